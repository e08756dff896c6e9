"""End to end on Kubernetes with Kubeflow Trainer: the real Celery worker (embedded beat, Redis,
PostgreSQL) drives ``kubernetes`` backend jobs through the official ``kubernetes`` client against the
stand-in API server (tests/k8s_standin.py), which plays Trainer and JobSet by running each pod as a
local process group with the ``PET_*`` variables of the torch runtime:

- a 2-node × 2-process digits DDP job reaches SUCCEEDED with metrics from the pods' logs and its cost
  at the node pool's internal rate, and the TrainJob the stand-in received is checked field by field
  against the fields trainjob_types.go documents, and against what Trainboard meant;
- a cancel deletes the TrainJob with foreground propagation: CANCELLED, and the pods are gone. Its
  pods run the trainer stand-in (tests/standins/trainer.py) for ``python``, held at its first step:
  the job runs until it is cancelled, however slow the machine.

The kubeconfig, its context and the allowed images are this installation's (TRAINBOARD_K8S_*), as in
production; the worker consumes the default queue ``celery``, the kubernetes backend's.
"""

from __future__ import annotations

import json
import zipfile
from decimal import Decimal

import pytest

from jobs import selectors, services
from jobs.models import JobStateChoices as S, MetricPoint, TrainingJob
from jobs.services.prices import instance_price_save
from k8s_standin import GROUP, LABEL_COMPLETION_INDEX, TRAINJOB_SCHEMA, kube_standin_server, schema_errors

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

RATE = Decimal("3.6")  # USD per node-hour of node pool cpu-pool on cluster standin
IMAGE = "registry.example/trainboard/trainer:e2e"
COMMAND = ["python", "-m", "trainer_pkg.launch", "--config", "env:TRAINBOARD_JOB_CONFIG", "--platform", "kubernetes"]
TOLERATION = {"key": "trainboard.io/dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with kube_standin_server(tmp_path_factory.mktemp("k8s-e2e"), grace_period_s=15) as server:
        yield server


@pytest.fixture(scope="module")
def worker(cluster, django_db_blocker, celery_worker_factory, tmp_path_factory):
    directory = tmp_path_factory.mktemp("k8s-worker")
    with django_db_blocker.unblock():
        with celery_worker_factory(directory, directory / "runs", extra_env=cluster.installation(),
                                   queues="celery") as running:
            yield running


@pytest.fixture
def kube(cluster, settings, user, tmp_path):
    for name, value in cluster.installation().items():
        setattr(settings, name, value)
    instance_price_save(provider="kubernetes", region="standin", instance_type="cpu-pool", usd_per_hour=RATE)
    return services.backend_create(owner=user, name="kube", kind="kubernetes", config={
        "namespace": "default", "image": IMAGE, "cluster": "standin", "node_pool": "cpu-pool",
        "cpu_request": "1", "memory_request": "1Gi", "output_path": str(tmp_path / "pod-output"),
        "node_selector": {"node.kubernetes.io/instance-type": "standin-cpu-4"}, "tolerations": [TOLERATION],
    })


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _ended(worker, job, timeout=300):
    return worker.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=timeout, what="the job to end")


def _posted(cluster, name: str) -> dict:
    [request] = [r for r in cluster.requests_for("POST", "/namespaces/default/trainjobs")
                 if (r.body or {}).get("metadata", {}).get("name") == name and r.status == 201]
    return request.body


