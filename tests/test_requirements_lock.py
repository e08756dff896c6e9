"""requirements-lock.txt (scripts/lock-requirements.sh): the exact versions the image and `make venv`
install, requirements.txt's pins among them, and what this test environment actually runs."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s#;]+)")


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.fullmatch(line)
        assert match, f"{path.name}: {line!r} is not an exact pin (name==version)"
        out[_name(match.group(1))] = match.group(3)
    return out


def test_the_lock_pins_every_requirement_at_its_version():
    lock, required = _pins(ROOT / "requirements-lock.txt"), _pins(ROOT / "requirements.txt")
    assert len(lock) > len(required)  # the transitive ones too
    assert {name: lock.get(name) for name in required} == required


def test_the_test_environment_runs_exactly_the_locked_versions():
    lock = _pins(ROOT / "requirements-lock.txt")
    installed = {_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    # torch's CPU build carries a local label (2.13.0+cpu), which the lock leaves out for both builds.
    seen = {name: installed.get(name, "missing").split("+", 1)[0] for name in lock}
    assert seen == lock
