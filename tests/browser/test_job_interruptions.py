"""A spot job's interruptions on the job page in a real browser: the Interruptions stat shows the
count, and each interruption on the timeline is labelled and marked in the warning colour."""

from __future__ import annotations

import pytest

from jobs import services
from jobs.models import JobStateChoices as S, TrainingJob
from jobs.states import transition
from test_job_chart import login

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_interruptions_are_counted_and_marked_on_the_timeline(live_server, browser_page, artifacts_dir, user,
                                                              digits_dataset, cnn_model, local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
    TrainingJob.objects.filter(pk=job.pk).update(spot=True)
    job.refresh_from_db()
    for state, message in [(S.SUBMITTING, ""), (S.PENDING, ""), (S.RUNNING, "InProgress / Training"),
                           (S.PENDING, "InProgress / Interrupted"), (S.RUNNING, "InProgress / Training"),
                           (S.PENDING, "InProgress / Interrupted"), (S.RUNNING, "InProgress / Training")]:
        assert transition(job, state, message=message)
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")

    stat = page.locator("#stat-interruptions")
    assert stat.is_visible()
    assert page.locator("#stat-interruption-count").inner_text() == "2"
    marked = page.locator("#timeline li.interruption")
    assert marked.count() == 2
    for i in range(2):
        item = marked.nth(i)
        assert item.locator(".interruption-label").inner_text() == "Interrupted"
        assert "InProgress / Interrupted" in item.inner_text()
        dot = item.evaluate("li => getComputedStyle(li, '::before').backgroundColor")
        assert dot == "rgb(217, 119, 6)"
    # The other transitions keep the plain marker.
    plain = page.locator("#timeline li:not(.interruption)").first
    assert plain.evaluate("li => getComputedStyle(li, '::before').backgroundColor") != "rgb(217, 119, 6)"
    page.locator("#job-stats").screenshot(path=str(artifacts_dir / "job-interruptions-stats.png"))
    page.locator("#job-details").screenshot(path=str(artifacts_dir / "job-interruptions.png"))
