"""What identified a dataset's content when a job was created (``TrainingJob.dataset_fingerprint``),
so a job page can say whether two runs saw the same data.

- a built-in dataset: ``{"kind": "builtin", "name": "digits"}`` (its content ships with the trainer);
- a local path: ``{"kind": "local", "path", "size_bytes", "files", "mtime", "sample_sha256"}`` read
  here, without reading every byte (:func:`local_fingerprint`);
- a cloud URI (``s3://``, ``gs://``, ``azureml://``): None here. The worker records it at submit
  time from the provider's listing (:func:`cloud_adapters.fingerprints.fingerprint_dataset`, called
  by :mod:`jobs.lifecycle`), with the backend's credentials the web process should not use.

Torch-free and Django-free: a leaf that the service and the worker side share.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from pathlib import Path
from typing import Any

from cloud_adapters.base import uri_scheme

SAMPLE_FILES = 16
"""Files whose first bytes :func:`local_fingerprint` hashes at most."""
SAMPLE_BYTES = 1024 * 1024
"""Bytes read from the start of each sampled file (1 MiB)."""
TOKENS_META = "meta.json"
"""A token dataset's index of its shards (:mod:`trainer_pkg.tokens`): always hashed."""


def _regular_files(root: Path) -> list[tuple[str, Path, os.stat_result]]:
    """Every regular file under ``root`` (``root`` itself when it is one), as (path relative to
    ``root`` in POSIX form, its path, its stat), sorted by path. Symbolic links are not followed: the trainer
    reads the same tree the dataset check read, and a link out of it is not the dataset's content."""
    if root.is_file():
        return [(root.name, root, root.stat())]
    if not root.is_dir():
        raise FileNotFoundError(2, "no such file or directory", str(root))
    found = []
    for folder, dirs, names in os.walk(root, followlinks=False):
        dirs.sort()
        for name in names:
            path = Path(folder, name)
            st = path.lstat()
            if path.is_file() and not path.is_symlink():
                found.append((path.relative_to(root).as_posix(), path, st))
    found.sort(key=lambda item: item[0])
    return found


def sample_indices(count: int, most: int = SAMPLE_FILES) -> list[int]:
    """Which of ``count`` sorted files are sampled: all of them up to ``most``, else ``most`` evenly
    spaced from the first to the last (``sample_indices(100, 4)`` = ``[0, 33, 66, 99]``)."""
    if count <= most:
        return list(range(count))
    return [round(i * (count - 1) / (most - 1)) for i in range(most)]


def local_fingerprint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fingerprint of the local file or directory ``path``:

    ``{"kind": "local", "path": str, "size_bytes": int (total of the regular files), "files": int,
    "mtime": str (the newest modification time, ISO 8601 UTC; null for no file), "sample_sha256":
    str (hex SHA-256 over, for each of up to :data:`SAMPLE_FILES` files chosen by
    :func:`sample_indices` from the sorted paths: its relative path, its size and its first
    :data:`SAMPLE_BYTES` bytes; a token dataset's top-level ``meta.json``, which names its shards,
    is always among them)}``.

    A changed, added, removed or renamed file changes ``size_bytes``, ``files``, ``mtime`` or
    ``sample_sha256``; a change deep inside an unsampled large file only its ``mtime``. Reads at most
    16 MiB whatever the dataset's size, but stats every file. Never raises: a path that cannot be
    read gives ``{"kind": "local", "path": ..., "error": "<why>"}``.
    """
    root = Path(path)
    try:
        files = _regular_files(root)
        digest = hashlib.sha256()
        picked = sample_indices(len(files))
        meta = [i for i, (name, _, _) in enumerate(files) if name == TOKENS_META]
        for index in sorted(set(picked) | set(meta)):
            name, file, st = files[index]
            digest.update(f"{name}\0{st.st_size}\0".encode("utf-8", "surrogateescape"))
            with open(file, "rb") as fh:
                digest.update(fh.read(SAMPLE_BYTES))
    except OSError as exc:
        return {"kind": "local", "path": str(path), "error": f"cannot read it: {exc.strerror or exc}"}
    newest = max((st.st_mtime for _, _, st in files), default=None)
    return {
        "kind": "local",
        "path": str(path),
        "size_bytes": sum(st.st_size for _, _, st in files),
        "files": len(files),
        "mtime": (dt.datetime.fromtimestamp(newest, tz=dt.timezone.utc).isoformat()
                  if newest is not None else None),
        "sample_sha256": digest.hexdigest(),
    }


def dataset_fingerprint(*, format: str, uri: str, builtin_name: str = "") -> dict[str, Any] | None:
    """The fingerprint of a dataset taken when a job is created: ``{"kind": "builtin", "name"}`` for
    ``format`` builtin, :func:`local_fingerprint` for a local path, None for a cloud URI (taken at
    submit by the worker). Never raises."""
    if format == "builtin":
        return {"kind": "builtin", "name": builtin_name or "digits"}
    if not uri or uri_scheme(uri):
        return None
    return local_fingerprint(uri.removeprefix("file://"))
