"""One real ``celery worker -B`` per pytest process, lent in turn to every test that asks for a plain
worker (``celery_worker_process``, tests/conftest.py), instead of one started and stopped per test.

A plain worker is the default one: the default queues (:data:`workerkit.DEFAULT_QUEUES`), the default
environment (:func:`workerkit.worker_environment`) with the torch-free torchrun as its GPU box
interpreter (``TRAINBOARD_GPUBOX_PYTHON``: :func:`standins.torchrun_lite.python`), embedded beat. Tests that need another environment
or queues, or that kill or stop workers, start their own (``celery_worker_factory``, tests/faults).

What a borrowing test sees is what a worker of its own gave it: its own database rows (it is a
``transaction=True`` test; the flush after it finds the worker idle), an empty run root, an empty
broker, no process left by an earlier test, and :meth:`WorkerProcess.log` from its own start on.

- **Broker**: a redis-server of its own (:class:`PrivateRedis`: 127.0.0.1, a free port, no
  persistence). Nothing the other tests publish to ``REDIS_URL`` (a transaction=True test's
  ``submit_job`` on commit) reaches it, nothing it or its beat publishes reaches them, and their
  fixtures' ``FLUSHDB`` of ``REDIS_URL`` cannot delete its queue bindings.
- **Between tests it is paused**: it consumes no queue (remote control ``cancel_consumer``, then no
  ``BRPOP`` of it left waiting on the broker), no task
  is running, reserved or waiting for its ETA (the reserved and scheduled ones are revoked), and it
  holds no database session (``DATABASE_CONN_MAX_AGE=0``: it closes its connection after each task),
  so it can neither touch another test's rows nor hold a lock the flush needs. Its beat keeps sending
  the periodic tasks to its own broker, where nobody consumes them.
- **Lending** (:meth:`SharedWorker.lend`): started if it is not running; every message on its broker
  deleted (queues, unacked; kombu's ``_kombu.binding.*`` kept); ``add_consumer`` for each queue, until
  ``active_queues`` lists them all; this process publishes to its broker (:func:`workerkit.use_broker`).
- **Taking back** (:meth:`SharedWorker.take_back`): paused as above; every process of the test's runs
  (a live process whose command line or environment names the run root, outside the worker's session)
  SIGKILLed by PID until none is left; the run root's contents moved into the test's own directory
  (a failed test's runs can still be read there); this process's broker set back. A worker that does
  not become idle within :attr:`SharedWorker.idle_timeout_s` is stopped instead; the next lend starts
  a new one.
- At the end of the session it is stopped (SIGTERM, then SIGKILL), with its runs and its redis-server,
  and its database sessions are waited out before pytest-django drops the test database.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from polling import wait_for
from standins import torchrun_lite
from workerkit import (ALONGSIDE_KEYS, DEFAULT_QUEUES, WorkerProcess, live_processes_mentioning, session_of, start_worker,
                       use_broker, wait_for_sessions_to_close, worker_environment)


class PrivateRedis:
    """A ``redis-server`` on 127.0.0.1 and a free port, without persistence, its files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, attempts: int = 5) -> None:
        """Start it and wait until it answers PING (20 s); another free port is tried when the one
        picked was taken meanwhile. Raises RuntimeError after ``attempts`` failed starts."""
        import redis

        for _ in range(attempts):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            with open(self.directory / "redis.log", "ab") as log:
                self.proc = subprocess.Popen(
                    ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--daemonize", "no", "--dir", str(self.directory)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
            deadline = time.monotonic() + 20
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    if client.ping():
                        self.url = f"redis://127.0.0.1:{port}/0"
                        return
                except redis.exceptions.ConnectionError:
                    time.sleep(0.05)
            self.stop()
        raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}")

    def delete_messages(self) -> int:
        """Delete every key but kombu's queue bindings (``_kombu.binding.*``): the queued messages,
        the unacked ones, the undeliverable ones. Returns how many keys were deleted."""
        import redis

        client = redis.Redis.from_url(self.url)
        try:
            keys = [k for k in client.scan_iter(count=1000) if not k.startswith(b"_kombu.binding.")]
            return client.delete(*keys) if keys else 0
        finally:
            client.close()

    def wait_for_no_blocked_pop(self, timeout: float = 10) -> None:
        """Wait until no client of this server is blocked in ``BRPOP``; TimeoutError otherwise.

        A worker that has cancelled its consumers issues no new ``BRPOP``, but the one it sent before
        (kombu's ``brpop_timeout``, 1 s) still pops the next message that arrives; kombu then
        requeues it ("no consumers"), so for a moment it is on neither side. Once no ``BRPOP`` waits,
        a message sent stays on its queue."""
        import redis

        client = redis.Redis.from_url(self.url)
        try:
            deadline = time.monotonic() + timeout
            while any(c.get("cmd") == "brpop" and "b" in c.get("flags", "") for c in client.client_list()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a BRPOP still waits on {self.url} after {timeout:g} s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class SharedWorker:
    """The pytest process's shared worker (see the module's docstring); ``directory`` holds its log,
    beat schedule, var dir, redis-server files and the run root (``directory/runs``). Needs the
    test database set up (pytest-django's ``django_db_setup``) before :meth:`lend`."""

    queues = DEFAULT_QUEUES
    ready_timeout_s = 90.0
    """How long a start waits for " ready." in the log."""
    idle_timeout_s = 120.0
    """How long :meth:`take_back` waits for the tasks still running (a submit's time limit is 150 s;
    a sync's 45 s) before it stops the worker instead."""
    control_timeout_s = 5.0
    """How long one remote-control command waits for the worker's reply."""

    def __init__(self, directory: Path, repo_root: Path) -> None:
        self.directory = directory
        self.repo_root = repo_root
        self.run_root = directory / "runs"
        self.run_root.mkdir(parents=True, exist_ok=True)
        # The worker's TRAINBOARD_VAR_DIR is directory/worker-var: its code store (a job's archive is
        # read from there), where a test's own uploads must go (settings.TRAINBOARD_CODE_STORE).
        self.code_store = directory / "worker-var" / "code"
        self.redis = PrivateRedis(directory)
        self.worker: WorkerProcess | None = None
        self.node = ""
        self._saved_broker: tuple[str, dict] | None = None

    # -- lending ----------------------------------------------------------------------------

    def lend(self) -> WorkerProcess:
        """The worker, consuming its queues on an empty broker, for one test (a
        :class:`workerkit.WorkerProcess` whose ``log()`` starts here); this process publishes to
        its broker until :meth:`take_back`."""
        from webapp.celery import app

        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.stop()
            self.redis.start()
        if self.worker is None or self.worker.proc.poll() is not None:
            self.stop_worker()
            self._start()
        self.redis.delete_messages()
        try:
            self._resume()
        except (TimeoutError, OSError) as exc:  # no reply: one fresh worker, which consumes from its start
            self._note(f"not resumed ({exc}): stopped; starting another")
            self.stop_worker()
            self._start()
            self._resume()
        self._saved_broker = (app.conf.broker_url, dict(app.conf.broker_transport_options or {}))
        use_broker(self.redis.url)
        return WorkerProcess(self.worker.proc, self.worker.log_path, self.redis.url, self.run_root, self.worker.env,
                             full_env=self.worker.full_env, cwd=self.repo_root,
                             log_start=self.worker.log_path.stat().st_size)

    def take_back(self, runs_dest: Path) -> None:
        """Pause the worker, kill what the test's runs left running (by PID), move the run root's
        contents into ``runs_dest`` (made if missing) and set this process's broker back. A worker
        that does not become idle in time is stopped (the next :meth:`lend` starts another)."""
        try:
            if self.worker is not None and self.worker.proc.poll() is None:
                try:
                    self._pause()
                except Exception as exc:  # noqa: BLE001 - any failure to pause: a fresh worker next time
                    self._note(f"not paused ({exc}): stopped; the next test starts another")
                    self.stop_worker()
            self.kill_runs()
            runs_dest.mkdir(parents=True, exist_ok=True)
            for entry in list(self.run_root.iterdir()):
                shutil.move(str(entry), str(runs_dest / entry.name))
        finally:
            if self._saved_broker is not None:
                use_broker(*self._saved_broker)
                self._saved_broker = None

    # -- starting and stopping --------------------------------------------------------------

    def _start(self) -> None:
        from django.db import connection

        var_dir = self.directory / "worker-var"
        var_dir.mkdir(exist_ok=True)
        # A paused worker must hold no database session: others wait for every session to end
        # (workerkit.wait_for_sessions_to_close) before they flush or drop the test database.
        # Its GPU box jobs run the real launcher and trainer under the torch-free torchrun
        # (standins.torchrun_lite): these tests' subject is the job's lifecycle, not torchrun. The GPU box
        # jobs of the workers tests start themselves (celery_worker_factory) and of the compose stack
        # keep torch's own torchrun.
        env = worker_environment(settings_dict=connection.settings_dict, broker_url=self.redis.url,
                                 run_root=self.run_root, var_dir=var_dir, repo_root=self.repo_root,
                                 extra={"DATABASE_CONN_MAX_AGE": "0",
                                        "TRAINBOARD_GPUBOX_PYTHON": torchrun_lite.python()})
        self.node = f"tbshared-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
        start = self.directory / "worker.log"
        offset = start.stat().st_size if start.exists() else 0
        proc, log_path = start_worker(self.directory, env, self.repo_root, self.queues, node=self.node)
        self.worker = WorkerProcess(proc, log_path, self.redis.url, self.run_root,
                                    {k: env[k] for k in ALONGSIDE_KEYS}, full_env=env,
                                    cwd=self.repo_root, log_start=offset)
        self.worker.wait_for(lambda: " ready." in self.worker.log(), timeout=self.ready_timeout_s,
                             what="the shared Celery worker to be ready")

    def stop_worker(self) -> None:
        """Stop the worker (SIGTERM, then SIGKILL after its grace), if one runs."""
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    def stop(self) -> None:
        """Stop the worker, every process of its runs, and its redis-server."""
        self.stop_worker()
        self.kill_runs()
        self.redis.stop()

    def close(self, django_db_blocker=None) -> None:
        """At the end of the session: :meth:`stop`, then wait until its database sessions have ended."""
        from django.db import connection

        self.stop()
        if django_db_blocker is not None:
            with django_db_blocker.unblock():
                wait_for_sessions_to_close(connection)

    def kill_runs(self, timeout: float = 10) -> None:
        """SIGKILL, by PID, every live process that names the run root (supervisors, torchrun,
        ranks) and is not the worker's own (its session), until none is left."""
        worker_pid = self.worker.proc.pid if self.worker is not None and self.worker.proc.poll() is None else None
        deadline = time.monotonic() + timeout
        while True:
            pids = [p for p in live_processes_mentioning(str(self.run_root))
                    if worker_pid is None or session_of(p) != worker_pid]
            if not pids:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"processes of the shared worker's runs outlived SIGKILL: {pids}")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    # -- remote control ---------------------------------------------------------------------

    @contextlib.contextmanager
    def controlling(self):
        """A Celery app of its own on the worker's broker and a connection to it, for remote control.
        Its own, because ``app.control`` publishes through its app's producer pool (its app's
        broker) whatever connection it is given; new each time, because :func:`workerkit.use_broker`
        closes every kombu pool."""
        from celery import Celery

        controller = Celery("tbshared-control", broker=self.redis.url, set_as_current=False)
        try:
            with controller.connection_for_write() as conn:
                yield controller, conn
        finally:
            controller.close()

    def control(self, control, command: str, **arguments):
        """Send ``command`` to this worker alone (``control``: what :meth:`controlling` yields) and
        return its reply; TimeoutError if none comes in :attr:`control_timeout_s`."""
        controller, conn = control
        replies = controller.control.broadcast(command, arguments=arguments, destination=[self.node], connection=conn,
                                               reply=True, timeout=self.control_timeout_s)
        for reply in replies or []:
            if self.node in reply:
                return reply[self.node]
        raise TimeoutError(f"no reply from {self.node} to {command} within {self.control_timeout_s:g} s")

    def _wait_for_queues(self, control, wanted: set[str], timeout: float = 10) -> None:
        """Poll ``active_queues`` until the worker consumes exactly ``wanted``; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            consuming = {q["name"] for q in self.control(control, "active_queues")}
            if consuming == wanted:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.node} consumes {sorted(consuming)}, not {sorted(wanted)}")
            time.sleep(0.05)

    def _note(self, text: str) -> None:
        """Append ``text`` to the worker's log (what this harness did to it, for whoever reads it)."""
        with open(self.worker.log_path, "a") as log:
            log.write(f"\n[tests/sharedworker.py] {self.node}: {text}\n")

    def _resume(self) -> None:
        """Consume every queue again; TimeoutError when the worker does not answer or comply."""
        queues = self.queues.split(",")
        with self.controlling() as control:
            for queue in queues:
                self.control(control, "add_consumer", queue=queue)
            self._wait_for_queues(control, set(queues))

    def _pause(self) -> None:
        """Stop consuming, revoke what is reserved or scheduled, wait until no task runs and no
        ``BRPOP`` of the worker is still waiting on its broker."""
        self._pause_consumers()
        self.redis.wait_for_no_blocked_pop()

    def _pause_consumers(self) -> None:
        with self.controlling() as control:
            for queue in self.queues.split(","):
                self.control(control, "cancel_consumer", queue=queue)
            self._wait_for_queues(control, set())
            revoked: set[str] = set()
            deadline = time.monotonic() + self.idle_timeout_s
            while True:
                active = self.control(control, "active")
                reserved = [r["id"] for r in self.control(control, "reserved")]
                scheduled = [s["request"]["id"] for s in self.control(control, "scheduled")]
                waiting = [i for i in reserved + scheduled if i not in revoked]
                if waiting:
                    self.control(control, "revoke", task_id=waiting)
                    revoked.update(waiting)
                # A revoked reserved task leaves when the pool takes it, and is dropped without running;
                # a revoked ETA task stays scheduled until its ETA, then is dropped the same way.
                if not active and not reserved:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.node} still runs {[a.get('name') for a in active]} "
                                       f"after {self.idle_timeout_s:g} s")
                time.sleep(0.1)

