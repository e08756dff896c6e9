"""A job request, declared once: every field a user sets to launch a training job.

The dataset, model and backend, the shape, the job-level fields (budget, instance, priority, env, ...)
and the trainer-config fields a user may set directly (:data:`CONFIG_FIELDS`). A config field's kind,
default, bounds and choices — and its label and help, unless the front door words them otherwise
here — come from :mod:`trainer_pkg.config`'s own field metadata (:func:`trainer_pkg.config.config_fields`),
the way torchtitan derives its CLI from its config. The job form (``webapp.forms``), the API serializer
(so the OpenAPI schema), ``manage.py submit_job --help`` and the sweep's base job are built from
:func:`job_request_fields`; :func:`jobs.services.training_jobs.training_job_check` reads the config
fields back into the config by their paths.

To let users set one more trainer field at the front doors, add its dotted path to
:data:`CONFIG_FIELDS` (and, for another wording, an entry to :data:`_WORDING`).

This module is a leaf: it imports no service and no model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from jobs.validation import PRIORITY_RANGE
from trainer_pkg.config import FieldInfo, config_fields

KINDS = ("int", "float", "bool", "choice", "text", "decimal", "object", "ref")
"""What a field holds: a whole number, a number, true/false, one of ``choices``, text, a money amount,
a JSON object (or its text), or a row of the user's (dataset, model, backend, team) by id or name."""


@dataclasses.dataclass(frozen=True)
class RequestField:
    """One field of a job request, as every front door asks for it."""

    name: str
    """The service's keyword, the API's key, the form's field name (``procs_per_node``)."""
    kind: str
    """One of :data:`KINDS`."""
    label: str
    """What the field is called in messages, the form and the schema (``Processes per node``)."""
    help: str = ""
    """One or two sentences a person reads beside the field."""
    default: Any = None
    """The value when the field is left out; None with ``optional``: the trainer config's own default."""
    minimum: int | float | None = None
    """Smallest value a front door accepts itself (larger bounds: the service's checks, with the figures)."""
    maximum: int | float | None = None
    choices: tuple[str, ...] = ()
    config: str = ""
    """The trainer-config field it sets (``parallel.procs_per_node``); "" for a job-level field."""
    optional: bool = False
    """Left out or blank = not sent: the service's (the config's) default applies."""
    required: bool = False
    max_length: int | None = None
    group: str = "job"
    """Where ``submit_job --help`` lists it: what, shape, training, large, environment, limits, job."""
    option: str = ""
    """``submit_job``'s option, without ``--`` (default: the name with ``-`` for ``_``)."""
    form_label: str = ""
    """The job form's label where it says more than ``label`` (``Batch size per process``)."""
    initial: Any = None
    """What a form shows before the user types: the config's default for a config field (also an
    optional one's, which the request leaves out), else ``default``."""

    @property
    def cli_option(self) -> str:
        return "--" + (self.option or self.name.replace("_", "-"))


CONFIG_FIELDS: dict[str, str] = {
    "strategy": "parallel.strategy",
    "pipeline_stages": "parallel.pipeline_stages",
    "microbatches": "parallel.microbatches",
    "pipeline_schedule": "parallel.pipeline_schedule",
    "nodes": "parallel.nodes",
    "procs_per_node": "parallel.procs_per_node",
    "epochs": "train.epochs",
    "batch_size": "train.batch_size",
    "lr": "train.lr",
    "seed": "train.seed",
    "activation_checkpointing": "parallel.activation_checkpointing",
    "cpu_offload": "parallel.cpu_offload",
    "checkpoint_format": "output.checkpoint_format",
    "max_steps": "train.max_steps",
    "seq_len": "data.seq_len",
}
"""The trainer-config fields a user sets directly, by request name (the rest: ``hyperparameters``)."""

OPTIONAL_CONFIG_FIELDS = frozenset({"pipeline_stages", "microbatches", "pipeline_schedule", "activation_checkpointing",
                                    "cpu_offload", "checkpoint_format", "max_steps", "seq_len"})
"""Config fields a request may leave out (blank: the config's default). The others always travel with
the request's value, the config's default when left out."""

