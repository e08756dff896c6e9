"""State deadlines (DESIGN.md §4): how long a job may stay in each non-terminal state, and the
words for a job past it.

Each non-terminal state has a deadline in seconds: ``TRAINBOARD_STATE_DEADLINES_S`` overridden by
the backend's ``state_deadlines``; RUNNING defaults to the job's max runtime +
``TRAINBOARD_RUNNING_DEADLINE_MARGIN_S``. The backend service checks a backend's deadlines with
:func:`clean_state_deadlines`, the backend form offers :data:`DEADLINE_STATES`, and the recovery
sweep (:mod:`jobs.recovery`) flags a job past its deadline with :func:`stall_reason`.

A leaf module: it imports no service.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any, Mapping

from django.conf import settings

from jobs.models import ACTIVE_STATE_VALUES, ComputeBackend, JobStateChoices as S, TrainingJob

log = logging.getLogger(__name__)

DEADLINE_STATES = tuple(ACTIVE_STATE_VALUES)
"""The states a deadline may be set for (the non-terminal ones)."""
MAX_STATE_DEADLINE_S = 365 * 24 * 3600
"""The longest deadline a backend may set: a year (31,536,000 s), over 13 times the longest max runtime
(28 days). Bounded so that ``now − deadline`` stays a date (``timedelta(seconds=1e300)`` overflows)."""


def clean_state_deadlines(value: Any) -> tuple[dict[str, float], list[str]]:
    """Check a backend's ``state_deadlines``: ``{state: seconds}`` for non-terminal states, each a
    positive number of seconds up to :data:`MAX_STATE_DEADLINE_S`. Returns (the cleaned dict, error
    messages); the dict is empty when there are errors. ``None`` or ``{}`` means "use the defaults"."""
    if value in (None, ""):
        return {}, []
    if not isinstance(value, Mapping):
        return {}, ['State deadlines must be an object of state: seconds, e.g. {"PENDING": 3600}.']
    errors, cleaned = [], {}
    for state, seconds in value.items():
        name = str(state).upper()
        if name not in DEADLINE_STATES:
            errors.append(f"{state}: not a state with a deadline; use one of {', '.join(DEADLINE_STATES)} "
                          f"(terminal states have none).")
            continue
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds != seconds \
                or seconds <= 0:
            errors.append(f"{name}: the deadline must be a positive number of seconds (got {seconds!r}).")
            continue
        if seconds > MAX_STATE_DEADLINE_S:
            errors.append(f"{name}: the deadline must be at most {MAX_STATE_DEADLINE_S:,} seconds (365 days); "
                          f"leave the state out for the default.")
            continue
        cleaned[name] = int(seconds) if float(seconds).is_integer() else float(seconds)
    return ({} if errors else cleaned), errors


def state_deadline_s(job: TrainingJob, backend: ComputeBackend | None = None) -> float | None:
    """Seconds ``job`` may stay in its current state, or None for a terminal state and for a QUEUED
    job that waits for its GPU box (:func:`is_waiting`: a full box is not a stuck one; the job shows
    its wait reason, never "stalled").

    The backend's ``state_deadlines`` entry if it has one, else ``TRAINBOARD_STATE_DEADLINES_S``;
    RUNNING without either: ``max_runtime_s`` + ``TRAINBOARD_RUNNING_DEADLINE_MARGIN_S``."""
    state = str(job.state)
    if state not in DEADLINE_STATES or is_waiting(job):
        return None
    backend = backend or job.backend
    own = (backend.state_deadlines or {}) if isinstance(backend.state_deadlines, Mapping) else {}
    if own.get(state):
        return float(own[state])
    if state == S.RUNNING:
        return float(job.max_runtime_s) + float(settings.TRAINBOARD_RUNNING_DEADLINE_MARGIN_S)
    default = settings.TRAINBOARD_STATE_DEADLINES_S.get(state)
    return float(default) if default else None


def is_waiting(job: TrainingJob) -> bool:
    """Whether ``job`` is QUEUED because its backend holds it back (``wait_reason``, e.g. "waiting
    for 4 GPUs on box-a (2 free)": :mod:`jobs.admission`), rather than because no worker took it."""
    return str(job.state) == S.QUEUED and bool(job.wait_reason)


def deadline_start(job: TrainingJob) -> dt.datetime:
    """When the job's current deadline started. SUBMITTING counts from the first attempt
    (``submitted_at``): a resumed submission renews its lease, not its deadline."""
    candidates = [job.state_entered_at]
    if job.state == S.SUBMITTING:
        candidates.append(job.submitted_at)
    found = [c for c in candidates if c is not None]
    return min(found) if found else (job.updated_at or job.created_at)


def human_duration(seconds: float) -> str:
    """``3720`` → ``"1h 02m"``, ``600`` → ``"10m"``, ``75`` → ``"1m 15s"``, ``90000`` → ``"1d 01h"``:
    the two largest units, the second zero-padded and left out when zero."""
    seconds = int(max(seconds, 0))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    for big, big_unit, small, small_unit in ((days, "d", hours, "h"), (hours, "h", minutes, "m"),
                                             (minutes, "m", secs, "s")):
        if big:
            return f"{big}{big_unit}" + (f" {small:02d}{small_unit}" if small else "")
    return f"{secs}s"


def stall_reason(job: TrainingJob, now: dt.datetime, deadline_s: float) -> str:
    """``"PENDING for 1h 02m, past the backend's 1h deadline"`` (RUNNING adds the max runtime)."""
    age = (now - deadline_start(job)).total_seconds()
    reason = f"{job.state} for {human_duration(age)}, past the backend's {human_duration(deadline_s)} deadline"
    if job.state == S.RUNNING and not (job.backend.state_deadlines or {}).get(S.RUNNING):
        reason += f" (max runtime {human_duration(job.max_runtime_s)} + " \
                  f"{human_duration(settings.TRAINBOARD_RUNNING_DEADLINE_MARGIN_S)})"
    return reason

