"""Writes of the instance price catalog (admin-managed; DESIGN.md §6): the shipped rows, a refresh
from the providers' price APIs (``manage.py refresh_prices``), and the admin's edits.

Keyword-only functions; input errors raise ``ValidationError`` keyed by field and nothing is written.
"""

from __future__ import annotations

import logging
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction

from cloud_adapters.gpus import GpuFacts, shipped_gpus
from cloud_adapters.pricing import INTERNAL_RATE_PROVIDERS, INTERNAL_RATE_SOURCE, PriceRow, shipped_catalog
from jobs import cost as costs
from jobs.models import InstancePrice
from jobs.pricing import parse_as_of
from jobs.validation import ALL, Errors

log = logging.getLogger(__name__)

_PRICE_FIELDS = ("usd_per_hour", "usd_per_gpu_hour", "source", "as_of", "confirmed")
_GPU_FIELDS = ("gpu_model", "gpu_count", "gpu_memory_gib", "gpu_source")
KEEP: Any = object()
"""An :func:`instance_price_save` GPU argument not given: the row keeps its value."""


def _gpu_values(facts: GpuFacts | None) -> dict[str, Any]:
    """The GPU columns of a catalog row from the shipped facts of its type (empty when not known)."""
    if facts is None:
        return {}
    return {"gpu_model": facts.model, "gpu_count": facts.count, "gpu_memory_gib": facts.memory_gib,
            "gpu_source": facts.source[:500]}


_MAX_RATE = Decimal("1000000")
"""Rates are stored with 12 digits, 6 after the point (InstancePrice): below a million USD."""


def _rate(errors: Errors, field: str, value: Any, message: str) -> Decimal | None:
    """``value`` as a Decimal from 0 to below a million at the catalog's precision, or an error on ``field``."""
    try:
        number = Decimal(str(value).strip()) if not isinstance(value, (bool, Decimal)) else value
        if isinstance(number, bool) or not number.is_finite() or number < 0:
            raise InvalidOperation
        if number >= _MAX_RATE:
            errors.add(field, f"{message} must be below 1,000,000, got {value!r}.")
            return None
        return number.quantize(costs.PRICE_FRACTION)
    except (InvalidOperation, ValueError, TypeError, AttributeError):
        errors.add(field, f"{message} must be a number ≥ 0, got {value!r}.")
        return None


def _price_values(errors: Errors, row: PriceRow, label: str) -> dict[str, Any]:
    """The stored columns of ``row``, every problem recorded in ``errors``. An internal-rate row
    (:data:`INTERNAL_RATE_PROVIDERS`) without a source gets :data:`INTERNAL_RATE_SOURCE`; a GPU-hour
    rate on any other row is refused (a cloud's list price is per instance-hour)."""
    internal = row.provider in INTERNAL_RATE_PROVIDERS
    source = (row.source or "").strip() or (INTERNAL_RATE_SOURCE if internal else "")
    values: dict[str, Any] = {"source": source[:500], "confirmed": bool(row.confirmed)}
    if row.provider not in InstancePrice.Provider.values:
        errors.add("provider", f"{label}: provider must be one of {', '.join(InstancePrice.Provider.values)}, "
                               f"got {row.provider!r}.")
    if not row.region or not row.instance_type:
        errors.add(ALL, f"{label}: region and instance type are required.")
    values["usd_per_hour"] = _rate(errors, "usd_per_hour", row.usd_per_hour, f"{label}: USD per hour")
    gpu_hour = _rate(errors, "usd_per_gpu_hour", "0" if row.usd_per_gpu_hour in (None, "") else row.usd_per_gpu_hour,
                     f"{label}: USD per GPU-hour")
    if gpu_hour and not internal and row.provider in InstancePrice.Provider.values:
        errors.add("usd_per_gpu_hour", f"{label}: a GPU-hour rate is for the internal rates of own clusters "
                                       f"({', '.join(sorted(INTERNAL_RATE_PROVIDERS))}); a {row.provider} price is "
                                       f"per instance-hour, so leave it at 0.")
    values["usd_per_gpu_hour"] = gpu_hour
    try:
        values["as_of"] = parse_as_of(row.as_of)
    except ValueError as exc:
        errors.add("as_of", f"{label}: {exc}.")
    return values


def instance_price_upsert(*, rows: list[PriceRow], overwrite: bool = True) -> dict[str, int]:
    """Store catalog rows as :class:`InstancePrice`, keyed by (provider, region, instance type).

    New keys are created; existing ones are updated when ``overwrite`` (a refresh from a price API)
    and left alone otherwise (seeding never undoes an admin's edit). A row's GPU columns are filled
    from the shipped facts of its type (``cloud_adapters/data/gpus.csv``) when it has none; never
    overwritten (an admin's edit stands; a price refresh knows no GPUs). One transaction: a bad row
    raises ValidationError naming it and nothing is written. Returns ``{"created", "updated",
    "unchanged"}`` counts (an overwrite with identical values counts as unchanged).
    """
    errors = Errors()
    prepared = []
    for row in rows:
        label = f"{row.provider} {row.region} {row.instance_type}"
        prepared.append((row, _price_values(errors, row, label)))
    errors.raise_if_any()
    counts = {"created": 0, "updated": 0, "unchanged": 0}
    gpus = shipped_gpus()
    with transaction.atomic():
        for row, values in prepared:
            facts = gpus.get((row.provider, row.instance_type.split(":", 1)[0]))
            existing = (InstancePrice.objects.select_for_update()
                        .filter(provider=row.provider, region=row.region, instance_type=row.instance_type).first())
            if existing is None:
                InstancePrice.objects.create(provider=row.provider, region=row.region,
                                             instance_type=row.instance_type, **values, **_gpu_values(facts))
                counts["created"] += 1
                continue
            if existing.gpu_count is None and facts is not None:  # a row stored before GPU facts were shipped
                for field, value in _gpu_values(facts).items():
                    setattr(existing, field, value)
                existing.save(update_fields=[*_GPU_FIELDS, "updated_at"])
            if overwrite and any(getattr(existing, f) != values[f] for f in _PRICE_FIELDS):
                for field in _PRICE_FIELDS:
                    setattr(existing, field, values[field])
                existing.save()
                counts["updated"] += 1
            else:
                counts["unchanged"] += 1
    return counts


