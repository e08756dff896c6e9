"""Webhook deliveries: the URL check (http(s) only, no private address: SSRF), the payload and its
signature, one attempt over HTTP, and the retry schedule.

A delivery is a :class:`~jobs.models.WebhookDelivery` row written when its event is recorded
(:mod:`jobs.notifications`); the ``deliver_webhook`` task (sent after commit) and beat's
``webhook_deliveries_due`` (every ``TRAINBOARD_WEBHOOK_SWEEP_INTERVAL_S``) both call
:func:`delivery_attempt`. The sync never waits for an endpoint: it only writes rows.

At least once: a worker takes a due row by moving its ``next_attempt_at`` past the attempt (a lease
of the HTTP timeout + :data:`LEASE_MARGIN_S`); a worker killed mid-attempt leaves the row due again
once the lease ends, and the next sweep sends it. The receiver deduplicates by
``X-Trainboard-Delivery``.

Each attempt resolves the host, refuses it when any address is private, loopback, link-local,
reserved or multicast (the cloud metadata address 169.254.169.254 is link-local) unless it lies in
``TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS`` (a host setting), and then connects to the address it
checked (the Host header and TLS server name stay the URL's), so a name that resolves differently
the second time (DNS rebinding) cannot reach another address. Redirects are not followed.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs import counters, validation
from jobs.models import WebhookDelivery

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 10.0
"""Seconds a worker holds a delivery beyond its HTTP timeout before another may take it."""
MAX_URL_LENGTH = 2000
MAX_RESPONSE_EXCERPT = 200
"""Characters of a failed answer's body kept in the delivery log."""
SIGNATURE_HEADER = "X-Trainboard-Signature"
EVENT_HEADER = "X-Trainboard-Event"
DELIVERY_HEADER = "X-Trainboard-Delivery"
USER_AGENT = "Trainboard-Webhook/1"


class UrlRefused(ValueError):
    """A webhook URL Trainboard will not call; ``str()`` says why and what to do."""


# ---------------------------------------------------------------------------------------------
# The URL and its addresses
# ---------------------------------------------------------------------------------------------


