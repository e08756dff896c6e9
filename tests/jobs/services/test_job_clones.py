"""jobs/services/clones.py and lineage.py: clone with edits (the same config back when nothing is
edited), overrides, every error at once with nothing written, who may clone, and continue /
fine-tune from a GPU box job's files (what the trainer would refuse is refused first)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from jobs import dispatch, services
from jobs.models import JobEvent, MetricPoint, Team, TrainingJob
from jobs.services.lineage import lineage_text
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db


def _source(user, dataset, model, backend, **kw):
    args = dict(owner=user, dataset=dataset, model_spec=model, backend=backend, nodes=1, procs_per_node=2,
                epochs=1, batch_size=16, lr=0.02, seed=7, max_runtime_s=900, budget_usd="2.5", priority=3,
                env="WANDB_PROJECT=vision\nMODE=fast",
                hyperparameters={"train": {"optimizer": "adamw", "weight_decay": 0.01, "log_every_steps": 5},
                                 "data": {"val_fraction": 0.25}, "model": {"params": {"dropout": 0.1}}})
    args.update(kw)
    return services.training_job_create(**args)


def _ran(job, run_root, *, files=("model.pt", "checkpoints/last.pt"), epochs_done=1):
    """``job`` as the GPU box left it: a handle, its run directory's files, val_loss per epoch done."""
    run = run_root / job.provider_job_name
    for name in files:
        path = run / "output" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"weights")
    job.provider_handle = {"provider": "gpubox", "job_name": job.provider_job_name, "provider_job_id": str(run)}
    job.state = "SUCCEEDED"
    job.save(update_fields=["provider_handle", "state"])
    for epoch in range(epochs_done):
        MetricPoint.objects.create(job=job, name="val_loss", step=10 * (epoch + 1), epoch=epoch, value=0.5,
                                   recorded_at=timezone.now())
    return run


# --- clone with edits ----------------------------------------------------------------------------


def test_a_clone_without_edits_has_the_same_config_and_settings(user, digits_dataset, cnn_model, local_backend):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    data = services.training_job_clone_data(job)
    assert data["hyperparameters"] == {"train": {"optimizer": "adamw", "weight_decay": 0.01, "log_every_steps": 5},
                                       "data": {"val_fraction": 0.25}, "model": {"params": {"dropout": 0.1}}}
    assert (data["epochs"], data["batch_size"], data["lr"], data["seed"], data["procs_per_node"]) == (1, 16, 0.02, 7, 2)
    assert data["env"] == {"WANDB_PROJECT": "vision", "MODE": "fast"}
    assert (data["dataset"], data["model_spec"], data["backend"]) == (digits_dataset, cnn_model, local_backend)

    with sent_tasks(dispatch.SUBMIT_JOB):
        clone = services.training_job_clone(owner=user, job=job)
    assert clone.pk != job.pk
    assert clone.config == job.config
    assert (clone.max_runtime_s, clone.budget_usd, clone.priority, clone.env) == (900, Decimal("2.5"), 3, job.env)
    assert clone.cloned_from == job and clone.source_job is None and clone.init_mode == ""
    assert clone.name == f"job-{job.pk} (copy of #{job.pk})"
    assert lineage_text(clone) == f"cloned from #{job.pk}"
    assert JobEvent.objects.get(job=clone).message == f"Created, cloned from #{job.pk}"
    assert list(job.clones.all()) == [clone]


def test_a_clone_of_a_pipeline_job_with_large_model_settings_keeps_them(user, digits_dataset, cnn_model, local_backend):
    job = _source(user, digits_dataset, cnn_model, local_backend, strategy="pipeline", pipeline_stages=2,
                  microbatches=2, pipeline_schedule="1f1b", hyperparameters=None, max_steps=7)
    clone = services.training_job_clone(owner=user, job=job)
    assert clone.config == job.config
    assert clone.config["parallel"]["pipeline_schedule"] == "1f1b" and clone.config["train"]["max_steps"] == 7
    assert services.training_job_clone_data(job)["hyperparameters"] == {}


def test_overrides_replace_fields_and_hyperparameters_are_deep_merged(user, digits_dataset, cnn_model, local_backend):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    clone = services.training_job_clone(owner=user, job=job, overrides={
        "epochs": 4, "lr": 0.1, "name": "wider", "hyperparameters": {"train": {"weight_decay": 0.0}}})
    assert clone.name == "wider"
    train = clone.config["train"]
    assert (train["epochs"], train["lr"], train["weight_decay"], train["optimizer"], train["log_every_steps"]) == (
        4, 0.1, 0.0, "adamw", 5)
    assert clone.config["data"]["val_fraction"] == 0.25
    # A clone of the clone says it once: (copy of #clone), not stacked suffixes.
    again = services.training_job_clone(owner=user, job=clone)
    assert again.name == f"wider (copy of #{clone.pk})"


