"""Helpers for tests that run a real ``celery worker -B`` process against pytest-django's test
database: the database URL to hand it, the running process (its log, waiting on it, stopping it
with its pool children and beat) and waiting for its PostgreSQL sessions to end afterwards.

Used by the shared worker behind ``celery_worker_process`` (tests/sharedworker.py), the workers of
``celery_worker_factory`` (tests/conftest.py: module-wide ones, and the tests that start several),
the fault tests' workers (tests/faults/faultkit.py) and the worker-log secrets test
(tests/security/test_worker_secrets.py).

A worker shared by the tests of a module keeps syncing while pytest-django flushes the database
between them; :func:`install_flush_retry` makes that flush try again when it lost a lock race.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
import weakref
from pathlib import Path
from typing import Callable

import pytest
from django.core.management.base import CommandError

from fixture_report import count_start
from polling import wait_for


def database_url(settings_dict) -> str:
    """The ``DATABASE_URL`` of the database Django's ``settings_dict`` names (the test database)."""
    if "sqlite" in settings_dict["ENGINE"]:
        return f"sqlite:///{settings_dict['NAME']}"
    user = settings_dict.get("USER") or ""
    password = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or "5432"
    return f"postgres://{auth}{host}:{port}/{settings_dict['NAME']}"


def wait_for_sessions_to_close(connection, timeout: float = 10) -> None:
    """A stopped or killed worker's PostgreSQL sessions end a moment after the process; until they
    do the test database cannot be flushed or dropped ("being accessed by other users")."""
    if connection.vendor != "postgresql":
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
            if cursor.fetchone()[0] == 0:
                return
        time.sleep(0.2)


LOCK_CONFLICT_SQLSTATES = frozenset({"40P01", "55P03"})
"""PostgreSQL's deadlock_detected and lock_not_available: what a TRUNCATE of every table (the flush)
meets when a live worker's transaction holds one table and waits for another the TRUNCATE already took."""


def lost_a_lock_race(exc: BaseException) -> bool:
    """Whether ``exc`` (Django's CommandError "couldn't be flushed", or any error) was caused by a
    PostgreSQL deadlock or lock timeout: the ``sqlstate`` of psycopg's error anywhere in its chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "sqlstate", None) in LOCK_CONFLICT_SQLSTATES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_lock_conflicts(flush: Callable[[], object], *, attempts: int = 5, pause_s: float = 0.5,
                         tries: list | None = None) -> object:
    """Call ``flush`` until it does not fail with a lost lock race (:func:`lost_a_lock_race`), at
    most ``attempts`` times, pausing ``pause_s`` × the attempt number between; any other error, or
    the last attempt's, is raised. Each failed attempt's error is appended to ``tries`` if given."""
    for attempt in range(1, attempts + 1):
        try:
            return flush()
        except CommandError as exc:
            if attempt == attempts or not lost_a_lock_race(exc):
                raise
            if tries is not None:
                tries.append(exc)
            time.sleep(pause_s * attempt)
    raise AssertionError("unreachable")


def install_flush_retry() -> None:
    """Make a ``transaction=True`` test's teardown flush (``TransactionTestCase._fixture_teardown``)
    retry a lost lock race. Without it, a worker shared by a module's tests that writes a job's last
    log lines while the flush truncates can deadlock it, and the next test finds the last one's rows
    (seen in CI: "Database test_trainboard_gw1 couldn't be flushed", then a duplicate user)."""
    from django.test import TransactionTestCase

    original = TransactionTestCase._fixture_teardown
    if getattr(original, "retries_lock_conflicts", False):
        return

    def _fixture_teardown(self):
        retry_lock_conflicts(lambda: original(self))

    _fixture_teardown.retries_lock_conflicts = True
    TransactionTestCase._fixture_teardown = _fixture_teardown


def use_broker(url: str, transport_options: dict | None = None) -> None:
    """Make this process's Celery app publish to ``url`` with kombu ``transport_options`` (where a
    test's worker listens): its connection and producer pools are closed and forgotten."""
    from kombu import pools

    from webapp.celery import app

    options = dict(transport_options or {})
    if app.conf.broker_url == url and dict(app.conf.broker_transport_options or {}) == options:
        return
    pools.reset()  # close every cached connection/producer pool and forget them
    app._pool = None
    app.amqp._producer_pool = None
    app.conf.broker_url = url
    app.conf.broker_transport_options = options


def processes_mentioning(text: str) -> list[int]:
    """Pids (other than ours) whose command line or environment contains ``text``."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry}/{part}", "rb") as fh:
                    if text.encode() in fh.read():
                        found.append(int(entry))
                        break
            except OSError:
                continue
    return found


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, session, …
    ([] when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` is a zombie or gone."""
    fields = _stat_fields(pid)
    return not fields or fields[0] in (b"Z", b"X")


def session_of(pid: int) -> int | None:
    """The session id of ``pid`` (None when it is gone)."""
    fields = _stat_fields(pid)
    return int(fields[3]) if len(fields) > 3 else None


def live_processes_mentioning(text: str) -> list[int]:
    """:func:`processes_mentioning`, less zombies."""
    return [p for p in processes_mentioning(text) if not is_zombie(p)]


_COUNTED: "weakref.WeakSet[subprocess.Popen]" = weakref.WeakSet()
"""The worker processes already counted in the run's process starts (fixture_report.count_start)."""


