"""Issue 27 item 9: a batch larger than the dataset is refused at create with the numbers, where the
dataset's size is known (counted when it was saved); the form, the API and ``submit_job`` share the
service's check. Where it is not known the trainer says in the job's log what it used
(tests/trainer_pkg/test_small_batch_note.py)."""

from __future__ import annotations

import numpy as np
import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from jobs import services
from jobs.models import Dataset, TrainingJob

pytestmark = pytest.mark.django_db

DIGITS_TOO_BIG = ("Batch size 100,000 × 2 data-parallel ranks = 200,000 samples per step exceeds the 1,438 training "
                  "samples of dataset digits (1,797 less 359 held out for validation, data.val_fraction 0.2): each "
                  "epoch would be one smaller batch per rank; use a batch size of at most 719 or fewer ranks.")


def create(user, dataset, model, backend, **kw) -> TrainingJob:
    return services.training_job_create(**{"owner": user, "dataset": dataset, "model_spec": model,
                                           "backend": backend, "nodes": 1, "procs_per_node": 2, "epochs": 1, **kw})


def refused(*args, **kw) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as excinfo:
        create(*args, **kw)
    assert TrainingJob.objects.count() == 0
    return excinfo.value.message_dict


def test_digits_records_its_size_and_a_batch_past_it_is_refused_with_the_arithmetic(user, digits_dataset, cnn_model,
                                                                                     local_backend):
    assert (digits_dataset.num_samples, digits_dataset.val_samples) == (1797, None)
    assert refused(user, digits_dataset, cnn_model, local_backend, batch_size=100_000) == {"batch_size": [DIGITS_TOO_BIG]}
    # The boundary: 719 × 2 = 1,438 is every training sample once a step; 720 × 2 is not.
    assert "at most 719" in refused(user, digits_dataset, cnn_model, local_backend, batch_size=720)["batch_size"][0]
    assert create(user, digits_dataset, cnn_model, local_backend, batch_size=719).config["train"]["batch_size"] == 719


def test_the_overrides_count_where_they_set_the_batch_or_the_split(user, digits_dataset, cnn_model, local_backend):
    errors = refused(user, digits_dataset, cnn_model, local_backend, hyperparameters={"train": {"batch_size": 5000}})
    assert list(errors) == ["hyperparameters"] and errors["hyperparameters"][0].startswith(
        "Batch size 5,000 × 2 data-parallel ranks = 10,000 samples per step exceeds the 1,438 training samples")
    # Half held out: 1,797 − 898 = 899 training samples; 500 × 2 is more.
    errors = refused(user, digits_dataset, cnn_model, local_backend, batch_size=500,
                     hyperparameters={"data": {"val_fraction": 0.5}})
    assert errors["batch_size"][0].startswith("Batch size 500 × 2 data-parallel ranks = 1,000 samples per step exceeds "
                                              "the 899 training samples of dataset digits (1,797 less 898 held out")
    # A pipeline of 2 stages on 2 ranks is one data-parallel replica: 1,000 fits.
    job = create(user, digits_dataset, cnn_model, local_backend, batch_size=1000, strategy="pipeline",
                 hyperparameters={"parallel": {"microbatches": 2}})
    assert job.config["train"]["batch_size"] == 1000


def test_a_dataset_with_its_own_validation_split_counts_its_train_part(user, cnn_model, local_backend, tmp_path,
                                                                      settings):
    settings.TRAINBOARD_DATASET_ROOTS = [str(tmp_path)]
    path = tmp_path / "split.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.random((30, 1, 8, 8), dtype=np.float32), y_train=np.arange(30) % 10,
             x_val=rng.random((10, 1, 8, 8), dtype=np.float32), y_val=np.arange(10))
    dataset = services.dataset_create(owner=user, name="split", format="npz", uri=str(path))
    assert (dataset.num_samples, dataset.val_samples) == (40, 10)
    assert refused(user, dataset, cnn_model, local_backend, batch_size=16) == {"batch_size": [
        "Batch size 16 × 2 data-parallel ranks = 32 samples per step exceeds the 30 training samples of dataset split "
        "(40 less its 10 validation samples): each epoch would be one smaller batch per rank; use a batch size of at "
        "most 15 or fewer ranks."]}
    assert create(user, dataset, cnn_model, local_backend, batch_size=15).pk


def test_a_dataset_whose_size_is_not_known_is_not_refused(user, digits_dataset, cnn_model, local_backend):
    Dataset.objects.filter(pk=digits_dataset.pk).update(num_samples=None)  # as a cloud URI's: not counted
    digits_dataset.refresh_from_db()
    assert create(user, digits_dataset, cnn_model, local_backend, batch_size=100_000).pk


def test_the_api_and_the_cli_give_the_same_refusal(user, digits_dataset, cnn_model, local_backend):
    api = APIClient()
    api.force_authenticate(user)
    response = api.post("/api/jobs/", {"dataset": digits_dataset.pk, "model_spec": cnn_model.pk,
                                       "backend": local_backend.pk, "procs_per_node": 2, "batch_size": 100_000},
                        format="json")
    assert response.status_code == 400
    assert response.json() == {"batch_size": [DIGITS_TOO_BIG]}
    with pytest.raises(CommandError) as exit_:
        call_command("submit_job", "--user", user.username, "--dataset", "digits", "--model", "digits-cnn",
                     "--backend", "local", "--procs-per-node", "2", "--batch-size", "100000")
    assert exit_.value.returncode == 2
    assert f"--batch-size: {DIGITS_TOO_BIG}" in str(exit_.value)
    assert TrainingJob.objects.count() == 0
