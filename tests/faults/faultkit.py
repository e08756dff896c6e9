"""Helpers for the fault tests: start and SIGKILL real Celery workers (with beat) that know the
``faultcloud`` kind, against this test's database and a broker of the test's choosing."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from polling import wait_for  # noqa: F401 (the fault tests import it from here)
from workerkit import CeleryWorker, database_url, wait_for_sessions_to_close  # noqa: F401 (likewise)

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]

FAST_RECOVERY_ENV = {
    "TRAINBOARD_SYNC_INTERVAL_S": "1",
    "TRAINBOARD_RECOVERY_INTERVAL_S": "1",
    "TRAINBOARD_SUBMIT_TIME_LIMIT_S": "4",
    "TRAINBOARD_RECOVERY_REQUEUE_AFTER_S": "2",
}
"""Seconds, shrunk so one test sees several sweeps: a sweep every 1 s, a submission lease of 4 s."""


class Worker(CeleryWorker):
    """``celery worker -B`` as a subprocess in its own process group."""

    stop_grace_s = 15.0

    def __init__(self, *, tmp_path: Path, db_url: str, broker_url: str, env: dict[str, str] | None = None,
                 name: str = "w") -> None:
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
        log_path = tmp_path / f"worker-{name}-{uuid.uuid4().hex[:6]}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(command, cwd=REPO_ROOT, env=full_env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        super().__init__(proc, log_path)

    def ready(self, timeout: float = 90) -> "Worker":
        self.wait_for(lambda: " ready." in self.log(), timeout=timeout, what="the Celery worker to be ready")
        return self
