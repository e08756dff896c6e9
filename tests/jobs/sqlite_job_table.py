"""Run by tests/jobs/test_experiment_table_sqlite.py in a process of its own, on a fresh SQLite
database (the demo's engine): migrates, stores the jobs of test_experiment_table's ``table``, and
prints, as one JSON object, the job names each sort key and tag filter gives."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
os.environ["DATABASE_URL"] = f"sqlite:///{sys.argv[1]}"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from jobs import selectors, services  # noqa: E402
from jobs.models import ComputeBackend, Dataset, ModelSpec, TrainingJob  # noqa: E402

call_command("migrate", verbosity=0)
user = get_user_model().objects.create_user(username="alice", password="pw-alice-123")
dataset = Dataset.objects.create(owner=user, name="digits", format="builtin", builtin_name="digits")
model = ModelSpec.objects.create(owner=user, name="cnn", architecture="cnn", params={})
backend = ComputeBackend.objects.create(owner=user, name="local", kind="gpubox", config={})
rows = [
    ("high", {"val_accuracy": 0.9, "val_loss": 0.3}, {"train": {"lr": 0.1, "batch_size": 64}}),
    ("low", {"val_accuracy": 0.5, "val_loss": 1.2}, {"train": {"lr": 0.01, "batch_size": 16}}),
    ("mid", {"val_accuracy": 0.75, "val_loss": 0.7}, {"train": {"lr": 0.05}, "model": {"params": {"hidden": 128}}}),
    ("diverged", {"val_accuracy": None, "val_loss": None}, {"model": {"params": {"hidden": 64}}}),
    ("silent", {}, {"train": {"lr": 0.2, "batch_size": 32}}),
]
jobs = {name: TrainingJob.objects.create(owner=user, dataset=dataset, model_spec=model, backend=backend, name=name,
                                         state="SUCCEEDED", final_metrics=metrics, config=config)
        for name, metrics, config in rows}
services.training_job_annotate(job=jobs["high"], tags=["baseline", "resnet"])
services.training_job_annotate(job=jobs["low"], tags=["baseline"])
services.training_job_annotate(job=jobs["mid"], tags=["baseline-2"])


def names(**kwargs):
    return [job.name for job in selectors.training_job_list_for_user(user=user, **kwargs)]


print(json.dumps({
    "vendor": connection.vendor,
    "-val_accuracy": names(sort="-val_accuracy"), "val_accuracy": names(sort="val_accuracy"),
    "train.lr": names(sort="train.lr"), "-train.lr": names(sort="-train.lr"),
    "-model.params.hidden": names(sort="-model.params.hidden"),
    "tag=baseline": names(tag="baseline", sort="name"), "tag=resnet": names(tag="resnet"),
}))
