"""A sync pass writes the jobs that did not change and whose logs it does not read in one statement
(``jobs.sync._sync_unchanged``): the same values as the per-job path, a number of queries that
does not grow with them, and a job that crosses its budget among them is still stopped in that pass."""

from __future__ import annotations

import datetime as dt
import random
from decimal import Decimal
from unittest import mock

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from cloud_adapters import registry
from cloud_adapters.base import Backend, Capabilities, JobHandle, JobSpec, JobState, JobStatus
from jobs import cost as costs, dispatch, services, sync, tasks
from jobs.models import JobEvent, JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.timezone.utc)

@pytest.fixture(autouse=True)
def _on_postgresql():
    # The one-statement write is PostgreSQL's (elsewhere every job takes the per-job path, which the
    # other sync tests cover); the suite runs on PostgreSQL (make test), so this is never a skip.
    assert connection.vendor == "postgresql", "tests/jobs/test_sync_bulk.py needs DATABASE_URL=postgres://..."


class QuietBackend(Backend):
    """describe_many answers only for the jobs in ``changed``; logs are always empty; cancels and
    log reads are recorded. ``during_describe`` runs inside describe_many (another worker's write)."""

    kind = "quiet"
    changed: dict[str, JobStatus] = {}
    cancels: list[str] = []
    log_calls: list[str] = []
    during_describe = None

    @property
    def capabilities(self):
        return Capabilities(spot=True, max_nodes=8, max_procs_per_node=8)

    def submit(self, spec: JobSpec) -> JobHandle:
        return JobHandle(provider="quiet", job_name=spec.job_name)

    def describe(self, handle):  # pragma: no cover - describe_many is overridden
        raise AssertionError("describe_many must be used")

    def describe_many(self, handles, changed_since=None):
        if type(self).during_describe:
            type(self).during_describe()
        return {h.job_name: self.changed[h.job_name] for h in handles if h.job_name in self.changed}

    def cancel(self, handle):
        type(self).cancels.append(handle.job_name)

    def logs(self, handle, cursor=""):
        type(self).log_calls.append(handle.job_name)
        return [], cursor

    def price(self, instance_type="", spot=False):
        return 7.2


@pytest.fixture
def quiet(user, monkeypatch, settings):
    monkeypatch.setitem(registry.KINDS, "quiet", registry.KindInfo(__name__, "QuietBackend", "Quiet"))
    QuietBackend.changed, QuietBackend.cancels, QuietBackend.log_calls = {}, [], []
    QuietBackend.during_describe = None
    settings.TRAINBOARD_LOG_READS_PER_SYNC = 1
    return services.backend_create(owner=user, name="quiet", kind="quiet")


@pytest.fixture
def template_job(user, digits_dataset, cnn_model, quiet):
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=quiet, nodes=2, procs_per_node=1, name="template")
    tasks.submit_job(job.pk)
    job.refresh_from_db()
    assert job.state == S.PENDING
    return job


_serial = iter(range(1, 10**6))


def clone(template: TrainingJob, *, backend=None, **fields) -> TrainingJob:
    """A copy of ``template`` (its own provider job name), with ``fields`` set; logs read at T0 so
    that the read rotation picks jobs by id, never by "never read"."""
    job = TrainingJob.objects.get(pk=template.pk)
    name = f"tb-bulk-{next(_serial)}"
    job.pk = None
    job.name, job.provider_job_name = name, name
    job.provider_handle = {"provider": "quiet", "job_name": name}
    job.backend = backend or template.backend
    job.logs_read_at = T0
    job.last_synced_at = T0 - dt.timedelta(seconds=30)
    for key, value in fields.items():
        setattr(job, key, value)
    job.save()
    return job


def running(template, *, started_ago_s: float = 1800.0, **fields) -> TrainingJob:
    fields.setdefault("instance_count", 2)
    return clone(template, state=S.RUNNING, started_at=T0 - dt.timedelta(seconds=started_ago_s), **fields)


def sync_at(backend, when: dt.datetime, *, bulk: bool = True) -> int:
    with mock.patch("jobs.sync.timezone.now", return_value=when):
        return sync.backend_sync(backend_id=backend.pk, bulk=bulk)


def reload(job: TrainingJob) -> TrainingJob:
    job.refresh_from_db()
    return job


