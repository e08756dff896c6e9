"""``manage.py refresh_prices --provider aws``: GetProducts answers scripted with botocore's Stubber
on a real boto3 ``pricing`` client (moto has no pricing backend), the rows stored, one transaction,
and clear errors without credentials or network."""

from __future__ import annotations

import datetime as dt
import io
import json
from decimal import Decimal

import boto3
import pytest
from botocore.stub import Stubber
from django.core.management import CommandError, call_command

from jobs import price_refresh, services
from jobs.management.commands.refresh_prices import Command as RefreshPrices
from jobs.models import InstancePrice

pytestmark = pytest.mark.django_db

LOCATIONS = {"us-east-1": ("US East (N. Virginia)", "USE1"), "eu-west-1": ("EU (Ireland)", "EU")}


def product(instance: str, usd: str, *, region: str = "us-east-1", component: str = "Training",
            usagetype: str | None = None, sku: str = "7KQ3PVX2ZWJ6B5WD", unit: str = "Hrs") -> str:
    """One PriceList item as the API sends it: a JSON string (shape of public GetProducts answers)."""
    location, code = LOCATIONS[region]
    term, rate = f"{sku}.JRTCKXETXF", f"{sku}.JRTCKXETXF.6YS6EN2CT7"
    return json.dumps({
        "product": {
            "productFamily": "ML Instance",
            "attributes": {
                "regionCode": region, "servicecode": "AmazonSageMaker", "location": location,
                "locationType": "AWS Region", "instanceName": instance, "component": component,
                "usagetype": usagetype or f"{code}-Train:{instance}", "operation": "RunInstance",
                "vCpu": "4", "memory": "16 GiB", "servicename": "Amazon SageMaker",
            },
            "sku": sku,
        },
        "serviceCode": "AmazonSageMaker",
        "terms": {"OnDemand": {term: {
            "priceDimensions": {rate: {
                "unit": unit, "endRange": "Inf", "beginRange": "0", "appliesTo": [], "rateCode": rate,
                "description": f"${usd} per On Demand {instance} Training instance hour",
                "pricePerUnit": {"USD": usd},
            }},
            "sku": sku, "effectiveDate": "2026-11-01T00:00:00Z", "offerTermCode": "JRTCKXETXF",
            "termAttributes": {},
        }}},
        "version": "20261101000000",
        "publicationDate": "2026-11-01T00:00:00Z",
    })


def expected(region: str, token: str | None = None) -> dict:
    params = {
        "ServiceCode": "AmazonSageMaker", "FormatVersion": "aws_v1",
        "Filters": [{"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
                    {"Type": "TERM_MATCH", "Field": "component", "Value": "Training"}],
    }
    if token:
        params["NextToken"] = token
    return params


@pytest.fixture
def pricing(monkeypatch):
    """A real boto3 pricing client wrapped in a Stubber, handed to the command."""
    client = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="AKIDTEST",
                          aws_secret_access_key="secret-test")
    stubber = Stubber(client)
    asked = []

    def fake_client(*, profile="", endpoint_url=""):
        asked.append({"profile": profile, "endpoint_url": endpoint_url})
        return client

    monkeypatch.setattr(price_refresh, "aws_pricing_client", fake_client)
    with stubber:
        yield stubber, asked


@pytest.fixture
def seeded():
    services.instance_price_seed()
    return {p.instance_type: p.usd_per_hour for p in InstancePrice.objects.all()}


