"""Celery tasks: thin, take ids, load the row, call a service, return within seconds.

No task waits for a training job (Redis redelivers unacknowledged long tasks after its visibility
timeout; a task that waited would run twice). Task options live in :data:`OPTIONS`, one place:

* transient :class:`~cloud_adapters.base.BackendError` (Throttled, CapacityUnavailable,
  ProviderError(transient=True)) is retried with exponential backoff; other errors are handled
  by the services (the job becomes FAILED with the message) or logged;
* ``acks_late`` only for tasks that are idempotent (submit is guarded by a conditional state update
  and the provider's idempotency by name; cancel is idempotent at every provider);
* sync tasks expire quickly: beat sends a fresh one every ``TRAINBOARD_SYNC_INTERVAL_S``;
* the submit task's hard time limit is ``TRAINBOARD_SUBMIT_TIME_LIMIT_S``: the recovery sweep
  (``recovery_sweep``, every ``TRAINBOARD_RECOVERY_INTERVAL_S``) takes over a submission older than
  that, so a worker killed mid-call never leaves a job stuck.

Nothing imports this module (an import contract checks it): the services and the recovery sweep
send ``submit_job`` and ``cancel_job`` by name (:mod:`jobs.dispatch`), beat by the names in
``CELERY_BEAT_SCHEDULE``; the worker finds the tasks through Celery's autodiscovery.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import smtplib

from celery import shared_task
from django.conf import settings

from cloud_adapters.base import BackendError
from jobs import (counters, dispatch, lifecycle, metric_retention, notifications, orphans, recovery, selectors, sweeps,
                  sync, webhooks)
from jobs.adapters import backend_queue
from jobs.models import ComputeBackend, TrainingJob

log = logging.getLogger(__name__)

MAX_RETRIES = 8


def _sync_expiry_s() -> float:
    return max(float(settings.TRAINBOARD_SYNC_INTERVAL_S) * 5, 10.0)


def _submit_time_limit_s() -> float:
    return float(settings.TRAINBOARD_SUBMIT_TIME_LIMIT_S)


OPTIONS = {
    "submit_job": dict(name=dispatch.SUBMIT_JOB, bind=True, acks_late=True, max_retries=MAX_RETRIES,
                       soft_time_limit=max(_submit_time_limit_s() - 30, _submit_time_limit_s() * 0.8),
                       time_limit=_submit_time_limit_s()),
    "cancel_job": dict(name=dispatch.CANCEL_JOB, bind=True, acks_late=True, max_retries=MAX_RETRIES,
                       soft_time_limit=60, time_limit=90),
    "sync_jobs": dict(name="jobs.tasks.sync_jobs", acks_late=False, soft_time_limit=30, time_limit=45),
    "sync_backend": dict(name="jobs.tasks.sync_backend", acks_late=False, soft_time_limit=60, time_limit=90),
    "recovery_sweep": dict(name="jobs.tasks.recovery_sweep", acks_late=False, soft_time_limit=60, time_limit=90),
}


def _backoff_s(retries: int) -> float:
    """2, 4, 8 ... seconds, capped at 5 minutes, with jitter so throttled workers spread out."""
    return min(2 ** (retries + 1), 300) * random.uniform(0.8, 1.2)


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, BackendError) and bool(getattr(exc, "transient", False))


@shared_task(**OPTIONS["submit_job"])
def submit_job(self, job_id: int, claim: str | None = None) -> None:
    """Start job ``job_id`` on its backend (QUEUED → SUBMITTING → PENDING, or FAILED).

    ``claim``: ISO-8601 time, the job's ``state_entered_at`` when this message's sender owned the
    submission (a retry of this task, or the recovery sweep resuming a job whose worker died); see
    :func:`jobs.lifecycle.training_job_submit`. A redelivered message carries none and may resume
    only a submission whose lease expired.
    """
    job = TrainingJob.objects.select_related("backend").filter(pk=job_id).first()
    if job is None:
        return
    token = dt.datetime.fromisoformat(claim) if claim else None
    try:
        lifecycle.training_job_submit(job=job, claim=token)
    except BackendError as exc:
        if not _is_transient(exc):
            raise
        if self.request.retries >= self.max_retries:
            lifecycle.training_job_submit_gave_up(job=job, error=exc)
            return
        # The attempt that failed owns the job until its lease ends; its retry keeps that token.
        owner = job.state_entered_at.isoformat() if job.state_entered_at else None
        raise self.retry(exc=exc, countdown=_backoff_s(self.request.retries), args=[job_id],
                         kwargs={"claim": owner})


@shared_task(**OPTIONS["cancel_job"])
def cancel_job(self, job_id: int) -> None:
    """Ask the provider to stop STOPPING job ``job_id``; a later sync confirms CANCELLED."""
    job = TrainingJob.objects.select_related("backend").filter(pk=job_id).first()
    if job is None:
        return
    try:
        lifecycle.training_job_cancel_send(job=job)
    except BackendError as exc:
        if _is_transient(exc) and self.request.retries < self.max_retries:
            raise self.retry(exc=exc, countdown=_backoff_s(self.request.retries))
        # Not fatal: every sync re-sends the cancel of a STOPPING job.
        log.warning("job %s: cancel failed (%s); the next sync re-sends it", job_id, exc)


@shared_task(**OPTIONS["sync_jobs"])
def sync_jobs() -> int:
    """Beat's entry point: one ``sync_backend`` per backend with active jobs, on that backend's queue."""
    ids = selectors.backend_ids_with_active_jobs()
    for backend in ComputeBackend.objects.filter(pk__in=ids):
        sync_backend.apply_async(args=[backend.pk], queue=backend_queue(backend),
                                 expires=_sync_expiry_s())
    return len(ids)


@shared_task(**OPTIONS["sync_backend"])
def sync_backend(backend_id: int) -> int:
    """Describe, ingest logs/metrics, apply states and cost for one backend's active jobs."""
    try:
        return sync.backend_sync(backend_id=backend_id)
    except ComputeBackend.DoesNotExist:
        return 0
    except BackendError as exc:
        # Throttled or down: the next beat tick is the retry.
        log.warning("backend %s: sync skipped: %s", backend_id, exc)
        counters.count(counters.SYNC_ERRORS, backend_id)
        return 0
    except Exception:
        counters.count(counters.SYNC_ERRORS, backend_id)
        raise


