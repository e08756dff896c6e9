"""The dashboard's price catalog: admin-managed :class:`~jobs.models.InstancePrice` rows over the
catalog shipped with the adapters (DESIGN.md §6).

:class:`DatabasePriceCatalog` implements ``cloud_adapters.pricing.PriceCatalog`` (``lookup``/``rows``)
and is what ``jobs.adapters.backend_adapter`` hands every adapter as ``prices=``. A row in the
database wins over the shipped row with the same (provider, region, instance type); a shipped row
the database does not hold is still found, so a fresh installation prices jobs before anyone ran
``manage.py load_prices``.

Reads only; rows are written by ``jobs.services.instance_price_upsert`` (the admin, ``load_prices``
and ``refresh_prices``).
"""

from __future__ import annotations

import datetime as dt

from cloud_adapters.gpus import GpuFacts, catalog_gpus
from cloud_adapters.pricing import PriceCatalog, PriceRow, shipped_catalog
from jobs.models import InstancePrice


def price_row(price: InstancePrice) -> PriceRow:
    """The adapters' record for a stored row (``as_of`` as YYYY-MM-DD, "" when unknown)."""
    return PriceRow(
        provider=price.provider, region=price.region, instance_type=price.instance_type,
        usd_per_hour=price.usd_per_hour, source=price.source,
        as_of=price.as_of.isoformat() if price.as_of else "", confirmed=price.confirmed,
        usd_per_gpu_hour=price.usd_per_gpu_hour,
    )


def parse_as_of(value: str | dt.date | None) -> dt.date | None:
    """A catalog row's ``as_of`` (ISO date string) as a date; None for "" or None.

    Raises ValueError naming the value when it is not YYYY-MM-DD.
    """
    if value in (None, ""):
        return None
    if isinstance(value, dt.date):
        return value
    try:
        return dt.date.fromisoformat(str(value).strip())
    except ValueError:
        raise ValueError(f"as_of {value!r} is not a date (YYYY-MM-DD)") from None


class DatabasePriceCatalog:
    """``PriceCatalog`` over :class:`InstancePrice`, falling back to ``fallback`` (default: the
    shipped catalog) for rows the database does not hold. Each call reads the database, so an
    admin's edit applies to the next price an adapter looks up."""

    def __init__(self, fallback: PriceCatalog | None = None) -> None:
        self.fallback: PriceCatalog = fallback if fallback is not None else shipped_catalog()

    def lookup(self, provider: str, region: str, instance_type: str) -> PriceRow | None:
        stored = InstancePrice.objects.filter(provider=provider, region=region, instance_type=instance_type).first()
        if stored is not None:
            return price_row(stored)
        return self.fallback.lookup(provider, region, instance_type)

    def gpus(self, provider: str, instance_type: str) -> GpuFacts | None:
        """The GPU facts of ``instance_type``: a stored row's (any region; an admin's edit wins), else
        the fallback catalog's (the shipped ``gpus.csv``); None when neither knows the type."""
        stored = (InstancePrice.objects.filter(provider=provider, instance_type=instance_type, gpu_count__isnull=False)
                  .order_by("-updated_at").first())
        if stored is not None:
            return GpuFacts(model=stored.gpu_model, count=stored.gpu_count, memory_gib=stored.gpu_memory_gib,
                            source=stored.gpu_source)
        return catalog_gpus(self.fallback, provider, instance_type)

    def rows(self, provider: str, region: str | None = None) -> list[PriceRow]:
        merged = {(r.region, r.instance_type): r for r in self.fallback.rows(provider, region)}
        stored = InstancePrice.objects.filter(provider=provider)
        if region is not None:
            stored = stored.filter(region=region)
        merged.update({(p.region, p.instance_type): price_row(p) for p in stored})
        return [merged[key] for key in sorted(merged)]
