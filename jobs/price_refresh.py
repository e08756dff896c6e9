"""Fetch list prices from the providers' price APIs (``manage.py refresh_prices``, DESIGN.md §6).

One *fetcher* per provider, registered in :data:`FETCHERS` (provider → function): a fetcher takes the
regions to price and returns :class:`~cloud_adapters.pricing.PriceRow` records; it writes nothing.
The command stores them with ``jobs.services.instance_price_upsert`` in one transaction, so a
failure half-way leaves the catalog as it was. Vertex AI (Cloud Billing Catalog API) and Azure ML
(Azure Retail Prices API) fetchers are added to :data:`FETCHERS` the same way; the facts they need
are in shared/reference/clouds.md §4.2-4.3.

SDKs are imported inside the fetcher, so a dashboard without boto3 only fails when AWS prices are
refreshed, with a message naming what to install.
"""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Iterable, Protocol

from cloud_adapters.pricing import PriceRow

Progress = Callable[[str], None]


class PriceRefreshError(Exception):
    """The price API could not be read (network, credentials, permissions); says what to do next."""


class Fetcher(Protocol):
    def __call__(self, regions: list[str], *, progress: Progress, options: dict[str, Any]) -> list[PriceRow]:
        """Rows for ``regions`` with today's date and ``confirmed=True``; raise PriceRefreshError."""


# =============================================================================================
# AWS: the Price List API (boto3 "pricing"), SageMaker training instances
# =============================================================================================

AWS_SOURCE = "AWS Price List API"
AWS_PRICING_REGION = "us-east-1"  # the endpoint public code uses; the API is not served everywhere
AWS_SERVICE_CODE = "AmazonSageMaker"
AWS_COMPONENT = "Training"  # SageMaker products also list "Hosting Instance", "Notebook", ...


def aws_pricing_client(*, profile: str = "", endpoint_url: str = "") -> Any:
    """A boto3 ``pricing`` client on the us-east-1 endpoint, credentials from boto3's default chain
    (or the named ``profile``). Tests replace this function to hand in a Stubber-wrapped client."""
    try:
        import boto3
    except ImportError as exc:  # pragma: no cover - boto3 is a runtime requirement
        raise PriceRefreshError(
            f"refreshing AWS prices needs boto3 ({exc}); install it with `pip install 'trainboard[aws]'`."
        ) from exc
    from botocore.exceptions import BotoCoreError

    try:
        session = boto3.session.Session(profile_name=profile or None)
        return session.client("pricing", region_name=AWS_PRICING_REGION, endpoint_url=endpoint_url or None)
    except BotoCoreError as exc:  # e.g. ProfileNotFound
        raise PriceRefreshError(f"AWS: {exc}. Check the profile name in ~/.aws/config.") from exc


def _aws_error(exc: Exception) -> PriceRefreshError:
    """A PriceRefreshError saying what went wrong in words an operator can act on."""
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return PriceRefreshError(
            f"AWS credentials not found ({exc}). The Price List API needs signed requests: set "
            f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, pass --profile, or run where an IAM role is attached."
        )
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return PriceRefreshError(
            f"Cannot reach the AWS Price List API ({exc}). This machine needs network access to "
            f"api.pricing.{AWS_PRICING_REGION}.amazonaws.com; nothing was changed."
        )
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code, message = error.get("Code", "?"), error.get("Message", str(exc))
        hint = {
            "AccessDeniedException": "grant the identity pricing:GetProducts",
            "UnrecognizedClientException": "the access key is not valid; check the credentials",
            "ExpiredTokenException": "the session token expired; refresh the credentials",
            "ThrottlingException": "AWS is rate-limiting this account; try again in a minute",
        }.get(code, "see the AWS message")
        return PriceRefreshError(f"AWS Price List API refused the request ({code}: {message}); {hint}.")
    return PriceRefreshError(f"AWS Price List API call failed ({type(exc).__name__}: {exc}).")


def _hourly_usd(product: dict[str, Any]) -> Decimal | None:
    """The on-demand USD per hour of one PriceList product: the first positive
    ``terms.OnDemand.*.priceDimensions.*.pricePerUnit.USD`` whose unit is hours."""
    for term in (product.get("terms", {}).get("OnDemand") or {}).values():
        for dim in (term.get("priceDimensions") or {}).values():
            unit = str(dim.get("unit", "")).lower()
            if unit not in ("hrs", "hr", "hours", "hour"):
                continue
            try:
                price = Decimal(str(dim.get("pricePerUnit", {}).get("USD")))
            except InvalidOperation:
                continue
            if price.is_finite() and price > 0:
                return price
    return None


