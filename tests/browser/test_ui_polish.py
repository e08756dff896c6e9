"""Pages a first-time user meets, in real Chromium (1280 px wide): the "Job … queued." banner goes
once the job has moved on; Test connection from the Backends list ends on a GET page (a reload does
not test again); the admin's job list names an unnamed job job-<id> and fits 1280 px."""

from __future__ import annotations

import re
from unittest import mock

import pytest

from jobs import dispatch, services
from jobs.models import JobStateChoices as S, TrainingJob
from jobs.states import transition
from taskkit import sent_tasks

pytestmark = pytest.mark.browser


def _log_in(page, live_server, username="alice", password="pw-alice-123"):
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/$"))


def test_queued_banner_goes_once_the_job_moved_on(live_server, browser_page, user, digits_dataset, cnn_model,
                                                  local_backend):
    page = browser_page
    page.set_default_timeout(30_000)
    _log_in(page, live_server)
    with sent_tasks(dispatch.SUBMIT_JOB):  # no worker: the test moves the job
        page.goto(f"{live_server.url}/jobs/new/")
        page.select_option("#id_backend", label="local")
        page.fill("#id_name", "banner")
        page.click("#launch")
        page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    job = TrainingJob.objects.get(name="banner")
    assert page.inner_text("ul.messages") == "Job banner queued."
    page.wait_for_timeout(2500)  # a poll that finds it still QUEUED keeps the banner
    assert page.locator("ul.messages").count() == 1

    transition(job, S.SUBMITTING)
    page.wait_for_selector('#job-live[data-state="SUBMITTING"]')
    assert page.locator("ul.messages").count() == 0
    assert "Job banner queued." not in page.inner_text("body")


def test_test_connection_from_the_list_redirects_to_the_edit_page(live_server, browser_page, user, local_backend):
    page = browser_page
    page.set_default_timeout(30_000)
    _log_in(page, live_server)
    page.goto(f"{live_server.url}/backends/")
    with mock.patch.object(services, "backend_test_connection", wraps=services.backend_test_connection) as tested:
        page.click("text=Test connection")
        page.wait_for_url(f"{live_server.url}/backends/{local_backend.pk}/edit/")
        assert page.inner_text("#connection-checks").split() == (
            "ok settings settings are valid; this backend has nothing remote to check").split()
        page.reload()
        page.wait_for_selector("#backend-form")
        assert tested.call_count == 1  # the reload was a GET of the edit page, not the POST again
    assert page.url == f"{live_server.url}/backends/{local_backend.pk}/edit/"
    assert page.locator("#connection-checks").count() == 0  # results are shown once


def test_admin_job_list_names_unnamed_jobs_and_fits_1280px(live_server, browser_page, user, digits_dataset,
                                                          cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        unnamed = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                               backend=local_backend, procs_per_node=2)
        services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                     backend=local_backend, procs_per_node=2,
                                     name="demo: digits-cnn DDP with a longer name than most")
    page = browser_page
    page.set_default_timeout(30_000)
    page.goto(f"{live_server.url}/admin/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("input[type=submit]")
    page.goto(f"{live_server.url}/admin/jobs/trainingjob/")
    page.wait_for_selector("#result_list")
    names = page.locator("#result_list tbody tr td.field-display_name, #result_list tbody tr th.field-display_name")
    assert sorted(names.all_inner_texts()) == sorted([f"job-{unnamed.pk}",
                                                      "demo: digits-cnn DDP with a longer name than most"])
    widths = page.evaluate("""() => ({
        page: document.documentElement.scrollWidth, viewport: document.documentElement.clientWidth,
        results: document.querySelector('.results').scrollWidth,
        resultsBox: document.querySelector('.results').clientWidth,
    })""")
    assert widths["page"] <= widths["viewport"], widths
    assert widths["results"] <= widths["resultsBox"], widths  # the table does not scroll sideways
