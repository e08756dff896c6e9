"""The model form with code: upload (multipart) or a server directory, errors on their own fields
in one submit, nothing stored on an error, edit keeping the archive, the list's kind and hash."""

from __future__ import annotations


import pytest
from django.urls import reverse

from codekit import Link, MODEL_FILES, stored_files, tar_gz_bytes, upload, zip_bytes
from jobs.models import CodeArchive, ModelSpec

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("code_store")]


def test_the_form_uploads_code_and_the_list_shows_kind_hash_and_requirements(owner_client, code_store):
    page = owner_client.get(reverse("model-create")).content.decode()
    assert 'enctype="multipart/form-data"' in page
    assert 'type="file" name="code"' in page and 'name="kind"' in page and 'value="script"' in page
    response = owner_client.post(reverse("model-create"), {
        "name": "tiny", "kind": "code", "entry_point": "mymodel.net:build", "function_params": '{"width": 8}',
        "shard_classes": "Block", "image": "myregistry.azurecr.io/train:1.0",
        # what the hidden built-in section still holds is not read for kind code
        "architecture": "cnn", "params": '{"channels": 16}',
        "code": upload(zip_bytes(MODEL_FILES), "tiny.zip"),
    })
    assert response.status_code == 302, response.context["form"].errors
    spec = ModelSpec.objects.get()
    assert (spec.kind, spec.architecture, spec.entry_point, spec.params, spec.shard_classes, spec.image) == (
        "code", "custom", "mymodel.net:build", {"width": 8}, ["Block"], "myregistry.azurecr.io/train:1.0")
    listing = owner_client.get(reverse("model-list")).content.decode()
    assert "My model, Trainboard&#x27;s trainer" in listing
    assert f'title="SHA-256 {spec.code.sha256}">{spec.code.sha256[:12]}</span>' in listing
    assert "tinypkg==1.0" in listing and "mymodel.net:build" in listing
    edit = owner_client.get(reverse("model-edit", args=[spec.pk])).content.decode()
    assert spec.code.sha256[:12] in edit and "4 files" in edit
    assert 'value="mymodel.net:build"' in edit


def test_a_script_from_a_directory(owner_client, tmp_path, code_store):
    for name, data in MODEL_FILES.items():
        (tmp_path / "roots" / "proj" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "roots" / "proj" / name).write_bytes(data)
    response = owner_client.post(reverse("model-create"), {
        "name": "script", "kind": "script", "entry_point": "train.py", "code_dir": "proj",
        "script_args": "--epochs\r\n3\r\n", "function_params": '{"ignored": 1}'})
    assert response.status_code == 302, response.context["form"].errors
    spec = ModelSpec.objects.get()
    assert (spec.kind, spec.entry_point, spec.script_args, spec.params, spec.code.file_count) == (
        "script", "train.py", ["--epochs", "3"], {}, 4)
    outside = owner_client.post(reverse("model-create"), {
        "name": "out", "kind": "script", "entry_point": "train.py", "code_dir": "/etc"})
    errors = outside.context["form"].errors
    assert list(errors) == ["code_dir"] and "TRAINBOARD_CODE_ROOTS" in errors["code_dir"][0]


def test_every_error_on_its_field_in_one_submit_and_nothing_stored(owner_client, code_store):
    response = owner_client.post(reverse("model-create"), {
        "name": "not a slug", "kind": "code", "entry_point": "mymodel.net:nothing", "shard_classes": "Block, 9lives",
        "function_params": "{bad", "image": "bad image",
        "code": upload(tar_gz_bytes({**MODEL_FILES, "mymodel/w": Link("/etc/shadow")}), "m.tgz"),
    })
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert errors["name"][0].startswith("Enter a valid “slug”")
    assert errors["code"] == ["member 'mymodel/w': a symbolic link (to '/etc/shadow'); links are refused, inside "
                              "the archive or out of it: put the file itself in the archive."]
    assert errors["function_params"][0].startswith("Not valid JSON")
    assert errors["shard_classes"] == ["Shard classes [1]: '9lives' is not a Python class name."]
    assert errors["image"][0].startswith("Image: 'bad image' is not a container image reference")
    page = response.content.decode()
    assert "member &#x27;mymodel/w&#x27;: a symbolic link" in page
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), stored_files(code_store)) == (0, 0, [])
    missing = owner_client.post(reverse("model-create"), {"name": "m", "kind": "code",
                                                          "entry_point": "mymodel.net:build"})
    assert missing.context["form"].errors == {"code": [
        "A model of kind my model needs its code: upload a .zip or .tar.gz, or name a directory on the server."]}


