"""The operator's retention of metric points: a job's step-level points are removed a set number of
days after it ended, and its charts go on from its buckets (docs/comparing-runs.md, "Retention").

``TRAINBOARD_METRIC_POINTS_RETENTION_DAYS`` (days, a float; 0, the default, keeps every point): once a
job has been terminal that long, :func:`prune_metric_points` deletes its :class:`~jobs.models.MetricPoint`
rows and :class:`~jobs.models.MetricChunk` chunks except the per-epoch validation points (names starting ``val_``, one per epoch: the job's timeline
and the epochs a continued job starts from read them) and sets ``metric_points_pruned_at``. Kept: every
bucket (:mod:`jobs.metric_buckets`: each 256 steps' last value, min, max and count, and the coarser
levels), so its charts, comparisons and summaries look the same, a zoom reading 256-step buckets where it
would have read the points themselves (:func:`finest_width`); ``final_metrics``; the log (metric records included).

A beat task (``jobs.tasks.prune_metric_points``, hourly) calls it. Each call deletes at most
``max_rows`` rows, :data:`BATCH_ROWS` per transaction, oldest ended job first, so no call holds a lock or
a worker for long whatever the histories' sizes; a job is marked pruned only once none of its step-level
points is left, and the next call goes on where this one stopped.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs.metric_fold import STORED_WIDTHS
from jobs.models import TERMINAL_STATE_VALUES, MetricChunk, MetricPoint, TrainingJob

log = logging.getLogger(__name__)

KEPT_PREFIX = "val_"
"""Points whose name starts with this are kept: the per-epoch validation metrics."""
BATCH_ROWS = 20_000
"""Rows deleted per transaction."""


def retention_days() -> float:
    """The operator's ``TRAINBOARD_METRIC_POINTS_RETENTION_DAYS`` (0: keep every point)."""
    return float(getattr(settings, "TRAINBOARD_METRIC_POINTS_RETENTION_DAYS", 0) or 0)


def prune_after(job: TrainingJob) -> dt.datetime | None:
    """When ``job``'s step-level points are due to go: its end plus the retention; None while it runs
    or when retention is off."""
    days = retention_days()
    if days <= 0 or job.ended_at is None or job.state not in TERMINAL_STATE_VALUES:
        return None
    return job.ended_at + dt.timedelta(days=days)


PRUNED_WIDTH = STORED_WIDTHS[0]
"""Steps per bucket of a pruned job's finest chart read: the finest stored level."""


def finest_width(job: TrainingJob) -> int:
    """The finest resolution ``job``'s charts can read: 1 (its points) or, once pruned, the finest
    stored bucket level (:data:`jobs.metric_fold.STORED_WIDTHS`: the 16-step level is folded from the
    points when read, and they are gone)."""
    return PRUNED_WIDTH if job.metric_points_pruned_at is not None else 1


def prune_metric_points(*, now: dt.datetime | None = None, max_rows: int = 1_000_000) -> dict[str, int]:
    """Remove the step-level points of every job past its retention (module docstring), at most
    ``max_rows`` rows this call. Returns ``{"jobs": jobs marked pruned, "rows": rows deleted}``; both 0
    when retention is off."""
    days = retention_days()
    if days <= 0:
        return {"jobs": 0, "rows": 0}
    now = now or timezone.now()
    due = (TrainingJob.objects.filter(state__in=TERMINAL_STATE_VALUES, ended_at__lt=now - dt.timedelta(days=days),
                                      metric_points_pruned_at__isnull=True)
           .order_by("ended_at", "pk").values_list("pk", flat=True))
    pruned = rows = 0
    for job_id in due.iterator(chunk_size=100):
        while rows < max_rows:
            with transaction.atomic():
                batch = list(MetricPoint.objects.filter(job_id=job_id).exclude(name__startswith=KEPT_PREFIX)
                             .values_list("pk", flat=True)[:min(BATCH_ROWS, max_rows - rows)])
                if batch:
                    rows += MetricPoint.objects.filter(pk__in=batch).delete()[0]
                else:  # then its chunks (jobs.metric_store), counted by the points they hold
                    chunks = list(MetricChunk.objects.filter(job_id=job_id).exclude(name__startswith=KEPT_PREFIX)
                                  .values_list("pk", "count")[:max(1, min(BATCH_ROWS, max_rows - rows) // 4096)])
                    if chunks:
                        MetricChunk.objects.filter(pk__in=[pk for pk, _ in chunks]).delete()
                        rows += sum(count for _, count in chunks)
                        batch = chunks
            if not batch:
                TrainingJob.objects.filter(pk=job_id).update(metric_points_pruned_at=now)
                pruned += 1
                break
        if rows >= max_rows:
            break
    if pruned or rows:
        log.info("metric retention (%g days): %d rows deleted, %d jobs pruned", days, rows, pruned)
    return {"jobs": pruned, "rows": rows}
