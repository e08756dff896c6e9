"""SageMaker's artifacts against moto as a loopback server: the output tarball and the checkpoint
prefix listed by name, opened through GetObject, and a presigned URL that a plain HTTP GET downloads
(same bytes, same sha256); a name outside them is refused."""

from __future__ import annotations

import hashlib
import urllib.request

import boto3
import pytest

from cloud_adapters.base import InvalidSpec, JobSpec, ProviderError
from sagemaker_standin import BUCKET, REGION, make_backend, moto_server

CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp", "params": {"hidden_size": 32}},
          "parallel": {"strategy": "ddp", "procs_per_node": 1}, "train": {"epochs": 1}}
MODEL = b"\x1f\x8b model tarball " * 300
CKPT = b"checkpoint " * 50


@pytest.fixture
def server(fake_aws_credentials):
    with moto_server() as url:
        yield url


@pytest.fixture
def job(server):
    backend = make_backend(endpoint_url=server)
    handle = backend.submit(JobSpec(job_name="tb-job-7-art", config=CONFIG, instance_type="ml.g5.xlarge",
                                    tags={"trainboard-job-id": "7", "trainboard-owner-id": "1"}))
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=server)
    # Where SageMaker puts them (the backend's prefix "trainboard"): the model tarball under the
    # output path, the synced checkpoints under the job's checkpoint prefix.
    s3.put_object(Bucket=BUCKET, Key="trainboard/output/tb-job-7-art/output/model.tar.gz", Body=MODEL)
    s3.put_object(Bucket=BUCKET, Key="trainboard/output/tb-job-7-art/debug-output/x.json", Body=b"{}")
    s3.put_object(Bucket=BUCKET, Key="trainboard/checkpoints/tb-job-7-art/last.pt", Body=CKPT)
    s3.put_object(Bucket=BUCKET, Key="trainboard/checkpoints/tb-job-7-art/shards/0.distcp", Body=b"s0")
    return backend, handle


def test_lists_the_model_tarball_and_the_checkpoints(job):
    backend, handle = job
    found = {a.name: (a.kind, a.size_bytes) for a in backend.artifacts(handle)}
    assert found == {"model.tar.gz": ("model", len(MODEL)), "checkpoints/last.pt": ("checkpoint", len(CKPT)),
                     "checkpoints/shards/0.distcp": ("checkpoint", 2)}
    assert all(a.modified_at is not None and a.modified_at.tzinfo is not None for a in backend.artifacts(handle))


def test_opens_and_presigns_the_same_bytes(job):
    backend, handle = job
    with backend.open_artifact(handle, "checkpoints/last.pt") as stream:
        assert stream.read() == CKPT
    url = backend.artifact_url(handle, "model.tar.gz", expires_s=120)
    assert url.startswith(backend.config["endpoint_url"]) and "X-Amz-Expires=120" in url
    with urllib.request.urlopen(url, timeout=30) as answer:
        data = answer.read()
        assert answer.headers["Content-Disposition"] == 'attachment; filename="model.tar.gz"'
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(MODEL).hexdigest()
    assert backend.artifact_uri(handle, "model.tar.gz") == \
        f"s3://{BUCKET}/trainboard/output/tb-job-7-art/output/model.tar.gz"


@pytest.mark.parametrize("name", ["debug-output/x.json", "../output/tb-job-7-art/output/model.tar.gz",
                                  "checkpoints/../model.tar.gz", "nothing.pt"])
def test_a_name_outside_the_job_is_refused(job, name):
    backend, handle = job
    with pytest.raises(InvalidSpec, match="no artifact"):
        backend.open_artifact(handle, name)
    with pytest.raises(InvalidSpec):
        backend.artifact_url(handle, name)


def test_a_job_sagemaker_does_not_know_says_so(server):
    from cloud_adapters.base import JobHandle

    backend = make_backend(endpoint_url=server)
    with pytest.raises(ProviderError, match="no training job 'tb-job-8-none'"):
        backend.artifacts(JobHandle("sagemaker", "tb-job-8-none"))
