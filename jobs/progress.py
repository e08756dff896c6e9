"""Progress, time left and the projected final cost of a job with a known length (issue 30).

What the sync keeps on the job while it reads the job's log (:func:`progress_after`), from the
trainer's records (each carries ``total_steps``, the optimizer steps the run takes) and a user
script's (``trainer_pkg.report.progress(total=...)``; its ``report.log`` records then carry it too):

- ``progress_total_steps``: the run's length in steps; None = no known length (no figures at all);
- ``progress_step``: the step of the newest record, and ``progress_at`` its time (the trainer's clock);
- ``progress_recent``: ``[[step, unix seconds], ...]``, the last :data:`RECENT_RECORDS` records of the
  current run (a resumed run starts a new list: the restart's gap is no step time);
- ``progress_steps_per_s``: the step rate over them, ``(last step − first step) / (last time − first
  time)``; None until two records are a step and a moment apart.

Everything else is arithmetic on those columns and the job's cost columns (:func:`job_progress`),
so the job list, the API and /metrics read no metric point: a request's cost does not grow with the
run (DESIGN.md §9).

    fraction           = step / total (at most 1)
    finish_at          = progress_at + (total − step) / steps_per_s
    time left          = finish_at − now (at least 0)
    projected cost     = cost_usd + (finish_at − last_synced_at) × instances × hourly price / 3600

A job flagged hung (``hung_at`` set while RUNNING: no new step for its hang deadline, :mod:`jobs.hangs`;
a newer step clears the flag) has no end to project from its step rate: it bills until its max
runtime, so it gets no time left and its cost is projected to the end of its max runtime instead:

    max runtime end    = (started_at, else first_step_at) + max_runtime_s
    projected cost     = cost_usd + (max runtime end − last_synced_at) × instances × hourly price / 3600

``cost_usd`` is the cost up to the sync that wrote it (``last_synced_at``), so only the seconds after
it are added, priced by :func:`jobs.cost.job_cost_usd` at the job's frozen hourly price. A spot job is
projected at its own hourly price as if not interrupted (on SageMaker, whose managed spot bills fewer
seconds than it runs, that is an upper bound); a job whose hourly price is 0 (a GPU box without a
rate, a price the catalog did not know) projects no more than its cost so far, and says so
(:attr:`Progress.price_known`).

A leaf module: it imports :mod:`jobs.cost` only.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from decimal import Decimal
from typing import Any, Iterable, Mapping

from jobs import cost as costs

RECENT_RECORDS = 8
"""Records the step rate is measured over (the trainer writes one about every ``train.log_every_s``,
1 s by default: the rate of the last few seconds to minutes, not the run's average)."""
MAX_STEPS = 2**62
"""Largest step or total taken from a record (a bigint column); a larger one is ignored."""
MAX_ETA_S = 10 * 366 * 86_400
"""Time left beyond which nothing is projected (10 years): the rate is too low to mean anything, and
the end would not fit a date."""
PROGRESS_EVENTS = frozenset({"started", "step", "epoch", "completed", "stopped", "failed"})
"""Records whose ``step`` is the number of steps done (trainer_pkg/metrics.py); a script's
``report.log`` and ``report.progress`` records are ``step`` records."""
PROGRESS_FIELDS = ("progress_total_steps", "progress_step", "progress_at", "progress_steps_per_s",
                   "progress_recent")
"""The job's columns :func:`progress_after` writes."""
READ_FIELDS = ("progress_total_steps", "progress_step", "progress_at", "progress_steps_per_s", "state",
               "cost_usd", "last_synced_at", "instance_count", "nodes", "hourly_price_usd", "spot", "hung_at",
               "max_runtime_s", "started_at", "first_step_at")
"""The job's columns :func:`job_progress` reads: a list that loads fewer (``.only()``) pays a query per row."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """A job's progress as of ``now``. Seconds are wall-clock seconds; money is USD.

    ``total_steps``, ``step``: the run's length and the steps done (the newest record's);
    ``fraction``: ``step / total_steps`` in [0, 1]; ``steps_per_s``: the recent step rate, None until
    measured; ``eta_s``: seconds left from ``now`` (0 once ``finish_at`` has passed with no newer
    record: the arithmetic then says so), ``finish_at``: when the last step is projected to end,
    and ``projected_cost_usd``: the final cost projected (4 decimals) — all three None unless the
    job is RUNNING with a measured rate; a hung job (``hung``: flagged hung while RUNNING) has no
    ``eta_s`` nor ``finish_at``, and its ``projected_cost_usd`` is to the end of its max runtime
    (None when its start is unknown); ``price_known``: False when the hourly price is 0 (the
    projection then adds nothing to the cost so far); ``arithmetic``: the sums behind the figures,
    e.g. ``"200 of 1000 steps at 2.00 steps/s: 400 s left after the last record; $0.05 so far +
    390 s × 2 nodes × $3.60/h = $0.83"`` (money at the precision of the two figures)."""

    total_steps: int
    step: int
    fraction: float
    steps_per_s: float | None
    eta_s: float | None
    finish_at: dt.datetime | None
    projected_cost_usd: Decimal | None
    price_known: bool
    arithmetic: str
    hung: bool = False

    @property
    def percent(self) -> float:
        """``fraction`` × 100."""
        return self.fraction * 100.0


