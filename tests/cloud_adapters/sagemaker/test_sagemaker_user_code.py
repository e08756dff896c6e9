"""A job with the user's code on SageMaker, against moto: the submit directory is the trainer archive
plus the user's files at its root (requirements.txt where the training toolkit installs it), named by
the hash of the whole and uploaded once per hash; the request runs it with ``code.dir`` "." and the
archive's hash in the hyperparameters, the job's own image, and the job's secrets in the Environment only.
Members that would replace ours are refused before anything is uploaded."""

from __future__ import annotations

import io
import json
import tarfile

import boto3
import pytest
from moto import mock_aws

from cloud_adapters import packaging
from cloud_adapters.base import CodeBundle, InvalidSpec, JobSpec
from sagemaker_standin import BUCKET, count_calls, make_backend
from user_code_kit import MODEL_FILES, SCRIPT_FILES, code_bundle

SECRET = "s3cr3t-value-7f1e"
CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"},
          "parallel": {"strategy": "ddp"}, "train": {"epochs": 1},
          "code": {"script": "train.py", "args": ["--steps", "3"]}}


@pytest.fixture
def aws():
    with mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield


class Capture:
    def __init__(self, client) -> None:
        self.bodies: list[dict] = []
        client.meta.events.register("before-call.sagemaker.CreateTrainingJob",
                                    lambda params, **kw: self.bodies.append(json.loads(params["body"])))


def spec(code: CodeBundle | None, name: str = "tb-job-9-code", **kw) -> JobSpec:
    values = dict(job_name=name, config=CONFIG, nodes=1, procs_per_node=1, instance_type="ml.m5.xlarge",
                  code=code, tags={"trainboard-job-id": "9"}, env={"MY_SETTING": "on"},
                  secret_env={"WANDB_API_KEY": SECRET})
    values.update(kw)
    return JobSpec(**values)


def members(data: bytes) -> dict[str, tuple[bytes, int]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: (tar.extractfile(m).read(), m.mode) for m in tar.getmembers()}


def test_submit_directory_holds_the_trainer_and_the_users_files_at_its_root(aws, tmp_path):
    code = code_bundle(tmp_path / "store", SCRIPT_FILES, executable=("train.py",))
    backend = make_backend()
    capture = Capture(backend.client("sagemaker"))
    s3 = backend.client("s3")
    calls = count_calls(s3)
    backend.submit(spec(code, image="123456789012.dkr.ecr.us-east-1.amazonaws.com/my-training:3"))
    [req] = capture.bodies

    combined = packaging.build_archive(code=code)
    key = f"trainboard/code/trainboard-trainer-{combined.sha256[:16]}.tar.gz"
    assert json.loads(req["HyperParameters"]["sagemaker_submit_directory"]) == f"s3://{BUCKET}/{key}"
    uploaded = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert uploaded == combined.data  # deterministic: rebuilt here, byte for byte
    got = members(uploaded)
    trainer = members(packaging.build_archive().data)
    assert set(got) == set(trainer) | set(SCRIPT_FILES)
    for name, text in SCRIPT_FILES.items():  # at the root, beside trainer_pkg/, as the user wrote them
        assert got[name][0] == text.encode()
    assert got["train.py"][1] == 0o755 and got["requirements.txt"][1] == 0o644
    assert got["requirements.txt"][0].decode() == code.requirements
    assert {n: got[n] for n in trainer} == trainer  # ours unchanged
    assert calls.count("PutObject") == 1

    hps = req["HyperParameters"]
    assert json.loads(hps["code.dir"]) == "." and json.loads(hps["code.sha256"]) == code.sha256
    assert json.loads(hps["code.script"]) == "train.py" and json.loads(hps["code.args"]) == ["--steps", "3"]
    assert req["AlgorithmSpecification"]["TrainingImage"] == "123456789012.dkr.ecr.us-east-1.amazonaws.com/my-training:3"

    # The secret reaches the container's environment and nothing else of the request.
    assert req["Environment"]["WANDB_API_KEY"] == SECRET and req["Environment"]["MY_SETTING"] == "on"
    assert SECRET not in json.dumps(req["HyperParameters"]) and SECRET not in json.dumps(req["Tags"])
    assert SECRET not in json.dumps({k: v for k, v in req.items() if k != "Environment"})


