"""A real Slurm cluster for tests: Debian's munged, slurmctld and two slurmd on this machine.

:func:`slurm_cluster` writes a ``slurm.conf`` for two virtual nodes ``n1`` and ``n2`` (each
``CPUs=2``, ``NodeAddr=127.0.0.1``, its own slurmd port), a munge key and every state, spool, pid and
log file under one temporary directory, starts ``munged -F`` (as user munge), ``slurmctld -D -i`` and
``slurmd -D -N n1`` / ``-N n2`` with ``SLURM_CONF`` pointing at that file, waits until ``sinfo``
shows both nodes idle, and yields a :class:`SlurmCluster`. At the end it cancels every job still
known, waits for the jobs to go, and stops each daemon by its PID (SIGTERM, then SIGKILL), and any
process left in their sessions by its own, and removes the directory, even when the test failed::

    with slurm_cluster(tmp_path) as cluster:
        transport = LocalTransport(env=cluster.env)

The suite starts it once per pytest process (tests/conftest.py ``slurm_cluster_shared``, session
scope; every file that uses it carries :data:`SLURM_GROUP`, so under ``-n`` that is once per run). Each
test module gets a view of it with its own work directory (:func:`module_view`), and :func:`reset`
brings it back to a clean state between modules without restarting a daemon: every job cancelled and
gone from squeue, both nodes idle (a node a test set down or drained is resumed). :data:`STARTS`
counts the clusters this process started.

No systemd and no accounting daemon (``slurmdbd``): ``sacct`` has nothing to say here, which is what
the adapter's ``scontrol show job`` and exit-marker fallbacks are for. The facts are in
shared/reference/clouds.md §7 (Slurm 22.05.8 of Debian 12).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

MUNGED = "/usr/sbin/munged"
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
NODES = ("n1", "n2")
CPUS_PER_NODE = 2
PARTITION = "debug"
CLUSTER_NAME = "tbtest"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
RESET_TIMEOUT_S = 60.0
RESUMABLE_STATES = ("down", "drain", "drng", "fail", "failg")
"""sinfo's short node states (``%t``, flag characters such as ``*`` stripped) that :func:`reset`
resumes with ``scontrol update nodename=… state=resume``: what a test's ``state=down`` or a drain
leaves behind."""

STARTS = 0
"""How many clusters :func:`slurm_cluster` started in this process (the suite's goal: 1)."""

SLURM_GROUP = pytest.mark.xdist_group("slurm")
"""The mark of every test file that uses this cluster: under ``-n`` (tests/xdist_workers.py) they all
run on one worker, which starts the shared cluster once, as a serial run does (tests/conftest.py
``slurm_cluster_module`` refuses a module without it)."""


def nodes_python() -> str:
    """The nodes' interpreter (the ``python`` setting) for the tests whose subject is the Slurm adapter:
    the torch-free torchrun's wrapper (tests/standins/torchrun_lite.py). Each node runs the real
    launcher, which starts the real trainer's ranks through a torchrun that imports no torch (a third
    of a 2-rank node's CPU). Torch's own torchrun under ``srun`` runs in tests/e2e/test_slurm.py's
    job, and its two-node rendezvous in tests/trainer_pkg/test_platforms.py."""
    from standins import torchrun_lite

    return torchrun_lite.wrapper()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class SlurmCluster:
    """A running test cluster: its config file, its shared work directory and its daemons' PIDs."""

    directory: Path  # everything of the cluster lives here
    conf: Path  # slurm.conf (SLURM_CONF of every Slurm command)
    work_dir: Path  # the "shared filesystem" run directories go to (it is one machine)
    pids: dict[str, int]  # daemon name ("munged", "slurmctld", "slurmd-n1" …) -> PID
    partition: str = PARTITION
    cluster_name: str = CLUSTER_NAME
    nodes: tuple[str, ...] = NODES

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm command needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run a Slurm command against this cluster (argv list, no shell); output as text."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env}, check=False)

    def job_names(self) -> list[str]:
        """The names of the jobs squeue lists now (every state squeue shows)."""
        out = self.run("squeue", "-h", "-o", "%j")
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    def log(self, daemon: str) -> str:
        path = self.directory / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """The tails of every daemon's log and console output (for an error message)."""
        parts = []
        for name in ("munged", "slurmctld", *(f"slurmd-{n}" for n in self.nodes)):
            out = self.directory / f"{name}.out"
            console = out.read_text(errors="replace")[-2000:] if out.exists() else ""
            parts.append(f"--- {name} ---\n{self.log(name)[-3000:]}{console}")
        return "\n".join(parts)

    def node_states(self) -> dict[str, str]:
        """sinfo's short state of each node (``{"n1": "idle", "n2": "down*"}``); {} when sinfo fails."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t")
        if out.returncode != 0:
            return {}
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def active_jobs(self) -> list[str] | None:
        """``"<id> <name> <state>"`` of each job squeue lists by default (pending, running, completing:
        not the finished ones the controller still remembers for MinJobAge); None when squeue fails."""
        out = self.run("squeue", "-h", "-o", "%i %j %T")
        if out.returncode != 0:
            return None
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def _slurm_conf(directory: Path, host: str, ctld_port: int, node_ports: dict[str, int], munge_socket: Path) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={CPUS_PER_NODE} "
        f"RealMemory=1000 State=UNKNOWN" for n, p in node_ports.items())
    return f"""\
ClusterName={CLUSTER_NAME}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=900
KillWait=5
InactiveLimit=0
SlurmdTimeout=300
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{nodes}
PartitionName={PARTITION} Nodes={','.join(node_ports)} Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid: int) -> None:
    """SIGTERM ``pid``, wait up to STOP_TIMEOUT_S, then SIGKILL (a PID we started)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        if not running(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _session_members(sids: set[int]) -> list[int]:
    """PIDs of the processes (other than the leaders) whose session is one of ``sids``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, sid = int(entry), int(fields[3])
        if sid in sids and pid not in sids and fields[0] not in ("Z", "X"):
            found.append(pid)
    return found


