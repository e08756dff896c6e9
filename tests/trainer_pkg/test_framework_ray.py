"""``code.framework: ray`` (trainer_pkg/frameworks/ray.py, issue 33): a Ray Train script through the
launcher on two nodes recreated on this machine — two launchers with Slurm's variables, node 0 the
Ray head and the script's driver, node 1 joining — in the Ray test venv (tests/framework_venvs.py).

The script (tests/ray_scripts.py) is a real ``TorchTrainer`` of 2 workers (gloo on CPU) spread one
per node (``--spread``: ``STRICT_SPREAD``, it runs only if node 1 joined); rank 0 reports the
all-reduced sum of the workers' ranks with ``report.log``. Every process under the launchers is
followed while they run; each must be gone when they have exited, at the end of the script and after
a SIGTERM mid-run.

Each of those two tests starts one head and one joining node (~10-20 s each on a loaded 2-core
machine); the TorchTrainer's workers import torch. The venv's first build is in docs/testing.md. The
file and tests/e2e/test_ray_gpubox.py are one xdist unit (``ray``): never two Ray clusters at once.
The other tests here start no Ray: the environment the Ray processes get, the ports, the kill by
session and tag, and the launcher without Ray installed (the project's venv has none).
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from framework_venvs import RAY, framework_venv_fixture
from ray_scripts import RAY_TRAIN_SCRIPT
from trainer_helpers import REPO
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.frameworks import ray as ray_framework
from trainer_pkg.launch import UserScript
from trainer_pkg.platforms import LaunchPlan
from user_scripts import write_code

pytestmark = [pytest.mark.xdist_group("ray")]

ray_python = framework_venv_fixture("ray", RAY)

TIMEOUT_S = 420
"""Seconds a run may take (about 2 minutes on a loaded 2-core machine)."""


class Tracker(threading.Thread):
    """Every process under ``pids`` (their descendants, whatever session they are in), sampled every
    0.1 s until :meth:`stop`: the PIDs that must all be gone once the launchers have exited."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.roots = [psutil.Process(pid) for pid in pids]
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.names: dict[tuple[int, float], set[str]] = {}  # every name a process had: Ray renames its workers
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
                    self.names.setdefault(key, set()).add(name)  # before exec, after, renamed by Ray

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
    names = " | ".join(sorted(set().union(*tracker.names.values())))
    for part in ("-m ray.scripts.scripts", "gcs_server", "raylet", "ray::RayTrainWorker", "train.py"):
        assert part in names, names
    # The dashboard: its own script, or only its modules' processes when a sample missed the first (CI).
    assert "dashboard.py" in names or "ray-dashboard-" in names, names


@pytest.mark.slow
def test_ray_train_script_on_two_nodes(launch_two_nodes):
    launchers, out = launch_two_nodes("--spread")
    codes = launchers.wait()
    node0, node1 = launchers.output(0), launchers.output(1)
    assert codes == [0, 0], (node0[-4000:], node1[-4000:])

    # Node 0: the head, the script's driver; node 1 joined, waited for the script, left.
    [ray_dir] = re.findall(r"\[ray node 0\] Ray head at 127\.0\.0\.1:\d+ \(temp dir (\S+)\)", node0)
    assert not Path(ray_dir).parent.exists()  # removed with Ray's session files
    assert ("[ray node 0] 2 node(s) in the cluster; running python train.py --spread with "
            "RAY_ADDRESS=127.0.0.1:") in node0
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


@pytest.mark.slow
def test_sigterm_mid_run_leaves_no_ray_process(launch_two_nodes):
    launchers, out = launch_two_nodes("--spread", "--hold")
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
    # Node 0's code is the script's, and both nodes got the signal at once: Ray's driver, on SIGTERM,
    # prints "SIGTERM received" and aborts (128 + SIGABRT) unless the script handles SIGTERM itself; or
    # node 1's workers were gone first and the script's fit raised (exit 1: seen in CI under load).
    assert codes[0] in (128 + signal.SIGABRT, 1), (node0[-4000:], node1[-2000:])
    if codes[0] == 128 + signal.SIGABRT:
        assert "SIGTERM received" in node0
    assert "fit ended" not in node0
    assert launchers.tracker.alive() == []


