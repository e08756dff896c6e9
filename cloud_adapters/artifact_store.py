"""A job's artifacts where they lie in an object store (S3, Cloud Storage, Azure Blob) or a file tree:
the names, kinds and record shared by every backend's ``artifacts`` / ``open_artifact`` /
``artifact_url`` (cloud_adapters/base.py), and one lister, opener and signer per store.

A backend says which prefixes make up a job's artifacts (:class:`Root`: a store location and the
name prefix its files get, e.g. the checkpoint prefix's files as ``checkpoints/...``), lists them
with :func:`s3_files` / :func:`gcs_files` / :func:`blob_files`, and picks one by name with
:func:`pick`. Names are relative, ``/``-separated, never with ``..`` (:func:`name_problem`). The
SDK clients are the backend's own (its settings and credentials); nothing here imports an SDK at
module level.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, BinaryIO, Iterable

from cloud_adapters.base import Artifact, InvalidSpec


def artifact_kind(name: str) -> str:
    """``Artifact.kind`` of ``name``: ``checkpoint`` under ``checkpoints/``, ``log`` under ``logs/``,
    ``metrics`` for ``metrics.jsonl``, ``model`` for ``model.pt`` or SageMaker's ``model.tar.gz``,
    else ``output``."""
    if name.startswith("checkpoints/"):
        return "checkpoint"
    if name.startswith("logs/"):
        return "log"
    if name == "metrics.jsonl":
        return "metrics"
    return "model" if name in ("model.pt", "model.tar.gz") else "output"


def name_problem(name: str) -> str:
    """Why ``name`` is no artifact name ("" when it is one): empty, absolute, a ``.``, ``..`` or
    empty part, a backslash or a control character."""
    if not isinstance(name, str) or not name:
        return "an artifact name is required"
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or "\\" in name:
        return "an artifact name has no control characters or backslashes"
    if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        return "an artifact name is a relative path without '.', '..' or empty parts"
    return ""


@dataclasses.dataclass(frozen=True)
class Root:
    """One place a job's artifacts lie: ``container`` (bucket or Blob container), ``prefix`` (the
    object-name prefix, ending in ``/`` or empty) and ``name_prefix`` (what the files' names start
    with: "" or ``checkpoints/``). ``only``: when set, just these file names under the prefix."""

    container: str
    prefix: str
    name_prefix: str = ""
    only: frozenset[str] | None = None


@dataclasses.dataclass(frozen=True)
class StoredFile:
    """One object of a job's artifacts: its :class:`Artifact` name, where it lies, and what the
    store says of it (``sha256`` hex when the store keeps one, else "")."""

    name: str
    container: str
    key: str
    size_bytes: int | None
    modified_at: dt.datetime | None
    sha256: str = ""
    store: str = ""  # where the container lies, when a backend has several (Azure ML: the datastore)

    def artifact(self) -> Artifact:
        return Artifact(name=self.name, kind=artifact_kind(self.name), size_bytes=self.size_bytes,
                        sha256=self.sha256, modified_at=self.modified_at)


def split_uri(uri: str, scheme: str) -> tuple[str, str]:
    """``(container, prefix ending in '/' or "")`` of ``<scheme>://container[/prefix]``; ValueError otherwise."""
    head = f"{scheme}://"
    if not uri.startswith(head) or not uri[len(head):].split("/", 1)[0]:
        raise ValueError(f"expected a {head}container[/prefix] URI, got {uri!r}")
    container, _, prefix = uri[len(head):].partition("/")
    prefix = prefix.strip("/")
    return container, (prefix + "/" if prefix else "")


def _named(root: Root, key: str) -> str | None:
    rest = key[len(root.prefix):]
    if not rest or rest.endswith("/"):
        return None  # the prefix itself, or a "directory" marker object
    if root.only is not None and rest not in root.only:
        return None
    name = root.name_prefix + rest
    return None if name_problem(name) else name


def collect(found: Iterable[StoredFile]) -> dict[str, StoredFile]:
    """name → file; where two roots give one name (a checkpoint prefix inside the output prefix),
    the first root's file wins."""
    files: dict[str, StoredFile] = {}
    for f in found:
        files.setdefault(f.name, f)
    return files


def as_artifacts(files: dict[str, StoredFile]) -> list[Artifact]:
    """The :class:`Artifact` records of ``files``, sorted by name."""
    return [files[name].artifact() for name in sorted(files)]


def pick(files: dict[str, StoredFile], name: str, job_name: str) -> StoredFile:
    """The file named ``name``; :class:`InvalidSpec` for a name the job does not have."""
    found = files.get(name) if not name_problem(name) else None
    if found is None:
        raise InvalidSpec(f"job {job_name} has no artifact {name!r}")
    return found


def _aware(value: Any) -> dt.datetime | None:
    if not isinstance(value, dt.datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)


# -- S3 (boto3) ---------------------------------------------------------------------------------


def s3_files(s3: Any, root: Root) -> list[StoredFile]:
    """Every object under ``root`` (ListObjectsV2, 1,000 a page, every page). S3 keeps no sha256 of
    an object unless it was uploaded with one, and ListObjectsV2 does not return it: left ""."""
    out: list[StoredFile] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=root.container, Prefix=root.prefix):
        for obj in page.get("Contents") or []:
            name = _named(root, obj["Key"])
            if name is not None:
                out.append(StoredFile(name, root.container, obj["Key"], int(obj.get("Size") or 0),
                                      _aware(obj.get("LastModified"))))
    return out


