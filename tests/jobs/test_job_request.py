"""``jobs.job_request``: one declaration of a job request, its config fields' metadata read from the
trainer's config; ``training_job_check`` checks a request without writing; ``submit_job`` takes every
field of it (the large-model and pipeline settings it lacked: issue 31)."""

from __future__ import annotations

import io

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command

from jobs import dispatch, services
from jobs.job_request import CONFIG_FIELDS, JOB_REQUEST, config_sections, request_field
from jobs.models import JobEvent, TrainingJob
from taskkit import sent_tasks
from trainer_pkg.config import config_fields


def test_every_config_field_of_the_request_takes_the_trainers_metadata():
    lr, epochs, ac = request_field("lr"), request_field("epochs"), request_field("activation_checkpointing")
    assert (lr.kind, lr.label, lr.help, lr.default, lr.config) == ("float", "Learning rate", "Peak learning rate.",
                                                                   0.05, "train.lr")
    assert (epochs.default, epochs.minimum, epochs.maximum, epochs.help) == (3, 1, 100_000,
                                                                             "Passes over the training data.")
    assert (ac.kind, ac.optional, ac.default, ac.config) == ("bool", True, None, "parallel.activation_checkpointing")
    assert request_field("checkpoint_format").choices == ("full", "sharded")
    assert request_field("strategy").choices == ("ddp", "fsdp", "pipeline")
    for field in JOB_REQUEST:
        if field.config:
            info = config_fields()[field.config]
            assert (field.choices, field.minimum) == (info.choices, info.minimum), field.name
            assert field.default == (None if field.optional else info.default), field.name
    assert [f.name for f in JOB_REQUEST if f.config] == list(CONFIG_FIELDS)
    assert config_sections({"lr": 0.1, "seq_len": None, "checkpoint_format": "", "max_steps": 0, "name": "x"}) == {
        "train": {"lr": 0.1, "max_steps": 0}}


pytestmark_db = pytest.mark.django_db


