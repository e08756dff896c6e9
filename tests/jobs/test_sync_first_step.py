"""A job whose trainer is training is RUNNING even while its provider still reports PENDING (the
status is read before the log in one pass, or the provider is late), and a job's timeline never
holds a move from a state to itself."""

from __future__ import annotations

import time

import pytest

from cloud_adapters.base import JobState, JobStatus
from jobs import sync
from jobs.models import JobEvent, JobStateChoices as S, MetricPoint, TrainingJob
from jobs.selectors import training_job_interruption_count
from trainer_pkg.metrics import format_metric_line

from test_sync import ScriptedBackend, scripted_backend, submitted_job  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db


def now_rec(event, **fields):
    """A trainer record stamped now (after the job entered PENDING)."""
    return "[rank0]: " + format_metric_line({"event": event, "time": time.time(), **fields})


def pending(secondary="Downloading"):
    return JobStatus(JobState.PENDING, raw_state="InProgress", secondary_state=secondary, instance_count=2)


def test_a_job_whose_trainer_logs_steps_is_running_though_the_provider_still_says_pending(
        submitted_job, scripted_backend):
    job = submitted_job
    ScriptedBackend.statuses = [pending(), pending(), pending(),
                                JobStatus(JobState.RUNNING, raw_state="InProgress", secondary_state="Training",
                                          instance_count=2)]
    ScriptedBackend.log_chunks = [["booting"]]
    sync.backend_sync(backend_id=scripted_backend.pk)
    assert TrainingJob.objects.get(pk=job.pk).state == S.PENDING  # nothing trained yet

    # The pass reads the provider's PENDING, then the log: the trainer's first records are in it.
    ScriptedBackend.log_chunks.append([now_rec("started", epoch=0, step=1, world_size=4),
                                       now_rec("step", epoch=0, step=10, train_loss=1.5, lr=0.05)])
    sync.backend_sync(backend_id=scripted_backend.pk)
    job = TrainingJob.objects.get(pk=job.pk)
    assert job.state == S.RUNNING
    assert MetricPoint.objects.filter(job=job, name="train_loss").count() == 1
    assert job.first_step_at is not None
    assert job.events.last().message == "first step logged (the backend still reports InProgress / Downloading)"

    # The provider says the same PENDING once more (it is late): no interruption, still RUNNING;
    # then it catches up with RUNNING: no second move.
    sync.backend_sync(backend_id=scripted_backend.pk)
    sync.backend_sync(backend_id=scripted_backend.pk)
    job = TrainingJob.objects.get(pk=job.pk)
    assert (job.state, job.secondary_state, training_job_interruption_count(job=job)) == (S.RUNNING, "Training", 0)
    assert list(job.events.values_list("from_state", "to_state")) == [
        ("", S.QUEUED), (S.QUEUED, S.SUBMITTING), (S.SUBMITTING, S.PENDING), (S.PENDING, S.RUNNING)]


def test_a_job_left_out_of_describe_many_moves_to_running_on_its_first_logged_step(
        submitted_job, scripted_backend, monkeypatch):
    job = submitted_job
    monkeypatch.setattr(ScriptedBackend, "describe_many", lambda self, handles, changed_since=None: {})
    ScriptedBackend.log_chunks = [[now_rec("started", epoch=0, step=1, world_size=4)]]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job = TrainingJob.objects.get(pk=job.pk)
    assert job.state == S.RUNNING
    assert job.events.last().message == "first step logged"


def test_records_of_an_earlier_run_do_not_end_an_interruption(submitted_job, scripted_backend):
    """After RUNNING → PENDING (a spot reclaim), the log lines the lost run wrote before it are no
    sign of training: the job stays PENDING until its provider (or a new record) says otherwise."""
    job = submitted_job
    ScriptedBackend.statuses = [
        JobStatus(JobState.RUNNING, raw_state="InProgress", secondary_state="Training", instance_count=2),
        pending("Interrupted")]
    sync.backend_sync(backend_id=scripted_backend.pk)
    before = time.time() - 5  # written before the interruption was seen
    ScriptedBackend.log_chunks = [["[rank0]: " + format_metric_line({"event": "step", "time": before, "epoch": 0,
                                                                       "step": 10, "train_loss": 1.2})]]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job = TrainingJob.objects.get(pk=job.pk)
    assert (job.state, training_job_interruption_count(job=job)) == (S.PENDING, 1)

