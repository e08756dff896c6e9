"""Fixtures for the SageMaker adapter tests: fake AWS credentials (no request leaves the machine:
moto's ``mock_aws`` answers in-process and botocore's Stubber answers before sending), a simulated
clock for retries and the rate limit, and helpers (sm_helpers.py) to count, script and throttle API calls.

No database: these are adapter-level tests.
"""

from __future__ import annotations

import pytest

from cloud_adapters import retry
from sm_helpers import FakeClock


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    """Fake credentials for the default chain; no profile, no shared config, no instance metadata."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    retry.reset_limiters()
    yield
    retry.reset_limiters()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
