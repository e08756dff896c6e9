"""Reading a test job's stored points whole (a request never does: jobs.metric_buckets)."""

from __future__ import annotations

import math
from typing import Any

from jobs.metric_fold import GLOBAL_RANK, STORED_WIDTHS
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


def brute_buckets(points: list[tuple]) -> dict[tuple, dict]:
    """Every stored level's buckets of ``points`` (``(name, rank or None, step, value, epoch, at)``,
    stored in that order), computed point by point: what ``MetricBucket`` must hold, keyed
    ``(name, rank or GLOBAL_RANK, width, bucket)``, each the bucket's fields by name."""
    groups: dict[tuple, list] = {}
    for order, (name, rank, step, value, epoch, at) in enumerate(points):
        for width in STORED_WIDTHS:
            key = (name, GLOBAL_RANK if rank is None else rank, width, step // width)
            groups.setdefault(key, []).append((step, order, value, epoch, at))
    out = {}
    for key, pts in groups.items():
        finite = [p[2] for p in pts if p[2] is not None]
        last = max(pts, key=lambda p: (p[0], p[1]))
        out[key] = {"count": len(pts), "nonfinite": len(pts) - len(finite),
                    "first_nonfinite_step": min((p[0] for p in pts if p[2] is None), default=None),
                    "min_value": min(finite, default=None), "max_value": max(finite, default=None),
                    "sum_value": math.fsum(finite) if finite else None, "first_step": min(p[0] for p in pts),
                    "last_step": last[0], "last_value": last[2], "last_epoch": last[3],
                    "first_at": min(p[4] for p in pts), "last_at": last[4]}
    return out
