"""A Kubernetes backend in the dashboard, as the cloud backends are: the backend form has the kind
and its settings, a user's own backend (its own bearer token, the installation's kubeconfig) is
created from the form, Test connection runs its checks against the stand-in API server
(tests/k8s_standin.py), and the job form offers it with the estimate and the stored job priced from
the cluster's internal rate."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.urls import reverse

from jobs import services
from jobs.models import ComputeBackend, InstancePrice, TrainingJob
from webapp import forms as webapp_forms

pytestmark = pytest.mark.django_db

SETTINGS = {"namespace": "default", "image": "ghcr.io/acme/trainer:1.4", "gpus_per_node": "2",
            "cpu_request": "8", "memory_request": "32Gi", "suspend": "", "queue_name": "", "cluster": "onprem",
            "node_pool": "a100", "runtime": "torch-distributed"}


@pytest.fixture
def installation(settings, kube_standin):
    settings.TRAINBOARD_K8S_KUBECONFIG = str(kube_standin.kubeconfig_path)
    settings.TRAINBOARD_K8S_ALLOWED_IMAGES = "ghcr.io/acme/*"
    return kube_standin


def field(key: str) -> str:
    name = webapp_forms.BackendForm().setting_field("kubernetes", key)
    assert name, key
    return name


def test_the_backend_form_has_the_kind_and_its_settings(owner_client):
    page = owner_client.get(reverse("backend-create")).content.decode()
    assert re.search(r'<option value="kubernetes"[^>]*>Kubernetes \(Kubeflow Trainer\)</option>', page)
    assert '<fieldset class="kind-settings" data-kind="kubernetes">' in page
    names = set(re.findall(r'name="([^"]+)"', page))
    assert {field(k) for k in SETTINGS} <= names
    assert "secret_kubernetes_token" in names  # write-only
    for text in ("Trainer image", "GPUs per node", "CPU request", "Kueue queue", "Training runtime"):
        assert text in page


def test_a_users_backend_from_the_form_tests_its_connection_and_prices_its_jobs(
        owner_client, user, installation, digits_dataset, cnn_model):
    response = owner_client.post(reverse("backend-create"), {
        "name": "k8s", "kind": "kubernetes", "enabled": "on", "extra_config": "",
        "secret_kubernetes_token": installation.token, **{field(k): v for k, v in SETTINGS.items()}})
    assert response.status_code == 302, response.context["form"].errors
    backend = ComputeBackend.objects.get(name="k8s")
    assert backend.config == {"namespace": "default", "image": "ghcr.io/acme/trainer:1.4", "gpus_per_node": 2,
                              "cpu_request": "8", "memory_request": "32Gi", "cluster": "onprem",
                              "node_pool": "a100", "runtime": "torch-distributed", "suspend": False}
    assert backend.secrets == {"token": installation.token}

    checks = owner_client.post(reverse("backend-test-connection", args=[backend.pk]), HTTP_HX_REQUEST="true")
    text = checks.content.decode()
    assert [c.ok for c in checks.context["checks"]] == [True] * 6, text
    assert "ClusterTrainingRuntime torch-distributed exists." in text

    InstancePrice.objects.create(provider="kubernetes", region="onprem", instance_type="a100",
                                 usd_per_hour=Decimal("0.50"), usd_per_gpu_hour=Decimal("1.25"),
                                 source="internal rate")
    page = owner_client.get(reverse("job-create")).content.decode()
    assert re.search(rf'<option value="{backend.pk}"[^>]*>k8s</option>', page)
    estimate = owner_client.post(reverse("job-estimate"), {"backend": backend.pk, "nodes": 2, "procs_per_node": 2,
                                                           "max_runtime_s": 7200, "instance_type": ""})
    result = estimate.context["estimate"]
    assert result["ok"], result
    # (0.50 + 2 GPUs × 1.25) per node-hour × 2 nodes × 2 h
    assert (result["hourly_price_usd"], result["estimated_cost_usd"]) == (Decimal("3.00"), Decimal("12.0000"))
    refused = owner_client.post(reverse("job-estimate"), {"backend": backend.pk, "nodes": 1, "procs_per_node": 4,
                                                          "max_runtime_s": 3600, "instance_type": ""})
    assert "each rank needs its own GPU" in refused.content.decode()

    created = owner_client.post(reverse("job-create"), {
        "name": "", "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": backend.pk,
        "strategy": "ddp", "nodes": 2, "procs_per_node": 2, "epochs": 1, "batch_size": 32, "lr": 0.05, "seed": 0,
        "max_runtime_s": 7200, "budget_usd": "", "instance_type": "", "hyperparameters": ""})
    assert created.status_code == 302, created.context["form"].errors
    job = TrainingJob.objects.get(backend=backend)
    assert (job.hourly_price_usd, job.estimated_cost_usd) == (Decimal("3.00"), Decimal("12.0000"))


def test_a_users_backend_without_a_token_may_not_use_the_installations_identity(django_user_model, installation):
    from django.core.exceptions import ValidationError

    user = django_user_model.objects.create_user(username="nina", password="pw-nina-123")  # not staff

    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=user, name="k8s", kind="kubernetes", config={"image": "ghcr.io/acme/t:1"})
    assert exc.value.message_dict["secrets"][0].startswith("token: required, because this backend stores no "
                                                           "credentials of its own")
    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=user, name="k8s", kind="kubernetes", secrets={"token": "t"},
                                config={"image": "docker.io/evil/miner:1", "kubeconfig": "/root/.kube/config"})
    errors = exc.value.message_dict
    assert errors["config.kubeconfig"][0].startswith("Kubeconfig file: only a backend owned by staff may set this")
    assert errors["config.image"][0].startswith("Trainer image: 'docker.io/evil/miner:1' is not among the images")
