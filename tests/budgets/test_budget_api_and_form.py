"""The budget refusal through the REST API and the browser form: a 400 / the form again with the
figures, and no job; POST /api/jobs/ with ``team`` runs the job for that team (a team the user is not a
member of is a 400 on ``team``)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from jobs.models import Team, TrainingJob, UserBudget

pytestmark = pytest.mark.django_db


def payload(dataset, model, backend, **extra):
    data = {"dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "nodes": 1, "procs_per_node": 1,
            "epochs": 1, "max_runtime_s": 1000}
    data.update(extra)
    return data


@pytest.fixture
def api(user):
    client = APIClient()
    client.force_authenticate(user)
    return client


def test_api_refuses_past_the_monthly_budget_with_the_figures(api, user, digits_dataset, cnn_model, local_backend,
                                                             sent):
    UserBudget.objects.create(user=user, monthly_budget_usd=Decimal("1.50"))
    first = api.post("/api/jobs/", payload(digits_dataset, cnn_model, local_backend), format="json")
    assert first.status_code == 201, first.json()

    second = api.post("/api/jobs/", payload(digits_dataset, cnn_model, local_backend), format="json")

    assert second.status_code == 400
    assert ("Monthly budget of $1.50 for alice would be exceeded: $1.00 spent or committed this month + $1.00 "
            "estimate for this job.") in str(second.json())
    assert TrainingJob.objects.count() == 1


def test_api_team_argument(api, user, other_user, digits_dataset, cnn_model, local_backend, sent):
    team = Team.objects.create(name="vision", monthly_budget_usd=Decimal("5.00"))
    team.members.add(user)
    foreign = Team.objects.create(name="audio")
    foreign.members.add(other_user)

    made = api.post("/api/jobs/", payload(digits_dataset, cnn_model, local_backend, team=team.pk), format="json")
    refused = api.post("/api/jobs/", payload(digits_dataset, cnn_model, local_backend, team=foreign.pk),
                       format="json")

    assert made.status_code == 201, made.json()
    assert TrainingJob.objects.get().team == team
    assert refused.status_code == 400 and "team" in refused.json()
    assert TrainingJob.objects.count() == 1


def test_form_shows_the_refusal(client, user, digits_dataset, cnn_model, local_backend, sent):
    UserBudget.objects.create(user=user, monthly_budget_usd=Decimal("0.50"))
    client.force_login(user)
    form = {"name": "", "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
            "strategy": "ddp", "nodes": 1, "procs_per_node": 1, "epochs": 1, "batch_size": 32, "lr": 0.05,
            "seed": 0, "max_runtime_s": 1000, "budget_usd": "", "instance_type": "", "hyperparameters": ""}

    response = client.post(reverse("job-create"), form)

    assert response.status_code == 200
    assert ("Monthly budget of $0.50 for alice would be exceeded: $0.00 spent or committed this month + $1.00 "
            "estimate for this job.") in response.content.decode()
    assert TrainingJob.objects.count() == 0


def test_a_negative_budget_is_refused_and_the_schema_says_none_is_negative(api, digits_dataset, cnn_model,
                                                                          local_backend, sent):
    import re

    import yaml

    r = api.post("/api/jobs/", payload(digits_dataset, cnn_model, local_backend, budget_usd="-1", nodes=0),
                 format="json")
    assert r.status_code == 400
    assert r.json()["budget_usd"] == ["Ensure this value is greater than or equal to 0."]
    assert "nodes" in r.json()  # with the other fields' errors
    assert TrainingJob.objects.count() == 0
    schema = yaml.safe_load(api.get("/api/schema/").content)["components"]["schemas"]
    patterns = {(name, schema[name]["properties"]["budget_usd"]["pattern"])
                for name in ("TrainingJobCreate", "TrainingJob", "TrainingJobDetail", "Sweep", "SweepDetail")}
    assert {p for _, p in patterns} == {r"^\d{0,8}(?:\.\d{0,4})?$"}, patterns
    pattern = re.compile(r"^\d{0,8}(?:\.\d{0,4})?$")
    assert pattern.match("12.5000") and not pattern.match("-1")
    # A decimal that may be negative keeps its minus (a cost is never negative, but says nothing here).
    assert schema["JobProgress"]["properties"]["projected_cost_usd"]["pattern"].startswith("^-?")
