"""The real trainer under torchrun (gloo, CPU), as subprocesses. Its SIGTERM run (a checkpoint, a
``stopped`` record, exit 0 within seconds) is test_trainer_standin_contract.py's real side."""

import json
import os
import time

import torch

from trainer_helpers import launch, records, torchrun, write_job
from trainer_pkg.metrics import parse_metric_line
from trainer_pkg.models import build_model
from trainer_pkg.train import load_checkpoint


def test_two_ranks_learn_digits(tmp_path):
    # the default JobConfig (digits, cnn, 3 epochs, batch 32, SGD lr 0.05), with step records at a
    # fixed cadence (the default is time-based: test_record_cadence.py)
    job = write_job(tmp_path, train={"log_every_steps": 10})
    started = time.monotonic()
    run = torchrun(job, nproc=2, real_torchrun=True)  # torch's own torchrun (DDP; test_strategies.py: FSDP, pipeline)
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-3000:]
    assert elapsed < 60

    out = tmp_path / "out"
    recs = records(out)
    epochs = [r for r in recs if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    assert epochs[-1]["val_accuracy"] >= 0.90, epochs
    assert epochs[-1]["val_loss"] < epochs[0]["val_loss"]
    assert [r["event"] for r in recs][0] == "started" and recs[-1]["event"] == "completed"
    # 1,438 training samples over 2 ranks × 32 per step: 23 steps per epoch
    assert recs[-1]["step"] == 69
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == [10, 20, 30, 40, 50, 60]
    for r in recs[:-1]:
        assert r["world_size"] == 2 and r["lr"] == 0.05
        assert len(r["rank_samples_per_s"]) == 2 and len(r["rank_step_time_s"]) == 2
        assert r["samples_per_s"] > 0 and 0.0 <= r["train_accuracy"] <= 1.0

    # stdout carries the same records (rank 0 only: one line per record)
    printed = [parse_metric_line(line) for line in run.stdout.splitlines()]
    assert [p for p in printed if p] == recs

    # model.pt is a bare state dict that loads into a fresh model
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    fresh = build_model("cnn", {}, (1, 8, 8), 10)
    fresh.load_state_dict(state)

    ckpt = load_checkpoint(str(out / "checkpoints" / "last.pt"))
    assert ckpt["epoch"] == 3 and ckpt["step"] == 69 and ckpt["batches_done"] == 0
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    assert ckpt["config"]["train"]["epochs"] == 3
    assert set(ckpt["model"]) == set(state)
    assert not [f for f in os.listdir(out / "checkpoints") if f != "last.pt"]  # no temp files left


def test_resume_continues_from_the_next_epoch(tmp_path):
    job = write_job(tmp_path, train={"epochs": 1})
    first = torchrun(job, nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    job = write_job(tmp_path, train={"epochs": 2})
    second = torchrun(job, nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]

    recs = records(tmp_path / "out")
    assert [(r["event"], r["epoch"]) for r in recs if r["event"] != "step"] == [
        ("started", 0), ("epoch", 0), ("completed", 0),
        ("started", 1), ("epoch", 1), ("completed", 1),
    ]
    starts = [r for r in recs if r["event"] == "started"]
    assert [s["resumed"] for s in starts] == [False, True]
    assert starts[1]["step"] == 24  # 23 steps of epoch 0 came from the checkpoint
    assert "resuming from" in second.stdout
    assert load_checkpoint(str(tmp_path / "out" / "checkpoints" / "last.pt"))["epoch"] == 2


def test_missing_dataset_fails_every_rank_with_a_clear_error(tmp_path):
    missing = tmp_path / "gone" / "table.csv"
    job = write_job(tmp_path, data={"format": "csv", "uri": str(missing)})
    run = torchrun(job, nproc=2, timeout=60, real_torchrun=True)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("trainer error: ")]
    assert len(errors) == 2, run.stderr[-3000:]  # one line per rank, no rank left waiting
    assert all(str(missing) in line and "does not exist" in line for line in errors)


def test_same_seed_is_bit_identical(tmp_path):
    # One process, batch 32, twice with the same seed: bit-identical weights. (Two ranks × batch 16
    # computing what one process of batch 32 does: test_exactness.py, through train.py's flags.)
    mlp = {"arch": "mlp", "params": {}}
    paths = []
    for name in ("a", "b"):
        job = write_job(tmp_path / name, model=mlp, train={"epochs": 1, "seed": 5})
        run = launch(job)  # one process, no torchrun
        assert run.returncode == 0, run.stderr[-3000:]
        paths.append(tmp_path / name / "out" / "model.pt")
    a, b = (torch.load(p, map_location="cpu", weights_only=True) for p in paths)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(5)
    initial = build_model("mlp", {}, (1, 8, 8), 10).state_dict()
    assert not torch.equal(a["net.1.weight"], initial["net.1.weight"])  # it did train
    one = records(tmp_path / "a" / "out")
    assert one[-1]["event"] == "completed" and one[-1]["world_size"] == 1


def test_launch_rejects_a_bad_config_with_exit_2(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"train": {"epochs": "3"}}))
    run = launch(job)
    assert run.returncode == 2
    assert run.stderr.strip() == f"trainer error: invalid config {job}: train.epochs: expected an integer, got '3'"
    job.write_text(json.dumps({"train": {"epochs": 0}}))
    run = launch(job)
    assert run.returncode == 2 and "train.epochs: must be at least 1, got 0" in run.stderr


def test_csv_dataset_trains_an_mlp(tmp_path):
    # Two well-separated Gaussian blobs in 4 features: any working trainer separates them.
    import numpy as np

    rng = np.random.default_rng(0)
    y = np.arange(200) % 2
    x = rng.normal(size=(200, 4)) + 3.0 * y[:, None]
    table = tmp_path / "blobs.csv"
    table.write_text("f0,f1,f2,f3,target\n" + "\n".join(
        ",".join(f"{v:.5f}" for v in row) + f",{label}" for row, label in zip(x, y)) + "\n")
    job = write_job(tmp_path, data={"format": "csv", "uri": str(table), "label_column": "target"},
                    model={"arch": "mlp", "params": {"hidden_size": 16}}, train={"epochs": 2, "batch_size": 16})
    run = launch(job)
    assert run.returncode == 0, run.stderr[-3000:]
    epochs = [r for r in records(tmp_path / "out") if r["event"] == "epoch"]
    assert len(epochs) == 2 and epochs[-1]["val_accuracy"] >= 0.95
    state = torch.load(tmp_path / "out" / "model.pt", map_location="cpu", weights_only=True)
    assert state["net.1.weight"].shape == (16, 4)
