"""jobs/cost.py: absolute, Decimal, 4 places."""

import datetime as dt
from decimal import Decimal

from jobs.cost import estimate_cost_usd, job_cost_usd, run_seconds


def test_cost_formula():
    # 1 h on 2 instances at $3.60 = $7.20
    assert job_cost_usd(billable_seconds=3600, instances=2, hourly_price_usd=Decimal("3.6")) == Decimal("7.2000")
    # 10 s on one instance at $3.60/h = $0.01
    assert job_cost_usd(billable_seconds=10, instances=1, hourly_price_usd=3.6) == Decimal("0.0100")
    # rounding half-up at the 4th place: 1 s × $0.18/h = 0.00005 → 0.0001
    assert job_cost_usd(billable_seconds=1, instances=1, hourly_price_usd=Decimal("0.18")) == Decimal("0.0001")
    assert job_cost_usd(billable_seconds=-5, instances=1, hourly_price_usd=3.6) == Decimal("0.0000")
    assert job_cost_usd(billable_seconds=100, instances=1, hourly_price_usd=0) == Decimal("0.0000")
    assert str(job_cost_usd(billable_seconds=12.345, instances=3, hourly_price_usd="1.5")) == "0.0154"


def test_recomputing_is_idempotent():
    once = job_cost_usd(billable_seconds=1234.5, instances=4, hourly_price_usd=Decimal("32.7726"))
    again = job_cost_usd(billable_seconds=1234.5, instances=4, hourly_price_usd=Decimal("32.7726"))
    assert once == again == Decimal("44.9531")  # 1234.5 × 4 × 32.7726 / 3600


def test_run_seconds_and_estimate():
    t0 = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    assert run_seconds(None, None, t0) == 0.0
    assert run_seconds(t0, t0 + dt.timedelta(seconds=90), t0 + dt.timedelta(hours=1)) == 90.0
    assert run_seconds(t0, None, t0 + dt.timedelta(seconds=30)) == 30.0
    assert estimate_cost_usd(max_runtime_s=1800, instances=2, hourly_price_usd=Decimal("3.6")) == Decimal("3.6000")
