"""A job whose dataset its backend cannot read, or whose model cannot take the dataset's samples,
is refused at launch by the one service the form, the API and the CLI
call, instead of failing on the backend at run time."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from jobs import services
from jobs.models import TrainingJob

pytestmark = pytest.mark.django_db

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"


def _launch(user, dataset, model, backend, **kw):
    return services.training_job_create(**{"owner": user, "dataset": dataset, "model_spec": model,
                                           "backend": backend, "nodes": 1, "procs_per_node": 1, **kw})


@pytest.fixture
def sagemaker_backend(user):
    return services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": ROLE, "bucket": "tb-test-bucket"})


def test_a_cloud_dataset_on_a_gpu_box_is_refused_at_launch_naming_dataset_scheme_and_kind(
        user, cnn_model, local_backend):
    s3 = services.dataset_create(owner=user, name="imagenet-s3", format="imagefolder",
                                 uri="s3://tb-data/imagenet/")
    with pytest.raises(ValidationError) as excinfo:
        _launch(user, s3, cnn_model, local_backend, procs_per_node=3)
    errors = excinfo.value.message_dict
    assert errors["dataset"] == [
        "Dataset imagenet-s3 (s3://tb-data/imagenet/) cannot be read by a Local GPU box (torchrun) backend: it "
        "reads local paths, not s3://. Choose a dataset stored where this backend reads, or a backend that "
        "reads s3://."]
    assert "procs_per_node" in errors  # the box allows 2: reported in the same pass, not on the next submit
    assert TrainingJob.objects.count() == 0


def test_a_local_dataset_on_sagemaker_is_refused_once_in_the_services_words(user, cnn_model, tmp_path,
                                                                           sagemaker_backend):
    import numpy as np

    path = tmp_path / "images.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.random((20, 1, 8, 8), dtype=np.float32), y_train=np.arange(20) % 2)
    local = services.dataset_create(owner=user, name="local-images", format="npz", uri=str(path))
    with pytest.raises(ValidationError) as excinfo:
        _launch(user, local, cnn_model, sagemaker_backend, batch_size=8)  # 8 of its 16 training samples
    assert excinfo.value.message_dict == {"dataset": [
        f"Dataset local-images ({path}) cannot be read by an AWS SageMaker backend: it reads s3://, not local "
        f"paths. Choose a dataset stored where this backend reads, or a backend that reads local paths."]}


def test_a_dataset_the_backend_reads_is_accepted(user, cnn_model, local_backend, sagemaker_backend, digits_dataset):
    s3 = services.dataset_create(owner=user, name="images-s3", format="imagefolder", uri="s3://tb-data/images/")
    assert _launch(user, s3, cnn_model, sagemaker_backend).config["data"]["uri"] == "s3://tb-data/images/"
    assert _launch(user, digits_dataset, cnn_model, local_backend).state == "QUEUED"  # built-in: everywhere


def test_the_api_and_rerun_refuse_it_too(user, cnn_model, local_backend):
    from rest_framework.test import APIClient

    s3 = services.dataset_create(owner=user, name="imagenet-s3", format="imagefolder", uri="s3://tb-data/imagenet/")
    api = APIClient()
    api.force_authenticate(user)
    response = api.post("/api/jobs/", {"dataset": s3.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
                                       "nodes": 1, "procs_per_node": 1}, format="json")
    assert response.status_code == 400
    assert response.json()["dataset"][0].startswith("Dataset imagenet-s3 (s3://tb-data/imagenet/) cannot be read")
    # A stored job whose dataset its backend cannot read is not re-run either.
    job = TrainingJob.objects.create(owner=user, dataset=s3, model_spec=cnn_model, backend=local_backend,
                                     config={"data": {"format": "imagefolder", "uri": s3.uri}}, nodes=1,
                                     procs_per_node=1, state="FAILED")
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_rerun(job=job, owner=user)
    assert excinfo.value.message_dict["dataset"][0].startswith("Dataset imagenet-s3 (s3://tb-data/imagenet/) cannot be read")


# --- the model against the dataset's shape ----------------------------------------------------


@pytest.fixture
def table_npz(tmp_path):
    """An NPZ of 40 samples × 16 features, 2 classes."""
    import numpy as np

    path = tmp_path / "table16.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.random((40, 16), dtype=np.float32), y_train=np.arange(40) % 2)
    return path


def test_the_dataset_records_its_sample_shape_when_saved(user, table_npz, tmp_path, digits_dataset):
    table = services.dataset_create(owner=user, name="table16", format="npz", uri=str(table_npz))
    assert table.sample_shape == [16]
    table.refresh_from_db()
    assert table.sample_shape == [16]
    assert digits_dataset.sample_shape == [1, 8, 8]
    csv = tmp_path / "t.csv"
    csv.write_text("a,b,c,label\n1,2,3,0\n4,5,6,1\n")
    assert services.dataset_create(owner=user, name="t", format="csv", uri=str(csv)).sample_shape == [3]
    cloud = services.dataset_create(owner=user, name="c", format="npz", uri="s3://tb-data/x.npz")
    assert cloud.sample_shape is None  # not read here
    # Re-pointed at other data, the shape follows.
    services.dataset_update(dataset=table, format="csv", uri=str(csv))
    table.refresh_from_db()
    assert table.sample_shape == [3]


def test_a_cnn_on_a_table_is_refused_at_launch_with_both_shapes(user, table_npz, cnn_model, local_backend):
    table = services.dataset_create(owner=user, name="table16", format="npz", uri=str(table_npz))
    with pytest.raises(ValidationError) as excinfo:
        _launch(user, table, cnn_model, local_backend, procs_per_node=3)
    errors = excinfo.value.message_dict
    assert errors["model_spec"] == [
        "Model digits-cnn does not fit dataset table16: cnn needs image inputs of shape (C, H, W), but the "
        "dataset's samples have shape (16,); use mlp for tabular data."]
    assert "procs_per_node" in errors  # with the other errors of the same submit
    assert TrainingJob.objects.count() == 0
    mlp = services.model_spec_create(owner=user, name="table-mlp", architecture="mlp")
    assert _launch(user, table, mlp, local_backend).config["model"]["arch"] == "mlp"


def test_a_language_model_on_a_table_is_refused_at_launch(user, table_npz, local_backend):
    table = services.dataset_create(owner=user, name="table16", format="npz", uri=str(table_npz))
    gpt = services.model_spec_create(owner=user, name="tiny-gpt", architecture="gpt", params={"layers": 2})
    with pytest.raises(ValidationError) as excinfo:
        _launch(user, table, gpt, local_backend)
    assert excinfo.value.message_dict["model_spec"] == [
        "Model tiny-gpt does not fit dataset table16: gpt is a language model and reads a tokens dataset (token "
        "ids, made by prepare_text), but this dataset's format is npz; use a classifier (mlp, cnn, resnet) for it."]
    assert TrainingJob.objects.count() == 0


def test_the_form_and_the_api_show_the_same_refusal(user, table_npz, cnn_model, local_backend, client):
    from rest_framework.test import APIClient
    from django.urls import reverse

    table = services.dataset_create(owner=user, name="table16", format="npz", uri=str(table_npz))
    api = APIClient()
    api.force_authenticate(user)
    response = api.post("/api/jobs/", {"dataset": table.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
                                       "nodes": 1, "procs_per_node": 1}, format="json")
    assert response.status_code == 400
    message = ("Model digits-cnn does not fit dataset table16: cnn needs image inputs of shape (C, H, W), but "
               "the dataset's samples have shape (16,); use mlp for tabular data.")
    assert response.json()["model_spec"] == [message]
    client.force_login(user)
    page = client.post(reverse("job-create"), {
        "dataset": table.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk, "strategy": "ddp",
        "nodes": 1, "procs_per_node": 1, "epochs": 1, "batch_size": 8, "lr": 0.05, "seed": 0,
        "max_runtime_s": 600})
    assert page.status_code == 200
    assert page.context["form"].errors["model_spec"] == [message]
    assert TrainingJob.objects.count() == 0


def test_the_recorded_shape_is_shown_in_the_dataset_list_and_the_api(client, user, table_npz, digits_dataset):
    from rest_framework.test import APIClient

    from jobs.models import Dataset

    table = services.dataset_create(owner=user, name="table16", format="npz", uri=str(table_npz))
    cloud = services.dataset_create(owner=user, name="c", format="npz", uri="s3://tb-data/x.npz")
    folder = Dataset(sample_shape=[3, None, None])
    assert (digits_dataset.sample_shape_text, table.sample_shape_text, cloud.sample_shape_text,
            folder.sample_shape_text) == ("1 × 8 × 8", "16", "", "3 × H × W")
    client.force_login(user)
    page = client.get("/datasets/").content.decode()
    assert "<th>Sample shape</th>" in page and '<td class="mono small">1 × 8 × 8</td>' in page
    assert '<td class="mono small">16</td>' in page
    api = APIClient()
    api.force_authenticate(user)
    shapes = {d["name"]: d["sample_shape"] for d in api.get("/api/datasets/").json()["results"]}
    assert shapes == {"digits": [1, 8, 8], "table16": [16], "c": None}
    # Read-only: a client cannot claim a shape.
    r = api.patch(f"/api/datasets/{table.pk}/", {"sample_shape": [99]}, format="json")
    assert r.status_code == 200 and r.json()["sample_shape"] == [16]