def test_every_error_at_once_and_nothing_written(user, digits_dataset, cnn_model, local_backend):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    before = TrainingJob.objects.count()
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        with pytest.raises(ValidationError) as excinfo:
            services.training_job_clone(owner=user, job=job, overrides={
                "epochs": 0, "lr": "fast", "bogus": 1, "hyperparameters": {"train": {"init_from": "/etc/passwd"}}})
    errors = excinfo.value.message_dict
    assert set(errors) == {"epochs", "lr", "bogus", "hyperparameters"}, errors
    assert "Unknown field 'bogus'" in errors["bogus"][0]
    assert "train.init_from and train.init_mode are set by Trainboard" in errors["hyperparameters"][0]
    assert TrainingJob.objects.count() == before
    assert send.call_count == 0


def test_overrides_that_are_not_an_object_are_one_clear_error(user, digits_dataset, cnn_model, local_backend):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides=[1, 2])
    assert excinfo.value.message_dict["__all__"] == [
        'Overrides must be an object of job fields, e.g. {"epochs": 5, "lr": 0.01}.']


def test_a_teammate_clones_a_team_job_into_their_own_and_a_stranger_cannot(
        user, other_user, django_user_model, digits_dataset, cnn_model, local_backend):
    team = Team.objects.create(name="vision")
    team.members.add(user, other_user)
    for obj in (digits_dataset, cnn_model, local_backend):
        obj.team = team
        obj.save(update_fields=["team"])
    job = _source(user, digits_dataset, cnn_model, local_backend, team=team, budget_usd=None)
    clone = services.training_job_clone(owner=other_user, job=job)
    assert (clone.owner, clone.team, clone.cloned_from) == (other_user, team, job)
    assert clone.config == job.config

    carol = django_user_model.objects.create_user(username="carol", password="pw-carol-123")
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=carol, job=job)
    assert excinfo.value.message_dict == {"__all__": ["Choose one of your jobs; this one does not exist or is not yours."]}


# --- continue and fine-tune ----------------------------------------------------------------------


def test_continue_passes_the_checkpoint_path_on_the_same_box_and_records_the_lineage(
        user, digits_dataset, cnn_model, local_backend, run_root):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    run = _ran(job, run_root, epochs_done=1)
    cont = services.training_job_clone(owner=user, job=job, overrides={"init_mode": "continue", "epochs": 2})
    train = cont.config["train"]
    assert train["init_from"] == str(run / "output" / "checkpoints" / "last.pt")
    assert (train["init_mode"], train["epochs"]) == ("continue", 2)
    assert (cont.source_job, cont.cloned_from, cont.init_mode, cont.source_checkpoint_epoch) == (job, job, "continue", 1)
    assert lineage_text(cont) == f"continued from #{job.pk} (checkpoint epoch 1)"
    assert cont.name == f"job-{job.pk} (continued from #{job.pk})"
    assert list(job.derived_jobs.all()) == [cont]
    # Cloning the continued job again does not carry its starting point as a hyperparameter.
    assert "init_from" not in str(services.training_job_clone_data(cont)["hyperparameters"])


def test_the_checkpoint_epoch_is_the_finished_epochs_the_trainer_says_its_checkpoint_holds(
        user, digits_dataset, cnn_model, local_backend, run_root):
    """train.max_steps ended the source inside its second epoch (0-based epoch 1): it validated that
    epoch, but its checkpoint holds 1 finished epoch and the position inside the next, as the epoch
    record's ``epochs_done`` says. The lineage shows 1 and 2 epochs are enough to continue it."""
    from jobs.models import JobLogLine
    from trainer_pkg.metrics import format_metric_line

    job = _source(user, digits_dataset, cnn_model, local_backend)
    _ran(job, run_root, epochs_done=2)  # val_loss at epochs 0 and 1
    for seq, (epoch, done) in enumerate([(0, 1), (1, 1)]):
        JobLogLine.objects.create(job=job, seq=seq, text=format_metric_line(
            {"event": "epoch", "time": 1.0, "epoch": epoch, "step": 10 * (epoch + 1), "val_loss": 0.5,
             "epochs_done": done}))
    cont = services.training_job_clone(owner=user, job=job, overrides={"init_mode": "continue", "epochs": 2})
    assert cont.source_checkpoint_epoch == 1
    assert lineage_text(cont) == f"continued from #{job.pk} (checkpoint epoch 1)"


