"""End to end: a Ray Train script (``framework="ray"``, tests/ray_scripts.py) on the GPU box through
the services and the real Celery worker (tests/sharedworker.py), to SUCCEEDED with its metric charted.

The box's interpreter is the Ray test venv's (tests/framework_venvs.py: the operator's choice of
Python), so the box runs torch's own torchrun with 2 ranks: local rank 0 starts the Ray head and runs
the script as its driver, with ``TRAINBOARD_RAY_NUM_WORKERS`` = 2; local rank 1 exits 0
(trainer_pkg/frameworks/ray.py). No process of the run is left when the job has ended. About 55 s on
a loaded 2-core machine, the shared worker's start aside.
"""

from __future__ import annotations

import time

import pytest

from codekit import upload, zip_bytes
from framework_venvs import RAY, framework_venv_fixture
from jobs import services
from jobs.models import JobLogLine, JobStateChoices as S, MetricPoint, TrainingJob
from ray_scripts import RAY_TRAIN_SCRIPT

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.xdist_group("ray")]  # with tests/trainer_pkg/test_framework_ray.py: one Ray at a time

ray_python = framework_venv_fixture("ray", RAY)


def test_a_ray_train_script_on_the_gpu_box_succeeds(celery_worker_process, shared_celery_worker, settings, user,
                                                    local_backend, run_root, live_processes, ray_python, capsys):
    started = time.monotonic()
    settings.TRAINBOARD_CODE_STORE = shared_celery_worker.code_store  # where the worker reads archives
    services.backend_update(backend=local_backend, config={**local_backend.config, "python": str(ray_python)})
    model = services.model_spec_create(owner=user, name="ray-train", kind="script", framework="ray",
                                       code=upload(zip_bytes({"train.py": RAY_TRAIN_SCRIPT.encode()}), "ray.zip"),
                                       entry_point="train.py")
    job = services.training_job_create(owner=user, dataset=None, model_spec=model, backend=local_backend,
                                       nodes=1, procs_per_node=2, epochs=1)
    job = celery_worker_process.wait_for(lambda: (j := TrainingJob.objects.get(pk=job.pk)).is_terminal and j,
                                         timeout=420, what="the Ray job to end")
    log = list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("text", flat=True))
    assert job.state == S.SUCCEEDED, (job.failure_reason, log[-60:], celery_worker_process.log()[-3000:])
    assert job.config["code"]["framework"] == "ray"

    # Rank 0's report.log from inside a Ray Train worker, charted: gloo's sum over both workers.
    points = list(MetricPoint.objects.filter(job=job, name="rank_sum", rank__isnull=True)
                  .values_list("step", "value"))
    assert points == [(1, 3.0)]
    text = "\n".join(log)
    assert "[ray] local rank 1 of node_rank 0: Ray starts its own workers from local rank 0's node" in text
    assert "TRAINBOARD_RAY_NUM_WORKERS=2" in text
    workers = sorted(line.split(" worker ", 1)[1][:6] for line in log if "(RayTrainWorker pid=" in line
                     and " worker " in line)
    assert workers == ["0 of 2", "1 of 2"], text[-4000:]  # the workers' output is in the job's log
    assert "fit ended, error None" in text
    assert "[ray node 0] stopped" in text
    assert live_processes(str(run_root / job.provider_job_name)) == []
    with capsys.disabled():
        print(f"\n[e2e ray] GPU box Ray job: {time.monotonic() - started:.1f} s "
              f"(created → ended {(job.ended_at - job.created_at).total_seconds():.0f} s)")
