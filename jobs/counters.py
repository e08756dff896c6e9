"""Counters shared by every process, kept in the database (:class:`jobs.models.OperationCount`).

Prometheus counters in memory would be per process (a web process, each worker's pool children)
and lost at every restart; these rows are one count per name and backend that /metrics reads at
scrape time. An increment is one UPDATE (an INSERT the first time), safe under concurrency.

A leaf module: it imports no service.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import F

from jobs.models import OperationCount

SYNC_ERRORS = "sync_errors"
"""A sync pass of a backend that failed with a provider error (``jobs.tasks.sync_backend``)."""
WEBHOOK_ATTEMPTS_FAILED = "webhook_attempts_failed"
"""A webhook attempt that got no 2xx answer (network error, timeout, refused URL, any other status)."""
WEBHOOK_DELIVERIES_GIVEN_UP = "webhook_deliveries_given_up"
"""A webhook delivery that ran out of attempts or got a final (non-retryable) answer."""


def count(name: str, backend_id: int | None = None, by: int = 1) -> None:
    """Add ``by`` to counter ``name`` of ``backend_id`` (None: not per backend)."""
    if OperationCount.objects.filter(name=name, backend_id=backend_id).update(value=F("value") + by):
        return
    try:
        with transaction.atomic():
            OperationCount.objects.create(name=name, backend_id=backend_id, value=by)
    except IntegrityError:  # another process created it meanwhile
        OperationCount.objects.filter(name=name, backend_id=backend_id).update(value=F("value") + by)
