"""Redis restarts while jobs run (a throwaway redis-server on a free loopback port, without
persistence: every message in it is lost; the shared Redis is never touched). The database is the
source of truth: the running job keeps syncing once the same worker reconnects, a job created while
the broker was down is stored (the request does not fail) and the recovery sweep sends its lost
submission; nothing is submitted twice."""

from __future__ import annotations

import socket
import subprocess

import pytest

from faultkit import wait_for
from jobs import recovery, services
from jobs.models import JobEvent, JobStateChoices as S, TrainingJob

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


class ThrowawayRedis:
    def __init__(self, tmp_path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tmp_path
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--daemonize", "no",
                                      "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answers():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    return conn.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        wait_for(answers, timeout=20, what="redis-server to answer")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path):
    server = ThrowawayRedis(tmp_path)
    server.start()
    yield server
    if server.proc.poll() is None:
        server.kill()


def _state(job) -> str:
    return TrainingJob.objects.get(pk=job.pk).state


def test_redis_restart_loses_no_job(redis_server, workers, provider, fault_backend, user, digits_dataset,
                                    cnn_model):
    worker = workers.start(broker_url=redis_server.url)
    running = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=fault_backend)
    wait_for(lambda: _state(running) == S.RUNNING, timeout=60, what=f"the first job to run:\n{worker.log()[-2000:]}")

    redis_server.kill()
    # Created while the broker is down: stored QUEUED, the request does not fail, the message is lost.
    lost = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                        backend=fault_backend)
    assert _state(lost) == S.QUEUED
    record = provider.jobs(running.provider_job_name)[0]
    provider.set_state(record["id"], "SUCCEEDED")
    redis_server.start()  # empty: whatever it held is gone

    wait_for(lambda: _state(running) == S.SUCCEEDED, timeout=120,
             what=f"syncing to resume after the restart:\n{worker.log()[-3000:]}")
    wait_for(lambda: _state(lost) in (S.PENDING, S.RUNNING), timeout=60,
             what=f"the sweep to send the lost submission:\n{worker.log()[-3000:]}")
    assert worker.proc.poll() is None  # the same worker process reconnected
    assert JobEvent.objects.filter(job=lost, message__startswith=recovery.REQUEUE_MESSAGE).count() >= 1
    assert provider.count(running.provider_job_name) == 1
    assert provider.count(lost.provider_job_name) == 1
    lost_record = provider.jobs(lost.provider_job_name)[0]
    provider.set_state(lost_record["id"], "SUCCEEDED")
    wait_for(lambda: _state(lost) == S.SUCCEEDED, timeout=60, what="the re-sent job to finish")
    assert provider.count(lost.provider_job_name) == 1
