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

With a user code archive (``JobSpec.code``, :func:`build_archive`'s ``code``) its files join these at
the archive's root, beside ``trainer_pkg/``: a ``requirements.txt`` there is what SageMaker's toolkit
installs (``pip install -r requirements.txt`` in the code directory, before the entry script), and
the job's ``code.dir`` is ``"."``, the directory that holds ``trainer_pkg/`` (:data:`CODE_DIR_HERE`).
The combined archive is named by its own hash, so each pair (trainer, user code) is uploaded once.

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
import re
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Mapping, TypeVar

from cloud_adapters.base import CodeBundle, InvalidSpec

T = TypeVar("T")

ARCHIVE_PREFIX = "trainboard-trainer-"
ENTRY_SCRIPT = "trainboard_entry.py"
BASE_CONFIG = "trainboard_job.json"
PROCS_ENV = "TRAINBOARD_PROCS_PER_NODE"
"""Environment variable the entry script turns into the launcher's ``--nproc-per-node``."""

CODE_DIR_HERE = "."
"""``code.dir`` of a job whose user files lie beside ``trainer_pkg/`` (the SageMaker submit directory,
the Azure ML code snapshot): a relative ``code.dir`` is taken relative to the directory that holds
the ``trainer_pkg`` package the launcher runs from (SageMaker's entry script and Azure ML's command
also start there, so the working directory is the same place)."""
OURS_TOP = ("trainer_pkg", "trainboard_")
"""Top-level names a user archive may not use: the trainer package and our ``trainboard_*`` files."""

_INCLUDE_SUFFIXES = (".py", ".toml", ".typed")
REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout whose ``trainer_pkg`` is shipped when a job names no trainer directory."""

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
    prefix: str = ARCHIVE_PREFIX  # object name before the hash: what kind of archive this is

    @property
    def name(self) -> str:
        """``<prefix><sha256[:16]>.tar.gz``: ``trainboard-trainer-…`` for a trainer archive."""
        return f"{self.prefix}{self.sha256[:16]}.tar.gz"


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


Entry = tuple[str, bytes, int]
"""One archive member: (relative POSIX path, contents, mode 0o644 or 0o755)."""


def deterministic_tar_gz(entries: Iterable[Entry]) -> bytes:
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


def archive_of(entries: Iterable[Entry], *, prefix: str = ARCHIVE_PREFIX) -> TrainerArchive:
    """``entries`` sorted by path as one :func:`deterministic_tar_gz` archive, named ``<prefix><hash>``."""
    entries = sorted(entries, key=lambda e: e[0])
    data = deterministic_tar_gz(entries)
    return TrainerArchive(data=data, sha256=hashlib.sha256(data).hexdigest(),
                          members=tuple(e[0] for e in entries), prefix=prefix)


def code_files(code: CodeBundle) -> list[Entry]:
    """The regular files of the user's stored archive ``code.path``, sorted by path; directories are
    implied by the paths and left out. Modes are 0o755 for a file with any execute bit, else 0o644.

    Raises :class:`InvalidSpec` when the file is missing or unreadable, its SHA-256 is not
    ``code.sha256`` (the store changed under the job), or a member is not a plain relative file
    (absolute, ``..``, a link or a special file: the dashboard refuses those on upload, so such an
    archive did not come from it).
    """
    try:
        data = Path(code.path).read_bytes()
    except OSError as exc:
        raise InvalidSpec(f"code archive {code.path}: cannot read it ({exc.strerror}); the code store lost "
                          f"the archive {code.sha256[:16]}, upload the code again.") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != code.sha256:
        raise InvalidSpec(f"code archive {code.path}: its SHA-256 is {actual[:16]}…, the job records "
                          f"{code.sha256[:16]}…; the stored archive changed, upload the code again.")
    files: list[Entry] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for member in tar.getmembers():
                if member.isdir():
                    continue
                name = member.name
                parts = PurePosixPath(name).parts
                if not member.isfile():
                    raise InvalidSpec(f"code archive member {name!r}: not a regular file (a link or a special "
                                      f"file); archives hold regular files only.")
                if name.startswith("/") or ".." in parts or not parts:
                    raise InvalidSpec(f"code archive member {name!r}: the path leaves the archive; members are "
                                      f"relative paths without '..'.")
                body = tar.extractfile(member).read()  # type: ignore[union-attr]
                files.append(("/".join(p for p in parts if p != "."), body,
                              0o755 if member.mode & 0o111 else 0o644))
    except tarfile.TarError as exc:
        raise InvalidSpec(f"code archive {code.path}: not a readable tar.gz ({exc}); upload the code again.") \
            from None
    return sorted(files, key=lambda e: e[0])


def refuse_ours(files: Iterable[Entry], ours: Iterable[str]) -> None:
    """Raise :class:`InvalidSpec` naming the first user member that would replace one of ``ours``
    (archive paths) or uses a name of :data:`OURS_TOP` at the top level."""
    taken = set(ours)
    for name, _, _ in files:
        top = name.split("/", 1)[0]
        if name in taken or top == OURS_TOP[0] or top.startswith(OURS_TOP[1]):
            raise InvalidSpec(f"code archive member {name!r}: the name is Trainboard's (trainer_pkg/ and "
                              f"trainboard_* at the top level are the trainer's); rename it in your code.")


def build_archive(source_root: Path | str | None = None, *, code: CodeBundle | None = None) -> TrainerArchive:
    """The trainer archive of ``source_root/trainer_pkg`` (default: this checkout's), with the files
    of the user's archive ``code`` at its root when given (:func:`code_files`).

    Deterministic: the same files give the same bytes (and name) on any machine. Raises
    FileNotFoundError when ``source_root`` holds no ``trainer_pkg`` package, :class:`InvalidSpec`
    when ``code`` cannot be read or a member of it would replace one of ours (:func:`refuse_ours`).
    """
    return archive_of(archive_entries(source_root, code=code))


def archive_entries(source_root: Path | str | None = None, *, code: CodeBundle | None = None) -> list[Entry]:
    """The members of :func:`build_archive`'s archive, unsorted: the entry script, the base config,
    ``trainer_pkg``'s files and the user's (for a backend that packs them in another format: the Ray
    backend's ``working_dir`` zip, :func:`deterministic_zip`). Raises as :func:`build_archive`."""
    root = Path(source_root) if source_root is not None else REPO_ROOT
    package = root / "trainer_pkg"
    if not (package / "__init__.py").is_file():
        raise FileNotFoundError(f"{package} is not the trainer package (no __init__.py)")
    entries = [(ENTRY_SCRIPT, ENTRY_SOURCE.encode(), 0o755), (BASE_CONFIG, b"{}\n", 0o644)]
    entries += [(rel, path.read_bytes(), 0o644) for rel, path in _trainer_files(package)]
    if code is not None:
        user = code_files(code)
        refuse_ours(user, (e[0] for e in entries))
        entries += user
    return entries


def deterministic_zip(entries: Iterable[Entry]) -> bytes:
    """``(archive path, contents, mode)`` entries as ``.zip`` bytes (deflated) that depend on nothing
    else: sorted by path, every timestamp 1980-01-01 00:00 (the zip format's earliest), the Unix mode in
    the external attributes, no directory entries (implied by the paths)."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name, data, mode in sorted(entries, key=lambda e: e[0]):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # Unix: the mode below is read as st_mode
            info.external_attr = (0o100000 | mode) << 16
            archive.writestr(info, data)
    return out.getvalue()


def config_with_code(config: Mapping[str, Any], code: CodeBundle | None, code_dir: str) -> dict[str, Any]:
    """The JobConfig dict ``config`` with ``code.dir`` = ``code_dir`` (where the platform puts the
    archive's files) and ``code.sha256`` = the archive's hash; ``config`` itself (copied) when the job
    has no user code. The code section's other fields (``script``, ``args``) are the dashboard's."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    if code is not None:
        section = out.setdefault("code", {})
        if not isinstance(section, dict):
            raise InvalidSpec(f"config.code: expected an object of fields, got {section!r:.100}")
        section.update(dir=code_dir, sha256=code.sha256)
    return out


def code_framework(config: Mapping[str, Any]) -> str:
    """The JobConfig dict's ``code.framework`` (how a script's processes start: ``torch`` when the
    config names none; ``mpi`` asks the platform for its MPI launcher, docs/user-code.md)."""
    code = config.get("code")
    return str(code.get("framework") or "torch") if isinstance(code, Mapping) else "torch"


def requirement_lines(text: str) -> list[str]:
    """The requirements of a ``requirements.txt`` text, one entry per requirement as pip reads the file:
    comments (``#`` at the start or after whitespace) and blank lines dropped, ``\\`` continuations
    joined, surrounding whitespace stripped. Option lines (``--index-url …``) are kept as they are."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = pending + raw
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            lines.append(line)
    if pending.strip():
        lines.append(re.sub(r"(^|\s)#.*$", "", pending).strip())
    return [line for line in lines if line]


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
