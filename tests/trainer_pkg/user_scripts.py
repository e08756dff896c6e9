"""Users' training scripts, written into a test's tmp_path as a user's code archive would unpack.

Each script writes what it saw (torchrun's and Trainboard's variables, its working directory,
``sys.path[0]`` and its argv) to ``<--env-out>/rank<RANK>.json``, so a test asserts every rank's
environment after the run.
"""

from __future__ import annotations

import json
from pathlib import Path

SEEN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TRAINBOARD_MODEL_DIR", "TRAINBOARD_CHECKPOINT_DIR", "TRAINBOARD_DATA_DIR", "TRAINBOARD_CODE_DIR",
             "TRAINBOARD_LAUNCH_PLATFORM")

_RECORD_ENV = f'''
import json, os, sys

def record_env(out_dir, argv):
    seen = {{name: os.environ.get(name) for name in {SEEN_VARS!r}}}
    seen.update(cwd=os.getcwd(), sys_path0=sys.path[0], argv=argv)
    with open(os.path.join(out_dir, "rank%s.json" % os.environ["RANK"]), "w") as f:
        json.dump(seen, f)
'''

ENV_SCRIPT = _RECORD_ENV + '''
import argparse
p = argparse.ArgumentParser()
p.add_argument("--env-out", required=True)
args, rest = p.parse_known_args()
record_env(args.env_out, sys.argv[1:])
'''
"""Records its environment and exits 0: no torch, nothing printed."""

DDP_SCRIPT = _RECORD_ENV + '''
import argparse

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer_pkg import report

p = argparse.ArgumentParser(description="a user's own DDP training script")
p.add_argument("--lr", type=float, required=True)
p.add_argument("--steps", type=int, required=True)
p.add_argument("--env-out", required=True)
p.add_argument("--note", default="")
args = p.parse_args()
record_env(args.env_out, sys.argv[1:])

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data = np.load(report.data_dir())
x, y = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"]).long()
x, y = x[rank::world], y[rank::world]
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(x.shape[1], 4))
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
for step in range(1, args.steps + 1):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    report.log(step=step, my_loss=mean / world, **{"tokens/s": float(len(x) * world)})
if rank == 0:
    torch.save(model.module.state_dict(), os.path.join(report.model_dir(), "model.pt"))
    torch.save({"step": args.steps}, os.path.join(report.checkpoint_dir(), "last.pt"))
dist.barrier()
dist.destroy_process_group()
report.finish()
'''
"""Trains a linear classifier on the job's NPZ with DDP (gloo), reports ``my_loss`` (a 0-d tensor)
and ``tokens/s`` every step, saves model.pt and a checkpoint from rank 0, and ends with
``report.finish()``: left to the interpreter's teardown, torch 2.13 aborted a rank after its
successful run ("terminate called without an active exception", SIGABRT) in 3 of the last CI runs'
DDP script tests (docs/user-code.md)."""


def write_code(root: Path, script: str, name: str = "train.py") -> Path:
    """``root`` as an unpacked code archive holding ``script`` at ``name`` (a path under ``root``;
    packages on the way get an ``__init__.py``); returns ``root``."""
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in path.relative_to(root).parents:
        if parent != Path("."):
            (root / parent / "__init__.py").touch()
    path.write_text(script)
    return root


def seen_env(env_out: Path) -> dict[int, dict]:
    """{rank: what that rank recorded} from ``env_out``."""
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(env_out.glob("rank*.json"))}
