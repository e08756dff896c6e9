"""The admin-managed price catalog: InstancePrice rows, DatabasePriceCatalog over the shipped CSV,
``load_prices`` (and the demo's seeding), the admin, and adapters priced from the database. The
catalog's writes themselves: tests/jobs/services/test_prices.py."""

from __future__ import annotations

import datetime as dt
import io
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.db import IntegrityError, transaction
from django.urls import reverse

from cloud_adapters.pricing import PriceRow, StaticPriceCatalog, shipped_catalog
from jobs import adapters, services
from jobs.models import InstancePrice
from jobs.pricing import DatabasePriceCatalog

pytestmark = pytest.mark.django_db

SHIPPED_AWS = {r.instance_type: r for r in shipped_catalog().rows("aws", "us-east-1")}
SHIPPED = [r for provider in ("aws", "gcp", "azure") for r in shipped_catalog().rows(provider)]
SHIPPED_AZURE = shipped_catalog().rows("azure")
SAGEMAKER = {"region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerTraining",
             "bucket": "tb-test-bucket", "spot_allowed": True}


def stored(provider="aws", region="us-east-1", instance_type="ml.g5.xlarge") -> InstancePrice:
    return InstancePrice.objects.get(provider=provider, region=region, instance_type=instance_type)


# --- the catalog over the database ---------------------------------------------------------------


def test_shipped_catalog_is_what_the_tests_expect():
    # The figures below come from this file; if the other engineer's CSV changes, these tests say so.
    assert SHIPPED_AWS["ml.g5.xlarge"].usd_per_hour == Decimal("1.4084")
    assert SHIPPED_AWS["ml.g5.12xlarge"].usd_per_hour == Decimal("7.09")
    assert not SHIPPED_AWS["ml.g5.xlarge"].confirmed


def test_every_shipped_vertex_and_azure_type_has_an_interruptible_row_with_source_and_date():
    """Spot jobs on Vertex AI and low-priority jobs on Azure ML are priced from rows of their own; every type
    the catalog ships has one, with its source and date (unconfirmed upper bounds until refresh_prices)."""
    suffixes = {"gcp": ":spot", "azure": ":low_priority"}
    for provider, suffix in suffixes.items():
        rows = {r.instance_type: r for r in shipped_catalog().rows(provider)}
        plain = [t for t in rows if ":" not in t]
        assert plain and sorted(t + suffix for t in plain) == sorted(t for t in rows if ":" in t)
        for name in plain:
            spot = rows[name + suffix]
            assert spot.source and dt.date.fromisoformat(spot.as_of) and not spot.confirmed
            assert spot.usd_per_hour <= rows[name].usd_per_hour
    assert not [r for r in shipped_catalog().rows("aws") if ":" in r.instance_type]  # SageMaker bills fewer seconds


def test_database_row_wins_and_shipped_rows_fill_the_rest():
    fallback = StaticPriceCatalog([
        PriceRow("aws", "us-east-1", "ml.a", Decimal("1.00"), "csv", "2025-01-01", False),
        PriceRow("aws", "us-east-1", "ml.b", Decimal("2.00"), "csv", "2025-01-01", False),
        PriceRow("aws", "eu-west-1", "ml.a", Decimal("1.10"), "csv", "2025-01-01", False),
        PriceRow("gcp", "us-central1", "n1-standard-8", Decimal("0.437"), "csv", "", False),
    ])
    InstancePrice.objects.create(provider="aws", region="us-east-1", instance_type="ml.b",
                                 usd_per_hour=Decimal("2.50"), source="AWS Price List API",
                                 as_of=dt.date(2026, 11, 1), confirmed=True)
    InstancePrice.objects.create(provider="aws", region="us-east-1", instance_type="ml.c",
                                 usd_per_hour=Decimal("3.00"), source="admin", confirmed=False)
    catalog = DatabasePriceCatalog(fallback)

    row = catalog.lookup("aws", "us-east-1", "ml.b")
    assert row == PriceRow("aws", "us-east-1", "ml.b", Decimal("2.500000"), "AWS Price List API", "2026-11-01", True)
    assert catalog.lookup("aws", "us-east-1", "ml.a").usd_per_hour == Decimal("1.00")  # fallback
    assert catalog.lookup("aws", "us-east-1", "ml.c").as_of == ""  # no date stored
    assert catalog.lookup("aws", "us-east-1", "ml.zzz") is None

    rows = catalog.rows("aws", "us-east-1")
    assert [(r.instance_type, r.usd_per_hour, r.confirmed) for r in rows] == [
        ("ml.a", Decimal("1.00"), False), ("ml.b", Decimal("2.500000"), True), ("ml.c", Decimal("3.000000"), False)]
    assert [(r.region, r.instance_type) for r in catalog.rows("aws")] == [
        ("eu-west-1", "ml.a"), ("us-east-1", "ml.a"), ("us-east-1", "ml.b"), ("us-east-1", "ml.c")]
    assert [r.instance_type for r in catalog.rows("gcp")] == ["n1-standard-8"]

    # An admin's edit applies to the very next lookup (no cache).
    InstancePrice.objects.filter(instance_type="ml.b").update(usd_per_hour=Decimal("2.75"))
    assert catalog.lookup("aws", "us-east-1", "ml.b").usd_per_hour == Decimal("2.750000")


