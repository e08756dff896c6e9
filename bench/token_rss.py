"""Peak RSS per rank as a token dataset grows: 100 MB → 1 GB → 10 GB of training tokens.

    .venv/bin/python bench/token_rss.py                         # sparse shards, 2 runs per size (~3-5 min)
    .venv/bin/python bench/token_rss.py --fill random --sizes 100M,1G   # real bytes on disk (1.1 GB written)

Each size is a generated token dataset (:func:`bench._common.generate_tokens`; uint16, shards of at most
``--shard-mb``): ``sparse`` by default (files made by ``truncate``, holes that read as token 0: no disk
blocks, instant at any size; the kernel still pages them in as a real file's pages) or ``random`` (the
bytes written out; needs the disk space, checked first). The same small job trains on each — the real
trainer, ``torchrun --standalone --nproc_per_node 2 -m trainer_pkg.launch`` under :mod:`bench._rank_rss`:
``gpt`` (2 layers × 64, context 128), DDP, gloo, batch 8, ``--steps`` optimizer steps — so the work is
the same and only the dataset's size changes. Sizes alternate (100M, 1G, 10G, 100M, …), ``--reps`` each.

Per rank: the peak RSS (VmHWM at exit), the anonymous and file-backed resident memory at exit, and the
peak ÷ the smallest dataset's (goal 1.00 ± 10 %: memory that does not grow with the data). Loading
the training split whole would need its size in every rank; that is printed beside.

Never asserts; prints "meets target" / "MISSES target". The datasets are deleted at the end unless
``--workdir`` is given (then they are kept, and reused by the next run with the same sizes and fill).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import (fmt_list, generate_tokens, job_env, median, read_rss_detail, run_job, torchrun,  # noqa: E402
                           trainer_window, write_job)

FLAT_TOLERANCE = 0.10
WORLD = 2
UNITS = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """``"100M"`` → 100,000,000 bytes (decimal units K, M, G, T; a bare number is bytes)."""
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="peak RSS per rank as a token dataset grows")
    p.add_argument("--sizes", default="100M,1G,10G", help="training split sizes in bytes (default 100M,1G,10G)")
    p.add_argument("--fill", choices=["sparse", "random"], default="sparse")
    p.add_argument("--shard-mb", type=int, default=1024, help="largest shard, MB (default 1024)")
    p.add_argument("--reps", type=int, default=2, help="runs per size (default 2)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run (default 100)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workdir", help="keep the datasets, configs, logs and outputs here (default: a temporary folder)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    work = args.workdir or tempfile.mkdtemp(prefix="trainboard-bench-token-rss-")
    os.makedirs(work, exist_ok=True)
    if args.fill == "random":
        free = shutil.disk_usage(work).free
        if sum(sizes) > 0.8 * free:
            sys.exit(f"--fill random needs {sum(sizes) / 1e9:.1f} GB in {work}, which has {free / 1e9:.1f} GB free: "
                     f"use --fill sparse or fewer --sizes")
    datasets = {size: _dataset(work, size, args) for size in sizes}
    print(f"[token-rss] sizes {[f'{s / 1e9:g} GB' for s in sizes]} ({args.fill}); {WORLD} ranks, gpt 2x64, context 128, "
          f"batch {args.batch_size}, {args.steps} steps, {args.reps} run(s) per size; work dir {work}", flush=True)

    rows: dict[int, list[dict]] = {s: [] for s in sizes}
    for rep in range(args.reps):
        for size in sizes:
            run_dir = os.path.join(work, f"run-{rep:02d}-{size}")
            shutil.rmtree(run_dir, ignore_errors=True)  # a leftover checkpoint would make the trainer resume
            os.makedirs(os.path.join(run_dir, "rss"))
            cfg = write_job(os.path.join(run_dir, "job.json"), _config(datasets[size], run_dir, args))
            wall = run_job(torchrun(WORLD, ["-m", "trainer_pkg.launch", "--config", cfg]),
                           job_env(os.path.join(run_dir, "rss")), os.path.join(run_dir, "log.txt"), timeout_s=1800)
            window = trainer_window(os.path.join(run_dir, "out", "metrics.jsonl"))
            row = {"wall_s": wall, "rss": read_rss_detail(os.path.join(run_dir, "rss")),
                   "steps_per_s": (window["last_step"] - 1) / window["loop_s"]}
            rows[size].append(row)
            print(f"[token-rss] {size / 1e9:g} GB run {rep + 1}: " + ", ".join(
                f"rank {r} peak {m['peak']:.1f} MB (anon {m['anon']:.1f}, file {m['file']:.1f})"
                for r, m in sorted(row["rss"].items())) + f"; {row['steps_per_s']:.1f} steps/s, wall {wall:.1f} s",
                flush=True)

    report = _report(args, sizes, rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": {str(k): v for k, v in rows.items()}, **report}, f, indent=2)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _dataset(work: str, size: int, args: argparse.Namespace) -> str:
    """The dataset of ``size`` bytes of training tokens (made once per size and fill)."""
    root = os.path.join(work, f"tokens-{args.fill}-{size}")
    meta_path = os.path.join(root, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            generated = json.load(f).get("generated", {})
        if generated.get("train_tokens") == size // 2 and generated.get("fill") == args.fill:
            return root
    shutil.rmtree(root, ignore_errors=True)
    generate_tokens(root, train_tokens=size // 2, val_tokens=200_000, vocab_size=2048, fill=args.fill,
                    shard_tokens=args.shard_mb * 10**6 // 2)
    return root


def _config(tokens: str, run_dir: str, args: argparse.Namespace) -> dict:
    return {"data": {"format": "tokens", "uri": tokens, "seq_len": 128, "val_windows": 32},
            "model": {"arch": "gpt", "params": {"layers": 2, "heads": 2, "embed_dim": 64, "context_length": 128}},
            "parallel": {"strategy": "ddp", "procs_per_node": WORLD, "dist_backend": "gloo"},
            "train": {"epochs": 1, "max_steps": args.steps, "batch_size": args.batch_size, "lr": 1e-3,
                      "optimizer": "adamw", "seed": 0},
            "output": {"output_dir": os.path.join(run_dir, "out")}}


def _report(args: argparse.Namespace, sizes: list[int], rows: dict[int, list[dict]]) -> dict:
    print()
    print(f"=== peak RSS per rank vs the token dataset's size (goal: flat, ratio 1.00 +- {FLAT_TOLERANCE:.0%}) ===")
    print("| training tokens | rank | peak RSS (MB), runs | median | anon / file at exit (MB) | ratio to smallest | "
          "verdict | steps/s |\n|---|---|---|---|---|---|---|---|")
    base = sizes[0]
    out: dict = {"ratios": {}}
    for size in sizes:
        ranks = sorted(rows[size][0]["rss"])
        for rank in ranks:
            peaks = [r["rss"][rank]["peak"] for r in rows[size]]
            first = median([r["rss"][rank]["peak"] for r in rows[base]])
            ratio = median(peaks) / first
            ok = abs(ratio - 1) <= FLAT_TOLERANCE
            out["ratios"][f"{size}/{rank}"] = ratio
            anon = median([r["rss"][rank]["anon"] for r in rows[size]])
            file = median([r["rss"][rank]["file"] for r in rows[size]])
            print(f"| {size / 1e9:g} GB ({size // 2:,} uint16) | {rank} | {fmt_list(peaks, 1)} | {median(peaks):.1f} | "
                  f"{anon:.1f} / {file:.1f} | {ratio:.3f} | {'meets target' if ok else 'MISSES target'} | "
                  f"{median([r['steps_per_s'] for r in rows[size]]):.1f} |")
    print(f"(loading the largest training split whole would take {sizes[-1] / 1e6:,.0f} MB per rank as uint16, "
          f"{sizes[-1] * 4 / 1e6:,.0f} MB as int64; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    out["all_flat"] = all(abs(v - 1) <= FLAT_TOLERANCE for v in out["ratios"].values())
    return out


if __name__ == "__main__":
    sys.exit(main())
