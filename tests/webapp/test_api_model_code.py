"""POST/GET /api/models/ with code: a multipart upload, a server directory in JSON, refusals as 400s
naming the member (never a 500, nothing stored), owner/team/staff visibility, and the schema."""

from __future__ import annotations


import pytest
import yaml

from codekit import Link, MODEL_FILES, stored_files, tar_gz_bytes, upload, zip_bytes
from jobs.models import CodeArchive, ModelSpec, Team

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("code_store")]


def test_multipart_create_and_get(api_client, code_store):
    response = api_client.post("/api/models/", {
        "name": "tiny", "kind": "code", "entry_point": "mymodel.net:build", "params": '{"width": 32}',
        "shard_classes": '["Block"]', "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0",
        "code": upload(zip_bytes(MODEL_FILES), "tiny.zip"),
    }, format="multipart")
    assert response.status_code == 201, response.json()
    body = response.json()
    row = CodeArchive.objects.get()
    assert body["code"] == {"sha256": row.sha256, "size_bytes": row.size_bytes, "file_count": 4,
                            "requirements": "tinypkg==1.0\n",
                            "files": ["mymodel/__init__.py", "mymodel/net.py", "requirements.txt", "train.py"]}
    assert (body["kind"], body["architecture"], body["entry_point"], body["params"], body["shard_classes"],
            body["script_args"], body["image"]) == (
        "code", "custom", "mymodel.net:build", {"width": 32}, ["Block"], [],
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0")
    assert "code_dir" not in body
    got = api_client.get(f"/api/models/{body['id']}/").json()
    assert got == body
    listed = api_client.get("/api/models/").json()["results"]
    assert [m["code"]["sha256"] for m in listed] == [row.sha256]
    assert len(stored_files(code_store)) == 1


def test_files_listed_are_the_first_fifty(api_client, code_store):
    files = {**MODEL_FILES, **{f"data/f{i:03d}.txt": b"x" for i in range(60)}}
    body = api_client.post("/api/models/", {"name": "many", "kind": "script", "entry_point": "train.py",
                                            "script_args": '["--epochs", "2"]',
                                            "code": upload(tar_gz_bytes(files), "m.tar.gz")},
                           format="multipart").json()
    assert body["code"]["file_count"] == 64
    assert body["code"]["files"] == sorted(files)[:50]
    assert body["script_args"] == ["--epochs", "2"]
    assert CodeArchive.objects.get().files == sorted(files)


def test_json_create_from_a_server_directory(api_client, tmp_path, code_store):
    for name, data in MODEL_FILES.items():
        (tmp_path / "roots" / "proj" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "roots" / "proj" / name).write_bytes(data)
    response = api_client.post("/api/models/", {"name": "fromdir", "kind": "script", "entry_point": "-m mymodel.net",
                                                "code_dir": str(tmp_path / "roots" / "proj")}, format="json")
    assert response.status_code == 201, response.json()  # -m runs mymodel/net.py as a script
    assert ModelSpec.objects.get().entry_point == "-m mymodel.net"
    response = api_client.post("/api/models/", {"name": "pkg", "kind": "script", "entry_point": "-m mymodel",
                                                "code_dir": "proj"}, format="json")
    assert response.status_code == 400  # a package runs with -m through its __main__.py
    assert response.json() == {"entry_point": [
        "module 'mymodel' not in the archive (looked for mymodel.py, mymodel/__main__.py)."]}
    response = api_client.post("/api/models/", {"name": "fromdir2", "kind": "script", "entry_point": "train.py",
                                                "script_args": ["--epochs", "3"],
                                                "code_dir": str(tmp_path / "roots" / "proj")}, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["code"]["file_count"] == 4
    outside = api_client.post("/api/models/", {"name": "out", "kind": "script", "entry_point": "train.py",
                                               "code_dir": "/etc"}, format="json")
    assert outside.status_code == 400
    assert list(outside.json()) == ["code_dir"]
    assert "TRAINBOARD_CODE_ROOTS" in outside.json()["code_dir"][0]


@pytest.mark.parametrize("code, field, message", [
    (lambda: zip_bytes({**MODEL_FILES, "../evil.py": b""}), "code", "member '../evil.py': path leaves the archive (..)"),
    (lambda: tar_gz_bytes({**MODEL_FILES, "x": Link("/etc/passwd")}), "code",
     "member 'x': a symbolic link (to '/etc/passwd'); links are refused, inside the archive or out of it: put "
     "the file itself in the archive."),
    (lambda: b"\x1f\x8bnot really gzip", "code", None),
    (lambda: b"PK\x03\x04truncated zip", "code", None),
    (lambda: zip_bytes(MODEL_FILES), "entry_point",
     "function 'missing' is not defined at the top level of mymodel/net.py (it defines: Block, build)."),
])
def test_bad_archives_are_400_naming_the_member(api_client, code_store, code, field, message):
    response = api_client.post("/api/models/", {"name": "bad", "kind": "code", "entry_point": "mymodel.net:missing",
                                                "code": upload(code(), "bad.zip")}, format="multipart")
    assert response.status_code == 400
    errors = response.json()
    if message is not None:
        assert errors[field] == [message]
    else:
        assert errors[field][0].startswith("Not a readable ")
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), stored_files(code_store)) == (0, 0, [])


