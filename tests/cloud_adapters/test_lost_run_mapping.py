"""Which failures each adapter reports as a lost run (``JobStatus.lost``, docs/recovery.md) and which
are the job's own, and where a lost run's checkpoints are (``Backend.checkpoint_uri``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from google.cloud import aiplatform_v1 as v1

from cloud_adapters.azureml.states import job_status as azure_status
from cloud_adapters.base import JobHandle, JobState
from cloud_adapters.gpubox import _proc
from cloud_adapters.gpubox.backend import GpuBoxBackend
from cloud_adapters.registry import create_backend
from cloud_adapters.slurm import states as slurm_states
from cloud_adapters.slurm.states import SlurmJob
from cloud_adapters.vertex.states import job_status as vertex_status


# -- GPU box --------------------------------------------------------------------------------------


@pytest.fixture
def box(tmp_path):
    return GpuBoxBackend({"run_root": str(tmp_path / "runs"), "max_procs_per_node": 2, "hourly_rate_usd": 0.9})


def _run_dir(box, name):
    run_dir = box.run_root / name
    run_dir.mkdir(parents=True)
    return run_dir, JobHandle("gpubox", name, str(run_dir))


def _dead_pid() -> tuple[int, int]:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = _proc.start_ticks(child.pid)
    child.wait()
    return child.pid, ticks


def test_gpubox_a_vanished_supervisor_is_a_lost_run(box):
    run_dir, handle = _run_dir(box, "tb-job-1-a")
    pid, ticks = _dead_pid()
    _proc.write_json_atomic(run_dir / "supervisor.json", {"pid": pid, "start_ticks": ticks,
                                                          "started_at": time.time() - 30})
    status = box.describe(handle)
    assert (status.state, status.raw_state, status.lost) == (JobState.FAILED, "lost", True)
    assert status.failure_reason == "supervisor process disappeared"
    assert 29 <= status.billable_seconds <= 60


@pytest.mark.parametrize("record, raw, reason", [
    ({"returncode": 1}, "exited 1", "exit code 1"),
    ({"returncode": 0, "max_runtime": True, "reason": "MaxRuntimeExceeded: 60 s"}, "max-runtime",
     "MaxRuntimeExceeded: 60 s"),
    ({"returncode": 1, "stage": "requirements", "reason": "pip failed"}, "requirements failed", "pip failed"),
])
def test_gpubox_the_jobs_own_failures_are_not_lost(box, record, raw, reason):
    run_dir, handle = _run_dir(box, "tb-job-2-a")
    (run_dir / "train.log").write_text("")
    _proc.write_json_atomic(run_dir / "exit.json", {"started_at": time.time() - 5, "ended_at": time.time(),
                                                    **record})
    status = box.describe(handle)
    assert (status.state, status.raw_state, status.failure_reason, status.lost) == (
        JobState.FAILED, raw, reason, False)


def test_gpubox_a_cancelled_run_or_a_removed_run_directory_is_not_lost(box):
    run_dir, handle = _run_dir(box, "tb-job-3-a")
    pid, ticks = _dead_pid()
    _proc.write_json_atomic(run_dir / "supervisor.json", {"pid": pid, "start_ticks": ticks, "started_at": time.time()})
    (run_dir / "cancel_requested").write_text("x\n")
    status = box.describe(handle)
    assert (status.state, status.lost) == (JobState.CANCELLED, False)
    gone = JobHandle("gpubox", "tb-job-4-a", str(box.run_root / "tb-job-4-a"))
    status = box.describe(gone)  # its checkpoints went with it: nothing to resume from
    assert (status.state, status.raw_state, status.lost) == (JobState.FAILED, "lost", False)


def test_gpubox_checkpoint_uri_is_the_runs_checkpoint_directory_never_through_a_link(box, tmp_path):
    run_dir, handle = _run_dir(box, "tb-job-5-a")
    assert box.checkpoint_uri(handle) == ""  # nothing written yet
    (run_dir / "output" / "checkpoints").mkdir(parents=True)
    # What the job.json says is not read back: the place is the adapter's own.
    _proc.write_json_atomic(run_dir / "job.json", {"output": {"checkpoint_dir": "/etc"}})
    assert box.checkpoint_uri(handle) == str(run_dir / "output" / "checkpoints")
    # A job that made its checkpoint directory a link elsewhere: the next attempt is not pointed through it.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "output" / "checkpoints").rmdir()
    os.symlink(elsewhere, run_dir / "output" / "checkpoints")
    assert box.checkpoint_uri(handle) == ""
    second, handle2 = _run_dir(box, "tb-job-5-b")
    os.symlink(elsewhere, second / "output")
    assert box.checkpoint_uri(handle2) == ""
    assert box.checkpoint_uri(JobHandle("gpubox", "tb-job-6-a", str(box.run_root / "tb-job-6-a"))) == ""


# -- Slurm ----------------------------------------------------------------------------------------


@pytest.fixture
def slurm(tmp_path):
    return create_backend("slurm", {"partition": "debug", "work_dir": str(tmp_path)})


@pytest.mark.parametrize("state, lost", [
    ("NODE_FAIL", True), ("PREEMPTED", True), ("BOOT_FAIL", True),
    ("TIMEOUT", False), ("OUT_OF_MEMORY", False), ("DEADLINE", False), ("FAILED", False),
    ("SPECIAL_EXIT", False), ("COMPLETED", False), ("CANCELLED", False), ("RUNNING", False),
    ("REQUEUED", False),  # Slurm restarts it itself: an interruption
])
def test_slurm_lost_states(slurm, state, lost):
    job = SlurmJob(job_id="17", name="tb-job-1-a", state=state, nodes=2, time_limit="1:00", exit_code=1)
    status = slurm._status(JobHandle("slurm", "tb-job-1-a", "17"), job)
    assert status.lost is lost
    assert (state in slurm_states.LOST_STATES) is lost


def test_slurm_a_job_gone_without_an_exit_record_is_lost_and_one_with_a_record_is_not(slurm, tmp_path):
    handle = JobHandle("slurm", "tb-job-2-a", "999999")
    run_dir = tmp_path / "tb-job-2-a"
    run_dir.mkdir()
    status = slurm._status_from_run_dir(handle, str(run_dir))
    assert (status.state, status.raw_state, status.lost) == (JobState.FAILED, "lost", True)
    (run_dir / "exit.json").write_text(json.dumps({"returncode": 3}))
    status = slurm._status_from_run_dir(handle, str(run_dir))
    assert (status.state, status.lost) == (JobState.FAILED, False)
    assert status.failure_reason == "the batch script ended with exit code 3"


def test_slurm_checkpoint_uri_is_the_runs_own_place(slurm, tmp_path):
    handle = JobHandle("slurm", "tb-job-3-a", "18")
    assert slurm.checkpoint_uri(handle) == f"{tmp_path}/tb-job-3-a/output/checkpoints"


# -- Vertex AI, Azure ML --------------------------------------------------------------------------


def _vertex(state, *, spot, error=None):
    strategy = v1.Scheduling.Strategy.SPOT if spot else v1.Scheduling.Strategy.STANDARD
    return vertex_status(v1.CustomJob(state=v1.JobState[state], error=error,
                                      job_spec={"scheduling": {"strategy": strategy}}))


def test_vertex_a_failed_spot_job_lost_to_preemption_is_lost_and_nothing_else_is():
    preempted = {"code": 14, "message": "The Spot VM of workerpool0-0 was preempted (STOCKOUT)"}
    status = _vertex("JOB_STATE_FAILED", spot=True, error=preempted)
    assert (status.state, status.lost, status.spot) == (JobState.FAILED, True, True)
    assert status.failure_reason == "UNAVAILABLE (14): The Spot VM of workerpool0-0 was preempted (STOCKOUT)"
    assert _vertex("JOB_STATE_FAILED", spot=False, error=preempted).lost is False  # on demand: not a reclaim
    user_error = {"code": 3, "message": "The replica workerpool0-0 exited with a non-zero status of 1"}
    assert _vertex("JOB_STATE_FAILED", spot=True, error=user_error).lost is False
    assert _vertex("JOB_STATE_EXPIRED", spot=True, error=preempted).lost is False
    assert _vertex("JOB_STATE_RUNNING", spot=True).lost is False


def test_azure_a_failed_low_priority_job_lost_to_preemption_is_lost_and_nothing_else_is():
    error = "ServiceError: the job's low priority nodes were preempted"
    status = azure_status(status="Failed", error=error, low_priority=True)
    assert (status.state, status.lost) == (JobState.FAILED, True)
    assert azure_status(status="Failed", error=error, low_priority=False).lost is False
    assert azure_status(status="Failed", error="UserError: exited with status code 1", low_priority=True).lost is False
    # Azure ML requeues a preempted low-priority job itself: Queued again, not lost.
    assert azure_status(status="Queued", low_priority=True).lost is False
    assert azure_status(status="NotResponding", error=error, low_priority=True).lost is False
