"""jobs/services/training_jobs.py: create (field keys, nothing written, enqueue after commit), estimate,
re-run and cancel."""

import json
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import transaction

from jobs import dispatch, services
from jobs.models import JobEvent, JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db


def _create(user, dataset, model, backend, **kw):
    args = dict(owner=user, dataset=dataset, model_spec=model, backend=backend, nodes=1,
                procs_per_node=2, epochs=3)
    args.update(kw)
    return services.training_job_create(**args)


def _errors(excinfo) -> dict:
    return excinfo.value.message_dict



# --- create: validation --------------------------------------------------------------------


@pytest.mark.parametrize("field,value,needle", [
    ("nodes", 0, "at least 1"),
    ("nodes", -2, "at least 1"),
    ("procs_per_node", 0, "at least 1"),
    ("procs_per_node", -1, "at least 1"),
    ("epochs", 0, "at least 1"),
    ("epochs", -5, "at least 1"),
    ("batch_size", 0, "at least 1"),
    ("lr", 0, "greater than 0"),
    ("lr", "fast", "number"),
    ("max_runtime_s", 0, "at least 1"),
    ("budget_usd", "-1", "more than $0"),
    ("hyperparameters", "{not json", "not valid JSON"),
    ("hyperparameters", "[1, 2]", "JSON object"),
    ("hyperparameters", {"train": {"optimizer": "rmsprop"}}, "train.optimizer"),
    ("hyperparameters", {"train": {"bogus": 1}}, "bogus"),
    ("hyperparameters", {"parallel": {"cpu_offload": True}}, "strategy ddp has no shards: set parallel.strategy to fsdp"),
    ("procs_per_node", 3, "at most 2"),  # the backend allows 2 per node
    ("nodes", 2, "node"),
    ("strategy", "zero3", "zero3"),
])
def test_create_rejects_bad_input_with_field_errors_and_writes_nothing(
        user, digits_dataset, cnn_model, local_backend, field, value, needle):
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        with pytest.raises(ValidationError) as excinfo:
            _create(user, digits_dataset, cnn_model, local_backend, **{field: value})
    errors = _errors(excinfo)
    assert field in errors, errors
    assert any(needle in m for m in errors[field]), errors
    assert TrainingJob.objects.count() == 0
    assert JobEvent.objects.count() == 0
    send.assert_not_called()


def test_create_reports_several_fields_at_once(user, digits_dataset, cnn_model, local_backend):
    with pytest.raises(ValidationError) as excinfo:
        _create(user, digits_dataset, cnn_model, local_backend, nodes=0, procs_per_node=-1, epochs=0)
    assert {"nodes", "procs_per_node", "epochs"} <= set(_errors(excinfo))
    assert TrainingJob.objects.count() == 0


@pytest.mark.parametrize("override, needle", [
    ({"train": {"optimizer": "rmsprop"}}, "train.optimizer"),  # the trainer's schema refuses it
    ({"parallel": {"cpu_offload": True}}, "strategy ddp has no shards"),  # a job rule refuses it
])
def test_a_bad_field_a_bad_override_and_the_backends_limit_are_reported_together(
        user, digits_dataset, cnn_model, local_backend, override, needle):
    # The field's stand-in (1 epoch) lets the trainer config be checked on the same call, and the
    # config without the refused overrides lets the backend check the shape.
    with pytest.raises(ValidationError) as excinfo:
        _create(user, digits_dataset, cnn_model, local_backend, epochs=0, procs_per_node=3,
                hyperparameters=override)
    errors = _errors(excinfo)
    assert set(errors) == {"epochs", "hyperparameters", "procs_per_node"}, errors
    assert errors["epochs"] == ["Epochs must be at least 1, got 0."]
    assert len(errors["hyperparameters"]) == 1 and needle in errors["hyperparameters"][0]
    assert "at most 2" in errors["procs_per_node"][0]
    assert TrainingJob.objects.count() == 0


