"""FSDP2 for large models: mixed precision, activation checkpointing, CPU offload, gradient
accumulation's single reduce-scatter, sharded (DCP) checkpoints resumed on another world size,
torch.compile, and the memory each rank reports (``rank_memory``). Real torchrun runs over gloo.

The model is a user's (``custom``) stack of residual MLP blocks, the shape of a transformer's blocks:
each ``Block`` gets its own ``fully_shard`` (``model.shard_classes``) and, with activation
checkpointing, its own checkpoint. Every weight's first dimension (16, 64, 4) divides by 2 and 4, so
FSDP's shards are exactly 1/W of the model.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from test_strategies import assert_same, epoch_record, write_blobs
from trainer_helpers import launch, records, torchrun, write_job
from trainer_pkg.config import JobConfig
from trainer_pkg.memory import SavedActivations, rank_memory
from trainer_pkg.parallel import fsdp_units, maybe_apply_ac
from trainer_pkg.world_shape import config_errors

BLOCKS = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, features, classes, width, depth):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(num_classes, input_shape, width=16, depth=2):
    return Net(input_shape[0], num_classes, width, depth)
'''
PARAMS = 16 * 16 + 16 + 2 * (2 * 16 + 16 * 64 + 64 + 64 * 16 + 16) + 16 * 4 + 4  # 4,584
STEPS = 8  # 512 samples / 2 ranks / batch 16 = 16 batches, 2 per optimizer step


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("large")
    (root / "code" / "blocks").mkdir(parents=True)
    (root / "code" / "blocks" / "__init__.py").write_text("")
    (root / "code" / "blocks" / "model.py").write_text(BLOCKS)
    return root, write_blobs(root / "blobs.npz")


def run(setup, name, *, nproc=2, parallel=None, train=None, checkpoints_from=None):
    """One job of the block model (sharded checkpoints); returns (model.pt, records, stdout).
    ``checkpoints_from``: a run whose checkpoint directory this one starts from (a copy)."""
    root, blobs = setup
    out = root / name / "out"
    if checkpoints_from is not None and not out.exists():
        shutil.copytree(root / checkpoints_from / "out" / "checkpoints", out / "checkpoints")
    job = write_job(root / name, data={"format": "npz", "uri": str(blobs)},
                    model={"arch": "custom", "entry_point": "blocks.model:build", "shard_classes": ["Block"]},
                    code={"dir": str(root / "code")}, output={"checkpoint_format": "sharded"},
                    parallel={"strategy": "fsdp", "procs_per_node": nproc, **(parallel or {})},
                    train={"epochs": 1, "batch_size": 16, "grad_accum_steps": 2, "lr": 0.05, "seed": 5,
                           "log_every_steps": 4, **(train or {})})
    done = launch(job) if nproc == 1 else torchrun(job, nproc=nproc)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True), records(out), done.stdout


def held_bytes(entry):
    return entry["params_bytes"] + entry["grads_bytes"] + entry["optimizer_bytes"]


@pytest.fixture(scope="module")
def fsdp(setup):
    return run(setup, "fsdp")


@pytest.mark.slow
def test_fsdp_reduce_scatters_once_per_step_and_reports_its_shards(fsdp):
    state, recs, stdout = fsdp
    # 2 Blocks + the root (embed and head): 3 reduce-scatters per optimizer step, not 3 × 2 batches
    assert f"fsdp: {3 * STEPS} gradient reduce-scatter(s) in {STEPS} optimizer step(s)" in stdout
    for event in ("epoch", "completed"):
        memory = [r for r in recs if r["event"] == event][-1]["rank_memory"]
        assert len(memory) == 2
        for entry in memory:
            # SGD with momentum: one buffer per parameter; fp32, half of the model on each rank
            assert entry["params_bytes"] == entry["grads_bytes"] == entry["optimizer_bytes"] == PARAMS * 4 // 2
            assert entry["activations_bytes"] > 0 and entry["device"] == "cpu"
            assert entry["peak_bytes"] == held_bytes(entry) + entry["activations_bytes"]
    assert sum(v.numel() for v in state.values()) == PARAMS  # model.pt: the whole model, bare


@pytest.mark.slow
def test_activation_checkpointing_and_offload_change_memory_not_the_result(setup, fsdp):
    state, recs, stdout = run(setup, "fsdp_ac_offload", parallel={"activation_checkpointing": True, "cpu_offload": True})
    assert "activation checkpointing per unit" in stdout and "shards offloaded to CPU memory" in stdout
    assert_same(state, fsdp[0], atol=1e-6)
    assert abs(epoch_record(recs)["val_loss"] - epoch_record(fsdp[1])["val_loss"]) < 1e-6
    plain, checkpointed = epoch_record(fsdp[1])["rank_memory"][0], epoch_record(recs)["rank_memory"][0]
    # Each Block keeps only its input: 6 of its saved tensors (norm, up, gelu, down) fewer per block
    assert checkpointed["activations_bytes"] < 0.7 * plain["activations_bytes"]
    assert held_bytes(checkpointed) == held_bytes(plain)

    ddp_state, ddp_recs, _ = run(setup, "ddp_ac", parallel={"strategy": "ddp", "activation_checkpointing": True})
    assert_same(ddp_state, fsdp[0], atol=1e-5)
    ddp_memory = epoch_record(ddp_recs)["rank_memory"]
    # DDP holds the whole model on every rank, FSDP half of it at W = 2 (± 5 %)
    for fsdp_entry, ddp_entry in zip(epoch_record(fsdp[1])["rank_memory"], ddp_memory):
        assert held_bytes(fsdp_entry) == pytest.approx(held_bytes(ddp_entry) / 2, rel=0.05)
        assert ddp_entry["params_bytes"] == PARAMS * 4
    assert ddp_memory[0]["activations_bytes"] == checkpointed["activations_bytes"]


@pytest.mark.slow
def test_bf16_mixed_precision_trains_fp32_shards(setup, fsdp):
    state, recs, stdout = run(setup, "bf16", train={"precision": "bf16"})
    assert "bf16 parameters (FSDP2 mixed precision, fp32 gradient reduction)" in stdout
    assert all(v.dtype == torch.float32 for v in state.values())  # the shards the optimizer steps
    val = epoch_record(recs)
    assert val["val_accuracy"] >= 0.9
    # bf16 compute rounds differently from fp32, but learns the same
    assert 0 < abs(val["val_loss"] - epoch_record(fsdp[1])["val_loss"]) < 0.05
    assert epoch_record(recs)["rank_memory"][0]["params_bytes"] == PARAMS * 4 // 2


@pytest.mark.slow
def test_a_sharded_checkpoint_of_two_ranks_resumes_on_one_and_on_four(setup, fsdp):
    saved, saved_recs, _ = fsdp
    checkpoint = setup[0] / "fsdp" / "out" / "checkpoints" / "checkpoint"
    assert (checkpoint / ".metadata").is_file() and (checkpoint / "trainboard.pt").is_file()
    assert not (checkpoint / "model.pt").exists() and not list(checkpoint.parent.glob(".checkpoint.tmp-*"))
    # epochs 1 again: nothing left to train, so model.pt is what each world size loaded (1 rank: ddp)
    for nproc, strategy in ((1, "ddp"), (4, "fsdp")):
        loaded, _, stdout = run(setup, f"resume{nproc}", nproc=nproc, checkpoints_from="fsdp",
                                parallel={"strategy": strategy})
        assert f"resuming from {setup[0]}/resume{nproc}/out/checkpoints/checkpoint: epoch 1, batch 0, step {STEPS}" in stdout
        assert_same(loaded, saved, atol=0)
    # and training goes on from there on 4 ranks: 512 / 4 / 16 = 8 batches, 4 more steps
    state, recs, _ = run(setup, "resume4", nproc=4, train={"epochs": 2})
    assert [r["resumed"] for r in recs if r["event"] == "started"] == [True]  # the epochs-1 run took no step
    assert recs[-1]["step"] == STEPS + 4
    assert epoch_record(recs)["val_loss"] < epoch_record(saved_recs)["val_loss"]
    assert (state["head.weight"] - saved["head.weight"]).abs().max() > 1e-4
    memory = epoch_record(recs)["rank_memory"]
    ddp_bytes = PARAMS * 4 * 3  # every rank of DDP: parameters, gradients, momentum
    assert len(memory) == 4
    for entry in memory:
        assert held_bytes(entry) == pytest.approx(ddp_bytes / 4, rel=0.05)


@pytest.mark.slow
def test_a_sharded_checkpoint_of_another_model_is_refused_naming_the_parameter(setup, fsdp):
    root, blobs = setup
    shutil.copytree(root / "fsdp" / "out" / "checkpoints", root / "wider" / "out" / "checkpoints")
    job = write_job(root / "wider", data={"format": "npz", "uri": str(blobs)},
                    model={"arch": "custom", "entry_point": "blocks.model:build", "params": {"width": 32},
                           "shard_classes": ["Block"]},
                    code={"dir": str(root / "code")}, output={"checkpoint_format": "sharded"},
                    parallel={"strategy": "fsdp"}, train={"epochs": 2, "batch_size": 16})
    done = launch(job)
    assert done.returncode == 1
    checkpoint = root / "wider" / "out" / "checkpoints" / "checkpoint"
    assert (f"trainer error: checkpoint {checkpoint} does not fit this model/optimizer (ValueError: Size mismatch "
            "between saved torch.Size([16, 16]) and current: torch.Size([32, 16]) for model.embed.weight); "
            "delete it or set output.checkpoint_dir to start fresh") in done.stderr


@pytest.mark.slow
def test_compile_trains_a_tiny_mlp(tmp_path, monkeypatch):
    # Inductor's own cache, kept between runs on this machine (as the docker layer cache is): the first
    # run generates and compiles the kernels (26 CPU-s here), a later one loads them (6.5 CPU-s), both
    # through torch.compile's real path. Inductor keys its entries by torch's version and the graph.
    inductor = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainboard" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    monkeypatch.setenv("TORCH_LOGS", "+inductor")  # its cache lookups, one per compiled graph (~16 KB)
    blobs = write_blobs(tmp_path / "blobs.npz")
    job = write_job(tmp_path, data={"format": "npz", "uri": str(blobs)},
                    model={"arch": "mlp", "params": {"hidden_size": 16, "num_layers": 1}},
                    train={"epochs": 1, "batch_size": 64, "lr": 0.1, "compile": True})
    done = launch(job, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "torch.compile" in done.stdout
    assert epoch_record(records(tmp_path / "out"))["val_accuracy"] >= 0.9
    # This run's graphs went through inductor: generated and compiled now (a miss) or loaded (a hit).
    assert re.findall(r"fx graph cache (?:hit|miss) for key", done.stderr), done.stderr[-3000:]
    assert any(inductor.rglob("*.py"))  # inductor's generated kernels


# -- in process, no ranks ---------------------------------------------------------------------------


def test_saved_activations_count_what_backward_keeps():
    torch.manual_seed(0)
    layer = nn.Linear(16, 32)
    x = torch.randn(8, 16)
    with SavedActivations() as saved:
        out = torch.relu(layer(x)).sum()
    # addmm keeps the input x (8×16) and the weight (a parameter: not counted); relu its output (8×32)
    assert saved.bytes == (8 * 16 + 8 * 32) * 4
    out.backward()

    block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    maybe_apply_ac([block], True)
    h = torch.randn(8, 16, requires_grad=True)
    with SavedActivations() as checkpointed:
        block(h).sum().backward()
    assert checkpointed.bytes == 8 * 16 * 4  # the checkpoint keeps only the block's input
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_rank_memory_counts_parameters_gradients_and_optimizer_state():
    model = nn.Linear(10, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 10)).sum().backward()
    optimizer.step()
    entry = rank_memory(list(model.parameters()), optimizer, torch.device("cpu"), activations_bytes=100)
    n = 44 * 4
    # AdamW: two moments per parameter plus a 0-dim float32 step per parameter tensor
    assert entry == {"params_bytes": n, "grads_bytes": n, "optimizer_bytes": 2 * n + 2 * 4,
                     "activations_bytes": 100, "peak_bytes": 4 * n + 8 + 100, "device": "cpu"}


@pytest.mark.parametrize("parallel, output, train, field, words", [
    ({"strategy": "ddp", "cpu_offload": True}, {}, {}, "parallel.cpu_offload", "set parallel.strategy to fsdp"),
    ({"strategy": "pipeline", "activation_checkpointing": True}, {}, {}, "parallel.activation_checkpointing",
     "use strategy ddp or fsdp"),
    ({"strategy": "pipeline"}, {"checkpoint_format": "sharded"}, {}, "output.checkpoint_format",
     "use checkpoint_format full"),
    ({"strategy": "pipeline"}, {}, {"compile": True}, "train.compile", "use strategy ddp or fsdp"),
])
def test_large_model_settings_a_strategy_cannot_run_are_refused(parallel, output, train, field, words):
    cfg = JobConfig.from_dict({"model": {"arch": "mlp"}, "parallel": {"procs_per_node": 2, **parallel},
                               "output": output, "train": train})
    errs = config_errors(cfg)
    assert list(errs) == [field] and words in errs[field]


def test_settings_are_refused_all_at_once():
    cfg = JobConfig.from_dict({"model": {"arch": "mlp"}, "output": {"checkpoint_format": "sharded"},
                               "parallel": {"strategy": "pipeline", "procs_per_node": 2, "pipeline_stages": 3,
                                            "cpu_offload": True, "activation_checkpointing": True}})
    assert set(config_errors(cfg)) == {"parallel.pipeline_stages", "parallel.cpu_offload",
                                       "parallel.activation_checkpointing", "output.checkpoint_format"}


def test_a_custom_models_module_list_is_sharded_item_by_item():
    # A top-level ModuleList has no forward for FSDP's hooks ("fully_shard does not support containers
    # that do not implement forward"): without model.shard_classes its items are the units.
    namespace: dict = {}
    exec(BLOCKS, namespace)
    model = namespace["build"](4, (16,))
    assert fsdp_units(model, [], custom=True) == [model.embed, model.blocks[0], model.blocks[1], model.head]
    assert fsdp_units(model, ["Block"], custom=True) == [model.blocks[1], model.blocks[0]]
