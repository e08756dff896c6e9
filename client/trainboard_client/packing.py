"""Pack a project directory as the code archive of a *my script* / *my model* job.

What goes in: every regular file under the directory, less what ``.gitignore`` files (the root's and
any below it, each for its own subtree, as git reads them) and the root's ``.trainboardignore`` leave
out, and less ``.git/``, ``__pycache__/`` and ``.trainboard/`` (the server skips the first two too).
The archive is a ``.tar.gz`` whose bytes depend only on the files' paths, contents and execute bits
(sorted, mtime 0, no owners, a gzip header without name or time): the same tree packs to the same
SHA-256 on every run, which is how ``trainboard run`` knows the server already has it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

ALWAYS_SKIPPED = frozenset({".git", "__pycache__", ".trainboard"})
IGNORE_FILES = (".gitignore",)
ROOT_IGNORE_FILE = ".trainboardignore"


class PackError(ValueError):
    """A member that cannot be packed, named (``member``) with why (``reason``)."""

    def __init__(self, member: str, reason: str) -> None:
        self.member = member
        self.reason = reason
        super().__init__(f"{member}: {reason}")


@dataclass(frozen=True)
class Packed:
    data: bytes  # the .tar.gz
    sha256: str  # hex SHA-256 of data
    files: tuple[str, ...]  # member paths, sorted
    size_bytes: int  # the files' total size, uncompressed

    @property
    def compressed_bytes(self) -> int:
        return len(self.data)


def _spec(lines: list[str]) -> pathspec.PathSpec:
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def project_files(root: Path) -> list[tuple[str, Path, bool]]:
    """``(archive path, file, executable)`` for each file that is packed, sorted by path.

    Raises :class:`PackError` for a symbolic link or a special file that is not ignored (the server
    refuses links in a code archive)."""
    root = root.resolve()
    specs: list[tuple[str, pathspec.PathSpec]] = []  # (directory prefix "a/b/" or "", its patterns)
    trainboard_ignore = _read_lines(root / ROOT_IGNORE_FILE)
    if trainboard_ignore:
        specs.append(("", _spec(trainboard_ignore)))
    out: list[tuple[str, Path, bool]] = []

    def ignored(rel: str, is_dir: bool) -> bool:
        candidate = rel + "/" if is_dir else rel
        for prefix, spec in specs:
            if candidate.startswith(prefix) and spec.match_file(candidate[len(prefix):]):
                return True
        return False

    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        for name in IGNORE_FILES:
            lines = _read_lines(here / name)
            if lines:
                specs.append((prefix, _spec(lines)))
        keep = []
        for name in sorted(dirnames):
            rel = prefix + name
            path = here / name
            if name in ALWAYS_SKIPPED or ignored(rel, True):
                continue
            if path.is_symlink():
                raise PackError(rel, "a symbolic link; links are refused in a code archive: put the files "
                                     "themselves in the project, or list the link in .trainboardignore.")
            keep.append(name)
        dirnames[:] = keep
        for name in sorted(filenames):
            rel = prefix + name
            if ignored(rel, False):
                continue
            path = here / name
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                raise PackError(rel, "a symbolic link; links are refused in a code archive: put the file itself "
                                     "in the project, or list the link in .trainboardignore.")
            if not stat.S_ISREG(info.st_mode):
                raise PackError(rel, "not a regular file; only regular files may be in a code archive.")
            out.append((rel, path, bool(info.st_mode & 0o111)))
    return sorted(out)


def pack(root: Path) -> Packed:
    """The project under ``root`` as one deterministic ``.tar.gz``."""
    files = project_files(root)
    if not files:
        raise PackError(str(root), "no files to pack (all ignored, or the directory is empty).")
    raw = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, path, executable in files:
            data = path.read_bytes()
            total += len(data)
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o755 if executable else 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    data = out.getvalue()
    return Packed(data=data, sha256=hashlib.sha256(data).hexdigest(), files=tuple(f[0] for f in files),
                  size_bytes=total)


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
