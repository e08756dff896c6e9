"""The trainer stand-in (tests/standins/trainer.py) held to the real trainer: the same scenarios, once
with the real torchrun + trainer (gloo on CPU, digits, an mlp, 1 node × 2 processes) and once with the
stand-in, must give output of the same shape — the records' events, epochs and steps, the fields each
record carries, the exit code, the files left in the output and checkpoint directories, the launcher's
and trainer's log lines, and on SIGTERM a ``stopped`` record after a checkpoint and exit 0 within
seconds. The validation accuracy follows ``train.lr`` in both: well above chance after one epoch
and above 0.8 after two at lr 0.05, at chance (0.1) at lr 1e-6 (a sweep's pruner tells good trials
from bad by it: tests/e2e/test_sweep_e2e.py runs its trials on the stand-in).

The real side is one run per scenario (a run to its end; a run stopped by SIGTERM), shared by the
tests of the module; the SIGTERM run is also the real trainer's SIGTERM test (it was
test_trainer_distributed.py's own run). The stand-in's own behaviour (the gate, a failure,
resuming) is tested below them, without torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from standins.trainer import TrainerStandin
from trainer_helpers import REPO, trainer_env
from trainer_pkg.metrics import parse_metric_line

WORLD = 2
NORMAL = {"model": {"arch": "mlp"}, "train": {"epochs": 2, "log_every_steps": 10}}
"""A run to its end: 2 epochs of 23 steps (1,438 samples / 2 ranks / 32 per batch), a record every 10."""
STOPPED = {"model": {"arch": "mlp"}, "train": {"epochs": 1000, "lr": 1e-6, "log_every_steps": 1, "stop_check_s": 0.2}}
"""A run stopped by SIGTERM after its first epoch record (a record every step, so the ``stopped``
record has no training window on either side), at an lr too small to learn anything."""
STOPPED_AT = 25
"""Where the stand-in of the SIGTERM scenario is held: 2 steps into its second epoch (23 steps each)."""
STOP_WITHIN_S = 20.0
"""Seconds from SIGTERM to the launcher's exit, at most."""


@dataclasses.dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    out: Path
    stop_s: float | None = None
    """Seconds from SIGTERM to the exit (a stopped run)."""

    @property
    def records(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]

    @property
    def printed(self) -> list[dict]:
        return [r for r in map(parse_metric_line, self.stdout.splitlines()) if r]

    @property
    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.out)) for p in self.out.rglob("*") if p.is_file())

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.stdout.splitlines() if line.startswith(prefix)]


def _job(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True)
    path = directory / "job.json"
    path.write_text(json.dumps({**config, "output": {"output_dir": str(directory / "out")}}))
    return path


def _torchrun(python: str, job: Path) -> Run:
    """``python -m torch.distributed.run --standalone ... -m trainer_pkg.launch --config job`` (as a
    GPU box starts a job), to its end."""
    cmd = [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(WORLD), "--standalone",
           "-m", "trainer_pkg.launch", "--config", str(job)]
    run = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=180)
    return Run(run.returncode, run.stdout, run.stderr, job.parent / "out")


