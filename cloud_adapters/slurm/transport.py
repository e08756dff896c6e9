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
import posixpath
import stat
import subprocess
import tempfile
from typing import BinaryIO, Mapping, Protocol, Sequence

from cloud_adapters.base import ConnectionCheck, ProviderError

MAX_READ_BYTES = 4 * 1024 * 1024
"""The most bytes one :meth:`Transport.read_file` returns."""
MAX_LISTED_FILES = 10_000
"""The most files one :meth:`Transport.list_files` returns (a job that wrote more shows the first ones)."""


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A regular file under a directory, as :meth:`Transport.list_files` finds it."""

    path: str  # relative to the directory listed, '/'-separated
    size_bytes: int
    mtime: float  # seconds since the epoch


def link_under(root: str, path: str, lstat) -> bool:
    """Whether ``root`` or any part of ``path`` below it is a symbolic link (``lstat`` of the
    transport: os.lstat or SFTP's); a missing part raises FileNotFoundError. ``path`` lies under ``root``."""
    rel = posixpath.relpath(path, root)
    if rel == ".." or rel.startswith("../") or posixpath.isabs(rel):
        return True
    current = root
    for part in [""] + ([] if rel == "." else rel.split("/")):
        current = posixpath.join(current, part) if part else current
        if stat.S_ISLNK(lstat(current).st_mode):
            return True
    return False


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

    def list_files(self, root: str, *, recursive: bool = True) -> list[FileEntry]:
        """Every regular file under the absolute directory ``root`` (only its own with ``recursive`` False) (at most :data:`MAX_LISTED_FILES`),
        sorted by path; symbolic links are neither followed nor listed (a job's code could point one
        at any file of the cluster); [] when ``root`` is missing or is itself a link."""

    def open_file(self, path: str, *, root: str) -> BinaryIO:
        """``path`` (a file under ``root``) opened for reading; the caller closes it. Raises
        FileNotFoundError when it is missing, PermissionError when ``root`` or a part of ``path``
        is a symbolic link."""

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

    def list_files(self, root: str, *, recursive: bool = True) -> list[FileEntry]:
        if not os.path.isdir(root) or os.path.islink(root):
            return []
        found: list[FileEntry] = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if recursive and not os.path.islink(os.path.join(dirpath, d)))
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue  # removed while listed
                if stat.S_ISREG(st.st_mode):
                    found.append(FileEntry(os.path.relpath(full, root).replace(os.sep, "/"), st.st_size, st.st_mtime))
                    if len(found) >= MAX_LISTED_FILES:
                        return sorted(found, key=lambda f: f.path)
        return sorted(found, key=lambda f: f.path)

    def open_file(self, path: str, *, root: str) -> BinaryIO:
        if link_under(root, path, os.lstat):
            raise PermissionError(f"{path}: a symbolic link on the way; not opened")
        return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")

    def close(self) -> None:
        return None

    def check_connection(self) -> list[ConnectionCheck]:
        return []
