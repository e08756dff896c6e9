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


RESTART_REFUSED = ("Max restarts is 0, so the hang policy restart would never restart a hung run (it would cancel "
                   "it); set max restarts from 1 to 10, or choose the hang policy cancel.")


def test_the_hang_policy_restart_with_no_restart_is_refused_on_max_restarts_with_the_other_errors(
        api_client, local_backend):
    """restart with max_restarts 0 would cancel every hung run: refused on max_restarts, in the services
    (with every other field's error at once, whichever of the two is changed) and the API; nothing saved."""
    with pytest.raises(ValidationError) as exc:
        services.backend_update(backend=local_backend, hang_policy="restart", max_restarts=0, hang_deadline_s=5,
                                idle_minutes=0)
    assert exc.value.message_dict == {
        "max_restarts": [RESTART_REFUSED],
        "hang_deadline_s": ["Hang deadline must be whole seconds from 10 to 2592000 (30 days), or blank for the "
                            "job's own step time; got '5'."],
        "idle_minutes": ["Idle minutes must be whole minutes from 1 to 10080 (7 days); got '0'."]}
    services.backend_update(backend=local_backend, max_restarts=0)  # 0 under flag: no lost run resubmitted
    with pytest.raises(ValidationError) as exc:
        services.backend_update(backend=local_backend, hang_policy="restart")
    assert exc.value.message_dict == {"max_restarts": [RESTART_REFUSED]}
    r = api_client.patch(f"/api/backends/{local_backend.pk}/", {"hang_policy": "restart"}, format="json")
    assert (r.status_code, r.json()) == (400, {"max_restarts": [RESTART_REFUSED]})
    local_backend.refresh_from_db()
    assert (local_backend.hang_policy, local_backend.max_restarts) == ("flag", 0)
    r = api_client.patch(f"/api/backends/{local_backend.pk}/", {"hang_policy": "restart", "max_restarts": 1},
                         format="json")
    assert r.status_code == 200 and (r.json()["hang_policy"], r.json()["max_restarts"]) == ("restart", 1)


def test_max_restarts_is_worded_for_lost_and_hung_runs(api_client, owner_client, job):  # the header: test_job_attempts_page
    import yaml

    page = owner_client.get(reverse("backend-edit", args=[job.backend_id])).content.decode()
    assert "Max restarts of a lost or hung run" in field_block(page, "max_restarts")
    schema = yaml.safe_load(api_client.get("/api/schema/").content)
    description = schema["components"]["schemas"]["Backend"]["properties"]["max_restarts"]["description"]
    assert "a hung run is stopped and restarted" in description and "0 is refused with hang_policy restart" in description


def test_the_admin_reports_the_hang_deadline_with_the_other_field_errors(client, user, local_backend):
    client.force_login(user)
    response = client.post(reverse("admin:jobs_computebackend_change", args=[local_backend.pk]), {
        "name": local_backend.name, "kind": local_backend.kind, "config": "{}", "enabled": "on",
        "state_deadlines": "{}", "hang_deadline_s": "3", "idle_minutes": "0", "max_restarts": "11"})
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert errors["hang_deadline_s"] == ["Ensure this value is greater than or equal to 10."]
    assert errors["idle_minutes"] == ["Ensure this value is greater than or equal to 1."]
    assert errors["max_restarts"] == ["Ensure this value is less than or equal to 10."]
    local_backend.refresh_from_db()
    assert local_backend.hang_deadline_s is None


def test_the_schema_declares_the_hang_deadlines_bounds_and_the_api_keeps_them(api_client, local_backend):
    import yaml

    field = yaml.safe_load(api_client.get("/api/schema/").content)["components"]["schemas"]["Backend"][
        "properties"]["hang_deadline_s"]
    assert (field["type"], field["minimum"], field["maximum"], field["nullable"]) == ("integer", 10, 2_592_000, True)
    message = ("Hang deadline must be whole seconds from 10 to 2592000 (30 days), or null for the job's own step "
               "time.")
    for bad in (9, 2_592_001):
        r = api_client.patch(f"/api/backends/{local_backend.pk}/", {"hang_deadline_s": bad, "idle_minutes": 0},
                             format="json")
        assert r.status_code == 400 and r.json() == {
            "hang_deadline_s": [message], "idle_minutes": ["Ensure this value is greater than or equal to 1."]}
    for good in (10, 2_592_000, None):
        r = api_client.patch(f"/api/backends/{local_backend.pk}/", {"hang_deadline_s": good}, format="json")
        assert (r.status_code, r.json()["hang_deadline_s"]) == (200, good)
