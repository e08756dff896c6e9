"""A job's raw metric points: compact chunks (``MetricChunk``) plus a hot tail of rows (``MetricPoint``),
read through one API.

Every trainer point is first a ``MetricPoint`` row (the write API: ``MetricPoint.objects.bulk_create``,
which folds it into its buckets). A series (a job's ``name`` at one ``rank``, or global) whose rows
reach :data:`CHUNK_POINTS` is compacted (:func:`compact`): its oldest rows, in step order, are sealed
into ``MetricChunk`` rows of exactly :data:`CHUNK_POINTS` points, encoded by :func:`encode`, and
deleted, in one transaction. A sync pass that brings a backlog (:data:`DIRECT_CHUNK_MIN` points or
more of one series in one provider ``logs`` call) writes them as chunks directly (:func:`store`) and
folds the buckets from arrays, with no ORM object per point. Short runs reach neither: their points
stay rows.

Readers never look at either table themselves: :func:`points` (a range of steps, every series or
some, in step order), :func:`last` and :func:`backwards` (newest first) merge the chunks and the
tail, each in one query (:func:`backwards`: one per page). :func:`drop_from` cuts a resumed run's
superseded steps from both (a chunk that straddles the step is rewritten). Order: points of a series
are in step order; at equal steps, in the order they were stored, as far as compaction keeps it
(a chunk's points come before the tail's at one step; a late point below a sealed chunk, e.g. a failed
record's ``nonfinite_step``, is merged by step).

A chunk's bytes (:func:`encode`): a 29-byte header (format, count, first step, first epoch, first time)
then zlib over five planes: step deltas, epoch deltas (-1 for none) and time deltas (µs) as int64,
the values' IEEE-754 bits XORed with the previous value's (float64, exact: NaN and -0.0 come back
bit for bit), all byte-shuffled (byte k of every number together, so the constant high bytes of
deltas and of a series' exponent compress to almost nothing), and the non-finite mask as bits.

Imports models and :mod:`jobs.metric_fold` only (:mod:`jobs.metric_buckets` builds on this).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import heapq
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from django.db import connection, models, transaction

from jobs.metric_fold import ACROSS_SEPARATOR, GLOBAL_RANK, STORED_WIDTHS, Agg, Key, upsert
from jobs.models import MetricChunk, MetricPoint
from trainer_pkg.hardware import GPU_FIELDS, NODE_FIELDS, RANK_FIELDS

CHUNK_POINTS = 4096
"""Points per sealed chunk: a series is compacted once its rows reach this many."""
DIRECT_CHUNK_MIN = 256
"""Points of one series in one stored batch from which :func:`store` writes them as chunks directly
(a backlog: a provider's ``logs`` call brings up to 2,000 lines) instead of rows; below it they are
rows until compaction. A chunk of this many points still costs a few bytes a point."""
COMPACT_MAX_CHUNKS = 16
"""Chunks one :func:`compact` call seals at most (65,536 rows: bounded work and memory per sync pass; the
rest waits for the next call)."""
FORMAT = 1
_HEAD = struct.Struct("<BIqqq")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_US = dt.timedelta(microseconds=1)
_NO_EPOCH = -1
_TIMESTAMP = ("datetime", "timestamp with time zone")
"""The type of ``recorded_at`` on SQLite and PostgreSQL (a typed NULL in :func:`last`)."""
_STEP_MAX = 2**62
"""Range bounds are clamped to this (a zoom query may ask past a bigint)."""

HARDWARE_NAMES = (*RANK_FIELDS, *GPU_FIELDS, *NODE_FIELDS)
"""The launcher's hardware series (:mod:`trainer_pkg.hardware`): per rank (or per node), their step the
sample's time in whole Unix seconds."""

SeriesKey = tuple[str, int | None]
"""(name, rank or None for a global series)."""
Point = tuple[str, int | None, int, float | None, int | None, dt.datetime]
"""(name, rank or None, step, value or None where not finite, epoch or None, recorded_at): one point
as the sync builds it, in the order of :func:`jobs.metric_fold.fold`'s input."""


# -- a series as arrays ---------------------------------------------------------------------------

@dataclasses.dataclass
class Series:
    """Points of one series as parallel arrays, each of shape ``(n,)``.

    ``steps`` int64; ``values`` float64 (0.0 where ``missing``); ``missing`` bool, True where the
    point's value is None (NaN/inf as reported); ``epochs`` int64, -1 where None; ``at_us`` int64,
    ``recorded_at`` in µs since 1970-01-01 UTC."""

    steps: np.ndarray
    values: np.ndarray
    missing: np.ndarray
    epochs: np.ndarray
    at_us: np.ndarray

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    @classmethod
    def empty(cls) -> Series:
        i = np.zeros(0, np.int64)
        return cls(i, np.zeros(0, np.float64), np.zeros(0, bool), i.copy(), i.copy())

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[int, float | None, int | None, Any]]) -> Series:
        """From ``(step, value or None, epoch or None, recorded_at)`` tuples (datetime, or the text
        SQLite returns), in their order."""
        n = len(rows)
        steps = np.fromiter((r[0] for r in rows), np.int64, n)
        missing = np.fromiter((r[1] is None for r in rows), bool, n)
        values = np.fromiter((0.0 if r[1] is None else r[1] for r in rows), np.float64, n)
        epochs = np.fromiter((_NO_EPOCH if r[2] is None else r[2] for r in rows), np.int64, n)
        return cls(steps, values, missing, epochs, np.array(_times_us(rows), np.int64).reshape(n))

    def take(self, index: Any) -> Series:
        """The points at ``index`` (a slice, a bool mask or positions), in that order."""
        return Series(self.steps[index], self.values[index], self.missing[index], self.epochs[index],
                      self.at_us[index])

    @staticmethod
    def concat(parts: Sequence[Series]) -> Series:
        if not parts:
            return Series.empty()
        if len(parts) == 1:
            return parts[0]
        return Series(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Series)))

    def by_step(self) -> Series:
        """Sorted by step; points at equal steps keep their order (stable)."""
        if len(self) < 2 or bool(np.all(self.steps[1:] >= self.steps[:-1])):
            return self
        return self.take(np.argsort(self.steps, kind="stable"))

    def within(self, start: int | None, end: int | None) -> Series:
        """The points with ``start`` <= step <= ``end`` (None: unbounded); assumes step order."""
        lo = 0 if start is None else int(np.searchsorted(self.steps, start, "left"))
        hi = len(self) if end is None else int(np.searchsorted(self.steps, end, "right"))
        return self if (lo, hi) == (0, len(self)) else self.take(slice(lo, hi))

    def value_list(self) -> list[float | None]:
        return [None if m else v for v, m in zip(self.values.tolist(), self.missing.tolist())]

    def rows(self) -> Iterator[tuple[int, float | None, int | None, dt.datetime]]:
        """``(step, value or None, epoch or None, recorded_at)`` per point, in order."""
        for step, value, epoch, us in zip(self.steps.tolist(), self.value_list(), self.epochs.tolist(),
                                          self.at_us.tolist()):
            yield step, value, None if epoch == _NO_EPOCH else epoch, from_us(us)


