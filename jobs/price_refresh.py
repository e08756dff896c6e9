"""Fetch list prices from the providers' price APIs (``manage.py refresh_prices``, DESIGN.md §6).

One *fetcher* per provider, registered in :data:`FETCHERS` (provider → function): a fetcher takes the
regions to price and returns :class:`~cloud_adapters.pricing.PriceRow` records; it writes nothing.
The command stores them with ``jobs.services.instance_price_upsert`` in one transaction, so a
failure half-way leaves the catalog as it was.

- ``aws``: the AWS Price List API (boto3 ``pricing``), SageMaker training instances (clouds.md §4.1).
- ``gcp``: the Cloud Billing Catalog API, SKUs of the Vertex AI service (clouds.md §4.2). Vertex
  bills custom training per vCPU-hour and GiB-hour of the machine family plus per GPU-hour, so a
  machine type's row is rebuilt from its shape (:data:`GCP_MACHINE_SHAPES`); accelerators get their
  own rows, per GPU-hour, under the ``AcceleratorType`` name the Vertex adapter looks up; Spot VM
  (Preemptible) SKUs give the same rows as ``<name>:spot``.
- ``azure``: the Azure Retail Prices API (unauthenticated, clouds.md §4.3), Linux pay-as-you-go VM
  prices (Azure ML compute is priced as the VMs under it); the low-priority figure (the "Low Priority"
  meter, else the "Spot" one) is stored as ``<vm size>:low_priority``.

``options`` (all optional): ``endpoint_url`` (another API root, for tests and proxies), ``profile``
(aws), ``api_key`` (gcp, instead of Application Default Credentials) and ``instance_types`` (gcp
machine types / azure VM sizes to price; the command passes those the catalog already holds plus
``--instance-type``).

SDKs are imported inside the fetcher, so a dashboard without boto3 only fails when AWS prices are
refreshed, with a message naming what to install.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any, Callable, Iterable, Protocol

from cloud_adapters.pricing import INTERNAL_RATE_PROVIDERS, SPOT_SUFFIX, PriceRow
from trainer_pkg.config import plural

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
            f"refreshing AWS prices needs boto3 ({exc}); install boto3 from requirements.txt "
            f"(`pip install -r requirements.txt`)."
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
            f"api.pricing.{AWS_PRICING_REGION}.amazonaws.com."
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
                progress(f"aws {region}: page {number}, {plural(len(items), 'product', 'products')} so far")
        except (BotoCoreError, ClientError) as exc:
            raise _aws_error(exc) from exc
        try:
            found = parse_aws_price_list(items, region, progress=progress)
        except (ValueError, AttributeError, TypeError) as exc:
            raise PriceRefreshError(f"AWS Price List API answered something unexpected for {region}: {exc}") from exc
        progress(f"aws {region}: {plural(len(found), 'training instance type', 'training instance types')} priced")
        rows.extend(found)
    return rows


# =============================================================================================
# Shared: JSON over HTTP (requests), errors in words
# =============================================================================================

HTTP_TIMEOUT_S = 60.0
_PRICE_FRACTION = Decimal("0.000001")  # the catalog's precision (InstancePrice.usd_per_hour)


def _get_json(session: Any, url: str, *, params: dict[str, str] | None, api: str, host: str) -> dict[str, Any]:
    """One GET answered with a JSON object; PriceRefreshError naming ``api`` for anything else."""
    import requests

    try:
        response = session.get(url, params=params, timeout=HTTP_TIMEOUT_S)
    except requests.exceptions.RequestException as exc:
        raise PriceRefreshError(
            f"Cannot reach the {api} ({type(exc).__name__}: {exc}). This machine needs network access to "
            f"{host}."
        ) from exc
    if response.status_code >= 400:
        raise PriceRefreshError(f"The {api} refused the request (HTTP {response.status_code}: "
                                f"{_error_message(response)}); {_http_hint(response.status_code, api)}.")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise PriceRefreshError(f"The {api} answered something that is not a JSON object "
                                f"({response.text[:200]!r}).")
    return body


def _error_message(response: Any) -> str:
    """The message of a Google (``{"error": {"message"}}``) or Azure (``{"Error": {"Message"}}``)
    error body, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return (response.text or response.reason or "").strip()[:300]
    error = (body.get("error") or body.get("Error") or {}) if isinstance(body, dict) else {}
    if isinstance(error, dict):
        message = error.get("message") or error.get("Message")
        status = error.get("status") or error.get("Code") or error.get("code")
        if message:
            return f"{status}: {message}" if isinstance(status, str) and status else str(message)
    return json.dumps(body)[:300]


