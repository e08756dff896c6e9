"""The ``gpt`` language model: its structure (GPT-2's parameter count, causality) and real trainer
runs under torchrun on 2 ranks (gloo, 1 CPU thread each) on a small token dataset written here.

One module-scoped set of runs (ddp, fsdp, fsdp with activation checkpointing and CPU offload,
pipeline, and a run stopped by ``train.max_steps`` then resumed) serves every assertion, so the
module costs six torchrun launches."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer_helpers import records, torchrun, write_job
from trainer_pkg.config import ConfigError
from trainer_pkg.models import GPT, build_model, pipeline_units, sequential_layers
from trainer_pkg.registry import pipeline_layer_count
from trainer_pkg.tokens import write_tokens

VOCAB = 32
TINY = {"layers": 2, "heads": 2, "embed_dim": 32, "context_length": 32}


# -- the model ------------------------------------------------------------------------------------


def test_gpt2_124m_has_nanogpts_parameter_count():
    with torch.device("meta"):  # no memory: shapes only
        model = build_model("gpt", {"layers": 12, "heads": 12, "embed_dim": 768, "context_length": 1024},
                            (1024,), num_classes=50257)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # tied: lm_head is wte
    assert model.lm_head.weight is model.wte.weight
    assert [type(b).__name__ for b in model.blocks] == ["Block"] * 12
    with torch.device("meta"):
        untied = build_model("gpt", {"layers": 12, "heads": 12, "embed_dim": 768, "context_length": 1024,
                                     "tied_embeddings": False}, (1024,), num_classes=50257)
    assert sum(p.numel() for p in untied.parameters()) == 124_439_808 + 50257 * 768


def test_gpt_is_causal_and_maps_tokens_to_logits_over_the_vocabulary():
    torch.manual_seed(0)
    model = build_model("gpt", TINY, (16,), num_classes=VOCAB).eval()
    x = torch.randint(0, VOCAB, (3, 16))
    logits = model(x)
    assert logits.shape == (3, 16, VOCAB) and logits.dtype == torch.float32
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % VOCAB
    after = model(changed)
    assert torch.equal(after[:, :9], logits[:, :9])  # earlier positions never see a later token
    assert not torch.allclose(after[:, 9:], logits[:, 9:])
    with pytest.raises(ValueError, match="window of 33 tokens is longer than the model's context_length 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_gpt_init_is_gpt2s():
    torch.manual_seed(0)
    model = build_model("gpt", {"layers": 8, "embed_dim": 256, "heads": 4}, (128,), num_classes=1000)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[0].attn.c_attn.bias.abs().max().item() == 0.0


def test_gpt_pipeline_layers_compose_to_the_model_and_refuse_tied_embeddings():
    torch.manual_seed(0)
    params = {**TINY, "layers": 3, "tied_embeddings": False}
    model = build_model("gpt", params, (16,), num_classes=VOCAB).eval()
    layers = sequential_layers(model)
    assert [n for n, _ in layers] == ["embedding", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert len(pipeline_units(layers)) == pipeline_layer_count("gpt", params) == 5
    x = torch.randint(0, VOCAB, (2, 16))
    out = x
    for _, layer in layers:
        out = layer(out)
    assert torch.equal(out, model(x))
    tied = build_model("gpt", TINY, (16,), num_classes=VOCAB)
    with pytest.raises(ConfigError, match="model.params.tied_embeddings: .* set tied_embeddings to false"):
        sequential_layers(tied)
    assert isinstance(tied, GPT)


def test_token_loss_and_accuracy_count_every_token_and_evaluation_batches_by_tokens():
    from trainer_pkg.parallel import correct, cross_entropy, eval_batch_size

    torch.manual_seed(0)
    logits, y = torch.randn(3, 5, VOCAB), torch.randint(0, VOCAB, (3, 5))
    flat = torch.nn.functional.cross_entropy(logits.reshape(15, VOCAB), y.reshape(15), reduction="none")
    torch.testing.assert_close(cross_entropy(logits, y), flat.mean())
    torch.testing.assert_close(cross_entropy(logits, y, reduction="none"), flat.view(3, 5).mean(1))
    y[0] = logits[0].argmax(-1)  # every token of window 0 right, and none of window 1
    y[1] = (logits[1].argmax(-1) + 1) % VOCAB
    assert correct(logits, y)[:2].tolist() == [1.0, 0.0]
    assert eval_batch_size(torch.zeros(4, 1024, dtype=torch.long)) == 16  # GPT-2 windows: 16,384 tokens
    assert eval_batch_size(torch.zeros(4, 64)) == 512  # a table's samples


# -- training under torchrun ----------------------------------------------------------------------


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    """A learnable stream: a fixed cycle through the vocabulary, a tenth of the tokens replaced by noise."""
    cycle = (np.arange(n) * 7) % VOCAB
    return np.where(rng.random(n) < 0.1, rng.integers(0, VOCAB, n), cycle)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Output folders of 2-rank runs on the same data and seed: ddp, fsdp, fsdp with activation
    checkpointing per Block and CPU offload, pipeline, and ddp stopped
    by train.max_steps inside epoch 0, then resumed to the end from its sharded checkpoint
    (``resumed``)."""
    root = tmp_path_factory.mktemp("gpt")
    rng = np.random.default_rng(0)
    # 5,000 training tokens / 32 per window = 156 windows: 78 per rank, 5 batches of 16 per epoch
    data = write_tokens(str(root / "data"), vocab_size=VOCAB, train=[_tokens(rng, 3000), _tokens(rng, 2000)],
                        val=[_tokens(rng, 800)])
    base = {"data": {"format": "tokens", "uri": data, "seq_len": 32, "val_windows": 16},
            "train": {"epochs": 2, "batch_size": 16, "lr": 0.003, "optimizer": "adamw", "seed": 3,
                      "log_every_steps": 1},
            "parallel": {"procs_per_node": 2}}
    jobs = {
        "ddp": {"model": {"arch": "gpt", "params": TINY}, "parallel": {"strategy": "ddp"}},
        "fsdp": {"model": {"arch": "gpt", "params": TINY}, "parallel": {"strategy": "fsdp"}},
        "fsdp_ac_offload": {"model": {"arch": "gpt", "params": TINY},
                            "parallel": {"strategy": "fsdp", "activation_checkpointing": True, "cpu_offload": True}},
        "pipeline": {"model": {"arch": "gpt", "params": {**TINY, "tied_embeddings": False}},
                     "parallel": {"strategy": "pipeline", "microbatches": 2}},
        "resumed": {"model": {"arch": "gpt", "params": TINY}, "parallel": {"strategy": "ddp"},
                    "output": {"checkpoint_format": "sharded"},  # DCP keeps the mid-epoch position too
                    "train": {"max_steps": 3}},
    }
    out = {}
    for name, job in jobs.items():
        sections = {k: {**base.get(k, {}), **job.get(k, {})} for k in {*base, *job}}
        config = write_job(root / name, **sections)
        run = torchrun(config, nproc=2, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        out[name] = root / name / "out"
        if name == "resumed":
            out["stopped_records"] = records(out[name])
            sections["train"]["max_steps"] = 0
            run = torchrun(write_job(root / name, **sections), nproc=2, timeout=180)
            assert run.returncode == 0, run.stderr[-3000:]
    return out


def _model(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_ac_offload", "pipeline"])
def test_gpt_trains_on_2_ranks_and_reports_perplexity(runs, strategy):
    recs = records(runs[strategy])
    steps = [r for r in recs if r["event"] in ("started", "step")]
    # 156 windows per epoch: ddp and fsdp 78 per rank, 5 batches of 16; one pipeline reads all, 9 full batches
    per_epoch = 9 if strategy == "pipeline" else 5
    assert [r["step"] for r in steps] == list(range(1, 2 * per_epoch + 1))
    assert sum(r["train_loss"] for r in steps[-3:]) / 3 < sum(r["train_loss"] for r in steps[:3]) / 3 - 0.3
    assert all(r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 32) for r in steps)
    epochs = [r for r in recs if r["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert epochs[1]["val_loss"] < epochs[0]["val_loss"] < math.log(VOCAB)  # below a uniform guess
    for e in epochs:
        assert e["val_perplexity"] == pytest.approx(math.exp(e["val_loss"]), rel=1e-12)
        assert 0.0 <= e["val_accuracy"] <= 1.0
    assert epochs[1]["val_accuracy"] > 2.0 / VOCAB
    assert recs[-1]["event"] == "completed"
    state = _model(runs[strategy])  # the whole model's bare state dict, whatever the strategy
    model = build_model("gpt", {**TINY, "tied_embeddings": strategy != "pipeline"}, (32,), VOCAB)
    model.load_state_dict(state)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_run", ["fsdp", "fsdp_ac_offload"])
def test_gpt_fsdp_equals_ddp_to_1e_5_in_fp32(runs, fsdp_run):
    ddp, fsdp = _model(runs["ddp"]), _model(runs[fsdp_run])
    assert ddp.keys() == fsdp.keys()
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], rtol=0, atol=1e-5, msg=key)
    assert not torch.equal(ddp["blocks.0.attn.c_attn.weight"],
                           build_model("gpt", TINY, (32,), VOCAB).state_dict()["blocks.0.attn.c_attn.weight"])


@pytest.mark.slow
def test_gpt_stopped_by_max_steps_inside_an_epoch_resumes_exactly(runs):
    stopped = runs["stopped_records"]
    assert [r["event"] for r in stopped][-2:] == ["epoch", "completed"]
    assert stopped[-2]["step"] == 3 and stopped[-2]["epoch"] == 0  # validated where it stopped
    assert "val_perplexity" in stopped[-2]
    assert (runs["resumed"] / "checkpoints" / "checkpoint" / ".metadata").is_file()
    assert not (runs["resumed"] / "checkpoints" / "last.pt").exists()
    straight, resumed = _model(runs["ddp"]), _model(runs["resumed"])
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), "parameters differ after resume"
    again = records(runs["resumed"])
    assert [r["step"] for r in again if r["event"] in ("started", "step")] == list(range(1, 11))
    final = [r for r in again if r["event"] == "epoch"][-1]
    assert final == {**final, "epoch": 1, "step": 10}
    assert final["val_loss"] == [r for r in records(runs["ddp"]) if r["event"] == "epoch"][-1]["val_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp_ac_offload"])
