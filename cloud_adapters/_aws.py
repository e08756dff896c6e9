"""AWS pieces shared by the adapters that use boto3: clients, and what an AWS error means.

* :func:`make_client` builds a boto3 client from a profile name (or boto3's default credential
  chain: environment, shared config, instance/task role), a region and an optional endpoint URL,
  with botocore's own retries turned off (``total_max_attempts=1``): :mod:`cloud_adapters.retry`
  retries instead, under the account's rate limit, so the behaviour is one and testable.
* :func:`classify` tells :func:`cloud_adapters.retry.call` whether a botocore exception is transient
  (throttling, a 5xx, a dropped connection) and which Trainboard error it becomes.

boto3/botocore are imported inside the functions, so importing this module needs no SDK (the
registry's :class:`~cloud_adapters.base.MissingDependency` names the ``aws`` extra instead).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from cloud_adapters.base import (
    CapacityUnavailable,
    CredentialsError,
    InvalidSpec,
    ProviderError,
    QuotaExceeded,
    Throttled,
)
from cloud_adapters.retry import Verdict

# Error codes AWS services use for rate limiting (botocore's retry handler treats these as
# throttling: botocore/data/_retry.json "throttling" / standard-mode THROTTLED_ERROR_CODES).
THROTTLING_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "ProvisionedThroughputExceededException", "TransactionInProgressException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "LimitExceededException", "RequestThrottled",
    "SlowDown", "PriorRequestNotComplete", "EC2ThrottledException",
})
# Codes for a failure on AWS's side that a later attempt may not see (standard-mode transient codes).
TRANSIENT_CODES = frozenset({
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "InternalError",
    "InternalFailure", "InternalServerError", "ServiceUnavailable", "ServiceUnavailableException",
})
CREDENTIAL_CODES = frozenset({
    "AccessDenied", "AccessDeniedException", "UnrecognizedClientException", "InvalidClientTokenId",
    "ExpiredToken", "ExpiredTokenException", "SignatureDoesNotMatch", "IncompleteSignature",
    "MissingAuthenticationToken", "InvalidSignatureException", "AuthFailure", "UnauthorizedOperation",
    "NotAuthorized",
})
QUOTA_CODES = frozenset({"ResourceLimitExceeded", "ServiceQuotaExceededException"})
# SageMaker reports missing capacity mostly as a job failure (FailureReason "CapacityError: ..."),
# but a create answered with one of these means the same: try later or another instance type.
CAPACITY_CODES = frozenset({
    "InsufficientCapacity", "InsufficientCapacityError", "InsufficientInstanceCapacity", "CapacityError",
})

_ROLE_ARN = re.compile(r"arn:aws[a-z-]*:iam::(\d{12}):role/[\w+=,.@/-]{1,512}")


def role_account(role_arn: str) -> str | None:
    """The 12-digit account id of an IAM role ARN (``arn:aws:iam::<account>:role/<path/name>``),
    or None when ``role_arn`` does not have that shape."""
    m = _ROLE_ARN.fullmatch(role_arn or "")
    return m.group(1) if m else None


def error_code(exc: BaseException) -> str:
    """The AWS error code of a botocore ``ClientError`` ("" for anything else)."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        return str((response.get("Error") or {}).get("Code") or "")
    return ""


