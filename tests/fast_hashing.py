"""Password hashing at test speed, the hash format unchanged.

Django 5.2's PBKDF2 hasher runs 1,000,000 iterations per password: about half a second of a core for
each user a test makes and each ``client.login``, ~1,000 users a run. The suite hashes with
:class:`FastPBKDF2PasswordHasher` instead (``tests/conftest.py`` puts it first in
``PASSWORD_HASHERS`` for the whole session): the same algorithm and the same
``pbkdf2_sha256$<iterations>$<salt>$<hash>`` text with 1 iteration, which any process's standard
hasher verifies, since the iterations are read from the hash. A Celery worker, the demo or another
subprocess of a test keeps Django's default, and the users it makes are verified here as they are.
Passwords themselves are not the subject of any test; their validators still run.
"""

from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class FastPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """PBKDF2-SHA256 with one iteration (tests only)."""

    iterations = 1

    def must_update(self, encoded: str) -> bool:
        return False  # a default-strength hash made by a subprocess is not re-hashed on login
