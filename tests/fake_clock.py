"""Simulated time for tests of code that retries with backoff (``cloud_adapters.retry``)."""

from __future__ import annotations


class FakeClock:
    """Monotonic time that moves only when someone sleeps: ``sleep`` advances ``monotonic`` at once
    (seconds) and records each wait in ``sleeps``, so a test asserts the backoff without waiting."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += max(seconds, 0.0)
