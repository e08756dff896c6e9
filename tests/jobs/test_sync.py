"""backend_sync against a scripted Backend registered only for these tests (airflow-style: a
sequence of describe responses and log chunks, call counts asserted)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from unittest import mock

import pytest

from cloud_adapters import registry
from cloud_adapters.base import Backend, Capabilities, JobHandle, JobSpec, JobState, JobStatus
from jobs import dispatch, services, sync, tasks
from jobs.models import JobLogLine, MetricPoint, JobStateChoices as S, TrainingJob
from jobs.selectors import training_job_log_tail, training_job_rank_throughput
from metrickit import metric_series as training_job_metric_series
from trainer_pkg.metrics import format_metric_line
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


class ScriptedBackend(Backend):
    """Plays back ``SCRIPT``: one describe status and a list of log chunks per sync."""

    kind = "scripted"
    queue = "celery"
    statuses: list[JobStatus] = []
    log_chunks: list[list[str]] = []
    calls: dict[str, int] = {}

    @property
    def capabilities(self):
        return Capabilities(max_nodes=4, max_procs_per_node=8)

    def submit(self, spec: JobSpec) -> JobHandle:
        self.calls["submit"] = self.calls.get("submit", 0) + 1
        return JobHandle(provider="scripted", job_name=spec.job_name, provider_job_id="sc-1")

    def describe(self, handle):  # pragma: no cover - describe_many is overridden
        raise AssertionError("describe_many must be used")

    def describe_many(self, handles, changed_since=None):
        self.calls["describe_many"] = self.calls.get("describe_many", 0) + 1
        status = type(self).statuses.pop(0)
        return {h.job_name: status for h in handles}

    def cancel(self, handle):
        self.calls["cancel"] = self.calls.get("cancel", 0) + 1

    def logs(self, handle, cursor=""):
        self.calls["logs"] = self.calls.get("logs", 0) + 1
        at = int(cursor or 0)
        chunks = type(self).log_chunks
        if at >= len(chunks):
            return [], str(at)
        return chunks[at], str(at + 1)

    def price(self, instance_type="", spot=False):
        return 7.2


@pytest.fixture
def scripted_backend(user, monkeypatch):
    monkeypatch.setitem(registry.KINDS, "scripted",
                        registry.KindInfo(ScriptedBackend.__module__, "ScriptedBackend", "Scripted"))
    ScriptedBackend.statuses, ScriptedBackend.log_chunks, ScriptedBackend.calls = [], [], {}
    return services.backend_create(owner=user, name="scripted", kind="scripted")


@pytest.fixture
def submitted_job(user, digits_dataset, cnn_model, scripted_backend):
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=scripted_backend, nodes=2, procs_per_node=2)
    send.assert_not_called()  # captured on commit inside the test transaction: not run
    tasks.submit_job(job.pk)
    job.refresh_from_db()
    assert job.state == S.PENDING and ScriptedBackend.calls["submit"] == 1
    return job


def rec(event, **fields):
    return "[rank0]: " + format_metric_line({"event": event, "time": T0.timestamp() + fields.pop("dt", 0),
                                              **fields})


def sync_running(job, lines: list[str]) -> None:
    """One sync pass of ``job``'s scripted backend that finds it RUNNING (2 instances, since
    :data:`T0`) and reads ``lines`` as its next log chunk; ``job`` is refreshed."""
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, instance_count=2)]
    ScriptedBackend.log_chunks.append(lines)  # the cursor is the chunk's index: each sync reads the next
    sync.backend_sync(backend_id=job.backend_id)
    job.refresh_from_db()


def synced_into(job: TrainingJob, *states: str) -> TrainingJob | None:
    """One sync pass of ``job``'s backend; ``job`` (refreshed) if it is then in one of ``states``,
    else None (a predicate for ``polling.wait_for``)."""
    sync.backend_sync(backend_id=job.backend_id)
    job.refresh_from_db()
    return job if job.state in states else None


def test_sync_ingests_logs_metrics_and_applies_states(submitted_job, scripted_backend):
    job = submitted_job
    ScriptedBackend.statuses = [
        JobStatus(JobState.RUNNING, raw_state="InProgress", secondary_state="Training", started_at=T0,
                  instance_count=2, billable_seconds=60),
        JobStatus(JobState.SUCCEEDED, raw_state="Completed", started_at=T0, ended_at=T0 + dt.timedelta(seconds=100),
                  instance_count=2, billable_seconds=90),
    ]
    ScriptedBackend.log_chunks = [
        ["booting", rec("started", dt=5, epoch=0, step=1, world_size=4)],
        [rec("step", dt=6, epoch=0, step=10, train_loss=1.5, train_accuracy=0.4, samples_per_s=800.0, lr=0.05,
             rank_samples_per_s=[200.0, 201.0, 199.0, 200.0], rank_step_time_s=[0.1, 0.11, 0.1, 0.12],
             rank_data_wait_s=[0.01, 0.0, 0.02, 0.03]),
         rec("epoch", dt=8, epoch=0, step=12, val_loss=0.9, val_accuracy=0.7)],
    ]
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1
    job.refresh_from_db()
    assert job.state == S.RUNNING
    assert (job.raw_state, job.secondary_state) == ("InProgress", "Training")
    assert job.started_at == T0 and job.first_step_at == T0 + dt.timedelta(seconds=5)
    assert job.billable_seconds == 60 and job.instance_count == 2
    assert job.cost_usd == Decimal("0.2400")  # 60 s × 2 × $7.20 / 3600
    assert job.log_cursor == "2"
    # A trainer record is stored once, as metric points: the log keeps only "booting", at seq 0.
    assert list(JobLogLine.objects.filter(job=job).values_list("seq", "text")) == [(0, "booting")]

    # The last log lines arrive with the terminal state: they are stored before SUCCEEDED applies.
    ScriptedBackend.log_chunks.append([rec("epoch", dt=20, epoch=1, step=24, val_loss=0.5, val_accuracy=0.93),
                                       rec("completed", dt=21, epoch=1, step=24), "bye"])
    with mock.patch("jobs.sync.transition", wraps=sync.transition) as spy:
        sync.backend_sync(backend_id=scripted_backend.pk)
        at_transition = MetricPoint.objects.filter(job=job, name="val_accuracy").count()
    assert spy.call_count == 1 and at_transition == 2
    job.refresh_from_db()
    assert job.state == S.SUCCEEDED
    assert job.ended_at == T0 + dt.timedelta(seconds=100)
    assert job.cost_usd == Decimal("0.3600")  # absolute: 90 s × 2 × $7.20 / 3600, not 0.24 + ...
    assert ScriptedBackend.calls["describe_many"] == 2
    assert list(job.events.values_list("to_state", flat=True)) == [
        "QUEUED", "SUBMITTING", "PENDING", "RUNNING", "SUCCEEDED"]
    # seq runs on without gaps over the lines a person reads; no record is stored as a line.
    assert list(JobLogLine.objects.filter(job=job).values_list("seq", "text")) == [(0, "booting"), (1, "bye")]
    assert not JobLogLine.objects.filter(job=job, text__contains="TRAINBOARD_METRIC").exists()
    assert training_job_log_tail(job=job, lines=2) == ["booting", "bye"]

    series = training_job_metric_series(job=job)
    assert series["val_accuracy"] == [{"step": 12, "epoch": 0, "value": 0.7}, {"step": 24, "epoch": 1, "value": 0.93}]
    assert series["train_loss"] == [{"step": 10, "epoch": 0, "value": 1.5}]
    assert set(series) == {"train_loss", "train_accuracy", "samples_per_s", "lr", "val_loss", "val_accuracy"}
    assert job.final_metrics == {"train_loss": 1.5, "train_accuracy": 0.4, "samples_per_s": 800.0, "lr": 0.05,
                                 "val_loss": 0.5, "val_accuracy": 0.93}
    assert MetricPoint.objects.filter(job=job, name="rank_samples_per_s").count() == 4
    # a trainer that reported no compute / sync wait and no pipeline stages
    NOT_REPORTED = dict.fromkeys(("compute_s", "sync_wait_s", "stage", "stage_layers"))
    assert training_job_rank_throughput(job=job) == [
        {"rank": 0, "samples_per_s": 200.0, "step_time_s": 0.1, "data_wait_s": 0.01, **NOT_REPORTED},
        {"rank": 1, "samples_per_s": 201.0, "step_time_s": 0.11, "data_wait_s": 0.0, **NOT_REPORTED},
        {"rank": 2, "samples_per_s": 199.0, "step_time_s": 0.1, "data_wait_s": 0.02, **NOT_REPORTED},
        {"rank": 3, "samples_per_s": 200.0, "step_time_s": 0.12, "data_wait_s": 0.03, **NOT_REPORTED},
    ]
    # A terminal job is not synced again.
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 0
    assert ScriptedBackend.calls["describe_many"] == 2


def test_unchanged_and_unknown_states_write_no_event(submitted_job, scripted_backend):
    ScriptedBackend.statuses = [
        JobStatus(JobState.PENDING, raw_state="Queued", started_at=None),
        JobStatus(JobState.PENDING, raw_state="Mystery", warning="unknown provider state 'Mystery'"),
    ]
    sync.backend_sync(backend_id=scripted_backend.pk)
    sync.backend_sync(backend_id=scripted_backend.pk)
    job = TrainingJob.objects.get(pk=submitted_job.pk)
    assert job.state == S.PENDING and job.raw_state == "Mystery"
    assert "Mystery" in job.status_warning
    assert job.events.count() == 3  # QUEUED, SUBMITTING, PENDING only


def test_failed_status_sets_failure_reason(submitted_job, scripted_backend):
    ScriptedBackend.statuses = [JobStatus(JobState.FAILED, raw_state="Failed", failure_reason="CUDA OOM on rank 3",
                                          started_at=T0, ended_at=T0 + dt.timedelta(seconds=10))]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job = TrainingJob.objects.get(pk=submitted_job.pk)
    assert job.state == S.FAILED and job.failure_reason == "CUDA OOM on rank 3"
    assert job.billable_seconds == 10.0  # from the run interval when the provider reports none
    assert "CUDA OOM" in job.events.last().message


def test_budget_stops_the_job_and_stopping_resends_cancel(submitted_job, scripted_backend):
    job = submitted_job
    TrainingJob.objects.filter(pk=job.pk).update(budget_usd=Decimal("1.00"))
    ScriptedBackend.statuses = [
        JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, billable_seconds=300, instance_count=2),
        JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, billable_seconds=310, instance_count=2),
        JobStatus(JobState.CANCELLED, raw_state="Stopped", started_at=T0, ended_at=T0 + dt.timedelta(seconds=320),
                  billable_seconds=320, instance_count=2, failure_reason="stopped"),
    ]
    sync.backend_sync(backend_id=scripted_backend.pk)  # 300 s × 2 × $7.20/h = $1.20 ≥ $1.00
    job.refresh_from_db()
    assert job.state == S.STOPPING and job.failure_reason == "Stopped: budget of $1.00 reached at $1.20"
    assert job.budget_exceeded_at is not None
    assert ScriptedBackend.calls["cancel"] == 1
    sync.backend_sync(backend_id=scripted_backend.pk)  # still running: cancel re-sent
    job.refresh_from_db()
    assert job.state == S.STOPPING and ScriptedBackend.calls["cancel"] == 2
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert job.state == S.CANCELLED and job.failure_reason == "Stopped: budget of $1.00 reached at $1.20"
    assert job.cost_usd == Decimal("1.2800")
    assert list(job.events.values_list("to_state", flat=True))[-3:] == ["RUNNING", "STOPPING", "CANCELLED"]


def test_budget_stop_reason_reads_at_the_precision_of_the_figures_beside_it(client, user, submitted_job,
                                                                           scripted_backend):
    """Budget and cost of whole cents, but the estimate's sum (3601 s × 2 × $7.20/h = $14.404) has
    sub-cents: the reason reads at the job's one precision, as the cost beside it on the page."""
    from django.urls import reverse

    job = submitted_job
    TrainingJob.objects.filter(pk=job.pk).update(budget_usd=Decimal("1.00"), max_runtime_s=3601)
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0,
                                          billable_seconds=300, instance_count=2)]
    sync.backend_sync(backend_id=scripted_backend.pk)  # 300 s × 2 × $7.20/h = $1.20
    job.refresh_from_db()
    assert job.state == S.STOPPING and job.money_places == 4
    assert job.failure_reason == "Stopped: budget of $1.0000 reached at $1.2000"
    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "Stopped: budget of $1.0000 reached at $1.2000" in page
    assert '<span class="stat-value" id="stat-cost">$1.2000</span>' in page