def parse_aws_price_list(items: Iterable[str], region: str, *, progress: Progress | None = None,
                         today: dt.date | None = None) -> list[PriceRow]:
    """PriceRows from GetProducts' ``PriceList`` (one JSON string per product) for one region.

    A product counts when it is a SageMaker Training product of ``region`` with an instance name
    (``product.attributes.instanceName``, or ``instanceType``) and an hourly on-demand USD price.
    Spot usage types are skipped (SageMaker bills managed spot at the on-demand rate for fewer
    seconds). When one instance name has several prices the highest is kept, with a warning: the
    catalog feeds budget stops and estimates, which should not under-count.
    """
    today = today or dt.date.today()
    found: dict[str, Decimal] = {}
    for raw in items:
        product = json.loads(raw) if isinstance(raw, str) else raw
        attributes = (product.get("product") or {}).get("attributes") or {}
        name = attributes.get("instanceName") or attributes.get("instanceType") or ""
        if not name or attributes.get("regionCode", region) != region:
            continue
        if attributes.get("component", AWS_COMPONENT) != AWS_COMPONENT:
            continue
        if "spot" in str(attributes.get("usagetype", "")).lower():
            continue
        price = _hourly_usd(product)
        if price is None:
            continue
        if name in found and found[name] != price and progress:
            progress(f"  warning: {region} {name} is listed at ${found[name]} and ${price}; keeping the higher")
        found[name] = max(price, found.get(name, price))
    return [
        PriceRow(provider="aws", region=region, instance_type=name, usd_per_hour=price, source=AWS_SOURCE,
                 as_of=today.isoformat(), confirmed=True)
        for name, price in sorted(found.items())
    ]


def fetch_aws(regions: list[str], *, progress: Progress, options: dict[str, Any]) -> list[PriceRow]:
    """SageMaker training prices of ``regions`` from GetProducts (ServiceCode AmazonSageMaker,
    TERM_MATCH regionCode and component=Training, every page). Source: shared/reference/clouds.md §4.1."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = aws_pricing_client(profile=options.get("profile", ""), endpoint_url=options.get("endpoint_url", ""))
    rows: list[PriceRow] = []
    for region in regions:
        progress(f"aws {region}: GetProducts {AWS_SERVICE_CODE} component={AWS_COMPONENT} ...")
        items: list[str] = []
        try:
            pages = client.get_paginator("get_products").paginate(
                ServiceCode=AWS_SERVICE_CODE, FormatVersion="aws_v1",
                Filters=[{"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
                         {"Type": "TERM_MATCH", "Field": "component", "Value": AWS_COMPONENT}],
            )
            for number, page in enumerate(pages, start=1):
                items.extend(page.get("PriceList", []))
                progress(f"aws {region}: page {number}, {len(items)} product(s) so far")
        except (BotoCoreError, ClientError) as exc:
            raise _aws_error(exc) from exc
        try:
            found = parse_aws_price_list(items, region, progress=progress)
        except (ValueError, AttributeError, TypeError) as exc:
            raise PriceRefreshError(f"AWS Price List API answered something unexpected for {region}: {exc}") from exc
        progress(f"aws {region}: {len(found)} training instance type(s) priced")
        rows.extend(found)
    return rows


# =============================================================================================
# Registry
# =============================================================================================

FETCHERS: dict[str, Fetcher] = {
    "aws": fetch_aws,
}
"""provider → fetcher. Add ``"gcp"`` (Cloud Billing Catalog) and ``"azure"`` (Retail Prices) here."""

DEFAULT_REGIONS: dict[str, str] = {"aws": "us-east-1", "gcp": "us-central1", "azure": "eastus"}
"""The region priced when neither ``--region`` nor any catalog row names one."""


def fetch_prices(provider: str, regions: list[str], *, progress: Progress,
                 options: dict[str, Any] | None = None) -> list[PriceRow]:
    """Rows from ``provider``'s price API; PriceRefreshError for an unknown provider or a failed fetch."""
    try:
        fetcher = FETCHERS[provider]
    except KeyError:
        raise PriceRefreshError(
            f"no price fetcher for provider {provider!r} yet (available: {', '.join(sorted(FETCHERS))}); "
            f"edit its prices in the admin."
        ) from None
    return fetcher(list(regions), progress=progress, options=dict(options or {}))
