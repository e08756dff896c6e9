"""Sweeps (jobs.sweeps) against the real Optuna RDB storage in pytest-django's PostgreSQL test
database: validation, the grid mapping, TPE (seeded, modelling what it was told), the budget stop,
telling trials, pruning (median and successive halving), stale-trial repair and a worker killed
between asking and creating the job."""

from __future__ import annotations

import itertools
import math
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import connections
from django.utils import timezone

from jobs import sweeps
from jobs.models import JobStateChoices as S, MetricPoint, Sweep, TrainingJob
from jobs.states import transition

pytestmark = pytest.mark.django_db


def _base(dataset, model, backend, **extra):
    return {"dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "epochs": 2, "batch_size": 32,
            **extra}


def _sweep(user, dataset, model, backend, **kwargs):
    args = dict(name="lr-search", base=_base(dataset, model, backend),
                search_space={"train.lr": {"type": "categorical", "choices": [0.1, 0.05]}}, sampler="grid",
                max_trials=10, max_concurrent_trials=2)
    args.update(kwargs)
    return sweeps.sweep_create(owner=user, **args)


def _finish(job, *, state=S.SUCCEEDED, values=(), cost=None, metric="val_accuracy"):
    """Move a trial job through its life to ``state``, reporting ``values`` (one per epoch) first."""
    job.refresh_from_db()
    for epoch, value in enumerate(values):
        MetricPoint.objects.create(job=job, name=metric, step=(epoch + 1) * 10, epoch=epoch, value=value,
                                   recorded_at=timezone.now())
    for nxt in (S.SUBMITTING, S.PENDING, S.RUNNING):
        if job.state != nxt and job.state in (S.QUEUED, S.SUBMITTING, S.PENDING):
            transition(job, nxt)
    if cost is not None:
        TrainingJob.objects.filter(pk=job.pk).update(cost_usd=cost)
        job.refresh_from_db()
    if state != S.RUNNING:
        transition(job, state, failure_reason="exit 1" if state == S.FAILED else "")
    return job


def _trial_jobs(sweep):
    return list(TrainingJob.objects.filter(sweep=sweep).order_by("trial_number"))


def test_storage_url_is_the_test_database():
    url = sweeps.storage_url()
    assert url.startswith("postgresql+psycopg://")
    assert url.endswith("/" + connections["default"].settings_dict["NAME"])
    assert connections["default"].settings_dict["NAME"].startswith("test_")


def test_every_error_at_once_and_nothing_stored(user, digits_dataset, cnn_model, local_backend):
    space = {
        "train.lrr": {"type": "float", "low": 0.001, "high": 0.1},         # unknown config field
        "train.batch_size": {"type": "int", "low": 0, "high": 64},          # below the trainer's bound
        "model.params.widthh": {"type": "categorical", "choices": [8, 16]},  # unknown model parameter
        "train.optimizer": {"type": "categorical", "choices": ["sgd", "lion"]},  # not one of the choices
        "train.momentum": {"type": "float", "low": 0.9, "high": 0.1},       # low above high
        "code.script": {"type": "categorical", "choices": ["x.py"]},        # set by the model
        "train.epochs": {"type": "rand"},
    }
    with pytest.raises(ValidationError) as err:
        sweeps.sweep_create(owner=user, name="", base=_base(digits_dataset, cnn_model, local_backend, colour=1),
                            search_space=space, sampler="annealing", max_trials=0, max_concurrent_trials="two",
                            objective_metric="", direction="up")
    errors = err.value.message_dict
    text = " | ".join(errors["search_space"])
    assert "train.lrr: unknown field" in text
    assert "train.batch_size" in text and "at least 1" in text or "train.batch_size: must be" in text
    assert "model.params.widthh: unknown parameter for cnn" in text
    assert "train.optimizer: must be one of 'sgd', 'adamw', got 'lion'" in text
    assert "'train.momentum': low (0.9) is above high (0.1)" in text
    assert "'code.script': the code section is set by the model" in text
    assert "'train.epochs': type must be float, int or categorical" in text
    assert set(errors) >= {"name", "base", "sampler", "max_trials", "max_concurrent_trials", "objective_metric",
                           "direction"}
    assert "unknown field 'colour'" in errors["base"][0]
    assert Sweep.objects.count() == 0 and TrainingJob.objects.count() == 0


