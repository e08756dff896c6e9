"""Code archives (jobs/code_archives.py) through the model services: every refusal says which member
and why and stores nothing (no CodeArchive row, no ModelSpec row, no file in the store); the same
files give one hash, one row and one file whatever the archive format or timestamps; directories
under the code roots; static entry point and script checks."""

from __future__ import annotations

import io
import os
import tarfile
import zipfile
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from codekit import Link, MODEL_FILES, NET_PY, Special, stored_files, tar_gz_bytes, upload, zip_bytes
from jobs import code_archives, services
from jobs.models import CodeArchive, ModelSpec

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("code_store")]


def create(user, code, *, kind="code", entry_point="mymodel.net:build", **extra) -> ModelSpec:
    return services.model_spec_create(owner=user, name="mine", kind=kind, code=code, entry_point=entry_point,
                                      **extra)


def refused(user, store, code, *, field="code", **kwargs) -> str:
    """The one message on ``field`` of a refused create, after asserting nothing was stored."""
    with pytest.raises(ValidationError) as excinfo:
        create(user, code, **kwargs)
    errors = excinfo.value.message_dict
    assert CodeArchive.objects.count() == 0
    assert ModelSpec.objects.count() == 0
    assert stored_files(store) == []
    assert len(errors[field]) == 1, errors
    return errors[field][0]


def with_files(**extra) -> dict:
    return {**MODEL_FILES, **extra}


# ---------------------------------------------------------------------------------------------
# Refusals of the archive itself: each names the member and why
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build, expected", [
    (lambda: zip_bytes(with_files(**{"../evil.py": b"x = 1\n"})),
     "member '../evil.py': path leaves the archive (..)"),
    (lambda: tar_gz_bytes(with_files(**{"mymodel/../../evil.py": b"x = 1\n"})),
     "member 'mymodel/../../evil.py': path leaves the archive (..)"),
    (lambda: tar_gz_bytes(with_files(**{"/etc/cron.d/evil": b"* * * * * root sh\n"})),
     "member '/etc/cron.d/evil': an absolute path; members must be relative to the archive's root."),
    (lambda: zip_bytes(with_files(**{"/abs.py": b"x = 1\n"})),
     "member '/abs.py': an absolute path; members must be relative to the archive's root."),
    (lambda: tar_gz_bytes(with_files(**{"mymodel/data": Link("/etc/passwd")})),
     "member 'mymodel/data': a symbolic link (to '/etc/passwd'); links are refused, inside the archive or out "
     "of it: put the file itself in the archive."),
    (lambda: tar_gz_bytes(with_files(**{"mymodel/alias.py": Link("net.py")})),
     "member 'mymodel/alias.py': a symbolic link (to 'net.py'); links are refused, inside the archive or out "
     "of it: put the file itself in the archive."),
    (lambda: zip_bytes(with_files(**{"mymodel/out": Link("../../../etc/shadow")})),
     "member 'mymodel/out': a symbolic link (to '../../../etc/shadow'); links are refused, inside the archive "
     "or out of it: put the file itself in the archive."),
    (lambda: tar_gz_bytes(with_files(**{"mymodel/copy.py": Link("mymodel/net.py", hard=True)})),
     "member 'mymodel/copy.py': a hard link (to 'mymodel/net.py'); links are refused, inside the archive or "
     "out of it: put the file itself in the archive."),
    (lambda: tar_gz_bytes(with_files(**{"dev/sda": Special(tarfile.BLKTYPE)})),
     "member 'dev/sda': a block device, not a regular file; only regular files and directories may be in a "
     "code archive."),
    (lambda: tar_gz_bytes(with_files(**{"null": Special(tarfile.CHRTYPE)})),
     "member 'null': a character device, not a regular file; only regular files and directories may be in a "
     "code archive."),
    (lambda: tar_gz_bytes(with_files(**{"pipe": Special(tarfile.FIFOTYPE)})),
     "member 'pipe': a FIFO, not a regular file; only regular files and directories may be in a code archive."),
    (lambda: zip_bytes(with_files(**{"trainer_pkg/x.py": b"x = 1\n"})),
     "member 'trainer_pkg/x.py': trainer_pkg/ is Trainboard's trainer package, which the job puts beside "
     "your files; rename your package."),
    (lambda: tar_gz_bytes({f"proj/{k}": v for k, v in with_files(**{"trainboard_entry.py": b"x = 1\n"}).items()}),
     "member 'proj/trainboard_entry.py': top-level names starting trainboard_ are Trainboard's own (its entry "
     "script and job config sit beside your files); rename it."),
    (lambda: b"#!/bin/sh\necho not an archive\n",
     "'model.zip' is not a .zip or .tar.gz archive (its first bytes are neither); upload one of those."),
    (lambda: zip_bytes({"empty/": b""}),
     "The archive holds no files."),
], ids=["zip-slip", "tar-slip", "absolute-tar", "absolute-zip", "symlink-out", "symlink-in", "zip-symlink",
        "hardlink", "block-device", "char-device", "fifo", "trainer-pkg", "trainboard-name", "not-an-archive",
        "empty"])
