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
