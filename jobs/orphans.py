"""The orphan reconciler: provider jobs that carry Trainboard's tag but have no active job row.

Such a job bills while nobody watches it: its row was deleted, or it went terminal here (a lost
submit, a failed sync) while the provider kept running it. :func:`reconcile_orphans` lists a
backend's tagged, unfinished provider jobs (:meth:`cloud_adapters.base.Backend.list_tagged`) and
keeps one :class:`~jobs.models.OrphanJob` row per provider job name:

* a listed job with no ACTIVE TrainingJob row of that ``provider_job_name`` → upserted (created, or
  ``last_seen_at`` / ``raw_state`` refreshed; a row resolved earlier that shows up again is reopened);
* an open OrphanJob whose job is no longer listed (it ended, or a row adopted it) → ``resolved_at``;
* with ``backend.orphan_policy == "stop"`` an open orphan not yet stopped is cancelled through the
  adapter and ``stop_requested_at`` recorded; :func:`orphan_stop` does the same for one orphan on a
  staff member's request.

Concurrency: the upsert is one ``INSERT … ON CONFLICT`` on the (backend, provider_job_name) unique
constraint, so two reconcilers running at once make one row; a stop is claimed with a conditional
UPDATE (``stop_requested_at IS NULL``) so only one of them sends it (a cancel is idempotent anyway).

Gpubox backends on one host share a run root, and several backends may share a cloud account: a
tagged job whose ``trainboard-job-id`` names an existing row of ANOTHER backend of the same kind is
left to that backend's reconciler, and a name with an active row on any backend is never an orphan.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied, ValidationError
from django.utils import timezone

from cloud_adapters.base import BackendError, ProviderJob
from jobs.adapters import backend_adapter
from jobs.models import ACTIVE_STATE_VALUES, ComputeBackend, OrphanJob, TrainingJob

log = logging.getLogger(__name__)


def _not_orphans(backend: ComputeBackend, listed: list[ProviderJob]) -> set[str]:
    """Names among ``listed`` that are not orphans of ``backend`` (one or two queries)."""
    names = [p.name for p in listed]
    active = set(TrainingJob.objects.filter(provider_job_name__in=names, state__in=ACTIVE_STATE_VALUES)
                 .values_list("provider_job_name", flat=True))
    ids = {p.job_id: p.name for p in listed if p.job_id is not None and p.name not in active}
    elsewhere = set()
    if ids:
        for job_id, backend_id in (TrainingJob.objects.filter(pk__in=ids, backend__kind=backend.kind)
                                   .exclude(backend_id=backend.pk).values_list("pk", "backend_id")):
            elsewhere.add(ids[job_id])
    return active | elsewhere


def reconcile_orphans(backend_id: int) -> dict[str, int]:
    """One reconciler pass over backend ``backend_id`` (the body of ``jobs.tasks.reconcile_orphans``).

    Returns counts: ``{"listed": tagged unfinished provider jobs, "open": orphans open after the pass,
    "resolved": orphans resolved by this pass, "stopped": stops sent by this pass}``. Provider
    errors (:class:`~cloud_adapters.base.BackendError`) from the listing propagate and nothing is
    written (no orphan is resolved on a failed listing); a failed stop is logged, noted on the
    orphan and left for the next pass. Raises ``ComputeBackend.DoesNotExist`` for an unknown id.
    """
    backend = ComputeBackend.objects.get(pk=backend_id)
    adapter = backend_adapter(backend)
    listed = adapter.list_tagged()
    now = timezone.now()
    skip = _not_orphans(backend, listed)
    orphans = {p.name: p for p in listed if p.name not in skip}
    if orphans:
        OrphanJob.objects.bulk_create(
            [OrphanJob(backend=backend, provider_job_name=p.name, job_id=p.job_id, raw_state=p.raw_state[:100],
                       last_seen_at=now, resolved_at=None) for p in orphans.values()],
            update_conflicts=True, unique_fields=["backend", "provider_job_name"],
            update_fields=["job_id", "raw_state", "last_seen_at", "resolved_at"],
        )
    resolved = (OrphanJob.objects.filter(backend=backend, resolved_at__isnull=True)
                .exclude(provider_job_name__in=list(orphans)).update(resolved_at=now))
    stopped = 0
    if backend.orphan_policy == ComputeBackend.OrphanPolicy.STOP and orphans:
        for orphan in OrphanJob.objects.filter(backend=backend, provider_job_name__in=list(orphans),
                                               resolved_at__isnull=True, stop_requested_at__isnull=True):
            if _claim_and_stop(adapter, orphan, orphans[orphan.provider_job_name], user=None,
                               note="stopped by the backend's orphan policy"):
                stopped += 1
    open_count = OrphanJob.objects.filter(backend=backend, resolved_at__isnull=True).count()
    return {"listed": len(listed), "open": open_count, "resolved": resolved, "stopped": stopped}


def _claim_and_stop(adapter: Any, orphan: OrphanJob, provider_job: ProviderJob, *, user, note: str,
                    force: bool = False) -> bool:
    """Record the stop (only the first caller wins unless ``force``) and send the cancel.

    Returns True when the cancel was sent. A provider error clears the claim again (the next pass or
    click retries) and writes the error into ``note``."""
    now = timezone.now()
    claim = OrphanJob.objects.filter(pk=orphan.pk)
    if not force:
        claim = claim.filter(stop_requested_at__isnull=True)
    if not claim.update(stop_requested_at=now, stop_requested_by=user, note=note):
        return False
    try:
        adapter.cancel(provider_job.handle)
    except BackendError as exc:
        log.warning("orphan %s (%s): stop failed: %s", orphan.pk, orphan.provider_job_name, exc)
        OrphanJob.objects.filter(pk=orphan.pk, stop_requested_at=now).update(
            stop_requested_at=None, stop_requested_by=None, note=f"stop failed: {exc}"[:2000])
        raise
    return True


def orphan_stop(orphan: OrphanJob, user) -> OrphanJob:
    """Stop one orphan at a staff member's request (the Orphans page's and the admin's Stop).

    Looks the job up again with ``list_tagged`` (its handle, and whether it still runs), sends the
    provider's cancel and records ``stop_requested_at`` / ``stop_requested_by``. Asking again
    re-sends the cancel (idempotent at the provider). A job that has ended meanwhile is marked
    resolved instead. Raises PermissionDenied for a non-staff user, ValidationError when the
    orphan was already resolved or the provider refused (the message says why).
    """
    if not getattr(user, "is_staff", False):
        raise PermissionDenied("Only staff can stop orphan jobs.")
    if orphan.resolved_at is not None:
        raise ValidationError(f"{orphan.provider_job_name} already ended; there is nothing to stop.")
    try:
        adapter = backend_adapter(orphan.backend)
        current = {p.name: p for p in adapter.list_tagged()}.get(orphan.provider_job_name)
    except BackendError as exc:
        raise ValidationError(f"Could not reach backend {orphan.backend.name}: {exc}") from exc
    if current is None:
        OrphanJob.objects.filter(pk=orphan.pk).update(resolved_at=timezone.now())
        orphan.refresh_from_db()
        return orphan
    try:
        _claim_and_stop(adapter, orphan, current, user=user, force=True,
                        note=f"stop requested by {user.get_username()}")
    except BackendError as exc:
        raise ValidationError(f"{orphan.backend.name} refused to stop {orphan.provider_job_name}: {exc}") from exc
    OrphanJob.objects.filter(pk=orphan.pk).update(raw_state=current.raw_state[:100])
    orphan.refresh_from_db()
    return orphan


RESOLVED_SHOWN = 50
"""How many resolved orphans the Orphans page shows under the open ones."""


def orphan_list() -> tuple[list[OrphanJob], list[OrphanJob]]:
    """For the staff Orphans page: (every open orphan, newest sighting first; the
    :data:`RESOLVED_SHOWN` most recently resolved). Two queries, backends and stoppers joined."""
    base = OrphanJob.objects.select_related("backend", "stop_requested_by")
    open_orphans = list(base.filter(resolved_at__isnull=True).order_by("-last_seen_at", "id"))
    resolved = list(base.filter(resolved_at__isnull=False).order_by("-resolved_at", "id")[:RESOLVED_SHOWN])
    return open_orphans, resolved
