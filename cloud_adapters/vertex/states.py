"""Vertex AI ``CustomJob`` → :class:`~cloud_adapters.base.JobStatus` (DESIGN.md §4, Vertex row).

Values and meanings from ``aiplatform_v1.JobState`` (clouds.md §2.2 and the docstring quoted in
§2.6-A [GAPIC]):

===========================  ==========  ===================================================
JobState                     JobState    why
===========================  ==========  ===================================================
JOB_STATE_QUEUED             PENDING     created or resumed, processing not begun; RUNNING once the job
                                         has run (``start_time`` set): a resumed job
JOB_STATE_PENDING            PENDING     the service is preparing to run the job; RUNNING once it has run
JOB_STATE_RUNNING            RUNNING
JOB_STATE_UPDATING           RUNNING     + warning; "only RUNNING jobs can be updated; after updating the
                                         job goes back to RUNNING"
JOB_STATE_PAUSED             PENDING     "stopped, and can be resumed": not terminal; RUNNING once it has
                                         run; ``secondary_state`` PAUSED, so the page shows it paused
JOB_STATE_CANCELLING         STOPPING    "may only go to SUCCEEDED, FAILED or CANCELLED"
JOB_STATE_SUCCEEDED          SUCCEEDED
JOB_STATE_FAILED             FAILED      reason = ``job.error`` (google.rpc.Status code + message)
JOB_STATE_EXPIRED            FAILED      "the job has expired"; reason says so (+ ``job.error``)
JOB_STATE_PARTIALLY_SUCCEEDED FAILED     "some results may be missing due to errors": a training run whose
                                         outputs may be incomplete is not reported SUCCEEDED; the reason
                                         says it partially succeeded (+ ``job.error``)
JOB_STATE_CANCELLED          CANCELLED   (Vertex sets ``error.code`` 1 = CANCELLED, §2.2)
JOB_STATE_UNSPECIFIED, any   PENDING     + warning naming the value; the job stays non-terminal
other value
===========================  ==========  ===================================================

The dashboard never moves a RUNNING job back: a job that has run (Vertex AI sets ``start_time`` "when
the job first entered RUNNING") and is paused, or resumed and queued again (PAUSED → QUEUED →
PENDING → RUNNING), stays RUNNING — no interruption is counted — and shows the provider's state
beside it (:data:`AFTER_RUN`).

Vertex AI restarts a worker itself (VM maintenance, a non-zero exit it deems transient), and the whole
job with ``restart_job_on_worker_restart``; Trainboard leaves those alone. A spot job that ends
JOB_STATE_FAILED with an error naming the preemption (:func:`preempted`) was lost after Vertex AI
gave up: its status has ``lost`` set (docs/recovery.md).

A state newer than the installed SDK: the REST client parses responses with
``ignore_unknown_fields=True``, which drops an enum name it does not know and leaves the field at 0
(``JOB_STATE_UNSPECIFIED``). The adapter reads the provider's own string from the response body
(:class:`RawStates`) and passes it to :func:`job_status`, so the warning and ``raw_state`` name
what Vertex sent (e.g. ``JOB_STATE_SUSPENDED``), not ``JOB_STATE_UNSPECIFIED``.

Times: ``started_at`` = ``start_time`` ("when the job first entered RUNNING"), ``ended_at`` =
``end_time`` (terminal states only). Vertex reports no billable seconds: cost is priced from the run
interval (DESIGN.md §6); ``training_seconds`` = ``end_time`` − ``start_time`` once the job ended (while
it runs the dashboard measures the interval to its own clock). ``instance_count`` = the replicas of worker pools 0 and 1 (= nodes); ``spot`` =
``scheduling.strategy`` SPOT.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from typing import Any, Mapping

from cloud_adapters.base import PAUSED, JobState, JobStatus, parse_utc
from cloud_adapters.cloud import StateTable

STATE_MAP: dict[str, JobState] = {
    "JOB_STATE_QUEUED": JobState.PENDING,
    "JOB_STATE_PENDING": JobState.PENDING,
    "JOB_STATE_RUNNING": JobState.RUNNING,
    "JOB_STATE_UPDATING": JobState.RUNNING,
    "JOB_STATE_PAUSED": JobState.PENDING,  # RUNNING once it has run (AFTER_RUN)
    "JOB_STATE_CANCELLING": JobState.STOPPING,
    "JOB_STATE_SUCCEEDED": JobState.SUCCEEDED,
    "JOB_STATE_FAILED": JobState.FAILED,
    "JOB_STATE_EXPIRED": JobState.FAILED,
    "JOB_STATE_PARTIALLY_SUCCEEDED": JobState.FAILED,
    "JOB_STATE_CANCELLED": JobState.CANCELLED,
}
"""Every named ``JobState`` except UNSPECIFIED (which warns) → the normalized state."""

AFTER_RUN: dict[str, JobState] = dict.fromkeys(("JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_PAUSED"),
                                               JobState.RUNNING)
"""States whose meaning differs once the job has run (``start_time`` set): paused, or resumed and
waiting to run again — never a move back to PENDING, never an interruption."""

STATES = StateTable(
    states=STATE_MAP,
    warnings={
        "JOB_STATE_UPDATING": "Vertex AI is updating the running job; shown as RUNNING until it returns to RUNNING.",
    },
    unknown="Vertex AI reported an unknown job state {raw!r}; the job stays non-terminal until a known state arrives.",
)
"""The module's table, as data."""

