"""jobs/cost.py: absolute, Decimal, 4 places."""

import datetime as dt
import random
from decimal import Decimal

import pytest

from jobs.cost import estimate_cost_usd, job_cost_sql, job_cost_usd, run_seconds, run_seconds_sql


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


@pytest.mark.django_db
def test_the_sql_form_of_the_cost_gives_the_functions_values():
    """job_cost_sql / run_seconds_sql, evaluated by PostgreSQL on the values the sync stores (a
    timestamp to the microsecond, an integer instance count, a price of 6 decimals), against
    job_cost_usd / run_seconds: equal to the last decimal, ties at $0.00005 and clamps included."""
    from django.db import connection

    assert connection.vendor == "postgresql", "the SQL form is PostgreSQL's (DATABASE_URL=postgres://...)"
    rng = random.Random(12)
    now = dt.datetime(2026, 12, 1, 9, 30, 15, 654321, tzinfo=dt.timezone.utc)
    cases = [  # (started_at, instances, hourly price)
        (now - dt.timedelta(seconds=1), 1, Decimal("0.18")),  # $0.00005 → $0.0001
        (now - dt.timedelta(seconds=1), 1, Decimal("0.54")),  # $0.00015 → $0.0002
        (now - dt.timedelta(seconds=3), 3, Decimal("0.02")),  # $0.00005 from 3 × 3 s
        (now - dt.timedelta(seconds=1799, microseconds=999999), 2, Decimal("7.2")),  # just under $7.20
        (now + dt.timedelta(seconds=5), 2, Decimal("7.2")),  # clock skew: start after now → 0 s
        (now - dt.timedelta(days=28), 1000, Decimal("98.765432")),  # the longest run at scale
        (now - dt.timedelta(hours=1), 0, Decimal("3.6")),  # no instance reported
        (now - dt.timedelta(hours=1), 4, Decimal("0")),  # a free gpubox
        (now - dt.timedelta(hours=1), 1, Decimal("0.000001")),
    ]
    prices = [Decimal("7.2"), Decimal("0.123457"), Decimal("98.765432"), Decimal("3.333333"),
              Decimal("1.000005"), Decimal("1.4084"), Decimal("0.218499")]
    cases += [(now - dt.timedelta(microseconds=rng.randrange(0, 10 * 86400 * 10**6)), rng.randrange(0, 17),
               rng.choice(prices)) for _ in range(200)]
    seconds_sql = run_seconds_sql(started_at="c.started_at", now="%s::timestamptz")
    cost_sql = job_cost_sql(seconds=seconds_sql, instances="c.instances", hourly_price_usd="c.price")
    values = ", ".join(["(%s::timestamptz, %s::integer, %s::numeric(12, 6))"] * len(cases))
    params = [now, now] + [v for case in cases for v in case]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT ({seconds_sql})::double precision, {cost_sql} "
                       f"FROM (VALUES {values}) AS c(started_at, instances, price)", params)
        rows = cursor.fetchall()
    expected = []
    for started_at, instances, price in cases:
        seconds = run_seconds(started_at, None, now)
        expected.append((seconds, job_cost_usd(billable_seconds=seconds, instances=instances, hourly_price_usd=price)))
    assert rows == expected
    assert [cost for _, cost in rows[:4]] == [Decimal("0.0001"), Decimal("0.0002"), Decimal("0.0001"),
                                              Decimal("7.2000")]
    assert rows[4] == (0.0, Decimal("0.0000")) and rows[5][1] == Decimal("66370370.3040")
