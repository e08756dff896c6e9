"""``TrainingJob.final_metrics``: each global metric's last value, kept by the sync."""

from __future__ import annotations

import datetime as dt

from jobs.models import MetricPoint
from jobs.sync import final_metrics_after

NOW = dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc)


def _point(name, step, value, rank=None):
    return MetricPoint(name=name, step=step, value=value, rank=rank, recorded_at=NOW)


def test_the_last_logged_global_value_of_each_name_wins():
    points = [_point("train_loss", 1, 2.0), _point("train_loss", 2, 1.5), _point("val_accuracy", 2, 0.9),
              _point("rank_samples_per_s", 2, 100.0, rank=0), _point("val_loss", 2, None)]
    assert final_metrics_after({"lr": 0.05, "train_loss": 9.0}, points) == {
        "lr": 0.05, "train_loss": 1.5, "val_accuracy": 0.9, "val_loss": None}


def test_no_points_leave_it_as_it_was():
    assert final_metrics_after(None, []) == {}
    assert final_metrics_after({"train_loss": 1.0}, []) == {"train_loss": 1.0}