def test_every_refused_override_is_reported_not_only_the_first(user, digits_dataset, cnn_model, local_backend):
    with pytest.raises(ValidationError) as excinfo:
        _create(user, digits_dataset, cnn_model, local_backend, procs_per_node=3, hyperparameters={
            "train": {"optimizer": "nope", "momentum": "x", "epochs": 2}, "data": {"bogus": 1}})
    errors = _errors(excinfo)
    assert set(errors) == {"hyperparameters", "procs_per_node"}, errors
    said = " | ".join(errors["hyperparameters"])
    assert len(errors["hyperparameters"]) == 3, said
    assert "train.optimizer" in said and "train.momentum" in said and "bogus" in said
    assert TrainingJob.objects.count() == 0


def test_a_bad_field_and_what_the_backend_refuses_are_reported_together(user, digits_dataset, cnn_model,
                                                                         local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        with pytest.raises(ValidationError) as excinfo:
            _create(user, digits_dataset, cnn_model, local_backend, lr="fast", budget_usd="-1", procs_per_node=3)
    errors = _errors(excinfo)
    assert set(errors) == {"lr", "budget_usd", "procs_per_node"}, errors
    assert errors["lr"] == ["Learning rate must be a number, got 'fast'."]
    assert "at most 2" in errors["procs_per_node"][0]  # the GPU box's own limit, on the same call
    assert TrainingJob.objects.count() == 0
    send.assert_not_called()


def test_what_later_checks_say_of_a_flagged_field_or_the_whole_input_is_dropped():
    from jobs import validation

    errors = validation.Errors()
    errors.add("nodes", "Nodes must be a whole number, got 'x'.")
    later = validation.Errors()
    later.add("nodes", "1 node is too few for pipeline stages 2.")  # of the stand-in
    later.add("config.region", "kept: another field")
    later.add(validation.ALL, ValidationError("Needs 90 GiB per GPU", code=validation.WHOLE_INPUT))
    later.add(validation.ALL, "kept: not worked out from every field")
    validation.merge_later(errors, later, flagged={"nodes"})
    assert {k: [str(m) for m in v] for k, v in errors.items()} == {
        "nodes": ["Nodes must be a whole number, got 'x'."], "config.region": ["kept: another field"],
        validation.ALL: ["kept: not worked out from every field"]}
    # With nothing flagged, the whole input's error is the job's own, and kept.
    unflagged = validation.Errors()
    validation.merge_later(unflagged, later, flagged=set())
    assert len(unflagged[validation.ALL]) == 2 and "nodes" in unflagged


def test_create_rejects_unknown_and_foreign_objects(user, other_user, digits_dataset, cnn_model, local_backend):
    theirs = services.dataset_create(owner=other_user, name="theirs", format="builtin", builtin_name="digits")
    for dataset in (theirs, theirs.pk, 999999, None):
        with pytest.raises(ValidationError) as excinfo:
            _create(user, dataset, cnn_model, local_backend)
        assert "dataset" in _errors(excinfo)
        assert ("not yours" if dataset is not None else "Choose a dataset: model digits-cnn trains on one") in \
            _errors(excinfo)["dataset"][0]
    their_backend = services.backend_create(owner=other_user, name="b", kind="gpubox",
                                            config={"hourly_rate_usd": 1.0})
    with pytest.raises(ValidationError) as excinfo:
        _create(user, digits_dataset, cnn_model, their_backend)
    assert "backend" in _errors(excinfo)
    assert TrainingJob.objects.count() == 0


def test_create_rejects_disabled_backend(user, digits_dataset, cnn_model, local_backend):
    services.backend_update(backend=local_backend, enabled=False)
    with pytest.raises(ValidationError) as excinfo:
        _create(user, digits_dataset, cnn_model, local_backend)
    assert "disabled" in _errors(excinfo)["backend"][0]


# --- create: what is stored and sent -------------------------------------------------------


def test_create_freezes_config_and_enqueues_on_commit(user, digits_dataset, cnn_model, local_backend,
                                                      django_capture_on_commit_callbacks):
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            job = _create(user, digits_dataset, cnn_model, local_backend, batch_size=16, lr=0.1, seed=7,
                          max_runtime_s=1800, budget_usd="2.5", name="first",
                          hyperparameters=json.dumps({"train": {"optimizer": "adamw"}}))
    assert len(callbacks) == 1
    send.assert_called_once_with(args=[job.pk], queue="gpubox.local")
    job.refresh_from_db()
    assert job.state == S.QUEUED
    assert job.provider_job_name.startswith(f"tb-job-{job.pk}-")
    cfg = job.config
    assert cfg["data"] == {"format": "builtin", "name": "digits", "uri": "", "label_column": "label",
                           "val_fraction": 0.2, "image_size": 32, "seq_len": 0, "val_windows": 256,
                           "num_workers": 0, "pin_memory": False, "prefetch_factor": 2}
    assert cfg["model"]["arch"] == "cnn" and cfg["model"]["params"]["channels"] == 16
    assert cfg["parallel"]["nodes"] == 1 and cfg["parallel"]["procs_per_node"] == 2
    assert cfg["train"]["epochs"] == 3 and cfg["train"]["batch_size"] == 16
    assert cfg["train"]["lr"] == 0.1 and cfg["train"]["seed"] == 7
    assert cfg["train"]["optimizer"] == "adamw"  # the override merged in
    assert job.hourly_price_usd == Decimal("3.6")
    assert job.estimated_cost_usd == Decimal("1.8000")  # 0.5 h × 1 node × $3.60
    assert job.budget_usd == Decimal("2.5")
    assert list(job.events.values_list("from_state", "to_state")) == [("", "QUEUED")]


def test_create_inside_rolled_back_transaction_enqueues_nothing(
        user, digits_dataset, cnn_model, local_backend, django_capture_on_commit_callbacks):
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            with pytest.raises(RuntimeError):
                with transaction.atomic():
                    _create(user, digits_dataset, cnn_model, local_backend)
                    raise RuntimeError("the request failed after the job was created")
    assert callbacks == []
    send.assert_not_called()
    assert TrainingJob.objects.count() == 0


def test_estimate_shows_arithmetic(local_backend):
    out = services.training_job_estimate(backend=local_backend, nodes=1, procs_per_node=2, max_runtime_s=7200)
    assert out["hourly_price_usd"] == Decimal("3.6")
    assert out["estimated_cost_usd"] == Decimal("7.2000")
    assert out["world_size"] == 2
    assert "2 rank" in out["message"] and "$7.20" in out["message"]
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_estimate(backend=local_backend, procs_per_node=8)
    assert "procs_per_node" in excinfo.value.message_dict


def test_estimate_is_capped_by_the_jobs_budget_with_the_arithmetic(user, digits_dataset, cnn_model, local_backend):
    """min(max runtime × instances × price, budget): 7200 s × 1 × $3.60/h = $7.20 with a $5.00 budget is
    $5.00, stored as the job's estimate (what the monthly budgets count); a budget above it changes nothing."""
    capped = services.training_job_estimate(backend=local_backend, nodes=1, max_runtime_s=7200, budget_usd="5")
    assert capped["estimated_cost_usd"] == Decimal("5.0000")
    assert capped["arithmetic"] == "7200 s × 1 node × $3.60/h = $7.20, capped at the $5.00 budget"
    assert capped["message"] == ("1 node × 1 process = 1 rank; at most 7200 s × 1 node × $3.60/h = $7.20, "
                                 "capped at the $5.00 budget")
    assert capped["money_places"] == 2
    assert capped["max_runtime_covers"].startswith("the run from the moment the job starts on the box")
    loose = services.training_job_estimate(backend=local_backend, nodes=1, max_runtime_s=7200, budget_usd="9.5")
    assert loose["estimated_cost_usd"] == Decimal("7.2000")
    assert loose["arithmetic"] == "7200 s × 1 node × $3.60/h = $7.20; the $9.50 budget is not reached"
    tiny = services.training_job_estimate(backend=local_backend, nodes=1, max_runtime_s=7200, budget_usd="0.0030")
    # One precision for the estimate, its sum and the budget: the 4 decimals a sub-cent budget needs.
    assert tiny["arithmetic"] == "7200 s × 1 node × $3.60/h = $7.2000, capped at the $0.0030 budget"
    assert tiny["money_places"] == 4
    two = services.training_job_estimate(backend=local_backend, nodes=1, procs_per_node=2, max_runtime_s=60)
    assert two["message"] == "1 node × 2 processes = 2 ranks; at most 60 s × 1 node × $3.60/h = $0.06"
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_estimate(backend=local_backend, max_runtime_s=60, budget_usd="-1")
    assert "budget_usd" in excinfo.value.message_dict
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, local_backend, max_runtime_s=7200, budget_usd="5")
    assert job.estimated_cost_usd == Decimal("5.0000")


