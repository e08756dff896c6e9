"""A language model's records through the sync: ``val_perplexity`` (epoch records) and ``tokens_per_s``
(step records) are stored as global series, followed by ``submit_job --wait`` and in its ``--json``."""

from __future__ import annotations

import math

import pytest

from jobs import selectors, sync
from jobs.management.commands.submit_job import Command as SubmitJob
from jobs.models import MetricPoint
from metrickit import metric_series
from cloud_adapters.base import JobState, JobStatus
from test_sync import T0, ScriptedBackend, rec, scripted_backend, submitted_job  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db


def test_a_language_models_perplexity_and_tokens_per_s_are_stored_and_reported(submitted_job, scripted_backend):
    job = submitted_job
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, instance_count=2)]
    ScriptedBackend.log_chunks = [[
        rec("step", dt=5, epoch=0, step=10, train_loss=3.1, train_accuracy=0.2, samples_per_s=40.0,
            tokens_per_s=40.0 * 256, lr=3e-4),
        rec("epoch", dt=8, epoch=0, step=12, val_loss=2.5, val_accuracy=0.31, val_perplexity=math.exp(2.5)),
        rec("epoch", dt=9, epoch=1, step=24, val_loss=2.0, val_accuracy=0.4, val_perplexity=math.exp(2.0)),
    ]]
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1

    series = metric_series(job=job)
    assert [(p["step"], p["epoch"], p["value"]) for p in series["val_perplexity"]] == [
        (12, 0, pytest.approx(12.182494)), (24, 1, pytest.approx(7.389056))]
    assert [(p["step"], p["value"]) for p in series["tokens_per_s"]] == [(10, 10240.0)]
    assert MetricPoint.objects.filter(job=job, name="val_perplexity", rank__isnull=False).count() == 0

    lines, _ = selectors.training_job_progress(job=job)
    assert [text for _, text in lines if text.startswith("epoch")] == [
        "epoch 0 val_accuracy 0.3100, val_loss 2.5000, val_perplexity 12.1825",
        "epoch 1 val_accuracy 0.4000, val_loss 2.0000, val_perplexity 7.3891"]

    metrics = SubmitJob()._summary(job)["metrics"]  # what submit_job --json prints
    assert metrics["val_perplexity"] == pytest.approx(7.389056)
    assert metrics["val_loss"] == 2.0 and metrics["tokens_per_s"] == 10240.0


def test_the_move_to_running_is_followed_before_the_epochs_the_same_sync_brought(submitted_job, scripted_backend):
    """A sync sees RUNNING after the trainer has begun, and brings its first epochs in the same pass:
    the transition is placed at the platform's start time, so submit_job --wait and the demo print
    "PENDING → RUNNING" before the epochs (the new-user trial saw them after)."""
    job = submitted_job
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, instance_count=2)]
    ScriptedBackend.log_chunks = [[
        rec("epoch", dt=8, epoch=0, step=12, val_loss=2.5, val_accuracy=0.31),
        rec("epoch", dt=9, epoch=1, step=24, val_loss=2.0, val_accuracy=0.4),
    ]]
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1
    lines, _ = selectors.training_job_progress(job=job)
    # The trainer's clock (T0, in 2024 here) says its epochs came before the job was even created.
    assert [text for _, text in lines] == [
        "QUEUED", "QUEUED → SUBMITTING", "SUBMITTING → PENDING", "PENDING → RUNNING",
        "epoch 0 val_accuracy 0.3100, val_loss 2.5000", "epoch 1 val_accuracy 0.4000, val_loss 2.0000"]
    times = [when for when, _ in lines]
    assert times == sorted(times)
