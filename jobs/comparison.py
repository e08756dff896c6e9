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

from jobs import metric_buckets, metric_retention, metric_store, pagination, selectors
from jobs.metric_fold import ACROSS_RANKS, ACROSS_SEPARATOR, Agg, across_ranks_name
from jobs.models import TrainingJob
from jobs.validation import Errors

MAX_COMPARED_JOBS = 20
"""Most runs one comparison shows (the charts overlay a line per run: more is unreadable)."""
MAX_COMPARED_METRICS = 60
"""Most metric names one comparison charts and tabulates, in :func:`_metric_order`."""
MAX_POINTS_PER_SERIES = 2000
"""Points a chart line gets at most: a longer range is read as buckets (:mod:`jobs.metric_buckets`),
each its last point and its min–max band; the table's final and best values are the whole series'."""
MAX_POINTS_PER_RANK_LINE = 250
"""Points a per-rank line gets at most: a chart draws one line per rank (5 charts × 8 ranks are 40
lines), so each gets fewer points than a global line for the page to stay one bounded read."""
MAX_RANK_LINES = 16
"""Most ranks a job may have for its per-rank charts to get a line per rank. A larger job's charts get
the min, median and max across its ranks (``metric_fold.ACROSS_RANKS``, stored step by step by the
sync) with its slowest rank named: 512 lines are unreadable and would make every poll read 512 × 250
rows a chart."""
MAX_IDS_TEXT = 2000
"""Longest ``ids`` text read (about 20 ids of any length fit many times over)."""

