"""Read an Azure ML job's log files incrementally, with a resumable byte-offset cursor.

``MLClient.jobs.stream(name)`` blocks until the job ends, which no Celery task may do (DESIGN.md §2),
and it needs the workspace's run-history endpoints anyway (clouds.md §3.5: it GETs the job, then the
workspace for its discovery URL). So :meth:`AzureMLBackend.logs` asks run history for the run's
details once per call — ``GET <api>/history/v1.0/.../runs/<name>/details``, whose ``logFiles`` maps
each log file's name to a SAS URL (the same call ``jobs.stream`` polls, [AML
``_job_ops_helper.stream_logs_until_completion``]) — and reads each user log from its last byte
offset with an HTTP ``Range`` request.

Which files: the common runtime's ``user_logs/std_log*.txt`` (one per process in a distributed job,
e.g. ``std_log_process_0.txt`` … — [AML ``JobLogPattern.COMMON_RUNTIME_ALL_USER_LOG_PATTERN``]);
when a job has none of them, the legacy ``azureml-logs/NN_*.txt`` driver logs
(``COMMAND_JOB_LOG_PATTERN``).

The cursor is JSON ``{"<file name>": <byte offset>}``: each file resumes at its own offset, and a
file that appears later (another node starts) is read from its start. A partial last line (no
newline yet) is left for the next call.

Line format: the text without its newline. With more than one file a line is prefixed with its
file's short name, ``[std_log_process_1] ``, so the process is visible — except a line carrying a
trainer metric record (:data:`trainer_pkg.metrics.METRIC_PREFIX`): it is passed exactly as printed so the dashboard's
``parse_metric_line`` reads it.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Mapping

from cloud_adapters.base import InvalidSpec
from trainer_pkg.metrics import METRIC_PREFIX

MAX_BYTES = 1 << 20  # bytes read per file per logs() call; the dashboard calls again for more
USER_LOG = re.compile(r"user_logs/std_log.*\.txt")  # [AML JobLogPattern], clouds.md §3.3 ops
LEGACY_LOG = re.compile(r"azureml-logs/\d{2}.+\.txt")


def parse_cursor(cursor: str) -> dict[str, int]:
    """``{file name: byte offset}`` from a cursor ("" = nothing read yet).

    Raises :class:`InvalidSpec` for a cursor this module did not write.
    """
    if not cursor:
        return {}
    try:
        data = json.loads(cursor)
    except json.JSONDecodeError:
        raise InvalidSpec(f"log cursor is not JSON: {cursor[:100]!r}") from None
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in data.items()):
        raise InvalidSpec(f"log cursor must be {{file: byte offset}}, got {cursor[:100]!r}")
    return dict(data)


def format_cursor(offsets: Mapping[str, int]) -> str:
    return json.dumps(dict(sorted(offsets.items())), separators=(",", ":"))


def log_files(names: Mapping[str, str]) -> list[str]:
    """The names of ``names`` (run details' ``logFiles``) to show, sorted: user logs, else legacy."""
    user = sorted(n for n in names if USER_LOG.fullmatch(n))
    return user or sorted(n for n in names if LEGACY_LOG.fullmatch(n))


def short_name(name: str) -> str:
    """``std_log_process_1`` for ``user_logs/std_log_process_1.txt``."""
    base = name.rsplit("/", 1)[-1]
    return base[:-4] if base.endswith(".txt") else base


def read_new(files: Mapping[str, str], cursor: str, fetch: Callable[[str, int, int], bytes | None],
             max_bytes: int = MAX_BYTES) -> tuple[list[str], str]:
    """New complete lines of the log files since ``cursor``, and the next cursor.

    ``files``: ``{name: URL}`` (run details' ``logFiles``); ``fetch(url, offset, length)`` returns
    up to ``length`` bytes from ``offset`` (``b""`` when there are none, None when the file is gone).
    """
    offsets = parse_cursor(cursor)
    names = log_files(files)
    prefix = len(names) > 1
    lines: list[str] = []
    for name in names:
        start = offsets.get(name, 0)
        data = fetch(files[name], start, max_bytes)
        if not data:
            continue
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) < max_bytes:
                continue  # a partial line: read it whole next time
            end = len(data) - 1  # one line longer than a read: pass it on in pieces
        chunk = data[: end + 1]
        offsets[name] = start + len(chunk)
        tag = short_name(name)
        for line in chunk.decode("utf-8", errors="replace").split("\n")[:-1]:
            line = line.rstrip("\r")
            lines.append(line if not prefix or METRIC_PREFIX in line else f"[{tag}] {line}")
    return lines, format_cursor(offsets)
