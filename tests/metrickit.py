"""Reading a test job's stored points whole (a request never does: jobs.metric_buckets)."""

from __future__ import annotations

from typing import Any

from jobs.models import MetricPoint


def metric_series(*, job) -> dict[str, list[dict[str, Any]]]:
    """Global series by name, every point: ``{"val_accuracy": [{"step": 30, "epoch": 0, "value": 0.91},
    ...]}``, each ordered by step (then stored order). The reported series only: not the statistics
    across ranks the sync adds (``rank_step_time_s:max``, tests/webapp/test_rank_stats.py)."""
    series: dict[str, list[dict[str, Any]]] = {}
    rows = (MetricPoint.objects.filter(job_id=job.pk, rank__isnull=True).exclude(name__contains=":")
            .order_by("name", "step", "id").values_list("name", "step", "epoch", "value"))
    for name, step, epoch, value in rows:
        series.setdefault(name, []).append({"step": step, "epoch": epoch, "value": value})
    return series
