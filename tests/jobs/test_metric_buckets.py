"""Metric buckets (jobs/metric_buckets.py) against a brute-force fold of the raw points: random
histories with NaN gaps, several ranks, points stored in random batches, runs resumed from a
checkpoint (superseded steps), the migration's fold of points stored before buckets existed, and
the chart reads: at most a chart's worth of rows per line whatever the run's length, and a poll that
sends only what is new (merged as the job page merges it, it equals a full read)."""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import random
from importlib import import_module

import pytest
from django.apps import apps as django_apps
from django.db import connection, models
from django.test.utils import CaptureQueriesContext

from jobs import comparison, metric_buckets
from jobs.metric_buckets import STORED_WIDTHS, WIDTHS
from jobs.models import MetricBucket, MetricPoint
from metrickit import brute_buckets

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
FIELDS = ("count", "nonfinite", "first_nonfinite_step", "min_value", "max_value", "sum_value", "first_step",
          "last_step", "last_value", "last_epoch", "first_at", "last_at")


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    """A QUEUED job of 1 node × 2 processes (its points are what the tests store)."""
    from jobs import services
    from taskkit import sent_tasks
    from jobs import dispatch

    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=local_backend, nodes=1, procs_per_node=2, epochs=3, name="long")


def _history(rng: random.Random, steps: int, ranks: int, every: int = 1, nan_rate: float = 0.02) -> list[tuple]:
    """Points ``(name, rank, step, value, epoch, time)`` in the order a trainer's records store them:
    two global series, one per-rank series of ``ranks`` ranks, a record every ``every`` steps."""
    out = []
    for step in range(0, steps, every):
        at = T0 + dt.timedelta(seconds=step)
        for name in ("train_loss", "lr"):
            value = None if rng.random() < nan_rate else rng.uniform(-5, 5)
            out.append((name, None, step, value, step // 100, at))
        for rank in range(ranks):
            value = None if rng.random() < nan_rate else rng.uniform(0, 1000)
            out.append(("rank_step_time_s", rank, step, value, step // 100, at))
    return out


def _stored(job) -> dict[tuple, dict]:
    return {(b.name, b.rank, b.width, b.bucket): {f: getattr(b, f) for f in FIELDS}
            for b in MetricBucket.objects.filter(job=job)}


def _assert_same(stored: dict, expected: dict) -> None:
    assert stored.keys() == expected.keys()
    for key, want in expected.items():
        got = stored[key]
        for field in FIELDS:
            if field == "sum_value" and want[field] is not None:
                assert got[field] == pytest.approx(want[field], rel=1e-9, abs=1e-9), (key, field)
            else:
                assert got[field] == want[field], (key, field, got[field], want[field])


def _store(job, points: list[tuple], rng: random.Random) -> None:
    """Store ``points`` as the sync does (``MetricPoint.objects.bulk_create``), in random batches."""
    i = 0
    while i < len(points):
        n = rng.randint(1, 400)
        MetricPoint.objects.bulk_create([MetricPoint(job=job, name=name, rank=rank, step=step, value=value, epoch=epoch,
                                                     recorded_at=at) for name, rank, step, value, epoch, at in points[i:i + n]])
        i += n


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_buckets_equal_a_brute_force_fold_of_random_histories(job, seed):
    rng = random.Random(seed)
    points = _history(rng, steps=rng.randint(300, 5000), ranks=rng.randint(1, 4), every=rng.choice([1, 3, 10]),
                      nan_rate=rng.choice([0.0, 0.05, 0.5]))
    _store(job, points, rng)
    _assert_same(_stored(job), brute_buckets(points))
    summary = metric_buckets.summaries([job.pk], per_rank=False)
    loss = [p for p in points if p[0] == "train_loss"]
    finite = [p[3] for p in loss if p[3] is not None]
    got = summary[(job.pk, "train_loss", None)]
    assert (got.count, got.last_step, got.last_value) == (len(loss), loss[-1][2], loss[-1][3])
    assert (got.min_value, got.max_value) == (min(finite, default=None), max(finite, default=None))


@pytest.mark.parametrize("seed", [4, 5])
def test_a_resumed_run_cuts_its_superseded_steps_from_every_level(job, seed):
    """The sync's path: the ``started`` record of a resumed run deletes the points from its step on
    (``jobs.sync._drop_superseded_points``), then the resumed run's points arrive."""
    from jobs.sync import _drop_superseded_points

    rng = random.Random(seed)
    first = _history(rng, steps=3000, ranks=2, every=rng.choice([1, 7]))
    _store(job, first, rng)
    resume_at = rng.randint(1, 2999)
    _drop_superseded_points(job, {"event": "started", "step": resume_at, "resumed": True})
    again = [p for p in _history(rng, steps=4500, ranks=2, every=5) if p[2] >= resume_at]
    _store(job, again, rng)
    kept = [p for p in first if p[2] < resume_at] + again
    _assert_same(_stored(job), brute_buckets(kept))
    assert MetricPoint.objects.filter(job=job).count() == len(kept)


def test_rebuild_and_the_migration_fold_points_stored_before_buckets(job):
    """Points stored without buckets (as before migration 0029): the migration's fold gives the
    brute-force buckets and leaves every point as it was (count and checksum)."""
    rng = random.Random(6)
    points = _history(rng, steps=2000, ranks=3, every=2)
    models.QuerySet.bulk_create(MetricPoint.objects.all(), [
        MetricPoint(job=job, name=n, rank=r, step=s, value=v, epoch=e, recorded_at=at) for n, r, s, v, e, at in points])
    assert not MetricBucket.objects.filter(job=job).exists()

    def checksum() -> tuple[int, str]:
        rows = MetricPoint.objects.filter(job=job).order_by("id").values_list("name", "rank", "step", "value", "epoch")
        return len(rows), hashlib.sha256(repr(list(rows)).encode()).hexdigest()

    before = checksum()
    migration = import_module("jobs.migrations.0029_metric_buckets")
    migration.fold_existing_points(django_apps, None)
    assert checksum() == before
    _assert_same(_stored(job), brute_buckets(points))
    assert metric_buckets.rebuild(job.pk) == len(points)
    _assert_same(_stored(job), brute_buckets(points))


def test_a_point_saved_alone_is_folded_and_a_stored_one_is_not_edited(job):
    point = MetricPoint.objects.create(job=job, name="val_loss", step=40, epoch=1, value=0.5, recorded_at=T0)
    assert MetricBucket.objects.filter(job=job, name="val_loss").count() == len(STORED_WIDTHS)
    point.value = 0.1
    with pytest.raises(ValueError, match="not edited"):
        point.save()


def test_width_for_gives_at_most_a_charts_worth():
    assert metric_buckets.width_for(2000) == 1
    assert metric_buckets.width_for(2001) == 16
    for span in (10**4, 10**5, 10**6, 64 * 10**6):
        width = metric_buckets.width_for(span)
        assert math.ceil(span / width) + 1 <= metric_buckets.MAX_CHART_POINTS
        assert width == WIDTHS[0] or math.ceil(span / (width // 16)) + 1 > metric_buckets.MAX_CHART_POINTS


def test_a_million_step_chart_reads_a_charts_worth_of_rows_with_its_spike_and_nan(job):
    """A 1,000,000-step run (a record every 250 steps: 4,000 points a series, 2 ranks): the job page's
    chart read gets at most MAX_POINTS_PER_SERIES points a line in a bounded number of queries, and the
    one-step loss spike and the NaN that even sampling to that many points would miss are both in it."""
    rng = random.Random(7)
    points = _history(rng, steps=1_000_000, ranks=2, every=250, nan_rate=0.0)
    spike_step, nan_step = 123_250, 777_750
    points = [(n, r, s, 1e6 if (n == "train_loss" and s == spike_step) else None if (n == "train_loss" and s == nan_step)
               else v, e, at) for n, r, s, v, e, at in points]
    _store(job, points, rng)
    with CaptureQueriesContext(connection) as queries:
        charted = comparison.training_job_chart_series(job=job)
    assert len(queries) <= 3, [q["sql"][:100] for q in queries]
    assert charted["widths"] == [4096, 4096]  # 245 buckets over the run (256 would be 3,907)
    loss = charted["series"]["train_loss"]
    assert len(loss) <= comparison.MAX_POINTS_PER_SERIES + 1
    assert max(p["max"] for p in loss if p.get("max") is not None) == 1e6
    assert any(p["y"] is None and p["x"] == nan_step for p in loss)
    assert all(len(line) <= comparison.MAX_POINTS_PER_RANK_LINE + 1
               for line in charted["rank_series"]["rank_step_time_s"].values())
    bucket = next(p for p in loss if p.get("max") == 1e6)
    inside = [v for n, r, s, v, e, at in points if n == "train_loss" and s // charted["widths"][0] == bucket["x"] // charted["widths"][0]]
    assert (bucket["min"], bucket["n"]) == (min(v for v in inside if v is not None), len(inside))


def _merge(page: dict, poll: dict) -> dict:
    """What webapp/static/webapp/js/job.js ``merged`` does with a poll's answer."""
    if poll["replace"]:
        return poll
    from_global, from_rank = poll["from_step"]
    series = {n: [p for p in page["series"].get(n, []) if p["x"] < from_global] + poll["series"].get(n, [])
              for n in set(page["series"]) | set(poll["series"])}
    ranks = {}
    for n in set(page["rank_series"]) | set(poll["rank_series"]):
        mine, fresh = page["rank_series"].get(n, {}), poll["rank_series"].get(n, {})
        ranks[n] = {r: [p for p in mine.get(r, []) if p["x"] < from_rank] + fresh.get(r, []) for r in set(mine) | set(fresh)}
    return {**poll, "series": series, "rank_series": ranks}


@pytest.mark.parametrize("steps, every", [(1500, 1), (30_000, 40)])
def test_a_poll_sends_only_what_is_new_and_merged_equals_a_full_read(job, steps, every):
    """1,500 steps: the page holds the global points themselves (width 1); 30,000: buckets of 16
    steps. Per-rank lines get fewer points (buckets of 16 and 256 steps)."""
    rng = random.Random(8)
    points = _history(rng, steps=steps, ranks=2, every=every)
    done = len(points) // 2
    _store(job, points[:done], rng)
    page = comparison.training_job_chart_series(job=job)
    assert page["widths"] == ([1, 16] if every == 1 else [16, 256])
    _store(job, points[done:], rng)
    with CaptureQueriesContext(connection) as queries:
        poll = comparison.training_job_chart_series(job=job, after=page["last_step"], widths=page["widths"],
                                                    attempt=page["attempt"])
    assert len(queries) <= 3 and not poll["replace"] and poll["last_step"] == points[-1][2]
    sent = sum(len(line) for line in poll["series"].values())
    new = len([p for p in points[done:] if p[1] is None])  # the two global lines' new points
    assert 0 < sent <= new + 2 * 2  # and at most the bucket each line had begun (and a NaN gap in it)
    full = comparison.training_job_chart_series(job=job)
    assert full["widths"] == page["widths"]
    merged = _merge(page, poll)
    assert merged["series"] == full["series"] and merged["rank_series"] == full["rank_series"]
    again = comparison.training_job_chart_series(job=job, after=poll["last_step"], widths=poll["widths"],
                                                 attempt=poll["attempt"])
    assert _merge(merged, again)["series"] == full["series"]


def test_a_poll_gets_every_point_again_when_it_cannot_go_on(job):
    """The run outgrew the page's widths, a resumed attempt, or a malformed poll: ``replace``."""
    rng = random.Random(9)
    points = _history(rng, steps=4000, ranks=1, every=1)
    _store(job, points[:2000], rng)
    page = comparison.training_job_chart_series(job=job)
    assert page["widths"] == [1, 16]
    _store(job, points[2000:], rng)
    polls = {"outgrown": dict(after=page["last_step"], widths=page["widths"], attempt=page["attempt"]),
             "resumed": dict(after=page["last_step"], widths=[16, 16], attempt=page["attempt"] + 1),
             "past the end": dict(after=10**9, widths=[16, 16], attempt=page["attempt"]),
             "not a width": dict(after=0, widths=[17, 16], attempt=page["attempt"])}
    for why, poll in polls.items():
        got = comparison.training_job_chart_series(job=job, **poll)
        assert got["replace"] and got["from_step"] == [0, 0] and got["widths"] == [16, 256], why
        assert got["series"] == comparison.training_job_chart_series(job=job)["series"], why


def test_the_fold_writes_the_models_table_and_columns():
    """jobs.metric_fold writes MetricBucket's table by name (it imports no model)."""
    from jobs import metric_fold

    assert metric_fold.BUCKET_TABLE == MetricBucket._meta.db_table
    columns = {f.column for f in MetricBucket._meta.concrete_fields} - {"id"}
    assert set(metric_fold._COLUMNS) == columns


def test_a_zoomed_range_is_read_at_the_resolution_it_needs(job):
    """``steps=(first, last)``: a range of at most 2,000 steps is its points themselves (exact), a
    longer one its own buckets; steps past the run read nothing, and a range is never a poll."""
    rng = random.Random(10)
    points = _history(rng, steps=100_000, ranks=1, every=10, nan_rate=0.0)
    _store(job, points, rng)
    whole = comparison.training_job_chart_series(job=job)
    assert whole["widths"][0] == 256
    narrow = comparison.training_job_chart_series(job=job, steps=(50_000, 51_000))
    loss = [(s, v) for n, r, s, v, e, at in points if n == "train_loss" and 50_000 <= s <= 51_000]
    assert narrow["widths"][0] == 1 and narrow["replace"] and narrow["steps"] == [50_000, 51_000]
    assert [(p["x"], p["y"]) for p in narrow["series"]["train_loss"]] == loss
    wide = comparison.training_job_chart_series(job=job, steps=(10_000, 60_000))
    assert wide["widths"][0] == metric_buckets.width_for(50_001) == 256
    xs = [p["x"] for p in wide["series"]["train_loss"]]
    assert 9_984 <= xs[0] and xs[-1] <= 60_159 and len(xs) <= comparison.MAX_POINTS_PER_SERIES
    past = comparison.training_job_chart_series(job=job, steps=(10**12, 10**13))
    assert past["series"] == {} and past["rank_series"] == {}


def _brute_chart_line(points: list[tuple], width: int) -> list[dict]:
    """The chart points of one series' ``points`` (``(step, value, at)`` in stored order) at ``width``,
    computed point by point: per bucket its last point (highest step, the later stored at equal steps)
    with the band and count, after a gap point (the first non-finite step, the bucket's first time)
    where the bucket holds a non-finite point and its last value is finite."""
    buckets: dict[int, list[tuple]] = {}
    for point in points:
        buckets.setdefault(point[0] // width, []).append(point)
    line = []
    for _, inside in sorted(buckets.items()):
        last = max(enumerate(inside), key=lambda item: (item[1][0], item[0]))[1]
        finite = [v for _, v, _ in inside if v is not None]
        bad = [s for s, v, _ in inside if v is None]
        if bad and last[1] is not None:
            line.append({"x": min(bad), "y": None, "t": round(min(at for _, _, at in inside).timestamp(), 3)})
        line.append({"x": last[0], "y": last[1], "t": round(last[2].timestamp(), 3), "min": min(finite, default=None),
                     "max": max(finite, default=None), "n": len(inside)})
    return line


@pytest.mark.parametrize("seed", [11, 12])
def test_chart_lines_read_from_stored_buckets_equal_a_brute_force_of_the_points_times_and_gaps_included(job, seed):
    """The bucket read takes its times as Unix seconds from the database (``epoch_seconds_sql``) and the
    first point's time only where a bucket draws a gap: every point of every line, at the two finest
    stored levels, equals the one computed from the raw points (times to the microsecond, NaN gaps,
    a step stored twice)."""
    rng = random.Random(seed)
    points = [(n, r, s, v, e, at + dt.timedelta(microseconds=rng.randrange(10**6)))
              for n, r, s, v, e, at in _history(rng, steps=6000, ranks=2, every=rng.choice([1, 3]), nan_rate=0.05)]
    points.append(("train_loss", None, points[-1][2], 0.125, 0, T0 + dt.timedelta(days=1, microseconds=999_999)))
    _store(job, points, rng)
    last = max(p[2] for p in points)
    for width in STORED_WIDTHS[:2]:
        with CaptureQueriesContext(connection) as queries:
            got_width, lines = metric_buckets.read_series(job.pk, names=None, per_rank=None, end=last, width=width)
        assert got_width == width and len(queries) == 1
        series: dict[tuple, list[tuple]] = {}
        for n, r, s, v, e, at in points:
            series.setdefault((n, r), []).append((s, v, at))
        assert lines.keys() == series.keys()
        for key, line in lines.items():
            assert line == _brute_chart_line(series[key], width), (key, width)
        assert any(p["y"] is None for line in lines.values() for p in line)  # the gaps were exercised


def test_epoch_seconds_on_sqlite_equals_the_datetimes_timestamp():
    """``epoch_seconds_sql``'s SQLite form, run by SQLite on the text Django stores a ``DateTimeField`` as
    (UTC, ``YYYY-MM-DD HH:MM:SS[.ffffff]``), gives ``datetime.timestamp()`` to the last bit: whole
    seconds, microseconds, before 1970 and far ahead."""
    import sqlite3

    rng = random.Random(13)
    whens = [T0, T0 + dt.timedelta(microseconds=1), T0 + dt.timedelta(microseconds=999_999),
             dt.datetime(1969, 12, 31, 23, 59, 59, 500_000, tzinfo=dt.timezone.utc),
             dt.datetime(2999, 12, 31, 23, 59, 59, 999_999, tzinfo=dt.timezone.utc)]
    whens += [T0 + dt.timedelta(seconds=rng.uniform(0, 10**9)) for _ in range(200)]
    sql = metric_buckets.epoch_seconds_sql("sqlite").format('"at"')
    db = sqlite3.connect(":memory:")
    db.execute('CREATE TABLE t ("at" datetime)')
    # What Django's SQLite backend writes for an aware datetime (adapt_datetimefield_value), and how
    # its cursor turns the ``%%`` of a query with parameters into ``%``.
    db.executemany("INSERT INTO t VALUES (?)", [(str(w.astimezone(dt.timezone.utc).replace(tzinfo=None)),) for w in whens])
    got = [row[0] for row in db.execute(f"SELECT {sql.replace('%%', '%')} FROM t ORDER BY rowid")]
    assert got == [w.timestamp() for w in whens]


def test_a_jobs_buckets_have_one_index_the_key():
    """No index on ``job_id`` alone beside the key ``(job, width, name, rank, bucket)``: PostgreSQL chose
    it for a job its statistics did not know yet and read every bucket of the job (bench/RESULTS.md)."""
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, MetricBucket._meta.db_table)
    indexed = sorted(tuple(c["columns"]) for c in constraints.values() if c["index"] or c["unique"])
    assert indexed == [("id",), ("job_id", "width", "name", "rank", "bucket")]