def run(*args) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("refresh_prices", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_refresh_stores_confirmed_prices_for_each_region(pricing, seeded):
    stubber, asked = pricing
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "NextToken": "page-2", "PriceList": [
        product("ml.g5.xlarge", "1.4080000000"),
        product("ml.g5.xlarge", "0.4224000000", usagetype="USE1-Train-Spot:ml.g5.xlarge"),  # skipped
    ]}, expected("us-east-1"))
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
        product("ml.m5.xlarge", "0.2300000000", sku="QW4F3D7B9K2M8N5P"),
        product("ml.g5.xlarge", "1.4100000000", component="Hosting Instance", sku="HST1"),  # not training
        product("ml.p3.2xlarge", "0.0000000000", sku="ZERO"),  # no positive price: skipped
    ]}, expected("us-east-1", "page-2"))
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
        product("ml.g5.xlarge", "1.5740000000", region="eu-west-1", sku="EUW1G5X"),
    ]}, expected("eu-west-1"))

    out, err = run("--provider", "aws", "--region", "us-east-1", "--region", "eu-west-1", "--profile", "prices")

    stubber.assert_no_pending_responses()
    assert asked == [{"profile": "prices", "endpoint_url": ""}]
    today = dt.date.today()
    rows = {(p.region, p.instance_type): p for p in InstancePrice.objects.all()}
    for key, usd in {("us-east-1", "ml.g5.xlarge"): "1.408", ("us-east-1", "ml.m5.xlarge"): "0.23",
                     ("eu-west-1", "ml.g5.xlarge"): "1.574"}.items():
        row = rows[key]
        assert (row.usd_per_hour, row.source, row.as_of, row.confirmed) == (
            Decimal(usd), "AWS Price List API", today, True), key
    # Rows the API did not price are left as they were (shipped, unconfirmed).
    assert (rows[("us-east-1", "ml.p3.2xlarge")].usd_per_hour, rows[("us-east-1", "ml.p3.2xlarge")].confirmed) == (
        Decimal("3.825"), False)
    assert len(rows) == len(seeded) + 1
    assert out.strip() == "aws prices for us-east-1, eu-west-1: 1 added, 2 updated, 0 unchanged."
    assert err.splitlines() == [
        "aws us-east-1: GetProducts AmazonSageMaker component=Training ...",
        "aws us-east-1: page 1, 2 products so far",
        "aws us-east-1: page 2, 5 products so far",
        "aws us-east-1: 2 training instance types priced",
        "aws eu-west-1: GetProducts AmazonSageMaker component=Training ...",
        "aws eu-west-1: page 1, 1 product so far",
        "aws eu-west-1: 1 training instance type priced",
    ]


def test_without_regions_the_catalog_regions_are_refreshed(pricing, seeded):
    stubber, _ = pricing
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
        product("ml.g5.xlarge", "1.4084000000")]}, expected("us-east-1"))
    out, _ = run("--provider", "aws")
    stubber.assert_no_pending_responses()
    assert out.strip() == "aws prices for us-east-1: 0 added, 1 updated, 0 unchanged."  # now confirmed
    row = InstancePrice.objects.get(region="us-east-1", instance_type="ml.g5.xlarge")
    assert (row.usd_per_hour, row.confirmed) == (Decimal("1.4084"), True)
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
        product("ml.g5.xlarge", "1.4084000000")]}, expected("us-east-1"))
    assert run("--provider", "aws")[0].strip() == "aws prices for us-east-1: 0 added, 0 updated, 1 unchanged."


def test_dry_run_shows_changes_and_writes_nothing(pricing, seeded):
    stubber, _ = pricing
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
        product("ml.g5.xlarge", "1.4080000000"), product("ml.trn1.2xlarge", "1.3438000000", sku="TRN1")]},
        expected("us-east-1"))
    out, _ = run("--provider", "aws", "--region", "us-east-1", "--dry-run")
    assert out.splitlines() == [
        "aws us-east-1 ml.g5.xlarge: $1.408/h (was $1.4084)",
        "aws us-east-1 ml.trn1.2xlarge: $1.3438/h (new)",
        "Dry run: 2 prices fetched, nothing written.",
    ]
    assert {p.instance_type: p.usd_per_hour for p in InstancePrice.objects.all()} == seeded
    assert not InstancePrice.objects.filter(confirmed=True).exists()


def test_a_refused_call_half_way_changes_nothing(pricing, seeded):
    stubber, _ = pricing
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
        product("ml.g5.xlarge", "1.4080000000")]}, expected("us-east-1"))
    stubber.add_client_error("get_products", service_error_code="AccessDeniedException",
                             service_message="User is not authorized to perform: pricing:GetProducts",
                             http_status_code=400, expected_params=expected("eu-west-1"))
    with pytest.raises(CommandError) as caught:
        run("--provider", "aws", "--region", "us-east-1", "--region", "eu-west-1")
    assert str(caught.value) == (
        "AWS Price List API refused the request (AccessDeniedException: User is not authorized to perform: "
        "pricing:GetProducts); grant the identity pricing:GetProducts. No price was changed.")
    assert {p.instance_type: p.usd_per_hour for p in InstancePrice.objects.all()} == seeded
    assert not InstancePrice.objects.filter(confirmed=True).exists()


