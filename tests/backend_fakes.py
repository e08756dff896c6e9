"""A backend for tests that only look at settings, prices or Test connection: it never runs a job."""

from __future__ import annotations

from cloud_adapters.base import Backend, Capabilities
from cloud_adapters.settings import BackendSettings


class OfflineBackend(Backend):
    """Settings-only adapter: job operations refuse (a test that reaches them is wrong), price is 0.
    Subclasses set ``kind``, declare their ``settings`` (none here: only an empty config is valid)
    and override ``test_connection`` as the test needs."""

    kind = "offline"
    settings = BackendSettings(backend_label="Offline stand-in", provider="offline")

    @property
    def capabilities(self):
        return Capabilities()

    def _no_jobs(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__} runs no jobs; this test should not submit or sync one")

    submit = describe = cancel = logs = _no_jobs

    def price(self, instance_type="", spot=False):
        return 0.0
