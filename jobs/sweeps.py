"""Sweeps: a hyperparameter search whose trials are normal training jobs (docs/sweeps.md).

Optuna keeps the study in its RDB storage inside Trainboard's own database (:func:`optuna_storage`,
tables ``studies``, ``trials``, ... beside Django's); one study per sweep, named
``trainboard-sweep-<id>``. Trainboard drives it with Optuna's ask-and-tell interface from Celery
tasks (``jobs.tasks``), never from a long-lived ``study.optimize`` loop:

* :func:`sweep_fill` — under a lock on the sweep row, while fewer than ``max_concurrent_trials``
  trials run, fewer than ``max_trials`` were asked and the budget allows, ``study.ask()`` a trial,
  map its parameters onto the sweep's base job and create the job with
  :func:`jobs.services.training_job_create` (trial number on the job; unique per sweep). A trial
  whose job is refused (a ValidationError) is told FAIL, its message kept on the sweep.
* :func:`sweep_trial_ended` — a trial's job reached a terminal state (the
  :data:`jobs.signals.job_state_changed` receiver below sends the task): tell Optuna its objective
  (COMPLETE), or FAIL (a job that failed, was cancelled or never reported the metric); fill again.
* :func:`sweep_tick` — beat, every ``TRAINBOARD_SWEEP_INTERVAL_S``: report each running trial's new
  intermediate values (the objective metric per epoch, from its MetricPoints) with ``trial.report``,
  cancel a trial whose ``should_prune()`` says so (told PRUNED), repair stale state, fill: all in one
  transaction per sweep that skips a sweep whose row another worker holds (a fill in flight fills
  it), so two ticks, or a tick and a fill, never fill one sweep twice.

Why a beat task and not the sync for pruning: the sync is per backend and must stay fast and
provider-bound; the pruner reads the whole study (other trials' values at the same epoch) from
Optuna's tables. A separate pass a few seconds behind the sync changes nothing for a decision made
at epoch granularity, and keeps Optuna out of the sync's transaction.

Idempotency: asking (Optuna commits the trial on its own connection) and creating the job (Django's
transaction) cannot be one transaction, so a worker killed between them leaves a RUNNING Optuna trial
without a job. Every pass runs under the sweep row's lock, where such a trial can only be stale: it is
told FAIL (``user_attrs["stale"]``, not counted against ``max_trials``; a grid point is asked again),
never given a job later. ``(sweep, trial_number)`` is unique on the jobs, so no trial ever has two.

Layer: worker side (imports :mod:`jobs.services`); Optuna is imported inside the functions, so
processes that never touch a sweep do not load it.
"""

from __future__ import annotations

import logging
import math
from decimal import Decimal
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from django.core.exceptions import ValidationError
from django.db import connections, transaction
from django.db.models import Sum
from django.utils import timezone

from jobs import dispatch, metric_buckets, metric_store, services, validation
from jobs.job_request import JOB_REQUEST, RequestField
from jobs.models import (
    ACTIVE_STATE_VALUES,
    TERMINAL_STATE_VALUES,
    ComputeBackend,
    Dataset,
    JobStateChoices as S,
    ModelSpec,
    Sweep,
    TrainingJob,
)
from jobs.signals import job_state_changed
from jobs.validation import ALL, Errors
from trainer_pkg.config import ConfigError, JobConfig, script_hparam_keys
from trainer_pkg.registry import CUSTOM, validate_model_params

if TYPE_CHECKING:  # pragma: no cover
    import optuna

log = logging.getLogger(__name__)

# =============================================================================================
# The search space
# =============================================================================================

MAX_PARAMS = 32
"""Most keys a search space may have."""
MAX_CHOICES = 100
"""Most choices of one categorical parameter."""
MAX_GRID_POINTS = 10_000
"""Most combinations a grid sweep may have."""
MAX_TRIALS = 10_000
MAX_CONCURRENT = 100
FORBIDDEN_SECTIONS = ("code", "output")
"""Config sections a trial may not vary: the model's archive sets ``code``, the backend ``output``."""

BASE_FIELDS = tuple(f.name for f in JOB_REQUEST if f.name not in ("name", "team"))
"""The keys of a sweep's base job: the job request's fields (:data:`jobs.job_request.JOB_REQUEST`; ids for
the dataset, model and backend; ``budget_usd`` is each trial job's own budget) but the name and team,
which are the sweep's."""

SPACE_EXAMPLE = ('{"train.lr": {"type": "float", "low": 0.001, "high": 0.1, "log": true}, '
                 '"train.batch_size": {"type": "categorical", "choices": [16, 32, 64]}, '
                 '"model.params.hidden": {"type": "int", "low": 32, "high": 128, "step": 32}, '
                 '"train.optimizer": {"type": "categorical", "choices": ["sgd", "adamw"]}}')
