"""Cost accounting (DESIGN.md §6): always recomputed absolutely from source data, never incremented.

    cost_usd = billable_seconds × instances × hourly_price_usd / 3600

rounded half-up to 4 decimal places (the precision of ``TrainingJob.cost_usd``). Re-running a sync
therefore never double-counts: the same inputs give the same cost.
"""

from __future__ import annotations

import datetime as dt
from decimal import ROUND_HALF_UP, Decimal

CENT_FRACTION = Decimal("0.0001")
PRICE_FRACTION = Decimal("0.000001")


def to_decimal(value: float | int | str | Decimal, places: Decimal = CENT_FRACTION) -> Decimal:
    """``value`` as a Decimal rounded half-up to ``places`` (via str, so 0.1 stays 0.1)."""
    return Decimal(str(value)).quantize(places, rounding=ROUND_HALF_UP)


def job_cost_usd(*, billable_seconds: float, instances: int, hourly_price_usd: Decimal | float) -> Decimal:
    """USD for ``billable_seconds`` on ``instances`` machines at ``hourly_price_usd`` per instance-hour."""
    seconds = Decimal(str(max(float(billable_seconds), 0.0)))
    price = Decimal(str(hourly_price_usd))
    return (seconds * Decimal(max(int(instances), 0)) * price / Decimal(3600)).quantize(
        CENT_FRACTION, rounding=ROUND_HALF_UP
    )


def run_seconds(started_at: dt.datetime | None, ended_at: dt.datetime | None, now: dt.datetime) -> float:
    """Seconds of the run interval: start → end (or → ``now`` while running); 0 before it starts.

    Used where the provider reports no billable seconds (Vertex, Azure ML, gpubox).
    """
    if started_at is None:
        return 0.0
    return max(((ended_at or now) - started_at).total_seconds(), 0.0)


def estimate_cost_usd(*, max_runtime_s: int, instances: int, hourly_price_usd: Decimal | float) -> Decimal:
    """Upper bound shown before launch: max runtime × instances × hourly price."""
    return job_cost_usd(billable_seconds=max_runtime_s, instances=instances,
                        hourly_price_usd=hourly_price_usd)


def spot_saving(*, billable_seconds: float | None, training_seconds: float | None) -> float | None:
    """Fraction of the on-demand cost a spot job saved: ``1 − billable / training`` (SageMaker's
    definition: managed spot bills fewer seconds than the job trained). None without a positive
    training time. Clamped to [0, 1]."""
    if training_seconds is None or billable_seconds is None or training_seconds <= 0:
        return None
    return min(max(1.0 - float(billable_seconds) / float(training_seconds), 0.0), 1.0)
