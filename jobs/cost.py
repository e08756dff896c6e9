"""Cost accounting (DESIGN.md §6): always recomputed absolutely from source data, never incremented.

    cost_usd = billable_seconds × instances × hourly_price_usd / 3600

rounded half-up to 4 decimal places (the precision of ``TrainingJob.cost_usd``). Re-running a sync
therefore never double-counts: the same inputs give the same cost.

:func:`job_cost_usd` is that definition. The sync writes the cost of thousands of running jobs in one
SQL statement, so the same formula is also rendered as SQL here, beside it and from the same
constants (:func:`job_cost_sql`, :func:`run_seconds_sql`); tests/jobs/test_cost.py compares the two
on PostgreSQL. Everything else that prices a job (the estimate before launch, the on-demand
comparison, the money precision) calls :func:`job_cost_usd`.

Money is shown through :func:`format_usd` (the UI's ``usd`` filter, messages, the admin) at the
precision of the figures it stands beside (:func:`usd_places`): cents, or the 4 decimals a job's
cost is kept in, so a budget of $0.0030 reached at $0.0037 reads so, not "$0.00 at $0.00".
Hourly prices keep all their decimals: :func:`format_usd_per_hour`.
"""

from __future__ import annotations

import datetime as dt
from decimal import ROUND_HALF_UP, Decimal

CENT_FRACTION = Decimal("0.0001")
PRICE_FRACTION = Decimal("0.000001")


MONEY_PLACES = 4  # decimals of TrainingJob.cost_usd / budget_usd / estimated_cost_usd
MIN_MONEY_PLACES = 2  # cents
SECONDS_PER_HOUR = 3600  # prices are per instance-hour


def _amount(value: float | int | str | Decimal) -> Decimal | None:
    """``value`` as a finite Decimal small enough to quantize to 6 places, else None."""
    try:
        amount = Decimal(str(value))
    except (ArithmeticError, ValueError, TypeError):
        return None
    return amount if amount.is_finite() and amount.adjusted() < 20 else None


def usd_places(*amounts: float | int | str | Decimal | None) -> int:
    """Decimals that show every one of ``amounts`` (USD) without rounding away a digit of its
    4-decimal figure: 2 (cents) when each is a whole number of cents, else 4 (the precision of
    ``TrainingJob.cost_usd``), never 3, so a job's figures read alike whatever their digits:
    ``usd_places(12.5)`` = 2, ``usd_places(0.003)`` = ``usd_places(0.003, 0.0037)`` = 4. None and
    values that are not numbers are ignored."""
    for value in amounts:
        amount = _amount(value) if value is not None else None
        if amount is None:
            continue
        exact = amount.quantize(CENT_FRACTION, rounding=ROUND_HALF_UP).normalize()
        if -exact.as_tuple().exponent > MIN_MONEY_PLACES:
            return MONEY_PLACES
    return MIN_MONEY_PLACES


def format_usd(value: float | int | str | Decimal | None, places: int | None = None) -> str:
    """``$1,234.50``, ``$0.0037``: USD with thousands separators and ``places`` decimals (default:
    :func:`usd_places` of the value alone). Pass the places of the figures shown together
    (``usd_places(budget, cost)``) so they read at one precision. None → ``—``; text that is not a
    number is returned as it is."""
    if value is None or value == "":
        return "—"
    amount = _amount(value)
    if amount is None:
        return str(value)
    places = usd_places(amount) if places is None else max(0, min(int(places), MONEY_PLACES))
    rounded = amount.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    return f"-${-rounded:,.{places}f}" if rounded < 0 else f"${rounded:,.{places}f}"


def format_usd_per_hour(value: float | int | str | Decimal) -> str:
    """``$1.4084/h``, ``$7.09/h``, ``$3.00/h``, ``$0.21849885/h``: an hourly price with every decimal
    the catalog (or the job's frozen price, 6 decimals) has, at least cents."""
    amount = _amount(value)
    if amount is None:
        return f"{value}/h"
    price = amount.normalize()
    if price.as_tuple().exponent > -MIN_MONEY_PLACES:
        price = price.quantize(Decimal("0.01"))
    return f"${price:,f}/h"


def to_decimal(value: float | int | str | Decimal, places: Decimal = CENT_FRACTION) -> Decimal:
    """``value`` as a Decimal rounded half-up to ``places`` (via str, so 0.1 stays 0.1)."""
    return Decimal(str(value)).quantize(places, rounding=ROUND_HALF_UP)


def job_cost_usd(*, billable_seconds: float, instances: int, hourly_price_usd: Decimal | float) -> Decimal:
    """USD for ``billable_seconds`` on ``instances`` machines at ``hourly_price_usd`` per instance-hour:
    ``seconds × instances × price / 3600``, rounded half-up to 4 decimals; negative seconds or
    instances count as 0. The one definition of a job's cost (its SQL form: :func:`job_cost_sql`)."""
    seconds = Decimal(str(max(float(billable_seconds), 0.0)))
    price = Decimal(str(hourly_price_usd))
    return (seconds * Decimal(max(int(instances), 0)) * price / Decimal(SECONDS_PER_HOUR)).quantize(
        CENT_FRACTION, rounding=ROUND_HALF_UP
    )


