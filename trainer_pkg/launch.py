"""One entry for every backend: read the job's config and the platform's environment, then start the
trainer the way this machine needs.

    python -m trainer_pkg.launch --config job.json                    # any platform: detects it
    python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2   # this machine
    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.launch --config job.json
    python -m trainer_pkg.launch --config job.json --platform vertex  # skip detection
    python -m trainer_pkg.launch --config env:TRAINBOARD_JOB_CONFIG   # the JSON in a variable

What runs where (the platform is detected as in :mod:`trainer_pkg.platforms` and logged as
``[launch] platform: sagemaker (SM_HOSTS is set), node_rank 1 of 2 node(s) × 2 process(es) ...``):

==========  ==========================================================================================
torchrun    ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set: this process is one rank; train here.
sagemaker   ``SM_HOSTS``/``SM_CURRENT_HOST``: start torchrun --nnodes len(hosts) --node_rank (index of
            this host) --master_addr (first host) with one process per GPU (or parallel.procs_per_node
            on CPU); string hyperparameters parsed to the config's types; output → /opt/ml/model,
            checkpoints → /opt/ml/checkpoints, data → the ``train`` channel.
vertex      ``CLUSTER_SPEC`` + per-machine ``RANK``/``WORLD_SIZE``: start torchrun with per-process
            ranks; output → ``AIP_MODEL_DIR``, checkpoints → ``AIP_CHECKPOINT_DIR`` (gs:// via /gcs).
azureml     ``AZUREML_RUN_ID`` + per-process ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``: Azure started the
            ranks; train here. Output/checkpoints → the job's ``AZURE_ML_OUTPUT_<name>`` folders.
kubernetes  ``PET_NNODES``/``PET_NODE_RANK`` (Kubeflow Trainer's torch runtime, one pod per node):
            start torchrun --nnodes PET_NNODES --node_rank PET_NODE_RANK --master_addr
            PET_MASTER_ADDR --master_port PET_MASTER_PORT with PET_NPROC_PER_NODE processes.
slurm       ``SLURM_JOB_ID``/``SLURM_NODEID`` (one task per node that srun started): start torchrun
            --nnodes SLURM_NNODES --node_rank SLURM_NODEID --master_addr (the first host of
            SLURM_JOB_NODELIST) with ``--nproc-per-node`` (or SLURM_GPUS_ON_NODE) processes.
local       ``--standalone``: torchrun on this machine with ``--nproc-per-node`` processes (default
            ``parallel.procs_per_node``); nothing set: one process.
==========  ==========================================================================================

A user's script (``code.script``: ``train.py`` relative to ``code.dir``, or ``-m package.module``, with
``code.args``) runs instead of the trainer, the same way: torchrun starts it as ``python train.py
args`` in every rank where the table says torchrun is started; where the platform started the ranks
(azureml, torchrun) or the job is one process, this process runs it as a child and waits. Either way
it runs in ``code.dir`` (``sys.path``: the script's directory as Python puts it, then ``code.dir``, then
this package) with torchrun's ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, the job's
directories as ``TRAINBOARD_MODEL_DIR``, ``TRAINBOARD_CHECKPOINT_DIR``, ``TRAINBOARD_DATA_DIR``,
``TRAINBOARD_CODE_DIR``, the config's ``train`` values as the JSON object ``TRAINBOARD_HPARAMS``
(``{"train.lr": 0.01, ...}``: a sweep trial's sampled values reach the script there) and, for a continue
or fine-tune, ``TRAINBOARD_INIT_FROM`` (a local file: an object-store one is fetched first) and
``TRAINBOARD_INIT_MODE`` (:func:`trainboard_env`; our own trainer's ranks get them too), and its exit
code is the job's. ``{train.<field>}`` in ``code.args`` is replaced by that value, inside the argument
(:func:`trainer_pkg.config.expand_script_args`; an unknown field exits 2). It reports metrics with
:mod:`trainer_pkg.report` and reads those values with ``report.hparams()`` and ``report.init_from()``.

Every rank this launcher starts logs one line ``[launch] rank R (local rank L, node_rank N) of world
size W ...`` so a job's log shows the whole cluster. SIGTERM/SIGINT are passed on to torchrun (which
passes them to the ranks) or to the script this process runs; when the ranks stopped cleanly (a
checkpoint and a ``stopped`` record were written) the exit code is 0. A script run by this process
exits as it chooses; one under torchrun gets torchrun's code after a signal (1: torchrun does not
report its ranks' codes then).

Hang watch (:mod:`trainer_pkg.hang`): where this launcher starts the ranks of the node that holds rank 0
(torchrun under it, or the script as its child), a watchdog thread reads ``metrics.jsonl``; no new step
for the deadline (``TRAINBOARD_HANG_DEADLINE_S``, else from the recent step time, at least 10 minutes)
makes every rank write its threads' stacks (SIGUSR1, faulthandler, installed by the rank's entry:
:mod:`trainer_pkg.rank_entry` for a script) and prints one ``hang`` record per rank.

Network preflight (:mod:`trainer_pkg.preflight`): with ``TRAINBOARD_PREFLIGHT=1`` (the backend's
setting) every rank first measures the all-reduce bus bandwidth and latency and each node pair's
bandwidth, before our trainer's first step (here) or a script's first line (:mod:`trainer_pkg.rank_entry`),
and a network below the backend's minimum stops the run (exit code 3 per rank) with a ``preflight``
record naming the slow node or pair.

Hardware: every 5 s (``--hardware-every-s``, ``TRAINBOARD_HARDWARE_EVERY_S``; 0 turns it off) the
ranks' CPU %, resident memory and GPU figures and the node's network and disk rates are printed as
``hardware`` metric records (:mod:`trainer_pkg.hardware`): from a thread of this process when it
supervises torchrun or a script, off the training processes; from a thread of the rank's own process
when our trainer runs in it and no launcher of ours samples it (``TRAINBOARD_HARDWARE_SAMPLED``).

``--init-from PATH`` names where the platform put the file ``train.init_from`` names (a continue or
fine-tune from another job): Azure ML mounts an ``azureml://`` datastore path as an input of the job
and writes its local path into the command (``--init-from ${{inputs.init_from}}``), since the trainer
reads no ``azureml://`` URI. It replaces ``train.init_from`` for this run only; the config file keeps
the source's URI, and the log says both.

``--config env:NAME`` reads the JobConfig JSON from the environment variable ``NAME`` instead of a
file (a Kubernetes TrainJob passes it in ``trainer.env``, so no ConfigMap is needed) and writes it to
``trainboard-job.json`` in the working directory (the temporary directory when that is not writable),
which is then the config file, as if ``--config`` had named it.

Exit codes: 0 success (or a clean stop on SIGTERM), 1 training failed, 2 the config is invalid (for a
script: ``code.dir`` empty, or the file missing) or the platform's environment lacks or garbles a
variable (the message names it). A script's own exit code is passed on as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator, Mapping, Sequence

from trainer_pkg import hang, hardware, objstore, preflight, report, world_shape
from trainer_pkg.config import ConfigError, JobConfig, expand_script_args, script_hparams
from trainer_pkg.lifetime import die_with_parent
from trainer_pkg.metrics import exit_process, parse_metric_line, print_line, report_error
from trainer_pkg.platforms import (
    LAUNCHED_BY_US,
    PACKAGE_PARENT,
    PLATFORMS,
    LaunchPlan,
    PlatformError,
    cpu_threads_per_rank,
    plan as make_plan,
)

# Variables a platform or an outer launcher set that must not leak into the torchrun we start: it
# sets its own per-process values (Vertex's RANK/WORLD_SIZE count machines, not processes).
# Kubeflow Trainer's PET_* variables are torchrun's own defaults for its options: the launcher passes
# the options itself, so they go too.
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
              "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")

CONFIG_FROM_ENV = "env:"
"""``--config env:NAME``: the config's JSON is the value of the environment variable NAME."""
CONFIG_FROM_ENV_FILE = "trainboard-job.json"
"""Where ``--config env:NAME`` writes the JSON (in the working directory) for the rest of the run."""
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclasses.dataclass(frozen=True)
class UserScript:
    """The user's training script (``code.script``/``code.args``), checked and made absolute."""

    code_dir: str
    """Absolute directory of the unpacked code: the script's working directory, on its sys.path."""
    path: str = ""
    """Absolute path of the ``.py`` file; "" for a module."""
    module: str = ""
    """Dotted module name run as ``python -m``; "" for a file."""
    args: tuple[str, ...] = ()
    """The script's own arguments, ``{train.<field>}`` placeholders replaced (an argv list, never a shell)."""

    def argv(self) -> list[str]:
        """What follows the interpreter (or torchrun's options): ``[path, *args]`` or ``["-m", module, *args]``."""
        return (["-m", self.module] if self.module else [self.path]) + list(self.args)

    def describe(self) -> str:
        """``python train.py --lr 0.1`` as a person would type it (for the log only; never executed)."""
        shown = ["-m", self.module] if self.module else [os.path.relpath(self.path, self.code_dir)]
        return shlex.join(["python", *shown, *self.args])


