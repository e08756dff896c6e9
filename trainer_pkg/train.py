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

    # a GPT language model on a token dataset (a directory with meta.json), 200 optimizer steps
    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.train --dataset tokens/ --model gpt \
        --model-param layers=6 --seq-len 256 --optimizer adamw --lr 3e-4 --max-steps 200 --output-dir out

    # two nodes × 4 processes: run on each node, node 0's address as the rendezvous endpoint
    torchrun --nnodes 2 --nproc_per_node 4 --node_rank $NODE_RANK --rdzv_backend c10d \\
        --rdzv_endpoint $NODE0:29500 --rdzv_id $JOB_ID -m trainer_pkg.train --config job.json

    # what the dashboard runs: the job's frozen JobConfig (see trainer_pkg.launch)
    python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2

The flags are the JobConfig's fields (``--batch-size`` is ``train.batch_size``; ``--help`` prints each
field's documentation from :mod:`trainer_pkg.config`) and override ``--config``; the shape (nodes ×
processes) is the launcher's, never a flag's.

What a run does, top to bottom in :func:`train`:

1. Setup: the topology comes from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``),
   never from flags; no such variables means one process. ``LOCAL_RANK`` picks the GPU; without one
   every rank runs on CPU with gloo. The process group's timeout is ``parallel.timeout_s``.
2. Data: every rank opens the same dataset (the validation split is seeded by ``train.seed``) and reads
   its shard of each epoch through a ``DistributedSampler`` (``set_epoch`` reshuffles each epoch);
   ImageFolder, CSV and uncompressed NPZ inputs are read per batch, in DataLoader workers with
   ``data.num_workers`` (:mod:`trainer_pkg.streaming`), in the same order as arrays held in memory.
   The sampler pads the last shard with repeated samples so every rank takes the same number of
   steps; those duplicates train but are left out of every reported metric.
   A pipeline's data-parallel unit is a whole pipeline: its stages read the same shard.
   A ``tokens`` dataset is only memory-mapped: each rank draws its (seq_len + 1)-token windows per
   batch from (seed, epoch, rank, batch) (:mod:`trainer_pkg.token_shard`), and validates on
   ``data.val_windows`` fixed windows; a language model's loss is the mean over every token.
3. Model: built from the registry on every rank with the same seed, then placed by the strategy
   (:mod:`trainer_pkg.parallel`): wrapped in DDP, sharded with FSDP2, or cut into pipeline stages.
   A custom model (``model.arch`` ``custom``) is the user's: ``code.dir`` goes first on ``sys.path``,
   ``model.entry_point`` (``package.module:function``) is called as
   ``function(num_classes=N, input_shape=(C, ...), **model.params)``, and one forward on a real
   batch checks that it returns (B, N) logits before any wrapper (:mod:`trainer_pkg.user_model`).
   FSDP shards the submodules whose class is in ``model.shard_classes`` (default: each top-level
   child); a pipeline splits an ``nn.Sequential``'s children or the model's ``layers()``.
   The shape (stages against ranks, micro-batches against the batch size, stages against layers) is
   checked against the ranks the launcher started before any of that, with the arithmetic shown.
4. Resume: if ``<checkpoint_dir>/last.pt`` exists the run continues where it stopped (model,
   optimizer, lr schedule, epoch, position inside the epoch, RNG). Delete it to start over. With
   ``output.checkpoint_format`` sharded the same lives in ``<checkpoint_dir>/checkpoint/``
   (``torch.distributed.checkpoint``, every rank its own shards: :mod:`trainer_pkg.sharded_checkpoint`).
5. Loop: each optimizer step takes ``train.grad_accum_steps`` batches (gradients synchronised only on
   the last: DDP ``no_sync``, FSDP ``set_requires_gradient_sync(False)``), under bf16 autocast when
   ``train.precision`` says so, clips the global gradient norm (``train.grad_clip_norm``), steps the
   optimizer and the lr schedule (linear warmup, then constant or cosine: :func:`lr_factor`);
   ``train.max_steps`` ends the loop after that many steps, inside an epoch or not. Each
   epoch validates on the whole validation set (sharded, then all-reduced) and checkpoints (rank 0
   writes ``last.pt`` atomically, then a barrier).
6. Finish: rank 0 saves the full model's bare state dict to ``<output_dir>/model.pt`` (FSDP shards
   and pipeline stages gathered), so it loads into ``build_model(...)`` under any strategy.

Parameters that get no gradient (an auxiliary head switched off): DDP runs with
``find_unused_parameters=False``; such a model stops at its first step with an error naming the
parameters and the flag to set (``train.find_unused_parameters``). FSDP and pipeline need no flag.
See :mod:`trainer_pkg.parallel`.

Large models (docs/large-models.md): FSDP2's bf16 mixed precision policy, activation checkpointing
per unit, CPU offload and ``torch.compile`` are applied by :func:`trainer_pkg.parallel.make_strategy`;
``epoch`` and ``completed`` records carry each rank's measured memory, ``rank_memory``
(:mod:`trainer_pkg.memory`).

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
An exception in a custom model's code (importing it, calling its entry point, its first forward)
first prints the user's traceback, only the frames in their files, and its last line ends the
``trainer error: rank N: model.entry_point ...`` line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import io
import json
import math
import os
import random
import re
import signal
import time
import traceback
import typing
from typing import Any, Iterator, Literal, Sequence, get_args, get_origin

import numpy as np
import torch
import torch.distributed as dist

from trainer_pkg import objstore, sharded_checkpoint, world_shape
from trainer_pkg.config import ConfigError, JobConfig, TrainConfig, field_docs
from trainer_pkg.datasets import Dataset, Samples, TokenData, WebDataset, describe, load_dataset, token_data
from trainer_pkg.memory import SavedActivations, gather_rank_memory, rank_memory
from trainer_pkg.metrics import encode_record, exit_process, format_metric_line, print_line, report_error
from trainer_pkg.models import build_model
from trainer_pkg.parallel import Strategy, StrategyError, autocast_context, correct, cross_entropy, make_strategy
from trainer_pkg.platforms import cpu_threads_per_rank
from trainer_pkg.registry import CUSTOM, check_input_shape, seq_len_for
from trainer_pkg.sampling import ShardOrder
from trainer_pkg.streaming import SampleView, StreamShard
from trainer_pkg.token_shard import TokenShard, validation_windows
from trainer_pkg.web_shard import WebShard
from trainer_pkg.tokens import TokenDataset
from trainer_pkg.user_model import UserCodeError, check_first_batch
from trainer_pkg.versions import strategy_torch_error

CHECKPOINT_NAME = "last.pt"
CHECKPOINT_VERSION = 2  # 2: optimizer state keyed by parameter name; scheduler and scaler


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
    # A rank the launcher started has OMP_NUM_THREADS (the same count); one torchrun started by hand may not.
    if topo.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads_per_rank(topo.local_world_size))
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


@contextlib.contextmanager
def process_group(backend: str, topo: Topology, timeout_s: int, device: torch.device) -> Iterator[None]:
    """The job's process group (``backend``, ``timeout_s`` seconds per collective) for the body,
    destroyed on every way out of it."""
    _init_process_group(backend, topo, timeout_s, device)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- stopping on SIGTERM -------------------------------------------------------------------------


