"""Metric series at any length: points folded into buckets as they are stored, read at a chart's
resolution (:class:`jobs.models.MetricBucket`).

Every point of a series (a job's ``name`` at one ``rank``, or global) is counted once at each level
of :data:`WIDTHS`: in the bucket ``step // width`` of that width, which keeps the count, the
non-finite count, min, max and sum of the finite values and the last point (highest step). A range
of steps is then read at the finest level that gives at most ``max_points`` buckets, so a chart of a
week-long run reads as many rows as one of a minute-long run, and a loss spike or a NaN stays
visible in its bucket's min–max band and gap marker where even sampling would drop it. Ranges of
few points are read from the points themselves (``MetricPoint``). The widest level has one bucket
per series for any run under 16.7M steps: it is the series' summary (last value, min, max, sum).

Storing points folds them (:mod:`jobs.metric_fold`, which ``MetricPoint.objects.bulk_create`` calls):
one ``INSERT ... ON CONFLICT DO UPDATE`` per chunk of buckets (PostgreSQL and SQLite), merging with
what earlier passes stored without reading it. A resumed run's superseded steps are cut with
:func:`drop_from`. Imports models and :mod:`jobs.metric_fold` only.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from typing import Any

from django.db.models import Q

from jobs.metric_fold import ACROSS_SEPARATOR, GLOBAL_RANK, MAX_CHART_POINTS, TOP, WIDTHS, Agg, fold, upsert
from jobs.models import MetricBucket, MetricPoint

def drop_from(job_id: int, step: int) -> None:
    """Remove every point at ``step`` or later from the job's buckets (a resumed run redoes those
    steps; the caller has deleted the points themselves first). The bucket holding ``step`` at each
    level is rebuilt from what is below it: the points at the finest level, the finer level's
    buckets above it."""
    cut = Q()
    for width in WIDTHS:
        cut |= Q(width=width, bucket__gte=step // width)
    MetricBucket.objects.filter(job_id=job_id).filter(cut).delete()
    first = WIDTHS[0]
    base = (step // first) * first
    points = (MetricPoint.objects.filter(job_id=job_id, step__gte=base, step__lt=step).order_by("id")
              .values_list("name", "rank", "step", "value", "epoch", "recorded_at"))
    level = {(n, r, b): a for (n, r, w, b), a in fold(points).items() if w == first}
    upsert(job_id, {(n, r, first, b): a for (n, r, b), a in level.items()})
    for finer, width in zip(WIDTHS, WIDTHS[1:]):
        below = (MetricBucket.objects.filter(job_id=job_id, width=finer,
                                             bucket__gte=(step // width) * (width // finer))
                 .order_by("bucket"))
        rebuilt: dict[tuple[str, int, int], Agg] = {}
        for row in below:
            key = (row.name, row.rank, row.bucket // (width // finer))
            if key in rebuilt:
                rebuilt[key].add(Agg.of_row(row))
            else:
                rebuilt[key] = Agg.of_row(row)
        upsert(job_id, {(n, r, width, b): a for (n, r, b), a in rebuilt.items()})


def rebuild(job_id: int) -> int:
    """The job's buckets computed again from all its points (a repair); returns the points read."""
    MetricBucket.objects.filter(job_id=job_id).delete()
    return fold_stored_points(job_id)


def fold_stored_points(job_id: int, point_model: Any = MetricPoint, chunk: int = 200_000) -> int:
    """Fold every stored point of the job into its buckets, reading ``chunk``-sized keyset pages in
    stored order; returns the number of points read. ``point_model``: a migration's historical
    ``MetricPoint``."""
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
    for row in rows.order_by("job_id", "name", "rank", "bucket"):
        key = (row.job_id, row.name, None if row.rank == GLOBAL_RANK else row.rank)
        if key in out:
            out[key].add(Agg.of_row(row))
        else:
            out[key] = Agg.of_row(row)
    return out


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
        rows = MetricPoint.objects.filter(job_id=job_id, step__gte=start, step__lte=end)
        if per_rank is not None:
            rows = rows.filter(rank__isnull=False) if per_rank else rows.filter(rank__isnull=True)
        rows = rows.filter(name__in=list(names)) if names is not None else rows.exclude(name__contains=ACROSS_SEPARATOR)
        if exclude:
            rows = rows.exclude(name__in=list(exclude))
        for name, rank, step, value, at in (rows.order_by("name", "rank", "step", "id")
                                            .values_list("name", "rank", "step", "value", "recorded_at")):
            out.setdefault((name, rank), []).append({"x": step, "y": value, "t": _seconds(at)})
        return 1, out
    rows = MetricBucket.objects.filter(job_id=job_id, width=width, bucket__gte=start // width, bucket__lte=end // width)
    if per_rank is not None:
        rows = rows.filter(rank__gte=0) if per_rank else rows.filter(rank=GLOBAL_RANK)
    rows = rows.filter(name__in=list(names)) if names is not None else rows.exclude(name__contains=ACROSS_SEPARATOR)
    if exclude:
        rows = rows.exclude(name__in=list(exclude))
    for row in rows.order_by("name", "rank", "bucket"):
        line = out.setdefault((row.name, None if row.rank == GLOBAL_RANK else row.rank), [])
        if row.nonfinite and row.last_value is not None:
            line.append({"x": row.first_nonfinite_step, "y": None, "t": _seconds(row.first_at)})
        line.append({"x": row.last_step, "y": row.last_value, "t": _seconds(row.last_at),
                     "min": row.min_value, "max": row.max_value, "n": row.count})
    return width, out
