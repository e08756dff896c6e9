"""The front doors of a job (the API and its OpenAPI schema, the job form, ``submit_job --help``, a
sweep's base) are built from one declaration, ``jobs.job_request``: a field added to the trainer's
config and to the request shows in all of them, and the API takes the large-model and pipeline
fields it lacked (issue 31)."""

from __future__ import annotations

import argparse

import pytest
import yaml
from django import forms
from rest_framework import serializers

from jobs.job_request import CONFIG_FIELDS, config_sections, job_request_fields
from jobs.management.commands.submit_job import add_job_request_options
from jobs.models import TrainingJob
from jobs.sweeps import base_types
from trainer_pkg.config import FieldInfo, config_fields
from webapp.api.serializers import job_request_serializer_fields
from webapp.forms import job_request_form_fields

SMOOTHING = FieldInfo(path="train.label_smoothing", kind="float", default=0.1, label="Label smoothing",
                      help="Share of each target spread over the other classes. Regularizes an overconfident "
                           "classifier.", minimum=0.0, maximum=1.0)


def test_a_field_added_to_the_config_shows_at_every_front_door():
    """One entry more in the config's metadata (what a new dataclass field gives) and one line in the
    request's ``CONFIG_FIELDS``: the API, the form, the CLI and the sweep's base all take it, with the
    config's label, help, default and bounds."""
    fields = job_request_fields({**CONFIG_FIELDS, "label_smoothing": "train.label_smoothing"},
                                {**config_fields(), "train.label_smoothing": SMOOTHING})
    added = next(f for f in fields if f.name == "label_smoothing")
    assert (added.kind, added.default, added.help) == ("float", 0.1, "Share of each target spread over the "
                                                                     "other classes.")

    api = job_request_serializer_fields(fields)["label_smoothing"]
    assert isinstance(api, serializers.FloatField)
    assert (api.default, api.min_value, api.help_text) == (0.1, 0.0, added.help)

    form = job_request_form_fields(fields)
    assert isinstance(form["label_smoothing"], forms.FloatField)
    assert (form["label_smoothing"].label, form["label_smoothing"].min_value) == ("Label smoothing", 0.0)
    assert list(form)[-1] == "label_smoothing"  # after the large-model settings, in the declaration's order

    parser = argparse.ArgumentParser()
    add_job_request_options(parser, {}, fields)
    assert parser.parse_args(["--label-smoothing", "0.2"]).label_smoothing == 0.2
    assert parser.parse_args([]).label_smoothing == 0.1
    assert "Share of each target spread over the other classes. (0.0 to 1.0; default: 0.1)" in " ".join(
        parser.format_help().split())

    assert base_types(fields)["label_smoothing"] == (int, float, str)
    assert config_sections({"label_smoothing": 0.2, "lr": 0.1}, fields) == {
        "train": {"label_smoothing": 0.2, "lr": 0.1}}


@pytest.mark.django_db
def test_the_api_takes_the_large_model_and_pipeline_fields_and_its_schema_says_so(
        api_client, digits_dataset, cnn_model, local_backend, no_celery_publish):
    schema = yaml.safe_load(api_client.get("/api/schema/").content)["components"]["schemas"]["TrainingJobCreate"]
    props = schema["properties"]
    assert props["activation_checkpointing"]["type"] == "boolean" and props["max_steps"]["minimum"] == 0
    assert props["checkpoint_format"]["oneOf"][0] == {"$ref": "#/components/schemas/CheckpointFormatEnum"}
    assert props["checkpoint_format"]["nullable"] is True and props["checkpoint_format"]["description"].startswith(
        "full: one last.pt written by rank 0.")
    assert props["epochs"]["description"] == "Passes over the training data." and props["epochs"]["default"] == 3
    response = api_client.post("/api/jobs/", {
        "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk, "strategy": "fsdp",
        "procs_per_node": 2, "activation_checkpointing": True, "cpu_offload": True, "checkpoint_format": "sharded",
        "max_steps": 7}, format="json")
    assert response.status_code == 201, response.json()
    config = TrainingJob.objects.get().config
    assert (config["parallel"]["activation_checkpointing"], config["parallel"]["cpu_offload"]) == (True, True)
    assert (config["output"]["checkpoint_format"], config["train"]["max_steps"]) == ("sharded", 7)
    response = api_client.post("/api/jobs/", {
        "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
        "strategy": "pipeline", "procs_per_node": 2, "pipeline_stages": 2, "microbatches": 4,
        "pipeline_schedule": "1f1b", "seq_len": None}, format="json")
    assert response.status_code == 201, response.json()
    parallel = TrainingJob.objects.latest("pk").config["parallel"]
    assert (parallel["pipeline_stages"], parallel["microbatches"], parallel["pipeline_schedule"]) == (2, 4, "1f1b")


@pytest.mark.django_db
def test_the_api_reports_a_bad_field_a_bad_override_and_a_backend_refusal_in_one_400(
        api_client, digits_dataset, cnn_model, local_backend, no_celery_publish):
    response = api_client.post("/api/jobs/", {
        "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk, "max_steps": -1,
        "procs_per_node": 4, "hyperparameters": {"train": {"optimizer": "adam"}}}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["max_steps"] == ["Ensure this value is greater than or equal to 0."]
    assert body["hyperparameters"] == ["train.optimizer: must be one of 'sgd', 'adamw', got 'adam'"]
    assert "4" in body["procs_per_node"][0]
    assert TrainingJob.objects.count() == 0
    no_celery_publish["submit"].assert_not_called()


@pytest.mark.django_db
def test_a_request_with_errors_of_its_own_is_checked_never_created(owner_client, api_client, digits_dataset,
                                                                    cnn_model, local_backend, no_celery_publish):
    """The form and the API report their own field errors with the service's, found by
    ``training_job_check`` (which writes nothing), not by a create rolled back."""
    from unittest import mock

    from django.urls import reverse

    from jobs import services

    with mock.patch.object(services, "training_job_create", side_effect=AssertionError("no create")):
        page = owner_client.post(reverse("job-create"), {
            "name": "", "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
            "strategy": "ddp", "nodes": 1, "procs_per_node": 1, "epochs": 0, "batch_size": 32, "lr": 0.05,
            "seed": 0, "max_runtime_s": 3600, "hyperparameters": '{"train": {"optimizer": "adam"}}'})
        errors = page.context["form"].errors
        assert errors["epochs"] == ["Ensure this value is greater than or equal to 1."]
        assert errors["hyperparameters"] == ["train.optimizer: must be one of 'sgd', 'adamw', got 'adam'"]
        response = api_client.post("/api/jobs/", {
            "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk, "epochs": 0,
            "hyperparameters": {"train": {"optimizer": "adam"}}}, format="json")
        assert response.status_code == 400
        assert response.json()["hyperparameters"] == ["train.optimizer: must be one of 'sgd', 'adamw', got 'adam'"]
    assert TrainingJob.objects.count() == 0
