"""jobs/states.py: legal and illegal moves, the conditional update, events, ended_at."""

import pytest

from jobs.models import JobEvent, JobStateChoices as S, TrainingJob
from jobs.states import ALLOWED, IllegalTransition, transition

pytestmark = pytest.mark.django_db


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    return TrainingJob.objects.create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                      backend=local_backend, config={}, state=S.QUEUED)


def test_allowed_table_matches_design():
    assert ALLOWED[S.QUEUED] == {S.SUBMITTING, S.CANCELLED, S.FAILED}
    # QUEUED: a lost run resubmitted (jobs.restarts)
    assert ALLOWED[S.SUBMITTING] == {S.PENDING, S.RUNNING, S.FAILED, S.STOPPING, S.QUEUED}
    assert ALLOWED[S.PENDING] == {S.RUNNING, S.STOPPING, S.FAILED, S.SUCCEEDED, S.CANCELLED, S.QUEUED}
    assert ALLOWED[S.RUNNING] == {S.PENDING, S.STOPPING, S.SUCCEEDED, S.FAILED, S.CANCELLED,  # PENDING: interrupted
                                  S.QUEUED}
    # QUEUED: a hung run stopped to be restarted (jobs.restarts.hung_run)
    assert ALLOWED[S.STOPPING] == {S.CANCELLED, S.FAILED, S.SUCCEEDED, S.QUEUED}
    for terminal in (S.SUCCEEDED, S.FAILED, S.CANCELLED):
        assert ALLOWED[terminal] == set()


def test_legal_path_writes_events_and_fields(job):
    assert transition(job, S.SUBMITTING, message="go", raw_state="x") is True
    assert job.state == S.SUBMITTING and job.raw_state == "x"
    assert transition(job, S.PENDING) is True
    assert transition(job, S.RUNNING) is True
    assert job.ended_at is None
    assert transition(job, S.SUCCEEDED, message="done") is True
    job.refresh_from_db()
    assert job.state == S.SUCCEEDED
    assert job.ended_at is not None
    events = list(JobEvent.objects.filter(job=job).values_list("from_state", "to_state", "message"))
    assert events == [
        ("QUEUED", "SUBMITTING", "go"), ("SUBMITTING", "PENDING", ""),
        ("PENDING", "RUNNING", ""), ("RUNNING", "SUCCEEDED", "done"),
    ]


@pytest.mark.parametrize("path,illegal", [
    ([], S.RUNNING),                       # QUEUED -> RUNNING skips submission
    ([], S.SUCCEEDED),
    ([S.SUBMITTING, S.PENDING, S.RUNNING], S.SUBMITTING),
    ([S.CANCELLED], S.RUNNING),            # terminal goes nowhere
    ([S.SUBMITTING, S.PENDING, S.RUNNING, S.STOPPING], S.RUNNING),
])
def test_illegal_moves_are_rejected_and_write_nothing(job, path, illegal):
    for state in path:
        assert transition(job, state)
    before_events = JobEvent.objects.filter(job=job).count()
    before_state = job.state
    with pytest.raises(IllegalTransition):
        transition(job, illegal)
    job.refresh_from_db()
    assert job.state == before_state
    assert JobEvent.objects.filter(job=job).count() == before_events


def test_an_interruption_goes_back_to_pending_and_is_marked(job):
    for state in (S.SUBMITTING, S.PENDING, S.RUNNING):
        assert transition(job, state)
    assert transition(job, S.PENDING, message="InProgress / Interrupted") is True
    assert transition(job, S.RUNNING, message="InProgress / Training") is True
    events = list(JobEvent.objects.filter(job=job).order_by("id"))
    assert [(e.from_state, e.to_state) for e in events if e.is_interruption] == [(S.RUNNING, S.PENDING)]
    assert job.state == S.RUNNING and job.ended_at is None


def test_stale_instance_gets_false_and_writes_nothing(job):
    stale = TrainingJob.objects.get(pk=job.pk)
    assert transition(job, S.SUBMITTING) is True
    # `stale` still believes QUEUED: its conditional update matches no row.
    assert transition(stale, S.CANCELLED, message="late") is False
    assert stale.state == S.SUBMITTING  # refreshed to the truth
    job.refresh_from_db()
    assert job.state == S.SUBMITTING and job.ended_at is None
    assert not JobEvent.objects.filter(job=job, to_state=S.CANCELLED).exists()


def test_terminal_keeps_given_ended_at(job):
    import datetime as dt

    when = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    transition(job, S.FAILED, ended_at=when, failure_reason="boom")
    job.refresh_from_db()
    assert job.ended_at == when and job.failure_reason == "boom"


def test_a_committed_move_is_announced_once_with_its_event(job, django_capture_on_commit_callbacks):
    from django.db import transaction

    from jobs.signals import job_state_changed

    heard = []

    def listener(sender, **kwargs):
        heard.append(kwargs)

    def broken(sender, **kwargs):
        raise RuntimeError("a listener's bug")

    job_state_changed.connect(listener)
    job_state_changed.connect(broken)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            assert transition(job, S.SUBMITTING, message="go") is True
        event = JobEvent.objects.get(job=job, to_state=S.SUBMITTING)
        assert heard == [{"signal": job_state_changed, "job_id": job.pk, "from_state": "QUEUED",
                          "to_state": "SUBMITTING", "message": "go", "event_id": event.pk}]
        # A move rolled back with its transaction is never announced.
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            with pytest.raises(RuntimeError):
                with transaction.atomic():
                    transition(job, S.PENDING)
                    raise RuntimeError("rolled back")
        assert callbacks == [] and len(heard) == 1
        # A refused move (someone moved the row first) announces nothing either.
        stale = TrainingJob.objects.get(pk=job.pk)
        TrainingJob.objects.filter(pk=job.pk).update(state=S.RUNNING)
        with django_capture_on_commit_callbacks(execute=True):
            assert transition(stale, S.PENDING) is False
        assert len(heard) == 1
    finally:
        job_state_changed.disconnect(listener)
        job_state_changed.disconnect(broken)
