"""The job form's preselected backend: the one of the user's newest job on an enabled backend (not
the alphabetically first), and never a cloud backend with no credentials known to work."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils import timezone

from jobs import services
from jobs.models import TrainingJob

pytestmark = pytest.mark.django_db


def _job(user, dataset, model, backend, name: str) -> TrainingJob:
    return services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                        nodes=1, procs_per_node=1, epochs=1, name=name)


def _selected_backend(html: str) -> str:
    select = re.search(r'<select name="backend"[^>]*>(.*?)</select>', html, re.S)
    assert select, html[:2000]
    chosen = re.findall(r'<option value="(\d+)"[^>]*selected', select.group(1))
    return chosen[0] if chosen else ""


def test_job_form_preselects_the_backend_of_the_users_newest_job(owner_client, user, other_user, digits_dataset,
                                                                  cnn_model):
    alpha = services.backend_create(owner=user, name="alpha", kind="gpubox", config={})
    zulu = services.backend_create(owner=user, name="zulu", kind="gpubox", config={})
    # No job yet: the first in the list (alphabetical).
    page = owner_client.get(reverse("job-create")).content.decode()
    assert page.index(">alpha<") < page.index(">zulu<")
    assert _selected_backend(page) in ("", str(alpha.pk))

    _job(user, digits_dataset, cnn_model, alpha, "first")
    _job(user, digits_dataset, cnn_model, zulu, "newest")
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(zulu.pk)

    # A disabled backend is not preselected, however new its last job: the newest on an enabled one is.
    services.backend_update(backend=zulu, enabled=False)
    _job(user, digits_dataset, cnn_model, alpha, "again")
    zulu_job = TrainingJob.objects.get(name="newest")
    TrainingJob.objects.filter(pk=zulu_job.pk).update(created_at=zulu_job.created_at.replace(year=2099))
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(alpha.pk)


def test_job_form_does_not_preselect_a_cloud_backend_without_credentials(owner_client, user, digits_dataset,
                                                                       cnn_model):
    """"aws" (SageMaker, nothing stored, never used) sorts before "local" but would fail at submit, so
    the form selects the GPU box. Once a job on "aws" was accepted by SageMaker (its default
    credential chain works), or secrets are stored on it, it may be chosen again."""
    config = {"region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerTraining",
              "bucket": "tb-test-bucket"}
    aws = services.backend_create(owner=user, name="aws", kind="sagemaker", config=config)
    local = services.backend_create(owner=user, name="local", kind="gpubox", config={})
    page = owner_client.get(reverse("job-create")).content.decode()
    options = re.search(r'<select name="backend"[^>]*>(.*?)</select>', page, re.S).group(1)
    assert options.index(">aws<") < options.index(">local<")  # (the page may name "local" above: its isolation)
    assert _selected_backend(page) == str(local.pk)

    # Its newest job was on "aws" but never reached SageMaker (credentials unknown): still "local".
    on_aws = _job(user, digits_dataset, cnn_model, aws, "never-submitted")
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(local.pk)

    # SageMaker accepted it: the newest job's backend is chosen, as for any backend.
    TrainingJob.objects.filter(pk=on_aws.pk).update(submitted_at=timezone.now())
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(aws.pk)

    # Stored access keys count as credentials at hand too.
    keyed = services.backend_create(owner=user, name="aaa-keyed", kind="sagemaker", config=config,
                                    secrets={"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": "s3cr3t"})
    TrainingJob.objects.all().delete()
    assert _selected_backend(owner_client.get(reverse("job-create")).content.decode()) == str(keyed.pk)
