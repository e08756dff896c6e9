"""TokenShard: a rank's random training windows of a token dataset, and the fixed validation windows."""

import math
import os
import tracemalloc

import numpy as np
import pytest
import torch

from trainer_pkg.config import ConfigError
from trainer_pkg.token_shard import TokenShard, validation_windows
from trainer_pkg.tokens import open_tokens, write_meta, write_tokens

CPU = torch.device("cpu")
# Token k of shard s is s·STRIDE + k: a window's tokens tell which shard and start it came from.
STRIDE = 1_000_000


def _positional(root, train_lengths, val_lengths=(500,)):
    shards = lambda lengths, base: [base + s * STRIDE + np.arange(n) for s, n in enumerate(lengths)]  # noqa: E731
    write_tokens(str(root), vocab_size=1 << 26, train=shards(train_lengths, 0), val=shards(val_lengths, 50 * STRIDE))
    return open_tokens(str(root))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _positional(tmp_path_factory.mktemp("tokens"), (3000, 1200, 5, 800))


def _shard(data, **kw):
    args = dict(seq_len=16, batch_size=8, dp_rank=0, dp_size=2, seed=3, drop_last=False) | kw
    return TokenShard.of(data, **args)


def _windows(shard, epoch, index):
    _, x, y = shard.batch(shard.epoch_order(epoch), index, CPU)
    return x, y


def test_epoch_arithmetic_and_batch_shapes(data):
    shard = _shard(data)
    assert data.train.num_tokens == 5005 and shard.windows == 5005 // 16 == 312
    assert shard.n == math.ceil(312 / 2) == 156 and shard.batches == math.ceil(156 / 8) == 20
    start, x, y = shard.batch(shard.epoch_order(0), 19, CPU)
    assert start == 19 * 8 and x.shape == y.shape == (156 - 19 * 8, 16) == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert _windows(shard, 0, 0)[0].shape == (8, 16)
    assert shard.padding(start, 4) == (None, 4)
    dropped = _shard(data, drop_last=True)
    assert dropped.batches == 156 // 8 == 19 and dropped.n == 19 * 8
    assert _windows(dropped, 0, 18)[0].shape == (8, 16)


def test_windows_are_next_token_pairs_inside_one_shard(data):
    shard = _shard(data, seq_len=64, batch_size=32)
    lengths = [len(s) for s in data.train.shards]
    seen_shards = []
    for index in range(shard.batches):
        x, y = _windows(shard, 1, index)
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
        window = torch.cat([x, y[:, -1:]], 1)  # the seq_len + 1 tokens read
        assert torch.equal(window[:, 1:] - window[:, :-1], torch.ones_like(x))  # consecutive: no shard end crossed
        which, start = window[:, 0] // STRIDE, window[:, 0] % STRIDE
        assert all(start[i] + 65 <= lengths[s] for i, s in enumerate(which.tolist()))
        seen_shards += which.tolist()
    assert 2 not in seen_shards  # 5 tokens: too short for one window of 65
    # a shard is picked in proportion to its window starts (2936, 1136, 0, 736 of 4808)
    share = np.bincount(seen_shards, minlength=4) / len(seen_shards)
    assert np.allclose(share, [2936 / 4808, 1136 / 4808, 0, 736 / 4808], atol=0.06)


def test_every_start_that_fits_is_drawn_and_no_other(tmp_path):
    data = _positional(tmp_path / "d", (10, 17, 3))  # seq_len 3 (windows of 4): 7, 14 and 0 starts
    shard = _shard(data, seq_len=3, batch_size=64, dp_size=1)
    starts = set()
    for epoch in range(60):  # 10 windows an epoch
        for index in range(shard.batches):
            x, _ = _windows(shard, epoch, index)
            starts |= set(x[:, 0].tolist())
    assert starts == set(range(0, 7)) | set(STRIDE + k for k in range(0, 14))


def test_draws_are_deterministic_per_rank_epoch_and_resume_exactly(data):
    a, b = _shard(data), _shard(data)
    assert torch.equal(_windows(a, 0, 3)[0], _windows(b, 0, 3)[0])
    other_rank = _shard(data, dp_rank=1)
    other_seed = _shard(data, seed=4)
    assert not torch.equal(_windows(a, 0, 3)[0], _windows(other_rank, 0, 3)[0])
    assert not torch.equal(_windows(a, 0, 3)[0], _windows(a, 1, 3)[0])
    assert not torch.equal(_windows(a, 0, 3)[0], _windows(other_seed, 0, 3)[0])
    assert not torch.equal(_windows(a, 0, 3)[0], _windows(a, 0, 4)[0])
    # The digest the epoch records carry tells the epochs and ranks apart, and equal runs equal.
    assert torch.equal(a.epoch_order(2), b.epoch_order(2))
    assert not torch.equal(a.epoch_order(2), other_rank.epoch_order(2))
    # Resume at (epoch 1, batch 5): a fresh shard, nothing drawn before, gives the uninterrupted run's batches.
    uninterrupted = [_windows(a, 1, i)[0] for i in range(a.batches)]
    resumed = _shard(data)
    assert all(torch.equal(uninterrupted[i], _windows(resumed, 1, i)[0]) for i in range(5, a.batches))