def _http_hint(status: int, api: str) -> str:
    if status in (401, 403):
        return ("check the credentials and that the Cloud Billing API is enabled for their project"
                if "Billing" in api else "check the request")
    if status == 429:
        return "the API is rate-limiting this machine; try again in a minute"
    if status >= 500:
        return "the provider had an error; try again later"
    return "see the message"


def _usd(value: Decimal) -> Decimal:
    return value.quantize(_PRICE_FRACTION, rounding=ROUND_HALF_UP)


def _requested_types(options: dict[str, Any]) -> list[str]:
    return sorted({str(t).strip() for t in options.get("instance_types") or () if str(t).strip()})


# =============================================================================================
# GCP: the Cloud Billing Catalog API, Vertex AI custom training
# =============================================================================================

GCP_SOURCE = "Cloud Billing Catalog API (Vertex AI)"
GCP_ENDPOINT = "https://cloudbilling.googleapis.com"
GCP_VERTEX_SERVICE_ID = "C7E2-9256-1C43"  # clouds.md §4.2 (from public code, not Google docs)
GCP_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


def _gcp_shapes() -> dict[str, tuple[str, int, Decimal]]:
    """machine type → (billing family, vCPUs, GiB of memory), from Compute Engine's machine-family
    tables (cloud.google.com/compute/docs/machine-resource). A2/A3/G2 list the host only: their GPUs
    are billed per GPU-hour and the Vertex adapter adds them (accelerator row × count)."""
    shapes: dict[str, tuple[str, int, Decimal]] = {}
    for n in (2, 4, 8, 16, 32, 64, 96):
        shapes[f"n1-standard-{n}"] = ("N1", n, Decimal("3.75") * n)
        shapes[f"n1-highmem-{n}"] = ("N1", n, Decimal("6.5") * n)
        shapes[f"n1-highcpu-{n}"] = ("N1", n, Decimal("0.9") * n)
    for n in (2, 4, 8, 16, 32):
        shapes[f"e2-standard-{n}"] = ("E2", n, Decimal(4 * n))
        shapes[f"e2-highmem-{n}"] = ("E2", n, Decimal(8 * n))
    for n in (2, 4, 8, 16, 32, 48, 64, 80):
        shapes[f"n2-standard-{n}"] = ("N2", n, Decimal(4 * n))
    for gpus in (1, 2, 4, 8):
        shapes[f"a2-highgpu-{gpus}g"] = ("A2", 12 * gpus, Decimal(85 * gpus))
        shapes[f"a2-ultragpu-{gpus}g"] = ("A2", 12 * gpus, Decimal(170 * gpus))
    shapes["a2-megagpu-16g"] = ("A2", 96, Decimal(1360))
    for n, mem in ((4, 16), (8, 32), (12, 48), (16, 64), (24, 96), (32, 128), (48, 192), (96, 384)):
        shapes[f"g2-standard-{n}"] = ("G2", n, Decimal(mem))
    shapes["a3-highgpu-8g"] = ("A3", 208, Decimal(1872))
    return shapes


GCP_MACHINE_SHAPES = _gcp_shapes()

# (pattern in the SKU description, Vertex AcceleratorType) — first match wins, so the longer names
# come first ("A100 80GB" before "A100", "H100 Mega" before "H100").
GCP_ACCELERATORS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.I), name) for pattern, name in (
        (r"\bH100 Mega\b", "NVIDIA_H100_MEGA_80GB"),
        (r"\bH100\b", "NVIDIA_H100_80GB"),
        (r"\bH200\b", "NVIDIA_H200_141GB"),
        (r"\bA100 80GB\b", "NVIDIA_A100_80GB"),
        (r"\bA100\b", "NVIDIA_TESLA_A100"),
        (r"\bL4\b", "NVIDIA_L4"),
        (r"\bT4\b", "NVIDIA_TESLA_T4"),
        (r"\bV100\b", "NVIDIA_TESLA_V100"),
        (r"\bP100\b", "NVIDIA_TESLA_P100"),
        (r"\bP4\b", "NVIDIA_TESLA_P4"),
        (r"\bK80\b", "NVIDIA_TESLA_K80"),
    ))
_GCP_COMPONENT = re.compile(r"\b([A-Z][0-9A-Z]{1,3})\s+(?:predefined\s+)?instance\s+(core|ram)\b", re.I)


