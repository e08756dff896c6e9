"""The stand-in Kubernetes API server (tests/k8s_standin.py), driven by the official ``kubernetes``
client over HTTP: what the Kubernetes backend's tests rely on it to do as a real API server with
Kubeflow Trainer would."""

from __future__ import annotations

import json
import os
import sys

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from k8s_standin import (DISRUPTION_REASONS, LABEL_COMPLETION_INDEX, LABEL_JOB_INDEX, LABEL_JOBSET_NAME,
                         parse_rfc3339_ns, rfc3339nano)

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
PY = "python"


def trainjob(name: str, script: str = "print('hello')", *, nodes: int = 2, labels: dict | None = None, **spec) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJob",
        "metadata": {"name": name, "labels": labels or {"trainboard.io/job-id": name}},
        "spec": {"runtimeRef": {"name": "torch-distributed"},
                 "trainer": {"image": "trainboard/trainer:test", "command": [PY, "-c", script],
                             "numNodes": nodes, "numProcPerNode": 2}, **spec},
    }


@pytest.fixture(scope="module")
def api(kube_standin):
    return kube_standin.client()


@pytest.fixture(scope="module")
def custom(api):
    return client.CustomObjectsApi(api)


@pytest.fixture(scope="module")
def core(api):
    return client.CoreV1Api(api)


def create(custom, body, namespace="default"):
    return custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def error_of(call) -> tuple[int, dict]:
    with pytest.raises(ApiException) as info:
        call()
    return info.value.status, json.loads(info.value.body)


def pods_of(core, name):
    return core.list_namespaced_pod("default", label_selector=f"{LABEL_JOBSET_NAME}={name}").items


def raw_log(api, name: str, **query) -> str:
    """GET …/log with query parameters as given: the client's read_namespaced_pod_log (kubernetes 35)
    has no ``since_time``, though PodLogOptions has ``sinceTime``."""
    return api.call_api("/api/v1/namespaces/{namespace}/pods/{name}/log", "GET",
                        {"namespace": "default", "name": name}, list(query.items()),
                        {"Accept": "*/*"}, auth_settings=["BearerToken"], response_type="str",
                        _return_http_data_only=True)


def test_discovery_namespaces_runtime_and_token(kube_standin, api, custom, core):
    assert client.VersionApi(api).get_code().major == "1"
    assert client.CoreApi(api).get_api_versions().versions == ["v1"]
    groups = client.ApisApi(api).get_api_versions().groups
    assert [g.name for g in groups] == [GROUP]
    assert core.read_namespace("default").status.phase == "Active"
    status, body = error_of(lambda: core.read_namespace("nowhere"))
    assert (status, body["kind"], body["reason"]) == (404, "Status", "NotFound")
    runtime = custom.get_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes", "torch-distributed")
    assert runtime["spec"]["mlPolicy"]["torch"]["numProcPerNode"] == "auto"

    nodes = core.list_node(label_selector="node.kubernetes.io/instance-type=standin-cpu-4").items
    assert [n.metadata.name for n in nodes] == [f"standin-node-{i}" for i in range(4)]
    assert core.read_node("standin-node-1").metadata.labels["kubernetes.io/hostname"] == "standin-node-1"
    review = client.AuthorizationV1Api(api).create_self_subject_access_review(client.V1SelfSubjectAccessReview(
        spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=client.V1ResourceAttributes(
            group=GROUP, resource="trainjobs", verb="create", namespace="default"))))
    assert review.status.allowed is True

    configuration = client.Configuration(host=kube_standin.url)
    configuration.api_key = {"authorization": "Bearer wrong-token"}
    status, body = error_of(lambda: client.CoreV1Api(client.ApiClient(configuration)).read_namespace("default"))
    assert (status, body["reason"]) == (401, "Unauthorized")