def test_launch_refuses_a_strategy_the_backends_image_cannot_run(user, digits_dataset, cnn_model):
    """Vertex's default executor image has torch 2.4: fsdp (2.6) and pipeline (2.7) are refused at launch
    with the versions, ddp runs; an image_uri with a newer torch lifts it."""
    vertex = services.backend_create(owner=user, name="vx", kind="vertex",
                                     config={"project": "my-proj", "staging_bucket": "gs://stage/tb"})
    for strategy, need in (("fsdp", "2.6"), ("pipeline", "2.7")):
        with pytest.raises(ValidationError) as excinfo:
            services.training_job_estimate(backend=vertex, strategy=strategy, nodes=2, procs_per_node=1)
        (message,) = excinfo.value.message_dict["strategy"]
        assert message.startswith(f"parallel.strategy {strategy} needs torch ≥ {need} (")
        assert "but image_uri us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-4.py310:latest has torch 2.4" \
            in message
        with pytest.raises(ValidationError) as excinfo:
            _create(user, digits_dataset, cnn_model, vertex, strategy=strategy)
        assert excinfo.value.message_dict["strategy"] == [message]
    assert services.training_job_estimate(backend=vertex, strategy="ddp")["world_size"] == 1
    newer = services.backend_create(owner=user, name="vx27", kind="vertex", config={
        "project": "my-proj", "staging_bucket": "gs://stage/tb",
        "image_uri": "us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-7.py310:latest"})
    assert services.training_job_estimate(backend=newer, strategy="fsdp", nodes=2)["world_size"] == 2

    # A job's own image decides, either way: a newer one runs fsdp on the 2.4 backend, an older one not on 2.7.
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, vertex, strategy="fsdp",
                      image="us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-7.py310:latest")
    assert (job.strategy, job.image) == ("fsdp", "us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-7.py310:latest")
    with pytest.raises(ValidationError) as excinfo:
        _create(user, digits_dataset, cnn_model, newer, strategy="pipeline",
                image="us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-4.py310:latest")
    (message,) = excinfo.value.message_dict["strategy"]
    assert message.startswith("parallel.strategy pipeline needs torch ≥ 2.7 (")
    assert "but the job's image us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-4.py310:latest has torch 2.4" in message


