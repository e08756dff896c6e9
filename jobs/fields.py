"""Model fields that keep secrets encrypted at rest (DESIGN.md §8).

:class:`EncryptedJSONField` stores a JSON object as a Fernet token (AES-128-CBC + HMAC-SHA256, from
the ``cryptography`` package) in a text column. The keys come from ``settings.TRAINBOARD_ENCRYPTION_KEYS``
(environment variable ``TRAINBOARD_ENCRYPTION_KEY``: one or more url-safe base64 Fernet keys, comma
separated, newest first; older keys still decrypt, so keys can be rotated with
``manage.py rotate_secrets``). The database, a dump of it, and the admin's raw views see only the token.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import models

from cloud_adapters import redaction

TOKEN_PREFIX = "fernet:"
"""Marks an encrypted value, so a plain-text value can never be mistaken for one (or vice versa)."""


@lru_cache(maxsize=4)
def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    if not keys:
        raise ImproperlyConfigured("TRAINBOARD_ENCRYPTION_KEY is not set: secrets cannot be stored")
    try:
        return MultiFernet([Fernet(k.encode()) for k in keys])
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(
            "TRAINBOARD_ENCRYPTION_KEY must be comma-separated Fernet keys (32 url-safe base64 bytes each, "
            "e.g. from `python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'`)"
        ) from exc


def fernet() -> MultiFernet:
    """The MultiFernet for the configured keys (first key encrypts, every key decrypts)."""
    return _fernet(tuple(getattr(settings, "TRAINBOARD_ENCRYPTION_KEYS", ()) or ()))


def encrypt_json(value: Any) -> str:
    """``value`` (JSON-serialisable) → ``"fernet:<token>"``. Its strings are redacted from this
    process's logs and adapter errors from now on (:mod:`cloud_adapters.redaction`)."""
    redaction.register(value)
    return TOKEN_PREFIX + fernet().encrypt(json.dumps(value, sort_keys=True).encode()).decode()


def decrypt_json(text: str) -> Any:
    """Inverse of :func:`encrypt_json`. Raises ImproperlyConfigured when no configured key opens it."""
    if not text.startswith(TOKEN_PREFIX):
        raise ImproperlyConfigured("stored secret is not an encrypted token")
    try:
        value = json.loads(fernet().decrypt(text[len(TOKEN_PREFIX):].encode()))
    except InvalidToken as exc:
        raise ImproperlyConfigured(
            "a stored secret cannot be decrypted with TRAINBOARD_ENCRYPTION_KEY (was the key changed "
            "without keeping the old one after it?)"
        ) from exc
    redaction.register(value)  # decrypted in this process: keep it out of its logs
    return value


class EncryptedJSONField(models.TextField):
    """A dict of secret strings, encrypted in the database, plain in Python.

    Empty dict ↔ empty string (nothing to encrypt). Lookups other than ``isnull``/exact-empty are
    meaningless on ciphertext and are not supported.
    """

    description = "JSON object encrypted with Fernet"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", dict)
        kwargs.setdefault("blank", True)
        kwargs.setdefault("editable", False)  # never in a ModelForm or the admin by accident
        super().__init__(*args, **kwargs)

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if value in (None, ""):
            return {}
        return decrypt_json(value)

    def to_python(self, value: Any) -> Any:
        if value in (None, ""):
            return {}
        if isinstance(value, str):
            return decrypt_json(value) if value.startswith(TOKEN_PREFIX) else json.loads(value)
        return value

    def get_prep_value(self, value: Any) -> Any:
        if value in (None, "", {}):
            return ""
        if isinstance(value, str) and value.startswith(TOKEN_PREFIX):
            return value
        return encrypt_json(value)

    def value_to_string(self, obj: Any) -> str:
        # dumpdata/serializers get the ciphertext, never the secret.
        return self.get_prep_value(self.value_from_object(obj))