def test_unchanged_running_jobs_get_their_cost_from_the_run_interval_in_one_statement(quiet, template_job):
    jobs = [running(template_job, started_ago_s=1800), running(template_job, started_ago_s=3600.5, instance_count=3),
            running(template_job, started_ago_s=60, hourly_price_usd=Decimal("0.123457"), instance_count=1)]
    template_job.delete()
    at = T0 + dt.timedelta(seconds=300)
    assert sync_at(quiet, at) == 3
    got = [reload(j) for j in jobs]
    # 2100 s × 2 × $7.20/h; 3900.5 s × 3 × $7.20/h; 360 s × 1 × $0.123457/h
    assert [(j.billable_seconds, j.cost_usd) for j in got] == [
        (2100.0, Decimal("8.4000")), (3900.5, Decimal("23.4030")), (360.0, Decimal("0.0123"))]
    assert all(j.last_synced_at == at and j.state == S.RUNNING for j in got)
    assert QuietBackend.log_calls == [jobs[0].provider_job_name]  # TRAINBOARD_LOG_READS_PER_SYNC = 1

    # Recomputed, never added to: the same moment again gives the same numbers.
    sync_at(quiet, at)
    assert [(reload(j).billable_seconds, j.cost_usd) for j in jobs] == [
        (j.billable_seconds, j.cost_usd) for j in got]


def test_unchanged_jobs_that_are_not_running_keep_their_numbers(quiet, template_job):
    pending = clone(template_job, state=S.PENDING, cost_usd=Decimal("0.5000"), billable_seconds=250.0)
    no_start = clone(template_job, state=S.RUNNING, started_at=None, cost_usd=Decimal("1.2500"))
    stopping = clone(template_job, state=S.STOPPING, started_at=T0 - dt.timedelta(seconds=900),
                     cost_usd=Decimal("2.0000"), billable_seconds=500.0)
    reader = clone(template_job, state=S.PENDING, logs_read_at=None)  # read first: never read
    template_job.delete()
    at = T0 + dt.timedelta(seconds=60)
    sync_at(quiet, at)
    assert QuietBackend.log_calls == [reader.provider_job_name]
    assert (reload(pending).billable_seconds, pending.cost_usd, pending.state) == (250.0, Decimal("0.5"), S.PENDING)
    assert (reload(no_start).cost_usd, no_start.state) == (Decimal("1.25"), S.RUNNING)
    assert (reload(stopping).billable_seconds, stopping.cost_usd, stopping.state) == (
        500.0, Decimal("2.0"), S.STOPPING)
    assert QuietBackend.cancels == [stopping.provider_job_name]  # re-sent every pass while STOPPING
    assert all(reload(j).last_synced_at == at for j in (pending, no_start, stopping, reader))
    assert not JobEvent.objects.filter(job__in=[pending, no_start, stopping]).exists()


def test_bulk_and_per_job_paths_write_the_same_values(user, quiet, template_job):
    """Two backends with the same 60 jobs (random start times to the microsecond, prices, instance
    counts, states), one synced by the per-job path and one by the bulk path at the same moment."""
    other = services.backend_create(owner=user, name="quiet-2", kind="quiet")
    rng = random.Random(6)
    prices = [Decimal("7.2"), Decimal("0.123457"), Decimal("98.765432"), Decimal("3.333333"), Decimal("0.000001"),
              Decimal("12.5"), Decimal("1.000005")]
    at = T0 + dt.timedelta(microseconds=rng.randrange(10**6))
    # Half a hundredth of a cent rounds up: 1 s × 1 × $0.18/h = $0.00005, × $0.54/h = $0.00015.
    ties = [dict(state=S.RUNNING, started_at=at - dt.timedelta(seconds=1), instance_count=1,
                 hourly_price_usd=Decimal(price)) for price in ("0.18", "0.54")]
    pairs = []
    for i in range(60):
        fields = ties[i] if i < len(ties) else dict(
            state=rng.choice([S.RUNNING, S.RUNNING, S.RUNNING, S.PENDING, S.STOPPING]),
            started_at=T0 - dt.timedelta(microseconds=rng.randrange(0, 5 * 86400 * 10**6)),
            instance_count=rng.randrange(0, 9), hourly_price_usd=rng.choice(prices))
        # The last pair's logs are read (the per-job path in both); the ties take the bulk one.
        fields.update(billable_seconds=1.0, cost_usd=Decimal("0.0001"),
                      logs_read_at=T0 + dt.timedelta(seconds=60 - i))
        pairs.append((clone(template_job, **fields), clone(template_job, backend=other, **fields)))
    template_job.delete()
    QuietBackend.log_calls = []
    sync_at(quiet, at, bulk=False)
    sync_at(other, at, bulk=True)
    assert len(QuietBackend.log_calls) == 2  # one read each: 59 of the 60 written in one statement
    columns = ("state", "billable_seconds", "cost_usd", "last_synced_at", "logs_read_at")
    for per_job, bulk in pairs:
        a = TrainingJob.objects.values(*columns).get(pk=per_job.pk)
        b = TrainingJob.objects.values(*columns).get(pk=bulk.pk)
        assert a == b, (per_job.pk, bulk.pk)
        if a["state"] == S.RUNNING:  # and both are what jobs.cost computes
            seconds = costs.run_seconds(per_job.started_at, None, at)
            assert (a["billable_seconds"], a["cost_usd"]) == (seconds, costs.job_cost_usd(
                billable_seconds=seconds, instances=per_job.instance_count,
                hourly_price_usd=per_job.hourly_price_usd))
    assert [reload(b).cost_usd for _, b in pairs[:2]] == [Decimal("0.0001"), Decimal("0.0002")]


