"""jobs/restarts.py through the sync, on the real GPU-box adapter reading run directories written as
a run leaves them: a lost run is resubmitted while restarts are left, then FAILED with the count; a
job's own failure never is; the budget counts every attempt; cost and billable seconds are summed
over attempts, on the per-job path and in the one-statement path alike (docs/recovery.md)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from cloud_adapters.gpubox import _proc
from jobs import dispatch, restarts, services, sync
from jobs.models import JobAttempt, JobStateChoices as S, MetricPoint, TrainingJob
from jobs.states import transition
from taskkit import sent_tasks
from trainer_pkg.metrics import format_metric_line

pytestmark = pytest.mark.django_db


def _dead_pid() -> tuple[int, int]:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = _proc.start_ticks(child.pid)
    child.wait()
    return child.pid, ticks


def _pending(job: TrainingJob, run_root: Path) -> Path:
    """Put ``job``'s current attempt on the box: PENDING with its handle and an empty run directory."""
    job.refresh_from_db()
    run_dir = run_root / job.provider_job_name
    run_dir.mkdir()
    if not job.checkpoint_uri:  # its own checkpoint directory, as the trainer makes it
        (run_dir / "output" / "checkpoints").mkdir(parents=True)
    _proc.write_json_atomic(run_dir / "job.json", {"output": {
        "output_dir": str(run_dir / "output"),
        "checkpoint_dir": job.checkpoint_uri or str(run_dir / "output" / "checkpoints")}})
    transition(job, S.SUBMITTING, message="test")
    transition(job, S.PENDING, message="test")
    TrainingJob.objects.filter(pk=job.pk).update(
        provider_handle={"provider": "gpubox", "job_name": job.provider_job_name, "provider_job_id": str(run_dir)})
    return run_dir


def _lose(run_dir: Path, *, ran_s: float, log: list[str] = ()) -> None:
    """The run as a reboot leaves it: a supervisor.json whose process is gone, no exit.json; the log
    last written ``ran_s`` seconds after the start (the adapter's end of a lost run)."""
    pid, ticks = _dead_pid()
    started = time.time() - 600
    _proc.write_json_atomic(run_dir / "supervisor.json", {"pid": pid, "start_ticks": ticks, "started_at": started})
    (run_dir / "train.log").write_text("".join(f"{line}\n" for line in log))
    os.utime(run_dir / "train.log", (started + ran_s, started + ran_s))


def _finish(run_dir: Path, *, returncode: int, ran_s: float, log: list[str] = ()) -> None:
    started = time.time() - 300
    _proc.write_json_atomic(run_dir / "supervisor.json", {"pid": 999999999, "started_at": started})
    (run_dir / "train.log").write_text("".join(f"{line}\n" for line in log))
    _proc.write_json_atomic(run_dir / "exit.json", {"returncode": returncode, "started_at": started,
                                                    "ended_at": started + ran_s})


@pytest.fixture
def sync_pass(django_capture_on_commit_callbacks):
    """One sync pass of a backend; what it sends after commit is sent at its end, as in a worker
    (the test's own transaction never commits)."""
    def run(backend) -> None:
        with django_capture_on_commit_callbacks(execute=True):
            sync.backend_sync(backend_id=backend.pk)
    return run


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=local_backend, procs_per_node=1, epochs=3)


def _reload(job) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def test_a_lost_run_is_resubmitted_from_its_checkpoint_and_the_cost_is_the_sum_of_its_attempts(
        sync_pass, job, local_backend, run_root):
    first = _pending(job, run_root)
    _lose(first, ran_s=100)
    with sent_tasks(dispatch.SUBMIT_JOB) as sent:
        sync_pass(local_backend)
    job = _reload(job)
    assert job.state == S.QUEUED and job.attempt == 2
    assert job.provider_job_name == f"{first.name}-a2" and job.provider_handle is None and job.log_cursor == ""
    assert job.checkpoint_uri == str(first / "output" / "checkpoints")
    assert sent.call_count == 1 and sent.call_args.kwargs["args"] == [job.pk]
    event = job.events.last()
    assert (event.from_state, event.to_state) == (S.PENDING, S.QUEUED)
    assert event.message == "run lost (supervisor process disappeared); resubmitting, attempt 2 of 3"
    (lost,) = JobAttempt.objects.filter(job=job)
    assert (lost.number, lost.provider_job_name, lost.outcome, lost.raw_state) == (1, first.name, "lost", "lost")
    assert lost.provider_handle["provider_job_id"] == str(first)
    assert lost.reason == "supervisor process disappeared" and lost.checkpoint_uri == job.checkpoint_uri
    assert lost.billable_seconds == pytest.approx(100, abs=0.01)
    assert lost.cost_usd == Decimal("0.1000")  # 100 s × $3.60/h
    assert (job.billable_seconds, job.cost_usd) == (pytest.approx(100, abs=0.01), Decimal("0.1000"))

    # Attempt 2 runs on the box from attempt 1's checkpoint directory and succeeds in 50 s.
    second = _pending(job, run_root)
    assert json.loads((second / "job.json").read_text())["output"]["checkpoint_dir"] == lost.checkpoint_uri
    _finish(second, returncode=0, ran_s=50)
    sync_pass(local_backend)
    job = _reload(job)
    assert job.state == S.SUCCEEDED and job.attempt == 2
    assert job.billable_seconds == pytest.approx(150, abs=0.01)
    assert job.cost_usd == Decimal("0.1500")  # $0.10 + 50 s × $3.60/h
    sync_pass(local_backend)  # ended: a later pass changes nothing, never adds twice
    assert _reload(job).cost_usd == Decimal("0.1500")


