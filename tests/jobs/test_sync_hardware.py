"""The sync's side of the launcher's hardware records (trainer_pkg/hardware.py → jobs/sync.py): each
figure becomes a point at its rank (or node) stepped by the sample's Unix second, a malformed field is
skipped without failing the sync, a resumed run's cut of superseded steps leaves the hardware series
and their buckets alone, a script cannot report under ``sys/``, and the job page's metrics JSON
carries the series by time. (The launcher producing these records: tests/trainer_pkg/test_hardware.py.)"""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse

from jobs import metric_store, sync
from jobs.metric_fold import GLOBAL_RANK
from jobs.models import MetricBucket
from metrickit import brute_buckets
from trainer_pkg.metrics import format_metric_line

NOW = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)
T = 1_772_323_200.25  # 2026-03-01 00:00:00.25 UTC


def hw(t: float, **fields) -> dict:
    record = {"event": "hardware", "time": t, "node_rank": 1, "interval_s": 5.0, "ranks": [2, 3],
              "sys/cpu_pct": [95.5, 12.0], "sys/rss_mb": [812.0, 790.5], "gpu_ranks": [2],
              "sys/gpu_util_pct": [97.0], "sys/gpu_mem_used_mb": [30500.0], "sys/gpu_power_w": [None],
              "sys/gpu_temp_c": [66.0], "sys/gpu_sm_clock_mhz": [1980.0], "sys/net_recv_mb_s": 120.5,
              "sys/net_sent_mb_s": 118.0, "sys/disk_read_mb_s": 0.0}
    record.update(fields)
    return record


def test_a_record_becomes_points_at_its_ranks_and_node():
    at = dt.datetime.fromtimestamp(T, tz=dt.timezone.utc)
    step = int(T)
    assert sync.metric_point_tuples(hw(T), NOW) == [
        ("sys/cpu_pct", 2, step, 95.5, None, at), ("sys/cpu_pct", 3, step, 12.0, None, at),
        ("sys/rss_mb", 2, step, 812.0, None, at), ("sys/rss_mb", 3, step, 790.5, None, at),
        ("sys/gpu_util_pct", 2, step, 97.0, None, at), ("sys/gpu_mem_used_mb", 2, step, 30500.0, None, at),
        ("sys/gpu_temp_c", 2, step, 66.0, None, at), ("sys/gpu_sm_clock_mhz", 2, step, 1980.0, None, at),
        ("sys/net_recv_mb_s", 1, step, 120.5, None, at), ("sys/net_sent_mb_s", 1, step, 118.0, None, at),
        ("sys/disk_read_mb_s", 1, step, 0.0, None, at)]


@pytest.mark.parametrize(("fields", "left"), [
    ({"time": "soon"}, 0), ({"time": -5.0}, 0),
    ({"ranks": [2]}, 11 - 4), ({"ranks": [2, 2]}, 11 - 4), ({"ranks": [-1, 3]}, 11 - 4), ({"ranks": [True, 3]}, 11 - 4),
    ({"ranks": list(range(17)), "sys/cpu_pct": [1.0] * 17, "sys/rss_mb": [1.0] * 17}, 11 - 4),
    ({"sys/cpu_pct": [95.5, "x"]}, 11 - 1), ({"sys/rss_mb": "812"}, 11 - 2),
    ({"gpu_ranks": "2"}, 11 - 4), ({"node_rank": None}, 11 - 3), ({"node_rank": 1 << 40}, 11 - 3),
    ({"sys/net_recv_mb_s": float("nan")}, 11 - 1), ({"sys/made_up": [1.0, 2.0]}, 11)])
def test_a_malformed_field_is_skipped_and_the_rest_kept(fields, left):
    assert len(sync.metric_point_tuples(hw(T, **fields), NOW)) == left


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    from jobs import dispatch, services
    from taskkit import sent_tasks

    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=local_backend, nodes=1, procs_per_node=2, epochs=3, name="hw")


