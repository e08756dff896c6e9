"""End to end: a GPU-box job whose whole process tree is SIGKILLed, as a reboot would leave it, is
resubmitted by Trainboard as attempt 2 and resumes from its epoch-1 checkpoint (docs/recovery.md).

The real Celery worker (embedded beat, Redis, PostgreSQL) runs a 3-epoch digits job on the trainer
stand-in (tests/standins/trainer.py, named on the staff owner's backend row: the real supervisor,
torchrun command and launcher, a torch-free loop that checkpoints and resumes as the trainer does).
Held one step into its second epoch (after its epoch-1 checkpoint) and RUNNING, the job loses its
supervisor, torchrun and every rank to SIGKILL (their pids from the run directory's supervisor.json
and torchrun.json, all descendants found through /proc). It must end SUCCEEDED with exactly 3 epochs
of metrics (each epoch record once, steps continuing from the checkpoint), two attempts recorded and
its cost the sum of theirs. (The real trainer resuming from its own checkpoints:
tests/trainer_pkg/test_trainer_distributed.py and test_exactness.py.)
"""

from __future__ import annotations

import json
import os
import signal
from decimal import Decimal
from pathlib import Path

import pytest

from jobs import selectors, services
from jobs.models import JobAttempt, JobStateChoices as S, MetricPoint, TrainingJob
from polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _children() -> dict[int, list[int]]:
    """parent pid → child pids of every process now in /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state letter
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_tree(*roots: int) -> set[int]:
    """``roots`` and all their descendants that are alive now."""
    tree, found, todo = _children(), set(), [r for r in roots if r]
    while todo:
        pid = todo.pop()
        if pid in found or not _alive(pid):
            continue
        found.add(pid)
        todo.extend(tree.get(pid, []))
    return found


def kill_like_a_reboot(run_dir: Path) -> set[int]:
    """SIGKILL the run's supervisor, torchrun and ranks at once (no SIGTERM: no checkpoint, no
    exit.json); returns the pids killed."""
    supervisor = json.loads((run_dir / "supervisor.json").read_text())["pid"]
    torchrun = json.loads((run_dir / "torchrun.json").read_text())["pid"]
    pids = process_tree(supervisor, torchrun)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def test_a_killed_process_tree_is_resumed_from_its_checkpoint_as_attempt_two(
        celery_worker_process, user, digits_dataset, cnn_model, local_backend, run_root, trainer_standin):
    services.backend_update(backend=local_backend, config={**local_backend.config, "python": trainer_standin.python})
    # 1,438 samples / 2 ranks / 32 a batch: 23 steps an epoch. Held after step 24: inside epoch 2.
    trainer_standin.hold(steps=24)
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, procs_per_node=2, epochs=3, batch_size=32)
    first_name = job.provider_job_name
    first_dir = run_root / first_name
    checkpoint = first_dir / "output" / "checkpoints" / "last.pt"
    trainer_standin.wait_at(24, first_dir, timeout=240)
    assert checkpoint.exists(), "the epoch-1 checkpoint"
    celery_worker_process.wait_for(lambda: _reload(job).state == S.RUNNING, timeout=60,
                                   what="the sync to record it RUNNING")
    assert not (first_dir / "exit.json").exists()
    killed = kill_like_a_reboot(first_dir)
    assert len(killed) >= 4, killed  # supervisor, torchrun, 2 ranks (and what they started)
    wait_for(lambda: not process_tree(*killed), timeout=10, what="every killed process gone")
    assert not (first_dir / "exit.json").exists()  # nobody recorded an end: the run was lost
    trainer_standin.release()  # the second attempt runs to its end

    job = celery_worker_process.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=300,
                                         what="the job to end")
    assert job.state == S.SUCCEEDED, (job.failure_reason, celery_worker_process.log()[-3000:])

    # Two attempts: the lost one on record, the second the job's own row.
    assert job.attempt == 2 and job.provider_job_name == f"{first_name}-a2"
    assert len(job.allocated_gpus) == 2  # admission gave the new attempt a device (a slot here) per rank again
    (lost,) = JobAttempt.objects.filter(job=job)
    assert (lost.number, lost.outcome, lost.provider_job_name) == (1, "lost", first_name)
    assert lost.reason == "supervisor process disappeared"
    assert lost.checkpoint_uri == str(first_dir / "output" / "checkpoints")
    assert lost.started_at is not None and lost.ended_at is not None and lost.billable_seconds > 0
    second_config = json.loads((run_root / job.provider_job_name / "job.json").read_text())
    assert second_config["output"]["checkpoint_dir"] == lost.checkpoint_uri  # resumed in place

    events = list(selectors.training_job_events(job=job).values_list("from_state", "to_state", "message"))
    moves = [(a, b) for a, b, _ in events]
    requeue = [m for a, b, m in events if (a, b) == ("RUNNING", "QUEUED")]
    assert requeue == ["run lost (supervisor process disappeared); resubmitting, attempt 2 of 3"], events
    assert moves[-4:] == [("QUEUED", "SUBMITTING"), ("SUBMITTING", "PENDING"), ("PENDING", "RUNNING"),
                          ("RUNNING", "SUCCEEDED")], moves

    # Exactly the 3 epochs asked for, each once; the steps continue from the checkpoint.
    epochs = list(MetricPoint.objects.filter(job=job, name="val_accuracy", rank__isnull=True)
                  .order_by("step").values_list("epoch", "step"))
    assert [e for e, _ in epochs] == [0, 1, 2], epochs
    per_epoch = epochs[0][1]
    assert per_epoch == 23
    assert [s for _, s in epochs] == [per_epoch, 2 * per_epoch, 3 * per_epoch]
    losses = list(MetricPoint.objects.filter(job=job, name="train_loss", rank__isnull=True)
                  .order_by("id").values_list("step", flat=True))
    assert losses == sorted(set(losses)), "a step stored twice, or out of order"
    assert max(losses) <= 3 * per_epoch
    log_text = "\n".join(job.log_lines.values_list("text", flat=True))
    assert f"resuming from {lost.checkpoint_uri}/last.pt: epoch 1, batch 0, step {per_epoch}" in log_text

    # Cost = the lost attempt's + the second's ($3.60 per node-hour of its own run interval).
    second_s = (job.ended_at - job.started_at).total_seconds()
    assert job.billable_seconds == pytest.approx(lost.billable_seconds + second_s, rel=0.02)
    second_usd = Decimal(str(round(3.6 * second_s / 3600, 4)))
    assert abs(job.cost_usd - (lost.cost_usd + second_usd)) <= Decimal("0.0002")
    assert lost.cost_usd == Decimal(str(round(3.6 * lost.billable_seconds / 3600, 4)))
