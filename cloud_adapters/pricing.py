"""The instance price catalog (DESIGN.md §6): USD per instance-hour by provider, region and type.

The catalog ships as data (``cloud_adapters/data/prices.csv``), one row per (provider, region,
instance type) with the figure's source and date and whether it was confirmed against the
provider's own price list. Adapters look prices up through a :class:`PriceCatalog`; the dashboard
may hand them another one (admin-edited rows kept in the database) with the same two methods.

Providers are named ``aws`` (SageMaker), ``gcp`` (Vertex AI) and ``azure`` (Azure ML); ``slurm`` and
``kubernetes`` (and ``ray``) rows are *internal rates* an admin sets for an on-premises cluster (no list
price exists): ``region`` is the cluster's name, ``instance_type`` the partition (Slurm), node pool
(Kubernetes) or ``worker`` (Ray: the rate is per worker-hour), ``usd_per_hour`` the node-hour rate and ``usd_per_gpu_hour`` the GPU-hour rate
(:func:`internal_rate`).

Interruptible capacity has rows of its own, the instance type with a suffix: ``<type>:spot``
(:data:`SPOT_SUFFIX`, Vertex AI's Spot VMs, Cloud Billing's Spot/Preemptible SKUs) and
``<vm size>:low_priority`` (Azure ML's low-priority tier, the Retail Prices API's Low Priority or
Spot meters). SageMaker has none: managed spot bills fewer seconds at the on-demand rate
(clouds.md §1.2). An adapter asks for the suffixed row when a job runs on spot, and for the plain
row for what the job would have cost on demand (``Backend.on_demand_price``).

This module imports nothing from Django or a provider SDK.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Iterable, Protocol

from cloud_adapters.gpus import GpuFacts, shipped_gpus

SHIPPED_CSV = Path(__file__).resolve().parent / "data" / "prices.csv"
SPOT_SUFFIX = ":spot"
"""A catalog row ``<instance type>:spot`` prices the spot capacity of that type (Vertex AI)."""
CSV_FIELDS = ("provider", "region", "instance_type", "usd_per_hour", "source", "as_of", "confirmed")
"""The columns every catalog CSV has."""
OPTIONAL_CSV_FIELDS = ("usd_per_gpu_hour",)
"""Columns a catalog CSV may have: ``usd_per_gpu_hour`` (internal rates; blank or absent = 0). A CSV
written before internal rates existed lacks it and still loads."""


@dataclasses.dataclass(frozen=True)
class PriceRow:
    """One catalog row: list price of one instance type in one region (on demand; spot or low
    priority when ``instance_type`` carries :data:`SPOT_SUFFIX` or ``:low_priority``)."""

    provider: str  # "aws" | "gcp" | "azure"; "slurm" | "kubernetes" for internal rates
    region: str  # provider region code, e.g. "us-east-1", "us-central1", "eastus"; internal rates: the cluster
    instance_type: str  # e.g. "ml.g5.xlarge", "n1-standard-8", "NVIDIA_TESLA_T4", "Standard_NC6s_v3"; internal
    # rates: the Slurm partition or Kubernetes node pool
    usd_per_hour: Decimal  # USD per instance-hour (per accelerator-hour for accelerator rows; node-hour for internal rates)
    source: str = ""  # where the figure comes from (URL, API, file)
    as_of: str = ""  # ISO date the figure was read, YYYY-MM-DD
    confirmed: bool = False  # checked against the provider's own price list / API
    usd_per_gpu_hour: Decimal = Decimal("0")  # internal rates: USD per GPU-hour on top of usd_per_hour


class PriceCatalog(Protocol):
    """What an adapter needs from a price catalog."""

    def lookup(self, provider: str, region: str, instance_type: str) -> PriceRow | None:
        """The row for this instance type in this region, or None when the catalog has none."""

    def rows(self, provider: str, region: str | None = None) -> list[PriceRow]:
        """Every row of ``provider`` (in ``region`` when given), sorted by instance type."""


class StaticPriceCatalog:
    """A catalog held in memory (the shipped CSV, or rows a test builds)."""

    def __init__(self, rows: Iterable[PriceRow] = ()) -> None:
        self._rows: dict[tuple[str, str, str], PriceRow] = {}
        for row in rows:
            self._rows[(row.provider, row.region, row.instance_type)] = row

    def lookup(self, provider: str, region: str, instance_type: str) -> PriceRow | None:
        return self._rows.get((provider, region, instance_type))

    def gpus(self, provider: str, instance_type: str) -> GpuFacts | None:
        """The GPU facts of ``instance_type`` (the shipped file's: prices and GPUs are apart)."""
        return shipped_gpus().get((provider, instance_type))

    def rows(self, provider: str, region: str | None = None) -> list[PriceRow]:
        found = [r for (p, reg, _), r in self._rows.items() if p == provider and (region is None or reg == region)]
        return sorted(found, key=lambda r: (r.region, r.instance_type))


def _decimal(path: Path | str, lineno: int, field: str, text: str | None, *, blank: Decimal | None = None) -> Decimal:
    text = (text or "").strip()
    if not text and blank is not None:
        return blank
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"{path}:{lineno}: {field} {text!r} is not a number") from None
    if not value.is_finite() or value < 0:
        raise ValueError(f"{path}:{lineno}: {field} must be a number ≥ 0, got {text!r}")
    return value


