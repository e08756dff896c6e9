"""End to end: a 6-trial sweep with 2 concurrent trials of a digits job (2–3 epochs, one process) run
by a real Celery worker with embedded beat (Redis broker, PostgreSQL test database, Optuna's tables
in it) on a GPU box: it reaches its best trial, with the one bad trial pruned by the median pruner.

The box's interpreter is the trainer stand-in (tests/standins/trainer.py, named on the staff owner's
backend row): the real supervisor, torchrun command and launcher, with a torch-free training loop
whose validation accuracy follows ``train.lr`` (0.64 after an epoch and 0.85 after two at lr 0.05, chance at 1e-6:
the contract test, tests/trainer_pkg/test_trainer_standin_contract.py, finds the same in the real
trainer). The real trainer's learning is tested in tests/trainer_pkg/test_trainer_distributed.py,
a real job through the worker in tests/e2e/test_job_lifecycle.py, a real launcher in a sweep in
tests/e2e/test_script_sweep_e2e.py, and the pruners' arithmetic in tests/jobs/test_sweep_optuna.py.

How the pruning is made certain, not lucky:

* The search space is ``train.lr`` ∈ {0.05, 1e-6} × ``train.epochs`` ∈ {2, 3, LONG}, random sampler.
  Sweeps seed each ask from the sweep's seed and the trials asked so far (jobs.sweeps._sampler),
  so a seed fixes the six trials before anything runs: the test picks the first seed whose trials
  have exactly one lr = 1e-6 trial, asked third or later, with LONG epochs, and good trials of 2–3
  epochs only (computed below with the same sampler on an in-memory study).
* The stand-in's gate lets every job take GATE_EPOCHS (3) epochs of optimizer steps and no more: the
  good trials run to their end, and the bad trial (LONG epochs) waits at the gate after its third
  epoch record until the pruner cancels it, however late the beat pass comes.
* The good trials share lr and batch size: their val_accuracy is the same at every epoch they
  share, so none is ever below the median of the completed ones (ties are not pruned).
* The bad trial's job is created only when a slot frees, and every path that fills a slot first
  tells Optuna the ended trials (sweep_trial_ended; the beat pass's repair), so a completed curve
  is stored before the bad trial's first epoch; with lr = 1e-6 that epoch is at chance, far below
  it: the first pass that sees it prunes it at epoch 1.
"""

from __future__ import annotations

import optuna
import pytest

from jobs import services, sweeps
from jobs.models import JobStateChoices as S, Sweep, TrainingJob
from standins.trainer import batches_per_epoch
from trainer_pkg.config import JobConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LONG = 8  # the bad trial's epochs: more than the gate lets any job take
GATE_EPOCHS = 3  # the good trials' most epochs: the gate lets every job take this many epochs of steps
BATCH = 64
SPACE = {"train.lr": {"type": "categorical", "choices": [0.05, 1e-6]},
         "train.epochs": {"type": "categorical", "choices": [2, 3, LONG]}}
TRIALS = 6


def _planned_trials(seed: int) -> list[dict]:
    """The params the sweep will ask, trial by trial, for ``seed`` (the same sampler as jobs.sweeps)."""
    out = []
    sweep = Sweep(sampler="random", seed=seed, search_space=SPACE, max_trials=TRIALS)
    for n in range(TRIALS):
        study = optuna.create_study(sampler=sweeps._sampler(sweep, asked=n))
        out.append(study.ask(sweeps._distributions(SPACE)).params)
    return out


def _pick_seed() -> tuple[int, list[dict]]:
    for seed in range(20_000):
        planned = _planned_trials(seed)
        bad = [i for i, p in enumerate(planned) if p["train.lr"] == 1e-6]
        if (len(bad) == 1 and bad[0] >= 2 and planned[bad[0]]["train.epochs"] == LONG
                and all(p["train.epochs"] in (2, 3) for i, p in enumerate(planned) if i != bad[0])):
            return seed, planned
    raise AssertionError("no seed gives one late bad trial")


