"""``manage.py load_prices``: seed the admin-managed price catalog from the one the adapters ship.

    python manage.py load_prices              # add shipped rows not yet stored; keep the rest
    python manage.py load_prices --overwrite  # the shipped figures replace stored ones

Idempotent: running it twice changes nothing the second time. ``manage.py demo`` runs it after
migrating. Rows are written by ``jobs.services.instance_price_seed`` in one transaction.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from jobs import services


class Command(BaseCommand):
    help = (
        "Load the instance price catalog shipped with the adapters (cloud_adapters/data/prices.csv) "
        "into the database, where admins edit it and `refresh_prices` updates it. Rows already stored "
        "are kept unless --overwrite. Safe to run again."
    )

    def add_arguments(self, parser):
        parser.add_argument("--overwrite", action="store_true",
                            help="replace stored rows with the shipped figures (admin edits are lost)")

    def handle(self, *args, **opts):
        try:
            counts = services.instance_price_seed(overwrite=opts["overwrite"])
        except ValidationError as exc:
            raise CommandError("The shipped price catalog has a bad row: " + " ".join(exc.messages)) from exc
        self.stdout.write(
            f"Prices: {counts['created']} added, {counts['updated']} updated, "
            f"{counts['unchanged']} already stored."
        )
