"""Streamed data (trainer_pkg.streaming, the Samples of trainer_pkg.datasets): an ImageFolder decoded per
batch, NPZ members and a CSV's cache memory-mapped; the same batches, the same run, as in memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from test_exactness import _launch, weights
from trainer_helpers import REPO, python, records, trainer_env, write_job
from trainer_pkg import datasets
from trainer_pkg.config import ConfigError, DataConfig, JobConfig
from trainer_pkg.datasets import ArrayRows, ImageFiles, describe, load_dataset
from trainer_pkg.models import build_model
from trainer_pkg.streaming import StreamShard
from trainer_pkg.train import TrainShard, load_checkpoint, make_shard, validation_set

CLASSES = ("ant", "bee", "cow")


def image_tree(root: Path, per_class: int, size: int = 10, seed: int = 0) -> Path:
    """``root/<class>/<i>.png``: random RGB and greyscale images, each class a different tint."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8) // 2 + np.uint8(40 * c)
            img = Image.fromarray(pixels)
            (img.convert("L") if i % 3 == 0 else img).save(root / name / f"{i:04d}.png")
    return root


def decode(path: Path, size: int) -> np.ndarray:
    """What decoding the whole tree at start-up gave for one image: RGB, bilinear resize, [0, 1]."""
    with Image.open(path) as img:
        return (np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.float32) / 255.0
                ).transpose(2, 0, 1)


def unit(rank: int, size: int = 2) -> SimpleNamespace:
    """The parts of a Strategy a shard reads: this rank's data-parallel place."""
    return SimpleNamespace(dp_rank=rank, dp_size=size, drop_last_batch=False)


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    image_tree(root / "train", per_class=7)
    image_tree(root / "val", per_class=2, seed=1)
    return root


# -- images, in process -------------------------------------------------------------------------


