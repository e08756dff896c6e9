"""Who may call the provider for a job without a handle (jobs.lifecycle.submission_claim): the first
attempt, its own Celery retry (the claim travels in the retry's kwargs), the sweep once the lease
expired; a redelivered message within the lease does nothing. A job cancelled while its submission
was lost is adopted (or created) by name and stopped, never leaked."""

from __future__ import annotations

import datetime as dt
from unittest import mock

import pytest
from django.utils import timezone

from jobs import dispatch, lifecycle, recovery, services, sync, tasks
from jobs.models import JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


@pytest.fixture
def job(user, digits_dataset, cnn_model, fault_backend) -> TrainingJob:
    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=fault_backend)


def test_a_retry_keeps_the_claim_and_a_redelivery_within_the_lease_does_nothing(provider, job):
    provider.control(throttle_share=1.0, seed=3)  # every call throttled
    with mock.patch.object(tasks.submit_job, "retry", side_effect=RuntimeError("retry scheduled")) as retry:
        with pytest.raises(RuntimeError, match="retry scheduled"):
            tasks.submit_job(job.pk)
    job = _reload(job)
    assert job.state == S.SUBMITTING and job.provider_handle is None
    assert job.status_warning == "Submission retrying: faultcloud submit: rate exceeded"
    claim = retry.call_args.kwargs["kwargs"]["claim"]
    assert claim == job.state_entered_at.isoformat()
    assert retry.call_args.kwargs["args"] == [job.pk]

    provider.control(throttle_share=0)
    tasks.submit_job(job.pk)  # a redelivered copy, no claim, lease still running: hands off
    assert _reload(job).state == S.SUBMITTING and provider.count(job.provider_job_name) == 0
    assert recovery.resume_stuck_submissions() == []  # nor does the sweep take it within the lease
    tasks.submit_job(job.pk, claim=claim)  # the retry
    job = _reload(job)
    assert job.state == S.PENDING and provider.count(job.provider_job_name) == 1
    tasks.submit_job(job.pk, claim=claim)  # the same retry delivered again
    assert provider.count(job.provider_job_name) == 1


def test_cancelled_while_the_submission_was_lost_is_adopted_and_stopped(provider, fault_backend, job,
                                                                       django_capture_on_commit_callbacks):
    TrainingJob.objects.filter(pk=job.pk).update(state=S.SUBMITTING, submitted_at=timezone.now())
    started = provider.create(job.provider_job_name, {"trainboard-job-id": str(job.pk)})  # then the worker died
    with sent_tasks(dispatch.CANCEL_JOB) as send_cancel, \
            django_capture_on_commit_callbacks(execute=True):
        services.training_job_cancel(job=_reload(job), reason="enough")
    tasks.cancel_job(job.pk)  # no handle yet: nothing it can stop
    assert _reload(job).state == S.STOPPING and provider.get(started["id"])["state"] == "RUNNING"

    TrainingJob.objects.filter(pk=job.pk).update(
        state_entered_at=timezone.now() - dt.timedelta(seconds=lifecycle.submit_lease_s() + 1))
    with sent_tasks(dispatch.SUBMIT_JOB) as send, \
            django_capture_on_commit_callbacks(execute=True):
        assert recovery.resume_stuck_submissions() == [job.pk]
    tasks.submit_job(*send.call_args.kwargs["args"], **send.call_args.kwargs["kwargs"])
    job = _reload(job)
    assert job.state == S.STOPPING
    assert job.provider_handle["provider_job_id"] == started["id"]  # adopted by name
    assert provider.cancel_effects() == [started["id"]]
    sync.backend_sync(backend_id=fault_backend.pk)
    job = _reload(job)
    assert job.state == S.CANCELLED and job.failure_reason == "enough"
    assert provider.count(job.provider_job_name) == 1
    send_cancel.assert_called_once()
