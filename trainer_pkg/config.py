"""The trainer's one configuration: nested dataclasses, each field documented beneath it.

The dashboard builds a :class:`JobConfig`, freezes it as JSON on the job row, and the trainer reads
the same JSON back (``python -m trainer_pkg.launch --config job.json``). The same schema drives the
dashboard's forms and validation, so the vocabulary below (``Literal`` choices) is shared.

``JobConfig.from_dict`` is strict: an unknown key, a missing section or a value of the wrong type is a
:class:`ConfigError` naming the field. Strings are never silently read as booleans or numbers.
:meth:`JobConfig.field_errors` checks each field's range; whether the strategy fits the ranks (nodes ×
processes, pipeline stages, micro-batches) is :mod:`trainer_pkg.world_shape`'s, which also needs the
model registry. :func:`field_docs` reads the documentation beneath each field, so the trainer's
``--help`` is this file's text.

This module imports nothing from the package: every other module may import it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import re
import textwrap
import typing
from typing import Any, Literal, Mapping, get_args, get_origin

Strategy = Literal["ddp", "fsdp", "pipeline"]
PipelineSchedule = Literal["gpipe", "1f1b"]
Precision = Literal["fp32", "bf16"]
LRSchedule = Literal["constant", "cosine"]
DataFormat = Literal["builtin", "imagefolder", "csv", "npz", "tokens", "webdataset"]
BuiltinDataset = Literal["digits"]
Architecture = Literal["mlp", "cnn", "resnet", "gpt", "custom"]
Optimizer = Literal["sgd", "adamw"]
InitMode = Literal["", "continue", "finetune"]
DistBackend = Literal["auto", "gloo", "nccl"]
OnNonfiniteLoss = Literal["stop", "warn"]
CheckpointFormat = Literal["full", "sharded"]
Framework = Literal["torch", "tensorflow", "ray", "mpi"]


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    ``errors`` holds every problem found, keyed by its dotted path (``{"train.lr": "expected a
    number, got 'x'"}``); the text is each of them as ``path: message``, joined by ``"; "``. Raised
    with a bare message (no path known), ``errors`` is empty."""

    def __init__(self, message: str = "", errors: Mapping[str, str] | None = None) -> None:
        self.errors: dict[str, str] = dict(errors or {})
        super().__init__(message or "; ".join(f"{path}: {text}" for path, text in self.errors.items()))


@dataclasses.dataclass
class DataConfig:
    format: DataFormat = "builtin"
    """How the data is stored: a built-in dataset, an ImageFolder tree, a CSV table, NPZ arrays,
    token shards (``tokens``), or ``webdataset``: a folder or ``s3://``/``gs://``/``az://`` prefix of
    WebDataset-style ``*.tar`` shards of ``<key>.<image ext>`` images and ``<key>.cls`` integer
    labels (optionally ``val/`` shards for validation, else the last shard is), each data-parallel
    rank streaming only its own shards (shard i to rank i mod the data-parallel size), every rank
    running the same number of steps (trainer_pkg/web_shard.py)."""
    name: BuiltinDataset = "digits"
    """Built-in dataset (only read when ``format == "builtin"``): scikit-learn's 8×8 digits."""
    uri: str = ""
    """Path of the data for imagefolder / csv / npz (a local path or a cloud mount path); a tokens
    or webdataset dataset may also be an ``s3://``, ``gs://`` or ``az://`` prefix, read by range with the
    platform's credentials (docs/token-data.md, trainer_pkg/objstore.py)."""
    label_column: str = "label"
    """CSV only: the column holding the integer class label; every other column is a feature."""
    val_fraction: float = 0.2
    """Share of the samples held out for validation when the data has no validation split."""
    image_size: int = 32
    """ImageFolder and webdataset: images are resized to ``image_size × image_size`` pixels."""
    seq_len: int = 0
    """Tokens only: tokens per training window (the model sees ``seq_len`` tokens and predicts the
    next token at each position); 0 = the ``gpt`` model's ``context_length``."""
    val_windows: int = 256
    """Tokens only: windows of the validation split evaluated at each epoch's end (the same windows
    every epoch, drawn from ``train.seed``)."""
    num_workers: int = 0
    """DataLoader worker processes per rank that read and decode samples ahead of the training step
    (ImageFolder decoding, memory-mapped CSV and NPZ rows); 0 = read in the training process. Workers
    are forked at each epoch's first batch; they pay off when a core is free for each (cores ÷ ranks
    per node − 1 at most). The batches are the same whatever the count."""
    pin_memory: bool = False
    """Copy batches into page-locked memory so the copy to the GPU overlaps compute (GPU only;
    ignored on CPU)."""
    prefetch_factor: int = 2
    """With ``num_workers`` > 0: batches each worker prepares ahead (memory: workers × this × one
    batch of float32 inputs)."""


