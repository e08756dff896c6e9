"""Overhead of the trainer over a hand-written DDP loop, and its peak RSS over the same loop.

    .venv/bin/python bench/overhead.py                 # 4 pairs, 400 steps each (~1 min quiet, ~3 min loaded)
    .venv/bin/python bench/overhead.py --reps 7 --steps 1000     # the quiet-machine run (~2-3 min)

One invocation runs, alternating A B A B ..., ``--reps`` repetitions of

  A  the trainer:  torchrun --standalone --nproc_per_node 2 -m trainer_pkg.launch --config job.json
  B  the baseline: torchrun --standalone --nproc_per_node 2 bench/handwritten_ddp.py ...

on the same synthetic NPZ (``--steps`` × 2 ranks × batch samples, so one epoch is exactly
``--steps`` optimizer steps per rank with no padding), the same model (registry defaults of
``--arch``), batch size, SGD (lr 0.05, momentum 0.9), seed, gloo and one thread per rank.

Timed window, the same steps in both: optimizer steps 2..S, where S is the step of the trainer's last
``step`` record (its default cadence puts one about every second, so S is within a second of
``--steps``). The trainer's window comes from its own metric records (``started`` is written after
step 1 and an all-gather, so all ranks are there; the ``step`` record's time is taken when rank 0
has finished step S); the baseline's from ``perf_counter`` after step 1's barrier to rank 0's end
of step S, in the same pair. Figures are compared per step.
Process start-up, data loading, the trainer's end-of-epoch validation, checkpoint and model.pt are
outside it and are printed separately (end-to-end wall time, and the trainer's ``tail``).

With ``--hardware-every-s S`` the pair is instead the trainer sampled by the launcher's hardware
sampler every S seconds (trainer_pkg/hardware.py) against the same trainer unsampled
(``TRAINBOARD_HARDWARE_EVERY_S=0``), same window; target ratio <= 1.01. Under this torchrun each
rank's launcher samples its own process from a thread (a GPU box's path, where torchrun is the
supervisor's: the costliest place for the sampler, inside the rank)::

    nice .venv/bin/python bench/overhead.py --hardware-every-s 1 --reps 6 --steps 1500

Prints each run's figures, the medians, the ratio trainer/hand-written (target <= 1.03; also the
median of the per-pair ratios and the ratio of each program's fastest run) and each
rank's peak RSS (VmHWM at exit, both measured by bench/_rank_rss.py) minus the baseline's (target
<= +50 MB). The first pair also checks that both produced the same parameters (same model, data,
order and steps). Never asserts: timings on a shared machine are reported, not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import (BENCH, finish_job, fmt_list, job_env, make_npz, median, read_rank_cpu,  # noqa: E402
                           read_rss, run_job, spread, start_job, torchrun, trainer_window, verdict)

OVERHEAD_TARGET = 1.03
SAMPLING_TARGET = 1.01
RSS_TARGET_MB = 50.0
WORLD = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="trainer vs hand-written DDP loop: time and peak RSS ratios")
    p.add_argument("--reps", type=int, default=4, help="A/B pairs (default 4)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per run (default 400)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--arch", default="cnn", choices=["mlp", "cnn", "resnet"], help="registry defaults (default cnn)")
    p.add_argument("--shape", default="1,8,8", help="sample shape C,H,W (default 1,8,8: the digits' shape)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--concurrent", action="store_true",
                   help="run each pair's two programs at the same time on disjoint cores (needs 4 cores; "
                        "both see the same machine at the same moment, so drift in the host's speed cancels)")
    p.add_argument("--workdir", help="keep data, configs, logs and outputs here (default: a temporary folder)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--hardware-every-s", type=float, metavar="S",
                   help="compare the trainer with hardware sampling every S seconds against it unsampled, "
                        f"instead of against the hand-written loop (target <= {SAMPLING_TARGET})")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.steps < 20:
        sys.exit("--steps must be at least 20")
    work = args.workdir or tempfile.mkdtemp(prefix="trainboard-bench-overhead-")
    os.makedirs(work, exist_ok=True)
    shape = tuple(int(s) for s in args.shape.split(","))
    data = os.path.join(work, "data.npz")
    make_npz(data, n_train=args.steps * WORLD * args.batch_size, n_val=64, shape=shape, classes=args.classes)
    print(f"[overhead] {args.reps} A/B pairs; {args.arch} (registry defaults) on {args.steps * WORLD * args.batch_size} "
          f"synthetic samples {shape}; {WORLD} ranks x batch {args.batch_size} x {args.steps} steps; gloo, "
          f"1 thread/rank; timed: steps 2..(the trainer's last step record); work dir {work}", flush=True)

    if args.hardware_every_s:
        _sampling(args, work, data)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    core_sets = _core_sets() if args.concurrent else None
    if args.concurrent:
        print(f"[overhead] concurrent pairs: the two programs run at the same time on disjoint cores "
              f"{core_sets[0]} and {core_sets[1]}, swapped every pair", flush=True)
    trainer_rows, hand_rows = [], []
    for rep in range(args.reps):
        jobs = {kind: _prepare(kind, rep, work, data, args) for kind in ("trainer", "handwritten")}
        if args.concurrent:  # both at once; who gets which cores alternates, so a core set's bias cancels
            cpus = dict(zip(("trainer", "handwritten"), core_sets if rep % 2 == 0 else core_sets[::-1]))
            started = {kind: start_job(job["cmd"], job["env"], job["log"], cpus=cpus[kind])
                       for kind, job in jobs.items()}
            walls = {kind: finish_job(started[kind], timeout_s=600) for kind in jobs}
        else:  # A B A B ...
            walls = {kind: run_job(job["cmd"], job["env"], job["log"], timeout_s=600) for kind, job in jobs.items()}
        # The timed window ends at the trainer's last step record (about once a second, so not at a
        # fixed step); the hand-written loop's is cut at that same step.
        t_dir = jobs["trainer"]["dir"]
        t_row = {"wall_s": walls["trainer"], **trainer_window(os.path.join(t_dir, "out", "metrics.jsonl"))}
        with open(jobs["handwritten"]["out"], encoding="utf-8") as f:
            result = json.load(f)
        if result["steps"] != args.steps:
            raise RuntimeError(f"the hand-written loop took {result['steps']} steps, expected {args.steps}")
        last_step = t_row["last_step"]
        h_row = {"wall_s": walls["handwritten"], "loop_s": result["elapsed_s"][last_step - 1], "last_step": last_step,
                 "loop_to_end_s": result["loop_s"], "self_vmhwm_mb": result["vmhwm_mb"]}
        for kind, row in (("trainer", t_row), ("handwritten", h_row)):
            row["rss_mb"] = read_rss(jobs[kind]["rss"])
            (trainer_rows if kind == "trainer" else hand_rows).append(row)
            print(f"[overhead] pair {rep + 1}/{args.reps} {kind:11s}: loop {row['loop_s']:.3f} s over steps "
                  f"2..{row['last_step']} ({(row['last_step'] - 1) / row['loop_s']:.0f} steps/s), process wall "
                  f"{row['wall_s']:.2f} s, peak RSS "
                  + ", ".join(f"rank {r} {mb:.1f} MB" for r, mb in sorted(row["rss_mb"].items()))
                  + (f", end-of-run tail {row['tail_s']:.3f} s" if kind == "trainer" else "")
                  + (f", cores {cpus[kind]}" if args.concurrent else ""), flush=True)

    same = _same_parameters(os.path.join(work, "00-trainer", "out", "model.pt"),
                            os.path.join(work, "00-handwritten", "model.pt"))
    report = _report(args, trainer_rows, hand_rows, same)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "trainer": trainer_rows, "handwritten": hand_rows, **report}, f,
                      indent=2, default=str)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _prepare(kind: str, rep: int, work: str, data: str, args: argparse.Namespace) -> dict:
    """The command, environment and paths of one run (a fresh run directory)."""
    run_dir = os.path.join(work, f"{rep:02d}-{kind}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a leftover checkpoint would make the trainer resume
    rss_dir = os.path.join(run_dir, "rss")
    os.makedirs(rss_dir)
    job = {"dir": run_dir, "rss": rss_dir, "log": os.path.join(run_dir, "log.txt"), "env": job_env(rss_dir)}
    if kind == "trainer":
        cfg = {"data": {"format": "npz", "uri": data},
               "model": {"arch": args.arch, "params": {}},
               "parallel": {"strategy": "ddp", "procs_per_node": WORLD, "dist_backend": "gloo"},
               "train": {"epochs": 1, "batch_size": args.batch_size, "lr": 0.05, "momentum": 0.9,
                         "optimizer": "sgd", "seed": 0},  # records: the default cadence
               "output": {"output_dir": os.path.join(run_dir, "out")}}
        cfg_path = os.path.join(run_dir, "job.json")
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(cfg, f)
        job["cmd"] = torchrun(WORLD, ["-m", "trainer_pkg.launch", "--config", cfg_path])
    else:
        job["out"] = os.path.join(run_dir, "result.json")
        cmd = [os.path.join(BENCH, "handwritten_ddp.py"), "--data", data, "--arch", args.arch,
               "--batch-size", str(args.batch_size), "--epochs", "1", "--lr", "0.05", "--momentum", "0.9",
               "--seed", "0", "--out", job["out"]]
        if rep == 0:
            cmd += ["--save", os.path.join(run_dir, "model.pt")]
        job["cmd"] = torchrun(WORLD, cmd)
    return job


def _sampling(args: argparse.Namespace, work: str, data: str) -> None:
    """``--hardware-every-s``: pairs of the trainer sampled (A) and unsampled (B), alternating A B
    A B; prints each run's seconds per step over the same window as the main comparison, the
    records the sampler printed, and the ratio sampled/unsampled of the medians."""
    rows: dict[str, list[dict]] = {"sampled": [], "unsampled": []}
    for rep in range(args.reps):
        for kind, every in (("sampled", args.hardware_every_s), ("unsampled", 0.0)):
            job = _prepare("trainer", rep, os.path.join(work, kind), data, args)
            job["env"]["TRAINBOARD_HARDWARE_EVERY_S"] = f"{every:g}"
            wall = run_job(job["cmd"], job["env"], job["log"], timeout_s=600)
            row = {"wall_s": wall, **trainer_window(os.path.join(job["dir"], "out", "metrics.jsonl"))}
            with open(job["log"], encoding="utf-8") as f:
                row["samples"] = sum('"event":"hardware"' in line for line in f)
            cpu = read_rank_cpu(job["rss"])
            row["rank_cpu_s"] = sum(total for total, _ in cpu.values())
            row["sampling_cpu_s"] = sum(sampling for _, sampling in cpu.values())
            rows[kind].append(row)
            print(f"[overhead] pair {rep + 1}/{args.reps} {kind:9s}: loop {row['loop_s']:.3f} s over steps "
                  f"2..{row['last_step']} ({(row['last_step'] - 1) / row['loop_s']:.0f} steps/s), "
                  f"{row['samples']} hardware records, process wall {wall:.2f} s, ranks' CPU "
                  f"{row['rank_cpu_s']:.2f} s of which sampling {row['sampling_cpu_s'] * 1e3:.1f} ms", flush=True)
    per_step = {kind: [r["loop_s"] / (r["last_step"] - 1) * 1e3 for r in rs] for kind, rs in rows.items()}
    ratio = median(per_step["sampled"]) / median(per_step["unsampled"])
    paired = median([a / b for a, b in zip(per_step["sampled"], per_step["unsampled"])])
    print()
    print(f"=== hardware sampling every {args.hardware_every_s:g} s vs none: the trainer, {WORLD} ranks ===")
    for kind, ms in per_step.items():
        print(f"  {kind:9s} ms/step {fmt_list(ms)}  median {median(ms):.3f}  (spread {spread(ms)})")
    print(f"  records printed per sampled run: {fmt_list([float(r['samples']) for r in rows['sampled']], 0)}")
    print(f"  RATIO sampled/unsampled (medians) = {ratio:.4f}   target <= {SAMPLING_TARGET}: "
          f"{verdict(ratio, SAMPLING_TARGET, higher_is_better=False)}")
    print(f"  median of the per-pair ratios      = {paired:.4f}")
    # The sampling's own CPU, measured inside each sampled rank (thread time around every sample): the
    # share of the ranks' CPU it took, a figure the machine's other load does not blur as it blurs the
    # wall-clock ratio above. On a machine whose ranks keep every core busy, the sampling can slow
    # them by at most this share.
    sampled = rows["sampled"]
    share = median([r["sampling_cpu_s"] / max(r["rank_cpu_s"] - r["sampling_cpu_s"], 1e-9) for r in sampled])
    per_sample_ms = median([r["sampling_cpu_s"] * 1e3 / r["samples"] for r in sampled if r["samples"]] or [0.0])
    cpu_ratio = median([r["rank_cpu_s"] for r in sampled]) / median([r["rank_cpu_s"] for r in rows["unsampled"]])
    print(f"  CPU RATIO (ranks' CPU with the sampling's / without it, same runs) = {1 + share:.5f}   "
          f"target <= {SAMPLING_TARGET}: {verdict(1 + share, SAMPLING_TARGET, higher_is_better=False)}  "
          f"({per_sample_ms:.2f} ms of CPU a sample, every {args.hardware_every_s:g} s)")
    print(f"  ranks' CPU sampled/unsampled runs (medians) = {cpu_ratio:.4f}")
    print(f"  cores available to this process: {len(os.sched_getaffinity(0))}; load average before: "
          f"{args.load_before}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), **rows, "ratio_of_medians": ratio, "median_pair_ratio": paired,
                       "cpu_ratio_in_run": 1 + share, "sampling_cpu_ms_per_sample": per_sample_ms,
                       "rank_cpu_ratio_of_medians": cpu_ratio}, f,
                      indent=2, default=str)


def _core_sets() -> tuple[list[int], list[int]]:
    """Two disjoint sets of WORLD cores for the concurrent mode, on distinct physical cores where
    the kernel says which logical CPUs are SMT siblings (a rank sharing a core with a rank of the
    other program would slow both unevenly). Exits when fewer than 2 × WORLD are available."""
    free = sorted(os.sched_getaffinity(0))
    chosen, taken = [], set()
    for cpu in free:  # one logical CPU per physical core first
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", encoding="utf-8") as f:
                siblings = f.read().strip()
        except OSError:
            siblings = str(cpu)
        if siblings not in taken:
            taken.add(siblings)
            chosen.append(cpu)
    chosen += [c for c in free if c not in chosen]
    if len(chosen) < 2 * WORLD:
        sys.exit(f"--concurrent needs {2 * WORLD} cores (two programs x {WORLD} ranks); this process may use "
                 f"{len(free)}")
    # Leave the first core (interrupts, the OS, this driver) alone when there is one to spare.
    base = chosen[1:] if len(chosen) > 2 * WORLD else chosen
    return base[:WORLD], base[WORLD:2 * WORLD]


def _same_parameters(trainer_model: str, hand_model: str) -> float | None:
    """Largest absolute difference between the two runs' final tensors (None if one is missing)."""
    if not (os.path.exists(trainer_model) and os.path.exists(hand_model)):
        return None
    import torch

    a = torch.load(trainer_model, weights_only=True)
    b = torch.load(hand_model, weights_only=True)
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def _report(args, trainer_rows, hand_rows, same) -> dict:
    # Seconds per step over steps 2..S of each pair (S: the trainer's last step record in that pair).
    t_loop = [r["loop_s"] / (r["last_step"] - 1) for r in trainer_rows]
    h_loop = [r["loop_s"] / (r["last_step"] - 1) for r in hand_rows]
    ratio = median(t_loop) / median(h_loop)
    paired = median([t / h for t, h in zip(t_loop, h_loop)])
    best = min(t_loop) / min(h_loop)
    t_wall = [r["wall_s"] for r in trainer_rows]
    h_wall = [r["wall_s"] for r in hand_rows]
    tails = [r["tail_s"] for r in trainer_rows]
    ms = [x * 1e3 for x in t_loop], [x * 1e3 for x in h_loop]
    print()
    print("=== overhead: trainer vs hand-written DDP loop (same invocation, alternating) ===")
    print(f"parameters after training, max |trainer - hand-written|: "
          + ("not compared" if same is None else f"{same:.3g} (same model, data, order and steps)"
             if same <= 1e-5 else f"{same:.3g}  <-- NOT the same run"))
    print(f"milliseconds per step over steps 2..S (S per pair: {sorted(set(r['last_step'] for r in trainer_rows))}):")
    print(f"  trainer      {fmt_list(ms[0])}  median {median(ms[0]):.3f}  (spread {spread(ms[0])})")
    print(f"  hand-written {fmt_list(ms[1])}  median {median(ms[1]):.3f}  (spread {spread(ms[1])})")
    print(f"  difference per step {(median(t_loop) - median(h_loop)) * 1e6:+.0f} us")
    print(f"  RATIO trainer/hand-written (medians) = {ratio:.3f}   target <= {OVERHEAD_TARGET}: "
          f"{verdict(ratio, OVERHEAD_TARGET, higher_is_better=False)}")
    print(f"  median of the per-pair ratios        = {paired:.3f}   ({fmt_list([t / h for t, h in zip(t_loop, h_loop)])})")
    print(f"  ratio of the fastest runs (min/min)  = {best:.3f}   (other load only adds time, so each program's "
          f"fastest run is its closest to an idle machine)")
    print(f"  cores available to this process: {len(os.sched_getaffinity(0))}; load average before: "
          f"{args.load_before}")
    print(f"end-of-run tail of the trainer (validation, epoch record, checkpoint, model.pt): median "
          f"{median(tails):.3f} s {fmt_list(tails)}")
    print(f"process wall time (start-up + data + loop + exit; the trainer also validates and saves):")
    print(f"  trainer {fmt_list(t_wall, 2)} median {median(t_wall):.2f} s; hand-written {fmt_list(h_wall, 2)} "
          f"median {median(h_wall):.2f} s; ratio {median(t_wall) / median(h_wall):.3f} (informational)")
    print("peak RSS per rank (VmHWM at exit), MB:")
    rss = {}
    ranks = sorted(set().union(*(r["rss_mb"] for r in trainer_rows + hand_rows)))
    for rank in ranks:
        t = [r["rss_mb"][rank] for r in trainer_rows if rank in r["rss_mb"]]
        h = [r["rss_mb"][rank] for r in hand_rows if rank in r["rss_mb"]]
        diff = median(t) - median(h)
        rss[rank] = {"trainer_mb": median(t), "handwritten_mb": median(h), "diff_mb": diff}
        print(f"  rank {rank}: trainer {median(t):.1f} {fmt_list(t, 1)}, hand-written {median(h):.1f} "
              f"{fmt_list(h, 1)}  DIFFERENCE {diff:+.1f} MB  target <= +{RSS_TARGET_MB:.0f} MB: "
              f"{verdict(diff, RSS_TARGET_MB, higher_is_better=False)}")
    self_reported = [max(r["self_vmhwm_mb"]) for r in hand_rows]
    print(f"  (hand-written loop's own VmHWM read at the end of its loop, max over ranks: median "
          f"{median(self_reported):.1f} MB)")
    return {"ms_per_step_trainer": median(ms[0]), "ms_per_step_handwritten": median(ms[1]),
            "ratio_of_medians": ratio, "median_pair_ratio": paired, "ratio_of_fastest": best, "max_param_diff": same,
            "trainer_tail_s": median(tails), "rss": rss}


if __name__ == "__main__":
    sys.exit(main())
