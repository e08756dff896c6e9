"""A diverged run (lr 1e30: the loss is NaN from the second step) under torchrun with 2 ranks: by
default it stops as failed with "loss became NaN at step N" and writes no checkpoint; with
train.on_nonfinite_loss "warn" it trains on. Every record stays valid JSON (null + ``nonfinite``)."""

from __future__ import annotations

import json
import math

import pytest

from trainer_helpers import torchrun, write_job
from trainer_pkg import launch
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.metrics import encode_record, format_metric_line, parse_metric_line
from trainer_pkg.train import NonfiniteLoss, describe_nonfinite


def strict_records(path):
    """metrics.jsonl parsed with NaN/Infinity literals refused (they are not JSON)."""
    def refuse(literal):
        raise ValueError(f"{literal} in metrics.jsonl")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


DIVERGING = {"model": {"arch": "mlp", "params": {}}, "parallel": {"procs_per_node": 2}}


def test_a_diverged_run_stops_failed_with_the_step_and_no_checkpoint(tmp_path):
    job = write_job(tmp_path, train={"epochs": 3, "lr": 1e30, "log_every_steps": 5}, **DIVERGING)
    result = torchrun(job, nproc=2, timeout=240)
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"trainer error: rank {rank}: loss became NaN at step 2: the run diverged" in result.stderr
    records = strict_records(tmp_path / "out" / "metrics.jsonl")
    events = [r["event"] for r in records]
    assert events[0] == "started" and events[-1] == "failed" and "completed" not in events
    assert "epoch" not in events  # stopped before the first epoch's validation and checkpoint
    failed = records[-1]
    assert failed["reason"] == "loss became NaN at step 2"
    assert failed["nonfinite_step"] == 2 and failed["step"] >= 2  # the ranks agree some steps later
    assert failed["train_loss"] is None and failed["nonfinite"] == ["train_loss"]
    # The first record (step 1, initial weights) is finite; every later window holds the NaN.
    assert math.isfinite(records[0]["train_loss"]) and "nonfinite" not in records[0]
    assert all(r["train_loss"] is None and "train_loss" in r["nonfinite"] for r in records[1:])
    assert not (tmp_path / "out" / "checkpoints" / "last.pt").exists()
    assert not (tmp_path / "out" / "model.pt").exists()
    # What the launcher leaves as the platform's failure reason (SageMaker's /opt/ml/output/failure).
    cfg = JobConfig.from_json(job.read_text())
    assert launch.failure_message(cfg, 1, since=0) == "loss became NaN at step 2 (training failed with exit code 1)"
    assert launch.failure_message(cfg, 1, since=failed["time"] + 1).startswith("training failed with exit code 1;")


def test_warn_trains_on_with_null_losses_and_completes(tmp_path):
    job = write_job(tmp_path, train={"epochs": 1, "lr": 1e30, "log_every_steps": 5, "on_nonfinite_loss": "warn"},
                    **DIVERGING)
    result = torchrun(job, nproc=2, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("warning: loss became NaN at step 2; training goes on") == 1
    records = strict_records(tmp_path / "out" / "metrics.jsonl")
    assert [r["event"] for r in records][-2:] == ["epoch", "completed"]
    epoch = records[-2]
    assert epoch["val_loss"] is None and {"train_loss", "val_loss"} <= set(epoch["nonfinite"])
    assert (tmp_path / "out" / "model.pt").exists()


def test_record_encoding_and_reasons():
    record = {"event": "step", "train_loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1,
              "rank_step_time_s": [0.5, float("-inf")]}
    encoded = encode_record(record)
    assert encoded == {"event": "step", "train_loss": None, "grad_norm": None, "lr": 0.1,
                       "rank_step_time_s": [0.5, None],
                       "nonfinite": ["grad_norm", "rank_step_time_s", "train_loss"]}
    assert parse_metric_line(format_metric_line(record)) == encoded
    assert encode_record({"event": "step", "lr": 0.1}) == {"event": "step", "lr": 0.1}
    assert describe_nonfinite(-math.inf) is None
    assert describe_nonfinite(-(2.0 * 7)) == "loss became NaN at step 7"
    assert describe_nonfinite(-(2.0 * 7 + 1)) == "loss became infinite at step 7"
    with pytest.raises(ConfigError, match="train.on_nonfinite_loss"):
        JobConfig.from_dict({"train": {"on_nonfinite_loss": "ignore"}})


@pytest.mark.parametrize("on_host", [True, False])  # False: the bookkeeping a GPU run uses, kept in a tensor
def test_the_first_nonfinite_step_is_kept_exactly(on_host):
    import torch

    watch = NonfiniteLoss(torch.device("cpu"), on_host=on_host)
    for step, loss in [(1, 2.0), (2, 1.5)]:
        watch.see(torch.tensor(loss), step)
    assert watch.code() == -math.inf
    for step, loss in [(20_000_001, float("inf")), (20_000_002, float("nan"))]:
        watch.see(torch.tensor(loss), step)
    assert describe_nonfinite(watch.code()) == "loss became infinite at step 20000001"
