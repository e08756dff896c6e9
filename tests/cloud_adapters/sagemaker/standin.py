"""The SageMaker stand-in every test uses: moto's AWS (in-process, or as a loopback server for other
processes), completed where moto 5 falls short of the service, plus the helpers the adapter tests
need to count, script and throttle API calls.

moto creates every training job ``Completed`` and has no StopTrainingJob. A real job is
``InProgress`` while it bills, and the orphan sweep, list_tagged and cancel all act on such jobs, so
:func:`set_status` puts a job in progress and :func:`aws` adds StopTrainingJob with the service's
documented behaviour (InProgress → Stopping; any other status: ValidationException). The adapter's
real boto3 calls then reach a stand-in that answers them.

The fixture ``aws_env`` (tests/conftest.py) puts a test on it: fake credentials and moto for every
AWS call, no bucket yet; it yields this module::

    @pytest.fixture
    def aws(aws_env):
        aws_env.create_bucket()
        return aws_env

Inside tests/cloud_adapters/sagemaker the conftest registers this file as the module
``sagemaker_standin``; elsewhere load it with ``adapter_standins.standin("sagemaker")``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import random
from typing import Any, Iterator

import boto3
from moto import mock_aws
from moto.core import DEFAULT_ACCOUNT_ID
from moto.core.responses import EmptyResult
from moto.core.utils import utcnow
from moto.sagemaker.exceptions import ValidationError
from moto.sagemaker.models import sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse

from adapter_standins import free_port
from cloud_adapters import retry
from cloud_adapters.base import JobSpec
from cloud_adapters.sagemaker import SageMakerBackend
from fake_clock import FakeClock

REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
BUCKET = "tb-test-bucket"
T0 = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)

# Variables through which boto3 could find a real identity, profile or endpoint on the test machine.
_AMBIENT_AWS = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_ENDPOINT_URL")


# --- the environment and moto ------------------------------------------------------------------------


def fake_aws_env(monkeypatch, tmp_path) -> None:
    """Fake credentials for boto3's default chain (``testing``, region us-east-1) and nothing else it
    could find: no profile, no shared config or credentials file (both point into ``tmp_path``, where
    no such file exists), no instance metadata, no endpoint override. Undone by ``monkeypatch``."""
    for name in _AMBIENT_AWS:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION,
                        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)


@contextlib.contextmanager
def aws(monkeypatch) -> Iterator[None]:
    """moto in-process for every AWS call made inside the block, with StopTrainingJob (see
    :func:`install_stop`); no bucket exists yet (:func:`create_bucket`). Inside, boto3's default
    chain finds moto's own fake keys (access key id ``FOOBARKEY``).

    The adapters' rate limiters are reset on entry and exit: they live for the process, and one
    left from another test would make this one's first calls wait."""
    retry.reset_limiters()
    try:
        with mock_aws():
            install_stop(monkeypatch)
            yield
    finally:
        retry.reset_limiters()


def create_bucket(name: str = BUCKET, *, endpoint_url: str | None = None) -> None:
    """The S3 bucket ``name`` in us-east-1, in moto in-process or the moto server at ``endpoint_url``."""
    boto3.client("s3", region_name=REGION, endpoint_url=endpoint_url).create_bucket(Bucket=name)


@contextlib.contextmanager
def moto_server(*, bucket: str = BUCKET) -> Iterator[str]:
    """moto's AWS as a server on a free loopback port, for processes of their own (SageMaker's
    training toolkit), with the S3 bucket ``bucket``; yields its URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        create_bucket(bucket, endpoint_url=url)
        yield url
    finally:
        server.stop()


# --- what moto lacks: jobs in progress, StopTrainingJob ----------------------------------------------


def training_jobs() -> dict[str, Any]:
    """moto's training jobs of the test account in us-east-1, by TrainingJobName."""
    return sagemaker_backends[DEFAULT_ACCOUNT_ID][REGION].training_jobs


def set_status(name: str, status: str, secondary: str) -> None:
    """Put moto's job ``name`` in ``status`` / ``secondary`` (e.g. InProgress / Training); a new
    secondary status is appended to ``SecondaryStatusTransitions`` (the previous one ended), as the
    service keeps that history."""
    job = training_jobs()[name]
    job.training_job_status = status
    if secondary != job.secondary_status:
        now = dt.datetime.now(dt.timezone.utc)
        history = list(job.secondary_status_transitions or [])
        if history:
            history[-1] = {**history[-1], "EndTime": now}
        job.secondary_status_transitions = [*history, {"Status": secondary, "StartTime": now}]
    job.secondary_status = secondary
    job.last_modified_time = utcnow()


def status(name: str) -> str:
    """The TrainingJobStatus moto holds for the job ``name``."""
    return training_jobs()[name].training_job_status


def stop_training_job(self: SageMakerResponse) -> EmptyResult:
    """StopTrainingJob as the SageMaker API reference describes it: an InProgress job goes Stopping;
    an unknown name or any other status is a ValidationException."""
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
    """Give moto's SageMaker responses :func:`stop_training_job` (undone by ``monkeypatch`` at
    teardown). A test that counts stops wraps it and sets the wrapper the same way."""
    monkeypatch.setattr(SageMakerResponse, "stop_training_job", stop_training_job, raising=False)


