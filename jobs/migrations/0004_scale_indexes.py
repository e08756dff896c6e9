"""Indexes for the job list at 100,000 jobs (figures in bench/RESULTS.md, "Job list at 100,000 jobs").

- ``job_list_order`` (both databases): ``(created_at DESC, id DESC, owner_id, team_id, state, backend_id)``.
  The list is ordered by ``-created_at, -id`` and filtered by "own or shared with my team"
  (``owner_id = u OR team_id IN (...)``), an OR that no owner-first index serves. With every column the
  list filters on inside the index, a page's keys come from an index-only scan in list order that
  stops after offset + limit matches (jobs/pagination.py fetches the keys first).
  ``job_list_state`` and ``job_list_backend`` (both databases): the same with the state or the backend
  first, for the list's filters, so a filter that keeps few jobs reads only those to count them.
- ``job_name_trgm``, ``job_provider_name_trgm`` (PostgreSQL only, with the ``pg_trgm`` extension):
  trigram GIN indexes on ``UPPER(name)`` and ``UPPER(provider_job_name)``, the expressions Django's
  ``icontains`` compares, so a search for a job name reads the matching rows instead of all of them.
  Where the extension cannot be created (no CREATE privilege on the database), they are skipped with a
  warning: search still works, by a full scan.
- ``job_id_text`` (PostgreSQL only): ``UPPER(id::text)``, what the admin's ``=id`` search compares, so
  the admin search's OR can use an index in each arm.

Created with SQL and no model state on purpose: the index expressions (DESC keys, opclass on an
expression) are the same on SQLite and PostgreSQL here, and ``makemigrations`` does not try to drop
them. Reversible.
"""

from __future__ import annotations

import logging

from django.db import DatabaseError, migrations, transaction

log = logging.getLogger(__name__)

LIST_ORDER = [
    "CREATE INDEX IF NOT EXISTS job_list_order ON jobs_trainingjob "
    "(created_at DESC, id DESC, owner_id, team_id, state, backend_id)",
    # A filter that keeps few jobs (RUNNING: 3 %) would otherwise read the whole list-order index
    # to count them and to find its deep pages.
    "CREATE INDEX IF NOT EXISTS job_list_state ON jobs_trainingjob "
    "(state, created_at DESC, id DESC, owner_id, team_id, backend_id)",
    "CREATE INDEX IF NOT EXISTS job_list_backend ON jobs_trainingjob "
    "(backend_id, created_at DESC, id DESC, owner_id, team_id, state)",
]
TRIGRAM = [
    "CREATE INDEX IF NOT EXISTS job_name_trgm ON jobs_trainingjob USING gin (UPPER(name::text) gin_trgm_ops)",
    "CREATE INDEX IF NOT EXISTS job_provider_name_trgm ON jobs_trainingjob "
    "USING gin (UPPER(provider_job_name::text) gin_trgm_ops)",
]
# The admin's "=id" search compares UPPER(id::text) with the term (also for "sweep-7", which is no id).
ID_TEXT = "CREATE INDEX IF NOT EXISTS job_id_text ON jobs_trainingjob (UPPER(id::text))"
NAMES = ["job_list_order", "job_list_state", "job_list_backend", "job_name_trgm", "job_provider_name_trgm",
         "job_id_text"]


def create(apps, schema_editor) -> None:
    for sql in LIST_ORDER:
        schema_editor.execute(sql)
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(ID_TEXT)
    try:
        with transaction.atomic(using=schema_editor.connection.alias):
            schema_editor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    except DatabaseError as exc:
        log.warning("pg_trgm is not available (%s); job search by name will scan every job. "
                    "A superuser can run CREATE EXTENSION pg_trgm and migrate jobs 0003 then 0004 again.", exc)
        return
    for sql in TRIGRAM:
        schema_editor.execute(sql)


def drop(apps, schema_editor) -> None:
    for name in NAMES:
        schema_editor.execute(f"DROP INDEX IF EXISTS {name}")


class Migration(migrations.Migration):

    dependencies = [("jobs", "0003_issue6")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
