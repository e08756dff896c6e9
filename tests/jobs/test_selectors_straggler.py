"""The straggler: the rank the others wait for, by its time to reach the gradient sync (data wait +
its own compute), and what the waiting cost — from seeded MetricPoints."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest

from jobs import services
from jobs.models import MetricPoint, TrainingJob
from jobs.selectors import training_job_rank_throughput, training_job_straggler

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=2, epochs=1)
    TrainingJob.objects.filter(pk=job.pk).update(hourly_price_usd=Decimal("3.60"))
    job.refresh_from_db()
    return job


def seed(job, step: int, **per_rank: list[float]) -> None:
    """``seed(job, 10, compute=[...], data_wait=[...], sync_wait=[...], step_time=[...], stage=[...])``."""
    names = {"compute": "rank_compute_s", "data_wait": "rank_data_wait_s", "sync_wait": "rank_sync_wait_s",
             "step_time": "rank_step_time_s", "samples": "rank_samples_per_s", "stage": "rank_pipeline_stage",
             "stage_layers": "rank_stage_layers"}
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, name=names[key], step=step, rank=rank, value=v, recorded_at=T0)
        for key, values in per_rank.items() for rank, v in enumerate(values))


def seed_lost(job, step: int, seconds: float) -> None:
    MetricPoint.objects.create(job=job, name="wait_for_slowest_s", step=step, rank=None, value=seconds,
                               recorded_at=T0)


def test_the_straggler_is_the_rank_the_others_wait_for_not_the_one_that_waits(job):
    # Synchronous training: equal step times. Rank 1 computes 20 ms longer; rank 0 waits for it.
    seed(job, 10, compute=[0.030, 0.004, 0.004], data_wait=[0.0, 0.0, 0.0], step_time=[0.03, 0.03, 0.03])  # older
    seed(job, 20, compute=[0.0040, 0.0240, 0.0045], data_wait=[0.0002, 0.0010, 0.0001],
         sync_wait=[0.0210, 0.0010, 0.0205], step_time=[0.0250, 0.0250, 0.0250])
    seed_lost(job, 10, 4.0)
    seed_lost(job, 20, 8.5)
    s = training_job_straggler(job=job)
    assert s["rank"] == 1 and s["stage"] is None
    assert s["time_to_sync_s"] == pytest.approx(0.0250)
    assert s["others_median_s"] == pytest.approx(0.0044)  # median of 0.0042 and 0.0046
    assert s["behind_pct"] == pytest.approx((0.025 / 0.0044 - 1) * 100)
    assert s["others_wait_s"] == pytest.approx((0.025 - 0.0042) + (0.025 - 0.0046))
    assert s["lost_s"] == pytest.approx(12.5)
    # $3.60 per instance-hour / 2 processes per node / 3600 s = $0.0005 per rank-second
    assert s["lost_usd"] == Decimal("0.0063")  # 12.5 × 0.0005 = 0.00625, half up
    assert s["text"] == ("rank 1 makes the others wait: 0.025 s/step to reach the gradient sync (data + forward + "
                         "backward), 468% more than the others' median of 0.0044 s; they wait 0.0412 s/step for it. "
                         "Waiting so far: 12.5 rank-seconds, $0.0063 at $3.60/h per node")
    rows = training_job_rank_throughput(job=job)
    assert [(r["rank"], r["compute_s"], r["sync_wait_s"], r["data_wait_s"], r["stage"]) for r in rows] == [
        (0, 0.0040, 0.0210, 0.0002, None), (1, 0.0240, 0.0010, 0.0010, None), (2, 0.0045, 0.0205, 0.0001, None)]


def test_the_waiting_dollars_read_at_the_precision_of_the_jobs_own_figures(job):
    # A small CPU job: $0.50/h, a cost of $0.0024, 0.3 rank-seconds waited (worth $0.00004).
    TrainingJob.objects.filter(pk=job.pk).update(hourly_price_usd=Decimal("0.50"), cost_usd=Decimal("0.0024"),
                                                 budget_usd=None, estimated_cost_usd=Decimal("0.5000"))
    job.refresh_from_db()
    seed(job, 5, compute=[0.004, 0.024], data_wait=[0.0, 0.0])
    seed_lost(job, 5, 0.3)
    assert training_job_straggler(job=job)["text"].endswith(
        "Waiting so far: 0.3 rank-seconds, under $0.0001 at $0.50/h per node")
    # Whole cents of waiting beside a cost kept to 4 decimals read at 4 decimals too: 720 s × $0.25/h / 3600.
    seed_lost(job, 6, 719.7)
    s = training_job_straggler(job=job)
    assert s["lost_usd"] == Decimal("0.0500")
    assert s["text"].endswith("Waiting so far: 720 rank-seconds, $0.0500 at $0.50/h per node")


def test_data_wait_counts_toward_the_time_to_the_sync(job):
    seed(job, 5, compute=[0.004, 0.004], data_wait=[0.0, 0.02])
    s = training_job_straggler(job=job)
    assert (s["rank"], s["time_to_sync_s"], s["data_wait_s"]) == (1, pytest.approx(0.024), 0.02)
    assert s["lost_s"] == 0 and "Waiting so far" not in s["text"]


def test_no_straggler_when_no_rank_is_meaningfully_slower(job):
    assert training_job_straggler(job=job) is None
    seed(job, 5, compute=[0.01], data_wait=[0.0])
    assert training_job_straggler(job=job) is None  # one rank
    seed(job, 6, compute=[0.0100, 0.0100], data_wait=[0.0, 0.0])
    assert training_job_straggler(job=job) is None  # equal: no "0% behind the median"
    seed(job, 7, compute=[0.0100, 0.0105], data_wait=[0.0, 0.0])
    assert training_job_straggler(job=job) is None  # 5%: noise
    seed(job, 8, compute=[0.0100, 0.0111], data_wait=[0.0, 0.0])
    assert training_job_straggler(job=job)["rank"] == 1  # 11%


def test_pipeline_ranks_name_their_stage(job):
    seed(job, 9, compute=[0.010, 0.030], data_wait=[0.0, 0.0], samples=[300.0, 300.0], stage=[0, 1],
         stage_layers=[9, 4])
    rows = training_job_rank_throughput(job=job)
    assert [(r["stage"], r["stage_layers"], r["samples_per_s"]) for r in rows] == [(0, 9, 300.0), (1, 4, 300.0)]
    s = training_job_straggler(job=job)
    assert s["stage"] == 1
    assert s["text"].startswith("rank 1 (pipeline stage 1, 4 layers) makes the others wait: 0.03 s/step")


def test_records_from_trainers_without_compute_fall_back_to_the_step_time(job):
    seed(job, 3, step_time=[0.0080, 0.0108, 0.0079])
    s = training_job_straggler(job=job)
    assert (s["rank"], s["time_to_sync_s"]) == (1, 0.0108)
    assert s["others_median_s"] == pytest.approx(0.00795)
