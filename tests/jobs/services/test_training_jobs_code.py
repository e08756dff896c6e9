"""jobs/services/training_jobs.py with the user's code (docs/user-code.md): the frozen config and the
row of a job of a code model and of a script, its environment and image (every refusal at once, by
field), the dataset fingerprint it records, the JobSpec a backend receives, and a re-run that keeps
the archive that ran even after the model's code changed."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from codekit import MODEL_FILES, NET_PY, upload, zip_bytes
from jobs import services
from jobs.adapters import job_spec
from jobs.models import CodeArchive, TrainingJob

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("code_store", "allow_job_images")]


@pytest.fixture
def code_model(user):
    return services.model_spec_create(
        owner=user, name="my-net", kind="code", code=upload(zip_bytes(MODEL_FILES), "net.zip"),
        entry_point="mymodel.net:build", params={"width": 8}, shard_classes=["Block"],
        image="123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0")


@pytest.fixture
def script_model(user):
    return services.model_spec_create(
        owner=user, name="my-script", kind="script", code=upload(zip_bytes(MODEL_FILES), "net.zip"),
        entry_point="train.py", script_args=["--epochs", "2"])


@pytest.fixture
def table_csv(user, tmp_path):
    """A local CSV dataset of 3 features: its samples are (3,), which no built-in CNN takes. 100 rows:
    80 train, enough for the default batch of 32 on 2 ranks."""
    folder = tmp_path / "table"
    folder.mkdir()
    (folder / "t.csv").write_text("a,b,c,label\n" + "".join(f"{i},{i + 1},{i + 2},{i % 2}\n" for i in range(100)))
    return services.dataset_create(owner=user, name="table", format="csv", uri=str(folder / "t.csv"))


def create(user, dataset, model, backend, **kw) -> TrainingJob:
    return services.training_job_create(**{"owner": user, "dataset": dataset, "model_spec": model,
                                           "backend": backend, "nodes": 1, "procs_per_node": 2, "epochs": 2, **kw})


def refused(user, dataset, model, backend, **kw) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as excinfo:
        create(user, dataset, model, backend, **kw)
    assert TrainingJob.objects.count() == 0
    return excinfo.value.message_dict


# --- the frozen config and the row ----------------------------------------------------------


def test_a_code_model_job_freezes_the_custom_model_and_records_its_archive(user, digits_dataset, code_model,
                                                                          local_backend):
    job = create(user, digits_dataset, code_model, local_backend, strategy="fsdp")
    archive = CodeArchive.objects.get()
    assert job.config["model"] == {"arch": "custom", "entry_point": "mymodel.net:build", "params": {"width": 8},
                                   "shard_classes": ["Block"]}
    assert job.config["code"] == {"dir": "", "sha256": archive.sha256, "script": "", "args": [], "framework": "torch"}
    assert job.config["parallel"]["strategy"] == "fsdp"
    job.refresh_from_db()
    assert job.code_id == archive.pk
    assert job.image == "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0"  # the model's
    assert job.env == {}
    assert job.dataset_fingerprint == {"kind": "builtin", "name": "digits"}


def test_a_script_job_freezes_the_script_and_its_arguments(user, digits_dataset, script_model, local_backend):
    job = create(user, digits_dataset, script_model, local_backend, env={"WANDB_PROJECT": "vision"},
                 image="myregistry.azurecr.io/train:2.0")
    archive = CodeArchive.objects.get()
    assert job.config["code"] == {"dir": "", "sha256": archive.sha256, "script": "train.py",
                                  "args": ["--epochs", "2"], "framework": "torch"}
    job.refresh_from_db()
    assert (job.code_id, job.image, job.env) == (archive.pk, "myregistry.azurecr.io/train:2.0",
                                                 {"WANDB_PROJECT": "vision"})


def test_the_builtin_fit_check_is_skipped_for_a_code_model_and_a_script(user, table_csv, cnn_model, code_model,
                                                                        script_model, local_backend):
    errors = refused(user, table_csv, cnn_model, local_backend)
    assert "does not fit dataset table" in errors["model_spec"][0]
    # The entry point's shapes are known only when it runs; a script has no model of ours.
    assert create(user, table_csv, code_model, local_backend).config["model"]["arch"] == "custom"
    assert create(user, table_csv, script_model, local_backend).config["code"]["script"] == "train.py"


def test_a_script_job_has_no_model_layer_check(user, digits_dataset, script_model, local_backend):
    # The built-in cnn a script's config keeps as its (unused) default has 4 layers; a pipeline of the
    # script's own is not measured against it.
    job = create(user, digits_dataset, script_model, local_backend, strategy="pipeline",
                 hyperparameters={"parallel": {"microbatches": 2}})
    assert job.config["parallel"]["strategy"] == "pipeline"


def test_the_code_section_cannot_be_overridden(user, digits_dataset, code_model, local_backend):
    errors = refused(user, digits_dataset, code_model, local_backend,
                     hyperparameters={"code": {"sha256": "0" * 64}})
    assert errors == {"hyperparameters": [
        "Hyperparameters: the code section is set from the model's code archive (its hash, script and "
        "arguments); remove it, and change the model instead."]}


def test_a_custom_models_overridden_params_are_checked_by_the_trainers_rule(user, digits_dataset, code_model,
                                                                            local_backend):
    errors = refused(user, digits_dataset, code_model, local_backend,
                     hyperparameters={"model": {"params": {"num_classes": 3}}})
    assert errors == {"hyperparameters": [
        "model.params.num_classes: the trainer passes num_classes itself (from the dataset); remove it from the "
        "parameters"]}
    job = create(user, digits_dataset, code_model, local_backend, hyperparameters={"model": {"params": {"depth": 2}}})
    assert job.config["model"]["params"] == {"width": 8, "depth": 2}


# --- environment and image ------------------------------------------------------------------


def test_env_as_lines_is_stored_as_a_dict(user, digits_dataset, cnn_model, local_backend):
    job = create(user, digits_dataset, cnn_model, local_backend,
                 env="# tracking\nWANDB_PROJECT = vision\n\nHF_HOME=/data/hf\nEMPTYISH=a=b\n")
    job.refresh_from_db()
    assert job.env == {"WANDB_PROJECT": "vision", "HF_HOME": "/data/hf", "EMPTYISH": "a=b"}
    assert job.image == ""  # neither the job nor the built-in model names one: the backend's


def test_every_env_and_image_error_at_once_each_saying_why(user, digits_dataset, cnn_model, local_backend):
    env = "\n".join(["RANK=3", "JUST_A_NAME", "1BAD=x", "TRAINBOARD_DATA_DIR=/x", "CUDA_VISIBLE_DEVICES=0",
                     "PATH=/usr/bin", "SM_MODEL_DIR=/m", "AIP_MODEL_DIR=/m", "AZUREML_RUN_ID=1",
                     "LD_PRELOAD=/x.so", "PYTHONPATH=/p", "OK=1", "OK=2", "EMPTY=", "LONG=" + "x" * 4097,
                     "N" * 101 + "=1"])
    errors = refused(user, digits_dataset, cnn_model, local_backend, env=env, image="Not An Image!")
    assert set(errors) == {"env", "image"}
    assert errors["env"] == [
        "Environment variable RANK cannot be set here: torchrun sets it on every rank from the job's shape.",
        "Line 2: 'JUST_A_NAME' is not NAME=VALUE; write one variable per line, e.g. WANDB_PROJECT=vision.",
        "Environment variable '1BAD' is not a variable name: letters, digits and _, not starting with a digit "
        "(e.g. WANDB_API_KEY).",
        "Environment variable TRAINBOARD_DATA_DIR cannot be set here: names starting TRAINBOARD_ are "
        "Trainboard's own (the launcher sets TRAINBOARD_MODEL_DIR, TRAINBOARD_DATA_DIR, ...).",
        "Environment variable CUDA_VISIBLE_DEVICES cannot be set here: names starting CUDA_ are the platform's "
        "GPU settings (CUDA_VISIBLE_DEVICES is chosen per rank).",
        "Environment variable PATH cannot be set here: the platform sets it for the job's user and image.",
        "Environment variable SM_MODEL_DIR cannot be set here: names starting SM_ are SageMaker's (its "
        "training toolkit sets them).",
        "Environment variable AIP_MODEL_DIR cannot be set here: names starting AIP_ are Vertex AI's (it sets "
        "them in every replica).",
        "Environment variable AZUREML_RUN_ID cannot be set here: names starting AZUREML_ are Azure ML's (it "
        "sets them in every node).",
        "Environment variable LD_PRELOAD cannot be set here: it changes which libraries every process of the "
        "image loads; put them in a container image.",
        "Environment variable PYTHONPATH cannot be set here: the launcher puts the trainer and your code on it.",
        "Environment variable OK is given twice; keep one.",
        "Environment variable EMPTY has an empty value; give one, or remove the line.",
        "Environment variable LONG: a value is at most 4,096 characters, this one has 4,097.",
        f"Environment variable {'N' * 40}...: a name is at most 100 characters, this one has 101.",
    ]
    assert errors["image"] == [
        "Image: 'Not An Image!' is not a container image reference; give one like "
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0, us-docker.pkg.dev/project/repo/train:1.0 or "
        "myregistry.azurecr.io/train:1.0, or leave it blank for the backend's image."]


def test_env_limits_and_types(user, digits_dataset, cnn_model, local_backend):
    many = {f"V{i}": "1" for i in range(65)}
    assert refused(user, digits_dataset, cnn_model, local_backend, env=many)["env"] == [
        "At most 64 environment variables, got 65."]
    assert refused(user, digits_dataset, cnn_model, local_backend, env={"A": 1, "B": "x\x00y"})["env"] == [
        "Environment variable A: the value must be a string, got int.",
        "Environment variable B: the value contains a NUL character (\\u0000), which cannot be stored; remove it."]
    assert refused(user, digits_dataset, cnn_model, local_backend, env=["A=1"])["env"] == [
        "Environment variables must be an object of NAME: value strings, or NAME=VALUE lines."]
    assert refused(user, digits_dataset, cnn_model, local_backend, image=5)["image"] == [
        "Image must be text: a container image reference, or blank for the model's or the backend's image."]


def test_an_env_name_that_is_a_job_secret_of_the_backend_is_refused(user, digits_dataset, cnn_model,
                                                                    local_backend):
    local_backend.job_secrets = {"WANDB_API_KEY": "secret-value-123"}
    local_backend.save()
    errors = refused(user, digits_dataset, cnn_model, local_backend, env={"WANDB_API_KEY": "other", "X": "1"})
    assert errors == {"env": [
        "Environment variable WANDB_API_KEY is a job secret of backend local; remove it here (the secret is set "
        "in the job already), or choose another name."]}
    assert "secret-value-123" not in str(errors)


def test_env_errors_come_with_the_other_fields_errors(user, digits_dataset, cnn_model, local_backend):
    errors = refused(user, digits_dataset, cnn_model, local_backend, env="RANK=1", epochs=0, image="BAD IMAGE")
    assert set(errors) == {"env", "epochs", "image"}


# --- the dataset fingerprint ----------------------------------------------------------------


def test_a_local_dataset_is_fingerprinted_when_the_job_is_created(user, table_csv, cnn_model, code_model,
                                                                   local_backend, tmp_path):
    job = create(user, table_csv, code_model, local_backend)
    job.refresh_from_db()
    fp = job.dataset_fingerprint
    csv = tmp_path / "table" / "t.csv"
    assert fp["kind"] == "local" and fp["path"] == str(csv)
    assert (fp["files"], fp["size_bytes"]) == (1, csv.stat().st_size)
    assert len(fp["sample_sha256"]) == 64
    csv.write_text(csv.read_text().replace("0,1,2,0\n", "0,1,2,1\n", 1))  # the same size, one label changed
    again = services.training_job_rerun(job=job, owner=user)
    assert again.dataset_fingerprint["size_bytes"] == fp["size_bytes"]
    assert again.dataset_fingerprint["sample_sha256"] != fp["sample_sha256"]


def test_a_cloud_dataset_is_left_to_the_worker(user, code_model, local_backend, aws_env):
    sm = services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerTraining",
        "bucket": "tb-test-bucket"})
    s3 = services.dataset_create(owner=user, name="s3-table", format="csv", uri="s3://tb-data/table/")
    job = services.training_job_create(owner=user, dataset=s3, model_spec=code_model, backend=sm)
    job.refresh_from_db()
    assert job.dataset_fingerprint is None


# --- what the backend receives, and a re-run ------------------------------------------------


def test_job_spec_carries_the_code_bundle_image_env_and_the_backends_job_secrets(user, digits_dataset,
                                                                                code_model, local_backend):
    local_backend.job_secrets = {"WANDB_API_KEY": "wandb-secret-0001", "HF_TOKEN": "hf_abcdef"}
    local_backend.save()
    job = create(user, digits_dataset, code_model, local_backend, env="WANDB_PROJECT=vision")
    job = TrainingJob.objects.get(pk=job.pk)
    spec = job_spec(job)
    archive = CodeArchive.objects.get()
    assert spec.code is not None
    assert (spec.code.sha256, spec.code.requirements) == (archive.sha256, "tinypkg==1.0\n")
    assert Path(spec.code.path) == archive.path and archive.path.is_file()
    assert spec.image == "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0"
    assert spec.env == {"WANDB_PROJECT": "vision"}
    assert spec.secret_env == {"WANDB_API_KEY": "wandb-secret-0001", "HF_TOKEN": "hf_abcdef"}
    assert "wandb-secret-0001" not in str(job.config)  # secrets are never frozen into the config


def test_a_builtin_job_spec_has_no_code(user, digits_dataset, cnn_model, local_backend):
    spec = job_spec(create(user, digits_dataset, cnn_model, local_backend))
    assert (spec.code, spec.image, dict(spec.env), dict(spec.secret_env)) == (None, "", {}, {})


def test_a_rerun_keeps_the_archive_image_and_env_after_the_model_changed(user, digits_dataset, code_model,
                                                                         local_backend):
    job = create(user, digits_dataset, code_model, local_backend, env={"WANDB_PROJECT": "vision"},
                 image="us-docker.pkg.dev/p/r/train:1.0")
    old_sha = job.code.sha256
    edited = {**MODEL_FILES, "mymodel/net.py": NET_PY + b"\n# tuned\n"}
    services.model_spec_update(model_spec=code_model, code=upload(zip_bytes(edited), "net2.zip"),
                               image="myregistry.azurecr.io/other:2")
    code_model.refresh_from_db()
    assert code_model.code.sha256 != old_sha
    again = services.training_job_rerun(job=job, owner=user)
    again.refresh_from_db()
    assert again.code.sha256 == old_sha
    assert again.config["code"]["sha256"] == old_sha
    assert job_spec(again).code.sha256 == old_sha
    assert (again.image, again.env) == ("us-docker.pkg.dev/p/r/train:1.0", {"WANDB_PROJECT": "vision"})
    # A new job of the edited model runs the new archive.
    assert create(user, digits_dataset, code_model, local_backend).code.sha256 == code_model.code.sha256


def test_the_estimate_takes_a_script_model(user, script_model, code_model, local_backend):
    for model in (script_model, code_model):
        estimate = services.training_job_estimate(backend=local_backend, nodes=1, procs_per_node=2,
                                                  strategy="pipeline", batch_size=32, model_spec=model)
        assert estimate["world_size"] == 2


def test_a_script_job_may_run_without_a_dataset_and_no_other_kind_may(user, digits_dataset, script_model, code_model,
                                                                     cnn_model, local_backend):
    job = create(user, None, script_model, local_backend, procs_per_node=1)
    assert job.dataset is None and job.dataset_fingerprint is None
    assert job.config["data"]["uri"] == ""  # the launcher then sets no TRAINBOARD_DATA_DIR
    assert job_spec(job).dataset_uri == ""
    rerun = services.training_job_rerun(owner=user, job=job)
    assert rerun.dataset is None and rerun.dataset_fingerprint is None
    tuned_from_nothing = services.training_job_clone(owner=user, job=job)
    assert tuned_from_nothing.dataset is None
    TrainingJob.objects.all().delete()
    for model in (cnn_model, code_model):
        assert refused(user, "", model, local_backend) == {"dataset": [
            f"Choose a dataset: model {model.name} trains on one (only a script model may run without, reading "
            f"its own data)."]}


# --- a script's framework (issue 33) -----------------------------------------------------------

@pytest.mark.parametrize("framework", ["tensorflow", "ray", "mpi"])
def test_a_script_jobs_config_carries_its_models_framework(user, digits_dataset, local_backend, framework):
    model = services.model_spec_create(owner=user, name=f"s-{framework}", kind="script", framework=framework,
                                       code=upload(zip_bytes(MODEL_FILES), "net.zip"), entry_point="train.py")
    assert model.framework == framework
    job = create(user, digits_dataset, model, local_backend)
    assert job.config["code"]["framework"] == framework
    assert job.config["code"]["script"] == "train.py"


def test_a_torch_script_and_a_code_model_run_under_torch(user, digits_dataset, script_model, code_model,
                                                         local_backend):
    assert create(user, digits_dataset, script_model, local_backend).config["code"]["framework"] == "torch"
    assert create(user, digits_dataset, code_model, local_backend).config["code"]["framework"] == "torch"


def test_only_a_script_takes_another_framework_and_only_a_known_one(user):
    with pytest.raises(ValidationError) as excinfo:
        services.model_spec_create(owner=user, name="c", kind="code", framework="tensorflow",
                                   code=upload(zip_bytes(MODEL_FILES), "net.zip"), entry_point="mymodel.net:build")
    assert excinfo.value.message_dict == {"framework": [
        "Only a model of kind script runs under tensorflow: Trainboard's own trainer is PyTorch. Choose kind "
        "script, or framework torch."]}
    with pytest.raises(ValidationError) as excinfo:
        services.model_spec_create(owner=user, name="j", kind="script", framework="jax",
                                   code=upload(zip_bytes(MODEL_FILES), "net.zip"), entry_point="train.py")
    assert list(excinfo.value.message_dict) == ["framework"]
    assert "'jax' is not a valid choice" in excinfo.value.message_dict["framework"][0]


def test_changing_the_kind_away_from_script_drops_its_framework(user):
    model = services.model_spec_create(owner=user, name="s", kind="script", framework="ray",
                                       code=upload(zip_bytes(MODEL_FILES), "net.zip"), entry_point="train.py")
    model = services.model_spec_update(model_spec=model, kind="code", entry_point="mymodel.net:build")
    assert (model.kind, model.framework) == ("code", "torch")
