"""A real Ray head on this machine for the ``ray`` backend's tests: ``ray start --head --block`` from the
Ray test venv (tests/framework_venvs.py ``RAY``), every port a free one (never 6379, never Ray's
defaults: another head may run beside it), a short temporary directory of its own, 2 CPUs.

    head = RayHead.start(ray_python)   # waits for the dashboard's /api/version and the CPUs (deadline)
    head.address                       # http://127.0.0.1:<dashboard port>
    head.stop()                        # SIGTERM, then SIGKILL, to the head and every process under it

The head's processes (GCS, raylet, dashboard, the jobs' drivers and workers) see the venv's ``bin`` first
on PATH, so a job's ``python`` is the venv's, which sees the project's torch through its ``.pth``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from adapter_standins import free_port
from framework_venvs import RAY, framework_venv

START_TIMEOUT_S = 180.0
"""A cold head on a loaded 2-core machine takes 15-40 s."""


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports and port != 6379:
            ports.append(port)
    return ports


@dataclasses.dataclass
class RayHead:
    python: Path  # the Ray venv's python (the jobs' interpreter)
    proc: subprocess.Popen
    address: str  # the dashboard's URL
    temp_dir: str
    log_path: str

    @classmethod
    def start(cls, python: Path, *, num_cpus: int = 2) -> "RayHead":
        temp_dir = tempfile.mkdtemp(prefix="tbray-", dir="/tmp")  # Ray's socket paths must stay short
        gcs, dashboard, client, agent_http, agent_grpc, metrics, runtime_env = _free_ports(7)
        venv_bin = str(Path(python).parent)
        # A cluster's own environment, not this test process's (its database URL, its test settings).
        env = {"PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
               "LANG": "C.UTF-8", "RAY_USAGE_STATS_ENABLED": "0"}
        argv = [os.path.join(venv_bin, "ray"), "start", "--head", "--block", "--port", str(gcs),
                "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
                "--node-ip-address", "127.0.0.1", "--ray-client-server-port", str(client),
                "--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
                "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(runtime_env),
                "--num-cpus", str(num_cpus), "--num-gpus", "0", "--temp-dir", temp_dir, "--disable-usage-stats"]
        log_path = os.path.join(temp_dir, "head.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        head = cls(python=Path(python), proc=proc, address=f"http://127.0.0.1:{dashboard}", temp_dir=temp_dir,
                   log_path=log_path)
        try:
            head.wait_ready(num_cpus)
        except BaseException:
            head.stop()
            raise
        return head

    def wait_ready(self, num_cpus: int) -> None:
        """Until the dashboard answers and the autoscaler's report counts the CPUs (the Jobs API may
        answer before the raylet registered)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                status = httpx.get(f"{self.address}/api/cluster_status", timeout=5).json()
                usage = status["data"]["clusterStatus"]["loadMetricsReport"]["usage"]
                if usage.get("CPU", [0, 0])[1] >= num_cpus:
                    return
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not come up in {START_TIMEOUT_S:g} s: {self.log()[-3000:]}")
            time.sleep(0.5)

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def processes(self) -> list[psutil.Process]:
        """The head and every process under it now."""
        try:
            top = psutil.Process(self.proc.pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        """SIGTERM to the head and all its descendants (collected first: a child whose parent dies is
        reparented out of the tree), SIGKILL to those left after 10 s; then the temporary directory."""
        procs = self.processes()
        for proc in procs:
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_python() -> Path:
    """The Ray test venv's python (tests/framework_venvs.py ``RAY``)."""
    return framework_venv("ray", RAY)


_SHARED: list[RayHead] = []
"""The running head that consecutive tests share (at most one)."""

STARTS = 0
"""Heads started in this process (the fixture report prints it)."""


def stop_shared_head() -> None:
    """Stop the shared head if one runs: tests/conftest.py calls it after a test when the next one does
    not take ``head`` (an idle head costs CPU for the rest of the run), and at the session's end."""
    while _SHARED:
        _SHARED.pop().stop()


@pytest.fixture
def head(ray_python: Path):
    """One Ray head for consecutive tests that take it: every module of the ``ray-backend`` xdist group
    (the backend's cluster tests and its end-to-end test run in one worker process, one after another)
    shares one; it is stopped by PID with its processes once the next test does not take it
    (tests/conftest.py ``pytest_runtest_teardown``) — a serial run, which runs the two modules apart,
    starts one for each."""
    global STARTS
    if not _SHARED or _SHARED[0].proc.poll() is not None:
        stop_shared_head()
        _SHARED.append(RayHead.start(ray_python))
        STARTS += 1
    return _SHARED[0]
