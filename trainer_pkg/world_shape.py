"""Whether a job's parallel strategy fits the ranks it runs on, with the arithmetic in every message.

A job's *world* is its ranks: ``parallel.nodes × parallel.procs_per_node`` as the config asks for
them, or the ranks the launcher really started. The checks here are the ones that depend on that
number (and on the model's depth), as torchtitan's ``ParallelDims`` checks its mesh: a pipeline's
stage count must divide the world, each stage needs a layer, the batch must split into the
micro-batches, and the 1f1b schedule needs a micro-batch per stage. A message states the numbers:
``"2 nodes × 2 processes = 4 ranks; 3 pipeline stages do not divide 4: ..."``.

Torch-free: the dashboard calls :func:`config_errors` before a job is queued, the launcher
:func:`validate` before it starts anything, and the trainer :func:`shape_errors` with the world size
the launcher started.

    from trainer_pkg.world_shape import config_errors, describe_world
    config_errors(cfg)            # {} or {"parallel.pipeline_stages": "2 nodes × 2 processes = ..."}
    describe_world(2, 4)          # "2 nodes × 4 processes = 8 ranks"
"""

from __future__ import annotations

from trainer_pkg.config import ConfigError, JobConfig, ParallelConfig, plural
from trainer_pkg.registry import CUSTOM, TOKENS_FORMAT, check_input_shape, model_errors, pipeline_layer_count


def describe_world(nodes: int, procs_per_node: int) -> str:
    """``"2 nodes × 2 processes = 4 ranks"``: the arithmetic behind a world size, for messages."""
    return (f"{plural(nodes, 'node', 'nodes')} × {plural(procs_per_node, 'process', 'processes')} = "
            f"{plural(nodes * procs_per_node, 'rank', 'ranks')}")


def pipeline_stage_count(parallel: ParallelConfig, world_size: int) -> int:
    """Stages per pipeline: ``parallel.pipeline_stages``, or the world size when that is 0."""
    return parallel.pipeline_stages or world_size


def shape_errors(cfg: JobConfig, *, world_size: int, world_desc: str, check_layers: bool = True) -> dict[str, str]:
    """Whether ``cfg``'s strategy can run on ``world_size`` ranks, keyed by dotted field name.

    ``world_desc`` says where the world size comes from (``describe_world(...)`` for a config, the
    launcher's count in the trainer); every message shows the arithmetic, e.g. ``"2 nodes × 2
    processes = 4 ranks; 3 pipeline stages do not divide 4"``. ``check_layers=False`` skips the
    stages-against-layers check (a caller without the model); a custom model skips it always (its
    layers are known once it is built: :func:`trainer_pkg.parallel.make_strategy` checks them then).
    Empty when the shape fits.
    """
    p, t = cfg.parallel, cfg.train
    errs: dict[str, str] = {}
    if p.pipeline_stages < 0:
        errs["parallel.pipeline_stages"] = f"must be 0 (one stage per rank) or more, got {p.pipeline_stages}"
    if p.microbatches < 1:
        errs["parallel.microbatches"] = f"must be at least 1, got {p.microbatches}"
    if p.strategy != "pipeline" or errs:
        return {**errs, **feature_errors(cfg)}
    stages = pipeline_stage_count(p, world_size)
    if stages < 2:
        errs["parallel.pipeline_stages"] = (
            f"{world_desc}; a pipeline needs at least 2 stages: use at least 2 ranks, or strategy ddp")
    elif world_size % stages:
        errs["parallel.pipeline_stages"] = (
            f"{world_desc}; {stages} pipeline stages do not divide {world_size}: choose a stage count "
            f"that divides it (the ranks beyond one pipeline become data-parallel replicas)")
    if t.batch_size >= 1 and t.batch_size % p.microbatches:
        errs["parallel.microbatches"] = (
            f"batch size {t.batch_size} is not divisible into {plural(p.microbatches, 'micro-batch', 'micro-batches')}"
            f" ({t.batch_size} / {p.microbatches} = {t.batch_size / p.microbatches:g}): change one of them")
    elif p.pipeline_schedule == "1f1b" and stages >= 2 and p.microbatches < stages:
        errs["parallel.microbatches"] = (
            f"the 1f1b schedule needs at least one micro-batch per stage: {p.microbatches} micro-batches "
            f"< {stages} stages")
    if check_layers and stages >= 2 and "parallel.pipeline_stages" not in errs:
        try:
            layers = pipeline_layer_count(cfg.model.arch, cfg.model.params)
        except ConfigError:
            layers = None  # the registry reports bad model params itself
        if layers is not None and layers < stages:  # None: a custom model, counted once built
            errs["parallel.pipeline_stages"] = (
                f"{stages} pipeline stages need at least one layer each, but {cfg.model.arch} with these "
                f"parameters has {plural(layers, 'layer', 'layers')}: use fewer stages or a deeper model")
    if cfg.model.arch == "gpt" and (cfg.model.params or {}).get("tied_embeddings", True) is True:
        # The token embedding sits on the first stage and the output layer on the last: one weight cannot be both.
        errs["model.params.tied_embeddings"] = ("pipeline puts the token embedding on the first stage and the output "
                                                "layer on the last, so they cannot share one weight: set "
                                                "tied_embeddings to false, or use strategy ddp or fsdp")
    return {**errs, **feature_errors(cfg)}