def test_the_base_job_is_checked_by_the_job_service(user, digits_dataset, cnn_model, local_backend):
    with pytest.raises(ValidationError) as err:
        _sweep(user, digits_dataset, cnn_model, local_backend,
               base=_base(digits_dataset, cnn_model, local_backend, batch_size=0, epochs=0))
    errors = err.value.message_dict
    assert errors["base.epochs"] == ["Epochs must be at least 1, got 0."]
    assert errors["base.batch_size"] == ["Batch size must be at least 1, got 0."]
    assert Sweep.objects.count() == 0 and TrainingJob.objects.count() == 0


def test_grid_over_floats_is_refused(user, digits_dataset, cnn_model, local_backend):
    with pytest.raises(ValidationError) as err:
        _sweep(user, digits_dataset, cnn_model, local_backend,
               search_space={"train.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}})
    assert "the grid sampler needs listed values" in err.value.message_dict["search_space"][0]


def test_grid_covers_the_grid_exactly_once(user, digits_dataset, cnn_model, local_backend):
    space = {"train.lr": {"type": "categorical", "choices": [0.1, 0.05]},
             "train.batch_size": {"type": "int", "low": 16, "high": 48, "step": 16},
             "model.params.hidden_size": {"type": "categorical", "choices": [32, 64]}}
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, search_space=space, max_trials=50,
                   max_concurrent_trials=50)
    assert sweeps.trial_limit(sweep) == 12
    created = sweeps.sweep_fill(sweep_id=sweep.pk)
    assert len(created) == 12
    assert sweeps.sweep_fill(sweep_id=sweep.pk) == []  # a second fill asks nothing more
    jobs = _trial_jobs(sweep)
    assert [j.trial_number for j in jobs] == list(range(12))
    seen = {(j.config["train"]["lr"], j.config["train"]["batch_size"], j.config["model"]["params"]["hidden_size"])
            for j in jobs}
    assert seen == set(itertools.product([0.1, 0.05], [16, 32, 48], [32, 64]))
    for job in jobs:  # the base job's other fields are kept
        assert job.config["train"]["epochs"] == 2 and job.backend_id == local_backend.pk
        assert job.name == f"lr-search trial {job.trial_number}" and job.state == S.QUEUED
    for i, job in enumerate(jobs):
        _finish(job, values=[0.5, 0.5 + i / 100])
        assert sweeps.sweep_trial_ended(job_id=job.pk) == "COMPLETE"
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.SUCCEEDED and "All 12 trials done; 12 complete" in sweep.message
    trials = sweeps.sweep_trials(sweep=sweep)
    assert [t["value"] for t in trials] == pytest.approx([0.5 + i / 100 for i in range(12)])
    assert sweeps.best_trial(sweep, trials)["number"] == 11


def test_concurrency_limit_and_tell(user, digits_dataset, cnn_model, local_backend):
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, sampler="random", max_trials=3,
                   search_space={"train.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}})
    assert len(sweeps.sweep_fill(sweep_id=sweep.pk)) == 2
    first, second = _trial_jobs(sweep)
    _finish(first, values=[0.8, 0.9])
    assert sweeps.sweep_trial_ended(job_id=first.pk) == "COMPLETE"
    assert len(_trial_jobs(sweep)) == 3  # the freed slot is filled
    assert sweeps.sweep_trial_ended(job_id=first.pk) is None  # a second delivery tells nothing
    _finish(second, state=S.SUCCEEDED, values=[])  # ended without the metric
    assert sweeps.sweep_trial_ended(job_id=second.pk) == "FAIL"
    third = _trial_jobs(sweep)[2]
    _finish(third, state=S.FAILED, values=[0.95])
    assert sweeps.sweep_trial_ended(job_id=third.pk) == "FAIL"
    sweep.refresh_from_db()
    trials = sweeps.sweep_trials(sweep=sweep)
    assert [t["state"] for t in trials] == ["COMPLETE", "FAIL", "FAIL"]
    assert trials[0]["value"] == pytest.approx(0.9)
    assert f"job {second.pk} ended SUCCEEDED without reporting val_accuracy" in trials[1]["message"]
    assert f"job {third.pk} ended FAILED: exit 1" in trials[2]["message"]
    assert sweep.state == Sweep.State.SUCCEEDED
    assert [e["trial"] for e in sweep.trial_errors] == [1, 2]


def test_best_objective_and_minimize(user, digits_dataset, cnn_model, local_backend):
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, objective="best", direction="minimize",
                   objective_metric="val_loss", max_trials=1, max_concurrent_trials=1)
    sweeps.sweep_fill(sweep_id=sweep.pk)
    (job,) = _trial_jobs(sweep)
    _finish(job, values=[0.9, 0.3, 0.6], metric="val_loss")
    sweeps.sweep_trial_ended(job_id=job.pk)
    assert sweeps.sweep_trials(sweep=sweep)[0]["value"] == pytest.approx(0.3)  # the best, not the last (0.6)


def test_budget_stops_new_trials(user, digits_dataset, cnn_model, local_backend):
    # $3.60 per node-hour, max runtime 1 h: each trial is estimated at $3.60.
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, sampler="random", max_trials=10,
                   max_concurrent_trials=5, budget_usd="8.00",
                   search_space={"train.lr": {"type": "float", "low": 0.01, "high": 0.1}})
    assert sweep.trial_estimate_usd == Decimal("3.6000")
    assert len(sweeps.sweep_fill(sweep_id=sweep.pk)) == 2  # 2 × 3.60 = 7.20; a third would be 10.80 > 8
    first, second = _trial_jobs(sweep)
    _finish(first, values=[0.9], cost=Decimal("1.00"))  # spent 1.00 + 3.60 running + 3.60 next = 8.20 > 8
    sweeps.sweep_trial_ended(job_id=first.pk)
    assert len(_trial_jobs(sweep)) == 2
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.RUNNING
    _finish(second, values=[0.8], cost=Decimal("4.50"))  # 5.50 spent + 3.60 = 9.10 > 8: done
    sweeps.sweep_trial_ended(job_id=second.pk)
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.BUDGET_REACHED
    assert "$5.50 spent of $8.00" in sweep.message and "2 of 10 trials ran" in sweep.message
    assert len(_trial_jobs(sweep)) == 2


