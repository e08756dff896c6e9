"""Issue 6's settings in the UI, the API and the admin.

* Datasets and models shared with a team (form, API, services): a teammate sees them and launches with
  them; a team the owner is not in is refused with a message naming the field, and nothing is saved.
* A backend's stalled-job deadlines (one seconds input per non-terminal state, the default as
  placeholder), stall policy and orphan policy: saved from the form, the API and the admin; the
  service's message lands next to the deadline it is about.
* The job form's team: the job runs for it, and the team's monthly budget refusal shows its figures.
* The job API shows ``team`` and ``budget_exceeded_at``.
"""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from jobs import services
from jobs.models import ComputeBackend, Dataset, ModelSpec, Team, TrainingJob

pytestmark = pytest.mark.django_db

REFUSED = "Choose one of your teams; this one does not exist or you are not a member."


@pytest.fixture
def vision(user, other_user):
    """alice and bob's team."""
    team = Team.objects.create(name="vision", monthly_budget_usd=Decimal("0.50"))
    team.members.add(user, other_user)
    return team


@pytest.fixture
def audio(django_user_model):
    """A team of carol's that alice is not in."""
    carol = django_user_model.objects.create_user(username="carol", password="pw-carol-123")
    team = Team.objects.create(name="audio")
    team.members.add(carol)
    return team


def field_block(html: str, name: str) -> str:
    """The rendered ``webapp/_field.html`` block of field ``name`` (label, input, help, errors)."""
    match = re.search(rf'<div class="field[^"]*" id="field-{name}">(.*?)</div>', html, re.S)
    assert match, f"no field {name} on the page"
    return match.group(1)


def job_post(dataset, model, backend, **extra) -> dict:
    data = {"name": "", "dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "strategy": "ddp",
            "nodes": 1, "procs_per_node": 1, "epochs": 1, "batch_size": 32, "lr": 0.05, "seed": 0,
            "max_runtime_s": 1000, "budget_usd": "", "instance_type": "", "hyperparameters": ""}
    data.update(extra)
    return data


# --- datasets and models shared with a team -----------------------------------------------------


def test_dataset_and_model_forms_share_with_a_team_and_a_teammate_launches(client, user, other_user, vision,
                                                                          audio):
    client.force_login(user)
    page = client.get(reverse("dataset-create")).content.decode()
    team_select = field_block(page, "team")
    assert f'<option value="{vision.pk}">vision</option>' in team_select
    assert "audio" not in team_select  # only alice's teams are offered

    r = client.post(reverse("dataset-create"), {"name": "shared-digits", "format": "builtin",
                                                "builtin_name": "digits", "label_column": "label",
                                                "team": vision.pk})
    assert r.status_code == 302
    r = client.post(reverse("model-create"), {"name": "shared-cnn", "architecture": "cnn", "params": "{}",
                                              "team": vision.pk})
    assert r.status_code == 302
    dataset, model = Dataset.objects.get(name="shared-digits"), ModelSpec.objects.get(name="shared-cnn")
    assert (dataset.owner, dataset.team, model.owner, model.team) == (user, vision, user, vision)

    # bob, alice's teammate, sees both in his lists and launches on his own backend with them.
    client.force_login(other_user)
    assert "shared-digits" in client.get(reverse("dataset-list")).content.decode()
    assert "shared-cnn" in client.get(reverse("model-list")).content.decode()
    bobs_box = services.backend_create(owner=other_user, name="bobs-box", kind="gpubox",
                                       config={"max_procs_per_node": 1, "hourly_rate_usd": 0})
    r = client.post(reverse("job-create"), job_post(dataset, model, bobs_box))
    assert r.status_code == 302
    job = TrainingJob.objects.get()
    assert (job.owner, job.dataset, job.model_spec, job.backend) == (other_user, dataset, model, bobs_box)


