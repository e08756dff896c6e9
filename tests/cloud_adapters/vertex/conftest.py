"""Fixtures for the Vertex AI adapter tests: the in-memory Vertex AI + Cloud Logging stand-in
(standin.py) on 127.0.0.1, gcp-storage-emulator as Cloud Storage (clouds.md §6), a simulated clock
for retries and the rate limit, and a backend wired to all three. No request leaves the machine:
every endpoint is ``http://127.0.0.1:…`` and credentials are anonymous.

No database: these are adapter-level tests.
"""

from __future__ import annotations

import random

import pytest

from adapter_standins import gcs_emulator
from cloud_adapters import retry
from standin import VertexStandIn
from fake_clock import FakeClock

STAGING = "gs://stage/tb"




@pytest.fixture(autouse=True)
def google_env(monkeypatch, tmp_path):
    """No ambient Google configuration: no key file, no gcloud config, no emulator variable."""
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST",
                 "CLOUDSDK_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # google.auth.default must not probe the metadata server
    retry.reset_limiters()
    yield
    retry.reset_limiters()


@pytest.fixture
def vertex():
    server = VertexStandIn().start()
    yield server
    server.stop()


@pytest.fixture
def gcs():
    """gcp-storage-emulator in memory with the bucket ``stage``; yields its URL."""
    with gcs_emulator("stage") as url:
        yield url


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_backend(vertex, gcs, clock):
    from cloud_adapters.vertex import VertexBackend

    def make(**overrides):
        config = {"project": "my-proj", "staging_bucket": STAGING, "api_endpoint": vertex.url,
                  "storage_endpoint": gcs, "accelerator_type": "NVIDIA_TESLA_T4", "accelerator_count": 1,
                  "spot_allowed": True, "service_account": "trainer@my-proj.iam.gserviceaccount.com"}
        config.update(overrides)
        return VertexBackend(config, retry_policy=retry.RetryPolicy(rng=random.Random(0)), clock=clock)

    return make


@pytest.fixture
def backend(make_backend):
    return make_backend()