def test_when_the_restarts_are_used_up_the_job_fails_with_the_count(sync_pass, job, local_backend, run_root):
    local_backend.max_restarts = 1
    local_backend.save(update_fields=["max_restarts"])
    _lose(_pending(job, run_root), ran_s=36)
    with sent_tasks(dispatch.SUBMIT_JOB):
        sync_pass(local_backend)
    assert _reload(job).state == S.QUEUED
    _lose(_pending(job, run_root), ran_s=72)
    with sent_tasks(dispatch.SUBMIT_JOB) as sent:
        sync_pass(local_backend)
    job = _reload(job)
    assert job.state == S.FAILED and sent.call_count == 0
    assert job.failure_reason == "run lost 2 times (supervisor process disappeared); max restarts 1 reached"
    assert job.events.last().message == f"lost: {job.failure_reason}"
    assert JobAttempt.objects.filter(job=job).count() == 1  # the last attempt is the job's own row
    assert job.cost_usd == Decimal("0.1080")  # (36 + 72) s × $3.60/h
    assert job.billable_seconds == pytest.approx(108, abs=0.01)


def test_max_restarts_zero_keeps_the_backends_reason_and_a_jobs_own_failure_is_never_resubmitted(
        sync_pass, job, local_backend, run_root, user, digits_dataset, cnn_model):
    local_backend.max_restarts = 0
    local_backend.save(update_fields=["max_restarts"])
    _lose(_pending(job, run_root), ran_s=10)
    sync_pass(local_backend)
    job = _reload(job)
    assert (job.state, job.failure_reason, job.attempt) == (S.FAILED, "supervisor process disappeared", 1)
    assert not JobAttempt.objects.filter(job=job).exists()

    local_backend.max_restarts = 2
    local_backend.save(update_fields=["max_restarts"])
    with sent_tasks(dispatch.SUBMIT_JOB):
        own = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=local_backend, procs_per_node=1, epochs=1)
    _finish(_pending(own, run_root), returncode=1, ran_s=5, log=["trainer error: rank 0: out of data"])
    with sent_tasks(dispatch.SUBMIT_JOB) as sent:
        sync_pass(local_backend)
    own = _reload(own)
    assert own.state == S.FAILED and own.attempt == 1 and sent.call_count == 0
    assert not JobAttempt.objects.filter(job=own).exists()


def test_the_budget_counts_every_attempt(sync_pass, job, local_backend, run_root):
    TrainingJob.objects.filter(pk=job.pk).update(budget_usd=Decimal("0.1000"))
    _lose(_pending(job, run_root), ran_s=100)  # $0.10: the budget is spent
    with sent_tasks(dispatch.SUBMIT_JOB) as sent:
        sync_pass(local_backend)
    job = _reload(job)
    assert job.state == S.FAILED and sent.call_count == 0
    assert job.failure_reason == ("run lost (supervisor process disappeared); not resubmitted: the cost of its "
                                  "attempts, $0.10, reached its budget of $0.10")


def test_cancel_while_waiting_for_the_next_attempt_keeps_the_cost_so_far(sync_pass, job, local_backend, run_root):
    _lose(_pending(job, run_root), ran_s=100)
    with sent_tasks(dispatch.SUBMIT_JOB):
        sync_pass(local_backend)
    services.training_job_cancel(job=_reload(job))
    job = _reload(job)
    assert job.state == S.CANCELLED and job.cost_usd == Decimal("0.1000")
    assert [e.to_state for e in job.events.all()][-2:] == [S.QUEUED, S.CANCELLED]


