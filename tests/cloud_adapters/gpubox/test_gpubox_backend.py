"""The gpubox backend: config, validation, disk-state → JobState mapping, logs, and real jobs: the real
trainer (trainer_pkg.launch on the digits dataset) under torchrun with gloo on CPU for a job to
SUCCEEDED and a job that fails, and the trainer stand-in (tests/standins/trainer.py: the same
launcher, no torch, steps only as the test allows) where the subject is the job's life — cancel, a
signal, max runtime, a lost supervisor, a retried submit, the supervisor's reaping."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cloud_adapters.base import InvalidSpec, JobHandle, JobSpec, JobState
from cloud_adapters.gpubox import GpuBoxBackend
from cloud_adapters.gpubox import _proc
from cloud_adapters.gpubox.backend import MAX_LOG_LINES
from polling import wait_for as poll
from trainer_pkg.launch import torchrun_command
from trainer_pkg.metrics import format_metric_line, parse_metric_line
from trainer_pkg.platforms import LAUNCHED_BY_US, LaunchPlan, cpu_threads_per_rank

BOX = {"max_procs_per_node": 2, "grace_period_s": 8, "hourly_rate_usd": 0.9}


@pytest.fixture
def backend(tmp_path):
    return GpuBoxBackend({"run_root": str(tmp_path / "runs"), **BOX})


@pytest.fixture
def standin_box(tmp_path, trainer_standin):
    """The same box with the trainer stand-in as its interpreter (its gate: ``trainer_standin``)."""
    return GpuBoxBackend({"run_root": str(tmp_path / "runs"), "python": trainer_standin.python, **BOX})


def spec(name: str, config: dict | None = None, **kw) -> JobSpec:
    kw.setdefault("procs_per_node", 2)
    return JobSpec(job_name=name, config=config or {"train": {"epochs": 1},
                                                    "parallel": {"procs_per_node": 2}}, **kw)


def wait_for(backend, handle, done, timeout: float, seen: list | None = None):
    """Poll describe() until ``done(status)`` or the deadline; returns the last status."""
    deadline = time.monotonic() + timeout
    while True:
        status = backend.describe(handle)
        if seen is not None and (not seen or seen[-1] != status.state):
            seen.append(status.state)
        if done(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s; last status {status}; log tail:\n"
                                 + _tail(handle))
        time.sleep(0.1)


def _tail(handle: JobHandle) -> str:
    try:
        return "\n".join(Path(handle.provider_job_id, "train.log").read_text().splitlines()[-30:])
    except FileNotFoundError:
        return "(no train.log)"


def procs_mentioning(text: str) -> dict[int, str]:
    """Live processes whose command line contains ``text``, pid -> cmdline."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        stat = _proc.proc_stat(int(entry.name))
        if text in cmd and stat and stat[0] != "Z":
            found[int(entry.name)] = cmd
    return found


def torchrun_pids(run_dir: str) -> list[int]:
    return [p for p, cmd in procs_mentioning(run_dir).items() if "torch.distributed.run" in cmd
            and "cloud_adapters.gpubox.supervisor" not in cmd]


def assert_all_gone(run_dir: str, pgid: int, timeout: float = 5.0) -> None:
    """No process of the job is left (SIGKILL is delivered asynchronously, hence the deadline)."""
    deadline = time.monotonic() + timeout
    while left := sorted(set(_proc.group_members(pgid)) | set(_proc.job_processes(run_dir))
                         | set(procs_mentioning(run_dir))):
        if time.monotonic() > deadline:
            cmds = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ") for p in left}
            raise AssertionError(f"processes of {run_dir} left: {cmds}")
        time.sleep(0.05)