def test_budget_stop_shows_the_figures_at_the_jobs_own_precision(client, user, submitted_job, scripted_backend):
    """A $0.0030 budget reached at $0.0037 reads so in the stop reason, on the job page and in the
    list (it read "budget of $0.00 reached at $0.00"); a job of whole cents keeps cents."""
    from django.urls import reverse

    job = submitted_job
    TrainingJob.objects.filter(pk=job.pk).update(budget_usd=Decimal("0.0030"))
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0,
                                          billable_seconds=0.925, instance_count=2)]
    sync.backend_sync(backend_id=scripted_backend.pk)  # 0.925 s × 2 × $7.20/h = $0.0037
    job.refresh_from_db()
    assert job.cost_usd == Decimal("0.0037") and job.state == S.STOPPING
    assert job.failure_reason == "Stopped: budget of $0.0030 reached at $0.0037"
    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "Stopped: budget of $0.0030 reached at $0.0037" in page
    assert '<span class="stat-value" id="stat-cost">$0.0037</span>' in page
    assert "budget $0.0030" in page
    listing = client.get(reverse("job-list")).content.decode()
    assert '<div class="small muted budget-stop">Stopped: budget of $0.0030 reached</div>' in listing
    assert '<td class="right nowrap">$0.0037</td>' in listing