def test_upload_and_directory_together_and_oversized_bodies_are_refused(api_client, code_store, settings):
    both = api_client.post("/api/models/", {"name": "b", "kind": "code", "entry_point": "mymodel.net:build",
                                            "code_dir": "proj", "code": upload(zip_bytes(MODEL_FILES))},
                           format="multipart")
    assert both.status_code == 400 and "not both" in both.json()["code_dir"][0]
    settings.TRAINBOARD_CODE_MAX_BYTES = 1024
    big = api_client.post("/api/models/", {"name": "b", "kind": "code", "entry_point": "mymodel.net:build",
                                           "code": upload(b"PK" + bytes(3 * 1024 * 1024), "big.zip")},
                          format="multipart")
    assert big.status_code == 400
    assert big.json() == {"code": ["The upload is larger than 1,024 bytes (TRAINBOARD_CODE_MAX_BYTES); leave data "
                                   "and checkpoints out of the code archive."]}
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), stored_files(code_store)) == (0, 0, [])


def test_builtin_models_are_unchanged_and_json_code_is_refused(api_client):
    model = api_client.post("/api/models/", {"name": "m", "architecture": "mlp", "params": {"num_layers": 3}},
                            format="json")
    assert model.status_code == 201
    assert (model.json()["kind"], model.json()["code"], model.json()["params"]) == (
        "builtin", None, {"hidden_size": 128, "num_layers": 3, "dropout": 0.0})
    not_a_file = api_client.post("/api/models/", {"name": "m2", "kind": "code", "entry_point": "a.b:c",
                                                  "code": "print('hi')"}, format="json")
    assert not_a_file.status_code == 400 and "code" in not_a_file.json()
    missing = api_client.post("/api/models/", {"name": "m3", "kind": "code", "entry_point": "a.b:c"}, format="json")
    assert missing.json() == {"code": ["A model of kind my model needs its code: upload a .zip or .tar.gz, or name "
                                       "a directory on the server."]}