def test_one_row_per_provider_region_and_type():
    InstancePrice.objects.create(provider="aws", region="us-east-1", instance_type="ml.x", usd_per_hour=1)
    InstancePrice.objects.create(provider="aws", region="us-west-2", instance_type="ml.x", usd_per_hour=1)
    with pytest.raises(IntegrityError), transaction.atomic():
        InstancePrice.objects.create(provider="aws", region="us-east-1", instance_type="ml.x", usd_per_hour=2)


# --- seeding ---------------------------------------------------------------------------------


def test_load_prices_seeds_the_shipped_rows_and_is_idempotent():
    out = io.StringIO()
    call_command("load_prices", stdout=out)
    assert f"{len(SHIPPED)} added, 0 updated, 0 already stored" in out.getvalue()
    assert InstancePrice.objects.count() == len(SHIPPED)
    row = stored()
    assert (row.usd_per_hour, row.as_of, row.confirmed) == (Decimal("1.408400"), dt.date(2025, 1, 26), False)
    assert row.source.startswith("aws-samples/foundation-model-benchmarking-tool")

    # An admin edits one row; seeding again keeps the edit and adds nothing.
    services.instance_price_save(price=row, provider="aws", region="us-east-1", instance_type="ml.g5.xlarge",
                                 usd_per_hour="1.41", source="checked on aws.amazon.com", as_of="2026-11-29",
                                 confirmed=True)
    out = io.StringIO()
    call_command("load_prices", stdout=out)
    assert f"0 added, 0 updated, {len(SHIPPED)} already stored" in out.getvalue()
    assert InstancePrice.objects.count() == len(SHIPPED)
    assert (stored().usd_per_hour, stored().confirmed) == (Decimal("1.410000"), True)

    # --overwrite puts the shipped figure back.
    out = io.StringIO()
    call_command("load_prices", "--overwrite", stdout=out)
    assert f"0 added, 1 updated, {len(SHIPPED) - 1} already stored" in out.getvalue()
    assert (stored().usd_per_hour, stored().confirmed) == (Decimal("1.408400"), False)


def test_demo_seeds_prices_after_migrating(monkeypatch, settings, tmp_path):
    from jobs.management.commands import demo

    settings.TRAINBOARD_RUN_ROOT = tmp_path
    settings.VAR_DIR = tmp_path
    calls = []
    real_call_command = demo.call_command

    def recording_call_command(name, *args, **kwargs):
        calls.append(name)
        return real_call_command(name, *args, **kwargs)

    monkeypatch.setattr(demo, "call_command", recording_call_command)
    monkeypatch.setattr(demo, "_port_in_use", lambda host, port: False)
    monkeypatch.setattr(demo.signal, "signal", lambda *args: None)  # keep pytest's own handlers
    for method in ("_start_children", "_wait_for_web", "_shutdown"):
        monkeypatch.setattr(demo.Command, method, lambda self, *args, **kwargs: None)
    monkeypatch.setattr(demo.Command, "_follow", lambda self, job, stopping, exit_when_done: None)
    out = io.StringIO()
    call_command("demo", "--no-job", stdout=out)
    assert calls == ["migrate", "load_prices"]
    assert f"Prices: {len(SHIPPED)} added" in out.getvalue()
    assert stored().usd_per_hour == Decimal("1.408400")


# --- adapters priced from the database -----------------------------------------------------------