def test_imagefolder_keeps_files_and_decodes_only_what_is_taken(small_tree):
    ds = load_dataset(DataConfig(format="imagefolder", uri=str(small_tree), image_size=6), seed=0)
    assert isinstance(ds.x_train, ImageFiles) and ds.streamed and describe(ds)["read"] == "per batch"
    assert ds.x_train.shape == (21, 3, 6, 6) and ds.x_val.shape == (6, 3, 6, 6) and ds.input_shape == (3, 6, 6)
    assert ds.y_train.tolist() == [0] * 7 + [1] * 7 + [2] * 7
    files = sorted((small_tree / "train").glob("*/*.png"))
    got = ds.x_train.take(np.array([20, 3]))
    assert got.dtype == np.float32 and got.shape == (2, 3, 6, 6)
    assert np.array_equal(got, np.stack([decode(files[20], 6), decode(files[3], 6)]))

    # Without train/ and val/, the held-out split is a permutation of the file list, nothing decoded.
    flat = load_dataset(DataConfig(format="imagefolder", uri=str(small_tree / "train"), image_size=6,
                                   val_fraction=0.25), seed=4)
    order = np.random.default_rng(4).permutation(21)
    assert [os.fsdecode(p) for p in flat.x_val.paths] == [str(files[i]) for i in order[:5]]
    assert [os.fsdecode(p) for p in flat.x_train.paths] == [str(files[i]) for i in order[5:]]
    assert flat.y_train.tolist() == [i // 7 for i in order[5:]]


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_shard_gives_the_in_memory_shard_batches_and_restarts_at_any_batch(small_tree, workers):
    cfg = JobConfig.from_dict({"data": {"format": "imagefolder", "uri": str(small_tree), "image_size": 6,
                                        "num_workers": workers, "prefetch_factor": 1},
                               "train": {"batch_size": 4, "seed": 9}})
    lazy = load_dataset(cfg.data, seed=9)
    eager = load_dataset(cfg.data, seed=9)
    eager.x_train, eager.x_val = eager.x_train[:], eager.x_val[:]  # decoded whole, as before streaming
    assert not eager.streamed
    rng_before = torch.get_rng_state()
    for rank in (0, 1):  # 21 samples on 2 ranks: rank 1's last sample is the sampler's padding
        stream, memory = make_shard(lazy, unit(rank), cfg), make_shard(eager, unit(rank), cfg)
        assert isinstance(stream, StreamShard) and isinstance(memory, TrainShard)
        assert (stream.n, stream.batches) == (memory.n, memory.batches) == (21, 3)
        for epoch in (0, 1):
            order = stream.epoch_order(epoch)
            assert torch.equal(order, memory.epoch_order(epoch))
            for b in range(stream.batches):
                start, x, y = stream.batch(order, b, torch.device("cpu"))
                m_start, mx, my = memory.batch(order, b, torch.device("cpu"))
                assert start == m_start and torch.equal(x, mx) and torch.equal(y, my)
                mask, real = stream.padding(start, len(y))
                m_mask, m_real = memory.padding(start, len(y))
                assert real == m_real and (mask is None) == (m_mask is None)
                assert mask is None or torch.equal(mask, m_mask)
            assert real == (3 if rank == 0 else 2)  # the last batch: 3 positions, rank 1's last is padding
        # A resumed run: a fresh shard asked for batch 2 of epoch 1 first reads exactly that batch.
        resumed = make_shard(lazy, unit(rank), cfg)
        order = resumed.epoch_order(1)
        assert torch.equal(resumed.batch(order, 2, torch.device("cpu"))[1], memory.batch(order, 2, torch.device("cpu"))[1])
        # ... and one asked out of sequence (back to batch 0) restarts there.
        assert torch.equal(resumed.batch(order, 0, torch.device("cpu"))[1], memory.batch(order, 0, torch.device("cpu"))[1])
    assert torch.equal(torch.get_rng_state(), rng_before)  # the DataLoader drew nothing from the rank's RNG

    x_val, y_val = validation_set(lazy, cfg)
    idx = torch.tensor([5, 0, 3])
    assert torch.equal(x_val[idx], torch.from_numpy(eager.x_val)[idx]) and torch.equal(y_val[idx], torch.tensor([2, 0, 1]))


def test_a_broken_image_found_by_a_worker_is_one_clear_error(small_tree, tmp_path):
    tree = image_tree(tmp_path / "t", per_class=3)
    (tree / "cow" / "0002.png").write_bytes(b"not a png")
    cfg = JobConfig.from_dict({"data": {"format": "imagefolder", "uri": str(tree), "image_size": 4, "num_workers": 1},
                               "train": {"batch_size": 9}})
    shard = make_shard(load_dataset(cfg.data), unit(0, 1), cfg)  # the first image of each class is fine
    order = shard.epoch_order(0)
    with pytest.raises(ConfigError) as err:
        for b in range(shard.batches):
            shard.batch(order, b, torch.device("cpu"))
    assert str(err.value).startswith(f"image {tree / 'cow' / '0002.png'} cannot be read: ")
    assert "Traceback" not in str(err.value)


_RSS_SCRIPT = """
import json, sys, torch
from types import SimpleNamespace
from trainer_pkg.config import JobConfig
from trainer_pkg.datasets import load_dataset
from trainer_pkg.train import make_shard, validation_set

def peak_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

root, size, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = JobConfig.from_dict({"data": {"format": "imagefolder", "uri": root, "image_size": size, "val_fraction": 0.05},
                           "train": {"batch_size": 50}})
base = peak_bytes()
ds = load_dataset(cfg.data, seed=0)
if mode == "eager":
    held = ds.x_train[:]  # the whole tree decoded, as the trainer did before streaming
else:
    shard = make_shard(ds, SimpleNamespace(dp_rank=0, dp_size=1, drop_last_batch=False), cfg)
    order = shard.epoch_order(0)
    for b in range(shard.batches):
        shard.batch(order, b, torch.device("cpu"))
    x_val, y_val = validation_set(ds, cfg)
    x_val[torch.arange(len(y_val))]
print(json.dumps({"samples": len(ds.y_train), "growth": peak_bytes() - base}))
"""


def test_peak_rss_does_not_hold_the_decoded_tree(tmp_path):
    size = 96  # 2,000 images of 16×16 decoded to 3×96×96 float32: 221 MB for the whole tree
    root = tmp_path / "many"
    rng = np.random.default_rng(0)
    for c, name in enumerate(CLASSES[:2]):
        (root / name).mkdir(parents=True)
        for i in range(1000):
            Image.fromarray(rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)).save(root / name / f"{i}.png")

    def growth(mode: str) -> dict:
        run = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(root), str(size), mode], cwd=REPO,
                             env=trainer_env(), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    lazy, eager = growth("lazy"), growth("eager")
    decoded = lazy["samples"] * 3 * size * size * 4  # 1,900 training images: 210 MB
    assert lazy["samples"] == 1900
    assert eager["growth"] > 0.9 * decoded  # the measurement sees a decoded tree ...
    # ... and streaming holds a batch (5.5 MB), the 100 validation images evaluated at once (11 MB) and
    # Pillow (4 MB): about 25 MB.
    assert lazy["growth"] < decoded / 5, f"peak RSS grew {lazy['growth'] / 2**20:.1f} MiB over an epoch"


