"""A trainer metric record is stored once, as metric points: the sync does not store its text as a
log line, the log's ``seq`` runs without gaps over the other lines, and what later reads need from
the rare records (a ``failed`` record's reason, an ``epoch`` record's ``epochs_done``) is kept on the
job. Jobs logged before, whose records are ``is_metric`` rows, read as they did."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from cloud_adapters.base import JobState, JobStatus
from jobs import selectors, sync
from jobs.models import JobLogLine, JobStateChoices as S, MetricPoint
from trainer_pkg.metrics import format_metric_line

from test_sync import T0, ScriptedBackend, rec, scripted_backend, submitted_job  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db


def test_records_become_points_and_the_log_keeps_the_other_lines_numbered_without_gaps(
        submitted_job, scripted_backend):  # noqa: F811
    job = submitted_job
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="RUNNING", started_at=T0, instance_count=2)] * 2
    ScriptedBackend.log_chunks = [
        ["[launch] rank 0", rec("started", dt=1, epoch=0, step=1, world_size=4, train_loss=2.0),
         rec("step", dt=2, epoch=0, step=5, train_loss=1.5), "epoch 0 going well"],
        [rec("epoch", dt=3, epoch=0, step=8, val_loss=0.9, epochs_done=1),
         rec("step", dt=4, epoch=1, step=9, train_loss=1.0),
         "TRAINBOARD_METRIC {\"event\": \"step\", cut by another rank",  # malformed: an ordinary line
         rec("epoch", dt=5, epoch=1, step=12, val_loss=0.7, epochs_done=2)],
    ]
    sync.backend_sync(backend_id=scripted_backend.pk)
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", "text", "is_metric")) == [
        (0, "[launch] rank 0", False), (1, "epoch 0 going well", False),
        (2, "TRAINBOARD_METRIC {\"event\": \"step\", cut by another rank", False)]
    assert list(MetricPoint.objects.filter(job=job, name="train_loss").order_by("step")
                .values_list("step", "value")) == [(5, 1.5), (9, 1.0)]
    assert list(MetricPoint.objects.filter(job=job, name="val_loss").order_by("step")
                .values_list("step", "value")) == [(8, 0.9), (12, 0.7)]
    assert (job.checkpoint_epochs_done, job.trainer_failure_reason) == (2, "")
    assert selectors.training_job_checkpoint_epoch(job=job) == 2
    assert not selectors.training_job_has_metric_lines(job=job)
    # The whole log, the tail and the cursor read see the same three lines.
    assert "".join(selectors.training_job_log_text(job=job)) == (
        "[launch] rank 0\nepoch 0 going well\nTRAINBOARD_METRIC {\"event\": \"step\", cut by another rank\n")
    assert selectors.training_job_log_tail(job=job, lines=2) == [
        "epoch 0 going well", "TRAINBOARD_METRIC {\"event\": \"step\", cut by another rank"]
    assert selectors.training_job_log_after(job=job, after=0) == (
        [(1, "epoch 0 going well"), (2, "TRAINBOARD_METRIC {\"event\": \"step\", cut by another rank")], 2, False)


def test_the_trainers_failure_reason_is_kept_from_its_record_not_the_log(submitted_job, scripted_backend):  # noqa: F811
    job = submitted_job
    ScriptedBackend.statuses = [
        JobStatus(JobState.RUNNING, raw_state="RUNNING", started_at=T0, instance_count=2),
        JobStatus(JobState.FAILED, raw_state="exit 1", started_at=T0, ended_at=T0 + dt.timedelta(seconds=9),
                  failure_reason="exited with status 1")]
    ScriptedBackend.log_chunks = [[rec("failed", dt=4, epoch=0, step=4, reason="  loss became NaN at step 3 "),
                                   "bye"]]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert (job.state, job.trainer_failure_reason) == (S.RUNNING, "loss became NaN at step 3")
    assert list(JobLogLine.objects.filter(job=job).values_list("seq", "text")) == [(0, "bye")]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert job.state == S.FAILED
    assert job.failure_reason == "loss became NaN at step 3 (the backend reported: exited with status 1)"


def test_a_job_logged_with_its_records_as_lines_reads_as_before(submitted_job):  # noqa: F811
    """Rows an older Trainboard stored (records as ``is_metric`` lines, nothing kept on the job)."""
    job = submitted_job
    texts = ["[launch] rank 0", format_metric_line({"event": "epoch", "epoch": 0, "step": 8, "epochs_done": 1}),
             "plain", format_metric_line({"event": "failed", "step": 9, "reason": "loss became NaN at step 9"}),
             "last"]
    JobLogLine.objects.bulk_create(JobLogLine(job=job, seq=i, text=t) for i, t in enumerate(texts))
    assert selectors.training_job_has_metric_lines(job=job)
    assert selectors.training_job_checkpoint_epoch(job=job) == 1
    assert sync._trainer_failure_reason(job) == "loss became NaN at step 9"
    assert selectors.training_job_log_tail(job=job) == ["[launch] rank 0", "plain", "last"]
    page = selectors.training_job_log_page(job=job, per_page=2)
    assert (page.count, page.num_pages, page.number, page.lines) == (3, 2, 2, [(4, "last")])
    page = selectors.training_job_log_page(job=job, per_page=2, page=1, metrics=True)
    assert (page.count, page.num_pages, page.lines) == (5, 3, [(0, texts[0]), (1, texts[1])])
    assert "".join(selectors.training_job_log_text(job=job)) == "".join(f"{t}\n" for t in texts)
    # A newer sync's lines continue the numbering after the old rows.
    job.refresh_from_db()
    assert sync._ingest_lines(job, ["new", texts[1]], 5, T0, str)[0] == 6
    assert selectors.training_job_log_after(job=job, after=3) == ([(4, "last"), (5, "new")], 5, False)


def test_the_log_page_of_a_newer_job_reads_its_page_by_seq_range(submitted_job):  # noqa: F811
    job = submitted_job
    JobLogLine.objects.bulk_create(JobLogLine(job=job, seq=i, text=f"line {i}") for i in range(1001))
    with CaptureQueriesContext(connection) as queries:
        page = selectors.training_job_log_page(job=job)
    assert (page.count, page.num_pages, page.number) == (1001, 3, 3)
    assert page.lines == [(1000, "line 1000")]
    # the metric-row probe, min/max seq, the page's range: no count, no OFFSET
    assert len(queries) == 3 and not any("COUNT(" in q["sql"].upper() or "OFFSET" in q["sql"].upper()
                                         for q in queries)
    page = selectors.training_job_log_page(job=job, page=2)
    assert page.lines == [(i, f"line {i}") for i in range(500, 1000)]
    assert selectors.training_job_log_page(job=job, page=0).lines[0] == (0, "line 0")
    empty = selectors.training_job_log_page(job=job, q="nothing like it")
    assert (empty.count, empty.num_pages, empty.lines) == (0, 1, [])


def test_the_log_page_offers_metric_records_only_for_a_job_that_has_them_as_lines(submitted_job, client, user):  # noqa: F811
    job = submitted_job
    client.force_login(user)
    JobLogLine.objects.create(job=job, seq=0, text="plain")
    html = client.get(f"/jobs/{job.pk}/logs/").content.decode()
    assert 'id="log-metrics"' not in html and "metric records hidden" not in html
    assert "1 line · page 1 of 1" in html
    JobLogLine.objects.create(job=job, seq=1, text=format_metric_line({"event": "step", "step": 1}))
    html = client.get(f"/jobs/{job.pk}/logs/").content.decode()
    assert 'id="log-metrics"' in html and "1 line (metric records hidden) · page 1 of 1" in html