def wait_file(path: Path, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (data := _proc.read_json(path)) is None:
        assert time.monotonic() < deadline, f"{path} not written within {timeout} s"
        time.sleep(0.05)
    return data


# ---------------------------------------------------------------------------------------------
# Configuration and validation (no processes)
# ---------------------------------------------------------------------------------------------


def test_capabilities_and_price(backend):
    caps = backend.capabilities
    assert (caps.max_nodes, caps.spot) == (1, False)
    assert caps.max_procs_per_node == 2 and caps.strategies == ("ddp", "fsdp", "pipeline")
    assert backend.price("anything", spot=False) == 0.9


def test_validate_shows_the_process_arithmetic(backend):
    with pytest.raises(InvalidSpec) as err:
        backend.validate(spec("j1", procs_per_node=3))
    assert str(err.value) == (
        "1 node × 3 processes = 3 ranks, but this GPU box runs at most 2 processes per node "
        "(max_procs_per_node); ask for 2 or fewer."
    )
    with pytest.raises(InvalidSpec) as err:
        backend.validate(spec("j1", nodes=2, procs_per_node=3))
    assert str(err.value) == ("2 nodes requested. A GPU box runs a job on one machine; multi-node jobs go to a "
                              "Slurm or Kubernetes backend.")
    with pytest.raises(InvalidSpec, match="no spot capacity"):
        backend.validate(spec("j1", spot=True))
    backend.validate(spec("j1"))  # 1 × 2 fits


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "-x", "x" * 64, "a_b", "é"])
def test_unsafe_job_names_are_rejected(backend, tmp_path, name):
    with pytest.raises(InvalidSpec, match="must be 1–63 letters, digits or '-'"):
        backend.submit(spec(name))
    assert not (tmp_path / "x").exists()
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


# ---------------------------------------------------------------------------------------------
# describe() from synthetic run directories (no torchrun)
# ---------------------------------------------------------------------------------------------


def _run_dir(backend, name: str) -> tuple[Path, JobHandle]:
    run_dir = backend.run_root / name
    run_dir.mkdir(parents=True)
    return run_dir, JobHandle("gpubox", name, str(run_dir))


def _dead_process() -> tuple[int, int]:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = _proc.start_ticks(child.pid)
    child.wait()
    return child.pid, ticks


def test_describe_maps_exit_records(backend):
    cases = [
        ({"returncode": 0}, "", JobState.SUCCEEDED, "exited 0", ""),
        ({"returncode": 1}, "noise\nRuntimeError: boom\ntrainer error: dataset /d/x.npz not found\n"
         "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
         JobState.FAILED, "exited 1", "trainer error: dataset /d/x.npz not found"),
        ({"returncode": 1}, "a\nValueError: bad shape (3, 4)\n\nChildFailedError: x\nsummary\n",
         JobState.FAILED, "exited 1", "ValueError: bad shape (3, 4)"),
        ({"returncode": 2}, "l1\nl2\n\nl3\nl4\nl5\nl6\n", JobState.FAILED, "exited 2",
         "l2\nl3\nl4\nl5\nl6"),
        ({"returncode": -9}, "", JobState.FAILED, "exited -9", "exit code -9"),
        ({"returncode": 0, "cancelled": True, "reason": "stopped by user"}, "",
         JobState.CANCELLED, "cancelled", "stopped by user"),
        ({"returncode": -15, "max_runtime": True, "reason": "Max runtime reached: the run took longer than 2 s"}, "",
         JobState.FAILED, "max-runtime", "Max runtime reached: the run took longer than 2 s"),
        # an exit record without the max_runtime flag, as a run started by an older supervisor left it
        ({"returncode": -15, "reason": "MaxRuntimeExceeded: ran longer than 2 s"}, "",
         JobState.FAILED, "max-runtime", "MaxRuntimeExceeded: ran longer than 2 s"),
    ]
    for i, (exit_info, log, state, raw, reason) in enumerate(cases):
        run_dir, handle = _run_dir(backend, f"case{i}")
        _proc.write_json_atomic(run_dir / "supervisor.json", {"pid": 1, "started_at": 1000.0})
        record = {"returncode": None, "started_at": 1000.0, "ended_at": 1042.5, "cancelled": False,
                  "reason": ""}
        record.update(exit_info)
        _proc.write_json_atomic(run_dir / "exit.json", record)
        (run_dir / "train.log").write_text(log)
        status = backend.describe(handle)
        assert (status.state, status.raw_state, status.failure_reason) == (state, raw, reason), i
        assert status.started_at.timestamp() == 1000.0
        assert status.ended_at.timestamp() == 1042.5
        assert status.billable_seconds == 42.5 and status.instance_count == 1


