"""The job form's instance type select (catalog prices, confirmed or not) and spot checkbox for a
cloud backend, the estimate from the adapter's price, and the gpubox form left as it was; the job
page and the API showing a spot job's saving and on-demand equivalent."""

from __future__ import annotations

import datetime as dt
import json
import re
from decimal import Decimal

import pytest
from django.urls import reverse

from cloud_adapters.gpubox import GpuBoxBackend
from jobs import services
from jobs.models import InstancePrice, TrainingJob

pytestmark = pytest.mark.django_db

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"


@pytest.fixture
def sagemaker_backend(user):
    return services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": ROLE, "bucket": "tb-test-bucket", "spot_allowed": True})


def form_data(dataset, model, backend, **overrides):
    data = {"name": "", "dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "strategy": "ddp",
            "nodes": 2, "procs_per_node": 1, "epochs": 3, "batch_size": 32, "lr": 0.05, "seed": 0,
            "max_runtime_s": 3600, "budget_usd": "", "instance_type": "", "hyperparameters": ""}
    data.update(overrides)
    return data


def options(html: str) -> dict[str, list[tuple[str, str]]]:
    """``{optgroup label: [(value, text), ...]}`` of the instance type select ("" for ungrouped)."""
    select = re.search(r'<select name="instance_type".*?</select>', html, re.S).group(0)
    found: dict[str, list[tuple[str, str]]] = {}
    group = ""
    for tag, attr, text in re.findall(r'<(optgroup|option)([^>]*)>([^<]*)', select):
        if tag == "optgroup":
            group = re.search(r'label="([^"]*)"', attr).group(1)
            continue
        value = re.search(r'value="([^"]*)"', attr).group(1)
        found.setdefault(group, []).append((value, text))
    return found


def test_gpubox_only_form_is_as_before(owner_client, local_backend):
    page = owner_client.get(reverse("job-create")).content.decode()
    assert ('<input type="text" name="instance_type" maxlength="100" aria-describedby="id_instance_type_helptext" '
            'id="id_instance_type">') in page
    assert 'name="spot"' not in page  # the gpubox has no spot capacity
    assert json.loads(re.search(r'<script id="backend-offers" type="application/json">(.*?)</script>', page).group(1)) == {
        str(local_backend.pk): {"name": "local", "offers": False, "spot": False, "strategies": ["ddp", "fsdp", "pipeline"],
                                   "max_nodes": 1, "nodes_note": GpuBoxBackend.max_nodes_note}}


def test_cloud_backend_lists_instance_types_with_prices(owner_client, local_backend, sagemaker_backend):
    InstancePrice.objects.create(provider="aws", region="us-east-1", instance_type="ml.p3.2xlarge",
                                 usd_per_hour=Decimal("3.06"), source="AWS Price List API",
                                 as_of=dt.date(2026, 11, 29), confirmed=True)
    page = owner_client.get(reverse("job-create")).content.decode()
    assert options(page) == {
        "": [("", "Backend default")],
        "sm": [
            ("ml.g5.12xlarge", "ml.g5.12xlarge — $7.09/h (unconfirmed)"),
            ("ml.g5.xlarge", "ml.g5.xlarge — $1.4084/h (unconfirmed)"),
            ("ml.m5.xlarge", "ml.m5.xlarge — $0.23/h (unconfirmed)"),
            ("ml.p3.2xlarge", "ml.p3.2xlarge — $3.06/h"),  # the admin's confirmed row wins
            ("ml.p4d.24xlarge", "ml.p4d.24xlarge — $37.688/h (unconfirmed)"),
        ],
    }
    assert '<input type="checkbox" name="spot" aria-describedby="id_spot_helptext" id="id_spot">' in page
    data = json.loads(re.search(r'<script id="backend-offers" type="application/json">(.*?)</script>', page).group(1))
    assert data == {str(local_backend.pk): {"name": "local", "offers": False, "spot": False, "strategies": ["ddp", "fsdp", "pipeline"],
                                   "max_nodes": 1, "nodes_note": GpuBoxBackend.max_nodes_note},
                    str(sagemaker_backend.pk): {"name": "sm", "offers": True, "spot": True, "strategies": ["ddp", "fsdp", "pipeline"],
                                        "max_nodes": 8, "nodes_note": ""}}
    assert "job_form.js" in page