def allowed_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The operator's ``TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS`` (CIDRs) that may be called although
    not public (e.g. ``10.0.0.0/8`` for an in-house chat server; the tests' ``127.0.0.0/8``)."""
    return [ipaddress.ip_network(n, strict=False) for n in settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS]


def address_refusal(address: str) -> str | None:
    """Why ``address`` (an IPv4/IPv6 literal) may not be called, or None when it may."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in network for network in allowed_networks()):
        return None
    for kind, flag in (("loopback", ip.is_loopback), ("link-local (cloud metadata)", ip.is_link_local),
                       ("private", ip.is_private), ("multicast", ip.is_multicast),
                       ("reserved", ip.is_reserved or ip.is_unspecified), ("non-public", not ip.is_global)):
        if flag:
            return (f"{ip} is a {kind} address; webhooks go to public addresses only (an operator can "
                    f"allow a network with TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS)")
    return None


@dataclass(frozen=True)
class Target:
    """A checked URL: ``url`` as given, ``host`` (the Host header and TLS server name), ``port``,
    and ``address``, the checked IP the attempt connects to."""

    url: str
    host: str
    port: int
    address: str

    def url_by_address(self) -> str:
        parts = urlsplit(self.url)
        ip = self.address if ":" not in self.address else f"[{self.address}]"
        return urlunsplit((parts.scheme, f"{ip}:{self.port}", parts.path or "/", parts.query, ""))


def url_problem(url: Any) -> str | None:
    """The static check of a webhook URL (no DNS): why it is refused, or None. http(s) only, a host,
    no credentials in it, at most :data:`MAX_URL_LENGTH` characters, no fragment."""
    if not isinstance(url, str) or not url.strip():
        return "Enter the URL that receives the events, e.g. https://hooks.example.com/trainboard."
    url = url.strip()
    if len(url) > MAX_URL_LENGTH:
        return f"The URL is {len(url):,} characters long; at most {MAX_URL_LENGTH:,}."
    if any(c.isspace() or ord(c) < 32 for c in url) or validation.text_problem(url):
        return "The URL may not contain spaces or control characters."
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"This is not a valid URL ({exc})."
    if parts.scheme not in ("http", "https"):
        return f"Only http:// and https:// URLs are called, not {parts.scheme or 'a URL without a scheme'}."
    if not parts.hostname:
        return "The URL has no host."
    if parts.username or parts.password:
        return "Put no user name or password in the URL: the signature header authenticates Trainboard."
    if port == 0:
        return "Port 0 cannot be called."
    return None


def resolve_target(url: str) -> Target:
    """Check ``url`` (:func:`url_problem`), resolve its host, and refuse it when any address is not
    public (:func:`address_refusal`). Returns the first address as a :class:`Target`.

    Raises :class:`UrlRefused` with the reason (a host that does not resolve, or a refused address)."""
    problem = url_problem(url)
    if problem:
        raise UrlRefused(problem)
    parts = urlsplit(url.strip())
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UrlRefused(f"The host {host} does not resolve ({exc}).") from exc
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise UrlRefused(f"The host {host} has no address.")
    for address in addresses:
        refusal = address_refusal(address)
        if refusal:
            raise UrlRefused(f"{host} resolves to {address}, and {refusal}." if host != address.split("%")[0]
                             else refusal + ".")
    return Target(url=url.strip(), host=host, port=port, address=addresses[0])


# ---------------------------------------------------------------------------------------------
# Payload and signature
# ---------------------------------------------------------------------------------------------


def body_bytes(payload: dict[str, Any]) -> bytes:
    """The exact bytes POSTed for ``payload`` (compact JSON, keys sorted, UTF-8): the same at every
    attempt, and what the signature covers."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def signature(secret: str, body: bytes) -> str:
    """``X-Trainboard-Signature``'s value: ``sha256=`` + hex HMAC-SHA256 of the raw ``body`` keyed by
    ``secret`` (UTF-8). A receiver recomputes it over the body it read and compares in constant time."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def new_secret() -> str:
    """A fresh signing secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


# ---------------------------------------------------------------------------------------------
# Retry schedule
# ---------------------------------------------------------------------------------------------


def retry_delays_s() -> list[float]:
    """Seconds to wait after attempt 1, 2, ... before the next (``TRAINBOARD_WEBHOOK_RETRY_DELAYS_S``;
    default 60, 180, 540, 1080: 5 attempts over 31 minutes). After the last, the delivery gives up."""
    return [float(s) for s in settings.TRAINBOARD_WEBHOOK_RETRY_DELAYS_S]


def max_attempts() -> int:
    """Attempts a delivery gets: one plus one per retry delay."""
    return len(retry_delays_s()) + 1


def next_attempt_delay_s(attempts_made: int) -> float | None:
    """Seconds until the next attempt after ``attempts_made`` failed retryable attempts, or None when
    that was the last (give up)."""
    delays = retry_delays_s()
    return delays[attempts_made - 1] if 1 <= attempts_made <= len(delays) else None


def is_retryable(status_code: int | None) -> bool:
    """Network errors (no status), 5xx and 429 are retried; other answers are final."""
    return status_code is None or status_code >= 500 or status_code == 429


# ---------------------------------------------------------------------------------------------
# One attempt
# ---------------------------------------------------------------------------------------------


def timeout_s() -> float:
    """The HTTP timeout of one attempt, seconds (``TRAINBOARD_WEBHOOK_TIMEOUT_S``, default 5)."""
    return float(settings.TRAINBOARD_WEBHOOK_TIMEOUT_S)


def delivery_claim(delivery_id: int, *, now: dt.datetime | None = None) -> WebhookDelivery | None:
    """Take delivery ``delivery_id`` if it is due and unfinished: its ``next_attempt_at`` moves to
    now + timeout + :data:`LEASE_MARGIN_S` in one conditional update. None when it is not due, is
    finished, or another worker took it first."""
    now = now or timezone.now()
    lease = now + dt.timedelta(seconds=timeout_s() + LEASE_MARGIN_S)
    taken = WebhookDelivery.objects.filter(pk=delivery_id, delivered_at__isnull=True, given_up_at__isnull=True,
                                           next_attempt_at__lte=now).update(next_attempt_at=lease)
    if not taken:
        return None
    return WebhookDelivery.objects.select_related("webhook").get(pk=delivery_id)


def delivery_attempt(delivery_id: int) -> str:
    """Make one attempt of delivery ``delivery_id`` if it is due (:func:`delivery_claim`), record it,
    and schedule the next or give up. Returns "delivered", "retry", "given up" or "not due".

    Never raises for the endpoint's faults: a refused URL, a timeout, a connection error or an
    answer are all recorded in ``attempts`` (status_code, error, duration_ms)."""
    delivery = delivery_claim(delivery_id)
    if delivery is None:
        return "not due"
    webhook = delivery.webhook
    started = timezone.now()
    status_code, error = None, ""
    t0 = time.monotonic()
    if not webhook.enabled:
        status_code, error = None, "the webhook is disabled"
        retryable = False
    else:
        try:
            status_code, error = _post(webhook.url, (webhook.secret or {}).get("key", ""), delivery)
        except UrlRefused as exc:
            error = str(exc)
            retryable = False
        else:
            retryable = is_retryable(status_code)
    duration_ms = round((time.monotonic() - t0) * 1000)
    ok = status_code is not None and 200 <= status_code < 300
    if status_code is not None and not ok and 300 <= status_code < 400:
        retryable = False
    attempt = {"at": started.isoformat(), "status_code": status_code, "error": error[:500],
               "duration_ms": duration_ms}
    made = delivery.attempt_count + 1
    fields: dict[str, Any] = {"attempts": [*delivery.attempts, attempt], "attempt_count": made}
    if ok:
        fields.update(delivered_at=timezone.now(), next_attempt_at=None)
        outcome = "delivered"
    else:
        delay = next_attempt_delay_s(made) if retryable else None
        if delay is None:
            fields.update(given_up_at=timezone.now(), next_attempt_at=None)
            outcome = "given up"
        else:
            fields.update(next_attempt_at=timezone.now() + dt.timedelta(seconds=delay))
            outcome = "retry"
    with transaction.atomic():
        WebhookDelivery.objects.filter(pk=delivery.pk).update(**fields)
        if not ok:
            counters.count(counters.WEBHOOK_ATTEMPTS_FAILED)
        if outcome == "given up":
            counters.count(counters.WEBHOOK_DELIVERIES_GIVEN_UP)
    log.info("webhook %s delivery %s (%s) attempt %s: %s %s → %s", webhook.pk, delivery.delivery_id,
             delivery.event, made, status_code, error, outcome)
    return outcome


_CLIENT: httpx.Client | None = None


def _http_client() -> httpx.Client:
    """This process's HTTP client (made once: loading the CA bundle is the slow part of a request).
    No redirects followed, no proxy or netrc from the environment."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(follow_redirects=False, trust_env=False)
    return _CLIENT


def _post(url: str, secret: str, delivery: WebhookDelivery) -> tuple[int | None, str]:
    """POST the delivery's body to the checked address of ``url``: (status code, "") for an answer,
    (status code, excerpt) for a non-2xx answer, (None, error) for a network error or timeout.
    Raises :class:`UrlRefused` when the URL or its address is refused."""
    target = resolve_target(url)
    body = body_bytes(delivery.payload)
    headers = {
        "Host": target.host if target.port in (80, 443) else f"{target.host}:{target.port}",
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        EVENT_HEADER: delivery.event,
        DELIVERY_HEADER: str(delivery.delivery_id),
        SIGNATURE_HEADER: signature(secret, body),
    }
    extensions = {"sni_hostname": target.host} if urlsplit(target.url).scheme == "https" else {}
    try:
        response = _http_client().post(target.url_by_address(), content=body, headers=headers,
                                       extensions=extensions, timeout=timeout_s())
    except httpx.TimeoutException:
        return None, f"timed out after {timeout_s():g} s"
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if 200 <= response.status_code < 300:
        return response.status_code, ""
    excerpt = response.text[:MAX_RESPONSE_EXCERPT].strip()
    if 300 <= response.status_code < 400:
        excerpt = f"redirect to {response.headers.get('location', '?')} not followed"
    return response.status_code, excerpt


def due_delivery_ids(*, now: dt.datetime | None = None, limit: int = 500) -> list[int]:
    """Ids of unfinished deliveries whose ``next_attempt_at`` has passed (a retry that is due, or a
    row a killed worker left), oldest first, at most ``limit``."""
    now = now or timezone.now()
    return list(WebhookDelivery.objects.filter(delivered_at__isnull=True, given_up_at__isnull=True,
                                               next_attempt_at__lte=now)
                .order_by("next_attempt_at", "id").values_list("pk", flat=True)[:limit])


def new_delivery_id() -> uuid.UUID:
    return uuid.uuid4()
