"""A backend's idle policy (jobs.idle, issue 30): saved from the form and the API with its defaults (off,
10 %, 30 min), and refused out of bounds or of the wrong type with the message on the field, never a 500."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from jobs import services
from jobs.services.resources import IDLE_BOUNDS
from jobs.models import ComputeBackend
from page_html import field_block
from test_backend_deadlines import gpubox_post

pytestmark = pytest.mark.django_db


def test_the_form_saves_the_idle_policy_and_the_api_refuses_bad_values(client, user, api_client, local_backend):
    client.force_login(user)
    page = client.get(reverse("backend-create")).content.decode()
    assert '<option value="off" selected>' in field_block(page, "idle_policy")
    r = client.post(reverse("backend-create"), gpubox_post(idle_policy="stop", idle_gpu_util_pct="5",
                                                           idle_minutes="45"))
    assert r.status_code == 302
    backend = ComputeBackend.objects.get(name="box")
    assert (backend.idle_policy, backend.idle_gpu_util_pct, backend.idle_minutes) == ("stop", 5, 45)
    page = client.get(reverse("backend-edit", args=[backend.pk])).content.decode()
    assert 'value="45"' in field_block(page, "idle_minutes")
    r = client.post(reverse("backend-edit", args=[backend.pk]), gpubox_post(idle_policy="warn", idle_minutes="0"))
    assert r.status_code == 200  # shown again with the error on the field
    assert "greater than or equal to 1" in field_block(r.content.decode(), "idle_minutes")
    backend.refresh_from_db()
    assert backend.idle_policy == "stop"

    r = api_client.post("/api/backends/", {"name": "box2", "kind": "gpubox"}, format="json")
    assert r.status_code == 201, r.json()
    assert (r.json()["idle_policy"], r.json()["idle_gpu_util_pct"], r.json()["idle_minutes"]) == ("off", 10, 30)
    pk = r.json()["id"]
    for bad in ({"idle_policy": "kill"}, {"idle_policy": None}, {"idle_gpu_util_pct": 0},
                {"idle_gpu_util_pct": 101}, {"idle_gpu_util_pct": "soon"}, {"idle_gpu_util_pct": True},
                {"idle_minutes": 0}, {"idle_minutes": 10_081}, {"idle_minutes": 1.5}, {"idle_minutes": [1]},
                {"idle_minutes": 10**30}):
        r = api_client.patch(f"/api/backends/{pk}/", bad, format="json")
        assert r.status_code == 400 and list(r.json()) == list(bad), (bad, r.json())
    r = api_client.patch(f"/api/backends/{pk}/", {"idle_policy": "warn", "idle_minutes": 10_080}, format="json")
    assert (r.status_code, r.json()["idle_policy"], r.json()["idle_minutes"]) == (200, "warn", 10_080)

    for field, bad in (("idle_minutes", True), ("idle_minutes", 2.0), ("idle_gpu_util_pct", 0), ("idle_gpu_util_pct", "5")):
        with pytest.raises(ValidationError) as exc:
            services.backend_update(backend=local_backend, **{field: bad})
        words = IDLE_BOUNDS[field][2]
        assert exc.value.message_dict == {field: [f"{words}; got {str(bad)!r}."]}
    local_backend.refresh_from_db()
    assert (local_backend.idle_gpu_util_pct, local_backend.idle_minutes) == (10, 30)
