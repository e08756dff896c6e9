"""Progress, time left and projected cost (issue 30) where users read them: the API's job retrieve and
list (and the OpenAPI schema), the job list's Progress column, the job page's headline and /metrics,
all from the job's progress columns as the sync keeps them (jobs.progress): no metric row read. A job
without a known length shows none."""

from __future__ import annotations

import datetime as dt
import html as html_lib
import json
import re
from decimal import Decimal

import pytest
import yaml
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from jobs import hangs, progress, services
from jobs.models import JobStateChoices as S, MetricBucket, MetricChunk, MetricPoint, TrainingJob
from notifykit import move

pytestmark = pytest.mark.django_db


def with_progress(job: TrainingJob) -> tuple[TrainingJob, dt.datetime]:
    """``job`` RUNNING on 1 instance at $3.60/h, its records read as the sync reads them: a run of
    1,000 steps at step 0, then 200 steps 100 s later (2 steps/s). Cost $0.10 at the sync 110 s after
    the first record. Returns the job and the time of its first record."""
    move(job, S.SUBMITTING, S.PENDING, S.RUNNING)
    base = timezone.now().replace(microsecond=0) - dt.timedelta(seconds=100)
    t = base.timestamp()
    fields = progress.progress_after({f: getattr(job, f) for f in progress.PROGRESS_FIELDS}, [
        {"event": "started", "step": 0, "time": t, "total_steps": 1000},
        {"event": "step", "step": 200, "time": t + 100, "total_steps": 1000}])
    TrainingJob.objects.filter(pk=job.pk).update(
        **fields, hourly_price_usd=Decimal("3.6"), instance_count=1, cost_usd=Decimal("0.1000"),
        last_synced_at=base + dt.timedelta(seconds=110))
    job.refresh_from_db()
    return job, base


def other_job(job: TrainingJob) -> TrainingJob:
    """A RUNNING job of the same owner whose length is not known (no total_steps reported)."""
    other = services.training_job_create(owner=job.owner, dataset=job.dataset, model_spec=job.model_spec,
                                         backend=job.backend, epochs=1, name="no-length")
    move(other, S.SUBMITTING, S.PENDING, S.RUNNING)
    TrainingJob.objects.filter(pk=other.pk).update(progress_step=40, progress_steps_per_s=2.0)
    return other


# finish: 800 steps left at 2 steps/s = 400 s after the record at base + 100 → base + 500 s;
# projected: $0.10 + (500 − 110) s × 1 × $3.60/h = $0.10 + $0.39.
ARITHMETIC = ("200 of 1000 steps at 2.00 steps/s: 400 s left after the last record; "
              "$0.10 so far + 390 s × 1 node × $3.60/h = $0.49")


def test_the_api_gives_progress_on_retrieve_and_list(api_client, job):
    job, base = with_progress(job)
    other = other_job(job)
    before = timezone.now()
    one = api_client.get(f"/api/jobs/{job.pk}/").json()["progress"]
    listed = {j["id"]: j["progress"] for j in api_client.get("/api/jobs/").json()["results"]}
    after = timezone.now()
    finish = base + dt.timedelta(seconds=500)
    for p in (one, listed[job.pk]):
        assert {k: v for k, v in p.items() if k not in ("eta_s", "finish_at")} == {
            "total_steps": 1000, "step": 200, "fraction": 0.2, "percent": 20.0, "steps_per_s": 2.0,
            "projected_cost_usd": "0.4900", "price_known": True, "arithmetic": ARITHMETIC, "hung": False}
        assert dt.datetime.fromisoformat(p["finish_at"].replace("Z", "+00:00")) == finish
        assert (finish - after).total_seconds() <= p["eta_s"] <= (finish - before).total_seconds()
    assert listed[other.pk] is None
    assert api_client.get(f"/api/jobs/{other.pk}/").json()["progress"] is None


def test_the_schema_describes_progress(api_client):
    from drf_spectacular.validation import validate_schema

    schema = yaml.safe_load(api_client.get("/api/schema/").content)
    validate_schema(schema)
    components = schema["components"]["schemas"]
    assert set(components["JobProgress"]["properties"]) == {
        "total_steps", "step", "fraction", "percent", "steps_per_s", "eta_s", "finish_at", "projected_cost_usd",
        "price_known", "arithmetic", "hung"}
    for serializer in ("TrainingJob", "TrainingJobDetail"):
        field = components[serializer]["properties"]["progress"]
        assert "#/components/schemas/JobProgress" in json.dumps(field) and field.get("nullable") is True


def _metric_reads(queries) -> list[str]:
    tables = [m._meta.db_table for m in (MetricPoint, MetricChunk, MetricBucket)]
    return [q["sql"] for q in queries if any(t in q["sql"] for t in tables)]


def test_the_job_list_shows_a_progress_column_from_the_job_row_alone(owner_client, job):
    other_job(job)
    with CaptureQueriesContext(connection) as without:
        owner_client.get(reverse("job-list"))
    job, _ = with_progress(job)
    with CaptureQueriesContext(connection) as queries:
        page = owner_client.get(reverse("job-list")).content.decode()
    assert len(queries) == len(without) and _metric_reads(queries.captured_queries) == []
    rows = {int(pk): html_lib.unescape(row) for pk, row in re.findall(r'<tr data-job="(\d+)"(.*?)</tr>', page, re.S)}
    cell = re.search(r'class="right nowrap small job-progress">(.*?)</td>', rows[job.pk], re.S).group(1)
    assert re.search(r'<span class="progress-done">20%</span> · '
                     r'<span class="progress-eta">\d+m \d\ds left</span>', cell), cell
    assert f'title="{ARITHMETIC}">→ $0.49</div>' in cell
    others = [row for pk, row in rows.items() if pk != job.pk]
    assert len(others) == 1 and '<span class="muted">—</span></td>' in others[0]


