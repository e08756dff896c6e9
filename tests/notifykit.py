"""Helpers of the notification tests (tests/notifications/, tests/e2e/test_webhooks_e2e.py)."""

from __future__ import annotations


def move(job, *states, **fields):
    """Walk ``job`` through ``states`` with the state machine (each move's signal fires on commit
    when the test captures and runs on-commit callbacks)."""
    from jobs.states import transition

    for state in states:
        assert transition(job, state, message=f"to {state}", **(fields if state == states[-1] else {}))
    return job
