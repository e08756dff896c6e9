"""One launcher for every platform: each platform's environment and directory layout recreated under
tmp_path, 2 "nodes" × 2 processes on 127.0.0.1, the real trainer (gloo, CPU) on a tiny NPZ.

Every rank the launcher runs prints ``[launch] rank R (local rank L, node_rank N) of world size W``;
the tests read those lines from each node's log, and the trainer's own outputs (metrics.jsonl,
model.pt, checkpoints/last.pt with the resolved config) from the platform's directories.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer_helpers import REPO, records
from trainer_pkg.config import ConfigError, JobConfig, apply_overrides, parse_string_value
from trainer_pkg.platforms import LAUNCHED_BY_US, PlatformError, detect, gcs_fuse_path, plan
from trainer_pkg.train import load_checkpoint
from user_scripts import ENV_SCRIPT, seen_env, write_code

RANK_LINE = re.compile(r"\[launch\] rank (\d+) \(local rank (\d+), node_rank (\d+)\) of world size (\d+)")
PLATFORM_PREFIXES = ("SM_", "AZUREML_", "AZ_BATCH", "AZURE_ML_", "AIP_", "TRAINBOARD_", "PET_", "TORCHELASTIC_")
PLATFORM_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "CLUSTER_SPEC", "TF_CONFIG", "CLOUD_ML_JOB_ID", "TRAINING_JOB_ARN",
                 "SAGEMAKER_BASE_DIR")

SAMPLING = "TRAINBOARD_HARDWARE_EVERY_S"
"""trainer_pkg.hardware.EVERY_ENV."""

# -- helpers ---------------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """This test process's environment without any platform's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in PLATFORM_VARS and not k.startswith(PLATFORM_PREFIXES)}
    if SAMPLING in os.environ:  # the session's setting (off: tests/conftest.py), not a platform's variable
        env[SAMPLING] = os.environ[SAMPLING]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_npz(path: Path) -> Path:
    """128 samples of 8 features in 4 linearly separable classes, with a 32-sample validation split."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 8)) * 3
    y = rng.integers(0, 4, size=128)
    x = (centers[y] + rng.normal(size=(128, 8))).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x_train=x[:96], y_train=y[:96], x_val=x[96:], y_val=y[96:])
    return path


def write_config(path: Path, **sections) -> Path:
    cfg = {"data": {"format": "npz", "uri": "/nonexistent/tiny.npz"},
           "model": {"arch": "mlp", "params": {"hidden_size": 16}},
           "parallel": {"procs_per_node": 2, "timeout_s": 60},
           "train": {"epochs": 1, "batch_size": 8, "log_every_steps": 1, "lr": 0.05}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


def launcher(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer_pkg.launch", "--config", str(config), *extra]


def run_all(commands: list[tuple[list[str], dict[str, str]]], timeout: float = 120) -> list[tuple[int, str, str]]:
    """Start every (argv, env) at once; (exit code, stdout, stderr) of each, in order."""
    procs = [subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd, env in commands]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    finally:
        for p in procs:  # a hung run: SIGTERM lets the launcher pass it on to its torchrun
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    return results


def rank_lines(stdout: str) -> set[tuple[int, int, int, int]]:
    """{(rank, local rank, node rank, world size)} printed by the ranks in ``stdout``."""
    return {tuple(map(int, m.groups())) for m in RANK_LINE.finditer(stdout)}


def assert_trained_4_ranks(output_dir: Path, checkpoint_dir: Path) -> dict:
    """The outputs a 4-rank, 1-epoch run leaves; returns the config the ranks ran with."""
    recs = records(output_dir)
    assert [r["event"] for r in recs][0] == "started" and recs[-1]["event"] == "completed"
    assert [r["epoch"] for r in recs if r["event"] == "epoch"] == [0]
    assert all(r["world_size"] == 4 for r in recs[:-1])
    windows = [r["rank_samples_per_s"] for r in recs if "rank_samples_per_s" in r]  # absent: no step since
    assert windows and all(len(w) == 4 and all(v > 0 for v in w) for w in windows)
    assert recs[-1]["step"] == 3  # 96 training samples / (4 ranks × 8 per step)
    state = torch.load(output_dir / "model.pt", map_location="cpu", weights_only=True)
    assert state and not any(k.startswith("module.") for k in state)
    ckpt = load_checkpoint(str(checkpoint_dir / "last.pt"))
    assert ckpt["world_size"] == 4 and len(ckpt["rng"]) == 4 and ckpt["epoch"] == 1
    return ckpt["config"]


# -- SageMaker -------------------------------------------------------------------------------------


def sagemaker_layout(root: Path, host: str, hosts: list[str], port: int, hps: dict[str, str]) -> dict[str, str]:
    """/opt/ml as the training toolkit lays it out (clouds.md §1.5), under ``root``; its SM_* env."""
    (root / "input" / "config").mkdir(parents=True)
    (root / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hps))
    (root / "input" / "config" / "resourceconfig.json").write_text(json.dumps(
        {"current_host": host, "hosts": hosts, "network_interface_name": "lo"}))
    write_npz(root / "input" / "data" / "train" / "tiny.npz")
    for d in ("model", "checkpoints", "output/data"):
        (root / d).mkdir(parents=True, exist_ok=True)
    return {
        "TRAINBOARD_SM_ROOT": str(root), "SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": host,
        "SM_NUM_GPUS": "0", "SM_NUM_CPUS": "2", "SM_CHANNELS": '["train"]',
        "SM_CHANNEL_TRAIN": str(root / "input" / "data" / "train"), "SM_MODEL_DIR": str(root / "model"),
        "SM_OUTPUT_DATA_DIR": str(root / "output" / "data"), "SM_INPUT_CONFIG_DIR": str(root / "input" / "config"),
        "SM_NETWORK_INTERFACE_NAME": "lo", "TRAINING_JOB_NAME": "tb-test", "MASTER_PORT": str(port),
    }


# What the SageMaker SDK sends (JSON-encoded) mixed with raw console strings ("False").
SM_HYPERPARAMETERS = {
    "epochs": "1", "batch_size": "8", "lr": "0.1", "model.arch": '"mlp"', "augment": "False",
    "train.log_every_steps": "1", "sagemaker_program": '"train.py"',
    "sagemaker_torch_distributed_enabled": "true", "sagemaker_job_name": '"tb-test"',
}


def test_sagemaker_two_hosts_two_processes(tmp_path):
    # Loopback addresses as host names: both resolve to this machine; sorted, 127.0.0.1 is the master.
    hosts, port = ["127.0.0.1", "127.0.0.2"], free_port()
    config = write_config(tmp_path / "job.json", data={"uri": "s3://bucket/data/train/tiny.npz"},
                          train={"epochs": 3, "lr": 0.5, "augment": True},  # hyperparameters override
                          output={"output_dir": "s3://bucket/out"})
    roots = [tmp_path / f"node{i}" / "opt" / "ml" for i in range(2)]
    envs = [clean_env(**sagemaker_layout(roots[i], hosts[i], hosts, port, SM_HYPERPARAMETERS)) for i in range(2)]
    (n0, out0, err0), (n1, out1, err1) = run_all([(launcher(config), envs[0]), (launcher(config), envs[1])])
    assert n0 == 0 and n1 == 0, (err0[-3000:], err1[-3000:])

    assert "[launch] platform: sagemaker (SM_HOSTS is set), node_rank 0 of 2 node(s) × 2 process(es) " \
           "per node = world size 4, master 127.0.0.1:%d" % port in out0
    assert "node_rank 1 of 2 node(s) × 2 process(es)" in out1
    assert rank_lines(out0) == {(0, 0, 0, 4), (1, 1, 0, 4)}
    assert rank_lines(out1) == {(2, 0, 1, 4), (3, 1, 1, 4)}

    # Outputs in the platform's directories, not the config's s3:// ones.
    cfg = assert_trained_4_ranks(roots[0] / "model", roots[0] / "checkpoints")
    assert cfg["output"]["output_dir"] == str(roots[0] / "model")
    assert cfg["output"]["checkpoint_dir"] == str(roots[0] / "checkpoints")
    assert cfg["data"]["uri"] == str(roots[0] / "input" / "data" / "train" / "tiny.npz")
    assert (roots[0] / "output" / "data" / "metrics.jsonl").read_text() == (roots[0] / "model" / "metrics.jsonl").read_text()
    assert not (roots[0] / "output" / "failure").exists()
    # String hyperparameters parsed to their declared types ("False" is False: augment on flat
    # features would have failed the run).
    assert cfg["train"]["augment"] is False
    assert cfg["train"]["epochs"] == 1 and cfg["train"]["batch_size"] == 8 and cfg["train"]["lr"] == 0.1
    assert cfg["model"]["arch"] == "mlp"
    assert cfg["parallel"]["nodes"] == 2 and cfg["parallel"]["procs_per_node"] == 2
    assert all(r["lr"] == 0.1 for r in records(roots[0] / "model"))


# -- Vertex AI -------------------------------------------------------------------------------------


def vertex_env(tmp_path: Path, pool: str, index: int, machine: int, port: int) -> dict[str, str]:
    return clean_env(**vertex_vars(tmp_path, pool, index, machine, port))


def vertex_vars(tmp_path: Path, pool: str, index: int, machine: int, port: int) -> dict[str, str]:
    """A Vertex replica's variables (clouds.md §2.3): CLUSTER_SPEC, per-MACHINE RANK/WORLD_SIZE."""
    spec = {"cluster": {"workerpool0": ["127.0.0.1:2222"], "workerpool1": ["127.0.0.2:2222"]},
            "environment": "cloud", "task": {"type": pool, "index": index, "trial": ""},
            "job": json.dumps({"python_module": "trainer_pkg.launch"})}
    return dict(
        CLUSTER_SPEC=json.dumps(spec), RANK=str(machine), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), CLOUD_ML_JOB_ID="1234567890", AIP_MODEL_DIR="gs://bucket/job/model/",
        AIP_CHECKPOINT_DIR="gs://bucket/job/checkpoints/", AIP_TENSORBOARD_LOG_DIR="gs://bucket/job/logs/",
        TRAINBOARD_GCS_ROOT=str(tmp_path / "gcs"), CUDA_VISIBLE_DEVICES="")


