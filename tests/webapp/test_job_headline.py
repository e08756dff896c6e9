"""The job page's headline (issue 27, items 12 and 13): progress, the latest values, cost and time at the
top, from the records the trainer (or a user's script) wrote, ingested the way the sync ingests them;
what a *my script* job shows (only what applies to it); "Total cost" once the job has ended."""

from __future__ import annotations

import datetime as dt
import html as html_lib
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from jobs import selectors
from jobs.models import MetricPoint, TrainingJob
from jobs.states import transition
from jobs.sync import final_metrics_after, metric_points_from_record

pytestmark = pytest.mark.django_db


def ingest(job, records) -> None:
    """Store trainer records as a sync does: their metric points, then the job's final metrics."""
    now = timezone.now()
    points = [p for record in records for p in metric_points_from_record(job, record, now)]
    MetricPoint.objects.bulk_create(points)
    TrainingJob.objects.filter(pk=job.pk).update(final_metrics=final_metrics_after(job.final_metrics, points))
    job.refresh_from_db()


def running(job, *, started_s_ago: float) -> None:
    start = timezone.now() - dt.timedelta(seconds=started_s_ago)
    transition(job, "SUBMITTING", submitted_at=start)
    transition(job, "PENDING")
    transition(job, "RUNNING", started_at=start)


def trainer_records(start: float) -> list[dict]:
    """Epoch 0 of 3 ended at step 20 (validated), then epoch 1 up to step 30; 10 s a record."""
    return [
        {"event": "step", "time": start + 10, "epoch": 0, "step": 10, "lr": 0.05, "train_loss": 1.9,
         "train_accuracy": 0.41},
        {"event": "epoch", "time": start + 20, "epoch": 0, "step": 20, "lr": 0.05, "train_loss": 0.8,
         "train_accuracy": 0.77, "val_loss": 0.6123, "val_accuracy": 0.8412},
        {"event": "step", "time": start + 30, "epoch": 1, "step": 30, "lr": 0.05, "train_loss": 0.4567,
         "train_accuracy": 0.9012},
    ]


def headline_html(page: str) -> str:
    start = page.index('id="job-headline"')
    return html_lib.unescape(page[start:page.index('id="job-details"', start)]) if 'id="job-details"' in page[start:] \
        else html_lib.unescape(page[start:])


def test_the_headline_shows_progress_latest_values_cost_and_eta(owner_client, job):
    running(job, started_s_ago=60)
    start = job.started_at.timestamp()
    ingest(job, trainer_records(start))  # config: 3 epochs; the first took 20 steps
    page = owner_client.get(reverse("job-detail", args=[job.pk])).content.decode()
    head = headline_html(page)
    assert re.search(r'id="progress-value">epoch 2 of 3<', head)
    assert re.search(r'id="progress-steps">step 30 of about 60 · 50%<', head)
    assert 'id="progress-bar" max="1" value="0.5000"' in head
    latest = dict(re.findall(r'data-metric="([^"]+)">([^<]+)<', head))
    assert latest == {"train_loss": "0.4567", "val_loss": "0.6123", "train_accuracy": "0.9012",
                      "val_accuracy": "0.8412"}
    assert re.search(r'id="stat-cost-label">Cost so far<', head)
    # 30 s of training did half: about 30 s are left.
    assert re.search(r'id="stat-eta">about 30s left<', head)
    # The headline comes before the charts, the timeline and the tables after them.
    assert page.index('id="job-headline"') < page.index('id="chart-loss"') < page.index('id="timeline"')
    assert page.index('id="chart-loss"') < page.index('id="job-experiment"') < page.index('id="job-config"')


def test_the_headline_reads_two_points_not_the_history(owner_client, job):
    running(job, started_s_ago=60)
    start = job.started_at.timestamp()
    ingest(job, trainer_records(start) + [
        {"event": "step", "time": start + 30 + i, "epoch": 1, "step": 31 + i, "lr": 0.05, "train_loss": 0.4}
        for i in range(200)])
    with CaptureQueriesContext(connection) as queries:
        headline = selectors.training_job_headline(job=job)
    assert headline["step"] == 230 and headline["total_steps"] == 60 and headline["fraction"] == 1.0
    assert len(queries) == 2
    assert all("LIMIT 1" in q["sql"] and "ORDER BY" in q["sql"] for q in queries.captured_queries)