@pytestmark_db
def test_training_job_check_returns_the_checked_job_and_writes_nothing(user, digits_dataset, cnn_model,
                                                                       local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        checked = services.training_job_check(
            owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend, procs_per_node=2,
            epochs=2, lr=0.01, activation_checkpointing=True, max_steps=9, max_runtime_s=1800)
    assert (checked.config.train.epochs, checked.config.train.lr, checked.config.train.max_steps) == (2, 0.01, 9)
    assert checked.config.parallel.activation_checkpointing is True and checked.config.parallel.procs_per_node == 2
    assert str(checked.hourly_price) == "3.600000"  # the local backend's $3.60 per node-hour
    assert str(checked.estimated_cost_usd) == "1.8000"  # 1800 s × 1 node × $3.60/h
    # The GPU box has no GPUs here: the plan is per rank against the host's memory limit, and fits.
    assert (checked.memory_plan.fits, checked.memory_plan.device_unit, checked.memory_plan.world_size) == (
        True, "rank", 2)
    assert (TrainingJob.objects.count(), JobEvent.objects.count()) == (0, 0)
    send.assert_not_called()
    # Create = check + store: the same config is frozen on the row.
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(
            owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend, procs_per_node=2,
            epochs=2, lr=0.01, activation_checkpointing=True, max_steps=9, max_runtime_s=1800)
    assert job.config == checked.config.to_dict() and job.estimated_cost_usd == checked.estimated_cost_usd


@pytestmark_db
def test_training_job_check_reports_every_error_at_once(user, digits_dataset, cnn_model, local_backend):
    with pytest.raises(ValidationError) as caught:
        services.training_job_check(
            owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend, epochs=0,
            procs_per_node=4, cpu_offload=True, hyperparameters={"train": {"optimizer": "adam", "bogus": 1}})
    errors = caught.value.message_dict
    assert errors["epochs"] == ["Epochs must be at least 1, got 0."]
    assert errors["cpu_offload"][0].startswith("CPU offload: CPU offload keeps FSDP's parameter, gradient and "
                                               "optimizer shards in CPU memory; strategy ddp has no shards")
    assert errors["hyperparameters"] == [
        "train.bogus: unknown field (known: augment, batch_size, compile, epochs, find_unused_parameters, "
        "grad_accum_steps, grad_clip_norm, init_from, init_mode, log_every_s, log_every_steps, lr, lr_schedule, "
        "max_steps, momentum, on_nonfinite_loss, optimizer, precision, seed, stop_check_s, warmup_steps, "
        "weight_decay)",
        "train.optimizer: must be one of 'sgd', 'adamw', got 'adam'"]
    assert "procs_per_node" in errors and "4" in errors["procs_per_node"][0]
    assert TrainingJob.objects.count() == 0
    with pytest.raises(TypeError, match="unexpected keyword argument 'learning_rate'"):
        services.training_job_check(owner=user, model_spec=cnn_model, backend=local_backend, learning_rate=0.1)


def _submit(*args):
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("submit_job", *args, stdout=out, stderr=err)
    except CommandError as exc:
        return exc.returncode, out.getvalue(), err.getvalue() + str(exc)
    return 0, out.getvalue(), err.getvalue()


@pytestmark_db
def test_submit_job_takes_the_large_model_and_pipeline_options(user, digits_dataset, cnn_model, local_backend):
    base = ["--dataset", "digits", "--model", "digits-cnn", "--backend", "local", "--user", "alice",
            "--procs-per-node", "2"]
    with sent_tasks(dispatch.SUBMIT_JOB):
        code, _, err = _submit(*base, "--strategy", "fsdp", "--activation-checkpointing", "--cpu-offload",
                               "--checkpoint-format", "sharded", "--max-steps", "7")
        assert code == 0, err
        config = TrainingJob.objects.get().config
        assert (config["parallel"]["activation_checkpointing"], config["parallel"]["cpu_offload"]) == (True, True)
        assert (config["output"]["checkpoint_format"], config["train"]["max_steps"]) == ("sharded", 7)
        code, _, err = _submit(*base, "--strategy", "pipeline", "--pipeline-stages", "2", "--microbatches", "2",
                               "--pipeline-schedule", "1f1b", "--batch-size", "8")
        assert code == 0, err
        parallel = TrainingJob.objects.latest("pk").config["parallel"]
    assert (parallel["strategy"], parallel["pipeline_stages"], parallel["microbatches"],
            parallel["pipeline_schedule"]) == ("pipeline", 2, 2, "1f1b")
    # Left out, a large-model setting keeps the trainer's default.
    assert (parallel["activation_checkpointing"], parallel["cpu_offload"]) == (False, False)
    # A bad option, a bad override and a backend refusal: one exit 2 with all three.
    code, out, err = _submit(*base[:-1], "4", "--max-steps", "-1", "--hyperparameters",
                             '{"train": {"optimizer": "adam"}}')
    assert (code, out) == (2, "")
    assert "--max-steps: Max steps: must be 0 (all epochs) or more, got -1" in err
    assert "--hyperparameters: train.optimizer: must be one of 'sgd', 'adamw', got 'adam'" in err
    assert "--procs-per-node: " in err
    assert TrainingJob.objects.count() == 2


@pytestmark_db
def test_a_backend_refusal_lands_on_the_field_it_names(user, digits_dataset, cnn_model, local_backend):
    """``InvalidSpec.field`` (the JobSpec field an adapter's check is about) decides the request field,
    not the words of the message."""
    from cloud_adapters.base import InvalidSpec
    from jobs.services.training_jobs import _spec_error_field

    with pytest.raises(ValidationError) as caught:
        services.training_job_check(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend,
                                    spot=True, procs_per_node=3)
    errors = caught.value.message_dict
    assert errors["procs_per_node"] == ["1 node × 3 processes = 3 ranks, but this GPU box runs at most 2 processes "
                                        "per node (max_procs_per_node); ask for 2 or fewer."]
    assert set(errors) == {"procs_per_node"}  # the adapter stops at its first refusal: spot comes next
    with pytest.raises(ValidationError) as caught:
        services.training_job_check(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend,
                                    spot=True)
    assert caught.value.message_dict == {"spot": ["This backend has no spot capacity; untick spot."]}
    # A Kubernetes node pool named in an instance-type refusal once sent it to "nodes" by its words.
    refusal = InvalidSpec("instance type 'big': this backend runs on node pool gpu-a100", field="instance_type")
    assert _spec_error_field(refusal) == "instance_type"
    assert _spec_error_field(InvalidSpec("dataset 'x': SageMaker reads data from S3", field="dataset_uri")) == "dataset"
    assert _spec_error_field(InvalidSpec("2 processes per node requested")) == "procs_per_node"  # untagged: words


@pytestmark_db
def test_a_config_field_added_to_the_request_reaches_the_frozen_config(monkeypatch, user, digits_dataset, cnn_model,
                                                                       local_backend):
    """The service reads the request's config fields by their paths: one more entry in the declaration
    (an existing trainer field, train.warmup_steps) is a keyword the check takes and freezes."""
    from jobs import job_request

    fields = job_request.job_request_fields({**CONFIG_FIELDS, "warmup_steps": "train.warmup_steps"})
    monkeypatch.setattr(job_request, "JOB_REQUEST", fields)
    checked = services.training_job_check(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                          backend=local_backend, warmup_steps=5)
    assert checked.config.train.warmup_steps == 5
    assert request_field("warmup_steps", fields).label == "Warmup steps"
    with pytest.raises(ValidationError) as caught:  # its range is the trainer's, its error on the field
        services.training_job_check(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend,
                                    warmup_steps=-1)
    assert caught.value.message_dict == {"warmup_steps": ["Warmup steps: must be 0 or more, got -1"]}
