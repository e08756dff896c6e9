"""The memory plan: how many bytes each rank of a job needs, computed before launch, without torch.

The dashboard calls :func:`plan` when a job is created (and for the job form's estimate) to show the
peak memory per rank against the device's memory, with the arithmetic, and to refuse a job that
cannot fit. Pure arithmetic over the config and the model registry's parameters: torch-free, as the
web process has no torch. The formulas are written out in docs/large-models.md ("The memory plan").

Per rank, the plan counts:

* **parameters, gradients, optimizer state** — :func:`parameter_count` parameters; gradients of the
  same dtype as the parameters a rank holds; the optimizer's fp32 state per parameter: SGD with
  momentum one copy (none without momentum), AdamW two (``exp_avg``, ``exp_avg_sq``). DDP and
  pipeline replicas hold them whole (a pipeline rank: its stage's); FSDP holds 1/W of each.
* **activations** — the tensors the forward pass saves for backward, for this rank's batch
  (``train.batch_size`` samples; a pipeline stage: its micro-batches in flight). For ``gpt``, per
  transformer block, the per-layer formula of Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv:2205.05198, §4.1, eq. 1 without tensor
  parallelism): ``s·b·h·(34 + 5·a·s/h)`` bytes at 16 bits, where the ``5·a·s/h`` term is the
  attention matrix, which flash / SDPA attention never stores (it keeps the ``a·s·b`` log-sum-exp
  instead). Not counted: with ``dropout`` > 0 on CPU, SDPA falls back to its math kernel, which
  does store the attention matrix and its dropout mask (about 19 bytes per ``a·s²·b`` element).
  What PyTorch saves per block, each storage once, in elements of ``s·b·h``: the inputs of both
  LayerNorms (2), of ``c_attn`` (1), q, k, v (3, views of one tensor), the attention output, which
  is also ``c_proj``'s input (1: SDPA lays it out (B, T, H, D), so the transpose back is no copy),
  then the MLP's ``c_fc`` input (1), GELU input (4) and ``c_proj`` input (4): 16, plus a 1-byte
  dropout mask for each of the two residual dropouts when ``dropout`` > 0 — Korthikanti's 34 bytes
  at 16 bits = 2 × 16 + 2 (tests/trainer_pkg/test_memory_plan.py holds the sum to 1 % of what
  autograd saves). With
  activation checkpointing a block keeps only its input (1 element of ``s·b·h``) and one block's
  whole set is live again while it is recomputed: ``L·s·b·h`` saved, plus 1 block under buffers.
  Outside the blocks: the token ids, the final LayerNorm's input, the head's input, and — a large
  term for small models — the logits ``b·s·V`` and their log-softmax ``b·s·V`` (saved for the loss's
  backward), whose gradient ``b·s·V`` is allocated at the start of backward.
* **buffers** — what lives on the device besides the saved activations: the model's buffers
  (BatchNorm running statistics), the batch itself, DDP's gradient buckets (a second copy of the
  gradients: ``gradient_as_bucket_view`` is off), the logits and their gradients, the block being
  recomputed under activation checkpointing, and under FSDP
  the unsharded parameters of the units being run: the root's own parameters (kept gathered from
  forward to backward) plus two of the largest sharded units (the one running and the one
  prefetched), and one unit's unsharded gradients before their reduce-scatter.

Precision: ``fp32`` counts 4 bytes everywhere. ``bf16`` under DDP and pipeline is autocast: the
parameters, gradients and optimizer stay fp32; activations are 2 bytes, except what autocast runs in
fp32 (LayerNorm inputs, the log-softmax and its gradient), and the bf16 copies of every weight a
matmul used are saved for backward (2 bytes per matmul parameter). Under FSDP, ``bf16`` is FSDP2's
mixed precision: an fp32 master shard (4 bytes per parameter / W), fp32 gradient shards (fp32
reduction), bf16 unsharded units (2 bytes), and with no autocast the LayerNorms save bf16 inputs: only
the loss's log-softmax of the fp32 logits stays 4 bytes. ``parallel.cpu_offload`` keeps the parameter, gradient
and optimizer shards in host memory (:attr:`MemoryPlan.host_bytes`): the device holds the units being
run, the activations and the batch. On a machine without GPUs (``device_unit`` ``"rank"``) the host's
memory is the ranks' own, so what is offloaded still counts toward :attr:`MemoryPlan.needed_bytes`.

Usage::

    from trainer_pkg.memory_plan import parameter_count, plan
    parameter_count("gpt", {"layers": 12, "heads": 12, "embed_dim": 768, "context_length": 1024},
                    (1024,), 50257)                                  # 124,439,808
    p = plan(cfg, input_shape=(1024,), num_classes=50257, world_size=8, device_bytes=24 * 2**30)
    p.fits, p.needed_bytes, p.lines, p.suggestion
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from trainer_pkg.config import JobConfig, plural
from trainer_pkg.registry import ARCHITECTURES, CUSTOM, validate_model_params

GIB = 2**30
MIB = 2**20

GPT_DEFAULTS: dict[str, Any] = {"layers": 4, "heads": 4, "embed_dim": 128, "context_length": 128,
                                "dropout": 0.0, "tied_embeddings": True, "bias": True}
"""The ``gpt`` model's parameters and defaults (the shared contract of issue 14); the registry's
own ParamSpecs win once ``gpt`` is registered."""

OPTIMIZER_STATES = {"sgd": 1, "adamw": 2}
"""fp32 copies of each parameter the optimizer keeps: SGD's momentum buffer, AdamW's two moments."""

EVAL_BATCH_SIZE = 512
EVAL_BATCH_TOKENS = 16_384
"""Samples, and a language model's tokens, per evaluation batch: ``trainer_pkg.parallel``'s figures
(that module imports torch)."""

MAX_FSDP_RANKS = 1024
"""The largest FSDP world size a suggestion considers."""


class PlanError(ValueError):
    """The plan cannot be computed: a custom model (its structure is known only once built), or an
    architecture with parameters the registry refuses."""


# =============================================================================================
# Parameter counts
# =============================================================================================


@dataclasses.dataclass(frozen=True)
class Unit:
    """One piece of a model as the strategies cut it: a pipeline unit (what a stage boundary may
    fall between) and, for FSDP, what one ``fully_shard`` gathers at a time."""

    name: str
    params: int
    """Parameters of the unit."""
    matmul_params: int = 0
    """Of those, the weights of Linear / Conv layers (autocast keeps bf16 copies of them)."""
    buffers_bytes: int = 0
    """Bytes of its buffers (BatchNorm running mean and variance, fp32, and the int64 step count)."""
    act_elems: int = 0
    """Elements it saves for backward per sample (fp32 or bf16 by precision)."""
    act_fixed_bytes: int = 0
    """Bytes per sample it saves whatever the precision (int64 indices, 1-byte dropout masks, fp32
    statistics)."""
    act_fp32_elems: int = 0
    """Elements per sample it saves in fp32 even under bf16 autocast (LayerNorm inputs, log-softmax)."""
    loss_fp32_elems: int = 0
    """Of those, what stays fp32 under FSDP's bf16 mixed precision too, where no autocast runs the
    LayerNorms in fp32: the loss's log-softmax of the fp32 logits."""


