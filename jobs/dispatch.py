"""Enqueueing the worker's job tasks, by task name, after the request's transaction commits.

The services and the recovery sweep send ``submit_job`` and ``cancel_job`` through here with
``current_app.send_task`` and the task's registered name, so no module imports :mod:`jobs.tasks`
(which imports the services: importing it back would be a circle). The worker applies the task's
own options (retries, time limits, ``acks_late``) from its registry.

Side effects after commit (DESIGN.md §2): a rolled-back request never launches a cloud job. The
database is the source of truth, so a broker that is down is logged, never raised: the row is
already committed and the recovery sweep or the next sync re-sends what was lost.

A leaf module: it imports no service.
"""

from __future__ import annotations

import logging
from functools import partial

from celery import current_app
from django.conf import settings
from django.db import transaction
from kombu.exceptions import OperationalError

log = logging.getLogger(__name__)

SUBMIT_JOB = "jobs.tasks.submit_job"
"""The registered name of :func:`jobs.tasks.submit_job` (``jobs.tasks.OPTIONS``)."""
CANCEL_JOB = "jobs.tasks.cancel_job"
"""The registered name of :func:`jobs.tasks.cancel_job`."""


def submit_after_commit(job_id: int, queue: str) -> None:
    """Send ``submit_job(job_id)`` to Celery queue ``queue`` once the current transaction commits
    (at once outside one); nothing is sent when it rolls back."""
    transaction.on_commit(partial(send_submit, job_id, queue))


def cancel_after_commit(job_id: int, queue: str) -> None:
    """Send ``cancel_job(job_id)`` to ``queue`` once the current transaction commits."""
    transaction.on_commit(partial(send_cancel, job_id, queue))


def resubmit_after_commit(job_id: int, queue: str, claim: str | None) -> None:
    """The recovery sweep's ``submit_job(job_id, claim=claim)`` to ``queue`` once the current
    transaction commits. ``claim``: ISO-8601 time, the job's ``state_entered_at`` as the sweep
    wrote it when it took the submission over (:func:`jobs.lifecycle.submission_claim`); None for a
    QUEUED job whose message was lost."""
    transaction.on_commit(partial(resend_submit, job_id, queue, claim))


def send_submit(job_id: int, queue: str) -> None:
    """Publish ``submit_job(job_id)`` on ``queue`` now; a broker that is down is logged."""
    _send(SUBMIT_JOB, job_id, queue, "the recovery sweep re-sends it")


def send_cancel(job_id: int, queue: str) -> None:
    """Publish ``cancel_job(job_id)`` on ``queue`` now; a broker that is down is logged."""
    _send(CANCEL_JOB, job_id, queue, "every sync re-sends the cancel of a STOPPING job")


def resend_submit(job_id: int, queue: str, claim: str | None) -> None:
    """Publish the recovery sweep's ``submit_job(job_id, claim=claim)`` on ``queue`` now; any
    failure to publish is logged: the next sweep sends it again."""
    try:
        current_app.send_task(SUBMIT_JOB, args=[job_id], kwargs={"claim": claim} if claim else {}, queue=queue)
    except Exception as exc:  # broker down: the next sweep sends it again
        log.warning("job %s: could not send submit_job (%s); the next recovery sweep retries", job_id, exc)


def _send(task_name: str, job_id: int, queue: str, then: str) -> None:
    try:
        current_app.send_task(task_name, args=[job_id], queue=queue)
    except (OperationalError, OSError) as exc:
        log.warning("job %s: could not send %s (%s); %s", job_id, task_name, exc, then)


SWEEP_FILL = "jobs.tasks.sweep_fill"
"""The registered name of :func:`jobs.tasks.sweep_fill` (start a sweep's free trial slots)."""
SWEEP_TRIAL_ENDED = "jobs.tasks.sweep_trial_ended"
"""The registered name of :func:`jobs.tasks.sweep_trial_ended` (tell Optuna how a trial's job ended)."""


def sweep_fill_after_commit(sweep_id: int) -> None:
    """Send ``sweep_fill(sweep_id)`` (default queue) once the current transaction commits."""
    transaction.on_commit(partial(_send_sweep, SWEEP_FILL, sweep_id))


def send_sweep_trial_ended(job_id: int) -> None:
    """Publish ``sweep_trial_ended(job_id)`` now (the job's end has committed); a broker that is down is
    logged: the sweep's beat pass tells an ended trial that was never told."""
    _send_sweep(SWEEP_TRIAL_ENDED, job_id)


def _send_sweep(task_name: str, object_id: int) -> None:
    try:
        current_app.send_task(task_name, args=[object_id])
    except (OperationalError, OSError) as exc:
        log.warning("could not send %s(%s) (%s); the sweep's beat pass catches up", task_name, object_id, exc)


DELIVER_WEBHOOK = "jobs.tasks.deliver_webhook"
"""The registered name of :func:`jobs.tasks.deliver_webhook` (one attempt of one delivery row)."""
SEND_NOTIFICATION_EMAIL = "jobs.tasks.send_notification_email"
"""The registered name of :func:`jobs.tasks.send_notification_email`."""


def webhook_delivery_after_commit(delivery_pk: int) -> None:
    """Send ``deliver_webhook(delivery_pk)`` once the current transaction commits. A lost message
    costs nothing: the row is due, and beat's ``webhook_deliveries_due`` sends it."""
    transaction.on_commit(partial(_send_by_name, DELIVER_WEBHOOK, [delivery_pk],
                                  "beat's webhook_deliveries_due sends it"))


def notification_email_after_commit(user_ids: list[int], facts: dict) -> None:
    """Send ``send_notification_email(user_ids, facts)`` once the current transaction commits."""
    transaction.on_commit(partial(_send_by_name, SEND_NOTIFICATION_EMAIL, [list(user_ids), facts],
                                  "this email is not sent"))


def _send_by_name(task_name: str, args: list, then: str) -> None:
    """Publish a notification task on the notifications queue (``TRAINBOARD_NOTIFICATIONS_QUEUE``,
    served by its own worker so that a slow endpoint never holds a sync's)."""
    try:
        current_app.send_task(task_name, args=args, queue=settings.TRAINBOARD_NOTIFICATIONS_QUEUE)
    except (OperationalError, OSError) as exc:
        log.warning("could not send %s (%s); %s", task_name, exc, then)