def test_money_is_formatted_by_one_function_at_a_shared_precision():
    from jobs.cost import format_usd, format_usd_per_hour, usd_places
    from webapp.templatetags.trainboard import usd, usd_per_hour

    assert usd_places(Decimal("12.5")) == 2 and usd_places(Decimal("0.003"), Decimal("0.0037")) == 4
    # Never 3 places: a sub-cent figure reads at the 4 decimals a job's cost is kept in, as its others do.
    assert usd_places(Decimal("1.0030"), None, "n/a") == 4 and usd_places(Decimal("0.5"), Decimal("0.001")) == 4
    assert [format_usd(v) for v in (Decimal("1234.5"), Decimal("0.0037"), Decimal("0.0030"), 0, -2.5)] == [
        "$1,234.50", "$0.0037", "$0.0030", "$0.00", "-$2.50"]
    assert format_usd(Decimal("0.0030"), 4) == "$0.0030" and format_usd(None) == "—"
    assert usd(Decimal("1.0037"), 4) == "$1.0037" and usd(Decimal("1.0037")) == "$1.0037"  # was $1.00
    assert usd(Decimal("8"), "x") == "$8.00"
    assert format_usd_per_hour(0.21849885) == "$0.21849885/h" and usd_per_hour(Decimal("0.218499")) == "$0.218499/h"
    assert format_usd_per_hour(3) == "$3.00/h" and format_usd_per_hour(Decimal("1.4084")) == "$1.4084/h"