def test_create_returns_201_with_server_fields_and_409_for_a_duplicate(kube_standin, api, custom):
    data, status, _ = custom.create_namespaced_custom_object_with_http_info(
        GROUP, VERSION, "default", PLURAL, trainjob("dup-1", "print(1)", nodes=1, suspend=True))
    assert status == 201
    meta = data["metadata"]
    assert meta["name"] == "dup-1" and meta["namespace"] == "default" and meta["generation"] == 1
    assert len(meta["uid"]) == 36 and parse_rfc3339_ns(meta["creationTimestamp"]) is not None
    second = create(custom, trainjob("dup-2", "print(1)", nodes=1, suspend=True))
    assert int(second["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert second["spec"]["runtimeRef"] == {"name": "torch-distributed", "apiGroup": GROUP,
                                            "kind": "ClusterTrainingRuntime"}  # CRD defaults

    status, body = error_of(lambda: create(custom, trainjob("dup-1", nodes=1)))
    assert (status, body["reason"], body["message"]) == (409, "AlreadyExists",
                                                         'trainjobs.trainer.kubeflow.org "dup-1" already exists')
    assert custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "dup-1")["metadata"]["uid"] == meta["uid"]
    status, body = error_of(lambda: create(custom, trainjob("elsewhere", nodes=1), namespace="nowhere"))
    assert (status, body["message"]) == (404, 'namespaces "nowhere" not found')
    status, body = error_of(lambda: custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "absent"))
    assert (status, body["reason"]) == (404, "NotFound")
    posts = kube_standin.requests_for("POST", "/namespaces/default/trainjobs")
    assert posts[0].body["metadata"]["name"] == "dup-1" and posts[0].status == 201


def test_unknown_fields_and_invalid_values_are_refused_all_at_once(custom):
    body = trainjob("strict-1")
    body["spec"]["trainer"]["resources"] = {"cpu": 1}
    body["spec"]["podTemplateOverrides"] = []
    status, error = error_of(lambda: create(custom, body))
    assert status == 400 and error["reason"] == "BadRequest"
    assert 'unknown field "spec.trainer.resources"' in error["message"]
    assert 'unknown field "spec.podTemplateOverrides"' in error["message"]

    lenient = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body, field_validation="Ignore")
    assert "resources" not in lenient["spec"]["trainer"] and "podTemplateOverrides" not in lenient["spec"]
    custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "strict-1")

    body = trainjob("Bad_Name", activeDeadlineSeconds=0, managedBy="me")
    body["spec"]["trainer"].update(numProcPerNode="many", env=[{"name": "PET_NNODES", "value": "9"}])
    body["spec"]["runtimeRef"]["name"] = "no-such-runtime"
    status, error = error_of(lambda: create(custom, body))
    assert (status, error["reason"]) == (422, "Invalid")
    fields = sorted(cause["field"] for cause in error["details"]["causes"])
    assert fields == ["metadata.name", "spec.activeDeadlineSeconds", "spec.managedBy", "spec.runtimeRef",
                      "spec.trainer.env", "spec.trainer.numProcPerNode"], error["message"]
    body = trainjob("typed")
    body["spec"]["trainer"]["numNodes"] = "2"
    status, error = error_of(lambda: create(custom, body))
    assert status == 422 and "spec.trainer.numNodes in body must be of type integer" in error["message"]


def test_list_by_label_selector(custom):
    for name, labels in (("sel-a", {"team": "vision", "tier": "gold"}), ("sel-b", {"team": "nlp"}),
                         ("sel-c", {"team": "vision"})):
        create(custom, trainjob(name, nodes=1, labels=labels, suspend=True))

    def names(selector):
        items = custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, label_selector=selector)["items"]
        return sorted(i["metadata"]["name"] for i in items if i["metadata"]["name"].startswith("sel-"))

    assert names("team=vision") == ["sel-a", "sel-c"]
    assert names("team==vision,tier") == ["sel-a"]
    assert names("team,!tier") == ["sel-b", "sel-c"]
    assert names("team!=vision") == ["sel-b"]
    assert names("team in (nlp, vision),tier notin (gold)") == ["sel-b", "sel-c"]
    assert names("") == ["sel-a", "sel-b", "sel-c"]
    cluster_wide = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, label_selector="team=nlp")["items"]
    assert [i["metadata"]["name"] for i in cluster_wide] == ["sel-b"]
    status, error = error_of(lambda: names("team=(x"))
    assert status == 400