def test_budget_below_one_trial_is_refused(user, digits_dataset, cnn_model, local_backend):
    with pytest.raises(ValidationError) as err:
        _sweep(user, digits_dataset, cnn_model, local_backend, budget_usd="1.00")
    assert "One trial is estimated at $3.60" in err.value.message_dict["budget_usd"][0]


def test_refused_trial_job_is_told_fail(user, digits_dataset, cnn_model, local_backend):
    # batch sizes pass the schema, but 4096 is more than the digits training split holds per rank? No:
    # the job service refuses a model parameter combination the registry's cross-check forbids.
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, sampler="grid", max_concurrent_trials=5,
                   search_space={"train.lr": {"type": "categorical", "choices": [0.1, 0.05]}})
    # A job the backend refuses: the box has been disabled since the sweep was created.
    type(local_backend).objects.filter(pk=local_backend.pk).update(enabled=False)
    assert sweeps.sweep_fill(sweep_id=sweep.pk) == []
    sweep.refresh_from_db()
    trials = sweeps.sweep_trials(sweep=sweep)
    assert [t["state"] for t in trials] == ["FAIL", "FAIL"]
    assert "Backend local is disabled" in trials[0]["message"]
    assert [e["trial"] for e in sweep.trial_errors] == [0, 1]
    assert "Backend local is disabled" in sweep.trial_errors[0]["message"]
    assert sweep.state == Sweep.State.FAILED  # every trial done, none complete
    assert TrainingJob.objects.filter(sweep=sweep).count() == 0


