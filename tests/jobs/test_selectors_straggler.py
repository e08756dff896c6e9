"""Straggler visibility: the per-rank table and the slowest rank, from seeded MetricPoints."""

from __future__ import annotations

import datetime as dt

import pytest

from jobs import services
from jobs.models import MetricPoint
from jobs.selectors import training_job_rank_throughput, training_job_straggler

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                        backend=local_backend, nodes=1, procs_per_node=2, epochs=1)


def seed_ranks(job, step: int, step_times: list[float], data_waits: list[float] | None = None) -> None:
    points = []
    for rank, st in enumerate(step_times):
        points.append(MetricPoint(job=job, name="rank_step_time_s", step=step, rank=rank, value=st, recorded_at=T0))
        points.append(MetricPoint(job=job, name="rank_samples_per_s", step=step, rank=rank, value=32 / st,
                                  recorded_at=T0))
    for rank, wait in enumerate(data_waits or []):
        points.append(MetricPoint(job=job, name="rank_data_wait_s", step=step, rank=rank, value=wait, recorded_at=T0))
    MetricPoint.objects.bulk_create(points)


def test_straggler_is_the_slowest_rank_of_the_latest_step_against_the_median(job):
    seed_ranks(job, 10, [0.050, 0.010, 0.010])  # an older step: rank 0 was slow then
    seed_ranks(job, 20, [0.0080, 0.0108, 0.0079], [0.001, 0.004, 0.0])
    straggler = training_job_straggler(job=job)
    assert straggler["rank"] == 1
    assert straggler["step_time_s"] == pytest.approx(0.0108)
    assert straggler["median_step_time_s"] == pytest.approx(0.0080)
    assert straggler["behind_pct"] == pytest.approx(35.0)
    assert straggler["data_wait_s"] == pytest.approx(0.004)
    assert straggler["text"] == "rank 1 is the slowest: 0.0108 s/step, 35% behind the median"
    rows = training_job_rank_throughput(job=job)
    assert [(r["rank"], r["step_time_s"], r["data_wait_s"]) for r in rows] == [
        (0, 0.0080, 0.001), (1, 0.0108, 0.004), (2, 0.0079, 0.0)]


def test_straggler_with_two_ranks_uses_their_mean_and_ties_go_to_the_lowest_rank(job):
    seed_ranks(job, 5, [0.012, 0.008])
    s = training_job_straggler(job=job)
    assert (s["rank"], s["median_step_time_s"]) == (0, pytest.approx(0.010))
    assert s["behind_pct"] == pytest.approx(20.0)
    assert s["data_wait_s"] is None  # a trainer that did not report data waits
    seed_ranks(job, 6, [0.01, 0.01])
    s = training_job_straggler(job=job)
    assert (s["rank"], s["behind_pct"]) == (0, 0.0)


def test_no_straggler_without_two_ranks_reporting(job):
    assert training_job_straggler(job=job) is None
    seed_ranks(job, 5, [0.01])
    assert training_job_straggler(job=job) is None
