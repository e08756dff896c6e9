"""The submitted job, run the way Azure ML runs it: the code snapshot azure-ai-ml uploaded to the
Blob stand-in (Azurite) is downloaded to a temporary directory, and the job's command is started in
it once per process with the environment Azure ML's PyTorch distribution gives each process
(clouds.md §3.4: per-process RANK/LOCAL_RANK, WORLD_SIZE = all processes, per-node NODE_RANK,
MASTER_ADDR/MASTER_PORT; processes already started, no torchrun) plus the job's
``AZURE_ML_OUTPUT_<name>`` folders (trainer_pkg/platforms.py ``read_azureml``). 2 nodes × 2 processes
on 127.0.0.1 train one epoch of digits with gloo; the model lands in the ``model`` output. The
processes' stdout, served back as their std_log files, comes out of ``logs()`` with the metric
records exactly as printed. A user's model in the snapshot (``model.arch`` custom) trains the same way;
a user's script runs in the environment recreated from the job's conda file (its pip step). A job
continued from that job's checkpoint (``train.init_from`` its datastore path) gets the file as its
``init_from`` input, copied from Azurite where Azure ML would mount it, with the mounted path put in the
command as Azure ML does for ``${{inputs.init_from}}``; it resumes at the source's checkpoint epoch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from azure.core.exceptions import ResourceExistsError
from azureml_standin import SUBSCRIPTION, WORKSPACE, make_backend, two_gpu_catalog

from cloud_adapters.azureml.backend import DATASTORE_PATH_RE
from cloud_adapters.base import JobSpec
from trainer_pkg.metrics import METRIC_PREFIX, parse_metric_line

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "trainer_pkg"))
from trainer_helpers import records  # noqa: E402  (the trainer tests' reader of metrics.jsonl)
from user_code_kit import (  # noqa: E402
    DEP_MARK, DEP_NAME, DEP_VERSION, MODEL_FILES, SCRIPT_FILES, SECRET_NAME, build_user_model, build_wheel,
    code_bundle, script_metrics, script_ranks_done)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")  # azure-ai-ml's marshmallow schemas

RANK_LINE = re.compile(r"\[launch\] rank (\d+) \(local rank (\d+), node_rank (\d+)\) of world size (\d+)")
PLATFORM_PREFIXES = ("SM_", "AZUREML_", "AZ_BATCH", "AZURE_ML_", "AIP_", "TRAINBOARD_", "PET_", "TORCHELASTIC_")
PLATFORM_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "CLUSTER_SPEC", "TF_CONFIG", "PYTHONPATH")
CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp", "params": {"hidden_size": 32}},
          "train": {"epochs": 1, "batch_size": 32, "log_every_steps": 4, "lr": 0.05},
          "parallel": {"strategy": "ddp", "timeout_s": 60}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def download_snapshot(azurite, code_uri: str, dest: Path) -> Path:
    """The code version's blobs (``codeUri`` = ``<account>/<container>/<folder>``) copied to ``dest``."""
    container, prefix = code_uri[len(azurite.url) + 1:].split("/", 1)
    client = azurite.service().get_container_client(container)
    for blob in client.list_blobs(name_starts_with=prefix + "/"):
        path = dest / blob.name[len(prefix) + 1:]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(client.download_blob(blob.name).readall())
    return dest


