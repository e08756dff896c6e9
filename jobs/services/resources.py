"""Writes of the resources a job is built from: datasets, model specs and compute backends (with the
backend's connection test and the instance types it offers the job form).

Every function is keyword-only. Input errors raise :class:`django.core.exceptions.ValidationError`
whose ``message_dict`` is keyed by the form/API field names (``__all__`` for the rest) with messages
a user can act on, and nothing is written when they raise. The contract is docs/internal-api.md.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, NamedTuple, get_args

from django.conf import settings
from django.core.exceptions import ValidationError

from cloud_adapters.base import BackendError, ConnectionCheck, InstanceOffer, InvalidSpec, with_article
from cloud_adapters import registry
from jobs.adapters import (
    HOST_SETTING_SOURCES,
    backend_adapter,
    backend_host_settings,
    backend_secret_keys,
    backend_setting_labels,
    effective_config,
    may_set_host_settings,
    worker_credentials_refusal,
)
from jobs.deadlines import clean_state_deadlines
from jobs.models import ACTIVE_STATE_VALUES, ComputeBackend, Dataset, ModelSpec
from jobs.validation import ALL, Errors, full_clean, json_object, member_team, name_taken, team_field, update_row
from trainer_pkg.config import BuiltinDataset, ConfigError, Strategy
from trainer_pkg.datasets import inspect_dataset
from trainer_pkg.registry import ARCHITECTURES, validate_model_params

log = logging.getLogger(__name__)


# =============================================================================================
# Datasets
# =============================================================================================

_DATASET_FIELDS = {"name", "description", "format", "builtin_name", "uri", "label_column", "team"}

def _validate_dataset(errors: Errors, dataset: Dataset) -> None:
    full_clean(errors, dataset)
    if dataset.name and name_taken(Dataset, dataset.owner, dataset.name, dataset.pk):
        errors.add("name", f"You already have a dataset named {dataset.name}; choose another name.")
    if dataset.team_id is not None and not dataset.team.members.filter(pk=dataset.owner_id).exists():
        errors.add("team", "Choose one of your teams; you are not a member of this one.")
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


def _dataset_local_path(errors: Errors, uri: str) -> str | None:
    """``uri`` (a path, or ``file://`` + path) as an absolute path with symlinks and ``..`` resolved,
    when it lies inside one of ``settings.TRAINBOARD_DATASET_ROOTS`` (a relative path is taken
    relative to the first root). None, with an error on ``uri``, when it escapes them."""
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
    errors = Errors()
    team = member_team(errors, team, owner)
    dataset = Dataset(owner=owner, name=(name or "").strip(), format=format, builtin_name=builtin_name or "",
                      uri=(uri or "").strip(), label_column=label_column or "label",
                      description=description or "", team=team)
    _validate_dataset(errors, dataset)
    errors.raise_if_any()
    dataset.save()
    return dataset


def dataset_update(*, dataset: Dataset, **fields: Any) -> Dataset:
    """Change some of ``name, description, format, builtin_name, uri, label_column, team`` (``team``:
    a Team or pk of one of the owner's teams, None = private). Raises ValidationError; the row is
    untouched then."""
    errors = Errors()
    fields = team_field(errors, fields, dataset.owner)
    return update_row(dataset, fields, allowed=_DATASET_FIELDS, validate=_validate_dataset,
                   empty={"team": None}, errors=errors)


# =============================================================================================
# Model specs
# =============================================================================================

_MODEL_FIELDS = {"name", "description", "architecture", "params", "team"}


def _validate_model_spec(errors: Errors, spec: ModelSpec) -> None:
    full_clean(errors, spec)
    if spec.name and name_taken(ModelSpec, spec.owner, spec.name, spec.pk):
        errors.add("name", f"You already have a model named {spec.name}; choose another name.")
    if spec.team_id is not None and not spec.team.members.filter(pk=spec.owner_id).exists():
        errors.add("team", "Choose one of your teams; you are not a member of this one.")
    arch = ARCHITECTURES.get(spec.architecture)
    example = json.dumps(arch.defaults()) if arch else '{"hidden_size": 128}'
    params = json_object(errors, "params", spec.params, what="Parameters", example=example)
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
    errors = Errors()
    team = member_team(errors, team, owner)
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
    errors = Errors()
    if "params" not in fields and fields.get("architecture", model_spec.architecture) != model_spec.architecture:
        fields = {**fields, "params": {}}  # completed with the new architecture's defaults
    fields = team_field(errors, fields, model_spec.owner)
    return update_row(model_spec, fields, allowed=_MODEL_FIELDS, validate=_validate_model_spec,
                   empty={"params": {}, "team": None}, errors=errors)


# =============================================================================================
# Compute backends
# =============================================================================================

_BACKEND_FIELDS = {"name", "kind", "config", "enabled", "team", "state_deadlines", "stall_policy", "orphan_policy"}

def _clean_secrets(errors: Errors, kind: str, secrets: Any) -> dict[str, str] | None:
    """``secrets`` checked against the kind's accepted keys: a dict of non-empty strings; {} stores
    none. Errors go on ``secrets`` and name keys only, never values. None when invalid."""
    if not isinstance(secrets, Mapping):
        errors.add("secrets", "Secrets must be an object of key: value strings.")
        return None
    cleaned = {str(k): v for k, v in secrets.items() if v not in (None, "")}
    if not cleaned:
        return {}
    accepted = backend_secret_keys(kind)
    label = registry.KINDS[kind].label if kind in registry.KINDS else "this"
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


def _validate_backend(errors: Errors, backend: ComputeBackend) -> None:
    full_clean(errors, backend)
    if backend.name and name_taken(ComputeBackend, backend.owner, backend.name, backend.pk):
        errors.add("name", f"You already have a backend named {backend.name}; choose another name.")
    backend.state_deadlines, deadline_errors = clean_state_deadlines(backend.state_deadlines)
    for message in deadline_errors:
        errors.add("state_deadlines", message)
    if backend.team_id is not None and not backend.team.members.filter(pk=backend.owner_id).exists():
        errors.add("team", "Choose one of your teams; you are not a member of this one.")
    config = json_object(errors, "config", backend.config, what="Config", example='{"hourly_rate_usd": 1.5}',
                          plural=False)
    if config is None:
        return
    try:
        cls = registry.backend_class(backend.kind)
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
    effective = effective_config(backend.kind, config, host_settings_from_row=staff_owned)
    refusal = worker_credentials_refusal(cls, effective, secrets, backend.owner) if secrets is not None else None
    if refusal:
        # Named by the first key to give, as the other secrets messages are, so the form puts it there.
        first = next(k for k, required in cls.settings.secret_keys.items() if required)
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
    errors = Errors()
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
    errors = Errors()
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
    return update_row(backend, fields, allowed=_BACKEND_FIELDS | {"secrets"}, validate=_validate_backend,
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
