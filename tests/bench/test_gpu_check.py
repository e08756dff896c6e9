"""bench/gpu_check.py's gpt case (GPT-2 124M on a lent GPU) run small on the CPU with ``--smoke``: the
script the GPU session relies on works, and its MFU and plan figures are the arithmetic it claims."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import gpu_check
from tests.trainer_pkg.trainer_helpers import REPO, trainer_env
from trainer_pkg.memory_plan import parameter_count


def test_peak_flops_and_flops_per_token_follow_the_datasheet_and_palm():
    assert gpu_check.peak_flops("NVIDIA H200") == 989e12
    assert gpu_check.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_check.peak_flops("Tesla T4") is None
    # GPT-2 124M: N without the 1024 x 768 position embeddings, plus the attention term 12·L·C·T
    n = 124_439_808 - 1024 * 768
    assert gpu_check.flops_per_token(gpu_check.GPT2_124M, 50257) == 6 * n + 12 * 12 * 768 * 1024


def test_smoke_run_reports_tokens_per_s_mfu_and_plan_against_measured_memory(tmp_path):
    rows = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--work", str(tmp_path / "work"),
                           "--json", str(rows), "--peak-tflops", "0.5"], cwd=REPO, env=trainer_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(rows.read_text())
    assert row["case"] == "gpt-smoke" and row["rc"] == 0
    assert row["timed_steps"] == "2..6"
    assert row["tokens_per_s"] > 0
    smoke, vocab = gpu_check.SMOKE_GPT, gpu_check.SMOKE_VOCAB
    n = parameter_count("gpt", smoke, (64,), vocab) - 64 * 64
    assert row["flops_per_token"] == 6 * n + 12 * 2 * 64 * 64
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 0.5e12, rel=1e-3)
    # on the CPU the trainer measures its four counts; the plan is computed for the same job
    assert row["measured_device"] == "cpu"
    assert row["measured_peak_bytes"] == sum(row["measured_terms"][k] for k in
                                             ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"))
    plan = row["plan_terms"]
    state = plan["params_bytes"] + plan["grads_bytes"] + plan["optimizer_bytes"]
    assert row["plan_bytes"] == state + max(plan["activations_bytes"] + plan["buffers_bytes"], plan["evaluation_bytes"])
    assert 0.5 < row["plan_without_buffers_over_measured"] < 2
