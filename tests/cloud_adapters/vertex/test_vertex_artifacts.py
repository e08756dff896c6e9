"""Vertex AI's artifacts against the GCS emulator: the job's base output directory (model/,
checkpoints/, logs/) listed by name, opened through ranged reads, and a V4 signed URL (signed by
the backend's stored service-account key) that a plain HTTP GET downloads from the emulator with
the same bytes and sha256. Without a key that can sign, there is no URL: the dashboard streams."""

from __future__ import annotations

import hashlib
import random
import urllib.request
import uuid

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cloud_adapters import retry
from cloud_adapters.base import InvalidSpec, JobSpec
from cloud_adapters.vertex import VertexBackend
from standin import service_account_key

CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"},
          "train": {"epochs": 1, "batch_size": 32}, "parallel": {"strategy": "ddp"}}
MODEL = b"vertex weights " * 400
CKPT = b"ckpt" * 99


def _backend(vertex, gcs, clock, secrets=None) -> VertexBackend:
    config = {"project": "my-proj", "staging_bucket": "gs://stage/tb", "api_endpoint": vertex.url,
              "storage_endpoint": gcs, "accelerator_type": "NVIDIA_TESLA_T4", "accelerator_count": 1}
    return VertexBackend(config, secrets=secrets, retry_policy=retry.RetryPolicy(rng=random.Random(0)), clock=clock)


@pytest.fixture
def signing_backend(vertex, gcs, clock):
    email = f"tb-{uuid.uuid4().hex[:8]}@my-proj.iam.gserviceaccount.com"
    key_json, public = service_account_key(email, token_uri=f"{vertex.url}/token")
    vertex.accept_key(email, public)
    return _backend(vertex, gcs, clock, secrets={"service_account_json": key_json})


def _job(backend, gcs):
    handle = backend.submit(JobSpec(job_name="tb-job-5-art", config=CONFIG, nodes=1, procs_per_node=1,
                                    max_runtime_s=600, tags={"trainboard-job-id": "5"}))
    bucket = storage.Client(project="my-proj", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": gcs}).bucket("stage")
    base = backend.output_uri(JobSpec(job_name="tb-job-5-art", config=CONFIG))[len("gs://stage/"):]
    bucket.blob(f"{base}model/model.pt").upload_from_string(MODEL)
    bucket.blob(f"{base}model/metrics.jsonl").upload_from_string(b'{"epoch": 0}\n')
    bucket.blob(f"{base}checkpoints/last.pt").upload_from_string(CKPT)
    bucket.blob(f"{base}elsewhere.txt").upload_from_string(b"not an artifact root")
    return handle, base


def test_lists_model_metrics_and_checkpoints_and_signs_a_url(signing_backend, gcs):
    backend = signing_backend
    handle, base = _job(backend, gcs)
    assert {a.name: (a.kind, a.size_bytes) for a in backend.artifacts(handle)} == {
        "model.pt": ("model", len(MODEL)), "metrics.jsonl": ("metrics", 13),
        "checkpoints/last.pt": ("checkpoint", len(CKPT))}
    with backend.open_artifact(handle, "checkpoints/last.pt") as stream:
        assert stream.read() == CKPT
    url = backend.artifact_url(handle, "model.pt", expires_s=180)
    assert url.startswith(f"{gcs}/stage/{base}model/model.pt?") and "X-Goog-Expires=180" in url
    with urllib.request.urlopen(url, timeout=30) as answer:
        assert hashlib.sha256(answer.read()).hexdigest() == hashlib.sha256(MODEL).hexdigest()
    assert backend.artifact_uri(handle, "model.pt") == f"gs://stage/{base}model/model.pt"
    with pytest.raises(InvalidSpec, match="no artifact"):
        backend.open_artifact(handle, "elsewhere.txt")
    with pytest.raises(InvalidSpec, match="no artifact"):
        backend.artifact_url(handle, "../elsewhere.txt")


def test_anonymous_credentials_give_no_url_but_the_stream(backend, gcs):
    handle, _ = _job(backend, gcs)
    assert backend.artifact_url(handle, "model.pt") is None
    with backend.open_artifact(handle, "model.pt") as stream:
        assert stream.read() == MODEL