def _gcp_unit_price(sku: dict[str, Any]) -> tuple[Decimal, str] | None:
    """``(USD per usage unit, usage unit)`` of a SKU's current price: the first pricingInfo's
    first-tier rate (``startUsageAmount`` 0), ``units + nanos / 1e9``."""
    infos = sku.get("pricingInfo") or []
    if not infos:
        return None
    expression = infos[0].get("pricingExpression") or {}
    rates = sorted(expression.get("tieredRates") or [], key=lambda r: float(r.get("startUsageAmount") or 0))
    if not rates:
        return None
    unit_price = rates[0].get("unitPrice") or {}
    if unit_price.get("currencyCode", "USD") != "USD":
        return None
    price = Decimal(str(unit_price.get("units") or 0)) + Decimal(int(unit_price.get("nanos") or 0)) / Decimal(10**9)
    return price, str(expression.get("usageUnit", ""))


def _gcp_capacity(sku: dict[str, Any], description: str) -> str | None:
    """``""`` for an on-demand SKU, :data:`SPOT_SUFFIX` for a Spot/Preemptible one (``category.usageType``
    Preemptible, or the description says Spot or Preemptible), None for other usage (commitments)."""
    usage = (sku.get("category") or {}).get("usageType", "OnDemand")
    if usage == "Preemptible" or re.search(r"\b(spot|preemptible)\b", description, re.I):
        return SPOT_SUFFIX
    return "" if usage == "OnDemand" else None


def parse_gcp_skus(skus: Iterable[dict[str, Any]], region: str, *, machine_types: Iterable[str] = (),
                   progress: Progress | None = None, today: dt.date | None = None) -> list[PriceRow]:
    """PriceRows for ``region`` from Vertex AI SKUs (``GET /v1/services/{id}/skus``, clouds.md §4.2).

    A SKU counts when its description names custom training ("Training"), it is not custom-machine,
    prediction or TPU, ``serviceRegions`` holds ``region`` and ``category.usageType`` is OnDemand or
    Preemptible (Spot VMs: that usage type, or "Spot"/"Preemptible" in the description). Spot SKUs
    give the same rows as on-demand ones under ``<name>:spot`` (:data:`SPOT_SUFFIX`), the rows the
    Vertex adapter prices spot jobs with:

    - "… on <family> Instance Core …" (per vCPU-hour) and "… Instance Ram …" (per GiB-hour), Vertex's
      management fee SKUs for the family included, give each machine type of ``machine_types``
      with a known shape (:data:`GCP_MACHINE_SHAPES`) a row: vCPUs × core price + GiB × RAM price;
    - a GPU SKU ("… Nvidia Tesla T4 GPU …", "… NVIDIA H100 80GB …") gives a row per GPU-hour under
      its ``AcceleratorType`` name (e.g. ``NVIDIA_TESLA_T4``), whatever ``machine_types`` says.

    Two prices for one component: the higher is kept, with a warning (estimates and budget stops
    should not under-count). A requested machine type whose shape or family prices are unknown is
    reported through ``progress`` and left out (for spot only when the family has some spot price).
    """
    today = today or dt.date.today()
    # (capacity suffix, family, "core"|"ram", management fee?) -> USD; (capacity suffix, name) -> USD
    components: dict[tuple[str, str, str, bool], Decimal] = {}
    accelerators: dict[tuple[str, str], Decimal] = {}
    for sku in skus:
        description = str(sku.get("description", ""))
        if region not in (sku.get("serviceRegions") or []) or "training" not in description.lower():
            continue
        capacity = _gcp_capacity(sku, description)
        if capacity is None or re.search(r"prediction|custom instance|tpu", description, re.I):
            continue
        priced = _gcp_unit_price(sku)
        if priced is None or priced[0] <= 0:
            continue
        price, unit = priced
        what = "spot " if capacity else ""
        if (match := _GCP_COMPONENT.search(description)) is not None:
            family, part = match.group(1).upper(), match.group(2).lower()
            if unit not in ("h", "GiBy.h"):
                continue
            fee = "management fee" in description.lower()
            key = (capacity, family, part, fee)
            if key in components and components[key] != price and progress:
                progress(f"  warning: {region} {what}{family} {part}{' fee' if fee else ''} is listed at "
                         f"${components[key]} and ${price}; keeping the higher")
            components[key] = max(price, components.get(key, price))
            continue
        accelerator = next((name for pattern, name in GCP_ACCELERATORS if pattern.search(description)), None)
        if accelerator is None or unit != "h":
            continue
        key2 = (capacity, accelerator)
        if key2 in accelerators and accelerators[key2] != price and progress:
            progress(f"  warning: {region} {what}{accelerator} is listed at ${accelerators[key2]} and ${price}; "
                     f"keeping the higher")
        accelerators[key2] = max(price, accelerators.get(key2, price))

    def family_price(capacity: str, family: str, part: str) -> Decimal | None:
        base = components.get((capacity, family, part, False))
        return None if base is None else base + components.get((capacity, family, part, True), Decimal(0))

    found = {name + capacity: _usd(price) for (capacity, name), price in accelerators.items()}
    spot_families = {family for (capacity, family, _, _) in components if capacity}
    for machine in machine_types:
        if machine in found or _looks_like_accelerator(machine):
            continue
        shape = GCP_MACHINE_SHAPES.get(machine)
        if shape is None:
            if progress:
                progress(f"  {region} {machine}: shape unknown to Trainboard; not priced (edit it in the admin)")
            continue
        family, vcpus, gib = shape
        for capacity in ("", SPOT_SUFFIX):
            core, ram = family_price(capacity, family, "core"), family_price(capacity, family, "ram")
            if core is None or ram is None:
                if progress and (not capacity or family in spot_families):
                    progress(f"  {region} {machine}: no {family} {'spot ' if capacity else ''}training core/RAM "
                             f"price in this region; not priced")
                continue
            found[machine + capacity] = _usd(vcpus * core + gib * ram)
    return [
        PriceRow(provider="gcp", region=region, instance_type=name, usd_per_hour=price, source=GCP_SOURCE,
                 as_of=today.isoformat(), confirmed=True)
        for name, price in sorted(found.items())
    ]


