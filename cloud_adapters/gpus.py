"""GPU facts of the catalog's instance types: which GPU, how many per instance, memory per GPU.

Shipped as data (``cloud_adapters/data/gpus.csv``), one row per (provider, instance type) with the
documentation page it comes from; the dashboard stores them beside the prices
(``jobs.models.InstancePrice``), where admins edit them. The memory plan
(:mod:`trainer_pkg.memory_plan`) checks a job's peak per rank against :attr:`GpuFacts.memory_bytes`.

Vertex AI rows are per accelerator (``NVIDIA_TESLA_T4``: count 1), as Vertex attaches a backend's
``accelerator_type`` × ``accelerator_count`` to a machine type that has none of its own. Providers'
pages give GPU memory in "GB" that are binary (an A10G's 24 GB are 24 × 2³⁰ bytes): stored as GiB.

This module imports nothing from Django or a provider SDK.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
from pathlib import Path

SHIPPED_GPUS_CSV = Path(__file__).resolve().parent / "data" / "gpus.csv"
GPU_CSV_FIELDS = ("provider", "instance_type", "gpu_model", "gpu_count", "gpu_memory_gib", "source")


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """The GPUs of one instance type."""

    model: str  # e.g. "NVIDIA A10G"; "" for a type without GPUs
    count: int  # GPUs per instance; 0 = a CPU-only type
    memory_gib: float | None  # memory of one GPU (GiB); None when not known
    source: str = ""  # where the figures come from (a provider's documentation page)

    @property
    def memory_bytes(self) -> int | None:
        """Memory of one GPU in bytes; None for a CPU-only type or an unknown figure."""
        if not self.count or self.memory_gib is None:
            return None
        return int(self.memory_gib * 2**30)

    def describe(self, instance_type: str) -> str:
        """``"ml.g5.xlarge (1 × NVIDIA A10G, 24 GiB each)"``, or ``"ml.m5.xlarge (no GPU)"``."""
        if not self.count:
            return f"{instance_type} (no GPU)"
        memory = f", {self.memory_gib:g} GiB each" if self.memory_gib is not None else ""
        return f"{instance_type} ({self.count} × {self.model or 'GPU'}{memory})"


def read_gpus_csv(path: Path | str) -> dict[tuple[str, str], GpuFacts]:
    """The rows of a GPU facts CSV (header :data:`GPU_CSV_FIELDS`) keyed by (provider, instance type).
    Raises ValueError naming the bad line."""
    out: dict[tuple[str, str], GpuFacts] = {}
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = set(GPU_CSV_FIELDS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        for lineno, rec in enumerate(reader, start=2):
            try:
                count = int(rec["gpu_count"])
                memory = float(rec["gpu_memory_gib"]) if rec["gpu_memory_gib"].strip() else None
            except ValueError:
                raise ValueError(f"{path}:{lineno}: gpu_count must be a whole number and gpu_memory_gib a "
                                 f"number (or empty)") from None
            if count < 0 or (memory is not None and memory <= 0):
                raise ValueError(f"{path}:{lineno}: gpu_count must be ≥ 0 and gpu_memory_gib > 0")
            out[(rec["provider"].strip(), rec["instance_type"].strip())] = GpuFacts(
                model=rec["gpu_model"].strip(), count=count, memory_gib=memory, source=rec["source"].strip())
    return out


@functools.cache
def shipped_gpus() -> dict[tuple[str, str], GpuFacts]:
    """The GPU facts shipped with Trainboard (read once per process)."""
    return read_gpus_csv(SHIPPED_GPUS_CSV)


def catalog_gpus(prices: object, provider: str, instance_type: str) -> GpuFacts | None:
    """The GPU facts of ``instance_type`` from a price catalog that has them (``prices.gpus``, the
    dashboard's admin-edited rows), else from the shipped file; None when neither knows the type."""
    lookup = getattr(prices, "gpus", None)
    if callable(lookup):
        return lookup(provider, instance_type)
    return shipped_gpus().get((provider, instance_type))