def error_message(exc: BaseException) -> str:
    """The AWS error message of a ``ClientError``, else ``str(exc)``."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        message = (response.get("Error") or {}).get("Message")
        if message:
            return str(message)
    return str(exc)


def http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return int(status) if status else None
    return None


def classify(exc: BaseException, *, service: str = "AWS") -> Verdict | None:
    """The :class:`~cloud_adapters.retry.Verdict` for a botocore exception; None for anything else.

    ====================================================  ===========  ===============================
    exception                                             retried      raised at the end
    ====================================================  ===========  ===============================
    ClientError, a throttling code (``ThrottlingException``) yes       :class:`Throttled`
    ClientError, 5xx / ``InternalFailure`` ...            yes          ProviderError(transient=True)
    connection errors, timeouts                           yes          ProviderError(transient=True)
    ``AccessDenied*``, ``UnrecognizedClient``, expired,   no           :class:`CredentialsError`
    no credentials / profile not found
    ``ResourceLimitExceeded``                             no           :class:`QuotaExceeded`
    capacity codes                                        no           :class:`CapacityUnavailable`
    ``ValidationException``, client-side param errors     no           :class:`InvalidSpec`
    any other ClientError                                 no           ProviderError
    ====================================================  ===========  ===============================

    ``service`` names the API in messages ("SageMaker", "S3").
    """
    from botocore import exceptions as bexc  # lazily: the SDK is an optional extra

    if isinstance(exc, (bexc.ConnectionError, bexc.HTTPClientError)):
        return Verdict(True, ProviderError(
            f"{service}: could not reach the AWS endpoint ({exc}); check the network or the "
            f"endpoint_url setting. The next sync tries again.", transient=True))
    if isinstance(exc, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
        return Verdict(False, CredentialsError(no_credentials_message()))
    if isinstance(exc, bexc.ProfileNotFound):
        return Verdict(False, CredentialsError(
            f"{exc}; set the backend's profile to a profile in ~/.aws/config, or leave it empty to "
            f"use the default credential chain."))
    if isinstance(exc, (bexc.TokenRetrievalError, bexc.SSOError, bexc.CredentialRetrievalError)):
        return Verdict(False, CredentialsError(
            f"AWS credentials could not be loaded ({exc}); refresh them (e.g. `aws sso login`)."))
    if isinstance(exc, bexc.ParamValidationError):
        return Verdict(False, InvalidSpec(f"{service} request rejected before sending: {exc}"))
    if not isinstance(exc, bexc.ClientError):
        return None

    code, message = error_code(exc), error_message(exc)
    status = http_status(exc) or 0
    what = f"{service} {code}: {message}"
    if code in THROTTLING_CODES:
        return Verdict(True, Throttled(
            f"{what} (rate-limited by AWS after retries with backoff; the next sync tries again)."))
    if code in TRANSIENT_CODES or status >= 500:
        return Verdict(True, ProviderError(f"{what} (an AWS-side error; the next sync tries again).",
                                           transient=True))
    if code in CREDENTIAL_CODES:
        return Verdict(False, CredentialsError(
            f"{what}. The credentials in use lack a permission or are invalid: check the IAM policy "
            f"of the worker's identity (and the backend's profile)."))
    if code in QUOTA_CODES:
        return Verdict(False, QuotaExceeded(
            f"{what}. Ask for a higher quota in the AWS Service Quotas console, or use fewer or "
            f"smaller instances."))
    if code in CAPACITY_CODES:
        return Verdict(False, CapacityUnavailable(
            f"{what}. AWS has no capacity for this instance type now; try later, another instance "
            f"type or another region."))
    if code == "ValidationException":
        return Verdict(False, InvalidSpec(f"{what}"))
    return Verdict(False, ProviderError(what))


def no_credentials_message() -> str:
    return ("no AWS credentials found: set AWS_PROFILE (or this backend's profile) or "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the worker's environment, or run the worker "
            "with an IAM role (instance profile / task role).")


def make_client(service: str, *, region: str, profile: str = "", endpoint_url: str | Mapping[str, str] = "",
                connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0,
                secrets: Mapping[str, str] | None = None) -> Any:
    """A boto3 client for ``service`` with botocore retries off (see the module docstring).

    ``endpoint_url``: one URL for every service (a local stand-in), or ``{service: url}`` (VPC
    endpoints); a service missing from the mapping uses AWS's public endpoint. ``profile`` "" =
    boto3's default credential chain. ``secrets``: a backend's stored keys (``aws_access_key_id``,
    ``aws_secret_access_key``, optional ``aws_session_token``); when given they are used instead of
    the profile and the default chain. Raises :class:`CredentialsError` for an unknown profile.
    """
    import boto3
    from botocore import exceptions as bexc
    from botocore.config import Config

    if isinstance(endpoint_url, Mapping):
        url = endpoint_url.get(service) or None
    else:
        url = endpoint_url or None
    try:
        if secrets and secrets.get("aws_access_key_id"):
            session = boto3.session.Session(
                aws_access_key_id=secrets["aws_access_key_id"],
                aws_secret_access_key=secrets.get("aws_secret_access_key"),
                aws_session_token=secrets.get("aws_session_token") or None, region_name=region)
        else:
            session = boto3.session.Session(profile_name=profile or None, region_name=region)
    except bexc.ProfileNotFound as exc:
        raise CredentialsError(
            f"{exc}; set the backend's profile to a profile in ~/.aws/config, or leave it empty to "
            f"use the default credential chain.") from exc
    # S3 signs with SigV4 (botocore may still presign with SigV2 in us-east-1, which buckets in newer
    # regions and KMS-encrypted objects refuse): the artifact download URLs are presigned here.
    config = Config(retries={"mode": "standard", "total_max_attempts": 1},
                    connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                    signature_version="s3v4" if service == "s3" else None)
    return session.client(service, region_name=region, endpoint_url=url, config=config)
