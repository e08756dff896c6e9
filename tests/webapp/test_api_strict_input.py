"""Issue 27: every writable API endpoint refuses a key it does not know (naming it, with the other
errors), takes a dataset, model or backend by name as well as by id, and answers an unknown /api/
path with JSON; the job form's bad ?mode= says which modes there are."""

from __future__ import annotations

import pytest
import yaml

from jobs import services
from jobs.models import Dataset, ModelSpec, Sweep, Team, TrainingJob, Webhook

pytestmark = pytest.mark.django_db


def job_body(**overrides):
    body = {"dataset": "digits", "model_spec": "digits-cnn", "backend": "local", "nodes": 1, "procs_per_node": 1,
            "epochs": 1, "batch_size": 16}
    body.update(overrides)
    return body


# --- unknown keys (item 8) ---------------------------------------------------------------------


def test_job_create_refuses_unknown_keys_naming_each_with_the_other_errors(api_client, digits_dataset, cnn_model,
                                                                          local_backend, no_celery_publish):
    response = api_client.post("/api/jobs/", {
        "dataset": digits_dataset.pk, "model": cnn_model.pk, "backend": local_backend.pk, "lerning_rate": 0.5,
        "max_steps": 10, "epochs": 0}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["lerning_rate"] == ["Unknown field 'lerning_rate'. Did you mean 'lr'?"]
    assert body["model"] == ["Unknown field 'model'. Did you mean 'model_spec'?"]
    assert "max_steps" not in body  # a large-model setting is a field of the job request (issue 31)
    assert body["epochs"] == ["Ensure this value is greater than or equal to 1."]
    assert body["model_spec"] == ["This field is required."]
    assert TrainingJob.objects.count() == 0
    no_celery_publish["submit"].assert_not_called()


def test_an_unknown_key_without_a_close_name_lists_the_fields(api_client, digits_dataset, cnn_model, local_backend):
    response = api_client.post("/api/jobs/", job_body(colour="red"), format="json")
    assert response.status_code == 400
    message = response.json()["colour"][0]
    assert message.startswith("Unknown field 'colour': a job takes name, dataset, model_spec, backend, strategy, ")
    assert TrainingJob.objects.count() == 0


def test_a_read_only_field_sent_back_is_ignored_not_refused(api_client, digits_dataset):
    shown = api_client.get(f"/api/datasets/{digits_dataset.pk}/").json()
    response = api_client.put(f"/api/datasets/{digits_dataset.pk}/", {**shown, "description": "8×8 digits"},
                              format="json")
    assert response.status_code == 200, response.json()
    assert Dataset.objects.get().description == "8×8 digits"


def test_a_form_bodys_csrf_token_is_no_unknown_field(owner_client):
    """The browsable API's HTML forms post the CSRF token with the fields."""
    response = owner_client.post("/api/datasets/", {"name": "d2", "format": "builtin", "builtin_name": "digits",
                                                    "csrfmiddlewaretoken": "x" * 32})
    assert response.status_code == 201, response.content
    assert Dataset.objects.filter(name="d2").exists()


@pytest.fixture
def webhook(user, settings):
    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    return services.webhook_create(owner=user, url="http://127.0.0.1:9/a", events=["job.failed"])[0]


def _endpoints(job, dataset, model, backend, webhook):
    """(method, path, body, format): a valid request to each writable endpoint but for one unknown key."""
    return [
        ("post", "/api/datasets/", {"name": "d2", "format": "builtin", "builtin_name": "digits", "colour": 1}, "json"),
        ("patch", f"/api/datasets/{dataset.pk}/", {"descripton": "typo"}, "json"),
        ("post", "/api/models/", {"name": "m2", "kind": "builtin", "architecture": "mlp", "colour": 1}, "json"),
        ("post", "/api/models/", {"name": "m3", "kind": "builtin", "architecture": "mlp", "colour": "1"}, "multipart"),
        ("patch", f"/api/models/{model.pk}/", {"colour": 1}, "json"),
        ("post", "/api/backends/", {"name": "b2", "kind": "gpubox", "colour": 1}, "json"),
        ("patch", f"/api/backends/{backend.pk}/", {"colour": 1}, "json"),
        ("post", "/api/jobs/", job_body(colour=1), "json"),
        ("patch", f"/api/jobs/{job.pk}/", {"tags": ["a"], "colour": 1}, "json"),
        ("post", f"/api/jobs/{job.pk}/clone/", {"epochs": 2, "colour": 1}, "json"),
        ("post", f"/api/jobs/{job.pk}/rerun/", {"colour": 1}, "json"),
        ("post", "/api/sweeps/", {"name": "s", "base": {"dataset": dataset.pk, "model_spec": model.pk,
                                                        "backend": backend.pk, "epochs": 1},
                                  "search_space": {"train.lr": {"type": "categorical", "choices": [0.1]}},
                                  "colour": 1}, "json"),
        ("post", "/api/webhooks/", {"url": "http://127.0.0.1:9/b", "events": ["job.failed"], "colour": 1}, "json"),
        ("patch", f"/api/webhooks/{webhook.pk}/", {"colour": 1}, "json"),
        ("patch", "/api/notifications/", {"email_events": ["job.failed"], "colour": 1}, "json"),
        ("post", "/api/saved-filters/", {"name": "f", "query": {"state": "RUNNING"}, "colour": 1}, "json"),
    ]


def test_every_writable_endpoint_refuses_an_unknown_key_and_changes_nothing(api_client, job, digits_dataset, cnn_model,
                                                                            local_backend, webhook):
    before = (TrainingJob.objects.count(), Dataset.objects.count(), ModelSpec.objects.count(), Sweep.objects.count(),
              Webhook.objects.count(), list(TrainingJob.objects.values_list("tags", flat=True)))
    for method, path, body, fmt in _endpoints(job, digits_dataset, cnn_model, local_backend, webhook):
        response = getattr(api_client, method)(path, body, format=fmt)
        assert response.status_code == 400, (method, path, response.content)
        errors = response.json()
        key = "descripton" if "descripton" in body else "colour"
        assert errors[key][0].startswith(f"Unknown field {key!r}"), (method, path, errors)
    assert before == (TrainingJob.objects.count(), Dataset.objects.count(), ModelSpec.objects.count(),
                      Sweep.objects.count(), Webhook.objects.count(),
                      list(TrainingJob.objects.values_list("tags", flat=True)))
    assert api_client.patch(f"/api/datasets/{digits_dataset.pk}/", {"descripton": "x"}, format="json").json() == {
        "descripton": ["Unknown field 'descripton'. Did you mean 'description'?"]}


def test_a_rerun_with_fields_says_to_clone(api_client, job, no_celery_publish):
    response = api_client.post(f"/api/jobs/{job.pk}/rerun/", {"epochs": 5}, format="json")
    assert response.status_code == 400
    assert response.json() == {"epochs": [f"Unknown field 'epochs': a re-run takes no fields (it runs job #{job.pk}'s "
                                          f"frozen config again); for a job with edits, POST them to "
                                          f"/api/jobs/{job.pk}/clone/."]}
    assert TrainingJob.objects.count() == 1
    assert api_client.post(f"/api/jobs/{job.pk}/rerun/", format="json").status_code == 201


def test_a_clone_override_misspelt_gets_the_name_it_meant(api_client, job):
    response = api_client.post(f"/api/jobs/{job.pk}/clone/", {"learning_rate": 0.01, "epoch": 4}, format="json")
    assert response.status_code == 400
    assert response.json() == {"learning_rate": ["Unknown field 'learning_rate'. Did you mean 'lr'?"],
                               "epoch": ["Unknown field 'epoch'. Did you mean 'epochs'?"]}
    assert TrainingJob.objects.count() == 1


# --- a dataset, model or backend by name (item 11) -----------------------------------------------


def test_job_create_takes_names_as_the_cli_does(api_client, digits_dataset, cnn_model, local_backend,
                                                 no_celery_publish):
    response = api_client.post("/api/jobs/", job_body(), format="json")
    assert response.status_code == 201, response.json()
    job = TrainingJob.objects.get()
    assert (job.dataset, job.model_spec, job.backend) == (digits_dataset, cnn_model, local_backend)
    body = response.json()
    assert (body["dataset"], body["model_spec"], body["backend"]) == (digits_dataset.pk, cnn_model.pk, local_backend.pk)
    by_id = api_client.post("/api/jobs/", job_body(dataset=digits_dataset.pk, model_spec=str(cnn_model.pk)),
                            format="json")
    assert by_id.status_code == 201, by_id.json()


def test_an_unknown_name_and_another_users_name_get_the_same_answer(api_client, other_user, digits_dataset, cnn_model,
                                                                     local_backend):
    services.dataset_create(owner=other_user, name="private-digits", format="builtin", builtin_name="digits")
    for name in ("mnist", "private-digits"):
        response = api_client.post("/api/jobs/", job_body(dataset=name, backend="nowhere"), format="json")
        assert response.status_code == 400
        assert response.json() == {
            "dataset": [f"No dataset named {name!r} that you can use: GET /api/datasets/ lists yours (give its name "
                        f"or id)."],
            "backend": ["No backend named 'nowhere' that you can use: GET /api/backends/ lists yours (give its name "
                        "or id)."]}
    assert TrainingJob.objects.count() == 0


def test_a_name_both_yours_and_a_teams_is_refused_with_the_ids(api_client, user, other_user, digits_dataset,
                                                               cnn_model, local_backend):
    team = Team.objects.create(name="vision")
    team.members.add(user, other_user)
    theirs = services.dataset_create(owner=other_user, name="digits", format="builtin", builtin_name="digits",
                                     team=team)
    response = api_client.post("/api/jobs/", job_body(), format="json")
    assert response.status_code == 400
    assert response.json() == {"dataset": [f"2 datasets named 'digits' that you can use: ids {digits_dataset.pk} "
                                           f"(yours), {theirs.pk} (team vision); give the id of the one you mean."]}
    assert api_client.post("/api/jobs/", job_body(dataset=theirs.pk), format="json").status_code == 201


@pytest.mark.parametrize("kind", [True, [1], {"id": 1}, 1.5])
def test_a_reference_that_is_neither_id_nor_name_is_a_400(api_client, digits_dataset, cnn_model, local_backend, kind):
    response = api_client.post("/api/jobs/", job_body(backend=kind), format="json")
    assert response.status_code == 400
    assert response.json()["backend"][0].startswith("Give the backend's id (a whole number) or its name, not ")


def test_clone_overrides_take_names(api_client, user, job, no_celery_publish):
    other = services.dataset_create(owner=user, name="digits-2", format="builtin", builtin_name="digits")
    response = api_client.post(f"/api/jobs/{job.pk}/clone/", {"dataset": "digits-2"}, format="json")
    assert response.status_code == 201, response.json()
    assert TrainingJob.objects.get(pk=response.json()["id"]).dataset == other
    refused = api_client.post(f"/api/jobs/{job.pk}/clone/", {"dataset": "nope"}, format="json")
    assert refused.status_code == 400
    assert refused.json() == {"dataset": ["No dataset named 'nope' that you can use: GET /api/datasets/ lists yours "
                                          "(give its name or id)."]}


def test_the_schema_says_name_or_id(api_client):
    schema = yaml.safe_load(api_client.get("/api/schema/").content)
    request = schema["components"]["schemas"]["TrainingJobCreate"]["properties"]
    for field in ("dataset", "model_spec", "backend"):
        assert request[field]["oneOf"] == [{"type": "integer"}, {"type": "string"}], request[field]
        assert "or its name" in request[field]["description"]


# --- 404s (item 13) -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/no-such-thing/", "/api/jobs/1/no-such-action/x/", "/api/schema/x/"])
def test_an_unknown_api_path_is_a_json_404(api_client, path):
    response = api_client.get(path)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"detail": f"Not found: no API endpoint at {path}. GET /api/ lists the endpoints; "
                                         f"/api/schema/ describes them."}


def test_an_unknown_page_is_still_the_html_404(owner_client):
    response = owner_client.get("/no-such-page/")
    assert response.status_code == 404 and "text/html" in response["Content-Type"]
    assert b"There is nothing at" in response.content


def test_a_bad_mode_on_the_job_form_says_which_modes_there_are(owner_client, job):
    response = owner_client.get(f"/jobs/new/?from={job.pk}&mode=resume")
    assert response.status_code == 404
    page = response.content.decode()
    assert ("No such mode &#x27;resume&#x27;: open the form with mode=continue (resume the job&#x27;s last "
            "checkpoint) or mode=finetune") in page