def _looks_like_accelerator(name: str) -> bool:
    return name.upper().startswith(("NVIDIA_", "TPU_"))


def gcp_billing_session(*, api_key: str = "") -> Any:
    """A requests session for the Cloud Billing Catalog API: with ``api_key``, a plain session that
    sends ``key=``; otherwise google.auth's AuthorizedSession over Application Default Credentials
    (``gcloud auth application-default login``, GOOGLE_APPLICATION_CREDENTIALS, the VM's service
    account). Tests replace this function or pass an API key."""
    import requests

    if api_key:
        session = requests.Session()
        session.params = {"key": api_key}
        return session
    try:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
        from google.auth.transport.requests import AuthorizedSession
    except ImportError as exc:  # pragma: no cover - google-auth is a runtime requirement
        raise PriceRefreshError(f"refreshing GCP prices needs google-auth ({exc}); install google-auth from "
                                f"requirements.txt (`pip install -r requirements.txt`), or pass --api-key.") from exc
    try:
        credentials, _ = google.auth.default(scopes=[GCP_SCOPE])
    except DefaultCredentialsError as exc:
        raise PriceRefreshError(
            f"Google credentials not found ({exc}). Run `gcloud auth application-default login`, set "
            f"GOOGLE_APPLICATION_CREDENTIALS to a service account key file, or pass --api-key with an API "
            f"key allowed to call the Cloud Billing API."
        ) from exc
    return AuthorizedSession(credentials)


