"""A job with the user's code on Vertex AI, against the stand-in and gcp-storage-emulator: a second
pip-installable source archive in ``package_uris`` carries the files as package data and the
requirements as its dependencies, uploaded once per hash; the config the replicas read sets
``code.dir`` to the package's directory; the job's image and secrets go to each worker pool, never to
the labels or the config in the bucket. The sdist is installed with pip here to show where the files land."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import tomllib

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cloud_adapters.base import InvalidSpec, JobSpec
from cloud_adapters.vertex import package
from user_code_kit import DEP_NAME, DEP_VERSION, MODEL_FILES, SCRIPT_FILES, build_wheel, code_bundle

SECRET = "gcp-secret-5d2c"
IMAGE = "us-docker.pkg.dev/my-proj/training/mine:7"
CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"}, "train": {"epochs": 1},
          "parallel": {"strategy": "ddp"}, "code": {"script": "train.py", "args": ["--steps", "2"]}}


def spec(code, name="tb-job-11-code", **kw) -> JobSpec:
    values = dict(job_name=name, config=CONFIG, nodes=2, procs_per_node=1, max_runtime_s=600, code=code,
                  tags={"trainboard-job-id": "11"}, env={"MY_SETTING": "on"}, secret_env={"HF_TOKEN": SECRET})
    values.update(kw)
    return JobSpec(**values)


def blobs(gcs_url: str) -> dict[str, bytes]:
    client = storage.Client(project="my-proj", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": gcs_url})
    return {b.name: b.download_as_bytes() for b in client.list_blobs("stage")}


def test_code_package_rides_beside_the_trainer_with_the_jobs_image_and_secrets(make_backend, vertex, gcs, tmp_path):
    code = code_bundle(tmp_path / "store", SCRIPT_FILES)
    backend = make_backend(accelerator_type="", accelerator_count=0)
    backend.submit(spec(code, image=IMAGE))
    body = vertex.created[0]
    trainer, sdist = package.build_sdist(), package.build_code_sdist(code)
    assert sdist.name == f"trainboard-code-{sdist.sha256[:16]}.tar.gz"
    for pool in body["jobSpec"]["workerPoolSpecs"]:
        python = pool["pythonPackageSpec"]
        assert python["packageUris"] == [f"gs://stage/tb/code/{trainer.name}", f"gs://stage/tb/code/{sdist.name}"]
        assert python["executorImageUri"] == IMAGE and python["pythonModule"] == "trainer_pkg.launch"
        env = {e["name"]: e["value"] for e in python["env"]}
        assert env["HF_TOKEN"] == SECRET and env["MY_SETTING"] == "on"

    stored = blobs(gcs)
    assert stored[f"tb/code/{sdist.name}"] == sdist.data
    config = json.loads(stored["tb/jobs/tb-job-11-code/trainboard_job.json"])
    assert config["code"] == {"dir": f"trainboard_code_{code.sha256[:16]}", "sha256": code.sha256,
                              "script": "train.py", "args": ["--steps", "2"]}
    assert SECRET not in json.dumps(body["labels"]) and SECRET not in json.dumps(config)
    assert not any(SECRET.encode() in data for data in stored.values())


def test_sdist_members_and_its_pyproject(tmp_path):
    code = code_bundle(tmp_path / "store", {**SCRIPT_FILES, ".hidden/conf[1].txt": "x\n"})
    sdist = package.build_code_sdist(code)
    assert package.build_code_sdist(code).data == sdist.data  # deterministic
    h = code.sha256[:16]
    root, pkg = f"trainboard-code-{h}", f"trainboard_code_{h}"
    with tarfile.open(fileobj=io.BytesIO(sdist.data), mode="r:gz") as tar:
        names = sorted(m.name for m in tar.getmembers())
        pyproject = tar.extractfile(f"{root}/pyproject.toml").read().decode()
    assert names == sorted([f"{root}/pyproject.toml"] + [f"{root}/{pkg}/{n}" for n in
                                                          [*SCRIPT_FILES, ".hidden/conf[1].txt"]])
    project = tomllib.loads(pyproject)
    assert project["project"]["name"] == root
    assert project["project"]["dependencies"] == [f"{DEP_NAME}=={DEP_VERSION}"]  # the comment line dropped
    assert project["tool"]["setuptools"]["packages"] == [pkg]
    assert ".hidden/conf[[]1].txt" in project["tool"]["setuptools"]["package-data"][pkg]


def test_pip_installs_the_files_beside_trainer_pkg_and_the_requirement_with_them(tmp_path):
    code = code_bundle(tmp_path / "store", {**SCRIPT_FILES, ".hidden/conf[1].txt": "x\n"})
    sdist = tmp_path / "code.tar.gz"
    sdist.write_bytes(package.build_code_sdist(code).data)
    wheels = build_wheel(tmp_path / "wheels")
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-index",
                          "--find-links", str(wheels), "--target", str(site), str(sdist)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    installed = site / package.code_dir(code)
    files = sorted(p.relative_to(installed).as_posix() for p in installed.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    assert files == sorted([*SCRIPT_FILES, ".hidden/conf[1].txt"])
    assert (installed / "train.py").read_text() == SCRIPT_FILES["train.py"]
    assert (site / DEP_NAME / "__init__.py").is_file()  # the requirement, installed as a dependency


def test_each_code_archive_is_uploaded_once(make_backend, vertex, gcs, tmp_path, monkeypatch):
    script, model = code_bundle(tmp_path / "store", SCRIPT_FILES), code_bundle(tmp_path / "store", MODEL_FILES)
    backend = make_backend(accelerator_type="", accelerator_count=0)
    uploads: list[str] = []
    real = storage.Blob.upload_from_string
    monkeypatch.setattr(storage.Blob, "upload_from_string",
                        lambda self, *a, **kw: (uploads.append(self.name), real(self, *a, **kw))[1])
    for name, code in (("tb-1", script), ("tb-2", script), ("tb-3", model)):
        backend.submit(spec(code, name=name))
    code_uploads = [u for u in uploads if u.startswith("tb/code/trainboard-code-")]
    assert sorted(code_uploads) == sorted(f"tb/code/{package.build_code_sdist(c).name}" for c in (script, model))
    assert [p["pythonPackageSpec"]["packageUris"][1] for p in
            (b["jobSpec"]["workerPoolSpecs"][0] for b in vertex.created)][:2] == [
        f"gs://stage/tb/code/{package.build_code_sdist(script).name}"] * 2


@pytest.mark.parametrize("line", ["--index-url https://my.index/simple", "-r more.txt", "-e ./local",
                                  "requests==2.32.3 --hash=sha256:abc"])
def test_a_pip_option_in_requirements_is_refused_naming_the_line(make_backend, vertex, tmp_path, line):
    code = code_bundle(tmp_path / "store", {**SCRIPT_FILES, "requirements.txt": f"tbtinydep==1.2.0\n{line}\n"})
    with pytest.raises(InvalidSpec, match=rf"requirements.txt line '{line[:8]}.*': Vertex AI installs the code's "
                                          r"requirements as its package's dependencies"):
        make_backend().validate(spec(code))
    assert vertex.created == []


def test_a_job_without_code_has_one_package(make_backend, vertex):
    make_backend().submit(spec(None, config={"model": {"arch": "mlp"}}))
    python = vertex.created[0]["jobSpec"]["workerPoolSpecs"][0]["pythonPackageSpec"]
    assert python["pythonModule"] == "trainer_pkg.launch" and len(python["packageUris"]) == 1


def test_a_member_that_would_shadow_the_trainer_is_refused(make_backend, vertex, tmp_path):
    code = code_bundle(tmp_path / "store", {**MODEL_FILES, "trainer_pkg/train.py": "print('mine')\n"})
    backend = make_backend()
    for call in (backend.validate, backend.submit):
        with pytest.raises(InvalidSpec, match=r"code archive member 'trainer_pkg/train.py': the name is Trainboard's"):
            call(spec(code))
    assert vertex.created == []


def test_validate_refuses_a_bad_image_naming_it(make_backend, tmp_path):
    with pytest.raises(InvalidSpec, match=r"image 'no image': expected an Artifact Registry image URI"):
        make_backend().validate(spec(code_bundle(tmp_path / "store", MODEL_FILES), image="no image"))
