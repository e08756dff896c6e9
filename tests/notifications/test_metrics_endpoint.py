"""/metrics: off (404) without TRAINBOARD_METRICS_TOKEN, 401 without the bearer token, and with it
the Prometheus text format, parsed with prometheus_client's own parser and checked value by value:
jobs by state and backend, this month's cost, sync lag, Celery queue lengths in Redis, submit and
sync errors, failed webhook deliveries; a bounded number of queries however many jobs. A sync error
is also counted end to end: a real ``jobs.tasks.sync_backend`` pass on the fault-injecting stand-in
of tests/faults, its every call throttled."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

import pytest
import redis
from django.conf import settings as django_settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from jobs import counters, services
from jobs.models import JobStateChoices as S, TrainingJob, WebhookDelivery
from notifykit import move

pytestmark = pytest.mark.django_db

TOKEN = "scrape-token-123"


@pytest.fixture
def token(settings):
    settings.TRAINBOARD_METRICS_TOKEN = TOKEN


def _scrape() -> dict[tuple[str, tuple], float]:
    r = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert r.status_code == 200, r.content
    assert r["Content-Type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(r.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _backend_labels(backend, **more):
    return tuple(sorted({"backend_id": str(backend.pk), "backend": backend.name, "kind": backend.kind, **more}.items()))


def test_off_without_a_token_and_401_with_a_wrong_one(settings):
    settings.TRAINBOARD_METRICS_TOKEN = ""
    assert Client().get("/metrics").status_code == 404
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer anything").status_code == 404
    settings.TRAINBOARD_METRICS_TOKEN = TOKEN
    for header in (None, "Bearer wrong", f"Token {TOKEN}", "Bearer", f"Basic {TOKEN}"):
        r = Client().get("/metrics", **({"HTTP_AUTHORIZATION": header} if header else {}))
        assert r.status_code == 401, header
        assert r["WWW-Authenticate"].startswith("Bearer")
    assert Client().post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405


def test_metrics_values(token, user, job, local_backend, monkeypatch):
    from taskkit import record_sent_tasks

    for name in ("jobs.tasks.submit_job", "jobs.tasks.cancel_job", "jobs.tasks.deliver_webhook"):
        record_sent_tasks(monkeypatch, name)
    other = services.training_job_create(owner=user, dataset=job.dataset, model_spec=job.model_spec,
                                         backend=local_backend, epochs=1, name="two")
    third = services.training_job_create(owner=user, dataset=job.dataset, model_spec=job.model_spec,
                                         backend=local_backend, epochs=1, name="three")
    move(job, S.SUBMITTING, S.PENDING, S.RUNNING)
    move(other, S.SUBMITTING, S.FAILED, failure_reason="quota")  # a submit error
    synced = timezone.now() - dt.timedelta(seconds=42)
    TrainingJob.objects.filter(pk=job.pk).update(cost_usd=Decimal("1.2500"), last_synced_at=synced)
    TrainingJob.objects.filter(pk=third.pk).update(cost_usd=Decimal("0.5000"))
    last_month = services.training_job_create(owner=user, dataset=job.dataset, model_spec=job.model_spec,
                                              backend=local_backend, epochs=1, name="old")
    TrainingJob.objects.filter(pk=last_month.pk).update(
        cost_usd=Decimal("9"), created_at=timezone.now().replace(day=1) - dt.timedelta(days=3))
    counters.count(counters.SYNC_ERRORS, local_backend.pk)
    counters.count(counters.SYNC_ERRORS, local_backend.pk)
    counters.count(counters.WEBHOOK_DELIVERIES_GIVEN_UP, by=3)
    webhook, _ = services.webhook_create(owner=user, url="http://127.0.0.1:9/", events=["job.failed"])
    WebhookDelivery.objects.create(webhook=webhook, job=job, delivery_id="00000000-0000-0000-0000-000000000001",
                                   event="job.failed", payload={}, next_attempt_at=timezone.now())
    broker = redis.Redis.from_url(django_settings.REDIS_URL)
    broker.delete("gpubox.local", "celery", "notifications")  # another test on this broker may have left messages
    broker.rpush("gpubox.local", "m1", "m2", "m3")
    try:
        samples = _scrape()
    finally:
        broker.delete("gpubox.local")

    b = local_backend
    assert samples[("trainboard_jobs", _backend_labels(b, state="RUNNING"))] == 1
    assert samples[("trainboard_jobs", _backend_labels(b, state="FAILED"))] == 1
    assert samples[("trainboard_jobs", _backend_labels(b, state="QUEUED"))] == 2
    assert samples[("trainboard_jobs", _backend_labels(b, state="SUCCEEDED"))] == 0
    assert samples[("trainboard_cost_month_usd", _backend_labels(b))] == pytest.approx(1.75)  # not last month's 9
    assert samples[("trainboard_sync_lag_seconds", _backend_labels(b))] == pytest.approx(42, abs=15)
    assert samples[("trainboard_celery_queue_length", (("queue", "gpubox.local"),))] == 3
    assert samples[("trainboard_celery_queue_length", (("queue", "celery"),))] == 0
    assert samples[("trainboard_celery_queue_length", (("queue", "notifications"),))] == 0
    assert samples[("trainboard_submit_errors_total", _backend_labels(b))] == 1
    assert samples[("trainboard_sync_errors_total", _backend_labels(b))] == 2
    assert samples[("trainboard_webhook_deliveries_failed_total", ())] == 3
    assert samples[("trainboard_webhook_attempts_failed_total", ())] == 0
    assert samples[("trainboard_webhook_deliveries_pending", ())] == 1


def test_a_scrape_is_a_few_queries_however_many_jobs(token, user, job, local_backend, monkeypatch):
    from taskkit import record_sent_tasks

    record_sent_tasks(monkeypatch, "jobs.tasks.submit_job")
    with CaptureQueriesContext(connection) as one_job:
        _scrape()
    for i in range(5):
        services.training_job_create(owner=user, dataset=job.dataset, model_spec=job.model_spec,
                                     backend=local_backend, epochs=1, name=f"more-{i}")
    with CaptureQueriesContext(connection) as six_jobs:
        _scrape()
    assert len(six_jobs) == len(one_job) <= 10, [q["sql"][:120] for q in six_jobs]


def test_a_failed_sync_pass_counts_one_sync_error(token, user, digits_dataset, cnn_model, local_backend, tmp_path,
                                                  monkeypatch):
    """The real path: ``jobs.tasks.sync_backend`` on a backend whose status call fails, then a scrape."""
    from cloud_adapters import registry
    from faults.fault_backend import FaultProvider
    from jobs import dispatch, lifecycle, tasks
    from jobs.models import OperationCount
    from taskkit import sent_tasks

    monkeypatch.setitem(registry.KINDS, "faultcloud",
                        registry.KindInfo("faults.fault_backend", "FaultBackend", "Fault-injecting stand-in"))
    provider = FaultProvider(tmp_path / "provider")
    faulty = services.backend_create(owner=user, name="faulty", kind="faultcloud", config={"root": str(provider.root)})
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=faulty,
                                           epochs=1, name="followed")
    lifecycle.training_job_submit(job=job)
    job.refresh_from_db()
    assert job.state == S.PENDING and job.provider_handle  # a job the sync follows
    series = ("trainboard_sync_errors_total", _backend_labels(faulty))
    before = _scrape()
    assert before[series] == 0

    provider.control(throttle_share=1.0)  # every provider call: Throttled ("rate exceeded")
    assert tasks.sync_backend(faulty.pk) == 0  # logged and skipped: the next beat tick is the retry
    after = _scrape()
    assert after[series] == before[series] + 1
    assert after[("trainboard_sync_errors_total", _backend_labels(local_backend))] == 0  # per backend
    assert OperationCount.objects.get(name=counters.SYNC_ERRORS, backend_id=faulty.pk).value == 1
    job.refresh_from_db()
    assert job.state == S.PENDING  # a throttled pass changes no state

    # An error that is no BackendError (the provider answers garbage) is counted too, and raised.
    provider.control(throttle_share=None)
    (provider.root / "jobs" / f"{job.provider_handle['provider_job_id']}.json").write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        tasks.sync_backend(faulty.pk)
    assert _scrape()[series] == before[series] + 2
