"""How the Slurm backend reaches its cluster: the seam between the adapter and the login node.

A :class:`Transport` runs a Slurm command (``sbatch``, ``squeue``, ``sacct``, ``scontrol``,
``scancel``) from an argument list — never through a shell — and reads and writes files on the
cluster's shared filesystem (the batch script, the job's output files). Two exist:

* :class:`LocalTransport`: the Celery worker runs on the login node (``subprocess`` and local files).
* :class:`cloud_adapters.slurm.ssh.SshTransport`: over SSH to a login node with a stored key
  (paramiko); the command line is quoted with :func:`shlex.join`, since SSH hands it to the remote
  user's shell.

Errors: a transport that cannot reach the cluster raises :class:`~cloud_adapters.base.ProviderError`
with ``transient=True`` (retried, never fails a job); one refused by authentication raises
:class:`~cloud_adapters.base.CredentialsError`. A command that ran and exited non-zero is *not* an
error here: its :class:`CommandResult` says so and the adapter decides.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import tempfile
from typing import Mapping, Protocol, Sequence

from cloud_adapters.base import ConnectionCheck, ProviderError

MAX_READ_BYTES = 4 * 1024 * 1024
"""The most bytes one :meth:`Transport.read_file` returns."""


@dataclasses.dataclass(frozen=True)
class CommandResult:
    """What one command printed and how it exited."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Transport(Protocol):
    """The adapter's only way to the cluster."""

    def run(self, argv: Sequence[str], *, input: bytes | None = None, timeout: float = 60.0,
            env: Mapping[str, str] | None = None) -> CommandResult:
        """Run ``argv`` (``argv[0]`` a command on the login node's PATH) and wait for it.

        ``env``: variables added to the command's environment (e.g. ``SLURM_CONF``). Raises
        ProviderError(transient=True) on a timeout or when the cluster cannot be reached."""

    def write_file(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Write ``data`` to absolute ``path`` atomically (temp file + rename), creating its parent
        directories (mode 0o700)."""

    def read_file(self, path: str, *, offset: int = 0, limit: int = MAX_READ_BYTES) -> bytes:
        """Up to ``limit`` bytes of ``path`` from byte ``offset``; raises FileNotFoundError when the
        file does not exist (yet)."""

    def close(self) -> None:
        """Release the connection, if any."""

    def check_connection(self) -> list[ConnectionCheck]:
        """The checks of the way to the cluster itself, for the backend's Test connection, before it
        runs any Slurm command (SSH: connection, host key, login); [] when there is nothing to check
        (this machine). Never raises for a failed check."""


class LocalTransport:
    """The worker is on the login node: commands by ``subprocess``, files on the local filesystem."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(env or {})
        """Variables every command gets on top of the worker's environment (e.g. ``SLURM_CONF``)."""

    def run(self, argv: Sequence[str], *, input: bytes | None = None, timeout: float = 60.0,
            env: Mapping[str, str] | None = None) -> CommandResult:
        full_env = {**os.environ, **self.env, **(env or {})}
        try:
            done = subprocess.run(list(argv), input=input, capture_output=True, timeout=timeout, env=full_env,
                                  check=False)
        except FileNotFoundError:
            raise ProviderError(f"{argv[0]} is not installed on this machine (is the worker on the Slurm login "
                                f"node, with the Slurm client on PATH?).") from None
        except subprocess.TimeoutExpired:
            raise ProviderError(f"{argv[0]} did not answer within {timeout:g} s; will retry.", transient=True) from None
        return CommandResult(done.returncode, done.stdout.decode("utf-8", "replace"),
                             done.stderr.decode("utf-8", "replace"))

    def write_file(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        parent = os.path.dirname(path)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def read_file(self, path: str, *, offset: int = 0, limit: int = MAX_READ_BYTES) -> bytes:
        with open(path, "rb") as fh:
            fh.seek(max(0, offset))
            return fh.read(max(0, min(limit, MAX_READ_BYTES)))

    def close(self) -> None:
        return None

    def check_connection(self) -> list[ConnectionCheck]:
        return []
