"""A job request's errors come in one answer (the project's rule): a field the trainer refuses (CPU
offload on ddp, a clone's checkpoint format) does not hide the checks of the fields that did not fail
(the batch against the dataset, the backend's shape, the next config fields), at the API, the job
form and the clone."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from jobs import services
from jobs.models import TrainingJob

pytestmark = pytest.mark.django_db

CPU_OFFLOAD_ON_DDP = ("CPU offload: CPU offload keeps FSDP's parameter, gradient and optimizer shards in CPU memory; "
                      "strategy ddp has no shards: set parallel.strategy to fsdp, or turn parallel.cpu_offload off")
BATCH_PAST_DIGITS = ("Batch size 100,000 × 64 data-parallel ranks = 6,400,000 samples per step exceeds the 1,438 "
                     "training samples of dataset digits (1,797 less 359 held out for validation, data.val_fraction "
                     "0.2): each epoch would be one smaller batch per rank; use a batch size of at most 22 or fewer "
                     "ranks.")
TOO_MANY_PROCS = ("1 node × 64 processes = 64 ranks, but this GPU box runs at most 2 processes per node "
                  "(max_procs_per_node); ask for 2 or fewer.")


def test_api_reports_cpu_offload_batch_and_shape_in_one_answer(api_client, digits_dataset, cnn_model, local_backend,
                                                               no_celery_publish):
    response = api_client.post("/api/jobs/", {
        "dataset": "digits", "model_spec": "digits-cnn", "backend": "local", "procs_per_node": 64,
        "batch_size": 100_000, "cpu_offload": True}, format="json")
    assert response.status_code == 400
    # The memory plan is left out: it was worked out with CPU offload's stand-in (off), of another job.
    assert response.json() == {"cpu_offload": [CPU_OFFLOAD_ON_DDP], "batch_size": [BATCH_PAST_DIGITS],
                               "procs_per_node": [TOO_MANY_PROCS]}
    assert TrainingJob.objects.count() == 0
    no_celery_publish["submit"].assert_not_called()


def test_the_job_form_reports_the_same_three(owner_client, digits_dataset, cnn_model, local_backend):
    response = owner_client.post(reverse("job-create"), {
        "name": "", "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
        "strategy": "ddp", "nodes": 1, "procs_per_node": 64, "epochs": 1, "batch_size": 100_000, "lr": 0.05,
        "seed": 0, "max_runtime_s": 3600, "budget_usd": "", "instance_type": "", "hyperparameters": "",
        "cpu_offload": "on"})
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert (errors["cpu_offload"], errors["batch_size"], errors["procs_per_node"]) == (
        [CPU_OFFLOAD_ON_DDP], [BATCH_PAST_DIGITS], [TOO_MANY_PROCS])
    assert TrainingJob.objects.count() == 0


def test_a_batch_worked_out_from_a_failed_field_is_still_dropped(user, digits_dataset, cnn_model, local_backend):
    """The batch's arithmetic on a stand-in (processes per node past the maximum: 1,024) is of another job."""
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_check(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend,
                                    procs_per_node=5000, batch_size=100_000)
    errors = excinfo.value.message_dict
    assert errors == {"procs_per_node": ["Processes per node must be at most 1,024, got 5,000."]}


def test_clone_reports_every_config_field_with_the_others(api_client, user, digits_dataset, cnn_model, local_backend):
    source = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                          backend=local_backend, nodes=1, procs_per_node=2, epochs=1, batch_size=16)
    response = api_client.post(f"/api/jobs/{source.pk}/clone/", {
        "cpu_offload": "x", "max_steps": -1, "seq_len": -2, "checkpoint_format": "no", "lerning_rate": 3,
        "epochs": 0}, format="json")
    assert response.status_code == 400
    assert response.json() == {
        "lerning_rate": ["Unknown field 'lerning_rate'. Did you mean 'lr'?"],
        "cpu_offload": ["Cpu offload must be true or false."],
        "epochs": ["Epochs must be at least 1, got 0."],
        "checkpoint_format": ["Checkpoint format: must be one of 'full', 'sharded', got 'no'"],
        "max_steps": ["Max steps: must be 0 (all epochs) or more, got -1"],
        "seq_len": ["Sequence length: must be 0 (the model's context length) or more, got -2"],
    }
    assert TrainingJob.objects.count() == 1


# --- seq_len where nothing reads it ----------------------------------------------------------------

SEQ_LEN_ON_BUILTIN = ("Sequence length: token datasets only: this job reads builtin data, whose samples are not "
                      "windows of tokens, so 128 would be ignored; leave it blank (0)")