def test_a_trainjob_runs_its_pods_with_the_torch_variables_and_completes(kube_standin, api, custom, core):
    script = ("import os, sys; print('env', {k: v for k, v in sorted(os.environ.items()) if k.startswith('PET_')}); "
              "print('cwd', os.getcwd()); print('to stderr', file=sys.stderr); print('line two'); print('line three')")
    body = trainjob("run-ok", script, nodes=2)
    body["spec"]["trainer"]["env"] = [{"name": "JOB_CONFIG", "value": "{}"}]
    create(custom, body)
    done = kube_standin.wait_for_condition("default", "run-ok", "Complete", timeout=60)
    assert (done["reason"], done["message"]) == ("AllJobsCompleted", "jobset completed successfully")
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "run-ok")
    assert obj["status"]["jobsStatus"] == [{"name": "node", "active": 0, "ready": 1, "succeeded": 1, "failed": 0,
                                            "suspended": 0}]
    pods = sorted(pods_of(core, "run-ok"), key=lambda p: p.metadata.name)
    assert [p.status.phase for p in pods] == ["Succeeded", "Succeeded"]
    assert [p.metadata.name[:-5] for p in pods] == ["run-ok-node-0-0-", "run-ok-node-0-1-"]
    assert [(p.metadata.labels[LABEL_JOB_INDEX], p.metadata.labels[LABEL_COMPLETION_INDEX]) for p in pods] == \
        [("0", "0"), ("0", "1")]
    ranks = pods_of(core, "run-ok")
    rank1 = [p for p in ranks if p.metadata.labels[LABEL_COMPLETION_INDEX] == "1"][0]
    assert [p.metadata.name for p in core.list_namespaced_pod(
        "default", label_selector=f"{LABEL_JOBSET_NAME}=run-ok,{LABEL_COMPLETION_INDEX}=1").items] == [rank1.metadata.name]

    logs = [core.read_namespaced_pod_log(p.metadata.name, "default") for p in pods]
    for rank, text in enumerate(logs):
        env_line = text.splitlines()[0]
        assert f"'PET_NODE_RANK': '{rank}'" in env_line and "'PET_NNODES': '2'" in env_line
        assert "'PET_NPROC_PER_NODE': '2'" in env_line and "'PET_MASTER_ADDR': '127.0.0.1'" in env_line
        assert "to stderr" in text and text.endswith("line three\n")
    ports = {line.split("'PET_MASTER_PORT': '")[1].split("'")[0] for line in (t.splitlines()[0] for t in logs)}
    assert len(ports) == 1 and int(ports.pop()) > 0
    cwds = [t.splitlines()[1] for t in logs]
    assert cwds[0] != cwds[1]

    name = pods[0].metadata.name
    stamped = core.read_namespaced_pod_log(name, "default", timestamps=True).splitlines()
    assert len(stamped) == 5
    stamps = [parse_rfc3339_ns(line.split(" ", 1)[0]) for line in stamped]
    assert None not in stamps and stamps == sorted(stamps)
    assert [line.split(" ", 1)[1] for line in stamped] == logs[0].splitlines()
    assert core.read_namespaced_pod_log(name, "default", tail_lines=2) == "line two\nline three\n"
    assert core.read_namespaced_pod_log(name, "default", tail_lines=0) == ""
    assert core.read_namespaced_pod_log(name, "default", limit_bytes=6) == logs[0][:6]
    assert core.read_namespaced_pod_log(name, "default", tail_lines=1, timestamps=True) == stamped[-1] + "\n"
    after_last = rfc3339nano(stamps[-1] + 1_000_000_000)[:19] + "Z"
    assert raw_log(api, name, sinceTime=after_last) == ""
    assert raw_log(api, name, sinceTime="2020-01-01T00:00:00Z") == logs[0]
    assert raw_log(api, name, sinceTime=rfc3339nano(stamps[-1])[:19] + "Z").endswith("line three\n")
    assert core.read_namespaced_pod_log(name, "default", since_seconds=3600) == logs[0]
    status, error = error_of(lambda: raw_log(api, name, sinceSeconds=10, sinceTime="2020-01-01T00:00:00Z"))
    assert status == 422 and "at most one of `sinceTime` or `sinceSeconds`" in error["message"]
    status, error = error_of(lambda: core.read_namespaced_pod_log(name, "default", tail_lines=-1, limit_bytes=0))
    assert status == 422 and "tailLines" in error["message"] and "limitBytes" in error["message"]


