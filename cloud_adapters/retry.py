"""Retrying provider calls: exponential backoff with full jitter, under one rate limit per account.

Every cloud adapter sends its API calls through :func:`call`. A call first takes a token from the
account's :class:`TokenBucket` (one bucket per account key, shared by every backend object of this
process that talks to that account, so two backends on one AWS account do not each spend the whole
quota). When the call fails with an error the adapter's *classifier* calls transient (throttling, a
dropped connection), it is tried again after a random delay in ``[0, min(cap, base × 2^attempt))``
("full jitter": retries of many workers spread out instead of arriving together). Once the attempts
are spent the classifier's final error is raised (a :class:`~cloud_adapters.base.Throttled` or a
transient :class:`~cloud_adapters.base.ProviderError`), which the sync task reports and retries on its
next run; it never changes a job's state.

This module knows no provider: classifiers live with the adapter (``cloud_adapters._aws`` for AWS).
Time comes from a :class:`Clock`, so tests replace the wall clock and ``sleep`` with a simulated one.

    bucket = limiter("aws:123456789012:us-east-1", rate=10.0, burst=20)
    result = call(lambda: client.describe_training_job(TrainingJobName=name),
                  classify=aws_classify, bucket=bucket, policy=RetryPolicy())
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from typing import Callable, Protocol, TypeVar

from cloud_adapters.base import BackendError

T = TypeVar("T")


class Clock(Protocol):
    """Where retries and the rate limit read the time and wait (seconds)."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The process's monotonic clock and ``time.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a transient failure.

    Delays are full jitter: before attempt ``n`` (1-based, the first retry is n=1) the caller waits a
    uniform random time in ``[0, min(max_delay_s, base_delay_s × 2^(n-1)))``. With the defaults the
    waits are bounded by 0.5, 1, 2, 4 s: at most 7.5 s over a call's 5 attempts, so a sync task stays
    short.
    """

    max_attempts: int = 5  # attempts in all, the first included; 1 = no retry
    base_delay_s: float = 0.5  # cap of the first retry's random delay, seconds
    max_delay_s: float = 20.0  # no single delay exceeds this, seconds
    rng: random.Random = dataclasses.field(default_factory=random.Random, compare=False)
    # source of the jitter; tests pass random.Random(seed) for a reproducible run

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 = the first retry)."""
        cap = min(self.max_delay_s, self.base_delay_s * (2 ** max(retry - 1, 0)))
        return self.rng.uniform(0.0, cap)


class TokenBucket:
    """A rate limit: at most ``burst`` calls at once, refilled at ``rate`` calls per second.

    :meth:`acquire` blocks (via the clock's ``sleep``) until a token is free. Thread-safe: Celery
    workers with threads share the bucket.
    """

    def __init__(self, rate: float, burst: int, clock: Clock = SYSTEM_CLOCK) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1 (got {rate}, {burst})")
        self.rate = float(rate)
        self.burst = int(burst)
        self.clock = clock
        self._tokens = float(burst)
        self._stamp = clock.monotonic()
        self._lock = threading.Lock()
        self.waited_s = 0.0  # total time callers spent waiting for a token (for benchmarks and tests)

    def acquire(self) -> None:
        """Take one token, waiting as long as the refill needs."""
        while True:
            with self._lock:
                now = self.clock.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
                self._stamp = now
                if self._tokens >= 1.0 - 1e-9:  # float refill may land a hair short of a whole token
                    self._tokens = max(self._tokens - 1.0, 0.0)
                    return
                wait = (1.0 - self._tokens) / self.rate
            self.waited_s += wait
            self.clock.sleep(wait)


_limiters: dict[str, TokenBucket] = {}
_limiters_lock = threading.Lock()


def limiter(key: str, *, rate: float, burst: int, clock: Clock = SYSTEM_CLOCK) -> TokenBucket:
    """The process-wide bucket for ``key`` (e.g. ``"aws:<account id>:<region>"``), created on first use.

    The first caller's ``rate``/``burst``/``clock`` set the bucket; later callers share it as it is,
    so every backend on one account spends one budget.
    """
    with _limiters_lock:
        bucket = _limiters.get(key)
        if bucket is None:
            bucket = _limiters[key] = TokenBucket(rate, burst, clock)
        return bucket


def reset_limiters() -> None:
    """Forget every bucket (tests start each case with fresh ones)."""
    with _limiters_lock:
        _limiters.clear()


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a classifier says about an exception raised by a provider call."""

    retry: bool  # transient: try again after a delay
    error: BaseException  # what to raise when not retrying (or when attempts are spent)


Classifier = Callable[[BaseException], "Verdict | None"]
"""exception -> Verdict, or None for an exception the classifier does not know (re-raised as is)."""


def call(fn: Callable[[], T], *, classify: Classifier, bucket: TokenBucket | None = None,
         policy: RetryPolicy | None = None, clock: Clock | None = None,
         on_retry: Callable[[int, BaseException, float], None] | None = None) -> T:
    """``fn()`` under ``bucket``, retried per ``policy`` while ``classify`` calls the failure transient.

    Returns ``fn``'s result. Raises the classifier's ``error`` for a permanent failure at once and
    for a transient one after ``policy.max_attempts`` attempts (``from`` the provider's exception);
    an exception the classifier does not know propagates unchanged. ``clock`` (default: the bucket's,
    else the system clock) does the waiting; ``on_retry(attempt, exc, delay_s)`` is told of each retry.
    """
    policy = policy or RetryPolicy()
    clock = clock or (bucket.clock if bucket is not None else SYSTEM_CLOCK)
    attempt = 0
    while True:
        attempt += 1
        if bucket is not None:
            bucket.acquire()
        try:
            return fn()
        except BackendError:
            raise  # already ours (raised by a nested call): not the provider's to classify
        except Exception as exc:  # noqa: BLE001 - the classifier decides
            verdict = classify(exc)
            if verdict is None:
                raise
            if not verdict.retry or attempt >= policy.max_attempts:
                raise verdict.error from exc
            delay = policy.delay(attempt)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            clock.sleep(delay)