def test_estimate_is_runtime_times_instances_times_the_catalog_price(owner_client, sagemaker_backend):
    response = owner_client.post(reverse("job-estimate"), {
        "backend": sagemaker_backend.pk, "nodes": 2, "procs_per_node": 1, "max_runtime_s": 7200,
        "instance_type": "ml.g5.12xlarge", "spot": "on"})
    estimate = response.context["estimate"]
    assert estimate["ok"], estimate
    assert (estimate["hourly_price_usd"], estimate["estimated_cost_usd"]) == (Decimal("7.090000"), Decimal("28.3600"))
    assert "$28.36 max (7200 s × 2 nodes × $7.09/h)" in response.content.decode()
    # "Backend default": the backend's default instance type (ml.g5.xlarge): 1 h × 2 × $1.4084.
    default = owner_client.post(reverse("job-estimate"), {
        "backend": sagemaker_backend.pk, "nodes": 2, "procs_per_node": 1, "max_runtime_s": 3600, "instance_type": ""})
    assert default.context["estimate"]["estimated_cost_usd"] == Decimal("2.8168")


def test_the_estimate_headline_reads_at_the_precision_of_its_arithmetic(owner_client, local_backend):
    # A sub-cent budget: the headline, the sum and the budget all at 4 decimals (not "$0.003 max (… $0.0030 budget)").
    response = owner_client.post(reverse("job-estimate"), {
        "backend": local_backend.pk, "nodes": 1, "procs_per_node": 2, "max_runtime_s": 3600, "budget_usd": "0.003"})
    assert response.context["estimate"]["ok"], response.context["estimate"]
    page = response.content.decode()
    assert ('<span class="estimate-figure" id="estimate-figure">$0.0030 max (3600 s × 1 node × $3.60/h = $3.6000, '
            'capped at the $0.0030 budget)</span>') in page
    assert "1 node × 2 processes = 2 ranks; at most 3600 s" in page


def test_launch_on_an_offered_type_with_spot(owner_client, digits_dataset, cnn_model, sagemaker_backend):
    response = owner_client.post(reverse("job-create"), form_data(
        digits_dataset, cnn_model, sagemaker_backend, instance_type="ml.g5.xlarge", spot="on", max_runtime_s=7200))
    assert response.status_code == 302, response.context["form"].errors
    job = TrainingJob.objects.get()
    assert (job.instance_type, job.spot, job.nodes) == ("ml.g5.xlarge", True, 2)
    assert job.hourly_price_usd == Decimal("1.408400")
    assert job.estimated_cost_usd == Decimal("5.6336")  # 2 h × 2 instances × $1.4084


@pytest.mark.parametrize("backend_name, overrides, field, message", [
    ("local", {"instance_type": "ml.g5.xlarge", "procs_per_node": 2, "nodes": 1}, "instance_type",
     "Backend local has no choice of instance type; choose “Backend default”."),
    ("sm", {"instance_type": "ml.zzz.huge"}, "instance_type",
     "Select a valid choice. ml.zzz.huge is not one of the available choices."),
    ("local", {"spot": "on", "procs_per_node": 2, "nodes": 1}, "spot", "This backend has no spot capacity; untick spot."),
])
def test_a_type_or_spot_the_backend_does_not_offer_is_refused(owner_client, digits_dataset, cnn_model, local_backend,
                                                               sagemaker_backend, backend_name, overrides, field,
                                                               message):
    backend = {"local": local_backend, "sm": sagemaker_backend}[backend_name]
    response = owner_client.post(reverse("job-create"), form_data(digits_dataset, cnn_model, backend, **overrides))
    assert response.status_code == 200
    assert response.context["form"].errors[field] == [message]
    assert not TrainingJob.objects.exists()