def test_a_job_crossing_its_budget_among_unchanged_ones_is_stopped_in_the_same_pass(quiet, template_job):
    jobs = [running(template_job) for _ in range(10)]
    over = running(template_job, budget_usd=Decimal("8.00"))
    under = running(template_job, budget_usd=Decimal("9.00"))
    template_job.delete()
    sync_at(quiet, T0)
    assert reload(over).state == S.RUNNING and over.cost_usd == Decimal("7.2000")  # 1800 s: $7.20 < $8.00
    QuietBackend.cancels = []
    sync_at(quiet, T0 + dt.timedelta(seconds=300))  # 2100 s: $8.40
    over = reload(over)
    assert over.state == S.STOPPING and over.failure_reason == "Stopped: budget of $8.00 reached at $8.40"
    assert over.budget_exceeded_at is not None and over.cost_usd == Decimal("8.4000")
    assert QuietBackend.cancels == [over.provider_job_name]
    assert JobEvent.objects.filter(job=over, to_state=S.STOPPING).count() == 1
    assert (reload(under).state, under.cost_usd) == (S.RUNNING, Decimal("8.4000"))
    assert all((reload(j).state, j.cost_usd) == (S.RUNNING, Decimal("8.4000")) for j in jobs)


def count_queries(backend, when, *, bulk=True) -> int:
    with CaptureQueriesContext(connection) as ctx:
        sync_at(backend, when, bulk=bulk)
    return len(ctx.captured_queries)


def test_the_query_count_does_not_grow_with_unchanged_jobs(quiet, template_job):
    jobs = [running(template_job) for _ in range(5)]
    changed = running(template_job)
    QuietBackend.changed = {changed.provider_job_name: JobStatus(
        JobState.RUNNING, raw_state="InProgress", started_at=T0 - dt.timedelta(seconds=1800), instance_count=2)}
    template_job.delete()
    small = count_queries(quiet, T0)
    per_job_small = count_queries(quiet, T0 + dt.timedelta(seconds=1), bulk=False)

    jobs += [running(TrainingJob.objects.get(pk=jobs[0].pk)) for _ in range(45)]
    TrainingJob.objects.filter(pk__in=[j.pk for j in jobs]).update(logs_read_at=T0 + dt.timedelta(seconds=1))
    big = count_queries(quiet, T0 + dt.timedelta(seconds=2))
    per_job_big = count_queries(quiet, T0 + dt.timedelta(seconds=3), bulk=False)

    # 6 → 51 active jobs: the same queries (list, one UPDATE for the unchanged, the changed job's
    # and the one log reader's per-job work); the per-job path grows by ~5 queries per job.
    assert big == small
    assert small <= 30
    assert per_job_big - per_job_small >= 45 * 4
    assert all(reload(j).last_synced_at == T0 + dt.timedelta(seconds=3) for j in jobs)


def test_a_job_that_moved_since_the_list_was_read_is_written_by_its_new_state(quiet, template_job):
    """Another worker cancels one job and stops another while describe_many runs: the statement
    reads the row as it is then (a terminal job is left alone, a STOPPING one gets no cost)."""
    ended = running(template_job)
    stopping = running(template_job)
    job = running(template_job)
    template_job.delete()

    def meanwhile():
        TrainingJob.objects.filter(pk=ended.pk).update(state=S.CANCELLED, cost_usd=Decimal("1.0000"))
        TrainingJob.objects.filter(pk=stopping.pk).update(state=S.STOPPING, cost_usd=Decimal("2.0000"))
    QuietBackend.during_describe = meanwhile
    at = T0 + dt.timedelta(seconds=300)
    sync_at(quiet, at)
    assert (reload(ended).last_synced_at, ended.cost_usd) == (T0 - dt.timedelta(seconds=30), Decimal("1.0000"))
    assert (reload(stopping).last_synced_at, stopping.cost_usd) == (at, Decimal("2.0000"))
    assert (reload(job).last_synced_at, job.cost_usd) == (at, Decimal("8.4000"))


