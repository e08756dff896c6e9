"""Per-rank metrics across ranks (issue 29): the sync stores each record's min, median and max across
ranks as three global series; the job page and a comparison chart those for a job of any world size and
name its slowest rank, and a job of more than ``MAX_RANK_LINES`` ranks gets no line per rank at all."""

from __future__ import annotations

import datetime as dt
import random
import statistics

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs import comparison, metric_buckets, metric_store, selectors, sync
from jobs.metric_fold import across_ranks_name
from jobs.models import MetricBucket, MetricChunk, MetricPoint, TrainingJob

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
SLOW = 37


def _records(world: int, steps: int, seed: int = 7) -> list[dict]:
    """Step records as the trainer writes them: rank ``SLOW`` takes 3× the others' step time (and so
    has a third of their samples/s); one step's list holds a non-finite value at rank 1."""
    rng = random.Random(seed)
    out = []
    for step in range(1, steps + 1):
        times = [round(0.1 + rng.random() * 0.01, 6) for _ in range(world)]
        times[SLOW % world] *= 3
        record = {"event": "step", "step": step, "epoch": step // 100, "time": T0.timestamp() + step,
                  "train_loss": 1.0 / step, "rank_step_time_s": times,
                  "rank_samples_per_s": [round(32 / t, 3) for t in times]}
        if step == 5:
            record["rank_step_time_s"] = [None if r == 1 else t for r, t in enumerate(times)]
            record["nonfinite"] = ["rank_step_time_s"]
        out.append(record)
    return out


def _store(job: TrainingJob, records: list[dict]) -> None:
    """The records' points stored as the sync stores a pass's (:func:`jobs.metric_store.store`)."""
    points = [p for record in records for p in sync.metric_point_tuples(record, T0)]
    metric_store.store(job.pk, points)
    TrainingJob.objects.filter(pk=job.pk).update(final_metrics=sync.final_metrics_after({}, points))


def _expected(records: list[dict], name: str) -> dict[str, list[tuple[int, float]]]:
    """Brute force: each step's min, median and max over the list's finite values."""
    out: dict[str, list[tuple[int, float]]] = {"min": [], "median": [], "max": []}
    for record in records:
        finite = [v for v in record[name] if v is not None]
        out["min"].append((record["step"], min(finite)))
        out["median"].append((record["step"], statistics.median(finite)))
        out["max"].append((record["step"], max(finite)))
    return out


def test_the_sync_stores_min_median_and_max_across_ranks_and_no_final_metric_of_them(job):
    records = _records(world=4, steps=6)
    _store(job, records)
    for name in ("rank_step_time_s", "rank_samples_per_s"):
        expected = _expected(records, name)
        for stat in ("min", "median", "max"):
            stored = list(MetricPoint.objects.filter(job=job, name=across_ranks_name(name, stat))
                          .order_by("step").values_list("step", "value", "rank", "epoch"))
            assert [s for s, _, _, _ in stored] == [s for s, _ in expected[stat]]
            assert [v for _, v, _, _ in stored] == pytest.approx([v for _, v in expected[stat]])
            assert {r for _, _, r, _ in stored} == {None}
            assert [e for _, _, _, e in stored] == [r["epoch"] for r in records]
    # Step 5's list had rank 1 not finite: the statistics are over the other three.
    at_5 = sorted(t for t in records[4]["rank_step_time_s"] if t is not None)
    assert MetricPoint.objects.get(job=job, name="rank_step_time_s:median", step=5).value == pytest.approx(at_5[1])
    # Statistics are not metrics the job reported: not final metrics, not in the API's summary.
    job.refresh_from_db()
    assert set(job.final_metrics) == {"train_loss"}
    assert set(selectors.training_job_metric_summary(job=job)) == {"train_loss"}
    assert {name for (_, name, _) in metric_buckets.summaries([job.pk], per_rank=False)} == {"train_loss"}


def test_a_one_rank_record_gets_no_statistics_and_an_all_nonfinite_list_a_gap(job):
    one = sync.metric_points_from_record(job, {"event": "step", "step": 1, "rank_step_time_s": [0.1]}, T0)
    assert [(p.name, p.rank) for p in one] == [("rank_step_time_s", 0)]
    bad = sync.metric_points_from_record(job, {"event": "step", "step": 2, "rank_step_time_s": [None, None],
                                               "nonfinite": ["rank_step_time_s"]}, T0)
    assert sorted((p.name, p.value) for p in bad if p.rank is None) == [
        ("rank_step_time_s:max", None), ("rank_step_time_s:median", None), ("rank_step_time_s:min", None)]


