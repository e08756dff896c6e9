"""A job with the user's code on Azure ML, through the real ``MLClient`` over the stand-in and Azurite:
the user's files are in the code snapshot beside trainer_pkg/, the config sets ``code.dir`` "."; a job
with requirements runs in an environment azure-ai-ml creates from an image plus a conda file whose pip
dependencies are the trainer's and then the requirement lines; ``JobSpec.image`` replaces the image;
the job's secrets are in ``environment_variables`` and nowhere else of what is sent or uploaded."""

from __future__ import annotations

import json

import pytest
import yaml
from azureml_standin import make_backend, two_gpu_catalog

from cloud_adapters.azureml.backend import CONDA_PYTHON, DEFAULT_ENVIRONMENT, REQUIREMENTS_IMAGE
from cloud_adapters.base import InvalidSpec, JobSpec
from user_code_kit import DEP_NAME, DEP_VERSION, MODEL_FILES, SCRIPT_FILES, code_bundle

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")  # azure-ai-ml's marshmallow schemas

SECRET = "azure-secret-93ab"
CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"}, "train": {"epochs": 1},
          "parallel": {"strategy": "ddp"}, "code": {"script": "train.py", "args": ["--steps", "2"]}}


def spec(code, name="tb-job-21-code", **kw) -> JobSpec:
    values = dict(job_name=name, config=CONFIG, nodes=1, procs_per_node=1, instance_type="Standard_NC12s_v3",
                  max_runtime_s=600, code=code, tags={"trainboard-job-id": "21"}, env={"MY_SETTING": "on"},
                  secret_env={"API_TOKEN": SECRET})
    values.update(kw)
    return JobSpec(**values)


def snapshot(workspace, azurite) -> dict[str, bytes]:
    (code_put,) = workspace.calls("PUT", r"/codes/")
    container, prefix = code_put.body["properties"]["codeUri"][len(azurite.url) + 1:].split("/", 1)
    blobs = azurite.service().get_container_client(container)
    return {b.name[len(prefix) + 1:]: blobs.download_blob(b.name).readall()
            for b in blobs.list_blobs(name_starts_with=prefix + "/")}


def test_snapshot_holds_the_users_files_and_the_environment_installs_the_requirements(workspace, azurite, tmp_path):
    code = code_bundle(tmp_path / "store", {**SCRIPT_FILES, ".gitignore": "helpers/\n*.txt\n"})
    backend = make_backend(workspace, prices=two_gpu_catalog())
    backend.submit(spec(code))
    body = workspace.puts["tb-job-21-code"][0]["properties"]

    files = snapshot(workspace, azurite)
    for name, text in SCRIPT_FILES.items():  # .gitignore matches helpers/ and *.txt: uploaded all the same
        assert files[name] == text.encode()
    assert files[".amlignore"] == b"" and "trainer_pkg/launch.py" in files
    config = json.loads(files["trainboard_job.json"])
    assert config["code"] == {"dir": ".", "sha256": code.sha256, "script": "train.py", "args": ["--steps", "2"]}

    (env_put,) = workspace.calls("PUT", r"/environments/[^/]+/versions/[^/]+$")
    assert body["environmentId"] == env_put.path
    props = env_put.body["properties"]
    assert props["image"] == REQUIREMENTS_IMAGE and props["isAnonymous"] is True
    conda = yaml.safe_load(props["condaFile"])
    assert conda["dependencies"][:2] == [f"python={CONDA_PYTHON}", "pip"]
    pip = conda["dependencies"][2]["pip"]
    assert pip[-1] == f"{DEP_NAME}=={DEP_VERSION}"  # the requirement line, after the trainer's own
    assert pip[:-1] == ["torch>=2.4", "numpy", "psutil>=5.9", "nvidia-ml-py>=12", "scikit-learn"]  # trainer_pkg/pyproject.toml + the digits extra

    assert body["environmentVariables"]["API_TOKEN"] == SECRET and body["environmentVariables"]["MY_SETTING"] == "on"
    assert SECRET not in json.dumps({k: v for k, v in body.items() if k != "environmentVariables"})
    assert not any(SECRET.encode() in data for data in files.values())
    assert SECRET not in json.dumps(env_put.body)


def test_the_jobs_image_replaces_the_environment_with_or_without_requirements(workspace, tmp_path):
    backend = make_backend(workspace, prices=two_gpu_catalog())
    model = code_bundle(tmp_path / "store", MODEL_FILES)  # no requirements.txt
    script = code_bundle(tmp_path / "store", SCRIPT_FILES)
    backend.submit(spec(model, name="tb-a", image="myregistry.azurecr.io/train:2"))
    backend.submit(spec(script, name="tb-b", image="myregistry.azurecr.io/train:2"))
    backend.submit(spec(model, name="tb-c"))
    envs = {put.path: put.body["properties"] for put in workspace.calls("PUT", r"/environments/")}
    a, b, c = (workspace.puts[n][0]["properties"]["environmentId"] for n in ("tb-a", "tb-b", "tb-c"))
    assert envs[a]["image"] == "myregistry.azurecr.io/train:2" and "condaFile" not in envs[a]
    assert envs[b]["image"] == "myregistry.azurecr.io/train:2"
    assert yaml.safe_load(envs[b]["condaFile"])["dependencies"][2]["pip"][-1] == f"{DEP_NAME}=={DEP_VERSION}"
    assert c == DEFAULT_ENVIRONMENT  # no requirements, no image: the backend's environment


@pytest.mark.parametrize("member", ["trainer_pkg/train.py", "trainboard_job.json"])
def test_members_named_like_ours_are_refused_before_any_call(workspace, tmp_path, member):
    code = code_bundle(tmp_path / "store", {**MODEL_FILES, member: "{}"})
    backend = make_backend(workspace, prices=two_gpu_catalog())
    for call in (backend.validate, backend.submit):
        with pytest.raises(InvalidSpec, match=rf"code archive member '{member}': the name is Trainboard's"):
            call(spec(code))
    assert workspace.calls("PUT") == []


def test_validate_names_a_bad_image(workspace, tmp_path):
    with pytest.raises(InvalidSpec, match=r"image 'bad image': expected a container image"):
        make_backend(workspace, prices=two_gpu_catalog()).validate(spec(None, image="bad image"))