def test_two_nodes_two_processes_succeed_with_metrics_cost_and_a_documented_trainjob(
        worker, cluster, kube, user, digits_dataset, cnn_model, tmp_path):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=kube,
                                       nodes=2, procs_per_node=2, epochs=2)
    job = _ended(worker, job)
    assert job.state == S.SUCCEEDED, (job.failure_reason, worker.log()[-3000:])
    events = [e.to_state for e in selectors.training_job_events(job=job)]
    assert events[:3] == ["QUEUED", "SUBMITTING", "PENDING"] and events[-2:] == ["RUNNING", "SUCCEEDED"]

    val = list(MetricPoint.objects.filter(job=job, name="val_accuracy", rank__isnull=True)
               .order_by("step").values_list("epoch", flat=True))
    assert val == [0, 1]
    assert MetricPoint.objects.filter(job=job, name="rank_samples_per_s", rank=3).exists()  # 4 ranks

    run_s = (job.ended_at - job.started_at).total_seconds()
    assert run_s > 0
    # cost = elapsed × 2 nodes × $3.60 per node-hour; 4 decimal places stored
    assert float(job.cost_usd) == pytest.approx(2 * float(RATE) * run_s / 3600, rel=0.02, abs=0.0001)

    # The TrainJob as the API server received it: only fields trainjob_types.go documents ...
    body = _posted(cluster, job.provider_job_name)
    unknown, type_errors = schema_errors(body, TRAINJOB_SCHEMA, "")
    assert (unknown, type_errors) == ([], [])
    assert sorted(body) == ["apiVersion", "kind", "metadata", "spec"]
    assert (body["apiVersion"], body["kind"]) == (f"{GROUP}/v1alpha1", "TrainJob")
    # ... holding what Trainboard meant
    assert body["metadata"] == {"name": job.provider_job_name, "namespace": "default", "labels": {
        "trainboard-job-id": str(job.pk), "trainboard-job-name": job.provider_job_name}}
    spec = body["spec"]
    assert sorted(spec) == ["activeDeadlineSeconds", "runtimePatches", "runtimeRef", "trainer"]
    assert spec["runtimeRef"] == {"name": "torch-distributed", "apiGroup": GROUP, "kind": "ClusterTrainingRuntime"}
    assert spec["activeDeadlineSeconds"] == job.max_runtime_s
    trainer = spec["trainer"]
    assert sorted(trainer) == ["command", "env", "image", "numNodes", "numProcPerNode", "resourcesPerNode"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (2, 2, IMAGE)
    assert trainer["command"] == COMMAND
    assert trainer["resourcesPerNode"] == {"requests": {"cpu": "1", "memory": "1Gi"}}
    env = {item["name"]: item["value"] for item in trainer["env"]}
    assert all(sorted(item) == ["name", "value"] for item in trainer["env"])
    assert env["TRAINBOARD_JOB_NAME"] == job.provider_job_name and env["PYTHONUNBUFFERED"] == "1"
    sent = json.loads(env["TRAINBOARD_JOB_CONFIG"])
    frozen = _reload(job).config
    for section in ("data", "model", "train", "parallel"):
        assert sent[section] == frozen[section], section
    assert (sent["parallel"]["nodes"], sent["parallel"]["procs_per_node"], sent["parallel"]["strategy"]) == (2, 2, "ddp")
    assert (sent["data"]["format"], sent["data"]["name"]) == ("builtin", "digits")
    assert sent["output"]["output_dir"].endswith(f"/pod-output/{job.provider_job_name}")
    [patch] = spec["runtimePatches"]
    assert patch["manager"] == "trainboard"
    [node_job] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node_job == {"name": "node", "template": {"spec": {"template": {"spec": {
        "nodeSelector": {"node.kubernetes.io/instance-type": "standin-cpu-4"}, "tolerations": [TOLERATION]}}}}}

    # The pods the controller ran: one per node, with the patch applied and the runtime's variables
    pods = cluster.pods_of("default", job.provider_job_name)
    assert [p.index for p in pods] == [0, 1]
    for pod in pods:
        assert pod.obj["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "standin-cpu-4"}
        assert pod.obj["status"]["phase"] == "Succeeded"
        assert pod.obj["metadata"]["labels"][LABEL_COMPLETION_INDEX] == str(pod.index)
        pet = {e["name"]: e.get("value") for e in pod.obj["spec"]["containers"][0]["env"] if e["name"].startswith("PET_")}
        assert (pet["PET_NNODES"], pet["PET_NPROC_PER_NODE"], pet["PET_MASTER_ADDR"]) == ("2", "2", "127.0.0.1")
    assert "[launch] platform: kubernetes" in pods[0].log_path.read_text()
    # the real trainer ran (torch.save writes a zip archive; the trainer stand-in writes JSON)
    assert zipfile.is_zipfile(tmp_path / "pod-output" / job.provider_job_name / "model.pt")


def test_cancel_deletes_the_trainjob_in_the_foreground_and_gives_cancelled(worker, cluster, kube, user,
                                                                          digits_dataset, cnn_model, tmp_path,
                                                                          trainer_standin, live_processes):
    trainer_standin.hold(steps=1)
    with cluster.with_python(trainer_standin.python):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=kube,
                                           nodes=2, procs_per_node=2, epochs=1)
        name = job.provider_job_name
        ranks = trainer_standin.wait_at(1, tmp_path / "pod-output" / name, timeout=180)
    assert ranks["world_size"] == 4  # both pods' ranks took their first step and wait
    worker.wait_for(lambda: _reload(job).state == S.RUNNING, timeout=60, what="the job to be RUNNING")
    pids = [p.proc.pid for p in cluster.pods_of("default", name) if p.proc is not None]
    assert len(pids) == 2
    services.training_job_cancel(job=_reload(job))
    job = _ended(worker, job, timeout=120)
    assert job.state == S.CANCELLED, (job.failure_reason, worker.log()[-3000:])
    assert [e.to_state for e in selectors.training_job_events(job=job)][-2:] == ["STOPPING", "CANCELLED"]
    deletes = cluster.requests_for("DELETE", f"/namespaces/default/trainjobs/{name}")
    assert deletes and all(
        (r.query.get("propagationPolicy") or [(r.body or {}).get("propagationPolicy")])[-1] == "Foreground"
        for r in deletes)
    assert cluster.trainjob("default", name) is None and cluster.pods_of("default", name) == []
    live = set(cluster.live_pids())
    assert not live & set(pids)
    # SIGTERM to each pod's process group reached its torchrun, which stopped its ranks (their own
    # sessions): each stopped cleanly (a checkpoint, then `stopped`), and none is left
    assert [p["state"] for p in trainer_standin.positions()] == ["stopped"] * 4
    worker.wait_for(lambda: not live_processes(trainer_standin.python), timeout=10, what="no rank left")
