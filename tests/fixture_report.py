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
workers, Chromium), e.g. ``process starts: celery worker 4, chromium 3``.

The same counts are written as JSON to ``$TRAINBOARD_FIXTURE_REPORT_JSON`` when that is set (for
before/after comparisons; the process starts under the key ``"process starts"``).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest

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


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the totals to the controller
        workeroutput["fixture_setup"] = {name: [_totals[name], _counts[name]] for name in _totals}
        workeroutput["process_starts"] = dict(_starts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller adds up what each xdist worker measured."""
    for name, (seconds, count) in (getattr(node, "workeroutput", None) or {}).get("fixture_setup", {}).items():
        _totals[name] += seconds
        _counts[name] += count
    for kind, count in (getattr(node, "workeroutput", None) or {}).get("process_starts", {}).items():
        _starts[kind] += count


def pytest_terminal_summary(terminalreporter, config):
    if getattr(config, "workeroutput", None) is not None or not _totals:
        return
    limit = _limit()
    path = os.environ.get("TRAINBOARD_FIXTURE_REPORT_JSON")
    if path:
        report = {name: {"seconds": round(_totals[name], 3), "setups": _counts[name]} for name in _totals}
        report[STARTS_KEY] = dict(_starts)
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
