"""Azure pieces shared by adapters that use azure-core based SDKs: what an Azure error means.

:func:`classify` tells :func:`cloud_adapters.retry.call` whether an exception raised through
azure-core (azure-ai-ml, azure-storage-blob, azure-identity) is transient and which Trainboard error
it becomes. The SDK clients are built with azure-core's own retries off (``retry_total=0``), so
:mod:`cloud_adapters.retry` alone retries, under the subscription's rate limit — one behaviour,
testable with a simulated clock.

azure-core is imported inside the functions, so importing this module needs no SDK (the registry's
:class:`~cloud_adapters.base.MissingDependency` names the ``azure`` extra instead).
"""

from __future__ import annotations

import json
from typing import Any

from cloud_adapters.base import (
    CapacityUnavailable,
    CredentialsError,
    InvalidSpec,
    ProviderError,
    QuotaExceeded,
    Throttled,
)
from cloud_adapters.retry import Verdict

# ARM error codes (the ``error.code`` of an Azure error body) that mean "not enough quota" or "no
# capacity" whatever the HTTP status (Azure answers quota errors with 400 or 409).
QUOTA_CODES = frozenset({
    "QuotaExceeded", "OperationNotAllowed", "SubscriptionQuotaExceeded", "ResourceQuotaExceeded",
    "ServiceQuotaExceeded", "TooManyJobs",
})
CAPACITY_CODES = frozenset({
    "AllocationFailed", "ZonalAllocationFailed", "SkuNotAvailable", "OverconstrainedAllocationRequest",
    "InsufficientCapacity",
})
TRANSIENT_STATUSES = frozenset({408, 500, 502, 503, 504})


def http_status(exc: BaseException | None) -> int | None:
    """The HTTP status of an azure-core ``HttpResponseError`` (None for anything else)."""
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def error_code(exc: BaseException | None) -> str:
    """The ARM ``error.code`` of an azure-core ``HttpResponseError`` ("" when there is none)."""
    if exc is None:
        return ""
    code = getattr(exc, "error_code", None) or getattr(getattr(exc, "error", None), "code", None)
    if code:
        return str(code)
    response = getattr(exc, "response", None)
    try:
        body = json.loads(response.text()) if response is not None else None
    except Exception:  # noqa: BLE001 - not JSON, no code
        return ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("code") or "")
    return ""


def error_message(exc: BaseException) -> str:
    """The ARM ``error.message`` when the body has one, else the exception's first line."""
    message = getattr(getattr(exc, "error", None), "message", None)
    if not message:
        response = getattr(exc, "response", None)
        try:
            body = json.loads(response.text()) if response is not None else None
            message = body["error"]["message"] if isinstance(body, dict) else None
        except Exception:  # noqa: BLE001
            message = None
    text = str(message or getattr(exc, "message", None) or exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def no_credentials_message(detail: Any = "") -> str:
    extra = f" ({str(detail).strip().splitlines()[0]})" if str(detail).strip() else ""
    return ("no usable Azure credential" + extra + ": DefaultAzureCredential tried the environment "
            "(AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET or AZURE_FEDERATED_TOKEN_FILE), workload and "
            "managed identity and `az login`; give the worker one of them, with a role on the workspace "
            "(e.g. AzureML Data Scientist).")


def classify(exc: BaseException, *, service: str = "Azure ML") -> Verdict | None:
    """The :class:`~cloud_adapters.retry.Verdict` for an azure-core exception; None for anything else.

    ===========================================================  =======  ============================
    exception                                                    retried  raised at the end
    ===========================================================  =======  ============================
    ``HttpResponseError`` 429                                    yes      :class:`Throttled`
    ``HttpResponseError`` 408/500/502/503/504                    yes      ProviderError(transient=True)
    ``ServiceRequestError`` / ``ServiceResponseError`` (no       yes      ProviderError(transient=True)
    connection, timeout)
    ``ClientAuthenticationError`` (401, no/expired credential)   no       :class:`CredentialsError`
    ``HttpResponseError`` 403                                    no       :class:`CredentialsError`
    quota codes (``QuotaExceeded`` ...)                          no       :class:`QuotaExceeded`
    capacity codes (``AllocationFailed`` ...)                    no       :class:`CapacityUnavailable`
    ``HttpResponseError`` 400 / 422, azure-ai-ml                 no       :class:`InvalidSpec`
    ``ValidationException`` / ``UserErrorException``
    ``ResourceNotFoundError`` (404)                              no       ProviderError (callers that
                                                                          expect a 404 check the cause)
    any other ``HttpResponseError`` (409 ...)                    no       ProviderError
    ===========================================================  =======  ============================
    """
    from azure.core import exceptions as aexc  # lazily: the SDK is an optional extra

    if isinstance(exc, (aexc.ServiceRequestError, aexc.ServiceResponseError)):
        return Verdict(True, ProviderError(
            f"{service}: could not reach the Azure endpoint ({error_message(exc)}); check the network or the "
            f"base_url setting. The next sync tries again.", transient=True))
    if isinstance(exc, aexc.ClientAuthenticationError):
        status = http_status(exc)
        if status is None:  # raised by the credential itself, before any request was sent
            return Verdict(False, CredentialsError(no_credentials_message(error_message(exc))))
        return Verdict(False, CredentialsError(
            f"{service} rejected the credential (HTTP {status}: {error_message(exc)}); refresh it (`az login`, "
            f"the service principal's secret) or check the tenant."))
    try:  # azure-ai-ml's own client-side validation errors
        from azure.ai.ml.exceptions import UserErrorException, ValidationException
    except ImportError:  # pragma: no cover - azure-core without azure-ai-ml
        UserErrorException = ValidationException = ()  # type: ignore[assignment,misc]
    if isinstance(exc, (ValidationException, UserErrorException)) and not isinstance(exc, aexc.HttpResponseError):
        return Verdict(False, InvalidSpec(f"{service} request rejected before sending: {error_message(exc)}"))
    if not isinstance(exc, aexc.HttpResponseError):
        return None

    status = http_status(exc) or 0
    code = error_code(exc)
    what = f"{service} HTTP {status}" + (f" {code}" if code else "") + f": {error_message(exc)}"
    if status == 429:
        return Verdict(True, Throttled(
            f"{what} (rate-limited by Azure after retries with backoff; the next sync tries again)."))
    if status in TRANSIENT_STATUSES or status >= 500:
        return Verdict(True, ProviderError(f"{what} (an Azure-side error; the next sync tries again).",
                                           transient=True))
    if status == 401:
        return Verdict(False, CredentialsError(
            f"{what}. The credential was refused; refresh it (`az login`, the service principal's secret)."))
    if status == 403:
        return Verdict(False, CredentialsError(
            f"{what}. The identity in use lacks a permission on the workspace: give it a role such as "
            f"AzureML Data Scientist on the workspace (and Storage Blob Data Contributor on its storage)."))
    if code in QUOTA_CODES:
        return Verdict(False, QuotaExceeded(
            f"{what}. Ask for a higher quota for this VM family in the Azure portal (Quotas), or use fewer "
            f"or smaller nodes."))
    if code in CAPACITY_CODES:
        return Verdict(False, CapacityUnavailable(
            f"{what}. Azure has no capacity for this VM size now; try later, another size or region."))
    if status in (400, 422):
        return Verdict(False, InvalidSpec(what))
    return Verdict(False, ProviderError(what))
