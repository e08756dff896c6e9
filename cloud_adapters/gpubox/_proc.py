"""Process facts read from ``/proc`` and small on-disk helpers shared by the backend and the supervisor.

Kept free of torch and Django: the supervisor imports this at start-up, and the web process and the
Celery worker import it on every sync.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, pgrp, starttime)`` of ``pid`` from ``/proc/<pid>/stat``, or None if there is none.

    ``starttime`` is in clock ticks since boot (proc(5), field 22); with the pid it identifies one
    process for its whole life, so a recorded ``(pid, starttime)`` never matches a later process that
    happens to reuse the pid.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ")".
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[2]), int(rest[19])
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    stat = proc_stat(pid)
    return stat[2] if stat else None


def is_alive(pid: int | None, ticks: int | None) -> bool:
    """True if the process recorded as ``(pid, ticks)`` still runs (a zombie counts as gone)."""
    if not pid:
        return False
    stat = proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return ticks is None or stat[2] == ticks


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = proc_stat(int(entry.name))
        if stat and stat[1] == pgid and stat[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


RUN_TAG_VAR = "TRAINBOARD_GPUBOX_RUN"
"""Set to the run directory in the environment of the supervisor and, by inheritance, of torchrun
and every rank. torchrun starts each rank in a session of its own, so torchrun's process group does
not reach the ranks; this tag does, even after torchrun or the supervisor died."""


def job_processes(run_dir: str, exclude: int | None = None) -> list[int]:
    """Pids of live processes whose environment carries ``RUN_TAG_VAR=<run_dir>`` (ours only)."""
    needle = f"{RUN_TAG_VAR}={run_dir}\0".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:  # gone, or another user's process
            continue
        if (b"\0" + environ).find(b"\0" + needle) < 0:
            continue
        stat = proc_stat(int(entry.name))
        if stat and stat[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def signal_job(run_dir: str, sig: int, exclude: int | None = None) -> int:
    """Send ``sig`` to every process of the job (see :data:`RUN_TAG_VAR`); how many were signalled."""
    count = 0
    for pid in job_processes(run_dir, exclude):
        try:
            os.kill(pid, sig)
            count += 1
        except ProcessLookupError:
            pass
    return count


def kill_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # the group id was reused by someone else's process
        return False


def signal_pid(pid: int, ticks: int | None, sig: int = signal.SIGTERM) -> bool:
    """Signal ``pid`` only if it is still the process recorded with ``ticks``."""
    if not is_alive(pid, ticks):
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is absent or not (yet) a whole JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def chown_tree(path: Path, uid: int, gid: int) -> None:
    """Give ``path`` and everything under it to ``uid:gid`` (links themselves, never their targets)."""
    os.lchown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)