# google.rpc.Code names for job.error.code (the values Vertex puts in CustomJob.error).
_RPC_CODES = {
    1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
    10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
    15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


def proto_time(value: Any) -> dt.datetime | None:
    """A proto-plus Timestamp (an aware ``DatetimeWithNanoseconds``) in UTC; None when unset, which
    proto-plus gives as the epoch."""
    when = parse_utc(value)
    return when if when is not None and when.timestamp() > 0 else None


def state_name(job: Any, provider_state: str | None = None) -> str:
    """The job's ``JobState`` name (``JOB_STATE_RUNNING``); ``str(int)`` for a value the SDK does not know.

    ``provider_state``: the ``state`` string of the raw response (:class:`RawStates`); it wins when
    the parsed proto holds ``JOB_STATE_UNSPECIFIED`` (0), which is what the REST client leaves for
    an enum name it does not know."""
    state = getattr(job, "state", 0)
    if provider_state and not int(state or 0):
        return str(provider_state)
    name = getattr(state, "name", None)
    return str(name) if name else str(state)


class RawStates:
    """The ``state`` strings of CustomJobs as the Vertex REST API sent them, by resource name, for
    the jobs whose state the installed SDK does not know (the parsed proto then says
    JOB_STATE_UNSPECIFIED). Fed by :meth:`on_response`, a ``requests`` response hook on the
    REST transport's session; thread-safe. At most :attr:`limit` names are kept (oldest dropped)."""

    def __init__(self, known: frozenset[str], limit: int = 10_000) -> None:
        self.known = known  # JobState names the SDK parses itself
        self.limit = limit
        self._states: dict[str, str] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> str | None:
        with self._lock:
            return self._states.get(str(name))

    def note(self, body: Mapping[str, Any]) -> None:
        """Record the unknown states of a GetCustomJob (a CustomJob) or ListCustomJobs
        (``customJobs[]``) response body; forget a job once its state is a known one again."""
        jobs = body.get("customJobs") if isinstance(body.get("customJobs"), list) else [body]
        with self._lock:
            for job in jobs:
                if not isinstance(job, Mapping) or not isinstance(job.get("name"), str):
                    continue
                state = job.get("state")
                if isinstance(state, str) and state and state not in self.known:
                    self._states.pop(job["name"], None)
                    self._states[job["name"]] = state
                    while len(self._states) > self.limit:
                        self._states.pop(next(iter(self._states)))
                else:
                    self._states.pop(job["name"], None)

    def on_response(self, response: Any, *args: Any, **kwargs: Any) -> Any:
        """``requests`` hook: note the states of a JSON CustomJob response; never raises."""
        if "/customJobs" not in str(getattr(response, "url", "")) or not getattr(response, "ok", False):
            return response
        try:
            body = json.loads(response.content)
        except (ValueError, TypeError):
            return response
        if isinstance(body, Mapping):
            self.note(body)
        return response


def error_text(job: Any) -> str:
    """``job.error`` as ``"RESOURCE_EXHAUSTED (8): <message>"``, or "" when unset."""
    error = getattr(job, "error", None)
    code = int(getattr(error, "code", 0) or 0)
    message = str(getattr(error, "message", "") or "")
    if not code and not message:
        return ""
    label = f"{_RPC_CODES.get(code, 'code')} ({code})" if code else ""
    return ": ".join(p for p in (label, message) if p)


def replica_count(job: Any) -> int:
    """Machines of the job: replicas of worker pool 0 (the chief) + pool 1 (workers); at least 1."""
    pools = list(getattr(getattr(job, "job_spec", None), "worker_pool_specs", None) or [])
    return max(1, sum(int(p.replica_count or 0) for p in pools[:2]))


def is_spot(job: Any) -> bool:
    from google.cloud.aiplatform_v1 import Scheduling

    scheduling = getattr(getattr(job, "job_spec", None), "scheduling", None)
    return scheduling is not None and scheduling.strategy == Scheduling.Strategy.SPOT


PREEMPTION_WORDS = ("preempt", "stockout", "spot vm")
"""Words of ``job.error``'s message that name a Spot VM reclaim (Vertex AI, "Use Spot VMs with
training": a preempted Spot VM fails the job with a STOCKOUT error once Vertex AI's own restarts of
the worker are spent)."""


def preempted(error: str) -> bool:
    """Whether a failed spot job's error says its VMs were reclaimed: a lost run Vertex AI does not
    restart any more (its own worker restarts — VM maintenance, restart_job_on_worker_restart — end
    before the job is FAILED), which Trainboard may resubmit (docs/recovery.md)."""
    text = (error or "").lower()
    return any(word in text for word in PREEMPTION_WORDS)


def job_status(job: Any, provider_state: str | None = None) -> JobStatus:
    """The :class:`JobStatus` of one ``aiplatform_v1.CustomJob`` (see the module's table);
    ``provider_state`` as for :func:`state_name`."""
    raw = state_name(job, provider_state)
    state, warning = STATES.resolve(raw)
    started = proto_time(getattr(job, "start_time", None))
    if started is not None:
        state = AFTER_RUN.get(raw, state)
    error = error_text(job)
    reason = ""
    if raw == "JOB_STATE_FAILED":
        reason = error or "Vertex AI reported the job failed without an error message"
    elif raw == "JOB_STATE_EXPIRED":
        reason = "Vertex AI expired the job before it finished" + (f" ({error})" if error else "")
    elif raw == "JOB_STATE_PARTIALLY_SUCCEEDED":
        reason = ("Vertex AI reports the job partially succeeded: some results may be missing due to errors"
                  + (f" ({error})" if error else ""))
    elif raw == "JOB_STATE_CANCELLED":
        reason = "cancelled in Vertex AI (CancelCustomJob)"

    ended = proto_time(getattr(job, "end_time", None)) if state.is_terminal else None
    training = max(0.0, (ended - started).total_seconds()) if started and ended else None
    spot = is_spot(job)
    return JobStatus(
        lost=raw == "JOB_STATE_FAILED" and spot and preempted(error),
        state=state,
        raw_state=raw,
        secondary_state=PAUSED if raw == "JOB_STATE_PAUSED" else "",
        failure_reason=reason,
        started_at=started,
        ended_at=ended,
        billable_seconds=None,
        training_seconds=training,
        instance_count=replica_count(job),
        warning=warning,
        spot=spot,
    )