def test_vertex_two_machines_two_processes(tmp_path):
    port = free_port()
    write_npz(tmp_path / "gcs" / "bucket" / "data" / "tiny.npz")  # what /gcs/bucket/... mounts
    config = write_config(tmp_path / "job.json", data={"uri": "gs://bucket/data/tiny.npz"},
                          output={"output_dir": "gs://bucket/elsewhere"})
    envs = [vertex_env(tmp_path, "workerpool0", 0, 0, port), vertex_env(tmp_path, "workerpool1", 0, 1, port)]
    (n0, out0, err0), (n1, out1, err1) = run_all([(launcher(config), envs[0]), (launcher(config), envs[1])])
    assert n0 == 0 and n1 == 0, (err0[-3000:], err1[-3000:])

    assert "[launch] platform: vertex (CLUSTER_SPEC is set), node_rank 0 of 2 node(s) × 2 process(es)" in out0
    assert "[launch] platform: vertex (CLUSTER_SPEC is set), node_rank 1 of 2 node(s) × 2 process(es)" in out1
    # Vertex's per-machine RANK 0/1, WORLD_SIZE 2 became per-process ranks 0-3 of 4.
    assert rank_lines(out0) == {(0, 0, 0, 4), (1, 1, 0, 4)}
    assert rank_lines(out1) == {(2, 0, 1, 4), (3, 1, 1, 4)}

    model_dir, ckpt_dir = tmp_path / "gcs" / "bucket" / "job" / "model", tmp_path / "gcs" / "bucket" / "job" / "checkpoints"
    cfg = assert_trained_4_ranks(model_dir, ckpt_dir)
    assert cfg["output"]["output_dir"] == str(model_dir) and cfg["output"]["checkpoint_dir"] == str(ckpt_dir)
    assert cfg["data"]["uri"] == str(tmp_path / "gcs" / "bucket" / "data" / "tiny.npz")
    assert not (tmp_path / "gcs" / "bucket" / "elsewhere").exists()


