"""ddp, fsdp and pipeline train the same model the same way: real runs (gloo, CPU), values asserted.

Every run trains a small MLP on 512 synthetic samples with their own validation arrays, so each
epoch is 16 full steps of 32 samples whatever the strategy (a pipeline skips incomplete batches).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from trainer_helpers import launch, records, torchrun, write_job
from trainer_pkg.config import JobConfig
from trainer_pkg.models import build_model, pipeline_units, sequential_layers
from trainer_pkg.parallel import (
    StageModule, balance_stages, optimizer_state_by_index, optimizer_state_by_name)
from trainer_pkg.registry import pipeline_layer_count

MLP = {"arch": "mlp", "params": {"hidden_size": 32, "num_layers": 2}}
FEATURES, CLASSES = 16, 4


def write_blobs(path, n_train=512, n_val=64, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(CLASSES, FEATURES)) * 1.5
    y = rng.integers(0, CLASSES, size=n_train + n_val)
    x = (centers[y] + rng.normal(size=(len(y), FEATURES))).astype(np.float32)
    np.savez(path, x_train=x[:n_train], y_train=y[:n_train], x_val=x[n_train:], y_val=y[n_train:])
    return path


def train_run(root, name, data, *, nproc=1, parallel=None, train=None, real_torchrun=False):
    """Run one job; returns (model.pt state dict, metric records). ``real_torchrun``: under torch's
    own torchrun (else the torch-free one, tests/standins/torchrun_lite.py)."""
    job = write_job(root / name, data={"format": "npz", "uri": str(data)}, model=MLP,
                    parallel={"procs_per_node": nproc, **(parallel or {})},
                    train={"epochs": 1, "batch_size": 32, "lr": 0.1, "seed": 3, "log_every_steps": 4,
                           **(train or {})})
    run = launch(job) if nproc == 1 else torchrun(job, nproc=nproc, real_torchrun=real_torchrun)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    out = root / name / "out"
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True), records(out)


def assert_same(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"largest difference {worst:.3g}"


def train_losses(recs):
    """(step, train loss) of every step record: the global mean over the samples since the last one."""
    return [(r["step"], r["train_loss"]) for r in recs if r["event"] in ("started", "step")]


def epoch_record(recs):
    return [r for r in recs if r["event"] == "epoch"][-1]


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    return write_blobs(tmp_path_factory.mktemp("data") / "blobs.npz")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, blobs):
    """One process, batch 32: what every strategy must reproduce."""
    return train_run(tmp_path_factory.mktemp("ref"), "one", blobs)


def test_reference_trains(reference):
    state, recs = reference
    torch.manual_seed(3)
    initial = build_model("mlp", MLP["params"], (FEATURES,), CLASSES).state_dict()
    assert (state["net.1.weight"] - initial["net.1.weight"]).abs().max() > 1e-3
    assert epoch_record(recs)["val_accuracy"] >= 0.9
    assert recs[-1]["step"] == 16


def test_fsdp_on_two_ranks_equals_ddp_on_two_ranks(tmp_path, blobs, reference):
    ddp, ddp_recs = train_run(tmp_path, "ddp", blobs, nproc=2, parallel={"strategy": "ddp"},
                              train={"batch_size": 16})
    fsdp, fsdp_recs = train_run(tmp_path, "fsdp", blobs, nproc=2, parallel={"strategy": "fsdp"},
                                train={"batch_size": 16}, real_torchrun=True)  # FSDP under torch's torchrun
    assert_same(fsdp, ddp)
    assert_same(fsdp, reference[0])
    # model.pt is the full bare state dict: it loads into the plain model
    build_model("mlp", MLP["params"], (FEATURES,), CLASSES).load_state_dict(fsdp)
    e_ddp, e_fsdp = epoch_record(ddp_recs), epoch_record(fsdp_recs)
    assert abs(e_ddp["val_loss"] - e_fsdp["val_loss"]) < 1e-5
    assert np.allclose(train_losses(ddp_recs), train_losses(fsdp_recs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_of_two_stages_equals_one_process(tmp_path, blobs, reference, schedule):
    state, recs = train_run(tmp_path, schedule, blobs, nproc=2,
                            parallel={"strategy": "pipeline", "microbatches": 4, "pipeline_schedule": schedule},
                            real_torchrun=schedule == "gpipe")  # a pipeline under torch's own torchrun
    assert_same(state, reference[0])
    # the loss is computed on the last stage, yet rank 0 reports the global values
    mine, ref = epoch_record(recs), epoch_record(reference[1])
    for key in ("val_loss", "val_accuracy"):
        assert abs(mine[key] - ref[key]) < 1e-5, key
    assert np.allclose(train_losses(recs), train_losses(reference[1]), atol=1e-5, rtol=0)
    assert [r["train_accuracy"] for r in recs if r["event"] == "step"] == [
        r["train_accuracy"] for r in reference[1] if r["event"] == "step"]
    assert [r["step"] for r in recs if r["event"] == "step"] == [4, 8, 12, 16]


def test_two_pipelines_of_two_stages_equal_one_process(tmp_path, blobs, reference):
    # 4 ranks = 2 stages × 2 data-parallel replicas, 16 samples per replica per step.
    state, recs = train_run(tmp_path, "pp4", blobs, nproc=4, train={"batch_size": 16},
                            parallel={"strategy": "pipeline", "pipeline_stages": 2})
    assert_same(state, reference[0])
    assert abs(epoch_record(recs)["val_loss"] - epoch_record(reference[1])["val_loss"]) < 1e-5


@pytest.fixture(scope="module")
def reference_two_epochs(tmp_path_factory, blobs):
    return train_run(tmp_path_factory.mktemp("ref2"), "one", blobs, train={"epochs": 2})[0]


@pytest.mark.parametrize("first, then", [("fsdp", "pipeline"), ("pipeline", "fsdp")])
def test_resume_from_a_checkpoint_of_another_strategy(tmp_path, blobs, reference_two_epochs, first, then):
    # Checkpoints hold the full model and the optimizer state by parameter name under every
    # strategy: epoch 1 under one, epoch 2 resumed under the other, equals 2 epochs in one process.
    batch = {"fsdp": 16, "pipeline": 32}  # 32 samples per step either way
    train_run(tmp_path, "run", blobs, nproc=2, parallel={"strategy": first},
              train={"epochs": 1, "batch_size": batch[first]})
    ckpt = torch.load(tmp_path / "run" / "out" / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert ckpt["strategy"] == first and ckpt["epoch"] == 1 and ckpt["step"] == 16
    assert set(ckpt["model"]) == set(reference_two_epochs)
    assert set(ckpt["optimizer"]["state"]) == set(reference_two_epochs)  # every parameter, by name
    state, recs = train_run(tmp_path, "run", blobs, nproc=2, parallel={"strategy": then},
                            train={"epochs": 2, "batch_size": batch[then]})
    assert [r["resumed"] for r in recs if r["event"] == "started"] == [False, True]
    assert recs[-1]["step"] == 32
    assert_same(state, reference_two_epochs)


def test_the_trainer_checks_the_shape_the_launcher_started(tmp_path, blobs):
    # The config says 2 processes (valid), but torchrun starts 3: the trainer refuses on every rank.
    job = write_job(tmp_path, data={"format": "npz", "uri": str(blobs)}, model=MLP,
                    parallel={"strategy": "pipeline", "procs_per_node": 2, "pipeline_stages": 2})
    run = torchrun(job, nproc=3, timeout=90)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("trainer error: ")]
    assert len(errors) == 3, run.stderr[-3000:]
    assert all("the launcher started 3 rank(s); 2 pipeline stages do not divide 3" in e for e in errors)


@pytest.mark.parametrize("arch, params, shape", [
    ("mlp", {"num_layers": 3}, (1, 8, 8)),
    ("cnn", {"num_blocks": 3, "channels": 4}, (3, 12, 12)),
    ("resnet", {"width": 4, "num_stages": 2, "blocks_per_stage": 2}, (1, 8, 8)),
])
def test_stages_compose_to_the_model(arch, params, shape):
    torch.manual_seed(0)
    model = build_model(arch, params, shape, 5).eval()
    units = pipeline_units(sequential_layers(model))
    assert len(units) == pipeline_layer_count(arch, params)
    weights = [sum(p.numel() for _, m in u for p in m.parameters()) for u in units]
    cuts = balance_stages(weights, 3)
    stages = [StageModule([layer for u in units[a:b] for layer in u]) for a, b in zip(cuts, cuts[1:])]
    x = torch.randn(2, *shape)
    out = x
    for stage in stages:
        out = stage(out)
    assert torch.equal(out, model(x))
    merged = {}
    for stage in stages:
        merged.update(stage.model_state_dict())
    assert merged.keys() == model.state_dict().keys()


def test_balance_stages_minimises_the_largest_stage():
    assert balance_stages([8320, 16512, 1290], 2) == [0, 1, 3]
    assert balance_stages([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balance_stages([10, 1, 1, 10], 3) in ([0, 1, 3, 4], [0, 1, 2, 4])
    w = [5, 1, 1, 1, 5, 1]
    cuts = balance_stages(w, 3)
    assert max(sum(w[a:b]) for a, b in zip(cuts, cuts[1:])) == 6


def test_optimizer_state_round_trips_through_names():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    named = optimizer_state_by_name(opt, names)
    assert set(named["state"]) == set(names) and named["param_groups"][0]["params"] == names
    back = optimizer_state_by_index(named, names)
    assert all(torch.equal(back["state"][i]["momentum_buffer"], opt.state_dict()["state"][i]["momentum_buffer"])
               for i in range(4))
    # a stage takes its own parameters out of the whole model's state
    part = optimizer_state_by_index(named, names[2:])
    assert set(part["state"]) == {0, 1} and part["param_groups"][0]["params"] == [0, 1]
    assert torch.equal(part["state"][0]["momentum_buffer"], named["state"]["1.weight"]["momentum_buffer"])
    assert not dist.is_initialized()