@shared_task(**OPTIONS["recovery_sweep"])
def recovery_sweep() -> dict[str, int]:
    """Beat's recovery pass (:func:`jobs.recovery.recovery_sweep`): re-send lost submissions, resume
    submissions whose worker died, flag and by policy cancel jobs past their state's deadline."""
    return recovery.recovery_sweep()


OPTIONS["reconcile_orphans"] = dict(name="jobs.tasks.reconcile_orphans", acks_late=False, soft_time_limit=120,
                                    time_limit=150)


@shared_task(**OPTIONS["reconcile_orphans"])
def reconcile_orphans(backend_id: int | None = None) -> dict | int:
    """Orphan reconciler (:func:`jobs.orphans.reconcile_orphans`). Beat sends it without an id: it
    then sends one per enabled backend to that backend's queue (a gpubox's run directories are on
    its worker's machine) and returns how many. With an id: one pass; a provider error is logged
    and the next beat tick retries. Safe to run twice at once."""
    if backend_id is None:
        backends = list(ComputeBackend.objects.filter(enabled=True))
        for backend in backends:
            reconcile_orphans.apply_async(args=[backend.pk], queue=backend_queue(backend),
                                          expires=300.0)
        return len(backends)
    try:
        return orphans.reconcile_orphans(backend_id)
    except ComputeBackend.DoesNotExist:
        return {}
    except (BackendError, NotImplementedError) as exc:
        log.warning("backend %s: orphan reconcile skipped: %s", backend_id, exc)
        return {"error": str(exc)}


