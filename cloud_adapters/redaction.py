"""Credentials out of log lines and error messages.

A backend's stored secrets are decrypted in the web process and in every worker, and the SDKs that
use them log at DEBUG what they send (botocore logs each signed request, session token included, and
each response body) while a provider may quote the request in its error text ("... Authorization:
Bearer eyJ..."). What a job shows (``failure_reason``, ``status_warning``, events) is an adapter
error's ``str()``, and the worker logs the same text. So both pass through :func:`redact`:

* **known values**: every secret this process encrypted or decrypted (:func:`register`, called by
  ``jobs.fields``), and each long line of a multi-line one (the body lines of a PEM private key);
* **credential shapes**, whoever made them: ``Bearer <token>``, SigV4 ``Credential=<access key id>``,
  AWS access key ids, ``X-Amz-Security-Token`` values, JWTs (Google self-signed and Entra ID tokens),
  Google ``ya29.`` access tokens, PEM private keys, ``client_secret=`` and the credential parameters
  of presigned URLs (``X-Amz-Credential``/``-Signature``/``-Security-Token``, Azure SAS ``sig``).

:func:`install_log_redaction` makes every log record of the process pass through it (the record is
formatted, and its traceback too, when it is created), whatever handler Django or Celery attaches;
``jobs.apps`` installs it at start-up. ``cloud_adapters.base.BackendError`` redacts its message.
"""

from __future__ import annotations

import logging
import re
import threading
import traceback
from typing import Any, Callable, Iterable, Mapping

REDACTED = "[redacted]"

MIN_KNOWN_LENGTH = 8
"""Shorter stored values (a region, "t") are not searched for: they would blank ordinary words."""

# (pattern, keep group 1) — group 1, when kept, is the label before the credential.
_SHAPES: tuple[tuple[re.Pattern[str], bool], ...] = (
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S), False),
    (re.compile(r"(\bBearer\s+)[A-Za-z0-9._~+/=-]{8,}", re.I), True),
    (re.compile(r"(Credential=)[A-Za-z0-9]{12,128}"), True),
    (re.compile(r"\b(?:AKIA|ASIA|AROA|AIDA)[A-Z0-9]{16}\b"), False),
    (re.compile(r"""(x-amz-security-token['"]?\s*[:=]\s*b?['"]?)[A-Za-z0-9/+=._-]{8,}""", re.I), True),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{8,}"), False),
    (re.compile(r"\bya29\.[A-Za-z0-9._-]{8,}"), False),
    (re.compile(r"""(client_secret['"]?\s*[:=]\s*['"]?)[^\s&;'",}]{4,}""", re.I), True),
    (re.compile(r"""([?&](?:X-Amz-Credential|X-Amz-Signature|X-Amz-Security-Token|sig)=)[^&\s'"]+""", re.I), True),
)

_SECRET_JSON_FIELDS = frozenset({"private_key", "private_key_id", "client_secret", "refresh_token"})
"""The fields of a key file stored as one secret (Google's service-account and authorized-user JSON)
that are secret themselves; its e-mail, project and URLs are not."""

_lock = threading.Lock()
_known: set[str] = set()
_known_re: re.Pattern[str] | None = None


def _leaves(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)


def register(secrets: Any) -> None:
    """Remember the string values in ``secrets`` (a dict of them, a list, or one string) as text
    :func:`redact` removes from now on in this process. A value that is JSON (a service-account key
    file) counts with its secret fields (:data:`_SECRET_JSON_FIELDS`); a multi-line one also line by
    line (lines of 16 characters or more)."""
    import json

    global _known_re
    found: set[str] = set()
    for text in _leaves(secrets):
        found.add(text)
        if text.lstrip().startswith("{"):
            try:
                document = json.loads(text)
            except ValueError:
                continue
            if isinstance(document, dict):  # the secret fields only: not "type": "service_account"
                found.update(v for k, v in document.items() if k in _SECRET_JSON_FIELDS and isinstance(v, str))
    for text in list(found):
        for line in re.split(r"\r?\n|\\n", text):
            if len(line.strip()) >= 16 and not line.strip().startswith("-----"):  # not a PEM's armour
                found.add(line.strip())
    found = {text for text in found if len(text) >= MIN_KNOWN_LENGTH}
    with _lock:
        if found <= _known:
            return
        _known.update(found)
        _known_re = _alternation(_known)


def _alternation(texts: Iterable[str]) -> re.Pattern[str] | None:
    """One pattern matching any of ``texts`` literally; None for none. Longest first, so a value is
    removed whole rather than around a shorter one inside it."""
    texts = sorted(set(texts), key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


JOB_SECRET_MASK = "***"
MIN_JOB_SECRET_LENGTH = 4
"""Shorter job-secret values are not masked in log lines: "1" or "yes" would blank the log's own text."""


def job_secret_redactor(secrets: Mapping[str, str]) -> Callable[[str], str]:
    """A function that replaces, in one log line, every value of ``secrets`` (a backend's job
    secrets: name → value) of at least :data:`MIN_JOB_SECRET_LENGTH` characters by
    :data:`JOB_SECRET_MASK`, and each line of 16 characters or more of a multi-line value (a log line
    holds one line of it). The identity when there is nothing to mask.

    The job's own output is stored as it is but for these: unlike :func:`redact`, credential shapes
    are left (the user's code may print what it likes of its own), only the values this backend
    gives its jobs are masked."""
    texts: set[str] = set()
    for value in secrets.values():
        if not isinstance(value, str):
            continue
        if len(value) >= MIN_JOB_SECRET_LENGTH:
            texts.add(value)
        texts.update(line.strip() for line in value.splitlines() if len(line.strip()) >= 16)
    pattern = _alternation(texts)
    if pattern is None:
        return lambda line: line
    return lambda line: pattern.sub(JOB_SECRET_MASK, line)


def redact(text: str) -> str:
    """``text`` with known secrets and credential-shaped strings replaced by ``[redacted]``."""
    if not text:
        return text
    for pattern, keep_label in _SHAPES:  # first: a whole PEM block goes as one
        text = pattern.sub((lambda m: m.group(1) + REDACTED) if keep_label else REDACTED, text)
    known = _known_re
    if known is not None:
        text = known.sub(REDACTED, text)
    return text


def install_log_redaction() -> None:
    """Redact every log record of this process when it is made (idempotent).

    A record factory rather than a handler filter: Celery's worker replaces the root logger's
    handlers with its own, and a logger filter sees only records logged on that very logger. The
    record's message is formatted at once (only records a logger lets through are made) and its
    traceback too, since an exception's text (a provider's error body) is part of what is written.
    """
    previous = logging.getLogRecordFactory()
    if getattr(previous, "redacting", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: leave it to the handler to report
            return record
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            clean = redact(text)
            if clean != text:
                record.exc_text = clean  # what Formatter.format writes instead of formatting exc_info
        return record

    factory.redacting = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
