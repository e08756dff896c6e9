"""The job page, its live fragment and its metrics JSON for seeded metric points and events."""

from __future__ import annotations

import json
import re

import pytest
from django.urls import reverse

from jobs.models import MetricPoint

pytestmark = pytest.mark.django_db


def test_metrics_json_has_the_chart_series(owner_client, seeded_job):
    response = owner_client.get(reverse("job-metrics", args=[seeded_job.pk]))
    assert response.status_code == 200
    assert response["Cache-Control"].startswith("max-age=0")
    body = response.json()
    assert body["state"] == "RUNNING" and body["is_terminal"] is False
    # Each point: step, value and its time (unix seconds, for the charts' time axes).
    t = round(MetricPoint.objects.filter(job=seeded_job).first().recorded_at.timestamp(), 3)
    assert body["t0"] == t
    assert body["series"]["train_loss"] == [{"x": 10, "y": 2.3, "t": t}, {"x": 20, "y": 1.2, "t": t},
                                            {"x": 30, "y": 0.4, "t": t}]
    assert body["series"]["train_accuracy"] == [{"x": 10, "y": 0.11, "t": t}, {"x": 20, "y": 0.62, "t": t},
                                                {"x": 30, "y": 0.9, "t": t}]
    assert body["series"]["val_loss"] == [{"x": 30, "y": 0.55, "t": t}]
    assert body["series"]["val_accuracy"] == [{"x": 30, "y": 0.87, "t": t}]
    # The per-rank series: one list per rank.
    assert body["rank_series"]["rank_samples_per_s"]["0"][0]["x"] == 30
    assert set(body["rank_series"]) == {"rank_samples_per_s", "rank_step_time_s"}


def test_detail_page_embeds_the_same_series_and_keeps_canvases_outside_the_fragment(owner_client, seeded_job):
    page = owner_client.get(reverse("job-detail", args=[seeded_job.pk])).content.decode()
    embedded = re.search(r'<script id="metrics-data" type="application/json">(.*?)</script>', page, re.S)
    assert [(p["x"], p["y"]) for p in json.loads(embedded.group(1))["series"]["val_accuracy"]] == [(30, 0.87)]
    live_start = page.index('id="job-live"')
    charts = page.index('id="chart-loss"')
    details = page.index('id="job-details"')
    assert live_start < charts < details
    # The polling element ends before the charts begin.
    live_html = page[live_start:charts]
    assert 'hx-trigger="every 2s"' in live_html
    assert "chart.umd.min.js" in page and "webapp/js/job.js" in page


def test_live_fragment_renders_status_timeline_cost_ranks_and_log(owner_client, seeded_job):
    response = owner_client.get(reverse("job-live", args=[seeded_job.pk]))
    html = response.content.decode()
    assert response.status_code == 200
    assert 'hx-trigger="every 2s"' in html  # still polling: RUNNING
    assert 'data-state="RUNNING"' in html
    assert 'id="stat-cost">$0.09<' in html
    assert 'id="stat-billable">90<' in html
    # What the limit counts: start-up included, the backend's own wording in the title.
    assert re.search(r'id="stat-limit" title="Max runtime counts the run from the moment the job starts on the '
                     r'box[^"]*">limit [^<]+, start-up included</span>', html)
    assert 'id="cancel-job"' in html
    # Timeline: the four transitions, in order, with timestamps.
    timeline = html[html.index('id="timeline"'):html.index('id="rank-table"')]
    assert re.findall(r'data-state="(\w+)">', timeline) == [
        "QUEUED", "QUEUED", "SUBMITTING", "SUBMITTING", "PENDING", "PENDING", "RUNNING"]
    assert timeline.count("<time ") == 4
    # Rank table: the latest per-rank values.
    ranks = html[html.index('id="rank-table"'):html.index('id="log-tail"')]
    assert "812.5" in ranks and "798.3" in ranks and "0.0394 s" in ranks and "0.0401 s" in ranks
    # Log: the last 200 of 250 lines.
    log = html[html.index('id="log-tail"'):]
    assert "log line 249" in log and "log line 50\n" in log and "log line 49\n" not in log
    # The details are swapped out of band.
    assert 'id="job-details" class="job-details" hx-swap-oob="true"' in html


def test_live_fragment_stops_polling_when_terminal_and_shows_the_failure(owner_client, seeded_job):
    from jobs.states import transition

    transition(seeded_job, "FAILED", message="exit 1", failure_reason="rank 1 exited with code 1: CUDA OOM")
    html = owner_client.get(reverse("job-live", args=[seeded_job.pk])).content.decode()
    assert "hx-trigger" not in html
    assert 'data-terminal="true"' in html
    assert "rank 1 exited with code 1: CUDA OOM" in html
    assert 'class="alert alert-error failure"' in html
    assert 'id="cancel-job"' not in html and 'id="rerun-job"' in html
    metrics = owner_client.get(reverse("job-metrics", args=[seeded_job.pk])).json()
    assert metrics["is_terminal"] is True and metrics["state"] == "FAILED"


def test_job_list_shows_state_badge_duration_and_cost(owner_client, seeded_job):
    html = owner_client.get(reverse("job-list")).content.decode()
    row = html[html.index('id="job-table"'):]
    assert 'class="badge state-running" data-state="RUNNING">Running<' in row
    assert "$0.09" in row
    assert re.search(r">1m \d\ds<", row)  # started 90 s ago


@pytest.mark.parametrize("query", ["steps=0,99999999999999999999999", "steps=99999999999999999999999,99999999999999999999999",
                                   "steps=20,20", "steps=-5,10", "steps=9,3", "steps=a,b", "steps=" + "9" * 5000 + ",1",
                                   "after=99999999999999999999999&widths=1,1&attempt=1",
                                   "after=-99999999999999999999999&widths=1,1&attempt=1",
                                   "after=10&widths=99999999999999999999999,1&attempt=99999999999999999999999"])
def test_metrics_json_takes_any_poll_or_zoom_query_without_a_server_error(owner_client, seeded_job, query):
    """Out-of-range, reversed or malformed ``steps``/``after``/``widths``/``attempt`` (past a bigint
    too): a full or empty read, never a 500; a range past the last step holds what the job has."""
    response = owner_client.get(reverse("job-metrics", args=[seeded_job.pk]) + "?" + query)
    assert response.status_code == 200, query
    body = response.json()
    losses = [p["x"] for p in body["series"].get("train_loss", [])]
    if query == "steps=0,99999999999999999999999":
        assert losses == [10, 20, 30] and body["steps"] == [0, 99999999999999999999999]
    elif query == "steps=99999999999999999999999,99999999999999999999999":
        assert losses == [] and body["replace"] is True
    elif query == "steps=20,20":
        assert losses == [20] and body["steps"] == [20, 20]
    elif query.startswith("steps="):  # malformed: the whole chart
        assert losses == [10, 20, 30] and "steps" not in body
