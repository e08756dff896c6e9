"""Ray inside the job (``code.framework: ray``): a Ray cluster over the job's nodes, the user's script
as its driver on node 0, every Ray process stopped by PID when the script ends or the job is stopped.

What runs where (the cluster shape is the plan's, :mod:`trainer_pkg.platforms`, on every platform):

=============  =====================================================================================
node 0         ``ray start --head --block`` (its own session; ports below), waits for the other nodes
               to join, then runs the script (``python train.py args`` in ``code.dir``) as the Ray
               driver and waits for it: its exit code is the node's.
node 1 … n-1   ``ray start --address <head> --block``, then waits until node 0's script ends.
ranks          where the platform started one process per rank (GPU box: torchrun; Azure ML; a
               torchrun of the user's), local rank 0 of each node is that node's launcher above and
               the other local ranks exit 0 at once: Ray starts its own worker processes.
=============  =====================================================================================

The script gets Trainboard's variables (:func:`trainer_pkg.launch.trainboard_env`) and
``RAY_ADDRESS`` (the head's GCS, ``<node 0's address>:<port>``: ``ray.init()``/``ray.init("auto")``
connect to this job's cluster and no other on the machine), ``TRAINBOARD_RAY_NUM_WORKERS`` (nodes ×
processes per node: ``ScalingConfig(num_workers=...)``), ``TRAINBOARD_NNODES``,
``TRAINBOARD_NPROC_PER_NODE`` and ``TRAINBOARD_RAY_USE_GPU`` (``1`` when this node has a GPU,
else ``0``); not torchrun's ``RANK``/``WORLD_SIZE``: the driver is no rank (Ray Train sets them in
its workers). Every Ray process (and so every Ray worker) has Trainboard's variables too, the code
directory and this package on ``PYTHONPATH`` (``from trainer_pkg import report`` in a worker), and
``RAY_ADDRESS``.

Ports: the head's GCS port and every fixed Ray port (client server, dashboard, dashboard agent) are
free ports this node picks at start (never 6379, never the platform's ``MASTER_PORT``); the others
(node manager, object manager, workers, agents' gRPC, metrics) are left to the OS (``0``). The
dashboard listens on 127.0.0.1 only. The head's address reaches the other nodes, and the end of the
script reaches them, through a :class:`torch.distributed.TCPStore` at the plan's
``MASTER_ADDR:MASTER_PORT`` (hosted by node 0's launcher; by torchrun's agent where torchrun started
the ranks): keys ``head`` (the GCS address), ``joined`` and ``left`` (counters), ``done`` (node 0's
exit code). A job of one node needs no store.

Logs: ``ray start``'s output is printed with ``[ray node N]`` in front; the script's stdout and stderr
are the launcher's, and Ray streams its workers' output to the driver (``(RayTrainWorker pid=…)
…``): all of it is in the job's log, and a ``report.log`` line of a worker is a metric record like
any other. Ray's log deduplication (``RAY_DEDUP_LOGS``) and coloured prefixes (``RAY_COLOR_PREFIX``)
are off, and so are usage statistics (``RAY_USAGE_STATS_ENABLED``) and Ray Train's own copy of a
worker's ``print`` (``RAY_TRAIN_ENABLE_PRINT_PATCH``), unless the job's environment sets them
(:data:`RAY_DEFAULTS`).

Stopping: SIGTERM/SIGINT to the launcher are passed to the script (node 0), which has
:data:`STOP_GRACE_ENV` seconds (default 30) before it and its processes are SIGKILLed. Then, and
whenever the script ends, every Ray process of this node is SIGKILLed by PID: the processes in the
session of its ``ray start`` and any process whose environment carries this node's
:data:`TAG_ENV` value (a Ray worker that left the session). ``ray stop`` is not used: it stops every
Ray on the machine by process name. Ray's temporary directory (``--temp-dir``: short, as Ray's socket
paths must fit 107 bytes; inside a new directory only this uid may enter, as Ray opens its own to
every user) is removed.

Failures: node 0 exits 1 when its head does not start, or the nodes have not all joined within
:data:`JOIN_TIMEOUT_ENV` seconds (default 900: it says how many did), or one gave up first; a node
whose ``ray start`` ends before the script exits 1. A Python without Ray is a
:class:`~trainer_pkg.config.ConfigError` (exit 2) that says to add ``ray[train]`` to the requirements.

Not for Ray jobs: the hang watch, the network preflight and the hardware samples of a torch job
(they find the ranks by torchrun's variables; Ray starts its own workers).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Iterator, Mapping

from trainer_pkg import hardware
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.frameworks import setting_seconds
from trainer_pkg.launch import _RANK_VARS, UserScript, _script_pythonpath, _with_trainboard_env
from trainer_pkg.metrics import print_line, report_error
from trainer_pkg.platforms import LAUNCHED_BY_US, LaunchPlan, _visible_gpus

NUM_WORKERS_ENV = "TRAINBOARD_RAY_NUM_WORKERS"
"""The script's Ray Train worker count: nodes × processes per node (``ScalingConfig(num_workers=...)``)."""
NNODES_ENV = "TRAINBOARD_NNODES"
"""The job's node count, for the script."""
NPROC_ENV = "TRAINBOARD_NPROC_PER_NODE"
"""The job's processes per node (GPUs per node on a GPU machine), for the script."""
USE_GPU_ENV = "TRAINBOARD_RAY_USE_GPU"
"""``1`` when node 0 sees a GPU (``ScalingConfig(use_gpu=...)``), else ``0``."""
TAG_ENV = "TRAINBOARD_RAY_NODE"
"""A value unique to one node's launcher, in the environment of each Ray process it starts: how a
process that left ``ray start``'s session is still found and stopped."""
JOIN_TIMEOUT_ENV = "TRAINBOARD_RAY_JOIN_TIMEOUT_S"
"""Seconds node 0 waits for its head and every other node to join (the others: for the head)."""
STOP_GRACE_ENV = "TRAINBOARD_RAY_STOP_GRACE_S"
"""Seconds the script has after SIGTERM before it is killed."""
DEFAULT_JOIN_TIMEOUT_S = 900.0
DEFAULT_STOP_GRACE_S = 30.0
LEAVE_TIMEOUT_S = 60.0
"""Seconds node 0 waits, after the script, for the other nodes to stop their Ray processes (so its
head, which they talk to, goes last)."""
FORBIDDEN_PORTS = frozenset({6379})
"""Never chosen: Ray's default GCS port, where Redis runs on many machines."""
POLL_S = 0.2
RAY_DEFAULTS = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "RAY_COLOR_PREFIX": "0",
                "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
