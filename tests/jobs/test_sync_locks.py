"""A sync pass holds no row lock while it waits for a provider: the status, log and cancel calls run
outside any transaction, rows are locked only to write what they returned, and what changed
meanwhile (a user's cancel, another pass's end) is re-read under the lock and kept.

A stand-in provider blocks inside one call until the test releases it; meanwhile another writer, on
its own connection, locks the job's row with ``NOWAIT`` (it fails at once if the pass holds it). At
scale, every provider call of a pass over 10,000 active jobs checks from a third connection that
the pass's session is not inside a transaction and that all 10,000 rows can be locked. PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import threading
from decimal import Decimal
from unittest import mock

import psycopg
import pytest
from django.db import connection, transaction

from cloud_adapters import registry
from cloud_adapters.base import Backend, Capabilities, JobHandle, JobSpec, JobState, JobStatus
from jobs import dispatch, services, sync, tasks
from jobs.models import JobEvent, JobLogLine, JobStateChoices as S, MetricPoint, TrainingJob
from jobs.states import transition
from taskkit import sent_tasks
from trainer_pkg.metrics import format_metric_line

pytestmark = pytest.mark.django_db(transaction=True)

WAIT_S = 30.0


@pytest.fixture(autouse=True)
def _on_postgresql():
    assert connection.vendor == "postgresql", "tests/jobs/test_sync_locks.py needs DATABASE_URL=postgres://..."


class BlockingBackend(Backend):
    """Answers from ``statuses`` (only the jobs named there "changed") and ``log_lines`` (one chunk
    at cursor "", then nothing); records every call. The first call of operation ``block``
    ("describe_many", "logs" or "cancel") sets ``entered`` and waits for ``release``.
    ``on_call(op, job_name)`` runs at every call, inside it (the scale test's probe)."""

    kind = "blocking"
    statuses: dict[str, JobStatus] = {}
    log_lines: dict[str, list[str]] = {}
    calls: list[tuple[str, str]] = []
    block = ""
    entered = threading.Event()
    release = threading.Event()
    on_call = None

    @property
    def capabilities(self):
        return Capabilities(max_nodes=8, max_procs_per_node=8)

    def _call(self, op: str, job_name: str = "") -> None:
        cls = type(self)
        cls.calls.append((op, job_name))
        if cls.on_call is not None:
            cls.on_call(op, job_name)
        if op == cls.block:
            cls.block = ""
            cls.entered.set()
            if not cls.release.wait(WAIT_S):
                raise AssertionError(f"{op} was never released")

    def submit(self, spec: JobSpec) -> JobHandle:
        return JobHandle(provider="blocking", job_name=spec.job_name)

    def describe(self, handle):  # pragma: no cover - describe_many is overridden
        raise AssertionError("describe_many must be used")

    def describe_many(self, handles, changed_since=None):
        self._call("describe_many")
        return {h.job_name: self.statuses[h.job_name] for h in handles if h.job_name in self.statuses}

    def logs(self, handle, cursor=""):
        self._call("logs", handle.job_name)
        lines = self.log_lines.get(handle.job_name, [])
        return (list(lines), "end") if lines and not cursor else ([], cursor)

    def cancel(self, handle):
        self._call("cancel", handle.job_name)

    def price(self, instance_type="", spot=False):
        return 7.2


@pytest.fixture
def blocking(user, monkeypatch, settings):
    monkeypatch.setitem(registry.KINDS, "blocking", registry.KindInfo(__name__, "BlockingBackend", "Blocking"))
    cls = BlockingBackend
    cls.statuses, cls.log_lines, cls.calls, cls.block, cls.on_call = {}, {}, [], "", None
    cls.entered, cls.release = threading.Event(), threading.Event()
    settings.TRAINBOARD_LOG_READS_PER_SYNC = 1
    return services.backend_create(owner=user, name="blocking", kind="blocking")


@pytest.fixture
def job(user, digits_dataset, cnn_model, blocking) -> TrainingJob:
    """A RUNNING job (2 instances at $7.20/h, started 30 min ago) whose status changed."""
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=blocking, nodes=2, procs_per_node=1, name="blocked")
    tasks.submit_job(job.pk)
    job.refresh_from_db()
    assert job.state == S.PENDING
    started = job.created_at - dt.timedelta(minutes=30)
    transition(job, S.RUNNING, message="InProgress / Training", started_at=started, instance_count=2)
    BlockingBackend.statuses = {job.provider_job_name: JobStatus(
        JobState.RUNNING, raw_state="InProgress", secondary_state="Training", started_at=started,
        instance_count=2, billable_seconds=1800.0)}
    BlockingBackend.log_lines = {job.provider_job_name: [
        "epoch 0", format_metric_line({"event": "step", "step": 5, "epoch": 0, "train_loss": 0.5,
                                       "time": started.timestamp() + 60})]}
    return job


