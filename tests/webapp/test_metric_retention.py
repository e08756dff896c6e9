"""The operator's metric retention (jobs.metric_retention): a job's step-level points go a set number
of days after it ended; its buckets, per-epoch validation points, final values and charts stay."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse

from jobs import comparison, metric_buckets, metric_retention, selectors
from jobs.models import MetricBucket, MetricPoint, TrainingJob

pytestmark = pytest.mark.django_db

NOW = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.timezone.utc)


def _history(job, steps: int = 3000) -> None:
    """A 2-rank run: train_loss every step (a spike at 1234), rank step times, val_loss per 1000 steps."""
    t0 = NOW - dt.timedelta(days=30)
    points = []
    for step in range(1, steps + 1):
        at = t0 + dt.timedelta(seconds=step)
        points.append(MetricPoint(job=job, name="train_loss", step=step, epoch=step // 1000,
                                  value=9.0 if step == 1234 else 1.0 / step, recorded_at=at))
        points += [MetricPoint(job=job, name="rank_step_time_s", step=step, epoch=step // 1000, rank=r,
                               value=0.1 + r / 100, recorded_at=at) for r in (0, 1)]
        if step % 1000 == 0:
            points.append(MetricPoint(job=job, name="val_loss", step=step, epoch=step // 1000 - 1,
                                      value=1.0 / step, recorded_at=at))
    MetricPoint.objects.bulk_create(points)


def _end(job, state: str, days_ago: float | None) -> None:
    TrainingJob.objects.filter(pk=job.pk).update(
        state=state, ended_at=None if days_ago is None else NOW - dt.timedelta(days=days_ago))
    job.refresh_from_db()


def test_off_by_default_and_a_job_within_its_days_or_running_keeps_every_point(job, settings):
    _history(job, steps=100)
    _end(job, "SUCCEEDED", days_ago=400)
    assert metric_retention.prune_metric_points(now=NOW) == {"jobs": 0, "rows": 0}  # retention off
    settings.TRAINBOARD_METRIC_POINTS_RETENTION_DAYS = 7
    _end(job, "SUCCEEDED", days_ago=6.9)
    assert metric_retention.prune_metric_points(now=NOW) == {"jobs": 0, "rows": 0}
    _end(job, "RUNNING", days_ago=None)
    assert metric_retention.prune_metric_points(now=NOW) == {"jobs": 0, "rows": 0}
    assert MetricPoint.objects.filter(job=job).count() == 100 * 3
    assert metric_retention.prune_after(job) is None


def test_a_job_past_its_retention_keeps_buckets_validation_points_and_charts(job, settings, owner_client):
    settings.TRAINBOARD_METRIC_POINTS_RETENTION_DAYS = 7
    _history(job)
    _end(job, "SUCCEEDED", days_ago=8)
    assert metric_retention.prune_after(job) == NOW - dt.timedelta(days=1)
    summary_before = metric_buckets.summaries([job.pk])
    buckets_before = MetricBucket.objects.filter(job=job).count()
    chart_before = comparison.training_job_chart_series(job=job)
    assert chart_before["widths"] == [16, 16]

    # Bounded calls: 5,000 rows at most each, until the job is marked pruned.
    calls = []
    while not calls or calls[-1]["jobs"] == 0:
        calls.append(metric_retention.prune_metric_points(now=NOW, max_rows=5000))
        assert len(calls) < 10
    assert [c["rows"] for c in calls] == [5000, 4000]  # 3,000 losses + 6,000 rank times; the 3 val_loss kept
    job.refresh_from_db()
    assert job.metric_points_pruned_at == NOW
    assert sorted(MetricPoint.objects.filter(job=job).values_list("name", "step")) == [
        ("val_loss", 1000), ("val_loss", 2000), ("val_loss", 3000)]
    # Buckets untouched: the summaries read the same. The charts read the finest stored level, 256 steps
    # (16-step buckets are folded from the points when read: jobs.metric_fold.STORED_WIDTHS), each bucket
    # the last point of its 256 with their band, so the spike is still in its band.
    assert MetricBucket.objects.filter(job=job).count() == buckets_before
    assert metric_buckets.summaries([job.pk]) == summary_before
    chart_after = comparison.training_job_chart_series(job=job)
    assert chart_after["widths"] == [256, 256] and chart_after["last_step"] == chart_before["last_step"]
    loss = chart_after["series"]["train_loss"]
    assert [p["x"] for p in loss if "n" in p] == [255 + 256 * b for b in range(11)] + [3000]
    assert loss[-1]["y"] == 1.0 / 3000
    # A zoom that would read the points themselves reads 256-step buckets.
    zoomed = comparison.training_job_chart_series(job=job, steps=(1200, 1300))
    assert zoomed["widths"] == [256, 256]
    spike = next(p for p in zoomed["series"]["train_loss"] if p["x"] // 256 == 1234 // 256)
    assert spike["max"] == 9.0 and spike["n"] == 256
    assert zoomed["rank_series"]["rank_step_time_s"]["1"][0]["y"] == pytest.approx(0.11)
    # The comparison too, and the API's summary.
    compared = comparison.training_job_comparison(jobs=[job])
    assert compared["table"][0]["values"]["train_loss"] == {"final": 1.0 / 3000, "best": 1.0 / 3000}
    assert selectors.training_job_metric_summary(job=job)["train_loss"]["points"] == 3000
    # Nothing left to do: a second pass changes nothing.
    assert metric_retention.prune_metric_points(now=NOW) == {"jobs": 0, "rows": 0}

    page = owner_client.get(reverse("job-detail", kwargs={"pk": job.pk})).content.decode()
    assert "the step-level points were removed on 2026-12-07 12:00 UTC, 7 days after the job ended" in page
    assert "The charts show 256-step buckets" in page
    api = owner_client.get(f"/api/jobs/{job.pk}/").json()
    assert api["metric_points_pruned_at"] == "2026-12-07T12:00:00Z"


def test_the_page_says_until_when_every_point_is_kept(job, settings, owner_client):
    settings.TRAINBOARD_METRIC_POINTS_RETENTION_DAYS = 2.5
    TrainingJob.objects.filter(pk=job.pk).update(state="FAILED", ended_at=dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc))
    page = owner_client.get(reverse("job-detail", kwargs={"pk": job.pk})).content.decode()
    assert "every step is kept until 2026-12-03 12:00 UTC (2.5 days after the job ended" in page
    assert "then the charts show 256-step buckets." in page
    settings.TRAINBOARD_METRIC_POINTS_RETENTION_DAYS = 0
    page = owner_client.get(reverse("job-detail", kwargs={"pk": job.pk})).content.decode()
    assert 'id="metric-retention"' not in page and "digits-ddp" in page


def test_a_job_whose_points_are_in_chunks_loses_them_too(job, settings, monkeypatch):
    """Retention removes sealed chunks (jobs.metric_store) as it removes rows, counted by their points,
    and keeps the validation points."""
    from jobs import metric_store
    from jobs.models import MetricChunk

    settings.TRAINBOARD_METRIC_POINTS_RETENTION_DAYS = 7
    _history(job)
    monkeypatch.setattr(metric_store, "CHUNK_POINTS", 256)
    assert metric_store.compact(job.pk, max_chunks=10**6) == 3 * (3000 // 256)
    _end(job, "SUCCEEDED", days_ago=8)
    assert metric_retention.prune_metric_points(now=NOW) == {"jobs": 1, "rows": 9000}
    assert not MetricChunk.objects.filter(job=job).exists()
    assert sorted(MetricPoint.objects.filter(job=job).values_list("name", "step")) == [
        ("val_loss", 1000), ("val_loss", 2000), ("val_loss", 3000)]
