"""Issue 6 leftovers in the UI and the admin.

* The admin's "Delete selected" on jobs that have not ended: refused with a message naming them,
  nothing deleted; ended jobs are deleted with their events, metrics and log lines.
* The HTML job list names a bad ``?state=`` or ``?backend=`` (400, like the API) instead of silently
  showing every job.
* The job form preselects the backend of the user's newest job, not the alphabetically first.
"""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils import timezone

from jobs import services
from jobs.models import JobEvent, JobStateChoices as S, MetricPoint, TrainingJob
from jobs.states import transition

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:jobs_trainingjob_changelist"


def _job(user, dataset, model, backend, name: str) -> TrainingJob:
    return services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                        nodes=1, procs_per_node=1, epochs=1, name=name)


def _ended(job: TrainingJob) -> TrainingJob:
    services.training_job_cancel(job=job, reason="test")
    job.refresh_from_db()
    assert job.state == S.CANCELLED
    return job


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


# --- (a) admin: Delete selected ----------------------------------------------------------------------


def test_admin_delete_selected_refuses_active_jobs_by_name_and_deletes_nothing(
        client, user, digits_dataset, cnn_model, local_backend):
    queued = _job(user, digits_dataset, cnn_model, local_backend, "")  # unnamed: job-<id>, as the list shows it
    running = _job(user, digits_dataset, cnn_model, local_backend, "now-running")
    transition(running, S.SUBMITTING)
    transition(running, S.RUNNING)
    ended = _ended(_job(user, digits_dataset, cnn_model, local_backend, "ended"))
    client.force_login(user)

    # Offered on the list (the action is ours, with its own label).
    listing = client.get(reverse(CHANGELIST)).content.decode()
    assert '<option value="delete_selected">Delete selected training jobs</option>' in listing

    for confirm in ({}, {"post": "yes"}):  # the first step and a forged confirmation alike
        response = client.post(reverse(CHANGELIST), {"action": "delete_selected", **confirm,
                                                     "_selected_action": [queued.pk, running.pk, ended.pk]},
                               follow=True)
        assert response.redirect_chain == [(reverse(CHANGELIST), 302)] and response.status_code == 200
        expected = (
            f"Nothing was deleted: 2 of the selected jobs have not ended: #{queued.pk} job-{queued.pk} (QUEUED), "
            f"#{running.pk} now-running (RUNNING). Cancel them (action “Cancel selected jobs”) and delete them "
            f"once they have ended, or select only ended jobs.")
        assert [str(m) for m in response.context["messages"]] == [expected]
        assert expected in response.content.decode()  # shown on the list the redirect lands on
        assert set(TrainingJob.objects.values_list("pk", flat=True)) == {queued.pk, running.pk, ended.pk}


def test_admin_delete_selected_deletes_ended_jobs_with_their_history(
        client, user, digits_dataset, cnn_model, local_backend):
    ended = _ended(_job(user, digits_dataset, cnn_model, local_backend, "ended"))
    MetricPoint.objects.create(job=ended, name="train_loss", step=1, value=0.5, recorded_at=timezone.now())
    keep = _job(user, digits_dataset, cnn_model, local_backend, "keep")
    assert JobEvent.objects.filter(job=ended).count() >= 2
    client.force_login(user)

    confirm = client.post(reverse(CHANGELIST), {"action": "delete_selected", "_selected_action": [ended.pk]})
    assert confirm.status_code == 200
    text = _text(confirm.content.decode())
    assert "Are you sure you want to delete the selected training job?" in text, text[-1500:]
    assert "permission" not in text  # the read-only event/metric admins do not block it

    done = client.post(reverse(CHANGELIST), {"action": "delete_selected", "post": "yes",
                                             "_selected_action": [ended.pk]})
    assert done.status_code == 302
    from django.contrib.messages import get_messages

    assert [str(m) for m in get_messages(done.wsgi_request)] == ["Successfully deleted 1 training job."]
    assert list(TrainingJob.objects.values_list("pk", flat=True)) == [keep.pk]
    assert not JobEvent.objects.filter(job_id=ended.pk).exists()
    assert not MetricPoint.objects.filter(job_id=ended.pk).exists()


def test_admin_delete_page_of_an_ended_job_works_and_of_an_active_one_is_not_offered(
        client, user, digits_dataset, cnn_model, local_backend):
    active = _job(user, digits_dataset, cnn_model, local_backend, "active")
    ended = _ended(_job(user, digits_dataset, cnn_model, local_backend, "ended"))
    client.force_login(user)
    change = client.get(reverse("admin:jobs_trainingjob_change", args=[active.pk])).content.decode()
    assert reverse("admin:jobs_trainingjob_delete", args=[active.pk]) not in change
    response = client.post(reverse("admin:jobs_trainingjob_delete", args=[ended.pk]), {"post": "yes"})
    assert response.status_code == 302
    assert list(TrainingJob.objects.values_list("pk", flat=True)) == [active.pk]


