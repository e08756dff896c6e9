"""The idle policy with real processes (docs/idle.md, issue 30): a GPU-box job (supervisor + torchrun,
the trainer stand-in held at step 2: its loop no longer steps) whose launcher reads its GPU through the
NVML stand-in (tests/standins/fake_nvml: GPU 0 busy 10 % of the time) on a backend whose idle policy
is ``stop`` below 20 % for 1 minute. The launcher's own samples (every 5 s, by its clock) reach the
sync through the box's log; once its GPU has been below the threshold for a minute, the sync stops the
job with the reason and what stopping saves, the box sends SIGTERM, the stand-in writes its checkpoint
(``last.pt`` at step 2) and a ``stopped`` record, and the job ends CANCELLED with that reason.

It takes the minute of samples the policy needs (the backend's least ``idle_minutes``): the samples'
times are the launcher's clock, which the test does not move."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

from jobs import dispatch, lifecycle, services
from jobs.models import ComputeBackend, JobEvent, JobStateChoices as S
from polling import wait_for
from test_sync import synced_into

pytestmark = [pytest.mark.django_db, pytest.mark.slow]  # a minute of samples: started first


@pytest.fixture
def box(user, run_root, settings, trainer_standin):
    settings.TRAINBOARD_RUN_ROOT = run_root
    settings.TRAINBOARD_GPUBOX_PYTHON = trainer_standin.python
    trainer_standin.fake_nvml()
    backend = services.backend_create(owner=user, name="box", kind="gpubox",
                                      config={"hourly_rate_usd": 3.6, "grace_period_s": 5.0})
    ComputeBackend.objects.filter(pk=backend.pk).update(idle_policy=ComputeBackend.IdlePolicy.STOP,
                                                        idle_gpu_util_pct=20, idle_minutes=1)
    backend.refresh_from_db()
    return backend


def test_a_gpubox_job_whose_gpu_idles_is_checkpointed_and_stopped_with_the_reason(
        user, digits_dataset, cnn_model, box, run_root, trainer_standin, monkeypatch):
    monkeypatch.setattr(dispatch, "send_submit", lambda job_id, queue: None)
    trainer_standin.hold(steps=2)
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=box,
                                       epochs=1, max_runtime_s=3600)
    assert job.hourly_price_usd == Decimal("3.6")
    lifecycle.training_job_submit(job=job)
    job.refresh_from_db()
    run_dir = Path(run_root) / job.provider_job_name
    trainer_standin.wait_at(2, run_dir)

    # Synced every 2 s while the samples pile up; the sync that reads a minute of them stops the job.
    wait_for(lambda: synced_into(job, S.STOPPING, S.CANCELLED, S.FAILED, S.SUCCEEDED), timeout=150, interval=2.0,
             what="the idle policy to stop the job")
    assert job.state == S.STOPPING, (job.state, job.failure_reason)
    # GPU 0 of the NVML stand-in (the job's one rank, no CUDA_VISIBLE_DEVICES on a CPU box) at 10 %.
    assert job.idle["gpus"] == {"0": job.idle["since"]} and job.idle["threshold_pct"] == 20
    assert job.idle["last"] - job.idle["since"] >= 60
    match = re.fullmatch(r"Idle: the GPU below 20% for 1 min; stopping it saves \$(\d+\.\d+) \((\d+) s left of "
                         r"its max runtime × 1 node × \$3\.60/h = \$(\d+\.\d+)\)", job.idle_reason)
    assert match, job.idle_reason
    saved, left_s, again = Decimal(match[1]), int(match[2]), Decimal(match[3])
    # What stopping saves: the seconds left (shown whole) × 1 instance × $3.60/h, $0.001 a second.
    assert saved == again == job.idle_saved_usd
    assert abs(saved - Decimal(left_s) / 1000) <= Decimal("0.0005") and 3000 < left_s < 3600
    assert job.failure_reason == f"Stopped: {job.idle_reason}"
    assert JobEvent.objects.filter(job=job, message=job.idle_reason).count() == 1

    # The box stops the run: the stand-in checkpoints where it was held, and the job ends with the reason.
    wait_for(lambda: synced_into(job, S.CANCELLED, S.FAILED, S.SUCCEEDED), timeout=60, what="the stop confirmed")
    assert job.state == S.CANCELLED and job.failure_reason == f"Stopped: {job.idle_reason}"
    assert json.loads((run_dir / "output" / "checkpoints" / "last.pt").read_text())["step"] == 2
    log = (run_dir / "train.log").read_text()
    records = [json.loads(line.split("TRAINBOARD_METRIC ", 1)[1]) for line in log.splitlines()
               if "TRAINBOARD_METRIC " in line]
    assert [r["step"] for r in records if r["event"] == "stopped"] == [2]
    samples = [r for r in records if r["event"] == "hardware"]
    assert samples and all(r["gpu_ranks"] == [0] and r["sys/gpu_util_pct"] == [10.0] for r in samples)