def test_the_memory_plan_is_what_each_rank_measured(runs, name):
    """trainer_pkg.memory_plan against the trainer's rank_memory (CPU: the state it holds and the
    activations saved for backward), term by term, on the busiest rank."""
    from trainer_pkg.config import JobConfig
    from trainer_pkg.memory_plan import plan

    cfg = JobConfig.from_json((runs[name].parent / "job.json").read_text())
    planned = plan(cfg, input_shape=(32,), num_classes=VOCAB)
    completed = [r for r in records(runs[name]) if r["event"] == "completed"]
    busiest = max(completed[-1]["rank_memory"], key=lambda m: m["peak_bytes"])
    assert busiest["device"] == "cpu"
    held = busiest["params_bytes"] + busiest["grads_bytes"] + busiest["optimizer_bytes"]
    # under CPU offload the plan puts the shards in host memory: on a CPU run that is where they are
    assert planned.params_bytes + planned.grads_bytes + planned.optimizer_bytes + planned.host_bytes == \
        pytest.approx(held, rel=0.05)
    assert planned.activations_bytes == pytest.approx(busiest["activations_bytes"], rel=0.05)


@pytest.mark.slow
def test_gpt_fsdp_reports_its_memory_and_checkpointing_keeps_fewer_activations(runs):
    def memory(name):
        return [r for r in records(runs[name]) if r["event"] == "epoch"][-1]["rank_memory"]

    ddp, fsdp, checkpointed = memory("ddp"), memory("fsdp"), memory("fsdp_ac_offload")
    params = sum(p.numel() for p in build_model("gpt", TINY, (32,), VOCAB).parameters())
    for rank in range(2):
        # AdamW: parameters, gradients and two moments, fp32 (+ a 4-byte step per parameter tensor)
        assert ddp[rank]["params_bytes"] == ddp[rank]["grads_bytes"] == 4 * params
        held = {name: m[rank]["params_bytes"] + m[rank]["grads_bytes"] + m[rank]["optimizer_bytes"]
                for name, m in (("ddp", ddp), ("fsdp", fsdp), ("ac", checkpointed))}
        assert held["fsdp"] == pytest.approx(held["ddp"] / 2, rel=0.05)
        assert held["ac"] == held["fsdp"]  # offload moves the shards, it does not change them
        # each Block keeps only its input; the embedding, final LayerNorm and loss still save theirs
        assert checkpointed[rank]["activations_bytes"] < 0.6 * fsdp[rank]["activations_bytes"]
        assert fsdp[rank]["activations_bytes"] == ddp[rank]["activations_bytes"]