MULTI_RANK_METRICS = ("wait_for_slowest_s",)
"""Metrics that mean something only with two ranks or more: a one-rank run's values of them (0, from
trainers that still reported them) are left out of its charts and the table, so it never wins them."""
RANK_METRICS = ("rank_samples_per_s", "rank_step_time_s", "rank_data_wait_s", "rank_compute_s", "rank_sync_wait_s")
"""The trainer's per-rank series charted one line per rank (the stage fields are constants, not series)."""
_ACROSS = {across_ranks_name(name, stat): (name, stat) for name in RANK_METRICS for stat in ACROSS_RANKS}
"""The statistics' series names → (per-rank metric, statistic)."""

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
    from a queryset, so a filter matching thousands of jobs costs no more than one matching 21. An ordered
    queryset's head is read as a job list page is (:func:`jobs.pagination.page_rows`: a filter sorted by a
    metric reads that metric's index, not every matching job's JSON)."""
    if hasattr(jobs, "filter"):
        head = pagination.page_rows(jobs, 0, MAX_COMPARED_JOBS + 1) if jobs.ordered else list(jobs[:MAX_COMPARED_JOBS + 1])
    else:
        head = list(jobs)
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


def _points_of(jobs: Sequence[TrainingJob], max_points: int = MAX_POINTS_PER_SERIES
               ) -> tuple[dict, dict, dict, dict, dict[int, float]]:
    """``(series, rank_series, rank_stats, stats, t0)`` of the jobs: each series, global and per rank
    (:data:`RANK_METRICS`; a line per rank only for jobs of at most :data:`MAX_RANK_LINES` ranks;
    ``rank_stats[name][job_id]`` the min, median and max across the job's ranks, as on the job page),
    as ``{"x": step, "y": value, "t": unix s}`` points at most about
    ``max_points`` a line (buckets with their ``min``/``max`` band past that: :func:`jobs.metric_buckets.read_series`);
    ``stats[name][job_id]`` its final and best value; ``t0[job_id]`` the time of the job's first
    point. A one-rank job's :data:`MULTI_RANK_METRICS` are left out. One query for the summaries of
    all the jobs, then two a job (its global and its per-rank lines), each reading at most
    ``max_points`` + 1 rows a line whatever the run's length."""
    job_ids = [job.pk for job in jobs]
    one_rank = {job.pk for job in jobs if job.world_size <= 1}
    summary = metric_buckets.summaries(job_ids)
    stats: dict[str, dict[int, dict[str, Any]]] = {}
    t0: dict[int, float] = {}
    ends: dict[tuple[int, bool], int] = {}
    # Each job's global series by name (from its summaries): the line read then probes the index name by
    # name instead of scanning every series of the job at that width (64 ranks: 339 series for 6 lines).
    global_names: dict[int, list[str]] = {}
    for (job_id, name, rank), agg in summary.items():
        if (job_id in one_rank and name in MULTI_RANK_METRICS) or name in metric_store.HARDWARE_NAMES:
            continue
        if rank is None and ACROSS_SEPARATOR not in name:
            global_names.setdefault(job_id, []).append(name)
        t = round(agg.first_at.timestamp(), 3)
        t0[job_id] = min(t0.get(job_id, t), t)
        per_rank = rank is not None
        if per_rank and name not in RANK_METRICS:
            continue
        ends[(job_id, per_rank)] = max(ends.get((job_id, per_rank), -1), agg.last_step)
        if per_rank:
            continue
        direction = metric_direction(name)
        best = None if direction is None else agg.min_value if direction == "min" else agg.max_value
        stats.setdefault(name, {})[job_id] = {"final": agg.last_value, "best": best}
    series: dict[str, dict[str, list[dict[str, Any]]]] = {}
    rank_series: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    rank_stats: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    many_ranks = {job.pk for job in jobs if job.world_size > MAX_RANK_LINES}
    finest = {job.pk: metric_retention.finest_width(job) for job in jobs}
    for job_id in job_ids:
        skip = MULTI_RANK_METRICS if job_id in one_rank else ()
        if (job_id, False) in ends:
            _, lines = metric_buckets.read_series(job_id, names=sorted(global_names.get(job_id, ())), per_rank=False,
                                                  end=ends[(job_id, False)], max_points=max_points, exclude=skip,
                                                  min_width=finest[job_id])
            for (name, _), points in lines.items():
                series.setdefault(name, {})[str(job_id)] = points
        if (job_id, True) in ends:
            few = job_id not in many_ranks
            _, lines = metric_buckets.read_series(job_id, names=[*_ACROSS, *(RANK_METRICS if few else ())],
                                                  per_rank=None if few else False, end=ends[(job_id, True)],
                                                  max_points=min(max_points, MAX_POINTS_PER_RANK_LINE),
                                                  min_width=finest[job_id])
            for (name, rank), points in lines.items():
                if name in _ACROSS:
                    metric, stat = _ACROSS[name]
                    rank_stats.setdefault(metric, {}).setdefault(str(job_id), {})[stat] = points
                else:
                    rank_series.setdefault(name, {}).setdefault(str(job_id), {})[str(rank)] = points
    return series, rank_series, rank_stats, stats, t0


def training_job_chart_series(*, job: TrainingJob, after: int | None = None, widths: Sequence[int] | None = None,
                              attempt: int | None = None, steps: tuple[int, int] | None = None) -> dict[str, Any]:
    """The job page's chart data: ``{"series": {name: [{"x": step, "y": value, "t": unix s}]},
    "rank_series": {name: {"<rank>": [points]}}, "t0": unix s of its first point or None,
    "names": [global names], "last_step": int (-1 without points), "attempt": int,
    "widths": [global, per rank], "from_step": [global, per rank], "replace": bool,
    "rank_lines": bool, "rank_stats": {name: {"min" | "median" | "max": [points]}},
    "slowest_rank": {name: rank}, "counts": {name: points}, "rank_total": points}``; each line at
    most about :data:`MAX_POINTS_PER_SERIES` points (:data:`MAX_POINTS_PER_RANK_LINE` a per-rank line),
    read as buckets (with ``min``/``max``) past that (:mod:`jobs.metric_buckets`).

    A poll passes what its page holds: ``after`` (its ``last_step``), ``widths`` and ``attempt``.
    It then gets only the points from ``from_step`` on (the start of the bucket holding ``after``, or
    ``after`` itself at width 1), at the page's widths, to put in place of its own points at those
    steps and after (``replace`` False); every point again (``replace`` True)
    when the run has outgrown the page's widths, a resumed attempt redid steps, or the page's
    figures do not fit. Reads the series' summaries (one row a series), then each line's new rows.

    ``counts`` ``{global name: points}`` and ``rank_total`` (points of the ranks' lines, when sent,
    and of the statistics): how many points the lines hold in all, so a page can add what a poll sent
    to what it kept and compare (the job page's ``totals``: a point stored late at a step before
    ``from_step``, a script's ``report.log`` of an earlier step, makes them differ, and the page reads
    every line again).

    Per-rank metrics: ``rank_stats`` holds, for each, its min, median and max across ranks step by
    step (one line each, from the sync's statistics; none for runs stored before them) and
    ``slowest_rank`` the rank whose mean is the worst (:func:`slowest_ranks`). ``rank_series`` holds
    a line per rank only while ``rank_lines`` (at most :data:`MAX_RANK_LINES` ranks); a larger job's
    page draws the statistics alone.

    ``steps`` ``(first, last)``: only that range of steps, read at the resolution it needs on its own
    (a zoomed chart: the points themselves once the range holds at most a chart's worth of steps);
    the answer has ``"steps": [first, last]`` and ``replace`` True."""
    summary = metric_buckets.summaries([job.pk], across=True)
    one_rank = job.world_size <= 1
    rank_lines = job.world_size <= MAX_RANK_LINES
    t0: float | None = None
    ends = [-1, -1]
    counts: dict[str, int] = {}
    rank_total = 0
    names: set[str] = set()
    for (_, name, rank), agg in summary.items():
        if (one_rank and name in MULTI_RANK_METRICS) or name in metric_store.HARDWARE_NAMES:
            continue  # the hardware series: training_job_hardware_series
        if name in _ACROSS:
            rank_total += agg.count
            continue
        if rank is None:
            counts[name] = agg.count
        elif name in RANK_METRICS and rank_lines:
            rank_total += agg.count
        t = round(agg.first_at.timestamp(), 3)
        t0 = t if t0 is None else min(t0, t)
        per_rank = rank is not None
        if per_rank and name not in RANK_METRICS:
            continue
        ends[per_rank] = max(ends[per_rank], agg.last_step)
        if not per_rank:
            names.add(name)
    first = 0
    if steps is not None:
        first = max(0, int(steps[0]))
        ends = [min(end, int(steps[1])) for end in ends]
        after = None  # a range is read whole
    finest = metric_retention.finest_width(job)
    needed = [max(metric_buckets.width_for(ends[0] - first + 1, MAX_POINTS_PER_SERIES), finest),
              max(metric_buckets.width_for(ends[1] - first + 1, MAX_POINTS_PER_RANK_LINE), finest)]
    allowed = (1, *metric_buckets.WIDTHS)
    replace = not (after is not None and widths is not None and len(widths) == 2 and attempt == job.attempt
                   and 0 <= after <= max(ends) and all(w in allowed and w >= n for w, n in zip(widths, needed)))
    use = needed if replace else [int(w) for w in widths]
    # From the page's last step itself: a point stored later at that step (a script's second
    # report.log of the step, a name first reported there) still reaches the page.
    starts = [first, first] if replace else [(after // w) * w for w in use]
    out: dict[str, Any] = {"series": {}, "rank_series": {}, "t0": t0, "names": sorted(names),
                           "last_step": max(ends), "attempt": job.attempt, "widths": use, "from_step": starts,
                           "replace": replace, "counts": counts, "rank_total": rank_total}
    if steps is not None:
        out["steps"] = [first, int(steps[1])]
    skip = MULTI_RANK_METRICS if one_rank else ()
    if ends[0] >= starts[0]:
        _, lines = metric_buckets.read_series(job.pk, names=None, per_rank=False, start=starts[0], end=ends[0],
                                              exclude=skip, width=use[0])
        out["series"] = {name: points for (name, _), points in lines.items()}
    out["rank_lines"] = rank_lines
    out["slowest_rank"] = slowest_ranks(summary)
    out["rank_stats"] = {}
    if ends[1] >= starts[1]:
        # One read: the statistics across ranks (global series), with the lines of each rank beside
        # them while the job has few enough ranks.
        wanted = [*_ACROSS, *(RANK_METRICS if out["rank_lines"] else ())]
        _, lines = metric_buckets.read_series(job.pk, names=wanted, per_rank=None if out["rank_lines"] else False,
                                              start=starts[1], end=ends[1], width=use[1])
        for (name, rank), points in lines.items():
            if name in _ACROSS:
                metric, stat = _ACROSS[name]
                out["rank_stats"].setdefault(metric, {})[stat] = points
            else:
                out["rank_series"].setdefault(name, {})[str(rank)] = points
    return out


def training_job_hardware_series(*, job: TrainingJob, max_points: int = MAX_POINTS_PER_RANK_LINE) -> dict[str, Any]:
    """The job page's hardware charts (:mod:`trainer_pkg.hardware`, sampled by the launcher):
    ``{"series": {name: {"<index>": [{"x": Unix s, "y": value, "t": Unix s}, ...]}}, "t0": Unix s of
    the first sample or None, "lines": bool}``; the index is the rank (``sys/cpu_pct``,
    ``sys/rss_mb``, ``sys/gpu_*``) or the node (``sys/net_*``, ``sys/disk_*``). A line holds at
    most about ``max_points`` points, buckets of seconds with their ``min``/``max`` band past that
    (:func:`jobs.metric_buckets.read_series`): one summary query and one read a poll, however long the
    run. A job of more than :data:`MAX_RANK_LINES` ranks gets no lines (``lines`` False: the
    series are stored, its page says so)."""
    summary = metric_buckets.summaries([job.pk], names=metric_store.HARDWARE_NAMES, per_rank=True)
    out: dict[str, Any] = {"series": {}, "t0": None, "lines": job.world_size <= MAX_RANK_LINES}
    if not summary:
        return out
    first = min(agg.first_step for agg in summary.values())
    last = max(agg.last_step for agg in summary.values())
    out["t0"] = round(min(agg.first_at.timestamp() for agg in summary.values()), 3)
    if not out["lines"]:
        return out
    _, lines = metric_buckets.read_series(job.pk, names=metric_store.HARDWARE_NAMES, per_rank=True, start=first,
                                          end=last, max_points=max_points, min_width=metric_retention.finest_width(job))
    for (name, index), points in lines.items():
        out["series"].setdefault(name, {})[str(index)] = points
    return out


def slowest_ranks(summary: dict[tuple[int, str, int | None], Agg]) -> dict[str, int]:
    """``{per-rank metric: the rank whose mean over the run is the worst}`` from one job's
    :func:`jobs.metric_buckets.summaries` (of :data:`RANK_METRICS`, by :data:`OWN_DIRECTIONS`: the lowest
    samples/s, the highest step, data-wait, compute and sync-wait time); the lowest rank among equals.
    A metric with no finite value at two ranks or more names none."""
    means: dict[str, list[tuple[float, int]]] = {}
    for (_, name, rank), agg in summary.items():
        if rank is None or name not in RANK_METRICS or agg.sum_value is None:
            continue
        finite = agg.count - agg.nonfinite
        if finite > 0:
            means.setdefault(name, []).append((agg.sum_value / finite, rank))
    worst = {}
    for name, ranked in means.items():
        if len(ranked) < 2:
            continue
        sign = 1 if OWN_DIRECTIONS[name] == "max" else -1  # best high: the slowest is the lowest
        worst[name] = min(ranked, key=lambda mean_rank: (sign * mean_rank[0], mean_rank[1]))[1]
    return worst


def training_job_comparison(*, jobs: Sequence[TrainingJob]) -> dict[str, Any]:
    """Everything a comparison of ``jobs`` shows (jobs the caller has scoped to the user; in order).

    ``{"runs": [{"id", "name", "state", "t0"}], "metrics": [{"name", "direction", "kind", "per_rank"}],
    "table": [{"job_id", "values": {name: {"final", "best"}}}], "best": {name: {"final": job_id, "best": job_id}},
    "config": [rows of :func:`config_diff`], "direction_rule": text,
    "series": {name: {"<job id>": [{"x": step, "y": value, "t": unix s}]}},
    "rank_series": {name: {"<job id>": {"<rank>": [points]}}},
    "rank_stats": {name: {"<job id>": {"min" | "median" | "max": [points]}}}}``.

    ``t0``: unix seconds of the run's first point (None without points), what the charts' relative
    time counts from. ``y`` is None where the trainer reported NaN or infinity. ``final``: the value at
    the run's last step; ``best``: its min or max over every point (:func:`metric_direction`); both None
    where the run has no finite point of that metric. ``best`` names, per column, the run with the best
    value (the first of equals; None when no run has one, or for a metric without a direction). Only
    global metrics are in the table; per-rank ones (:data:`RANK_METRICS`) are charted one line per rank
    (a run of more than :data:`MAX_RANK_LINES` ranks: its median across ranks with a min–max band).
    A one-rank run has no value of :data:`MULTI_RANK_METRICS` (nothing waits for a slowest rank): it
    shows none and never wins them. One query for the summaries, then two a run, each line at most
    about :data:`MAX_POINTS_PER_SERIES` rows (:data:`MAX_POINTS_PER_RANK_LINE` a per-rank line).
    """
    job_ids = [job.pk for job in jobs]
    series, rank_series, rank_stats, stats, t0 = _points_of(jobs)
    names = _metric_order(list(series) + list(rank_series) + [n for n in rank_stats if n not in rank_series])
    per_rank = set(rank_series) | set(rank_stats)
    metrics = [{"name": n, "direction": metric_direction(n), "kind": metric_kind(n), "per_rank": n in per_rank}
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
        "series": {n: series[n] for n in names if n in series},
        "rank_series": {n: rank_series[n] for n in names if n in rank_series},
        "rank_stats": {n: rank_stats[n] for n in names if n in rank_stats},
    }


def ids_problem(exc: ValidationError) -> list[str]:
    """The messages of a :func:`parse_job_ids` error, for a page that shows them."""
    return [m for ms in exc.message_dict.values() for m in ms]