# -- without Ray ----------------------------------------------------------------------------------


def _node(tmp_path: Path, plan: LaunchPlan, monkeypatch, **env: str) -> ray_framework._Node:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = write_code(tmp_path / "code", "print('hi')\n")
    cfg = JobConfig.from_dict({"output": {"output_dir": str(tmp_path / "out")},
                               "code": {"dir": str(code), "script": "train.py", "framework": "ray"}})
    node = ray_framework._Node(cfg, plan, UserScript(code_dir=str(code), path=str(code / "train.py")),
                               join_s=60, grace_s=5)
    monkeypatch.undo()
    return node


def test_ray_processes_get_trainboard_variables_but_no_ranks_and_no_torchrun_agent(tmp_path, monkeypatch):
    """torchrun's rank and agent variables (the GPU box's ranks have them) would make Ray Train's
    workers wait for an agent store nobody hosts (seen: every worker hung in init_process_group)."""
    plan = LaunchPlan(platform="torchrun", nnodes=1, node_rank=0, nproc_per_node=2, master_addr="localhost",
                      master_port=29500, in_process=True)
    node = _node(tmp_path, plan, monkeypatch, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="localhost", MASTER_PORT="29500", TORCHELASTIC_USE_AGENT_STORE="True",
                 TORCHELASTIC_RUN_ID="abc", TRAINBOARD_LAUNCH_PLATFORM="local", RAY_DEDUP_LOGS="1",
                 TRAINBOARD_HARDWARE_SAMPLED="1")
    try:
        env = node.env
        assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TRAINBOARD_LAUNCH_PLATFORM",
                    "TRAINBOARD_HARDWARE_SAMPLED"} & set(env)
        assert env["TRAINBOARD_MODEL_DIR"] == str(tmp_path / "out")
        assert env["TRAINBOARD_CODE_DIR"] == str(tmp_path / "code")
        assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "code"), str(REPO)]
        assert len(env[ray_framework.TAG_ENV]) == 32
        # Trainboard's defaults, unless the job's environment set one (RAY_DEDUP_LOGS here).
        assert (env["RAY_DEDUP_LOGS"], env["RAY_COLOR_PREFIX"], env["RAY_USAGE_STATS_ENABLED"],
                env["RAY_TRAIN_ENABLE_PRINT_PATCH"]) == ("1", "0", "0", "0")
        # Ray's sockets live under its temporary directory: it must be short. Ray opens that one to every
        # user; the private one above it keeps them out.
        assert len(node.ray_dir) <= 40 and Path(node.ray_dir).parent == Path(node.temp_dir)
        assert oct(Path(node.temp_dir).stat().st_mode & 0o777) == "0o700"

        head = node._ray_start(head_port=41000, address=None)
        assert head[:4] == [sys.executable, "-m", "ray.scripts.scripts", "start"]
        assert head[head.index("--temp-dir") + 1] == node.ray_dir
        assert head[head.index("--port") + 1] == "41000" and "--head" in head and "--block" in head
        assert (head[head.index("--dashboard-host") + 1], head[head.index("--min-worker-port") + 1],
                head[head.index("--max-worker-port") + 1]) == ("127.0.0.1", "0", "0")
        assert "--node-ip-address" not in head  # localhost: Ray picks the node's address itself
        ports = [int(head[head.index(flag) + 1]) for flag in
                 ("--ray-client-server-port", "--dashboard-port", "--dashboard-agent-listen-port")]
        assert len(set(ports) | {41000}) == 4 and not {6379, 29500} & set(ports)
        join = node._ray_start(head_port=None, address="10.0.0.1:41000")
        assert join[join.index("--address") + 1] == "10.0.0.1:41000" and "--head" not in join
    finally:
        node.close()
    assert not Path(node.temp_dir).exists()


def test_free_ports_are_distinct_and_never_the_excluded_ones():
    ports = ray_framework.free_ports(20, exclude={6379})
    assert len(set(ports)) == 20 and 6379 not in ports and all(1024 <= p <= 65535 for p in ports)
    # An excluded port is skipped even when the kernel offers it again.
    again = ray_framework.free_ports(10, exclude=set(ports))
    assert not set(again) & set(ports)


