"""The Kubernetes adapter against the stand-in API server (tests/k8s_standin.py) through the official
client over HTTP: submit and adopt (409), one label-selected list for many jobs, pending reasons,
suspension, max runtime, cancel (CANCELLED) and a deletion outside Trainboard (FAILED), logs rank 0
first with a cursor, orphans by label, Test connection, and the server's own refusals (422).

The jobs that run are the trainer stand-in's (tests/standins/trainer.py, ``python`` in the pods; its
gate open, so they run to their end at once): the real launcher under ``--platform kubernetes``,
without torch. The real trainer runs on the stand-in cluster in tests/e2e/test_kubernetes.py (a
2-node job to SUCCEEDED) and test_k8s_lost.py (a lost run resumed from its checkpoints)."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from cloud_adapters.base import CredentialsError, InvalidSpec, JobHandle, JobSpec, JobState
from cloud_adapters.kubernetes import KubernetesBackend
from cloud_adapters.retry import RetryPolicy
from trainer_pkg.metrics import METRIC_PREFIX

TRAIN = {"data": {"format": "builtin", "name": "digits"},
         "model": {"arch": "mlp", "params": {"hidden_size": 16}},
         "train": {"epochs": 1, "max_steps": 2, "batch_size": 32, "log_every_steps": 1}}
TRAINJOBS = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs"


@pytest.fixture(scope="module")
def standin(kube_standin):
    return kube_standin


@pytest.fixture
def pods_on_standin(standin, trainer_standin):
    """The pods started during the test run the trainer stand-in for ``python``."""
    with standin.with_python(trainer_standin.python):
        yield trainer_standin


def make(standin, tmp_path_factory=None, **settings) -> KubernetesBackend:
    return KubernetesBackend({"kubeconfig": str(standin.kubeconfig_path), "image": "ghcr.io/acme/trainer:1",
                              "allowed_images": "ghcr.io/acme/*", "output_path": str(standin.directory / "out"),
                              **settings}, retry_policy=RetryPolicy(max_attempts=2, base_delay_s=0.01))


def spec(name: str, **fields) -> JobSpec:
    values = dict(job_name=name, config=TRAIN, nodes=2, procs_per_node=1, max_runtime_s=600,
                  tags={"trainboard-job-id": name.split("-")[2]}, env={"OMP_NUM_THREADS": "1"})
    values.update(fields)
    return JobSpec(**values)


def list_calls(standin) -> int:
    return len([r for r in standin.requests_for("GET", TRAINJOBS) if r.path == TRAINJOBS])


def test_submit_is_idempotent_runs_to_succeeded_and_logs_rank_0_first(standin, pods_on_standin):
    backend = make(standin, cpu_request="1")
    job = spec("tb-job-11-aa")
    handle = backend.submit(job)
    assert (handle.provider, handle.job_name, handle.provider_job_id) == ("kubernetes", "tb-job-11-aa", "tb-job-11-aa")
    assert handle.extra["namespace"] == "default" and handle.extra["uid"]
    again = make(standin).submit(job)  # a retried submit: 409, then the TrainJob adopted
    assert again == handle
    posts = [r for r in standin.requests_for("POST", TRAINJOBS) if r.body["metadata"]["name"] == "tb-job-11-aa"]
    assert [r.status for r in posts] == [201, 409]
    assert posts[0].body == backend.train_job(job)  # what was sent is the body built, field by field
    assert [key for key in standin.trainjobs if key[1] == "tb-job-11-aa"] == [("default", "tb-job-11-aa")]

    status = standin.wait_for(lambda: (s := backend.describe(handle)).state.is_terminal and s, timeout=240,
                              what="the TrainJob to end")
    assert (status.state, status.raw_state, status.instance_count) == (JobState.SUCCEEDED, "Complete", 2)
    assert status.started_at is not None and status.ended_at is not None and status.ended_at >= status.started_at
    lines, cursor = backend.logs(handle)
    first_other = next(i for i, line in enumerate(lines) if line.startswith("[node 1] "))
    assert all(line.startswith("[node 0] ") or METRIC_PREFIX in line for line in lines[:first_other])
    assert "[node 0] [launch] platform: kubernetes (--platform kubernetes), node_rank 0 of 2 node(s)" in lines[0]
    assert any(line.startswith(METRIC_PREFIX) for line in lines)  # metric records as printed
    assert set(json.loads(cursor)) == {p.name for p in standin.pods_of("default", "tb-job-11-aa")}
    assert backend.logs(handle, cursor) == ([], cursor)  # nothing new: nothing twice
    ran = json.loads((standin.directory / "out" / "tb-job-11-aa" / "metrics.jsonl").read_text().splitlines()[-1])
    assert ran["step"] >= 1
    assert [p["state"] for p in pods_on_standin.positions()] == ["completed"] * 2  # both pods' ranks


def test_describe_many_is_one_list_and_tells_pending_reasons_suspension_and_deadline(standin):
    backend = make(standin)
    standin.schedulable = False
    try:
        waiting = backend.submit(spec("tb-job-21-bb"))
        suspended = make(standin, suspend=True, queue_name="team-a").submit(spec("tb-job-22-bb"))
        deadline = backend.submit(spec("tb-job-23-bb", max_runtime_s=1))
        standin.wait_for(lambda: standin.condition("default", "tb-job-23-bb", "Failed"), timeout=60,
                         what="the deadline")
        standin.wait_for(lambda: standin.condition("default", "tb-job-22-bb", "Suspended"), timeout=60,
                         what="the suspension")
        standin.wait_for(lambda: standin.pods_of("default", "tb-job-21-bb"), timeout=60, what="pods")
        lists, pod_lists = list_calls(standin), len(standin.requests_for("GET", "/pods"))
        gone = JobHandle(provider="kubernetes", job_name="tb-job-24-bb", provider_job_id="tb-job-24-bb")
        statuses = backend.describe_many([waiting, suspended, deadline, gone])
        assert list_calls(standin) == lists + 1  # one list for the four
        assert len(standin.requests_for("GET", "/pods")) == pod_lists + 1  # one pod list, for the waiting one
        assert standin.requests_for("GET", "/pods")[-1].query["labelSelector"] == \
            ["jobset.sigs.k8s.io/jobset-name in (tb-job-21-bb)"]
        w = statuses["tb-job-21-bb"]
        assert (w.state, w.raw_state) == (JobState.PENDING, "PodsPending")
        assert "Unschedulable" in w.secondary_state or "nodes are available" in w.secondary_state
        s = statuses["tb-job-22-bb"]
        assert (s.state, s.raw_state, s.secondary_state) == (JobState.PENDING, "Suspended", "suspended (queued by Kueue?)")
        assert standin.trainjob("default", "tb-job-22-bb")["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        d = statuses["tb-job-23-bb"]
        assert (d.state, d.raw_state) == (JobState.FAILED, "Failed")
        assert d.failure_reason.startswith("max runtime reached (activeDeadlineSeconds 1 s)")
        g = statuses["tb-job-24-bb"]
        assert (g.state, g.raw_state) == (JobState.FAILED, "Deleted")
        assert g.failure_reason.startswith("TrainJob deleted outside Trainboard")

        tagged = {p.name: p for p in backend.list_tagged()}
        assert {"tb-job-21-bb", "tb-job-22-bb"} <= set(tagged) and "tb-job-23-bb" not in tagged
        assert (tagged["tb-job-21-bb"].job_id, tagged["tb-job-21-bb"].state) == (21, JobState.PENDING)
        assert tagged["tb-job-21-bb"].handle == waiting

        backend.cancel(waiting)
        backend.cancel(waiting)  # idempotent
        deletes = standin.requests_for("DELETE", "/trainjobs/tb-job-21-bb")
        assert deletes[0].body["propagationPolicy"] == "Foreground"
        standin.wait_for(lambda: standin.trainjob("default", "tb-job-21-bb") is None, timeout=60, what="deletion")
        cancelled = backend.describe(waiting)
        assert (cancelled.state, cancelled.raw_state) == (JobState.CANCELLED, "Cancelled")
        backend.cancel(waiting)  # 404: already gone, not an error
        assert standin.requests_for("DELETE", "/trainjobs/tb-job-21-bb")[-1].status == 404
        outside = make(standin).describe(waiting)  # an adapter that never deleted it
        assert outside.state is JobState.FAILED
        for handle in (suspended, deadline):
            backend.cancel(handle)
    finally:
        standin.schedulable = True


def test_a_name_taken_by_another_trainjob_is_not_adopted(standin):
    body = make(standin).train_job(spec("tb-job-31-cc"))
    body["metadata"]["labels"]["trainboard-job-name"] = "someone-else"
    client.CustomObjectsApi(standin.client()).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", "default", "trainjobs", {**body, "spec": {**body["spec"], "suspend": True}})
    with pytest.raises(Exception) as exc:
        make(standin).submit(spec("tb-job-31-cc"))
    assert "already has a TrainJob 'tb-job-31-cc' that is not this job's" in str(exc.value)


def test_the_servers_refusal_is_invalid_spec_with_its_message(standin):
    with pytest.raises(InvalidSpec) as exc:
        make(standin, runtime="no-such-runtime").submit(spec("tb-job-41-dd"))
    assert "422" in str(exc.value) and "no-such-runtime" in str(exc.value) and "not found" in str(exc.value)


def test_job_secrets_reach_the_ranks_from_a_secret_owned_by_the_trainjob_never_from_its_spec(standin,
                                                                                             pods_on_standin):
    backend = make(standin)
    token, rotated = "hf_live_7f3a9c", "hf_live_rotated"
    job = spec("tb-job-51-ee", nodes=1, secret_env={"HF_TOKEN": token},
               config={**TRAIN, "train": {**TRAIN["train"], "max_steps": 1}})
    standin.schedulable = False  # its pod waits until the retried submit below has rotated the value
    try:
        handle = backend.submit(job)
        assert token not in json.dumps(standin.trainjob("default", "tb-job-51-ee"))
        secret = standin.secrets[("default", "tb-job-51-ee-env")]
        uid = standin.trainjob("default", "tb-job-51-ee")["metadata"]["uid"]
        assert secret["metadata"]["ownerReferences"] == [
            {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": "tb-job-51-ee", "uid": uid}]
        assert secret["metadata"]["labels"] == {"trainboard-job-id": "51", "trainboard-job-name": "tb-job-51-ee"}
        # A retried submit with a rotated value adopts the TrainJob and refreshes the Secret's data.
        assert make(standin).submit(spec("tb-job-51-ee", nodes=1, secret_env={"HF_TOKEN": rotated},
                                         config=job.config)) == handle
    finally:
        standin.schedulable = True
    secret_posts = [r.status for r in standin.requests_for("POST", "/secrets")
                    if r.body["metadata"]["name"] == "tb-job-51-ee-env"]
    assert secret_posts == [201, 409]
    secret = standin.secrets[("default", "tb-job-51-ee-env")]
    assert secret["data"] == {"HF_TOKEN": "aGZfbGl2ZV9yb3RhdGVk"}  # base64 of the rotated value
    assert len(secret["metadata"]["ownerReferences"]) == 1

    status = standin.wait_for(lambda: (s := backend.describe(handle)).state.is_terminal and s, timeout=240,
                              what="the TrainJob to end")
    assert status.state == JobState.SUCCEEDED
    pod = standin.pods_of("default", "tb-job-51-ee")[0]
    assert pod.environ["HF_TOKEN"] == rotated  # resolved from the Secret when its container started
    # Deleting the TrainJob deletes its Secret (the garbage collector follows the owner reference).
    backend.cancel(handle)
    standin.wait_for(lambda: ("default", "tb-job-51-ee-env") not in standin.secrets, timeout=60,
                     what="the Secret to be collected with its TrainJob")


def test_a_refused_trainjob_leaves_no_secret_and_a_foreign_secret_is_not_taken(standin):
    with pytest.raises(InvalidSpec):
        make(standin, runtime="no-such-runtime").submit(spec("tb-job-52-ff", secret_env={"API_KEY": "k"}))
    assert ("default", "tb-job-52-ff-env") not in standin.secrets
    client.CoreV1Api(standin.client()).create_namespaced_secret("default", {
        "metadata": {"name": "tb-job-53-gg-env", "labels": {"trainboard-job-name": "someone-else"}},
        "stringData": {"API_KEY": "theirs"}})
    with pytest.raises(Exception) as exc:
        make(standin).submit(spec("tb-job-53-gg", secret_env={"API_KEY": "ours"}))
    assert "already has a Secret 'tb-job-53-gg-env' that is not this job's" in str(exc.value)
    assert standin.secrets[("default", "tb-job-53-gg-env")]["data"] == {"API_KEY": "dGhlaXJz"}  # untouched
    assert standin.trainjob("default", "tb-job-53-gg") is None


def test_connection_checks(standin):
    checks = make(standin).test_connection()
    assert [(c.name, c.ok) for c in checks] == [("API server", True), ("namespace", True), ("TrainJob API", True),
                                               ("training runtime", True), ("permissions", True),
                                               ("node pool", True)]
    assert checks[0].message.startswith(f"API server {standin.url} answers: Kubernetes v1.33.0")
    assert checks[4].message == ("this identity may create trainjobs, get trainjobs, list trainjobs, delete trainjobs, "
                                 "list pods, get pods/log, create secrets, get secrets, patch secrets, "
                                 "delete secrets in namespace default.")
    reviews = [r.body["spec"]["resourceAttributes"] for r in standin.requests_for("POST", "selfsubjectaccessreviews")]
    assert {"namespace": "default", "verb": "get", "group": "", "resource": "pods", "subresource": "log"} in reviews
    assert checks[5].message.startswith("4 node(s) in the cluster, instance type standin-cpu-4; jobs are priced at "
                                        "the internal rate of default/default")
    missing = {c.name: c for c in make(standin, namespace="nowhere", runtime="nope",
                                       node_selector={"pool": "a100"}).test_connection()}
    assert not missing["namespace"].ok and missing["namespace"].message.startswith("namespace nowhere does not exist")
    assert not missing["training runtime"].ok and "no ClusterTrainingRuntime 'nope'" in missing["training runtime"].message
    assert not missing["node pool"].ok and "no node matching the node selector pool=a100" in missing["node pool"].message
    standin.access_allowed = False
    try:
        denied = {c.name: c for c in make(standin).test_connection()}
    finally:
        standin.access_allowed = True
    assert not denied["permissions"].ok
    assert denied["permissions"].message.startswith("permissions: this identity may not create trainjobs, get "
                                                    "trainjobs, list trainjobs, delete trainjobs, list pods, get "
                                                    "pods/log, create secrets, get secrets, patch secrets, delete "
                                                    "secrets in namespace default; grant them")


def test_a_wrong_token_is_a_credentials_error_and_a_closed_port_is_transient(standin, tmp_path):
    wrong = KubernetesBackend({"kubeconfig": str(standin.kubeconfig_path), "image": "ghcr.io/acme/t:1",
                               "allowed_images": "*"}, secrets={"token": "not-the-token"},
                              retry_policy=RetryPolicy(max_attempts=1))
    with pytest.raises(CredentialsError) as exc:
        wrong.list_tagged()
    assert "401" in str(exc.value) and "trainjobs create/get/list/delete" in str(exc.value)
    checks = wrong.test_connection()
    assert not checks[0].ok and "401" in checks[0].message
    config = json.loads(standin.kubeconfig_path.read_text())
    config["clusters"][0]["cluster"]["server"] = "http://127.0.0.1:9"  # discard: nothing listens
    closed = tmp_path / "closed"
    closed.write_text(json.dumps(config))
    down = KubernetesBackend({"kubeconfig": str(closed), "image": "ghcr.io/acme/t:1", "allowed_images": "*"},
                             retry_policy=RetryPolicy(max_attempts=2, base_delay_s=0.01))
    with pytest.raises(Exception) as exc:
        down.describe_many([JobHandle(provider="kubernetes", job_name="tb-job-1-a")])
    assert getattr(exc.value, "transient", False) and "could not reach the API server" in str(exc.value)
    bad = KubernetesBackend({"kubeconfig": str(tmp_path / "none"), "image": "ghcr.io/acme/t:1", "allowed_images": "*"})
    with pytest.raises(CredentialsError) as exc:
        bad.list_tagged()
    assert "cannot load kubeconfig" in str(exc.value)
