"""Reads for comparing runs (``/jobs/compare/`` and ``GET /api/jobs/compare/``; docs/comparing-runs.md).

A comparison is of jobs the user may see (their own and their teams', :mod:`jobs.selectors`), at most
:data:`MAX_COMPARED_JOBS`, in the order asked. For them it gives every metric any of them logged (the
trainer's and a script's own, global and per rank), one series per run for the charts, a table of each
run's final and best value of each global metric with the best run per column, and a diff of their
frozen configs (flattened to dotted keys) and shapes that marks the keys whose values differ.

Best: the minimum of a metric whose name contains ``loss``, ``error`` or ``perplexity`` (and of the
trainer's ``wait_for_slowest_s``), the maximum of any other, nothing for ``lr`` (a schedule, neither
better high nor low): :func:`metric_direction`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Sequence

from django.core.exceptions import ValidationError

from jobs import selectors
from jobs.models import MetricPoint, TrainingJob
from jobs.validation import Errors

MAX_COMPARED_JOBS = 20
"""Most runs one comparison shows (the charts overlay a line per run: more is unreadable)."""
MAX_COMPARED_METRICS = 60
"""Most metric names one comparison charts and tabulates, in :func:`_metric_order`."""
MAX_POINTS_PER_SERIES = 2000
"""A longer series is thinned to this many evenly spaced points for the charts (first and last kept);
the table's final and best values are always read from every point."""
MAX_IDS_TEXT = 2000
"""Longest ``ids`` text read (about 20 ids of any length fit many times over)."""

MULTI_RANK_METRICS = ("wait_for_slowest_s",)
"""Metrics that mean something only with two ranks or more: a one-rank run's values of them (0, from
trainers that still reported them) are left out of its charts and the table, so it never wins them."""
RANK_METRICS = ("rank_samples_per_s", "rank_step_time_s", "rank_data_wait_s", "rank_compute_s", "rank_sync_wait_s")
"""The trainer's per-rank series charted one line per rank (the stage fields are constants, not series)."""

# The trainer's own metrics, in the order the table shows them, with the direction that is better.
OWN_DIRECTIONS: dict[str, str | None] = {
    "val_accuracy": "max", "val_loss": "min", "train_accuracy": "max", "train_loss": "min",
    "val_perplexity": "min", "samples_per_s": "max", "tokens_per_s": "max", "wait_for_slowest_s": "min",
    "lr": None,
    "rank_samples_per_s": "max", "rank_step_time_s": "min", "rank_data_wait_s": "min", "rank_compute_s": "min",
    "rank_sync_wait_s": "min",
}
MINIMISED_NAME = re.compile(r"loss|error|perplexity", re.IGNORECASE)
"""A user metric whose name matches this (anywhere, any case) is better low; any other, better high."""
DIRECTION_RULE = ("Best is the lowest value of a metric whose name contains “loss”, “error” or “perplexity” "
                  "(and of wait_for_slowest_s), the highest of any other; lr has no best.")

SHAPE_KEYS = ("backend", "dataset", "model", "strategy", "nodes", "procs_per_node", "instance_type", "spot")
"""The job's shape fields the config diff lists first, before the frozen config's dotted keys."""
ABSENT = "—"
"""How the config diff shows a key one run's config does not have."""


def metric_direction(name: str) -> str | None:
    """``"min"`` or ``"max"``: which value of metric ``name`` is the best; None for ``lr``.

    The trainer's own metrics by :data:`OWN_DIRECTIONS`; any other name by :data:`MINIMISED_NAME`."""
    if name in OWN_DIRECTIONS:
        return OWN_DIRECTIONS[name]
    return "min" if MINIMISED_NAME.search(name) else "max"


def metric_kind(name: str) -> str:
    """``"accuracy"`` (a 0–1 axis fitted to the data), ``"loss"`` or ``"other"``: how its chart's y axis starts."""
    lowered = name.lower()
    if "accuracy" in lowered:
        return "accuracy"
    return "loss" if "loss" in lowered else "other"