"""Ray settings a job gets unless its environment sets them: no usage report to Ray's servers,
every worker's line in the log as printed (not folded into "[repeated 3x across cluster]"), no ANSI
colours in the log, and a Ray Train worker's ``print`` left as Python's (Ray Train 2.60 also sends
it through its logger, and the job's log got every printed line twice)."""
_AGENT_VARS = (LAUNCHED_BY_US, "ROLE_NAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
"""What torchrun (or our launcher) sets for its ranks beside :data:`trainer_pkg.launch._RANK_VARS` and the
``TORCHELASTIC_*`` variables; none of it reaches a Ray process."""
_STORE_PREFIX = "trainboard-ray"
_MAX_TEMP_DIR = 40  # Ray's sockets live under <temp-dir>/session_<date>_<pid>/sockets/: 107 bytes at most


def run(cfg: JobConfig, plan: LaunchPlan, script: UserScript, *, hardware_every_s: float) -> int:
    """Run ``script`` as the driver of a Ray cluster over ``plan``'s nodes (see the module docstring)
    and wait for it; stop every Ray process of this node by PID before returning.

    ``hardware_every_s`` is not used: :mod:`trainer_pkg.hardware` finds a node's ranks by torchrun's
    ``RANK`` in their environment, and Ray's workers set theirs only once they run (no samples).

    Returns node 0's script's exit code there (128 + N when signal N ended it), 0 on the other nodes
    once node 0's script ended, 1 when the cluster could not form or this node's Ray processes died,
    128 + N on a node stopped by signal N before the script ended. Raises :class:`ConfigError` when
    this Python has no ``ray`` package or a timeout variable is not a number > 0.
    """
    local_rank = os.environ.get("LOCAL_RANK", "0") if plan.in_process else "0"
    if local_rank != "0":
        print_line(f"[ray] local rank {local_rank} of node_rank {plan.node_rank}: Ray starts its own workers "
                   "from local rank 0's node; nothing to run here")
        return 0
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"code.framework ray: this job's Python ({sys.executable}) has no ray package; add "
                          "ray[train] (pinned, e.g. ray[train]==2.60.0) to the code's requirements.txt or use an "
                          "image that has it")
    join_s = setting_seconds(os.environ, JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT_S)
    grace_s = setting_seconds(os.environ, STOP_GRACE_ENV, DEFAULT_STOP_GRACE_S)
    node = _Node(cfg, plan, script, join_s=join_s, grace_s=grace_s)
    with _stop_on_signals() as stopped:
        try:
            return node.run_head(stopped) if plan.node_rank == 0 else node.run_worker(stopped)
        finally:
            node.close()


