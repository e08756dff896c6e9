"""The whole path in a real browser: log in, launch a job from the form, watch the job page reach
SUCCEEDED without reloading while a real Celery worker runs it on the local gpubox, and check both
charts drew points (Chart.js instances read in the page)."""

from __future__ import annotations

import re

import pytest

from jobs.models import TrainingJob

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

CHART_POINTS_JS = """(id) => {
  const chart = Chart.getChart(document.getElementById(id));
  return chart ? chart.data.datasets.map(d => d.data.length) : null;
}"""


def test_launch_job_and_watch_it_succeed(live_server, celery_worker_process, browser_page, artifacts_dir,
                                         user, digits_dataset, cnn_model, local_backend):
    page = browser_page
    page.set_default_timeout(30_000)
    console_errors: list[str] = []
    page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)

    # Log in.
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/$"))

    # The job form: digits, cnn, the gpubox backend, 2 processes, 3 epochs; the estimate updates.
    page.goto(f"{live_server.url}/jobs/new/")
    page.select_option("#id_dataset", label="digits")
    page.select_option("#id_model_spec", label="digits-cnn")
    page.select_option("#id_backend", label="local")
    page.fill("#id_name", "browser-digits")
    page.fill("#id_procs_per_node", "2")
    page.fill("#id_epochs", "3")
    page.fill("#id_max_runtime_s", "600")
    page.dispatch_event("#id_max_runtime_s", "change")
    page.wait_for_function(
        "() => (document.getElementById('estimate-figure') || {}).textContent"
        " === '$0.60 max (600 s × 1 node × $3.60/h)'")
    # The memory plan beside it: this box has no GPU, so the plan is checked against its host memory.
    plan = page.inner_text("#memory-plan-summary")
    assert re.fullmatch(r"Memory: needs [\d.]+ [KM]iB per rank; backend \S+'s host \(no GPU; [\d.]+ GiB of host memory, "
                        r"a job may use [\d.]+ GiB \(its memory limit\): [\d.]+ GiB per rank for 2 ranks\) has [\d.]+ GiB",
                        plan), plan
    page.click("#launch")
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    job = TrainingJob.objects.get(name="browser-digits")
    assert (job.nodes, job.procs_per_node, job.config["train"]["epochs"]) == (1, 2, 3)

    # Watch it run: htmx swaps the live fragment; the page itself never reloads.
    page.evaluate("window.__sameDocument = true")
    page.wait_for_selector('#job-live[data-state="SUCCEEDED"]', timeout=240_000)
    assert page.evaluate("window.__sameDocument") is True
    assert page.locator("#cancel-job").count() == 0
    job.refresh_from_db()
    assert job.state == "SUCCEEDED", (job.state, job.failure_reason, celery_worker_process.log()[-3000:])

    # Both charts drew train and validation points (the final fetch follows the last swap).
    page.wait_for_function(
        "() => ['chart-loss', 'chart-accuracy'].every(id => {"
        " const c = Chart.getChart(document.getElementById(id));"
        " return c && c.data.datasets.slice(0, 2).every(d => d.data.length > 0); })",
        timeout=15_000,
    )
    loss = page.evaluate(CHART_POINTS_JS, "chart-loss")
    accuracy = page.evaluate(CHART_POINTS_JS, "chart-accuracy")
    assert all(n > 0 for n in loss[:2]) and all(n > 0 for n in accuracy[:2]), (loss, accuracy)
    assert loss[2] == accuracy[2] == 0  # no non-finite value to mark
    # The val series has one point per epoch.
    assert loss[1] == accuracy[1] == 3
    # The same Chart instances the page created at load were updated, not replaced.
    assert page.evaluate("Chart.getChart(document.getElementById('chart-loss')) === window.trainboardCharts['chart-loss']")

    # Timeline, rank table and log were re-rendered by the polling.
    timeline = page.inner_text("#timeline")
    for state in ("Queued", "Submitting", "Pending", "Running", "Succeeded"):
        assert state in timeline
    assert page.locator("#rank-table tbody tr").count() == 2
    assert page.inner_text("#log-tail").strip() != "No log output yet."

    page.screenshot(path=str(artifacts_dir / "job-succeeded.png"), full_page=True)
    assert not console_errors, console_errors