@dataclasses.dataclass
class ModelConfig:
    arch: Architecture = "cnn"
    """Architecture from the trainer's model registry (``trainer_pkg.models``)."""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Architecture parameters; validated and completed with defaults by the model registry. For
    ``custom``: any JSON object, passed to the entry point as keyword arguments."""
    entry_point: str = ""
    """``custom`` only: ``package.module:function`` in the user's code (``code.dir``); called as
    ``function(num_classes=..., input_shape=(C, ...), **params)`` it returns a ``torch.nn.Module``
    mapping a batch (B, *input_shape) to logits (B, num_classes)."""
    shard_classes: list[str] = dataclasses.field(default_factory=list)
    """FSDP only: class names of the submodules that each get their own ``fully_shard`` (e.g.
    ``["Block"]``); empty = each layer of a built-in model, each top-level child of a custom one."""


@dataclasses.dataclass
class ParallelConfig:
    strategy: Strategy = "ddp"
    """``ddp``: every rank holds the whole model and a disjoint shard of each epoch's data.
    ``fsdp``: the same data split, but parameters, gradients and optimizer state are sharded across
    ranks (FSDP2 ``fully_shard`` per layer), for models too large for one device.
    ``pipeline``: the model's layers split into ``pipeline_stages`` consecutive stages, one per rank,
    activations sent from stage to stage in ``microbatches`` micro-batches; with more ranks than
    stages the pipelines are data-parallel replicas of each other."""
    pipeline_stages: int = 0
    """Pipeline only: stages per pipeline; 0 means one stage per rank. Must divide the world size
    (world size / stages = data-parallel replicas) and be at most the model's layer count."""
    microbatches: int = 4
    """Pipeline only: micro-batches per batch (``train.batch_size`` must be divisible by it); more
    micro-batches keep more stages busy at once."""
    pipeline_schedule: PipelineSchedule = "gpipe"
    """Pipeline only: ``gpipe`` (all forwards, then all backwards) or ``1f1b`` (one forward, one
    backward: fewer activations held; needs micro-batches ≥ stages)."""
    nodes: int = 1
    """Number of machines."""
    procs_per_node: int = 1
    """Processes (ranks) per machine; world size = nodes × procs_per_node."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's (each sharded unit's) activations during backward instead
    of keeping them from the forward pass: less memory per rank for about a third more compute.
    ddp and fsdp (the units are those FSDP shards: ``model.shard_classes``, else each layer with
    weights); refused with a pipeline. A unit that is a single layer saves little by it."""
    cpu_offload: bool = False
    """FSDP only (refused with ddp and pipeline): keep parameters, gradients and optimizer state in
    CPU memory between uses (FSDP2 ``CPUOffloadPolicy``), for a model whose shards do not fit the
    GPU; the optimizer steps on the CPU. Runs on a CPU-only machine too (nothing to move)."""
    dist_backend: DistBackend = "auto"
    """Process-group backend: ``auto`` picks nccl when CUDA is available, gloo otherwise."""
    timeout_s: int = 600
    """Process-group timeout in seconds: how long a collective waits for a missing rank."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclasses.dataclass
class TrainConfig:
    epochs: int = 3
    """Passes over the training data."""
    batch_size: int = 32
    """Samples per process per step (the global batch is batch_size × world size)."""
    lr: float = 0.05
    """Peak learning rate."""
    optimizer: Optimizer = "sgd"
    """``sgd`` (with momentum) or ``adamw``."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """L2 penalty (decoupled for AdamW)."""
    seed: int = 0
    """Seeds model init, data split and shuffling; the same seed gives the same run on CPU."""
    log_every_steps: int = 0
    """Emit a ``step`` metric record every this many optimizer steps; 0 (the default) = by time: about
    every ``log_every_s`` seconds of training (see :func:`trainer_pkg.train.record_interval`)."""
    log_every_s: float = 1.0
    """With ``log_every_steps`` 0: about how often, in seconds of training, a ``step`` record is
    emitted (from the slowest rank's step time, so every rank agrees; 1 to 1000 steps apart)."""
    stop_check_s: float = 2.0
    """About how often, in seconds of training, the ranks agree on whether one of them received
    SIGTERM (between 1 and 50 steps apart; 0 = at every step). A signal is acted on within about
    twice this: keep it far below the platform's grace period (SageMaker, spot: 120 s)."""
    precision: Precision = "fp32"
    """``bf16``: ddp and pipeline run forward passes under bfloat16 autocast (weights, gradients and
    optimizer stay fp32; no loss scaling needed). fsdp uses FSDP2's mixed precision policy instead
    (``param_dtype`` bfloat16, ``reduce_dtype`` float32): the fp32 shards are all-gathered as bf16,
    forward and backward compute in bf16, gradients are reduced in fp32 into fp32 shards that the
    optimizer steps. Refused on a device without bf16 support."""
    grad_accum_steps: int = 1
    """Batches whose gradients are summed before each optimizer step (no gradient sync between
    ranks until the last of them): the optimizer's batch is batch_size × this × data-parallel ranks."""
    grad_clip_norm: float = 0.0
    """Clip the global gradient norm (over all ranks and shards) to this before each step; 0 = off."""
    lr_schedule: LRSchedule = "constant"
    """Learning rate after warmup: ``constant`` (``lr``) or ``cosine`` (``lr`` decaying to 0 at the
    last step of the last epoch)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup: the lr rises as lr × (step + 1) / (warmup_steps + 1)."""
    find_unused_parameters: bool = False
    """DDP only: set when some parameters get no gradient in a step (an auxiliary head switched
    off). Off, such a model stops at its first step with a message naming the parameters; on, DDP
    searches the graph every step for them (slower). FSDP and pipeline need no flag."""
    augment: bool = False
    """Random horizontal flips of training images (image data only: samples shaped (C, H, W)).
    Each rank draws its flips from its own stream (seeded by ``seed`` and the rank), so ranks see
    different flips; the stream is checkpointed, so a resumed run draws what an uninterrupted one would."""
    max_steps: int = 0
    """Stop after this many optimizer steps (a language model's run is usually counted in steps, not
    epochs); 0 = run all ``epochs``. The run then validates, checkpoints at that position (inside an
    epoch if need be), saves ``model.pt`` and completes; rerun with a larger value (or 0) and it
    resumes exactly there. The lr schedule spans the smaller of this and the epochs' steps."""
    compile: bool = False
    """``torch.compile`` the model before training (faster steps on GPU after a compile of a minute
    or so): under fsdp each sharded unit on its own (as torchtitan compiles each block), under ddp
    the whole model; refused with a pipeline. Off by default, and rarely worth it on CPU (it needs
    a C++ compiler there)."""
    on_nonfinite_loss: OnNonfiniteLoss = "stop"
    """When the training loss becomes NaN or infinite (a diverged run: too high a learning rate, bad
    data): ``stop`` ends the run as failed with "loss became NaN at step N" (no checkpoint is written
    over the last good one); ``warn`` logs that once and trains on. The ranks agree on it with the
    SIGTERM check (``stop_check_s``), so a run stops within about two such intervals of the step."""
    init_from: str = ""
    """Start from another run's results: a local path or an ``s3://``/``gs://``/``az://`` URI of a full
    checkpoint file (``last.pt``, for ``init_mode`` continue) or of a ``model.pt`` (a bare state dict,
    for finetune); "" = start from scratch. Read once at start, only when this run has no checkpoint of
    its own: a restarted run resumes its own progress. A local path is never followed through a
    symbolic link. Set by the dashboard from the source job (docs/clone-continue.md)."""
    init_mode: InitMode = ""
    """With ``init_from``: ``continue`` resumes the source's checkpoint as if it were this run's own
    (model, optimizer, lr schedule, epoch and step, RNG) and trains on to ``epochs``; ``finetune``
    loads the source's weights into the same architecture and starts at epoch 0, step 0 with a new
    optimizer."""


@dataclasses.dataclass
class OutputConfig:
    output_dir: str = "output"
    """Where ``model.pt`` (bare state dict) and ``metrics.jsonl`` are written."""
    checkpoint_dir: str = ""
    """Where per-epoch checkpoints go; "" means ``<output_dir>/checkpoints``."""

    checkpoint_format: CheckpointFormat = "full"
    """``full``: one ``last.pt`` with the whole model and optimizer, written by rank 0.
    ``sharded``: a ``torch.distributed.checkpoint`` directory, ``checkpoint/``, written by every rank
    in parallel (each its own shards; no rank ever holds the whole model), which resumes on any world
    size under ddp or fsdp (refused with a pipeline); every rank must see the same
    ``checkpoint_dir``. Each format resumes from its own file. ``model.pt`` is always the whole
    model's bare state dict."""

    @property
    def resolved_checkpoint_dir(self) -> str:
        return self.checkpoint_dir or f"{self.output_dir.rstrip('/')}/checkpoints"


@dataclasses.dataclass
class CodeConfig:
    dir: str = ""
    """Directory holding the user's unpacked code archive: first on ``sys.path`` for a ``custom``
    model's entry point, and the working directory of a ``script``; "" = no user code. The backend
    sets it to where the archive lies on the platform."""
    sha256: str = ""
    """SHA-256 of the code archive (hex), for the record: logged at start, shown on the job page."""
    script: str = ""
    """Run the user's own training script under the launcher instead of Trainboard's trainer: a
    ``.py`` file relative to ``dir`` (``train.py``) or ``-m package.module``; "" = our trainer."""
    args: list[str] = dataclasses.field(default_factory=list)
    """Arguments passed to ``script`` (an argv list, never through a shell); ``{train.<field>}`` in
    one is replaced by that field's value (:func:`expand_script_args`)."""
    framework: Framework = "torch"
    """How the launcher starts a ``script``'s processes (docs/user-code.md): ``torch``, one process
    per rank under torchrun's variables; ``tensorflow``, one ``tf.distribute`` worker per process with
    ``TF_CONFIG``; ``ray``, a Ray cluster over the job's nodes with the script on node 0; ``mpi``, the
    ranks started by ``mpirun`` (or the platform's MPI). Only a ``script`` takes one other than torch."""


# -- what a user's script receives of its job's config (docs/user-code.md) ----------------------

SCRIPT_SECTION = "train"
"""The config section a script receives: every field of it but :data:`SCRIPT_SKIPPED`, in
``TRAINBOARD_HPARAMS`` and as ``{train.<field>}`` placeholders in ``code.args``. The other sections
are the platform's (``output``, ``code``, ``parallel``: the script sees the shape as torchrun's
``WORLD_SIZE``…), the data's path (``TRAINBOARD_DATA_DIR``) or our trainer's model (``model``)."""
SCRIPT_SKIPPED = ("init_from", "init_mode")
"""``train`` fields a script gets as variables of their own (``TRAINBOARD_INIT_FROM``/``_MODE``)."""
_PLACEHOLDER = re.compile(r"\{train\.([A-Za-z_][A-Za-z0-9_]*)\}")


def script_hparam_keys() -> tuple[str, ...]:
    """The dotted keys a script receives (``train.epochs``, ``train.lr``, ...), in field order: what a
    sweep over a script may vary."""
    return tuple(f"{SCRIPT_SECTION}.{f.name}" for f in dataclasses.fields(TrainConfig)
                 if f.name not in SCRIPT_SKIPPED)


def script_hparams(cfg: "JobConfig") -> dict[str, Any]:
    """``{"train.epochs": 3, "train.lr": 0.05, ...}``: the values of :func:`script_hparam_keys` in
    ``cfg`` (the job's frozen config: the form's epochs, batch size, lr and seed, a sweep trial's
    sampled values, the hyperparameters' overrides), JSON types as in the config."""
    return {key: getattr(cfg.train, key.split(".", 1)[1]) for key in script_hparam_keys()}


def format_hparam(value: Any) -> str:
    """A value as a placeholder writes it into an argument: text as it is, ``true``/``false``, numbers
    as Python (and JSON) write them: ``3``, ``0.01``, ``1e-06``."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def script_arg_problems(args: Any) -> list[str]:
    """Every ``{train.<name>}`` placeholder in ``args`` whose name is no field a script receives, one
    message each (empty when all are known). Other braces are left alone: ``{"a": 1}`` is an argument."""
    known = {key.split(".", 1)[1] for key in script_hparam_keys()}
    problems = []
    for arg in args if isinstance(args, (list, tuple)) else []:
        for name in _PLACEHOLDER.findall(arg) if isinstance(arg, str) else []:
            if name not in known:
                problems.append(f"{{train.{name}}} in argument {arg!r} names no field a script receives "
                                f"(train.{', train.'.join(sorted(known))})")
    return problems


def expand_script_args(args: list[str] | tuple[str, ...], hparams: Mapping[str, Any]) -> list[str]:
    """``args`` with each ``{train.<field>}`` replaced by :func:`format_hparam` of
    ``hparams["train.<field>"]``: ``["--lr", "{train.lr}"]`` → ``["--lr", "0.01"]``; one argument stays
    one (``--lr={train.lr}`` → ``--lr=0.01``), and no shell ever sees them. Raises
    :class:`ConfigError` on ``code.args`` naming every unknown placeholder."""
    problems = script_arg_problems(list(args))
    if problems:
        raise ConfigError("code.args: " + "; ".join(problems))
    return [_PLACEHOLDER.sub(lambda m: format_hparam(hparams[f"train.{m.group(1)}"]), arg) for arg in args]


@dataclasses.dataclass
class JobConfig:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    code: CodeConfig = dataclasses.field(default_factory=CodeConfig)

    # -- serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "JobConfig":
        """Build a config from a (possibly partial) dict; missing fields take their defaults.

        Raises :class:`ConfigError` naming every unknown key and mistyped value at once, each by its
        dotted path (``ConfigError.errors``), e.g. ``train.epochs: expected an integer, got '3'``.
        Range checks are :meth:`field_errors`'s; :func:`check_config` does both.
        """
        errors: dict[str, str] = {}
        config = _build(cls, data, "", errors)
        if errors:
            raise ConfigError(errors=errors)
        return config

    @classmethod
    def from_json(cls, text: str) -> "JobConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError("config must be a JSON object")
        return cls.from_dict(data)

    # -- validation -------------------------------------------------------------------------

    def field_errors(self) -> dict[str, str]:
        """Range checks of single fields, keyed by dotted field name; empty when every field is in
        range. Whether the strategy fits the world (nodes × processes, pipeline stages, micro-batches)
        is :func:`trainer_pkg.world_shape.config_errors`, which includes these."""
        errs: dict[str, str] = {}

        def need(ok: bool, field: str, msg: str) -> None:
            if not ok and field not in errs:
                errs[field] = msg

        d, p, t = self.data, self.parallel, self.train
        need(d.format == "builtin" or bool(d.uri), "data.uri", f"a {d.format} dataset needs a path")
        need(0.0 < d.val_fraction < 1.0, "data.val_fraction",
             f"must be between 0 and 1 (exclusive), got {d.val_fraction}")
        need(d.image_size >= 8, "data.image_size", f"must be at least 8 pixels, got {d.image_size}")
        need(p.nodes >= 1, "parallel.nodes", f"must be at least 1, got {p.nodes}")
        need(p.procs_per_node >= 1, "parallel.procs_per_node",
             f"must be at least 1, got {p.procs_per_node}")
        need(p.timeout_s >= 1, "parallel.timeout_s", f"must be at least 1 second, got {p.timeout_s}")
        need(t.epochs >= 1, "train.epochs", f"must be at least 1, got {t.epochs}")
        need(0 <= t.seed <= 2**32 - 1, "train.seed", f"must be between 0 and 4,294,967,295, got {t.seed:,}")
        need(t.batch_size >= 1, "train.batch_size", f"must be at least 1, got {t.batch_size}")
        need(t.lr > 0, "train.lr", f"must be greater than 0, got {t.lr}")
        need(0.0 <= t.momentum < 1.0, "train.momentum", f"must be in [0, 1), got {t.momentum}")
        need(t.weight_decay >= 0, "train.weight_decay", f"must be 0 or more, got {t.weight_decay}")
        need(t.log_every_steps >= 0, "train.log_every_steps",
             f"must be 0 (by time, every train.log_every_s) or more, got {t.log_every_steps}")
        need(t.log_every_s > 0, "train.log_every_s", f"must be greater than 0 seconds, got {t.log_every_s}")
        need(t.stop_check_s >= 0, "train.stop_check_s", f"must be 0 (every step) or more, got {t.stop_check_s}")
        need(t.grad_accum_steps >= 1, "train.grad_accum_steps", f"must be at least 1, got {t.grad_accum_steps}")
        need(t.grad_clip_norm >= 0, "train.grad_clip_norm", f"must be 0 (off) or more, got {t.grad_clip_norm}")
        need(d.seq_len >= 0, "data.seq_len", f"must be 0 (the model's context length) or more, got {d.seq_len}")
        need(d.val_windows >= 1, "data.val_windows", f"must be at least 1, got {d.val_windows}")
        need(d.num_workers >= 0, "data.num_workers", f"must be 0 (read in the training process) or more, got {d.num_workers}")
        need(d.prefetch_factor >= 1, "data.prefetch_factor", f"must be at least 1, got {d.prefetch_factor}")
        need(t.max_steps >= 0, "train.max_steps", f"must be 0 (all epochs) or more, got {t.max_steps}")
        need(t.warmup_steps >= 0, "train.warmup_steps", f"must be 0 or more, got {t.warmup_steps}")
        need(bool(t.init_from) == bool(t.init_mode), "train.init_mode" if t.init_from else "train.init_from",
             "train.init_from and train.init_mode go together: a checkpoint or model.pt to start from, and "
             "continue or finetune")
        c = self.code
        need(c.framework == "torch" or bool(c.script.strip()), "code.framework",
             f"{c.framework} runs a training script (code.script): Trainboard's own trainer is PyTorch")
        for dotted, most in MAXIMA.items():  # past these a run overflows a library call, or means nothing
            section, name = dotted.split(".")
            value = getattr(getattr(self, section), name)
            need(value <= most, dotted, f"must be at most {most:,}, got {value:,}" if isinstance(value, int)
                 else f"must be at most {most:,g}, got {value:g}")
        return errs


MAXIMA: dict[str, int | float] = {
    "data.image_size": 4096,
    "data.seq_len": 1_048_576,
    "data.val_windows": 1_000_000,
    "data.num_workers": 64,
    "data.prefetch_factor": 64,
    "train.max_steps": 100_000_000,
    "parallel.nodes": 1000,
    "parallel.procs_per_node": 1024,
    "parallel.pipeline_stages": 1024,
    "parallel.microbatches": 10_000,
    "parallel.timeout_s": 86_400,  # torch's process-group timeout overflows a C int of ms past ~24 days
    "train.epochs": 100_000,
    "train.batch_size": 1_000_000,
    "train.log_every_steps": 1_000_000,
    "train.log_every_s": 86_400.0,
    "train.stop_check_s": 3600.0,
    "train.grad_accum_steps": 10_000,
    "train.warmup_steps": 10_000_000,
}
"""Largest accepted value of each bounded numeric field (:meth:`JobConfig.field_errors`)."""

MINIMA: dict[str, int | float] = {
    "data.image_size": 8,
    "data.seq_len": 0,
    "data.val_windows": 1,
    "data.num_workers": 0,
    "data.prefetch_factor": 1,
    "parallel.nodes": 1,
    "parallel.procs_per_node": 1,
    "parallel.pipeline_stages": 0,
    "parallel.microbatches": 1,
    "parallel.timeout_s": 1,
    "train.epochs": 1,
    "train.batch_size": 1,
    "train.seed": 0,
    "train.weight_decay": 0.0,
    "train.log_every_steps": 0,
    "train.stop_check_s": 0.0,
    "train.grad_accum_steps": 1,
    "train.grad_clip_norm": 0.0,
    "train.max_steps": 0,
    "train.warmup_steps": 0,
}
"""Smallest accepted value of each numeric field bounded from below inclusively (what
:meth:`JobConfig.field_errors` and :func:`trainer_pkg.world_shape.shape_errors` check; a field
bounded exclusively, ``train.lr`` > 0, is left out: a form's minimum cannot say it)."""

LABELS: dict[str, str] = {
    "parallel.procs_per_node": "Processes per node",
    "parallel.microbatches": "Micro-batches",
    "parallel.cpu_offload": "CPU offload",
    "train.lr": "Learning rate",
    "train.max_steps": "Max steps",
    "data.seq_len": "Sequence length",
}
"""A field's label where its name, spaced and capitalized (``batch_size`` → ``Batch size``), would
not say it: what a form, the API's schema and a CLI's help call the field."""


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """What a front door needs to ask for one config field: read from the dataclasses
    (:func:`config_fields`), never written out again."""

    path: str
    """Dotted path, ``train.lr``."""
    kind: str
    """``int``, ``float``, ``bool``, ``choice``, ``str``, ``dict`` or ``list``."""
    default: Any
    """The config's default."""
    label: str
    """Short name for a person (:data:`LABELS`, else the field name spaced and capitalized)."""
    help: str
    """The documentation beneath the field (:func:`field_docs`), whitespace collapsed."""
    minimum: int | float | None = None
    """Smallest accepted value (:data:`MINIMA`), None when unbounded or bounded exclusively."""
    maximum: int | float | None = None
    """Largest accepted value (:data:`MAXIMA`)."""
    choices: tuple[str, ...] = ()
    """The ``Literal`` choices of a ``choice`` field, in declaration order."""

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[1]


def _kind(hint: Any) -> tuple[str, tuple[str, ...]]:
    if get_origin(hint) is Literal:
        return "choice", tuple(get_args(hint))
    for kind, python in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if hint is python:
            return kind, ()
    return {dict: "dict", list: "list"}[get_origin(hint)], ()


@functools.cache
def config_fields() -> dict[str, FieldInfo]:
    """Every leaf field of :class:`JobConfig` by dotted path, in declaration order, with its type,
    default, label, documentation, bounds and choices: what the dashboard's job form, its API and its
    CLI are generated from (``jobs.job_request``).

    ``config_fields()["train.lr"].default`` = ``0.05``; ``config_fields()["train.epochs"].minimum`` = ``1``.
    """
    out: dict[str, FieldInfo] = {}
    for section, section_cls in typing.get_type_hints(JobConfig).items():
        hints, docs, defaults = typing.get_type_hints(section_cls), field_docs(section_cls), section_cls()
        for f in dataclasses.fields(section_cls):
            path = f"{section}.{f.name}"
            kind, choices = _kind(hints[f.name])
            out[path] = FieldInfo(
                path=path, kind=kind, default=getattr(defaults, f.name),
                label=LABELS.get(path, f.name.replace("_", " ").capitalize()),
                help=docs.get(f.name, ""), minimum=MINIMA.get(path), maximum=MAXIMA.get(path), choices=choices)
    return out


def check_config(data: Any) -> tuple[JobConfig | None, dict[str, str]]:
    """``data`` (a possibly partial JobConfig dict) built and range-checked at once: ``(config, {})``
    when it is valid, else ``(None, errors)`` with every problem keyed by its dotted path — unknown
    keys, mistyped values (:meth:`JobConfig.from_dict`) and out-of-range ones
    (:meth:`JobConfig.field_errors`) together, a field keeping its first. Writes nothing, raises
    nothing. Whether the strategy fits the world is :func:`trainer_pkg.world_shape.config_errors`'s."""
    errors: dict[str, str] = {}
    config = _build(JobConfig, data, "", errors)
    for path, message in config.field_errors().items():
        errors.setdefault(path, message)  # a mistyped field checked at its default says nothing new
    return (None, errors) if errors else (config, {})


def plural(n: int, one: str, many: str) -> str:
    """``n`` with the noun that agrees with it: ``plural(1, "node", "nodes")`` = ``"1 node"``,
    ``plural(2, "process", "processes")`` = ``"2 processes"``."""
    return f"{n} {one if n == 1 else many}"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The documentation of each field of the dataclass ``cls``: the string literal written beneath
    it (torchtitan's style), whitespace collapsed; ``{}`` when the source is not available (a
    bytecode-only install). Fields without one are left out.

    ``field_docs(TrainConfig)["epochs"]`` = ``"Passes over the training data."``
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _build(cls: type, data: Any, prefix: str, errors: dict[str, str] | None = None) -> Any:
    """An instance of the dataclass ``cls`` from ``data``. With ``errors`` every problem is recorded
    there (keyed by dotted path) and the field keeps its default, so the rest is still checked;
    without it the first problem raises :class:`ConfigError`."""
    if errors is None:
        found: dict[str, str] = {}
        built = _build(cls, data, prefix, found)
        if found:
            raise ConfigError(errors=found)
        return built
    if not isinstance(data, Mapping):
        errors.setdefault(prefix.rstrip(".") or "config", f"expected an object, got {type(data).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in sorted(set(data) - set(fields), key=str):
        errors.setdefault(f"{prefix}{name}", f"unknown field (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            continue
        where = f"{prefix}{name}"
        if dataclasses.is_dataclass(hints[name]):
            kwargs[name] = _build(hints[name], value, f"{where}.", errors)
            continue
        try:
            kwargs[name] = _convert(hints[name], value, where)
        except ConfigError as exc:
            errors.setdefault(where, str(exc).removeprefix(f"{where}: "))
    return cls(**kwargs)


def _convert(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{where}.")
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ConfigError(f"{where}: must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):  # JSON cannot store it, and no setting means it
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {value!r}")
        return dict(value)
    if origin is list and get_args(hint) == (str,):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return list(value)
    raise ConfigError(f"{where}: unsupported field type {hint!r}")  # a schema bug, not user input


# -- values that arrive as strings (SageMaker hyperparameters) -----------------------------------

_UNPARSED = object()


def parse_string_value(hint: Any, raw: Any, where: str) -> Any:
    """The value of the declared type ``hint`` that the platform string ``raw`` stands for.

    SageMaker delivers hyperparameters as strings: the SDK JSON-encodes each value (``"\\"digits\\""``,
    ``"3"``, ``"false"``) but a console or boto3 user may send raw text (``"False"``, ``digits``).
    Both are read: JSON first, then the text itself — ``"False"``/``"false"`` → False for a bool
    field, ``"3"`` → 3 for an int field, ``"0.1"`` → 0.1 for a float field. A value that is not of
    the declared type is a :class:`ConfigError` naming ``where`` (never a silent truthy string).
    Non-string values (already decoded, e.g. from ``SM_HPS``) go through the strict checks as is.
    """
    if not isinstance(raw, str):
        return _convert(hint, raw, where)
    text = raw.strip()
    try:
        decoded: Any = json.loads(text)
    except ValueError:
        decoded = _UNPARSED
    inner = decoded if isinstance(decoded, str) else text  # '"3"' and '3' both mean 3
    if hint is bool:
        if isinstance(decoded, bool):
            return decoded
        if inner.lower() in ("true", "false"):
            return inner.lower() == "true"
        raise ConfigError(f"{where}: expected true or false, got {raw!r}")
    if hint is int:
        if isinstance(decoded, int) and not isinstance(decoded, bool):
            return decoded
        try:
            return int(inner)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {raw!r}") from None
    if hint is float:
        if isinstance(decoded, (int, float)) and not isinstance(decoded, bool):
            value = float(decoded)
        else:
            try:
                value = float(inner)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {raw!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{where}: expected a finite number, got {raw!r}")
        return value
    if hint is str:
        return decoded if isinstance(decoded, str) else raw
    if get_origin(hint) is Literal:
        for candidate in (decoded, raw, text):
            if isinstance(candidate, str) and candidate in get_args(hint):
                return candidate
        return _convert(hint, inner, where)  # raises, listing the choices
    if decoded is _UNPARSED:
        raise ConfigError(f"{where}: expected JSON for this field, got {raw!r}")
    return _convert(hint, decoded, where)


def apply_overrides(cfg: JobConfig, values: Mapping[str, Any]) -> JobConfig:
    """A copy of ``cfg`` with ``values`` applied, each parsed to its field's declared type.

    Keys are dotted field names (``train.epochs``) or a bare field name that exactly one section has
    (``epochs``); dashes read as underscores (``batch-size``). An unknown or ambiguous key, or a value
    that does not parse, is a :class:`ConfigError` naming it. Range checks are left to ``validate``.
    """
    hints = {name: typing.get_type_hints(section) for name, section in typing.get_type_hints(JobConfig).items()}
    owners: dict[str, list[str]] = {}
    for section, fields in hints.items():
        for field in fields:
            owners.setdefault(field, []).append(section)
    data = cfg.to_dict()
    for key, raw in values.items():
        name = key.strip().replace("-", "_")
        if "." in name:
            section, field = name.split(".", 1)
            if section not in hints or field not in hints[section]:
                raise ConfigError(f"{key}: unknown field (a section.field of the job config, e.g. train.epochs)")
        else:
            found = owners.get(name, [])
            if len(found) != 1:
                raise ConfigError(f"{key}: " + (f"ambiguous, name the section: {', '.join(f'{s}.{name}' for s in found)}"
                                                 if found else "unknown field (e.g. epochs or train.epochs)"))
            section, field = found[0], name
        data[section][field] = parse_string_value(hints[section][field], raw, f"{section}.{field}")
    return JobConfig.from_dict(data)
