#!/usr/bin/env python3
"""Write tests/unit_seconds.json from a pytest log with ``--durations=0``: each test file's seconds
(setup + call + teardown of its tests), the files of an ``xdist_group`` summed under ``group:<name>``.

    .venv/bin/python -m pytest -n 2 --dist loadgroup -q --durations=0 > run.log
    python3 scripts/unit-seconds.py run.log            # rewrites tests/unit_seconds.json

tests/xdist_workers.py starts the units longest first by these figures (a unit not listed: by its
tests' markers), so the longest one does not come last. Only the order matters: a run on a busier
machine gives larger figures, not another order.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(tests/\S+?\.py)::")
# A module's ``pytestmark`` statement, continuation lines included (a list may span several).
MARKS = re.compile(r"^pytestmark\s*=[^\n]*(?:\n[ \t]+[^\n]*)*", re.M)
GROUP = re.compile(r"""xdist_group\(\s*["']([\w.-]+)["']""")
SLURM = re.compile(r"SLURM_GROUP")  # tests/slurmkit.py's mark of the "slurm" group


def unit_of(path: str) -> str:
    text = (ROOT / path).read_text(errors="replace") if (ROOT / path).exists() else ""
    marks = "\n".join(m.group(0) for m in MARKS.finditer(text))
    if SLURM.search(marks):
        return "group:slurm"
    found = GROUP.search(marks)
    return f"group:{found.group(1)}" if found else path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    seconds: Counter[str] = Counter()
    for line in Path(argv[0]).read_text(errors="replace").splitlines():
        found = LINE.match(line)
        if found:
            seconds[unit_of(found.group(2))] += float(found.group(1))
    if not seconds:
        print(f"{argv[0]}: no --durations=0 lines found", file=sys.stderr)
        return 1
    out = ROOT / "tests" / "unit_seconds.json"
    out.write_text(json.dumps({unit: round(s, 1) for unit, s in sorted(seconds.items())}, indent=0) + "\n")
    print(f"{out}: {len(seconds)} units, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
