"""End to end: a real Celery worker with embedded beat (Redis broker, PostgreSQL test database)
drives real gpubox jobs (torchrun, gloo, 2 processes) from QUEUED to a terminal state; the cancel
test's job is the trainer stand-in's (tests/standins/trainer.py), held at its first step.

Run: DATABASE_URL=postgres://postgres@127.0.0.1:5432/trainboard REDIS_URL=redis://127.0.0.1:6379/15 \\
     .venv/bin/python -m pytest tests/e2e -q
"""

from __future__ import annotations

import numpy as np
import pytest
from django.db import transaction

from jobs import selectors, services
from jobs.models import MetricPoint, JobStateChoices as S, TrainingJob

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def test_ddp_job_succeeds_with_events_metrics_and_cost(celery_worker_process, user, digits_dataset, cnn_model,
                                                        local_backend, record_property, capsys):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=2, epochs=3)
    job = celery_worker_process.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=300,
                                         what="the job to end")
    assert job.state == S.SUCCEEDED, (job.failure_reason, celery_worker_process.log()[-3000:])

    events = list(selectors.training_job_events(job=job).values_list("from_state", "to_state"))
    assert events == [("", "QUEUED"), ("QUEUED", "SUBMITTING"), ("SUBMITTING", "PENDING"),
                      ("PENDING", "RUNNING"), ("RUNNING", "SUCCEEDED")]

    val = list(MetricPoint.objects.filter(job=job, name="val_accuracy", rank__isnull=True)
               .order_by("step").values_list("epoch", "value"))
    assert [epoch for epoch, _ in val] == [0, 1, 2]
    assert val[-1][1] >= 0.90, val
    assert MetricPoint.objects.filter(job=job, name="rank_samples_per_s", rank=1).exists()
    assert len(selectors.training_job_rank_throughput(job=job)) == 2
    # Its length, as the trainer reported it (3 epochs × 23 steps of 2 ranks × 32 of 1,438 samples),
    # kept by the sync beside the last step: 100 % done, no time left once ended.
    assert (job.progress_total_steps, job.progress_step) == (69, 69)
    assert job.progress.fraction == 1.0 and job.progress.eta_s is None and job.progress_steps_per_s > 0

    # cost = $3.60/h × (ended_at − started_at); the row stores 4 decimal places, hence abs=0.00005
    run_s = (job.ended_at - job.started_at).total_seconds()
    assert run_s > 0
    assert float(job.cost_usd) == pytest.approx(3.6 * run_s / 3600, rel=0.01, abs=0.00005)
    assert job.billable_seconds == pytest.approx(run_s, rel=0.01)

    to_first_step = (job.first_step_at - job.created_at).total_seconds()
    to_end = (job.ended_at - job.created_at).total_seconds()
    record_property("launch_to_first_step_s", round(to_first_step, 2))
    record_property("launch_to_succeeded_s", round(to_end, 2))
    with capsys.disabled():
        print(f"\n[e2e] launch → first step {to_first_step:.1f} s, launch → SUCCEEDED {to_end:.1f} s, "
              f"val_accuracy {val[-1][1]:.4f}, cost ${job.cost_usd}")


def test_cancel_running_job_stops_every_process(celery_worker_process, user, digits_dataset, cnn_model,
                                                local_backend, run_root, live_processes, wait_until, trainer_standin):
    # The trainer stand-in (a staff owner's backend may name the interpreter), held at its first step:
    # RUNNING until cancelled, however slow the machine.
    services.backend_update(backend=local_backend, config={**local_backend.config, "python": trainer_standin.python})
    trainer_standin.hold(steps=1)
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=2, epochs=1)
    celery_worker_process.wait_for(lambda: _reload(job).state == S.RUNNING, timeout=60,
                                   what="the job to be RUNNING")
    run_dir = str(run_root / _reload(job).provider_job_name)
    assert live_processes(run_dir), "the job's processes should be running"

    services.training_job_cancel(job=_reload(job))
    assert _reload(job).state == S.STOPPING
    job = celery_worker_process.wait_for(lambda: (j := _reload(job)).state == S.CANCELLED and j, timeout=10,
                                         what="CANCELLED within 10 s")
    assert job.failure_reason == "Cancelled by user"
    assert [e.to_state for e in selectors.training_job_events(job=job)][-2:] == ["STOPPING", "CANCELLED"]
    wait_until(lambda: not live_processes(run_dir), timeout=5, what="no process of the run left")
    # The ranks were stopped by SIGTERM and stopped cleanly (a checkpoint, then the `stopped` record).
    assert [p["state"] for p in trainer_standin.positions()] == ["stopped", "stopped"]


