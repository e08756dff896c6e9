"""The shared Celery worker of a pytest process (tests/sharedworker.py, behind ``celery_worker_process``)
between two borrowing tests: what lets one worker serve them all without one test's tasks, runs or
database sessions reaching another.

* Lent, it consumes its queues and runs a task this process sends.
* Taken back, the same process keeps running but consumes no queue and holds no database session
  (another test's flush or a fixture waiting for the test database's sessions to end is not held up),
  and a message sent to it meanwhile waits on its broker until the next lend deletes it — with the
  queue bindings kept, so the next test's tasks are routed and run.
"""

from __future__ import annotations

import pytest
import redis
from django.db import connection

from polling import wait_for
from workerkit import use_broker

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _other_sessions() -> int:
    """Client sessions on the test database other than this process's own."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND pid <> pg_backend_pid() AND backend_type = 'client backend'")
        return cursor.fetchone()[0]


def _send(task: str) -> str:
    """Send ``task`` (no arguments) through this process's Celery app; returns its id."""
    from webapp.celery import app

    return app.send_task(task).id


def _blocked_pops(broker: redis.Redis) -> int:
    """Clients of ``broker`` blocked in BRPOP (a consuming worker waits in one, 1 s at a time)."""
    return sum(1 for c in broker.client_list() if c.get("cmd") == "brpop" and "b" in c.get("flags", ""))


def test_a_taken_back_worker_consumes_nothing_holds_no_session_and_is_lent_again_with_an_empty_broker(
        shared_celery_worker, tmp_path):
    worker = shared_celery_worker.lend()
    broker = redis.Redis.from_url(worker.broker_url)
    try:
        sent = _send("jobs.tasks.sync_jobs")
        worker.wait_for(lambda: f"jobs.tasks.sync_jobs[{sent}] succeeded" in worker.log(), timeout=60,
                        what="the lent worker to run the task sent to it")
        wait_for(lambda: _blocked_pops(broker) > 0, timeout=10, what="the consuming worker's BRPOP")
    finally:
        shared_celery_worker.take_back(tmp_path / "runs")

    assert worker.proc.poll() is None, "taking back pauses the worker; it does not stop it"
    # Its last BRPOP has ended, so it cannot pop (and requeue later) a message sent from now on.
    assert _blocked_pops(broker) == 0
    with shared_celery_worker.controlling() as control:
        assert shared_celery_worker.control(control, "active_queues") == []
        assert shared_celery_worker.control(control, "active") == []
    wait_for(lambda: _other_sessions() == 0, timeout=10, what="the paused worker's database sessions to end")

    # While it is paused, a message sent to its broker stays there, unconsumed.
    from webapp.celery import app

    saved = (app.conf.broker_url, dict(app.conf.broker_transport_options or {}))
    use_broker(worker.broker_url)
    try:
        stale = _send("jobs.tasks.sync_jobs")
    finally:
        use_broker(*saved)
    assert any(stale.encode() in m for m in broker.lrange("celery", 0, -1))

    again = shared_celery_worker.lend()
    try:
        assert again.proc.pid == worker.proc.pid
        assert not any(stale.encode() in m for m in broker.lrange("celery", 0, -1)), "lending empties the broker"
        assert broker.exists("_kombu.binding.celery"), "the queue bindings survive the emptying"
        assert f"[{sent}]" not in again.log(), "the log a test sees starts at its lend"
        fresh = _send("jobs.tasks.sync_jobs")
        again.wait_for(lambda: f"jobs.tasks.sync_jobs[{fresh}] succeeded" in again.log(), timeout=60,
                       what="the worker lent again to run a task")
        assert f"[{stale}]" not in again.log()
    finally:
        shared_celery_worker.take_back(tmp_path / "runs-2")
        broker.close()
