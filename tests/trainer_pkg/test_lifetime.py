"""A launcher killed outright (SIGKILL) takes its supervised child with it: the child gets the
parent-death signal (trainer_pkg.lifetime) instead of running on, reparented to init, in its own
session. ci20 found a Ray job's rank script alive after the job and the head had stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil

from trainer_helpers import REPO

# The middle process is the launcher's supervision as a rank runs it: _supervise starts the child in a
# session of its own (so a signal to the launcher's group does not reach it) and waits.
MIDDLE = textwrap.dedent("""
    import os, sys
    from trainer_pkg.launch import _supervise
    child = [sys.executable, "-c", "import os, time; print('CHILD', os.getpid(), flush=True); time.sleep(600)"]
    _supervise(child, dict(os.environ), None)
""")


def test_a_child_of_a_killed_launcher_gets_sigterm_and_ends():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        line = middle.stdout.readline()
        assert line.startswith("CHILD "), line
        child = psutil.Process(int(line.split()[1]))
        assert child.ppid() == middle.pid and os.getsid(child.pid) == child.pid  # its own session
        middle.send_signal(signal.SIGKILL)
        middle.wait(timeout=30)
        # Not our child, so no exit status to read: that it is gone within the wait is the assertion.
        child.wait(timeout=30)
        assert not child.is_running()
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()
        if child is not None and child.is_running():
            child.kill()