def parse_job_ids(raw: str) -> list[int]:
    """``"3, 1,#2,3"`` → ``[3, 1, 2]``: the job ids of a comparison's ``ids`` parameter, in order, each once.

    Separators: commas and whitespace; ``#7`` is 7. Raises ValidationError on ``ids`` naming every
    part that is not a job id (all at once), or saying none was given. An id past PostgreSQL's bigint
    is kept (no job has it: it is reported as not found, never an error of the database)."""
    errors = Errors()
    text = (raw or "")[:MAX_IDS_TEXT]
    ids: list[int] = []
    for part in re.split(r"[\s,]+", text.strip()):
        if not part:
            continue
        digits = part.removeprefix("#")
        if digits.isascii() and digits.isdigit():
            value = int(digits[:30])
            if value not in ids:
                ids.append(value)
        else:
            errors.add("ids", f"“{part[:40]}” is not a job id; give job numbers separated by commas, e.g. ids=12,15,19.")
    if not ids and not errors:
        errors.add("ids", "Give the jobs to compare, e.g. ids=12,15,19 (or pick them in the job list and press Compare).")
    errors.raise_if_any()
    return ids


def training_jobs_by_ids_for_user(*, user, ids: Sequence[int]) -> tuple[list[TrainingJob], list[int]]:
    """``(jobs, not_found)``: the jobs of ``ids`` that ``user`` may see, in the order of ``ids``, and
    the ids that are not theirs to see, in order. A stranger's job and a job that does not exist are
    both "not found": the answer never reveals that a job exists."""
    storable = [i for i in ids if i < 2**63]
    found = {job.pk: job for job in
             selectors.training_job_list_for_user(user=user).filter(pk__in=storable).select_related("backend")}
    return [found[i] for i in ids if i in found], [i for i in ids if i not in found]


def limit_jobs(jobs: Iterable[TrainingJob]) -> tuple[list[TrainingJob], int]:
    """``(the first MAX_COMPARED_JOBS jobs, how many there were in all)``; reads at most one past the cap
    from a queryset, so a filter matching thousands of jobs costs no more than one matching 21."""
    head = list(jobs[:MAX_COMPARED_JOBS + 1]) if hasattr(jobs, "filter") else list(jobs)
    if len(head) <= MAX_COMPARED_JOBS:
        return head, len(head)
    total = jobs.count() if hasattr(jobs, "filter") else len(head)
    return head[:MAX_COMPARED_JOBS], total


def limit_message(shown: int, total: int) -> str:
    """What a comparison capped at :data:`MAX_COMPARED_JOBS` says ("" when nothing was left out)."""
    if total <= shown:
        return ""
    return (f"Showing {shown} of {total} runs: a comparison shows at most {MAX_COMPARED_JOBS}. "
            f"Narrow the filter or pick the runs in the job list.")


def not_found_message(ids: Sequence[int]) -> str:
    """"Not found: #7, #9 …" for ids the user may not see or that do not exist ("" for none)."""
    if not ids:
        return ""
    shown = ", ".join(f"#{i}" for i in ids[:20]) + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")
    return f"Not found: {shown} (no such job, or one you may not see)."


def _thin(points: list[dict[str, Any]], cap: int = MAX_POINTS_PER_SERIES) -> list[dict[str, Any]]:
    """``cap`` evenly spaced points of a series longer than ``cap``, its first and last kept."""
    if len(points) <= cap:
        return points
    last = len(points) - 1
    return [points[round(i * last / (cap - 1))] for i in range(cap)]


def _seconds(when) -> float:
    return round(when.timestamp(), 3)


def _metric_order(names: Iterable[str]) -> list[str]:
    """The trainer's own metrics in :data:`OWN_DIRECTIONS` order, then the others by name."""
    names = set(names)
    own = [n for n in OWN_DIRECTIONS if n in names]
    return (own + sorted(names - set(own)))[:MAX_COMPARED_METRICS]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 0.1}}`` → ``{"train.lr": 0.1}``; lists and scalars are leaves; an empty
    dict is a leaf of its own ({})."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key in sorted(value, key=str):
            out.update(_flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value} if prefix else {}


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _shape(job: TrainingJob) -> dict[str, Any]:
    return {"backend": job.backend.name if job.backend_id else None,
            "dataset": job.dataset.name if job.dataset_id else None,
            "model": job.model_spec.name if job.model_spec_id else None,
            "strategy": job.strategy, "nodes": job.nodes, "procs_per_node": job.procs_per_node,
            "instance_type": job.instance_type, "spot": job.spot}