"""A search space, as the create form and the errors show it."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_search_space(errors: Errors, value: Any, field: str = "search_space") -> dict[str, dict[str, Any]]:
    """``value`` (a dict or JSON text) as a normalized search space: dotted key → one of
    ``{"type": "float", "low": a, "high": b, "log": bool}``, ``{"type": "int", "low": a, "high": b,
    "step": s, "log": bool}`` or ``{"type": "categorical", "choices": [...]}`` (choices: numbers,
    strings, booleans). Every problem is an error on ``field`` naming the key; returns what passed.
    The keys are not checked against the trainer's schema here: :func:`check_space_against_config`."""
    space = validation.json_object(errors, field, value, what="Search space", example=SPACE_EXAMPLE, plural=False)
    if space is None:
        return {}
    if not space:
        errors.add(field, f"Search space: give at least one parameter, e.g. {SPACE_EXAMPLE}.")
        return {}
    if len(space) > MAX_PARAMS:
        errors.add(field, f"Search space: at most {MAX_PARAMS} parameters, got {len(space)}.")
        return {}
    out: dict[str, dict[str, Any]] = {}
    for key, spec in space.items():
        where = f"Search space {key!r}"
        parts = key.split(".")
        if len(parts) < 2 or not all(p.isidentifier() for p in parts):
            errors.add(field, f"{where}: a key is a dotted config path such as train.lr or model.params.hidden.")
            continue
        if parts[0] in FORBIDDEN_SECTIONS:
            errors.add(field, f"{where}: the {parts[0]} section is set by "
                              f"{'the model' if parts[0] == 'code' else 'the backend'}; a trial cannot vary it.")
            continue
        if not isinstance(spec, Mapping):
            errors.add(field, f"{where}: expected an object with a type (float, int or categorical).")
            continue
        kind = spec.get("type")
        allowed = {"float": {"type", "low", "high", "log"}, "int": {"type", "low", "high", "step", "log"},
                   "categorical": {"type", "choices"}}.get(kind) if isinstance(kind, str) else None
        if allowed is None:
            errors.add(field, f"{where}: type must be float, int or categorical, got {kind!r}.")
            continue
        extra = sorted(set(spec) - allowed)
        if extra:
            errors.add(field, f"{where}: unknown field {extra[0]!r} for type {kind} (known: {', '.join(sorted(allowed))}).")
            continue
        if kind == "categorical":
            choices = spec.get("choices")
            if not isinstance(choices, list) or not choices:
                errors.add(field, f"{where}: choices must be a non-empty list.")
                continue
            if len(choices) > MAX_CHOICES:
                errors.add(field, f"{where}: at most {MAX_CHOICES} choices, got {len(choices)}.")
                continue
            if not all(isinstance(c, (str, bool)) or _is_number(c) for c in choices):
                errors.add(field, f"{where}: each choice must be a number, a string or true/false.")
                continue
            if len({(type(c).__name__, c) for c in choices}) != len(choices):
                errors.add(field, f"{where}: the choices repeat a value.")
                continue
            out[key] = {"type": "categorical", "choices": list(choices)}
            continue
        low, high, log_scale = spec.get("low"), spec.get("high"), spec.get("log", False)
        check = _is_int if kind == "int" else _is_number
        if not check(low) or not check(high):
            errors.add(field, f"{where}: low and high must be {'whole numbers' if kind == 'int' else 'numbers'}, "
                              f"got low={low!r}, high={high!r}.")
            continue
        if low > high:
            errors.add(field, f"{where}: low ({low}) is above high ({high}).")
            continue
        if not isinstance(log_scale, bool):
            errors.add(field, f"{where}: log must be true or false, got {log_scale!r}.")
            continue
        if log_scale and low <= 0:
            errors.add(field, f"{where}: a log scale needs low > 0, got {low}.")
            continue
        entry: dict[str, Any] = {"type": kind, "low": low, "high": high, "log": log_scale}
        if kind == "float":
            entry["low"], entry["high"] = float(low), float(high)
        else:
            step = spec.get("step", 1)
            if not _is_int(step) or step < 1:
                errors.add(field, f"{where}: step must be a whole number ≥ 1, got {step!r}.")
                continue
            if log_scale and step != 1:
                errors.add(field, f"{where}: a log scale takes step 1 only (Optuna's rule), got {step}.")
                continue
            entry["step"] = step
        out[key] = entry
    return out


def grid_values(space: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, list[Any]], list[str]]:
    """``(key → every value the grid visits, problems)``: a categorical's choices, an int's
    ``low, low+step, …, ≤ high``; a float range has no grid (a problem naming the key)."""
    grid: dict[str, list[Any]] = {}
    problems = []
    for key, spec in space.items():
        if spec["type"] == "categorical":
            grid[key] = list(spec["choices"])
        elif spec["type"] == "int" and not spec.get("log"):
            grid[key] = list(range(spec["low"], spec["high"] + 1, spec["step"]))
        else:
            problems.append(f"Search space {key!r}: the grid sampler needs listed values: use a categorical "
                            f"(choices) or an int range with a step (no log scale).")
    return grid, problems


def grid_size(space: Mapping[str, Mapping[str, Any]]) -> int:
    """How many combinations the grid of ``space`` has (0 when it has none)."""
    grid, problems = grid_values(space)
    return 0 if problems else math.prod(len(v) for v in grid.values())


def _nested(params: Mapping[str, Any]) -> dict[str, Any]:
    """``{"train.lr": 0.1, "model.params.hidden": 32}`` → ``{"train": {"lr": 0.1}, "model":
    {"params": {"hidden": 32}}}``."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        node = out
        *head, last = key.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def trial_payload(base: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :func:`jobs.services.training_job_create` (without owner, team and
    name) for one trial: the sweep's base job with the trial's ``params`` (dotted config keys)
    merged into its ``hyperparameters`` overrides, which the trainer's schema applies over the
    base job's own fields (a trial's ``train.lr`` wins over the base ``lr``)."""
    payload = dict(base)
    hyper = payload.get("hyperparameters") or {}
    payload["hyperparameters"] = _merge(hyper if isinstance(hyper, Mapping) else {}, _nested(params))
    for field in JOB_REQUEST:  # the base's field left unset: a conflict with its override is an error
        if field.config in params:
            payload[field.name] = field.default
    return payload


def _key_values(spec: Mapping[str, Any]) -> list[Any]:
    """The values of one key that :func:`check_space_against_config` tries: both ends of a range,
    every choice."""
    return list(spec["choices"]) if spec["type"] == "categorical" else [spec["low"], spec["high"]]


def check_space_against_config(errors: Errors, space: Mapping[str, Mapping[str, Any]], *,
                               model_spec: ModelSpec | None, field: str = "search_space") -> None:
    """Errors on ``field`` for every key or value the trainer's own schema refuses (an unknown
    field, a wrong type, a value out of bounds), each key on its own so that one bad key hides no
    other: a trial config is built with the key at each end of its range and at every choice by
    :meth:`trainer_pkg.config.JobConfig.from_dict` and checked with its ``field_errors``;
    ``model.params.<name>`` are checked with the model's architecture and parameters
    (:func:`trainer_pkg.registry.validate_model_params`). A script's model takes only the keys it
    receives (:func:`trainer_pkg.config.script_hparam_keys`: its job's ``train`` values, which the
    launcher hands it as ``TRAINBOARD_HPARAMS`` and ``{train.<field>}`` placeholders); any other key
    would change nothing the script sees, so every trial would run alike."""
    is_script = model_spec is not None and model_spec.kind == ModelSpec.Kind.SCRIPT
    receivable = script_hparam_keys()
    arch = ""
    if model_spec is not None and model_spec.kind == ModelSpec.Kind.BUILTIN:
        arch = model_spec.architecture
    elif model_spec is not None and model_spec.kind == ModelSpec.Kind.CODE:
        arch = CUSTOM
    for key, spec in space.items():
        if is_script and key not in receivable:
            errors.add(field, f"Search space {key!r}: model {model_spec.name} is a script, which receives only its "
                              f"job's train values (TRAINBOARD_HPARAMS, report.hparams(), {{train.<field>}} in its "
                              f"arguments): {key} would reach no trial's script, and the trials would run alike. "
                              f"Vary a train field your script reads instead: {', '.join(receivable[:4])}, … "
                              f"(docs/user-code.md).")
            continue
        for value in _key_values(spec):
            if key.startswith("model.params."):
                if key.count(".") != 2:
                    errors.add(field, f"Search space {key!r}: a model parameter key is model.params.<name> (one level).")
                    break
                if not arch:
                    errors.add(field, f"Search space {key!r}: model.params.* needs a built-in model or your model "
                                      f"function (a script's model is its own).")
                    break
                try:
                    validate_model_params(arch, {**(model_spec.params or {}), key.split(".", 2)[2]: value})
                except ConfigError as exc:
                    errors.add(field, f"Search space: {exc}.")
                    break
                continue
            try:
                config = JobConfig.from_dict(_nested({key: value}))
            except ConfigError as exc:
                errors.add(field, f"Search space: {exc}.")
                break
            problem = config.field_errors().get(key)
            if problem:
                errors.add(field, f"Search space: {key}: {problem}")
                break


