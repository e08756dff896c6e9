"""Code archives for tests, built in the test: zips and tar.gz files of given members (regular
files, links, devices), and a small model package whose entry point the dashboard checks.

    zip_bytes({"mymodel/net.py": NET_PY})                  # bytes of a .zip
    tar_gz_bytes({"a.py": b"x = 1\\n"}, mtime=1234)         # bytes of a .tar.gz
    tar_gz_bytes({"link": Link("/etc/passwd")})             # a symlink member
    upload(zip_bytes(...), "model.zip")                     # a Django uploaded file
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
import io
import tarfile
import zipfile

from django.core.files.uploadedfile import SimpleUploadedFile

NET_PY = b'''"""A tiny classifier: the tests' user model (never imported by the dashboard)."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x)) + x


def build(num_classes, input_shape, width=16):
    features = 1
    for n in input_shape:
        features *= n
    return nn.Sequential(nn.Flatten(), nn.Linear(features, width), Block(width), nn.Linear(width, num_classes))


WIDTH = 16
'''

TRAIN_PY = b'''import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
print(parser.parse_args())
'''

MODEL_FILES = {"mymodel/__init__.py": b"", "mymodel/net.py": NET_PY, "requirements.txt": b"tinypkg==1.0\n",
               "train.py": TRAIN_PY}


@dataclasses.dataclass(frozen=True)
class Link:
    """A symbolic link member (``hard``: a hard link) pointing at ``target``."""

    target: str
    hard: bool = False


@dataclasses.dataclass(frozen=True)
class Special:
    """A special member: ``tarfile.CHRTYPE``, ``BLKTYPE`` or ``FIFOTYPE``."""

    type: bytes


def zip_bytes(members: dict[str, bytes | Link], *, date=(2020, 1, 2, 3, 4, 6)) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=date)
            info.compress_type = zipfile.ZIP_DEFLATED
            if isinstance(data, Link):
                info.create_system = 3
                info.external_attr = (0o120777 << 16)
                zf.writestr(info, data.target)
            else:
                info.create_system = 3
                info.external_attr = (0o100644 << 16)
                zf.writestr(info, data)
    return buf.getvalue()


def tar_gz_bytes(members: dict[str, bytes | Link | Special], *, mtime: int = 1_700_000_000,
                 uid: int = 1000) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname = mtime, uid, uid, "someone"
            if isinstance(data, Link):
                info.type = tarfile.LNKTYPE if data.hard else tarfile.SYMTYPE
                info.linkname = data.target
                tar.addfile(info)
            elif isinstance(data, Special):
                info.type = data.type
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o664
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def upload(data: bytes, name: str = "model.zip") -> SimpleUploadedFile:
    return SimpleUploadedFile(name, data, content_type="application/octet-stream")


def stored_files(store: Path) -> list[str]:
    """The files in the code store ``store``, as sorted paths relative to it ([] when it does not exist)."""
    return sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file()) if store.exists() else []
