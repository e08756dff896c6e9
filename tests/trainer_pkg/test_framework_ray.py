"""``code.framework: ray`` (trainer_pkg/frameworks/ray.py, issue 33): a Ray Train script through the
launcher on two nodes recreated on this machine — two launchers with Slurm's variables, node 0 the
Ray head and the script's driver, node 1 joining — in the Ray test venv (tests/framework_venvs.py).

The script is a real ``TorchTrainer`` of 2 workers (gloo on CPU) spread one per node
(``STRICT_SPREAD``: it runs only if node 1 joined); rank 0 reports the all-reduced sum of the
workers' ranks with ``report.log``. Every process under the launchers is followed while they run;
each must be gone when they have exited, at the end of the script and after a SIGTERM mid-run.

Each test starts one head and one joining node (~10-20 s each on a loaded 2-core machine); the
TorchTrainer's workers import torch. The venv's first build is in docs/testing.md.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

from framework_venvs import RAY, framework_venv_fixture
from trainer_helpers import REPO
from user_scripts import write_code

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray-in-job")]

ray_python = framework_venv_fixture("ray", RAY)

RAY_TRAIN_SCRIPT = '''\
import os
import sys
import threading

import ray
import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def loop(config):
    import torch
    import torch.distributed as dist

    from trainer_pkg import report

    ctx = ray.train.get_context()
    ranks = torch.tensor([float(ctx.get_world_rank() + 1)])
    dist.all_reduce(ranks)  # TorchTrainer's process group (gloo on CPU): 1 + 2
    node = ray.get_runtime_context().get_node_id()
    print(f"worker {ctx.get_world_rank()} of {ctx.get_world_size()} on node {node}", flush=True)
    report.log(step=1, rank_sum=ranks.item())
    if config["hold"]:
        threading.Event().wait()  # until the test stops the job


ray.init()  # RAY_ADDRESS: this job's head
trainer = TorchTrainer(
    loop, train_loop_config={"hold": "--hold" in sys.argv},
    scaling_config=ScalingConfig(num_workers=int(os.environ["TRAINBOARD_RAY_NUM_WORKERS"]),
                                 placement_strategy="STRICT_SPREAD"),
    run_config=RunConfig(storage_path=os.path.join(os.environ["TRAINBOARD_CHECKPOINT_DIR"], "ray"), name="job"))
result = trainer.fit()
print(f"fit ended, error {result.error}", flush=True)
'''

TIMEOUT_S = 420
"""Seconds a run may take (about 2 minutes on a loaded 2-core machine)."""


class Tracker(threading.Thread):
    """Every process under ``pids`` (their descendants, whatever session they are in), sampled every
    0.1 s until :meth:`stop`: the PIDs that must all be gone once the launchers have exited."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.roots = [psutil.Process(pid) for pid in pids]
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.names: dict[tuple[int, float], str] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()

    def sample(self) -> None:
        for root in self.roots:
            try:
                children = root.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for proc in children:
                try:
                    key = (proc.pid, proc.create_time())
                    name = " ".join(proc.cmdline()[:3]) or proc.name()
                except psutil.Error:
                    continue
                with self.lock:
                    self.seen.setdefault(key, proc)
                    self.names[key] = name  # the latest: a child seen between fork and exec, a renamed worker

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.sample()

    def stop(self) -> None:
        self.done.set()
        self.join()

    def alive(self) -> list[str]:
        """The followed processes that still exist (a zombie counts as gone), described."""
        left = []
        for (pid, _), proc in self.seen.items():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(proc.cmdline())[:160]}")
            except psutil.NoSuchProcess:
                pass
        return left

    def kill_left(self) -> None:
        for (_, _), proc in self.seen.items():
            try:
                if proc.is_running():
                    proc.kill()
            except psutil.Error:
                pass


