"""A job's ``output.output_dir``/``output.checkpoint_dir`` are the backend's (the GPU box writes to the
job's run directory, the clouds to their output locations): a job that sets them is refused at create,
in the form and the API, instead of being stored with a path it never writes to."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse

from jobs.models import TrainingJob

from test_job_form_strategies import job_form_data, page_text

pytestmark = pytest.mark.django_db

BOTH = ("Hyperparameters: output.output_dir and output.checkpoint_dir are set by the backend: the job's outputs "
        "go to its run directory (GPU box) or the backend's output location (SageMaker, Vertex, Azure ML); "
        "remove them.")


def test_the_api_refuses_both_paths_with_the_other_errors_and_stores_nothing(
        api_client, digits_dataset, cnn_model, local_backend, no_celery_publish):
    response = api_client.post("/api/jobs/", {
        "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk, "nodes": 1,
        "procs_per_node": 1, "epochs": 0,
        "hyperparameters": {"output": {"output_dir": "/srv/mine", "checkpoint_dir": "/srv/ckpt"}}}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["hyperparameters"] == [BOTH]
    assert "epochs" in body  # every error in one pass
    assert TrainingJob.objects.count() == 0
    no_celery_publish["submit"].assert_not_called()


def test_the_form_refuses_one_path_and_keeps_checkpoint_format(
        owner_client, digits_dataset, cnn_model, local_backend, no_celery_publish):
    data = job_form_data(digits_dataset, cnn_model, local_backend,
                         hyperparameters=json.dumps({"output": {"checkpoint_dir": "/tmp/c"}}))
    response = owner_client.post(reverse("job-create"), data)
    assert response.status_code == 200
    message = ("Hyperparameters: output.checkpoint_dir is set by the backend: the job's outputs go to its run "
               "directory (GPU box) or the backend's output location (SageMaker, Vertex, Azure ML); remove it.")
    assert response.context["form"].errors["hyperparameters"] == [message]
    assert message in page_text(response)
    assert TrainingJob.objects.count() == 0

    # The rest of the output section is the user's: it is stored as given.
    data["hyperparameters"] = json.dumps({"output": {"checkpoint_format": "sharded"}})
    response = owner_client.post(reverse("job-create"), data)
    assert response.status_code == 302, response.context["form"].errors
    output = TrainingJob.objects.get().config["output"]
    assert output["checkpoint_format"] == "sharded" and output["checkpoint_dir"] == ""
