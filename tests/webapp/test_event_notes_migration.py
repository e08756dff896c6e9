"""Migration 0026: old same-state events (written before notes existed) become notes, in the API too."""

import importlib

import pytest
from django.apps import apps

from jobs.models import JobEvent

pytestmark = pytest.mark.django_db

migration = importlib.import_module("jobs.migrations.0026_jobevent_notes")


def test_same_state_rows_become_notes_and_moves_stay(api_client, user, digits_dataset, cnn_model, local_backend):
    from jobs import services

    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend)
    job.events.all().delete()
    rows = [JobEvent.objects.create(job=job, from_state=f, to_state=t, message=m) for f, t, m in [
        ("", "QUEUED", "Created"), ("QUEUED", "QUEUED", "waiting for 2 GPUs"), ("QUEUED", "SUBMITTING", ""),
        ("PENDING", "", "a note already"), ("RUNNING", "RUNNING", "stalled: no step for 600 s")]]
    migration.same_state_rows_to_notes(apps, None)
    assert [(e.from_state, e.to_state) for e in JobEvent.objects.filter(pk__in=[r.pk for r in rows])] == [
        ("", "QUEUED"), ("QUEUED", ""), ("QUEUED", "SUBMITTING"), ("PENDING", ""), ("RUNNING", "")]

    events = api_client.get(f"/api/jobs/{job.pk}/").json()["events"]
    mine = [e for e in events if e["message"] in {r.message for r in rows}]
    assert [(e["to_state"], e["is_note"]) for e in mine] == [
        ("QUEUED", False), ("", True), ("SUBMITTING", False), ("", True), ("", True)]
