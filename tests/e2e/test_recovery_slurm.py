"""End to end on a real Slurm (tests/slurmkit.py): a job whose node goes down while it runs is
resubmitted by Trainboard from its checkpoint (docs/recovery.md).

What this Slurm (22.05, the cluster's default JobRequeue=1) does with a batch job whose node is set
down (``scontrol update nodename=… state=down``): it kills the job for NODE_FAIL and requeues it
itself (PENDING, reason BeginTime, Restarts=1) — a restart the provider makes, which the dashboard
shows as an interruption and leaves alone. A job submitted with ``--no-requeue`` (the backend's extra
sbatch options) ends NODE_FAIL instead: a lost run, which Trainboard resubmits as attempt 2 under
a new job name on the node left, resuming from the checkpoint on the shared filesystem.
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from jobs import selectors, services
from jobs.models import JobAttempt, JobStateChoices as S, MetricPoint, TrainingJob
from jobs.services.artifacts import training_job_artifact_list
from jobs.services.prices import instance_price_save
import slurmkit
from slurmkit import SLURM_GROUP

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True), SLURM_GROUP]

RATE = Decimal("3.6")  # USD per node-hour of partition debug


@pytest.fixture(scope="module")
def cluster(slurm_cluster_module):
    """The suite's shared Slurm cluster, clean, with this module's own work directory (tests/conftest.py)."""
    return slurm_cluster_module


def installation(cluster) -> dict[str, str]:
    return {"TRAINBOARD_SLURM_WORK_DIR": str(cluster.work_dir), "TRAINBOARD_SLURM_CONF": str(cluster.conf),
            "TRAINBOARD_SLURM_PYTHON": slurmkit.nodes_python()}


@pytest.fixture(scope="module")
def worker(cluster, django_db_blocker, celery_worker_factory, tmp_path_factory):
    directory = tmp_path_factory.mktemp("slurm-recovery-worker")
    with django_db_blocker.unblock():
        with celery_worker_factory(directory, directory / "runs", extra_env=installation(cluster),
                                   queues="celery,slurm.hpc") as running:
            yield running


@pytest.fixture
def hpc(cluster, settings, user):
    for name, value in installation(cluster).items():
        setattr(settings, name, value)
    instance_price_save(provider="slurm", region=cluster.cluster_name, instance_type=cluster.partition,
                        usd_per_hour=RATE)
    return services.backend_create(owner=user, name="hpc", kind="slurm",
                                   config={"partition": cluster.partition, "cluster": cluster.cluster_name,
                                           "extra_sbatch_options": "--no-requeue"})


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _node_of(cluster, job_name: str) -> str:
    out = cluster.run("squeue", "-h", f"--name={job_name}", "-o", "%N").stdout.strip()
    return out if out in ("n1", "n2") else ""


def test_a_job_whose_node_fails_is_resubmitted_and_resumes_from_its_checkpoint(worker, cluster, hpc, user,
                                                                               digits_dataset, cnn_model):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=hpc,
                                       nodes=1, procs_per_node=2, epochs=3, batch_size=2)
    first_name = job.provider_job_name
    checkpoint = cluster.work_dir / first_name / "output" / "checkpoints" / "last.pt"
    worker.wait_for(lambda: checkpoint.exists(), timeout=300, what=f"the epoch-1 checkpoint {checkpoint}")
    node = _node_of(cluster, first_name)
    assert node, cluster.run("squeue", "-h", "-o", "%i|%j|%T|%N").stdout
    try:
        done = cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=test")
        assert done.returncode == 0, done.stderr
        job = worker.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=400, what="the job to end")
    finally:
        cluster.run("scontrol", "update", f"nodename={node}", "state=resume")
    assert job.state == S.SUCCEEDED, (job.failure_reason, worker.log()[-3000:])

    assert job.attempt == 2 and job.provider_job_name == f"{first_name}-a2"
    (lost,) = JobAttempt.objects.filter(job=job)
    assert (lost.number, lost.raw_state, lost.outcome) == (1, "NODE_FAIL", "lost")
    assert lost.reason == "a node of the job failed (NODE_FAIL); Slurm ended the job"
    assert lost.checkpoint_uri == f"{cluster.work_dir}/{first_name}/output/checkpoints"
    # The second attempt wrote its checkpoints where it resumed: the job's artifacts list them from there.
    listing = training_job_artifact_list(job=job)
    assert listing.error == ""
    names = {a.name for a in listing.artifacts}
    assert {"model.pt", "metrics.jsonl", "checkpoints/last.pt"} <= names, names
    events = [(a, b, m) for a, b, m in selectors.training_job_events(job=job).values_list("from_state", "to_state",
                                                                                        "message")]
    assert [m for a, b, m in events if (a, b) == ("RUNNING", "QUEUED")] == [
        "run lost (a node of the job failed (NODE_FAIL); Slurm ended the job); resubmitting, attempt 2 of 3"]

    epochs = list(MetricPoint.objects.filter(job=job, name="val_accuracy", rank__isnull=True)
                  .order_by("step").values_list("epoch", "step"))
    assert [e for e, _ in epochs] == [0, 1, 2], epochs
    per_epoch = epochs[0][1]
    assert [s for _, s in epochs] == [per_epoch, 2 * per_epoch, 3 * per_epoch]
    steps = list(MetricPoint.objects.filter(job=job, name="train_loss", rank__isnull=True)
                 .order_by("id").values_list("step", flat=True))
    assert steps == sorted(set(steps))

    # Cost: the lost attempt's (its own interval) + the second's, at $3.60 per node-hour.
    second_s = (job.ended_at - job.started_at).total_seconds()
    second_usd = Decimal(str(round(float(RATE) * second_s / 3600, 4)))
    assert abs(job.cost_usd - (lost.cost_usd + second_usd)) <= Decimal("0.0002")
    assert job.billable_seconds == pytest.approx(lost.billable_seconds + second_s, rel=0.02, abs=2)
