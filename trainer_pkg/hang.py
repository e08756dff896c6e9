"""Hang detection on the node that holds rank 0: no new step for the deadline → every rank's Python
stacks, as ``hang`` records the dashboard shows on the job page (issue 30).

How it works, for the built-in trainer and for a user's script alike:

1. The launcher that starts this node's ranks (:func:`trainer_pkg.launch.run_torchrun`,
   :func:`trainer_pkg.launch.run_script_here`) makes a directory and names it to every rank in
   :data:`HANG_DIR`. Each rank's first act (:mod:`trainer_pkg.rank_entry` for a script, the launcher's
   in-process branch for our trainer) is :func:`install_rank_dump`: ``faulthandler.register(SIGUSR1,
   all_threads=True)`` writing to ``rank-<RANK>.stack`` there, and ``rank-<RANK>.pid`` saying which
   process (and which thread is its main one) may be signalled.
2. :class:`Watchdog`, a thread of that launcher, reads ``<output_dir>/metrics.jsonl`` as rank 0 appends
   to it. From this run's first record with a step on (what the file held before is skipped), a stall of :func:`deadline_s` seconds with no new record
   makes it send SIGUSR1 to each rank whose pid file is there; faulthandler writes the stacks from
   its C signal handler, so a rank blocked in a collective, a ``sleep`` or a lock answers as well.
3. It prints one ``hang`` record per rank (:func:`hang_record`) on stdout, the job's log, which the
   dashboard's sync reads as it reads every record. A new record from rank 0 re-arms it.

The deadline: :data:`DEADLINE_VAR` in seconds (``0`` turns the watchdog off), else
``max(600, 20 × seconds per step, 3 × seconds between records)`` over the last :data:`RECENT` records.

Limits: only the node of rank 0 watches (the others' ranks are not signalled; the dashboard flags the
job from its progress either way); a script that installs its own SIGUSR1 handler replaces ours (its
rank then reports no stack). Torch-free.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable, TextIO

from trainer_pkg.metrics import format_metric_line, print_line

HANG_DIR = "TRAINBOARD_HANG_DIR"
"""Variable naming the directory of the ranks' pid and stack files (set by the launcher only)."""
DEADLINE_VAR = "TRAINBOARD_HANG_DEADLINE_S"
"""Variable: seconds with no new step before the ranks' stacks are dumped; 0 = no watchdog."""
DUMP_SIGNAL = signal.SIGUSR1
"""The signal that makes a rank write its stacks (faulthandler)."""
MIN_DEADLINE_S = 600.0
"""The default deadline's floor, seconds (10 minutes)."""
STEP_TIMES = 20
"""The default deadline in steps: 20 × the recent seconds per step when that is longer than the floor."""
RECENT = 8
"""Records the default deadline's step time is measured over (as jobs.progress measures the rate)."""
MAX_THREADS = 8
"""Threads per rank kept in a record (the main thread first)."""
MAX_FRAMES = 24
"""Frames per thread kept in a record, innermost first."""
DUMP_WAIT_S = 5.0
"""Seconds the watchdog waits for the ranks' stack files after signalling them."""

_dump_file: TextIO | None = None  # kept open for faulthandler for the life of the rank


def install_rank_dump(env: dict[str, str] | None = None) -> str | None:
    """In a rank: have SIGUSR1 write every thread's Python stack to ``<HANG_DIR>/rank-<RANK>.stack``
    and announce this process in ``rank-<RANK>.pid`` (JSON: pid, rank, main thread id). Returns the
    stack file's path, or None when :data:`HANG_DIR` is unset or not a directory (nothing installed:
    SIGUSR1 keeps its default). Never raises: a rank trains whether or not it can be dumped."""
    global _dump_file
    env = os.environ if env is None else env
    directory, rank = env.get(HANG_DIR, ""), env.get("RANK", "0")
    if not directory or not os.path.isdir(directory) or not rank.isdigit():
        return None
    try:
        path = os.path.join(directory, f"rank-{rank}.stack")
        _dump_file = open(path, "a", encoding="utf-8")
        faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True, chain=False)
        pid_file = os.path.join(directory, f"rank-{rank}.pid")
        with open(pid_file + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "rank": int(rank), "main_thread": threading.main_thread().ident}, f)
        os.replace(pid_file + ".tmp", pid_file)  # the watchdog signals only a rank whose handler is in place
        return path
    except (OSError, RuntimeError, ValueError):
        return None


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*?)\s*$')