def test_worker_killed_between_ask_and_create(user, digits_dataset, cnn_model, local_backend, monkeypatch):
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, max_concurrent_trials=2,
                   search_space={"train.lr": {"type": "categorical", "choices": [0.1, 0.05, 0.02]}})

    class Killed(BaseException):
        """The worker process dies (SIGKILL): nothing after this point runs, the transaction is lost."""

    real = sweeps._create_trial_job
    monkeypatch.setattr(sweeps, "_create_trial_job", lambda sweep, trial: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        sweeps.sweep_fill(sweep_id=sweep.pk)
    assert TrainingJob.objects.filter(sweep=sweep).count() == 0
    study = sweeps.sweep_study(sweep)
    (lost,) = study.get_trials()
    assert lost.state.name == "RUNNING"  # Optuna committed the ask on its own connection
    monkeypatch.setattr(sweeps, "_create_trial_job", real)
    created = sweeps.sweep_fill(sweep_id=sweep.pk)
    created += sweeps.sweep_fill(sweep_id=sweep.pk)  # two fills: still one job per trial
    assert len(created) == 2
    trials = sweeps.sweep_trials(sweep=sweep)
    assert trials[0]["state"] == "FAIL" and trials[0]["stale"] and trials[0]["job_id"] is None
    assert "never given a job" in trials[0]["message"]
    jobs = _trial_jobs(sweep)
    assert [j.trial_number for j in jobs] == [1, 2]
    # The lost grid point is asked again, so the grid is still covered exactly once.
    for job in jobs:
        _finish(job, values=[0.7])
        sweeps.sweep_trial_ended(job_id=job.pk)
    jobs = _trial_jobs(sweep)
    assert sorted(j.config["train"]["lr"] for j in jobs) == [0.02, 0.05, 0.1]
    assert len({j.trial_number for j in jobs}) == 3
    for job in jobs[2:]:
        _finish(job, values=[0.7])
        sweeps.sweep_trial_ended(job_id=job.pk)
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.SUCCEEDED


def test_unique_trial_number_per_sweep(user, digits_dataset, cnn_model, local_backend):
    from django.db import IntegrityError, transaction

    sweep = _sweep(user, digits_dataset, cnn_model, local_backend)
    sweeps.sweep_fill(sweep_id=sweep.pk)
    first, second = _trial_jobs(sweep)
    with pytest.raises(IntegrityError), transaction.atomic():
        TrainingJob.objects.filter(pk=second.pk).update(trial_number=first.trial_number)


def test_ended_job_never_told_is_repaired_by_the_tick(user, digits_dataset, cnn_model, local_backend):
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, max_concurrent_trials=1)
    sweeps.sweep_fill(sweep_id=sweep.pk)
    (job,) = _trial_jobs(sweep)
    _finish(job, values=[0.9])  # its sweep_trial_ended message was lost
    result = sweeps.sweep_tick()
    assert result["repaired"] == 1
    trials = sweeps.sweep_trials(sweep=sweep)
    assert trials[0]["state"] == "COMPLETE" and len(_trial_jobs(sweep)) == 2


def _median_sweep_with_one_completed_trial(user, dataset, model, backend):
    """A median-pruned sweep (pruning from the first completed trial) whose first trial completed with
    0.85, 0.95 over two epochs: (sweep, that trial's job, the second trial's job, still QUEUED)."""
    sweep = _sweep(user, dataset, model, backend, pruner="median", pruner_startup_trials=1,
                   search_space={"train.lr": {"type": "categorical", "choices": [0.1, 1e-6, 0.05]}})
    sweeps.sweep_fill(sweep_id=sweep.pk)
    good, bad = _trial_jobs(sweep)
    _finish(good, values=[0.85, 0.95])
    sweeps.sweep_trial_ended(job_id=good.pk)
    return sweep, good, bad


