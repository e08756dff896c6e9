"""A Celery worker exits on SIGTERM within its grace period at any moment of its start-up.

Real ``celery -A webapp worker`` processes on the embedded default (SQLite and the filesystem broker
under their own ``TRAINBOARD_VAR_DIR``), as ``make demo`` runs them, each in a process group of its
own. SIGTERM goes to the whole group, as a terminal, a supervisor or ``kill -TERM -<pgid>`` sends it:
it reaches the idle pool processes too, which may hold the task queue's read lock, and the main
process must not then hang in its warm shutdown, ignoring SIGTERM and SIGQUIT (webapp/celery.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polling import wait_for
from workerkit import CeleryWorker

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]

# (moment, log line to wait for or None, seconds to wait after it)
MOMENTS = [
    ("while importing", None, 0.3),
    ("after the banner", "[tasks]", 0.0),
    ("connected to the broker", "Connected to", 0.0),
    ("just ready", " ready.", 0.0),
    # Idle: each pool process waits for work, one of them holding the queue's read lock.
    ("1 s after ready", " ready.", 1.0),
    ("2 s after ready", " ready.", 2.0),
    ("3.5 s after ready", " ready.", 3.5),
    ("5 s after ready", " ready.", 5.0),
]


@pytest.mark.parametrize("moment,marker,after_s", MOMENTS, ids=[m[0].replace(" ", "-") for m in MOMENTS])
def test_sigterm_to_the_group_stops_the_worker_within_its_grace_period(tmp_path, live_processes, moment, marker,
                                                                          after_s):
    var_dir = tmp_path / "var"
    var_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({"TRAINBOARD_VAR_DIR": str(var_dir), "DJANGO_SETTINGS_MODULE": "webapp.settings",
                "PYTHONUNBUFFERED": "1"})
    log_path = tmp_path / "worker.log"
    command = [sys.executable, "-m", "celery", "-A", "webapp", "worker", "-Q", "celery,gpubox.local",
               "--concurrency", "2", "--loglevel", "INFO"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    worker = CeleryWorker(proc, log_path)
    try:
        if marker is not None:
            worker.wait_for(lambda: marker in worker.log(), timeout=120, what=f"{marker!r} in the worker log")
        time.sleep(after_s)
        if marker == " ready.":
            assert len(live_processes(str(var_dir))) == 3, "the main process and 2 pool processes"
        os.killpg(proc.pid, signal.SIGTERM)
        started = time.monotonic()
        try:
            code = proc.wait(timeout=CeleryWorker.stop_grace_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGTERM {moment}: the worker still runs after {CeleryWorker.stop_grace_s:g} s:\n"
                        f"{worker.log()[-3000:]}")
        # Killed by the signal itself (before Celery installs its handler) or a warm shutdown (0).
        assert code in (0, -signal.SIGTERM), worker.log()[-3000:]
        wait_for(lambda: not live_processes(str(var_dir)), timeout=10,
                 what="the pool processes to exit with the worker")
        assert time.monotonic() - started < CeleryWorker.stop_grace_s
    finally:
        for pid in live_processes(str(var_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