def fetch_gcp(regions: list[str], *, progress: Progress, options: dict[str, Any]) -> list[PriceRow]:
    """Vertex AI custom-training prices of ``regions``: every page of ``GET
    /v1/services/C7E2-9256-1C43/skus?currencyCode=USD`` (``nextPageToken``), read once for all
    regions, then :func:`parse_gcp_skus` per region. Source: shared/reference/clouds.md §4.2."""
    from google.auth.exceptions import GoogleAuthError

    root = (options.get("endpoint_url") or GCP_ENDPOINT).rstrip("/")
    session = gcp_billing_session(api_key=options.get("api_key", ""))
    url = f"{root}/v1/services/{GCP_VERTEX_SERVICE_ID}/skus"
    api = "Cloud Billing Catalog API"
    progress(f"gcp: listing Vertex AI SKUs (service {GCP_VERTEX_SERVICE_ID}) ...")
    skus: list[dict[str, Any]] = []
    token, number = "", 0
    try:
        while True:
            params = {"currencyCode": "USD", **({"pageToken": token} if token else {})}
            page = _get_json(session, url, params=params, api=api, host="cloudbilling.googleapis.com")
            number += 1
            skus.extend(page.get("skus") or [])
            progress(f"gcp: page {number}, {plural(len(skus), 'SKU', 'SKUs')} so far")
            token = page.get("nextPageToken") or ""
            if not token:
                break
    except GoogleAuthError as exc:  # e.g. a refresh token that was revoked
        raise PriceRefreshError(f"Google credentials could not be used ({exc}); sign in again with "
                                f"`gcloud auth application-default login` or pass --api-key.") from exc
    finally:
        session.close()
    machine_types = sorted({t.removesuffix(SPOT_SUFFIX) for t in _requested_types(options)})
    rows: list[PriceRow] = []
    for region in regions:
        try:
            found = parse_gcp_skus(skus, region, machine_types=machine_types, progress=progress)
        except (ValueError, AttributeError, TypeError, ArithmeticError) as exc:
            raise PriceRefreshError(f"{api} answered something unexpected for {region}: {exc}") from exc
        spot = sum(1 for r in found if r.instance_type.endswith(SPOT_SUFFIX))
        machines = sum(1 for r in found if not _looks_like_accelerator(r.instance_type)
                       and not r.instance_type.endswith(SPOT_SUFFIX))
        progress(f"gcp {region}: {plural(machines, 'machine type', 'machine types')} and "
                 f"{plural(len(found) - machines - spot, 'accelerator', 'accelerators')} priced, "
                 f"{plural(spot, 'spot price', 'spot prices')}")
        rows.extend(found)
    return rows


# =============================================================================================
# Azure: the Retail Prices API, virtual machines (Azure ML compute is billed as its VMs)
# =============================================================================================

AZURE_SOURCE = "Azure Retail Prices API"
AZURE_ENDPOINT = "https://prices.azure.com/api/retail/prices"
AZURE_LOW_PRIORITY = ":low_priority"  # catalog suffix the Azure ML adapter looks up for tier low_priority


def azure_filter(region: str, vm_sizes: Iterable[str] = ()) -> str:
    """The OData ``$filter`` for Linux-or-Windows pay-as-you-go VM rows of ``region`` (values are
    case-sensitive since api-version 2023-01-01-preview, clouds.md §4.3), narrowed to ``vm_sizes``
    (``armSkuName``) when given."""
    clauses = ["serviceName eq 'Virtual Machines'", f"armRegionName eq '{_odata(region)}'",
               "priceType eq 'Consumption'"]
    sizes = list(vm_sizes)
    if sizes:
        clauses.append("(" + " or ".join(f"armSkuName eq '{_odata(s)}'" for s in sizes) + ")")
    return " and ".join(clauses)


def _odata(value: str) -> str:
    return str(value).replace("'", "''")


def parse_azure_items(items: Iterable[dict[str, Any]], region: str, *, progress: Progress | None = None,
                      today: dt.date | None = None) -> list[PriceRow]:
    """PriceRows from Retail Prices ``Items`` of ``region``: Linux (productName without "Windows"),
    ``type`` Consumption, hourly ("1 Hour"), USD rows. The regular meter is the VM size's row; a
    "Low Priority" meter is ``<size>:low_priority``, and where a size has none its "Spot" meter
    stands in (Azure ML's low-priority tier runs on the VMs' interruptible capacity). Rows of a
    non-primary meter region are used only when the primary is missing. Highest price kept on a
    clash, with a warning."""
    today = today or dt.date.today()
    found: dict[tuple[str, str], tuple[bool, Decimal]] = {}  # (size, meter kind) -> (primary, price)
    for item in items:
        size = str(item.get("armSkuName") or "")
        if not size or item.get("armRegionName") != region or item.get("type", "Consumption") != "Consumption":
            continue
        if "windows" in str(item.get("productName", "")).lower():
            continue
        if str(item.get("unitOfMeasure", "")).strip().lower() != "1 hour" or item.get("currencyCode", "USD") != "USD":
            continue
        try:
            price = Decimal(str(item.get("retailPrice", item.get("unitPrice"))))
        except InvalidOperation:
            continue
        if not price.is_finite() or price <= 0:
            continue
        names = f"{item.get('skuName', '')} {item.get('meterName', '')}".lower()
        kind = "low_priority" if "low priority" in names else "spot" if "spot" in names else "regular"
        primary = bool(item.get("isPrimaryMeterRegion", True))
        key = (size, kind)
        if key in found:
            old_primary, old = found[key]
            if old_primary and not primary:
                continue
            if old_primary == primary and old != price:
                if progress:
                    progress(f"  warning: {region} {size}{'' if kind == 'regular' else ' ' + kind} is listed at "
                             f"${old} and ${price}; keeping the higher")
                price = max(old, price)
        found[key] = (primary, price)
    prices: dict[str, Decimal] = {}
    for (size, kind), (_, price) in found.items():
        if kind == "regular":
            prices[size] = price
        elif kind == "low_priority" or (size, "low_priority") not in found:
            prices[size + AZURE_LOW_PRIORITY] = price
    return [
        PriceRow(provider="azure", region=region, instance_type=name, usd_per_hour=_usd(price), source=AZURE_SOURCE,
                 as_of=today.isoformat(), confirmed=True)
        for name, price in sorted(prices.items())
    ]


