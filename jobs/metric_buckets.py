"""Metric series at any length: points folded into buckets as they are stored, read at a chart's
resolution (:class:`jobs.models.MetricBucket`).

Every point of a series (a job's ``name`` at one ``rank``, or global) is counted once at each stored
level (:data:`STORED_WIDTHS`; the finest chart level, 16, is folded from the raw points when read): in the bucket ``step // width`` of that width, which keeps the count, the
non-finite count, min, max and sum of the finite values and the last point (highest step). A range
of steps is then read at the finest level that gives at most ``max_points`` buckets, so a chart of a
week-long run reads as many rows as one of a minute-long run, and a loss spike or a NaN stays
visible in its bucket's min–max band and gap marker where even sampling would drop it. Ranges of
few points are read from the points themselves (:mod:`jobs.metric_store`: chunks and rows). The widest level has one bucket
per series for any run under 16.7M steps: it is the series' summary (last value, min, max, sum).

Storing points folds them (:mod:`jobs.metric_fold`, which ``MetricPoint.objects.bulk_create`` calls):
one ``INSERT ... ON CONFLICT DO UPDATE`` per chunk of buckets (PostgreSQL and SQLite), merging with
what earlier passes stored without reading it. A resumed run's superseded steps are cut with
:func:`drop_from`. Imports models, :mod:`jobs.metric_fold` and :mod:`jobs.metric_store` only.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Sequence
from typing import Any

from django.db import connection, transaction
from django.db.models import Max, Q

from jobs import metric_store
from jobs.metric_fold import (ACROSS_SEPARATOR, GLOBAL_RANK, MAX_CHART_POINTS, STORED_WIDTHS, TOP, WIDTHS, Agg, Key,
                              fold, upsert)
from jobs.models import MetricBucket, MetricPoint

def drop_from(job_id: int, step: int) -> None:
    """Remove every point at ``step`` or later from the job's points (rows and chunks,
    :func:`jobs.metric_store.drop_from`) and from its buckets (a resumed run redoes those steps), in
    one transaction. The bucket holding ``step`` at each stored level is rebuilt from what is below
    it: the points at the finest stored level, the finer level's buckets above it. The hardware
    series (:data:`jobs.metric_store.HARDWARE_NAMES`, stepped by the clock) are left as they are."""
    kept = metric_store.HARDWARE_NAMES
    with transaction.atomic():
        metric_store.drop_from(job_id, step)
        cut = Q()
        for width in STORED_WIDTHS:
            cut |= Q(width=width, bucket__gte=step // width)
        MetricBucket.objects.filter(job_id=job_id).filter(cut).exclude(name__in=kept).delete()
        first = STORED_WIDTHS[0]
        base = (step // first) * first
        level: dict[Key, Agg] = {}
        if base < step:
            for (name, rank), series in metric_store.points(job_id, start=base, end=step - 1, exclude=kept).items():
                level.update(metric_store.fold_arrays(name, rank, series, (first,)))
        upsert(job_id, level)
        for finer, width in zip(STORED_WIDTHS, STORED_WIDTHS[1:]):
            below = (MetricBucket.objects.filter(job_id=job_id, width=finer,
                                                 bucket__gte=(step // width) * (width // finer))
                     .exclude(name__in=kept).order_by("bucket"))
            rebuilt: dict[tuple[str, int, int], Agg] = {}
            for row in below:
                key = (row.name, row.rank, row.bucket // (width // finer))
                if key in rebuilt:
                    rebuilt[key].add(Agg.of_row(row))
                else:
                    rebuilt[key] = Agg.of_row(row)
            upsert(job_id, {(n, r, width, b): a for (n, r, b), a in rebuilt.items()})


def rebuild(job_id: int) -> int:
    """The job's buckets computed again from all its points, rows and chunks (a repair); returns the
    points read."""
    with transaction.atomic():
        MetricBucket.objects.filter(job_id=job_id).delete()
        done = 0
        for (name, rank), series in metric_store.points(job_id).items():
            upsert(job_id, metric_store.fold_arrays(name, rank, series))
            done += len(series)
        return done


def fold_stored_points(job_id: int, point_model: Any = MetricPoint, chunk: int = 200_000) -> int:
    """Fold every stored point row of the job into its buckets, reading ``chunk``-sized keyset pages
    in stored order; returns the number of points read. ``point_model``: a migration's historical
    ``MetricPoint`` (migration 0029 ran before chunks existed: the rows were every point then)."""
    done, after = 0, 0
    while True:
        page = list(point_model.objects.filter(job_id=job_id, id__gt=after).order_by("id")
                    .values_list("id", "name", "rank", "step", "value", "epoch", "recorded_at")[:chunk])
        if not page:
            return done
        upsert(job_id, fold(row[1:] for row in page))
        done += len(page)
        after = page[-1][0]


# -- reading -------------------------------------------------------------------------------------


def width_for(span_steps: int, max_points: int = MAX_CHART_POINTS) -> int:
    """The finest level whose buckets over ``span_steps`` steps number at most ``max_points``; 1
    (the points themselves) when the span has at most ``max_points`` steps."""
    if span_steps <= max_points:
        return 1
    for width in WIDTHS:
        if math.ceil(span_steps / width) + 1 <= max_points:
            return width
    return TOP


def _seconds(when: dt.datetime) -> float:
    return round(when.timestamp(), 3)


def summaries(job_ids: Sequence[int], *, names: Sequence[str] | None = None,
              per_rank: bool | None = None, across: bool = False) -> dict[tuple[int, str, int | None], Agg]:
    """``{(job id, name, rank or None): the series' fold}`` from the summary level: one row per
    series for runs under :data:`TOP` steps. ``per_rank`` True: per-rank series only, False: global
    only, None: both. ``names`` None: every reported name, and the statistics across ranks
    (``metric_fold.across_ranks_name``) only with ``across``."""
    rows = MetricBucket.objects.filter(job_id__in=list(job_ids), width=TOP)
    if names is not None:
        rows = rows.filter(name__in=list(names))
    elif not across:
        rows = rows.exclude(name__contains=ACROSS_SEPARATOR)
    if per_rank is True:
        rows = rows.filter(rank__gte=0)
    elif per_rank is False:
        rows = rows.filter(rank=GLOBAL_RANK)
    out: dict[tuple[int, str, int | None], Agg] = {}
    # Tuples of the fold's columns, not model instances (a comparison of 10 runs of 64 ranks reads 3,390).
    for job_id, name, rank, *fold in rows.order_by("job_id", "name", "rank", "bucket").values_list(
            "job_id", "name", "rank", *_AGG_FIELDS):
        key = (job_id, name, None if rank == GLOBAL_RANK else rank)
        if key in out:
            out[key].add(Agg(*fold))
        else:
            out[key] = Agg(*fold)
    return out


def recent_means(job_id: int, name: str, *, buckets: int = 2) -> dict[int, float]:
    """``{rank: mean of its finite values}`` of the per-rank series ``name`` over its recent points: the
    last ``buckets`` buckets of the finest stored level (256 steps; for the hardware series, whose steps
    are Unix seconds, 256 s), counted back from the newest bucket of any rank. A rank with no finite
    value there is left out. Two queries of at most ``buckets`` + 1 rows a rank (the newest step from the
    summary level, then the buckets), whatever the run's length."""
    width = STORED_WIDTHS[0]
    last = (MetricBucket.objects.filter(job_id=job_id, name=name, width=TOP, rank__gte=0)
            .aggregate(last=Max("last_step"))["last"])
    if last is None:
        return {}
    newest = last // width
    rows = MetricBucket.objects.filter(job_id=job_id, name=name, width=width, rank__gte=0)
    sums: dict[int, list[float]] = {}
    for rank, total, count, nonfinite in (rows.filter(bucket__gt=newest - buckets)
                                          .values_list("rank", "sum_value", "count", "nonfinite")):
        if total is not None and count > nonfinite:
            acc = sums.setdefault(rank, [0.0, 0])
            acc[0] += total
            acc[1] += count - nonfinite
    return {rank: total / n for rank, (total, n) in sorted(sums.items())}


_AGG_FIELDS = tuple(f.name for f in dataclasses.fields(Agg))
"""``MetricBucket``'s columns that make an :class:`Agg`, in its order."""


def read_series(job_id: int, *, names: Sequence[str] | None, per_rank: bool | None, start: int = 0, end: int,
                max_points: int = MAX_CHART_POINTS, exclude: Sequence[str] = (),
                width: int | None = None, min_width: int = 1
                ) -> tuple[int, dict[tuple[str, int | None], list[dict[str, Any]]]]:
    """``(width, {(name, rank or None): points})``: the job's global (``per_rank`` False), per-rank
    (True) or both (None: the per-rank and global series of ``names`` in one read) series over steps ``start``..``end`` (inclusive; the last step is in :func:`summaries`), at most
    about ``max_points`` per line, in step order. ``names`` None: every reported name but ``exclude``
    (not the statistics across ranks: those are read by name). ``width``:
    read at that level (1: the points) instead of the one ``max_points`` gives (a poll that goes on
    at the page's resolution); ``min_width``: the finest level to read otherwise (a job whose points
    the operator's retention removed: ``jobs.metric_retention.finest_width``).

    A point is ``{"x": step, "y": value or None, "t": unix s}``; read from buckets (``width`` > 1) it is
    the bucket's last point with ``"min"`` and ``"max"`` (its finite values' range, None when none),
    ``"n"`` (points in it), and a bucket that holds a non-finite point among finite ones is preceded by a
    ``y`` None point at that step (the chart's gap). Reads at most ``max_points`` + 1 rows a line."""
    if end < start:
        return width or 1, {}
    width = width or max(width_for(end - start + 1, max_points), min_width)
    out: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
    if width == 1:
        for key, series in metric_store.points(job_id, names=names, exclude=exclude, per_rank=per_rank,
                                               reported_only=names is None, start=start, end=end).items():
            out[key] = [{"x": step, "y": value, "t": round(us / 1e6, 3)} for step, value, us in
                        zip(series.steps.tolist(), series.value_list(), series.at_us.tolist())]
        return 1, out
    if width not in STORED_WIDTHS:
        # A level not stored (16): folded from the range's raw points, whole buckets as stored ones are.
        first, stop = (start // width) * width, (end // width) * width + width - 1
        for (name, rank), series in metric_store.points(job_id, names=names, exclude=exclude, per_rank=per_rank,
                                                        reported_only=names is None, start=first, end=stop).items():
            line = out.setdefault((name, rank), [])
            folded = metric_store.fold_arrays(name, rank, series, (width,))
            for (_, _, _, _), agg in sorted(folded.items(), key=lambda item: item[0][3]):
                _bucket_points(line, agg)
        return width, out
    # One range read of the bucket key (job, width, name, rank, bucket), written as SQL and fetched as plain
    # tuples: a comparison of 10 long runs reads ~51,000 buckets, and the ORM's per-row work (model
    # instances, then named tuples with their converters) and parsing two timestamps a bucket were most of
    # its time (bench/RESULTS.md, issue 29). The times come as Unix seconds from the database, the first
    # point's only where the bucket draws a gap.
    where = ["job_id = %s", "width = %s", "bucket >= %s", "bucket <= %s"]
    params: list[Any] = [job_id, width, start // width, end // width]
    if per_rank is not None:
        where.append("rank >= 0" if per_rank else f"rank = {GLOBAL_RANK}")
    if names is not None:
        if not names:
            return width, out
        where.append(f"name IN ({', '.join(['%s'] * len(names))})")
        params += list(names)
    else:
        where.append(f"name NOT LIKE '%%{ACROSS_SEPARATOR}%%'")
    if exclude:
        where.append(f"name NOT IN ({', '.join(['%s'] * len(exclude))})")
        params += list(exclude)
    epoch = epoch_seconds_sql(connection.vendor)
    sql = (f"SELECT name, rank, first_nonfinite_step, CASE WHEN nonfinite > 0 AND last_value IS NOT NULL "
           f"THEN {epoch.format('first_at')} END, last_step, last_value, {epoch.format('last_at')}, min_value, "
           f"max_value, count FROM {MetricBucket._meta.db_table} WHERE {' AND '.join(where)} "
           f"ORDER BY name, rank, bucket")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    line: list[dict[str, Any]] = []
    key = None
    for name, rank, gap_step, gap_s, last_step, last_value, last_s, low, high, count in rows:
        if (name, rank) != key:
            key = (name, rank)
            line = out.setdefault((name, None if rank == GLOBAL_RANK else rank), [])
        if gap_s is not None:
            line.append({"x": gap_step, "y": None, "t": round(gap_s, 3)})
        line.append({"x": last_step, "y": last_value, "t": round(last_s, 3), "min": low, "max": high, "n": count})
    return width, out


def epoch_seconds_sql(vendor: str) -> str:
    """SQL for a ``DateTimeField`` column as Unix seconds (float), with ``{0}`` for the column: the value
    ``datetime.timestamp()`` gives for it, microseconds since 1970 ÷ 10**6 rounded once to a float.
    PostgreSQL: ``date_part('epoch', …)``, whose ``timestamptz`` form is exactly that division. SQLite
    (the column is the text ``YYYY-MM-DD HH:MM:SS[.ffffff]`` in UTC): the same division of the whole
    seconds, read without the fraction that ``strftime`` would round, and the microseconds written after
    them. ``%%`` is a ``%`` once the query runs with parameters, as Django's cursors run it."""
    if vendor == "postgresql":
        return "date_part('epoch', {0})"
    if vendor == "sqlite":
        return ("((CAST(strftime('%%s', substr({0}, 1, 19)) AS INTEGER) * 1000000"
                " + CAST(substr({0}, 21, 6) AS INTEGER)) / 1000000.0)")
    raise NotImplementedError(f"chart reads support PostgreSQL and SQLite, not {vendor}")


def _bucket_points(line: list[dict[str, Any]], b: Agg) -> None:
    """Append the fold ``b`` (a bucket folded from raw points) to a chart line: its last point
    with its band, preceded by a gap where it holds a non-finite point among finite ones (as a stored
    bucket's row in :func:`read_series`)."""
    if b.nonfinite and b.last_value is not None:
        line.append({"x": b.first_nonfinite_step, "y": None, "t": _seconds(b.first_at)})
    line.append({"x": b.last_step, "y": b.last_value, "t": _seconds(b.last_at),
                 "min": b.min_value, "max": b.max_value, "n": b.count})
