"""The GPU box's artifacts: the run directory's files by name, never a symbolic link."""

from __future__ import annotations

import os

import pytest

from cloud_adapters.base import InvalidSpec, JobHandle, ProviderError
from cloud_adapters.gpubox.backend import GpuBoxBackend


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "tb-job-1"
    (run / "output" / "checkpoints").mkdir(parents=True)
    (run / "output" / "model.pt").write_bytes(b"m" * 10)
    (run / "output" / "metrics.jsonl").write_text('{"event": "step"}\n')
    (run / "output" / "checkpoints" / "last.pt").write_bytes(b"c" * 5)
    (run / "train.log").write_text("line\n")
    return run


def _box(run_dir):
    return GpuBoxBackend({"run_root": str(run_dir.parent)}), JobHandle("gpubox", run_dir.name, str(run_dir))


def test_lists_output_checkpoint_and_log_by_name_with_sizes(run_dir):
    box, handle = _box(run_dir)
    found = {a.name: (a.kind, a.size_bytes) for a in box.artifacts(handle)}
    assert found == {"checkpoints/last.pt": ("checkpoint", 5), "logs/train.log": ("log", 5),
                     "metrics.jsonl": ("metrics", 18), "model.pt": ("model", 10)}


def test_opens_an_artifact_and_gives_its_path(run_dir):
    box, handle = _box(run_dir)
    with box.open_artifact(handle, "checkpoints/last.pt") as stream:
        assert stream.read() == b"ccccc"
    assert box.artifact_uri(handle, "model.pt") == str(run_dir / "output" / "model.pt")


def test_a_symbolic_link_in_the_output_is_neither_listed_nor_opened(run_dir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host file")
    os.symlink(secret, run_dir / "output" / "evil")
    os.symlink(tmp_path, run_dir / "output" / "evil-dir")
    box, handle = _box(run_dir)
    names = [a.name for a in box.artifacts(handle)]
    assert not any(name.startswith("evil") for name in names)
    with pytest.raises(InvalidSpec, match="no artifact 'evil'"):
        box.open_artifact(handle, "evil")
    with pytest.raises(InvalidSpec):
        box.open_artifact(handle, "../secret.txt")


def test_a_removed_run_directory_says_the_files_are_gone(run_dir):
    box, handle = _box(run_dir)
    for path in sorted(run_dir.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    run_dir.rmdir()
    with pytest.raises(ProviderError, match="no longer exists"):
        box.artifacts(handle)