# How the front doors word a config field where the trainer's documentation is longer than a form's
# help line (the trainer's --help keeps the full text). group: submit_job's option group.
_WORDING: dict[str, dict[str, str]] = {
    "strategy": dict(group="shape", help=(
        "ddp: every rank holds the model and a shard of the data. fsdp: the same, with parameters, gradients and "
        "optimizer state sharded across ranks. pipeline: the model's layers split into consecutive stages, one "
        "per rank.")),
    "pipeline_stages": dict(group="shape", help="Pipeline only: stages per pipeline, dividing the world size; 0 = "
                                                "one per rank."),
    "microbatches": dict(group="shape", help="Pipeline only: the batch size must divide into this many "
                                             "micro-batches."),
    "pipeline_schedule": dict(group="shape", help="Pipeline only: gpipe, or 1f1b (needs micro-batches ≥ stages)."),
    "nodes": dict(group="shape", help="Machines."),
    "procs_per_node": dict(group="shape", help="Ranks per machine; world size = nodes × processes."),
    "epochs": dict(group="training"),
    "batch_size": dict(group="training", help="Samples per process per step.", form_label="Batch size per process"),
    "lr": dict(group="training"),
    "seed": dict(group="training", help="Random seed: the same seed gives the same run on CPU."),
    "activation_checkpointing": dict(group="large", help=(
        "ddp and fsdp: recompute each block's activations during backward instead of keeping them — less memory "
        "per rank for about a third more compute.")),
    "cpu_offload": dict(group="large", help=(
        "fsdp only: keep parameters, gradients and optimizer state in CPU memory between uses; the optimizer "
        "steps on the CPU.")),
    "checkpoint_format": dict(group="large", help=(
        "full: one last.pt written by rank 0. sharded: every rank writes its own shards "
        "(torch.distributed.checkpoint), resumable on another world size; ddp and fsdp only.")),
    "max_steps": dict(group="large", help="Stop after this many optimizer steps; 0 = run all epochs."),
    "seq_len": dict(group="large", form_label="Sequence length (tokens)", help=(
        "Token datasets only: tokens per training window; 0 = the gpt model's context length.")),
}

MAX_RUNTIME_HELP = (
    "The limit on the job's whole run, counted from its start: start-up counts (on a cloud, launching the "
    "machines and downloading the image and the data; on a GPU box, starting the processes and loading the "
    "data), so allow for it: a limit shorter than the start-up ends the job before it trains. The job is "
    "stopped there, so it is billed up to it at most. The estimate says what it counts on the chosen backend.")
"""What a max runtime covers, for the job form and the API schema (``Backend.max_runtime_covers`` per backend)."""

_KIND_OF_CONFIG = {"int": "int", "float": "float", "bool": "bool", "choice": "choice", "str": "text"}


def first_sentence(text: str) -> str:
    """The first sentence of a field's documentation (up to its first ``. ``), for a help line."""
    head, dot, _ = text.partition(". ")
    return head + "." if dot else text


def config_request_field(name: str, info: FieldInfo) -> RequestField:
    """The request field ``name`` that sets the config field ``info``: its kind, default, bounds,
    choices, label and help from the config (help: its first sentence), worded by :data:`_WORDING`."""
    wording = _WORDING.get(name, {})
    optional = name in OPTIONAL_CONFIG_FIELDS
    return RequestField(
        name=name, kind=_KIND_OF_CONFIG[info.kind], label=wording.get("label", info.label),
        help=wording.get("help", first_sentence(info.help)), default=None if optional else info.default,
        minimum=info.minimum, maximum=info.maximum, choices=info.choices, config=info.path, optional=optional,
        group=wording.get("group", "training"), form_label=wording.get("form_label", ""), initial=info.default)


def _job_fields() -> list[RequestField]:
    low, high = PRIORITY_RANGE
    return [
        RequestField("name", "text", "Name", "Optional; defaults to job-<id>.", default="", max_length=200),
        RequestField("dataset", "ref", "Dataset", (
            "The dataset's id, or its name (one of yours or your teams'). Required, except for a script model "
            "(kind script) that reads its own data."), optional=True, group="what"),
        RequestField("model_spec", "ref", "Model", "The model's id, or its name (one of yours or your teams').",
                     required=True, group="what", option="model"),
        RequestField("backend", "ref", "Backend", "The compute backend's id, or its name.", required=True,
                     group="what"),
        RequestField("max_runtime_s", "int", "Max runtime (s)", MAX_RUNTIME_HELP, default=3600, minimum=1,
                     group="limits", option="max-runtime"),  # its maximum: the service's, with the figures
        RequestField("budget_usd", "decimal", "Budget (USD)", (
            "Stop the job when its cost reaches this (USD); caps the estimate: min(max runtime × nodes × "
            "hourly price, budget)."), minimum=0, optional=True, group="limits", option="budget"),
        RequestField("instance_type", "text", "Instance type", "Provider instance type; empty = the backend's default.",
                     default="", max_length=100, group="shape"),
        RequestField("spot", "bool", "Spot", "Interruptible capacity, where the backend offers it.", default=False,
                     group="shape"),
        RequestField("priority", "int", "Priority", (
            f"{low} to {high}: where the backend queues jobs itself (a GPU box whose GPUs are taken) higher starts "
            f"first; equal priorities start in submission order."), default=0, minimum=low, maximum=high,
            group="shape"),
    ]


