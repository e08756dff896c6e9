"""The job page's per-rank panel names the rank the others wait for and shows each rank's compute,
data wait and sync wait; it names none when the ranks are equal."""

from __future__ import annotations

import html

import pytest
from django.urls import reverse
from django.utils import timezone

pytestmark = pytest.mark.django_db


def seed(job, step, rows):
    from jobs.models import MetricPoint

    now = timezone.now()
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, name=name, step=step, rank=rank, value=value, recorded_at=now)
        for rank, row in enumerate(rows) for name, value in row.items())


def panel(client, url):
    """The per-rank panel's HTML, entities decoded (the text's "others'" is escaped)."""
    page = client.get(url).content.decode()
    return html.unescape(page[page.index("Throughput per rank"):page.index('id="log-tail"')])


def test_rank_panel_names_the_rank_the_others_wait_for(owner_client, job):
    seed(job, 40, [
        {"rank_compute_s": 0.0040, "rank_data_wait_s": 0.0002, "rank_sync_wait_s": 0.0215, "rank_step_time_s": 0.0255,
         "rank_samples_per_s": 1254.9},
        {"rank_compute_s": 0.0195, "rank_data_wait_s": 0.0051, "rank_sync_wait_s": 0.0009, "rank_step_time_s": 0.0204,
         "rank_samples_per_s": 1254.1},
    ])
    for url in (reverse("job-live", args=[job.pk]), reverse("job-detail", args=[job.pk])):
        p = panel(owner_client, url)
        assert ("rank 1 makes the others wait: 0.0246 s/step to reach the gradient sync (data + forward + "
                "backward), 486% more than the others' median of 0.0042 s; they wait 0.0204 s/step for it") in p
        assert "(of which 0.0051 s/step waiting for data)" in p
        table = p[p.index('id="rank-table"'):]
        assert ">Compute</th>" in table and ">Sync wait</th>" in table and ">Stage</th>" not in table
        assert "0.0195 s" in table and "0.0215 s" in table and "0.0051 s" in table
        assert table.count('class="slowest"') == 1


def test_equal_ranks_name_no_straggler(owner_client, job):
    seed(job, 40, [{"rank_compute_s": 0.0100, "rank_data_wait_s": 0.0001, "rank_samples_per_s": 3000.0}] * 2)
    p = panel(owner_client, reverse("job-live", args=[job.pk]))
    assert 'id="straggler"' not in p and "behind" not in p
    assert "No rank is meaningfully slower than the others." in p
    assert 'class="slowest"' not in p


def test_pipeline_table_shows_each_stage_and_its_samples(owner_client, job):
    seed(job, 40, [
        {"rank_compute_s": 0.013, "rank_data_wait_s": 0.0, "rank_samples_per_s": 284.8, "rank_pipeline_stage": 0,
         "rank_stage_layers": 9},
        {"rank_compute_s": 0.014, "rank_data_wait_s": 0.0, "rank_samples_per_s": 287.3, "rank_pipeline_stage": 1,
         "rank_stage_layers": 4},
    ])
    p = panel(owner_client, reverse("job-live", args=[job.pk]))
    table = p[p.index('id="rank-table"'):]
    assert ">Stage</th>" in table
    assert "stage 0 · 9 layers" in table and "stage 1 · 4 layers" in table
    assert "284.8" in table and "287.3" in table and "0.0 " not in table
    assert "No rank is meaningfully slower than the others." in p  # 0.014 vs 0.013: 8%


def test_rank_panel_without_metrics_has_no_straggler_line(owner_client, job):
    html = owner_client.get(reverse("job-live", args=[job.pk])).content.decode()
    assert 'id="straggler"' not in html and 'id="no-straggler"' not in html
    assert "No throughput reported yet." in html
