"""Users' code archives: read an upload or a directory, refuse what is unsafe, normalize, check the
entry point or script, store once by content (docs/user-code.md "Code archives").

Nothing here imports or runs the user's code: members are read as bytes, the entry point's module is
parsed with :mod:`ast`, ``requirements.txt`` is read as text. User code runs only inside a job.

Usage::

    archive = normalize_upload(request.FILES["code"], "model.zip")   # ArchiveError names the member
    check_entry_point(archive, "mymodel.net:build")                   # or check_script(archive, "train.py")
    row = store(archive)                                              # CodeArchive; file written once

Refused, each as an :class:`ArchiveError` naming the member and why (nothing is stored; every unsafe
member of an archive in one error's ``messages``): an upload
over ``TRAINBOARD_CODE_MAX_BYTES`` as sent, files over it in total uncompressed (counted as they are
read, so a zip bomb stops there, whatever its headers claim), more than ``TRAINBOARD_CODE_MAX_FILES``
regular files, an absolute path, a ``..`` component, a symbolic or hard link, a device, FIFO or
other special file, a member inside ``trainer_pkg/`` or a top-level name starting ``trainboard_``
(Trainboard's own, which the backends put beside the user's files), a member that appears twice.

Normalized form: regular files only, sorted, mtime 0, uid/gid 0, mode 0755 when the file had an
execute bit else 0644, written by :func:`cloud_adapters.packaging.deterministic_tar_gz`; named by the
SHA-256 of those bytes, so the same files give the same hash whatever their archive format,
timestamps or owners. An upload whose files all lie in one top directory (``project-main/...``, as a
zip of a folder has) loses that directory, unless it is itself a Python package (has an
``__init__.py``), whose name the entry point needs. ``__pycache__/``, ``.git/`` and ``__MACOSX/``
(bytecode, history and macOS resource forks, not code) are left out of every archive.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import dataclasses
import gzip
import hashlib
import io
import os
import re
import stat
import tarfile
import tempfile
import zipfile
import zlib
from importlib.util import decode_source
from pathlib import Path
from typing import IO, Iterator

from django.conf import settings

from cloud_adapters.packaging import deterministic_tar_gz
from jobs.models import CodeArchive
from trainer_pkg.config import ConfigError
from trainer_pkg.registry import parse_entry_point

REQUIREMENTS = "requirements.txt"
SKIPPED_DIRS = frozenset({"__pycache__", ".git", "__MACOSX"})
"""Directory names left out of every archive, at any depth (not code: see the module docstring)."""

_CHUNK = 1024 * 1024
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class ArchiveError(ValueError):
    """Why an archive, its entry point or its script is refused: ``str()`` is the message for the
    user, ``member 'x': reason`` when one member is the cause, else the reason alone."""

    def __init__(self, member: str | None, reason: str) -> None:
        self.member = member
        self.reason = reason
        super().__init__(f"member {_quote(member)}: {reason}" if member is not None else reason)
        self.messages = [str(self)]  # every refusal of the archive (ArchiveError.of), this one first

    @classmethod
    def of(cls, refusals: list["ArchiveError"]) -> "ArchiveError":
        """One error carrying every one of ``refusals`` (in order) in ``messages``; ``str()`` the first's."""
        first = refusals[0]
        combined = cls(first.member, first.reason)
        combined.messages = [m for r in refusals for m in r.messages]
        return combined


@dataclasses.dataclass(frozen=True)
class NormalizedArchive:
    """One normalized archive, in memory (at most ``TRAINBOARD_CODE_MAX_BYTES`` of files)."""

    data: bytes  # the deterministic .tar.gz
    sha256: str  # hex SHA-256 of ``data``
    files: tuple[str, ...]  # member paths, sorted (posix, relative, regular files only)
    requirements: str  # text of the top-level requirements.txt, "" when there is none
    stripped_prefix: str = ""  # the shared top directory removed from every member ("" = none)
    contents: dict[str, bytes] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def size_bytes(self) -> int:
        """Size of the normalized .tar.gz, bytes."""
        return len(self.data)

    @property
    def file_count(self) -> int:
        return len(self.files)


