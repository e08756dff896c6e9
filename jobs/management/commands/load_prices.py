"""``manage.py load_prices``: seed the admin-managed price catalog from the one the adapters ship, or
load a site's own rows (the internal rates of its Slurm and Kubernetes clusters) from a CSV.

    python manage.py load_prices                          # add shipped rows not yet stored; keep the rest
    python manage.py load_prices --overwrite              # the shipped figures replace stored ones
    python manage.py load_prices --csv rates.csv --overwrite   # this file's rows, replacing stored ones

A CSV has the shipped file's columns (``cloud_adapters.pricing.CSV_FIELDS``) and, for internal rates,
``usd_per_gpu_hour`` (a file without that column loads as before, every GPU-hour rate 0).
Idempotent: running it twice changes nothing the second time. ``manage.py demo`` runs it after
migrating. Rows are written by ``jobs.services`` (``instance_price_seed``, ``instance_price_upsert``)
in one transaction: one bad row and nothing is written.
"""

from __future__ import annotations

import csv

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from cloud_adapters.pricing import read_csv
from jobs import services


class Command(BaseCommand):
    help = (
        "Load the instance price catalog shipped with the adapters (cloud_adapters/data/prices.csv), or "
        "the CSV given with --csv, into the database, where admins edit it and `refresh_prices` updates "
        "the clouds' rows. Rows already stored are kept unless --overwrite. Safe to run again."
    )

    def add_arguments(self, parser):
        parser.add_argument("--overwrite", action="store_true",
                            help="replace stored rows with the file's figures (admin edits of those rows are lost)")
        parser.add_argument("--csv", default="", metavar="FILE",
                            help="load this catalog CSV instead of the shipped one: the shipped file's columns "
                                 "(provider, region, instance_type, usd_per_hour, source, as_of, confirmed) and "
                                 "optionally usd_per_gpu_hour, e.g. an own cluster's internal rates "
                                 "(provider slurm or kubernetes, region = cluster, instance_type = partition "
                                 "or node pool)")

    def handle(self, *args, **opts):
        try:
            if opts["csv"]:
                try:
                    rows = read_csv(opts["csv"])
                except (OSError, ValueError, UnicodeDecodeError, csv.Error) as exc:
                    raise CommandError(f"Cannot read the price CSV: {exc}. No price was changed.") from exc
                counts = services.instance_price_upsert(rows=rows, overwrite=opts["overwrite"])
            else:
                counts = services.instance_price_seed(overwrite=opts["overwrite"])
        except ValidationError as exc:
            where = opts["csv"] or "The shipped price catalog"
            raise CommandError(f"{where} has a bad row: " + " ".join(exc.messages) + " No price was changed.") from exc
        self.stdout.write(
            f"Prices: {counts['created']} added, {counts['updated']} updated, "
            f"{counts['unchanged']} already stored."
        )
