"""jobs.orphans against moto's SageMaker stand-in and a real gpubox: a provider job whose row was
deleted or went terminal is listed once as an orphan, stopped on request (provider state asserted),
stopped by the sweep under policy "stop", resolved once it ended; a job with an active row is never
listed; two reconcilers at once make one row per job and send one stop."""

from __future__ import annotations

import threading
import time

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connection

from adapter_standins import standin
from cloud_adapters.base import JobHandle, JobState
from jobs import adapters, orphans
from jobs.models import JobStateChoices as S, OrphanJob, TrainingJob

sagemaker_standin = standin("sagemaker")


def _three_sagemaker_jobs(launch, sm_backend):
    """Three running SageMaker jobs: one whose row is deleted, one whose row went FAILED, one active."""
    deleted, failed, active = launch(sm_backend), launch(sm_backend), launch(sm_backend)
    for job in (deleted, failed, active):
        sagemaker_standin.set_status(job.provider_job_name, "InProgress", "Training")
    deleted_id, deleted_name = deleted.pk, deleted.provider_job_name
    TrainingJob.objects.filter(pk=deleted.pk).delete()
    TrainingJob.objects.filter(pk=failed.pk).update(state=S.FAILED, failure_reason="lost track")
    return (deleted_id, deleted_name), failed, active


@pytest.mark.django_db
def test_sagemaker_orphans_listed_once_stopped_on_request_then_resolved(aws, sm_backend, launch, user, non_staff):
    (deleted_id, deleted_name), failed, active = _three_sagemaker_jobs(launch, sm_backend)

    first = orphans.reconcile_orphans(sm_backend.pk)
    second = orphans.reconcile_orphans(sm_backend.pk)

    assert first == {"listed": 3, "open": 2, "resolved": 0, "stopped": 0}
    assert second == first
    rows = {o.provider_job_name: o for o in OrphanJob.objects.filter(backend=sm_backend)}
    assert sorted(rows) == sorted([deleted_name, failed.provider_job_name])
    assert active.provider_job_name not in rows
    assert rows[deleted_name].job_id == deleted_id and rows[failed.provider_job_name].job_id == failed.pk
    assert rows[deleted_name].raw_state == "InProgress"
    assert rows[deleted_name].stop_requested_at is None  # policy "report": listed, not stopped
    assert sagemaker_standin.status(deleted_name) == "InProgress"

    with pytest.raises(PermissionDenied):
        orphans.orphan_stop(rows[deleted_name], non_staff)
    assert sagemaker_standin.status(deleted_name) == "InProgress"

    stopped = orphans.orphan_stop(rows[deleted_name], user)

    assert sagemaker_standin.status(deleted_name) == "Stopping"
    assert stopped.stop_requested_at is not None and stopped.stop_requested_by == user
    assert sagemaker_standin.status(failed.provider_job_name) == "InProgress"
    assert sagemaker_standin.status(active.provider_job_name) == "InProgress"

    sagemaker_standin.set_status(deleted_name, "Stopped", "Stopped")
    third = orphans.reconcile_orphans(sm_backend.pk)

    assert third == {"listed": 2, "open": 1, "resolved": 1, "stopped": 0}
    gone = OrphanJob.objects.get(backend=sm_backend, provider_job_name=deleted_name)
    assert gone.resolved_at is not None
    with pytest.raises(ValidationError, match="already ended"):
        orphans.orphan_stop(gone, user)


@pytest.mark.django_db
def test_sagemaker_policy_stop_stops_orphans_in_the_sweep_once(aws, sm_backend, launch):
    (_, deleted_name), failed, active = _three_sagemaker_jobs(launch, sm_backend)
    sm_backend.orphan_policy = "stop"
    sm_backend.save(update_fields=["orphan_policy"])

    first = orphans.reconcile_orphans(sm_backend.pk)
    second = orphans.reconcile_orphans(sm_backend.pk)

    assert first["stopped"] == 2 and second["stopped"] == 0
    assert sagemaker_standin.status(deleted_name) == "Stopping"
    assert sagemaker_standin.status(failed.provider_job_name) == "Stopping"
    assert sagemaker_standin.status(active.provider_job_name) == "InProgress"  # an active row: never touched
    rows = OrphanJob.objects.filter(backend=sm_backend)
    assert rows.count() == 2
    assert all(o.stop_requested_at is not None and o.stop_requested_by is None for o in rows)
    assert {o.raw_state for o in rows} == {"Stopping"}


@pytest.mark.django_db(transaction=True)
def test_two_reconcilers_at_once_make_one_row_and_one_stop(aws, sm_backend, launch, monkeypatch):
    (_, deleted_name), failed, _active = _three_sagemaker_jobs(launch, sm_backend)
    sm_backend.orphan_policy = "stop"
    sm_backend.save(update_fields=["orphan_policy"])
    stops: list[str] = []
    real_stop = sagemaker_standin.stop_training_job

    def counting_stop(self):
        stops.append(self._get_param("TrainingJobName"))
        return real_stop(self)

    monkeypatch.setattr(sagemaker_standin.SageMakerResponse, "stop_training_job", counting_stop, raising=False)
    barrier = threading.Barrier(2)
    results, errors = [], []

    def run():
        try:
            barrier.wait(timeout=10)
            results.append(orphans.reconcile_orphans(sm_backend.pk))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)

    assert errors == []
    assert len(results) == 2
    assert OrphanJob.objects.filter(backend=sm_backend).count() == 2
    assert sorted(stops) == sorted([deleted_name, failed.provider_job_name])  # each stopped exactly once
    assert sum(r["stopped"] for r in results) == 2


def _wait_state(adapter, name: str, run_root, state: JobState, timeout: float = 60) -> None:
    handle = JobHandle(provider="gpubox", job_name=name, provider_job_id=str(run_root / name))
    deadline = time.monotonic() + timeout
    while (status := adapter.describe(handle)).state != state:
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


@pytest.mark.django_db
def test_gpubox_orphan_of_a_deleted_row_is_stopped_on_request(local_backend, launch, run_root, user):
    kept, lost = launch(local_backend), launch(local_backend)
    adapter = adapters.backend_adapter(local_backend)
    try:
        TrainingJob.objects.filter(pk=lost.pk).delete()

        result = orphans.reconcile_orphans(local_backend.pk)

        assert result == {"listed": 2, "open": 1, "resolved": 0, "stopped": 0}
        orphan = OrphanJob.objects.get(backend=local_backend)
        assert (orphan.provider_job_name, orphan.job_id) == (lost.provider_job_name, lost.pk)
        assert orphan.raw_state in ("spawned", "running", "submitting")

        orphans.orphan_stop(orphan, user)

        assert (run_root / lost.provider_job_name / "cancel_requested").exists()
        _wait_state(adapter, lost.provider_job_name, run_root, JobState.CANCELLED)
        assert orphans.reconcile_orphans(local_backend.pk) == {"listed": 1, "open": 0, "resolved": 1, "stopped": 0}
        assert not (run_root / kept.provider_job_name / "cancel_requested").exists()
    finally:
        for job in (kept, lost):
            adapter.cancel(JobHandle.from_dict(job.provider_handle))
        for job in (kept, lost):
            _wait_state(adapter, job.provider_job_name, run_root, JobState.CANCELLED)