@pytest.mark.django_db(transaction=True)
def test_a_row_another_transaction_holds_is_skipped_not_waited_for(quiet, template_job):
    """As the per-job path's ``SKIP LOCKED``: a pass never waits behind another sync's lock."""
    import psycopg

    held = running(template_job)
    free = running(template_job)
    reader = running(template_job, logs_read_at=None)
    template_job.delete()
    s = connection.settings_dict
    dsn = f"host={s['HOST'] or '127.0.0.1'} port={s['PORT'] or 5432} dbname={s['NAME']} user={s['USER']}"
    if s.get("PASSWORD"):
        dsn += f" password={s['PASSWORD']}"
    with psycopg.connect(dsn) as other:
        other.execute("SET lock_timeout = '10s'")
        other.execute("SELECT id FROM jobs_trainingjob WHERE id = %s FOR UPDATE", [held.pk])
        at = T0 + dt.timedelta(seconds=300)
        sync_at(quiet, at)
        other.rollback()
    assert QuietBackend.log_calls == [reader.provider_job_name]
    assert (reload(held).last_synced_at, held.cost_usd) == (T0 - dt.timedelta(seconds=30), Decimal("0"))
    assert (reload(free).last_synced_at, free.cost_usd) == (at, Decimal("8.4000"))


def test_the_bulk_statement_costs_varied_jobs_as_jobs_cost_does(quiet, template_job):
    """Spot and on-demand jobs, prices of 6 decimals, instance counts from 0, start times to the
    microsecond (one after the clock: skew), ties at the fourth decimal: every unchanged RUNNING job
    written by the one statement gets :func:`jobs.cost.job_cost_usd` of its run interval; PENDING and
    STOPPING jobs keep their numbers, ended jobs are not touched."""
    rng = random.Random(12)
    at = T0 + dt.timedelta(seconds=3600, microseconds=250_001)
    reader = clone(template_job, state=S.PENDING, logs_read_at=None)  # the one job read: the per-job path

    def started(before_s: float, **fields) -> TrainingJob:
        return clone(template_job, state=S.RUNNING, started_at=at - dt.timedelta(seconds=before_s), **fields)

    running_jobs = [
        started(1, instance_count=1, hourly_price_usd=Decimal(price))
        for price in ("0.18", "0.54", "0.90")  # $0.00005, $0.00015, $0.00025: half-up
    ] + [
        started(-5, instance_count=2),  # started "after" now (clock skew): 0 s
        started(28 * 86400, instance_count=8, hourly_price_usd=Decimal("98.765432")),
    ] + [
        running(template_job, started_ago_s=rng.randrange(0, 3 * 86400 * 10**6) / 10**6,
                instance_count=rng.randrange(0, 9), spot=spot,
                hourly_price_usd=rng.choice([Decimal("2.16"), Decimal("0.037037"), Decimal("1.000001")] if spot else
                                            [Decimal("7.2"), Decimal("0.123457"), Decimal("3.333333")]),
                on_demand_price_usd=Decimal("7.2") if spot else None)
        for spot in [True, False] * 20
    ]
    kept = {clone(template_job, state=state, started_at=T0 - dt.timedelta(seconds=900), billable_seconds=12.5,
                  cost_usd=Decimal("0.0250")).pk: state
            for state in (S.PENDING, S.STOPPING, S.SUCCEEDED, S.FAILED, S.CANCELLED)}
    template_job.delete()
    assert sync_at(quiet, at) == len(running_jobs) + 3  # the ended ones are not in the pass
    assert QuietBackend.log_calls == [reader.provider_job_name]
    for job in running_jobs:
        job = reload(job)
        seconds = costs.run_seconds(job.started_at, None, at)
        expected = costs.job_cost_usd(billable_seconds=seconds, instances=job.instance_count,
                                      hourly_price_usd=job.hourly_price_usd)
        assert (job.billable_seconds, job.cost_usd, job.last_synced_at) == (seconds, expected, at), job.pk
    assert [reload(j).cost_usd for j in running_jobs[:5]] == [
        Decimal("0.0001"), Decimal("0.0002"), Decimal("0.0003"), Decimal("0.0000"), Decimal("530962.9624")]
    for pk, state in kept.items():
        job = TrainingJob.objects.get(pk=pk)
        assert (job.state, job.billable_seconds, job.cost_usd) == (state, 12.5, Decimal("0.0250"))
        assert job.last_synced_at == (at if state in (S.PENDING, S.STOPPING) else T0 - dt.timedelta(seconds=30))
