"""Azure ML job status → :class:`~cloud_adapters.base.JobStatus` (DESIGN.md §4, Azure ML row).

Values of the REST ``JobStatus`` enum (clouds.md §3.3 [AML ``_enums.py``], all fourteen):

==============================================================  ======================================
Azure ML status                                                 JobState
==============================================================  ======================================
NotStarted, Queued, Preparing, Provisioning, Starting           PENDING
Running, Finalizing                                             RUNNING
CancelRequested                                                 STOPPING
Completed                                                       SUCCEEDED
Failed, NotResponding                                           FAILED, with the job's error message
Canceled                                                        CANCELLED
Paused, Unknown                                                 PENDING + ``warning`` (non-terminal)
anything else                                                   PENDING + ``warning`` (non-terminal)
==============================================================  ======================================

Provisioning is on-demand compute creation and Preparing the image build (clouds.md §3.3
[AML ``_run_history_constants.py``]): no training yet, so PENDING. Finalizing is post-processing
after the command ended (outputs uploaded): the nodes are still held, so RUNNING.
A low-priority job whose nodes are preempted is requeued by Azure ML itself (back to Queued: the
dashboard's interruption); one that ends Failed with an error naming the preemption
(:func:`preempted`) has ``lost`` set (docs/recovery.md).
NotResponding (the run stopped reporting) is FAILED: the service gives up on the job. Paused and
Unknown say nothing about progress: the job stays non-terminal (PENDING, which the dashboard's state
machine never moves a RUNNING job back to) with a warning naming the status.

Times (not in clouds.md — the ARM job resource has no start/end fields, §3.2): ``started_at`` and
``ended_at`` are the run properties ``StartTimeUtc`` / ``EndTimeUtc`` that the service stamps on the
job's ``properties`` once it runs / ends; when absent, ``started_at`` falls back to the job's
creation time (``creation_context.created_at``, ARM ``systemData.createdAt``) once the job is
RUNNING or later — an upper bound that includes queueing — and ``ended_at`` (terminal states only)
to ``creation_context.last_modified_at``. ``training_seconds`` = ended − started (the run interval,
once ended); Azure reports no billable seconds, so the dashboard prices the run interval
(DESIGN.md §6).
"""

from __future__ import annotations

from typing import Any, Mapping

from cloud_adapters.base import JobState, JobStatus, parse_utc
from cloud_adapters.cloud import StateTable

_PAUSED_OR_UNKNOWN = ("Azure ML reports the job {raw}; it stays non-terminal until Azure ML reports a running "
                      "or final status.")
STATES = StateTable(
    states={
        **dict.fromkeys(("NotStarted", "Queued", "Preparing", "Provisioning", "Starting"), JobState.PENDING),
        **dict.fromkeys(("Running", "Finalizing"), JobState.RUNNING),
        "CancelRequested": JobState.STOPPING,
        "Completed": JobState.SUCCEEDED,
        **dict.fromkeys(("Failed", "NotResponding"), JobState.FAILED),
        "Canceled": JobState.CANCELLED,
        **dict.fromkeys(("Paused", "Unknown"), JobState.PENDING),
    },
    warnings={"Paused": _PAUSED_OR_UNKNOWN, "Unknown": _PAUSED_OR_UNKNOWN},
    unknown=("Azure ML reported an unknown job status {raw!r}; the job stays non-terminal until a known "
             "status arrives."),
)
"""The fourteen values of the REST ``JobStatus`` enum (clouds.md §3.3) → JobState: the module's table."""

START_PROPERTY = "StartTimeUtc"
END_PROPERTY = "EndTimeUtc"


PREEMPTION_WORDS = ("preempt", "low priority", "lowpriority", "evicted")
"""Words of a failed job's error that name the reclaim of its low-priority nodes."""


def preempted(error: str) -> bool:
    """Whether a failed low-priority job's error says its nodes were preempted. Azure ML requeues a
    preempted low-priority job itself (it goes back to Queued: an interruption, left alone); one that
    ends Failed for it was lost, and Trainboard may resubmit it (docs/recovery.md)."""
    text = (error or "").lower()
    return any(word in text for word in PREEMPTION_WORDS)


def status_text(value: Any) -> str:
    """``job.status`` as a plain string (the SDK gives a str-Enum equal to it, clouds.md §3.3)."""
    if value is None:
        return ""
    return str(getattr(value, "value", value))


def job_status(*, status: Any, properties: Mapping[str, Any] | None = None, created_at: Any = None,
               last_modified_at: Any = None, error: str = "", instance_count: int | None = None,
               low_priority: bool = False) -> JobStatus:
    """The :class:`JobStatus` of one Azure ML job (see the module's table and its notes on times).

    ``status``: the job's status (str or the SDK's enum); ``properties``: the job's ``properties``
    dict; ``created_at`` / ``last_modified_at``: its creation context (datetimes or ISO strings);
    ``error``: the service's error message for a failed job ("" when it gave none);
    ``instance_count``: ``resources.instance_count`` (nodes); ``low_priority``: the job runs on
    low-priority capacity (``queue_settings.job_tier``).
    """
    raw = status_text(status)
    props = properties or {}
    state, warning = STATES.resolve(raw)
    reason = ""
    if raw == "Failed":
        reason = error or "Azure ML reported the job Failed without an error message; see the job's std_log files"
    elif raw == "NotResponding":
        reason = ("NotResponding: Azure ML stopped hearing from the job's nodes"
                  + (f" ({error})" if error else "") + "; check the nodes' std_log files and resubmit")
    elif raw == "Canceled":
        reason = "canceled in Azure ML" + (f" ({error})" if error else "")

    started = parse_utc(props.get(START_PROPERTY))
    if started is None and (state in (JobState.RUNNING, JobState.STOPPING) or state.is_terminal):
        started = parse_utc(created_at)
    ended = None
    if state.is_terminal:
        ended = parse_utc(props.get(END_PROPERTY)) or parse_utc(last_modified_at)
        if started is not None and ended is not None and ended < started:
            ended = started
    training = (ended - started).total_seconds() if started is not None and ended is not None else None
    return JobStatus(
        lost=raw == "Failed" and bool(low_priority) and preempted(error),
        state=state,
        raw_state=raw,
        failure_reason=reason,
        started_at=started,
        ended_at=ended,
        billable_seconds=None,  # Azure ML reports none: the run interval is priced (DESIGN.md §6)
        training_seconds=training,
        instance_count=int(instance_count) if isinstance(instance_count, int) and instance_count > 0 else 1,
        warning=warning,
        spot=bool(low_priority),
    )
