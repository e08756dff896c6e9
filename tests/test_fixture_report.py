"""The suite's report of the real parts it started (tests/fixture_report.py): each new process of a
kind is counted once and named by the test file that started it."""

from __future__ import annotations

import os
import subprocess
import sys

import fixture_report
from polling import wait_for

LINGER = "import sys, time; time.sleep(float(sys.argv[1]))"


def _start(seconds: float, *argv: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LINGER, str(seconds), *argv],
                            env={**os.environ, **env})


def _cmdline(proc: subprocess.Popen) -> bytes:
    with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
        return fh.read()


def test_a_started_process_is_counted_once_under_the_test_file_that_started_it():
    counter = fixture_report.ProcessCounter()  # not started: scanned by hand
    kind = "torchrun launches (real trainer, torch's torchrun)"
    here = os.environ["PYTEST_CURRENT_TEST"].split("::", 1)[0]
    procs = [_start(30, "torch.distributed.run"),
             _start(30, "torch.distributed.run", PYTEST_CURRENT_TEST="tests/elsewhere/test_x.py::test_y (call)"),
             _start(30, "not-a-kind")]
    try:
        for proc in procs:  # exec'd: the command line is the new program's
            wait_for(lambda: _cmdline(proc).endswith(b"\0" + proc.args[-1].encode() + b"\0"), timeout=10, interval=0.01)
        counter.scan()
        counter.scan()  # a second look counts nothing again
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert counter.counts[kind] == 2
    assert dict(counter.by_file[kind]) == {here: 1, "tests/elsewhere/test_x.py": 1}
    assert here == "tests/test_fixture_report.py"


def test_a_process_without_the_variable_or_gone_is_named_by_a_question_mark(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    proc = subprocess.Popen([sys.executable, "-c", LINGER, "30"], env=env, cwd="/")
    in_tmp = subprocess.Popen([sys.executable, "-c", LINGER, "30"], env=env, cwd=tmp_path)
    try:
        for started in (proc, in_tmp):
            wait_for(lambda: _cmdline(started).endswith(b"\x0030\x00"), timeout=10, interval=0.01)
        assert fixture_report._started_by(str(proc.pid)) == "?"
        # one that runs in a test's tmp_path (a daemon's child) is named by that directory
        assert fixture_report._started_by(str(in_tmp.pid)) == f"tmp:{tmp_path.name}"
        assert tmp_path.name.startswith("test_a_process_without_the")
    finally:
        for started in (proc, in_tmp):
            started.kill()
            started.wait()
    assert fixture_report._started_by(str(proc.pid)) == "?"  # reaped: no /proc entry


def test_a_slurm_jobs_process_is_named_by_its_modules_work_directory(tmp_path):
    import slurmkit

    base = tmp_path / "tb-slurm-x1y2"
    cluster = slurmkit.SlurmCluster(directory=base, conf=base / "slurm.conf", work_dir=base / "work", pids={})
    cluster.work_dir.mkdir(parents=True)
    run_dir = slurmkit.module_view(cluster, "test_slurm_backend").work_dir / "tb-job-7-a"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    step = subprocess.Popen([sys.executable, "-c", LINGER, "30"], env=env, cwd=run_dir)
    try:
        wait_for(lambda: _cmdline(step).endswith(b"\x0030\x00"), timeout=10, interval=0.01)
        assert fixture_report._started_by(str(step.pid)) == "slurm:test_slurm_backend"
    finally:
        step.kill()
        step.wait()


def test_a_tests_cpu_seconds_count_the_children_it_waited_for_under_its_file():
    class Item:
        nodeid = "tests/some/test_busy.py::test_it"

    fixture_report._cpu.pop("tests/some/test_busy.py", None)
    wrapper = fixture_report.pytest_runtest_protocol(Item(), None)
    next(wrapper)  # the test starts
    spin = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)  # 0.6 s of a child's CPU, waited for
    try:
        next(wrapper)  # the test ends
    except StopIteration:
        pass
    try:
        assert 0.6 <= fixture_report._cpu["tests/some/test_busy.py"] < 30
    finally:
        del fixture_report._cpu["tests/some/test_busy.py"]
