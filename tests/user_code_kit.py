"""A user's code as the cloud adapter tests hand it to a backend: archives written the way the dashboard
stores them (deterministic .tar.gz, relative members, :func:`cloud_adapters.packaging.archive_of`),
a custom model package and a training script written here (not in trainer_pkg), and a pure-Python wheel
built by hand for a ``requirements.txt`` to name, so pip installs it from a local directory (no network).

    bundle = code_bundle(tmp_path / "store", SCRIPT_FILES)   # a CodeBundle of the files
    wheels = build_wheel(tmp_path / "wheels")                # the directory for --find-links
    calls = fake_docker(tmp_path / "bin", tmp_path / "calls.jsonl", monkeypatch)  # a recording `docker` on PATH
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any, Mapping

from cloud_adapters import packaging
from cloud_adapters.base import CodeBundle

DEP_NAME = "tbtinydep"
"""The requirement's distribution and module name: a package that no index has, so only the local wheel
satisfies it."""
DEP_VERSION = "1.2.0"
DEP_MARK = 4242
"""``tbtinydep.MARK``: a user script that imported it reports this value."""

SECRET_NAME = "TB_USER_SECRET"
"""A job secret's variable the script reports back (in its model directory), to show it arrived."""

MODEL_FILES: dict[str, str] = {
    "usermodel/__init__.py": "",
    "usermodel/net.py": '''\
"""A user's model: an MLP with a named block class, built from the dataset's shape."""
import math

from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.fc(x))


def build(num_classes, input_shape, width=24, depth=2):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width),
                         *[Block(width) for _ in range(depth)], nn.Linear(width, num_classes))
''',
    "README.md": "my model\n",
}
"""A custom model archive: ``model.entry_point = "usermodel.net:build"``."""

SCRIPT_FILES: dict[str, str] = {
    "train.py": f'''\
"""A user's training script: its own argparse, the launcher's variables, Trainboard's report API."""
import argparse
import json
import os
import sys

import {DEP_NAME}
from trainer_pkg import report

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--tag", default="")
args = p.parse_args()
rank = int(os.environ["RANK"])
for step in range(1, args.steps + 1):
    report.log(step=step, my_metric=step * 1.5, dep_mark=float({DEP_NAME}.MARK))
if rank == 0:
    with open(os.path.join(report.model_dir(), "user_model.json"), "w") as f:
        json.dump({{"tag": args.tag, "world_size": int(os.environ["WORLD_SIZE"]), "dep": {DEP_NAME}.__version__,
                   "cwd": os.getcwd(), "secret": os.environ.get("{SECRET_NAME}", "")}}, f)
# One write per line: the ranks of a node share one stdout.
sys.stdout.write(f"user script rank {{rank}} of {{os.environ['WORLD_SIZE']}} done, tag {{args.tag}}\\n")
sys.stdout.flush()
''',
    "requirements.txt": f"# the script's own dependency\n{DEP_NAME}=={DEP_VERSION}\n",
    "helpers/data.txt": "some data\n",
}
"""A script archive: ``code.script = "train.py"``, ``code.args = ["--steps", "3", "--tag", "..."]``; its
``requirements.txt`` names :data:`DEP_NAME`."""


def code_bundle(store: Path, files: Mapping[str, str | bytes], *, executable: tuple[str, ...] = ()) -> CodeBundle:
    """``files`` (archive path → contents) stored as the dashboard stores an archive: one deterministic
    .tar.gz at ``<store>/<sha[:2]>/<sha>.tar.gz``; the bundle naming it, with the requirements text."""
    entries = [(name, text.encode() if isinstance(text, str) else text, 0o755 if name in executable else 0o644)
               for name, text in files.items()]
    archive = packaging.archive_of(entries)
    path = store / archive.sha256[:2] / f"{archive.sha256}.tar.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(archive.data)
    requirements = files.get("requirements.txt", "")
    return CodeBundle(sha256=archive.sha256, path=str(path),
                      requirements=requirements.decode() if isinstance(requirements, bytes) else requirements)


def build_wheel(dest: Path, name: str = DEP_NAME, version: str = DEP_VERSION) -> Path:
    """A pure-Python wheel of the module ``name`` (``MARK = DEP_MARK``, ``__version__``) written into
    ``dest``, with the METADATA, WHEEL and RECORD files pip checks. Returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f'__version__ = "{version}"\nMARK = {DEP_MARK}\n'.encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: user_code_kit\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([path, f"sha256={digest}", len(data)])
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    files[f"{dist_info}/RECORD"] = record.getvalue().encode()
    with zipfile.ZipFile(dest / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, data in files.items():
            whl.writestr(path, data)
    return dest


def build_user_model(code_dir: Path, **kwargs: Any) -> Any:
    """``usermodel.net.build(**kwargs)`` imported from ``code_dir`` (where a platform unpacked
    :data:`MODEL_FILES`), leaving ``sys.path`` and ``sys.modules`` as they were: the module a job's
    model.pt must load into."""
    sys.path.insert(0, str(code_dir))
    try:
        from usermodel.net import build

        return build(**kwargs)
    finally:
        sys.path.remove(str(code_dir))
        for name in [m for m in sys.modules if m == "usermodel" or m.startswith("usermodel.")]:
            del sys.modules[name]


def script_ranks_done(output: str, tag: str) -> list[int]:
    """The ranks whose "user script rank R of N done, tag <tag>" line is in ``output``, sorted."""
    return sorted(int(r) for r in re.findall(rf"user script rank (\d+) of \d+ done, tag {re.escape(tag)}$", output,
                                             flags=re.M))


def script_metrics(output: str) -> list[dict[str, Any]]:
    """The metric records in ``output`` that the job's processes printed, in order: every
    ``TRAINBOARD_METRIC`` line but the launcher's hardware samples (one per node every few seconds,
    so how many a run has depends on how long it took)."""
    from trainer_pkg.metrics import parse_metric_line
    records = (parse_metric_line(line) for line in output.splitlines())
    return [r for r in records if r is not None and r.get("event") != "hardware"]


FAKE_DOCKER = '''#!{python}
# A recording `docker`: answers `docker info`, records every other call (its argv, and the values
# of the variables it was asked to pass by name) and exits 0.
import json, os, sys
args = sys.argv[1:]
if args[:1] == ["info"]:
    print("28.2.2")
    sys.exit(0)
names = [args[i + 1] for i, a in enumerate(args) if a == "--env"]
with open({calls!r}, "a") as fh:
    fh.write(json.dumps({{"argv": args, "uid": os.getuid(), "env": {{n: os.environ.get(n) for n in names}}}}) + "\\n")
'''


def fake_docker(bin_dir: Path, calls: Path, monkeypatch) -> Path:
    """Put the recording ``docker`` first on PATH; returns the file its calls are recorded in."""
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER.format(python=sys.executable, calls=str(calls)))
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls
