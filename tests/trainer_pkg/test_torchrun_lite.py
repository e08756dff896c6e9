"""The torch-free torchrun (tests/standins/torchrun_lite.py) against torch's own: the same rank
environment, the same failure handling and exit code, and no torch in its process. Most trainer
tests run under it; this file holds it to the real one."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from standins import rank_zygote, torchrun_lite
from trainer_helpers import records, trainer_env, write_job
from trainer_pkg.metrics import parse_metric_line

REPO = Path(__file__).resolve().parents[2]
DIFFERENT = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}
"""Variables whose values differ between two runs or by design (module docstring of torchrun_lite)."""

ENV_SCRIPT = """
import json, os, sys
before = set(json.loads(os.environ.pop("BEFORE")))
with open(f"/proc/{os.getppid()}/maps") as maps:
    parent_has_torch = "libtorch" in maps.read()
seen = {k: v for k, v in os.environ.items() if k not in before}
line = "RANKENV " + json.dumps({"env": seen, "parent_has_torch": parent_has_torch, "ppid": os.getppid(),
                                "cwd": os.getcwd(), "path0": sys.path[0], "argv": sys.argv,
                                "session_leader": os.getsid(0) == os.getpid()}) + chr(10)
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
open(os.path.join(marks, "pids"), "a").write(f"{os.getpid()} {os.getppid()}\\n")
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


def _rank_envs(python: str, script: Path, **extra: str) -> dict[int, dict]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(extra)
    env["BEFORE"] = json.dumps(sorted(env))
    run = _run(python, script, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    found = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("RANKENV ")]
    return {int(f["env"]["RANK"]): f for f in found}


def test_ranks_get_the_real_torchruns_environment_from_a_process_without_torch(scripts):
    real = _rank_envs(sys.executable, scripts["env"])
    lite = _rank_envs(torchrun_lite.python(), scripts["env"], **{rank_zygote.ENABLE_VAR: "0"})
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
    runs = [("real", sys.executable, "0"), ("lite", torchrun_lite.python(), "0")]
    if rank_zygote.enabled():  # TRAINBOARD_TEST_RANK_ZYGOTE=0 leaves this process without a zygote
        runs.append(("zygote", torchrun_lite.python(), "1"))
    for name, python, zygote in runs:
        marks = tmp_path / name
        marks.mkdir()
        run = _run(python, scripts["fail"], str(marks), env=dict(env, **{rank_zygote.ENABLE_VAR: zygote}))
        assert run.returncode == 1, (name, run.stderr[-3000:])
        assert "ChildFailedError" in run.stderr, name
        assert "rank      : 1 (local_rank: 1)" in run.stderr, (name, run.stderr[-3000:])
        assert "exitcode  : 3 (pid: " in run.stderr, (name, run.stderr[-3000:])
        pid, ppid = map(int, (marks / "pids").read_text().split())
        assert (ppid == rank_zygote.zygote_pid()) is (name == "zygote"), (name, ppid)
        (marks / "pids").unlink()
        assert sorted(p.name for p in marks.iterdir()) == [f"rank0-got-{int(signal.SIGTERM)}", "rank0-ready"], name
        assert _gone([pid]), name


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


def test_the_wrappers_launcher_ends_as_python_m_trainer_pkg_launch_does(monkeypatch):
    """``-m trainer_pkg.launch`` in the wrapper ends through :func:`trainer_pkg.metrics.exit_process`
    with the launcher's code, as the module's ``__main__`` does, not through the interpreter's
    teardown: a job of one process trains in the wrapper's own process, whose teardown with gloo's
    threads alive intermittently aborted a finished run (SIGABRT: a strategy test's one-process
    reference run failed under load)."""
    from trainer_pkg import launch, metrics

    class Ended(Exception):
        pass

    def exit_process(code):
        raise Ended(code)

    monkeypatch.setattr(sys, "path", list(sys.path))  # the wrapper sets sys.path[0], as `python -m` has it
    monkeypatch.setattr(launch, "torchrun_command", launch.torchrun_command)  # the wrapper names itself there
    monkeypatch.setattr(launch, "main", lambda argv: 3 if argv == ["--config", "job.json"] else 99)
    monkeypatch.setattr(metrics, "exit_process", exit_process)
    with pytest.raises(Ended) as ended:
        torchrun_lite.main(["-u", "-m", "trainer_pkg.launch", "--config", "job.json"], wrapper="/wrapper")
    assert ended.value.args == (3,)