def test_rerun_copies_frozen_config(user, other_user, digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, local_backend)
        again = services.training_job_rerun(job=job, owner=user)
        with pytest.raises(ValidationError):
            services.training_job_rerun(job=job, owner=other_user)
    assert again.pk != job.pk and again.rerun_of_id == job.pk
    assert again.config == job.config and again.state == S.QUEUED
    assert again.provider_job_name != job.provider_job_name
    assert TrainingJob.objects.count() == 2


# --- cancel --------------------------------------------------------------------------------


def test_cancel_queued_is_immediate(user, digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, local_backend)
    with sent_tasks(dispatch.CANCEL_JOB) as send:
        services.training_job_cancel(job=job)
    assert job.state == S.CANCELLED and job.failure_reason == "Cancelled by user"
    send.assert_not_called()
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_cancel(job=job)
    assert "already ended" in excinfo.value.message_dict["__all__"][0]


def test_cancel_running_goes_stopping_and_enqueues(user, digits_dataset, cnn_model, local_backend,
                                                   django_capture_on_commit_callbacks):
    from jobs.states import transition

    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, local_backend)
    for state in (S.SUBMITTING, S.PENDING, S.RUNNING):
        transition(job, state)
    with sent_tasks(dispatch.CANCEL_JOB) as send:
        with django_capture_on_commit_callbacks(execute=True):
            services.training_job_cancel(job=job, reason="enough")
    assert job.state == S.STOPPING and job.failure_reason == "enough" and job.cancel_requested_at
    send.assert_called_once_with(args=[job.pk], queue="gpubox.local")
