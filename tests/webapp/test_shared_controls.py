"""A teammate sees shared objects without the owner's controls; a refused action explains itself.

Only the owner or staff may change an object: the views answer 403 to a teammate's edit, test
connection, cancel or re-run. The pages therefore offer those controls only to whoever may use them,
and the 403 page (templates/403.html) is the site's own page with the reason, not Django's bare one.
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs import services
from jobs.models import Team

pytestmark = pytest.mark.django_db


@pytest.fixture
def teammate(django_user_model):
    """carol: signed-in, not staff (staff may change anything)."""
    return django_user_model.objects.create_user(username="carol", password="pw-carol-123")


@pytest.fixture
def shared(user, teammate, digits_dataset, cnn_model, local_backend):
    """alice's dataset, model and backend shared with team vision (alice and carol), and a job of hers."""
    team = Team.objects.create(name="vision")
    team.members.add(user, teammate)
    for obj in (digits_dataset, cnn_model, local_backend):
        obj.team = team
        obj.save(update_fields=["team"])
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, team=team)
    return {"dataset": digits_dataset, "model": cnn_model, "backend": local_backend, "job": job}


@pytest.mark.parametrize("page, edit_url", [
    ("dataset-list", "dataset-edit"), ("model-list", "model-edit"), ("backend-list", "backend-edit")])
def test_lists_offer_edit_to_the_owner_only(client, user, teammate, shared, page, edit_url):
    obj = {"dataset-edit": shared["dataset"], "model-edit": shared["model"], "backend-edit": shared["backend"]}[edit_url]
    edit = reverse(edit_url, args=[obj.pk])

    client.force_login(user)
    html = client.get(reverse(page)).content.decode()
    assert f'href="{edit}"' in html and ">shared<" not in html

    client.force_login(teammate)
    html = client.get(reverse(page)).content.decode()
    assert obj.name in html  # carol sees it...
    assert f'href="{edit}"' not in html and ">shared</span>" in html  # ...without the owner's controls
    if page == "backend-list":
        assert reverse("backend-test-connection", args=[obj.pk]) not in html


def test_job_page_offers_cancel_and_rerun_to_the_owner_only(client, user, teammate, shared):
    url = reverse("job-detail", args=[shared["job"].pk])
    client.force_login(user)
    html = client.get(url).content.decode()
    assert 'id="cancel-job"' in html and 'id="rerun-job"' in html
    client.force_login(teammate)
    html = client.get(url).content.decode()
    assert shared["job"].provider_job_name in html or str(shared["job"]) in html
    assert 'id="cancel-job"' not in html and 'id="rerun-job"' not in html


def test_a_refused_change_shows_the_reason_on_the_sites_own_page(client, teammate, shared):
    client.force_login(teammate)
    r = client.get(reverse("dataset-edit", args=[shared["dataset"].pk]))
    html = r.content.decode()
    assert r.status_code == 403
    assert 'id="forbidden"' in html and 'class="topbar"' in html
    assert "Only the owner (or staff) can change this; it is shared with you to see and use." in html


def test_an_unknown_page_is_the_sites_own_404(client, user):
    client.force_login(user)
    r = client.get("/jobs/999999/")
    assert r.status_code == 404
    assert 'id="not-found"' in r.content.decode() and "/jobs/999999/" in r.content.decode()


def test_favicon_ico_leads_to_the_apps_icon(client):
    r = client.get("/favicon.ico")
    assert r.status_code == 302 and r["Location"].endswith("/static/webapp/favicon.svg")
    assert client.get(r["Location"]).status_code == 200