def job_cost_sql(*, seconds: str, instances: str, hourly_price_usd: str) -> str:
    """:func:`job_cost_usd` as a PostgreSQL expression (``numeric``, 4 decimals) over three SQL
    operands (columns, parameters or expressions, inserted as given: never user input).

    The product is exact in ``numeric`` and cast to a scale of 30 before the division, so it is
    rounded once, as the Decimal division at 28 digits is; ``ROUND(numeric, 4)`` rounds half away
    from zero, which is half-up for the non-negative values both forms compute."""
    return (f"ROUND(CAST(GREATEST(({seconds})::numeric, 0) * GREATEST(({instances}), 0) * ({hourly_price_usd})"
            f" AS numeric(65, 30)) / {SECONDS_PER_HOUR}, {MONEY_PLACES})")


def run_seconds(started_at: dt.datetime | None, ended_at: dt.datetime | None, now: dt.datetime) -> float:
    """Seconds of the run interval: start → end (or → ``now`` while running); 0 before it starts.

    Used where the provider reports no billable seconds (Vertex, Azure ML, gpubox).
    """
    if started_at is None:
        return 0.0
    return max(((ended_at or now) - started_at).total_seconds(), 0.0)


def run_seconds_sql(*, started_at: str, now: str) -> str:
    """:func:`run_seconds` of a running job (no end yet) as a PostgreSQL ``numeric`` expression:
    ``now − started_at`` in seconds with its microseconds (as ``timedelta.total_seconds``), at least 0.
    The caller handles ``started_at IS NULL`` (0 s in :func:`run_seconds`)."""
    return f"GREATEST(EXTRACT(EPOCH FROM (({now}) - ({started_at}))), 0)"


def estimate_cost_usd(*, max_runtime_s: int, instances: int, hourly_price_usd: Decimal | float,
                      budget_usd: Decimal | float | str | None = None) -> Decimal:
    """What a job may cost, shown before launch (USD, 4 decimals):
    ``min(max runtime × instances × hourly price, budget)``, the budget only when the job has one.

    The max runtime is the provider's limit on the job's whole run, start-up included (instances
    launching, the image and data downloading count; see ``Backend.max_runtime_covers``), and a job
    whose cost reaches its budget is stopped, so the job cannot run up more than either. Both stops
    take effect a little late — the provider's stop (SageMaker sends SIGTERM and allows 120 s,
    clouds.md §1.1) and the sync that sees the budget reached — which the estimate does not add."""
    runtime = job_cost_usd(billable_seconds=max_runtime_s, instances=instances, hourly_price_usd=hourly_price_usd)
    if budget_usd is None or budget_usd == "":
        return runtime
    return min(runtime, to_decimal(budget_usd))


def estimate_arithmetic(*, max_runtime_s: int, instances: int, hourly_price_usd: Decimal | float,
                        budget_usd: Decimal | float | str | None = None, places: int | None = None) -> str:
    """The sum behind :func:`estimate_cost_usd`, for the form and the API:
    ``"7200 s × 2 nodes × $1.4084/h"``, and with a budget below it
    ``"7200 s × 2 nodes × $1.4084/h = $5.6336, capped at the $3.0000 budget"`` (or ``"…; the $9.00
    budget is not reached"``). Money at ``places`` decimals (a job's ``money_places``), by default
    at the one precision of the two figures (:func:`usd_places`)."""
    runtime = job_cost_usd(billable_seconds=max_runtime_s, instances=instances, hourly_price_usd=hourly_price_usd)
    sum_text = (f"{int(max_runtime_s)} s × {int(instances)} node{'' if int(instances) == 1 else 's'} × "
                f"{format_usd_per_hour(hourly_price_usd)}")
    if budget_usd is None or budget_usd == "":
        return sum_text
    budget = to_decimal(budget_usd)
    places = usd_places(runtime, budget) if places is None else places
    if budget < runtime:
        return f"{sum_text} = {format_usd(runtime, places)}, capped at the {format_usd(budget, places)} budget"
    return f"{sum_text} = {format_usd(runtime, places)}; the {format_usd(budget, places)} budget is not reached"


def spot_saving(*, billable_seconds: float | None, training_seconds: float | None,
                hourly_price_usd: Decimal | float | None = None,
                on_demand_price_usd: Decimal | float | None = None) -> float | None:
    """Fraction of the on-demand cost a spot job saved:
    ``1 − (billable × hourly price) / (training × on-demand price)``, clamped to [0, 1].

    SageMaker bills managed spot at the on-demand rate for fewer seconds, so the prices cancel and
    this is its ``1 − billable / training`` (clouds.md §1.2); Vertex AI and Azure ML bill the whole run
    interval at the lower spot / low-priority rate, so it is ``1 − spot / on-demand price``. Without
    prices the seconds alone are compared. None without a positive training time (or a positive
    on-demand price when prices are given)."""
    if training_seconds is None or billable_seconds is None or training_seconds <= 0:
        return None
    ratio = float(billable_seconds) / float(training_seconds)
    if hourly_price_usd is not None and on_demand_price_usd is not None:
        if float(on_demand_price_usd) <= 0:
            return None
        ratio *= float(hourly_price_usd) / float(on_demand_price_usd)
    return min(max(1.0 - ratio, 0.0), 1.0)