class SpotPricedBackend(ScriptedBackend):
    """Bills spot at a lower hourly rate for the whole run interval, as Vertex AI and Azure ML do."""

    kind = "spotpriced"

    @property
    def capabilities(self):
        return Capabilities(spot=True, max_nodes=4, max_procs_per_node=8)

    def price(self, instance_type="", spot=False):
        return 2.0 if spot else 8.0


def test_spot_saving_compares_the_spot_price_with_on_demand(client, user, digits_dataset, cnn_model, monkeypatch):
    """Vertex AI / Azure ML report no billable seconds: billable = trained = the run interval, so the saving
    is in the price (it showed "Spot saving 0%" and an "on demand" figure at the spot price)."""
    from django.urls import reverse

    monkeypatch.setitem(registry.KINDS, "spotpriced",
                        registry.KindInfo(SpotPricedBackend.__module__, "SpotPricedBackend", "Spot priced"))
    SpotPricedBackend.statuses, SpotPricedBackend.log_chunks, SpotPricedBackend.calls = [], [], {}
    backend = services.backend_create(owner=user, name="spotpriced", kind="spotpriced")
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=backend, nodes=2, spot=True)
    assert (job.hourly_price_usd, job.on_demand_price_usd) == (Decimal("2"), Decimal("8"))
    tasks.submit_job(job.pk)
    SpotPricedBackend.statuses = [JobStatus(JobState.SUCCEEDED, raw_state="Done", started_at=T0,
                                            ended_at=T0 + dt.timedelta(seconds=900), training_seconds=900,
                                            instance_count=2, spot=True)]
    sync.backend_sync(backend_id=backend.pk)
    job.refresh_from_db()
    assert job.billable_seconds == 900 and job.cost_usd == Decimal("1.0000")  # 900 s × 2 × $2/h
    assert job.spot_saving == pytest.approx(0.75)  # 1 − $2 / $8
    assert job.on_demand_cost_usd == Decimal("4.0000")  # 900 s × 2 × $8/h
    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert '<span class="stat-value" id="stat-spot-saving">75%</span>' in page
    assert 'id="stat-on-demand">on demand $4.00 · 900 s trained, 900 s billed</span>' in page
    with sent_tasks(dispatch.SUBMIT_JOB):
        rerun = services.training_job_rerun(job=job, owner=user)
    assert (rerun.hourly_price_usd, rerun.on_demand_price_usd) == (Decimal("2"), Decimal("8"))
    # A job stored without an on-demand price is compared at its own price.
    TrainingJob.objects.filter(pk=job.pk).update(on_demand_price_usd=None)
    job.refresh_from_db()
    assert job.spot_saving == 0.0 and job.on_demand_cost_usd == Decimal("1.0000")


