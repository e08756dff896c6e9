"""The installation's own files, out of reach of the jobs a GPU box runs beside the dashboard.

A GPU box runs each job as a uid of its own (docs/gpu-boxes.md "Isolation") with its run directory
under ``var/runs`` by default, so ``var/`` must let other uids through to ``runs/`` (and ``datasets/``)
while everything else in it stays the dashboard's: the encryption key that decrypts every stored cloud
credential, Django's secret key, the SQLite database, the code store, the file broker's messages and
the mail folder. Called once from webapp/settings.py; only what this process owns is changed (a volume
owned by another user is its operator's to set).

    var/                 0711  enter, not list
    var/encryption_key   0600  (private_file)
    var/secret_key       0600
    var/trainboard.sqlite3  0600  (its -wal and -shm files take its mode: SQLite's unix VFS)
    var/code/, var/broker/, var/mail/   0700  (private_dir)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

TRAVERSABLE = 0o711
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def _owned(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.geteuid()
    except FileNotFoundError:
        return False


def traversable_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) if missing; make it mode 0711 when this process owns it:
    other users may reach what is inside by name (the run root, the datasets), never list it."""
    path.mkdir(parents=True, exist_ok=True)
    if _owned(path) and stat.S_IMODE(path.stat().st_mode) != TRAVERSABLE:
        os.chmod(path, TRAVERSABLE)
    return path


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) if missing, mode 0700; an existing one this process owns is
    made 0700 too (an installation made before it was)."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    if _owned(path) and stat.S_IMODE(path.stat().st_mode) != PRIVATE_DIR:
        os.chmod(path, PRIVATE_DIR)
    return path


def private_file(path: Path, make: Callable[[], str] | None = None) -> Path:
    """Make ``path`` mode 0600 when this process owns it; when it is missing and ``make`` is given,
    create it with ``make()``'s text, 0600 from the first byte (``O_EXCL``: two processes starting at
    once keep the first one's). A missing file without ``make`` is created empty (SQLite takes an
    empty file as a new database)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        if _owned(path) and stat.S_IMODE(path.stat().st_mode) != PRIVATE_FILE:
            os.chmod(path, PRIVATE_FILE)
        return path
    with os.fdopen(fd, "w") as fh:
        if make is not None:
            fh.write(make())
    return path
