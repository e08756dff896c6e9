"""A backend's stalled-job deadlines (one seconds input per non-terminal state, the default as
placeholder), stall policy and orphan policy: saved from the form, the API and the admin, refused
by the services with the message next to the deadline it is about."""

from __future__ import annotations

import re

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from jobs import services
from jobs.models import ComputeBackend
from page_html import field_block

pytestmark = pytest.mark.django_db


def gpubox_post(**extra) -> dict:
    data = {"name": "box", "kind": "gpubox", "max_procs_per_node": 2, "hourly_rate_usd": "0", "extra_config": "",
            "enabled": "on"}
    data.update(extra)
    return data


def test_backend_form_shows_one_deadline_per_state_with_the_default(client, user, settings):
    settings.TRAINBOARD_STATE_DEADLINES_S = {"QUEUED": 600, "SUBMITTING": 300, "PENDING": 3600, "STOPPING": 900}
    settings.TRAINBOARD_RUNNING_DEADLINE_MARGIN_S = 600.0
    client.force_login(user)
    page = client.get(reverse("backend-create")).content.decode()

    expected = {"QUEUED": "600 s", "SUBMITTING": "300 s", "PENDING": "3600 s", "RUNNING": "max runtime + 600 s",
                "STOPPING": "900 s"}
    for state, default in expected.items():
        block = field_block(page, f"deadline_{state}")
        assert 'type="number"' in block and f'placeholder="default: {default}"' in block, block
    assert not re.search(r'id="field-deadline_(SUCCEEDED|FAILED|CANCELLED)"', page)
    assert '<option value="warn" selected>' in field_block(page, "stall_policy")
    assert '<option value="report" selected>' in field_block(page, "orphan_policy")


def test_backend_form_saves_deadlines_and_policies_and_edits_them(client, user):
    client.force_login(user)
    r = client.post(reverse("backend-create"), gpubox_post(deadline_PENDING="120", deadline_RUNNING="7200.5",
                                                           deadline_QUEUED="", stall_policy="cancel",
                                                           orphan_policy="stop"))
    assert r.status_code == 302
    backend = ComputeBackend.objects.get(name="box")
    assert backend.state_deadlines == {"PENDING": 120, "RUNNING": 7200.5}
    assert (backend.stall_policy, backend.orphan_policy) == ("cancel", "stop")

    page = client.get(reverse("backend-edit", args=[backend.pk])).content.decode()
    assert 'value="120"' in field_block(page, "deadline_PENDING")
    assert '<option value="cancel" selected>' in field_block(page, "stall_policy")
    assert '<option value="stop" selected>' in field_block(page, "orphan_policy")

    # Blank again = back to the defaults; the policies change.
    r = client.post(reverse("backend-edit", args=[backend.pk]),
                    gpubox_post(deadline_PENDING="", deadline_RUNNING="", stall_policy="warn", orphan_policy="report"))
    assert r.status_code == 302
    backend.refresh_from_db()
    assert (backend.state_deadlines, backend.stall_policy, backend.orphan_policy) == ({}, "warn", "report")


def test_backend_form_puts_the_services_deadline_error_on_that_state(client, user):
    client.force_login(user)
    r = client.post(reverse("backend-create"), gpubox_post(deadline_PENDING="-5", stall_policy="warn",
                                                           orphan_policy="report"))
    assert r.status_code == 200
    page = r.content.decode()
    assert ("PENDING: the deadline must be a positive number of seconds (got -5.0)."
            in field_block(page, "deadline_PENDING"))
    assert "has-error" not in re.search(r'<div class="field[^"]*" id="field-deadline_QUEUED">', page).group(0)
    assert not ComputeBackend.objects.exists()

    # A policy that is not a choice: the form's message on that field, nothing created.
    r = client.post(reverse("backend-create"), gpubox_post(stall_policy="sometimes"))
    assert "Select a valid choice" in field_block(r.content.decode(), "stall_policy")
    assert not ComputeBackend.objects.exists()


