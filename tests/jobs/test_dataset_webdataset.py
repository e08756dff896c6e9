"""A webdataset (format ``webdataset``: tar shards of images and .cls labels) in the dashboard:
registered through the service, the form and the API with the trainer's quick summary (the first
shard indexed, the rest estimated), a broken shard refused naming the sample, and at launch the
same location rule as every format."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from jobs import services
from jobs.models import Dataset, TrainingJob
from trainer_pkg.datasets import inspect_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_pkg"))
from test_webdataset import write_shard  # noqa: E402  (the trainer tests' shard writer)

pytestmark = pytest.mark.django_db


@pytest.fixture
def shards(tmp_path) -> str:
    root = tmp_path / "pets"
    for i, (first, count) in enumerate(((0, 6), (6, 6), (12, 6))):
        write_shard(root / f"shard-{i:06d}.tar", first, count)
    write_shard(root / "val" / "shard-000000.tar", 100, 3)
    return str(root)


def test_a_webdataset_is_registered_with_the_trainers_quick_summary(user, shards):
    info = inspect_dataset("webdataset", shards)
    assert info.summary == ("about 18 samples in 3 shards (the first holds 6, classes 0–2 seen in it); "
                            "validation: 1 shard in val/")
    ds = services.dataset_create(owner=user, name="pets", format="webdataset", uri=shards)
    ds.refresh_from_db()
    assert ds.format == Dataset.Format.WEBDATASET and ds.uri == shards
    assert ds.sample_shape == [3, None, None] and ds.sample_shape_text == "3 × H × W" and ds.num_classes == 3
    cloud = services.dataset_create(owner=user, name="pets-s3", format="webdataset", uri="s3://tb-data/pets/")
    assert cloud.sample_shape is None  # a cloud prefix is not read here, as for every format


def test_a_broken_first_shard_or_no_shards_is_refused(user, shards, tmp_path):
    with open(f"{shards}/shard-000000.tar", "r+b") as f:
        f.write(b"garbage!" * 64)  # the first header
    with pytest.raises(ValidationError) as excinfo:
        services.dataset_create(owner=user, name="pets", format="webdataset", uri=shards)
    (message,) = excinfo.value.message_dict["uri"]
    assert message.startswith(f"shard {shards}/shard-000000.tar is not a readable tar file")
    with pytest.raises(ValidationError) as excinfo:
        services.dataset_create(owner=user, name="empty", format="webdataset", uri=str(tmp_path))
    assert "holds no .tar shards at its top level" in excinfo.value.message_dict["uri"][0]
    assert not Dataset.objects.exists()


def test_the_api_and_the_form_take_format_webdataset(user, shards, client):
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(user)
    made = api.post("/api/datasets/", {"name": "pets", "format": "webdataset", "uri": shards}, format="json")
    assert made.status_code == 201, made.json()
    assert made.json()["format"] == "webdataset" and made.json()["sample_shape"] == [3, None, None]
    client.force_login(user)
    page = client.get("/datasets/new/")
    assert page.status_code == 200 and b'value="webdataset"' in page.content


def test_launch_refuses_a_location_the_backend_cannot_read_and_takes_a_local_one(user, shards, cnn_model,
                                                                                 local_backend):
    s3 = services.dataset_create(owner=user, name="pets-s3", format="webdataset", uri="s3://tb-data/pets/")
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_create(owner=user, dataset=s3, model_spec=cnn_model, backend=local_backend,
                                     nodes=1, procs_per_node=2)
    assert excinfo.value.message_dict["dataset"] == [
        "Dataset pets-s3 (s3://tb-data/pets/) cannot be read by a Local GPU box (torchrun) backend: it reads "
        "local paths, not s3://. Choose a dataset stored where this backend reads, or a backend that reads s3://."]
    assert TrainingJob.objects.count() == 0
    local = services.dataset_create(owner=user, name="pets", format="webdataset", uri=shards)
    job = services.training_job_create(owner=user, dataset=local, model_spec=cnn_model, backend=local_backend,
                                       nodes=1, procs_per_node=2)
    assert job.state == "QUEUED" and job.config["data"]["format"] == "webdataset"
    assert job.config["data"]["uri"] == shards