def test_backend_adapter_prices_from_the_database_with_shipped_fallback(user):
    backend = services.backend_create(owner=user, name="sm", kind="sagemaker", config=SAGEMAKER)
    adapter = adapters.backend_adapter(backend)
    assert isinstance(adapter.prices, DatabasePriceCatalog)
    assert adapter.price("ml.g5.xlarge") == pytest.approx(1.4084)  # shipped row, nothing stored yet
    InstancePrice.objects.create(provider="aws", region="us-east-1", instance_type="ml.g5.xlarge",
                                 usd_per_hour=Decimal("1.5"), source="AWS Price List API", confirmed=True)
    InstancePrice.objects.create(provider="aws", region="us-east-1", instance_type="ml.trn1.2xlarge",
                                 usd_per_hour=Decimal("1.5"), source="admin")
    assert adapter.price("ml.g5.xlarge") == pytest.approx(1.5)
    offers = {o.instance_type: o for o in adapter.instance_offers()}
    assert offers["ml.g5.xlarge"].confirmed and offers["ml.g5.xlarge"].usd_per_hour == pytest.approx(1.5)
    assert offers["ml.trn1.2xlarge"].usd_per_hour == pytest.approx(1.5)  # a row only the database has
    assert offers["ml.p3.2xlarge"].usd_per_hour == pytest.approx(3.825) and not offers["ml.p3.2xlarge"].confirmed

    # The estimate uses adapter.price(instance type, spot): 2 h × 2 instances × $7.09 = $28.36.
    estimate = services.training_job_estimate(backend=backend, nodes=2, procs_per_node=1, max_runtime_s=7200,
                                              instance_type="ml.g5.12xlarge", spot=True)
    assert estimate["hourly_price_usd"] == Decimal("7.090000")
    assert estimate["estimated_cost_usd"] == Decimal("28.3600")
    estimate = services.training_job_estimate(backend=backend, nodes=2, max_runtime_s=3600,
                                              instance_type="ml.g5.xlarge")
    assert estimate["estimated_cost_usd"] == Decimal("3.0000")  # the stored $1.50, not the shipped $1.4084


# --- admin -----------------------------------------------------------------------------------


