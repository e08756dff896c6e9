"""The admin's user-code rows: a model's kind and archive, the archives a staff user's models use
(read only; another staff user's are a 404), a backend's job secrets by name only, a job's code."""

from __future__ import annotations

import pytest
from django.urls import reverse

from codekit import MODEL_FILES, upload, zip_bytes
from jobs import services
from jobs.models import CodeArchive

pytestmark = pytest.mark.django_db


@pytest.fixture
def code_model(user, settings, tmp_path):
    settings.TRAINBOARD_CODE_STORE = tmp_path / "store"
    return services.model_spec_create(owner=user, name="tiny", kind="code", entry_point="mymodel.net:build",
                                      code=upload(zip_bytes(MODEL_FILES)))


def test_model_pages_show_kind_and_archive(client, user, code_model):
    client.force_login(user)
    listing = client.get(reverse("admin:jobs_modelspec_changelist")).content.decode()
    assert code_model.code.sha256[:12] in listing and "mymodel.net:build" in listing
    page = client.get(reverse("admin:jobs_modelspec_change", args=[code_model.pk])).content.decode()
    assert f"{code_model.code.sha256} (4 files, {code_model.code.size_bytes:,} bytes); requirements: tinypkg==1.0" in page
    response = client.post(reverse("admin:jobs_modelspec_change", args=[code_model.pk]), {
        "name": "tiny", "description": "", "kind": "code", "architecture": "custom", "params": '{"width": 8}',
        "entry_point": "mymodel.net:build", "script_args": "[]", "shard_classes": '["Block"]', "image": "",
        "team": ""})
    assert response.status_code == 302
    code_model.refresh_from_db()
    assert (code_model.params, code_model.shard_classes, CodeArchive.objects.count()) == ({"width": 8}, ["Block"], 1)
    wrong = client.post(reverse("admin:jobs_modelspec_change", args=[code_model.pk]), {
        "name": "tiny", "kind": "code", "architecture": "custom", "params": "{}", "entry_point": "mymodel.net:nope",
        "script_args": "[]", "shard_classes": "[]", "image": "", "team": ""})
    assert wrong.status_code == 200
    assert "function &#x27;nope&#x27; is not defined at the top level of mymodel/net.py" in wrong.content.decode()


def test_archives_are_read_only_and_scoped_to_their_users(client, user, other_user, django_user_model, code_model):
    archive = code_model.code
    url = reverse("admin:jobs_codearchive_change", args=[archive.pk])
    client.force_login(user)
    assert archive.sha256[:12] in client.get(reverse("admin:jobs_codearchive_changelist")).content.decode()
    page = client.get(url).content.decode()
    assert archive.sha256 in page and "tinypkg==1.0" in page and str(archive.path) in page
    assert client.post(url, {"requirements": "evil"}).status_code == 403
    assert client.get(reverse("admin:jobs_codearchive_add")).status_code == 403
    client.force_login(other_user)  # staff, no model or job of theirs uses it
    assert client.get(url).status_code == 404
    assert archive.sha256[:12] not in client.get(reverse("admin:jobs_codearchive_changelist")).content.decode()
    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)
    assert client.get(url).status_code == 200


def test_backend_job_secrets_by_name_only_and_the_jobs_code_fields(client, user, local_backend, digits_dataset,
                                                                   cnn_model):
    local_backend.job_secrets = {"HF_TOKEN": "hf-top-secret-987"}
    local_backend.save(update_fields=["job_secrets"])
    client.force_login(user)
    page = client.get(reverse("admin:jobs_computebackend_change", args=[local_backend.pk])).content.decode()
    assert "set: HF_TOKEN" in page and "hf-top-secret-987" not in page
    from jobs import dispatch
    from taskkit import sent_tasks

    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=local_backend, procs_per_node=2, name="mine")
    page = client.get(reverse("admin:jobs_trainingjob_change", args=[job.pk])).content.decode()
    for label in ("Dataset fingerprint", "Code:", "Image:", "Env:"):
        assert label in page, label
    assert "hf-top-secret-987" not in page
