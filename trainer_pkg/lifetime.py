"""A child process that does not outlive the process that started it.

A launcher that supervises a child (torchrun, a rank, a framework's worker) passes the child's signals
on while it lives; when the launcher itself is killed (SIGKILL from a platform's stop escalation, an
out-of-memory kill) nothing would pass them on, and a child in a session of its own would run on,
reparented to init. :func:`die_with_parent` arms Linux's ``prctl(PR_SET_PDEATHSIG)`` in the child so
the kernel sends it a signal when its parent dies.

Caveat (prctl(2)): the signal follows the death of the parent *thread* that started the child, so
start children from a thread that lives as long as the supervision (the main thread, or the thread
that waits on the child). Torch-free, standard library only.
"""

from __future__ import annotations

import ctypes
import signal
from typing import Callable

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option number for the parent-death signal (linux/prctl.h)."""

try:  # looked up in the parent: a dlopen between fork and exec could wait on a lock forever
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux (no prctl in the C library)
    _PRCTL = None


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that makes the child get ``sig`` when the thread
    that started it dies; None where there is no prctl (the child then outlives its parent as before).
    SIGTERM lets the child shut down its own children and checkpoint; SIGKILL is for children that may
    ignore SIGTERM (a TensorFlow worker blocked in a collective)."""
    if _PRCTL is None:
        return None
    number = int(sig)

    def arm() -> None:
        _PRCTL(PR_SET_PDEATHSIG, number)

    return arm
