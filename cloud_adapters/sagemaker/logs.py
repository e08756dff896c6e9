"""Tail a training job's CloudWatch log streams with a resumable cursor.

SageMaker writes one stream per instance to the log group ``/aws/sagemaker/TrainingJobs``, named
``<training-job-name>/algo-<n>-<epoch seconds>`` (clouds.md §1.4). The SageMaker SDK tails them with
DescribeLogStreams(logStreamNamePrefix=<name>/) and GetLogEvents (§1.4 [SDK2 session.py]); so do we.

The cursor is JSON, ``{"streams": {"<stream name>": "<nextForwardToken>"}}``: each stream resumes at
its own token, and a stream that appears later (a second instance starts after the first) is read
from its head. Lines from one call are merged across streams by event time.

Line format: the text of each event without its trailing newline. In a job of more than one instance,
a line is prefixed ``[algo-2] `` so the instance is visible — except a line that carries a trainer
metric record (:data:`trainer_pkg.metrics.METRIC_PREFIX`): it is passed exactly as printed so the
dashboard's ``parse_metric_line`` reads it and the log shows the record as the trainer wrote it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, TypeVar

from cloud_adapters.base import InvalidSpec
from trainer_pkg.metrics import METRIC_PREFIX

T = TypeVar("T")

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
MAX_LINES = 2000  # lines per logs() call; the dashboard calls again for more
EVENTS_PER_REQUEST = 1000  # GetLogEvents ``limit`` (1..10000, botocore model)

_STREAM_HOST = re.compile(r"/(algo-\d+)(?:-\d+)?$")


def parse_cursor(cursor: str) -> dict[str, str]:
    """``{stream name: nextForwardToken}`` from a cursor ("" = nothing read yet).

    Raises :class:`InvalidSpec` for a cursor this module did not write.
    """
    if not cursor:
        return {}
    try:
        data = json.loads(cursor)
    except json.JSONDecodeError:
        raise InvalidSpec(f"log cursor is not JSON: {cursor[:100]!r}") from None
    streams = data.get("streams") if isinstance(data, dict) else None
    if not isinstance(streams, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in streams.items()):
        raise InvalidSpec(f"log cursor must be {{\"streams\": {{name: token}}}}, got {cursor[:100]!r}")
    return dict(streams)


def format_cursor(tokens: dict[str, str]) -> str:
    return json.dumps({"streams": dict(sorted(tokens.items()))}, separators=(",", ":"))


def host_of(stream: str) -> str:
    """``algo-2`` for ``<job>/algo-2-1700000000``; else the part after the job name."""
    m = _STREAM_HOST.search(stream)
    return m.group(1) if m else stream.split("/", 1)[-1]


def _split(message: str) -> list[str]:
    text = message[:-1] if message.endswith("\n") else message
    return [line.rstrip("\r") for line in text.split("\n")]


def tail(logs: Any, job_name: str, cursor: str, *, prefix_hosts: bool,
         call: Callable[[Callable[[], T]], T] = lambda fn: fn(),
         max_lines: int = MAX_LINES) -> tuple[list[str], str]:
    """New lines of the job's streams since ``cursor``, and the next cursor.

    ``logs`` is a boto3 CloudWatch Logs client; ``call`` wraps each request (retry + rate limit).
    Calls: one DescribeLogStreams per 50 streams, then one GetLogEvents per stream until ``max_lines``
    lines are collected. A missing log group (no instance has logged yet) is no lines.
    """
    tokens = parse_cursor(cursor)
    streams = _streams(logs, job_name, call)
    if streams is None:
        return [], format_cursor(tokens) if tokens else cursor
    events: list[tuple[int, int, int, str]] = []  # (timestamp, stream index, order, line)
    budget = max_lines
    for index, stream in enumerate(streams):
        if budget <= 0:
            break
        kwargs: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamName": stream, "startFromHead": True,
                                  "limit": min(EVENTS_PER_REQUEST, budget)}
        if stream in tokens:
            kwargs["nextToken"] = tokens[stream]
        response = call(lambda kwargs=kwargs: logs.get_log_events(**kwargs))
        host = host_of(stream)
        order = 0
        for event in response.get("events") or []:
            for line in _split(str(event.get("message", ""))):
                if prefix_hosts and METRIC_PREFIX not in line:
                    line = f"[{host}] {line}"
                events.append((int(event.get("timestamp") or 0), index, order, line))
                order += 1
                budget -= 1
        token = response.get("nextForwardToken")
        if token:
            tokens[stream] = token
    events.sort()
    return [e[3] for e in events], format_cursor(tokens)


def _streams(logs: Any, job_name: str, call: Callable[[Callable[[], T]], T]) -> list[str] | None:
    """The job's stream names, sorted (algo-1 first); None when the log group does not exist."""
    names: list[str] = []
    token = None
    while True:
        kwargs: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{job_name}/",
                                  "orderBy": "LogStreamName"}
        if token:
            kwargs["nextToken"] = token
        try:
            response = call(lambda kwargs=kwargs: logs.describe_log_streams(**kwargs))
        except Exception as exc:
            code = (getattr(exc, "response", None) or {}).get("Error", {}).get("Code")
            cause = getattr(exc, "__cause__", None)
            cause_code = (getattr(cause, "response", None) or {}).get("Error", {}).get("Code")
            if "ResourceNotFoundException" in (code, cause_code):
                return None
            raise
        names += [s["logStreamName"] for s in response.get("logStreams") or [] if s.get("logStreamName")]
        token = response.get("nextToken")
        if not token:
            return sorted(names)