def test_visibility_owner_team_and_staff(api_client, other_api_client, user, django_user_model, code_store):
    """As for every model: the owner's, a teammate's to see and use (not change), a 404 to anyone else,
    staff included (the API is scoped like the pages; the admin is where staff see every row)."""
    from rest_framework.test import APIClient

    mine = api_client.post("/api/models/", {"name": "tiny", "kind": "code", "entry_point": "mymodel.net:build",
                                            "code": upload(zip_bytes(MODEL_FILES))}, format="multipart").json()
    carol = django_user_model.objects.create_user(username="carol", password="pw-carol-123")
    teammate = APIClient()
    teammate.force_authenticate(carol)
    assert teammate.get(f"/api/models/{mine['id']}/").status_code == 404
    assert other_api_client.get(f"/api/models/{mine['id']}/").status_code == 404  # bob: staff, not in the team
    team = Team.objects.create(name="vision")
    team.members.add(user, carol)
    shared = api_client.patch(f"/api/models/{mine['id']}/", {"team": team.pk}, format="json")
    assert shared.status_code == 200, shared.json()
    seen = teammate.get(f"/api/models/{mine['id']}/")
    assert seen.status_code == 200 and seen.json()["code"]["sha256"] == mine["code"]["sha256"]
    assert teammate.patch(f"/api/models/{mine['id']}/", {"entry_point": "mymodel.net:Block"},
                          format="json").status_code == 403
    assert other_api_client.get(f"/api/models/{mine['id']}/").status_code == 404
    # The owner changes the entry point: checked against the stored archive.
    wrong = api_client.patch(f"/api/models/{mine['id']}/", {"entry_point": "mymodel.net:Block"}, format="json")
    assert wrong.status_code == 400
    assert wrong.json() == {"entry_point": ["'Block' in mymodel/net.py is a class, not a function; name a "
                                            "function that returns the torch.nn.Module."]}
    assert ModelSpec.objects.get().entry_point == "mymodel.net:build"


def test_schema_documents_the_upload_and_stays_valid(api_client):
    from drf_spectacular.validation import validate_schema

    schema = yaml.safe_load(api_client.get("/api/schema/").content)
    validate_schema(schema)
    body = schema["paths"]["/api/models/"]["post"]["requestBody"]["content"]
    upload_schema = schema["components"]["schemas"][body["multipart/form-data"]["schema"]["$ref"].rsplit("/", 1)[1]]
    assert upload_schema["properties"]["code"]["format"] == "binary"
    model = schema["components"]["schemas"]["ModelSpec"]["properties"]
    assert model["code"]["readOnly"] is True
    assert model["code_dir"]["writeOnly"] is True
    archive = schema["components"]["schemas"]["CodeArchive"]["properties"]
    assert set(archive) == {"sha256", "size_bytes", "file_count", "requirements", "files"}


@pytest.mark.parametrize("field, text, message", [
    ("params", '{"width": NaN}', "Parameters: width: expected a finite number, got nan."),
    ("params", "[1, 2]", "Parameters must be a JSON object, e.g. {\"hidden_size\": 128}."),
    ("params", "{" * 40 + "}" * 40, "Nested more than 32 levels deep; at most 32 levels of objects and arrays are "
                                    "accepted."),
    ("shard_classes", '"Block"', 'Shard classes must be a list of strings, e.g. ["Block"].'),
    # a plain word where JSON text is due: the message says the field takes JSON, with its example
    ("shard_classes", "Block", 'Not valid JSON: Expecting value at line 1, column 1. Give its JSON text, e.g. '
                               '["Block"].'),
    ("params", "{width: 8}", 'Not valid JSON: Expecting property name enclosed in double quotes at line 1, '
                             'column 2. Give its JSON text, e.g. {"hidden_size": 128}.'),
], ids=["nan", "not-an-object", "deep", "not-a-list", "word-not-json", "object-not-json"])
def test_multipart_json_fields_are_checked_like_json_ones(api_client, code_store, field, text, message):
    response = api_client.post("/api/models/", {"name": "tiny", "kind": "code", "entry_point": "mymodel.net:build",
                                                field: text, "code": upload(zip_bytes(MODEL_FILES))},
                               format="multipart")
    assert response.status_code == 400
    assert response.json()[field] == [message]
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), stored_files(code_store)) == (0, 0, [])


def test_script_args_given_as_a_command_line_say_they_take_a_json_list(api_client, code_store):
    response = api_client.post("/api/models/", {"name": "tiny", "kind": "script", "entry_point": "train.py",
                                                "script_args": "--epochs 3", "code": upload(zip_bytes(MODEL_FILES))},
                               format="multipart")
    assert response.status_code == 400
    assert response.json() == {"script_args": [
        'Not valid JSON: Expecting value at line 1, column 1. Give its JSON text, e.g. ["--epochs", "3"].']}
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), stored_files(code_store)) == (0, 0, [])