def test_edit_forms_keep_and_change_the_team(client, user, vision):
    dataset = services.dataset_create(owner=user, name="d", format="builtin", builtin_name="digits", team=vision)
    model = services.model_spec_create(owner=user, name="m", architecture="mlp", team=vision.pk)
    client.force_login(user)

    page = client.get(reverse("dataset-edit", args=[dataset.pk])).content.decode()
    assert f'<option value="{vision.pk}" selected>vision</option>' in field_block(page, "team")
    page = client.get(reverse("model-edit", args=[model.pk])).content.decode()
    assert f'<option value="{vision.pk}" selected>vision</option>' in field_block(page, "team")

    r = client.post(reverse("dataset-edit", args=[dataset.pk]), {"name": "d", "format": "builtin",
                                                                 "builtin_name": "digits", "label_column": "label",
                                                                 "team": ""})
    assert r.status_code == 302
    dataset.refresh_from_db()
    assert dataset.team is None
    r = client.post(reverse("model-edit", args=[model.pk]), {"name": "m", "architecture": "mlp", "params": "{}",
                                                             "team": ""})
    assert r.status_code == 302
    model.refresh_from_db()
    assert model.team is None


def test_a_team_the_owner_is_not_in_is_refused_everywhere(client, api_client, user, audio):
    # Services: clear message on "team", nothing saved.
    with pytest.raises(ValidationError) as exc:
        services.dataset_create(owner=user, name="d", format="builtin", builtin_name="digits", team=audio)
    assert exc.value.message_dict == {"team": [REFUSED]}
    with pytest.raises(ValidationError) as exc:
        services.model_spec_create(owner=user, name="m", architecture="mlp", team=audio.pk)
    assert exc.value.message_dict == {"team": [REFUSED]}
    with pytest.raises(ValidationError) as exc:
        services.model_spec_create(owner=user, name="m", architecture="mlp", team="not-a-pk")
    assert exc.value.message_dict == {"team": [REFUSED]}
    assert not Dataset.objects.exists() and not ModelSpec.objects.exists()

    # Updates: refused, the row keeps its team.
    dataset = services.dataset_create(owner=user, name="d", format="builtin", builtin_name="digits")
    with pytest.raises(ValidationError) as exc:
        services.dataset_update(dataset=dataset, team=audio, description="moved")
    assert exc.value.message_dict == {"team": [REFUSED]}
    dataset.refresh_from_db()
    assert (dataset.team, dataset.description) == (None, "")
    model = services.model_spec_create(owner=user, name="m", architecture="mlp")
    ModelSpec.objects.filter(pk=model.pk).update(team=audio)  # e.g. alice left the team since
    model.refresh_from_db()
    with pytest.raises(ValidationError) as exc:
        services.model_spec_update(model_spec=model, description="x")
    assert exc.value.message_dict == {"team": ["Choose one of your teams; you are not a member of this one."]}

    # The form: the choice is not offered; the message is on the field and nothing is created.
    client.force_login(user)
    r = client.post(reverse("dataset-create"), {"name": "d2", "format": "builtin", "builtin_name": "digits",
                                                "label_column": "label", "team": audio.pk})
    assert r.status_code == 200
    assert "Select a valid choice" in field_block(r.content.decode(), "team")
    assert not Dataset.objects.filter(name="d2").exists()

    # The API: 400 on "team", nothing created.
    r = api_client.post("/api/datasets/", {"name": "d3", "format": "builtin", "builtin_name": "digits",
                                           "team": audio.pk}, format="json")
    assert r.status_code == 400
    assert r.json() == {"team": [f"Choose one of your teams; team {audio.pk} does not exist or you are not a "
                                 f"member."]}
    r = api_client.post("/api/models/", {"name": "m3", "architecture": "mlp", "team": audio.pk}, format="json")
    assert r.status_code == 400 and list(r.json()) == ["team"]
    assert not Dataset.objects.filter(name="d3").exists() and not ModelSpec.objects.filter(name="m3").exists()


