"""Clone with edits: a new job made from another's settings ("New job like this", Continue,
Fine-tune, ``POST /api/jobs/{id}/clone/``); docs/clone-continue.md.

:func:`training_job_clone_data` turns a job back into the arguments of
:func:`~jobs.services.training_jobs.training_job_create` that would build the same frozen config
(the form's fields, and the rest of the config as ``hyperparameters``); :func:`training_job_clone`
applies a user's overrides to them and creates the job, recording ``cloned_from`` (and for continue
and fine-tune ``source_job`` and ``init_mode``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from django.core.exceptions import ValidationError
from django.db import transaction

from jobs import job_request, validation
from jobs.models import ModelSpec, TrainingJob
from jobs.services.training_jobs import (
    INIT_FIELDS,
    JOB_FIELD_ALIASES,
    _deep_merge,
    _hyperparameters,
    _override_at,
    job_base_config,
    training_job_create,
)
from jobs.validation import ALL, Errors
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.registry import validate_model_params

CLONE_FIELDS = (
    "name", "dataset", "model_spec", "backend", "team", "strategy", "nodes", "procs_per_node", "pipeline_stages",
    "microbatches", "pipeline_schedule", "instance_type", "spot", "epochs", "batch_size", "lr", "seed",
    "max_runtime_s", "budget_usd", "priority", "image", "env", "activation_checkpointing", "cpu_offload",
    "checkpoint_format", "max_steps", "seq_len", "hyperparameters",
)
"""The keys of :func:`training_job_clone_data`: :func:`training_job_create`'s own argument names."""

# Not the user's to carry over: where the job wrote (the backend's), its code archive's hash (the
# model's, set again from the model), its starting point (the source job's, set by init_mode).
_NOT_CARRIED = {"output": ("output_dir", "checkpoint_dir"), "code": None, "train": INIT_FIELDS}


def _difference(base: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, Any]:
    """The smallest overrides that, deep-merged over ``base``, give ``target`` (both full JobConfig
    dicts with the same keys): the differing leaves, nested as in the config; a list or a model's
    params object differing only in some keys gives those keys (params are merged one level)."""
    diff: dict[str, Any] = {}
    for key, value in target.items():
        before = base.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            inner = _difference(before, value)
            if inner:
                diff[key] = inner
        elif value != before:
            diff[key] = value
    return diff


def _carried(diff: dict[str, Any]) -> dict[str, Any]:
    out = dict(diff)
    for section, names in _NOT_CARRIED.items():
        if section not in out:
            continue
        if names is None:
            out.pop(section)
            continue
        kept = {k: v for k, v in out[section].items() if k not in names}
        if kept:
            out[section] = kept
        else:
            out.pop(section)
    return out


def clone_name(job: TrainingJob, init_mode: str = "") -> str:
    """``<name> (copy of #12)``, ``(continued from #12)``, ``(fine-tuned from #12)``; cloning a clone
    replaces the suffix instead of stacking it."""
    base = re.sub(r" \((copy of|continued from|fine-tuned from|re-run of) #\d+\)$", "", job.name or f"job-{job.pk}")
    how = {"continue": "continued from", "finetune": "fine-tuned from"}.get(init_mode, "copy of")
    return f"{base} ({how} #{job.pk})"[:200]


def training_job_clone_data(job: TrainingJob) -> dict[str, Any]:
    """The :func:`training_job_create` arguments that rebuild ``job``: ``{"name", "dataset",
    "model_spec", "backend", "team" (instances or None), "strategy", "nodes", "procs_per_node",
    "pipeline_stages", "microbatches", "pipeline_schedule", "instance_type", "spot", "epochs",
    "batch_size", "lr", "seed", "max_runtime_s", "budget_usd", "priority", "image", "env" (dict),
    "activation_checkpointing", "cpu_offload", "checkpoint_format", "max_steps", "seq_len",
    "hyperparameters" (dict)}`` (:data:`CLONE_FIELDS`), read from the job's frozen config and row.

    ``hyperparameters`` is the part of ``job.config`` the other arguments do not produce, computed
    against the config :func:`training_job_create` builds from them, so creating a job from these
    arguments unchanged gives ``job.config`` again, as long as the dataset and model rows still say
    what they said (an edited dataset's new URI shows up as a ``data`` override instead). Never
    carried: ``output.output_dir``/``checkpoint_dir`` (the backend's), the ``code`` section (the
    model's archive) and ``train.init_from``/``init_mode`` (continue and fine-tune set them).
    Raises ValidationError (``__all__``) when the job's config no longer reads as a JobConfig.
    Writes nothing. A stable signature: sweeps build their trials from it.
    """
    try:
        config = JobConfig.from_dict(job.config or {})
    except ConfigError as exc:
        raise ValidationError({ALL: [f"Job #{job.pk}'s config cannot be read by this version of the trainer "
                                     f"({exc}); create a new job instead."]}) from None
    args: dict[str, Any] = {
        "name": clone_name(job), "dataset": job.dataset, "model_spec": job.model_spec, "backend": job.backend,
        "team": job.team, "instance_type": job.instance_type, "spot": job.spot,
        "max_runtime_s": job.max_runtime_s, "budget_usd": job.budget_usd, "priority": job.priority,
        "image": job.image or "", "env": dict(job.env or {}),
    }
    settings = {f.name: getattr(getattr(config, f.config.split(".")[0]), f.config.split(".")[1])
                for f in job_request.JOB_REQUEST if f.config}  # every config field the request sets
    args.update(settings)
    model_spec = job.model_spec
    archive = model_spec.code if model_spec.kind != ModelSpec.Kind.BUILTIN else None
    base = job_base_config(dataset=job.dataset, model_spec=model_spec, archive=archive, **settings)
    try:
        built = JobConfig.from_dict(base)
        if model_spec.kind != ModelSpec.Kind.SCRIPT:
            built.model.params = validate_model_params(built.model.arch, built.model.params)
    except ConfigError:
        built = None  # the model row changed into something invalid: carry the job's whole model section
    target = config.to_dict()
    args["hyperparameters"] = _carried(_difference(built.to_dict() if built else {}, target))
    return args


