"""The create endpoints of webhooks and sweeps refuse what the requester may not use: a team they are
not a member of, and (sweeps) a base job naming another user's dataset, model or backend, private
or shared with a team the requester is not in. API: 400 naming the field; HTML forms: the page
again with the error on the field. Either way no row is stored and nothing is sent (no on-commit
work). Each refusal has a control: the same input with the requester's own team or objects is
accepted, so the refusal is the ownership rule's and not another error's.

(tests/security/test_permission_walk.py walks reads and writes of existing objects; this file the
references a new object makes.)"""

from __future__ import annotations

import html
from types import SimpleNamespace

import pytest
from django.test import Client
from rest_framework.test import APIClient

from jobs import services
from jobs.models import Sweep, Team, TrainingJob, Webhook

pytestmark = pytest.mark.django_db

NOT_YOUR_TEAM = "Choose one of your teams; this one does not exist or you are not a member."
NOT_A_CHOICE = "Select a valid choice. That choice is not one of the available choices."
HOOK_URL = "https://93.184.215.14/hook"  # a public address literal: no DNS lookup, passes the SSRF check
SPACE = {"train.lr": {"type": "categorical", "choices": [0.1, 0.05]}}


@pytest.fixture
def mine(user):
    """alice's own team (her objects are the conftest's digits_dataset, cnn_model, local_backend)."""
    team = Team.objects.create(name="alices-lab")
    team.members.add(user)
    return team


@pytest.fixture
def bobs(other_user):
    """bob's team "bobs-lab" (bob only) and his dataset, model and gpubox backend, private."""
    team = Team.objects.create(name="bobs-lab")
    team.members.add(other_user)
    return SimpleNamespace(
        team=team,
        dataset=services.dataset_create(owner=other_user, name="bob-digits", format="builtin", builtin_name="digits"),
        model_spec=services.model_spec_create(owner=other_user, name="bob-cnn", architecture="cnn", params={}),
        backend=services.backend_create(owner=other_user, name="bob-box", kind="gpubox",
                                        config={"hourly_rate_usd": 1.0}))


def _share_with_team(obj, team):
    type(obj).objects.filter(pk=obj.pk).update(team=team)


def _api(user) -> APIClient:
    api = APIClient()
    api.force_authenticate(user)
    return api