def test_python_in_a_command_is_the_interpreter_the_test_names_else_this_one(kube_standin, custom, trainer_standin):
    with kube_standin.with_python(trainer_standin.python):
        create(custom, trainjob("run-py-standin", "print('ran')", nodes=1))
        kube_standin.wait_for(lambda: (pods := kube_standin.pods_of("default", "run-py-standin")) and pods[0].proc,
                              timeout=30, what="the pod's process")
    create(custom, trainjob("run-py-real", "print('ran')", nodes=1))
    for name in ("run-py-standin", "run-py-real"):
        kube_standin.wait_for_condition("default", name, "Complete", timeout=60)
    argv = {name: kube_standin.pods_of("default", name)[0].proc.args for name in ("run-py-standin", "run-py-real")}
    assert argv == {"run-py-standin": [trainer_standin.python, "-c", "print('ran')"],
                    "run-py-real": [sys.executable, "-c", "print('ran')"]}
    assert kube_standin.python == sys.executable


def test_a_failing_node_fails_the_trainjob_and_stops_the_other(kube_standin, custom, core):
    script = ("import os, sys, time\n"
              "if os.environ['PET_NODE_RANK'] == '1':\n    sys.exit(3)\n"
              "time.sleep(120)")
    create(custom, trainjob("run-fail", script))
    failed = kube_standin.wait_for_condition("default", "run-fail", "Failed", timeout=60)
    assert (failed["reason"], failed["message"]) == ("FailedJobs", "jobset failed due to one or more job failures")
    kube_standin.wait_for(lambda: all(p.status.phase == "Failed" for p in pods_of(core, "run-fail")), timeout=30,
                          what="both pods Failed")
    statuses = {p.metadata.labels[LABEL_COMPLETION_INDEX]: p.status.container_statuses[0].state.terminated
                for p in pods_of(core, "run-fail")}
    assert statuses["1"].exit_code == 3
    assert statuses["0"].signal == 15  # SIGTERM to the surviving node's process group
    jobs = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "run-fail")["status"]["jobsStatus"]
    assert jobs == [{"name": "node", "active": 0, "ready": 0, "succeeded": 0, "failed": 1, "suspended": 0}]


def test_active_deadline_kills_the_pods(kube_standin, custom, core):
    create(custom, trainjob("run-deadline", "import time; time.sleep(300)", nodes=1, activeDeadlineSeconds=1))
    failed = kube_standin.wait_for_condition("default", "run-deadline", "Failed", timeout=60)
    assert failed["reason"] == "DeadlineExceeded"
    kube_standin.wait_for(lambda: pods_of(core, "run-deadline")[0].status.phase == "Failed", timeout=30,
                          what="the pod Failed")
    pod = kube_standin.pods_of("default", "run-deadline")[0]
    assert pod.proc.poll() == -15 and not _alive(pod.proc.pid)