def test_seq_len_on_a_dataset_not_of_tokens_is_refused_on_its_field(api_client, digits_dataset, cnn_model,
                                                                    local_backend, no_celery_publish):
    body = {"dataset": "digits", "model_spec": "digits-cnn", "backend": "local", "procs_per_node": 2}
    response = api_client.post("/api/jobs/", {**body, "seq_len": 128}, format="json")
    assert response.status_code == 400
    assert response.json() == {"seq_len": [SEQ_LEN_ON_BUILTIN]}
    in_overrides = api_client.post("/api/jobs/", {**body, "hyperparameters": {"data": {"seq_len": 128}}}, format="json")
    assert in_overrides.status_code == 400
    assert in_overrides.json() == {"hyperparameters": [
        "data.seq_len: token datasets only: this job reads builtin data, whose samples are not windows of tokens, so "
        "128 would be ignored; leave it blank (0)"]}
    assert TrainingJob.objects.count() == 0
    # 0 (blank) is the config's default: no window length, nothing to refuse.
    created = api_client.post("/api/jobs/", {**body, "seq_len": 0}, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["config"]["data"]["seq_len"] == 0


def test_seq_len_of_a_script_model_is_refused(user, local_backend, settings, tmp_path):
    from codekit import MODEL_FILES, upload, zip_bytes

    settings.TRAINBOARD_CODE_STORE = tmp_path / "store"
    script = services.model_spec_create(owner=user, name="my-script", kind="script", entry_point="train.py",
                                        code=upload(zip_bytes(MODEL_FILES)))
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_check(owner=user, model_spec=script, backend=local_backend, seq_len=64)
    assert excinfo.value.message_dict == {"seq_len": [
        "Sequence length: token datasets of our trainer only: a script model reads its own data and is not passed "
        "data.seq_len, so 64 would be ignored; leave it blank (0), or give the length in the model's script "
        "arguments"]}
    assert services.training_job_check(owner=user, model_spec=script, backend=local_backend).config.data.seq_len == 0


# --- a field given twice: at top level and in the hyperparameters -------------------------------------


def test_a_field_and_its_hyperparameter_with_different_values_are_refused_naming_both(
        api_client, digits_dataset, cnn_model, local_backend, no_celery_publish):
    body = {"dataset": "digits", "model_spec": "digits-cnn", "backend": "local", "procs_per_node": 2}
    response = api_client.post("/api/jobs/", {**body, "max_steps": 5, "lr": 0.1, "hyperparameters": {
        "train": {"max_steps": 10, "lr": 0.2}}}, format="json")
    assert response.status_code == 400
    assert response.json() == {"hyperparameters": [
        "Hyperparameters set train.lr to 0.2, but Learning rate (lr) is 0.1: give it in one place, the field or the "
        "hyperparameters.",
        "Hyperparameters set train.max_steps to 10, but Max steps (max_steps) is 5: give it in one place, the field "
        "or the hyperparameters."]}
    assert TrainingJob.objects.count() == 0
    # The same value twice says one thing; a field left at its default leaves the override to it.
    same = api_client.post("/api/jobs/", {**body, "max_steps": 5, "hyperparameters": {"train": {"max_steps": 5}}},
                           format="json")
    assert same.status_code == 201, same.json()
    assert same.json()["config"]["train"]["max_steps"] == 5
    only = api_client.post("/api/jobs/", {**body, "hyperparameters": {"train": {"max_steps": 10, "lr": 0.2}}},
                           format="json")
    assert only.status_code == 201, only.json()
    assert (only.json()["config"]["train"]["max_steps"], only.json()["config"]["train"]["lr"]) == (10, 0.2)


def test_a_clone_overriding_a_field_in_its_hyperparameters_takes_it_and_both_given_differing_is_refused(
        api_client, user, digits_dataset, cnn_model, local_backend):
    source = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                          backend=local_backend, nodes=1, procs_per_node=2, epochs=1, batch_size=16,
                                          lr=0.02)
    taken = api_client.post(f"/api/jobs/{source.pk}/clone/", {"hyperparameters": {"train": {"lr": 0.01}}},
                            format="json")
    assert taken.status_code == 201, taken.json()
    assert taken.json()["config"]["train"]["lr"] == 0.01
    both = api_client.post(f"/api/jobs/{source.pk}/clone/", {"lr": 0.03, "hyperparameters": {"train": {"lr": 0.01}}},
                           format="json")
    assert both.status_code == 400
    assert both.json() == {"hyperparameters": [
        "Hyperparameters set train.lr to 0.01, but Learning rate (lr) is 0.03: give it in one place, the field or "
        "the hyperparameters."]}
    assert TrainingJob.objects.count() == 2


def test_a_sweep_trials_value_at_a_fields_path_replaces_the_base_field_and_its_job_takes_it(
        user, digits_dataset, cnn_model, local_backend):
    from jobs.sweeps import trial_payload

    base = {"dataset": digits_dataset, "model_spec": cnn_model, "backend": local_backend, "procs_per_node": 2,
            "lr": 0.02, "max_steps": 4, "hyperparameters": {"train": {"optimizer": "adamw"}}}
    payload = trial_payload(base, {"train.lr": 0.3, "train.weight_decay": 0.1})
    assert (payload["lr"], payload["max_steps"], payload["hyperparameters"]) == (
        0.05, 4, {"train": {"optimizer": "adamw", "lr": 0.3, "weight_decay": 0.1}})
    train = services.training_job_check(owner=user, **payload).config.train
    assert (train.lr, train.max_steps, train.weight_decay, train.optimizer) == (0.3, 4, 0.1, "adamw")
