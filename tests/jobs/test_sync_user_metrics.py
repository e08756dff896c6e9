"""A user script's metrics (``trainer_pkg.report.log``) through the sync: each name in ``user_metrics``
is stored under its own name; malformed records are skipped without failing the pass."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from jobs import sync
from jobs.models import JobStateChoices as S, MetricPoint
from metrickit import metric_series as training_job_metric_series
from cloud_adapters.base import JobState, JobStatus
from test_sync import T0, ScriptedBackend, scripted_backend, submitted_job  # noqa: F401 (fixtures)
from trainer_pkg import report
from trainer_pkg.metrics import METRIC_PREFIX

pytestmark = pytest.mark.django_db

NOW = T0 + dt.timedelta(hours=1)


def logged(capsys, monkeypatch, *calls: dict) -> list[str]:
    """The lines ``report.log(**call)`` prints for each call, as rank 0 of a fresh script."""
    monkeypatch.setattr(report, "_last_step", -1)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(report.MODEL_DIR, raising=False)
    capsys.readouterr()
    for call in calls:
        report.log(**call)
    return ["[rank0]: " + line for line in capsys.readouterr().out.splitlines()]


def test_a_scripts_metrics_are_stored_under_their_own_names(submitted_job, scripted_backend, capsys, monkeypatch):
    job = submitted_job
    lines = logged(capsys, monkeypatch,
                   {"step": 1, "my_loss": 2.5, "tokens/s": 800.0, "train_loss": 2.4},
                   {"step": 2, "my_loss": float("nan"), "tokens/s": 820.0, "train_loss": 2.0},
                   {"my_loss": 1.5, "eval.top-1": 0.25})
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, instance_count=2)]
    ScriptedBackend.log_chunks = [["epoch 0 starting", *lines]]
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1
    job.refresh_from_db()
    assert job.state == S.RUNNING

    series = training_job_metric_series(job=job)
    assert set(series) == {"my_loss", "tokens/s", "train_loss", "eval.top-1"}
    assert [(p["step"], p["value"]) for p in series["my_loss"]] == [(1, 2.5), (2, None), (3, 1.5)]
    assert [(p["step"], p["value"]) for p in series["tokens/s"]] == [(1, 800.0), (2, 820.0)]
    assert [(p["step"], p["value"]) for p in series["eval.top-1"]] == [(3, 0.25)]
    # A user name equal to a built-in one: one row per step, not two.
    assert [(p["step"], p["value"]) for p in series["train_loss"]] == [(1, 2.4), (2, 2.0)]
    assert MetricPoint.objects.filter(job=job, rank__isnull=False).count() == 0


def record(**fields) -> dict:
    return {"event": "step", "step": 4, "time": T0.timestamp(), **fields}


@pytest.mark.parametrize("fields, stored", [
    ({"a": 1.0, "user_metrics": ["a"]}, {"a": 1.0}),
    ({"a": 1.0, "user_metrics": "a"}, {}),  # not a list
    ({"a": 1.0, "user_metrics": {"a": 1}}, {}),
    ({"a": 1.0, "user_metrics": ["a", "a", "a"]}, {"a": 1.0}),  # once
    ({"a": 1.0, "user_metrics": ["a"] + [f"m{i}" for i in range(50)]}, {}),  # 51: ignored whole
    ({"a": 1.0, "b": 2.0, "user_metrics": [1, None, ["a"], {"a": 1}, "b"]}, {"b": 2.0}),
    ({"bad name": 1.0, "1st": 2.0, "": 3.0, "x" * 101: 4.0, "ok": 5.0,
      "user_metrics": ["bad name", "1st", "", "x" * 101, "ok"]}, {"ok": 5.0}),
    ({"user_metrics": ["time", "step", "event", "epoch", "user_metrics"]}, {}),  # the record's own fields
    ({"s": "3.0", "l": [1.0], "d": {"v": 1}, "t": True, "n": None, "user_metrics": ["s", "l", "d", "t", "n", "gone"]},
     {}),  # not numbers (a None not flagged in nonfinite), or absent
    ({"n": None, "nonfinite": ["n"], "user_metrics": ["n"]}, {"n": None}),  # NaN as the encoder writes it
    ({"lr": 0.1, "user_metrics": ["lr"]}, {"lr": 0.1}),  # built-in name: stored once
])
def test_user_metrics_in_a_record(submitted_job, fields, stored):
    points = sync.metric_points_from_record(submitted_job, record(**fields), NOW)
    assert {p.name: p.value for p in points} == stored
    assert len(points) == len(stored)
    assert all(p.step == 4 and p.rank is None and p.recorded_at == T0 for p in points)


def test_a_hostile_line_does_not_fail_the_sync(submitted_job, scripted_backend):
    job = submitted_job
    hostile = [
        METRIC_PREFIX + json.dumps(record(user_metrics=["m"] * 10_000, m=1.0)),
        METRIC_PREFIX + json.dumps(record(user_metrics=[{"$ne": 1}], step="4")),
        METRIC_PREFIX + json.dumps(record(**{"x" * 100: 1e308, "user_metrics": ["x" * 100]})),
        METRIC_PREFIX + '{"event": "step", "user_metrics": ["a"], "a": 1.0',  # cut short
    ]
    ScriptedBackend.statuses = [
        JobStatus(JobState.SUCCEEDED, raw_state="Completed", started_at=T0, ended_at=T0 + dt.timedelta(seconds=9),
                  instance_count=2)]
    ScriptedBackend.log_chunks = [hostile]
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1
    job.refresh_from_db()
    # The three records are stored as what points they give (a record is not a log line as well); the
    # line cut short is no record, so it stays a log line, as written.
    assert job.state == S.SUCCEEDED
    assert list(job.log_lines.values_list("seq", "text")) == [(0, hostile[3])]
    assert {p.name: p.value for p in MetricPoint.objects.filter(job=job)} == {"x" * 100: 1e308}