class Launchers:
    """Node 0's and node 1's launcher (Slurm's variables, the rendezvous on 127.0.0.1), their output
    read line by line, every process under them followed."""

    def __init__(self, python: Path, config: Path) -> None:
        from test_platforms import clean_env, free_port

        port = free_port()
        self.procs = []
        for node in (0, 1):
            env = clean_env(SLURM_JOB_ID="77", SLURM_NODEID=str(node), SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]",
                            SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=str(port), SLURM_GPUS_ON_NODE="0")
            self.procs.append(subprocess.Popen(
                [str(python), "-m", "trainer_pkg.launch", "--config", str(config), "--nproc-per-node", "1"],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        self.lines: list[list[str]] = [[], []]
        self.node0 = queue.Queue()
        self.readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in (0, 1)]
        for reader in self.readers:
            reader.start()
        self.tracker = Tracker([p.pid for p in self.procs])
        self.tracker.start()

    def _read(self, node: int) -> None:
        for line in self.procs[node].stdout:
            self.lines[node].append(line)
            if node == 0:
                self.node0.put(line)

    def wait_for(self, text: str, timeout: float) -> str:
        """Node 0's first output line holding ``text`` (read as it is printed)."""
        while True:
            line = self.node0.get(timeout=timeout)
            if text in line:
                return line

    def wait(self, timeout: float = TIMEOUT_S) -> list[int]:
        codes = [p.wait(timeout=timeout) for p in self.procs]
        for reader in self.readers:
            reader.join(timeout=30)
        self.tracker.stop()
        return codes

    def output(self, node: int) -> str:
        return "".join(self.lines[node])

    def close(self) -> None:
        """After a failed test: nothing of it is left running (each by its PID)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.tracker.done.set()
        self.tracker.kill_left()


@pytest.fixture
def launch_two_nodes(ray_python, tmp_path):
    started: list[Launchers] = []

    def start(*args: str) -> tuple[Launchers, Path]:
        code = write_code(tmp_path / "code", RAY_TRAIN_SCRIPT)
        out = tmp_path / "out"
        config = tmp_path / "job.json"
        config.write_text(json.dumps({
            "output": {"output_dir": str(out), "checkpoint_dir": str(out / "checkpoints")},
            "code": {"dir": str(code), "script": "train.py", "args": list(args), "framework": "ray"}}))
        launchers = Launchers(ray_python, config)
        started.append(launchers)
        return launchers, out

    yield start
    for launchers in started:
        launchers.close()


def metric_records(text: str) -> list[dict]:
    return [json.loads(line.split("TRAINBOARD_METRIC ", 1)[1]) for line in text.splitlines()
            if "TRAINBOARD_METRIC " in line]


def assert_ray_processes_seen(tracker: Tracker) -> None:
    """The tracker followed the Ray cluster itself, not only the launchers' direct children."""
    names = " | ".join(sorted(set(tracker.names.values())))
    for part in ("-m ray.scripts.scripts", "gcs_server", "raylet", "dashboard.py", "ray::RayTrainWorker",
                 "train.py"):
        assert part in names, names


def test_ray_train_script_on_two_nodes(launch_two_nodes):
    launchers, out = launch_two_nodes()
    codes = launchers.wait()
    node0, node1 = launchers.output(0), launchers.output(1)
    assert codes == [0, 0], (node0[-4000:], node1[-4000:])

    # Node 0: the head, the script's driver; node 1 joined, waited for the script, left.
    assert re.search(r"\[ray node 0\] Ray head at 127\.0\.0\.1:\d+ ", node0)
    assert "[ray node 0] 2 node(s) in the cluster; running python train.py with RAY_ADDRESS=127.0.0.1:" in node0
    assert "TRAINBOARD_RAY_NUM_WORKERS=2" in node0
    assert "[ray node 1] joined the Ray cluster at 127.0.0.1:" in node1
    assert "[ray node 1] node 0's script ended (exit code 0)" in node1
    assert "fit ended, error None" in node0

    # The workers' output is in node 0's log (Ray streams it to the driver), once each, one per node.
    workers = re.findall(r"\(RayTrainWorker pid=\d+(?:, ip=[\d.]+)?\) worker (\d) of 2 on node (\w+)", node0)
    assert sorted(rank for rank, _ in workers) == ["0", "1"], node0[-4000:]
    assert len({node for _, node in workers}) == 2

    # rank 0's report.log: a metric record in the job's log and in metrics.jsonl, gloo's sum of both ranks.
    [record] = metric_records(node0)
    assert (record["event"], record["step"], record["rank_sum"]) == ("step", 1, 3.0)
    assert record["user_metrics"] == ["rank_sum"]
    [stored] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert stored["rank_sum"] == 3.0 and stored["step"] == 1

    assert_ray_processes_seen(launchers.tracker)
    assert launchers.tracker.alive() == []
    assert re.search(r"\[ray node 0\] stopped \d+ Ray process\(es\) by PID", node0)


def test_sigterm_mid_run_leaves_no_ray_process(launch_two_nodes):
    launchers, out = launch_two_nodes("--hold")
    line = launchers.wait_for("TRAINBOARD_METRIC", timeout=TIMEOUT_S)  # the workers are training now
    assert json.loads(line.split("TRAINBOARD_METRIC ", 1)[1])["rank_sum"] == 3.0
    launchers.tracker.sample()
    assert_ray_processes_seen(launchers.tracker)
    for proc in launchers.procs:  # what a cancel does on a cloud or a Slurm cluster: every node's launcher
        proc.send_signal(signal.SIGTERM)
    codes = launchers.wait(timeout=120)
    node0, node1 = launchers.output(0), launchers.output(1)

    assert "[ray node 0] signal 15: passed to the script (30 s to exit)" in node0
    assert "[ray node 1] stopped by signal 15" in node1
    assert codes[1] == 128 + signal.SIGTERM
    # Node 0's code is the script's: Ray's driver, on SIGTERM, prints "SIGTERM received" and aborts
    # (128 + SIGABRT) unless the script handles SIGTERM itself; node 1 reports the signal it got.
    assert codes == [128 + signal.SIGABRT, 128 + signal.SIGTERM], (node0[-4000:], node1[-2000:])
    assert "SIGTERM received" in node0
    assert "fit ended" not in node0
    assert launchers.tracker.alive() == []
