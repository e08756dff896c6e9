"""The experiment table's sorts and tag filter on SQLite (the demo's database), as on PostgreSQL
(tests/jobs/test_experiment_table.py): JSON key transforms, nulls last both ways, json_each for tags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.slow
def test_sorts_and_tag_filter_on_sqlite(tmp_path):
    done = subprocess.run([sys.executable, str(HERE / "sqlite_job_table.py"), str(tmp_path / "db.sqlite3")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {
        "vendor": "sqlite",
        # the same orders as on PostgreSQL (test_experiment_table.py)
        "-val_accuracy": ["high", "mid", "low", "silent", "diverged"],
        "val_accuracy": ["low", "mid", "high", "silent", "diverged"],
        "train.lr": ["low", "mid", "high", "silent", "diverged"],
        "-train.lr": ["silent", "high", "mid", "low", "diverged"],
        "-model.params.hidden": ["mid", "diverged", "silent", "low", "high"],
        "tag=baseline": ["high", "low"],
        "tag=resnet": ["high"],
    }
