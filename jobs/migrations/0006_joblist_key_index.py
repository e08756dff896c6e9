"""The job list's order index, half the size (figures in bench/RESULTS.md, "Job list at 100,000 jobs").

``job_list_order`` (0004) is ``(created_at DESC, id DESC, owner_id, team_id, state, backend_id)``. It
reads twice the pages it needs to:

- New jobs carry the newest ``created_at``, which in a DESC index lands on the *first* leaf page. B-tree
  leaf pages split half and half there; only appends to the *last* page are packed (fill factor 90).
  Grown oldest first, as a real list grows, the index is therefore mostly half-empty pages, where the
  same columns ascending are packed.
- ``state`` and ``backend_id`` are not needed: a filter on either is served by ``job_list_state`` /
  ``job_list_backend``, each of which holds the other column too.

``job_list_key (created_at, id, owner_id, team_id)``, ascending, replaces it at under half its size.
PostgreSQL reads it backwards for ``ORDER BY created_at DESC, id DESC`` (index-only, the same order),
forwards for the "Newer" link's ascending seek. What reads it: every unfiltered page's capped count
(10,001 entries), its keys-first page, and a deep page's position (jobs.pagination.position_at, which
reads all the entries before it). Same SQL on SQLite. Reversible.
"""

from __future__ import annotations

from django.db import migrations

OLD = ("CREATE INDEX IF NOT EXISTS job_list_order ON jobs_trainingjob "
       "(created_at DESC, id DESC, owner_id, team_id, state, backend_id)")
NEW = "CREATE INDEX IF NOT EXISTS job_list_key ON jobs_trainingjob (created_at, id, owner_id, team_id)"


def forwards(apps, schema_editor) -> None:
    schema_editor.execute(NEW)
    schema_editor.execute("DROP INDEX IF EXISTS job_list_order")


def backwards(apps, schema_editor) -> None:
    schema_editor.execute(OLD)
    schema_editor.execute("DROP INDEX IF EXISTS job_list_key")


class Migration(migrations.Migration):

    dependencies = [("jobs", "0005_job_logs_read_at")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
