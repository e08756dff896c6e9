"""cloud_adapters.pricing for own clusters: the internal rate of a partition or node pool (node-hour +
GPUs per node × GPU-hour) and catalog CSVs with and without the usd_per_gpu_hour column."""

from __future__ import annotations

from decimal import Decimal

import pytest

from cloud_adapters.pricing import (CSV_FIELDS, INTERNAL_RATE_SOURCE, PriceRow, StaticPriceCatalog, internal_rate,
                                    read_csv, shipped_catalog, write_csv)

CATALOG = StaticPriceCatalog([
    PriceRow("slurm", "hpc1", "gpu", Decimal("1.50"), source=INTERNAL_RATE_SOURCE, usd_per_gpu_hour=Decimal("0.85")),
    PriceRow("slurm", "hpc1", "cpu", Decimal("0.40"), source=INTERNAL_RATE_SOURCE),
    PriceRow("kubernetes", "prod", "a100-pool", Decimal("0"), usd_per_gpu_hour=Decimal("2.10")),
])


@pytest.mark.parametrize("provider,cluster,pool,gpus,rate", [
    ("slurm", "hpc1", "gpu", 4, Decimal("4.90")),  # 1.50 + 4 × 0.85
    ("slurm", "hpc1", "gpu", 0, Decimal("1.50")),  # a CPU-only job on the GPU partition pays the node-hour
    ("slurm", "hpc1", "cpu", 8, Decimal("0.40")),  # no GPU-hour rate set: GPUs add nothing
    ("kubernetes", "prod", "a100-pool", 8, Decimal("16.80")),  # 8 × 2.10, no node-hour rate
])
def test_internal_rate_is_the_node_hour_plus_gpus_times_the_gpu_hour(provider, cluster, pool, gpus, rate):
    assert internal_rate(CATALOG, provider, cluster, pool, gpus) == rate


def test_internal_rate_is_none_without_a_row_for_the_cluster_and_pool():
    assert internal_rate(CATALOG, "slurm", "hpc2", "gpu", 4) is None  # another cluster
    assert internal_rate(CATALOG, "slurm", "hpc1", "a100", 4) is None  # another partition
    assert internal_rate(CATALOG, "kubernetes", "hpc1", "gpu", 4) is None  # another provider


def test_a_job_cost_from_the_rate_is_elapsed_hours_times_nodes_times_rate():
    # 2 nodes × 4 GPUs on hpc1/gpu for 90 minutes: 1.5 h × 2 × (1.50 + 4 × 0.85) = 14.70 USD
    rate = internal_rate(CATALOG, "slurm", "hpc1", "gpu", 4)
    assert Decimal("1.5") * 2 * rate == Decimal("14.70")


def test_a_csv_with_the_gpu_hour_column_round_trips(tmp_path):
    path = tmp_path / "rates.csv"
    write_csv(path, CATALOG.rows("slurm") + CATALOG.rows("kubernetes"))
    assert path.read_text().splitlines()[0] == ",".join(CSV_FIELDS) + ",usd_per_gpu_hour"

    back = StaticPriceCatalog(read_csv(path))
    assert back.lookup("slurm", "hpc1", "gpu").usd_per_gpu_hour == Decimal("0.85")
    assert back.lookup("slurm", "hpc1", "cpu").usd_per_gpu_hour == Decimal("0")
    assert internal_rate(back, "kubernetes", "prod", "a100-pool", 8) == Decimal("16.80")


def test_a_csv_without_the_column_still_loads_with_no_gpu_hour_rate(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text(",".join(CSV_FIELDS) + "\n"
                    "aws,us-east-1,ml.g5.xlarge,1.4084,pricing page,2025-01-26,false\n"
                    "slurm,hpc1,gpu,2.25,internal rate,2026-12-01,true\n")
    rows = read_csv(path)

    assert [(r.provider, r.usd_per_hour, r.usd_per_gpu_hour) for r in rows] == [
        ("aws", Decimal("1.4084"), Decimal("0")), ("slurm", Decimal("2.25"), Decimal("0"))]
    assert rows[1].confirmed and rows[1].as_of == "2026-12-01"


def test_the_shipped_csv_still_loads():
    assert shipped_catalog().rows("aws")
    assert all(r.usd_per_gpu_hour == 0 for p in ("aws", "gcp", "azure") for r in shipped_catalog().rows(p))


@pytest.mark.parametrize("cell,message", [
    ("-0.5", "usd_per_gpu_hour must be a number ≥ 0, got '-0.5'"),
    ("cheap", "usd_per_gpu_hour 'cheap' is not a number"),
    ("NaN", "usd_per_gpu_hour must be a number ≥ 0, got 'NaN'"),
])
def test_a_bad_gpu_hour_cell_names_its_line(tmp_path, cell, message):
    path = tmp_path / "bad.csv"
    path.write_text(",".join(CSV_FIELDS) + ",usd_per_gpu_hour\n"
                    "slurm,hpc1,cpu,0.4,,,false,\n"
                    f"slurm,hpc1,gpu,1.5,,,false,{cell}\n")
    with pytest.raises(ValueError, match=f"bad.csv:3: {message}"):
        read_csv(path)


def test_a_short_line_is_read_with_blank_cells(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text(",".join(CSV_FIELDS) + ",usd_per_gpu_hour\nslurm,hpc1,gpu,1.5\n")
    (row,) = read_csv(path)
    assert (row.source, row.as_of, row.confirmed, row.usd_per_gpu_hour) == ("", "", False, Decimal("0"))
