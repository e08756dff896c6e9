"""Automatic recovery of lost runs (docs/recovery.md): a job whose run was lost is resubmitted from
its checkpoint as its next attempt, up to its backend's ``max_restarts``.

A run is *lost* when its backend says so (:attr:`cloud_adapters.base.JobStatus.lost`): the GPU box's
supervisor vanished without writing exit.json (a reboot, an OOM kill of the process tree), Slurm
reports NODE_FAIL, PREEMPTED or BOOT_FAIL or forgot a job that left no exit record, a spot or
low-priority job ended FAILED for its preemption after the provider's own restarts, a Kubernetes
TrainJob ended Failed with a pod that Kubernetes disrupted (pod condition ``DisruptionTarget``). A provider that
restarts a job itself (SageMaker's managed spot, Azure ML's requeue of a low-priority job) shows an
interruption (RUNNING → PENDING) instead and is left alone. A job's own failure (exit code ≠ 0, a
trainer error, its time limit, out of memory) is never lost, so never resubmitted.

When the sync (:mod:`jobs.sync`) sees a lost run of an active job it calls :func:`lost_run`, inside
the transaction that holds the job's row locked:

* restarts left (``job.attempt − 1 < backend.max_restarts``), no cancel asked for, and the cost of
  all attempts still under the job's budget: the attempt is closed as a :class:`~jobs.models.JobAttempt`
  row (its provider job name and handle, start and end, billable seconds, cost, why it ended, where its
  checkpoints were), the job goes back to QUEUED with "run lost (…); resubmitting, attempt 2 of 3",
  a new provider job name (``…-a2``: the GPU box and Slurm adopt an existing run by name, so the next
  attempt must not reuse it), no handle, an empty log cursor, and ``checkpoint_uri`` = the lost
  attempt's checkpoint directory (``Backend.checkpoint_uri``), so the trainer's resume-by-default
  continues from the last checkpoint and the job ends with the epochs asked for, not more. The
  ``submit_job`` message is sent after commit; admission on a GPU box gives the new attempt its
  devices again. A cancel while it waits is the plain QUEUED → CANCELLED.
* else: FAILED, with "run lost N times (…); max restarts M reached" (or the budget's reason). With
  ``max_restarts`` 0 the backend's reason stands alone, as before recovery existed.

A **hung** run (docs/hangs.md) under the backend's hang policy ``restart`` takes the same path in two
steps: :func:`stop_hung` moves the job to STOPPING with ``hang_restart_at`` set and sends the provider's
cancel after commit (the built-in trainer saves a checkpoint on the SIGTERM when it can; a rank stuck in
a collective cannot, and the last periodic checkpoint stands); when a later sync sees the stop confirmed
(CANCELLED, or FAILED from the signal), :func:`hung_run` closes the attempt (outcome ``hung``) and
requeues the job from its checkpoint directory as for a lost run — STOPPING → QUEUED, the one move back
out of STOPPING. Hang restarts and lost-run restarts share the backend's ``max_restarts``; with none left
the hung job is cancelled. A user's cancel while the stop is on its way clears ``hang_restart_at``.

Cost over attempts: the job's ``cost_usd`` and ``billable_seconds`` are the closed attempts' figures
(stored on their rows) plus the current attempt's from the provider, recomputed at every sync
(:func:`closed_totals`), never incremented.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from decimal import Decimal
from typing import Any, Mapping

from django.db.models import Sum

from cloud_adapters.base import Backend, BackendError, JobHandle, JobStatus
from jobs import cost as costs
from jobs import dispatch
from jobs.adapters import backend_queue, provider_job_name
from jobs.models import RESUBMIT_FROM, JobAttempt, JobStateChoices as S, TrainingJob
from jobs.states import transition

log = logging.getLogger(__name__)

MAX_REASON = 500  # characters of the backend's reason quoted in a message


@dataclasses.dataclass(frozen=True)
class AttemptFigures:
    """What the current attempt alone ran and cost, from its provider status (one sync)."""

    started_at: dt.datetime | None  # when the attempt's billable work began (UTC)
    ended_at: dt.datetime | None  # when it ended (UTC), None while it runs
    billable_seconds: float  # seconds billed per instance
    instance_count: int  # instances billed
    cost_usd: Decimal  # billable seconds × instances × the job's hourly price


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What :func:`lost_run` did: ``requeued`` (the job is QUEUED for its next attempt) or not, and
    then the ``failure_reason`` the caller ends the job FAILED with."""

    requeued: bool
    failure_reason: str = ""