def test_describe_live_supervisor_states(backend):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        run_dir, handle = _run_dir(backend, "live")
        _proc.write_json_atomic(run_dir / "supervisor.json", {
            "pid": sleeper.pid, "start_ticks": _proc.start_ticks(sleeper.pid),
            "started_at": time.time() - 5})
        (run_dir / "train.log").write_text("rendezvous...\n")
        status = backend.describe(handle)
        assert (status.state, status.raw_state) == (JobState.PENDING, "spawned")
        assert status.secondary_state == "process spawned, rendezvous"
        assert 5 <= status.billable_seconds < 10 and status.ended_at is None

        with open(run_dir / "train.log", "a") as fh:
            fh.write("[rank0]: " + format_metric_line({"event": "started", "step": 1}) + "\n")
        status = backend.describe(handle)
        assert (status.state, status.raw_state) == (JobState.RUNNING, "running")

        (run_dir / "cancel_requested").write_text("now\n")
        assert backend.describe(handle).state == JobState.STOPPING

        # The same pid with other start ticks is a different (reused-pid) process: not ours.
        _proc.write_json_atomic(run_dir / "supervisor.json", {
            "pid": sleeper.pid, "start_ticks": _proc.start_ticks(sleeper.pid) - 1,
            "started_at": time.time() - 5})
        (run_dir / "cancel_requested").unlink()
        status = backend.describe(handle)
        assert (status.state, status.failure_reason) == (JobState.FAILED,
                                                         "supervisor process disappeared")
    finally:
        sleeper.kill()
        sleeper.wait()


def test_describe_dead_supervisor_without_exit_record(backend):
    pid, ticks = _dead_process()
    run_dir, handle = _run_dir(backend, "lost")
    _proc.write_json_atomic(run_dir / "supervisor.json",
                            {"pid": pid, "start_ticks": ticks, "started_at": time.time() - 3})
    status = backend.describe(handle)
    assert (status.state, status.raw_state) == (JobState.FAILED, "lost")
    assert status.failure_reason == "supervisor process disappeared"
    # After the user asked to stop it, a vanished supervisor means stopped, never SUCCEEDED/FAILED.
    (run_dir / "cancel_requested").write_text("x\n")
    assert backend.describe(handle).state == JobState.CANCELLED


def test_cancel_escalates_when_the_supervisor_is_stuck(backend):
    """A supervisor that ignores SIGTERM: grace + 5 s after the request, cancel() SIGKILLs the
    job's processes and the supervisor itself; the job then reads CANCELLED."""
    run_dir, handle = _run_dir(backend, "stuck")
    stuck = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                              "print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    rank = subprocess.Popen(["sleep", "60"], start_new_session=True,
                            env={**os.environ, _proc.RUN_TAG_VAR: str(run_dir)})
    try:
        assert stuck.stdout.readline() == "ready\n"
        _proc.write_json_atomic(run_dir / "supervisor.json", {
            "pid": stuck.pid, "start_ticks": _proc.start_ticks(stuck.pid), "started_at": time.time()})
        _proc.write_json_atomic(run_dir / "torchrun.json", {
            "pid": rank.pid, "pgid": rank.pid, "start_ticks": _proc.start_ticks(rank.pid)})
        backend.cancel(handle)  # fresh request: SIGTERM only, which the stuck supervisor ignores
        assert backend.describe(handle).state == JobState.STOPPING
        assert stuck.poll() is None and rank.poll() is None

        old = time.time() - (8 + 5 + 1)  # pretend the request is older than grace + 5 s
        os.utime(run_dir / "cancel_requested", (old, old))
        backend.cancel(handle)
        assert stuck.wait(timeout=5) == -signal.SIGKILL
        assert rank.wait(timeout=5) == -signal.SIGKILL
        status = backend.describe(handle)
        assert status.state == JobState.CANCELLED
        assert status.failure_reason == "stopped by user (supervisor process disappeared)"
    finally:
        for p in (stuck, rank):
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------------------------
# logs()
# ---------------------------------------------------------------------------------------------