# -- Azure ML --------------------------------------------------------------------------------------


def azure_env(tmp_path: Path, rank: int, port: int) -> dict[str, str]:
    return clean_env(**azure_vars(tmp_path, rank, port))


def azure_vars(tmp_path: Path, rank: int, port: int) -> dict[str, str]:
    """What Azure ML's PyTorch distribution gives each process it starts (clouds.md §3.4)."""
    return dict(
        AZUREML_RUN_ID="tb-test_1700000000_abcd", AZUREML_ARM_SUBSCRIPTION="0000",
        AZUREML_ARM_WORKSPACE_NAME="ws", RANK=str(rank), LOCAL_RANK=str(rank % 2), WORLD_SIZE="4",
        NODE_RANK=str(rank // 2), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        AZURE_ML_OUTPUT_model=str(tmp_path / "az" / "outputs" / "model"),
        AZURE_ML_OUTPUT_checkpoints=str(tmp_path / "az" / "outputs" / "checkpoints"),
        AZURE_ML_INPUT_data=str(tmp_path / "az" / "inputs" / "data"))


def test_azureml_processes_started_by_the_platform(tmp_path):
    port = free_port()
    write_npz(tmp_path / "az" / "inputs" / "data" / "tiny.npz")
    config = write_config(tmp_path / "job.json",
                          data={"uri": "azureml://datastores/workspaceblobstore/paths/tiny.npz"})
    results = run_all([(launcher(config), azure_env(tmp_path, r, port)) for r in range(4)])
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, (rank, err[-3000:])
        assert rank_lines(out) == {(rank, rank % 2, rank // 2, 4)}
    assert "[launch] platform: azureml (AZUREML_RUN_ID is set), node_rank 0 of 2 node(s) × 2 process(es) " \
           "per node = world size 4, master 127.0.0.1:%d, ranks already started" % port in results[0][1]
    assert "node_rank 1 of 2 node(s)" in results[2][1]
    assert "[launch] platform" not in results[1][1]  # one plan line per node, from its local rank 0

    outputs = tmp_path / "az" / "outputs"
    cfg = assert_trained_4_ranks(outputs / "model", outputs / "checkpoints")
    assert cfg["output"]["output_dir"] == str(outputs / "model")
    assert cfg["data"]["uri"] == str(tmp_path / "az" / "inputs" / "data" / "tiny.npz")


# -- torchrun, two nodes ---------------------------------------------------------------------------


def test_torchrun_two_nodes_train_in_process(tmp_path):
    port = free_port()
    data = write_npz(tmp_path / "tiny.npz")
    config = write_config(tmp_path / "job.json", data={"uri": str(data)},
                          output={"output_dir": str(tmp_path / "out")}, parallel={"nodes": 2})
    cmds = [([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
              "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", str(port),
              "-m", "trainer_pkg.launch", "--config", str(config)], clean_env()) for n in range(2)]
    (n0, out0, err0), (n1, out1, err1) = run_all(cmds)
    assert n0 == 0 and n1 == 0, (err0[-3000:], err1[-3000:])
    assert "[launch] platform: torchrun (RANK, LOCAL_RANK and WORLD_SIZE are set), node_rank 0 of 2" in out0
    assert rank_lines(out0) == {(0, 0, 0, 4), (1, 1, 0, 4)}
    assert rank_lines(out1) == {(2, 0, 1, 4), (3, 1, 1, 4)}
    assert_trained_4_ranks(tmp_path / "out", tmp_path / "out" / "checkpoints")


# -- a user's script on each platform: torchrun's variables and the platform's directories --------


def script_config(tmp_path: Path, **sections) -> tuple[Path, Path]:
    """A job whose code.script is ENV_SCRIPT (records each rank's environment into tmp_path/seen);
    returns (job.json, the seen directory)."""
    code_dir = write_code(tmp_path / "code", ENV_SCRIPT)
    seen = tmp_path / "seen"
    seen.mkdir()
    config = write_config(tmp_path / "job.json", code={"dir": str(code_dir), "script": "train.py",
                                                      "args": ["--env-out", str(seen)]}, **sections)
    return config, seen


def assert_ranks_saw(seen: Path, port: int, dirs_by_node: dict[int, dict[str, str]]) -> None:
    """Ranks 0-3 (2 nodes × 2 processes) saw torchrun's variables and their node's TRAINBOARD_* dirs."""
    envs = seen_env(seen)
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, env in envs.items():
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank), str(rank % 2), "4", "2")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(port))
        got = {k: env[k] for k in ("TRAINBOARD_MODEL_DIR", "TRAINBOARD_CHECKPOINT_DIR", "TRAINBOARD_DATA_DIR")}
        assert got == dirs_by_node[rank // 2], rank
        assert env["TRAINBOARD_CODE_DIR"] == env["cwd"] == str(seen.parent / "code")


def test_script_on_sagemaker_sees_the_containers_directories(tmp_path):
    hosts, port = ["127.0.0.1", "127.0.0.2"], free_port()
    config, seen = script_config(tmp_path, data={"uri": "s3://bucket/data/train/tiny.npz"},
                                 output={"output_dir": "s3://bucket/out"})
    roots = [tmp_path / f"node{i}" / "opt" / "ml" for i in range(2)]
    envs = [clean_env(**sagemaker_layout(roots[i], hosts[i], hosts, port, {})) for i in range(2)]
    results = run_all([(launcher(config), envs[0]), (launcher(config), envs[1])])
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert_ranks_saw(seen, port, {n: {
        "TRAINBOARD_MODEL_DIR": str(roots[n] / "model"), "TRAINBOARD_CHECKPOINT_DIR": str(roots[n] / "checkpoints"),
        "TRAINBOARD_DATA_DIR": str(roots[n] / "input" / "data" / "train" / "tiny.npz")} for n in range(2)})


def test_script_on_vertex_sees_the_gcs_directories(tmp_path):
    port = free_port()
    config, seen = script_config(tmp_path, data={"uri": "gs://bucket/data/tiny.npz"})
    envs = [vertex_env(tmp_path, "workerpool0", 0, 0, port), vertex_env(tmp_path, "workerpool1", 0, 1, port)]
    results = run_all([(launcher(config), envs[0]), (launcher(config), envs[1])])
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    gcs = tmp_path / "gcs" / "bucket"
    dirs = {"TRAINBOARD_MODEL_DIR": str(gcs / "job" / "model"), "TRAINBOARD_CHECKPOINT_DIR": str(gcs / "job" / "checkpoints"),
            "TRAINBOARD_DATA_DIR": str(gcs / "data" / "tiny.npz")}
    assert_ranks_saw(seen, port, {0: dirs, 1: dirs})


def test_script_on_azureml_runs_in_each_process_the_platform_started(tmp_path):
    port = free_port()
    write_npz(tmp_path / "az" / "inputs" / "data" / "tiny.npz")
    config, seen = script_config(tmp_path, data={"uri": "azureml://datastores/workspaceblobstore/paths/tiny.npz"})
    results = run_all([(launcher(config), azure_env(tmp_path, r, port)) for r in range(4)])
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, (rank, err[-2000:])
        assert rank_lines(out) == {(rank, rank % 2, rank // 2, 4)}  # this process ran the script itself
    az = tmp_path / "az"
    dirs = {"TRAINBOARD_MODEL_DIR": str(az / "outputs" / "model"),
            "TRAINBOARD_CHECKPOINT_DIR": str(az / "outputs" / "checkpoints"),
            "TRAINBOARD_DATA_DIR": str(az / "inputs" / "data" / "tiny.npz")}
    assert_ranks_saw(seen, port, {0: dirs, 1: dirs})  # LOCAL_WORLD_SIZE, which Azure does not set: 2


# -- a missing or malformed variable fails fast with exit code 2, naming it ------------------------


def _sm(tmp_path: Path) -> dict[str, str]:
    return sagemaker_layout(tmp_path / "opt" / "ml", "algo-1", ["algo-1", "algo-2"], 7777, SM_HYPERPARAMETERS)


def _vx(tmp_path: Path) -> dict[str, str]:
    return vertex_vars(tmp_path, "workerpool1", 0, 1, 29500)


def _az(tmp_path: Path) -> dict[str, str]:
    return azure_vars(tmp_path, 1, 29500)


CASES = {
    "sagemaker-current-host": (_sm, {"SM_CURRENT_HOST": None, "file:resourceconfig.json": None},
                               "SageMaker: SM_CURRENT_HOST is not set"),
    "sagemaker-hosts-json": (_sm, {"SM_HOSTS": "algo-1,algo-2"}, "SageMaker: SM_HOSTS is not valid JSON"),
    "sagemaker-gpus": (_sm, {"SM_NUM_GPUS": "four"}, "SageMaker: SM_NUM_GPUS is not an integer: 'four'"),
    "sagemaker-hyperparameter": (_sm, {"hp:epochs": "three"}, "train.epochs: expected an integer, got 'three'"),
    "vertex-cluster-spec-json": (_vx, {"CLUSTER_SPEC": "{cluster: 1"}, "Vertex AI: CLUSTER_SPEC is not valid JSON: "),
    "vertex-cluster-spec": (_vx, {"CLUSTER_SPEC": None}, "Vertex AI: CLUSTER_SPEC is not set"),
    "vertex-master-addr": (_vx, {"MASTER_ADDR": None}, "Vertex AI: MASTER_ADDR is not set"),
    "vertex-rank-mismatch": (_vx, {"RANK": "0"}, "Vertex AI: RANK is 0 but CLUSTER_SPEC's task is machine 1"),
    "azureml-local-rank": (_az, {"LOCAL_RANK": None}, "Azure ML: LOCAL_RANK is not set"),
    "azureml-master-port": (_az, {"MASTER_PORT": None}, "Azure ML: MASTER_PORT is not set"),
    "torchrun-partial": (lambda p: {"RANK": "0", "WORLD_SIZE": "2"}, {}, "torchrun: RANK, WORLD_SIZE set but LOCAL_RANK not"),
}


@pytest.mark.parametrize("case", CASES)
def test_missing_or_malformed_variable_exits_2_naming_it(tmp_path, case):
    make, change, message = CASES[case]
    env = clean_env(**make(tmp_path))
    for key, value in change.items():
        if key.startswith("file:"):  # a custom image without the toolkit has only this file
            (Path(env["SM_INPUT_CONFIG_DIR"]) / key[5:]).unlink()
        elif key.startswith("hp:"):
            hp_file = Path(env["SM_INPUT_CONFIG_DIR"]) / "hyperparameters.json"
            hp_file.write_text(json.dumps({**json.loads(hp_file.read_text()), key[3:]: value}))
        elif value is None:
            env.pop(key)
        else:
            env[key] = value
    config = write_config(tmp_path / "job.json")
    started = time.monotonic()
    [(code, out, err)] = run_all([(launcher(config), env)], timeout=30)
    assert time.monotonic() - started < 10
    assert code == 2, (out, err)
    assert message in err
    assert err.startswith("trainer error: ")
    if make is _sm:  # SageMaker shows /opt/ml/output/failure as the job's FailureReason
        assert message in (tmp_path / "opt" / "ml" / "output" / "failure").read_text()


def test_platform_flag_overrides_detection(tmp_path):
    # Azure markers present, but --platform sagemaker: SageMaker's variables are required.
    env = clean_env(**_az(tmp_path))
    [(code, out, err)] = run_all([(launcher(write_config(tmp_path / "job.json"), "--platform", "sagemaker"), env)],
                                 timeout=30)
    assert code == 2, (out, err)
    assert "SageMaker: SM_HOSTS is not set" in err


# -- the readers and the string parsing, in process ------------------------------------------------


def test_detection_order_and_reasons(tmp_path):
    cfg = JobConfig()
    assert detect({}) == ("local", "no platform variables")
    assert detect({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})[0] == "torchrun"
    assert detect({"SM_HOSTS": '["algo-1"]', "TRAINBOARD_SM_ROOT": str(tmp_path)}) == ("sagemaker", "SM_HOSTS is set")
    assert detect({"CLUSTER_SPEC": "{}", "RANK": "0", "WORLD_SIZE": "2"}) == ("vertex", "CLUSTER_SPEC is set")
    assert detect({"AZUREML_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})[0] == "azureml"
    assert detect({"AZ_BATCH_NODE_ID": "tvm-1"}) == ("azureml", "AZ_BATCH_NODE_ID is set")
    # azure-ai-ml sets AZUREML_CURRENT_CLOUD in any process that submits jobs: not a marker
    assert detect({"AZUREML_CURRENT_CLOUD": "AzureCloud"}) == ("local", "no platform variables")
    # our own ranks, even on a cloud, are torchrun ranks with an already-resolved config
    ours = {LAUNCHED_BY_US: "sagemaker", "SM_HOSTS": "[]", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    assert detect(ours)[0] == "torchrun"
    assert detect({}, standalone=True) == ("local", "--standalone")
    # a resourceconfig.json alone (custom image without the toolkit) is SageMaker too
    (tmp_path / "input" / "config").mkdir(parents=True)
    (tmp_path / "input" / "config" / "resourceconfig.json").write_text(
        json.dumps({"current_host": "algo-2", "hosts": ["algo-2", "algo-1"]}))
    p = plan({"TRAINBOARD_SM_ROOT": str(tmp_path)}, cfg)
    assert (p.platform, p.nnodes, p.node_rank, p.master_addr, p.master_port) == ("sagemaker", 2, 1, "algo-1", 7777)
    assert p.nproc_per_node == cfg.parallel.procs_per_node and not p.in_process


def test_sagemaker_gpus_and_toolkit_started_torchrun(tmp_path):
    env = {"TRAINBOARD_SM_ROOT": str(tmp_path), "SM_HOSTS": '["algo-1","algo-2","algo-3"]',
           "SM_CURRENT_HOST": "algo-3", "SM_NUM_GPUS": "4", "SM_NETWORK_INTERFACE_NAME": "eth0"}
    p = plan(env, JobConfig())
    assert (p.nnodes, p.node_rank, p.nproc_per_node, p.world_size) == (3, 2, 4, 12)
    assert p.extra_env == {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_PROTO": "simple"}
    assert p.output_dir == str(tmp_path / "model") and p.checkpoint_dir == str(tmp_path / "checkpoints")
    # The toolkit's torch_distributed launcher already ran torchrun: train in place, same dirs.
    ranks = dict(env, RANK="9", LOCAL_RANK="1", WORLD_SIZE="12", LOCAL_WORLD_SIZE="4", GROUP_RANK="2",
                 MASTER_ADDR="algo-1", MASTER_PORT="7777", TORCHELASTIC_RUN_ID="none")
    p = plan(ranks, JobConfig())
    assert p.in_process and (p.nnodes, p.node_rank, p.nproc_per_node) == (3, 2, 4)
    assert p.output_dir == str(tmp_path / "model")


@pytest.mark.parametrize("fmt, uri, expected", [
    ("npz", "s3://bucket/data/tiny.npz", "tiny.npz"),
    ("csv", "s3://bucket/tables/rows.csv", "rows.csv"),
    ("imagefolder", "s3://bucket/images/", ""),
])
def test_sagemaker_channel_follows_the_hyperparameters(tmp_path, fmt, uri, expected):
    # The archive's job file holds only defaults (format builtin); the dataset arrives as
    # hyperparameters, JSON-encoded as the adapter sends them, and its data is in the train channel.
    channel = tmp_path / "input" / "data" / "train"
    (channel / "cat").mkdir(parents=True)
    for name in ("tiny.npz", "rows.csv"):
        (channel / name).write_bytes(b"x")
    hps = {"data.format": json.dumps(fmt), "data.uri": json.dumps(uri)}
    (tmp_path / "input" / "config").mkdir(parents=True)
    (tmp_path / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hps))
    env = {"TRAINBOARD_SM_ROOT": str(tmp_path), "SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1",
           "SM_CHANNEL_TRAIN": str(channel)}
    cfg = plan(env, JobConfig()).resolve(JobConfig())
    assert (cfg.data.format, cfg.data.uri) == (fmt, str(channel / expected) if expected else str(channel))
    # A built-in dataset, or a path that exists on this machine, is left alone.
    local = tmp_path / "here.npz"
    local.write_bytes(b"x")
    (tmp_path / "input" / "config" / "hyperparameters.json").write_text(
        json.dumps({"data.format": '"npz"', "data.uri": json.dumps(str(local))}))
    assert plan(env, JobConfig()).resolve(JobConfig()).data.uri == str(local)
    (tmp_path / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"data.name": '"digits"'}))
    assert plan(env, JobConfig()).resolve(JobConfig()).data.uri == JobConfig().data.uri


def test_azureml_input_follows_the_config(tmp_path):
    (tmp_path / "tiny.npz").write_bytes(b"x")
    cfg = JobConfig.from_dict({"data": {"format": "npz", "uri": "azureml://datastores/d/paths/tiny.npz"}})
    p = plan({"AZUREML_RUN_ID": "r", "AZURE_ML_INPUT_data": str(tmp_path)}, cfg)
    assert p.resolve(cfg).data.uri == str(tmp_path / "tiny.npz")
    assert plan({"AZUREML_RUN_ID": "r", "AZURE_ML_INPUT_data": str(tmp_path)}, JobConfig()).resolve(
        JobConfig()).data.uri == JobConfig().data.uri


def test_vertex_workers_and_gcs_paths():
    spec = {"cluster": {"workerpool0": ["c:1"], "workerpool1": ["w0:1", "w1:1", "w2:1"]},
            "task": {"type": "workerpool1", "index": 2}}
    env = {"CLUSTER_SPEC": json.dumps(spec), "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "c",
           "MASTER_PORT": "3333", "AIP_MODEL_DIR": "gs://b/m/", "CUDA_VISIBLE_DEVICES": "0,1"}
    p = plan(env, JobConfig())
    assert (p.nnodes, p.node_rank, p.nproc_per_node, p.master_addr, p.master_port) == (4, 3, 2, "c", 3333)
    assert p.output_dir == "/gcs/b/m" and p.checkpoint_dir is None
    assert gcs_fuse_path("gs://bucket/a/b", {"TRAINBOARD_GCS_ROOT": "/mnt/g"}) == "/mnt/g/bucket/a/b"
    bad = dict(env, CLUSTER_SPEC=json.dumps({**spec, "task": {"type": "workerpool2", "index": 0}}))
    with pytest.raises(PlatformError, match="task.type is 'workerpool2'"):
        plan(bad, JobConfig())
    single = plan({"CLOUD_ML_JOB_ID": "1", "CUDA_VISIBLE_DEVICES": ""}, JobConfig())
    assert (single.platform, single.nnodes, single.master_addr) == ("vertex", 1, "")


def test_azureml_and_local_plans():
    base = {"AZUREML_RUN_ID": "r", "AZURE_ML_OUTPUT_Model": "/mnt/out/model"}
    single = plan(base, JobConfig())  # no distribution configured: one process
    assert (single.platform, single.world_size, single.in_process, single.output_dir) == \
        ("azureml", 1, False, "/mnt/out/model")
    cfg = JobConfig.from_dict({"parallel": {"procs_per_node": 4}})
    p = plan(dict(base, RANK="6", LOCAL_RANK="2", WORLD_SIZE="8", MASTER_ADDR="10.0.0.4", MASTER_PORT="6105"), cfg)
    assert (p.nnodes, p.node_rank, p.nproc_per_node, p.in_process) == (2, 1, 4, True)
    assert p.extra_env == {"LOCAL_WORLD_SIZE": "4"}
    with pytest.raises(PlatformError, match="Azure ML: LOCAL_RANK 2 / WORLD_SIZE 6 do not fit 4"):
        plan(dict(base, RANK="5", LOCAL_RANK="2", WORLD_SIZE="6", MASTER_ADDR="a", MASTER_PORT="1"), cfg)
    local = plan({}, cfg, standalone=True)
    assert (local.platform, local.nnodes, local.nproc_per_node, local.in_process) == ("local", 1, 4, False)
    assert plan({}, cfg).world_size == 1
    assert plan({}, cfg, standalone=True, nproc=3).nproc_per_node == 3


@pytest.mark.parametrize("hint, raw, expected", [
    (bool, "False", False), (bool, "false", False), (bool, "True", True), (bool, '"false"', False),
    (int, "3", 3), (int, '"3"', 3), (int, " 12 ", 12), (float, "0.1", 0.1), (float, "3", 3.0),
    (str, '"digits"', "digits"), (str, "digits", "digits"), (str, "3", "3"), (str, "s3://b/k", "s3://b/k"),
])
def test_parse_string_value(hint, raw, expected):
    value = parse_string_value(hint, raw, "x.y")
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("hint, raw, error", [
    (bool, "yes", "x.y: expected true or false, got 'yes'"), (bool, "1", "x.y: expected true or false"),
    (int, "3.5", "x.y: expected an integer, got '3.5'"), (int, "true", "x.y: expected an integer"),
    (float, "fast", "x.y: expected a number, got 'fast'"), (float, "NaN", "x.y: expected a finite number"),
])
def test_parse_string_value_rejects(hint, raw, error):
    with pytest.raises(ConfigError, match=re.escape(error)):
        parse_string_value(hint, raw, "x.y")


def test_apply_overrides_keys_and_types():
    cfg = apply_overrides(JobConfig(), {"epochs": "2", "model.arch": '"mlp"', "batch-size": "16",
                                        "params": '{"hidden_size": 8}', "format": "npz"})
    assert (cfg.train.epochs, cfg.model.arch, cfg.train.batch_size) == (2, "mlp", 16)
    assert cfg.model.params == {"hidden_size": 8} and cfg.data.format == "npz"
    with pytest.raises(ConfigError, match="^nope: unknown field"):
        apply_overrides(JobConfig(), {"nope": "1"})
    with pytest.raises(ConfigError, match="model.arch: must be one of"):
        apply_overrides(JobConfig(), {"arch": "vit"})
    with pytest.raises(ConfigError, match="train.bogus: unknown field"):
        apply_overrides(JobConfig(), {"train.bogus": "1"})
