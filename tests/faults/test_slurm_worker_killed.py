"""A worker SIGKILLed while its ``sbatch`` had already created the Slurm job but before the job's row
recorded it: the next worker's recovery sweep resumes the submission and adopts that job by its name
(``squeue --name``), so the cluster runs exactly one job. Real Celery workers consuming
``slurm.hpc``, a real two-node Slurm (tests/slurmkit.py), Redis and PostgreSQL.

The first worker's ``sbatch`` is the real one followed by a long sleep (a wrapper first on its
PATH): the job exists on the cluster while the worker still waits for sbatch's answer, which is
the moment the kill lands. The job is the trainer stand-in (tests/standins/trainer.py, the nodes'
interpreter), held at its first step until the second worker has adopted it, then let run to its end.
"""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from faultkit import FAST_RECOVERY_ENV
from jobs import services
from jobs.models import JobStateChoices as S, TrainingJob
from polling import wait_for
from slurmkit import SLURM_GROUP

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True), SLURM_GROUP]

SLOW_SBATCH = """#!/bin/sh
# The real sbatch, then no answer: the worker waiting for it is killed meanwhile.
/usr/bin/sbatch "$@"
echo $$ > {pid_file}
exec sleep 600
"""


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


@pytest.fixture(scope="module")
def cluster(slurm_cluster_module):
    """The suite's shared Slurm cluster, clean, with this module's own work directory (tests/conftest.py):
    only a Celery worker is killed here, no Slurm daemon."""
    return slurm_cluster_module


def test_submit_retried_after_a_worker_kill_adopts_the_first_job(tmp_path, settings, user, digits_dataset,
                                                                 cnn_model, celery_worker_factory, cluster,
                                                                 trainer_standin):
    installation = {"TRAINBOARD_SLURM_WORK_DIR": str(cluster.work_dir),
                    "TRAINBOARD_SLURM_CONF": str(cluster.conf), "TRAINBOARD_SLURM_PYTHON": trainer_standin.python}
    trainer_standin.hold(steps=1)  # the job runs until the second worker has adopted it
    for name, value in installation.items():
        setattr(settings, name, value)
    backend = services.backend_create(owner=user, name="hpc", kind="slurm",
                                      config={"partition": cluster.partition})
    bin_dir = tmp_path / "slow-bin"
    bin_dir.mkdir()
    pid_file = tmp_path / "sbatch.pid"
    (bin_dir / "sbatch").write_text(SLOW_SBATCH.format(pid_file=pid_file))
    (bin_dir / "sbatch").chmod(0o755)
    env = {**installation, **FAST_RECOVERY_ENV}
    try:
        first_dir = tmp_path / "first"
        first_dir.mkdir()
        with celery_worker_factory(first_dir, tmp_path / "runs", queues="celery,slurm.hpc",
                                   extra_env={**env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}) as first:
            job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                               backend=backend, nodes=2, procs_per_node=2, epochs=1)
            name = job.provider_job_name
            wait_for(lambda: pid_file.exists() and name in cluster.job_names(), timeout=90,
                     what=f"sbatch to create {name}:\n{first.log()[-2000:]}")
            assert _reload(job).state == S.SUBMITTING and _reload(job).provider_handle is None
            first.kill()
        first_id = cluster.run("squeue", "-h", f"--name={name}", "-o", "%i").stdout.split()
        assert len(first_id) == 1

        second_dir = tmp_path / "second"
        second_dir.mkdir()
        with celery_worker_factory(second_dir, tmp_path / "runs", queues="celery,slurm.hpc", extra_env=env) as second:
            adopted = second.wait_for(lambda: (j := _reload(job)).provider_handle and j, timeout=120,
                                      what=f"the second worker to adopt {name}")
            assert adopted.provider_handle["provider_job_id"] == first_id[0]  # adopted, not submitted again
            trainer_standin.wait_at(1, cluster.work_dir / name, timeout=120)
            trainer_standin.release()  # now it may end
            job = second.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=240,
                                  what="the resumed job to end")
            assert job.state == S.SUCCEEDED, (job.failure_reason, second.log()[-3000:])
        assert job.provider_handle["provider_job_id"] == first_id[0]
        jobs = cluster.run("scontrol", "-o", "show", "job").stdout.splitlines()
        assert len([ln for ln in jobs if f"JobName={name} " in ln]) == 1
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
