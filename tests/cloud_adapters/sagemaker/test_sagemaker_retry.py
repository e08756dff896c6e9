"""cloud_adapters.retry (provider-neutral) and the AWS classifier of cloud_adapters._aws."""

from __future__ import annotations

import random

import pytest
from botocore.exceptions import ClientError, ConnectTimeoutError, NoCredentialsError

from cloud_adapters import _aws, retry
from cloud_adapters.base import (CapacityUnavailable, CredentialsError, InvalidSpec, ProviderError, QuotaExceeded,
                                 Throttled)
from sagemaker_standin import FakeClock


class Boom(Exception):
    pass


def flaky(failures: int, result: str = "ok"):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= failures:
            raise Boom(len(calls))
        return result

    return fn, calls


def transient(exc):
    return retry.Verdict(True, Throttled("still throttled")) if isinstance(exc, Boom) else None


def test_full_jitter_delays_stay_under_the_doubling_cap():
    policy = retry.RetryPolicy(base_delay_s=0.5, max_delay_s=3.0, rng=random.Random(1))
    for attempt, cap in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (9, 3.0)]:
        delays = [policy.delay(attempt) for _ in range(200)]
        assert all(0 <= d < cap for d in delays) and max(delays) > 0.8 * cap


def test_retries_until_success_then_returns():
    clock = FakeClock()
    fn, calls = flaky(3)
    waits = []
    assert retry.call(fn, classify=transient, policy=retry.RetryPolicy(rng=random.Random(0)), clock=clock,
                      on_retry=lambda n, exc, d: waits.append((n, d))) == "ok"
    assert len(calls) == 4 and [n for n, _ in waits] == [1, 2, 3]
    assert clock.sleeps == [d for _, d in waits]


def test_gives_up_after_max_attempts_with_the_classifiers_error():
    clock = FakeClock()
    fn, calls = flaky(10)
    with pytest.raises(Throttled, match="still throttled") as err:
        retry.call(fn, classify=transient, policy=retry.RetryPolicy(max_attempts=3), clock=clock)
    assert len(calls) == 3 and len(clock.sleeps) == 2 and isinstance(err.value.__cause__, Boom)


def test_permanent_and_unknown_errors_are_not_retried():
    fn, calls = flaky(10)
    with pytest.raises(InvalidSpec):
        retry.call(fn, classify=lambda e: retry.Verdict(False, InvalidSpec("no")), clock=FakeClock())
    assert len(calls) == 1
    fn, calls = flaky(10)
    with pytest.raises(Boom):
        retry.call(fn, classify=lambda e: None, clock=FakeClock())
    assert len(calls) == 1


def test_token_bucket_spaces_calls_at_the_rate():
    clock = FakeClock()
    bucket = retry.TokenBucket(rate=5.0, burst=2, clock=clock)
    start = clock.monotonic()
    for _ in range(12):
        bucket.acquire()
    assert clock.monotonic() - start == pytest.approx(2.0)  # 2 at once, then 10 at 5 per second
    assert bucket.waited_s == pytest.approx(2.0)


def test_limiter_is_shared_per_key():
    retry.reset_limiters()
    a = retry.limiter("aws:1:us-east-1", rate=1, burst=1)
    assert retry.limiter("aws:1:us-east-1", rate=99, burst=99) is a and a.rate == 1.0
    assert retry.limiter("aws:2:us-east-1", rate=1, burst=1) is not a


def client_error(code: str, status: int = 400) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "msg"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "DescribeTrainingJob")


@pytest.mark.parametrize("exc, retried, error", [
    (client_error("ThrottlingException"), True, Throttled),
    (client_error("TooManyRequestsException", 429), True, Throttled),
    (client_error("InternalFailure", 500), True, ProviderError),
    (client_error("SomethingNew", 503), True, ProviderError),
    (ConnectTimeoutError(endpoint_url="https://x"), True, ProviderError),
    (client_error("AccessDeniedException"), False, CredentialsError),
    (client_error("UnrecognizedClientException"), False, CredentialsError),
    (client_error("ExpiredTokenException"), False, CredentialsError),
    (NoCredentialsError(), False, CredentialsError),
    (client_error("ResourceLimitExceeded"), False, QuotaExceeded),
    (client_error("InsufficientCapacityError"), False, CapacityUnavailable),
    (client_error("ValidationException"), False, InvalidSpec),
    (client_error("ResourceInUse"), False, ProviderError),
])
def test_aws_classifier(exc, retried, error):
    verdict = _aws.classify(exc, service="SageMaker")
    assert verdict.retry is retried and type(verdict.error) is error
    if isinstance(verdict.error, ProviderError):
        assert verdict.error.transient is retried
    assert _aws.classify(ValueError("not AWS")) is None


def test_role_account():
    assert _aws.role_account("arn:aws:iam::123456789012:role/service-role/SageMaker-Exec") == "123456789012"
    assert _aws.role_account("arn:aws-cn:iam::123456789012:role/x") == "123456789012"
    assert _aws.role_account("arn:aws:iam::123456789012:user/x") is None
