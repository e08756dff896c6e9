"""Faults on the gpubox: a rank that dies makes the job fail fast, with the rank and its error named.

The real trainer runs under torchrun (2 ranks, gloo on CPU); the fault is a real one (SIGKILL of one
rank's process, as the out-of-memory killer would), not a hook in the trainer.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from cloud_adapters.base import JobSpec, JobState
from cloud_adapters.gpubox import GpuBoxBackend, _proc
from cloud_adapters.gpubox.backend import _failure_reason


@pytest.fixture
def backend(tmp_path):
    return GpuBoxBackend({"run_root": str(tmp_path / "runs"), "max_procs_per_node": 2, "grace_period_s": 8})


def _rank_pid(run_dir: str, rank: int) -> int | None:
    """The pid of the job's process that torchrun started as ``rank`` (read from its environment)."""
    for pid in _proc.job_processes(run_dir):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and f"LOCAL_RANK={rank}".encode() in env:
            return pid
    return None


def _wait(backend, handle, done, timeout: float):
    deadline = time.monotonic() + timeout
    while not done(status := backend.describe(handle)):
        assert time.monotonic() < deadline, f"timed out; last status {status}"
        time.sleep(0.1)
    return status


def test_fault_sigkill_of_one_rank_fails_the_job_fast_naming_the_rank(backend):
    config = {"train": {"epochs": 200, "log_every_steps": 1}, "parallel": {"procs_per_node": 2}}
    handle = backend.submit(JobSpec(job_name="kill-rank-1", config=config, procs_per_node=2))
    run_dir = handle.provider_job_id
    _wait(backend, handle, lambda s: s.state == JobState.RUNNING, 90)  # the first step is logged
    victim = _rank_pid(run_dir, 1)
    assert victim is not None, _proc.job_processes(run_dir)

    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    status = _wait(backend, handle, lambda s: s.state.is_terminal, 15)
    took = time.monotonic() - killed

    assert status.state == JobState.FAILED, status
    assert took < 15
    assert status.failure_reason.startswith("rank 1 (local rank 1) was killed by SIGKILL (exit code -9)"), \
        status.failure_reason
    assert "torchrun stopped the other ranks" in status.failure_reason
    # rank 0's collateral error (its peer closed the connection) is not offered as the cause
    assert "Connection" not in status.failure_reason
    deadline = time.monotonic() + 5
    while left := _proc.job_processes(run_dir):
        assert time.monotonic() < deadline, f"processes left: {left}"
        time.sleep(0.05)


# torchrun's failure summary as torch 2.x prints it (abridged to the lines the parser reads).
SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
trainer_pkg.launch FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-01-01_10:00:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 101)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_10:00:00
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 102)
  error_file: <N/A>
  traceback : {traceback}
============================================================
"""


@pytest.mark.parametrize("log, expected", [
    # The root-cause rank's own trainer error wins over a later, collateral one from another rank.
    ("trainer error: rank 1: CUDA out of memory. Tried to allocate 2.00 GiB\n"
     "trainer error: rank 0: RuntimeError: Connection closed by peer\n"
     + SUMMARY.format(rank=1, code=1, traceback="To enable traceback see: ..."),
     "trainer error: rank 1: CUDA out of memory. Tried to allocate 2.00 GiB"),
    # An uncaught exception (torch prefixes each line with the rank).
    ("[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: bad shard\n"
     "trainer error: rank 0: RuntimeError: Connection reset by peer\n"
     + SUMMARY.format(rank=1, code=1, traceback="To enable traceback see: ..."),
     "rank 1 (local rank 1): ValueError: bad shard"),
    # A signal: named, with the exit code torchrun reports.
    (SUMMARY.format(rank=3, code=-11, traceback="Signal 11 (SIGSEGV) received by PID 102"),
     "rank 3 (local rank 3) was killed by SIGSEGV (exit code -11); torchrun stopped the other ranks"),
    # Nothing but the summary: the rank and its code.
    (SUMMARY.format(rank=2, code=3, traceback="To enable traceback see: ..."),
     "rank 2 (local rank 2) failed with exit code 3; its error is in the job's log"),
    # torchrun noticed rank 0's collateral error first; rank 1, listed under "Failures:", was killed.
    ("trainer error: rank 0: RuntimeError: Connection reset by peer\n"
     + SUMMARY.replace("rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 101)",
                       "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 101)")
     .format(rank=0, code=1, traceback="To enable traceback see: ..."),
     "rank 1 (local rank 1) was killed by SIGKILL (exit code -9), usually the out-of-memory killer or an "
     "operator (check the machine's memory and `dmesg`); torchrun stopped the other ranks"),
    # A user's script raised, without a rank prefix: its exception line, where its code raised it (the
    # traceback's frame of the job's code/ directory), not torchrun's own wrapper.
    ("Traceback (most recent call last):\n  File \"/r/code/train.py\", line 3, in <module>\n"
     "ValueError: boom from my script\n"
     "E1201 17:03:21.303000 1 api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 102)\n"
     + SUMMARY.format(rank=1, code=1, traceback="To enable traceback see: ..."),
     "rank 1 (local rank 1) failed with exit code 1; the log's last error: train.py:3: ValueError: boom from my "
     "script"),
    # A script's argparse refusing its arguments (exit code 2).
    ("usage: train.py [-h] [--steps STEPS]\ntrain.py: error: unrecognized arguments: --nope\n"
     + SUMMARY.format(rank=0, code=2, traceback="To enable traceback see: ..."),
     "rank 0 (local rank 0) failed with exit code 2; the log's last error: train.py: error: unrecognized "
     "arguments: --nope"),
    # No torchrun summary (a single process): the last trainer error.
    ("noise\ntrainer error: dataset /d/x.npz not found\n", "trainer error: dataset /d/x.npz not found"),
])
def test_fault_failure_reason_names_the_root_cause_rank(tmp_path, log, expected):
    path = tmp_path / "train.log"
    path.write_text(log)
    assert _failure_reason(path, 1) == expected
