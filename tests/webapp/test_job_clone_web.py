"""The clone in the browser and the API: /jobs/new/?from=<id> prefilled (posted back unchanged it
makes the same config), ``POST /api/jobs/{id}/clone/`` (201, 400 with every error at once), and the
lineage on both jobs' pages and in the job API."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import services
from jobs.models import MetricPoint, TrainingJob

pytestmark = pytest.mark.django_db


@pytest.fixture
def source(user, digits_dataset, cnn_model, local_backend):
    return services.training_job_create(
        owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend, nodes=1,
        procs_per_node=2, epochs=1, batch_size=16, lr=0.02, seed=5, name="digits-a", env="MODE=fast",
        hyperparameters={"train": {"optimizer": "adamw", "log_every_steps": 3}})


def _post_data(form) -> dict:
    """What a browser submits for ``form`` as rendered: each field's shown value (an unchecked box is left out)."""
    data = {}
    for name, field in form.fields.items():
        value = form[name].value()
        if isinstance(value, bool):
            if value:
                data[name] = "on"
            continue
        data[name] = "" if value is None else value
    return data


def test_the_form_is_prefilled_from_the_job_and_posted_back_makes_the_same_config(client, user, source):
    client.force_login(user)
    page = client.get(reverse("job-create") + f"?from={source.pk}")
    assert page.status_code == 200
    html = page.content.decode()
    assert "Prefilled from job" in html and f"#{source.pk} digits-a" in html
    form = page.context["form"]
    assert form["epochs"].value() == 1 and form["lr"].value() == 0.02 and form["seed"].value() == 5
    assert form["env"].value() == "MODE=fast"
    assert form["name"].value() == f"digits-a (copy of #{source.pk})"
    data = _post_data(form)
    assert '"optimizer": "adamw"' in data["hyperparameters"]

    same = client.post(reverse("job-create") + f"?from={source.pk}", data)
    assert same.status_code == 302
    clone = TrainingJob.objects.exclude(pk=source.pk).get()
    assert clone.config == source.config and clone.cloned_from == source

    data["epochs"] = "2"
    client.post(reverse("job-create") + f"?from={source.pk}", data)
    edited = TrainingJob.objects.latest("pk")
    assert edited.config["train"]["epochs"] == 2
    assert {**edited.config, "train": {**edited.config["train"], "epochs": 1}} == source.config


def test_continue_opens_the_form_with_more_epochs_and_the_mode_and_the_job_page_shows_both_ends(
        client, user, source, run_root):
    run = run_root / source.provider_job_name / "output" / "checkpoints"
    run.mkdir(parents=True)
    (run / "last.pt").write_bytes(b"checkpoint")
    TrainingJob.objects.filter(pk=source.pk).update(
        state="SUCCEEDED", provider_handle={"provider": "gpubox", "job_name": source.provider_job_name,
                                            "provider_job_id": str(run_root / source.provider_job_name)})
    MetricPoint.objects.create(job=source, name="val_loss", step=40, epoch=0, value=0.4, recorded_at=timezone.now())
    client.force_login(user)
    detail = client.get(reverse("job-detail", args=[source.pk])).content.decode()
    assert f'href="/jobs/new/?from={source.pk}&amp;mode=continue"' in detail
    assert f'href="/jobs/new/?from={source.pk}&amp;mode=finetune"' in detail
    assert "Made from scratch." in detail

    url = reverse("job-create") + f"?from={source.pk}&mode=continue"
    page = client.get(url)
    assert "from its last checkpoint (epoch 1: 1 epoch finished, the run goes on at the next)" in page.content.decode()
    form = page.context["form"]
    assert form["epochs"].value() == 2
    assert client.post(url, _post_data(form)).status_code == 302
    cont = TrainingJob.objects.latest("pk")
    assert (cont.init_mode, cont.source_job, cont.source_checkpoint_epoch) == ("continue", source, 1)
    assert cont.config["train"]["init_from"] == str(run / "last.pt")

    page = client.get(reverse("job-detail", args=[cont.pk])).content.decode()
    assert f"continued from #{source.pk} (checkpoint epoch 1)" in page
    assert str(run / "last.pt") in page
    source_page = client.get(reverse("job-detail", args=[source.pk])).content.decode()
    assert f"#{cont.pk} digits-a (continued from #{source.pk})" in source_page