def test_edit_keeps_the_archive_checks_the_new_entry_point_and_can_replace_it(owner_client, code_store):
    owner_client.post(reverse("model-create"), {"name": "tiny", "kind": "code", "entry_point": "mymodel.net:build",
                                                "code": upload(zip_bytes(MODEL_FILES))})
    spec = ModelSpec.objects.get()
    first = spec.code_id
    wrong = owner_client.post(reverse("model-edit", args=[spec.pk]), {
        "name": "tiny", "kind": "code", "entry_point": "mymodel.net:WIDTH"})
    assert wrong.context["form"].errors == {"entry_point": [
        "'WIDTH' in mymodel/net.py is a variable, not a function; name a function that returns the torch.nn.Module."]}
    renamed = owner_client.post(reverse("model-edit", args=[spec.pk]), {
        "name": "tiny2", "kind": "code", "entry_point": "mymodel.net:build", "function_params": '{"width": 4}'})
    assert renamed.status_code == 302
    spec.refresh_from_db()
    assert (spec.name, spec.code_id, spec.params) == ("tiny2", first, {"width": 4})
    files = {**MODEL_FILES, "mymodel/extra.py": b"def build2(num_classes, input_shape):\n    return None\n"}
    replaced = owner_client.post(reverse("model-edit", args=[spec.pk]), {
        "name": "tiny2", "kind": "code", "entry_point": "mymodel.extra:build2", "code": upload(zip_bytes(files))})
    assert replaced.status_code == 302
    spec.refresh_from_db()
    assert spec.code_id != first and spec.entry_point == "mymodel.extra:build2"
    assert CodeArchive.objects.count() == 2  # the first stays for the jobs that ran it
    back = owner_client.post(reverse("model-edit", args=[spec.pk]), {
        "name": "tiny2", "kind": "builtin", "architecture": "mlp", "params": "", "entry_point": "x"})
    assert back.status_code == 302, back.context["form"].errors
    spec.refresh_from_db()
    assert (spec.kind, spec.code, spec.entry_point, spec.architecture, spec.params["num_layers"]) == (
        "builtin", None, "", "mlp", 2)


def test_an_oversized_post_is_refused_before_it_is_read(owner_client, settings, code_store):
    settings.TRAINBOARD_CODE_MAX_BYTES = 1024
    response = owner_client.post(reverse("model-create"), {
        "name": "big", "kind": "code", "entry_point": "mymodel.net:build",
        "code": upload(bytes(2 * 1024 * 1024), "big.zip")})
    assert response.status_code == 400
    assert "The upload is larger than 1,024 bytes (TRAINBOARD_CODE_MAX_BYTES)" in response.content.decode()
    assert (ModelSpec.objects.count(), stored_files(code_store)) == (0, [])


def test_a_teammate_sees_but_does_not_edit(owner_client, user, django_user_model, client, code_store):
    from jobs.models import Team

    owner_client.post(reverse("model-create"), {"name": "tiny", "kind": "code", "entry_point": "mymodel.net:build",
                                                "code": upload(zip_bytes(MODEL_FILES))})
    spec = ModelSpec.objects.get()
    carol = django_user_model.objects.create_user(username="carol", password="pw-carol-123")
    team = Team.objects.create(name="vision")
    team.members.add(user, carol)
    spec.team = team
    spec.save(update_fields=["team"])
    client.force_login(carol)
    listing = client.get(reverse("model-list")).content.decode()
    assert spec.code.sha256[:12] in listing and ">shared</span>" in listing
    assert client.get(reverse("model-edit", args=[spec.pk])).status_code == 403


def test_a_form_error_of_its_own_stores_no_archive(owner_client, code_store):
    """The service still runs for its errors on the other fields (rolled back): it writes no file."""
    response = owner_client.post(reverse("model-create"), {
        "name": "not a slug", "kind": "code", "entry_point": "mymodel.net:build",
        "code": upload(zip_bytes(MODEL_FILES))})
    assert list(response.context["form"].errors) == ["name"]
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), stored_files(code_store)) == (0, 0, [])


