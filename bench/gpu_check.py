"""The trainer's CUDA/NCCL path on a machine with a GPU: one run per case, each timed out, results in
a table and a JSON file. Needs a CUDA GPU; on a CPU-only machine it says so and exits 2.

    PYTHONPATH=. python3 bench/gpu_check.py --json gpu-check.json

Cases (digits, ``cnn`` registry defaults, batch 32, lr 0.05, seed 0, ``--stop-check-s 0``):

``cpu-ddp-1``        reference: world size 1, gloo, CPU (``CUDA_VISIBLE_DEVICES=""``), 2 epochs
``cuda-ddp-1``       world size 1, NCCL on the GPU, fp32; final parameters against ``cpu-ddp-1``
``cuda-fsdp-1``      FSDP2 on NCCL, world size 1; parameters against ``cuda-ddp-1``
``cuda-ddp-1-bf16``  bf16 autocast on the GPU
``cuda-ddp-2-nccl``  2 ranks on the one GPU over NCCL (NCCL refuses two ranks on one device: the
                     case records how the trainer fails, and whether it fails fast)
``cuda-ddp-2-gloo``  2 ranks sharing the GPU over gloo (CUDA tensors through gloo)
``cuda-pipeline-2-gloo``  2 pipeline stages sharing the GPU over gloo
``cuda-sigterm``     a 300-epoch run (auto: NCCL on the GPU) started by ``trainer_pkg.launch``, its
                     process group sent SIGTERM after the first epoch record: exit code, seconds
                     from the signal to exit, and the checkpoint it wrote
``cpu-resume``       that GPU checkpoint resumed on the CPU (``map_location``) for one more epoch
``gpt2-fsdp-bf16``   GPT-2 124M (``gpt``: 12 layers, 12 heads, 768 wide, context 1024, vocabulary 50,257,
                     tied; 124,439,808 parameters) under FSDP2 with bf16 mixed precision on the one GPU,
                     AdamW, ``--gpt-batch`` windows per step, ``--gpt-steps`` steps of random tokens (a record every 10):
                     tokens/s over steps 2..S (the trainer's records), MFU, and the memory plan
                     (:func:`trainer_pkg.memory_plan.plan`) ÷ ``max_memory_allocated`` (the trainer's
                     ``rank_memory`` peak on a GPU)
``gpt2-fsdp-bf16-compile``  the same with ``train.compile`` (the first steps compile; they are outside
                     the window only if S is well past them: the row says how many steps it timed)

MFU (model FLOPs utilisation) = tokens/s × FLOPs per token ÷ the GPU's peak dense bf16 FLOP/s, with
FLOPs per token = 6·N + 12·L·C·T (PaLM, Chowdhery et al. 2022, arXiv:2204.02311, appendix B: 6 FLOPs
per parameter per token for forward and backward, plus the attention scores' 12·layers·width·context;
N excludes the position embeddings, as nanoGPT's ``estimate_mfu`` does). Peaks (:data:`PEAK_BF16_FLOPS`)
are NVIDIA's datasheet figures without sparsity: H100 SXM and H200 989 TFLOP/s (the H200 datasheet
gives 1,979 TFLOP/s "with sparsity"; dense is half), A100 312. ``--peak-tflops`` overrides.

``--smoke`` runs only ``gpt-smoke`` on the CPU (gloo, a 2-layer 64-wide gpt, 6 steps, bf16 autocast):
the same code path and figures, so the script can be checked where no GPU is lent
(``tests/bench/test_gpu_check.py``); MFU is printed only with ``--peak-tflops``.

Figures are reported, never asserted: this is a check to run where a GPU is lent, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Peak dense bf16 tensor FLOP/s by GPU name (NVIDIA's datasheets; "with sparsity" figures halved).
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12), ("A10G", 70e12))

GPT2_124M = {"layers": 12, "heads": 12, "embed_dim": 768, "context_length": 1024, "dropout": 0.0,
             "tied_embeddings": True, "bias": True}
GPT2_VOCAB = 50257
SMOKE_GPT = {"layers": 2, "heads": 2, "embed_dim": 64, "context_length": 64, "dropout": 0.0,
             "tied_embeddings": True, "bias": True}
SMOKE_VOCAB = 512

BASE = ["--dataset", "digits", "--model", "cnn", "--batch-size", "32", "--lr", "0.05", "--seed", "0",
        "--stop-check-s", "0"]


def _env(cpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "TRAINBOARD_LAUNCH_PLATFORM")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _cmd(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "trainer_pkg.train", *args]


def _records(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _summary(out_dir: str, log: str) -> dict:
    recs = _records(out_dir)
    epochs = [r for r in recs if r["event"] == "epoch"]
    lines = [ln for ln in log.splitlines() if "world size" in ln or "error" in ln.lower()]
    return {"events": [r["event"] for r in recs if r["event"] != "step"],
            "step_records": sum(r["event"] == "step" for r in recs),
            "val_accuracy": epochs[-1].get("val_accuracy") if epochs else None,
            "val_loss": epochs[-1].get("val_loss") if epochs else None,
            "samples_per_s": next((r.get("samples_per_s") for r in reversed(recs) if "samples_per_s" in r), None),
            "log_lines": lines[:6]}


def run_case(name: str, work: str, nproc: int, args: list[str], cpu: bool, timeout_s: float) -> dict:
    out_dir = os.path.join(work, name)
    start = time.perf_counter()
    try:
        proc = subprocess.run(_cmd(nproc, [*BASE, *args, "--output-dir", out_dir]), env=_env(cpu), cwd=REPO,
                              capture_output=True, text=True, timeout=timeout_s)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    row = {"case": name, "rc": rc, "seconds": round(time.perf_counter() - start, 2), **_summary(out_dir, log)}
    if rc != 0:
        row["log_tail"] = log[-1500:]
    return row


def max_param_diff(a_dir: str, b_dir: str) -> float | None:
    import torch

    a_path, b_path = os.path.join(a_dir, "model.pt"), os.path.join(b_dir, "model.pt")
    if not (os.path.exists(a_path) and os.path.exists(b_path)):
        return None
    a = torch.load(a_path, map_location="cpu", weights_only=True)
    b = torch.load(b_path, map_location="cpu", weights_only=True)
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


def _launch_config(work: str, out_dir: str, epochs: int, backend: str) -> str:
    cfg = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "cnn", "params": {}},
           "parallel": {"strategy": "ddp", "procs_per_node": 1, "dist_backend": backend},
           "train": {"epochs": epochs, "batch_size": 32, "lr": 0.05, "seed": 0, "stop_check_s": 0},
           "output": {"output_dir": out_dir}}
    path = os.path.join(work, f"job-{epochs}-{backend}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def _launch(config: str) -> list[str]:
    """The product's launcher, as every backend starts the trainer (it exits 0 after a clean stop)."""
    return [sys.executable, "-m", "trainer_pkg.launch", "--config", config, "--standalone", "--nproc-per-node", "1"]


