"""Fixtures for the web UI and API tests (users, domain objects and the worker come from
tests/conftest.py)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from jobs import dispatch
from taskkit import sent_tasks


@pytest.fixture(autouse=True)
def no_celery_publish():
    """Nothing in these tests reaches a broker: ``submit_job``/``cancel_job`` are recorded instead."""
    with sent_tasks(dispatch.SUBMIT_JOB) as submit, \
            sent_tasks(dispatch.CANCEL_JOB) as cancel:
        yield {"submit": submit, "cancel": cancel}


@pytest.fixture
def owner_client(client, user):
    client.force_login(user)
    return client


@pytest.fixture
def other_client(client, other_user):
    client.force_login(other_user)
    return client


@pytest.fixture
def api_client(user):
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(user)
    return api


@pytest.fixture
def other_api_client(other_user):
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(other_user)
    return api


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    """A QUEUED job of ``user``: digits, cnn, 1 node × 2 processes on the local gpubox."""
    from jobs import services

    return services.training_job_create(
        owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend,
        nodes=1, procs_per_node=2, epochs=3, name="digits-ddp",
    )


@pytest.fixture
def seeded_job(job):
    """``job`` RUNNING with known events, metric points (global and per rank) and log lines."""
    from jobs.models import JobEvent, JobLogLine, MetricPoint, TrainingJob
    from jobs.states import transition

    start = timezone.now() - dt.timedelta(seconds=90)
    transition(job, "SUBMITTING", message="Submitting to backend local", submitted_at=start)
    transition(job, "PENDING", message="Submitted as tb-job")
    transition(job, "RUNNING", message="first step logged", started_at=start)
    TrainingJob.objects.filter(pk=job.pk).update(
        cost_usd="0.0900", billable_seconds=90.0, provider_handle={"provider": "gpubox", "job_name": "x"},
    )
    points = []
    for step, (tl, ta) in enumerate([(2.30, 0.11), (1.20, 0.62), (0.40, 0.90)], start=1):
        points.append(MetricPoint(job=job, name="train_loss", step=step * 10, epoch=step - 1, value=tl,
                                  recorded_at=start))
        points.append(MetricPoint(job=job, name="train_accuracy", step=step * 10, epoch=step - 1, value=ta,
                                  recorded_at=start))
    points += [
        MetricPoint(job=job, name="val_loss", step=30, epoch=0, value=0.55, recorded_at=start),
        MetricPoint(job=job, name="val_accuracy", step=30, epoch=0, value=0.87, recorded_at=start),
    ]
    for rank, (sps, st) in enumerate([(812.5, 0.0394), (798.25, 0.0401)]):
        points.append(MetricPoint(job=job, name="rank_samples_per_s", step=30, rank=rank, value=sps,
                                  recorded_at=start))
        points.append(MetricPoint(job=job, name="rank_step_time_s", step=30, rank=rank, value=st,
                                  recorded_at=start))
    MetricPoint.objects.bulk_create(points)
    JobLogLine.objects.bulk_create(
        [JobLogLine(job=job, seq=i, text=f"log line {i}") for i in range(250)]
    )
    job.refresh_from_db()
    assert JobEvent.objects.filter(job=job).count() == 4
    return job
