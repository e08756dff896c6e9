"""A TrainJob's logs from its pods' container logs, rank 0 first, with a resumable cursor.

The pods of a TrainJob carry ``jobset.sigs.k8s.io/jobset-name=<trainjob>`` (JobSet labels every
pod of the JobSet the Trainer controller makes); rank 0 is the pod with job index 0 and completion
index 0 (labels ``jobset.sigs.k8s.io/job-index``, ``batch.kubernetes.io/job-completion-index``).
Each pod's trainer container (``node`` in the torch runtime) is read with
``GET …/pods/<pod>/log?timestamps=true&sinceSeconds=…&limitBytes=…`` (core/v1 PodLogOptions,
kubernetes.io API reference): every line comes with the kubelet's RFC3339Nano timestamp in front.

The official client (``CoreV1Api.read_namespaced_pod_log``) has no ``sinceTime``, so a pod is read
from ``sinceSeconds`` = the seconds since its last returned line + :data:`CLOCK_MARGIN_S` (the
worker's and the node's clocks may differ), and lines at or before the cursor are dropped.

Cursor: JSON ``{"<pod>": ["<timestamp of the last line returned>", <lines returned at exactly that
timestamp>]}``; a pod not in it is read from its start. A last line without its newline (cut by
``limitBytes``, or still being written) is left for the next call.

Line format: the text after the timestamp. With more than one pod a line is prefixed ``[node N] ``
(N the completion index) — except a line carrying a trainer metric record
(:data:`trainer_pkg.metrics.METRIC_PREFIX`), passed exactly as printed for the dashboard's
``parse_metric_line``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from typing import Callable, Mapping, Sequence

from cloud_adapters.base import InvalidSpec
from cloud_adapters.kubernetes.states import PodView
from trainer_pkg.metrics import METRIC_PREFIX

MAX_BYTES = 1 << 20  # limitBytes per pod per logs() call; the dashboard calls again for more
CLOCK_MARGIN_S = 300  # seconds of clock difference between the worker and a node that lose no line
TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:Z|[+-]\d{2}:\d{2})) ?(.*)", re.S)

Fetch = Callable[[PodView, int | None, int], bytes | None]
"""``fetch(pod, since_seconds or None for all, limit_bytes)`` → the pod log's bytes (with
timestamps); None when the pod has no log to read (not started, gone)."""


def parse_cursor(cursor: str) -> dict[str, tuple[str, int]]:
    """``{pod: (last timestamp, lines at it)}`` from a cursor ("" = nothing read). Raises
    :class:`InvalidSpec` for a cursor this module did not write."""
    if not cursor:
        return {}
    try:
        data = json.loads(cursor)
    except ValueError:
        raise InvalidSpec(f"log cursor is not JSON: {cursor[:100]!r}") from None
    ok = isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
        and isinstance(v[1], int) and not isinstance(v[1], bool) and v[1] >= 0 for k, v in data.items())
    if not ok:
        raise InvalidSpec(f"log cursor must be {{pod: [timestamp, count]}}, got {cursor[:100]!r}")
    return {k: (v[0], v[1]) for k, v in data.items()}


def format_cursor(positions: Mapping[str, tuple[str, int]]) -> str:
    return json.dumps({k: list(v) for k, v in sorted(positions.items())}, separators=(",", ":"))


def _ns(stamp: str) -> int | None:
    """Nanoseconds since the epoch of an RFC3339(Nano) timestamp, None when it is not one."""
    match = re.fullmatch(r"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2})", stamp)
    if not match:
        return None
    base, fraction, zone = match.groups()
    try:
        moment = dt.datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone))
    except ValueError:
        return None
    return int(moment.timestamp()) * 1_000_000_000 + int((fraction or "").ljust(9, "0") or 0)


def since_seconds(stamp: str, now: dt.datetime) -> int:
    """``sinceSeconds`` that covers the line at ``stamp`` when asked at ``now``, with the margin."""
    ns = _ns(stamp)
    if ns is None:
        return 0
    return max(1, math.ceil(now.timestamp() - ns / 1e9) + CLOCK_MARGIN_S)


def read_new(pods: Sequence[PodView], cursor: str, fetch: Fetch, now: dt.datetime,
             max_bytes: int = MAX_BYTES) -> tuple[list[str], str]:
    """New complete lines of ``pods`` since ``cursor``, rank 0's first, and the next cursor.
    ``now``: the worker's time (UTC), for ``sinceSeconds``."""
    positions = parse_cursor(cursor)
    ordered = sorted(pods, key=lambda p: p.order)
    prefix = len(ordered) > 1
    lines: list[str] = []
    for pod in ordered:
        last = positions.get(pod.name)
        data = fetch(pod, since_seconds(last[0], now) if last else None, max_bytes)
        if not data:
            continue
        end = data.rfind(b"\n")
        if end < 0:
            continue  # one partial line: read whole next time
        last_ns = _ns(last[0]) if last else None
        stamp, at_stamp = last if last else ("", 0)
        seen_at_last = 0
        for raw in data[: end + 1].decode("utf-8", errors="replace").split("\n")[:-1]:
            match = TIMESTAMP.fullmatch(raw.rstrip("\r"))
            if not match:
                continue  # not a kubelet log line (no timestamp): nothing to order it by
            line_stamp, text = match.groups()
            line_ns = _ns(line_stamp)
            if last_ns is not None and line_ns is not None:
                if line_ns < last_ns:
                    continue
                if line_ns == last_ns:
                    seen_at_last += 1
                    if seen_at_last <= last[1]:
                        continue
            if line_stamp == stamp:
                at_stamp += 1
            else:
                stamp, at_stamp = line_stamp, 1
            lines.append(text if not prefix or METRIC_PREFIX in text else f"[node {pod.completion_index}] {text}")
        positions[pod.name] = (stamp, at_stamp)
        if not stamp:
            positions.pop(pod.name, None)
    return lines, format_cursor(positions)
