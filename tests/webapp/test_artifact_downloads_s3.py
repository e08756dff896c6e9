"""A SageMaker job's artifacts through the dashboard, with moto as a loopback S3 server: the list
hashes the model tarball by reading it once through GetObject, and a download (API and job page)
is a 302 to a presigned URL valid a few minutes, which a plain HTTP GET turns into the same bytes."""

from __future__ import annotations

import hashlib
import urllib.parse
import urllib.request

import boto3
import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from adapter_standins import standin
from cloud_adapters.base import JobSpec
from jobs import adapters, services
from jobs.models import TrainingJob

pytestmark = pytest.mark.django_db

sagemaker = standin("sagemaker")
MODEL = b"\x1f\x8b tarball of /opt/ml/model " * 200


@pytest.fixture
def s3_job(monkeypatch, tmp_path, settings, user, digits_dataset, cnn_model):
    sagemaker.fake_aws_env(monkeypatch, tmp_path)
    settings.TRAINBOARD_ARTIFACT_URL_EXPIRES_S = 120
    with sagemaker.moto_server() as url:
        row = services.backend_create(owner=user, name="sm", kind="sagemaker", config={
            "region": sagemaker.REGION, "role_arn": sagemaker.ROLE, "bucket": sagemaker.BUCKET, "endpoint_url": url})
        job = services.training_job_create(owner=user, dataset=digits_dataset.pk, model_spec=cnn_model.pk,
                                           backend=row.pk, nodes=1, procs_per_node=1, epochs=1, name="sm-job")
        handle = adapters.backend_adapter(row).submit(JobSpec(job_name="tb-job-21-sm", config={"train": {"epochs": 1}},
                                                              instance_type="ml.g5.xlarge"))
        boto3.client("s3", region_name=sagemaker.REGION, endpoint_url=url).put_object(
            Bucket=sagemaker.BUCKET, Key="trainboard/output/tb-job-21-sm/output/model.tar.gz", Body=MODEL)
        TrainingJob.objects.filter(pk=job.pk).update(state="SUCCEEDED", ended_at=timezone.now(),
                                                     provider_handle=handle.to_dict())
        yield job, url


def test_list_hashes_the_tarball_and_download_redirects_to_a_presigned_url(s3_job, user, owner_client):
    job, url = s3_job
    api = APIClient()
    api.force_authenticate(user)
    body = api.get(f"/api/jobs/{job.pk}/artifacts/").json()
    assert body["error"] == ""
    assert [(a["name"], a["kind"], a["size_bytes"], a["sha256"], a["sha256_source"]) for a in body["results"]] == [
        ("model.tar.gz", "model", len(MODEL), hashlib.sha256(MODEL).hexdigest(), "computed")]

    r = api.get(f"/api/jobs/{job.pk}/artifacts/model.tar.gz/download/")
    assert r.status_code == 302
    location = r["Location"]
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(location).query)
    assert location.startswith(f"{url}/{'tb-test-bucket'}/trainboard/output/tb-job-21-sm/output/model.tar.gz?")
    assert query["X-Amz-Expires"] == ["120"] and query["X-Amz-Algorithm"] == ["AWS4-HMAC-SHA256"]
    with urllib.request.urlopen(location, timeout=30) as answer:
        assert answer.read() == MODEL

    page = owner_client.get(f"/jobs/{job.pk}/artifacts/model.tar.gz")
    assert page.status_code == 302 and page["Location"].startswith(f"{url}/tb-test-bucket/")
    assert owner_client.get(f"/jobs/{job.pk}/artifacts/checkpoints/none.pt").status_code == 404