def test_logs_cursor_continuity_partial_lines_and_limits(backend):
    run_dir, handle = _run_dir(backend, "logs")
    assert backend.logs(handle, "") == ([], "0")  # no log yet
    log = run_dir / "train.log"
    log.write_bytes(b"one\ntwo\r\nth")
    lines, cursor = backend.logs(handle, "")
    assert (lines, cursor) == (["one", "two"], "9")
    assert backend.logs(handle, cursor) == ([], "9")  # the partial line waits
    with open(log, "ab") as fh:
        fh.write(b"ree\n\xff bad byte\n")
    lines, cursor = backend.logs(handle, cursor)
    assert lines == ["three", "\ufffd bad byte"] and cursor == str(log.stat().st_size)

    with open(log, "ab") as fh:
        fh.write(b"".join(b"line %d\n" % i for i in range(MAX_LOG_LINES + 5)))
    first, c1 = backend.logs(handle, cursor)
    second, c2 = backend.logs(handle, c1)
    assert len(first) == MAX_LOG_LINES and second == [f"line {i}" for i in range(2000, 2005)]
    assert first[0] == "line 0" and first[-1] == "line 1999"
    assert c2 == str(log.stat().st_size)
    with pytest.raises(InvalidSpec, match="byte offset"):
        backend.logs(handle, "abc")


# ---------------------------------------------------------------------------------------------
# Real jobs: the real trainer under torchrun (gloo, CPU)
# ---------------------------------------------------------------------------------------------