OPTIONS["sweep_fill"] = dict(name=dispatch.SWEEP_FILL, acks_late=True, soft_time_limit=120, time_limit=150)
OPTIONS["sweep_trial_ended"] = dict(name=dispatch.SWEEP_TRIAL_ENDED, acks_late=True, soft_time_limit=120,
                                    time_limit=150)
OPTIONS["sweep_tick"] = dict(name="jobs.tasks.sweep_tick", acks_late=False, soft_time_limit=120, time_limit=150)


@shared_task(**OPTIONS["sweep_fill"])
def sweep_fill(sweep_id: int) -> list[int]:
    """Start trials in sweep ``sweep_id``'s free slots (:func:`jobs.sweeps.sweep_fill`); idempotent
    (the sweep row's lock and the unique trial number), so ``acks_late`` is safe."""
    return sweeps.sweep_fill(sweep_id=sweep_id)


@shared_task(**OPTIONS["sweep_trial_ended"])
def sweep_trial_ended(job_id: int) -> str | None:
    """Tell Optuna how trial job ``job_id`` ended, then fill (:func:`jobs.sweeps.sweep_trial_ended`);
    a second delivery finds the trial told and only fills."""
    return sweeps.sweep_trial_ended(job_id=job_id)


@shared_task(**OPTIONS["sweep_tick"])
def sweep_tick() -> dict[str, int]:
    """Beat: prune, repair and fill every running sweep (:func:`jobs.sweeps.sweep_tick`)."""
    return sweeps.sweep_tick()


# --- notifications (jobs.notifications, jobs.webhooks) -----------------------------------------

OPTIONS["deliver_webhook"] = dict(name=dispatch.DELIVER_WEBHOOK, acks_late=False,
                                  soft_time_limit=webhooks.timeout_s() + 20, time_limit=webhooks.timeout_s() + 30)
OPTIONS["webhook_deliveries_due"] = dict(name="jobs.tasks.webhook_deliveries_due", acks_late=False,
                                         soft_time_limit=30, time_limit=45)
OPTIONS["send_notification_email"] = dict(name=dispatch.SEND_NOTIFICATION_EMAIL, bind=True, acks_late=False,
                                          max_retries=3, soft_time_limit=60, time_limit=90)


OPTIONS["prune_metric_points"] = dict(name="jobs.tasks.prune_metric_points", acks_late=False,
                                     soft_time_limit=600, time_limit=660)


@shared_task(**OPTIONS["prune_metric_points"])
def prune_metric_points() -> dict[str, int]:
    """Beat (hourly): the operator's metric retention (:func:`jobs.metric_retention.prune_metric_points`)."""
    return metric_retention.prune_metric_points()


@shared_task(**OPTIONS["deliver_webhook"])
def deliver_webhook(delivery_id: int) -> str:
    """One attempt of webhook delivery ``delivery_id`` if it is due (:func:`jobs.webhooks.delivery_attempt`);
    a retry is not a Celery retry: the row's ``next_attempt_at`` says when, and beat sends it."""
    return webhooks.delivery_attempt(delivery_id)


@shared_task(**OPTIONS["webhook_deliveries_due"])
def webhook_deliveries_due() -> int:
    """Beat's pass: a ``deliver_webhook`` for every due delivery (retries, and rows a killed worker
    left); returns how many were sent."""
    ids = webhooks.due_delivery_ids()
    for delivery_id in ids:
        deliver_webhook.apply_async(args=[delivery_id], expires=300.0)
    return len(ids)


@shared_task(**OPTIONS["send_notification_email"])
def send_notification_email(self, user_ids: list[int], facts: dict) -> int:
    """Mail ``user_ids`` about one event (:func:`jobs.notifications.notification_email_send`); an
    SMTP or network error is retried after 30 s, 60 s, 120 s."""
    try:
        return notifications.notification_email_send(user_ids=user_ids, facts=facts)
    except (OSError, smtplib.SMTPException) as exc:
        if self.request.retries >= self.max_retries:
            log.warning("notification email to users %s not sent: %s", user_ids, exc)
            return 0
        raise self.retry(exc=exc, countdown=30 * 2 ** self.request.retries)
