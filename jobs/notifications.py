"""Job events → email and webhook deliveries (docs/notifications.md).

Events (:data:`jobs.models.NOTIFICATION_EVENTS`):

* ``job.started``, ``job.succeeded``, ``job.failed``, ``job.cancelled``: a state change
  (:data:`jobs.signals.job_state_changed`, received by :func:`on_job_state_changed`);
* ``job.budget_stopped``: the sync's budget stop, the move to STOPPING that ``jobs.sync``
  makes with ``budget_exceeded_at`` (the same signal, told apart by that field);
* ``job.stalled``: the recovery sweep flagging a job past its state's deadline (``jobs.recovery``
  calls :func:`job_stalled` inside its transaction);
* ``job.hung``: a running job flagged hung, by the sync from the launcher's records or by the
  recovery sweep (:func:`job_hung`, inside the transaction that flags it; :mod:`jobs.hangs`);
* ``job.idle``: a running job whose GPUs stayed below its backend's idle threshold, warned or stopped
  by the backend's idle policy (:func:`job_idle`, inside the sync's transaction; :mod:`jobs.idle`);
  its payload's job carries ``idle_saved_usd``, what stopping it saves.

:func:`event_record` writes one :class:`~jobs.models.WebhookDelivery` row per matching webhook and,
after commit, sends ``deliver_webhook`` for each and one ``send_notification_email`` for the users
who chose the event. Nothing here makes a network call: a slow or dead endpoint never slows the
sync or the request that made the change.

Who is told:

* email: the job's owner when the event is in their ``email_events``; another member of the job's
  team only when it is in their ``team_email_events``; users without an email address are skipped;
* webhooks: enabled webhooks listing the event that are the owner's own (no team), or belong to the
  job's team.
"""

from __future__ import annotations

import datetime as dt
import logging
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import EmailMessage, get_connection
from django.db import transaction
from django.db.models import Q
from django.dispatch import receiver
from django.urls import reverse
from django.utils import timezone

from jobs import dispatch, webhooks
from jobs.models import (
    NOTIFICATION_EVENTS,
    JobStateChoices as S,
    NotificationPreference,
    Team,
    TrainingJob,
    Webhook,
    WebhookDelivery,
)
from jobs.signals import job_state_changed

log = logging.getLogger(__name__)

STATE_EVENTS = {S.SUCCEEDED: "job.succeeded", S.FAILED: "job.failed", S.CANCELLED: "job.cancelled",
                S.RUNNING: "job.started"}
"""The state a job entered → its event (RUNNING only when it came from SUBMITTING or PENDING)."""


def event_for_move(job: TrainingJob, from_state: str, to_state: str) -> str | None:
    """The event a committed move announces, or None. A move to STOPPING is ``job.budget_stopped``
    when the budget made it (``budget_exceeded_at`` set with it), else none (a user's cancel is told
    once, when it is CANCELLED). RUNNING after an interruption (PENDING → RUNNING again) is
    ``job.started`` too: it started again."""
    if to_state == S.STOPPING:
        return "job.budget_stopped" if job.budget_exceeded_at is not None else None
    if to_state == S.RUNNING and from_state not in (S.SUBMITTING, S.PENDING):
        return None
    return STATE_EVENTS.get(to_state)


@receiver(job_state_changed, dispatch_uid="jobs.notifications.on_job_state_changed")
def on_job_state_changed(sender, *, job_id: int, from_state: str, to_state: str, message: str = "",
                         **_kwargs: Any) -> None:
    """The receiver of :data:`jobs.signals.job_state_changed`: records the move's event, if any."""
    job = TrainingJob.objects.select_related("backend", "owner", "team").filter(pk=job_id).first()
    if job is None:
        return
    event = event_for_move(job, from_state, to_state)
    if event is not None:
        with transaction.atomic():
            event_record(job=job, event=event, reason=message)


def job_stalled(*, job: TrainingJob, reason: str) -> None:
    """``job.stalled`` for ``job`` (the recovery sweep, inside the transaction that flags it)."""
    event_record(job=job, event="job.stalled", reason=reason)


