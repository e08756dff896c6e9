"""``manage.py refresh_prices --provider gcp|azure`` against a local HTTP server in the test that
answers like the Cloud Billing Catalog API (Vertex AI SKUs, ``nextPageToken``) and the Azure Retail
Prices API (``$filter``, ``NextPageLink``): the stored rows and values, one transaction, the
requests sent (paths, filters, credentials), and clear errors."""

from __future__ import annotations

import datetime as dt
import io
import json
import threading
import types
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, urlsplit

import pytest
from django.core.management import CommandError, call_command

from cloud_adapters.pricing import PriceRow, StaticPriceCatalog
from jobs import price_refresh, pricing
from jobs.models import InstancePrice

pytestmark = pytest.mark.django_db

TODAY = dt.date.today()
"""The date the refreshes in this file store as ``as_of``: :func:`_today_is_pinned` holds the refresh's
clock to it, so a run that crosses midnight stores the date the expectations were written with."""


class _PinnedDate(dt.date):
    @classmethod
    def today(cls) -> dt.date:
        return TODAY


@pytest.fixture(autouse=True)
def _today_is_pinned(monkeypatch):
    """jobs/price_refresh.py reads ``dt.date.today()`` when no ``today`` is passed (the command passes
    none); here that ``dt`` is the datetime module with ``date.today`` pinned to :data:`TODAY`."""
    module = types.ModuleType("datetime_pinned")
    module.__dict__.update(vars(dt))
    module.date = _PinnedDate
    monkeypatch.setattr(price_refresh, "dt", module)


# --- a local price API -------------------------------------------------------------------------


