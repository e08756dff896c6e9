"""Google Cloud pieces shared by the adapters that use Google's SDKs: credentials, and what a Google
API error means.

* :func:`credentials` returns Application Default Credentials (``google.auth.default()``: the
  ``GOOGLE_APPLICATION_CREDENTIALS`` key file, ``gcloud auth application-default login``, or the
  attached service account of a GCE/GKE/Cloud Run worker), or the backend's stored service-account
  key; for an ``http://`` endpoint (a local stand-in in the tests) with no stored key, anonymous
  credentials, so nothing is signed and nothing secret is needed.
* :func:`classify` tells :func:`cloud_adapters.retry.call` whether an exception from a Google client
  (``google.api_core.exceptions``, google-auth, a ``requests`` connection error) is transient and
  which Trainboard error it becomes.

Google's libraries are imported inside the functions, so importing this module needs no SDK.
"""

from __future__ import annotations

import re
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

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)

# ResourceExhausted / 429 covers three different things on Google APIs. A request-rate limit names a
# rate ("Quota exceeded for quota metric '... requests' and limit '... per minute'"): retry with
# backoff. Any other quota (GPUs, CPUs, concurrent jobs) does not go away by retrying. Missing zone
# capacity ("does not have enough resources available", ZONE_RESOURCE_POOL_EXHAUSTED, "stockout") is
# neither: try later or elsewhere.
_RATE_WORDS = re.compile(r"per (minute|second|100 seconds)|rate limit|RATE_LIMIT_EXCEEDED|too many requests",
                         re.IGNORECASE)
_CAPACITY_WORDS = re.compile(r"enough resources|RESOURCE_POOL_EXHAUSTED|stockout|no capacity",
                             re.IGNORECASE)
_QUOTA_WORDS = re.compile(r"quota", re.IGNORECASE)


