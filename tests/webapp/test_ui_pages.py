"""Every page renders for its owner; anonymous users are sent to log in; another user's objects
are 404s (webapp/views.py)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs.models import TrainingJob

pytestmark = pytest.mark.django_db


def owner_pages(job):
    return [
        reverse("job-list"),
        reverse("job-list") + "?state=QUEUED&backend=%d&q=digits" % job.backend_id,
        reverse("job-create"),
        reverse("job-detail", args=[job.pk]),
        reverse("job-live", args=[job.pk]),
        reverse("job-metrics", args=[job.pk]),
        reverse("dataset-list"),
        reverse("dataset-create"),
        reverse("dataset-edit", args=[job.dataset_id]),
        reverse("model-list"),
        reverse("model-create"),
        reverse("model-edit", args=[job.model_spec_id]),
        reverse("backend-list"),
        reverse("backend-create"),
        reverse("backend-edit", args=[job.backend_id]),
        reverse("backend-detail", args=[job.backend_id]),
    ]


def test_every_page_renders_for_the_owner(owner_client, seeded_job):
    for url in owner_pages(seeded_job):
        response = owner_client.get(url)
        assert response.status_code == 200, url


def test_lists_show_the_owners_objects(owner_client, seeded_job):
    assert b"digits-ddp" in owner_client.get(reverse("job-list")).content
    assert b"digits-cnn" in owner_client.get(reverse("model-list")).content
    assert b"local" in owner_client.get(reverse("backend-list")).content
    page = owner_client.get(reverse("dataset-list")).content.decode()
    assert "digits" in page and "Built-in" in page


def test_base_layout_has_nav_links(owner_client, job):
    page = owner_client.get(reverse("job-list")).content.decode()
    for href in ("/jobs/", "/datasets/", "/models/", "/backends/", "/admin/", "/api/docs/"):
        assert f'href="{href}"' in page
    assert 'action="/logout/"' in page
    assert "django_htmx/htmx-2.min.js" in page


def test_admin_link_only_for_staff(client, django_user_model):
    plain = django_user_model.objects.create_user(username="carol", password="pw-carol-123")
    client.force_login(plain)
    page = client.get(reverse("job-list")).content.decode()
    assert 'href="/admin/"' not in page


def test_anonymous_is_redirected_to_login(client, job):
    for url in owner_pages(job):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("login") + "?next="), url
    for name in ("job-cancel", "job-rerun"):
        response = client.post(reverse(name, args=[job.pk]))
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("login"))
    assert TrainingJob.objects.get(pk=job.pk).state == "QUEUED"
    assert TrainingJob.objects.count() == 1


def test_login_page_and_login_flow(client, user):
    assert client.get(reverse("login")).status_code == 200
    response = client.post(reverse("login"), {"username": "alice", "password": "pw-alice-123"})
    assert response.status_code == 302
    assert response["Location"] == reverse("job-list")
    client.logout()
    bad = client.post(reverse("login"), {"username": "alice", "password": "wrong"})
    assert bad.status_code == 200
    assert "Please enter a correct username and password" in bad.content.decode()


def test_logout_is_a_post(owner_client):
    response = owner_client.post(reverse("logout"))
    assert response.status_code == 302
    assert owner_client.get(reverse("job-list")).status_code == 302


def test_another_users_objects_are_404(other_client, seeded_job):
    job = seeded_job
    for url in [
        reverse("job-detail", args=[job.pk]),
        reverse("job-live", args=[job.pk]),
        reverse("job-metrics", args=[job.pk]),
        reverse("dataset-edit", args=[job.dataset_id]),
        reverse("model-edit", args=[job.model_spec_id]),
        reverse("backend-edit", args=[job.backend_id]),
    ]:
        assert other_client.get(url).status_code == 404, url
    assert other_client.post(reverse("dataset-edit", args=[job.dataset_id]),
                             {"name": "stolen", "format": "builtin", "builtin_name": "digits"}).status_code == 404
    assert other_client.post(reverse("job-cancel", args=[job.pk])).status_code == 404
    assert other_client.post(reverse("job-rerun", args=[job.pk])).status_code == 404
    job.refresh_from_db()
    assert job.state == "RUNNING"
    assert job.dataset.name == "digits"
    assert TrainingJob.objects.count() == 1
    # Their own lists do not show it either.
    assert b"digits-ddp" not in other_client.get(reverse("job-list")).content


def test_unknown_pk_is_404(owner_client, job):
    assert owner_client.get(reverse("job-detail", args=[job.pk + 1000])).status_code == 404
    assert owner_client.get(reverse("dataset-edit", args=[99999])).status_code == 404


def test_healthz(client, db):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"db": "ok"}


def test_static_assets_are_served(live_server):
    """Chart.js (npm), htmx (django-htmx) and our CSS come from this server, not a CDN."""
    import urllib.request

    for path in ("/static/chart.umd.min.js", "/static/django_htmx/htmx-2.min.js",
                 "/static/webapp/css/app.css", "/static/webapp/js/job.js",
                 "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js"):
        with urllib.request.urlopen(live_server.url + path) as response:
            assert response.status == 200, path
            assert len(response.read()) > 500, path