class _Stop:
    """Set by SIGTERM/SIGINT (the signal's number kept); the launcher's main thread waits on it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum = 0

    def __bool__(self) -> bool:
        return self.event.is_set()


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[_Stop]:
    stop = _Stop()

    def handler(signum, frame) -> None:
        stop.signum = stop.signum or signum
        stop.event.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class _Failed(Exception):
    """The cluster could not form or a Ray process died: the message is the job's failure reason."""


class _Node:
    """This node's part of the job: its ``ray start``, the script (node 0), the store, the cleanup."""

    def __init__(self, cfg: JobConfig, plan: LaunchPlan, script: UserScript, *, join_s: float,
                 grace_s: float) -> None:
        self.cfg, self.plan, self.script = cfg, plan, script
        self.join_s, self.grace_s = join_s, grace_s
        self.who = f"[ray node {plan.node_rank}]"
        self.tag = uuid.uuid4().hex
        self.temp_dir = _short_temp_dir()
        # Ray makes its --temp-dir world-writable (shared between users, it says): one level down, so
        # this node's private directory keeps every other uid (another job's, on a GPU box) out.
        self.ray_dir = os.path.join(self.temp_dir, "r")
        self.host = plan.master_addr or "127.0.0.1"
        self.ray: subprocess.Popen | None = None
        self.driver: subprocess.Popen | None = None
        self.store = None  # torch.distributed.Store when nnodes > 1
        self.env = self._base_env(os.environ)

    # -- environment and commands ---------------------------------------------------------------

    def _base_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """Every Ray process's environment (and the script's, before its own variables)."""
        # No rank's variables: the driver is no rank, and Ray Train sets its workers' own. Nor torchrun's
        # agent's: with its TORCHELASTIC_USE_AGENT_STORE=True, Ray Train's rank 0 waited for an agent
        # store that nobody hosts, and every worker hung in init_process_group.
        out = {k: v for k, v in env.items()
               if k not in _RANK_VARS and k not in _AGENT_VARS and not k.startswith("TORCHELASTIC_")}
        out = _with_trainboard_env(out, self.cfg)
        out.update(self.plan.extra_env)
        out["PYTHONPATH"] = _script_pythonpath(out, self.script)
        out["PYTHONUNBUFFERED"] = "1"
        for name, value in RAY_DEFAULTS.items():
            out.setdefault(name, value)
        out[TAG_ENV] = self.tag
        out.pop(hardware.SAMPLED_ENV, None)
        return out

    def _ray_start(self, *, head_port: int | None, address: str | None) -> list[str]:
        """``ray start ... --block`` for the head (``head_port``) or a node joining ``address``."""
        exclude = FORBIDDEN_PORTS | {self.plan.master_port}
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--temp-dir", self.ray_dir,
               "--disable-usage-stats", "--log-color", "false", "--min-worker-port", "0", "--max-worker-port", "0"]
        if head_port is not None:
            client, dashboard, agent = free_ports(3, exclude=exclude | {head_port})
            cmd += ["--head", "--port", str(head_port), "--ray-client-server-port", str(client),
                    "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
                    "--dashboard-agent-listen-port", str(agent)]
            ip = _local_address(self.host)
            if ip:  # what the other nodes reach node 0 at; on loopback Ray picks the node's address itself
                cmd += ["--node-ip-address", ip]
        else:
            (agent,) = free_ports(1, exclude=exclude)
            cmd += ["--address", address, "--dashboard-agent-listen-port", str(agent)]
        return cmd

    def _start_ray(self, cmd: list[str]) -> None:
        """Start ``cmd`` in a session of its own (every Ray process it starts inherits the session),
        its output printed with this node's prefix."""
        self.ray = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=_pump, args=(self.ray.stdout, self.who), daemon=True).start()

    def _wait_ray_ready(self, stop: _Stop, deadline: float) -> None:
        """Until ``ray start`` has written its address file (it does so once its node is up)."""
        ready = os.path.join(self.ray_dir, "ray_current_cluster")
        while not os.path.exists(ready):
            self._check(stop, deadline, "its Ray node to start")
            stop.event.wait(POLL_S)

    def _check(self, stop: _Stop, deadline: float, what: str) -> None:
        if stop:
            raise _Stopped()
        assert self.ray is not None
        if self.ray.poll() is not None:
            raise _Failed(f"ray start on node {self.plan.node_rank} exited with code {self.ray.returncode} "
                          f"(its output is above, prefixed {self.who})")
        if time.monotonic() > deadline:
            raise _Failed(f"node {self.plan.node_rank} waited {self.join_s:g} s for {what} "
                          f"({JOIN_TIMEOUT_ENV} sets how long)")

    # -- node 0 ---------------------------------------------------------------------------------

    def run_head(self, stop: _Stop) -> int:
        plan = self.plan
        deadline = time.monotonic() + self.join_s
        port = free_ports(1, exclude=FORBIDDEN_PORTS | {plan.master_port})[0]
        address = f"{self.host}:{port}"
        self.env["RAY_ADDRESS"] = address
        code = 1
        try:
            if plan.nnodes > 1:
                self.store = _open_store(plan, stop, deadline, master=True)
            self._start_ray(self._ray_start(head_port=port, address=None))
            self._wait_ray_ready(stop, deadline)
            print_line(f"{self.who} Ray head at {address} (temp dir {self.ray_dir})")
            if self.store is not None:
                self.store.set("head", address)
                joined = self._wait_count("joined", plan.nnodes - 1, stop, deadline, fail_on_left=True)
                if joined < plan.nnodes - 1:
                    raise _Failed(f"only {joined} of the {plan.nnodes - 1} other node(s) joined the Ray cluster "
                                  f"at {address} within {self.join_s:g} s ({JOIN_TIMEOUT_ENV} sets how long)")
            code = self._run_script(stop)
        except _Stopped:
            code = 128 + stop.signum
            print_line(f"{self.who} stopped by signal {stop.signum} before the script started")
        except _Failed as exc:
            report_error(str(exc))
            code = 1
        finally:
            if self.store is not None:
                with contextlib.suppress(Exception):
                    self.store.set("done", str(code))
                    # The other nodes stop their Ray processes first: they talk to this head.
                    self._wait_count("left", plan.nnodes - 1, _Stop(), time.monotonic() + LEAVE_TIMEOUT_S)
        return code

    def _run_script(self, stop: _Stop) -> int:
        plan = self.plan
        env = dict(self.env)
        env.update({NUM_WORKERS_ENV: str(plan.world_size), NNODES_ENV: str(plan.nnodes),
                    NPROC_ENV: str(plan.nproc_per_node), USE_GPU_ENV: "1" if _visible_gpus(env) else "0"})
        print_line(f"{self.who} {plan.nnodes} node(s) in the cluster; running {self.script.describe()} with "
                   f"RAY_ADDRESS={env['RAY_ADDRESS']} {NUM_WORKERS_ENV}={plan.world_size}")
        self.driver = subprocess.Popen([sys.executable, *self.script.argv()], env=env, cwd=self.script.code_dir,
                                       start_new_session=True)
        given_up = None
        while self.driver.poll() is None:
            if stop and given_up is None:
                print_line(f"{self.who} signal {stop.signum}: passed to the script ({self.grace_s:g} s to exit)")
                with contextlib.suppress(ProcessLookupError):
                    self.driver.send_signal(stop.signum)
                given_up = time.monotonic() + self.grace_s
            if given_up is not None and time.monotonic() > given_up:
                print_line(f"{self.who} the script did not exit within {self.grace_s:g} s; SIGKILL")
                kill_all(_session(self.driver.pid) | {self.driver.pid})
            elif self.ray is not None and self.ray.poll() is not None and given_up is None:
                report_error(f"the Ray head's ray start exited with code {self.ray.returncode} while the script "
                             "ran; stopping the script")
                given_up = time.monotonic() + self.grace_s
                with contextlib.suppress(ProcessLookupError):
                    self.driver.send_signal(signal.SIGTERM)
            stop.event.wait(POLL_S)
        code = self.driver.returncode
        return 128 - code if code < 0 else code

    # -- nodes 1 … n-1 --------------------------------------------------------------------------

    def run_worker(self, stop: _Stop) -> int:
        plan = self.plan
        deadline = time.monotonic() + self.join_s
        try:
            self.store = _open_store(plan, stop, deadline, master=False)
            address = self._wait_key("head", stop, deadline, "node 0's Ray head")
            if address is None:
                print_line(f"{self.who} node 0 ended before its Ray head started")
                return 0
            self.env["RAY_ADDRESS"] = address
            self._start_ray(self._ray_start(head_port=None, address=address))
            self._wait_ray_ready(stop, deadline)
            self.store.add("joined", 1)
            print_line(f"{self.who} joined the Ray cluster at {address}; waiting for node 0's script")
            while not self.store.check(["done"]):
                self._check(stop, float("inf"), "")
                stop.event.wait(1.0)
            print_line(f"{self.who} node 0's script ended (exit code {self.store.get('done').decode()})")
            return 0
        except _Stopped:
            print_line(f"{self.who} stopped by signal {stop.signum}")
            return 128 + stop.signum
        except _Failed as exc:
            report_error(str(exc))
            return 1
        except (RuntimeError, OSError) as exc:  # the store: node 0's launcher is gone
            report_error(f"node {plan.node_rank} lost node 0 ({plan.master_addr}:{plan.master_port}): {exc}")
            return 1
        finally:
            self.stop_ray()
            if self.store is not None:  # node 0 waits for every node's leaving (or gives up on joining)
                with contextlib.suppress(Exception):
                    self.store.add("left", 1)

    def _wait_key(self, key: str, stop: _Stop, deadline: float, what: str) -> str | None:
        """The store's ``key`` once set; None when node 0 announced ``done`` first."""
        assert self.store is not None
        while True:
            if self.store.check([key]):
                return self.store.get(key).decode()
            if self.store.check(["done"]):
                return None
            if stop:
                raise _Stopped()
            if time.monotonic() > deadline:
                raise _Failed(f"node {self.plan.node_rank} waited {self.join_s:g} s for {what} "
                              f"({JOIN_TIMEOUT_ENV} sets how long)")
            stop.event.wait(0.5)

    def _wait_count(self, key: str, count: int, stop: _Stop, deadline: float, *, fail_on_left: bool = False) -> int:
        """The counter ``key`` once it reaches ``count``, or its value at ``deadline``. With
        ``fail_on_left``: :class:`_Failed` as soon as a node has left (it cannot join any more)."""
        assert self.store is not None
        while True:
            value = self.store.add(key, 0)
            if value >= count or time.monotonic() > deadline:
                return value
            if fail_on_left and self.store.add("left", 0):
                raise _Failed(f"{self.store.add('left', 0)} node(s) gave up before all {self.plan.nnodes} nodes had "
                              "joined the Ray cluster; their errors are in their logs")
            if self.ray is not None:
                self._check(stop, float("inf"), "")
            elif stop:
                raise _Stopped()
            stop.event.wait(0.5)

    # -- the end --------------------------------------------------------------------------------

    def stop_ray(self) -> None:
        """SIGKILL every Ray process of this node (and the script's, if any is left) by PID.

        Not SIGTERM first: ``ray start --block`` then drains for up to 30 s and the GCS and raylet
        took longer than 10 s to act on it (Ray 2.60, measured); nothing of theirs is needed once
        the script has ended, and what the job keeps it wrote itself."""
        roots = [p.pid for p in (self.ray, self.driver) if p is not None]
        stopped = kill_all(set(roots), sessions=roots, tag=(TAG_ENV, self.tag))
        for proc in (self.ray, self.driver):
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        if stopped:
            print_line(f"{self.who} stopped {len(stopped)} Ray process(es) by PID")
        self.ray = self.driver = None

    def close(self) -> None:
        self.stop_ray()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class _Stopped(Exception):
    """SIGTERM/SIGINT arrived before the script started."""


