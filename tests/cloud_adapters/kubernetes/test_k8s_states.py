"""A TrainJob's status → JobStatus, row by row of cloud_adapters/kubernetes/states.py's table, and a
lost run (a Failed TrainJob whose pod was disrupted) told from the job's own failures; what
a client error means (errors.classify); the pod-log cursor (logs.read_new). No API server."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from cloud_adapters.base import CredentialsError, InvalidSpec, JobState, ProviderError, Throttled
from cloud_adapters.kubernetes import errors, logs, states

CREATED = "2026-12-01T10:00:00Z"


def trainjob(conditions=(), jobs_status=None, deleting=False, nodes=2, deadline=None):
    meta = {"name": "tb-job-1-a", "creationTimestamp": CREATED}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T10:30:00Z"
    spec = {"trainer": {"numNodes": nodes}}
    if deadline:
        spec["activeDeadlineSeconds"] = deadline
    status = {"conditions": [dict(c) for c in conditions]}
    if jobs_status is not None:
        status["jobsStatus"] = [{"name": "node", **jobs_status}]
    return {"metadata": meta, "spec": spec, "status": status}


def cond(type_, status="True", reason="", message="", at="2026-12-01T10:20:00Z"):
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": at}


ACTIVE = {"active": 1, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 0}
READY = {"active": 1, "ready": 1, "succeeded": 0, "failed": 0, "suspended": 0}


@pytest.mark.parametrize("job, phases, raw, state", [
    (trainjob(), None, "Created", JobState.PENDING),
    (trainjob(jobs_status={"active": 0, "ready": 0}), None, "Created", JobState.PENDING),
    (trainjob([cond("Suspended", reason="Suspended")]), None, "Suspended", JobState.PENDING),
    (trainjob(jobs_status=ACTIVE), None, "PodsPending", JobState.PENDING),
    (trainjob(jobs_status=ACTIVE), ["Pending", "Pending"], "PodsPending", JobState.PENDING),
    (trainjob(jobs_status=ACTIVE), ["Running", "Pending"], "Running", JobState.RUNNING),
    (trainjob(jobs_status=READY), None, "Running", JobState.RUNNING),
    (trainjob([cond("Suspended", "False", "Resumed")], jobs_status=READY), None, "Running", JobState.RUNNING),
    (trainjob(jobs_status=READY, deleting=True), None, "Deleting", JobState.STOPPING),
    (trainjob([cond("Complete", reason="AllJobsCompleted")], jobs_status=READY), None, "Complete", JobState.SUCCEEDED),
    (trainjob([cond("Complete")], deleting=True), None, "Complete", JobState.SUCCEEDED),  # completed, then deleted
    (trainjob([cond("Failed", reason="FailedJobs")]), None, "Failed", JobState.FAILED),
    (trainjob([cond("Suspended", "False", "Resumed"), cond("Failed", reason="DeadlineExceeded")]), None, "Failed",
     JobState.FAILED),
])
def test_each_row_of_the_state_table(job, phases, raw, state):
    status = states.job_status(job, phases)
    assert (status.raw_state, status.state, status.warning) == (raw, state, "")


def test_every_raw_state_maps_to_one_job_state_and_the_terminal_ones_are_known():
    assert states.STATES.terminal == {"Complete", "Failed", "Cancelled", "Deleted"}
    assert states.STATES.resolve("Cancelled")[0] is JobState.CANCELLED
    assert states.STATES.resolve("Deleted")[0] is JobState.FAILED  # never SUCCEEDED
    unknown = states.STATES.resolve("Exploded")
    assert unknown[0] is JobState.PENDING and "'Exploded'" in unknown[1]


def test_what_a_status_reports_besides_the_state():
    suspended = states.job_status(trainjob([cond("Suspended", reason="Suspended")]))
    assert suspended.secondary_state == "suspended (queued by Kueue?)" and suspended.started_at is None
    waiting = states.job_status(trainjob(jobs_status=ACTIVE), ["Pending"], "0/3 nodes are available: Insufficient nvidia.com/gpu")
    assert waiting.secondary_state == "0/3 nodes are available: Insufficient nvidia.com/gpu"
    assert states.job_status(trainjob(jobs_status=ACTIVE)).secondary_state == "pods pending"
    done = states.job_status(trainjob([cond("Complete", at="2026-12-01T10:45:00Z")], jobs_status=READY, nodes=4))
    assert done.started_at == dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.timezone.utc)
    assert done.ended_at == dt.datetime(2026, 12, 1, 10, 45, tzinfo=dt.timezone.utc)
    assert (done.instance_count, done.failure_reason, done.billable_seconds) == (4, "", None)
    resumed = states.job_status(trainjob([cond("Suspended", "False", "Resumed", at="2026-12-01T10:10:00Z")],
                                         jobs_status=READY))
    assert resumed.started_at == dt.datetime(2026, 12, 1, 10, 10, tzinfo=dt.timezone.utc)  # the deadline's clock
    deadline = states.job_status(trainjob([cond("Failed", reason="DeadlineExceeded", message="TrainJob exceeded it")],
                                          deadline=600))
    assert deadline.failure_reason == "max runtime reached (activeDeadlineSeconds 600 s): TrainJob exceeded it"
    failed = states.job_status(trainjob([cond("Failed", reason="FailedJobs", message="jobset failed")]))
    assert failed.failure_reason == "FailedJobs: jobset failed"
    assert states.job_status(trainjob([cond("Failed")])).failure_reason == "TrainJob failed"


def test_a_trainjob_gone_is_cancelled_only_after_trainboard_deleted_it():
    now = dt.datetime(2026, 12, 1, 11, 0, tzinfo=dt.timezone.utc)
    cancelled, outside = states.gone_status(True, now), states.gone_status(False, now)
    assert (cancelled.state, cancelled.raw_state, cancelled.ended_at) == (JobState.CANCELLED, "Cancelled", now)
    assert (outside.state, outside.raw_state) == (JobState.FAILED, "Deleted")
    assert outside.failure_reason.startswith("TrainJob deleted outside Trainboard")


def test_pod_views_order_rank_0_first_and_say_why_a_pod_waits():
    def pod(name, job_index, completion, phase="Running", **status):
        return {"metadata": {"name": name, "labels": {"jobset.sigs.k8s.io/job-index": str(job_index),
                                                      "batch.kubernetes.io/job-completion-index": str(completion)}},
                "spec": {"containers": [{"name": "node"}]}, "status": {"phase": phase, **status}}

    views = [states.pod_view(p) for p in (pod("c", 1, 0), pod("b", 0, 1), pod("a", 0, 0))]
    assert [v.name for v in sorted(views, key=lambda v: v.order)] == ["a", "b", "c"]
    waiting = states.pod_view(pod("w", 0, 0, "Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes are available"}]))
    assert (waiting.phase, waiting.waiting, waiting.containers) == ("Pending", "0/2 nodes are available", ("node",))
    pulling = states.pod_view(pod("p", 0, 0, "Pending", containerStatuses=[
        {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "back-off pulling image"}}}]))
    assert pulling.waiting == "ImagePullBackOff: back-off pulling image"


def api_error(status, message="", reason="Reason"):
    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return exc


@pytest.mark.parametrize("exc, retried, kind, words", [
    (api_error(401, "Unauthorized", "Unauthorized"), False, CredentialsError, "Kubernetes 401 Unauthorized: Unauthorized."),
    (api_error(403, 'trainjobs is forbidden: User "u" cannot create'), False, CredentialsError, "cannot create"),
    (api_error(429, "too many requests"), True, Throttled, "rate-limiting"),
    (api_error(500, "etcdserver: request timed out"), True, ProviderError, "etcdserver: request timed out"),
    (api_error(503, "unavailable"), True, ProviderError, "next sync tries again"),
    (api_error(422, 'TrainJob "x" is invalid: spec.trainer.numNodes: Invalid value: 0'), False, InvalidSpec,
     "spec.trainer.numNodes: Invalid value: 0"),
    (api_error(400, "strict decoding error: unknown field"), False, InvalidSpec, "unknown field"),
    (api_error(404, "not found"), False, ProviderError, "404"),
    (api_error(409, "already exists"), False, ProviderError, "already exists"),
    (ApiException(status=0, reason="no answer"), True, ProviderError, "no answer"),
    (urllib3.exceptions.MaxRetryError(None, "/version", "refused"), True, ProviderError, "could not reach the API server"),
    (ConnectionRefusedError("refused"), True, ProviderError, "could not reach"),
    (ConfigException("Invalid kube-config file. No configuration found."), False, CredentialsError,
     "the cluster configuration cannot be used"),
])
def test_errors_become_trainboards(exc, retried, kind, words):
    verdict = errors.classify(exc, service="Kubernetes")
    assert verdict.retry is retried and type(verdict.error) is kind
    assert words in str(verdict.error)
    assert getattr(verdict.error, "transient", False) is retried or kind is Throttled


def test_other_exceptions_are_not_classified_and_a_bad_body_is_cut():
    assert errors.classify(KeyError("x")) is None
    exc = ApiException(status=502, reason="Bad Gateway")
    exc.body = "<html>" + "x" * 1000
    assert errors.status_message(exc) == ("<html>" + "x" * 1000)[:300]
    wrapped = ProviderError("outer")
    wrapped.__cause__ = api_error(404)
    assert errors.status_code(wrapped) == 404 and errors.status_code(ValueError()) is None


def view(name, index):
    return states.PodView(name=name, phase="Running", job_index=0, completion_index=index, containers=("node",))


def test_logs_rank_0_first_each_line_once_and_partial_lines_wait():
    now = dt.datetime(2026, 12, 1, 10, 1, tzinfo=dt.timezone.utc)
    files = {
        "p1": b"2026-12-01T10:00:01.5Z worker line\n2026-12-01T10:00:02Z TRAINBOARD_METRIC {\"step\": 1}\n",
        "p0": b"2026-12-01T10:00:01Z first\n2026-12-01T10:00:01Z same stamp\n2026-12-01T10:00:03.000000001Z par",
    }
    asked = []

    def fetch(pod, since, limit):
        asked.append((pod.name, since, limit))
        return files[pod.name]

    lines, cursor = logs.read_new([view("p1", 1), view("p0", 0)], "", fetch, now)
    assert lines == ["[node 0] first", "[node 0] same stamp", "[node 1] worker line", 'TRAINBOARD_METRIC {"step": 1}']
    assert asked == [("p0", None, logs.MAX_BYTES), ("p1", None, logs.MAX_BYTES)]
    assert json.loads(cursor) == {"p0": ["2026-12-01T10:00:01Z", 2], "p1": ["2026-12-01T10:00:02Z", 1]}
    # the partial line completes, one more line comes with the same stamp as the last read
    files["p0"] += b"tial\n2026-12-01T10:00:04Z later\n"
    files["p0"] = files["p0"].replace(b"same stamp\n", b"same stamp\n2026-12-01T10:00:01Z third at it\n")
    asked.clear()
    lines, cursor = logs.read_new([view("p0", 0), view("p1", 1)], cursor, fetch, now)
    assert lines == ["[node 0] third at it", "[node 0] partial", "[node 0] later"]
    assert asked[0] == ("p0", 59 + logs.CLOCK_MARGIN_S, logs.MAX_BYTES)  # 10:01:00 − 10:00:01, + the margin
    assert logs.read_new([view("p0", 0), view("p1", 1)], cursor, fetch, now)[0] == []
    one_pod = logs.read_new([view("p0", 0)], "", fetch, now)[0]
    assert one_pod[0] == "first"  # one pod: no prefix


@pytest.mark.parametrize("cursor", ["nope", "[1]", '{"p": [1, 2]}', '{"p": ["t", -1]}'])
def test_a_cursor_this_module_did_not_write_is_refused(cursor):
    with pytest.raises(InvalidSpec):
        logs.parse_cursor(cursor)


# -- a lost run: a Failed TrainJob whose pod Kubernetes disrupted (DisruptionTarget) ------------------

FAILED_JOBS = cond("Failed", reason="FailedJobs", message="jobset failed due to one or more job failures")


def pod_json(name, rank, phase="Failed", disruption=None, deleting=False, exit_code=None):
    """A pod of the TrainJob as the API returns it (camelCase), optionally with condition
    DisruptionTarget ``disruption`` = (status, reason, message)."""
    conditions = [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}]
    if disruption:
        status, reason, message = disruption
        conditions.append({"type": "DisruptionTarget", "status": status, "reason": reason, "message": message,
                           "lastTransitionTime": "2026-12-01T10:19:00Z"})
    meta = {"name": name, "labels": {"jobset.sigs.k8s.io/jobset-name": "tb-job-1-a",
                                     "jobset.sigs.k8s.io/job-index": "0",
                                     "batch.kubernetes.io/job-completion-index": str(rank)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T10:19:00Z"
    statuses = []
    if exit_code is not None:
        statuses = [{"name": "node", "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}}}]
    return {"metadata": meta, "spec": {"containers": [{"name": "node"}]},
            "status": {"phase": phase, "conditions": conditions, "containerStatuses": statuses}}


# The reasons kubernetes.io lists ("Pod disruption conditions"), with messages like those the
# Kubernetes components write.
@pytest.mark.parametrize("reason, message", [
    ("PreemptionByScheduler", "default-scheduler: preempting to accommodate a higher priority pod"),
    ("DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint"),
    ("EvictionByEvictionAPI", "Eviction API: evicting"),
    ("DeletionByPodGC", "PodGC: node no longer exists"),
    ("TerminationByKubelet", "The node was low on resource: memory."),
])
def test_a_failed_trainjob_whose_pod_was_disrupted_is_a_lost_run(reason, message):
    job = trainjob([FAILED_JOBS])
    assert states.needs_pods(job)
    pods = [states.pod_view(pod_json("tb-job-1-a-node-0-0-aaaaa", 0, exit_code=1)),  # the peer that noticed
            states.pod_view(pod_json("tb-job-1-a-node-0-1-bbbbb", 1, disruption=("True", reason, message),
                                     exit_code=143))]
    status = states.job_status(job, [p.phase for p in pods], pods=pods)
    assert (status.state, status.raw_state, status.lost) == (JobState.FAILED, "Failed", True)
    assert status.failure_reason == (f"pod tb-job-1-a-node-0-1-bbbbb (node 1) disrupted: {reason} ({message}); "
                                     f"TrainJob FailedJobs: jobset failed due to one or more job failures")
    assert status.ended_at == dt.datetime(2026, 12, 1, 10, 20, tzinfo=dt.timezone.utc)
    assert reason in states.DISRUPTION_REASONS


def test_every_disrupted_pod_is_counted_and_the_first_by_rank_is_named():
    pods = [states.pod_view(pod_json(f"p{rank}", rank, disruption=("True", "DeletionByTaintManager", "")))
            for rank in (2, 0, 1)]
    status = states.job_status(trainjob([FAILED_JOBS], nodes=3), pods=pods)
    assert status.lost
    assert status.failure_reason == ("pod p0 (node 0) and 2 other pod(s) disrupted: DeletionByTaintManager; "
                                     "TrainJob FailedJobs: jobset failed due to one or more job failures")


def test_a_disrupted_pod_being_deleted_counts_and_a_condition_without_reason_still_names_it():
    deleting = states.pod_view(pod_json("p0", 0, phase="Running", deleting=True,
                                        disruption=("True", "", "")))
    assert (deleting.deleting, deleting.disruption_reason, deleting.disrupted) == (True, "DisruptionTarget", True)
    status = states.job_status(trainjob([FAILED_JOBS], nodes=1), pods=[deleting])
    assert status.lost and status.failure_reason.startswith("pod p0 (node 0) disrupted: DisruptionTarget; ")


@pytest.mark.parametrize("job, pod", [
    # the job's own failure: a rank exited 1, no disruption anywhere
    (trainjob([FAILED_JOBS]), pod_json("p0", 0, exit_code=1)),
    # its own time limit, whatever its pods say (Trainer's controller ended them)
    (trainjob([cond("Failed", reason="DeadlineExceeded", message="deadline")], deadline=60),
     pod_json("p0", 0, disruption=("True", "EvictionByEvictionAPI", "Eviction API: evicting"))),
    # a disruption that was interrupted: the pod still runs (the condition is cleared later)
    (trainjob([FAILED_JOBS]), pod_json("p0", 0, phase="Running",
                                       disruption=("True", "PreemptionByScheduler", "preempting"))),
    # a condition that is not True
    (trainjob([FAILED_JOBS]), pod_json("p0", 0, disruption=("False", "PreemptionByScheduler", ""))),
    # a pod deleted after it succeeded
    (trainjob([FAILED_JOBS]), pod_json("p0", 0, phase="Succeeded", deleting=True,
                                       disruption=("True", "EvictionByEvictionAPI", "Eviction API: evicting"))),
    # not failed at all: completed, with a disrupted pod of an earlier JobSet restart
    (trainjob([cond("Complete", reason="AllJobsCompleted")], jobs_status=READY),
     pod_json("p0", 0, disruption=("True", "EvictionByEvictionAPI", "Eviction API: evicting"))),
])
def test_the_jobs_own_failures_and_undone_disruptions_are_not_lost(job, pod):
    status = states.job_status(job, pods=[states.pod_view(pod)])
    assert status.lost is False
    assert "disrupted" not in status.failure_reason


def test_pods_are_read_only_where_the_status_needs_them():
    assert states.needs_pods(trainjob(jobs_status=ACTIVE))  # PENDING or RUNNING?
    assert states.needs_pods(trainjob([FAILED_JOBS]))  # lost?
    assert states.needs_pods(trainjob([cond("Failed", reason="PodFailurePolicy")]))
    assert not states.needs_pods(trainjob([cond("Failed", reason="DeadlineExceeded")]))
    assert not states.needs_pods(trainjob([cond("Complete")], jobs_status=READY))
    assert not states.needs_pods(trainjob(jobs_status=READY))
    assert not states.needs_pods(trainjob([cond("Suspended", reason="Suspended")]))
    # without its pods a Failed TrainJob is the job's own failure, as before
    assert states.job_status(trainjob([FAILED_JOBS])).lost is False
    snake = states.pod_view({"metadata": {"name": "s", "deletion_timestamp": "2026-12-01T10:19:00Z"},
                             "status": {"phase": "Running", "conditions": [
                                 {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                                  "message": "Eviction API:\n evicting"}]}})
    assert (snake.deleting, snake.disruption_message, snake.disrupted) == (True, "Eviction API: evicting", True)