def test_api_shares_datasets_and_models_and_a_teammate_uses_them(api_client, other_api_client, user, other_user,
                                                                 vision):
    r = api_client.post("/api/datasets/", {"name": "d", "format": "builtin", "builtin_name": "digits",
                                           "team": vision.pk}, format="json")
    assert r.status_code == 201 and r.json()["team"] == vision.pk
    dataset_id = r.json()["id"]
    r = api_client.post("/api/models/", {"name": "m", "architecture": "mlp", "team": vision.pk}, format="json")
    assert r.status_code == 201 and r.json()["team"] == vision.pk
    model_id = r.json()["id"]

    assert [d["id"] for d in other_api_client.get("/api/datasets/").json()["results"]] == [dataset_id]
    bobs_box = services.backend_create(owner=other_user, name="bobs-box", kind="gpubox",
                                       config={"max_procs_per_node": 1, "hourly_rate_usd": 0})
    r = other_api_client.post("/api/jobs/", {"dataset": dataset_id, "model_spec": model_id, "backend": bobs_box.pk,
                                             "epochs": 1}, format="json")
    assert r.status_code == 201, r.json()
    assert (r.json()["dataset"], r.json()["model_spec"]) == (dataset_id, model_id)

    # PATCH team null makes it private again: bob no longer sees it.
    r = api_client.patch(f"/api/datasets/{dataset_id}/", {"team": None}, format="json")
    assert r.status_code == 200 and r.json()["team"] is None
    assert other_api_client.get("/api/datasets/").json()["results"] == []


# --- backend: deadlines, stall and orphan policy ------------------------------------------------


def gpubox_post(**extra) -> dict:
    data = {"name": "box", "kind": "gpubox", "max_procs_per_node": 2, "hourly_rate_usd": "0", "extra_config": "",
            "enabled": "on"}
    data.update(extra)
    return data


def test_backend_form_shows_one_deadline_per_state_with_the_default(client, user, settings):
    settings.TRAINBOARD_STATE_DEADLINES_S = {"QUEUED": 600, "SUBMITTING": 300, "PENDING": 3600, "STOPPING": 900}
    settings.TRAINBOARD_RUNNING_DEADLINE_MARGIN_S = 600.0
    client.force_login(user)
    page = client.get(reverse("backend-create")).content.decode()

    expected = {"QUEUED": "600 s", "SUBMITTING": "300 s", "PENDING": "3600 s", "RUNNING": "max runtime + 600 s",
                "STOPPING": "900 s"}
    for state, default in expected.items():
        block = field_block(page, f"deadline_{state}")
        assert 'type="number"' in block and f'placeholder="default: {default}"' in block, block
    assert not re.search(r'id="field-deadline_(SUCCEEDED|FAILED|CANCELLED)"', page)
    assert '<option value="warn" selected>' in field_block(page, "stall_policy")
    assert '<option value="report" selected>' in field_block(page, "orphan_policy")


def test_backend_form_saves_deadlines_and_policies_and_edits_them(client, user):
    client.force_login(user)
    r = client.post(reverse("backend-create"), gpubox_post(deadline_PENDING="120", deadline_RUNNING="7200.5",
                                                           deadline_QUEUED="", stall_policy="cancel",
                                                           orphan_policy="stop"))
    assert r.status_code == 302
    backend = ComputeBackend.objects.get(name="box")
    assert backend.state_deadlines == {"PENDING": 120, "RUNNING": 7200.5}
    assert (backend.stall_policy, backend.orphan_policy) == ("cancel", "stop")

    page = client.get(reverse("backend-edit", args=[backend.pk])).content.decode()
    assert 'value="120"' in field_block(page, "deadline_PENDING")
    assert '<option value="cancel" selected>' in field_block(page, "stall_policy")
    assert '<option value="stop" selected>' in field_block(page, "orphan_policy")

    # Blank again = back to the defaults; the policies change.
    r = client.post(reverse("backend-edit", args=[backend.pk]),
                    gpubox_post(deadline_PENDING="", deadline_RUNNING="", stall_policy="warn", orphan_policy="report"))
    assert r.status_code == 302
    backend.refresh_from_db()
    assert (backend.state_deadlines, backend.stall_policy, backend.orphan_policy) == ({}, "warn", "report")


def test_backend_form_puts_the_services_deadline_error_on_that_state(client, user):
    client.force_login(user)
    r = client.post(reverse("backend-create"), gpubox_post(deadline_PENDING="-5", stall_policy="warn",
                                                           orphan_policy="report"))
    assert r.status_code == 200
    page = r.content.decode()
    assert ("PENDING: the deadline must be a positive number of seconds (got -5.0)."
            in field_block(page, "deadline_PENDING"))
    assert "has-error" not in re.search(r'<div class="field[^"]*" id="field-deadline_QUEUED">', page).group(0)
    assert not ComputeBackend.objects.exists()

    # A policy that is not a choice: the form's message on that field, nothing created.
    r = client.post(reverse("backend-create"), gpubox_post(stall_policy="sometimes"))
    assert "Select a valid choice" in field_block(r.content.decode(), "stall_policy")
    assert not ComputeBackend.objects.exists()


