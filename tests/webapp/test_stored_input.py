"""Input PostgreSQL cannot store is a field error in every form and API call, never a 500
(jobs/validation.py): non-finite numbers (NaN, Infinity, 1e400) and NUL characters in
any JSON field, JSON nested thousands deep, numbers in backend settings past what they can mean."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse

from jobs.models import ComputeBackend, Dataset, ModelSpec, TrainingJob

pytestmark = pytest.mark.django_db

DEEP = "[" * 5000 + "]" * 5000  # past Python's recursion limit: json.loads raised RecursionError


def _post(api_client, path: str, body: str):
    return api_client.post(path, data=body, content_type="application/json")


# --- the forms ---------------------------------------------------------------------------------


@pytest.mark.parametrize("params, message", [
    ('{"dropout": NaN}', "dropout: expected a finite number, got nan."),
    ('{"dropout": Infinity}', "dropout: expected a finite number, got inf"),
    ('{"dropout": -Infinity}', "dropout: expected a finite number, got -inf"),
    ('{"dropout": 1e400}', "dropout: expected a finite number, got inf (a number past about 1.8e308"),
    ('{"hidden_size": 32, "a\\u0000": 1}', 'Key "a\\u0000" contains a NUL character'),
    ('{"hidden_size": "3\\u00002"}', "hidden_size: contains a NUL character (\\u0000), which cannot be stored"),
    ('{"x": ' + DEEP + '}', "Nested more than 32 levels deep"),
])
def test_model_form_unstorable_params_are_a_field_error(owner_client, params, message):
    response = owner_client.post(reverse("model-create"), {"name": "mlp", "architecture": "mlp", "params": params})
    assert response.status_code == 200
    errors = response.context["form"].errors["params"]
    assert any(message in e for e in errors), errors
    assert ModelSpec.objects.count() == 0


def test_backend_and_job_forms_refuse_nan_in_their_json_fields(owner_client, digits_dataset, cnn_model,
                                                                local_backend):
    backend = owner_client.post(reverse("backend-create"), {
        "name": "box2", "kind": "gpubox", "enabled": "on", "stall_policy": "warn", "orphan_policy": "report",
        "extra_config": '{"grace_period_s": NaN}',
    })
    assert backend.status_code == 200
    assert any("grace_period_s: expected a finite number, got nan" in e
               for e in backend.context["form"].errors["extra_config"]), backend.context["form"].errors
    job = owner_client.post(reverse("job-create"), {
        "name": "", "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
        "strategy": "ddp", "nodes": 1, "procs_per_node": 1, "epochs": 1, "batch_size": 32, "lr": 0.05,
        "seed": 0, "max_runtime_s": 3600, "budget_usd": "", "instance_type": "",
        "hyperparameters": '{"train": {"lr": NaN}}',
    })
    assert job.status_code == 200
    assert job.context["form"].errors["hyperparameters"] == ["train.lr: expected a finite number, got nan."]
    assert (ComputeBackend.objects.count(), TrainingJob.objects.count()) == (1, 0)


# --- the API -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, field, message", [
    ("/api/models/", '{"name": "m", "architecture": "mlp", "params": {"dropout": NaN}}',
     "params", "Parameters: dropout: expected a finite number, got nan."),
    ("/api/models/", '{"name": "m", "architecture": "mlp", "params": {"dropout": 1e400}}',
     "params", "Parameters: dropout: expected a finite number, got inf"),
    ("/api/models/", '{"name": "m", "architecture": "mlp", "params": {"hidden_size": 8, "k\\u0000": 1}}',
     "params", 'Parameters: Key "k\\u0000" contains a NUL character'),
    ("/api/backends/", '{"name": "b", "kind": "gpubox", "config": {"hourly_rate_usd": 1e400}}',
     "config", "Config: hourly_rate_usd: expected a finite number, got inf"),
    ("/api/backends/", '{"name": "b", "kind": "gpubox", "config": {"hourly_rate_usd": Infinity}}',
     "config", "Config: hourly_rate_usd: expected a finite number, got inf"),
    ("/api/backends/", '{"name": "b", "kind": "gpubox", "config": {"run_root": "/tmp/r\\u0000"}}',
     "config", "Config: run_root: contains a NUL character (\\u0000), which cannot be stored; remove it."),
    ("/api/backends/", '{"name": "b", "kind": "gpubox", "config": {"hourly_rate_usd": 1e300}}',
     "config", "Hourly rate (USD): must be 0 to 100,000 USD per node-hour, got 1e+300."),
    ("/api/backends/", '{"name": "b", "kind": "gpubox", "config": {"grace_period_s": 1e300}}',
     "config", "Cancel grace period (s): must be 0 to 600 seconds, got 1e+300."),
    ("/api/backends/", '{"name": "b", "kind": "gpubox", "state_deadlines": {"PENDING": 1e300}}',
     "state_deadlines", "PENDING: the deadline must be at most 31,536,000 seconds (365 days)"),
    ("/api/jobs/", '{"dataset": D, "model_spec": M, "backend": B, "hyperparameters": {"train": {"lr": NaN}}}',
     "hyperparameters", "train.lr: expected a finite number, got nan."),
    ("/api/jobs/", '{"dataset": D, "model_spec": M, "backend": B, "hyperparameters": {"x": "a\\u0000"}}',
     "hyperparameters", "x: contains a NUL character (\\u0000), which cannot be stored; remove it."),
    ("/api/jobs/", '{"dataset": D, "model_spec": M, "backend": B, "hyperparameters": "{\\"x\\": ' + DEEP + '}"}',
     "hyperparameters", "Hyperparameters: Nested more than 32 levels deep"),
])
def test_api_unstorable_json_values_are_a_field_error(api_client, digits_dataset, cnn_model, local_backend,
                                                      path, body, field, message):
    body = body.replace("D,", f"{digits_dataset.pk},").replace("M,", f"{cnn_model.pk},").replace(
        "B,", f"{local_backend.pk},")
    counts = (ModelSpec.objects.count(), ComputeBackend.objects.count(), TrainingJob.objects.count())
    response = _post(api_client, path, body)
    assert response.status_code == 400, response.content
    errors = response.json()[field]
    assert any(message in e for e in errors), errors
    assert (ModelSpec.objects.count(), ComputeBackend.objects.count(), TrainingJob.objects.count()) == counts


def test_api_nan_in_a_number_field_is_that_fields_error(api_client, digits_dataset, cnn_model, local_backend):
    response = _post(api_client, "/api/jobs/", json.dumps({
        "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
        "lr": float("nan"), "budget_usd": float("inf")}))
    assert response.status_code == 400
    assert set(response.json()) == {"lr", "budget_usd"}


@pytest.mark.parametrize("path", ["/api/models/", "/api/backends/", "/api/datasets/", "/api/jobs/",
                                  "/api/auth/token/"])
def test_api_body_nested_thousands_deep_is_a_400(api_client, path):
    response = _post(api_client, path, '{"name": "x", "params": ' + DEEP + "}")
    assert response.status_code == 400
    assert response.json() == {"detail": "JSON parse error - Nested more than 33 levels deep; at most 33 levels "
                                         "of objects and arrays are accepted."}


def test_api_integer_of_thousands_of_digits_is_a_400(api_client):
    response = _post(api_client, "/api/models/", '{"name": "m", "architecture": "mlp", "params": {"hidden_size": '
                     + "9" * 5000 + "}}")
    assert response.status_code == 400
    assert response.json() == {"detail": "JSON parse error - A number has more than 4,300 digits; give a shorter one."}


def test_api_unpaired_surrogate_is_a_400_naming_where(api_client):
    """A field's error would echo it, and no response can be encoded with it (UnicodeEncodeError)."""
    response = _post(api_client, "/api/backends/", '{"name": "b", "kind": "gpubox", "config": {"x": ["\\ud800"]}}')
    assert response.status_code == 400
    assert response.json() == {"detail": "JSON parse error - config.x[0]: a string holds an unpaired surrogate "
                                         "(\\ud800-\\udfff escapes not in a pair), which is not text; remove it."}
    assert _post(api_client, "/api/models/", '{"name": "\\udfff"}').json()["detail"].startswith(
        "JSON parse error - name: a string holds an unpaired surrogate")


@pytest.mark.parametrize("field", ["team", "dataset"])
def test_api_non_finite_primary_key_is_a_field_error(api_client, digits_dataset, cnn_model, local_backend, field):
    body = {"dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk}
    text = json.dumps({k: v for k, v in body.items() if k != field})[:-1] + f', "{field}": 1e400}}'
    response = _post(api_client, "/api/jobs/", text)  # int(inf) in the query would raise OverflowError
    assert response.status_code == 400
    expected = {"team": "A valid integer is required.",
                "dataset": "Give the dataset's id (a whole number) or its name, not inf."}[field]
    assert response.json() == {field: [expected]}
