"""tests/xdist_workers.py: under ``-n``, each xdist worker's own Redis database, each file (or
xdist_group) whole on one worker, heaviest units first, and the refusals that keep workers apart.

The suites run here are small ones written into ``tmp_path`` and run by a real ``pytest -n`` in a
subprocess (no Django, no Redis traffic: the tests only record what each worker sees)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xdist_workers import check_redis_databases, redis_db, redis_url_for_worker

TESTS_DIR = Path(__file__).resolve().parent

RECORDER = '''
import json, os, time
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def record(request):
    out = Path(os.environ["TRACE_DIR"])
    name = request.node.nodeid.replace("/", "_").replace(":", "_")
    (out / f"{time.monotonic_ns()}-{name}.json").write_text(json.dumps({
        "nodeid": request.node.nodeid.split("@")[0], "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        "redis": os.environ.get("REDIS_URL")}))
    yield
'''

SUITE = {
    "conftest.py": RECORDER,
    "test_alpha.py": "def test_a1(): pass\ndef test_a2(): pass\ndef test_a3(): pass\n",
    "test_pair_one.py": "import pytest\npytestmark = pytest.mark.xdist_group('pair')\n"
                        "def test_p1(): pass\ndef test_p2(): pass\n",
    "test_pair_two.py": "import pytest\npytestmark = pytest.mark.xdist_group('pair')\n"
                        "def test_p3(): pass\ndef test_p4(): pass\n",
    "test_heavy.py": "import pytest\n@pytest.mark.slow\ndef test_h1(): pass\n",
}


def _run_suite(tmp_path: Path, *args: str, redis_url: str | None = "redis://127.0.0.1:6379/12"
               ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    for name, text in SUITE.items():
        (suite / name).write_text(text)
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: a slow test\n")
    trace = tmp_path / "trace"
    trace.mkdir(exist_ok=True)
    # Not this run's xdist variables (this test may itself run in a worker): the inner run has its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "REDIS_URL"}
    env.update({"TRACE_DIR": str(trace), "PYTHONPATH": str(TESTS_DIR)})
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(suite / "pytest.ini"), "--rootdir", str(suite),
         "-p", "no:cacheprovider", "-p", "no:django", "-p", "xdist_workers", "-q", *args, str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    records = [json.loads(p.read_text()) for p in sorted(trace.iterdir())]
    return result, records


def test_redis_url_per_worker():
    assert redis_db("redis://127.0.0.1:6379/12") == 12
    assert redis_db("redis://127.0.0.1:6379") == 0
    assert redis_url_for_worker("redis://127.0.0.1:6379/12", 0) == "redis://127.0.0.1:6379/12"
    assert redis_url_for_worker("redis://:pw@127.0.0.1:6380/6", 3) == "redis://:pw@127.0.0.1:6380/9"
    assert redis_url_for_worker("redis://127.0.0.1:6379", 2) == "redis://127.0.0.1:6379/2"
    with pytest.raises(ValueError, match="the path must be a database number"):
        redis_db("redis://127.0.0.1:6379/cache")


def test_too_many_redis_databases_are_refused_with_what_to_do():
    check_redis_databases("redis://127.0.0.1:6379/12", 4)  # 12–15: fits
    with pytest.raises(pytest.UsageError) as refused:
        check_redis_databases("redis://127.0.0.1:6379/14", 3)
    assert str(refused.value) == (
        "3 xdist workers use Redis databases 14–16 (REDIS_URL's 14 plus the worker number), but Redis has "
        "databases 0–15: use a REDIS_URL whose database is at most 13 (make test "
        "TEST_REDIS_URL=redis://127.0.0.1:6379/13) or fewer workers (TEST_WORKERS=2)")


def test_each_worker_has_its_own_redis_database_and_each_file_one_worker(tmp_path):
    result, records = _run_suite(tmp_path, "-n", "2", "--dist", "loadgroup")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(records) == 8
    assert {r["worker"] for r in records} == {"gw0", "gw1"}
    for r in records:
        assert r["redis"] == f"redis://127.0.0.1:6379/{12 + int(r['worker'][2:])}"
    by_file: dict[str, set[str]] = {}
    for r in records:
        by_file.setdefault(r["nodeid"].split("::")[0], set()).add(r["worker"])
    assert sorted(by_file) == ["test_alpha.py", "test_heavy.py", "test_pair_one.py", "test_pair_two.py"]
    assert all(len(workers) == 1 for workers in by_file.values()), by_file
    assert by_file["test_pair_one.py"] == by_file["test_pair_two.py"]  # one xdist_group, one worker


def test_units_start_heaviest_first(tmp_path):
    """One worker runs the units in the order the plugin gives: the slow test (weight 60), the pair
    group (4 tests), then test_alpha.py (3)."""
    result, records = _run_suite(tmp_path, "-n", "1", "--dist", "loadgroup")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["nodeid"] for r in records] == [
        "test_heavy.py::test_h1",
        "test_pair_one.py::test_p1", "test_pair_one.py::test_p2",
        "test_pair_two.py::test_p3", "test_pair_two.py::test_p4",
        "test_alpha.py::test_a1", "test_alpha.py::test_a2", "test_alpha.py::test_a3"]
    assert {r["redis"] for r in records} == {"redis://127.0.0.1:6379/12"}


def test_a_serial_run_keeps_redis_url_and_order(tmp_path):
    result, records = _run_suite(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["nodeid"].split("::")[1] for r in records] == [
        "test_a1", "test_a2", "test_a3", "test_h1", "test_p1", "test_p2", "test_p3", "test_p4"]
    assert {(r["worker"], r["redis"]) for r in records} == {(None, "redis://127.0.0.1:6379/12")}


@pytest.mark.parametrize("args, redis_url, message", [
    (("-n", "2"), "redis://127.0.0.1:6379/12",
     "-n runs this suite only with --dist loadgroup (got --dist load)"),
    (("-n", "2", "--dist", "loadgroup"), None, "-n needs REDIS_URL"),
    (("-n", "3", "--dist", "loadgroup"), "redis://127.0.0.1:6379/14",
     "3 xdist workers use Redis databases 14–16"),
], ids=["dist-load", "no-redis-url", "too-many-databases"])
def test_what_would_share_a_resource_is_refused_before_any_test(tmp_path, args, redis_url, message):
    result, records = _run_suite(tmp_path, *args, redis_url=redis_url)
    assert result.returncode == 4  # pytest's usage error
    assert f"ERROR: {message}" in result.stderr
    assert records == []
