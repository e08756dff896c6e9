"""A TrainJob's status → :class:`~cloud_adapters.base.JobStatus` (DESIGN.md §4, Kubeflow ``TrainJob`` row).

A TrainJob has no phase field. What it reports (kubeflow/trainer ``pkg/apis/trainer/v1alpha1/
trainjob_types.go``, commit 0015772c): ``status.conditions`` of types ``Suspended``, ``Complete`` and
``Failed`` (reasons include ``Suspended``/``Resumed``, ``DeadlineExceeded``,
``TrainingRuntimeNotSupported``; JobSet's own ``FailedJobs``), and ``status.jobsStatus[]``, one entry
per replicated Job of its JobSet, counting child Jobs that are ``active`` (a pod running or pending),
``ready``, ``succeeded``, ``failed``, ``suspended``. There is no Running condition, so this module
derives one *raw state* from the object (and, where the counts cannot tell, from its pods'
phases), and :data:`STATES` maps each raw state to one JobState:

=================  ====================================================  ===========
raw state          when                                                  JobState
=================  ====================================================  ===========
``Created``        no terminal condition, no child Job active yet        PENDING
``Suspended``      condition Suspended True (``suspend``, e.g. Kueue      PENDING
                   holding it in its queue)
``PodsPending``    a child Job active, none of its pods Running          PENDING
``Running``        a child Job ready, or one of its pods Running          RUNNING
``Deleting``       ``metadata.deletionTimestamp`` set (foreground         STOPPING
                   deletion: the pods are being stopped)
``Complete``       condition Complete True                               SUCCEEDED
``Failed``         condition Failed True (reason and message shown;       FAILED
                   DeadlineExceeded reads "max runtime reached"); a
                   *lost* run when one of its pods was disrupted
                   (below)
``Cancelled``      gone (404) after Trainboard deleted it                 CANCELLED
``Deleted``        gone (404) without a cancel from Trainboard            FAILED
=================  ====================================================  ===========

How "deleted by Trainboard" is known: the TrainJob is gone once its foreground deletion ends, so
nothing on the cluster can say who deleted it. The dashboard re-sends ``cancel`` for every STOPPING
job at the start of each sync, before ``describe_many``, on the same adapter object
(``jobs.sync``), and ``KubernetesBackend.cancel`` remembers the names it deleted; a 404 for one of
those is CANCELLED, any other 404 is FAILED "TrainJob deleted outside Trainboard". A terminal
condition is read before ``deletionTimestamp``: a job that completed and is being deleted stays
SUCCEEDED.

A lost run (:attr:`~cloud_adapters.base.JobStatus.lost`, docs/recovery.md): a TrainJob that ends
``Failed`` (for any reason but ``DeadlineExceeded``, its own time limit) while one of its pods ended
with the pod condition ``DisruptionTarget`` True. Kubernetes adds that condition to a pod "about to
be deleted due to a disruption", with the reason :data:`DISRUPTION_REASONS` names, and to no pod
whose disruption it caused itself ("eviction due to exceeding Pod container limits … Pods don't
receive the DisruptionTarget condition because the disruptions were probably caused by the Pod and
would reoccur on retry"): kubernetes.io, Concepts → Workloads → Pods → Disruptions, "Pod disruption
conditions" (feature gate ``PodDisruptionConditions``, beta and on by default since Kubernetes 1.26,
GA in 1.31). A pod whose container exits ≠ 0 on its own, a runtime failure, ``DeadlineExceeded``:
the job's own, never lost. Whichever rank failed first, the disruption is the cause: the other
ranks of a torch job often exit ≠ 0 themselves once a peer is gone. The same page warns that a
disruption may be interrupted and its condition cleared later, so only a pod that ended with it
counts (phase ``Failed``, or deleted and not ``Succeeded``, which the Job controller counts as
failed: kubernetes ``pkg/controller/job/job_controller.go`` ``isPodFailed``). The pods are read
only for a ``Failed`` TrainJob that may be lost (:func:`needs_pods`).
A disrupted pod that Kubernetes deleted (an eviction, a preemption, the taint manager, PodGC) is
kept until the Job controller has counted it (its ``batch.kubernetes.io/job-tracking`` finalizer);
one already gone when the sync reads the pods leaves the failure the job's own.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, Iterable, Mapping

from cloud_adapters.base import JobState, JobStatus, parse_utc
from cloud_adapters.cloud import StateTable

STATES = StateTable(
    states={
        "Created": JobState.PENDING,
        "Suspended": JobState.PENDING,
        "PodsPending": JobState.PENDING,
        "Running": JobState.RUNNING,
        "Deleting": JobState.STOPPING,
        "Complete": JobState.SUCCEEDED,
        "Failed": JobState.FAILED,
        "Cancelled": JobState.CANCELLED,
        "Deleted": JobState.FAILED,
    },
    unknown="Kubernetes reported a TrainJob state Trainboard does not know ({raw!r}); shown as PENDING.",
)

SUSPENDED_NOTE = "suspended (queued by Kueue?)"
"""The secondary state of a suspended TrainJob: Kueue admits a job by clearing ``spec.suspend``."""
DELETED_OUTSIDE = ("TrainJob deleted outside Trainboard (kubectl delete, a TTL or another controller) "
                   "before it reported Complete or Failed.")
CANCELLED_REASON = "cancelled from Trainboard (TrainJob deleted)"
DISRUPTION = "DisruptionTarget"
"""The pod condition type Kubernetes adds to a pod it is about to delete for a disruption."""
DISRUPTION_REASONS = ("PreemptionByScheduler", "DeletionByTaintManager", "EvictionByEvictionAPI",
                      "DeletionByPodGC", "TerminationByKubelet")
"""The reasons of ``DisruptionTarget`` the Kubernetes documentation lists (kubernetes.io, "Pod
disruption conditions"): preempted by the scheduler for a pod of higher priority; deleted by the taint
manager for a ``NoExecute`` taint the pod does not tolerate (a node gone NotReady or unreachable);
evicted through the Eviction API (``kubectl drain``, a cluster autoscaler scaling down); bound to a
node that no longer exists and deleted by PodGC; terminated by the kubelet (node-pressure eviction,
graceful node shutdown, preemption for a system-critical pod). Any reason counts as a disruption (a
newer release may add one); these are the ones named in words."""


def condition(job: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    """The condition of ``type_`` whose status is "True", or None."""
    for cond in ((job.get("status") or {}).get("conditions") or []):
        if isinstance(cond, Mapping) and cond.get("type") == type_ and cond.get("status") == "True":
            return cond
    return None


def _count(job: Mapping[str, Any], field: str) -> int:
    total = 0
    for entry in ((job.get("status") or {}).get("jobsStatus") or []):
        value = entry.get(field) if isinstance(entry, Mapping) else None
        total += value if isinstance(value, int) and not isinstance(value, bool) else 0
    return total


def needs_pods(job: Mapping[str, Any]) -> bool:
    """Whether the job's pods must be read for its status: to tell PENDING from RUNNING (no terminal
    or suspended condition, not being deleted, a child Job active and none ready), or whether a
    ``Failed`` TrainJob's run was lost (any Failed reason but ``DeadlineExceeded``: a pod disrupted,
    module docstring)."""
    raw = raw_state(job, None)
    if raw == "Failed":
        return str((condition(job, "Failed") or {}).get("reason") or "") != "DeadlineExceeded"
    return raw == "PodsPending"


def raw_state(job: Mapping[str, Any], pod_phases: Iterable[str] | None = None) -> str:
    """The raw state of the TrainJob ``job`` (its JSON as the API returns it) per the module table;
    ``pod_phases``: the ``status.phase`` of its pods, None when not read (a job with an active child
    Job and none ready is then ``PodsPending``)."""
    if condition(job, "Complete"):
        return "Complete"
    if condition(job, "Failed"):
        return "Failed"
    if (job.get("metadata") or {}).get("deletionTimestamp"):
        return "Deleting"
    if condition(job, "Suspended"):
        return "Suspended"
    phases = list(pod_phases or ())
    if _count(job, "ready") > 0 or "Running" in phases:
        return "Running"
    if _count(job, "active") > 0 or phases:
        return "PodsPending"
    return "Created"


def failure_reason(job: Mapping[str, Any]) -> str:
    """The Failed condition's reason and message in words ("" when it has not failed):
    ``DeadlineExceeded`` is "max runtime reached (activeDeadlineSeconds N s): <message>"."""
    cond = condition(job, "Failed")
    if cond is None:
        return ""
    reason, message = str(cond.get("reason") or ""), str(cond.get("message") or "")
    if reason == "DeadlineExceeded":
        deadline = (job.get("spec") or {}).get("activeDeadlineSeconds")
        limit = f" (activeDeadlineSeconds {deadline} s)" if deadline else ""
        return f"max runtime reached{limit}" + (f": {message}" if message else "")
    return ": ".join(p for p in (reason, message) if p) or "TrainJob failed"


def disruption_reason(job: Mapping[str, Any], pods: Iterable["PodView"]) -> str:
    """Why the run of TrainJob ``job`` was lost, in words, or "" when it was not (module docstring):
    ``job`` Failed for another reason than DeadlineExceeded and one of ``pods`` (its pods, as read)
    ended disrupted. Names the first such pod by rank order, its node rank, the condition's reason
    and message, how many others were disrupted, and the TrainJob's own reason::

        pod tb-job-7-ab-node-0-1-x2k9q (node 1) disrupted: EvictionByEvictionAPI (Eviction API:
        evicting); TrainJob FailedJobs: jobset failed due to one or more job failures
    """
    if not needs_pods(job) or raw_state(job) != "Failed":
        return ""
    disrupted = sorted((p for p in pods if p.disrupted), key=lambda p: p.order)
    if not disrupted:
        return ""
    first = disrupted[0]
    rank = f" (node {first.completion_index})" if first.completion_index < 1 << 30 else ""
    detail = f" ({first.disruption_message})" if first.disruption_message else ""
    others = f" and {len(disrupted) - 1} other pod(s)" if len(disrupted) > 1 else ""
    return (f"pod {first.name}{rank}{others} disrupted: {first.disruption_reason}{detail}; "
            f"TrainJob {failure_reason(job)}")


def _started_at(job: Mapping[str, Any]) -> dt.datetime | None:
    """When the job last became active: its creation, or the last resume from suspension (the
    ``Suspended`` condition turned False with reason ``Resumed``), the moment activeDeadlineSeconds
    counts from (trainjob_types.go)."""
    created = parse_utc((job.get("metadata") or {}).get("creationTimestamp"))
    for cond in ((job.get("status") or {}).get("conditions") or []):
        if isinstance(cond, Mapping) and cond.get("type") == "Suspended" and cond.get("status") == "False":
            resumed = parse_utc(cond.get("lastTransitionTime"))
            if resumed is not None and (created is None or resumed > created):
                return resumed
    return created


def job_status(job: Mapping[str, Any], pod_phases: Iterable[str] | None = None,
               pending_reason: str = "", pods: Iterable["PodView"] = ()) -> JobStatus:
    """The :class:`JobStatus` of TrainJob ``job``. ``pod_phases``: its pods' phases when read;
    ``pending_reason``: why its pods wait (a pod's ``PodScheduled`` message), shown as the secondary
    state of a PENDING job; ``pods``: its pods when read, for a Failed job (:func:`needs_pods`): one
    that ended disrupted makes the FAILED status ``lost``, with :func:`disruption_reason` as its
    failure reason. ``instance_count`` is ``spec.trainer.numNodes``; started_at its creation (or last
    resume), ended_at the terminal condition's transition time. Kubernetes reports no billable
    seconds."""
    raw = raw_state(job, pod_phases)
    state, warning = STATES.resolve(raw)
    secondary = ""
    if raw == "Suspended":
        secondary = SUSPENDED_NOTE
    elif raw == "PodsPending":
        secondary = pending_reason or "pods pending"
    ended = None
    terminal = condition(job, "Complete") or condition(job, "Failed")
    if terminal is not None:
        ended = parse_utc(terminal.get("lastTransitionTime"))
    nodes = ((job.get("spec") or {}).get("trainer") or {}).get("numNodes")
    lost = disruption_reason(job, pods)
    return JobStatus(
        state=state, raw_state=raw, secondary_state=secondary, failure_reason=lost or failure_reason(job),
        lost=bool(lost),
        started_at=_started_at(job) if raw != "Created" and raw != "Suspended" else None, ended_at=ended,
        instance_count=nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 0 else 1,
        warning=warning,
    )


def gone_status(cancelled: bool, now: dt.datetime | None = None) -> JobStatus:
    """The status of a TrainJob the API server no longer has (404): CANCELLED when Trainboard
    deleted it (``cancelled``), else FAILED with :data:`DELETED_OUTSIDE`."""
    raw = "Cancelled" if cancelled else "Deleted"
    state, _ = STATES.resolve(raw)
    return JobStatus(state=state, raw_state=raw,
                     failure_reason=CANCELLED_REASON if cancelled else DELETED_OUTSIDE,
                     ended_at=now or dt.datetime.now(dt.timezone.utc))


@dataclasses.dataclass(frozen=True)
class PodView:
    """What the adapter reads of one pod of a TrainJob."""

    name: str
    phase: str  # status.phase: Pending, Running, Succeeded, Failed, Unknown
    job_index: int  # label jobset.sigs.k8s.io/job-index
    completion_index: int  # label/annotation batch.kubernetes.io/job-completion-index: the node rank
    containers: tuple[str, ...]  # spec.containers[].name
    waiting: str = ""  # why it is not running: PodScheduled False message, or a container's waiting reason
    deleting: bool = False  # metadata.deletionTimestamp is set
    disruption_reason: str = ""  # condition DisruptionTarget True: its reason (DISRUPTION_REASONS), else ""
    disruption_message: str = ""  # and its message

    @property
    def disrupted(self) -> bool:
        """Ended by a disruption: condition DisruptionTarget True, and phase Failed or deleted before
        it succeeded (a disruption that was interrupted leaves the pod running: not counted)."""
        ended = self.phase == "Failed" or (self.deleting and self.phase != "Succeeded")
        return bool(self.disruption_reason) and ended

    @property
    def order(self) -> tuple[int, int, str]:
        """Rank 0 (job index 0, completion index 0) first, then by node rank."""
        return (self.job_index, self.completion_index, self.name)


def _int(value: Any, default: int = 1 << 30) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def pod_view(pod: Mapping[str, Any]) -> PodView:
    """A :class:`PodView` of a pod's JSON (``V1Pod.to_dict()`` snake_case or the API's camelCase)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    index = labels.get("batch.kubernetes.io/job-completion-index",
                       annotations.get("batch.kubernetes.io/job-completion-index"))
    waiting = disruption = message = ""
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            waiting = str(cond.get("message") or cond.get("reason") or "")
        if cond.get("type") == DISRUPTION and cond.get("status") == "True":
            disruption, message = str(cond.get("reason") or DISRUPTION), str(cond.get("message") or "")
    for cs in status.get("container_statuses") or status.get("containerStatuses") or []:
        state = (cs.get("state") or {}).get("waiting") or {}
        if state and not waiting:
            waiting = ": ".join(str(p) for p in (state.get("reason"), state.get("message")) if p)
    return PodView(name=str(meta.get("name") or ""), phase=str(status.get("phase") or "Pending"),
                   job_index=_int(labels.get("jobset.sigs.k8s.io/job-index"), 0),
                   completion_index=_int(index), waiting=waiting,
                   deleting=bool(meta.get("deletionTimestamp") or meta.get("deletion_timestamp")),
                   disruption_reason=disruption, disruption_message=" ".join(message.split())[:300],
                   containers=tuple(str(c.get("name")) for c in spec.get("containers") or [] if c.get("name")))
