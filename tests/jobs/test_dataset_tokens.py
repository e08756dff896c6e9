"""A token dataset (format ``tokens``) in the dashboard: registered through the service, the form and
the API with the trainer's own summary, refused with every bad shard named, and at launch a model
that cannot take token windows is refused."""

from __future__ import annotations

import numpy as np
import pytest
from django.core.exceptions import ValidationError

from jobs import services
from jobs.models import Dataset, TrainingJob
from trainer_pkg.tokens import write_tokens

pytestmark = pytest.mark.django_db


@pytest.fixture
def token_dir(tmp_path):
    rng = np.random.default_rng(0)
    return write_tokens(str(tmp_path / "books"), vocab_size=512,
                        train=[rng.integers(0, 512, 3000), rng.integers(0, 512, 2000)], val=[rng.integers(0, 512, 400)])


def test_a_token_dataset_is_registered_with_the_trainers_summary(user, token_dir):
    ds = services.dataset_create(owner=user, name="books", format="tokens", uri=token_dir)
    ds.refresh_from_db()
    assert ds.format == Dataset.Format.TOKENS and ds.uri == token_dir
    assert ds.sample_shape == [None] and ds.sample_shape_text == "T tokens"
    cloud = services.dataset_create(owner=user, name="books-s3", format="tokens", uri="s3://tb-data/books/")
    assert cloud.sample_shape is None  # a cloud prefix is not read here


def test_a_broken_token_dataset_is_refused_naming_every_bad_shard(user, token_dir, tmp_path):
    with open(f"{token_dir}/train/000001.bin", "ab") as f:
        f.write(b"\x00")  # an odd byte count: not whole uint16 tokens
    np.array([600], dtype=np.uint16).tofile(f"{token_dir}/val/000000.bin")
    with pytest.raises(ValidationError) as excinfo:
        services.dataset_create(owner=user, name="books", format="tokens", uri=token_dir)
    (message,) = excinfo.value.message_dict["uri"]
    assert "000001.bin has 4,001 bytes, not a whole number of uint16 tokens" in message
    assert "val/000000.bin holds 1 token(s); a shard needs at least 2" in message
    with pytest.raises(ValidationError) as excinfo:
        services.dataset_create(owner=user, name="nothing", format="tokens", uri=str(tmp_path))
    assert excinfo.value.message_dict["uri"] == [
        f"tokens dataset {tmp_path} has no meta.json: make the dataset with python -m trainer_pkg.prepare_text, "
        "or write its meta.json (docs/token-data.md)"]
    assert not Dataset.objects.exists()


def test_the_api_and_the_form_take_format_tokens(user, token_dir, client):
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(user)
    made = api.post("/api/datasets/", {"name": "books", "format": "tokens", "uri": token_dir}, format="json")
    assert made.status_code == 201, made.json()
    assert made.json()["format"] == "tokens" and made.json()["sample_shape"] == [None]
    bad = api.post("/api/datasets/", {"name": "bad", "format": "tokens", "uri": token_dir + "/train"}, format="json")
    assert bad.status_code == 400 and "has no meta.json" in bad.json()["uri"][0]
    client.force_login(user)
    page = client.get("/datasets/new/")
    assert page.status_code == 200 and b'value="tokens"' in page.content


def test_a_cnn_on_token_windows_is_refused_at_launch(user, token_dir, cnn_model, local_backend):
    ds = services.dataset_create(owner=user, name="books", format="tokens", uri=token_dir)
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_create(owner=user, dataset=ds, model_spec=cnn_model, backend=local_backend,
                                     nodes=1, procs_per_node=1)
    (message,) = excinfo.value.message_dict["model_spec"]
    assert message == ("Model digits-cnn does not fit dataset books: cnn is a classifier, but a tokens dataset "
                       "holds token ids for a language model; use gpt.")
    assert TrainingJob.objects.count() == 0


def test_a_gpt_on_the_token_dataset_passes_launch_validation(user, token_dir, local_backend):
    ds = services.dataset_create(owner=user, name="books", format="tokens", uri=token_dir)
    gpt = services.model_spec_create(owner=user, name="tiny-gpt", architecture="gpt",
                                     params={"layers": 2, "heads": 2, "embed_dim": 32, "context_length": 64})
    job = services.training_job_create(owner=user, dataset=ds, model_spec=gpt, backend=local_backend,
                                       nodes=1, procs_per_node=2)
    assert job.state == "QUEUED"
    assert job.config["data"]["format"] == "tokens" and job.config["data"]["uri"] == token_dir
    assert job.config["model"]["arch"] == "gpt"
    assert job.dataset_fingerprint["kind"] == "local" and job.dataset_fingerprint["files"] == 4  # meta + 3 shards
