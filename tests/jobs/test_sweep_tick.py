"""The beat's sweep pass (jobs.sweeps.sweep_tick) is idempotent: two ticks fill a sweep's free slots
once, and a tick that finds a fill in flight (the sweep's row held) skips the sweep instead of
waiting behind it and filling again. Real PostgreSQL row locks and Optuna's RDB storage; the fill in
flight runs in a thread of its own (its own database connection)."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from jobs import dispatch, sweeps
from jobs.models import Sweep, TrainingJob
from polling import wait_for
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db(transaction=True)


def _sweep(user, dataset, model, backend) -> Sweep:
    with sent_tasks(dispatch.SWEEP_FILL):  # the create's own fill is left out: the ticks fill
        return sweeps.sweep_create(
            owner=user, name="lr-search", base={"dataset": dataset.pk, "model_spec": model.pk,
                                                "backend": backend.pk, "epochs": 1},
            search_space={"train.lr": {"type": "float", "low": 0.001, "high": 0.1}}, sampler="random",
            max_trials=10, max_concurrent_trials=2)


def _trials(sweep: Sweep) -> tuple[list[int], int]:
    """(the trial numbers of the sweep's jobs, sorted; how many trials Optuna asked)."""
    numbers = sorted(TrainingJob.objects.filter(sweep=sweep).values_list("trial_number", flat=True))
    return numbers, len(sweeps.sweep_study(sweep).get_trials(deepcopy=False))


def test_two_ticks_fill_the_free_slots_once(user, digits_dataset, cnn_model, local_backend):
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend)
    with sent_tasks(dispatch.SUBMIT_JOB):
        first = sweeps.sweep_tick()
        second = sweeps.sweep_tick()
    assert (first["filled"], second["filled"]) == (2, 0)
    assert _trials(sweep) == ([0, 1], 2)  # one fill's worth (2 concurrent trials), no trial twice


def _blocked_on_a_lock() -> int:
    """Sessions of this test database waiting for a lock (another transaction's row lock)."""
    with connection.cursor() as cursor:
        # The poll runs inside the tick's transaction, where PostgreSQL keeps showing the first
        # read of pg_stat_activity (its snapshot lasts until the transaction ends): take a new one.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'")
        return cursor.fetchone()[0]


def test_a_fill_sent_while_a_tick_holds_the_sweep_finds_it_filled_and_the_tick_never_waits_for_it(
        user, digits_dataset, cnn_model, local_backend, monkeypatch):
    """A ``sweep_fill`` arrives while the tick holds the sweep's row (pruning): it waits for the
    tick, which fills the free slots in the same transaction, and then finds none free. The tick
    never lets go of the row between its pass and its fill, so it neither waits behind that fill
    (it would, holding a worker, for as long as the fill's trial jobs take to make) nor fills twice."""
    sweep = _sweep(user, digits_dataset, cnn_model, local_backend)
    release = threading.Event()
    create, prune = sweeps._create_trial_job, sweeps.prune_trials
    made: list[int] = []

    def slow_create(s, trial):  # the other fill makes its trial jobs slowly, holding the row meanwhile
        if threading.current_thread().name == "fill-in-flight":
            release.wait(20)
        return create(s, trial)

    def fill():
        try:
            made.extend(sweeps.sweep_fill(sweep_id=sweep.pk))
        finally:
            connection.close()

    thread = threading.Thread(target=fill, name="fill-in-flight")

    def prune_while_a_fill_arrives(s, study):
        thread.start()  # blocks on the row the tick holds
        wait_for(lambda: _blocked_on_a_lock() >= 1, timeout=30, interval=0.05,
                 what="the fill in flight to wait for the sweep's row lock")
        return prune(s, study)

    monkeypatch.setattr(sweeps, "_create_trial_job", slow_create)
    monkeypatch.setattr(sweeps, "prune_trials", prune_while_a_fill_arrives)
    with sent_tasks(dispatch.SUBMIT_JOB):
        started = time.monotonic()
        try:
            tick = sweeps.sweep_tick()
            waited = time.monotonic() - started
        finally:
            release.set()
            thread.join(60)
    assert waited < 10, f"the tick waited {waited:.1f} s behind the fill that arrived meanwhile"
    assert (tick["filled"], made) == (2, [])
    assert _trials(sweep) == ([0, 1], 2)  # one fill's worth, no trial asked twice