def _step(value: Any) -> int | None:
    """``value`` as a step count: an int (not a bool) in [0, :data:`MAX_STEPS`], else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEPS:
        return None
    return value


def _time(value: Any) -> float | None:
    """``value`` as Unix seconds: a finite int or float (not a bool) in year 1970–9999, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if 0.0 <= value < 253_402_300_800.0 else None  # rejects NaN and ±inf too


def record_total(record: Mapping[str, Any]) -> int | None:
    """The ``total_steps`` a record carries (an int ≥ 1), else None."""
    total = _step(record.get("total_steps"))
    return total if total else None


def steps_per_s(recent: Iterable[Iterable[Any]]) -> float | None:
    """The step rate over ``recent`` (``[[step, unix seconds], ...]``, oldest first): steps between
    the first and the last over the seconds between them; None when either difference is not
    positive (one record, or records of one moment)."""
    pairs = list(recent)
    if len(pairs) < 2:
        return None
    (s0, t0), (s1, t1) = pairs[0], pairs[-1]
    if s1 <= s0 or t1 <= t0:
        return None
    return (s1 - s0) / (t1 - t0)


def progress_after(current: Mapping[str, Any], records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The job's :data:`PROGRESS_FIELDS` after ``records`` (the parsed metric records of log lines
    just stored, in log order), from ``current`` (the same fields as the row holds them).

    A record counts when its ``event`` is one of :data:`PROGRESS_EVENTS` and it has a ``step``
    (int ≥ 0) and a ``time`` (Unix seconds); its ``total_steps`` (int ≥ 1), when present, becomes
    the job's length (the latest one given wins: a script may correct its estimate). A ``started``
    record, or a step lower than the newest kept one (a resumed run), starts the recent list over.
    Malformed records are skipped: a log line is never a reason to fail a sync. Work and memory are
    O(records) and O(:data:`RECENT_RECORDS`)."""
    out = {field: current.get(field) for field in PROGRESS_FIELDS}
    recent = [list(p) for p in (out["progress_recent"] or []) if isinstance(p, (list, tuple)) and len(p) == 2]
    for record in records:
        total = record_total(record)
        if total is not None:
            out["progress_total_steps"] = total
        if record.get("event") not in PROGRESS_EVENTS:
            continue
        step, at = _step(record.get("step")), _time(record.get("time"))
        if step is None or at is None:
            continue
        if record.get("event") == "started" or (recent and step < recent[-1][0]):
            recent = []
        recent = [*recent, [step, at]][-RECENT_RECORDS:]
        out["progress_step"] = step
        out["progress_at"] = dt.datetime.fromtimestamp(at, tz=dt.timezone.utc)
    out["progress_recent"] = recent
    out["progress_steps_per_s"] = steps_per_s(recent)
    return out


def _rate(steps_per_s: float) -> str:
    """``2.00``, ``0.0031``: two decimals, or two significant digits below 0.01."""
    return f"{steps_per_s:.2f}" if steps_per_s >= 0.01 else f"{steps_per_s:.2g}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def job_progress(job: Any, now: dt.datetime) -> Progress | None:
    """``job``'s :class:`Progress` at ``now`` (an aware datetime), from its columns
    (:data:`READ_FIELDS`) alone; None when the job has no known length (no ``progress_total_steps``)
    or no step yet. The time left and the projected cost only while the job is RUNNING and its step
    rate is measured."""
    total, step = job.progress_total_steps, job.progress_step
    if not total or step is None:
        return None
    fraction = min(step / total, 1.0)
    rate = job.progress_steps_per_s
    price = Decimal(str(job.hourly_price_usd or 0))
    done = f"{step} of {total} steps"
    if job.state == "RUNNING" and getattr(job, "hung_at", None) is not None:
        return _hung_progress(job, now, fraction, rate, price, done)
    if job.state != "RUNNING" or not rate or rate <= 0 or job.progress_at is None:
        why = "" if job.state != "RUNNING" else "; no step rate yet"
        return Progress(total, step, fraction, rate, None, None, None, price > 0, done + why)
    left_after_record = max(total - step, 0) / rate
    try:
        if left_after_record > MAX_ETA_S:
            raise OverflowError
        finish_at = job.progress_at + dt.timedelta(seconds=left_after_record)
    except OverflowError:  # past MAX_ETA_S, or past the year 9999
        return Progress(total, step, fraction, rate, None, None, None, price > 0,
                        f"{done} at {_rate(rate)} steps/s: more than 10 years left, not projected")
    eta_s = max((finish_at - now).total_seconds(), 0.0)
    projected, priced = _projected(job, finish_at, now, price)
    arithmetic = f"{done} at {_rate(rate)} steps/s: {left_after_record:.0f} s left after the last record; {priced}"
    if finish_at < now:
        # A slowed or hung run: its newest record projected an end that has passed.
        late_s = (now - finish_at).total_seconds()
        arithmetic += f" (the projected end passed {late_s:.0f} s ago with no newer record read)"
    return Progress(total, step, fraction, rate, eta_s, finish_at, projected, price > 0, arithmetic + _price_note(job, price))


def _projected(job: Any, until: dt.datetime, now: dt.datetime, price: Decimal) -> tuple[Decimal, str]:
    """The cost projected to ``until`` (4 decimals) and its sum, ``"$0.05 so far + 390 s × 2 nodes ×
    $3.60/h = $0.83"``: ``cost_usd`` + the seconds from the last sync (else ``now``) to ``until``."""
    more_s = max((until - (job.last_synced_at or now)).total_seconds(), 0.0)
    instances = max(int(job.instance_count or job.nodes or 1), 1)
    projected = job.cost_usd + costs.job_cost_usd(billable_seconds=more_s, instances=instances, hourly_price_usd=price)
    places = costs.usd_places(job.cost_usd, projected)
    return projected, (f"{costs.format_usd(job.cost_usd, places)} so far + {more_s:.0f} s × "
                       f"{_plural(instances, 'node')} × {costs.format_usd_per_hour(price)} = "
                       f"{costs.format_usd(projected, places)}")


