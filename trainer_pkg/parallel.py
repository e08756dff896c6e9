"""The parallelism strategies: how a model is placed on the ranks and how one batch trains.

:func:`make_strategy` returns one :class:`Strategy` for ``parallel.strategy``; the training loop in
:mod:`trainer_pkg.train` is the same for all three and talks to it only through that interface.

``ddp``
    Every rank holds the whole model (``DistributedDataParallel``) and a disjoint shard of the data;
    gradients are averaged across ranks during backward.
``fsdp``
    The same data split, but FSDP2 ``fully_shard`` is applied to each unit of :func:`fsdp_units` that
    has weights (the submodules of the classes named in ``model.shard_classes``; else each layer of
    :func:`trainer_pkg.models.sequential_layers`, or each top-level child of a custom model) and then
    to the root: parameters,
    gradients and optimizer state live as 1/world-size shards (DTensors) and each layer's weights are
    all-gathered only while it runs. Gradients are reduce-scattered (averaged), so the run equals
    DDP's up to float rounding.
``pipeline``
    The model's layers (:func:`trainer_pkg.models.pipeline_units` of its ``layers()``, or of an
    ``nn.Sequential``'s children) are split into ``S`` consecutive
    stages of about equal parameter count, one stage per rank (``torch.distributed.pipelining``).
    Each batch is cut into ``parallel.microbatches`` micro-batches that flow stage to stage under the
    GPipe or 1F1B schedule; the loss is computed on the last stage. With ``W = S × R`` ranks there
    are ``R`` pipelines (ranks ``r·S … r·S + S − 1`` form pipeline ``r``), each reading its own data
    shard; stage ``s`` of every pipeline averages its gradients with the others after backward.
    Batches must have the same size every step (the stages agree on activation shapes once), so each
    epoch's last, incomplete batch is skipped; the next epoch's reshuffle trains those samples.

Compute against waiting (the straggler): in synchronous training every rank's step takes as long as
the slowest rank's, so a step time cannot tell which rank the others wait for. Each strategy
therefore measures its rank's *compute*: the seconds of :meth:`Strategy.forward_backward` spent on
this rank's own forward and backward, apart from the time it sits in a collective or a receive
that waits for other ranks. ``ddp``: from the call to the moment this rank's last gradient is
accumulated (a post-accumulate-grad hook on every parameter), so the gradient all-reduce it then
waits in is left out (buffers are not broadcast in forward: :meth:`Strategy.sync_buffers` does
that where they are read). ``fsdp``: the call's time less the time blocked in FSDP's parameter
all-gathers and gradient reduce-scatters (timed by custom comms, ``set_custom_all_gather`` /
``set_custom_reduce_scatter``). ``pipeline``: the time in the stage's own forward and backward of
each micro-batch (``forward_one_chunk`` / ``backward_one_chunk``), not the waits for activations or
gradients from the neighbouring stages. :meth:`Strategy.take_compute_seconds` hands it to the loop.
These are host clocks: exact on CPU (gloo blocks the calling thread). On a GPU, kernels and NCCL
collectives run asynchronously, so the host's times show when work was queued, not when it ran;
timing the same spans with CUDA events is what a GPU run would need (not done yet).

Checkpoints and ``model.pt`` hold the *full* model as a bare state dict (the keys of the plain
model) under every strategy, and the optimizer state keyed by parameter name (the format of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(full_state_dict=True)``). So a
checkpoint written by one strategy loads into another, and ``model.pt`` loads into
``build_model(...)`` without any wrapper.

A sharded checkpoint (``output.checkpoint_format`` sharded, ddp and fsdp) is written instead by
every rank through ``torch.distributed.checkpoint`` (:mod:`trainer_pkg.sharded_checkpoint`), from the
same parameter names. Before wrapping, :func:`make_strategy` applies the large-model settings to the
plain model in torchtitan's order: :func:`maybe_apply_ac`, :func:`maybe_apply_compile`, then
``fully_shard`` with FSDP2's mixed precision and offload policies (docs/large-models.md).

Parameters that get no gradient (an auxiliary head switched off): DDP is built with
``find_unused_parameters=False`` (no graph search each step). If a parameter gets no gradient in the
first step, the run stops with a message naming it and the flag to set,
``train.find_unused_parameters``, with which DDP searches the graph each step and the parameter is
left unchanged. FSDP and pipeline stages handle such parameters without a flag (their gradient stays
empty and the optimizer skips them).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_pkg.config import ConfigError, JobConfig, plural
from trainer_pkg.models import pipeline_units, sequential_layers
from trainer_pkg.registry import CUSTOM
from trainer_pkg.world_shape import pipeline_stage_count, shape_errors

_DDP_PARAMETERS = frozenset(inspect.signature(DDP.__init__).parameters)

EVAL_BATCH_SIZE = 512
EVAL_BATCH_TOKENS = 16_384
"""A language model's evaluation batch, in tokens: its logits are (windows, T, V), so 512 windows of
GPT-2's 1,024 tokens would be 105 GB of fp32 logits; 16 windows of 1,024 are 3.3 GB."""