# -- NPZ and CSV ----------------------------------------------------------------------------------


def test_npz_savez_members_are_memory_mapped_and_converted_per_batch(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, size=(30, 5, 4), dtype=np.uint8)
    xv = np.asfortranarray(rng.normal(size=(6, 5, 4)))  # float64, Fortran order
    y, yv = np.arange(30) % 3, np.array([0, 1, 2, 0, 1, 2])
    np.savez(tmp_path / "s.npz", y_train=y, x_train=x, x_val=xv, y_val=yv)  # x not the first member
    ds = load_dataset(DataConfig(format="npz", uri=str(tmp_path / "s.npz")), seed=0)
    assert isinstance(ds.x_train, ArrayRows) and isinstance(ds.x_train.array, np.memmap)
    assert ds.x_train.array.dtype == np.uint8 and ds.x_train.shape == (30, 1, 5, 4)  # no float32 copy
    assert ds.notes == []
    batch = ds.x_train.take(np.array([7, 29, 0]))
    assert batch.dtype == np.float32 and np.array_equal(batch, x[[7, 29, 0], None].astype(np.float32) / 255.0)
    assert np.array_equal(ds.x_val[:], xv[:, None].astype(np.float32)) and ds.y_val.tolist() == yv.tolist()
    with zipfile.ZipFile(tmp_path / "s.npz") as zf:  # numpy.savez writes a zip64 extra field per member
        assert all(info.compress_type == zipfile.ZIP_STORED for info in zf.infolist())

    # A held-out split is an index into the same map.
    np.savez(tmp_path / "u.npz", x_train=x, y_train=y)
    split = load_dataset(DataConfig(format="npz", uri=str(tmp_path / "u.npz"), val_fraction=0.2), seed=3)
    order = np.random.default_rng(3).permutation(30)
    assert split.x_train.rows.tolist() == order[6:].tolist() and split.x_val.rows.tolist() == order[:6].tolist()
    assert np.array_equal(split.x_train[:4], x[order[6:10], None] / np.float32(255.0))

    # savez_compressed: loaded whole, as before, and the log says why.
    np.savez_compressed(tmp_path / "c.npz", x_train=x, y_train=y)
    packed = load_dataset(DataConfig(format="npz", uri=str(tmp_path / "c.npz"), val_fraction=0.2), seed=3)
    assert isinstance(packed.x_train, np.ndarray) and not packed.streamed and describe(packed)["read"] == "in memory"
    assert np.array_equal(packed.x_train, split.x_train[:])
    assert packed.notes == [f"NPZ {tmp_path / 'c.npz'}: x_train is compressed (numpy.savez_compressed), which "
                            "cannot be memory-mapped: loaded whole (0.0 MiB as float32); save it with numpy.savez "
                            "to stream it"]