def test_the_job_page_headline_uses_the_stored_progress(owner_client, job):
    job, _ = with_progress(job)
    live = html_lib.unescape(owner_client.get(reverse("job-live", args=[job.pk])).content.decode())
    assert re.search(r'id="progress-value">step 200 of 1000</span>\s*<span class="stat-sub" id="progress-steps">20% done<',
                     live)
    assert 'id="progress-bar" max="1" value="0.2000"' in live
    assert f'id="stat-projected" title="{ARITHMETIC}">projected $0.49 at the end<' in live
    assert re.search(rf'id="stat-eta" title="{re.escape(ARITHMETIC)}">about \d+m \d\ds left<', live)

    other = other_job(job)
    live = html_lib.unescape(owner_client.get(reverse("job-live", args=[other.pk])).content.decode())
    assert 'id="stat-projected"' not in live and 'id="progress-bar"' not in live


TOKEN = "scrape-token-progress"


def test_prometheus_exports_progress_eta_and_projected_cost(settings, job):
    settings.TRAINBOARD_METRICS_TOKEN = TOKEN
    job, base = with_progress(job)
    other = other_job(job)
    before = timezone.now()
    r = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    after = timezone.now()
    assert r.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(r.content.decode()):
        for sample in family.samples:
            samples[(sample.name, sample.labels.get("job_id"))] = (sample.value, sample.labels)
    value, labels = samples[("trainboard_job_progress_ratio", str(job.pk))]
    assert value == 0.2 and labels == {"backend_id": str(job.backend_id), "backend": job.backend.name,
                                       "kind": job.backend.kind, "job_id": str(job.pk)}
    assert samples[("trainboard_job_projected_cost_usd", str(job.pk))][0] == 0.49
    finish = base + dt.timedelta(seconds=500)
    eta = samples[("trainboard_job_eta_seconds", str(job.pk))][0]
    assert (finish - after).total_seconds() <= eta <= (finish - before).total_seconds()
    assert not any(job_id == str(other.pk) for _, job_id in samples)  # no known length: no series


def test_a_hung_job_claims_no_end_and_is_projected_to_its_max_runtime(settings, owner_client, api_client, job):
    """Flagged hung at step 200 of 1000: no time left anywhere (API, page, list, /metrics), and the cost
    projected to the end of its max runtime, which it bills until; a newer step clears it."""
    settings.TRAINBOARD_METRICS_TOKEN = TOKEN
    job, base = with_progress(job)
    hung_at = base + dt.timedelta(seconds=100 + 600)
    TrainingJob.objects.filter(pk=job.pk).update(hung_at=hung_at, started_at=base, max_runtime_s=3600)
    job.refresh_from_db()
    # $0.10 + (base + 3600 − (base + 110)) s × 1 × $3.60/h = $0.10 + $3.49
    arithmetic = (f"200 of 1000 steps; hung since {hung_at:%Y-%m-%d %H:%M:%S} UTC: it bills until its max runtime "
                  f"({base + dt.timedelta(seconds=3600):%Y-%m-%d %H:%M:%S} UTC); "
                  f"$0.10 so far + 3490 s × 1 node × $3.60/h = $3.59")

    p = api_client.get(f"/api/jobs/{job.pk}/").json()["progress"]
    assert p == {"total_steps": 1000, "step": 200, "fraction": 0.2, "percent": 20.0, "steps_per_s": 2.0,
                 "eta_s": None, "finish_at": None, "projected_cost_usd": "3.5900", "price_known": True,
                 "arithmetic": arithmetic, "hung": True}

    live = html_lib.unescape(owner_client.get(reverse("job-live", args=[job.pk])).content.decode())
    assert f'id="stat-projected" title="{arithmetic}">projected $3.59 at max runtime<' in live
    assert (f'id="stat-eta-hung" title="{arithmetic}">hung since {hung_at:%Y-%m-%d %H:%M:%S} UTC — '
            f'bills until its max runtime<') in live
    assert 'id="stat-eta"' not in live and " left<" not in live and "at the end" not in live

    page = html_lib.unescape(owner_client.get(reverse("job-list")).content.decode())
    cell = re.search(rf'<tr data-job="{job.pk}".*?class="right nowrap small job-progress">(.*?)</td>', page, re.S).group(1)
    assert '<span class="progress-done">20%</span>' in cell and "progress-eta" not in cell
    assert f'title="{arithmetic}">→ $3.59</div>' in cell

    r = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    samples = {(s.name, s.labels.get("job_id")): s.value
               for family in text_string_to_metric_families(r.content.decode()) for s in family.samples}
    assert samples[("trainboard_job_progress_ratio", str(job.pk))] == 0.2
    assert samples[("trainboard_job_projected_cost_usd", str(job.pk))] == 3.59
    assert ("trainboard_job_eta_seconds", str(job.pk)) not in samples

    # A newer step than the flag clears it (the sync's jobs.hangs.hang_after): the end is projected again.
    cleared, hang = hangs.hang_after(job.hung_at, job.hang, [
        {"event": "step", "step": 210, "time": (hung_at + dt.timedelta(seconds=1)).timestamp()}])
    assert cleared is None
    TrainingJob.objects.filter(pk=job.pk).update(hung_at=cleared, hang=hang)
    p = api_client.get(f"/api/jobs/{job.pk}/").json()["progress"]
    assert (p["hung"], p["projected_cost_usd"], p["arithmetic"]) == (False, "0.4900", ARITHMETIC)
    assert p["eta_s"] is not None
