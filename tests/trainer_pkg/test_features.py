"""Training features: accumulation, clipping, the lr schedule, bf16, unused parameters, resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from test_strategies import CLASSES, FEATURES, MLP, assert_same, epoch_record, train_run, write_blobs
from trainer_pkg.config import JobConfig
from trainer_pkg.models import build_model
from trainer_pkg.parallel import StrategyError, make_strategy, optimizer_state_by_index
from trainer_pkg.train import lr_factor


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    return write_blobs(tmp_path_factory.mktemp("data") / "blobs.npz")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, blobs):
    return train_run(tmp_path_factory.mktemp("ref"), "one", blobs)


def test_cosine_schedule_with_warmup_values():
    f = lambda s: lr_factor(s, schedule="cosine", warmup_steps=4, total_steps=20)  # noqa: E731
    assert [f(s) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert f(12) == pytest.approx(0.5)  # halfway through the 16 cosine steps
    assert f(8) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert f(20) == pytest.approx(0.0) and f(25) == pytest.approx(0.0)
    assert [lr_factor(s, schedule="constant", warmup_steps=1, total_steps=9) for s in (0, 1, 8)] == [0.5, 1, 1]
    assert lr_factor(0, schedule="cosine", warmup_steps=0, total_steps=10) == 1.0


def test_grad_accumulation_equals_the_bigger_batch(tmp_path, blobs, reference):
    # One process: 2 batches of 16 per step; two FSDP ranks: 2 batches of 8 per rank per step.
    # Both see the same 32 samples per optimizer step as the reference's one batch of 32.
    state, recs = train_run(tmp_path, "accum", blobs, train={"batch_size": 16, "grad_accum_steps": 2})
    assert_same(state, reference[0])
    assert recs[-1]["step"] == 16
    fsdp, _ = train_run(tmp_path, "fsdp", blobs, nproc=2, parallel={"strategy": "fsdp"},
                        train={"batch_size": 8, "grad_accum_steps": 2})
    assert_same(fsdp, reference[0])


def test_clipping_bounds_the_global_gradient_norm(tmp_path):
    # 32 samples: one step of one batch of 32 (fsdp: 16 per rank; pipeline: 2 stages). SGD without
    # momentum and lr 1 moves the weights by exactly the clipped gradient.
    data = write_blobs(tmp_path / "small.npz", n_train=32, n_val=8)
    train = {"lr": 1.0, "momentum": 0.0, "grad_clip_norm": 0.01, "log_every_steps": 1}
    torch.manual_seed(3)
    model = build_model("mlp", MLP["params"], (FEATURES,), CLASSES)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with np.load(data) as z:
        F.cross_entropy(model(torch.from_numpy(z["x_train"])), torch.from_numpy(z["y_train"])).backward()
    true_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item()
    assert true_norm > 0.1

    for name, nproc, parallel, batch in [("fsdp", 2, {"strategy": "fsdp"}, 16),
                                         ("pipeline", 2, {"strategy": "pipeline"}, 32)]:
        state, recs = train_run(tmp_path, name, data, nproc=nproc, parallel=parallel,
                                train={**train, "batch_size": batch})
        assert recs[0]["step"] == 1 and recs[-1]["step"] == 1
        assert recs[0]["grad_norm"] == pytest.approx(true_norm, rel=1e-5), name  # before clipping
        moved = torch.sqrt(sum((state[k] - initial[k]).pow(2).sum() for k in state)).item()
        assert moved == pytest.approx(0.01, rel=1e-4), name


def test_bf16_autocast_trains_on_cpu(tmp_path, blobs, reference):
    state, recs = train_run(tmp_path, "bf16", blobs, train={"precision": "bf16", "epochs": 2})
    assert epoch_record(recs)["val_accuracy"] >= 0.9
    assert all(v.dtype == torch.float32 for v in state.values())  # the weights stay fp32
    assert not all(torch.equal(state[k], reference[0][k]) for k in state)  # it really ran in bf16


def test_lr_schedule_and_resume_from_a_checkpoint_with_scheduler_state(tmp_path, blobs):
    # 16 steps per epoch; 24 warmup steps run across the resume.
    train = {"warmup_steps": 24, "lr_schedule": "constant"}
    whole, whole_recs = train_run(tmp_path, "whole", blobs, train={**train, "epochs": 2})
    lrs = {r["step"]: r["lr"] for r in whole_recs if r["event"] == "step"}
    assert lrs[4] == pytest.approx(0.1 * 5 / 25) and lrs[20] == pytest.approx(0.1 * 21 / 25)
    assert lrs[28] == pytest.approx(0.1)

    train_run(tmp_path, "split", blobs, train={**train, "epochs": 1})
    ckpt_path = tmp_path / "split" / "out" / "checkpoints" / "last.pt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    assert ckpt["scheduler"]["last_epoch"] == 16 and ckpt["scaler"] is None
    assert ckpt["optimizer"]["param_groups"][0]["params"][0] == "net.1.weight"

    # An older checkpoint: no scheduler or scaler, optimizer keyed by index. It resumes the same way.
    old_dir = tmp_path / "old" / "out" / "checkpoints"
    old_dir.mkdir(parents=True)
    old = {k: v for k, v in ckpt.items() if k not in ("scheduler", "scaler", "strategy")}
    names = ckpt["optimizer"]["param_groups"][0]["params"]
    old["optimizer"], old["version"] = optimizer_state_by_index(ckpt["optimizer"], names), 1
    old["model"] = {f"module.{k}": v for k, v in ckpt["model"].items()}  # as DDP's own state dict
    torch.save(old, old_dir / "last.pt")

    resumed, recs = train_run(tmp_path, "split", blobs, train={**train, "epochs": 2})
    assert [r["resumed"] for r in recs if r["event"] == "started"] == [False, True]
    assert_same(resumed, whole, atol=0.0)
    assert {r["step"]: r["lr"] for r in recs if r["event"] == "step"} == lrs

    from_old, _ = train_run(tmp_path, "old", blobs, train={**train, "epochs": 2})
    assert_same(from_old, whole, atol=0.0)


class WithAuxHead(torch.nn.Module):
    """A classifier whose auxiliary head is switched off: its parameters never get a gradient."""

    def __init__(self, use_aux: bool = False):
        super().__init__()
        self.body = torch.nn.Linear(4, 3)
        self.aux = torch.nn.Linear(4, 3)
        self.use_aux = use_aux

    def layers(self):
        return [("body", self.body)]

    def forward(self, x):
        return self.body(x) + (self.aux(x) if self.use_aux else 0)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_unused_parameters_policy(one_rank_group):
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    autocast = torch.autocast("cpu", enabled=False)

    strict = make_strategy(JobConfig(), WithAuxHead(), torch.device("cpu"))
    with pytest.raises(StrategyError) as info:
        strict.forward_backward(x, y, loss_scale=1.0, sync=True, autocast=autocast)
    assert str(info.value).startswith(
        "parameters got no gradient in the first step: aux.weight, aux.bias. DDP must be told to expect "
        "that: set train.find_unused_parameters to true")

    cfg = JobConfig.from_dict({"train": {"find_unused_parameters": True}})
    model = WithAuxHead()
    aux_before = model.aux.weight.detach().clone()
    relaxed = make_strategy(cfg, model, torch.device("cpu"))
    opt = torch.optim.SGD(relaxed.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        relaxed.forward_backward(x, y, loss_scale=1.0, sync=True, autocast=autocast)
        opt.step()
    assert torch.equal(model.aux.weight, aux_before)  # left unchanged
    assert model.body.weight.grad is not None


def test_cli_flags_mirror_the_new_config_fields():
    from trainer_pkg.train import build_parser, config_from_args

    args = build_parser().parse_args([
        "--strategy", "fsdp", "--pipeline-stages", "2", "--microbatches", "8", "--pipeline-schedule", "1f1b",
        "--precision", "bf16", "--grad-accum-steps", "4", "--grad-clip-norm", "1.5", "--lr-schedule", "cosine",
        "--warmup-steps", "10", "--find-unused-parameters", "--model", "mlp"])
    cfg = config_from_args(args)
    assert (cfg.parallel.strategy, cfg.parallel.pipeline_stages, cfg.parallel.microbatches,
            cfg.parallel.pipeline_schedule) == ("fsdp", 2, 8, "1f1b")
    t = cfg.train
    assert (t.precision, t.grad_accum_steps, t.grad_clip_norm, t.lr_schedule, t.warmup_steps,
            t.find_unused_parameters) == ("bf16", 4, 1.5, "cosine", 10, True)
    assert config_from_args(build_parser().parse_args([])).train.find_unused_parameters is False
    # one process cannot be a pipeline: the shape check shows the arithmetic
    with pytest.raises(Exception, match="1 node × 1 process = 1 rank; a pipeline needs at least 2 stages"):
        config_from_args(build_parser().parse_args(["--strategy", "pipeline"]))


def test_ddp_does_not_sync_buffers_in_forward_and_says_nothing_about_it(one_rank_group):
    """The wrapper turns off the per-forward buffer broadcast with the switch this torch has, so no
    deprecation warning lands in every job's log (torch 2.13 warned on broadcast_buffers)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = make_strategy(JobConfig(), WithAuxHead(use_aux=True), torch.device("cpu"))
    assert [str(w.message) for w in caught if "buffers" in str(w.message)] == []
    ddp = strategy.ddp
    assert getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) is False
