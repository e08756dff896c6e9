"""The trainer archive a cloud job runs: ``trainer_pkg/`` plus an entry script, as one tar.gz.

The archive's bytes depend only on the files' paths and contents (entries sorted, mtime 0, uid/gid 0,
fixed modes, gzip header without name or time), so it is named by its content hash,
``trainboard-trainer-<sha256[:16]>.tar.gz``, and uploaded once per trainer version: a job whose
archive is already in the bucket (HeadObject answers) uploads nothing.

Layout (what SageMaker's training toolkit unpacks into ``/opt/ml/code``, clouds.md §1.1
``sagemaker_submit_directory`` / ``sagemaker_program``)::

    trainboard_entry.py      the entry script: python -m trainer_pkg.launch on this host
    trainboard_job.json      "{}": every config field arrives as a hyperparameter (see below)
    trainer_pkg/...          the trainer's .py files and its pyproject.toml

The entry script runs ``python -m trainer_pkg.launch --config trainboard_job.json`` (with
``--nproc-per-node $TRAINBOARD_PROCS_PER_NODE`` when set) from the directory it was unpacked into, with
that directory first on ``PYTHONPATH``; the launcher detects the platform (SageMaker: ``SM_HOSTS`` ...)
and applies the job's config from the hyperparameters (:mod:`trainer_pkg.platforms`). Arguments the
toolkit appends (``--key value`` per hyperparameter) are ignored: the launcher reads the same values
from ``/opt/ml/input/config/hyperparameters.json``.

This module imports no SDK; :func:`upload_once` takes a boto3 S3 client.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import tarfile
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")

ARCHIVE_PREFIX = "trainboard-trainer-"
ENTRY_SCRIPT = "trainboard_entry.py"
BASE_CONFIG = "trainboard_job.json"
PROCS_ENV = "TRAINBOARD_PROCS_PER_NODE"
"""Environment variable the entry script turns into the launcher's ``--nproc-per-node``."""

_INCLUDE_SUFFIXES = (".py", ".toml", ".typed")
_REPO_ROOT = Path(__file__).resolve().parents[1]

ENTRY_SOURCE = '''\
"""Trainboard's entry point in a cloud training container: run trainer_pkg.launch on this host.

SageMaker's training toolkit runs this file once per host from the unpacked archive, appending the
hyperparameters as --key value arguments; they are ignored here because the launcher reads them
from /opt/ml/input/config/hyperparameters.json. $TRAINBOARD_PROCS_PER_NODE, when set, is passed on
as --nproc-per-node.
"""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
env = dict(os.environ)
env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
env.setdefault("PYTHONUNBUFFERED", "1")
argv = [sys.executable, "-m", "trainer_pkg.launch", "--config", os.path.join(here, "trainboard_job.json")]
procs = env.get("TRAINBOARD_PROCS_PER_NODE", "").strip()
if procs:
    argv += ["--nproc-per-node", procs]
os.chdir(here)
sys.stdout.flush()
os.execve(sys.executable, argv, env)  # the launcher gets SageMaker's SIGTERM directly
'''


@dataclasses.dataclass(frozen=True)
class TrainerArchive:
    """One built archive: its bytes and the names derived from them."""

    data: bytes  # the .tar.gz bytes
    sha256: str  # hex digest of ``data``
    members: tuple[str, ...]  # archive paths, in archive order

    @property
    def name(self) -> str:
        """``trainboard-trainer-<sha256[:16]>.tar.gz``."""
        return f"{ARCHIVE_PREFIX}{self.sha256[:16]}.tar.gz"


def _trainer_files(package_dir: Path) -> list[tuple[str, Path]]:
    """(archive path, file) for every shipped file under ``package_dir`` (``.../trainer_pkg``)."""
    found = []
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith(".")
                         and not d.endswith(".egg-info"))
        for name in files:
            if name.endswith(_INCLUDE_SUFFIXES) and not name.startswith("."):
                path = Path(root) / name
                rel = path.relative_to(package_dir.parent).as_posix()
                found.append((rel, path))
    return sorted(found)


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = mode
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    tar.addfile(info, io.BytesIO(data))


def deterministic_tar_gz(entries: Iterable[tuple[str, bytes, int]]) -> bytes:
    """``(archive path, contents, mode)`` entries, in the order given, as ``.tar.gz`` bytes that depend
    on nothing else: mtime 0, uid/gid 0, no owner names, regular files only, a gzip header without
    name or time. Sort the entries first for bytes independent of the order they were found in."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in entries:
            _add(tar, name, data, mode)
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def build_archive(source_root: Path | str | None = None) -> TrainerArchive:
    """The trainer archive of ``source_root/trainer_pkg`` (default: this checkout's).

    Deterministic: the same files give the same bytes (and name) on any machine. Raises
    FileNotFoundError when ``source_root`` holds no ``trainer_pkg`` package.
    """
    root = Path(source_root) if source_root is not None else _REPO_ROOT
    package = root / "trainer_pkg"
    if not (package / "__init__.py").is_file():
        raise FileNotFoundError(f"{package} is not the trainer package (no __init__.py)")
    entries = [(ENTRY_SCRIPT, ENTRY_SOURCE.encode(), 0o755), (BASE_CONFIG, b"{}\n", 0o644)]
    entries += [(rel, path.read_bytes(), 0o644) for rel, path in _trainer_files(package)]
    entries.sort(key=lambda e: e[0])
    data = deterministic_tar_gz(entries)
    return TrainerArchive(data=data, sha256=hashlib.sha256(data).hexdigest(),
                          members=tuple(e[0] for e in entries))


def upload_once(s3: Any, archive: TrainerArchive, *, bucket: str, prefix: str,
                call: Callable[[Callable[[], T]], T] = lambda fn: fn()) -> tuple[str, bool]:
    """Put ``archive`` at ``s3://bucket/<prefix>/code/<archive.name>`` unless it is there already.

    ``s3`` is a boto3 S3 client; ``call`` wraps each request (the adapter's retry + rate limit).
    Returns ``(s3 uri, uploaded)``; ``uploaded`` is False when HeadObject found the key (same name =
    same bytes). A HeadObject error other than 404 (e.g. 403) propagates through ``call``.
    """
    key = f"{prefix.strip('/')}/code/{archive.name}" if prefix.strip("/") else f"code/{archive.name}"
    uri = f"s3://{bucket}/{key}"
    if _exists(s3, bucket, key, call):
        return uri, False
    call(lambda: s3.put_object(Bucket=bucket, Key=key, Body=archive.data,
                               ContentType="application/gzip",
                               Metadata={"trainboard-sha256": archive.sha256}))
    return uri, True


def _exists(s3: Any, bucket: str, key: str, call: Callable[[Callable[[], T]], T]) -> bool:
    def head() -> bool:
        try:
            s3.head_object(Bucket=bucket, Key=key)
            return True
        except Exception as exc:  # botocore ClientError; imported lazily by the caller's SDK
            status = (getattr(exc, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = (getattr(exc, "response", None) or {}).get("Error", {}).get("Code")
            if status == 404 or code in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    return call(head)