def fetch_azure(regions: list[str], *, progress: Progress, options: dict[str, Any]) -> list[PriceRow]:
    """Azure ML VM prices of ``regions`` from the Retail Prices API (no credentials): ``GET
    https://prices.azure.com/api/retail/prices?$filter=…`` (:func:`azure_filter`, narrowed to the
    VM sizes in ``options["instance_types"]`` when given), following ``NextPageLink`` to the end.
    Source: shared/reference/clouds.md §4.3."""
    import requests

    url = options.get("endpoint_url") or AZURE_ENDPOINT
    sizes = [s.removesuffix(AZURE_LOW_PRIORITY) for s in _requested_types(options)]
    sizes = list(dict.fromkeys(sizes))
    api = "Azure Retail Prices API"
    rows: list[PriceRow] = []
    with requests.Session() as session:
        for region in regions:
            scope = plural(len(sizes), "VM size", "VM sizes") if sizes else "every VM size"
            progress(f"azure {region}: Retail Prices, Virtual Machines, {scope} ...")
            items: list[dict[str, Any]] = []
            next_url, params, number = url, {"$filter": azure_filter(region, sizes)}, 0
            while next_url:
                page = _get_json(session, next_url, params=params, api=api, host="prices.azure.com")
                number += 1
                items.extend(page.get("Items") or [])
                progress(f"azure {region}: page {number}, {plural(len(items), 'price row', 'price rows')} so far")
                # NextPageLink is a complete URL carrying the filter and a $skip.
                next_url, params = page.get("NextPageLink") or "", None
            try:
                found = parse_azure_items(items, region, progress=progress)
            except (ValueError, AttributeError, TypeError) as exc:
                raise PriceRefreshError(f"{api} answered something unexpected for {region}: {exc}") from exc
            low = sum(1 for r in found if r.instance_type.endswith(AZURE_LOW_PRIORITY))
            progress(f"azure {region}: {plural(len(found) - low, 'VM size', 'VM sizes')} and "
                     f"{plural(low, 'low-priority price', 'low-priority prices')}")
            rows.extend(found)
    return rows


# =============================================================================================
# Registry
# =============================================================================================

FETCHERS: dict[str, Fetcher] = {
    "aws": fetch_aws,
    "gcp": fetch_gcp,
    "azure": fetch_azure,
}
"""provider → fetcher (the ``--provider`` values of ``manage.py refresh_prices`` that can be refreshed)."""

DEFAULT_REGIONS: dict[str, str] = {"aws": "us-east-1", "gcp": "us-central1", "azure": "eastus"}
"""The region priced when neither ``--region`` nor any catalog row names one."""


def fetch_prices(provider: str, regions: list[str], *, progress: Progress,
                 options: dict[str, Any] | None = None) -> list[PriceRow]:
    """Rows from ``provider``'s price API; PriceRefreshError for an unknown provider, a provider whose
    rows are internal rates (no price API: a refresh never touches them), or a failed fetch."""
    if provider in INTERNAL_RATE_PROVIDERS:
        raise PriceRefreshError(
            f"{provider} prices are internal rates that an admin sets for an own cluster; no price API has them, "
            f"so refresh_prices never changes them. Set them in the admin (Instance prices) or load them with "
            f"`manage.py load_prices --csv FILE`."
        )
    try:
        fetcher = FETCHERS[provider]
    except KeyError:
        raise PriceRefreshError(
            f"no price fetcher for provider {provider!r} yet (available: {', '.join(sorted(FETCHERS))}); "
            f"edit its prices in the admin."
        ) from None
    return fetcher(list(regions), progress=progress, options=dict(options or {}))
