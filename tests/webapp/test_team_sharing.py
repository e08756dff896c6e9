"""Datasets and models shared with a team, and jobs run for one, through the forms, the API, the
services and the admin: a teammate sees shared objects and launches with them; a team the owner is
not in is refused with a message on the team field, and nothing is saved; a job run for a team is
checked against the team's monthly budget, and the job API shows ``team`` and ``budget_exceeded_at``.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
import yaml
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from jobs import services
from jobs.models import Dataset, ModelSpec, Team, TrainingJob
from page_html import field_block

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


def test_admin_dataset_form_takes_a_team_and_refuses_a_strangers(client, user, vision, audio):
    client.force_login(user)
    data = {"name": "d", "format": "builtin", "builtin_name": "digits", "label_column": "label"}
    r = client.post(reverse("admin:jobs_dataset_add"), {**data, "team": audio.pk})
    assert r.status_code == 200 and REFUSED in r.content.decode()
    assert not Dataset.objects.exists()
    r = client.post(reverse("admin:jobs_dataset_add"), {**data, "team": vision.pk})
    assert r.status_code == 302 and Dataset.objects.get().team == vision


# --- jobs run for a team ---------------------------------------------------------------------


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
    # Read-only: a PATCH may change only tags, notes and archived (docs/experiments.md).
    r = api_client.patch(f"/api/jobs/{job.pk}/", {"budget_exceeded_at": None}, format="json")
    assert r.status_code == 400 and "budget_exceeded_at is read-only" in str(r.json())
    job.refresh_from_db()
    assert job.budget_exceeded_at == when


def test_the_api_takes_a_team_by_name_as_it_takes_the_other_rows(api_client, user, vision, audio, digits_dataset,
                                                                  cnn_model, local_backend):
    """``team`` by id or by name (team names are unique), as the job request declares it and the schema
    says (the new-user trial found it typed integer-only); a team the user is not in is refused by name
    as by id, and nothing is created."""
    r = api_client.post("/api/datasets/", {"name": "d", "format": "builtin", "builtin_name": "digits",
                                           "team": vision.name}, format="json")
    assert r.status_code == 201, r.json()
    assert r.json()["team"] == vision.pk
    r = api_client.post("/api/jobs/", {"dataset": digits_dataset.pk, "model_spec": cnn_model.pk,
                                       "backend": local_backend.pk, "epochs": 1, "max_runtime_s": 100,
                                       "team": vision.name}, format="json")
    assert r.status_code == 201, r.json()
    assert TrainingJob.objects.get(pk=r.json()["id"]).team == vision
    jobs = TrainingJob.objects.count()
    r = api_client.post("/api/jobs/", {"dataset": digits_dataset.pk, "model_spec": cnn_model.pk,
                                       "backend": local_backend.pk, "max_runtime_s": 100, "team": audio.name},
                        format="json")
    assert r.status_code == 400
    assert r.json() == {"team": [f"Choose one of your teams; no team named {audio.name!r} of which you are a member."]}
    assert TrainingJob.objects.count() == jobs
    schema = yaml.safe_load(api_client.get("/api/schema/").content)
    team = schema["components"]["schemas"]["TrainingJobCreate"]["properties"]["team"]
    assert team["oneOf"] == [{"type": "integer"}, {"type": "string"}] and team["nullable"] is True
