"""Fixtures for the orphan tests: moto's SageMaker stand-in (with StopTrainingJob, sm_standin.py) and a
SageMaker backend row, a non-staff user, and a helper that submits a Trainboard job through the real
adapter and records its handle the way the submit service does."""

from __future__ import annotations

import sys
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sm_standin  # noqa: E402

from cloud_adapters import retry  # noqa: E402
from jobs import services  # noqa: E402
from jobs.models import JobStateChoices as S, TrainingJob  # noqa: E402

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"
BUCKET = "tb-test-bucket"


@pytest.fixture
def aws(monkeypatch, tmp_path):
    """moto in-process for every AWS call of the test, fake credentials, StopTrainingJob added."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    retry.reset_limiters()
    with mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        sm_standin.install_stop(monkeypatch)
        yield
    retry.reset_limiters()


@pytest.fixture
def sm_backend(user):
    return services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": ROLE, "bucket": BUCKET, "max_calls_per_second": 1000.0})


@pytest.fixture
def non_staff(django_user_model):
    return django_user_model.objects.create_user(username="carol", password="pw-carol-123", is_staff=False)


@pytest.fixture
def launch(user, digits_dataset, cnn_model):
    """``launch(backend, **job_fields)``: a job row created by the service and started at the
    provider through the backend's real adapter (its handle stored, state PENDING)."""

    def _launch(backend, **fields):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=backend, epochs=200, max_runtime_s=600, **fields)
        handle = services.backend_adapter(backend).submit(services.job_spec(job))
        TrainingJob.objects.filter(pk=job.pk).update(provider_handle=handle.to_dict(), state=S.PENDING)
        job.refresh_from_db()
        return job

    return _launch