def test_sync_jobs_fans_out_per_backend_queue(submitted_job, scripted_backend, local_backend):
    with mock.patch.object(tasks.sync_backend, "apply_async") as send:
        assert tasks.sync_jobs() == 1
    send.assert_called_once()
    assert send.call_args.kwargs["args"] == [scripted_backend.pk]
    assert send.call_args.kwargs["queue"] == "celery"


def test_a_diverged_run_keeps_its_nan_points_and_its_reason_leads_the_backends(submitted_job, scripted_backend):
    """Records as the trainer's encoder writes them (NaN → null + ``nonfinite``), and a cloud whose
    own failure reason is generic: the trainer's "loss became NaN at step N" comes first."""
    job = submitted_job
    nan = float("nan")
    ScriptedBackend.statuses = [
        JobStatus(JobState.RUNNING, raw_state="RUNNING", started_at=T0, instance_count=2),
        JobStatus(JobState.FAILED, raw_state="JOB_STATE_FAILED", started_at=T0, ended_at=T0 + dt.timedelta(seconds=30),
                  instance_count=2, failure_reason="The replica workerpool0-0 exited with a non-zero status of 1."),
    ]
    ScriptedBackend.log_chunks = [
        [rec("started", dt=1, epoch=0, step=1, world_size=4, train_loss=2.3),
         rec("step", dt=2, epoch=0, step=5, train_loss=1.9, rank_step_time_s=[0.1, 0.1, 0.1, 0.1]),
         rec("step", dt=3, epoch=0, step=10, train_loss=nan, train_accuracy=0.1, rank_step_time_s=[0.1, nan, 0.1, 0.1])],
        [rec("failed", dt=4, epoch=0, step=12, train_loss=float("inf"), reason="loss became NaN at step 7",
             nonfinite_step=7),
         "trainer error: rank 0: loss became NaN at step 7: the run diverged"],
    ]
    sync.backend_sync(backend_id=scripted_backend.pk)
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert job.state == S.FAILED
    assert job.failure_reason == ("loss became NaN at step 7 (the backend reported: The replica workerpool0-0 "
                                  "exited with a non-zero status of 1.)")
    assert training_job_metric_series(job=job)["train_loss"] == [
        {"step": 5, "epoch": 0, "value": 1.9}, {"step": 7, "epoch": 0, "value": None},
        {"step": 10, "epoch": 0, "value": None}, {"step": 12, "epoch": 0, "value": None}]
    assert training_job_metric_series(job=job)["train_accuracy"] == [{"step": 10, "epoch": 0, "value": 0.1}]
    assert list(MetricPoint.objects.filter(job=job, name="rank_step_time_s", step=10).order_by("rank")
                .values_list("value", flat=True)) == [0.1, None, 0.1, 0.1]


def test_a_failure_reason_that_already_names_the_trainers_reason_is_kept(submitted_job, scripted_backend):
    job = submitted_job
    gpubox_reason = "trainer error: rank 1: loss became NaN at step 3: the run diverged"
    ScriptedBackend.statuses = [JobStatus(JobState.FAILED, raw_state="exit 1", started_at=T0,
                                          ended_at=T0 + dt.timedelta(seconds=9), failure_reason=gpubox_reason)]
    ScriptedBackend.log_chunks = [[rec("failed", dt=4, epoch=0, step=4, reason="loss became NaN at step 3")]]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert (job.state, job.failure_reason) == (S.FAILED, gpubox_reason)


