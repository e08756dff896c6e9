"""A Slurm backend in the web UI: the backend form's fields come from the adapter's declaration (host
settings left to the installation), a refused sbatch option is shown on its field, Test connection
runs the adapter's checks against a real Slurm (tests/slurmkit.py), the job form offers the backend,
and the estimate is priced from the partition's internal rate or says that none is set."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.urls import reverse

from cloud_adapters.registry import backend_settings
from jobs import services
from jobs.models import ComputeBackend
from jobs.services.prices import instance_price_save
from slurmkit import SLURM_GROUP
from webapp import forms as webapp_forms

pytestmark = [pytest.mark.django_db, SLURM_GROUP]

FIELDS = ("cluster", "partition", "account", "qos", "gpus_per_node", "gpu_request", "cpus_per_task",
          "mem_per_node_gb", "max_nodes", "extra_sbatch_options", "container_image")


@pytest.fixture(scope="module")
def cluster(slurm_cluster_module):
    """The suite's shared Slurm cluster, clean, with this module's own work directory (tests/conftest.py)."""
    return slurm_cluster_module


@pytest.fixture
def installation(settings, tmp_path):
    settings.TRAINBOARD_SLURM_WORK_DIR = str(tmp_path / "slurm-work")
    return settings


def field(key: str) -> str:
    return webapp_forms.BackendForm().setting_field("slurm", key)


def post(settings: dict, name: str = "hpc") -> dict:
    return {"name": name, "kind": "slurm", "extra_config": "", "enabled": "on",
            **{field(k): v for k, v in settings.items()}}


def test_the_form_has_the_slurm_settings_and_no_host_setting(owner_client, installation):
    assert tuple(s.key for s in backend_settings("slurm").fields) == FIELDS
    page = owner_client.get(reverse("backend-create")).content.decode()
    names = set(re.findall(r'name="([^"]+)"', page))
    assert {field(k) for k in FIELDS} <= names
    assert "Slurm cluster" in page
    for key in ("work_dir", "python", "slurm_conf", "login_host", "transport"):
        assert not webapp_forms.BackendForm().setting_field("slurm", key)


def test_create_a_slurm_backend_from_its_fields(owner_client, user, installation):
    response = owner_client.post(reverse("backend-create"), post({
        "cluster": "hpc1", "partition": "gpu", "account": "ml", "qos": "", "gpus_per_node": "4",
        "gpu_request": "gpus-per-node", "cpus_per_task": "", "mem_per_node_gb": "64", "max_nodes": "8",
        "extra_sbatch_options": "--constraint=a100 --exclusive", "container_image": ""}))
    assert response.status_code == 302, response.context["form"].errors
    backend = ComputeBackend.objects.get(owner=user, name="hpc")
    assert backend.kind == "slurm"
    assert backend.config == {"cluster": "hpc1", "partition": "gpu", "account": "ml", "gpus_per_node": 4,
                              "gpu_request": "gpus-per-node", "mem_per_node_gb": 64, "max_nodes": 8,
                              "extra_sbatch_options": "--constraint=a100 --exclusive"}


def test_a_refused_sbatch_option_is_named_on_its_field(owner_client, installation):
    response = owner_client.post(reverse("backend-create"), post({"partition": "gpu",
                                                                  "extra_sbatch_options": "--uid=0"}))
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert "Extra sbatch options: --uid is not allowed (would run the job as another user)." in str(errors)


def test_test_connection_runs_the_checks_on_the_cluster(owner_client, user, cluster, settings):
    settings.TRAINBOARD_SLURM_WORK_DIR = str(cluster.work_dir)
    settings.TRAINBOARD_SLURM_CONF = str(cluster.conf)
    backend = services.backend_create(owner=user, name="hpc", kind="slurm", config={"partition": cluster.partition})
    page = owner_client.post(reverse("backend-test-connection", args=[backend.pk]), HTTP_HX_REQUEST="true")
    text = page.content.decode()
    assert page.status_code == 200
    assert "slurm-wlm 22.05.8" in text
    assert "partition debug: up, 2 nodes, 2 CPUs per node" in text
    assert f"{cluster.work_dir} is writable" in text


def test_the_job_form_offers_the_backend_and_the_estimate_uses_the_internal_rate(owner_client, user, installation):
    backend = services.backend_create(owner=user, name="hpc", kind="slurm",
                                      config={"partition": "gpu", "cluster": "hpc1", "gpus_per_node": 2})
    page = owner_client.get(reverse("job-create")).content.decode()
    assert re.search(rf'<option value="{backend.pk}"[^>]*>[^<]*hpc', page)

    unpriced = services.training_job_estimate(backend=backend, nodes=2, procs_per_node=2, max_runtime_s=3600)
    assert unpriced["hourly_price_usd"] == 0
    assert unpriced["price_note"] == (
        "no internal rate is set for partition gpu on cluster hpc1, so jobs here cost $0; an admin sets it in the "
        "price catalog (provider slurm, region hpc1, instance type gpu)")
    assert unpriced["message"].endswith(unpriced["price_note"])

    instance_price_save(provider="slurm", region="hpc1", instance_type="gpu", usd_per_hour=Decimal("1.5"),
                        usd_per_gpu_hour=Decimal("2"))
    priced = services.training_job_estimate(backend=backend, nodes=2, procs_per_node=2, max_runtime_s=3600)
    assert Decimal(str(priced["hourly_price_usd"])) == Decimal("5.5")  # 1.5 + 2 GPUs × 2
    assert Decimal(str(priced["estimated_cost_usd"])) == Decimal("11.00")  # 1 h × 2 nodes × 5.5
    assert priced["price_note"] == ""
    estimate = owner_client.get(reverse("job-estimate"), {"backend": backend.pk, "nodes": 2, "procs_per_node": 2,
                                                          "max_runtime_s": 3600, "instance_type": ""})
    assert "$11.00 max" in estimate.content.decode()


def test_the_job_page_says_when_no_internal_rate_is_set(owner_client, user, installation, digits_dataset, cnn_model):
    backend = services.backend_create(owner=user, name="hpc", kind="slurm",
                                      config={"partition": "gpu", "cluster": "hpc1"})
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=backend,
                                       nodes=2, procs_per_node=1, epochs=1)
    page = owner_client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert ('<p class="muted small" id="price-note">Cost: no internal rate is set for partition gpu on cluster hpc1, '
            'so jobs here cost $0; an admin sets it in the price catalog') in page

    instance_price_save(provider="slurm", region="hpc1", instance_type="gpu", usd_per_hour=Decimal("1.5"))
    priced = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=backend,
                                          nodes=2, procs_per_node=1, epochs=1)
    assert priced.hourly_price_usd == Decimal("1.5")
    assert 'id="price-note"' not in owner_client.get(reverse("job-detail", args=[priced.pk])).content.decode()


def test_the_api_creates_a_slurm_backend_and_refuses_what_it_must(api_client, user, installation):
    created = api_client.post("/api/backends/", {"name": "hpc", "kind": "slurm", "config": {
        "partition": "gpu", "gpus_per_node": 2, "extra_sbatch_options": ["--constraint=a100", "--exclusive"]}},
        format="json")
    assert created.status_code == 201, created.json()
    assert ComputeBackend.objects.get(owner=user, name="hpc").config == {
        "partition": "gpu", "gpus_per_node": 2, "extra_sbatch_options": "--constraint=a100 --exclusive"}

    refused = api_client.post("/api/backends/", {"name": "hpc2", "kind": "slurm", "config": {
        "partition": "gpu", "extra_sbatch_options": ["--export=ALL"], "gpus_per_node": "four"}}, format="json")
    assert refused.status_code == 400
    assert refused.json()["config"] == [
        "GPUs per node: expected a whole number, got 'four'.",
        "Extra sbatch options: --export is not allowed (would pass the worker's environment to the job)."]



def test_a_non_staff_user_may_not_set_where_the_jobs_run(django_user_model, installation):
    from rest_framework.test import APIClient

    carol = django_user_model.objects.create_user(username="carol", password="pw-carol-123", is_staff=False)
    api = APIClient()
    api.force_authenticate(carol)
    host = api.post("/api/backends/", {"name": "hpc3", "kind": "slurm", "config": {
        "partition": "gpu", "work_dir": "/home/someone-else", "python": "/tmp/evil/python"}}, format="json")
    assert host.status_code == 400, host.json()
    assert not ComputeBackend.objects.filter(owner=carol).exists()
    text = str(host.json())
    assert "Working directory: only a backend owned by staff may set this" in text and "TRAINBOARD_SLURM_WORK_DIR" in text
    assert "Python on the nodes: only a backend owned by staff may set this" in text
    ok = api.post("/api/backends/", {"name": "hpc3", "kind": "slurm", "config": {"partition": "gpu"}}, format="json")
    assert ok.status_code == 201, ok.json()
