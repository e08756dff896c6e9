"""Writes of training jobs: create (validate, price, store QUEUED, enqueue the submission), estimate,
re-run and cancel. The worker's side of a job (submit, sync) is :mod:`jobs.lifecycle` and
:mod:`jobs.sync`.

Every function is keyword-only. Input errors raise :class:`django.core.exceptions.ValidationError`
whose ``message_dict`` is keyed by the form/API field names (``__all__`` for the rest) with messages
a user can act on, and nothing is written when they raise. Celery messages are sent after commit
(:mod:`jobs.dispatch`), so a rolled-back request never launches a cloud job. The contract is
docs/internal-api.md.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from cloud_adapters import registry
from cloud_adapters.base import Backend, BackendError, InvalidSpec, JobSpec, scheme_label, uri_scheme, with_article
from jobs import cost as costs
from jobs import admission, dispatch, job_request, validation
from jobs.services import lineage
from jobs.adapters import backend_adapter, backend_queue, code_bundle, job_spec, provider_job_name, shared_uid_refusal
from jobs.budgets import check_monthly_budgets
from jobs.fingerprints import dataset_fingerprint
from jobs.models import (
    TERMINAL_STATE_VALUES,
    CodeArchive,
    ComputeBackend,
    Dataset,
    JobEvent,
    JobStateChoices as S,
    ModelSpec,
    TrainingJob,
)
from jobs.states import note, transition
from jobs.validation import ALL, Errors
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.memory_plan import MemoryPlan, PlanError
from trainer_pkg.memory_plan import plan as memory_plan
from trainer_pkg.registry import CUSTOM, TOKENS_FORMAT, check_input_shape, seq_len_for, validate_model_params
from trainer_pkg.datasets import held_out, train_split_size
from trainer_pkg.world_shape import config_errors, describe_world, pipeline_stage_count, shape_errors

log = logging.getLogger(__name__)


# =============================================================================================
# The trainer config a job freezes, and which form/API field each of its errors belongs to
# =============================================================================================


def _hyperparameters(errors: Errors, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    return validation.json_object(errors, "hyperparameters", value, what="Hyperparameters",
                        example='{"train": {"optimizer": "adamw"}} (trainer config overrides)') or {}


# Where a job writes is the backend's decision on every kind: the GPU box sets both to the job's run
# directory, SageMaker leaves the output section out (/opt/ml/model, /opt/ml/checkpoints), and the
# trainer on Vertex and Azure ML replaces them with the platform's (AIP_MODEL_DIR, the job's outputs).
_BACKEND_PATHS = ("output_dir", "checkpoint_dir")


def _without_backend_paths(errors: Errors, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` without ``output.output_dir``/``output.checkpoint_dir``, with an error on
    ``hyperparameters`` naming them when the user set either: a job showing a path it never wrote to
    would mislead. The other ``output`` fields (``checkpoint_format``) stay."""
    output = overrides.get("output")
    if not isinstance(output, Mapping):
        return overrides
    given = [key for key in _BACKEND_PATHS if key in output]
    if not given:
        return overrides
    names = " and ".join(f"output.{key}" for key in given)
    errors.add("hyperparameters",
               f"Hyperparameters: {names} {'is' if len(given) == 1 else 'are'} set by the backend: the job's "
               f"outputs go to its run directory (GPU box) or the backend's output location (SageMaker, Vertex, "
               f"Azure ML); remove {'it' if len(given) == 1 else 'them'}.")
    return {**overrides, "output": {k: v for k, v in output.items() if k not in _BACKEND_PATHS}}


INIT_FIELDS = ("init_from", "init_mode")
"""``train`` fields only Trainboard sets, from a source job the user may see (continue, fine-tune)."""