def job_hung(*, job: TrainingJob, reason: str) -> None:
    """``job.hung`` for ``job`` (``jobs.sync.hung``, inside the transaction that flags it); ``reason``
    is :func:`jobs.hangs.hang_reason`'s line (the last step and where the ranks are stuck)."""
    event_record(job=job, event="job.hung", reason=reason)


def job_idle(*, job: TrainingJob, reason: str) -> None:
    """``job.idle`` for ``job`` (``jobs.sync.idled``, inside the transaction that flags it); ``reason``
    is :func:`jobs.idle.reason`'s line. The payload's job also carries ``idle_saved_usd`` (a decimal
    string, 4 places, as ``cost_usd``): what stopping the job saves."""
    saved = None if job.idle_saved_usd is None else _usd(job.idle_saved_usd)
    event_record(job=job, event="job.idle", reason=reason, details={"idle_saved_usd": saved})


def job_page_url(job_id: int) -> str:
    """The job page's absolute URL under ``TRAINBOARD_BASE_URL``."""
    return settings.TRAINBOARD_BASE_URL + reverse("job-detail", kwargs={"pk": job_id})


def job_facts(job: TrainingJob, event: str, reason: str, at: dt.datetime) -> dict[str, Any]:
    """What every message says about the event: the webhook JSON payload's body (less ``delivery``).

    ``cost_usd`` is a decimal string (4 places, as stored), ``timestamp`` ISO-8601 UTC."""
    return {
        "event": event,
        "timestamp": at.astimezone(dt.timezone.utc).isoformat(),
        "job": {
            "id": job.pk,
            "name": job.name or f"job-{job.pk}",
            "state": str(job.state),
            "reason": reason or job.failure_reason or "",
            "cost_usd": _usd(job.cost_usd),
            "budget_usd": None if job.budget_usd is None else _usd(job.budget_usd),
            "backend": job.backend.name,
            "owner": job.owner.get_username(),
            "team": job.team.name if job.team_id else None,
            "url": job_page_url(job.pk),
        },
    }


def _usd(value: Any) -> str:
    """A USD amount as stored: a decimal string with 4 places ("0.0123")."""
    return f"{Decimal(value):.4f}"


def summary_line(facts: dict[str, Any]) -> str:
    """One line for a chat message or an email subject: "Job #12 digits-cnn succeeded: <reason>"."""
    job = facts["job"]
    verb = {"job.started": "started", "job.succeeded": "succeeded", "job.failed": "failed",
            "job.cancelled": "was cancelled", "job.budget_stopped": "was stopped by its budget",
            "job.stalled": "stalled", "job.hung": "hung", "job.idle": "is idle"}.get(facts["event"], facts["event"])
    line = f"Job #{job['id']} {job['name']} {verb}"
    return f"{line}: {job['reason']}" if job["reason"] and facts["event"] != "job.succeeded" else line


def slack_payload(facts: dict[str, Any], delivery_id: str) -> dict[str, Any]:
    """A Slack incoming-webhook body: ``text`` (the notification's fallback) and ``blocks`` (a section
    with the summary and a link, and a context line with state, cost and backend)."""
    job = facts["job"]
    link = f"<{job['url']}|Job #{job['id']} {job['name']}>"
    text = summary_line(facts)
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": text.replace(
                f"Job #{job['id']} {job['name']}", link, 1)}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": (
                f"State *{job['state']}* · cost ${job['cost_usd']} · backend {job['backend']} · "
                f"event `{facts['event']}` · delivery {delivery_id}")}]},
        ],
    }


def webhook_payload(webhook: Webhook, facts: dict[str, Any], delivery_id: str) -> dict[str, Any]:
    """The body one webhook gets: ``{"delivery", "event", "timestamp", "job": {...}}`` for format
    json, :func:`slack_payload` for format slack."""
    if webhook.format == Webhook.Format.SLACK:
        return slack_payload(facts, delivery_id)
    return {"delivery": delivery_id, **facts}


