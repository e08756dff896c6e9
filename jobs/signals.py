"""Signals other parts of Trainboard listen to (notifications, sweeps, metrics): sent after the change
they announce has committed, so a listener that reads the job sees it, and a rolled-back change
announces nothing.

``job_state_changed`` is sent by :func:`jobs.states.transition` (every state change goes through it)
with ``sender=TrainingJob`` and::

    job_id: int          the job that moved
    from_state: str      the state it left (a JobStateChoices value)
    to_state: str        the state it entered
    message: str         the event's message (the reason shown on the timeline)
    event_id: int        the JobEvent row recorded with the move

A listener must be quick and must not raise: it runs inside the request or the sync that made the
change (after its commit). Slow work (an HTTP call, an Optuna ask) is sent to a Celery task.
"""

from __future__ import annotations

import django.dispatch

job_state_changed = django.dispatch.Signal()
