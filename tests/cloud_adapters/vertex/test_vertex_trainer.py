"""The trainer as Vertex AI runs it: the archive the adapter uploaded, pip-installed the way Vertex
installs ``package_uris``, started with the CustomJob's own ``python_module`` and ``args`` under a
recreated Vertex environment — ``CLUSTER_SPEC``, per-machine ``RANK``/``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``AIP_MODEL_DIR``/``AIP_CHECKPOINT_DIR`` from the job's
``base_output_directory`` (clouds.md §2.3), the bucket's Cloud Storage FUSE mount as a temp dir —
on 2 "machines" × 2 processes on 127.0.0.1 (gloo, CPU), one epoch of digits.

With the user's code the CustomJob carries a second package, the code's: a custom model from it trains
the same way, from a working directory that is neither the checkout nor site-packages (the launcher
finds the package's directory, the config's relative ``code.dir``, beside the installed trainer_pkg);
a user's script runs with its requirements installed as the code package's dependencies.

The Vertex variables come from tests/trainer_pkg/test_platforms.py (``vertex_vars``), the same helpers
the checkout's platform test uses; here the code runs from the installed archive, not the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cloud_adapters.base import JobSpec
from trainer_pkg.metrics import METRIC_PREFIX, parse_metric_line
from user_code_kit import (
    DEP_MARK, DEP_NAME, DEP_VERSION, MODEL_FILES, SCRIPT_FILES, SECRET_NAME, build_user_model, build_wheel,
    code_bundle, script_metrics, script_ranks_done)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainer_pkg"))
from test_platforms import PLATFORM_PREFIXES, PLATFORM_VARS, free_port, rank_lines, vertex_vars  # noqa: E402

CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"},
          "train": {"epochs": 1, "batch_size": 32, "log_every_steps": 5},
          "parallel": {"strategy": "ddp", "timeout_s": 120}}


def replica_env(body: dict, pool: str, index: int, machine: int, port: int, gcs_root: Path, site: Path) -> dict:
    """What a Vertex replica of this CustomJob sees: the job's env, Vertex's variables, the package on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_VARS and not k.startswith(PLATFORM_PREFIXES)}
    env.pop("PYTHONPATH", None)
    python = body["jobSpec"]["workerPoolSpecs"][0]["pythonPackageSpec"]
    env.update({e["name"]: e["value"] for e in python.get("env", [])})
    base = body["jobSpec"]["baseOutputDirectory"]["outputUriPrefix"]
    env.update(vertex_vars(gcs_root.parent, pool, index, machine, port))
    env.update(AIP_MODEL_DIR=base + "model/", AIP_CHECKPOINT_DIR=base + "checkpoints/",
               AIP_TENSORBOARD_LOG_DIR=base + "logs/", TRAINBOARD_GCS_ROOT=str(gcs_root),
               PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    return env


def mirror_bucket(gcs: str, gcs_root: Path) -> Path:
    """The bucket as the replicas' /gcs mount: every object the adapter uploaded, under ``gcs_root/stage/``."""
    client = storage.Client(project="my-proj", credentials=AnonymousCredentials(), client_options={"api_endpoint": gcs})
    for blob in client.list_blobs("stage"):
        path = gcs_root / "stage" / blob.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob.download_as_bytes())
    return gcs_root


def run_replicas(body: dict, gcs_root: Path, site: Path, workdir: Path) -> tuple[int, tuple[str, str], tuple[str, str]]:
    """The chief and one worker of ``body`` started at once as Vertex starts them (``python -m
    <python_module> <args>`` in a working directory of their own, not the checkout), each with 2 CPU
    processes; (the rendezvous port, (stdout, stderr) of the chief, of the worker). Asserts both exit 0."""
    python = body["jobSpec"]["workerPoolSpecs"][0]["pythonPackageSpec"]
    workdir.mkdir()
    port = free_port()
    args = [a.replace("/gcs/", f"{gcs_root}/", 1) if a.startswith("/gcs/") else a for a in python["args"]]
    argv = [sys.executable, "-m", python["pythonModule"], *args]
    envs = [replica_env(body, "workerpool0", 0, 0, port, gcs_root, site),
            replica_env(body, "workerpool1", 0, 1, port, gcs_root, site)]
    procs = [subprocess.Popen(argv, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in envs]
    try:
        results = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    (out0, err0), (out1, err1) = results
    assert [p.returncode for p in procs] == [0, 0], (err0[-3000:], err1[-3000:])
    return port, (out0, err0), (out1, err1)


def pip_install(archive: Path, site: Path, *options: str) -> None:
    """``pip install`` of one package archive into ``site`` without a network (the venv's setuptools)."""
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-index",
                          "--disable-pip-version-check", *options, "--target", str(site), str(archive)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]