def test_unsafe_archive_is_refused_naming_the_member(user, code_store, build, expected):
    assert refused(user, code_store, upload(build())) == expected


def test_upload_over_the_size_limit_is_refused(user, code_store, settings):
    settings.TRAINBOARD_CODE_MAX_BYTES = 64 * 1024
    data = zip_bytes(with_files(**{"weights.bin": os.urandom(100 * 1024)}))  # random: does not compress
    assert len(data) > 64 * 1024
    assert refused(user, code_store, upload(data, "big.zip")) == (
        "'big.zip' is larger than 65,536 bytes (TRAINBOARD_CODE_MAX_BYTES); leave data and checkpoints out "
        "of the code archive.")


@pytest.mark.parametrize("pack", [zip_bytes, tar_gz_bytes], ids=["zip", "tar.gz"])
def test_zip_bomb_stops_at_the_uncompressed_limit(user, code_store, settings, pack):
    settings.TRAINBOARD_CODE_MAX_BYTES = 1024 * 1024
    data = pack(with_files(**{"zeros.bin": bytes(20 * 1024 * 1024)}))
    assert len(data) < 1024 * 1024  # small as sent: only the bytes read out give it away
    assert refused(user, code_store, upload(data)) == (
        "member 'zeros.bin': the files pass 1 MiB uncompressed here (TRAINBOARD_CODE_MAX_BYTES); leave data "
        "and checkpoints out of the code archive.")


def test_tar_stream_of_skipped_padding_is_bounded(user, code_store, settings):
    """A .tar.gz whose bytes lie where no member is read (in a __MACOSX folder, skipped) is still
    stopped: the decompressed stream itself is bounded."""
    settings.TRAINBOARD_CODE_MAX_BYTES = 1024 * 1024
    data = tar_gz_bytes(with_files(**{"__MACOSX/pad.bin": bytes(30 * 1024 * 1024)}))
    message = refused(user, code_store, upload(data, "m.tar.gz"))
    assert message.startswith("The archive decompresses to more than ")
    assert "TRAINBOARD_CODE_MAX_BYTES" in message


def test_too_many_files_is_refused(user, code_store, settings):
    settings.TRAINBOARD_CODE_MAX_FILES = 5
    data = zip_bytes(with_files(**{f"extra/{i}.py": b"" for i in range(3)}))
    assert refused(user, code_store, upload(data)) == (
        "member 'extra/1.py': more than 5 files (TRAINBOARD_CODE_MAX_FILES); leave data, checkpoints and "
        "environments out of the code archive.")


def test_member_twice_is_refused(user, code_store):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("mymodel/net.py", NET_PY)
        zf.writestr("./mymodel/net.py", b"x = 1\n")
    assert refused(user, code_store, upload(buf.getvalue())) == \
        "member './mymodel/net.py': appears twice in the archive; keep one."


