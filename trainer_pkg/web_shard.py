"""A rank's training batches of a ``webdataset``: its own tar shards, streamed, the step count agreed.

Which shards: shard i (of the training shards in name order) belongs to data-parallel rank
``i mod dp_size``; a rank never opens another's. Each epoch a rank reads its shards in an order
shuffled by ``(train.seed, epoch, dp_rank)``, each shard's samples in tar order (write shards
already shuffled, as WebDataset's writers do), and cuts that stream into ``train.batch_size`` batches.

The step count: shards rarely hold equal numbers of samples, and a rank that ran out of batches
while another still stepped would leave that one waiting forever in its gradient all-reduce. So at
start every rank indexes its own shards (tar headers and ``.cls`` labels, :func:`index_shard`) and
the ranks all-gather their sample counts; every rank then runs exactly ``batches`` = the fewest
batches any rank's samples fill (``ceil(samples / batch_size)``, or whole batches only under a
pipeline's ``drop_last``) per epoch. A rank with more samples leaves its surplus out of that epoch
(which samples changes with the shuffled shard order). The gather happens inside an agreed setup
step, after each rank's own index: a rank whose shard is broken sends -1, and every rank raises.

Decoding (the expensive part) runs in DataLoader workers (``data.num_workers``), as
:mod:`trainer_pkg.streaming` does: the training process reads each batch's image bytes in order (a
shard is read in 8 MiB blocks: one ranged GET per block on object storage) and the workers decode
them, so the batches are the same whatever the worker count. Batch ``b`` of an epoch is found from
the index alone, so a run resumed at batch ``b`` reads exactly what the uninterrupted one would.

Each rank logs the shards it read in each epoch ("rank 1 epoch 0: read shards [1] ...").
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.datasets import WebDataset, decode_image
from trainer_pkg.metrics import print_line
from trainer_pkg.streaming import EpochBatches, start_workers, worker_own_session
from trainer_pkg.tar_shards import ShardIndex, index_shard, open_shard

_READ_BLOCK = 8 << 20
"""Bytes read from a shard at once while streaming it (one ranged GET on object storage)."""


class DecodeBatch(torch.utils.data.Dataset):
    """Map-style dataset whose "index" is one batch's raw samples (image bytes, labels, names): it
    decodes them; used with ``batch_size=None`` so DataLoader workers decode whole batches."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:  # never asked for by a DataLoader whose sampler is given
        return 0

    def __getitem__(self, raw: tuple[list[bytes], np.ndarray, list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels, names = raw
        x = np.stack([decode_image(b, self.size, n) for b, n in zip(images, names)])
        return torch.from_numpy(x), torch.from_numpy(labels)


class _Plan:
    """An iterable of raw batches (a DataLoader's sampler): built fresh for each iterator."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def __iter__(self) -> Iterator[Any]:
        return self.make()


class WebShard:
    """This rank's shards of a :class:`~trainer_pkg.datasets.WebDataset`, with
    :class:`trainer_pkg.train.TrainShard`'s interface (see the module docstring)."""

    def __init__(self, data: WebDataset, own: list[int], indexes: dict[int, ShardIndex], *, batch_size: int,
                 batches: int, dp_rank: int, dp_size: int, seed: int, rank: int, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int = 2) -> None:
        self.data, self.own, self.indexes = data, own, indexes
        """The dataset; this rank's shard numbers; their indexes."""
        self.batch_size, self.batches = batch_size, batches
        """Samples per batch; batches per epoch, the same on every rank."""
        self.dp_rank, self.dp_size, self.seed, self.rank = dp_rank, dp_size, seed, rank
        self.samples = sum(len(ix) for ix in indexes.values())
        """Samples this rank's shards hold."""
        self.n = min(self.samples, batches * batch_size)
        """Samples this rank trains per epoch: the first ``n`` of its stream."""
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self._epoch = 0
        self._loader = EpochBatches(self._open_at, batches)

    @classmethod
    def of(cls, data: WebDataset, strategy: Any, cfg: JobConfig) -> "WebShard":
        """Collective (every rank calls it): this rank's shards under ``strategy`` (its ``dp_rank``,
        ``dp_size``, ``drop_last_batch``), indexed, and the step count agreed with the other ranks.

        Raises :class:`ConfigError` when there are fewer shards than data-parallel ranks, when a
        shard cannot be indexed (on the rank that owns it; the others say which rank failed), or
        when some rank's samples fill no batch."""
        t, d = cfg.train, cfg.data
        dp_rank, dp_size = strategy.dp_rank, strategy.dp_size
        if len(data.train) < dp_size:
            raise ConfigError(f"webdataset {data.root} has {len(data.train)} training shard(s) for {dp_size} "
                              f"data-parallel ranks: each rank reads its own shards, so it needs at least {dp_size}; "
                              "write the data into more shards or run fewer ranks")
        own = list(range(dp_rank, len(data.train), dp_size))
        error: Exception | None = None
        indexes: dict[int, ShardIndex] = {}
        try:
            indexes = {i: index_shard(data.train[i]) for i in own}
            bad = [(i, int(ix.labels.max())) for i, ix in indexes.items() if ix.labels.max() >= data.num_classes]
            if bad:
                i, label = bad[0]
                raise ConfigError(f"shard {data.train[i].path} holds label {label}, but the validation shards have "
                                  f"{data.num_classes} classes (0 … {data.num_classes - 1}): every class needs "
                                  "validation samples")
        except Exception as exc:  # noqa: BLE001 — raised after the gather, so no rank is left waiting in it
            error = exc
        counts = _gather_counts(-1 if error else sum(len(ix) for ix in indexes.values()))
        if error:
            raise error
        if min(counts) < 0:
            failed = [r for r, c in enumerate(counts) if c < 0]
            raise ConfigError(f"rank(s) {failed} could not index their webdataset shards (their errors are in their logs)")
        per_rank = counts  # every rank's count (the ranks of one pipeline hold the same shards)
        fill = (lambda n: n // t.batch_size) if strategy.drop_last_batch else (lambda n: math.ceil(n / t.batch_size))
        batches = min(fill(n) for n in per_rank)
        if batches == 0:
            raise ConfigError(f"train.batch_size {t.batch_size} is larger than the {min(per_rank)} samples of the "
                              f"smallest rank's shards ({_counts_text(per_rank)}); use a smaller batch size, or "
                              "balance the shards")
        rank = dist.get_rank() if dist.is_initialized() else 0
        shard = cls(data, own, indexes, batch_size=t.batch_size, batches=batches, dp_rank=dp_rank, dp_size=dp_size,
                    seed=t.seed, rank=rank, num_workers=d.num_workers, pin_memory=d.pin_memory,
                    prefetch_factor=d.prefetch_factor)
        if rank == 0:
            print_line(f"[trainer] webdataset: {len(data.train)} training shard(s) over {dp_size} data-parallel "
                       f"rank(s), {_counts_text(per_rank)}; every rank runs {batches} batch(es) of {t.batch_size} "
                       f"per epoch")
        return shard

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's shard numbers in the order it reads them in ``epoch`` (int64), shuffled by
        ``(seed, epoch, dp_rank)``."""
        self._epoch = epoch  # for the log line of the shards read
        rng = np.random.default_rng([self.seed, epoch, self.dp_rank])
        return torch.from_numpy(np.array(self.own, dtype=np.int64)[rng.permutation(len(self.own))])

    def batch_size_of(self, index: int) -> int:
        return min(self.batch_size, self.n - index * self.batch_size)

    def batch(self, order: torch.Tensor, index: int, device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(position of its first sample in this rank's epoch, images (B, 3, S, S) float32, labels (B,)
        int64) of batch ``index`` of the epoch whose :meth:`epoch_order` is ``order``, on ``device``."""
        x, y = self._loader.next(order, index, device)
        if self.pin_memory and device.type == "cuda" and self.num_workers == 0:
            x, y = x.pin_memory(), y.pin_memory()
        return index * self.batch_size, x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def padding(self, start: int, count: int) -> tuple[None, int]:
        """(None, count): every sample of a batch is real."""
        return None, count

    def close(self) -> None:
        """Stop the DataLoader's workers, if any are running."""
        self._loader.close()

    def _raw_batches(self, order: torch.Tensor, start: int, epoch: int) -> Iterator[tuple[list[bytes], np.ndarray, list[str]]]:
        """Batches ``start`` … ``batches − 1`` of the epoch, raw (image bytes, labels, names), read
        in order from this rank's shards; logs the shards read once the epoch's last batch is out."""
        skip, left = start * self.batch_size, self.n - start * self.batch_size
        images: list[bytes] = []
        labels: list[int] = []
        names: list[str] = []
        read: list[int] = []
        for shard_no in order.tolist():
            ix = self.indexes[shard_no]
            if skip >= len(ix):
                skip -= len(ix)
                continue
            shard = self.data.train[shard_no]
            read.append(shard_no)
            with open_shard(shard, block=_READ_BLOCK) as f:
                for k in range(skip, len(ix)):
                    if left == 0:
                        break
                    f.seek(int(ix.offsets[k]))
                    images.append(f.read(int(ix.lengths[k])))
                    labels.append(int(ix.labels[k]))
                    names.append(f"{shard.path} at byte {int(ix.offsets[k]):,}")
                    left -= 1
                    if len(images) == self.batch_size or left == 0:
                        yield images, np.array(labels, dtype=np.int64), names
                        images, labels, names = [], [], []
            skip = 0
            if left == 0:
                break
        print_line(f"[trainer] rank {self.rank} (data-parallel {self.dp_rank} of {self.dp_size}) epoch {epoch}: "
                   f"read shards {sorted(read)} from batch {start} ({self.n} of its {self.samples} samples per epoch "
                   f"in {self.batches} batches)")

    def _open_at(self, order: torch.Tensor, index: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches ``index`` … ``batches − 1`` of the epoch whose shard order is ``order``, decoded (in
        DataLoader workers when ``data.num_workers`` > 0)."""
        epoch = self._epoch
        plan = _Plan(lambda: self._raw_batches(order, index, epoch))
        decode = DecodeBatch(self.data.image_size)
        if self.num_workers == 0:
            return (decode[raw] for raw in plan)
        else:
            loader = DataLoader(decode, batch_size=None, sampler=plan, num_workers=self.num_workers,
                                prefetch_factor=self.prefetch_factor,
                                pin_memory=self.pin_memory and device.type == "cuda",
                                # as streaming.StreamShard's: its own generator, workers in their own session
                                generator=torch.Generator().manual_seed(0), worker_init_fn=worker_own_session)
            return start_workers(loader)  # no worker dies of a signal to this rank


def _gather_counts(count: int) -> list[int]:
    """Every rank's ``count`` (collective over the world); [count] without a process group."""
    if not dist.is_initialized():
        return [count]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([count], dtype=torch.int64, device=device))
    return [int(t.item()) for t in out]


def _counts_text(counts: list[int]) -> str:
    return "samples per rank " + ", ".join(f"{c:,}" for c in counts)
