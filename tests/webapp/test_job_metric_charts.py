"""The job page's metrics JSON and the API charting any metric name a job reported: a user script's
``report.log`` names get one chart each; a job of our trainer keeps its loss and accuracy charts."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from jobs.models import MetricPoint, TrainingJob

pytestmark = pytest.mark.django_db


def make_script_job(job) -> None:
    config = {**job.config, "code": {**job.config.get("code", {}), "dir": "/code", "script": "-m mypkg.train"}}
    TrainingJob.objects.filter(pk=job.pk).update(config=config)


def xy(points) -> list[dict]:
    """The points without their time (asserted in test_job_page.py)."""
    return [{"x": p["x"], "y": p["y"]} for p in points]


def add_points(job, **series) -> None:
    now = timezone.now()
    MetricPoint.objects.bulk_create([MetricPoint(job=job, name=name, step=i + 1, value=v, recorded_at=now)
                                     for name, values in series.items() for i, v in enumerate(values)])


def test_a_scripts_metric_names_are_charted(owner_client, seeded_job):
    make_script_job(seeded_job)
    add_points(seeded_job, **{"my_loss": [2.0, None], "tokens/s": [800.0, 810.0], "lr": [0.1, 0.05]})
    body = owner_client.get(reverse("job-metrics", args=[seeded_job.pk])).json()
    assert body["metric_charts"] == ["lr", "my_loss", "tokens/s"]
    assert xy(body["series"]["my_loss"]) == [{"x": 1, "y": 2.0}, {"x": 2, "y": None}]
    assert xy(body["series"]["tokens/s"]) == [{"x": 1, "y": 800.0}, {"x": 2, "y": 810.0}]
    assert xy(body["series"]["train_loss"]) == [{"x": 10, "y": 2.3}, {"x": 20, "y": 1.2}, {"x": 30, "y": 0.4}]
    # The API's summary lists every name too.
    detail = owner_client.get(f"/api/jobs/{seeded_job.pk}/").json()["metrics"]
    assert detail["tokens/s"] == {"points": 2, "last_step": 2, "last_value": 810.0, "min": 800.0, "max": 810.0,
                                  "nonfinite": 0}
    assert detail["my_loss"]["nonfinite"] == 1


def test_a_trainer_jobs_own_fields_get_no_chart_of_their_own(owner_client, seeded_job):
    add_points(seeded_job, lr=[0.1], samples_per_s=[800.0], wait_for_slowest_s=[0.2], custom=[1.0])
    body = owner_client.get(reverse("job-metrics", args=[seeded_job.pk])).json()
    assert body["metric_charts"] == ["custom"]
    assert set(body["series"]) == {"train_loss", "val_loss", "train_accuracy", "val_accuracy", "custom"}


def test_a_language_models_perplexity_gets_its_chart(owner_client, seeded_job):
    add_points(seeded_job, val_perplexity=[12.18, 7.39], tokens_per_s=[10240.0], lr=[3e-4])
    body = owner_client.get(reverse("job-metrics", args=[seeded_job.pk])).json()
    assert body["metric_charts"] == ["val_perplexity"]  # throughput and lr stay in the rank table
    assert xy(body["series"]["val_perplexity"]) == [{"x": 1, "y": 12.18}, {"x": 2, "y": 7.39}]
    page = owner_client.get(reverse("job-detail", args=[seeded_job.pk])).content.decode()
    assert '"metric_charts": ["val_perplexity"]' in page


def test_at_most_50_metric_charts(owner_client, seeded_job):
    make_script_job(seeded_job)
    add_points(seeded_job, **{f"m{i:03d}": [float(i)] for i in range(80)})
    body = owner_client.get(reverse("job-metrics", args=[seeded_job.pk])).json()
    assert body["metric_charts"] == [f"m{i:03d}" for i in range(50)]
    page = owner_client.get(reverse("job-detail", args=[seeded_job.pk]))
    assert page.status_code == 200 and '"metric_charts": ["m000"' in page.content.decode()
