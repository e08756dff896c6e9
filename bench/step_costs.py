"""Where the trainer's per-step overhead goes: the hand-written step plus, one at a time, each piece
of per-step work trainer_pkg/train.py's loop adds, timed in one process group, round-robin.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python -m torch.distributed.run --standalone \\
        --nproc_per_node 2 bench/step_costs.py [--steps 200] [--rounds 5]

Variants (the trainer's own objects where it has them: sampling.real_mask, Window):
  base     zero_grad, DDP forward, mean cross entropy, backward, SGD step (the hand-written step)
  agree    base + a blocking one-int all_reduce every step (the stop agreement the trainer replaced
           with an asynchronous one every stop_check_s)
  metrics  base + the metric block: per-sample cross entropy again, argmax, boolean masks, summed
           on the device (Window.add_batch)
  mask     base + real_mask(arange(...)) for the batch
  sched    base + LambdaLR.step() (constant schedule) and the perf_counter/Window.add_step bookkeeping
  all      every one of the above: the trainer's step
Rank 0 prints each variant's median µs per step over the rounds and its excess over ``base``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_pkg.models import build_model
from trainer_pkg.parallel import BatchResult
from trainer_pkg.sampling import real_mask
from trainer_pkg.train import Window, lr_factor

VARIANTS = ("base", "agree", "metrics", "mask", "sched", "all")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--arch", default="cnn")
    p.add_argument("--shape", default="1,8,8")
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = tuple(int(s) for s in args.shape.split(","))
    bs = args.batch_size
    torch.manual_seed(0)
    n = bs * world * 64
    x, y = torch.randn(n, *shape), torch.randint(0, 10, (n,))
    model = build_model(args.arch, {}, shape, 10)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
        lr_factor, schedule="constant", warmup_steps=0, total_steps=10**6))
    window = Window(torch.device("cpu"))
    order = torch.randperm(n)[rank::world]
    device = torch.device("cpu")

    def run(variant: str, steps: int) -> float:
        agree = variant in ("agree", "all")
        metrics = variant in ("metrics", "all")
        mask = variant in ("mask", "all")
        book = variant in ("sched", "all")
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(steps):
            b = s % (len(order) // bs)
            if agree:
                flag = torch.zeros(1, dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item():
                    break
            tick = time.perf_counter()
            idx = order[b * bs:(b + 1) * bs]
            keep = real_mask(torch.arange(b * bs, b * bs + len(idx)), rank, world, n).to(device) if mask else None
            xb, yb = x[idx], y[idx]
            opt.zero_grad(set_to_none=True)
            logits = ddp(xb)
            F.cross_entropy(logits, yb).backward()
            if metrics:
                if keep is None:
                    keep = torch.ones(len(idx), dtype=torch.bool)
                with torch.no_grad():
                    out = BatchResult(logits=logits.detach(), loss=F.cross_entropy(logits.detach(), yb))
                    window.add_batch(out, yb, keep, int(keep.sum()))
            opt.step()
            if book:
                sched.step()
                window.add_step(time.perf_counter() - tick, 0.0, 0.0)
        dist.barrier()
        return (time.perf_counter() - t0) / steps * 1e6

    for v in VARIANTS:  # warm-up
        run(v, 20)
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            results[v].append(run(v, args.steps))
    if rank == 0:
        base = statistics.median(results["base"])
        print(f"per-step cost, {args.arch} {shape} batch {bs}, {world} ranks, gloo, 1 thread; median of "
              f"{args.rounds} rounds x {args.steps} steps")
        for v in VARIANTS:
            m = statistics.median(results[v])
            print(f"  {v:8s} {m:9.0f} us/step  excess over base {m - base:+7.0f} us ({(m / base - 1) * 100:+5.1f}%)  "
                  f"rounds {[round(t) for t in results[v]]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