def sigterm_case(work: str, timeout_s: float) -> dict:
    out_dir = os.path.join(work, "cuda-sigterm")
    proc = subprocess.Popen(_launch(_launch_config(work, out_dir, 300, "auto")), env=_env(False), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None and not any(
            r["event"] == "epoch" for r in _records(out_dir)):
        time.sleep(0.2)
    signalled = time.perf_counter()
    os.killpg(proc.pid, signal.SIGTERM)  # the whole process group, as a container stop or spot reclaim does
    try:
        log, _ = proc.communicate(timeout=60)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, rc = proc.communicate()[0], "timeout"
    ckpt = os.path.join(out_dir, "checkpoints")
    row = {"case": "cuda-sigterm", "rc": rc, "seconds_signal_to_exit": round(time.perf_counter() - signalled, 2),
           "checkpoints": sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else [], **_summary(out_dir, log)}
    if rc != 0:
        row["log_tail"] = log[-1500:]
    return row


def resume_on_cpu(work: str, timeout_s: float) -> dict:
    """The GPU run's checkpoint resumed on the CPU (gloo), for 2 epochs more than it had finished."""
    out_dir = os.path.join(work, "cuda-sigterm")
    done = max((r["epoch"] for r in _records(out_dir) if r["event"] == "epoch"), default=0) + 1
    start = time.perf_counter()
    proc = subprocess.run(_launch(_launch_config(work, out_dir, done + 2, "gloo")), env=_env(True), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)
    log = proc.stdout + proc.stderr
    row = {"case": "cpu-resume", "rc": proc.returncode, "seconds": round(time.perf_counter() - start, 2),
           "epochs_before": done, **_summary(out_dir, log)}
    row["resumed_line"] = next((ln for ln in log.splitlines() if "resuming from" in ln), None)
    if proc.returncode != 0:
        row["log_tail"] = log[-1500:]
    return row


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of the GPU named ``device_name`` (:data:`PEAK_BF16_FLOPS`), or None."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def flops_per_token(params: dict, vocab: int) -> float:
    """Training FLOPs per token of the ``gpt`` model ``params``: 6·N + 12·L·C·T (see the module's
    docstring), N = every parameter but the position embeddings, counted once when tied."""
    from trainer_pkg.memory_plan import parameter_count

    L, C, T = params["layers"], params["embed_dim"], params["context_length"]
    n = parameter_count("gpt", params, (T,), vocab) - T * C
    return 6 * n + 12 * L * C * T


def gpt_case(name: str, work: str, timeout_s: float, *, smoke: bool, compile_model: bool, steps: int,
             batch: int, precision: str, peak: float | None) -> dict:
    """One ``gpt`` run under FSDP2 on one rank (the GPU, or the CPU with ``smoke``): tokens/s, MFU,
    the plan against the measured peak."""
    from bench._common import generate_tokens, trainer_window

    from trainer_pkg.config import JobConfig
    from trainer_pkg.memory_plan import plan

    params, vocab = (SMOKE_GPT, SMOKE_VOCAB) if smoke else (GPT2_124M, GPT2_VOCAB)
    T = params["context_length"]
    tokens = os.path.join(work, f"tokens-{vocab}")
    if not os.path.exists(os.path.join(tokens, "meta.json")):
        generate_tokens(tokens, train_tokens=int(1.3 * (steps + 2) * batch * (T + 1)) + 10 * (T + 1),
                        val_tokens=8 * (T + 1) + 1, vocab_size=vocab, fill="random")
    out_dir = os.path.join(work, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    cfg = {"data": {"format": "tokens", "uri": tokens, "seq_len": T, "val_windows": 8},
           "model": {"arch": "gpt", "params": params},
           "parallel": {"strategy": "fsdp", "procs_per_node": 1, "dist_backend": "gloo" if smoke else "nccl"},
           "train": {"epochs": 1, "max_steps": steps, "batch_size": batch, "lr": 6e-4, "optimizer": "adamw",
                     "precision": precision, "compile": compile_model, "seed": 0, "stop_check_s": 0,
                     # a record every few steps: the window must not depend on the 1-second cadence
                     "log_every_steps": 1 if smoke else 10},
           "output": {"output_dir": out_dir}}
    os.makedirs(out_dir)
    config = os.path.join(out_dir, "job.json")
    with open(config, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    start = time.perf_counter()
    try:
        proc = subprocess.run(_launch(config), env=_env(smoke), cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    row: dict = {"case": name, "rc": rc, "seconds": round(time.perf_counter() - start, 2), **_summary(out_dir, log)}
    if rc != 0:
        row["log_tail"] = log[-1500:]
        return row
    window = trainer_window(os.path.join(out_dir, "metrics.jsonl"))
    tps = (window["last_step"] - 1) * batch * T / window["loop_s"]
    fpt = flops_per_token(params, vocab)
    row.update(timed_steps=f"2..{window['last_step']}", tokens_per_s=round(tps, 1), flops_per_token=fpt,
               achieved_tflops=round(tps * fpt / 1e12, 3), peak_tflops=peak / 1e12 if peak else None,
               mfu=tps * fpt / peak if peak else None)
    memory = [r["rank_memory"] for r in _records(out_dir) if r.get("rank_memory")]
    planned = plan(JobConfig.from_dict(cfg), input_shape=(T,), num_classes=vocab, world_size=1)
    row["plan_bytes"] = planned.peak_bytes
    if memory:
        measured = memory[-1][0]
        row.update(measured_peak_bytes=measured["peak_bytes"], measured_device=measured.get("device"),
                   plan_over_measured=round(planned.peak_bytes / measured["peak_bytes"], 4),
                   plan_terms={k: getattr(planned, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                                 "activations_bytes", "buffers_bytes",
                                                                 "evaluation_bytes")},
                   measured_terms={k: v for k, v in measured.items() if k.endswith("_bytes")})
        if smoke:  # on the CPU the trainer's peak is its four counts: compare the plan's same four
            four = planned.params_bytes + planned.grads_bytes + planned.optimizer_bytes + planned.activations_bytes
            row["plan_without_buffers_over_measured"] = round(four / measured["peak_bytes"], 4)
    else:
        row["measured_peak_bytes"] = None
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/trainboard-gpu-check")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--timeout-s", type=float, default=120, help="per case (default 120)")
    p.add_argument("--cases", help="comma-separated case names to run (default: all)")
    p.add_argument("--smoke", action="store_true", help="only gpt-smoke, on the CPU (no GPU needed)")
    p.add_argument("--gpt-steps", type=int, default=50, help="gpt cases: optimizer steps, a multiple of 10 (default 50; smoke 6)")
    p.add_argument("--gpt-batch", type=int, default=16, help="gpt cases: windows per step (default 16; smoke 4)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak bf16 TFLOP/s (default: by GPU name)")
    args = p.parse_args()
    import torch

    if args.smoke:
        os.makedirs(args.work, exist_ok=True)
        peak = args.peak_tflops * 1e12 if args.peak_tflops else None
        row = gpt_case("gpt-smoke", args.work, args.timeout_s, smoke=True, compile_model=False,
                       steps=min(args.gpt_steps, 6), batch=min(args.gpt_batch, 4), precision="bf16", peak=peak)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump([row], f, indent=2)
        return 0 if row["rc"] == 0 else 1
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to check (--smoke runs the gpt case on the CPU)")
        return 2
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
          f"bf16 {torch.cuda.is_bf16_supported()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    os.makedirs(args.work, exist_ok=True)
    w = args.work
    rows = []

    wanted = set(args.cases.split(",")) if args.cases else None

    def case(name, nproc, extra, cpu=False):
        if wanted is not None and name not in wanted:
            return None
        row = run_case(name, w, nproc, extra, cpu, args.timeout_s)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    case("cpu-ddp-1", 1, ["--epochs", "2", "--dist-backend", "gloo"], cpu=True)
    if case("cuda-ddp-1", 1, ["--epochs", "2", "--dist-backend", "nccl"]):
        rows[-1]["max_param_diff_vs_cpu"] = max_param_diff(os.path.join(w, "cpu-ddp-1"),
                                                           os.path.join(w, "cuda-ddp-1"))
    if case("cuda-fsdp-1", 1, ["--epochs", "2", "--dist-backend", "nccl", "--strategy", "fsdp"]):
        rows[-1]["max_param_diff_vs_cuda_ddp"] = max_param_diff(os.path.join(w, "cuda-ddp-1"),
                                                                os.path.join(w, "cuda-fsdp-1"))
    case("cuda-ddp-1-bf16", 1, ["--epochs", "2", "--dist-backend", "nccl", "--precision", "bf16"])
    case("cuda-ddp-2-nccl", 2, ["--epochs", "1", "--dist-backend", "nccl", "--timeout-s", "60"])
    case("cuda-ddp-2-gloo", 2, ["--epochs", "2", "--dist-backend", "gloo"])
    case("cuda-pipeline-2-gloo", 2, ["--epochs", "2", "--dist-backend", "gloo", "--strategy", "pipeline",
                                     "--model", "mlp"])
    for name, fn in (("cuda-sigterm", sigterm_case), ("cpu-resume", resume_on_cpu)):
        if wanted is None or name in wanted:
            rows.append(fn(w, args.timeout_s))
            print(json.dumps(rows[-1]), flush=True)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(torch.cuda.get_device_name(0))
    for name, compile_model in (("gpt2-fsdp-bf16", False), ("gpt2-fsdp-bf16-compile", True)):
        if wanted is None or name in wanted:
            rows.append(gpt_case(name, w, max(args.timeout_s, 600), smoke=False, compile_model=compile_model,
                                 steps=args.gpt_steps, batch=args.gpt_batch, precision="bf16", peak=peak))
            print(json.dumps(rows[-1]), flush=True)

    print("\n| case | rc | seconds | val_accuracy | notes |\n|---|---|---|---|---|")
    for r in rows:
        notes = {k: v for k, v in r.items() if k.startswith(("max_param", "seconds_signal", "checkpoints", "tokens_per_s",
                                                             "mfu", "plan_over"))}
        if r["rc"] != 0:
            notes["error"] = next((ln for ln in r.get("log_tail", "").splitlines()[::-1] if "rror" in ln), "")[:200]
        print(f"| {r['case']} | {r['rc']} | {r.get('seconds', '')} | {r.get('val_accuracy')} | {notes} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
