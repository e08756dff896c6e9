# Written by hand on 2026-12-07 (issue 29: compact raw-point storage).

import django.db.models.deletion
from django.db import migrations, models


def compact_existing(apps, schema_editor):
    """Every stored job's long series sealed into chunks (jobs.metric_store.compact): each series'
    rows in full chunks of CHUNK_POINTS points, the rest stay rows. Nothing is lost or changed
    (tests/jobs/test_metric_store.py: count and checksum before and after)."""
    from jobs.metric_store import compact

    MetricPoint = apps.get_model("jobs", "MetricPoint")
    MetricChunk = apps.get_model("jobs", "MetricChunk")
    for job_id in list(MetricPoint.objects.order_by().values_list("job_id", flat=True).distinct()):
        # 64 chunks (262,144 rows) a call: bounded memory whatever the history.
        while compact(job_id, max_chunks=64, point_model=MetricPoint, chunk_model=MetricChunk):
            pass


def expand_chunks(apps, schema_editor):
    """Back to one row per point (the reverse): every chunk's points written as rows, then the chunk
    deleted; the buckets already count them."""
    from jobs.metric_store import decode

    MetricPoint = apps.get_model("jobs", "MetricPoint")
    MetricChunk = apps.get_model("jobs", "MetricChunk")
    for chunk in MetricChunk.objects.order_by("id").iterator(chunk_size=16):
        rank = None if chunk.rank < 0 else chunk.rank
        MetricPoint.objects.bulk_create([
            MetricPoint(job_id=chunk.job_id, name=chunk.name, rank=rank, step=step, value=value, epoch=epoch,
                        recorded_at=at) for step, value, epoch, at in decode(chunk.data).rows()], batch_size=2000)
        chunk.delete()


def fold_finest_buckets(apps, schema_editor):
    """The width-16 level again (the reverse), folded from the rows."""
    from jobs.metric_fold import upsert
    from jobs.metric_store import Series, fold_arrays

    MetricPoint = apps.get_model("jobs", "MetricPoint")
    for job_id in list(MetricPoint.objects.order_by().values_list("job_id", flat=True).distinct()):
        keys = MetricPoint.objects.filter(job_id=job_id).order_by().values_list("name", "rank").distinct()
        for name, rank in list(keys):
            rows = (MetricPoint.objects.filter(job_id=job_id, name=name, rank=rank).order_by("step", "id")
                    .values_list("step", "value", "epoch", "recorded_at"))
            upsert(job_id, fold_arrays(name, rank, Series.from_rows(list(rows)), (16,)))


def drop_finest_buckets(apps, schema_editor):
    """The width-16 level is no longer stored (jobs.metric_fold.STORED_WIDTHS): a chart folds it from
    the raw points of its range."""
    apps.get_model("jobs", "MetricBucket").objects.filter(width=16).delete()


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0031_metric_points_pruned_at'),
    ]

    operations = [
        migrations.CreateModel(
            name='MetricChunk',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=100)),
                ('rank', models.IntegerField(help_text='The rank of a per-rank series; -1 (GLOBAL_RANK) for a global one.')),
                ('first_step', models.BigIntegerField()),
                ('last_step', models.BigIntegerField()),
                ('count', models.PositiveIntegerField()),
                ('data', models.BinaryField(help_text='The points, encoded by jobs.metric_store.encode.')),
                ('job', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='metric_chunks', to='jobs.trainingjob')),
            ],
            options={
                'indexes': [models.Index(fields=['job', 'name', 'rank', 'last_step'], name='metric_chunk_range')],
            },
        ),
        migrations.RunPython(drop_finest_buckets, fold_finest_buckets),
        migrations.RunPython(compact_existing, expand_chunks),
    ]
