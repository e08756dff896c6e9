"""A lost run on Kubernetes (docs/recovery.md), against the stand-in API server through the official
client: a pod evicted through the Eviction API (``DisruptionTarget`` ``EvictionByEvictionAPI``) makes
its Failed TrainJob a lost run that names the pod; a job that fails for its own reasons (a trainer
error, its deadline) stays not lost; the batch costs one TrainJob list and one pod list. The lost
attempt's checkpoint directory (``checkpoint_uri``) is given to the next attempt, a TrainJob of a new
name, whose trainer resumes from it and ends with the epochs asked for."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from cloud_adapters.base import InvalidSpec, JobState
from cloud_adapters.kubernetes import KubernetesBackend
from cloud_adapters.retry import RetryPolicy

TRAINJOBS = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs"
EPOCHS = 4
LONG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp", "params": {"hidden_size": 16}},
        "train": {"epochs": EPOCHS, "batch_size": 4, "log_every_steps": 20}}
SHORT = {**LONG, "train": {"epochs": 1, "max_steps": 2, "batch_size": 32, "log_every_steps": 1}}
BAD = {**SHORT, "data": {"format": "builtin", "name": "no-such-dataset"}}


@pytest.fixture(scope="module")
def standin(kube_standin):
    return kube_standin


def make(standin) -> KubernetesBackend:
    return KubernetesBackend({"kubeconfig": str(standin.kubeconfig_path), "image": "ghcr.io/acme/trainer:1",
                              "allowed_images": "ghcr.io/acme/*", "output_path": str(standin.directory / "out") + "/"},
                             retry_policy=RetryPolicy(max_attempts=2, base_delay_s=0.01))


def spec(name: str, config: dict, **fields):
    from cloud_adapters.base import JobSpec

    values = dict(job_name=name, config=config, nodes=2, procs_per_node=1, max_runtime_s=600,
                  tags={"trainboard-job-id": name.split("-")[2]}, env={"OMP_NUM_THREADS": "1"})
    values.update(fields)
    return JobSpec(**values)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_an_evicted_pod_is_a_lost_run_and_the_next_attempt_resumes_from_its_checkpoints(standin):
    backend = make(standin)
    out = standin.directory / "out"
    lost = backend.submit(spec("tb-job-61-aa", LONG))
    own = backend.submit(spec("tb-job-62-aa", BAD, nodes=1))
    deadline = backend.submit(spec("tb-job-63-aa", SHORT, nodes=1, max_runtime_s=1))

    # Evict rank 1 once the first epoch's checkpoint is written, as `kubectl drain` would.
    standin.wait_for(lambda: (out / "tb-job-61-aa" / "checkpoints" / "last.pt").is_file(), timeout=240,
                     what="the first checkpoint")
    victim = next(p.name for p in standin.pods_of("default", "tb-job-61-aa") if p.index == 1)
    client.CoreV1Api(standin.client()).create_namespaced_pod_eviction(victim, "default", client.V1Eviction(
        metadata=client.V1ObjectMeta(name=victim, namespace="default"),
        delete_options=client.V1DeleteOptions(grace_period_seconds=5)))
    for name in ("tb-job-61-aa", "tb-job-62-aa", "tb-job-63-aa"):
        standin.wait_for_condition("default", name, "Failed", timeout=240)

    lists = len([r for r in standin.requests_for("GET", TRAINJOBS) if r.path == TRAINJOBS])
    pod_lists = len(standin.requests_for("GET", "/pods"))
    statuses = backend.describe_many([lost, own, deadline])
    assert len([r for r in standin.requests_for("GET", TRAINJOBS) if r.path == TRAINJOBS]) == lists + 1
    assert len(standin.requests_for("GET", "/pods")) == pod_lists + 1  # one pod list, for the two that may be lost
    assert standin.requests_for("GET", "/pods")[-1].query["labelSelector"] == \
        ["jobset.sigs.k8s.io/jobset-name in (tb-job-61-aa,tb-job-62-aa)"]

    s = statuses["tb-job-61-aa"]
    assert (s.state, s.raw_state, s.lost) == (JobState.FAILED, "Failed", True)
    assert s.failure_reason == (f"pod {victim} (node 1) disrupted: EvictionByEvictionAPI (Eviction API: evicting); "
                                f"TrainJob FailedJobs: jobset failed due to one or more job failures")
    o = statuses["tb-job-62-aa"]
    assert (o.state, o.lost, o.failure_reason) == (
        JobState.FAILED, False, "FailedJobs: jobset failed due to one or more job failures")
    d = statuses["tb-job-63-aa"]
    assert (d.state, d.lost) == (JobState.FAILED, False)
    assert d.failure_reason.startswith("max runtime reached (activeDeadlineSeconds 1 s)")

    # Where the lost attempt's checkpoints are: the adapter's word, no call.
    calls = len(standin.requests)
    checkpoints = backend.checkpoint_uri(lost)
    assert checkpoints == f"{out}/tb-job-61-aa/checkpoints" == backend.artifact_uri(lost, "checkpoints")
    assert len(standin.requests) == calls
    lost_epochs = [r["epoch"] for r in records(out / "tb-job-61-aa" / "metrics.jsonl") if r.get("event") == "epoch"]
    assert lost_epochs and max(lost_epochs) < EPOCHS - 1  # it was lost before its last epoch

    # The next attempt (a new TrainJob name) is given that directory and resumes from it.
    second = spec("tb-job-61-aa-a2", LONG, checkpoint_uri=checkpoints)
    handle = backend.submit(second)
    [posted] = [r.body for r in standin.requests_for("POST", TRAINJOBS)
                if r.body["metadata"]["name"] == "tb-job-61-aa-a2" and r.status == 201]
    sent = json.loads(next(e["value"] for e in posted["spec"]["trainer"]["env"] if e["name"] == "TRAINBOARD_JOB_CONFIG"))
    assert sent["output"] == {"output_dir": f"{out}/tb-job-61-aa-a2", "checkpoint_dir": checkpoints}
    status = standin.wait_for(lambda: (s := backend.describe(handle)).state.is_terminal and s, timeout=300,
                              what="attempt 2 to end")
    assert (status.state, status.lost) == (JobState.SUCCEEDED, False), status.failure_reason
    ran = records(out / "tb-job-61-aa-a2" / "metrics.jsonl")
    started = next(r for r in ran if r.get("event") == "started")
    assert started["resumed"] is True and started["epoch"] >= 1 and started["step"] > 1  # not from epoch 0
    epochs = [r["epoch"] for r in ran if r.get("event") == "epoch"]
    assert epochs == list(range(started["epoch"], EPOCHS))  # the rest, each once: EPOCHS in all with the lost ones
    assert sorted(set(lost_epochs) | set(epochs)) == list(range(EPOCHS))


def test_a_checkpoint_directory_off_the_output_volume_is_refused_before_any_call(standin):
    backend = make(standin)
    posts = len(standin.requests_for("POST", TRAINJOBS))
    out = str(standin.directory / "out")
    for place in ("/etc/checkpoints", f"{out}/../elsewhere/checkpoints", out, "s3://bucket/checkpoints",
                  f"{out}-other/tb-job-1/checkpoints"):
        with pytest.raises(InvalidSpec, match="expected a directory under the output path"):
            backend.submit(spec("tb-job-64-aa", SHORT, checkpoint_uri=place))
    assert len(standin.requests_for("POST", TRAINJOBS)) == posts
    backend.validate(spec("tb-job-64-aa", SHORT, checkpoint_uri=f"{out}/tb-job-1-aa/checkpoints"))
