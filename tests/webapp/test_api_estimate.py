"""POST /api/jobs/estimate/: the create's checks without its write (jobs.services.training_job_preview):
the estimate, the memory plan and the job as the create would store it, nothing written; every error
at once otherwise, as the create's."""

from __future__ import annotations

from decimal import Decimal

import pytest

from jobs.models import JobEvent, TrainingJob

pytestmark = pytest.mark.django_db


def test_the_estimate_of_a_job_writes_nothing_and_says_what_the_create_would_store(
        api_client, digits_dataset, cnn_model, local_backend, django_capture_on_commit_callbacks):
    body = {"dataset": digits_dataset.name, "model_spec": cnn_model.name, "backend": local_backend.name,
            "nodes": 1, "procs_per_node": 2, "epochs": 2, "max_runtime_s": 1800}
    with django_capture_on_commit_callbacks(execute=False) as submitted:
        response = api_client.post("/api/jobs/estimate/", body, format="json")
    assert response.status_code == 200, response.json()
    assert (TrainingJob.objects.count(), JobEvent.objects.count(), submitted) == (0, 0, [])
    data = response.json()
    created = api_client.post("/api/jobs/", body, format="json").json()
    job = TrainingJob.objects.get()
    assert data["estimated_cost_usd"] == created["estimated_cost_usd"] == f"{job.estimated_cost_usd:.4f}"
    assert Decimal(data["hourly_price_usd"]) == job.hourly_price_usd
    assert (data["world_size"], data["memory_plan"]) == (2, job.memory_plan)
    assert data["job"]["id"] is None and (data["job"]["events"], data["job"]["attempts"]) == ([], [])
    same = {"config", "strategy", "nodes", "procs_per_node", "dataset", "model_spec", "backend", "state",
            "max_runtime_s", "estimate_arithmetic"}
    assert {k: data["job"][k] for k in same} == {k: created[k] for k in same}


def test_every_error_at_once_and_nothing_written(api_client, digits_dataset, cnn_model, local_backend):
    response = api_client.post("/api/jobs/estimate/", {
        "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
        "nodes": 0, "lr": -1, "epochs": 0}, format="json")
    assert response.status_code == 400
    assert {"nodes", "lr", "epochs"} <= set(response.json())
    assert TrainingJob.objects.count() == 0
