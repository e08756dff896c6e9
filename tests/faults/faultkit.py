"""Helpers for the fault tests: start and SIGKILL real Celery workers (with beat) that know the
``faultcloud`` kind, against this test's database and a broker of the test's choosing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from polling import wait_for

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]

FAST_RECOVERY_ENV = {
    "TRAINBOARD_SYNC_INTERVAL_S": "1",
    "TRAINBOARD_RECOVERY_INTERVAL_S": "1",
    "TRAINBOARD_SUBMIT_TIME_LIMIT_S": "4",
    "TRAINBOARD_RECOVERY_REQUEUE_AFTER_S": "2",
}
"""Seconds, shrunk so one test sees several sweeps: a sweep every 1 s, a submission lease of 4 s."""


def database_url(settings_dict) -> str:
    user = settings_dict.get("USER") or ""
    password = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    return (f"postgres://{auth}{settings_dict.get('HOST') or '127.0.0.1'}:{settings_dict.get('PORT') or 5432}"
            f"/{settings_dict['NAME']}")



class Worker:
    """``celery worker -B`` as a subprocess in its own process group."""

    def __init__(self, *, tmp_path: Path, db_url: str, broker_url: str, env: dict[str, str] | None = None,
                 name: str = "w") -> None:
        self.log_path = tmp_path / f"worker-{name}-{uuid.uuid4().hex[:6]}.log"
        var_dir = tmp_path / "worker-var"
        var_dir.mkdir(exist_ok=True)
        full_env = dict(os.environ)
        full_env.update({
            "DJANGO_SETTINGS_MODULE": "webapp.settings",
            "DATABASE_URL": db_url,
            "REDIS_URL": broker_url,
            "TRAINBOARD_VAR_DIR": str(var_dir),
            "DJANGO_SECRET_KEY": "faults-test-secret-key-not-for-production",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(HERE)]),
            "PYTHONUNBUFFERED": "1",
            **FAST_RECOVERY_ENV,
            **(env or {}),
        })
        command = [sys.executable, str(HERE / "fault_worker.py"), "-A", "webapp", "worker", "-B",
                   "--scheduler", "celery.beat:PersistentScheduler",
                   "-s", str(tmp_path / f"beat-{uuid.uuid4().hex[:6]}"),
                   "-Q", "celery", "--pool", "prefork", "-c", "2", "-n", f"faults-{uuid.uuid4().hex[:8]}@%h",
                   "--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=REPO_ROOT, env=full_env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def ready(self, timeout: float = 90) -> "Worker":
        def check():
            if self.proc.poll() is not None:
                pytest.fail(f"worker exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            return " ready." in self.log()

        wait_for(check, timeout=timeout, what="the Celery worker to be ready")
        return self

    def kill(self) -> None:
        """SIGKILL the worker, its pool children and beat at once: no shutdown code runs."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()


def wait_for_sessions_to_close(connection, timeout: float = 10) -> None:
    """A killed worker's PostgreSQL sessions end a moment after it; the test database cannot be
    flushed until they do."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND pid <> pg_backend_pid() AND backend_type = 'client backend'")
            if cursor.fetchone()[0] == 0:
                return
        time.sleep(0.2)
