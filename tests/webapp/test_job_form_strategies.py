"""The job form's strategy fields: ddp / fsdp / pipeline reach the frozen JobConfig, and a shape the
trainer cannot run shows the trainer's own arithmetic on the form and in the estimate."""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs.models import TrainingJob
from jobs.adapters import backend_adapter

pytestmark = pytest.mark.django_db


def job_form_data(dataset, model, backend, /, **overrides):
    data = {
        "name": "", "dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk,
        "strategy": "ddp", "nodes": 1, "procs_per_node": 2, "epochs": 3, "batch_size": 32,
        "lr": 0.05, "seed": 0, "max_runtime_s": 3600, "budget_usd": "", "instance_type": "",
        "hyperparameters": "",
    }
    data.update(overrides)
    return data


def page_text(response) -> str:
    return response.content.decode().replace("&#x27;", "'").replace("&quot;", '"')


def test_the_form_offers_every_strategy(owner_client, local_backend):
    page = owner_client.get(reverse("job-create")).content.decode()
    for value in ("ddp", "fsdp", "pipeline", "gpipe", "1f1b"):
        assert f'value="{value}"' in page
    assert 'name="microbatches"' in page and 'name="pipeline_stages"' in page
    assert backend_adapter(local_backend).capabilities.strategies == ("ddp", "fsdp", "pipeline")


@pytest.mark.parametrize("strategy, extra", [
    ("fsdp", {}),
    ("pipeline", {"microbatches": 8, "pipeline_schedule": "1f1b"}),
])
def test_strategy_reaches_the_frozen_config(owner_client, digits_dataset, cnn_model, local_backend,
                                            no_celery_publish, strategy, extra):
    response = owner_client.post(reverse("job-create"),
                                 job_form_data(digits_dataset, cnn_model, local_backend, strategy=strategy, **extra))
    assert response.status_code == 302, response.context["form"].errors
    job = TrainingJob.objects.get()
    assert job.strategy == strategy
    parallel = job.config["parallel"]
    assert parallel["strategy"] == strategy and parallel["procs_per_node"] == 2
    assert parallel["microbatches"] == extra.get("microbatches", 4)
    assert parallel["pipeline_schedule"] == extra.get("pipeline_schedule", "gpipe")
    assert parallel["pipeline_stages"] == 0


@pytest.mark.parametrize("overrides, field, message", [
    ({"pipeline_stages": 3}, "pipeline_stages",
     "1 node × 2 processes = 2 ranks; 3 pipeline stages do not divide 2"),
    ({"batch_size": 30}, "microbatches", "batch size 30 is not divisible into 4 micro-batches"),
    ({"procs_per_node": 1}, "pipeline_stages",
     "1 node × 1 process = 1 rank; a pipeline needs at least 2 stages"),
])
def test_pipeline_shape_errors_show_on_the_form_and_in_the_estimate(
        owner_client, digits_dataset, cnn_model, local_backend, no_celery_publish, overrides, field, message):
    data = job_form_data(digits_dataset, cnn_model, local_backend, strategy="pipeline", **overrides)
    response = owner_client.post(reverse("job-create"), data)
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert any(message in e for e in errors[field]), errors
    assert message in page_text(response)
    assert TrainingJob.objects.count() == 0
    no_celery_publish["submit"].assert_not_called()

    estimate = page_text(owner_client.post(reverse("job-estimate"), data))
    assert "estimate-error" in estimate and message in estimate
