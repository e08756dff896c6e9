"""The worker side of a job's start and stop: the bodies of ``jobs.tasks.submit_job`` and
``jobs.tasks.cancel_job``, and the submission claim the recovery sweep shares with them.

A job's life: :func:`jobs.services.training_job_create` stores it QUEUED and enqueues
``submit_job`` (:mod:`jobs.dispatch`); :func:`training_job_submit` moves it QUEUED → SUBMITTING →
PENDING (or FAILED) with the provider's handle; :mod:`jobs.sync` follows it from there to a terminal
state. :func:`jobs.services.training_job_cancel` moves it to STOPPING and enqueues ``cancel_job``,
whose body :func:`training_job_cancel_send` asks the provider; a later sync confirms CANCELLED.

Each step is safe to run twice: state moves are conditional updates (:func:`jobs.states.transition`),
the provider job name is derived from the row so a repeated submit adopts the job it created, and
a cancel is idempotent at every provider.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.conf import settings
from django.utils import timezone

from cloud_adapters.base import Backend, BackendError, JobHandle, uri_scheme
from cloud_adapters.fingerprints import fingerprint_dataset
from jobs import admission
from jobs.adapters import backend_adapter, backend_allocates_devices, job_spec, shared_uid_refusal
from jobs.models import JobStateChoices as S, TrainingJob
from jobs.states import is_allowed, transition

log = logging.getLogger(__name__)


def training_job_fail(job: TrainingJob, reason: str) -> None:
    """Move ``job`` to FAILED with ``reason`` (the job's ``failure_reason`` and its JobEvent's message)
    from whatever state it is in now, if that move is still legal; a job that ended meanwhile is left
    as it is. Re-reads and retries when another writer moved the job first."""
    for _ in range(3):
        if not is_allowed(job.state, S.FAILED):
            return
        if transition(job, S.FAILED, message=reason, failure_reason=reason):
            return


def submit_lease_s() -> float:
    """Seconds one submission attempt owns a SUBMITTING job (the submit task's hard time limit,
    ``TRAINBOARD_SUBMIT_TIME_LIMIT_S``): past it, the worker that held the job is gone."""
    return float(settings.TRAINBOARD_SUBMIT_TIME_LIMIT_S)


_RESUMABLE = (S.SUBMITTING, S.STOPPING)
"""States in which a job without a provider handle has a submission to finish: SUBMITTING, and
STOPPING (cancelled while its submission was in flight: it is adopted by name, then stopped)."""


def submission_claim(job: TrainingJob, claim: dt.datetime | None) -> bool:
    """Take (or renew) the right to call the provider for a SUBMITTING (or STOPPING) job without a
    handle.

    The owner of a submission is whoever last wrote ``state_entered_at``; that value is its token.
    ``claim`` is the token the caller holds (a Celery retry of the attempt, or the recovery sweep's
    resume); without one, the caller may take the job only once the lease expired
    (:func:`submit_lease_s`). The write is conditional on the value read, so of two deliveries at
    the same moment exactly one gets ``True``.
    """
    if job.state not in _RESUMABLE or job.provider_handle:
        return False
    seen = job.state_entered_at
    now = timezone.now()
    if claim is not None:
        if seen != claim:
            return False
    elif seen is not None and seen > now - dt.timedelta(seconds=submit_lease_s()):
        return False
    if not TrainingJob.objects.filter(pk=job.pk, state=job.state, provider_handle__isnull=True,
                                      state_entered_at=seen).update(state_entered_at=now):
        return False
    job.state_entered_at = now
    return True


def training_job_submit(*, job: TrainingJob, retrying: bool = False,
                        claim: dt.datetime | None = None) -> TrainingJob:
    """Start ``job`` on its backend (the body of ``jobs.tasks.submit_job``).

    QUEUED → SUBMITTING with a conditional update (a duplicate delivery gets ``False`` and returns
    without calling the provider; on a backend that shares its devices, a GPU box, only when the job
    is admitted: :mod:`jobs.admission` gives it its devices or leaves it QUEUED with its wait reason), ``Backend.submit`` (idempotent by job name), the handle stored,
    → PENDING. A SUBMITTING job without a handle is resumed (submitted again; the provider adopts
    the job of that name) only by the caller that owns it (:func:`submission_claim`): one holding
    ``claim`` (the job's ``state_entered_at`` as its owner wrote it), a ``retrying`` caller (a Celery
    retry after a transient error: the job's ``state_entered_at`` as passed in is its token), or
    anyone once the lease (:func:`submit_lease_s`, seconds) has expired because the worker died.
    Non-transient BackendErrors make the job FAILED with the message; transient ones propagate
    unchanged for the task to retry (``job.state_entered_at`` is then the token for that retry).
    """
    adapter = None
    if job.state == S.QUEUED:
        if backend_allocates_devices(job.backend):
            # A GPU box shares its devices: the job starts only when enough are free (jobs.admission).
            adapter = _adapter_or_fail(job)
            if adapter is None or not _admit(job, adapter):
                return job
        elif not transition(job, S.SUBMITTING, submitted_at=timezone.now(),
                            message=f"Submitting to backend {job.backend.name}"):
            return job
    else:
        if retrying and claim is None:
            claim = job.state_entered_at
        if not submission_claim(job, claim):
            return job
    adapter = adapter or _adapter_or_fail(job)
    if adapter is None:
        return job
    _record_cloud_fingerprint(adapter, job)
    if (refusal := shared_uid_refusal(adapter)):  # users came since it was created (jobs.adapters)
        training_job_fail(job, refusal)
        admission.wake_waiting(job.backend)
        return job
    try:
        handle = adapter.submit(job_spec(job))
    except BackendError as exc:
        if exc.transient:
            TrainingJob.objects.filter(pk=job.pk).update(status_warning=f"Submission retrying: {exc}")
            raise
        training_job_fail(job, str(exc))
        admission.wake_waiting(job.backend)  # what it was given is free again
        return job
    TrainingJob.objects.filter(pk=job.pk).update(provider_handle=handle.to_dict(), status_warning="")
    job.provider_handle = handle.to_dict()
    if job.state == S.STOPPING or not transition(job, S.PENDING, message=f"Submitted as {handle.job_name}"):
        if job.state == S.STOPPING:
            # Cancelled while the provider call was in flight: stop what we just started.
            try:
                adapter.cancel(handle)
            except BackendError as exc:
                log.warning("job %s: cancel after submit failed (the next sync re-sends it): %s", job.pk, exc)
    return job


def _adapter_or_fail(job: TrainingJob) -> Backend | None:
    """The job's backend adapter, or None after failing the job with why it cannot be built."""
    try:
        return backend_adapter(job.backend)
    except (BackendError, LookupError, ValueError, TypeError) as exc:
        training_job_fail(job, f"Backend {job.backend.name} cannot be used: {exc}")
        admission.wake_waiting(job.backend)
        return None


def _admit(job: TrainingJob, adapter: Backend) -> bool:
    """Admission on a device-sharing backend (:func:`jobs.admission.training_job_admit`): True when
    the job moved to SUBMITTING with its devices. A job that needs more devices than the box has in
    all is FAILED with the arithmetic, and the next waiting job is woken."""
    try:
        inventory = adapter.inventory()
    except BackendError as exc:
        if exc.transient:
            raise
        training_job_fail(job, f"Backend {job.backend.name} cannot say which devices it has: {exc}")
        return False
    refusal = admission.never_fits(inventory, admission.needed_devices(job), job.backend.name)
    if refusal:
        training_job_fail(job, refusal)
        admission.wake_waiting(job.backend)
        return False
    return admission.training_job_admit(job=job, adapter=adapter)


def _record_cloud_fingerprint(adapter: Backend, job: TrainingJob) -> None:
    """Store the fingerprint of the job's cloud dataset (the object store's listing, read with the
    job's backend: :func:`cloud_adapters.fingerprints.fingerprint_dataset`) unless one is stored
    already (a resumed submission). A listing that fails is stored as its error; it never stops
    the submission."""
    uri = (job.config.get("data") or {}).get("uri", "")
    if job.dataset_fingerprint is not None or not uri_scheme(uri):
        return
    fingerprint = fingerprint_dataset(adapter, uri)
    if fingerprint is None:
        return
    if "error" in fingerprint:
        log.warning("job %s: dataset %s not fingerprinted: %s", job.pk, uri, fingerprint["error"])
    TrainingJob.objects.filter(pk=job.pk, dataset_fingerprint__isnull=True).update(dataset_fingerprint=fingerprint)
    job.dataset_fingerprint = fingerprint


def training_job_submit_gave_up(*, job: TrainingJob, error: BaseException) -> None:
    """Transient errors outlasted the task's retries: leave the job non-terminal, say why."""
    TrainingJob.objects.filter(pk=job.pk).update(
        status_warning=f"Submission still failing after retries ({error}); the job stays {job.state}. "
                       f"Cancel it or re-run it later."
    )


def training_job_cancel_send(*, job: TrainingJob) -> None:
    """Ask the provider to stop a STOPPING job (the body of ``jobs.tasks.cancel_job``). Idempotent.

    A job without a provider handle is still being submitted: the submit service cancels it once
    the handle exists. Transient BackendErrors propagate for the task to retry.
    """
    if job.state != S.STOPPING or not job.provider_handle:
        return
    backend_adapter(job.backend).cancel(JobHandle.from_dict(job.provider_handle))