# =============================================================================================
# Optuna: storage, study, sampler, pruner
# =============================================================================================


def storage_url(settings_dict: Mapping[str, Any] | None = None) -> str:
    """The SQLAlchemy URL of Django's ``default`` database (its live settings, so under pytest
    pytest-django's test database): ``postgresql+psycopg://user:password@host:port/name`` or
    ``sqlite:///<file>``."""
    from sqlalchemy.engine import URL

    sd = settings_dict or connections["default"].settings_dict
    engine = sd["ENGINE"]
    if "sqlite" in engine:
        return f"sqlite:///{sd['NAME']}"
    if "postgresql" not in engine:
        raise RuntimeError(f"sweeps need PostgreSQL or SQLite; the database engine is {engine}")
    return URL.create("postgresql+psycopg", username=sd.get("USER") or None, password=sd.get("PASSWORD") or None,
                      host=sd.get("HOST") or None, port=int(sd["PORT"]) if sd.get("PORT") else None,
                      database=sd["NAME"]).render_as_string(hide_password=False)


@lru_cache(maxsize=4)
def _storage_for(url: str) -> "optuna.storages.RDBStorage":
    import optuna
    from sqlalchemy.pool import NullPool

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # NullPool: no connection outlives its operation, so a test database can be dropped and a
    # worker's fork does not inherit a pooled socket.
    return optuna.storages.RDBStorage(url, engine_kwargs={"poolclass": NullPool})


def optuna_storage() -> "optuna.storages.RDBStorage":
    """Optuna's RDB storage in Trainboard's database (tables created on first use)."""
    return _storage_for(storage_url())


def _grid_sampler_class():
    import optuna

    class AskTellGridSampler(optuna.samplers.GridSampler):
        """Optuna's grid sampler without ``study.stop()`` after the last point: ``stop`` works only
        inside ``study.optimize`` and raises in ask-and-tell; the sweep counts its trials itself."""

        def after_trial(self, study, trial, state, values) -> None:
            return None

    return AskTellGridSampler


def _sampler(sweep: Sweep, asked: int = 0):
    """The sweep's sampler for its next ask, ``asked`` trials into the study.

    Every pass builds its sampler anew (no process lives as long as a sweep), so a fixed seed would
    make every pass's first draw the same trial: the seed is derived from the pair (the sweep's seed,
    the trials asked so far) through numpy's ``SeedSequence`` (a grid keeps the sweep's seed). The same
    sweep (same seed, same results) so asks the same trials, in any worker; a pair, not a sum, so the
    sweeps seeded s and s + 1 do not ask the same trials one apart."""
    import numpy as np
    import optuna

    seed = int(np.random.SeedSequence([sweep.seed, asked]).generate_state(1)[0])
    if sweep.sampler == Sweep.Sampler.GRID:
        # The sweep's own seed, always: the grid sampler numbers its points in a seeded shuffle, and a
        # trial's grid id must name the same point in every pass. It picks among the points not yet
        # visited, so a fixed seed draws no point twice.
        grid, _ = grid_values(sweep.search_space)
        return _grid_sampler_class()(grid, seed=sweep.seed)
    if sweep.sampler == Sweep.Sampler.RANDOM:
        return optuna.samplers.RandomSampler(seed=seed)
    # The first trials are random (TPE needs some results to model).
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, sweep.max_trials // 3)))


PRUNER_LABELS = {Sweep.Pruner.MEDIAN: "median pruner", Sweep.Pruner.SUCCESSIVE_HALVING: "successive halving pruner"}


def _pruner(sweep: Sweep):
    import optuna

    if sweep.pruner == Sweep.Pruner.MEDIAN:
        return optuna.pruners.MedianPruner(n_startup_trials=sweep.pruner_startup_trials,
                                           n_warmup_steps=sweep.pruner_warmup_epochs)
    if sweep.pruner == Sweep.Pruner.SUCCESSIVE_HALVING:
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, sweep.pruner_warmup_epochs))
    return optuna.pruners.NopPruner()


def sweep_study(sweep: Sweep) -> "optuna.Study":
    """The sweep's Optuna study (created on first use), with its sampler and pruner."""
    import optuna

    return optuna.create_study(storage=optuna_storage(), study_name=sweep.study_name, load_if_exists=True,
                               direction=sweep.direction, sampler=_sampler(sweep), pruner=_pruner(sweep))


