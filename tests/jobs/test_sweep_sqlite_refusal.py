"""A sweep is refused on the embedded SQLite database, with what to do, and nothing is stored."""

from __future__ import annotations

from unittest import mock

import pytest
from django.core.exceptions import ValidationError
from django.db import connections

from jobs import sweeps
from jobs.models import Sweep

pytestmark = pytest.mark.django_db


def test_a_sweep_on_sqlite_is_refused_with_the_reason_and_nothing_is_stored(user):
    with mock.patch.object(connections["default"], "vendor", "sqlite"):
        with pytest.raises(ValidationError) as exc:
            sweeps.sweep_create(owner=user, name="lr-search", base={}, search_space={})
    assert sweeps.SQLITE_REFUSAL in exc.value.message_dict["__all__"]
    assert "Set DATABASE_URL to a PostgreSQL database" in sweeps.SQLITE_REFUSAL
    # Both reasons: the file's lock, and no row locks to keep two workers from filling one sweep twice.
    assert '"database is locked"' in sweeps.SQLITE_REFUSAL and "SQLite has no row locks" in sweeps.SQLITE_REFUSAL


def test_sqlite_has_no_row_lock_for_a_sweeps_fill():
    """Why a sibling Optuna file would not make sweeps safe on SQLite: Django's SQLite backend has no
    SELECT … FOR UPDATE (the row lock every fill and tick takes), nor SKIP LOCKED."""
    from django.db.backends.sqlite3.base import DatabaseWrapper

    features = DatabaseWrapper.features_class
    assert features.has_select_for_update is False
    assert features.has_select_for_update_skip_locked is False
    assert not Sweep.objects.exists()