# ---------------------------------------------------------------------------------------------
# Entry point and script checks (static)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("files, entry_point, expected", [
    (MODEL_FILES, "mymodel.nets:build",
     "module 'mymodel.nets' not in the archive (looked for mymodel/nets.py, mymodel/nets/__init__.py)."),
    (with_files(**{"mymodel/bad.py": b"import torch\n\n\ndef build(:\n    pass\n"}), "mymodel.bad:build",
     "mymodel/bad.py has a syntax error at line 4: invalid syntax"),
    (MODEL_FILES, "mymodel.net:make",
     "function 'make' is not defined at the top level of mymodel/net.py (it defines: Block, build)."),
    (MODEL_FILES, "mymodel.net:Block",
     "'Block' in mymodel/net.py is a class, not a function; name a function that returns the torch.nn.Module."),
    (MODEL_FILES, "mymodel.net:WIDTH",
     "'WIDTH' in mymodel/net.py is a variable, not a function; name a function that returns the torch.nn.Module."),
    (MODEL_FILES, "mymodel/net.py",
     "entry point 'mymodel/net.py': expected package.module:function, e.g. mymodel.net:build."),
], ids=["missing-module", "syntax-error", "function-missing", "a-class", "a-variable", "malformed"])
def test_bad_entry_point_is_refused(user, code_store, files, entry_point, expected):
    assert refused(user, code_store, upload(zip_bytes(files)), field="entry_point",
                   entry_point=entry_point) == expected


@pytest.mark.parametrize("script, expected", [
    ("fit.py", "script 'fit.py' is not in the archive; its top-level scripts: train.py."),
    ("-m mymodel.main", "module 'mymodel.main' not in the archive (looked for mymodel/main.py, "
                        "mymodel/main/__main__.py)."),
    ("../train.py", "script '../train.py': path leaves the archive (..)"),
], ids=["missing-file", "missing-module", "leaves"])
def test_missing_script_is_refused(user, code_store, script, expected):
    assert refused(user, code_store, upload(tar_gz_bytes(MODEL_FILES), "m.tgz"), field="entry_point",
                   kind="script", entry_point=script) == expected


def test_entry_point_imported_in_a_package_and_namespace_packages_are_accepted(user, code_store):
    files = {"ns/models/net.py": NET_PY, "pkg/__init__.py": b"from .impl import build\n",
             "pkg/impl.py": b"def build(num_classes, input_shape):\n    raise SystemExit('never run here')\n"}
    archive = code_archives.normalize_upload(io.BytesIO(zip_bytes(files)))
    code_archives.check_entry_point(archive, "ns.models.net:build")  # no ns/__init__.py: a namespace package
    code_archives.check_entry_point(archive, "pkg:build")
    assert archive.files == ("ns/models/net.py", "pkg/__init__.py", "pkg/impl.py")


def test_all_errors_at_once(user, code_store):
    with pytest.raises(ValidationError) as excinfo:
        services.model_spec_create(owner=user, name="bad name!", kind="code",
                                   code=upload(zip_bytes(MODEL_FILES)), entry_point="mymodel.net:missing",
                                   shard_classes=["Block", "not a class"], image="not an image!",
                                   params={"num_classes": 3}, script_args=["--x"])
    errors = excinfo.value.message_dict
    assert set(errors) == {"name", "entry_point", "shard_classes", "image", "params", "script_args"}
    assert errors["shard_classes"] == ["Shard classes [1]: 'not a class' is not a Python class name."]
    assert errors["params"] == ["Parameter num_classes: the trainer passes num_classes itself (from the dataset); "
                                "remove it from the parameters"]
    assert (CodeArchive.objects.count(), ModelSpec.objects.count(), stored_files(code_store)) == (0, 0, [])


# ---------------------------------------------------------------------------------------------
# Stored once, by content
# ---------------------------------------------------------------------------------------------


def test_same_files_as_zip_and_tar_gz_are_one_archive(user, other_user, code_store):
    zipped = {f"project-main/{k}": v for k, v in MODEL_FILES.items()}  # as GitHub zips a repository
    first = create(user, upload(zip_bytes(zipped, date=(2021, 5, 6, 7, 8, 10)), "m.zip"))
    second = services.model_spec_create(owner=other_user, name="theirs", kind="code", entry_point="mymodel.net:build",
                                        code=upload(tar_gz_bytes(MODEL_FILES, mtime=1_234_567, uid=42), "m.tgz"))
    assert first.code_id == second.code_id
    row = CodeArchive.objects.get()
    assert stored_files(code_store) == [f"{row.sha256[:2]}/{row.sha256}.tar.gz"]
    assert row.path == code_store / row.sha256[:2] / f"{row.sha256}.tar.gz"
    assert (row.file_count, row.files, row.requirements) == (
        4, ["mymodel/__init__.py", "mymodel/net.py", "requirements.txt", "train.py"], "tinypkg==1.0\n")
    assert row.size_bytes == row.path.stat().st_size
    import hashlib
    assert hashlib.sha256(row.path.read_bytes()).hexdigest() == row.sha256
    with tarfile.open(row.path) as tar:  # the normalized form
        members = tar.getmembers()
        assert [(m.name, m.mtime, m.uid, m.gid, m.uname, m.mode) for m in members] == [
            (name, 0, 0, 0, "", 0o644) for name in row.files]
        assert tar.extractfile("mymodel/net.py").read() == NET_PY
    assert (first.kind, first.architecture, first.entry_point, first.params) == ("code", "custom", "mymodel.net:build", {})