@pytest.fixture
def superuser_client(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def test_admin_lists_filters_searches_and_edits_prices(superuser_client):
    services.instance_price_seed()
    InstancePrice.objects.create(provider="azure", region="westeurope", instance_type="Standard_NC6s_v3",
                                 usd_per_hour=Decimal("3.06"), confirmed=True)  # a row nothing ships
    url = reverse("admin:jobs_instanceprice_changelist")
    page = superuser_client.get(url)
    assert page.status_code == 200
    assert page.context["cl"].result_count == len(SHIPPED) + 1
    assert superuser_client.get(url + "?provider__exact=azure").context["cl"].result_count == len(SHIPPED_AZURE) + 1
    assert superuser_client.get(url + "?confirmed__exact=0").context["cl"].result_count == len(SHIPPED)
    found = superuser_client.get(url + "?q=g5").context["cl"].result_list
    assert sorted(p.instance_type for p in found) == ["ml.g5.12xlarge", "ml.g5.xlarge"]
    html = page.content.decode()
    for column in ("Instance type", "Provider", "Region", "Usd per hour", "Confirmed", "As of", "Source"):
        assert column in html, column

    # Add through the admin form (the service saves it); a duplicate key is an error on the form.
    add = reverse("admin:jobs_instanceprice_add")
    data = {"provider": "aws", "region": "eu-west-1", "instance_type": "ml.g5.xlarge", "usd_per_hour": "1.57",
            "source": "aws.amazon.com/sagemaker/pricing", "as_of": "2026-11-29", "confirmed": "on"}
    assert superuser_client.post(add, data).status_code == 302
    row = stored(region="eu-west-1")
    assert (row.usd_per_hour, row.as_of, row.confirmed) == (Decimal("1.570000"), dt.date(2026, 11, 29), True)
    again = superuser_client.post(add, data)
    assert again.status_code == 200
    assert again.context["adminform"].form.errors["instance_type"] == [
        "ml.g5.xlarge in aws eu-west-1 already has a price; edit that row instead."]
    change = reverse("admin:jobs_instanceprice_change", args=[row.pk])
    assert superuser_client.post(change, {**data, "usd_per_hour": "1.60"}).status_code == 302
    assert stored(region="eu-west-1").usd_per_hour == Decimal("1.600000")
    assert InstancePrice.objects.filter(region="eu-west-1").count() == 1


def test_staff_without_permission_cannot_edit_prices(client, user):
    client.force_login(user)  # staff, not superuser, no model permission
    assert client.get(reverse("admin:jobs_instanceprice_changelist")).status_code == 403


# --- GPU facts -------------------------------------------------------------------------------


def test_every_shipped_type_has_gpu_facts_with_a_source_and_load_prices_stores_them():
    from cloud_adapters.gpus import shipped_gpus

    gpus = shipped_gpus()
    for row in SHIPPED:
        facts = gpus.get((row.provider, row.instance_type.split(":", 1)[0]))
        assert facts is not None and facts.source.count("https://") == 1, row.instance_type
    call_command("load_prices", stdout=io.StringIO())
    g5 = stored()
    assert (g5.gpu_model, g5.gpu_count, g5.gpu_memory_gib) == ("NVIDIA A10G", 1, 24.0)
    assert "aws.amazon.com/ec2/instance-types/g5" in g5.gpu_source
    cpu = stored(instance_type="ml.m5.xlarge")
    assert (cpu.gpu_count, cpu.gpu_memory_gib) == (0, None)
    assert stored("gcp", "us-central1", "NVIDIA_TESLA_T4:spot").gpu_memory_gib == 16.0

    # A price edit keeps the GPU facts; a GPU edit is kept by the next seeding.
    services.instance_price_save(price=g5, provider="aws", region="us-east-1", instance_type="ml.g5.xlarge",
                                 usd_per_hour="1.41")
    assert stored().gpu_memory_gib == 24.0
    services.instance_price_save(price=stored(), provider="aws", region="us-east-1", instance_type="ml.g5.xlarge",
                                 usd_per_hour="1.41", gpu_memory_gib=22.0, gpu_count=1)
    call_command("load_prices", stdout=io.StringIO())
    assert stored().gpu_memory_gib == 22.0
    with pytest.raises(Exception) as caught:
        services.instance_price_save(price=stored(), provider="aws", region="us-east-1",
                                     instance_type="ml.g5.xlarge", usd_per_hour="1.41", gpu_memory_gib=-1.0)
    assert caught.value.message_dict["gpu_memory_gib"] == [
        "GPU memory must be more than 0 GiB (at most 100,000), or empty; got -1.0."]


def test_each_adapter_reads_its_gpus_from_the_catalog_or_its_settings(user, tmp_path):
    backend = services.backend_create(owner=user, name="sm", kind="sagemaker", config=SAGEMAKER)
    sagemaker = adapters.backend_adapter(backend)
    assert sagemaker.gpus().memory_bytes == 24 * 2**30  # the default type, ml.g5.xlarge, shipped facts
    assert sagemaker.gpus("ml.p4d.24xlarge").count == 8
    assert sagemaker.gpus("ml.m5.xlarge").memory_bytes is None and sagemaker.gpus("ml.trn1.2xlarge") is None
    InstancePrice.objects.create(provider="aws", region="eu-west-1", instance_type="ml.p4d.24xlarge",
                                 usd_per_hour=Decimal("40"), gpu_model="NVIDIA A100 40GB", gpu_count=8,
                                 gpu_memory_gib=39.5, gpu_source="admin")
    assert sagemaker.gpus("ml.p4d.24xlarge").memory_gib == 39.5  # a stored row wins, whatever its region

    from cloud_adapters.azureml.backend import AzureMLBackend
    from cloud_adapters.gpubox.backend import GpuBoxBackend
    from cloud_adapters.vertex.backend import VertexBackend

    assert AzureMLBackend.gpus(_bare(AzureMLBackend, vm_size="Standard_NC24ads_A100_v4")).memory_gib == 80
    vertex = _bare(VertexBackend, machine_type="n1-standard-8", accelerator_type="NVIDIA_TESLA_T4",
                   accelerator_count=2)
    assert (vertex.gpus().model, vertex.gpus().count, vertex.gpus().memory_gib) == ("NVIDIA T4", 2, 16.0)
    assert _bare(VertexBackend, machine_type="n1-standard-4", accelerator_type="", accelerator_count=0).gpus().count == 0
    box = GpuBoxBackend(GpuBoxBackend.clean_config({"run_root": str(tmp_path), "max_procs_per_node": 2,
                                                    "gpu_model": "NVIDIA H200", "gpu_memory_gib": 139.8}))
    assert (box.gpus().count, box.gpus().memory_bytes) == (2, int(139.8 * 2**30))
    assert GpuBoxBackend(GpuBoxBackend.clean_config({"run_root": str(tmp_path)})).gpus() is None


def _bare(cls, **config):
    """An adapter whose config is ``config`` as it stands (no SDK, no settings check)."""
    adapter = cls.__new__(cls)
    adapter.config, adapter.prices = config, shipped_catalog()
    return adapter


def test_admin_shows_and_edits_gpu_facts(superuser_client):
    services.instance_price_seed()
    url = reverse("admin:jobs_instanceprice_changelist")
    html = superuser_client.get(url).content.decode()
    for column in ("GPUs", "GPU model", "GPU memory (GiB)"):
        assert column in html, column
    row = stored()
    change = reverse("admin:jobs_instanceprice_change", args=[row.pk])
    data = {"provider": "aws", "region": "us-east-1", "instance_type": "ml.g5.xlarge", "usd_per_hour": "1.4084",
            "source": row.source, "as_of": "2025-01-26", "gpu_model": "NVIDIA A10G", "gpu_count": "1",
            "gpu_memory_gib": "23.5", "gpu_source": "nvidia-smi on the instance"}
    assert superuser_client.post(change, data).status_code == 302
    assert (stored().gpu_memory_gib, stored().gpu_source) == (23.5, "nvidia-smi on the instance")
