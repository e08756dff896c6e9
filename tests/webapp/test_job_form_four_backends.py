"""The job form offers all four backends with their instance types and prices. One user
with a gpubox, a SageMaker, a Vertex AI and two Azure ML backends (dedicated and low priority):
the job form's backend select lists all five, the instance type select one group per cloud backend
with the adapters' own prices (Vertex: machine + accelerator × count; Azure ML low priority: the
``:low_priority`` row), spot offered where the backend has it, and the estimate and the stored job
priced the same way.

The catalog under the database rows is replaced with the rows below, so the figures do not depend
on what the adapters ship. A kind not registered yet is registered here with its real class (the
adapter package is in the tree); an adapter whose package is missing skips the test, saying so."""

from __future__ import annotations

import importlib
import json
import re
from decimal import Decimal

import pytest
from django.urls import reverse

from cloud_adapters import registry
from cloud_adapters.gpubox import GpuBoxBackend
from cloud_adapters.pricing import PriceRow, StaticPriceCatalog
from jobs import pricing, services
from jobs.models import InstancePrice, TrainingJob

pytestmark = pytest.mark.django_db

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"
SUBSCRIPTION = "3f2b6c1e-8a4d-4e7b-9c0a-5d1e2f3a4b5c"
KINDS = {"vertex": ("cloud_adapters.vertex", "VertexBackend", "Google Vertex AI"),
         "azureml": ("cloud_adapters.azureml", "AzureMLBackend", "Azure ML")}


def row(provider, region, instance_type, usd, confirmed=False):
    return PriceRow(provider, region, instance_type, Decimal(usd), "test catalog", "2026-11-29", confirmed)


CATALOG = [
    row("aws", "us-east-1", "ml.g5.xlarge", "1.4084"),
    row("aws", "us-east-1", "ml.m5.xlarge", "0.23"),
    row("gcp", "us-central1", "n1-standard-4", "0.21849885"),
    row("gcp", "us-central1", "n1-standard-8", "0.437"),
    row("gcp", "us-central1", "NVIDIA_TESLA_T4", "0.4025"),
    row("gcp", "us-central1", "NVIDIA_L4", "0.644"),
    row("azure", "eastus", "Standard_NC6s_v3", "3.06"),
    row("azure", "eastus", "Standard_NC6s_v3:low_priority", "0.612"),
    row("azure", "eastus", "Standard_NC12s_v3", "6.12"),
    row("azure", "eastus", "Standard_NC4as_T4_v3", "0.526"),
    row("azure", "eastus", "Standard_NC4as_T4_v3:low_priority", "0.2104"),
]


@pytest.fixture
def catalog(monkeypatch):
    monkeypatch.setattr(pricing, "shipped_catalog", lambda: StaticPriceCatalog(CATALOG))


@pytest.fixture
def cloud_kinds(monkeypatch):
    for kind, (module, class_name, label) in KINDS.items():
        if kind in registry.KINDS:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            pytest.skip(f"the {kind} adapter is not in the tree yet ({exc})")
        monkeypatch.setitem(registry.KINDS, kind, registry.KindInfo(module, class_name, label))


@pytest.fixture
def backends(user, local_backend, catalog, cloud_kinds):
    sm = services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": ROLE, "bucket": "tb-test-bucket", "spot_allowed": True})
    vx = services.backend_create(owner=user, name="vx", kind="vertex", config={
        "project": "vision-ml-prod", "staging_bucket": "gs://tb-staging", "accelerator_type": "NVIDIA_TESLA_T4",
        "accelerator_count": 1, "spot_allowed": True})
    aml = services.backend_create(owner=user, name="aml", kind="azureml", config={
        "subscription_id": SUBSCRIPTION, "resource_group": "ml-rg", "workspace": "vision-ws",
        "compute": "gpu-cluster"})
    aml_lp = services.backend_create(owner=user, name="aml-lp", kind="azureml", config={
        "subscription_id": SUBSCRIPTION, "resource_group": "ml-rg", "workspace": "vision-ws",
        "compute": "lp-cluster", "tier": "low_priority"})
    return {"local": local_backend, "sm": sm, "vx": vx, "aml": aml, "aml-lp": aml_lp}


def options(html: str, name: str) -> dict[str, list[tuple[str, str]]]:
    """``{optgroup label: [(value, text), ...]}`` of the select ``name`` ("" for ungrouped options)."""
    select = re.search(rf'<select name="{name}".*?</select>', html, re.S).group(0)
    found: dict[str, list[tuple[str, str]]] = {}
    group = ""
    for tag, attr, text in re.findall(r'<(optgroup|option)([^>]*)>([^<]*)', select):
        if tag == "optgroup":
            group = re.search(r'label="([^"]*)"', attr).group(1)
            continue
        found.setdefault(group, []).append((re.search(r'value="([^"]*)"', attr).group(1), text))
    return found