def test_suspend_holds_the_pods_and_a_patch_resumes(kube_standin, custom, core):
    create(custom, trainjob("run-suspend", "print('resumed')", nodes=2, suspend=True))
    kube_standin.wait_for_condition("default", "run-suspend", "Suspended", timeout=30)
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "run-suspend")
    assert obj["status"]["jobsStatus"][0]["suspended"] == 1 and pods_of(core, "run-suspend") == []

    status, error = error_of(lambda: custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "run-suspend", {"spec": {"trainer": {"numNodes": 3}}}))
    assert status == 422 and "field is immutable" in error["message"]
    patched = custom.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "run-suspend",
                                                    {"spec": {"suspend": False}})
    assert patched["metadata"]["generation"] == 2
    kube_standin.wait_for_condition("default", "run-suspend", "Complete", timeout=60)
    resumed = kube_standin.condition("default", "run-suspend", "Suspended")
    assert (resumed["status"], resumed["reason"]) == ("False", "Resumed")
    assert len(pods_of(core, "run-suspend")) == 2


def test_unschedulable_pods_wait_pending_until_the_cluster_has_room(kube_standin, custom, core):
    kube_standin.schedulable = False
    try:
        create(custom, trainjob("run-pending", "print('scheduled')", nodes=2))
        kube_standin.wait_for(lambda: len(pods_of(core, "run-pending")) == 2, timeout=30, what="two pods")
        ticks = kube_standin.ticks
        kube_standin.wait_for(lambda: kube_standin.ticks >= ticks + 3, timeout=30, what="three controller passes")
        pods = pods_of(core, "run-pending")
        assert {p.status.phase for p in pods} == {"Pending"}
        scheduled = [c for c in pods[0].status.conditions if c.type == "PodScheduled"][0]
        assert (scheduled.status, scheduled.reason) == ("False", "Unschedulable")
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "run-pending")
        assert obj["status"]["jobsStatus"][0]["active"] == 1 and obj["status"]["jobsStatus"][0]["ready"] == 0
        status, error = error_of(lambda: core.read_namespaced_pod_log(pods[0].metadata.name, "default"))
        assert status == 400 and "is waiting to start" in error["message"]
    finally:
        kube_standin.schedulable = True
    kube_standin.wait_for_condition("default", "run-pending", "Complete", timeout=60)


def _running(kube_standin, core, name):
    kube_standin.wait_for(lambda: (pods := pods_of(core, name)) and all(p.status.phase == "Running" for p in pods),
                          timeout=30, what=f"{name}'s pods Running")
    return [p.proc.pid for p in kube_standin.pods_of("default", name)]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def test_foreground_delete_kills_the_pods_then_removes_the_trainjob(kube_standin, custom, core):
    create(custom, trainjob("del-fg", "import time; time.sleep(300)"))
    pids = _running(kube_standin, core, "del-fg")
    answer = custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "del-fg",
                                                    propagation_policy="Foreground")
    assert answer["metadata"]["deletionTimestamp"] and "foregroundDeletion" in answer["metadata"]["finalizers"]
    kube_standin.wait_for(lambda: kube_standin.trainjob("default", "del-fg") is None, timeout=30,
                          what="the TrainJob to go")
    assert not any(_alive(pid) for pid in pids) and pods_of(core, "del-fg") == []
    assert kube_standin.requests_for("DELETE", "/trainjobs/del-fg")[0].query["propagationPolicy"] == ["Foreground"]


def test_background_delete_removes_the_trainjob_first_and_orphan_leaves_the_pods(kube_standin, custom, core):
    create(custom, trainjob("del-bg", "import time; time.sleep(300)", nodes=1))
    create(custom, trainjob("del-orphan", "import time; time.sleep(300)", nodes=1))
    bg_pids = _running(kube_standin, core, "del-bg")
    orphan_pids = _running(kube_standin, core, "del-orphan")
    answer = custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "del-bg",
                                                    propagation_policy="Background")
    assert answer["status"] == "Success"
    status, _ = error_of(lambda: custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "del-bg"))
    assert status == 404
    kube_standin.wait_for(lambda: pods_of(core, "del-bg") == [], timeout=30, what="the garbage collector")
    assert not any(_alive(pid) for pid in bg_pids)

    custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "del-orphan",
                                           body=client.V1DeleteOptions(propagation_policy="Orphan"))
    ticks = kube_standin.ticks
    kube_standin.wait_for(lambda: kube_standin.ticks >= ticks + 5, timeout=30, what="five controller passes")
    assert all(_alive(pid) for pid in orphan_pids)
    assert [p.status.phase for p in pods_of(core, "del-orphan")] == ["Running"]
    for pid in orphan_pids:  # the fixture would kill it at the end; do it now to free the CPU
        os.killpg(pid, 9)


