"""Hang detection on the dashboard's side (issue 30): what the job page shows of a run that stopped
stepping, and when.

Two sources flag a RUNNING job (``TrainingJob.hung_at``, ``TrainingJob.hang``):

- the launcher (trainer_pkg/hang.py), on the node of rank 0, where it started the ranks: one ``hang``
  record per rank in the job's log, with the last step, its time, the deadline and the rank's threads'
  stacks. The sync folds them into the job (:func:`hang_after`); the records of one stall share their
  ``time``, the detection time.
- the recovery sweep (:func:`silent_for`), for every backend, from the progress columns alone: no new
  record for :func:`deadline_s` seconds. It carries no stack (where the launcher does not watch: a GPU
  box's torchrun, a node other than rank 0's, a launcher that itself hangs); the launcher's records,
  when they come, replace it.

A newer training record (a step after the detection) clears the flag: the run was slow, not stuck.
The backend's ``hang_policy`` says what follows the flag: ``flag`` (the default) or ``cancel``.

``hang`` (JSON): ``{"source": "launcher" | "sweep", "detected_at": unix s, "step": int | None,
"step_time": unix s | None, "deadline_s": s, "ranks": [{"rank", "where", "threads": [{"thread",
"main", "frames": [{"file", "line", "function"}]}]}]}`` — ranks sorted, at most :data:`MAX_RANKS`,
every string cut to :data:`MAX_TEXT` characters: a record is the job's own output, never trusted.

A leaf module: it imports nothing from the project.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any, Iterable, Mapping

MIN_DEADLINE_S = 600.0
"""The default deadline's floor, seconds (the launcher's: trainer_pkg.hang.MIN_DEADLINE_S)."""
STEP_TIMES = 20
"""The default deadline in steps (trainer_pkg.hang.STEP_TIMES)."""
MAX_RANKS = 256
"""Ranks whose ``where`` a job keeps (a larger run keeps the first ones; the log holds them all)."""
MAX_STACK_RANKS = 32
"""Ranks whose threads a job keeps too (the first to arrive); the others keep their ``where`` only, so a
job's ``hang`` stays under about 300 kB whatever the run's size."""
MAX_THREADS = 4
"""Threads per rank kept (the main thread first, as the launcher sorts them)."""
MAX_FRAMES = 24
"""Frames per thread kept, innermost first."""
MAX_TEXT = 300
"""Characters kept of a file name, function or ``where``."""
TRAINING_EVENTS = frozenset({"started", "step", "epoch"})
"""Records that show the run stepping (as jobs.sync.TRAINING_EVENTS)."""


def deadline_s(recent: Iterable[Any], override_s: int | float | None = None) -> float:
    """Seconds with no new record before a RUNNING job is hung: ``override_s`` (the backend's
    ``hang_deadline_s``) when it is a positive number, else ``max(600, 20 × seconds per step,
    3 × seconds between records)`` over ``recent`` (``progress_recent``: [[step, unix s], ...], oldest
    first; malformed pairs are skipped; fewer than two: 600), as the launcher computes it."""
    if isinstance(override_s, (int, float)) and not isinstance(override_s, bool) and override_s > 0:
        return float(override_s)
    points = [(p[0], p[1]) for p in recent if isinstance(p, (list, tuple)) and len(p) == 2
              and all(_number(v) for v in p)] if isinstance(recent, (list, tuple)) else []
    longest = MIN_DEADLINE_S
    if len(points) >= 2:
        (s0, t0), (s1, t1) = points[0], points[-1]
        if t1 > t0:
            if s1 > s0:
                longest = max(longest, STEP_TIMES * (t1 - t0) / (s1 - s0))
            longest = max(longest, 3 * (t1 - t0) / (len(points) - 1))
    return longest


def silent_for(progress_at: dt.datetime | None, now: dt.datetime) -> float | None:
    """Seconds since the newest record (``progress_at``, the trainer's clock), or None before one."""
    return None if progress_at is None else (now - progress_at).total_seconds()


def sweep_hang(*, step: int | None, step_at: dt.datetime | None, deadline: float, now: dt.datetime) -> dict[str, Any]:
    """The ``hang`` of a job the recovery sweep found silent: no stacks (module docstring)."""
    return {"source": "sweep", "detected_at": now.timestamp(), "step": step,
            "step_time": step_at.timestamp() if step_at else None, "deadline_s": deadline, "ranks": []}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any, low: int = 0, high: int = 2**62) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high else None


