"""Idle GPUs on the dashboard's side (issue 30): when a job's GPUs sit below a utilisation threshold,
for how long, what that cost, and what stopping it saves.

The launcher samples every GPU of a run (``hardware`` records, :mod:`trainer_pkg.hardware`:
``gpu_ranks`` and ``sys/gpu_util_pct``, NVML's % of the sample period in which a kernel ran). The sync
folds them, in log order, into the job's tracker (``TrainingJob.idle``, :func:`idle_after`)::

    {"threshold_pct": 10,          # the backend's idle_gpu_util_pct the tracker was folded with
     "gpus": {"0": 1765090000.0,   # per GPU (by rank): Unix s from which each of its samples was below
              "1": null},          #   the threshold; null: its newest sample was at or above it
     "since": null,                # Unix s from which every GPU seen was below: the latest of ``gpus``,
                                   #   while all are below; else null (one busy GPU keeps the job busy)
     "last": 1765090300.0,         # the newest GPU sample's time, Unix s (the launcher's clock)
     "idle_s": 0.0,                # seconds in which every GPU seen was below: the cost of waste
     "gpu_last": {"0": 1765090300.0},   # per GPU: its newest sample's time, Unix s
     "gpu_idle_s": {"1": 120.0}}   # per GPU: seconds it was below while another GPU was not (per-GPU waste)

A job is idle for ``last − since`` seconds. The backend's ``idle_policy`` acts once that reaches its
``idle_minutes``: ``warn`` (a note, the ``job.idle`` notification) or ``stop`` (that and the cancel:
the trainer checkpoints on SIGTERM). A busy sample of any GPU ends the idle period; a later one is
told again. A job whose records carry no GPU figure (a CPU-only run, a node without NVML) has no GPU
in ``gpus`` and is never idle under a GPU policy.

``idle_s`` grows by the time between two consecutive GPU samples of the job (any node's) when every
GPU was below the threshold at the first of them; a gap longer than :func:`max_gap_s` (sampling off,
a restart) counts only that much. The waste is ``idle_s × instances × hourly price / 3600``
(:func:`waste_usd`): the whole job's machines, since its GPUs were all idle. GPUs idling while others
work are counted apart, per GPU (``gpu_idle_s``): the time between two consecutive samples of that
GPU when it was below the threshold at the first of them and the job was not wholly idle (another GPU
busy; judged when the later sample arrives), capped as ``idle_s`` is. Their cost is the GPU's share of
its machine: ``Σ gpu_idle_s × hourly price / processes per node / 3600`` (:func:`gpu_waste_usd`; a
rank per GPU), so a second is never counted twice.

What stopping saves (:func:`saving`) is the cost of the seconds the job would otherwise have run from
the moment it was found idle: to its projected end (:mod:`jobs.progress`) when its length and step
rate are known, never past its max runtime (which would stop it anyway); to its max runtime when its
length is unknown; at most what its budget has left.

A leaf module: it imports :mod:`jobs.cost` and :mod:`jobs.progress` only.
"""

from __future__ import annotations

import datetime as dt
import math
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Iterable, Mapping

from jobs import cost as costs
from jobs import progress

