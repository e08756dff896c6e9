"""A Kubernetes job's files live on the volume its pods mount at the output path, which the API
server cannot read: the adapter lists none and says where they are, opens none, and gives the path
a later pod on that volume reads."""

from __future__ import annotations

import pytest

from cloud_adapters.base import InvalidSpec, JobHandle, ProviderError
from cloud_adapters.kubernetes import KubernetesBackend


@pytest.fixture
def backend(tmp_path):
    return KubernetesBackend({"kubeconfig": str(tmp_path / "kubeconfig"), "image": "ghcr.io/acme/trainer:1",
                              "allowed_images": "ghcr.io/acme/*", "output_path": "/mnt/shared/out/"})


def test_lists_nothing_and_says_where_the_files_are(backend):
    handle = JobHandle("kubernetes", "tb-job-12-aa", "tb-job-12-aa", extra={"namespace": "default"})
    with pytest.raises(ProviderError) as exc:
        backend.artifacts(handle)
    assert str(exc.value) == (
        "a Kubernetes job's files are not reachable from the dashboard: its model and checkpoints are in "
        "/mnt/shared/out/tb-job-12-aa/ inside its pods, on the volume the runtime mounts there; read them from "
        "that volume (a pod that mounts it, or the storage behind it).")
    with pytest.raises(InvalidSpec, match="has no artifact 'model.pt': a Kubernetes job's files are not reachable"):
        backend.open_artifact(handle, "model.pt")
    assert backend.artifact_url(handle, "model.pt") is None
    assert backend.artifact_uri(handle, "checkpoints/last.pt") == "/mnt/shared/out/tb-job-12-aa/checkpoints/last.pt"
    assert backend.artifact_uri(handle, "../other/model.pt") == ""
