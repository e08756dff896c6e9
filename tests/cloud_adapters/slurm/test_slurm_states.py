"""Slurm's states, row by row, and the fixed formats of squeue, sacct and scontrol as Slurm 22.05
prints them (lines copied from the test cluster's output, tests/slurmkit.py)."""

from __future__ import annotations

import datetime as dt

import pytest

from cloud_adapters.base import JobHandle, JobState
from cloud_adapters.registry import create_backend
from cloud_adapters.slurm import states
from cloud_adapters.slurm.states import SlurmJob

UTC = dt.timezone.utc
START = dt.datetime(2026, 12, 1, 23, 45, 53, tzinfo=UTC)
END = dt.datetime(2026, 12, 1, 23, 47, 0, tzinfo=UTC)


@pytest.fixture
def backend(tmp_path):
    return create_backend("slurm", {"partition": "debug", "work_dir": str(tmp_path)})


HANDLE = JobHandle(provider="slurm", job_name="tb-job-1-a", provider_job_id="17")

# (Slurm state, reason, JobState, secondary_state, failure_reason)
TABLE = [
    ("PENDING", "Resources", JobState.PENDING, "waiting: Resources", ""),
    ("PENDING", "Priority", JobState.PENDING, "waiting: Priority", ""),
    ("PENDING", "QOSMaxJobsPerUserLimit", JobState.PENDING, "waiting: QOSMaxJobsPerUserLimit", ""),
    ("PENDING", "", JobState.PENDING, "waiting", ""),
    ("CONFIGURING", "", JobState.PENDING, "nodes booting / configuring", ""),
    ("REQUEUED", "", JobState.PENDING, "requeued (REQUEUED)", ""),
    ("REQUEUE_HOLD", "", JobState.PENDING, "requeued (REQUEUE_HOLD)", ""),
    ("SUSPENDED", "", JobState.PENDING, "suspended by Slurm", ""),
    ("RUNNING", "", JobState.RUNNING, "", ""),
    ("COMPLETING", "", JobState.RUNNING, "completing", ""),
    ("STAGE_OUT", "", JobState.RUNNING, "stage_out", ""),
    ("COMPLETED", "", JobState.SUCCEEDED, "", ""),
    ("CANCELLED", "", JobState.CANCELLED, "", "cancelled on the cluster (scancel)"),
    ("TIMEOUT", "TimeLimit", JobState.FAILED, "", "time limit (--time 1:00) reached: Slurm stopped the job"),
    ("NODE_FAIL", "", JobState.FAILED, "", "a node of the job failed (NODE_FAIL); Slurm ended the job"),
    ("PREEMPTED", "", JobState.FAILED, "", "preempted by a higher-priority job (PREEMPTED)"),
    ("OUT_OF_MEMORY", "", JobState.FAILED, "", "out of memory (OUT_OF_MEMORY): a process used more than the job's --mem"),
    ("BOOT_FAIL", "", JobState.FAILED, "", "a node failed to boot (BOOT_FAIL)"),
    ("DEADLINE", "", JobState.FAILED, "", "deadline (--deadline) reached before the job could end (DEADLINE)"),
    ("FAILED", "NonZeroExitCode", JobState.FAILED, "", "the batch script ended with exit code 2"),
    ("SPECIAL_EXIT", "", JobState.FAILED, "", "ended in Slurm's SPECIAL_EXIT state (a requeue that failed)"),
]


@pytest.mark.parametrize("slurm_state, reason, state, secondary, failure", TABLE)
def test_state_table(backend, slurm_state, reason, state, secondary, failure):
    job = SlurmJob(job_id="17", name="tb-job-1-a", state=slurm_state, reason=reason, nodes=2, time_limit="1:00",
                   exit_code=2, started_at=START, ended_at=END)
    status = backend._status(HANDLE, job)
    assert (status.state, status.raw_state, status.secondary_state, status.failure_reason, status.warning) == (
        state, slurm_state, secondary, failure, "")
    assert status.instance_count == 2


