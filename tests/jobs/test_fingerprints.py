"""jobs/fingerprints.py: what identifies a local dataset's content (sizes, file count, newest
modification time, a hash of the first MiB of up to 16 files chosen evenly from the sorted paths),
and which change moves which value."""

from __future__ import annotations

import datetime as dt
import hashlib
import os

import pytest

from jobs.fingerprints import SAMPLE_BYTES, dataset_fingerprint, local_fingerprint, sample_indices


def write(path, data: bytes, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (mtime, mtime))


@pytest.fixture
def tree(tmp_path):
    """An ImageFolder-like tree: 2 classes × 20 files of 100 bytes, and one large file."""
    root = tmp_path / "images"
    for label in ("cat", "dog"):
        for i in range(20):
            write(root / label / f"{i:03d}.png", bytes([i]) * 100, 1_700_000_000 + i)
    write(root / "big.bin", b"a" * SAMPLE_BYTES + b"tail", 1_700_000_100)
    return root


def test_sample_indices_are_evenly_spaced_from_first_to_last():
    assert sample_indices(3) == [0, 1, 2]
    assert sample_indices(100, 4) == [0, 33, 66, 99]
    picked = sample_indices(41)
    assert len(picked) == 16 and picked[0] == 0 and picked[-1] == 40 and picked == sorted(set(picked))


def test_a_directory_fingerprint_gives_sizes_count_newest_time_and_the_sample_hash(tree):
    fp = local_fingerprint(tree)
    assert fp["kind"] == "local" and fp["path"] == str(tree)
    assert fp["files"] == 41
    assert fp["size_bytes"] == 40 * 100 + SAMPLE_BYTES + 4
    assert fp["mtime"] == dt.datetime.fromtimestamp(1_700_000_100, tz=dt.timezone.utc).isoformat()
    # The hash, recomputed by the rule: sorted relative paths, 16 evenly spaced, path + size + first MiB.
    names = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for index in sample_indices(len(names)):
        data = (tree / names[index]).read_bytes()
        digest.update(f"{names[index]}\0{len(data)}\0".encode())
        digest.update(data[:SAMPLE_BYTES])
    assert fp["sample_sha256"] == digest.hexdigest()
    assert local_fingerprint(tree) == fp  # deterministic


def test_changing_a_sampled_file_changes_the_hash_and_an_unsampled_one_the_time(tree):
    before = local_fingerprint(tree)
    names = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    sampled = {names[i] for i in sample_indices(len(names))}
    first = next(n for n in names if n.endswith(".png") and n in sampled)
    write(tree / first, b"\xff" * 100, 1_700_000_000)  # same size, same time, other bytes
    after = local_fingerprint(tree)
    assert after["sample_sha256"] != before["sample_sha256"]
    assert (after["size_bytes"], after["files"], after["mtime"]) == (before["size_bytes"], before["files"],
                                                                     before["mtime"])
    unsampled = next(n for n in names if n not in sampled)
    write(tree / unsampled, b"\x01" * 100, 1_800_000_000)
    later = local_fingerprint(tree)
    assert later["sample_sha256"] == after["sample_sha256"]
    assert later["mtime"] == dt.datetime.fromtimestamp(1_800_000_000, tz=dt.timezone.utc).isoformat()
    # Beyond the first MiB of a file only its size and time tell.
    big = tree / "big.bin"
    write(big, b"a" * SAMPLE_BYTES + b"TAIL", 1_700_000_100)
    assert local_fingerprint(tree)["sample_sha256"] == later["sample_sha256"]


def test_a_single_file_an_empty_directory_and_a_missing_path(tmp_path):
    csv = tmp_path / "t.csv"
    write(csv, b"a,label\n1,0\n", 1_700_000_000)
    fp = local_fingerprint(csv)
    assert (fp["files"], fp["size_bytes"]) == (1, 12)
    assert fp["sample_sha256"] == hashlib.sha256(b"t.csv\x0012\x00a,label\n1,0\n").hexdigest()
    (tmp_path / "empty").mkdir()
    empty = local_fingerprint(tmp_path / "empty")
    assert (empty["files"], empty["size_bytes"], empty["mtime"]) == (0, 0, None)
    missing = local_fingerprint(tmp_path / "gone")
    assert missing == {"kind": "local", "path": str(tmp_path / "gone"),
                       "error": "cannot read it: no such file or directory"}


def test_a_symlink_is_not_followed(tmp_path, tree):
    outside = tmp_path / "secret.txt"
    write(outside, b"x" * 1000, 1_900_000_000)
    before = local_fingerprint(tree)
    (tree / "cat" / "link.png").symlink_to(outside)
    assert local_fingerprint(tree) == before


def test_dataset_fingerprint_by_kind(tmp_path):
    assert dataset_fingerprint(format="builtin", uri="", builtin_name="digits") == {"kind": "builtin",
                                                                                   "name": "digits"}
    assert dataset_fingerprint(format="imagefolder", uri="s3://b/images/") is None
    assert dataset_fingerprint(format="npz", uri="gs://b/x.npz") is None
    write(tmp_path / "x.npz", b"12345", 1_700_000_000)
    assert dataset_fingerprint(format="npz", uri=str(tmp_path / "x.npz"))["size_bytes"] == 5