def webhooks_for(job: TrainingJob, event: str) -> list[Webhook]:
    """Enabled webhooks that want ``event`` of ``job``: the owner's personal ones and its team's."""
    scope = Q(owner_id=job.owner_id, team__isnull=True)
    if job.team_id:
        scope |= Q(team_id=job.team_id)
    return [w for w in Webhook.objects.filter(scope, enabled=True).order_by("id") if event in (w.events or [])]


def email_recipients(job: TrainingJob, event: str) -> list[int]:
    """Ids of the users mailed about ``event`` of ``job`` (see the module's docstring)."""
    candidates = Q(user_id=job.owner_id)
    if job.team_id:
        candidates |= Q(user_id__in=Team.objects.filter(pk=job.team_id).values("members"))
    # The choices are read in Python: JSON containment is not a lookup every database has (SQLite).
    chosen = []
    for user_id, own, team in (NotificationPreference.objects.filter(candidates).exclude(user__email="")
                               .order_by("user_id").values_list("user_id", "email_events", "team_email_events")):
        if event in ((own or []) if user_id == job.owner_id else (team or [])):
            chosen.append(user_id)
    return chosen


def event_record(*, job: TrainingJob, event: str, reason: str = "",
                 details: dict[str, Any] | None = None) -> list[WebhookDelivery]:
    """Record ``event`` of ``job``: a due delivery row per matching webhook, and after commit one
    ``deliver_webhook`` task per row and a ``send_notification_email`` task for the email recipients.
    ``details``: the event's own figures (JSON values), added to the payload's ``job``. Call inside a
    transaction (the event's, or one of its own). Returns the rows written.

    Raises ValueError for an event name not in :data:`jobs.models.NOTIFICATION_EVENTS`."""
    if event not in NOTIFICATION_EVENTS:
        raise ValueError(f"unknown notification event {event!r}")
    now = timezone.now()
    facts = job_facts(job, event, reason, now)
    facts["job"].update(details or {})
    rows = []
    for webhook in webhooks_for(job, event):
        delivery_id = webhooks.new_delivery_id()
        rows.append(WebhookDelivery.objects.create(
            webhook=webhook, job=job, delivery_id=delivery_id, event=event,
            payload=webhook_payload(webhook, facts, str(delivery_id)), next_attempt_at=now))
    for row in rows:
        dispatch.webhook_delivery_after_commit(row.pk)
    recipients = email_recipients(job, event)
    if recipients:
        dispatch.notification_email_after_commit(recipients, facts)
    return rows


def notification_email_send(*, user_ids: list[int], facts: dict[str, Any]) -> int:
    """Mail the users ``user_ids`` one message each about ``facts`` (:func:`job_facts`) through
    Django's configured email backend (``EMAIL_*`` settings). Returns the messages sent; an SMTP
    error propagates (the task retries it)."""
    users = get_user_model().objects.filter(pk__in=user_ids).exclude(email="").order_by("pk")
    job = facts["job"]
    subject = f"[Trainboard] {summary_line(facts)}"[:200]
    lines = [summary_line(facts), "", f"State: {job['state']}", f"Cost: ${job['cost_usd']}",
             f"Backend: {job['backend']}"]
    if job["budget_usd"] is not None:
        lines.append(f"Budget: ${job['budget_usd']}")
    if job.get("idle_saved_usd") is not None:
        lines.append(f"What stopping it saves: ${job['idle_saved_usd']}")
    if job["team"]:
        lines.append(f"Team: {job['team']}")
    lines += ["", f"Open the job: {job['url']}", "",
              "You get this email because you chose it on your notification settings: "
              f"{settings.TRAINBOARD_BASE_URL}{reverse('notification-settings')}"]
    body = "\n".join(lines)
    messages = [EmailMessage(subject, body, settings.DEFAULT_FROM_EMAIL, [user.email]) for user in users]
    if not messages:
        return 0
    with get_connection() as connection:
        return connection.send_messages(messages) or 0

