"""The trainer as Vertex AI installs it: a pip-installable source archive, uploaded once per content hash.

A Vertex ``PythonPackageSpec`` names source archives in Cloud Storage (``package_uris``) and a module
(``python_module``); Vertex installs the archives with pip and runs ``python -m <module> <args>``
(clouds.md §2.1 [GAPIC PythonPackageSpec]). pip builds a ``.tar.gz`` as an sdist: one top-level
directory holding ``pyproject.toml`` (pip strips that directory when every member lies under it).
The SageMaker archive of :mod:`cloud_adapters.packaging` has no such root, so this module re-packs
the same files:

    trainboard-trainer-<sha256[:16] of the packaging archive>/pyproject.toml   (trainer_pkg's own)
    trainboard-trainer-<…>/__init__.py, launch.py, …                          (trainer_pkg's files)

``trainer_pkg/pyproject.toml`` maps the package ``trainer_pkg`` to its own directory
(``package-dir = {"trainer_pkg" = "."}``, it installs with ``pip install ./trainer_pkg``), so the
archive's root *is* that directory and pip installs the package ``trainer_pkg`` (dependencies
``torch>=2.4``, ``numpy``; the ``digits`` extra, scikit-learn, is not requested). The build backend
is setuptools (``requires = ["setuptools>=68"]``), fetched by pip's build isolation in the container.

File selection and the deterministic tar/gzip form are :mod:`cloud_adapters.packaging`'s: the same
trainer gives the same bytes, hence the same name, on any machine, and :func:`upload_once` uploads
nothing when the object is already in the bucket.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path
from typing import Any, Callable, TypeVar

from cloud_adapters import packaging

T = TypeVar("T")

PACKAGE_DIR = "trainer_pkg/"


def build_sdist(source_root: Path | str | None = None) -> packaging.TrainerArchive:
    """The pip-installable archive of ``source_root/trainer_pkg`` (default: this checkout's).

    Members: ``<root>/<path inside trainer_pkg>`` for every file :func:`packaging.build_archive`
    ships under ``trainer_pkg/`` (its entry script and base config are SageMaker's and left out).
    Its :attr:`~cloud_adapters.packaging.TrainerArchive.name` is ``trainboard-trainer-<sha256[:16]>.tar.gz``
    of these bytes. Raises FileNotFoundError when there is no trainer package, ValueError when it has
    no ``pyproject.toml`` (pip could not install it).
    """
    base = packaging.build_archive(source_root)
    root = f"trainboard-trainer-{base.sha256[:16]}"
    with tarfile.open(fileobj=io.BytesIO(base.data), mode="r:gz") as src:
        files = [(m.name[len(PACKAGE_DIR):], src.extractfile(m).read())  # type: ignore[union-attr]
                 for m in src.getmembers() if m.isfile() and m.name.startswith(PACKAGE_DIR)]
    if not any(name == "pyproject.toml" for name, _ in files):
        raise ValueError("trainer_pkg has no pyproject.toml; Vertex AI installs package_uris with pip")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files):
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    data = out.getvalue()
    return packaging.TrainerArchive(data=data, sha256=hashlib.sha256(data).hexdigest(),
                                    members=tuple(f"{root}/{name}" for name, _ in sorted(files)))


def object_name(prefix: str, *parts: str) -> str:
    """``<prefix>/<parts…>`` without empty segments or doubled slashes."""
    return "/".join(p.strip("/") for p in (prefix, *parts) if p.strip("/"))


def upload_once(bucket: Any, archive: packaging.TrainerArchive, *, prefix: str,
                call: Callable[[Callable[[], T]], T] = lambda fn: fn()) -> tuple[str, bool]:
    """Put ``archive`` at ``gs://<bucket>/<prefix>/code/<archive.name>`` unless it is there already.

    ``bucket`` is a ``google.cloud.storage.Bucket``; ``call`` wraps each request (the adapter's retry
    and rate limit). Returns ``(gs:// URI, uploaded)``; ``uploaded`` is False when the object exists
    (same name = same bytes). The upload is conditional (``ifGenerationMatch=0``), so a concurrent
    upload of the same archive answered 412 counts as present.
    """
    from google.api_core import exceptions as gexc

    name = object_name(prefix, "code", archive.name)
    blob = bucket.blob(name)
    uri = f"gs://{bucket.name}/{name}"
    if call(lambda: blob.exists(retry=None, timeout=30)):
        return uri, False
    blob.metadata = {"trainboard-sha256": archive.sha256}

    def upload() -> bool:
        try:
            blob.upload_from_string(archive.data, content_type="application/gzip", if_generation_match=0,
                                    retry=None, timeout=120)
            return True
        except gexc.PreconditionFailed:
            return False

    return uri, call(upload)
