"""Issue 5, "the same job config submitted to each produces the three requests above and the gpubox
run": one job (digits, the CNN, DDP, 1 node × 2 processes, 1 epoch, batch 32, lr 0.05, seed 0, 1 h
max runtime) created through ``jobs.services`` on four backends of one user and submitted by the real
``jobs.tasks.submit_job`` task body, called in this process:

- gpubox: the real run (torchrun, gloo, 2 ranks on this machine), synced by ``jobs.tasks.sync_backend``
  until SUCCEEDED;
- SageMaker under moto: the CreateTrainingJob request botocore sent, the config as hyperparameters;
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
from typing import Any
from unittest import mock

import pytest

from jobs import services, tasks
from jobs.models import JobStateChoices as S, TrainingJob

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"
BUCKET = "tb-e2e-bucket"
SHAPE = dict(strategy="ddp", nodes=1, procs_per_node=2, epochs=1, batch_size=32, lr=0.05, seed=0, max_runtime_s=3600)


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


# --- SageMaker under moto ------------------------------------------------------------------------


@pytest.fixture
def aws(monkeypatch, tmp_path):
    """moto's in-process AWS with fake credentials; records every botocore call as (operation, params)."""
    import boto3
    from botocore.client import BaseClient
    from moto import mock_aws

    from cloud_adapters import retry

    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    retry.reset_limiters()
    calls: list[tuple[str, dict]] = []
    original = BaseClient._make_api_call

    def recording(self, operation_name, api_params):
        calls.append((operation_name, json.loads(json.dumps(api_params, default=str))))
        return original(self, operation_name, api_params)

    with mock_aws(), mock.patch.object(BaseClient, "_make_api_call", recording):
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield calls
    retry.reset_limiters()


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


# --- the job, four times ----------------------------------------------------------------------------


def without(config: dict, *sections: str) -> dict:
    return {k: v for k, v in config.items() if k not in sections}


def create_and_submit(owner, dataset, model, backend, capture_on_commit) -> TrainingJob:
    """The job through ``training_job_create`` (which enqueues ``submit_job`` on commit: recorded
    here), then the task body itself."""
    with mock.patch.object(tasks.submit_job, "apply_async") as enqueue, capture_on_commit(execute=True):
        job = services.training_job_create(owner=owner, dataset=dataset, model_spec=model, backend=backend,
                                           name=f"same-job-on-{backend.name}", **SHAPE)
    assert [c.kwargs.get("args") or c.args[0] for c in enqueue.call_args_list] == [[job.pk]]
    tasks.submit_job(job.pk)
    job = _reload(job)
    assert job.state == S.PENDING, (backend.name, job.state, job.failure_reason)
    return job


def test_same_job_on_four_backends(user, digits_dataset, cnn_model, local_backend, aws,
                                   django_capture_on_commit_callbacks):
    backends = {
        "local": local_backend,
        "sm": services.backend_create(owner=user, name="sm", kind="sagemaker", config={
            "region": "us-east-1", "role_arn": ROLE, "bucket": BUCKET, "instance_type": "ml.g5.12xlarge"}),
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
    assert sagemaker_config(create) == without(config, "output")  # SageMaker's directories replace output
    assert create["ResourceConfig"]["InstanceCount"] == 1
    assert create["ResourceConfig"]["InstanceType"] == "ml.g5.12xlarge"
    assert create["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600}
    assert create["EnableManagedSpotTraining"] is False
    assert create["Environment"]["TRAINBOARD_PROCS_PER_NODE"] == "2"
    assert {t["Key"]: t["Value"] for t in create["Tags"]}["trainboard-job-id"] == str(sm_job.pk)

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