def feature_errors(cfg: JobConfig) -> dict[str, str]:
    """The large-model settings the job's strategy cannot run, keyed by dotted field name:
    ``parallel.cpu_offload`` needs fsdp (FSDP2's ``CPUOffloadPolicy`` moves the shards it holds);
    activation checkpointing, sharded checkpoints and ``train.compile`` are for ddp and fsdp, not
    a pipeline's stages. Empty when they fit."""
    p, errs = cfg.parallel, {}
    if p.cpu_offload and p.strategy != "fsdp":
        errs["parallel.cpu_offload"] = (
            f"CPU offload keeps FSDP's parameter, gradient and optimizer shards in CPU memory; strategy "
            f"{p.strategy} has no shards: set parallel.strategy to fsdp, or turn parallel.cpu_offload off")
    if p.strategy == "pipeline":
        fix = "use strategy ddp or fsdp, or turn it off"
        if p.activation_checkpointing:
            errs["parallel.activation_checkpointing"] = (
                f"activation checkpointing is applied per sharded unit under ddp and fsdp, not to a "
                f"pipeline's stages: {fix}")
        if cfg.output.checkpoint_format == "sharded":
            errs["output.checkpoint_format"] = (
                "sharded checkpoints map ddp and fsdp models, not a pipeline's stages: use checkpoint_format "
                "full with a pipeline (it also resumes under another strategy or world size), or strategy ddp or fsdp")
        if cfg.train.compile:
            errs["train.compile"] = f"torch.compile is applied under ddp and fsdp, not to a pipeline's stages: {fix}"
    return errs


def config_errors(cfg: JobConfig) -> dict[str, str]:
    """Every error of ``cfg`` as a job, keyed by dotted field name; empty when it can run.

    The field checks of :meth:`JobConfig.field_errors` first, then the model section's
    (:func:`trainer_pkg.registry.model_errors`: a custom model's entry point and parameters), then
    :func:`shape_errors` for the world the config asks for (nodes × procs_per_node), skipped while
    either count is itself invalid. A field keeps its first error.
    """
    errs = cfg.field_errors()
    for field, msg in model_errors(cfg.model).items():
        errs.setdefault(field, msg)
    p = cfg.parallel
    if "parallel.nodes" not in errs and "parallel.procs_per_node" not in errs:
        found = shape_errors(cfg, world_size=p.world_size, world_desc=describe_world(p.nodes, p.procs_per_node))
        for field, msg in found.items():
            errs.setdefault(field, msg)
    return errs


def data_model_errors(cfg: JobConfig) -> dict[str, str]:
    """A language model (``gpt``) with data that is not ``tokens``, or a classifier with ``tokens``
    data (:func:`trainer_pkg.registry.check_input_shape` on the format alone), keyed by field; empty
    otherwise, for a custom model, and while the model's own parameters are invalid. The trainer
    checks it before opening the data; the dashboard checks the same rule against the stored
    dataset, with the dataset's name (``jobs.services.training_jobs``)."""
    if cfg.model.arch == CUSTOM or (cfg.data.format != TOKENS_FORMAT and cfg.model.arch != "gpt"):
        return {}
    try:
        check_input_shape(cfg.model.arch, (None,), data_format=cfg.data.format, params=cfg.model.params)
    except ConfigError as exc:
        field, _, message = str(exc).partition(": ")
        return {} if field.startswith("model.params") else {field: message}
    return {}


def validate(cfg: JobConfig) -> JobConfig:
    """Return ``cfg`` when :func:`config_errors` finds nothing; else raise :class:`ConfigError`
    listing every error as ``field: message``, joined by ``"; "``."""
    errs = config_errors(cfg)
    if errs:
        raise ConfigError("; ".join(f"{k}: {v}" for k, v in errs.items()))
    return cfg
