"""Reading the log of a torchrun job, shared by the adapters that keep the log of a torchrun they
started (the GPU box's ``train.log``, a Slurm job's ``slurm.log``): its lines from a byte-offset cursor
(:func:`byte_cursor`, :func:`complete_lines`), and why the job failed, from its end.

:func:`failure_line` prefers torchrun's failure summary ("Root Cause (first observed failure)": that
rank, its exit code or signal, and the ``trainer error: rank N: ...`` line of that rank when it printed
one — the other ranks' errors are usually the consequence, e.g. a closed connection; else the log's
last exception or argparse error line above the summary, as a user's script prints it); then the last
line containing ``trainer error:``; then the last Python exception line of a rank (torchrun's own
ChildFailedError wrapper is skipped).

Pure text functions: no file, no process.
"""

from __future__ import annotations

import re
import signal
from typing import Sequence

from cloud_adapters.base import InvalidSpec


def byte_cursor(cursor: str) -> int:
    """A ``logs()`` cursor as the byte offset it holds ("" = 0); InvalidSpec when it is not one."""
    try:
        offset = int(cursor or 0)
    except ValueError:
        raise InvalidSpec(f"log cursor must be a byte offset, got {cursor!r}.") from None
    if offset < 0:
        raise InvalidSpec(f"log cursor must be 0 or more, got {offset}.")
    return offset


def complete_lines(chunk: bytes, offset: int, *, max_bytes: int, max_lines: int) -> tuple[list[str], str]:
    """The complete lines of ``chunk`` (the log's bytes read from byte ``offset``, at most ``max_bytes``),
    at most ``max_lines`` of them, decoded as UTF-8 with invalid bytes replaced, and the cursor after
    them: a partial last line is left for the next call, except one line longer than ``max_bytes``,
    handed over in pieces rather than stalling."""
    complete = chunk.split(b"\n")[:-1]
    if not complete and len(chunk) == max_bytes:
        complete, consumed = [chunk], len(chunk)
    else:
        complete = complete[:max_lines]
        consumed = sum(len(p) + 1 for p in complete)
    return [p.rstrip(b"\r").decode("utf-8", "replace") for p in complete], str(offset + consumed)

# torchrun's failure summary (torch.distributed.elastic ``ProcessFailure`` formatting), e.g.
#   Root Cause (first observed failure):
#   [0]:
#     rank      : 1 (local_rank: 1)
#     exitcode  : -9 (pid: 27701)
#     traceback : Signal 9 (SIGKILL) received by PID 27701
_ROOT_CAUSE = "Root Cause (first observed failure):"
_SUMMARY_RANK = re.compile(r"^rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_SUMMARY_EXIT = re.compile(r"^exitcode\s*:\s*(-?\d+)")


def root_cause(lines: list[str]) -> str | None:
    """"rank R (local rank L) ..." from the last torchrun failure summary in ``lines``, or None."""
    starts = [i for i, ln in enumerate(lines) if ln.startswith(_ROOT_CAUSE)]
    if not starts:
        return None
    # The summary's "Failures:" section (other ranks) sits just above the root cause.
    first = starts[-1]
    failures = [i for i in range(max(0, first - 60), first) if lines[i].startswith("Failures:")]
    entries: list[list[int | None]] = []  # [rank, local_rank, exitcode], in summary order
    for i in range((failures[-1] if failures else first) + 1, min(len(lines), first + 12)):
        line = lines[i]
        if i > first and line.startswith("===="):
            break
        if m := _SUMMARY_RANK.match(line):
            entries.append([int(m.group(1)), int(m.group(2)), None])
        elif (m := _SUMMARY_EXIT.match(line)) and entries:
            entries[-1][2] = int(m.group(1))
    if not entries:
        return None
    # torchrun's "first observed" is when *it* noticed, not what happened first: when one rank is
    # killed (OOM killer, segfault), its peers fail a moment later on the closed connection and may be
    # noticed first. A rank ended by a signal torchrun did not send (SIGTERM) is the cause.
    killed = [e for e in entries if e[2] is not None and e[2] < 0 and -e[2] != signal.SIGTERM]
    rank, local_rank, exitcode = killed[0] if killed else entries[-1]
    who = f"rank {rank} (local rank {local_rank})"
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = (", usually the out-of-memory killer or an operator (check the machine's memory and "
                "`dmesg`)" if -exitcode == signal.SIGKILL else "")
        return f"{who} was killed by {name} (exit code {exitcode}){hint}; torchrun stopped the other ranks"
    own = f"trainer error: rank {rank}: "
    for line in reversed(lines):
        if own in line:
            return line[line.index("trainer error:") :]
    # A rank that died outside the trainer's error handling: Python prints "[rankN]: Traceback".
    exception = re.compile(rf"^\[rank{rank}\]:\s*([A-Za-z_][\w.]*(?:Error|Exception)): \S")
    for line in reversed(lines):
        if exception.match(line):
            return f"{who}: {line[line.index(']:') + 2 :].strip()}"
    code_text = f"exit code {exitcode}" if exitcode is not None else "an unknown exit code"
    # A user's script prints its uncaught exception or argparse's "train.py: error: ..." without a
    # rank prefix (it need not init a process group): the last such line above torchrun's summary is
    # named as the log's, since which rank printed it is not recorded.
    plain = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception): \S|[\w.-]+: error: \S)")
    for line in reversed(lines[:first]):
        if plain.match(line) and "ChildFailedError" not in line:
            return f"{who} failed with {code_text}; the log's last error: {line}"
    return f"{who} failed with {code_text}; its error is in the job's log"


_EXCEPTION = re.compile(r"^(?:\[[^\]]*\]:?\s*)?([A-Za-z_][\w.]*(?:Error|Exception)): \S")


def failure_line(lines: Sequence[str]) -> str:
    """The failure of a torchrun job as its log's stripped, non-empty ``lines`` (oldest first) show it,
    in the order of preference of the module docstring; "" when they show none."""
    lines = list(lines)
    root = root_cause(lines)
    if root is not None:
        return root
    for line in reversed(lines):
        if "trainer error:" in line:
            return line[line.index("trainer error:") :]
    for line in reversed(lines):
        if _EXCEPTION.match(line) and "ChildFailedError" not in line:
            return line
    return ""