def test_median_pruner_cancels_a_bad_trial(user, digits_dataset, cnn_model, local_backend):
    sweep, good, bad = _median_sweep_with_one_completed_trial(user, digits_dataset, cnn_model, local_backend)
    _finish(bad, state=S.RUNNING, values=[0.10])
    third = _trial_jobs(sweep)[2]
    _finish(third, state=S.RUNNING, values=[0.85])  # as good as the median: kept
    sweeps.sweep_tick()
    _assert_pruned(sweep, bad, "pruned by the median pruner at epoch 1", {1: pytest.approx(0.10)})
    third.refresh_from_db()
    assert third.state == S.RUNNING
    # The job's cancel confirmed later tells nothing more.
    transition(bad, S.CANCELLED)
    assert sweeps.sweep_trial_ended(job_id=bad.pk) is None


def _assert_pruned(sweep, job, message: str, intermediate: dict) -> None:
    """``job``, a trial of ``sweep``, is being cancelled with ``message``, and Optuna holds it PRUNED
    with the same message and ``intermediate`` (epoch → value) reported."""
    job.refresh_from_db()
    assert job.state == S.STOPPING and job.failure_reason == message
    trial = {t["number"]: t for t in sweeps.sweep_trials(sweep=sweep)}[job.trial_number]
    assert (trial["state"], trial["intermediate"], trial["message"]) == ("PRUNED", intermediate, message)


def test_a_bad_trial_seen_first_past_the_completed_trials_epochs_is_still_pruned(user, digits_dataset, cnn_model,
                                                                              local_backend):
    """Fast epochs, a slow pass: the first pass that sees the bad trial finds it at epoch 5, beyond the
    2 epochs the completed trial has. Each epoch is put to the pruner in turn, so it is pruned at epoch 1
    (asked at its last epoch alone, the median pruner has nothing to compare with and keeps it)."""
    sweep, good, bad = _median_sweep_with_one_completed_trial(user, digits_dataset, cnn_model, local_backend)
    _finish(bad, state=S.RUNNING, values=[0.10, 0.10, 0.11, 0.10, 0.12])
    sweeps.sweep_tick()
    _assert_pruned(sweep, bad, "pruned by the median pruner at epoch 1", {1: pytest.approx(0.10)})


def test_successive_halving_cancels_a_bad_trial(user, digits_dataset, cnn_model, local_backend):
    # Warm-up 2 epochs: the pruner's min_resource, so rung 0 is reached at epoch 2. Reduction factor 4
    # (Optuna's default): with fewer than 4 trials at a rung only the best of them goes on.
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, pruner="successive_halving",
                   pruner_warmup_epochs=2,
                   search_space={"train.lr": {"type": "categorical", "choices": [0.1, 1e-6, 0.05]}})
    sweeps.sweep_fill(sweep_id=sweep.pk)
    good, bad = _trial_jobs(sweep)
    _finish(good, state=S.RUNNING, values=[0.80, 0.85])
    assert sweeps.sweep_tick()["pruned"] == 0  # the first at rung 0: nothing to compare with
    _finish(bad, state=S.RUNNING, values=[0.10])
    assert sweeps.sweep_tick()["pruned"] == 0  # epoch 1 is before the warm-up's end
    bad.refresh_from_db()
    assert bad.state == S.RUNNING
    MetricPoint.objects.create(job=bad, name="val_accuracy", step=20, epoch=1, value=0.12, recorded_at=timezone.now())
    assert sweeps.sweep_tick()["pruned"] == 1  # rung 0: 0.12 is not the best of (0.85, 0.12)
    _assert_pruned(sweep, bad, "pruned by the successive halving pruner at epoch 2",
                   {1: pytest.approx(0.10), 2: pytest.approx(0.12)})
    good.refresh_from_db()
    assert good.state == S.RUNNING
    assert {t["number"]: t for t in sweeps.sweep_trials(sweep=sweep)}[good.trial_number]["state"] == "RUNNING"
    # The cancel confirmed tells nothing more; the freed slot asks the third trial, which beats the
    # first at rung 0 and is kept.
    transition(bad, S.CANCELLED)
    assert sweeps.sweep_trial_ended(job_id=bad.pk) is None
    third = _trial_jobs(sweep)[2]
    _finish(third, state=S.RUNNING, values=[0.88, 0.90])
    assert sweeps.sweep_tick()["pruned"] == 0
    third.refresh_from_db()
    assert third.state == S.RUNNING
    assert [t["state"] for t in sweeps.sweep_trials(sweep=sweep)] == ["RUNNING", "PRUNED", "RUNNING"]


