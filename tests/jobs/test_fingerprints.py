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


# --- a cloud dataset: taken by the worker at submit ------------------------------------------


@pytest.mark.django_db
def test_the_submit_records_an_s3_datasets_listing_and_a_failed_listing_never_fails_the_job(
        user, cnn_model, aws_env):
    from jobs import lifecycle, services
    from jobs.models import TrainingJob

    aws_env.create_bucket()  # the backend's own bucket: the trainer archive goes there
    aws_env.create_bucket("tb-data")
    import boto3

    s3 = boto3.client("s3", region_name="us-east-1")
    s3.put_object(Bucket="tb-data", Key="images/cat/1.png", Body=b"cat")
    s3.put_object(Bucket="tb-data", Key="images/dog/1.png", Body=b"dog!")
    sm = services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": aws_env.ROLE, "bucket": aws_env.BUCKET})
    images = services.dataset_create(owner=user, name="images", format="imagefolder", uri="s3://tb-data/images/")
    gone = services.dataset_create(owner=user, name="gone", format="imagefolder", uri="s3://no-such-bucket/x/")

    job = services.training_job_create(owner=user, dataset=images, model_spec=cnn_model, backend=sm)
    assert job.dataset_fingerprint is None  # not at creation: the web process lists no bucket
    lifecycle.training_job_submit(job=TrainingJob.objects.get(pk=job.pk))
    job.refresh_from_db()
    assert job.state == "PENDING"
    fp = job.dataset_fingerprint
    assert (fp["kind"], fp["uri"], fp["objects"], fp["size_bytes"]) == ("s3", "s3://tb-data/images/", 2, 7)
    assert len(fp["listing_sha256"]) == 64

    broken = services.training_job_create(owner=user, dataset=gone, model_spec=cnn_model, backend=sm)
    lifecycle.training_job_submit(job=TrainingJob.objects.get(pk=broken.pk))
    broken.refresh_from_db()
    assert broken.state == "PENDING"
    assert broken.dataset_fingerprint == {"kind": "s3", "uri": "s3://no-such-bucket/x/",
                                          "error": "S3 NoSuchBucket: The specified bucket does not exist"}


def test_a_token_datasets_meta_json_is_always_hashed(tmp_path):
    """meta.json names the shards (and their dtype and vocabulary): among 40 shards it would not be one
    of the 16 sampled files, yet editing it in place (same size, same time) changes the data read."""
    root = tmp_path / "tokens"
    for i in range(40):  # meta.json sorts between the shards of data/ and val/
        write(root / ("data" if i < 30 else "val") / f"{i:06d}.bin", bytes([i]) * 64, 1_700_000_000)
    write(root / "meta.json", b'{"dtype": "uint16"}', 1_700_000_000)
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert names.index("meta.json") not in sample_indices(len(names))
    before = local_fingerprint(root)
    write(root / "meta.json", b'{"dtype": "uint32"}', 1_700_000_000)
    after = local_fingerprint(root)
    assert after["sample_sha256"] != before["sample_sha256"]
    assert (after["size_bytes"], after["files"], after["mtime"]) == (before["size_bytes"], before["files"],
                                                                     before["mtime"])
