"""Compact raw-point storage (jobs/metric_store.py): chunks round-trip exactly, reads merge chunks and
tail rows and equal a brute-force read of the raw points (whole series, ranges, newest first), buckets
still equal a brute-force fold after compaction and after a resumed run cut inside a chunk, migration
0031 seals existing series without losing or changing a point (count and checksum), and the sync's
backlog path stores what the row path stores."""

from __future__ import annotations

import datetime as dt
import random
from importlib import import_module

import numpy as np
import pytest
from django.apps import apps as django_apps
from django.db import models

from jobs import metric_buckets, metric_store, sync
from jobs.metric_fold import STORED_WIDTHS
from jobs.metric_store import Series
from jobs.models import MetricBucket, MetricChunk, MetricPoint
from metrickit import brute_buckets

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
FIELDS = ("count", "nonfinite", "first_nonfinite_step", "min_value", "max_value", "sum_value", "first_step",
          "last_step", "last_value", "last_epoch", "first_at", "last_at")
SMALL = 64
"""CHUNK_POINTS in these tests: chunks of 64 points, so short histories span many."""


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(metric_store, "CHUNK_POINTS", SMALL)
    monkeypatch.setattr(metric_store, "DIRECT_CHUNK_MIN", SMALL // 4)


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    from jobs import dispatch, services
    from taskkit import sent_tasks

    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=local_backend, nodes=1, procs_per_node=2, epochs=3, name="chunks")


@pytest.fixture
def other_job(user, digits_dataset, cnn_model, local_backend):
    from jobs import dispatch, services
    from taskkit import sent_tasks

    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=local_backend, nodes=1, procs_per_node=2, epochs=3, name="rows")


def _history(rng: random.Random, steps: int, ranks: int, *, first: int = 0, every: int = 1) -> list[tuple]:
    """Points ``(name, rank, step, value, epoch, time)`` as records store them: two global series and a
    per-rank one; values with NaN/inf gaps (None), some exactly repeated, some -0.0 (PostgreSQL; SQLite
    stores a row's -0.0 as 0) and tiny; epochs None now and then; times with µs jitter."""
    from django.db import connection

    zero = -0.0 if connection.vendor == "postgresql" else 0.0
    out = []
    for step in range(first, first + steps, every):
        at = T0 + dt.timedelta(seconds=step, microseconds=rng.randrange(1_000_000))
        epoch = None if rng.random() < 0.05 else step // 100
        for name, rank in [("train_loss", None), ("lr", None)] + [("rank_step_time_s", r) for r in range(ranks)]:
            roll = rng.random()
            value = (None if roll < 0.05 else zero if roll < 0.07 else 5e-324 if roll < 0.08
                     else 1.5 if roll < 0.15 else rng.uniform(-1e6, 1e6))
            out.append((name, rank, step, value, epoch, at))
    return out


def _bits(value: float | None):
    return None if value is None else np.float64(value).view(np.int64).item()


def _brute_series(points: list[tuple], start=None, end=None) -> dict[tuple, list[tuple]]:
    """``{(name, rank): [(step, value bits, epoch, time)]}`` in step order, stored order at equal steps."""
    out: dict[tuple, list[tuple]] = {}
    for order, (name, rank, step, value, epoch, at) in enumerate(points):
        if (start is None or step >= start) and (end is None or step <= end):
            out.setdefault((name, rank), []).append((step, order, _bits(value), epoch, at))
    return {key: [(s, v, e, at) for s, _, v, e, at in sorted(pts, key=lambda p: (p[0], p[1]))]
            for key, pts in out.items()}


def _read(job_id: int, **kw) -> dict[tuple, list[tuple]]:
    return {key: [(s, _bits(v), e, at) for s, v, e, at in series.rows()]
            for key, series in metric_store.points(job_id, **kw).items()}


def _assert_buckets(job, points: list[tuple]) -> None:
    stored = {(b.name, b.rank, b.width, b.bucket): b for b in MetricBucket.objects.filter(job=job)}
    want = brute_buckets(points)
    assert stored.keys() == want.keys()
    for key, fields in want.items():
        for field in FIELDS:
            got = getattr(stored[key], field)
            if field == "sum_value" and fields[field] is not None:
                assert got == pytest.approx(fields[field], rel=1e-9, abs=1e-6), (key, field)
            else:
                assert got == fields[field], (key, field, got, fields[field])