def attempt_job_name(job: TrainingJob, attempt: int) -> str:
    """The provider job name of ``job``'s attempt ``attempt``: :func:`jobs.adapters.provider_job_name`
    for the first, with ``-a<N>`` after it for the later ones (``tb-job-7-6750c1a2-a2``): still
    deterministic, so a retried submit of that attempt adopts the run it created, and never the
    lost attempt's name, which the GPU box and Slurm would adopt instead of starting a new run."""
    base = provider_job_name(job)
    return base if attempt <= 1 else f"{base}-a{attempt}"


def closed_totals(job: TrainingJob) -> tuple[float, Decimal]:
    """(billable seconds, cost in USD) of ``job``'s closed attempts (its :class:`JobAttempt` rows):
    (0, 0) on its first attempt, without a query. Seconds are per instance, as the job's own."""
    if int(job.attempt or 1) <= 1:
        return 0.0, Decimal("0")
    sums = JobAttempt.objects.filter(job_id=job.pk).aggregate(seconds=Sum("billable_seconds"), usd=Sum("cost_usd"))
    return float(sums["seconds"] or 0.0), Decimal(sums["usd"] or 0)


def checkpoint_location(adapter: Backend, handle: JobHandle) -> str:
    """Where the lost attempt's checkpoints are (``Backend.checkpoint_uri``), for the next attempt
    to resume from; "" when the backend cannot say or its answer failed (the next attempt then starts
    over). A provider call: make it outside any row lock."""
    try:
        return adapter.checkpoint_uri(handle) or ""
    except BackendError as exc:
        log.warning("%s: checkpoint location unknown (%s); its next attempt starts over", handle.job_name, exc)
        return ""


def restarts_used(job: TrainingJob) -> int:
    """Resubmissions made so far: attempt N has used N − 1."""
    return max(int(job.attempt or 1) - 1, 0)


def _quoted(reason: str) -> str:
    reason = " ".join((reason or "run lost").split())
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 1] + "…"


def restart_left(job: TrainingJob) -> bool:
    """Whether ``job`` may be resubmitted once more under its backend's ``max_restarts``."""
    return restarts_used(job) < int(job.backend.max_restarts)


def stop_hung(job: TrainingJob, reason: str) -> bool:
    """Stop the hung ``job`` (PENDING or RUNNING, its row locked by the caller) to restart it: STOPPING with
    "Restarting: hung. <reason>", ``hang_restart_at`` and ``cancel_requested_at`` now, and the provider's
    cancel sent after commit. True when this call moved it. The caller checked :func:`restart_left`."""
    now = dt.datetime.now(dt.timezone.utc)
    moved = transition(job, S.STOPPING, message=f"Restarting: hung. {reason}"[:2000], cancel_requested_at=now,
                       hang_restart_at=now)
    if moved:
        dispatch.cancel_after_commit(job.pk, backend_queue(job.backend))
    return moved


def hung_run(job: TrainingJob, *, status: JobStatus, figures: AttemptFigures, fields: Mapping[str, Any],
             checkpoint_uri: str, reason: str) -> Outcome:
    """Restart ``job`` (STOPPING, ``hang_restart_at`` set, its row locked by the caller), whose stop of a
    hung run ``status`` confirms (CANCELLED or FAILED), from its last checkpoint; or say why not (the cost
    of its attempts reached its budget, no restart left). ``reason``: the hang's line
    (:func:`jobs.hangs.hang_reason`); the other arguments as for :func:`lost_run`. Makes no provider call."""
    limit = int(job.backend.max_restarts)
    total = fields.get("cost_usd")
    if not restart_left(job):
        return Outcome(False, f"Cancelled: hung; max restarts {limit} reached. {reason}"[:2000])
    if job.budget_usd is not None and total is not None and Decimal(total) >= job.budget_usd:
        places = costs.usd_places(job.budget_usd, total)
        return Outcome(False, f"Cancelled: hung; not restarted: the cost of its attempts, "
                              f"{costs.format_usd(total, places)}, reached its budget of "
                              f"{costs.format_usd(job.budget_usd, places)}. {reason}"[:2000])
    following = int(job.attempt or 1) + 1
    return _resubmit(job, status=status, figures=figures, fields=fields, checkpoint_uri=checkpoint_uri,
                     outcome=JobAttempt.Outcome.HUNG, reason=_quoted(reason),
                     message=f"hung ({_quoted(reason)}); restarting from its last checkpoint, attempt {following} "
                             f"of {limit + 1}",
                     hung_at=None, hang={}, hang_restart_at=None, cancel_requested_at=None)


