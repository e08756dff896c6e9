"""The content security policy breaks no page: Chromium (Debian's, via Playwright) opens the pages
that use scripts — the job page with its Chart.js charts and htmx polling, the job form's estimate
(htmx), the backend form, Swagger UI — and reports no CSP violation and no script error."""

from __future__ import annotations

import re

import pytest

from jobs import dispatch
from taskkit import record_sent_tasks

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_pages_work_under_the_csp(live_server, browser_page, django_user_model, settings, tmp_path,
                                  monkeypatch):
    from django.utils import timezone

    from jobs import services
    from jobs.models import MetricPoint

    settings.TRAINBOARD_RUN_ROOT = tmp_path
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2  # a host setting: the installation's, not hana's
    user = django_user_model.objects.create_user(username="hana", password="pw-hana-Secret-1")
    digits = services.dataset_create(owner=user, name="digits", format="builtin", builtin_name="digits")
    cnn = services.model_spec_create(owner=user, name="cnn", architecture="cnn", params={})
    box = services.backend_create(owner=user, name="box", kind="gpubox",
                                  config={"hourly_rate_usd": 3.6})
    # No broker in this test: submissions and cancels are recorded, so the job stays QUEUED.
    record_sent_tasks(monkeypatch, dispatch.SUBMIT_JOB)
    record_sent_tasks(monkeypatch, dispatch.CANCEL_JOB)
    job = services.training_job_create(owner=user, dataset=digits, model_spec=cnn, backend=box, nodes=1,
                                       procs_per_node=1, epochs=1, name="csp-job")
    now = timezone.now()
    MetricPoint.objects.bulk_create([MetricPoint(job=job, name="train_loss", step=s, epoch=0, value=1.0 / s,
                                                 recorded_at=now) for s in range(1, 6)])

    page = browser_page
    page.set_default_timeout(20_000)
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(f"{page.url}: console {msg.type}: {msg.text[:160]}")
            if msg.type == "error" or "Content Security Policy" in msg.text else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))

    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "hana")
    page.fill("#id_password", "pw-hana-Secret-1")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/$"))

    # The job page: Chart.js draws the loss chart from the json_script data; htmx polls the fragment.
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => typeof Chart !== 'undefined' && Object.keys(Chart.instances).length > 0")
    with page.expect_response(re.compile(rf"/jobs/{job.pk}/live/")):
        pass  # the live fragment is fetched by htmx within its polling interval

    # Cancel asks first (a data-confirm listener, no inline handler): dismissing keeps the job queued.
    page.once("dialog", lambda dialog: dialog.dismiss())
    page.click("#cancel-job")
    page.wait_for_timeout(300)
    assert page.url.endswith(f"/jobs/{job.pk}/")
    from jobs.models import TrainingJob

    assert TrainingJob.objects.get(pk=job.pk).state == "QUEUED"
    dialogs: list[str] = []

    def accept(dialog):
        dialogs.append(dialog.message)
        dialog.accept()

    page.once("dialog", accept)
    with page.expect_navigation():
        page.click("#cancel-job")
    assert dialogs == ["Cancel this job?"]
    assert TrainingJob.objects.get(pk=job.pk).state == "CANCELLED"

    # The job form's estimate is an htmx request.
    page.goto(f"{live_server.url}/jobs/new/")
    page.fill("#id_max_runtime_s", "600")
    page.dispatch_event("#id_max_runtime_s", "change")
    page.wait_for_function("() => (document.getElementById('estimate-figure') || {}).textContent"
                           " === '$0.60 max (600 s × 1 node × $3.60/h)'")

    # The backend form hides the other kinds' settings (backend_form.js).
    page.goto(f"{live_server.url}/backends/new/")
    page.select_option("#id_kind", "sagemaker")
    page.wait_for_function("() => document.querySelector('fieldset[data-kind=gpubox]').hidden === true")

    # The backend page (its styles and no script of its own), and the job form's nodes note (job_form.js).
    page.goto(f"{live_server.url}/backends/{box.pk}/")
    page.wait_for_selector("#backend-queue")
    page.goto(f"{live_server.url}/jobs/new/")
    page.wait_for_selector("#nodes-note")

    # Swagger UI renders the schema.
    page.goto(f"{live_server.url}/api/docs/")
    page.wait_for_selector("#swagger-ui .info .title")

    assert not problems, "\n".join(problems)
