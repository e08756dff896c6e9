"""Polling with a deadline, for tests that wait on another process (a worker, a server, torchrun)."""

from __future__ import annotations

import time
from typing import Callable

import pytest


def wait_for(predicate: Callable[[], object], *, timeout: float, interval: float = 0.2, what: str = "") -> object:
    """Poll ``predicate`` every ``interval`` seconds until it returns a truthy value (returned) or
    ``timeout`` seconds pass (the test fails, naming ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what or predicate}")
        time.sleep(interval)


def read_whole_log(backend, handle) -> tuple[list[str], str]:
    """A backend job's log read by cursor to its current end (``backend.logs`` until it returns no
    line): (the lines, the cursor after them)."""
    lines: list[str] = []
    cursor = ""
    while True:
        more, cursor = backend.logs(handle, cursor)
        if not more:
            return lines, cursor
        lines += more
