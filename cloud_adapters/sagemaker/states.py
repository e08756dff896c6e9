"""SageMaker training-job status → :class:`~cloud_adapters.base.JobStatus` (DESIGN.md §4, SageMaker row).

Values from botocore's SageMaker model (clouds.md §1.2 [B]): ``TrainingJobStatus`` is one of
InProgress, Completed, Failed, Stopping, Stopped, Deleting; ``SecondaryStatus`` refines it. The API
doc groups them: InProgress → Starting, Pending, Downloading, Training, Interrupted (spot), Uploading;
Stopped → MaxRuntimeExceeded, MaxWaitTimeExceeded, Stopped. LaunchingMLInstances,
PreparingTrainingStack and DownloadingTrainingImage are documented as no longer used but still map.

=====================================================================  ============================
TrainingJobStatus (+ SecondaryStatus)                                  JobState
=====================================================================  ============================
InProgress + Starting, Pending, LaunchingMLInstances,                  PENDING
PreparingTrainingStack, Downloading, DownloadingTrainingImage
InProgress + Interrupted, Restarting, Updating                         PENDING (see below)
InProgress + Training, Uploading                                       RUNNING
Stopping                                                               STOPPING
Completed                                                              SUCCEEDED
Failed                                                                 FAILED, FailureReason
Stopped + MaxRuntimeExceeded / MaxWaitTimeExceeded                     FAILED, that reason
Stopped (anything else)                                                CANCELLED
Deleting                                                               CANCELLED (the job is going away)
anything else                                                          PENDING + ``warning``
=====================================================================  ============================

Interrupted (a spot instance was reclaimed; SageMaker waits for capacity and restarts, clouds.md §1.2
spot sequence) and Restarting are phases in which the job does not train: PENDING, which the
dashboard's state machine takes from RUNNING as an interruption (RUNNING → PENDING, counted on the
job page) and leaves again when Training resumes. Updating (an UpdateTrainingJob call, which
Trainboard never makes) does not say whether training runs: PENDING, so a job that never trained
is not reported RUNNING. An unknown value keeps the job non-terminal (PENDING, for the same
reason) with a warning that names it: SageMaker documents the values as "subject to change".
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Mapping

from cloud_adapters.base import JobState, JobStatus

PENDING_SECONDARY = frozenset({
    "Starting", "Pending", "LaunchingMLInstances", "PreparingTrainingStack", "Downloading",
    "DownloadingTrainingImage", "Interrupted", "Restarting", "Updating",
})
RUNNING_SECONDARY = frozenset({"Training", "Uploading"})
LIMIT_SECONDARY = frozenset({"MaxRuntimeExceeded", "MaxWaitTimeExceeded"})
TERMINAL_STATUSES = frozenset({"Completed", "Failed", "Stopped"})
"""Primary statuses after which the job never changes again (StopTrainingJob is then a no-op)."""
NON_TERMINAL_STATUSES = frozenset({"InProgress", "Stopping"})

_LIMIT_TEXT = {
    "MaxRuntimeExceeded": "MaxRuntimeExceeded: SageMaker stopped the job when it reached its max runtime "
                          "({runtime}, counted from the job's start: launching instances and downloading the "
                          "image and data count); raise max runtime or resume from the job's checkpoints",
    "MaxWaitTimeExceeded": "MaxWaitTimeExceeded: the spot job did not finish within its max wait time "
                           "({wait}, waiting for capacity included); raise it or run on demand",
}


def _seconds(value: Any) -> str:
    return f"{int(value)} s" if isinstance(value, (int, float)) and not isinstance(value, bool) else "the limit"


def _utc(value: Any) -> dt.datetime | None:
    """botocore parses timestamps to aware datetimes; keep them UTC."""
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.timezone.utc) if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _last_message(desc: Mapping[str, Any], status: str) -> str:
    """The StatusMessage of the last SecondaryStatusTransitions item with ``status``, or ""."""
    for item in reversed(desc.get("SecondaryStatusTransitions") or []):
        if item.get("Status") == status and item.get("StatusMessage"):
            return str(item["StatusMessage"])
    return ""


def job_status(desc: Mapping[str, Any]) -> JobStatus:
    """The :class:`JobStatus` of one DescribeTrainingJob response (see the module's table).

    Times: ``started_at`` = TrainingStartTime, ``ended_at`` = TrainingEndTime (terminal states only);
    ``billable_seconds`` = BillableTimeInSeconds and ``training_seconds`` = TrainingTimeInSeconds
    (present once the job ended; per instance, clouds.md §1.2); ``instance_count`` =
    ResourceConfig.InstanceCount; ``spot`` = EnableManagedSpotTraining.
    """
    raw = str(desc.get("TrainingJobStatus") or "")
    secondary = str(desc.get("SecondaryStatus") or "")
    warning = ""
    reason = ""
    if raw == "InProgress":
        if secondary in RUNNING_SECONDARY:
            state = JobState.RUNNING
        else:
            state = JobState.PENDING
            if secondary not in PENDING_SECONDARY:
                warning = (f"SageMaker reported an unknown secondary status {secondary!r} for an "
                           f"InProgress job; shown as PENDING until it changes.")
    elif raw == "Stopping":
        state = JobState.STOPPING
    elif raw == "Completed":
        state = JobState.SUCCEEDED
    elif raw == "Failed":
        state = JobState.FAILED
        reason = str(desc.get("FailureReason") or "") or "SageMaker reported the job Failed without a reason"
    elif raw == "Stopped" and secondary in LIMIT_SECONDARY:
        stopping = desc.get("StoppingCondition") or {}
        reason = _LIMIT_TEXT[secondary].format(runtime=_seconds(stopping.get("MaxRuntimeInSeconds")),
                                               wait=_seconds(stopping.get("MaxWaitTimeInSeconds")))
        detail = str(desc.get("FailureReason") or "") or _last_message(desc, secondary)
        if detail:
            reason = f"{reason} ({detail})"
        state = JobState.FAILED
    elif raw == "Stopped":
        state = JobState.CANCELLED
        reason = "stopped in SageMaker (StopTrainingJob)"
    elif raw == "Deleting":
        state = JobState.CANCELLED
        reason = "the training job is being deleted in SageMaker"
    else:
        state = JobState.PENDING
        warning = (f"SageMaker reported an unknown training job status {raw!r} (secondary "
                   f"{secondary!r}); the job stays non-terminal until a known status arrives.")

    resources = desc.get("ResourceConfig") or {}
    count = resources.get("InstanceCount")
    return JobStatus(
        state=state,
        raw_state=raw,
        secondary_state=secondary,
        failure_reason=reason,
        started_at=_utc(desc.get("TrainingStartTime")),
        ended_at=_utc(desc.get("TrainingEndTime")) if state.is_terminal else None,
        billable_seconds=_number(desc.get("BillableTimeInSeconds")),
        training_seconds=_number(desc.get("TrainingTimeInSeconds")),
        instance_count=int(count) if isinstance(count, int) and count > 0 else 1,
        warning=warning,
        spot=bool(desc.get("EnableManagedSpotTraining")),
    )
