"""A GPU box in real Chromium: from a waiting job's page to its backend's page, which shows why the
job waits and which GPUs the running job holds; the job form's note beside the nodes field (a GPU
box runs a job on one machine), gone for a cloud backend."""

from __future__ import annotations

import re

import pytest

from jobs import dispatch, services
from jobs.models import JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = pytest.mark.browser

NOTE = "A GPU box runs a job on one machine; multi-node jobs go to a Slurm or Kubernetes backend."


def _log_in(page, live_server, username="alice", password="pw-alice-123"):
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/$"))


def _job(user, dataset, model, backend, **fields):
    with sent_tasks(dispatch.SUBMIT_JOB):  # no worker: the rows say what the box's admission would
        job = services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                           nodes=1, procs_per_node=1, epochs=1, name=fields.pop("name"))
    TrainingJob.objects.filter(pk=job.pk).update(**fields)
    return job


def test_from_a_waiting_job_to_its_box_and_why_it_waits(live_server, browser_page, user, digits_dataset, cnn_model,
                                                        local_backend):
    running = _job(user, digits_dataset, cnn_model, local_backend, name="big", state=S.RUNNING,
                   allocated_gpus=[0, 1])
    waiting = _job(user, digits_dataset, cnn_model, local_backend, name="small",
                   wait_reason="waiting for 2 GPUs on local (0 free)")
    page = browser_page
    page.set_default_timeout(30_000)
    _log_in(page, live_server)
    page.goto(f"{live_server.url}/jobs/{waiting.pk}/")
    page.click("#job-backend-link")
    page.wait_for_url(f"{live_server.url}/backends/{local_backend.pk}/")
    assert page.inner_text("h1") == "Backend local"
    assert page.inner_text("#backend-queue") == "gpubox.local"
    row = page.locator(f'tr.waiting-job[data-job="{waiting.pk}"]')
    assert row.locator(".wait-reason").inner_text() == "waiting for 2 GPUs on local (0 free)"
    assert page.locator("#backend-devices li").all_inner_texts() == [f"device 0,1 → job #{running.pk}"]
    page.click(f'#backend-devices a:has-text("job #{running.pk}")')
    page.wait_for_url(f"{live_server.url}/jobs/{running.pk}/")


def test_the_job_form_says_a_box_runs_one_machine_beside_the_nodes_field(live_server, browser_page, user,
                                                                         digits_dataset, cnn_model, local_backend):
    services.backend_create(owner=user, name="sm", kind="sagemaker",
                            config={"role_arn": "arn:aws:iam::123456789012:role/x", "bucket": "tb-bucket",
                                    "region": "us-east-1"},
                            secrets={"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": "s"})
    page = browser_page
    page.set_default_timeout(30_000)
    _log_in(page, live_server)
    page.goto(f"{live_server.url}/jobs/new/")
    page.select_option("#id_backend", label="local")
    note = page.locator("#field-nodes #nodes-note")
    assert note.is_visible() and note.inner_text() == NOTE
    assert "error" not in note.get_attribute("class")
    page.fill("#id_nodes", "2")
    page.wait_for_selector("#nodes-note.error")  # asked for more than a box runs: said as a warning
    page.select_option("#id_backend", label="sm")
    page.wait_for_selector("#nodes-note", state="hidden")
    page.select_option("#id_backend", label="local")
    page.wait_for_selector("#nodes-note.error")
    # The server says the same when the form is sent anyway.
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        page.click("#launch")
        page.wait_for_selector("#field-nodes p.error:not(#nodes-note)")
    assert page.locator("#field-nodes p.error:not(#nodes-note)").inner_text() == f"2 nodes requested. {NOTE}"
    send.assert_not_called()