def max_bytes() -> int:
    """``settings.TRAINBOARD_CODE_MAX_BYTES``: bytes an upload may have as sent, and its files in total."""
    return int(getattr(settings, "TRAINBOARD_CODE_MAX_BYTES", 50 * 1024 * 1024))


def max_files() -> int:
    """``settings.TRAINBOARD_CODE_MAX_FILES``: regular files an archive may hold."""
    return int(getattr(settings, "TRAINBOARD_CODE_MAX_FILES", 2000))


# =============================================================================================
# Reading: uploads and directories
# =============================================================================================


def normalize_upload(fileobj: IO[bytes], filename: str = "") -> NormalizedArchive:
    """The normalized archive of an uploaded ``.zip`` or ``.tar.gz``/``.tgz`` (``fileobj``: binary,
    read from its start; ``filename``: the name it was sent under, for messages only — the format
    is told by the content).

    Raises :class:`ArchiveError` for anything refused (module docstring), for a file that is neither
    format, and for an archive with no files.
    """
    limit = max_bytes()
    spooled = _spool(fileobj, limit, filename)
    try:
        head = spooled.read(4)
        spooled.seek(0)
        if head[:2] == b"PK":
            entries = _zip_entries(spooled)
        elif head[:2] == b"\x1f\x8b":
            entries = _tar_entries(spooled)
        else:
            what = f"{filename!r} is" if filename else "The upload is"
            raise ArchiveError(None, f"{what} not a .zip or .tar.gz archive (its first bytes are neither); "
                                     f"upload one of those.")
        return _normalize(entries, strip_top=True)
    finally:
        spooled.close()


REQUEST_OVERHEAD = 1024 * 1024
"""Bytes a request carrying an upload may have beyond the archive itself (the other fields, multipart framing)."""


def request_too_large(content_length: str | int | None) -> str | None:
    """Why a request body of ``content_length`` bytes (its Content-Length header) is refused before
    it is read, or None: more than ``TRAINBOARD_CODE_MAX_BYTES`` plus :data:`REQUEST_OVERHEAD`."""
    try:
        length = int(content_length or 0)
    except (TypeError, ValueError):
        return None
    limit = max_bytes()
    if length <= limit + REQUEST_OVERHEAD:
        return None
    return (f"The upload is larger than {_mib(limit)} (TRAINBOARD_CODE_MAX_BYTES); leave data and checkpoints "
            f"out of the code archive.")


def normalize_directory(path: str | os.PathLike[str]) -> NormalizedArchive:
    """The normalized archive of the files under directory ``path``, which must lie inside one of
    ``settings.TRAINBOARD_CODE_ROOTS`` after symlinks and ``..`` are resolved (a relative path is
    taken relative to the first root). The directory is the archive's root: nothing is stripped.

    Raises :class:`ArchiveError`: outside the roots, not a directory, or anything refused (module
    docstring; a symlink or a file with more than one hard link inside the tree is refused too).
    """
    root = resolve_code_dir(path)
    return _normalize(_directory_entries(root), strip_top=False)


