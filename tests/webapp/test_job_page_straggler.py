"""The job page's per-rank panel names the slowest rank and shows each rank's data wait."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

pytestmark = pytest.mark.django_db


def test_rank_panel_names_the_slowest_rank_and_shows_data_wait(owner_client, job):
    from jobs.models import MetricPoint

    now = timezone.now()
    points = []
    for rank, (st, wait) in enumerate([(0.0089, 0.0002), (0.0122, 0.0051)]):
        for name, value in (("rank_step_time_s", st), ("rank_data_wait_s", wait), ("rank_samples_per_s", 32 / st)):
            points.append(MetricPoint(job=job, name=name, step=40, rank=rank, value=value, recorded_at=now))
    MetricPoint.objects.bulk_create(points)

    for url in (reverse("job-live", args=[job.pk]), reverse("job-detail", args=[job.pk])):
        html = owner_client.get(url).content.decode()
        panel = html[html.index("Throughput per rank"):html.index('id="log-tail"')]
        # median of 0.0089 and 0.0122 is 0.01055: rank 1 trails it by 16%
        assert "rank 1 is the slowest: 0.0122 s/step, 16% behind the median" in panel
        assert "(waits 0.0051 s/step for data)" in panel
        assert "<th class=\"right\" title=\"seconds per step waiting for the next batch\">Data wait</th>" in panel
        table = panel[panel.index('id="rank-table"'):]
        assert "0.0002 s" in table and "0.0051 s" in table
        assert table.count('class="slowest"') == 1


def test_rank_panel_without_metrics_has_no_straggler_line(owner_client, job):
    html = owner_client.get(reverse("job-live", args=[job.pk])).content.decode()
    assert 'id="straggler"' not in html
    assert "No throughput reported yet." in html
