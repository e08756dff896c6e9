"""backend_sync passes ``changed_since`` to describe_many; jobs left out of the answer keep their
state, still get their logs read and, while RUNNING, their cost refreshed from the run interval;
training seconds are stored and a spot job's saving follows from them."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from unittest import mock

import pytest

from cloud_adapters import registry
from cloud_adapters.base import Backend, Capabilities, JobHandle, JobSpec, JobState, JobStatus
from jobs import dispatch, services, sync, tasks
from jobs.models import JobLogLine, JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.timezone.utc)


class RecordingBackend(Backend):
    """describe_many records the ``changed_since`` it got and answers only for the jobs in
    ``changed`` (the rest "did not change"); logs play ``log_chunks[job_name]`` one chunk per call."""

    kind = "recording"
    seen: list = []
    changed: dict[str, JobStatus] = {}
    log_chunks: dict[str, list[list[str]]] = {}
    cancels: list[str] = []

    @property
    def capabilities(self):
        return Capabilities(spot=True, max_nodes=4, max_procs_per_node=8)

    def submit(self, spec: JobSpec) -> JobHandle:
        return JobHandle(provider="recording", job_name=spec.job_name)

    def describe(self, handle):  # pragma: no cover - describe_many is overridden
        raise AssertionError("describe_many must be used")

    def describe_many(self, handles, changed_since=None):
        type(self).seen.append(changed_since)
        return {h.job_name: self.changed[h.job_name] for h in handles if h.job_name in self.changed}

    def cancel(self, handle):
        type(self).cancels.append(handle.job_name)

    log_calls: list[str] = []

    def logs(self, handle, cursor=""):
        type(self).log_calls.append(handle.job_name)
        at = int(cursor or 0)
        chunks = self.log_chunks.get(handle.job_name, [])
        return (chunks[at], str(at + 1)) if at < len(chunks) else ([], str(at))

    def price(self, instance_type="", spot=False):
        return 7.2


@pytest.fixture
def recording_backend(user, monkeypatch):
    monkeypatch.setitem(registry.KINDS, "recording",
                        registry.KindInfo(RecordingBackend.__module__, "RecordingBackend", "Recording"))
    RecordingBackend.seen, RecordingBackend.changed, RecordingBackend.log_chunks = [], {}, {}
    RecordingBackend.cancels, RecordingBackend.log_calls = [], []
    return services.backend_create(owner=user, name="recording", kind="recording")


@pytest.fixture
def make_job(user, digits_dataset, cnn_model, recording_backend):
    def make(**kwargs) -> TrainingJob:
        with sent_tasks(dispatch.SUBMIT_JOB):
            job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                               backend=recording_backend, nodes=2, procs_per_node=1, **kwargs)
        tasks.submit_job(job.pk)
        job.refresh_from_db()
        assert job.state == S.PENDING
        return job
    return make


def sync_at(backend, when: dt.datetime) -> int:
    with mock.patch("jobs.sync.timezone.now", return_value=when):
        return sync.backend_sync(backend_id=backend.pk)


def reload(job: TrainingJob) -> TrainingJob:
    job.refresh_from_db()
    return job


def test_changed_since_is_the_oldest_sync_minus_a_minute_or_none(make_job, recording_backend):
    a, b = make_job(name="a"), make_job(name="b")
    running = JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0 - dt.timedelta(seconds=1800),
                        instance_count=2)
    RecordingBackend.changed = {a.provider_job_name: running,
                                b.provider_job_name: JobStatus(JobState.PENDING, raw_state="InProgress")}
    assert sync_at(recording_backend, T0) == 2
    assert RecordingBackend.seen == [None]  # neither job was ever synced
    assert reload(a).last_synced_at == T0 and reload(b).last_synced_at == T0

    TrainingJob.objects.filter(pk=b.pk).update(last_synced_at=T0 - dt.timedelta(seconds=100))
    sync_at(recording_backend, T0 + dt.timedelta(seconds=30))
    assert RecordingBackend.seen[-1] == T0 - dt.timedelta(seconds=160)  # b's, the older, minus 60 s

    # A job that was never synced makes the whole batch "describe everything".
    make_job(name="c")
    sync_at(recording_backend, T0 + dt.timedelta(seconds=60))
    assert RecordingBackend.seen[-1] is None
    assert sync.sync_changed_since([]) is None


def test_an_unchanged_running_job_gets_its_logs_and_cost_from_the_run_interval(make_job, recording_backend):
    job = make_job(name="a")
    started = T0 - dt.timedelta(seconds=1800)
    RecordingBackend.changed = {job.provider_job_name: JobStatus(
        JobState.RUNNING, raw_state="InProgress", secondary_state="Training", started_at=started, instance_count=2)}
    RecordingBackend.log_chunks = {job.provider_job_name: [["first line"]]}
    sync_at(recording_backend, T0)
    job = reload(job)
    assert (job.state, job.billable_seconds, job.cost_usd) == (S.RUNNING, 1800.0, Decimal("7.2000"))  # 1800 s × 2 × $7.20/h

    # Nothing changed at the provider: describe_many leaves the job out.
    RecordingBackend.changed = {}
    RecordingBackend.log_chunks[job.provider_job_name].append(["second line", "third line"])
    sync_at(recording_backend, T0 + dt.timedelta(seconds=300))
    job = reload(job)
    assert RecordingBackend.seen == [None, T0 - dt.timedelta(seconds=60)]
    assert (job.state, job.secondary_state) == (S.RUNNING, "Training")
    assert list(JobLogLine.objects.filter(job=job).values_list("text", flat=True)) == [
        "first line", "second line", "third line"]
    assert job.log_cursor == "2"
    assert job.billable_seconds == 2100.0 and job.cost_usd == Decimal("8.4000")  # 2100 s × 2 × $7.20/h
    assert job.last_synced_at == T0 + dt.timedelta(seconds=300)

    # Recomputed, never added: the same moment twice gives the same cost.
    sync_at(recording_backend, T0 + dt.timedelta(seconds=300))
    assert reload(job).cost_usd == Decimal("8.4000")
    sync_at(recording_backend, T0 + dt.timedelta(seconds=1800))
    assert reload(job).cost_usd == Decimal("14.4000")  # 3600 s × 2 × $7.20/h


def test_an_unchanged_pending_job_keeps_its_numbers(make_job, recording_backend):
    job = make_job(name="p")
    RecordingBackend.changed = {job.provider_job_name: JobStatus(JobState.PENDING, raw_state="InProgress",
                                                                 secondary_state="Starting")}
    sync_at(recording_backend, T0)
    RecordingBackend.changed = {}
    sync_at(recording_backend, T0 + dt.timedelta(seconds=600))
    job = reload(job)
    assert (job.state, job.secondary_state, job.billable_seconds, job.cost_usd) == (
        S.PENDING, "Starting", 0.0, Decimal("0"))
    assert job.last_synced_at == T0 + dt.timedelta(seconds=600)


def test_an_unchanged_running_job_over_budget_is_stopped(make_job, recording_backend):
    job = make_job(name="budget", budget_usd="8.00")
    RecordingBackend.changed = {job.provider_job_name: JobStatus(
        JobState.RUNNING, raw_state="InProgress", started_at=T0 - dt.timedelta(seconds=1800), instance_count=2)}
    sync_at(recording_backend, T0)
    assert reload(job).state == S.RUNNING  # $7.20 < $8.00
    RecordingBackend.changed = {}
    sync_at(recording_backend, T0 + dt.timedelta(seconds=300))  # $8.40 by the run interval
    job = reload(job)
    assert job.state == S.STOPPING and job.failure_reason == "Stopped: budget of $8.00 reached at $8.40"
    assert RecordingBackend.cancels == [job.provider_job_name]


def test_training_seconds_are_stored_and_a_spot_job_shows_its_saving(make_job, recording_backend):
    job = make_job(name="spot", spot=True, instance_type="ml.g5.xlarge")
    assert job.hourly_price_usd == Decimal("7.200000")
    RecordingBackend.changed = {job.provider_job_name: JobStatus(
        JobState.SUCCEEDED, raw_state="Completed", started_at=T0 - dt.timedelta(seconds=1300), ended_at=T0,
        billable_seconds=840, training_seconds=1200, instance_count=2, spot=True)}
    sync_at(recording_backend, T0)
    job = reload(job)
    assert job.state == S.SUCCEEDED
    assert (job.billable_seconds, job.training_seconds) == (840.0, 1200.0)
    assert job.cost_usd == Decimal("3.3600")  # 840 s × 2 × $7.20/h
    assert job.spot_saving == pytest.approx(0.3)  # 1 − 840 / 1200
    assert job.on_demand_cost_usd == Decimal("4.8000")  # 1200 s × 2 × $7.20/h


def test_an_on_demand_job_has_no_saving(make_job, recording_backend):
    job = make_job(name="od")
    RecordingBackend.changed = {job.provider_job_name: JobStatus(
        JobState.SUCCEEDED, raw_state="Completed", started_at=T0 - dt.timedelta(seconds=1200), ended_at=T0,
        billable_seconds=1200, training_seconds=1200, instance_count=2)}
    sync_at(recording_backend, T0)
    job = reload(job)
    assert job.training_seconds == 1200.0 and job.spot_saving is None and job.on_demand_cost_usd is None


def test_gpubox_describes_every_job_whatever_changed_since_says(user, digits_dataset, cnn_model, local_backend,
                                                                run_root):
    """The gpubox keeps the base describe_many (one describe per handle): a job synced a minute ago
    is still read from its run directory."""
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=local_backend, procs_per_node=1, name="box")
    run_dir = run_root / job.provider_job_name
    run_dir.mkdir()
    started = T0.timestamp()
    (run_dir / "supervisor.json").write_text(json.dumps({"pid": 999999999, "started_at": started}))
    (run_dir / "exit.json").write_text(json.dumps({"returncode": 0, "started_at": started,
                                                   "ended_at": started + 90}))
    (run_dir / "train.log").write_text("hello from rank 0\n")
    from jobs.states import transition

    transition(job, S.SUBMITTING, message="test")
    transition(job, S.PENDING, message="test")
    TrainingJob.objects.filter(pk=job.pk).update(
        provider_handle={"provider": "gpubox", "job_name": job.provider_job_name},
        last_synced_at=T0 + dt.timedelta(seconds=100))
    with mock.patch.object(Backend, "describe_many", autospec=True, side_effect=Backend.describe_many) as spy:
        sync_at(local_backend, T0 + dt.timedelta(seconds=120))
    assert spy.call_args.kwargs["changed_since"] == T0 + dt.timedelta(seconds=40)
    job = reload(job)
    assert job.state == S.SUCCEEDED and job.billable_seconds == 90.0
    assert job.cost_usd == Decimal("0.0900")  # 90 s × 1 × $3.60/h
    assert list(JobLogLine.objects.filter(job=job).values_list("text", flat=True)) == ["hello from rank 0"]


def test_a_pass_reads_the_changed_jobs_logs_and_a_bounded_rotation_of_the_rest(make_job, recording_backend,
                                                                               settings):
    """Log reads per pass = changed jobs + TRAINBOARD_LOG_READS_PER_SYNC of the unchanged ones, least
    recently read first: every log is still read, and a pass's calls do not grow with active jobs."""
    settings.TRAINBOARD_LOG_READS_PER_SYNC = 2
    jobs = [make_job(name=f"j{i}") for i in range(5)]
    names = [j.provider_job_name for j in jobs]
    RecordingBackend.changed = {}
    RecordingBackend.log_chunks = {n: [[f"{n} line"]] for n in names}

    def read_in_pass(when):
        RecordingBackend.log_calls = []
        assert sync_at(recording_backend, when) == 5
        return set(RecordingBackend.log_calls)

    # Never read: by id. Each job read is read until it returns nothing (2 calls: a line, then empty).
    assert read_in_pass(T0) == {names[0], names[1]}
    assert len(RecordingBackend.log_calls) == 4
    assert read_in_pass(T0 + dt.timedelta(seconds=2)) == {names[2], names[3]}
    # Job 4 (never read) first, then the least recently read (job 0); a changed job is read on top.
    RecordingBackend.changed = {names[2]: JobStatus(JobState.RUNNING, raw_state="InProgress",
                                                    started_at=T0, instance_count=2)}
    assert read_in_pass(T0 + dt.timedelta(seconds=4)) == {names[4], names[0], names[2]}
    assert all(JobLogLine.objects.filter(job=j).count() == 1 for j in jobs)  # every log read, none twice
    assert reload(jobs[4]).logs_read_at == T0 + dt.timedelta(seconds=4)
    assert reload(jobs[3]).logs_read_at == T0 + dt.timedelta(seconds=2)