def config_diff(*, jobs: Sequence[TrainingJob]) -> list[dict[str, Any]]:
    """The rows of the config diff: ``[{"key": "train.lr", "values": ["0.1", "0.05"], "differs": True}, ...]``.

    One row per key any run has: the shape fields (:data:`SHAPE_KEYS`, as ``backend``, ``nodes`` ...)
    first, then the frozen config's dotted keys in name order. ``values`` has one text per run, in the
    order of ``jobs`` (JSON for a number, a boolean, a list or null; :data:`ABSENT` where that run has
    no such key); ``differs``: the runs do not all have the same value (absence counts as a value)."""
    # The shape wins a clash (a config section that is an empty dict flattens to its bare name).
    flats = [{**_flatten(job.config if isinstance(job.config, dict) else {}), **_shape(job)} for job in jobs]
    keys = list(SHAPE_KEYS) + sorted({k for flat in flats for k in flat} - set(SHAPE_KEYS))
    rows = []
    for key in keys:
        values = [_shown(flat[key]) if key in flat else ABSENT for flat in flats]
        rows.append({"key": key, "values": values, "differs": len(set(values)) > 1})
    return rows


def _points_of(jobs: Sequence[TrainingJob]) -> tuple[dict, dict, dict, dict[int, float]]:
    """``(series, rank_series, stats, t0)`` of the jobs: every point, global and per rank
    (:data:`RANK_METRICS`), as ``{"x": step, "y": value, "t": unix s}``; ``stats[name][job_id]`` its final
    and best value; ``t0[job_id]`` the time of the job's first point. A one-rank job's
    :data:`MULTI_RANK_METRICS` are left out. Two queries."""
    job_ids = [job.pk for job in jobs]
    one_rank = {job.pk for job in jobs if job.world_size <= 1}
    series: dict[str, dict[str, list[dict[str, Any]]]] = {}
    stats: dict[str, dict[int, dict[str, Any]]] = {}
    t0: dict[int, float] = {}
    rows = (MetricPoint.objects.filter(job_id__in=job_ids, rank__isnull=True)
            .order_by("job_id", "name", "step", "id").values_list("job_id", "name", "step", "value", "recorded_at"))
    directions: dict[str, str | None] = {}
    for job_id, name, step, value, at in rows:
        if job_id in one_rank and name in MULTI_RANK_METRICS:
            continue
        t = _seconds(at)
        t0[job_id] = min(t0.get(job_id, t), t)
        series.setdefault(name, {}).setdefault(str(job_id), []).append({"x": step, "y": value, "t": t})
        cell = stats.setdefault(name, {}).setdefault(job_id, {"final": None, "best": None})
        cell["final"] = value  # ordered by step: the last row is the run's last value
        direction = directions[name] if name in directions else directions.setdefault(name, metric_direction(name))
        if value is not None and direction is not None:
            best = cell["best"]
            if best is None or (value < best if direction == "min" else value > best):
                cell["best"] = value
    rank_series: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    rank_rows = (MetricPoint.objects.filter(job_id__in=job_ids, rank__isnull=False, name__in=RANK_METRICS)
                 .order_by("job_id", "name", "rank", "step", "id")
                 .values_list("job_id", "name", "rank", "step", "value", "recorded_at"))
    for job_id, name, rank, step, value, at in rank_rows:
        t = _seconds(at)
        t0[job_id] = min(t0.get(job_id, t), t)
        (rank_series.setdefault(name, {}).setdefault(str(job_id), {}).setdefault(str(rank), [])
         .append({"x": step, "y": value, "t": t}))

    return series, rank_series, stats, t0


