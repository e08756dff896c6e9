"""The API answers a request's own field errors and the service's in one 400, so a client fixes
everything in one round, and saves and sends nothing then (``webapp.errors.trial_call``, which the
UI's ``submit_form`` uses too). A model's parameters follow a changed architecture."""

from __future__ import annotations

import pytest

from jobs.models import ComputeBackend, Dataset, ModelSpec, TrainingJob
from trainer_pkg.registry import ARCHITECTURES

pytestmark = pytest.mark.django_db


def test_a_sagemaker_backend_without_name_or_settings_gets_every_error_at_once(api_client):
    response = api_client.post("/api/backends/", {"kind": "sagemaker"}, format="json")
    assert response.status_code == 400
    assert response.json() == {
        "name": ["This field is required."],
        "config": ["AWS region is required for an AWS SageMaker backend.",
                   "Execution role ARN is required for an AWS SageMaker backend.",
                   "S3 bucket is required for an AWS SageMaker backend."],
    }
    assert not ComputeBackend.objects.exists()


def test_a_dataset_without_name_or_uri_gets_both_errors(api_client):
    response = api_client.post("/api/datasets/", {"format": "csv"}, format="json")
    assert response.status_code == 400
    assert response.json() == {"name": ["This field is required."],
                               "uri": ["Path or URI is required for a dataset in CSV table format."]}
    assert not Dataset.objects.exists()


def test_a_model_without_name_and_with_another_architectures_params_gets_both_errors(api_client):
    response = api_client.post("/api/models/", {"architecture": "mlp", "params": {"channels": 8}}, format="json")
    assert response.status_code == 400
    assert response.json() == {
        "name": ["This field is required."],
        "params": ["Parameter channels: unknown parameter for mlp (known: dropout, hidden_size, num_layers)"],
    }
    assert not ModelSpec.objects.exists()


def test_an_update_reports_its_own_and_the_services_errors_and_changes_nothing(api_client, cnn_model):
    before = (cnn_model.name, cnn_model.params)
    response = api_client.patch(f"/api/models/{cnn_model.pk}/", {"name": "", "params": {"width": 3}},
                                format="json")
    assert response.status_code == 400
    assert response.json() == {
        "name": ["This field may not be blank."],
        "params": ["Parameter width: unknown parameter for cnn (known: channels, dropout, hidden_size, "
                   "num_blocks)"],
    }
    cnn_model.refresh_from_db()
    assert (cnn_model.name, cnn_model.params) == before


def test_a_job_with_a_bad_field_and_a_bad_pipeline_gets_every_error_and_nothing_is_queued(
        api_client, digits_dataset, cnn_model, local_backend, django_capture_on_commit_callbacks,
        no_celery_publish):
    payload = {"dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
               "strategy": "pipeline", "nodes": 1, "procs_per_node": 2, "pipeline_stages": 5, "microbatches": 5,
               "batch_size": 32, "epochs": 0}
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = api_client.post("/api/jobs/", payload, format="json")
    assert response.status_code == 400
    assert response.json() == {
        "epochs": ["Ensure this value is greater than or equal to 1."],
        "pipeline_stages": ["Pipeline stages: 1 node × 2 processes = 2 ranks; 5 pipeline stages do not divide 2: "
                            "choose a stage count that divides it (the ranks beyond one pipeline become "
                            "data-parallel replicas)"],
        "microbatches": ["Micro-batches: batch size 32 is not divisible into 5 micro-batches (32 / 5 = 6.4): "
                         "change one of them"],
    }
    assert not TrainingJob.objects.exists()
    assert callbacks == []
    no_celery_publish["submit"].assert_not_called()


BATCH_32_ON_64_RANKS = ("Batch size 32 × 64 data-parallel ranks = 2,048 samples per step exceeds the 1,438 training "
                        "samples of dataset digits (1,797 less 359 held out for validation, data.val_fraction 0.2): "
                        "each epoch would be one smaller batch per rank; use a batch size of at most 22 or fewer "
                        "ranks.")


@pytest.mark.parametrize("bad, batch", [
    # The batch's arithmetic stands where its own inputs (batch size, shape, dataset, hyperparameters) are
    # valid, whatever else failed; of a failed one (a stand-in) it is dropped.
    ({"epochs": 0, "hyperparameters": {"train": {"optimizer": "nope"}}}, None),
    ({"lr": -1}, BATCH_32_ON_64_RANKS),
    ({"batch_size": 0}, None),
])
def test_field_and_config_errors_do_not_hide_what_the_backend_refuses(api_client, digits_dataset, cnn_model,
                                                                        local_backend, no_celery_publish, bad, batch):
    payload = {"dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
               "nodes": 1, "procs_per_node": 64, **bad}
    response = api_client.post("/api/jobs/", payload, format="json")
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {*bad, "procs_per_node", *(["batch_size"] if batch else [])}, body
    if batch:
        assert body["batch_size"] == [batch]
    assert body["procs_per_node"] == [
        "1 node × 64 processes = 64 ranks, but this GPU box runs at most 2 processes per node "
        "(max_procs_per_node); ask for 2 or fewer."]
    assert not TrainingJob.objects.exists()
    no_celery_publish["submit"].assert_not_called()


def test_a_request_that_is_not_an_object_is_one_error(api_client):
    response = api_client.post("/api/backends/", ["sagemaker"], format="json")
    assert response.status_code == 400
    assert response.json() == {"non_field_errors": ["Invalid data. Expected a dictionary, but got list."]}
    assert not ComputeBackend.objects.exists()


@pytest.fixture
def mlp_model(user):
    return ModelSpec.objects.create(owner=user, name="digits-mlp", architecture="mlp",
                                    params=ARCHITECTURES["mlp"].defaults())


def test_a_new_architecture_without_params_takes_its_defaults(api_client, mlp_model):
    response = api_client.patch(f"/api/models/{mlp_model.pk}/", {"architecture": "cnn"}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["params"] == ARCHITECTURES["cnn"].defaults()
    mlp_model.refresh_from_db()
    assert (mlp_model.architecture, mlp_model.params) == ("cnn", ARCHITECTURES["cnn"].defaults())


def test_params_sent_with_a_new_architecture_are_checked_for_it(api_client, mlp_model):
    response = api_client.patch(f"/api/models/{mlp_model.pk}/", {"architecture": "cnn", "params": {"num_layers": 2}},
                                format="json")
    assert response.status_code == 400
    assert response.json() == {"params": ["Parameter num_layers: unknown parameter for cnn (known: channels, "
                                          "dropout, hidden_size, num_blocks)"]}
    mlp_model.refresh_from_db()
    assert (mlp_model.architecture, mlp_model.params) == ("mlp", ARCHITECTURES["mlp"].defaults())

    response = api_client.patch(f"/api/models/{mlp_model.pk}/", {"architecture": "cnn", "params": {"channels": 8}},
                                format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["params"] == {**ARCHITECTURES["cnn"].defaults(), "channels": 8}


def test_the_same_architecture_keeps_its_params(api_client, mlp_model):
    mlp_model.params = {**mlp_model.params, "hidden_size": 16}
    mlp_model.save()
    response = api_client.patch(f"/api/models/{mlp_model.pk}/", {"architecture": "mlp", "name": "renamed"},
                                format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["params"]["hidden_size"] == 16