def test_the_job_form_offers_all_four_backends_with_prices(owner_client, backends):
    InstancePrice.objects.create(provider="gcp", region="us-central1", instance_type="n1-standard-16",
                                 usd_per_hour=Decimal("0.874"), source="Cloud Billing Catalog API (Vertex AI)",
                                 confirmed=True)
    page = owner_client.get(reverse("job-create")).content.decode()

    assert [text for _, text in options(page, "backend")[""]] == ["aml", "aml-lp", "local", "sm", "vx"]
    assert options(page, "instance_type") == {
        "": [("", "Backend default")],
        "aml": [
            ("Standard_NC12s_v3", "Standard_NC12s_v3 — $6.12/h (unconfirmed)"),
            ("Standard_NC4as_T4_v3", "Standard_NC4as_T4_v3 — $0.526/h (unconfirmed)"),
            ("Standard_NC6s_v3", "Standard_NC6s_v3 — $3.06/h (unconfirmed)"),
        ],
        "aml-lp": [  # the low-priority tier: only sizes with a low-priority price, at that price
            ("Standard_NC4as_T4_v3", "Standard_NC4as_T4_v3 — $0.2104/h (unconfirmed)"),
            ("Standard_NC6s_v3", "Standard_NC6s_v3 — $0.612/h (unconfirmed)"),
        ],
        "sm": [
            ("ml.g5.xlarge", "ml.g5.xlarge — $1.4084/h (unconfirmed)"),
            ("ml.m5.xlarge", "ml.m5.xlarge — $0.23/h (unconfirmed)"),
        ],
        "vx": [  # machine types only, each with the backend's one T4 ($0.4025) added
            ("n1-standard-16", "n1-standard-16 — $1.2765/h (unconfirmed)"),  # confirmed machine, unconfirmed T4
            ("n1-standard-4", "n1-standard-4 — $0.62099885/h (unconfirmed)"),
            ("n1-standard-8", "n1-standard-8 — $0.8395/h (unconfirmed)"),
        ],
    }
    data = json.loads(re.search(r'<script id="backend-offers" type="application/json">(.*?)</script>', page).group(1))
    assert data == {
        str(backends["local"].pk): {"name": "local", "offers": False, "spot": False, "strategies": ["ddp", "fsdp", "pipeline"],
                                    "max_nodes": 1, "nodes_note": GpuBoxBackend.max_nodes_note},
        str(backends["sm"].pk): {"name": "sm", "offers": True, "spot": True, "strategies": ["ddp", "fsdp", "pipeline"],
                                 "max_nodes": 8, "nodes_note": ""},
        # Vertex's default executor image has torch 2.4: ddp only (fsdp needs 2.6, pipeline 2.7).
        str(backends["vx"].pk): {"name": "vx", "offers": True, "spot": True, "strategies": ["ddp"],
                                 "max_nodes": 16, "nodes_note": ""},
        str(backends["aml"].pk): {"name": "aml", "offers": True, "spot": True, "strategies": ["ddp", "fsdp", "pipeline"],
                                  "max_nodes": 16, "nodes_note": ""},  # low-priority rows exist
        str(backends["aml-lp"].pk): {"name": "aml-lp", "offers": True, "spot": True, "strategies": ["ddp", "fsdp", "pipeline"],
                                     "max_nodes": 16, "nodes_note": ""},
    }


@pytest.mark.parametrize("name, instance_type, hourly, estimate", [
    ("vx", "", "0.8395", "3.3580"),  # n1-standard-8 $0.437 + T4 $0.4025, 2 h × 2 replicas
    ("vx", "n1-standard-4", "0.620999", "2.4840"),  # the catalog keeps 6 decimals
    ("aml", "Standard_NC12s_v3", "6.12", "24.4800"),
    ("aml-lp", "", "0.612", "2.4480"),  # Standard_NC6s_v3 at its low-priority price
    ("sm", "ml.m5.xlarge", "0.23", "0.9200"),
])
def test_estimate_and_stored_job_use_the_adapters_price(owner_client, user, digits_dataset, cnn_model, backends,
                                                         name, instance_type, hourly, estimate):
    backend = backends[name]
    response = owner_client.post(reverse("job-estimate"), {
        "backend": backend.pk, "nodes": 2, "procs_per_node": 1, "max_runtime_s": 7200,
        "instance_type": instance_type})
    result = response.context["estimate"]
    assert result["ok"], result
    assert (result["hourly_price_usd"], result["estimated_cost_usd"]) == (Decimal(hourly), Decimal(estimate))

    created = owner_client.post(reverse("job-create"), {
        "name": "", "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": backend.pk,
        "strategy": "ddp", "nodes": 2, "procs_per_node": 1, "epochs": 1, "batch_size": 32, "lr": 0.05, "seed": 0,
        "max_runtime_s": 7200, "budget_usd": "", "instance_type": instance_type, "hyperparameters": ""})
    assert created.status_code == 302, created.context["form"].errors
    job = TrainingJob.objects.get(backend=backend)
    assert (job.hourly_price_usd, job.estimated_cost_usd) == (Decimal(hourly), Decimal(estimate))


def test_another_backends_machine_type_is_refused(owner_client, digits_dataset, cnn_model, backends):
    response = owner_client.post(reverse("job-create"), {
        "name": "", "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": backends["vx"].pk,
        "strategy": "ddp", "nodes": 1, "procs_per_node": 1, "epochs": 1, "batch_size": 32, "lr": 0.05, "seed": 0,
        "max_runtime_s": 3600, "budget_usd": "", "instance_type": "Standard_NC6s_v3", "hyperparameters": ""})
    assert response.context["form"].errors["instance_type"] == [
        "Backend vx does not offer Standard_NC6s_v3; choose one of n1-standard-4, n1-standard-8."]
    assert not TrainingJob.objects.exists()
