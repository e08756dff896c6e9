"""The network preflight on the dashboard's side (issue 30): the launcher's ``preflight`` record
(trainer_pkg/preflight.py), read from the job's log by the sync, kept on the job
(``TrainingJob.preflight``) and shown on its page and in the API.

Every rank measured the all-reduce bus bandwidth and latency and each node pair's bandwidth before the
run's first step; rank 0 printed one record. When the backend's minimum bus bandwidth or maximum latency
was not met, the record's ``reason`` says so, naming the slow node or pair, every rank exited, and the
sync leads the FAILED job's reason with it (``TrainingJob.trainer_failure_reason``).

``preflight`` (JSON, :func:`from_record`): ``{"time": unix s, "world_size", "nodes", "backend", "device",
"busbw_gbps", "algbw_gbps", "latency_us", "sizes": [{"bytes", "time_us", "algbw_gbps", "busbw_gbps"}],
"pairs": [{"units": [a, b], "ranks": [ra, rb], "hosts": [ha, hb], "gbps"}] (slowest first),
"pairs_measured", "pair_unit": "node" | "rank", "slow_unit": {"unit", "name"} | None, "duration_s",
"min_busbw_gbps", "max_latency_us", "ok": bool, "reason": str}``. A record is the job's own output,
never trusted: every number is checked finite and ≥ 0, every string cut, every list bounded.

A leaf module: it imports nothing from the project.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

EVENT = "preflight"
"""The record's ``event`` (trainer_pkg.preflight.EVENT)."""
MAX_SIZES = 16
"""Sizes kept."""
MAX_PAIRS = 32
"""Node pairs kept (the launcher lists the slowest first)."""
MAX_TEXT = 200
"""Characters kept of a host name, backend or unit name."""
MAX_REASON = 1000
"""Characters kept of the reason."""


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return float(value) if ok else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


def _text(value: Any, most: int = MAX_TEXT) -> str:
    return value[:most] if isinstance(value, str) else ""


def _pair(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, Mapping):
        return None
    units, ranks, hosts = raw.get("units"), raw.get("ranks"), raw.get("hosts")
    gbps = _number(raw.get("gbps"))
    if gbps is None or not isinstance(units, list) or len(units) != 2 or any(_int(u) is None for u in units):
        return None
    return {"units": list(units), "gbps": gbps,
            "ranks": list(ranks) if isinstance(ranks, list) and len(ranks) == 2 and all(
                _int(r) is not None for r in ranks) else [],
            "hosts": [_text(h) for h in hosts] if isinstance(hosts, list) and len(hosts) == 2 else []}


def from_record(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The job's ``preflight`` (module docstring) from one ``preflight`` record; None for a record
    without a finite ``time`` (not a launcher's). Figures that are missing or malformed are None
    (a preflight that could not complete has none, only its reason)."""
    at = _number(record.get("time"))
    if record.get("event") != EVENT or at is None:
        return None
    sizes = []
    for raw in record.get("sizes") if isinstance(record.get("sizes"), list) else []:
        if isinstance(raw, Mapping) and _int(raw.get("bytes")) is not None:
            sizes.append({"bytes": raw["bytes"], **{k: _number(raw.get(k))
                                                     for k in ("time_us", "algbw_gbps", "busbw_gbps")}})
    pairs = [p for p in map(_pair, record.get("pairs") if isinstance(record.get("pairs"), list) else []) if p]
    slow = record.get("slow_unit")
    reason = _text(record.get("reason"), MAX_REASON).strip()
    return {
        "time": at, "world_size": _int(record.get("world_size")), "nodes": _int(record.get("nodes")),
        "backend": _text(record.get("backend"), 20), "device": _text(record.get("device"), 20),
        **{k: _number(record.get(k)) for k in ("busbw_gbps", "algbw_gbps", "latency_us", "duration_s",
                                              "min_busbw_gbps", "max_latency_us")},
        "sizes": sizes[:MAX_SIZES],
        "pairs": sorted(pairs, key=lambda p: p["gbps"])[:MAX_PAIRS],
        "pairs_measured": _int(record.get("pairs_measured")),
        "pair_unit": "node" if record.get("pair_unit") == "node" else "rank",
        "slow_unit": ({"unit": slow["unit"], "name": _text(slow.get("name"))}
                      if isinstance(slow, Mapping) and _int(slow.get("unit")) is not None else None),
        "ok": record.get("ok") is True and not reason, "reason": reason,
    }


def summary(preflight: Mapping[str, Any]) -> str:
    """One line for the job's timeline: ``Preflight passed: all-reduce bus bandwidth 1.2 GB/s, latency
    393 µs, slowest pair 2.73 GB/s (2 ranks on 1 node, gloo)``, or ``Preflight failed: <reason>``."""
    if not preflight.get("ok"):
        reason = preflight.get("reason") or "the network check failed"
        return reason if reason.startswith("Preflight") else f"Preflight failed: {reason}"
    pairs = preflight.get("pairs") or []
    figures = [f"all-reduce bus bandwidth {preflight['busbw_gbps']:.3g} GB/s" if preflight.get("busbw_gbps") is not None
               else "", f"latency {preflight['latency_us']:.0f} µs" if preflight.get("latency_us") is not None else "",
               f"slowest pair {pairs[0]['gbps']:.3g} GB/s" if pairs else ""]
    nodes = preflight.get("nodes") or 1
    shape = f"{preflight.get('world_size')} ranks on {nodes} node{'s' if nodes != 1 else ''}, {preflight.get('backend')}"
    return f"Preflight passed: {', '.join(f for f in figures if f)} ({shape})"