def test_backend_api_takes_and_returns_deadlines_and_policies(api_client, user):
    r = api_client.post("/api/backends/", {"name": "box", "kind": "gpubox", "config": {"max_procs_per_node": 1},
                                           "state_deadlines": {"pending": 90, "QUEUED": 30.5},
                                           "stall_policy": "cancel", "orphan_policy": "stop"}, format="json")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert (body["state_deadlines"], body["stall_policy"], body["orphan_policy"]) == (
        {"PENDING": 90, "QUEUED": 30.5}, "cancel", "stop")
    backend = ComputeBackend.objects.get(pk=body["id"])
    assert (backend.state_deadlines, backend.stall_policy, backend.orphan_policy) == (
        {"PENDING": 90, "QUEUED": 30.5}, "cancel", "stop")

    r = api_client.patch(f"/api/backends/{backend.pk}/", {"state_deadlines": {"DONE": 5}}, format="json")
    assert r.status_code == 400
    assert r.json() == {"state_deadlines": [
        "DONE: not a state with a deadline; use one of QUEUED, SUBMITTING, PENDING, RUNNING, STOPPING "
        "(terminal states have none)."]}
    r = api_client.patch(f"/api/backends/{backend.pk}/", {"orphan_policy": "sometimes"}, format="json")
    assert r.status_code == 400 and list(r.json()) == ["orphan_policy"]
    backend.refresh_from_db()
    assert (backend.state_deadlines, backend.orphan_policy) == ({"PENDING": 90, "QUEUED": 30.5}, "stop")

    r = api_client.patch(f"/api/backends/{backend.pk}/", {"state_deadlines": {}, "orphan_policy": "report"},
                         format="json")
    assert r.status_code == 200
    backend.refresh_from_db()
    assert (backend.state_deadlines, backend.orphan_policy, backend.stall_policy) == ({}, "report", "cancel")

    # Defaults when left out.
    r = api_client.post("/api/backends/", {"name": "box2", "kind": "gpubox"}, format="json")
    assert r.status_code == 201
    assert (r.json()["state_deadlines"], r.json()["stall_policy"], r.json()["orphan_policy"]) == (
        {}, "warn", "report")


def test_services_refuse_a_bad_orphan_policy_and_keep_the_row(local_backend):
    with pytest.raises(ValidationError) as exc:
        services.backend_update(backend=local_backend, orphan_policy="sometimes", stall_policy="cancel")
    assert list(exc.value.message_dict) == ["orphan_policy"]
    local_backend.refresh_from_db()
    assert (local_backend.orphan_policy, local_backend.stall_policy) == ("report", "warn")
    services.backend_update(backend=local_backend, orphan_policy="stop")
    local_backend.refresh_from_db()
    assert local_backend.orphan_policy == "stop"


def test_admin_backend_form_takes_deadlines_and_policies(client, user):
    client.force_login(user)
    page = client.get(reverse("admin:jobs_computebackend_add")).content.decode()
    assert 'name="state_deadlines"' in page and 'name="stall_policy"' in page and 'name="orphan_policy"' in page

    r = client.post(reverse("admin:jobs_computebackend_add"),
                    {"name": "box", "kind": "gpubox", "config": '{"max_procs_per_node": 1}', "enabled": "on",
                     "state_deadlines": '{"PENDING": -1}', "stall_policy": "cancel", "orphan_policy": "stop"})
    assert r.status_code == 200
    assert "PENDING: the deadline must be a positive number of seconds (got -1)." in r.content.decode()
    assert not ComputeBackend.objects.exists()

    r = client.post(reverse("admin:jobs_computebackend_add"),
                    {"name": "box", "kind": "gpubox", "config": '{"max_procs_per_node": 1}', "enabled": "on",
                     "state_deadlines": '{"PENDING": 45}', "stall_policy": "cancel", "orphan_policy": "stop"})
    assert r.status_code == 302
    backend = ComputeBackend.objects.get(name="box")
    assert (backend.owner, backend.state_deadlines, backend.stall_policy, backend.orphan_policy) == (
        user, {"PENDING": 45}, "cancel", "stop")

    r = client.post(reverse("admin:jobs_computebackend_change", args=[backend.pk]),
                    {"name": "box", "kind": "gpubox", "config": '{"max_procs_per_node": 1}', "enabled": "on",
                     "state_deadlines": "", "stall_policy": "warn", "orphan_policy": "report"})
    assert r.status_code == 302
    backend.refresh_from_db()
    assert (backend.state_deadlines, backend.stall_policy, backend.orphan_policy) == ({}, "warn", "report")
