"""Internal rates of own clusters (slurm, kubernetes) in the admin-managed catalog: the services'
validation, the admin's form and list, DatabasePriceCatalog and internal_rate over stored rows, and
``load_prices --csv`` with and without the usd_per_gpu_hour column. (refresh_prices leaving them alone:
tests/jobs/test_refresh_prices.py.)"""

from __future__ import annotations

import io
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.urls import reverse

from cloud_adapters.pricing import CSV_FIELDS, INTERNAL_RATE_SOURCE, PriceRow, StaticPriceCatalog, internal_rate
from jobs import services
from jobs.models import InstancePrice
from jobs.pricing import DatabasePriceCatalog

pytestmark = pytest.mark.django_db


@pytest.fixture
def superuser_client(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def stored(provider="slurm", region="hpc1", instance_type="gpu") -> InstancePrice:
    return InstancePrice.objects.get(provider=provider, region=region, instance_type=instance_type)


# --- services ----------------------------------------------------------------------------------


def test_save_stores_both_rates_and_defaults_the_source_of_internal_rows():
    row = services.instance_price_save(provider="slurm", region="hpc1", instance_type="gpu", usd_per_hour="1.5",
                                       usd_per_gpu_hour="0.85")
    assert (row.usd_per_hour, row.usd_per_gpu_hour, row.source) == (Decimal("1.5"), Decimal("0.85"), INTERNAL_RATE_SOURCE)

    k8s = services.instance_price_save(provider="kubernetes", region="prod", instance_type="a100-pool",
                                       usd_per_hour=0, usd_per_gpu_hour=Decimal("2.1"), source="finance sheet 2026-Q4")
    assert (k8s.usd_per_gpu_hour, k8s.source) == (Decimal("2.1"), "finance sheet 2026-Q4")  # a given source stands

    cloud = services.instance_price_save(provider="aws", region="eu-west-1", instance_type="ml.g5.xlarge",
                                         usd_per_hour="1.57")
    assert (cloud.usd_per_gpu_hour, cloud.source) == (Decimal("0"), "")  # no default source for list prices


def test_save_reports_every_problem_at_once_and_writes_nothing():
    with pytest.raises(ValidationError) as caught:
        services.instance_price_save(provider="slurm", region="hpc1", instance_type="gpu", usd_per_hour="-1",
                                     usd_per_gpu_hour="lots", as_of="soon")
    assert caught.value.message_dict == {
        "usd_per_hour": ["slurm hpc1 gpu: USD per hour must be a number ≥ 0, got '-1'."],
        "usd_per_gpu_hour": ["slurm hpc1 gpu: USD per GPU-hour must be a number ≥ 0, got 'lots'."],
        "as_of": ["slurm hpc1 gpu: as_of 'soon' is not a date (YYYY-MM-DD)."],
    }
    assert not InstancePrice.objects.exists()


@pytest.mark.parametrize("value,message", [
    (Decimal("-0.01"), "must be a number ≥ 0, got Decimal('-0.01')"),
    ("NaN", "must be a number ≥ 0, got 'NaN'"),
    ("Infinity", "must be a number ≥ 0, got 'Infinity'"),
    (True, "must be a number ≥ 0, got True"),
    ("1e9", "must be below 1,000,000, got '1e9'"),
    ({"x": 1}, "must be a number ≥ 0, got {'x': 1}"),
])
def test_save_refuses_a_gpu_hour_rate_that_is_no_amount(value, message):
    with pytest.raises(ValidationError) as caught:
        services.instance_price_save(provider="slurm", region="hpc1", instance_type="gpu", usd_per_hour=1,
                                     usd_per_gpu_hour=value)
    assert caught.value.message_dict == {"usd_per_gpu_hour": [f"slurm hpc1 gpu: USD per GPU-hour {message}."]}


def test_a_gpu_hour_rate_on_a_cloud_list_price_is_refused():
    with pytest.raises(ValidationError) as caught:
        services.instance_price_save(provider="gcp", region="us-central1", instance_type="n1-standard-8",
                                     usd_per_hour="0.38", usd_per_gpu_hour="0.5")
    assert caught.value.message_dict == {"usd_per_gpu_hour": [
        "gcp us-central1 n1-standard-8: a GPU-hour rate is for the internal rates of own clusters (kubernetes, ray, "
        "slurm); a gcp price is per instance-hour, so leave it at 0."]}


def test_upsert_takes_the_gpu_hour_rate_and_overwrite_updates_it():
    rows = [PriceRow("slurm", "hpc1", "gpu", Decimal("1.5"), usd_per_gpu_hour=Decimal("0.85")),
            PriceRow("slurm", "hpc1", "cpu", Decimal("0.4"))]
    assert services.instance_price_upsert(rows=rows) == {"created": 2, "updated": 0, "unchanged": 0}
    assert stored().usd_per_gpu_hour == Decimal("0.85")
    assert stored(instance_type="cpu").source == INTERNAL_RATE_SOURCE

    cheaper = [PriceRow("slurm", "hpc1", "gpu", Decimal("1.5"), usd_per_gpu_hour=Decimal("0.60"))]
    assert services.instance_price_upsert(rows=cheaper, overwrite=False)["unchanged"] == 1
    assert stored().usd_per_gpu_hour == Decimal("0.85")
    assert services.instance_price_upsert(rows=cheaper, overwrite=True)["updated"] == 1
    assert stored().usd_per_gpu_hour == Decimal("0.60")


def test_upsert_names_each_bad_row_and_writes_nothing():
    rows = [PriceRow("slurm", "hpc1", "gpu", Decimal("1.5"), usd_per_gpu_hour=Decimal("-2")),
            PriceRow("aws", "us-east-1", "ml.g5.xlarge", Decimal("1.4"), usd_per_gpu_hour=Decimal("1")),
            PriceRow("kubernetes", "prod", "pool", Decimal("1"))]
    with pytest.raises(ValidationError) as caught:
        services.instance_price_upsert(rows=rows)
    assert caught.value.message_dict["usd_per_gpu_hour"] == [
        "slurm hpc1 gpu: USD per GPU-hour must be a number ≥ 0, got Decimal('-2').",
        "aws us-east-1 ml.g5.xlarge: a GPU-hour rate is for the internal rates of own clusters (kubernetes, ray, "
        "slurm); a aws price is per instance-hour, so leave it at 0."]
    assert not InstancePrice.objects.exists()


# --- the catalog the adapters read ----------------------------------------------------------------


def test_database_catalog_finds_internal_rows_with_their_gpu_hour_rate():
    services.instance_price_save(provider="slurm", region="hpc1", instance_type="gpu", usd_per_hour="1.50",
                                 usd_per_gpu_hour="0.85")
    services.instance_price_save(provider="kubernetes", region="prod", instance_type="a100-pool", usd_per_hour="0",
                                 usd_per_gpu_hour="2.10")
    catalog = DatabasePriceCatalog(fallback=StaticPriceCatalog())

    row = catalog.lookup("slurm", "hpc1", "gpu")
    assert (row.usd_per_hour, row.usd_per_gpu_hour, row.source) == (Decimal("1.5"), Decimal("0.85"), INTERNAL_RATE_SOURCE)
    assert [r.instance_type for r in catalog.rows("slurm", "hpc1")] == ["gpu"]
    assert internal_rate(catalog, "slurm", "hpc1", "gpu", 4) == Decimal("4.90")  # 1.50 + 4 × 0.85
    assert internal_rate(catalog, "kubernetes", "prod", "a100-pool", 8) == Decimal("16.80")
    assert internal_rate(catalog, "slurm", "hpc1", "debug", 4) is None

    # An admin's edit applies to the next lookup.
    services.instance_price_save(price=stored(), provider="slurm", region="hpc1", instance_type="gpu",
                                 usd_per_hour="1.50", usd_per_gpu_hour="1.00")
    assert internal_rate(catalog, "slurm", "hpc1", "gpu", 4) == Decimal("5.50")


# --- admin --------------------------------------------------------------------------------------


def test_admin_add_page_explains_internal_rates(superuser_client):
    page = superuser_client.get(reverse("admin:jobs_instanceprice_add"))
    assert page.status_code == 200
    html = page.content.decode()
    for text in ("USD per GPU-hour", "the cluster's name", "Slurm: the partition; Kubernetes: the node pool",
                 "USD per node-hour", "GPUs per node × this", "Slurm (internal rate)"):
        assert text in html, text


def test_admin_adds_and_changes_an_internal_rate(superuser_client):
    add = reverse("admin:jobs_instanceprice_add")
    data = {"provider": "slurm", "region": "hpc1", "instance_type": "gpu", "usd_per_hour": "1.50",
            "usd_per_gpu_hour": "0.85", "source": "", "as_of": "2026-12-01"}
    assert superuser_client.post(add, data).status_code == 302
    row = stored()
    assert (row.usd_per_hour, row.usd_per_gpu_hour, row.source, row.confirmed) == (
        Decimal("1.5"), Decimal("0.85"), INTERNAL_RATE_SOURCE, False)

    change = reverse("admin:jobs_instanceprice_change", args=[row.pk])
    assert superuser_client.get(change).status_code == 200
    assert superuser_client.post(change, {**data, "usd_per_gpu_hour": "", "source": "internal rate"}).status_code == 302
    assert stored().usd_per_gpu_hour == Decimal("0")  # blank = no GPU-hour rate

    listing = superuser_client.get(reverse("admin:jobs_instanceprice_changelist") + "?provider__exact=slurm")
    assert listing.context["cl"].result_count == 1
    assert "USD per GPU-hour" in listing.content.decode()


def test_admin_shows_every_problem_on_the_form(superuser_client):
    add = reverse("admin:jobs_instanceprice_add")
    page = superuser_client.post(add, {"provider": "slurm", "region": "hpc1", "instance_type": "gpu",
                                       "usd_per_hour": "-1", "usd_per_gpu_hour": "-2"})
    assert page.status_code == 200
    errors = page.context["adminform"].form.errors
    assert set(errors) == {"usd_per_hour", "usd_per_gpu_hour"}
    assert not InstancePrice.objects.exists()

    cloud = superuser_client.post(add, {"provider": "azure", "region": "eastus", "instance_type": "Standard_NC6s_v3",
                                        "usd_per_hour": "3.06", "usd_per_gpu_hour": "1"})
    assert cloud.status_code == 200
    assert "a GPU-hour rate is for the internal rates of own clusters" in \
        cloud.context["adminform"].form.errors["usd_per_gpu_hour"][0]


# --- load_prices --csv ------------------------------------------------------------------------


def _load(*args) -> str:
    out = io.StringIO()
    call_command("load_prices", *args, stdout=out)
    return out.getvalue().strip()


def test_load_prices_reads_a_csv_with_the_gpu_hour_column(tmp_path):
    path = tmp_path / "rates.csv"
    path.write_text(",".join(CSV_FIELDS) + ",usd_per_gpu_hour\n"
                    "slurm,hpc1,gpu,1.50,,2026-12-01,true,0.85\n"
                    "slurm,hpc1,cpu,0.40,,2026-12-01,true,\n"
                    "kubernetes,prod,a100-pool,0,rate card 2026,2026-12-01,false,2.10\n")

    assert _load("--csv", str(path)) == "Prices: 3 added, 0 updated, 0 already stored."
    assert (stored().usd_per_gpu_hour, stored().source, stored().confirmed) == (Decimal("0.85"), INTERNAL_RATE_SOURCE, True)
    assert stored(instance_type="cpu").usd_per_gpu_hour == Decimal("0")
    assert stored("kubernetes", "prod", "a100-pool").source == "rate card 2026"
    assert _load("--csv", str(path)) == "Prices: 0 added, 0 updated, 3 already stored."

    path.write_text(",".join(CSV_FIELDS) + ",usd_per_gpu_hour\nslurm,hpc1,gpu,1.50,,2026-12-01,true,0.95\n")
    assert _load("--csv", str(path)) == "Prices: 0 added, 0 updated, 1 already stored."  # kept without --overwrite
    assert _load("--csv", str(path), "--overwrite") == "Prices: 0 added, 1 updated, 0 already stored."
    assert stored().usd_per_gpu_hour == Decimal("0.95")


def test_load_prices_reads_a_csv_without_the_column(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text(",".join(CSV_FIELDS) + "\nslurm,hpc1,gpu,2.25,,2026-12-01,false\n"
                    "aws,eu-west-1,ml.g5.xlarge,1.57,aws.amazon.com/sagemaker/pricing,2026-11-29,true\n")

    assert _load("--csv", str(path)) == "Prices: 2 added, 0 updated, 0 already stored."
    assert (stored().usd_per_hour, stored().usd_per_gpu_hour) == (Decimal("2.25"), Decimal("0"))
    assert stored("aws", "eu-west-1", "ml.g5.xlarge").usd_per_gpu_hour == Decimal("0")


def test_load_prices_refuses_a_bad_csv_and_changes_nothing(tmp_path):
    bad_cell = tmp_path / "bad.csv"
    bad_cell.write_text(",".join(CSV_FIELDS) + ",usd_per_gpu_hour\nslurm,hpc1,gpu,1.5,,,false,-1\n")
    with pytest.raises(CommandError, match=r"bad.csv:2: usd_per_gpu_hour must be a number ≥ 0.*No price was changed"):
        _load("--csv", str(bad_cell))

    bad_row = tmp_path / "rows.csv"
    bad_row.write_text(",".join(CSV_FIELDS) + ",usd_per_gpu_hour\nslurm,hpc1,cpu,0.4,,,false,\n"
                       "aws,us-east-1,ml.g5.xlarge,1.4,,,false,0.5\n")
    with pytest.raises(CommandError, match=r"rows.csv has a bad row: aws us-east-1 ml.g5.xlarge: a GPU-hour rate"):
        _load("--csv", str(bad_row))

    with pytest.raises(CommandError, match="Cannot read the price CSV: .*missing column"):
        (tmp_path / "cols.csv").write_text("provider,region\nslurm,hpc1\n")
        _load("--csv", str(tmp_path / "cols.csv"))
    with pytest.raises(CommandError, match="Cannot read the price CSV"):
        _load("--csv", str(tmp_path / "absent.csv"))
    assert not InstancePrice.objects.exists()