def user_script(cfg: JobConfig) -> UserScript | None:
    """The script ``cfg.code`` asks to run instead of Trainboard's trainer; None when ``code.script`` is "".

    ``code.script`` is a ``.py`` file relative to ``code.dir`` (``train.py``, ``src/train.py``) or
    ``-m package.module``, with ``code.args`` whose ``{train.<field>}`` placeholders are replaced by
    the config's values; ``code.dir`` is absolute or relative to
    :data:`~trainer_pkg.platforms.PACKAGE_PARENT`. Raises :class:`ConfigError` naming the field when ``code.dir`` is empty or
    not a directory, the file is missing or lies outside ``code.dir``, the module name is malformed, or
    an argument names an unknown ``{train.<field>}``.
    """
    code = cfg.code
    spec = code.script.strip()
    if not spec:
        return None
    if not code.dir.strip():
        raise ConfigError(f"code.script is {spec!r} but code.dir is empty: set code.dir to the directory "
                          "holding the unpacked code")
    code_dir = os.path.normpath(os.path.join(PACKAGE_PARENT, code.dir))  # as LaunchPlan.resolve has it
    if not os.path.isdir(code_dir):
        raise ConfigError(f"code.dir {code_dir} is not a directory: the code archive was not unpacked there")
    args = tuple(expand_script_args(code.args, script_hparams(cfg)))
    if spec == "-m" or spec.startswith("-m ") or spec.startswith("-m\t"):
        module = spec[2:].strip()
        if not _MODULE_NAME.fullmatch(module):
            raise ConfigError(f"code.script {spec!r}: after -m give a dotted module name such as "
                              "'-m mypkg.train'")
        return UserScript(code_dir=code_dir, module=module, args=args)
    if os.path.isabs(spec):
        raise ConfigError(f"code.script {spec!r} must be a path relative to code.dir, e.g. 'train.py'")
    path = os.path.realpath(os.path.join(code_dir, spec))
    if os.path.commonpath([path, os.path.realpath(code_dir)]) != os.path.realpath(code_dir):
        raise ConfigError(f"code.script {spec!r} points outside code.dir {code_dir}")
    if not os.path.isfile(path):
        raise ConfigError(f"code.script {spec!r}: no such file in code.dir {code_dir}")
    return UserScript(code_dir=code_dir, path=path, args=args)


