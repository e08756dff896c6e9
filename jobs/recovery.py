"""The recovery sweep: what a lost message, a killed worker or a stuck provider would leave behind.

The database is the source of truth (DESIGN.md §2). Beat runs :func:`recovery_sweep` every
``TRAINBOARD_RECOVERY_INTERVAL_S`` seconds (``jobs.tasks.recovery_sweep``); it is safe to run twice
at once (each job is taken with ``SELECT ... FOR NO KEY UPDATE OF <the job> SKIP LOCKED``, :func:`_take`,
and every write is conditional):

1. **Lost submissions.** A QUEUED job no worker picked up for ``TRAINBOARD_RECOVERY_REQUEUE_AFTER_S``
   (its message was lost with a broker restart, or the enqueue failed) gets its ``submit_job`` message
   sent again, at most once per that period. A duplicate message is harmless: the QUEUED → SUBMITTING
   update is conditional.
2. **Killed workers.** A SUBMITTING (or STOPPING) job without a provider handle whose submission is
   older than the submit task's hard time limit (``TRAINBOARD_SUBMIT_TIME_LIMIT_S``) lost its worker
   before or just after the provider call. The sweep takes the submission over
   (:func:`jobs.lifecycle.submission_claim`) and sends ``submit_job`` with its claim: the adapter
   adopts the provider job of the same deterministic name, or creates it if the first call never
   arrived. After ``TRAINBOARD_RECOVERY_MAX_RESUMES`` resumes the job is FAILED with the reason.
   A QUEUED job that its GPU box holds back (``wait_reason``: :mod:`jobs.admission`) is waiting, not
   lost: instead, the first waiting job of each such backend gets its ``submit_job`` again (no event),
   so a lost wake-up delays it by one sweep at most; it starts if it fits now.
3. **Deadlines (DESIGN.md §4).** Each non-terminal state has a deadline in seconds:
   ``TRAINBOARD_STATE_DEADLINES_S`` overridden by the backend's ``state_deadlines``; RUNNING defaults
   to the job's max runtime + ``TRAINBOARD_RUNNING_DEADLINE_MARGIN_S`` (:mod:`jobs.deadlines`). A job past it is flagged
   (``stalled_at``, ``stalled_reason``, a JobEvent with the reason) and, when the backend's
   ``stall_policy`` is ``cancel``, cancelled with that reason. The next transition clears the flag.
4. **Hangs (issue 30).** A RUNNING job with no new step for its hang deadline (:mod:`jobs.hangs`) is
   flagged hung (:func:`flag_hung_jobs`) and, under the backend's ``hang_policy`` ``cancel``, cancelled.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Mapping

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from jobs import admission, dispatch, hangs, notifications
from jobs.adapters import backend_queue
from jobs.deadlines import DEADLINE_STATES, deadline_start, human_duration, stall_reason, state_deadline_s
from jobs.lifecycle import submission_claim, submit_lease_s, training_job_fail
from jobs.models import ComputeBackend, JobEvent, JobStateChoices as S, TrainingJob
from jobs.services import training_job_cancel
from jobs.sync import hung
from jobs.states import note

log = logging.getLogger(__name__)

REQUEUE_MESSAGE = "Recovery: submission re-sent"
RESUME_MESSAGE = "Recovery: resuming the submission"


# ---------------------------------------------------------------------------------------------
# Deadlines
# ---------------------------------------------------------------------------------------------


def flag_stalled_jobs(*, now: dt.datetime | None = None) -> list[int]:
    """Flag every active job past its state's deadline; cancel it where the backend says so.

    Each job is flagged once per state (``stalled_at`` is cleared by the next transition), with a
    note (:func:`jobs.states.note`: from_state its state, to_state blank) carrying the reason. Returns the flagged job ids."""
    now = now or timezone.now()
    flagged = []
    candidates = (TrainingJob.objects.filter(_maybe_past_deadline(now), stalled_at__isnull=True)
                  .select_related("backend").order_by("id"))
    for job in candidates.iterator(chunk_size=500):
        deadline = state_deadline_s(job)
        if deadline is None or (now - deadline_start(job)).total_seconds() <= deadline:
            continue
        if _flag_one(job, now, deadline):
            flagged.append(job.pk)
    return flagged


def _maybe_past_deadline(now: dt.datetime) -> Q:
    """Active jobs that may be past their deadline: in their state for longer than the shortest
    deadline any backend gives it, so each sweep reads only those rows, not every active job."""
    shortest: dict[str, float] = {state: float(seconds) for state, seconds
                                  in settings.TRAINBOARD_STATE_DEADLINES_S.items() if state in DEADLINE_STATES}
    shortest[S.RUNNING] = 1 + float(settings.TRAINBOARD_RUNNING_DEADLINE_MARGIN_S)  # max runtime ≥ 1 s
    for deadlines in ComputeBackend.objects.exclude(state_deadlines={}).values_list("state_deadlines", flat=True):
        for state, seconds in (deadlines or {}).items() if isinstance(deadlines, Mapping) else ():
            if state in DEADLINE_STATES and isinstance(seconds, (int, float)) and seconds > 0:
                shortest[state] = min(shortest.get(state, float("inf")), float(seconds))
    query = Q(state__in=DEADLINE_STATES, state_entered_at__isnull=True)
    for state in DEADLINE_STATES:
        if state not in shortest:
            query |= Q(state=state)
            continue
        before = now - dt.timedelta(seconds=shortest[state])
        query |= Q(state=state, state_entered_at__lt=before)
        if state == S.SUBMITTING:
            query |= Q(state=state, submitted_at__lt=before)
    return query


def _flag_one(job: TrainingJob, now: dt.datetime, deadline: float) -> bool:
    reason = stall_reason(job, now, deadline)
    with transaction.atomic():
        # Conditional on the state and the unflagged row: a second sweep, or a transition that
        # happened since the read, makes this a no-op.
        if not TrainingJob.objects.filter(pk=job.pk, state=job.state, state_entered_at=job.state_entered_at,
                                          stalled_at__isnull=True).update(stalled_at=now, stalled_reason=reason):
            return False
        note(job.pk, job.state, f"Stalled: {reason}")
        log.warning("job %s stalled: %s", job.pk, reason)
        notifications.job_stalled(job=job, reason=reason)  # rows in this transaction, sent after commit
        if job.backend.stall_policy == ComputeBackend.StallPolicy.CANCEL:
            job.refresh_from_db()
            try:
                training_job_cancel(job=job, reason=f"Stalled: {reason}")
            except ValidationError:  # it ended meanwhile: nothing to cancel
                pass
    return True


# ---------------------------------------------------------------------------------------------
# Hangs (jobs.hangs): no new step for the job's hang deadline
# ---------------------------------------------------------------------------------------------


def flag_hung_jobs(*, now: dt.datetime | None = None) -> list[int]:
    """Flag every RUNNING job whose newest record (``progress_at``) is older than its hang deadline
    (:func:`jobs.hangs.deadline_s` of its recent records, or its backend's ``hang_deadline_s``) and
    that is not flagged yet; the note and the backend's ``hang_policy`` as for the launcher's records
    (:func:`jobs.sync.hung`). The flag carries no stack: the launcher's records, when they come,
    replace it. A job that never logged a step is left to the RUNNING deadline. Returns the flagged ids."""
    now = now or timezone.now()
    overrides = [s for s in ComputeBackend.objects.filter(hang_deadline_s__gt=0)
                 .values_list("hang_deadline_s", flat=True)]
    shortest = min([hangs.MIN_DEADLINE_S, *overrides])
    flagged = []
    candidates = (TrainingJob.objects.filter(state=S.RUNNING, hung_at__isnull=True,
                                             progress_at__lt=now - dt.timedelta(seconds=shortest))
                  .select_related("backend").order_by("id"))
    for job in candidates.iterator(chunk_size=500):
        deadline = hangs.deadline_s(job.progress_recent, job.backend.hang_deadline_s)
        if hangs.silent_for(job.progress_at, now) <= deadline:
            continue
        hang = hangs.sweep_hang(step=job.progress_step, step_at=job.progress_at, deadline=deadline, now=now)
        with transaction.atomic():
            # Conditional on what was read: a newer record, a transition or another sweep makes it a no-op.
            if not TrainingJob.objects.filter(pk=job.pk, state=S.RUNNING, hung_at__isnull=True,
                                              progress_at=job.progress_at).update(hung_at=now, hang=hang):
                continue
            job.hung_at, job.hang = now, hang
            hung(job)
        flagged.append(job.pk)
    return flagged


# ---------------------------------------------------------------------------------------------
# Lost messages and killed workers
# ---------------------------------------------------------------------------------------------


def _take():
    """Jobs to lock for one recovery, skipping those another transaction holds (a second sweep).

    Only the job's row is locked (``OF``), never its backend's that ``select_related`` joins: a
    backend's row is shared by all its jobs, so locking it made a sweep skip every job of the
    backend while another transaction held it or had only just touched it (the other sweep holding
    another job; or committing the cancel of a stalled job, whose foreign-key checks lock the
    backend's row, FOR KEY SHARE, when the job's row was written twice in the transaction): two
    sweeps at once could then both skip a job and neither recover it. ``NO KEY UPDATE`` (what an
    UPDATE of non-key columns takes) still excludes the other sweep and any writer of the row, but not
    a transaction that only adds a row pointing at the job (a JobEvent: FOR KEY SHARE of the job)."""
    return TrainingJob.objects.select_for_update(skip_locked=True, no_key=True, of=("self",))


def requeue_lost_submissions(*, now: dt.datetime | None = None) -> list[int]:
    """Send ``submit_job`` again for QUEUED jobs older than ``TRAINBOARD_RECOVERY_REQUEUE_AFTER_S``
    that were not re-sent within that period. Returns their ids."""
    now = now or timezone.now()
    after = dt.timedelta(seconds=float(settings.TRAINBOARD_RECOVERY_REQUEUE_AFTER_S))
    # A job its GPU box holds back (a wait reason) was taken by a worker: it is waiting, not lost.
    ids = list(TrainingJob.objects.filter(state=S.QUEUED, state_entered_at__lt=now - after, wait_reason="")
               .order_by("id").values_list("pk", flat=True))
    sent = []
    for job_id in ids:
        with transaction.atomic():
            job = (_take().select_related("backend")
                   .filter(pk=job_id, state=S.QUEUED, wait_reason="").first())
            if job is None:
                continue
            if JobEvent.objects.filter(job_id=job_id, message__startswith=REQUEUE_MESSAGE,
                                       created_at__gte=now - after).exists():
                continue
            waited = human_duration((now - (job.state_entered_at or job.created_at)).total_seconds())
            note(job_id, S.QUEUED, f"{REQUEUE_MESSAGE} (no worker had started it after {waited})")
            dispatch.resubmit_after_commit(job_id, backend_queue(job.backend), None)
            sent.append(job_id)
    return sent


def wake_waiting_jobs() -> list[int]:
    """Send ``submit_job`` for the first waiting job of each backend that has one (a GPU box that
    holds jobs back: :func:`jobs.admission.wake_waiting`), should the wake-up that a job's end sends
    have been lost; it starts if it fits, else it keeps waiting. Returns the ids sent."""
    backend_ids = (TrainingJob.objects.filter(state=S.QUEUED).exclude(wait_reason="")
                   .values_list("backend_id", flat=True).distinct())
    sent = []
    for backend in ComputeBackend.objects.filter(pk__in=list(backend_ids)).order_by("id"):
        with transaction.atomic():
            if (job_id := admission.wake_waiting(backend)) is not None:
                sent.append(job_id)
    return sent


def resume_stuck_submissions(*, now: dt.datetime | None = None) -> list[int]:
    """Take over SUBMITTING/STOPPING jobs without a provider handle whose submission lease expired
    (their worker died) and send ``submit_job`` with the new claim; FAIL those resumed
    ``TRAINBOARD_RECOVERY_MAX_RESUMES`` times already. Returns the ids resumed or failed."""
    now = now or timezone.now()
    lease = dt.timedelta(seconds=submit_lease_s())
    ids = list(TrainingJob.objects.filter(state__in=(S.SUBMITTING, S.STOPPING), provider_handle__isnull=True,
                                          state_entered_at__lt=now - lease)
               .order_by("id").values_list("pk", flat=True))
    done = []
    for job_id in ids:
        with transaction.atomic():
            job = (_take().select_related("backend")
                   .filter(pk=job_id, provider_handle__isnull=True).first())
            if job is None or job.state not in (S.SUBMITTING, S.STOPPING):
                continue
            resumes = JobEvent.objects.filter(job_id=job_id, message__startswith=RESUME_MESSAGE).count()
            if resumes >= int(settings.TRAINBOARD_RECOVERY_MAX_RESUMES):
                training_job_fail(job, f"The submission did not finish after {resumes} resumed attempts (the "
                                       f"worker was lost each time); if the provider started "
                                       f"{job.provider_job_name}, the Orphans page lists it.")
                done.append(job_id)
                continue
            if not submission_claim(job, None):
                continue
            note(job_id, job.state, f"{RESUME_MESSAGE} (attempt {resumes + 2}: no provider handle "
                                    f"{human_duration(lease.total_seconds())} after the last attempt began)")
            dispatch.resubmit_after_commit(job_id, backend_queue(job.backend), job.state_entered_at.isoformat())
            done.append(job_id)
    return done


def recovery_sweep(*, now: dt.datetime | None = None) -> dict[str, int]:
    """One pass of all four (module docstring), waking waiting jobs with the first. Returns how many jobs each step touched."""
    now = now or timezone.now()
    return {
        "requeued": len(requeue_lost_submissions(now=now)),
        "resumed": len(resume_stuck_submissions(now=now)),
        "woken": len(wake_waiting_jobs()),
        "stalled": len(flag_stalled_jobs(now=now)),
        "hung": len(flag_hung_jobs(now=now)),
    }

