"""What an error of the official ``kubernetes`` client means for Trainboard.

:func:`classify` tells :func:`cloud_adapters.retry.call` whether an exception of a call is transient
and which Trainboard error it becomes:

=============================================  =======  ==========================================
exception                                      retried  raised at the end
=============================================  =======  ==========================================
ApiException 401, 403                           no       :class:`CredentialsError`
ApiException 429 (API Priority and Fairness)    yes      :class:`Throttled`
ApiException 5xx, or status 0/none (no answer) yes      ProviderError(transient=True)
ApiException 422 (Invalid), 400 (BadRequest)    no       :class:`InvalidSpec`, the server's message
ApiException 404, 409 and any other             no       ProviderError, the server's message
urllib3 errors (connection refused, timeout,    yes      ProviderError(transient=True)
TLS), ConnectionError, TimeoutError
kubernetes.config.ConfigException               no       :class:`CredentialsError` (the kubeconfig)
=============================================  =======  ==========================================

The server's message is the ``message`` of the ``Status`` object in the answer's body (the API's
error form, kubernetes.io API concepts "Responses"); a body that is not one is cut to 300 characters.
The client is imported inside the functions, so importing this module needs no SDK.
"""

from __future__ import annotations

import json

from cloud_adapters.base import CredentialsError, InvalidSpec, ProviderError, Throttled
from cloud_adapters.retry import Verdict


def status_message(exc: BaseException) -> str:
    """The ``message`` of the Kubernetes ``Status`` in an ApiException's body, else its reason."""
    body = getattr(exc, "body", None)
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str) and body.strip():
        try:
            data = json.loads(body)
        except ValueError:
            return body.strip()[:300]
        if isinstance(data, dict) and data.get("message"):
            return str(data["message"])[:2000]
    return str(getattr(exc, "reason", "") or exc)[:300]


def status_code(exc: BaseException) -> int | None:
    """The HTTP status of an ApiException (or of the ApiException behind a classified error), else None."""
    from kubernetes.client.exceptions import ApiException

    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, ApiException):
            return exc.status if isinstance(exc.status, int) else None
        exc = exc.__cause__  # type: ignore[assignment]
        seen += 1
    return None


def classify(exc: BaseException, *, service: str = "Kubernetes") -> Verdict | None:
    """The verdict for an exception of a ``kubernetes`` client call (module table); None for others.
    ``service`` names the API in messages."""
    import urllib3
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException

    if isinstance(exc, ConfigException):
        return Verdict(False, CredentialsError(
            f"{service}: the cluster configuration cannot be used ({exc}); check the kubeconfig file and context "
            f"(or the in-cluster service account) the backend names."))
    if isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)):
        return Verdict(True, ProviderError(
            f"{service}: could not reach the API server ({type(exc).__name__}: {str(exc)[:200]}); check the "
            f"kubeconfig's server address and the network. The next sync tries again.", transient=True))
    if not isinstance(exc, ApiException):
        return None
    code = exc.status if isinstance(exc.status, int) else None
    message = status_message(exc)
    what = f"{service} {code or ''} {exc.reason or ''}: {message}".replace("  ", " ")
    if code in (401, 403):
        return Verdict(False, CredentialsError(
            f"{what}. The backend's identity (its token, or the kubeconfig's user) is not allowed this; it needs "
            f"trainjobs create/get/list/delete and pods list, pods/log get in the namespace (docs/kubernetes.md)."))
    if code == 429:
        return Verdict(True, Throttled(f"{what}; the API server is rate-limiting this client, the next sync tries again."))
    if not code or code >= 500:  # 0: the client got no answer (its rest.py, e.g. a TLS error)
        return Verdict(True, ProviderError(f"{what}; the next sync tries again.", transient=True))
    if code in (400, 422):
        return Verdict(False, InvalidSpec(f"{what}"))
    return Verdict(False, ProviderError(what))
