"""Test virtual environments for the other frameworks a script may use (TensorFlow, Ray, MPI):
each in a venv of its own, never in the project's ``.venv`` (issue 33).

A venv is built once per machine and kept, keyed by what it holds, under
``$TRAINBOARD_TEST_VENVS`` (default ``~/.cache/trainboard/test-venvs``): a fresh clone's CI run reuses
the one an earlier run built (a warm cache) and builds it when it is missing or its key changed (cold:
the figure is in docs/testing.md). It sees the project's ``.venv`` packages after its own (a ``.pth``
file naming that venv's site-packages), so the launcher's own needs (torch, psutil) come from there
and only the framework is installed; its own versions win where both have a package.

Usage in a test module::

    TF = framework_venv_fixture("tensorflow", TENSORFLOW)

    def test_it(TF):  # TF: the venv's python (a Path)
        subprocess.run([str(TF), "-c", "import tensorflow"], check=True)
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(os.environ.get("TRAINBOARD_TEST_VENVS", Path.home() / ".cache" / "trainboard" / "test-venvs"))
"""Where the framework venvs are kept (one folder per name and key)."""
TENSORFLOW = ["tensorflow-cpu==2.21.0"]
"""The TensorFlow venv's requirements (tensorflow-cpu beside the project's torch 2.13: checked together)."""
RAY = ["ray[default,train]==2.60.0"]
"""The Ray venv's: ``default`` brings the dashboard and its Job Submission API, ``train`` Ray Train.
The in-job tests and the ``ray`` backend's share this one venv (one list, one key)."""
MPI = ["mpi4py==4.1.2"]
"""The MPI venv's: mpi4py, built against Debian's Open MPI (``libopenmpi-dev``, scripts/system-deps.sh)."""
READY = ".trainboard-ready"
"""The file a finished build leaves (what was installed and how long it took): a half-built venv has none."""


def framework_venv(name: str, requirements: list[str], *, pip_args: tuple[str, ...] = ()) -> Path:
    """The python of the venv ``name`` holding ``requirements`` (pip requirement strings, pinned),
    built now if missing. Safe across pytest-xdist workers (a file lock: one builds, the others wait).
    Raises :class:`subprocess.CalledProcessError` when pip fails (its output is in the exception)."""
    # Keyed by what it holds, not by which checkout asks: every fresh clone (a CI run) reuses it.
    key_text = json.dumps([sys.version, sorted(requirements), list(pip_args)])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:12]
    venv = ROOT / f"{name}-{key}"
    python = venv / "bin" / "python"
    ROOT.mkdir(parents=True, exist_ok=True)
    with FileLock(str(ROOT / f"{name}-{key}.lock")):
        if (venv / READY).is_file():
            _see_project(python)
            return python
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        _see_project(python)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        *pip_args, *requirements], check=True, capture_output=True, text=True)
        (venv / READY).write_text(json.dumps({"requirements": requirements,
                                              "build_s": round(time.monotonic() - started, 1)}))
    return python


def _see_project(python: Path) -> None:
    """Point the venv at this checkout's project packages (a ``.pth`` naming its site-packages, after
    the venv's own): torch and the launcher's needs without a copy. Rewritten on every use, so the
    venv follows whichever checkout runs the tests."""
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    pth = Path(purelib, "trainboard-project.pth")
    text = "\n".join(site.getsitepackages()) + "\n"
    if not pth.is_file() or pth.read_text() != text:
        pth.write_text(text)


def framework_venv_fixture(name: str, requirements: list[str], *, pip_args: tuple[str, ...] = ()):
    """A session-scoped fixture giving :func:`framework_venv`'s python (built at most once per run)."""

    @pytest.fixture(scope="session")
    def fixture() -> Path:
        return framework_venv(name, requirements, pip_args=pip_args)

    return fixture