_TRAINBOARD_VARS = (report.MODEL_DIR, report.CHECKPOINT_DIR, report.DATA_DIR, report.CODE_DIR, report.HPARAMS,
                    report.INIT_FROM, report.INIT_MODE)
"""The variables :func:`trainboard_env` sets: an outer environment's values of them never reach a rank."""


def trainboard_env(cfg: JobConfig) -> dict[str, str]:
    """Trainboard's variables for every rank, from ``cfg`` as :meth:`LaunchPlan.resolve` left it:
    ``TRAINBOARD_MODEL_DIR`` (``output.output_dir``), ``TRAINBOARD_CHECKPOINT_DIR``
    (``output.resolved_checkpoint_dir``), ``TRAINBOARD_DATA_DIR`` (``data.uri``),
    ``TRAINBOARD_CODE_DIR`` (``code.dir``), ``TRAINBOARD_INIT_FROM`` (``train.init_from``) and
    ``TRAINBOARD_INIT_MODE`` (``train.init_mode``); the per-platform table is in docs/user-code.md.
    ``TRAINBOARD_HPARAMS``: the JSON object of :func:`trainer_pkg.config.script_hparams`
    (``{"train.epochs": 3, "train.lr": 0.05, ...}``, keys sorted).

    Local paths are made absolute (a script runs in ``code.dir``, not where the launcher was started);
    a URI is passed as it is; a variable whose value would be "" is left out (a built-in dataset has no
    path, a job from scratch no init file).
    """
    values = {report.MODEL_DIR: cfg.output.output_dir, report.CHECKPOINT_DIR: cfg.output.resolved_checkpoint_dir,
              report.DATA_DIR: cfg.data.uri, report.CODE_DIR: cfg.code.dir, report.INIT_FROM: cfg.train.init_from}
    out = {name: value if "://" in value else os.path.abspath(value)
           for name, value in values.items() if value.strip()}
    if cfg.train.init_mode:
        out[report.INIT_MODE] = cfg.train.init_mode
    out[report.HPARAMS] = json.dumps(script_hparams(cfg), sort_keys=True)
    return out


def _with_trainboard_env(env: Mapping[str, str], cfg: JobConfig) -> dict[str, str]:
    """``env`` with Trainboard's variables for ``cfg``; ones an outer environment set that this job
    has no value for are dropped, so a rank never reads another job's directory or init file."""
    out = {k: v for k, v in env.items() if k not in _TRAINBOARD_VARS}
    out.update(trainboard_env(cfg))
    return out


INIT_FETCH_CHUNK = 64 << 20
"""Bytes per ranged read when :func:`fetch_init_file` copies an object-store file (memory: one chunk)."""


def fetch_init_file(cfg: JobConfig, directory: str | None = None) -> JobConfig:
    """For a script: ``cfg`` with an object-store ``train.init_from`` (``s3://``, ``gs://``, ``az://``:
    a source job's file on another cloud prefix) copied to a local file in a new temporary directory
    under ``directory`` (default the system's) and named there, so ``TRAINBOARD_INIT_FROM`` is always a
    file the script opens; ``cfg`` itself when ``init_from`` is "" or already local. Read with the
    platform's credentials (:mod:`trainer_pkg.objstore`), in chunks of :data:`INIT_FETCH_CHUNK`.
    Raises :class:`ConfigError` naming the URI when it cannot be read."""
    source = cfg.train.init_from
    if not source or not objstore.is_remote(source):
        return cfg
    try:
        store, key = objstore.store(source)
        size = store.size(key)
        local = os.path.join(tempfile.mkdtemp(prefix="trainboard-init-", dir=directory),
                             os.path.basename(key) or "init.pt")
        with open(local, "wb") as f:
            for offset in range(0, size, INIT_FETCH_CHUNK):
                f.write(store.read(key, offset, min(INIT_FETCH_CHUNK, size - offset)))
    except FileNotFoundError:
        raise ConfigError(f"train.init_from {source}: no such object (the source job's file was deleted?)") from None
    except OSError as exc:
        raise ConfigError(f"train.init_from {source} cannot be copied to a local file: {exc}") from None
    data = cfg.to_dict()
    data["train"]["init_from"] = local
    return JobConfig.from_dict(data)


def _script_pythonpath(env: Mapping[str, str], script: UserScript | None) -> str:
    """PYTHONPATH for the processes we start: for a script its code directory first (after the
    script's own directory, which Python puts in front), then this package's parent (the package may
    be run from a checkout rather than installed; an archive cannot shadow it: members named
    ``trainer_pkg/`` are refused), then the caller's."""
    parts = [script.code_dir if script else "", PACKAGE_PARENT, env.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def with_init_from(cfg: JobConfig, path: str) -> JobConfig:
    """``cfg`` with ``train.init_from`` = ``path`` (``--init-from``: where the platform mounted the
    file the config names). Raises :class:`ConfigError` when the config starts from nothing (no
    ``train.init_mode``) or ``path`` is empty: a mount for a job that did not ask for one is a mistake
    in the command, not something to train from."""
    if not path.strip():
        raise ConfigError("--init-from: empty path; the platform names the mounted file there")
    if not cfg.train.init_mode:
        raise ConfigError(f"--init-from {path}: the config starts from scratch (no train.init_mode); set "
                          f"train.init_from and train.init_mode (continue or finetune), or drop --init-from")
    data = cfg.to_dict()
    data["train"]["init_from"] = path
    return world_shape.validate(JobConfig.from_dict(data))


def read_config(path: str) -> JobConfig:
    """The validated JobConfig in the JSON file ``path``; :class:`ConfigError` saying what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    return world_shape.validate(JobConfig.from_json(text))


def config_from_env(spec: str, env: Mapping[str, str], directory: str | None = None) -> str:
    """For ``--config env:NAME``: check that ``env[NAME]`` is a JSON object, write it atomically to
    :data:`CONFIG_FROM_ENV_FILE` in ``directory`` (default the working directory; the temporary
    directory when that cannot be written) and return the file's path. Raises :class:`ConfigError`
    when NAME is not a variable name, is unset or empty, or does not hold a JSON object."""
    name = spec[len(CONFIG_FROM_ENV):]
    if not _ENV_NAME.fullmatch(name):
        raise ConfigError(f"--config env:NAME needs an environment variable name, got {name!r}")
    text = env.get(name, "")
    if not text.strip():
        raise ConfigError(f"environment variable {name} is not set (or empty); it must hold the job's "
                          "JobConfig as JSON")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"environment variable {name} is not valid JSON: {exc} (value {text[:200]!r})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"environment variable {name} must hold a JSON object, got {type(data).__name__}")
    last_error: OSError | None = None
    for where in (directory or os.getcwd(), tempfile.gettempdir()):
        try:
            fd, tmp = tempfile.mkstemp(prefix=".trainboard-job-", suffix=".json", dir=where)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            path = os.path.join(where, CONFIG_FROM_ENV_FILE)
            os.replace(tmp, path)
            return path
        except OSError as exc:
            last_error = exc
    raise ConfigError(f"cannot write the config from {name} to a file: {last_error}")


def torchrun_command(config_path: str, plan: LaunchPlan, *, python: str = sys.executable,
                     script: UserScript | None = None) -> list[str]:
    """The torchrun argument list that starts ``plan``'s ranks of this node, each running this
    launcher on ``config_path`` — or, with ``script``, the user's script (``path args`` or ``-m module
    args``: torchrun runs it as ``python path args`` in every rank): ``--standalone`` for one node, else
    a static rendezvous at the master with this node's rank (as SageMaker's toolkit does, clouds.md
    §1.6). ``python`` is the interpreter that has torch (the GPU box's may differ from the worker's own)."""
    cmd = [python, "-m", "torch.distributed.run", "--nnodes", str(plan.nnodes),
           "--nproc_per_node", str(plan.nproc_per_node)]
    if plan.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += ["--node_rank", str(plan.node_rank), "--master_addr", plan.master_addr,
                "--master_port", str(plan.master_port)]
    if script is not None:
        return cmd + [*_SCRIPT_ENTRY, *script.argv()]
    return cmd + ["-m", "trainer_pkg.launch", "--config", config_path]


def torchrun_env(plan: LaunchPlan, env: Mapping[str, str]) -> dict[str, str]:
    """The environment for :func:`torchrun_command`, from ``env`` (this process's, as a rule).

    Another launcher's rank variables are dropped (torchrun sets its own per process; Vertex's
    RANK/WORLD_SIZE count machines), ``plan.extra_env`` is added, the ranks are marked as started
    by this launcher (so they train in process whatever else the machine's environment says), and
    ``OMP_NUM_THREADS`` is :func:`~trainer_pkg.platforms.cpu_threads_per_rank` unless ``env`` sets
    it. ``PYTHONPATH`` is the caller's: it knows where the package comes from.
    """
    out = {k: v for k, v in env.items() if k not in _RANK_VARS}
    out.update(plan.extra_env)
    out[LAUNCHED_BY_US] = plan.platform
    if "OMP_NUM_THREADS" not in out:
        out["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(plan.nproc_per_node))
    return out


def run_torchrun(cfg: JobConfig, config_path: str, plan: LaunchPlan, script: UserScript | None = None, *,
                 hardware_every_s: float = 0.0) -> int:
    """Start torchrun for ``plan`` on this node (ranks running our trainer, or ``script`` in
    ``script.code_dir``) and wait for it; returns the exit code to use. ``hardware_every_s`` > 0:
    this process samples the node's ranks that often (:mod:`trainer_pkg.hardware`)."""
    env = _with_trainboard_env(torchrun_env(plan, os.environ), cfg)
    env["PYTHONPATH"] = _script_pythonpath(env, script)
    env.pop(hardware.SAMPLED_ENV, None)
    if hardware_every_s > 0:
        env[hardware.SAMPLED_ENV] = "1"  # this process samples them
    if script is not None:  # the mark tells our own ranks their config is resolved; a script has none
        env.pop(LAUNCHED_BY_US)
    started = time.time()
    cmd = torchrun_command(os.path.abspath(config_path), plan, script=script)
    with watch_for_hangs(cfg, env, plan.world_size, watching=plan.node_rank == 0):
        code, signalled = _supervise(cmd, env, cwd=script.code_dir if script else None,
                                     sampler=_node_sampler(plan, env, hardware_every_s))
    if signalled and code != 0 and _stopped_cleanly(cfg, since=started):
        # torchrun itself exits 1 after forwarding a signal even when every rank exited 0.
        return 0
    return code


def run_script_here(cfg: JobConfig, plan: LaunchPlan, script: UserScript, *, hardware_every_s: float = 0.0) -> int:
    """Run ``script`` as this process's rank (the platform started the ranks, or the job is one
    process) and wait for it; returns its exit code (128 + N when signal N ended it).
    ``hardware_every_s`` > 0: this process samples the script's process that often
    (:mod:`trainer_pkg.hardware`; the node's figures from local rank 0's launcher only).

    It runs as ``python path args`` (or ``-m module``) in ``code_dir``, with torchrun's variables
    (:func:`rank_env`), Trainboard's directories and the plan's extra variables.
    """
    env = _with_trainboard_env(rank_env(plan, os.environ), cfg)
    env.update(plan.extra_env)
    env.pop(LAUNCHED_BY_US, None)
    env["PYTHONPATH"] = _script_pythonpath(env, script)
    node_fields = env.get("LOCAL_RANK", "0") == "0"
    with watch_for_hangs(cfg, env, int(env["WORLD_SIZE"]) if env["WORLD_SIZE"].isdigit() else 1,
                         watching=env.get("RANK") == "0"):
        code, _ = _supervise([sys.executable, *_SCRIPT_ENTRY, *script.argv()], env, cwd=script.code_dir,
                             sampler=_node_sampler(plan, env, hardware_every_s, node_fields=node_fields))
    return 128 - code if code < 0 else code


def run_framework(cfg: JobConfig, plan: LaunchPlan, script: UserScript, *, hardware_every_s: float = 0.0) -> int:
    """Start ``script`` under ``cfg.code.framework`` (tensorflow, ray or mpi: a module of
    :mod:`trainer_pkg.frameworks`, imported now) on this node or rank and wait for it; the exit code
    to report. Raises :class:`ConfigError` naming ``code.framework`` when this launcher has no module
    for it."""
    name = f"trainer_pkg.frameworks.{cfg.code.framework}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise ConfigError(f"code.framework: this launcher cannot start a {cfg.code.framework} script") from None
    return module.run(cfg, plan, script, hardware_every_s=hardware_every_s)


_SCRIPT_ENTRY = ("-m", "trainer_pkg.rank_entry")
"""What runs a script's rank: :mod:`trainer_pkg.rank_entry` installs the hang dump, then runs it as python would."""


@contextlib.contextmanager
def watch_for_hangs(cfg: JobConfig, env: dict[str, str], world_size: int, *, watching: bool) -> Iterator[None]:
    """While the ranks run: with ``watching`` (this node holds rank 0, whose records land in
    ``<output_dir>/metrics.jsonl``) a :class:`trainer_pkg.hang.Watchdog` thread, and ``env`` (the
    ranks' environment, changed in place) naming its directory in ``TRAINBOARD_HANG_DIR`` so each rank
    installs its stack dump; the directory is removed afterwards. Without ``watching``, or when the
    deadline variable is ``0``, or no temporary directory can be made: nothing."""
    env.pop(hang.HANG_DIR, None)  # an outer launcher's directory is not ours to signal from
    if not watching or hang.deadline_s([], env) == 0:
        yield
        return
    try:
        directory = tempfile.mkdtemp(prefix="trainboard-hang-")
    except OSError:
        yield
        return
    env[hang.HANG_DIR] = directory
    watchdog = hang.Watchdog(os.path.join(cfg.output.output_dir, "metrics.jsonl"), directory,
                             world_size=world_size, env=env)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.stop()
        watchdog.join(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def _node_sampler(plan: LaunchPlan, env: Mapping[str, str], every_s: float, *,
                  node_fields: bool = True) -> Callable[[int], hardware.Sampler | None]:
    """What :func:`_supervise` calls with its child's pid to start sampling the ranks under it
    (GPUs as the child's ``CUDA_VISIBLE_DEVICES`` shows them)."""
    return lambda pid: hardware.start(pid, interval_s=every_s, env=env, node_rank=plan.node_rank,
                                      node_fields=node_fields)


def rank_env(plan: LaunchPlan, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` all set for a process that runs in place.

    Ranks the platform started keep the values it gave (Azure ML's per-process ones) and get the
    missing ones from ``plan`` (Azure sets no ``LOCAL_WORLD_SIZE``). A job of one process gets rank 0
    of 1 and a free port on 127.0.0.1, so ``init_process_group("env://")`` works there too; another
    launcher's per-machine values (Vertex's RANK/WORLD_SIZE of one replica) are replaced.
    """
    if not plan.in_process:
        out = {k: v for k, v in env.items() if k not in _RANK_VARS}
        out.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
        return out
    out = dict(env)
    defaults = {"LOCAL_WORLD_SIZE": str(plan.nproc_per_node), "MASTER_ADDR": plan.master_addr or "127.0.0.1",
                "MASTER_PORT": str(plan.master_port or _free_port())}
    for name, value in defaults.items():
        if not out.get(name, "").strip():
            out[name] = value
    return out


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the rendezvous of a job of one process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _supervise(cmd: list[str], env: Mapping[str, str], cwd: str | None,
               sampler: Callable[[int], hardware.Sampler | None] | None = None) -> tuple[int, list[int]]:
    """Run ``cmd`` and wait for it, passing SIGTERM/SIGINT on; (its exit code, the signals passed on).
    ``sampler``: called with the child's pid once it is started; the sampler it returns (if any) is
    stopped when the child has exited.

    The child gets its own session so a signal to our process group reaches it once, from us: a
    second SIGTERM while torchrun is shutting its ranks down would cut that shutdown short.
    """
    proc = subprocess.Popen(cmd, env=dict(env), cwd=cwd, start_new_session=True,
                            preexec_fn=die_with_parent(signal.SIGTERM))
    signalled: list[int] = []

    def forward(signum, frame) -> None:
        signalled.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    sampling = None
    try:
        sampling = sampler(proc.pid) if sampler is not None else None
        code = proc.wait()
    finally:
        if proc.poll() is None:  # we are leaving on an exception: do not orphan the ranks
            proc.kill()
            proc.wait()
        if sampling is not None:
            sampling.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, signalled


def _last_record(cfg: JobConfig) -> dict:
    """The last metric record in ``metrics.jsonl`` ({} when there is none)."""
    path = os.path.join(cfg.output.output_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = parse_metric_line(line)
        if isinstance(record, dict) and "event" in record:
            return record
    return {}


def _stopped_cleanly(cfg: JobConfig, since: float) -> bool:
    """Whether this run's last metric record is ``stopped`` (written after its checkpoint)."""
    record = _last_record(cfg)
    return record.get("event") == "stopped" and record.get("time", 0) >= since


def failure_message(cfg: JobConfig, code: int, since: float) -> str:
    """The failure reason of a run started at ``since`` (Unix time) that exited ``code`` (≠ 0): the
    trainer's own when it stopped the run itself (a ``failed`` record of this run, its ``reason``,
    e.g. "loss became NaN at step 12"), or the preflight's (a ``preflight`` record with a reason), else the exit code and where the ranks' errors are."""
    record = _last_record(cfg)
    if (record.get("event") == "failed" and isinstance(record.get("reason"), str)
            and record.get("time", 0) >= since):
        return f"{record['reason']} (training failed with exit code {code})"
    if (record.get("event") == preflight.EVENT and record.get("reason") and isinstance(record["reason"], str)
            and record.get("time", 0) >= since):
        return f"{record['reason']} (exit code {code})"
    if cfg.code.script.strip():
        return (f"the script {cfg.code.script.strip()} failed with exit code {code}; its traceback or "
                "error is in the job's log")
    return (f"training failed with exit code {code}; the ranks' errors ('trainer error: ...') are in "
            "the job's log")


def _resolved_config_file(cfg: JobConfig) -> str:
    """The resolved config written for the ranks this launcher starts (removed when they are done)."""
    fd, path = tempfile.mkstemp(prefix="trainboard-job-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(cfg.to_json())
    return path


def _log_rank(plan_platform: str) -> None:
    """One line per rank, so the job's log shows where every process sits."""
    env = os.environ
    print_line(f"[launch] rank {env.get('RANK')} (local rank {env.get('LOCAL_RANK')}, node_rank "
               f"{env.get('GROUP_RANK', env.get('NODE_RANK', '?'))}) of world size {env.get('WORLD_SIZE')}, "
               f"platform {plan_platform}, master {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}")


def _write_failure(path: str | None, message: str) -> None:
    """Leave ``message`` where the platform shows it as the job's failure reason (SageMaker)."""
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(message[:1024])
    except OSError:
        pass  # best effort: the same message is on stderr, which the platform logs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer_pkg.launch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run a Trainboard training job from its JobConfig JSON on whatever platform this is.\n\n"
            "auto-detection (first match wins):\n"
            "  torchrun   RANK, LOCAL_RANK, WORLD_SIZE set       -> this process is one rank\n"
            "  azureml    AZUREML_RUN_ID (+ per-process RANK...) -> Azure started the ranks; train here\n"
            "  sagemaker  SM_HOSTS / SM_CURRENT_HOST             -> torchrun over the job's hosts\n"
            "  vertex     CLUSTER_SPEC (+ per-machine RANK...)   -> torchrun over the job's machines\n"
            "  kubernetes PET_NNODES, PET_NODE_RANK (TrainJob)   -> torchrun over the TrainJob's pods\n"
            "  local      --standalone                           -> torchrun on this machine\n"
            "             nothing set                            -> one process\n\n"
            "On a cloud the platform's directories replace the config's: model/output, checkpoints\n"
            "and data (SageMaker /opt/ml/..., Vertex AIP_MODEL_DIR/AIP_CHECKPOINT_DIR, Azure\n"
            "AZURE_ML_OUTPUT_<name>); SageMaker hyperparameters (strings) override config fields.\n\n"
            "With code.script set (train.py in code.dir, or -m package.module) the user's script runs\n"
            "instead of the trainer, with code.args, in code.dir, on every rank: torchrun's RANK,\n"
            "LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and TRAINBOARD_MODEL_DIR,\n"
            "TRAINBOARD_CHECKPOINT_DIR, TRAINBOARD_DATA_DIR, TRAINBOARD_CODE_DIR, TRAINBOARD_HPARAMS\n"
            "(the train section as JSON) and, to continue or fine-tune, TRAINBOARD_INIT_FROM and\n"
            "TRAINBOARD_INIT_MODE are set; {train.<field>} in code.args becomes that value."
        ),
        epilog="exit codes: 0 done (or stopped cleanly by SIGTERM, resumable), 1 training failed, "
               "2 invalid config or platform environment (the message names the variable); a script's "
               "own exit code otherwise. "
               "Example: python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2",
    )
    p.add_argument("--config", required=True, metavar="JOB_JSON",
                   help="the job's JobConfig as JSON (missing fields take their defaults): a file, or "
                        "env:NAME for the JSON in environment variable NAME (written to "
                        f"./{CONFIG_FROM_ENV_FILE} for the ranks)")
    p.add_argument("--platform", choices=("auto",) + PLATFORMS, default="auto",
                   help="where this runs; auto (default) detects it from the environment")
    p.add_argument("--standalone", action="store_true",
                   help="start torchrun on this machine alone (single node) and wait for it")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="processes per node (default: one per GPU, else the config's parallel.procs_per_node)")
    p.add_argument("--init-from", metavar="PATH",
                   help="where the platform put the file train.init_from names (Azure ML: "
                        "${{inputs.init_from}}, the source job's file mounted read-only); replaces "
                        "train.init_from for this run")
    p.add_argument("--hardware-every-s", type=float, metavar="SECONDS",
                   help=f"seconds between two samples of the ranks' CPU, memory, GPUs and the node's "
                        f"network and disk, printed as metric records (default ${hardware.EVERY_ENV} or "
                        f"{hardware.DEFAULT_EVERY_S:g}; 0: off)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.time()
    plan: LaunchPlan | None = None
    try:
        config_path = args.config
        if config_path.startswith(CONFIG_FROM_ENV):
            config_path = config_from_env(config_path, os.environ)
        cfg = read_config(config_path)
        source = cfg.train.init_from
        if args.init_from is not None:
            cfg = with_init_from(cfg, args.init_from)
        plan = make_plan(os.environ, cfg, platform=args.platform, nproc=args.nproc_per_node,
                         standalone=args.standalone)
        try:
            cfg = plan.resolve(cfg)
        except ConfigError as exc:
            source = " (SageMaker hyperparameters)" if plan.hyperparameters else ""
            raise ConfigError(f"{plan.platform}{source}: {exc}") from None
    except PlatformError as exc:
        report_error(str(exc))
        _write_failure(exc.failure_file, str(exc))
        return 2
    except ConfigError as exc:
        report_error(f"invalid config {args.config}: {exc}")
        _write_failure(plan and plan.failure_file, f"invalid config: {exc}")
        return 2
    try:
        every_s = hardware.every_s(args.hardware_every_s, os.environ)
    except ValueError as exc:
        report_error(str(exc))
        _write_failure(plan.failure_file, str(exc))
        return 2

    try:
        script = user_script(cfg)
        if script is not None:
            fetched_from = cfg.train.init_from
            cfg = fetch_init_file(cfg)
    except ConfigError as exc:
        report_error(f"invalid config {args.config}: {exc}")
        _write_failure(plan.failure_file, f"invalid config: {exc}")
        return 2

    ours = os.environ.get(LAUNCHED_BY_US)  # set in the ranks we started: their node launcher logged
    node_leader = not ours and not (plan.in_process and os.environ.get("LOCAL_RANK", "0") != "0")
    if node_leader:
        framework = cfg.code.framework if script is not None else "torch"
        starter = "torchrun" if framework == "torch" else f"trainer_pkg.frameworks.{framework}"
        print_line(f"[launch] {plan.describe(starter)}")
        if args.init_from is not None:
            print_line(f"[launch] train.init_from {source} is read from {cfg.train.init_from} "
                       f"(--init-from)")
        if script is not None:
            sha = f", code sha256 {cfg.code.sha256}" if cfg.code.sha256 else ""
            print_line(f"[launch] running the user's script instead of the trainer: {script.describe()} "
                       f"(in {script.code_dir}{sha})")
            if cfg.train.init_from:
                fetched = f" (fetched from {fetched_from})" if fetched_from != cfg.train.init_from else ""
                print_line(f"[launch] the script starts from {cfg.train.init_from}{fetched}: "
                           f"{report.INIT_FROM}, {report.INIT_MODE}={cfg.train.init_mode}")

    if ours and os.environ.get(hardware.SAMPLED_ENV) == "1":
        every_s = 0.0  # a rank of a torchrun our launcher started and samples
    if script is not None and cfg.code.framework != "torch":
        try:  # TensorFlow, Ray or MPI: how its processes start is the framework's (trainer_pkg.frameworks)
            code = run_framework(cfg, plan, script, hardware_every_s=every_s)
        except ConfigError as exc:
            report_error(str(exc))
            _write_failure(plan.failure_file, str(exc))
            return 2
    elif plan.in_process:
        _log_rank(f"{ours} via torchrun" if ours else plan.platform)
        if script is not None:
            code = run_script_here(cfg, plan, script, hardware_every_s=every_s)
        else:
            _set_environ(_with_trainboard_env(rank_env(plan, {**os.environ, **plan.extra_env}), cfg))
            hang.install_rank_dump()  # a rank torchrun started for our launcher: its stacks on SIGUSR1
            # The network preflight (off unless the backend turned it on), before the trainer's first step.
            code = preflight.maybe_run(cfg.parallel.dist_backend)
            if code is None:
                code = _train_sampled(cfg, plan, every_s)
    elif plan.world_size == 1:
        if script is not None:
            code = run_script_here(cfg, plan, script, hardware_every_s=every_s)
        else:
            # Vertex's per-machine RANK=0/WORLD_SIZE=1 and the like: one process is not a process group.
            _set_environ(_with_trainboard_env({k: v for k, v in os.environ.items() if k not in _RANK_VARS}, cfg))
            code = _train_sampled(cfg, plan, every_s)
    else:  # this process only supervises torchrun: it never imports torch
        path = _resolved_config_file(cfg)
        try:
            code = run_torchrun(cfg, path, plan, script, hardware_every_s=every_s)
        finally:
            os.unlink(path)
    _finish(plan, cfg, code, started)
    return code


def _set_environ(env: Mapping[str, str]) -> None:
    """Make this process's environment ``env`` (for our trainer, which runs in this process)."""
    for name in set(os.environ) - set(env):
        del os.environ[name]
    os.environ.update(env)


def _train_sampled(cfg: JobConfig, plan: LaunchPlan, every_s: float) -> int:
    """:func:`_train` with this process sampled every ``every_s`` seconds by a thread of its own: the
    rank trains in this process (a one-process job, or ranks another launcher started), so there is
    no other process to sample it from; the node's figures from local rank 0 only."""
    rank = os.environ.get("RANK", "0")
    sampler = hardware.start(os.getpid(), interval_s=every_s, env=os.environ, node_rank=plan.node_rank,
                             node_fields=os.environ.get("LOCAL_RANK", "0") == "0",
                             self_rank=int(rank) if rank.isdigit() else 0)
    try:
        return _train(cfg)
    finally:
        if sampler is not None:
            sampler.stop()


def _train(cfg: JobConfig) -> int:
    from trainer_pkg import train  # imports torch: only now that config and platform are known good

    return train.train(cfg)


def _finish(plan: LaunchPlan, cfg: JobConfig, code: int, started: float) -> None:
    """After training on this node: copy the metrics where the platform collects outputs, or leave
    the failure reason where the platform shows it."""
    if code != 0:
        _write_failure(plan.failure_file, failure_message(cfg, code, started))
        return
    first = os.environ.get("RANK") == "0" if plan.in_process else plan.node_rank == 0
    metrics = os.path.join(cfg.output.output_dir, "metrics.jsonl")
    if plan.output_data_dir and first and os.path.isfile(metrics):
        os.makedirs(plan.output_data_dir, exist_ok=True)
        shutil.copy(metrics, os.path.join(plan.output_data_dir, "metrics.jsonl"))


if __name__ == "__main__":
    exit_process(main())