# --- (b) the HTML job list's filters -----------------------------------------------------------------


def test_job_list_names_an_unknown_state_instead_of_ignoring_it(owner_client, job, api_client):
    response = owner_client.get(reverse("job-list"), {"state": "BOGUS"})
    assert response.status_code == 400
    page = response.content.decode()
    problems = re.search(r'<ul class="messages" role="alert" id="filter-problems">(.*?)</ul>', page, re.S)
    assert problems, page[:3000]
    assert _text(problems.group(1)).strip() == (
        "State “BOGUS” is not a job state; choose one of " + ", ".join(S.values)
        + ". The list below shows every state.")
    assert "digits-ddp" in page  # the other filters (none here) still apply
    # The API says 400 for the same query.
    assert api_client.get(reverse("api-job-list"), {"state": "BOGUS"}).status_code == 400


def test_job_list_names_a_backend_that_is_not_yours(owner_client, job, other_user):
    other = services.backend_create(owner=other_user, name="theirs", kind="gpubox", config={})
    for value in ("abc", str(other.pk), "999999"):
        response = owner_client.get(reverse("job-list"), {"backend": value, "state": "QUEUED"})
        assert response.status_code == 400, value
        text = _text(response.content.decode())
        assert (f"Backend “{value}” is not one of your backends; choose one from the Backend list. "
                f"The list below shows every backend.") in text
        assert "digits-ddp" in text  # state=QUEUED still filters, and the job is queued


def test_job_list_valid_filters_have_no_message(owner_client, job, local_backend):
    response = owner_client.get(reverse("job-list"), {"state": "QUEUED", "backend": local_backend.pk, "q": "ddp"})
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="filter-problems"' not in page and "digits-ddp" in page
    response = owner_client.get(reverse("job-list"), {"state": "RUNNING"})
    assert response.status_code == 200 and "digits-ddp" not in response.content.decode()


# --- (c) the job form's default backend ---------------------------------------------------------------


def _selected_backend(html: str) -> str:
    select = re.search(r'<select name="backend"[^>]*>(.*?)</select>', html, re.S)
    assert select, html[:2000]
    chosen = re.findall(r'<option value="(\d+)"[^>]*selected', select.group(1))
    return chosen[0] if chosen else ""


def test_job_form_preselects_the_backend_of_the_users_newest_job(owner_client, user, other_user, digits_dataset,
                                                                  cnn_model):
    alpha = services.backend_create(owner=user, name="alpha", kind="gpubox", config={})
    zulu = services.backend_create(owner=user, name="zulu", kind="gpubox", config={})
    # No job yet: the first in the list (alphabetical), as before.
    page = owner_client.get(reverse("job-create")).content.decode()
    assert page.index(">alpha<") < page.index(">zulu<")
    assert _selected_backend(page) in ("", str(alpha.pk))

    _job(user, digits_dataset, cnn_model, alpha, "first")
    _job(user, digits_dataset, cnn_model, zulu, "newest")
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(zulu.pk)

    # A disabled backend is not preselected, however new its last job: the newest on an enabled one is.
    services.backend_update(backend=zulu, enabled=False)
    _job(user, digits_dataset, cnn_model, alpha, "again")
    zulu_job = TrainingJob.objects.get(name="newest")
    TrainingJob.objects.filter(pk=zulu_job.pk).update(created_at=zulu_job.created_at.replace(year=2099))
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(alpha.pk)


def test_job_form_does_not_preselect_a_cloud_backend_without_credentials(owner_client, user, digits_dataset,
                                                                       cnn_model):
    """Issue 11: "aws" (SageMaker, nothing stored, never used) sorts before "local" but would fail at
    submit; the form selects the GPU box. Once a job on "aws" was accepted by SageMaker (its default
    credential chain works), or secrets are stored on it, it may be chosen again."""
    config = {"region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerTraining",
              "bucket": "tb-test-bucket"}
    aws = services.backend_create(owner=user, name="aws", kind="sagemaker", config=config)
    local = services.backend_create(owner=user, name="local", kind="gpubox", config={})
    page = owner_client.get(reverse("job-create")).content.decode()
    assert page.index(">aws<") < page.index(">local<")
    assert _selected_backend(page) == str(local.pk)

    # Its newest job was on "aws" but never reached SageMaker (credentials unknown): still "local".
    on_aws = _job(user, digits_dataset, cnn_model, aws, "never-submitted")
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(local.pk)

    # SageMaker accepted it: the newest job's backend is chosen, as for any backend.
    TrainingJob.objects.filter(pk=on_aws.pk).update(submitted_at=timezone.now())
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(aws.pk)

    # Stored access keys count as credentials at hand too.
    keyed = services.backend_create(owner=user, name="aaa-keyed", kind="sagemaker", config=config,
                                    secrets={"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": "s3cr3t"})
    TrainingJob.objects.all().delete()
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(keyed.pk)