HOLDER = """\
import os, subprocess, sys
# A child that leaves our session (as a Ray worker may) but keeps the environment's tag.
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                         start_new_session=True)
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_kill_all_finds_the_session_and_a_tagged_process_that_left_it():
    tag = ("TRAINBOARD_RAY_NODE", "test-" + "0" * 27)
    env = {**os.environ, tag[0]: tag[1]}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        escaped = int(holder.stdout.readline())
        assert psutil.Process(escaped).ppid() == holder.pid
        assert os.getsid(escaped) != holder.pid  # not in the holder's session: found by its tag
        killed = ray_framework.kill_all({holder.pid}, sessions=[holder.pid], tag=tag)
        assert killed == {holder.pid, escaped}
        assert holder.wait(timeout=10) == -signal.SIGKILL
        assert not psutil.pid_exists(escaped) or psutil.Process(escaped).status() == psutil.STATUS_ZOMBIE
        assert bystander.poll() is None  # nothing else was touched
    finally:
        for proc in (bystander, holder):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_other_local_ranks_start_nothing_and_a_python_without_ray_is_a_config_error(tmp_path, monkeypatch):
    cfg = JobConfig.from_dict({"code": {"dir": str(tmp_path), "script": "train.py", "framework": "ray"}})
    script = UserScript(code_dir=str(tmp_path), path=str(tmp_path / "train.py"))
    plan = LaunchPlan(platform="torchrun", nnodes=1, node_rank=0, nproc_per_node=2, in_process=True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ray_framework.run(cfg, plan, script, hardware_every_s=0) == 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert importlib.util.find_spec("ray") is None  # the project's venv: Ray lives in its own
    with pytest.raises(ConfigError, match=r"has no ray package; add ray\[train\]"):
        ray_framework.run(cfg, plan, script, hardware_every_s=0)
    monkeypatch.setenv(ray_framework.JOIN_TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match="TRAINBOARD_RAY_JOIN_TIMEOUT_S must be a number of seconds above 0, "
                                          "got 'soon'"):
        ray_framework.setting_seconds(os.environ, ray_framework.JOIN_TIMEOUT_ENV, 1.0)


def test_the_launcher_without_ray_exits_2_saying_what_to_install(tmp_path):
    from test_platforms import clean_env

    code = write_code(tmp_path / "code", "import ray\n")
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"output": {"output_dir": str(tmp_path / "out")},
                                  "code": {"dir": str(code), "script": "train.py", "framework": "ray"}}))
    done = subprocess.run([sys.executable, "-m", "trainer_pkg.launch", "--config", str(config)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert (f"trainer error: code.framework ray: this job's Python ({sys.executable}) has no ray package; add "
            "ray[train] (pinned, e.g. ray[train]==2.60.0) to the code's requirements.txt") in done.stderr


def test_a_node_whose_head_never_comes_fails_within_the_join_timeout(ray_python, tmp_path):
    """Node 1 of 2 alone (node 0 never started): no store to reach, exit 1 naming it, no Ray started."""
    from test_platforms import clean_env, free_port

    code = write_code(tmp_path / "code", "import ray\n")
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"output": {"output_dir": str(tmp_path / "out")},
                                  "code": {"dir": str(code), "script": "train.py", "framework": "ray"}}))
    port = free_port()
    env = clean_env(SLURM_JOB_ID="77", SLURM_NODEID="1", SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]",
                    SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=str(port), SLURM_GPUS_ON_NODE="0",
                    TRAINBOARD_RAY_JOIN_TIMEOUT_S="3")
    done = subprocess.run([str(ray_python), "-m", "trainer_pkg.launch", "--config", str(config),
                           "--nproc-per-node", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, (done.stdout[-2000:], done.stderr[-2000:])
    assert f"trainer error: node 1: no store at 127.0.0.1:{port} (reaching it failed: " in done.stderr
    assert "[ray node 1]" not in done.stdout  # no ray start
