"""End to end: a user's *script* gets each job's values and starting point (docs/user-code.md), through
the model form, the sweep and clone services, a real Celery worker with embedded beat (Redis,
PostgreSQL: sweeps need it) and the GPU box running the real launcher, one process per job (no torch
training: the script computes its metric from the lr it received).

- A 4-trial grid sweep over ``train.lr`` of a script registered through the model form, its arguments
  typed on one line with a placeholder (``--epochs 2 --lr {train.lr}``): each trial's script gets 4
  argv entries carrying its own lr, and the same lr in ``report.hparams()``; its own metric (the
  objective) differs per trial, and the best trial is the one whose lr scores best.
- A fine-tune of a script job: the new job's script gets the source's ``model.pt`` (as the source's
  script saved it) in ``TRAINBOARD_INIT_FROM``, with ``TRAINBOARD_INIT_MODE`` finetune, and loads it;
  both jobs run without a dataset (a script may read its own data).

One worker serves the module (its start is most of a short job's time).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse

from codekit import upload, zip_bytes
from jobs import services, sweeps
from jobs.models import JobStateChoices as S, MetricPoint, ModelSpec, Sweep, TrainingJob

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LRS = [0.0001, 0.001, 0.01, 0.1]

# Score −|log10(lr) + 1.8|: −2.2, −1.2, −0.2, −0.8 for LRS, so the best is lr 0.01 and every trial's differs.
SWEEP_SCRIPT = '''\
import argparse, math, sys
from trainer_pkg import report

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, required=True)
p.add_argument("--lr", type=float, required=True)
args = p.parse_args()
score = -abs(math.log10(args.lr) + 1.8)
for step in range(1, args.epochs + 1):
    report.log(step=step, score=score, lr_arg=args.lr, lr_hparam=report.hparams()["train.lr"],
               argc=len(sys.argv) - 1)
'''

# Saves weights derived from its lr; started from another job's file, reports what it loaded.
WEIGHTS_SCRIPT = '''\
import os
import torch
from trainer_pkg import report

lr = report.hparams()["train.lr"]
metrics = {"saved_w": 100 * lr}
if report.init_from() is not None:
    loaded = torch.load(report.init_from(), weights_only=True)
    metrics.update(loaded_w=float(loaded["w"][0]), finetune=float(report.init_mode() == "finetune"))
torch.save({"w": torch.tensor([100 * lr])}, os.path.join(report.model_dir(), "model.pt"))
report.log(step=1, **metrics)
'''


@dataclasses.dataclass
class Box:
    worker: object  # tests/conftest.py's WorkerProcess
    run_root: Path
    code_store: Path


@pytest.fixture(scope="module")
def box(tmp_path_factory, django_db_setup, django_db_blocker, celery_worker_factory):
    """A GPU box "local" (2 slots) with one Celery worker for the module, its own run root and code store."""
    root = tmp_path_factory.mktemp("script-values-box")
    run_root, code_store = root / "runs", root / "code-store"
    run_root.mkdir()
    extra = {"TRAINBOARD_CODE_STORE": str(code_store), "TRAINBOARD_GPUBOX_SLOTS": "2"}
    with django_db_blocker.unblock():
        running = celery_worker_factory(root, run_root, extra)  # queues: celery and gpubox.local
        worker = running.__enter__()
    try:
        yield Box(worker=worker, run_root=run_root, code_store=code_store)
    finally:
        with django_db_blocker.unblock():
            running.__exit__(None, None, None)


@pytest.fixture
def box_backend(box, user, settings):
    settings.TRAINBOARD_RUN_ROOT = box.run_root
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2
    settings.TRAINBOARD_CODE_STORE = box.code_store
    settings.TRAINBOARD_GPUBOX_SLOTS = 2
    return services.backend_create(owner=user, name="local", kind="gpubox",
                                   config={"hourly_rate_usd": 3.6, "grace_period_s": 3.0})


def _last(job: TrainingJob, name: str) -> float | None:
    return (MetricPoint.objects.filter(job=job, name=name, rank__isnull=True).order_by("-step")
            .values_list("value", flat=True).first())


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def test_a_four_trial_script_sweep_hands_each_trial_its_lr_and_finds_the_best(box, box_backend, user,
                                                                               digits_dataset):
    started = time.monotonic()
    web = Client()
    web.force_login(user)
    created = web.post(reverse("model-create"), {
        "name": "lr-script", "kind": "script", "entry_point": "train.py",
        "code": upload(zip_bytes({"train.py": SWEEP_SCRIPT.encode()}), "script.zip"),
        "script_args": "--epochs 2 --lr {train.lr}"})  # typed on one line, as a person would
    assert created.status_code == 302, created.context["form"].errors
    model = ModelSpec.objects.get(name="lr-script")
    assert model.script_args == ["--epochs", "2", "--lr", "{train.lr}"]

    sweep = sweeps.sweep_create(
        owner=user, name="script-lr", sampler="grid", seed=0,
        search_space={"train.lr": {"type": "categorical", "choices": LRS}},
        base={"dataset": digits_dataset.pk, "model_spec": model.pk, "backend": box_backend.pk, "epochs": 1,
              "procs_per_node": 1, "max_runtime_s": 300},
        objective_metric="score", direction="maximize", max_trials=4, max_concurrent_trials=2)
    done = box.worker.wait_for(lambda: (s := Sweep.objects.get(pk=sweep.pk)).is_terminal and s, timeout=600,
                               what="the script sweep to end")
    jobs = list(TrainingJob.objects.filter(sweep=sweep).order_by("trial_number"))
    assert done.state == Sweep.State.SUCCEEDED, (done.message, done.trial_errors, box.worker.log()[-3000:])

    trials = sweeps.sweep_trials(sweep=done)
    assert [t["state"] for t in trials] == ["COMPLETE"] * 4
    assert sorted(t["params"]["train.lr"] for t in trials) == LRS  # the grid: each lr once
    for trial, job in zip(trials, jobs):
        lr = trial["params"]["train.lr"]
        assert job.state == S.SUCCEEDED, job.failure_reason
        assert _last(job, "argc") == 4.0  # --epochs 2 --lr <its lr>: four arguments, not one
        assert _last(job, "lr_arg") == pytest.approx(lr)  # the placeholder became the trial's value
        assert _last(job, "lr_hparam") == pytest.approx(lr)  # and report.hparams() holds it
        assert trial["value"] == pytest.approx(-abs(math.log10(lr) + 1.8))
    values = [t["value"] for t in trials]
    assert len(set(values)) == 4  # the trials did not run alike
    best = sweeps.best_trial(done, trials)
    assert best["params"]["train.lr"] == 0.01 and best["value"] == max(values)
    print(f"\n[e2e script sweep] 4 trials in {time.monotonic() - started:.1f} s")


def test_a_fine_tuned_script_job_loads_the_weights_its_source_saved(box, box_backend, user):
    model = services.model_spec_create(owner=user, name="weights", kind="script", entry_point="train.py",
                                       code=upload(zip_bytes({"train.py": WEIGHTS_SCRIPT.encode()}), "w.zip"))
    # No dataset: the script reads none (a script job needs none), and the fine-tune keeps that.
    source = services.training_job_create(owner=user, dataset=None, model_spec=model,
                                          backend=box_backend, procs_per_node=1, epochs=1, lr=0.03)
    source = box.worker.wait_for(lambda: (j := _reload(source)).is_terminal and j, timeout=240,
                                 what="the source job to end")
    assert source.state == S.SUCCEEDED, (source.failure_reason, box.worker.log()[-3000:])
    assert _last(source, "saved_w") == pytest.approx(3.0) and _last(source, "loaded_w") is None

    tuned = services.training_job_clone(owner=user, job=source, overrides={"init_mode": "finetune", "lr": 0.05})
    saved = box.run_root / source.provider_job_name / "output" / "model.pt"
    assert tuned.config["train"]["init_from"] == str(saved)
    tuned = box.worker.wait_for(lambda: (j := _reload(tuned)).is_terminal and j, timeout=240,
                                what="the fine-tuned job to end")
    assert tuned.state == S.SUCCEEDED, (tuned.failure_reason, box.worker.log()[-3000:])
    assert _last(tuned, "loaded_w") == pytest.approx(3.0)  # the source's weights, not its own fresh ones
    assert _last(tuned, "finetune") == 1.0 and _last(tuned, "saved_w") == pytest.approx(5.0)
    assert tuned.lineage_text == f"fine-tuned from #{source.pk}"
    assert (source.dataset, tuned.dataset) == (None, None)