def parse_dump(text: str, main_thread: int | None = None) -> list[dict[str, Any]]:
    """The threads of one faulthandler dump (``text``), the main one first: each
    ``{"thread": "0x…", "main": bool, "frames": [{"file", "line", "function"}, ...]}``, frames
    innermost first, at most :data:`MAX_THREADS` threads of :data:`MAX_FRAMES` frames. ``main_thread``
    is ``threading.main_thread().ident`` in that rank (None: no thread is marked main)."""
    threads: list[dict[str, Any]] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            ident = int(head.group(2), 16)
            threads.append({"thread": head.group(2), "main": main_thread is not None and ident == main_thread,
                            "frames": []})
            continue
        frame = _FRAME.match(line)
        if frame and threads and len(threads[-1]["frames"]) < MAX_FRAMES:
            threads[-1]["frames"].append({"file": frame.group(1), "line": int(frame.group(2)),
                                          "function": frame.group(3)})
    threads.sort(key=lambda t: not t["main"])
    return threads[:MAX_THREADS]


def _library(path: str) -> bool:
    """Whether a frame's file is Python's or an installed package's, not the job's own code."""
    parts = path.replace("\\", "/")
    return ("/site-packages/" in parts or "/dist-packages/" in parts or "/lib/python3" in parts
            or parts.startswith("<"))


def where(threads: list[dict[str, Any]]) -> str:
    """One line for a rank's stack: ``in <innermost function>, <file>:<line>`` where the file and line
    are the innermost frame of the job's own code (not Python's, not an installed package's) in its
    main thread (the first thread when none is marked): ``in all_reduce, train.py:14``. "" when no
    thread has a frame."""
    thread = next((t for t in threads if t["frames"]), None)
    if thread is None:
        return ""
    frames = thread["frames"]
    own = next((f for f in frames if not _library(f["file"])), frames[0])
    return f"in {frames[0]['function']}, {os.path.basename(own['file'])}:{own['line']}"


def deadline_s(recent: list[tuple[int, float]], env: dict[str, str] | None = None) -> float:
    """Seconds with no new record before a run counts as hung: :data:`DEADLINE_VAR` when set to a
    number ≥ 0 (0: never), else ``max(MIN_DEADLINE_S, STEP_TIMES × s/step, 3 × s/record)`` over
    ``recent`` ([(step, unix seconds)], oldest first; fewer than two points: the floor)."""
    env = os.environ if env is None else env
    raw = env.get(DEADLINE_VAR, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if value >= 0 and value == value and value != float("inf"):
            return value
        print_line(f"[launch] {DEADLINE_VAR}={raw[:40]!r} is not a number of seconds ≥ 0: the default is used")
    longest = MIN_DEADLINE_S
    if len(recent) >= 2:
        (s0, t0), (s1, t1) = recent[0], recent[-1]
        if t1 > t0:
            if s1 > s0:
                longest = max(longest, STEP_TIMES * (t1 - t0) / (s1 - s0))
            longest = max(longest, 3 * (t1 - t0) / (len(recent) - 1))
    return longest


def hang_record(*, rank: int, threads: list[dict[str, Any]], detected_at: float, step: int,
                step_time: float, deadline: float, world_size: int) -> dict[str, Any]:
    """The ``hang`` record of one rank (trainer_pkg/metrics.py's format): ``time`` when the stall was
    detected (the same for every rank of one stall: the dashboard groups them by it), ``step`` and
    ``step_time`` the last record's, ``deadline_s``, ``rank``, ``where`` (:func:`where`; "" when the rank
    wrote no stack) and ``threads`` (:func:`parse_dump`)."""
    return {"event": "hang", "time": round(detected_at, 3), "step": step, "step_time": step_time,
            "deadline_s": round(deadline, 3), "rank": rank, "world_size": world_size,
            "where": where(threads), "threads": threads}


@dataclasses.dataclass
class _Rank:
    rank: int
    pid: int
    main_thread: int | None
    stack_path: str
    offset: int = 0


def _ranks(directory: str) -> list[_Rank]:
    out = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("rank-") and name.endswith(".pid")):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                info = json.load(f)
            rank, pid = int(info["rank"]), int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        ident = info.get("main_thread")
        out.append(_Rank(rank, pid, ident if isinstance(ident, int) else None,
                         os.path.join(directory, f"rank-{rank}.stack")))
    return sorted(out, key=lambda r: r.rank)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def holds_open(pid: int, path: str) -> bool:
    """Whether process ``pid`` has ``path`` open (Linux: ``/proc/<pid>/fd``), so a pid file left by a
    rank that exited never gets SIGUSR1 (default action: terminate) sent to another process that
    reused its pid. True where there is no ``/proc`` to ask; False when the process is gone or its
    descriptors cannot be read."""
    if not os.path.isdir("/proc/self/fd"):
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    target = os.path.realpath(path)
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


