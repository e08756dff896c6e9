"""webapp/hardening.py: a process that holds the installation's secrets hides its environment from
other processes of its own OS user (a GPU box's jobs run user code as the worker's user by default)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from webapp.hardening import is_dumpable

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's 3.11: the virtualenv's interpreter may lie under root's home (0700)
HOLDER = (  # loads webapp/hardening.py by its path: the package itself imports Celery and Django
    "import importlib.util, sys, time\n"
    "spec = importlib.util.spec_from_file_location('hardening', sys.argv[2])\n"
    "hardening = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(hardening)\n"
    "if sys.argv[1] == 'hide':\n"
    "    assert hardening.make_undumpable() is True\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
READER = (
    "import sys\n"
    "try:\n"
    "    data = open(f'/proc/{sys.argv[1]}/environ', 'rb').read()\n"
    "except PermissionError:\n"
    "    print('refused')\n"
    "else:\n"
    "    print('secret seen' if b'TB_TEST_SECRET=s3cret' in data else 'read, no secret')\n"
)


def _read_as_nobody(mode: str) -> str:
    """Start a process as uid 65534 with a secret in its environment (made undumpable when ``mode``
    is "hide"), then read its /proc/<pid>/environ from another uid-65534 process."""
    env = {"PATH": "/usr/bin:/bin", "TB_TEST_SECRET": "s3cret", "HOME": "/tmp"}
    holder = subprocess.Popen([SYSTEM_PYTHON, "-c", HOLDER, mode, str(ROOT / "webapp" / "hardening.py")], cwd="/", env=env, user=NOBODY, group=NOBODY,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        reader = subprocess.run([SYSTEM_PYTHON, "-c", READER, str(holder.pid)], cwd="/", user=NOBODY, group=NOBODY,
                                env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
        assert reader.returncode == 0, reader.stderr
        return reader.stdout.strip()
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_a_same_user_process_reads_the_environment_only_of_a_process_that_did_not_hide_it():
    assert os.geteuid() == 0, "the suite runs as root (README): both processes are started as uid 65534"
    assert _read_as_nobody("show") == "secret seen"  # the control: what a job could do before
    assert _read_as_nobody("hide") == "refused"


def test_the_celery_worker_hides_itself_before_its_pool_forks():
    """The ``celeryd_init`` handler webapp/celery.py connects, as Celery sends it at a worker's start."""
    code = ("import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'webapp.settings'); django.setup()\n"
            "from webapp.celery import app\nfrom celery.signals import celeryd_init\n"
            "from webapp.hardening import is_dumpable\n"
            "before = is_dumpable()\n"
            "celeryd_init.send(sender='celery@test', instance=None, conf=app.conf, options={})\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    os._exit(0 if is_dumpable() is False else 3)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "print(before, is_dumpable(), os.waitstatus_to_exitcode(status))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "0"]  # and a forked pool process keeps the flag


def test_gunicorns_master_hides_itself_on_starting():
    code = ("from webapp import gunicorn_conf\nfrom webapp.hardening import is_dumpable\n"
            "before = is_dumpable()\ngunicorn_conf.on_starting(None)\nprint(before, is_dumpable())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
    assert is_dumpable() is True  # this test process was never touched
