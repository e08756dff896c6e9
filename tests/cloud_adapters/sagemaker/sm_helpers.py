"""Helpers for the SageMaker adapter tests: a simulated clock, a backend built for tests, counting,
throttling and scripted DescribeTrainingJob answers."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import random
from typing import Any

import boto3
from moto import mock_aws

from cloud_adapters import retry
from cloud_adapters.base import JobSpec
from cloud_adapters.sagemaker import SageMakerBackend

ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
BUCKET = "tb-test-bucket"
T0 = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)


class FakeClock:
    """Simulated time: ``sleep`` advances ``monotonic`` at once and records each wait."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += max(seconds, 0.0)


def make_backend(clock: FakeClock | None = None, seed: int = 0, **config: Any) -> SageMakerBackend:
    settings = {"region": "us-east-1", "role_arn": ROLE, "bucket": BUCKET, "spot_allowed": True,
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
            boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        backend.client("sagemaker").meta.events.register(
            "before-call.sagemaker.CreateTrainingJob", lambda params, **kw: bodies.append(json.loads(params["body"])))
        backend.submit(spec)
        [request] = bodies
        uri = json.loads(request["HyperParameters"]["sagemaker_submit_directory"])
        bucket, key = uri[len("s3://"):].split("/", 1)
        data = backend.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    return request, data


class CallLog:
    """Counts every API call a client attempts (throttled attempts included), by operation name."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, model, **kwargs) -> None:
        self.calls.append(model.name)

    def count(self, operation: str) -> int:
        return self.calls.count(operation)


def count_calls(client) -> CallLog:
    log = CallLog()
    client.meta.events.register_first("before-call.*.*", log)  # before any stub or injector answers
    return log


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
