"""Recording the Celery messages the code under test sends, instead of publishing them.

The services and the recovery sweep send ``submit_job`` and ``cancel_job`` by name through
``current_app.send_task`` (:mod:`jobs.dispatch`). :func:`sent_tasks` records the messages of one task
name in a Mock called with what ``send_task`` got after the name, e.g.
``send.assert_called_once_with(args=[job.pk], queue="gpubox.local")``; messages of other names are
published as usual.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator
from unittest import mock

from celery import Celery


def _recording(task_name: str, recorder: mock.Mock) -> Callable[..., Any]:
    publish = Celery.send_task  # the real one, or an outer recording of another name

    def send_task(app: Celery, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == task_name:
            return recorder(*args, **kwargs)
        return publish(app, name, *args, **kwargs)

    return send_task


@contextlib.contextmanager
def sent_tasks(task_name: str) -> Iterator[mock.Mock]:
    """While the block runs, messages for ``task_name`` (e.g. ``jobs.dispatch.SUBMIT_JOB``) go to the
    yielded Mock instead of the broker."""
    recorder = mock.Mock(name=task_name)
    with mock.patch.object(Celery, "send_task", _recording(task_name, recorder)):
        yield recorder


def record_sent_tasks(monkeypatch: Any, task_name: str) -> mock.Mock:
    """:func:`sent_tasks` for the rest of a test, through pytest's ``monkeypatch``."""
    recorder = mock.Mock(name=task_name)
    monkeypatch.setattr(Celery, "send_task", _recording(task_name, recorder))
    return recorder
