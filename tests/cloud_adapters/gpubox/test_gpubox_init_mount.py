"""A GPU box job in a container sees the file its ``train.init_from`` names (a continued job's
source checkpoint), read-only, at the same path; never a symbolic link."""

from __future__ import annotations

import os

from cloud_adapters.gpubox.backend import GpuBoxBackend


def test_the_source_checkpoint_is_mounted_read_only_and_a_link_is_not(tmp_path):
    run_dir, trainer = tmp_path / "runs" / "tb-job-2", tmp_path / "trainer"
    source = tmp_path / "runs" / "tb-job-1" / "output" / "checkpoints" / "last.pt"
    source.parent.mkdir(parents=True)
    source.write_bytes(b"checkpoint")
    config = {"train": {"init_from": str(source), "init_mode": "continue"}}
    mounts = GpuBoxBackend._container_mounts(config, run_dir, trainer, None)
    assert mounts == [(str(run_dir), False), (str(trainer), True), (str(source), True)]

    link = tmp_path / "link.pt"
    os.symlink(source, link)
    linked = GpuBoxBackend._container_mounts({"train": {"init_from": str(link)}}, run_dir, trainer, None)
    assert linked == [(str(run_dir), False), (str(trainer), True)]
    remote = GpuBoxBackend._container_mounts({"train": {"init_from": "s3://b/last.pt"}}, run_dir, trainer, None)
    assert remote == [(str(run_dir), False), (str(trainer), True)]