def test_real_job_succeeds_with_metrics_and_idempotent_submit(backend):
    t0 = time.monotonic()
    first = backend.submit(spec("digits-ok"))
    assert time.monotonic() - t0 < 1.0  # submit does not wait for training
    run_dir = first.provider_job_id

    # A retry and concurrent duplicate deliveries adopt the job: one supervisor, one torchrun.
    handles = [backend.submit(spec("digits-ok"))]
    threads = [threading.Thread(target=lambda: handles.append(backend.submit(spec("digits-ok"))))
               for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert handles == [first] * 4
    tr = wait_file(Path(run_dir, "torchrun.json"))
    sup = _proc.read_json(Path(run_dir, "supervisor.json"))
    supervisors = [p for p, cmd in procs_mentioning(run_dir).items()
                   if "cloud_adapters.gpubox.supervisor" in cmd]
    assert supervisors == [sup["pid"]]
    assert torchrun_pids(run_dir) in ([tr["pid"]], [])  # [] only if it already finished

    job = json.loads(Path(run_dir, "job.json").read_text())
    assert job["output"] == {"output_dir": f"{run_dir}/output",
                             "checkpoint_dir": f"{run_dir}/output/checkpoints"}
    assert job["train"] == {"epochs": 1} and job["parallel"]["procs_per_node"] == 2

    seen: list[JobState] = []
    lines_during, cursor = [], ""
    status = backend.describe(first)
    assert status.state in (JobState.PENDING, JobState.RUNNING)
    deadline = time.monotonic() + 90
    while not status.state.is_terminal:
        seen.append(status.state)
        new, cursor = backend.logs(first, cursor)
        lines_during += new
        assert time.monotonic() < deadline, _tail(first)
        time.sleep(0.2)
        status = backend.describe(first)
    assert status.state == JobState.SUCCEEDED, status
    assert status.raw_state == "exited 0" and status.failure_reason == ""
    assert seen[0] == JobState.PENDING
    assert set(seen) <= {JobState.PENDING, JobState.RUNNING}
    assert status.billable_seconds == pytest.approx(
        (status.ended_at - status.started_at).total_seconds(), abs=1e-3)
    assert 1 < status.billable_seconds < 90

    rest, end_cursor = backend.logs(first, cursor)
    full = Path(run_dir, "train.log").read_text().splitlines()
    assert lines_during + rest == full  # disjoint and consecutive: nothing lost, nothing twice
    assert int(end_cursor) == Path(run_dir, "train.log").stat().st_size
    assert backend.logs(first, end_cursor) == ([], end_cursor)
    # The training's records in order; the ranks' hardware samples (a GPU box's ranks sample themselves,
    # every 5 s: trainer_pkg.hardware) may come before "started" and after "completed".
    events = [r["event"] for r in map(parse_metric_line, full) if r and r["event"] != "hardware"]
    assert events[0] == "started" and "epoch" in events and events[-1] == "completed"
    epoch = next(r for r in map(parse_metric_line, full) if r and r["event"] == "epoch")
    assert epoch["world_size"] == 2 and 0 <= epoch["val_accuracy"] <= 1
    assert Path(run_dir, "output", "metrics.jsonl").exists()

    # Adopting a finished job still starts nothing.
    assert backend.submit(spec("digits-ok")) == first
    assert backend.describe(first).state == JobState.SUCCEEDED
    assert torchrun_pids(run_dir) == []
    backend.cancel(first)  # cancelling a finished job is a no-op
    assert backend.describe(first).state == JobState.SUCCEEDED


def _children() -> dict[int, str]:
    """This process's child processes (of every thread), pid -> state (``Z`` for a zombie)."""
    pids = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            pids.update(int(p) for p in (task / "children").read_text().split())
    return {pid: stat[0] for pid in pids if (stat := _proc.proc_stat(pid))}


def test_a_finished_supervisor_leaves_no_zombie_in_the_worker(standin_box, trainer_standin):
    """The demo's worker submits one job and no other: the supervisor it started, a child in its
    own session, must be reaped when it exits, not left <defunct> until the next submit."""
    backend = standin_box
    trainer_standin.hold(steps=0)
    handle = backend.submit(spec("digits-reaped", {"train": {"epochs": 1}, "parallel": {"procs_per_node": 1}},
                                 procs_per_node=1))
    sup = _proc.read_json(Path(handle.provider_job_id, "supervisor.json"))["pid"]
    assert _children().get(sup) not in (None, "Z")  # it runs, as our child
    assert os.getsid(sup) == sup  # in a session of its own: it outlives the worker
    trainer_standin.release()
    status = wait_for(backend, handle, lambda s: s.state.is_terminal, timeout=60)
    assert status.state == JobState.SUCCEEDED, status
    poll(lambda: sup not in _children(), timeout=10, interval=0.05, what=f"supervisor {sup} to be reaped")
    with pytest.raises(ChildProcessError):
        os.waitpid(sup, os.WNOHANG)  # reaped already, by the backend


def test_cancel_running_job(standin_box, trainer_standin):
    backend = standin_box
    trainer_standin.hold(steps=1)  # `started` is out: RUNNING, and it stays there
    handle = backend.submit(spec("digits-cancel"))
    run_dir = handle.provider_job_id
    trainer_standin.wait_at(1, run_dir)
    wait_for(backend, handle, lambda s: s.state == JobState.RUNNING, 30)
    pgid = _proc.read_json(Path(run_dir, "torchrun.json"))["pgid"]
    # torchrun + 2 ranks (each rank in a session of its own, found by the environment tag)
    assert len(_proc.job_processes(run_dir)) >= 3

    t0 = time.monotonic()
    backend.cancel(handle)
    backend.cancel(handle)  # idempotent
    seen: list[JobState] = []
    status = wait_for(backend, handle, lambda s: s.state.is_terminal, 10, seen)
    assert time.monotonic() - t0 < 10
    assert status.state == JobState.CANCELLED and status.raw_state == "cancelled"
    assert status.failure_reason == "stopped by user"
    assert JobState.STOPPING in seen or seen == [JobState.CANCELLED]
    assert_all_gone(run_dir, pgid, timeout=0.5)
    # The ranks got the SIGTERM first and stopped cleanly: a checkpoint, then the `stopped` record.
    records = [json.loads(line) for line in Path(run_dir, "output", "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["started", "stopped"]
    assert Path(run_dir, "output", "checkpoints", "last.pt").is_file()


def test_a_job_runs_the_launchers_torchrun_command_and_thread_count(standin_box, trainer_standin, backend,
                                                                     monkeypatch):
    # What `trainer_pkg.launch --standalone` would start on this machine: the same argv and, with
    # one process, every core this worker may use (a box that forced 1 thread would show here).
    # The interpreter is the box's `python` setting, by default the worker's own.
    assert backend.config["python"] == sys.executable
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    trainer_standin.hold(steps=0)
    handle = standin_box.submit(spec("digits-threads", {"train": {"epochs": 1}}, procs_per_node=1))
    run_dir = handle.provider_job_id
    try:
        pid = wait_file(Path(run_dir, "torchrun.json"))["pid"]
        trainer_standin.wait_at(0, run_dir)
        # The stand-in is a script: the kernel runs its shebang's interpreter with the script's path first.
        interpreter, *argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
        plan = LaunchPlan(platform="local", nnodes=1, node_rank=0, nproc_per_node=1)
        assert interpreter == sys.executable
        assert argv == torchrun_command(f"{run_dir}/job.json", plan, python=trainer_standin.python)
        assert argv[:8] == [trainer_standin.python, "-m", "torch.distributed.run", "--nnodes", "1",
                            "--nproc_per_node", "1", "--standalone"]
        assert environ["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0))) == str(cpu_threads_per_rank(1))
        assert environ[LAUNCHED_BY_US] == "local"
    finally:
        standin_box.cancel(handle)
        wait_for(standin_box, handle, lambda s: s.state.is_terminal, 30)


def test_a_signal_from_elsewhere_is_not_reported_as_a_user_cancel(standin_box, trainer_standin):
    backend = standin_box
    trainer_standin.hold(steps=1)
    handle = backend.submit(spec("digits-sigterm"))
    run_dir = handle.provider_job_id
    trainer_standin.wait_at(1, run_dir)
    wait_for(backend, handle, lambda s: s.state == JobState.RUNNING, 30)
    pgid = _proc.read_json(Path(run_dir, "torchrun.json"))["pgid"]
    sup = _proc.read_json(Path(run_dir, "supervisor.json"))
    os.kill(int(sup["pid"]), signal.SIGTERM)  # a shutdown or someone's kill: no cancel_requested marker
    status = wait_for(backend, handle, lambda s: s.state.is_terminal, 30)
    assert status.state == JobState.CANCELLED
    assert status.failure_reason == ("stopped by a signal to the job's supervisor (no cancel was requested: "
                                     "a shutdown or a kill)")
    assert_all_gone(run_dir, pgid, timeout=5)


def test_missing_dataset_fails_with_the_path(backend):
    config = {"data": {"format": "npz", "uri": "/nonexistent/x.npz"}, "train": {"epochs": 1},
              "parallel": {"procs_per_node": 2}}
    handle = backend.submit(spec("missing-data", config))
    status = wait_for(backend, handle, lambda s: s.state.is_terminal, 60)
    assert status.state == JobState.FAILED, status
    assert "/nonexistent/x.npz" in status.failure_reason
    assert status.raw_state.startswith("exited ") and status.raw_state != "exited 0"


def test_max_runtime_fails_the_job(standin_box, trainer_standin):
    backend = standin_box
    trainer_standin.hold(steps=1)  # it would never end by itself
    handle = backend.submit(spec("too-slow", max_runtime_s=2))
    status = wait_for(backend, handle, lambda s: s.state.is_terminal, 20)
    assert status.state == JobState.FAILED
    assert status.failure_reason == ("Max runtime reached: the run took longer than 2 s, start-up included; raise the "
                                     "max runtime or resume from the job's checkpoints")
    assert 2 <= status.billable_seconds < 2 + 8 + 3  # runtime + grace + slack
    tr = _proc.read_json(Path(handle.provider_job_id, "torchrun.json"))
    assert_all_gone(handle.provider_job_id, tr["pgid"], timeout=0.5)


def test_killed_supervisor_is_reported_failed(standin_box, trainer_standin):
    backend = standin_box
    trainer_standin.hold(steps=1)
    handle = backend.submit(spec("lost-sup"))
    run_dir = handle.provider_job_id
    tr = wait_file(Path(run_dir, "torchrun.json"))
    sup = _proc.read_json(Path(run_dir, "supervisor.json"))
    trainer_standin.wait_at(1, run_dir)
    wait_for(backend, handle, lambda s: s.state == JobState.RUNNING, 30)
    ranks = set(_proc.job_processes(run_dir)) - {tr["pid"]}
    assert len(ranks) >= 2
    os.kill(sup["pid"], signal.SIGKILL)
    os.killpg(tr["pgid"], signal.SIGKILL)  # torchrun dies; its ranks (own sessions) are orphaned
    status = wait_for(backend, handle, lambda s: s.state.is_terminal, 10)
    assert (status.state, status.raw_state) == (JobState.FAILED, "lost")
    assert status.failure_reason == "supervisor process disappeared"
    assert not Path(run_dir, "exit.json").exists()
    # describe() killed the orphaned ranks: a FAILED job holds no GPU.
    assert_all_gone(run_dir, tr["pgid"])


def test_a_lost_run_directory_is_failed_and_cancel_is_a_no_op(backend):
    """A run directory removed under a job: FAILED "run directory lost" (that job only); its cancel
    has nothing to stop. A run root that is gone itself is a transient error, no verdict."""
    from cloud_adapters.base import ProviderError

    backend.run_root.mkdir(parents=True)
    handle = JobHandle(provider="gpubox", job_name="tb-job-1-gone", provider_job_id=str(backend.run_root / "tb-job-1-gone"))
    status = backend.describe(handle)
    assert (status.state, status.raw_state) == (JobState.FAILED, "lost")
    assert status.failure_reason.startswith(f"run directory lost: {backend.run_root / 'tb-job-1-gone'} no longer exists")
    backend.cancel(handle)  # returns: nothing left to stop
    assert not (backend.run_root / "tb-job-1-gone").exists()

    backend.run_root.rmdir()
    for call in (backend.describe, backend.cancel):
        with pytest.raises(ProviderError) as excinfo:
            call(handle)
        assert excinfo.value.transient and f"run root {backend.run_root} not found" in str(excinfo.value)


def test_a_retry_after_the_worker_died_before_starting_the_supervisor_starts_the_run(standin_box):
    """The first attempt's worker died inside submit after creating the run directory, before the
    supervisor started. The retry, and a duplicate delivery racing it, must not
    adopt that empty directory (it would fail "supervisor never started" though nothing ran): one of
    them starts the run, exactly once, and the other adopts it."""
    backend = standin_box
    name = "digits-retried"
    run_dir = backend.run_root / name
    run_dir.mkdir(parents=True)
    long_ago = time.time() - 600  # past the start-up grace: describe would call an empty one lost
    os.utime(run_dir, (long_ago, long_ago))

    handles: list[JobHandle] = []
    threads = [threading.Thread(target=lambda: handles.append(backend.submit(spec(name)))) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(handles) == 2 and handles[0] == handles[1]
    assert (run_dir / "supervisor.json").exists(), f"adopted a run that never started: {backend.describe(handles[0])}"
    status = wait_for(backend, handles[0], lambda s: s.state.is_terminal, timeout=60)
    assert status.state == JobState.SUCCEEDED, status
    assert (run_dir / "supervisor.log").read_text().count("started torchrun pid") == 1
    assert json.loads((run_dir / "tags.json").read_text()) == {"trainboard-job-name": name}


@pytest.mark.parametrize("through_runner", [False, True], ids=["direct", "runner"])
def test_a_supervisor_that_cannot_start_ends_the_run_not_started(backend, monkeypatch, through_runner):
    """Started directly (the exec fails) or by the box's runner (it refuses): exit.json records it,
    the run is FAILED "not started" with the reason, and a retry adopts it instead of starting it."""
    from cloud_adapters.base import ProviderError
    from cloud_adapters.gpubox import runner as box_runner
    from cloud_adapters.gpubox.backend import RUNNER_SOCKET_VAR

    if through_runner:
        def refuse(socket_path, **kwargs):
            raise box_runner.RunnerError("cwd: /elsewhere is not inside the runner's run root", reached=True)

        monkeypatch.setenv(RUNNER_SOCKET_VAR, str(backend.run_root / "runner.sock"))
        monkeypatch.setattr(box_runner, "start_supervisor", refuse)
        why = "cwd: /elsewhere is not inside the runner's run root"
    else:
        real_popen = subprocess.Popen

        def popen(argv, *args, **kwargs):
            if "cloud_adapters.gpubox.supervisor" in argv:
                raise PermissionError(13, "Permission denied", argv[0])
            return real_popen(argv, *args, **kwargs)

        monkeypatch.setattr(subprocess, "Popen", popen)
        why = f"[Errno 13] Permission denied: '{sys.executable}'"
    reason = f"could not start the gpubox supervisor: {why}"

    with pytest.raises(ProviderError) as err:
        backend.submit(spec("no-supervisor"))
    assert (str(err.value), err.value.transient) == (reason, False)
    run_dir = backend.run_root / "no-supervisor"
    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert {k: exit_info[k] for k in ("returncode", "cancelled", "reason")} == {
        "returncode": None, "cancelled": False, "reason": reason}
    assert exit_info["started_at"] <= exit_info["ended_at"] <= time.time()
    assert not (run_dir / "supervisor.json").exists()
    handle = backend.submit(spec("no-supervisor"))  # adopted: nothing is started a second time
    status = backend.describe(handle)
    assert (status.state, status.raw_state, status.failure_reason) == (JobState.FAILED, "not started", reason)


def test_the_supervisor_holds_the_start_lock_until_it_has_recorded_itself(tmp_path):
    """The submitting worker may die right after starting the supervisor, before it writes
    supervisor.json: the supervisor inherits the run's start.lock (a retry waits on it), and lets go
    of it once it has recorded itself, while it keeps running, so the retry then adopts the run
    instead of waiting out the lock."""
    import fcntl

    run_dir = tmp_path / "tb-job-7-abc"
    run_dir.mkdir()
    fd = os.open(run_dir / "start.lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    sup = subprocess.Popen(
        [sys.executable, "-m", "cloud_adapters.gpubox.supervisor", "--run-dir", str(run_dir),
         "--grace-period", "1", "--max-runtime", "60", "--start-lock-fd", str(fd), "--",
         sys.executable, "-c", "import time; time.sleep(30)"],
        cwd=Path(__file__).resolve().parents[3], pass_fds=(fd,), start_new_session=True)
    os.close(fd)  # the worker is gone: only the supervisor's copy holds the lock now
    try:
        record = wait_file(run_dir / "supervisor.json")
        assert record["pid"] == sup.pid
        other = os.open(run_dir / "start.lock", os.O_RDWR)
        try:
            deadline = time.monotonic() + 10
            while True:  # the supervisor closes its copy right after writing the record
                try:
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the supervisor kept the start lock"
                    time.sleep(0.05)
        finally:
            os.close(other)
        assert sup.poll() is None  # released by closing it, not by exiting
    finally:
        os.killpg(sup.pid, signal.SIGTERM)
        sup.wait(timeout=30)
        wait_file(run_dir / "exit.json")