def _page(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _rows() -> dict[str, int]:
    return {"sweeps": Sweep.objects.count(), "jobs": TrainingJob.objects.count(), "webhooks": Webhook.objects.count()}


OWN = {"sweeps": 0, "jobs": 0, "webhooks": 0}


# --- webhooks ------------------------------------------------------------------------------------


def test_api_webhook_with_a_team_she_is_not_in(user, bobs, mine, django_capture_on_commit_callbacks):
    body = {"url": HOOK_URL, "events": ["job.failed"], "team": bobs.team.pk}
    with django_capture_on_commit_callbacks() as sent:
        response = _api(user).post("/api/webhooks/", body, format="json")
    assert response.status_code == 400
    assert response.json() == {"team": [NOT_YOUR_TEAM]}
    assert _rows() == OWN and sent == []
    ok = _api(user).post("/api/webhooks/", {**body, "team": mine.pk}, format="json")
    assert ok.status_code == 201, ok.json()
    assert Webhook.objects.get().team_id == mine.pk


def test_form_webhook_with_a_team_she_is_not_in(user, bobs, mine, django_capture_on_commit_callbacks):
    data = {"name": "hook", "url": HOOK_URL, "events": ["job.failed"], "format": "json", "enabled": "on",
            "team": str(bobs.team.pk)}
    with django_capture_on_commit_callbacks() as sent:
        response = _page(user).post("/account/webhooks/new/", data)
    assert response.status_code == 200  # the form again
    assert response.context["form"].errors == {"team": [NOT_A_CHOICE]}
    assert html.escape(NOT_A_CHOICE) in response.content.decode()
    assert "bobs-lab" not in response.content.decode()  # not even offered
    assert _rows() == OWN and sent == []
    ok = _page(user).post("/account/webhooks/new/", {**data, "team": str(mine.pk)})
    assert ok.status_code == 302
    assert Webhook.objects.get().team_id == mine.pk


# --- sweeps: the API -----------------------------------------------------------------------------


def _sweep_body(dataset, model_spec, backend, **extra):
    return {"name": "lr-search", "base": {"dataset": dataset.pk, "model_spec": model_spec.pk, "backend": backend.pk,
                                          "epochs": 1},
            "search_space": SPACE, "sampler": "grid", **extra}


def test_api_sweep_with_a_team_she_is_not_in(user, bobs, mine, digits_dataset, cnn_model, local_backend,
                                             django_capture_on_commit_callbacks):
    body = _sweep_body(digits_dataset, cnn_model, local_backend, team=bobs.team.pk)
    with django_capture_on_commit_callbacks() as sent:
        response = _api(user).post("/api/sweeps/", body, format="json")
    assert response.status_code == 400
    assert response.json() == {"team": [NOT_YOUR_TEAM]}
    assert _rows() == OWN and sent == []
    with django_capture_on_commit_callbacks() as sent:
        ok = _api(user).post("/api/sweeps/", {**body, "team": mine.pk}, format="json")
    assert ok.status_code == 201, ok.json()
    assert Sweep.objects.get().team_id == mine.pk and len(sent) == 1  # its first fill, on commit


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared-with-bobs-team"])
@pytest.mark.parametrize("field, label", [("dataset", "datasets"), ("model_spec", "models"),
                                          ("backend", "backends")])
def test_api_sweep_whose_base_names_a_strangers_object(user, bobs, digits_dataset, cnn_model, local_backend,
                                                       django_capture_on_commit_callbacks, field, label, shared):
    theirs = getattr(bobs, field)
    if shared:  # shared with a team, but not one of hers
        _share_with_team(theirs, bobs.team)
    own = {"dataset": digits_dataset, "model_spec": cnn_model, "backend": local_backend}
    body = _sweep_body(**{**own, field: theirs})
    with django_capture_on_commit_callbacks() as sent:
        response = _api(user).post("/api/sweeps/", body, format="json")
    assert response.status_code == 400
    assert response.json() == {"base": [f"Choose one of your {label}; this one does not exist or is not yours."]}
    assert _rows() == OWN and sent == []
    assert _api(user).post("/api/sweeps/", _sweep_body(**own), format="json").status_code == 201


# --- sweeps: the form ----------------------------------------------------------------------------


def _sweep_form(dataset, model_spec, backend, **extra) -> dict[str, str]:
    return {"name": "lr-search", "dataset": str(dataset.pk), "model_spec": str(model_spec.pk),
            "backend": str(backend.pk), "nodes": "1", "procs_per_node": "1", "epochs": "1", "batch_size": "32",
            "lr": "0.05", "max_runtime_s": "3600", "hyperparameters": "", "search_space": '{"train.lr": '
            '{"type": "categorical", "choices": [0.1, 0.05]}}', "sampler": "grid", "seed": "0",
            "objective_metric": "val_accuracy", "direction": "maximize", "objective": "final", "max_trials": "2",
            "max_concurrent_trials": "2", "budget_usd": "", "pruner": "none", "pruner_startup_trials": "1",
            "pruner_warmup_epochs": "0", **extra}


@pytest.mark.parametrize("field, shared", [
    ("dataset", False), ("dataset", True), ("model_spec", False), ("model_spec", True), ("backend", False),
    ("backend", True), ("team", False),
])
def test_form_sweep_with_a_strangers_object_or_team(user, bobs, mine, digits_dataset, cnn_model, local_backend,
                                                    django_capture_on_commit_callbacks, field, shared):
    theirs = getattr(bobs, field)
    if shared:
        _share_with_team(theirs, bobs.team)
    own = {"dataset": digits_dataset, "model_spec": cnn_model, "backend": local_backend}
    data = _sweep_form(**own) | {field: str(theirs.pk)}
    with django_capture_on_commit_callbacks() as sent:
        response = _page(user).post("/sweeps/new/", data)
    assert response.status_code == 200  # the form again
    assert response.context["form"].errors == {field: [NOT_A_CHOICE]}
    page = response.content.decode()
    assert html.escape(NOT_A_CHOICE) in page
    assert theirs.name not in page  # not even offered
    assert _rows() == OWN and sent == []
    ok = _page(user).post("/sweeps/new/", _sweep_form(**own, team=str(mine.pk)))
    assert ok.status_code == 302, ok.context["form"].errors
    assert Sweep.objects.get().team_id == mine.pk
