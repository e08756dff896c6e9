"""Token datasets on disk: open_tokens' checks, the held-out tail of train, inspect_tokens, and
prepare_text on the real corpus (the King James Bible, scripts/corpus_kjv.py)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from trainer_helpers import REPO, trainer_env
from trainer_pkg.config import ConfigError, DataConfig
from trainer_pkg.datasets import describe, inspect_dataset, load_dataset
from trainer_pkg.tokens import ShardWriter, inspect_tokens, open_tokens, token_dtype, write_meta, write_tokens


def _meta(root):
    return json.loads((root / "meta.json").read_text())


def test_every_bad_shard_is_named_at_once_with_what_to_do(tmp_path):
    root = tmp_path / "d"
    write_tokens(str(root), vocab_size=100, train=[np.arange(50), np.arange(50)], val=[np.arange(10)])
    (root / "train" / "000001.bin").write_bytes(b"\x01\x00\x02")  # 1.5 uint16 tokens
    np.array([5, 7, 300], dtype=np.uint16).tofile(root / "val" / "000000.bin")
    meta = _meta(root)
    meta["splits"]["train"] += ["train/missing.bin", "../outside.bin", "train/x.txt"]
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as err:
        open_tokens(str(root))
    msg = str(err.value)
    assert "000001.bin has 3 bytes, not a whole number of uint16 tokens (2 bytes each): it is truncated" in msg
    assert "missing.bin listed in" in msg and "does not exist" in msg
    assert "shard '../outside.bin' lies outside the dataset directory" in msg
    assert "shard 'train/x.txt' is not a .bin or .npy file" in msg
    assert "val/000000.bin holds token id 300, not below vocab_size 100" in msg


def test_dataset_level_errors_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist: give the folder holding meta.json \(made by python -m "
                                          r"trainer_pkg.prepare_text\)"):
        open_tokens(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"hdfs://nn/tokens is neither a local path nor an s3://, gs:// or az:// "
                                          r"prefix: pass the mount or channel path"):
        open_tokens("hdfs://nn/tokens")  # s3://, gs://, az:// are read by range: tests/trainer_pkg/test_objstore.py
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no meta.json: make the dataset with python -m trainer_pkg.prepare_text"):
        open_tokens(str(tmp_path / "empty"))
    root = tmp_path / "d"
    write_tokens(str(root), vocab_size=100, train=[np.arange(50)], val=[np.arange(10)])
    write_meta(str(root), dtype="uint16", vocab_size=100, splits={"train": ["train/000000.bin"]})
    with pytest.raises(ConfigError, match=r"lists no val shards: list some under splits.val \(prepare_text makes "
                                          r"them\), or let the trainer hold out data.val_fraction"):
        open_tokens(str(root))
    write_meta(str(root), dtype="int8", vocab_size=100, splits={"train": ["train/000000.bin"]})
    with pytest.raises(ConfigError, match="dtype must be one of uint16, uint32, got 'int8'"):
        open_tokens(str(root))


def test_without_val_shards_the_tail_of_train_is_held_out(tmp_path):
    root = tmp_path / "d"
    write_tokens(str(root), vocab_size=1000, train=[np.arange(600), np.arange(600, 1000)], val=[])
    data = open_tokens(str(root), val_fraction=0.25)  # the last 250 of 1,000 tokens
    assert data.train.num_tokens == 750 and data.val.num_tokens == 250
    assert [len(s) for s in data.train.shards] == [600, 150] and int(data.val.shards[0][0]) == 750
    assert np.array_equal(np.concatenate(data.train.shards + data.val.shards), np.arange(1000))
    info = inspect_tokens(str(root), val_fraction=0.25)
    assert info.summary == ("750 tokens in 2 shards (train), 250 (val: the last 25% of train, data.val_fraction), "
                            "vocab 1,000, uint16") and info.val_from_train
    with pytest.raises(ConfigError, match="data.val_fraction 0.001 of its 1,000 train tokens leaves no validation tokens"):
        open_tokens(str(root), val_fraction=0.001)


def test_writer_shards_dtype_and_the_dashboards_summary(tmp_path):
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"
    root = tmp_path / "d"
    writer = ShardWriter(str(root), "train", "uint32", shard_tokens=1000)
    for start in range(0, 2500, 300):  # appends that straddle shard ends
        writer.append(np.arange(start, min(start + 300, 2500)) + 65536)
    assert writer.close() == ["train/000000.bin", "train/000001.bin", "train/000002.bin"]
    val = ShardWriter(str(root), "val", "uint32", shard_tokens=1000)
    val.append([70_000, 70_001, 70_002])
    write_meta(str(root), dtype="uint32", vocab_size=70_003, splits={"train": writer.files, "val": val.close()})
    data = load_dataset(DataConfig(format="tokens", uri=str(root)))
    assert [len(s) for s in data.train.shards] == [1000, 1000, 500] and data.train.shards[0].dtype == np.uint32
    assert np.array_equal(np.concatenate(data.train.shards), np.arange(2500) + 65536)
    assert describe(data) == {"train_tokens": 2500, "val_tokens": 3, "train_shards": 3, "vocab_size": 70_003,
                              "dtype": "uint32"}
    info = inspect_dataset("tokens", str(root))
    assert info.summary == "2,500 tokens in 3 shards (train), 3 (val), vocab 70,003, uint32"
    assert info.sample_shape == (None,)


def test_token_modules_are_torch_free():
    code = "import sys, trainer_pkg.tokens, trainer_pkg.prepare_text, trainer_pkg.datasets; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


# -- prepare_text on the real corpus ------------------------------------------------------------------


def _run(*args, cwd=REPO):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=trainer_env(), capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def kjv(tmp_path_factory):
    """The first 12,000 verses of the King James Bible (Genesis to 2 Samuel, 1.4 MB) in two files,
    and the token dataset prepare_text makes of them."""
    work = tmp_path_factory.mktemp("kjv")
    whole = work / "kjv.txt"
    made = _run("scripts/corpus_kjv.py", str(whole))
    assert made.returncode == 0, made.stderr
    lines = whole.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len([x for x in lines if x.strip()]) == 31_102 and lines[0].startswith("In the beginning God created")
    books = work / "books"
    books.mkdir()
    (books / "a.txt").write_text("".join(lines[:6000]), encoding="utf-8")
    (books / "b.txt").write_text("".join(lines[6000:12000]), encoding="utf-8")
    out = work / "tokens"
    done = _run("-m", "trainer_pkg.prepare_text", str(books), "--out", str(out), "--vocab-size", "2048",
                "--val-fraction", "0.05", "--shard-tokens", "100000")
    assert done.returncode == 0, done.stderr
    return books, out, json.loads(done.stdout), done.stderr


def test_prepare_text_makes_shards_that_decode_to_the_text(kjv):
    from tokenizers import Tokenizer

    books, out, summary, stderr = kjv
    data = open_tokens(str(out))
    assert data.vocab_size == summary["vocab_size"] == 2048 and data.dtype == "uint16"
    assert summary["train_tokens"] == data.train.num_tokens > 300_000 and summary["val_tokens"] == data.val.num_tokens
    assert [len(s) for s in data.train.shards[:-1]] == [100_000] * (len(data.train.shards) - 1)
    assert "encoded 2/2 file(s)" in stderr and f"wrote {out}" in stderr
    # Train is each file's first 95 % (cut at a line end), val its rest; <|endoftext|> (id 0) after each part.
    tok = Tokenizer.from_file(data.tokenizer)
    train = np.concatenate(data.train.shards)
    val = np.concatenate(data.val.shards)
    eot = _meta(out)["end_of_text"]
    assert eot == tok.token_to_id("<|endoftext|>") == 0
    assert (train == eot).sum() == 2 and (val == eot).sum() == 2 and train[-1] == val[-1] == eot
    a, b = ((books / n).read_text(encoding="utf-8") for n in ("a.txt", "b.txt"))
    train_a, train_b = tok.decode(train[:-1].tolist(), skip_special_tokens=False).split("<|endoftext|>")
    val_a, val_b = tok.decode(val[:-1].tolist(), skip_special_tokens=False).split("<|endoftext|>")
    assert train_a + val_a == a and train_b + val_b == b
    assert train_a.endswith("\n") and 0.04 < len(val_a) / len(a) < 0.06
    # the BPE learned the corpus: common words are single tokens, ~3-4 characters per token
    assert len(tok.encode(" LORD").ids) == 1 and 3.0 < len(a + b) / (len(train) + len(val)) < 5.0
    assert inspect_dataset("tokens", str(out)).summary.endswith("vocab 2,048, uint16")


def test_prepare_text_reuses_a_tokenizer_and_reports_every_error_at_once(kjv, tmp_path):
    books, out, summary, _ = kjv
    again = tmp_path / "again"
    done = _run("-m", "trainer_pkg.prepare_text", str(books / "b.txt"), "--out", str(again),
                "--tokenizer", str(out / "tokenizer.json"), "--val-fraction", "0.5")
    assert done.returncode == 0, done.stderr
    ours, theirs = open_tokens(str(again)), open_tokens(str(out))
    assert ours.vocab_size == 2048
    # same tokenizer, same text: b.txt's tokens in the first dataset are a run inside the new one
    first = np.concatenate(theirs.train.shards).tolist()
    b_ids = first[first.index(0) + 1:-1]
    assert np.concatenate(ours.train.shards).tolist()[:1000] == b_ids[:1000]

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    bad = _run("-m", "trainer_pkg.prepare_text", str(tmp_path / "missing.txt"), str(books / "a.txt"),
               "--out", str(tmp_path / "full"), "--vocab-size", "100", "--val-fraction", "1.5",
               "--shard-tokens", "1")
    assert bad.returncode == 2 and bad.stdout == ""
    errors = [line for line in bad.stderr.splitlines() if line.startswith("prepare_text: error: ")]
    assert len(errors) == 5, bad.stderr
    assert "input " + str(tmp_path / "missing.txt") + " does not exist: give text files or folders" in bad.stderr
    assert f"--out {tmp_path / 'full'} is a folder that is not empty: give a new or empty folder" in bad.stderr
    assert "--vocab-size must be from 257 (the 256 bytes and <|endoftext|>) to 4,294,967,296, got 100" in bad.stderr
    assert "--val-fraction must be above 0 and below 1" in bad.stderr and "--shard-tokens must be at least 2" in bad.stderr
    assert not (tmp_path / "full" / "meta.json").exists()

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1") * 10)
    bad = _run("-m", "trainer_pkg.prepare_text", str(latin1), "--out", str(tmp_path / "l"), "--tokenizer",
               str(out / "tokenizer.json"))
    assert bad.returncode == 2 and "latin1.txt is not UTF-8 text (byte 3): convert it to UTF-8" in bad.stderr
    assert not (tmp_path / "l").exists()  # nothing half-written is left

    (tmp_path / "junk.json").write_text("{not a tokenizer")
    for given, why in ((tmp_path / "missing.json", "no such file: give the tokenizer.json of an earlier prepare_text"),
                       (tmp_path / "junk.json", "not a tokenizers tokenizer.json (")):
        bad = _run("-m", "trainer_pkg.prepare_text", str(books / "b.txt"), "--out", str(tmp_path / "t"),
                   "--tokenizer", str(given))
        assert bad.returncode == 2 and f"prepare_text: error: --tokenizer {given}: {why}" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr and not (tmp_path / "t").exists()


def test_prepare_text_help_names_every_option():
    shown = _run("-m", "trainer_pkg.prepare_text", "--help")
    assert shown.returncode == 0
    for option in ("--out DIR", "--vocab-size N", "--val-fraction F", "--shard-tokens N", "--tokenizer FILE", "INPUT"):
        assert option in shown.stdout
