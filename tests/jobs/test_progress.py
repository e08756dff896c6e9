"""Progress, time left and projected final cost (jobs.progress, issue 30): the arithmetic on a job
with ``train.max_steps``, kept by a real sync pass from recorded trainer lines (no training process);
a script's ``report.progress``; a resumed run's rate; a job without a known length; malformed
records skipped."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from types import SimpleNamespace

import pytest

from cloud_adapters.base import JobState, JobStatus
from jobs import progress, sync
from jobs.models import JobStateChoices as S, MetricPoint, TrainingJob
from test_sync import T0, ScriptedBackend, rec, scripted_backend, submitted_job  # noqa: F401 (fixtures)
from trainer_pkg import report

pytestmark = pytest.mark.django_db

T = T0.timestamp()


def with_max_steps(job: TrainingJob, max_steps: int) -> TrainingJob:
    TrainingJob.objects.filter(pk=job.pk).update(
        config={**job.config, "train": {**job.config["train"], "max_steps": max_steps}})
    job.refresh_from_db()
    return job


def trainer_lines(total: int = 1000) -> list[str]:
    """What the trainer prints for a run of ``total`` steps (``train.max_steps``): its first step
    at T0, step 100 at T0 + 49.5 s, step 200 at T0 + 99.5 s: 199 steps in 99.5 s = 2 steps/s."""
    return [rec("started", step=1, epoch=0, total_steps=total, resumed=False, lr=0.1),
            rec("step", step=100, epoch=0, total_steps=total, dt=49.5, lr=0.1, train_loss=1.5),
            rec("step", step=200, epoch=0, total_steps=total, dt=99.5, lr=0.1, train_loss=1.2)]


def test_a_max_steps_job_shows_the_arithmetic_of_its_progress_and_projected_cost(submitted_job, scripted_backend):
    job = with_max_steps(submitted_job, 1000)
    assert (job.nodes, job.hourly_price_usd) == (2, Decimal("7.2"))
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, instance_count=2,
                                          billable_seconds=125)]
    ScriptedBackend.log_chunks = [trainer_lines()]
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1
    job.refresh_from_db()
    assert job.state == S.RUNNING
    # 125 s × 2 instances × $7.20/h = $0.50 so far.
    assert job.cost_usd == Decimal("0.5000")
    assert (job.progress_total_steps, job.progress_step) == (1000, 200)
    assert job.progress_at == T0 + dt.timedelta(seconds=99.5)
    assert job.progress_recent == [[1, T], [100, T + 49.5], [200, T + 99.5]]
    assert job.progress_steps_per_s == 2.0  # (200 − 1) / 99.5

    # The cost was computed by the sync at T0 + 120 s; it is now T0 + 150 s.
    TrainingJob.objects.filter(pk=job.pk).update(last_synced_at=T0 + dt.timedelta(seconds=120))
    job.refresh_from_db()
    p = progress.job_progress(job, T0 + dt.timedelta(seconds=150))
    assert p.fraction == 0.2 and p.percent == 20.0  # 200 / 1000
    # 800 steps left at 2 steps/s = 400 s after the record at 99.5 s: the run ends at 499.5 s.
    assert p.finish_at == T0 + dt.timedelta(seconds=499.5)
    assert p.eta_s == 349.5  # 499.5 − 150
    # $0.50 + (499.5 − 120) s × 2 × $7.20/h / 3600 = $0.50 + $1.518
    assert p.projected_cost_usd == Decimal("2.0180")
    assert p.price_known is True
    assert p.arithmetic == ("200 of 1000 steps at 2.00 steps/s: 400 s left after the last record; "
                            "$0.5000 so far + 380 s × 2 nodes × $7.20/h = $2.0180")

    # Later, the step rate halves: the last 8 records set the rate, not the run's average.
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, instance_count=2,
                                          billable_seconds=400)]
    ScriptedBackend.log_chunks += [[rec("step", step=200 + 10 * i, epoch=0, total_steps=1000, dt=99.5 + 10 * i,
                                        lr=0.1) for i in range(1, 11)]]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert job.progress_step == 300 and len(job.progress_recent) == progress.RECENT_RECORDS
    assert job.progress_recent[0] == [230, T + 129.5] and job.progress_steps_per_s == 1.0  # 70 steps in 70 s


def test_a_job_without_a_known_length_shows_no_progress(submitted_job, scripted_backend):
    job = submitted_job
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, instance_count=2)]
    ScriptedBackend.log_chunks = [[rec("step", step=10, epoch=0, lr=0.1, train_loss=1.0),
                                   rec("step", step=20, epoch=0, lr=0.1, train_loss=0.9, dt=5)]]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert job.state == S.RUNNING and job.progress_total_steps is None
    assert job.progress_step == 20 and job.progress_steps_per_s == 2.0  # kept, in case a length comes
    assert job.progress is None and progress.job_progress(job, T0) is None


def test_a_script_reports_its_length_with_report_progress(submitted_job, scripted_backend, capsys, monkeypatch):
    job = submitted_job
    monkeypatch.setattr(report, "_last_step", -1)
    monkeypatch.setattr(report, "_total_steps", 0)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(report.MODEL_DIR, raising=False)
    clock = iter([T, T + 10.0, T + 20.0, T + 30.0])
    monkeypatch.setattr(report, "time", SimpleNamespace(time=lambda: next(clock)))
    capsys.readouterr()
    report.progress(total=500)                 # step 0 at T
    report.log(step=50, my_loss=0.9)           # at T + 10
    report.log(step=100, my_loss=0.8)          # at T + 20
    report.progress(done=150)                  # at T + 30, no metric
    lines = ["[rank0]: " + line for line in capsys.readouterr().out.splitlines()]
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, instance_count=2,
                                          billable_seconds=60)]
    ScriptedBackend.log_chunks = [lines]
    sync.backend_sync(backend_id=scripted_backend.pk)
    job.refresh_from_db()
    assert (job.progress_total_steps, job.progress_step, job.progress_steps_per_s) == (500, 150, 5.0)  # 150 in 30 s
    assert job.final_metrics == {"my_loss": 0.8}  # the progress records add no metric
    assert not MetricPoint.objects.filter(job=job, name="total_steps").exists()
    TrainingJob.objects.filter(pk=job.pk).update(last_synced_at=T0 + dt.timedelta(seconds=60))
    job.refresh_from_db()
    p = progress.job_progress(job, T0 + dt.timedelta(seconds=60))
    # 350 steps left at 5 steps/s = 70 s after T0 + 30: ends at T0 + 100, 40 s from now.
    assert (p.fraction, p.eta_s) == (0.3, 40.0)
    # 60 s × 2 × $7.20/h = $0.24 so far, + 40 s × 2 × $7.20/h = $0.16.
    assert (job.cost_usd, p.projected_cost_usd) == (Decimal("0.2400"), Decimal("0.4000"))


def test_a_resumed_run_measures_its_rate_afresh():
    current = {field: None for field in progress.PROGRESS_FIELDS}
    first = progress.progress_after(current, [
        {"event": "started", "step": 1, "time": 100.0, "total_steps": 300},
        {"event": "step", "step": 101, "time": 150.0}])
    assert first["progress_steps_per_s"] == 2.0
    # Restarted from the checkpoint at step 80 an hour later: the hour is no step time.
    resumed = progress.progress_after(first, [
        {"event": "started", "step": 81, "time": 3750.0, "resumed": True, "total_steps": 300},
        {"event": "step", "step": 121, "time": 3760.0}])
    assert resumed["progress_recent"] == [[81, 3750.0], [121, 3760.0]] and resumed["progress_steps_per_s"] == 4.0
    assert resumed["progress_step"] == 121 and resumed["progress_total_steps"] == 300


CURRENT = {"progress_total_steps": 100, "progress_step": 4, "progress_at": None, "progress_steps_per_s": None,
           "progress_recent": [[4, 9.0]]}


@pytest.mark.parametrize("total", ["100", True, -3, 0, 2**63, 1.5e3, None])
def test_a_malformed_total_is_ignored(total):
    after = progress.progress_after(CURRENT, [{"event": "step", "step": 5, "time": 10.0, "total_steps": total}])
    assert after["progress_total_steps"] == 100 and after["progress_step"] == 5
    assert after["progress_steps_per_s"] == 1.0  # from step 4 at 9 s to 5 at 10 s


@pytest.mark.parametrize("record", [
    {"event": "step", "step": -5, "time": 10.0},
    {"event": "step", "step": 5.5, "time": 10.0},
    {"event": "step", "step": 5, "time": float("nan")},
    {"event": "step", "step": 5, "time": float("inf")},
    {"event": "step", "step": 5, "time": "yesterday"},
    {"event": "log", "step": 5, "time": 10.0},
    {"step": 5, "time": 10.0},
])
def test_malformed_records_change_nothing(record):
    assert progress.progress_after(CURRENT, [record]) == CURRENT


def test_spot_and_unknown_prices_are_said():
    job = SimpleNamespace(progress_total_steps=100, progress_step=50, progress_at=T0, progress_steps_per_s=1.0,
                          state="RUNNING", cost_usd=Decimal("1.0000"), last_synced_at=T0, instance_count=1, nodes=1,
                          hourly_price_usd=Decimal("0"), spot=False)
    free = progress.job_progress(job, T0)
    assert (free.eta_s, free.projected_cost_usd, free.price_known) == (50.0, Decimal("1.0000"), False)
    assert free.arithmetic.endswith("(no hourly price known: the rest is not priced)")
    job.hourly_price_usd, job.spot = Decimal("3.6"), True
    spot = progress.job_progress(job, T0)
    assert spot.projected_cost_usd == Decimal("1.0500")  # + 50 s × $3.60/h
    assert spot.arithmetic.endswith("(spot: priced as if not interrupted)")
    # No record since the projected end (a slowed or hung run): no time left, and the page says why.
    late = progress.job_progress(job, T0 + dt.timedelta(seconds=80))
    assert late.eta_s == 0.0 and late.projected_cost_usd == Decimal("1.0500")
    assert late.arithmetic.endswith("= $1.05 (the projected end passed 30 s ago with no newer record read) "
                                    "(spot: priced as if not interrupted)")
    # Ended, or no rate yet: % done only.
    job.state = "SUCCEEDED"
    assert progress.job_progress(job, T0).eta_s is None and progress.job_progress(job, T0).projected_cost_usd is None
    job.state, job.progress_steps_per_s = "RUNNING", None
    waiting = progress.job_progress(job, T0)
    assert (waiting.fraction, waiting.eta_s, waiting.arithmetic) == (0.5, None, "50 of 100 steps; no step rate yet")


@pytest.mark.parametrize("total, rate, at", [
    (2**62, 1e-9, T0),                                               # 4.6e27 s left
    (1000, 1e-6, T0),                                                # 31 years left
    (1000, 1.0, dt.datetime(9999, 12, 31, 23, 59, tzinfo=dt.timezone.utc)),  # would end after the year 9999
])
def test_an_end_too_far_is_not_projected(total, rate, at):
    job = SimpleNamespace(progress_total_steps=total, progress_step=0, progress_at=at, progress_steps_per_s=rate,
                          state="RUNNING", cost_usd=Decimal("1.0000"), last_synced_at=at, instance_count=1, nodes=1,
                          hourly_price_usd=Decimal("3.6"), spot=False)
    p = progress.job_progress(job, T0)
    assert (p.fraction, p.eta_s, p.finish_at, p.projected_cost_usd) == (0.0, None, None, None)
    assert p.arithmetic.startswith(f"0 of {total} steps at ") and p.arithmetic.endswith(
        "steps/s: more than 10 years left, not projected")


def test_a_hung_job_has_no_time_left_and_is_projected_to_its_max_runtime():
    """Hung at step 5 of 20 (the trial's job): no "0 s left" nor a projected end; it bills until its max
    runtime, so its cost is projected there. Without a known start nothing is projected."""
    job = SimpleNamespace(progress_total_steps=20, progress_step=5, progress_at=T0, progress_steps_per_s=1.0,
                          state="RUNNING", cost_usd=Decimal("0.0032"), last_synced_at=T0 + dt.timedelta(seconds=700),
                          instance_count=1, nodes=1, hourly_price_usd=Decimal("3.6"), spot=False,
                          hung_at=T0 + dt.timedelta(seconds=600), max_runtime_s=7200,
                          started_at=T0 - dt.timedelta(seconds=100), first_step_at=None)
    p = progress.job_progress(job, T0 + dt.timedelta(seconds=900))
    # $0.0032 + (T0 − 100 + 7200 − (T0 + 700)) s × 1 × $3.60/h = $0.0032 + 6400 s × $0.001/s
    assert (p.hung, p.eta_s, p.finish_at, p.projected_cost_usd, p.fraction) == (True, None, None, Decimal("6.4032"), 0.25)
    assert p.arithmetic == (f"5 of 20 steps; hung since {job.hung_at:%Y-%m-%d %H:%M:%S} UTC: it bills until its max "
                            f"runtime ({T0 + dt.timedelta(seconds=7100):%Y-%m-%d %H:%M:%S} UTC); "
                            f"$0.0032 so far + 6400 s × 1 node × $3.60/h = $6.4032")
    job.started_at = None
    unknown = progress.job_progress(job, T0)
    assert (unknown.hung, unknown.eta_s, unknown.projected_cost_usd) == (True, None, None)
    assert unknown.arithmetic.endswith("(its start is not known: not projected)")
    job.state = "SUCCEEDED"  # an ended job is no longer hung
    assert progress.job_progress(job, T0).hung is False
