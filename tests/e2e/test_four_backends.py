"""The same job config reaches every backend unchanged: one job (digits, the CNN, DDP, 1 node × 2
processes, 1 epoch, batch 32, lr 0.05, seed 0, 1 h max runtime) created through ``jobs.services`` on
four backends of one user and submitted by the real ``jobs.tasks.submit_job`` task body, called in
this process:

- gpubox: the real run (torchrun, gloo, 2 ranks on this machine), synced by ``jobs.tasks.sync_backend``
  until SUCCEEDED;
- SageMaker on its stand-in (moto): the CreateTrainingJob request botocore sent, the config as hyperparameters;
- Vertex AI against its stand-in (a local HTTP server answering the real aiplatform_v1 REST client,
  gcp-storage-emulator for the trainer package): the CustomJob POSTed;
- Azure ML against its stand-in (an in-memory workspace behind a custom azure-core transport): the
  PUT of the command job.

Each cloud request is decoded back to a JobConfig-shaped dict and compared, field by field, with the
job's frozen config, and its shape (instances, processes per node, machine, runtime limit, tags) with
the job's. No Celery worker: the provider stand-ins live in this process.

Run: DATABASE_URL=postgres://postgres@127.0.0.1:5432/trainboard REDIS_URL=redis://127.0.0.1:6379/15 \\
     .venv/bin/python -m pytest tests/e2e/test_four_backends.py -q
"""

from __future__ import annotations

import json
import time
import urllib.parse
from decimal import Decimal
from typing import Any
from unittest import mock

import pytest
import requests

from adapter_standins import azureml_workspace_in_registry, azurite_blob, standin, vertex_with_gcs
from jobs import dispatch, services, tasks
from jobs.models import InstancePrice, JobStateChoices as S, TrainingJob
from jobs.pricing import DatabasePriceCatalog
from taskkit import sent_tasks



azureml_standin = standin("azureml")

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"
BUCKET = "tb-e2e-bucket"
SHAPE = dict(strategy="ddp", nodes=1, procs_per_node=2, epochs=1, batch_size=32, lr=0.05, seed=0, max_runtime_s=3600)


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


# --- SageMaker under moto ------------------------------------------------------------------------


@pytest.fixture
def aws(aws_env):
    """The SageMaker stand-in with the bucket ``BUCKET``; records every botocore call as (operation, params)."""
    aws_env.create_bucket(BUCKET)
    with aws_env.recording_calls() as calls:
        yield calls


def sagemaker_config(request: dict) -> dict[str, Any]:
    """The JobConfig the SageMaker adapter sent: ``HyperParameters`` are ``section.field`` → JSON
    text (SageMaker's string-only hyperparameters); SageMaker's own ``sagemaker_*`` keys left out."""
    config: dict[str, dict[str, Any]] = {}
    for key, text in request["HyperParameters"].items():
        if key.startswith("sagemaker_"):
            continue
        section, name = key.split(".", 1)
        config.setdefault(section, {})[name] = json.loads(text)
    return config


# --- Vertex AI: its stand-in and gcp-storage-emulator --------------------------------------------------


@pytest.fixture
def vertex(monkeypatch, tmp_path):
    """``(Vertex stand-in, Cloud Storage emulator URL)``, no ambient Google configuration."""
    with vertex_with_gcs(monkeypatch, tmp_path) as both:
        yield both


def gcs_read(gcs_url: str, bucket: str, name: str) -> bytes:
    response = requests.get(f"{gcs_url}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}",
                            params={"alt": "media"}, timeout=10)
    response.raise_for_status()
    return response.content


# --- Azure ML: its stand-in (custom azure-core transport) and Azurite ------------------------------------


@pytest.fixture
def azurite(tmp_path):
    """Azurite's Blob service (npm devDependency) on a free loopback port: the code snapshot's store."""
    with azurite_blob(tmp_path) as account:
        yield account


@pytest.fixture
def azureml(monkeypatch, azurite):
    """The in-memory workspace; every Azure ML adapter ``jobs.services`` builds talks to it through
    the stand-in transport with a fake credential (the only thing a stored config cannot say)."""
    return azureml_workspace_in_registry(monkeypatch, azurite, vm_size="Standard_NC12s_v3")


def snapshot_file(blob: Any, code_uri: str, name: str) -> bytes:
    """File ``name`` of the code snapshot stored at ``code_uri`` (``<blob url>/<container>/<prefix>``)."""
    container, _, prefix = code_uri.removeprefix(blob.url + "/").partition("/")
    client = blob.service().get_container_client(container)
    [path] = [b.name for b in client.list_blobs(name_starts_with=prefix) if b.name.endswith("/" + name)]
    return client.download_blob(path).readall()


# --- the job, four times ----------------------------------------------------------------------------


def without(config: dict, *sections: str) -> dict:
    return {k: v for k, v in config.items() if k not in sections}


