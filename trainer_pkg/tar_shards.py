"""WebDataset-style tar shards: where they are, and what each holds (an index of its samples).

Torch-free. A ``webdataset`` dataset is a local folder or an object-store prefix (``s3://``,
``gs://``, ``az://``: :mod:`trainer_pkg.objstore`) of ``*.tar`` shards, sorted by name, and optionally
a ``val/`` sub-folder (sub-prefix) of validation shards::

    <root>/shard-000000.tar    <key>.png  <key>.cls   (one sample: members that share a key, adjacent)
    <root>/shard-000001.tar    ...
    <root>/val/shard-000000.tar

A member's key is its name up to the first dot of its base name (WebDataset's convention:
``a/b.c.jpg`` is key ``a/b`` and extension ``c.jpg``); a sample is the run of adjacent members with
one key, and needs one image (an extension of :data:`IMAGE_TYPES`) and a ``.cls`` member holding
its integer class label as text. Other members (``.json``, ``.txt``) are skipped.

:func:`index_shard` walks a shard's tar headers (seeking over the images' bytes: a local file reads
one 512-byte header per member, an object one ranged GET per MiB) and reads the ``.cls`` labels; the
images themselves are read later, by offset, when a batch needs them.
"""

from __future__ import annotations

import dataclasses
import os
import tarfile

import numpy as np

from trainer_pkg import objstore
from trainer_pkg.config import ConfigError

IMAGE_TYPES = ("png", "jpg", "jpeg", "bmp", "gif", "webp", "tif", "tiff", "ppm", "pgm")
"""Member extensions read as the sample's image."""
VAL_DIR = "val"


@dataclasses.dataclass(frozen=True)
class TarShard:
    """One ``.tar`` shard: where it is and its size."""

    path: str
    """Absolute path, or the object's URI."""
    size: int
    """Bytes."""


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """The samples of one shard, in tar order: where each image's bytes lie, and its label."""

    offsets: np.ndarray
    """(samples,) int64 byte offset of each image's data in the shard."""
    lengths: np.ndarray
    """(samples,) int64 bytes of each image."""
    labels: np.ndarray
    """(samples,) int64 class labels (the ``.cls`` members)."""

    def __len__(self) -> int:
        return len(self.labels)


def list_shards(uri: str) -> tuple[str, list[TarShard], list[TarShard]]:
    """(root, train shards, val shards) of the webdataset at ``uri``, each list sorted by name; the
    val shards are those of ``<root>/val/`` (none when it has no such folder). A prefix is listed once.

    Raises :class:`ConfigError` when the folder or prefix does not exist or holds no ``.tar`` shard."""
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    if not path:
        raise ConfigError("data.uri: a webdataset needs the folder or s3://, gs://, az:// prefix of its .tar shards")
    if objstore.is_remote(path):
        root = path.rstrip("/")
        s, key = objstore.store(root)
        listed = s.list(key + "/" if key else "")
        prefix = key + "/" if key else ""
        rel = {k[len(prefix):]: size for k, size in listed.items()}
        make = lambda name: TarShard(objstore.join(root, name), rel[name])  # noqa: E731
    else:
        if "://" in path:
            raise ConfigError(f"webdataset {uri} is neither a local folder nor an s3://, gs:// or az:// prefix")
        root = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(root):
            what = "does not exist" if not os.path.exists(root) else "is a file, not a folder"
            raise ConfigError(f"webdataset {root} {what}: give the folder holding its .tar shards")
        rel = {}
        for sub in ("", VAL_DIR):
            folder = os.path.join(root, sub)
            if os.path.isdir(folder):
                rel.update((os.path.join(sub, e.name) if sub else e.name, e.stat().st_size)
                           for e in os.scandir(folder) if e.is_file())
        make = lambda name: TarShard(os.path.join(root, name), rel[name])  # noqa: E731
    train = [make(n) for n in sorted(rel) if n.endswith(".tar") and "/" not in n]
    val = [make(n) for n in sorted(rel) if n.endswith(".tar") and n.startswith(VAL_DIR + "/") and n.count("/") == 1]
    if not train:
        raise ConfigError(f"webdataset {root} holds no .tar shards at its top level: put the shards there "
                          f"(<name>.tar, each of <key>.<image ext> and <key>.cls members), validation ones in {VAL_DIR}/")
    return root, train, val


