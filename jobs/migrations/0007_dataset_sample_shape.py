"""``Dataset.sample_shape``: the shape of one sample, read when the dataset is saved, so a model that
cannot take it is refused at launch. Rows saved before this migration stay null (not checked)
until they are saved again."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0006_joblist_key_index'),
    ]

    operations = [
        migrations.AddField(
            model_name='dataset',
            name='sample_shape',
            field=models.JSONField(blank=True, editable=False, help_text="Shape of one sample as the trainer reads it, e.g. [1, 8, 8] or [16] (ImageFolder: [3, null, null], the job's image size), read when the dataset was saved; null for a cloud URI, which is not read here.", null=True),
        ),
    ]
