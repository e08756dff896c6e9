"""REST API under /api/: CRUD through the services, 400s with field errors, user scoping, the
OpenAPI schema (webapp/api/)."""

from __future__ import annotations

import pytest
import yaml

from jobs.models import ComputeBackend, Dataset, ModelSpec, TrainingJob

pytestmark = pytest.mark.django_db


def job_payload(dataset, model, backend, /, **overrides):
    payload = {"dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "nodes": 1,
               "procs_per_node": 2, "epochs": 2, "batch_size": 16, "lr": 0.1, "seed": 7,
               "max_runtime_s": 1800}
    payload.update(overrides)
    return payload


def test_job_create_via_api_enqueues_submit(api_client, digits_dataset, cnn_model, local_backend,
                                            django_capture_on_commit_callbacks, no_celery_publish):
    payload = job_payload(digits_dataset, cnn_model, local_backend, name="api-job", budget_usd="5.00",
                          hyperparameters={"train": {"optimizer": "adamw"}})
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = api_client.post("/api/jobs/", payload, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    job = TrainingJob.objects.get()
    assert body["id"] == job.pk
    assert (body["name"], body["display_name"]) == ("api-job", "api-job")
    assert body["state"] == "QUEUED"
    assert body["world_size"] == 2
    assert body["estimated_cost_usd"] == "1.8000"  # 0.5 h × 1 node × $3.60/h
    assert body["config"]["train"] == {**body["config"]["train"], "optimizer": "adamw", "epochs": 2,
                                       "batch_size": 16, "seed": 7}
    assert [e["to_state"] for e in body["events"]] == ["QUEUED"]
    assert len(callbacks) == 1
    no_celery_publish["submit"].assert_called_once()
    assert no_celery_publish["submit"].call_args.kwargs["args"] == [job.pk]


def test_a_job_without_a_name_is_shown_as_job_id(api_client, digits_dataset, cnn_model, local_backend,
                                                  no_celery_publish):
    response = api_client.post("/api/jobs/", job_payload(digits_dataset, cnn_model, local_backend, name=""),
                               format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["name"], body["display_name"]) == ("", f"job-{body['id']}")
    listed = api_client.get("/api/jobs/").json()["results"]
    assert [j["display_name"] for j in listed] == [f"job-{body['id']}"]


@pytest.mark.parametrize("overrides, field, message", [
    ({"nodes": 0}, "nodes", "Ensure this value is greater than or equal to 1."),
    ({"procs_per_node": -1}, "procs_per_node", "Ensure this value is greater than or equal to 1."),
    ({"epochs": 0}, "epochs", "Ensure this value is greater than or equal to 1."),
    ({"dataset": 999999}, "dataset", "Choose one of your datasets; this one does not exist or is not yours."),
    ({"hyperparameters": "{not json"}, "hyperparameters", "Hyperparameters are not valid JSON"),
    ({"hyperparameters": [1, 2]}, "hyperparameters", "Hyperparameters must be a JSON object"),
    ({"procs_per_node": 3}, "procs_per_node", "this GPU box runs at most 2 processes per node"),
    ({"strategy": "zero3"}, "strategy", '"zero3" is not a valid choice.'),
])
def test_job_create_bad_input_is_400(api_client, digits_dataset, cnn_model, local_backend,
                                     overrides, field, message, no_celery_publish):
    response = api_client.post("/api/jobs/", job_payload(digits_dataset, cnn_model, local_backend, **overrides),
                               format="json")
    assert response.status_code == 400
    errors = response.json()
    assert any(message in e for e in errors[field]), errors
    assert TrainingJob.objects.count() == 0
    no_celery_publish["submit"].assert_not_called()


def test_job_create_with_another_users_dataset_is_400(other_api_client, digits_dataset, cnn_model, local_backend):
    response = other_api_client.post("/api/jobs/", job_payload(digits_dataset, cnn_model, local_backend),
                                     format="json")
    assert response.status_code == 400
    assert set(response.json()) == {"dataset", "model_spec", "backend"}
    assert TrainingJob.objects.count() == 0


def test_job_list_filters_and_pagination(api_client, user, digits_dataset, cnn_model, local_backend):
    from jobs import services

    for i in range(3):
        services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                     backend=local_backend, name=f"run-{i}")
    services.training_job_cancel(job=TrainingJob.objects.get(name="run-1"))
    body = api_client.get("/api/jobs/").json()
    assert body["count"] == 3
    assert [j["name"] for j in body["results"]] == ["run-2", "run-1", "run-0"]
    assert [j["name"] for j in api_client.get("/api/jobs/?state=CANCELLED").json()["results"]] == ["run-1"]
    assert api_client.get(f"/api/jobs/?backend={local_backend.pk}").json()["count"] == 3
    assert api_client.get(f"/api/jobs/?backend={local_backend.pk + 999}").json()["count"] == 0
    assert [j["name"] for j in api_client.get("/api/jobs/?q=run-0").json()["results"]] == ["run-0"]
    page = api_client.get("/api/jobs/?limit=2&offset=2").json()
    assert [j["name"] for j in page["results"]] == ["run-0"]
    assert api_client.get("/api/jobs/?state=BOGUS").status_code == 400