def _label(page: str, field: str) -> str:
    """The text of the label of ``field`` in ``page`` (markers included), tags removed."""
    import re

    found = re.search(rf'<label for="id_{field}">(.*?)</label>', page, re.S)
    assert found, field
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def test_code_archive_and_entry_point_are_marked_required_not_optional(owner_client, code_store):
    page = owner_client.get(reverse("model-create")).content.decode()
    assert _label(page, "code") == "Code archive (required)"
    assert _label(page, "entry_point") == "Entry point (required)"
    assert _label(page, "code_dir") == "Or a directory on the server (optional)"  # the alternative to an upload
    missing = owner_client.post(reverse("model-create"), {"name": "s", "kind": "script"})
    assert missing.context["form"].errors == {
        "code": ["A model of kind my script needs its code: upload a .zip or .tar.gz, or name a directory on the "
                 "server."],
        "entry_point": ["A model of kind my script needs its entry point: the script, a .py file in the archive "
                        "(train.py) or -m package.module."]}
    owner_client.post(reverse("model-create"), {"name": "s", "kind": "script", "entry_point": "train.py",
                                                "code": upload(zip_bytes(MODEL_FILES))})
    edit = owner_client.get(reverse("model-edit", args=[ModelSpec.objects.get().pk])).content.decode()
    assert _label(edit, "code") == "Code archive (optional)"  # editing: empty keeps the current archive
    assert _label(edit, "entry_point") == "Entry point (required)"


def test_script_arguments_typed_on_one_line_are_split_as_a_shell_would(owner_client, code_store):
    response = owner_client.post(reverse("model-create"), {
        "name": "s", "kind": "script", "entry_point": "train.py", "code": upload(zip_bytes(MODEL_FILES)),
        "script_args": "--epochs 3 --lr 0.1\r\n--note 'two words; $HOME' --lr2={train.lr}"})
    assert response.status_code == 302, response.context["form"].errors
    spec = ModelSpec.objects.get()
    assert spec.script_args == ["--epochs", "3", "--lr", "0.1", "--note", "two words; $HOME", "--lr2={train.lr}"]
    edit = owner_client.get(reverse("model-edit", args=[spec.pk])).content.decode()
    # Shown again quoted, so saving the form unchanged keeps the same 7 arguments.
    assert "--epochs 3 --lr 0.1 --note &#x27;two words; $HOME&#x27; &#x27;--lr2={train.lr}&#x27;</textarea>" in edit
    resaved = owner_client.post(reverse("model-edit", args=[spec.pk]), {
        "name": "s", "kind": "script", "entry_point": "train.py",
        "script_args": "--epochs 3 --lr 0.1 --note 'two words; $HOME' '--lr2={train.lr}'"})
    assert resaved.status_code == 302, resaved.context["form"].errors
    spec.refresh_from_db()
    assert len(spec.script_args) == 7 and spec.script_args[5] == "two words; $HOME"
    listing = owner_client.get(reverse("model-list")).content.decode()
    assert "--epochs 3 --lr 0.1 --note &#x27;two words; $HOME&#x27;" in listing

    bad = owner_client.post(reverse("model-create"), {
        "name": "s2", "kind": "script", "entry_point": "train.py", "code": upload(zip_bytes(MODEL_FILES)),
        "script_args": "--note 'two words --lr {train.lrr}"})
    assert bad.context["form"].errors == {"script_args": [
        "Script arguments: no closing quotation in \"--note 'two words --lr {train.lrr}\"; close the quote, or put "
        "a backslash before a quote that is part of an argument."]}
    unknown = owner_client.post(reverse("model-create"), {
        "name": "s3", "kind": "script", "entry_point": "train.py", "code": upload(zip_bytes(MODEL_FILES)),
        "script_args": "--lr {train.lrr}"})
    [message] = unknown.context["form"].errors["script_args"]
    assert message.startswith("Script arguments: {train.lrr} in argument '{train.lrr}' names no field a script "
                              "receives (train.augment, train.batch_size, ")
    assert ModelSpec.objects.count() == 1
