"""Writes. Views, the API, admin actions, management commands and tasks all call these functions.

Every function is keyword-only. Input errors raise :class:`django.core.exceptions.ValidationError`
whose ``message_dict`` is keyed by the form/API field names (``__all__`` for the rest) with messages
a user can act on, and nothing is written when they raise. Side effects outside the database (Celery
messages, provider calls) happen after commit, so a rolled-back request never launches a cloud job.
The contract is docs/internal-api.md.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import re
from decimal import Decimal, InvalidOperation
from functools import partial
from pathlib import PurePath
from typing import Any, Mapping, NamedTuple, get_args

from django.conf import settings
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import connection, transaction
from django.db.models import Max
from django.utils import timezone

from cloud_adapters.base import (
    Backend,
    BackendError,
    ConnectionCheck,
    CredentialsError,
    InstanceOffer,
    InvalidSpec,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
)
from cloud_adapters.pricing import PriceRow
from jobs import cost as costs
from jobs import validation
from jobs.models import (
    ACTIVE_STATE_VALUES,
    INTERRUPTION,
    TERMINAL_STATE_VALUES,
    ComputeBackend,
    Dataset,
    InstancePrice,
    JobEvent,
    JobLogLine,
    JobStateChoices as S,
    MetricPoint,
    ModelSpec,
    TrainingJob,
)
from jobs.states import is_allowed, transition
from trainer_pkg.config import ConfigError, JobConfig, Strategy
from trainer_pkg.world_shape import config_errors, describe_world, shape_errors

log = logging.getLogger(__name__)

ALL = NON_FIELD_ERRORS  # "__all__"


# =============================================================================================
# Adapters
# =============================================================================================


HOST_SETTING_SOURCES: dict[str, dict[str, str]] = {
    "gpubox": {"run_root": "TRAINBOARD_RUN_ROOT", "python": "TRAINBOARD_GPUBOX_PYTHON",
               "max_procs_per_node": "TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE"},
}
"""kind -> {host setting: the Django setting (and environment variable of the same name) holding this
installation's value}. Data, not if/elif: which settings are host settings is the adapter's
``host_settings``; this says where the installation's values live."""


def _host_config_defaults() -> dict[str, dict[str, Any]]:
    """This installation's host settings by adapter kind (:data:`HOST_SETTING_SOURCES`; a blank
    setting leaves the adapter's own default, e.g. the worker's interpreter). ``settings.
    TRAINBOARD_BACKEND_DEFAULTS`` (``{kind: {key: value}}``), when set, replaces them."""
    configured = getattr(settings, "TRAINBOARD_BACKEND_DEFAULTS", None)
    if configured:
        return configured
    defaults: dict[str, dict[str, Any]] = {}
    for kind, sources in HOST_SETTING_SOURCES.items():
        values = {key: getattr(settings, name, None) for key, name in sources.items()}
        defaults[kind] = {key: str(v) if isinstance(v, PurePath) else v for key, v in values.items()
                          if v not in (None, "")}
    return defaults


def backend_host_settings(kind: str) -> frozenset[str]:
    """The settings of a ``kind`` backend that only staff may set (the adapter's ``host_settings``:
    for the gpubox ``run_root``, ``python``, ``max_procs_per_node``); empty for an unknown kind."""
    from cloud_adapters.registry import backend_class

    try:
        return frozenset(backend_class(kind).host_settings)
    except (LookupError, ValueError, BackendError):
        return frozenset()


def backend_setting_labels(kind: str) -> dict[str, str]:
    """``{config key: label}`` of a ``kind`` backend's settings (the adapter's ``setting_labels``):
    the backend form labels its fields with them, as the adapter's messages name the settings; {}
    for an unknown kind or one whose SDK is missing."""
    from cloud_adapters.registry import backend_class

    try:
        return dict(backend_class(kind).setting_labels)
    except (LookupError, ValueError, BackendError):
        return {}


def may_set_host_settings(user) -> bool:
    """Whether a backend owned by ``user`` may carry host settings (:func:`backend_host_settings`):
    an active staff user's may; anyone else's takes them from the installation."""
    return bool(user is not None and getattr(user, "is_active", False) and getattr(user, "is_staff", False))


def may_use_worker_credentials(user) -> bool:
    """Whether a cloud backend owned by ``user`` may call its provider with the worker's own identity
    (the adapter's ``ambient_identity``: boto3's default chain, Application Default Credentials,
    DefaultAzureCredential) when it stores no credentials of its own.

    ``settings.TRAINBOARD_WORKER_CREDENTIALS``: ``"staff"`` (the default) lets only an active staff
    user's backend; ``"everyone"`` lets every user's. The default is the safe one because that
    identity is the operator's cloud account: a backend naming any role ARN or service account would
    otherwise launch billable jobs there as the operator (DESIGN.md §8: as whom a job runs is the
    operator's decision)."""
    return settings.TRAINBOARD_WORKER_CREDENTIALS == "everyone" or may_set_host_settings(user)


def worker_credentials_refusal(cls: type[Backend], config: Mapping[str, Any], secrets: Mapping[str, Any] | None,
                               owner) -> str | None:
    """Why a ``cls`` backend of ``owner`` with ``config`` and stored ``secrets`` may not be used: it
    would call its provider with the worker's own identity (``cls.uses_ambient_credentials``) and
    :func:`may_use_worker_credentials` says no for ``owner``. The message says what to do; None when
    it may be used."""
    if may_use_worker_credentials(owner) or not cls.uses_ambient_credentials(config, secrets):
        return None
    keys = " and ".join(k for k, required in cls.secret_keys.items() if required)
    return (f"this backend stores no credentials of its own, so its calls would use the worker's own "
            f"identity ({cls.ambient_identity}), which only a backend owned by staff may use. Store the "
            f"backend's own credentials ({keys}), or ask staff to set up the backend.")


def _effective_config(kind: str, config: Mapping[str, Any] | None, *, host_settings_from_row: bool) -> dict[str, Any]:
    """The installation's host settings for ``kind``, then the row's ``config`` over them; the row's
    own host settings count only when ``host_settings_from_row`` (its owner is staff)."""
    refused = frozenset() if host_settings_from_row else backend_host_settings(kind)
    merged = dict(_host_config_defaults().get(kind, {}))
    merged.update({k: v for k, v in (config or {}).items() if v not in (None, "") and k not in refused})
    return merged


def backend_adapter(backend: ComputeBackend) -> Backend:
    """The configured ``cloud_adapters`` Backend for a ComputeBackend row, pricing from the
    admin-managed catalog (:class:`jobs.pricing.DatabasePriceCatalog`, shipped rows as fallback).

    Host settings (:func:`backend_host_settings`: where a GPU box runs jobs, with which interpreter,
    how many processes) come from the installation (:data:`HOST_SETTING_SOURCES`); the row's values
    of them are used only while its owner is an active staff user (:func:`may_set_host_settings`).
    A non-staff user's row never carries them since the service refuses them, and any such value left
    from before (or from an owner no longer staff) is ignored here — the rule is the row's owner, at
    the time of use.

    The backend's stored ``secrets`` (decrypted) are handed to the adapter as ``adapter.secrets``,
    which builds its SDK clients with them instead of the provider's default credential chain. A
    cloud backend without them uses the worker's own identity, so it is built only while its owner
    may use that (:func:`may_use_worker_credentials`, checked at the time of use like the host
    settings): a row stored before the rule, or whose owner is no longer staff, raises
    :class:`CredentialsError` saying what to do, before any provider call.

    Raises :class:`BackendError` (e.g. InvalidSpec for a bad stored config, MissingDependency,
    CredentialsError as above); ImproperlyConfigured when the stored secrets cannot be decrypted with
    the configured keys.
    """
    from cloud_adapters.registry import create_backend
    from jobs.pricing import DatabasePriceCatalog

    config = _effective_config(backend.kind, backend.config,
                               host_settings_from_row=may_set_host_settings(backend.owner))
    adapter = create_backend(backend.kind, config, prices=DatabasePriceCatalog())
    refusal = worker_credentials_refusal(type(adapter), adapter.config, backend.secrets, backend.owner)
    if refusal:
        raise CredentialsError(refusal)
    if backend.secrets:
        adapter.secrets = dict(backend.secrets)
    return adapter


def backend_queue(backend: ComputeBackend) -> str:
    """The Celery queue whose workers reach ``backend`` (``Backend.queue``; "celery" if unknown)."""
    from cloud_adapters.registry import backend_class

    try:
        return backend_class(backend.kind).queue
    except (LookupError, ValueError, BackendError):
        return "celery"


def provider_job_name(job: TrainingJob) -> str:
    """Deterministic, provider-safe job name: ``tb-job-<id>-<creation time, hex seconds>``.

    Derived only from the row, so a retried submit finds the job its first attempt created. The
    creation time keeps a fresh database (ids restarting at 1) from adopting an old run's job.
    Lowercase letters, digits and hyphens, under 63 characters: valid on SageMaker, Vertex, Azure ML.
    """
    prefix = getattr(settings, "TRAINBOARD_JOB_NAME_PREFIX", "tb-job")
    return f"{prefix}-{job.pk}-{int(job.created_at.timestamp()):x}"


def job_spec(job: TrainingJob) -> JobSpec:
    """The :class:`JobSpec` for a stored job (its frozen config and shape)."""
    return JobSpec(
        job_name=job.provider_job_name or provider_job_name(job),
        config=job.config,
        nodes=job.nodes,
        procs_per_node=job.procs_per_node,
        instance_type=job.instance_type,
        spot=job.spot,
        max_runtime_s=job.max_runtime_s,
        dataset_uri=(job.config.get("data") or {}).get("uri", ""),
        tags={"trainboard-job-id": str(job.pk), "trainboard-owner-id": str(job.owner_id)},
    )


# =============================================================================================
# Small validation helpers
# =============================================================================================


class _Errors(dict):
    """field -> [messages]; ``raise_if_any`` raises one ValidationError with all of them."""

    def add(self, field: str, message: str) -> None:
        messages = self.setdefault(field, [])
        if message not in messages:  # two checks finding the same fault say it once
            messages.append(message)

    def raise_if_any(self) -> None:
        if self:
            raise ValidationError(dict(self))


MAX_RUNTIME_S = 28 * 24 * 3600
"""Longest max runtime a job may ask for: 28 days (2,419,200 s), SageMaker's maximum
``StoppingCondition.MaxRuntimeInSeconds`` (shared/reference/clouds.md); the same ceiling for every backend."""
MAX_NODES = 1000
"""Most nodes (instances) one job may ask for."""
MAX_PROCS_PER_NODE = 1024
"""Most trainer processes per node (one per GPU, or per CPU core on a CPU box)."""
MAX_EPOCHS = 100_000
MAX_BATCH_SIZE = 1_000_000
MAX_SEED = 2**32 - 1
"""Seeds are 0..2³²−1 (what NumPy's seeding takes; larger values overflow ``torch.manual_seed``
once the trainer adds its per-rank offsets)."""
MAX_COST_USD = Decimal("99999999.9999")
"""The largest cost the cost columns hold (12 digits, 4 after the point)."""


def _int(errors: _Errors, field: str, value: Any, *, minimum: int, label: str, maximum: int | None = None) -> int:
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            pass
    if number is None:
        errors.add(field, f"{label} must be a whole number, got {value!r}.")
        return minimum
    if number < minimum:
        errors.add(field, f"{label} must be at least {minimum}, got {number}.")
    elif maximum is not None and number > maximum:
        errors.add(field, f"{label} must be at most {maximum:,}, got {number:,}.")
        return maximum
    return number


def _shape_ints(errors: _Errors, nodes: Any, procs_per_node: Any, max_runtime_s: Any) -> tuple[int, int, int]:
    """Nodes, processes per node and max runtime (s) as whole numbers within their ranges."""
    return (_int(errors, "nodes", nodes, minimum=1, maximum=MAX_NODES, label="Nodes"),
            _int(errors, "procs_per_node", procs_per_node, minimum=1, maximum=MAX_PROCS_PER_NODE,
                 label="Processes per node"),
            _int(errors, "max_runtime_s", max_runtime_s, minimum=1, maximum=MAX_RUNTIME_S, label="Max runtime (s)"))


def _check_estimate(errors: _Errors, estimate: Decimal) -> None:
    """An estimate the cost columns cannot hold is refused (on ``max_runtime_s``, the usual cause)."""
    if estimate > MAX_COST_USD:
        places = costs.usd_places(estimate, MAX_COST_USD)
        errors.add("max_runtime_s", f"The estimate {costs.format_usd(estimate, places)} is more than Trainboard "
                                    f"records for one job ({costs.format_usd(MAX_COST_USD, places)}): lower the max "
                                    f"runtime, nodes or instance type.")


def _positive_float(errors: _Errors, field: str, value: Any, *, label: str) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        errors.add(field, f"{label} must be a number, got {value!r}.")
        return 1.0
    if not number > 0 or number != number or number == float("inf"):
        errors.add(field, f"{label} must be greater than 0, got {value!r}.")
    return number


def _budget(errors: _Errors, value: Any) -> Decimal | None:
    if value in (None, ""):
        return None
    try:
        if isinstance(value, bool):
            raise InvalidOperation
        budget = Decimal(str(value))
    except (InvalidOperation, ValueError):
        errors.add("budget_usd", f"Budget must be an amount in USD, e.g. 5.00, got {value!r}.")
        return None
    if not budget.is_finite() or budget <= 0:
        errors.add("budget_usd", f"Budget must be more than $0 (or empty for none), got {value!r}.")
        return None
    if budget > MAX_COST_USD:  # checked before quantize, which fails on a huge exponent
        errors.add("budget_usd", f"Budget must be at most ${MAX_COST_USD:,f}, got {value!r}.")
        return None
    return budget.quantize(costs.CENT_FRACTION)


def _hyperparameters(errors: _Errors, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    return _json_object(errors, "hyperparameters", value, what="Hyperparameters",
                        example='{"train": {"optimizer": "adamw"}} (trainer config overrides)') or {}


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and key != "params":
            out[key] = _deep_merge(out[key], value)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}  # model params: merged one level
        else:
            out[key] = value
    return out


def _flatten_keys(data: Mapping[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        keys.add(prefix + key)
        if isinstance(value, Mapping):
            keys |= _flatten_keys(value, f"{prefix}{key}.")
    return keys


# The form/API field that owns each JobConfig field the service fills from its arguments.
_CONFIG_FIELD_TO_ARG = {
    "parallel.strategy": "strategy",
    "parallel.nodes": "nodes",
    "parallel.procs_per_node": "procs_per_node",
    "parallel.pipeline_stages": "pipeline_stages",
    "parallel.microbatches": "microbatches",
    "parallel.pipeline_schedule": "pipeline_schedule",
    "train.epochs": "epochs",
    "train.batch_size": "batch_size",
    "train.lr": "lr",
    "train.seed": "seed",
}


def _pipeline_fields(pipeline_stages, microbatches, pipeline_schedule) -> dict[str, Any]:
    """The pipeline's ``parallel`` fields that were given (None: the JobConfig default)."""
    given = {"pipeline_stages": pipeline_stages, "microbatches": microbatches,
             "pipeline_schedule": pipeline_schedule}
    return {k: v for k, v in given.items() if v is not None}


def _config_error_field(dotted: str, overridden: set[str]) -> str:
    """Which form field a JobConfig error belongs to (``dotted`` like ``train.epochs``)."""
    if dotted in overridden or any(dotted.startswith(k + ".") for k in overridden):
        return "hyperparameters"
    if dotted in _CONFIG_FIELD_TO_ARG:
        return _CONFIG_FIELD_TO_ARG[dotted]
    if dotted.startswith("data."):
        return "dataset"
    if dotted.startswith("model."):
        return "model_spec"
    return "hyperparameters" if overridden else ALL


# The labels the job form shows (and the service's own messages use) for the fields above.
_ARG_LABELS = {
    "strategy": "Strategy", "nodes": "Nodes", "procs_per_node": "Processes per node",
    "pipeline_stages": "Pipeline stages", "microbatches": "Micro-batches", "pipeline_schedule": "Pipeline schedule",
    "epochs": "Epochs", "batch_size": "Batch size", "lr": "Learning rate", "seed": "Seed",
}


def _config_message(dotted: str, field: str, text: str) -> str:
    """``text`` (a JobConfig error, ``parallel.pipeline_stages: ...``) worded for ``field``: a field the
    user filled in is named by its label (``Pipeline stages: ...``), as the form and the API ask for it;
    in the hyperparameters the config path is what the user wrote, so it stays."""
    label = _ARG_LABELS.get(field)
    prefix = f"{dotted}:"
    if label is None or not text.startswith(prefix):
        return text
    return f"{label}:{text[len(prefix):]}"


def _add_config_error(errors: _Errors, exc_or_msg: Any, overridden: set[str]) -> None:
    text = str(exc_or_msg)
    dotted = text.split(":", 1)[0].strip() if ":" in text else ""
    field = _config_error_field(dotted, overridden) if dotted and " " not in dotted else (
        "hyperparameters" if overridden else ALL
    )
    errors.add(field, _config_message(dotted, field, text))


def _spec_error_field(message: str) -> str:
    """The form field an adapter's InvalidSpec message is about (the message shows the arithmetic)."""
    lowered = message.lower()
    for needle, field in (
        ("process", "procs_per_node"), ("node", "nodes"), ("spot", "spot"),
        ("instance", "instance_type"), ("runtime", "max_runtime_s"), ("strateg", "strategy"),
    ):
        if needle in lowered:
            return field
    return ALL


def _owned(errors: _Errors, field: str, model: type, value: Any, owner: Any, label: str) -> Any:
    """``value`` (an instance or a pk) when it exists and ``owner`` may use it: it is theirs, or it is
    shared with a team they are a member of (a teammate may launch on a team's backend, dataset and
    model). Else an error on ``field`` (a pk that is not an integer is the same error, not a crash)."""
    from jobs.models import Team

    obj = value
    if not isinstance(value, model):
        try:
            obj = model.objects.filter(pk=int(value)).first() if value not in (None, "") else None
        except (TypeError, ValueError, OverflowError):
            obj = None
    owner_pk = getattr(owner, "pk", None)
    usable = obj is not None and owner_pk is not None and (
        obj.owner_id == owner_pk
        or (obj.team_id is not None and Team.objects.filter(pk=obj.team_id, members__pk=owner_pk).exists()))
    if not usable:
        errors.add(field, f"Choose one of your {label}s; this one does not exist or is not yours.")
        return None
    return obj


def _adapter_or_error(errors: _Errors, backend: ComputeBackend | None) -> Backend | None:
    if backend is None:
        return None
    if not backend.enabled:
        errors.add("backend", f"Backend {backend.name} is disabled; enable it in the admin or choose another.")
        return None
    try:
        return backend_adapter(backend)
    except (BackendError, LookupError, ValueError, TypeError) as exc:
        errors.add("backend", f"Backend {backend.name} cannot be used: {exc}")
        return None


def _check_spec(errors: _Errors, adapter: Backend, spec: JobSpec, strategy: str,
                dataset: Dataset | None = None) -> None:
    caps = adapter.capabilities
    if strategy not in caps.strategies:
        # An image whose torch is too old says which version the strategy needs (Backend.strategy_error).
        errors.add("strategy", adapter.strategy_error(strategy) or (
            f"This backend runs {', '.join(caps.strategies) or 'no strategy'}; {strategy!r} is not one of them."))
    spec = _check_dataset_scheme(errors, adapter, spec, dataset)
    try:
        adapter.validate(spec)
    except InvalidSpec as exc:
        errors.add(_spec_error_field(str(exc)), str(exc))


def _check_dataset_scheme(errors: _Errors, adapter: Backend, spec: JobSpec, dataset: Dataset | None) -> JobSpec:
    """An error on ``dataset`` when the adapter cannot read the scheme of ``spec.dataset_uri``
    (``Backend.dataset_schemes``: an ``s3://`` dataset on a GPU box would fail at run time), naming
    the dataset, the scheme and the backend kind. Returns the spec to validate further: without the
    URI when it was refused, so the adapter does not report the same dataset a second time."""
    from cloud_adapters.base import scheme_label, uri_scheme, with_article
    from cloud_adapters.registry import KINDS

    scheme = uri_scheme(spec.dataset_uri)
    if not spec.dataset_uri or scheme in adapter.dataset_schemes:
        return spec
    kind = KINDS[adapter.kind].label if adapter.kind in KINDS else adapter.kind
    named = f"Dataset {dataset.name}" if dataset is not None and dataset.uri == spec.dataset_uri else "The dataset"
    reads = " or ".join(sorted(scheme_label(s) for s in adapter.dataset_schemes)) or "no dataset URIs"
    errors.add("dataset", f"{named} ({spec.dataset_uri[:200]}) cannot be read by {with_article(kind)} backend: "
                          f"it reads {reads}, not {scheme_label(scheme)}. Choose a dataset stored where this "
                          f"backend reads, or a backend that reads {scheme_label(scheme)}.")
    return dataclasses.replace(spec, dataset_uri="")


MAX_HOURLY_PRICE_USD = Decimal("999999.999999")
"""The largest price per instance-hour the price columns hold (12 digits, 6 after the point)."""


def _storable_price(usd_per_hour: Any) -> Decimal | None:
    """``usd_per_hour`` as the price columns hold it, or None when they cannot (negative, NaN,
    infinite, or past :data:`MAX_HOURLY_PRICE_USD`, where rounding it raised InvalidOperation)."""
    try:
        exact = Decimal(str(usd_per_hour))
    except (InvalidOperation, ValueError, TypeError):
        return None
    if not exact.is_finite() or not 0 <= exact <= MAX_HOURLY_PRICE_USD:
        return None
    return costs.to_decimal(exact, costs.PRICE_FRACTION)


def _hourly_price(errors: _Errors, adapter: Backend, instance_type: str, spot: bool) -> Decimal:
    try:
        usd_per_hour = adapter.price(instance_type, spot)
    except BackendError as exc:
        errors.add("instance_type", str(exc))
        return Decimal("0")
    price = _storable_price(usd_per_hour)
    if price is None:
        # A backend's settings multiply its price (Vertex: accelerators per machine), so they can
        # reach a figure no cost can be recorded for.
        errors.add("backend", f"This backend prices an instance-hour at {usd_per_hour!r} USD, outside what Trainboard "
                              f"records ($0 to ${MAX_HOURLY_PRICE_USD:,f}); check its settings, e.g. the "
                              f"accelerators per machine.")
        return Decimal("0")
    return price


def _on_demand_price(adapter: Backend, instance_type: str, spot: bool, hourly: Decimal) -> Decimal | None:
    """The on-demand price per instance-hour a job is compared with (``Backend.on_demand_price``):
    ``hourly`` itself for an on-demand job; None when the catalog has no on-demand row (the job is
    then compared at its own price, as jobs created before the figure was kept)."""
    if not spot:
        return hourly
    try:
        return _storable_price(adapter.on_demand_price(instance_type))
    except BackendError:
        return None


def _name_taken(model: type, owner: Any, name: str, exclude_pk: Any = None) -> bool:
    if validation.text_problem(name) is not None:
        return False  # no row holds such a name (_full_clean says why); PostgreSQL refuses it in a query too
    qs = model.objects.filter(owner=owner, name=name)
    if exclude_pk is not None:
        qs = qs.exclude(pk=exclude_pk)
    return qs.exists()


def _full_clean(errors: _Errors, obj: Any) -> None:
    """The model's own field checks, plus: no text column may hold a NUL or an unpaired surrogate
    (:func:`jobs.validation.text_problem`; PostgreSQL refuses the row, a 500 otherwise)."""
    for model_field in obj._meta.concrete_fields:
        value = getattr(obj, model_field.attname, None)
        if isinstance(value, str) and (problem := validation.text_problem(value)) is not None:
            errors.add(model_field.name, f"{model_field.verbose_name[:1].upper()}{model_field.verbose_name[1:]} {problem}")
    try:
        obj.full_clean(exclude=["owner"], validate_unique=False, validate_constraints=False)
    except ValidationError as exc:
        for field, messages in exc.message_dict.items():
            for message in messages:
                errors.add(field, message)


# =============================================================================================
# Datasets
# =============================================================================================

_DATASET_FIELDS = {"name", "description", "format", "builtin_name", "uri", "label_column", "team"}


def _json_object(errors: _Errors, field: str, value: Any, *, what: str, example: str,
                 plural: bool = True) -> dict | None:
    """``value`` as a dict: a dict, or a JSON object in a string ("" is {}). None, with errors on
    ``field``, when it is neither, or when it holds what cannot be stored (NaN or an infinite number,
    a NUL character, nesting past ``jobs.validation.MAX_JSON_DEPTH``: each problem a message)."""
    if isinstance(value, str):
        try:
            value = validation.loads(value) if value.strip() else {}
        except validation.JSONInputError as exc:
            bad = exc.decode_error
            errors.add(field, f"{what} {'are' if plural else 'is'} not valid JSON: {bad.msg} at line "
                              f"{bad.lineno} column {bad.colno}." if bad else f"{what}: {exc}")
            return None
    if not isinstance(value, dict):
        errors.add(field, f"{what} must be a JSON object, e.g. {example}.")
        return None
    problems = validation.json_problems(value)
    for problem in problems:
        errors.add(field, f"{what}: {problem}")
    return None if problems else value


def _update(instance: Any, fields: Mapping[str, Any], *, allowed: set[str], validate: Any,
            empty: Mapping[str, Any] | None = None, errors: _Errors | None = None) -> Any:
    """Set ``fields`` on ``instance``, validate with ``validate(errors, instance)`` and save; on any
    error restore every field and raise (the row is untouched). ``None`` becomes ``empty[field]``
    (or ""). An unknown field name is a programming error: TypeError."""
    unknown = set(fields) - allowed
    if unknown:
        raise TypeError(f"{type(instance).__name__}: unknown fields {sorted(unknown)}")
    original = {f: getattr(instance, f) for f in allowed}
    for field, value in fields.items():
        setattr(instance, field, (empty or {}).get(field, "") if value is None else value)
    errors = errors if errors is not None else _Errors()
    validate(errors, instance)
    if errors:
        for field, value in original.items():
            setattr(instance, field, value)
        errors.raise_if_any()
    instance.save()
    return instance


def _validate_dataset(errors: _Errors, dataset: Dataset) -> None:
    from typing import get_args

    from trainer_pkg.config import BuiltinDataset

    _full_clean(errors, dataset)
    if dataset.name and _name_taken(Dataset, dataset.owner, dataset.name, dataset.pk):
        errors.add("name", f"You already have a dataset named {dataset.name}; choose another name.")
    if dataset.team_id is not None and not dataset.team.members.filter(pk=dataset.owner_id).exists():
        errors.add("team", "Choose one of your teams; you are not a member of this one.")
    from trainer_pkg.datasets import inspect_dataset

    dataset.sample_shape = None  # a cloud URI is not read here: its shape is not known
    if dataset.format == Dataset.Format.BUILTIN:
        known = get_args(BuiltinDataset)
        if dataset.builtin_name not in known:
            errors.add("builtin_name", f"Choose a built-in dataset: {', '.join(known)}.")
        else:
            dataset.sample_shape = list(inspect_dataset(dataset.format, dataset.builtin_name).sample_shape)
        dataset.uri = ""
        return
    dataset.builtin_name = ""
    if "format" in errors:  # what the URI must hold depends on the format
        return
    if not dataset.uri:
        errors.add("uri", f"Path or URI is required for a dataset in {Dataset.Format(dataset.format).label} format.")
        return
    if ("://" not in dataset.uri or dataset.uri.startswith("file://")) and "format" not in errors:
        # A local path: it must lie inside an allowed root, then the trainer's own loader says
        # whether it can read it, in its words, and what shape its samples have.
        path = _dataset_local_path(errors, dataset.uri)
        if path is None:
            return
        dataset.uri = path
        try:
            info = inspect_dataset(dataset.format, dataset.uri, dataset.label_column or "label")
        except ConfigError as exc:
            errors.add("uri", str(exc))
        else:
            dataset.sample_shape = list(info.sample_shape)


def _dataset_local_path(errors: _Errors, uri: str) -> str | None:
    """``uri`` (a path, or ``file://`` + path) as an absolute path with symlinks and ``..`` resolved,
    when it lies inside one of ``settings.TRAINBOARD_DATASET_ROOTS`` (a relative path is taken
    relative to the first root). None, with an error on ``uri``, when it escapes them."""
    from pathlib import Path

    roots = [Path(r).resolve() for r in getattr(settings, "TRAINBOARD_DATASET_ROOTS", ())]
    raw = uri[len("file://"):] if uri.startswith("file://") else uri
    if "\x00" in raw or not roots:
        errors.add("uri", "Local dataset paths are not allowed here; use an s3://, gs:// or azureml:// URI.")
        return None
    candidate = Path(raw)
    resolved = (candidate if candidate.is_absolute() else roots[0] / candidate).resolve()
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        errors.add("uri", f"A local dataset must lie inside {' or '.join(str(r) for r in roots)} "
                          f"(TRAINBOARD_DATASET_ROOTS); put the data there or give a path relative to it.")
        return None
    return str(resolved)


def dataset_create(*, owner, name: str, format: str, builtin_name: str = "", uri: str = "",
                   label_column: str = "label", description: str = "", team=None) -> Dataset:
    """Register a dataset: built-in (``builtin_name`` "digits") or a ``uri`` in one of the formats.

    ``team`` (a Team or its pk; None/"" = private) must be one of ``owner``'s teams: its members then
    see the dataset and may launch jobs with it. Raises ValidationError keyed by field; nothing is
    saved then.
    """
    errors = _Errors()
    team = _member_team(errors, team, owner)
    dataset = Dataset(owner=owner, name=(name or "").strip(), format=format, builtin_name=builtin_name or "",
                      uri=(uri or "").strip(), label_column=label_column or "label",
                      description=description or "", team=team)
    _validate_dataset(errors, dataset)
    errors.raise_if_any()
    dataset.save()
    return dataset


def _team_field(errors: _Errors, fields: Mapping[str, Any], owner: Any) -> dict[str, Any]:
    """``fields`` with a ``team`` pk resolved to the Team (one of ``owner``'s teams; else an error on
    ``team`` and the field left out so the row keeps its team)."""
    if "team" not in fields:
        return dict(fields)
    fields = dict(fields)
    team = _member_team(errors, fields["team"], owner)
    if team is None and fields["team"] not in (None, ""):
        fields.pop("team")
    else:
        fields["team"] = team
    return fields


def dataset_update(*, dataset: Dataset, **fields: Any) -> Dataset:
    """Change some of ``name, description, format, builtin_name, uri, label_column, team`` (``team``:
    a Team or pk of one of the owner's teams, None = private). Raises ValidationError; the row is
    untouched then."""
    errors = _Errors()
    fields = _team_field(errors, fields, dataset.owner)
    return _update(dataset, fields, allowed=_DATASET_FIELDS, validate=_validate_dataset,
                   empty={"team": None}, errors=errors)


# =============================================================================================
# Model specs
# =============================================================================================

_MODEL_FIELDS = {"name", "description", "architecture", "params", "team"}


def _validate_model_spec(errors: _Errors, spec: ModelSpec) -> None:
    from trainer_pkg.registry import validate_model_params

    _full_clean(errors, spec)
    if spec.name and _name_taken(ModelSpec, spec.owner, spec.name, spec.pk):
        errors.add("name", f"You already have a model named {spec.name}; choose another name.")
    if spec.team_id is not None and not spec.team.members.filter(pk=spec.owner_id).exists():
        errors.add("team", "Choose one of your teams; you are not a member of this one.")
    from trainer_pkg.registry import ARCHITECTURES

    arch = ARCHITECTURES.get(spec.architecture)
    example = json.dumps(arch.defaults()) if arch else '{"hidden_size": 128}'
    params = _json_object(errors, "params", spec.params, what="Parameters", example=example)
    if params is None:
        return
    try:
        spec.params = validate_model_params(spec.architecture, params)
    except ConfigError as exc:
        field = "architecture" if str(exc).startswith("model.arch") else "params"
        errors.add(field, _param_message(str(exc)))


def _param_message(text: str) -> str:
    """A model-parameter error (``model.params.num_layers: unknown parameter for cnn``) worded for the
    Parameters field the user filled in: ``Parameter num_layers: unknown parameter for cnn``."""
    path, sep, rest = text.partition(":")
    if not sep or not path.startswith("model.params"):
        return text
    name = path[len("model.params"):].lstrip(".")
    return f"Parameter {name}:{rest}" if name else f"Parameters:{rest}"


def model_spec_create(*, owner, name: str, architecture: str, params: dict | None = None,
                      description: str = "", team=None) -> ModelSpec:
    """Register a model: an architecture from the trainer's registry; ``params`` completed with defaults.

    ``team`` (a Team or its pk; None/"" = private) must be one of ``owner``'s teams: its members then
    see the model and may launch jobs with it. Raises ValidationError keyed by field.
    """
    errors = _Errors()
    team = _member_team(errors, team, owner)
    spec = ModelSpec(owner=owner, name=(name or "").strip(), architecture=architecture or "",
                     params=params if params is not None else {}, description=description or "", team=team)
    _validate_model_spec(errors, spec)
    errors.raise_if_any()
    spec.save()
    return spec


def model_spec_update(*, model_spec: ModelSpec, **fields: Any) -> ModelSpec:
    """Change some of ``name, description, architecture, params, team`` (params re-validated; ``team``
    as for :func:`dataset_update`). A new ``architecture`` without ``params`` takes that
    architecture's default parameters (the old ones belong to the old architecture), as the form's
    parameters follow its architecture. Raises ValidationError; the row is untouched then."""
    errors = _Errors()
    if "params" not in fields and fields.get("architecture", model_spec.architecture) != model_spec.architecture:
        fields = {**fields, "params": {}}  # completed with the new architecture's defaults
    fields = _team_field(errors, fields, model_spec.owner)
    return _update(model_spec, fields, allowed=_MODEL_FIELDS, validate=_validate_model_spec,
                   empty={"params": {}, "team": None}, errors=errors)


# =============================================================================================
# Compute backends
# =============================================================================================

_BACKEND_FIELDS = {"name", "kind", "config", "enabled", "team", "state_deadlines", "stall_policy", "orphan_policy"}


def backend_secret_keys(kind: str) -> dict[str, bool]:
    """The secret keys a backend of ``kind`` accepts, each mapped to whether it is required once any
    secret is given (e.g. sagemaker: ``aws_access_key_id``/``aws_secret_access_key`` required,
    ``aws_session_token`` optional). Declared by each adapter class as ``secret_keys``; {} for a kind
    that stores no secret (gpubox) or is unknown."""
    from cloud_adapters.registry import backend_class

    try:
        return dict(getattr(backend_class(kind), "secret_keys", None) or {})
    except (LookupError, ValueError, BackendError):
        return {}


def _clean_secrets(errors: _Errors, kind: str, secrets: Any) -> dict[str, str] | None:
    """``secrets`` checked against the kind's accepted keys: a dict of non-empty strings; {} stores
    none. Errors go on ``secrets`` and name keys only, never values. None when invalid."""
    if not isinstance(secrets, Mapping):
        errors.add("secrets", "Secrets must be an object of key: value strings.")
        return None
    cleaned = {str(k): v for k, v in secrets.items() if v not in (None, "")}
    if not cleaned:
        return {}
    from cloud_adapters.base import with_article
    from cloud_adapters.registry import KINDS

    accepted = backend_secret_keys(kind)
    label = KINDS[kind].label if kind in KINDS else "this"
    unknown = sorted(set(cleaned) - set(accepted))
    if unknown:
        allowed = ", ".join(sorted(accepted)) if accepted else "none (it uses the worker's own identity)"
        errors.add("secrets", f"{', '.join(unknown)}: not a secret {with_article(label)} backend takes; it takes "
                              f"{allowed}.")
        return None
    if any(not isinstance(v, str) for v in cleaned.values()):
        errors.add("secrets", "Each secret must be a string.")
        return None
    missing = sorted(k for k, required in accepted.items() if required and k not in cleaned)
    if missing:
        errors.add("secrets", f"{', '.join(missing)}: required with the other {label} secrets (give all of "
                              f"{', '.join(k for k, r in accepted.items() if r)}, or none to use the worker's identity).")
        return None
    return cleaned


def _validate_backend(errors: _Errors, backend: ComputeBackend) -> None:
    from cloud_adapters.registry import backend_class

    _full_clean(errors, backend)
    if backend.name and _name_taken(ComputeBackend, backend.owner, backend.name, backend.pk):
        errors.add("name", f"You already have a backend named {backend.name}; choose another name.")
    from jobs.recovery import clean_state_deadlines  # stalled-job deadlines (jobs.recovery)

    backend.state_deadlines, deadline_errors = clean_state_deadlines(backend.state_deadlines)
    for message in deadline_errors:
        errors.add("state_deadlines", message)
    if backend.team_id is not None and not backend.team.members.filter(pk=backend.owner_id).exists():
        errors.add("team", "Choose one of your teams; you are not a member of this one.")
    config = _json_object(errors, "config", backend.config, what="Config", example='{"hourly_rate_usd": 1.5}',
                          plural=False)
    if config is None:
        return
    try:
        cls = backend_class(backend.kind)
    except (LookupError, ValueError, BackendError) as exc:
        errors.add("kind", str(exc) or f"Unknown backend kind {backend.kind!r}.")
        return
    secrets = _clean_secrets(errors, backend.kind, backend.secrets)
    if secrets is not None:
        backend.secrets = secrets
    staff_owned = may_set_host_settings(backend.owner)
    if not staff_owned:
        sources = HOST_SETTING_SOURCES.get(backend.kind, {})
        labels = backend_setting_labels(backend.kind)
        for key in sorted(set(config) & backend_host_settings(backend.kind)):
            if config[key] in (None, ""):
                continue
            source = f" ({sources[key]})" if key in sources else ""
            # Keyed by the setting, worded with its label, like the adapter's own settings errors.
            errors.add(f"config.{key}", f"{labels.get(key, key)}: only a backend owned by staff may set this; it decides what the "
                                 f"installation's machines run or where they send their calls, which "
                                 f"is the operator's choice{source}. Remove it to use the "
                                 f"installation's value.")
    effective = _effective_config(backend.kind, config, host_settings_from_row=staff_owned)
    refusal = worker_credentials_refusal(cls, effective, secrets, backend.owner) if secrets is not None else None
    if refusal:
        # Named by the first key to give, as the other secrets messages are, so the form puts it there.
        first = next(k for k, required in cls.secret_keys.items() if required)
        errors.add("secrets", f"{first}: required, because {refusal}")
    try:
        cleaned = cls.clean_config(effective)
    except InvalidSpec as exc:
        # Every setting's problem at once, each under ``config.<setting key>`` (the form puts it on
        # that setting's field; the API lists them under ``config``).
        for key, messages in (exc.errors or {_setting_named(str(exc)): [str(exc)]}).items():
            for message in messages:
                errors.add(f"config.{key}" if key else "config", message)
        return
    except (BackendError, ValueError, TypeError) as exc:
        errors.add("config", str(exc))
        return
    # Store what the admin set (normalised), not the defaults the adapter or this host filled in:
    # those are decided where the backend is used (a worker's interpreter, its run root).
    backend.config = {k: cleaned.get(k, v) for k, v in config.items()}


def _setting_named(message: str) -> str:
    """The setting key an adapter's single message starts with (``"project: required…"``), or ""."""
    head = message.split(":", 1)[0].strip() if ":" in message else ""
    return head if head.isidentifier() else ""


def backend_create(*, owner, name: str, kind: str, config: dict | None = None, enabled: bool = True,
                   secrets: Mapping[str, str] | None = None, team=None,
                   state_deadlines: Mapping[str, float] | None = None, stall_policy: str = "warn",
                   orphan_policy: str = "report") -> ComputeBackend:
    """Register a compute backend; ``config`` is checked by the adapter's ``clean_config``.

    ``secrets``: credentials for the kind (:func:`backend_secret_keys`), stored encrypted; {} or
    None: the worker's own identity. ``team``: a Team ``owner`` is a member of (shares it), or None.
    ``state_deadlines``: ``{state: seconds}`` for non-terminal states (missing ones use
    ``settings.TRAINBOARD_STATE_DEADLINES_S``; RUNNING: max runtime + margin); ``stall_policy``
    "warn" | "cancel" (what a job past its deadline gets); ``orphan_policy`` "report" | "stop".
    Raises ValidationError keyed by field (``secrets`` messages name keys, never values).
    """
    backend = ComputeBackend(owner=owner, name=(name or "").strip(), kind=kind or "",
                             config=config if config is not None else {}, enabled=bool(enabled),
                             secrets=secrets if secrets is not None else {}, team=team,
                             state_deadlines=state_deadlines if state_deadlines is not None else {},
                             stall_policy=stall_policy or "", orphan_policy=orphan_policy or "")
    errors = _Errors()
    _validate_backend(errors, backend)
    errors.raise_if_any()
    backend.save()
    return backend


def backend_update(*, backend: ComputeBackend, secrets: Mapping[str, str | None] | None = None,
                   clear_secrets: bool = False, **fields: Any) -> ComputeBackend:
    """Change some of ``name, kind, config, enabled, team, state_deadlines, stall_policy,
    orphan_policy`` (as for :func:`backend_create`; None deadlines = the defaults); the kind only
    while no job is active.

    ``secrets`` is merged into the stored ones: a key with a non-empty value replaces that secret, a
    blank or missing key keeps it (write-only forms send blanks). ``clear_secrets`` removes all stored
    secrets first. Raises ValidationError; nothing is saved then.
    """
    errors = _Errors()
    if "kind" in fields and fields["kind"] != backend.kind and backend.pk and \
            backend.jobs.filter(state__in=ACTIVE_STATE_VALUES).exists():
        errors.add("kind", "This backend has active jobs; wait for them to end before changing its kind.")
    if secrets is not None and not isinstance(secrets, Mapping):
        errors.add("secrets", "Secrets must be an object of key: value strings.")
        errors.raise_if_any()
    if clear_secrets or secrets:
        merged = {} if clear_secrets else dict(backend.secrets or {})
        merged.update({k: v for k, v in (secrets or {}).items() if v not in (None, "")})
        fields = {**fields, "secrets": merged}
    return _update(backend, fields, allowed=_BACKEND_FIELDS | {"secrets"}, validate=_validate_backend,
                   empty={"config": {}, "secrets": {}, "team": None, "state_deadlines": {}}, errors=errors)


def backend_test_connection(*, backend: ComputeBackend, user) -> list[ConnectionCheck]:
    """Check that ``backend`` is usable with its saved settings and the credentials at hand.

    Calls the adapter's ``test_connection()`` (read-only provider calls: for a cloud, identity,
    bucket and API access) and returns its checks, each ``ok`` or not with a message saying what to
    fix. Never raises for a failed check: settings the adapter rejects (a BackendError while
    building it, e.g. a missing role ARN or SDK) and an adapter that raises while testing become one
    failed check. A disabled backend is tested too (test before enabling). ``user`` must own the
    backend or be a superuser, else ValidationError on ``__all__``.
    """
    if not (getattr(user, "is_superuser", False) or backend.owner_id == getattr(user, "pk", None)):
        raise ValidationError({ALL: [f"Backend {backend.name} is not yours to test."]})
    try:
        adapter = backend_adapter(backend)
    except (BackendError, LookupError, ValueError, TypeError) as exc:
        return [ConnectionCheck("settings", False, f"Backend {backend.name} cannot be used: {exc} "
                                                   f"Fix its settings and test again.")]
    try:
        checks = list(adapter.test_connection())
    except Exception as exc:  # the contract says adapters do not raise here; a bug must not be a 500
        log.exception("backend %s: test_connection raised", backend.pk)
        return [ConnectionCheck("connection", False, f"The {backend.kind} adapter failed while testing "
                                                     f"({type(exc).__name__}: {exc}).")]
    log.info("backend %s tested by %s: %s", backend.pk, getattr(user, "pk", None),
             ", ".join(f"{c.name}={'ok' if c.ok else 'failed'}" for c in checks))
    return checks


class BackendOffers(NamedTuple):
    """What the job form offers on one backend (:func:`backend_instance_offers`)."""

    offers: list[InstanceOffer]  # instance types with catalog prices; empty for the gpubox
    spot: bool  # has spot / low-priority capacity
    strategies: tuple[str, ...]  # the strategies its image runs (Capabilities.strategies)


def backend_instance_offers(*, backend: ComputeBackend) -> BackendOffers:
    """``(offers, spot, strategies)`` for the job form: the instance types ``backend``'s adapter offers
    with their catalog prices (``Backend.instance_offers``; empty for the gpubox), whether it has spot
    capacity, and the strategies its image's torch runs. A backend whose adapter cannot be built
    offers nothing and every strategy (its error shows at submit)."""
    try:
        adapter = backend_adapter(backend)
        caps = adapter.capabilities
        return BackendOffers(list(adapter.instance_offers()), bool(caps.spot), tuple(caps.strategies))
    except (BackendError, LookupError, ValueError, TypeError) as exc:
        log.info("backend %s: no instance offers (%s)", backend.pk, exc)
        return BackendOffers([], False, tuple(get_args(Strategy)))


# =============================================================================================
# Instance prices (admin-managed catalog; DESIGN.md §6)
# =============================================================================================

_PRICE_FIELDS = ("usd_per_hour", "source", "as_of", "confirmed")


def _price_values(errors: _Errors, row: PriceRow, label: str) -> dict[str, Any]:
    from jobs.pricing import parse_as_of

    values: dict[str, Any] = {"source": (row.source or "")[:500], "confirmed": bool(row.confirmed)}
    if row.provider not in InstancePrice.Provider.values:
        errors.add("provider", f"{label}: provider must be one of {', '.join(InstancePrice.Provider.values)}, "
                               f"got {row.provider!r}.")
    if not row.region or not row.instance_type:
        errors.add(ALL, f"{label}: region and instance type are required.")
    try:
        price = Decimal(str(row.usd_per_hour))
        if not price.is_finite() or price < 0:
            raise InvalidOperation
        values["usd_per_hour"] = price.quantize(costs.PRICE_FRACTION)
    except (InvalidOperation, ValueError):
        errors.add("usd_per_hour", f"{label}: USD per hour must be a number ≥ 0, got {row.usd_per_hour!r}.")
    try:
        values["as_of"] = parse_as_of(row.as_of)
    except ValueError as exc:
        errors.add("as_of", f"{label}: {exc}.")
    return values


def instance_price_upsert(*, rows: list[PriceRow], overwrite: bool = True) -> dict[str, int]:
    """Store catalog rows as :class:`InstancePrice`, keyed by (provider, region, instance type).

    New keys are created; existing ones are updated when ``overwrite`` (a refresh from a price API)
    and left alone otherwise (seeding never undoes an admin's edit). One transaction: a bad row
    raises ValidationError naming it and nothing is written. Returns ``{"created", "updated",
    "unchanged"}`` counts (an overwrite with identical values counts as unchanged).
    """
    errors = _Errors()
    prepared = []
    for row in rows:
        label = f"{row.provider} {row.region} {row.instance_type}"
        prepared.append((row, _price_values(errors, row, label)))
    errors.raise_if_any()
    counts = {"created": 0, "updated": 0, "unchanged": 0}
    with transaction.atomic():
        for row, values in prepared:
            existing = (InstancePrice.objects.select_for_update()
                        .filter(provider=row.provider, region=row.region, instance_type=row.instance_type).first())
            if existing is None:
                InstancePrice.objects.create(provider=row.provider, region=row.region,
                                             instance_type=row.instance_type, **values)
                counts["created"] += 1
            elif overwrite and any(getattr(existing, f) != values[f] for f in _PRICE_FIELDS):
                for field in _PRICE_FIELDS:
                    setattr(existing, field, values[field])
                existing.save()
                counts["updated"] += 1
            else:
                counts["unchanged"] += 1
    return counts


def instance_price_seed(*, overwrite: bool = False) -> dict[str, int]:
    """Load the catalog shipped with the adapters (``cloud_adapters/data/prices.csv``) into
    :class:`InstancePrice`. Idempotent: rows already stored are kept as they are unless
    ``overwrite`` (then the shipped figures replace them). Counts as :func:`instance_price_upsert`."""
    from cloud_adapters.pricing import shipped_catalog

    catalog = shipped_catalog()
    rows = [row for provider in InstancePrice.Provider.values for row in catalog.rows(provider)]
    return instance_price_upsert(rows=rows, overwrite=overwrite)


def instance_price_save(*, price: InstancePrice | None = None, provider: str, region: str, instance_type: str,
                        usd_per_hour: Any, source: str = "", as_of: Any = None,
                        confirmed: bool = False) -> InstancePrice:
    """Create (``price`` None) or change one catalog row (the admin's form). ValidationError keyed by
    field; the (provider, region, instance type) must not belong to another row."""
    errors = _Errors()
    row = PriceRow(provider=provider, region=(region or "").strip(), instance_type=(instance_type or "").strip(),
                   usd_per_hour=usd_per_hour, source=source or "", as_of=as_of or "", confirmed=bool(confirmed))
    values = _price_values(errors, row, f"{row.provider} {row.region} {row.instance_type}")
    clash = InstancePrice.objects.filter(provider=row.provider, region=row.region, instance_type=row.instance_type)
    if price is not None and price.pk:
        clash = clash.exclude(pk=price.pk)
    if clash.exists():
        errors.add("instance_type", f"{row.instance_type} in {row.provider} {row.region} already has a price; "
                                    f"edit that row instead.")
    errors.raise_if_any()
    price = price or InstancePrice()
    price.provider, price.region, price.instance_type = row.provider, row.region, row.instance_type
    for field in _PRICE_FIELDS:
        setattr(price, field, values[field])
    price.save()
    return price


# =============================================================================================
# Training jobs: create, estimate, re-run
# =============================================================================================


def _enqueue_submit(job_id: int, queue: str) -> None:
    from jobs import tasks

    _send(tasks.submit_job, job_id, queue, "the recovery sweep re-sends it")


def _enqueue_cancel(job_id: int, queue: str) -> None:
    from jobs import tasks

    _send(tasks.cancel_job, job_id, queue, "every sync re-sends the cancel of a STOPPING job")


def _send(task, job_id: int, queue: str, then: str) -> None:
    """Publish ``task(job_id)``; a broker that is down (restarting) is logged, not raised: the row is
    already committed and the database is the source of truth, so the request still succeeds."""
    from kombu.exceptions import OperationalError

    try:
        task.apply_async(args=[job_id], queue=queue)
    except (OperationalError, OSError) as exc:
        log.warning("job %s: could not send %s (%s); %s", job_id, task.name, exc, then)


def _store_job(*, owner, dataset, model_spec, backend, config: dict[str, Any], strategy: str, nodes: int,
               procs_per_node: int, instance_type: str, spot: bool, max_runtime_s: int,
               budget_usd: Decimal | None, hourly_price: Decimal, name: str,
               rerun_of: TrainingJob | None, team=None, on_demand_price: Decimal | None = None) -> TrainingJob:
    """Create the QUEUED row, its event and (on commit) its submit message, in one transaction that
    first checks the owner's and the team's monthly budgets under row locks (jobs.budgets); a
    refusal (ValidationError with the figures) writes nothing."""
    from jobs.budgets import check_monthly_budgets

    estimate = costs.estimate_cost_usd(max_runtime_s=max_runtime_s, instances=nodes, hourly_price_usd=hourly_price,
                                       budget_usd=budget_usd)
    errors = _Errors()
    _check_estimate(errors, estimate)
    errors.raise_if_any()
    with transaction.atomic():
        check_monthly_budgets(owner=owner, team=team, estimate=estimate)
        job = TrainingJob.objects.create(
            owner=owner, team=team, name=name, dataset=dataset, model_spec=model_spec, backend=backend,
            rerun_of=rerun_of, config=config, strategy=strategy, nodes=nodes,
            procs_per_node=procs_per_node, instance_type=instance_type, spot=spot,
            max_runtime_s=max_runtime_s, budget_usd=budget_usd, hourly_price_usd=hourly_price,
            on_demand_price_usd=on_demand_price,
            estimated_cost_usd=estimate, instance_count=nodes, state=S.QUEUED,
            state_entered_at=timezone.now(),
        )
        job.provider_job_name = provider_job_name(job)
        job.save(update_fields=["provider_job_name"])
        message = f"Re-run of job {rerun_of.pk}" if rerun_of else "Created"
        JobEvent.objects.create(job=job, from_state="", to_state=S.QUEUED, message=message)
        transaction.on_commit(partial(_enqueue_submit, job.pk, backend_queue(backend)))
    return job


def training_job_create(*, owner, dataset, model_spec, backend, strategy: str = "ddp", nodes: int = 1,
                        procs_per_node: int = 1, pipeline_stages: int | None = None,
                        microbatches: int | None = None, pipeline_schedule: str | None = None,
                        epochs: int = 3, batch_size: int = 32, lr: float = 0.05,
                        seed: int = 0, max_runtime_s: int = 3600, budget_usd=None, instance_type: str = "",
                        spot: bool = False, hyperparameters=None, name: str = "",
                        rerun_of: TrainingJob | None = None, team=None) -> TrainingJob:
    """Validate a job, store it QUEUED with its frozen trainer config, enqueue its submission.

    ``dataset``/``model_spec``/``backend`` are instances (or pks) that must belong to ``owner``.
    ``hyperparameters`` (dict or JSON text) are JobConfig overrides merged over the arguments, e.g.
    ``{"train": {"optimizer": "adamw"}}``. The backend checks the shape (``Backend.validate``).
    ``jobs.tasks.submit_job`` is sent to the backend's queue when the transaction commits.
    ``team`` (a Team or its pk; None/"" = no team) must be one of the owner's teams: the job is then
    shared with it and counts toward its monthly budget. A submission whose estimate would take the
    owner's or the team's month-to-date spend past its monthly budget is refused with the figures
    (``jobs.budgets``).
    Raises ValidationError keyed by these argument names; writes nothing then.
    """
    from trainer_pkg.registry import validate_model_params

    errors = _Errors()
    dataset = _owned(errors, "dataset", Dataset, dataset, owner, "dataset")
    model_spec = _owned(errors, "model_spec", ModelSpec, model_spec, owner, "model")
    backend = _owned(errors, "backend", ComputeBackend, backend, owner, "backend")
    team = _member_team(errors, team, owner)
    nodes, procs_per_node, max_runtime_s = _shape_ints(errors, nodes, procs_per_node, max_runtime_s)
    epochs = _int(errors, "epochs", epochs, minimum=1, maximum=MAX_EPOCHS, label="Epochs")
    batch_size = _int(errors, "batch_size", batch_size, minimum=1, maximum=MAX_BATCH_SIZE, label="Batch size")
    seed = _int(errors, "seed", seed, minimum=0, maximum=MAX_SEED, label="Seed")
    lr = _positive_float(errors, "lr", lr, label="Learning rate")
    budget = _budget(errors, budget_usd)
    overrides = _hyperparameters(errors, hyperparameters)
    instance_type = (instance_type or "").strip()
    spot = bool(spot)
    name = (name or "").strip()[:200]
    for field, label, text in (("name", "Name", name), ("instance_type", "Instance type", instance_type)):
        if (problem := validation.text_problem(text)) is not None:
            errors.add(field, f"{label} {problem}")
    if errors or dataset is None or model_spec is None:
        errors.raise_if_any()

    # The trainer config: data from the Dataset, model from the ModelSpec, shape and training from
    # the arguments, then the user's overrides; the trainer's own schema validates the result.
    base = {
        "data": {"format": dataset.format, "name": dataset.builtin_name or "digits", "uri": dataset.uri,
                 "label_column": dataset.label_column or "label"},
        "model": {"arch": model_spec.architecture, "params": dict(model_spec.params or {})},
        "parallel": {"strategy": strategy, "nodes": nodes, "procs_per_node": procs_per_node,
                     **_pipeline_fields(pipeline_stages, microbatches, pipeline_schedule)},
        "train": {"epochs": epochs, "batch_size": batch_size, "lr": lr, "seed": seed},
    }
    overridden = _flatten_keys(overrides)
    config = None
    try:
        config = JobConfig.from_dict(_deep_merge(base, overrides))
        config.model.params = validate_model_params(config.model.arch, config.model.params)
    except ConfigError as exc:
        _add_config_error(errors, exc, overridden)
    if config is not None:
        for dotted, message in config_errors(config).items():
            field = _config_error_field(dotted, overridden)
            errors.add(field, _config_message(dotted, field, f"{dotted}: {message}"))
    if config is None or errors:
        errors.raise_if_any()
    # Pending, not raised: the backend's checks below still run, so one submit shows both.
    _check_model_fits_dataset(errors, config, dataset, model_spec, overridden)

    # The frozen config is the truth; the row's shape columns mirror it (overrides included).
    strategy, nodes, procs_per_node = config.parallel.strategy, config.parallel.nodes, config.parallel.procs_per_node
    adapter = _adapter_or_error(errors, backend)
    if adapter is None:
        errors.raise_if_any()
    spec = JobSpec(job_name="tb-job-new", config=config.to_dict(), nodes=nodes, procs_per_node=procs_per_node,
                   instance_type=instance_type, spot=spot, max_runtime_s=max_runtime_s,
                   dataset_uri=config.data.uri)
    _check_spec(errors, adapter, spec, strategy, dataset)
    price = _hourly_price(errors, adapter, instance_type, spot)
    errors.raise_if_any()
    return _store_job(owner=owner, dataset=dataset, model_spec=model_spec, backend=backend,
                      config=config.to_dict(), strategy=strategy, nodes=nodes, procs_per_node=procs_per_node,
                      instance_type=instance_type, spot=spot, max_runtime_s=max_runtime_s, budget_usd=budget,
                      hourly_price=price, name=name, rerun_of=rerun_of, team=team,
                      on_demand_price=_on_demand_price(adapter, instance_type, spot, price))


def _check_model_fits_dataset(errors: _Errors, config: JobConfig, dataset: Dataset, model_spec: ModelSpec,
                              overridden: set[str]) -> None:
    """An error (on ``model_spec``, or ``hyperparameters`` when they chose the architecture) when the
    job's architecture cannot take the dataset's samples, by the registry's own rule
    (:func:`trainer_pkg.registry.check_input_shape`) on the shape read when the dataset was saved
    (``Dataset.sample_shape``); the message names both shapes. Not checked when that shape is unknown
    (a cloud URI) or the overrides point the job at other data."""
    from trainer_pkg.registry import check_input_shape

    data = config.data
    same_data = (data.format, data.uri) == (dataset.format, dataset.uri) and (
        dataset.format != Dataset.Format.BUILTIN or data.name == dataset.builtin_name)
    if dataset.sample_shape is None or not same_data:
        return
    try:
        check_input_shape(config.model.arch, dataset.sample_shape)
    except ConfigError as exc:
        reason = str(exc).removeprefix("model.arch: ")
        errors.add(_config_error_field("model.arch", overridden),
                   f"Model {model_spec.name} does not fit dataset {dataset.name}: {reason}.")


def _member_team(errors: _Errors, value: Any, owner: Any):
    """The Team ``value`` (instance or pk) when ``owner`` is a member; None for None/"". Else an
    error on ``team`` (an unknown or non-integer pk is the same error)."""
    from jobs.models import Team

    if value in (None, ""):
        return None
    pk = value.pk if isinstance(value, Team) else value
    try:
        team = Team.objects.filter(pk=int(pk), members__pk=getattr(owner, "pk", None)).first()
    except (TypeError, ValueError, OverflowError):
        team = None
    if team is None:
        errors.add("team", "Choose one of your teams; this one does not exist or you are not a member.")
    return team


def training_job_estimate(*, backend: ComputeBackend, nodes: int = 1, procs_per_node: int = 1,
                          max_runtime_s: int = 3600, instance_type: str = "", spot: bool = False,
                          strategy: str = "ddp", pipeline_stages: int | None = None,
                          microbatches: int | None = None, pipeline_schedule: str | None = None,
                          batch_size: int | None = None, model_spec: ModelSpec | None = None,
                          budget_usd: Any = None) -> dict:
    """Price of a shape before launch: ``{"hourly_price_usd", "estimated_cost_usd", "arithmetic",
    "money_places", "max_runtime_covers", "world_size", "message"}``; ``money_places`` (2 or 4) is
    the one precision the estimate, its arithmetic and the budget are shown at.

    Estimate = min(max runtime × instances (nodes) × hourly price, ``budget_usd``) — the budget only
    when given (:func:`jobs.cost.estimate_cost_usd`); ``arithmetic`` is that sum in words
    (:func:`jobs.cost.estimate_arithmetic`), ``max_runtime_covers`` what the backend's limit counts
    (``Backend.max_runtime_covers``: start-up included). Raises ValidationError like
    :func:`training_job_create` for a shape the backend cannot run, including the strategy's own
    arithmetic (pipeline stages against ranks, micro-batches against the batch size and, with
    ``model_spec``, stages against the model's layers), keyed by the same field names.
    """
    errors = _Errors()
    nodes, procs_per_node, max_runtime_s = _shape_ints(errors, nodes, procs_per_node, max_runtime_s)
    if not isinstance(backend, ComputeBackend):
        backend = ComputeBackend.objects.filter(pk=backend).first()
        if backend is None:
            errors.add("backend", "Choose one of your backends.")
    errors.raise_if_any()
    adapter = _adapter_or_error(errors, backend)
    errors.raise_if_any()
    spec = JobSpec(job_name="tb-job-estimate", config={}, nodes=nodes, procs_per_node=procs_per_node,
                   instance_type=(instance_type or "").strip(), spot=bool(spot), max_runtime_s=max_runtime_s)
    _check_spec(errors, adapter, spec, strategy)
    _check_strategy_shape(errors, strategy=strategy, nodes=nodes, procs_per_node=procs_per_node,
                          batch_size=batch_size, model_spec=model_spec,
                          **_pipeline_fields(pipeline_stages, microbatches, pipeline_schedule))
    price = _hourly_price(errors, adapter, spec.instance_type, spec.spot)
    budget = _budget(errors, budget_usd)
    errors.raise_if_any()
    shape = dict(max_runtime_s=max_runtime_s, instances=nodes, hourly_price_usd=price, budget_usd=budget)
    estimate = costs.estimate_cost_usd(**shape)
    _check_estimate(errors, estimate)
    errors.raise_if_any()
    world = nodes * procs_per_node
    places = costs.usd_places(costs.job_cost_usd(billable_seconds=max_runtime_s, instances=nodes,
                                                 hourly_price_usd=price), budget, estimate)
    arithmetic = costs.estimate_arithmetic(**shape, places=places)
    message = (f"{describe_world(nodes, procs_per_node)}; at most {arithmetic}"
               + ("" if budget is not None else f" = {costs.format_usd(estimate, places)}"))
    return {"hourly_price_usd": price, "estimated_cost_usd": estimate, "arithmetic": arithmetic,
            "money_places": places, "max_runtime_covers": type(adapter).max_runtime_covers,
            "world_size": world, "message": message}


def _check_strategy_shape(errors: _Errors, *, strategy: str, nodes: int, procs_per_node: int,
                          batch_size: int | None, model_spec: ModelSpec | None, **pipeline: Any) -> None:
    """The JobConfig's shape errors (the trainer's own arithmetic) for the estimate's fields."""
    raw: dict[str, Any] = {"parallel": {"strategy": strategy, "nodes": nodes, "procs_per_node": procs_per_node,
                                        **pipeline}}
    if batch_size is not None:
        raw["train"] = {"batch_size": batch_size}
    if model_spec is not None:
        raw["model"] = {"arch": model_spec.architecture, "params": dict(model_spec.params or {})}
    try:
        config = JobConfig.from_dict(raw)
    except ConfigError as exc:
        _add_config_error(errors, exc, set())
        return
    found = shape_errors(config, world_size=nodes * procs_per_node, world_desc=describe_world(nodes, procs_per_node),
                         check_layers=model_spec is not None)
    for dotted, message in found.items():
        errors.add(_config_error_field(dotted, set()), message)


def training_job_rerun(*, job: TrainingJob, owner) -> TrainingJob:
    """A new QUEUED job with ``job``'s frozen config and shape (``rerun_of=job``), priced now; for
    ``job``'s team while the owner is still a member of it. The monthly budgets are checked as for a
    new job (ValidationError with the figures)."""
    errors = _Errors()
    if job.owner_id != getattr(owner, "pk", None):
        errors.add(ALL, "You can only re-run your own jobs.")
        errors.raise_if_any()
    backend = job.backend
    adapter = _adapter_or_error(errors, backend)
    errors.raise_if_any()
    spec = job_spec(job)
    _check_spec(errors, adapter, spec, job.strategy, job.dataset)
    price = _hourly_price(errors, adapter, job.instance_type, job.spot)
    errors.raise_if_any()
    return _store_job(owner=owner, dataset=job.dataset, model_spec=job.model_spec, backend=backend,
                      config=dict(job.config), strategy=job.strategy, nodes=job.nodes,
                      procs_per_node=job.procs_per_node, instance_type=job.instance_type, spot=job.spot,
                      max_runtime_s=job.max_runtime_s, budget_usd=job.budget_usd, hourly_price=price,
                      on_demand_price=_on_demand_price(adapter, job.instance_type, job.spot, price),
                      name=rerun_name(job), rerun_of=job,
                      team=job.team if job.team_id and job.team.members.filter(pk=owner.pk).exists() else None)


def rerun_name(job: TrainingJob) -> str:
    """``<name> (re-run of #<id>)``; re-running a re-run replaces the suffix instead of stacking it."""
    base = re.sub(r" \(re-run of #\d+\)$", "", job.name or f"job-{job.pk}")
    return f"{base} (re-run of #{job.pk})"


# =============================================================================================
# Training jobs: submit and cancel (called by tasks)
# =============================================================================================


def _fail(job: TrainingJob, reason: str) -> None:
    """Move ``job`` to FAILED from whatever state it is in now (if that is still legal)."""
    for _ in range(3):
        if not is_allowed(job.state, S.FAILED):
            return
        if transition(job, S.FAILED, message=reason, failure_reason=reason):
            return


def submit_lease_s() -> float:
    """Seconds one submission attempt owns a SUBMITTING job (the submit task's hard time limit,
    ``TRAINBOARD_SUBMIT_TIME_LIMIT_S``): past it, the worker that held the job is gone."""
    return float(settings.TRAINBOARD_SUBMIT_TIME_LIMIT_S)


_RESUMABLE = (S.SUBMITTING, S.STOPPING)
"""States in which a job without a provider handle has a submission to finish: SUBMITTING, and
STOPPING (cancelled while its submission was in flight: it is adopted by name, then stopped)."""


def _claim_submission(job: TrainingJob, claim: dt.datetime | None) -> bool:
    """Take (or renew) the right to call the provider for a SUBMITTING (or STOPPING) job without a
    handle.

    The owner of a submission is whoever last wrote ``state_entered_at``; that value is its token.
    ``claim`` is the token the caller holds (a Celery retry of the attempt, or the recovery sweep's
    resume); without one, the caller may take the job only once the lease expired
    (:func:`submit_lease_s`). The write is conditional on the value read, so of two deliveries at
    the same moment exactly one gets ``True``.
    """
    if job.state not in _RESUMABLE or job.provider_handle:
        return False
    seen = job.state_entered_at
    now = timezone.now()
    if claim is not None:
        if seen != claim:
            return False
    elif seen is not None and seen > now - dt.timedelta(seconds=submit_lease_s()):
        return False
    if not TrainingJob.objects.filter(pk=job.pk, state=job.state, provider_handle__isnull=True,
                                      state_entered_at=seen).update(state_entered_at=now):
        return False
    job.state_entered_at = now
    return True


def training_job_submit(*, job: TrainingJob, retrying: bool = False,
                        claim: dt.datetime | None = None) -> TrainingJob:
    """Start ``job`` on its backend (the body of ``jobs.tasks.submit_job``).

    QUEUED → SUBMITTING with a conditional update (a duplicate delivery gets ``False`` and returns
    without calling the provider), ``Backend.submit`` (idempotent by job name), the handle stored,
    → PENDING. A SUBMITTING job without a handle is resumed (submitted again; the provider adopts
    the job of that name) only by the caller that owns it (:func:`_claim_submission`): one holding
    ``claim`` (the job's ``state_entered_at`` as its owner wrote it), a ``retrying`` caller (a Celery
    retry after a transient error: the job's ``state_entered_at`` as passed in is its token), or
    anyone once the lease (:func:`submit_lease_s`, seconds) has expired because the worker died.
    Non-transient BackendErrors make the job FAILED with the message; transient ones propagate
    unchanged for the task to retry (``job.state_entered_at`` is then the token for that retry).
    """
    if job.state == S.QUEUED:
        if not transition(job, S.SUBMITTING, submitted_at=timezone.now(),
                          message=f"Submitting to backend {job.backend.name}"):
            return job
    else:
        if retrying and claim is None:
            claim = job.state_entered_at
        if not _claim_submission(job, claim):
            return job
    try:
        adapter = backend_adapter(job.backend)
    except (BackendError, LookupError, ValueError, TypeError) as exc:
        _fail(job, f"Backend {job.backend.name} cannot be used: {exc}")
        return job
    try:
        handle = adapter.submit(job_spec(job))
    except BackendError as exc:
        if exc.transient:
            TrainingJob.objects.filter(pk=job.pk).update(status_warning=f"Submission retrying: {exc}")
            raise
        _fail(job, str(exc))
        return job
    TrainingJob.objects.filter(pk=job.pk).update(provider_handle=handle.to_dict(), status_warning="")
    job.provider_handle = handle.to_dict()
    if job.state == S.STOPPING or not transition(job, S.PENDING, message=f"Submitted as {handle.job_name}"):
        if job.state == S.STOPPING:
            # Cancelled while the provider call was in flight: stop what we just started.
            try:
                adapter.cancel(handle)
            except BackendError as exc:
                log.warning("job %s: cancel after submit failed (the next sync re-sends it): %s", job.pk, exc)
    return job


def training_job_submit_gave_up(*, job: TrainingJob, error: BaseException) -> None:
    """Transient errors outlasted the task's retries: leave the job non-terminal, say why."""
    TrainingJob.objects.filter(pk=job.pk).update(
        status_warning=f"Submission still failing after retries ({error}); the job stays {job.state}. "
                       f"Cancel it or re-run it later."
    )


def training_job_cancel(*, job: TrainingJob, reason: str = "Cancelled by user") -> TrainingJob:
    """Stop ``job``. QUEUED → CANCELLED at once; SUBMITTING/PENDING/RUNNING → STOPPING and
    ``jobs.tasks.cancel_job`` asks the provider (CANCELLED when a later sync confirms it); STOPPING
    → re-sends the cancel. A terminal job raises ValidationError."""
    for _ in range(3):
        state = job.state
        if state in TERMINAL_STATE_VALUES:
            raise ValidationError({ALL: [f"Job {job.pk} already ended ({state}); there is nothing to cancel."]})
        now = timezone.now()
        if state == S.QUEUED:
            if transition(job, S.CANCELLED, message=reason, failure_reason=reason, cancel_requested_at=now):
                return job
            continue
        if state == S.STOPPING:
            transaction.on_commit(partial(_enqueue_cancel, job.pk, backend_queue(job.backend)))
            return job
        if transition(job, S.STOPPING, message=reason, failure_reason=reason, cancel_requested_at=now):
            transaction.on_commit(partial(_enqueue_cancel, job.pk, backend_queue(job.backend)))
            return job
    return job


def training_job_cancel_send(*, job: TrainingJob) -> None:
    """Ask the provider to stop a STOPPING job (the body of ``jobs.tasks.cancel_job``). Idempotent.

    A job without a provider handle is still being submitted: the submit service cancels it once
    the handle exists. Transient BackendErrors propagate for the task to retry.
    """
    if job.state != S.STOPPING or not job.provider_handle:
        return
    backend_adapter(job.backend).cancel(JobHandle.from_dict(job.provider_handle))


# =============================================================================================
# Sync: describe, logs, metrics, cost, budget (called by jobs.tasks.sync_backend)
# =============================================================================================

_GLOBAL_METRICS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "samples_per_s", "lr",
                   "wait_for_slowest_s")
_RANK_METRICS = ("rank_samples_per_s", "rank_step_time_s", "rank_data_wait_s", "rank_compute_s",
                 "rank_sync_wait_s", "rank_pipeline_stage", "rank_stage_layers")
_METRIC_EVENTS = {"step", "epoch", "failed"}
_MAX_LOG_CALLS = 200  # per job per sync; keeps one task short when a job has a huge backlog


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def _when(record: Mapping[str, Any], default: dt.datetime) -> dt.datetime:
    t = _number(record.get("time"))
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc) if t is not None else default


def metric_points_from_record(job: TrainingJob, record: Mapping[str, Any], now: dt.datetime) -> list[MetricPoint]:
    """MetricPoint rows for one trainer record (schema: trainer_pkg/metrics.py).

    Global values become rows with ``rank`` NULL; ``rank_*`` lists one row per rank. Only ``step``,
    ``epoch`` and ``failed`` records carry series (``started``/``completed`` mark times and would
    duplicate). A value the trainer reported as non-finite (named in the record's ``nonfinite``, or
    a NaN/Infinity literal from an older trainer) becomes a row with ``value`` None: the chart's gap.
    """
    if record.get("event") not in _METRIC_EVENTS:
        return []
    step = record.get("step")
    step = int(step) if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0
    epoch = record.get("epoch")
    epoch = int(epoch) if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else None
    at = _when(record, now)
    flagged = record.get("nonfinite")
    flagged = {n for n in flagged if isinstance(n, str)} if isinstance(flagged, list) else set()
    points = []

    def add(name: str, raw: Any, rank: int | None) -> None:
        value = _number(raw)
        nonfinite = (raw is None and name in flagged) or (isinstance(raw, float) and value is None)
        if value is not None or nonfinite:
            points.append(MetricPoint(job=job, name=name, step=step, epoch=epoch, rank=rank, value=value,
                                      recorded_at=at))

    for name in _GLOBAL_METRICS:
        add(name, record.get(name), None)
    bad_step = record.get("nonfinite_step")
    if (record.get("event") == "failed" and isinstance(bad_step, int) and not isinstance(bad_step, bool)
            and 0 <= bad_step < step):
        # A diverged run's first non-finite loss, steps before the failed record: the chart marks
        # the step the reason names ("loss became NaN at step 2"), not only where the run stopped.
        points.append(MetricPoint(job=job, name="train_loss", step=bad_step, epoch=epoch, rank=None,
                                  value=None, recorded_at=at))
    for name in _RANK_METRICS:
        values = record.get(name)
        if isinstance(values, list):
            for rank, raw in enumerate(values):
                add(name, raw, rank)
    return points


def _trainer_failure_reason(job: TrainingJob) -> str | None:
    """The reason the trainer gave when it stopped the run itself (its ``failed`` record, e.g. "loss
    became NaN at step 12"), from the job's stored log; None when it gave none."""
    from trainer_pkg.metrics import METRIC_PREFIX, parse_metric_line

    texts = (JobLogLine.objects.filter(job_id=job.pk, text__contains=METRIC_PREFIX)
             .filter(text__contains='"event":"failed"').order_by("-seq").values_list("text", flat=True)[:1])
    for text in texts:
        record = parse_metric_line(text) or {}
        reason = record.get("reason")
        if isinstance(reason, str) and reason.strip():
            return reason.strip()[:500]
    return None


def _ingest_lines(job: TrainingJob, lines: list[str], next_seq: int, now: dt.datetime) -> tuple[int, dt.datetime | None]:
    """Store log lines from ``next_seq`` on and their metric records; returns (next seq, first step time)."""
    from trainer_pkg.metrics import parse_metric_line

    log_rows, points, first_step = [], [], None
    for line in lines:
        text = str(line).replace("\x00", "")  # PostgreSQL text cannot hold NUL
        log_rows.append(JobLogLine(job=job, seq=next_seq, text=text))
        next_seq += 1
        record = parse_metric_line(text)
        if record is None:
            continue
        if record.get("event") == "started" and first_step is None:
            first_step = _when(record, now)
        points.extend(metric_points_from_record(job, record, now))
    JobLogLine.objects.bulk_create(log_rows)
    MetricPoint.objects.bulk_create(points)
    return next_seq, first_step


def _drain_logs(adapter: Backend, job: TrainingJob, handle: JobHandle, now: dt.datetime) -> bool:
    """Read ``logs(handle, cursor)`` until empty; True when drained (False: a backlog remains)."""
    cursor = job.log_cursor
    last = job.log_lines.aggregate(m=Max("seq"))["m"]
    next_seq = 0 if last is None else last + 1
    for _ in range(_MAX_LOG_CALLS):
        lines, new_cursor = adapter.logs(handle, cursor)
        if not lines:
            if new_cursor != cursor:
                job.log_cursor = new_cursor or ""
                TrainingJob.objects.filter(pk=job.pk).update(log_cursor=job.log_cursor)
            return True
        next_seq, first_step = _ingest_lines(job, lines, next_seq, now)
        cursor = new_cursor
        update = {"log_cursor": cursor or ""}
        if first_step is not None and job.first_step_at is None:
            update["first_step_at"] = job.first_step_at = first_step
        job.log_cursor = cursor or ""
        TrainingJob.objects.filter(pk=job.pk).update(**update)
    return False


def _status_fields(job: TrainingJob, status: JobStatus, now: dt.datetime) -> dict[str, Any]:
    """Columns to write from a provider status; cost recomputed absolutely from them."""
    target = status.state.value if isinstance(status.state, JobState) else str(status.state)
    terminal = target in TERMINAL_STATE_VALUES
    started_at = status.started_at or job.started_at
    ended_at = (status.ended_at or job.ended_at or now) if terminal else None
    billable = status.billable_seconds
    if billable is None:
        billable = costs.run_seconds(started_at, ended_at, now)
    instances = max(int(status.instance_count or job.nodes), 1)
    fields: dict[str, Any] = {
        "raw_state": (status.raw_state or "")[:100],
        "secondary_state": (status.secondary_state or "")[:100],
        "status_warning": status.warning or "",
        "started_at": started_at,
        "billable_seconds": float(billable),
        "instance_count": instances,
        "cost_usd": costs.job_cost_usd(billable_seconds=billable, instances=instances,
                                       hourly_price_usd=job.hourly_price_usd),
        "last_synced_at": now,
    }
    if status.training_seconds is not None:
        fields["training_seconds"] = float(status.training_seconds)
    if terminal:
        fields["ended_at"] = ended_at
    if target == S.FAILED:
        reason = status.failure_reason or job.failure_reason or (
            f"The backend reported the job failed ({status.raw_state or 'no reason given'}).")
        # The trainer's own reason (a diverged loss) is what the user acts on; a cloud's reason is
        # generic ("exited with a non-zero status of 1"), so it follows as the detail.
        trainer_reason = _trainer_failure_reason(job)
        if trainer_reason and trainer_reason not in reason:
            reason = f"{trainer_reason} (the backend reported: {reason})"
        fields["failure_reason"] = reason
    elif target == S.CANCELLED:
        fields["failure_reason"] = job.failure_reason or status.failure_reason or "Cancelled"
    return fields


def _unchanged_fields(job: TrainingJob, now: dt.datetime) -> dict[str, Any]:
    """Columns to write for a job ``describe_many`` left out (unchanged since ``changed_since``, or
    not found): the sync time and, while it runs, its cost so far from the run interval (start →
    now) — recomputed absolutely, never incremented. The provider's own billable seconds arrive
    with the status that reports them."""
    fields: dict[str, Any] = {"last_synced_at": now}
    if job.state == S.RUNNING and job.started_at is not None:
        billable = costs.run_seconds(job.started_at, None, now)
        fields["billable_seconds"] = billable
        fields["cost_usd"] = costs.job_cost_usd(billable_seconds=billable, instances=job.instance_count,
                                                hourly_price_usd=job.hourly_price_usd)
    return fields


def _sync_one(adapter: Backend, job: TrainingJob, status: JobStatus | None, now: dt.datetime,
              read_logs: bool = True) -> None:
    handle = JobHandle.from_dict(job.provider_handle)
    drained = True
    if read_logs or status is not None:  # a changed job's log is always read (its end needs all of it)
        drained = _drain_logs(adapter, job, handle, now)
        TrainingJob.objects.filter(pk=job.pk).update(logs_read_at=now)
    if status is None:  # unchanged since the last sync, or not found: state left as it is
        fields = _unchanged_fields(job, now)
        TrainingJob.objects.filter(pk=job.pk, state=job.state).update(**fields)
        job.refresh_from_db()
        _enforce_budget(adapter, job, handle)
        return
    target = status.state.value if isinstance(status.state, JobState) else str(status.state)
    if target in TERMINAL_STATE_VALUES and not drained:
        # Apply the final state only once every log line (and metric) is stored.
        TrainingJob.objects.filter(pk=job.pk).update(last_synced_at=now)
        return
    fields = _status_fields(job, status, now)
    if (target in TERMINAL_STATE_VALUES and job.state in (S.SUBMITTING, S.PENDING)
            and job.first_step_at is not None):
        # It ran and ended between two syncs; the trainer's "started" record is in the log we just
        # stored, so the history says so rather than jumping PENDING → SUCCEEDED.
        transition(job, S.RUNNING, message="first step logged", started_at=fields["started_at"])
    # An unknown provider state reads as PENDING (with a warning) only so that a job that never ran
    # is not shown RUNNING; for a running job it is no interruption: it stays RUNNING, warning shown.
    unsure_interruption = (str(job.state), target) == INTERRUPTION and bool(status.warning)
    if target != job.state and is_allowed(job.state, target) and not unsure_interruption:
        message = " / ".join(x for x in (status.raw_state, status.secondary_state) if x)
        if target in (S.FAILED,) and fields.get("failure_reason"):
            message = f"{message}: {fields['failure_reason']}" if message else fields["failure_reason"]
        transition(job, target, message=message[:2000], **fields)
    else:
        # Same state, or a move the machine refuses (the provider still says RUNNING while we are
        # STOPPING): refresh the numbers only.
        fields = {k: v for k, v in fields.items() if k not in ("ended_at", "failure_reason")}
        TrainingJob.objects.filter(pk=job.pk, state=job.state).update(**fields)
        job.refresh_from_db()
    _enforce_budget(adapter, job, handle)


def _enforce_budget(adapter: Backend, job: TrainingJob, handle: JobHandle) -> None:
    """Stop a PENDING/RUNNING job whose cost reached its budget: → STOPPING with
    ``budget_exceeded_at`` and the reason "Stopped: budget of $X reached at $Y" (Y = its cost then)."""
    if job.budget_usd is None or job.state not in (S.PENDING, S.RUNNING) or job.cost_usd < job.budget_usd:
        return
    places = job.money_places  # as the job page shows its cost and budget beside this reason
    reason = (f"Stopped: budget of {costs.format_usd(job.budget_usd, places)} reached at "
              f"{costs.format_usd(job.cost_usd, places)}")
    now = timezone.now()
    if transition(job, S.STOPPING, message=reason, failure_reason=reason, cancel_requested_at=now,
                  budget_exceeded_at=now):
        _send_cancel(adapter, job, handle)


def _send_cancel(adapter: Backend, job: TrainingJob, handle: JobHandle) -> None:
    try:
        adapter.cancel(handle)
    except BackendError as exc:
        log.warning("job %s: cancel not sent this sync (%s); the next sync retries", job.pk, exc)


_UNCHANGED_SQL = """
WITH synced AS (
    UPDATE {table} AS j SET
        last_synced_at = %(now)s,
        billable_seconds = CASE WHEN j.state = %(running)s AND j.started_at IS NOT NULL
            THEN GREATEST(EXTRACT(EPOCH FROM (%(now)s - j.started_at)), 0)::double precision
            ELSE j.billable_seconds END,
        cost_usd = CASE WHEN j.state = %(running)s AND j.started_at IS NOT NULL
            THEN ROUND(CAST(GREATEST(EXTRACT(EPOCH FROM (%(now)s - j.started_at)), 0)::numeric
                            * j.instance_count * j.hourly_price_usd AS numeric(65, 30)) / 3600, 4)
            ELSE j.cost_usd END
    FROM (SELECT id FROM {table} WHERE id = ANY(%(ids)s) AND state = ANY(%(active)s)
          ORDER BY id FOR UPDATE SKIP LOCKED) AS free
    WHERE j.id = free.id
    RETURNING j.id, j.state, j.cost_usd, j.budget_usd
)
SELECT id FROM synced
WHERE state = ANY(%(budgeted)s) AND budget_usd IS NOT NULL AND cost_usd >= budget_usd
ORDER BY id
"""


def _sync_unchanged(job_ids: list[int], now: dt.datetime) -> list[int]:
    """Write :func:`_unchanged_fields` for every job of ``job_ids`` in one statement, and return the
    ids of those whose cost now reaches their budget (the caller stops them, one by one).

    For the jobs ``describe_many`` left out whose logs this pass does not read: at 10,000 active
    jobs, locking, updating and re-reading each row made a pass take 40–80 s (31,000 statements)
    (bench/RESULTS.md, Scale). The values are those of the per-job path, computed by PostgreSQL from
    the row under its lock: ``now − started_at`` in seconds (exact microseconds, as
    ``timedelta.total_seconds``), cost = ROUND(seconds × instance_count × hourly_price_usd / 3600, 4),
    half away from zero = half up for costs ≥ 0 (:func:`jobs.cost.job_cost_usd`), with a scale of 30
    before the division so nothing is rounded twice. Recomputed absolutely, never added to. A row
    another sync or a transition holds is skipped (``SKIP LOCKED``), as the per-job lock does, and so
    is a job no longer active. PostgreSQL only: the caller uses the per-job path elsewhere.
    """
    if not job_ids:
        return []
    sql = _UNCHANGED_SQL.format(table=connection.ops.quote_name(TrainingJob._meta.db_table))
    with connection.cursor() as cursor:
        cursor.execute(sql, {"now": now, "running": S.RUNNING.value, "ids": list(job_ids),
                             "active": list(ACTIVE_STATE_VALUES),
                             "budgeted": [S.PENDING.value, S.RUNNING.value]})
        return [row[0] for row in cursor.fetchall()]


SYNC_MARGIN = dt.timedelta(seconds=60)
"""Overlap between syncs: provider modification times and our clock may disagree by this much."""


def sync_changed_since(jobs: list[TrainingJob]) -> dt.datetime | None:
    """``changed_since`` for ``describe_many``: the oldest ``last_synced_at`` among ``jobs`` minus
    :data:`SYNC_MARGIN`, or None when any of them has never been synced (it must be described)."""
    synced = [job.last_synced_at for job in jobs]
    if not synced or any(at is None for at in synced):
        return None
    return min(synced) - SYNC_MARGIN


def log_readers(jobs: list[TrainingJob], changed: set[str], limit: int) -> set[int]:
    """Ids of the jobs whose logs one sync pass reads: every job whose status ``changed`` (by provider
    job name) and at most ``limit`` of the others, least recently read first (never read = first), so
    at 10,000 active jobs a pass makes ``changed + limit`` log reads, not 10,000, and every job's log
    is still read every ``active / limit`` passes."""
    never = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    ids = {j.pk for j in jobs if (j.provider_handle or {}).get("job_name", "") in changed}
    rest = sorted((j for j in jobs if j.pk not in ids), key=lambda j: (j.logs_read_at or never, j.pk))
    return ids | {j.pk for j in rest[:max(limit, 0)]}


def backend_sync(*, backend_id: int, bulk: bool = True) -> int:
    """One sync pass over a backend's active jobs (the body of ``jobs.tasks.sync_backend``).

    One ``describe_many`` call for all of them, with ``changed_since`` from :func:`sync_changed_since`
    so an adapter may list only the jobs that changed. STOPPING jobs get their cancel re-sent. Per
    job whose status changed or whose log this pass reads (row locked, skipped if another sync holds
    it): new log lines and metric points are stored, then the provider state is applied through the
    state machine with times, billable and training seconds, instance count and cost recomputed
    absolutely. A job left out of the result keeps its state and, while RUNNING, its cost so far is
    recomputed from the run interval; its log is read when it is among the
    ``TRAINBOARD_LOG_READS_PER_SYNC`` least recently read (:func:`log_readers`). The rest (left out
    and not read) are written in one statement (:func:`_sync_unchanged`), so the pass's database
    work grows with the changed jobs, not the active ones. A job whose cost reached its budget is
    stopped in this pass, whichever way it was written.

    ``bulk=False`` (and any database but PostgreSQL) writes every job by the per-job path; the
    results are the same (bench/sync_db.py compares the two).
    A backend whose adapter cannot be built (:func:`backend_adapter` raises a non-transient
    BackendError, e.g. it may not use the worker's identity) is not called at all: its jobs keep
    their state and get a ``status_warning`` saying why they are not followed.
    Returns the number of jobs looked at. Transient BackendErrors from describe_many propagate.
    """
    backend = ComputeBackend.objects.get(pk=backend_id)
    # Only what this loop reads (each job is re-read, locked, before it is synced): at 10,000 active
    # jobs the frozen configs alone would be most of the worker's memory (bench/sync_memory.py).
    jobs = list(
        TrainingJob.objects.filter(backend_id=backend_id, state__in=ACTIVE_STATE_VALUES)
        .exclude(state=S.QUEUED).exclude(provider_handle__isnull=True).order_by("id")
        .only("id", "state", "provider_handle", "last_synced_at", "logs_read_at")
    )
    if not jobs:
        return 0
    try:
        adapter = backend_adapter(backend)
    except BackendError as exc:
        if exc.transient:
            raise
        # E.g. a backend that may not use the worker's identity (stored before that rule): its jobs
        # are not touched (no provider call at all); each says why it is no longer followed.
        log.warning("backend %s: not synced: %s", backend.pk, exc)
        TrainingJob.objects.filter(pk__in=[job.pk for job in jobs]).update(
            status_warning=f"Not synced: backend {backend.name} cannot be used: {exc} Until then this job "
                           f"is not followed or stopped from here; check it in the provider's console.")
        return len(jobs)
    for job in jobs:
        if job.state == S.STOPPING:
            # Re-sent every sync: idempotent, and lets a gpubox escalate SIGTERM to SIGKILL.
            _send_cancel(adapter, job, JobHandle.from_dict(job.provider_handle))
    statuses = adapter.describe_many([JobHandle.from_dict(j.provider_handle) for j in jobs],
                                     changed_since=sync_changed_since(jobs))
    now = timezone.now()
    readers = log_readers(jobs, set(statuses), settings.TRAINBOARD_LOG_READS_PER_SYNC)

    def changed_or_read(job: TrainingJob) -> bool:
        return job.pk in readers or job.provider_handle.get("job_name", "") in statuses

    one_by_one = jobs
    if bulk and connection.vendor == "postgresql":
        over_budget = set(_sync_unchanged([job.pk for job in jobs if not changed_or_read(job)], now))
        # Those over budget go through the per-job path too: it writes the same values again, then
        # stops them (in this pass, as if they had been written one by one).
        one_by_one = [job for job in jobs if changed_or_read(job) or job.pk in over_budget]
    for job in one_by_one:
        with transaction.atomic():
            locked = (TrainingJob.objects.select_for_update(skip_locked=True)
                      .filter(pk=job.pk, state__in=ACTIVE_STATE_VALUES).first())
            if locked is None:
                continue
            try:
                _sync_one(adapter, locked, statuses.get(locked.provider_handle.get("job_name", "")), now,
                          read_logs=locked.pk in readers)
            except BackendError as exc:
                if not exc.transient:
                    log.warning("job %s: sync error: %s", job.pk, exc)
                    TrainingJob.objects.filter(pk=job.pk).update(status_warning=f"Sync error: {exc}")
                else:
                    log.info("job %s: transient sync error, next sync retries: %s", job.pk, exc)
    return len(jobs)
