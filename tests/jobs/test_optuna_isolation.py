"""tests/conftest.py's ``_no_optuna_study_left``: a study left by one test (Optuna writes through its own
connection, so neither the rollback nor the flush removes it) is gone when the next database test
starts. The two tests run in this order, on one pytest process (a file runs whole on one worker)."""

from __future__ import annotations

import optuna
import pytest

from jobs import sweeps

pytestmark = pytest.mark.django_db


def _studies() -> list[str]:
    return sorted(s.study_name for s in optuna.get_all_study_summaries(storage=sweeps.optuna_storage(),
                                                                      include_best_trial=False))


def test_a_study_written_in_a_rolled_back_test_outlives_its_transaction():
    optuna.create_study(storage=sweeps.optuna_storage(), study_name="trainboard-sweep-1")
    assert _studies() == ["trainboard-sweep-1"]


def test_the_next_database_test_starts_without_it():
    assert _studies() == []
