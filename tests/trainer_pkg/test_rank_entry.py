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


def test_an_uncaught_exception_is_named_in_the_launchers_error_file(tmp_path):
    """With TRAINBOARD_RANK_ERROR_FILE set (the TensorFlow launcher sets it), one line names where the
    user's code raised: the innermost frame of the script's directory, relative to it."""
    code = tmp_path / "code"
    (code / "lib").mkdir(parents=True)
    (code / "lib" / "shards.py").write_text("def load(n):\n    raise ValueError(f'bad shard {n}')\n")
    (code / "train.py").write_text("import json\nfrom lib.shards import load\njson.dumps({})\nload(7)\n")
    (code / "broken.py").write_text("x = (\n")
    error_file = tmp_path / "worker-1"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINBOARD_RANK_ERROR_FILE": str(error_file)}
    run = subprocess.run([sys.executable, "-m", "trainer_pkg.rank_entry", str(code / "train.py")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "ValueError: bad shard 7" in run.stderr
    assert error_file.read_text() == "lib/shards.py:2 in load: ValueError: bad shard 7\n"

    run = subprocess.run([sys.executable, "-m", "trainer_pkg.rank_entry", str(code / "broken.py")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert error_file.read_text().startswith("broken.py:1: SyntaxError: ")

    error_file.unlink()
    run = subprocess.run([sys.executable, "-m", "trainer_pkg.rank_entry", str(code / "train.py")], cwd=REPO,
                         env={**env, "TRAINBOARD_RANK_ERROR_FILE": ""}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and not error_file.exists()  # no launcher asked: nothing written
