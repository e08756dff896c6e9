"""The baseline: a minimal hand-written DDP training loop, what the trainer is measured against.

    OMP_NUM_THREADS=1 PYTHONPATH=. torchrun --standalone --nproc_per_node 2 bench/handwritten_ddp.py \\
        --data bench.npz --arch cnn --batch-size 32 --epochs 1 --out result.json

Same model as the trainer (``trainer_pkg.models.build_model`` with the registry's defaults plus any
``--model-param``), same data (``x_train``/``y_train`` of an NPZ, as the trainer reads float32 NPZ
arrays: unchanged), same init (``torch.manual_seed(seed)`` before building), same sample order
(``DistributedSampler(shuffle=True, seed=seed, drop_last=False)`` sliced into batches), same loss
(mean cross entropy), same optimizer (SGD, momentum 0.9) and step count. gloo, one CPU thread per
rank, no metrics, no validation, no checkpoints.

Timing: optimizer step 1 is warm-up (the trainer's ``started`` record is written after it too);
a process-group barrier, then steps 2..last are timed, then another barrier. Rank 0 writes
``--out`` (JSON): the loop seconds, the steps timed, every rank's VmHWM (peak RSS) read from
``/proc/self/status`` at the end, and the final loss. ``--save`` writes the final state dict so a
caller can check the trainer's ``model.pt`` is the same model.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from trainer_pkg.models import build_model


def vmhwm_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="NPZ with x_train, y_train (and x_val, y_val)")
    p.add_argument("--arch", default="cnn", choices=["mlp", "cnn", "resnet"])
    p.add_argument("--model-param", action="append", default=[], metavar="NAME=JSON")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON result (rank 0)")
    p.add_argument("--save", help="final state dict (rank 0), for an equality check")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    with np.load(args.data) as z:
        x, y = torch.from_numpy(z["x_train"].astype(np.float32)), torch.from_numpy(z["y_train"].astype(np.int64))
        classes = int(max(z["y_train"].max(), z["y_val"].max() if "y_val" in z else -1)) + 1
    params = dict((k, json.loads(v)) for k, v in (s.split("=", 1) for s in args.model_param))

    torch.manual_seed(args.seed)
    model = build_model(args.arch, params, tuple(x.shape[1:]), classes)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    sampler = DistributedSampler(range(len(y)), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    bs = args.batch_size
    n_batches = math.ceil(len(sampler) / bs)

    step, t0, loss = 0, 0.0, torch.zeros(())
    # Rank 0's perf_counter after each step (one list append: ~0.1 us), so a window ending at any step
    # can be compared with the trainer's records, which come about once a second, not at fixed steps.
    after_step: list[float] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.long)
        for b in range(n_batches):
            idx = order[b * bs:(b + 1) * bs]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x[idx]), y[idx])
            loss.backward()
            opt.step()
            step += 1
            if step == 1:
                dist.barrier()
                t0 = time.perf_counter()
            after_step.append(time.perf_counter())
    dist.barrier()
    loop_s = time.perf_counter() - t0

    peaks: list = [None] * world
    dist.all_gather_object(peaks, vmhwm_mb())
    if rank == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"loop_s": loop_s, "steps": step, "steps_timed": step - 1, "world_size": world,
                       "vmhwm_mb": peaks, "final_loss": float(loss),
                       # elapsed_s[k]: seconds from t0 (after step 1's barrier) to the end of step k + 1
                       "elapsed_s": [t - t0 for t in after_step]}, f)
        if args.save:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