class PriceServer:
    """An http.server on 127.0.0.1 in a thread. ``answer(path, query, headers) -> (status, body)``;
    every request is recorded as ``(path, query, headers)``."""

    def __init__(self, answer: Callable[[str, dict, dict], tuple[int, object]]):
        self.requests: list[tuple[str, dict[str, list[str]], dict[str, str]]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                parts = urlsplit(self.path)
                query = parse_qs(parts.query, keep_blank_values=True)
                headers = {k.lower(): v for k, v in self.headers.items()}
                server.requests.append((parts.path, query, headers))
                status, body = answer(parts.path, query, headers)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(answer):
        servers.append(PriceServer(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def shipped(monkeypatch):
    """Replace the shipped catalog under DatabasePriceCatalog with these rows (so the test does not
    depend on what the adapters ship) and return a setter."""
    def set_rows(*rows: PriceRow):
        monkeypatch.setattr(pricing, "shipped_catalog", lambda: StaticPriceCatalog(rows))

    set_rows()
    return set_rows


def run(*args) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("refresh_prices", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def stored(provider: str) -> dict[tuple[str, str], tuple]:
    return {(p.region, p.instance_type): (p.usd_per_hour, p.source, p.as_of, p.confirmed)
            for p in InstancePrice.objects.filter(provider=provider)}


# --- GCP: Cloud Billing Catalog, Vertex AI -------------------------------------------------------

VERTEX = "C7E2-9256-1C43"
SKUS_PATH = f"/v1/services/{VERTEX}/skus"


def sku(sku_id: str, description: str, units: str, nanos: int, *, unit: str = "h",
        regions=("us-central1",), usage: str = "OnDemand", group: str = "N1Standard",
        tiers: list | None = None) -> dict:
    """One SKU as ``GET /v1/services/{id}/skus`` returns it (fields of the v1 Sku resource)."""
    unit_description = {"h": "hour", "GiBy.h": "gibibyte hour"}[unit]
    return {
        "name": f"services/{VERTEX}/skus/{sku_id}",
        "skuId": sku_id,
        "description": description,
        "category": {"serviceDisplayName": "Vertex AI", "resourceFamily": "Compute", "resourceGroup": group,
                     "usageType": usage},
        "serviceRegions": list(regions),
        "pricingInfo": [{
            "summary": "",
            "pricingExpression": {
                "usageUnit": unit, "displayQuantity": 1, "usageUnitDescription": unit_description,
                "baseUnit": "s" if unit == "h" else "By.s", "baseUnitDescription": "second",
                "baseUnitConversionFactor": 3600 if unit == "h" else 3865470566400,
                "tieredRates": tiers or [{"startUsageAmount": 0,
                                          "unitPrice": {"currencyCode": "USD", "units": units, "nanos": nanos}}],
            },
            "currencyConversionRate": 1,
            "effectiveTime": "2026-11-28T08:12:04.512Z",
        }],
        "serviceProviderName": "Google",
        "geoTaxonomy": {"type": "REGIONAL", "regions": list(regions)},
    }


PAGE_1 = [
    sku("A1B2-0001-0001", "Vertex AI: Training/Pipelines on N1 Predefined Instance Core running in Americas",
        "0", 36461100),
    sku("A1B2-0001-0002", "Vertex AI: Training/Pipelines on N1 Predefined Instance Ram running in Americas",
        "0", 4889700, unit="GiBy.h"),
    sku("A1B2-0001-0003", "Vertex AI: Training/Pipelines on Nvidia Tesla T4 GPU running in Americas", "0", 402500000,
        group="GPU"),
    # Spot capacity (usage type Preemptible, or "Spot" in the description) gives the :spot rows.
    sku("A1B2-0001-0004", "Vertex AI: Training/Pipelines on Nvidia Tesla T4 GPU running in Americas", "0", 140000000,
        group="GPU", usage="Preemptible"),
    sku("A1B2-0001-0006", "Vertex AI: Training/Pipelines on Spot Preemptible N1 Predefined Instance Core running in "
        "Americas", "0", 7200000),
    sku("A1B2-0001-0007", "Vertex AI: Training/Pipelines on N1 Predefined Instance Ram running in Americas", "0",
        970000, unit="GiBy.h", usage="Preemptible"),
    # Prediction is another price: skipped.
    sku("A1B2-0001-0005", "Vertex AI: Online/Batch Prediction N1 Predefined Instance Core running in Americas",
        "0", 31600000),
]
PAGE_2 = [
    sku("A1B2-0002-0001", "Vertex AI: Training/Pipelines on E2 Instance Core running in Americas", "0", 26100000,
        group="E2"),
    sku("A1B2-0002-0002", "Vertex AI: Training/Pipelines Management fee on E2 Instance Core in Americas", "0",
        3900000, group="E2"),
    sku("A1B2-0002-0003", "Vertex AI: Training/Pipelines on E2 Instance Ram running in Americas", "0", 3500000,
        unit="GiBy.h", group="E2"),
    sku("A1B2-0002-0004", "Vertex AI: Training/Pipelines Management fee on E2 Instance RAM in Americas", "0",
        500000, unit="GiBy.h", group="E2"),
    sku("A1B2-0002-0005", "Vertex AI: Training/Pipelines on NVIDIA H100 80GB in Iowa", "11", 266033200,
        group="GPU"),
    sku("A1B2-0002-0006", "Vertex AI: Training/Pipelines on Nvidia Tesla A100 80GB GPU running in Americas", "3",
        930000000, group="GPU"),
    # Tiered: the first tier (from 0) is the list price.
    sku("A1B2-0002-0007", "Vertex AI: Training/Pipelines on Nvidia Tesla V100 GPU running in Americas", "0", 0,
        group="GPU", tiers=[
            {"startUsageAmount": 1000, "unitPrice": {"currencyCode": "USD", "units": "2", "nanos": 0}},
            {"startUsageAmount": 0, "unitPrice": {"currencyCode": "USD", "units": "2", "nanos": 852000000}}]),
    # Another region only.
    sku("A1B2-0002-0008", "Vertex AI: Training/Pipelines on Nvidia L4 GPU running in Netherlands", "0", 644000000,
        regions=("europe-west4",), group="GPU"),
]


def billing_api(key: str | None = None, fail_page_2: bool = False):
    def answer(path, query, headers):
        assert path == SKUS_PATH, path
        assert query["currencyCode"] == ["USD"]
        if key is not None:
            assert query["key"] == [key]
        if query.get("pageToken") == ["page-2"]:
            if fail_page_2:
                return 403, {"error": {"code": 403, "status": "PERMISSION_DENIED",
                                       "message": "Cloud Billing API has not been used in project 1234 before or "
                                                  "it is disabled."}}
            return 200, {"skus": PAGE_2, "nextPageToken": ""}
        return 200, {"skus": PAGE_1, "nextPageToken": "page-2"}
    return answer


def test_gcp_refresh_stores_machine_types_and_accelerators(serve, shipped):
    shipped(PriceRow("gcp", "us-central1", "n1-standard-8", Decimal("0.437"), "clouds.md §4.5", "2026-10-07"),
            PriceRow("gcp", "us-central1", "NVIDIA_TESLA_T4", Decimal("0.4025"), "code comment", "2026-10-07"))
    server = serve(billing_api(key="test-key"))

    out, err = run("--provider", "gcp", "--region", "us-central1", "--endpoint-url", server.url,
                   "--api-key", "test-key", "--instance-type", "e2-standard-4", "--instance-type", "a2-highgpu-1g",
                   "--instance-type", "x9-mystery-2")

    source = "Cloud Billing Catalog API (Vertex AI)"
    assert stored("gcp") == {
        # 8 vCPU × $0.0364611 + 30 GiB × $0.0048897
        ("us-central1", "n1-standard-8"): (Decimal("0.438380"), source, TODAY, True),
        # 4 × ($0.0261 + $0.0039 fee) + 16 GiB × ($0.0035 + $0.0005 fee)
        ("us-central1", "e2-standard-4"): (Decimal("0.184000"), source, TODAY, True),
        ("us-central1", "NVIDIA_TESLA_T4"): (Decimal("0.402500"), source, TODAY, True),
        ("us-central1", "NVIDIA_H100_80GB"): (Decimal("11.266033"), source, TODAY, True),
        ("us-central1", "NVIDIA_A100_80GB"): (Decimal("3.930000"), source, TODAY, True),
        ("us-central1", "NVIDIA_TESLA_V100"): (Decimal("2.852000"), source, TODAY, True),
        # Spot: 8 vCPU × $0.0072 + 30 GiB × $0.00097; the T4's Preemptible SKU. E2 has no spot price here.
        ("us-central1", "n1-standard-8:spot"): (Decimal("0.086700"), source, TODAY, True),
        ("us-central1", "NVIDIA_TESLA_T4:spot"): (Decimal("0.140000"), source, TODAY, True),
    }
    assert [(p, q.get("pageToken")) for p, q, _ in server.requests] == [(SKUS_PATH, None), (SKUS_PATH, ["page-2"])]
    assert out.strip() == "gcp prices for us-central1: 8 added, 0 updated, 0 unchanged."
    assert err.splitlines() == [
        f"gcp: listing Vertex AI SKUs (service {VERTEX}) ...",
        "gcp: page 1, 7 SKUs so far",
        "gcp: page 2, 15 SKUs so far",
        "  us-central1 a2-highgpu-1g: no A2 training core/RAM price in this region; not priced",
        "  us-central1 x9-mystery-2: shape unknown to Trainboard; not priced (edit it in the admin)",
        "gcp us-central1: 2 machine types and 4 accelerators priced, 2 spot prices",
    ]


def test_gcp_uses_application_default_credentials(serve, shipped, monkeypatch):
    import google.auth
    from google.oauth2.credentials import Credentials

    asked = []

    def fake_default(scopes=None, **kwargs):
        asked.append(scopes)
        return Credentials(token="ya29.test-token"), "my-project"

    monkeypatch.setattr(google.auth, "default", fake_default)
    server = serve(billing_api())
    run("--provider", "gcp", "--region", "us-central1", "--endpoint-url", server.url, "--dry-run")
    assert asked == [["https://www.googleapis.com/auth/cloud-platform"]]
    assert [h.get("authorization") for _, _, h in server.requests] == ["Bearer ya29.test-token"] * 2
    assert all("key" not in q for _, q, _ in server.requests)


def test_gcp_dry_run_shows_changes_and_writes_nothing(serve, shipped):
    InstancePrice.objects.create(provider="gcp", region="us-central1", instance_type="NVIDIA_TESLA_T4",
                                 usd_per_hour=Decimal("0.35"))
    server = serve(billing_api(key="k"))
    out, _ = run("--provider", "gcp", "--endpoint-url", server.url, "--api-key", "k", "--dry-run")
    assert out.splitlines() == [
        "gcp us-central1 NVIDIA_A100_80GB: $3.93/h (new)",
        "gcp us-central1 NVIDIA_H100_80GB: $11.266033/h (new)",
        "gcp us-central1 NVIDIA_TESLA_T4: $0.4025/h (was $0.35)",
        "gcp us-central1 NVIDIA_TESLA_T4:spot: $0.14/h (new)",
        "gcp us-central1 NVIDIA_TESLA_V100: $2.852/h (new)",
        "Dry run: 5 prices fetched, nothing written.",
    ]
    assert stored("gcp") == {("us-central1", "NVIDIA_TESLA_T4"): (Decimal("0.35"), "", None, False)}


def test_gcp_refused_page_changes_nothing(serve, shipped):
    InstancePrice.objects.create(provider="gcp", region="us-central1", instance_type="NVIDIA_TESLA_T4",
                                 usd_per_hour=Decimal("0.35"))
    server = serve(billing_api(key="k", fail_page_2=True))
    with pytest.raises(CommandError) as caught:
        run("--provider", "gcp", "--region", "us-central1", "--endpoint-url", server.url, "--api-key", "k")
    assert str(caught.value) == (
        "The Cloud Billing Catalog API refused the request (HTTP 403: PERMISSION_DENIED: Cloud Billing API has "
        "not been used in project 1234 before or it is disabled.); check the credentials and that the Cloud "
        "Billing API is enabled for their project. No price was changed.")
    assert stored("gcp") == {("us-central1", "NVIDIA_TESLA_T4"): (Decimal("0.35"), "", None, False)}


def test_gcp_without_credentials_is_a_clear_error(monkeypatch, tmp_path, shipped):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(CommandError) as caught:
        run("--provider", "gcp", "--region", "us-central1", "--endpoint-url", "http://127.0.0.1:9")
    message = str(caught.value)
    assert message.startswith(f"Google credentials not found (File {tmp_path / 'missing.json'} was not found.")
    assert "gcloud auth application-default login" in message and "--api-key" in message
    assert message.endswith("No price was changed.")
    assert not InstancePrice.objects.exists()


def test_gcp_without_network_is_a_clear_error(shipped):
    # A closed local port stands in for a machine without network: the connection is refused.
    with pytest.raises(CommandError) as caught:
        run("--provider", "gcp", "--region", "us-central1", "--endpoint-url", "http://127.0.0.1:9", "--api-key", "k")
    message = str(caught.value)
    assert message.startswith("Cannot reach the Cloud Billing Catalog API (ConnectionError: ")
    assert message.endswith("This machine needs network access to cloudbilling.googleapis.com. No price was changed.")
    assert not InstancePrice.objects.exists()


def test_gcp_parser_prices_the_first_tier_and_keeps_the_higher_of_two():
    warnings = []
    skus = [*PAGE_1, *PAGE_2,
            sku("DUP", "Vertex AI: Training/Pipelines on Nvidia Tesla T4 GPU running in Americas", "0", 410000000)]
    rows = price_refresh.parse_gcp_skus(skus, "europe-west4", machine_types=["n1-standard-8"],
                                        progress=warnings.append, today=dt.date(2026, 11, 29))
    assert [(r.instance_type, r.usd_per_hour, r.as_of) for r in rows] == [("NVIDIA_L4", Decimal("0.644000"),
                                                                           "2026-11-29")]
    assert warnings == ["  europe-west4 n1-standard-8: no N1 training core/RAM price in this region; not priced"]
    warnings.clear()
    rows = price_refresh.parse_gcp_skus(skus, "us-central1", progress=warnings.append)
    assert {r.instance_type: r.usd_per_hour for r in rows}["NVIDIA_TESLA_T4"] == Decimal("0.41")
    assert warnings == ["  warning: us-central1 NVIDIA_TESLA_T4 is listed at $0.4025 and $0.41; keeping the higher"]


# --- Azure: Retail Prices ------------------------------------------------------------------------


def item(size: str, meter: str, price: float, *, product: str = "Virtual Machines NCSv3 Series",
         region: str = "eastus", primary: bool = True, unit: str = "1 Hour") -> dict:
    """One ``Items[]`` entry as the Retail Prices API returns it."""
    return {
        "currencyCode": "USD", "tierMinimumUnits": 0.0, "retailPrice": price, "unitPrice": price,
        "armRegionName": region, "location": "US East", "effectiveStartDate": "2024-03-01T00:00:00Z",
        "meterId": f"meter-{size}-{meter}".replace(" ", "-"), "meterName": meter,
        "productId": "DZH318Z0BQ4W", "skuId": "DZH318Z0BQ4W/00VM", "productName": product, "skuName": meter,
        "serviceName": "Virtual Machines", "serviceId": "DZH313Z7MMC8", "serviceFamily": "Compute",
        "unitOfMeasure": unit, "type": "Consumption", "isPrimaryMeterRegion": primary, "armSkuName": size,
    }


AZURE_PAGE_1 = [
    item("Standard_NC6s_v3", "NC6s v3", 3.06),
    item("Standard_NC6s_v3", "NC6s v3 Low Priority", 0.612),
    item("Standard_NC6s_v3", "NC6s v3 Spot", 0.3366),  # low priority is listed: the spot row is not used
    item("Standard_NC6s_v3", "NC6s v3", 3.428, product="Virtual Machines NCSv3 Series Windows"),  # Windows
    item("Standard_NC4as_T4_v3", "NC4as T4 v3", 0.526, product="Virtual Machines NCasT4_v3 Series"),
]
AZURE_PAGE_2 = [
    item("Standard_NC4as_T4_v3", "NC4as T4 v3 Spot", 0.2104, product="Virtual Machines NCasT4_v3 Series"),
    item("Standard_NC24ads_A100_v4", "NC24ads A100 v4", 3.673, product="Virtual Machines NCadsA100v4 Series"),
    item("Standard_NC24ads_A100_v4", "NC24ads A100 v4", 3.8, product="Virtual Machines NCadsA100v4 Series",
         primary=False),  # a non-primary meter region of the same price: the primary wins
]
FILTER = ("serviceName eq 'Virtual Machines' and armRegionName eq 'eastus' and priceType eq 'Consumption' and "
          "(armSkuName eq 'Standard_NC24ads_A100_v4' or armSkuName eq 'Standard_NC4as_T4_v3' or "
          "armSkuName eq 'Standard_NC6s_v3')")


def retail_api(fail: bool = False):
    def answer(path, query, headers):
        assert path == "/api/retail/prices", path
        assert "authorization" not in headers  # the API is unauthenticated
        if query.get("$skip") == ["100"]:
            if fail:
                return 429, {"Error": {"Code": "TooManyRequests", "Message": "Rate limit exceeded."}}
            return 200, {"BillingCurrency": "USD", "CustomerEntityId": "Default", "CustomerEntityType": "Retail",
                         "Items": AZURE_PAGE_2, "NextPageLink": None, "Count": len(AZURE_PAGE_2)}
        server_url = f"http://{headers['host']}"
        link = f"{server_url}/api/retail/prices?$filter={query['$filter'][0]}&$skip=100"
        return 200, {"BillingCurrency": "USD", "CustomerEntityId": "Default", "CustomerEntityType": "Retail",
                     "Items": AZURE_PAGE_1, "NextPageLink": link, "Count": len(AZURE_PAGE_1)}
    return answer


def test_azure_refresh_stores_vm_and_low_priority_prices(serve, shipped):
    shipped(PriceRow("azure", "eastus", "Standard_NC6s_v3", Decimal("3.06"), "third-party", "2026-11-29"),
            PriceRow("azure", "eastus", "Standard_NC6s_v3:low_priority", Decimal("0.6"), "third-party", "2026-11-29"))
    InstancePrice.objects.create(provider="azure", region="eastus", instance_type="Standard_NC4as_T4_v3",
                                 usd_per_hour=Decimal("0.526"))
    server = serve(retail_api())

    out, err = run("--provider", "azure", "--region", "eastus", "--endpoint-url", f"{server.url}/api/retail/prices",
                   "--instance-type", "Standard_NC24ads_A100_v4")

    source = "Azure Retail Prices API"
    assert stored("azure") == {
        ("eastus", "Standard_NC6s_v3"): (Decimal("3.06"), source, TODAY, True),
        ("eastus", "Standard_NC6s_v3:low_priority"): (Decimal("0.612"), source, TODAY, True),
        ("eastus", "Standard_NC4as_T4_v3"): (Decimal("0.526"), source, TODAY, True),
        ("eastus", "Standard_NC4as_T4_v3:low_priority"): (Decimal("0.2104"), source, TODAY, True),  # from spot
        ("eastus", "Standard_NC24ads_A100_v4"): (Decimal("3.673"), source, TODAY, True),
    }
    assert [q for _, q, _ in server.requests] == [{"$filter": [FILTER]}, {"$filter": [FILTER], "$skip": ["100"]}]
    assert out.strip() == "azure prices for eastus: 4 added, 1 updated, 0 unchanged."
    assert err.splitlines() == [
        "azure eastus: Retail Prices, Virtual Machines, 3 VM sizes ...",
        "azure eastus: page 1, 5 price rows so far",
        "azure eastus: page 2, 8 price rows so far",
        "azure eastus: 3 VM sizes and 2 low-priority prices",
    ]


def test_azure_dry_run_writes_nothing(serve, shipped):
    shipped(PriceRow("azure", "eastus", "Standard_NC6s_v3", Decimal("3.06")))
    server = serve(retail_api())
    out, _ = run("--provider", "azure", "--endpoint-url", f"{server.url}/api/retail/prices", "--dry-run")
    assert out.splitlines() == [
        "azure eastus Standard_NC24ads_A100_v4: $3.673/h (new)",
        "azure eastus Standard_NC4as_T4_v3: $0.526/h (new)",
        "azure eastus Standard_NC4as_T4_v3:low_priority: $0.2104/h (new)",
        "azure eastus Standard_NC6s_v3: $3.06/h (unchanged)",
        "azure eastus Standard_NC6s_v3:low_priority: $0.612/h (new)",
        "Dry run: 5 prices fetched, nothing written.",
    ]
    assert server.requests[0][1]["$filter"] == [
        "serviceName eq 'Virtual Machines' and armRegionName eq 'eastus' and priceType eq 'Consumption' and "
        "(armSkuName eq 'Standard_NC6s_v3')"]
    assert not InstancePrice.objects.exists()


def test_azure_error_on_a_later_page_changes_nothing(serve, shipped):
    server = serve(retail_api(fail=True))
    with pytest.raises(CommandError) as caught:
        run("--provider", "azure", "--region", "eastus", "--endpoint-url", f"{server.url}/api/retail/prices",
            "--instance-type", "Standard_NC6s_v3")
    assert str(caught.value) == (
        "The Azure Retail Prices API refused the request (HTTP 429: TooManyRequests: Rate limit exceeded.); the "
        "API is rate-limiting this machine; try again in a minute. No price was changed.")
    assert not InstancePrice.objects.exists()


def test_azure_without_network_is_a_clear_error(shipped):
    with pytest.raises(CommandError) as caught:
        run("--provider", "azure", "--region", "eastus", "--endpoint-url", "http://127.0.0.1:9/api/retail/prices")
    message = str(caught.value)
    assert message.startswith("Cannot reach the Azure Retail Prices API (ConnectionError: ")
    assert "network access to prices.azure.com" in message and message.endswith("No price was changed.")


def test_azure_region_with_no_prices_says_so(serve, shipped):
    server = serve(lambda path, query, headers: (200, {"Items": [], "NextPageLink": None, "Count": 0}))
    with pytest.raises(CommandError) as caught:
        run("--provider", "azure", "--region", "east-us", "--endpoint-url", f"{server.url}/api/retail/prices")
    assert str(caught.value) == ("The azure price API returned no prices for east-us; check the region codes. "
                                 "No price was changed.")
    # No size known and none asked for: every VM size of the region is asked for.
    assert server.requests[0][1]["$filter"] == [
        "serviceName eq 'Virtual Machines' and armRegionName eq 'east-us' and priceType eq 'Consumption'"]


def test_help_names_the_three_price_apis():
    from jobs.management.commands.refresh_prices import Command

    text = " ".join(Command().create_parser("manage.py", "refresh_prices").format_help().split())
    for phrase in ("Cloud Billing Catalog API", "Azure Retail Prices API", "--api-key", "--instance-type TYPE",
                   "<size>:low_priority", "Application Default Credentials", "--endpoint-url"):
        assert phrase in text, phrase
    assert sorted(price_refresh.FETCHERS) == ["aws", "azure", "gcp"]
