"""Memory per rank, measured by the trainer: FSDP2 against DDP, and the memory plan against both.

    .venv/bin/python bench/memory_fsdp.py                       # W = 2 and 4, gpt 4 layers x 128 (~2-4 min)
    .venv/bin/python bench/memory_fsdp.py --worlds 2,4,8 --layers 6 --embed-dim 192

Every run is the real trainer (``torchrun --standalone --nproc_per_node W -m trainer_pkg.launch``) on
the ``gpt`` model (``--layers 4 --heads 4 --embed-dim 128 --context 128``, vocabulary 2,048) and a
generated token dataset, batch ``--batch-size`` windows per rank, AdamW, fp32, gloo on the CPU, a few
optimizer steps (memory does not change after the first). Figures come from the ``rank_memory`` list
of the run's last ``completed`` (or ``epoch``) record (see :mod:`trainer_pkg.memory`): per rank the
bytes of the parameters, gradients and optimizer state it holds, and the peak bytes saved for backward.

1. **FSDP2 ÷ DDP** at each W of ``--worlds``: per rank, (params + grads + optimizer bytes) under FSDP
   over the same under DDP. Goal 1/W ± 5 %: printed as ratio × W (goal 0.95 … 1.05). FSDP pads each
   sharded dimension up to a multiple of W, so sizes that W divides give exactly 1/W.
2. **The plan ÷ the measurement** (:func:`trainer_pkg.memory_plan.plan`, the figure the job form
   shows) for ddp, fsdp, fsdp + activation checkpointing and pipeline (2 stages, ``tied_embeddings``
   off as a pipeline needs) at W = 2. On the CPU the trainer's peak is the sum of its four counts, so
   the plan's same four terms are compared with it (goal within 10 %); the plan's ``buffers`` (the batch,
   FSDP's gathered units, the loss's gradient) are counted on a GPU's ``max_memory_allocated`` only,
   and printed beside. Each term is printed, plan and measured, for the busiest rank.

Memory is deterministic here (the same config gives the same bytes), so each configuration runs
once. Never asserts; prints "meets target" / "MISSES target".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import generate_tokens, job_env, read_records, run_job, torchrun, verdict, write_job  # noqa: E402

SHARD_TOLERANCE = 0.05
PLAN_TOLERANCE = 0.10
TERMS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
STATE_TERMS = TERMS[:3]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="FSDP2 vs DDP bytes per rank, and the memory plan vs the measurement")
    p.add_argument("--worlds", default="2,4", help="world sizes for FSDP vs DDP (default 2,4)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per step (default 8)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    p.add_argument("--workdir", help="keep data, configs, logs and outputs here (default: a temporary folder)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    work = args.workdir or tempfile.mkdtemp(prefix="trainboard-bench-memory-")
    os.makedirs(work, exist_ok=True)
    tokens = os.path.join(work, "tokens")
    shutil.rmtree(tokens, ignore_errors=True)
    need = 2 * (args.steps + 1) * args.batch_size * max(worlds) * (args.context + 1)
    generate_tokens(tokens, train_tokens=max(need, 100_000), val_tokens=20 * (args.context + 1),
                    vocab_size=args.vocab_size, fill="walk")
    print(f"[memory] gpt layers {args.layers} heads {args.heads} embed {args.embed_dim} context {args.context} "
          f"vocab {args.vocab_size}; batch {args.batch_size}/rank; AdamW fp32; gloo CPU; {args.steps} steps; "
          f"work dir {work}", flush=True)

    runs: dict[str, dict] = {}

    def run(name: str, world: int, **parallel) -> dict:
        cfg = _config(args, tokens, os.path.join(work, name), world, **parallel)
        run_dir = os.path.join(work, name)
        run_job(torchrun(world, ["-m", "trainer_pkg.launch", "--config", cfg]), job_env(), os.path.join(run_dir, "log.txt"),
                timeout_s=900)
        with open(cfg, encoding="utf-8") as f:
            job = json.load(f)
        runs[name] = {"world": world, "config": job, "rank_memory": _rank_memory(os.path.join(run_dir, "out"))}
        print(f"[memory] {name}: " + "; ".join(
            f"rank {r}: " + " ".join(f"{t.split('_')[0]} {m[t] / 2**20:.2f}" for t in TERMS) + " MiB"
            for r, m in enumerate(runs[name]["rank_memory"])), flush=True)
        return runs[name]

    for w in worlds:
        run(f"ddp-{w}", w, strategy="ddp")
        run(f"fsdp-{w}", w, strategy="fsdp")
    run("fsdp-ac-2", 2, strategy="fsdp", activation_checkpointing=True)
    run("pipeline-2", 2, strategy="pipeline", pipeline_stages=2)

    report = {"shard_ratio": _shard_report(runs, worlds), "plan": _plan_report(args, runs)}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "runs": runs, **report}, f, indent=2, default=str)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _config(args: argparse.Namespace, tokens: str, run_dir: str, world: int, **parallel) -> str:
    os.makedirs(run_dir, exist_ok=True)
    pipeline = parallel.get("strategy") == "pipeline"
    cfg = {"data": {"format": "tokens", "uri": tokens, "seq_len": args.context, "val_windows": 8},
           "model": {"arch": "gpt", "params": {"layers": args.layers, "heads": args.heads, "embed_dim": args.embed_dim,
                                               "context_length": args.context, "dropout": 0.0, "bias": True,
                                               "tied_embeddings": not pipeline}},
           "parallel": {"procs_per_node": world, "dist_backend": "gloo", **parallel},
           "train": {"epochs": 1, "max_steps": args.steps, "batch_size": args.batch_size, "lr": 1e-3,
                     "optimizer": "adamw", "seed": 0},
           "output": {"output_dir": os.path.join(run_dir, "out")}}
    return write_job(os.path.join(run_dir, "job.json"), cfg)


def _rank_memory(out_dir: str) -> list[dict]:
    """The ``rank_memory`` of the last record that carries it (``completed``, else ``epoch``)."""
    recs = [r for r in read_records(os.path.join(out_dir, "metrics.jsonl")) if r.get("rank_memory")]
    if not recs:
        raise RuntimeError(f"{out_dir}/metrics.jsonl: no record carries rank_memory (the trainer's measured "
                           f"memory per rank)")
    return recs[-1]["rank_memory"]


def _state(m: dict) -> int:
    return sum(int(m[t]) for t in STATE_TERMS)


def _shard_report(runs: dict, worlds: list[int]) -> list[dict]:
    print()
    print("=== FSDP2 / DDP: parameter + gradient + optimizer bytes per rank (goal 1/W +- 5 %) ===")
    print("| W | rank | DDP (MiB) | FSDP (MiB) | FSDP / DDP | x W | verdict |\n|---|---|---|---|---|---|---|")
    out = []
    for w in worlds:
        ddp, fsdp = runs[f"ddp-{w}"]["rank_memory"], runs[f"fsdp-{w}"]["rank_memory"]
        for rank, (a, b) in enumerate(zip(ddp, fsdp)):
            ratio = _state(b) / _state(a)
            ok = abs(ratio * w - 1) <= SHARD_TOLERANCE
            out.append({"world": w, "rank": rank, "ddp_bytes": _state(a), "fsdp_bytes": _state(b), "ratio": ratio,
                        "ratio_times_w": ratio * w, "ok": ok})
            print(f"| {w} | {rank} | {_state(a) / 2**20:.3f} | {_state(b) / 2**20:.3f} | {ratio:.4f} | {ratio * w:.4f} | "
                  f"{'meets target' if ok else 'MISSES target'} |")
    return out


def _plan_report(args: argparse.Namespace, runs: dict) -> list[dict]:
    from trainer_pkg.config import JobConfig
    from trainer_pkg.memory_plan import plan

    print()
    print("=== the plan / the measurement, busiest rank (goal within 10 %) ===")
    print("| config | term | plan (MiB) | measured (MiB) | plan / measured |\n|---|---|---|---|---|")
    out = []
    for name in ("ddp-2", "fsdp-2", "fsdp-ac-2", "pipeline-2"):
        r = runs[name]
        p = plan(JobConfig.from_dict(r["config"]), input_shape=(args.context,), num_classes=args.vocab_size,
                 world_size=r["world"])
        busiest = max(r["rank_memory"], key=lambda m: int(m["peak_bytes"]))
        planned = {t: getattr(p, t) for t in TERMS}
        plan_sum, measured = sum(planned.values()), int(busiest["peak_bytes"])
        for t in TERMS:
            print(f"| {name} | {t.removesuffix('_bytes')} | {planned[t] / 2**20:.3f} | {int(busiest[t]) / 2**20:.3f} | "
                  f"{planned[t] / int(busiest[t]) if int(busiest[t]) else float('nan'):.3f} |")
        ratio = plan_sum / measured
        print(f"| {name} | **sum = peak on CPU** | {plan_sum / 2**20:.3f} | {measured / 2**20:.3f} | **{ratio:.3f}** "
              f"{verdict(abs(ratio - 1), PLAN_TOLERANCE, higher_is_better=False)} |")
        print(f"| {name} | (plan's buffers, GPU only; plan's whole peak) | {p.buffers_bytes / 2**20:.3f}; "
              f"{p.peak_bytes / 2**20:.3f} | – | – |")
        out.append({"config": name, "plan": {**planned, "buffers_bytes": p.buffers_bytes, "peak_bytes": p.peak_bytes},
                    "measured": busiest, "ratio": ratio, "ok": abs(ratio - 1) <= PLAN_TOLERANCE,
                    "plan_lines": list(p.lines)})
    return out


if __name__ == "__main__":
    sys.exit(main())