def test_a_resumed_attempt_replaces_the_steps_the_lost_one_did_after_its_checkpoint(sync_pass, job, local_backend,
                                                                                   run_root):
    """Attempt 1 logged steps 1–30 and epoch 0 (step 20), then was lost after its epoch-0 checkpoint;
    attempt 2 resumes at step 21: the job keeps steps 1–20 of attempt 1 and 21– of attempt 2, once."""
    def step(n, epoch, loss):
        return format_metric_line({"event": "step", "step": n, "epoch": epoch, "train_loss": loss})

    lines = [step(n, 0 if n <= 20 else 1, 1.0) for n in range(10, 31, 10)]
    lines.insert(2, format_metric_line({"event": "epoch", "step": 20, "epoch": 0, "val_accuracy": 0.5}))
    _lose(_pending(job, run_root), ran_s=30, log=lines)
    with sent_tasks(dispatch.SUBMIT_JOB):
        sync_pass(local_backend)
    assert list(MetricPoint.objects.filter(job=job, name="train_loss").values_list("step", flat=True)) == [10, 20, 30]

    resumed = [format_metric_line({"event": "started", "step": 21, "epoch": 1, "resumed": True}),
               step(30, 1, 0.5), step(40, 1, 0.4),
               format_metric_line({"event": "epoch", "step": 40, "epoch": 1, "val_accuracy": 0.8})]
    _finish(_pending(job, run_root), returncode=0, ran_s=20, log=resumed)
    sync_pass(local_backend)
    losses = list(MetricPoint.objects.filter(job=job, name="train_loss").order_by("step").values_list("step", "value"))
    assert losses == [(10, 1.0), (20, 1.0), (30, 0.5), (40, 0.4)]
    epochs = list(MetricPoint.objects.filter(job=job, name="val_accuracy").order_by("step").values_list("epoch", "step"))
    assert epochs == [(0, 20), (1, 40)]
    assert _reload(job).final_metrics["train_loss"] == 0.4


def test_the_one_statement_path_sums_the_closed_attempts_as_the_per_job_path_does(job, local_backend):
    """A RUNNING attempt 2 left out of describe_many: PostgreSQL's statement writes the closed
    attempts' figures plus the run interval, as :func:`jobs.sync._unchanged_fields` computes them."""
    now = timezone.now()
    started = now - dt.timedelta(seconds=60)
    TrainingJob.objects.filter(pk=job.pk).update(state=S.RUNNING, attempt=2, started_at=started, instance_count=1)
    JobAttempt.objects.create(job=job, number=1, billable_seconds=100.0, cost_usd=Decimal("0.1000"))
    job = _reload(job)
    expected = sync._unchanged_fields(job, now)
    assert expected["billable_seconds"] == pytest.approx(160, abs=0.01)
    assert expected["cost_usd"] == Decimal("0.1600")
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL (DATABASE_URL)")
    assert sync._sync_unchanged([job.pk], now) == []
    job = _reload(job)
    assert job.billable_seconds == pytest.approx(expected["billable_seconds"], abs=1e-6)
    assert job.cost_usd == expected["cost_usd"]
    assert restarts.closed_totals(job) == (100.0, Decimal("0.1000"))


def test_attempt_names_are_deterministic_and_never_the_lost_ones(job):
    assert restarts.attempt_job_name(job, 1) == job.provider_job_name
    assert restarts.attempt_job_name(job, 3) == f"{job.provider_job_name}-a3"
    assert len(restarts.attempt_job_name(job, 99)) < 63


def test_a_pass_holding_the_lost_runs_status_after_another_pass_resubmitted_it_changes_nothing(
        sync_pass, job, local_backend, run_root, django_capture_on_commit_callbacks):
    """Two passes read the same lost run; the first resubmits it. The second's status is of attempt 1,
    which the job no longer follows: it must not close attempt 2 as lost too (ci: the Kubernetes
    recovery e2e ended at attempt 3 after one eviction)."""
    from jobs.adapters import backend_adapter

    first = _pending(job, run_root)
    _lose(first, ran_s=100)
    stale = _reload(job)  # the second pass's list entry, taken before the first pass wrote
    adapter = backend_adapter(local_backend)
    handle = sync.JobHandle.from_dict(stale.provider_handle)
    status = adapter.describe_many([handle])[handle.job_name]
    assert status.lost  # what the second pass holds
    with sent_tasks(dispatch.SUBMIT_JOB):
        sync_pass(local_backend)  # the first pass: attempt 2 queued
    second = _pending(job, run_root)  # and submitted: PENDING on the box under its own name
    with sent_tasks(dispatch.SUBMIT_JOB) as sent, django_capture_on_commit_callbacks(execute=True):
        sync._sync_one(adapter, stale, status, timezone.now(), read_logs=True, mask=lambda text: text)
    job = _reload(job)
    assert (job.state, job.attempt, job.provider_job_name) == (S.PENDING, 2, second.name)
    assert JobAttempt.objects.filter(job=job).count() == 1 and sent.call_count == 0