def test_missing_dataset_file_fails_with_trainer_error(celery_worker_process, user, cnn_model, local_backend,
                                                       tmp_path):
    from sklearn.datasets import load_digits

    digits = load_digits()
    path = tmp_path / "digits.npz"
    np.savez(path, x_train=digits.images.astype("float32"), y_train=digits.target.astype("int64"))  # (N, 8, 8), for the cnn
    dataset = services.dataset_create(owner=user, name="digits-npz", format="npz", uri=str(path))
    with transaction.atomic():  # submit is enqueued on commit: the file is gone before any worker looks
        job = services.training_job_create(owner=user, dataset=dataset, model_spec=cnn_model,
                                           backend=local_backend, nodes=1, procs_per_node=2, epochs=1)
        path.unlink()
    job = celery_worker_process.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=180,
                                         what="the job to end")
    assert job.state == S.FAILED
    assert "trainer error" in job.failure_reason and str(path) in job.failure_reason, job.failure_reason
    assert "does not exist" in job.failure_reason



def test_submit_job_command_waits_for_success(celery_worker_process, user, digits_dataset, cnn_model,
                                              local_backend):
    """The shell path: `manage.py submit_job --wait --json` as its own process, driven by the worker."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, **celery_worker_process.env)
    result = subprocess.run(
        [sys.executable, "manage.py", "submit_job", "--dataset", "digits", "--model", "digits-cnn",
         "--backend", "local", "--nodes", "1", "--procs-per-node", "2", "--epochs", "3", "--user", "alice",
         "--wait", "--json", "--timeout", "300"],
        cwd=celery_worker_process.cwd, env=env, capture_output=True, text=True, timeout=330,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["state"] == "SUCCEEDED"
    assert data["metrics"]["val_accuracy"] >= 0.90
    assert [e["to"] for e in data["events"]] == ["QUEUED", "SUBMITTING", "PENDING", "RUNNING", "SUCCEEDED"]
    assert data["cost_usd"] > 0 and data["duration_s"] > 0 and data["url"] == f"http://127.0.0.1:8000/jobs/{data['id']}/"
    assert "PENDING → RUNNING" in result.stderr and "epoch 2 val_accuracy" in result.stderr


def test_diverged_job_fails_with_the_nan_step_and_the_chart_gets_gaps(celery_worker_process, user, digits_dataset,
                                                                       cnn_model, local_backend, client):
    """lr 1e30: the real trainer's loss is NaN from step 2; the job ends FAILED with that as its
    reason (read from the run's output by the gpubox backend), and the chart data keeps the NaN
    points as nulls instead of dropping them."""
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=2, epochs=3, lr=1e30)
    job = celery_worker_process.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=300,
                                         what="the job to end")
    assert job.state == S.FAILED, (job.state, job.failure_reason, celery_worker_process.log()[-3000:])
    assert "loss became NaN at step 2" in job.failure_reason, job.failure_reason
    assert "loss became NaN at step 2" in selectors.training_job_events(job=job).last().message
    losses = list(MetricPoint.objects.filter(job=job, name="train_loss", rank__isnull=True)
                  .order_by("step").values_list("step", "value"))
    # Every window after step 1 (the "started" record, not a series point) holds the NaN step.
    assert losses and all(v is None for _, v in losses), losses
    client.force_login(user)
    payload = client.get(f"/jobs/{job.pk}/metrics.json").json()
    assert payload["series"]["train_loss"] and all(p["y"] is None for p in payload["series"]["train_loss"])
