"""End to end: a user's TensorFlow script (``framework: tensorflow``, issue 33) through the services, a
real Celery worker (+ beat, Redis, PostgreSQL) and real TensorFlow workers, to SUCCEEDED:

- on the GPU box: 1 node × 2 processes, i.e. torchrun's 2 ranks, each a launcher that starts one TF
  worker; the ranks trade their workers' ports through torchrun's own store;
- on the real Slurm cluster (tests/slurmkit.py): 2 nodes × 1 process, one launcher per node under
  srun, node 0's launcher serving the store at the job's rendezvous.

- on the GPU box, a worker whose TF server never starts (and that ignores SIGTERM): the job FAILS at
  the cluster deadline (``TRAINBOARD_TF_CLUSTER_DEADLINE_S`` 30 s, the box's operator's setting) with
  that reason, no process left.

The first two train :data:`TF_SCRIPT` (tests/trainer_pkg/test_tensorflow_framework.py: MultiWorkerMirroredStrategy,
a custom loop) to identical weights on both workers, reported with ``report.log`` and charted. The
box's and the nodes' interpreter is the TensorFlow test venv's python (tests/framework_venvs.py), set
as the installation would: the box's ``python`` host setting, ``TRAINBOARD_SLURM_PYTHON``. One worker
serves the module (the box's queue and ``slurm.hpc``). Run::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/trainboard REDIS_URL=redis://127.0.0.1:6379/15 \\
        .venv/bin/python -m pytest tests/e2e/test_tensorflow_jobs.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import re
import time
from decimal import Decimal
from pathlib import Path

import pytest

from cloud_adapters.gpubox.backend import GpuBoxBackend
from codekit import upload, zip_bytes
from framework_venvs import TENSORFLOW, framework_venv
from jobs import services
from jobs.models import JobLogLine, JobStateChoices as S, MetricPoint, TrainingJob
from jobs.services.prices import instance_price_save
from slurmkit import SLURM_GROUP
from tensorflow_scripts import TF_SCRIPT

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True), SLURM_GROUP]

BOX_NAME = "tfbox"
JOB_TIMEOUT_S = 300  # TensorFlow's import is most of a job: 20-60 s per worker on a loaded 2-core machine
STEPS = 20
SHORT_WATCHDOG = {"TRAINBOARD_TF_CLUSTER_DEADLINE_S": "30", "TRAINBOARD_TF_GRACE_S": "2"}


@pytest.fixture(scope="module")
def tf_python() -> str:
    return str(framework_venv("tensorflow", TENSORFLOW))


@pytest.fixture(scope="module")
def cluster(slurm_cluster_module):
    """The suite's shared Slurm cluster, clean, with this module's own work directory (tests/conftest.py)."""
    return slurm_cluster_module


def installation(cluster, tf_python: str, code_store: Path) -> dict[str, str]:
    return {"TRAINBOARD_SLURM_WORK_DIR": str(cluster.work_dir), "TRAINBOARD_SLURM_CONF": str(cluster.conf),
            "TRAINBOARD_SLURM_PYTHON": tf_python, "TRAINBOARD_CODE_STORE": str(code_store)}


@pytest.fixture(scope="module")
def worker(cluster, tf_python, django_db_blocker, celery_worker_factory, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tf-worker")
    # The watchdog's settings, as an operator sets them: in the worker's environment, passed to the
    # jobs of a box whose env_passthrough names them (the watchdog test's box; a job may not set
    # TRAINBOARD_* itself, and Slurm jobs never see the worker's environment).
    extra = {**installation(cluster, tf_python, directory / "code-store"), **SHORT_WATCHDOG}
    with django_db_blocker.unblock():
        with celery_worker_factory(directory, directory / "runs", extra_env=extra,
                                   queues=f"celery,slurm.hpc,{GpuBoxBackend.queue_for(BOX_NAME, {})}") as running:
            yield running


@pytest.fixture
def settings_like_worker(worker, cluster, tf_python, settings):
    for name, value in installation(cluster, tf_python, Path(worker.full_env["TRAINBOARD_CODE_STORE"])).items():
        setattr(settings, name, value)
    settings.TRAINBOARD_RUN_ROOT = worker.run_root
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2
    return settings


@pytest.fixture
def tf_model(user, settings_like_worker):
    return services.model_spec_create(owner=user, name="tf-mwms", kind="script", framework="tensorflow",
                                      code=upload(zip_bytes({"train.py": TF_SCRIPT.encode()}), "tf.zip"),
                                      entry_point="train.py", script_args=["--steps", str(STEPS)])


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _ended(worker, job: TrainingJob) -> TrainingJob:
    return worker.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=JOB_TIMEOUT_S, what="the job to end")


def _explain(worker, job: TrainingJob) -> str:
    lines = JobLogLine.objects.filter(job=job).order_by("seq").values_list("text", flat=True)
    return f"{job.state}: {job.failure_reason}\n" + "\n".join(list(lines)[-40:]) + "\n" + worker.log()[-2000:]


def assert_identical_weights(job: TrainingJob, output_dir: Path) -> list[float]:
    """Both workers' final weights are one, and report.log charted worker 0's."""
    w0, w1 = (json.loads((output_dir / f"weights-{r}.json").read_text()) for r in (0, 1))
    assert w0["weights"] == w1["weights"] and w0["world_size"] == w1["world_size"] == 2
    assert [w0["tf_config"]["task"]["index"], w1["tf_config"]["task"]["index"]] == [0, 1]
    charted = [MetricPoint.objects.filter(job=job, name=f"w{i}", rank__isnull=True).values_list("step", "value").get()
               for i in range(4)]
    assert charted == [(STEPS, pytest.approx(v)) for v in w0["weights"]]
    assert all(abs(a - b) < 0.2 for a, b in zip(w0["weights"], [1.0, -2.0, 0.5, 3.0])), w0
    return w0["weights"]


def test_a_tensorflow_script_on_the_gpu_box_succeeds_with_identical_weights(worker, user, digits_dataset, tf_model,
                                                                           tf_python, capsys):
    t0 = time.monotonic()
    box = services.backend_create(owner=user, name=BOX_NAME, kind="gpubox",
                                  config={"hourly_rate_usd": 3.6, "grace_period_s": 3.0, "python": tf_python})
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=tf_model, backend=box,
                                       procs_per_node=2, epochs=1)
    job = _ended(worker, job)
    assert job.state == S.SUCCEEDED, _explain(worker, job)
    assert job.config["code"]["framework"] == "tensorflow"
    weights = assert_identical_weights(job, worker.run_root / job.provider_job_name / "output")
    with capsys.disabled():
        print(f"\n[e2e tensorflow] GPU box, 2 workers: SUCCEEDED in {time.monotonic() - t0:.1f} s, weights {weights}")


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_that_never_starts_fails_the_job_at_the_deadline_with_no_process_left(
        worker, user, digits_dataset, tf_model, tf_python, capsys):
    t0 = time.monotonic()
    box = services.backend_create(owner=user, name=BOX_NAME, kind="gpubox",
                                  config={"hourly_rate_usd": 3.6, "grace_period_s": 3.0, "python": tf_python,
                                          "env_passthrough": ",".join(SHORT_WATCHDOG)})
    model = services.model_spec_create(owner=user, name="tf-never", kind="script", framework="tensorflow",
                                       code=upload(zip_bytes({"train.py": TF_SCRIPT.encode()}), "tf.zip"),
                                       entry_point="train.py", script_args=["--never-start-rank", "1"])
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=model, backend=box,
                                       procs_per_node=2, epochs=1)
    job = _ended(worker, job)
    assert job.state == S.FAILED, _explain(worker, job)
    assert "the TensorFlow cluster did not form within 30 s (TRAINBOARD_TF_CLUSTER_DEADLINE_S): worker(s) " \
        in job.failure_reason, _explain(worker, job)
    log = "\n".join(JobLogLine.objects.filter(job=job).values_list("text", flat=True))
    pids = [int(p) for m in re.finditer(r"TensorFlow worker\(s\) of rank \d+ started: pid (\d+)", log) for p in m.groups()]
    assert len(pids) == 2, log[-3000:]
    assert not any(map(alive, pids))  # the worker that ignored SIGTERM too: SIGKILL after the grace
    took = (job.ended_at - job.started_at).total_seconds() if job.started_at else time.monotonic() - t0
    with capsys.disabled():
        print(f"\n[e2e tensorflow] GPU box, a worker never started: FAILED after {took:.1f} s of running "
              f"({time.monotonic() - t0:.1f} s in all): {job.failure_reason}")


def test_a_tensorflow_script_on_two_slurm_nodes_succeeds_with_identical_weights(worker, cluster, user,
                                                                               digits_dataset, tf_model, capsys):
    t0 = time.monotonic()
    instance_price_save(provider="slurm", region=cluster.cluster_name, instance_type=cluster.partition,
                        usd_per_hour=Decimal("3.6"))
    hpc = services.backend_create(owner=user, name="hpc", kind="slurm",
                                  config={"partition": cluster.partition, "cluster": cluster.cluster_name})
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=tf_model, backend=hpc,
                                       nodes=2, procs_per_node=1, epochs=1)
    job = _ended(worker, job)
    assert job.state == S.SUCCEEDED, _explain(worker, job)
    weights = assert_identical_weights(job, cluster.work_dir / job.provider_job_name / "output")
    log = "\n".join(JobLogLine.objects.filter(job=job).values_list("text", flat=True))
    assert "[launch] TensorFlow: 2 worker(s), TF_CONFIG cluster.worker" in log
    with capsys.disabled():
        print(f"\n[e2e tensorflow] Slurm, 2 nodes × 1 worker: SUCCEEDED in {time.monotonic() - t0:.1f} s, "
              f"weights {weights}")
