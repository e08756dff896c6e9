"""trainer_pkg.memory_plan: parameter counts equal torch's, activations equal what autograd saves,
and the plan divides, offloads and suggests as each strategy does."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from trainer_pkg.config import JobConfig
from trainer_pkg.memory_plan import GIB, PlanError, gib, parameter_count, plan
from trainer_pkg.models import build_model

CLASSIFIERS = [
    ("mlp", {}, (64,), 10),
    ("mlp", {"num_layers": 3, "hidden_size": 17}, (1, 8, 8), 7),
    ("cnn", {}, (1, 8, 8), 10),
    ("cnn", {"num_blocks": 3, "channels": 5}, (3, 9, 7), 4),  # odd sizes: the ceil-mode pools
    ("resnet", {}, (3, 32, 32), 10),
    ("resnet", {"width": 4, "num_stages": 2, "blocks_per_stage": 2}, (1, 8, 8), 3),
]

GPT2 = {"layers": 12, "heads": 12, "embed_dim": 768, "context_length": 1024}


GPTS = [  # (params, tokens per window, vocabulary): tied and untied, with and without biases
    ({"layers": 2, "heads": 2, "embed_dim": 32, "context_length": 64}, 64, 256),
    ({"layers": 3, "heads": 4, "embed_dim": 64, "context_length": 64}, 48, 300),
    ({"layers": 2, "heads": 2, "embed_dim": 64, "context_length": 32, "bias": False, "tied_embeddings": False}, 32, 500),
]


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool = False) -> int:
    """Bytes of the distinct storages autograd saves for backward in a forward (under bf16 autocast
    with ``bf16``, as the trainer runs ddp) and its fp32 loss, parameters left out (what the trainer
    measures: trainer_pkg.memory.SavedActivations)."""
    params = {p.data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    return sum(storages.values())


def _config(arch, params, **sections) -> JobConfig:
    data = {"model": {"arch": arch, "params": params}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return JobConfig.from_dict(data)


@pytest.mark.parametrize("arch, params, shape, classes", CLASSIFIERS)
def test_parameters_and_activations_match_torch(arch, params, shape, classes):
    model = build_model(arch, params, shape, classes).train()
    assert parameter_count(arch, params, shape, classes) == sum(p.numel() for p in model.parameters())
    batch = 16
    saved = _saved_bytes(model, torch.randn(batch, *shape), torch.randint(0, classes, (batch,)))
    planned = plan(_config(arch, params, train={"batch_size": batch}), input_shape=shape, num_classes=classes)
    assert planned.activations_bytes == pytest.approx(saved, rel=0.05)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("params, tokens, vocab", GPTS)
def test_gpt_parameters_and_activations_match_torch(params, tokens, vocab, precision):
    model = build_model("gpt", params, (tokens,), vocab).train()
    assert parameter_count("gpt", params, (tokens,), vocab) == sum(p.numel() for p in model.parameters())
    batch = 4
    saved = _saved_bytes(model, torch.randint(0, vocab, (batch, tokens)), torch.randint(0, vocab, (batch, tokens)),
                         bf16=precision == "bf16")
    cfg = _config("gpt", params, data={"format": "tokens", "uri": "/d", "seq_len": tokens},
                  train={"batch_size": batch, "precision": precision})
    assert plan(cfg, input_shape=(tokens,), num_classes=vocab).activations_bytes == pytest.approx(saved, rel=0.01)


def test_gpt2_small_has_its_published_parameter_count():
    assert parameter_count("gpt", GPT2, (1024,), 50257) == 124_439_808
    # untied: the head is a second V × C matrix
    assert parameter_count("gpt", {**GPT2, "tied_embeddings": False}, (1024,), 50257) == 124_439_808 + 50257 * 768


def test_fsdp_holds_one_world_th_of_ddp_and_offload_moves_it_to_the_host():
    cfg = _config("gpt", GPT2, data={"format": "tokens", "uri": "/d"}, train={"optimizer": "adamw", "batch_size": 4})
    ddp = plan(cfg, input_shape=(1024,), num_classes=50257, world_size=8)
    assert ddp.params_bytes == ddp.grads_bytes == 124_439_808 * 4
    assert ddp.optimizer_bytes == 2 * 124_439_808 * 4
    cfg.parallel.strategy = "fsdp"
    fsdp = plan(cfg, input_shape=(1024,), num_classes=50257, world_size=8)
    assert fsdp.params_bytes == -(-124_439_808 // 8) * 4
    assert fsdp.activations_bytes == ddp.activations_bytes  # the same batch per rank
    assert any("unsharded parameters" in line for line in fsdp.lines)
    cfg.parallel.cpu_offload = True
    offload = plan(cfg, input_shape=(1024,), num_classes=50257, world_size=8)
    assert offload.params_bytes == offload.grads_bytes == offload.optimizer_bytes == 0
    assert offload.host_bytes == fsdp.params_bytes + fsdp.grads_bytes + fsdp.optimizer_bytes
    assert offload.peak_bytes == fsdp.peak_bytes - offload.host_bytes
    assert offload.offloaded == {"params_bytes": fsdp.params_bytes, "grads_bytes": fsdp.grads_bytes,
                                 "optimizer_bytes": fsdp.optimizer_bytes}
    assert offload.needed_bytes == offload.peak_bytes  # a GPU holds none of it
    assert offload.lines[-1] == f"peak per rank: {gib(offload.peak_bytes)}"


def test_offload_without_gpus_still_counts_the_host_memory_in_the_summary_and_the_lines():
    """On a machine without GPUs (device_unit "rank") the host's memory is the ranks' own: the summary,
    the last line and fits all count the offloaded shards (the new-user trial's table-vs-summary defect)."""
    cfg = _config("gpt", GPT2, data={"format": "tokens", "uri": "/d"},
                  train={"optimizer": "adamw", "batch_size": 4}, parallel={"strategy": "fsdp", "cpu_offload": True})
    kept = plan(cfg, input_shape=(1024,), num_classes=50257, world_size=8, device_bytes=64 * GIB, device_unit="rank")
    assert kept.host_bytes > 0
    assert kept.needed_bytes == kept.peak_bytes + kept.host_bytes
    assert kept.summary == f"needs {gib(kept.needed_bytes)} per rank; the device has 64.0 GiB"
    assert kept.lines[-1] == (f"peak per rank: {gib(kept.needed_bytes)} (with the {gib(kept.host_bytes)} offloaded: "
                              f"without GPUs the host's memory is where the ranks run) of 64.0 GiB (fits)")
    tight = plan(cfg, input_shape=(1024,), num_classes=50257, world_size=8, device_unit="rank",
                 device_bytes=(kept.peak_bytes + kept.needed_bytes) // 2)
    assert tight.fits is False  # it would fit a GPU of that size, not a rank's share of the host
    assert plan(cfg, input_shape=(1024,), num_classes=50257, world_size=8,
                device_bytes=(kept.peak_bytes + kept.needed_bytes) // 2).fits is True


def test_activation_checkpointing_keeps_block_inputs_and_one_block():
    cfg = _config("gpt", {**GPT2, "layers": 24}, data={"format": "tokens", "uri": "/d"}, train={"batch_size": 2})
    full = plan(cfg, input_shape=(1024,), num_classes=50257)
    cfg.parallel.activation_checkpointing = True
    ac = plan(cfg, input_shape=(1024,), num_classes=50257)
    s, b, h = 1024, 2, 768
    per_block = b * (16 * s * h * 4 + 2 * 2 * s * 4 + 12 * s * 4)  # 16 elements of s·h, LN stats, log-sum-exp
    assert full.activations_bytes - ac.activations_bytes == 24 * per_block - 24 * b * s * h * 4
    assert ac.buffers_bytes - full.buffers_bytes == per_block  # the block being recomputed


def test_a_job_that_cannot_fit_names_the_fsdp_world_that_would():
    cfg = _config("gpt", {**GPT2, "layers": 48, "embed_dim": 1600, "heads": 25},  # GPT-2 XL, 1.56 B
                  data={"format": "tokens", "uri": "/d"}, train={"optimizer": "adamw", "batch_size": 1},
                  parallel={"procs_per_node": 1})
    planned = plan(cfg, input_shape=(1024,), num_classes=50257, device_bytes=24 * GIB, device_name="ml.g5.xlarge")
    assert planned.fits is False
    assert planned.summary.startswith(f"needs {gib(planned.needed_bytes)} per GPU; ml.g5.xlarge has 24.0 GiB; "
                                      "FSDP across ")
    ranks = int(planned.suggestion.split("FSDP across ")[1].split()[0])
    cfg.parallel.strategy, cfg.parallel.procs_per_node = "fsdp", ranks
    assert plan(cfg, input_shape=(1024,), num_classes=50257, device_bytes=24 * GIB).fits is True
    cfg.parallel.procs_per_node = ranks // 2
    assert plan(cfg, input_shape=(1024,), num_classes=50257, device_bytes=24 * GIB).fits is False


def test_pipeline_plans_its_largest_stage_and_the_micro_batches_in_flight():
    params = {"layers": 4, "heads": 2, "embed_dim": 64, "context_length": 32, "tied_embeddings": False}
    sections = dict(data={"format": "tokens", "uri": "/d"}, train={"batch_size": 8},
                    parallel={"strategy": "pipeline", "procs_per_node": 2, "microbatches": 4})
    gpipe = plan(_config("gpt", params, **sections), input_shape=(32,), num_classes=256)
    sections["parallel"]["pipeline_schedule"] = "1f1b"
    one_f_one_b = plan(_config("gpt", params, **sections), input_shape=(32,), num_classes=256)
    assert "4 of 4 micro-batches" in gpipe.lines[1] and "of 4 micro-batches of 2 samples" in one_f_one_b.lines[1]
    assert one_f_one_b.activations_bytes < gpipe.activations_bytes
    assert gpipe.params_bytes < parameter_count("gpt", params, (32,), 256) * 4


def test_cpu_targets_are_planned_not_checked_and_custom_models_have_no_plan():
    planned = plan(JobConfig(), input_shape=(1, 8, 8), num_classes=10)
    assert planned.fits is None and planned.device_bytes is None
    assert "not checked" in planned.summary
    with pytest.raises(PlanError, match="custom model"):
        plan(_config("custom", {}), input_shape=(4,), num_classes=2)
    with pytest.raises(PlanError, match=r"cnn takes images \(C, H, W\), not samples of shape \(16,\)"):
        plan(_config("cnn", {}), input_shape=(16,), num_classes=2)


def test_memory_plan_is_torch_free():
    code = "import sys, trainer_pkg.memory_plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_evaluation_of_a_large_vocabulary_can_set_the_peak():
    # 16,384 evaluation tokens × 50,257 × (4 + 4) B of logits and log-softmax outweigh 1 window's training
    cfg = _config("gpt", GPT2, data={"format": "tokens", "uri": "/d"}, train={"batch_size": 1})
    planned = plan(cfg, input_shape=(1024,), num_classes=50257)
    state = planned.params_bytes + planned.grads_bytes + planned.optimizer_bytes
    assert planned.evaluation_bytes > planned.activations_bytes + planned.buffers_bytes
    assert planned.peak_bytes == state + planned.evaluation_bytes
    assert planned.evaluation_bytes >= 16_384 * 50257 * 8 + planned.grads_bytes  # DDP's buckets stay resident
    assert "it sets the peak" in planned.lines[-2]
    cfg.data.val_windows = 2  # a rank evaluates at most its share of the validation windows
    assert plan(cfg, input_shape=(1024,), num_classes=50257).evaluation_bytes < 2 * 1024 * 50257 * 9 + planned.grads_bytes


def test_the_suggestion_stays_within_the_backends_ranks_and_nouns_agree():
    cfg = _config("gpt", {**GPT2, "layers": 48, "embed_dim": 1600, "heads": 25},  # GPT-2 XL, 1.56 B
                  data={"format": "tokens", "uri": "/d"}, train={"optimizer": "adamw", "batch_size": 1},
                  parallel={"procs_per_node": 1})
    free = plan(cfg, input_shape=(1024,), num_classes=50257, device_bytes=24 * GIB)
    ranks = int(free.suggestion.split("FSDP across ")[1].split()[0])
    assert ranks == 2
    capped = plan(cfg, input_shape=(1024,), num_classes=50257, device_bytes=24 * GIB, max_ranks=1)
    assert capped.fits is False
    assert capped.suggestion.startswith("no FSDP world this backend can run (at most 1 rank) fits with activation "
                                        "checkpointing; choose an instance type or backend with more GPU memory")
    # A box without GPUs: each rank's share of the machine's memory, and no GPU to suggest (issue 27)
    host = plan(cfg, input_shape=(1024,), num_classes=50257, device_bytes=24 * GIB, max_ranks=1, device_unit="rank")
    assert (host.device_unit, host.fits) == ("rank", False)
    assert host.suggestion.startswith("no FSDP world this backend can run (at most 1 rank) fits with activation "
                                      "checkpointing; choose a machine with more memory per rank (or fewer processes "
                                      "per node)"), host.suggestion
    assert " per rank" in host.summary and "GPU" not in host.summary + host.suggestion
    within = plan(cfg, input_shape=(1024,), num_classes=50257, device_bytes=24 * GIB, max_ranks=ranks)
    assert within.suggestion == free.suggestion
    assert "1 sample per rank per step" in capped.lines[0] and "1 samples" not in " ".join(capped.lines)
