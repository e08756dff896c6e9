"""A TensorFlow script (``code.framework: tensorflow``): one TF worker process per rank of the job,
``TF_CONFIG`` written by this launcher, and a watchdog so a cluster that cannot form fails instead of
hanging (issue 33; docs/user-code.md, "TensorFlow").

    python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2   # 2 workers here
    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.launch --config job.json # the GPU box: same

How many workers: one per rank the launcher works out for the platform (nodes × processes per node,
:class:`~trainer_pkg.platforms.LaunchPlan`): ``parallel.procs_per_node`` on CPU machines, one per GPU
where the platform counts GPUs. A worker on a machine with a GPU for each of its local workers sees only
its own (``CUDA_VISIBLE_DEVICES``); with ``procs_per_node`` 1 on CPU nodes, or fewer GPUs than workers,
a worker sees what the node gives. ``MultiWorkerMirroredStrategy`` takes the cluster from
``TF_CONFIG``; every worker runs the same script.

Where ``TF_CONFIG`` comes from:

* The platform's own, passed through unchanged, when the environment has one (Vertex AI sets it on
  every replica; Azure ML's ``tensorflow`` distribution on every worker): this process runs that one
  worker. :func:`platform_tf_config` checks it.
* Otherwise written here: every launcher of the job (one per node, or one per rank where the platform
  or the GPU box's torchrun started the ranks: ``plan.in_process``) chooses a free TCP port for each of
  its workers on the address it reaches the rendezvous from (:func:`advertised_host`), and the launchers
  trade their ``host:port`` lists through a ``torch.distributed.TCPStore`` at the job's rendezvous
  (``MASTER_ADDR:MASTER_PORT``: hosted by node 0's launcher, or the GPU box's torchrun agent, which
  already serves one there; :class:`Peers`). Worker *i* of the job is ``task.index`` *i* of
  ``cluster.worker`` (:func:`written_tf_config`); worker 0 is the chief. A job of one launcher (one
  node that starts all its workers itself) needs no store: its workers are on 127.0.0.1.

Each worker gets ``TF_CONFIG``, Trainboard's variables (as a torch script does) and ``RANK`` (its
index: the chief is 0, so :func:`trainer_pkg.report.log` prints from it alone), ``WORLD_SIZE``,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; no ``MASTER_ADDR``/``MASTER_PORT`` (not TensorFlow's).

The watchdog (:class:`_Supervisor`): a TF worker whose peer never starts waits in the strategy's
set-up and does not stop on SIGTERM, so the launcher decides, polling every :data:`POLL_S` s:

* the cluster forms when every worker in ``TF_CONFIG`` accepts a TCP connection on its port; not
  within ``TRAINBOARD_TF_CLUSTER_DEADLINE_S`` seconds (default 600) of the launcher's start (the
  exchange of addresses included) fails the job, naming the workers that never listened, or the
  launchers that never reached the rendezvous;
* a worker that exits with a code other than 0 fails the job, and tells the other launchers (the
  store's ``failed`` key), which stop theirs; the reason names the worker, its exit code and, when it
  ended on an uncaught exception, where the user's code raised it (``train.py:12 in load: ValueError:
  bad shard 7``, written by :mod:`trainer_pkg.rank_entry`), so it is that worker's error and not a
  peer's consequence that the job shows;
* stopping a worker: SIGTERM, then SIGKILL after ``TRAINBOARD_TF_GRACE_S`` seconds (default 10), each
  by PID; a worker also gets SIGKILL from the kernel should its launcher die first
  (``PR_SET_PDEATHSIG``).

Both settings are the installation's, read from the launcher's environment (a job may not set
``TRAINBOARD_*`` variables; a GPU box passes the worker's through its ``env_passthrough``).

The reason is printed as ``trainer error: ...``, left as a ``failed`` record in ``metrics.jsonl`` by
the launcher holding worker 0 (so the job's failure reason is it, :func:`trainer_pkg.launch.failure_message`)
and written where the platform shows failures (SageMaker's ``/opt/ml/output/failure``). SIGTERM or
SIGINT to the launcher (a cancel) stops the workers the same way; the exit code is 0 when they all exit
0, else 128 + the signal.

Exit codes: 0 when every worker of this launcher exited 0; a failed worker's own code (128 + N for
signal N); 1 when a peer failed or the cluster did not form; 2 for a garbled ``TF_CONFIG`` or setting
(:class:`~trainer_pkg.config.ConfigError`, which the launcher reports).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Mapping, Sequence

from trainer_pkg import hardware
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.frameworks import setting_seconds
from trainer_pkg.launch import (
    _SCRIPT_ENTRY, LAUNCHED_BY_US, UserScript, _RANK_VARS, _script_pythonpath, _with_trainboard_env,
    _write_failure, watch_for_hangs,
)
from trainer_pkg.lifetime import die_with_parent
from trainer_pkg.metrics import encode_record, format_metric_line, print_line, report_error
from trainer_pkg.platforms import LaunchPlan, _visible_gpus
from trainer_pkg.rank_entry import ERROR_FILE_ENV

TF_CONFIG = "TF_CONFIG"
DEADLINE_ENV = "TRAINBOARD_TF_CLUSTER_DEADLINE_S"
"""Seconds the TF cluster has to form (every worker listening) before the job fails."""
DEFAULT_DEADLINE_S = 600.0
GRACE_ENV = "TRAINBOARD_TF_GRACE_S"
"""Seconds between SIGTERM and SIGKILL when the launcher stops its workers."""
DEFAULT_GRACE_S = 10.0
POLL_S = 0.5
"""How often the watchdog looks at its workers, the peers' ``failed`` key and the cluster's ports (s)."""
STORE_PREFIX = "trainboard-tf"
"""The keys of this module in a shared store (the GPU box's torchrun agent serves torch's own too)."""
_TASK_TYPES = ("chief", "master", "worker")
"""The task types that train under MultiWorkerMirroredStrategy, in rank order (``ps`` and
``evaluator`` tasks are the platform's business: they are not part of the cluster this watchdog waits for)."""


# -- TF_CONFIG ------------------------------------------------------------------------------------


def platform_tf_config(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The ``TF_CONFIG`` the platform set (Vertex AI; Azure ML's ``tensorflow`` distribution), parsed,
    or None when the environment has none (the launcher writes one).

    Shape (TensorFlow's, AI Platform's "TF_CONFIG and distributed training"): ``{"cluster": {"chief":
    ["host:port"], "worker": ["host:port", ...], ...}, "task": {"type": "worker", "index": 1}, ...}``;
    other keys (Vertex's ``environment``, ``job``) are kept. Raises :class:`ConfigError` naming
    ``TF_CONFIG`` when it is not JSON, lacks ``cluster``/``task``, an address is not ``host:port`` or the
    task is not one of the cluster's."""
    raw = env.get(TF_CONFIG, "")
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{TF_CONFIG} is not valid JSON: {exc} (value {raw[:200]!r})") from None
    if not isinstance(value, dict) or not isinstance(value.get("cluster"), dict) \
            or not isinstance(value.get("task"), dict):
        raise ConfigError(f"{TF_CONFIG} must be an object with 'cluster' and 'task', got {raw[:200]!r}")
    for kind, addresses in value["cluster"].items():
        if not isinstance(addresses, list) or not all(_is_address(a) for a in addresses):
            raise ConfigError(f"{TF_CONFIG} cluster.{kind} must be a list of 'host:port', got {addresses!r:.200}")
    kind, index = value["task"].get("type"), value["task"].get("index")
    members = value["cluster"].get(kind) if isinstance(kind, str) else None
    if members is None or isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(members):
        raise ConfigError(f"{TF_CONFIG} task {value['task']!r:.200} is not a task of its cluster "
                          f"({', '.join(f'{k}: {len(v)}' for k, v in value['cluster'].items())})")
    return value


def _is_address(text: Any) -> bool:
    if not isinstance(text, str):
        return False
    host, sep, port = text.rpartition(":")
    return bool(host) and bool(sep) and port.isdigit() and 0 < int(port) < 65536


def written_tf_config(workers: Sequence[str], index: int) -> dict[str, Any]:
    """The ``TF_CONFIG`` of worker ``index`` (0-based) of ``workers`` (``host:port`` each, in rank
    order): ``{"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}``. Raises
    ValueError when ``index`` is not one of them."""
    if not 0 <= index < len(workers):
        raise ValueError(f"worker index {index} is not below the {len(workers)} worker(s)")
    return {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}}


def training_tasks(tf_config: Mapping[str, Any]) -> list[tuple[str, int, str]]:
    """The tasks of ``tf_config`` that train, in rank order — ``chief``/``master`` first, then the
    ``worker`` list — as ``(type, index, "host:port")``."""
    cluster = tf_config["cluster"]
    return [(kind, i, address) for kind in _TASK_TYPES for i, address in enumerate(cluster.get(kind, []))]


def task_rank(tf_config: Mapping[str, Any]) -> tuple[int, int]:
    """(this task's rank, the number of training tasks) in :func:`training_tasks`' order: Vertex's
    ``chief`` is rank 0 and its ``worker`` *i* rank 1 + *i*. A ``ps`` or ``evaluator`` task is
    rank -1 (it never reports metrics)."""
    tasks = training_tasks(tf_config)
    me = (tf_config["task"]["type"], tf_config["task"]["index"])
    ranks = [r for r, (kind, index, _) in enumerate(tasks) if (kind, index) == me]
    return (ranks[0] if ranks else -1), len(tasks)


def worker_env(env: Mapping[str, str], tf_config: Mapping[str, Any], *, local_rank: int,
               local_world: int) -> dict[str, str]:
    """``env`` for one TF worker: ``TF_CONFIG`` (JSON), ``RANK``/``WORLD_SIZE`` from
    :func:`task_rank`, ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``; torchrun's other variables dropped; with
    ``local_world`` > 1 and at least that many GPUs visible, ``CUDA_VISIBLE_DEVICES`` = this worker's
    one GPU (the ``local_rank``-th of those visible)."""
    out = {k: v for k, v in env.items() if k not in _RANK_VARS}
    rank, world = task_rank(tf_config)
    out.update({TF_CONFIG: json.dumps(tf_config, sort_keys=True), "RANK": str(rank),
                "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world)})
    if local_world > 1 and _visible_gpus(env) >= local_world:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(local_world)]
        out["CUDA_VISIBLE_DEVICES"] = ids[local_rank]
    return out


# -- the launchers' shape and their exchange ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """Where this launcher sits among the job's launchers."""

    members: int
    """Launchers in the job: nodes, or ranks where the platform started them (``plan.in_process``)."""
    member: int
    """This launcher's index (node rank, or RANK)."""
    workers: int
    """TF workers this launcher starts (processes per node, or 1 per rank)."""
    master_addr: str
    """The rendezvous host ("" for a job of one launcher)."""
    master_port: int
    """The rendezvous port (0 for a job of one launcher)."""
    hosts_store: bool
    """Whether this launcher serves the store (node 0's; never under torchrun, whose agent serves one)."""
    unit: str = "node"
    """What a member is, for messages: ``node`` or ``rank``."""


def launch_shape(plan: LaunchPlan, env: Mapping[str, str]) -> Shape:
    """This launcher's :class:`Shape` from ``plan`` (and, for ranks started by torchrun or the
    platform, ``RANK``/``WORLD_SIZE``/``MASTER_*`` in ``env``, which the plan's reader checked)."""
    if plan.in_process:
        members, member = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # as torch.distributed.rendezvous decides
        return Shape(members, member, 1, env.get("MASTER_ADDR", plan.master_addr),
                     int(env.get("MASTER_PORT", plan.master_port) or 0), hosts_store=member == 0 and not agent,
                     unit="rank")
    return Shape(plan.nnodes, plan.node_rank, plan.nproc_per_node, plan.master_addr, plan.master_port,
                 hosts_store=plan.node_rank == 0)


_LOOPBACK = ("", "localhost", "127.0.0.1", "::1")


def advertised_host(master_addr: str) -> str:
    """The address other machines reach this one at: the local address of the route to
    ``master_addr`` (a UDP socket's, which sends nothing; no name lookup of this host), 127.0.0.1
    when the rendezvous is local. Falls back to this host's name when no route is known."""
    if master_addr in _LOOPBACK:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now, for the workers' servers (held together while
    chosen, so they differ; released before the workers start)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Peers:
    """The launchers of one job talking through a ``torch.distributed.TCPStore`` at the rendezvous:
    their workers' addresses, a failure, and who is done. Keys live under :data:`STORE_PREFIX` and the
    torchrun restart count. One launcher alone has no store and every method is local."""

    def __init__(self, shape: Shape, store: Any | None, prefix: str):
        self.shape, self.store, self.prefix = shape, store, prefix

    @classmethod
    def connect(cls, shape: Shape, env: Mapping[str, str], timeout_s: float) -> "Peers":
        """Join (node 0: serve) the store at ``shape``'s rendezvous, waiting up to ``timeout_s`` for
        it to answer. Raises RuntimeError (torch's DistStoreError) when it does not."""
        prefix = f"{STORE_PREFIX}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        if shape.members == 1:
            return cls(shape, None, prefix)
        from torch.distributed import TCPStore  # only for a job of several launchers; torch is the trainer's

        store = TCPStore(shape.master_addr, shape.master_port, world_size=None, is_master=shape.hosts_store,
                         timeout=timedelta(seconds=max(timeout_s, 1.0)), wait_for_workers=False,
                         multi_tenant=True)
        return cls(shape, store, prefix)

    def exchange(self, mine: list[str], deadline: float, deadline_s: float) -> list[list[str]]:
        """Every launcher's worker addresses, indexed by member, once all have published theirs.
        Raises TimeoutError naming the members that had not by ``deadline`` (``time.monotonic()``;
        ``deadline_s`` after the launcher's start, as the message says), or another's failure."""
        if self.store is None:
            return [mine]
        self.store.set(f"{self.prefix}addr/{self.shape.member}", json.dumps(mine))
        keys = [f"{self.prefix}addr/{m}" for m in range(self.shape.members)]
        while not self.store.check(keys):
            failure = self.failure()
            if failure:
                raise TimeoutError(failure)
            if time.monotonic() >= deadline:
                missing = [m for m, k in enumerate(keys) if not self.store.check([k])]
                raise TimeoutError(f"the TensorFlow cluster did not form within {deadline_s:g} s: "
                                   f"{self.shape.unit}(s) {', '.join(map(str, missing))} never joined "
                                   f"the rendezvous at {self.shape.master_addr}:{self.shape.master_port}")
            time.sleep(POLL_S)  # a poll, not store.wait: a peer's failure must end the wait too
        return [json.loads(self.store.get(k)) for k in keys]

    def fail(self, reason: str) -> None:
        """Tell the other launchers the job failed (the first reason stays). Best effort."""
        if self.store is None:
            return
        try:
            self.store.compare_set(f"{self.prefix}failed", "", reason)
        except Exception:  # noqa: BLE001 (the store's host may be gone: nothing more to tell)
            pass

    def failure(self) -> str | None:
        """Another launcher's failure reason, or None. A store that stopped answering before this
        launcher was done means node 0's launcher is gone: that is a failure too."""
        if self.store is None:
            return None
        key = f"{self.prefix}failed"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception as exc:  # noqa: BLE001 (torch raises DistNetworkError/RuntimeError)
            return f"the rendezvous at {self.shape.master_addr}:{self.shape.master_port} stopped answering ({exc})"

    def done(self) -> None:
        """Say this launcher's workers all exited 0."""
        if self.store is not None:
            try:
                self.store.set(f"{self.prefix}done/{self.shape.member}", "1")
            except Exception:  # noqa: BLE001
                pass

    def wait_all_done(self, timeout_s: float) -> None:
        """The store's host waits (at most ``timeout_s``) until every launcher said done or one
        failed, so no launcher loses the store while it still finishes."""
        if self.store is None or not self.shape.hosts_store:
            return
        keys = [f"{self.prefix}done/{m}" for m in range(self.shape.members)]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.store.check(keys) and self.failure() is None:
            time.sleep(POLL_S)


# -- the workers and the watchdog -----------------------------------------------------------------


def _accepts(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except OSError:
        return False


class _Supervisor:
    """This launcher's workers, watched until they all exit 0 or the job fails (module docstring)."""

    def __init__(self, commands: list[tuple[list[str], dict[str, str]]], cwd: str, *, peers: Peers,
                 addresses: list[str], deadline: float, deadline_s: float, grace_s: float):
        self.commands, self.cwd, self.peers = commands, cwd, peers
        self.addresses, self.deadline, self.deadline_s, self.grace_s = addresses, deadline, deadline_s, grace_s
        self.procs: list[subprocess.Popen] = []
        self.signalled: list[int] = []
        self.error_dir = ""  # where each worker names its uncaught exception (trainer_pkg.rank_entry)

    def start(self) -> None:
        self.error_dir = tempfile.mkdtemp(prefix="tb-tf-errors-")
        for i, (cmd, env) in enumerate(self.commands):
            env = {**env, ERROR_FILE_ENV: os.path.join(self.error_dir, f"worker-{i}")}
            self.procs.append(subprocess.Popen(cmd, env=env, cwd=self.cwd, preexec_fn=die_with_parent(signal.SIGKILL)))

    def _error(self, i: int) -> str:
        """The line worker ``i`` wrote naming its uncaught exception; "" when it wrote none."""
        try:
            with open(os.path.join(self.error_dir, f"worker-{i}"), encoding="utf-8", errors="replace") as f:
                return f.read(2000).strip()
        except OSError:
            return ""

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def watch(self) -> tuple[int, str]:
        """Wait; (exit code, failure reason or "")."""
        formed = not self.addresses
        waiting = list(self.addresses)
        while True:
            codes = [p.poll() for p in self.procs]
            if self.signalled:
                self.stop()
                codes = [p.returncode for p in self.procs]
                return (0, "") if all(c == 0 for c in codes) else (128 + self.signalled[0], "")
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i, code = bad[0]
                code = 128 - code if code < 0 else code
                error = self._error(i)
                reason = (f"TensorFlow worker {self._rank(i)} (pid {self.procs[i].pid}) exited with code "
                          f"{code}{': ' + error if error else ''}; the job's other workers were stopped")
                self.peers.fail(reason)
                self.stop()
                return code, reason
            if all(c == 0 for c in codes):
                return 0, ""
            failure = self.peers.failure()
            if failure:
                self.stop()
                return 1, failure
            if not formed:
                waiting = [a for a in waiting if not _accepts(a)]
                formed = not waiting
                if not formed and time.monotonic() >= self.deadline:
                    reason = (f"the TensorFlow cluster did not form within {self.deadline_s:g} s "
                              f"({DEADLINE_ENV}): worker(s) {', '.join(waiting)} never started listening; "
                              "the job's workers were stopped")
                    self.peers.fail(reason)
                    self.stop()
                    return 1, reason
            time.sleep(POLL_S)

    def _rank(self, i: int) -> str:
        return self.commands[i][1].get("RANK", str(i))

    def stop(self) -> None:
        """SIGTERM every worker still running, SIGKILL those left after the grace period; each
        reaped (no process of ours is left)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + self.grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(end - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.error_dir:
            shutil.rmtree(self.error_dir, ignore_errors=True)


# -- the entry --------------------------------------------------------------------------------------


class ClusterError(Exception):
    """The launchers did not all reach the rendezvous in time (the message says who and where)."""


def cluster_configs(shape: Shape, env: Mapping[str, str], deadline_s: float) -> tuple[list[dict[str, Any]], Peers]:
    """The ``TF_CONFIG`` of each worker this launcher starts, in local rank order, and the
    :class:`Peers` it shares the job with: the platform's own ``TF_CONFIG`` for its one worker
    (:func:`platform_tf_config`), else one written for each of ``shape.workers`` workers from the
    ``host:port`` lists every launcher published at the rendezvous (ports chosen here,
    :func:`free_ports`). Blocks until every launcher of the job published, at most ``deadline_s``.

    Raises :class:`ClusterError` when one did not (or the rendezvous never answered), after telling
    the others; :class:`ConfigError` for a garbled ``TF_CONFIG``."""
    given = platform_tf_config(env)
    if given is not None:
        print_line(f"[launch] TensorFlow: the platform's {TF_CONFIG} (task {given['task']['type']} "
                   f"{given['task']['index']} of {len(training_tasks(given))} training task(s))")
        return [given], Peers(shape, None, STORE_PREFIX)
    deadline = time.monotonic() + deadline_s
    host = advertised_host(shape.master_addr) if shape.members > 1 else "127.0.0.1"
    mine = [f"{host}:{port}" for port in free_ports(host, shape.workers)]
    peers = Peers(shape, None, STORE_PREFIX)
    try:
        peers = Peers.connect(shape, env, deadline_s)
        everyone = peers.exchange(mine, deadline, deadline_s)
    except TimeoutError as exc:
        peers.fail(str(exc))
        raise ClusterError(str(exc)) from None
    except RuntimeError as exc:  # torch's DistStoreError/DistNetworkError: no store answered
        raise ClusterError(f"the TensorFlow cluster did not form: the rendezvous at {shape.master_addr}:"
                           f"{shape.master_port} did not answer within {deadline_s:g} s ({exc})") from None
    workers = [a for addresses in everyone for a in addresses]
    if shape.member == 0:
        print_line(f"[launch] TensorFlow: {len(workers)} worker(s), TF_CONFIG cluster.worker "
                   f"{json.dumps(workers)}")
    return [written_tf_config(workers, shape.member * shape.workers + i) for i in range(shape.workers)], peers


def run(cfg: JobConfig, plan: LaunchPlan, script: UserScript, *, hardware_every_s: float = 0.0) -> int:
    """Start this launcher's TF workers running ``script`` and watch them (module docstring); the exit
    code for this node or rank. Raises :class:`ConfigError` for a garbled ``TF_CONFIG`` or setting."""
    env = dict(os.environ)
    started = time.time()
    deadline_s = setting_seconds(env, DEADLINE_ENV, DEFAULT_DEADLINE_S)
    grace_s = setting_seconds(env, GRACE_ENV, DEFAULT_GRACE_S)
    deadline = time.monotonic() + deadline_s
    shape = launch_shape(plan, env)
    try:
        configs, peers = cluster_configs(shape, env, deadline_s)
    except ClusterError as exc:
        return _failed(cfg, plan, shape, str(exc), 1, started)

    base = _with_trainboard_env(env, cfg)
    for name in (LAUNCHED_BY_US, hardware.SAMPLED_ENV, "TRAINBOARD_PREFLIGHT"):
        base.pop(name, None)  # the network preflight is torch's all-reduce: not for TF workers
    base["PYTHONPATH"] = _script_pythonpath(base, script)
    addresses = [a for _, _, a in training_tasks(configs[0])]
    holds_rank0 = any(task_rank(c)[0] == 0 for c in configs)
    code, reason = 1, ""
    previous: dict[int, Any] = {}
    sampler = None
    supervisor = None
    try:
        # The hang watch of the launcher holding worker 0 (it names its directory in base).
        with watch_for_hangs(cfg, base, len(addresses), watching=holds_rank0):
            envs = [worker_env(base, c, local_rank=i, local_world=len(configs)) for i, c in enumerate(configs)]
            commands = [([sys.executable, *_SCRIPT_ENTRY, *script.argv()], e) for e in envs]
            supervisor = _Supervisor(commands, script.code_dir, peers=peers, addresses=addresses,
                                     deadline=deadline, deadline_s=deadline_s, grace_s=grace_s)
            previous = {s: signal.signal(s, lambda signum, frame: supervisor.signalled.append(signum))
                        for s in (signal.SIGTERM, signal.SIGINT)}
            supervisor.start()
            print_line(f"[launch] TensorFlow worker(s) of rank {', '.join(e['RANK'] for e in envs)} "
                       f"started: pid {', '.join(map(str, supervisor.pids()))}")
            sampler = hardware.start(os.getpid(), interval_s=hardware_every_s, env=env,
                                     node_rank=plan.node_rank, node_fields=env.get("LOCAL_RANK", "0") == "0")
            code, reason = supervisor.watch()
    finally:
        if supervisor is not None:
            supervisor.stop()  # on an exception too: no worker outlives its launcher
        if sampler is not None:
            sampler.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if reason:
        return _failed(cfg, plan, shape, reason, code, started, holds_rank0=holds_rank0)
    if code == 0:
        peers.done()
        peers.wait_all_done(grace_s + deadline_s)
    return code


def _failed(cfg: JobConfig, plan: LaunchPlan, shape: Shape, reason: str, code: int, started: float, *,
            holds_rank0: bool | None = None) -> int:
    """Report ``reason``: ``trainer error:`` on stderr, the platform's failure file, and — from the
    launcher holding worker 0 — a ``failed`` record in ``metrics.jsonl`` (the job's failure reason)."""
    report_error(reason)
    _write_failure(plan.failure_file, reason)
    if holds_rank0 is None:
        holds_rank0 = shape.member == 0
    if holds_rank0:
        record = {"event": "failed", "time": max(time.time(), started), "reason": reason}
        print_line(format_metric_line(record))
        try:
            os.makedirs(cfg.output.output_dir, exist_ok=True)
            with open(os.path.join(cfg.output.output_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(encode_record(record), sort_keys=True) + "\n")
        except OSError:
            pass  # the reason is on stderr and in the failure file
    return code
