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
InProgress + Interrupted, Restarting                                   PENDING (see below)
InProgress + Training, Uploading                                       RUNNING
InProgress + Updating                                                  the state of the status it updates
Stopping                                                               STOPPING
Completed                                                              SUCCEEDED
Failed                                                                 FAILED, FailureReason
Stopped + MaxRuntimeExceeded / MaxWaitTimeExceeded                     FAILED, that reason
Stopped (anything else)                                                CANCELLED
Deleting                                                               CANCELLED (the job is going away)
anything else                                                          PENDING + ``warning``
=====================================================================  ============================

A restart phase after Training — Interrupted (a spot instance was reclaimed; SageMaker waits for
capacity and restarts: Interrupted → Starting → Downloading → Training, clouds.md §1.2), Restarting,
or Starting again (a retry of RetryStrategy: "when the job is retried, its SecondaryStatus is changed
to Starting") — is PENDING: the dashboard's state machine takes RUNNING → PENDING as one
interruption, counted on the job page, and the phases that follow until Training resumes are the
same PENDING, so one restart counts once.

Updating (UpdateTrainingJob: "a new Debugger profiling configuration or … warm pool retention
length", which Trainboard never calls) and Uploading (training complete, model artifacts being
uploaded) are no restart. Uploading is RUNNING; Updating is whatever the job was doing when the
update began — RUNNING after Training or Uploading, PENDING before — read from
``SecondaryStatusTransitions`` (the history of the job's secondary statuses, :func:`updated_status`).
Without that history it is PENDING with a warning, which the sync never takes as an interruption of
a running job. An unknown value keeps the job non-terminal (PENDING, so a job that never trained is
not reported RUNNING) with a warning that names it: SageMaker documents the values as "subject to
change".
"""

from __future__ import annotations

from typing import Any, Mapping

from cloud_adapters.base import JobState, JobStatus, parse_utc
from cloud_adapters.cloud import StateTable

_PENDING, _RUNNING = JobState.PENDING, JobState.RUNNING
STATES = StateTable(
    states={
        # A secondary status not listed: PENDING, so a job that never trained is not reported RUNNING.
        "InProgress": _PENDING,
        **{("InProgress", s): _PENDING for s in (
            "Starting", "Pending", "LaunchingMLInstances", "PreparingTrainingStack", "Downloading",
            "DownloadingTrainingImage", "Interrupted", "Restarting")},
        # Updating: the state of the status it updates (resolve); PENDING + warning without a history.
        ("InProgress", "Updating"): _PENDING,
        ("InProgress", "Training"): _RUNNING,
        ("InProgress", "Uploading"): _RUNNING,
        "Stopping": JobState.STOPPING,
        "Completed": JobState.SUCCEEDED,
        "Failed": JobState.FAILED,
        ("Stopped", "MaxRuntimeExceeded"): JobState.FAILED,
        ("Stopped", "MaxWaitTimeExceeded"): JobState.FAILED,
        "Stopped": JobState.CANCELLED,
        "Deleting": JobState.CANCELLED,
    },
    warnings={"InProgress": ("SageMaker reported an unknown secondary status {secondary!r} for an InProgress "
                             "job; shown as PENDING until it changes."),
              ("InProgress", "Updating"): ("SageMaker is updating the job (UpdateTrainingJob) and reports no "
                                           "status before the update; its state is kept until the update ends.")},
    unknown=("SageMaker reported an unknown training job status {raw!r} (secondary {secondary!r}); the job "
             "stays non-terminal until a known status arrives."),
)
"""``TrainingJobStatus`` (+ ``SecondaryStatus``) → JobState: the module's table, as data."""

_LIMIT_TEXT = {
    "MaxRuntimeExceeded": "MaxRuntimeExceeded: SageMaker stopped the job when it reached its max runtime "
                          "({runtime}, counted from the job's start: launching instances and downloading the "
                          "image and data count); raise max runtime or resume from the job's checkpoints",
    "MaxWaitTimeExceeded": "MaxWaitTimeExceeded: the spot job did not finish within its max wait time "
                           "({wait}, waiting for capacity included); raise it or run on demand",
}
_REASONS = {
    "Stopped": "stopped in SageMaker (StopTrainingJob)",
    "Deleting": "the training job is being deleted in SageMaker",
}


def _seconds(value: Any) -> str:
    return f"{int(value)} s" if isinstance(value, (int, float)) and not isinstance(value, bool) else "the limit"


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


def failure_reason(desc: Mapping[str, Any]) -> str:
    """Why the job of DescribeTrainingJob response ``desc`` failed or was cancelled; "" while it runs."""
    raw = str(desc.get("TrainingJobStatus") or "")
    secondary = str(desc.get("SecondaryStatus") or "")
    if raw == "Failed":
        return str(desc.get("FailureReason") or "") or "SageMaker reported the job Failed without a reason"
    if raw == "Stopped" and secondary in _LIMIT_TEXT:
        stopping = desc.get("StoppingCondition") or {}
        reason = _LIMIT_TEXT[secondary].format(runtime=_seconds(stopping.get("MaxRuntimeInSeconds")),
                                               wait=_seconds(stopping.get("MaxWaitTimeInSeconds")))
        detail = str(desc.get("FailureReason") or "") or _last_message(desc, secondary)
        return f"{reason} ({detail})" if detail else reason
    return _REASONS.get(raw, "")


UPDATING = "Updating"


def updated_status(desc: Mapping[str, Any]) -> str:
    """The secondary status an ``Updating`` job of DescribeTrainingJob response ``desc`` was in when the
    update began: the last ``SecondaryStatusTransitions`` item that is not Updating ("" when none)."""
    for item in reversed(desc.get("SecondaryStatusTransitions") or []):
        status = str((item or {}).get("Status") or "")
        if status and status != UPDATING:
            return status
    return ""


def resolve(raw: str, secondary: str, desc: Mapping[str, Any]) -> tuple[JobState, str]:
    """``(state, warning)`` of ``raw`` / ``secondary`` (the module's table); an InProgress job that is
    Updating takes the state of the status it updates (:func:`updated_status`)."""
    if (raw, secondary) == ("InProgress", UPDATING):
        before = updated_status(desc)
        if before and ("InProgress", before) in STATES.states:
            return STATES.states[("InProgress", before)], ""
    return STATES.resolve(raw, secondary)


def job_status(desc: Mapping[str, Any]) -> JobStatus:
    """The :class:`JobStatus` of one DescribeTrainingJob response (see the module's table).

    Times: ``started_at`` = TrainingStartTime, ``ended_at`` = TrainingEndTime (terminal states only);
    ``billable_seconds`` = BillableTimeInSeconds and ``training_seconds`` = TrainingTimeInSeconds
    (present once the job ended; per instance, clouds.md §1.2); ``instance_count`` =
    ResourceConfig.InstanceCount; ``spot`` = EnableManagedSpotTraining.
    """
    raw = str(desc.get("TrainingJobStatus") or "")
    secondary = str(desc.get("SecondaryStatus") or "")
    state, warning = resolve(raw, secondary, desc)
    count = (desc.get("ResourceConfig") or {}).get("InstanceCount")
    return JobStatus(
        state=state,
        raw_state=raw,
        secondary_state=secondary,
        failure_reason=failure_reason(desc),
        started_at=parse_utc(desc.get("TrainingStartTime")),
        ended_at=parse_utc(desc.get("TrainingEndTime")) if state.is_terminal else None,
        billable_seconds=_number(desc.get("BillableTimeInSeconds")),
        training_seconds=_number(desc.get("TrainingTimeInSeconds")),
        instance_count=int(count) if isinstance(count, int) and count > 0 else 1,
        warning=warning,
        spot=bool(desc.get("EnableManagedSpotTraining")),
    )