def test_six_trial_sweep_reaches_its_best_trial_with_one_pruned(celery_worker_process, user, digits_dataset,
                                                                local_backend, run_root, trainer_standin):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seed, planned = _pick_seed()
    services.backend_update(backend=local_backend, config={**local_backend.config, "python": trainer_standin.python})
    per_epoch = batches_per_epoch(JobConfig.from_dict({"train": {"batch_size": BATCH}}), 1)  # 23: one process
    trainer_standin.hold(steps=GATE_EPOCHS * per_epoch)
    model = services.model_spec_create(owner=user, name="tiny-mlp", architecture="mlp",
                                       params={"hidden_size": 32, "num_layers": 1})
    sweep = sweeps.sweep_create(
        owner=user, name="e2e-sweep", search_space=SPACE, sampler="random", seed=seed,
        base={"dataset": digits_dataset.pk, "model_spec": model.pk, "backend": local_backend.pk,
              "batch_size": BATCH, "epochs": 2, "max_runtime_s": 600},
        objective_metric="val_accuracy", direction="maximize", max_trials=TRIALS, max_concurrent_trials=2,
        pruner="median", pruner_startup_trials=1, budget_usd="20")

    def ended():
        s = Sweep.objects.get(pk=sweep.pk)
        return s if s.is_terminal else None

    done = celery_worker_process.wait_for(ended, timeout=900, what="the sweep to end")
    jobs = list(TrainingJob.objects.filter(sweep=sweep).order_by("trial_number"))
    log_tail = celery_worker_process.log()[-4000:]
    assert done.state == Sweep.State.SUCCEEDED, (done.message, done.trial_errors, log_tail)
    assert done.message == f"All {TRIALS} trials done; {TRIALS - 1} complete."

    trials = sweeps.sweep_trials(sweep=done)
    assert [t["params"] for t in trials] == planned  # the seed decided every trial
    assert [j.trial_number for j in jobs] == list(range(TRIALS))
    states = [t["state"] for t in trials]
    bad = next(i for i, p in enumerate(planned) if p["train.lr"] == 1e-6)
    assert states == ["PRUNED" if i == bad else "COMPLETE" for i in range(TRIALS)], (states, trials)

    pruned_job = jobs[bad]
    assert pruned_job.state == S.CANCELLED
    assert pruned_job.failure_reason == "pruned by the median pruner at epoch 1"
    assert trials[bad]["message"] == pruned_job.failure_reason
    assert list(trials[bad]["intermediate"]) == [1] and trials[bad]["intermediate"][1] < 0.5  # near chance
    # Its ranks were held at the gate (or on their way to it) and stopped by the cancel's SIGTERM; the
    # others ran to their end.
    for job in jobs:
        ranks = [p for p in trainer_standin.positions()
                 if p["output_dir"].startswith(f"{run_root / job.provider_job_name}/")]
        assert len(ranks) == 1, ranks
        if job is pruned_job:
            assert ranks[0]["state"] == "stopped" and ranks[0]["step"] <= GATE_EPOCHS * per_epoch, ranks
        else:
            assert ranks[0]["state"] == "completed" and ranks[0]["step"] == job.config["train"]["epochs"] * per_epoch

    for t, job in zip(trials, jobs):
        assert job.config["train"]["lr"] == t["params"]["train.lr"]
        assert job.config["train"]["epochs"] == t["params"]["train.epochs"]
        if t["state"] == "COMPLETE":
            assert job.state == S.SUCCEEDED
            assert t["value"] == pytest.approx(job.final_metrics["val_accuracy"])
            assert t["value"] > 0.8
            assert sorted(t["intermediate"]) == list(range(1, job.config["train"]["epochs"] + 1))

    best = sweeps.best_trial(done, trials)
    assert best["value"] == max(t["value"] for t in trials if t["value"] is not None)
    assert best["params"]["train.lr"] == 0.05
    # Never more than 2 trials' jobs at once: a job is created when a slot frees.
    events = sorted([(j.created_at, 1) for j in jobs] + [(j.ended_at, -1) for j in jobs])  # ends first at a tie
    running, most = 0, 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert most == 2, [(j.trial_number, j.created_at, j.ended_at) for j in jobs]
    spend = sweeps.sweep_spend(done)
    assert spend["spent_usd"] == sum(j.cost_usd for j in jobs) and spend["spent_usd"] > 0