def dump_ranks(directory: str, wait_s: float = DUMP_WAIT_S) -> dict[int, list[dict[str, Any]]]:
    """Signal every rank announced in ``directory`` and return each one's threads (:func:`parse_dump`
    of what it wrote after the signal; [] for a rank that wrote nothing within ``wait_s`` seconds or
    is gone), keyed by rank. Only a process that holds its stack file open (:func:`holds_open`) is
    signalled."""
    ranks = _ranks(directory)
    signalled = []
    for r in ranks:
        r.offset = _size(r.stack_path)
        if not holds_open(r.pid, r.stack_path):
            continue  # the rank exited; its pid may be another process's now
        try:
            os.kill(r.pid, DUMP_SIGNAL)
            signalled.append(r)
        except OSError:  # the rank exited (or is not ours to signal): nothing to dump
            pass
    deadline, sizes = time.monotonic() + wait_s, {}
    while time.monotonic() < deadline:
        now = {r.rank: _size(r.stack_path) for r in signalled}
        if all(now[r.rank] > r.offset for r in signalled) and now == sizes:
            break  # every rank wrote, and nothing more arrived since the last look
        sizes = now
        time.sleep(0.1)
    out: dict[int, list[dict[str, Any]]] = {r.rank: [] for r in ranks}
    for r in signalled:
        try:
            with open(r.stack_path, encoding="utf-8", errors="replace") as f:
                f.seek(r.offset)
                out[r.rank] = parse_dump(f.read(), r.main_thread)
        except OSError:
            pass
    return out


class Watchdog(threading.Thread):
    """The launcher's hang watch (module docstring): reads ``metrics_path`` as it grows; a stall past
    the deadline dumps the ranks of ``directory`` and emits their ``hang`` records through ``emit``
    (a line printer). :meth:`stop` ends it (it is a daemon thread besides)."""

    def __init__(self, metrics_path: str, directory: str, *, world_size: int,
                 env: dict[str, str] | None = None, emit: Callable[[str], None] = print_line,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="trainboard-hang-watchdog", daemon=True)
        self.metrics_path, self.directory, self.world_size = metrics_path, directory, world_size
        self.env = dict(os.environ if env is None else env)
        self.emit, self.clock = emit, clock
        # A resumed run appends to its earlier runs' file: only this run's records arm the watch (a
        # checkpoint that takes longer than the deadline to load is no hang).
        self._offset, self._partial = _size(metrics_path), ""
        self.recent: list[tuple[int, float]] = []  # (step, the record's time)
        self.last_seen: float | None = None  # our clock when the newest record arrived
        self.reported = False  # this stall's records are out; a new record re-arms
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def _read_new(self) -> bool:
        """Take the records appended since the last look; True when one with a step arrived."""
        try:
            with open(self.metrics_path, encoding="utf-8", errors="replace") as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except OSError:
            return False
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # a line rank 0 is still writing
        fresh = False
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            step, at = (record.get("step"), record.get("time")) if isinstance(record, dict) else (None, None)
            if isinstance(step, int) and not isinstance(step, bool) and isinstance(at, (int, float)):
                self.recent = (self.recent + [(step, float(at))])[-RECENT:]
                fresh = True
        return fresh

    def check(self) -> float | None:
        """One look: read new records; dump and emit when stalled. Returns the deadline in force
        (None: not armed yet, or the watchdog is off)."""
        now = self.clock()
        if self._read_new():
            self.last_seen, self.reported = now, False
        if self.last_seen is None:
            return None
        limit = deadline_s(self.recent, self.env)
        if limit <= 0:
            return None
        if not self.reported and now - self.last_seen >= limit:
            self.reported = True
            self._report(now, limit)
        return limit

    def _report(self, now: float, limit: float) -> None:
        step, step_time = self.recent[-1]
        stacks = dump_ranks(self.directory)
        self.emit(f"[launch] hang: no new step for {now - self.last_seen:.0f} s (deadline {limit:.0f} s) after "
                  f"step {step}; the ranks' stacks follow")
        for rank, threads in sorted(stacks.items()):
            record = hang_record(rank=rank, threads=threads, detected_at=now, step=step, step_time=step_time,
                                 deadline=limit, world_size=self.world_size)
            self.emit(f"[launch] rank {rank}: {record['where'] or 'no stack (the rank did not answer SIGUSR1)'}")
            self.emit(format_metric_line(record))

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                limit = self.check()
            except Exception as exc:  # a watchdog never takes the run down
                print(f"[launch] hang watchdog stopped: {exc!r}", file=sys.stderr, flush=True)
                return
            # Look ten times per deadline, at most every 10 s and at least every 0.2 s.
            self._stop_event.wait(min(10.0, max(0.2, (limit or 10.0) / 10)))
