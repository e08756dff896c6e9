"""The job state machine (DESIGN.md §4): the legal moves and the one function that makes them.

Every state change anywhere (services, tasks, admin) goes through :func:`transition`, which

* rejects an illegal move with :class:`IllegalTransition` (a programming error, never user input),
* writes with a conditional ``UPDATE ... WHERE id = %s AND state = <the state the caller saw>`` so two
  workers racing on one job cannot both move it (the loser gets ``False`` and writes nothing),
* stamps ``ended_at`` on a terminal state, clears ``wait_reason`` on the way out of QUEUED, appends a
  :class:`~jobs.models.JobEvent` and refreshes the instance.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from jobs.models import TERMINAL_STATE_VALUES, JobEvent, JobStateChoices as S, TrainingJob
from jobs.signals import job_state_changed

log = logging.getLogger(__name__)

ALLOWED: dict[str, frozenset[str]] = {
    S.QUEUED: frozenset({S.SUBMITTING, S.CANCELLED, S.FAILED}),
    # → QUEUED is a resubmission (jobs.restarts): the run was lost (a preemption the provider does
    # not restart itself, a host that failed) and the job waits for its next attempt, which resumes
    # from the lost one's checkpoint. Only Trainboard makes it, never a provider's state.
    S.SUBMITTING: frozenset({S.PENDING, S.RUNNING, S.FAILED, S.STOPPING, S.QUEUED}),
    S.PENDING: frozenset({S.RUNNING, S.STOPPING, S.FAILED, S.SUCCEEDED, S.CANCELLED, S.QUEUED}),
    # RUNNING -> PENDING is an interruption (models.INTERRUPTION): a spot reclaim or preemption, after
    # which the provider waits for capacity and restarts the job from its checkpoint.
    S.RUNNING: frozenset({S.PENDING, S.STOPPING, S.SUCCEEDED, S.FAILED, S.CANCELLED, S.QUEUED}),
    # STOPPING -> QUEUED: a hung run stopped by its backend's hang policy ``restart``, restarted once the
    # provider confirmed the stop (jobs.restarts.hung_run). Only Trainboard makes it.
    S.STOPPING: frozenset({S.CANCELLED, S.FAILED, S.SUCCEEDED, S.QUEUED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
"""from state -> the states it may move to. Terminal states go nowhere."""


class IllegalTransition(Exception):
    """A move the state machine does not allow, e.g. SUCCEEDED -> RUNNING."""


def is_allowed(from_state: str, to_state: str) -> bool:
    return to_state in ALLOWED.get(str(from_state), frozenset())


def transition(job: TrainingJob, to_state: str, *, message: str = "", **fields: Any) -> bool:
    """Move ``job`` from the state it holds in memory to ``to_state``; write ``fields`` with it.

    Returns ``True`` when this call moved the job, ``False`` when the row's state in the database is
    no longer ``job.state`` (someone else moved it first): then nothing is written and the instance
    is refreshed so the caller sees the current state.

    ``ended_at`` is set to now on a terminal state unless ``fields`` carries one. Raises
    :class:`IllegalTransition` for a move not in :data:`ALLOWED`.
    """
    from_state = str(job.state)
    to_state = str(to_state)
    if not is_allowed(from_state, to_state):
        raise IllegalTransition(f"job {job.pk}: {from_state} → {to_state} is not a legal transition")
    now = timezone.now()
    if to_state in TERMINAL_STATE_VALUES and not fields.get("ended_at"):
        fields["ended_at"] = job.ended_at or now
    fields["state"] = to_state
    fields["updated_at"] = now
    fields.setdefault("state_entered_at", now)
    fields.setdefault("stalled_at", None)  # a new state starts a new deadline
    fields.setdefault("stalled_reason", "")
    if from_state == S.QUEUED:
        fields.setdefault("wait_reason", "")  # out of the queue: no longer waiting (jobs.admission)
    with transaction.atomic():
        updated = TrainingJob.objects.filter(pk=job.pk, state=from_state).update(**fields)
        if updated:
            event = JobEvent.objects.create(job_id=job.pk, from_state=from_state, to_state=to_state,
                                            message=message)
            announce = functools.partial(_announce, job.pk, from_state, to_state, message, event.pk)
            transaction.on_commit(announce, robust=True)
    job.refresh_from_db()
    return bool(updated)


def note(job_id: int, state: str, message: str) -> JobEvent:
    """Append a note to job ``job_id``'s timeline: a :class:`~jobs.models.JobEvent` that records something
    that happened while it stayed in its state (a wait reason, a stall, a re-sent submission),
    with ``from_state`` = ``state`` (the job's) and a blank ``to_state`` (:attr:`JobEvent.is_note`). No state
    changes, and a move from a state to itself is never recorded. ``message`` is cut to 2000
    characters."""
    return JobEvent.objects.create(job_id=job_id, from_state=str(state), to_state="", message=str(message)[:2000])


def _announce(job_id: int, from_state: str, to_state: str, message: str, event_id: int) -> None:
    """Send :data:`jobs.signals.job_state_changed` for a committed move; a listener that raises is
    logged, never the mover's failure."""
    for receiver, result in job_state_changed.send_robust(
            sender=TrainingJob, job_id=job_id, from_state=from_state, to_state=to_state, message=message,
            event_id=event_id):
        if isinstance(result, Exception):
            log.error("job %s: %s on %s → %s failed: %r", job_id, getattr(receiver, "__qualname__", receiver),
                      from_state, to_state, result)
