"""The job form's large-model settings (activation checkpointing, CPU offload, checkpoint format,
max steps, sequence length): under the config's own names they reach the frozen JobConfig, and a
value the trainer refuses shows on its field."""

from __future__ import annotations

import numpy as np
import pytest
from django.urls import reverse

from jobs import services
from jobs.models import TrainingJob
from trainer_pkg.tokens import write_tokens

pytestmark = pytest.mark.django_db


@pytest.fixture
def token_dataset(user, tmp_path):
    rng = np.random.default_rng(0)
    uri = write_tokens(str(tmp_path / "books"), vocab_size=256, train=[rng.integers(0, 256, 2000)],
                       val=[rng.integers(0, 256, 300)])
    return services.dataset_create(owner=user, name="books", format="tokens", uri=uri)


@pytest.fixture
def gpt_model(user):
    return services.model_spec_create(owner=user, name="tiny-gpt", architecture="gpt",
                                      params={"layers": 2, "embed_dim": 32, "heads": 2, "context_length": 64})


def form_data(dataset, model, backend, **overrides):
    data = {"name": "", "dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "strategy": "fsdp",
            "nodes": 1, "procs_per_node": 2, "epochs": 1, "batch_size": 4, "lr": 0.001, "seed": 0,
            "max_runtime_s": 3600, "budget_usd": "", "instance_type": "", "hyperparameters": ""}
    data.update(overrides)
    return data


def test_the_large_model_settings_reach_the_frozen_config(owner_client, token_dataset, gpt_model, local_backend,
                                                          no_celery_publish):
    page = owner_client.get(reverse("job-create")).content.decode()
    for name in ("activation_checkpointing", "cpu_offload", "checkpoint_format", "max_steps", "seq_len"):
        assert f'name="{name}"' in page
    settings = {"activation_checkpointing": "on", "cpu_offload": "on", "checkpoint_format": "sharded",
                "max_steps": 7, "seq_len": 32}
    estimate = owner_client.post(reverse("job-estimate"), form_data(token_dataset, gpt_model, local_backend,
                                                                    **settings))
    plan = estimate.context["estimate"]["memory_plan"]
    assert plan["strategy"] == "fsdp" and any("activation checkpointing" in line for line in plan["lines"]), plan
    response = owner_client.post(reverse("job-create"), form_data(token_dataset, gpt_model, local_backend, **settings))
    assert response.status_code == 302, response.context["form"].errors
    config = TrainingJob.objects.get().config
    assert (config["parallel"]["activation_checkpointing"], config["parallel"]["cpu_offload"]) == (True, True)
    assert config["output"]["checkpoint_format"] == "sharded"
    assert (config["train"]["max_steps"], config["data"]["seq_len"]) == (7, 32)


def test_a_bad_large_model_setting_is_an_error_on_its_field(owner_client, token_dataset, gpt_model, local_backend,
                                                             no_celery_publish):
    response = owner_client.post(reverse("job-create"), form_data(
        token_dataset, gpt_model, local_backend, strategy="ddp", cpu_offload="on", max_steps=-1,
        checkpoint_format="zip"))
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert any("CPU offload" in e and "fsdp" in e for e in errors["cpu_offload"]), errors
    assert errors["max_steps"] == ["Ensure this value is greater than or equal to 0."]
    assert "zip is not one of the available choices" in errors["checkpoint_format"][0]
    assert not TrainingJob.objects.exists()


def test_the_api_takes_them_in_the_hyperparameters(api_client, token_dataset, gpt_model, local_backend,
                                                  no_celery_publish):
    response = api_client.post("/api/jobs/", {
        "dataset": token_dataset.pk, "model_spec": gpt_model.pk, "backend": local_backend.pk, "strategy": "fsdp",
        "procs_per_node": 2, "batch_size": 4, "hyperparameters": {
            "parallel": {"activation_checkpointing": True, "cpu_offload": True},
            "output": {"checkpoint_format": "sharded"}, "train": {"max_steps": 7}, "data": {"seq_len": 32}}},
        format="json")
    assert response.status_code == 201, response.json()
    config = TrainingJob.objects.get().config
    assert (config["parallel"]["cpu_offload"], config["output"]["checkpoint_format"]) == (True, "sharded")
    assert (config["train"]["max_steps"], config["data"]["seq_len"]) == (7, 32)
