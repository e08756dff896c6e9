"""One gpubox run directory that has gone missing fails that job alone; the backend's other jobs
sync in the same pass. A missing run root is no verdict on any job."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from jobs import dispatch, services, sync, tasks
from jobs.models import JobStateChoices as S, TrainingJob
from jobs.states import transition
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db


def _pending_job(owner, dataset, model, backend, name: str) -> TrainingJob:
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=owner, dataset=dataset, model_spec=model, backend=backend,
                                           procs_per_node=1, name=name)
    transition(job, S.SUBMITTING, message="test")
    transition(job, S.PENDING, message="test")
    TrainingJob.objects.filter(pk=job.pk).update(
        provider_handle={"provider": "gpubox", "job_name": job.provider_job_name})
    return TrainingJob.objects.get(pk=job.pk)


def _finished_run(run_dir, returncode: int = 0) -> None:
    run_dir.mkdir()
    started = time.time() - 60
    (run_dir / "supervisor.json").write_text(json.dumps({"pid": 999999999, "started_at": started}))
    (run_dir / "exit.json").write_text(json.dumps({"returncode": returncode, "started_at": started,
                                                   "ended_at": started + 30}))
    (run_dir / "train.log").write_text("hello from rank 0\n")


def test_a_lost_run_directory_fails_its_job_and_the_others_still_sync(user, digits_dataset, cnn_model,
                                                                      local_backend, run_root):
    lost = _pending_job(user, digits_dataset, cnn_model, local_backend, "lost")
    fine = _pending_job(user, digits_dataset, cnn_model, local_backend, "fine")
    _finished_run(run_root / lost.provider_job_name)
    _finished_run(run_root / fine.provider_job_name)
    shutil.rmtree(run_root / lost.provider_job_name)  # someone cleaned the disk under a live job

    assert sync.backend_sync(backend_id=local_backend.pk) == 2
    lost.refresh_from_db()
    fine.refresh_from_db()
    assert fine.state == S.SUCCEEDED
    assert lost.state == S.FAILED
    assert lost.failure_reason.startswith(f"run directory lost: {run_root / lost.provider_job_name} no longer exists")
    assert lost.events.last().to_state == S.FAILED


def test_a_missing_run_root_judges_no_job(user, digits_dataset, cnn_model, local_backend, run_root):
    job = _pending_job(user, digits_dataset, cnn_model, local_backend, "waiting")
    shutil.rmtree(run_root)  # the disk is not mounted (or this is not the box)
    assert tasks.sync_backend(local_backend.pk) == 0  # skipped: "sync skipped", the next beat retries
    job.refresh_from_db()
    assert job.state == S.PENDING
