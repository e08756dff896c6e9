"""Training data read per batch: an ImageFolder decoded, a memory-mapped CSV cache or NPZ sliced, only
for the samples a batch needs, in DataLoader worker processes (``data.num_workers``) ahead of the step.

:class:`StreamShard` is the training shard of a dataset whose inputs are
:class:`trainer_pkg.datasets.Samples` (``train.make_shard`` picks it); it has
:class:`trainer_pkg.train.TrainShard`'s interface and the same sample order (both hold a :class:`trainer_pkg.sampling.ShardOrder`), so a run gives the
same parameters whether its data is streamed or held in memory:

- each epoch's order is the ``DistributedSampler``'s (seeded by ``train.seed``, ``set_epoch`` per
  epoch, padded to ``ceil(n / dp_size)`` by repeating its head), cut into ``train.batch_size`` batches;
- batch ``i`` of an epoch holds the same samples, decoded the same way, whatever came before it: a
  run resumed at batch ``i`` (or one whose loop asks for batches out of sequence) restarts the
  DataLoader's iterator at ``i``;
- no random number is drawn from the rank's generators (the DataLoader gets its own), so dropout and
  ``train.augment``'s flips draw what they would from an in-memory shard.

With ``data.num_workers`` 0 a batch is read in the training process when it is asked for. With N > 0
each rank starts N worker processes per epoch (forked: they share the file list and the memory maps),
each preparing ``data.prefetch_factor`` batches ahead; an epoch's last batch shuts them down, and a run
stopped mid-epoch shuts them down with its iterator. Workers run in a session of their own, out of the
reach of signals sent to their rank's process group (:func:`start_workers`, :func:`worker_own_session`):
stopping is the rank's business (the ranks agree on it, then checkpoint), and a SIGTERM that torchrun
passes on to the rank's group must not kill them first. ``data.pin_memory`` pins batches for the copy
to a GPU (ignored on CPU).
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.datasets import Dataset, Samples
from trainer_pkg.sampling import ShardOrder


class SampleBatches(torch.utils.data.Dataset):
    """A map-style dataset whose index is a whole batch: ``dataset[indices]`` reads those samples
    (:meth:`Samples.take`) in one call. Used with ``batch_size=None``, so the DataLoader's sampler
    yields index arrays and no per-sample collation runs."""

    def __init__(self, x: Samples, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs (k, *sample shape) float32, labels (k,) int64) of the samples ``indices``."""
        return torch.from_numpy(self.x.take(indices)), self.y[torch.from_numpy(indices)]


class SampleView:
    """Validation inputs for :meth:`trainer_pkg.parallel.Strategy.evaluate`: indexed by a (k,) int64
    tensor, it reads just those samples as a float32 tensor (k, *sample shape)."""

    def __init__(self, x: Samples) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.x.take(idx.cpu().numpy()))


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def start_workers(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)``, its workers forked with SIGTERM and SIGINT blocked (this process gets a signal
    sent meanwhile once they are started): with :func:`worker_own_session` as the loader's
    ``worker_init_fn``, no worker can die of a signal sent to this rank's process group."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def worker_own_session(worker_id: int) -> None:
    """A DataLoader worker leaves its rank's process group (``setsid``), so the signals sent to the group
    are its rank's alone. A stop signals the whole group: torchrun's agent passes SIGTERM on with
    ``killpg`` to each rank's group, a terminal sends SIGINT to its foreground group. A worker killed by
    it would fail its rank's next batch ("DataLoader worker exited unexpectedly") before the ranks have
    agreed to stop and checkpointed. The rank still stops its workers itself (each worker is its child:
    SIGTERM's default action is back once the worker has left), and a worker whose rank is gone exits by
    itself (the DataLoader's watchdog).

    Forked by :func:`start_workers`, the worker starts with both signals blocked; one sent to the group
    before ``setsid`` is pending, and discarded here (ignoring a pending signal drops it)."""
    os.setsid()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class EpochBatches:
    """An epoch's batches from an iterator that can start at any batch: what :class:`StreamShard` and
    :class:`trainer_pkg.web_shard.WebShard` read through.

    ``open_at(order, index, device)`` returns an iterator over batches ``index`` … ``batches − 1`` of
    the epoch whose order is ``order`` (a DataLoader's, its workers started with
    :func:`start_workers`). :meth:`next` keeps that iterator while the training loop asks for batches
    in sequence and opens a new one when it asks for another epoch's order or another batch (a run
    resumed mid-epoch); the epoch's last batch closes it, so its workers exit then, not at the next
    epoch. A :class:`ConfigError` raised in a worker (the DataLoader re-raises it with the worker's
    traceback in the message) comes out as the worker's own message."""

    def __init__(self, open_at: Callable[[torch.Tensor, int, torch.device], Iterator[Any]], batches: int) -> None:
        self.open_at, self.batches = open_at, batches
        self._order: torch.Tensor | None = None  # the epoch order the running iterator reads
        self._next = -1  # the batch index the running iterator yields next
        self._batches: Iterator[Any] | None = None

    def next(self, order: torch.Tensor, index: int, device: torch.device) -> Any:
        """Batch ``index`` of the epoch whose order is ``order``, as ``open_at``'s iterator yields it."""
        if self._batches is None or order is not self._order or index != self._next:
            self.close()
            self._batches, self._order, self._next = self.open_at(order, index, device), order, index
        try:
            batch = next(self._batches)
        except ConfigError as exc:
            self.close()
            raise ConfigError(str(exc).strip().splitlines()[-1].partition("ConfigError: ")[2] or str(exc)) from None
        self._next = index + 1
        if self._next == self.batches:
            self.close()
        return batch

    def close(self) -> None:
        """Drop the running iterator (a DataLoader's workers stop with it); the next batch opens a new one."""
        self._batches, self._order, self._next = None, None, -1


