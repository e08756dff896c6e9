"""In Chromium: "New job like this" on a job's page opens the job form prefilled from the job (its
settings and its extra hyperparameters), one edit (epochs), Launch: the new job has the source's
config but for that edit, and its page says "cloned from #<id>"."""

from __future__ import annotations

import json
import re

import pytest

from jobs import services
from jobs.models import TrainingJob

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_new_job_like_this_is_prefilled_and_launches_with_one_edit(live_server, browser_page, user, digits_dataset,
                                                                    cnn_model, local_backend):
    source = services.training_job_create(
        owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend, nodes=1, procs_per_node=2,
        epochs=2, batch_size=24, lr=0.03, seed=11, max_runtime_s=700, name="digits-src", env="MODE=fast",
        hyperparameters={"train": {"optimizer": "adamw", "weight_decay": 0.02}})
    page = browser_page
    page.set_default_timeout(30_000)
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/$"))

    page.goto(f"{live_server.url}/jobs/{source.pk}/")
    page.click("#clone-job")
    page.wait_for_url(re.compile(rf"/jobs/new/\?from={source.pk}$"))
    assert "Prefilled from job" in page.inner_text("#clone-notice")
    assert page.input_value("#id_epochs") == "2"
    assert page.input_value("#id_batch_size") == "24"
    assert page.input_value("#id_lr") == "0.03"
    assert page.input_value("#id_seed") == "11"
    assert page.input_value("#id_max_runtime_s") == "700"
    assert page.input_value("#id_procs_per_node") == "2"
    assert page.input_value("#id_env") == "MODE=fast"
    assert page.input_value("#id_name") == f"digits-src (copy of #{source.pk})"
    assert json.loads(page.input_value("#id_hyperparameters")) == {"train": {"optimizer": "adamw",
                                                                             "weight_decay": 0.02}}

    page.fill("#id_epochs", "4")
    page.click("#launch")
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    clone = TrainingJob.objects.exclude(pk=source.pk).get()
    assert clone.cloned_from_id == source.pk
    assert clone.config == {**source.config, "train": {**source.config["train"], "epochs": 4}}
    assert page.inner_text("#lineage-text").startswith(f"This job was cloned from #{source.pk}")
