"""The staff Orphans page (/orphans/) and its Stop button, through Django's test client, and the
admin's Stop action: a staff user sees the orphan and stops it (moto's job goes Stopping); a non-staff
user gets 403 on the page and on the button (the job keeps running); an anonymous visitor is sent to
the login page; the nav link is shown to staff only."""

from __future__ import annotations

import pytest
from django.urls import reverse

from adapter_standins import standin
from jobs import orphans
from jobs.models import OrphanJob, TrainingJob

pytestmark = pytest.mark.django_db

sagemaker_standin = standin("sagemaker")


@pytest.fixture
def orphan(aws, sm_backend, launch):
    job = launch(sm_backend)
    sagemaker_standin.set_status(job.provider_job_name, "InProgress", "Training")
    TrainingJob.objects.filter(pk=job.pk).delete()
    orphans.reconcile_orphans(sm_backend.pk)
    return OrphanJob.objects.get(backend=sm_backend)


def test_staff_sees_the_orphan_and_stops_it(client, user, orphan):
    client.force_login(user)
    page = client.get(reverse("orphan-list"))
    assert page.status_code == 200
    html = page.content.decode()
    assert orphan.provider_job_name in html
    assert f"#{orphan.job_id}" in html
    assert "InProgress" in html
    assert reverse("orphan-stop", args=[orphan.pk]) in html
    assert f'href="{reverse("orphan-list")}"' in html  # the nav link

    response = client.post(reverse("orphan-stop", args=[orphan.pk]), follow=True)

    assert response.redirect_chain == [(reverse("orphan-list"), 302)]
    assert f"Stop sent for {orphan.provider_job_name} on sm." in response.content.decode()
    assert sagemaker_standin.status(orphan.provider_job_name) == "Stopping"
    orphan.refresh_from_db()
    assert orphan.stop_requested_by == user and orphan.stop_requested_at is not None


def test_non_staff_is_refused_and_nothing_is_stopped(client, non_staff, orphan):
    client.force_login(non_staff)
    assert client.get(reverse("orphan-list")).status_code == 403
    assert client.post(reverse("orphan-stop", args=[orphan.pk])).status_code == 403
    assert sagemaker_standin.status(orphan.provider_job_name) == "InProgress"
    orphan.refresh_from_db()
    assert orphan.stop_requested_at is None
    jobs_page = client.get(reverse("job-list")).content.decode()
    assert reverse("orphan-list") not in jobs_page


def test_anonymous_is_sent_to_login(client, orphan):
    for response in (client.get(reverse("orphan-list")), client.post(reverse("orphan-stop", args=[orphan.pk]))):
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("login"))
    assert sagemaker_standin.status(orphan.provider_job_name) == "InProgress"


def test_unknown_orphan_is_404_and_get_on_stop_is_405(client, user, orphan):
    client.force_login(user)
    assert client.post(reverse("orphan-stop", args=[orphan.pk + 1000])).status_code == 404
    assert client.get(reverse("orphan-stop", args=[orphan.pk])).status_code == 405


def test_admin_stop_action(client, django_user_model, orphan):
    admin_user = django_user_model.objects.create_superuser(username="root", password="pw-root-123")
    client.force_login(admin_user)
    listing = client.get(reverse("admin:jobs_orphanjob_changelist"))
    assert listing.status_code == 200 and orphan.provider_job_name in listing.content.decode()

    response = client.post(reverse("admin:jobs_orphanjob_changelist"),
                           {"action": "stop_selected", "_selected_action": [orphan.pk]}, follow=True)

    assert "Stop sent for 1 orphan job." in response.content.decode()
    assert sagemaker_standin.status(orphan.provider_job_name) == "Stopping"