def resolve_code_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` resolved (symlinks, ``..``), when it is a directory inside ``TRAINBOARD_CODE_ROOTS``.
    Raises :class:`ArchiveError` otherwise, saying where code directories may lie."""
    roots = [Path(r).resolve() for r in getattr(settings, "TRAINBOARD_CODE_ROOTS", ())]
    raw = os.fspath(path)
    if not roots:
        raise ArchiveError(None, "Code directories on the server are not allowed here (TRAINBOARD_CODE_ROOTS is "
                                 "empty); upload a .zip or .tar.gz instead.")
    if not raw.strip():
        raise ArchiveError(None, "Give the directory's path.")
    if "\x00" in raw:
        raise ArchiveError(None, "The directory's path contains a NUL character; give the path as it is.")
    try:
        candidate = Path(raw)
        resolved = (candidate if candidate.is_absolute() else roots[0] / candidate).resolve()
        inside = any(resolved == root or resolved.is_relative_to(root) for root in roots)
        is_dir = inside and resolved.is_dir()
    except (OSError, ValueError) as exc:  # a name too long for the filesystem, a loop of links
        raise ArchiveError(None, f"{raw[:200]!r} cannot be read as a directory "
                                 f"({getattr(exc, 'strerror', None) or exc}).") from None
    if not inside:
        raise ArchiveError(None, f"A code directory must lie inside {' or '.join(str(r) for r in roots)} "
                                 f"(TRAINBOARD_CODE_ROOTS); {raw!r} is outside. Put the code there, or upload "
                                 f"it as a .zip or .tar.gz.")
    if not is_dir:
        raise ArchiveError(None, f"{raw!r} is not a directory on the server.")
    return resolved


def _spool(fileobj: IO[bytes], limit: int, filename: str) -> IO[bytes]:
    """A seekable copy of ``fileobj`` (zip needs to seek), refused past ``limit`` bytes as sent."""
    out = tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024)
    try:
        if hasattr(fileobj, "seek"):
            fileobj.seek(0)
        size = 0
        while chunk := fileobj.read(_CHUNK):
            size += len(chunk)
            if size > limit:
                what = f"{filename!r}" if filename else "The upload"
                raise ArchiveError(None, f"{what} is larger than {_mib(limit)} (TRAINBOARD_CODE_MAX_BYTES); "
                                         f"leave data and checkpoints out of the code archive.")
            out.write(chunk)
        out.seek(0)
        return out
    except BaseException:
        out.close()
        raise


@dataclasses.dataclass
class _Entry:
    """One member as found: its raw name, kind and a reader of its bytes (regular files only)."""

    name: str
    kind: str  # "file" | "dir" | "symlink" | "hardlink" | a special kind ("FIFO", "character device", ...)
    executable: bool = False
    read: "Iterator[bytes] | None" = None  # chunks of a regular file's contents
    detail: str = ""  # what a link points at, for the message


def _zip_entries(fileobj: IO[bytes]) -> Iterator[_Entry]:
    try:
        zf = zipfile.ZipFile(fileobj)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        raise ArchiveError(None, f"Not a readable .zip archive ({exc}); zip the files again.") from None
    with zf:
        for info in zf.infolist():
            mode = info.external_attr >> 16 if info.create_system == 3 else 0  # 3 = Unix: st_mode bits
            ftype = stat.S_IFMT(mode)
            if info.is_dir() or ftype == stat.S_IFDIR:
                yield _Entry(info.filename, "dir")
            elif ftype == stat.S_IFLNK:
                yield _Entry(info.filename, "symlink", detail=f"to {_zip_link_target(zf, info)!r}")
            elif ftype not in (0, stat.S_IFREG):
                yield _Entry(info.filename, _special_kind(ftype))
            elif info.flag_bits & 0x1:
                raise ArchiveError(info.filename, "encrypted; zip it without a password.")
            else:
                yield _Entry(info.filename, "file", executable=bool(mode & 0o111), read=_zip_chunks(zf, info))


def _zip_link_target(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> str:
    try:
        with zf.open(info) as member:
            return member.read(4096).decode("utf-8", "replace")
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, zlib.error, EOFError):
        return "?"


def _zip_chunks(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> Iterator[bytes]:
    try:
        with zf.open(info) as member:
            while chunk := member.read(_CHUNK):
                yield chunk
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, zlib.error, EOFError) as exc:
        raise ArchiveError(info.filename, f"cannot be read ({exc}); zip the files again.") from None


class _BoundedReader(io.RawIOBase):
    """The decompressed tar stream, refused once it passes ``limit`` bytes: the headers and padding
    of a tar of well-behaved files stay far below, while a gzip bomb of padding or of skipped member
    data (which :mod:`tarfile` decompresses to pass over) is stopped there."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self._stream, self._limit, self._seen = stream, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self._stream.read(len(buffer))
        self._seen += len(data)
        if self._seen > self._limit:
            raise ArchiveError(None, f"The archive decompresses to more than {_mib(self._limit)}; its files may "
                                     f"total at most {_mib(max_bytes())} (TRAINBOARD_CODE_MAX_BYTES).")
        buffer[: len(data)] = data
        return len(data)


def _tar_entries(fileobj: IO[bytes]) -> Iterator[_Entry]:
    # The stream allowance: the files' limit, plus a tar's own overhead for the most files (a header
    # and up to a block of padding each, pax headers for long names) and a margin.
    allowance = max_bytes() + (max_files() + 1) * 4 * tarfile.BLOCKSIZE + 1024 * 1024
    stream = io.BufferedReader(_BoundedReader(gzip.GzipFile(fileobj=fileobj, mode="rb"), allowance))
    try:
        # "r|": one pass, no seeking, so every byte goes through the bounded reader.
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for info in tar:
                if info.isdir():
                    yield _Entry(info.name, "dir")
                elif info.issym():
                    yield _Entry(info.name, "symlink", detail=f"to {info.linkname!r}")
                elif info.islnk():
                    yield _Entry(info.name, "hardlink", detail=f"to {info.linkname!r}")
                elif info.isreg():
                    yield _Entry(info.name, "file", executable=bool(info.mode & 0o111),
                                 read=_tar_chunks(tar, info))
                else:
                    yield _Entry(info.name, _special_kind(_tar_kind(info)))
    except (tarfile.TarError, OSError, EOFError, zlib.error, ValueError) as exc:
        if isinstance(exc, ArchiveError):
            raise
        raise ArchiveError(None, f"Not a readable .tar.gz archive ({exc}); pack the files again.") from None


def _tar_chunks(tar: tarfile.TarFile, info: tarfile.TarInfo) -> Iterator[bytes]:
    try:
        member = tar.extractfile(info)
        assert member is not None  # a regular file always has a reader
        while chunk := member.read(_CHUNK):
            yield chunk
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise ArchiveError(info.name, f"cannot be read ({exc}); pack the files again.") from None


def _tar_kind(info: tarfile.TarInfo) -> int:
    if info.ischr():
        return stat.S_IFCHR
    if info.isblk():
        return stat.S_IFBLK
    if info.isfifo():
        return stat.S_IFIFO
    return 0


def _directory_entries(root: Path) -> Iterator[_Entry]:
    def unreadable(exc: OSError) -> None:
        where = Path(exc.filename or root)
        raise ArchiveError(where.relative_to(root).as_posix() if where.is_relative_to(root) else str(where),
                           f"cannot be read ({exc.strerror}).")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=False):
        here = Path(dirpath)
        for name in sorted(dirnames):
            if (here / name).is_symlink():
                yield _Entry((here / name).relative_to(root).as_posix(), "symlink",
                             detail=f"to {os.readlink(here / name)!r}")
        dirnames[:] = sorted(d for d in dirnames if not (here / d).is_symlink() and d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            path = here / name
            rel = path.relative_to(root).as_posix()
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                yield _Entry(rel, "symlink", detail=f"to {os.readlink(path)!r}")
            elif not stat.S_ISREG(st.st_mode):
                yield _Entry(rel, _special_kind(stat.S_IFMT(st.st_mode)))
            elif st.st_nlink > 1:
                # Another name for the same bytes, possibly outside the roots: what it says is not
                # this tree's to decide.
                yield _Entry(rel, "hardlink", detail=f"the file has {st.st_nlink} names")
            else:
                yield _Entry(rel, "file", executable=bool(st.st_mode & 0o111), read=_file_chunks(path, rel))


def _file_chunks(path: Path, rel: str) -> Iterator[bytes]:
    try:
        # O_NOFOLLOW: a file swapped for a symlink after it was listed is not followed.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ArchiveError(rel, f"cannot be read ({exc.strerror}).") from None
    with os.fdopen(fd, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            yield chunk


def _special_kind(ftype: int) -> str:
    return {stat.S_IFCHR: "character device", stat.S_IFBLK: "block device", stat.S_IFIFO: "FIFO",
            stat.S_IFSOCK: "socket"}.get(ftype, "special file")


# =============================================================================================
# Normalizing
# =============================================================================================


def _normalize(entries: Iterator[_Entry], *, strip_top: bool) -> NormalizedArchive:
    """Every entry checked and read (bytes counted as read), then written deterministically."""
    limit_bytes, limit_files = max_bytes(), max_files()
    files: dict[str, tuple[bytes, bool]] = {}
    dirs: set[str] = set()
    total = 0
    # An unsafe member is noted and the next one read, so one refusal names every one of them; the
    # limits (files, bytes) stop at once: reading on is what they guard against.
    refused: list[ArchiveError] = []
    for entry in entries:
        try:
            name = _clean_name(entry.name)
        except ArchiveError as exc:
            refused.append(exc)
            continue
        if name is None or _skipped(name):
            continue
        if entry.kind == "dir":
            dirs.add(name)
            continue
        if (problem := _unsafe_kind(entry)) is not None:
            refused.append(problem)
            continue
        if name in files:
            refused.append(ArchiveError(entry.name, "appears twice in the archive; keep one."))
            continue
        if len(files) >= limit_files:
            raise ArchiveError.of([*refused, ArchiveError(entry.name, (
                f"more than {limit_files:,} files (TRAINBOARD_CODE_MAX_FILES); leave data, checkpoints and "
                f"environments out of the code archive."))])
        chunks = []
        assert entry.read is not None
        for chunk in entry.read:
            total += len(chunk)
            if total > limit_bytes:
                raise ArchiveError.of([*refused, ArchiveError(entry.name, (
                    f"the files pass {_mib(limit_bytes)} uncompressed here (TRAINBOARD_CODE_MAX_BYTES); leave data "
                    f"and checkpoints out of the code archive."))])
            chunks.append(chunk)
        files[name] = (b"".join(chunks), entry.executable)
    if not files:
        raise ArchiveError.of([*refused, ArchiveError(None, "The archive holds no files.")])
    try:
        _refuse_file_and_dir(files, dirs)
    except ArchiveError as exc:
        raise ArchiveError.of([*refused, exc]) from None
    prefix = _shared_top(files) if strip_top else ""
    if prefix:
        files = {name[len(prefix):]: value for name, value in files.items()}
    for name in sorted(files):
        try:
            _refuse_ours(name, prefix)
        except ArchiveError as exc:
            refused.append(exc)
    if refused:
        raise ArchiveError.of(refused)
    names = tuple(sorted(files))
    data = deterministic_tar_gz((n, files[n][0], 0o755 if files[n][1] else 0o644) for n in names)
    contents = {n: files[n][0] for n in names}
    return NormalizedArchive(data=data, sha256=hashlib.sha256(data).hexdigest(), files=names,
                             requirements=_requirements(contents), stripped_prefix=prefix, contents=contents)


def _unsafe_kind(entry: _Entry) -> ArchiveError | None:
    """Why ``entry`` may not be in a code archive by its kind (a link, a device, ...); None for a file."""
    if entry.kind == "symlink":
        return ArchiveError(entry.name, f"a symbolic link ({entry.detail}); links are refused, inside the "
                                        f"archive or out of it: put the file itself in the archive.")
    if entry.kind == "hardlink":
        return ArchiveError(entry.name, f"a hard link ({entry.detail}); links are refused, inside the archive "
                                        f"or out of it: put the file itself in the archive.")
    if entry.kind != "file":
        return ArchiveError(entry.name, f"a {entry.kind}, not a regular file; only regular files and "
                                        f"directories may be in a code archive.")
    return None


def _clean_name(raw: str) -> str | None:
    """``raw`` as a relative posix path (``./`` and repeated slashes dropped), or None for the
    archive's root itself. Raises ArchiveError for a path that could land anywhere else."""
    if "\x00" in raw or any(ord(c) < 32 for c in raw):
        raise ArchiveError(_printable(raw), "a control character in the name; rename it.")
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:  # tarfile and os.walk keep undecodable bytes as surrogates
        raise ArchiveError(_printable(raw), "the name is not UTF-8 text; rename it.") from None
    if "\\" in raw:
        raise ArchiveError(raw, "a backslash in the path (a Windows separator); pack the files with a tool "
                                "that writes / between directories.")
    if raw.startswith("/") or re.match(r"[A-Za-z]:", raw):
        raise ArchiveError(raw, "an absolute path; members must be relative to the archive's root.")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(raw, "path leaves the archive (..)")
    return "/".join(parts) or None


def _skipped(name: str) -> bool:
    return any(part in SKIPPED_DIRS for part in name.split("/")[:-1]) or name in SKIPPED_DIRS


def _refuse_file_and_dir(files: dict[str, tuple[bytes, bool]], dirs: set[str]) -> None:
    parents = {"/".join(n.split("/")[:i]) for n in files for i in range(1, n.count("/") + 1)}
    for name in sorted((parents | dirs) & set(files)):
        raise ArchiveError(name, "is both a file and a directory; rename one of them.")


def _shared_top(files: dict[str, tuple[bytes, bool]]) -> str:
    """``"top/"`` when every file lies under one top directory that is not a Python package, else ""."""
    tops = {n.split("/", 1)[0] for n in files}
    if len(tops) != 1 or any("/" not in n for n in files):
        return ""
    top = tops.pop()
    return "" if f"{top}/__init__.py" in files else f"{top}/"


def _refuse_ours(name: str, prefix: str) -> None:
    shown, top = prefix + name, name.split("/", 1)[0]
    if top == "trainer_pkg":
        raise ArchiveError(shown, "trainer_pkg/ is Trainboard's trainer package, which the job puts beside your "
                                  "files; rename your package.")
    if top.startswith("trainboard_"):
        raise ArchiveError(shown, "top-level names starting trainboard_ are Trainboard's own (its entry script "
                                  "and job config sit beside your files); rename it.")


def _requirements(contents: dict[str, bytes]) -> str:
    data = contents.get(REQUIREMENTS)
    if data is None:
        return ""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ArchiveError(REQUIREMENTS, f"not UTF-8 text (byte {exc.start}); save it as UTF-8.") from None
    if "\x00" in text:
        raise ArchiveError(REQUIREMENTS, "contains a NUL character; it must be a pip requirements text file.")
    return text


# =============================================================================================
# Entry point and script checks (static: nothing is imported)
# =============================================================================================


def check_entry_point_form(entry_point: str, *, script: bool) -> None:
    """Check only the form of a model's ``entry_point`` (``package.module:function``) or, with
    ``script``, of its script (``train.py`` or ``-m package.module``), for a request whose archive is
    missing or refused, so that its error comes with the archive's. Raises :class:`ArchiveError`
    (member None) with the message :func:`check_entry_point` or :func:`check_script` gives."""
    entry_point = (entry_point or "").strip()
    if not script:
        try:
            parse_entry_point(entry_point)  # the trainer's own reading of it
        except ConfigError:
            raise ArchiveError(None, f"entry point {entry_point!r}: expected package.module:function, e.g. "
                                     f"mymodel.net:build.") from None
        return
    if entry_point.startswith("-m"):
        if not _MODULE.fullmatch(entry_point[2:].strip()):
            raise ArchiveError(None, f"script {entry_point!r}: expected -m package.module, e.g. -m mytrain.main.")
        return
    try:
        name = _clean_name(entry_point)
    except ArchiveError as exc:
        raise ArchiveError(None, f"script {entry_point!r}: {exc.reason}") from None
    if not name or not name.endswith(".py"):
        raise ArchiveError(None, f"script {entry_point!r}: expected a .py file in the archive (train.py) or "
                                 f"-m package.module.")


def check_entry_point(archive: NormalizedArchive, entry_point: str) -> None:
    """Check that ``entry_point`` (``package.module:function``) names a function defined at the top
    level of a module file in ``archive``: ``pkg/mod.py`` or ``pkg/mod/__init__.py``
    (``pkg/__init__.py`` is optional: namespace packages import too). A name bound by an import at
    the top level (``from .net import build``) is accepted: where it comes from is not checked.

    Raises :class:`ArchiveError` (member None) with the message for the ``entry_point`` field.
    """
    entry_point = (entry_point or "").strip()
    check_entry_point_form(entry_point, script=False)
    module, function = parse_entry_point(entry_point)
    path = _module_file(archive, module, ("{}.py", "{}/__init__.py"))
    tree = _parse(archive, path)
    functions, imported, others = _top_level_names(tree)
    if function in functions or function in imported:
        return
    if function in others:
        raise ArchiveError(None, f"{function!r} in {path} is a {others[function]}, not a function; name a "
                                 f"function that returns the torch.nn.Module.")
    defined = sorted(set(functions) | {n for n, k in others.items() if k == "class"})
    listed = f"it defines: {', '.join(defined[:20])}{', ...' if len(defined) > 20 else ''}" if defined \
        else "it defines no functions or classes"
    raise ArchiveError(None, f"function {function!r} is not defined at the top level of {path} ({listed}).")


def check_script(archive: NormalizedArchive, script: str) -> None:
    """Check that ``script`` — a ``.py`` file in ``archive`` (``train.py``, ``tools/train.py``) or
    ``-m package.module`` (``pkg/mod.py``, or ``pkg/mod/__main__.py`` for a package) — is there and
    parses. Raises :class:`ArchiveError` (member None) with the message for the ``entry_point`` field.
    """
    script = (script or "").strip()
    check_entry_point_form(script, script=True)
    if script.startswith("-m"):
        _parse(archive, _module_file(archive, script[2:].strip(), ("{}.py", "{}/__main__.py")))
        return
    name = _clean_name(script)
    if name not in archive.contents:
        scripts = [f for f in archive.files if f.endswith(".py") and "/" not in f]
        hint = f"; its top-level scripts: {', '.join(scripts[:10])}" if scripts else ""
        raise ArchiveError(None, f"script {name!r} is not in the archive{hint}{_stripped_hint(archive)}.")
    _parse(archive, name)


def _module_file(archive: NormalizedArchive, module: str, patterns: tuple[str, ...]) -> str:
    base = module.replace(".", "/")
    candidates = [p.format(base) for p in patterns]
    for candidate in candidates:
        if candidate in archive.contents:
            return candidate
    raise ArchiveError(None, f"module {module!r} not in the archive (looked for {', '.join(candidates)})"
                             f"{_stripped_hint(archive)}.")


def _stripped_hint(archive: NormalizedArchive) -> str:
    if not archive.stripped_prefix:
        return ""
    return (f"; the archive's shared top directory {archive.stripped_prefix!r} was removed, so paths start "
            f"inside it: name the module from there, or add {archive.stripped_prefix}__init__.py")


def _parse(archive: NormalizedArchive, path: str) -> ast.Module:
    try:
        text = decode_source(archive.contents[path])
    except (UnicodeDecodeError, SyntaxError, LookupError) as exc:
        raise ArchiveError(None, f"{path} is not readable Python text ({exc}); save it as UTF-8.") from None
    try:
        return ast.parse(text, filename=path)
    except SyntaxError as exc:
        raise ArchiveError(None, f"{path} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise ArchiveError(None, f"{path} cannot be parsed ({type(exc).__name__}: {exc}).") from None


def _top_level_names(tree: ast.Module) -> tuple[set[str], set[str], dict[str, str]]:
    """(functions defined, names imported, {other name: "class" | "variable"}) bound at the module's
    top level, looking into top-level ``if``/``try``/``with`` blocks (``try: ... except ImportError: def``)."""
    functions: set[str] = set()
    imported: set[str] = set()
    others: dict[str, str] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.add(node.name)
            elif isinstance(node, ast.ClassDef):
                others.setdefault(node.name, "class")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    imported.add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            others.setdefault(name.id, "variable")
            elif isinstance(node, ast.If):
                visit(node.body), visit(node.orelse)
            elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                visit(node.body), visit(node.orelse), visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                visit(node.body)

    visit(tree.body)
    bound = functions | imported
    return functions, imported, {n: k for n, k in others.items() if n not in bound}


# =============================================================================================
# Storing
# =============================================================================================


def load_stored(row: CodeArchive) -> NormalizedArchive:
    """The stored archive of ``row`` read back (to check a new entry point against it). Raises
    :class:`ArchiveError` when its file is missing, unreadable or no longer has its hash."""
    try:
        with open(store_path(row.sha256), "rb") as handle:
            archive = _normalize(_tar_entries(handle), strip_top=False)
    except OSError as exc:
        raise ArchiveError(None, f"the stored file is missing or unreadable ({exc.strerror})") from None
    if archive.sha256 != row.sha256:
        raise ArchiveError(None, f"the stored file's hash is {archive.sha256[:12]}, not {row.sha256[:12]}")
    return archive


_write_files: contextvars.ContextVar[bool] = contextvars.ContextVar("code_archives_write_files", default=True)


@contextlib.contextmanager
def files_not_written() -> Iterator[None]:
    """Within it, :func:`store` records rows but writes no file: for a service call made only to
    collect its errors and then rolled back (``webapp.errors.trial_call``), which must leave nothing."""
    token = _write_files.set(False)
    try:
        yield
    finally:
        _write_files.reset(token)


def store_path(sha256: str) -> Path:
    """``<TRAINBOARD_CODE_STORE>/<sha[:2]>/<sha>.tar.gz`` (:attr:`CodeArchive.path`, before the row exists)."""
    return CodeArchive(sha256=sha256).path


def store(archive: NormalizedArchive) -> CodeArchive:
    """Write ``archive`` to the store unless its file is there already, and return its
    :class:`CodeArchive` row (created on first store). The file is written to a temporary name in
    its directory and renamed into place, so a reader never sees part of one; two stores of the
    same archive at once write the same bytes to the same name. Raises OSError when the store
    cannot be written.
    """
    path = store_path(archive.sha256)
    if _write_files.get() and not path.is_file():  # named by its content: a file there holds these bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".incoming-", suffix=".tar.gz", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(archive.data)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    row, _ = CodeArchive.objects.get_or_create(
        sha256=archive.sha256,
        defaults={"size_bytes": archive.size_bytes, "file_count": archive.file_count,
                  "files": list(archive.files[:CodeArchive.FILES_KEPT]), "requirements": archive.requirements},
    )
    return row


def _quote(member: str | None) -> str:
    return f"'{member}'" if member is not None and "'" not in member else repr(member)


def _printable(text: str) -> str:
    return text.encode("unicode_escape").decode("ascii")


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB" if n >= 1024 * 1024 else f"{n:,} bytes"