def _without_init_fields(errors: Errors, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` without ``train.init_from``/``train.init_mode``, with an error on
    ``hyperparameters`` when the user set either: a path typed here could name any file on a host;
    the job's starting point comes from a source job (Continue, Fine-tune) instead."""
    train = overrides.get("train")
    if not isinstance(train, Mapping) or not any(key in train for key in INIT_FIELDS):
        return overrides
    errors.add("hyperparameters", "Hyperparameters: train.init_from and train.init_mode are set by Trainboard from "
                                  "a source job; remove them, and use Continue or Fine-tune on that job's page "
                                  "(or init_mode in the API's clone).")
    return {**overrides, "train": {k: v for k, v in train.items() if k not in INIT_FIELDS}}


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


def request_field_is_set(field: job_request.RequestField, value: Any) -> bool:
    """Whether a request's ``value`` of the config field ``field`` says something of its own: an
    optional one not None or blank, any other not its declared default (the config's, which every
    front door sends when the user leaves the field alone)."""
    if value is None or value == "":
        return False
    return field.optional or value != field.default


def _override_at(overrides: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """``(True, value)`` where the nested ``overrides`` set the config path ``dotted``, else ``(False, None)``."""
    node: Any = overrides
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _check_override_conflicts(errors: Errors, request: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """An error on ``hyperparameters`` naming both where they set a config path (``train.max_steps``)
    that a request field given with a value of its own (:func:`request_field_is_set`) sets to another
    value: the hyperparameters would silently win. The same value twice is no conflict."""
    for field in job_request.JOB_REQUEST:
        if not field.config or not request_field_is_set(field, request.get(field.name)):
            continue
        present, other = _override_at(overrides, field.config)
        value = request[field.name]
        if present and other != value and str(other).strip() != str(value).strip():
            errors.add("hyperparameters", (
                f"Hyperparameters set {field.config} to {other!r}, but {field.label} ({field.name}) is {value!r}: "
                f"give it in one place, the field or the hyperparameters."))


def _flatten_keys(data: Mapping[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        keys.add(prefix + key)
        if isinstance(value, Mapping):
            keys |= _flatten_keys(value, f"{prefix}{key}.")
    return keys




JOB_FIELD_ALIASES = {"learning_rate": "lr", "model": "model_spec", "model_id": "model_spec",
                     "dataset_id": "dataset", "backend_id": "backend", "world_size": "procs_per_node",
                     "num_nodes": "nodes", "hparams": "hyperparameters", "config": "hyperparameters"}
"""Other spellings of the job create's argument names a caller may guess (the trainer's flags, other
tools' names), so an unknown key is answered with the name it meant
(:func:`jobs.validation.unknown_fields`)."""


def _pipeline_fields(pipeline_stages, microbatches, pipeline_schedule) -> dict[str, Any]:
    """The pipeline's ``parallel`` fields that were given (None: the JobConfig default)."""
    given = {"pipeline_stages": pipeline_stages, "microbatches": microbatches,
             "pipeline_schedule": pipeline_schedule}
    return {k: v for k, v in given.items() if v is not None}


def _config_error_field(dotted: str, overridden: set[str]) -> str:
    """Which form field a JobConfig error belongs to (``dotted`` like ``train.epochs``)."""
    if dotted in overridden or any(dotted.startswith(k + ".") for k in overridden):
        return "hyperparameters"
    owner = next((f.name for f in job_request.JOB_REQUEST if f.config == dotted), None)  # the request's field
    if owner is not None:
        return owner
    if dotted.startswith("data."):
        return "dataset"
    if dotted.startswith("model."):
        return "model_spec"
    return "hyperparameters" if overridden else ALL


def _config_message(dotted: str, field: str, text: str) -> str:
    """``text`` (a JobConfig error, ``parallel.pipeline_stages: ...``) worded for ``field``: a field the
    user filled in is named by its label (``Pipeline stages: ...``), as the form and the API ask for it;
    in the hyperparameters the config path is what the user wrote, so it stays."""
    label = next((f.label for f in job_request.JOB_REQUEST if f.config and f.name == field), None)
    prefix = f"{dotted}:"
    if label is None or not text.startswith(prefix):
        return text
    return f"{label}:{text[len(prefix):]}"


def _add_config_error(errors: Errors, exc_or_msg: Any, overridden: set[str]) -> None:
    found = getattr(exc_or_msg, "errors", None)  # a ConfigError keyed by path: every error, each on its field
    if found:
        for dotted, message in found.items():
            field = _config_error_field(dotted, overridden)
            errors.add(field, _config_message(dotted, field, f"{dotted}: {message}"))
        return
    text = str(exc_or_msg)
    dotted = text.split(":", 1)[0].strip() if ":" in text else ""
    field = _config_error_field(dotted, overridden) if dotted and " " not in dotted else (
        "hyperparameters" if overridden else ALL
    )
    errors.add(field, _config_message(dotted, field, text))


_SPEC_FIELD_TO_REQUEST = {"dataset_uri": "dataset"}
"""The request field of a JobSpec field where their names differ (the others are the same)."""


def _spec_error_field(exc: InvalidSpec) -> str:
    """The request field an adapter's refusal is about: the JobSpec field it names (``InvalidSpec.field``);
    for a refusal that names none (an adapter's check not yet tagged), guessed from its words."""
    if exc.field:
        return _SPEC_FIELD_TO_REQUEST.get(exc.field, exc.field)
    lowered = str(exc).lower()
    for needle, field in (
        ("process", "procs_per_node"), ("node", "nodes"), ("spot", "spot"),
        ("instance", "instance_type"), ("runtime", "max_runtime_s"), ("strateg", "strategy"),
    ):
        if needle in lowered:
            return field
    return ALL


# =============================================================================================
# The backend's checks and price
# =============================================================================================


def _adapter_or_error(errors: Errors, backend: ComputeBackend | None) -> Backend | None:
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


def _check_spec(errors: Errors, adapter: Backend, spec: JobSpec, strategy: str,
                dataset: Dataset | None = None) -> None:
    caps = adapter.capabilities
    if spec.image:
        # The job's own image decides what its torch runs, not the backend's (Backend.strategy_error).
        problem = adapter.strategy_error(strategy, image=spec.image)
        if problem is None and strategy not in adapter.offered_strategies:
            problem = f"This backend runs {', '.join(adapter.offered_strategies)}; {strategy!r} is not one of them."
        if problem:
            errors.add("strategy", problem)
    elif strategy not in caps.strategies:
        # An image whose torch is too old says which version the strategy needs (Backend.strategy_error).
        errors.add("strategy", adapter.strategy_error(strategy) or (
            f"This backend runs {', '.join(caps.strategies) or 'no strategy'}; {strategy!r} is not one of them."))
    spec = _check_dataset_scheme(errors, adapter, spec, dataset)
    if (refusal := shared_uid_refusal(adapter)):
        errors.add("backend", refusal)
    try:
        adapter.validate(spec)
    except InvalidSpec as exc:
        errors.add(_spec_error_field(exc), str(exc))


def _check_dataset_scheme(errors: Errors, adapter: Backend, spec: JobSpec, dataset: Dataset | None) -> JobSpec:
    """An error on ``dataset`` when the adapter cannot read the scheme of ``spec.dataset_uri``
    (``Backend.dataset_schemes``: an ``s3://`` dataset on a GPU box would fail at run time), naming
    the dataset, the scheme and the backend kind. Returns the spec to validate further: without the
    URI when it was refused, so the adapter does not report the same dataset a second time."""
    scheme = uri_scheme(spec.dataset_uri)
    if not spec.dataset_uri or scheme in adapter.dataset_schemes:
        return spec
    kind = registry.KINDS[adapter.kind].label if adapter.kind in registry.KINDS else adapter.kind
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


def _hourly_price(errors: Errors, adapter: Backend, instance_type: str, spot: bool) -> Decimal:
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
    then compared at its own price, as is a job stored without the figure)."""
    if not spot:
        return hourly
    try:
        return _storable_price(adapter.on_demand_price(instance_type))
    except BackendError:
        return None


# =============================================================================================
# Create, estimate, re-run, cancel
# =============================================================================================


def _store_job(*, owner, dataset, model_spec, backend, config: dict[str, Any], strategy: str, nodes: int,
               procs_per_node: int, instance_type: str, spot: bool, max_runtime_s: int,
               budget_usd: Decimal | None, hourly_price: Decimal, name: str,
               rerun_of: TrainingJob | None, team=None, on_demand_price: Decimal | None = None,
               code: CodeArchive | None = None, image: str = "", env: Mapping[str, str] | None = None,
               fingerprint: dict[str, Any] | None = None, memory_plan: dict[str, Any] | None = None,
               priority: int = 0, lineage_fields: Mapping[str, Any] | None = None) -> TrainingJob:
    """Create the QUEUED row, its event and (on commit) its submit message, in one transaction that
    first checks the owner's and the team's monthly budgets under row locks (jobs.budgets); a
    refusal (ValidationError with the figures) writes nothing."""
    estimate = costs.estimate_cost_usd(max_runtime_s=max_runtime_s, instances=nodes, hourly_price_usd=hourly_price,
                                       budget_usd=budget_usd)
    errors = Errors()
    validation.check_estimate(errors, estimate)
    errors.raise_if_any()
    with transaction.atomic():
        check_monthly_budgets(owner=owner, team=team, estimate=estimate)
        job = _job_row(owner=owner, team=team, name=name, dataset=dataset, model_spec=model_spec, backend=backend,
                       rerun_of=rerun_of, config=config, strategy=strategy, nodes=nodes,
                       procs_per_node=procs_per_node, instance_type=instance_type, spot=spot,
                       max_runtime_s=max_runtime_s, budget_usd=budget_usd, hourly_price=hourly_price,
                       on_demand_price=on_demand_price, estimate=estimate, code=code, image=image, env=env,
                       fingerprint=fingerprint, memory_plan=memory_plan, priority=priority,
                       lineage_fields=lineage_fields)
        job.save(force_insert=True)
        job.provider_job_name = provider_job_name(job)
        job.save(update_fields=["provider_job_name"])
        made_from = lineage.lineage_text(job)
        message = f"Re-run of job {rerun_of.pk}" if rerun_of else (f"Created, {made_from}" if made_from else "Created")
        JobEvent.objects.create(job=job, from_state="", to_state=S.QUEUED, message=message)
        dispatch.submit_after_commit(job.pk, backend_queue(backend))
    return job


def _job_row(*, owner, team, name: str, dataset, model_spec, backend, rerun_of, config: dict[str, Any], strategy: str,
             nodes: int, procs_per_node: int, instance_type: str, spot: bool, max_runtime_s: int,
             budget_usd: Decimal | None, hourly_price: Decimal, on_demand_price: Decimal | None, estimate: Decimal,
             code, image: str, env: Mapping[str, str] | None, fingerprint, memory_plan, priority: int,
             lineage_fields: Mapping[str, Any] | None) -> TrainingJob:
    """The QUEUED job row for these values, not saved (:func:`_store_job` saves it; :func:`training_job_preview`
    shows it)."""
    return TrainingJob(
        owner=owner, team=team, name=name, dataset=dataset, model_spec=model_spec, backend=backend,
        rerun_of=rerun_of, config=config, strategy=strategy, nodes=nodes,
        procs_per_node=procs_per_node, instance_type=instance_type, spot=spot,
        max_runtime_s=max_runtime_s, budget_usd=budget_usd, hourly_price_usd=hourly_price,
        on_demand_price_usd=on_demand_price,
        estimated_cost_usd=estimate, instance_count=nodes, state=S.QUEUED,
        state_entered_at=timezone.now(), code=code, image=image, env=dict(env or {}),
        dataset_fingerprint=fingerprint, memory_plan=memory_plan, priority=priority,
        **dict(lineage_fields or {}),
    )


def training_job_preview(*, owner, **request: Any) -> TrainingJob:
    """The job :func:`training_job_create` would store for ``request``, checked the same way
    (:func:`training_job_check`; ValidationError with every error at once) and not saved: no row, no
    event, no submission (``pk`` None). For ``POST /api/jobs/estimate/``."""
    checked = training_job_check(owner=owner, **request)
    kwargs = checked.store_kwargs()
    estimate = costs.estimate_cost_usd(max_runtime_s=kwargs["max_runtime_s"], instances=kwargs["nodes"],
                                       hourly_price_usd=kwargs["hourly_price"], budget_usd=kwargs["budget_usd"])
    return _job_row(**kwargs, rerun_of=None, estimate=estimate)


@dataclasses.dataclass
class CheckedJob:
    """A job request that passed every check (:func:`training_job_check`): what :func:`training_job_create`
    stores, the price and the memory plan. Nothing of it is written yet."""

    owner: Any
    dataset: Dataset | None
    model_spec: ModelSpec
    backend: ComputeBackend
    config: JobConfig
    """The trainer config the job freezes (overrides, init fields included)."""
    instance_type: str
    spot: bool
    max_runtime_s: int
    budget_usd: Decimal | None
    hourly_price: Decimal
    on_demand_price: Decimal | None
    estimated_cost_usd: Decimal
    name: str
    team: Any
    priority: int
    code: CodeArchive | None
    image: str
    env: dict[str, str]
    memory_plan: MemoryPlan | None
    lineage_fields: dict[str, Any]

    def store_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`_store_job` for this job (the shape columns mirror the config)."""
        p = self.config.parallel
        return dict(owner=self.owner, dataset=self.dataset, model_spec=self.model_spec, backend=self.backend,
                    config=self.config.to_dict(), strategy=p.strategy, nodes=p.nodes,
                    procs_per_node=p.procs_per_node, instance_type=self.instance_type, spot=self.spot,
                    max_runtime_s=self.max_runtime_s, budget_usd=self.budget_usd, hourly_price=self.hourly_price,
                    on_demand_price=self.on_demand_price, name=self.name, team=self.team, priority=self.priority,
                    code=self.code, image=self.image, env=self.env,
                    memory_plan=self.memory_plan.as_dict() if self.memory_plan is not None else None,
                    fingerprint=_fingerprint(self.config) if self.dataset else None,
                    lineage_fields=self.lineage_fields)


def _request_values(request: Mapping[str, Any]) -> dict[str, Any]:
    """``request`` (keyword arguments by :data:`jobs.job_request.JOB_REQUEST` name) with every field
    it leaves out at its declared default; an unknown name is a TypeError, as for any Python call."""
    names = {f.name for f in job_request.JOB_REQUEST}
    unknown = sorted(set(request) - names)
    if unknown:
        raise TypeError(f"training_job_check() got an unexpected keyword argument {unknown[0]!r}")
    missing = [f.name for f in job_request.JOB_REQUEST if f.required and f.name not in request]
    if missing:
        raise TypeError(f"training_job_check() missing required keyword argument {missing[0]!r}")
    values = {f.name: f.default for f in job_request.JOB_REQUEST}
    values.update(request)
    return values


def training_job_create(*, owner, rerun_of: TrainingJob | None = None, cloned_from: TrainingJob | None = None,
                        source_job: TrainingJob | None = None, init_mode: str = "", **request: Any) -> TrainingJob:
    """Check a job request (:func:`training_job_check`), store it QUEUED with its frozen trainer config,
    and enqueue its submission (``jobs.tasks.submit_job``, sent to the backend's queue when the
    transaction commits). ``rerun_of``: the job this one re-runs (recorded). The monthly budgets are
    checked again under row locks as the row is written (ValidationError with the figures)."""
    checked = training_job_check(owner=owner, cloned_from=cloned_from, source_job=source_job, init_mode=init_mode,
                                 **request)
    return _store_job(**checked.store_kwargs(), rerun_of=rerun_of)


def training_job_check(*, owner, cloned_from: TrainingJob | None = None, source_job: TrainingJob | None = None,
                       init_mode: str = "", **request: Any) -> CheckedJob:
    """Check a job request without writing anything: the checked job (:class:`CheckedJob`: its frozen
    config, price, estimate and memory plan), or a ValidationError with every error at once.

    ``request``: the fields of :data:`jobs.job_request.JOB_REQUEST` by name (a field left out takes its
    declared default; the config fields' defaults are the trainer's). The config fields
    (``strategy``, ``nodes``, ``epochs``, ``lr``, the pipeline and large-model settings, ...) are set
    at their config paths (:func:`jobs.job_request.config_sections`); an optional one None or ""
    keeps the config's default.

    ``dataset``/``model_spec``/``backend`` are instances (or pks) that must belong to ``owner``;
    ``dataset`` None (or "") only for a model of kind script, whose script reads its own data (its
    job has no ``TRAINBOARD_DATA_DIR``). ``hyperparameters`` (dict or JSON text) are JobConfig overrides merged over the arguments, e.g.
    ``{"train": {"optimizer": "adamw"}}`` (not the ``code`` section: the model's archive sets it).
    The backend checks the shape (``Backend.validate``).
    ``team`` (a Team or its pk; None/"" = no team) must be one of the owner's teams: the job is then
    shared with it and counts toward its monthly budget. A submission whose estimate would take the
    owner's or the team's month-to-date spend past its monthly budget is refused with the figures
    (``jobs.budgets``).

    The model's kind decides the config (docs/user-code.md): a built-in architecture as it is; kind
    ``code``: ``model.arch`` "custom" with the model's entry point, parameters and shard classes;
    kind ``script``: ``code.script`` and ``code.args`` (no model checks: the script is the model).
    Both record ``code.sha256`` and the job's ``code`` (the model's archive now; a re-run keeps it).
    ``env``: the job's environment variables, a dict or ``KEY=VALUE`` lines
    (:func:`jobs.validation.env_vars`: names not reserved for the launcher or the platform, not one
    of the backend's job secrets; at most 64; values ≤ 4,096 characters). ``image``: a container
    image reference; None or "" = the model's image, else the backend's. The dataset's fingerprint
    (:func:`jobs.fingerprints.dataset_fingerprint`) is stored with the job.
    ``activation_checkpointing``, ``cpu_offload`` (``parallel``), ``checkpoint_format`` (``output``),
    ``max_steps`` (``train``, optimizer steps) and ``seq_len`` (``data``, tokens per window): the
    config's fields of those names (trainer_pkg/config.py, docs/large-models.md); None = the
    config's default; the hyperparameters override them like the other arguments.
    ``priority``: a whole number from -100 to 100 (``validation.PRIORITY_RANGE``); where the backend
    queues jobs itself (a GPU box whose GPUs are taken: :mod:`jobs.admission`) higher starts first,
    equal priorities in submission order.
    ``cloned_from``: the job whose settings this one was made from (recorded, shown as lineage).
    ``init_mode`` continue | finetune with ``source_job``: start from that job's last checkpoint or
    trained weights (:func:`jobs.services.lineage.job_init` checks what the trainer would refuse and
    sets ``train.init_from``); both jobs must be ones ``owner`` sees (own or a team's).
    The owner's and the team's monthly budgets are read (in a transaction of its own that writes nothing).
    Raises ValidationError keyed by the request's field names (every error at once).
    """
    values = _request_values(request)
    dataset, model_spec, backend, team = (values[k] for k in ("dataset", "model_spec", "backend", "team"))
    errors = Errors()
    if cloned_from is not None:
        cloned_from = validation.owned(errors, "cloned_from", TrainingJob, cloned_from, owner, "job")
    if source_job is not None:
        source_job = validation.owned(errors, "source_job", TrainingJob, source_job, owner, "job")
    init_mode = init_mode or ""
    model_spec = validation.owned(errors, "model_spec", ModelSpec, model_spec, owner, "model")
    # A script may read its own data (or none): its job needs no dataset. Every other kind does.
    no_dataset = dataset in (None, "") and model_spec is not None and model_spec.kind == ModelSpec.Kind.SCRIPT
    if no_dataset:
        dataset = None
    elif dataset in (None, "") and model_spec is not None:
        dataset = None
        errors.add("dataset", f"Choose a dataset: model {model_spec.name} trains on one (only a script model may "
                              f"run without, reading its own data).")
    else:
        dataset = validation.owned(errors, "dataset", Dataset, dataset, owner, "dataset")
    backend = validation.owned(errors, "backend", ComputeBackend, backend, owner, "backend")
    team = validation.member_team(errors, team, owner)
    values["nodes"], values["procs_per_node"], max_runtime_s = validation.shape_ints(
        errors, values["nodes"], values["procs_per_node"], values["max_runtime_s"])
    values["epochs"] = validation.whole_number(errors, "epochs", values["epochs"], minimum=1,
                                               maximum=validation.MAX_EPOCHS, label="Epochs")
    values["batch_size"] = validation.whole_number(errors, "batch_size", values["batch_size"], minimum=1,
                                                   maximum=validation.MAX_BATCH_SIZE, label="Batch size")
    values["seed"] = validation.whole_number(errors, "seed", values["seed"], minimum=0, maximum=validation.MAX_SEED,
                                             label="Seed")
    low, high = validation.PRIORITY_RANGE
    priority = validation.whole_number(errors, "priority", 0 if values["priority"] is None else values["priority"],
                                       minimum=low, maximum=high, label="Priority")
    values["lr"] = validation.positive_float(errors, "lr", values["lr"], label="Learning rate")
    budget = validation.budget(errors, values["budget_usd"])
    overrides = _hyperparameters(errors, values["hyperparameters"])
    if "code" in overrides:
        errors.add("hyperparameters", "Hyperparameters: the code section is set from the model's code archive "
                                      "(its hash, script and arguments); remove it, and change the model instead.")
        overrides = {k: v for k, v in overrides.items() if k != "code"}
    overrides = _without_backend_paths(errors, overrides)
    overrides = _without_init_fields(errors, overrides)
    _check_override_conflicts(errors, request, overrides)
    env = validation.env_vars(errors, "env", values["env"])
    image = _job_image(errors, values["image"], model_spec)
    instance_type = (values["instance_type"] or "").strip()
    spot = bool(values["spot"])
    name = (values["name"] or "").strip()[:200]
    for field, label, text in (("name", "Name", name), ("instance_type", "Instance type", instance_type)):
        if (problem := validation.text_problem(text)) is not None:
            errors.add(field, f"{label} {problem}")
    if backend is not None:
        _check_env_against_secrets(errors, env, backend)
    archive = _model_archive(errors, model_spec)
    if (dataset is None and not no_dataset) or model_spec is None:
        errors.raise_if_any()
    # A field that failed carries a stand-in from here on (whole_number's bound, positive_float's
    # 1.0, no overrides, ...) so that the config and backend checks still run and one submit shows
    # every error. They add to ``later``; what they say of a flagged field, or of the whole input,
    # is about the stand-ins and is dropped (validation.merge_later).
    flagged, later = set(errors), Errors()

    def stop_if_any() -> None:
        validation.merge_later(errors, later, flagged)
        errors.raise_if_any()

    # The trainer config: data from the Dataset, model from the ModelSpec, shape and training from
    # the arguments, then the user's overrides; the trainer's own schema validates the result.
    base = job_base_config(dataset=dataset, model_spec=model_spec, archive=archive,
                           **{f.name: values[f.name] for f in job_request.JOB_REQUEST if f.config})
    overridden = _flatten_keys(overrides)
    is_script = model_spec.kind == ModelSpec.Kind.SCRIPT
    config, refused = _checked_config(later, base, overrides, overridden, is_script)
    # Each refusal is the user's own error (kept), and the checks go on without the refused key (an
    # override left out, a field at the config's default), its field flagged: the trainer's schema
    # stops at its first error, so the next refused key is found too (a clone's checkpoint format,
    # then its max steps and sequence length), and the batch and backend checks below run on a
    # config the trainer takes, keeping what they say of the fields that did not fail.
    dropped: set[str] = set()
    while refused - dropped:
        validation.merge_later(errors, later, flagged)
        flagged |= set(map(validation.field_of, later))
        later.clear()
        dropped |= refused
        kept = _without_keys(overrides, dropped)
        own = {k for k in dropped if _config_error_field(k, overridden) != "hyperparameters"}
        config, refused = _checked_config(later, _without_keys(base, own), kept, _flatten_keys(kept), is_script)
    if config is None or any(validation.field_of(key) not in flagged for key in later):
        stop_if_any()  # the backend's checks need a config the trainer takes
    # Pending, not raised: the backend's checks below still run, so one submit shows both. A script
    # has no model of ours to fit; a custom model passes the registry's rule (its shapes are known
    # only once its entry point runs: the trainer checks the first batch).
    fits = is_script or _check_model_fits_dataset(later, config, dataset, model_spec, overridden)
    if not is_script:  # a script reads its own batch size
        _check_batch_fits_dataset(later, config, dataset, overridden)

    # The frozen config is the truth; the row's shape columns mirror it (overrides included).
    strategy, nodes, procs_per_node = config.parallel.strategy, config.parallel.nodes, config.parallel.procs_per_node
    adapter = _adapter_or_error(later, backend)
    if adapter is None:
        stop_if_any()
    lineage_fields: dict[str, Any] = {"cloned_from": cloned_from}
    if init_mode or source_job is not None:  # train.init_from set on the config before it is frozen
        epochs_done = lineage.job_init(later, source=source_job, mode=init_mode, config=config, backend=backend,
                                       adapter=adapter, dataset=dataset)
        lineage_fields.update(source_job=source_job, init_mode=init_mode, source_checkpoint_epoch=epochs_done)
    spec = JobSpec(job_name="tb-job-new", config=config.to_dict(), nodes=nodes, procs_per_node=procs_per_node,
                   instance_type=instance_type, spot=spot, max_runtime_s=max_runtime_s,
                   dataset_uri=config.data.uri, env=env, code=code_bundle(archive), image=image,
                   secret_env=dict(backend.job_secrets or {}))
    _check_spec(later, adapter, spec, strategy, dataset)
    price = _hourly_price(later, adapter, instance_type, spot)
    # No plan of a model that cannot read the data (a cnn's arithmetic on token windows means nothing).
    memory = None if is_script or not fits else job_memory_plan(config=config, dataset=dataset, adapter=adapter,
                                                    instance_type=instance_type, backend_name=backend.name)
    if memory is not None and memory.fits is False:
        later.add(ALL, ValidationError(memory_refusal(memory), code=validation.WHOLE_INPUT))
    estimate = costs.estimate_cost_usd(max_runtime_s=max_runtime_s, instances=nodes, hourly_price_usd=price,
                                       budget_usd=budget)
    validation.check_estimate(later, estimate)
    stop_if_any()
    with transaction.atomic():  # the budgets' rows are read under their locks, released at once: nothing is written
        check_monthly_budgets(owner=owner, team=team, estimate=estimate)
    return CheckedJob(owner=owner, dataset=dataset, model_spec=model_spec, backend=backend, config=config,
                      instance_type=instance_type, spot=spot, max_runtime_s=max_runtime_s, budget_usd=budget,
                      hourly_price=price, on_demand_price=_on_demand_price(adapter, instance_type, spot, price),
                      estimated_cost_usd=estimate, name=name, team=team, priority=priority, code=archive,
                      image=image, env=env, memory_plan=memory, lineage_fields=lineage_fields)


def _checked_config(errors: Errors, base: dict[str, Any], overrides: dict[str, Any], overridden: set[str],
                    is_script: bool) -> tuple[JobConfig | None, set[str]]:
    """The trainer config of ``base`` with ``overrides`` merged in, checked by the trainer's own
    schema and the job rules (:func:`_job_config_errors`), and the dotted keys they refused
    (``train.optimizer``). Errors go to ``errors`` under the field each belongs to
    (``hyperparameters`` for an overridden key). The config is None when the trainer's schema refuses
    it (it then cannot be built at all)."""
    config, refused = None, set()
    try:
        config = JobConfig.from_dict(_deep_merge(base, overrides))
        if not is_script:
            config.model.params = validate_model_params(config.model.arch, config.model.params)
    except ConfigError as exc:
        _add_config_error(errors, exc, overridden)
        refused |= set(exc.errors)
        dotted = str(exc).split(":", 1)[0].strip() if ":" in str(exc) and not exc.errors else ""
        if dotted and " " not in dotted:
            refused.add(dotted)  # the model registry's errors name their field in the text
    if config is not None:
        for dotted, message in _job_config_errors(config, is_script).items():
            field = _config_error_field(dotted, overridden)
            errors.add(field, _config_message(dotted, field, f"{dotted}: {message}"))
            refused.add(dotted)
    return config, refused


def _without_keys(overrides: Mapping[str, Any], dotted_keys: set[str]) -> dict[str, Any]:
    """``overrides`` (nested dicts) less every key named in ``dotted_keys`` (``train.optimizer``);
    a key named that it does not hold is ignored."""
    kept: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in dotted_keys:
            continue
        inner = {k.split(".", 1)[1] for k in dotted_keys if k.startswith(key + ".")}
        if inner and isinstance(value, Mapping):
            value = _without_keys(value, inner)
            if not value:
                continue  # a section emptied of its refused keys overrides nothing (its errors are the arguments')
        kept[key] = value
    return kept


def job_base_config(*, dataset: Dataset | None, model_spec: ModelSpec, archive: CodeArchive | None,
                    **settings: Any) -> dict[str, Any]:
    """The trainer config (a partial JobConfig dict, before the hyperparameters' overrides) that
    :func:`training_job_create` builds from its request: data from the Dataset, model (and code) from the
    ModelSpec, and the request's config fields (``settings`` by request name: ``strategy``, ``epochs``,
    ...) at their config paths (:func:`jobs.job_request.config_sections`: an optional one None or ""
    is left to the config's default). :func:`jobs.services.clones.training_job_clone_data` diffs a
    job's config against it. Without a dataset (a script's job that reads its own data) the ``data``
    section keeps its defaults: no path."""
    base = {
        "data": {"format": dataset.format, "name": dataset.builtin_name or "digits", "uri": dataset.uri,
                 "label_column": dataset.label_column or "label"} if dataset is not None else {},
        **_model_sections(model_spec, archive),
    }
    return _deep_merge(base, job_request.config_sections(settings))


def _model_sections(model_spec: ModelSpec, archive: CodeArchive | None) -> dict[str, Any]:
    """The ``model`` and ``code`` sections of a job's config for ``model_spec`` (docs/user-code.md
    "Trainer config"); ``code.dir`` is left for the backend to set where it puts the archive."""
    if model_spec.kind == ModelSpec.Kind.CODE:
        return {"model": {"arch": CUSTOM, "entry_point": model_spec.entry_point,
                          "params": dict(model_spec.params or {}),
                          "shard_classes": list(model_spec.shard_classes or [])},
                "code": {"sha256": archive.sha256 if archive else ""}}
    if model_spec.kind == ModelSpec.Kind.SCRIPT:
        return {"code": {"sha256": archive.sha256 if archive else "", "script": model_spec.entry_point,
                         "args": list(model_spec.script_args or []), "framework": model_spec.framework}}
    return {"model": {"arch": model_spec.architecture, "params": dict(model_spec.params or {})}}


def _model_archive(errors: Errors, model_spec: ModelSpec | None) -> CodeArchive | None:
    """The archive a job of ``model_spec`` runs (kinds code and script); an error on ``model_spec``
    when such a model has none."""
    if model_spec is None or model_spec.kind == ModelSpec.Kind.BUILTIN:
        return None
    if model_spec.code_id is None:
        errors.add("model_spec", f"Model {model_spec.name} has no code archive; upload its code in the model "
                                 f"form, then launch the job.")
        return None
    return model_spec.code


def _job_config_errors(config: JobConfig, is_script: bool) -> dict[str, str]:
    """The trainer's own checks of a job's config: all of them (:func:`config_errors`), except for a
    script, whose model section is not ours: its fields and its shape without the layer count. And
    ``data.seq_len`` (not 0) only where the trainer reads it: a tokens dataset, not a script's job."""
    if not is_script:
        errs = config_errors(config)
        if config.data.seq_len and config.data.format != TOKENS_FORMAT and "data.seq_len" not in errs:
            # The trainer reads data.seq_len for a tokens dataset only (trainer_pkg.train: TokenData).
            errs["data.seq_len"] = (f"token datasets only: this job reads {config.data.format} data, whose samples "
                                    f"are not windows of tokens, so {config.data.seq_len:,} would be ignored; leave "
                                    f"it blank (0)")
        return errs
    errs = config.field_errors()
    if config.data.seq_len and "data.seq_len" not in errs:
        # A script is passed the train section only (TRAINBOARD_HPARAMS), never data.seq_len.
        errs["data.seq_len"] = (f"token datasets of our trainer only: a script model reads its own data and is not "
                                f"passed data.seq_len, so {config.data.seq_len:,} would be ignored; leave it blank (0), "
                                f"or give the length in the model's script arguments")
    p = config.parallel
    if "parallel.nodes" not in errs and "parallel.procs_per_node" not in errs:
        found = shape_errors(config, world_size=p.world_size, world_desc=describe_world(p.nodes, p.procs_per_node),
                             check_layers=False)
        for dotted, message in found.items():
            errs.setdefault(dotted, message)
    return errs


def _job_image(errors: Errors, image: str | None, model_spec: ModelSpec | None) -> str:
    """The job's container image: ``image`` when given (checked, error on ``image``), else the
    model's, else "" (the backend's)."""
    if not isinstance(image, (str, type(None))):
        errors.add("image", "Image must be text: a container image reference, or blank for the model's or "
                            "the backend's image.")
        return ""
    image = (image or "").strip()
    if not image:
        return model_spec.image if model_spec is not None else ""
    if (problem := validation.text_problem(image)) is not None:
        errors.add("image", f"Image {problem}")
        return ""
    if (problem := validation.image_problem(image)) is not None:
        errors.add("image", problem)
        return ""
    return image


def _check_env_against_secrets(errors: Errors, env: Mapping[str, str], backend: ComputeBackend) -> None:
    """An error on ``env`` for each variable that is also one of ``backend``'s job secrets: the
    secret would be set twice, and which value wins differs between platforms."""
    for name in sorted(set(backend.job_secrets or {}) & set(env)):
        errors.add("env", f"Environment variable {name} is a job secret of backend {backend.name}; remove it "
                          f"here (the secret is set in the job already), or choose another name.")


def _fingerprint(config: JobConfig) -> dict[str, Any] | None:
    """The dataset fingerprint of the data the job's config reads (None for a cloud URI: the worker
    takes it at submit)."""
    data = config.data
    return dataset_fingerprint(format=data.format, uri=data.uri, builtin_name=data.name)


def _reads_dataset(config: JobConfig, dataset: Dataset) -> bool:
    """Whether the job's ``data`` section still reads ``dataset`` (the overrides may point it at other
    data, whose shape and size the dataset row does not describe)."""
    data = config.data
    return (data.format, data.uri) == (dataset.format, dataset.uri) and (
        dataset.format != Dataset.Format.BUILTIN or data.name == dataset.builtin_name)


def _check_batch_fits_dataset(errors: Errors, config: JobConfig, dataset: Dataset, overridden: set[str]) -> None:
    """An error on ``batch_size`` (``hyperparameters`` when they set it) when one step takes more
    samples than the training split holds: ``train.batch_size`` × the data-parallel ranks (a
    pipeline's replicas) > the dataset's training samples (:func:`trainer_pkg.datasets.train_split_size`
    of the samples counted when it was saved, ``data.val_fraction`` held out). Such a job trains one
    smaller batch per rank an epoch and "succeeds" having learnt little, so it is refused with the
    arithmetic. Not checked when the size is not known (a cloud URI, a large CSV, token data): the
    trainer then logs the batch it really used (``ShardOrder.small_batch_note``). Worked out from
    :data:`_BATCH_INPUTS` together (:func:`jobs.validation.worked_out_from`)."""
    if dataset.num_samples is None or not _reads_dataset(config, dataset):
        return
    data, p, batch = config.data, config.parallel, config.train.batch_size
    train = train_split_size(dataset.num_samples, dataset.val_samples, data.val_fraction)
    world = p.world_size
    ranks = max(world // pipeline_stage_count(p, world), 1) if p.strategy == "pipeline" else world
    if batch * ranks <= train:
        return
    if dataset.val_samples is not None:
        split = f"{dataset.num_samples:,} less its {dataset.val_samples:,} validation samples"
    else:
        split = (f"{dataset.num_samples:,} less {held_out(dataset.num_samples, data.val_fraction):,} held out for "
                 f"validation, data.val_fraction {data.val_fraction:g}")
    most = train // ranks
    fix = (f"use a batch size of at most {most:,}" + (" or fewer ranks" if ranks > 1 else "")) if most >= 1 else \
        f"use at most {train:,} data-parallel ranks, or more data"
    message = (f"Batch size {batch:,} × {ranks} data-parallel rank{'s' if ranks != 1 else ''} = {batch * ranks:,} "
               f"samples per step exceeds the {train:,} training samples of dataset {dataset.name} ({split}): each "
               f"epoch would be one smaller batch per rank; {fix}.")
    errors.add(_config_error_field("train.batch_size", overridden), validation.worked_out_from(message, _BATCH_INPUTS))


_BATCH_INPUTS = ("batch_size", "nodes", "procs_per_node", "strategy", "pipeline_stages", "dataset", "hyperparameters")
"""The request fields :func:`_check_batch_fits_dataset` works its arithmetic from: its refusal stands
while another field (CPU offload) failed, and is dropped when one of these did (of a stand-in)."""


def _check_model_fits_dataset(errors: Errors, config: JobConfig, dataset: Dataset, model_spec: ModelSpec,
                              overridden: set[str]) -> bool:
    """False, with an error (on ``model_spec``, or ``hyperparameters`` when they chose the
    architecture), when the job's architecture cannot take the dataset's samples, by the registry's own rule
    (:func:`trainer_pkg.registry.check_input_shape`) on the shape read when the dataset was saved
    (``Dataset.sample_shape``); the message names both shapes. Token data and the language model
    (``gpt``) go together only, whatever the shape; a window is the job's ``data.seq_len`` (or the
    model's context length) long, at most that context length. Not checked when the shape is unknown
    (a cloud URI) for a classifier, or when the overrides point the job at other data."""
    data = config.data
    if not _reads_dataset(config, dataset):
        return True
    shape = dataset.sample_shape
    if shape is None and data.format != TOKENS_FORMAT and config.model.arch != "gpt":
        return True  # unknown shape; gpt refuses any format but tokens whatever the shape
    try:
        if data.format == TOKENS_FORMAT:  # a window's length is the job's (data.seq_len or the context length)
            shape = [seq_len_for(data.seq_len, config.model.arch, config.model.params) or None]
        check_input_shape(config.model.arch, shape or [None], data_format=data.format, params=config.model.params)
    except ConfigError as exc:
        reason = str(exc).removeprefix("model.arch: ")
        errors.add(_config_error_field("model.arch", overridden),
                   f"Model {model_spec.name} does not fit dataset {dataset.name}: {reason}.")
        return False
    return True


def training_job_estimate(*, backend: ComputeBackend, nodes: int = 1, procs_per_node: int = 1,
                          max_runtime_s: int = 3600, instance_type: str = "", spot: bool = False,
                          strategy: str = "ddp", pipeline_stages: int | None = None,
                          microbatches: int | None = None, pipeline_schedule: str | None = None,
                          batch_size: int | None = None, model_spec: ModelSpec | None = None,
                          budget_usd: Any = None, dataset: Dataset | None = None,
                          hyperparameters: Any = None, activation_checkpointing: bool | None = None,
                          cpu_offload: bool | None = None, checkpoint_format: str | None = None,
                          max_steps: int | None = None, seq_len: int | None = None) -> dict:
    """Price of a shape before launch: ``{"hourly_price_usd", "estimated_cost_usd", "arithmetic",
    "money_places", "max_runtime_covers", "world_size", "message", "price_note"}`` (``price_note``:
    the adapter's ``price_note``, e.g. no internal rate set; also at the end of ``message``); ``money_places`` (2 or 4) is
    the one precision the estimate, its arithmetic and the budget are shown at.

    Estimate = min(max runtime × instances (nodes) × hourly price, ``budget_usd``) — the budget only
    when given (:func:`jobs.cost.estimate_cost_usd`); ``arithmetic`` is that sum in words
    (:func:`jobs.cost.estimate_arithmetic`), ``max_runtime_covers`` what the backend's limit counts
    (``Backend.max_runtime_covers``: start-up included). Raises ValidationError like
    :func:`training_job_create` for a shape the backend cannot run, including the strategy's own
    arithmetic (pipeline stages against ranks, micro-batches against the batch size and, with
    ``model_spec``, stages against the model's layers), keyed by the same field names.

    With ``model_spec`` and ``dataset`` (the large-model settings and the ``hyperparameters``
    overrides, as for :func:`training_job_create`), ``"memory_plan"`` is the job's memory plan as a dict
    (:meth:`trainer_pkg.memory_plan.MemoryPlan.as_dict`: per-rank terms, ``fits`` against the
    instance's GPU memory, ``lines``, ``suggestion``), the one :func:`training_job_create` refuses a
    job by; None when no plan can be made. The estimate itself is not refused for it.
    """
    errors = Errors()
    nodes, procs_per_node, max_runtime_s = validation.shape_ints(errors, nodes, procs_per_node, max_runtime_s)
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
    budget = validation.budget(errors, budget_usd)
    errors.raise_if_any()
    shape = dict(max_runtime_s=max_runtime_s, instances=nodes, hourly_price_usd=price, budget_usd=budget)
    estimate = costs.estimate_cost_usd(**shape)
    validation.check_estimate(errors, estimate)
    errors.raise_if_any()
    world = nodes * procs_per_node
    places = costs.usd_places(costs.job_cost_usd(billable_seconds=max_runtime_s, instances=nodes,
                                                 hourly_price_usd=price), budget, estimate)
    arithmetic = costs.estimate_arithmetic(**shape, places=places)
    message = (f"{describe_world(nodes, procs_per_node)}; at most {arithmetic}"
               + ("" if budget is not None else f" = {costs.format_usd(estimate, places)}"))
    price_note = adapter.price_note(spec.instance_type)  # e.g. an own cluster without an internal rate
    if price_note:
        message += f"; {price_note}"
    memory = _estimate_memory_plan(
        adapter=adapter, backend=backend, dataset=dataset, model_spec=model_spec, hyperparameters=hyperparameters,
        instance_type=spec.instance_type, parallel={"strategy": strategy, "nodes": nodes, "procs_per_node": procs_per_node,
                                                    **_pipeline_fields(pipeline_stages, microbatches, pipeline_schedule)},
        batch_size=batch_size, settings=dict(
            activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
            checkpoint_format=checkpoint_format, max_steps=max_steps, seq_len=seq_len))
    return {"hourly_price_usd": price, "estimated_cost_usd": estimate, "arithmetic": arithmetic,
            "money_places": places, "max_runtime_covers": type(adapter).max_runtime_covers,
            "world_size": world, "message": message, "price_note": price_note,
            "memory_plan": memory.as_dict() if memory is not None else None}


def _estimate_memory_plan(*, adapter: Backend, backend: ComputeBackend, dataset: Dataset | None,
                          model_spec: ModelSpec | None, hyperparameters: Any, instance_type: str,
                          parallel: dict[str, Any], batch_size: int | None,
                          settings: Mapping[str, Any]) -> MemoryPlan | None:
    """The memory plan of the estimate's shape, built as :func:`training_job_create` builds the config
    (dataset, model, shape, overrides); None when a part is missing or invalid (the create reports it)."""
    if dataset is None or model_spec is None or model_spec.kind == ModelSpec.Kind.SCRIPT:
        return None
    overrides = _hyperparameters(Errors(), hyperparameters)
    overrides.pop("code", None)
    base = {"data": {"format": dataset.format, "name": dataset.builtin_name or "digits", "uri": dataset.uri,
                     "label_column": dataset.label_column or "label"},
            "model": _model_sections(model_spec, None)["model"], "parallel": parallel,
            "train": {"batch_size": batch_size} if batch_size is not None else {}}
    base = _deep_merge(base, job_request.config_sections(settings))
    try:
        config = JobConfig.from_dict(_deep_merge(base, overrides))
    except ConfigError:
        return None
    if config.field_errors():
        return None
    return job_memory_plan(config=config, dataset=dataset, adapter=adapter, instance_type=instance_type,
                           backend_name=backend.name)


def _plan_input(config: JobConfig, dataset: Dataset) -> tuple[tuple[int, ...], int, str] | None:
    """(one sample's shape, classes or vocabulary size, a note) for the memory plan of ``config`` on
    ``dataset``; None when the dataset's shape was never read (a cloud URI) or the overrides point
    the job at other data."""
    data = config.data
    if (data.format, data.uri) != (dataset.format, dataset.uri) or dataset.sample_shape is None:
        return None
    shape = tuple(data.image_size if s is None else int(s) for s in dataset.sample_shape)
    if data.format == "tokens":
        shape = (data.seq_len,) if data.seq_len else ()  # the plan reads the model's context length
        if dataset.num_classes is None:
            return None  # a vocabulary is no guess
    if dataset.num_classes is None:
        return shape, 2, (f"classes: dataset {dataset.name} was saved before Trainboard counted them; 2 assumed "
                          f"(save it again to count them)")
    return shape, dataset.num_classes, ""


def job_memory_plan(*, config: JobConfig, dataset: Dataset, adapter: Backend, instance_type: str,
                    backend_name: str) -> MemoryPlan | None:
    """The memory plan (:func:`trainer_pkg.memory_plan.plan`) of a job of ``config`` on ``dataset``,
    checked against the GPUs of ``instance_type`` on the backend (``Backend.gpus``: the catalog's GPU
    facts, or a GPU box's as set on it). Without a known GPU memory (a CPU type, a box without
    ``gpu_memory_gib``) the plan is made but never refuses. Its suggestion stays within the
    backend's capacity (``Capabilities.max_nodes`` × ``max_procs_per_node`` ranks). None when no plan can be made: a custom
    model (its structure is the user's), a dataset whose shape or vocabulary was not read."""
    found = _plan_input(config, dataset)
    if found is None or config.model.arch == CUSTOM:
        return None
    shape, classes, note = found
    try:
        gpus = adapter.gpus(instance_type)
    except BackendError:
        gpus = None
    host = None
    if gpus is None and callable(getattr(adapter, "host_memory", None)):
        host = adapter.host_memory(config.parallel.procs_per_node)  # a box without GPUs: its memory per rank
    device_bytes = gpus.memory_bytes if gpus is not None else host.per_rank_bytes if host is not None else None
    where = instance_type or f"backend {backend_name}'s default instance"
    if host is not None:
        where = f"backend {backend_name}'s host"
    name = f"{where}'s {gpus.model}" if gpus is not None and gpus.model else where
    caps = adapter.capabilities  # the suggestion names no FSDP world the backend cannot run
    try:
        planned = memory_plan(config, input_shape=shape, num_classes=classes, device_bytes=device_bytes,
                              device_name=name, max_ranks=caps.max_nodes * caps.max_procs_per_node,
                              device_unit="rank" if host is not None else "GPU")
    except PlanError:
        return None
    if note:
        planned.lines.insert(1, note)
    if host is not None:
        planned.device_name = f"{where} ({host.describe()})"
        planned.lines.append(f"device: {host.describe()}")
    if gpus is not None:
        planned.lines.append(f"device: {gpus.describe(instance_type or 'the default instance')}"
                             + (f" — {gpus.source}" if gpus.source else ""))
    return planned


def memory_refusal(memory: MemoryPlan) -> str:
    """The message that refuses a job whose plan does not fit: the summary, then the arithmetic."""
    where = "GPU memory" if memory.device_unit == "GPU" else "the machine's memory"
    return (f"The job does not fit in {where}: it {memory.summary}. The plan per rank: "
            + "; ".join(memory.lines) + ".")


def _check_strategy_shape(errors: Errors, *, strategy: str, nodes: int, procs_per_node: int,
                          batch_size: int | None, model_spec: ModelSpec | None, **pipeline: Any) -> None:
    """The JobConfig's shape errors (the trainer's own arithmetic) for the estimate's fields."""
    raw: dict[str, Any] = {"parallel": {"strategy": strategy, "nodes": nodes, "procs_per_node": procs_per_node,
                                        **pipeline}}
    if batch_size is not None:
        raw["train"] = {"batch_size": batch_size}
    # A script's model is its own: only the shape is checked, not its layers.
    with_model = model_spec is not None and model_spec.kind != ModelSpec.Kind.SCRIPT
    if with_model:
        raw["model"] = _model_sections(model_spec, None)["model"]
    try:
        config = JobConfig.from_dict(raw)
    except ConfigError as exc:
        _add_config_error(errors, exc, set())
        return
    found = shape_errors(config, world_size=nodes * procs_per_node, world_desc=describe_world(nodes, procs_per_node),
                         check_layers=with_model)
    for dotted, message in found.items():
        errors.add(_config_error_field(dotted, set()), message)


def training_job_rerun(*, job: TrainingJob, owner) -> TrainingJob:
    """A new QUEUED job with ``job``'s frozen config and shape (``rerun_of=job``), its code archive,
    image and environment (never the model's current archive: the re-run trains what ran), its
    dataset fingerprinted again, priced now; for ``job``'s team while the owner is still a member
    of it. The monthly budgets are checked as for a new job (ValidationError with the figures)."""
    errors = Errors()
    if job.owner_id != getattr(owner, "pk", None):
        errors.add(ALL, "You can only re-run your own jobs.")
        errors.raise_if_any()
    backend = job.backend
    adapter = _adapter_or_error(errors, backend)
    errors.raise_if_any()
    spec = dataclasses.replace(job_spec(job), devices=())  # a re-run is given its own devices when it starts
    _check_spec(errors, adapter, spec, job.strategy, job.dataset)
    price = _hourly_price(errors, adapter, job.instance_type, job.spot)
    errors.raise_if_any()
    config = dict(job.config)
    data = config.get("data") or {}
    fingerprint = dataset_fingerprint(format=data.get("format", ""), uri=data.get("uri", ""),
                                      builtin_name=data.get("name", "")) if job.dataset_id else None
    return _store_job(owner=owner, dataset=job.dataset, model_spec=job.model_spec, backend=backend,
                      config=config, strategy=job.strategy, nodes=job.nodes,
                      procs_per_node=job.procs_per_node, instance_type=job.instance_type, spot=job.spot,
                      max_runtime_s=job.max_runtime_s, budget_usd=job.budget_usd, hourly_price=price,
                      on_demand_price=_on_demand_price(adapter, job.instance_type, job.spot, price),
                      name=rerun_name(job), rerun_of=job, code=job.code, image=job.image, env=job.env,
                      fingerprint=fingerprint, memory_plan=job.memory_plan, priority=job.priority,
                      team=job.team if job.team_id and job.team.members.filter(pk=owner.pk).exists() else None)


def rerun_name(job: TrainingJob) -> str:
    """``<name> (re-run of #<id>)``; re-running a re-run replaces the suffix instead of stacking it."""
    base = re.sub(r" \(re-run of #\d+\)$", "", job.name or f"job-{job.pk}")
    return f"{base} (re-run of #{job.pk})"


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
                admission.wake_waiting(job.backend)  # a job that waited behind it may start now
                return job
            continue
        if state == S.STOPPING:
            if job.hang_restart_at is not None:
                # Stopping a hung run to restart it (jobs.restarts.stop_hung): the user's cancel ends it instead.
                TrainingJob.objects.filter(pk=job.pk, state=S.STOPPING).update(hang_restart_at=None,
                                                                                failure_reason=reason)
                note(job.pk, S.STOPPING, f"{reason}: it will not be restarted"[:2000])
                job.refresh_from_db()
            dispatch.cancel_after_commit(job.pk, backend_queue(job.backend))
            return job
        if transition(job, S.STOPPING, message=reason, failure_reason=reason, cancel_requested_at=now):
            dispatch.cancel_after_commit(job.pk, backend_queue(job.backend))
            return job
    return job