def _step(step: int, t: float) -> dict:
    return {"event": "step", "step": step, "epoch": 0, "time": t, "train_loss": 1.0 / (step + 1),
            "rank_step_time_s": [0.1, 0.2, 0.3, 0.4]}


@pytest.mark.django_db
def test_a_resumed_run_cuts_its_steps_and_keeps_the_hardware_series(job):
    """Steps 0-299 and a sample every 5 s, then the run resumes from its step-100 checkpoint: the
    training points from step 100 on go, every hardware point stays, and the buckets equal a fold of
    what is left (the hardware steps, ~1.77e9, lie far above the cut)."""
    records = [_step(s, T + s) for s in range(300)] + [hw(T + 5 * i) for i in range(60)]
    records.sort(key=lambda r: r["time"])
    sync._ingest_lines(job, [format_metric_line(r) for r in records], 0, NOW, lambda text: text)
    before = metric_store.points(job.pk, names=metric_store.HARDWARE_NAMES)
    assert len(before[("sys/rss_mb", 3)]) == 60 and len(before[("sys/net_recv_mb_s", 1)]) == 60
    resumed = {"event": "started", "resumed": True, "step": 100, "epoch": 0, "time": T + 400}
    sync._ingest_lines(job, [format_metric_line(resumed)], len(records), NOW, lambda text: text)
    after = metric_store.points(job.pk)
    assert {key: s.value_list() for key, s in after.items() if key[0].startswith("sys/")} == \
        {key: s.value_list() for key, s in before.items()}
    assert after[("train_loss", None)].steps.tolist() == list(range(100))
    kept = [(name, rank, step, value, epoch, at) for (name, rank), series in after.items()
            for step, value, epoch, at in series.rows()]
    stored = {(b.name, b.rank, b.width, b.bucket): (b.count, b.min_value, b.max_value, b.last_step, b.last_value)
              for b in MetricBucket.objects.filter(job=job)}
    expected = {key: (b["count"], b["min_value"], b["max_value"], b["last_step"], b["last_value"])
                for key, b in brute_buckets(kept).items()}
    assert stored == expected
    assert stored[("sys/gpu_util_pct", 2, 16777216, int(T) // 16777216)][0] == 60


@pytest.mark.django_db
def test_a_scripts_metric_under_sys_is_not_stored(job):
    record = {"event": "step", "step": 3, "time": T, "sys/cpu_pct": 5.0, "loss": 0.5, "user_metrics": ["sys/cpu_pct", "loss"]}
    assert [p[:4] for p in sync.metric_point_tuples(record, NOW)] == [("loss", None, 3, 0.5)]


@pytest.mark.django_db
def test_the_job_pages_metrics_carry_the_hardware_series_by_time(client, user, job):
    lines = [format_metric_line(hw(T + 5 * i, **{"sys/rss_mb": [800.0 + i, 700.0]})) for i in range(3)]
    lines.append(format_metric_line(_step(0, T + 12)))
    sync._ingest_lines(job, lines, 0, NOW, lambda text: text)
    client.force_login(user)
    data = client.get(reverse("job-metrics", args=[job.pk]), HTTP_ACCEPT="application/json").json()
    hardware = data["hardware"]
    assert hardware["lines"] is True and hardware["t0"] == T
    assert [(p["x"], p["y"]) for p in hardware["series"]["sys/rss_mb"]["2"]] == \
        [(int(T), 800.0), (int(T) + 5, 801.0), (int(T) + 10, 802.0)]
    assert sorted(hardware["series"]["sys/net_recv_mb_s"]) == ["1"]  # by node
    assert data["t0"] == T + 12 and data["last_step"] == 0  # the step charts: the trainer's points only
    page = client.get(reverse("job-detail", args=[job.pk]))
    assert b'id="hardware"' in page.content and b"Hardware</h2>" in page.content
    assert GLOBAL_RANK not in {b.rank for b in MetricBucket.objects.filter(job=job, name__startswith="sys/")}