# --- the adapter under test ----------------------------------------------------------------------------




def make_backend(clock: FakeClock | None = None, seed: int = 0, **config: Any) -> SageMakerBackend:
    """A SageMakerBackend on ``ROLE`` and ``BUCKET`` in us-east-1 with spot allowed and a rate limit
    of 1000 calls/s (so the limiter never waits), overridden by ``config``; retries draw their jitter
    from ``random.Random(seed)`` and wait on ``clock`` (a fresh :class:`FakeClock` by default)."""
    settings = {"region": REGION, "role_arn": ROLE, "bucket": BUCKET, "spot_allowed": True,
                "max_calls_per_second": 1000.0}
    settings.update(config)
    return SageMakerBackend(settings, retry_policy=retry.RetryPolicy(rng=random.Random(seed)),
                            clock=clock or FakeClock())


def submit_and_capture(spec: JobSpec, *, endpoint_url: str = "") -> tuple[dict, bytes]:
    """Submit ``spec`` through the adapter to moto — in-process, or the moto server at
    ``endpoint_url`` (whose bucket ``BUCKET`` must exist); (the CreateTrainingJob body botocore sent,
    the trainer archive's bytes read back from the S3 key its ``sagemaker_submit_directory`` names)."""
    bodies: list[dict] = []
    with contextlib.nullcontext() if endpoint_url else mock_aws():
        backend = make_backend(endpoint_url=endpoint_url) if endpoint_url else make_backend()
        if not endpoint_url:
            create_bucket()
        backend.client("sagemaker").meta.events.register(
            "before-call.sagemaker.CreateTrainingJob", lambda params, **kw: bodies.append(json.loads(params["body"])))
        backend.submit(spec)
        [request] = bodies
        uri = json.loads(request["HyperParameters"]["sagemaker_submit_directory"])
        bucket, key = uri[len("s3://"):].split("/", 1)
        data = backend.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    return request, data


# --- counting, recording, throttling and scripting calls ---------------------------------------------


class CallLog:
    """Counts every API call a client attempts (throttled attempts included), by operation name."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, model, **kwargs) -> None:
        self.calls.append(model.name)

    def count(self, operation: str) -> int:
        return self.calls.count(operation)


def count_calls(client) -> CallLog:
    """A :class:`CallLog` of ``client``'s calls from now on."""
    log = CallLog()
    client.meta.events.register_first("before-call.*.*", log)  # before any stub or injector answers
    return log


@contextlib.contextmanager
def recording_calls() -> Iterator[list[tuple[str, dict]]]:
    """Every botocore call made inside the block, by any client (including those the code under test
    makes for itself), as ``(operation name, parameters as JSON would carry them)``."""
    from unittest import mock

    from botocore.client import BaseClient

    calls: list[tuple[str, dict]] = []
    original = BaseClient._make_api_call

    def recording(self, operation_name, api_params):
        calls.append((operation_name, json.loads(json.dumps(api_params, default=str))))
        return original(self, operation_name, api_params)

    with mock.patch.object(BaseClient, "_make_api_call", recording):
        yield calls


class _Http:
    def __init__(self, status: int) -> None:
        self.status_code = status
        self.headers: dict[str, str] = {}
        self.content = b""
        self.raw = None


class Throttler:
    """Answers a seeded ``share`` of a client's calls with ThrottlingException (HTTP 400), before
    the Stubber or moto sees them; ``injected`` counts them."""

    def __init__(self, share: float, seed: int) -> None:
        self.share = share
        self.rng = random.Random(seed)
        self.injected = 0

    def __call__(self, model, **kwargs):
        if self.rng.random() < self.share:
            self.injected += 1
            return _Http(400), {"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"},
                                "ResponseMetadata": {"HTTPStatusCode": 400}}
        return None


def throttle(client, share: float, seed: int = 7) -> Throttler:
    """Throttle a seeded ``share`` (0..1) of ``client``'s calls from now on; the :class:`Throttler`."""
    injector = Throttler(share, seed)
    client.meta.events.register_first("before-call.*.*", injector)
    return injector


def describe_response(name: str, status: str, secondary: str, *, count: int = 2,
                      instance_type: str = "ml.g5.xlarge", **extra: Any) -> dict[str, Any]:
    """A DescribeTrainingJob answer as the service gives it (required members of the model)."""
    response = {
        "TrainingJobName": name,
        "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}",
        "ModelArtifacts": {"S3ModelArtifacts": f"s3://{BUCKET}/trainboard/output/{name}/output/model.tar.gz"},
        "TrainingJobStatus": status,
        "SecondaryStatus": secondary,
        "AlgorithmSpecification": {"TrainingImage": "img", "TrainingInputMode": "FastFile"},
        "ResourceConfig": {"InstanceType": instance_type, "InstanceCount": count, "VolumeSizeInGB": 50},
        "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
        "CreationTime": T0,
        "LastModifiedTime": T0,
    }
    response.update(extra)
    return response
