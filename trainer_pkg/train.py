"""Trainboard's trainer: ddp, fsdp or pipeline parallel. Every job, on every backend, ends up here.

Run it from the repository root (or anywhere after ``pip install ./trainer_pkg``):

    # one process (CPU → gloo; a GPU → nccl)
    python -m trainer_pkg.train --dataset digits --model cnn --epochs 3 --output-dir out

    # two processes on this machine
    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.train --dataset digits --model cnn \\
        --strategy ddp --epochs 3 --batch-size 32 --lr 0.05 --seed 0 --output-dir out

    # the same with sharded parameters (FSDP2), or the layers split into 2 pipeline stages
    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.train --dataset digits --strategy fsdp --output-dir out
    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.train --dataset digits --model mlp \
        --strategy pipeline --microbatches 4 --pipeline-schedule 1f1b --output-dir out

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
   A pipeline's data-parallel unit is a whole pipeline: its stages read the same shard.
3. Model: built from the registry on every rank with the same seed, then placed by the strategy
   (:mod:`trainer_pkg.parallel`): wrapped in DDP, sharded with FSDP2, or cut into pipeline stages.
   The shape (stages against ranks, micro-batches against the batch size, stages against layers) is
   checked against the ranks the launcher started before any of that, with the arithmetic shown.
4. Resume: if ``<checkpoint_dir>/last.pt`` exists the run continues where it stopped (model,
   optimizer, lr schedule, epoch, position inside the epoch, RNG). Delete it to start over.
5. Loop: each optimizer step takes ``train.grad_accum_steps`` batches (gradients synchronised only on
   the last: DDP ``no_sync``, FSDP ``set_requires_gradient_sync(False)``), under bf16 autocast when
   ``train.precision`` says so, clips the global gradient norm (``train.grad_clip_norm``), steps the
   optimizer and the lr schedule (linear warmup, then constant or cosine: :func:`lr_factor`). Each
   epoch validates on the whole validation set (sharded, then all-reduced) and checkpoints (rank 0
   writes ``last.pt`` atomically, then a barrier).
6. Finish: rank 0 saves the full model's bare state dict to ``<output_dir>/model.pt`` (FSDP shards
   and pipeline stages gathered), so it loads into ``build_model(...)`` under any strategy.

Parameters that get no gradient (an auxiliary head switched off): DDP runs with
``find_unused_parameters=False``; such a model stops at its first step with an error naming the
parameters and the flag to set (``train.find_unused_parameters``). FSDP and pipeline need no flag.
See :mod:`trainer_pkg.parallel`.

Metrics: rank 0 appends one JSON record per line to ``<output_dir>/metrics.jsonl`` and prints it on
stdout (see :mod:`trainer_pkg.metrics`). Values are global: sums and counts all-reduced over ranks
(a pipeline's loss and accuracy come from its last stage). With clipping on, records carry
``grad_norm``: the global gradient norm before clipping, of the step just taken.

Stopping: SIGTERM (spot preemption, cancel) sets a flag; the ranks agree on it with an asynchronous
all-reduce started about every ``train.stop_check_s`` (2 s) of training (every 1-50 steps) and
read when the next one starts, so they all stop at the same step (within about two intervals of the
signal: seconds, well inside a 120 s grace period), rank 0 writes a checkpoint, a ``stopped`` record
is emitted and every rank exits 0. Running the same command again resumes.

A diverged run: every step's training loss is checked for NaN/inf (on CPU one ``.item()``; on a GPU a
device-side flag), the ranks agree on the earliest bad step along with the SIGTERM flag, and again
before each epoch's checkpoint. With ``train.on_nonfinite_loss`` ``stop`` (the default) every rank
fails with ``trainer error: loss became NaN at step N: ...`` after a ``failed`` record carrying that
reason (the launcher also leaves it where the platform shows a failure reason); the last good
checkpoint is kept. ``warn`` logs it once and trains on.

Errors: a bad dataset, config or checkpoint prints one line ``trainer error: ...`` on stderr and exits
1 on every rank (setup failures are agreed over the process group so no rank waits for another).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
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
from torch.utils.data import DistributedSampler

from trainer_pkg.versions import strategy_torch_error
from trainer_pkg.config import ConfigError, JobConfig, shape_errors
from trainer_pkg.datasets import Dataset, describe, load_dataset
from trainer_pkg.metrics import encode_record, exit_process, format_metric_line, report_error
from trainer_pkg.models import build_model
from trainer_pkg.parallel import Strategy, StrategyError, autocast_context, make_strategy

CHECKPOINT_NAME = "last.pt"
CHECKPOINT_VERSION = 2  # 2: optimizer state keyed by parameter name; scheduler and scaler
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


def gpu_placement_error(backend: str, strategy: str, local_world_size: int, gpus: int) -> str | None:
    """Why ``local_world_size`` processes per node cannot run on ``gpus`` CUDA GPUs with ``backend``
    and ``strategy``, or None when they can (ranks take GPU ``local_rank % gpus``).

    Facts seen on an H200 with torch 2.11 and NCCL 2.28.9 (bench/gpu_check.py, bench/RESULTS.md):
    two NCCL ranks on one GPU fail at their first collective with "NCCL error ... invalid usage";
    gloo carries a data-parallel job's CUDA tensors between ranks sharing a GPU, but a pipeline's
    send/recv of CUDA activations over gloo aborts ("writev ... Bad address").
    """
    if gpus < 1:
        return None
    if backend == "nccl" and local_world_size > gpus:
        return (f"{local_world_size} processes per node but this node has {gpus} CUDA GPU(s): NCCL needs one GPU "
                f"per process. Start {gpus} process(es) per node (parallel.procs_per_node), or use "
                "parallel.dist_backend gloo to share GPUs (ddp and fsdp only)")
    if backend == "gloo" and strategy == "pipeline":
        return ("pipeline stages on CUDA GPUs send activations with send/recv, which gloo cannot do for CUDA "
                "tensors: use parallel.dist_backend nccl (or auto) with one GPU per stage")
    return None


def _pick_device(dist_backend: str, topo: Topology, strategy: str = "ddp") -> tuple[torch.device, str]:
    cuda = torch.cuda.is_available()
    backend = ("nccl" if cuda else "gloo") if dist_backend == "auto" else dist_backend
    if backend == "nccl" and not cuda:
        raise TrainerError("parallel.dist_backend is nccl but this machine has no CUDA GPU: use auto or gloo")
    if cuda:
        gpus = torch.cuda.device_count()
        error = gpu_placement_error(backend, strategy, topo.local_world_size, gpus)
        if error:
            raise TrainerError(error)
        torch.cuda.set_device(topo.local_rank % gpus)
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

    def start_agreement(self, device: torch.device, step_seconds: float = 0.0,
                        nonfinite: float = -math.inf) -> "PendingStop":
        """Collective, asynchronous: start agreeing on this rank's flag as it is now, on the
        slowest rank's last step time (seconds) and on the earliest non-finite loss of any rank
        (``nonfinite``: :meth:`NonfiniteLoss.code`); the answer is read with :meth:`PendingStop.result`
        some steps later, so the all-reduce completes in the background instead of stalling a step.
        Every rank issues the same sequence of these and reads each result at the same step, so all
        ranks stop at the same step."""
        values = [1.0 if self.received is not None else 0.0, float(step_seconds), float(nonfinite)]
        if dist.get_world_size() == 1:  # nobody to agree with
            return PendingStop(values, None)
        flag = torch.tensor(values, dtype=torch.float64, device=device)
        return PendingStop(flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))


class PendingStop:
    """An agreement started by :meth:`StopSignal.start_agreement`."""

    def __init__(self, values: torch.Tensor | list[float], work: Any) -> None:
        self.values, self.work = values, work

    def result(self) -> tuple[bool, float, float]:
        """(any rank had been signalled when the agreement started, the slowest rank's step seconds,
        the earliest non-finite loss as a :meth:`NonfiniteLoss.code`)."""
        if self.work is not None:
            self.work.wait()
        stop, step_seconds, nonfinite = self.values.tolist() if isinstance(self.values, torch.Tensor) else self.values
        return stop > 0, step_seconds, nonfinite


class NonfiniteLoss:
    """The first optimizer step whose training loss was NaN or infinite on this rank.

    Ranks agree on it through one float each (:meth:`code`, all-reduced with MAX): ``-(2·step + 1)``
    for an infinite loss, ``-(2·step)`` for NaN, ``-inf`` for none, so the maximum is the earliest
    step (NaN before inf at the same step). :func:`describe_nonfinite` turns the agreed value into the
    run's failure reason.

    On CPU a loss is read with ``.item()`` (under a microsecond); on a GPU that would stall every step
    on the device, so the first bad step is tracked in a device tensor and read only by :meth:`code`,
    at the stop agreements (every 1-50 steps) and at epoch ends.
    """

    def __init__(self, device: torch.device, on_host: bool | None = None) -> None:
        # on_host: read each loss on the host (default: on CPU); False keeps the device-side flag.
        self.on_host = device.type == "cpu" if on_host is None else on_host
        self.first = -math.inf
        if not self.on_host:
            self._first = torch.full((), -math.inf, dtype=torch.float64, device=device)

    def see(self, loss: torch.Tensor, step: int) -> None:
        """Record ``loss`` (a 0-dim tensor) as the loss of optimizer step ``step`` (1-based)."""
        if self.on_host:
            if self.first == -math.inf:
                value = loss.item()
                if not math.isfinite(value):
                    self.first = -(2.0 * step + (1.0 if math.isinf(value) else 0.0))
            return
        # Device ops with Python-number operands only: no host-device copy, no sync.
        code = torch.isinf(loss).to(torch.float64).add_(2.0 * step).neg_()
        bad = ~torch.isfinite(loss) & (self._first == -math.inf)
        self._first = torch.where(bad, code, self._first)

    def code(self) -> float:
        """This rank's first non-finite loss, encoded as above."""
        if not self.on_host and self.first == -math.inf:
            self.first = float(self._first.item())
        return self.first

    def agreed(self, device: torch.device) -> float:
        """Collective, blocking: the earliest non-finite loss over all ranks, as a :meth:`code`."""
        if dist.get_world_size() == 1:
            return self.code()
        value = torch.tensor([self.code()], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())


