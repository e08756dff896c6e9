"""Request size limits (a too-big body is a 400, never a 500) and local dataset paths that cannot
escape TRAINBOARD_DATASET_ROOTS."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from jobs.models import Dataset

pytestmark = pytest.mark.django_db


@pytest.fixture
def carol(django_user_model):
    return django_user_model.objects.create_user(username="carol", password="pw-carol-Secret-1")


@pytest.fixture
def web(client, carol):
    client.force_login(carol)
    return client


@pytest.fixture
def api(carol):
    c = APIClient()
    c.force_authenticate(carol)
    return c


def test_limits_are_set_explicitly(settings):
    assert settings.DATA_UPLOAD_MAX_MEMORY_SIZE == 2_621_440
    assert settings.FILE_UPLOAD_MAX_MEMORY_SIZE == 2_621_440
    assert settings.DATA_UPLOAD_MAX_NUMBER_FIELDS == 1000


def test_oversized_form_body_is_a_400(web, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    r = web.post(reverse("dataset-create"), {"name": "big", "format": "builtin", "builtin_name": "digits",
                                             "description": "x" * 20_000})
    assert r.status_code == 400
    assert not Dataset.objects.exists()


def test_oversized_api_json_body_is_a_400_or_413(api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    body = json.dumps({"name": "big", "format": "builtin", "builtin_name": "digits", "description": "x" * 20_000})
    r = api.post("/api/datasets/", body, content_type="application/json")
    assert r.status_code in (400, 413), r.status_code
    assert not Dataset.objects.exists()


def test_too_many_form_fields_is_a_400(web):
    data = {f"f{i}": "1" for i in range(1100)}
    data.update({"name": "many", "format": "builtin", "builtin_name": "digits"})
    r = web.post(reverse("dataset-create"), data)
    assert r.status_code == 400
    assert not Dataset.objects.exists()


def test_a_dataset_path_cannot_escape_the_allowed_root(api, settings, tmp_path):
    root = tmp_path / "datasets"
    root.mkdir()
    (root / "t.csv").write_text("a,b,label\n1,2,0\n3,4,1\n5,6,0\n7,8,1\n")
    outside = tmp_path / "private.csv"
    outside.write_text("secret_col,label\n1,0\n2,1\n")
    (root / "link.csv").symlink_to(outside)
    settings.TRAINBOARD_DATASET_ROOTS = [str(root)]

    escapes = ["../private.csv", str(outside), f"file://{outside}", "link.csv", "/etc/passwd",
               f"{root}/../private.csv", "t.csv\x00"]
    for uri in escapes:
        r = api.post("/api/datasets/", {"name": "esc", "format": "csv", "uri": uri}, format="json")
        assert r.status_code == 400, (uri, r.status_code)
        message = r.json()["uri"][0]
        assert message.startswith(("A local dataset must lie inside", "Local dataset paths are not allowed",
                                   "Null characters are not allowed")), message
        assert "secret_col" not in r.content.decode()  # nothing of the outside file was read back
    assert not Dataset.objects.exists()
    # The service itself refuses a NUL byte (the API's field already did above).
    from django.core.exceptions import ValidationError

    from jobs import services

    with pytest.raises(ValidationError) as exc:
        services.dataset_create(owner=Dataset._meta.get_field("owner").related_model.objects.get(username="carol"),
                                name="nul", format="csv", uri="t.csv\x00")
    assert exc.value.message_dict["uri"][0] == ("Path or URI contains a NUL character (\\u0000), which cannot be "
                                                 "stored; remove it.")

    # Inside the root: a relative path is resolved against it and stored absolute.
    r = api.post("/api/datasets/", {"name": "ok", "format": "csv", "uri": "t.csv"}, format="json")
    assert r.status_code == 201, r.content
    assert Dataset.objects.get().uri == str((root / "t.csv").resolve())
    # Remote URIs are not local paths and are not confined.
    r = api.post("/api/datasets/", {"name": "s3", "format": "csv", "uri": "s3://bucket/t.csv"}, format="json")
    assert r.status_code == 201 and Dataset.objects.get(name="s3").uri == "s3://bucket/t.csv"


def test_production_default_root_is_var_datasets_only(tmp_path):
    import os
    import secrets
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "TRAINBOARD_"))}
    env.update({"DJANGO_ENV": "production", "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
                "TRAINBOARD_VAR_DIR": str(tmp_path / "var"), "DJANGO_SETTINGS_MODULE": "webapp.settings",
                "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"})
    out = subprocess.run([sys.executable, "-c", "import django, json; django.setup(); from django.conf import "
                          "settings; print(json.dumps(settings.TRAINBOARD_DATASET_ROOTS))"],
                         cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [str((tmp_path / "var" / "datasets").resolve())]
