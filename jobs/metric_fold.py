"""Folding metric points into buckets (the part of :mod:`jobs.metric_buckets` that storing a point
needs): the levels, the fold, and the upsert that merges a fold into ``MetricBucket``'s table.

A leaf module: ``jobs.models`` calls :func:`store` when points are stored (``MetricPoint.objects.bulk_create``
and ``MetricPoint.save``), so this imports no model; it writes the table by its name.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import connection

BUCKET_TABLE = "jobs_metricbucket"
"""``jobs.models.MetricBucket``'s table (a test holds the two together)."""

WIDTHS = (16, 256, 4096, 65536, 1048576, 16777216)
"""Steps per bucket at each level a chart is read at, finest first: each 16 times the one before."""
STORED_WIDTHS = WIDTHS[1:]
"""The levels stored in ``MetricBucket``. The finest, 16, is not: at one point a step it was one bucket
row (~300 bytes with its index) per 16 points, ≈ 19 bytes a point by itself (bench/RESULTS.md), more
than the raw points cost in chunks (``jobs.metric_store``); a chart read at width 16 spans at most 32,000 steps and folds
the raw points of its range instead (``jobs.metric_buckets.read_series``)."""
TOP = WIDTHS[-1]
"""The summary level: one bucket per series for runs shorter than 16,777,216 steps."""
GLOBAL_RANK = -1
"""``MetricBucket.rank`` of a global series (``MetricPoint.rank`` None)."""
MAX_CHART_POINTS = 2000
"""Points per line a chart gets at most (a bucket is one point with its band)."""
UPSERT_CHUNK = 500
"""Buckets per INSERT statement."""
ACROSS_RANKS = ("min", "median", "max")
"""The statistics across ranks stored beside a per-rank series, one global point each per step:
``rank_step_time_s:max`` is the slowest rank's step time at each step (:func:`across_ranks_name`).
A chart of hundreds of ranks draws these three lines instead of a line per rank."""
ACROSS_SEPARATOR = ":"
"""Joins a per-rank series' name and a statistic; no trainer or user metric name holds it
(``trainer_pkg.metrics.USER_METRIC_NAME``), so these names never collide with a reported one."""


def across_ranks_name(name: str, stat: str) -> str:
    """The global series holding ``stat`` (one of :data:`ACROSS_RANKS`) of the per-rank series
    ``name`` across its ranks, step by step: ``across_ranks_name("rank_step_time_s", "max")`` is
    ``"rank_step_time_s:max"``."""
    return f"{name}{ACROSS_SEPARATOR}{stat}"


def is_across_ranks(name: str) -> bool:
    """Whether ``name`` is a statistic across ranks (:func:`across_ranks_name`), not a reported metric."""
    return ACROSS_SEPARATOR in name


@dataclasses.dataclass
class Agg:
    """The fold of some points of one series (the fields of :class:`~jobs.models.MetricBucket`)."""

    count: int
    nonfinite: int
    first_nonfinite_step: int | None
    min_value: float | None
    max_value: float | None
    sum_value: float | None
    first_step: int
    last_step: int
    last_value: float | None
    last_epoch: int | None
    first_at: dt.datetime
    last_at: dt.datetime

    @classmethod
    def point(cls, step: int, value: float | None, epoch: int | None, at: dt.datetime) -> Agg:
        """One point; ``value`` None: it was NaN or infinite."""
        bad = value is None
        return cls(1, int(bad), step if bad else None, value, value, value, step, step, value, epoch, at, at)

    @classmethod
    def of_row(cls, row: Any) -> Agg:
        """The fold a ``MetricBucket`` row holds."""
        return cls(*(getattr(row, f.name) for f in dataclasses.fields(cls)))

    def add(self, later: Agg) -> None:
        """Fold ``later`` (points stored after this one's) in; at equal last steps ``later``'s last wins."""
        self.count += later.count
        self.nonfinite += later.nonfinite
        self.first_nonfinite_step = _least(self.first_nonfinite_step, later.first_nonfinite_step)
        self.min_value = _least(self.min_value, later.min_value)
        self.max_value = _greatest(self.max_value, later.max_value)
        self.sum_value = (later.sum_value if self.sum_value is None else
                          self.sum_value if later.sum_value is None else self.sum_value + later.sum_value)
        self.first_step = min(self.first_step, later.first_step)
        self.first_at = min(self.first_at, later.first_at)
        if later.last_step >= self.last_step:
            self.last_step, self.last_value = later.last_step, later.last_value
            self.last_epoch, self.last_at = later.last_epoch, later.last_at


def _least(a, b):
    return b if a is None else a if b is None else min(a, b)


def _greatest(a, b):
    return b if a is None else a if b is None else max(a, b)


Key = tuple[str, int, int, int]
"""(name, rank (:data:`GLOBAL_RANK` for a global series), width, bucket)."""


