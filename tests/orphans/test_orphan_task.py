"""The Celery task jobs.tasks.reconcile_orphans: beat's entry (no id) sends one task per enabled backend
to that backend's queue; with an id it runs the reconciler (here on the moto SageMaker stand-in, run
in-process with ``apply``); beat schedules it."""

from __future__ import annotations

import pytest
from django.conf import settings

from adapter_standins import standin
from jobs import tasks
from jobs.models import OrphanJob, TrainingJob

pytestmark = pytest.mark.django_db

sagemaker_standin = standin("sagemaker")


def test_beat_schedules_the_task():
    entry = settings.CELERY_BEAT_SCHEDULE["reconcile-orphans"]
    assert entry["task"] == tasks.reconcile_orphans.name == "jobs.tasks.reconcile_orphans"
    assert entry["schedule"] > 0


def test_without_an_id_it_fans_out_per_backend_queue(monkeypatch, aws, sm_backend, local_backend, user):
    from jobs import services

    disabled = services.backend_create(owner=user, name="off", kind="gpubox", config={}, enabled=False)
    sent = []
    monkeypatch.setattr(tasks.reconcile_orphans, "apply_async",
                        lambda args, queue, expires: sent.append((args[0], queue)))

    assert tasks.reconcile_orphans() == 2

    assert sorted(sent) == sorted([(sm_backend.pk, "celery"), (local_backend.pk, "gpubox.local")])
    assert disabled.pk not in [backend_id for backend_id, _ in sent]


def test_with_an_id_it_reconciles(aws, sm_backend, launch):
    job = launch(sm_backend)
    sagemaker_standin.set_status(job.provider_job_name, "InProgress", "Training")
    TrainingJob.objects.filter(pk=job.pk).delete()

    result = tasks.reconcile_orphans.apply(args=[sm_backend.pk]).get()

    assert result == {"listed": 1, "open": 1, "resolved": 0, "stopped": 0}
    assert OrphanJob.objects.get().provider_job_name == job.provider_job_name
    assert tasks.reconcile_orphans.apply(args=[sm_backend.pk + 1000]).get() == {}