def test_max_steps_is_the_total_and_a_finished_job_shows_its_total_cost(owner_client, job):
    TrainingJob.objects.filter(pk=job.pk).update(config={**job.config, "train": {**job.config["train"], "max_steps": 40}})
    job.refresh_from_db()
    running(job, started_s_ago=60)
    ingest(job, trainer_records(job.started_at.timestamp()))
    head = headline_html(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    assert re.search(r'id="progress-steps">step 30 of 40 · 75%<', head)
    transition(job, "SUCCEEDED")
    live = html_lib.unescape(owner_client.get(reverse("job-live", args=[job.pk])).content.decode())
    assert re.search(r'id="stat-cost-label">Total cost<', live) and "Cost so far" not in live
    assert re.search(r'id="progress-steps">step 30 of 40 · 100%<', live) and 'id="stat-eta"' not in live


def test_a_job_without_points_says_so(owner_client, job):
    head = headline_html(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    assert re.search(r'id="progress-value">queued<', head)
    assert "no loss or accuracy reported yet" in head and 'id="progress-bar"' not in head


def script_job(job):
    config = {**job.config, "code": {**job.config["code"], "dir": "/code", "script": "train.py",
                                     "args": ["--epochs", "2"]}}
    TrainingJob.objects.filter(pk=job.pk).update(config=config)
    job.refresh_from_db()
    return job


def test_a_script_job_shows_only_what_applies_to_it(owner_client, job):
    script_job(job)
    running(job, started_s_ago=30)
    t = job.started_at.timestamp()
    ingest(job, [{"event": "step", "time": t + 1, "step": 5, "my_loss": 0.75, "tokens/s": 812000.0,
                  "user_metrics": ["my_loss", "tokens/s"]},
                 {"event": "step", "time": t + 2, "step": 6, "my_loss": 0.5, "tokens/s": 815000.0,
                  "user_metrics": ["my_loss", "tokens/s"]}])
    page = html_lib.unescape(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    head = headline_html(page)
    assert dict(re.findall(r'data-metric="([^"]+)">([^<]+)<', head)) == {"my_loss": "0.5", "tokens/s": "8.15e+05"}
    assert re.search(r'id="progress-value">step 6<', head) and "epoch" not in head
    assert 'id="progress-bar"' not in head  # a script's own epochs are not known
    # The config panel: what the launcher hands the script, not the trainer's model, data or train sections.
    config = page[page.index('id="job-config"'):]
    config = config[:config.index("</details>")]
    assert "What the launcher gives the script" in config and '"script": "train.py"' in config
    assert '"arch"' not in config and '"lr"' not in config and '"train"' not in config
    assert '"epochs"' not in config and '"output"' in config
    # The built-in dataset has no path to hand the script: no fingerprint row, no "on digits".
    assert 'id="code-fingerprint"' not in page


def test_a_trainer_job_shows_its_whole_config(owner_client, job):
    page = html_lib.unescape(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    config = page[page.index('id="job-config"'):]
    assert "Frozen trainer config" in config and '"arch": "cnn"' in config and '"lr": 0.05' in config


def test_the_headline_says_each_figure_once_and_nothing_that_reads_zero(owner_client, job):
    """A script's job of a known length: "step 20 of 20" once (not "step 20 / step 20 of 20"); a FAILED
    job that never stepped says so (not "no step logged yet"); the straggler line only when it is not $0
    and 0 s; the preflight's figures with no space before their punctuation, read element by element."""
    from jobs import metric_buckets, preflight as job_preflight, progress

    script_job(job)
    running(job, started_s_ago=30)
    t = job.started_at.timestamp()
    ingest(job, [{"event": "step", "time": t + 1, "step": 10, "my_loss": 0.75, "wait_for_slowest_s": 0.1,
                  "user_metrics": ["my_loss"]},
                 {"event": "step", "time": t + 2, "step": 20, "my_loss": 0.5, "wait_for_slowest_s": 0.2,
                  "user_metrics": ["my_loss"]}])
    metric_buckets.rebuild(job.pk)
    fields = progress.progress_after({f: getattr(job, f) for f in progress.PROGRESS_FIELDS}, [
        {"event": "step", "step": 10, "time": t + 1, "total_steps": 20},
        {"event": "step", "step": 20, "time": t + 2, "total_steps": 20}])
    record = {"event": "preflight", "time": t, "world_size": 2, "nodes": 1, "backend": "gloo", "device": "cpu",
              "busbw_gbps": 1.2, "algbw_gbps": 1.2, "latency_us": 511.2, "sizes": [],
              "pairs": [{"units": [0, 1], "ranks": [0, 1], "hosts": ["vm", "vm"], "gbps": 2.189}],
              "pairs_measured": 1, "pair_unit": "rank", "slow_unit": None, "duration_s": 0.68,
              "min_busbw_gbps": None, "max_latency_us": None, "ok": True, "reason": ""}
    TrainingJob.objects.filter(pk=job.pk).update(**fields, hourly_price_usd=3.6, instance_count=1,
                                                 preflight=job_preflight.from_record(record))
    job.refresh_from_db()
    assert selectors.training_job_waste(job=job)["straggler_s"] == pytest.approx(0.3)
    page = html_lib.unescape(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    head = headline_html(page)
    assert re.search(r'id="progress-value">step 20 of 20</span>\s*<span class="stat-sub" id="progress-steps">100% done<',
                     head), head
    assert "while ranks waited" not in head and 'id="stat-waste-straggler"' not in head
    start = page.index('id="job-preflight"')
    text = " ".join(re.sub(r"<[^>]+>", " ", page[start:page.index("</span>", page.index("(measured", start))]).split())
    assert ("Network preflight passed. All-reduce bus bandwidth 1.200 GB/s (algbw 1.200 GB/s) · latency 511 µs · "
            "slowest rank pair 2.189 GB/s · 2 ranks on 1 node, gloo.") in text, text
    assert " ," not in text and " ;" not in text

    ingest(job, [{"event": "step", "time": t + 3, "step": 20, "my_loss": 0.5, "wait_for_slowest_s": 45.0,
                  "user_metrics": ["my_loss"]}])
    metric_buckets.rebuild(job.pk)
    head = headline_html(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    # 45.3 rank-s × $3.60/h / 2 ranks per node = $0.0227, at the job's cents
    assert re.search(r'id="stat-waste-straggler"[^>]*>\$0\.02 while ranks waited for the slowest \(45s of rank time\)<',
                     head), head

    other = TrainingJob.objects.create(owner=job.owner, dataset=job.dataset, model_spec=job.model_spec,
                                       backend=job.backend, config=job.config, name="never-stepped")
    running(other, started_s_ago=5)
    transition(other, "FAILED", failure_reason="exit code 1")
    head = headline_html(owner_client.get(reverse("job-detail", args=[other.pk])).content.decode())
    assert re.search(r'id="progress-value">no step reported</span>\s*'
                     r'<span class="stat-sub" id="progress-steps">failed before its first step<', head), head
    assert "no step logged yet" not in head and "has reported no step yet" not in head
