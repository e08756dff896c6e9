"""The streaming ImageFolder loader against the in-memory one, on the same generated images (issue 14,
"Data"): samples/s of each, and the ratio streaming ÷ in-memory, from one run.

    .venv/bin/python bench/streaming_images.py [--images 2000] [--source-size 64] [--image-size 32]
        [--batch-size 32] [--workers 0,2] [--reps 3] [--workdir DIR] [--json FILE]

One process, one torch thread (a trainer rank's setting on this 2-core box). The images are JPEGs
(quality 90) of ``--source-size`` pixels, smooth colour fields plus noise, ``--images`` in 10 classes.

Loaders, each built by the trainer's own ``train.make_shard`` from ``datasets.load_dataset``:

  in-memory    the tree decoded whole at start-up (``x_train[:]``, what the trainer did before streaming)
               into float32, then ``TrainShard`` slices each batch; its start-up decode is timed apart
  stream wN    ``StreamShard``: each batch decoded when asked, by N DataLoader workers (0 = in the
               training process)

Two rates for each, over one epoch (every batch of a shuffled ``DistributedSampler`` order, one rank):

  loader   batches fetched back to back: what the loader alone delivers
  train    a ``cnn`` (registry defaults) forward, backward and SGD step after each batch: what a run
           gets, where workers decode the next batches while the step computes

Each rep runs every loader once, in turn (in-memory first); medians over the reps. Before timing, the
first epoch's batches of every loader are checked equal to the in-memory ones (exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer_pkg.config import JobConfig  # noqa: E402
from trainer_pkg.datasets import load_dataset  # noqa: E402
from trainer_pkg.models import build_model  # noqa: E402
from trainer_pkg.train import make_shard  # noqa: E402

CPU = torch.device("cpu")
ONE_RANK = SimpleNamespace(dp_rank=0, dp_size=1, drop_last_batch=False)


def make_images(root: str, n: int, size: int, classes: int = 10, seed: int = 0) -> None:
    """``n`` JPEGs of ``size``² pixels under ``root/<class>/``: a colour gradient per class plus noise."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, size, dtype=np.float32)
    for i in range(n):
        c = i % classes
        folder = os.path.join(root, f"class{c:02d}")
        os.makedirs(folder, exist_ok=True)
        tint = rng.uniform(0, 255, size=3).astype(np.float32)
        field = ramp[None, :, None] * tint + ramp[:, None, None] * (255 - tint) * (c + 1) / classes
        pixels = np.clip(field + rng.normal(0, 20, size=(size, size, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:06d}.jpg"), quality=90)


def config(root: str, image_size: int, batch_size: int, workers: int) -> JobConfig:
    return JobConfig.from_dict({"data": {"format": "imagefolder", "uri": root, "image_size": image_size,
                                         "val_fraction": 0.1, "num_workers": workers},
                                "train": {"batch_size": batch_size, "seed": 0}})


def build(name: str, root: str, args: argparse.Namespace) -> tuple[object, float]:
    """(the shard, seconds its start-up took: listing, and for in-memory the decode of the tree)."""
    workers = 0 if name == "in-memory" else int(name.removeprefix("stream w"))
    cfg = config(root, args.image_size, args.batch_size, workers)
    tick = time.perf_counter()
    data = load_dataset(cfg.data, seed=0)
    if name == "in-memory":
        data.x_train, data.x_val = data.x_train[:], data.x_val[:]
    shard = make_shard(data, ONE_RANK, cfg)
    return shard, time.perf_counter() - tick


def epoch(shard, index: int, step=None) -> tuple[float, float]:
    """(seconds for one epoch of ``shard``, sum of its inputs); ``step(x, y)`` after each batch."""
    order = shard.epoch_order(index)
    total = 0.0
    tick = time.perf_counter()
    for b in range(shard.batches):
        _, x, y = shard.batch(order, b, CPU)
        if step is not None:
            step(x, y)
        else:
            total += float(x[:, 0, 0, 0].sum())
    return time.perf_counter() - tick, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--source-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", default="0,2", help="DataLoader workers of the streaming runs, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", help="keep the images here (default: a temporary folder, removed)")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    names = ["in-memory"] + [f"stream w{int(w)}" for w in args.workers.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(args.workdir or tmp, "images")
        if not os.path.isdir(root):
            make_images(root, args.images, args.source_size)
        print(f"{args.images} JPEGs {args.source_size}² → {args.image_size}², batch {args.batch_size}, "
              f"1 torch thread, load average {os.getloadavg()[0]:.2f}", flush=True)

        shards, startup = {}, {}
        for name in names:
            shards[name], startup[name] = build(name, root, args)
        reference = [shards["in-memory"].batch(shards["in-memory"].epoch_order(0), b, CPU)[1]
                     for b in range(shards["in-memory"].batches)]
        equal = {}
        for name in names[1:]:
            order = shards[name].epoch_order(0)
            equal[name] = all(torch.equal(shards[name].batch(order, b, CPU)[1], ref) for b, ref in enumerate(reference))
            print(f"{name}: batches equal to in-memory's: {'yes' if equal[name] else 'NO'}", flush=True)

        torch.manual_seed(0)
        sample_shape = tuple(reference[0].shape[1:])
        model = build_model("cnn", {}, sample_shape, 10)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def train_step(x, y):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        samples = len(shards["in-memory"].epoch_order(0))
        rates: dict[str, dict[str, list[float]]] = {n: {"loader": [], "train": []} for n in names}
        for rep in range(args.reps):
            for kind, step in (("loader", None), ("train", train_step)):
                for name in names:
                    seconds, _ = epoch(shards[name], rep + 1, step)
                    rates[name][kind].append(samples / seconds)
                    print(f"rep {rep + 1} {kind:6s} {name:10s} {samples / seconds:9.0f} samples/s", flush=True)

    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rates.items()}
    print(f"\n{'loader':10s} {'start-up s':>10s} {'loader /s':>10s} {'÷ in-mem':>9s} {'train /s':>9s} {'÷ in-mem':>9s}")
    for name in names:
        print(f"{name:10s} {startup[name]:10.2f} {med[name]['loader']:10.0f} "
              f"{med[name]['loader'] / med['in-memory']['loader']:9.3f} {med[name]['train']:9.0f} "
              f"{med[name]['train'] / med['in-memory']['train']:9.3f}")
    held = samples * 3 * args.image_size ** 2 * 4
    print(f"in-memory holds {held / 2**20:.1f} MiB of decoded training images; streaming holds a batch "
          f"({args.batch_size * 3 * args.image_size ** 2 * 4 / 2**20:.2f} MiB) per prefetched batch")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "batches_equal": equal, "startup_s": startup, "samples_per_s": rates, "medians": med}, f, indent=2)


if __name__ == "__main__":
    main()
