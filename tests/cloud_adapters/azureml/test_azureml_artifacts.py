"""Azure ML's artifacts: the job's outputs ``model`` and ``checkpoints`` in its datastore's Blob
container (a real Blob service, Azurite), found through the datastore the stand-in workspace
describes; listed by name, read in chunks, and a read-only SAS URL (signed with the datastore's
account key from listSecrets) that a plain HTTP GET downloads from Azurite with the same sha256."""

from __future__ import annotations

import hashlib
import random
import urllib.request

import pytest
from azure.core.exceptions import ResourceExistsError
from azureml_standin import SETTINGS, FakeCredential, FakeClock, StandinTransport

from cloud_adapters import retry
from cloud_adapters.azureml import AzureMLBackend
from cloud_adapters.base import InvalidSpec, JobHandle

MODEL = b"azure weights " * 500
CKPT = b"ck" * 321


@pytest.fixture
def job(workspace, azurite):
    workspace.add_job("tb-job-9-art", "Completed")
    service = azurite.service()
    try:
        service.create_container("azureml-blobstore")
    except ResourceExistsError:
        pass
    container = service.get_container_client("azureml-blobstore")
    container.upload_blob("azureml/tb-job-9-art/model/model.pt", MODEL, overwrite=True)
    container.upload_blob("azureml/tb-job-9-art/model/metrics.jsonl", b'{"epoch": 0}\n', overwrite=True)
    container.upload_blob("azureml/tb-job-9-art/checkpoints/last.pt", CKPT, overwrite=True)
    container.upload_blob("azureml/tb-job-9-art/other/stray.txt", b"not an output", overwrite=True)
    backend = AzureMLBackend(SETTINGS, credential=FakeCredential(), transport=StandinTransport(workspace),
                             retry_policy=retry.RetryPolicy(rng=random.Random(0)), clock=FakeClock(),
                             blob_account_url=azurite.url)
    return backend, JobHandle("azureml", "tb-job-9-art", extra={"azure_job_name": "tb-job-9-art"})


def test_lists_the_outputs_reads_them_and_signs_a_sas_url(job, azurite):
    backend, handle = job
    assert {a.name: (a.kind, a.size_bytes) for a in backend.artifacts(handle)} == {
        "model.pt": ("model", len(MODEL)), "metrics.jsonl": ("metrics", 13),
        "checkpoints/last.pt": ("checkpoint", len(CKPT))}
    with backend.open_artifact(handle, "checkpoints/last.pt") as stream:
        assert stream.read(100) + stream.read() == CKPT
    url = backend.artifact_url(handle, "model.pt", expires_s=240)
    assert url.startswith(f"{azurite.url}/azureml-blobstore/azureml/tb-job-9-art/model/model.pt?") and "sp=r" in url
    with urllib.request.urlopen(url, timeout=30) as answer:
        assert answer.headers["Content-Disposition"] == 'attachment; filename="model.pt"'
        assert hashlib.sha256(answer.read()).hexdigest() == hashlib.sha256(MODEL).hexdigest()
    assert backend.artifact_uri(handle, "model.pt") == \
        "azureml://datastores/workspaceblobstore/paths/azureml/tb-job-9-art/model/model.pt"
    with pytest.raises(InvalidSpec, match="no artifact"):
        backend.open_artifact(handle, "other/stray.txt")
    with pytest.raises(InvalidSpec, match="no artifact"):
        backend.artifact_url(handle, "checkpoints/../../other/stray.txt")