def _check_overrides(errors: Errors, overrides: Any) -> dict[str, Any]:
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        errors.add(ALL, "Overrides must be an object of job fields, e.g. {\"epochs\": 5, \"lr\": 0.01}.")
        return {}
    known = (*CLONE_FIELDS, "init_mode")
    validation.unknown_fields(errors, overrides, known, what="a clone", aliases=JOB_FIELD_ALIASES)
    given = {k: v for k, v in overrides.items() if k in known}
    for key in [k for k in _NOT_NULL_FIELDS if k in given and given[k] is None]:
        errors.add(key, f"{key.replace('_', ' ').capitalize()} may not be null: give a value, or leave the key "
                        f"out to keep the source job's.")
        given.pop(key)
    for key in _TEXT_FIELDS:
        if key in given and not isinstance(given[key], str):
            errors.add(key, f"{key.replace('_', ' ').capitalize()} must be text.")
            given.pop(key)
    for key in _BOOL_FIELDS:
        if key in given and not isinstance(given[key], bool):
            errors.add(key, f"{key.replace('_', ' ').capitalize()} must be true or false.")
            given.pop(key)
    return given


# Overrides whose null would mean nothing (the create has no "unset" for them); a null of the others
# (team, budget_usd, image, max_steps ...) is the create's own default, as for a new job.
_NOT_NULL_FIELDS = ("name", "dataset", "model_spec", "backend", "strategy", "nodes", "procs_per_node", "epochs",
                    "batch_size", "lr", "seed", "max_runtime_s", "instance_type", "spot", "priority", "env",
                    "hyperparameters", "init_mode")

# Overrides the create takes as they come (it strips text and calls bool()): checked here first, so
# "false" is not True and a number is no name.
_TEXT_FIELDS = ("name", "instance_type", "image", "strategy", "pipeline_schedule", "checkpoint_format")
_BOOL_FIELDS = ("spot", "activation_checkpointing", "cpu_offload")


def _yield_to_overrides(data: dict[str, Any], extra: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """Where the clone's ``extra`` hyperparameters set a request field's config path (``train.lr``)
    and the clone does not give that field itself, the field carried from the source job is left
    unset (its declared default), so the override takes effect without conflicting with it (a
    conflict is an error: ``training_job_check``)."""
    for field in job_request.JOB_REQUEST:
        if field.config and field.name not in given and _override_at(extra, field.config)[0]:
            data[field.name] = field.default


def training_job_clone(*, owner, job: TrainingJob, overrides: Mapping[str, Any] | None = None) -> TrainingJob:
    """A new job of ``owner`` like ``job``: :func:`training_job_clone_data` with ``overrides``
    (:func:`training_job_create`'s argument names; ``hyperparameters``, an object or JSON text, is
    deep-merged over the job's; ``init_mode`` continue | finetune starts from ``job``'s last
    checkpoint or trained weights, :mod:`jobs.services.lineage`), then created, with ``cloned_from``
    = ``job``. ``owner`` must see ``job`` (theirs or their team's): a teammate's clone is the
    teammate's own job; the team is kept while ``owner`` is a member of it.

    Raises ValidationError with every error at once, keyed by field (an unknown override key is an
    error on that key); nothing is written then.
    """
    errors = Errors()
    if validation.owned(errors, ALL, TrainingJob, job, owner, "job") is None:
        errors.raise_if_any()
    given = _check_overrides(errors, overrides)
    data = training_job_clone_data(job)
    init_mode = given.pop("init_mode", "") or ""
    if not isinstance(init_mode, str):
        errors.add("init_mode", "Init mode must be continue, finetune or blank.")
        init_mode = ""
    if "name" not in given:
        data["name"] = clone_name(job, init_mode)
    if "team" not in given and job.team_id and not job.team.members.filter(pk=owner.pk).exists():
        data["team"] = None  # the owner's own job, not a team's they left
    if "hyperparameters" in given:
        extra = _hyperparameters(errors, given.pop("hyperparameters"))
        data["hyperparameters"] = _deep_merge(data["hyperparameters"], extra)
        _yield_to_overrides(data, extra, given)
    data.update(given)
    # The create's own checks run even when an override was refused, so one answer lists every error;
    # its row is rolled back then.
    with transaction.atomic():
        try:
            new_job = training_job_create(owner=owner, **data, cloned_from=job,
                                          source_job=job if init_mode else None, init_mode=init_mode)
        except ValidationError as exc:
            for field, messages in exc.message_dict.items():
                for message in messages:
                    errors.add(field, message)
            raise ValidationError(dict(errors)) from None
        errors.raise_if_any()
    return new_job