def s3_open(s3: Any, f: StoredFile) -> BinaryIO:
    """The object's body as a stream (GetObject; botocore's StreamingBody, read in chunks)."""
    return s3.get_object(Bucket=f.container, Key=f.key)["Body"]


def s3_url(s3: Any, f: StoredFile, expires_s: int) -> str:
    """A presigned GetObject URL valid ``expires_s`` seconds that downloads as an attachment
    (signed locally with the client's credentials: no call)."""
    filename = f.name.rsplit("/", 1)[-1]
    return s3.generate_presigned_url("get_object", ExpiresIn=int(expires_s), Params={
        "Bucket": f.container, "Key": f.key,
        "ResponseContentDisposition": f'attachment; filename="{filename}"'})


# -- Cloud Storage (google-cloud-storage) -------------------------------------------------------


def gcs_files(storage_client: Any, root: Root) -> list[StoredFile]:
    """Every object under ``root`` (objects.list, every page). Cloud Storage keeps an MD5 and a
    CRC32C, no sha256: left "" for the dashboard to compute."""
    out: list[StoredFile] = []
    for blob in storage_client.list_blobs(root.container, prefix=root.prefix):
        name = _named(root, blob.name)
        if name is not None:
            out.append(StoredFile(name, root.container, blob.name, blob.size,
                                  _aware(blob.updated)))
    return out


def gcs_open(storage_client: Any, f: StoredFile) -> BinaryIO:
    """A reader of the object (``Blob.open("rb")``: ranged reads, never the whole object at once)."""
    return storage_client.bucket(f.container).blob(f.key).open("rb")


def gcs_url(storage_client: Any, f: StoredFile, expires_s: int, *, credentials: Any,
            endpoint: str = "") -> str | None:
    """A V4 signed URL valid ``expires_s`` seconds, or None when ``credentials`` cannot sign (user
    credentials, anonymous ones: the dashboard streams instead). A service-account key signs
    locally; ``endpoint`` ("" = storage.googleapis.com) is where the URL points."""
    if credentials is None or not hasattr(credentials, "sign_bytes") or not getattr(
            credentials, "service_account_email", None):
        return None
    filename = f.name.rsplit("/", 1)[-1]
    kwargs: dict[str, Any] = {"version": "v4", "expiration": dt.timedelta(seconds=int(expires_s)),
                              "method": "GET", "credentials": credentials,
                              "response_disposition": f'attachment; filename="{filename}"'}
    if endpoint:
        kwargs["api_access_endpoint"] = endpoint.rstrip("/")
    return storage_client.bucket(f.container).blob(f.key).generate_signed_url(**kwargs)


# -- Azure Blob (azure-storage-blob) ------------------------------------------------------------


def blob_files(service: Any, root: Root) -> list[StoredFile]:
    """Every blob under ``root`` (List Blobs, every page). Azure keeps an optional Content-MD5, no
    sha256: left ""."""
    container = service.get_container_client(root.container)
    out: list[StoredFile] = []
    for blob in container.list_blobs(name_starts_with=root.prefix or None):
        name = _named(root, blob.name)
        if name is not None:
            out.append(StoredFile(name, root.container, blob.name, blob.size, _aware(blob.last_modified)))
    return out


class _BlobReader:
    """A file-like view of a Blob download (``StorageStreamDownloader``), read in chunks."""

    def __init__(self, downloader: Any) -> None:
        self._chunks = downloader.chunks()
        self._buffer = b""

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buffer) < size:
            try:
                self._buffer += next(self._chunks)
            except StopIteration:
                break
        if size < 0:
            data, self._buffer = self._buffer, b""
        else:
            data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def close(self) -> None:
        self._chunks = iter(())

    def __enter__(self) -> "_BlobReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def blob_open(service: Any, f: StoredFile) -> BinaryIO:
    """A chunked reader of the blob (Get Blob)."""
    return _BlobReader(service.get_blob_client(f.container, f.key).download_blob())  # type: ignore[return-value]


def blob_url(service: Any, f: StoredFile, expires_s: int) -> str | None:
    """A read-only SAS URL valid ``expires_s`` seconds, or None when the client holds no account key
    to sign with (Entra ID credentials: a user delegation key would need more rights than reading;
    the dashboard streams instead)."""
    from azure.storage.blob import BlobSasPermissions, generate_blob_sas

    credential = getattr(service, "credential", None)
    key = getattr(credential, "account_key", None)
    if not key:
        return None
    filename = f.name.rsplit("/", 1)[-1]
    sas = generate_blob_sas(account_name=service.account_name, container_name=f.container, blob_name=f.key,
                            account_key=key, permission=BlobSasPermissions(read=True),
                            expiry=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=int(expires_s)),
                            content_disposition=f'attachment; filename="{filename}"')
    return f"{service.get_blob_client(f.container, f.key).url}?{sas}"


LISTING_TTL_S = 30.0
"""How long one backend object reuses its listing of a job's files: the dashboard lists, then opens
each new file to hash it, and each open would otherwise list the prefixes again."""


def cached_listing(backend: Any, key: str, list_files: Any) -> dict[str, StoredFile]:
    """``list_files()`` (name → file), reused by ``backend`` for :data:`LISTING_TTL_S` seconds per ``key``."""
    import time

    cache = backend.__dict__.setdefault("_artifact_listings", {})
    hit = cache.get(key)
    now = time.monotonic()
    if hit is not None and now - hit[0] < LISTING_TTL_S:
        return hit[1]
    files = list_files()
    cache[key] = (now, files)
    return files