class StopSignal:
    """Remembers a SIGTERM/SIGINT; the ranks agree on it with :meth:`start_agreement`.

    The handlers stay installed after :func:`train` returns: a SIGTERM that lands after the last
    checkpoint, while the launcher copies the outputs, must not turn a finished run into a killed one.
    """

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> "StopSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

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
    """Rank 0's record sink: ``metrics.jsonl`` plus the same line on stdout; a no-op elsewhere. A
    context manager: the file is closed however the run ends."""

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
        print_line(format_metric_line(record))

    def close(self) -> None:
        if self.enabled:
            self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class Window:
    """Training sums since the previous record, on this rank (padded duplicates excluded).

    Kept where they are cheapest and read only by :meth:`start_gather`: the loss sum (float64: the
    same additions, in the same order, as Python floats) and the correct count on the device, the
    sample counts and the timings (seconds) as Python numbers.
    """

    FIELDS = ("loss_sum", "correct", "samples", "seconds", "steps", "step_seconds", "data_seconds",
              "compute_seconds", "trained")
    _HOST = ("samples", "trained", "steps", "seconds", "step_seconds", "data_seconds", "compute_seconds")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.float64, device=device)  # a language model's: shares of tokens
        self.host: dict[str, float] = dict.fromkeys(self._HOST, 0)

    def add_batch(self, out: Any, y: torch.Tensor, keep: torch.Tensor | None, real: int) -> None:
        """One batch of labels ``y`` (B,) (a language model's next tokens (B, T)) trained on this
        rank, ``real`` of them not padding (``keep``, a (B,) bool mask, marks which; None when all
        are). ``out`` is ``forward_backward``'s detached loss and logits (B, classes) or (B, T, V),
        None on a pipeline stage without the loss."""
        self.host["trained"] += real  # every stage of a pipeline trains the batch
        if out is None:
            return
        hits = correct(out.logits, y)
        self.host["samples"] += real
        if keep is not None:
            keep = keep.to(self.device)
            losses = cross_entropy(out.logits, y, reduction="none")
            self.loss_sum.add_(losses[keep].sum())
            self.correct.add_(hits[keep].sum())
        else:
            self.loss_sum.add_(out.loss, alpha=len(y))
            self.correct.add_(hits.sum())

    def add_step(self, seconds: float, data_seconds: float, compute_seconds: float) -> None:
        """One optimizer step that took ``seconds``, ``data_seconds`` of them fetching batches and
        ``compute_seconds`` in this rank's own forward and backward passes."""
        h = self.host
        h["steps"] += 1
        h["data_seconds"] += data_seconds
        h["seconds"] += seconds
        h["step_seconds"] += seconds - data_seconds
        h["compute_seconds"] += compute_seconds

    def start_gather(self) -> "PendingGather":
        """Collective, asynchronous: start gathering every rank's window as it is now, and start a
        new, empty one."""
        values = {"loss_sum": self.loss_sum.item(), "correct": float(self.correct.item()),
                  **{k: float(v) for k, v in self.host.items()}}
        self.loss_sum.zero_()
        self.correct.zero_()
        self.host = dict.fromkeys(self._HOST, 0)
        mine = torch.tensor([values[k] for k in self.FIELDS], dtype=torch.float64, device=self.device)
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


@dataclasses.dataclass
class Progress:
    """Where the run is: optimizer steps taken, and the global gradient norm before clipping of the
    last one (None with clipping off)."""

    step: int
    grad_norm: float | None = None


class Recorder:
    """The run's metric records: each carries the global window since the previous one.

    A ``step`` record's all-gather runs in the background and the record is written one step later
    (:meth:`flush`, with the time and values of its own step), so a record costs no rank a wait in
    the step loop; any other record is written at once.
    """

    def __init__(self, log: MetricsLog, window: Window, optimizer: torch.optim.Optimizer,
                 progress: Progress, topo: Topology, layout: dict[str, Any], *, tokens_per_sample: int = 0,
                 total_steps: int = 0) -> None:
        """``tokens_per_sample``: a language model's window length (seq_len); its records then carry
        ``tokens_per_s`` (``samples_per_s`` × seq_len, the tokens trained per second over all ranks).
        ``total_steps``: the optimizer steps the run takes (:func:`planned_steps`); every record
        carries it as ``total_steps`` (the dashboard's % done and time left) when it is > 0."""
        self.log, self.window, self.optimizer, self.progress, self.topo = log, window, optimizer, progress, topo
        self.total_steps = total_steps
        self.layout = layout
        self.tokens_per_sample = tokens_per_sample
        self._deferred: list[tuple[dict[str, Any], PendingGather, dict[str, Any]]] = []

    def flush(self) -> None:
        """Write the ``step`` record whose gather is in flight, if any (rank 0; collective-free)."""
        while self._deferred:
            head, gathered, tail = self._deferred.pop()
            fields = _window_fields(gathered.result())
            if fields and self.tokens_per_sample:
                fields["tokens_per_s"] = fields["samples_per_s"] * self.tokens_per_sample
            self.log.write({**head, **fields, **(self.layout if fields else {}), **tail})

    def report(self, event: str, epoch: int, **extra: Any) -> None:
        """Collective: emit one ``event`` record for ``epoch`` with the global window since the
        previous record and ``extra`` fields."""
        self.flush()  # records stay in order
        head = {"event": event, "time": time.time(), "epoch": epoch, "step": self.progress.step,
                "world_size": self.topo.world_size, "lr": self.optimizer.param_groups[0]["lr"]}
        if self.total_steps > 0:
            head["total_steps"] = self.total_steps
        tail = {"grad_norm": self.progress.grad_norm} if self.progress.grad_norm is not None else {}
        tail.update(extra)
        self._deferred.append((head, self.window.start_gather(), tail))
        if event != "step":
            self.flush()


def _rank_layout(strategy: Strategy, world_size: int) -> dict[str, Any]:
    """What each rank does, for the per-rank table of step records (a pipeline's stages differ by
    design); {} for ddp and fsdp, whose ranks all do the same."""
    if strategy.name != "pipeline":
        return {}
    stages = [r % strategy.num_stages for r in range(world_size)]
    return {"rank_pipeline_stage": stages, "rank_stage_layers": [strategy.stage_sizes[s] for s in stages]}


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
    # One rank has no slowest to wait for: no wait_for_slowest_s at all (a 0 would read as the best).
    waiting = {"wait_for_slowest_s": sum(max(ready) - x for x in ready)} if len(ranks) > 1 else {}
    return {
        "train_loss": sum(r["loss_sum"] for r in ranks) / samples,
        "train_accuracy": sum(r["correct"] for r in ranks) / samples,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "rank_samples_per_s": [r["trained"] / r["seconds"] if r["seconds"] > 0 else 0.0 for r in ranks],
        "rank_step_time_s": [per_step(r, r["step_seconds"]) for r in ranks],
        "rank_data_wait_s": [per_step(r, r["data_seconds"]) for r in ranks],
        "rank_compute_s": [per_step(r, r["compute_seconds"]) for r in ranks],
        "rank_sync_wait_s": [per_step(r, max(0.0, r["step_seconds"] - r["compute_seconds"])) for r in ranks],
        **waiting,
    }


