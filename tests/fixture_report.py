"""Where the suite's time goes: each fixture's set-up time, summed over the run, printed at its end.

Loaded in every pytest process (``-p fixture_report`` in pyproject.toml's ``addopts``). Every fixture
set-up is timed (wall seconds, ``time.perf_counter``); the set-up of a fixture that another fixture
needs is counted in both, so the totals name the costly fixtures rather than add up to the run. Under
pytest-xdist each worker sends its totals to the controller (``workeroutput``), which adds them up and
prints the heaviest ``TRAINBOARD_FIXTURE_REPORT`` (default 25; 0 turns the report off) with the
count of set-ups, e.g.::

    ===== fixture set-up totals (seconds; a fixture's own set-up includes those it requests) =====
      812.4 s   31 ×  slurm_cluster_session
      301.9 s   22 ×  celery_worker_process

Below them, how many times the run started each costly real process (:func:`count_start`: Celery
workers, Chromium, Slurm clusters, Kubernetes stand-ins), e.g. ``process starts: celery worker 4, chromium 3``.

The same counts are written as JSON to ``$TRAINBOARD_FIXTURE_REPORT_JSON`` when that is set (for
before/after comparisons; the process starts under the key ``"process starts"``).

The controller (or the one process of a serial run) also counts the real parts the run started, by
watching ``/proc`` for new processes every 0.2 s (:class:`ProcessCounter`): torchrun launches (real
and the trainer stand-in's), Celery workers, Slurm clusters (``slurmctld``), Chromium browsers and dockerd engines, printed under the fixture totals,
each kind with the test files that started the most (:func:`_started_by`). A process that lives
less than the interval can be missed (none of these does); processes of other work on the machine
are counted too, so the counts are exact on an otherwise idle machine, as CI's.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections import defaultdict

import pytest

_cpu: dict[str, float] = defaultdict(float)
"""Test file → CPU seconds (user + system) of the pytest process and of the children it waited for,
during that file's tests' set-up, call and tear-down (:func:`pytest_runtest_protocol`)."""
_totals: dict[str, float] = defaultdict(float)
_counts: dict[str, int] = defaultdict(int)
_starts: dict[str, int] = defaultdict(int)

STARTS_KEY = "process starts"


def count_start(kind: str) -> None:
    """Count one start of a real process of ``kind`` ("celery worker", "chromium") in this pytest
    process; the run's totals are printed under the fixture totals."""
    _starts[kind] += 1


def started(kind: str) -> int:
    """How many processes of ``kind`` this pytest process has started so far (:func:`count_start`)."""
    return _starts[kind]


def _limit() -> int:
    try:
        return int(os.environ.get("TRAINBOARD_FIXTURE_REPORT", "25"))
    except ValueError:
        return 25


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    started = time.perf_counter()
    try:
        yield
    finally:
        name = fixturedef.argname
        _totals[name] += time.perf_counter() - started
        _counts[name] += 1


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's CPU seconds, added to its file's: this process's own and those of the children it
    waited for (a child's waited-for descendants included). A process nobody in pytest waits for (a
    daemon that reparents itself to init: a Ray head's raylet, dockerd's containers, a GPU box job's
    detached supervisor) is not counted, and a fixture's process is counted in the test whose
    tear-down waits for it."""
    before = _cpu_seconds()
    try:
        yield
    finally:
        _cpu[item.nodeid.split("::", 1)[0]] += _cpu_seconds() - before


PROCESS_KINDS: dict[str, tuple[bytes, ...]] = {
    "torchrun launches (real trainer, torch's torchrun)": (b"torch.distributed.run",),
    "torchrun launches (real trainer, torch-free torchrun)": (b"torchrun-lite/python", b"torch.distributed.run"),
    "torchrun launches (trainer stand-in)": (b"trainer-standin/python", b"torch.distributed.run"),
    "Celery workers": (b"celery", b"-A\0webapp\0worker"),
    "Slurm clusters (slurmctld)": (b"slurmctld",),
    "Chromium browsers": (b"chromium", b"--headless"),
    "docker engines (dockerd)": (b"dockerd\0--data-root",),
}
"""What :class:`ProcessCounter` counts: a kind's new process has every one of its byte strings in its
command line (arguments joined by NUL). A Chromium browser is its main process (no ``--type=``); a
Celery worker its main process (its pool children are forks with the same command line, not counted:
their parent is a counted worker). Processes in another PID namespace (containers) are not counted."""


def _started_by(pid: str) -> str:
    """The test file during whose test ``pid`` was started: the file part of ``PYTEST_CURRENT_TEST``
    in its environment (pytest sets it in its process's environment for each test phase, and the
    processes a test starts inherit it; a process that a session- or module-scoped fixture started is
    named by the first test that needed it). ``"?"`` when it has none or is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            environ = fh.read()
    except OSError:
        return "?"
    marker = b"PYTEST_CURRENT_TEST="
    start = environ.find(b"\0" + marker)
    if start < 0:
        if not environ.startswith(marker):
            return _by_directory(pid)
        start = -1
    value = environ[start + 1 + len(marker):].split(b"\0", 1)[0].decode(errors="replace")
    return value.split("::", 1)[0] or "?"