def instance_price_seed(*, overwrite: bool = False) -> dict[str, int]:
    """Load the catalog shipped with the adapters (``cloud_adapters/data/prices.csv``) into
    :class:`InstancePrice`. Idempotent: rows already stored are kept as they are unless
    ``overwrite`` (then the shipped figures replace them). Counts as :func:`instance_price_upsert`."""
    catalog = shipped_catalog()
    rows = [row for provider in InstancePrice.Provider.values for row in catalog.rows(provider)]
    return instance_price_upsert(rows=rows, overwrite=overwrite)


def instance_price_save(*, price: InstancePrice | None = None, provider: str, region: str, instance_type: str,
                        usd_per_hour: Any, usd_per_gpu_hour: Any = 0, source: str = "", as_of: Any = None,
                        confirmed: bool = False, gpu_model: Any = KEEP, gpu_count: Any = KEEP,
                        gpu_memory_gib: Any = KEEP, gpu_source: Any = KEEP) -> InstancePrice:
    """Create (``price`` None) or change one catalog row (the admin's form). ValidationError keyed by
    field, every problem at once; the (provider, region, instance type) must not belong to another row.
    ``usd_per_hour`` and ``usd_per_gpu_hour``: USD ≥ 0 (the GPU-hour rate only on internal rates,
    slurm and kubernetes, whose blank source becomes "internal rate"). The GPU facts:
    ``gpu_count`` ≥ 0 or None (not known), ``gpu_memory_gib`` > 0 GiB per GPU or None; memory needs a
    count of at least 1. A GPU argument left out (:data:`KEEP`) keeps the row's value; a new row then
    takes the shipped facts of its type."""
    errors = Errors()
    given = {"gpu_model": gpu_model, "gpu_count": gpu_count, "gpu_memory_gib": gpu_memory_gib, "gpu_source": gpu_source}
    if price is not None and price.pk:
        current = {f: getattr(price, f) for f in _GPU_FIELDS}
    else:
        current = {"gpu_model": "", "gpu_count": None, "gpu_memory_gib": None, "gpu_source": "",
                   **_gpu_values(shipped_gpus().get((provider, (instance_type or "").strip().split(":", 1)[0])))}
    gpu = {f: current[f] if v is KEEP else v for f, v in given.items()}
    gpu["gpu_model"], gpu["gpu_source"] = (gpu["gpu_model"] or "").strip()[:100], (gpu["gpu_source"] or "").strip()[:500]
    gpu_count, gpu_memory_gib = gpu["gpu_count"], gpu["gpu_memory_gib"]
    if gpu_count is not None and (isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or gpu_count < 0):
        errors.add("gpu_count", f"GPUs must be a whole number ≥ 0 (0 = a CPU-only type), or empty; got {gpu_count!r}.")
    if gpu_memory_gib is not None and not (isinstance(gpu_memory_gib, (int, float)) and 0 < gpu_memory_gib <= 100_000):
        errors.add("gpu_memory_gib", f"GPU memory must be more than 0 GiB (at most 100,000), or empty; got {gpu_memory_gib!r}.")
    elif gpu_memory_gib is not None and not gpu_count:
        errors.add("gpu_count", "GPU memory is given, so say how many GPUs an instance has (1 or more).")
    row = PriceRow(provider=provider, region=(region or "").strip(), instance_type=(instance_type or "").strip(),
                   usd_per_hour=usd_per_hour, source=source or "", as_of=as_of or "", confirmed=bool(confirmed),
                   usd_per_gpu_hour=usd_per_gpu_hour)
    values = _price_values(errors, row, f"{row.provider} {row.region} {row.instance_type}")
    clash = InstancePrice.objects.filter(provider=row.provider, region=row.region, instance_type=row.instance_type)
    if price is not None and price.pk:
        clash = clash.exclude(pk=price.pk)
    if clash.exists():
        errors.add("instance_type", f"{row.instance_type} in {row.provider} {row.region} already has a price; "
                                    f"edit that row instead.")
    errors.raise_if_any()
    price = price or InstancePrice()
    price.provider, price.region, price.instance_type = row.provider, row.region, row.instance_type
    for field in _PRICE_FIELDS:
        setattr(price, field, values[field])
    for field, value in gpu.items():
        setattr(price, field, value)
    price.save()
    return price