def test_csv_is_parsed_once_into_a_memory_mapped_cache(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    rows = 10_000  # two chunks of the parser
    feats = rng.normal(size=(rows, 3)).astype(np.float32)
    labels = rng.integers(0, 4, size=rows)
    path = tmp_path / "t.csv"
    with open(path, "w") as f:
        f.write("f0,label,f1,f2\n")
        for v, lab in zip(feats.tolist(), labels.tolist()):
            f.write(f"{v[0]!r},{lab},{v[1]!r},{v[2]!r}\n")
    data = DataConfig(format="csv", uri=str(path), val_fraction=0.1)
    first = load_dataset(data, seed=0)
    cached = sorted(p.name for p in tmp_path.glob("t.csv.*.npy"))
    assert len(cached) == 2 and cached[0].endswith(".features.npy") and cached[1].endswith(".labels.npy")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*cached, "t.csv"])  # no lock or temporary file left
    assert first.notes == [f"CSV {path}: parsed once (10,000 rows) into the cache {tmp_path / cached[0]}, "
                           "memory-mapped from there"]
    assert isinstance(first.x_train.array, np.memmap) and first.x_train.array.shape == (rows, 3)
    assert np.array_equal(first.x_train.array, feats) and first.input_shape == (3,)
    order = np.random.default_rng(0).permutation(rows)
    assert first.x_train.rows.tolist() == order[1000:].tolist()
    assert first.y_train.tolist() == labels[order[1000:]].tolist()
    assert np.array_equal(first.x_val[:3], feats[order[:3]])

    again = load_dataset(data, seed=0)  # the cache, not the CSV
    assert again.notes == [f"CSV {path}: read through its cache {tmp_path / cached[0]} (memory-mapped)"]
    with open(path, "a") as f:
        f.write("1.0,3,2.0,3.0\n")
    edited = load_dataset(data, seed=0)
    assert edited.x_train.array.shape == (rows + 1, 3) and "parsed once (10,001 rows)" in edited.notes[0]

    # A read-only folder (a cloud mount): the cache goes to the cache folder given (default: $TMPDIR).
    real_access = os.access
    monkeypatch.setattr(datasets.os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    mounted = load_dataset(data, seed=0, cache_dir=str(tmp_path / "run" / "data_cache"))
    assert str(tmp_path / "run" / "data_cache") in mounted.notes[0]
    assert np.array_equal(mounted.x_train.array[:rows], feats)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "machine_tmp"))  # what the trainer gets
    assert str(tmp_path / "machine_tmp" / "trainboard-csv-cache") in load_dataset(data, seed=0).notes[0]


