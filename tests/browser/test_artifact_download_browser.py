"""The job page's artifacts in Chromium: a finished GPU-box job (a real digits run of the trainer
under torchrun, made once for the module) shows its files with sizes and SHA-256, and clicking
Download on ``model.pt`` saves the file itself, byte for byte."""

from __future__ import annotations

import hashlib
import re

import pytest
from django.utils import timezone

from cloud_adapters.base import JobSpec, JobState
from cloud_adapters.gpubox import GpuBoxBackend
from jobs import dispatch, services
from jobs.models import TrainingJob
from polling import wait_for
from taskkit import sent_tasks

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """(run root, handle) of one finished digits job: 1 process, 1 epoch, on a GPU box of its own."""
    run_root = tmp_path_factory.mktemp("artifact-runs")
    box = GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 1})
    handle = box.submit(JobSpec(job_name="tb-job-77-browser", config={"train": {"epochs": 1},
                                                                     "parallel": {"procs_per_node": 1}},
                                procs_per_node=1, max_runtime_s=600))
    status = wait_for(lambda: (s := box.describe(handle)).state.is_terminal and s, timeout=300, interval=0.5,
                      what="the digits run to end")
    assert status.state == JobState.SUCCEEDED, (status, (run_root / handle.job_name / "train.log").read_text()[-2000:])
    return run_root, handle


def test_download_model_from_the_job_page(live_server, browser_page, settings, digits_run, user, digits_dataset,
                                          cnn_model):
    run_root, handle = digits_run
    settings.TRAINBOARD_RUN_ROOT = run_root
    with sent_tasks(dispatch.SUBMIT_JOB):  # the row stands for the run above: nothing is submitted
        backend = services.backend_create(owner=user, name="box", kind="gpubox", config={})
        job = services.training_job_create(owner=user, dataset=digits_dataset.pk, model_spec=cnn_model.pk,
                                           backend=backend.pk, nodes=1, procs_per_node=1, epochs=1,
                                           name="finished-digits")
    TrainingJob.objects.filter(pk=job.pk).update(state="SUCCEEDED", ended_at=timezone.now(),
                                                 provider_handle=handle.to_dict(),
                                                 provider_job_name=handle.job_name)
    model = (run_root / handle.job_name / "output" / "model.pt").read_bytes()

    page = browser_page
    page.set_default_timeout(30_000)
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/$"))
    page.goto(f"{live_server.url}/jobs/{job.pk}/")

    row = page.locator('#artifact-table tr[data-artifact="model.pt"]')
    row.wait_for()
    names = page.eval_on_selector_all("#artifact-table tr[data-artifact]", "rows => rows.map(r => r.dataset.artifact)")
    assert {"model.pt", "metrics.jsonl", "logs/train.log"} <= set(names)
    assert any(name.startswith("checkpoints/") for name in names), names
    shown_sha = row.locator("code.sha256").get_attribute("title")
    assert shown_sha == hashlib.sha256(model).hexdigest()
    assert row.locator("td").nth(1).inner_text() == "model"

    with page.expect_download() as info:
        row.locator("a.download").click()
    download = info.value
    assert download.suggested_filename == "model.pt"
    saved = open(download.path(), "rb").read()
    assert saved == model
