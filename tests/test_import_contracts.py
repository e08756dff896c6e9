"""The import contracts of pyproject.toml (``[tool.importlinter]``) hold: ``webapp → jobs →
cloud_adapters``, trainer_pkg imports nothing of the dashboard, the client (client/) imports nothing of the server, no import cycle inside ``jobs`` or
``trainer_pkg``, the layers inside ``jobs`` (tasks → worker side → services → leaf modules), nothing imports
``jobs.tasks``. Run here so that ``make test`` (and CI) fails when one breaks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    assert lint_imports.exists(), f"{lint_imports} is missing: install requirements-dev.txt (make dev-venv)"
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "0 broken" in report, report
    assert report.count(" KEPT") == 7, report
