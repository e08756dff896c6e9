"""Stored jobs for the experiment table's tests (docs/experiments.md): rows as a sync leaves them,
without a submission."""

from __future__ import annotations

from jobs.models import TrainingJob


def make_job(owner, dataset, model_spec, backend, *, name, final_metrics=None, config=None, state="SUCCEEDED",
             **fields) -> TrainingJob:
    """A job row in ``state`` with ``final_metrics`` and frozen ``config`` (default: lr 0.05, batch 32)."""
    return TrainingJob.objects.create(
        owner=owner, dataset=dataset, model_spec=model_spec, backend=backend, name=name, state=state,
        config=config if config is not None else {"train": {"lr": 0.05, "batch_size": 32}},
        final_metrics=final_metrics or {}, **fields)