def lost_run(job: TrainingJob, *, status: JobStatus, figures: AttemptFigures, fields: Mapping[str, Any],
             checkpoint_uri: str) -> Outcome:
    """Resubmit ``job``, whose current run ``status`` reports lost, or say why not (module docstring).

    ``job``: its row, locked by the caller's transaction (:func:`jobs.sync._locked`); ``figures``: the
    lost attempt's own start, end, billable seconds and cost; ``fields``: the columns the sync would
    write (``cost_usd`` there is the sum over attempts, lost one included, which the budget is checked
    against); ``checkpoint_uri``: :func:`checkpoint_location` of the lost attempt (one that was itself given a
    ``job.checkpoint_uri`` wrote there, which wins). Returns
    ``Outcome(requeued=True)`` when the job moved to QUEUED (its ``submit_job`` is sent after commit),
    else the failure reason to end it with. Makes no provider call.
    """
    reason = _quoted(status.failure_reason or fields.get("failure_reason") or "")
    limit = int(job.backend.max_restarts)
    used = restarts_used(job)
    if limit <= 0:
        return Outcome(False, fields.get("failure_reason") or reason)
    if job.state not in RESUBMIT_FROM or job.cancel_requested_at is not None:
        return Outcome(False, fields.get("failure_reason") or reason)
    lost_times = used + 1
    if used >= limit:
        return Outcome(False, f"run lost {lost_times} time{'s' if lost_times != 1 else ''} ({reason}); "
                              f"max restarts {limit} reached")
    total = fields.get("cost_usd")
    if job.budget_usd is not None and total is not None and Decimal(total) >= job.budget_usd:
        places = costs.usd_places(job.budget_usd, total)
        return Outcome(False, f"run lost ({reason}); not resubmitted: the cost of its attempts, "
                              f"{costs.format_usd(total, places)}, reached its budget of "
                              f"{costs.format_usd(job.budget_usd, places)}")

    return _resubmit(job, status=status, figures=figures, fields=fields, checkpoint_uri=checkpoint_uri,
                     outcome=JobAttempt.Outcome.LOST, reason=reason,
                     message=f"run lost ({reason}); resubmitting, attempt {used + 2} of {limit + 1}")


def _resubmit(job: TrainingJob, *, status: JobStatus, figures: AttemptFigures, fields: Mapping[str, Any],
              checkpoint_uri: str, outcome: str, reason: str, message: str, **extra: Any) -> Outcome:
    """Close ``job``'s current attempt as a :class:`JobAttempt` (``outcome``, ``reason``) and move it to
    QUEUED for the next one with ``message`` (and a note when no checkpoint was found) and ``extra``
    columns; ``submit_job`` is sent after commit. :func:`lost_run` and :func:`hung_run` share it."""
    number = int(job.attempt or 1)
    # An attempt that resumed from an earlier one's directory wrote its checkpoints there too.
    checkpoint_uri = job.checkpoint_uri or checkpoint_uri
    JobAttempt.objects.create(
        job=job, number=number, provider_job_name=job.provider_job_name, provider_handle=job.provider_handle,
        raw_state=(status.raw_state or "")[:100], started_at=figures.started_at, ended_at=figures.ended_at,
        billable_seconds=figures.billable_seconds, instance_count=figures.instance_count,
        cost_usd=figures.cost_usd, outcome=outcome, reason=reason,
        checkpoint_uri=checkpoint_uri)
    following = number + 1
    resume = checkpoint_uri
    message += "" if resume else " (no checkpoint found: it starts over)"
    moved = transition(
        job, S.QUEUED, message=message, **extra,
        attempt=following, provider_job_name=attempt_job_name(job, following), provider_handle=None,
        checkpoint_uri=resume, log_cursor="", raw_state=(status.raw_state or "")[:100], secondary_state="",
        status_warning="", failure_reason="", started_at=None, first_step_at=None, ended_at=None,
        allocated_gpus=[], billable_seconds=fields.get("billable_seconds", 0.0),
        cost_usd=fields.get("cost_usd", Decimal("0")), instance_count=figures.instance_count,
        last_synced_at=fields.get("last_synced_at"), submitted_at=None)
    if not moved:  # the caller holds the row: another writer cannot have moved it; keep the books right
        JobAttempt.objects.filter(job_id=job.pk, number=number).delete()
        return Outcome(False, fields.get("failure_reason") or reason)
    dispatch.submit_after_commit(job.pk, backend_queue(job.backend))
    return Outcome(True)
