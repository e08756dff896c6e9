"""`python manage.py compact_metrics [--job ID ...]`: seal every full series of the jobs' metric point rows
into chunks (jobs.metric_store.compact), as migration 0031 did for the points stored before chunks.

The sync compacts a series when its points cross a chunk's worth of steps; a series whose passes bring
one point at a time past that boundary, or points stored by ``MetricPoint.objects.bulk_create`` outside
the sync, keep their rows until this runs. Idempotent: rows short of a full chunk stay rows.
"""

from __future__ import annotations

from django.core.management import BaseCommand

from jobs import metric_store
from jobs.models import MetricPoint


class Command(BaseCommand):
    help = "Seal the full series of metric point rows into compact chunks (all jobs, or --job)."

    def add_arguments(self, parser):
        parser.add_argument("--job", type=int, action="append", help="a job id (repeatable); default every job")

    def handle(self, *args, **options):
        job_ids = options["job"] or list(MetricPoint.objects.order_by().values_list("job_id", flat=True).distinct())
        total = 0
        for job_id in sorted(set(job_ids)):
            while sealed := metric_store.compact(job_id):
                total += sealed
        self.stdout.write(f"{total} chunks of {metric_store.CHUNK_POINTS} points sealed over {len(set(job_ids))} jobs")
