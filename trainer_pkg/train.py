"""Trainboard's data-parallel (DDP) trainer. Every job, on every backend, ends up here.

Run it from the repository root (or anywhere after ``pip install ./trainer_pkg``):

    # one process (CPU → gloo; a GPU → nccl)
    python -m trainer_pkg.train --dataset digits --model cnn --epochs 3 --output-dir out

    # two processes on this machine
    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.train --dataset digits --model cnn \\
        --strategy ddp --epochs 3 --batch-size 32 --lr 0.05 --seed 0 --output-dir out

    # two nodes × 4 processes: run on each node, node 0's address as the rendezvous endpoint
    torchrun --nnodes 2 --nproc_per_node 4 --node_rank $NODE_RANK --rdzv_backend c10d \\
        --rdzv_endpoint $NODE0:29500 --rdzv_id $JOB_ID -m trainer_pkg.train --config job.json

    # what the dashboard runs: the job's frozen JobConfig (see trainer_pkg.launch)
    python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2

What a run does, top to bottom in :func:`train`:

1. Setup: the topology comes from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``),
   never from flags; no such variables means one process. ``LOCAL_RANK`` picks the GPU; without one
   every rank runs on CPU with gloo. The process group's timeout is ``parallel.timeout_s``.
2. Data: every rank loads the same arrays (the validation split is seeded by ``train.seed``) and reads
   its shard of each epoch through a ``DistributedSampler`` (``set_epoch`` reshuffles each epoch).
   The sampler pads the last shard with repeated samples so every rank takes the same number of
   steps; those duplicates train but are left out of every reported metric.
3. Model: built from the registry on every rank with the same seed, wrapped in DDP.
4. Resume: if ``<checkpoint_dir>/last.pt`` exists the run continues where it stopped (model,
   optimizer, epoch, position inside the epoch, RNG). Delete it to start over.
5. Loop: each epoch trains, validates on the whole validation set (sharded, then all-reduced) and
   checkpoints (rank 0 writes ``last.pt`` atomically, then a barrier).
6. Finish: rank 0 saves the bare state dict to ``<output_dir>/model.pt``.

Metrics: rank 0 appends one JSON record per line to ``<output_dir>/metrics.jsonl`` and prints it on
stdout (see :mod:`trainer_pkg.metrics`). Values are global: sums and counts all-reduced over ranks.

Stopping: SIGTERM (spot preemption, cancel) sets a flag; at the next step boundary the ranks agree
(all-reduce) to stop, rank 0 writes a checkpoint, a ``stopped`` record is emitted and every rank
exits 0. Running the same command again resumes.

Errors: a bad dataset, config or checkpoint prints one line ``trainer error: ...`` on stderr and exits
1 on every rank (setup failures are agreed over the process group so no rank waits for another).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
import traceback
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.datasets import Dataset, describe, load_dataset
from trainer_pkg.metrics import format_metric_line, report_error
from trainer_pkg.models import build_model

CHECKPOINT_NAME = "last.pt"
CHECKPOINT_VERSION = 1
EVAL_BATCH_SIZE = 512


class TrainerError(Exception):
    """A failure the user can act on; printed as one ``trainer error:`` line."""


# -- topology ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits in the job, as the launcher (torchrun) set it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Topology":
        env = os.environ if env is None else env
        try:
            world_size = int(env.get("WORLD_SIZE", "1"))
            return cls(
                rank=int(env.get("RANK", "0")),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                world_size=world_size,
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
            )
        except ValueError as exc:
            raise TrainerError(f"bad torchrun environment (RANK/LOCAL_RANK/WORLD_SIZE): {exc}") from None


def torchrun_env_present(env: dict[str, str] | None = None) -> bool:
    """True when this process was started by torchrun (or another launcher setting its variables)."""
    env = os.environ if env is None else env
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _pick_device(dist_backend: str, topo: Topology) -> tuple[torch.device, str]:
    cuda = torch.cuda.is_available()
    backend = ("nccl" if cuda else "gloo") if dist_backend == "auto" else dist_backend
    if backend == "nccl" and not cuda:
        raise TrainerError("parallel.dist_backend is nccl but this machine has no CUDA GPU: use auto or gloo")
    if cuda:
        torch.cuda.set_device(topo.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device()), backend
    return torch.device("cpu"), backend


def _set_cpu_threads(topo: Topology) -> None:
    # Ranks sharing a machine would otherwise each start one thread per core and fight over them.
    if topo.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, topo.local_world_size)))
    elif topo.world_size > 1:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"] or 1)))


def _init_process_group(backend: str, topo: Topology, timeout_s: int, device: torch.device) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if torchrun_env_present():
        dist.init_process_group(**kwargs)  # env:// — MASTER_ADDR/MASTER_PORT from torchrun
    else:
        # One process without a launcher: an in-memory store, so the same code path (DDP,
        # all-reduce) runs without opening a port.
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)


# -- stopping on SIGTERM -------------------------------------------------------------------------


class StopSignal:
    """Remembers a SIGTERM/SIGINT; the loop polls :meth:`agreed` at step boundaries."""

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> "StopSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank has been signalled (a collective: call on all ranks)."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


# -- metrics -------------------------------------------------------------------------------------


class MetricsLog:
    """Rank 0's record sink: ``metrics.jsonl`` plus the same line on stdout; a no-op elsewhere."""

    def __init__(self, path: str, enabled: bool, fresh: bool) -> None:
        self.path = path
        self.enabled = enabled
        if enabled:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._file = open(path, "w" if fresh else "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        print(format_metric_line(record), flush=True)

    def close(self) -> None:
        if self.enabled:
            self._file.close()


class Window:
    """Training sums since the previous record, on this rank (padded duplicates excluded)."""

    FIELDS = ("loss_sum", "correct", "samples", "seconds", "steps", "step_seconds", "data_seconds")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.values = dict.fromkeys(self.FIELDS, 0.0)

    def add(self, **kw: float) -> None:
        for k, v in kw.items():
            self.values[k] += float(v)

    def gather(self, device: torch.device) -> list[dict[str, float]]:
        """Every rank's window, indexed by rank (a collective)."""
        mine = torch.tensor([self.values[k] for k in self.FIELDS], dtype=torch.float64, device=device)
        parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        return [dict(zip(self.FIELDS, p.tolist())) for p in parts]


def _window_fields(ranks: list[dict[str, float]]) -> dict[str, Any]:
    samples = sum(r["samples"] for r in ranks)
    if samples == 0:
        return {}
    seconds = max(r["seconds"] for r in ranks)
    return {
        "train_loss": sum(r["loss_sum"] for r in ranks) / samples,
        "train_accuracy": sum(r["correct"] for r in ranks) / samples,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "rank_samples_per_s": [r["samples"] / r["seconds"] if r["seconds"] > 0 else 0.0 for r in ranks],
        "rank_step_time_s": [r["step_seconds"] / r["steps"] if r["steps"] else 0.0 for r in ranks],
        "rank_data_wait_s": [r["data_seconds"] / r["steps"] if r["steps"] else 0.0 for r in ranks],
    }


# -- data sharding -------------------------------------------------------------------------------


def _real_mask(positions: torch.Tensor, rank: int, world_size: int, n: int) -> torch.Tensor:
    """Which of this rank's sampler positions are real samples rather than padding.

    DistributedSampler (drop_last=False) pads the epoch's index list to a multiple of the world size
    by repeating its head, then gives rank r the items r, r + W, r + 2W, ...; item k of rank r is
    therefore padding exactly when r + k·W ≥ n.
    """
    return rank + positions * world_size < n


def sample_order_digest(order: torch.Tensor) -> str:
    """A short fingerprint (16 hex digits of SHA-256) of one rank's sample indices for an epoch, in
    order: equal digests mean the same samples in the same order (``epoch`` records carry them)."""
    return hashlib.sha256(order.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def random_hflip(x: torch.Tensor) -> torch.Tensor:
    """``train.augment``: each image of the batch (N, C, H, W) mirrored left–right with probability
    1/2, drawn from this rank's torch RNG (seeded per rank, saved in checkpoints)."""
    flip = torch.rand(len(x)) < 0.5
    return torch.where(flip.to(x.device).view(-1, 1, 1, 1), x.flip(-1), x)


@torch.no_grad()
def _evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, topo: Topology,
              device: torch.device) -> tuple[float, float]:
    """(loss, accuracy) over the whole validation set: each rank its shard, then all-reduced."""
    sampler = DistributedSampler(range(len(y)), num_replicas=topo.world_size, rank=topo.rank,
                                 shuffle=False, drop_last=False)
    order = torch.tensor(list(iter(sampler)), dtype=torch.long)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for start in range(0, len(order), EVAL_BATCH_SIZE):
        idx = order[start : start + EVAL_BATCH_SIZE]
        keep = _real_mask(torch.arange(start, start + len(idx)), topo.rank, topo.world_size, len(y)).to(device)
        xb, yb = x[idx].to(device), y[idx].to(device)
        logits = model(xb)
        loss = F.cross_entropy(logits, yb, reduction="none")
        sums[0] += loss[keep].sum().double()
        sums[1] += (logits.argmax(1) == yb)[keep].sum().double()
        sums[2] += keep.sum().double()
    dist.all_reduce(sums)
    model.train()
    count = max(sums[2].item(), 1.0)
    return sums[0].item() / count, sums[1].item() / count


def _sync_buffers(module: torch.nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running stats) to every rank, so evaluation and the
    checkpoint see one model: during training each rank updates them from its own batches."""
    for buf in module.buffers():
        dist.broadcast(buf, src=0)


# -- checkpoints ---------------------------------------------------------------------------------


def strip_module_prefix(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict with DDP's ``module.`` key prefix removed (older checkpoints carry it)."""
    if state_dict and all(k.startswith("module.") for k in state_dict):
        return {k[len("module."):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def _rng_state() -> dict[str, Any]:
    # The numpy state is stored as tensors and ints so the checkpoint loads with weights_only=True.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _atomic_torch_save(obj: Any, path: str) -> None:
    """Write ``path`` so a reader sees the old file or the new one, never half of one."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_checkpoint(path: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                    batches_done: int, step: int, cfg: JobConfig, topo: Topology) -> None:
    """Collective: gather every rank's RNG, rank 0 writes ``path`` atomically, then a barrier.

    ``epoch`` is the epoch to run next (``batches_done`` of it already done), ``step`` the optimizer
    steps taken so far.
    """
    rngs: list[Any] = [None] * topo.world_size
    dist.all_gather_object(rngs, _rng_state())
    if topo.is_main:
        _atomic_torch_save(
            {
                "version": CHECKPOINT_VERSION,
                "model": strip_module_prefix(model.state_dict()),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "batches_done": batches_done,
                "step": step,
                "sampler_epoch": epoch,
                "world_size": topo.world_size,
                "rng": rngs,
                "config": cfg.to_dict(),
            },
            path,
        )
    dist.barrier()


def load_checkpoint(path: str, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A checkpoint written by :func:`save_checkpoint`, tensors mapped onto ``device``; the model's
    state dict has no ``module.`` prefix (files from older trainers that kept it are accepted)."""
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which one and what to do
        raise TrainerError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "delete it to start over"
        ) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise TrainerError(f"checkpoint {path} is not a Trainboard checkpoint; delete it to start over")
    ckpt["model"] = strip_module_prefix(ckpt["model"])
    return ckpt


# -- the run -------------------------------------------------------------------------------------


def train(cfg: JobConfig) -> int:
    """Run the job ``cfg`` in this process as one rank of the current topology; returns the exit code.

    Never raises for a user error: it prints ``trainer error: ...`` on stderr and returns 1.
    """
    stop = StopSignal().install()
    initialized = False
    try:
        cfg.validate()
        topo = Topology.from_env()
        device, backend = _pick_device(cfg.parallel.dist_backend, topo)
        if device.type == "cpu":
            _set_cpu_threads(topo)
        _init_process_group(backend, topo, cfg.parallel.timeout_s, device)
        initialized = True
        return _run(cfg, topo, device, backend, stop)
    except (TrainerError, ConfigError) as exc:
        report_error(f"{exc}")
        return 1
    except Exception as exc:
        traceback.print_exc()
        report_error(f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        if initialized and dist.is_initialized():
            dist.destroy_process_group()


def _log(topo: Topology, msg: str) -> None:
    if topo.is_main:
        print(f"[trainer] {msg}", flush=True)


def _agree_setup(error: str | None, topo: Topology, device: torch.device) -> None:
    """Collective: raise on every rank if setup failed on any, so none waits in a later collective."""
    failed = torch.tensor([topo.rank if error else -1], dtype=torch.int64, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error:
        raise TrainerError(error)
    if failed.item() >= 0:
        raise TrainerError(f"rank {failed.item()} failed during setup (its error is in its log)")


def _run(cfg: JobConfig, topo: Topology, device: torch.device, backend: str, stop: StopSignal) -> int:
    t = cfg.train
    ckpt_path = os.path.join(cfg.output.resolved_checkpoint_dir, CHECKPOINT_NAME)
    _log(topo, f"world size {topo.world_size} ({backend} on {device.type}), "
               f"{torch.get_num_threads()} CPU thread(s) per rank")
    if topo.world_size != cfg.parallel.world_size:
        _log(topo, f"note: the config asks for {cfg.parallel.nodes} node(s) × {cfg.parallel.procs_per_node} "
                   f"process(es) = {cfg.parallel.world_size} rank(s); the launcher started {topo.world_size}")

    # -- setup: data, model, optimizer, checkpoint (failures agreed across ranks) ----------------
    error = None
    try:
        _seed_everything(t.seed)
        data: Dataset = load_dataset(cfg.data, seed=t.seed)
        torch.manual_seed(t.seed)  # identical initial weights on every rank (DDP also broadcasts them)
        if t.augment and len(data.input_shape) != 3:
            raise TrainerError(f"train.augment flips images, but this dataset's samples have shape "
                               f"{tuple(data.input_shape)}, not (C, H, W); turn train.augment off")
        model = build_model(cfg.model.arch, cfg.model.params, data.input_shape, data.num_classes).to(device)
        if t.optimizer == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(
                model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        ckpt = load_checkpoint(ckpt_path, device) if os.path.exists(ckpt_path) else None
        if ckpt is not None:
            try:
                model.load_state_dict(ckpt["model"])
                optimizer.load_state_dict(ckpt["optimizer"])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise TrainerError(
                    f"checkpoint {ckpt_path} does not fit this model/optimizer "
                    f"({str(exc).splitlines()[0]}); delete it or set output.checkpoint_dir to start fresh"
                ) from None
    except (TrainerError, ConfigError) as exc:
        error = str(exc)
    except OSError as exc:
        error = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
    except Exception as exc:  # still agreed, so the other ranks fail too instead of waiting
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    _agree_setup(error, topo, device)

    start_epoch, skip_batches, step = 0, 0, 0
    if ckpt is not None:
        start_epoch, skip_batches, step = ckpt["epoch"], ckpt.get("batches_done", 0), ckpt["step"]
        rngs = ckpt.get("rng") or []
        if ckpt.get("world_size") == topo.world_size and len(rngs) == topo.world_size:
            _set_rng_state(rngs[topo.rank])
        else:
            # A different world size reshards the data: the saved position inside the epoch is void.
            skip_batches = 0
            torch.manual_seed(t.seed + 7919 * topo.rank + 104729 * start_epoch)
        _log(topo, f"resuming from {ckpt_path}: epoch {start_epoch}, batch {skip_batches}, step {step}")
    else:
        torch.manual_seed(t.seed + 7919 * topo.rank)  # per-rank randomness (dropout) after a shared init
    _log(topo, f"data {describe(data)}; model {cfg.model.arch} "
               f"({sum(p.numel() for p in model.parameters()):,} parameters)")

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    x_val, y_val = torch.from_numpy(data.x_val), torch.from_numpy(data.y_val)
    n_train = len(y_train)
    sampler = DistributedSampler(range(n_train), num_replicas=topo.world_size, rank=topo.rank,
                                 shuffle=True, seed=t.seed, drop_last=False)
    metrics = MetricsLog(os.path.join(cfg.output.output_dir, "metrics.jsonl"), topo.is_main, fresh=ckpt is None)
    window = Window()

    def report(event: str, epoch: int, **extra: Any) -> None:
        """Collective: emit one record with the global window since the previous record."""
        fields = _window_fields(window.gather(device))
        window.reset()
        metrics.write({"event": event, "time": time.time(), "epoch": epoch, "step": step,
                       "world_size": topo.world_size, "lr": optimizer.param_groups[0]["lr"],
                       **fields, **extra})

    try:
        # -- the loop ----------------------------------------------------------------------------
        first_step = step + 1
        for epoch in range(start_epoch, t.epochs):
            sampler.set_epoch(epoch)
            order = torch.tensor(list(iter(sampler)), dtype=torch.long)
            n_batches = math.ceil(len(order) / t.batch_size)
            begin = skip_batches if epoch == start_epoch else 0
            for b in range(begin, n_batches):
                if stop.agreed(device):
                    return _stop(cfg, ddp.module, optimizer, epoch, b, step, topo, ckpt_path, report)
                tick = time.perf_counter()
                idx = order[b * t.batch_size : (b + 1) * t.batch_size]
                keep = _real_mask(torch.arange(b * t.batch_size, b * t.batch_size + len(idx)),
                                  topo.rank, topo.world_size, n_train).to(device)
                xb, yb = x_train[idx].to(device, non_blocking=True), y_train[idx].to(device, non_blocking=True)
                if t.augment:
                    xb = random_hflip(xb)
                step_tick = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                logits = ddp(xb)
                losses = F.cross_entropy(logits, yb, reduction="none")
                losses.mean().backward()
                optimizer.step()
                step += 1
                with torch.no_grad():
                    window.add(loss_sum=losses[keep].sum().item(),
                               correct=(logits.argmax(1) == yb)[keep].sum().item(),
                               samples=keep.sum().item(), steps=1,
                               step_seconds=time.perf_counter() - step_tick,
                               data_seconds=step_tick - tick,
                               seconds=time.perf_counter() - tick)
                if step == first_step:
                    report("started", epoch, resumed=ckpt is not None)
                elif step % t.log_every_steps == 0:
                    report("step", epoch)

            _sync_buffers(ddp.module)
            val_loss, val_acc = _evaluate(ddp.module, x_val, y_val, topo, device)
            digests: list[Any] = [None] * topo.world_size
            dist.all_gather_object(digests, sample_order_digest(order))
            report("epoch", epoch, val_loss=val_loss, val_accuracy=val_acc, sample_order_digest=digests)
            _log(topo, f"epoch {epoch}: val_loss {val_loss:.4f} val_accuracy {val_acc:.4f}")
            save_checkpoint(ckpt_path, model=ddp.module, optimizer=optimizer, epoch=epoch + 1, batches_done=0,
                            step=step, cfg=cfg, topo=topo)

        # -- finish ------------------------------------------------------------------------------
        _sync_buffers(ddp.module)
        model_path = os.path.join(cfg.output.output_dir, "model.pt")
        if topo.is_main:
            _atomic_torch_save(strip_module_prefix(ddp.module.state_dict()), model_path)
        dist.barrier()
        report("completed", max(t.epochs - 1, 0))
        _log(topo, f"done: {model_path}")
        return 0
    finally:
        metrics.close()


def _stop(cfg, model, optimizer, epoch, batches_done, step, topo, ckpt_path, report) -> int:
    """Every rank agreed to stop: checkpoint the exact position, emit ``stopped``, exit cleanly."""
    _sync_buffers(model)
    save_checkpoint(ckpt_path, model=model, optimizer=optimizer, epoch=epoch, batches_done=batches_done,
                    step=step, cfg=cfg, topo=topo)
    report("stopped", epoch)
    _log(topo, f"stopped by signal at epoch {epoch}, step {step}; checkpoint {ckpt_path}")
    return 0


# -- command line --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = JobConfig()
    p = argparse.ArgumentParser(
        prog="python -m trainer_pkg.train",
        description="Train a classifier with DistributedDataParallel. Run under torchrun for several "
                    "processes (the topology comes from torchrun's environment); flags mirror the "
                    "JobConfig fields and override --config.",
        epilog="example: torchrun --standalone --nproc_per_node 2 -m trainer_pkg.train --dataset digits "
               "--model cnn --epochs 3 --batch-size 32 --lr 0.05 --seed 0 --output-dir out",
    )
    p.add_argument("--config", metavar="JOB_JSON", help="a JobConfig JSON file to start from")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", metavar="NAME_OR_PATH",
                   help="'digits' (built in) or the path of an ImageFolder tree, .csv or .npz file")
    g.add_argument("--data-format", choices=["builtin", "imagefolder", "csv", "npz"],
                   help="format of --dataset (default: guessed from the path)")
    g.add_argument("--label-column", help=f"CSV label column (config default {d.data.label_column!r})")
    g.add_argument("--val-fraction", type=float, help=f"held-out share (config default {d.data.val_fraction})")
    g.add_argument("--image-size", type=int, help=f"ImageFolder resize (config default {d.data.image_size})")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["mlp", "cnn", "resnet"], help=f"architecture (config default {d.model.arch})")
    g.add_argument("--model-param", action="append", default=[], metavar="NAME=JSON",
                   help="an architecture parameter, e.g. --model-param channels=16 (repeatable)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--strategy", choices=["ddp"], help="parallelism strategy")
    g.add_argument("--dist-backend", choices=["auto", "gloo", "nccl"], help="process-group backend")
    g.add_argument("--timeout-s", type=int, help=f"process-group timeout (config default {d.parallel.timeout_s})")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, help=f"config default {d.train.epochs}")
    g.add_argument("--batch-size", type=int, help=f"per process (config default {d.train.batch_size})")
    g.add_argument("--lr", type=float, help=f"config default {d.train.lr}")
    g.add_argument("--optimizer", choices=["sgd", "adamw"], help=f"config default {d.train.optimizer}")
    g.add_argument("--momentum", type=float, help=f"SGD momentum (config default {d.train.momentum})")
    g.add_argument("--weight-decay", type=float, help=f"config default {d.train.weight_decay}")
    g.add_argument("--seed", type=int, help=f"config default {d.train.seed}")
    g.add_argument("--log-every-steps", type=int, help=f"config default {d.train.log_every_steps}")
    g.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                   help=f"random horizontal flips of training images (config default {d.train.augment})")
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", help=f"model.pt and metrics.jsonl (config default {d.output.output_dir!r})")
    g.add_argument("--checkpoint-dir", help="checkpoints (default <output-dir>/checkpoints)")
    return p


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The JobConfig the flags describe: ``--config`` (if given) with the flags applied on top."""
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as f:
                base = json.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read --config {args.config}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config {args.config} is not valid JSON: {exc}") from None
        cfg = JobConfig.from_dict(base)
    else:
        cfg = JobConfig()
    raw = cfg.to_dict()

    def put(section: str, field: str, value: Any) -> None:
        if value is not None:
            raw[section][field] = value

    if args.dataset is not None:
        fmt = args.data_format or _guess_format(args.dataset)
        put("data", "format", fmt)
        put("data", "name" if fmt == "builtin" else "uri", args.dataset)
    else:
        put("data", "format", args.data_format)
    put("data", "label_column", args.label_column)
    put("data", "val_fraction", args.val_fraction)
    put("data", "image_size", args.image_size)
    if args.model is not None and args.model != raw["model"]["arch"]:
        raw["model"] = {"arch": args.model, "params": {}}  # another arch's params would not fit
    for item in args.model_param:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--model-param {item!r}: expected NAME=VALUE, e.g. channels=16")
        try:
            raw["model"]["params"][name] = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"--model-param {item!r}: the value must be JSON (16, 0.1, true)") from None
    put("parallel", "strategy", args.strategy)
    put("parallel", "dist_backend", args.dist_backend)
    put("parallel", "timeout_s", args.timeout_s)
    for field in ("epochs", "batch_size", "lr", "optimizer", "momentum", "weight_decay", "seed",
                  "log_every_steps", "augment"):
        put("train", field, getattr(args, field))
    put("output", "output_dir", args.output_dir)
    put("output", "checkpoint_dir", args.checkpoint_dir)
    return JobConfig.from_dict(raw).validate()


def _guess_format(dataset: str) -> str:
    if dataset == "digits":
        return "builtin"
    lower = dataset.lower()
    if lower.endswith(".csv"):
        return "csv"
    if lower.endswith(".npz"):
        return "npz"
    return "imagefolder"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        report_error(f"{exc}")
        return 2
    return train(cfg)


if __name__ == "__main__":
    sys.exit(main())