def test_backend_api_takes_and_returns_deadlines_and_policies(api_client, user):
    r = api_client.post("/api/backends/", {"name": "box", "kind": "gpubox", "config": {"max_procs_per_node": 1},
                                           "state_deadlines": {"pending": 90, "QUEUED": 30.5},
                                           "stall_policy": "cancel", "orphan_policy": "stop"}, format="json")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert (body["state_deadlines"], body["stall_policy"], body["orphan_policy"]) == (
        {"PENDING": 90, "QUEUED": 30.5}, "cancel", "stop")
    backend = ComputeBackend.objects.get(pk=body["id"])
    assert (backend.state_deadlines, backend.stall_policy, backend.orphan_policy) == (
        {"PENDING": 90, "QUEUED": 30.5}, "cancel", "stop")

    r = api_client.patch(f"/api/backends/{backend.pk}/", {"state_deadlines": {"DONE": 5}}, format="json")
    assert r.status_code == 400
    assert r.json() == {"state_deadlines": [
        "DONE: not a state with a deadline; use one of QUEUED, SUBMITTING, PENDING, RUNNING, STOPPING "
        "(terminal states have none)."]}
    r = api_client.patch(f"/api/backends/{backend.pk}/", {"orphan_policy": "sometimes"}, format="json")
    assert r.status_code == 400 and list(r.json()) == ["orphan_policy"]
    backend.refresh_from_db()
    assert (backend.state_deadlines, backend.orphan_policy) == ({"PENDING": 90, "QUEUED": 30.5}, "stop")

    r = api_client.patch(f"/api/backends/{backend.pk}/", {"state_deadlines": {}, "orphan_policy": "report"},
                         format="json")
    assert r.status_code == 200
    backend.refresh_from_db()
    assert (backend.state_deadlines, backend.orphan_policy, backend.stall_policy) == ({}, "report", "cancel")

    # Defaults when left out.
    r = api_client.post("/api/backends/", {"name": "box2", "kind": "gpubox"}, format="json")
    assert r.status_code == 201
    assert (r.json()["state_deadlines"], r.json()["stall_policy"], r.json()["orphan_policy"]) == (
        {}, "warn", "report")


def test_services_refuse_a_bad_orphan_policy_and_keep_the_row(local_backend):
    with pytest.raises(ValidationError) as exc:
        services.backend_update(backend=local_backend, orphan_policy="sometimes", stall_policy="cancel")
    assert list(exc.value.message_dict) == ["orphan_policy"]
    local_backend.refresh_from_db()
    assert (local_backend.orphan_policy, local_backend.stall_policy) == ("report", "warn")
    services.backend_update(backend=local_backend, orphan_policy="stop")
    local_backend.refresh_from_db()
    assert local_backend.orphan_policy == "stop"


def test_admin_backend_form_takes_deadlines_and_policies(client, user):
    client.force_login(user)
    page = client.get(reverse("admin:jobs_computebackend_add")).content.decode()
    assert 'name="state_deadlines"' in page and 'name="stall_policy"' in page and 'name="orphan_policy"' in page

    r = client.post(reverse("admin:jobs_computebackend_add"),
                    {"name": "box", "kind": "gpubox", "config": '{"max_procs_per_node": 1}', "enabled": "on",
                     "state_deadlines": '{"PENDING": -1}', "stall_policy": "cancel", "orphan_policy": "stop"})
    assert r.status_code == 200
    assert "PENDING: the deadline must be a positive number of seconds (got -1)." in r.content.decode()
    assert not ComputeBackend.objects.exists()

    r = client.post(reverse("admin:jobs_computebackend_add"),
                    {"name": "box", "kind": "gpubox", "config": '{"max_procs_per_node": 1}', "enabled": "on",
                     "state_deadlines": '{"PENDING": 45}', "stall_policy": "cancel", "orphan_policy": "stop"})
    assert r.status_code == 302
    backend = ComputeBackend.objects.get(name="box")
    assert (backend.owner, backend.state_deadlines, backend.stall_policy, backend.orphan_policy) == (
        user, {"PENDING": 45}, "cancel", "stop")

    r = client.post(reverse("admin:jobs_computebackend_change", args=[backend.pk]),
                    {"name": "box", "kind": "gpubox", "config": '{"max_procs_per_node": 1}', "enabled": "on",
                     "state_deadlines": "", "stall_policy": "warn", "orphan_policy": "report"})
    assert r.status_code == 302
    backend.refresh_from_db()
    assert (backend.state_deadlines, backend.stall_policy, backend.orphan_policy) == ({}, "warn", "report")


