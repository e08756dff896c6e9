"""webdataset: tar shards of images and .cls labels, each data-parallel rank streaming only its own
shards, the ranks agreeing on the step count so uneven shards never hang a run."""

import io
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from trainer_helpers import records, torchrun, write_job
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.datasets import WebDataset, decode_image, load_dataset
from trainer_pkg.tar_shards import index_shard, list_shards
from trainer_pkg.web_shard import WebShard

CPU = torch.device("cpu")
SIZE = 8
CLASSES = 3


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_shard(path: Path, first: int, count: int) -> list[tuple[bytes, int]]:
    """A tar of ``count`` samples keyed first … first + count − 1 (png, cls, and a json to skip)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = [(png(k), k % CLASSES) for k in range(first, first + count)]
    with tarfile.open(path, "w") as tar:
        for k, (image, label) in enumerate(samples, start=first):
            for ext, data in (("png", image), ("cls", str(label).encode()), ("json", b"{}")):
                info = tarfile.TarInfo(f"{k:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return samples


SHARD_SIZES = (8, 10, 5)  # 2 ranks: rank 0 reads shards 0 and 2 (13 samples), rank 1 shard 1 (10)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wds")
    first = 0
    for i, n in enumerate(SHARD_SIZES):
        write_shard(root / f"shard-{i:06d}.tar", first, n)
        first += n
    write_shard(root / "val" / "shard-000000.tar", 1000, 6)
    return root


def cfg(root: Path, **data) -> JobConfig:
    return JobConfig.from_dict({"data": {"format": "webdataset", "uri": str(root), "image_size": SIZE, **data},
                                "train": {"batch_size": 4, "seed": 3}})


def unit(dp_rank: int, dp_size: int = 2) -> SimpleNamespace:
    return SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, drop_last_batch=False)


def test_the_shards_are_listed_indexed_and_validated_from_val(root):
    _, train, val = list_shards(str(root))
    assert [Path(s.path).name for s in train] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert [Path(s.path).parent.name for s in val] == ["val"]
    ix = index_shard(train[1])
    assert len(ix) == 10 and ix.labels.tolist() == [k % CLASSES for k in range(8, 18)]
    with open(train[1].path, "rb") as f:  # the index points at each png's bytes
        f.seek(int(ix.offsets[0]))
        assert f.read(int(ix.lengths[0])) == png(8)
    data = load_dataset(cfg(root).data)
    assert isinstance(data, WebDataset) and data.num_classes == CLASSES and data.input_shape == (3, SIZE, SIZE)
    assert data.y_val.tolist() == [k % CLASSES for k in range(1000, 1006)]
    np.testing.assert_array_equal(data.x_val.take(np.array([2])), decode_image(png(1002), SIZE, "")[None])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_rank_streams_its_own_shards_in_a_shuffled_order_and_resumes_at_any_batch(root, workers):
    c = cfg(root, num_workers=workers)
    data = load_dataset(c.data)
    shard = WebShard.of(data, unit(0), c)  # no process group: only this rank's count
    assert shard.own == [0, 2] and shard.samples == 13 and shard.batches == 4
    orders = {tuple(shard.epoch_order(e).tolist()) for e in range(6)}
    assert orders == {(0, 2), (2, 0)}, "shard order shuffled per epoch"
    order = shard.epoch_order(0)
    firsts = {0: 0, 2: 18}
    expect = [(png(firsts[s] + k), (firsts[s] + k) % CLASSES) for s in order.tolist() for k in range(SHARD_SIZES[s])]
    got = [shard.batch(order, i, CPU) for i in range(shard.batches)]
    assert [g[0] for g in got] == [0, 4, 8, 12] and [len(g[2]) for g in got] == [4, 4, 4, 1]
    x = torch.cat([g[1] for g in got])
    assert x.shape == (13, 3, SIZE, SIZE)
    assert torch.cat([g[2] for g in got]).tolist() == [label for _, label in expect]
    np.testing.assert_array_equal(x.numpy(), np.stack([decode_image(b, SIZE, "") for b, _ in expect]))
    _, x2, y2 = shard.batch(order, 2, CPU)  # out of sequence: restarts at batch 2
    assert torch.equal(x2, got[2][1]) and torch.equal(y2, got[2][2])
    assert WebShard.of(data, unit(1), c).own == [1]


def test_fewer_shards_than_ranks_and_a_broken_shard_are_clear_errors(root, tmp_path):
    data = load_dataset(cfg(root).data)
    with pytest.raises(ConfigError, match=r"has 3 training shard\(s\) for 4 data-parallel ranks: each rank reads its "
                                          r"own shards, so it needs at least 4"):
        WebShard.of(data, unit(0, 4), cfg(root))
    bad = tmp_path / "bad"
    write_shard(bad / "a.tar", 0, 2)
    with tarfile.open(bad / "b.tar", "w") as tar:
        info = tarfile.TarInfo("000009.png")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    (bad / "c.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(ConfigError, match=r"b.tar: sample '000009' has no a .cls label"):
        index_shard(list_shards(str(bad))[1][1])
    with pytest.raises(ConfigError, match=r"c.tar is not a readable tar file"):
        index_shard(list_shards(str(bad))[1][2])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no .tar shards at its top level: put the shards there"):
        list_shards(str(tmp_path / "empty"))


def test_two_ranks_three_uneven_shards_end_reading_only_their_own(root, tmp_path):
    job = write_job(tmp_path, data={"format": "webdataset", "uri": str(root), "image_size": SIZE, "num_workers": 1},
                    model={"arch": "mlp", "params": {}}, parallel={"procs_per_node": 2},
                    train={"epochs": 2, "batch_size": 4, "lr": 0.05, "seed": 3, "log_every_steps": 1000,
                           "stop_check_s": 0})
    run = torchrun(job, timeout=180)  # a hang would end here, failing the test
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert ("webdataset: 3 training shard(s) over 2 data-parallel rank(s), samples per rank 13, 10; every rank "
            "runs 3 batch(es) of 4 per epoch") in out
    for epoch in (0, 1):
        assert (f"rank 0 (data-parallel 0 of 2) epoch {epoch}: read shards [0, 2] from batch 0 (12 of its 13 "
                "samples per epoch in 3 batches)") in out
        assert (f"rank 1 (data-parallel 1 of 2) epoch {epoch}: read shards [1] from batch 0 (10 of its 10 samples "
                "per epoch in 3 batches)") in out
    recs = records(tmp_path / "out")
    assert [r["epoch"] for r in recs if r["event"] == "epoch"] == [0, 1]
    assert recs[-1]["event"] == "completed" and recs[-1]["step"] == 6


def test_a_broken_shard_on_one_rank_fails_every_rank_without_a_hang(root, tmp_path):
    broken = tmp_path / "wds"
    broken.mkdir()
    for name in ("shard-000000.tar", "shard-000002.tar", "val"):
        (broken / name).symlink_to(root / name)
    (broken / "shard-000001.tar").write_bytes(b"not a tar" * 200)  # rank 1's only shard
    job = write_job(tmp_path, data={"format": "webdataset", "uri": str(broken), "image_size": SIZE},
                    model={"arch": "mlp", "params": {}}, parallel={"procs_per_node": 2},
                    train={"epochs": 1, "batch_size": 4, "stop_check_s": 0})
    run = torchrun(job, timeout=120)  # a rank left waiting in the count gather would end here
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert f"shard {broken}/shard-000001.tar is not a readable tar file" in out  # rank 1, its own error
    assert "rank(s) [1] could not index their webdataset shards" in out  # rank 0, told which rank failed
