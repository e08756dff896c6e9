"""A job's artifacts: the files it left (model, metrics, checkpoints, logs), listed from its backend
with size and sha256, and opened for download (docs/artifacts.md).

The backend lists the files (``Backend.artifacts``); this module keeps the listing as
:class:`~jobs.models.JobArtifact` rows so that a file's sha256 is worked out once: the provider's
where it gives one, else by reading the file once. A file listed again with the same size and
modification time keeps its hash and is not read again. A finished job's listing is taken once
after it ended and then served from those rows.

Downloads go to the provider directly when it can sign a short-lived URL (S3 presigned, GCS signed,
Azure Blob SAS: ``Backend.artifact_url``); otherwise the dashboard streams ``Backend.open_artifact``.
Only a name the job lists is ever opened, and a name with ``..``, a leading ``/``, a backslash or a
control character is refused before any provider call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import BinaryIO

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cloud_adapters.base import Artifact, Backend, BackendError, InvalidSpec, JobHandle
from jobs.adapters import backend_adapter
from jobs.models import JobArtifact, TrainingJob

log = logging.getLogger(__name__)

MAX_NAME_LENGTH = 1024
"""Longest artifact name accepted (characters); the column's width."""
HASH_CHUNK_BYTES = 1 << 20


def url_expires_s() -> int:
    """Seconds a signed download URL stays valid (``TRAINBOARD_ARTIFACT_URL_EXPIRES_S``, default 300)."""
    return int(getattr(settings, "TRAINBOARD_ARTIFACT_URL_EXPIRES_S", 300))


def hash_max_bytes() -> int:
    """Largest file whose sha256 the dashboard computes by reading it, in bytes
    (``TRAINBOARD_ARTIFACT_HASH_MAX_BYTES``, default 2 GiB); a larger one shows its hash as not known."""
    return int(getattr(settings, "TRAINBOARD_ARTIFACT_HASH_MAX_BYTES", 2 << 30))


class ArtifactNotFound(LookupError):
    """The job has no artifact of that name (or the name is not a valid artifact name): a 404."""


@dataclasses.dataclass(frozen=True)
class ArtifactListing:
    """What the job page and the API show.

    ``artifacts``: the rows, sorted by name (the last listing's when the backend could not be read
    now). ``error``: the backend's message when it could not be read ("" when it was)."""

    artifacts: list[JobArtifact]
    error: str = ""


@dataclasses.dataclass
class ArtifactDownload:
    """How to hand the file to a browser: ``url`` (redirect there; valid a few minutes) or ``stream``
    (a binary stream the caller closes, ``size_bytes`` long when known). ``filename``: the name's last part."""

    artifact: JobArtifact
    filename: str
    url: str | None = None
    stream: BinaryIO | None = None
    size_bytes: int | None = None


def artifact_name_problem(name: str) -> str:
    """Why ``name`` cannot be an artifact name ("" when it can): empty, longer than
    :data:`MAX_NAME_LENGTH`, absolute, with a ``..`` or empty part, a backslash or a control character."""
    if not isinstance(name, str) or not name:
        return "An artifact name is required."
    if len(name) > MAX_NAME_LENGTH:
        return f"An artifact name has at most {MAX_NAME_LENGTH} characters."
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or "\\" in name:
        return "An artifact name has no control characters or backslashes."
    if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        return "An artifact name is a relative path without '.', '..' or empty parts."
    return ""


def _handle(job: TrainingJob) -> JobHandle | None:
    return JobHandle.from_dict(job.provider_handle) if job.provider_handle else None


def _listing_is_final(job: TrainingJob, rows: list[JobArtifact]) -> bool:
    """A finished job's files no longer change: a listing taken after it ended is kept."""
    if not job.is_terminal or job.ended_at is None:
        return False
    return bool(rows) and min(r.listed_at for r in rows) >= job.ended_at


def _sha256_of(adapter: Backend, handle: JobHandle, name: str) -> str:
    digest = hashlib.sha256()
    with adapter.open_artifact(handle, name) as stream:
        while chunk := stream.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _same_file(row: JobArtifact, found: Artifact) -> bool:
    return (row.size_bytes == found.size_bytes and row.modified_at == found.modified_at
            and found.modified_at is not None and row.size_bytes is not None)