def test_archive_trains_digits_under_vertex_environment(make_backend, vertex, gcs, tmp_path):
    backend = make_backend(accelerator_type="", accelerator_count=0)  # CPU machines: 2 ranks each
    handle = backend.submit(JobSpec(job_name="tb-job-7-65f0a1b2", config=CONFIG, nodes=2, procs_per_node=2,
                                    max_runtime_s=600, tags={"trainboard-job-id": "7"}))
    body = vertex.created[0]
    python = body["jobSpec"]["workerPoolSpecs"][0]["pythonPackageSpec"]
    assert [p["replicaCount"] for p in body["jobSpec"]["workerPoolSpecs"]] == ["1", "1"]

    gcs_root = mirror_bucket(gcs, tmp_path / "gcs")

    # Vertex pip-installs package_uris (offline here: no dependencies, the venv's setuptools).
    (package_uri,) = python["packageUris"]
    archive = gcs_root / package_uri[len("gs://"):]
    site = tmp_path / "site"
    pip_install(archive, site, "--no-deps")
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == ["trainer_pkg"]

    where = subprocess.run([sys.executable, "-c", "import trainer_pkg; print(trainer_pkg.__file__)"],
                           env=replica_env(body, "workerpool0", 0, 0, free_port(), gcs_root, site),
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(site / "trainer_pkg" / "__init__.py")

    port, (out0, err0), (out1, err1) = run_replicas(body, gcs_root, site, tmp_path / "replica")

    assert (f"[launch] platform: vertex (--platform vertex), node_rank 0 of 2 node(s) × 2 process(es) per node "
            f"= world size 4, master 127.0.0.1:{port}") in out0
    assert "node_rank 1 of 2 node(s) × 2 process(es)" in out1
    assert rank_lines(out0) == {(0, 0, 0, 4), (1, 1, 0, 4)}  # Vertex's per-machine ranks became per-process
    assert rank_lines(out1) == {(2, 0, 1, 4), (3, 1, 1, 4)}

    # The model where Vertex expects it: AIP_MODEL_DIR = <base_output_directory>/model/ (via /gcs).
    output = gcs_root / "stage" / "tb" / "output" / "tb-job-7-65f0a1b2"
    model_dir, ckpt_dir = output / "model", output / "checkpoints"
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "started" and records[-1]["event"] == "completed"
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == [0]
    assert all(r["world_size"] == 4 for r in records if "world_size" in r)
    state = torch.load(model_dir / "model.pt", map_location="cpu", weights_only=True)
    assert state and not any(k.startswith("module.") for k in state)
    ckpt = torch.load(ckpt_dir / "last.pt", map_location="cpu", weights_only=False)
    assert ckpt["epoch"] == 1 and ckpt["world_size"] == 4
    assert ckpt["config"]["output"]["output_dir"] == str(model_dir)
    assert ckpt["config"]["output"]["checkpoint_dir"] == str(ckpt_dir)
    assert ckpt["config"]["data"] == {**ckpt["config"]["data"], "format": "builtin", "name": "digits"}
    assert ckpt["config"]["parallel"]["nodes"] == 2 and ckpt["config"]["parallel"]["procs_per_node"] == 2

    # What the chief printed, read back through Cloud Logging: metric lines exactly as printed.
    from trainer_pkg.metrics import METRIC_PREFIX

    job_id = handle.provider_job_id.rsplit("/", 1)[-1]
    printed = out0.splitlines()
    for i, line in enumerate(printed):
        vertex.add_entry(job_id, f"2026-01-01T00:10:00.{i:09d}Z", f"e{i:05d}", text=line + "\n")
    lines, _ = backend.logs(handle, "")
    metric_lines = [line for line in printed if line.startswith(METRIC_PREFIX)]
    assert metric_lines and [line for line in lines if METRIC_PREFIX in line] == metric_lines
    assert lines[0] == "[workerpool0-0] " + printed[0]


def install_job_packages(body: dict, gcs_root: Path, site: Path, wheels: Path | None = None) -> None:
    """Vertex's install of ``package_uris`` (pip), offline: the trainer's without its dependencies (torch
    and numpy are this environment's), the code package with its dependencies from ``wheels``."""
    python = body["jobSpec"]["workerPoolSpecs"][0]["pythonPackageSpec"]
    trainer_uri, code_uri = python["packageUris"]
    pip_install(gcs_root / trainer_uri[len("gs://"):], site, "--no-deps")
    pip_install(gcs_root / code_uri[len("gs://"):], site, *(("--find-links", str(wheels)) if wheels else ()))


def test_a_custom_model_from_the_code_package_trains_on_2_machines(make_backend, vertex, gcs, tmp_path):
    code = code_bundle(tmp_path / "store", MODEL_FILES)
    config = {**CONFIG, "model": {"arch": "custom", "entry_point": "usermodel.net:build", "params": {"width": 16}}}
    backend = make_backend(accelerator_type="", accelerator_count=0)
    backend.submit(JobSpec(job_name="tb-job-12-custom", config=config, nodes=2, procs_per_node=2, max_runtime_s=600,
                           code=code))
    body = vertex.created[0]
    gcs_root = mirror_bucket(gcs, tmp_path / "gcs")
    site = tmp_path / "site"
    install_job_packages(body, gcs_root, site)
    installed = site / f"trainboard_code_{code.sha256[:16]}"
    assert (installed / "usermodel" / "net.py").read_text() == MODEL_FILES["usermodel/net.py"]

    _, (out0, err0), (out1, _) = run_replicas(body, gcs_root, site, tmp_path / "replica")
    assert f"user code: sha256 {code.sha256} in " in out0 + err0
    assert rank_lines(out0) == {(0, 0, 0, 4), (1, 1, 0, 4)} and rank_lines(out1) == {(2, 0, 1, 4), (3, 1, 1, 4)}

    model_dir = gcs_root / "stage" / "tb" / "output" / "tb-job-12-custom" / "model"  # AIP_MODEL_DIR via /gcs
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "started" and records[-1]["event"] == "completed"
    [epoch] = [r for r in records if r["event"] == "epoch"]
    assert epoch["val_accuracy"] > 0.3  # 10 digit classes: chance is 0.1
    model = build_user_model(installed, num_classes=10, input_shape=(64,), width=16)
    model.load_state_dict(torch.load(model_dir / "model.pt", map_location="cpu", weights_only=True), strict=True)


def test_a_users_script_runs_with_its_requirements_installed_as_the_packages_dependencies(
        make_backend, vertex, gcs, tmp_path):
    code = code_bundle(tmp_path / "store", SCRIPT_FILES)
    config = {**CONFIG, "code": {"script": "train.py", "args": ["--steps", "3", "--tag", "vx"]}}
    backend = make_backend(accelerator_type="", accelerator_count=0)
    backend.submit(JobSpec(job_name="tb-job-12-script", config=config, nodes=2, procs_per_node=2, max_runtime_s=600,
                           code=code, secret_env={SECRET_NAME: "vx-secret-71"}))
    body = vertex.created[0]
    gcs_root = mirror_bucket(gcs, tmp_path / "gcs")
    site = tmp_path / "site"
    install_job_packages(body, gcs_root, site, wheels=build_wheel(tmp_path / "wheels"))
    assert (site / DEP_NAME / "__init__.py").is_file()  # pip installed the requirement with the code package

    _, (out0, err0), (out1, err1) = run_replicas(body, gcs_root, site, tmp_path / "replica")
    assert script_ranks_done(out0 + out1, "vx") == [0, 1, 2, 3]
    assert "vx-secret-71" not in out0 + err0 + out1 + err1  # in the environment only, never in our log lines
    metrics = script_metrics(out0)
    assert [(m["step"], m["my_metric"], m["dep_mark"]) for m in metrics] == [
        (1, 1.5, float(DEP_MARK)), (2, 3.0, float(DEP_MARK)), (3, 4.5, float(DEP_MARK))]
    model_dir = gcs_root / "stage" / "tb" / "output" / "tb-job-12-script" / "model"
    written = json.loads((model_dir / "user_model.json").read_text())
    assert written == {"tag": "vx", "world_size": 4, "dep": DEP_VERSION,
                       "cwd": str(site / f"trainboard_code_{code.sha256[:16]}"), "secret": "vx-secret-71"}