def _pump(stream, prefix: str) -> None:
    """Print each line of ``stream`` (``ray start``'s output) with ``prefix``, until it closes."""
    with contextlib.suppress(ValueError, OSError):
        for raw in iter(stream.readline, b""):
            print_line(f"{prefix} {raw.decode('utf-8', 'replace').rstrip()}")


def _short_temp_dir() -> str:
    """A new private directory for Ray's files, short enough for its socket paths: under the
    temporary directory when that path is short, else under /tmp."""
    base = tempfile.gettempdir()
    if len(base) > _MAX_TEMP_DIR - 20:  # "/tbrayjob-", 8 characters and Ray's "/r"
        base = "/tmp"
    return tempfile.mkdtemp(prefix="tbrayjob-", dir=base)


def free_ports(count: int, *, exclude: frozenset[int] | set[int] = FORBIDDEN_PORTS) -> list[int]:
    """``count`` distinct TCP ports free on every address of this machine now (bound together, so
    never the same one twice), none in ``exclude`` nor :data:`FORBIDDEN_PORTS`."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            held.append(s)
            s.bind(("", 0))
            port = s.getsockname()[1]
            if port not in exclude and port not in FORBIDDEN_PORTS:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


def _local_address(host: str) -> str | None:
    """``host``'s IPv4 address when it is one of this machine's and not loopback (node 0's address
    as the platform names it: Ray advertises it to the other nodes); None otherwise."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return None
    if ip.startswith("127."):
        return None
    with socket.socket() as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return None
    return ip


