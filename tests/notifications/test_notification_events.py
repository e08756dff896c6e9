"""Job events become deliveries and emails: state changes (jobs.signals.job_state_changed), the
sync's budget stop and the recovery sweep's stall flag; who is told (owner, team webhooks,
teammates only when they chose); the email itself through Django's locmem backend."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.core import mail
from django.core.exceptions import ValidationError
from django.utils import timezone

from notifykit import move
from jobs import dispatch, notifications, recovery, services, sync
from jobs.models import JobStateChoices as S, NotificationPreference, Team, TrainingJob, WebhookDelivery
from taskkit import record_sent_tasks

pytestmark = pytest.mark.django_db

ALL_EVENTS = ["job.started", "job.succeeded", "job.failed", "job.cancelled", "job.budget_stopped", "job.stalled"]


@pytest.fixture
def sent(monkeypatch):
    """The deliver_webhook and send_notification_email messages, recorded instead of published."""
    deliveries = record_sent_tasks(monkeypatch, dispatch.DELIVER_WEBHOOK)
    emails = record_sent_tasks(monkeypatch, dispatch.SEND_NOTIFICATION_EMAIL)
    record_sent_tasks(monkeypatch, dispatch.SUBMIT_JOB)
    record_sent_tasks(monkeypatch, dispatch.CANCEL_JOB)
    return {"deliveries": deliveries, "emails": emails}


@pytest.fixture
def hook(user):
    webhook, _secret = services.webhook_create(owner=user, url="http://127.0.0.1:9/hook", events=ALL_EVENTS)
    return webhook


def _events(job):
    return list(WebhookDelivery.objects.filter(job=job).order_by("id").values_list("event", flat=True))


def test_state_changes_are_events(job, hook, sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        move(job, S.SUBMITTING, S.PENDING, S.RUNNING, S.SUCCEEDED)
    assert _events(job) == ["job.started", "job.succeeded"]
    rows = list(WebhookDelivery.objects.filter(job=job).order_by("id"))
    # One deliver_webhook per row, sent after the row committed, on the notifications queue.
    assert [c.kwargs for c in sent["deliveries"].call_args_list] == [
        {"args": [row.pk], "queue": "notifications"} for row in rows]
    succeeded = rows[1].payload
    assert succeeded["job"]["state"] == "SUCCEEDED" and succeeded["job"]["reason"] == "to SUCCEEDED"
    assert rows[1].next_attempt_at <= timezone.now() and rows[1].attempt_count == 0


@pytest.mark.parametrize("end, event", [(S.FAILED, "job.failed"), (S.CANCELLED, "job.cancelled")])
def test_failed_and_cancelled(job, hook, sent, django_capture_on_commit_callbacks, end, event):
    with django_capture_on_commit_callbacks(execute=True):
        move(job, S.SUBMITTING, S.PENDING, end, failure_reason="exit 1")
    assert _events(job) == [event]


def test_a_webhook_gets_only_its_events_and_a_disabled_one_none(user, job, sent, django_capture_on_commit_callbacks):
    only_failed, _ = services.webhook_create(owner=user, url="http://127.0.0.1:9/a", events=["job.failed"])
    services.webhook_create(owner=user, url="http://127.0.0.1:9/b", events=ALL_EVENTS, enabled=False)
    with django_capture_on_commit_callbacks(execute=True):
        move(job, S.SUBMITTING, S.PENDING, S.RUNNING, S.FAILED)
    assert list(WebhookDelivery.objects.values_list("webhook_id", "event")) == [(only_failed.pk, "job.failed")]


def test_budget_stop_is_an_event(job, hook, sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        move(job, S.SUBMITTING, S.PENDING, S.RUNNING)
    TrainingJob.objects.filter(pk=job.pk).update(cost_usd=Decimal("2.5"))
    job.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):
        assert sync._enforce_budget(job) is True
    assert _events(job) == ["job.started", "job.budget_stopped"]
    row = WebhookDelivery.objects.get(job=job, event="job.budget_stopped")
    assert row.payload["job"]["reason"] == "Stopped: budget of $2.00 reached at $2.50"
    assert row.payload["job"]["state"] == "STOPPING" and row.payload["job"]["cost_usd"] == "2.5000"


def test_a_user_cancel_is_told_once_when_cancelled(job, hook, sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        move(job, S.SUBMITTING, S.PENDING, S.RUNNING)
        services.training_job_cancel(job=job)
    with django_capture_on_commit_callbacks(execute=True):
        move(job, S.CANCELLED)
    assert _events(job) == ["job.started", "job.cancelled"]


def test_stall_is_an_event(job, hook, sent, django_capture_on_commit_callbacks):
    later = timezone.now() + dt.timedelta(days=2)
    with django_capture_on_commit_callbacks(execute=True):
        assert recovery.flag_stalled_jobs(now=later) == [job.pk]
    [row] = WebhookDelivery.objects.filter(job=job)
    assert row.event == "job.stalled"
    assert row.payload["job"]["reason"] == "QUEUED for 2d, past the backend's 10m deadline"
    assert sent["deliveries"].call_count == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert recovery.flag_stalled_jobs(now=later) == []  # flagged once per state
    assert WebhookDelivery.objects.filter(job=job).count() == 1


def test_team_webhooks_and_personal_webhooks(django_user_model, user, job, sent, django_capture_on_commit_callbacks):
    erin = django_user_model.objects.create_user(username="erin", password="pw-erin-Secret-1")
    team = Team.objects.create(name="vision")
    team.members.add(user, erin)
    team_hook, _ = services.webhook_create(owner=erin, url="http://127.0.0.1:9/team", events=["job.failed"], team=team)
    erins_own, _ = services.webhook_create(owner=erin, url="http://127.0.0.1:9/erin", events=["job.failed"])
    private_job = job
    team_job = services.training_job_create(owner=user, dataset=job.dataset, model_spec=job.model_spec,
                                            backend=job.backend, epochs=1, team=team, name="team-run")
    with django_capture_on_commit_callbacks(execute=True):
        move(private_job, S.SUBMITTING, S.FAILED)
        move(team_job, S.SUBMITTING, S.FAILED)
    # alice's private job: nobody's webhook (erin's are hers and her team's); the team's job: the team's.
    assert list(WebhookDelivery.objects.values_list("webhook_id", "job_id")) == [(team_hook.pk, team_job.pk)]
    assert not WebhookDelivery.objects.filter(webhook=erins_own).exists()


def test_email_goes_to_those_who_chose(django_user_model, user, job, sent, django_capture_on_commit_callbacks):
    user.email = "alice@example.org"
    user.save()
    erin = django_user_model.objects.create_user(username="erin", password="x", email="erin@example.org")
    frank = django_user_model.objects.create_user(username="frank", password="x", email="frank@example.org")
    team = Team.objects.create(name="vision")
    team.members.add(user, erin, frank)
    services.notification_preference_update(user=user, email_events=["job.failed"])
    services.notification_preference_update(user=erin, email_events=ALL_EVENTS, team_email_events=["job.failed"])
    services.notification_preference_update(user=frank, email_events=ALL_EVENTS)  # not about teammates' jobs
    team_job = services.training_job_create(owner=user, dataset=job.dataset, model_spec=job.model_spec,
                                            backend=job.backend, epochs=1, team=team, name="team-run")
    with django_capture_on_commit_callbacks(execute=True):
        move(team_job, S.SUBMITTING, S.PENDING, S.RUNNING)  # job.started: nobody chose it for this job
        move(team_job, S.FAILED, failure_reason="rank 0: loss is NaN")
    [call] = sent["emails"].call_args_list
    user_ids, facts = call.kwargs["args"]
    assert user_ids == [user.pk, erin.pk]
    assert facts["event"] == "job.failed" and facts["job"]["id"] == team_job.pk

    assert notifications.notification_email_send(user_ids=user_ids, facts=facts) == 2
    assert [m.to for m in mail.outbox] == [["alice@example.org"], ["erin@example.org"]]
    message = mail.outbox[0]
    assert message.subject == f"[Trainboard] Job #{team_job.pk} team-run failed: to FAILED"
    assert f"Open the job: https://trainboard.example.org/jobs/{team_job.pk}/" in message.body
    assert "Team: vision" in message.body and "Budget: $" not in message.body


def test_preference_validation(user, django_user_model):
    with pytest.raises(ValidationError) as exc:
        services.notification_preference_update(user=user, email_events=["job.failed"])
    assert exc.value.message_dict == {"__all__": [
        "Your account has no email address; ask an administrator to add one, then choose events."]}
    user.email = "alice@example.org"
    user.save()
    with pytest.raises(ValidationError) as exc:
        services.notification_preference_update(user=user, email_events=["job.nope"], team_email_events={"a": 1})
    assert set(exc.value.message_dict) == {"email_events", "team_email_events"}
    assert not NotificationPreference.objects.exists()
    pref = services.notification_preference_update(user=user, email_events="job.failed, job.succeeded")
    assert pref.email_events == ["job.succeeded", "job.failed"] and pref.team_email_events == []


def test_an_unknown_event_name_is_a_programming_error(job):
    with pytest.raises(ValueError, match="unknown notification event 'job.exploded'"):
        notifications.event_record(job=job, event="job.exploded")
