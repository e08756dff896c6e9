"""Old same-state events become notes.

Before notes existed (jobs.states.note), a wait reason or a stall was written as an event from a state to
the same state (``QUEUED → QUEUED``). Such a row records no move: its ``to_state`` is blanked, as a note's
is, so the API and the timeline read them alike."""

from django.db import migrations
from django.db.models import F


def same_state_rows_to_notes(apps, schema_editor):
    JobEvent = apps.get_model("jobs", "JobEvent")
    JobEvent.objects.exclude(to_state="").filter(from_state=F("to_state")).update(to_state="")


class Migration(migrations.Migration):
    dependencies = [("jobs", "0025_notifications_webhooks")]

    operations = [migrations.RunPython(same_state_rows_to_notes, migrations.RunPython.noop)]
