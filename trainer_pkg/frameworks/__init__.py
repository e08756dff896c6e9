"""How the launcher starts a user's script that is not a torch one (``code.framework``, docs/user-code.md).

``torch`` is :mod:`trainer_pkg.launch`'s own path (torchrun's ranks). Each other framework is a module
of this package named after it (``tensorflow``, ``ray``, ``mpi``) with one function::

    run(cfg: JobConfig, plan: LaunchPlan, script: UserScript, *, hardware_every_s: float) -> int

called by :func:`trainer_pkg.launch.main` on every process the platform (or our own torchrun) started
for the job, after the config and the platform are known good: ``plan.in_process`` says whether this
process is one rank of many (its ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set) or a node's launcher.
It keeps the cluster shape the plan worked out and changes only how the script's processes start;
it returns the exit code the node reports (0 only when every process it started exited 0) and stops
every process it started, by PID, before it returns.

:func:`trainer_pkg.launch.run_framework` imports a framework's module only for a job that names it
(its own imports are heavy, and it uses the launcher's helpers: the launcher never imports it at the top).
"""


from __future__ import annotations

from collections.abc import Mapping

from trainer_pkg.config import ConfigError


def setting_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A framework's timing setting from the launcher's environment (the installation's, never a
    job's): ``env[name]`` in seconds, ``default`` when unset or blank. Raises :class:`ConfigError`
    naming ``name`` when it is not a number above 0."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ConfigError(f"{name} must be a number of seconds above 0, got {raw!r}")
    return value