class StrategyError(Exception):
    """A model, shape or state that the chosen strategy cannot run; the message says what to change."""


# -- optimizer state keyed by parameter name ---------------------------------------------------------


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter indices replaced by names.

    ``names[i]`` is the model-level name of the i-th parameter the optimizer was given (over all its
    groups, in order). Tensors are moved to CPU. The result has the layout of
    ``get_optimizer_state_dict(..., full_state_dict=True)``.
    """
    sd = optimizer.state_dict()
    state = {names[i]: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in sd["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def optimizer_state_by_index(named: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_name` for an optimizer over ``names`` (one group).

    ``named`` may hold more parameters than ``names`` (a pipeline stage takes its own); an older
    checkpoint already keyed by index is returned as it is. Raises KeyError for a missing group.
    """
    groups = named.get("param_groups") or []
    if not groups or not groups[0].get("params") or not isinstance(groups[0]["params"][0], str):
        return named  # index-keyed (written before checkpoints named parameters)
    index = {n: i for i, n in enumerate(names)}
    state = {index[n]: s for n, s in named["state"].items() if n in index}
    group = {k: v for k, v in groups[0].items() if k != "params"}
    group["params"] = list(range(len(names)))
    return {"state": state, "param_groups": [group]}


def _merge_named_states(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One name-keyed optimizer state from the pipeline stages' parts (one group, params in order)."""
    state: dict[str, Any] = {}
    params: list[str] = []
    group: dict[str, Any] = {}
    for part in parts:
        state.update(part["state"])
        for g in part["param_groups"]:
            group = {k: v for k, v in g.items() if k != "params"}
            params += [p for p in g["params"] if p not in params]
    return {"state": state, "param_groups": [{**group, "params": params}]}


# -- stage splitting -----------------------------------------------------------------------------------


def balance_stages(weights: list[int], num_stages: int) -> list[int]:
    """Cut points splitting ``weights`` (parameters per unit) into ``num_stages`` consecutive,
    non-empty groups whose largest sum is as small as possible.

    Returns ``num_stages + 1`` indices ``[0, c1, ..., len(weights)]``; stage ``s`` takes units
    ``cuts[s]:cuts[s+1]``. Ties keep earlier stages smaller (the last stage also computes the loss).
    Raises StrategyError when there are fewer units than stages.
    """
    n = len(weights)
    if n < num_stages:
        raise StrategyError(f"{num_stages} pipeline stages need at least one layer each, but the model "
                            f"has {n}: use fewer stages or a deeper model")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: the smallest max-stage-sum splitting units[:i] into s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost <= best[s][i]:  # <=: the latest cut wins, so earlier stages stay small
                    best[s][i], cut[s][i] = cost, j
    cuts = [n]
    for s in range(num_stages, 0, -1):
        cuts.append(cut[s][cuts[-1]])
    return cuts[::-1]


class StageModule(nn.Module):
    """A consecutive slice of a model's layers; ``state_dict`` keys map back to the full model's."""

    def __init__(self, named_layers: list[tuple[str, nn.Module]]):
        super().__init__()
        self.layers = nn.ModuleList(m for _, m in named_layers)
        self.layer_names = [n for n, _ in named_layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def model_key(self, key: str) -> str:
        """``layers.3.weight`` → the full model's key, e.g. ``net.4.weight``."""
        _, index, rest = key.split(".", 2)
        return f"{self.layer_names[int(index)]}.{rest}"

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {self.model_key(k): v.detach().cpu() for k, v in self.state_dict().items()}

    def load_model_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        own = {k: full[self.model_key(k)] for k in self.state_dict()}
        self.load_state_dict(own)


# -- strategies ----------------------------------------------------------------------------------------


class BatchResult(NamedTuple):
    """What :meth:`Strategy.forward_backward` returns where a rank computes the loss."""

    logits: torch.Tensor  # (B, classes), or a language model's (B, T, vocab), detached
    loss: torch.Tensor  # () mean cross entropy over the batch (every token) in float32, detached: the
    #                     value the backward started from (before loss_scale), so metrics need no second loss


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The one loss of every strategy, in float32: cross entropy of classifier logits (B, classes)
    against labels (B,), or of a language model's logits (B, T, V) against next-token ids (B, T),
    every token counted alike (nats per token).

    ``reduction`` ``"mean"``: a 0-dim tensor, the mean over samples (tokens). ``"none"``: one value
    per sample, (B,): a language model's mean over that sample's T tokens (so the mean of these is
    the mean over every token; padding masks select whole samples)."""
    if logits.dim() == 3:
        b, t, v = logits.shape
        flat = F.cross_entropy(logits.float().reshape(b * t, v), y.reshape(b * t),
                               reduction="mean" if reduction == "mean" else "none")
        return flat if reduction == "mean" else flat.view(b, t).mean(1)
    return F.cross_entropy(logits.float(), y, reduction=reduction)


def correct(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per sample, (B,) float32: 1.0 where the classifier's top class is the label, 0.0 elsewhere; for a
    language model's (B, T, V) logits the share of the sample's T tokens whose top prediction is the
    next token (their sum over samples ÷ samples is the token accuracy)."""
    hits = logits.argmax(-1) == y
    return hits.float().mean(1) if hits.dim() == 2 else hits.float()


def loss_backward(logits: torch.Tensor, y: torch.Tensor, loss_scale: float) -> BatchResult:
    """Backward of ``cross_entropy(logits, y) × loss_scale`` (mean over the batch, every token of a
    language model's); returns the detached logits and mean loss. A scale of 1 is not multiplied at
    all (multiplying by 1.0 is exact). The fused mean reduction is the cheapest form: a per-sample
    loss, where a batch holds padding, is computed from the returned logits only for that batch."""
    loss = cross_entropy(logits, y)
    (loss * loss_scale if loss_scale != 1.0 else loss).backward()
    return BatchResult(logits.detach(), loss.detach())


def eval_batch_size(x: Any) -> int:
    """Samples per evaluation batch: :data:`EVAL_BATCH_SIZE`, or for a language model's (N, T) integer
    token windows as many as make :data:`EVAL_BATCH_TOKENS` tokens (at least 1)."""
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", ())
    if dtype is not None and not dtype.is_floating_point and len(shape) == 2:
        return max(1, EVAL_BATCH_TOKENS // max(1, int(shape[1])))
    return EVAL_BATCH_SIZE


class Strategy:
    """One rank's share of the model, and how a batch trains on it.

    The loop calls, per optimizer step: :meth:`forward_backward` for each accumulated batch (``sync``
    on the last), then :meth:`finish_gradients`, optionally :meth:`clip_grad_norm_`, then the
    optimizer. Methods marked *collective* must be called on every rank.
    """

    name = ""
    #: this rank's data shard: index and count of data-parallel replicas
    dp_rank: int = 0
    dp_size: int = 1
    #: False on ranks that never see logits (pipeline stages before the last)
    computes_loss: bool = True
    #: skip each epoch's incomplete last batch (pipeline: fixed activation shapes)
    drop_last_batch: bool = False

    #: True where the strategy computes in bf16 itself (FSDP2's mixed precision policy): no autocast
    casts_parameters: bool = False

    module: nn.Module  # the local, unwrapped module (the whole model, or a pipeline stage)
    _compute_s: float = 0.0

    def take_compute_seconds(self) -> float:
        """Seconds of compute (see the module docstring) in :meth:`forward_backward` since the last
        call: this rank's own forward and backward, without the time it waited for other ranks."""
        seconds, self._compute_s = self._compute_s, 0.0
        return seconds

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates on this rank."""
        return list(self.module.parameters())

    def parameter_names(self) -> list[str]:
        """Model-level names of :meth:`parameters`, in the same order."""
        return [n for n, _ in self.module.named_parameters()]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, loss_scale: float, sync: bool,
                         autocast: contextlib.AbstractContextManager) -> BatchResult | None:
        """Forward and backward of one batch; gradients accumulate (scaled by ``loss_scale``).

        Returns the logits (B, classes) and the mean loss (:class:`BatchResult`) where this
        rank computes the loss, else None. ``sync``:
        reduce gradients across data-parallel ranks after this backward (the last accumulated batch).
        """
        raise NotImplementedError

    def finish_gradients(self) -> None:
        """Collective: anything left to make every rank's gradients the global ones."""

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Collective: scale the gradients so their global L2 norm is at most ``max_norm``; returns
        the norm before clipping (over every parameter of the model, whichever rank holds it)."""
        params = [p for p in self.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                 autocast: contextlib.AbstractContextManager) -> tuple[float, float]:
        """Collective: (loss, accuracy) over the whole set; each data-parallel replica its shard.

        ``x`` (N, *sample shape) and ``y`` (N,) labels, or a language model's (N, T) windows and
        (N, T) next tokens: then loss is nats per token and accuracy the next-token accuracy."""
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
        n = len(y)
        order = torch.arange(self.dp_rank, math.ceil(n / self.dp_size) * self.dp_size, self.dp_size)
        keep_all = order < n  # DistributedSampler-style padding wraps around to the head
        order = torch.where(keep_all, order, order % n)
        self.module.eval()
        try:
            rows = eval_batch_size(x)
            for start in range(0, len(order), rows):
                idx, keep = order[start:start + rows], keep_all[start:start + rows].to(device)
                with autocast:
                    logits = self.eval_forward(x[idx].to(device))
                if logits is None:
                    continue
                yb = y[idx].to(device)
                loss = cross_entropy(logits, yb, reduction="none")
                sums[0] += loss[keep].sum().double()
                sums[1] += correct(logits, yb)[keep].sum().double()
                sums[2] += keep.sum().double()
        finally:
            self.module.train()
        dist.all_reduce(sums)
        count = max(sums[2].item(), 1.0)
        return sums[0].item() / count, sums[1].item() / count

    def eval_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.module(x)

    def sync_buffers(self) -> None:
        """Collective: rank 0's buffers (BatchNorm running statistics) on every replica, so
        evaluation and the checkpoint see one model."""
        for buf in self.module.buffers():
            dist.broadcast(buf, src=0)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's bare state dict on CPU on rank 0; None elsewhere."""
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()} if dist.get_rank() == 0 else None

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Collective: the optimizer state keyed by parameter name on rank 0; None elsewhere."""
        if dist.get_rank() != 0:
            return None
        return optimizer_state_by_name(optimizer, self.parameter_names())

    def load(self, model_state: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
             optimizer_state: dict[str, Any] | None) -> None:
        """Load a full model state dict (and optimizer state by name or, older files, by index)."""
        self.module.load_state_dict(model_state)
        if optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state_by_index(optimizer_state, self.parameter_names()))


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, model: nn.Module, device: torch.device, *, find_unused_parameters: bool = False):
        self.module = model
        self.find_unused = find_unused_parameters
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        # broadcast_buffers=False: a broadcast at every forward would be a collective before the
        # gradient sync, where a fast rank waits for a slow one inside its own "compute"; the
        # buffers (BatchNorm statistics) are broadcast where they are read instead (sync_buffers,
        # before evaluation and checkpoints), and rank 0's evolve from rank 0's batches either way.
        # torch 2.13 names the switch forward_sync_buffers (broadcast_buffers warns in every job's
        # log); the older torch of the clouds' images has broadcast_buffers only.
        no_forward_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_PARAMETERS
                           else {"broadcast_buffers": False})
        self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                       find_unused_parameters=find_unused_parameters, **no_forward_sync)
        self._checked_unused = False
        self._grads_ready = 0.0
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param: nn.Parameter) -> None:
        # The last of these in a backward is when this rank's gradients are all computed: from then
        # on it only waits for the all-reduce (and the ranks behind it).
        self._grads_ready = time.perf_counter()

    def forward_backward(self, x, y, *, loss_scale, sync, autocast):
        start = self._grads_ready = time.perf_counter()
        context = contextlib.nullcontext() if sync else self.ddp.no_sync()
        with context:
            with autocast:
                logits = self.ddp(x)
            out = loss_backward(logits, y, loss_scale)
        end = self._grads_ready if sync and self._grads_ready > start else time.perf_counter()
        self._compute_s += end - start
        if sync and not self._checked_unused:
            self._checked_unused = True
            self._check_unused()
        return out

    def _check_unused(self) -> None:
        if self.find_unused:
            return
        unused = [n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
            raise StrategyError(
                f"parameters got no gradient in the first step: {shown}. DDP must be told to expect "
                f"that: set train.find_unused_parameters to true (--find-unused-parameters; DDP then "
                f"searches the graph every step and leaves them unchanged), or remove them from the model")


def fsdp_units(model: nn.Module, shard_classes: list[str], *, custom: bool) -> list[nn.Module]:
    """The submodules of ``model`` that each get their own ``fully_shard`` before the root, in an
    order that shards every module before any module containing it (FSDP2 needs that).

    ``shard_classes`` (``model.shard_classes``) non-empty: every submodule whose class name
    (``type(m).__name__``) is listed, e.g. ``["Block"]``. Empty: each layer of a built-in model
    (:func:`trainer_pkg.models.sequential_layers`), each top-level child of a ``custom`` one (the
    items of a top-level ``nn.ModuleList`` or ``nn.ModuleDict``, which has no forward to shard around).

    A built-in model may name its own default (``default_shard_classes``: ``gpt`` shards each
    ``Block``, keeping the tied embedding and output weight in the root's unit).

    Raises :class:`StrategyError` for a listed name no submodule has, listing the class names the
    model has.
    """
    if not shard_classes:
        shard_classes = list(getattr(model, "default_shard_classes", ()))  # gpt: each Block
    if not shard_classes:
        if custom:
            # A ModuleList or ModuleDict has no forward of its own for FSDP's hooks: its items are the units.
            return [item for _, m in model.named_children()
                    for item in (m.children() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) else [m])]
        return [m for _, m in sequential_layers(model)]
    below_root = list(model.modules())[1:]
    present = {type(m).__name__ for m in model.modules()}  # the root's own class: sharded last anyway
    unknown = [c for c in shard_classes if c not in present]
    if unknown:
        raise StrategyError(
            f"model.shard_classes: no submodule of class {', '.join(map(repr, unknown))} in "
            f"{type(model).__name__}; its modules' classes are {', '.join(sorted(present))}")
    wanted = set(shard_classes)
    # modules() lists a module before its descendants, so the reverse shards the innermost first.
    return [m for m in reversed(below_root) if type(m).__name__ in wanted]


class FSDPStrategy(Strategy):
    name = "fsdp"

    def __init__(self, model: nn.Module, device: torch.device, units: list[nn.Module] | None = None, *,
                 bf16: bool = False, cpu_offload: bool = False):
        """``units``: the submodules sharded one ``fully_shard`` each before the root
        (:func:`fsdp_units`; default: each of :func:`trainer_pkg.models.sequential_layers`).

        ``bf16`` (``train.precision`` bf16): every ``fully_shard`` gets FSDP2's
        ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the fp32 shards are
        all-gathered as bf16, forward and backward compute in bf16, gradients are reduce-scattered
        in fp32 into fp32 gradient shards and the optimizer steps the fp32 shards (no autocast:
        :attr:`casts_parameters`). ``cpu_offload`` (``parallel.cpu_offload``): ``CPUOffloadPolicy``,
        the shards, their gradients and the optimizer state live in CPU memory and are copied to the
        device for each unit's forward and backward (pinned memory on a GPU)."""
        if units is None:
            units = [m for _, m in sequential_layers(model)]
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(device.type, (self.dp_size,))
        self._blocked_s = 0.0
        self.reduce_scatters = 0
        """Gradient reduce-scatters run so far (one per sharded unit with gradients per synced step)."""
        self.casts_parameters = bf16
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
                  else MixedPrecisionPolicy())
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
        self.cpu_offload = cpu_offload
        sharded = []
        for layer in units:
            if any(p.requires_grad for p in layer.parameters()):
                sharded.append(layer)
        # Named before fully_shard, which swaps each module's class for an FSDP subclass (FSDPBlock).
        self.unit_classes = sorted({type(m).__name__ for m in sharded})
        """Class names of the submodules sharded on their own (before the root), for the run's log."""
        self.unit_count = len(sharded)
        for layer in sharded:
            fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
        self.module = model
        for m in sharded + [model]:
            m.set_custom_all_gather(_TimedAllGather(self))
            m.set_custom_reduce_scatter(_TimedReduceScatter(self))

    def forward_backward(self, x, y, *, loss_scale, sync, autocast):
        # Accumulating batches keep their gradients unsharded and unreduced: one reduce-scatter per step.
        self.module.set_requires_gradient_sync(sync)
        start, blocked = time.perf_counter(), self._blocked_s
        with autocast:
            logits = self.module(x)
        out = loss_backward(logits, y, loss_scale)
        self._compute_s += time.perf_counter() - start - (self._blocked_s - blocked)
        return out

    def clip_grad_norm_(self, max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        params = [p for p in self.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(total, DTensor):
            total = total.full_tensor()  # the shards' norms combined: the global norm on every rank
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    def full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if dist.get_rank() == 0 else None

    def full_optimizer_state(self, optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(self.module, optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return osd if dist.get_rank() == 0 else None

    def load(self, model_state, optimizer, optimizer_state):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.module, model_state, options=options)
        if optimizer_state is not None:
            groups = optimizer_state.get("param_groups") or [{}]
            if groups[0].get("params") and not isinstance(groups[0]["params"][0], str):
                raise StrategyError("this checkpoint's optimizer state is keyed by parameter index (an "
                                    "older ddp checkpoint): resume it with strategy ddp once, or delete it")
            set_optimizer_state_dict(self.module, optimizer, optimizer_state, options=options)


class _TimedAllGather:
    """FSDP's all-gather (``all_gather_single``, as its default comm), run to completion here so the
    time this rank is blocked in it (waiting for the others, then the transfer) is known.

    Synchronous is what FSDP2 does on CPU anyway (``unshard`` defaults to ``async_op=False``); FSDP
    waits on a returned Work only when there is one."""

    def __init__(self, owner: "FSDPStrategy") -> None:
        self.owner = owner

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        start = time.perf_counter()
        dist.all_gather_single(output_tensor, input_tensor, group=group)
        self.owner._blocked_s += time.perf_counter() - start


class _TimedReduceScatter(_TimedAllGather):
    """FSDP's gradient reduce-scatter (``reduce_scatter_single``), timed like :class:`_TimedAllGather`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        start = time.perf_counter()
        dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op)
        self.owner._blocked_s += time.perf_counter() - start
        self.owner.reduce_scatters += 1


def _timed_stage_class():
    """A ``PipelineStage`` whose own forward and backward of each micro-batch are timed (the
    schedule receives activations and gradients outside these calls)."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        compute_s = 0.0

        def forward_one_chunk(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super().forward_one_chunk(*args, **kwargs)
            finally:
                self.compute_s += time.perf_counter() - start

        def backward_one_chunk(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super().backward_one_chunk(*args, **kwargs)
            finally:
                self.compute_s += time.perf_counter() - start

    return TimedStage


class PipelineStrategy(Strategy):
    name = "pipeline"
    drop_last_batch = True

    def __init__(self, model: nn.Module, device: torch.device, *, num_stages: int, microbatches: int,
                 schedule: str):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        world, rank = dist.get_world_size(), dist.get_rank()
        self.num_stages = num_stages
        self.stage_index, self.dp_rank = rank % num_stages, rank // num_stages
        self.dp_size = world // num_stages
        self.device = device
        # Every rank creates every group, in the same order (new_group is collective).
        self.pp_group, self.dp_group = dist.group.WORLD, None
        for r in range(self.dp_size):
            ranks = [r * num_stages + s for s in range(num_stages)]
            g = dist.new_group(ranks) if self.dp_size > 1 else dist.group.WORLD
            if rank in ranks:
                self.pp_group, self.pp_ranks = g, ranks
        if self.dp_size > 1:
            for s in range(num_stages):
                ranks = [r * num_stages + s for r in range(self.dp_size)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.dp_group, self.dp_ranks = g, ranks

        units = pipeline_units(sequential_layers(model))
        cuts = balance_stages([sum(p.numel() for _, m in u for p in m.parameters()) for u in units], num_stages)
        self.stage_sizes = [sum(len(u) for u in units[cuts[s]:cuts[s + 1]]) for s in range(num_stages)]
        mine = [layer for u in units[cuts[self.stage_index]:cuts[self.stage_index + 1]] for layer in u]
        self.module = StageModule(mine).to(device)
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == num_stages - 1
        self.computes_loss = self.is_last
        self.layer_count = len(units)

        self._loss_scale = 1.0
        self._stage = _timed_stage_class()(self.module, self.stage_index, num_stages, device, group=self.pp_group)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        # scale_grads=False: the loss function already divides by micro-batches × accumulated batches,
        # so gradients accumulate across schedule steps unchanged.
        self._schedule = cls(self._stage, microbatches, loss_fn=self._loss, scale_grads=False)
        self.microbatches = microbatches

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target) * self._loss_scale

    def parameter_names(self) -> list[str]:
        return [self.module.model_key(n) for n, _ in self.module.named_parameters()]

    def take_compute_seconds(self) -> float:
        seconds, self._stage.compute_s = self._stage.compute_s, 0.0
        return seconds

    def forward_backward(self, x, y, *, loss_scale, sync, autocast):
        self._loss_scale = loss_scale / self.microbatches
        with autocast:
            if self.is_first and self.is_last:
                logits = self._schedule.step(x, target=y)
            elif self.is_first:
                self._schedule.step(x)
                return None
            elif self.is_last:
                logits = self._schedule.step(target=y)
            else:
                self._schedule.step()
                return None
        # The schedule back-propagates each micro-batch's mean inside its loss_fn; the loss for the
        # metrics comes from the merged logits of the whole batch.
        with torch.no_grad():
            logits = logits.detach()
            return BatchResult(logits, cross_entropy(logits, y))

    def finish_gradients(self) -> None:
        if self.dp_group is None:
            return
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.dp_group)
            p.grad.div_(self.dp_size)

    def clip_grad_norm_(self, max_norm: float) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq, group=self.pp_group)  # the stages' shares of one pipeline's model
        total = sq.sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    def eval_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Forward only, stage to stage by point-to-point sends (a shape header first, since the
        evaluation batches differ in size from the training micro-batches)."""
        if not self.is_first:
            header = torch.zeros(8, dtype=torch.int64)
            dist.recv(header, src=self.pp_ranks[self.stage_index - 1])
            x = torch.empty(header[1:1 + int(header[0])].tolist(), dtype=torch.float32)
            dist.recv(x, src=self.pp_ranks[self.stage_index - 1])
            x = x.to(self.device)
        out = self.module(x)
        if self.is_last:
            return out
        out = out.float().cpu().contiguous()  # gloo and nccl alike: a CPU staging copy keeps this simple
        header = torch.zeros(8, dtype=torch.int64)
        header[0] = out.dim()
        header[1:1 + out.dim()] = torch.tensor(out.shape)
        dist.send(header, dst=self.pp_ranks[self.stage_index + 1])
        dist.send(out, dst=self.pp_ranks[self.stage_index + 1])
        return None

    def sync_buffers(self) -> None:
        if self.dp_group is None:
            return
        for buf in self.module.buffers():
            dist.broadcast(buf, src=self.dp_ranks[0], group=self.dp_group)

    def full_state_dict(self):
        parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        mine = self.module.model_state_dict() if self.dp_rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return None
        full: dict[str, torch.Tensor] = {}
        for part in parts[: self.num_stages]:
            full.update(part)
        return full

    def full_optimizer_state(self, optimizer):
        parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        mine = optimizer_state_by_name(optimizer, self.parameter_names()) if self.dp_rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        return _merge_named_states(parts[: self.num_stages]) if dist.get_rank() == 0 else None

    def load(self, model_state, optimizer, optimizer_state):
        self.module.load_model_state_dict(model_state)
        if optimizer_state is not None:
            groups = optimizer_state.get("param_groups") or [{}]
            if groups[0].get("params") and not isinstance(groups[0]["params"][0], str):
                raise StrategyError("this checkpoint's optimizer state is keyed by parameter index (an "
                                    "older ddp checkpoint): resume it with strategy ddp once, or delete it")
            optimizer.load_state_dict(optimizer_state_by_index(optimizer_state, self.parameter_names()))


# -- large-model features applied to the plain model before it is wrapped (torchtitan's order:
# activation checkpointing, then compile, then fully_shard) ------------------------------------------


def _checkpointed(forward: Any) -> Any:
    """``forward`` run under non-reentrant ``torch.utils.checkpoint``: the activations it would save
    for backward are dropped and recomputed when backward reaches them; only its inputs are kept."""
    from torch.utils.checkpoint import checkpoint

    from trainer_pkg.memory import note_checkpoint_inputs

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        note_checkpoint_inputs(args)  # what the checkpoint keeps, for the measured activation bytes
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def maybe_apply_ac(units: list[nn.Module], enabled: bool) -> None:
    """``parallel.activation_checkpointing``: each unit's forward (each sharded unit of
    :func:`fsdp_units`: each ``Block`` of gpt, each layer with weights of a built-in model) runs
    under non-reentrant ``torch.utils.checkpoint``; nothing when off.

    The forward is replaced on the instance instead of wrapping the module in ``checkpoint_wrapper``,
    so parameter names, state dicts and checkpoints stay those of the plain model. A unit that
    saves no more than its input (a lone ``Linear``) saves nothing by it: a block of several layers
    does. Recomputation runs the forward twice: a BatchNorm inside a unit updates its running
    statistics twice per step."""
    if not enabled:
        return
    for unit in units:
        unit.forward = _checkpointed(unit.forward)


def maybe_apply_compile(model: nn.Module, units: list[nn.Module], enabled: bool) -> None:
    """``train.compile``: ``torch.compile`` each of ``units`` (FSDP: each sharded unit, as torchtitan
    compiles each transformer block, so FSDP's all-gathers between units stay outside the compiled
    graphs) or, with no units (DDP), the whole model; nothing when off.

    The instance's ``forward`` is compiled (module hooks, FSDP's among them, run outside it) and the
    module is not replaced, so names and state dicts are unchanged. The first steps compile (seconds
    to minutes); on CPU that needs a C++ compiler (inductor)."""
    if not enabled:
        return
    for m in units or [model]:
        m.forward = torch.compile(m.forward)


def make_strategy(cfg: JobConfig, model: nn.Module, device: torch.device) -> Strategy:
    """Collective: place ``model`` (built identically on every rank) for ``cfg.parallel.strategy``.

    Raises StrategyError for a shape the strategy cannot run on the current process group, with the
    arithmetic (the launcher's world size may differ from the config's nodes × processes), for fewer
    layers than pipeline stages (a custom model's are counted here, once built), and for a
    ``model.shard_classes`` name the model has no submodule of; ConfigError for a model a pipeline
    cannot split (:func:`trainer_pkg.models.sequential_layers`).
    """
    world = dist.get_world_size()
    errs = shape_errors(cfg, world_size=world, world_desc=f"the launcher started {world} rank(s)")
    if errs:
        raise StrategyError("; ".join(f"{k}: {v}" for k, v in errs.items()))
    p = cfg.parallel
    units: list[nn.Module] = []
    if p.strategy == "fsdp" or (p.strategy == "ddp" and p.activation_checkpointing):
        # DDP checkpoints the units FSDP would shard (model.shard_classes, e.g. each Block)
        units = fsdp_units(model, cfg.model.shard_classes, custom=cfg.model.arch == CUSTOM)
        units = [u for u in units if any(q.requires_grad for q in u.parameters())]
    if p.strategy in ("ddp", "fsdp"):
        maybe_apply_ac(units, p.activation_checkpointing)
        maybe_apply_compile(model, units if p.strategy == "fsdp" else [], cfg.train.compile)
    if p.strategy == "ddp":
        return DDPStrategy(model, device, find_unused_parameters=cfg.train.find_unused_parameters)
    if p.strategy == "fsdp":
        return FSDPStrategy(model, device, units, bf16=cfg.train.precision == "bf16", cpu_offload=p.cpu_offload)
    if p.strategy == "pipeline":
        stages = pipeline_stage_count(p, world)
        units = pipeline_units(sequential_layers(model))
        if len(units) < stages:
            raise StrategyError(f"the model has {plural(len(units), 'layer', 'layers')}; {stages} pipeline stages "
                                f"need at least {stages}: use fewer stages (parallel.pipeline_stages) or a deeper model")
        return PipelineStrategy(model, device, num_stages=stages, microbatches=p.microbatches,
                                schedule=p.pipeline_schedule)
    raise ConfigError(f"parallel.strategy: unknown strategy {p.strategy!r}")  # a schema bug


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to bfloat16 for ``precision == "bf16"``, a no-op for fp32.

    Raises StrategyError where the device cannot run bf16 (a CUDA GPU without bf16, e.g. pre-Ampere).
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        raise StrategyError(f"train.precision bf16: autocast is not available on {device.type}; use fp32")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise StrategyError(f"train.precision bf16: {torch.cuda.get_device_name(device)} does not support "
                            "bfloat16; use fp32")
    return torch.autocast(device.type, dtype=torch.bfloat16)
