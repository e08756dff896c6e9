"""Fixtures of the notification tests: a job of alice's on the local GPU box, webhooks allowed on
loopback (the tests' receivers listen on 127.0.0.1), a short HTTP timeout and the default retry
schedule."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def webhook_settings(settings):
    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    settings.TRAINBOARD_WEBHOOK_TIMEOUT_S = 2.0
    settings.TRAINBOARD_WEBHOOK_RETRY_DELAYS_S = [60.0, 180.0, 540.0, 1080.0]
    settings.TRAINBOARD_BASE_URL = "https://trainboard.example.org"
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    return settings


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    from jobs import services

    return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                        backend=local_backend, epochs=1, name="digits-run", budget_usd="2.00")