def read_csv(path: Path | str) -> list[PriceRow]:
    """Rows of a catalog CSV (header :data:`CSV_FIELDS`, plus any of :data:`OPTIONAL_CSV_FIELDS`).
    Raises ValueError naming the bad line."""
    out: list[PriceRow] = []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = set(CSV_FIELDS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        for lineno, rec in enumerate(reader, start=2):
            cell = {key: (value or "").strip() if isinstance(value, str) or value is None else ""
                    for key, value in rec.items() if key is not None}  # a short line's missing cells are None
            out.append(PriceRow(
                provider=cell["provider"], region=cell["region"], instance_type=cell["instance_type"],
                usd_per_hour=_decimal(path, lineno, "usd_per_hour", cell["usd_per_hour"]),
                source=cell["source"], as_of=cell["as_of"],
                confirmed=cell["confirmed"].lower() in ("1", "true", "yes"),
                usd_per_gpu_hour=_decimal(path, lineno, "usd_per_gpu_hour", cell.get("usd_per_gpu_hour"),
                                          blank=Decimal("0")),
            ))
    return out


def write_csv(path: Path | str, rows: Iterable[PriceRow]) -> None:
    """Write ``rows`` as a catalog CSV (:data:`CSV_FIELDS` then :data:`OPTIONAL_CSV_FIELDS`), sorted by
    provider, region, instance type."""
    ordered = sorted(rows, key=lambda r: (r.provider, r.region, r.instance_type))
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(CSV_FIELDS + OPTIONAL_CSV_FIELDS)
        for r in ordered:
            writer.writerow([r.provider, r.region, r.instance_type, f"{r.usd_per_hour:f}", r.source, r.as_of,
                             "true" if r.confirmed else "false", f"{r.usd_per_gpu_hour:f}"])


@functools.cache
def shipped_catalog() -> StaticPriceCatalog:
    """The catalog shipped with Trainboard (read once per process)."""
    return StaticPriceCatalog(read_csv(SHIPPED_CSV))


INTERNAL_RATE_SOURCE = "internal rate"
"""The ``source`` of catalog rows an admin sets for an on-premises cluster (slurm, kubernetes)."""
INTERNAL_RATE_PROVIDERS = frozenset({"slurm", "kubernetes", "ray"})
"""The catalog providers whose rows are internal rates: no price API exists for them (``refresh_prices``
refuses them), a row's source defaults to :data:`INTERNAL_RATE_SOURCE`, and only their rows carry a
GPU-hour rate."""


def internal_rate(prices: PriceCatalog, provider: str, cluster: str, pool: str, gpus_per_node: int) -> Decimal | None:
    """USD per node-hour of ``pool`` (a Slurm partition, a Kubernetes node pool) on ``cluster``:
    the row's node-hour rate plus ``gpus_per_node`` × its GPU-hour rate; None when the catalog has no
    row for it (the job is then priced at 0 and the job page says no rate is set).

    A job's cost is then elapsed hours × nodes × this rate (DESIGN.md §6)."""
    row = prices.lookup(provider, cluster, pool)
    if row is None:
        return None
    return row.usd_per_hour + max(0, int(gpus_per_node)) * (row.usd_per_gpu_hour or Decimal("0"))
