"""Writes of the resources a job is built from: datasets, model specs and compute backends (with the
backend's connection test and the instance types it offers the job form).

Every function is keyword-only. Input errors raise :class:`django.core.exceptions.ValidationError`
whose ``message_dict`` is keyed by the form/API field names (``__all__`` for the rest) with messages
a user can act on, and nothing is written when they raise. The contract is docs/internal-api.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
from pathlib import Path
from typing import Any, Mapping, NamedTuple, get_args

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from cloud_adapters.base import BackendError, ConnectionCheck, InstanceOffer, InvalidSpec, with_article
from cloud_adapters import registry
from jobs.adapters import (
    HOST_SETTING_SOURCES,
    backend_adapter,
    backend_host_settings,
    backend_queue,
    backend_queue_holder,
    backend_secret_keys,
    backend_setting_labels,
    effective_config,
    may_set_host_settings,
    worker_credentials_refusal,
)
from jobs import code_archives
from jobs.deadlines import clean_state_deadlines
from jobs.models import ACTIVE_STATE_VALUES, DEFAULT_MAX_RESTARTS, MAX_RESTARTS, ComputeBackend, Dataset, ModelSpec
from jobs.validation import (
    ALL,
    Errors,
    MAX_ENV_VARS,
    env_vars,
    full_clean,
    image_problem,
    json_object,
    member_team,
    name_taken,
    team_field,
    text_problem,
    update_row,
)
from trainer_pkg.config import BuiltinDataset, ConfigError, Strategy, script_arg_problems
from trainer_pkg.datasets import DatasetInfo, inspect_dataset
from trainer_pkg.registry import ARCHITECTURES, CUSTOM, validate_model_params

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
    # a cloud URI is not read here: its shape and size are not known
    dataset.sample_shape = dataset.num_classes = dataset.num_samples = dataset.val_samples = None
    dataset.summary = ""
    if dataset.format == Dataset.Format.BUILTIN:
        known = get_args(BuiltinDataset)
        if dataset.builtin_name not in known:
            errors.add("builtin_name", f"Choose a built-in dataset: {', '.join(known)}.")
        else:
            info = inspect_dataset(dataset.format, dataset.builtin_name)
            _keep_info(dataset, info)
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
            _keep_info(dataset, info)


def _keep_info(dataset: Dataset, info: DatasetInfo) -> None:
    """What :func:`inspect_dataset` read, stored on the row: the sample's shape, the classes (or the
    vocabulary), the samples counted (and those of its own validation split) and the one-line
    summary (cut to the field's 500 characters)."""
    dataset.sample_shape, dataset.num_classes = list(info.sample_shape), info.classes
    dataset.num_samples, dataset.val_samples = info.samples, info.val_samples
    limit = Dataset._meta.get_field("summary").max_length
    dataset.summary = info.summary if len(info.summary) <= limit else info.summary[:limit - 1] + "…"


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

_MODEL_FIELDS = {"name", "description", "kind", "architecture", "params", "team", "entry_point", "script_args",
                 "shard_classes", "image", "framework"}
_CODE_FIELDS = ("entry_point", "script_args", "shard_classes")
MAX_SCRIPT_ARGS = 200
MAX_SHARD_CLASSES = 50
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _validate_model_spec(errors: Errors, spec: ModelSpec, archive: code_archives.NormalizedArchive | None = None) -> None:
    """Every check of ``spec``, its errors added to ``errors``. ``archive``: the code given with this
    write (already normalized), else the stored one is read back when the entry point must be checked."""
    full_clean(errors, spec)
    if spec.name and name_taken(ModelSpec, spec.owner, spec.name, spec.pk):
        errors.add("name", f"You already have a model named {spec.name}; choose another name.")
    if spec.team_id is not None and not spec.team.members.filter(pk=spec.owner_id).exists():
        errors.add("team", "Choose one of your teams; you are not a member of this one.")
    _check_image(errors, spec)
    spec.framework = (spec.framework or "torch").strip()
    if spec.framework != "torch" and spec.kind != ModelSpec.Kind.SCRIPT and "framework" not in errors:
        errors.add("framework", f"Only a model of kind script runs under {spec.framework}: Trainboard's own "
                                f"trainer is PyTorch. Choose kind script, or framework torch.")
    if spec.kind == ModelSpec.Kind.BUILTIN:
        if archive is not None or spec.code_id is not None:
            errors.add("code", "A built-in model takes no code; choose kind code (your model function) or "
                               "script (your training script) to use an archive.")
        for field in _CODE_FIELDS:
            if getattr(spec, field):
                errors.add(field, f"Only a model of kind code or script has {field.replace('_', ' ')}; remove it, "
                                  f"or choose one of those kinds.")
        _validate_builtin_params(errors, spec)
        return
    if spec.kind not in ModelSpec.Kind.values:
        return  # full_clean said so
    _validate_user_code(errors, spec, archive)


def _validate_builtin_params(errors: Errors, spec: ModelSpec) -> None:
    if spec.architecture == CUSTOM:  # the registry takes it, as a user's model; a built-in one cannot be
        errors.add("architecture", f"{CUSTOM} is the architecture of your own model: choose kind code, or one of "
                                   f"{', '.join(sorted(ARCHITECTURES))}.")
        return
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


def _validate_user_code(errors: Errors, spec: ModelSpec, archive: code_archives.NormalizedArchive | None) -> None:
    """Kinds code and script: an archive, an entry point (or script) in it, their lists."""
    is_code = spec.kind == ModelSpec.Kind.CODE
    spec.architecture = CUSTOM if is_code else ""  # the trainer's model.arch of a user's model
    if archive is None and spec.code_id is None and "code" not in errors:
        errors.add("code", f"A model of kind {'my model' if is_code else 'my script'} needs its code: upload a "
                           f".zip or .tar.gz, or name a directory on the server.")
    if is_code:
        params = json_object(errors, "params", spec.params, what="Parameters", example='{"hidden_size": 128}')
        if params is not None:
            try:  # keyword-argument names, and not the ones the trainer passes itself
                spec.params = validate_model_params(CUSTOM, params)
            except ConfigError as exc:
                errors.add("params", _param_message(str(exc)))
        spec.shard_classes = _string_list(errors, "shard_classes", spec.shard_classes, what="Shard classes",
                                          most=MAX_SHARD_CLASSES, identifiers=True)
        if spec.script_args:
            errors.add("script_args", "Only a model of kind script takes script arguments; your model "
                                      "function takes parameters (JSON).")
    else:
        if spec.params:
            errors.add("params", "A script takes no parameters (JSON): give it script arguments instead.")
        spec.script_args = _string_list(errors, "script_args", split_script_args(errors, spec.script_args),
                                        what="Script arguments", most=MAX_SCRIPT_ARGS)
        for problem in script_arg_problems(spec.script_args):
            errors.add("script_args", f"Script arguments: {problem}.")
        if spec.shard_classes:
            errors.add("shard_classes", "Only a model of kind code has shard classes: a script shards its "
                                        "model itself.")
    spec.entry_point = (spec.entry_point or "").strip()
    if not spec.entry_point:
        errors.add("entry_point", "A model of kind my model needs its entry point: package.module:function "
                                  "returning the torch.nn.Module (e.g. mymodel.net:build)." if is_code else
                                  "A model of kind my script needs its entry point: the script, a .py file in the "
                                  "archive (train.py) or -m package.module.")
        return
    if "entry_point" in errors:
        return
    if archive is None and spec.code_id is not None and "code" not in errors:
        try:
            archive = code_archives.load_stored(spec.code)
        except code_archives.ArchiveError as exc:
            errors.add("code", f"The stored archive {spec.code.short_sha} cannot be read ({exc}); upload the "
                               f"code again.")
    try:
        if archive is None:  # no code, or a refused one: the entry point's form is still checked
            code_archives.check_entry_point_form(spec.entry_point, script=not is_code)
            return
        (code_archives.check_entry_point if is_code else code_archives.check_script)(archive, spec.entry_point)
    except code_archives.ArchiveError as exc:
        errors.add("entry_point", str(exc))


def split_script_args(errors: Errors, value: Any) -> Any:
    """Script arguments typed as one text (the model form's box, a string in the API) split as a
    shell would, without one (:func:`shlex.split`: spaces and newlines separate, quotes keep an
    argument with spaces whole, ``$``, backquotes and ``;`` are plain characters): ``"--epochs 3
    --lr 0.1"`` → ``["--epochs", "3", "--lr", "0.1"]``. A list is returned as it is (one argument per
    item). An unbalanced quote is an error on ``script_args`` saying so; ``[]`` then."""
    if not isinstance(value, str):
        return value
    try:
        return shlex.split(value)
    except ValueError as exc:  # "No closing quotation", "No escaped character"
        errors.add("script_args", f"Script arguments: {str(exc).lower()} in {value.strip()[:200]!r}; close the "
                                  f"quote, or put a backslash before a quote that is part of an argument.")
        return []


def _string_list(errors: Errors, field: str, value: Any, *, what: str, most: int,
                 identifiers: bool = False) -> list[str]:
    """``value`` (a list of strings) checked: at most ``most`` items of at most 1,000 characters each,
    storable text (and Python names when ``identifiers``)."""
    example = '["Block"]' if identifiers else '["--epochs", "3"]'
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        errors.add(field, f"{what} must be a list of strings, e.g. {example}.")
        return []
    if len(value) > most:
        errors.add(field, f"{what}: at most {most} items, got {len(value)}.")
        return []
    for index, item in enumerate(value):
        problem = text_problem(item) or ("longer than 1,000 characters." if len(item) > 1000 else None)
        if identifiers and problem is None and not _IDENTIFIER.fullmatch(item):
            problem = f"{item!r} is not a Python class name."
        if problem is not None:
            errors.add(field, f"{what} [{index}]: {problem}")
    return list(value)


def _check_image(errors: Errors, spec: ModelSpec) -> None:
    spec.image = (spec.image or "").strip()
    if spec.image and "image" not in errors and (problem := image_problem(spec.image)) is not None:
        errors.add("image", problem)


def _param_message(text: str) -> str:
    """A model-parameter error (``model.params.num_layers: unknown parameter for cnn``) worded for the
    Parameters field the user filled in: ``Parameter num_layers: unknown parameter for cnn``."""
    path, sep, rest = text.partition(":")
    if not sep or not path.startswith("model.params"):
        return text
    name = path[len("model.params"):].lstrip(".")
    return f"Parameter {name}:{rest}" if name else f"Parameters:{rest}"


def _read_code(errors: Errors, code: Any) -> code_archives.NormalizedArchive | None:
    """``code`` (an uploaded file: anything with ``read``; or a directory path on the server) read
    and normalized; None with the reason on ``code`` when it is refused, or when ``code`` is None."""
    if code in (None, ""):
        return None
    try:
        if hasattr(code, "read"):
            return code_archives.normalize_upload(code, str(getattr(code, "name", "") or ""))
        if isinstance(code, (str, os.PathLike)):
            return code_archives.normalize_directory(code)
    except code_archives.ArchiveError as exc:
        for message in exc.messages:  # every unsafe member, one message each
            errors.add("code", message)
        return None
    errors.add("code", "Code must be an uploaded .zip or .tar.gz, or a directory path on the server.")
    return None


def _save_with_code(spec: ModelSpec, archive: code_archives.NormalizedArchive | None) -> ModelSpec:
    """Store ``archive`` (when given) and save ``spec`` pointing at it, in one transaction. Should
    the save fail after the file was written, the file stays with no row: harmless, because it is
    named by its content and the next store of the same files uses it as it is."""
    try:
        with transaction.atomic():
            if archive is not None:
                spec.code = code_archives.store(archive)
            spec.save()
    except IntegrityError as exc:
        if "modelspec_unique_name" not in str(exc):
            raise
        # The name was free when checked, and another request took it since.
        raise ValidationError({"name": [f"You already have a model named {spec.name}; choose another name."]}) from None
    return spec


def model_spec_create(*, owner, name: str, architecture: str = "", params: dict | None = None,
                      description: str = "", team=None, kind: str = ModelSpec.Kind.BUILTIN, code: Any = None,
                      entry_point: str = "", script_args: list[str] | None = None,
                      shard_classes: list[str] | None = None, image: str = "", framework: str = "torch") -> ModelSpec:
    """Register a model (docs/user-code.md):

    - kind ``builtin``: an ``architecture`` from the trainer's registry; ``params`` completed with defaults.
    - kind ``code``: ``code`` plus ``entry_point`` ``package.module:function`` (checked statically: the
      module's file defines the function), called with ``params`` (JSON object, without ``num_classes``
      / ``input_shape``) as keyword arguments; ``shard_classes``: class names for FSDP (Python names).
    - kind ``script``: ``code`` plus ``entry_point`` ``train.py`` (a file in it) or ``-m package.module``,
      run with ``script_args``: a list of strings, one argument each, or one text split as a shell
      would (:func:`split_script_args`); ``{train.<field>}`` in one is the job's value of that field
      (trainer_pkg.config.expand_script_args; an unknown field is an error); ``framework`` says how
      the launcher starts its processes: ``torch`` (default), ``tensorflow``, ``ray`` or ``mpi``
      (trainer_pkg.config ``code.framework``; docs/user-code.md). Other kinds take only ``torch``.

    ``code``: an uploaded file (``.zip``/``.tar.gz``, anything with ``read``) or a directory path under
    ``TRAINBOARD_CODE_ROOTS`` (:mod:`jobs.code_archives`; normalized and stored once by SHA-256).
    ``image``: a container image reference for the model's jobs, or "". ``team`` (a Team or its pk;
    None/"" = private) must be one of ``owner``'s teams: its members then see the model and may launch
    jobs with it. Raises ValidationError with every error keyed by field (``code``, ``entry_point``,
    ...); nothing is stored then, neither row nor archive file.
    """
    errors = Errors()
    team = member_team(errors, team, owner)
    archive = _read_code(errors, code)
    spec = ModelSpec(owner=owner, name=(name or "").strip(), kind=kind or "", architecture=architecture or "",
                     params=params if params is not None else {}, description=description or "", team=team,
                     entry_point=entry_point or "", script_args=script_args if script_args is not None else [],
                     shard_classes=shard_classes if shard_classes is not None else [], image=image or "",
                     framework=framework or "torch")
    _validate_model_spec(errors, spec, archive)
    errors.raise_if_any()
    return _save_with_code(spec, archive)


def model_spec_update(*, model_spec: ModelSpec, code: Any = None, **fields: Any) -> ModelSpec:
    """Change some of ``name, description, kind, architecture, params, team, entry_point, script_args,
    shard_classes, image, framework`` and, with ``code`` (as for :func:`model_spec_create`), the archive; the
    entry point is re-checked against the new archive or the stored one. A new ``architecture``
    without ``params`` takes that architecture's default parameters (the old ones belong to the old
    architecture), as the form's parameters follow its architecture; a change to kind builtin drops
    the archive. ``team`` as for :func:`dataset_update`. Raises ValidationError; the row is untouched
    and nothing is stored then."""
    errors = Errors()
    if "params" not in fields and fields.get("architecture", model_spec.architecture) != model_spec.architecture:
        fields = {**fields, "params": {}}  # completed with the new architecture's defaults
    fields = team_field(errors, fields, model_spec.owner)
    unknown = set(fields) - _MODEL_FIELDS
    if unknown:
        raise TypeError(f"ModelSpec: unknown fields {sorted(unknown)}")
    original = {f: getattr(model_spec, f) for f in _MODEL_FIELDS | {"code"}}
    empty = {"params": {}, "team": None, "script_args": [], "shard_classes": [], "framework": "torch"}
    for field, value in fields.items():
        setattr(model_spec, field, empty.get(field, "") if value is None else value)
    if model_spec.kind != original["kind"]:
        # What a kind takes belongs to that kind: the fields not given start empty under the new one.
        for field in ("params", "entry_point", "script_args", "shard_classes", "framework"):
            if field not in fields:
                setattr(model_spec, field, empty.get(field, ""))
        if model_spec.kind == ModelSpec.Kind.BUILTIN and code in (None, ""):
            model_spec.code = None  # the old archive stays for the jobs that ran it
    archive = _read_code(errors, code)
    _validate_model_spec(errors, model_spec, archive)
    if errors:
        for field, value in original.items():
            setattr(model_spec, field, value)
        errors.raise_if_any()
    return _save_with_code(model_spec, archive)


# =============================================================================================
# Compute backends
# =============================================================================================

_BACKEND_FIELDS = {"name", "kind", "config", "enabled", "team", "state_deadlines", "stall_policy", "orphan_policy",
                   "max_restarts", "hang_policy", "hang_deadline_s", "idle_policy", "idle_gpu_util_pct", "idle_minutes",
                   "preflight", "preflight_min_busbw_gbps", "preflight_max_latency_us"}

MIN_HANG_DEADLINE_S = 10
"""Shortest hang deadline a backend may set, seconds (a shorter one would flag every record interval)."""
MAX_HANG_DEADLINE_S = 30 * 86_400
"""Longest hang deadline a backend may set, seconds (30 days)."""


def _clean_hang_deadline(errors: Errors, value: Any) -> int | None:
    """``hang_deadline_s``: None (blank: from the job's step time) or whole seconds
    :data:`MIN_HANG_DEADLINE_S` … :data:`MAX_HANG_DEADLINE_S`; None after an error, which says the bounds."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_HANG_DEADLINE_S <= value <= MAX_HANG_DEADLINE_S:
        errors.add("hang_deadline_s", f"Hang deadline must be whole seconds from {MIN_HANG_DEADLINE_S} to "
                                      f"{MAX_HANG_DEADLINE_S} (30 days), or blank for the job's own step time; "
                                      f"got {str(value)[:40]!r}.")
        return None
    return value


IDLE_BOUNDS = {"idle_gpu_util_pct": (1, 100, "Idle threshold must be a whole percent from 1 to 100"),
               "idle_minutes": (1, 7 * 24 * 60, "Idle minutes must be whole minutes from 1 to 10080 (7 days)")}
"""The idle policy's numbers (:mod:`jobs.idle`): field → (least, most, the error's first words)."""


def _clean_idle_number(errors: Errors, field: str, value: Any, default: int) -> int:
    """``idle_gpu_util_pct`` (%) or ``idle_minutes`` (minutes) as a whole number within
    :data:`IDLE_BOUNDS` (a bool, a fraction or text is refused); ``default`` after an error on ``field``,
    which says the bounds, so the other fields are still checked."""
    low, high, words = IDLE_BOUNDS[field]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        errors.add(field, f"{words}; got {str(value)[:40]!r}.")
        return default
    return value


PREFLIGHT_BOUNDS = {
    "preflight_min_busbw_gbps": (0.001, 100_000, float,
                                 "Minimum bus bandwidth must be a number of GB/s from 0.001 to 100000, or blank for "
                                 "no minimum"),
    "preflight_max_latency_us": (1, 10_000_000, int,
                                 "Maximum latency must be whole microseconds from 1 to 10000000 (10 s), or blank "
                                 "for no maximum"),
}
"""The network preflight's thresholds (:mod:`trainer_pkg.preflight`): field → (least, most, type, the
error's first words). None (blank) = no such threshold."""


