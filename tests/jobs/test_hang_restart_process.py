"""Restart-on-hang with real processes (docs/hangs.md, issue 30): a GPU-box job (supervisor + torchrun,
the trainer stand-in held at step 3, so it stops stepping however fast the machine) on a backend whose
hang policy is ``restart``. The recovery sweep finds it silent past the backend's 60 s deadline (its
``now`` given, so nothing waits a minute); the stop goes to the box (SIGTERM: the stand-in writes
``last.pt`` at step 3 and exits as the trainer does); once the box reports the run cancelled, the sync
resubmits the job as attempt 2 from the first run's checkpoint directory, and the second run resumes
there (its ``started`` record says ``resumed``) and finishes."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from jobs import dispatch, lifecycle, recovery, services
from jobs.models import ComputeBackend, JobAttempt, JobStateChoices as S
from polling import wait_for
from test_sync import synced_into

pytestmark = pytest.mark.django_db


@pytest.fixture
def box(user, run_root, settings, trainer_standin):
    settings.TRAINBOARD_RUN_ROOT = run_root
    settings.TRAINBOARD_GPUBOX_PYTHON = trainer_standin.python
    backend = services.backend_create(owner=user, name="box", kind="gpubox", config={"grace_period_s": 5.0})
    ComputeBackend.objects.filter(pk=backend.pk).update(hang_policy=ComputeBackend.HangPolicy.RESTART,
                                                        hang_deadline_s=60, max_restarts=1)
    backend.refresh_from_db()
    return backend


def test_a_hung_gpubox_run_is_stopped_and_restarted_from_its_checkpoint(
        user, digits_dataset, cnn_model, box, run_root, trainer_standin, monkeypatch):
    monkeypatch.setattr(dispatch, "send_submit", lambda job_id, queue: None)
    trainer_standin.hold(steps=3)
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=box,
                                       epochs=1, max_runtime_s=600)
    lifecycle.training_job_submit(job=job)
    job.refresh_from_db()
    first = Path(run_root) / job.provider_job_name
    trainer_standin.wait_at(3, first)
    wait_for(lambda: synced_into(job, S.RUNNING) and job.progress_at is not None, timeout=60,
             what="the held run RUNNING with its first record read")

    # Silent for more than the backend's 60 s: flagged, and stopped to be restarted.
    assert recovery.flag_hung_jobs(now=job.progress_at + dt.timedelta(seconds=61)) == [job.pk]
    job.refresh_from_db()
    assert job.state == S.STOPPING and job.hang_restart_at is not None
    assert job.events.last().message.startswith("Restarting: hung. No new step for 60 s after step ")

    # The box stops the run (the next sync re-sends the cancel: SIGTERM), the stand-in checkpoints
    # step 3, and the confirmed stop resubmits the job from that checkpoint.
    wait_for(lambda: synced_into(job, S.QUEUED, S.CANCELLED, S.FAILED), timeout=60, what="the stop confirmed")
    assert job.state == S.QUEUED and job.attempt == 2, (job.state, job.failure_reason)
    checkpoints = first / "output" / "checkpoints"
    assert job.checkpoint_uri == str(checkpoints)
    assert json.loads((checkpoints / "last.pt").read_text())["step"] == 3
    (closed,) = JobAttempt.objects.filter(job=job)
    assert (closed.outcome, closed.provider_job_name, closed.checkpoint_uri) == ("hung", first.name, str(checkpoints))
    assert job.events.last().message.startswith("hung (No new step for 60 s after step ")

    # Attempt 2 resumes at step 3 and runs to its end.
    trainer_standin.release()
    lifecycle.training_job_submit(job=job)
    job.refresh_from_db()
    assert job.provider_job_name == f"{first.name}-a2"
    wait_for(lambda: synced_into(job, S.SUCCEEDED, S.FAILED, S.CANCELLED), timeout=90, what="attempt 2 to end")
    assert job.state == S.SUCCEEDED and job.attempt == 2, job.failure_reason
    log = (Path(run_root) / job.provider_job_name / "train.log").read_text()
    started = [json.loads(line.split("TRAINBOARD_METRIC ", 1)[1]) for line in log.splitlines()
               if "TRAINBOARD_METRIC " in line and '"event":"started"' in line]
    assert [(r.get("resumed", False), r["step"]) for r in started] == [(True, 4)]
