"""SageMakerBackend.submit against moto's mock_aws (S3 + SageMaker in-process): the trainer archive is
uploaded once per content hash, the CreateTrainingJob request carries every field the JobSpec maps
to (read from the request body botocore actually sends), a second submit adopts the first job; and, with
botocore's Stubber, what moto cannot do: ResourceInUse adoption and the error mapping."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from cloud_adapters import packaging
from cloud_adapters.base import CredentialsError, InvalidSpec, JobSpec, QuotaExceeded, Throttled
from sagemaker_standin import BUCKET, ROLE, count_calls, describe_response, make_backend, throttle

CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp", "params": {"hidden_size": 32}},
          "parallel": {"strategy": "ddp", "procs_per_node": 1}, "train": {"epochs": 1, "lr": 0.05, "augment": False},
          "output": {"output_dir": "/somewhere/else"}}


def spec(name: str = "tb-job-7-67a1b2c3", **kw) -> JobSpec:
    values = dict(job_name=name, config=CONFIG, nodes=2, procs_per_node=1, instance_type="ml.g5.xlarge",
                  spot=True, max_runtime_s=7200, dataset_uri="s3://datasets/digits/",
                  tags={"trainboard-job-id": "7", "trainboard-owner-id": "3"})
    values.update(kw)
    return JobSpec(**values)


class RequestCapture:
    """The JSON body of each CreateTrainingJob request as serialized for the wire."""

    def __init__(self, client) -> None:
        self.bodies: list[dict] = []
        client.meta.events.register("before-call.sagemaker.CreateTrainingJob", self)

    def __call__(self, params, **kwargs) -> None:
        body = params["body"]
        self.bodies.append(json.loads(body.decode() if isinstance(body, bytes) else body))


@pytest.fixture
def aws():
    with mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield


def test_two_jobs_with_one_trainer_upload_it_once(aws):
    backend = make_backend()
    s3 = backend.client("s3")
    calls = count_calls(s3)
    first = backend.submit(spec("tb-job-1-aa"))
    second = backend.submit(spec("tb-job-2-bb"))
    archive = packaging.build_archive()
    objects = s3.list_objects_v2(Bucket=BUCKET)["Contents"]
    assert [o["Key"] for o in objects] == [f"trainboard/code/trainboard-trainer-{archive.sha256[:16]}.tar.gz"]
    assert objects[0]["Size"] == len(archive.data)
    assert calls.count("PutObject") == 1 and calls.count("HeadObject") == 2
    body = s3.get_object(Bucket=BUCKET, Key=objects[0]["Key"])["Body"].read()
    assert body == archive.data
    assert first.job_name == "tb-job-1-aa" and second.job_name == "tb-job-2-bb"
    names = [j["TrainingJobName"] for j in backend.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]]
    assert sorted(names) == ["tb-job-1-aa", "tb-job-2-bb"]


def test_create_training_job_request_has_every_field(aws):
    backend = make_backend()
    sm = backend.client("sagemaker")
    capture = RequestCapture(sm)
    handle = backend.submit(spec())
    [req] = capture.bodies
    archive = packaging.build_archive()
    code_uri = f"s3://{BUCKET}/trainboard/code/trainboard-trainer-{archive.sha256[:16]}.tar.gz"

    assert req["TrainingJobName"] == "tb-job-7-67a1b2c3"
    assert req["RoleArn"] == ROLE
    assert req["AlgorithmSpecification"] == {
        "TrainingImage": "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.8.0-gpu-py312",
        "TrainingInputMode": "FastFile"}
    hps = req["HyperParameters"]
    assert all(isinstance(v, str) for v in hps.values())
    assert hps["sagemaker_program"] == '"trainboard_entry.py"'
    assert hps["sagemaker_submit_directory"] == json.dumps(code_uri)
    assert hps["sagemaker_job_name"] == '"tb-job-7-67a1b2c3"' and hps["sagemaker_region"] == '"us-east-1"'
    assert hps["data.format"] == '"builtin"' and hps["data.name"] == '"digits"'
    assert hps["model.arch"] == '"mlp"' and hps["model.params"] == '{"hidden_size":32}'
    assert hps["train.epochs"] == "1" and hps["train.lr"] == "0.05" and hps["train.augment"] == "false"
    assert hps["parallel.strategy"] == '"ddp"'
    assert not any(k.startswith("output.") for k in hps)  # SageMaker's directories replace the section
    assert req["InputDataConfig"] == [{
        "ChannelName": "train",
        "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": "s3://datasets/digits/",
                                        "S3DataDistributionType": "FullyReplicated"}},
        "InputMode": "FastFile"}]
    assert req["OutputDataConfig"] == {"S3OutputPath": f"s3://{BUCKET}/trainboard/output/"}
    assert req["CheckpointConfig"] == {"S3Uri": f"s3://{BUCKET}/trainboard/checkpoints/tb-job-7-67a1b2c3/",
                                       "LocalPath": "/opt/ml/checkpoints"}
    assert req["ResourceConfig"] == {"InstanceType": "ml.g5.xlarge", "InstanceCount": 2, "VolumeSizeInGB": 50}
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200, "MaxWaitTimeInSeconds": 14400}
    assert req["EnableManagedSpotTraining"] is True
    assert req["Environment"] == {"PYTHONUNBUFFERED": "1", "TRAINBOARD_JOB_NAME": "tb-job-7-67a1b2c3",
                                  "TRAINBOARD_PROCS_PER_NODE": "1"}
    assert req["Tags"] == [{"Key": "trainboard-job-name", "Value": "tb-job-7-67a1b2c3"},
                           {"Key": "trainboard-job-id", "Value": "7"},
                           {"Key": "trainboard-owner-id", "Value": "3"}]

    # What SageMaker (moto) stored matches, and the handle points at it.
    desc = sm.describe_training_job(TrainingJobName="tb-job-7-67a1b2c3")
    assert desc["HyperParameters"] == hps and desc["EnableManagedSpotTraining"] is True
    assert handle.provider == "sagemaker" and handle.provider_job_id == desc["TrainingJobArn"]
    assert dict(handle.extra) == {"training_job_name": "tb-job-7-67a1b2c3", "region": "us-east-1",
                                  "instance_count": 2}
    tags = sm.list_tags(ResourceArn=desc["TrainingJobArn"])["Tags"]
    assert {t["Key"]: t["Value"] for t in tags}["trainboard-job-id"] == "7"


def test_on_demand_cpu_job_without_dataset(aws):
    backend = make_backend()
    capture = RequestCapture(backend.client("sagemaker"))
    backend.submit(spec("tb-cpu", instance_type="ml.m5.xlarge", nodes=1, procs_per_node=4, spot=False,
                        dataset_uri="", max_runtime_s=600))
    [req] = capture.bodies
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 600}  # no MaxWait without spot
    assert req["EnableManagedSpotTraining"] is False
    assert "InputDataConfig" not in req
    assert req["AlgorithmSpecification"]["TrainingImage"].endswith("/pytorch-training:2.8.0-cpu-py312")
    assert req["Environment"]["TRAINBOARD_PROCS_PER_NODE"] == "4"


def test_second_submit_adopts_the_first_job(aws):
    backend = make_backend()
    sm = backend.client("sagemaker")
    calls = count_calls(sm)
    first = backend.submit(spec())
    other = make_backend()  # e.g. the task redelivered to another worker
    other_calls = count_calls(other.client("sagemaker"))
    again = other.submit(spec())
    assert again == first
    assert calls.count("CreateTrainingJob") == 1 and other_calls.count("CreateTrainingJob") == 0
    assert other_calls.calls == ["DescribeTrainingJob"]
    jobs = sm.list_training_jobs()["TrainingJobSummaries"]
    assert [j["TrainingJobName"] for j in jobs] == ["tb-job-7-67a1b2c3"]


def test_underscored_name_is_mapped_deterministically(aws):
    backend = make_backend()
    handle = backend.submit(spec("tb_job_9_run"))
    sm_name = handle.extra["training_job_name"]
    assert sm_name.startswith("tb-job-9-run-") and len(sm_name) == len("tb-job-9-run-") + 8
    assert backend.submit(spec("tb_job_9_run")) == handle
    assert [j["TrainingJobName"] for j in backend.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]] == [sm_name]


# -- Stubber: what moto does not answer ---------------------------------------------------------


def _not_found(stub: Stubber, name: str) -> None:
    stub.add_client_error("describe_training_job", service_error_code="ValidationException",
                          service_message="Requested resource not found.", http_status_code=400,
                          expected_params={"TrainingJobName": name})


def _stubbed(backend):
    """Stub SageMaker; S3 answers through moto (the archive upload is not what these tests test)."""
    sm = backend.client("sagemaker")
    return sm, Stubber(sm)


def test_resource_in_use_adopts_by_name(aws):
    backend = make_backend()
    sm, stub = _stubbed(backend)
    name = "tb-job-7-67a1b2c3"
    _not_found(stub, name)
    stub.add_client_error("create_training_job", service_error_code="ResourceInUse",
                          service_message=f"Training job names must be unique ... {name} already exists",
                          http_status_code=400)
    stub.add_response("describe_training_job", describe_response(name, "InProgress", "Starting"),
                      {"TrainingJobName": name})
    with stub:
        handle = backend.submit(spec())
    stub.assert_no_pending_responses()
    assert handle.provider_job_id == f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}"
    assert handle.extra["instance_count"] == 2


@pytest.mark.parametrize("code, error, words", [
    ("ResourceLimitExceeded", QuotaExceeded, "Service Quotas"),
    ("AccessDeniedException", CredentialsError, "IAM policy"),
    ("UnrecognizedClientException", CredentialsError, "lack a permission or are invalid"),
    ("ValidationException", InvalidSpec, "ValidationException: bad"),
])
def test_create_errors_become_backend_errors(aws, code, error, words):
    backend = make_backend()
    sm, stub = _stubbed(backend)
    _not_found(stub, "tb-job-7-67a1b2c3")
    stub.add_client_error("create_training_job", service_error_code=code, service_message="bad",
                          http_status_code=400)
    with stub, pytest.raises(error) as err:
        backend.submit(spec())
    assert words in str(err.value) and code in str(err.value)
    stub.assert_no_pending_responses()  # not retried


def test_throttled_create_is_retried_then_raises_throttled(aws, clock):
    backend = make_backend(clock)
    sm, stub = _stubbed(backend)
    _not_found(stub, "tb-job-7-67a1b2c3")
    for _ in range(5):
        stub.add_client_error("create_training_job", service_error_code="ThrottlingException",
                              service_message="Rate exceeded", http_status_code=400)
    with stub, pytest.raises(Throttled) as err:
        backend.submit(spec())
    stub.assert_no_pending_responses()
    assert "the next sync tries again" in str(err.value)
    assert len(clock.sleeps) == 4  # 5 attempts, 4 backoffs, each under its full-jitter cap
    assert all(0 <= s < cap for s, cap in zip(clock.sleeps, (0.5, 1.0, 2.0, 4.0)))


def test_throttled_then_created(aws, clock):
    backend = make_backend(clock)
    sm = backend.client("sagemaker")
    injected = throttle(sm, share=0.5, seed=3)
    calls = count_calls(sm)
    handle = backend.submit(spec())
    assert injected.injected > 0 and len(clock.sleeps) == injected.injected
    assert calls.count("CreateTrainingJob") >= 1
    jobs = boto3.client("sagemaker", region_name="us-east-1").list_training_jobs()["TrainingJobSummaries"]
    assert [j["TrainingJobName"] for j in jobs] == [handle.job_name]


def test_an_mpi_script_asks_for_the_mpi_distribution_and_a_torch_job_does_not(aws):
    """``code.framework`` mpi: the hyperparameters the SDK sends for distribution={"mpi": {"enabled":
    True, "processes_per_host": 2}} (JSON-encoded), which make the toolkit start the ranks with its
    mpirun (trainer_pkg/frameworks/mpi.py then runs the script as each rank)."""
    backend = make_backend()
    capture = RequestCapture(backend.client("sagemaker"))
    mpi_config = {**CONFIG, "code": {"script": "train.py", "framework": "mpi"}}
    backend.submit(spec("tb-job-8-mpi", config=mpi_config, procs_per_node=2, instance_type="ml.g5.12xlarge"))
    backend.submit(spec("tb-job-9-torch"))
    mpi_hps, torch_hps = (body["HyperParameters"] for body in capture.bodies)
    assert {k: v for k, v in mpi_hps.items() if k.startswith("sagemaker_mpi")} == {
        "sagemaker_mpi_enabled": "true", "sagemaker_mpi_num_of_processes_per_host": "2",
        "sagemaker_mpi_custom_mpi_options": '""'}
    assert mpi_hps["code.framework"] == '"mpi"' and mpi_hps["sagemaker_program"] == '"trainboard_entry.py"'
    assert not [k for k in torch_hps if k.startswith("sagemaker_mpi")]