def test_job_retrieve_has_metrics_summary_events_and_ranks(api_client, seeded_job):
    body = api_client.get(f"/api/jobs/{seeded_job.pk}/").json()
    assert body["state"] == "RUNNING"
    assert [e["to_state"] for e in body["events"]] == ["QUEUED", "SUBMITTING", "PENDING", "RUNNING"]
    assert body["metrics"]["train_loss"] == {"points": 3, "last_step": 30, "last_value": 0.4,
                                             "min": 0.4, "max": 2.3, "nonfinite": 0}
    assert body["metrics"]["val_accuracy"]["last_value"] == 0.87
    empty = dict.fromkeys(("data_wait_s", "compute_s", "sync_wait_s", "stage", "stage_layers"))
    assert body["ranks"] == [{"rank": 0, "samples_per_s": 812.5, "step_time_s": 0.0394, **empty},
                             {"rank": 1, "samples_per_s": 798.25, "step_time_s": 0.0401, **empty}]
    assert body["straggler"] is None  # 0.0401 is 2% behind 0.0394: noise, not a straggler
    assert body["cost_usd"] == "0.0900"


def test_job_cancel_and_rerun(api_client, job, django_capture_on_commit_callbacks, no_celery_publish):
    response = api_client.post(f"/api/jobs/{job.pk}/cancel/")
    assert response.status_code == 200
    assert response.json()["state"] == "CANCELLED"
    again = api_client.post(f"/api/jobs/{job.pk}/cancel/")
    assert again.status_code == 400
    assert "there is nothing to cancel" in again.json()["non_field_errors"][0]
    with django_capture_on_commit_callbacks(execute=True):
        rerun = api_client.post(f"/api/jobs/{job.pk}/rerun/")
    assert rerun.status_code == 201
    assert rerun.json()["rerun_of"] == job.pk
    assert rerun.json()["state"] == "QUEUED"
    assert TrainingJob.objects.count() == 2
    no_celery_publish["submit"].assert_called_once()


def test_another_users_objects_are_404(other_api_client, seeded_job):
    job = seeded_job
    for url in (f"/api/jobs/{job.pk}/", f"/api/datasets/{job.dataset_id}/",
                f"/api/models/{job.model_spec_id}/", f"/api/backends/{job.backend_id}/"):
        assert other_api_client.get(url).status_code == 404, url
    assert other_api_client.post(f"/api/jobs/{job.pk}/cancel/").status_code == 404
    assert other_api_client.post(f"/api/jobs/{job.pk}/rerun/").status_code == 404
    assert other_api_client.patch(f"/api/datasets/{job.dataset_id}/", {"name": "mine"},
                                  format="json").status_code == 404
    assert other_api_client.get("/api/jobs/").json()["count"] == 0
    job.refresh_from_db()
    assert job.state == "RUNNING" and job.dataset.name == "digits"
    assert TrainingJob.objects.count() == 1


def test_anonymous_is_refused(client, job):
    for url in ("/api/jobs/", f"/api/jobs/{job.pk}/", "/api/datasets/", "/api/models/", "/api/backends/",
                "/api/schema/"):
        assert client.get(url).status_code == 401, url
    assert client.post(f"/api/jobs/{job.pk}/cancel/").status_code == 401
    assert client.post("/api/jobs/", {}).status_code == 401
    job.refresh_from_db()
    assert job.state == "QUEUED"


def test_token_auth(client, user):
    response = client.post("/api/auth/token/", {"username": "alice", "password": "pw-alice-123"})
    assert response.status_code == 200
    token = response.json()["token"]
    listed = client.get("/api/datasets/", HTTP_AUTHORIZATION=f"Token {token}")
    assert listed.status_code == 200
    assert client.post("/api/auth/token/", {"username": "alice", "password": "no"}).status_code == 400
    assert client.get("/api/datasets/", HTTP_AUTHORIZATION="Token bogus").status_code == 401