def test_a_spot_interruption_goes_back_to_pending_and_is_counted_on_the_job_page(
        client, user, submitted_job, scripted_backend):
    """SageMaker's spot life (clouds.md §1.2): Training, Interrupted (instances reclaimed; back to
    PENDING until capacity returns), Training again ... Completed. Each interruption is a RUNNING →
    PENDING event on the timeline, and the job page counts them."""
    import re

    from django.urls import reverse

    from jobs.selectors import training_job_interruption_count

    job = submitted_job
    TrainingJob.objects.filter(pk=job.pk).update(spot=True)

    def status(state, secondary, seconds):
        return JobStatus(state, raw_state="InProgress" if state != JobState.SUCCEEDED else "Completed",
                         secondary_state=secondary, started_at=T0, instance_count=2, billable_seconds=seconds,
                         ended_at=T0 + dt.timedelta(seconds=seconds) if state == JobState.SUCCEEDED else None)

    ScriptedBackend.statuses = [
        status(JobState.RUNNING, "Training", 30), status(JobState.PENDING, "Interrupted", 40),
        status(JobState.RUNNING, "Training", 45), status(JobState.PENDING, "Interrupted", 50),
        status(JobState.RUNNING, "Training", 60), status(JobState.SUCCEEDED, "Completed", 80),
    ]
    client.force_login(user)
    for expected_state, expected_count in [(S.RUNNING, 0), (S.PENDING, 1), (S.RUNNING, 1), (S.PENDING, 2),
                                           (S.RUNNING, 2)]:
        sync.backend_sync(backend_id=scripted_backend.pk)
        job.refresh_from_db()
        assert (job.state, training_job_interruption_count(job=job)) == (expected_state, expected_count)
        assert job.started_at == T0  # the first start: the run interval spans the interruptions
    live = client.get(reverse("job-live", args=[job.pk])).content.decode()
    assert re.search(r'id="stat-interruption-count">2<', live)
    # A state the adapter does not know reads as PENDING with a warning: no interruption, still RUNNING.
    ScriptedBackend.statuses.insert(0, JobStatus(JobState.PENDING, raw_state="InProgress", secondary_state="Mystery",
                                                 warning="unknown SecondaryStatus 'Mystery'", started_at=T0,
                                                 instance_count=2, billable_seconds=70))
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert (job.state, job.secondary_state, training_job_interruption_count(job=job)) == (S.RUNNING, "Mystery", 2)
    assert "Mystery" in job.status_warning
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert job.state == S.SUCCEEDED and job.billable_seconds == 80
    assert list(job.events.values_list("from_state", "to_state", "message"))[3:] == [
        ("PENDING", "RUNNING", "InProgress / Training"), ("RUNNING", "PENDING", "InProgress / Interrupted"),
        ("PENDING", "RUNNING", "InProgress / Training"), ("RUNNING", "PENDING", "InProgress / Interrupted"),
        ("PENDING", "RUNNING", "InProgress / Training"), ("RUNNING", "SUCCEEDED", "Completed / Completed"),
    ]
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert re.search(r'<span class="stat-label">Interruptions</span>\s*<span class="stat-value" '
                     r'id="stat-interruption-count">2</span>', page)
    timeline = page[page.index('id="timeline"'):page.index('id="rank-table"')]
    assert timeline.count('<li class="interruption">') == 2
    assert timeline.count('<strong class="interruption-label">Interrupted</strong>') == 2
    assert timeline.count("InProgress / Interrupted") == 2


def test_a_job_secret_in_the_failure_reason_is_masked(submitted_job, scripted_backend):
    """The GPU box's failure reason is the failed rank's error line: the user's code's words, which may
    quote a secret its job was given. It is stored with *** in its place, as the log lines are."""
    services.backend_update(backend=scripted_backend, job_secrets={"HF_TOKEN": "hf_secret_value_123"})
    reason = "trainer error: rank 1: ValueError: bad token hf_secret_value_123"
    ScriptedBackend.statuses = [JobStatus(JobState.FAILED, raw_state="exited 1", started_at=T0,
                                          ended_at=T0 + dt.timedelta(seconds=5), failure_reason=reason)]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job = TrainingJob.objects.get(pk=submitted_job.pk)
    assert job.state == S.FAILED and job.failure_reason == "trainer error: rank 1: ValueError: bad token ***"
    assert "hf_secret" not in job.events.order_by("pk").last().message