# -- data sharding -------------------------------------------------------------------------------


def sample_order_digest(order: torch.Tensor) -> str:
    """A short fingerprint (16 hex digits of SHA-256) of one rank's sample indices for an epoch, in
    order: equal digests mean the same samples in the same order (``epoch`` records carry them)."""
    return hashlib.sha256(order.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def random_hflip(x: torch.Tensor) -> torch.Tensor:
    """``train.augment``: each image of the batch (N, C, H, W) mirrored left–right with probability
    1/2, drawn from this rank's torch RNG (seeded per rank, saved in checkpoints)."""
    flip = torch.rand(len(x)) < 0.5
    return torch.where(flip.to(x.device).view(-1, 1, 1, 1), x.flip(-1), x)


def maybe_flip(x: torch.Tensor, enabled: bool) -> torch.Tensor:
    """:func:`random_hflip` of the batch ``x`` when ``train.augment`` is on, else ``x`` itself."""
    return random_hflip(x) if enabled else x


@dataclasses.dataclass(frozen=True)
class TrainShard:
    """This rank's part of each epoch's training data, held in memory: its data-parallel unit's
    :class:`~trainer_pkg.sampling.ShardOrder`, cut into batches (a pipeline's stages read the same
    shard). Padded duplicates train but are left out of every reported metric (:meth:`padding`).
    """

    x: torch.Tensor
    """Every training sample, (n, *sample shape), on the CPU."""
    y: torch.Tensor
    """Their labels, (n,)."""
    order: ShardOrder

    @classmethod
    def of(cls, data: Dataset, strategy: Strategy, t: TrainConfig) -> "TrainShard":
        """The shard of ``data``'s training split that ``strategy`` gives this rank. Raises
        :class:`TrainerError` when a shard holds fewer samples than one batch of a pipeline."""
        order = ShardOrder(len(data.y_train), dp_rank=strategy.dp_rank, dp_size=strategy.dp_size,
                           batch_size=t.batch_size, seed=t.seed, drop_last_batch=strategy.drop_last_batch)
        if order.batches == 0:
            raise TrainerError(order.too_small())
        return cls(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train), order)

    @property
    def n(self) -> int:
        return len(self.y)

    @property
    def batches(self) -> int:
        """Batches per epoch (a pipeline skips an incomplete last batch)."""
        return self.order.batches

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for ``epoch`` in training order (:meth:`ShardOrder.epoch_order`)."""
        return self.order.epoch_order(epoch)

    def batch(self, order: torch.Tensor, index: int, device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(position of its first sample in ``order``, samples, labels) of batch ``index`` of the epoch
        whose :meth:`epoch_order` is ``order``, on ``device``."""
        idx = self.order.indices(order, index)
        return (index * self.order.batch_size, self.x[idx].to(device, non_blocking=True),
                self.y[idx].to(device, non_blocking=True))

    def padding(self, start: int, count: int) -> tuple[torch.Tensor | None, int]:
        """(mask of the real samples, how many) among ``count`` positions from ``start``
        (:meth:`ShardOrder.padding`)."""
        return self.order.padding(start, count)


def make_shard(data: Any, strategy: Strategy, cfg: JobConfig) -> TrainShard | TokenShard | StreamShard | WebShard:
    """This rank's training shard of ``data`` (what :func:`trainer_pkg.datasets.load_dataset` returned)
    under ``strategy``: the one place that picks the shard class for a kind of data. Every shard class
    has :class:`TrainShard`'s interface (``batches``, ``n``, ``epoch_order``, ``batch``, ``padding``).

    Token data (:class:`trainer_pkg.datasets.TokenData`): a :class:`trainer_pkg.token_shard.TokenShard`
    of (B, seq_len) windows drawn per batch from (``train.seed``, epoch, data-parallel rank, batch).
    A ``webdataset`` (:class:`trainer_pkg.datasets.WebDataset`): a :class:`trainer_pkg.web_shard.WebShard`
    of this rank's own tar shards; making it is a collective (the ranks agree on the step count)."""
    if isinstance(data, TokenData):
        return TokenShard.of(data.tokens, seq_len=data.seq_len, batch_size=cfg.train.batch_size,
                             dp_rank=strategy.dp_rank, dp_size=strategy.dp_size, seed=cfg.train.seed,
                             drop_last=strategy.drop_last_batch)
    if isinstance(data, Dataset) and data.streamed:  # ImageFolder, CSV, uncompressed NPZ (trainer_pkg.streaming)
        return StreamShard.of(data, strategy, cfg)
    if isinstance(data, WebDataset):  # each rank its own tar shards, the step count agreed (collective)
        return WebShard.of(data, strategy, cfg)
    return TrainShard.of(data, strategy, cfg.train)


def validation_set(data: Any, cfg: JobConfig) -> tuple[Any, torch.Tensor]:
    """(inputs, targets) that :meth:`Strategy.evaluate` runs over at each epoch's end: tensors, or
    for inputs any object indexed by a (k,) int64 tensor giving a (k, *sample shape) tensor. Token
    data: ``data.val_windows`` fixed windows of the validation split, x and y int64 (N, seq_len)
    (:func:`trainer_pkg.token_shard.validation_windows`)."""
    if isinstance(data, TokenData):
        return validation_windows(data.tokens, seq_len=data.seq_len, count=cfg.data.val_windows, seed=cfg.train.seed)
    if isinstance(data, (Dataset, WebDataset)) and isinstance(data.x_val, Samples):  # each batch read when evaluate asks for it
        return SampleView(data.x_val), torch.from_numpy(data.y_val)
    return torch.from_numpy(data.x_val), torch.from_numpy(data.y_val)


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


def save_sharded_checkpoint(path: str, *, strategy: Strategy, optimizer: torch.optim.Optimizer,
                            scheduler: torch.optim.lr_scheduler.LRScheduler, epoch: int, batches_done: int,
                            step: int, cfg: JobConfig, topo: Topology) -> None:
    """Collective: :func:`save_checkpoint`'s contents as a sharded checkpoint in the directory
    ``path`` (``output.checkpoint_format`` sharded, :mod:`trainer_pkg.sharded_checkpoint`): every rank
    writes its own shards of the model and optimizer state, rank 0 the loop position, schedule,
    every rank's RNG and the config; no rank gathers the whole model."""
    rngs: list[Any] = [None] * topo.world_size
    dist.all_gather_object(rngs, _rng_state())
    meta = {"version": CHECKPOINT_VERSION, "strategy": strategy.name, "scheduler": scheduler.state_dict(),
            "scaler": None, "epoch": epoch, "batches_done": batches_done, "step": step, "sampler_epoch": epoch,
            "world_size": topo.world_size, "rng": rngs, "config": cfg.to_dict()}
    sharded_checkpoint.write(path, strategy.module, optimizer, meta, step=step)


def load_sharded_checkpoint_meta(path: str) -> dict[str, Any] | None:
    """The loop position, schedule and RNG of the sharded checkpoint directory ``path`` (or of the
    previous one a killed save left as ``path.old``), with ``format`` ``sharded`` and its ``path``;
    None when there is none. The model and optimizer state are read by :func:`maybe_resume` once
    they are placed. Raises :class:`TrainerError` for an unreadable one."""
    found = sharded_checkpoint.find_checkpoint(path)
    if found is None:
        return None
    try:
        return sharded_checkpoint.read_meta(found)
    except ValueError as exc:
        raise TrainerError(f"checkpoint {found} cannot be read ({exc}); delete it to start over") from None


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


