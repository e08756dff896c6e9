"""A backend's hang policy and hang deadline (jobs.hangs, issue 30): saved from the form and the API,
refused out of bounds with the message on the field, and the deadline handed to the launcher's
watchdog in the job's environment."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from jobs import services
from jobs.adapters import job_spec
from jobs.models import ComputeBackend
from page_html import field_block
from test_backend_deadlines import gpubox_post

pytestmark = pytest.mark.django_db


def test_backend_form_saves_the_hang_policy_and_deadline_and_blank_means_the_step_time(client, user):
    client.force_login(user)
    page = client.get(reverse("backend-create")).content.decode()
    assert '<option value="flag" selected>' in field_block(page, "hang_policy")
    r = client.post(reverse("backend-create"), gpubox_post(hang_policy="cancel", hang_deadline_s="900"))
    assert r.status_code == 302
    backend = ComputeBackend.objects.get(name="box")
    assert (backend.hang_policy, backend.hang_deadline_s) == ("cancel", 900)
    page = client.get(reverse("backend-edit", args=[backend.pk])).content.decode()
    assert 'value="900"' in field_block(page, "hang_deadline_s")
    r = client.post(reverse("backend-edit", args=[backend.pk]), gpubox_post(hang_policy="flag", hang_deadline_s=""))
    assert r.status_code == 302
    backend.refresh_from_db()
    assert (backend.hang_policy, backend.hang_deadline_s) == ("flag", None)


def test_backend_api_takes_the_hang_settings_and_refuses_bad_ones(api_client):
    r = api_client.post("/api/backends/", {"name": "box", "kind": "gpubox", "hang_policy": "cancel",
                                           "hang_deadline_s": 120}, format="json")
    assert r.status_code == 201, r.json()
    assert (r.json()["hang_policy"], r.json()["hang_deadline_s"]) == ("cancel", 120)
    pk = r.json()["id"]
    for bad in ({"hang_policy": "reboot"}, {"hang_deadline_s": 5}, {"hang_deadline_s": "soon"},
                {"hang_deadline_s": -1}, {"hang_deadline_s": 10**12}, {"hang_deadline_s": [1]}):
        r = api_client.patch(f"/api/backends/{pk}/", bad, format="json")
        assert r.status_code == 400 and list(r.json()) == list(bad), (bad, r.json())
    backend = ComputeBackend.objects.get(pk=pk)
    assert (backend.hang_policy, backend.hang_deadline_s) == ("cancel", 120)
    r = api_client.post("/api/backends/", {"name": "box2", "kind": "gpubox"}, format="json")
    assert (r.json()["hang_policy"], r.json()["hang_deadline_s"]) == ("flag", None)
    r = api_client.patch(f"/api/backends/{pk}/", {"hang_policy": "restart"}, format="json")
    assert r.status_code == 200 and ComputeBackend.objects.get(pk=pk).hang_policy == "restart"


def test_services_word_the_deadlines_bounds(local_backend):
    for bad in (9, True, 30 * 86_400 + 1, 1.5):
        with pytest.raises(ValidationError) as exc:
            services.backend_update(backend=local_backend, hang_deadline_s=bad)
        assert exc.value.message_dict == {"hang_deadline_s": [
            f"Hang deadline must be whole seconds from 10 to 2592000 (30 days), or blank for the job's own step "
            f"time; got {str(bad)!r}."]}
    services.backend_update(backend=local_backend, hang_deadline_s=10)
    local_backend.refresh_from_db()
    assert local_backend.hang_deadline_s == 10


def test_the_backends_hang_deadline_reaches_the_launcher_and_the_jobs_env_may_set_its_own(job):
    assert "TRAINBOARD_HANG_DEADLINE_S" not in job_spec(job).env  # blank: the launcher computes it
    ComputeBackend.objects.filter(pk=job.backend_id).update(hang_deadline_s=300)
    job.backend.refresh_from_db()
    assert job_spec(job).env["TRAINBOARD_HANG_DEADLINE_S"] == "300"
    job.env = {"TRAINBOARD_HANG_DEADLINE_S": "0"}
    assert job_spec(job).env["TRAINBOARD_HANG_DEADLINE_S"] == "0"
