"""The trainer archive: deterministic bytes named by hash, and — the archive a submit uploaded, unpacked
into two /opt/ml-style trees under tmp_path with the SageMaker environment of 2 hosts on 127.0.0.1 —
one epoch of digits trained by 2 × 2 ranks, the model in SM_MODEL_DIR.

The per-host layout and environment come from the SageMaker platform test's helpers
(tests/trainer_pkg/test_platforms.py ``sagemaker_layout``), so both tests recreate one container.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import boto3
import pytest
import torch
from moto import mock_aws

from cloud_adapters import packaging
from cloud_adapters.base import JobSpec
from sagemaker_standin import BUCKET, submit_and_capture

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "trainer_pkg"))
from test_platforms import clean_env, free_port, rank_lines, run_all, sagemaker_layout  # noqa: E402
from trainer_helpers import records  # noqa: E402


def test_archive_is_deterministic_and_named_by_its_hash(tmp_path):
    a, b = packaging.build_archive(), packaging.build_archive()
    assert a.data == b.data and a.sha256 == hashlib.sha256(a.data).hexdigest()
    assert a.name == f"trainboard-trainer-{a.sha256[:16]}.tar.gz"
    with tarfile.open(fileobj=io.BytesIO(a.data), mode="r:gz") as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names) and names[:2] == ["trainboard_entry.py", "trainboard_job.json"]
    assert "trainer_pkg/launch.py" in names and "trainer_pkg/platforms.py" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}

    # A copy of the package elsewhere gives the same bytes; one changed file gives another name.
    copy = tmp_path / "src"
    (copy / "trainer_pkg").mkdir(parents=True)
    for name in names[2:]:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes((REPO / name).read_bytes())
    (copy / "trainer_pkg" / "__pycache__").mkdir()
    (copy / "trainer_pkg" / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert packaging.build_archive(copy).data == a.data
    (copy / "trainer_pkg" / "launch.py").write_text((REPO / "trainer_pkg" / "launch.py").read_text() + "\n# v2\n")
    assert packaging.build_archive(copy).name != a.name


def test_upload_once_skips_a_present_key():
    archive = packaging.build_archive()
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        first = packaging.upload_once(s3, archive, bucket=BUCKET, prefix="/tb/")
        second = packaging.upload_once(s3, archive, bucket=BUCKET, prefix="tb")
        head = s3.head_object(Bucket=BUCKET, Key=f"tb/code/{archive.name}")
    assert first == (f"s3://{BUCKET}/tb/code/{archive.name}", True)
    assert second == (first[0], False)
    assert head["ContentLength"] == len(archive.data) and head["Metadata"] == {"trainboard-sha256": archive.sha256}


def _submitted(tmp_path: Path) -> tuple[dict, bytes]:
    """Submit a 2-node × 2-process digits job to moto; (the CreateTrainingJob body, the archive bytes)."""
    config = {"data": {"format": "builtin", "name": "digits"},
              "model": {"arch": "mlp", "params": {"hidden_size": 32}},
              "parallel": {"strategy": "ddp", "procs_per_node": 2, "timeout_s": 120},
              "train": {"epochs": 1, "batch_size": 32, "log_every_steps": 5, "lr": 0.1}}
    return submit_and_capture(JobSpec(job_name="tb-job-3-digits", config=config, nodes=2, procs_per_node=2,
                                      instance_type="ml.m5.xlarge", max_runtime_s=1800))


def test_uploaded_archive_trains_digits_on_two_sagemaker_hosts(tmp_path):
    request, data = _submitted(tmp_path)
    hps, environment = request["HyperParameters"], request["Environment"]
    hosts, port = ["algo-1", "algo-2"], free_port()
    roots = [tmp_path / f"node{i}" / "opt" / "ml" for i in range(2)]
    commands = []
    for i, root in enumerate(roots):
        # What SageMaker and the toolkit do: hyperparameters.json holds the request's map as sent,
        # the archive is unpacked into /opt/ml/code, the request's Environment is set, the PyTorch
        # container exports MASTER_ADDR (clouds.md §1.5, §1.6) — here the loopback address.
        layout = sagemaker_layout(root, hosts[i], hosts, port, hps)
        code = root / "code"
        code.mkdir()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(code, filter="data")
        env = clean_env(**layout, **environment, MASTER_ADDR="127.0.0.1", PYTHONPATH="")
        toolkit_args = [arg for k, v in sorted(hps.items()) if not k.startswith("sagemaker_") for arg in (f"--{k}", v)]
        commands.append(([sys.executable, str(code / packaging.ENTRY_SCRIPT), *toolkit_args], env))

    # Only the archive's copy of the trainer is importable with this environment.
    probe = subprocess.run([sys.executable, "-c", "import trainer_pkg"], env=commands[0][1], cwd=tmp_path,
                           capture_output=True, text=True)
    assert "No module named 'trainer_pkg'" in probe.stderr

    (n0, out0, err0), (n1, out1, err1) = run_all(commands, timeout=240)
    assert n0 == 0 and n1 == 0, (err0[-3000:], err1[-3000:])
    assert "platform: sagemaker (SM_HOSTS is set), node_rank 0 of 2 node(s) × 2 process(es) per node = world " \
           f"size 4, master 127.0.0.1:{port}" in out0
    assert rank_lines(out0) == {(0, 0, 0, 4), (1, 1, 0, 4)} and rank_lines(out1) == {(2, 0, 1, 4), (3, 1, 1, 4)}

    model_dir = roots[0] / "model"  # SM_MODEL_DIR of algo-1
    state = torch.load(model_dir / "model.pt", map_location="cpu", weights_only=True)
    assert isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values())
    assert not any(k.startswith("module.") for k in state)
    recs = records(model_dir)
    assert recs[0]["event"] == "started" and recs[-1]["event"] == "completed"
    assert [r["epoch"] for r in recs if r["event"] == "epoch"] == [0]
    assert all(r["world_size"] == 4 for r in recs if "world_size" in r)
    ckpt = torch.load(roots[0] / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert ckpt["config"]["data"]["name"] == "digits" and ckpt["config"]["model"]["params"] == {"hidden_size": 32}
    assert ckpt["config"]["train"]["lr"] == 0.1 and ckpt["config"]["output"]["output_dir"] == str(model_dir)
    assert (roots[0] / "output" / "data" / "metrics.jsonl").is_file()
    assert not (roots[0] / "output" / "failure").exists() and not (roots[1] / "output" / "failure").exists()


@pytest.mark.parametrize("prefix", ["", "team/a"])
def test_code_key_under_prefix(prefix):
    archive = packaging.build_archive()
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        uri, uploaded = packaging.upload_once(s3, archive, bucket=BUCKET, prefix=prefix)
    assert uploaded and uri == f"s3://{BUCKET}/{prefix + '/' if prefix else ''}code/{archive.name}"