# -- the rank zygote (tests/standins/rank_zygote.py) ----------------------------------------------

@pytest.fixture
def zygote_enabled(monkeypatch):
    """The zygote on for this test, even in a pytest process run with ``TRAINBOARD_TEST_RANK_ZYGOTE=0``
    (its subject is the zygote); :func:`standins.rank_zygote.ensure` starts one where there is none."""
    was_enabled = rank_zygote.enabled()
    monkeypatch.setenv(rank_zygote.ENABLE_VAR, "1")
    assert rank_zygote.ensure() is not None
    yield
    if not was_enabled:
        rank_zygote.stop()  # the later tests of this process run without one, as asked


zygote_on = pytest.mark.usefixtures("zygote_enabled")
"""The tests of the zygote itself."""
GONE_WITHIN_S = 10.0
"""Seconds a process may take to disappear after its run (or its zygote) ended."""

PROBE_SCRIPT = """
import json, os, sys
preloaded = sorted(m for m in ("torch", "numpy", "trainer_pkg", "standins") if m in sys.modules)
import torch, trainer_pkg
line = "PROBE " + json.dumps({"rank": int(os.environ["RANK"]), "pid": os.getpid(), "ppid": os.getppid(),
                              "threads": torch.get_num_threads(), "preloaded": preloaded,
                              "trainer_pkg": trainer_pkg.__file__, "cwd": os.getcwd()}) + chr(10)
os.write(1, line.encode())
"""

DRIVER = """
import json, os, subprocess, sys
sys.path.insert(0, {tests!r})
from standins import rank_zygote, torchrun_lite
python = torchrun_lite.python()
run = subprocess.run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      *sys.argv[1:]], capture_output=True, text=True, timeout=90, env=dict(json.loads(os.environ["RANK_ENV"]),
                     **{{rank_zygote.SOCKET_VAR: os.environ[rank_zygote.SOCKET_VAR]}}),
                     cwd=os.environ["RANK_CWD"])
print(json.dumps({{"zygote": rank_zygote.zygote_pid(), "code": run.returncode, "stdout": run.stdout,
                  "stderr": run.stderr}}))
"""


