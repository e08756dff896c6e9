"""GpuBoxBackend.list_tagged on real run directories: a job submitted through the adapter (real
supervisor; torchrun and trainer the trainer stand-in's, held before its first step) is listed with its tagged job id while it runs and no longer once cancel()
stopped it; a run directory without Trainboard's tags.json and a tagged job that exited are not."""

from __future__ import annotations

import json
import time

import pytest

from cloud_adapters.base import JobSpec, JobState
from cloud_adapters.gpubox import GpuBoxBackend, _proc


@pytest.fixture
def backend(tmp_path, trainer_standin):
    trainer_standin.hold(steps=0)  # it runs until cancel() stops it
    return GpuBoxBackend({"run_root": str(tmp_path / "runs"), "grace_period_s": 5, "python": trainer_standin.python})


def test_running_tagged_job_is_listed_until_cancelled(backend, tmp_path):
    config = {"train": {"epochs": 1, "log_every_steps": 1}}
    handle = backend.submit(JobSpec(job_name="tb-job-77-abc", config=config,
                                    tags={"trainboard-job-id": "77", "trainboard-owner-id": "1"}))
    try:
        # Not Trainboard's: a directory somebody made by hand in the run root.
        (tmp_path / "runs" / "scratch").mkdir()
        # A tagged job that already ended.
        done = tmp_path / "runs" / "tb-job-78-def"
        done.mkdir()
        _proc.write_json_atomic(done / "tags.json", {"trainboard-job-name": "tb-job-78-def",
                                                     "trainboard-job-id": "78"})
        _proc.write_json_atomic(done / "exit.json", {"returncode": 0, "started_at": time.time() - 5,
                                                     "ended_at": time.time(), "cancelled": False})
        assert json.loads((tmp_path / "runs" / "tb-job-77-abc" / "tags.json").read_text()) == {
            "trainboard-job-name": "tb-job-77-abc", "trainboard-job-id": "77", "trainboard-owner-id": "1"}

        listed = backend.list_tagged()

        assert [(p.name, p.job_id) for p in listed] == [("tb-job-77-abc", 77)]
        assert listed[0].state in (JobState.PENDING, JobState.RUNNING)
        assert listed[0].handle == handle
        backend.cancel(listed[0].handle)
        deadline = time.monotonic() + 30
        while backend.describe(handle).state != JobState.CANCELLED:
            assert time.monotonic() < deadline, backend.describe(handle)
            time.sleep(0.2)
        assert backend.list_tagged() == []
    finally:
        backend.cancel(handle)
        deadline = time.monotonic() + 30
        while not backend.describe(handle).state.is_terminal and time.monotonic() < deadline:
            time.sleep(0.2)
