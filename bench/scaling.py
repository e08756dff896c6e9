"""Data-parallel scaling of the trainer: samples/s at 2 ranks over 2 × samples/s at 1 rank.

    .venv/bin/python bench/scaling.py                  # 4 pairs, resnet on 3×32×32, 30 steps (~2-3 min)
    .venv/bin/python bench/scaling.py --reps 6 --steps 50

One invocation alternates, ``--reps`` times, the trainer at 1 rank and at 2 ranks

    torchrun --standalone --nproc_per_node {1,2} -m trainer_pkg.launch --config job.json

on a compute-bound job: ``--arch`` (default resnet, registry defaults: ~78k parameters, ~0.3 MB of
gradients to all-reduce per step) on synthetic 3×32×32 images, batch 32 per rank, 1 CPU thread per
rank, gloo. Weak scaling: each rank takes ``--steps`` steps of the same per-rank batch in both runs
(the 2-rank run's data set is twice as large), so the two windows do the same per-rank work.

samples/s = (steps − 1) × batch × ranks / (time of the ``step`` record at the last step − time of the
``started`` record), from the trainer's own metrics. Prints every run, the medians and
ratio = median samples/s at 2 ranks / (2 × median samples/s at 1 rank), target ≥ 0.85.

2 ranks × 1 thread need 2 free cores: on a 2-core machine anything else running lands on one of
the ranks and the whole job waits for it at every all-reduce, so the ratio measures the machine's
quiet as much as the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import fmt_list, job_env, make_npz, median, run_job, spread, torchrun, trainer_window, verdict  # noqa: E402

SCALING_TARGET = 0.85


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="trainer: samples/s at 2 ranks over 2 x samples/s at 1 rank")
    p.add_argument("--reps", type=int, default=4, help="1-rank/2-rank pairs (default 4)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per rank, a multiple of 10 (default 30)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    p.add_argument("--arch", default="resnet", choices=["mlp", "cnn", "resnet"])
    p.add_argument("--params", default="{}", help='model params as JSON, e.g. \'{"width": 32}\' (default: registry defaults)')
    p.add_argument("--shape", default="3,32,32", help="sample shape (default 3,32,32)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--workdir", help="keep data, configs, logs and outputs here (default: a temporary folder)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.steps % 10 or args.steps < 20:
        sys.exit("--steps must be a multiple of 10 and at least 20 (the trainer logs every 10 steps)")
    work = args.workdir or tempfile.mkdtemp(prefix="trainboard-bench-scaling-")
    os.makedirs(work, exist_ok=True)
    shape = tuple(int(s) for s in args.shape.split(","))
    params = json.loads(args.params)
    data = {}
    for world in (1, 2):
        data[world] = os.path.join(work, f"data-{world}.npz")
        make_npz(data[world], n_train=args.steps * world * args.batch_size, n_val=32, shape=shape,
                 classes=args.classes, seed=world)
    print(f"[scaling] {args.reps} pairs of 1 rank / 2 ranks; {args.arch} {params or '(registry defaults)'} on "
          f"synthetic {shape}; batch {args.batch_size} per rank x {args.steps} steps per rank; gloo, 1 thread/rank; "
          f"timed: steps 2..{args.steps}; work dir {work}", flush=True)

    sps: dict[int, list[float]] = {1: [], 2: []}
    for rep in range(args.reps):
        for world in ((1, 2) if rep % 2 == 0 else (2, 1)):  # 1 2 2 1 1 2 ...: drift hits both alike
            run_dir = os.path.join(work, f"{rep:02d}-{world}rank")
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            cfg = {"data": {"format": "npz", "uri": data[world]},
                   "model": {"arch": args.arch, "params": params},
                   "parallel": {"strategy": "ddp", "procs_per_node": world, "dist_backend": "gloo"},
                   "train": {"epochs": 1, "batch_size": args.batch_size, "lr": 0.05, "seed": 0, "log_every_steps": 10},
                   "output": {"output_dir": os.path.join(run_dir, "out")}}
            cfg_path = os.path.join(run_dir, "job.json")
            with open(cfg_path, "w", encoding="utf-8") as f:
                json.dump(cfg, f)
            wall = run_job(torchrun(world, ["-m", "trainer_pkg.launch", "--config", cfg_path]), job_env(None),
                           os.path.join(run_dir, "log.txt"), timeout_s=600)
            window = trainer_window(os.path.join(run_dir, "out", "metrics.jsonl"), args.steps)
            rate = (args.steps - 1) * args.batch_size * world / window["loop_s"]
            sps[world].append(rate)
            print(f"[scaling] pair {rep + 1}/{args.reps} {world} rank(s): {rate:8.1f} samples/s "
                  f"(loop {window['loop_s']:.3f} s, process wall {wall:.2f} s)", flush=True)

    one, two = median(sps[1]), median(sps[2])
    ratio = two / (2 * one)
    paired = median([b / (2 * a) for a, b in zip(sps[1], sps[2])])
    best = max(sps[2]) / (2 * max(sps[1]))
    print()
    print("=== scaling: trainer, ddp, 2 ranks vs 1 rank (same invocation, alternating) ===")
    print(f"  1 rank : {fmt_list(sps[1], 1)} samples/s, median {one:.1f} (spread {spread(sps[1])})")
    print(f"  2 ranks: {fmt_list(sps[2], 1)} samples/s, median {two:.1f} (spread {spread(sps[2])})")
    print(f"  RATIO samples/s(2) / (2 x samples/s(1)) = {ratio:.3f}   target >= {SCALING_TARGET}: "
          f"{verdict(ratio, SCALING_TARGET, higher_is_better=True)}")
    print(f"  median of the per-pair ratios          = {paired:.3f}")
    print(f"  ratio of the fastest runs (max/max)    = {best:.3f}   (other load only slows a run down)")
    print(f"  cores available to this process: {len(os.sched_getaffinity(0))} (2 ranks x 1 thread need 2 idle ones)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "samples_per_s": sps, "ratio_of_medians": ratio,
                       "median_pair_ratio": paired, "ratio_of_fastest": best}, f, indent=2)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
