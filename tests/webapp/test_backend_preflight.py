"""A backend's network preflight settings (trainer_pkg.preflight, issue 30): saved from the form and the API
with their defaults (off, no minimum, no maximum), refused out of bounds or of the wrong type with every
message at once on its field (never a 500), and passed to the job's ranks as variables."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from jobs import services
from jobs.adapters import job_spec
from jobs.models import ComputeBackend
from jobs.services.resources import PREFLIGHT_BOUNDS
from page_html import field_block
from test_backend_deadlines import gpubox_post
from trainer_pkg import preflight

pytestmark = pytest.mark.django_db

BUSBW_WORDS = PREFLIGHT_BOUNDS["preflight_min_busbw_gbps"][3]
LATENCY_WORDS = PREFLIGHT_BOUNDS["preflight_max_latency_us"][3]


def test_the_form_and_the_api_save_the_preflight_and_refuse_bad_values_all_at_once(client, user, api_client):
    client.force_login(user)
    page = client.get(reverse("backend-create")).content.decode()
    assert 'type="checkbox" name="preflight"' in field_block(page, "preflight")
    assert "checked" not in field_block(page, "preflight")
    r = client.post(reverse("backend-create"), gpubox_post(preflight="on", preflight_min_busbw_gbps="12.5",
                                                           preflight_max_latency_us="500"))
    assert r.status_code == 302
    backend = ComputeBackend.objects.get(name="box")
    assert (backend.preflight, backend.preflight_min_busbw_gbps, backend.preflight_max_latency_us) == (True, 12.5, 500)
    page = client.get(reverse("backend-edit", args=[backend.pk])).content.decode()
    assert 'value="12.5"' in field_block(page, "preflight_min_busbw_gbps")
    r = client.post(reverse("backend-edit", args=[backend.pk]),
                    gpubox_post(preflight="on", preflight_min_busbw_gbps="0", preflight_max_latency_us="1.5"))
    assert r.status_code == 200  # shown again with both errors, each on its field
    page = r.content.decode()
    assert "greater than or equal to 0.001" in field_block(page, "preflight_min_busbw_gbps")
    assert "Enter a whole number" in field_block(page, "preflight_max_latency_us")

    r = api_client.post("/api/backends/", {"name": "box2", "kind": "gpubox"}, format="json")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert (body["preflight"], body["preflight_min_busbw_gbps"], body["preflight_max_latency_us"]) == (False, None, None)
    r = api_client.patch(f"/api/backends/{body['id']}/", {"preflight": True, "preflight_min_busbw_gbps": 100_001,
                                                          "preflight_max_latency_us": 0}, format="json")
    assert r.status_code == 400 and set(r.json()) == {"preflight_min_busbw_gbps", "preflight_max_latency_us"}, r.json()
    for bad in ({"preflight_min_busbw_gbps": "fast"}, {"preflight_min_busbw_gbps": [1]},
                {"preflight_max_latency_us": 10_000_001}, {"preflight": "maybe"}):
        r = api_client.patch(f"/api/backends/{body['id']}/", bad, format="json")
        assert r.status_code == 400 and list(r.json()) == list(bad), (bad, r.json())
    r = api_client.patch(f"/api/backends/{body['id']}/", {"preflight": True, "preflight_min_busbw_gbps": 0.5,
                                                          "preflight_max_latency_us": None}, format="json")
    assert (r.status_code, r.json()["preflight"], r.json()["preflight_min_busbw_gbps"]) == (200, True, 0.5)


def test_services_word_the_bounds_and_report_every_field_at_once(local_backend):
    with pytest.raises(ValidationError) as exc:
        services.backend_update(backend=local_backend, preflight="yes", preflight_min_busbw_gbps=float("nan"),
                                preflight_max_latency_us=2.5)
    assert exc.value.message_dict == {
        "preflight": ["Preflight must be true or false; got 'yes'."],
        "preflight_min_busbw_gbps": [f"{BUSBW_WORDS}; got 'nan'."],
        "preflight_max_latency_us": [f"{LATENCY_WORDS}; got '2.5'."]}
    for field, bad in (("preflight_min_busbw_gbps", True), ("preflight_min_busbw_gbps", 0.0001),
                       ("preflight_max_latency_us", "100")):
        with pytest.raises(ValidationError) as exc:
            services.backend_update(backend=local_backend, **{field: bad})
        words = PREFLIGHT_BOUNDS[field][3]
        assert exc.value.message_dict == {field: [f"{words}; got {str(bad)!r}."]}
    local_backend.refresh_from_db()
    assert (local_backend.preflight, local_backend.preflight_min_busbw_gbps) == (False, None)


def test_the_backends_preflight_reaches_every_rank_as_variables(job):
    assert not {preflight.ENABLE_VAR, preflight.MIN_BUSBW_VAR} & set(job_spec(job).env)  # off: nothing
    ComputeBackend.objects.filter(pk=job.backend_id).update(preflight=True, preflight_min_busbw_gbps=40)
    job.backend.refresh_from_db()
    env = job_spec(job).env
    assert (env[preflight.ENABLE_VAR], env[preflight.MIN_BUSBW_VAR]) == ("1", "40.0")
    assert preflight.MAX_LATENCY_VAR not in env
    assert preflight.limits(env) == (preflight.Limits(40.0, None), [])  # the launcher reads what the dashboard wrote


def test_a_job_cannot_set_or_override_the_backends_preflight(job):
    """What runs before a job's first step is the operator's: the job's environment refuses the names, and a
    row holding them anyway (written around the validation) changes nothing in what the ranks get."""
    from jobs import validation

    assert validation.env_name_problem(preflight.ENABLE_VAR) == (
        "TRAINBOARD_PREFLIGHT cannot be set here: names starting TRAINBOARD_ are Trainboard's own (the launcher "
        "sets TRAINBOARD_MODEL_DIR, TRAINBOARD_DATA_DIR, ...).")
    ComputeBackend.objects.filter(pk=job.backend_id).update(preflight=True, preflight_min_busbw_gbps=40)
    job.backend.refresh_from_db()
    job.env = {preflight.ENABLE_VAR: "0", preflight.MIN_BUSBW_VAR: "0.001", preflight.MAX_LATENCY_VAR: "1",
               "WANDB_MODE": "offline"}
    env = job_spec(job).env
    assert {k: env.get(k) for k in (preflight.ENABLE_VAR, preflight.MIN_BUSBW_VAR, preflight.MAX_LATENCY_VAR,
                                     "WANDB_MODE")} == {
        preflight.ENABLE_VAR: "1", preflight.MIN_BUSBW_VAR: "40.0", preflight.MAX_LATENCY_VAR: None,
        "WANDB_MODE": "offline"}
    ComputeBackend.objects.filter(pk=job.backend_id).update(preflight=False)
    job.backend.refresh_from_db()
    job.env = {preflight.ENABLE_VAR: "1"}
    assert preflight.ENABLE_VAR not in job_spec(job).env  # the backend's preflight is off: off