class StreamShard:
    """This rank's part of each epoch's training data, read batch by batch from
    :class:`~trainer_pkg.datasets.Samples` (see the module docstring)."""

    def __init__(self, x: Samples, y: torch.Tensor, order: ShardOrder, *, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int = 2) -> None:
        self.x, self.y, self.order = x, y, order
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self._loader = EpochBatches(self._open_at, order.batches)

    @classmethod
    def of(cls, data: Dataset, strategy: Any, cfg: JobConfig) -> "StreamShard":
        """The shard of ``data``'s training split that ``strategy`` (its ``dp_rank``, ``dp_size`` and
        ``drop_last_batch``) gives this rank. Raises :class:`ConfigError` when a shard holds fewer
        samples than one batch of a pipeline."""
        t, d = cfg.train, cfg.data
        order = ShardOrder(len(data.y_train), dp_rank=strategy.dp_rank, dp_size=strategy.dp_size,
                           batch_size=t.batch_size, seed=t.seed, drop_last_batch=strategy.drop_last_batch)
        if order.batches == 0:
            raise ConfigError(order.too_small())
        return cls(data.x_train, torch.from_numpy(data.y_train), order, num_workers=d.num_workers,
                   pin_memory=d.pin_memory, prefetch_factor=d.prefetch_factor)

    @property
    def n(self) -> int:
        """Training samples in the whole split (every rank's)."""
        return len(self.y)

    @property
    def batches(self) -> int:
        """Batches per epoch (a pipeline skips an incomplete last batch)."""
        return self.order.batches

    @property
    def batch_size(self) -> int:
        return self.order.batch_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for ``epoch`` in training order (:meth:`ShardOrder.epoch_order`)."""
        return self.order.epoch_order(epoch)

    def batch(self, order: torch.Tensor, index: int, device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(position of its first sample in ``order``, samples (B, *sample shape) float32, labels (B,)
        int64) of batch ``index`` of the epoch whose :meth:`epoch_order` is ``order``, on ``device``."""
        start = index * self.batch_size
        if self.num_workers == 0:
            x, y = SampleBatches(self.x, self.y)[self._indices(order, index)]
            if self.pin_memory and device.type == "cuda":
                x, y = x.pin_memory(), y.pin_memory()
        else:
            x, y = self._loader.next(order, index, device)
        return start, x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def padding(self, start: int, count: int) -> tuple[torch.Tensor | None, int]:
        """(mask of the real samples, how many) among ``count`` positions from ``start``
        (:meth:`ShardOrder.padding`)."""
        return self.order.padding(start, count)

    def close(self) -> None:
        """Stop the DataLoader's workers, if any are running (the next batch starts new ones)."""
        self._loader.close()

    def _indices(self, order: torch.Tensor, index: int) -> np.ndarray:
        return self.order.indices(order, index).numpy()

    def _open_at(self, order: torch.Tensor, index: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A DataLoader over this epoch's batches ``index`` … ``batches - 1``, its workers started."""
        plan = [self._indices(order, i) for i in range(index, self.batches)]
        loader = DataLoader(
            SampleBatches(self.x, self.y), batch_size=None, sampler=plan, num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor, pin_memory=self.pin_memory and device.type == "cuda",
            # Its own generator: the workers' base seed would otherwise be drawn from the rank's
            # torch generator, moving dropout and augmentation off an in-memory run's.
            generator=torch.Generator().manual_seed(0), worker_init_fn=worker_own_session,
        )
        return start_workers(loader)