def test_csv_cache_is_not_left_behind_when_a_row_is_bad(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("a,label\n" + "".join(f"{i},1\n" for i in range(10_000)) + "oops,1\n")
    with pytest.raises(ConfigError, match="line 10002, column 'a': 'oops' is not a number"):
        load_dataset(DataConfig(format="csv", uri=str(path)), seed=0)
    assert [p.name for p in tmp_path.iterdir() if ".npy" in p.name] == []


# -- the trainer: lazy == eager under torchrun ------------------------------------------------------


@pytest.mark.slow
def test_streamed_images_train_exactly_as_in_memory_on_2_ranks_with_workers_and_resume(tmp_path):
    # 480 images / (2 ranks × 4) = 60 steps an epoch: a SIGTERM after epoch 0 lands inside epoch 1.
    tree = image_tree(tmp_path / "tree" / "train", per_class=160)
    image_tree(tmp_path / "tree" / "val", per_class=3, seed=1)
    order = sorted((tree).glob("*/*.png"))
    val = sorted((tmp_path / "tree" / "val").glob("*/*.png"))
    np.savez_compressed(tmp_path / "decoded.npz",  # the tree decoded up front: the in-memory path
                        x_train=np.stack([decode(p, 8) for p in order]), y_train=np.repeat(np.arange(3), 160),
                        x_val=np.stack([decode(p, 8) for p in val]), y_val=np.repeat(np.arange(3), 3))
    common = dict(model={"arch": "mlp", "params": {}}, parallel={"procs_per_node": 2},
                  train={"epochs": 3, "batch_size": 4, "lr": 0.05, "seed": 5, "augment": True,
                         "log_every_steps": 1000, "stop_check_s": 0})
    lazy = {"format": "imagefolder", "uri": str(tmp_path / "tree"), "image_size": 8}
    # The subject is the data path, not torchrun: the torch-free torchrun (tests/standins/torchrun_lite.py)
    # starts the real ranks; torch's own with the same SIGTERM is tests/trainer_pkg/test_exactness.py's.
    lite = python()
    _launch(write_job(tmp_path / "eager", data={"format": "npz", "uri": str(tmp_path / "decoded.npz")}, **common),
            interpreter=lite)
    _launch(write_job(tmp_path / "lazy0", data=lazy, **common), interpreter=lite)
    job = write_job(tmp_path / "lazy2", data={**lazy, "num_workers": 2, "prefetch_factor": 2}, **common)
    _launch(job, stop_after_epoch=0, interpreter=lite)
    ckpt = load_checkpoint(str(tmp_path / "lazy2" / "out" / "checkpoints" / "last.pt"))
    assert ckpt["epoch"] == 1 and 0 < ckpt["batches_done"] < 60, "the stop should land inside epoch 1"
    _launch(job, interpreter=lite)

    eager, lazy0, lazy2 = (weights(tmp_path / n / "out") for n in ("eager", "lazy0", "lazy2"))
    assert all(torch.equal(eager[k], lazy0[k]) for k in eager), "streamed (0 workers) differs from in-memory"
    assert all(torch.equal(eager[k], lazy2[k]) for k in eager), "streamed (2 workers, resumed) differs"
    torch.manual_seed(5)
    assert any(not torch.equal(eager[k], v) for k, v in build_model("mlp", {}, (3, 8, 8), 3).state_dict().items())
    final = {n: [r for r in records(tmp_path / n / "out") if r["event"] == "epoch"][-1] for n in ("eager", "lazy2")}
    assert final["eager"]["val_loss"] == final["lazy2"]["val_loss"]
    assert final["eager"]["sample_order_digest"] == final["lazy2"]["sample_order_digest"]
    starts = [r["resumed"] for r in records(tmp_path / "lazy2" / "out") if r["event"] == "started"]
    assert starts == [False, True]


_SIGNAL_SCRIPT = """
import os, signal, sys, torch
from types import SimpleNamespace
from trainer_pkg.config import JobConfig
from trainer_pkg.datasets import load_dataset
from trainer_pkg.train import StopSignal, make_shard

cfg = JobConfig.from_dict({"data": {"format": "imagefolder", "uri": sys.argv[1], "image_size": 6, "num_workers": 2,
                                    "prefetch_factor": 1}, "train": {"batch_size": 2}})
one = SimpleNamespace(dp_rank=0, dp_size=1, drop_last_batch=False)
lazy, eager = load_dataset(cfg.data), load_dataset(cfg.data)
eager.x_train = eager.x_train[:]
shard, memory = make_shard(lazy, one, cfg), make_shard(eager, one, cfg)
stop = StopSignal().install()
order = shard.epoch_order(0)
shard.batch(order, 0, torch.device("cpu"))
os.killpg(0, signal.SIGTERM)  # what torchrun's agent does to a rank's group when it is told to stop
same = all(torch.equal(shard.batch(order, b, torch.device("cpu"))[1], memory.batch(order, b, torch.device("cpu"))[1])
           for b in range(1, shard.batches))  # 10 more batches: far more than the 2 prefetched
print(stop.received == signal.SIGTERM, same, flush=True)
"""


def test_workers_outlive_a_sigterm_sent_to_their_ranks_process_group(small_tree):
    # The rank (a session leader, as torchrun starts it) catches SIGTERM to agree on a stop with the
    # other ranks; its workers must go on serving batches until it has.
    run = subprocess.run([sys.executable, "-c", _SIGNAL_SCRIPT, str(small_tree)], cwd=REPO, env=trainer_env(),
                         capture_output=True, text=True, timeout=120, start_new_session=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "True"]