def read_bytes(path: str, offset: int, length: int) -> bytes:
    """``length`` bytes of the shard file or object ``path`` at ``offset`` (a pread, or one ranged GET)."""
    if objstore.is_remote(path):
        data = objstore.read(path, offset, length)
    else:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
    if len(data) != length:
        raise ConfigError(f"shard {path} ended after {offset + len(data):,} bytes, before byte {offset + length:,}: "
                          "was it truncated or rewritten while training?")
    return data


def open_shard(shard: TarShard, *, block: int = 1 << 20) -> objstore.RangeFile:
    """A seekable file over ``shard``, read in blocks of ``block`` bytes (for sequential reading)."""
    if objstore.is_remote(shard.path):
        s, key = objstore.store(shard.path)
        fetch = lambda offset, length: s.read(key, offset, length)  # noqa: E731
    else:
        fetch = lambda offset, length: read_bytes(shard.path, offset, length)  # noqa: E731
    return objstore.RangeFile(fetch, shard.size, name=shard.path, block=block)


def _key_ext(name: str) -> tuple[str, str]:
    folder, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return (os.path.join(folder, stem) if folder else stem), ext.lower()


def index_shard(shard: TarShard) -> ShardIndex:
    """The samples of ``shard`` (its tar headers and ``.cls`` labels read, its images not).

    Raises :class:`ConfigError` naming the shard when it is not a tar file, or naming the sample when
    one has no image or no ``.cls`` member, or a label that is not a non-negative integer (the first
    few problems at once)."""
    offsets: list[int] = []
    lengths: list[int] = []
    labels: list[int] = []
    problems: list[str] = []
    current: dict[str, tarfile.TarInfo] = {}
    key = None
    try:
        with open_shard(shard) as raw, tarfile.open(fileobj=raw, mode="r:") as tar:

            def finish() -> None:
                if key is None:
                    return
                image = next((m for ext, m in current.items() if ext.rsplit(".", 1)[-1] in IMAGE_TYPES), None)
                label = current.get("cls")
                if image is None or label is None:
                    missing = "an image (" + ", ".join(IMAGE_TYPES[:3]) + ", ...)" if image is None else "a .cls label"
                    problems.append(f"sample {key!r} has no {missing}")
                    return
                text = tar.extractfile(label).read().decode("utf-8", "replace").strip()
                if not text.isdigit():
                    problems.append(f"sample {key!r}: {key}.cls holds {text[:20]!r}, not a class number 0, 1, ...")
                    return
                offsets.append(image.offset_data)
                lengths.append(image.size)
                labels.append(int(text))

            for member in tar:
                if not member.isfile():
                    continue
                k, ext = _key_ext(member.name)
                if k != key:
                    finish()
                    key, current = k, {}
                current[ext] = member
            finish()
    except tarfile.TarError as exc:
        raise ConfigError(f"shard {shard.path} is not a readable tar file ({exc}): write shards with tar or "
                          "webdataset's ShardWriter") from None
    if problems:
        shown = problems[:5] + ([f"and {len(problems) - 5} more"] if len(problems) > 5 else [])
        raise ConfigError(f"shard {shard.path}: " + "; ".join(shown))
    if not labels:
        raise ConfigError(f"shard {shard.path} holds no samples (<key>.<image ext> with <key>.cls): remove it "
                          "or write samples into it")
    return ShardIndex(np.array(offsets, dtype=np.int64), np.array(lengths, dtype=np.int64),
                      np.array(labels, dtype=np.int64))
