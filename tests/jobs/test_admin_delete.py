"""The admin's "Delete selected" and delete page for training jobs (jobs/admin.py): jobs that have not
ended are refused with a message naming them and nothing is deleted (a running job's cloud
resources would be left behind); ended jobs are deleted with their events, metrics and log lines."""

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
