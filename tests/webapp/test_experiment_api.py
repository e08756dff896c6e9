"""The experiment table in the REST API (docs/experiments.md): ``?ordering=`` on final metrics and
hyperparameters, ``?archived=``, ``?tag=``, ``PATCH /api/jobs/{id}/`` of tags, notes and archived only,
and ``GET /api/jobs/{id}/logs/`` with its cursor; every bad input a 400 naming the field."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from experimentkit import make_job
from jobs.models import JobLogLine, Team, TrainingJob
from trainer_pkg.metrics import format_metric_line

pytestmark = pytest.mark.django_db


@pytest.fixture
def jobs(user, digits_dataset, cnn_model, local_backend):
    def job(name, acc, lr, state="SUCCEEDED"):
        return make_job(user, digits_dataset, cnn_model, local_backend, name=name, state=state,
                        final_metrics={"val_accuracy": acc} if acc is not None else {},
                        config={"train": {"lr": lr}})

    return {"a": job("run-a", 0.91, 0.1), "b": job("run-b", 0.62, 0.01), "c": job("run-c", None, 0.05),
            "live": job("run-live", 0.3, 0.2, state="RUNNING")}


def names(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [row["name"] for row in response.json()["results"]]


def test_ordering_by_metric_and_hyperparameter_with_pages(api_client, jobs):
    assert names(api_client.get("/api/jobs/?ordering=-val_accuracy")) == ["run-a", "run-b", "run-live", "run-c"]
    assert names(api_client.get("/api/jobs/?ordering=val_accuracy")) == ["run-live", "run-b", "run-a", "run-c"]
    assert names(api_client.get("/api/jobs/?ordering=train.lr")) == ["run-b", "run-c", "run-a", "run-live"]
    first = api_client.get("/api/jobs/?ordering=-train.lr&limit=2").json()
    assert [r["name"] for r in first["results"]] == ["run-live", "run-a"] and first["count"] == 4
    assert "after=" not in first["next"]  # another order than newest first pages by offset
    assert names(api_client.get(first["next"])) == ["run-c", "run-b"]
    row = api_client.get("/api/jobs/?ordering=-val_accuracy").json()["results"][0]
    assert (row["final_metrics"], row["tags"], row["notes"], row["archived"], row["archived_at"]) == (
        {"val_accuracy": 0.91}, [], "", False, None)


def test_bad_ordering_archived_and_tag_are_400(api_client, jobs):
    r = api_client.get("/api/jobs/?ordering=-val accuracy&archived=maybe")
    assert r.status_code == 400
    body = r.json()
    assert body["archived"] == ["archived is 1 (archived jobs only), all (both) or 0 (the default), got “maybe”."]
    assert body["ordering"][0].startswith("Cannot sort by “-val accuracy”: “val accuracy” is neither a metric name")
    # A well-formed name that no job reported is no sort key: 400 naming it and the allowed keys, not an
    # order by a value no job has (which reads as no order at all).
    r = api_client.get("/api/jobs/?ordering=-bogus")
    assert r.status_code == 400
    message = r.json()["ordering"][0]
    assert message.startswith("Cannot sort by “-bogus”: it is not a sort key, and no job of yours reported a metric "
                              "of that name. Sort by created, name, state, backend, cost, id; a metric: lr, ")
    assert "val_accuracy" in message and "e.g. train.lr" in message
    make_job(jobs["a"].owner, jobs["a"].dataset, jobs["a"].model_spec, jobs["a"].backend, name="run-tok",
             final_metrics={"tokens/s": 812.0})
    assert names(api_client.get("/api/jobs/?ordering=-tokens/s"))[0] == "run-tok"
    r = api_client.get("/api/jobs/?tag=NOT A TAG")
    assert r.status_code == 400 and r.json()["tag"][0].startswith("Tag “not a tag” may hold only")


def test_patch_tags_notes_archived_only(api_client, jobs):
    job = jobs["a"]
    r = api_client.patch(f"/api/jobs/{job.pk}/", {"tags": ["Baseline", "lr-sweep"], "notes": "good"}, format="json")
    assert r.status_code == 200 and (r.json()["tags"], r.json()["notes"]) == (["baseline", "lr-sweep"], "good")
    r = api_client.patch(f"/api/jobs/{job.pk}/", {"name": "renamed", "tags": ["x"], "state": "FAILED"}, format="json")
    assert r.status_code == 400 and r.json() == {
        "name": ["name is read-only: a job's tags, notes and archived can be changed, nothing else."],
        "state": ["state is read-only: a job's tags, notes and archived can be changed, nothing else."]}
    r = api_client.patch(f"/api/jobs/{job.pk}/", {"tags": "a" * 51, "notes": 5, "archived": "yes"}, format="json")
    assert r.status_code == 400 and r.json() == {
        "tags": [f"Tag “{'a' * 50}…” is 51 characters; at most 50."], "notes": ["Notes are text, got int."],
        "archived": ["archived is true or false, got 'yes'."]}
    assert api_client.put(f"/api/jobs/{job.pk}/", {"tags": []}, format="json").status_code == 405
    job.refresh_from_db()
    assert (job.name, job.state, job.tags, job.notes) == ("run-a", "SUCCEEDED", ["baseline", "lr-sweep"], "good")
    # Archive: hidden from the list, listed with archived=1 and all, still fetched by id.
    r = api_client.patch(f"/api/jobs/{job.pk}/", {"archived": True}, format="json")
    assert r.status_code == 200 and r.json()["archived"] is True
    assert "run-a" not in names(api_client.get("/api/jobs/"))
    assert names(api_client.get("/api/jobs/?archived=1")) == ["run-a"]
    assert len(names(api_client.get("/api/jobs/?archived=all"))) == 4
    assert api_client.get(f"/api/jobs/{job.pk}/").json()["archived"] is True
    assert names(api_client.get("/api/jobs/?tag=lr-sweep&archived=all")) == ["run-a"]
    r = api_client.patch(f"/api/jobs/{jobs['live'].pk}/", {"archived": True}, format="json")
    assert r.status_code == 400 and r.json()["archived"][0].startswith("Job run-live (#")
    assert api_client.patch(f"/api/jobs/{job.pk}/", {}, format="json").json() == {
        "non_field_errors": ["Send tags, notes or archived to change; nothing else of a job can be changed."]}


def test_patch_as_teammate_and_stranger(user, django_user_model, jobs):
    team = Team.objects.create(name="vision")
    erin = django_user_model.objects.create_user(username="erin", password="pw-erin-123")
    dave = django_user_model.objects.create_user(username="dave", password="pw-dave-123")
    team.members.add(user, erin)
    job = jobs["a"]
    TrainingJob.objects.filter(pk=job.pk).update(team=team)
    for who, status in ((erin, 403), (dave, 404)):
        api = APIClient()
        api.force_authenticate(who)
        assert api.patch(f"/api/jobs/{job.pk}/", {"tags": ["x"]}, format="json").status_code == status
        assert api.get(f"/api/jobs/{job.pk}/logs/").status_code == (200 if who is erin else 404)
    assert TrainingJob.objects.get(pk=job.pk).tags == []


def test_logs_after_cursor_with_filters(api_client, jobs):
    job = jobs["live"]
    # A job logged when records were stored as lines too (is_metric rows).
    texts = ["[launch] rank 0 (local rank 0)", "[launch] rank 1 (local rank 1)",
             format_metric_line({"event": "step", "step": 1}), "[rank1]: ValueError: bad", "epoch 0 done"]
    JobLogLine.objects.bulk_create(JobLogLine(job=job, seq=i, text=t) for i, t in enumerate(texts))
    url = f"/api/jobs/{job.pk}/logs/"
    body = api_client.get(url + "?limit=2").json()
    assert body == {"lines": [{"seq": 0, "text": texts[0]}, {"seq": 1, "text": texts[1]}], "next": 1, "more": True}
    body = api_client.get(url + f"?after={body['next']}").json()
    assert body == {"lines": [{"seq": 3, "text": texts[3]}, {"seq": 4, "text": texts[4]}], "next": 4, "more": False}
    assert api_client.get(url + "?after=4").json() == {"lines": [], "next": 4, "more": False}
    assert api_client.get(url + "?rank=1").json()["lines"] == [{"seq": 1, "text": texts[1]}, {"seq": 3, "text": texts[3]}]
    assert api_client.get(url + "?metrics=true&q=METRIC").json()["lines"] == [{"seq": 2, "text": texts[2]}]
    # The job list's ?q= is not a job search here: it searches the log.
    assert api_client.get(url + "?q=epoch").json()["lines"] == [{"seq": 4, "text": "epoch 0 done"}]
    JobLogLine.objects.create(job=job, seq=5, text="epoch 1 done")
    assert api_client.get(url + "?after=4").json() == {"lines": [{"seq": 5, "text": "epoch 1 done"}], "next": 5,
                                                        "more": False}
    r = api_client.get(url + "?after=x&limit=0&rank=-1&metrics=perhaps")
    assert r.status_code == 400 and r.json() == {
        "after": ["after must be a whole number, got “x”."], "limit": ["limit must be 1 to 5,000, got 0."],
        "rank": ["rank must be 0 to 1,000,000, got -1."], "metrics": ["metrics is true or false, got “perhaps”."]}
