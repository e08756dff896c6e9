"""The Celery application. Broker: Redis when ``REDIS_URL`` is set, else kombu's filesystem transport
(no server needed) under ``TRAINBOARD_VAR_DIR/broker``. Configuration lives in settings (``CELERY_*``)."""

import os

from celery import Celery
from celery.signals import celeryd_init, worker_process_init

from webapp.hardening import make_undumpable

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("trainboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@celeryd_init.connect
def _hide_the_workers_secrets(**_kwargs) -> None:
    """A worker's environment holds the installation's secrets, and a GPU box's jobs may run user code
    as the worker's own OS user: make the worker's ``/proc/<pid>/environ`` (and ptrace) root's alone
    before its pool forks (the pool processes keep the flag). webapp/hardening.py says why."""
    make_undumpable()


@worker_process_init.connect
def _leave_worker_process_group(**_kwargs) -> None:
    """Move each prefork pool process into a process group of its own, so that a signal sent to the
    worker's group (``kill -TERM -<pgid>``, a terminal, a supervisor stopping the whole group) reaches
    the worker's main process only, which then stops its pool itself.

    Why: with the filesystem broker the worker uses billiard's blocking pool, whose idle pool
    processes wait for work holding the task queue's read lock, a semaphore shared with the main
    process. A group SIGTERM would kill them there; the lock would stay taken and the main process,
    finishing its warm shutdown, would block on it for good, ignoring every further SIGTERM and SIGQUIT
    (tests/e2e/test_worker_shutdown.py). Pool processes still die with the worker: Celery sets their
    parent-death signal to SIGKILL.
    """
    os.setpgid(0, 0)
