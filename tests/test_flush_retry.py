"""The teardown flush of a ``transaction=True`` test retries a lost lock race (tests/workerkit.py).

A Celery worker shared by a module's tests keeps writing while pytest-django truncates every table
between them. Here a second real PostgreSQL session plays that worker: it holds the last table the
TRUNCATE locks, then asks for the first, which the TRUNCATE already holds, and PostgreSQL's deadlock
detector aborts the flush.
"""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import TransactionTestCase

from polling import wait_for
from workerkit import database_url, lost_a_lock_race, retry_lock_conflicts

pytestmark = pytest.mark.django_db(transaction=True)


def _flush():
    call_command("flush", verbosity=0, interactive=False)


def test_a_flush_deadlocked_by_a_live_session_is_retried_and_empties_the_database(django_user_model):
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL (the Makefile's DATABASE_URL)")
    django_user_model.objects.create_user(username="carol")
    # The flush truncates these tables in this order (the same call in the same process).
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    first, last = tables[0], tables[-1]
    url = database_url(connection.settings_dict)
    worker = psycopg.connect(url)  # not autocommit: what it reads, it holds until it rolls back
    observer = psycopg.connect(url, autocommit=True)
    # PostgreSQL aborts the session whose deadlock check runs first (each checks after waiting its
    # deadlock_timeout, 1 s by default): the worker's is a minute, so the flush is the one aborted
    # however late the loaded machine lets the TRUNCATE start waiting.
    worker.execute("SET deadlock_timeout = '60s'")
    worker.execute(f'SELECT 1 FROM "{last}" LIMIT 1')
    worker_pid = worker.info.backend_pid
    outcome = {}

    def worker_then_wants_the_first_table():
        try:
            wait_for(lambda: observer.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE 'TRUNCATE%%' AND pid <> %s", (worker_pid,)
            ).fetchone()[0] == 1, timeout=30, what="the flush to wait for the worker's table")
            worker.execute(f'SELECT 1 FROM "{first}" LIMIT 1')  # waits for the TRUNCATE: a cycle
            outcome["worker"] = "read"
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            outcome["worker"] = repr(exc)
        finally:
            worker.rollback()

    thread = threading.Thread(target=worker_then_wants_the_first_table)
    thread.start()
    tries = []
    try:
        retry_lock_conflicts(_flush, tries=tries)
    finally:
        thread.join(timeout=60)
        worker.close()
        observer.close()
    # The TRUNCATE's deadlock check ran first (the worker's waits a minute) and aborted it, not the worker.
    assert outcome == {"worker": "read"}
    assert len(tries) == 1, tries
    assert "couldn't be flushed" in str(tries[0]) and lost_a_lock_race(tries[0])
    assert list(django_user_model.objects.values_list("username", flat=True)) == []


def test_any_other_flush_error_is_raised_at_its_first_attempt():
    calls = []

    def broken():
        calls.append(1)
        raise CommandError("Database x couldn't be flushed.") from ValueError("not a lock race")

    with pytest.raises(CommandError, match="couldn't be flushed"):
        retry_lock_conflicts(broken, pause_s=0)
    assert calls == [1]


def test_the_transactional_teardown_is_the_retrying_one():
    assert getattr(TransactionTestCase._fixture_teardown, "retries_lock_conflicts", False) is True
