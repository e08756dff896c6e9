"""PostgreSQL restart, as the web and the workers see it: every session of theirs is terminated from
the server side (``pg_terminate_backend``; the shared server itself is never restarted). A real web
server (gunicorn, one sync worker: one persistent connection, CONN_MAX_AGE) and a real Celery worker
keep going without a restart of their own: the next request and the next tasks reconnect
(CONN_HEALTH_CHECKS)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from faultkit import REPO_ROOT, database_url, wait_for
from jobs import services
from jobs.models import JobStateChoices as S, TrainingJob

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _terminate_every_other_session(url: str) -> set[int]:
    """Kill every session on the test database but this one; returns their pids."""
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'").fetchall()
    return {pid for pid, _ in rows}


def _sessions(url: str) -> set[int]:
    with psycopg.connect(url, autocommit=True) as admin:
        return {r[0] for r in admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'").fetchall()}


@pytest.fixture
def web_server(tmp_path):
    """gunicorn serving webapp.wsgi on a free loopback port with one sync worker (one thread)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="webapp.settings", DATABASE_URL=database_url(connection.settings_dict),
               TRAINBOARD_VAR_DIR=str(tmp_path / "web-var"), DJANGO_SECRET_KEY="faults-web-test-key",
               PYTHONPATH=str(REPO_ROOT))
    log = open(tmp_path / "web.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "webapp.wsgi", "-w", "1", "--threads", "1",
                             "-b", f"127.0.0.1:{port}"], cwd=REPO_ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            urllib.request.urlopen(base + "/login/", timeout=2)
            return True
        except urllib.error.HTTPError:  # answering, whatever it says
            return True
        except OSError:
            return proc.poll() is not None and pytest.fail(Path(tmp_path / "web.log").read_text())

    try:
        wait_for(up, timeout=60, what="gunicorn to answer")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


def _get(url: str, token: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, {"body": err.read().decode(errors="replace")[:500]}


def test_web_and_worker_reconnect_after_their_sessions_are_killed(workers, web_server, provider, fault_backend,
                                                                 user, digits_dataset, cnn_model):
    from rest_framework.authtoken.models import Token

    token = Token.objects.create(user=user).key
    url = database_url(connection.settings_dict)
    worker = workers.start()
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=fault_backend)
    wait_for(lambda: TrainingJob.objects.get(pk=job.pk).state == S.RUNNING, timeout=60,
             what=f"the job to run:\n{worker.log()[-2000:]}")
    status, body = _get(f"{web_server}/api/jobs/{job.pk}/", token)
    assert (status, body["state"]) == (200, S.RUNNING)
    connection.ensure_connection()
    mine = connection.connection.info.backend_pid
    held = _sessions(url) - {mine}
    assert held, "the web server holds a persistent session (CONN_MAX_AGE)"

    connection.close()  # this test's own session dies with the others; it reconnects on next use
    # A session of a worker's task may end on its own between the two reads (CI saw 1 of 2 killed):
    # what counts is that held ones were killed here and that none of them is left (below).
    assert _terminate_every_other_session(url) & held
    # pg_terminate_backend only signals the backend; it leaves pg_stat_activity when it has exited.
    wait_for(lambda: not (held & _sessions(url)), timeout=30, what=f"the sessions {sorted(held)} to end")

    # The web: the next request answers from a fresh session.
    status, body = _get(f"{web_server}/api/jobs/{job.pk}/", token)
    assert status == 200, body
    assert body["state"] == S.RUNNING
    # The worker: syncing goes on (the provider's SUCCEEDED is applied) and a new job is submitted.
    record = provider.jobs(job.provider_job_name)[0]
    provider.set_state(record["id"], "SUCCEEDED")
    wait_for(lambda: TrainingJob.objects.get(pk=job.pk).state == S.SUCCEEDED, timeout=60,
             what=f"the sync to apply SUCCEEDED after the kill:\n{worker.log()[-3000:]}")
    second = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                          backend=fault_backend)
    wait_for(lambda: TrainingJob.objects.get(pk=second.pk).state == S.RUNNING, timeout=60,
             what="a job created after the kill to run")
    assert worker.proc.poll() is None  # the same worker process all along
    status, body = _get(f"{web_server}/api/jobs/?state=SUCCEEDED", token)
    assert status == 200 and [j["id"] for j in body["results"]] == [job.pk]
    assert not (held & _sessions(url)), "every session in use now was opened after the kill"
