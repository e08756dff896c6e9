"""Writes of the instance price catalog (admin-managed; DESIGN.md §6): the shipped rows, a refresh
from the providers' price APIs (``manage.py refresh_prices``), and the admin's edits.

Keyword-only functions; input errors raise ``ValidationError`` keyed by field and nothing is written.
"""

from __future__ import annotations

import logging
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction

from cloud_adapters.pricing import PriceRow, shipped_catalog
from jobs import cost as costs
from jobs.models import InstancePrice
from jobs.pricing import parse_as_of
from jobs.validation import ALL, Errors

log = logging.getLogger(__name__)

_PRICE_FIELDS = ("usd_per_hour", "source", "as_of", "confirmed")


def _price_values(errors: Errors, row: PriceRow, label: str) -> dict[str, Any]:
    values: dict[str, Any] = {"source": (row.source or "")[:500], "confirmed": bool(row.confirmed)}
    if row.provider not in InstancePrice.Provider.values:
        errors.add("provider", f"{label}: provider must be one of {', '.join(InstancePrice.Provider.values)}, "
                               f"got {row.provider!r}.")
    if not row.region or not row.instance_type:
        errors.add(ALL, f"{label}: region and instance type are required.")
    try:
        price = Decimal(str(row.usd_per_hour))
        if not price.is_finite() or price < 0:
            raise InvalidOperation
        values["usd_per_hour"] = price.quantize(costs.PRICE_FRACTION)
    except (InvalidOperation, ValueError):
        errors.add("usd_per_hour", f"{label}: USD per hour must be a number ≥ 0, got {row.usd_per_hour!r}.")
    try:
        values["as_of"] = parse_as_of(row.as_of)
    except ValueError as exc:
        errors.add("as_of", f"{label}: {exc}.")
    return values


def instance_price_upsert(*, rows: list[PriceRow], overwrite: bool = True) -> dict[str, int]:
    """Store catalog rows as :class:`InstancePrice`, keyed by (provider, region, instance type).

    New keys are created; existing ones are updated when ``overwrite`` (a refresh from a price API)
    and left alone otherwise (seeding never undoes an admin's edit). One transaction: a bad row
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
    with transaction.atomic():
        for row, values in prepared:
            existing = (InstancePrice.objects.select_for_update()
                        .filter(provider=row.provider, region=row.region, instance_type=row.instance_type).first())
            if existing is None:
                InstancePrice.objects.create(provider=row.provider, region=row.region,
                                             instance_type=row.instance_type, **values)
                counts["created"] += 1
            elif overwrite and any(getattr(existing, f) != values[f] for f in _PRICE_FIELDS):
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
                        usd_per_hour: Any, source: str = "", as_of: Any = None,
                        confirmed: bool = False) -> InstancePrice:
    """Create (``price`` None) or change one catalog row (the admin's form). ValidationError keyed by
    field; the (provider, region, instance type) must not belong to another row."""
    errors = Errors()
    row = PriceRow(provider=provider, region=(region or "").strip(), instance_type=(instance_type or "").strip(),
                   usd_per_hour=usd_per_hour, source=source or "", as_of=as_of or "", confirmed=bool(confirmed))
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
    price.save()
    return price