def _backlog_log():
    """A run's log in chunks (one ``logs`` call each): its start, three steps, its end."""
    def step(n):
        return rec("step", dt=5 + n, epoch=0, step=n, train_loss=2.0 / n, train_accuracy=0.2 * n,
                   samples_per_s=800.0, lr=0.05, rank_samples_per_s=[200.0 + n, 199.0],
                   rank_step_time_s=[0.1, 0.1 + n / 100])
    return [["booting", rec("started", dt=5, epoch=0, step=1, world_size=2)], [step(1)], [step(2)],
            [step(3), rec("completed", dt=9, epoch=0, step=3), "bye"]]


def test_an_ended_jobs_state_shows_in_the_first_pass_and_its_backlog_is_read_after(
        submitted_job, scripted_backend, monkeypatch):
    """Issue 29: a job's state is visible within one sync pass however large the log backlog behind it.
    A pass stores a bounded part of a job's log (here one call's points: PASS_POINTS = 1); the provider's
    SUCCEEDED is applied in the first pass with the backlog marked, the next passes read the rest without
    asking the provider again, and the mark goes once the log is read to its end: every line and point
    stored once, in order."""
    job = submitted_job
    monkeypatch.setattr(sync, "PASS_POINTS", 1)
    ScriptedBackend.statuses = [JobStatus(JobState.SUCCEEDED, raw_state="Completed", started_at=T0,
                                          ended_at=T0 + dt.timedelta(seconds=10), instance_count=2)]
    ScriptedBackend.log_chunks = _backlog_log()

    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1
    job.refresh_from_db()
    # The start and step 1 were read (the pass stops after the call that brought points), the state applied.
    assert (job.state, job.log_backlog, job.log_cursor) == (S.SUCCEEDED, True, "2")
    assert list(job.events.values_list("to_state", flat=True)) == [
        "QUEUED", "SUBMITTING", "PENDING", "RUNNING", "SUCCEEDED"]
    assert job.ended_at == T0 + dt.timedelta(seconds=10)
    assert job.final_metrics["train_loss"] == 2.0
    assert training_job_metric_series(job=job)["train_loss"] == [{"step": 1, "epoch": 0, "value": 2.0}]

    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1  # step 2; the provider is not asked again
    job.refresh_from_db()
    assert (job.state, job.log_backlog, job.log_cursor) == (S.SUCCEEDED, True, "3")
    assert job.final_metrics["train_loss"] == 1.0
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1  # step 3, the end record and the last line
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1  # an empty read: the log is at its end
    job.refresh_from_db()
    assert (job.state, job.log_backlog, job.log_cursor) == (S.SUCCEEDED, False, "4")
    assert ScriptedBackend.calls["describe_many"] == 1
    # The plain lines as log lines, once and in order (the trainer's records are stored as their points).
    assert list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", "text")) == [
        (0, "booting"), (1, "bye")]
    assert [p["step"] for p in training_job_metric_series(job=job)["train_loss"]] == [1, 2, 3]
    assert job.final_metrics["train_loss"] == 2.0 / 3
    assert list(job.events.values_list("to_state", flat=True))[-1] == "SUCCEEDED"
    assert job.events.filter(to_state="SUCCEEDED").count() == 1
    # Read to its end: the job is not looked at again.
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 0
    assert ScriptedBackend.calls["logs"] == 5  # 2 + 1 + 1 + the empty read


def test_a_failed_jobs_reason_gains_the_trainers_once_its_backlog_is_read(submitted_job, scripted_backend,
                                                                         monkeypatch):
    """FAILED shows in the first pass with the backend's reason; the trainer's own (its ``failed`` record at
    the end of the log) leads it once the backlog behind it has been read."""
    job = submitted_job
    monkeypatch.setattr(sync, "PASS_POINTS", 1)
    ScriptedBackend.statuses = [JobStatus(JobState.FAILED, raw_state="Failed", failure_reason="exit status 1",
                                          started_at=T0, ended_at=T0 + dt.timedelta(seconds=10), instance_count=2)]
    chunks = _backlog_log()
    chunks[-1] = [rec("failed", dt=9, epoch=0, step=3, reason="loss became NaN at step 3"), "bye"]
    ScriptedBackend.log_chunks = chunks
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert (job.state, job.log_backlog, job.failure_reason) == (S.FAILED, True, "exit status 1")
    for _ in range(3):
        sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert (job.state, job.log_backlog) == (S.FAILED, False)
    assert job.failure_reason == "loss became NaN at step 3 (the backend reported: exit status 1)"
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 0
