"""Token datasets read straight from object storage (trainer_pkg.objstore): the same windows from
moto's S3 server, gcp-storage-emulator and Azurite as from the local copy, each window one ranged
read, never a whole shard. Every store is a stand-in on 127.0.0.1."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from adapter_standins import azurite_blob, gcs_emulator, standin
from test_webdataset import unit, write_shard
from trainer_pkg import objstore
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.datasets import load_dataset
from trainer_pkg.web_shard import WebShard
from trainer_pkg.token_shard import TokenShard, validation_windows
from trainer_pkg.tokens import RemoteShard, open_tokens, write_tokens

CPU = torch.device("cpu")
SEQ = 16


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    """A token dataset of three train shards (one a .npy) and one val shard, token k of shard s = s·10⁴ + k."""
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    train = [s * 10_000 + np.arange(n) for s, n in enumerate((700, 300, 450))]
    write_tokens(str(root), vocab_size=1 << 17, train=train[:2], val=[rng.integers(0, 1 << 17, 260)])
    np.save(root / "train" / "000002.npy", train[2].astype(np.uint32))
    meta = (root / "meta.json").read_text().replace('"train/000001.bin"', '"train/000001.bin", "train/000002.npy"')
    (root / "meta.json").write_text(meta)
    return root


def upload(root: Path, put, prefix: str = "data/tok") -> None:
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        put(f"{prefix}/{f.relative_to(root).as_posix()}", f.read_bytes())


@pytest.fixture(scope="module")
def s3_uri(local, tmp_path_factory):
    sm = standin("sagemaker")
    with pytest.MonkeyPatch.context() as mp:
        sm.fake_aws_env(mp, tmp_path_factory.mktemp("aws"))
        with sm.moto_server(bucket="tb-data") as url:
            mp.setenv("AWS_ENDPOINT_URL_S3", url)
            import boto3

            client = boto3.client("s3")
            upload(local, lambda key, body: client.put_object(Bucket="tb-data", Key=key, Body=body))
            objstore._OPEN.clear()
            yield "s3://tb-data/data/tok"
    objstore._OPEN.clear()


@pytest.fixture(scope="module")
def gs_uri(local):
    with gcs_emulator("tb-data") as url, pytest.MonkeyPatch.context() as mp:
        mp.setenv("STORAGE_EMULATOR_HOST", url)
        mp.setenv("NO_GCE_CHECK", "True")
        from google.cloud import storage

        bucket = storage.Client().bucket("tb-data")
        upload(local, lambda key, body: bucket.blob(key).upload_from_string(body))
        objstore._OPEN.clear()
        yield "gs://tb-data/data/tok/"
    objstore._OPEN.clear()


@pytest.fixture(scope="module")
def az_uri(local, tmp_path_factory):
    with azurite_blob(tmp_path_factory.mktemp("azurite")) as account, pytest.MonkeyPatch.context() as mp:
        mp.setenv("AZURE_STORAGE_CONNECTION_STRING", account.connection_string)
        container = account.service().create_container("tb-data")
        upload(local, lambda key, body: container.upload_blob(key, body))
        objstore._OPEN.clear()
        yield "az://tb-data/data/tok"
    objstore._OPEN.clear()


def batches(data, dp_rank):
    shard = TokenShard.of(data, seq_len=SEQ, batch_size=4, dp_rank=dp_rank, dp_size=2, seed=5, drop_last=False)
    order = shard.epoch_order(1)
    return [shard.batch(order, i, CPU)[1:] for i in (0, 3, shard.batches - 1)]


@pytest.mark.parametrize("store", ["s3", "gs", "az"])
def test_the_same_windows_as_the_local_copy_each_a_ranged_read(store, local, request, monkeypatch):
    uri = request.getfixturevalue(f"{store}_uri")
    reads = []
    real = objstore.read
    monkeypatch.setattr(objstore, "read", lambda u, offset=0, length=None: reads.append((u, offset, length))
                        or real(u, offset, length))
    remote, here = open_tokens(uri), open_tokens(str(local))
    assert all(isinstance(s, RemoteShard) for s in remote.train.shards + remote.val.shards)
    assert [len(s) for s in remote.train.shards] == [len(s) for s in here.train.shards] == [700, 300, 450]
    assert remote.train.offsets[2] == here.train.offsets[2] == 128  # the .npy's header
    assert remote.val.num_tokens == 260 and remote.vocab_size == 1 << 17
    assert remote.train.paths[0] == f"{store}://tb-data/data/tok/train/000000.bin"
    # opening read meta.json whole and the shards' ends by range (the .npy also its header), nothing else
    assert [r for r in reads if r[2] is None] == [(f"{store}://tb-data/data/tok/meta.json", 0, None)]
    reads.clear()
    for rank in (0, 1):
        for (x, y), (xl, yl) in zip(batches(remote, rank), batches(here, rank)):
            assert torch.equal(x, xl) and torch.equal(y, yl) and x.shape[1] == SEQ and len(x) in (1, 4)
    assert reads and all(length == (SEQ + 1) * 4 for _, _, length in reads)  # uint32 tokens
    vx, vy = validation_windows(remote, seq_len=SEQ, count=8, seed=1)
    lx, ly = validation_windows(here, seq_len=SEQ, count=8, seed=1)
    assert torch.equal(vx, lx) and torch.equal(vy, ly) and vx.shape == (8, SEQ)


def test_errors_name_the_object_and_what_to_do(s3_uri, monkeypatch):
    with pytest.raises(ConfigError, match=r"s3://tb-data/nothing-here has no meta.json: make the dataset"):
        open_tokens("s3://tb-data/nothing-here")
    with pytest.raises(ConfigError, match=r"s3://no-such-bucket/tok/meta.json cannot be read: .*NoSuchBucket.*"
                                          r"check that the job's credentials"):
        open_tokens("s3://no-such-bucket/tok")
    with pytest.raises(ConfigError, match=r"names no bucket: write gs://<bucket>/<prefix>"):
        open_tokens("gs:///tok")
    objstore._OPEN.clear()
    monkeypatch.setitem(sys.modules, "boto3", None)  # an image without boto3
    with pytest.raises(ConfigError, match=r"reading s3:// datasets needs boto3, which this image lacks: "
                                          r"pip install 'trainboard-trainer\[s3\]'"):
        open_tokens(s3_uri)
    objstore._OPEN.clear()


def test_no_cloud_sdk_or_torch_is_imported_until_a_uri_needs_it():
    code = ("import sys, trainer_pkg.objstore, trainer_pkg.tokens, trainer_pkg.datasets; "
            "print(sorted(m for m in ('torch', 'boto3', 'google.cloud.storage', 'azure.storage.blob') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


def test_webdataset_shards_stream_from_s3_as_from_the_folder(s3_uri, tmp_path):
    import boto3

    root = tmp_path / "wds"
    for name, first, count in (("a.tar", 0, 5), ("b.tar", 5, 7), ("c.tar", 12, 2), ("val/v.tar", 100, 3)):
        write_shard(root / name, first, count)
    client = boto3.client("s3")
    upload(root, lambda key, body: client.put_object(Bucket="tb-data", Key=key, Body=body), prefix="data/wds")
    job = lambda uri: JobConfig.from_dict({"data": {"format": "webdataset", "uri": uri, "image_size": 8},  # noqa: E731
                                           "train": {"batch_size": 2, "seed": 4}})
    here, remote = load_dataset(job(str(root)).data), load_dataset(job("s3://tb-data/data/wds").data)
    assert [s.path for s in remote.train] == [f"s3://tb-data/data/wds/{n}.tar" for n in "abc"]
    assert remote.y_val.tolist() == here.y_val.tolist() and remote.num_classes == here.num_classes
    np.testing.assert_array_equal(remote.x_val.take(np.arange(3)), here.x_val.take(np.arange(3)))
    for rank, own, samples in ((0, [0, 2], 7), (1, [1], 7)):
        a, b = WebShard.of(remote, unit(rank), job("")), WebShard.of(here, unit(rank), job(""))
        assert a.own == b.own == own and a.samples == b.samples == samples and a.batches == 4
        order = a.epoch_order(1)
        for i in range(a.batches):
            _, xa, ya = a.batch(order, i, CPU)
            _, xb, yb = b.batch(order, i, CPU)
            assert torch.equal(xa, xb) and torch.equal(ya, yb) and len(ya) == (2 if i < 3 else 1)


def test_a_range_file_reads_across_its_blocks_in_full():
    data = bytes(range(256)) * 40  # 10,240 bytes, read in 1,000-byte blocks
    fetched = []
    f = objstore.RangeFile(lambda o, n: fetched.append((o, n)) or data[o:o + n], len(data), block=1000)
    assert f.read(10) == data[:10] and fetched == [(0, 1000)]
    f.seek(990)
    assert f.read(25) == data[990:1015] and fetched == [(0, 1000), (1000, 1000)]  # one read, two blocks
    f.seek(-5, 2)
    assert f.read(100) == data[-5:] and f.read(1) == b""
    f.seek(3000)
    assert f.read(2500) == data[3000:5500]  # one fetch of the whole read when it exceeds a block
    assert fetched[-1] == (3000, 2500)