def _by_directory(pid: str) -> str:
    """For a process without the variable (one a daemon started: a GPU box's detached supervisor, slurmd,
    a pod of the Kubernetes stand-in): the test whose ``tmp_path`` it runs in, ``tmp:<test directory>``
    (pytest names that directory after the test, cut at 30 characters); a Slurm job's step, which runs in
    the test Slurm cluster's work directory for its module (tests/slurmkit.py ``module_view``:
    ``tb-slurm-XXXX/work/<module>-XXXX``), ``slurm:<module>``; ``"?"`` elsewhere."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return "?"
    parts = cwd.split(os.sep)
    for i, part in enumerate(parts[:-2]):
        if part.startswith("tb-slurm-") and parts[i + 1] == "work":
            return "slurm:" + parts[i + 2].rsplit("-", 1)[0]
    for i, part in enumerate(parts[:-1]):
        if part.startswith("pytest-of-"):
            rest = parts[i + 2:]  # after pytest-of-<user>/pytest-<N>/
            if rest and rest[0].startswith("popen-gw"):
                rest = rest[1:]
            return f"tmp:{rest[0]}" if rest else "?"
    return "?"


BY_FILE_LINES = 8
"""Test files named per kind of real part in the report, most processes first."""


class ProcessCounter(threading.Thread):
    """Counts new processes of each :data:`PROCESS_KINDS` kind (a daemon thread; :meth:`stop` ends it)."""

    interval_s = 0.2

    def __init__(self) -> None:
        super().__init__(name="process-counter", daemon=True)
        self.counts: dict[str, int] = defaultdict(int)
        self.by_file: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        """kind → test file (:func:`_started_by`) → processes counted."""
        self._seen: set[str] = set(os.listdir("/proc"))
        self._counted: set[str] = set()
        self._stopped = threading.Event()
        self._namespace = os.readlink("/proc/self/ns/pid")

    def run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.scan()

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5)
        self.scan()

    def scan(self) -> None:
        now = set(os.listdir("/proc"))
        for pid in now - self._seen:
            if not pid.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") != self._namespace:
                    continue  # a container's process (the compose test's stack), not one the run started
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    argv = fh.read()
                with open(f"/proc/{pid}/stat", "rb") as fh:
                    ppid = fh.read().rsplit(b")", 1)[1].split()[1].decode()
            except OSError:
                continue
            if not argv:  # not yet exec'd (a fork): look again next time
                now.discard(pid)
                continue
            for kind, parts in PROCESS_KINDS.items():
                if not all(part in argv for part in parts):
                    continue
                if kind == "torchrun launches (real trainer, torch's torchrun)" and (
                        b"trainer-standin/python" in argv or b"torchrun-lite/python" in argv):
                    continue
                if kind == "Chromium browsers" and b"--type=" in argv:
                    continue
                if kind in ("Celery workers", "docker engines (dockerd)") and ppid in self._counted:
                    continue  # a worker's pool child or beat, a dockerd's re-execution
                self._counted.add(pid)
                self.counts[kind] += 1
                self.by_file[kind][_started_by(pid)] += 1
        self._seen = now


_counter: ProcessCounter | None = None


def pytest_sessionstart(session):
    global _counter
    if getattr(session.config, "workeroutput", None) is None and os.path.isdir("/proc"):
        _counter = ProcessCounter()
        _counter.start()


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the totals to the controller
        workeroutput["fixture_setup"] = {name: [_totals[name], _counts[name]] for name in _totals}
        workeroutput["process_starts"] = dict(_starts)
        workeroutput["cpu_by_file"] = dict(_cpu)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller adds up what each xdist worker measured."""
    for name, (seconds, count) in (getattr(node, "workeroutput", None) or {}).get("fixture_setup", {}).items():
        _totals[name] += seconds
        _counts[name] += count
    for kind, count in (getattr(node, "workeroutput", None) or {}).get("process_starts", {}).items():
        _starts[kind] += count
    for name, seconds in (getattr(node, "workeroutput", None) or {}).get("cpu_by_file", {}).items():
        _cpu[name] += seconds


def pytest_terminal_summary(terminalreporter, config):
    if getattr(config, "workeroutput", None) is not None or not _totals:
        return
    limit = _limit()
    path = os.environ.get("TRAINBOARD_FIXTURE_REPORT_JSON")
    if _counter is not None:
        _counter.stop()
    if path:
        report = {"fixtures": {name: {"seconds": round(_totals[name], 3), "setups": _counts[name]} for name in _totals},
                  "processes": dict(_counter.counts) if _counter is not None else {}, STARTS_KEY: dict(_starts),
                  "processes by test file": {kind: dict(files) for kind, files in _counter.by_file.items()}
                  if _counter is not None else {},
                  "cpu seconds by test file": {name: round(seconds, 2) for name, seconds in _cpu.items()}}
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1, sort_keys=True)
    if limit <= 0:
        return
    terminalreporter.write_sep("=", "fixture set-up totals (seconds; a fixture's own set-up includes those it requests)")
    heaviest = sorted(_totals, key=_totals.__getitem__, reverse=True)[:limit]
    for name in heaviest:
        terminalreporter.write_line(f"{_totals[name]:8.1f} s {_counts[name]:5d} ×  {name}")
    if _starts:
        terminalreporter.write_line(
            STARTS_KEY + ": " + ", ".join(f"{kind} {_starts[kind]}" for kind in sorted(_starts)))
    if _cpu:
        terminalreporter.write_sep("=", f"CPU seconds by test file (pytest and the children it waited for; "
                                        f"{sum(_cpu.values()):.0f} s in all)")
        for name in sorted(_cpu, key=_cpu.__getitem__, reverse=True)[:limit]:
            terminalreporter.write_line(f"{_cpu[name]:8.1f} s  {name}")
    if _counter is not None:
        terminalreporter.write_sep("=", "real parts started (new processes seen in /proc)")
        for kind in PROCESS_KINDS:
            terminalreporter.write_line(f"{_counter.counts.get(kind, 0):6d}  {kind}")
            files = _counter.by_file.get(kind, {})
            for name in sorted(files, key=lambda f: (-files[f], f))[:BY_FILE_LINES]:
                terminalreporter.write_line(f"{'':8}{files[name]:5d}  {name}")
