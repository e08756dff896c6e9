"""``manage.py refresh_prices``: update the price catalog from a provider's own price API.

    python manage.py refresh_prices --provider aws --region us-east-1 --region eu-west-1
    python manage.py refresh_prices --provider aws --dry-run      # show what would change
    python manage.py refresh_prices --provider gcp --region us-central1 --instance-type a2-highgpu-1g
    python manage.py refresh_prices --provider azure --region eastus --instance-type Standard_NC24ads_A100_v4

Fetchers live in ``jobs.price_refresh.FETCHERS`` (provider → function). Everything is fetched
first and stored in one transaction (``jobs.services.instance_price_upsert``), so a network or
credentials failure half-way changes nothing. Progress goes to stderr, the summary to stdout.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from jobs import price_refresh, services
from jobs.pricing import DatabasePriceCatalog
from trainer_pkg.config import plural


class Command(BaseCommand):
    help = (
        "Refresh instance prices from a provider's price API and store them as confirmed rows "
        "(source and today's date). aws: the AWS Price List API (boto3 'pricing', us-east-1 endpoint, "
        "SageMaker training instances); it needs network access and AWS credentials from boto3's "
        "default chain (environment, --profile, instance role) with pricing:GetProducts. gcp: the Cloud "
        "Billing Catalog API (Vertex AI SKUs; machine types rebuilt from per-vCPU and per-GiB training "
        "prices, accelerators per GPU-hour; Spot/Preemptible SKUs stored as <type>:spot) with Application "
        "Default Credentials or --api-key. azure: the Azure Retail Prices API (no credentials; Linux "
        "pay-as-you-go VM prices, the Low Priority or else the Spot meter stored as <size>:low_priority). gcp and azure price the machine types / VM sizes the catalog already "
        "holds plus each --instance-type. Without --region, every region the catalog already holds for "
        "the provider is refreshed. Exit status 1 with nothing changed when the API cannot be read."
    )

    def add_arguments(self, parser):
        parser.add_argument("--provider", required=True, choices=sorted(price_refresh.FETCHERS),
                            help="whose prices to fetch; the internal rates of own clusters (slurm, kubernetes) "
                                 "have no price API and are never changed here: set them in the admin or with "
                                 "`load_prices --csv`")
        parser.add_argument("--region", action="append", default=[], metavar="REGION",
                            help="region code to price, e.g. us-east-1; repeat for several")
        parser.add_argument("--dry-run", action="store_true",
                            help="fetch and print what would change; write nothing")
        parser.add_argument("--instance-type", action="append", default=[], metavar="TYPE",
                            help="gcp/azure: a machine type or VM size to price besides those the catalog "
                                 "holds, e.g. n1-standard-16 or Standard_NC24ads_A100_v4; repeat for several")
        parser.add_argument("--profile", default="", help="aws: the AWS profile name to use (default chain if empty)")
        parser.add_argument("--api-key", default="",
                            help="gcp: a Google API key for the Cloud Billing API instead of Application "
                                 "Default Credentials")
        parser.add_argument("--endpoint-url", default="",
                            help="another price API root, e.g. a proxy or a local test server (aws: the "
                                 "Price List API endpoint; gcp: instead of https://cloudbilling.googleapis.com; "
                                 "azure: instead of https://prices.azure.com/api/retail/prices)")

    def handle(self, *args, **opts):
        provider = opts["provider"]
        regions = list(dict.fromkeys(opts["region"])) or self._known_regions(provider)

        def progress(message: str) -> None:
            self.stderr.write(message)

        try:
            rows = price_refresh.fetch_prices(
                provider, regions, progress=progress,
                options={"profile": opts["profile"], "endpoint_url": opts["endpoint_url"],
                         "api_key": opts["api_key"],
                         "instance_types": self._known_types(provider) + list(opts["instance_type"])},
            )
        except price_refresh.PriceRefreshError as exc:
            raise CommandError(f"{exc} No price was changed.") from exc
        if not rows:
            raise CommandError(
                f"The {provider} price API returned no prices for {', '.join(regions)}; check the region "
                f"codes. No price was changed."
            )
        if opts["dry_run"]:
            self._show_changes(rows)
            self.stdout.write(f"Dry run: {plural(len(rows), 'price', 'prices')} fetched, nothing written.")
            return
        try:
            counts = services.instance_price_upsert(rows=rows, overwrite=True)
        except ValidationError as exc:
            raise CommandError("The price API returned a bad row: " + " ".join(exc.messages)) from exc
        self.stdout.write(
            f"{provider} prices for {', '.join(regions)}: {counts['created']} added, "
            f"{counts['updated']} updated, {counts['unchanged']} unchanged."
        )

    def _known_regions(self, provider: str) -> list[str]:
        regions = sorted({row.region for row in DatabasePriceCatalog().rows(provider)})
        return regions or [price_refresh.DEFAULT_REGIONS.get(provider, "")]

    def _known_types(self, provider: str) -> list[str]:
        """The instance types the catalog holds for ``provider`` (any region), without suffixes such
        as ``:low_priority``: what a gcp/azure refresh prices besides ``--instance-type``."""
        return sorted({row.instance_type.split(":", 1)[0] for row in DatabasePriceCatalog().rows(provider)})

    def _show_changes(self, rows) -> None:
        catalog = DatabasePriceCatalog()
        for row in rows:
            old = catalog.lookup(row.provider, row.region, row.instance_type)
            if old is None:
                change = "new"
            elif old.usd_per_hour != row.usd_per_hour:
                change = f"was ${old.usd_per_hour.normalize():f}"
            else:
                change = "unchanged"
            self.stdout.write(f"{row.provider} {row.region} {row.instance_type}: "
                              f"${row.usd_per_hour.normalize():f}/h ({change})")