def _arch_params(arch: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    if arch == CUSTOM:
        raise PlanError("a custom model's structure is known only once its entry point builds it: no memory plan")
    if arch == "gpt" and arch not in ARCHITECTURES:
        return {**GPT_DEFAULTS, **dict(params or {})}
    try:
        return validate_model_params(arch, params)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


_TARGET_BYTES = 8
"""Per sample, the int64 target the loss saves (its log-softmax is counted with the last layer)."""


def _bn(c: int) -> tuple[int, int]:
    """(parameters, buffer bytes) of a BatchNorm over ``c`` channels."""
    return 2 * c, 2 * c * 4 + 8


def model_units(arch: str, params: Mapping[str, Any] | None, input_shape: Sequence[int],
                num_classes: int) -> list[Unit]:
    """The model as a list of :class:`Unit` in execution order, as ``trainer_pkg.models`` builds it:
    the pipeline units of :func:`trainer_pkg.models.pipeline_units` (for ``gpt``: the embedding, each
    Block, the head), with per-sample activation elements.

    ``input_shape``: one sample without the batch dimension ((C, H, W), (F,), or (seq_len,) for
    ``gpt``); ``num_classes``: classes, or the vocabulary size for ``gpt``. Raises :class:`PlanError`
    for ``custom``, for parameters the registry refuses and for samples the architecture cannot take.
    """
    p = _arch_params(arch, params)
    shape = [int(s) for s in input_shape]
    if arch in ("cnn", "resnet") and len(shape) != 3:
        raise PlanError(f"{arch} takes images (C, H, W), not samples of shape {tuple(shape)}: no memory plan")
    if arch == "gpt" and len(shape) != 1:
        raise PlanError(f"gpt takes windows of token ids (T,), not samples of shape {tuple(shape)}: no memory plan")
    if arch == "mlp":
        width, units = math.prod(shape), []
        h, dropout = p["hidden_size"], p["dropout"] > 0
        for i in range(p["num_layers"]):
            n = _linear(width, h)
            # The first Linear saves the input; each in-place ReLU its output (the next Linear's input);
            # a dropout > 0 its 1-byte mask and a new output.
            units.append(Unit(f"net.{3 * i + 1}", n, n, act_elems=(width if i == 0 else 0) + h * (2 if dropout else 1),
                              act_fixed_bytes=h if dropout else 0))
            width = h
        n = _linear(width, num_classes)
        return units + [Unit(f"net.{3 * p['num_layers'] + 1}", n, n, act_elems=(width if not units else 0) + num_classes,
                             act_fixed_bytes=_TARGET_BYTES)]
    if arch == "cnn":
        return _cnn_units(p, shape, num_classes)
    if arch == "resnet":
        return _resnet_units(p, shape, num_classes)
    if arch == "gpt":
        return _gpt_units(p, shape, num_classes)
    raise PlanError(f"model.arch: no memory plan for {arch!r}")  # a registry entry without formulas


def _cnn_units(p: Mapping[str, Any], shape: list[int], num_classes: int) -> list[Unit]:
    c_in, h, w = shape
    units = []
    for i in range(p["num_blocks"]):
        c_out = p["channels"] * 2**i
        fixed = 0
        if i > 0:  # max-pool (ceil mode) between blocks: its input is the ReLU's output; it adds int64 indices
            h, w = -(-h // 2), -(-w // 2)
            fixed += c_in * h * w * 8
        conv = c_in * c_out * 9
        bn_params, bn_buffers = _bn(c_out)
        # the conv's input (the image, or the pool's output), the BatchNorm's input, the in-place ReLU's
        # output; BatchNorm's batch mean and inverse std (fp32)
        units.append(Unit(f"features.{i}", conv + bn_params, conv, bn_buffers, act_elems=c_in * h * w + 2 * c_out * h * w,
                          act_fixed_bytes=fixed + 2 * c_out * 4))
        c_in = c_out
    hidden = _linear(c_in * 4, p["hidden_size"])
    head = _linear(p["hidden_size"], num_classes)
    dropout = p["dropout"] > 0
    return units + [
        # the 2×2 pool's output (the hidden Linear's input), the ReLU's output, a dropout's mask and output
        Unit("head.1", hidden, hidden, act_elems=c_in * 4 + p["hidden_size"] * (2 if dropout else 1),
             act_fixed_bytes=p["hidden_size"] if dropout else 0),
        Unit("head.4", head, head, act_elems=num_classes, act_fixed_bytes=_TARGET_BYTES),
    ]


def _resnet_units(p: Mapping[str, Any], shape: list[int], num_classes: int) -> list[Unit]:
    c_in, h, w = shape
    width = p["width"]
    bn_params, bn_buffers = _bn(width)
    units = [Unit("stem.0", c_in * width * 9 + bn_params, c_in * width * 9, bn_buffers,
                  act_elems=c_in * h * w + 2 * width * h * w, act_fixed_bytes=2 * width * 4)]
    c_in = width
    for stage in range(p["num_stages"]):
        c_out = width * 2**stage
        for b in range(p["blocks_per_stage"]):
            stride = 2 if stage > 0 and b == 0 else 1
            h_out, w_out = -(-h // stride), -(-w // stride)
            out_hw = h_out * w_out
            bn1, bn1_buf = _bn(c_out)
            matmul = c_in * c_out * 9 + c_out * c_out * 9
            params, buffers = matmul + 2 * bn1, 2 * bn1_buf
            # bn1 input, relu output (conv2's input), bn2 input, the final ReLU's output (the block's
            # input is the previous ReLU's output, counted there)
            acts = 4 * c_out * out_hw
            fixed = 4 * c_out * 4
            if stride != 1 or c_in != c_out:  # 1×1 projection shortcut with its BatchNorm
                matmul += c_in * c_out
                params += c_in * c_out + bn1
                buffers += bn1_buf
                acts += c_out * out_hw  # the shortcut's BatchNorm input (its conv shares x)
                fixed += 2 * c_out * 4
            units.append(Unit(f"stages.{len(units) - 1}", params, matmul, buffers, act_elems=acts,
                              act_fixed_bytes=fixed))
            c_in, h, w = c_out, h_out, w_out
    head = _linear(c_in, num_classes)
    # the pooled features (the Linear's input), the log-softmax
    return units + [Unit("head.2", head, head, act_elems=c_in + num_classes, act_fixed_bytes=_TARGET_BYTES)]


def _gpt_units(p: Mapping[str, Any], shape: list[int], vocab: int) -> list[Unit]:
    c, t_ctx, layers, bias = p["embed_dim"], p["context_length"], p["layers"], p["bias"]
    s = shape[0] if shape else t_ctx
    embedding = vocab * c + t_ctx * c
    masks = 2 * s * c if p["dropout"] > 0 else 0  # one byte per element: the two residual dropouts
    block = 12 * c * c + 2 * c + (11 * c if bias else 0)
    units = [Unit("embedding", embedding, 0, act_fixed_bytes=s * 8 + (s * c if p["dropout"] > 0 else 0))]
    heads = p["heads"]
    for i in range(layers):
        units.append(Unit(f"blocks.{i}", block, 12 * c * c,
                          # ln_1, c_attn, q/k/v, attention output, c_proj, ln_2, c_fc, GELU, mlp c_proj
                          act_elems=16 * s * c,
                          act_fp32_elems=2 * s * c,  # the two LayerNorm inputs (fp32 under autocast)
                          # LayerNorm mean and rstd (fp32), SDPA's log-sum-exp (fp32), dropout masks
                          act_fixed_bytes=2 * 2 * s * 4 + heads * s * 4 + masks))
    head = c + (c if bias else 0) + (0 if p["tied_embeddings"] else vocab * c)
    # ln_f input (fp32 under autocast), lm_head input, the log-softmax the loss saves (fp32 under autocast)
    units.append(Unit("head", head, vocab * c, act_elems=2 * s * c + s * vocab, act_fp32_elems=s * c + s * vocab,
                      loss_fp32_elems=s * vocab,
                      act_fixed_bytes=2 * s * 4 + s * 8))
    return units


def parameter_count(arch: str, params: Mapping[str, Any] | None, input_shape: Sequence[int],
                    num_classes: int) -> int:
    """Trainable parameters of the built-in model ``arch`` with ``params`` (defaults filled in by the
    registry) for samples of ``input_shape`` and ``num_classes`` classes (``gpt``: the vocabulary
    size; tied embeddings count once), as ``sum(p.numel() for p in build_model(...).parameters())``.

    GPT-2 124M (``layers`` 12, ``heads`` 12, ``embed_dim`` 768, ``context_length`` 1024, vocabulary
    50257, tied) is 124,439,808. Raises :class:`PlanError` for ``custom`` and invalid params.
    """
    return sum(u.params for u in model_units(arch, params, input_shape, num_classes))


# =============================================================================================
# The plan
# =============================================================================================


@dataclasses.dataclass
class MemoryPlan:
    """Estimated peak memory of the busiest rank, by term (bytes), with the arithmetic."""

    strategy: str
    world_size: int
    parameters: int
    """Parameters of the whole model."""
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    """Saved for backward, at the peak (end of forward) on the busiest rank."""
    buffers_bytes: int
    """Model buffers, the batch, FSDP's unsharded units, the loss's gradient workspace."""
    evaluation_bytes: int = 0
    """What each epoch's evaluation (no gradients) holds beside the parameters, gradients and
    optimizer state: the model's buffers, DDP's buckets or FSDP's unsharded units, the largest layer's
    working set for an evaluation batch and, for ``gpt``, that batch's logits and log-softmax."""
    host_bytes: int = 0
    """Held in host memory instead (``parallel.cpu_offload``): the parameter, gradient and optimizer
    shards of :attr:`offloaded`."""
    offloaded: dict[str, int] = dataclasses.field(default_factory=dict)
    """With ``parallel.cpu_offload``: ``{"params_bytes", "grads_bytes", "optimizer_bytes"}`` that the
    device does not hold (the terms above are 0 then); their sum is :attr:`host_bytes`. {} otherwise."""
    device_bytes: int | None = None
    """Memory of one device (GPU), when known."""
    device_name: str = ""
    """What the device is, for messages ("ml.g5.xlarge's NVIDIA A10G")."""
    lines: list[str] = dataclasses.field(default_factory=list)
    """The arithmetic, one term per line, for people."""
    suggestion: str = ""
    """When the job does not fit: the smallest FSDP world (and/or activation checkpointing) that does."""
    device_unit: str = "GPU"
    """What :attr:`device_bytes` is the memory of: ``"GPU"``, or ``"rank"`` on a machine without GPUs
    whose host memory the ranks share (a GPU box's CPUs: ``GpuBoxBackend.host_memory``)."""

    @property
    def peak_bytes(self) -> int:
        """The estimated peak per rank: the state (parameters, gradients, optimizer) plus the larger of
        training's activations and buffers and evaluation's working set."""
        state = self.params_bytes + self.grads_bytes + self.optimizer_bytes
        return state + max(self.activations_bytes + self.buffers_bytes, self.evaluation_bytes)

    @property
    def needed_bytes(self) -> int:
        """What one device must hold: :attr:`peak_bytes`, plus :attr:`host_bytes` where the device is the
        host's memory (``device_unit`` ``"rank"``: a machine without GPUs, where offloading to the host
        moves nothing off it)."""
        return self.peak_bytes + (self.host_bytes if self.device_unit == "rank" else 0)

    @property
    def fits(self) -> bool | None:
        """Whether :attr:`needed_bytes` ≤ :attr:`device_bytes`; None when the device's memory is unknown."""
        return None if self.device_bytes is None else self.needed_bytes <= self.device_bytes

    @property
    def summary(self) -> str:
        """One sentence: "needs 41.2 GiB per GPU; ml.g5.xlarge has 24 GiB; FSDP across 8 ranks would
        need 7.9 GiB", or the peak against the device when it fits."""
        need = f"needs {gib(self.needed_bytes)} per {self.device_unit if self.device_bytes is not None else 'rank'}"
        if self.device_bytes is None:
            return f"{need} (no GPU memory known for this target: not checked)"
        has = f"{self.device_name or 'the device'} has {gib(self.device_bytes)}"
        if self.fits:
            return f"{need}; {has}"
        return f"{need}; {has}" + (f"; {self.suggestion}" if self.suggestion else "")

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (the API's ``memory_plan``), byte figures as integers."""
        return {"strategy": self.strategy, "world_size": self.world_size, "parameters": self.parameters,
                "params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
                "optimizer_bytes": self.optimizer_bytes, "activations_bytes": self.activations_bytes,
                "buffers_bytes": self.buffers_bytes, "evaluation_bytes": self.evaluation_bytes,
                "host_bytes": self.host_bytes, "offloaded": dict(self.offloaded),
                "peak_bytes": self.peak_bytes, "needed_bytes": self.needed_bytes,
                "device_bytes": self.device_bytes, "device_name": self.device_name, "fits": self.fits,
                "lines": list(self.lines), "suggestion": self.suggestion, "summary": self.summary}


def gib(n: float) -> str:
    """Bytes for people: ``"41.2 GiB"``, ``"7.9 MiB"``, ``"512 B"``."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def _balance(weights: list[int], stages: int) -> list[list[int]]:
    """Indices of ``weights`` split into ``stages`` consecutive groups whose largest sum is smallest
    (the split :func:`trainer_pkg.parallel.balance_stages` makes; ties keep earlier stages smaller)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost <= best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    cuts = [n]
    for s in range(stages, 0, -1):
        cuts.append(cut[s][cuts[-1]])
    cuts = cuts[::-1]
    return [list(range(cuts[s], cuts[s + 1])) for s in range(stages)]


def _act_bytes(u: Unit, samples: float, bf16: bool, mixed: bool = False) -> float:
    """Bytes ``u`` saves for backward for ``samples`` samples: fp32, bf16 autocast (``bf16``), or
    FSDP's bf16 mixed precision (``bf16`` and ``mixed``: bf16 parameters, no autocast)."""
    low = 2 if bf16 else 4
    fp32 = (u.loss_fp32_elems if mixed else u.act_fp32_elems) if bf16 else 0
    return samples * ((u.act_elems - fp32) * low + fp32 * 4 + u.act_fixed_bytes)


def plan(cfg: JobConfig, *, input_shape: Sequence[int], num_classes: int, world_size: int | None = None,
         device_bytes: int | None = None, device_name: str = "", max_ranks: int | None = None,
         device_unit: str = "GPU") -> MemoryPlan:
    """The memory plan of ``cfg`` on ``world_size`` ranks (default: ``cfg.parallel.world_size``).

    ``input_shape``: one sample, no batch dimension ((C, H, W), (F,); ``gpt``: (seq_len,), where
    ``data.seq_len`` 0 means the model's ``context_length``); ``num_classes``: classes, or the token
    dataset's vocabulary size. ``device_bytes``: memory of one GPU (None: unknown, e.g. a CPU target:
    the plan is shown, never a refusal); ``device_name`` names it in the summary; ``device_unit``:
    what ``device_bytes`` is the memory of, ``"GPU"``, or ``"rank"`` for a machine without GPUs
    whose memory each rank gets a share of (the summary and the suggestion say so).

    Every figure is per rank, for the busiest rank (a pipeline's largest stage). When the plan does
    not fit, :attr:`MemoryPlan.suggestion` names the smallest FSDP world size (same batch per rank)
    that would, or activation checkpointing with it, or says that the batch is too large.
    ``max_ranks``: the most ranks the target can run (a backend's max nodes × max processes per
    node; None: :data:`MAX_FSDP_RANKS`): the suggestion names no larger world, and says so when
    none within it fits. Raises :class:`PlanError` for a custom model.
    """
    world = world_size if world_size is not None else cfg.parallel.world_size
    result = _plan(cfg, input_shape, num_classes, world, device_bytes, device_name)
    result.device_unit = device_unit
    if result.host_bytes and device_unit == "rank":  # no GPU: the host's memory is the ranks' memory
        result.lines[-1] = (f"peak per rank: {gib(result.needed_bytes)} (with the {gib(result.host_bytes)} offloaded: "
                            f"without GPUs the host's memory is where the ranks run)"
                            + ("" if device_bytes is None else
                               f" of {gib(device_bytes)} ({'fits' if result.fits else 'does not fit'})"))
    if result.fits is False:
        result.suggestion = _suggest(cfg, input_shape, num_classes, world, device_bytes, device_name,
                                     max_ranks=max_ranks, device_unit=device_unit)
    return result


def _plan(cfg: JobConfig, input_shape: Sequence[int], num_classes: int, world: int,
          device_bytes: int | None, device_name: str) -> MemoryPlan:
    arch = cfg.model.arch
    p = _arch_params(arch, cfg.model.params)
    shape = list(input_shape)
    if arch == "gpt":
        shape = [cfg.data.seq_len or p["context_length"]]
    units = model_units(arch, cfg.model.params, shape, num_classes)
    total = sum(u.params for u in units)
    par, train = cfg.parallel, cfg.train
    strategy, bf16 = par.strategy, train.precision == "bf16"
    b = train.batch_size
    states = OPTIMIZER_STATES[train.optimizer] if (train.optimizer != "sgd" or train.momentum > 0) else 0
    lines = [f"model: {arch}, {total:,} parameters; {strategy} on {plural(world, 'rank', 'ranks')}, "
             f"{_samples(b)} per rank per step, {train.precision}"]

    held = units  # the units whose parameters this rank holds (a pipeline: its stage)
    act_units, act_samples = units, float(b)
    if strategy == "pipeline":
        stages = par.pipeline_stages or world
        groups = _balance([u.params for u in units], min(stages, len(units)))
        micro = b / par.microbatches
        sizes = []
        for index, group in enumerate(groups):
            in_flight = (par.microbatches if par.pipeline_schedule == "gpipe"
                         else min(par.microbatches, stages - index))
            stage_units = [units[i] for i in group]
            stage_bytes = (sum(u.params for u in stage_units) * 4 * (2 + states)
                           + sum(_act_bytes(u, micro * in_flight, bf16) for u in stage_units))
            sizes.append((stage_bytes, index, stage_units, in_flight))
        _, index, held, in_flight = max(sizes, key=lambda s: s[0])
        act_units, act_samples = held, micro * in_flight
        lines.append(f"pipeline: {stages} stages; the largest is stage {index} ({len(held)} of {len(units)} "
                     f"units, {sum(u.params for u in held):,} parameters), {in_flight} of {par.microbatches} "
                     f"micro-batches of {_samples(micro)} in flight ({par.pipeline_schedule})")
    held_params = sum(u.params for u in held)

    shard = world if strategy == "fsdp" else 1
    mixed = bf16 and strategy == "fsdp"
    params_b = math.ceil(held_params / shard) * 4
    grads_b = params_b
    opt_b = params_b * states
    what = "1/" + str(shard) + " of " if shard > 1 else ""
    lines.append(f"parameters: {what}{held_params:,} × 4 B (fp32{' master' if mixed else ''}) = {gib(params_b)}")
    lines.append(f"gradients: {what}{held_params:,} × 4 B (fp32) = {gib(grads_b)}")
    lines.append(f"optimizer: {train.optimizer} keeps {states} fp32 cop{'y' if states == 1 else 'ies'} per "
                 f"parameter = {gib(opt_b)}")

    # Activations: saved for backward at the end of forward.
    checkpointed = par.activation_checkpointing and arch == "gpt"
    blocks = [u for u in act_units if u.name.startswith("blocks.")] if checkpointed else []
    low = 2 if bf16 else 4
    act = sum(_act_bytes(u, act_samples, bf16, mixed) for u in act_units if u not in blocks)
    recomputed = 0  # one checkpointed block's activations, live again while backward recomputes it
    if blocks:
        c = p["embed_dim"]
        recomputed = int(_act_bytes(blocks[0], act_samples, bf16, mixed))
        inputs = len(blocks) * act_samples * shape[0] * c * low
        act += inputs
        lines.append(f"activation checkpointing: {len(blocks)} blocks keep only their input ({gib(inputs)}); one "
                     f"block at a time is recomputed in backward ({gib(recomputed)}, under buffers)")
    if bf16 and strategy != "fsdp":  # autocast's bf16 weight copies, saved for backward
        act += sum(u.matmul_params for u in held) * 2
    act_b = int(act)
    autocast = "" if not bf16 else " (bf16)" if strategy == "fsdp" else " (bf16, and the weights autocast copied)"
    lines.append(f"activations: {_samples(act_samples)} × {gib(act_b / max(act_samples, 1))} per sample saved for "
                 f"backward{autocast} = {gib(act_b)}")

    # Buffers: model buffers, the batch, FSDP's gathered units, the loss's gradient workspace.
    model_buffers = sum(u.buffers_bytes for u in held)
    sample_bytes = (shape[0] * 8 * 2) if arch == "gpt" else (math.prod(shape) * 4 + 8)
    batch_b = int(act_samples if strategy == "pipeline" else b) * sample_bytes
    extra = model_buffers + batch_b
    parts = [f"model buffers {gib(model_buffers)}", f"the batch {gib(batch_b)}"]
    if recomputed:
        extra += recomputed
        parts.append(f"the block being recomputed {gib(recomputed)}")
    if strategy == "ddp":
        # gradient_as_bucket_view is off: DDP's all-reduce buckets are a second copy of the gradients
        extra += grads_b
        parts.append(f"DDP's gradient buckets {gib(grads_b)}")
    if strategy == "fsdp":
        unit_bytes = 2 if mixed else 4
        sharded = [u for u in units if u.name.startswith("blocks.")] if arch == "gpt" else units
        root = sum(u.params for u in units if u not in sharded)
        largest = max((u.params for u in sharded), default=0)
        gathered = (root + 2 * largest) * unit_bytes + largest * 4
        extra += gathered
        parts.append(f"unsharded parameters (root {root:,} + 2 × largest unit {largest:,}) × {unit_bytes} B "
                     f"+ one unit's gradients {largest:,} × 4 B = {gib(gathered)}")
    if arch == "gpt" and (strategy != "pipeline" or held[-1].name == "head"):
        loss_samples = int(b if strategy != "pipeline" else b / par.microbatches)
        logits = loss_samples * shape[0] * num_classes
        workspace = logits * (low + 2 * 4)
        extra += workspace
        parts.append(f"the logits, held until backward, and the loss's two gradients of them (b·s·V = "
                     f"{loss_samples} × {shape[0]} × {num_classes:,} × ({low} + 2 × 4) B) {gib(workspace)}")
    lines.append("buffers: " + ", ".join(parts))

    # Evaluation at each epoch's end, without gradients: the state stays; the biggest layer's working
    # set for an evaluation batch, and a language model's logits with their fp32 log-softmax.
    dp = world // (par.pipeline_stages or world) if strategy == "pipeline" else world
    if arch == "gpt":
        rows = min(max(1, EVAL_BATCH_TOKENS // shape[0]), -(-cfg.data.val_windows // max(dp, 1)))
        eval_logits = rows * shape[0] * num_classes
        eval_work = eval_logits * (low + (4 if bf16 else 0) + 4) if (strategy != "pipeline" or held[-1].name == "head") else 0
        what_eval = (f"the logits and log-softmax of {plural(rows, 'window', 'windows')} ({rows * shape[0]:,} tokens × {num_classes:,} × "
                     f"({low}{' + 4' if bf16 else ''} + 4) B)")
        eval_work += max((u.act_elems for u in held if u.name.startswith("blocks.")), default=0) * rows * low
    else:
        rows = EVAL_BATCH_SIZE
        eval_work = max(u.act_elems for u in held) * rows * low
        what_eval = f"the largest layer's working set for {_samples(rows)}"
    resident = model_buffers + (grads_b if strategy == "ddp" else 0)
    if strategy == "fsdp":
        resident += (root + 2 * largest) * unit_bytes
    evaluation = resident + eval_work
    lines.append(f"evaluation (no gradients): {what_eval} and the resident buffers = {gib(evaluation)}"
                 + ("; more than training's activations and buffers: it sets the peak" if evaluation > act_b + extra
                    else ""))

    host, offloaded = 0, {}
    if par.cpu_offload and strategy == "fsdp":
        host = params_b + grads_b + opt_b
        offloaded = {"params_bytes": params_b, "grads_bytes": grads_b, "optimizer_bytes": opt_b}
        params_b = grads_b = opt_b = 0
        lines.append(f"cpu offload: parameter, gradient and optimizer shards in host memory ({gib(host)})")
    result = MemoryPlan(strategy=strategy, world_size=world, parameters=total, params_bytes=params_b,
                        grads_bytes=grads_b, optimizer_bytes=opt_b, activations_bytes=act_b,
                        buffers_bytes=extra, evaluation_bytes=int(evaluation), host_bytes=host, offloaded=offloaded,
                        device_bytes=device_bytes,
                        device_name=device_name, lines=lines)
    lines.append(f"peak per rank: {gib(result.peak_bytes)}"
                 + ("" if device_bytes is None else f" of {gib(device_bytes)} ({'fits' if result.fits else 'does not fit'})"))
    return result


def _samples(n: float) -> str:
    """``n`` samples, the noun agreeing (``1 sample``, ``2.5 samples``); a whole float without ``.0``."""
    return plural(int(n) if float(n).is_integer() else n, "sample", "samples")


def _with(cfg: JobConfig, **parallel: Any) -> JobConfig:
    data = cfg.to_dict()
    data["parallel"].update(parallel)
    return JobConfig.from_dict(data)


def _suggest(cfg: JobConfig, input_shape: Sequence[int], num_classes: int, world: int,
             device_bytes: int | None, device_name: str, *, max_ranks: int | None = None,
             device_unit: str = "GPU") -> str:
    """The smallest change that fits: FSDP across more ranks (at most ``max_ranks``), then with
    activation checkpointing."""
    per_node = max(cfg.parallel.procs_per_node, 1)
    capped = max_ranks is not None and max_ranks < MAX_FSDP_RANKS
    most = min(max_ranks, MAX_FSDP_RANKS) if max_ranks is not None else MAX_FSDP_RANKS
    candidates = sorted({n for n in range(1, most + 1)
                         if (n & (n - 1) == 0 or n % per_node == 0) and n >= max(world, 2)})
    ac_options = [cfg.parallel.activation_checkpointing]
    if cfg.model.arch == "gpt" and not cfg.parallel.activation_checkpointing:
        ac_options.append(True)
    def trial(ranks: int, ac: bool) -> MemoryPlan:
        nodes, procs = (ranks // per_node, per_node) if ranks % per_node == 0 else (ranks, 1)
        tried = _plan(_with(cfg, strategy="fsdp", activation_checkpointing=ac, nodes=nodes, procs_per_node=procs,
                            pipeline_stages=0), input_shape, num_classes, ranks, device_bytes, device_name)
        tried.device_unit = device_unit  # what counts toward a rank's memory (host offload, without GPUs)
        return tried

    for ac in ac_options:
        # FSDP's bytes per rank never grow with the ranks: when the largest world fits, search for the least.
        if not candidates or not trial(candidates[-1], ac).fits:
            continue
        low, high = 0, len(candidates) - 1
        while low < high:
            middle = (low + high) // 2
            if trial(candidates[middle], ac).fits:
                high = middle
            else:
                low = middle + 1
        found = trial(candidates[low], ac)
        how = f"FSDP across {candidates[low]} ranks" + (" with activation checkpointing" if ac and not
                                                         cfg.parallel.activation_checkpointing else "")
        return f"{how} would need {gib(found.needed_bytes)}"
    if capped:
        more = ("an instance type or backend with more GPU memory" if device_unit == "GPU" else
                "a machine with more memory per rank (or fewer processes per node)")
        with_ac = " with activation checkpointing" if cfg.model.arch == "gpt" else ""
        return (f"no FSDP world this backend can run (at most {plural(most, 'rank', 'ranks')}) fits{with_ac}; "
                f"choose {more}, or lower the batch size (train.batch_size) and "
                f"raise train.grad_accum_steps to keep the optimizer's batch")
    return (f"even FSDP across {MAX_FSDP_RANKS} ranks with activation checkpointing would not fit: the activations "
            f"of {_samples(cfg.train.batch_size)} per rank are too many; lower the batch size (train.batch_size) "
            f"and raise train.grad_accum_steps to keep the optimizer's batch")