def process_env(body: dict, outputs: Path, rank: int, port: int) -> dict[str, str]:
    """What Azure ML sets for process ``rank`` of a 2 × 2 PyTorch job (clouds.md §3.4), on a clean
    environment (no repo on PYTHONPATH: the trainer must come from the snapshot)."""
    per_node = body["distribution"]["processCountPerInstance"]
    world = body["resources"]["instanceCount"] * per_node
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_VARS and not k.startswith(PLATFORM_PREFIXES)}
    if "TRAINBOARD_HARDWARE_EVERY_S" in os.environ:  # the session's (off: tests/conftest.py): only our records
        env["TRAINBOARD_HARDWARE_EVERY_S"] = os.environ["TRAINBOARD_HARDWARE_EVERY_S"]
    env.update(body["environmentVariables"])
    env.update(OMP_NUM_THREADS="1", AZUREML_RUN_ID=body["displayName"], AZUREML_ARM_SUBSCRIPTION=SUBSCRIPTION,
               AZUREML_ARM_WORKSPACE_NAME=WORKSPACE, AZUREML_ARM_PROJECT_NAME=body["experimentName"],
               RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(world),
               NODE_RANK=str(rank // per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name in body["outputs"]:  # every rw_mount output is a folder the processes share
        env[f"AZURE_ML_OUTPUT_{name}"] = str(outputs / name)
        (outputs / name).mkdir(parents=True, exist_ok=True)
    return env


def mount_inputs(azurite, body: dict, dest: Path) -> dict[str, str]:
    """The job's ``uri_file`` inputs where Azure ML would mount them: each datastore path's blob (the
    stand-in's ``workspaceblobstore`` is Azurite's ``azureml-blobstore`` container) copied to
    ``dest/<input>/<file name>``; input name → that local path."""
    client = azurite.service().get_container_client("azureml-blobstore")
    paths = {}
    for name, entry in body["inputs"].items():
        m = DATASTORE_PATH_RE.fullmatch(entry["uri"])
        assert m and m.group(1) == "workspaceblobstore" and entry["jobInputType"] == "uri_file", entry
        path = dest / name / m.group(2).rsplit("/", 1)[-1]
        path.parent.mkdir(parents=True)
        path.write_bytes(client.download_blob(m.group(2)).readall())
        paths[name] = str(path)
    return paths


def run_processes(body: dict, code: Path, outputs: Path, python: str = sys.executable,
                  inputs: dict[str, str] | None = None) -> tuple[int, list[tuple[int, str]]]:
    """The job's command started in the snapshot ``code`` once per process of its 2 × 2 PyTorch
    distribution, as Azure ML starts them (:func:`process_env`), with the environment's ``python`` and
    each ``${{inputs.<name>}}`` replaced by ``inputs[name]``, the input's mounted path (clouds.md §3.1);
    (the rendezvous port, (exit code, output) per rank). Asserts every process exited 0 and printed its
    own rank line."""
    port = free_port()
    command = body["command"]
    for name, path in (inputs or {}).items():
        command = command.replace(f"${{{{inputs.{name}}}}}", shlex.quote(path))
    assert "${{" not in command, command
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "trainer_pkg.launch"]
    procs = [subprocess.Popen([python, *argv[1:]], cwd=code, env=process_env(body, outputs, rank, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(4)]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append((proc.returncode, out))
    for rank, (code_, out) in enumerate(results):
        assert code_ == 0, (rank, out[-3000:])
        assert {tuple(map(int, m.groups())) for m in RANK_LINE.finditer(out)} == {(rank, rank % 2, rank // 2, 4)}
    return port, results


def test_uploaded_trainer_trains_under_azure_mls_process_environment(workspace, azurite, tmp_path):
    backend = make_backend(workspace, prices=two_gpu_catalog())
    job = JobSpec(job_name="tb-job-5-65f1a2b3", config=CONFIG, nodes=2, procs_per_node=2,
                  instance_type="Standard_NC12s_v3", max_runtime_s=600)
    backend.submit(job)
    body = workspace.puts[job.job_name][0]["properties"]
    assert body["distribution"] == {"distributionType": "PyTorch", "processCountPerInstance": 2}
    assert body["resources"]["instanceCount"] == 2
    code_uri = workspace.calls("PUT", r"/codes/")[0].body["properties"]["codeUri"]
    code = download_snapshot(azurite, code_uri, tmp_path / "wd")
    assert json.loads((code / "trainboard_job.json").read_text())["parallel"] == {
        "strategy": "ddp", "timeout_s": 60, "nodes": 2, "procs_per_node": 2}

    outputs = tmp_path / "outputs"
    port, results = run_processes(body, code, outputs)
    assert ("[launch] platform: azureml (AZUREML_RUN_ID is set), node_rank 0 of 2 node(s) × 2 process(es) per "
            f"node = world size 4, master 127.0.0.1:{port}, ranks already started") in results[0][1]

    model_dir = outputs / "model"
    state = torch.load(model_dir / "model.pt", map_location="cpu", weights_only=True)
    assert state and not any(k.startswith("module.") for k in state)
    recs = records(model_dir)
    assert recs[0]["event"] == "started" and recs[-1]["event"] == "completed"
    assert [r["epoch"] for r in recs if r["event"] == "epoch"] == [0]
    assert all(r["world_size"] == 4 for r in recs if "world_size" in r)
    assert (outputs / "checkpoints" / "last.pt").is_file()

    # The processes' stdout as Azure ML's per-process std_log files, read back through logs().
    for rank, (_, out) in enumerate(results):
        workspace.write_log(job.job_name, f"user_logs/std_log_process_{rank}.txt", out)
    lines, _ = backend.logs(backend.submit(job))  # submit again: adopts, and gives the handle
    metric_lines = [line for line in lines if line.startswith(METRIC_PREFIX)]
    printed = [line for line in results[0][1].splitlines() if line.startswith(METRIC_PREFIX)]
    assert metric_lines == printed and len(printed) >= 3
    assert parse_metric_line(metric_lines[-1])["event"] == "completed"
    assert "[std_log_process_2] [launch] rank 2 (local rank 0, node_rank 1) of world size 4" in \
        " ".join(line for line in lines if line.startswith("[std_log_process_2]"))
    assert len(workspace.calls("PUT", r"/jobs/")) == 1


def test_a_continued_job_mounts_the_sources_checkpoint_and_resumes_at_its_epoch(workspace, azurite, tmp_path):
    backend = make_backend(workspace, prices=two_gpu_catalog())
    shape = dict(nodes=2, procs_per_node=2, instance_type="Standard_NC12s_v3", max_runtime_s=600)
    source = backend.submit(JobSpec(job_name="tb-job-7-source", config=CONFIG, **shape))
    snapshot = download_snapshot(azurite, workspace.calls("PUT", r"/codes/")[-1].body["properties"]["codeUri"],
                                 tmp_path / "wd-source")
    source_outputs = tmp_path / "outputs-source"
    run_processes(workspace.puts["tb-job-7-source"][0]["properties"], snapshot, source_outputs)
    # What the checkpoints output's read-write mount leaves in the datastore: Azure ML's default path.
    checkpoint = (source_outputs / "checkpoints" / "last.pt").read_bytes()
    with contextlib.suppress(ResourceExistsError):
        azurite.service().create_container("azureml-blobstore")
    azurite.service().get_container_client("azureml-blobstore").upload_blob(
        "azureml/tb-job-7-source/checkpoints/last.pt", checkpoint, overwrite=True)
    uri = backend.artifact_uri(source, "checkpoints/last.pt")  # as lineage.job_init asks
    assert uri == "azureml://datastores/workspaceblobstore/paths/azureml/tb-job-7-source/checkpoints/last.pt"

    config = {**CONFIG, "train": {**CONFIG["train"], "epochs": 2, "init_from": uri, "init_mode": "continue"}}
    backend.submit(JobSpec(job_name="tb-job-8-continued", config=config, **shape))
    body = workspace.puts["tb-job-8-continued"][0]["properties"]
    assert body["command"].endswith(" --init-from ${{inputs.init_from}}")
    code = download_snapshot(azurite, workspace.calls("PUT", r"/codes/")[-1].body["properties"]["codeUri"],
                             tmp_path / "wd")
    assert json.loads((code / "trainboard_job.json").read_text())["train"]["init_from"] == uri  # the truth
    mounted = mount_inputs(azurite, body, tmp_path / "inputs")
    assert Path(mounted["init_from"]).read_bytes() == checkpoint

    outputs = tmp_path / "outputs"
    _, results = run_processes(body, code, outputs, inputs=mounted)
    log = results[0][1]
    assert f"[launch] train.init_from {uri} is read from {mounted['init_from']} (--init-from)" in log
    assert f"continuing from {mounted['init_from']}" in log
    recs = records(outputs / "model")
    started = next(r for r in recs if r["event"] == "started")
    assert started["resumed"] is True and started["step"] > 0
    # The source's checkpoint holds 1 finished epoch: the continued run trains epoch 1 only.
    assert [(r["epoch"], r["epochs_done"]) for r in recs if r["event"] == "epoch"] == [(1, 2)]
    assert recs[-1]["event"] == "completed"
    resumed = torch.load(outputs / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert resumed["epoch"] == 2


def test_a_custom_model_in_the_snapshot_trains_under_azure_ml(workspace, azurite, tmp_path):
    code = code_bundle(tmp_path / "store", MODEL_FILES)
    config = {**CONFIG, "model": {"arch": "custom", "entry_point": "usermodel.net:build", "params": {"width": 16}}}
    backend = make_backend(workspace, prices=two_gpu_catalog())
    backend.submit(JobSpec(job_name="tb-job-6-custom", config=config, nodes=2, procs_per_node=2,
                           instance_type="Standard_NC12s_v3", max_runtime_s=600, code=code))
    body = workspace.puts["tb-job-6-custom"][0]["properties"]
    snapshot = download_snapshot(azurite, workspace.calls("PUT", r"/codes/")[0].body["properties"]["codeUri"],
                                 tmp_path / "wd")
    assert (snapshot / "usermodel" / "net.py").read_text() == MODEL_FILES["usermodel/net.py"]

    outputs = tmp_path / "outputs"
    _, results = run_processes(body, snapshot, outputs)
    assert f"user code: sha256 {code.sha256} in " in results[0][1]
    recs = records(outputs / "model")
    assert recs[0]["event"] == "started" and recs[-1]["event"] == "completed"
    [epoch] = [r for r in recs if r["event"] == "epoch"]
    assert epoch["val_accuracy"] > 0.3  # 10 digit classes: chance is 0.1
    model = build_user_model(snapshot, num_classes=10, input_shape=(64,), width=16)
    model.load_state_dict(torch.load(outputs / "model" / "model.pt", map_location="cpu", weights_only=True),
                          strict=True)


def recreate_environment(env_body: dict, venv: Path, wheels: Path) -> str:
    """What Azure ML does with an environment of an image plus a conda file, here without a network: a
    fresh Python environment (a virtualenv; this run's torch, numpy and scikit-learn come in through a
    ``.pth``, as the image's conda step would install them) and the conda file's pip step, ``pip install
    -r`` of its pip list, from ``wheels`` only. The environment's python."""
    conda = yaml.safe_load(env_body["properties"]["condaFile"])
    (pip_section,) = [d for d in conda["dependencies"] if isinstance(d, dict)]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    own_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    Path(own_site, "trainboard-test-site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    requirements = venv / "conda-pip-requirements.txt"
    requirements.write_text("\n".join(pip_section["pip"]) + "\n")
    pip = subprocess.run([python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                          "--disable-pip-version-check", "-r", str(requirements)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    assert f"Successfully installed {DEP_NAME}-{DEP_VERSION}" in pip.stdout
    return python


def test_a_users_script_runs_in_the_environment_built_from_the_conda_file(workspace, azurite, tmp_path):
    code = code_bundle(tmp_path / "store", SCRIPT_FILES)
    config = {**CONFIG, "code": {"script": "train.py", "args": ["--steps", "3", "--tag", "az"]}}
    backend = make_backend(workspace, prices=two_gpu_catalog())
    backend.submit(JobSpec(job_name="tb-job-6-script", config=config, nodes=2, procs_per_node=2,
                           instance_type="Standard_NC12s_v3", max_runtime_s=600, code=code,
                           secret_env={SECRET_NAME: "az-secret-38"}))
    body = workspace.puts["tb-job-6-script"][0]["properties"]
    (env_put,) = workspace.calls("PUT", r"/environments/[^/]+/versions/[^/]+$")
    assert body["environmentId"] == env_put.path
    python = recreate_environment(env_put.body, tmp_path / "env", build_wheel(tmp_path / "wheels"))
    snapshot = download_snapshot(azurite, workspace.calls("PUT", r"/codes/")[0].body["properties"]["codeUri"],
                                 tmp_path / "wd")

    outputs = tmp_path / "outputs"
    _, results = run_processes(body, snapshot, outputs, python=python)
    assert script_ranks_done("".join(out for _, out in results), "az") == [0, 1, 2, 3]
    assert not any("az-secret-38" in out for _, out in results)  # in the environment only, never in our log lines
    metrics = script_metrics(results[0][1])
    assert [(m["step"], m["my_metric"], m["dep_mark"]) for m in metrics] == [
        (1, 1.5, float(DEP_MARK)), (2, 3.0, float(DEP_MARK)), (3, 4.5, float(DEP_MARK))]
    assert not any(script_metrics(out) for _, out in results[1:])
    written = json.loads((outputs / "model" / "user_model.json").read_text())
    assert written == {"tag": "az", "world_size": 4, "dep": DEP_VERSION, "cwd": str(snapshot), "secret": "az-secret-38"}