class Pass:
    """``backend_sync`` in a thread of its own (its own connection), blocked in ``op`` until
    :meth:`finish`."""

    def __init__(self, backend, op: str) -> None:
        BlockingBackend.block = op
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(backend.pk,))
        self.thread.start()
        if not BlockingBackend.entered.wait(WAIT_S):
            BlockingBackend.release.set()
            self.thread.join(WAIT_S)
            raise AssertionError(f"the pass never called {op}: {self.error!r}; calls {BlockingBackend.calls}")

    def _run(self, backend_id: int) -> None:
        try:
            sync.backend_sync(backend_id=backend_id)
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
            self.error = exc
        finally:
            connection.close()

    def finish(self) -> None:
        BlockingBackend.release.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the pass did not end"
        if self.error is not None:
            raise self.error


def lock_now(job_id: int) -> TrainingJob:
    """This thread's own write lock on the job's row, at once or ``OperationalError`` (NOWAIT);
    the caller is inside ``transaction.atomic()``."""
    return TrainingJob.objects.select_for_update(nowait=True).get(pk=job_id)


def reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


@pytest.mark.parametrize("op", ["describe_many", "logs", "cancel"])
def test_another_writer_is_not_kept_waiting_while_a_pass_is_inside_a_provider_call(blocking, job, op):
    """``cancel``: the budget stop, sent once the stop is committed (so the writer already sees it)."""
    if op == "cancel":
        TrainingJob.objects.filter(pk=job.pk).update(budget_usd=Decimal("1.00"))  # 1800 s × 2 × $7.20/h = $7.20
    blocked = Pass(blocking, op)
    try:
        with transaction.atomic():
            row = lock_now(job.pk)
            TrainingJob.objects.filter(pk=job.pk).update(name="renamed while the pass waited")
    finally:
        blocked.finish()
    if op == "cancel":
        assert (row.state, row.failure_reason) == (S.STOPPING, "Stopped: budget of $1.00 reached at $7.20")
        assert row.budget_exceeded_at is not None
        assert BlockingBackend.calls[-1] == ("cancel", job.provider_job_name)
    else:
        assert row.state == S.RUNNING
    job = reload(job)
    assert job.cost_usd == Decimal("7.2000") and job.name == "renamed while the pass waited"
    assert list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("text", flat=True))[:1] == ["epoch 0"]


def test_a_stopping_jobs_cancel_is_resent_with_no_row_locked(blocking, job):
    transition(job, S.STOPPING, message="enough", failure_reason="enough")
    blocked = Pass(blocking, "cancel")
    try:
        with transaction.atomic():
            assert lock_now(job.pk).state == S.STOPPING
    finally:
        blocked.finish()
    assert reload(job).state == S.STOPPING


def test_a_cancel_made_while_the_pass_reads_the_log_is_kept(blocking, job):
    """The user stops the job while the pass waits for its log: the pass stores the lines and the
    numbers, and the provider's RUNNING does not undo STOPPING (the state machine refuses it)."""
    blocked = Pass(blocking, "logs")
    try:
        with transaction.atomic():
            lock_now(job.pk)
            assert transition(reload(job), S.STOPPING, message="enough", failure_reason="enough")
    finally:
        blocked.finish()
    job = reload(job)
    assert (job.state, job.failure_reason, job.cost_usd) == (S.STOPPING, "enough", Decimal("7.2000"))
    assert list(job.events.values_list("to_state", flat=True))[-2:] == [S.RUNNING, S.STOPPING]
    assert JobLogLine.objects.filter(job=job).count() == 1  # its record is stored once, as points
    assert MetricPoint.objects.filter(job=job, name="train_loss").count() == 1
    assert job.log_cursor == "end"


def test_a_job_that_ended_while_the_pass_read_its_log_is_left_as_it_ended(blocking, job):
    """Another pass stored the log and ended the job while this one waited for the same log: the
    lines it got are not stored twice and the ended job is not written again."""
    blocked = Pass(blocking, "logs")
    try:
        with transaction.atomic():
            row = lock_now(job.pk)
            for seq, text in enumerate(BlockingBackend.log_lines[job.provider_job_name]):
                JobLogLine.objects.create(job=row, seq=seq, text=text)
            TrainingJob.objects.filter(pk=job.pk).update(log_cursor="end", cost_usd=Decimal("7.0000"))
            assert transition(reload(job), S.SUCCEEDED, message="Completed", billable_seconds=1750.0)
    finally:
        blocked.finish()
    job = reload(job)
    assert (job.state, job.cost_usd, job.billable_seconds) == (S.SUCCEEDED, Decimal("7.0000"), 1750.0)
    assert list(JobLogLine.objects.filter(job=job).values_list("seq", flat=True)) == [0, 1]
    assert not MetricPoint.objects.filter(job=job).exists()
    assert list(job.events.values_list("to_state", flat=True))[-2:] == [S.RUNNING, S.SUCCEEDED]


