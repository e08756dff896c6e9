"""manage.py prepare_text: the real corpus (the first verses of the King James Bible) into a token
dataset registered for its owner; every bad option in one run, exit 2, nothing written."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from jobs.models import Dataset
from trainer_pkg.tokens import open_tokens

pytestmark = pytest.mark.django_db

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        call_command("prepare_text", *args, stdout=out, stderr=err)
    except CommandError as exc:
        code, err = exc.returncode, io.StringIO(err.getvalue() + str(exc))
    return code, out.getvalue(), err.getvalue()


def test_the_readmes_corpus_command_makes_its_data_folder(tmp_path):
    """The README's first token-data command, ``python3 scripts/corpus_kjv.py data/kjv.txt``, on a fresh
    clone, which has no data/ (it is .gitignored): the folder is made, the corpus written."""
    assert not (tmp_path / "data").exists()
    made = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "corpus_kjv.py"), "data/kjv.txt"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    lines = (tmp_path / "data" / "kjv.txt").read_text(encoding="utf-8").splitlines()
    assert len([x for x in lines if x]) == 31_102 and lines[0].startswith("In the beginning God created")
    assert "corpus_kjv: wrote data/kjv.txt: 31,102 verses" in made.stderr


@pytest.fixture(scope="module")
def genesis(tmp_path_factory):
    """Genesis to Leviticus (the first 3,600 verses) as a text file, from scripts/corpus_kjv.py."""
    work = tmp_path_factory.mktemp("corpus")
    made = subprocess.run([sys.executable, "scripts/corpus_kjv.py", str(work / "kjv.txt")], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    lines = (work / "kjv.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    (work / "genesis.txt").write_text("".join(lines[:3600]), encoding="utf-8")
    return work / "genesis.txt"


@pytest.fixture
def roots(tmp_path, settings):
    settings.TRAINBOARD_DATASET_ROOTS = [str(tmp_path / "datasets")]
    return tmp_path / "datasets"


def test_prepares_and_registers_a_token_dataset(user, genesis, roots):
    out = roots / "genesis"
    code, stdout, err = run(str(genesis), "--out", str(out), "--vocab-size", "512", "--name", "genesis",
                            "--owner", "alice", "--description", "Genesis to Leviticus", "--json")
    assert code == 0, err
    ds = Dataset.objects.get()
    assert (ds.name, ds.owner, ds.format, ds.uri, ds.sample_shape) == ("genesis", user, "tokens", str(out), [None])
    summary = json.loads(stdout)
    data = open_tokens(str(out))
    assert summary["dataset"] == {"id": ds.pk, "name": "genesis", "owner": "alice"}
    assert summary["vocab_size"] == data.vocab_size == 512 and summary["train_tokens"] == data.train.num_tokens
    assert data.train.num_tokens > 100_000 and data.val.num_tokens > 1000
    assert "[prepare_text] training a byte-level BPE tokenizer of 512 tokens" in err
    assert f"dataset genesis registered (id {ds.pk}) for alice" in err


def test_every_bad_option_is_reported_before_anything_is_written(user, genesis, roots, tmp_path):
    Dataset.objects.create(owner=user, name="taken", format="builtin", builtin_name="digits")
    outside = tmp_path / "elsewhere"
    code, stdout, err = run(str(genesis), str(tmp_path / "nope.txt"), "--out", str(outside), "--vocab-size", "10",
                            "--name", "taken", "--owner", "alice")
    assert code == 2 and stdout == ""
    assert err.startswith("nothing was written:")
    assert f"input {tmp_path / 'nope.txt'} does not exist" in err
    assert "--vocab-size must be from 257" in err
    assert "--name: alice already has a dataset named taken; choose another name." in err
    assert f"--out {outside}: a registered dataset must lie inside {roots}" in err
    assert not outside.exists() and Dataset.objects.count() == 1
    code, _, err = run(str(genesis), "--out", str(roots / "x"), "--name", "x", "--owner", "nobody")
    assert code == 2 and "--owner: no user named 'nobody'." in err and not (roots / "x").exists()


def test_a_fresh_checkout_without_tables_hears_what_to_run(genesis, tmp_path):
    """Before `make demo` or `migrate` there is no user table: the command says what to run, exit 2,
    instead of a database traceback."""
    env = {**__import__("os").environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'empty.sqlite3'}",
           "TRAINBOARD_DATASET_ROOTS": str(tmp_path)}
    done = subprocess.run([sys.executable, "manage.py", "prepare_text", str(genesis), "--out", str(tmp_path / "k"),
                           "--name", "kjv", "--owner", "alice"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--owner: the dashboard's database is not ready (no such table: auth_user): run `make demo` once, or " \
           "`python manage.py migrate` and create the user, first." in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "k").exists()