def test_every_named_state_is_in_the_table():
    named = states.PENDING_STATES | states.RUNNING_STATES | states.TERMINAL_STATES
    assert {row[0] for row in TABLE} <= named
    assert all(states.job_state(s) is not None for s in named)


def test_cancelled_by_trainboard_and_failed_with_the_trainers_error(backend, tmp_path):
    run_dir = tmp_path / "tb-job-1-a"
    run_dir.mkdir()
    (run_dir / "cancel_requested").write_text("x\n")
    (run_dir / "slurm.log").write_text("x\n[rank1]: trainer error: rank 1: out of data\nsrun: error: n2: task 1\n")
    cancelled = backend._status(HANDLE, SlurmJob(job_id="17", state="CANCELLED"))
    assert cancelled.failure_reason == "cancelled from Trainboard (scancel)"
    failed = backend._status(HANDLE, SlurmJob(job_id="17", state="FAILED", exit_code=1))
    assert failed.failure_reason == "trainer error: rank 1: out of data"


def test_unknown_state_stays_active_with_a_warning(backend):
    status = backend._status(HANDLE, SlurmJob(job_id="17", state="UPDATE_DB", started_at=START))
    assert status.state is JobState.RUNNING and not status.state.is_terminal
    assert status.warning.startswith("Slurm reports state 'UPDATE_DB', which Trainboard does not know")
    assert backend._status(HANDLE, SlurmJob(job_id="17", state="WEIRD")).state is JobState.PENDING


def test_parse_squeue():
    text = ("17|tb-job-1-a|RUNNING|None|2026-12-01T23:45:53|2026-12-01T23:55:53|2|10:00|trainboard-job-id=1|"
            "2026-12-01T23:45:51\n"
            "18|tb-job-2-a|PENDING|Resources|2026-12-01T23:55:53|2026-12-02T00:05:53|2|10:00|(null)|"
            "2026-12-01T23:45:52\n"
            "garbage line\n")
    running, pending = states.parse_squeue(text)
    assert running == SlurmJob(job_id="17", name="tb-job-1-a", state="RUNNING", reason="", started_at=START,
                               ended_at=None, nodes=2, time_limit="10:00", comment="trainboard-job-id=1",
                               submitted_at=dt.datetime(2026, 12, 1, 23, 45, 51, tzinfo=UTC))
    # A pending job's start and end are squeue's forecast, not a start.
    assert (pending.state, pending.reason, pending.started_at, pending.comment) == ("PENDING", "Resources", None, "")


def test_parse_sacct():
    text = ("17|tb-job-1-a|CANCELLED by 0|None|2026-12-01T23:45:53|2026-12-01T23:47:00|00:01:07|0:15|2|10:00\n"
            "18|tb-job-2-a|TIMEOUT|TimeLimit|2026-12-01T23:45:53|2026-12-01T23:47:00|00:01:07|0:0|1|00:01:00\n")
    cancelled, timeout = states.parse_sacct(text)
    assert (cancelled.state, cancelled.exit_code, cancelled.signal, cancelled.started_at, cancelled.ended_at) == (
        "CANCELLED", 0, 15, START, END)
    assert (timeout.state, timeout.reason, timeout.nodes, timeout.time_limit) == ("TIMEOUT", "TimeLimit", 1, "00:01:00")


def test_parse_scontrol():
    text = ("JobId=1 JobName=tb-job-1-a UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 "
            "JobState=FAILED Reason=NonZeroExitCode Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
            "ExitCode=2:0 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-01T23:45:51 "
            "StartTime=2026-12-01T23:45:53 EndTime=2026-12-01T23:47:00 NodeList=n[1-2] NumNodes=2 "
            "Comment=trainboard-job-id=1 Command=/w/job.sbatch\n")
    (job,) = states.parse_scontrol(text)
    assert (job.job_id, job.name, job.state, job.reason, job.exit_code, job.nodes, job.started_at, job.ended_at,
            job.comment, job.time_limit) == ("1", "tb-job-1-a", "FAILED", "NonZeroExitCode", 2, 2, START, END,
                                             "trainboard-job-id=1", "UNLIMITED")
