"""``manage.py rotate_secrets``: re-encrypt every stored secret with the first key of
``TRAINBOARD_ENCRYPTION_KEY``.

Rotation: put the new key first and keep the old one after it
(``TRAINBOARD_ENCRYPTION_KEY=<new>,<old>``), run this command, then drop the old key. Each row is
rewritten in one transaction; a row no configured key opens stops the command with the row named
(nothing is half-rotated: the transaction rolls back) and exit status 1.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from jobs.fields import TOKEN_PREFIX, fernet
from jobs.models import ComputeBackend
from trainer_pkg.config import plural


class Command(BaseCommand):
    help = ("Re-encrypt every stored backend secret with the first key of TRAINBOARD_ENCRYPTION_KEY "
            "(older keys listed after it must still open them).")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Check that every row decrypts; write nothing.")

    def handle(self, *args, dry_run: bool = False, **options) -> None:
        table = connection.ops.quote_name(ComputeBackend._meta.db_table)
        rotated = 0
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT id, secrets FROM {table} WHERE secrets <> '' ORDER BY id FOR UPDATE"
                               if connection.vendor == "postgresql" else
                               f"SELECT id, secrets FROM {table} WHERE secrets <> '' ORDER BY id")
                rows = cursor.fetchall()
            for pk, token in rows:
                if not token.startswith(TOKEN_PREFIX):
                    raise CommandError(f"backend {pk}: its secrets column is not an encrypted token; "
                                       f"re-enter the backend's credentials")
                try:
                    new = TOKEN_PREFIX + fernet().rotate(token[len(TOKEN_PREFIX):].encode()).decode()
                except Exception as exc:  # InvalidToken, or keys not configured
                    detail = str(exc) if isinstance(exc, ImproperlyConfigured) else (
                        "no key of TRAINBOARD_ENCRYPTION_KEY opens it; add the key it was written with after the new one")
                    raise CommandError(f"backend {pk}: {detail}") from None
                if not dry_run:
                    with connection.cursor() as cursor:
                        cursor.execute(f"UPDATE {table} SET secrets = %s WHERE id = %s", [new, pk])
                rotated += 1
        verb = "would re-encrypt" if dry_run else "re-encrypted"
        self.stdout.write(f"{verb} the secrets of {plural(rotated, 'backend', 'backends')} with the first key.")
