"""A rank's training windows of a token dataset: drawn at random, per batch, never a permutation.

A token dataset (:mod:`trainer_pkg.tokens`) may hold billions of tokens in memory-mapped shards. An
epoch is ``windows = train.num_tokens // seq_len`` windows of ``seq_len + 1`` consecutive tokens,
split over the data-parallel ranks: each rank trains ``ceil(windows / dp_size)`` of them (the
global count rounded up so every rank steps the same number of times), in ``batches`` batches of
``batch_size`` (the last one smaller, or dropped with ``drop_last``).

The windows of batch ``b`` of epoch ``e`` on data-parallel rank ``r`` come from a
``numpy.random.Generator`` seeded with ``(seed, e, r, b)``, as nanoGPT's ``get_batch`` draws random
offsets into its memory-mapped file:

* deterministic: the same seed gives the same windows, rerun after rerun;
* different per rank and per epoch (the ranks' draws are independent streams, not a partition:
  two ranks may sample overlapping windows, as two epochs may);
* O(1) memory whatever the dataset's size: nothing per window is ever held, only one integer per
  shard (its cumulative count of window starts);
* resumable exactly: batch ``b`` depends on nothing drawn before it, so a run resumed at
  ``(epoch, batch)`` trains exactly the windows an uninterrupted one would.

A window never crosses a shard's end (shards are separate documents or files): a start is drawn
uniformly over every position of every shard where ``seq_len + 1`` tokens fit, so a shard is chosen
in proportion to its usable length. The model sees ``x = window[:-1]`` and predicts
``y = window[1:]``, both int64 (B, seq_len).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from trainer_pkg.config import ConfigError
from trainer_pkg.tokens import TokenDataset, TokenStream

# Mixed into the validation windows' seed so they never coincide with any training batch's draw.
_VALIDATION_STREAM = 0x7661_6C69  # "vali"


def _window_starts(stream: TokenStream, seq_len: int) -> np.ndarray:
    """(shards,) int64: cumulative count of the positions in each shard where a window of
    ``seq_len + 1`` tokens starts and fits (a shard shorter than that contributes none)."""
    return np.cumsum([max(0, len(s) - seq_len) for s in stream.shards], dtype=np.int64)


def _read_windows(stream: TokenStream, cum: np.ndarray, positions: np.ndarray, seq_len: int) -> np.ndarray:
    """(len(positions), seq_len + 1) int64: the window at each global start ``positions`` (values
    in 0 … cum[-1] − 1), located in its shard through the cumulative counts ``cum``."""
    shard_of = np.searchsorted(cum, positions, side="right")
    out = np.empty((len(positions), seq_len + 1), dtype=np.int64)
    for i, (shard, pos) in enumerate(zip(shard_of.tolist(), positions.tolist())):
        start = pos - (int(cum[shard - 1]) if shard else 0)
        out[i] = stream.window(shard, start, seq_len + 1)
    return out


def _usable(stream: TokenStream, seq_len: int, split: str, root: str) -> np.ndarray:
    cum = _window_starts(stream, seq_len)
    if not len(cum) or cum[-1] == 0:
        longest = max((len(s) for s in stream.shards), default=0)
        raise ConfigError(
            f"tokens dataset {root}: no {split} shard holds the {seq_len + 1:,} tokens one window of "
            f"data.seq_len {seq_len:,} needs (the longest holds {longest:,}); lower data.seq_len "
            f"(or the gpt model's context_length) or prepare larger shards")
    return cum


@dataclasses.dataclass(frozen=True)
class TokenShard:
    """This rank's training windows of a token dataset, with :class:`trainer_pkg.train.TrainShard`'s
    interface (``batches``, ``n``, ``batch_size``, ``epoch_order``, ``batch``, ``padding``)."""

    stream: TokenStream
    """The training split."""
    seq_len: int
    """Tokens the model sees per window (T); each window reads T + 1 tokens."""
    batch_size: int
    """Windows per batch (B)."""
    batches: int
    """Batches per epoch on this rank (the same on every rank)."""
    per_rank: int
    """Windows this rank trains per epoch: ``ceil(windows / dp_size)``, or ``batches × batch_size``
    with ``drop_last``."""
    windows: int
    """Windows in one epoch over all ranks: ``train.num_tokens // seq_len``."""
    dp_rank: int
    dp_size: int
    seed: int
    cum_starts: np.ndarray
    """(shards,) int64 cumulative window starts per shard (:func:`_window_starts`)."""

    @classmethod
    def of(cls, data: TokenDataset, *, seq_len: int, batch_size: int, dp_rank: int, dp_size: int,
           seed: int, drop_last: bool) -> "TokenShard":
        """The training windows data-parallel rank ``dp_rank`` of ``dp_size`` draws from ``data``.

        Raises :class:`ConfigError` when ``seq_len`` or ``batch_size`` is below 1, when no training
        shard holds ``seq_len + 1`` tokens, or when an epoch has fewer windows per rank than one
        batch and ``drop_last`` (a pipeline) would leave no batch.
        """
        if seq_len < 1:
            raise ConfigError(f"data.seq_len must be at least 1 token, got {seq_len}")
        if batch_size < 1:
            raise ConfigError(f"train.batch_size must be at least 1, got {batch_size}")
        cum = _usable(data.train, seq_len, "train", data.root)
        windows = data.train.num_tokens // seq_len
        per_rank = math.ceil(windows / dp_size)
        batches = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
        if batches == 0:
            raise ConfigError(
                f"train.batch_size {batch_size} is larger than the {per_rank:,} windows of {seq_len:,} "
                f"tokens each of the {dp_size} data-parallel rank(s) reads per epoch "
                f"({data.train.num_tokens:,} training tokens); use a smaller batch size or data.seq_len")
        if drop_last:
            per_rank = batches * batch_size
        return cls(data.train, seq_len, batch_size, batches, per_rank, windows, dp_rank, dp_size, seed, cum)

    @property
    def n(self) -> int:
        """Windows this rank trains per epoch."""
        return self.per_rank

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """``[seed, epoch, dp_rank]`` int64 (3,): everything an epoch's draws depend on, so
        :func:`trainer_pkg.train.sample_order_digest` of it tells equal window orders apart from
        different ones; :meth:`batch` reads it back."""
        return torch.tensor([self.seed, epoch, self.dp_rank], dtype=torch.int64)

    def batch_size_of(self, index: int) -> int:
        """Windows in batch ``index`` (0 … batches − 1): ``batch_size`` but for a smaller last batch."""
        return min(self.batch_size, self.per_rank - index * self.batch_size)

    def positions(self, order: torch.Tensor, index: int) -> np.ndarray:
        """(B,) int64 global window starts (0 … cum_starts[-1] − 1) of batch ``index`` of the epoch
        whose :meth:`epoch_order` is ``order``: drawn from a Generator seeded with
        ``(seed, epoch, dp_rank, index)``."""
        seed, epoch, rank = (int(v) for v in order.tolist())
        rng = np.random.default_rng([seed, epoch, rank, index])
        return rng.integers(0, int(self.cum_starts[-1]), size=self.batch_size_of(index), dtype=np.int64)

    def batch(self, order: torch.Tensor, index: int, device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(position of its first window in this rank's epoch, x, y) of batch ``index``: x and y are
        int64 (B, seq_len) on ``device``, y = x shifted left by one token (the next token at each
        position). Reads only the ``B × (seq_len + 1)`` tokens of its windows from the shards."""
        tokens = torch.from_numpy(_read_windows(self.stream, self.cum_starts, self.positions(order, index),
                                                self.seq_len))
        x, y = tokens[:, :-1], tokens[:, 1:]
        return (index * self.batch_size, x.to(device, non_blocking=True).contiguous(),
                y.to(device, non_blocking=True).contiguous())

    def padding(self, start: int, count: int) -> tuple[None, int]:
        """(None, count): every drawn window is real (no sampler padding to leave out of metrics)."""
        return None, count


def validation_windows(data: TokenDataset, *, seq_len: int, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each int64 (N, seq_len): the validation windows evaluated at every epoch's end, the
    same every epoch and on every rank (y = x shifted left by one token).

    When the validation split holds at most ``count`` non-overlapping windows, it is evaluated whole:
    N is that number, windows tiled from each shard's start. Otherwise N = ``count`` windows whose
    starts are drawn (as training windows are, never crossing a shard's end) from a Generator seeded
    by ``seed`` alone. Raises :class:`ConfigError` as :meth:`TokenShard.of` when no validation shard
    holds ``seq_len + 1`` tokens.
    """
    if seq_len < 1 or count < 1:
        raise ConfigError(f"validation windows need data.seq_len ≥ 1 and data.val_windows ≥ 1, got "
                          f"{seq_len} and {count}")
    stream = data.val
    cum = _usable(stream, seq_len, "validation", data.root)
    if sum((len(shard) - 1) // seq_len for shard in stream.shards) <= count:
        tokens = np.stack([stream.window(s, k * seq_len, seq_len + 1) for s, shard in enumerate(stream.shards)
                           for k in range((len(shard) - 1) // seq_len)])
    else:
        positions = np.random.default_rng([seed, _VALIDATION_STREAM]).integers(0, int(cum[-1]), size=count)
        tokens = _read_windows(stream, cum, np.sort(positions), seq_len)
    t = torch.from_numpy(tokens)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()
