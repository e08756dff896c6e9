"""Deadlines per non-terminal state (DESIGN.md §4): a job past its state's deadline is flagged STALLED
with the reason (job page, list badge, API, ?stalled=true), once; a backend whose stall_policy is
"cancel" cancels it; the next transition clears the flag; bad state_deadlines are refused."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from jobs import deadlines, dispatch, recovery, services, states
from jobs.models import JobEvent, JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _job(user, digits_dataset, cnn_model, backend, **kwargs) -> TrainingJob:
    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=backend, **kwargs)


def _age(job: TrainingJob, state: str, seconds: float) -> TrainingJob:
    """Put ``job`` in ``state`` since ``seconds`` ago (with a provider handle past QUEUED)."""
    since = timezone.now() - dt.timedelta(seconds=seconds)
    handle = None if state == S.QUEUED else {"provider": "faultcloud", "job_name": job.provider_job_name,
                                            "provider_job_id": "x", "extra": {}}
    TrainingJob.objects.filter(pk=job.pk).update(state=state, state_entered_at=since, submitted_at=since,
                                                 provider_handle=handle)
    return _reload(job)


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59, "59s"), (75, "1m 15s"), (600, "10m"),
                                           (3720, "1h 02m"), (3600, "1h"), (90000, "1d 01h")])
def test_human_duration(seconds, text):
    assert deadlines.human_duration(seconds) == text


def test_deadlines_default_backend_override_and_running_from_max_runtime(user, digits_dataset, cnn_model,
                                                                         fault_backend, settings):
    settings.TRAINBOARD_RUNNING_DEADLINE_MARGIN_S = 600
    job = _job(user, digits_dataset, cnn_model, fault_backend, max_runtime_s=1800)
    expected = {S.QUEUED: 600, S.SUBMITTING: 300, S.PENDING: 3600, S.RUNNING: 2400, S.STOPPING: 900}
    for state, seconds in expected.items():
        job.state = state
        assert deadlines.state_deadline_s(job) == seconds, state
    job.state = S.SUCCEEDED
    assert deadlines.state_deadline_s(job) is None
    services.backend_update(backend=fault_backend, state_deadlines={"pending": 120, "RUNNING": 7200})
    fault_backend.refresh_from_db()
    assert fault_backend.state_deadlines == {"PENDING": 120, "RUNNING": 7200}
    job = _reload(job)
    job.state = S.PENDING
    assert deadlines.state_deadline_s(job) == 120
    job.state = S.RUNNING
    assert deadlines.state_deadline_s(job) == 7200
    job.state = S.QUEUED
    assert deadlines.state_deadline_s(job) == 600


def test_pending_past_its_deadline_is_flagged_once_and_unflagged_by_the_next_transition(
        user, digits_dataset, cnn_model, fault_backend):
    job = _age(_job(user, digits_dataset, cnn_model, fault_backend), S.PENDING, 3720)
    fresh = _age(_job(user, digits_dataset, cnn_model, fault_backend), S.PENDING, 3500)

    assert recovery.flag_stalled_jobs() == [job.pk]
    assert recovery.flag_stalled_jobs() == []  # already flagged: no second event
    job = _reload(job)
    assert job.state == S.PENDING  # warn policy: flagged, not cancelled
    assert job.stalled_at is not None
    assert job.stalled_reason in ("PENDING for 1h 02m, past the backend's 1h deadline",
                                  "PENDING for 1h 02m, past the backend's 1h deadline".replace("02m", "03m"))
    events = list(JobEvent.objects.filter(job=job, from_state=S.PENDING, to_state="")  # a note, no move
                  .values_list("message", flat=True))
    assert events == [f"Stalled: {job.stalled_reason}"]
    assert _reload(fresh).stalled_at is None

    assert states.transition(job, S.RUNNING, message="first step logged")
    job = _reload(job)
    assert job.stalled_at is None and job.stalled_reason == ""


def test_running_deadline_is_max_runtime_plus_margin(user, digits_dataset, cnn_model, fault_backend, settings):
    settings.TRAINBOARD_RUNNING_DEADLINE_MARGIN_S = 600
    job = _age(_job(user, digits_dataset, cnn_model, fault_backend, max_runtime_s=3600), S.RUNNING, 4300)
    assert recovery.flag_stalled_jobs() == [job.pk]
    assert _reload(job).stalled_reason == \
        "RUNNING for 1h 11m, past the backend's 1h 10m deadline (max runtime 1h + 10m)"


def test_cancel_policy_cancels_with_the_reason(user, digits_dataset, cnn_model, fault_backend,
                                               django_capture_on_commit_callbacks):
    services.backend_update(backend=fault_backend, stall_policy="cancel", state_deadlines={"QUEUED": 30})
    queued = _age(_job(user, digits_dataset, cnn_model, fault_backend), S.QUEUED, 45)
    running = _age(_job(user, digits_dataset, cnn_model, fault_backend, max_runtime_s=60), S.RUNNING, 700)
    with sent_tasks(dispatch.CANCEL_JOB) as send_cancel, \
            django_capture_on_commit_callbacks(execute=True):
        flagged = recovery.flag_stalled_jobs()
    assert sorted(flagged) == sorted([queued.pk, running.pk])
    queued, running = _reload(queued), _reload(running)
    assert queued.state == S.CANCELLED
    assert queued.failure_reason == "Stalled: QUEUED for 45s, past the backend's 30s deadline"
    assert running.state == S.STOPPING
    assert running.failure_reason.startswith("Stalled: RUNNING for 11m 4")
    assert "past the backend's 11m deadline (max runtime 1m + 10m)" in running.failure_reason
    send_cancel.assert_called_once_with(args=[running.pk], queue="celery")


@pytest.mark.parametrize("deadlines, message", [
    ({"SUCCEEDED": 60}, "SUCCEEDED: not a state with a deadline; use one of QUEUED, SUBMITTING, PENDING, "
                        "RUNNING, STOPPING (terminal states have none)."),
    ({"PENDING": 0}, "PENDING: the deadline must be a positive number of seconds (got 0)."),
    ({"PENDING": "1h"}, "PENDING: the deadline must be a positive number of seconds (got '1h')."),
    ({"QUEUED": True}, "QUEUED: the deadline must be a positive number of seconds (got True)."),
    ([600], 'State deadlines must be an object of state: seconds, e.g. {"PENDING": 3600}.'),
])
def test_bad_state_deadlines_are_refused_with_a_clear_message(fault_backend, deadlines, message):
    with pytest.raises(ValidationError) as err:
        services.backend_update(backend=fault_backend, state_deadlines=deadlines)
    assert err.value.message_dict == {"state_deadlines": [message]}
    fault_backend.refresh_from_db()
    assert fault_backend.state_deadlines == {}


def test_stalled_shows_on_the_job_page_the_list_and_the_api(client, user, digits_dataset, cnn_model,
                                                            fault_backend):
    stalled = _age(_job(user, digits_dataset, cnn_model, fault_backend, name="slow"), S.PENDING, 3720)
    fine = _age(_job(user, digits_dataset, cnn_model, fault_backend, name="fine"), S.PENDING, 60)
    recovery.flag_stalled_jobs()
    reason = _reload(stalled).stalled_reason
    client.force_login(user)

    page = client.get(reverse("job-detail", args=[stalled.pk])).content.decode()
    assert 'id="job-stalled"' in page and escape(reason) in page
    assert 'id="job-stalled"' not in client.get(reverse("job-detail", args=[fine.pk])).content.decode()
    listing = client.get(reverse("job-list")).content.decode()
    assert "state-stalled" in listing and escape(reason) in listing

    body = client.get(f"/api/jobs/{stalled.pk}/").json()
    assert body["stalled"] is True and body["stalled_reason"] == reason
    assert client.get(f"/api/jobs/{fine.pk}/").json()["stalled"] is False
    only = client.get("/api/jobs/?stalled=true").json()["results"]
    assert [j["id"] for j in only] == [stalled.pk]
    others = client.get("/api/jobs/?stalled=false").json()["results"]
    assert [j["id"] for j in others] == [fine.pk]
    bad = client.get("/api/jobs/?stalled=maybe")
    assert bad.status_code == 400 and bad.json() == {"stalled": ["stalled must be true or false, got maybe."]}


def test_the_sweep_reads_only_jobs_that_may_be_past_a_deadline(user, digits_dataset, cnn_model, fault_backend):
    """Fresh active jobs are not even read: the query narrows by each state's shortest deadline (the
    backend's 120 s PENDING here), and the one past it is still found."""
    services.backend_update(backend=fault_backend, state_deadlines={"PENDING": 120})
    stalled = _age(_job(user, digits_dataset, cnn_model, fault_backend), S.PENDING, 130)
    for state, age in ((S.PENDING, 100), (S.RUNNING, 60), (S.QUEUED, 500), (S.STOPPING, 10),
                       (S.SUBMITTING, 200)) * 3:
        _age(_job(user, digits_dataset, cnn_model, fault_backend), state, age)
    read = TrainingJob.objects.filter(recovery._maybe_past_deadline(timezone.now()))
    assert list(read.values_list("pk", flat=True)) == [stalled.pk]
    assert recovery.flag_stalled_jobs() == [stalled.pk]
