"""Objects read straight from ``s3://``, ``gs://`` and ``az://`` prefixes: listed once, read by range.

Torch-free. Each cloud's SDK is imported only when a URI of its scheme is opened (a job's image
usually holds one of them), with an error naming the extra to install when it is missing:

=========  =======================  ====================================================  ===================
scheme     URI                      a ranged read                                         pip install
=========  =======================  ====================================================  ===================
``s3``     ``s3://bucket/prefix``   boto3 ``get_object(Range="bytes=a-b")``               ``trainboard-trainer[s3]``
``gs``     ``gs://bucket/prefix``   google-cloud-storage ``download_as_bytes(start, end)``  ``trainboard-trainer[gcs]``
``az``     ``az://container/prefix``  azure-storage-blob ``download_blob(offset, length)``  ``trainboard-trainer[azure]``
=========  =======================  ====================================================  ===================

Credentials come from each SDK's default chain, as the platform provides them, never from the job
config: boto3's (environment keys, the instance or task role; ``AWS_ENDPOINT_URL_S3`` points it at
another endpoint), ``google.auth.default`` (the service account of a Vertex job or GCE VM;
``STORAGE_EMULATOR_HOST`` an emulator, anonymously), and for Azure the storage account named by
``AZURE_STORAGE_CONNECTION_STRING``, or ``AZURE_STORAGE_ACCOUNT_URL`` / ``AZURE_STORAGE_ACCOUNT_NAME``
with azure-identity's ``DefaultAzureCredential`` (a managed identity on Azure ML compute).

A client is made per process (DataLoader workers are forked: an SDK client and its connection
pool are not shared across a fork), and per bucket.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable

from trainer_pkg.config import ConfigError

SCHEMES = ("s3", "gs", "az")
_EXTRA = {"s3": ("boto3", "s3"), "gs": ("google-cloud-storage", "gcs"), "az": ("azure-storage-blob", "azure")}


def is_remote(uri: str) -> bool:
    """Whether ``uri`` is an object-store URI this module reads (``s3://``, ``gs://``, ``az://``)."""
    return uri.split("://", 1)[0] in SCHEMES and "://" in uri


def split_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, bucket or container, key) of ``uri``; the key has no leading slash and may be "".
    Raises :class:`ConfigError` for another scheme or a URI without a bucket."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ConfigError(f"{uri} is not an s3://, gs:// or az:// URI")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ConfigError(f"{uri} names no bucket: write {scheme}://<bucket>/<prefix>")
    return scheme, bucket, key.lstrip("/")


def join(uri: str, *parts: str) -> str:
    """``uri`` with ``parts`` appended, one slash between each."""
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts if p)])