EVENT = "hardware"
"""The launcher's sample records (trainer_pkg.hardware.EVENT)."""
UTIL = "sys/gpu_util_pct"
"""The field read: one value per GPU of ``gpu_ranks``, % (trainer_pkg.hardware.GPU_FIELDS)."""
MAX_GPUS = 4096
"""GPUs a tracker keeps at most (more are not a launcher's: ignored)."""
MAX_INDEX = 1 << 20
"""Largest rank a record may name (as jobs.sync.MAX_HARDWARE_INDEX)."""
MIN_GAP_S = 60.0
"""The least of :func:`max_gap_s`, seconds."""
MAX_TIME = 253_402_300_800.0
"""Unix seconds of the year 10000: a later (or non-finite) time is not a sample's."""
MAX_USD = Decimal("99999999.9999")
"""The most ``TrainingJob.idle_saved_usd`` holds (12 digits, 4 decimals): a saving is never more. The job's
estimate (max runtime × nodes × price) is refused above it at submission, so only an instance count the
provider reports above the job's nodes could reach it."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _time(value: Any) -> float | None:
    value = _number(value)
    return value if value is not None and 0.0 <= value < MAX_TIME else None


def empty(threshold_pct: float) -> dict[str, Any]:
    """A tracker with no sample folded in."""
    return {"threshold_pct": threshold_pct, "gpus": {}, "since": None, "last": None, "idle_s": 0.0,
            "gpu_last": {}, "gpu_idle_s": {}}


def max_gap_s(record: Mapping[str, Any]) -> float:
    """The most seconds before ``record`` that count as idle: ``max(60, 2 × its interval_s)`` (the
    launcher's sampling interval, 5 s by default), so a gap in the samples is not counted whole."""
    interval = _number(record.get("interval_s"))
    return max(MIN_GAP_S, 2 * interval) if interval is not None and interval > 0 else MIN_GAP_S


def _gpu_samples(record: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``[(rank as text, util %), ...]`` of one record; [] when it has no GPU figures or they are
    malformed (``gpu_ranks`` not distinct ints in range, a list of another length). A GPU whose figure
    is None (the driver did not give it) is left out."""
    ranks, values = record.get("gpu_ranks"), record.get(UTIL)
    if not isinstance(ranks, list) or not isinstance(values, list) or len(ranks) != len(values):
        return []
    if not all(type(r) is int and 0 <= r <= MAX_INDEX for r in ranks) or len(set(ranks)) != len(ranks):
        return []
    return [(str(r), v) for r, v in zip(ranks, map(_number, values)) if v is not None and v >= 0]


def _clean(tracker: Mapping[str, Any] | None, threshold_pct: float) -> dict[str, Any]:
    """``tracker`` as this module writes it, or a new one: a malformed one (an older row, a hand edit)
    starts over; one folded with another threshold keeps only its ``idle_s`` (the past is not re-judged)."""
    out = empty(threshold_pct)
    if not isinstance(tracker, Mapping):
        return out
    idle_s = _number(tracker.get("idle_s"))
    out["idle_s"] = idle_s if idle_s is not None and idle_s >= 0 else 0.0
    out["gpu_idle_s"] = gpu_idle_s(tracker)
    gpus = tracker.get("gpus")
    if tracker.get("threshold_pct") != threshold_pct or not isinstance(gpus, Mapping):
        return out
    out["gpus"] = {str(k): _time(v) for k, v in list(gpus.items())[:MAX_GPUS]}
    seen = tracker.get("gpu_last")
    if isinstance(seen, Mapping):
        out["gpu_last"] = {str(k): t for k, v in list(seen.items())[:MAX_GPUS] if (t := _time(v)) is not None}
    out["last"] = _time(tracker.get("last"))
    out["since"] = _since(out["gpus"])
    return out


def _since(gpus: Mapping[str, float | None]) -> float | None:
    """When every GPU went below the threshold: the latest start among them; None while one is busy,
    or with no GPU."""
    starts = list(gpus.values())
    return max(starts) if starts and all(s is not None for s in starts) else None  # type: ignore[type-var]


def idle_after(tracker: Mapping[str, Any] | None, records: Iterable[Mapping[str, Any]],
               threshold_pct: float) -> dict[str, Any]:
    """The job's tracker (module docstring) after ``records`` (parsed records of log lines just stored,
    in log order; only ``hardware`` ones with GPU figures count), from its current one. A GPU is below
    when its ``sys/gpu_util_pct`` < ``threshold_pct`` (%). Records without a finite ``time`` and
    malformed GPU fields are skipped: a log line is never a reason to fail a sync. A record older than
    the newest folded (another node's, out of order) updates its GPUs but adds no idle seconds.
    Pure; work O(records × GPUs per record)."""
    out = _clean(tracker, threshold_pct)
    gpus: dict[str, float | None] = out["gpus"]
    seen: dict[str, float] = out["gpu_last"]
    alone: dict[str, float] = out["gpu_idle_s"]
    for record in records:
        if record.get("event") != EVENT:
            continue
        at = _time(record.get("time"))
        samples = _gpu_samples(record)
        if at is None or not samples:
            continue
        last = out["last"]
        whole = out["since"] is not None
        if whole and last is not None and at > last:
            out["idle_s"] += min(at - last, max_gap_s(record))
        for rank, util in samples:
            if rank not in gpus and len(gpus) >= MAX_GPUS:
                continue
            start = gpus.get(rank)
            before = seen.get(rank)
            if start is not None and not whole and before is not None and at > before:
                alone[rank] = alone.get(rank, 0.0) + min(at - before, max_gap_s(record))
            seen[rank] = at if before is None else max(before, at)
            gpus[rank] = None if util >= threshold_pct else at if start is None else min(start, at)
        out["last"] = at if last is None else max(last, at)
        out["since"] = _since(gpus)
    return out


def idle_for_s(tracker: Mapping[str, Any] | None) -> float:
    """Seconds the job has been idle as of its newest sample (``last − since``); 0 when it is not."""
    if not isinstance(tracker, Mapping):
        return 0.0
    since, last = _time(tracker.get("since")), _time(tracker.get("last"))
    return max(last - since, 0.0) if since is not None and last is not None else 0.0


def gpu_count(tracker: Mapping[str, Any] | None) -> int:
    """GPUs the tracker has seen."""
    gpus = tracker.get("gpus") if isinstance(tracker, Mapping) else None
    return len(gpus) if isinstance(gpus, Mapping) else 0


def waste_usd(*, idle_s: float, instances: int, hourly_price_usd: Decimal | float) -> Decimal:
    """The cost of waste, USD (4 decimals): ``idle_s × instances × hourly price / 3600``
    (:func:`jobs.cost.job_cost_usd`)."""
    return costs.job_cost_usd(billable_seconds=idle_s, instances=instances, hourly_price_usd=hourly_price_usd)


def tracker_idle_s(tracker: Mapping[str, Any] | None) -> float:
    """The tracker's ``idle_s`` (seconds, ≥ 0); 0 for a malformed one."""
    value = _number(tracker.get("idle_s")) if isinstance(tracker, Mapping) else None
    return value if value is not None and value > 0 else 0.0


def gpu_idle_s(tracker: Mapping[str, Any] | None) -> dict[str, float]:
    """The tracker's ``gpu_idle_s`` (module docstring): ``{GPU rank as text: seconds > 0}``, the
    malformed entries left out."""
    raw = tracker.get("gpu_idle_s") if isinstance(tracker, Mapping) else None
    if not isinstance(raw, Mapping):
        return {}
    return {str(k): v for k, raw_v in list(raw.items())[:MAX_GPUS] if (v := _number(raw_v)) is not None and v > 0}


def gpu_waste_usd(*, gpu_idle_s: float, procs_per_node: int, hourly_price_usd: Decimal | float) -> Decimal:
    """The cost of GPUs idling while others worked, USD (4 decimals, half up): ``gpu_idle_s`` (summed over
    the GPUs) × hourly price / ``procs_per_node`` (a GPU's share of its machine) / 3600."""
    seconds = Decimal(str(max(float(gpu_idle_s), 0.0)))
    usd = seconds * Decimal(str(hourly_price_usd)) / Decimal(max(int(procs_per_node or 1), 1)) / Decimal(3600)
    return usd.quantize(costs.CENT_FRACTION, rounding=ROUND_HALF_UP)


def what(tracker: Mapping[str, Any], threshold_pct: float) -> str:
    """``all 4 GPUs below 10% for 30 min`` (the minutes whole, rounded down)."""
    count = gpu_count(tracker)
    gpus = "the GPU" if count == 1 else f"all {count} GPUs"
    return f"{gpus} below {threshold_pct:g}% for {int(idle_for_s(tracker) // 60)} min"


def saving(job: Any, at: dt.datetime) -> tuple[Decimal, str]:
    """What stopping ``job`` at ``at`` (aware; the moment it was found idle) saves, USD (4 decimals),
    and the sum behind it (module docstring), e.g. ``"5340 s left of its max runtime × 2 nodes ×
    $7.20/h = $21.36"``. Reads the job's cost columns, ``started_at``/``first_step_at``,
    ``max_runtime_s``, ``budget_usd`` and :data:`jobs.progress.READ_FIELDS`; no query."""
    price = Decimal(str(job.hourly_price_usd or 0))
    instances = max(int(job.instance_count or job.nodes or 1), 1)
    start = job.started_at or job.first_step_at
    limit_s = float(job.max_runtime_s or 0)
    left_s = max(limit_s - (at - start).total_seconds(), 0.0) if start is not None else limit_s
    why = "left of its max runtime"
    projected = progress.job_progress(job, at)
    if projected is not None and projected.finish_at is not None:
        to_end = max((projected.finish_at - at).total_seconds(), 0.0)
        if to_end < left_s:
            left_s, why = to_end, "to its projected end"
    saved = min(costs.job_cost_usd(billable_seconds=left_s, instances=instances, hourly_price_usd=price), MAX_USD)
    nodes = f"{instances} node{'' if instances == 1 else 's'}"
    places = costs.usd_places(saved)
    text = f"{left_s:.0f} s {why} × {nodes} × {costs.format_usd_per_hour(price)}"
    if job.budget_usd is not None:
        budget_left = max(Decimal(job.budget_usd) - Decimal(job.cost_usd or 0), Decimal(0))
        if budget_left < saved:
            places = costs.usd_places(saved, budget_left)
            text += (f" = {costs.format_usd(saved, places)}, capped at the {costs.format_usd(budget_left, places)} "
                     f"its budget has left")
            return budget_left.quantize(costs.CENT_FRACTION), text
    return saved, f"{text} = {costs.format_usd(saved, places)}"


def reason(tracker: Mapping[str, Any], threshold_pct: float, saved: Decimal, arithmetic: str, *, stop: bool) -> str:
    """The line for the timeline, the notification and (``stop``) the cancel: ``Idle: all 4 GPUs
    below 10% for 30 min; stopping it saves $21.36 (5340 s left of its max runtime × 2 nodes ×
    $7.20/h = $21.36)`` (``would save`` for a warning)."""
    verb = "stopping it saves" if stop else "stopping it would save"
    return f"Idle: {what(tracker, threshold_pct)}; {verb} {costs.format_usd(saved)} ({arithmetic})"


def at_datetime(seconds: float) -> dt.datetime:
    """Unix seconds as an aware UTC datetime."""
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc)
