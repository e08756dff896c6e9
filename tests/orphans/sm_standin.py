"""moto's SageMaker stand-in, completed for the orphan tests: moto 5 creates every training job
``Completed`` and has no StopTrainingJob. These helpers put a job in progress (what a real job is while
it bills) and add StopTrainingJob with the service's documented behaviour (InProgress → Stopping; any
other status: ValidationException), so the adapter's real boto3 calls reach a stand-in that answers
them. Used only inside ``mock_aws``.
"""

from __future__ import annotations

from typing import Any

from moto.core import DEFAULT_ACCOUNT_ID
from moto.core.responses import EmptyResult
from moto.sagemaker.exceptions import ValidationError
from moto.sagemaker.models import sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse

REGION = "us-east-1"


def training_jobs() -> dict[str, Any]:
    """moto's training jobs of the test account in us-east-1, by TrainingJobName."""
    return sagemaker_backends[DEFAULT_ACCOUNT_ID][REGION].training_jobs


def set_status(name: str, status: str, secondary: str) -> None:
    """Put moto's job ``name`` in ``status`` / ``secondary`` (e.g. InProgress / Training)."""
    job = training_jobs()[name]
    job.training_job_status = status
    job.secondary_status = secondary


def status(name: str) -> str:
    return training_jobs()[name].training_job_status


def _stop_training_job(self: SageMakerResponse) -> EmptyResult:
    name = self._get_param("TrainingJobName")
    job = self.sagemaker_backend.training_jobs.get(name)
    if job is None:
        raise ValidationError(message="Requested resource not found.")
    if job.training_job_status != "InProgress":
        raise ValidationError(message=f"The request was rejected because the training job is in status "
                                      f"{job.training_job_status}.")
    job.training_job_status = "Stopping"
    job.secondary_status = "Stopping"
    return EmptyResult()


def install_stop(monkeypatch) -> None:
    """Give moto's SageMaker responses a StopTrainingJob (undone by ``monkeypatch`` at teardown)."""
    monkeypatch.setattr(SageMakerResponse, "stop_training_job", _stop_training_job, raising=False)
