"""The uploaded archive run the way AWS's PyTorch training container runs it: SageMaker's own training
toolkit (sagemaker-training + sagemaker-pytorch-training from PyPI, in a virtualenv of their own; see
conftest.py ``sagemaker_toolkit``) started as the image starts it — its ``train`` command with
``SAGEMAKER_TRAINING_MODULE=sagemaker_pytorch_container.training:main`` — on two hosts, each an
/opt/ml tree under tmp_path named by ``SAGEMAKER_BASE_DIR``.

What SageMaker itself does before the toolkit starts is recreated from the CreateTrainingJob request
the adapter sent to moto: ``input/config/hyperparameters.json`` is the request's HyperParameters as
sent, ``resourceconfig.json`` names the hosts, ``inputdataconfig.json`` the channels, the ``train``
channel holds the dataset's objects copied from S3 (a prefix's objects keep their path below the
prefix's last ``/``), and the request's Environment is set. The toolkit downloads the archive from
``sagemaker_submit_directory`` in moto's S3 (a loopback server), unpacks it into ``code/`` and runs
the entry script; the trainer must find the data in the channel and leave the model in SM_MODEL_DIR.

With the user's code in the submit directory, a custom model from it trains on both hosts the same way,
and a user's script runs after the toolkit's own step installed its requirements.txt.

Host names are the loopback addresses 127.0.0.1 and 127.0.0.2: the toolkit and the container module
wait until every host in resourceconfig.json resolves (``socket.gethostbyname``) and the container
sets MASTER_ADDR to the first, and an address resolves as itself on any machine, without /etc/hosts
or a resolver shim. The container fixes MASTER_PORT at 7777 (clouds.md §1.6), so the test needs that
port free on this machine.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import tarfile
from pathlib import Path
from typing import Callable

import boto3
import pytest
import torch

from cloud_adapters import packaging
from cloud_adapters.base import JobSpec
from trainer_pkg.metrics import METRIC_PREFIX, parse_metric_line
from sagemaker_standin import BUCKET, submit_and_capture

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "trainer_pkg"))
from test_platforms import clean_env, rank_lines, run_all, write_npz  # noqa: E402
from test_trainer_datasets import _csv, _image_tree  # noqa: E402
from trainer_helpers import records  # noqa: E402
from user_code_kit import (  # noqa: E402
    DEP_MARK, DEP_NAME, DEP_VERSION, MODEL_FILES, SCRIPT_FILES, SECRET_NAME, build_user_model, build_wheel,
    code_bundle, script_metrics, script_ranks_done)

HOSTS = ["127.0.0.1", "127.0.0.2"]
CONTAINER_MASTER_PORT = 7777  # sagemaker_pytorch_container.training.MASTER_PORT


def _csv_table(path: Path) -> Path:
    """96 rows, 2 features, 3 classes a linear model separates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return _csv(path, [f"{i % 3 * 4 + i * 0.01:.2f},{i % 3 - 1},{i % 3}" for i in range(96)], header="a,b,kind")


# format → (write the dataset under a directory: its path, the S3 key below datasets/, data config extras)
DATASETS = {
    "npz": (lambda d: write_npz(d / "tiny.npz"), "tiny.npz", {}),
    "csv": (lambda d: _csv_table(d / "rows.csv"), "rows.csv", {"label_column": "kind"}),
    "imagefolder": (lambda d: _image_tree(d / "imgs", per_class=8), "imgs/", {"image_size": 8}),
}


def _upload(s3, source: Path, key: str) -> None:
    """``source`` (a file, or a tree put under the prefix ``key``) into BUCKET."""
    if source.is_file():
        s3.upload_file(str(source), BUCKET, key)
        return
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        s3.upload_file(str(path), BUCKET, key + path.relative_to(source).as_posix())


def _channel_from_s3(s3, uri: str, channel: Path) -> list[str]:
    """What SageMaker puts in a channel of S3DataType S3Prefix: every object under the prefix, at its
    key relative to the prefix's last ``/``. Returns the relative paths written."""
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    base = prefix[: prefix.rfind("/") + 1]
    written = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(base):]
            (channel / rel).parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(channel / rel))
            written.append(rel)
    return sorted(written)