def _gone(pids: list[int], within: float = GONE_WITHIN_S) -> bool:
    """Whether every pid in ``pids`` is gone (no /proc entry, or a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(pid)
            except FileNotFoundError:
                pass
        if not alive:
            return True
        time.sleep(0.05)  # polls the condition, bounded by ``within``
    return False


@zygote_on
def test_zygote_ranks_get_the_same_environment_cwd_and_argv_as_plain_ones(scripts):
    plain = _rank_envs(torchrun_lite.python(), scripts["env"], **{rank_zygote.ENABLE_VAR: "0"})
    forked = _rank_envs(torchrun_lite.python(), scripts["env"])
    zygote = rank_zygote.zygote_pid()
    assert zygote is not None and sorted(plain) == sorted(forked) == [0, 1]
    for rank in (0, 1):
        p, f = plain[rank], forked[rank]
        assert {k: v for k, v in p["env"].items() if k not in DIFFERENT} == {
            k: v for k, v in f["env"].items() if k not in DIFFERENT}
        assert sorted(p["env"]) == sorted(f["env"])
        assert (p["cwd"], p["path0"], p["argv"]) == (f["cwd"], f["path0"], f["argv"]) == (
            str(REPO), str(scripts["env"].parent), [str(scripts["env"])])
        assert p["session_leader"] and f["session_leader"]
        assert f["ppid"] == zygote and p["ppid"] != zygote and f["parent_has_torch"] is True


@zygote_on
def test_zygote_ranks_honour_their_thread_count_import_their_own_trainer_pkg_and_leave_nothing(tmp_path):
    # a snapshot of the trainer first on PYTHONPATH (as on the GPU box): the rank imports it, not the repo's
    snap = tmp_path / "snapshot"
    (snap / "trainer_pkg").mkdir(parents=True)
    (snap / "trainer_pkg" / "__init__.py").write_text("")
    (tmp_path / "probe.py").write_text(PROBE_SCRIPT)
    (tmp_path / "driver.py").write_text(DRIVER.format(tests=str(REPO / "tests")))
    rank_env = {k: v for k, v in os.environ.items() if k != rank_zygote.SOCKET_VAR}
    rank_env.update(OMP_NUM_THREADS="3", PYTHONPATH=os.pathsep.join([str(snap), str(REPO)]))
    cwd = tmp_path / "work"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != rank_zygote.SOCKET_VAR}
    env.update(RANK_ENV=json.dumps(rank_env), RANK_CWD=str(cwd))
    # the driver is a pytest process's stand-in: it starts its own zygote, which must be gone when it exits
    driver = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "probe.py")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert driver.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["code"] == 0, result["stderr"][-3000:]
    probes = [json.loads(line.split(" ", 1)[1]) for line in result["stdout"].splitlines() if line.startswith("PROBE ")]
    assert sorted(p["rank"] for p in probes) == [0, 1]
    for probe in probes:
        assert probe["ppid"] == result["zygote"]  # forked by the zygote
        assert probe["preloaded"] == ["numpy", "torch"]  # nothing of the repository before the rank's own imports
        assert probe["trainer_pkg"] == str(snap / "trainer_pkg" / "__init__.py")
        assert probe["threads"] == 3  # its own OMP_NUM_THREADS, not the zygote's
        assert probe["cwd"] == str(cwd)
    assert _gone([result["zygote"], *(p["pid"] for p in probes)])


def _digits_run(tmp_path: Path, name: str, zygote: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """A 2-rank 1-epoch digits run of the real trainer (mlp, seed 5) under the lite torchrun, through
    the zygote or not (``zygote``: ``TRAINBOARD_TEST_RANK_ZYGOTE``)."""
    job = write_job(tmp_path / name, model={"arch": "mlp"}, train={"epochs": 1, "log_every_steps": 5, "seed": 5})
    cmd = [torchrun_lite.python(), "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", "2", "-m", "trainer_pkg.launch", "--config", str(job)]
    run = subprocess.run(cmd, cwd=REPO, env=dict(trainer_env(), **{rank_zygote.ENABLE_VAR: zygote}),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (name, run.stderr[-3000:])
    return run, records(tmp_path / name / "out")


def _without_timing(recs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in ("time", "_s", "per_s", "/s", "seconds"))}
            for r in recs]


@zygote_on
def test_a_real_trainer_run_through_the_zygote_matches_a_plain_one(tmp_path):
    _, plain = _digits_run(tmp_path, "plain", "0")
    _, forked = _digits_run(tmp_path, "forked", "1")
    assert [r["event"] for r in plain] == [r["event"] for r in forked]
    assert plain[-1]["event"] == "completed"
    keys = ("event", "step", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "sample_order_digest")
    losses = [[r.get(k) for k in keys] for r in plain]
    assert losses == [[r.get(k) for k in keys] for r in forked]  # floats compared exactly: every digit
    assert sum(r.get("train_loss") is not None for r in plain) >= 4 and plain[-2]["val_loss"] is not None
    assert _without_timing(plain) == _without_timing(forked)


@zygote_on
def test_sigterm_to_the_agent_stops_zygote_ranks_with_the_trainers_stopped_record(tmp_path):
    job = write_job(tmp_path, model={"arch": "mlp"},
                    train={"epochs": 1000, "lr": 1e-6, "log_every_steps": 1, "stop_check_s": 0})
    cmd = [torchrun_lite.python(), "-u", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", "2", "-m", "trainer_pkg.launch", "--config", str(job)]
    assert rank_zygote.zygote_pid() is not None
    agent = subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        step = None
        while step is None and time.monotonic() < deadline:
            ready, _, _ = select.select([agent.stdout], [], [], 1.0)
            if ready:
                line = agent.stdout.readline()
                assert line, agent.stderr.read()[-3000:]
                record = parse_metric_line(line)
                step = record if record and record["event"] == "step" else None
        assert step is not None
        ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(rank_zygote.zygote_pid())],
                                                capture_output=True, text=True).stdout.split()]
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert agent.returncode == 1, err[-3000:]
    assert "SignalException" in err and f"got signal: {int(signal.SIGTERM)}" in err
    stopped = records(tmp_path / "out")
    assert stopped[-1]["event"] == "stopped", stopped[-1]
    assert len(ranks) >= 2
    assert _gone(ranks)


@zygote_on
def test_the_zygote_refuses_another_interpreter_and_the_agent_then_starts_a_plain_process(tmp_path):
    torchrun_lite.python()  # this process's zygote, started
    other = tmp_path / "python"
    other.symlink_to(sys.executable)  # the same binary under another name, as a venv's python is
    assert rank_zygote.start([str(other), "-u", "-c", "pass"], dict(os.environ)) is None  # not a -m/script form
    assert rank_zygote.start([str(other), "-u", "-m", "json.tool", "--help"], dict(os.environ)) is None