def _times_us(rows: Sequence[tuple]) -> list[int]:
    """:func:`to_us` of each row's ``[3]``; the points of one record share their time object, converted once."""
    out, last, last_us = [], None, 0
    for row in rows:
        at = row[3]
        if at is not last:
            last, last_us = at, to_us(at)
        out.append(last_us)
    return out


def to_us(when: Any) -> int:
    """µs since 1970-01-01 UTC of a datetime (naive: UTC) or of the ISO text SQLite gives a raw query."""
    if isinstance(when, str):
        when = dt.datetime.fromisoformat(when)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return (when - _EPOCH) // _US


def from_us(us: int) -> dt.datetime:
    return _EPOCH + dt.timedelta(microseconds=us)


# -- the chunk format -----------------------------------------------------------------------------

def _shuffle(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, "<i8").view(np.uint8).reshape(-1, 8).T.tobytes()


def _unshuffle(buf: memoryview, n: int) -> np.ndarray:
    return np.ascontiguousarray(np.frombuffer(buf, np.uint8, 8 * n).reshape(8, n).T).view("<i8").reshape(n)


def _deltas(a: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    out[0] = 0
    np.subtract(a[1:], a[:-1], out=out[1:])
    return out


def encode(series: Series, level: int = 6) -> bytes:
    """The bytes of a chunk holding ``series`` (at least one point, in step order). Exact: :func:`decode`
    gives back every array bit for bit."""
    n = len(series)
    if n == 0:
        raise ValueError("a chunk holds at least one point")
    bits = np.where(series.missing, 0.0, series.values).astype("<f8").view("<i8")
    xored = bits.copy()
    np.bitwise_xor(bits[1:], bits[:-1], out=xored[1:])
    body = b"".join((_shuffle(_deltas(series.steps)), _shuffle(_deltas(series.epochs)),
                     _shuffle(_deltas(series.at_us)), _shuffle(xored), np.packbits(series.missing).tobytes()))
    head = _HEAD.pack(FORMAT, n, int(series.steps[0]), int(series.epochs[0]), int(series.at_us[0]))
    return head + zlib.compress(body, level)


def decode(data: bytes | memoryview) -> Series:
    """The points of a chunk (:func:`encode`'s inverse). Raises ValueError on bytes it did not write."""
    data = bytes(data)
    if len(data) < _HEAD.size:
        raise ValueError("not a metric chunk: too short")
    fmt, n, step0, epoch0, at0 = _HEAD.unpack_from(data)
    if fmt != FORMAT:
        raise ValueError(f"metric chunk format {fmt} is not {FORMAT}")
    body = memoryview(zlib.decompress(data[_HEAD.size:]))
    if len(body) != 32 * n + (n + 7) // 8:
        raise ValueError("metric chunk: body length does not match its count")
    steps = np.cumsum(_unshuffle(body[0:8 * n], n)) + step0
    epochs = np.cumsum(_unshuffle(body[8 * n:16 * n], n)) + epoch0
    at_us = np.cumsum(_unshuffle(body[16 * n:24 * n], n)) + at0
    values = np.bitwise_xor.accumulate(_unshuffle(body[24 * n:32 * n], n)).view("<f8").astype(np.float64)
    missing = np.unpackbits(np.frombuffer(body[32 * n:], np.uint8), count=n).astype(bool)
    return Series(steps.astype(np.int64), values, missing, epochs.astype(np.int64), at_us.astype(np.int64))


def _chunk_fields(job_id: int, name: str, rank: int | None, series: Series) -> dict[str, Any]:
    return {"job_id": job_id, "name": name, "rank": GLOBAL_RANK if rank is None else rank,
            "first_step": int(series.steps[0]), "last_step": int(series.steps[-1]), "count": len(series),
            "data": encode(series)}


def _chunk(job_id: int, name: str, rank: int | None, series: Series) -> MetricChunk:
    return MetricChunk(**_chunk_fields(job_id, name, rank, series))


# -- reading --------------------------------------------------------------------------------------

def _clamp(step: int | None) -> int | None:
    return None if step is None else max(-1, min(int(step), _STEP_MAX))


def _filters(*, names: Sequence[str] | None, exclude: Sequence[str], per_rank: bool | None,
             ranks: Sequence[int] | None, reported_only: bool, chunk: bool) -> tuple[str, list[Any]]:
    sql, params = "", []
    if reported_only:
        sql += " AND name NOT LIKE %s"
        params.append(f"%{ACROSS_SEPARATOR}%")
    if names is not None:
        names = list(names) or [""]
        sql += f" AND name IN ({', '.join(['%s'] * len(names))})"
        params += names
    if exclude:
        sql += f" AND name NOT IN ({', '.join(['%s'] * len(exclude))})"
        params += list(exclude)
    if ranks is not None:
        wanted = [GLOBAL_RANK if r is None else int(r) for r in ranks] or [-2]
        if chunk:
            sql += f" AND rank IN ({', '.join(['%s'] * len(wanted))})"
            params += wanted
        else:
            real = [r for r in wanted if r >= 0] or [-2]
            sql += (f" AND (rank IN ({', '.join(['%s'] * len(real))})"
                    + (" OR rank IS NULL)" if GLOBAL_RANK in wanted else ")"))
            params += real
    if per_rank is True:
        sql += " AND rank >= 0" if chunk else " AND rank IS NOT NULL"
    elif per_rank is False:
        sql += f" AND rank = {GLOBAL_RANK}" if chunk else " AND rank IS NULL"
    return sql, params


def points(job_id: int, *, names: Sequence[str] | None = None, exclude: Sequence[str] = (),
           per_rank: bool | None = None, ranks: Sequence[int | None] | None = None, reported_only: bool = False,
           start: int | None = None, end: int | None = None) -> dict[SeriesKey, Series]:
    """``{(name, rank or None): Series}``: the job's points with ``start`` <= step <= ``end`` (inclusive;
    None: unbounded), from its chunks and its rows, each series in step order. ``names`` None: every
    name but ``exclude``; ``per_rank`` True: per-rank series only, False: global only; ``ranks``: only
    these ranks (None in it: the global series); ``reported_only``: not the statistics across ranks
    (``metric_fold.across_ranks_name``). One query; reads the chunks that overlap the range
    whole (at most :data:`CHUNK_POINTS` points more a series at each end)."""
    start, end = _clamp(start), _clamp(end)
    if start is not None and end is not None and end < start:
        return {}
    chunk_sql, chunk_params = _filters(names=names, exclude=exclude, per_rank=per_rank, ranks=ranks,
                                       reported_only=reported_only, chunk=True)
    row_sql, row_params = _filters(names=names, exclude=exclude, per_rank=per_rank, ranks=ranks,
                                   reported_only=reported_only, chunk=False)
    chunk_range, row_range, chunk_bounds, row_bounds = "", "", [], []
    if start is not None:
        chunk_range += " AND last_step >= %s"
        row_range += " AND step >= %s"
        chunk_bounds.append(start)
        row_bounds.append(start)
    if end is not None:
        chunk_range += " AND first_step <= %s"
        row_range += " AND step <= %s"
        chunk_bounds.append(end)
        row_bounds.append(end)
    sql = (f"SELECT 0, name, rank, first_step, NULL, NULL, NULL, data, id FROM {MetricChunk._meta.db_table} "
           f"WHERE job_id = %s{chunk_range}{chunk_sql} UNION ALL "
           f"SELECT 1, name, COALESCE(rank, {GLOBAL_RANK}), step, epoch, value, recorded_at, NULL, id "
           f"FROM {MetricPoint._meta.db_table} WHERE job_id = %s{row_range}{row_sql}")
    chunks: dict[SeriesKey, list[tuple[int, Any]]] = {}
    rows: dict[SeriesKey, list[tuple[int, int, Any, Any, Any]]] = {}
    with connection.cursor() as cursor:
        cursor.execute(sql, [job_id, *chunk_bounds, *chunk_params, job_id, *row_bounds, *row_params])
        for kind, name, rank, step, epoch, value, at, data, pk in cursor.fetchall():
            key = (name, None if rank == GLOBAL_RANK else rank)
            if kind == 0:
                chunks.setdefault(key, []).append((pk, data))
            else:
                rows.setdefault(key, []).append((pk, step, value, epoch, at))
    out: dict[SeriesKey, Series] = {}
    for key in sorted(set(chunks) | set(rows), key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        parts = [decode(data) for _, data in sorted(chunks.get(key, []), key=lambda c: c[0])]
        tail = sorted(rows.get(key, []), key=lambda r: r[0])
        if tail:
            parts.append(Series.from_rows([r[1:] for r in tail]))
        series = Series.concat(parts).by_step().within(start, end)
        if len(series):
            out[key] = series
    return out


def point_tuples(job_id: int, **filters: Any) -> list[Point]:
    """:func:`points` as ``(name, rank, step, value, epoch, recorded_at)`` tuples, series by series
    (name, then rank, global first), each in step order."""
    out: list[Point] = []
    for (name, rank), series in points(job_id, **filters).items():
        out.extend((name, rank, step, value, epoch, at) for step, value, epoch, at in series.rows())
    return out


def backwards(job_id: int, name: str, *, rank: int | None = None,
              page_chunks: int = 4, page_rows: int = 500) -> Iterator[tuple[int, float | None, int | None, dt.datetime]]:
    """The series' points newest first (step descending; at equal steps the later stored first):
    ``(step, value or None, epoch or None, recorded_at)``. Lazy: rows are fetched ``page_rows`` at a
    time (a server-side cursor on PostgreSQL) and chunks ``page_chunks`` at a time, so a reader that
    stops early reads only the newest part of a long history."""
    rank_filter = {"rank__isnull": True} if rank is None else {"rank": rank}
    tail = (MetricPoint.objects.filter(job_id=job_id, name=name, **rank_filter).order_by("-step", "-id")
            .values_list("step", "value", "epoch", "recorded_at").iterator(chunk_size=page_rows))

    def sealed() -> Iterator[tuple[int, float | None, int | None, dt.datetime]]:
        chunk_rank = GLOBAL_RANK if rank is None else rank
        below: tuple[int, int] | None = None
        while True:
            page = MetricChunk.objects.filter(job_id=job_id, name=name, rank=chunk_rank)
            if below is not None:
                page = page.filter(models.Q(last_step__lt=below[0]) | models.Q(last_step=below[0], id__lt=below[1]))
            page = list(page.order_by("-last_step", "-id").values_list("last_step", "id", "data")[:page_chunks])
            if not page:
                return
            for _, _, data in page:
                yield from reversed(list(decode(data).rows()))
            below = page[-1][:2]

    yield from heapq.merge(tail, sealed(), key=lambda p: p[0], reverse=True)


def last(job_id: int, name: str, *, rank: int | None = None) -> tuple[int, float | None, int | None, dt.datetime] | None:
    """The series' newest point ``(step, value or None, epoch or None, recorded_at)`` (the highest
    step; the later stored at equal steps), or None: its newest row and its newest chunk, one query."""
    chunk_rank = GLOBAL_RANK if rank is None else rank
    row_rank = "rank IS NULL" if rank is None else "rank = %s"
    # Typed NULLs: PostgreSQL makes an untyped one in a subquery text, which no other column unites with.
    # Each side is ordered by its own index ((job, name, step), (job, name, rank, last_step)): one row read.
    sql = (f"SELECT * FROM (SELECT 1 AS kind, step, epoch, value, recorded_at, "
           f"CAST(NULL AS bytea) AS data FROM {MetricPoint._meta.db_table} "
           f"WHERE job_id = %s AND name = %s AND {row_rank} ORDER BY step DESC, id DESC LIMIT 1) AS r UNION ALL "
           f"SELECT * FROM (SELECT 0 AS kind, last_step, CAST(NULL AS integer), CAST(NULL AS double precision), "
           f"CAST(NULL AS {_TIMESTAMP[connection.vendor == 'postgresql']}), data FROM {MetricChunk._meta.db_table} "
           f"WHERE job_id = %s AND name = %s AND rank = %s ORDER BY last_step DESC, id DESC LIMIT 1) AS c")
    params = [job_id, name, *([] if rank is None else [rank]), job_id, name, chunk_rank]
    best = None
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for kind, step, epoch, value, at, data in cursor.fetchall():
            if kind == 0:
                step, value, epoch, at = list(decode(data).rows())[-1]
            else:
                at = from_us(to_us(at))
            if best is None or step > best[0] or (step == best[0] and kind == 1):
                best = (step, value, epoch, at)
    return best


# -- writing --------------------------------------------------------------------------------------

def _rank_q(rank: int | None) -> dict[str, Any]:
    return {"rank__isnull": True} if rank is None else {"rank": rank}


def compact(job_id: int, keys: Iterable[SeriesKey] | None = None, *, max_chunks: int = COMPACT_MAX_CHUNKS,
            point_model: Any = MetricPoint, chunk_model: Any = MetricChunk) -> int:
    """Seal the oldest rows of the job's series (``keys``; None: every series holding at least
    :data:`CHUNK_POINTS` rows) into chunks of :data:`CHUNK_POINTS` points in step order, deleting the
    rows sealed, at most ``max_chunks`` chunks in all; each series in one transaction. Returns the
    chunks written. Rows short of a full chunk stay rows. ``point_model``, ``chunk_model``: a
    migration's historical models."""
    MetricPoint, MetricChunk = point_model, chunk_model  # noqa: N806 (the models, or a migration's)
    if keys is None:
        keys = [(name, rank) for name, rank in MetricPoint.objects.filter(job_id=job_id).order_by()
                .values_list("name", "rank").annotate(n=models.Count("id")).filter(n__gte=CHUNK_POINTS)
                .values_list("name", "rank")]
    written = 0
    for name, rank in sorted(set(keys), key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        room = max_chunks - written
        if room <= 0:
            break
        with transaction.atomic():
            rows = list(MetricPoint.objects.filter(job_id=job_id, name=name, **_rank_q(rank)).order_by("step", "id")
                        .values_list("id", "step", "value", "epoch", "recorded_at")[:room * CHUNK_POINTS])
            full = len(rows) // CHUNK_POINTS
            if not full:
                continue
            sealed = rows[:full * CHUNK_POINTS]
            series = Series.from_rows([r[1:] for r in sealed])
            MetricChunk.objects.bulk_create([MetricChunk(**_chunk_fields(job_id, name, rank,
                                                                         series.take(slice(i, i + CHUNK_POINTS))))
                                             for i in range(0, len(sealed), CHUNK_POINTS)])
            cut_id, cut_step = sealed[-1][0], sealed[-1][1]
            (MetricPoint.objects.filter(job_id=job_id, name=name, **_rank_q(rank))
             .filter(models.Q(step__lt=cut_step) | models.Q(step=cut_step, id__lte=cut_id)).delete())
            written += full
    return written


def fold_arrays(name: str, rank: int | None, series: Series, widths: Sequence[int] = STORED_WIDTHS) -> dict[Key, Agg]:
    """Every bucket of ``widths`` of one series' points (``series`` in the order they were stored, or
    in step order with stored order kept at equal steps), as :func:`jobs.metric_fold.fold` computes
    them point by point, with numpy: O(points) per level, no Python object per point."""
    if not len(series):
        return {}
    s = series.by_step()
    n = len(s)
    r = GLOBAL_RANK if rank is None else rank
    finite = ~s.missing
    low = np.where(finite, s.values, np.inf)
    high = np.where(finite, s.values, -np.inf)
    total = np.where(finite, s.values, 0.0)
    bad_steps = np.where(s.missing, s.steps, np.iinfo(np.int64).max)
    out: dict[Key, Agg] = {}
    for width in widths:
        bucket = s.steps // width
        starts = np.flatnonzero(np.concatenate(([True], bucket[1:] != bucket[:-1])))
        ends = np.concatenate((starts[1:], [n])) - 1
        counts = np.diff(np.concatenate((starts, [n])))
        nonfinite = np.add.reduceat(s.missing.astype(np.int64), starts)
        mins, maxs = np.minimum.reduceat(low, starts), np.maximum.reduceat(high, starts)
        sums = np.add.reduceat(total, starts)
        first_bad = np.minimum.reduceat(bad_steps, starts)
        first_at = np.minimum.reduceat(s.at_us, starts)
        columns = zip(bucket[starts].tolist(), counts.tolist(), nonfinite.tolist(), first_bad.tolist(), mins.tolist(),
                      maxs.tolist(), sums.tolist(), s.steps[starts].tolist(), s.steps[ends].tolist(),
                      s.values[ends].tolist(), s.missing[ends].tolist(), s.epochs[ends].tolist(), first_at.tolist(),
                      s.at_us[ends].tolist())
        for b, count, bad, fbad, lo, hi, sm, first, lst, lval, lmiss, lepoch, fat, lat in columns:
            some = bad < count
            out[(name, r, width, b)] = Agg(
                count, bad, fbad if bad else None, lo if some else None, hi if some else None, sm if some else None,
                first, lst, None if lmiss else lval, None if lepoch == _NO_EPOCH else lepoch, from_us(fat), from_us(lat))
    return out


def store(job_id: int, batch: Sequence[Point], *, compact_after: bool = True) -> dict[str, int]:
    """Store one sync pass's points of a job (``batch``, in the order they were logged; a NaN value is
    stored as None, not finite, as the sync builds it) and fold them
    into its buckets, in one transaction: a series bringing at least :data:`DIRECT_CHUNK_MIN` points
    (a backlog) is written as chunks directly, in step order, ``ceil(n / CHUNK_POINTS)`` of nearly
    equal size; a series bringing fewer as rows. Buckets are folded from arrays (:func:`fold_arrays`).
    Then a series whose rows may have reached :data:`CHUNK_POINTS` (its rows in this batch cross a
    multiple of that many steps) is compacted (:func:`compact`, bounded). Returns ``{"rows",
    "chunks", "compacted"}``: rows and chunks written by this call and chunks sealed by its compaction.

    Stores what ``MetricPoint.objects.bulk_create`` of the same points would, read back through
    :func:`points` (tests/jobs/test_metric_store.py holds the two paths equal)."""
    if not batch:
        return {"rows": 0, "chunks": 0, "compacted": 0}
    groups: dict[SeriesKey, list[Point]] = {}
    for point in batch:
        groups.setdefault((point[0], point[1]), []).append(point)
    times: dict[dt.datetime, int] = {}  # a record's points share one time: converted to µs once
    arrays: dict[SeriesKey, Series] = {}
    for key, group in groups.items():
        _, _, steps, values, epochs, ats = zip(*group)  # columns, transposed in C
        at_us = [times[at] if at in times else times.setdefault(at, to_us(at)) for at in ats]
        # float(None) is NaN in a float array: None (not finite) and NaN are one thing here.
        floats = np.array(values, np.float64)
        missing = np.isnan(floats)
        epoch_floats = np.array(epochs, np.float64)
        arrays[key] = Series(np.array(steps, np.int64), np.where(missing, 0.0, floats), missing,
                             np.where(np.isnan(epoch_floats), _NO_EPOCH, epoch_floats).astype(np.int64),
                             np.array(at_us, np.int64))
    return store_series(job_id, arrays, compact_after=compact_after)


def store_series(job_id: int, arrays: dict[SeriesKey, Series], *, compact_after: bool = True) -> dict[str, int]:
    """:func:`store` of one pass's points given as arrays, a :class:`Series` per (name, rank) in the order
    they were logged: what :func:`store` does once it has grouped its point tuples (bench/metric_scale.py's
    ``--load bulk`` writes generated arrays through it)."""
    row_objs: list[MetricPoint] = []
    chunk_objs: list[MetricChunk] = []
    buckets: dict[Key, Agg] = {}
    crossing: list[SeriesKey] = []
    for (name, rank), series in arrays.items():
        if not len(series):
            continue
        buckets.update(fold_arrays(name, rank, series))
        n = len(series)
        if n >= DIRECT_CHUNK_MIN:
            ordered = series.by_step()
            size = -(-n // -(-n // CHUNK_POINTS))  # ceil(n / pieces), pieces = ceil(n / CHUNK_POINTS)
            chunk_objs += [_chunk(job_id, name, rank, ordered.take(slice(i, i + size))) for i in range(0, n, size)]
            continue
        steps = series.steps.tolist()
        low, high = min(steps), max(steps)
        if low // CHUNK_POINTS != high // CHUNK_POINTS or low % CHUNK_POINTS == 0:
            crossing.append((name, rank))
        row_objs += [MetricPoint(job_id=job_id, name=name, rank=rank, step=step, value=None if miss else value,
                                 epoch=None if epoch == _NO_EPOCH else epoch, recorded_at=from_us(at))
                     for step, value, miss, epoch, at in zip(steps, series.values.tolist(), series.missing.tolist(),
                                                             series.epochs.tolist(), series.at_us.tolist())]
    with transaction.atomic():
        # The plain QuerySet's bulk_create: these points are folded above, from arrays, not again.
        models.QuerySet(model=MetricPoint).bulk_create(row_objs, batch_size=2000)
        MetricChunk.objects.bulk_create(chunk_objs, batch_size=64)
        upsert(job_id, buckets)
        compacted = compact(job_id, crossing) if compact_after and crossing else 0
    return {"rows": len(row_objs), "chunks": len(chunk_objs), "compacted": compacted}


def drop_from(job_id: int, step: int) -> None:
    """Delete every point of the job at ``step`` or later, rows and chunks (a chunk holding points on
    both sides is rewritten with those below ``step``), in one transaction; the hardware series
    (:data:`HARDWARE_NAMES`: their steps are Unix seconds, not training steps) are kept. The buckets
    are the caller's (:func:`jobs.metric_buckets.drop_from`)."""
    with transaction.atomic():
        MetricPoint.objects.filter(job_id=job_id, step__gte=step).exclude(name__in=HARDWARE_NAMES).delete()
        chunks = MetricChunk.objects.filter(job_id=job_id).exclude(name__in=HARDWARE_NAMES)
        chunks.filter(first_step__gte=step).delete()
        for chunk in chunks.filter(last_step__gte=step).select_for_update():
            kept = decode(chunk.data).within(None, step - 1)
            chunk.data, chunk.count = encode(kept), len(kept)
            chunk.first_step, chunk.last_step = int(kept.steps[0]), int(kept.steps[-1])
            chunk.save(update_fields=["data", "count", "first_step", "last_step"])


def count_and_checksum(job_id: int | None = None) -> tuple[int, str]:
    """(points, sha256 hex) over every point of the job (None: of every job) as
    ``(job, name, rank, step, value bits or None)`` in a canonical order, from rows and chunks alike:
    equal before and after a compaction that lost and changed nothing."""
    import hashlib

    job_ids = ([job_id] if job_id is not None else sorted(set(MetricPoint.objects.values_list("job_id", flat=True))
                                                            | set(MetricChunk.objects.values_list("job_id", flat=True))))
    digest, count = hashlib.sha256(), 0
    for jid in job_ids:
        for (name, rank), series in points(jid).items():
            order = np.lexsort((series.values.view("<i8"), series.steps))  # canonical at equal steps too
            s = series.take(order)
            for step, value, missing in zip(s.steps.tolist(), s.values.view("<i8").tolist(), s.missing.tolist()):
                digest.update(f"{jid}|{name}|{rank}|{step}|{'-' if missing else value};".encode())
            count += len(s)
    return count, digest.hexdigest()