class Store:
    """One bucket (container) of one object store. Keys are relative to the bucket."""

    scheme = ""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket

    def uri(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``offset … offset + length − 1`` of the object ``key`` (one ranged GET; the whole
        object when ``length`` is None); fewer when it ends first. Raises :class:`FileNotFoundError`
        when there is no such object, :class:`ConfigError` when the credentials may not read it."""
        raise NotImplementedError

    def size(self, key: str) -> int:
        """Bytes in the object ``key`` (a HEAD); :class:`FileNotFoundError` when there is none."""
        raise NotImplementedError

    def list(self, prefix: str) -> dict[str, int]:
        """{key: bytes} of every object whose key starts with ``prefix``, by listing (no object read)."""
        raise NotImplementedError


class S3Store(Store):
    scheme = "s3"

    def __init__(self, bucket: str) -> None:
        super().__init__(bucket)
        boto3 = _sdk("s3", "boto3")
        from botocore.exceptions import ClientError, NoCredentialsError

        self._client = boto3.client("s3")
        self._errors = (ClientError, NoCredentialsError)

    def _call(self, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self._errors as exc:
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(self.uri(key)) from None
            raise _denied(self.uri(key), exc) from None

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""
        extra = {} if length is None and not offset else {
            "Range": f"bytes={offset}-{'' if length is None else offset + length - 1}"}
        return self._call(key, lambda: self._client.get_object(Bucket=self.bucket, Key=key, **extra)["Body"].read())

    def size(self, key: str) -> int:
        return int(self._call(key, lambda: self._client.head_object(Bucket=self.bucket, Key=key))["ContentLength"])

    def list(self, prefix: str) -> dict[str, int]:
        def listing() -> dict[str, int]:
            out: dict[str, int] = {}
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                out.update((o["Key"], int(o["Size"])) for o in page.get("Contents", ()))
            return out

        return self._call(prefix, listing)


class GCSStore(Store):
    scheme = "gs"

    def __init__(self, bucket: str) -> None:
        super().__init__(bucket)
        storage = _sdk("gs", "google.cloud.storage")
        from google.api_core import exceptions
        from google.auth.exceptions import DefaultCredentialsError

        try:
            self._bucket = storage.Client().bucket(bucket)
        except DefaultCredentialsError as exc:
            raise _denied(f"gs://{bucket}", exc) from None
        self._missing, self._errors = exceptions.NotFound, (exceptions.GoogleAPIError, DefaultCredentialsError)

    def _call(self, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self._missing:
            raise FileNotFoundError(self.uri(key)) from None
        except self._errors as exc:
            raise _denied(self.uri(key), exc) from None

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""
        end = None if length is None else offset + length - 1  # inclusive, as the API's
        return self._call(key, lambda: self._bucket.blob(key).download_as_bytes(start=offset or None, end=end))

    def size(self, key: str) -> int:
        def head() -> int:
            blob = self._bucket.get_blob(key)
            if blob is None:
                raise self._missing(key)
            return int(blob.size)

        return self._call(key, head)

    def list(self, prefix: str) -> dict[str, int]:
        return self._call(prefix, lambda: {b.name: int(b.size) for b in self._bucket.client.list_blobs(
            self._bucket, prefix=prefix)})


class AzureStore(Store):
    scheme = "az"

    def __init__(self, bucket: str) -> None:
        super().__init__(bucket)
        blob = _sdk("az", "azure.storage.blob")
        from azure.core import exceptions

        conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        if conn:
            service = blob.BlobServiceClient.from_connection_string(conn)
        else:
            url = os.environ.get("AZURE_STORAGE_ACCOUNT_URL") or ""
            name = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") or os.environ.get("AZURE_STORAGE_ACCOUNT") or ""
            if not url and not name:
                raise ConfigError(f"az://{bucket}: the trainer does not know the storage account: set "
                                  "AZURE_STORAGE_ACCOUNT_URL (https://<account>.blob.core.windows.net), "
                                  "AZURE_STORAGE_ACCOUNT_NAME or AZURE_STORAGE_CONNECTION_STRING in the job's environment")
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError:
                raise ConfigError("reading az:// datasets with the platform's identity needs azure-identity: "
                                  "pip install 'trainboard-trainer[azure]'") from None
            service = blob.BlobServiceClient(url or f"https://{name}.blob.core.windows.net",
                                             credential=DefaultAzureCredential())
        self._container = service.get_container_client(bucket)
        self._missing, self._errors = exceptions.ResourceNotFoundError, (exceptions.AzureError,)

    def _call(self, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self._missing:
            raise FileNotFoundError(self.uri(key)) from None
        except self._errors as exc:
            raise _denied(self.uri(key), exc) from None

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""
        return self._call(key, lambda: self._container.download_blob(
            key, offset=offset or None if length is None else offset, length=length).readall())

    def size(self, key: str) -> int:
        return int(self._call(key, lambda: self._container.get_blob_client(key).get_blob_properties().size))

    def list(self, prefix: str) -> dict[str, int]:
        return self._call(prefix, lambda: {b.name: int(b.size) for b in self._container.list_blobs(
            name_starts_with=prefix)})


_STORES = {"s3": S3Store, "gs": GCSStore, "az": AzureStore}
_OPEN: dict[tuple[int, str, str], Store] = {}


def store(uri: str) -> tuple[Store, str]:
    """(the :class:`Store` of ``uri``'s bucket, made once per process, ``uri``'s key in it)."""
    scheme, bucket, key = split_uri(uri)
    ident = (os.getpid(), scheme, bucket)
    if ident not in _OPEN:
        _OPEN[ident] = _STORES[scheme](bucket)
    return _OPEN[ident], key


def read(uri: str, offset: int = 0, length: int | None = None) -> bytes:
    """Bytes of the object ``uri`` (:meth:`Store.read`)."""
    s, key = store(uri)
    return s.read(key, offset, length)


def _sdk(scheme: str, module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package, extra = _EXTRA[scheme]
        raise ConfigError(f"reading {scheme}:// datasets needs {package}, which this image lacks: "
                          f"pip install 'trainboard-trainer[{extra}]' (or {package}), or read the "
                          "dataset through the platform's mount or channel path instead") from None


def _denied(uri: str, exc: Exception) -> ConfigError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"{uri} cannot be read: {first[:300]}; check that the job's credentials (the "
                       "platform's role or identity) may list and read that prefix")


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over one object (or a local file) of ``size`` bytes, read in
    blocks of ``block`` bytes by ``fetch(offset, length)``; for :mod:`tarfile`, which reads headers
    and seeks over members' data. Memory: one block."""

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, *, name: str = "", block: int = 1 << 20) -> None:
        super().__init__()
        self._fetch, self._size, self.name, self._block = fetch, size, name, block
        self._pos = 0
        self._buf_start, self._buf = 0, b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        """Fill ``b`` from the current position (fewer bytes only at the end of the object): a
        read that straddles a block boundary fetches the next block, never returns short."""
        want = min(len(b), self._size - self._pos)
        done = 0
        while done < want:
            end = self._buf_start + len(self._buf)
            if not self._buf_start <= self._pos < end:
                self._buf_start = self._pos
                self._buf = self._fetch(self._pos, min(max(self._block, want - done), self._size - self._pos))
                end = self._buf_start + len(self._buf)
                if not self._buf:
                    raise OSError(f"{self.name} ended at byte {self._pos:,} of {self._size:,}: was it changed while read?")
            n = min(want - done, end - self._pos)
            at = self._pos - self._buf_start
            b[done:done + n] = self._buf[at:at + n]
            self._pos += n
            done += n
        return done
