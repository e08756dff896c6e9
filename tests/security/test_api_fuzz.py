"""Schemathesis against /api/schema/: every operation fuzzed through the real WSGI stack with a fixed
seed and a bounded number of cases (issue 6, Security: Input).

Asserted: no response is a server error (5xx), every response to a create is either a 201 with the
object or a 4xx, and afterwards no half-made job exists (each TrainingJob has its provider job name
and its QUEUED event). Runs in well under three minutes on two cores (about 20 operations ×
``EXAMPLES`` cases).

Left out: ``POST /api/backends/{id}/test-connection/``, which calls the cloud's API with whatever a
fuzzed backend names (traffic off this machine); tests/security/test_permission_walk.py and the
backend connection tests cover it.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

EXAMPLES = 80
SKIP = {("POST", "/api/backends/{id}/test-connection/")}


@pytest.fixture
def fuzz_user(django_user_model, settings, tmp_path):
    from rest_framework.authtoken.models import Token

    from jobs import services

    settings.TRAINBOARD_RUN_ROOT = tmp_path / "runs"
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2  # the box's host limit (no staff user sets it here)
    settings.TRAINBOARD_DATASET_ROOTS = [str(tmp_path)]
    user = django_user_model.objects.create_user(username="fuzz", password="pw-fuzz-Secret-1")
    # Something to find by id: the generated ids 1, 2 ... hit real rows as well as missing ones.
    digits = services.dataset_create(owner=user, name="digits", format="builtin", builtin_name="digits")
    cnn = services.model_spec_create(owner=user, name="cnn", architecture="cnn", params={})
    box = services.backend_create(owner=user, name="box", kind="gpubox", config={})
    services.training_job_create(owner=user, dataset=digits, model_spec=cnn, backend=box, nodes=1,
                                 procs_per_node=1, epochs=1)
    return user, Token.objects.create(user=user).key


def test_api_fuzz_no_server_error_and_no_half_made_job(fuzz_user, monkeypatch):
    import schemathesis
    from django.core.wsgi import get_wsgi_application
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import settings as hsettings

    from jobs.models import JobEvent, TrainingJob

    # Nothing may leave the machine even if a fuzzed backend were used: no cloud credentials.
    for name in ("AWS_PROFILE", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("NO_GCE_CHECK", "True")

    # The WSGI handler closes the database connection after each request, which would close the
    # test's transaction; Django's own test client disconnects the same hook.
    from django.core import signals
    from django.db import close_old_connections

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        _fuzz(fuzz_user, schemathesis, get_wsgi_application, HealthCheck, Phase, given, hsettings,
              JobEvent, TrainingJob)
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


def _fuzz(fuzz_user, schemathesis, get_wsgi_application, HealthCheck, Phase, given, hsettings,
          JobEvent, TrainingJob) -> None:
    _, token = fuzz_user
    auth = {"Authorization": f"Token {token}"}
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application(), headers=auth)
    failures: list[str] = []
    seen: dict[str, int] = {}

    for result in schema.get_all_operations():
        operation = result.ok()
        key = (operation.method.upper(), operation.path)
        if key in SKIP:
            continue

        @hsettings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=operation.as_strategy())
        def run(case) -> None:
            response = case.call(headers=auth)
            seen[f"{key[0]} {key[1]}"] = seen.get(f"{key[0]} {key[1]}", 0) + 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} body={case.body!r} "
                                f"query={case.query!r} -> {response.status_code}")

        run()

    assert len(seen) >= 15, seen  # every operation of the four viewsets, the token endpoint ...
    assert sum(seen.values()) >= 15 * 10
    assert not failures, "server errors:\n" + "\n".join(failures[:20])
    half_made = TrainingJob.objects.filter(provider_job_name="") | TrainingJob.objects.exclude(
        pk__in=JobEvent.objects.filter(to_state="QUEUED").values("job_id"))
    assert not half_made.exists(), list(half_made.values("id", "provider_job_name", "state"))
