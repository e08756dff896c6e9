from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0030_log_line_is_metric'),
    ]

    operations = [
        migrations.AddField(
            model_name='trainingjob',
            name='metric_points_pruned_at',
            field=models.DateTimeField(blank=True, help_text="When the operator's retention (TRAINBOARD_METRIC_POINTS_RETENTION_DAYS after the job ended) removed its step-level metric points; its buckets, per-epoch validation points and final values are kept (jobs.metric_retention). Null: every point is kept.", null=True),
        ),
    ]