def training_job_chart_series(*, job: TrainingJob) -> dict[str, Any]:
    """The job page's chart data: ``{"series": {name: [{"x": step, "y": value, "t": unix s}]},
    "rank_series": {name: {"<rank>": [points]}}, "t0": unix s of its first point or None}``; every
    global point, the per-rank series of :data:`RANK_METRICS` thinned to :data:`MAX_POINTS_PER_SERIES`."""
    series, rank_series, _, t0 = _points_of([job])
    key = str(job.pk)
    return {"series": {name: by_job[key] for name, by_job in series.items()},
            "rank_series": {name: {r: _thin(points) for r, points in by_job[key].items()}
                            for name, by_job in rank_series.items()},
            "t0": t0.get(job.pk)}


def training_job_comparison(*, jobs: Sequence[TrainingJob]) -> dict[str, Any]:
    """Everything a comparison of ``jobs`` shows (jobs the caller has scoped to the user; in order).

    ``{"runs": [{"id", "name", "state", "t0"}], "metrics": [{"name", "direction", "kind", "per_rank"}],
    "table": [{"job_id", "values": {name: {"final", "best"}}}], "best": {name: {"final": job_id, "best": job_id}},
    "config": [rows of :func:`config_diff`], "direction_rule": text,
    "series": {name: {"<job id>": [{"x": step, "y": value, "t": unix s}]}},
    "rank_series": {name: {"<job id>": {"<rank>": [points]}}}}``.

    ``t0``: unix seconds of the run's first point (None without points), what the charts' relative
    time counts from. ``y`` is None where the trainer reported NaN or infinity. ``final``: the value at
    the run's last step; ``best``: its min or max over every point (:func:`metric_direction`); both None
    where the run has no finite point of that metric. ``best`` names, per column, the run with the best
    value (the first of equals; None when no run has one, or for a metric without a direction). Only
    global metrics are in the table; per-rank ones (:data:`RANK_METRICS`) are charted one line per rank.
    A one-rank run has no value of :data:`MULTI_RANK_METRICS` (nothing waits for a slowest rank): it
    shows none and never wins them. Two queries (global points, per-rank points) whatever the number of runs.
    """
    job_ids = [job.pk for job in jobs]
    series, rank_series, stats, t0 = _points_of(jobs)
    names = _metric_order(list(series) + list(rank_series))
    metrics = [{"name": n, "direction": metric_direction(n), "kind": metric_kind(n), "per_rank": n in rank_series}
               for n in names]
    table_names = [m["name"] for m in metrics if not m["per_rank"]]
    best: dict[str, dict[str, int | None]] = {}
    for name in table_names:
        direction = metric_direction(name)
        best[name] = {}
        for column in ("final", "best"):
            candidates = [(stats[name][j][column], j) for j in job_ids
                          if j in stats[name] and stats[name][j][column] is not None]
            winner = None
            if direction is not None and candidates:
                pick = min if direction == "min" else max
                target = pick(v for v, _ in candidates)
                winner = next(j for v, j in candidates if v == target)
            best[name][column] = winner
    return {
        "runs": [{"id": job.pk, "name": str(job), "state": job.state, "t0": t0.get(job.pk)} for job in jobs],
        "metrics": metrics,
        "table": [{"job_id": job.pk,
                   "values": {n: dict(stats.get(n, {}).get(job.pk, {"final": None, "best": None})) for n in table_names}}
                  for job in jobs],
        "best": best,
        "config": config_diff(jobs=jobs),
        "direction_rule": DIRECTION_RULE,
        "series": {n: {j: _thin(points) for j, points in series[n].items()} for n in names if n in series},
        "rank_series": {n: {j: {r: _thin(points) for r, points in by_rank.items()} for j, by_rank in rank_series[n].items()}
                        for n in names if n in rank_series},
    }


def ids_problem(exc: ValidationError) -> list[str]:
    """The messages of a :func:`parse_job_ids` error, for a page that shows them."""
    return [m for ms in exc.message_dict.values() for m in ms]
