"""trainer_pkg.rank_entry runs a user's script as ``python`` would: same argv, exit code and traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from trainer_helpers import REPO

SCRIPT = """import sys
def fail(why):
    raise ValueError(why)
print("argv", sys.argv[1:], "path0", sys.path[0] == __import__("os").path.dirname(__file__), flush=True)
if sys.argv[1] == "exit":
    sys.exit(3)
fail("bad shard")
"""


def _run(*argv: str, entry: bool) -> subprocess.CompletedProcess:
    head = [sys.executable, "-m", "trainer_pkg.rank_entry"] if entry else [sys.executable]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*head, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_a_scripts_uncaught_exception_reads_as_under_python_and_exits_1(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ours, plain = _run(str(script), "raise", entry=True), _run(str(script), "raise", entry=False)
    assert ours.returncode == plain.returncode == 1
    assert ours.stdout == plain.stdout == "argv ['raise'] path0 True\n"
    assert ours.stderr == plain.stderr
    assert ours.stderr.splitlines()[:2] == ["Traceback (most recent call last):",
                                            f'  File "{script}", line 7, in <module>']


def test_a_scripts_exit_code_is_its_own(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = _run(str(script), "exit", entry=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "argv ['exit'] path0 True\n", "")


def test_a_syntax_error_in_the_script_reads_as_under_python(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys\n\nx = = 1\n")
    ours, plain = _run(str(script), entry=True), _run(str(script), entry=False)
    assert ours.returncode == plain.returncode == 1
    assert ours.stderr == plain.stderr
    assert ours.stderr.splitlines()[0] == f'  File "{script}", line 3' and "runpy" not in ours.stderr
