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
    assert not Sweep.objects.exists()
