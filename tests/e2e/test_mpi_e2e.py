"""End to end: an MPI script (``code.framework`` ``mpi``) on the GPU box through the services, a real
Celery worker (+ beat, Redis, PostgreSQL) and Debian's Open MPI: the box's ``python`` host setting
(``TRAINBOARD_GPUBOX_PYTHON``) is the MPI test venv's (mpi4py, tests/framework_venvs.py).

A 2-rank mpi4py allreduce of the rank numbers reaches SUCCEEDED, rank 0's ``report.log`` of the sum
(1) charted on the job; a cancelled one ends CANCELLED with no rank and no mpirun left (by PID).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cloud_adapters.gpubox.backend import GpuBoxBackend
from codekit import upload, zip_bytes
from framework_venvs import MPI, framework_venv
from jobs import services
from jobs.models import JobLogLine, JobStateChoices as S, MetricPoint, TrainingJob

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BOX_NAME = "mpibox"
SCRIPT = b'''\
import json, os, sys, time
from mpi4py import MPI
from trainer_pkg import report

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
total = comm.allreduce(rank, op=MPI.SUM)
with open(f"rank{rank}.json.tmp", "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid()}, f)
os.replace(f"rank{rank}.json.tmp", f"rank{rank}.json")
report.log(step=1, rank_sum=total)
if "--wait" in sys.argv:
    time.sleep(600)  # the workload the cancel stops
'''


@pytest.fixture(scope="module")
def box(tmp_path_factory, django_db_setup, django_db_blocker, celery_worker_factory):
    python = framework_venv("mpi", MPI)
    root = tmp_path_factory.mktemp("mpi-box")
    run_root = root / "runs"
    run_root.mkdir()
    extra = {"TRAINBOARD_CODE_STORE": str(root / "code-store"), "TRAINBOARD_GPUBOX_PYTHON": str(python),
             "TRAINBOARD_GPUBOX_SLOTS": "4"}
    with django_db_blocker.unblock():
        running = celery_worker_factory(root, run_root, extra,
                                        queues=f"celery,{GpuBoxBackend.queue_for(BOX_NAME, {})}")
        worker = running.__enter__()
    try:
        yield worker, run_root, root / "code-store", python
    finally:
        with django_db_blocker.unblock():
            running.__exit__(None, None, None)


@pytest.fixture
def mpi_backend(box, user, settings):
    _, run_root, code_store, python = box
    settings.TRAINBOARD_RUN_ROOT = run_root
    settings.TRAINBOARD_CODE_STORE = code_store
    settings.TRAINBOARD_GPUBOX_PYTHON = str(python)
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2
    settings.TRAINBOARD_GPUBOX_SLOTS = 4
    return services.backend_create(owner=user, name=BOX_NAME, kind="gpubox", config={"grace_period_s": 3.0})


def _job(user, digits_dataset, backend, args: list[str]) -> TrainingJob:
    model = services.model_spec_create(owner=user, name=f"mpi-{len(args)}", kind="script", framework="mpi",
                                       code=upload(zip_bytes({"train.py": SCRIPT}), "mpi.zip"),
                                       entry_point="train.py", script_args=args)
    return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=model, backend=backend,
                                        procs_per_node=2, epochs=1)


def _until(worker, job: TrainingJob, done, what: str, timeout: float = 180) -> TrainingJob:
    return worker.wait_for(lambda: done(j := TrainingJob.objects.get(pk=job.pk)) and j, timeout=timeout, what=what)


def _log(job: TrainingJob) -> list[str]:
    return list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("text", flat=True))


def _ranks(run_dir: Path) -> dict[int, dict]:
    return {int(p.name[4:-5]): json.loads(p.read_text()) for p in (run_dir / "code").glob("rank*.json")}


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_an_mpi_script_job_succeeds_and_its_cancel_leaves_no_rank(box, mpi_backend, user, digits_dataset, capsys):
    worker, run_root, _, _ = box
    t0 = time.monotonic()
    job = _job(user, digits_dataset, mpi_backend, [])
    assert job.config["code"]["framework"] == "mpi"
    job = _until(worker, job, lambda j: j.is_terminal, f"job {job.pk} to end")
    log = _log(job)
    assert job.state == S.SUCCEEDED, f"{job.failure_reason}\n" + "\n".join(log[-40:]) + worker.log()[-2000:]
    points = list(MetricPoint.objects.filter(job=job, name="rank_sum", rank__isnull=True).values_list("step", "value"))
    assert points == [(1, 1.0)]
    assert "[launch] mpi: starting 2 rank(s) with /usr/bin/mpirun (on this machine)" in log
    succeeded_s = time.monotonic() - t0

    job = _job(user, digits_dataset, mpi_backend, ["--wait"])
    job = _until(worker, job, lambda j: j.provider_job_name and len(_ranks(run_root / j.provider_job_name)) == 2,
                 f"job {job.pk}'s 2 ranks to start")
    seen = _ranks(run_root / job.provider_job_name)
    pids = [seen[0]["pid"], seen[1]["pid"], seen[0]["ppid"]]  # the ranks and their mpirun
    assert all(_running(p) for p in pids)
    services.training_job_cancel(job=job)
    job = _until(worker, job, lambda j: j.is_terminal, f"job {job.pk} to end after its cancel", timeout=60)
    assert job.state == S.CANCELLED, job.failure_reason
    assert [p for p in pids if _running(p)] == []
    with capsys.disabled():
        print(f"\n[e2e mpi] succeeded job {succeeded_s:.1f} s; both jobs {time.monotonic() - t0:.1f} s")
