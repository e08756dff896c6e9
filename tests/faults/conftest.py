"""Fixtures for the fault-injection tests: the ``faultcloud`` provider stand-in and its backend, and
real Celery workers (``workers``) that can be SIGKILLed and restarted.

Run (own database and Redis db)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/trainboard_faults REDIS_URL=redis://127.0.0.1:6379/7 \\
        .venv/bin/pytest -q -p no:cacheprovider tests/faults
"""

from __future__ import annotations

import os

import pytest

from fault_backend import FaultProvider
from faultkit import Worker, database_url, wait_for_sessions_to_close


@pytest.fixture
def provider(tmp_path) -> FaultProvider:
    return FaultProvider(tmp_path / "provider")


@pytest.fixture
def fault_backend(user, provider, monkeypatch):
    """A ``faultcloud`` backend of alice's whose provider is ``provider``."""
    from cloud_adapters import registry
    from jobs import services

    monkeypatch.setitem(registry.KINDS, "faultcloud",
                        registry.KindInfo("fault_backend", "FaultBackend", "Fault-injecting stand-in"))
    return services.backend_create(owner=user, name="faulty", kind="faultcloud",
                                   config={"root": str(provider.root)})


def use_broker(url: str) -> None:
    """Make this process publish to ``url`` (where the test's workers listen)."""
    from webapp.celery import app

    if app.conf.broker_url != url:
        from kombu import pools

        pools.reset()  # close every cached connection/producer pool and forget them
        app._pool = None
        app.amqp._producer_pool = None
        app.conf.broker_url = url


@pytest.fixture
def workers(transactional_db, tmp_path):
    """``workers.start(broker_url=None, **env)`` starts a real worker (+ beat) on this test's database;
    all are stopped at the end. The default broker is ``REDIS_URL`` (flushed first)."""
    import redis
    from django.db import connection

    from webapp.celery import app

    saved = app.conf.broker_url
    default_broker = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/7"
    started: list[Worker] = []

    class Workers:
        broker_url = default_broker

        def start(self, broker_url: str | None = None, **env: str) -> Worker:
            broker = broker_url or default_broker
            if not started and broker == default_broker:
                redis.Redis.from_url(broker).flushdb()
            use_broker(broker)
            worker = Worker(tmp_path=tmp_path, db_url=database_url(connection.settings_dict), broker_url=broker,
                            env=env, name=str(len(started)))
            started.append(worker)
            return worker.ready()

    try:
        yield Workers()
    finally:
        for worker in started:
            worker.stop()
        wait_for_sessions_to_close(connection)
        use_broker(saved)
