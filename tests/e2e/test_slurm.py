"""End to end on a real Slurm: the real Celery worker (embedded beat, Redis, PostgreSQL) consumes
``slurm.hpc`` as a worker on the login node would and drives jobs on the two-node test cluster
(tests/slurmkit.py) from QUEUED to their end: a 2-node × 2-process digits DDP job to SUCCEEDED with
metrics and its cost at the partition's internal rate, a cancel to CANCELLED, a job past its --time
to FAILED "time limit". The backend's row names no host setting: work_dir, slurm.conf and the
nodes' interpreter come from the installation's settings (TRAINBOARD_SLURM_*), as in production.

The nodes' interpreter is the trainer stand-in's wrapper (tests/standins/trainer.py), one for the
module as the worker reads it once: passing through to the real interpreter for the job to
SUCCEEDED (the real torchrun and trainer under srun), the stand-in held at its first step for the
cancel and the time limit, which only need a job that runs until Slurm stops it.
"""

from __future__ import annotations

import zipfile
from decimal import Decimal

import pytest

from jobs import selectors, services
from jobs.models import JobStateChoices as S, MetricPoint, TrainingJob
from jobs.services.prices import instance_price_save
import slurmkit
from slurmkit import SLURM_GROUP
from standins.trainer import TrainerStandin

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True), SLURM_GROUP]

RATE = Decimal("3.6")  # USD per node-hour of partition debug on cluster tbtest


@pytest.fixture(scope="module")
def cluster(slurm_cluster_module):
    """The suite's shared Slurm cluster, clean, with this module's own work directory (tests/conftest.py)."""
    return slurm_cluster_module


@pytest.fixture(scope="module")
def nodes_python(tmp_path_factory) -> TrainerStandin:
    """The nodes' interpreter: the trainer stand-in's wrapper, passing through to the real one
    unless a test holds it (:func:`held`)."""
    standin = TrainerStandin.create(tmp_path_factory.mktemp("slurm-python"))
    standin.pass_through()
    return standin


@pytest.fixture
def held(nodes_python):
    """The stand-in for this test's jobs, each held at its first step (RUNNING until Slurm stops it)."""
    nodes_python.pass_through(False)
    nodes_python.hold(steps=1)
    yield nodes_python
    nodes_python.release()
    nodes_python.pass_through()


def installation(cluster, python: TrainerStandin) -> dict[str, str]:
    return {"TRAINBOARD_SLURM_WORK_DIR": str(cluster.work_dir), "TRAINBOARD_SLURM_CONF": str(cluster.conf),
            "TRAINBOARD_SLURM_PYTHON": python.python}


@pytest.fixture(scope="module")
def worker(cluster, nodes_python, django_db_blocker, celery_worker_factory, tmp_path_factory):
    directory = tmp_path_factory.mktemp("slurm-worker")
    with django_db_blocker.unblock():
        with celery_worker_factory(directory, directory / "runs", extra_env=installation(cluster, nodes_python),
                                   queues="celery,slurm.hpc") as running:
            yield running


@pytest.fixture
def hpc(cluster, nodes_python, settings, user):
    for name, value in installation(cluster, nodes_python).items():
        setattr(settings, name, value)
    instance_price_save(provider="slurm", region=cluster.cluster_name, instance_type=cluster.partition,
                        usd_per_hour=RATE)
    return services.backend_create(owner=user, name="hpc", kind="slurm",
                                   config={"partition": cluster.partition, "cluster": cluster.cluster_name})


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _ended(worker, job, timeout=300):
    return worker.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=timeout, what="the job to end")


def test_two_nodes_two_processes_succeed_with_metrics_and_cost(worker, cluster, hpc, user, digits_dataset,
                                                              cnn_model):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=hpc,
                                       nodes=2, procs_per_node=2, epochs=2)
    job = _ended(worker, job)
    assert job.state == S.SUCCEEDED, (job.failure_reason, worker.log()[-3000:])
    assert job.provider_handle["provider"] == "slurm" and job.provider_handle["provider_job_id"].isdigit()
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
    assert cluster.job_names().count(job.provider_job_name) <= 1
    # the real trainer ran (torch.save writes a zip archive; the stand-in writes JSON)
    assert zipfile.is_zipfile(cluster.work_dir / job.provider_job_name / "output" / "model.pt")


def test_cancel_gives_cancelled(worker, cluster, hpc, held, user, digits_dataset, cnn_model):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=hpc,
                                       nodes=2, procs_per_node=2, epochs=1)
    run_dir = cluster.work_dir / _reload(job).provider_job_name
    ranks = held.wait_at(1, run_dir, timeout=180)  # both nodes' ranks took their first step and wait
    assert ranks["world_size"] == 4
    worker.wait_for(lambda: _reload(job).state == S.RUNNING, timeout=60, what="the job to be RUNNING")
    services.training_job_cancel(job=_reload(job))
    job = _ended(worker, job, timeout=90)
    assert job.state == S.CANCELLED, (job.failure_reason, worker.log()[-3000:])
    assert [e.to_state for e in selectors.training_job_events(job=job)][-2:] == ["STOPPING", "CANCELLED"]
    assert job.provider_job_name not in cluster.job_names()
    worker.wait_for(lambda: not any(slurmkit.running(pid) for pid in ranks["pids"]), timeout=30,
                    what="every rank of both nodes to be gone")


def test_a_job_past_its_time_limit_fails_with_time_limit(worker, cluster, hpc, held, user, digits_dataset, cnn_model):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=hpc,
                                       nodes=1, procs_per_node=2, epochs=1, max_runtime_s=60)
    held.wait_at(1, cluster.work_dir / _reload(job).provider_job_name, timeout=180)  # it cannot end by itself
    job = _ended(worker, job, timeout=240)
    assert job.state == S.FAILED, (job.failure_reason, worker.log()[-3000:])
    assert job.failure_reason == "time limit (--time 00:01:00) reached: Slurm stopped the job"
    assert job.started_at is not None and (job.ended_at - job.started_at).total_seconds() >= 60
