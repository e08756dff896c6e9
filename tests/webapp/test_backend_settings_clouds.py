"""The backend form's Vertex AI and Azure ML settings (each adapter's ``settings`` declaration):
every configuration key has a field with a label and help a user understands, no secret field,
values stored typed and shown again on the edit page, the adapter's message on the setting it names,
another kind's fields ignored."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils.html import escape

from cloud_adapters.registry import backend_settings
from jobs.models import ComputeBackend
from webapp import forms as webapp_forms

pytestmark = pytest.mark.django_db

SUBSCRIPTION = "3f2b6c1e-8a4d-4e7b-9c0a-5d1e2f3a4b5c"
VERTEX_KEYS = ("project", "region", "staging_bucket", "image_uri", "service_account", "machine_type",
               "accelerator_type", "accelerator_count", "spot_allowed", "max_nodes", "api_endpoint",
               "storage_endpoint")
AZUREML_KEYS = ("subscription_id", "resource_group", "workspace", "compute", "environment", "vm_size", "tier",
                "region", "max_nodes", "base_url")


def field(kind: str, key: str) -> str:
    name = webapp_forms.BackendForm().setting_field(kind, key)
    assert name, (kind, key)
    return name


def field_names(html: str) -> set[str]:
    return set(re.findall(r'name="([^"]+)"', html))


VERTEX_SETTINGS = {
    "project": "vision-ml-prod", "region": "europe-west4", "staging_bucket": "gs://tb-staging/vertex",
    "image_uri": "europe-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-4.py310:latest",
    "service_account": "trainer@vision-ml-prod.iam.gserviceaccount.com", "machine_type": "n1-standard-16",
    "accelerator_type": "NVIDIA_TESLA_T4", "accelerator_count": "2", "spot_allowed": "on", "max_nodes": "8",
    "api_endpoint": "", "storage_endpoint": "",
}
AZUREML_SETTINGS = {
    "subscription_id": SUBSCRIPTION, "resource_group": "ml-rg", "workspace": "vision-ws", "compute": "gpu-cluster",
    "environment": "", "vm_size": "Standard_NC24ads_A100_v4", "tier": "low_priority", "region": "westeurope",
    "max_nodes": "4", "base_url": "",
}


def post(kind: str, settings: dict, name: str = "cloud", **extra) -> dict:
    return {"name": name, "kind": kind, "extra_config": "", "enabled": "on",
            **{field(kind, k): v for k, v in settings.items()}, **extra}


def test_new_backend_page_has_every_vertex_and_azure_ml_setting(owner_client):
    page = owner_client.get(reverse("backend-create")).content.decode()
    assert '<fieldset class="kind-settings" data-kind="vertex">' in page
    assert '<fieldset class="kind-settings" data-kind="azureml">' in page
    names = field_names(page)
    assert {field("vertex", k) for k in VERTEX_KEYS} <= names
    assert {field("azureml", k) for k in AZUREML_KEYS} <= names
    # Shared setting names get the kind in front, so each kind keeps its own field.
    assert (field("vertex", "region"), field("azureml", "region"), field("sagemaker", "region")) == (
        "vertex_region", "azureml_region", "sagemaker_region")
    assert (field("vertex", "max_nodes"), field("azureml", "max_nodes")) == ("vertex_max_nodes", "azureml_max_nodes")
    assert (field("vertex", "spot_allowed"), field("vertex", "image_uri")) == ("vertex_spot_allowed", "vertex_image_uri")
    assert (field("vertex", "project"), field("azureml", "subscription_id")) == ("project", "subscription_id")
    # Credentials come from ADC / DefaultAzureCredential on the worker unless typed into the write-only
    # secret_<kind>_<key> fields (the job_secrets textarea likewise), which never carry a value back.
    assert not {n for n in names if re.search("secret|key|token|password|credential", n)} - {
        "csrfmiddlewaretoken", "job_secrets"} - {n for n in names if n.startswith("secret_")}
    assert not re.search(r'type="password"[^>]*value=', page)
    for text in ("Google Cloud project ID", "Staging bucket", "gs://bucket or gs://bucket/prefix", "Executor image",
                 "Accelerators per machine", "NVIDIA_TESLA_T4", "Subscription ID", "Compute cluster",
                 "Low priority (cheaper, may be preempted)", "Default VM size", "curated PyTorch environment"):
        assert escape(text) in page, text


def test_every_setting_has_a_label_and_help_text():
    form = webapp_forms.BackendForm()
    for kind in ("vertex", "azureml"):
        keys = VERTEX_KEYS if kind == "vertex" else AZUREML_KEYS
        assert tuple(s.key for s in backend_settings(kind).fields) == keys
        for key in keys:
            form_field = form.fields[form.setting_field(kind, key)]
            assert form_field.label and form_field.help_text, (kind, key)
            assert not form_field.required, (kind, key)  # required-ness is the adapter's to say


def test_create_a_vertex_backend_from_its_fields(owner_client, user):
    response = owner_client.post(reverse("backend-create"), post("vertex", VERTEX_SETTINGS, name="vx"))
    assert response.status_code == 302, response.context["form"].errors
    backend = ComputeBackend.objects.get(owner=user, name="vx")
    assert backend.kind == "vertex"
    # Typed values; blank settings left out so the adapter's defaults apply.
    assert backend.config == {
        "project": "vision-ml-prod", "region": "europe-west4", "staging_bucket": "gs://tb-staging/vertex",
        "image_uri": "europe-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-4.py310:latest",
        "service_account": "trainer@vision-ml-prod.iam.gserviceaccount.com", "machine_type": "n1-standard-16",
        "accelerator_type": "NVIDIA_TESLA_T4", "accelerator_count": 2, "spot_allowed": True, "max_nodes": 8}

    form = owner_client.get(reverse("backend-edit", args=[backend.pk])).context["form"]
    assert {k: form.initial[field("vertex", k)] for k in backend.config} == backend.config
    assert form.initial["extra_config"] == ""


def test_create_an_azure_ml_backend_from_its_fields(owner_client, user):
    response = owner_client.post(reverse("backend-create"), post("azureml", AZUREML_SETTINGS, name="aml"))
    assert response.status_code == 302, response.context["form"].errors
    backend = ComputeBackend.objects.get(owner=user, name="aml")
    assert backend.config == {
        "subscription_id": SUBSCRIPTION, "resource_group": "ml-rg", "workspace": "vision-ws",
        "compute": "gpu-cluster", "vm_size": "Standard_NC24ads_A100_v4", "tier": "low_priority",
        "region": "westeurope", "max_nodes": 4}
    page = owner_client.get(reverse("backend-edit", args=[backend.pk]))
    form = page.context["form"]
    assert {k: form.initial[field("azureml", k)] for k in backend.config} == backend.config
    assert '<option value="low_priority" selected>' in page.content.decode()

    # Back to dedicated; the gpubox and Vertex fieldsets' stray values are ignored.
    edit = owner_client.post(reverse("backend-edit", args=[backend.pk]), post(
        "azureml", {**AZUREML_SETTINGS, "tier": "dedicated"}, name="aml",
        **{field("vertex", "project"): "", field("vertex", "accelerator_count"): "many", "max_procs_per_node": "x"}))
    assert edit.status_code == 302, edit.context["form"].errors
    backend.refresh_from_db()
    assert backend.config["tier"] == "dedicated"


def test_an_unknown_tier_is_refused_by_the_form(owner_client):
    response = owner_client.post(reverse("backend-create"), post("azureml", {**AZUREML_SETTINGS, "tier": "spot"}))
    assert response.context["form"].errors == {field("azureml", "tier"): [
        "Select a valid choice. spot is not one of the available choices."]}


@pytest.mark.parametrize("kind, settings, missing", [
    ("vertex", VERTEX_SETTINGS, "project"),
    ("vertex", VERTEX_SETTINGS, "staging_bucket"),
    ("azureml", AZUREML_SETTINGS, "subscription_id"),
    ("azureml", AZUREML_SETTINGS, "resource_group"),
    ("azureml", AZUREML_SETTINGS, "workspace"),
    ("azureml", AZUREML_SETTINGS, "compute"),
])
def test_a_missing_required_setting_is_named_on_its_field(owner_client, kind, settings, missing):
    response = owner_client.post(reverse("backend-create"), post(kind, {**settings, missing: ""}))
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert list(errors) == [field(kind, missing)], errors
    (message,) = errors[field(kind, missing)]
    from cloud_adapters.base import with_article
    from cloud_adapters.registry import KINDS, backend_class

    # The form's label, and the article that fits the kind's label ("an Azure ML", not "a Azure ML").
    assert message == (f"{backend_class(kind).settings.labels[missing]} is required for "
                       f"{with_article(KINDS[kind].label)} backend.")
    assert escape(message) in response.content.decode()
    assert not ComputeBackend.objects.exists()
