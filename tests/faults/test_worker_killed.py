"""A worker SIGKILLed after its job went SUBMITTING, before or just after the provider call: a new
worker's recovery sweep (every 1 s here, submission lease 4 s) finishes the submission on exactly one
provider job, adopted by its deterministic name; or, past the resume limit, FAILs it with the reason.
Real Celery workers (prefork, embedded beat), Redis, PostgreSQL; the provider is the file-backed
``faultcloud`` stand-in shared by the test and the workers."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from faultkit import wait_for
from jobs import dispatch, lifecycle, recovery, services
from jobs.models import JobEvent, JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _create(user, digits_dataset, cnn_model, backend) -> TrainingJob:
    return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=backend)


@pytest.mark.parametrize("when", ["before", "after"])
def test_worker_sigkilled_mid_submit_recovers_on_one_provider_job(when, workers, provider, fault_backend, user,
                                                                  digits_dataset, cnn_model):
    provider.control(block_submit=when)
    provider.block()
    first = workers.start()
    job = _create(user, digits_dataset, cnn_model, fault_backend)
    name = job.provider_job_name
    wait_for(lambda: provider.entered(name), timeout=30, what="the submit to reach the provider call")
    assert _reload(job).state == S.SUBMITTING
    assert provider.count(name) == (1 if when == "after" else 0)
    created_before_kill = [r["id"] for r in provider.jobs(name)]

    first.kill()
    killed_at = timezone.now()
    provider.unblock()
    job = _reload(job)
    assert job.state == S.SUBMITTING and job.provider_handle is None  # what the killed worker left

    second = workers.start()
    job = wait_for(lambda: (j := _reload(job)).state in (S.PENDING, S.RUNNING) and j, timeout=60,
                   what=f"the job to leave SUBMITTING:\n{second.log()[-3000:]}")
    # Resumed once its 4 s lease had passed (one sweep interval later), on exactly one provider job.
    assert job.state_entered_at - job.submitted_at >= dt.timedelta(seconds=4)
    assert provider.count(name) == 1
    record = provider.jobs(name)[0]
    assert job.provider_handle["provider_job_id"] == record["id"]
    if when == "after":
        assert record["id"] == created_before_kill[0]  # adopted, not re-created
    assert record["tags"]["trainboard-job-id"] == str(job.pk)
    messages = list(job.events.values_list("message", flat=True))
    assert sum(m.startswith(recovery.RESUME_MESSAGE) for m in messages) == 1, messages
    # The sweep keeps running: nothing is submitted twice afterwards, and syncing carries on.
    wait_for(lambda: _reload(job).state == S.RUNNING, timeout=30, what="the sync to apply RUNNING")
    provider.set_state(record["id"], "SUCCEEDED")
    job = wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=30, what="SUCCEEDED to be synced")
    assert job.state == S.SUCCEEDED and provider.count(name) == 1
    assert (timezone.now() - killed_at).total_seconds() < 90


def test_provider_job_exists_row_without_handle_is_adopted_by_the_sweep(provider, fault_backend, user,
                                                                        digits_dataset, cnn_model):
    """"Just after the provider call", in process: the provider job exists, the row is SUBMITTING
    without a handle and its lease has expired; one sweep + the submit task it sends adopt the job."""
    from jobs import dispatch, lifecycle, tasks

    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, fault_backend)
    long_ago = timezone.now() - dt.timedelta(seconds=lifecycle.submit_lease_s() + 5)
    TrainingJob.objects.filter(pk=job.pk).update(state=S.SUBMITTING, submitted_at=long_ago,
                                                 state_entered_at=long_ago)
    existing = provider.create(job.provider_job_name, {"trainboard-job-id": str(job.pk)})

    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        assert recovery.resume_stuck_submissions() == [job.pk]
        assert recovery.resume_stuck_submissions() == []  # claimed: the next sweep leaves it alone
    claim = _reload(job).state_entered_at
    assert claim > long_ago
    send.assert_called_once_with(args=[job.pk], kwargs={"claim": claim.isoformat()}, queue="celery")
    tasks.submit_job(job.pk, claim=claim.isoformat())  # the message the sweep sent
    job = _reload(job)
    assert job.state == S.PENDING
    assert job.provider_handle == {"provider": "faultcloud", "job_name": job.provider_job_name,
                                   "provider_job_id": existing["id"], "extra": {}}
    assert provider.count(job.provider_job_name) == 1
    # A stale redelivery of the first message (no claim) changes nothing.
    tasks.submit_job(job.pk)
    assert provider.count(job.provider_job_name) == 1 and _reload(job).state == S.PENDING


def test_resumes_are_limited_then_the_job_fails_with_the_reason(provider, fault_backend, user, digits_dataset,
                                                               cnn_model, settings):
    from jobs import dispatch, lifecycle, tasks

    settings.TRAINBOARD_RECOVERY_MAX_RESUMES = 2
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, fault_backend)
    lease = dt.timedelta(seconds=lifecycle.submit_lease_s() + 1)

    def expire():
        TrainingJob.objects.filter(pk=job.pk).update(state_entered_at=timezone.now() - lease)

    TrainingJob.objects.filter(pk=job.pk).update(state=S.SUBMITTING, submitted_at=timezone.now() - lease)
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        for _ in range(2):  # each resumed submission "dies" again (its message is never run)
            expire()
            assert recovery.resume_stuck_submissions() == [job.pk]
            assert _reload(job).state == S.SUBMITTING
        expire()
        assert recovery.resume_stuck_submissions() == [job.pk]
    assert send.call_count == 2
    job = _reload(job)
    assert job.state == S.FAILED
    assert job.failure_reason.startswith("The submission did not finish after 2 resumed attempts")
    assert job.provider_job_name in job.failure_reason
    assert JobEvent.objects.filter(job=job, to_state=S.FAILED).count() == 1
    assert provider.count(job.provider_job_name) == 0
