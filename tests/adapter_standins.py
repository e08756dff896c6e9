"""The cloud adapter tests' provider stand-ins (tests/cloud_adapters/<cloud>/standin.py: sagemaker,
vertex, azureml) for tests in other folders, and the loopback servers that go with them: a free port,
gcp-storage-emulator, Azurite."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

ADAPTER_TESTS = Path(__file__).resolve().parent / "cloud_adapters"
AZURITE = ADAPTER_TESTS.parents[1] / "node_modules" / ".bin" / "azurite-blob"


def standin(cloud: str):
    """tests/cloud_adapters/``cloud``/standin.py as the module ``<cloud>_standin`` (every cloud's
    file is standin.py: each gets a name of its own), loaded once."""
    name = f"{cloud}_standin"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ADAPTER_TESTS / cloud / "standin.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gcs_emulator(bucket: str = "stage") -> Iterator[str]:
    """gcp-storage-emulator in memory on a free loopback port, with the bucket ``bucket``; its URL."""
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@contextlib.contextmanager
def vertex_with_gcs(monkeypatch, tmp_path: Path) -> Iterator[tuple]:
    """``(Vertex stand-in, Cloud Storage emulator URL)``, both on loopback, with no ambient Google
    configuration (credentials, project, gcloud's directory, the metadata server's check) in the way."""
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    server = standin("vertex").VertexStandIn().start()
    try:
        with gcs_emulator() as gcs_url:
            yield server, gcs_url
    finally:
        server.stop()


def azureml_workspace_in_registry(monkeypatch, blob, **workspace_options):
    """An in-memory Azure ML workspace (the azureml stand-in, its code uploads to ``blob``) that every
    Azure ML adapter the services build talks to, through the stand-in transport with a fake
    credential (the only thing a stored config cannot say), its datastores' files (artifacts) on
    ``blob``'s Blob service; no ambient Azure ML configuration."""
    from cloud_adapters import registry

    for name in ("AZUREML_CURRENT_CLOUD", "ARM_CLOUD_METADATA_URL", "AZURE_ML_CLI_PRIVATE_FEATURES_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    azureml = standin("azureml")
    workspace = azureml.AzureMLStandin(blob=blob, **workspace_options)
    original = registry.create_backend

    def create_backend(kind, config=None, *, secrets=None, prices=None):
        if kind != "azureml":
            return original(kind, config, secrets=secrets, prices=prices)
        return registry.backend_class(kind)(config, secrets=secrets, prices=prices,
                                            credential=azureml.FakeCredential(),
                                            transport=azureml.StandinTransport(workspace),
                                            blob_account_url=blob.url)

    monkeypatch.setattr(registry, "create_backend", create_backend)
    return workspace


@contextlib.contextmanager
def azurite_blob(location: Path) -> Iterator:
    """Azurite's Blob service (npm, a devDependency) on a free loopback port, its data in
    ``location``: yields the azureml stand-in's ``BlobAccount``. The process is stopped by its id."""
    import pytest

    if not AZURITE.exists():
        pytest.fail(f"{AZURITE} is missing: run `npm ci` (Azurite is a devDependency in package.json).")
    if shutil.which("node") is None:
        pytest.fail("node is not on PATH; Azurite (npm) needs Node.js.")
    port = free_port()
    log = open(location / "azurite.out", "wb")
    proc = subprocess.Popen([str(AZURITE), "--silent", "--skipApiVersionCheck", "--location", str(location),
                             "--blobHost", "127.0.0.1", "--blobPort", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"Azurite did not listen on 127.0.0.1:{port}: "
                                f"{(location / 'azurite.out').read_text(errors='replace')[-2000:]}")
                time.sleep(0.1)
        azureml = standin("azureml")
        yield azureml.BlobAccount(f"http://127.0.0.1:{port}/{azureml.AZURITE_ACCOUNT}")
    finally:
        # Azurite's graceful stop waits for the clients' idle keep-alive connections (10 s and more);
        # its data is this test's and need not be saved, so it gets 2 s before SIGKILL.
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
