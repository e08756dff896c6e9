"""Fixtures for the SageMaker adapter tests: fake AWS credentials (no request leaves the machine:
moto's ``mock_aws`` answers in-process and botocore's Stubber answers before sending), a simulated
clock for retries and the rate limit; for the toolkit test, SageMaker's training toolkit in a
virtualenv of its own and moto as a loopback server.

The stand-in and its helpers (standin.py) are registered here as the module ``sagemaker_standin``
(not ``standin``), so that another provider's stand-in of the same file name cannot shadow it on
``sys.path``; the tests import what they need from ``sagemaker_standin``.

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

import pytest

from adapter_standins import standin
from cloud_adapters import retry

sagemaker_standin = standin("sagemaker")
FakeClock = sagemaker_standin.FakeClock


@pytest.fixture(autouse=True)
def fake_aws_credentials(monkeypatch, tmp_path):
    """Fake credentials for the default chain; no profile, no shared config, no instance metadata;
    fresh rate limiters."""
    sagemaker_standin.fake_aws_env(monkeypatch, tmp_path)
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
    ``$XDG_CACHE_HOME/trainboard-test`` (default ~/.cache) and reused after that, by every checkout
    (a fresh clone's CI run included: the key is what it holds, not where the project's venv is).

    torch comes from this test run's environment through a ``.pth`` written after pip has resolved the
    toolkit's own dependencies, so pip neither sees nor changes the project's packages; it is rewritten
    on each use to name the site-packages of the checkout that runs the tests. A build that did not
    finish is redone; concurrent sessions wait for each other on a lock file.
    """
    site = sysconfig.get_paths()["purelib"]
    key = hashlib.sha256(TOOLKIT_REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()[:16]
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
            (venv / "trainboard-complete").write_text(TOOLKIT_REQUIREMENTS.read_text())
        own_site = subprocess.run([str(venv / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip()
        pth = Path(own_site, "trainboard-project-site.pth")
        if not pth.is_file() or pth.read_text() != site + "\n":
            pth.write_text(site + "\n")
    return venv / "bin" / "train"


@pytest.fixture
def moto_server() -> Iterator[str]:
    """moto's AWS as a server on a free loopback port (processes of their own reach it), with the
    bucket ``BUCKET``; its URL."""
    with sagemaker_standin.moto_server() as url:
        yield url
