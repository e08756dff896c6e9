"""Log lines carry ``is_metric`` (a trainer metric record), set from their text however they are
stored, and lines stored before the flag are marked by migration 0030: the log tail, the log page
without records and the user-code failure reason read the other lines by the partial index
``logline_text_seq`` instead of scanning a log that is mostly metric records."""

from __future__ import annotations

from importlib import import_module

import pytest
from django.apps import apps as django_apps
from django.db import connection, models
from django.test.utils import CaptureQueriesContext

from jobs import selectors
from jobs.models import JobLogLine
from trainer_pkg.metrics import format_metric_line

pytestmark = pytest.mark.django_db

RECORD = format_metric_line({"event": "step", "step": 3, "time": 1.0, "train_loss": 0.5})


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    from jobs import dispatch, services
    from taskkit import sent_tasks

    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=local_backend, epochs=1, name="logged")


def test_every_way_of_storing_a_line_sets_the_flag_from_its_text(job):
    JobLogLine.objects.bulk_create([JobLogLine(job=job, seq=0, text="[launch] rank 0"),
                                    JobLogLine(job=job, seq=1, text=f"[node 1] {RECORD}")])
    JobLogLine.objects.create(job=job, seq=2, text=RECORD)
    line = JobLogLine(job=job, seq=3, text="plain", is_metric=True)  # the text decides, not the caller
    line.save()
    assert list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", "is_metric")) == [
        (0, False), (1, True), (2, True), (3, False)]


def test_the_tail_reads_the_last_plain_lines_behind_many_records(job):
    lines = [JobLogLine(job=job, seq=i, text=f"plain {i}") for i in range(5)]
    lines += [JobLogLine(job=job, seq=5 + i, text=RECORD) for i in range(3000)]
    lines += [JobLogLine(job=job, seq=3005 + i, text=f"late {i}") for i in range(2)]
    JobLogLine.objects.bulk_create(lines)
    with CaptureQueriesContext(connection) as queries:
        tail = selectors.training_job_log_tail(job=job, lines=4)
    assert tail == ["plain 3", "plain 4", "late 0", "late 1"]
    assert len(queries) == 1 and '"is_metric"' in queries[0]["sql"] and "LIKE" not in queries[0]["sql"]
    page = selectors.training_job_log_lines(job=job)
    assert [line.text for line in page] == [f"plain {i}" for i in range(5)] + ["late 0", "late 1"]
    assert selectors.training_job_log_lines(job=job, metrics=True).count() == 3007


def test_the_migration_marks_the_lines_stored_before_the_flag(job):
    models.QuerySet.bulk_create(JobLogLine.objects.all(), [JobLogLine(job=job, seq=0, text=RECORD),
                                                         JobLogLine(job=job, seq=1, text="plain")])
    assert not JobLogLine.objects.filter(job=job, is_metric=True).exists()
    import_module("jobs.migrations.0030_log_line_is_metric").mark_metric_lines(django_apps, None)
    assert list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("is_metric", flat=True)) == [True, False]