def test_a_64_rank_job_page_charts_the_statistics_names_the_slowest_rank_and_reads_no_rank_lines(job):
    TrainingJob.objects.filter(pk=job.pk).update(nodes=8, procs_per_node=8)
    job.refresh_from_db()
    records = _records(world=64, steps=3000)
    _store(job, records)
    expected = _expected(records, "rank_step_time_s")

    with CaptureQueriesContext(connection) as queries:
        charted = comparison.training_job_chart_series(job=job)
    assert charted["rank_lines"] is False and charted["rank_series"] == {}
    assert charted["slowest_rank"] == {"rank_step_time_s": SLOW, "rank_samples_per_s": SLOW}
    stats = charted["rank_stats"]["rank_step_time_s"]
    width = charted["widths"][1]
    assert width == 16  # 3,000 steps at ≤ 250 points a line
    # Each bucket's point is its last step's statistic, its band the extremes of the steps in it.
    for stat in ("min", "median", "max"):
        line = [p for p in stats[stat] if p["y"] is not None or "n" in p]
        assert len(line) == 3000 // width + 1
        for point in line:
            in_bucket = [v for s, v in expected[stat] if s // width == point["x"] // width]
            assert point["y"] == pytest.approx(dict(expected[stat])[point["x"]])
            assert (point["min"], point["max"]) == pytest.approx((min(in_bucket), max(in_bucket)))
    # Bounded reads: the summaries, the global lines and the statistics' lines; no line per rank. A line
    # at 16 steps a bucket (or 1) reads the raw points (jobs.metric_store: chunks and rows in one query).
    bucket_reads = [q["sql"] for q in queries.captured_queries
                    if MetricBucket._meta.db_table in q["sql"] or MetricChunk._meta.db_table in q["sql"]]
    assert len(bucket_reads) == 3, bucket_reads

    # The poll sends only the statistics' new points, merged by the page like a rank's line.
    last = charted["last_step"]
    _store(job, [dict(r, step=r["step"] + 3000, time=r["time"] + 3000) for r in records[:20]])
    polled = comparison.training_job_chart_series(job=job, after=last, widths=charted["widths"], attempt=job.attempt)
    assert polled["replace"] is False and polled["rank_series"] == {}
    assert polled["from_step"][1] == (last // width) * width
    assert [p["x"] for p in polled["rank_stats"]["rank_step_time_s"]["max"] if "n" in p][-1] == 3020


def test_a_small_job_keeps_its_rank_lines_beside_the_statistics(job):
    records = _records(world=2, steps=30)
    _store(job, records)
    with CaptureQueriesContext(connection) as queries:
        charted = comparison.training_job_chart_series(job=job)
    # The summaries, the global lines, then the ranks' lines and the statistics in one read.
    assert len(queries) == 3, [q["sql"][:80] for q in queries.captured_queries]
    assert charted["rank_lines"] is True
    assert set(charted["rank_series"]["rank_step_time_s"]) == {"0", "1"}
    assert [p["y"] for p in charted["rank_stats"]["rank_step_time_s"]["max"]] == pytest.approx(
        [v for _, v in _expected(records, "rank_step_time_s")["max"]])
    assert charted["slowest_rank"]["rank_step_time_s"] == SLOW % 2


def test_the_metrics_json_and_the_comparison_carry_the_statistics_of_a_many_rank_job(owner_client, job, user):
    TrainingJob.objects.filter(pk=job.pk).update(nodes=4, procs_per_node=8)
    _store(job, _records(world=32, steps=40))
    body = owner_client.get(reverse("job-metrics", kwargs={"pk": job.pk})).json()
    assert body["rank_lines"] is False and body["rank_series"] == {}
    assert set(body["rank_stats"]["rank_samples_per_s"]) == {"min", "median", "max"}
    assert body["slowest_rank"]["rank_samples_per_s"] == SLOW % 32
    assert "rank_step_time_s:max" not in body["series"] and "rank_step_time_s:max" not in body["metric_charts"]

    job.refresh_from_db()
    compared = comparison.training_job_comparison(jobs=[job])
    assert compared["rank_series"] == {}
    assert len(compared["rank_stats"]["rank_step_time_s"][str(job.pk)]["median"]) == 40
    per_rank = {m["name"] for m in compared["metrics"] if m["per_rank"]}
    assert per_rank == {"rank_step_time_s", "rank_samples_per_s"}
    assert not any(":" in m["name"] for m in compared["metrics"])