def _sagemaker_host(root: Path, host: str, request: dict, s3) -> Path:
    """/opt/ml under ``root`` as SageMaker lays it out for ``host`` before the container starts;
    the train channel's directory."""
    config = root / "input" / "config"
    config.mkdir(parents=True)
    (config / "hyperparameters.json").write_text(json.dumps(request["HyperParameters"]))
    itype = request["ResourceConfig"]["InstanceType"]
    (config / "resourceconfig.json").write_text(json.dumps({
        "current_host": host, "current_instance_type": itype, "current_group_name": "homogeneousCluster",
        "hosts": HOSTS, "instance_groups": [{"instance_group_name": "homogeneousCluster",
                                             "instance_type": itype, "hosts": HOSTS}],
        "network_interface_name": "lo"}))
    (config / "inputdataconfig.json").write_text(json.dumps({
        c["ChannelName"]: {"TrainingInputMode": c["InputMode"], "RecordWrapperType": "None",
                           "S3DistributionType": c["DataSource"]["S3DataSource"]["S3DataDistributionType"]}
        for c in request["InputDataConfig"]}))
    # Mounted by SageMaker before the container starts (the toolkit writes output/success into it).
    for mount in ("model", "output/data", request["CheckpointConfig"]["LocalPath"].replace("/opt/ml/", "")):
        (root / mount).mkdir(parents=True, exist_ok=True)
    [channel_config] = request["InputDataConfig"]
    channel = root / "input" / "data" / channel_config["ChannelName"]
    channel.mkdir(parents=True)
    assert _channel_from_s3(s3, channel_config["DataSource"]["S3DataSource"]["S3Uri"], channel)
    return channel


def _why(log: str) -> str:
    """The trainer's and launcher's error lines of a host's log, then its tail (the toolkit's report)."""
    errors = [line for line in log.splitlines() if "trainer error" in line or "invalid config" in line]
    return "\n".join(errors[:5] + [log[-2000:]])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds: TIME_WAIT is no obstacle
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _run_on_two_hosts(tmp_path: Path, toolkit: Path, moto_server: str, request: dict, s3,
                      host_env: Callable[[Path], dict[str, str]] = lambda root: {},
                      ) -> tuple[list[Path], list[Path], tuple[str, str], tuple[str, str]]:
    """Both hosts of ``request`` laid out under ``tmp_path`` and the toolkit run on each at once, with
    the request's Environment plus ``host_env(root)``; (the /opt/ml roots, the train channels, (stdout,
    stderr) of host 1 and of host 2). Asserts both exited 0, showing their errors otherwise."""
    roots = [tmp_path / f"host{i + 1}" / "opt" / "ml" for i in range(len(HOSTS))]
    channels, commands = [], []
    for root, host in zip(roots, HOSTS):
        channels.append(_sagemaker_host(root, host, request, s3))
        env = clean_env(**request["Environment"], SAGEMAKER_BASE_DIR=str(root),
                        SAGEMAKER_TRAINING_MODULE="sagemaker_pytorch_container.training:main",
                        TRAINING_JOB_NAME=request["TrainingJobName"], AWS_REGION="us-east-1",
                        S3_ENDPOINT_URL=moto_server, AWS_ENDPOINT_URL=moto_server, PYTHONPATH="")
        env.update(host_env(root))
        commands.append(([str(toolkit)], env))
    (code0, out0, err0), (code1, out1, err1) = run_all(commands, timeout=420)
    assert code0 == 0 and code1 == 0, (_why(out0 + err0), _why(out1 + err1))
    return roots, channels, (out0, err0), (out1, err1)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(DATASETS))