def _dsn() -> str:
    s = connection.settings_dict
    dsn = f"host={s['HOST'] or '127.0.0.1'} port={s['PORT'] or 5432} dbname={s['NAME']} user={s['USER']}"
    return dsn + (f" password={s['PASSWORD']}" if s.get("PASSWORD") else "")


@pytest.mark.slow
def test_a_pass_over_10000_active_jobs_holds_no_row_lock_across_a_provider_call(blocking, job, settings):
    """10,000 active jobs on one backend: 100 changed (their logs have lines), 100 more logs read,
    20 STOPPING (cancel re-sent), 10 over budget among the unchanged ones (stopped: a cancel each).
    At every provider call, a third connection sees the pass's session idle (no transaction open,
    so no row lock held) and locks all 10,000 rows with NOWAIT."""
    settings.TRAINBOARD_LOG_READS_PER_SYNC = 100
    template = reload(job)
    now = template.created_at
    columns = {f.attname: getattr(template, f.attname) for f in TrainingJob._meta.concrete_fields if not f.primary_key}
    rows, changed = [], {}
    for i in range(10_000):
        name = f"tb-scale-{i}"
        state = S.STOPPING if i % 500 == 7 else S.PENDING if i % 10 == 9 else S.RUNNING
        rows.append(TrainingJob(**{
            **columns, "name": name, "provider_job_name": name, "state": state,
            "provider_handle": {"provider": "blocking", "job_name": name},
            "started_at": None if state == S.PENDING else now - dt.timedelta(minutes=30),
            "budget_usd": Decimal("1.00") if i % 1000 == 3 else None,
            "last_synced_at": now - dt.timedelta(seconds=30), "logs_read_at": now - dt.timedelta(seconds=i % 997),
            "log_cursor": ""}))
        if i % 100 == 0:
            changed[name] = JobStatus(JobState.RUNNING, raw_state="InProgress", secondary_state="Training",
                                      started_at=now - dt.timedelta(minutes=30), instance_count=2,
                                      billable_seconds=1800.0)
    TrainingJob.objects.filter(pk=template.pk).update(state=S.SUCCEEDED)  # out of the pass
    TrainingJob.objects.bulk_create(rows, batch_size=2_000)
    BlockingBackend.statuses = changed
    BlockingBackend.log_lines = {name: ["a line", format_metric_line({"event": "step", "step": 1, "train_loss": 1.0})]
                                 for name in changed}

    problems, probes = [], [0]
    with psycopg.connect(_dsn()) as observer:
        observer.execute("SET lock_timeout = '100ms'")

        def probe(op: str, job_name: str) -> None:
            probes[0] += 1
            pid = connection.connection.info.backend_pid  # the pass's session (this is its thread)
            state = observer.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()[0]
            try:
                locked = observer.execute(
                    "SELECT count(*) FROM (SELECT id FROM jobs_trainingjob WHERE backend_id = %s "
                    "FOR UPDATE NOWAIT) AS t", [blocking.pk]).fetchone()[0]
            except psycopg.errors.LockNotAvailable:
                locked = None
            observer.rollback()
            if state != "idle" or locked != 10_001:
                problems.append((op, job_name, state, locked))

        BlockingBackend.on_call = probe
        with mock.patch("jobs.sync.timezone.now", return_value=now):
            assert sync.backend_sync(backend_id=blocking.pk) == 10_000
        BlockingBackend.on_call = None

    ops = [op for op, _ in BlockingBackend.calls]
    # logs: two calls per changed job (its lines, then the end) and one per other job read
    assert (ops.count("describe_many"), ops.count("logs"), ops.count("cancel")) == (1, 300, 30)
    assert problems == [] and probes[0] == len(ops)
    jobs = TrainingJob.objects.filter(backend=blocking).exclude(pk=template.pk)
    assert jobs.filter(state=S.STOPPING).count() == 30
    assert jobs.filter(state=S.STOPPING, budget_exceeded_at__isnull=False).count() == 10
    # 8,980 RUNNING less the 10 stopped, each 1800 s × 2 × $7.20/h
    assert jobs.filter(state=S.RUNNING, cost_usd=Decimal("7.2000")).count() == 8_970
    assert JobLogLine.objects.filter(job__in=jobs).count() == 100  # "a line" each; the records are points
    assert jobs.filter(last_synced_at=now).count() == 10_000