def test_cancel_stops_the_sweep_and_its_trials(user, digits_dataset, cnn_model, local_backend):
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend)
    sweeps.sweep_fill(sweep_id=sweep.pk)
    sweep = sweeps.sweep_cancel(sweep=sweep)
    assert sweep.state == Sweep.State.CANCELLED
    assert {j.state for j in _trial_jobs(sweep)} == {S.CANCELLED}
    assert sweeps.sweep_fill(sweep_id=sweep.pk) == []
    with pytest.raises(ValidationError):
        sweeps.sweep_cancel(sweep=sweep)


def test_terminal_move_of_a_trial_job_sends_the_task(user, digits_dataset, cnn_model, local_backend, monkeypatch,
                                                     django_capture_on_commit_callbacks):
    from jobs import dispatch

    sent = []
    monkeypatch.setattr(dispatch, "send_sweep_trial_ended", sent.append)
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend)
    sweeps.sweep_fill(sweep_id=sweep.pk)
    job = _trial_jobs(sweep)[0]
    with django_capture_on_commit_callbacks(execute=True):
        transition(job, S.SUBMITTING)
    assert sent == []
    with django_capture_on_commit_callbacks(execute=True):
        transition(job, S.FAILED)
    assert sent == [job.pk]


def test_param_importances(user, digits_dataset, cnn_model, local_backend):
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, sampler="random", max_trials=8,
                   max_concurrent_trials=8,
                   search_space={"train.lr": {"type": "float", "low": 0.01, "high": 0.1},
                                 "train.momentum": {"type": "float", "low": 0.0, "high": 0.9}})
    sweeps.sweep_fill(sweep_id=sweep.pk)
    for job in _trial_jobs(sweep):
        _finish(job, values=[job.config["train"]["lr"] * 10])  # the score depends on lr only
        sweeps.sweep_trial_ended(job_id=job.pk)
    found = sweeps.param_importances(sweep=sweep)
    assert set(found) == {"train.lr", "train.momentum"}
    assert found["train.lr"] > found["train.momentum"]
    assert sum(found.values()) == pytest.approx(1.0)