def _read_init_file(source: str) -> io.BytesIO:
    """The bytes of ``train.init_from``: an object-store URI read through :mod:`trainer_pkg.objstore`
    (the platform's credentials), or a local file opened without following a symbolic link (a file
    another job made is never a door to elsewhere on the host)."""
    if objstore.is_remote(source):
        try:
            return io.BytesIO(objstore.read(source))
        except ConfigError as exc:
            raise TrainerError(f"train.init_from {source} cannot be read: {exc}") from None
    try:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise TrainerError(f"train.init_from {source} cannot be read ({exc.strerror or exc}); it must be a "
                           f"regular file, not a symbolic link") from None
    with os.fdopen(fd, "rb") as f:
        return io.BytesIO(f.read())


def load_init(t: TrainConfig, device: torch.device | str = "cpu") -> dict[str, Any]:
    """What ``train.init_from`` holds for ``train.init_mode``: for ``continue`` a checkpoint dict as
    :func:`load_checkpoint` returns it (model, optimizer, scheduler, epoch, step, RNG); for
    ``finetune`` ``{"model": bare state dict}`` from a ``model.pt`` (or the model of a checkpoint).
    Tensors are mapped onto ``device``. Raises :class:`TrainerError` naming the file for one that
    cannot be read or holds the wrong thing (a model.pt given to continue)."""
    data = _read_init_file(t.init_from)
    try:
        loaded = torch.load(data, map_location=device, weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise TrainerError(f"train.init_from {t.init_from} cannot be read ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    is_checkpoint = isinstance(loaded, dict) and "model" in loaded and "step" in loaded
    if t.init_mode == "continue":
        if not is_checkpoint:
            raise TrainerError(f"train.init_from {t.init_from} is not a Trainboard checkpoint (last.pt); continue "
                               f"needs one (a model.pt holds weights only: use finetune)")
        loaded["model"] = strip_module_prefix(loaded["model"])
        return loaded
    weights = loaded["model"] if is_checkpoint else loaded
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise TrainerError(f"train.init_from {t.init_from} holds no model state dict")
    return {"model": strip_module_prefix(weights)}


def maybe_init_weights(model: torch.nn.Module, init: dict[str, Any] | None, source: str) -> None:
    """Fine-tuning: the source's weights loaded into ``model`` (before any wrapper). Raises
    :class:`TrainerError` when they do not fit this architecture (another head, other layers), with
    torch's first line naming the mismatch."""
    if init is None:
        return
    try:
        model.load_state_dict(init["model"])
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = "; ".join(lines[1:3]) or lines[0]
        raise TrainerError(f"train.init_from {source}: its weights do not fit this model ({detail}); fine-tune "
                           f"needs the same architecture, input shape and number of classes") from None


# -- the run -------------------------------------------------------------------------------------


def train(cfg: JobConfig) -> int:
    """Run the job ``cfg`` in this process as one rank of the current topology; returns the exit code.

    Never raises for a user error: it prints ``trainer error: ...`` on stderr and returns 1.
    """
    stop = StopSignal().install()
    with contextlib.ExitStack() as resources:  # closed after the error below is reported
        try:
            world_shape.validate(cfg)
            # Before any collective: an image too old for the strategy fails the same way on every rank.
            too_old = strategy_torch_error(cfg.parallel.strategy, torch.__version__, where="this image")
            if too_old:
                raise TrainerError(too_old)
            topo = Topology.from_env()
            device, backend = _pick_device(cfg.parallel.dist_backend, topo, cfg.parallel.strategy)
            if device.type == "cpu":
                _set_cpu_threads(topo)
            resources.enter_context(process_group(backend, topo, cfg.parallel.timeout_s, device))
            return _run(cfg, topo, device, backend, stop)
        except (TrainerError, ConfigError, StrategyError, UserCodeError) as exc:
            report_error(f"{exc}")
            return 1
        except Exception as exc:
            traceback.print_exc()
            report_error(f"{type(exc).__name__}: {exc}")
            return 1


def _run(cfg: JobConfig, topo: Topology, device: torch.device, backend: str, stop: StopSignal) -> int:
    """One rank's run, top to bottom: setup, data, model, resume, loop, save. Every rank runs the
    same collectives in the same order."""
    t = cfg.train
    sharded = cfg.output.checkpoint_format == "sharded"
    ckpt_path = (sharded_checkpoint.checkpoint_dir_path(cfg.output.resolved_checkpoint_dir) if sharded
                 else os.path.join(cfg.output.resolved_checkpoint_dir, CHECKPOINT_NAME))
    model_path = os.path.join(cfg.output.output_dir, "model.pt")
    _log(topo, f"world size {topo.world_size} ({backend} on {device.type}), "
               f"{torch.get_num_threads()} CPU thread(s) per rank")
    if cfg.code.dir or cfg.code.sha256:
        _log(topo, f"user code: sha256 {cfg.code.sha256 or '(not recorded)'} in {cfg.code.dir or '(no code.dir)'}")
    if topo.world_size != cfg.parallel.world_size:
        _log(topo, f"note: the config asks for {cfg.parallel.nodes} node(s) × {cfg.parallel.procs_per_node} "
                   f"process(es) = {cfg.parallel.world_size} rank(s); the launcher started {topo.world_size}")

    # -- data and model: the same arrays and the same initial weights on every rank ---------------
    with agreed_setup(topo, device):
        _seed_everything(t.seed)
        mismatch = world_shape.data_model_errors(cfg)  # before the data: a cnn never opens token shards
        if mismatch:
            raise ConfigError("; ".join(f"{k}: {v}" for k, v in mismatch.items()))
        data = load_dataset(cfg.data, seed=t.seed)
        for note in getattr(data, "notes", ()):  # how a Dataset's files are read
            _log(topo, note)
        if isinstance(data, TokenDataset):
            data = token_data(data, seq_len_for(cfg.data.seq_len, cfg.model.arch, cfg.model.params))
        torch.manual_seed(t.seed)  # identical initial weights on every rank (DDP also broadcasts them)
        _check_job_fits(cfg, data, topo.world_size)
        autocast = autocast_context(t.precision, device)
        model = build_model(cfg.model.arch, cfg.model.params, data.input_shape, data.num_classes,
                            entry_point=cfg.model.entry_point, code_dir=cfg.code.dir).to(device)
        if cfg.model.arch == CUSTOM and isinstance(data, Dataset):  # before any wrapper: a wrong output shape fails here, not in the loss
            first = torch.from_numpy(data.x_train[:t.batch_size]).to(device)
            check_first_batch(model, first, num_classes=data.num_classes, entry_point=cfg.model.entry_point,
                              code_dir=cfg.code.dir, autocast=autocast)
        n_params = sum(p.numel() for p in model.parameters())
        if sharded:
            ckpt = load_sharded_checkpoint_meta(ckpt_path)
        else:
            ckpt = load_checkpoint(ckpt_path, device) if os.path.exists(ckpt_path) else None
        # Another job's results, only for a run without progress of its own (a restart resumes its own).
        init = load_init(t, device) if ckpt is None and t.init_from else None
        if init is not None and t.init_mode == "continue":
            ckpt = init
            _log(topo, f"continuing from {t.init_from}")
        elif init is not None:
            maybe_init_weights(model, init, t.init_from)
            _log(topo, f"fine-tuning from the weights in {t.init_from}")
        if topo.is_main:
            _remove_leftovers(topo, ckpt_path, model_path)

    # -- placement: the strategy wraps, shards or splits the model; optimizer, lr schedule, resume --
    with agreed_setup(topo, device):
        strategy = make_strategy(cfg, model, device)
        optimizer = _make_optimizer(strategy.parameters(), t)
        shard = make_shard(data, strategy, cfg)
        if isinstance(getattr(shard, "order", None), ShardOrder) and (note := shard.order.small_batch_note()):
            _log(topo, f"warning: {note}")  # the batch really used, where the dashboard could not refuse it
        total_steps = planned_steps(t, shard.batches)
        ckpt_label = t.init_from if init is not None and ckpt is init else ckpt_path  # what errors and logs name
        scheduler = maybe_resume(ckpt, ckpt_label, strategy, optimizer, t, total_steps)
        if strategy.casts_parameters:  # FSDP2's mixed precision policy computes in bf16 itself
            autocast = contextlib.nullcontext()
    start_epoch, start_batch, step = _resume_position(ckpt, ckpt_label, topo, t.seed)
    shown = f"custom {cfg.model.entry_point}" if cfg.model.arch == CUSTOM else cfg.model.arch
    _log(topo, f"data {describe(data)}; model {shown} ({n_params:,} parameters); "
               f"{_describe_strategy(strategy, t, cfg.parallel)}")

    x_val, y_val = validation_set(data, cfg)
    save = functools.partial(save_sharded_checkpoint if sharded else save_checkpoint, ckpt_path,
                             strategy=strategy, optimizer=optimizer, scheduler=scheduler, cfg=cfg, topo=topo)
    progress = Progress(step)
    nonfinite = NonfiniteLoss(device)
    stepper = Stepper(strategy, optimizer, scheduler, shard, Window(device), nonfinite, progress, autocast, t)
    agreements = Agreements(stop, t, device, step)
    with MetricsLog(os.path.join(cfg.output.output_dir, "metrics.jsonl"), topo.is_main, fresh=ckpt is None) as log:
        recorder = Recorder(log, stepper.window, optimizer, progress, topo, _rank_layout(strategy, topo.world_size),
                            tokens_per_sample=data.seq_len if isinstance(data, TokenData) else 0,
                            total_steps=total_steps)
        divergence = Divergence(t.on_nonfinite_loss, recorder, topo)

        # -- the loop: one optimizer step per train.grad_accum_steps batches -----------------------
        first_step, last_step_s = step + 1, 0.0
        last_epoch = max(start_epoch - 1, 0)
        for epoch in range(start_epoch, t.epochs):
            if steps_done(progress.step, t):  # train.max_steps reached (before this epoch, or before a resume)
                break
            last_epoch = epoch
            order = shard.epoch_order(epoch)
            b = epoch_start = start_batch if epoch == start_epoch else 0
            measured_batch = memory_step_batch(strategy, epoch_start, shard.batches, t.grad_accum_steps,
                                               first_of_run=progress.step + 1 == first_step)
            while b < shard.batches and not steps_done(progress.step, t):
                if agreements.due(progress.step):
                    stopping, nonfinite_code = agreements.read()
                    divergence.check(nonfinite_code, epoch)
                    if stopping:
                        return _stop(epoch, b, strategy=strategy, save=save, recorder=recorder, topo=topo,
                                     ckpt_path=ckpt_path)
                    agreements.start(progress.step, last_step_s, nonfinite.code())
                batches = range(b, min(b + t.grad_accum_steps, shard.batches))
                # the saved activations are measured on one step per epoch only (rank_memory)
                last_step_s = stepper.step(batches, order, measure_activations=b == measured_batch)
                b = batches.stop
                recorder.flush()  # the previous step's record: its gather has finished by now
                if progress.step == first_step:
                    recorder.report("started", epoch, resumed=ckpt is not None)
                elif agreements.record_due(progress.step):
                    recorder.report("step", epoch)

            # -- end of epoch (or of train.max_steps inside it): validate, then checkpoint (never a
            # diverged model over a good one) --------------------------------------------------------
            divergence.check(nonfinite.agreed(device), epoch)
            strategy.sync_buffers()
            val_loss, val_acc = strategy.evaluate(x_val, y_val, device, autocast)
            digests: list[Any] = [None] * topo.world_size
            dist.all_gather_object(digests, sample_order_digest(order))
            scores = validation_fields(val_loss, val_acc, tokens=isinstance(data, TokenData))
            finished = b >= shard.batches  # else stopped inside the epoch by train.max_steps: resume there
            epochs_done = epoch + 1 if finished else epoch  # what the checkpoint below holds
            recorder.report("epoch", epoch, **scores, sample_order_digest=digests,
                            rank_memory=measured_memory(stepper, device), epochs_done=epochs_done)
            _log(topo, f"epoch {epoch}: " + " ".join(f"{k} {v:.4f}" for k, v in scores.items()))
            save(epoch=epochs_done, batches_done=0 if finished else b, step=progress.step)
        agreements.finish()

        # -- save: the whole model's bare state dict on rank 0 (FSDP shards, pipeline stages gathered)
        strategy.sync_buffers()
        state = strategy.full_state_dict()  # collective
        if topo.is_main:
            _atomic_torch_save(state, model_path)
        dist.barrier()
        recorder.report("completed", last_epoch, rank_memory=measured_memory(stepper, device))
        if strategy.name == "fsdp":  # one per sharded unit per step: none while gradients accumulate
            _log(topo, f"fsdp: {strategy.reduce_scatters} gradient reduce-scatter(s) in "
                       f"{progress.step - step} optimizer step(s) on rank 0")
        _log(topo, f"done: {model_path}")
        return 0


def _log(topo: Topology, msg: str) -> None:
    if topo.is_main:
        print_line(f"[trainer] {msg}")


def _agree_setup(error: str | None, topo: Topology, device: torch.device) -> None:
    """Collective: raise on every rank if setup failed on any, so none waits in a later collective."""
    failed = torch.tensor([topo.rank if error else -1], dtype=torch.int64, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error:
        raise TrainerError(error)
    if failed.item() >= 0:
        raise TrainerError(f"rank {failed.item()} failed during setup (its error is in its log)")


@contextlib.contextmanager
def agreed_setup(topo: Topology, device: torch.device) -> Iterator[None]:
    """A setup step whose outcome every rank agrees on (a collective at its end): when it failed on
    any rank, every rank raises :class:`TrainerError` (this rank's own error, or which rank failed),
    so no rank waits in a later collective for one that has given up. A fault in the user's model
    code (:class:`trainer_pkg.user_model.UserCodeError`) also prints the user's traceback first."""
    error = None
    try:
        yield
    except UserCodeError as exc:
        exc.write_traceback(topo.rank)  # the user's frames, then the one-line error like any other
        error = str(exc)
    except (TrainerError, ConfigError, StrategyError) as exc:
        error = str(exc)
    except OSError as exc:
        error = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
    except Exception as exc:  # still agreed, so the other ranks fail too instead of waiting
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    _agree_setup(error, topo, device)


def _check_job_fits(cfg: JobConfig, data: Dataset | TokenData, world_size: int) -> None:
    """Raise :class:`TrainerError` when the job cannot run on ``data`` or on the ``world_size`` ranks
    the launcher started (the world-shape checks, with their arithmetic); :class:`ConfigError` when
    the model cannot read the data (a classifier given token data, gpt given anything else, windows
    longer than the context: :func:`trainer_pkg.registry.check_input_shape`)."""
    check_input_shape(cfg.model.arch, data.input_shape, data_format=cfg.data.format, params=cfg.model.params)
    if cfg.train.augment and len(data.input_shape) != 3:
        raise TrainerError(f"train.augment flips images, but this dataset's samples have shape "
                           f"{tuple(data.input_shape)}, not (C, H, W); turn train.augment off")
    shape = world_shape.shape_errors(cfg, world_size=world_size,
                                     world_desc=f"the launcher started {world_size} rank(s)")
    if shape:
        raise TrainerError("; ".join(f"{k}: {v}" for k, v in shape.items()))


def _remove_leftovers(topo: Topology, *paths: str) -> None:
    for path in paths:
        for leftover in remove_stale_temp_files(path) + sharded_checkpoint.remove_stale_temp_dirs(path):
            _log(topo, f"removed {leftover}, left half-written by an earlier run that was killed")


def measured_memory(stepper: "Stepper", device: torch.device) -> list[dict[str, Any]]:
    """Collective: every rank's measured memory (:func:`trainer_pkg.memory.rank_memory`: its
    parameters, gradients and optimizer state as it holds them now, after a step, and the saved
    activations last measured), indexed by rank: the ``rank_memory`` of ``epoch`` and ``completed``
    records."""
    reshard = getattr(stepper.strategy.module, "reshard", None)
    if reshard is not None:  # FSDP: the root stays unsharded after a forward (evaluation); count its shards
        reshard()
    mine = rank_memory(stepper.strategy.parameters(), stepper.optimizer, device, stepper.activation_bytes)
    return gather_rank_memory(mine)


def maybe_resume(ckpt: dict[str, Any] | None, ckpt_path: str, strategy: Strategy, optimizer: torch.optim.Optimizer,
                 t: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr schedule over ``total_steps`` optimizer steps; with a checkpoint ``ckpt``, the model,
    optimizer and schedule state it holds loaded into them.

    Raises :class:`TrainerError` when the checkpoint does not fit this model or optimizer.
    """
    # Made before the optimizer state is loaded, as in the run that saved it: the parameter groups
    # then have the saved ones' keys (initial_lr), which FSDP's loader requires.
    scheduler = lr_scheduler(optimizer, t, total_steps)
    if ckpt is None:
        return scheduler
    try:
        if ckpt.get("format") == "sharded":  # any world size: DCP reshards
            sharded_checkpoint.load(ckpt["path"], strategy.module, optimizer)
        else:
            strategy.load(ckpt["model"], optimizer, ckpt.get("optimizer"))
        if ckpt.get("scheduler"):
            scheduler.load_state_dict(ckpt["scheduler"])
        else:  # a checkpoint from before schedules: the lr the schedule gives at its step
            scheduler = lr_scheduler(optimizer, t, total_steps, step=ckpt["step"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise TrainerError(
            f"checkpoint {ckpt_path} does not fit this model/optimizer "
            f"({str(exc).splitlines()[0]}); delete it or set output.checkpoint_dir to start fresh"
        ) from None
    return scheduler


def _resume_position(ckpt: dict[str, Any] | None, ckpt_path: str, topo: Topology, seed: int) -> tuple[int, int, int]:
    """(epoch, batch inside it, optimizer steps taken) to start at, and this rank's random state for
    them: the checkpoint's, or a fresh start's per-rank seed."""
    if ckpt is None:
        torch.manual_seed(seed + 7919 * topo.rank)  # per-rank randomness (dropout) after a shared init
        return 0, 0, 0
    epoch, batch, step = ckpt["epoch"], ckpt.get("batches_done", 0), ckpt["step"]
    rngs = ckpt.get("rng") or []
    if ckpt.get("world_size") == topo.world_size and len(rngs) == topo.world_size:
        _set_rng_state(rngs[topo.rank])
    else:
        # A different world size reshards the data: the saved position inside the epoch is void.
        batch = 0
        torch.manual_seed(seed + 7919 * topo.rank + 104729 * epoch)
    _log(topo, f"resuming from {ckpt_path}: epoch {epoch}, batch {batch}, step {step}")
    return epoch, batch, step


def memory_step_batch(strategy: Strategy, epoch_start: int, batches: int, grad_accum_steps: int, *,
                      first_of_run: bool) -> int:
    """The batch index whose step's saved activations ``rank_memory`` reports for an epoch that starts
    at batch ``epoch_start``: its first step, except a pipeline's first step in this process, whose
    schedule runs one extra forward to infer the stages' shapes (its saved tensors are counted too);
    then the next step, when the epoch has one."""
    if strategy.name == "pipeline" and first_of_run and epoch_start + grad_accum_steps < batches:
        return epoch_start + grad_accum_steps
    return epoch_start


class Stepper:
    """One optimizer step at a time: forward and backward over its batches (gradients synchronised
    only on the last: DDP ``no_sync``, FSDP ``set_requires_gradient_sync(False)``), under autocast
    when ``train.precision`` asks, clipping, the optimizer and lr schedule steps, and the sums the
    next record reports."""

    def __init__(self, strategy: Strategy, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, shard: TrainShard, window: Window,
                 nonfinite: "NonfiniteLoss", progress: Progress, autocast: contextlib.AbstractContextManager,
                 t: TrainConfig) -> None:
        self.strategy, self.optimizer, self.scheduler = strategy, optimizer, scheduler
        self.shard, self.window, self.nonfinite, self.progress = shard, window, nonfinite, progress
        self.autocast, self.t = autocast, t
        self.device = window.device
        self.activation_bytes = 0
        """Bytes saved for backward by one batch's forward, as last measured (:mod:`trainer_pkg.memory`)."""

    def step(self, batches: range, order: torch.Tensor, *, measure_activations: bool = False) -> float:
        """One optimizer step over the epoch's batches ``batches`` (indices into ``order``, this
        rank's :meth:`TrainShard.epoch_order`); returns the seconds it took. ``measure_activations``:
        count the bytes the first batch's forward saves for backward into :attr:`activation_bytes`."""
        tick = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        data_seconds = 0.0
        for index in batches:
            data_tick = time.perf_counter()
            start, xb, yb = self.shard.batch(order, index, self.device)
            xb = maybe_flip(xb, self.t.augment)
            data_seconds += time.perf_counter() - data_tick
            meter = SavedActivations() if measure_activations and index == batches[0] else contextlib.nullcontext()
            # Each batch's mean loss weighs 1/len(batches): the step's gradient is the mean over them.
            with meter:
                out = self.strategy.forward_backward(xb, yb, loss_scale=1.0 / len(batches),
                                                     sync=index == batches[-1], autocast=self.autocast)
            if isinstance(meter, SavedActivations):
                self.activation_bytes = meter.bytes
            keep, real = self.shard.padding(start, len(yb))
            if out is not None:  # (out's tensors are detached: no autograd here)
                self.nonfinite.see(out.loss, self.progress.step + 1)
            self.window.add_batch(out, yb, keep, real)
        self.strategy.finish_gradients()
        self.progress.grad_norm = maybe_clip_grad_norm(self.strategy, self.t.grad_clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.progress.step += 1
        seconds = time.perf_counter() - tick
        self.window.add_step(seconds, data_seconds, self.strategy.take_compute_seconds())
        return seconds


def planned_steps(t: TrainConfig, batches_per_epoch: int) -> int:
    """Optimizer steps the run takes (the span of the lr schedule): ``train.epochs`` × the steps of
    an epoch of ``batches_per_epoch`` batches (``train.grad_accum_steps`` per step, the last step of
    an epoch taking what is left), or ``train.max_steps`` when that is set and fewer."""
    total = t.epochs * math.ceil(batches_per_epoch / t.grad_accum_steps)
    return min(total, t.max_steps) if t.max_steps else total


def steps_done(step: int, t: TrainConfig) -> bool:
    """Whether ``step`` optimizer steps reach ``train.max_steps`` (never when it is 0): the loop then
    stops, validates, checkpoints and saves ``model.pt`` as after its last epoch. The same on every
    rank (every rank counts the same steps)."""
    return bool(t.max_steps) and step >= t.max_steps


def validation_fields(loss: float, accuracy: float, *, tokens: bool) -> dict[str, float]:
    """The ``epoch`` record's validation fields: ``val_loss`` (mean cross entropy; nats per token for
    a language model) and ``val_accuracy`` (next-token accuracy for a language model), and for token
    data ``val_perplexity`` = exp(val_loss) (inf past float range)."""
    fields = {"val_loss": loss, "val_accuracy": accuracy}
    if tokens:
        fields["val_perplexity"] = math.exp(loss) if loss < 709.0 else math.inf
    return fields


def maybe_clip_grad_norm(strategy: Strategy, max_norm: float) -> float | None:
    """With ``train.grad_clip_norm`` > 0, clip the global gradient norm (over all ranks and shards) to
    ``max_norm`` and return the norm before clipping; None, touching nothing, when it is 0."""
    return strategy.clip_grad_norm_(max_norm) if max_norm > 0 else None


class Agreements:
    """When the ranks agree on stopping, and how often ``step`` records are made.

    An agreement (:meth:`StopSignal.start_agreement`: a SIGTERM flag, the slowest step time, the
    earliest non-finite loss) is an asynchronous all-reduce started about every
    ``train.stop_check_s`` of training (:func:`stop_poll_interval`) and read when the next one
    starts, long finished in the background. Every rank computes the same interval, and with
    ``train.log_every_steps`` 0 the same record interval (:func:`record_interval`), from the agreed
    slowest step time, so all ranks stop, and record, at the same step.
    """

    def __init__(self, stop: StopSignal, t: TrainConfig, device: torch.device, step: int) -> None:
        self.stop, self.t, self.device = stop, t, device
        self.pending: PendingStop | None = None
        self.poll, self.next_at = 1, step
        self.record_every = t.log_every_steps or RECORD_FIRST_STEPS
        self.last_record = step + 1

    def due(self, step: int) -> bool:
        """Whether an agreement is read and the next one started before optimizer step ``step + 1``."""
        return step >= self.next_at

    def read(self) -> tuple[bool, float]:
        """(whether any rank had been signalled, the earliest non-finite loss as a
        :meth:`NonfiniteLoss.code`) of the agreement in flight; ``(False, -inf)`` before the first."""
        if self.pending is None:
            return False, -math.inf
        stopping, slowest_step_s, nonfinite_code = self.pending.result()
        self.pending = None
        self.poll = stop_poll_interval(slowest_step_s, self.t.stop_check_s)
        if not self.t.log_every_steps:
            self.record_every = record_interval(slowest_step_s, self.t.log_every_s)
        return stopping, nonfinite_code

    def start(self, step: int, last_step_s: float, nonfinite_code: float) -> None:
        """Start the next agreement at optimizer step ``step`` with this rank's last step time
        (seconds) and first non-finite loss."""
        self.pending = self.stop.start_agreement(self.device, last_step_s, nonfinite_code)
        self.next_at = step + self.poll

    def record_due(self, step: int) -> bool:
        """Whether optimizer step ``step`` gets a ``step`` record: every ``train.log_every_steps``
        steps, or (0) about every ``train.log_every_s`` seconds."""
        if self.t.log_every_steps:
            return step % self.t.log_every_steps == 0
        if step - self.last_record >= self.record_every:
            self.last_record = step
            return True
        return False

    def finish(self) -> None:
        """Wait for the last agreement (nothing is left to stop)."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None


class Divergence:
    """What the run does about an agreed non-finite loss (``train.on_nonfinite_loss``); the value is
    the same on every rank, so every rank acts alike."""

    def __init__(self, policy: str, recorder: Recorder, topo: Topology) -> None:
        self.policy, self.recorder, self.topo = policy, recorder, topo
        self.warned = False

    def check(self, code: float, epoch: int) -> None:
        """Act on ``code`` (:meth:`NonfiniteLoss.code`, agreed): ``stop`` emits the ``failed`` record and
        raises :class:`TrainerError`; ``warn`` logs it once. Nothing for ``-inf`` (all finite)."""
        reason = describe_nonfinite(code)
        if reason is None:
            return
        if self.policy == "stop":
            # The ranks agree about every stop_check_s, so the run is some steps past the bad one:
            # the record names it, and the dashboard marks the chart there.
            self.recorder.report("failed", epoch, reason=reason, nonfinite_step=nonfinite_step(code))
            raise TrainerError(f"{reason}: the run diverged (lower train.lr, or clip gradients with "
                               "train.grad_clip_norm); no checkpoint was written after it")
        if not self.warned:
            self.warned = True
            _log(self.topo, f"warning: {reason}; training goes on (train.on_nonfinite_loss is warn)")


def _stop(epoch: int, batches_done: int, *, strategy: Strategy, save: Any, recorder: Recorder, topo: Topology,
          ckpt_path: str) -> int:
    """Every rank agreed to stop: checkpoint the exact position, emit ``stopped``, exit cleanly."""
    strategy.sync_buffers()
    save(epoch=epoch, batches_done=batches_done, step=recorder.progress.step)
    recorder.report("stopped", epoch)
    _log(topo, f"stopped by signal at epoch {epoch}, step {recorder.progress.step}; checkpoint {ckpt_path}")
    return 0


def _make_optimizer(params: list[torch.nn.Parameter], t: TrainConfig) -> torch.optim.Optimizer:
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


def lr_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig, total_steps: int, *,
                 step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """``train.lr_schedule`` (:func:`lr_factor` of ``train.lr``, over ``total_steps`` optimizer steps)
    for ``optimizer``, placed after ``step`` steps: the optimizer's lr becomes that of step ``step``
    (0-based), and each ``scheduler.step()`` after an optimizer step moves to the next.

    A ``step`` > 0 goes through the scheduler's own resume argument (``last_epoch``), which reads the
    base lr from each parameter group's ``initial_lr``.
    """
    for group in optimizer.param_groups:
        group["initial_lr"] = t.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, schedule=t.lr_schedule, warmup_steps=t.warmup_steps, total_steps=total_steps),
        last_epoch=step - 1)


def _describe_strategy(strategy: Any, t: Any, p: Any) -> str:
    s = strategy.name
    if s == "fsdp":
        s += f": {strategy.unit_count} submodule(s) sharded on their own ({', '.join(strategy.unit_classes) or 'none'}), then the root"
    if s == "pipeline":
        s += (f": {strategy.num_stages} stages of {strategy.stage_sizes} layers × {strategy.dp_size} "
              f"replica(s), {strategy.microbatches} micro-batches, each epoch's incomplete last batch skipped")
    if t.grad_accum_steps > 1:
        s += f"; {t.grad_accum_steps} batches per optimizer step"
    if t.precision != "fp32":
        s += f"; {t.precision} " + ("parameters (FSDP2 mixed precision, fp32 gradient reduction)"
                                    if getattr(strategy, "casts_parameters", False) else "autocast")
    if getattr(strategy, "cpu_offload", False):
        s += "; shards offloaded to CPU memory"
    if p.activation_checkpointing:
        s += "; activation checkpointing per unit"
    if t.compile:
        s += "; torch.compile"
    return s


# -- command line --------------------------------------------------------------------------------

# The command line is the JobConfig: a flag per field (``--batch-size`` sets train.batch_size), its
# help the field's documentation, its choices the field's Literal. Exceptions, by dotted field:
_FLAG_NAMES = {"data.format": "--data-format", "model.arch": "--model"}
_NO_FLAG = frozenset({
    "data.name", "data.uri",  # both set by --dataset
    "model.params",  # --model-param NAME=JSON, one per parameter
    "parallel.nodes", "parallel.procs_per_node",  # the launcher's word (its environment), never a flag's
    "model.shard_classes",  # a list: set in --config
    # the user's code: trainer_pkg.launch's business
    "code.dir", "code.sha256", "code.script", "code.args", "code.framework",
})
_GROUP_TITLES = {"data": "data", "model": "model", "parallel": "parallelism", "train": "training", "output": "output"}


@dataclasses.dataclass(frozen=True)
class CliFlag:
    """One config field the command line sets."""

    section: str
    """The JobConfig section (``train``)."""
    field: str
    """The field in it (``batch_size``)."""
    flag: str
    """The option (``--batch-size``)."""

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments that holds the value (``batch_size``); None when
        the flag was not given."""
        return self.flag[2:].replace("-", "_")


def cli_flags() -> list[CliFlag]:
    """Every config field the command line sets, with its flag, in the JobConfig's order."""
    flags = []
    for section, cls in typing.get_type_hints(JobConfig).items():
        for f in dataclasses.fields(cls):
            dotted = f"{section}.{f.name}"
            if dotted not in _NO_FLAG:
                flags.append(CliFlag(section, f.name, _FLAG_NAMES.get(dotted, "--" + f.name.replace("_", "-"))))
    return flags


def _add_flag(group: Any, flag: CliFlag, cls: type, default: Any) -> None:
    """Add ``flag`` to ``group``, typed, with choices and help from the field's declaration in ``cls``."""
    hint = typing.get_type_hints(cls)[flag.field]
    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", field_docs(cls).get(flag.field, "")).replace("``", "")  # reST to text
    shown = repr(default) if isinstance(default, str) else default
    help_text = f"{doc} (config default {shown})".strip().replace("%", "%%")
    if hint is bool:
        group.add_argument(flag.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif get_origin(hint) is Literal:
        group.add_argument(flag.flag, choices=get_args(hint), help=help_text)
    elif hint in (int, float, str):
        group.add_argument(flag.flag, type=hint, help=help_text)
    else:  # a new field of another type needs a flag of its own, or a place in _NO_FLAG
        raise TypeError(f"{flag.section}.{flag.field}: no command-line flag for type {hint!r}")


def build_parser() -> argparse.ArgumentParser:
    """The trainer's command line: ``--config`` and a flag per JobConfig field (:func:`cli_flags`),
    each overriding the file's value; unset flags parse to None."""
    defaults = JobConfig()
    p = argparse.ArgumentParser(
        prog="python -m trainer_pkg.train",
        description="Train a classifier (ddp, fsdp or pipeline parallel). Run under torchrun for several "
                    "processes (the topology comes from torchrun's environment); flags mirror the "
                    "JobConfig fields and override --config.",
        epilog="example: torchrun --standalone --nproc_per_node 2 -m trainer_pkg.train --dataset digits "
               "--model cnn --epochs 3 --batch-size 32 --lr 0.05 --seed 0 --output-dir out",
    )
    p.add_argument("--config", metavar="JOB_JSON", help="a JobConfig JSON file to start from")
    groups = {section: p.add_argument_group(title) for section, title in _GROUP_TITLES.items()}
    groups["data"].add_argument(
        "--dataset", metavar="NAME_OR_PATH",
        help="'digits' (built in: data.name) or the path of an ImageFolder tree, .csv or .npz file, a "
             "tokens directory (with meta.json) or a folder of .tar shards (data.uri); its format is guessed from the path unless "
             "--data-format is given")
    sections = typing.get_type_hints(JobConfig)
    for flag in cli_flags():
        _add_flag(groups[flag.section], flag, sections[flag.section], getattr(getattr(defaults, flag.section), flag.field))
    groups["model"].add_argument("--model-param", action="append", default=[], metavar="NAME=JSON",
                                 help="an architecture parameter, e.g. --model-param channels=16 (repeatable)")
    return p


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The JobConfig the flags describe: ``--config`` (if given) with the flags applied on top,
    validated (:func:`trainer_pkg.world_shape.validate`). Raises :class:`ConfigError`."""
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
    if args.model is not None and args.model != raw["model"]["arch"]:
        raw["model"]["params"] = {}  # another architecture's params would not fit
    for flag in cli_flags():
        value = getattr(args, flag.dest)
        if value is not None:
            raw[flag.section][flag.field] = value
    if args.dataset is not None:
        fmt = args.data_format or _guess_format(args.dataset)
        raw["data"]["format"] = fmt
        raw["data"]["name" if fmt == "builtin" else "uri"] = args.dataset
    for item in args.model_param:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--model-param {item!r}: expected NAME=VALUE, e.g. channels=16")
        try:
            raw["model"]["params"][name] = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"--model-param {item!r}: the value must be JSON (16, 0.1, true)") from None
    if torchrun_env_present():
        # The shape is the launcher's, never a flag's: record it so the shape checks see the real one.
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if local >= 1 and world % local == 0:
            raw["parallel"]["nodes"], raw["parallel"]["procs_per_node"] = world // local, local
    return world_shape.validate(JobConfig.from_dict(raw))


def _guess_format(dataset: str) -> str:
    if dataset == "digits":
        return "builtin"
    if os.path.isfile(os.path.join(dataset, "meta.json")):  # a token dataset's directory
        return "tokens"
    if os.path.isdir(dataset) and any(n.endswith(".tar") for n in os.listdir(dataset)):  # tar shards
        return "webdataset"
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