def test_api_clone_creates_201_with_the_lineage_and_400_lists_every_error(user, source):
    api = APIClient()
    api.force_authenticate(user)
    r = api.post(f"/api/jobs/{source.pk}/clone/", {"epochs": 3, "hyperparameters": {"train": {"lr": 0.01}}},
                 format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["cloned_from"] == source.pk and body["source_job"] is None and body["init_mode"] == ""
    assert body["lineage"]["text"] == f"cloned from #{source.pk}"
    assert body["lineage"]["parent"] == {"id": source.pk, "name": "digits-a"}
    assert (body["config"]["train"]["epochs"], body["config"]["train"]["lr"],
            body["config"]["train"]["optimizer"]) == (3, 0.01, "adamw")

    detail = api.get(f"/api/jobs/{source.pk}/").json()
    assert detail["lineage"]["derived"] == [{"id": body["id"], "name": body["name"], "state": "QUEUED",
                                             "text": f"cloned from #{source.pk}"}]

    before = TrainingJob.objects.count()
    bad = api.post(f"/api/jobs/{source.pk}/clone/", {"epochs": 0, "lr": "fast", "spot": "false", "name": 7,
                                                     "bogus": 1, "init_mode": "continue"}, format="json")
    assert bad.status_code == 400
    errors = bad.json()
    assert {"epochs", "lr", "spot", "name", "bogus"} <= set(errors), errors
    assert errors["spot"] == ["Spot must be true or false."]
    assert TrainingJob.objects.count() == before

    not_an_object = api.post(f"/api/jobs/{source.pk}/clone/", [1, 2], format="json")
    assert not_an_object.status_code == 400
    assert api.post("/api/jobs/999999/clone/", {}, format="json").status_code == 404


def test_api_continue_of_a_job_that_never_ran_is_400_with_the_reason(user, source):
    TrainingJob.objects.filter(pk=source.pk).update(state="FAILED")  # ended before it was submitted
    api = APIClient()
    api.force_authenticate(user)
    r = api.post(f"/api/jobs/{source.pk}/clone/", {"init_mode": "continue", "epochs": 2}, format="json")
    assert r.status_code == 400
    assert f"Job #{source.pk} never ran on its backend" in str(r.json())


@pytest.mark.parametrize("state", ["PENDING", "RUNNING", "STOPPING"])
def test_continue_and_fine_tune_of_an_active_job_are_refused_and_a_plain_clone_is_not(client, user, source, run_root,
                                                                                      state):
    """A running job still writes its checkpoint and weights: continue and fine-tune wait until it has
    ended (400 naming its state and what to do; the job page shows both buttons disabled), while "New job
    like this" of it is allowed."""
    run = run_root / source.provider_job_name / "output" / "checkpoints"
    run.mkdir(parents=True)
    (run / "last.pt").write_bytes(b"checkpoint")
    TrainingJob.objects.filter(pk=source.pk).update(
        state=state, provider_handle={"provider": "gpubox", "job_name": source.provider_job_name,
                                      "provider_job_id": str(run_root / source.provider_job_name)})
    MetricPoint.objects.create(job=source, name="val_loss", step=40, epoch=0, value=0.4, recorded_at=timezone.now())
    api = APIClient()
    api.force_authenticate(user)
    before = TrainingJob.objects.count()
    for mode, what in (("continue", "its last checkpoint"), ("finetune", "its trained weights")):
        r = api.post(f"/api/jobs/{source.pk}/clone/", {"init_mode": mode, "epochs": 2}, format="json")
        assert r.status_code == 400, r.content
        verb = "continue" if mode == "continue" else "fine-tune"
        assert r.json() == {"init_mode": [
            f"Job #{source.pk} is {state}, not ended: {verb} starts from {what}, which the job still writes while "
            f"it runs. Wait until it has ended (or cancel it: a cancelled job keeps its last checkpoint), or "
            f"clone it without init_mode to start a new run like it from scratch."]}
    assert TrainingJob.objects.count() == before
    plain = api.post(f"/api/jobs/{source.pk}/clone/", {"epochs": 2}, format="json")
    assert plain.status_code == 201, plain.content
    assert plain.json()["init_mode"] == "" and plain.json()["cloned_from"] == source.pk

    client.force_login(user)
    page = client.get(reverse("job-detail", args=[source.pk])).content.decode()
    assert "mode=continue" not in page and "mode=finetune" not in page
    assert re.search(r'<button type="button" class="btn" id="continue-job" disabled', page)
    assert re.search(r'<button type="button" class="btn" id="finetune-job" disabled', page)
    assert f'href="/jobs/new/?from={source.pk}"' in page  # New job like this
    # The form opened by hand says the same as the API.
    form_page = client.post(reverse("job-create") + f"?from={source.pk}&mode=continue",
                            _post_data(client.get(reverse("job-create") + f"?from={source.pk}&mode=continue")
                                       .context["form"]))
    assert form_page.status_code == 200
    assert f"Job #{source.pk} is {state}, not ended" in form_page.content.decode()
