"""The GPU box's runner (cloud_adapters/gpubox/runner.py): a real runner process on a Unix socket starts
the supervisors of real digits jobs (torchrun, gloo), which outlive the process that submitted them;
what it refuses, and what a submit does when no runner answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud_adapters.base import JobState, ProviderError
from cloud_adapters.gpubox import GpuBoxBackend, _proc, runner
from cloud_adapters.gpubox import backend as backend_module
from polling import wait_for

ROOT = Path(__file__).resolve().parents[3]
CONFIG = {"train": {"epochs": 1}, "parallel": {"procs_per_node": 2}}


def _start_runner(socket_path: Path, run_root: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "cloud_adapters.gpubox.runner", "--socket", str(socket_path),
                             "--run-root", str(run_root)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: socket_path.exists(), timeout=20, what="the runner's socket")
    except BaseException:
        _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read() if proc.stdout else ""


@pytest.fixture
def box(tmp_path, monkeypatch):
    """``(backend, runner process, socket path)``: a backend whose submits go through a real runner."""
    run_root = tmp_path / "runs"
    run_root.mkdir()
    socket_path = tmp_path / "r.sock"
    proc = _start_runner(socket_path, run_root)
    monkeypatch.setenv(runner.SOCKET_VAR, str(socket_path))
    backend = GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 2, "grace_period_s": 8,
                             "hourly_rate_usd": 0.9})
    try:
        yield backend, proc, socket_path
    finally:
        _stop(proc)
        for run_dir in run_root.iterdir():  # nothing of a failed test keeps running
            _proc.signal_job(str(run_dir), signal.SIGKILL)


def _spec(name: str, config: dict | None = None):
    from cloud_adapters.base import JobSpec

    return JobSpec(job_name=name, config=config or CONFIG, procs_per_node=2)


def _parent(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1])


def _ended(backend, handle, timeout: float = 240):
    return wait_for(lambda: (s := backend.describe(handle)).state.is_terminal and s, timeout=timeout,
                    what=f"{handle.job_name} to end")


def test_a_job_started_through_the_runner_is_the_runners_child_and_succeeds(box):
    backend, proc, socket_path = box
    assert runner.SOCKET_VAR == backend_module.RUNNER_SOCKET_VAR == "TRAINBOARD_GPUBOX_RUNNER_SOCKET"
    assert runner.ping(str(socket_path))["pid_ns"] == runner.pid_namespace()
    handle = backend.submit(_spec("via-runner"))
    run_dir = Path(handle.provider_job_id)
    sup = json.loads((run_dir / "supervisor.json").read_text())
    assert sup["start_ticks"] == _proc.start_ticks(sup["pid"])
    # The runner, not this (worker) process, is the supervisor's parent.
    assert _parent(sup["pid"]) == proc.pid
    assert backend.submit(_spec("via-runner")) == handle  # a retry adopts it
    status = _ended(backend, handle)
    assert status.state == JobState.SUCCEEDED, status
    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert exit_info["returncode"] == 0 and exit_info["cancelled"] is False
    metrics = [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("event") == "epoch" for m in metrics), metrics[-3:]
    # The job's variables reached the supervisor through the pipe, never the disk.
    assert "started supervisor pid" in _stop(proc)


def test_the_job_outlives_the_process_that_submitted_it(box, tmp_path):
    """A worker's container restart, in small: the submitting process is SIGKILLed mid-job and a new
    process (this one) follows the job to its end from the run directory alone."""
    backend, _proc_runner, socket_path = box
    code = (
        "import sys, json; from cloud_adapters.gpubox import GpuBoxBackend; from cloud_adapters.base import JobSpec\n"
        f"b = GpuBoxBackend({{'run_root': {str(backend.run_root)!r}, 'max_procs_per_node': 2, 'grace_period_s': 8}})\n"
        "h = b.submit(JobSpec(job_name='outlives', config={'train': {'epochs': 6}, 'parallel': {'procs_per_node': 2}},"
        " procs_per_node=2))\n"
        "print(h.provider_job_id, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, runner.SOCKET_VAR: str(socket_path)})
    try:
        run_dir = Path(worker.stdout.readline().strip())
        handle = backend._handle(run_dir.name, run_dir)
        wait_for(lambda: backend.describe(handle).state == JobState.RUNNING, timeout=120,
                 what="the job to log its first step")
    finally:
        worker.kill()
        worker.wait()
    assert backend.describe(handle).state == JobState.RUNNING
    status = _ended(backend, handle)
    assert status.state == JobState.SUCCEEDED, (status, (run_dir / "train.log").read_text()[-2000:])


def test_the_runner_refuses_what_it_must_not_start_listing_every_problem(box, tmp_path):
    _backend, _p, socket_path = box
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(runner.RunnerError) as refused:
            runner._request(str(socket_path), {"op": "start", "args": ["--run-dir", str(outside), "--start-lock-fd", "3"],
                                               "env": {"A": "1"}, "cwd": str(outside), "pid_ns": "pid:[1]"},
                            fds=(read_end, write_end))
    finally:
        os.close(read_end)
        os.close(write_end)
    message = str(refused.value)
    assert refused.value.reached is True
    assert "expected 3 descriptors (stdin, log, start lock), got 2" in message
    assert "--start-lock-fd is the runner's to set" in message
    assert f"cwd: {outside} is not inside the runner's run root" in message
    assert "the worker runs in PID namespace pid:[1]" in message and 'pid: "service:gpubox-runner"' in message
    with pytest.raises(runner.RunnerError, match="unknown op 'exec'"):
        runner._request(str(socket_path), {"op": "exec"})


def test_no_runner_answering_is_a_transient_error_and_a_retry_starts_the_run(tmp_path, monkeypatch):
    run_root = tmp_path / "runs"
    run_root.mkdir()
    socket_path = tmp_path / "r.sock"
    monkeypatch.setenv(runner.SOCKET_VAR, str(socket_path))
    backend = GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 2, "grace_period_s": 8})
    with pytest.raises(ProviderError) as err:
        backend.submit(_spec("no-runner"))
    assert err.value.transient is True
    assert f"the GPU box's runner at {socket_path} is not answering" in str(err.value)
    run_dir = run_root / "no-runner"
    assert not (run_dir / "exit.json").exists() and not (run_dir / "supervisor.json").exists()
    ping = subprocess.run([sys.executable, "-m", "cloud_adapters.gpubox.runner", "--socket", str(socket_path),
                           "--ping"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert ping.returncode == 1 and "is not answering" in ping.stderr

    proc = _start_runner(socket_path, run_root)
    try:
        ping = subprocess.run([sys.executable, "-m", "cloud_adapters.gpubox.runner", "--socket", str(socket_path),
                               "--ping"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert ping.returncode == 0, ping.stderr
        handle = backend.submit(_spec("no-runner"))
        assert _parent(json.loads((run_dir / "supervisor.json").read_text())["pid"]) == proc.pid
        assert _ended(backend, handle).state == JobState.SUCCEEDED
    finally:
        _stop(proc)
        _proc.signal_job(str(run_dir), signal.SIGKILL)
    assert not socket_path.exists()  # the runner removes its socket when it stops
