"""Adding a provider is its adapter class and one registry line: the class below declares its settings
and credentials, the test registers it in one line, and the backend form, the admin form, the API
(its validation and its schema) and the service's checks all know them, labels, required settings,
host settings and secrets included, with nothing else edited."""

from __future__ import annotations

import html
import re

import pytest
from django.urls import reverse

from cloud_adapters import registry
from cloud_adapters.settings import BackendSettings, Secret, Setting
from jobs.models import ComputeBackend
from webapp.forms import BackendForm
from backend_fakes import OfflineBackend

pytestmark = pytest.mark.django_db


class TinyCloudBackend(OfflineBackend):
    """The whole provider: its settings are its declaration (the default clean_config checks them)."""

    kind = "tinycloud"
    settings = BackendSettings(backend_label="Tiny Cloud", provider="Tiny Cloud", settings=(
        Setting("project", "Tiny project", "The project the jobs bill to.", required=True, max_length=40),
        Setting("zone", "Tiny zone", "Where the jobs run.", choices=(("north", "North"), ("south", "South")),
                default="north"),
        Setting("quota", "Tiny quota", "Most machines at once.", type=int, min_value=1, max_value=4, default=1),
        Setting("endpoint", "Tiny endpoint", host=True, field=False),
    ), secrets=(Secret("api_key", "Tiny API key"), Secret("note", "Tiny note", required=False)))


@pytest.fixture
def tinycloud(monkeypatch):
    monkeypatch.setitem(registry.KINDS, "tinycloud", registry.KindInfo(__name__, "TinyCloudBackend", "Tiny Cloud"))


def _label(page: str, name: str) -> str:
    match = re.search(rf'<label for="id_{name}">(.*?)</label>', page)
    assert match, name
    return match.group(1)


def test_the_backend_form_shows_and_checks_the_new_providers_settings(owner_client, user, tinycloud):
    page = owner_client.get(reverse("backend-create")).content.decode()
    assert '<fieldset class="kind-settings" data-kind="tinycloud">' in page
    assert "Tiny Cloud settings" in page
    assert '<option value="tinycloud">Tiny Cloud</option>' in page
    # Vertex AI has a "project" too: each kind keeps its own input.
    project = BackendForm().setting_field("tinycloud", "project")
    assert project == "tinycloud_project"
    assert _label(page, project) == 'Tiny project <span class="muted">(required)</span>'
    assert _label(page, "zone") == 'Tiny zone <span class="muted">(optional)</span>'
    assert re.search(r'<select name="zone"[^>]*data-kind="tinycloud"', page)
    assert re.search(r'<input type="number" name="quota" min="1" max="4" data-kind="tinycloud"', page)
    # The host setting has no input of its own (it is set in the JSON), the secrets are write-only inputs.
    assert 'name="endpoint"' not in page
    assert _label(page, "secret_tinycloud_api_key") == 'Tiny API key <span class="muted">(optional)</span>'
    assert re.search(r'<input type="password" name="secret_tinycloud_api_key"', page)
    assert re.search(r'<input type="password" name="secret_tinycloud_note"', page)

    bad = owner_client.post(reverse("backend-create"), {"name": "tc", "kind": "tinycloud", "zone": "north",
                                                        "quota": "3", "secret_tinycloud_note": "n"})
    assert bad.context["form"].errors == {
        project: ["Tiny project is required for a Tiny Cloud backend."],
        "secret_tinycloud_api_key": ["api_key: required with the other Tiny Cloud secrets (give all of api_key, or "
                                     "none to use the worker's identity)."]}
    good = owner_client.post(reverse("backend-create"), {"name": "tc", "kind": "tinycloud", project: "vision",
                                                         "zone": "south", "quota": "3",
                                                         "secret_tinycloud_api_key": "k-123"})
    assert good.status_code == 302, good.context["form"].errors
    backend = ComputeBackend.objects.get(name="tc")
    assert (backend.config, backend.secrets) == ({"project": "vision", "zone": "south", "quota": 3}, {"api_key": "k-123"})


def test_the_admin_form_lists_the_new_providers_settings_and_checks_them(client, user, tinycloud):
    client.force_login(user)
    page = html.unescape(client.get(reverse("admin:jobs_computebackend_add")).content.decode())
    assert '<option value="tinycloud">Tiny Cloud</option>' in page
    assert ("<li>Tiny Cloud (tinycloud): project (Tiny project; required); zone (Tiny zone; north | south); "
            "quota (Tiny quota; whole number); endpoint (Tiny endpoint; staff only). Credentials (write-only, set "
            "from the backend form or the API): api_key (Tiny API key), note (Tiny note; optional).</li>") in page
    response = client.post(reverse("admin:jobs_computebackend_add"),
                           {"name": "tc", "kind": "tinycloud", "config": '{"zone": "east", "quota": 9}',
                            "enabled": "on", "state_deadlines": "{}"})
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["config"]
    assert errors == ["Tiny project is required for a Tiny Cloud backend.",
                      "Tiny zone: expected one of 'north', 'south', got 'east'.",
                      "Tiny quota: expected a number from 1 to 4, got 9."]
    assert not ComputeBackend.objects.filter(name="tc").exists()


def test_the_api_takes_and_describes_the_new_providers_settings(api_client, django_user_model, tinycloud):
    from rest_framework.test import APIClient

    schema = api_client.get(reverse("api-schema"), {"format": "json"}).json()
    backend = schema["components"]["schemas"]["Backend"]["properties"]
    assert "tinycloud" in schema["components"]["schemas"]["BackendKindEnum"]["enum"]  # ModelKindEnum is the other kind
    assert ("tinycloud: project (Tiny project; required); zone (Tiny zone; north | south); quota (Tiny quota; "
            "whole number); endpoint (Tiny endpoint; staff only).") in backend["config"]["description"]
    assert "tinycloud: api_key (Tiny API key), note (Tiny note; optional)" in backend["secrets"]["description"]

    missing = api_client.post("/api/backends/", {"name": "tc", "kind": "tinycloud", "config": {"quota": "2"}},
                              format="json")
    assert missing.status_code == 400
    assert missing.json() == {"config": ["Tiny project is required for a Tiny Cloud backend.",
                                         "Tiny quota: expected a whole number, got '2'."]}
    created = api_client.post("/api/backends/", {"name": "tc", "kind": "tinycloud", "config": {"project": "vision"},
                                                 "secrets": {"api_key": "k-1", "note": "n"}}, format="json")
    assert created.status_code == 201, created.content
    assert (created.json()["config"], created.json()["secrets_set"]) == ({"project": "vision"}, ["api_key", "note"])

    # The host setting is the operator's: a non-staff user's backend may not set it.
    theirs = APIClient()
    theirs.force_authenticate(django_user_model.objects.create_user(username="mallory", password="pw-mallory-9"))
    refused = theirs.post("/api/backends/", {"name": "tc", "kind": "tinycloud",
                                             "config": {"project": "vision", "endpoint": "http://127.0.0.1:9"}},
                          format="json")
    assert refused.status_code == 400
    assert refused.json()["config"][0].startswith("Tiny endpoint: only a backend owned by staff may set this")