def test_toolkit_trains_an_s3_dataset_on_two_hosts(tmp_path, sagemaker_toolkit, moto_server, fmt):
    assert _port_free(CONTAINER_MASTER_PORT), (
        f"port {CONTAINER_MASTER_PORT} is in use on this machine; the SageMaker PyTorch container fixes its "
        "MASTER_PORT there — stop what listens on it (ss -ltnp) and run the test again")
    write, key, extra = DATASETS[fmt]
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=moto_server)
    _upload(s3, write(tmp_path / "dataset"), f"datasets/{key}")
    dataset_uri = f"s3://{BUCKET}/datasets/{key}"
    config = {"data": {"format": fmt, "uri": dataset_uri, **extra},
              "model": {"arch": "mlp", "params": {"hidden_size": 16}},
              "parallel": {"strategy": "ddp", "procs_per_node": 2, "timeout_s": 120},
              "train": {"epochs": 1, "batch_size": 8, "log_every_steps": 1, "lr": 0.05}}
    request, archive = submit_and_capture(
        JobSpec(job_name=f"tb-job-7-{fmt}", config=config, dataset_uri=dataset_uri, nodes=2, procs_per_node=2,
                instance_type="ml.m5.xlarge", max_runtime_s=1800), endpoint_url=moto_server)
    assert request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == dataset_uri
    assert json.loads(request["HyperParameters"]["data.uri"]) == dataset_uri

    roots, channels, (out0, err0), (out1, err1) = _run_on_two_hosts(tmp_path, sagemaker_toolkit, moto_server,
                                                                   request, s3)

    # The toolkit fetched the archive the adapter uploaded and ran its entry script on both hosts.
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        members = {m.name for m in tar.getmembers()}
    for root in roots:
        unpacked = {p.relative_to(root / "code").as_posix() for p in (root / "code").rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts}
        assert unpacked == members
        assert (root / "output" / "success").is_file() and not (root / "output" / "failure").exists()
    logs = out0 + err0
    assert f"platform: sagemaker (SM_HOSTS is set), node_rank 0 of 2 node(s) × 2 process(es) per node = world " \
           f"size 4, master {HOSTS[0]}:{CONTAINER_MASTER_PORT}" in logs
    assert rank_lines(out0) == {(0, 0, 0, 4), (1, 1, 0, 4)} and rank_lines(out1) == {(2, 0, 1, 4), (3, 1, 1, 4)}

    model_dir = roots[0] / "model"  # SM_MODEL_DIR of the first host
    state = torch.load(model_dir / "model.pt", map_location="cpu", weights_only=True)
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    assert not any(k.startswith("module.") for k in state)
    recs = records(model_dir)
    assert recs[0]["event"] == "started" and recs[-1]["event"] == "completed"
    assert [r["epoch"] for r in recs if r["event"] == "epoch"] == [0]
    ckpt = torch.load(roots[0] / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    data = ckpt["config"]["data"]
    expected = channels[0] if key.endswith("/") else channels[0] / key
    assert (data["format"], data["uri"]) == (fmt, str(expected))
    assert ckpt["config"]["output"]["output_dir"] == str(model_dir)
    assert (roots[0] / "output" / "data" / "metrics.jsonl").is_file()


def _npz_job(tmp_path: Path, moto_server: str) -> tuple[object, str]:
    """The npz dataset in moto's S3 (4 classes of 8 features); (the S3 client, its URI)."""
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=moto_server)
    _upload(s3, write_npz(tmp_path / "dataset" / "tiny.npz"), "datasets/tiny.npz")
    return s3, f"s3://{BUCKET}/datasets/tiny.npz"


@pytest.mark.slow
def test_toolkit_trains_a_custom_model_from_the_users_code(tmp_path, sagemaker_toolkit, moto_server):
    assert _port_free(CONTAINER_MASTER_PORT), f"port {CONTAINER_MASTER_PORT} is in use on this machine"
    s3, dataset_uri = _npz_job(tmp_path, moto_server)
    code = code_bundle(tmp_path / "store", MODEL_FILES)
    config = {"data": {"format": "npz", "uri": dataset_uri},
              "model": {"arch": "custom", "entry_point": "usermodel.net:build", "params": {"width": 16}},
              "parallel": {"strategy": "ddp", "procs_per_node": 2, "timeout_s": 120},
              "train": {"epochs": 2, "batch_size": 8, "log_every_steps": 1, "lr": 0.05}}
    request, _ = submit_and_capture(
        JobSpec(job_name="tb-job-8-custom", config=config, dataset_uri=dataset_uri, nodes=2, procs_per_node=2,
                instance_type="ml.m5.xlarge", max_runtime_s=1800, code=code), endpoint_url=moto_server)
    roots, _, (out0, err0), (out1, _) = _run_on_two_hosts(tmp_path, sagemaker_toolkit, moto_server, request, s3)

    code_dir = roots[0] / "code"  # the toolkit unpacked the user's files beside trainer_pkg/
    assert (code_dir / "usermodel" / "net.py").read_text() == MODEL_FILES["usermodel/net.py"]
    assert f"user code: sha256 {code.sha256} in " in out0 + err0
    assert rank_lines(out0) == {(0, 0, 0, 4), (1, 1, 0, 4)} and rank_lines(out1) == {(2, 0, 1, 4), (3, 1, 1, 4)}

    model_dir = roots[0] / "model"
    recs = records(model_dir)
    assert recs[0]["event"] == "started" and recs[-1]["event"] == "completed"
    assert [r["epoch"] for r in recs if r["event"] == "epoch"] == [0, 1]
    # model.pt is the bare state dict of the user's own module: it loads into a fresh build().
    model = build_user_model(code_dir, num_classes=4, input_shape=(8,), width=16)
    model.load_state_dict(torch.load(model_dir / "model.pt", map_location="cpu", weights_only=True), strict=True)
    assert type(model[2]).__name__ == "Block"