class CeleryWorker:
    """A ``celery worker -B`` subprocess started in its own process group (``start_new_session``),
    its stdout and stderr in ``log_path``; :meth:`log` reads it from byte ``log_start`` on. The first
    object made for a process counts one ``celery worker`` start in the run's report
    (:func:`fixture_report.count_start`)."""

    stop_grace_s = 20.0
    """How long :meth:`stop` waits for a warm shutdown before it SIGKILLs what is left."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, log_start: int = 0) -> None:
        self.proc = proc
        self.log_path = log_path
        self.log_start = log_start
        if proc not in _COUNTED:  # a start, not another view of a running worker (the shared one's)
            _COUNTED.add(proc)
            count_start("celery worker")

    def log(self) -> str:
        """The worker's log (stdout and stderr) from byte ``log_start`` on; "" before it exists."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self.log_start)
                return fh.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for(self, predicate: Callable[[], object], *, timeout: float, what: str = "") -> object:
        """:func:`polling.wait_for`, failing at once (with the log's tail) if the worker exits."""
        def check():
            if self.proc.poll() is not None:
                pytest.fail(f"the Celery worker exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            return predicate()

        return wait_for(check, timeout=timeout, what=what)

    def kill(self) -> None:
        """SIGKILL the worker, its pool children and beat at once: no shutdown code runs."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM (warm shutdown of worker and beat), then SIGKILL whatever is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=self.stop_grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()


class WorkerProcess(CeleryWorker):
    """A running ``celery worker -B`` subprocess as a test sees it (``celery_worker_process``,
    ``celery_worker_factory``): ``broker_url`` it consumes from, the GPU box ``run_root`` it runs jobs
    under, ``env`` (``DATABASE_URL``, ``REDIS_URL``, … to run other processes, e.g. ``manage.py``,
    alongside it), ``full_env`` (its whole environment as it was started) and ``cwd``."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, broker_url: str, run_root: Path, env: dict,
                 full_env: dict | None = None, *, cwd: Path, log_start: int = 0):
        super().__init__(proc, log_path, log_start)
        self.broker_url = broker_url
        self.run_root = run_root
        self.env = env
        self.full_env = dict(full_env or {})
        self.cwd = cwd


ALONGSIDE_KEYS = ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL", "TRAINBOARD_RUN_ROOT",
                  "TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE", "TRAINBOARD_VAR_DIR", "DJANGO_SECRET_KEY", "PYTHONPATH")
"""The variables of a worker's environment that a test hands a process it runs beside the worker
(``manage.py submit_job``): :attr:`WorkerProcess.env`."""


def worker_environment(*, settings_dict, broker_url: str, run_root: Path, var_dir: Path, repo_root: Path,
                       extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a test's ``celery worker``: this process's, plus the test database
    (``settings_dict``: Django's, of the test database), the broker, the gpubox run root (2
    processes per node), a 1 s sync interval, its own ``TRAINBOARD_VAR_DIR`` and a fixed Django
    secret key, and ``extra`` over all of them; not this process's rank zygote socket."""
    env = dict(os.environ)
    # This pytest process's rank zygote (standins.rank_zygote) forks ranks for its own lite torchruns
    # only: a job the worker starts keeps its ranks in its own process tree, under its limits.
    env.pop("TRAINBOARD_TEST_RANK_ZYGOTE_SOCKET", None)
    env.update({
        "DJANGO_SETTINGS_MODULE": "webapp.settings",
        "DATABASE_URL": database_url(settings_dict),
        "REDIS_URL": broker_url,
        "TRAINBOARD_RUN_ROOT": str(run_root),
        "TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE": "2",
        "TRAINBOARD_SYNC_INTERVAL_S": "1",
        "TRAINBOARD_VAR_DIR": str(var_dir),
        "DJANGO_SECRET_KEY": "e2e-test-secret-key-not-for-production",
        "PYTHONPATH": os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


DEFAULT_QUEUES = "celery,notifications,gpubox.local"
"""The queues a test's worker consumes unless told otherwise: the default queue (the cloud backends'),
the notifications queue (webhook deliveries and emails, ``TRAINBOARD_NOTIFICATIONS_QUEUE``; a
deployment gives it a worker of its own) and the queue of the ``local`` GPU box of tests/conftest.py
(``GpuBoxBackend.queue_for``: each box has its own, ``gpubox.<name>``). A test whose GPU box has
another name passes its queue."""


def start_worker(directory: Path, env: dict[str, str], cwd: Path, queues: str = DEFAULT_QUEUES,
                 beat: bool = True, node: str | None = None) -> tuple[subprocess.Popen, Path]:
    """Start ``celery -A webapp worker -B -Q <queues>`` (prefork, 2 processes, a node name of its
    own) with ``env`` in its own session; its log and beat schedule go into ``directory``.
    ``queues``: comma-separated Celery queue names (``Backend.queue_for`` of the test's backends);
    ``beat``: False for a second worker beside one that runs beat (no ``-B``); ``node``: its node
    name (``name@host``; default ``tbtest-<random>@%h``), for remote control commands.
    Returns the process and its log's path; the caller waits for " ready." in the log."""
    log_path = directory / "worker.log"
    node = node or f"tbtest-{uuid.uuid4().hex[:8]}@%h"
    command = [
        sys.executable, "-m", "celery", "-A", "webapp", "worker",
        *(["-B", "--scheduler", "celery.beat:PersistentScheduler", "-s", str(directory / "beat-schedule")]
          if beat else []),
        "-Q", queues, "--pool", "prefork", "-c", "2", "-n", node,
        "--loglevel", "INFO", "--without-gossip", "--without-mingle",
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log_path
