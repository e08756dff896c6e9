"""The torch-free torchrun (tests/standins/torchrun_lite.py) against torch's own: the same rank
environment, the same failure handling and exit code, and no torch in its process. Most trainer
tests run under it; this file holds it to the real one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from standins import torchrun_lite

REPO = Path(__file__).resolve().parents[2]
DIFFERENT = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}
"""Variables whose values differ between two runs or by design (module docstring of torchrun_lite)."""

ENV_SCRIPT = """
import json, os, sys
before = set(json.loads(os.environ.pop("BEFORE")))
with open(f"/proc/{os.getppid()}/maps") as maps:
    parent_has_torch = "libtorch" in maps.read()
seen = {k: v for k, v in os.environ.items() if k not in before}
line = "RANKENV " + json.dumps({"env": seen, "parent_has_torch": parent_has_torch}) + chr(10)
os.write(1, line.encode())  # one write: under torchrun's -u, print() writes the text and its newline apart
"""

FAIL_SCRIPT = """
import os, signal, sys, time
marks = sys.argv[1]
ready = os.path.join(marks, "rank0-ready")
if os.environ["RANK"] == "1":  # fails once rank 0 can take the SIGTERM torchrun then sends it
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)  # polls for rank 0's file (no shared channel before a process group exists)
    sys.exit(3)
def stop(signum, frame):
    open(os.path.join(marks, "rank0-got-" + str(signum)), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(ready, "w").close()
signal.alarm(120)  # never signalled: SIGALRM ends it
while True:
    signal.pause()
"""


def _run(python: str, script: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", "2",
           str(script), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=90)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scripts")
    (root / "env.py").write_text(ENV_SCRIPT)
    (root / "fail.py").write_text(FAIL_SCRIPT)
    return {"env": root / "env.py", "fail": root / "fail.py"}


def _rank_envs(python: str, script: Path) -> dict[int, dict]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["BEFORE"] = json.dumps(sorted(env))
    run = _run(python, script, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    found = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("RANKENV ")]
    return {int(f["env"]["RANK"]): f for f in found}


def test_ranks_get_the_real_torchruns_environment_from_a_process_without_torch(scripts):
    real = _rank_envs(sys.executable, scripts["env"])
    lite = _rank_envs(torchrun_lite.python(), scripts["env"])
    assert sorted(real) == sorted(lite) == [0, 1]
    for rank in (0, 1):
        r, l = real[rank]["env"], lite[rank]["env"]
        assert sorted(r) == sorted(l)
        assert {k: v for k, v in r.items() if k not in DIFFERENT} == {k: v for k, v in l.items() if k not in DIFFERENT}
        assert r["LOCAL_RANK"] == str(rank) and r["WORLD_SIZE"] == "2" and r["OMP_NUM_THREADS"] == "1"
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True" and l["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        for e in (r, l):
            assert e["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{rank}/error.json")
        assert real[rank]["parent_has_torch"] is True
        assert lite[rank]["parent_has_torch"] is False
    for envs in (real, lite):  # one master port per run, shared by its ranks
        assert envs[0]["env"]["MASTER_PORT"] == envs[1]["env"]["MASTER_PORT"]
        assert envs[0]["env"]["MASTER_PORT"].isdigit()


def test_a_failed_rank_stops_the_others_and_exits_1_as_torchrun_does(scripts, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name, python in (("real", sys.executable), ("lite", torchrun_lite.python())):
        marks = tmp_path / name
        marks.mkdir()
        run = _run(python, scripts["fail"], str(marks), env=env)
        assert run.returncode == 1, (name, run.stderr[-3000:])
        assert "ChildFailedError" in run.stderr, name
        assert "rank      : 1 (local_rank: 1)" in run.stderr, (name, run.stderr[-3000:])
        assert "exitcode  : 3 (pid: " in run.stderr, (name, run.stderr[-3000:])
        assert sorted(p.name for p in marks.iterdir()) == [f"rank0-got-{int(signal.SIGTERM)}", "rank0-ready"], name


def test_the_wrapper_runs_the_real_launcher_and_every_other_program_on_the_real_interpreter():
    python = torchrun_lite.python()
    assert Path(python).read_text().startswith(f"#!{sys.executable}\n")
    assert os.stat(python).st_mode & 0o777 == 0o755
    other = subprocess.run([python, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                           timeout=30)
    assert other.stdout.strip() == sys.executable
    helped = subprocess.run([python, "-m", "trainer_pkg.launch", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and "--config" in helped.stdout