def test_admin_dataset_form_takes_a_team_and_refuses_a_strangers(client, user, vision, audio):
    client.force_login(user)
    data = {"name": "d", "format": "builtin", "builtin_name": "digits", "label_column": "label"}
    r = client.post(reverse("admin:jobs_dataset_add"), {**data, "team": audio.pk})
    assert r.status_code == 200 and REFUSED in r.content.decode()
    assert not Dataset.objects.exists()
    r = client.post(reverse("admin:jobs_dataset_add"), {**data, "team": vision.pk})
    assert r.status_code == 302 and Dataset.objects.get().team == vision


# --- the job form's team, the job API --------------------------------------------------------


def test_job_form_runs_the_job_for_a_team(client, user, vision, audio, digits_dataset, cnn_model, local_backend):
    client.force_login(user)
    page = client.get(reverse("job-create")).content.decode()
    assert f'<option value="{vision.pk}">vision</option>' in field_block(page, "team")

    r = client.post(reverse("job-create"), job_post(digits_dataset, cnn_model, local_backend, team=audio.pk,
                                                    max_runtime_s=100))
    assert r.status_code == 200 and "Select a valid choice" in field_block(r.content.decode(), "team")
    assert not TrainingJob.objects.exists()

    r = client.post(reverse("job-create"), job_post(digits_dataset, cnn_model, local_backend, team=vision.pk,
                                                    max_runtime_s=100))
    assert r.status_code == 302
    assert TrainingJob.objects.get().team == vision
    r = client.post(reverse("job-create"), job_post(digits_dataset, cnn_model, local_backend, max_runtime_s=100))
    assert r.status_code == 302
    assert TrainingJob.objects.latest("pk").team is None


def test_job_form_shows_the_team_budget_refusal_with_the_figures(client, user, vision, digits_dataset, cnn_model,
                                                                 local_backend):
    # local_backend: $3.60 per node-hour, so 1000 s on one node is a $1.00 estimate; vision's budget is $0.50.
    client.force_login(user)
    r = client.post(reverse("job-create"), job_post(digits_dataset, cnn_model, local_backend, team=vision.pk))
    assert r.status_code == 200
    assert ("Monthly budget of $0.50 for team vision would be exceeded: $0.00 spent or committed this month + "
            "$1.00 estimate for this job.") in r.content.decode()
    assert not TrainingJob.objects.exists()
    # Without the team the job is not the team's: it passes (alice has no budget of her own).
    r = client.post(reverse("job-create"), job_post(digits_dataset, cnn_model, local_backend))
    assert r.status_code == 302


def test_job_api_shows_team_and_budget_exceeded_at(api_client, user, vision, digits_dataset, cnn_model,
                                                   local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, max_runtime_s=100, team=vision)
    body = api_client.get(f"/api/jobs/{job.pk}/").json()
    assert (body["team"], body["budget_exceeded_at"]) == (vision.pk, None)

    when = timezone.now().replace(microsecond=0) - dt.timedelta(minutes=5)
    TrainingJob.objects.filter(pk=job.pk).update(budget_exceeded_at=when)
    row = next(j for j in api_client.get("/api/jobs/").json()["results"] if j["id"] == job.pk)
    assert row["team"] == vision.pk
    assert dt.datetime.fromisoformat(row["budget_exceeded_at"].replace("Z", "+00:00")) == when
    # Read-only: the job endpoint takes no PATCH.
    r = api_client.patch(f"/api/jobs/{job.pk}/", {"budget_exceeded_at": None}, format="json")
    assert r.status_code == 405
    job.refresh_from_db()
    assert job.budget_exceeded_at == when