def test_an_eviction_disrupts_the_pod_and_fails_the_trainjob_as_jobset_would(kube_standin, api, custom, core):
    # the pod exits 0 on SIGTERM (as the trainer does after its checkpoint): still Failed, as the Job
    # controller counts a pod deleted before it succeeded
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
              "print('up', flush=True)\ntime.sleep(300)")
    create(custom, trainjob("run-evict", script, nodes=2))
    pids = _running(kube_standin, core, "run-evict")
    victim = [p for p in pods_of(core, "run-evict") if p.metadata.labels[LABEL_COMPLETION_INDEX] == "1"][0].metadata.name
    # Running is the process started; its "up" comes after its SIGTERM handler (a SIGTERM before it: 143)
    kube_standin.wait_for(lambda: "up" in core.read_namespaced_pod_log(victim, "default"), timeout=60,
                          what="the victim's SIGTERM handler")

    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=victim, namespace="default"),
                                 delete_options=client.V1DeleteOptions(grace_period_seconds=5))
    core.create_namespaced_pod_eviction(victim, "default", eviction)
    [request] = kube_standin.requests_for("POST", f"/pods/{victim}/eviction")
    assert (request.status, request.body["metadata"]["name"], request.body["deleteOptions"]) == \
        (201, victim, {"gracePeriodSeconds": 5})

    failed = kube_standin.wait_for_condition("default", "run-evict", "Failed", timeout=60)
    assert (failed["reason"], failed["message"]) == ("FailedJobs", "jobset failed due to one or more job failures")
    kube_standin.wait_for(lambda: all(p.status.phase == "Failed" for p in pods_of(core, "run-evict")), timeout=30,
                          what="both pods Failed")
    pods = {p.metadata.name: p for p in pods_of(core, "run-evict")}
    evicted = pods[victim]
    [target] = [c for c in evicted.status.conditions if c.type == "DisruptionTarget"]
    assert (target.status, target.reason, target.message) == ("True", "EvictionByEvictionAPI", "Eviction API: evicting")
    assert evicted.metadata.deletion_timestamp is not None
    assert evicted.status.container_statuses[0].state.terminated.exit_code == 0  # its own exit: clean
    [other] = [p for name, p in pods.items() if name != victim]
    assert not [c for c in other.status.conditions if c.type == "DisruptionTarget"]  # killed by JobSet, not disrupted
    assert not any(_alive(pid) for pid in pids)

    # strict decoding: an unknown field, a name that is not the URL's, no such pod; a second eviction is a no-op
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": victim}}
    evict = "/api/v1/namespaces/{namespace}/pods/{name}/eviction"

    def post(name, payload):
        return api.call_api(evict, "POST", {"namespace": "default", "name": name}, [],
                            {"Content-Type": "application/json"}, body=payload, auth_settings=["BearerToken"], response_type="object",
                            _return_http_data_only=True)

    status, error = error_of(lambda: post(victim, {**body, "spec": {}}))
    assert (status, error["message"]) == (400, 'strict decoding error: unknown field "spec"')
    status, error = error_of(lambda: post(victim, {**body, "kind": "Pod"}))
    assert status == 400 and "expected apiVersion policy/v1 kind Eviction" in error["message"]
    status, error = error_of(lambda: post(victim, {**body, "metadata": {"name": "other"}}))
    assert (status, error["message"]) == (400, "name in URL does not match name in Eviction object")
    status, error = error_of(lambda: post("no-such-pod", {**body, "metadata": {"name": "no-such-pod"}}))
    assert status == 404
    assert post(victim, body)["status"] == "Success"
    assert [c.reason for c in core.read_namespaced_pod(victim, "default").status.conditions
            if c.type == "DisruptionTarget"] == ["EvictionByEvictionAPI"]


