"""Forms: creates and edits go through the services; bad input shows the message on the field and
writes nothing (webapp/views.py, webapp/forms.py)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from django.urls import reverse

from jobs.models import ComputeBackend, Dataset, ModelSpec, TrainingJob

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


# --- jobs ------------------------------------------------------------------------------------


def test_job_create_via_form_enqueues_submit(owner_client, digits_dataset, cnn_model, local_backend,
                                             django_capture_on_commit_callbacks, no_celery_publish):
    data = job_form_data(digits_dataset, cnn_model, local_backend, name="form-job",
                         hyperparameters='{"train": {"optimizer": "adamw"}}')
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = owner_client.post(reverse("job-create"), data)
    job = TrainingJob.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("job-detail", args=[job.pk])
    assert (job.name, job.state, job.nodes, job.procs_per_node) == ("form-job", "QUEUED", 1, 2)
    assert job.config["train"]["optimizer"] == "adamw"
    assert job.config["train"]["epochs"] == 3
    assert len(callbacks) == 1
    no_celery_publish["submit"].assert_called_once()
    assert no_celery_publish["submit"].call_args.kwargs["args"] == [job.pk]


@pytest.mark.parametrize("field, value, message", [
    ("nodes", 0, "Ensure this value is greater than or equal to 1."),
    ("nodes", -2, "Ensure this value is greater than or equal to 1."),
    ("procs_per_node", 0, "Ensure this value is greater than or equal to 1."),
    ("epochs", -1, "Ensure this value is greater than or equal to 1."),
    ("dataset", 999999, "Select a valid choice. That choice is not one of the available choices."),
    ("hyperparameters", "{not json", "Not valid JSON"),
    ("hyperparameters", "[1, 2]", "Must be a JSON object"),
    ("procs_per_node", 3, "this GPU box runs at most 2 processes per node"),
    ("lr", 0, "Learning rate must be greater than 0"),
    ("hyperparameters", '{"train": {"optimizer": "rmsprop"}}', "train.optimizer: must be one of"),
])
def test_job_form_bad_input_shows_errors_and_creates_nothing(
        owner_client, digits_dataset, cnn_model, local_backend, field, value, message, no_celery_publish):
    data = job_form_data(digits_dataset, cnn_model, local_backend, **{field: value})
    response = owner_client.post(reverse("job-create"), data)
    assert response.status_code == 200
    form = response.context["form"]
    assert any(message in e for e in form.errors[field]), form.errors
    assert message in response.content.decode().replace("&#x27;", "'").replace("&quot;", '"')
    assert TrainingJob.objects.count() == 0
    no_celery_publish["submit"].assert_not_called()


def test_job_form_offers_only_the_users_objects(owner_client, other_user, digits_dataset, cnn_model, local_backend):
    from jobs import services

    theirs = services.dataset_create(owner=other_user, name="their-digits", format="builtin", builtin_name="digits")
    page = owner_client.get(reverse("job-create")).content.decode()
    assert "digits-cnn" in page and "local" in page
    assert "their-digits" not in page
    response = owner_client.post(reverse("job-create"), job_form_data(theirs, cnn_model, local_backend))
    assert response.status_code == 200
    assert "dataset" in response.context["form"].errors
    assert TrainingJob.objects.count() == 0


def test_estimate_endpoint_shows_the_figure(owner_client, local_backend):
    # $3.60 per node-hour × 2 nodes... the gpubox runs one node, so 1 node × 7200 s × $3.60/h = $7.20.
    response = owner_client.post(reverse("job-estimate"), {
        "backend": local_backend.pk, "nodes": 1, "procs_per_node": 2, "max_runtime_s": 7200,
    })
    assert response.status_code == 200
    html = response.content.decode()
    assert "$7.20 max (7200 s × 1 node × $3.60/h)" in html
    assert "estimate-ok" in html


def test_estimate_endpoint_caps_at_the_budget_and_says_what_the_limit_counts(owner_client, local_backend):
    response = owner_client.post(reverse("job-estimate"), {
        "backend": local_backend.pk, "nodes": 1, "procs_per_node": 1, "max_runtime_s": 7200, "budget_usd": "5",
    })
    html = response.content.decode()
    assert "$5.00 max (7200 s × 1 node × $3.60/h = $7.20, capped at the $5.00 budget)" in html
    assert "the max runtime counts the run from the moment the job starts on the box" in html
    form = owner_client.get(reverse("job-create")).content.decode()
    assert ("start-up counts (on a cloud, launching the machines and downloading the image and the data; on a "
            "GPU box, starting the processes and loading the data)") in form
    assert "min(max runtime × nodes × hourly price, budget)" in form


def test_estimate_endpoint_says_which_torch_a_strategy_needs(owner_client, user):
    """Picking fsdp for a Vertex backend on its default image (torch 2.4) shows why at once, before a submit."""
    from jobs import services

    vertex = services.backend_create(owner=user, name="vx", kind="vertex",
                                     config={"project": "my-proj", "staging_bucket": "gs://stage/tb"})
    response = owner_client.post(reverse("job-estimate"), {
        "backend": vertex.pk, "nodes": 2, "procs_per_node": 1, "max_runtime_s": 3600, "strategy": "fsdp"})
    html = response.content.decode()
    assert "estimate-error" in html
    assert ("parallel.strategy fsdp needs torch ≥ 2.6 (FSDP2 fully_shard), but image_uri "
            "us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-4.py310:latest has torch 2.4: use ddp") in html


def test_estimate_endpoint_shows_the_shape_error(owner_client, local_backend):
    response = owner_client.post(reverse("job-estimate"), {
        "backend": local_backend.pk, "nodes": 1, "procs_per_node": 5, "max_runtime_s": 3600,
    })
    assert response.status_code == 200
    html = response.content.decode()
    assert "estimate-error" in html
    assert "this GPU box runs at most 2 processes per node" in html
    bad = owner_client.post(reverse("job-estimate"), {"backend": local_backend.pk, "nodes": 0,
                                                     "procs_per_node": 1, "max_runtime_s": 3600})
    assert "greater than or equal to 1" in bad.content.decode()
    assert TrainingJob.objects.count() == 0


def test_estimate_endpoint_refuses_another_users_backend(other_client, local_backend):
    response = other_client.post(reverse("job-estimate"), {
        "backend": local_backend.pk, "nodes": 1, "procs_per_node": 1, "max_runtime_s": 3600,
    })
    assert response.status_code == 200
    assert "estimate-error" in response.content.decode()
    assert "$3.60" not in response.content.decode()


def test_cancel_and_rerun_buttons(owner_client, job, django_capture_on_commit_callbacks, no_celery_publish):
    page = owner_client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert 'id="cancel-job"' in page and 'id="rerun-job"' in page
    response = owner_client.post(reverse("job-cancel", args=[job.pk]))
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.state == "CANCELLED"
    page = owner_client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert 'id="cancel-job"' not in page  # hidden when terminal
    # Cancelling again: the service's message, no 500.
    response = owner_client.post(reverse("job-cancel", args=[job.pk]), follow=True)
    assert response.status_code == 200
    assert "there is nothing to cancel" in response.content.decode()
    with django_capture_on_commit_callbacks(execute=True):
        response = owner_client.post(reverse("job-rerun", args=[job.pk]))
    new_job = TrainingJob.objects.exclude(pk=job.pk).get()
    assert response["Location"] == reverse("job-detail", args=[new_job.pk])
    assert new_job.rerun_of_id == job.pk and new_job.state == "QUEUED"
    assert new_job.config == job.config
    no_celery_publish["submit"].assert_called_once()


def test_cancel_and_rerun_need_post(owner_client, job):
    assert owner_client.get(reverse("job-cancel", args=[job.pk])).status_code == 405
    assert owner_client.get(reverse("job-rerun", args=[job.pk])).status_code == 405


def test_job_list_filters_and_pagination(owner_client, user, digits_dataset, cnn_model, local_backend):
    from jobs import services

    for i in range(27):
        services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                     backend=local_backend, name=f"sweep-{i:02d}")
    services.training_job_cancel(job=TrainingJob.objects.get(name="sweep-03"))
    page1 = owner_client.get(reverse("job-list"))
    assert len(page1.context["jobs"]) == 25
    assert page1.context["page"].paginator.num_pages == 2
    page2 = owner_client.get(reverse("job-list") + "?page=2")
    assert [j.name for j in page2.context["jobs"]] == ["sweep-01", "sweep-00"]
    cancelled = owner_client.get(reverse("job-list") + "?state=CANCELLED")
    assert [j.name for j in cancelled.context["jobs"]] == ["sweep-03"]
    searched = owner_client.get(reverse("job-list") + "?q=sweep-2")
    assert sorted(j.name for j in searched.context["jobs"]) == [f"sweep-2{i}" for i in range(7)]
    by_backend = owner_client.get(reverse("job-list") + f"?backend={local_backend.pk}&page=99")
    assert by_backend.status_code == 200 and len(by_backend.context["jobs"]) == 2  # last page
    junk = owner_client.get(reverse("job-list") + "?state=NOPE&backend=abc&page=x")
    # A bad filter is named (400, like the API) and left out; a bad page number is the first page.
    assert junk.status_code == 400 and len(junk.context["jobs"]) == 25
    assert [p.split(";")[0] for p in junk.context["filter_problems"]] == [
        "State “NOPE” is not a job state", "Backend “abc” is not one of your backends"]


# --- datasets, models, backends --------------------------------------------------------------


def test_dataset_create_and_edit(owner_client, user):
    response = owner_client.post(reverse("dataset-create"), {
        "name": "digits2", "format": "builtin", "builtin_name": "digits", "label_column": "label",
    })
    assert response.status_code == 302
    dataset = Dataset.objects.get(name="digits2")
    response = owner_client.post(reverse("dataset-edit", args=[dataset.pk]), {
        "name": "digits3", "description": "renamed", "format": "builtin", "builtin_name": "digits",
    })
    assert response.status_code == 302
    dataset.refresh_from_db()
    assert (dataset.name, dataset.description) == ("digits3", "renamed")


def test_dataset_errors_come_from_the_service(owner_client, tmp_path):
    missing = tmp_path / "nope.csv"
    response = owner_client.post(reverse("dataset-create"), {
        "name": "table", "format": "csv", "uri": str(missing), "label_column": "label",
    })
    assert response.status_code == 200
    assert response.context["form"].errors["uri"]
    csv = tmp_path / "t.csv"
    csv.write_text("a,b,target\n1,2,0\n3,4,1\n")
    response = owner_client.post(reverse("dataset-create"), {
        "name": "table", "format": "csv", "uri": str(csv), "label_column": "label",
    })
    assert response.status_code == 200
    errors = response.context["form"].errors["uri"]
    assert any("label" in e for e in errors), errors
    response = owner_client.post(reverse("dataset-create"), {"name": "nodata", "format": "csv", "uri": ""})
    assert "Path or URI is required for a dataset in CSV table format." in response.context["form"].errors["uri"]
    assert Dataset.objects.count() == 0


def test_model_create_edit_and_json_errors(owner_client):
    page = owner_client.get(reverse("model-create")).content.decode()
    assert "Output channels of the first conv block" in page  # the registry's parameter docs
    response = owner_client.post(reverse("model-create"), {
        "name": "mlp-small", "architecture": "mlp", "params": '{"hidden_size": 32}',
    })
    assert response.status_code == 302
    model = ModelSpec.objects.get(name="mlp-small")
    assert model.params == {"hidden_size": 32, "num_layers": 2, "dropout": 0.0}
    bad_json = owner_client.post(reverse("model-edit", args=[model.pk]), {
        "name": "mlp-small", "architecture": "mlp", "params": "{hidden_size: 32",
    })
    assert bad_json.status_code == 200
    assert any("Not valid JSON" in e for e in bad_json.context["form"].errors["params"])
    out_of_range = owner_client.post(reverse("model-edit", args=[model.pk]), {
        "name": "mlp-small", "architecture": "mlp", "params": '{"hidden_size": 0}',
    })
    assert any("out of range" in e for e in out_of_range.context["form"].errors["params"])
    model.refresh_from_db()
    assert model.params["hidden_size"] == 32


def test_backend_create_edit_and_errors(owner_client):
    response = owner_client.post(reverse("backend-create"), {
        "name": "box", "kind": "gpubox", "max_procs_per_node": 4, "hourly_rate_usd": "1.25",
        "enabled": "on",
    })
    assert response.status_code == 302
    backend = ComputeBackend.objects.get(name="box")
    assert backend.config["max_procs_per_node"] == 4
    assert Decimal(str(backend.config["hourly_rate_usd"])) == Decimal("1.25")
    page = owner_client.get(reverse("backend-edit", args=[backend.pk])).content.decode()
    assert 'value="4"' in page
    bad = owner_client.post(reverse("backend-edit", args=[backend.pk]), {
        "name": "box", "kind": "gpubox", "max_procs_per_node": 2, "extra_config": '{"colour": "red"}',
        "enabled": "on",
    })
    assert bad.status_code == 200
    assert any("unknown gpubox setting" in e for e in bad.context["form"].errors["extra_config"])
    bad_kind = owner_client.post(reverse("backend-create"), {"name": "x", "kind": "mainframe"})
    assert "kind" in bad_kind.context["form"].errors
    not_json = owner_client.post(reverse("backend-create"), {"name": "y", "kind": "gpubox", "extra_config": "{"})
    assert "extra_config" in not_json.context["form"].errors
    assert ComputeBackend.objects.count() == 1
    backend.refresh_from_db()
    assert backend.config["max_procs_per_node"] == 4


# --- every error after one submit ------------------------------------------------------------


def test_the_dataset_form_shows_its_own_and_the_services_errors_together(owner_client):
    response = owner_client.post(reverse("dataset-create"), {"name": "not a slug", "format": "npz", "uri": ""})
    errors = response.context["form"].errors
    assert errors["name"][0].startswith("Enter a valid “slug”")
    assert errors["uri"] == ["Path or URI is required for a dataset in NPZ arrays format."]  # the service's, same submit
    assert not Dataset.objects.exists()


def test_the_model_form_shows_its_own_and_the_services_errors_together(owner_client):
    response = owner_client.post(reverse("model-create"), {
        "name": "", "architecture": "mlp", "params": '{"channels": 32}'})
    errors = response.context["form"].errors
    assert errors["name"] == ["This field is required."]
    assert errors["params"] == ["Parameter channels: unknown parameter for mlp (known: dropout, hidden_size, "
                                "num_layers)"]
    assert not ModelSpec.objects.exists()


def test_the_job_form_shows_its_own_and_the_services_errors_together(owner_client, digits_dataset, cnn_model,
                                                                      local_backend, no_celery_publish):
    data = job_form_data(digits_dataset, cnn_model, local_backend, epochs="three", procs_per_node=3)
    response = owner_client.post(reverse("job-create"), data)
    errors = response.context["form"].errors
    assert errors["epochs"] == ["Enter a whole number."]
    assert errors["procs_per_node"][0].startswith("1 node × 3 processes = 3 ranks, but this GPU box runs at most 2")
    assert not TrainingJob.objects.exists()
    no_celery_publish["submit"].assert_not_called()  # the trial run sends nothing
