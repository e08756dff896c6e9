"""A job's priority in the form, the API and the service (bounded, every error at once), and the job
page of a job its GPU box holds back: the wait reason, the priority, the GPUs it holds."""

from __future__ import annotations

import re

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from jobs import services
from jobs.models import TrainingJob
from test_api import job_payload
from test_ui_forms import job_form_data

pytestmark = pytest.mark.django_db


def test_the_api_takes_a_priority_and_shows_it_with_the_wait_reason_and_gpus(api_client, digits_dataset, cnn_model,
                                                                            local_backend):
    response = api_client.post("/api/jobs/", job_payload(digits_dataset, cnn_model, local_backend, priority=7),
                               format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["priority"], body["wait_reason"], body["allocated_gpus"]) == (7, "", [])
    assert TrainingJob.objects.get().priority == 7


@pytest.mark.parametrize("value,message", [
    (101, "Ensure this value is less than or equal to 100."),
    (-101, "Ensure this value is greater than or equal to -100."),
    ("high", "A valid integer is required."),
    (10**30, "Ensure this value is less than or equal to 100."),
])
def test_the_api_refuses_a_priority_out_of_range(api_client, digits_dataset, cnn_model, local_backend, value, message):
    response = api_client.post("/api/jobs/", job_payload(digits_dataset, cnn_model, local_backend, priority=value),
                               format="json")
    assert response.status_code == 400
    assert response.json()["priority"] == [message]
    assert TrainingJob.objects.count() == 0


def test_the_service_bounds_the_priority_and_reports_it_with_the_other_errors(user, digits_dataset, cnn_model,
                                                                              local_backend):
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend,
                                     procs_per_node=2, priority=1000, epochs=0)
    errors = excinfo.value.message_dict
    assert errors["priority"] == ["Priority must be at most 100, got 1,000."]
    assert errors["epochs"] == ["Epochs must be at least 1, got 0."]
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, procs_per_node=2, priority="-3")
    assert job.priority == -3
    assert services.training_job_rerun(job=job, owner=user).priority == -3


def test_the_form_takes_a_priority_and_refuses_one_out_of_range(owner_client, digits_dataset, cnn_model, local_backend):
    response = owner_client.post(reverse("job-create"), job_form_data(digits_dataset, cnn_model, local_backend,
                                                                      priority="250"))
    assert response.status_code == 200
    assert response.context["form"].errors["priority"] == ["Ensure this value is less than or equal to 100."]
    response = owner_client.post(reverse("job-create"), job_form_data(digits_dataset, cnn_model, local_backend,
                                                                      priority="-5"))
    assert response.status_code == 302
    assert TrainingJob.objects.get().priority == -5
    assert 'name="priority"' in owner_client.get(reverse("job-create")).content.decode()


def test_the_job_page_shows_why_a_queued_job_waits_and_what_a_running_one_holds(owner_client, job):
    TrainingJob.objects.filter(pk=job.pk).update(wait_reason="waiting for 2 slots on local (0 free)", priority=4)
    live = owner_client.get(reverse("job-live", args=[job.pk])).content.decode()
    assert '<strong>Waiting.</strong> waiting for 2 slots on local (0 free)' in live
    assert "(priority 4;" in live and 'id="stat-priority"' in live
    TrainingJob.objects.filter(pk=job.pk).update(state="RUNNING", wait_reason="", allocated_gpus=[2, 3])
    live = owner_client.get(reverse("job-live", args=[job.pk])).content.decode()
    assert "Waiting." not in live and "given 2, 3" in live


def test_the_timeline_shows_a_wait_as_a_note_in_queued_not_a_move_from_queued_to_queued(owner_client, job):
    from jobs.models import JobEvent

    JobEvent.objects.create(job=job, from_state="QUEUED", to_state="QUEUED",
                            message="Waiting: waiting for 2 slots on local (0 free)")
    live = owner_client.get(reverse("job-live", args=[job.pk])).content.decode()
    timeline = live[live.index('id="timeline"'):]
    timeline = timeline[:timeline.index("</ol>")]
    entries = re.findall(r"<li[^>]*>(.*?)</li>", timeline, re.S)
    wait = [e for e in entries if "Waiting: waiting for 2 slots" in e]
    assert len(wait) == 1 and re.findall(r'data-state="(\w+)">', wait[0]) == ["QUEUED"] and "→" not in wait[0]