def test_each_pair_of_trainer_and_code_is_uploaded_once(aws, tmp_path):
    script = code_bundle(tmp_path / "store", SCRIPT_FILES)
    model = code_bundle(tmp_path / "store", MODEL_FILES)
    backend = make_backend()
    s3 = backend.client("s3")
    calls = count_calls(s3)
    for name, code in (("tb-1", script), ("tb-2", script), ("tb-3", model), ("tb-4", None)):
        backend.submit(spec(code, name=name))
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"])
    expected = sorted(f"trainboard/code/{packaging.build_archive(code=c).name}" for c in (script, model, None))
    assert keys == expected and len(set(keys)) == 3
    assert calls.count("HeadObject") == 4 and calls.count("PutObject") == 3


def test_a_job_without_code_keeps_the_config_and_the_backends_image(aws):
    backend = make_backend()
    capture = Capture(backend.client("sagemaker"))
    backend.submit(spec(None, config={"model": {"arch": "mlp"}}))
    [req] = capture.bodies
    assert not any(k.startswith("code.") for k in req["HyperParameters"])
    assert req["AlgorithmSpecification"]["TrainingImage"].endswith("/pytorch-training:2.8.0-cpu-py312")


@pytest.mark.parametrize("member, words", [
    ("trainer_pkg/train.py", "'trainer_pkg/train.py': the name is Trainboard's"),
    ("trainboard_entry.py", "'trainboard_entry.py': the name is Trainboard's"),
    ("trainboard_extra/x.py", "'trainboard_extra/x.py': the name is Trainboard's"),
    ("setup.py", "'setup.py': SageMaker's training toolkit installs a submit directory with a top-level setup.py"),
])
def test_members_that_would_replace_ours_are_refused_before_any_upload(aws, tmp_path, member, words):
    code = code_bundle(tmp_path / "store", {**SCRIPT_FILES, member: "print('mine')\n"})
    backend = make_backend()
    calls = count_calls(backend.client("s3"))
    with pytest.raises(InvalidSpec, match="code archive member " + words.replace("(", r"\(")):
        backend.validate(spec(code))  # when the job is created: the archive is read, nothing is called
    with pytest.raises(InvalidSpec, match="code archive member " + words.replace("(", r"\(")):
        backend.submit(spec(code))
    assert calls.count("PutObject") == 0
    assert backend.client("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []


def test_a_stored_archive_that_changed_is_refused(aws, tmp_path):
    code = code_bundle(tmp_path / "store", SCRIPT_FILES)
    with open(code.path, "ab") as f:
        f.write(b"tampered")
    for call in (make_backend().validate, make_backend().submit):
        with pytest.raises(InvalidSpec, match=r"its SHA-256 is [0-9a-f]{16}…, the job records "
                                              rf"{code.sha256[:16]}…; the stored archive changed, upload the code again"):
            call(spec(code))


def test_validate_names_a_bad_image_a_bad_secret_name_and_an_s3_trainer_with_code(tmp_path):
    code = code_bundle(tmp_path / "store", SCRIPT_FILES)
    backend = make_backend()
    with pytest.raises(InvalidSpec, match=r"image 'not an image': expected an ECR image URI"):
        backend.validate(spec(code, image="not an image"))
    with pytest.raises(InvalidSpec, match=r"env '1BAD': names are letters") as exc:
        backend.validate(spec(code, secret_env={"1BAD": SECRET}))
    assert SECRET not in str(exc.value)
    with pytest.raises(InvalidSpec, match=r"a job with its own code ships the trainer and the code as one archive"):
        backend.validate(spec(code, trainer_package_uri="s3://elsewhere/trainer.tar.gz"))
