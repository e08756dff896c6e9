"""``GET /metrics``: Trainboard's state for Prometheus, read at scrape time (docs/notifications.md,
"/metrics").

A custom collector (:class:`TrainboardCollector`) reads :func:`jobs.selectors.metrics_snapshot`
(a fixed number of queries) and the length of each Celery queue in Redis at every scrape, so the numbers are the
database's, the same whichever web process answers. Counters that must survive restarts and be
shared by every process (sync errors, failed webhook attempts) are rows of
:class:`jobs.models.OperationCount`; submit errors are counted from the jobs' events.

Behind a token: ``TRAINBOARD_METRICS_TOKEN`` (a host setting). Unset: 404 (the endpoint does not
exist). Set: a request without ``Authorization: Bearer <token>`` gets 401.
"""

from __future__ import annotations

import hmac
import logging
from typing import Iterator

import redis
from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jobs import counters, selectors
from jobs.models import JobStateChoices

log = logging.getLogger(__name__)

BACKEND_LABELS = ["backend_id", "backend", "kind"]
QUEUE_READ_TIMEOUT_S = 2.0


def queue_lengths(queues: list[str]) -> dict[str, int] | None:
    """{queue: messages waiting} from the Redis broker (``LLEN`` of each queue's list), or None when
    the broker is not Redis or cannot be reached within :data:`QUEUE_READ_TIMEOUT_S`."""
    if not settings.REDIS_URL:
        return None
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=QUEUE_READ_TIMEOUT_S,
                                      socket_connect_timeout=QUEUE_READ_TIMEOUT_S)
        with client.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.llen(queue)
            return dict(zip(queues, pipe.execute()))
    except redis.RedisError as exc:
        log.warning("/metrics: Celery queue lengths not read: %s", exc)
        return None


class TrainboardCollector:
    """A prometheus_client collector that reads everything at scrape time."""

    def collect(self) -> Iterator[Metric]:
        snap = selectors.metrics_snapshot()

        def labels(backend_id: int | None) -> list[str]:
            name, kind, _queue = snap.backends.get(backend_id, ("", "", ""))
            return [str(backend_id), name, kind]

        jobs = GaugeMetricFamily("trainboard_jobs", "Jobs by state and backend.", labels=[*BACKEND_LABELS, "state"])
        for backend_id in sorted(snap.backends):
            for state in JobStateChoices.values:
                jobs.add_metric([*labels(backend_id), state], snap.jobs_by_state.get((backend_id, state), 0))
        yield jobs

        cost = GaugeMetricFamily("trainboard_cost_month_usd",
                                 "USD cost of the jobs created this calendar month (UTC), per backend.",
                                 labels=BACKEND_LABELS)
        for backend_id in sorted(snap.backends):
            cost.add_metric(labels(backend_id), float(snap.cost_month_usd.get(backend_id, 0)))
        yield cost

        waste = GaugeMetricFamily("trainboard_idle_waste_month_usd",
                                  "USD the GPUs of the jobs created this calendar month (UTC) spent idle (every GPU "
                                  "of a job below its backend's idle threshold: docs/idle.md), per backend.",
                                  labels=BACKEND_LABELS)
        for backend_id in sorted(snap.backends):
            waste.add_metric(labels(backend_id), float(snap.waste_month_usd.get(backend_id, 0)))
        yield waste

        lag = GaugeMetricFamily("trainboard_sync_lag_seconds",
                                "Seconds since the least recently synced active job's last sync, per backend "
                                "(backends with a PENDING, RUNNING or STOPPING job).", labels=BACKEND_LABELS)
        for backend_id, seconds in sorted(snap.sync_lag_s.items()):
            lag.add_metric(labels(backend_id), seconds)
        yield lag

        queues = sorted({"celery", settings.TRAINBOARD_NOTIFICATIONS_QUEUE,
                         *(q for _n, _k, q in snap.backends.values() if q)})
        lengths = queue_lengths(queues)
        depth = GaugeMetricFamily("trainboard_celery_queue_length", "Messages waiting in each Celery queue (Redis).",
                                  labels=["queue"])
        for queue, length in sorted((lengths or {}).items()):
            depth.add_metric([queue], length)
        yield depth

        submit = CounterMetricFamily("trainboard_submit_errors", "Jobs that failed while being submitted "
                                     "(events QUEUED/SUBMITTING → FAILED), per backend.", labels=BACKEND_LABELS)
        for backend_id in sorted(snap.backends):
            submit.add_metric(labels(backend_id), snap.submit_errors.get(backend_id, 0))
        yield submit

        sync = CounterMetricFamily("trainboard_sync_errors", "Sync passes of a backend that failed "
                                   "(provider error or exception), per backend.", labels=BACKEND_LABELS)
        for backend_id in sorted(snap.backends):
            sync.add_metric(labels(backend_id), snap.counters.get((counters.SYNC_ERRORS, backend_id), 0))
        yield sync

        # One series per RUNNING job with a known length (jobs.progress): they end with the job.
        job_labels = [*BACKEND_LABELS, "job_id"]
        done = GaugeMetricFamily("trainboard_job_progress_ratio", "Share of a running job's steps done (0 to 1), "
                                 "for jobs with a known length.", labels=job_labels)
        left = GaugeMetricFamily("trainboard_job_eta_seconds", "Seconds a running job has left at its recent step "
                                 "rate (absent until the rate is measured, and while the job is hung).", labels=job_labels)
        projected = GaugeMetricFamily("trainboard_job_projected_cost_usd", "A running job's projected final cost: "
                                      "its cost so far + its time left × instances × hourly price (a hung job: "
                                      "to the end of its max runtime, which it bills until).", labels=job_labels)
        for job_id, backend_id, progress in snap.progress:
            job = [*labels(backend_id), str(job_id)]
            done.add_metric(job, progress.fraction)
            if progress.eta_s is not None:
                left.add_metric(job, progress.eta_s)
            if progress.projected_cost_usd is not None:
                projected.add_metric(job, float(progress.projected_cost_usd))
        yield done
        yield left
        yield projected

        yield CounterMetricFamily("trainboard_webhook_attempts_failed",
                                  "Webhook attempts without a 2xx answer (network error, timeout, refused URL, "
                                  "non-2xx status).",
                                  value=snap.counters.get((counters.WEBHOOK_ATTEMPTS_FAILED, None), 0))
        yield CounterMetricFamily("trainboard_webhook_deliveries_failed",
                                  "Webhook deliveries given up (attempts exhausted or a final 4xx answer).",
                                  value=snap.counters.get((counters.WEBHOOK_DELIVERIES_GIVEN_UP, None), 0))
        yield GaugeMetricFamily("trainboard_webhook_deliveries_pending",
                                "Webhook deliveries neither delivered nor given up.", value=snap.webhook_pending)


def _authorized(request: HttpRequest, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus text exposition of :class:`TrainboardCollector`; 404 when
    ``TRAINBOARD_METRICS_TOKEN`` is unset, 401 without the right bearer token."""
    token = settings.TRAINBOARD_METRICS_TOKEN
    if not token:
        raise Http404("/metrics is off: set TRAINBOARD_METRICS_TOKEN to turn it on.")
    if not _authorized(request, token):
        response = HttpResponse("Send Authorization: Bearer <TRAINBOARD_METRICS_TOKEN>.\n", status=401,
                                content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="trainboard-metrics"'
        return response
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TrainboardCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