@pytest.mark.slow
def test_toolkit_installs_the_requirements_and_runs_the_users_script(tmp_path, sagemaker_toolkit, moto_server):
    """The toolkit's own requirements step (pip install -r requirements.txt in the code directory) installs
    the wheel from a local directory (PIP_NO_INDEX/PIP_FIND_LINKS; PIP_TARGET keeps the cached toolkit
    virtualenv unchanged, and PYTHONPATH finds the target as the image's site-packages would be found)."""
    assert _port_free(CONTAINER_MASTER_PORT), f"port {CONTAINER_MASTER_PORT} is in use on this machine"
    s3, dataset_uri = _npz_job(tmp_path, moto_server)
    code = code_bundle(tmp_path / "store", SCRIPT_FILES)
    wheels = build_wheel(tmp_path / "wheels")
    config = {"data": {"format": "npz", "uri": dataset_uri}, "parallel": {"procs_per_node": 2, "timeout_s": 120},
              "code": {"script": "train.py", "args": ["--steps", "3", "--tag", "sm"]}}
    request, _ = submit_and_capture(
        JobSpec(job_name="tb-job-8-script", config=config, dataset_uri=dataset_uri, nodes=2, procs_per_node=2,
                instance_type="ml.m5.xlarge", max_runtime_s=1800, code=code,
                secret_env={SECRET_NAME: "sm-secret-52"}), endpoint_url=moto_server)
    assert request["Environment"][SECRET_NAME] == "sm-secret-52"

    def pip_env(root: Path) -> dict[str, str]:
        site = root.parent / "site-packages"
        return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_TARGET": str(site),
                "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONPATH": str(site)}

    roots, _, (out0, err0), (out1, err1) = _run_on_two_hosts(tmp_path, sagemaker_toolkit, moto_server, request, s3,
                                                             host_env=pip_env)
    for root, log in zip(roots, (out0 + err0, out1 + err1)):
        assert "Installing dependencies from requirements.txt" in log  # the toolkit's step, on each host
        assert (root.parent / "site-packages" / DEP_NAME / "__init__.py").is_file()
        assert (root / "code" / "requirements.txt").read_text() == code.requirements
    assert script_ranks_done(out0 + out1, "sm") == [0, 1, 2, 3]

    # The script's custom metrics in the log, from rank 0 only, with the requirement's value.
    metrics = script_metrics(out0)
    assert [(m["step"], m["my_metric"], m["dep_mark"]) for m in metrics] == [
        (1, 1.5, float(DEP_MARK)), (2, 3.0, float(DEP_MARK)), (3, 4.5, float(DEP_MARK))]
    assert all(m["user_metrics"] == ["my_metric", "dep_mark"] for m in metrics)
    assert not script_metrics(out1)
    written = json.loads((roots[0] / "model" / "user_model.json").read_text())  # SM_MODEL_DIR of host 1
    assert written == {"tag": "sm", "world_size": 4, "dep": DEP_VERSION, "cwd": str(roots[0] / "code"),
                       "secret": "sm-secret-52"}
    launcher_lines = [line for line in (out0 + err0).splitlines() if "[launch]" in line or "trainer" in line]
    assert launcher_lines and not any("sm-secret-52" in line for line in launcher_lines)
