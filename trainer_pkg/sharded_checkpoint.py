"""Sharded checkpoints (``output.checkpoint_format`` ``sharded``): ``torch.distributed.checkpoint``.

Layout, in ``<checkpoint_dir>/checkpoint/``::

    .metadata, __0_0.distcp, __1_0.distcp, ...   DCP: the model and optimizer state, each rank's own
                                                   shards (FSDP) or one copy of replicated tensors (DDP)
    trainboard.pt                                  rank 0: the loop position (epoch, batches_done,
                                                   step), the lr schedule, every rank's RNG, the
                                                   world size, strategy and config (torch.save)

The model and optimizer state go through ``get_state_dict`` / ``set_state_dict``
(``torch.distributed.checkpoint.state_dict``), keyed by the plain model's parameter names, so DCP
reshards on load: a checkpoint written on 2 ranks resumes on 1 or 4, and under ddp or fsdp. A
pipeline is refused (:func:`trainer_pkg.world_shape.shape_errors`): its stages hold different
modules, which this layout does not map.

Written atomically: every rank writes into ``.checkpoint.tmp-<step>``, then rank 0 writes
``trainboard.pt`` and renames the directory to ``checkpoint`` (the previous one is renamed to
``checkpoint.old`` first and removed after), so a run killed at any moment leaves a complete
checkpoint: :func:`find_checkpoint` falls back to ``checkpoint.old`` when the kill fell between the
two renames. Every rank must see the same ``checkpoint_dir`` (one machine, or shared storage).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

DIR_NAME = "checkpoint"
META_NAME = "trainboard.pt"


def checkpoint_dir_path(checkpoint_dir: str) -> str:
    """``<checkpoint_dir>/checkpoint``: where the sharded checkpoint lives."""
    return os.path.join(checkpoint_dir, DIR_NAME)


def find_checkpoint(path: str) -> str | None:
    """The complete sharded checkpoint to resume from: ``path`` or, when a run was killed between
    the two renames of :func:`write`, ``path.old``; None when there is none."""
    for candidate in (path, path + ".old"):
        if os.path.isfile(os.path.join(candidate, META_NAME)):
            return candidate
    return None


def read_meta(path: str) -> dict[str, Any]:
    """``trainboard.pt`` of the checkpoint directory ``path`` with ``format`` and ``path`` added.
    Raises ValueError for a file that cannot be read (the caller names what to do)."""
    try:
        meta = torch.load(os.path.join(path, META_NAME), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise ValueError("not a Trainboard checkpoint")
    return {**meta, "format": "sharded", "path": path}


def remove_stale_temp_dirs(path: str) -> list[str]:
    """Delete the ``.checkpoint.tmp-*`` directories a killed run left beside ``path``; returns them.
    Called by rank 0 before any rank writes."""
    parent, prefix = os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-"
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return []
    for name in names:
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return [os.path.join(parent, n) for n in names]


def _first_failure(exc: BaseException) -> str:
    """The first rank's reason inside DCP's ``CheckpointException`` (every rank's failure, wrapped
    with its traceback), as one line."""
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        text = str(inner).strip().splitlines()
        return f"{type(inner).__name__}: {text[0]}" if text else type(inner).__name__
    return str(exc).splitlines()[0]


def write(path: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any], *,
          step: int) -> None:
    """Collective: save ``module``'s and ``optimizer``'s state with DCP and ``meta`` (rank 0's) into
    ``path``, atomically (see the module docstring). ``module`` is the strategy's module (the plain
    model under DDP, the ``fully_shard``-ed root under FSDP)."""
    # Imported here, not at the top: DCP costs every rank about a second and tens of MB of imports,
    # and most runs write full checkpoints.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    parent = os.path.dirname(path) or "."
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{step}")
    main = dist.get_rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(module, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
    except CheckpointException as exc:
        raise RuntimeError(f"writing the sharded checkpoint {tmp} failed: {_first_failure(exc)}") from None
    # dcp.save returns on the coordinator (rank 0) once every rank's shards are written.
    if main:
        with open(os.path.join(tmp, META_NAME), "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(path):
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load(path: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: load the model and optimizer state of the checkpoint ``path`` into ``module`` and
    ``optimizer`` on any world size (DCP reshards). Raises ValueError for a checkpoint of another
    model or optimizer, with DCP's first reason ("Size mismatch between saved torch.Size([32, 16]) and
    current: torch.Size([64, 16]) for model.net.1.weight"); RuntimeError or KeyError from
    ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(module, optimizer)  # the layout to read into
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as exc:  # a BaseException: no handler above would see it
        raise ValueError(_first_failure(exc)) from None
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