def _clean_preflight(errors: Errors, backend: ComputeBackend) -> None:
    """``preflight`` a bool, and its thresholds None or numbers within :data:`PREFLIGHT_BOUNDS` (a
    bool, text or NaN is refused; a whole number is a number of GB/s too). An invalid value becomes
    its default after its error, so every field is still checked and all errors come together."""
    if not isinstance(backend.preflight, bool):
        errors.add("preflight", f"Preflight must be true or false; got {str(backend.preflight)[:40]!r}.")
        backend.preflight = False
    for field, (low, high, kind, words) in PREFLIGHT_BOUNDS.items():
        value = getattr(backend, field)
        if value is None or value == "":
            setattr(backend, field, None)
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            kind is float or isinstance(value, int))
        if not number or not low <= value <= high:  # NaN fails the comparison
            errors.add(field, f"{words}; got {str(value)[:40]!r}.")
            setattr(backend, field, None)
        else:
            setattr(backend, field, kind(value))


def _clean_max_restarts(errors: Errors, value: Any) -> int:
    """``max_restarts`` as a whole number 0…:data:`MAX_RESTARTS` (the error on ``max_restarts`` says
    the bounds); the default when invalid, so the other fields are still checked."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        else:
            errors.add("max_restarts", f"Max restarts must be a whole number from 0 to {MAX_RESTARTS}, got {str(value)[:40]!r}.")
            return DEFAULT_MAX_RESTARTS
    if not 0 <= value <= MAX_RESTARTS:
        errors.add("max_restarts", f"Max restarts must be from 0 (never resubmit a lost run) to {MAX_RESTARTS}, got {value}.")
        return DEFAULT_MAX_RESTARTS
    return value

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


def _clean_job_secrets(errors: Errors, stored: Mapping[str, str], given: Any) -> dict[str, str]:
    """``stored`` job secrets with ``given`` (a dict or ``NAME=VALUE`` lines; None = nothing) merged
    in: a value replaces that name's, a blank value removes the name. Names are checked as a job's
    environment variable names (:func:`jobs.validation.env_vars`: not the launcher's or a
    platform's), values as theirs; errors go on ``job_secrets`` and never quote a value."""
    merged = dict(stored)
    for name, value in env_vars(errors, "job_secrets", given, what="Job secret", allow_empty=True).items():
        if value:
            merged[name] = value
        else:
            merged.pop(name, None)
    if len(merged) > MAX_ENV_VARS and "job_secrets" not in errors:
        errors.add("job_secrets", f"At most {MAX_ENV_VARS} job secrets, got {len(merged)}; remove some (NAME=).")
    return merged


def hang_restart_error(hang_policy: str, max_restarts: Any) -> str | None:
    """The error on ``max_restarts`` when the hang policy ``restart`` is chosen with no restart allowed
    (0: every hung run would be cancelled, which is the policy ``cancel``, docs/hangs.md); else None."""
    if hang_policy != ComputeBackend.HangPolicy.RESTART or max_restarts != 0:
        return None
    return ("Max restarts is 0, so the hang policy restart would never restart a hung run (it would cancel it); "
            f"set max restarts from 1 to {MAX_RESTARTS}, or choose the hang policy cancel.")


def _validate_backend(errors: Errors, backend: ComputeBackend) -> None:
    backend.max_restarts = _clean_max_restarts(errors, backend.max_restarts)
    if "max_restarts" not in errors and (refusal := hang_restart_error(backend.hang_policy, backend.max_restarts)):
        errors.add("max_restarts", refusal)
    backend.hang_deadline_s = _clean_hang_deadline(errors, backend.hang_deadline_s)
    backend.idle_gpu_util_pct = _clean_idle_number(errors, "idle_gpu_util_pct", backend.idle_gpu_util_pct, 10)
    backend.idle_minutes = _clean_idle_number(errors, "idle_minutes", backend.idle_minutes, 30)
    _clean_preflight(errors, backend)
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
    if backend.name and "name" not in errors and backend_queue_holder(backend) is not None:
        errors.add("name", f"Another user's backend is already named {backend.name}, and this backend's name "
                           f"makes its own Celery queue ({backend_queue(backend)}), which only the worker on "
                           f"its machine consumes; choose another name.")
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
                   orphan_policy: str = "report", job_secrets: Any = None,
                   max_restarts: int = DEFAULT_MAX_RESTARTS, hang_policy: str = "flag",
                   hang_deadline_s: int | None = None, idle_policy: str = "off", idle_gpu_util_pct: int = 10,
                   idle_minutes: int = 30, preflight: bool = False, preflight_min_busbw_gbps: float | None = None,
                   preflight_max_latency_us: int | None = None) -> ComputeBackend:
    """Register a compute backend; ``config`` is checked by the adapter's ``clean_config``.

    ``secrets``: credentials for the kind (:func:`backend_secret_keys`), stored encrypted; {} or
    None: the worker's own identity. ``team``: a Team ``owner`` is a member of (shares it), or None.
    ``state_deadlines``: ``{state: seconds}`` for non-terminal states (missing ones use
    ``settings.TRAINBOARD_STATE_DEADLINES_S``; RUNNING: max runtime + margin); ``stall_policy``
    "warn" | "cancel" (what a job past its deadline gets); ``orphan_policy`` "report" | "stop".
    ``max_restarts``: how many times a job whose run is lost is resubmitted from its checkpoint
    (0 … :data:`MAX_RESTARTS`; 0 = never; :mod:`jobs.restarts`).
    ``hang_policy`` "flag" | "cancel" (what a RUNNING job with no new step for its hang deadline gets,
    :mod:`jobs.hangs`); ``hang_deadline_s`` that deadline in seconds (:data:`MIN_HANG_DEADLINE_S` …
    :data:`MAX_HANG_DEADLINE_S`), None = from the job's own step time.
    ``idle_policy`` "off" | "warn" | "stop" (what a running job whose GPUs all stay below
    ``idle_gpu_util_pct`` % for ``idle_minutes`` minutes gets, :mod:`jobs.idle`; bounds: :data:`IDLE_BOUNDS`).
    ``preflight``: every rank measures the network before the first step (:mod:`trainer_pkg.preflight`);
    below ``preflight_min_busbw_gbps`` (GB/s) or above ``preflight_max_latency_us`` (µs) the run is
    stopped, FAILED with the reason; None = no such threshold (bounds: :data:`PREFLIGHT_BOUNDS`).
    ``job_secrets``: environment variables set in every job of the backend (name → value, or
    ``NAME=VALUE`` lines; :func:`_clean_job_secrets`), stored encrypted, never shown back.
    Raises ValidationError keyed by field (``secrets`` and ``job_secrets`` messages name keys, never values).
    """
    errors = Errors()
    backend = ComputeBackend(owner=owner, name=(name or "").strip(), kind=kind or "",
                             config=config if config is not None else {}, enabled=bool(enabled),
                             secrets=secrets if secrets is not None else {}, team=team,
                             state_deadlines=state_deadlines if state_deadlines is not None else {},
                             stall_policy=stall_policy or "", orphan_policy=orphan_policy or "",
                             max_restarts=max_restarts, job_secrets=_clean_job_secrets(errors, {}, job_secrets),
                             hang_policy=hang_policy or "", hang_deadline_s=hang_deadline_s,
                             idle_policy=idle_policy or "", idle_gpu_util_pct=idle_gpu_util_pct,
                             idle_minutes=idle_minutes, preflight=preflight,
                             preflight_min_busbw_gbps=preflight_min_busbw_gbps,
                             preflight_max_latency_us=preflight_max_latency_us)
    _validate_backend(errors, backend)
    errors.raise_if_any()
    backend.save()
    return backend


