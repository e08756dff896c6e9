"""``/api/saved-filters/``: save a job-list query, list, fetch, delete, and the jobs it selects."""

import pytest

from jobs import services
from jobs.models import SavedFilter, TrainingJob

pytestmark = pytest.mark.django_db


def _job(user, dataset, model, backend, name: str, state: str, val_accuracy: float, tags=()):
    job = services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend, name=name)
    TrainingJob.objects.filter(pk=job.pk).update(state=state, final_metrics={"val_accuracy": val_accuracy},
                                                 tags=list(tags))
    return job


def test_save_list_fetch_run_and_delete_a_filter(api_client, user, digits_dataset, cnn_model, local_backend):
    a = _job(user, digits_dataset, cnn_model, local_backend, "a", "SUCCEEDED", 0.91, ["lr"])
    b = _job(user, digits_dataset, cnn_model, local_backend, "b", "SUCCEEDED", 0.97, ["lr"])
    _job(user, digits_dataset, cnn_model, local_backend, "c", "FAILED", 0.99, ["lr"])
    _job(user, digits_dataset, cnn_model, local_backend, "d", "SUCCEEDED", 0.99)

    response = api_client.post("/api/saved-filters/", {"name": " best lr ", "query": {
        "state": "SUCCEEDED", "tag": "lr", "sort": "-val_accuracy"}}, format="json")
    assert response.status_code == 201, response.json()
    saved = response.json()
    assert (saved["name"], saved["query"]) == ("best lr", {"state": "SUCCEEDED", "tag": "lr", "sort": "-val_accuracy"})

    listed = api_client.get("/api/saved-filters/").json()
    assert (listed["count"], [f["id"] for f in listed["results"]]) == (1, [saved["id"]])
    assert api_client.get(f"/api/saved-filters/{saved['id']}/").json()["name"] == "best lr"

    jobs = api_client.get(f"/api/saved-filters/{saved['id']}/jobs/").json()
    assert jobs["count"] == 2
    assert [j["id"] for j in jobs["results"]] == [b.pk, a.pk]  # SUCCEEDED, tagged lr, best first
    page = api_client.get(f"/api/saved-filters/{saved['id']}/jobs/?limit=1&offset=1").json()
    assert [j["id"] for j in page["results"]] == [a.pk]

    assert api_client.delete(f"/api/saved-filters/{saved['id']}/").status_code == 204
    assert not SavedFilter.objects.exists()
    assert api_client.get(f"/api/saved-filters/{saved['id']}/").status_code == 404


def test_every_problem_at_once_and_nothing_saved(api_client, user):
    services.saved_filter_create(owner=user, name="taken", query={})
    response = api_client.post("/api/saved-filters/", {"name": "taken", "colour": "red", "query": {
        "state": "DONE", "page": "2", "sort": "-nonsense.key.that.is.wrong!"}}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["colour"] == ["Unknown field 'colour': a saved filter takes name, query."]
    assert body["name"] == ["You already have a saved filter named “taken”; choose another name or delete that one."]
    assert body["query"][0] == ("Unknown job-list parameters: page; the list's are state, backend, q, tag, archived, "
                                "columns, sort.")
    assert any(m.startswith("State “DONE” is not a job state") for m in body["query"])
    assert len(body["query"]) == 3  # the unknown key, the state and the sort key
    assert list(SavedFilter.objects.values_list("name", flat=True)) == ["taken"]


@pytest.mark.parametrize("body", ["[1, 2]", '"text"', "null", "7"])
def test_a_body_that_is_no_object_is_a_400(api_client, body):
    response = api_client.post("/api/saved-filters/", body, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["non_field_errors"] == ['Send a JSON object: {"name": ..., "query": {...}}.']


def test_no_body_asks_for_a_name(api_client):
    response = api_client.post("/api/saved-filters/")
    assert (response.status_code, response.json()) == (400, {"name": ["Name the filter, e.g. best-lr-sweep."]})


def test_another_users_filter_is_a_404_and_never_listed(api_client, other_user):
    theirs = services.saved_filter_create(owner=other_user, name="bobs", query={"state": "FAILED"})
    assert api_client.get("/api/saved-filters/").json()["count"] == 0
    for path in (f"/api/saved-filters/{theirs.pk}/", f"/api/saved-filters/{theirs.pk}/jobs/"):
        assert api_client.get(path).status_code == 404
    assert api_client.delete(f"/api/saved-filters/{theirs.pk}/").status_code == 404
    assert SavedFilter.objects.filter(pk=theirs.pk).exists()


@pytest.mark.parametrize("name, problem", [
    ("a\x00b", "The name contains a NUL character (\\u0000), which cannot be stored; remove it."),
    ("x" * 101, "The name is 101 characters; at most 100."),
    ("   ", "Name the filter, e.g. best-lr-sweep."),
])
def test_a_name_that_cannot_be_stored_is_a_400(api_client, name, problem):
    response = api_client.post("/api/saved-filters/", {"name": name, "query": {}}, format="json")
    assert (response.status_code, response.json()) == (400, {"name": [problem]})
    assert not SavedFilter.objects.exists()


def test_compare_a_saved_filters_jobs(api_client, user, other_user, digits_dataset, cnn_model, local_backend):
    a = _job(user, digits_dataset, cnn_model, local_backend, "a", "SUCCEEDED", 0.91)
    b = _job(user, digits_dataset, cnn_model, local_backend, "b", "SUCCEEDED", 0.97)
    _job(user, digits_dataset, cnn_model, local_backend, "c", "FAILED", 0.99)
    saved = services.saved_filter_create(owner=user, name="done", query={"state": "SUCCEEDED", "sort": "-val_accuracy"})
    body = api_client.get(f"/api/jobs/compare/?filter={saved.pk}").json()
    assert ([r["id"] for r in body["runs"]], body["matched"]) == ([b.pk, a.pk], 2)
    theirs = services.saved_filter_create(owner=other_user, name="theirs", query={})
    response = api_client.get(f"/api/jobs/compare/?filter={theirs.pk}")
    assert (response.status_code, response.json()["detail"]) == (
        404, f"Saved filter #{theirs.pk} not found: saved filters are private to their owner.")
    response = api_client.get("/api/jobs/compare/?filter=best")
    assert (response.status_code, response.json()) == (
        400, {"filter": ["“best” is not a saved filter's id (GET /api/saved-filters/)."]})