def _text(value: Any) -> str:
    return value[:MAX_TEXT] if isinstance(value, str) else ""


def _threads(raw: Any) -> list[dict[str, Any]]:
    out = []
    for thread in (raw if isinstance(raw, list) else [])[:MAX_THREADS]:
        if not isinstance(thread, dict):
            continue
        frames = [{"file": _text(f.get("file")), "line": _int(f.get("line"), 0, 2**31) or 0,
                   "function": _text(f.get("function"))}
                  for f in (thread.get("frames") if isinstance(thread.get("frames"), list) else [])[:MAX_FRAMES]
                  if isinstance(f, dict)]
        out.append({"thread": _text(thread.get("thread")), "main": thread.get("main") is True, "frames": frames})
    return out


def hang_after(hung_at: dt.datetime | None, hang: Mapping[str, Any] | None,
               records: Iterable[Mapping[str, Any]]) -> tuple[dt.datetime | None, dict[str, Any]]:
    """The job's ``(hung_at, hang)`` after ``records`` (parsed log records, in log order), from its
    current ones. A ``hang`` record of a new stall (another ``time``) starts a new ``hang``; one of the
    same stall adds its rank; a training record later than the detection clears both. A malformed
    hang record (no rank, no finite time) is skipped. Pure: no query."""
    current = dict(hang or {})
    for record in records:
        event = record.get("event")
        at = record.get("time")
        if not _number(at):
            continue
        if event in TRAINING_EVENTS and hung_at is not None and at > hung_at.timestamp():
            hung_at, current = None, {}
            continue
        rank = _int(record.get("rank"), 0, 2**31)
        if event != "hang" or rank is None:
            continue
        if current.get("source") != "launcher" or current.get("detected_at") != at:
            current = {"source": "launcher", "detected_at": at,
                       "step": _int(record.get("step")),
                       "step_time": record.get("step_time") if _number(record.get("step_time")) else None,
                       "deadline_s": record.get("deadline_s") if _number(record.get("deadline_s")) else None,
                       "ranks": []}
            hung_at = dt.datetime.fromtimestamp(at, dt.timezone.utc)
        ranks = [r for r in current["ranks"] if r["rank"] != rank]
        stacks = sum(1 for r in ranks if r["threads"])
        if len(ranks) < MAX_RANKS:
            ranks.append({"rank": rank, "where": _text(record.get("where")),
                          "threads": _threads(record.get("threads")) if stacks < MAX_STACK_RANKS else []})
        current["ranks"] = sorted(ranks, key=lambda r: r["rank"])
    return hung_at, current


def hang_reason(hang: Mapping[str, Any]) -> str:
    """One line for the timeline, a notification and a cancel's reason: ``No new step for 2 s after
    step 1; rank 0: in all_reduce, train.py:15; rank 1: in <module>, train.py:14`` (at most 4 ranks
    named, then how many more)."""
    deadline = hang.get("deadline_s")
    step = hang.get("step")
    text = f"No new step for {deadline:.0f} s" if _number(deadline) else "No new step"
    text += f" after step {step}" if isinstance(step, int) else " (no step reported)"
    ranks = [r for r in hang.get("ranks") or [] if isinstance(r, dict)]
    named = [f"rank {r.get('rank')}: {r.get('where') or 'no stack'}" for r in ranks[:4]]
    if len(ranks) > 4:
        named.append(f"{len(ranks) - 4} more rank(s) on the job page")
    if not ranks:
        named.append("no stacks (the launcher did not report them)")
    return "; ".join([text, *named])