def test_no_credentials_is_a_clear_error(monkeypatch, tmp_path, seeded):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(CommandError) as caught:
        run("--provider", "aws", "--region", "us-east-1")
    message = str(caught.value)
    assert message.startswith("AWS credentials not found (Unable to locate credentials).")
    assert "--profile" in message and message.endswith("No price was changed.")
    assert {p.instance_type: p.usd_per_hour for p in InstancePrice.objects.all()} == seeded


def test_no_network_is_a_clear_error(monkeypatch, seeded):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-test")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    # A closed local port stands in for a machine without network: the connection is refused.
    with pytest.raises(CommandError) as caught:
        run("--provider", "aws", "--region", "us-east-1", "--endpoint-url", "http://127.0.0.1:9")
    message = str(caught.value)
    assert message.startswith("Cannot reach the AWS Price List API (Could not connect to the endpoint URL")
    assert "api.pricing.us-east-1.amazonaws.com" in message and message.endswith("No price was changed.")
    assert {p.instance_type: p.usd_per_hour for p in InstancePrice.objects.all()} == seeded


def test_provider_without_a_fetcher_says_so():
    with pytest.raises(price_refresh.PriceRefreshError) as caught:
        price_refresh.fetch_prices("oracle", ["us-ashburn-1"], progress=print)
    assert str(caught.value) == ("no price fetcher for provider 'oracle' yet (available: aws, azure, gcp); edit its "
                                 "prices in the admin.")


def test_internal_rates_are_never_refreshed(pricing, seeded):
    rate = services.instance_price_save(provider="slurm", region="hpc1", instance_type="gpu", usd_per_hour="1.50",
                                        usd_per_gpu_hour="0.85")
    before = InstancePrice.objects.filter(pk=rate.pk).values().get()
    stubber, _ = pricing
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
        product("ml.g5.xlarge", "1.4080000000")]}, expected("us-east-1"))

    assert run("--provider", "aws")[0].strip() == "aws prices for us-east-1: 0 added, 1 updated, 0 unchanged."
    with pytest.raises(CommandError, match="invalid choice: 'slurm'"):
        run("--provider", "slurm")
    with pytest.raises(price_refresh.PriceRefreshError, match="kubernetes prices are internal rates .* never changes them"):
        price_refresh.fetch_prices("kubernetes", ["prod"], progress=print)

    assert InstancePrice.objects.filter(pk=rate.pk).values().get() == before


def test_help_explains_the_command():
    text = RefreshPrices().create_parser("manage.py", "refresh_prices").format_help()
    for phrase in ("AWS Price List API", "--provider {aws,azure,gcp}", "--region REGION", "--dry-run",
                   "--profile", "pricing:GetProducts", "nothing changed", "internal rates of own clusters"):
        assert phrase in " ".join(text.split()), phrase


def test_parser_keeps_the_higher_of_two_listed_prices():
    warnings = []
    rows = price_refresh.parse_aws_price_list(
        [product("ml.g5.xlarge", "1.40", sku="A"), product("ml.g5.xlarge", "1.45", sku="B"),
         product("ml.g5.xlarge", "9.99", unit="Quantity", sku="C"),  # not an hourly dimension
         product("ml.c5.xlarge", "0.2", region="eu-west-1", sku="D")],  # another region
        "us-east-1", progress=warnings.append, today=dt.date(2026, 11, 29))
    assert [(r.instance_type, r.usd_per_hour, r.as_of, r.confirmed) for r in rows] == [
        ("ml.g5.xlarge", Decimal("1.45"), "2026-11-29", True)]
    assert warnings == ["  warning: us-east-1 ml.g5.xlarge is listed at $1.40 and $1.45; keeping the higher"]
