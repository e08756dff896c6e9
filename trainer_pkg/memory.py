"""The memory each rank holds, measured: the ``rank_memory`` of ``epoch`` and ``completed`` records.

``rank_memory`` is a list indexed by rank of::

    {"peak_bytes": int, "params_bytes": int, "grads_bytes": int, "optimizer_bytes": int,
     "activations_bytes": int, "device": "cuda" | "cpu"}

``params_bytes``, ``grads_bytes``, ``optimizer_bytes``: the bytes of the parameters this rank's
optimizer updates, of their gradients and of the optimizer's state tensors (SGD's momentum, AdamW's
two moments and step), counted as this rank holds them: under FSDP the local shards (a DTensor's
``to_local()``), so they are 1/W of DDP's on W ranks where every sharded dimension divides by W.

``activations_bytes``: the peak bytes of tensors saved for backward during one batch's forward
(:class:`SavedActivations`, a ``torch.autograd.graph.saved_tensors_hooks`` pair), measured on the
first step of each epoch only, so the other steps pay nothing. Each storage counts once; the
parameters themselves (FSDP's all-gathered ones included) are left out. A unit under activation
checkpointing saves nothing but its inputs, which are counted (the checkpoint keeps them). A
pipeline stage's count is the sum over the batch's micro-batches: GPipe holds them all before the
first backward, so that is its peak; under 1F1B it is an upper bound.

``peak_bytes``: on a GPU ``torch.cuda.max_memory_allocated`` (everything the caching allocator
handed out, at its highest, since the run started); on CPU the sum of the four counts above (the
process's RSS would include the data, the interpreter and torch itself).
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch
import torch.distributed as dist

_ACTIVE: "SavedActivations | None" = None


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``Linear`` saves ``weight.t()``); FSDP2's all-gathered
    (unsharded) parameters are ``nn.Parameter`` too."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class SavedActivations:
    """Context manager: :attr:`bytes` is the total size of the distinct storages saved for backward
    by the autograd graph recorded while it is active (parameters excluded). Saved tensors live until
    the backward reaches them, so at the end of a forward this total is the peak of them."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()
        self._hooks: Any = None
        self._outer: SavedActivations | None = None

    def add(self, t: Any) -> None:
        """Count ``t``'s storage unless it is a parameter's or already counted."""
        if not isinstance(t, torch.Tensor) or _is_parameter(t):
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            return
        key = storage.data_ptr()
        if key and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "SavedActivations":
        global _ACTIVE
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._outer, _ACTIVE = _ACTIVE, self
        return self

    def __exit__(self, *exc_info: Any) -> None:
        global _ACTIVE
        _ACTIVE = self._outer
        self._hooks.__exit__(*exc_info)


def note_checkpoint_inputs(args: Iterable[Any]) -> None:
    """Count the inputs an activation-checkpointed forward keeps for its recomputation (the
    checkpoint's own hooks hide what it saves inside from :class:`SavedActivations`)."""
    if _ACTIVE is not None and torch.is_grad_enabled():
        for a in args:
            _ACTIVE.add(a)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` as this rank holds it: a DTensor's local shard, else the tensor."""
    # No DTensor exists unless FSDP imported its module: importing it here would cost every DDP and
    # pipeline rank about 40 MB of resident memory for nothing.
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def rank_memory(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, device: torch.device,
                activations_bytes: int) -> dict[str, Any]:
    """This rank's entry of ``rank_memory`` (see the module docstring): ``params`` are the parameters
    its optimizer updates, read with their gradients as they are now (after a step, before the next
    ``zero_grad``)."""
    params_bytes = sum(local_bytes(p) for p in params)
    grads_bytes = sum(local_bytes(p.grad) for p in params if p.grad is not None)
    optimizer_bytes = sum(local_bytes(v) for state in optimizer.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor))
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    else:
        peak = params_bytes + grads_bytes + optimizer_bytes + activations_bytes
    return {"peak_bytes": int(peak), "params_bytes": int(params_bytes), "grads_bytes": int(grads_bytes),
            "optimizer_bytes": int(optimizer_bytes), "activations_bytes": int(activations_bytes),
            "device": "cuda" if device.type == "cuda" else "cpu"}


def gather_rank_memory(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Collective: every rank's :func:`rank_memory`, indexed by rank (on every rank)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every
