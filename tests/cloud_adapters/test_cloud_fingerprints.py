"""cloud_adapters/fingerprints.py against the stand-ins: an S3 prefix on moto through the SageMaker
adapter's boto3 client (keys, ETags, sizes), a Cloud Storage prefix on gcp-storage-emulator through
the Vertex adapter's storage client (names, generations, sizes); a rewrite of one object changes the
listing hash, a failed listing is returned as its error, Azure ML says why it is not read."""

from __future__ import annotations

import hashlib
import random

import pytest

from adapter_standins import gcs_emulator, standin
from cloud_adapters import retry
from cloud_adapters.fingerprints import fingerprint_dataset
from fake_clock import FakeClock

sagemaker_standin = standin("sagemaker")


@pytest.fixture
def s3_backend(aws_env):
    aws_env.create_bucket("tb-data")
    backend = aws_env.make_backend()
    s3 = backend.client("s3")
    s3.put_object(Bucket="tb-data", Key="images/cat/1.png", Body=b"cat-one")
    s3.put_object(Bucket="tb-data", Key="images/dog/1.png", Body=b"dog-one!")
    s3.put_object(Bucket="tb-data", Key="other/x.png", Body=b"not in the prefix")
    return backend


def expected_sha(lines: list[str]) -> str:
    return hashlib.sha256("".join(line + "\n" for line in sorted(lines)).encode()).hexdigest()


def test_an_s3_prefix_is_fingerprinted_from_its_listing(s3_backend):
    fp = fingerprint_dataset(s3_backend, "s3://tb-data/images/")
    s3 = s3_backend.client("s3")
    etags = {o["Key"]: o["ETag"].strip('"')
             for o in s3.list_objects_v2(Bucket="tb-data", Prefix="images/")["Contents"]}
    assert etags["images/cat/1.png"] == hashlib.md5(b"cat-one").hexdigest()  # a single-part upload's ETag
    assert fp == {
        "kind": "s3", "uri": "s3://tb-data/images/", "objects": 2, "size_bytes": 7 + 8,
        "last_modified": fp["last_modified"], "truncated": False,
        "listing_sha256": expected_sha([f"images/cat/1.png\t{etags['images/cat/1.png']}\t7",
                                        f"images/dog/1.png\t{etags['images/dog/1.png']}\t8"]),
    }
    assert fp["last_modified"].endswith("+00:00")
    s3.put_object(Bucket="tb-data", Key="images/cat/1.png", Body=b"cat-two")  # same size, new bytes
    again = fingerprint_dataset(s3_backend, "s3://tb-data/images/")
    assert (again["objects"], again["size_bytes"]) == (2, 15)
    assert again["listing_sha256"] != fp["listing_sha256"]


def test_an_s3_listing_reads_every_page(s3_backend, monkeypatch):
    import cloud_adapters.fingerprints as fingerprints

    s3 = s3_backend.client("s3")
    for i in range(5):
        s3.put_object(Bucket="tb-data", Key=f"many/{i}.bin", Body=b"x" * i)
    monkeypatch.setattr(fingerprints, "PAGE_SIZE", 2)
    fp = fingerprint_dataset(s3_backend, "s3://tb-data/many/")
    assert (fp["objects"], fp["size_bytes"], fp["truncated"]) == (5, 0 + 1 + 2 + 3 + 4, False)
    monkeypatch.setattr(fingerprints, "MAX_PAGES", 2)
    cut = fingerprint_dataset(s3_backend, "s3://tb-data/many/")
    assert (cut["objects"], cut["truncated"]) == (4, True)


def test_a_failed_s3_listing_is_returned_as_its_error(aws_env):
    backend = aws_env.make_backend()
    fp = fingerprint_dataset(backend, "s3://no-such-bucket/data/")
    assert set(fp) == {"kind", "uri", "error"}
    assert fp == {"kind": "s3", "uri": "s3://no-such-bucket/data/",
                  "error": "S3 NoSuchBucket: The specified bucket does not exist"}


@pytest.fixture
def gcs_backend(monkeypatch, tmp_path):
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    retry.reset_limiters()
    from cloud_adapters.vertex import VertexBackend

    with gcs_emulator("stage") as url:
        backend = VertexBackend({"project": "my-proj", "staging_bucket": "gs://stage/tb", "api_endpoint":
                                 "http://127.0.0.1:9", "storage_endpoint": url},
                                retry_policy=retry.RetryPolicy(rng=random.Random(0)), clock=FakeClock())
        bucket = backend.storage_client().bucket("stage")
        bucket.blob("data/a.npz").upload_from_string(b"aaaa")
        bucket.blob("data/b/c.npz").upload_from_string(b"cc")
        bucket.blob("elsewhere.npz").upload_from_string(b"zzz")
        yield backend
    retry.reset_limiters()


def test_a_gs_prefix_is_fingerprinted_from_the_blobs_generations(gcs_backend):
    fp = fingerprint_dataset(gcs_backend, "gs://stage/data/")
    bucket = gcs_backend.storage_client().bucket("stage")
    generations = {b.name: b.generation for b in gcs_backend.storage_client().list_blobs("stage", prefix="data/")}
    assert set(generations) == {"data/a.npz", "data/b/c.npz"}
    assert fp == {"kind": "gs", "uri": "gs://stage/data/", "objects": 2, "size_bytes": 6,
                  "last_modified": fp["last_modified"], "truncated": False,
                  "listing_sha256": expected_sha([f"data/a.npz\t{generations['data/a.npz']}\t4",
                                                  f"data/b/c.npz\t{generations['data/b/c.npz']}\t2"])}
    bucket.blob("data/a.npz").upload_from_string(b"AAAA")  # a new generation, the same size
    again = fingerprint_dataset(gcs_backend, "gs://stage/data/")
    assert again["size_bytes"] == 6 and again["listing_sha256"] != fp["listing_sha256"]


def test_azure_ml_local_and_mismatched_uris(s3_backend):
    assert fingerprint_dataset(s3_backend, "azureml://datastores/data/paths/images/") == {
        "kind": "azureml", "uri": "azureml://datastores/data/paths/images/",
        "reason": "Azure ML datastore and data-asset URIs are not listed: the fingerprint would need the storage "
                  "account's own keys; the job page shows the URI only"}
    assert fingerprint_dataset(s3_backend, "/data/images") is None
    assert fingerprint_dataset(s3_backend, "gs://b/x") == {
        "kind": "gs", "uri": "gs://b/x", "error": "a sagemaker backend does not list gs:// objects"}