def test_dataset_model_backend_crud(api_client, tmp_path):
    ds = api_client.post("/api/datasets/", {"name": "digits", "format": "builtin", "builtin_name": "digits"},
                         format="json")
    assert ds.status_code == 201, ds.json()
    dup = api_client.post("/api/datasets/", {"name": "digits", "format": "builtin", "builtin_name": "digits"},
                          format="json")
    assert dup.status_code == 400
    assert "already have a dataset named digits" in dup.json()["name"][0]
    missing = api_client.post("/api/datasets/", {"name": "t", "format": "csv", "uri": str(tmp_path / "x.csv")},
                              format="json")
    assert missing.status_code == 400 and missing.json()["uri"]
    patched = api_client.patch(f"/api/datasets/{ds.json()['id']}/", {"description": "8×8 digits"}, format="json")
    assert patched.status_code == 200 and patched.json()["description"] == "8×8 digits"
    assert Dataset.objects.count() == 1

    model = api_client.post("/api/models/", {"name": "m", "architecture": "mlp", "params": {"num_layers": 3}},
                            format="json")
    assert model.status_code == 201
    assert model.json()["params"] == {"hidden_size": 128, "num_layers": 3, "dropout": 0.0}
    bad = api_client.post("/api/models/", {"name": "m2", "architecture": "mlp", "params": {"depth": 3}},
                          format="json")
    assert bad.status_code == 400 and "unknown parameter" in bad.json()["params"][0]
    assert ModelSpec.objects.count() == 1

    backend = api_client.post("/api/backends/", {"name": "box", "kind": "gpubox",
                                                 "config": {"max_procs_per_node": 2, "hourly_rate_usd": 1.5}},
                              format="json")
    assert backend.status_code == 201, backend.json()
    bad = api_client.post("/api/backends/", {"name": "box2", "kind": "gpubox",
                                             "config": {"max_procs_per_node": 0}}, format="json")
    assert bad.status_code == 400
    assert bad.json()["config"] == ["Max processes per node: must be 1 to 1024, got 0."]  # the form's label
    put = api_client.put(f"/api/backends/{backend.json()['id']}/",
                         {"name": "box", "kind": "gpubox", "config": {"max_procs_per_node": 1}, "enabled": False},
                         format="json")
    assert put.status_code == 200 and put.json()["enabled"] is False
    assert ComputeBackend.objects.count() == 1
    assert api_client.delete(f"/api/backends/{backend.json()['id']}/").status_code == 405


def test_schema_is_valid_openapi_with_job_paths(api_client):
    response = api_client.get("/api/schema/")
    assert response.status_code == 200
    schema = yaml.safe_load(response.content)
    assert schema["openapi"].startswith("3.")
    for path in ("/api/jobs/", "/api/jobs/{id}/", "/api/jobs/{id}/cancel/", "/api/jobs/{id}/rerun/",
                 "/api/datasets/", "/api/models/", "/api/backends/", "/api/auth/token/"):
        assert path in schema["paths"], path
    assert set(schema["paths"]["/api/jobs/"]) >= {"get", "post"}
    params = {p["name"] for p in schema["paths"]["/api/jobs/"]["get"]["parameters"]}
    assert {"state", "backend", "q", "limit", "offset"} <= params
    from drf_spectacular.validation import validate_schema

    validate_schema(schema)  # raises on an invalid OpenAPI document


def test_api_job_estimate_is_capped_by_its_budget_and_shows_the_arithmetic(
        api_client, digits_dataset, cnn_model, local_backend, no_celery_publish):
    payload = job_payload(digits_dataset, cnn_model, local_backend, max_runtime_s=7200, budget_usd="5.00")
    body = api_client.post("/api/jobs/", payload, format="json").json()
    assert body["estimated_cost_usd"] == "5.0000"  # min(7200 s × 1 node × $3.60/h = $7.20, $5.00)
    assert body["estimate_arithmetic"] == "7200 s × 1 node × $3.60/h = $7.20, capped at the $5.00 budget"
    assert body["max_runtime_covers"].startswith("the run from the moment the job starts on the box")
    schema = yaml.safe_load(api_client.get("/api/schema/").content)["components"]["schemas"]
    for name in ("TrainingJob", "TrainingJobCreate"):
        assert ("start-up counts (on a cloud, launching the machines and downloading the image and the data; "
                "on a GPU box, starting the processes and loading the data)") in \
            schema[name]["properties"]["max_runtime_s"]["description"]
    assert "min(max_runtime_s × nodes × hourly_price_usd / 3600, budget_usd)" in \
        schema["TrainingJob"]["properties"]["estimated_cost_usd"]["description"]


def test_swagger_ui_sends_an_anonymous_browser_to_the_login_page(client):
    response = client.get("/api/docs/")
    assert response.status_code == 302
    assert response["Location"] == "/login/?next=/api/docs/"


def test_swagger_ui_is_served_without_a_cdn(owner_client):
    page = owner_client.get("/api/docs/").content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in page
    assert "cdn." not in page and "unpkg" not in page


def test_api_creates_a_pipeline_job_with_its_shape(api_client, digits_dataset, cnn_model, local_backend,
                                                    no_celery_publish):
    body = job_payload(digits_dataset, cnn_model, local_backend, strategy="pipeline", pipeline_stages=2,
                       microbatches=4, pipeline_schedule="1f1b", batch_size=32)
    response = api_client.post("/api/jobs/", body, format="json")
    assert response.status_code == 201, response.json()
    parallel = response.json()["config"]["parallel"]
    assert (parallel["strategy"], parallel["pipeline_stages"], parallel["microbatches"],
            parallel["pipeline_schedule"]) == ("pipeline", 2, 4, "1f1b")


def test_api_shape_error_shows_the_arithmetic(api_client, digits_dataset, cnn_model, local_backend):
    body = job_payload(digits_dataset, cnn_model, local_backend, strategy="pipeline", microbatches=4,
                       batch_size=30)
    response = api_client.post("/api/jobs/", body, format="json")
    assert response.status_code == 400
    assert "batch size 30 is not divisible into 4 micro-batches" in str(response.json())
    assert TrainingJob.objects.count() == 0
