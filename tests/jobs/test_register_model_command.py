"""manage.py register_model: a model from an archive or a directory, --json, every bad option's
message in one run with exit 2 and nothing stored, --update, and --help in a real process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from codekit import Link, MODEL_FILES, stored_files, tar_gz_bytes, zip_bytes
from jobs.models import CodeArchive, ModelSpec, Team

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("code_store")]

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        call_command("register_model", *args, stdout=out, stderr=err)
    except CommandError as exc:
        code, err = exc.returncode, io.StringIO(err.getvalue() + str(exc))
    return code, out.getvalue(), err.getvalue()


def test_registers_a_model_from_a_zip(user, tmp_path, code_store):
    archive = tmp_path / "tiny.zip"
    archive.write_bytes(zip_bytes(MODEL_FILES))
    code, out, err = run("--name", "tiny", "--code", str(archive), "--entry-point", "mymodel.net:build",
                         "--param", "width=32", "--param", 'act="gelu"', "--shard-class", "Block",
                         "--image", "us-docker.pkg.dev/p/r/train:1", "--owner", "alice", "--json")
    assert code == 0, err
    spec = ModelSpec.objects.get()
    summary = json.loads(out)
    assert summary == {
        "id": spec.pk, "name": "tiny", "owner": "alice", "kind": "code", "entry_point": "mymodel.net:build",
        "script_args": [], "framework": "torch", "shard_classes": ["Block"], "params": {"width": 32, "act": "gelu"},
        "image": "us-docker.pkg.dev/p/r/train:1", "team": None,
        "code": {"sha256": spec.code.sha256, "size_bytes": spec.code.size_bytes, "file_count": 4,
                 "requirements": "tinypkg==1.0\n", "path": str(spec.code.path)}}
    assert f"model tiny registered (id {spec.pk}): kind code, mymodel.net:build, archive {spec.code.sha256[:12]} " \
           f"(4 files, {spec.code.size_bytes:,} bytes, with requirements.txt)" in err
    assert stored_files(code_store) == [f"{spec.code.sha256[:2]}/{spec.code.sha256}.tar.gz"]


def test_a_script_from_a_directory_then_updated(user, tmp_path, code_store):
    tree = tmp_path / "roots" / "proj"
    for name, data in MODEL_FILES.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(data)
    code, _, err = run("--name", "mytrain", "--code", str(tree), "--script", "train.py",
                       "--script-arg=--epochs", "--script-arg", "3", "--owner", "alice")
    assert code == 0, err
    spec = ModelSpec.objects.get()
    assert (spec.kind, spec.entry_point, spec.script_args) == ("script", "train.py", ["--epochs", "3"])
    first = spec.code_id
    (tree / "train2.py").write_bytes(b"print('v2')\n")
    taken = run("--name", "mytrain", "--code", str(tree), "--script", "train2.py", "--owner", "alice")
    assert taken[0] == 2 and "--name: You already have a model named mytrain; choose another name." in taken[2]
    code, _, err = run("--name", "mytrain", "--code", str(tree), "--script", "-m mymodel.net", "--owner", "alice",
                       "--update")
    assert code == 0, err
    spec.refresh_from_db()
    assert (spec.entry_point, spec.script_args, ModelSpec.objects.count()) == ("-m mymodel.net", [], 1)
    assert spec.code_id != first and CodeArchive.objects.count() == 2
    assert "model mytrain updated" in err


def test_every_bad_option_in_one_run_exits_2_and_stores_nothing(user, tmp_path, code_store):
    archive = tmp_path / "bad.tgz"
    archive.write_bytes(tar_gz_bytes({**MODEL_FILES, "mymodel/evil": Link("/etc/shadow")}))
    code, out, err = run("--name", "bad name", "--code", str(archive), "--entry-point", "mymodel.net:build",
                         "--param", "width=wide", "--shard-class", "9lives", "--image", "no spaces please",
                         "--team", "nobodys", "--owner", "alice")
    assert code == 2 and out == ""
    lines = err.split("the model was not registered:\n", 1)[1].splitlines()
    assert [line.strip().split(":", 1)[0] for line in lines] == [
        "--team", "--param width=wide", "--code", "--name", "--image", "--shard-class"]
    assert "  --code: member 'mymodel/evil': a symbolic link (to '/etc/shadow')" in err
    assert "  --team: alice is not a member of a team named 'nobodys'." in err
    assert "  --shard-class: Shard classes [0]: '9lives' is not a Python class name." in err
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), stored_files(code_store)) == (0, 0, [])


def test_a_missing_entry_point_and_a_missing_code_path(user, tmp_path, code_store):
    archive = tmp_path / "m.zip"
    archive.write_bytes(zip_bytes(MODEL_FILES))
    code, _, err = run("--name", "m", "--code", str(archive), "--entry-point", "mymodel.net:Block", "--owner", "alice")
    assert code == 2
    assert ("--entry-point: 'Block' in mymodel/net.py is a class, not a function; name a function that returns "
            "the torch.nn.Module.") in err
    code, _, err = run("--name", "m", "--code", str(tmp_path / "nope.zip"), "--script", "train.py",
                       "--script-arg=--x", "--owner", "alice")
    assert code == 2 and f"--code: {tmp_path / 'nope.zip'} is neither a file nor a directory." in err
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "train.py").write_bytes(b"print(1)\n")
    code, _, err = run("--name", "m", "--code", str(outside), "--script", "train.py", "--owner", "alice")
    assert code == 2 and "--code: A code directory must lie inside" in err
    code, _, err = run("--name", "m", "--code", str(archive), "--script", "train.py", "--owner", "nobody")
    assert code == 2 and "--owner: no user named 'nobody'." in err
    # A framework other than torch on a model function: the command's words, not the form's kinds.
    code, _, err = run("--name", "m", "--code", str(archive), "--entry-point", "mymodel.net:build", "--framework",
                       "tensorflow", "--owner", "alice")
    assert code == 2
    assert err.split("the model was not registered:\n", 1)[1].splitlines() == [
        "  --framework tensorflow: only a training script runs under tensorflow (Trainboard's own trainer is "
        "PyTorch): give --script instead of --entry-point, or leave --framework out (torch)."]
    assert (ModelSpec.objects.count(), stored_files(code_store)) == (0, [])


def test_shared_with_a_team(user, tmp_path):
    team = Team.objects.create(name="vision")
    team.members.add(user)
    archive = tmp_path / "m.zip"
    archive.write_bytes(zip_bytes(MODEL_FILES))
    code, out, err = run("--name", "m", "--code", str(archive), "--entry-point", "mymodel.net:build",
                         "--owner", "alice", "--team", "vision", "--json")
    assert code == 0, err
    assert json.loads(out)["team"] == "vision" and ModelSpec.objects.get().team == team


def test_help_and_usage_errors_in_a_real_process():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "webapp.settings"}
    shown = subprocess.run([sys.executable, "manage.py", "register_model", "--help"], cwd=REPO_ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    for needle in ("--entry-point PACKAGE.MODULE:FUNCTION", "--script FILE_OR_-m_MODULE", "--script-arg=--epochs",
                   "TRAINBOARD_CODE_ROOTS", "Exit status: 0 registered, 2 bad input"):
        assert needle in text, needle
    both = subprocess.run([sys.executable, "manage.py", "register_model", "--name", "x", "--code", "x.zip",
                           "--entry-point", "a.b:c", "--script", "t.py", "--owner", "alice"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert both.returncode == 2
    assert "argument --script: not allowed with argument --entry-point" in both.stderr


def test_every_unsafe_member_of_the_archive_is_reported(user, tmp_path, code_store):
    archive = tmp_path / "bad.tgz"
    archive.write_bytes(tar_gz_bytes({**MODEL_FILES, "mymodel/evil": Link("/etc/shadow"),
                                      "mymodel/copy.py": Link("mymodel/net.py", hard=True),
                                      "../outside.py": b"x = 1\n", "trainer_pkg/x.py": b"x = 1\n"}))
    code, out, err = run("--name", "bad", "--code", str(archive), "--entry-point", "mymodel.net:build",
                         "--owner", "alice")
    assert (code, out) == (2, "")
    assert err.split("the model was not registered:\n", 1)[1].splitlines() == [
        "  --code: member 'mymodel/evil': a symbolic link (to '/etc/shadow'); links are refused, inside the archive "
        "or out of it: put the file itself in the archive.",
        "  --code: member 'mymodel/copy.py': a hard link (to 'mymodel/net.py'); links are refused, inside the "
        "archive or out of it: put the file itself in the archive.",
        "  --code: member '../outside.py': path leaves the archive (..)",
        "  --code: member 'trainer_pkg/x.py': trainer_pkg/ is Trainboard's trainer package, which the job puts "
        "beside your files; rename your package.",
    ]
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), stored_files(code_store)) == (0, 0, [])