def _sparse_dataset(root, shards, tokens_per_shard):
    """A uint16 dataset of ``shards`` sparse files (no disk, no page cache: holes read as zeros)."""
    os.makedirs(root / "train")
    files = []
    for i in range(shards):
        with open(root / "train" / f"{i}.bin", "wb") as f:
            f.truncate(2 * tokens_per_shard)
        files.append(f"train/{i}.bin")
    write_meta(str(root), dtype="uint16", vocab_size=256, splits={"train": files, "val": files[:1]})
    return open_tokens(str(root))


def _peak_bytes(data):
    tracemalloc.start()
    try:
        shard = _shard(data, seq_len=128, batch_size=16)
        for index in (0, 1, shard.batches // 2, shard.batches - 1):
            _windows(shard, 0, index)
        validation_windows(data, seq_len=128, count=16, seed=0)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_dataset(tmp_path):
    small = _peak_bytes(_sparse_dataset(tmp_path / "small", 2, 1 << 16))  # 256 KiB
    large = _peak_bytes(_sparse_dataset(tmp_path / "large", 2, 1 << 32))  # 16 GiB, 2 shards
    many = _peak_bytes(_sparse_dataset(tmp_path / "many", 400, 1 << 20))  # 800 MiB in 400 shards
    # One batch is 16 × 129 int64 (16 KiB) twice over; a permutation of the large one's 67M windows
    # would be 512 MiB.
    assert small < 200_000 and large < small + 20_000 and many < small + 40_000, (small, large, many)


def test_validation_windows_are_fixed_and_a_small_split_is_read_whole(data, tmp_path):
    x, y = validation_windows(data, seq_len=16, count=256, seed=0)
    assert x.shape == y.shape == ((500 - 1) // 16, 16) == (31, 16)  # 31 ≤ 256: the whole split, tiled
    assert torch.equal(x[:, 0], 50 * STRIDE + 16 * torch.arange(31)) and torch.equal(y, x + 1)
    big = _positional(tmp_path / "big", (100,), val_lengths=(4000, 3000))
    x1, y1 = validation_windows(big, seq_len=32, count=50, seed=7)
    x2, _ = validation_windows(big, seq_len=32, count=50, seed=7)
    assert x1.shape == (50, 32) and torch.equal(x1, x2) and torch.equal(y1, x1 + 1)
    assert torch.equal(x1[:, -1] - x1[:, 0], torch.full((50,), 31))  # consecutive: no shard end crossed
    assert not torch.equal(x1, validation_windows(big, seq_len=32, count=50, seed=8)[0])


def test_errors_name_the_setting_to_change(data):
    with pytest.raises(ConfigError, match=r"no train shard holds the 4,001 tokens one window of data.seq_len "
                                          r"4,000 needs \(the longest holds 3,000\); lower data.seq_len"):
        _shard(data, seq_len=4000)
    with pytest.raises(ConfigError, match=r"train.batch_size 200 is larger than the 156 windows of 16 tokens "
                                          r"each of the 2 data-parallel rank\(s\) reads per epoch"):
        _shard(data, batch_size=200, drop_last=True)
    assert _shard(data, batch_size=200).batches == 1  # without drop_last: one smaller batch
    with pytest.raises(ConfigError, match="no validation shard holds the 501 tokens"):
        validation_windows(data, seq_len=500, count=4, seed=0)


def _rss_file_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])


def test_windows_are_read_not_mapped_so_the_resident_set_stays_flat(tmp_path):
    """Pages touched through a memory map stay in the process's resident set: 2,000 random windows
    over a 128 MiB shard would map most of it (the kernel maps whole large folios around a fault).
    Windows are read with pread instead, and the file's pages never enter this process's RSS."""
    root = tmp_path / "d"
    rng = np.random.default_rng(0)
    write_tokens(str(root), vocab_size=256, train=[rng.integers(0, 256, 64 << 20, dtype=np.uint16)],
                 val=[np.arange(100)])
    data = open_tokens(str(root))
    shard = _shard(data, seq_len=64, batch_size=20, dp_size=1)
    before = _rss_file_kb()
    order = shard.epoch_order(0)
    windows = [shard.batch(order, i, CPU)[1] for i in range(100)]
    assert len(windows) == 100 and _rss_file_kb() - before < 8 * 1024  # < 8 MiB of 128 MiB
    # .npy shards (a header before the tokens) and a held-out tail read the right tokens too
    np.save(root / "train" / "000001.npy", np.arange(5000, dtype=np.uint16))
    write_meta(str(root), dtype="uint16", vocab_size=5000, splits={"train": ["train/000001.npy"]})
    npy = open_tokens(str(root), val_fraction=0.1)
    assert npy.train.window(0, 10, 5).tolist() == [10, 11, 12, 13, 14]
    assert npy.val.window(0, 0, 3).tolist() == [4500, 4501, 4502] and npy.val.num_tokens == 500