def test_another_sagemaker_backends_type_is_refused(owner_client, user, digits_dataset, cnn_model, sagemaker_backend):
    InstancePrice.objects.create(provider="aws", region="eu-west-1", instance_type="ml.g6.xlarge",
                                 usd_per_hour=Decimal("0.99"))
    services.backend_create(owner=user, name="dublin", kind="sagemaker", config={
        "region": "eu-west-1", "role_arn": ROLE, "bucket": "tb-test-bucket", "instance_type": "ml.g6.xlarge"})
    page = owner_client.get(reverse("job-create")).content.decode()
    assert options(page)["dublin"] == [("ml.g6.xlarge", "ml.g6.xlarge — $0.99/h (unconfirmed)")]
    response = owner_client.post(reverse("job-create"), form_data(
        digits_dataset, cnn_model, sagemaker_backend, instance_type="ml.g6.xlarge"))
    assert response.context["form"].errors["instance_type"] == [
        "Backend sm does not offer ml.g6.xlarge; choose one of ml.g5.12xlarge, ml.g5.xlarge, ml.m5.xlarge, "
        "ml.p3.2xlarge, ml.p4d.24xlarge."]


# --- job page and API: spot saving -----------------------------------------------------------


@pytest.fixture
def spot_job(user, digits_dataset, cnn_model, sagemaker_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=sagemaker_backend, nodes=2, procs_per_node=1,
                                       instance_type="ml.g5.xlarge", spot=True, name="spot-run")
    from jobs.cost import job_cost_usd

    # As the sync leaves it after SageMaker reported Completed: 1,200 s trained, 840 s billed.
    TrainingJob.objects.filter(pk=job.pk).update(
        state="SUCCEEDED", billable_seconds=840.0, training_seconds=1200.0, instance_count=2,
        cost_usd=job_cost_usd(billable_seconds=840, instances=2, hourly_price_usd=job.hourly_price_usd))
    job.refresh_from_db()
    return job


def test_job_page_shows_the_spot_saving_and_on_demand_cost(owner_client, spot_job):
    assert spot_job.cost_usd == Decimal("0.6573")  # 840 s × 2 × $1.4084 / 3600
    html = owner_client.get(reverse("job-detail", args=[spot_job.pk])).content.decode()
    assert '<span class="stat-value" id="stat-spot-saving">30%</span>' in html  # 1 − 840 / 1200
    # At the job's one precision (4 decimals, as its cost beside it), not rounded to cents.
    assert re.search(r'id="stat-on-demand">on demand \$0\.9389 · 1200 s trained, 840 s billed</span>', html)
    assert '<span class="stat-value" id="stat-cost">$0.6573</span>' in html
    live = owner_client.get(reverse("job-live", args=[spot_job.pk])).content.decode()
    assert 'id="stat-spot-saving">30%</span>' in live


def test_spot_job_before_the_training_time_is_known(owner_client, spot_job):
    TrainingJob.objects.filter(pk=spot_job.pk).update(state="RUNNING", training_seconds=None)
    html = owner_client.get(reverse("job-detail", args=[spot_job.pk])).content.decode()
    assert 'id="stat-spot-saving">—</span>' in html
    assert "shown once the provider reports the training time" in html


def test_on_demand_job_page_has_no_spot_stat(owner_client, seeded_job):
    html = owner_client.get(reverse("job-detail", args=[seeded_job.pk])).content.decode()
    assert "stat-spot" not in html


def test_api_serializes_training_seconds_saving_and_on_demand_cost(api_client, spot_job, seeded_job):
    body = api_client.get(f"/api/jobs/{spot_job.pk}/").json()
    assert (body["training_seconds"], body["billable_seconds"]) == (1200.0, 840.0)
    assert body["spot_saving"] == pytest.approx(0.3)
    assert (body["on_demand_cost_usd"], body["cost_usd"]) == ("0.9389", "0.6573")  # 1200 s × 2 × $1.4084 / 3600
    listed = {j["id"]: j for j in api_client.get("/api/jobs/").json()["results"]}
    assert listed[spot_job.pk]["spot_saving"] == pytest.approx(0.3)
    assert (listed[seeded_job.pk]["spot_saving"], listed[seeded_job.pk]["on_demand_cost_usd"],
            listed[seeded_job.pk]["training_seconds"]) == (None, None, None)