def describe_nonfinite(code: float) -> str | None:
    """``"loss became NaN at step 12"`` (or ``infinite``) for an agreed :meth:`NonfiniteLoss.code`;
    None for ``-inf`` (every loss was finite)."""
    if code == -math.inf:
        return None
    value = int(-code)
    return f"loss became {'infinite' if value % 2 else 'NaN'} at step {nonfinite_step(code)}"


def nonfinite_step(code: float) -> int:
    """The step an agreed :meth:`NonfiniteLoss.code` (not ``-inf``) names: the first whose loss was
    not finite."""
    return int(-code) // 2


STOP_POLL_MAX_STEPS = 50
"""Most steps between two stop agreements (fast steps): each is a collective the step does not need."""


def stop_poll_interval(step_seconds: float, target_s: float) -> int:
    """Steps until the next stop agreement: about ``target_s`` seconds of training at the slowest
    rank's step time ``step_seconds`` (0 = not measured yet), between 1 and
    :data:`STOP_POLL_MAX_STEPS`; 1 when ``target_s`` is 0.

    A signal is acted on within two intervals (≈ 2 × ``train.stop_check_s``, or two steps when a step
    is slower), far inside a spot reclaim's or SageMaker's 120 s grace period, while a 5 ms step pays
    for one all-reduce every 50 steps instead of one every step.
    """
    if step_seconds <= 0 or target_s <= 0:
        return 1
    return max(1, min(STOP_POLL_MAX_STEPS, int(target_s / step_seconds)))