def _queue_moves(backend: ComputeBackend, fields: Mapping[str, Any]) -> bool:
    """Whether saving ``fields`` on ``backend`` would change its Celery queue (a GPU box's is
    ``gpubox.<name>``): its queued jobs' messages and its worker would then be on the old one. A
    name ``queue_for`` refuses is not a move; the name's own validation reports it."""
    renamed = ComputeBackend(pk=backend.pk, owner_id=backend.owner_id, kind=backend.kind,
                             name=str(fields.get("name") or "").strip(),
                             config=fields.get("config", backend.config) or {})
    try:
        return backend_queue(renamed) != backend_queue(backend)
    except ValueError:
        return False


def backend_update(*, backend: ComputeBackend, secrets: Mapping[str, str | None] | None = None,
                   clear_secrets: bool = False, job_secrets: Any = None, clear_job_secrets: bool = False,
                   **fields: Any) -> ComputeBackend:
    """Change some of ``name, kind, config, enabled, team, state_deadlines, stall_policy,
    orphan_policy, max_restarts, hang_policy, hang_deadline_s, idle_policy, idle_gpu_util_pct, idle_minutes,
    preflight, preflight_min_busbw_gbps, preflight_max_latency_us`` (as for :func:`backend_create`; None deadlines = the defaults); the kind only
    while no job is active.

    ``secrets`` is merged into the stored ones: a key with a non-empty value replaces that secret, a
    blank or missing key keeps it (write-only forms send blanks). ``clear_secrets`` removes all stored
    secrets first. ``job_secrets`` merges likewise, except that a name given with a blank value is
    removed (``NAME=`` in the form); ``clear_job_secrets`` removes every one first. Raises
    ValidationError; nothing is saved then.
    """
    errors = Errors()
    if "kind" in fields and fields["kind"] != backend.kind and backend.pk and \
            backend.jobs.filter(state__in=ACTIVE_STATE_VALUES).exists():
        errors.add("kind", "This backend has active jobs; wait for them to end before changing its kind.")
    elif "name" in fields and backend.pk and _queue_moves(backend, fields):
        active = list(backend.jobs.filter(state__in=ACTIVE_STATE_VALUES).order_by("pk").values_list("pk", flat=True)[:6])
        if active:
            listed = ", ".join(f"#{pk}" for pk in active[:5]) + (" …" if len(active) > 5 else "")
            errors.add("name", f"This backend has active jobs ({listed}) on its Celery queue "
                               f"{backend_queue(backend)}, which the new name would change; wait for them to "
                               f"end (or cancel them) before renaming it.")
    if secrets is not None and not isinstance(secrets, Mapping):
        errors.add("secrets", "Secrets must be an object of key: value strings.")
        errors.raise_if_any()
    if clear_secrets or secrets:
        merged = {} if clear_secrets else dict(backend.secrets or {})
        merged.update({k: v for k, v in (secrets or {}).items() if v not in (None, "")})
        fields = {**fields, "secrets": merged}
    if clear_job_secrets or job_secrets not in (None, "", {}):
        stored = {} if clear_job_secrets else dict(backend.job_secrets or {})
        fields = {**fields, "job_secrets": _clean_job_secrets(errors, stored, job_secrets)}
    return update_row(backend, fields, allowed=_BACKEND_FIELDS | {"secrets", "job_secrets"},
                      validate=_validate_backend,
                      empty={"config": {}, "secrets": {}, "team": None, "state_deadlines": {}, "job_secrets": {}},
                      errors=errors)


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
    max_nodes: int = 0  # most nodes per job (Capabilities.max_nodes); 0 = not known
    nodes_note: str = ""  # why not more, and where to go instead (Backend.max_nodes_note)


def backend_instance_offers(*, backend: ComputeBackend) -> BackendOffers:
    """``(offers, spot, strategies, max_nodes, nodes_note)`` for the job form: the instance types
    ``backend``'s adapter offers with their catalog prices (``Backend.instance_offers``; empty for the
    gpubox), whether it has spot capacity, the strategies its image's torch runs, the most nodes a job
    may have and the adapter's note on it (a GPU box: one machine). A backend whose adapter cannot be
    built offers nothing and every strategy (its error shows at submit)."""
    try:
        adapter = backend_adapter(backend)
        caps = adapter.capabilities
        return BackendOffers(list(adapter.instance_offers()), bool(caps.spot), tuple(caps.strategies),
                             int(caps.max_nodes), adapter.max_nodes_note)
    except (BackendError, LookupError, ValueError, TypeError) as exc:
        log.info("backend %s: no instance offers (%s)", backend.pk, exc)
        return BackendOffers([], False, tuple(get_args(Strategy)))