def test_continue_refuses_what_the_trainer_would_reject_all_at_once(
        user, digits_dataset, cnn_model, local_backend, run_root):
    job = _source(user, digits_dataset, cnn_model, local_backend, hyperparameters={"train": {"optimizer": "adamw"}})
    _ran(job, run_root, epochs_done=1)
    other = services.model_spec_create(owner=user, name="wide-cnn", architecture="cnn",
                                       params={"channels": 32, "hidden_size": 64})
    before = TrainingJob.objects.count()
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={
            "init_mode": "continue", "epochs": 1, "lr": 0.5, "model_spec": other.pk,
            "hyperparameters": {"train": {"optimizer": "sgd"}}})
    errors = excinfo.value.message_dict
    assert errors["epochs"] == [f"Epochs: job #{job.pk}'s checkpoint has 1 epoch done; set more than 1 to continue it."]
    assert "Continue keeps the model" in errors["model_spec"][0] and "channels=16" in errors["model_spec"][0]
    assert "holds train.lr = 0.02; this job asks for 0.5" in errors["lr"][0]
    assert "train.optimizer = 'adamw'; this job asks for 'sgd'" in errors["hyperparameters"][0]
    assert TrainingJob.objects.count() == before


def test_a_bad_mode_or_a_refused_override_hides_no_other_error(user, digits_dataset, cnn_model, local_backend,
                                                                run_root):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    _ran(job, run_root, epochs_done=1)
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={"init_mode": "resume", "epochs": 0, "bogus": 1})
    errors = excinfo.value.message_dict
    assert set(errors) == {"init_mode", "epochs", "bogus"}, errors
    assert errors["init_mode"] == ["Init mode must be continue or finetune (or blank), not 'resume'."]
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={
            "init_mode": "continue", "epochs": 3, "procs_per_node": 64,
            "hyperparameters": {"train": {"optimizer": "nope"}}})
    errors = excinfo.value.message_dict
    assert set(errors) == {"procs_per_node", "hyperparameters"}, errors
    assert "at most 2 processes per node" in errors["procs_per_node"][0]
    assert "train.optimizer" in errors["hyperparameters"][0]
    assert TrainingJob.objects.count() == 1


def test_continue_needs_a_checkpoint_and_fine_tune_uses_model_pt(user, digits_dataset, cnn_model, local_backend, run_root):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    run = _ran(job, run_root, files=("model.pt",), epochs_done=0)
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={"init_mode": "continue", "epochs": 3})
    assert excinfo.value.message_dict["__all__"] == [
        f"Job #{job.pk} left no checkpoint (checkpoints/last.pt): it ended before its first epoch did, or its "
        f"backend no longer keeps its files. Start it from scratch instead."]

    tuned = services.training_job_clone(owner=user, job=job, overrides={
        "init_mode": "finetune", "lr": 0.001, "hyperparameters": {"train": {"optimizer": "sgd"}}})
    assert tuned.config["train"]["init_from"] == str(run / "output" / "model.pt")
    assert (tuned.config["train"]["init_mode"], tuned.config["train"]["lr"]) == ("finetune", 0.001)
    assert tuned.source_checkpoint_epoch is None
    assert lineage_text(tuned) == f"fine-tuned from #{job.pk}"


def test_continue_of_a_sharded_checkpoint_says_so_once_and_not_that_none_was_left(
        user, digits_dataset, cnn_model, local_backend, run_root):
    job = _source(user, digits_dataset, cnn_model, local_backend, strategy="fsdp",
                  hyperparameters={"output": {"checkpoint_format": "sharded"}})
    assert job.config["output"]["checkpoint_format"] == "sharded"
    _ran(job, run_root, files=("model.pt", "checkpoints/last/.metadata"), epochs_done=1)
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={"init_mode": "continue", "epochs": 3})
    assert excinfo.value.message_dict["__all__"] == [
        f"Job #{job.pk} wrote a sharded checkpoint (a directory every rank reads); continue starts from a full "
        f"checkpoint (last.pt) only. Choose Fine-tune, or re-run job #{job.pk} with checkpoint format full."]