def _open_store(plan: LaunchPlan, stop: _Stop, deadline: float, *, master: bool):
    """The job's :class:`torch.distributed.TCPStore` at ``MASTER_ADDR:MASTER_PORT`` (prefixed): node 0
    hosts it, unless torchrun's agent already does (``TORCHELASTIC_USE_AGENT_STORE``). A client waits
    for it until ``deadline``; a signal meanwhile raises :class:`_Stopped`."""
    from torch.distributed import PrefixStore, TCPStore  # only a job of several nodes needs it

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = master and not agent
    box: dict = {}

    def connect() -> None:
        try:
            box["store"] = TCPStore(plan.master_addr, plan.master_port, None, host,
                                    timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())),
                                    wait_for_workers=False)
        except Exception as exc:  # reported in the main thread
            box["error"] = exc

    # In a thread: a client's constructor retries in C++ until its timeout, deaf to our signals.
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    while thread.is_alive():
        if stop:
            raise _Stopped()
        stop.event.wait(POLL_S)
    if "error" in box:
        raise _Failed(f"node {plan.node_rank}: no store at {plan.master_addr}:{plan.master_port} "
                      f"({'hosting' if host else 'reaching'} it failed: {box['error']})")
    store = box["store"]
    store.set_timeout(datetime.timedelta(seconds=60))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"{_STORE_PREFIX}/{restart}", store)


