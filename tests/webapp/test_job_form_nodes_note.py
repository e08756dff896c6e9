"""A GPU box runs a job on one machine: the job form says so beside the nodes field, and the form,
the API and the service refuse more nodes with the same words (``Backend.max_nodes_note``)."""

from __future__ import annotations

import json
import re

import pytest
from django.urls import reverse

from cloud_adapters.gpubox import GpuBoxBackend
from jobs import services
from jobs.models import TrainingJob
from tests.webapp.test_api import job_payload
from tests.webapp.test_job_form_strategies import job_form_data, page_text

pytestmark = pytest.mark.django_db

NOTE = "A GPU box runs a job on one machine; multi-node jobs go to a Slurm or Kubernetes backend."


@pytest.fixture
def sagemaker_backend(user):
    return services.backend_create(owner=user, name="sm", kind="sagemaker",
                                   config={"role_arn": "arn:aws:iam::123456789012:role/x", "bucket": "tb-bucket",
                                           "region": "us-east-1"},
                                   secrets={"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": "s"})


def test_the_form_gives_the_script_each_backends_node_limit_and_note(owner_client, local_backend, sagemaker_backend):
    page = owner_client.get(reverse("job-create")).content.decode()
    data = json.loads(re.search(r'<script id="backend-offers" type="application/json">(.*?)</script>', page,
                                re.S).group(1))
    assert data[str(local_backend.pk)]["max_nodes"] == 1
    assert data[str(local_backend.pk)]["nodes_note"] == NOTE == GpuBoxBackend.max_nodes_note
    assert data[str(sagemaker_backend.pk)]["max_nodes"] > 1
    assert data[str(sagemaker_backend.pk)]["nodes_note"] == ""


def test_the_form_refuses_two_nodes_on_a_box_with_the_note(owner_client, digits_dataset, cnn_model, local_backend,
                                                          no_celery_publish):
    response = owner_client.post(reverse("job-create"),
                                 job_form_data(digits_dataset, cnn_model, local_backend, nodes=2))
    assert response.status_code == 200
    assert response.context["form"].errors["nodes"] == [f"2 nodes requested. {NOTE}"]
    assert f"2 nodes requested. {NOTE}" in page_text(response)
    assert TrainingJob.objects.count() == 0


def test_the_api_refuses_two_nodes_on_a_box_with_the_note(api_client, digits_dataset, cnn_model, local_backend,
                                                         no_celery_publish):
    response = api_client.post("/api/jobs/", job_payload(digits_dataset, cnn_model, local_backend, nodes=3,
                                                         procs_per_node=5), format="json")
    assert response.status_code == 400
    # The node limit is the point; the per-node arithmetic of a job that could never run here is not.
    assert response.json() == {"nodes": [f"3 nodes requested. {NOTE}"]}
    no_celery_publish["submit"].assert_not_called()
