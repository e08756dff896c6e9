"""The memory plan before launch: the job form's estimate and the API show it, a job that cannot fit
the instance's GPU memory is refused with the arithmetic and the FSDP world that would fit, and is
accepted once it asks for that; a target without known GPU memory is planned, never refused."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from jobs import services
from jobs.models import TrainingJob

pytestmark = pytest.mark.django_db

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"
# 1.6 B parameters (conv blocks of 1024 … 16384 channels); AdamW: 16 bytes each, plus DDP's buckets.
HUGE = {"channels": 1024, "num_blocks": 5}
ADAMW = {"train": {"optimizer": "adamw"}}
REFUSAL = ("The job does not fit in GPU memory: it needs 30.2 GiB per GPU; ml.g5.xlarge's NVIDIA A10G has 24.0 GiB; "
           "FSDP across 3 ranks would need 21.6 GiB. The plan per rank: model: cnn, 1,608,589,002 parameters; ddp on "
           "2 ranks, 32 samples per rank per step, fp32; parameters: 1,608,589,002 × 4 B (fp32) = 6.0 GiB; ")


@pytest.fixture
def sagemaker_backend(user):
    return services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": ROLE, "bucket": "tb-test-bucket"})


@pytest.fixture
def huge_model(user):
    return services.model_spec_create(owner=user, name="huge-cnn", architecture="cnn", params=HUGE)


def form_data(dataset, model, backend, **overrides):
    data = {"name": "", "dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "strategy": "ddp",
            "nodes": 2, "procs_per_node": 1, "epochs": 3, "batch_size": 32, "lr": 0.05, "seed": 0,
            "max_runtime_s": 3600, "budget_usd": "", "instance_type": "ml.g5.xlarge",
            "hyperparameters": '{"train": {"optimizer": "adamw"}}'}
    data.update(overrides)
    return data


def test_the_api_refuses_a_job_that_cannot_fit_and_accepts_it_with_fsdp_across_more_ranks(
        api_client, digits_dataset, huge_model, sagemaker_backend, no_celery_publish):
    payload = {"dataset": digits_dataset.pk, "model_spec": huge_model.pk, "backend": sagemaker_backend.pk,
               "nodes": 2, "procs_per_node": 1, "instance_type": "ml.g5.xlarge", "hyperparameters": ADAMW,
               "max_runtime_s": 3600, "epochs": 0}
    refused = api_client.post("/api/jobs/", payload, format="json")
    assert refused.status_code == 400
    assert refused.json()["epochs"] == ["Ensure this value is greater than or equal to 1."]  # the API's own check first
    refused = api_client.post("/api/jobs/", {**payload, "epochs": 1, "budget_usd": "-1"}, format="json")
    assert refused.status_code == 400 and "budget_usd" in refused.json()
    refused = api_client.post("/api/jobs/", {**payload, "epochs": 1}, format="json")
    assert refused.status_code == 400
    [message] = refused.json()["non_field_errors"]
    assert message.startswith(REFUSAL)
    assert "buffers: model buffers 248.0 KiB, the batch 8.2 KiB, DDP's gradient buckets 6.0 GiB" in message
    assert "peak per rank: 30.2 GiB of 24.0 GiB (does not fit)" in message
    assert "device: ml.g5.xlarge (1 × NVIDIA A10G, 24 GiB each)" in message
    assert TrainingJob.objects.count() == 0

    accepted = api_client.post("/api/jobs/", {**payload, "epochs": 1, "strategy": "fsdp", "nodes": 3}, format="json")
    assert accepted.status_code == 201, accepted.json()
    plan = accepted.json()["memory_plan"]
    assert (plan["strategy"], plan["world_size"], plan["fits"], plan["device_bytes"]) == ("fsdp", 3, True, 24 * 2**30)
    assert plan["params_bytes"] == -(-1_608_589_002 // 3) * 4
    assert plan["summary"] == "needs 21.6 GiB per GPU; ml.g5.xlarge's NVIDIA A10G has 24.0 GiB"
    assert accepted.json()["rank_memory"] is None
    assert TrainingJob.objects.get().memory_plan == plan


def test_the_form_shows_the_plan_refuses_and_then_accepts(owner_client, digits_dataset, huge_model, sagemaker_backend):
    estimate = owner_client.post(reverse("job-estimate"), form_data(digits_dataset, huge_model, sagemaker_backend))
    plan = estimate.context["estimate"]["memory_plan"]
    assert plan["fits"] is False and plan["suggestion"] == "FSDP across 3 ranks would need 21.6 GiB"
    page = estimate.content.decode()
    assert ('Memory: needs 30.2 GiB per GPU; ml.g5.xlarge&#x27;s NVIDIA A10G has 24.0 GiB; FSDP across 3 ranks would '
            'need 21.6 GiB — the job would be refused') in page
    assert "<li>optimizer: adamw keeps 2 fp32 copies per parameter = 12.0 GiB</li>" in page

    refused = owner_client.post(reverse("job-create"), form_data(digits_dataset, huge_model, sagemaker_backend))
    assert refused.status_code == 200
    [message] = refused.context["form"].non_field_errors()
    assert message.startswith(REFUSAL)
    assert TrainingJob.objects.count() == 0

    fsdp = form_data(digits_dataset, huge_model, sagemaker_backend, strategy="fsdp", nodes=3)
    fits = owner_client.post(reverse("job-estimate"), fsdp).context["estimate"]["memory_plan"]
    assert fits["fits"] is True
    accepted = owner_client.post(reverse("job-create"), fsdp)
    assert accepted.status_code == 302, accepted.context["form"].errors
    job = TrainingJob.objects.get()
    assert job.memory_plan["needed_bytes"] == fits["needed_bytes"]
    page = owner_client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "Plan: needs 21.6 GiB per GPU; ml.g5.xlarge&#x27;s NVIDIA A10G has 24.0 GiB." in page
    assert "Not measured yet" in page


def test_a_target_without_known_gpu_memory_is_planned_never_refused(api_client, digits_dataset, huge_model,
                                                                    local_backend, no_celery_publish, settings):
    settings.TRAINBOARD_GPUBOX_GPU_IDS = "0,1"  # a box with GPUs whose memory nobody set (without any, its host's counts)
    response = api_client.post("/api/jobs/", {"dataset": digits_dataset.pk, "model_spec": huge_model.pk,
                                              "backend": local_backend.pk, "procs_per_node": 2,
                                              "hyperparameters": ADAMW}, format="json")
    assert response.status_code == 201, response.json()
    plan = response.json()["memory_plan"]
    assert (plan["fits"], plan["device_bytes"], plan["suggestion"]) == (None, None, "")
    assert plan["summary"] == "needs 30.2 GiB per rank (no GPU memory known for this target: not checked)"
    assert re.search(r"peak per rank: 30\.2 GiB$", plan["lines"][-1])


def test_the_suggestion_names_no_world_the_backend_cannot_run(api_client, digits_dataset, huge_model, user, run_root,
                                                              settings, no_celery_publish):
    settings.TRAINBOARD_RUN_ROOT = run_root
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2  # one node, 2 processes: at most 2 ranks
    box = services.backend_create(owner=user, name="box", kind="gpubox",
                                  config={"hourly_rate_usd": 0.0, "gpu_memory_gib": 4.0, "gpu_model": "Tiny GPU"})
    refused = api_client.post("/api/jobs/", {"dataset": digits_dataset.pk, "model_spec": huge_model.pk,
                                             "backend": box.pk, "procs_per_node": 2, "hyperparameters": ADAMW},
                              format="json")
    assert refused.status_code == 400
    [message] = refused.json()["non_field_errors"]
    assert "FSDP across" not in message
    assert ("needs 30.2 GiB per GPU; backend box's default instance's Tiny GPU has 4.0 GiB; no FSDP world this "
            "backend can run (at most 2 ranks) fits; choose an instance type or backend with more GPU memory") in message


def test_no_plan_is_worked_out_on_stand_ins_for_fields_in_error(owner_client, api_client, digits_dataset, huge_model,
                                                                 sagemaker_backend, no_celery_publish):
    for bad in ({"strategy": "zero3"}, {"batch_size": 0}):
        estimate = owner_client.post(reverse("job-estimate"),
                                     form_data(digits_dataset, huge_model, sagemaker_backend, **bad))
        assert estimate.context["estimate"]["ok"] is True
        assert estimate.context["estimate"]["memory_plan"] is None, bad
    assert "Memory plan: shown once these fields are valid: Batch size per process." in estimate.content.decode()
    refused = owner_client.post(reverse("job-create"),
                                form_data(digits_dataset, huge_model, sagemaker_backend, strategy="zero3"))
    form = refused.context["form"]
    assert "strategy" in form.errors and not any("GPU memory" in e for e in form.non_field_errors()), form.errors
    payload = {"dataset": digits_dataset.pk, "model_spec": huge_model.pk, "backend": sagemaker_backend.pk,
               "nodes": 2, "instance_type": "ml.g5.xlarge", "hyperparameters": ADAMW}
    for bad in ({"procs_per_node": 0}, {"strategy": "zero3"}):
        response = api_client.post("/api/jobs/", {**payload, **bad}, format="json")
        assert response.status_code == 400
        assert set(response.json()) == set(bad), response.json()
    whole = api_client.post("/api/jobs/", payload, format="json")  # valid: the plan's refusal stands
    assert whole.json()["non_field_errors"][0].startswith(REFUSAL)
    assert TrainingJob.objects.count() == 0
