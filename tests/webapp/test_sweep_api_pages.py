"""The sweep API (/api/sweeps/), the sweep pages (/sweeps/, /sweeps/new/, /sweeps/<id>/) and
``manage.py sweep``, on the real Optuna storage in the test database."""

from __future__ import annotations

import json

import pytest
from django.core.management import call_command
from django.urls import reverse
from django.utils import timezone

from jobs import sweeps
from jobs.models import JobStateChoices as S, MetricPoint, Sweep, TrainingJob
from jobs.states import transition

pytestmark = pytest.mark.django_db

SPACE = {"train.lr": {"type": "categorical", "choices": [0.1, 0.05]},
         "train.batch_size": {"type": "categorical", "choices": [16, 32]}}


def _payload(dataset, model, backend, **extra):
    return {"name": "api-sweep", "base": {"dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk,
                                          "epochs": 1},
            "search_space": SPACE, "sampler": "grid", "max_trials": 4, "max_concurrent_trials": 4, **extra}


def _run_all(sweep, values):
    """Fill the sweep and end its trial jobs with these val_accuracy values, in trial order."""
    sweeps.sweep_fill(sweep_id=sweep.pk)
    for job, value in zip(TrainingJob.objects.filter(sweep=sweep).order_by("trial_number"), values):
        MetricPoint.objects.create(job=job, name="val_accuracy", step=10, epoch=0, value=value,
                                   recorded_at=timezone.now())
        for state in (S.SUBMITTING, S.PENDING, S.RUNNING, S.SUCCEEDED):
            transition(job, state)
        sweeps.sweep_trial_ended(job_id=job.pk)


