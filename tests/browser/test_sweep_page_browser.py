"""The sweep page in real Chromium: the parallel-coordinates plot and the parameter-importance chart
are drawn (from the page's JSON block, no inline script), the best trial is marked, and Cancel sweep
asks first, then stops the sweep and its running trials."""

from __future__ import annotations

import pytest
from django.utils import timezone

from jobs import dispatch, sweeps
from jobs.models import JobStateChoices as S, MetricPoint, Sweep, TrainingJob
from jobs.states import transition
from taskkit import sent_tasks

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SPACE = {"train.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True},
         "train.optimizer": {"type": "categorical", "choices": ["sgd", "adamw"]}}


def login(page, live_server):
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/jobs/")


@pytest.fixture
def no_broker():
    with sent_tasks(dispatch.SUBMIT_JOB), sent_tasks(dispatch.CANCEL_JOB), sent_tasks(dispatch.SWEEP_FILL), \
            sent_tasks(dispatch.SWEEP_TRIAL_ENDED):
        yield


def _sweep(user, dataset, model, backend, **kwargs):
    return sweeps.sweep_create(owner=user, name="browser-sweep", sampler="random", seed=3, search_space=SPACE,
                               base={"dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk,
                                     "epochs": 1}, **kwargs)


def test_sweep_page_draws_both_charts_and_cancels(live_server, browser_page, no_broker, user, digits_dataset,
                                                  cnn_model, local_backend):
    done = _sweep(user, digits_dataset, cnn_model, local_backend, max_trials=5, max_concurrent_trials=5)
    sweeps.sweep_fill(sweep_id=done.pk)
    for job in TrainingJob.objects.filter(sweep=done).order_by("trial_number"):
        lr = job.config["train"]["lr"]
        MetricPoint.objects.create(job=job, name="val_accuracy", step=5, epoch=0, value=lr * 5,
                                   recorded_at=timezone.now())
        for state in (S.SUBMITTING, S.PENDING, S.RUNNING, S.SUCCEEDED):
            transition(job, state)
        sweeps.sweep_trial_ended(job_id=job.pk)
    done.refresh_from_db()
    assert done.state == Sweep.State.SUCCEEDED
    trials = sweeps.sweep_trials(sweep=done)
    best = sweeps.best_trial(done, trials)

    page = browser_page
    errors = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    login(page, live_server)
    page.goto(f"{live_server.url}/sweeps/{done.pk}/")
    page.wait_for_function("() => window.Chart && Chart.getChart(document.getElementById('chart-parallel'))")
    drawn = page.evaluate("""() => {
      const p = Chart.getChart(document.getElementById('chart-parallel'));
      const i = Chart.getChart(document.getElementById('chart-importance'));
      return {labels: p.data.labels, lines: p.data.datasets.length,
              points: p.getDatasetMeta(0).data.length,
              importance: i ? i.data.labels : null,
              bars: i ? i.getDatasetMeta(0).data.map(b => b.width > 0) : null};
    }""")
    assert drawn["labels"] == ["train.lr", "train.optimizer", "val_accuracy"]
    assert drawn["lines"] == 5 and drawn["points"] == 3
    assert sorted(drawn["importance"]) == ["train.lr", "train.optimizer"]
    assert any(drawn["bars"])
    row = page.locator(f"#trial-table tr[data-trial='{best['number']}']")
    assert "best" in (row.get_attribute("class") or "")
    assert "5 of 5 trials done, 0 running" in page.locator("#sweep-progress").inner_text()
    assert page.locator("#sweep-cancel").count() == 0  # an ended sweep has nothing to cancel

    running = _sweep(user, digits_dataset, cnn_model, local_backend, max_trials=4, max_concurrent_trials=2)
    sweeps.sweep_fill(sweep_id=running.pk)
    page.goto(f"{live_server.url}/sweeps/{running.pk}/")
    assert page.locator("#trial-table tr[data-state='RUNNING']").count() == 2
    page.once("dialog", lambda dialog: dialog.dismiss())
    page.click("#sweep-cancel")
    assert Sweep.objects.get(pk=running.pk).state == Sweep.State.RUNNING  # dismissed: nothing happens
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#sweep-cancel")
    page.wait_for_selector("#sweep-state[data-state='CANCELLED']")
    assert set(TrainingJob.objects.filter(sweep=running).values_list("state", flat=True)) == {S.CANCELLED}
    assert "no new trials" in page.locator("ul.messages").inner_text()
    assert errors == []