def test_each_pass_asks_a_new_trial_and_a_seed_repeats_them(user, digits_dataset, cnn_model, local_backend):
    space = {"train.lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True}}

    def run(seed):
        sweep = _sweep(user, digits_dataset, cnn_model, local_backend, sampler="random", seed=seed, max_trials=3,
                       max_concurrent_trials=1, search_space=space)
        for _ in range(3):  # one trial per pass, each pass a fresh sampler (as in a new worker)
            sweeps.sweep_fill(sweep_id=sweep.pk)
            job = TrainingJob.objects.filter(sweep=sweep).order_by("-trial_number").first()
            _finish(job, values=[0.5])
            sweeps.sweep_trial_ended(job_id=job.pk)
        return [t["params"]["train.lr"] for t in sweeps.sweep_trials(sweep=sweep)]

    first = run(7)
    assert len(set(first)) == 3 and all(0.001 <= lr <= 0.1 for lr in first)
    assert run(7) == first
    # Another seed asks other trials, not the same ones shifted (seed + trials asked would give seed 8's
    # first trial = seed 7's second).
    assert not set(run(8)) & set(first)


def _tpe_run(user, dataset, model, backend, *, seed, score, trials=8):
    """A sweep with the default sampler (TPE) over a log-scale lr, one trial per pass (a fresh sampler
    each time, as in a new worker), each trial's job reporting ``score(lr)``; its trials' lr in order."""
    sweep = sweeps.sweep_create(owner=user, name="tpe-search", base=_base(dataset, model, backend), seed=seed,
                                search_space={"train.lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True}},
                                max_trials=trials, max_concurrent_trials=1)
    assert sweep.sampler == Sweep.Sampler.TPE  # the default
    sweeps.sweep_fill(sweep_id=sweep.pk)
    for number in range(trials):
        (job,) = TrainingJob.objects.filter(sweep=sweep, state=S.QUEUED)
        assert job.trial_number == number
        _finish(job, values=[score(job.config["train"]["lr"])])
        assert sweeps.sweep_trial_ended(job_id=job.pk) == "COMPLETE"  # and asks the next trial
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.SUCCEEDED and f"All {trials} trials done; {trials} complete" in sweep.message
    return [t["params"]["train.lr"] for t in sweeps.sweep_trials(sweep=sweep)]


def test_tpe_is_seeded_and_learns_from_the_told_values(user, digits_dataset, cnn_model, local_backend):
    # max_trials 8: TPE's first max(2, 8 // 3) = 2 trials are random (its start-up), the other 6 modelled.
    startup = 2
    assert sweeps._sampler(Sweep(sampler="tpe", max_trials=8, seed=7))._n_startup_trials == startup
    high_is_good = math.log10  # the larger lr, the better
    first = _tpe_run(user, digits_dataset, cnn_model, local_backend, seed=7, score=high_is_good)
    assert len(set(first)) == 8 and all(1e-4 <= lr <= 1.0 for lr in first)
    assert _tpe_run(user, digits_dataset, cnn_model, local_backend, seed=7, score=high_is_good) == first
    # Same seed, opposite scores: the same random start-up trials, then TPE follows what it was told.
    reverse = _tpe_run(user, digits_dataset, cnn_model, local_backend, seed=7, score=lambda lr: -math.log10(lr))
    assert reverse[:startup] == first[:startup]
    assert reverse[startup:] != first[startup:]
    low, high = sorted(first[:startup])

    def nearer(lr, to, than):  # on the log scale the space is searched on
        return abs(math.log(lr) - math.log(to)) < abs(math.log(lr) - math.log(than))

    # The first modelled trial is drawn around the better start-up trial: the high one when a high lr
    # scored better, the low one when a low lr did.
    assert nearer(first[startup], high, low)
    assert nearer(reverse[startup], low, high)


def test_a_base_may_name_its_objects_instead_of_their_ids(user, digits_dataset, cnn_model, local_backend,
                                                          django_capture_on_commit_callbacks):
    """As the CLI does (issue 27): a name is looked up among the objects the owner may use, and the
    sweep's base keeps the ids; a name no object of theirs has is refused with where to look."""
    with pytest.raises(ValidationError) as err:
        _sweep(user, digits_dataset, cnn_model, local_backend,
               base={"dataset": "mnist", "model_spec": cnn_model.name, "backend": local_backend.name})
    assert err.value.message_dict == {"base.dataset": [
        "No dataset named 'mnist' that you can use: GET /api/datasets/ lists yours (give its name or id)."]}
    assert Sweep.objects.count() == 0 and TrainingJob.objects.count() == 0
    with django_capture_on_commit_callbacks():
        sweep = _sweep(user, digits_dataset, cnn_model, local_backend,
                       base={"dataset": digits_dataset.name, "model_spec": cnn_model.name,
                             "backend": local_backend.name})
    assert (sweep.dataset, sweep.model_spec, sweep.backend) == (digits_dataset, cnn_model, local_backend)
    assert (sweep.base["dataset"], sweep.base["model_spec"], sweep.base["backend"]) == (
        digits_dataset.pk, cnn_model.pk, local_backend.pk)


def test_a_script_sweep_takes_only_the_keys_its_script_receives(user, digits_dataset, local_backend, code_store):
    from codekit import MODEL_FILES, upload, zip_bytes
    from jobs import services

    script = services.model_spec_create(owner=user, name="my-loop", kind="script", code=upload(zip_bytes(MODEL_FILES)),
                                        entry_point="train.py", script_args="--lr {train.lr}")
    with pytest.raises(ValidationError) as exc:
        _sweep(user, digits_dataset, script, local_backend, search_space={
            "train.lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True},  # received: kept
            "model.params.hidden": {"type": "int", "low": 8, "high": 32},
            "data.val_fraction": {"type": "categorical", "choices": [0.1, 0.2]},
            "parallel.strategy": {"type": "categorical", "choices": ["ddp", "fsdp"]},
            "train.init_mode": {"type": "categorical", "choices": ["finetune"]}}, sampler="random")
    messages = exc.value.message_dict["search_space"]
    assert [m.split(":", 1)[0] for m in messages] == [
        "Search space 'model.params.hidden'", "Search space 'data.val_fraction'", "Search space 'parallel.strategy'",
        "Search space 'train.init_mode'"]
    assert messages[1] == (
        "Search space 'data.val_fraction': model my-loop is a script, which receives only its job's train values "
        "(TRAINBOARD_HPARAMS, report.hparams(), {train.<field>} in its arguments): data.val_fraction would reach no "
        "trial's script, and the trials would run alike. Vary a train field your script reads instead: train.epochs, "
        "train.batch_size, train.lr, train.optimizer, … (docs/user-code.md).")
    assert not Sweep.objects.exists()
    sweep = _sweep(user, digits_dataset, script, local_backend, search_space={
        "train.lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True},
        "train.momentum": {"type": "categorical", "choices": [0.0, 0.9]}}, sampler="random")
    assert sweep.state == Sweep.State.RUNNING


def test_epoch_values_read_back_from_the_last_step_to_the_epochs_already_reported(user, digits_dataset, cnn_model,
                                                                                 local_backend):
    """A step-level objective: the last global value of each epoch; ``after`` stops the read at the
    epochs a pass reported, so a pass over a long run reads only the points since (a point of an
    earlier epoch edited in place is not seen again: the read stopped before it)."""
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend, objective_metric="train_loss",
                   direction="minimize")
    sweeps.sweep_fill(sweep_id=sweep.pk)
    job = _trial_jobs(sweep)[0]
    now = timezone.now()
    points = [MetricPoint(job=job, name="train_loss", step=step, epoch=(step - 1) // 100, value=1000.0 / step,
                          recorded_at=now) for step in range(1, 1001)]  # 10 epochs of 100 steps
    points += [MetricPoint(job=job, name="train_loss", step=step, epoch=(step - 1) // 100, rank=1, value=-1.0,
                           recorded_at=now) for step in range(1, 1001, 7)]  # a rank's own: not global
    MetricPoint.objects.bulk_create(points)
    everything = sweeps._epoch_values(sweep, job)
    assert list(everything) == list(range(1, 11))
    assert everything == {e: pytest.approx(1000.0 / (e * 100)) for e in range(1, 11)}
    assert sweeps._epoch_values(sweep, job, after=8) == {9: pytest.approx(1000.0 / 900), 10: pytest.approx(1.0)}
    assert sweeps._epoch_values(sweep, job, after=10) == {}
    # Bounded: with epoch 1's rows gone from reach (their epoch changed to one past every report), a
    # read after epoch 8 still ends at epoch 9's first point and never meets them.
    MetricPoint.objects.filter(job=job, step__lte=100, rank__isnull=True).update(epoch=99)
    assert sweeps._epoch_values(sweep, job, after=8) == {9: pytest.approx(1000.0 / 900), 10: pytest.approx(1.0)}
    assert 100 in sweeps._epoch_values(sweep, job)  # the whole read meets them
