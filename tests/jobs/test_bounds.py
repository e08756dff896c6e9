"""What bounds a run, in one line (jobs.bounds, issue 30): the shares of a step from each rank's latest
timing, the GPU that stands out from the launcher's recent samples, and the line on the job page and
in the API, from seeded points. The figures are binary fractions, so every share is exact."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from jobs import bounds, metric_buckets, services
from jobs.models import MetricBucket, MetricPoint
from jobs.selectors import training_job_bound

T0 = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def row(rank: int, data: float, compute: float | None, sync: float, **extra) -> dict:
    """A row of training_job_rank_throughput: step time = compute + sync wait."""
    return {"rank": rank, "data_wait_s": data, "compute_s": compute, "sync_wait_s": sync,
            "step_time_s": (compute or 0.0) + sync, **extra}


def test_input_bound_names_the_share_of_each_step_spent_waiting_for_data():
    # Each rank: 0.5 s data + 0.5 s compute + 0.25 s sync = 1.25 s; Σ 2.5 s, of which 1.0 s data.
    found = bounds.bound([row(0, 0.5, 0.5, 0.25), row(1, 0.5, 0.5, 0.25)], {}, 2)
    assert found["kind"] == "input"
    assert found["text"] == "input-bound: ranks wait for data 40 % of each step"
    assert found["shares"] == {"ranks": 2, "data_pct": 40.0, "compute_pct": 40.0, "sync_pct": 20.0,
                               "waiting_pct": 0.0, "slowest_rank": 0}
    assert (found["gpu"], found["gpu_mean_pct"]) == (None, None)


def test_sync_bound_says_how_much_of_it_is_waiting_for_the_slowest_rank():
    # Every rank's step is 1 s: 0.0625 s data. Rank 3 computes 0.5625 s (ready at 0.625 s), the others
    # 0.1875 s (ready at 0.25 s) and wait 0.375 s each for it.
    ranks = [row(r, 0.0625, 0.1875, 0.75) for r in range(3)] + [row(3, 0.0625, 0.5625, 0.375)]
    found = bounds.bound(ranks, {}, 4)
    # Σ step 4 s: data 0.25 (6.25 %), compute 1.125 (28.125 %), sync 2.625 (65.625 %), waiting 3 × 0.375
    # = 1.125 (28.125 %).
    assert found["shares"] == {"ranks": 4, "data_pct": 6.25, "compute_pct": 28.125, "sync_pct": 65.625,
                               "waiting_pct": 28.125, "slowest_rank": 3}
    assert found["kind"] == "sync"
    assert found["text"] == ("sync-bound: ranks spend 66 % of each step in the gradient sync and the optimizer, "
                             "28 % waiting for rank 3, the slowest to reach it")


def test_compute_bound_with_one_gpu_far_behind_the_others_names_it_by_node_and_index():
    # 2 nodes × 4 GPUs; rank 6 = node 1, GPU 2.
    ranks = [row(r, 0.0625, 0.8125, 0.125) for r in range(8)]
    utils = {r: 95.0 for r in range(8)} | {6: 12.0}
    found = bounds.bound(ranks, utils, 4)
    assert found["kind"] == "compute"
    assert found["text"] == ("compute-bound: forward and backward take 81 % of each step; GPU 2 of node 1 (rank 6) "
                             "at 12 % while the others are at 95 %")
    assert found["gpu"] == {"rank": 6, "node": 1, "gpu": 2, "util_pct": 12.0, "others_pct": 95.0, "more": 0}
    assert found["gpu_mean_pct"] == (7 * 95.0 + 12.0) / 8


def test_gpus_alone_judge_a_script_and_more_gpus_as_far_behind_are_counted():
    assert bounds.bound([], {0: 95.5, 1: 96.5}, 2)["text"] == "compute-bound: the GPUs are busy 96 % of the time"
    underused = bounds.bound([], {0: 40.0, 1: 50.0}, 2)  # 10 points apart: none stands out
    assert (underused["kind"], underused["gpu"]) == ("gpus-underused", None)
    assert underused["text"] == ("GPUs underused: busy 45 % of the time on average; the run waits on something "
                                 "else (data, the CPU or communication)")
    # The others' median is 95 (of 20, 95, 95): rank 2 at 10 is named, rank 3 at 20 (75 below) counted.
    found = bounds.bound([], {0: 95.0, 1: 95.0, 2: 10.0, 3: 20.0}, 2)
    assert found["gpu"] == {"rank": 2, "node": 1, "gpu": 0, "util_pct": 10.0, "others_pct": 95.0, "more": 1}
    assert found["text"] == ("GPUs underused: busy 55 % of the time on average; the run waits on something else "
                             "(data, the CPU or communication); GPU 0 of node 1 (rank 2) at 10 % while the others "
                             "are at 95 % (1 more GPU as far behind)")
    # 29 points below: not far enough.
    assert bounds.gpu_outlier({0: 95.0, 1: 66.0}, 1) is None


def test_an_older_trainers_records_without_compute_and_no_figures_at_all():
    old = bounds.bound([{"rank": 0, "data_wait_s": 0.125, "compute_s": None, "step_time_s": 0.875}], {}, 1)
    assert old["shares"] == {"ranks": 1, "data_pct": 12.5, "compute_pct": None, "sync_pct": None,
                             "waiting_pct": None, "slowest_rank": None}
    assert old["text"] == "not input-bound: ranks wait for data 12 % of each step"  # 12.5 rounds half to even
    assert bounds.bound([{"rank": 0, "data_wait_s": None, "step_time_s": 1.0}], {}, 1) is None
    assert bounds.bound([row(0, 0.0, 0.0, 0.0)], {0: float("nan")}, 1) is None  # 0 s steps, no finite GPU figure
    assert bounds.bound([], {}, 1) is None


@pytest.mark.django_db
def test_the_job_page_and_the_api_read_the_latest_timing_and_the_gpus_recent_buckets(
        client, user, digits_dataset, cnn_model, local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=2, epochs=1)
    timing = {"rank_data_wait_s": [0.5, 0.5], "rank_compute_s": [0.5, 0.5], "rank_sync_wait_s": [0.25, 0.25],
              "rank_step_time_s": [0.75, 0.75]}
    # An older record that a latest-value read must not mix in (all data wait).
    MetricPoint.objects.bulk_create(MetricPoint(job=job, name=n, step=10, rank=r, value=v * 4, recorded_at=T0)
                                    for n, vs in timing.items() for r, v in enumerate(vs))
    MetricPoint.objects.bulk_create(MetricPoint(job=job, name=n, step=20, rank=r, value=v, recorded_at=T0)
                                    for n, vs in timing.items() for r, v in enumerate(vs))
    # GPU samples by the clock (steps are Unix seconds): the last two 256 s buckets are B − 1 and B.
    width = metric_buckets.STORED_WIDTHS[0]
    b = int(T0.timestamp()) // width
    samples = [(0, (b - 3) * width, 0.0), (1, (b - 3) * width, 100.0),  # older: not read
               (0, (b - 1) * width + 10, 90.0), (0, b * width + 5, 100.0),
               (1, (b - 1) * width + 10, 12.0), (1, b * width + 5, 12.0)]
    MetricPoint.objects.bulk_create(MetricPoint(job=job, name="sys/gpu_util_pct", step=t, rank=r, value=v,
                                                recorded_at=T0) for r, t, v in samples)
    assert metric_buckets.recent_means(job.pk, "sys/gpu_util_pct") == {0: 95.0, 1: 12.0}
    # The read is bounded: the summary row and the two recent buckets of each GPU exist beside the old one.
    assert MetricBucket.objects.filter(job=job, name="sys/gpu_util_pct", width=width).count() == 6

    found = training_job_bound(job=job)
    text = ("input-bound: ranks wait for data 40 % of each step; GPU 1 of node 0 (rank 1) at 12 % while the others "
            "are at 95 %")
    assert found["text"] == text

    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert f'<strong>What bounds the run:</strong> {text}</p>' in page
    api = APIClient()
    api.force_authenticate(user)
    body = api.get(f"/api/jobs/{job.pk}/").json()["bound"]
    assert body == {"kind": "input", "text": text,
                    "shares": {"ranks": 2, "data_pct": 40.0, "compute_pct": 40.0, "sync_pct": 20.0,
                               "waiting_pct": 0.0, "slowest_rank": 0},
                    "gpu": {"rank": 1, "node": 0, "gpu": 1, "util_pct": 12.0, "others_pct": 95.0, "more": 0},
                    "gpu_mean_pct": 53.5}