def _launch_and_stop(python: str, job: Path, ready) -> Run:
    """``python -m trainer_pkg.launch --config job --standalone --nproc-per-node 2`` (the launcher
    starts torchrun), SIGTERM to its process group once ``ready(stdout lines so far)`` is true; the
    run's ``stop_s`` is the time from the signal to the exit."""
    proc = subprocess.Popen([python, "-m", "trainer_pkg.launch", "--config", str(job), "--standalone",
                             "--nproc-per-node", str(WORLD)], cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not ready(seen):
            assert time.monotonic() < deadline and proc.poll() is None, (seen, proc.poll())
            if select.select([proc.stdout], [], [], 0.5)[0]:
                seen.append(proc.stdout.readline())
        os.killpg(proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        rest, err = proc.communicate(timeout=60)
        stop_s = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Run(proc.returncode, "".join(seen) + rest, err, job.parent / "out", stop_s)


def _first_epoch_record(lines: list[str]) -> bool:
    return any((r := parse_metric_line(line)) and r["event"] == "epoch" for line in lines)


@pytest.fixture(scope="module")
def normal(tmp_path_factory) -> dict[str, Run]:
    top = tmp_path_factory.mktemp("normal")
    standin = TrainerStandin.create(top / "standin")
    return {"real": _torchrun(sys.executable, _job(top / "real", NORMAL)),
            "standin": _torchrun(standin.python, _job(top / "fake", NORMAL))}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[str, Run]:
    top = tmp_path_factory.mktemp("stopped")
    standin = TrainerStandin.create(top / "standin")
    standin.hold(steps=STOPPED_AT)
    fake_job = _job(top / "fake", STOPPED)
    return {"real": _launch_and_stop(sys.executable, _job(top / "real", STOPPED), _first_epoch_record),
            "standin": _launch_and_stop(standin.python, fake_job,
                                        lambda seen: standin.at(STOPPED_AT, fake_job.parent) is not None)}


def _checkpoint_position(run: Run) -> tuple[int, int, int]:
    """(epoch to run next, batches done of it, optimizer steps) of the run's last.pt."""
    path = run.out / "checkpoints" / "last.pt"
    try:
        state = json.loads(path.read_text())  # the stand-in's
    except (UnicodeDecodeError, ValueError):
        from trainer_pkg.train import load_checkpoint

        state = load_checkpoint(str(path))
    return state["epoch"], state["batches_done"], state["step"]


def test_a_run_to_its_end_has_the_real_events_steps_and_exit_code(normal):
    real, fake = normal["real"], normal["standin"]
    assert (real.code, fake.code) == (0, 0), (real.stderr[-3000:], fake.stderr[-3000:])
    shape = [(r["event"], r["epoch"], r["step"]) for r in real.records]
    assert shape == [("started", 0, 1), ("step", 0, 10), ("step", 0, 20), ("epoch", 0, 23), ("step", 1, 30),
                     ("step", 1, 40), ("epoch", 1, 46), ("completed", 1, 46)]
    assert [(r["event"], r["epoch"], r["step"]) for r in fake.records] == shape
    for run in (real, fake):
        assert run.printed == run.records  # stdout carries the same records, once each (rank 0)
        assert [r["epochs_done"] for r in run.records if r["event"] == "epoch"] == [1, 2]
        assert run.records[0]["resumed"] is False
        assert {r["total_steps"] for r in run.records} == {46}  # 2 epochs × 23 steps: the dashboard's % done


def test_a_run_to_its_end_has_the_real_record_fields(normal):
    real, fake = normal["real"], normal["standin"]
    assert [sorted(r) for r in fake.records] == [sorted(r) for r in real.records]
    for run in (real, fake):
        for r in run.records:
            assert r["world_size"] == WORLD and isinstance(r["time"], float)
            for key, value in r.items():
                if key.startswith("rank_") or key == "sample_order_digest":
                    assert len(value) == WORLD, (key, value)
            if r["event"] == "epoch":
                assert 0 <= r["val_accuracy"] <= 1 and r["val_loss"] > 0
                assert all(re.fullmatch(r"[0-9a-f]{16}", d) for d in r["sample_order_digest"])
            if "train_loss" in r:
                assert 0 <= r["train_accuracy"] <= 1 and r["samples_per_s"] > 0
    memory = lambda run: [sorted(m) for r in run.records for m in r.get("rank_memory", [])]  # noqa: E731
    assert memory(fake) == memory(real)


def test_a_run_to_its_end_leaves_the_real_files_and_lines(normal):
    real, fake = normal["real"], normal["standin"]
    assert real.files == fake.files == ["checkpoints/last.pt", "metrics.jsonl", "model.pt"]
    assert _checkpoint_position(real) == _checkpoint_position(fake) == (2, 0, 46)
    for run in (real, fake):
        # searched in the whole output: two ranks share the pipe, and under `python -u` print writes
        # its text and its newline apart, so one rank's line may end after the other's has begun
        ranks = set(re.findall(r"\[launch\] rank (\d) \(local rank \1, node_rank 0\) of world size 2, ", run.stdout))
        assert ranks == {"0", "1"}, run.stdout
        assert [re.sub(r"[\d.]+", "N", line) for line in run.lines("[trainer] epoch ")] == [
            "[trainer] epoch N: val_loss N val_accuracy N"] * 2
        assert run.lines("[trainer] done: ") == [f"[trainer] done: {run.out}/model.pt"]
        assert "trainer error" not in run.stderr


def test_sigterm_stops_with_a_checkpoint_a_stopped_record_and_exit_0(stopped):
    real, fake = stopped["real"], stopped["standin"]
    assert (real.code, fake.code) == (0, 0), (real.stderr[-3000:], fake.stderr[-3000:])
    assert sorted(fake.records[-1]) == sorted(real.records[-1])
    for run in (real, fake):
        records = run.records
        last = records[-1]
        assert last["event"] == "stopped" and last["step"] > 0
        events = [r["event"] for r in records]
        assert events[0] == "started" and set(events[1:-1]) <= {"step", "epoch"}, events
        steps = [r["step"] for r in records if r["event"] == "step"]
        assert steps == list(range(2, last["step"] + 1))  # a record per step, stopped after the last
        assert [sorted(r) for r in records if r["event"] == "step"] == [sorted(records[1])] * len(steps)
        assert run.files == ["checkpoints/last.pt", "metrics.jsonl"]  # no model.pt: the run is not over
        epoch, batches, step = _checkpoint_position(run)
        assert (epoch, step) == (last["epoch"], last["step"]) and epoch * 23 + batches == step
        assert run.lines("[trainer] stopped by signal at ") == [
            f"[trainer] stopped by signal at epoch {epoch}, step {step}; checkpoint {run.out}/checkpoints/last.pt"]
        # torchrun was signalled by the launcher: it says so and exits 1, which the launcher turns into 0
        assert re.search(r"SignalException: Process \d+ got signal: 15", run.stderr), run.stderr[-2000:]
    assert [sorted(r) for r in fake.records[:2]] == [sorted(r) for r in real.records[:2]]
    assert fake.records[-1]["step"] == STOPPED_AT  # where the test held it
    for run in (real, fake):
        assert run.stop_s < STOP_WITHIN_S, run.stop_s  # the ranks agreed on the stop within stop_check_s


def test_the_validation_accuracy_follows_the_lr(normal, stopped):
    """lr 0.05 (NORMAL) learns digits in two epochs; lr 1e-6 (STOPPED) stays at chance (10 classes)."""
    for name in ("real", "standin"):
        good = [(r["val_accuracy"], r["val_loss"]) for r in normal[name].records if r["event"] == "epoch"]
        bad = [(r["val_accuracy"], r["val_loss"]) for r in stopped[name].records if r["event"] == "epoch"]
        assert len(good) == 2 and 0.4 < good[0][0] < good[1][0] and good[1][0] > 0.8, (name, good)
        assert good[0][1] > good[1][1], (name, good)  # the loss falls
        assert bad and all(accuracy < 0.3 and loss > 2.0 for accuracy, loss in bad), (name, bad)


# -- the stand-in alone (no torch) -------------------------------------------------------------


def _standin_torchrun(standin: TrainerStandin, job: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([standin.python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
                             str(WORLD), "--standalone", "-m", "trainer_pkg.launch", "--config", str(job)],
                            cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)


def test_the_standin_steps_only_as_the_gate_allows(trainer_standin, tmp_path):
    job = _job(tmp_path / "job", {"train": {"epochs": 1, "log_every_steps": 1}})
    trainer_standin.hold(steps=0)
    proc = _standin_torchrun(trainer_standin, job)
    try:
        held = trainer_standin.wait_at(0, tmp_path / "job", timeout=30)
        assert held["world_size"] == WORLD and len(held["pids"]) == WORLD
        assert not (tmp_path / "job" / "out" / "metrics.jsonl").read_text()  # no step, no `started`
        trainer_standin.hold(steps=5)
        trainer_standin.wait_at(5, tmp_path / "job", timeout=30)
        assert [r["step"] for r in map(json.loads, (tmp_path / "job" / "out" / "metrics.jsonl").open())] == [
            1, 2, 3, 4, 5]
        assert proc.poll() is None
        trainer_standin.release()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    records = [r for r in map(parse_metric_line, out.splitlines()) if r]
    assert [r["event"] for r in records][-2:] == ["epoch", "completed"] and records[-1]["step"] == 23
    assert {p["state"] for p in trainer_standin.positions()} == {"completed"}


def test_a_standin_rank_told_to_fail_fails_the_job_as_a_trainer_error_does(trainer_standin, tmp_path):
    trainer_standin.fail(step=4, rank=1, message="boom at step 4")
    trainer_standin.hold(steps=10)  # the real ranks keep in step through their collectives; these do not
    job = _job(tmp_path / "job", {"train": {"epochs": 1, "log_every_steps": 1}})
    proc = _standin_torchrun(trainer_standin, job)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "trainer error: rank 1: RuntimeError: boom at step 4" in err.splitlines()
    assert "Traceback (most recent call last):" in err and "RuntimeError: boom at step 4" in err
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: " in err
    assert re.search(r"rank      : 1 \(local_rank: 1\)\n  exitcode  : 1 ", err), err
    events = [r["event"] for r in map(parse_metric_line, out.splitlines()) if r]
    assert "completed" not in events and not (tmp_path / "job" / "out" / "model.pt").exists()  # rank 0 stopped


def test_the_standin_resumes_from_its_checkpoint_and_runs_other_programs_on_the_real_interpreter(
        trainer_standin, tmp_path):
    job = _job(tmp_path / "job", {"train": {"epochs": 1, "max_steps": 7, "log_every_steps": 1}})
    first = _standin_torchrun(trainer_standin, job)
    assert first.wait(timeout=30) == 0, first.stderr.read()
    job.write_text(json.dumps({"train": {"epochs": 2, "log_every_steps": 1},
                               "output": {"output_dir": str(tmp_path / "job" / "out")}}))
    second = _standin_torchrun(trainer_standin, job)
    out, err = second.communicate(timeout=30)
    assert second.returncode == 0, err
    assert "[trainer] resuming from " in out and ": epoch 0, batch 7, step 7" in out
    records = [json.loads(line) for line in (tmp_path / "job" / "out" / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in records if r["event"] == "started"]
    assert [(s["step"], s["resumed"]) for s in starts] == [(1, False), (8, True)]
    assert records[-1] == {**records[-1], "event": "completed", "step": 46}

    ran = subprocess.run([trainer_standin.python, "-c", "import sys; print(sys.executable)"],
                         capture_output=True, text=True, timeout=30)
    assert (ran.returncode, ran.stdout.strip()) == (0, sys.executable)


def _node(standin: TrainerStandin, job: Path, node_rank: int, port: int) -> subprocess.Popen:
    """One node's stand-in torchrun of a 2-node × 2-process job (static rendezvous at 127.0.0.1:port)."""
    return subprocess.Popen([standin.python, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
                             "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
                             "-m", "trainer_pkg.launch", "--config", str(job)],
                            cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_two_standin_nodes_number_their_ranks_as_torchrun_and_stop_together(trainer_standin, tmp_path):
    """Two nodes' torchruns (as Slurm's srun tasks or a TrainJob's pods start them): ranks 0-1 on node
    0 and 2-3 on node 1 of world size 4; SIGTERM to one node stops the other's ranks too; a later
    job at the same address and port is not stopped by the first one's stop."""
    from standins.torchrun_lite import free_port

    port = free_port()
    config = {"train": {"epochs": 1, "log_every_steps": 1}, "parallel": {"nodes": 2, "procs_per_node": 2}}
    trainer_standin.hold(steps=2)
    nodes: list[subprocess.Popen] = []
    try:
        first = _job(tmp_path / "first", config)
        nodes = [_node(trainer_standin, first, k, port) for k in (0, 1)]
        held = trainer_standin.wait_at(2, first.parent, timeout=30)
        assert held["world_size"] == 4 and len(held["pids"]) == 4
        nodes[1].send_signal(signal.SIGTERM)  # one node's torchrun is signalled, as one pod is deleted
        outs = [proc.communicate(timeout=30) for proc in nodes]
        assert [proc.returncode for proc in nodes] == [0, 1], [err[-2000:] for _, err in outs]
        launch = sorted(m for out, _ in outs  # the whole output: two ranks' lines may interleave on one pipe
                        for m in re.findall(r"\[launch\] rank (\d) \(local rank (\d), node_rank (\d)\) of world size 4, ", out))
        assert launch == [("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
        mine = [p for p in trainer_standin.positions() if p["output_dir"] == str(first.parent / "out")]
        assert [(p["rank"], p["state"], p["step"]) for p in mine] == [(r, "stopped", 2) for r in range(4)]
        records = [json.loads(line) for line in (first.parent / "out" / "metrics.jsonl").read_text().splitlines()]
        assert [(r["event"], r["world_size"]) for r in records] == [("started", 4), ("step", 4), ("stopped", 4)]

        second = _job(tmp_path / "second", config)  # the same rendezvous: the first job's stop is not its own
        nodes = [_node(trainer_standin, second, k, port) for k in (0, 1)]
        trainer_standin.wait_at(2, second.parent, timeout=30)
        trainer_standin.release()
        outs = [proc.communicate(timeout=30) for proc in nodes]
        assert [proc.returncode for proc in nodes] == [0, 0], [err[-2000:] for _, err in outs]
        records = [json.loads(line) for line in (second.parent / "out" / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["event"] == "completed" and records[-1]["step"] == 12  # 1,438 / 4 ranks / 32 a batch
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_passing_through_runs_the_real_interpreter_for_torchrun_too(trainer_standin):
    def torchrun_help() -> str:
        ran = subprocess.run([trainer_standin.python, "-m", "torch.distributed.run", "--help"], cwd=REPO,
                             env=trainer_env(), capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr[-2000:]
        return ran.stdout

    assert "torchrun (trainer stand-in)" in torchrun_help()
    trainer_standin.pass_through()
    real = torchrun_help()
    assert "trainer stand-in" not in real and "--rdzv-backend" in real  # the real torchrun's options
    trainer_standin.pass_through(False)
    assert "torchrun (trainer stand-in)" in torchrun_help()
