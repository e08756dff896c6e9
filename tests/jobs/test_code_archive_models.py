"""The user-code columns (migration 0012): existing rows keep working with the defaults, an archive's
store path, job secrets encrypted at rest, and archives protected while a model or job uses them."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import connection
from django.db.models import ProtectedError

from jobs.models import CodeArchive, ComputeBackend, ModelSpec, TrainingJob

pytestmark = pytest.mark.django_db

SHA = "ab" + "0" * 62


def _archive() -> CodeArchive:
    return CodeArchive.objects.create(sha256=SHA, size_bytes=123, file_count=2, files=["m/a.py", "m/b.py"],
                                      requirements="numpy==1.26\n")


def test_builtin_model_and_backend_get_the_defaults(cnn_model, local_backend):
    spec = ModelSpec.objects.get(pk=cnn_model.pk)
    assert (spec.kind, spec.code, spec.entry_point, spec.script_args, spec.shard_classes, spec.image) == \
        ("builtin", None, "", [], [], "")
    assert spec.architecture == "cnn"
    assert ComputeBackend.objects.get(pk=local_backend.pk).job_secrets == {}
    field_defaults = {f: TrainingJob._meta.get_field(f).get_default() for f in ("code", "image", "env",
                                                                                  "dataset_fingerprint")}
    assert field_defaults == {"code": None, "image": "", "env": {}, "dataset_fingerprint": None}


def test_archive_path_is_under_the_store(settings, tmp_path):
    settings.TRAINBOARD_CODE_STORE = tmp_path / "store"
    archive = _archive()
    assert archive.path == Path(tmp_path / "store" / "ab" / f"{SHA}.tar.gz")
    assert str(archive) == archive.short_sha == SHA[:12]
    with pytest.raises(Exception) as excinfo:  # content-addressed: one row per hash
        CodeArchive.objects.create(sha256=SHA, size_bytes=1, file_count=1)
    assert "unique" in str(excinfo.value).lower()


def test_job_secrets_are_encrypted_in_the_database(local_backend):
    local_backend.job_secrets = {"HF_TOKEN": "hf-very-secret-123"}
    local_backend.save(update_fields=["job_secrets"])
    with connection.cursor() as cursor:
        cursor.execute("SELECT job_secrets FROM jobs_computebackend WHERE id = %s", [local_backend.pk])
        raw = cursor.fetchone()[0]
    assert raw.startswith("fernet:") and "hf-very-secret-123" not in raw
    assert ComputeBackend.objects.get(pk=local_backend.pk).job_secrets == {"HF_TOKEN": "hf-very-secret-123"}


def test_an_archive_in_use_cannot_be_deleted(user):
    archive = _archive()
    ModelSpec.objects.create(owner=user, name="mine", kind="code", architecture="custom", code=archive,
                             entry_point="m.a:build")
    with pytest.raises(ProtectedError):
        archive.delete()
    assert CodeArchive.objects.filter(pk=archive.pk).exists()