# -- processes ------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) of ``pid`` from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[3])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _session(sid: int) -> set[int]:
    """Live processes in session ``sid``."""
    return {pid for pid, (state, _, s) in _table().items() if s == sid and state not in ("Z", "X")}


def _table() -> dict[int, tuple[str, int, int]]:
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                out[int(entry.name)] = stat
    return out


def _tagged(name: str, value: str) -> set[int]:
    """Live processes whose environment has ``name=value`` (readable ones: ours)."""
    needle = f"\0{name}={value}\0".encode()
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = b"\0" + f.read()
        except OSError:
            continue
        if needle in environ + b"\0" and _alive(int(entry.name)):
            found.add(int(entry.name))
    return found


def _members(roots: set[int], sessions: list[int], tag: tuple[str, str] | None) -> set[int]:
    """``roots``, their descendants, the members of ``sessions`` and the ``tag``-ged processes, alive."""
    table = _table()
    found = {pid for pid in roots if pid in table}
    found |= {pid for pid, (_, _, sid) in table.items() if sid in sessions}
    if tag is not None:
        found |= _tagged(*tag)
    grew = True
    while grew:  # descendants that started a session of their own
        more = {pid for pid, (_, ppid, _) in table.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    found.discard(os.getpid())
    return {pid for pid in found if table.get(pid, ("X",))[0] not in ("Z", "X")}


def kill_all(roots: set[int], *, sessions: list[int] = (), tag: tuple[str, str] | None = None,
             timeout_s: float = 10.0) -> set[int]:
    """SIGKILL ``roots``, their descendants, every process of ``sessions`` and every process tagged
    ``tag`` (a variable name and value), again for any that appear meanwhile (a raylet starting a
    worker), until none is left or ``timeout_s`` passes; returns the PIDs signalled."""
    signalled: set[int] = set()
    give_up = time.monotonic() + timeout_s
    while True:
        left = _members(roots, list(sessions), tag)
        if not left or time.monotonic() > give_up:
            return signalled
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        signalled |= left
        roots = set()  # a killed root's PID may be reused; its descendants are in ``left`` now
        wait_gone(left, timeout_s=max(0.1, give_up - time.monotonic()))


def wait_gone(pids: set[int], *, timeout_s: float) -> set[int]:
    """Wait until none of ``pids`` is alive (a zombie counts as gone) or ``timeout_s`` passes;
    the ones still alive."""
    give_up = time.monotonic() + timeout_s
    while True:
        left = {pid for pid in pids if _alive(pid)}
        if not left or time.monotonic() > give_up:
            return left
        time.sleep(0.05)

