"""Fixtures for the Azure ML adapter tests: the real ``MLClient`` over the in-memory stand-in
(standin.py, a custom azure-core transport: clouds.md §3.5), a real Blob service (Azurite from
npm, started once per session on a free 127.0.0.1 port), a fake credential and a simulated clock.

No request leaves the machine: ARM, run history and log reads are answered in-process; the code
upload goes to Azurite on loopback. No database: these are adapter-level tests.

The stand-in module is registered as ``azureml_standin`` (not ``standin``) so that another
provider's test helper of the same file name cannot shadow it on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

from cloud_adapters import retry

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def _load_standin():
    spec = importlib.util.spec_from_file_location("azureml_standin", HERE / "standin.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["azureml_standin"] = module
    spec.loader.exec_module(module)
    return module


standin = sys.modules.get("azureml_standin") or _load_standin()


FakeClock = standin.FakeClock


@pytest.fixture(autouse=True)
def fresh_limits(monkeypatch):
    """Fresh rate limits per test, and no Azure settings from the environment."""
    for name in ("AZUREML_CURRENT_CLOUD", "ARM_CLOUD_METADATA_URL", "AZURE_ML_CLI_PRIVATE_FEATURES_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    retry.reset_limiters()
    yield
    retry.reset_limiters()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    """Azurite's Blob service on a free loopback port for the session: a :class:`BlobAccount`."""
    from adapter_standins import azurite_blob

    with azurite_blob(tmp_path_factory.mktemp("azurite")) as account:
        yield account


@pytest.fixture
def workspace(azurite):
    """A fresh stand-in workspace whose code uploads go to Azurite."""
    return standin.AzureMLStandin(blob=azurite)