def test_fine_tune_refuses_another_architecture(user, digits_dataset, cnn_model, local_backend, run_root):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    _ran(job, run_root)
    mlp = services.model_spec_create(owner=user, name="mlp", architecture="mlp", params={})
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={"init_mode": "finetune", "model_spec": mlp})
    assert "Fine-tune loads job" in excinfo.value.message_dict["model_spec"][0]


def test_a_job_that_never_ran_and_a_bad_mode_are_refused(user, digits_dataset, cnn_model, local_backend):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    with pytest.raises(ValidationError) as excinfo:  # still QUEUED: not ended
        services.training_job_clone(owner=user, job=job, overrides={"init_mode": "finetune"})
    assert excinfo.value.message_dict["init_mode"][0].startswith(f"Job #{job.pk} is QUEUED, not ended: fine-tune")
    job.state = "CANCELLED"  # cancelled before it was submitted
    job.save(update_fields=["state"])
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={"init_mode": "finetune"})
    assert f"Job #{job.pk} never ran on its backend" in excinfo.value.message_dict["__all__"][0]
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={"init_mode": "resume"})
    assert excinfo.value.message_dict["init_mode"] == ["Init mode must be continue or finetune (or blank), not 'resume'."]


def test_another_backend_cannot_read_a_gpu_box_path_and_is_told_which_to_choose(
        user, digits_dataset, cnn_model, local_backend, run_root):
    job = _source(user, digits_dataset, cnn_model, local_backend)
    _ran(job, run_root)
    other_box = services.backend_create(owner=user, name="box-b", kind="gpubox", config={"hourly_rate_usd": 1})
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={"init_mode": "continue", "epochs": 2,
                                                                    "backend": other_box})
    message = excinfo.value.message_dict["backend"][0]
    assert f"lies on backend local (Local GPU box (torchrun)) at {run_root}" in message
    assert "cannot read it there" in message and "Choose backend local." in message


# --- a user's script ----------------------------------------------------------------------------


def test_a_script_job_is_continued_and_fine_tuned_from_what_its_script_saved(
        user, digits_dataset, local_backend, run_root, code_store):
    """The script gets the file as TRAINBOARD_INIT_FROM (the launcher's env: tests/trainer_pkg/
    test_script_values.py); what it holds is the script's, so the trainer's optimizer and epoch rules
    do not apply, and a source whose script saved nothing is refused, saying what to save."""
    from codekit import MODEL_FILES, upload, zip_bytes

    script = services.model_spec_create(owner=user, name="loop", kind="script", code=upload(zip_bytes(MODEL_FILES)),
                                        entry_point="train.py", script_args=["--lr", "{train.lr}"])
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=script, backend=local_backend,
                                       epochs=1, lr=0.02)
    run = _ran(job, run_root, files=("train.log",), epochs_done=0)  # it ran, and saved nothing
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_clone(owner=user, job=job, overrides={"init_mode": "finetune"})
    assert excinfo.value.message_dict["__all__"] == [
        f"Job #{job.pk} left no trained weights (model.pt) and no checkpoint: its script saved none (or its "
        f"backend no longer keeps its files), so there is nothing to hand the new job's script in "
        f"TRAINBOARD_INIT_FROM. A script that is to be fine-tuned saves its weights as model.pt in "
        f"TRAINBOARD_MODEL_DIR (report.model_dir()) or a checkpoint as last.pt in TRAINBOARD_CHECKPOINT_DIR; "
        f"start this job from scratch instead."]

    for name in ("model.pt", "checkpoints/last.pt"):
        (run / "output" / name).parent.mkdir(parents=True, exist_ok=True)
        (run / "output" / name).write_bytes(b"weights")
    tuned = services.training_job_clone(owner=user, job=job, overrides={"init_mode": "finetune", "lr": 0.001})
    assert (tuned.config["train"]["init_from"], tuned.config["train"]["init_mode"]) == (
        str(run / "output" / "model.pt"), "finetune")
    assert tuned.config["code"]["args"] == ["--lr", "{train.lr}"] and tuned.config["train"]["lr"] == 0.001
    assert lineage_text(tuned) == f"fine-tuned from #{job.pk}"
    # Continue: a new lr and fewer epochs are the script's to judge (its checkpoint is its own), and the
    # checkpoint's epoch is not known (no "checkpoint epoch 0").
    cont = services.training_job_clone(owner=user, job=job, overrides={"init_mode": "continue", "lr": 0.5})
    assert cont.config["train"]["init_from"] == str(run / "output" / "checkpoints" / "last.pt")
    assert cont.source_checkpoint_epoch is None
    assert lineage_text(cont) == f"continued from #{job.pk}"
