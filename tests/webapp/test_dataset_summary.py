"""The trainer's one-line summary of a dataset (``inspect_dataset``) is stored when the dataset is
saved and shown where the dataset is: the save message, the list, the edit page, the admin and the
API (read-only); a cloud URI is not read here, so its summary stays empty."""

from __future__ import annotations

import numpy as np
import pytest
from django.urls import reverse

from jobs import services
from jobs.models import Dataset
from trainer_pkg.tokens import write_tokens

pytestmark = pytest.mark.django_db

TOKENS = "5,000 tokens in 2 shards (train), 400 (val), vocab 512, uint16"
DIGITS = "1,797 samples, 10 classes, inputs 1×8×8"


@pytest.fixture
def token_dir(tmp_path):
    rng = np.random.default_rng(0)
    return write_tokens(str(tmp_path / "books"), vocab_size=512,
                        train=[rng.integers(0, 512, 3000), rng.integers(0, 512, 2000)], val=[rng.integers(0, 512, 400)])


def _text(response) -> str:
    return response.content.decode().replace("&#x27;", "'").replace("&quot;", '"')


def test_the_form_says_the_summary_and_the_list_edit_and_admin_pages_show_it(owner_client, token_dir):
    form = {"name": "books", "description": "", "format": "tokens", "builtin_name": "", "uri": token_dir,
            "label_column": "label", "team": ""}
    response = owner_client.post(reverse("dataset-create"), form, follow=True)
    assert f"Dataset books created: {TOKENS}." in _text(response)
    books = Dataset.objects.get(name="books")
    assert books.summary == TOKENS
    assert TOKENS in _text(owner_client.get(reverse("dataset-list")))
    assert TOKENS in _text(owner_client.get(reverse("dataset-edit", args=[books.pk])))
    admin_page = _text(owner_client.get(reverse("admin:jobs_dataset_change", args=[books.pk])))
    assert TOKENS in admin_page and 'name="summary"' not in admin_page  # shown, not editable
    assert TOKENS in _text(owner_client.get(reverse("admin:jobs_dataset_changelist")))

    # Saving again reads the data again: the new shards are counted.
    write_tokens(token_dir, vocab_size=512, train=[np.arange(100) % 512], val=[np.arange(10)])
    response = owner_client.post(reverse("dataset-edit", args=[books.pk]), form, follow=True)
    assert "Dataset books saved: 100 tokens in 1 shard (train), 10 (val), vocab 512, uint16." in _text(response)


def test_the_api_gives_the_summary_read_only_and_a_cloud_uri_none(api_client, user, token_dir, digits_dataset):
    made = api_client.post("/api/datasets/", {"name": "books", "format": "tokens", "uri": token_dir,
                                              "summary": "mine"}, format="json")
    assert made.status_code == 201, made.json()
    body = made.json()
    assert (body["summary"], body["sample_shape"], body["num_classes"]) == (TOKENS, [None], 512)
    patched = api_client.patch(f"/api/datasets/{body['id']}/", {"summary": "x", "description": "d"}, format="json")
    assert patched.status_code == 200 and patched.json()["summary"] == TOKENS
    assert api_client.get(f"/api/datasets/{digits_dataset.pk}/").json()["summary"] == DIGITS

    cloud = services.dataset_create(owner=user, name="books-s3", format="tokens", uri="s3://tb-data/books/")
    assert cloud.summary == ""
    # A local dataset moved to the cloud loses the summary of data no longer read.
    moved = services.dataset_update(dataset=Dataset.objects.get(name="books"), uri="s3://tb-data/books2/")
    assert moved.summary == "" and moved.sample_shape is None


def test_the_schema_says_what_a_token_datasets_null_sample_shape_means(api_client):
    import yaml

    schema = yaml.safe_load(api_client.get("/api/schema/").content)
    props = schema["components"]["schemas"]["Dataset"]["properties"]
    assert "tokens: [null], the window length T that each job sets with data.seq_len" in props["sample_shape"][
        "description"]
    assert props["summary"]["readOnly"] is True