def _refresh(job: TrainingJob, adapter: Backend, handle: JobHandle) -> list[JobArtifact]:
    """List the backend's files now; hash the new or changed ones (outside any transaction: reading
    a file may take a while), then replace the job's rows in one short transaction."""
    found = adapter.artifacts(handle)
    known = {r.name: r for r in JobArtifact.objects.filter(job=job)}
    now = timezone.now()
    rows = []
    for artifact in found:
        if artifact_name_problem(artifact.name):
            log.warning("job %s: backend listed an unusable artifact name %r; skipped", job.pk, artifact.name)
            continue
        old = known.get(artifact.name)
        sha256, source = artifact.sha256.lower(), "provider" if artifact.sha256 else ""
        if not sha256 and old is not None and old.sha256 and _same_file(old, artifact):
            sha256, source = old.sha256, old.sha256_source
        elif not sha256 and artifact.size_bytes is not None and artifact.size_bytes <= hash_max_bytes():
            try:
                sha256, source = _sha256_of(adapter, handle, artifact.name), "computed"
            except (BackendError, OSError) as exc:
                log.warning("job %s: cannot hash %s: %s", job.pk, artifact.name, exc)
        rows.append(JobArtifact(job=job, name=artifact.name, kind=artifact.kind, size_bytes=artifact.size_bytes,
                                modified_at=artifact.modified_at, sha256=sha256, sha256_source=source,
                                listed_at=now))
    with transaction.atomic():
        JobArtifact.objects.filter(job=job).exclude(name__in=[r.name for r in rows]).delete()
        JobArtifact.objects.bulk_create(
            rows, update_conflicts=True, unique_fields=["job", "name"],
            update_fields=["kind", "size_bytes", "modified_at", "sha256", "sha256_source", "listed_at"])
    return sorted(rows, key=lambda r: r.name)


def training_job_artifact_list(*, job: TrainingJob) -> ArtifactListing:
    """The job's artifacts with size and sha256, sorted by name.

    A job not yet submitted has none. A finished job listed after it ended is served from the
    stored rows without asking its backend; otherwise the backend is listed now and the rows are
    brought up to date (new files hashed, removed ones dropped). When the backend cannot be read
    (``BackendError``: its files are gone, credentials, network), ``error`` says why and the last
    listing is returned. Never raises for a backend's failure."""
    stored = list(JobArtifact.objects.filter(job=job).order_by("name"))
    handle = _handle(job)
    if handle is None or _listing_is_final(job, stored):
        return ArtifactListing(stored)
    try:
        adapter = backend_adapter(job.backend)
        return ArtifactListing(_refresh(job, adapter, handle))
    except BackendError as exc:
        return ArtifactListing(stored, error=str(exc))


def training_job_artifact_download(*, job: TrainingJob, name: str) -> ArtifactDownload:
    """How to download the artifact ``name`` of ``job``: a signed URL valid :func:`url_expires_s`
    seconds where the backend gives one, else an open stream (the caller closes it).

    Raises :class:`ArtifactNotFound` for an invalid name or one the job does not list (checked
    before the file is opened), :class:`BackendError` when the backend cannot be read."""
    if artifact_name_problem(name):
        raise ArtifactNotFound(name)
    handle = _handle(job)
    if handle is None:
        raise ArtifactNotFound(name)
    stored = list(JobArtifact.objects.filter(job=job))
    adapter = backend_adapter(job.backend)
    row = next((r for r in stored if r.name == name), None)
    if not _listing_is_final(job, stored):
        # The job may still be writing: the name is checked against the backend's listing now
        # (without hashing anything; the list view does that).
        found = next((a for a in adapter.artifacts(handle) if a.name == name), None)
        if found is None:
            raise ArtifactNotFound(name)
        if row is None or row.size_bytes != found.size_bytes:
            row = JobArtifact(job=job, name=found.name, kind=found.kind, size_bytes=found.size_bytes,
                              modified_at=found.modified_at, sha256=found.sha256, listed_at=timezone.now())
    if row is None:
        raise ArtifactNotFound(name)
    filename = name.rsplit("/", 1)[-1]
    url = adapter.artifact_url(handle, name, expires_s=url_expires_s())
    if url:
        return ArtifactDownload(row, filename, url=url, size_bytes=row.size_bytes)
    try:
        stream = adapter.open_artifact(handle, name)
    except InvalidSpec as exc:  # listed a moment ago, gone now
        raise ArtifactNotFound(name) from exc
    return ArtifactDownload(row, filename, stream=stream, size_bytes=row.size_bytes)