def _price_note(job: Any, price: Decimal) -> str:
    if price <= 0:
        return " (no hourly price known: the rest is not priced)"
    return " (spot: priced as if not interrupted)" if job.spot else ""


def max_runtime_end(job: Any) -> dt.datetime | None:
    """When ``job``'s max runtime runs out: its start (``started_at``, else ``first_step_at``) +
    ``max_runtime_s``; None when neither start is known or it has no max runtime."""
    start = getattr(job, "started_at", None) or getattr(job, "first_step_at", None)
    limit_s = getattr(job, "max_runtime_s", None)
    if start is None or not limit_s:
        return None
    try:
        return start + dt.timedelta(seconds=int(limit_s))
    except OverflowError:
        return None


def _hung_progress(job: Any, now: dt.datetime, fraction: float, rate: float | None, price: Decimal,
                   done: str) -> Progress:
    """A hung job's :class:`Progress`: no time left, the cost projected to the end of its max runtime."""
    hung_at = job.hung_at.astimezone(dt.timezone.utc)
    head = f"{done}; hung since {hung_at:%Y-%m-%d %H:%M:%S} UTC: it bills until its max runtime"
    end = max_runtime_end(job)
    if end is None:
        return Progress(job.progress_total_steps, job.progress_step, fraction, rate, None, None, None, price > 0,
                        f"{head} (its start is not known: not projected)", hung=True)
    projected, priced = _projected(job, end, now, price)
    return Progress(job.progress_total_steps, job.progress_step, fraction, rate, None, None, projected, price > 0,
                    f"{head} ({end:%Y-%m-%d %H:%M:%S} UTC); {priced}{_price_note(job, price)}", hung=True)