def _wait(predicate, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise RuntimeError(f"test Slurm cluster: {what} within {timeout:g} s\n{logs()}")


@contextlib.contextmanager
def slurm_cluster(directory: Path | None = None) -> Iterator[SlurmCluster]:
    """Start the two-node cluster (module docstring) and stop it by PID at the end.

    ``directory``: where its files go; None = a fresh one under /tmp (munged, which runs as user
    munge, must be able to reach its files: pytest's tmp_path is private to root)."""
    global STARTS
    from fixture_report import count_start

    STARTS += 1
    count_start("slurm cluster")
    base = Path(tempfile.mkdtemp(prefix="tb-slurm-", dir=str(directory) if directory else None))
    base.chmod(0o755)
    for sub in ("state", "spool", "work"):
        (base / sub).mkdir(mode=0o755)
    munge = pwd.getpwnam("munge")
    munge_dir = base / "munge"
    munge_dir.mkdir(mode=0o755)  # munged: its socket directory must be searchable by all
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    for path in (munge_dir, key):
        os.chown(path, munge.pw_uid, munge.pw_gid)
    munge_socket = munge_dir / "munge.socket"

    host = socket.gethostname().split(".")[0]
    node_ports = {n: free_port() for n in NODES}
    conf = base / "slurm.conf"
    conf.write_text(_slurm_conf(base, host, free_port(), node_ports, munge_socket))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(directory=base, conf=conf, work_dir=base / "work", pids={})
    procs: list[subprocess.Popen] = []
    logs = cluster.logs

    def start(name: str, argv: list[str], **kw) -> None:
        with open(base / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env, **kw)
        procs.append(proc)
        cluster.pids[name] = proc.pid

    try:
        start("munged", [MUNGED, "-F", f"--socket={munge_socket}", f"--key-file={key}",
                         f"--log-file={munge_dir / 'munged.log'}", f"--pid-file={munge_dir / 'munged.pid'}",
                         f"--seed-file={munge_dir / 'munged.seed'}"],
              user=munge.pw_uid, group=munge.pw_gid)
        _wait(lambda: munge_socket.exists() or procs[0].poll() is not None, START_TIMEOUT_S,
              "munged did not open its socket", logs)
        if procs[0].poll() is not None:
            raise RuntimeError(f"test Slurm cluster: munged exited with {procs[0].returncode}\n{logs()}")
        start("slurmctld", [SLURMCTLD, "-D", "-i"])
        for node in NODES:
            start(f"slurmd-{node}", [SLURMD, "-D", "-N", node])

        def idle() -> bool:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"test Slurm cluster: {proc.args[0]} exited with {proc.returncode}\n{logs()}")
            states = cluster.node_states()
            return all(states.get(n) == "idle" for n in NODES)

        _wait(idle, START_TIMEOUT_S, "the nodes were not idle", logs)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            if cluster.pids.get("slurmctld") and running(cluster.pids["slurmctld"]):
                cluster.run("scancel", "--full", "-u", "root", timeout=15)
                deadline = time.monotonic() + STOP_TIMEOUT_S
                while time.monotonic() < deadline and cluster.job_names():
                    time.sleep(0.3)
        leaders = {p.pid for p in procs}
        for proc in reversed(procs):  # the slurmds, then slurmctld, then munged
            _stop(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for pid in _session_members(leaders):  # a slurmstepd left behind
            _stop(pid)
        shutil.rmtree(base, ignore_errors=True)


def reset(cluster: SlurmCluster, timeout: float = RESET_TIMEOUT_S) -> None:
    """Bring a running cluster back to a clean state without restarting a daemon.

    Cancels every job (``scancel --full -u root``: all jobs run as root here), resumes each node
    sinfo shows in one of :data:`RESUMABLE_STATES`, and waits until squeue lists no job and both
    nodes are ``idle``. Finished jobs stay known to the controller for MinJobAge (900 s) — ``squeue
    --states=all`` and ``scontrol show job`` still list them — so a test names its own jobs when it
    asks Slurm. Raises RuntimeError, with the daemons' logs, when a daemon is no longer running or the
    cluster is not clean within ``timeout`` seconds."""
    dead = [name for name, pid in cluster.pids.items() if not running(pid)]
    if dead:
        raise RuntimeError(f"test Slurm cluster: {', '.join(dead)} no longer runs (a test must not stop a "
                           f"daemon of the shared cluster)\n{cluster.logs()}")
    cancelled = cluster.run("scancel", "--full", "-u", "root", timeout=15)
    if cancelled.returncode != 0:
        raise RuntimeError(f"test Slurm cluster: scancel failed: {cancelled.stderr.strip()}\n{cluster.logs()}")
    seen: dict[str, object] = {}

    def clean() -> bool:
        states = cluster.node_states()
        for node in cluster.nodes:
            if states.get(node, "").rstrip("*~#!%$@^-+") in RESUMABLE_STATES:
                cluster.run("scontrol", "update", f"nodename={node}", "state=resume")
        jobs = cluster.active_jobs()
        seen.update(states=states, jobs=jobs)
        return jobs == [] and all(states.get(n) == "idle" for n in cluster.nodes)

    _wait(clean, timeout, "was not clean (no job, every node idle)",
          lambda: f"last seen: {seen}\n{cluster.logs()}")


def module_view(cluster: SlurmCluster, name: str) -> SlurmCluster:
    """``cluster`` with a work directory of its own: a new ``<work_dir>/<name>-XXXX`` (0755, one per
    call, so the run directories of two test modules never mix). ``name``: a module's name; anything
    but letters, digits, ``-`` and ``_`` becomes ``-``."""
    slug = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:60] or "module"
    work = Path(tempfile.mkdtemp(prefix=f"{slug}-", dir=cluster.work_dir))
    work.chmod(0o755)
    return dataclasses.replace(cluster, work_dir=work)
