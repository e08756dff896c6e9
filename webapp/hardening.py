"""Keep a process's secrets out of reach of the training jobs that run beside it.

A GPU box's jobs run user code. Where they run as the same OS user as a Celery worker (the default of
``TRAINBOARD_GPUBOX_RUN_AS``; in docker-compose.yml the runner's uid, in the worker's PID namespace),
that code could read ``/proc/<worker pid>/environ`` — ``DJANGO_SECRET_KEY``,
``TRAINBOARD_ENCRYPTION_KEY`` (which decrypts every stored cloud credential), ``DATABASE_URL`` with its
password — or attach a debugger to the worker. :func:`make_undumpable` closes that: the kernel then
treats the process as not dumpable, so its ``/proc/<pid>/environ``, ``mem`` and ``fd/`` belong to root
and only root may ptrace it (proc(5) "/proc/pid/environ", prctl(2) ``PR_SET_DUMPABLE``).

The flag is kept across ``fork`` (Celery's prefork pool processes have it) and reset by ``execve``
(a job's supervisor, torchrun and the ranks are ordinary processes again, readable by their own
user). The price: no core dumps of the worker, and ``py-spy`` on it needs root.
"""

from __future__ import annotations

import ctypes
import sys

PR_SET_DUMPABLE = 4  # <linux/prctl.h>
PR_GET_DUMPABLE = 3


def _libc() -> ctypes.CDLL | None:
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def make_undumpable() -> bool:
    """Mark this process not dumpable (prctl ``PR_SET_DUMPABLE`` 0). True when done; False off Linux.

    Raises OSError when the kernel refuses (it does not for this call)."""
    libc = _libc()
    if libc is None:
        return False
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "prctl(PR_SET_DUMPABLE, 0) failed")
    return True


def is_dumpable() -> bool | None:
    """This process's dumpable flag (prctl ``PR_GET_DUMPABLE``); None off Linux."""
    libc = _libc()
    return None if libc is None else bool(libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0))
