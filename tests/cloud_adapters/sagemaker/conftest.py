"""Fixtures for the SageMaker adapter tests: fake AWS credentials (no request leaves the machine:
moto's ``mock_aws`` answers in-process and botocore's Stubber answers before sending), a simulated
clock for retries and the rate limit, and helpers (sm_helpers.py) to count, script and throttle API calls;
for the toolkit test, SageMaker's training toolkit in a virtualenv of its own and moto as a loopback server.

No database: these are adapter-level tests.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

import boto3
import pytest

from adapter_standins import free_port
from cloud_adapters import retry
from sm_helpers import BUCKET, FakeClock


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


TOOLKIT_REQUIREMENTS = Path(__file__).with_name("toolkit-requirements.txt")


@pytest.fixture(scope="session")
def sagemaker_toolkit() -> Path:
    """The ``train`` command of a virtualenv holding SageMaker's training toolkit and AWS's PyTorch
    container module (toolkit-requirements.txt), built once per pinned set and Python under
    ``$XDG_CACHE_HOME/trainboard-test`` (default ~/.cache) and reused after that.

    torch comes from this test run's environment through a ``.pth`` written after pip has resolved the
    toolkit's own dependencies, so pip neither sees nor changes the project's packages. A build that
    did not finish is redone; concurrent sessions wait for each other on a lock file.
    """
    site = sysconfig.get_paths()["purelib"]
    key = hashlib.sha256(TOOLKIT_REQUIREMENTS.read_bytes() + sys.version.encode() + site.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainboard-test"
    venv = cache / f"sagemaker-toolkit-{key}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "trainboard-complete").is_file():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
            python = str(venv / "bin" / "python")
            pip = subprocess.run([python, "-m", "pip", "install", "-q", "-r", str(TOOLKIT_REQUIREMENTS)],
                                 capture_output=True, text=True, timeout=900)
            assert pip.returncode == 0, f"pip install -r {TOOLKIT_REQUIREMENTS} failed:\n{pip.stderr[-3000:]}"
            own_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                      capture_output=True, text=True, check=True).stdout.strip()
            Path(own_site, "trainboard-project-site.pth").write_text(site + "\n")
            (venv / "trainboard-complete").write_text(TOOLKIT_REQUIREMENTS.read_text())
    return venv / "bin" / "train"


@pytest.fixture
def moto_server() -> Iterator[str]:
    """moto's AWS as a server on a free loopback port (processes of their own reach it), with the
    bucket ``BUCKET``; its URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        boto3.client("s3", region_name="us-east-1", endpoint_url=url).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        server.stop()
