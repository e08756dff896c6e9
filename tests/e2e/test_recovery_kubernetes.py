"""End to end: a Kubernetes job whose pod is evicted mid-run is resubmitted by Trainboard as a new
TrainJob and resumes from the lost one's checkpoints (docs/recovery.md).

The real Celery worker (embedded beat, Redis, PostgreSQL) drives a 2-node, 3-epoch digits job
through the official ``kubernetes`` client against the stand-in API server (tests/k8s_standin.py).
The pods run the trainer stand-in (tests/standins/trainer.py: the real launcher, a torch-free
trainer that steps only as the test allows), since the subject is the recovery, not the training:
the real trainer's lost run and resume on this stand-in cluster is
tests/cloud_adapters/kubernetes/test_k8s_lost.py. The job is held one step into its second epoch,
after its epoch-0 checkpoint is on the output volume (a directory all the stand-in's pods share, as a
ReadWriteMany volume would be); the test then evicts rank 1's pod through the Eviction API, as
``kubectl drain`` would: the pod ends Failed with ``DisruptionTarget`` ``EvictionByEvictionAPI`` and
the TrainJob Failed. The job must end SUCCEEDED as attempt 2 (TrainJob ``<name>-a2``, given the lost
one's checkpoint directory), which resumed where the first stopped (not at epoch 0), with each of the
3 epochs' validation stored once.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from jobs import selectors, services
from jobs.models import JobAttempt, JobStateChoices as S, MetricPoint, TrainingJob
from k8s_standin import kube_standin_server
from standins.trainer import batches_per_epoch
from trainer_pkg.config import JobConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

IMAGE = "registry.example/trainboard/trainer:e2e"
EPOCHS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with kube_standin_server(tmp_path_factory.mktemp("k8s-recovery"), grace_period_s=10) as server:
        yield server


@pytest.fixture(scope="module")
def worker(cluster, django_db_blocker, celery_worker_factory, tmp_path_factory):
    directory = tmp_path_factory.mktemp("k8s-recovery-worker")
    with django_db_blocker.unblock():
        with celery_worker_factory(directory, directory / "runs", extra_env=cluster.installation(),
                                   queues="celery") as running:
            yield running


@pytest.fixture
def kube(cluster, settings, user, tmp_path):
    for name, value in cluster.installation().items():
        setattr(settings, name, value)
    return services.backend_create(owner=user, name="kube", kind="kubernetes", config={
        "namespace": "default", "image": IMAGE, "output_path": str(tmp_path / "pod-output")})


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def test_an_evicted_pod_is_resubmitted_and_resumes_from_its_checkpoint(worker, cluster, kube, user, tmp_path,
                                                                       digits_dataset, cnn_model, trainer_standin):
    trainer_standin.hold(steps=0)
    with cluster.with_python(trainer_standin.python):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=kube,
                                           nodes=2, procs_per_node=1, epochs=EPOCHS, batch_size=32)
        worker.wait_for(lambda: _reload(job).state == S.RUNNING, timeout=180, what="the job to be RUNNING")
        first = _reload(job).provider_job_name
        output = tmp_path / "pod-output"
        [posted] = [r.body for r in cluster.requests_for("POST", "/namespaces/default/trainjobs")
                    if r.body["metadata"]["name"] == first and r.status == 201]
        config = json.loads(next(e["value"] for e in posted["spec"]["trainer"]["env"]
                                 if e["name"] == "TRAINBOARD_JOB_CONFIG"))
        held_at = batches_per_epoch(JobConfig.from_dict(config), world_size=2) + 1  # one step into epoch 1
        trainer_standin.hold(steps=held_at)
        trainer_standin.wait_at(held_at, output / first, timeout=120)
        assert (output / first / "checkpoints" / "last.pt").is_file(), "epoch 0's checkpoint"

        victim = next(p.name for p in cluster.pods_of("default", first) if p.index == 1)
        client.CoreV1Api(cluster.client()).create_namespaced_pod_eviction(victim, "default", client.V1Eviction(
            metadata=client.V1ObjectMeta(name=victim, namespace="default")))
        # The second attempt resumes where the first stopped, and is held there until released.
        trainer_standin.wait_at(held_at, output / f"{first}-a2", timeout=240)
        trainer_standin.release()
        job = worker.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=240, what="the job to end")

    assert job.state == S.SUCCEEDED, (job.failure_reason, worker.log()[-3000:])
    assert (job.attempt, job.provider_job_name) == (2, f"{first}-a2")
    checkpoints = f"{output}/{first}/checkpoints"
    assert job.checkpoint_uri == checkpoints
    [lost] = JobAttempt.objects.filter(job=job)
    assert (lost.number, lost.provider_job_name, lost.outcome, lost.checkpoint_uri) == (
        1, first, JobAttempt.Outcome.LOST, checkpoints)
    assert lost.reason.startswith(f"pod {victim} (node 1) disrupted: EvictionByEvictionAPI (Eviction API: evicting)")
    messages = [e.message for e in selectors.training_job_events(job=job)]
    assert any(m.startswith(f"run lost (pod {victim}") and m.endswith("resubmitting, attempt 2 of 3") for m in messages)

    # The second TrainJob was given the lost one's checkpoint directory, and its trainer resumed there.
    [posted] = [r.body for r in cluster.requests_for("POST", "/namespaces/default/trainjobs")
                if r.body["metadata"]["name"] == f"{first}-a2" and r.status == 201]
    sent = json.loads(next(e["value"] for e in posted["spec"]["trainer"]["env"] if e["name"] == "TRAINBOARD_JOB_CONFIG"))
    assert sent["output"]["checkpoint_dir"] == checkpoints
    ran = [json.loads(line) for line in (output / f"{first}-a2" / "metrics.jsonl").read_text().splitlines()]
    started = next(r for r in ran if r.get("event") == "started")
    assert (started["resumed"], started["epoch"], started["step"]) == (True, 1, held_at + 1), started
    val = list(MetricPoint.objects.filter(job=job, name="val_accuracy", rank__isnull=True)
               .order_by("step").values_list("epoch", flat=True))
    assert val == list(range(EPOCHS))  # each epoch once, across the two attempts