@pytest.mark.parametrize("reason, deleted", [("PreemptionByScheduler", True), ("TerminationByKubelet", False)])
def test_the_other_disruptions_are_played_by_a_hook_with_kubernetes_reasons(kube_standin, custom, core, reason, deleted):
    name = f"run-{reason.lower()[:11]}"
    create(custom, trainjob(name, "import time; time.sleep(300)", nodes=1))
    [pid] = _running(kube_standin, core, name)
    pod = pods_of(core, name)[0].metadata.name
    with pytest.raises(ValueError, match="expected one of PreemptionByScheduler"):
        kube_standin.disrupt("default", pod, "OOMKilled")
    condition = kube_standin.disrupt("default", pod, reason, grace_s=0)  # SIGKILL at once: a node gone
    assert (condition["reason"], condition["message"]) == (reason, DISRUPTION_REASONS[reason])
    kube_standin.wait_for_condition("default", name, "Failed", timeout=60)
    ended = core.read_namespaced_pod(pod, "default")
    assert ended.status.phase == "Failed" and (ended.metadata.deletion_timestamp is not None) is deleted
    assert ended.status.container_statuses[0].state.terminated.signal == 9 and not _alive(pid)
    with pytest.raises(ValueError, match="has ended"):
        kube_standin.disrupt("default", pod, reason)


def test_secrets_are_stored_base64_resolved_into_pods_and_a_missing_one_holds_the_pod(kube_standin, custom, core):
    created = core.create_namespaced_secret("default", {"metadata": {"name": "run-secret-env"},
                                                        "stringData": {"TOKEN": "t0k"}})
    assert created.data == {"TOKEN": "dDBr"} and created.type == "Opaque" and created.metadata.uid
    status, error = error_of(lambda: core.create_namespaced_secret("default", {"metadata": {"name": "run-secret-env"}}))
    assert status == 409 and error["reason"] == "AlreadyExists"
    status, error = error_of(lambda: core.create_namespaced_secret(
        "default", {"metadata": {"name": "Bad_Name"}, "data": {"k": "not base64!"}}))
    assert status == 422 and "RFC 1123" in error["message"] and "illegal base64 data" in error["message"]

    ref = {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "run-secret-env", "key": "TOKEN"}}}
    body = trainjob("run-secret", "import os; print('token', os.environ['TOKEN'])", nodes=1)
    body["spec"]["trainer"]["env"] = [ref]
    job = create(custom, body)
    kube_standin.wait_for_condition("default", "run-secret", "Complete", timeout=60)
    assert [p.environ["TOKEN"] for p in kube_standin.pods_of("default", "run-secret")] == ["t0k"]

    missing = trainjob("run-no-secret", nodes=1)
    missing["spec"]["trainer"]["env"] = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "absent",
                                                                                          "key": "TOKEN"}}}]
    create(custom, missing)
    kube_standin.wait_for(lambda: pods_of(core, "run-no-secret") and pods_of(core, "run-no-secret")[0].status
                          .container_statuses, timeout=30, what="the pod's container status")
    waiting = pods_of(core, "run-no-secret")[0].status.container_statuses[0].state.waiting
    assert (waiting.reason, waiting.message) == ("CreateContainerConfigError", 'secret "absent" not found')

    # Owned by a TrainJob, a Secret goes when the TrainJob is deleted (here the Background way).
    core.patch_namespaced_secret("run-secret-env", "default", {"metadata": {"ownerReferences": [
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJob", "name": "run-secret", "uid": job["metadata"]["uid"]}]}})
    custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "run-secret",
                                           body=client.V1DeleteOptions(propagation_policy="Background"))
    status, _ = error_of(lambda: core.read_namespaced_secret("run-secret-env", "default"))
    assert status == 404
    custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "run-no-secret")