RECORD_MAX_STEPS = 1000
"""Most steps between two time-based ``step`` records (very fast steps)."""
RECORD_FIRST_STEPS = 10
"""Steps between time-based records until a step time has been agreed (the first two steps)."""


def record_interval(step_seconds: float, target_s: float) -> int:
    """Steps until the next time-based ``step`` record (``train.log_every_steps`` 0): about
    ``target_s`` (``train.log_every_s``) seconds of training at the slowest rank's step time
    ``step_seconds`` (as agreed by the stop agreement, so every rank gets the same number), between 1
    and :data:`RECORD_MAX_STEPS`; :data:`RECORD_FIRST_STEPS` while ``step_seconds`` is 0 (not yet
    measured).

    A record is a collective (an asynchronous all-gather) plus, on rank 0, a JSON line written and
    printed: every 10 steps that is a measurable share of a millisecond step, and a flood of rows for
    the dashboard; about one a second costs neither.
    """
    if step_seconds <= 0:
        return RECORD_FIRST_STEPS
    return max(1, min(RECORD_MAX_STEPS, int(target_s / step_seconds)))


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
        self._file.write(json.dumps(encode_record(record), sort_keys=True, allow_nan=False) + "\n")
        self._file.flush()
        print(format_metric_line(record), flush=True)

    def close(self) -> None:
        if self.enabled:
            self._file.close()


class Window:
    """Training sums since the previous record, on this rank (padded duplicates excluded)."""

    FIELDS = ("loss_sum", "correct", "samples", "seconds", "steps", "step_seconds", "data_seconds",
              "compute_seconds", "trained")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.values = dict.fromkeys(self.FIELDS, 0.0)

    def add(self, **kw: float) -> None:
        for k, v in kw.items():
            self.values[k] += float(v)

    def gather(self, device: torch.device) -> list[dict[str, float]]:
        """Every rank's window, indexed by rank (a collective)."""
        return self.start_gather(device).result()

    def start_gather(self, device: torch.device) -> "PendingGather":
        """Collective, asynchronous: start gathering every rank's window as it is now."""
        mine = torch.tensor([self.values[k] for k in self.FIELDS], dtype=torch.float64, device=device)
        parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        return PendingGather(parts, dist.all_gather(parts, mine, async_op=True))


