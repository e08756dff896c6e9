"""Reading the log of a torchrun job, shared by the adapters that keep the log of a torchrun they
started (the GPU box's ``train.log``, a Slurm job's ``slurm.log``): its lines from a byte-offset cursor
(:func:`byte_cursor`, :func:`complete_lines`), and why the job failed, from its end.

:func:`failure_line` prefers torchrun's failure summary ("Root Cause (first observed failure)": that
rank, its exit code or signal, and the ``trainer error: rank N: ...`` line of that rank when it printed
one — the other ranks' errors are usually the consequence, e.g. a closed connection; else the log's
last exception or argparse error line above the summary, as a user's script prints it); then the last
line containing ``trainer error:``; then the last Python exception line of a rank (torchrun's own
ChildFailedError wrapper is skipped). An exception line is named with where the user's code raised
it (:func:`located`): ``train.py:3: SyntaxError: invalid syntax`` and, on the next line, the
offending source line, from the Python traceback printed above it.

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
    for i in range(len(lines) - 1, -1, -1):
        if exception.match(lines[i]):
            return f"{who}: {located(lines, i)}"
    code_text = f"exit code {exitcode}" if exitcode is not None else "an unknown exit code"
    # A user's script prints its uncaught exception or argparse's "train.py: error: ..." without a
    # rank prefix (it need not init a process group): the last such line above torchrun's summary is
    # named as the log's, since which rank printed it is not recorded.
    plain = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception): \S|[\w.-]+: error: \S)")
    for i in range(first - 1, -1, -1):
        if plain.match(lines[i]) and "ChildFailedError" not in lines[i]:
            return f"{who} failed with {code_text}; the log's last error: {located(lines, i)}"
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
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION.match(lines[i]) and "ChildFailedError" not in lines[i]:
            return located(lines, i)
    return ""


_RANK_PREFIX = re.compile(r"^\[[^\]]*\]:?\s*")
_FRAME = re.compile(r'^File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>\S.*))?$')
_NOT_USER_CODE = ("/site-packages/", "/dist-packages/", "/trainer_pkg/", "/lib/python3", "<frozen ", "<string>")
"""Frames of a path with one of these are Python's, a library's or the launcher's, not the user's code."""
_TRACEBACK_LINES = 200  # how far above an exception line its traceback is looked for


def _code_path(path: str) -> str:
    """A frame's file as the user knows it: relative to the job's ``code/`` directory (where the archive
    was unpacked), else its base name."""
    return path.rsplit("/code/", 1)[1] if "/code/" in path else path.rsplit("/", 1)[-1]


def user_code_error(lines: Sequence[str]) -> str:
    """The last exception of ``lines`` (a job's log, oldest first) that the user's code raised, named as
    :func:`located` names it; "" when the last exception's traceback shows no frame of the user's files
    (or there is none). For a provider that reports only an exit code (SageMaker, Vertex AI, Azure ML)."""
    lines = [ln.strip() for ln in lines]
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION.match(lines[i]) and "ChildFailedError" not in lines[i]:
            found = located(lines, i)
            return found if found != _RANK_PREFIX.sub("", lines[i]).strip() else ""
    return ""


def located(lines: Sequence[str], index: int) -> str:
    """The exception line ``lines[index]`` (rank prefix dropped) named with where the user's code raised
    it: ``"helpers.py:2 in load: ValueError: bad shard 7\n    raise ValueError(...)"`` — the innermost
    frame of the user's files in the Python traceback just above it (for a SyntaxError, the file and line
    it names), and that frame's source line; the line alone when the traceback shows no frame of the
    user's (an error inside a library called from nowhere in the user's code, or no traceback)."""
    def bare(i: int) -> str:
        return _RANK_PREFIX.sub("", lines[i]).strip() if lines[i].startswith("[") else lines[i].strip()

    error = bare(index)
    frame: tuple[str, str, str, str] | None = None  # path, line, function, source
    for i in range(index - 1, max(-1, index - _TRACEBACK_LINES), -1):
        text = bare(i)
        if text.startswith("Traceback (most recent call last)") or _EXCEPTION.match(text):
            break  # the start of this traceback, or the end of an earlier one
        match = _FRAME.match(text)
        if match is None or any(mark in match["path"] for mark in _NOT_USER_CODE):
            continue
        source = bare(i + 1) if i + 1 < index else ""
        if _FRAME.match(source) or not source.strip("^~ "):
            source = ""
        frame = (match["path"], match["line"], match["func"] or "", source)
        break  # the innermost frame of the user's code: the last one above the exception
    if frame is None:
        return error
    path, line, func, source = frame
    where = f"{_code_path(path)}:{line}" + (f" in {func}" if func and func != "<module>" else "")
    return f"{where}: {error}" + (f"\n    {source}" if source else "")


_AGENT_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ \S*torch/distributed/\S+\] ")  # glog-style agent lines
_AGENT_FAILED = re.compile(r"\] failed \(exitcode: -?\d+\)")  # torch.distributed.elastic's own error log line


def failure_summary_span(lines: Sequence[str]) -> tuple[int, int] | None:
    """``(first, last)`` indexes (inclusive) of torchrun's own report of the last failure in ``lines``:
    its agent's "failed (exitcode: N)" line and the agent's lines just above it (stopping the other
    ranks; else its ChildFailedError traceback) through the "===="
    line that closes "Root Cause (first observed failure)"; None when ``lines`` hold no whole report.
    What a person reads a failed job's log for is above it: the rank's own traceback."""
    text = [ln.strip() for ln in lines]
    roots = [i for i, ln in enumerate(text) if ln.startswith(_ROOT_CAUSE)]
    if not roots:
        return None
    root = roots[-1]
    end = next((i for i in range(root + 1, len(text)) if text[i].startswith("====")), None)
    if end is None:
        return None
    window = range(root - 1, max(-1, root - _TRACEBACK_LINES), -1)
    start = next((i for i in window if _AGENT_FAILED.search(text[i])), None)
    while start is not None and start > 0 and _AGENT_LOG.match(text[start - 1]):
        start -= 1  # the agent's lines just before it ("Sending process N closing signal SIGTERM")
    if start is None:
        wrapper = next((i for i in window if "ChildFailedError" in text[i]), None)
        if wrapper is None:
            return None
        start = next((i for i in range(wrapper, max(-1, wrapper - _TRACEBACK_LINES), -1)
                      if text[i].startswith("Traceback (most recent call last)")), wrapper)
    return start, end
