"""SageMakerBackend.list_tagged against moto (mock_aws): an in-progress job carrying Trainboard's tag is
listed with its name, tagged job id and a handle cancel() accepts; an untagged in-progress job and a
tagged job that ended are not; the calls are ListTrainingJobs per status plus ListTags per live job."""

from __future__ import annotations

import pytest

import sagemaker_standin as sm_standin
from cloud_adapters.base import JobSpec, JobState
from sagemaker_standin import BUCKET, count_calls, make_backend

CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp", "params": {"hidden_size": 32}},
          "parallel": {"strategy": "ddp", "procs_per_node": 1}, "train": {"epochs": 1}}


@pytest.fixture
def aws(aws_env):
    aws_env.create_bucket()


def spec(name: str, job_id: int) -> JobSpec:
    return JobSpec(job_name=name, config=CONFIG, instance_type="ml.g5.xlarge",
                   tags={"trainboard-job-id": str(job_id), "trainboard-owner-id": "1"})


def test_tagged_running_job_is_listed_untagged_and_ended_are_not(aws):
    backend = make_backend()
    backend.submit(spec("tb-job-41-aa", 41))
    backend.submit(spec("tb-job-42-bb", 42))
    sm_standin.set_status("tb-job-41-aa", "InProgress", "Training")  # tb-job-42-bb stays Completed
    sm = backend.client("sagemaker")
    # A job somebody else started by hand, in progress, with no Trainboard tag.
    sm.create_training_job(
        TrainingJobName="someone-elses-job", RoleArn="arn:aws:iam::123456789012:role/SageMakerRole",
        AlgorithmSpecification={"TrainingImage": "img:1", "TrainingInputMode": "File"},
        OutputDataConfig={"S3OutputPath": f"s3://{BUCKET}/x/"},
        ResourceConfig={"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 10},
        StoppingCondition={"MaxRuntimeInSeconds": 60}, Tags=[{"Key": "team", "Value": "vision"}])
    sm_standin.set_status("someone-elses-job", "InProgress", "Training")
    calls = count_calls(sm)

    listed = backend.list_tagged()

    assert [(p.name, p.job_id, p.state, p.raw_state) for p in listed] == [
        ("tb-job-41-aa", 41, JobState.PENDING, "InProgress")]
    assert listed[0].created_at is not None and listed[0].created_at.tzinfo is not None
    # ListTrainingJobs for InProgress and for Stopping (one page each), ListTags for the 2 live jobs.
    assert calls.count("ListTrainingJobs") == 2
    assert calls.count("ListTags") == 2

    backend.cancel(listed[0].handle)
    assert sm_standin.status("tb-job-41-aa") == "Stopping"
    again = backend.list_tagged()
    assert [(p.name, p.state) for p in again] == [("tb-job-41-aa", JobState.STOPPING)]
