"""What identified a cloud dataset's content when its job was submitted: the object store's own
version of each object under the dataset's prefix, hashed as one listing.

- ``s3://bucket/prefix``: ``list_objects_v2`` of the prefix through the SageMaker adapter's boto3
  client; each object's key, ETag and size. An ETag changes whenever the object's bytes do (it is the
  MD5 of a single-part upload, a hash of the parts' MD5s otherwise: AWS S3 User Guide, "Checking
  object integrity").
- ``gs://bucket/prefix``: the blobs of the prefix through the Vertex adapter's storage client; each
  blob's name, generation and size. A generation is new for every write of the object (Cloud Storage
  documentation, "Object versioning": generation numbers).
- ``azureml://`` / ``az://``: not read; the fingerprint says why.

Each listing is read page by page through the adapter's call wrapper (its rate limit and retries),
at most :data:`MAX_PAGES` pages. Nothing here raises: the caller (``jobs.lifecycle``, before the
submit) must never fail a job because its data could not be listed.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

from cloud_adapters.base import BackendError, uri_scheme
from cloud_adapters.redaction import redact

MAX_PAGES = 100
"""Pages of a listing read at most (1,000 objects each: 100,000 objects); past them the fingerprint
covers the first objects in key order and says ``"truncated": true``."""
PAGE_SIZE = 1000


def _bucket_and_prefix(uri: str) -> tuple[str, str]:
    parts = urlsplit(uri)
    return parts.netloc, parts.path.lstrip("/")


def _iso(when: Any) -> str | None:
    if isinstance(when, dt.datetime):
        return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc).isoformat()
    return None


def _summary(kind: str, uri: str, entries: list[tuple[str, str, int, Any]], truncated: bool) -> dict[str, Any]:
    """The fingerprint of a listing: ``entries`` are (name, version, size in bytes, modified time);
    ``listing_sha256`` is the SHA-256 of one ``name\\tversion\\tsize\\n`` line per object, sorted by
    name, so any object added, removed or rewritten changes it."""
    entries.sort(key=lambda e: e[0])
    digest = hashlib.sha256()
    for name, version, size, _ in entries:
        digest.update(f"{name}\t{version}\t{size}\n".encode("utf-8", "surrogateescape"))
    times = [t for t in (e[3] for e in entries) if isinstance(t, dt.datetime)]
    newest = max(times, default=None)
    return {"kind": kind, "uri": uri, "objects": len(entries), "size_bytes": sum(e[2] for e in entries),
            "last_modified": _iso(newest), "listing_sha256": digest.hexdigest(), "truncated": truncated}


def _listing(pages: Callable[..., Iterable[Any]], fetch: Callable[[str | None], tuple[list[Any], str | None]],
             service: str) -> tuple[list[Any], bool]:
    """Every item of at most :data:`MAX_PAGES` pages, and whether more pages were left unread."""
    items: list[Any] = []
    more = {"token": None}

    def counting(token: str | None) -> tuple[list[Any], str | None]:
        page, more["token"] = fetch(token)
        return page, more["token"]

    items.extend(pages(counting, service, max_pages=MAX_PAGES))
    return items, bool(more["token"])


def _s3(adapter: Any, uri: str) -> dict[str, Any]:
    bucket, prefix = _bucket_and_prefix(uri)
    client = adapter.client("s3")

    def fetch(token: str | None) -> tuple[list[dict[str, Any]], str | None]:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": PAGE_SIZE}
        if token:
            kwargs["ContinuationToken"] = token
        page = client.list_objects_v2(**kwargs)
        return list(page.get("Contents") or []), page.get("NextContinuationToken") if page.get("IsTruncated") else None

    objects, truncated = _listing(adapter.pages, fetch, "S3")
    return _summary("s3", uri, [(o["Key"], str(o.get("ETag", "")).strip('"'), int(o.get("Size", 0)),
                                 o.get("LastModified")) for o in objects], truncated)


def _gs(adapter: Any, uri: str) -> dict[str, Any]:
    bucket, prefix = _bucket_and_prefix(uri)
    client = adapter.storage_client()

    def fetch(token: str | None) -> tuple[list[Any], str | None]:
        blobs = client.list_blobs(bucket, prefix=prefix or None, max_results=PAGE_SIZE, page_token=token)
        page = next(blobs.pages, None)
        return (list(page) if page is not None else []), blobs.next_page_token

    blobs, truncated = _listing(adapter.pages, fetch, "Cloud Storage")
    return _summary("gs", uri, [(b.name, str(b.generation or ""), int(b.size or 0), b.updated) for b in blobs],
                    truncated)


_READERS: dict[str, tuple[str, Callable[[Any, str], dict[str, Any]]]] = {
    "s3": ("client", _s3),
    "gs": ("storage_client", _gs),
}
"""scheme → (the adapter method the listing needs, the reader)."""

_NOT_READ = {
    "azureml": "Azure ML datastore and data-asset URIs are not listed: the fingerprint would need the "
               "storage account's own keys; the job page shows the URI only",
    "az": "Azure storage URIs are not listed: the fingerprint would need the storage account's own keys; "
          "the job page shows the URI only",
}


def fingerprint_dataset(adapter: Any, uri: str) -> dict[str, Any] | None:
    """The fingerprint of the cloud dataset at ``uri``, read with ``adapter`` (the job's configured
    backend, so its credentials and endpoints):

    - ``s3://`` / ``gs://``: ``{"kind": "s3" | "gs", "uri", "objects": int, "size_bytes": int,
      "last_modified": ISO 8601 UTC | None, "listing_sha256": hex, "truncated": bool}``
      (:func:`_summary`: ETags on S3, generations on Cloud Storage);
    - ``azureml://`` / ``az://``: ``{"kind": "azureml" | "az", "uri", "reason": "<why not read>"}``;
    - a listing that failed (no permission, no such bucket, an adapter that cannot list the
      scheme): ``{"kind", "uri", "error": "<the provider's message>"}``;
    - None for a local path or another scheme (``jobs.fingerprints`` takes those).

    Never raises.
    """
    scheme = uri_scheme(uri)
    if scheme in _NOT_READ:
        return {"kind": scheme, "uri": uri, "reason": _NOT_READ[scheme]}
    if scheme not in _READERS:
        return None
    method, reader = _READERS[scheme]
    if not callable(getattr(adapter, method, None)) or not callable(getattr(adapter, "pages", None)):
        return {"kind": scheme, "uri": uri,
                "error": f"a {getattr(adapter, 'kind', type(adapter).__name__)} backend does not list {scheme}:// "
                         f"objects"}
    try:
        return reader(adapter, uri)
    except BackendError as exc:
        return {"kind": scheme, "uri": uri, "error": str(exc)[:500]}
    except Exception as exc:  # noqa: BLE001 - an SDK's own error type: the job is submitted regardless
        return {"kind": scheme, "uri": uri, "error": redact(f"{type(exc).__name__}: {exc}")[:500]}