def test_a_package_top_directory_is_kept(user, code_store):
    archive = code_archives.normalize_upload(io.BytesIO(zip_bytes({"mymodel/__init__.py": b"",
                                                                   "mymodel/net.py": NET_PY})))
    assert (archive.files, archive.stripped_prefix) == (("mymodel/__init__.py", "mymodel/net.py"), "")
    code_archives.check_entry_point(archive, "mymodel.net:build")


def test_executable_bit_survives_as_0755(user, code_store):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("run.sh")
        info.size, info.mode = 3, 0o700
        tar.addfile(info, io.BytesIO(b"ls\n"))
        info = tarfile.TarInfo("train.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"\n"))
    spec = create(user, upload(buf.getvalue(), "t.tar.gz"), kind="script", entry_point="train.py",
                  script_args=["--epochs", "2"])
    with tarfile.open(spec.code.path) as tar:
        assert {m.name: m.mode for m in tar.getmembers()} == {"run.sh": 0o755, "train.py": 0o644}
    assert (spec.kind, spec.architecture, spec.script_args) == ("script", "", ["--epochs", "2"])


# ---------------------------------------------------------------------------------------------
# Directories on the server
# ---------------------------------------------------------------------------------------------


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_directory_is_the_same_archive_as_its_zip(user, code_store, tmp_path):
    tree = write_tree(tmp_path / "roots" / "project", MODEL_FILES)
    (tree / "mymodel" / "__pycache__").mkdir()
    (tree / "mymodel" / "__pycache__" / "net.cpython-311.pyc").write_bytes(b"\x00bytecode")
    spec = create(user, str(tree))
    uploaded = code_archives.normalize_upload(io.BytesIO(zip_bytes(MODEL_FILES)))
    assert spec.code.sha256 == uploaded.sha256
    relative = services.model_spec_create(owner=user, name="rel", kind="code", code="project",
                                          entry_point="mymodel.net:build")
    assert relative.code_id == spec.code_id


def test_directory_outside_the_roots_is_refused(user, code_store, tmp_path):
    outside = write_tree(tmp_path / "elsewhere", MODEL_FILES)
    message = refused(user, code_store, str(outside))
    assert message == (f"A code directory must lie inside {tmp_path / 'roots'} (TRAINBOARD_CODE_ROOTS); "
                       f"{str(outside)!r} is outside. Put the code there, or upload it as a .zip or .tar.gz.")
    (tmp_path / "roots" / "sneaky").symlink_to(outside)  # resolved before the check
    assert refused(user, code_store, str(tmp_path / "roots" / "sneaky")).startswith("A code directory must lie inside")
    assert refused(user, code_store, "../elsewhere").startswith("A code directory must lie inside")


def test_directory_with_a_link_or_a_fifo_is_refused(user, code_store, tmp_path):
    tree = write_tree(tmp_path / "roots" / "p", MODEL_FILES)
    (tree / "mymodel" / "secrets").symlink_to("/etc/passwd")
    assert refused(user, code_store, str(tree)) == (
        "member 'mymodel/secrets': a symbolic link (to '/etc/passwd'); links are refused, inside the archive "
        "or out of it: put the file itself in the archive.")
    (tree / "mymodel" / "secrets").unlink()
    os.link(tree / "train.py", tree / "train2.py")
    with pytest.raises(ValidationError) as excinfo:  # both names of the file, each its own message
        create(user, str(tree))
    assert excinfo.value.message_dict == {"code": [
        f"member {name!r}: a hard link (the file has 2 names); links are refused, inside the archive or out of it: "
        f"put the file itself in the archive." for name in ("train.py", "train2.py")]}
    (tree / "train2.py").unlink()
    os.mkfifo(tree / "pipe")
    assert refused(user, code_store, str(tree)) == (
        "member 'pipe': a FIFO, not a regular file; only regular files and directories may be in a code archive.")


def test_names_that_are_not_text_are_refused(user, code_store, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        for name, data in {**MODEL_FILES, "caf\xe9.py": b"x = 1\n"}.items():  # latin-1 bytes: not UTF-8
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert refused(user, code_store, upload(buf.getvalue(), "m.tgz")) == \
        "member 'caf\\udce9.py': the name is not UTF-8 text; rename it."
    assert refused(user, code_store, upload(zip_bytes({**MODEL_FILES, "a\x01b.py": b""}))) == \
        "member 'a\\x01b.py': a control character in the name; rename it."


def test_directory_paths_the_filesystem_cannot_take(user, code_store, tmp_path):
    too_long = str(tmp_path / "roots" / ("x" * 300))
    assert refused(user, code_store, too_long).endswith("cannot be read as a directory (File name too long).")
    assert refused(user, code_store, str(tmp_path / "roots" / "missing")) == \
        f"{str(tmp_path / 'roots' / 'missing')!r} is not a directory on the server."
    assert refused(user, code_store, "proj\x00/x") == \
        "The directory's path contains a NUL character; give the path as it is."


def test_a_save_that_fails_after_the_file_was_written_leaves_no_row(user, code_store, monkeypatch):
    """Another request takes the name between the check and the save: the archive's row goes with
    the rolled-back save, the error is the name's, and the file left behind (named by its content)
    is the one the next store of the same files uses."""
    from jobs.services import resources

    ModelSpec.objects.create(owner=user, name="mine", architecture="cnn")
    monkeypatch.setattr(resources, "name_taken", lambda *args, **kwargs: False)
    with pytest.raises(ValidationError) as excinfo:
        create(user, upload(zip_bytes(MODEL_FILES)))
    assert excinfo.value.message_dict == {"name": ["You already have a model named mine; choose another name."]}
    assert (CodeArchive.objects.count(), ModelSpec.objects.count()) == (0, 1)
    left = stored_files(code_store)
    assert len(left) == 1
    spec = services.model_spec_create(owner=user, name="mine2", kind="code", entry_point="mymodel.net:build",
                                      code=upload(zip_bytes(MODEL_FILES)))
    assert stored_files(code_store) == left == [f"{spec.code.sha256[:2]}/{spec.code.sha256}.tar.gz"]


def test_store_writes_once_and_leaves_no_temporary_file_on_failure(user, code_store, monkeypatch):
    archive = code_archives.normalize_upload(io.BytesIO(zip_bytes(MODEL_FILES)))

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(code_archives.os, "replace", refuse)
    with pytest.raises(OSError):
        code_archives.store(archive)
    assert stored_files(code_store) == [] and CodeArchive.objects.count() == 0
    monkeypatch.undo()
    row = code_archives.store(archive)
    first = row.path.stat().st_mtime_ns
    assert code_archives.store(archive).pk == row.pk and row.path.stat().st_mtime_ns == first  # not rewritten
    assert oct(row.path.stat().st_mode & 0o777) == "0o644"
    assert code_archives.load_stored(row).files == archive.files
    row.path.write_bytes(b"tampered")
    with pytest.raises(code_archives.ArchiveError) as excinfo:
        code_archives.load_stored(row)
    assert str(excinfo.value).startswith("Not a readable .tar.gz archive")


def test_a_builtin_model_cannot_be_custom_or_carry_code_fields(user, code_store):
    with pytest.raises(ValidationError) as excinfo:
        services.model_spec_create(owner=user, name="b", architecture="custom", entry_point="m.n:f",
                                   script_args=["--x"], code=upload(zip_bytes(MODEL_FILES)))
    assert excinfo.value.message_dict == {
        "architecture": ["custom is the architecture of your own model: choose kind code, or one of cnn, gpt, mlp, resnet."],
        "code": ["A built-in model takes no code; choose kind code (your model function) or script (your training "
                 "script) to use an archive."],
        "entry_point": ["Only a model of kind code or script has entry point; remove it, or choose one of those kinds."],
        "script_args": ["Only a model of kind code or script has script args; remove it, or choose one of those "
                        "kinds."]}
    assert (CodeArchive.objects.count(), ModelSpec.objects.count(), stored_files(code_store)) == (0, 0, [])
