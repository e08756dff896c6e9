"""Which torch each parallelism strategy needs, as data: read by the trainer at start and by the
dashboard at launch (an adapter that knows its image's torch refuses a strategy it cannot run).

Torch-free, so the dashboard imports it without torch's import cost.

===========  ==========  =====================================================================
strategy     torch ≥     why
===========  ==========  =====================================================================
ddp          2.4         the trainer's floor (``trainer_pkg/pyproject.toml``: ``torch>=2.4``)
fsdp         2.6         FSDP2 ``fully_shard`` is public as ``torch.distributed.fsdp.fully_shard``
                         from 2.6 (``torch.distributed._composable.fsdp`` before)
pipeline     2.7         ``torch.distributed.pipelining``'s schedules take ``scale_grads``
                         (pytorch/pytorch#144352, after 2.6's branch cut), which the trainer
                         passes; ``PipelineStage`` infers shapes without ``input_args``
===========  ==========  =====================================================================

Checked here on torch 2.13 (CPU, gloo; shared/reference/clouds.md §6); the lower bounds are those of
the APIs the trainer calls, not runs on each older release.
"""

from __future__ import annotations

import re
from typing import Mapping

TorchVersion = tuple[int, int]  # (major, minor)

STRATEGY_MIN_TORCH: Mapping[str, TorchVersion] = {"ddp": (2, 4), "fsdp": (2, 6), "pipeline": (2, 7)}
"""strategy → the oldest torch (major, minor) the trainer runs it on (the module's table)."""

STRATEGY_NEEDS: Mapping[str, str] = {
    "ddp": "the trainer's minimum",
    "fsdp": "FSDP2 fully_shard",
    "pipeline": "torch.distributed.pipelining with scale_grads",
}
"""strategy → the part of torch it needs, for messages."""

_VERSION_RE = re.compile(r"(\d+)[.\-_](\d+)")


def parse_torch_version(text: str) -> TorchVersion | None:
    """``(major, minor)`` of a torch version string (``"2.13.0+cpu"`` → (2, 13)) or of the version
    part of an image tag (``"2-4"`` → (2, 4)); None when ``text`` has none."""
    match = _VERSION_RE.search(str(text or ""))
    return (int(match.group(1)), int(match.group(2))) if match else None


def version_text(version: TorchVersion) -> str:
    return f"{version[0]}.{version[1]}"


def requirements_text() -> str:
    """``"ddp needs torch ≥ 2.4, fsdp ≥ 2.6, pipeline ≥ 2.7"``."""
    parts = [f"{name} ≥ {version_text(v)}" for name, v in STRATEGY_MIN_TORCH.items()]
    return "torch " + ", ".join(parts) if parts else ""


def strategy_torch_error(strategy: str, torch_version: TorchVersion | str | None,
                         where: str = "this torch") -> str | None:
    """Why ``strategy`` cannot run on ``torch_version`` (``(2, 4)`` or ``"2.4.1+cu121"``; None when it
    can, or the version is unknown): ``"parallel.strategy fsdp needs torch ≥ 2.6 (FSDP2 fully_shard),
    but <where> has torch 2.4.1: use ddp, or run on an image with torch ≥ 2.6 (torch ddp ≥ 2.4, …)"``."""
    need = STRATEGY_MIN_TORCH.get(strategy)
    version = parse_torch_version(torch_version) if isinstance(torch_version, str) else torch_version
    if version is None or need is None or version >= need:
        return None
    shown = torch_version if isinstance(torch_version, str) else version_text(version)
    able = [s for s, v in STRATEGY_MIN_TORCH.items() if version >= v]
    instead = f"use {' or '.join(able)}, or " if able else ""
    return (f"parallel.strategy {strategy} needs torch ≥ {version_text(need)} ({STRATEGY_NEEDS.get(strategy, strategy)}), "
            f"but {where} has torch {shown}: {instead}run on an image with torch ≥ "
            f"{version_text(need)} ({requirements_text()})")
