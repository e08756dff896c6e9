"""The experiment table in real Chromium (docs/experiments.md): add a hyperparameter column, sort by it
both ways, tag a job and filter by the tag, archive one, select two and read the Compare link, and
page and search a job's full log."""

from __future__ import annotations

import re

import pytest

from experimentkit import make_job
from jobs.models import JobLogLine, TrainingJob

pytestmark = pytest.mark.browser


def _log_in(page, live_server):
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/$"))


def _row_names(page) -> list[str]:
    return [page.inner_text(f'tr[data-job="{pk}"] td:nth-child(2) strong')
            for pk in page.eval_on_selector_all("#job-table tbody tr", "rows => rows.map(r => r.dataset.job)")]


def test_columns_sort_tags_archive_compare_and_log(live_server, browser_page, artifacts_dir, user, digits_dataset,
                                                   cnn_model, local_backend):
    jobs = {name: make_job(user, digits_dataset, cnn_model, local_backend, name=name,
                           final_metrics={"val_accuracy": acc, "val_loss": 1 - acc, "train_loss": 0.4},
                           config={"train": {"lr": lr, "batch_size": 32}})
            for name, acc, lr in (("lr-small", 0.71, 0.01), ("lr-big", 0.93, 0.2), ("lr-mid", 0.85, 0.05))}
    logged = jobs["lr-mid"]
    JobLogLine.objects.bulk_create(JobLogLine(job=logged, seq=i, text=f"step {i} loss {1 / (i + 1):.4f}")
                                   for i in range(700))
    page = browser_page
    page.set_default_timeout(30_000)
    console_errors: list[str] = []
    failed: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    _log_in(page, live_server)

    # Add a hyperparameter column and sort by it, ascending then descending.
    page.fill("#columns-input", "val_accuracy,train.lr")
    page.click("#columns-show")
    page.wait_for_selector('th[data-column="train.lr"]')
    assert page.locator('th[data-column="val_loss"]').count() == 0
    page.click('th[data-column="train.lr"] a')
    page.wait_for_url(re.compile(r"sort=train\.lr"))
    assert _row_names(page) == ["lr-small", "lr-mid", "lr-big"]
    page.click('th[data-column="train.lr"] a')
    page.wait_for_url(re.compile(r"sort=-train\.lr"))
    assert _row_names(page) == ["lr-big", "lr-mid", "lr-small"]
    assert page.inner_text('tr[data-job="%d"] td:nth-last-child(2)' % jobs["lr-big"].pk) == "0.93"
    assert page.inner_text('tr[data-job="%d"] td:last-child' % jobs["lr-big"].pk) == "0.2"

    # Select two: the Compare link carries their ids in row order.
    page.check(f'input.job-select[value="{jobs["lr-mid"].pk}"]')
    page.check(f'input.job-select[value="{jobs["lr-small"].pk}"]')
    assert page.get_attribute("#compare-selected", "href") == (
        f"/jobs/compare/?ids={jobs['lr-mid'].pk},{jobs['lr-small'].pk}")
    assert page.inner_text("#compare-selected") == "Compare selected (2)"

    # Tag a job on its page; the list filters by the tag.
    page.click(f'tr[data-job="{jobs["lr-big"].pk}"] td:nth-child(2) a')
    page.wait_for_url(re.compile(rf"/jobs/{jobs['lr-big'].pk}/$"))
    page.fill("#job-tags-input", "Best, lr-sweep")
    page.click("#annotate-save")
    page.wait_for_selector("text=Tags and notes saved.")
    assert TrainingJob.objects.get(pk=jobs["lr-big"].pk).tags == ["best", "lr-sweep"]
    page.goto(f"{live_server.url}/jobs/")
    page.click('a.tag:has-text("best")')
    page.wait_for_url(re.compile(r"\?tag=best$"))
    assert _row_names(page) == ["lr-big"]

    # Archive it from its page: gone from the default list, shown with "Archived only".
    page.goto(f"{live_server.url}/jobs/{jobs['lr-big'].pk}/")
    page.click("#archive-button")
    page.wait_for_selector("#archived-badge")
    page.goto(f"{live_server.url}/jobs/")
    assert sorted(_row_names(page)) == ["lr-mid", "lr-small"]
    page.select_option("#filter-archived", "1")
    page.click("form[role=search] button[type=submit]")
    page.wait_for_url(re.compile(r"archived=1"))
    assert _row_names(page) == ["lr-big"]

    # The full log: the newest page first, the oldest one page back, and a search.
    page.goto(f"{live_server.url}/jobs/{logged.pk}/")
    page.click("#full-log-link")
    page.wait_for_url(re.compile(rf"/jobs/{logged.pk}/logs/$"))
    assert "page 2 of 2" in page.inner_text("#log-summary")
    assert page.locator("#log-lines .log-line").first.get_attribute("data-seq") == "500"
    page.click("#log-first")
    page.wait_for_url(re.compile(r"page=1"))
    assert page.locator("#log-lines .log-line").first.get_attribute("data-seq") == "0"
    assert "step 0 loss 1.0000" in page.locator("#log-lines .log-line").first.inner_text()
    page.fill("#log-q", "STEP 69")
    page.click("#log-filter-apply")
    page.wait_for_url(re.compile(r"q=STEP\+69"))
    seqs = page.eval_on_selector_all("#log-lines .log-line", "lines => lines.map(l => l.dataset.seq)")
    assert seqs == ["69"] + [str(i) for i in range(690, 700)]
    page.screenshot(path=str(artifacts_dir / "experiment-log.png"), full_page=True)
    assert not console_errors, console_errors
    assert failed == []  # the chart plugins under static/vendor/ come from npm (make static)