@pytest.mark.parametrize("kind, entry_point, code, message", [
    ("code", "garbage", None, "entry point 'garbage': expected package.module:function, e.g. mymodel.net:build."),
    ("script", "train.sh", lambda: upload(b"not an archive", "bad.zip"),
     "script 'train.sh': expected a .py file in the archive (train.py) or -m package.module."),
    ("script", "-m 9lives", None, "script '-m 9lives': expected -m package.module, e.g. -m mytrain.main."),
], ids=["no-code", "refused-code", "bad-module"])
def test_a_malformed_entry_point_is_reported_with_a_missing_or_refused_archive(api_client, code_store, kind,
                                                                             entry_point, code, message):
    body = {"name": "tiny", "kind": kind, "entry_point": entry_point, **({"code": code()} if code else {})}
    response = api_client.post("/api/models/", body, format="multipart")
    assert response.status_code == 400
    errors = response.json()
    assert errors["entry_point"] == [message]
    assert len(errors["code"]) == 1  # the archive's own error beside it, all at once
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), stored_files(code_store)) == (0, 0, [])


def test_script_args_as_one_string_are_split_as_a_shell_would(api_client, tmp_path, code_store):
    for name, data in MODEL_FILES.items():
        (tmp_path / "roots" / "proj" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "roots" / "proj" / name).write_bytes(data)
    response = api_client.post("/api/models/", {"name": "line", "kind": "script", "entry_point": "train.py",
                                                "script_args": "--epochs 3 --lr {train.lr} --note 'a b'",
                                                "code_dir": "proj"}, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["script_args"] == ["--epochs", "3", "--lr", "{train.lr}", "--note", "a b"]
    bad = api_client.post("/api/models/", {"name": "bad", "kind": "script", "entry_point": "train.py",
                                           "script_args": "--note \"a b", "code_dir": "proj"}, format="json")
    assert bad.status_code == 400
    assert bad.json() == {"script_args": ["Script arguments: no closing quotation in '--note \"a b'; close the "
                                          "quote, or put a backslash before a quote that is part of an argument."]}


def test_a_scripts_framework_is_given_shown_and_checked(api_client, code_store):
    """``framework`` (issue 33): a script's is stored and returned; a code model's other than torch, or
    an unknown one, is a 400 on that field, with the choices; nothing stored."""
    made = api_client.post("/api/models/", {"name": "tf", "kind": "script", "entry_point": "train.py",
                                            "framework": "tensorflow",
                                            "code": upload(zip_bytes(MODEL_FILES), "m.zip")}, format="multipart")
    assert made.status_code == 201, made.json()
    assert made.json()["framework"] == "tensorflow"
    assert api_client.get(f"/api/models/{made.json()['id']}/").json()["framework"] == "tensorflow"
    code = api_client.post("/api/models/", {"name": "c", "kind": "code", "entry_point": "mymodel.net:build",
                                            "framework": "ray", "code": upload(zip_bytes(MODEL_FILES), "m.zip")},
                           format="multipart")
    assert code.status_code == 400
    assert code.json() == {"framework": ["Only a model of kind script runs under ray: Trainboard's own trainer is "
                                         "PyTorch. Choose kind script, or framework torch."]}
    unknown = api_client.post("/api/models/", {"name": "j", "kind": "script", "entry_point": "train.py",
                                               "framework": "jax", "code": upload(zip_bytes(MODEL_FILES), "m.zip")},
                              format="multipart")
    assert unknown.status_code == 400
    assert unknown.json() == {"framework": ['"jax" is not a framework: one of torch, tensorflow, ray, mpi.']}
    assert ModelSpec.objects.count() == 1
    schema = yaml.safe_load(api_client.get("/api/schema/").content)
    enum = [s for name, s in schema["components"]["schemas"].items() if set(s.get("enum") or []) >= {"tensorflow"}]
    assert [e["enum"] for e in enum] == [["torch", "tensorflow", "ray", "mpi"]]


def test_the_clients_frameworks_are_the_servers():
    from trainboard_client.api import FRAMEWORKS as CLIENT_FRAMEWORKS

    from jobs.models import FRAMEWORKS

    assert CLIENT_FRAMEWORKS == FRAMEWORKS == ("torch", "tensorflow", "ray", "mpi")
