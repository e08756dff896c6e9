"""End to end: a GPU box shares its devices between jobs through the real worker (Redis, PostgreSQL,
the real supervisor and launcher). This machine has no GPU, so the box counts process slots; the path
is the one GPUs take (tests/cloud_adapters/gpubox/test_gpubox_inventory.py shows a real job's ranks
given GPU indices, tests/jobs/test_admission.py the rules and the race). The jobs are the trainer
stand-in's (tests/standins/trainer.py, named on the staff backend row), held at their first step
while the test looks at their ranks, then released (real training through the worker:
tests/e2e/test_job_lifecycle.py).

* A box of 2 slots and two 2-process digits jobs: the second waits in QUEUED ("waiting for 2 slots
  on local (0 free)") and starts once the sync has seen the first end; both succeed.
* A box of 4 slots and two 2-process jobs at once: they run together, and the slots their ranks were
  given (``TRAINBOARD_SLOTS``, read from each rank's environment in /proc) are disjoint.
"""

from __future__ import annotations

import time

import pytest

from devicekit import rank_environments
from jobs import selectors, services
from jobs.models import JobStateChoices as S, TrainingJob

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HOLDING = (S.SUBMITTING, S.PENDING, S.RUNNING)


@pytest.fixture
def box_settings(celery_worker_process, settings):
    """The shared worker (2 processes per node, as the conftest's box); this process's host settings
    are the worker's (the web side validates against the same box)."""
    settings.TRAINBOARD_RUN_ROOT = celery_worker_process.run_root
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2
    return celery_worker_process


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _create(user, dataset, model, backend, epochs: int = 2) -> TrainingJob:
    return services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                        nodes=1, procs_per_node=2, epochs=epochs)


def _slots_seen(worker, job: TrainingJob) -> dict[int, str]:
    """``{LOCAL_RANK: TRAINBOARD_SLOTS}`` of the job's two ranks, read while they run."""
    run_dir = str(worker.run_root / _reload(job).provider_job_name)
    found = worker.wait_for(lambda: (envs := rank_environments(run_dir)) and len(envs) == 2 and envs,
                            timeout=180, what=f"job {job.pk}'s two ranks")
    return {rank: env.get("TRAINBOARD_SLOTS", "") for rank, env in found.items()}


def _ended(worker, job: TrainingJob, timeout: float = 300) -> TrainingJob:
    return worker.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=timeout, what=f"job {job.pk} to end")


def test_a_job_that_does_not_fit_waits_and_starts_when_the_first_ends(box_settings, user, digits_dataset,
                                                                       cnn_model, settings, capsys, trainer_standin):
    worker = box_settings
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2
    backend = services.backend_create(owner=user, name="local", kind="gpubox",
                                      config={"hourly_rate_usd": 3.6, "python": trainer_standin.python})
    trainer_standin.hold(steps=1)  # the first job keeps its slots until the test has looked at it
    started = time.monotonic()
    first = _create(user, digits_dataset, cnn_model, backend)
    worker.wait_for(lambda: _reload(first).state in HOLDING, timeout=60, what="the first job to be admitted")
    second = _create(user, digits_dataset, cnn_model, backend)
    waiting = worker.wait_for(lambda: (j := _reload(second)).wait_reason and j, timeout=60,
                              what="the second job to be held back")
    assert (waiting.state, waiting.wait_reason) == (S.QUEUED, "waiting for 2 slots on local (0 free)")
    assert _reload(first).allocated_gpus == [0, 1]
    assert _slots_seen(worker, first) == {0: "0,1", 1: "0,1"}
    assert _reload(second).state == S.QUEUED  # still waiting: the first holds its slots at the gate

    trainer_standin.release()
    first = _ended(worker, first)
    second = _ended(worker, second)
    assert (first.state, second.state) == (S.SUCCEEDED, S.SUCCEEDED), (first.failure_reason, second.failure_reason)
    # It started on the slots the first gave back, once that had ended, and says why it waited.
    assert second.allocated_gpus == [0, 1] and second.wait_reason == ""
    assert second.submitted_at > first.ended_at
    messages = list(selectors.training_job_events(job=second).values_list("message", flat=True))
    assert messages[:3] == ["Created", "Waiting: waiting for 2 slots on local (0 free)",
                            "Submitting to backend local with 2 slots 0,1"]
    # The wait is a note in QUEUED; no event moves a job from a state to itself.
    moves = list(selectors.training_job_events(job=second).values_list("from_state", "to_state"))
    assert moves == [("", "QUEUED"), ("QUEUED", ""), ("QUEUED", "SUBMITTING"), ("SUBMITTING", "PENDING"),
                     ("PENDING", "RUNNING"), ("RUNNING", "SUCCEEDED")], moves
    with capsys.disabled():
        print(f"\n[e2e sharing] two jobs one after the other on 2 slots: {time.monotonic() - started:.1f} s")


def test_jobs_that_run_together_are_given_disjoint_slots(box_settings, user, digits_dataset, cnn_model, capsys,
                                                         trainer_standin):
    worker = box_settings
    # Staff's backend carries its own host settings: this box has 4 slots.
    backend = services.backend_create(owner=user, name="local", kind="gpubox",
                                      config={"hourly_rate_usd": 3.6, "slots": 4, "python": trainer_standin.python})
    trainer_standin.hold(steps=1)  # both jobs' ranks stay up, together, until the test has looked
    started = time.monotonic()
    jobs = [_create(user, digits_dataset, cnn_model, backend, epochs=2) for _ in range(2)]
    worker.wait_for(lambda: all(_reload(j).state in HOLDING for j in jobs), timeout=60,
                    what="both jobs admitted at once")
    run_dirs = [str(worker.run_root / _reload(job).provider_job_name) for job in jobs]

    def both_running():
        envs = [rank_environments(d) for d in run_dirs]
        return all(len(e) == 2 for e in envs) and envs

    seen = [{rank: env.get("TRAINBOARD_SLOTS", "") for rank, env in envs.items()}
            for envs in worker.wait_for(both_running, timeout=180, what="the ranks of both jobs at once")]
    allocated = [_reload(job).allocated_gpus for job in jobs]
    assert sorted(allocated) == [[0, 1], [2, 3]]
    # Running at the same time, each job's ranks saw exactly the slots it holds: no slot was given twice.
    assert seen == [{0: ",".join(map(str, a)), 1: ",".join(map(str, a))} for a in allocated]
    trainer_standin.release()
    ended = [_ended(worker, job) for job in jobs]
    assert [j.state for j in ended] == [S.SUCCEEDED, S.SUCCEEDED], [j.failure_reason for j in ended]
    assert all(not j.wait_reason for j in ended)
    with capsys.disabled():
        print(f"\n[e2e sharing] two jobs together on 4 slots: {time.monotonic() - started:.1f} s")
