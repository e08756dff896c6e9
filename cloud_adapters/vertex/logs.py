"""Tail a Vertex AI custom job's Cloud Logging entries with a resumable cursor.

Vertex AI writes a custom job's container output to Cloud Logging under the monitored resource
``ml_job`` with ``resource.labels.job_id`` = the job's numeric id and ``resource.labels.task_name``
= the replica (``workerpool0-0``, ``workerpool1-0`` …; the node names of clouds.md §2.1). (The
resource type is Google's "ml_job" monitored resource used by Vertex training logs; it is not among
clouds.md's local checks.) google-cloud-logging is not a Trainboard dependency, so entries are read
with the REST method ``POST https://logging.googleapis.com/v2/entries:list`` (body ``resourceNames``,
``filter``, ``orderBy``, ``pageSize``, ``pageToken``; answer ``entries`` + ``nextPageToken``)
through an HTTP session (google-auth's ``AuthorizedSession`` in production).

Cursor: JSON ``{"ts": "<timestamp of the last entry returned>", "id": "<its insertId>"}``. The next
call asks for ``timestamp >= ts`` in ``timestamp asc`` order (Cloud Logging orders equal timestamps
by ``insertId``) and skips entries up to and including ``(ts, id)``, so an entry is returned once
even when several share a timestamp. Without a cursor the query starts at the job's create time.

Line format: ``textPayload``, or ``jsonPayload.message`` (the JSON object when it has none), without
a trailing newline, one line per ``\\n``. In a job of more than one replica a line is prefixed with
the replica, ``[workerpool1-0] `` — except a line carrying a trainer metric record
(``trainer_pkg.metrics.METRIC_PREFIX``): it is returned exactly as printed, for the dashboard's
``parse_metric_line``.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any, Callable, TypeVar

from cloud_adapters.base import InvalidSpec
from trainer_pkg.metrics import METRIC_PREFIX

T = TypeVar("T")

LOGGING_ENDPOINT = "https://logging.googleapis.com"
MAX_LINES = 2000  # lines per logs() call; the dashboard calls again for more
PAGE_SIZE = 1000  # entries:list pageSize (the API's maximum)
TASK_LABEL = "ml.googleapis.com/task_name"  # entry label naming the replica when the resource lacks it

_TS = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")


def timestamp_key(value: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 timestamp (Cloud Logging's ``timestamp``).

    Raises ValueError for another format."""
    m = _TS.fullmatch(value or "")
    if not m:
        raise ValueError(f"not an RFC 3339 timestamp: {value!r}")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    base = dt.datetime.fromisoformat(m.group(1) + zone)
    return int(base.timestamp()) * 1_000_000_000 + int((m.group(2) or "0").ljust(9, "0"))


def parse_cursor(cursor: str) -> tuple[str, str] | None:
    """``(timestamp, insertId)`` of a cursor; None for "". Raises :class:`InvalidSpec` for a cursor
    this module did not write."""
    if not cursor:
        return None
    try:
        data = json.loads(cursor)
        ts, insert_id = str(data["ts"]), str(data.get("id", ""))
        timestamp_key(ts)
    except (ValueError, KeyError, TypeError):
        raise InvalidSpec(f"log cursor must be {{\"ts\": RFC 3339, \"id\": insertId}}, got {cursor[:100]!r}") from None
    return ts, insert_id


def format_cursor(ts: str, insert_id: str) -> str:
    return json.dumps({"ts": ts, "id": insert_id}, separators=(",", ":"))


def log_filter(job_id: str, since: str = "") -> str:
    """The Cloud Logging filter for the job's entries at or after ``since`` (RFC 3339; "" = all)."""
    parts = ['resource.type="ml_job"', f'resource.labels.job_id="{job_id}"']
    if since:
        parts.append(f'timestamp>="{since}"')
    return " AND ".join(parts)


def entry_lines(entry: dict[str, Any], *, prefix_tasks: bool) -> list[str]:
    """The lines of one LogEntry (see the module docstring for the format)."""
    if "textPayload" in entry:
        text = str(entry.get("textPayload") or "")
    elif isinstance(entry.get("jsonPayload"), dict):
        payload = entry["jsonPayload"]
        text = str(payload["message"]) if "message" in payload else json.dumps(payload, sort_keys=True)
    else:
        text = ""
    if text.endswith("\n"):
        text = text[:-1]
    lines = [line.rstrip("\r") for line in text.split("\n")]
    if not prefix_tasks:
        return lines
    task = ((entry.get("resource") or {}).get("labels") or {}).get("task_name") \
        or (entry.get("labels") or {}).get(TASK_LABEL) or ""
    return [line if METRIC_PREFIX in line or not task else f"[{task}] {line}" for line in lines]


def tail(session: Any, *, base_url: str, project: str, job_id: str, cursor: str, since: str = "",
         prefix_tasks: bool, call: Callable[[Callable[[], T]], T] = lambda fn: fn(),
         max_lines: int | None = None, timeout_s: float = 30.0) -> tuple[list[str], str]:
    """New lines of the job's entries since ``cursor``, and the next cursor.

    ``session``: an object with ``post(url, json=…, timeout=…)`` returning a ``requests.Response``
    (google-auth's ``AuthorizedSession``); ``base_url``: ``https://logging.googleapis.com`` or a
    stand-in; ``since``: where to start without a cursor (the job's create time). ``call`` wraps each
    request (retry + rate limit). An HTTP error is raised as the matching
    ``google.api_core.exceptions`` class (429 TooManyRequests, 403 Forbidden …) for the classifier.
    Calls: one entries:list per page of up to 1000 entries until ``max_lines`` lines are collected.
    """
    from google.api_core import exceptions as gexc

    max_lines = max_lines or MAX_LINES
    position = parse_cursor(cursor)
    after = (timestamp_key(position[0]), position[1]) if position else None
    body: dict[str, Any] = {
        "resourceNames": [f"projects/{project}"],
        "filter": log_filter(job_id, position[0] if position else since),
        "orderBy": "timestamp asc",
        "pageSize": PAGE_SIZE,
    }
    url = f"{base_url.rstrip('/')}/v2/entries:list"
    lines: list[str] = []
    last: tuple[str, str] | None = None
    while len(lines) < max_lines:
        def request(body: dict[str, Any] = dict(body)) -> dict[str, Any]:
            response = session.post(url, json=body, timeout=timeout_s)
            if response.status_code >= 400:
                raise gexc.from_http_response(response)
            return response.json() if response.content else {}

        page = call(request)
        for entry in page.get("entries") or []:
            ts, insert_id = str(entry.get("timestamp") or ""), str(entry.get("insertId") or "")
            if not ts:
                continue
            if after is not None and (timestamp_key(ts), insert_id) <= after:
                continue  # returned by an earlier call
            lines += entry_lines(entry, prefix_tasks=prefix_tasks)
            last = (ts, insert_id)
            if len(lines) >= max_lines:
                break
        token = page.get("nextPageToken")
        if not token or len(lines) >= max_lines:
            break
        body["pageToken"] = token
    if last is None:
        return [], cursor
    return lines, format_cursor(*last)
