"""One data-parallel unit's order over a training split of ``n`` samples, epoch by epoch.

:class:`trainer_pkg.train.TrainShard` (samples in memory) and
:class:`trainer_pkg.streaming.StreamShard` (samples read batch by batch) differ in how they fetch a
batch, not in which samples a rank trains on: both hold a :class:`ShardOrder`. It wraps
``DistributedSampler`` (``shuffle=True``, ``drop_last=False``, seeded by ``train.seed`` and reshuffled
per epoch with ``set_epoch``), so a run's order is the same whichever shard reads it, and resuming
from a checkpoint's epoch gives the same order again.

DistributedSampler pads the epoch's index list to a multiple of ``dp_size`` by repeating its head and
gives rank r the items r, r + W, r + 2W, …; item k of rank r is therefore padding exactly when
r + k·W ≥ n. Padded samples train (every rank takes the same number of steps) but are left out of
every reported metric (:meth:`ShardOrder.padding`).

Imports torch only (no other trainer module), so both shard modules can use it.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data.distributed import DistributedSampler


def real_mask(positions: torch.Tensor, rank: int, world_size: int, n: int) -> torch.Tensor:
    """Which of rank ``rank``'s sampler positions (int64 tensor) are real samples rather than padding,
    a bool tensor of the same shape: ``rank + position·world_size < n``."""
    return rank + positions * world_size < n


class ShardOrder:
    """Rank ``dp_rank`` of ``dp_size``'s sample indices over ``n`` samples, cut into batches of
    ``batch_size``: ``batches`` per epoch, ``ceil(n / dp_size) // batch_size`` when
    ``drop_last_batch`` (a pipeline skips an incomplete last batch), else the ceiling. ``batches``
    is 0 when a shard holds fewer samples than one batch of a pipeline: the caller refuses that with
    :meth:`too_small`'s message."""

    def __init__(self, n: int, *, dp_rank: int, dp_size: int, batch_size: int, seed: int,
                 drop_last_batch: bool) -> None:
        self.n, self.dp_rank, self.dp_size, self.batch_size = n, dp_rank, dp_size, batch_size
        self.shard = math.ceil(n / dp_size)
        """Samples this rank takes per epoch, padding included."""
        self.batches = self.shard // batch_size if drop_last_batch else math.ceil(self.shard / batch_size)
        self.sampler = DistributedSampler(range(n), num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=seed,
                                          drop_last=False)

    def too_small(self) -> str:
        """Why a shard with no batch cannot train (the message a :class:`ConfigError` carries)."""
        return (f"train.batch_size {self.batch_size} is larger than the {self.shard} samples each "
                f"pipeline reads per epoch; use a smaller batch size")

    def small_batch_note(self) -> str | None:
        """What a rank trains when ``batch_size`` is larger than its shard (the dashboard refuses that
        where it knows the data's size; it does not for a cloud URI), or None when a batch fits: the
        job's log then says the batch it really used, not the one it was given."""
        if self.batch_size <= self.shard or self.batches == 0:
            return None
        ranks = f"{self.n:,} training samples over {self.dp_size} data-parallel rank{'s' if self.dp_size != 1 else ''}"
        return (f"train.batch_size {self.batch_size:,} is larger than the {self.shard:,} samples each rank reads per "
                f"epoch ({ranks}): each epoch is one batch of {self.shard:,} samples per rank; a batch size of at "
                f"most {self.shard:,} trains on full batches")

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for ``epoch`` in training order, (ceil(n / dp_size),) int64:
        the sampler reshuffled for the epoch (``set_epoch``), the same on every rank of a unit."""
        self.sampler.set_epoch(epoch)
        return torch.tensor(list(iter(self.sampler)), dtype=torch.long)

    def indices(self, order: torch.Tensor, index: int) -> torch.Tensor:
        """The sample indices of batch ``index`` in the epoch whose :meth:`epoch_order` is ``order``,
        (≤ batch_size,) int64."""
        start = index * self.batch_size
        return order[start:start + self.batch_size]

    def padding(self, start: int, count: int) -> tuple[torch.Tensor | None, int]:
        """(mask of the real samples, how many) among the ``count`` at positions ``start…`` of this
        rank's order; the mask is None when all are real, as in every batch but an epoch's last."""
        if start + count <= math.ceil((self.n - self.dp_rank) / self.dp_size):
            return None, count
        keep = real_mask(torch.arange(start, start + count), self.dp_rank, self.dp_size, self.n)
        return keep, int(keep.sum())