def _store_rows(job, points: list[tuple], rng: random.Random) -> None:
    i = 0
    while i < len(points):
        n = rng.randint(1, 300)
        MetricPoint.objects.bulk_create([MetricPoint(job=job, name=n_, rank=r, step=s, value=v, epoch=e, recorded_at=at)
                                         for n_, r, s, v, e, at in points[i:i + n]])
        i += n


# -- the format ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_a_chunk_gives_back_every_array_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5000))
    steps = np.sort(rng.integers(0, 2**40, n)) if seed % 2 else np.arange(n, dtype=np.int64) * 3 + 10**9
    values = rng.normal(0, 1e3, n)
    values[rng.random(n) < 0.1] = np.nan  # NaN stored as a value (not None) comes back as NaN
    values[rng.random(n) < 0.05] = -0.0
    values[rng.random(n) < 0.05] = np.inf
    missing = rng.random(n) < 0.2
    values[missing] = 0.0
    epochs = np.where(rng.random(n) < 0.1, -1, steps // 100)
    at_us = 1_700_000_000_000_000 + np.cumsum(rng.integers(-5, 2_000_000, n))
    series = Series(steps.astype(np.int64), values, missing, epochs.astype(np.int64), at_us.astype(np.int64))
    back = metric_store.decode(metric_store.encode(series))
    for field in ("steps", "missing", "epochs", "at_us"):
        assert np.array_equal(getattr(back, field), getattr(series, field)), field
    assert np.array_equal(back.values.view(np.int64), series.values.view(np.int64))
    with pytest.raises(ValueError):
        metric_store.decode(b"\x02" + metric_store.encode(series)[1:])


def test_a_smooth_series_costs_a_few_bytes_a_point():
    """4,096 steps of a trainer-like series (a value with noise, one point a second): under 10 bytes a
    point with its steps, epochs and times, where a row costs ~150."""
    rng = np.random.default_rng(1)
    n = 4096
    steps = np.arange(n, dtype=np.int64)
    values = 2.3 * np.exp(-np.arange(n) / 2000) + rng.normal(0, 0.02, n)
    series = Series(steps, values, np.zeros(n, bool), steps // 1000, 1_700_000_000_000_000 + steps * 1_000_000)
    assert len(metric_store.encode(series)) / n < 10


# -- reads over chunks and rows --------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("seed", [1, 2])
def test_compacted_series_read_back_as_the_raw_points_whole_by_range_and_newest_first(job, small_chunks, seed):
    rng = random.Random(seed)
    points = _history(rng, steps=rng.randint(300, 700), ranks=rng.randint(1, 3), every=rng.choice([1, 2]))
    _store_rows(job, points, rng)
    sealed = metric_store.compact(job.pk, max_chunks=10**6)
    assert sealed > 0 and MetricChunk.objects.filter(job=job).count() == sealed
    tail = MetricPoint.objects.filter(job=job).values_list("name", "rank").annotate(n=models.Count("id"))
    assert all(n < SMALL for _, _, n in tail)  # only rows short of a chunk stay rows
    assert _read(job.pk) == _brute_series(points)
    last_step = points[-1][2]
    for _ in range(15):
        a = rng.randint(-5, last_step + 5)
        b = rng.randint(a - 3, last_step + 10)
        assert _read(job.pk, start=a, end=b) == _brute_series(points, a, b), (a, b)
    assert _read(job.pk, per_rank=True, start=100, end=200) == {
        k: v for k, v in _brute_series(points, 100, 200).items() if k[1] is not None}
    assert _read(job.pk, names=["lr"], per_rank=False) == {("lr", None): _brute_series(points)[("lr", None)]}
    assert _read(job.pk, ranks=[0]) == {("rank_step_time_s", 0): _brute_series(points)[("rank_step_time_s", 0)]}
    for name, rank in (("train_loss", None), ("rank_step_time_s", 0)):
        want = list(reversed(_brute_series(points)[(name, rank)]))
        got = [(s, _bits(v), e, at) for s, v, e, at in metric_store.backwards(job.pk, name, rank=rank, page_rows=7)]
        assert [p[0] for p in got] == [p[0] for p in want]
        # at equal steps the order is the reverse of stored, so compare as sets per step
        assert sorted(got, key=repr) == sorted(want, key=repr)
        newest = metric_store.last(job.pk, name, rank=rank)
        assert (newest[0], _bits(newest[1]), newest[2], newest[3]) == want[0]
    _assert_buckets(job, points)
    assert metric_buckets.rebuild(job.pk) == len(points)
    _assert_buckets(job, points)


@pytest.mark.django_db
def test_a_resumed_run_cut_inside_a_chunk_keeps_the_steps_before_it(job, small_chunks):
    """A run resumed at a step inside a sealed chunk: the chunk is rewritten with the points below it,
    later chunks and rows go, and the points and buckets equal the brute force of what is kept."""
    rng = random.Random(4)
    first = _history(rng, steps=900, ranks=2)
    _store_rows(job, first, rng)
    metric_store.compact(job.pk, max_chunks=10**6)
    resume_at = 517  # inside a chunk of every series (64 points a chunk, one point a step)
    assert MetricChunk.objects.filter(job=job, first_step__lt=resume_at, last_step__gte=resume_at).exists()
    metric_buckets.drop_from(job.pk, resume_at)
    again = _history(rng, steps=400, ranks=2, first=resume_at)
    _store_rows(job, again, rng)
    metric_store.compact(job.pk, max_chunks=10**6)
    kept = [p for p in first if p[2] < resume_at] + again
    assert _read(job.pk) == _brute_series(kept)
    _assert_buckets(job, kept)


@pytest.mark.django_db
def test_chart_reads_equal_over_chunks_and_over_rows(job, other_job, small_chunks):
    """The same history, one job compacted and one all rows: every chart level reads the same (width 1
    and 16 from the raw points, 256 up from the buckets)."""
    rng = random.Random(5)
    points = _history(rng, steps=3000, ranks=2)
    _store_rows(job, points, random.Random(1))
    _store_rows(other_job, points, random.Random(1))
    metric_store.compact(job.pk, max_chunks=10**6)
    assert MetricChunk.objects.filter(job=job).exists() and not MetricChunk.objects.filter(job=other_job).exists()
    for width in (1, 16, 256, 4096):
        for per_rank in (False, True):
            a = metric_buckets.read_series(job.pk, names=None, per_rank=per_rank, start=700, end=2900, width=width)
            b = metric_buckets.read_series(other_job.pk, names=None, per_rank=per_rank, start=700, end=2900,
                                           width=width)
            assert a == b and a[1], (width, per_rank)


@pytest.mark.django_db
def test_width_16_read_from_the_points_equals_a_brute_force_fold(job):
    rng = random.Random(6)
    points = _history(rng, steps=2500, ranks=1)
    _store_rows(job, points, rng)
    width, lines = metric_buckets.read_series(job.pk, names=["train_loss"], per_rank=False, start=100, end=1000,
                                              width=16)
    assert width == 16
    line = [p for p in lines[("train_loss", None)] if "n" in p]
    mine = [p for p in points if p[0] == "train_loss" and 96 <= p[2] < 1008]
    assert sum(p["n"] for p in line) == len(mine) and len(line) == 57
    for p in line:
        inside = [q[3] for q in mine if q[2] // 16 == p["x"] // 16]
        finite = [v for v in inside if v is not None]
        assert (p["min"], p["max"]) == ((min(finite), max(finite)) if finite else (None, None))


# -- migration ----------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_the_migration_seals_long_series_and_loses_nothing(job, other_job, monkeypatch):
    """Rows stored as before migration 0031 (one per point, some series past CHUNK_POINTS): the
    migration seals them into chunks; count and checksum of (job, name, rank, step, value) are equal
    before and after, and the buckets still equal a brute-force fold."""
    monkeypatch.setattr(metric_store, "CHUNK_POINTS", 256)
    rng = random.Random(7)
    long_run = _history(rng, steps=1300, ranks=2)
    short_run = _history(rng, steps=40, ranks=1)
    _store_rows(job, long_run, rng)
    _store_rows(other_job, short_run, rng)
    before = metric_store.count_and_checksum()
    assert before[0] == len(long_run) + len(short_run) == MetricPoint.objects.count()
    migration = import_module("jobs.migrations.0032_metric_chunks")
    migration.compact_existing(django_apps, None)
    assert metric_store.count_and_checksum() == before
    assert MetricChunk.objects.filter(job=job).count() == 4 * (1300 // 256)  # 4 series, 5 full chunks each
    assert not MetricChunk.objects.filter(job=other_job).exists()
    assert MetricPoint.objects.count() == len(long_run) - 4 * 5 * 256 + len(short_run)
    _assert_buckets(job, long_run)
    migration.expand_chunks(django_apps, None)  # the reverse
    assert not MetricChunk.objects.exists() and metric_store.count_and_checksum() == before


# -- the sync ---------------------------------------------------------------------------------------------

def _records(rng: random.Random, steps: int, ranks: int) -> list[dict]:
    out = []
    for step in range(1, steps + 1):
        loss = float("nan") if rng.random() < 0.03 else rng.uniform(0, 3)
        out.append({"event": "step", "step": step, "epoch": step // 50, "time": 1.7e9 + step + rng.random(),
                    "train_loss": loss, "lr": 0.01, "samples_per_s": rng.uniform(100, 200),
                    "rank_step_time_s": [float("inf") if rng.random() < 0.02 else rng.uniform(0.01, 0.1)
                                         for _ in range(ranks)]})
        if step % 50 == 0:
            out.append({"event": "epoch", "step": step, "epoch": step // 50, "time": 1.7e9 + step,
                        "val_loss": rng.uniform(0, 3), "val_accuracy": rng.uniform(0, 1)})
    return out


@pytest.mark.django_db
def test_the_sync_backlog_path_stores_what_the_row_path_stores(job, other_job, small_chunks):
    """One sync pass bringing a backlog (hundreds of points a series): ``_ingest_lines`` writes full
    chunks directly; the same records stored as rows (``MetricPoint.objects.bulk_create``) read back
    the same points, the same buckets and the same final metrics."""
    from trainer_pkg.metrics import format_metric_line, parse_metric_line

    rng = random.Random(8)
    lines = [format_metric_line(r) for r in _records(rng, steps=700, ranks=3)]
    records = [parse_metric_line(line) for line in lines]
    now = dt.datetime(2026, 2, 1, tzinfo=dt.timezone.utc)
    MetricPoint.objects.bulk_create([p for r in records for p in sync.metric_points_from_record(other_job, r, now)])
    sync._ingest_lines(job, lines[:300], 0, now, lambda text: text)  # two passes, the first a backlog too
    sync._ingest_lines(job, lines[300:], 300, now, lambda text: text)
    assert MetricChunk.objects.filter(job=job).count() >= 5 * 300 // SMALL
    assert _read(job.pk) == _read(other_job.pk)
    mine = {(b.name, b.rank, b.width, b.bucket): tuple(getattr(b, f) for f in FIELDS if f != "sum_value")
            for b in MetricBucket.objects.filter(job=job)}
    theirs = {(b.name, b.rank, b.width, b.bucket): tuple(getattr(b, f) for f in FIELDS if f != "sum_value")
              for b in MetricBucket.objects.filter(job=other_job)}
    assert mine == theirs
    job.refresh_from_db()
    assert job.final_metrics == sync.final_metrics_after({}, [p for r in records
                                                             for p in sync.metric_points_from_record(job, r, now)])


@pytest.mark.django_db
def test_a_steady_sync_compacts_a_series_once_its_rows_fill_a_chunk(job, small_chunks):
    """Passes of a few records each: rows until a series' points cross a multiple of CHUNK_POINTS steps,
    then its oldest full chunks are sealed; nothing is lost."""
    from trainer_pkg.metrics import format_metric_line, parse_metric_line

    rng = random.Random(9)
    records = [parse_metric_line(format_metric_line(r)) for r in _records(rng, steps=300, ranks=1)]
    now = dt.datetime(2026, 2, 1, tzinfo=dt.timezone.utc)
    seq = 0
    for i in range(0, len(records), 7):
        lines = [format_metric_line(r) for r in records[i:i + 7]]
        seq = sync._ingest_lines(job, lines, seq, now, lambda text: text)[0]
    want = [p for r in records for p in sync.metric_point_tuples(r, now)]
    assert {k: [(s, v) for s, v, _, _ in rows] for k, rows in _read(job.pk).items()} == {
        k: [(s, v) for s, v, _, _ in rows] for k, rows in _brute_series(want).items()}
    assert MetricChunk.objects.filter(job=job, name="train_loss").count() >= 3
    assert MetricPoint.objects.filter(job=job, name="train_loss").count() < 2 * SMALL


@pytest.mark.django_db
def test_whole_number_values_fold_with_float_ones(job):
    """A value stored as an int (a pipeline stage number) among floats in one batch: the bucket upsert
    (one array per column on PostgreSQL) takes them, and reads them back as floats."""
    MetricPoint.objects.bulk_create([MetricPoint(job=job, name="rank_pipeline_stage", rank=0, step=s, value=v,
                                                 recorded_at=T0) for s, v in ((1, 1), (2, 2.5), (3, None))])
    top = MetricBucket.objects.get(job=job, name="rank_pipeline_stage", width=STORED_WIDTHS[-1])
    assert (top.min_value, top.max_value, top.sum_value, top.count, top.nonfinite) == (1.0, 2.5, 3.5, 3, 1)
