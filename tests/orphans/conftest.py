"""Fixtures for the orphan tests: the SageMaker stand-in (moto with jobs in progress and
StopTrainingJob, tests/cloud_adapters/sagemaker/standin.py) and a SageMaker backend row, a non-staff
user, and a helper that submits a Trainboard job through the real adapter and records its handle the
way the submit service does (a GPU box's on the trainer stand-in, tests/standins/trainer.py)."""

from __future__ import annotations

import pytest

from adapter_standins import standin
from jobs import adapters, services
from jobs.models import JobStateChoices as S, TrainingJob

sagemaker_standin = standin("sagemaker")


@pytest.fixture
def aws(aws_env):
    """The SageMaker stand-in for every AWS call of the test, with the backend's bucket."""
    aws_env.create_bucket()
    return aws_env


@pytest.fixture
def sm_backend(user):
    return services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": sagemaker_standin.ROLE, "bucket": sagemaker_standin.BUCKET,
        "max_calls_per_second": 1000.0})


@pytest.fixture
def non_staff(django_user_model):
    return django_user_model.objects.create_user(username="carol", password="pw-carol-123", is_staff=False)


@pytest.fixture
def launch(user, digits_dataset, cnn_model, settings, trainer_standin):
    """``launch(backend, **job_fields)``: a job row created by the service and started at the
    provider through the backend's real adapter (its handle stored, state PENDING). A GPU box runs
    it on the trainer stand-in, held at its first step: it runs until it is stopped."""
    settings.TRAINBOARD_GPUBOX_PYTHON = trainer_standin.python
    trainer_standin.hold(steps=1)

    def _launch(backend, **fields):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=backend, epochs=1, max_runtime_s=600, **fields)
        handle = adapters.backend_adapter(backend).submit(adapters.job_spec(job))
        TrainingJob.objects.filter(pk=job.pk).update(provider_handle=handle.to_dict(), state=S.PENDING)
        job.refresh_from_db()
        return job

    return _launch