def test_api_create_retrieve_list_and_cancel(api_client, other_api_client, digits_dataset, cnn_model, local_backend):
    response = api_client.post("/api/sweeps/", _payload(digits_dataset, cnn_model, local_backend), format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["state"] == "RUNNING" and body["sampler"] == "grid" and body["trials"] == []
    assert body["progress"]["limit"] == 4 and body["progress"]["done"] == 0
    sweep = Sweep.objects.get(pk=body["id"])
    _run_all(sweep, [0.5, 0.9, 0.7, 0.6])
    detail = api_client.get(f"/api/sweeps/{sweep.pk}/").json()
    assert detail["state"] == "SUCCEEDED"
    assert [t["state"] for t in detail["trials"]] == ["COMPLETE"] * 4
    assert [t["value"] for t in detail["trials"]] == pytest.approx([0.5, 0.9, 0.7, 0.6])
    assert detail["best_trial"]["number"] == 1 and detail["best_trial"]["value"] == pytest.approx(0.9)
    assert detail["progress"]["done"] == 4 and detail["progress"]["spent_usd"] == "0.0000"
    assert set(detail["param_importances"]) <= set(SPACE)
    assert [s["id"] for s in api_client.get("/api/sweeps/").json()["results"]] == [sweep.pk]
    assert other_api_client.get(f"/api/sweeps/{sweep.pk}/").status_code == 404  # a stranger
    assert other_api_client.get("/api/sweeps/").json()["results"] == []
    response = api_client.post(f"/api/sweeps/{sweep.pk}/cancel/")
    assert response.status_code == 400 and "already ended (SUCCEEDED)" in json.dumps(response.json())


def test_api_cancel_a_running_sweep(api_client, digits_dataset, cnn_model, local_backend):
    sweep_id = api_client.post("/api/sweeps/", _payload(digits_dataset, cnn_model, local_backend),
                               format="json").json()["id"]
    sweeps.sweep_fill(sweep_id=sweep_id)
    response = api_client.post(f"/api/sweeps/{sweep_id}/cancel/")
    assert response.status_code == 200 and response.json()["state"] == "CANCELLED"
    assert set(TrainingJob.objects.filter(sweep_id=sweep_id).values_list("state", flat=True)) == {S.CANCELLED}


@pytest.mark.parametrize("body", [
    {"name": "x", "base": "not json", "search_space": "{"},
    {"name": "x", "base": [], "search_space": [], "max_trials": "many", "budget_usd": "lots", "seed": -1},
    {"name": "\x00", "base": {"dataset": {"deep": [1]}, "model_spec": None, "backend": 1e300, "epochs": "two"},
     "search_space": {"train.lr": {"type": "float", "low": "a", "high": None}}, "pruner_warmup_epochs": 1e400},
    {"name": "x", "base": {"dataset": 1, "model_spec": 1, "backend": 1, "instance_type": 5, "spot": "yes",
                           "hyperparameters": [1], "env": 7}, "search_space": {"a.b.c": 1}},
])
def test_api_bad_input_is_400_never_500(api_client, digits_dataset, cnn_model, local_backend, body):
    # Sent as text: Infinity (1e400 parses so) is what a client can send, not what DRF's encoder writes.
    response = api_client.post("/api/sweeps/", json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.content
    assert Sweep.objects.count() == 0 and TrainingJob.objects.count() == 0


def test_api_every_error_at_once(api_client, digits_dataset, cnn_model, local_backend):
    body = _payload(digits_dataset, cnn_model, local_backend, sampler="bogus", max_concurrent_trials=0,
                    search_space={"train.nope": {"type": "int", "low": 1, "high": 2}})
    errors = api_client.post("/api/sweeps/", body, format="json").json()
    assert set(errors) == {"sampler", "max_concurrent_trials", "search_space"}
    assert "train.nope: unknown field" in errors["search_space"][0]


def test_sweep_pages(owner_client, other_user, user, digits_dataset, cnn_model, local_backend):
    from django.test import Client

    stranger = Client()
    stranger.force_login(other_user)
    sweep = sweeps.sweep_create(owner=user, **_payload(digits_dataset, cnn_model, local_backend))
    _run_all(sweep, [0.5, 0.9, 0.7, 0.6])
    listing = owner_client.get(reverse("sweep-list")).content.decode()
    assert f'href="/sweeps/{sweep.pk}/"' in listing and "api-sweep" in listing
    page = owner_client.get(reverse("sweep-detail", args=[sweep.pk])).content.decode()
    assert "4 of 4</strong> trials done" in page
    assert 'id="best-value">0.9000<' in page
    assert page.count('data-state="COMPLETE"') == 4
    assert 'id="sweep-chart-data" type="application/json"' in page
    assert "<script>" not in page  # no inline script (CSP): the charts are drawn by sweep.js
    chart = json.loads(page.split('id="sweep-chart-data" type="application/json">')[1].split("</script>")[0])
    assert chart["parallel"]["axes"] == ["train.lr", "train.batch_size", "val_accuracy"]
    assert len(chart["parallel"]["lines"]) == 4
    assert all(0 <= p <= 1 for line in chart["parallel"]["lines"] for p in line["points"])
    assert stranger.get(reverse("sweep-detail", args=[sweep.pk])).status_code == 404


def test_create_form_shows_every_error_and_creates(owner_client, digits_dataset, cnn_model, local_backend):
    form = {"name": "form-sweep", "dataset": digits_dataset.pk, "model_spec": cnn_model.pk,
            "backend": local_backend.pk, "nodes": 1, "procs_per_node": 1, "epochs": 1, "batch_size": 32, "lr": 0.05,
            "max_runtime_s": 3600, "hyperparameters": "", "sampler": "grid", "seed": 0,
            "objective_metric": "val_accuracy", "direction": "maximize", "objective": "final", "max_trials": 4,
            "max_concurrent_trials": 2, "budget_usd": "", "pruner": "median", "pruner_startup_trials": 1,
            "pruner_warmup_epochs": 0}
    page = owner_client.get(reverse("sweep-create")).content.decode()
    assert "train.lr" in page and 'id="space-example"' in page
    bad = owner_client.post(reverse("sweep-create"), {**form, "search_space": '{"train.lr": {"type": "float", '
                                                                            '"low": 0.01, "high": 0.1}}',
                                                      "epochs": 1, "procs_per_node": 3})
    text = bad.content.decode()
    assert bad.status_code == 200 and "the grid sampler needs listed values" in text
    assert Sweep.objects.count() == 0
    ok = owner_client.post(reverse("sweep-create"), {**form, "search_space": json.dumps(SPACE)})
    sweep = Sweep.objects.get()
    assert ok.status_code == 302 and ok["Location"] == f"/sweeps/{sweep.pk}/"
    assert sweep.base["epochs"] == 1 and sweep.pruner == "median" and sweep.search_space == SPACE


def test_on_sqlite_the_sweep_pages_say_why_before_any_form(owner_client, digits_dataset, cnn_model, local_backend):
    """The demo's embedded SQLite database cannot run sweeps: the form page says so at its top and offers
    no form to fill in first; the list has no "New sweep" button, and says why."""
    from unittest import mock

    from django.db import connections

    with mock.patch.object(connections["default"], "vendor", "sqlite"):
        page = owner_client.get(reverse("sweep-create"))
        posted = owner_client.post(reverse("sweep-create"), {"name": "x"})
        listed = owner_client.get(reverse("sweep-list")).content.decode()
    text = page.content.decode()
    assert page.status_code == 200 and 'id="sweeps-unavailable"' in text
    assert "Sweeps need PostgreSQL" in text and 'id="sweep-form"' not in text and 'name="search_space"' not in text
    # the notice is the first thing of the page's content, before anything to fill in
    assert text.index('id="sweeps-unavailable"') < text.index("Launch a single job instead")
    assert posted.status_code == 400 and 'id="sweeps-unavailable"' in posted.content.decode()
    assert Sweep.objects.count() == 0
    assert 'id="sweeps-unavailable"' in listed and "Sweeps need PostgreSQL" in listed
    assert reverse("sweep-create") not in listed
    # On PostgreSQL the form is there and no notice.
    text = owner_client.get(reverse("sweep-create")).content.decode()
    assert 'id="sweep-form"' in text and "sweeps-unavailable" not in text


def test_cancel_page_teammate_is_refused(owner_client, client, django_user_model, user, digits_dataset, cnn_model,
                                         local_backend):
    sweep = sweeps.sweep_create(owner=user, **_payload(digits_dataset, cnn_model, local_backend))
    response = owner_client.post(reverse("sweep-cancel", args=[sweep.pk]))
    assert response.status_code == 302
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.CANCELLED


def test_cli_create_list_show_cancel(tmp_path, capsys, user, digits_dataset, cnn_model, local_backend):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "cli-sweep", "base": {"dataset": "digits", "model_spec": "digits-cnn",
                                                              "backend": "local", "epochs": 1},
                                "search_space": SPACE, "sampler": "grid", "max_trials": 4,
                                "max_concurrent_trials": 4}))
    call_command("sweep", "--user", "alice", "create", "--from-file", str(spec), "--json")
    created = json.loads(capsys.readouterr().out)
    assert created["name"] == "cli-sweep" and created["state"] == "RUNNING"
    sweep = Sweep.objects.get(pk=created["id"])
    _run_all(sweep, [0.1, 0.2, 0.4, 0.3])
    call_command("sweep", "--user", "alice", "list")
    assert f"{sweep.pk}  SUCCEEDED" in capsys.readouterr().out
    call_command("sweep", "--user", "alice", "show", str(sweep.pk))
    out = capsys.readouterr().out
    assert "4 of 4 trials done, 0 running" in out and "Best: trial 2 val_accuracy=0.4" in out
    call_command("sweep", "--user", "alice", "show", str(sweep.pk), "--json")
    shown = json.loads(capsys.readouterr().out)
    assert shown["best_trial"]["number"] == 2 and len(shown["trials"]) == 4


def test_cli_bad_spec_exits_2_with_every_message(tmp_path, capsys, user, digits_dataset, cnn_model, local_backend):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "", "base": {"dataset": "nope", "model_spec": "digits-cnn", "backend": "local"},
                                "search_space": {"train.lr": {"type": "float", "low": 1, "high": 0}}}))
    with pytest.raises(SystemExit) as exit_:
        call_command("sweep", "--user", "alice", "create", "--from-file", str(spec))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "name: Name: give the sweep a name" in err
    assert "base.dataset: No dataset named 'nope' that you can use: GET /api/datasets/ lists yours" in err
    assert "low (1) is above high (0)" in err
    assert Sweep.objects.count() == 0


def test_cli_help_names_every_action(capsys):
    with pytest.raises(SystemExit):
        call_command("sweep", "--help")
    out = capsys.readouterr().out
    for word in ("create", "list", "show", "cancel", "search_space", "--user"):
        assert word in out
