"""The launcher's ``kubernetes`` platform (Kubeflow Trainer's torch runtime: ``PET_*`` variables, one
pod per node) and ``--config env:NAME``: the readers in process, the exit-2 errors from a real
launcher process, and a 2-node × 2-process TrainJob on the stand-in API server
(tests/k8s_standin.py) whose pods run the real launcher and trainer (gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kubernetes import client

from k8s_standin import LABEL_COMPLETION_INDEX, LABEL_JOBSET_NAME
from test_platforms import assert_trained_4_ranks, clean_env, rank_lines, write_config, write_npz
from trainer_helpers import REPO
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.launch import CONFIG_FROM_ENV_FILE, config_from_env, torchrun_env
from trainer_pkg.platforms import PlatformError, detect, plan

PET = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "tj-node-0-0.tj",
       "PET_MASTER_PORT": "29400"}


def test_kubernetes_is_detected_and_planned_from_the_pet_variables():
    assert detect(PET) == ("kubernetes", "PET_NNODES and PET_NODE_RANK are set")
    # torchrun started inside the pod (the user's own command): its ranks are torchrun's
    assert detect({**PET, "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})[0] == "torchrun"
    p = plan(PET, JobConfig())
    assert (p.platform, p.nnodes, p.node_rank, p.nproc_per_node, p.master_addr, p.master_port, p.in_process) == \
        ("kubernetes", 2, 1, 2, "tj-node-0-0.tj", 29400, False)
    assert p.output_dir is None and p.checkpoint_dir is None  # the config's own directories
    assert plan(PET, JobConfig(), nproc=3).nproc_per_node == 3  # --nproc-per-node wins


@pytest.mark.parametrize("value, gpus, expected", [
    ("auto", "0,1,2", 3), ("gpu", "0,1", 2), ("4", "0,1", 4), ("AUTO", "0", 1),
])
def test_nproc_per_node_takes_what_torchrun_takes(value, gpus, expected):
    env = {**PET, "PET_NPROC_PER_NODE": value, "CUDA_VISIBLE_DEVICES": gpus}
    assert plan(env, JobConfig()).nproc_per_node == expected


def test_auto_and_cpu_without_gpus_count_the_cpus_this_pod_may_use():
    cpus = len(os.sched_getaffinity(0))
    for value in ("auto", "cpu"):
        assert plan({**PET, "PET_NPROC_PER_NODE": value, "CUDA_VISIBLE_DEVICES": ""}, JobConfig()).nproc_per_node == cpus


@pytest.mark.parametrize("change, message", [
    ({"PET_NNODES": "two"}, "Kubernetes: PET_NNODES is not an integer: 'two'"),
    ({"PET_NNODES": "0"}, "Kubernetes: PET_NNODES must be at least 1, got 0"),
    ({"PET_NODE_RANK": "2"}, "Kubernetes: PET_NODE_RANK 2 is not below PET_NNODES 2"),
    ({"PET_NPROC_PER_NODE": None}, "Kubernetes: PET_NPROC_PER_NODE is not set; Kubeflow Trainer's torch runtime"),
    ({"PET_NPROC_PER_NODE": "many"}, "Kubernetes: PET_NPROC_PER_NODE is not an integer: 'many'"),
    ({"PET_NPROC_PER_NODE": "gpu", "CUDA_VISIBLE_DEVICES": ""}, "PET_NPROC_PER_NODE is 'gpu' but this pod sees no GPU"),
    ({"PET_MASTER_ADDR": None}, "Kubernetes: PET_MASTER_ADDR is not set"),
    ({"PET_MASTER_PORT": "70000"}, "Kubernetes: PET_MASTER_PORT is not a TCP port: 70000"),
])
def test_a_missing_or_unreadable_variable_names_it(change, message):
    env = dict(PET, CUDA_VISIBLE_DEVICES="0")
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    with pytest.raises(PlatformError) as info:
        plan(env, JobConfig(), platform="kubernetes")
    assert message in str(info.value)


def test_one_node_needs_no_rendezvous_and_torchrun_gets_no_pet_variables():
    p = plan({"PET_NNODES": "1", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "2"}, JobConfig())
    assert (p.nnodes, p.master_addr, p.master_port) == (1, "", 0)
    env = torchrun_env(plan(PET, JobConfig()), {**PET, "PATH": "/usr/bin"})
    assert not [k for k in env if k.startswith("PET_")] and env["PATH"] == "/usr/bin"


def test_config_from_env_writes_the_json_to_the_working_directory(tmp_path):
    text = json.dumps({"train": {"epochs": 2}})
    path = config_from_env("env:JOB", {"JOB": text}, str(tmp_path))
    assert path == str(tmp_path / CONFIG_FROM_ENV_FILE) and (tmp_path / CONFIG_FROM_ENV_FILE).read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == [CONFIG_FROM_ENV_FILE]  # no temp file left behind
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    try:
        if os.access(read_only, os.W_OK):  # root writes anywhere: point at a path that is not a directory
            read_only = tmp_path / CONFIG_FROM_ENV_FILE
        path = config_from_env("env:JOB", {"JOB": text}, str(read_only))
        assert not path.startswith(str(tmp_path)) and open(path).read() == text
    finally:
        (tmp_path / "ro").chmod(0o700)
    for spec, env, message in (
            ("env:JOB", {}, "environment variable JOB is not set (or empty)"),
            ("env:JOB", {"JOB": "{epochs: 1"}, "environment variable JOB is not valid JSON: "),
            ("env:JOB", {"JOB": "[1, 2]"}, "environment variable JOB must hold a JSON object, got list"),
            ("env:", {}, "--config env:NAME needs an environment variable name, got ''"),
            ("env:A B", {}, "needs an environment variable name, got 'A B'")):
        with pytest.raises(ConfigError) as info:
            config_from_env(spec, env, str(tmp_path))
        assert message in str(info.value)


@pytest.mark.parametrize("value, message", [
    (None, "invalid config env:TRAINBOARD_JOB_CONFIG: environment variable TRAINBOARD_JOB_CONFIG is not set"),
    ("not json", "invalid config env:TRAINBOARD_JOB_CONFIG: environment variable TRAINBOARD_JOB_CONFIG is not valid JSON"),
    ('{"train": {"epochs": 0}}', "invalid config env:TRAINBOARD_JOB_CONFIG: "),
])
def test_launcher_exits_2_for_a_bad_config_variable(tmp_path, value, message):
    env = clean_env(**({"TRAINBOARD_JOB_CONFIG": value} if value is not None else {}))
    proc = subprocess.run([sys.executable, "-m", "trainer_pkg.launch", "--config", "env:TRAINBOARD_JOB_CONFIG"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr and proc.stderr.startswith("trainer error: ")


def test_help_names_the_platform_and_env_configs():
    proc = subprocess.run([sys.executable, "-m", "trainer_pkg.launch", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "kubernetes PET_NNODES, PET_NODE_RANK (TrainJob)" in proc.stdout
    assert "env:NAME for the JSON in environment variable NAME" in " ".join(proc.stdout.split())


def test_a_two_node_trainjob_trains_through_the_launcher(kube_standin, tmp_path):
    data = write_npz(tmp_path / "tiny.npz")
    out = tmp_path / "out"
    config = json.loads(write_config(tmp_path / "job.json", data={"uri": str(data)},
                                     output={"output_dir": str(out)}).read_text())
    body = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": "launch-2x2", "labels": {"trainboard.io/job-id": "launch-2x2"}},
        "spec": {"runtimeRef": {"name": "torch-distributed"},
                 "trainer": {"image": "trainboard/trainer:test", "numNodes": 2, "numProcPerNode": 2,
                             "command": ["python", "-m", "trainer_pkg.launch"],
                             "args": ["--config", "env:TRAINBOARD_JOB_CONFIG"],
                             "env": [{"name": "TRAINBOARD_JOB_CONFIG", "value": json.dumps(config)},
                                     {"name": "OMP_NUM_THREADS", "value": "1"}]}},
    }
    api = kube_standin.client()
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", "default", "trainjobs", body)
    kube_standin.wait_for(lambda: kube_standin.condition("default", "launch-2x2", "Complete")
                          or kube_standin.condition("default", "launch-2x2", "Failed"), timeout=240,
                          what="the TrainJob to finish")
    core = client.CoreV1Api(api)
    pods = core.list_namespaced_pod("default", label_selector=f"{LABEL_JOBSET_NAME}=launch-2x2").items
    logs = {int(p.metadata.labels[LABEL_COMPLETION_INDEX]): core.read_namespaced_pod_log(p.metadata.name, "default")
            for p in pods}
    assert kube_standin.condition("default", "launch-2x2", "Complete"), logs
    assert "[launch] platform: kubernetes (PET_NNODES and PET_NODE_RANK are set), node_rank 0 of 2 node(s) × " \
           "2 process(es)" in logs[0]
    assert "node_rank 1 of 2 node(s)" in logs[1]
    assert rank_lines(logs[0]) == {(0, 0, 0, 4), (1, 1, 0, 4)}
    assert rank_lines(logs[1]) == {(2, 0, 1, 4), (3, 1, 1, 4)}
    ran = assert_trained_4_ranks(out, out / "checkpoints")
    assert (ran["parallel"]["nodes"], ran["parallel"]["procs_per_node"]) == (2, 2)
    for pod in kube_standin.pods_of("default", "launch-2x2"):  # each pod's working directory holds the config
        assert json.loads((pod.workdir / CONFIG_FROM_ENV_FILE).read_text()) == config