def _tail_fields() -> list[RequestField]:
    return [
        RequestField("hyperparameters", "object", "Hyperparameters", (
            'Extra trainer config overrides, e.g. {"train": {"optimizer": "adamw"}}; not the code section (the '
            "model's) nor output.output_dir / output.checkpoint_dir (the backend sets where a job writes)."),
            optional=True, group="training"),
        RequestField("env", "object", "Environment variables", (
            'Environment variables of the job\'s processes: {"NAME": "value"} or "NAME=VALUE" lines; at most 64, '
            "values up to 4,096 characters; not the launcher's (RANK, MASTER_ADDR, PYTHONPATH, ...) nor "
            "TRAINBOARD_*, SM_*, AIP_*, AZUREML_*, CUDA_* names."), optional=True, group="environment"),
        RequestField("image", "text", "Container image", (
            "Container image for this job (an ECR, Artifact Registry or ACR URI); blank = the model's, else the "
            "backend's."), default="", max_length=500, group="environment"),
        RequestField("team", "ref", "Team", "Run for a team you are a member of (counts toward its monthly "
                                             "budget); none = private.", optional=True, group="what"),
    ]


# The form's order: what, shape, training, limits and placement, large-model settings, then the rest.
_ORDER = ("name", "dataset", "model_spec", "backend", "strategy", "pipeline_stages", "microbatches",
          "pipeline_schedule", "nodes", "procs_per_node", "epochs", "batch_size", "lr", "seed", "max_runtime_s",
          "budget_usd", "instance_type", "spot", "priority")


def job_request_fields(config_paths: Mapping[str, str] | None = None,
                       infos: Mapping[str, FieldInfo] | None = None) -> tuple[RequestField, ...]:
    """Every field of a job request, in the job form's order: the job-level fields, and one per entry
    of ``config_paths`` (default :data:`CONFIG_FIELDS`) built from ``infos`` (default the trainer's
    :func:`~trainer_pkg.config.config_fields`). A config field not in the form's order so far comes
    after the large-model ones."""
    config_paths = CONFIG_FIELDS if config_paths is None else config_paths
    infos = config_fields() if infos is None else infos
    by_name = {f.name: f for f in _job_fields()}
    by_name.update({name: config_request_field(name, infos[path]) for name, path in config_paths.items()})
    ordered = [by_name.pop(name) for name in _ORDER if name in by_name]
    ordered += [by_name.pop(name) for name in list(config_paths) if name in by_name]
    return tuple(ordered + list(by_name.values()) + _tail_fields())


JOB_REQUEST: tuple[RequestField, ...] = job_request_fields()
"""The job request the front doors are built from."""


def request_field(name: str, fields: Iterable[RequestField] | None = None) -> RequestField:
    """The field ``name`` of ``fields`` (default: :data:`JOB_REQUEST` as it is now)."""
    return next(f for f in (JOB_REQUEST if fields is None else fields) if f.name == name)


def config_sections(values: Mapping[str, Any], fields: Iterable[RequestField] | None = None) -> dict[str, dict]:
    """``{"parallel": {"strategy": ..., ...}, "train": {...}}``: the config fields among ``values`` (by
    request name) nested by their config path; an optional field left out, None or blank is not sent."""
    sections: dict[str, dict[str, Any]] = {}
    for field in JOB_REQUEST if fields is None else fields:
        if not field.config or field.name not in values:
            continue
        value = values[field.name]
        if field.optional and (value is None or value == ""):
            continue
        section, name = field.config.split(".", 1)
        sections.setdefault(section, {})[name] = value
    return sections