def _distributions(space: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for key, spec in space.items():
        if spec["type"] == "categorical":
            out[key] = CategoricalDistribution(spec["choices"])
        elif spec["type"] == "int":
            out[key] = IntDistribution(spec["low"], spec["high"], step=spec["step"], log=spec["log"])
        else:
            out[key] = FloatDistribution(spec["low"], spec["high"], log=spec["log"])
    return out


# =============================================================================================
# Create
# =============================================================================================


_TEXT, _NUMBER, _WHOLE, _FLAG, _OBJECT = (str,), (int, float, str), (int, str), (bool,), (dict, str)
_TYPES_OF_KIND = {"text": _TEXT, "choice": _TEXT, "float": _NUMBER, "decimal": _NUMBER, "int": _WHOLE,
                  "ref": _WHOLE, "bool": _FLAG, "object": _OBJECT}


def base_types(fields: Iterable[RequestField] = JOB_REQUEST) -> dict[str, tuple[type, ...]]:
    """What each base field may hold, by the kind the job request declares (None = the service's
    default); the service checks the values."""
    return {f.name: _TYPES_OF_KIND[f.kind] for f in fields if f.name not in ("name", "team")}


_BASE_TYPES = base_types()
_KIND_WORDS = {_TEXT: "text", _NUMBER: "a number", _WHOLE: "a whole number", _FLAG: "true or false",
               _OBJECT: "a JSON object"}


def _base_payload(errors: Errors, base: Any) -> dict[str, Any]:
    base = validation.json_object(errors, "base", base, what="Base job", example='{"dataset": 1, "model_spec": 2, '
                                  '"backend": 3, "epochs": 2}', plural=False)
    if base is None:
        return {}
    unknown = sorted(set(base) - set(BASE_FIELDS))
    if unknown:
        errors.add("base", f"Base job: unknown field {unknown[0]!r} (known: {', '.join(BASE_FIELDS)}).")
    for key, value in base.items():
        kinds = _BASE_TYPES.get(key)
        if kinds is not None and value is not None and (not isinstance(value, kinds) or (
                isinstance(value, bool) and bool not in kinds)):
            errors.add(f"base.{key}", f"Base job: {key} must be {_KIND_WORDS[kinds]}, got {value!r}.")
    for key in ("dataset", "model_spec", "backend"):
        if base.get(key) in (None, ""):
            errors.add(f"base.{key}", f"Base job: {key} is required (the id of one of yours).")
    return {k: v for k, v in base.items() if k in BASE_FIELDS and f"base.{k}" not in errors}


def _check_trial(errors: Errors, *, owner, team, payload: Mapping[str, Any], name: str) -> Decimal:
    """Check one trial's job with the service's own checks (:func:`jobs.services.training_job_check`:
    nothing is written, nothing sent): every error the job would get, keyed ``base.<field>``
    (``search_space`` for the hyperparameters the trial sets). Returns its estimate."""
    try:
        return services.training_job_check(owner=owner, team=team, name=name, **payload).estimated_cost_usd
    except ValidationError as exc:
        for field, messages in exc.message_dict.items():
            key = ALL if field == ALL else ("search_space" if field == "hyperparameters" else f"base.{field}")
            for message in messages:
                errors.add(key, message)
    except TypeError as exc:  # an argument of the wrong kind the service does not take
        errors.add("base", f"Base job: {exc}")
    return Decimal("0")


def _choice(errors: Errors, field: str, value: Any, choices: type, label: str) -> str:
    values = [c.value for c in choices]
    if value not in values:
        errors.add(field, f"{label} must be one of {', '.join(values)}, got {value!r}.")
        return values[0]
    return value


SQLITE_REFUSAL = ("Sweeps need PostgreSQL: on the embedded SQLite database, Optuna's storage and Trainboard's own "
                  "writes lock each other out (\"database is locked\"), and SQLite has no row locks, which keep two "
                  "workers from filling one sweep twice. Set DATABASE_URL to a PostgreSQL database "
                  "(README, \"Configuration (environment variables)\") to run sweeps.")
"""Why a sweep is refused on SQLite (found trying the demo: trials never started and pages failed while
Optuna's connection held the file's lock). Optuna's study in a sibling SQLite file would end the
lock-out, but not the second reason: every fill and tick relies on ``SELECT … FOR UPDATE`` of the
sweep's row (``SKIP LOCKED`` in the tick), which Django leaves out on SQLite, so two workers (the
demo's worker runs several) could each start a sweep's free slots' trials: more than
``max_concurrent_trials`` at once, and more asked than ``max_trials``."""


def sweeps_unavailable() -> str | None:
    """Why this installation cannot run sweeps (:data:`SQLITE_REFUSAL` on SQLite), or None: what the
    sweep pages say before their form, and what :func:`sweep_create` refuses with."""
    return SQLITE_REFUSAL if connections["default"].vendor == "sqlite" else None


def sweep_create(*, owner, name: str, base: Any, search_space: Any, sampler: str = "tpe", seed: Any = 0,
                 objective_metric: str = "val_accuracy", direction: str = "maximize", objective: str = "final",
                 max_trials: Any = 10, max_concurrent_trials: Any = 2, budget_usd: Any = None,
                 pruner: str = "none", pruner_startup_trials: Any = 1, pruner_warmup_epochs: Any = 0,
                 team: Any = None) -> Sweep:
    """Validate and store a RUNNING sweep, then (on commit) send its first ``sweep_fill``.

    ``base``: the job every trial starts from, a dict (or JSON text) of
    :data:`BASE_FIELDS` (``dataset``, ``model_spec``, ``backend`` ids of the owner's or their team's;
    ``epochs``, ``batch_size``, ``lr``, ``hyperparameters`` ...). ``search_space``: dotted config key
    → distribution (:func:`parse_search_space`). ``sampler``: grid (every combination once;
    categorical or stepped int keys), random or tpe, seeded with ``seed``. ``objective_metric``: any
    global metric the trials report (``val_accuracy``, ``val_loss``, a script's own name);
    ``direction`` maximize | minimize; ``objective`` final (its last value) | best (its best value
    over the run). ``max_trials`` (a grid sweep runs at most its grid), ``max_concurrent_trials``,
    ``budget_usd`` (USD for the whole sweep; None = no limit). ``pruner`` none | median |
    successive_halving, ``pruner_startup_trials`` (median: completed trials before pruning),
    ``pruner_warmup_epochs`` (epochs before a trial may be pruned).

    Raises ValidationError with every error at once, keyed by these names (``base.<field>`` for the
    base job's; a trial job is built with the trainer's schema and the real job service, in a
    rolled-back savepoint, to find them). Nothing is stored then.
    """
    errors = Errors()
    if (unavailable := sweeps_unavailable()) is not None:
        errors.add(ALL, unavailable)
    name = (name or "").strip() if isinstance(name, str) else ""
    if not name:
        errors.add("name", "Name: give the sweep a name, e.g. lr-search.")
    elif (problem := validation.text_problem(name)) is not None:
        errors.add("name", f"Name {problem}")
    name = name[:200]
    team = validation.member_team(errors, team, owner)
    payload = _base_payload(errors, base)
    space = parse_search_space(errors, search_space)
    sampler = _choice(errors, "sampler", sampler, Sweep.Sampler, "Sampler")
    direction = _choice(errors, "direction", direction, Sweep.Direction, "Direction")
    objective = _choice(errors, "objective", objective, Sweep.Objective, "Objective")
    pruner = _choice(errors, "pruner", pruner, Sweep.Pruner, "Pruner")
    seed = validation.whole_number(errors, "seed", seed, minimum=0, maximum=validation.MAX_SEED, label="Seed")
    max_trials = validation.whole_number(errors, "max_trials", max_trials, minimum=1, maximum=MAX_TRIALS,
                                         label="Max trials")
    concurrent = validation.whole_number(errors, "max_concurrent_trials", max_concurrent_trials, minimum=1,
                                         maximum=MAX_CONCURRENT, label="Max concurrent trials")
    startup = validation.whole_number(errors, "pruner_startup_trials", pruner_startup_trials, minimum=0,
                                      maximum=MAX_TRIALS, label="Pruner start-up trials")
    warmup = validation.whole_number(errors, "pruner_warmup_epochs", pruner_warmup_epochs, minimum=0,
                                     maximum=validation.MAX_EPOCHS, label="Pruner warm-up epochs")
    budget = validation.budget(Errors(), budget_usd)
    if budget_usd not in (None, "") and budget is None:
        errors.add("budget_usd", f"Budget must be an amount in USD more than $0 (or empty for none), got {budget_usd!r}.")
    metric = objective_metric.strip() if isinstance(objective_metric, str) else ""
    if not metric or len(metric) > 100 or validation.text_problem(metric) is not None or any(c.isspace() for c in metric):
        errors.add("objective_metric", "Objective metric: the name of a metric the trials report, e.g. val_accuracy.")
    if sampler == Sweep.Sampler.GRID and space:
        _, problems = grid_values(space)
        for problem in problems:
            errors.add("search_space", problem)
        if not problems and grid_size(space) > MAX_GRID_POINTS:
            errors.add("search_space", f"Search space: the grid has {grid_size(space):,} combinations; at most "
                                       f"{MAX_GRID_POINTS:,}.")
    model_errors = Errors()  # reported below, after the search space is checked against what it could read
    model_spec = validation.owned(model_errors, "base.model_spec", ModelSpec, payload.get("model_spec"), owner, "model")
    if space:
        check_space_against_config(errors, space, model_spec=model_spec)
    dataset = validation.owned(errors, "base.dataset", Dataset, payload.get("dataset"), owner, "dataset") \
        if "base.dataset" not in errors else None
    backend = validation.owned(errors, "base.backend", ComputeBackend, payload.get("backend"), owner, "backend") \
        if "base.backend" not in errors else None
    if model_spec is None and "base.model_spec" not in errors:
        for message in model_errors.get("base.model_spec", []):
            errors.add("base.model_spec", message)
    errors.raise_if_any()
    payload.update(dataset=dataset.pk, model_spec=model_spec.pk, backend=backend.pk)
    first = {k: (s["choices"][0] if s["type"] == "categorical" else s["low"]) for k, s in space.items()}
    estimate = _check_trial(errors, owner=owner, team=team, payload=trial_payload(payload, first),
                            name=f"{name} trial 0")
    if budget is not None and not errors and estimate > budget:
        errors.add("budget_usd", f"One trial is estimated at ${estimate:,.2f} (max runtime × nodes × price), more than "
                                 f"the sweep's budget of ${budget:,.2f}: raise the budget or lower the max runtime.")
    errors.raise_if_any()
    with transaction.atomic():
        sweep = Sweep.objects.create(
            owner=owner, team=team, name=name, dataset=dataset, model_spec=model_spec, backend=backend,
            base=payload, search_space=space, sampler=sampler, seed=seed, objective_metric=metric,
            direction=direction, objective=objective, max_trials=max_trials, max_concurrent_trials=concurrent,
            budget_usd=budget, pruner=pruner, pruner_startup_trials=startup, pruner_warmup_epochs=warmup,
            trial_estimate_usd=estimate, state=Sweep.State.RUNNING)
        dispatch.sweep_fill_after_commit(sweep.pk)
    return sweep


# =============================================================================================
# Ask: fill the free trial slots
# =============================================================================================


def trial_limit(sweep: Sweep) -> int:
    """How many trials the sweep runs at most: ``max_trials``, and no more than its grid for grid."""
    if sweep.sampler == Sweep.Sampler.GRID:
        return min(sweep.max_trials, grid_size(sweep.search_space))
    return sweep.max_trials


def _counted(trials) -> list:
    """The trials that count against the limit: all but stale ones (asked, never given a job)."""
    return [t for t in trials if not t.user_attrs.get("stale")]


def sweep_spend(sweep: Sweep) -> dict[str, Decimal]:
    """``{"spent_usd", "committed_usd"}``: the cost of the sweep's jobs so far, and that plus what
    its active jobs may still cost (the larger of each one's estimate and its cost so far)."""
    jobs = TrainingJob.objects.filter(sweep_id=sweep.pk)
    spent = jobs.aggregate(s=Sum("cost_usd"))["s"] or Decimal("0")
    committed = spent
    for cost, estimate in jobs.filter(state__in=ACTIVE_STATE_VALUES).values_list("cost_usd", "estimated_cost_usd"):
        committed += max(estimate - cost, Decimal("0"))
    places = Decimal("0.0001")  # the cost columns' precision
    return {"spent_usd": Decimal(spent).quantize(places), "committed_usd": Decimal(committed).quantize(places)}


def _budget_allows(sweep: Sweep) -> bool:
    if sweep.budget_usd is None:
        return True
    return sweep_spend(sweep)["committed_usd"] + sweep.trial_estimate_usd <= sweep.budget_usd


def _note(sweep: Sweep, trial: int, message: str) -> None:
    sweep.trial_errors = [*sweep.trial_errors, {"trial": trial, "message": message[:2000]}][-200:]
    sweep.message = f"Trial {trial}: {message}"[:2000]
    Sweep.objects.filter(pk=sweep.pk).update(trial_errors=sweep.trial_errors, message=sweep.message)


def _create_trial_job(sweep: Sweep, trial: "optuna.Trial") -> TrainingJob:
    """The job of ``trial`` (its params over the base job), stored with ``sweep`` and its number.
    Raises ValidationError when the service refuses it; nothing is written then."""
    payload = trial_payload(sweep.base, trial.params)
    with transaction.atomic():
        job = services.training_job_create(owner=sweep.owner, team=sweep.team,
                                           name=f"{sweep.name} trial {trial.number}"[:200], **payload)
        TrainingJob.objects.filter(pk=job.pk).update(sweep=sweep, trial_number=trial.number)
    job.sweep_id, job.trial_number = sweep.pk, trial.number
    return job


def _lock(sweep_id: int) -> Sweep | None:
    return Sweep.objects.select_for_update().filter(pk=sweep_id).first()


def sweep_fill(*, sweep_id: int) -> list[int]:
    """Start trials until the sweep's slots are full; end the sweep when nothing is left to run.

    Under the sweep row's lock: repair stale trials (:func:`repair_stale_trials`), then
    :func:`_fill_locked`. Returns the new jobs' ids. Safe to call any number of times, from any
    worker, at once (a second call waits for the first, then finds the slots it filled).
    """
    with transaction.atomic():
        sweep = _lock(sweep_id)
        if sweep is None or sweep.state != Sweep.State.RUNNING:
            return []
        study = sweep_study(sweep)
        repair_stale_trials(sweep, study)
        return _fill_locked(sweep, study)


def _free_slots(sweep: Sweep, study: "optuna.Study") -> bool:
    """Whether one more trial may start now: active trial jobs < ``max_concurrent_trials``, trials
    (stale ones not counted) < :func:`trial_limit` and the budget allows (spent + active estimates +
    one trial's estimate ≤ ``budget_usd``). The caller holds the sweep's lock."""
    active = TrainingJob.objects.filter(sweep_id=sweep.pk, state__in=ACTIVE_STATE_VALUES).count()
    counted = len(_counted(study.get_trials(deepcopy=False)))
    return active < sweep.max_concurrent_trials and counted < trial_limit(sweep) and _budget_allows(sweep)


def _fill_locked(sweep: Sweep, study: "optuna.Study") -> list[int]:
    """While :func:`_free_slots`, ask Optuna and create the trial's job (a refused job is told FAIL
    with its message on the sweep); then end the sweep if nothing is left to run
    (:func:`_maybe_finish`). The caller holds the sweep's lock. Returns the new jobs' ids."""
    from optuna.trial import TrialState

    created: list[int] = []
    distributions = _distributions(sweep.search_space)
    while _free_slots(sweep, study):
        study.sampler = _sampler(sweep, asked=len(study.get_trials(deepcopy=False)))
        trial = study.ask(distributions)
        try:
            job = _create_trial_job(sweep, trial)
        except ValidationError as exc:
            text = "; ".join(m for ms in exc.message_dict.values() for m in ms)
            trial.set_user_attr("failure", f"job refused: {text}"[:2000])
            study.tell(trial, state=TrialState.FAIL)
            _note(sweep, trial.number, f"job refused: {text}")
            continue
        trial.set_user_attr("job_id", job.pk)
        created.append(job.pk)
    _maybe_finish(sweep, study)
    return created


def _maybe_finish(sweep: Sweep, study: "optuna.Study") -> None:
    """End the sweep (under its lock) when no trial job is active and nothing more will start:
    SUCCEEDED (trials done, at least one complete), FAILED (none complete), BUDGET_REACHED."""
    from optuna.trial import TrialState

    if TrainingJob.objects.filter(sweep_id=sweep.pk, state__in=ACTIVE_STATE_VALUES).exists():
        return
    trials = study.get_trials(deepcopy=False)
    if any(t.state == TrialState.RUNNING for t in trials):
        return  # told by the job's end (or the next repair)
    counted = _counted(trials)
    done = len(counted) >= trial_limit(sweep)
    if not done and _budget_allows(sweep):
        return
    complete = [t for t in counted if t.state == TrialState.COMPLETE]
    if not done:
        state = Sweep.State.BUDGET_REACHED
        message = (f"Budget reached: ${sweep_spend(sweep)['spent_usd']:,.2f} spent of ${sweep.budget_usd:,.2f}; "
                   f"another trial (about ${sweep.trial_estimate_usd:,.2f}) would pass it. {len(counted)} of "
                   f"{trial_limit(sweep)} trials ran.")
    elif complete:
        state, message = Sweep.State.SUCCEEDED, f"All {len(counted)} trials done; {len(complete)} complete."
    else:
        state, message = Sweep.State.FAILED, f"All {len(counted)} trials done; none completed with {sweep.objective_metric}."
    Sweep.objects.filter(pk=sweep.pk, state=Sweep.State.RUNNING).update(
        state=state, message=message, ended_at=timezone.now(), updated_at=timezone.now())


# =============================================================================================
# Tell: a trial's job ended
# =============================================================================================


def objective_value(sweep: Sweep, job: TrainingJob) -> float | None:
    """The trial's score: the last value (``objective`` final) or the best (``best``: max when
    maximizing, min when minimizing) of the sweep's ``objective_metric`` over the job's global
    MetricPoints; None when it never reported a finite one."""
    if sweep.objective == Sweep.Objective.BEST:  # the series' summary row (jobs.metric_buckets)
        summary = metric_buckets.summaries([job.pk], names=[sweep.objective_metric], per_rank=False)
        agg = summary.get((job.pk, sweep.objective_metric, None))
        if agg is None:
            return None
        return agg.max_value if sweep.direction == Sweep.Direction.MAXIMIZE else agg.min_value
    return next((value for _, value, _, _ in metric_store.backwards(job.pk, sweep.objective_metric)
                 if value is not None), None)


def _frozen(study: "optuna.Study", number: int):
    for t in study.get_trials(deepcopy=False):
        if t.number == number:
            return t
    return None


def _tell_job(sweep: Sweep, study: "optuna.Study", job: TrainingJob) -> str | None:
    """Tell Optuna how ``job``'s (terminal) trial ended; the state told, or None if it was told before."""
    from optuna.trial import TrialState

    frozen = _frozen(study, job.trial_number)
    if frozen is None or frozen.state != TrialState.RUNNING:
        return None  # pruned, or told by an earlier delivery
    # Its whole curve, so the pruner compares later trials with a complete one at every epoch (the
    # epochs a pass reported are in it already).
    for epoch, reported in _epoch_values(sweep, job, after=max(frozen.intermediate_values, default=0)).items():
        if epoch not in frozen.intermediate_values:
            study._storage.set_trial_intermediate_value(frozen._trial_id, epoch, reported)
    value = objective_value(sweep, job) if job.state == S.SUCCEEDED else None
    if value is not None:
        study.tell(frozen.number, value)
        return TrialState.COMPLETE.name
    reason = (f"job {job.pk} ended {job.state} without reporting {sweep.objective_metric}"
              if job.state == S.SUCCEEDED or not job.failure_reason
              else f"job {job.pk} ended {job.state}: {job.failure_reason}")
    study._storage.set_trial_user_attr(frozen._trial_id, "failure", reason[:2000])
    study.tell(frozen.number, state=TrialState.FAIL)
    _note(sweep, frozen.number, reason)
    return TrialState.FAIL.name


def sweep_trial_ended(*, job_id: int) -> str | None:
    """Tell the sweep of job ``job_id`` (terminal) how its trial ended, then fill the free slots.
    Returns the state told (COMPLETE, FAIL) or None (not a trial, not ended, already told)."""
    job = TrainingJob.objects.filter(pk=job_id).first()
    if job is None or job.sweep_id is None or job.state not in TERMINAL_STATE_VALUES:
        return None
    with transaction.atomic():
        sweep = _lock(job.sweep_id)
        if sweep is None:
            return None
        study = sweep_study(sweep)
        told = _tell_job(sweep, study, job)
    sweep_fill(sweep_id=job.sweep_id)
    return told


def _on_job_state_changed(sender, *, job_id: int, to_state: str, **kwargs: Any) -> None:
    """Receiver of :data:`jobs.signals.job_state_changed`: a trial's job that ended sends
    ``sweep_trial_ended`` (one indexed lookup for other jobs' ends, nothing for other moves)."""
    if to_state not in TERMINAL_STATE_VALUES:
        return
    if TrainingJob.objects.filter(pk=job_id, sweep__isnull=False).exists():
        dispatch.send_sweep_trial_ended(job_id)


job_state_changed.connect(_on_job_state_changed, dispatch_uid="jobs.sweeps.trial_ended")


# =============================================================================================
# Pruning and repair (beat)
# =============================================================================================


EPOCH_VALUES_CHUNK = 500
"""Rows fetched at a time by :func:`_epoch_values` (a server-side cursor on PostgreSQL)."""


def _epoch_values(sweep: Sweep, job: TrainingJob, *, after: int = 0) -> dict[int, float]:
    """Epoch (1-based) → the objective metric's last value in that epoch, from the job's global
    points, for the epochs after ``after`` (1-based: 0 is every epoch).

    Read from the job's last step backwards (index ``metric_job_name_step``) and stopped at the first
    point of an epoch at or before ``after``: a pruning pass reads the points since the epochs it
    reported, not the run's whole history (a step-level objective on a week-long run is millions of
    points). Raises nothing; a job without such points gives ``{}``."""
    out: dict[int, float] = {}
    for _, value, epoch, _ in metric_store.backwards(job.pk, sweep.objective_metric, page_rows=EPOCH_VALUES_CHUNK):
        if epoch is None or value is None:
            continue
        if epoch + 1 <= after:
            break
        out.setdefault(epoch + 1, value)  # the first seen backwards is the epoch's last
    return dict(sorted(out.items()))


def prune_trials(sweep: Sweep, study: "optuna.Study") -> list[int]:
    """Report each active trial's new per-epoch values (``trial.report(value, epoch)``); cancel the
    job of a trial whose pruner says ``should_prune()`` (reason "pruned by the median pruner at epoch
    1") and tell it PRUNED. Returns the pruned trial numbers. The caller holds the sweep's lock."""
    import optuna
    from optuna.trial import TrialState

    if sweep.pruner == Sweep.Pruner.NONE:
        return []
    pruned = []
    for job in TrainingJob.objects.filter(sweep_id=sweep.pk, state__in=ACTIVE_STATE_VALUES).exclude(
            state=S.STOPPING).order_by("trial_number"):
        frozen = _frozen(study, job.trial_number)
        if frozen is None or frozen.state != TrialState.RUNNING:
            continue
        values = _epoch_values(sweep, job, after=max(frozen.intermediate_values, default=0))
        new = {e: v for e, v in values.items() if e not in frozen.intermediate_values}
        if not new:
            continue
        trial = optuna.trial.Trial(study, frozen._trial_id)
        # Asked after each epoch, as if every epoch had been seen on time: the pruners compare a trial
        # at its last reported step only, so a trial that ran past the completed trials' epochs
        # between two passes (fast epochs, a slow pass) would otherwise never be compared again.
        epoch = next((e for e, value in sorted(new.items()) if _reported_and_pruned(trial, value, e)), None)
        if epoch is None:
            continue
        reason = f"pruned by the {PRUNER_LABELS[sweep.pruner]} at epoch {epoch}"
        try:
            services.training_job_cancel(job=job, reason=reason)
        except ValidationError:
            continue  # it ended meanwhile: its end is told as it is
        trial.set_user_attr("pruned", reason)
        study.tell(frozen.number, state=TrialState.PRUNED)
        pruned.append(frozen.number)
    return pruned


def _reported_and_pruned(trial: "optuna.Trial", value: float, epoch: int) -> bool:
    trial.report(value, epoch)
    return trial.should_prune()


def repair_stale_trials(sweep: Sweep, study: "optuna.Study") -> list[int]:
    """Under the sweep's lock: every Optuna trial left RUNNING without a job (a worker killed between
    ``ask`` and the job's commit) is told FAIL as stale (``user_attrs["stale"]``, not counted against
    the limit; on a grid its point is asked again); a trial whose job ended but was never told (a
    lost ``sweep_trial_ended``) is told now. Returns the trial numbers repaired."""
    from optuna.trial import TrialState

    repaired = []
    jobs = {j.trial_number: j for j in TrainingJob.objects.filter(sweep_id=sweep.pk)}
    for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        job = jobs.get(frozen.number)
        if job is None:
            study._storage.set_trial_user_attr(frozen._trial_id, "stale", True)
            study._storage.set_trial_user_attr(frozen._trial_id, "failure",
                                               "asked but never given a job (its worker stopped); asked again")
            study.tell(frozen.number, state=TrialState.FAIL)
            if sweep.sampler == Sweep.Sampler.GRID:
                study.enqueue_trial(dict(frozen.params), skip_if_exists=False)
            repaired.append(frozen.number)
        elif job.state in TERMINAL_STATE_VALUES:
            _tell_job(sweep, study, job)
            repaired.append(frozen.number)
    return repaired


def sweep_tick() -> dict[str, int]:
    """Beat's pass over running sweeps: report intermediate values and prune, repair, and fill the
    free slots, each sweep in one transaction under its row's lock. A sweep another worker holds (a
    fill, a trial's end being told, another tick: ``SKIP LOCKED``) is skipped: that worker fills
    it, so a tick never waits behind a fill in flight nor starts a second one; the next tick looks
    again. Returns ``{"pruned", "repaired", "filled" (new trial jobs), "skipped" (sweeps held)}``."""
    counts = {"pruned": 0, "repaired": 0, "filled": 0, "skipped": 0}
    for sweep_id in Sweep.objects.filter(state=Sweep.State.RUNNING).values_list("pk", flat=True):
        with transaction.atomic():
            sweep = Sweep.objects.select_for_update(skip_locked=True).filter(pk=sweep_id).first()
            if sweep is None:
                counts["skipped"] += 1
                continue
            if sweep.state != Sweep.State.RUNNING:
                continue
            study = sweep_study(sweep)
            counts["pruned"] += len(prune_trials(sweep, study))
            counts["repaired"] += len(repair_stale_trials(sweep, study))
            counts["filled"] += len(_fill_locked(sweep, study))
    return counts


# =============================================================================================
# Cancel
# =============================================================================================


def sweep_cancel(*, sweep: Sweep, reason: str = "Sweep cancelled by user") -> Sweep:
    """Stop the sweep: no new trials, every active trial job cancelled with ``reason`` (their ends
    are told FAIL). A sweep that already ended raises ValidationError."""
    with transaction.atomic():
        locked = _lock(sweep.pk)
        if locked is None or locked.state != Sweep.State.RUNNING:
            raise ValidationError({ALL: [f"Sweep {sweep.pk} already ended ({locked.state if locked else 'gone'}); "
                                         f"there is nothing to cancel."]})
        now = timezone.now()
        Sweep.objects.filter(pk=locked.pk).update(state=Sweep.State.CANCELLED, message=reason, ended_at=now,
                                                  cancel_requested_at=now, updated_at=now)
        for job in TrainingJob.objects.filter(sweep_id=locked.pk, state__in=ACTIVE_STATE_VALUES):
            try:
                services.training_job_cancel(job=job, reason=reason)
            except ValidationError:
                pass  # ended meanwhile
    locked.refresh_from_db()
    return locked


# =============================================================================================
# Reads (Optuna's side of a sweep, for the page, the API and the CLI)
# =============================================================================================


def sweep_trials(*, sweep: Sweep) -> list[dict[str, Any]]:
    """One dict per Optuna trial, in order: ``number``, ``state`` (COMPLETE, PRUNED, FAIL, RUNNING,
    WAITING), ``params`` (dotted key → value), ``value`` (the objective, None unless complete),
    ``intermediate`` (epoch → value), ``job_id``, ``job_state``, ``cost_usd``, ``message`` (why it
    failed or was pruned), ``stale``."""
    study = _existing_study(sweep)
    jobs = {j.trial_number: j for j in TrainingJob.objects.filter(sweep_id=sweep.pk).only(
        "id", "trial_number", "state", "cost_usd", "failure_reason")}
    out = []
    for t in (study.get_trials(deepcopy=False) if study is not None else []):
        job = jobs.get(t.number)
        out.append({"number": t.number, "state": t.state.name, "params": dict(t.params),
                    "value": t.value if t.state.name == "COMPLETE" else None,
                    "intermediate": {int(k): v for k, v in sorted(t.intermediate_values.items())},
                    "job_id": job.pk if job else None, "job_state": job.state if job else None,
                    "cost_usd": job.cost_usd if job else None,
                    "message": t.user_attrs.get("pruned") or t.user_attrs.get("failure") or "",
                    "stale": bool(t.user_attrs.get("stale"))})
    return out


def _existing_study(sweep: Sweep):
    import optuna

    try:
        return optuna.load_study(study_name=sweep.study_name, storage=optuna_storage(), sampler=_sampler(sweep),
                                 pruner=_pruner(sweep))
    except KeyError:  # not created yet: no fill has run
        return None


def best_trial(sweep: Sweep, trials: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The complete trial with the best objective (first of equals), or None."""
    complete = [t for t in trials if t["state"] == "COMPLETE" and t["value"] is not None]
    if not complete:
        return None
    pick = max if sweep.direction == Sweep.Direction.MAXIMIZE else min
    return pick(complete, key=lambda t: t["value"])


def param_importances(*, sweep: Sweep) -> dict[str, float]:
    """Parameter → importance (sums to 1) from the complete trials, by Optuna's
    :func:`optuna.importance.get_param_importances` with the PED-ANOVA evaluator (numpy only);
    {} with fewer than two complete trials or when every trial scored the same."""
    import optuna
    from optuna.trial import TrialState

    study = _existing_study(sweep)
    if study is None:
        return {}
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < 2 or len({t.value for t in complete}) < 2:
        return {}
    try:
        found = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
    except (ValueError, RuntimeError, ZeroDivisionError) as exc:
        log.info("sweep %s: no importances: %s", sweep.pk, exc)
        return {}
    return {k: float(v) for k, v in found.items() if math.isfinite(v)}


def sweep_progress(*, sweep: Sweep, trials: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"done", "running", "limit", "spent_usd", "committed_usd", "budget_usd"}`` for the page and API."""
    counted = [t for t in trials if not t["stale"]]
    return {"done": sum(1 for t in counted if t["state"] in ("COMPLETE", "PRUNED", "FAIL")),
            "running": sum(1 for t in counted if t["state"] == "RUNNING"),
            "asked": len(counted), "limit": trial_limit(sweep), **sweep_spend(sweep),
            "budget_usd": sweep.budget_usd}


__all__ = [
    "SPACE_EXAMPLE", "best_trial", "check_space_against_config", "grid_size", "grid_values", "objective_value",
    "optuna_storage", "param_importances", "parse_search_space", "prune_trials", "repair_stale_trials",
    "storage_url", "sweep_cancel", "sweep_create", "sweep_fill", "sweep_progress", "sweep_study", "sweep_tick",
    "sweep_trial_ended", "sweep_trials", "trial_limit", "trial_payload",
]