def is_local(endpoint: str) -> bool:
    """Whether ``endpoint`` is a plain-HTTP stand-in (tests): no credentials are sent to it."""
    return (endpoint or "").startswith("http://")


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint``'s host is this machine (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    import ipaddress
    import urllib.parse

    host = urllib.parse.urlsplit(endpoint if "//" in endpoint else "//" + endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def no_credentials_message(detail: str = "") -> str:
    return ("no Google Cloud credentials found" + (f" ({detail})" if detail else "") + ": run "
            "`gcloud auth application-default login` on the worker, set GOOGLE_APPLICATION_CREDENTIALS to "
            "a service-account key file, or run the worker with an attached service account.")


def credentials(endpoint: str = "", service_account_json: str = "") -> tuple[Any, str | None]:
    """``(credentials, project of the credentials or None)``.

    ``service_account_json`` (a backend's stored key file, the JSON text) gives that service
    account's credentials, whatever the endpoint: a stand-in on loopback sees the same bearer tokens
    Google would (tokens come from the key's ``token_uri``). Without a stored key:
    ``AnonymousCredentials`` when ``endpoint`` is ``http://`` (a local stand-in), else Application
    Default Credentials with the cloud-platform scope. Raises :class:`CredentialsError` saying how to
    provide credentials when ADC finds none, what is wrong with the key (never its content), or when a
    stored key's token would go in clear text to an ``http://`` endpoint off this machine.
    """
    if is_local(endpoint) and not service_account_json:
        from google.auth.credentials import AnonymousCredentials

        return AnonymousCredentials(), None
    if is_local(endpoint) and not is_loopback(endpoint):
        raise CredentialsError(
            f"the endpoint {endpoint} is plain http:// on another machine: the backend's service-account "
            f"token would cross the network unencrypted. Use https://, or a stand-in on 127.0.0.1.")
    if service_account_json:
        import json

        from google.oauth2 import service_account

        try:
            info = json.loads(service_account_json)
            creds = service_account.Credentials.from_service_account_info(info, scopes=list(SCOPES))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # The exception text may quote the key; name only its type.
            raise CredentialsError(
                f"the backend's service_account_json is not a usable service-account key file "
                f"({type(exc).__name__}); paste the JSON key downloaded from IAM → Service accounts → Keys."
            ) from None
        return creds, info.get("project_id")
    import google.auth
    from google.auth import exceptions as auth_exc

    try:
        creds, project = google.auth.default(scopes=list(SCOPES))
    except auth_exc.DefaultCredentialsError as exc:
        raise CredentialsError(no_credentials_message(str(exc).split("\n")[0][:200])) from exc
    return creds, project


def error_message(exc: BaseException) -> str:
    """The API's own message of a ``GoogleAPICallError`` (``str(exc)`` for anything else)."""
    message = getattr(exc, "message", None)
    return str(message) if message else str(exc)


def error_reason(exc: BaseException) -> str:
    """The ``ErrorInfo.reason`` of a ``GoogleAPICallError`` ("" when absent), e.g. ``SERVICE_DISABLED``."""
    try:
        return str(getattr(exc, "reason", None) or "")
    except Exception:  # noqa: BLE001 - an odd error payload is just "no reason"
        return ""


def classify(exc: BaseException, *, service: str = "Google Cloud") -> Verdict | None:
    """The :class:`~cloud_adapters.retry.Verdict` for an exception of a Google client; None for others.

    =================================================  =======  ====================================
    exception                                          retried  raised at the end
    =================================================  =======  ====================================
    429 / ResourceExhausted naming a request rate       yes      :class:`Throttled`
    (or naming nothing)
    429 / ResourceExhausted naming another quota        no       :class:`QuotaExceeded`
    429 / ResourceExhausted naming zone capacity        no       :class:`CapacityUnavailable`
    401 / 403 (Unauthenticated, PermissionDenied),      no       :class:`CredentialsError`
    no ADC, a token that cannot be refreshed
    400 (InvalidArgument, FailedPrecondition,            no       :class:`InvalidSpec`
    OutOfRange)
    5xx (ServiceUnavailable, DeadlineExceeded,           yes      ProviderError(transient=True)
    InternalServerError ...), 409 Aborted, connection
    errors, timeouts, google-auth TransportError
    404 and anything else from the API                   no       ProviderError
    =================================================  =======  ====================================

    ``service`` names the API in messages ("Vertex AI", "Cloud Storage").
    """
    from google.api_core import exceptions as gexc
    from google.auth import exceptions as auth_exc

    try:
        import requests
        connection_errors: tuple[type[BaseException], ...] = (
            requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError, TimeoutError)
    except ImportError:  # pragma: no cover - requests comes with google-auth's transport
        connection_errors = (ConnectionError, TimeoutError)

    if isinstance(exc, auth_exc.DefaultCredentialsError):
        return Verdict(False, CredentialsError(no_credentials_message(str(exc).split("\n")[0][:200])))
    if isinstance(exc, auth_exc.RefreshError):
        if getattr(exc, "retryable", False):
            return Verdict(True, ProviderError(
                f"{service}: refreshing the Google access token failed ({exc}); the next sync tries again.",
                transient=True))
        return Verdict(False, CredentialsError(
            f"{service}: the Google credentials could not be refreshed ({exc}); renew them (e.g. "
            f"`gcloud auth application-default login`) or check the worker's service account."))
    if isinstance(exc, (auth_exc.TransportError, *connection_errors)):
        return Verdict(True, ProviderError(
            f"{service}: could not reach the Google API ({exc}); check the network or the endpoint "
            f"settings. The next sync tries again.", transient=True))
    if isinstance(exc, gexc.RetryError):
        return Verdict(True, ProviderError(f"{service}: {exc}; the next sync tries again.", transient=True))
    if not isinstance(exc, gexc.GoogleAPICallError):
        return None

    code = getattr(exc, "code", None)
    message, reason = error_message(exc), error_reason(exc)
    what = f"{service} {code or ''} {type(exc).__name__}: {message}".replace("  ", " ")
    if isinstance(exc, (gexc.TooManyRequests, gexc.ResourceExhausted)):
        text = f"{message} {reason}"
        if _CAPACITY_WORDS.search(text):
            return Verdict(False, CapacityUnavailable(
                f"{what}. Google Cloud has no capacity for this machine or accelerator now; try later, "
                f"another machine type or another region."))
        if _QUOTA_WORDS.search(text) and not _RATE_WORDS.search(text):
            return Verdict(False, QuotaExceeded(
                f"{what}. Ask for a higher quota (IAM & Admin → Quotas in the Cloud console), or use "
                f"fewer or smaller machines or accelerators."))
        return Verdict(True, Throttled(
            f"{what} (rate-limited by Google Cloud after retries with backoff; the next sync tries again)."))
    if isinstance(exc, (gexc.Unauthorized, gexc.Forbidden)):
        hint = ("enable the API in the project (APIs & Services) and retry" if reason == "SERVICE_DISABLED"
                or "has not been used in project" in message or "is disabled" in message else
                "the credentials in use lack a permission or are invalid: grant the worker's identity the "
                "roles it needs (e.g. Vertex AI User, Storage Object Admin on the staging bucket, Logs "
                "Viewer) or renew its credentials")
        return Verdict(False, CredentialsError(f"{what}. {hint[0].upper()}{hint[1:]}."))
    if isinstance(exc, gexc.BadRequest):
        return Verdict(False, InvalidSpec(what))
    if isinstance(exc, (gexc.ServerError, gexc.Aborted)) or (isinstance(code, int) and code >= 500):
        return Verdict(True, ProviderError(f"{what} (a Google-side error; the next sync tries again).",
                                           transient=True))
    return Verdict(False, ProviderError(what))