def create_and_submit(owner, dataset, model, backend, capture_on_commit) -> TrainingJob:
    """The job through ``training_job_create`` (which enqueues ``submit_job`` on commit: recorded
    here), then the task body itself."""
    with sent_tasks(dispatch.SUBMIT_JOB) as enqueue, capture_on_commit(execute=True):
        job = services.training_job_create(owner=owner, dataset=dataset, model_spec=model, backend=backend,
                                           name=f"same-job-on-{backend.name}", **SHAPE)
    assert [c.kwargs.get("args") or c.args[0] for c in enqueue.call_args_list] == [[job.pk]]
    tasks.submit_job(job.pk)
    job = _reload(job)
    assert job.state == S.PENDING, (backend.name, job.state, job.failure_reason)
    return job


def test_same_job_on_four_backends(user, digits_dataset, cnn_model, local_backend, aws, vertex, azureml,
                                   django_capture_on_commit_callbacks):
    vertex_api, gcs_url = vertex
    # 2 processes per node need 2 GPUs on each cloud: Azure's NC12s_v3 is priced by an admin row.
    InstancePrice.objects.create(provider="azure", region="eastus", instance_type="Standard_NC12s_v3",
                                 usd_per_hour=Decimal("6.12"), source="test: admin-entered")
    backends = {
        "local": local_backend,
        "sm": services.backend_create(owner=user, name="sm", kind="sagemaker", config={
            "region": "us-east-1", "role_arn": ROLE, "bucket": BUCKET, "instance_type": "ml.g5.12xlarge"}),
        "vx": services.backend_create(owner=user, name="vx", kind="vertex", config={
            "project": "tb-e2e-project", "staging_bucket": "gs://stage/tb", "api_endpoint": vertex_api.url,
            "storage_endpoint": gcs_url, "machine_type": "n1-standard-8", "accelerator_type": "NVIDIA_TESLA_T4",
            "accelerator_count": 2}),
        "aml": services.backend_create(owner=user, name="aml", kind="azureml", config={
            "subscription_id": azureml_standin.SUBSCRIPTION, "resource_group": azureml_standin.RESOURCE_GROUP,
            "workspace": azureml_standin.WORKSPACE, "compute": azureml_standin.COMPUTE,
            "vm_size": "Standard_NC12s_v3"}),
    }
    jobs = {name: create_and_submit(user, digits_dataset, cnn_model, b, django_capture_on_commit_callbacks)
            for name, b in backends.items()}
    config = jobs["local"].config
    # One frozen config for all: the same dataset, model and training settings.
    for name, job in jobs.items():
        assert job.config == config, name
        assert (job.nodes, job.procs_per_node, job.max_runtime_s, job.spot) == (1, 2, 3600, False), name
    assert config["data"] == {**config["data"], "format": "builtin", "name": "digits"}
    assert config["model"] == {**config["model"], "arch": "cnn", "params": {**config["model"]["params"],
                                                                            "channels": 16, "hidden_size": 64}}
    assert {k: config["train"][k] for k in ("epochs", "batch_size", "lr", "seed")} == {
        "epochs": 1, "batch_size": 32, "lr": 0.05, "seed": 0}
    assert {k: config["parallel"][k] for k in ("strategy", "nodes", "procs_per_node")} == {
        "strategy": "ddp", "nodes": 1, "procs_per_node": 2}

    # --- SageMaker: one CreateTrainingJob, the config as hyperparameters ---------------------------
    [create] = [params for op, params in aws if op == "CreateTrainingJob"]
    sm_job = jobs["sm"]
    assert create["TrainingJobName"] == sm_job.provider_job_name
    # SageMaker's directories replace output's two paths; the rest of output (checkpoint_format) goes as is.
    output = {k: v for k, v in config["output"].items() if k not in ("output_dir", "checkpoint_dir")}
    assert sagemaker_config(create) == {**without(config, "output"), "output": output}
    assert output == {"checkpoint_format": "full"}
    assert create["ResourceConfig"]["InstanceCount"] == 1
    assert create["ResourceConfig"]["InstanceType"] == "ml.g5.12xlarge"
    assert create["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600}
    assert create["EnableManagedSpotTraining"] is False
    assert create["Environment"]["TRAINBOARD_PROCS_PER_NODE"] == "2"
    assert {t["Key"]: t["Value"] for t in create["Tags"]}["trainboard-job-id"] == str(sm_job.pk)

    # --- Vertex AI: one CustomJob; its config file in the staging bucket is the job's config ----------
    vx_job = jobs["vx"]
    [custom_job] = vertex_api.created
    assert custom_job["displayName"] == vx_job.provider_job_name
    assert custom_job["labels"]["trainboard-job-id"] == str(vx_job.pk)
    assert vx_job.provider_handle["provider_job_id"] == (
        "projects/tb-e2e-project/locations/us-central1/customJobs/1000000001")
    [pool] = custom_job["jobSpec"]["workerPoolSpecs"]  # one node: the chief's pool only
    assert pool["replicaCount"] == "1"
    assert pool["machineSpec"] == {"machineType": "n1-standard-8", "acceleratorType": 5,  # NVIDIA_TESLA_T4
                                   "acceleratorCount": 2}
    python = pool["pythonPackageSpec"]
    assert python["pythonModule"] == "trainer_pkg.launch"
    assert python["args"][python["args"].index("--nproc-per-node") + 1] == "2"
    assert custom_job["jobSpec"]["scheduling"] == {"timeout": "3600s"}  # no SPOT strategy
    config_path = python["args"][python["args"].index("--config") + 1]
    assert config_path.startswith("/gcs/stage/")  # the replica reads it through Cloud Storage FUSE
    vertex_config = json.loads(gcs_read(gcs_url, "stage", config_path.removeprefix("/gcs/stage/")))
    assert vertex_config == config

    # --- Azure ML: one PUT of a command job; its code snapshot carries the job's config -----------------
    aml_job = jobs["aml"]
    name = aml_job.provider_handle["extra"]["azure_job_name"]
    [put] = [r for r in azureml.requests if r.method == "PUT" and "/jobs/" in r.path]
    assert put.path.endswith(f"/workspaces/{azureml_standin.WORKSPACE}/jobs/{name}") and put.status in (200, 201)
    [body] = azureml.puts[name]
    properties = body["properties"]
    assert properties["jobType"] == "Command"
    assert properties["displayName"] == aml_job.provider_job_name
    assert properties["command"] == "python -m trainer_pkg.launch --config trainboard_job.json"
    assert properties["computeId"].endswith(f"/computes/{azureml_standin.COMPUTE}")
    assert properties["distribution"] == {"distributionType": "PyTorch", "processCountPerInstance": 2}
    assert properties["resources"]["instanceCount"] == 1
    assert properties["limits"] == {"jobLimitsType": "Command", "timeout": "PT1H"}
    assert properties["tags"]["trainboard-job-id"] == str(aml_job.pk)
    assert "queueSettings" not in properties  # dedicated, not spot
    [code] = [c for c in azureml.codes.values() if c["id"] == properties["codeId"]]
    azure_config = json.loads(snapshot_file(azureml.blob, code["properties"]["codeUri"], "trainboard_job.json"))
    assert azure_config == config

    # --- the same values in the three requests, field by field ------------------------------------------
    for section in ("data", "model", "parallel", "train"):
        for key, value in config[section].items():
            sent = {"sagemaker": sagemaker_config(create)[section][key], "vertex": vertex_config[section][key],
                    "azureml": azure_config[section][key]}
            assert sent == dict.fromkeys(sent, value), f"{section}.{key}"
    shape = {
        "sagemaker": (create["ResourceConfig"]["InstanceCount"], int(create["Environment"]["TRAINBOARD_PROCS_PER_NODE"]),
                      create["StoppingCondition"]["MaxRuntimeInSeconds"]),
        "vertex": (int(pool["replicaCount"]), int(python["args"][python["args"].index("--nproc-per-node") + 1]),
                   int(custom_job["jobSpec"]["scheduling"]["timeout"].removesuffix("s"))),
        "azureml": (properties["resources"]["instanceCount"], properties["distribution"]["processCountPerInstance"],
                    {"PT1H": 3600}[properties["limits"]["timeout"]]),
    }
    assert shape == dict.fromkeys(shape, (1, 2, 3600))

    # Priced as each adapter prices it: SageMaker's instance, Vertex's machine + 2 × T4, Azure's VM.
    catalog = DatabasePriceCatalog()

    def usd(provider, region, instance_type):
        return catalog.lookup(provider, region, instance_type).usd_per_hour

    expected = {"local": Decimal("3.6"), "sm": usd("aws", "us-east-1", "ml.g5.12xlarge"),
                "vx": usd("gcp", "us-central1", "n1-standard-8") + 2 * usd("gcp", "us-central1", "NVIDIA_TESLA_T4"),
                "aml": Decimal("6.12")}
    assert {k: j.hourly_price_usd for k, j in jobs.items()} == {
        k: v.quantize(Decimal("0.000001")) for k, v in expected.items()}

    # --- gpubox: the real run, synced by the task until it ends -------------------------------------
    local = jobs["local"]
    deadline = time.monotonic() + 240
    while not _reload(local).is_terminal:
        assert time.monotonic() < deadline, f"gpubox job still {_reload(local).state} after 240 s"
        tasks.sync_backend(local_backend.pk)
        time.sleep(0.5)
    local = _reload(local)
    assert local.state == S.SUCCEEDED, local.failure_reason
    assert local.world_size == 2 and local.cost_usd > 0