class PendingGather:
    """A :meth:`Window.start_gather` in flight; :meth:`result` waits for it."""

    def __init__(self, parts: list[torch.Tensor], work: Any) -> None:
        self.parts, self.work = parts, work

    def result(self) -> list[dict[str, float]]:
        """Every rank's window, indexed by rank."""
        if self.work is not None:
            self.work.wait()
        return [dict(zip(Window.FIELDS, p.tolist())) for p in self.parts]


def _window_fields(ranks: list[dict[str, float]]) -> dict[str, Any]:
    """The record fields of one window from every rank's sums (indexed by rank)."""
    samples = sum(r["samples"] for r in ranks)
    if samples == 0:
        return {}
    seconds = max(r["seconds"] for r in ranks)

    def per_step(r: dict[str, float], value: float) -> float:
        return value / r["steps"] if r["steps"] else 0.0

    # Seconds each rank needed before it could join the step's gradient sync (data + its own forward
    # and backward); the slowest sets the pace, and every other rank waits the difference.
    ready = [r["data_seconds"] + r["compute_seconds"] for r in ranks]
    return {
        "train_loss": sum(r["loss_sum"] for r in ranks) / samples,
        "train_accuracy": sum(r["correct"] for r in ranks) / samples,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "rank_samples_per_s": [r["trained"] / r["seconds"] if r["seconds"] > 0 else 0.0 for r in ranks],
        "rank_step_time_s": [per_step(r, r["step_seconds"]) for r in ranks],
        "rank_data_wait_s": [per_step(r, r["data_seconds"]) for r in ranks],
        "rank_compute_s": [per_step(r, r["compute_seconds"]) for r in ranks],
        "rank_sync_wait_s": [per_step(r, max(0.0, r["step_seconds"] - r["compute_seconds"])) for r in ranks],
        "wait_for_slowest_s": sum(max(ready) - x for x in ready),
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


def _temp_path(path: str) -> str:
    """Where :func:`_atomic_torch_save` writes ``path`` before renaming it: ``.<name>.tmp-<pid>``."""
    return os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-{os.getpid()}")


def remove_stale_temp_files(path: str) -> list[str]:
    """Delete the half-written ``.<name>.tmp-<pid>`` files of ``path`` that a killed run left behind
    (a SIGKILL or a lost machine during :func:`_atomic_torch_save` skips its clean-up); returns the
    paths removed.

    Called by rank 0 before the run writes anything: only rank 0 of a run writes these files, so any
    that exist then belong to a run that is gone. A file that cannot be removed is left (it is only
    disk space) rather than failing the run.
    """
    directory, prefix = os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-"
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:  # no directory yet: nothing left over
        return []
    removed = []
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:
            pass
    return removed


def _atomic_torch_save(obj: Any, path: str) -> None:
    """Write ``path`` so a reader sees the old file or the new one, never half of one."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = _temp_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_checkpoint(path: str, *, strategy: Strategy, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, epoch: int, batches_done: int, step: int,
                    cfg: JobConfig, topo: Topology) -> None:
    """Collective: gather the full model and optimizer state and every rank's RNG, rank 0 writes
    ``path`` atomically, then a barrier.

    ``epoch`` is the epoch to run next (``batches_done`` of it already done), ``step`` the optimizer
    steps taken so far. ``model`` is the whole model's bare state dict and ``optimizer`` is keyed by
    parameter name, whatever the strategy (see :mod:`trainer_pkg.parallel`); ``scaler`` is None
    (bf16 needs no loss scaling; the key is kept for an fp16 scaler's state).
    """
    model_state = strategy.full_state_dict()
    optimizer_state = strategy.full_optimizer_state(optimizer)
    rngs: list[Any] = [None] * topo.world_size
    dist.all_gather_object(rngs, _rng_state())
    if topo.is_main:
        _atomic_torch_save(
            {
                "version": CHECKPOINT_VERSION,
                "strategy": strategy.name,
                "model": model_state,
                "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(),
                "scaler": None,
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
        # Before any collective: an image too old for the strategy fails the same way on every rank.
        too_old = strategy_torch_error(cfg.parallel.strategy, torch.__version__, where="this image")
        if too_old:
            raise TrainerError(too_old)
        topo = Topology.from_env()
        device, backend = _pick_device(cfg.parallel.dist_backend, topo, cfg.parallel.strategy)
        if device.type == "cpu":
            _set_cpu_threads(topo)
        _init_process_group(backend, topo, cfg.parallel.timeout_s, device)
        initialized = True
        return _run(cfg, topo, device, backend, stop)
    except (TrainerError, ConfigError, StrategyError) as exc:
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

    # -- setup: data, model, shape checks, checkpoint file (failures agreed across ranks) -------
    error = None
    try:
        _seed_everything(t.seed)
        data: Dataset = load_dataset(cfg.data, seed=t.seed)
        torch.manual_seed(t.seed)  # identical initial weights on every rank (DDP also broadcasts them)
        if t.augment and len(data.input_shape) != 3:
            raise TrainerError(f"train.augment flips images, but this dataset's samples have shape "
                               f"{tuple(data.input_shape)}, not (C, H, W); turn train.augment off")
        shape = shape_errors(cfg, world_size=topo.world_size,
                             world_desc=f"the launcher started {topo.world_size} rank(s)")
        if shape:
            raise TrainerError("; ".join(f"{k}: {v}" for k, v in shape.items()))
        autocast = autocast_context(t.precision, device)
        model = build_model(cfg.model.arch, cfg.model.params, data.input_shape, data.num_classes).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        ckpt = load_checkpoint(ckpt_path, device) if os.path.exists(ckpt_path) else None
        if topo.is_main:
            for path in (ckpt_path, os.path.join(cfg.output.output_dir, "model.pt")):
                for leftover in remove_stale_temp_files(path):
                    _log(topo, f"removed {leftover}, left half-written by an earlier run that was killed")
    except (TrainerError, ConfigError, StrategyError) as exc:
        error = str(exc)
    except OSError as exc:
        error = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
    except Exception as exc:  # still agreed, so the other ranks fail too instead of waiting
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    _agree_setup(error, topo, device)

    # -- the strategy places the model; optimizer, schedule, checkpoint state (collective) --------
    error = None
    try:
        strategy = make_strategy(cfg, model, device)
        optimizer = _make_optimizer(strategy.parameters(), t)
        n_train = len(data.y_train)
        shard = math.ceil(n_train / strategy.dp_size)  # DistributedSampler pads every shard to this
        n_batches = shard // t.batch_size if strategy.drop_last_batch else math.ceil(shard / t.batch_size)
        if n_batches == 0:
            raise TrainerError(f"train.batch_size {t.batch_size} is larger than the {shard} samples each "
                               f"pipeline reads per epoch; use a smaller batch size")
        steps_per_epoch = math.ceil(n_batches / t.grad_accum_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
            lr_factor, schedule=t.lr_schedule, warmup_steps=t.warmup_steps, total_steps=t.epochs * steps_per_epoch))
        if ckpt is not None:
            try:
                strategy.load(ckpt["model"], optimizer, ckpt.get("optimizer"))
                if ckpt.get("scheduler"):
                    scheduler.load_state_dict(ckpt["scheduler"])
                else:  # a checkpoint from before schedules: the lr the schedule gives at its step
                    _set_schedule_step(scheduler, ckpt["step"])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise TrainerError(
                    f"checkpoint {ckpt_path} does not fit this model/optimizer "
                    f"({str(exc).splitlines()[0]}); delete it or set output.checkpoint_dir to start fresh"
                ) from None
    except (TrainerError, ConfigError, StrategyError) as exc:
        error = str(exc)
    except Exception as exc:
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
    _log(topo, f"data {describe(data)}; model {cfg.model.arch} ({n_params:,} parameters); "
               f"{_describe_strategy(strategy, t)}")

    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    x_val, y_val = torch.from_numpy(data.x_val), torch.from_numpy(data.y_val)
    sampler = DistributedSampler(range(n_train), num_replicas=strategy.dp_size, rank=strategy.dp_rank,
                                 shuffle=True, seed=t.seed, drop_last=False)
    metrics = MetricsLog(os.path.join(cfg.output.output_dir, "metrics.jsonl"), topo.is_main, fresh=ckpt is None)
    window = Window()
    grad_norm: float | None = None
    # Training sums since the previous record, kept where they are cheapest and only read in report():
    # the loss sum (float64: the same additions, in the same order, as Python floats) and the correct
    # count on the device, the sample count and the timings as plain Python numbers.
    loss_acc = torch.zeros((), dtype=torch.float64, device=device)
    correct_acc = torch.zeros((), dtype=torch.int64, device=device)
    acc = {"samples": 0, "trained": 0, "steps": 0, "seconds": 0.0, "step_seconds": 0.0, "data_seconds": 0.0,
           "compute_seconds": 0.0}

    # A ``step`` record's all-gather runs in the background and the record is written one step later
    # (with the time and values of its own step): a record costs no rank a wait in the step loop.
    deferred: list[tuple[dict[str, Any], PendingGather, dict[str, Any]]] = []
    # What each rank does, for the per-rank table (a pipeline's stages differ by design).
    layout: dict[str, Any] = {}
    if strategy.name == "pipeline":
        layout = {"rank_pipeline_stage": [r % strategy.num_stages for r in range(topo.world_size)],
                  "rank_stage_layers": [strategy.stage_sizes[r % strategy.num_stages] for r in range(topo.world_size)]}

    def flush_record() -> None:
        """Write the ``step`` record whose gather is in flight, if any (rank 0; collective-free)."""
        while deferred:
            head, gathered, tail = deferred.pop()
            fields = _window_fields(gathered.result())
            metrics.write({**head, **fields, **(layout if fields else {}), **tail})

    def report(event: str, epoch: int, **extra: Any) -> None:
        """Collective: emit one record with the global window since the previous record."""
        flush_record()  # records stay in order
        window.values.update(loss_sum=loss_acc.item(), correct=float(correct_acc.item()),
                             **{k: float(v) for k, v in acc.items()})
        loss_acc.zero_()
        correct_acc.zero_()
        acc.update(samples=0, trained=0, steps=0, seconds=0.0, step_seconds=0.0, data_seconds=0.0,
                   compute_seconds=0.0)
        head = {"event": event, "time": time.time(), "epoch": epoch, "step": step,
                "world_size": topo.world_size, "lr": optimizer.param_groups[0]["lr"]}
        tail = {"grad_norm": grad_norm} if grad_norm is not None else {}
        tail.update(extra)
        gathered = window.start_gather(device)
        window.reset()
        deferred.append((head, gathered, tail))
        if event != "step":
            flush_record()

    nonfinite = NonfiniteLoss(device)
    warned_nonfinite = False

    def check_nonfinite(code: float, epoch: int) -> None:
        """Act on an agreed :meth:`NonfiniteLoss.code` (the same on every rank, so every rank acts
        alike): ``stop`` emits the ``failed`` record and raises; ``warn`` logs once."""
        nonlocal warned_nonfinite
        reason = describe_nonfinite(code)
        if reason is None:
            return
        if t.on_nonfinite_loss == "stop":
            # The ranks agree about every stop_check_s, so the run is some steps past the bad one:
            # the record names it, and the dashboard marks the chart there.
            report("failed", epoch, reason=reason, nonfinite_step=nonfinite_step(code))
            raise TrainerError(f"{reason}: the run diverged (lower train.lr, or clip gradients with "
                               "train.grad_clip_norm); no checkpoint was written after it")
        if not warned_nonfinite:
            warned_nonfinite = True
            _log(topo, f"warning: {reason}; training goes on (train.on_nonfinite_loss is warn)")

    def save(epoch: int, batches_done: int) -> None:
        save_checkpoint(ckpt_path, strategy=strategy, optimizer=optimizer, scheduler=scheduler, epoch=epoch,
                        batches_done=batches_done, step=step, cfg=cfg, topo=topo)

    try:
        # -- the loop: one optimizer step per grad_accum_steps batches -----------------------------
        first_step = step + 1
        # The stop flag is agreed asynchronously every ``poll`` steps (stop_poll_interval: about
        # train.stop_check_s of training apart), each agreement read when the next one starts; every
        # rank computes the same ``poll`` from the agreed slowest step time, so all stop at one step.
        pending: PendingStop | None = None
        poll, next_agreement, last_step_s = 1, step, 0.0
        # ``step`` records: every log_every_steps steps, or (0) about every log_every_s seconds, the
        # interval recomputed from each agreement's slowest step time (the same on every rank).
        record_every, last_record = t.log_every_steps or RECORD_FIRST_STEPS, first_step
        # Only a batch reaching past the sampler's padding point holds padded duplicates (the last one
        # of an epoch): rank r's item k is padding exactly when r + k·W ≥ n (see _real_mask).
        first_padded = max(0, math.ceil((n_train - strategy.dp_rank) / strategy.dp_size))
        # A constant schedule without warmup has factor 1 at every step: its step() only counts.
        constant_lr = t.lr_schedule == "constant" and t.warmup_steps == 0
        for epoch in range(start_epoch, t.epochs):
            sampler.set_epoch(epoch)
            order = torch.tensor(list(iter(sampler)), dtype=torch.long)
            b = skip_batches if epoch == start_epoch else 0
            while b < n_batches:
                if step >= next_agreement:
                    # Read the agreement started ``poll`` steps ago (long finished in the background:
                    # no wait), then start the next one with this rank's last step time.
                    if pending is not None:
                        stopping, slowest_step_s, nonfinite_code = pending.result()
                        pending = None
                        check_nonfinite(nonfinite_code, epoch)
                        if stopping:
                            return _stop(strategy, epoch, b, step, topo, ckpt_path, report, save)
                        poll = stop_poll_interval(slowest_step_s, t.stop_check_s)
                        if not t.log_every_steps:
                            record_every = record_interval(slowest_step_s, t.log_every_s)
                    pending = stop.start_agreement(device, last_step_s, nonfinite.code())
                    next_agreement = step + poll
                tick = time.perf_counter()
                group = range(b, min(b + t.grad_accum_steps, n_batches))
                optimizer.zero_grad(set_to_none=True)
                data_seconds = 0.0
                for bb in group:
                    data_tick = time.perf_counter()
                    start = bb * t.batch_size
                    idx = order[start : start + t.batch_size]
                    xb, yb = x_train[idx].to(device, non_blocking=True), y_train[idx].to(device, non_blocking=True)
                    if t.augment:
                        xb = random_hflip(xb)
                    data_seconds += time.perf_counter() - data_tick
                    # Each batch's mean loss weighs 1/len(group): the step's gradient is the mean over the group.
                    out = strategy.forward_backward(xb, yb, loss_scale=1.0 / len(group), sync=bb == group[-1],
                                                    autocast=autocast)
                    keep = None
                    if start + len(idx) > first_padded:  # padded duplicates: left out of the sums
                        keep = _real_mask(torch.arange(start, start + len(idx)),
                                          strategy.dp_rank, strategy.dp_size, n_train)
                        real = int(keep.sum())
                    else:
                        real = len(idx)
                    acc["trained"] += real  # every stage of a pipeline trains the batch
                    if out is not None:  # (out's tensors are detached: no autograd here)
                        nonfinite.see(out.loss, step + 1)
                        hits = out.logits.argmax(1) == yb
                        if keep is not None:
                            acc["samples"] += real
                            keep = keep.to(device)
                            losses = F.cross_entropy(out.logits.float(), yb, reduction="none")
                            loss_acc.add_(losses[keep].sum())
                            correct_acc.add_(hits[keep].sum())
                        else:
                            acc["samples"] += len(idx)
                            loss_acc.add_(out.loss, alpha=len(idx))
                            correct_acc.add_(hits.sum())
                strategy.finish_gradients()
                if t.grad_clip_norm > 0:
                    grad_norm = strategy.clip_grad_norm_(t.grad_clip_norm)
                optimizer.step()
                if constant_lr:
                    scheduler.last_epoch += 1  # what step() would do, less recomputing the same lr
                    scheduler._step_count += 1
                else:
                    scheduler.step()
                step += 1
                b = group.stop
                seconds = last_step_s = time.perf_counter() - tick
                acc["steps"] += 1
                acc["data_seconds"] += data_seconds
                acc["seconds"] += seconds
                acc["step_seconds"] += seconds - data_seconds
                acc["compute_seconds"] += strategy.take_compute_seconds()
                if deferred:  # the previous step's record: its gather has finished by now
                    flush_record()
                if step == first_step:
                    report("started", epoch, resumed=ckpt is not None)
                elif (step % t.log_every_steps == 0) if t.log_every_steps else step - last_record >= record_every:
                    report("step", epoch)
                    last_record = step

            # Before the epoch's checkpoint: a diverged model never replaces the last good one.
            check_nonfinite(nonfinite.agreed(device), epoch)
            strategy.sync_buffers()
            val_loss, val_acc = strategy.evaluate(x_val, y_val, device, autocast)
            digests: list[Any] = [None] * topo.world_size
            dist.all_gather_object(digests, sample_order_digest(order))
            report("epoch", epoch, val_loss=val_loss, val_accuracy=val_acc, sample_order_digest=digests)
            _log(topo, f"epoch {epoch}: val_loss {val_loss:.4f} val_accuracy {val_acc:.4f}")
            save(epoch + 1, 0)
        if pending is not None:  # the last step's agreement: nothing left to stop
            pending.result()

        # -- finish ------------------------------------------------------------------------------
        strategy.sync_buffers()
        model_path = os.path.join(cfg.output.output_dir, "model.pt")
        state = strategy.full_state_dict()  # collective: the whole model on rank 0
        if topo.is_main:
            _atomic_torch_save(state, model_path)
        dist.barrier()
        report("completed", max(t.epochs - 1, 0))
        _log(topo, f"done: {model_path}")
        return 0
    finally:
        metrics.close()


def _stop(strategy, epoch, batches_done, step, topo, ckpt_path, report, save) -> int:
    """Every rank agreed to stop: checkpoint the exact position, emit ``stopped``, exit cleanly."""
    strategy.sync_buffers()
    save(epoch, batches_done)
    report("stopped", epoch)
    _log(topo, f"stopped by signal at epoch {epoch}, step {step}; checkpoint {ckpt_path}")
    return 0


def _make_optimizer(params: list[torch.nn.Parameter], t: Any) -> torch.optim.Optimizer:
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The multiplier of ``train.lr`` for optimizer step ``step`` (0-based: the lr of the first step
    is ``lr × lr_factor(0)``).

    Warmup: ``(step + 1) / (warmup_steps + 1)`` for the first ``warmup_steps`` steps, so no step has
    lr 0. Then ``constant`` gives 1, ``cosine`` gives ``0.5 × (1 + cos(π × p))`` with
    ``p = (step − warmup_steps) / (total_steps − warmup_steps)``: 1 right after warmup, 0 after
    the last step.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _set_schedule_step(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put ``scheduler`` (and its optimizer's lr) at ``step`` without stepping it that many times."""
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def _describe_strategy(strategy: Any, t: Any) -> str:
    s = strategy.name
    if s == "pipeline":
        s += (f": {strategy.num_stages} stages of {strategy.stage_sizes} layers × {strategy.dp_size} "
              f"replica(s), {strategy.microbatches} micro-batches, each epoch's incomplete last batch skipped")
    if t.grad_accum_steps > 1:
        s += f"; {t.grad_accum_steps} batches per optimizer step"
    if t.precision != "fp32":
        s += f"; {t.precision} autocast"
    return s


# -- command line --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = JobConfig()
    p = argparse.ArgumentParser(
        prog="python -m trainer_pkg.train",
        description="Train a classifier (ddp, fsdp or pipeline parallel). Run under torchrun for several "
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
    g.add_argument("--strategy", choices=["ddp", "fsdp", "pipeline"],
                   help=f"parallelism strategy (config default {d.parallel.strategy})")
    g.add_argument("--pipeline-stages", type=int,
                   help="pipeline: stages per pipeline, dividing the world size (config default 0 = one per rank)")
    g.add_argument("--microbatches", type=int,
                   help=f"pipeline: micro-batches per batch (config default {d.parallel.microbatches})")
    g.add_argument("--pipeline-schedule", choices=["gpipe", "1f1b"],
                   help=f"pipeline schedule (config default {d.parallel.pipeline_schedule})")
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
    g.add_argument("--log-every-steps", type=int,
                   help=f"a step record every N steps; 0 = about every --log-every-s seconds "
                        f"(config default {d.train.log_every_steps})")
    g.add_argument("--log-every-s", type=float,
                   help=f"seconds of training between step records when --log-every-steps is 0 "
                        f"(config default {d.train.log_every_s})")
    g.add_argument("--stop-check-s", type=float,
                   help=f"seconds of training between agreements on a SIGTERM; 0 = every step "
                        f"(config default {d.train.stop_check_s})")
    g.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                   help=f"random horizontal flips of training images (config default {d.train.augment})")
    g.add_argument("--precision", choices=["fp32", "bf16"],
                   help=f"bf16: bfloat16 autocast where the device supports it (config default {d.train.precision})")
    g.add_argument("--grad-accum-steps", type=int,
                   help=f"batches per optimizer step (config default {d.train.grad_accum_steps})")
    g.add_argument("--grad-clip-norm", type=float,
                   help=f"clip the global gradient norm to this; 0 = off (config default {d.train.grad_clip_norm})")
    g.add_argument("--lr-schedule", choices=["constant", "cosine"],
                   help=f"after warmup (config default {d.train.lr_schedule})")
    g.add_argument("--warmup-steps", type=int, help=f"linear warmup steps (config default {d.train.warmup_steps})")
    g.add_argument("--on-nonfinite-loss", choices=["stop", "warn"],
                   help=f"a NaN or infinite training loss: stop the run as failed, or warn and go on "
                        f"(config default {d.train.on_nonfinite_loss})")
    g.add_argument("--find-unused-parameters", action=argparse.BooleanOptionalAction, default=None,
                   help="ddp: allow parameters that get no gradient (config default "
                        f"{d.train.find_unused_parameters})")
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
    put("parallel", "pipeline_stages", args.pipeline_stages)
    put("parallel", "microbatches", args.microbatches)
    put("parallel", "pipeline_schedule", args.pipeline_schedule)
    put("parallel", "dist_backend", args.dist_backend)
    put("parallel", "timeout_s", args.timeout_s)
    for field in ("epochs", "batch_size", "lr", "optimizer", "momentum", "weight_decay", "seed",
                  "log_every_steps", "log_every_s", "stop_check_s", "augment", "precision", "grad_accum_steps",
                  "grad_clip_norm", "lr_schedule", "warmup_steps", "find_unused_parameters", "on_nonfinite_loss"):
        put("train", field, getattr(args, field))
    put("output", "output_dir", args.output_dir)
    put("output", "checkpoint_dir", args.checkpoint_dir)
    if torchrun_env_present():
        # The shape is the launcher's, never a flag's: record it so the shape checks see the real one.
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if local >= 1 and world % local == 0:
            raw["parallel"]["nodes"], raw["parallel"]["procs_per_node"] = world // local, local
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
    exit_process(main())