def fold(points: Iterable[tuple[str, int | None, int, float | None, int | None, dt.datetime]]) -> dict[Key, Agg]:
    """Every stored level's buckets (:data:`STORED_WIDTHS`) of ``points``, ``(name, rank or None, step,
    value or None, epoch, time)`` in the order they were stored."""
    first = STORED_WIDTHS[0]
    level: dict[tuple[str, int, int], Agg] = {}
    for name, rank, step, value, epoch, at in points:
        key = (name, GLOBAL_RANK if rank is None else rank, step // first)
        agg = level.get(key)
        if agg is None:
            level[key] = Agg.point(step, value, epoch, at)
        else:
            agg.add(Agg.point(step, value, epoch, at))
    out: dict[Key, Agg] = {(n, r, first, b): a for (n, r, b), a in level.items()}
    for finer, width in zip(STORED_WIDTHS, STORED_WIDTHS[1:]):
        coarser: dict[tuple[str, int, int], Agg] = {}
        ratio = width // finer
        for (n, r, b), agg in level.items():
            key = (n, r, b // ratio)
            if key in coarser:
                coarser[key].add(agg)
            else:
                coarser[key] = dataclasses.replace(agg)
        out.update({(n, r, width, b): a for (n, r, b), a in coarser.items()})
        level = coarser
    return out


def store(points: Sequence[Any]) -> None:
    """Fold ``points`` (just stored, in their order; any jobs') into their jobs' buckets.
    ``MetricPoint.objects.bulk_create`` and ``MetricPoint.save`` call it."""
    by_job: dict[int, list[MetricPoint]] = {}
    for p in points:
        by_job.setdefault(p.job_id, []).append(p)
    for job_id, mine in by_job.items():
        upsert(job_id, fold((p.name, p.rank, p.step, p.value, p.epoch, p.recorded_at) for p in mine))


_COLUMNS = ("job_id", "name", "rank", "width", "bucket", "count", "nonfinite", "first_nonfinite_step", "min_value",
            "max_value", "sum_value", "first_step", "last_step", "last_value", "last_epoch", "first_at", "last_at")


_PG_TYPES = ("bigint", "varchar", "integer", "integer", "bigint", "integer", "integer", "bigint", "double precision",
             "double precision", "double precision", "bigint", "bigint", "double precision", "integer",
             "timestamptz", "timestamptz")
"""PostgreSQL types of :data:`_COLUMNS`, for :func:`upsert`'s arrays."""


def _merge_sql(table: str) -> str:
    """The SET clause merging ``excluded`` (the later points) into the stored bucket, as :meth:`Agg.add`."""
    least, greatest = ("LEAST", "GREATEST") if connection.vendor == "postgresql" else ("MIN", "MAX")

    def nullsafe(fn: str, col: str) -> str:
        return f"{fn}(COALESCE({table}.{col}, excluded.{col}), COALESCE(excluded.{col}, {table}.{col}))"

    later = f"excluded.last_step >= {table}.last_step"
    sets = [f"count = {table}.count + excluded.count", f"nonfinite = {table}.nonfinite + excluded.nonfinite",
            f"first_nonfinite_step = {nullsafe(least, 'first_nonfinite_step')}",
            f"min_value = {nullsafe(least, 'min_value')}", f"max_value = {nullsafe(greatest, 'max_value')}",
            f"sum_value = CASE WHEN {table}.sum_value IS NULL THEN excluded.sum_value "
            f"WHEN excluded.sum_value IS NULL THEN {table}.sum_value ELSE {table}.sum_value + excluded.sum_value END",
            f"first_step = {least}({table}.first_step, excluded.first_step)",
            f"first_at = {least}({table}.first_at, excluded.first_at)"]
    sets += [f"{col} = CASE WHEN {later} THEN excluded.{col} ELSE {table}.{col} END"
             for col in ("last_value", "last_epoch", "last_at")]
    sets.append(f"last_step = CASE WHEN {later} THEN excluded.last_step ELSE {table}.last_step END")
    return ", ".join(sets)


def upsert(job_id: int, buckets: Mapping[Key, Agg]) -> None:
    """Merge ``buckets`` (folds of points stored after the job's stored ones) into the table."""
    if not buckets:
        return
    table = BUCKET_TABLE
    adapt = connection.ops.adapt_datetimefield_value
    head = (f"INSERT INTO {table} ({', '.join(_COLUMNS)}) VALUES ")
    tail = f" ON CONFLICT (job_id, width, name, rank, bucket) DO UPDATE SET {_merge_sql(table)}"
    row_sql = "(" + ", ".join(["%s"] * len(_COLUMNS)) + ")"
    items = list(buckets.items())
    if connection.vendor == "postgresql":
        # One statement of 17 array parameters, whatever the number of buckets: a VALUES list of
        # 500 rows is 8,500 placeholders for the driver to split and quote, a cost per bucket.
        columns: list[list[Any]] = [[] for _ in _COLUMNS]
        for (name, rank, width, bucket), a in items:
            for column, value in zip(columns, (job_id, name, rank, width, bucket, a.count, a.nonfinite,
                                               a.first_nonfinite_step, a.min_value, a.max_value, a.sum_value,
                                               a.first_step, a.last_step, a.last_value, a.last_epoch, a.first_at,
                                               a.last_at)):
                column.append(value)
        for column, kind in zip(columns, _PG_TYPES):
            if kind == "double precision":  # a value stored as an int (a stage number): one type a list
                column[:] = [None if v is None else float(v) for v in column]
        arrays = ", ".join(f"%s::{kind}[]" for kind in _PG_TYPES)
        with connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO {table} ({', '.join(_COLUMNS)}) SELECT * FROM unnest({arrays}){tail}",
                           columns)
        return
    with connection.cursor() as cursor:
        for start in range(0, len(items), UPSERT_CHUNK):
            chunk = items[start:start + UPSERT_CHUNK]
            params: list[Any] = []
            for (name, rank, width, bucket), a in chunk:
                params += [job_id, name, rank, width, bucket, a.count, a.nonfinite, a.first_nonfinite_step,
                           a.min_value, a.max_value, a.sum_value, a.first_step, a.last_step, a.last_value,
                           a.last_epoch, adapt(a.first_at), adapt(a.last_at)]
            cursor.execute(head + ", ".join([row_sql] * len(chunk)) + tail, params)
