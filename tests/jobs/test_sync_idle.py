"""Idle GPUs through the sync (jobs.idle, issue 30): the launcher's ``hardware`` records of a 2-node,
4-GPU run whose loop sleeps (its GPUs at a few %), read from the job's log (recorded lines, no process):
the backend's ``warn`` policy notes and notifies once, ``stop`` cancels with the reason and what
stopping saves, a busy sample clears the idle period, a CPU-only job is never idle, and malformed
records change nothing."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from types import SimpleNamespace

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from jobs import idle, notifications, services
from jobs.models import ComputeBackend, JobEvent, JobStateChoices as S, NotificationPreference, TrainingJob, WebhookDelivery
from test_sync import T0, ScriptedBackend, rec, scripted_backend, submitted_job, sync_running  # noqa: F401 (fixtures)
from trainer_pkg import hardware
from trainer_pkg.metrics import format_metric_line

pytestmark = pytest.mark.django_db

START = T0.timestamp()


def hw(at_s: float, utils: list, *, node: int = 0, gpu_ranks: list | None = None, **fields) -> str:
    """One node's launcher sample ``at_s`` seconds after T0 (trainer_pkg.hardware's schema), 60 s apart."""
    ranks = [2 * node, 2 * node + 1]
    record = {"event": "hardware", "time": START + at_s, "node_rank": node, "interval_s": 60.0, "ranks": ranks,
              "sys/cpu_pct": [100.0, 100.0], "sys/rss_mb": [400.0, 400.0],
              "gpu_ranks": ranks if gpu_ranks is None else gpu_ranks, "sys/gpu_util_pct": utils, **fields}
    return "[launch] " + format_metric_line(record)


def sleeping(start_s: int, end_s: int) -> list[str]:
    """Both nodes' samples of a loop that sleeps, every 60 s from ``start_s`` to ``end_s``: GPUs at 0–9.9 %."""
    lines = []
    for at in range(start_s, end_s + 1, 60):
        lines += [hw(at, [3.0, 0.0], node=0), hw(at, [9.9, 5.0], node=1)]
    return lines


def policy(backend, name: str, **fields) -> None:
    ComputeBackend.objects.filter(pk=backend.pk).update(idle_policy=name, **fields)


def api_idle(user, job) -> dict | None:
    api = APIClient()
    api.force_authenticate(user)
    return api.get(f"/api/jobs/{job.pk}/").json()["idle"]


def test_the_warn_policy_notes_and_notifies_once_and_a_busy_sample_clears_it(
        client, user, submitted_job, scripted_backend, settings, mailoutbox):
    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]  # the test's endpoint (never called)
    services.webhook_create(owner=user, url="http://127.0.0.1:9/hook", events=["job.idle"])
    policy(scripted_backend, "warn")
    job = submitted_job
    assert (job.hourly_price_usd, job.max_runtime_s) == (Decimal("7.2"), 3600)
    sync_running(job, [rec("started", step=0), *sleeping(60, 1800)])
    assert job.state == S.RUNNING and job.started_at == T0
    assert idle.idle_for_s(job.idle) == 1740.0 and job.idle_at is None  # 29 min: not yet

    sync_running(job, sleeping(1860, 1860))
    # 30 min idle at T0 + 1860 s; 3600 − 1860 = 1740 s of max runtime left × 2 nodes × $7.20/h = $6.96.
    reason = ("Idle: all 4 GPUs below 10% for 30 min; stopping it would save $6.96 (1740 s left of its max "
              "runtime × 2 nodes × $7.20/h = $6.96)")
    assert job.state == S.RUNNING  # warn only
    assert (job.idle_at, job.idle_reason, job.idle_saved_usd) == (T0 + dt.timedelta(seconds=1860), reason,
                                                                  Decimal("6.96"))
    assert JobEvent.objects.filter(job=job, message=reason).count() == 1
    [row] = WebhookDelivery.objects.filter(job=job)
    assert (row.event, row.payload["job"]["reason"], row.payload["job"]["idle_saved_usd"]) == (
        "job.idle", reason, "6.9600")

    # The email says the same, with the saving on its own line.
    user.email = "alice@example.com"
    user.save()
    NotificationPreference.objects.create(user=user, email_events=["job.idle"])
    assert notifications.email_recipients(job, "job.idle") == [user.pk]
    assert notifications.notification_email_send(user_ids=[user.pk], facts=row.payload) == 1
    [mail] = mailoutbox
    assert notifications.summary_line(row.payload) == f"Job #{job.pk} {row.payload['job']['name']} is idle: {reason}"
    assert mail.subject == f"[Trainboard] {notifications.summary_line(row.payload)}"[:200]
    assert "What stopping it saves: $6.9600" in mail.body.splitlines()

    sync_running(job, sleeping(1920, 1920))  # still idle: told once per idle period
    assert JobEvent.objects.filter(job=job, message__startswith="Idle:").count() == 1
    assert WebhookDelivery.objects.filter(job=job).count() == 1
    assert job.idle["idle_s"] == 1860.0
    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert f"<strong>Idle.</strong> {reason}" in page.replace("&#x27;", "'")
    assert "while its GPUs idled (31m 00s)</span>" in page
    assert 'data-idle="1"' in client.get(reverse("job-list")).content.decode()
    found = api_idle(user, job)
    assert (found["at"][:19], found["saved_usd"], found["waste_usd"], found["idle_s"]) == (
        "2024-05-01T12:31:00", "6.9600", "7.4400", 1860.0)  # 1860 s × 2 × $7.20/h = $7.44

    # GPU 0 at the threshold (10 %, not below it): busy, the finding goes; the interval before counts idle.
    sync_running(job, [hw(1980, [10.0, 0.0], node=0), hw(1980, [0.0, 0.0], node=1)])
    assert (job.idle_at, job.idle_reason, job.idle_saved_usd) == (None, "", None)
    assert (job.idle["since"], job.idle["gpus"]["0"], job.idle["idle_s"]) == (None, None, 1920.0)
    assert "<strong>Idle.</strong>" not in client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert api_idle(user, job)["at"] is None

    sync_running(job, sleeping(2040, 3840))  # a second idle period of 30 min is told again
    assert JobEvent.objects.filter(job=job, message__startswith="Idle:").count() == 2
    assert job.idle_at == T0 + dt.timedelta(seconds=3840)


def test_the_stop_policy_cancels_with_the_reason_and_what_stopping_saves(user, submitted_job, scripted_backend):
    policy(scripted_backend, "stop")
    job = submitted_job
    TrainingJob.objects.filter(pk=job.pk).update(max_runtime_s=7200)
    sync_running(job, [rec("started", step=0), rec("step", step=1, dt=30)])
    assert job.state == S.RUNNING
    sync_running(job, [rec("step", step=2, dt=40), *sleeping(60, 1860)])  # the loop sleeps: a step, then idle GPUs
    # Found at T0 + 1860 s; 7200 − 1860 = 5340 s of max runtime left × 2 nodes × $7.20/h = $21.36.
    reason = ("Idle: all 4 GPUs below 10% for 30 min; stopping it saves $21.36 (5340 s left of its max runtime × "
              "2 nodes × $7.20/h = $21.36)")
    assert job.state == S.STOPPING
    assert job.failure_reason == f"Stopped: {reason}"
    assert (job.idle_reason, job.idle_saved_usd) == (reason, Decimal("21.36"))
    assert job.idle == {"threshold_pct": 10, "gpus": {str(g): START + 60 for g in range(4)}, "since": START + 60,
                        "last": START + 1860, "idle_s": 1800.0,
                        "gpu_last": {str(g): START + 1860 for g in range(4)}, "gpu_idle_s": {}}
    assert JobEvent.objects.filter(job=job, message=reason).count() == 1
    assert api_idle(user, job) == {
        "gpus": 4, "threshold_pct": 10, "since": "2024-05-01T12:01:00Z", "idle_for_s": 1800.0, "idle_s": 1800.0,
        "waste_usd": "7.2000", "gpu_idle_s": 0.0, "gpu_waste_usd": "0.0000", "at": "2024-05-01T12:31:00Z",
        "reason": reason, "saved_usd": "21.3600"}
    sync_running(job, ["[launch] saving a checkpoint on SIGTERM"])  # the provider still says RUNNING
    assert job.state == S.STOPPING and ScriptedBackend.calls["cancel"] == 1
    # The backend's waste this month, as /metrics reports it: 1800 s × 2 × $7.20/h; a tracker that is not
    # the sync's (idle_s a string, a bool) does not count.
    from jobs import selectors
    from webapp.metrics import TrainboardCollector

    assert selectors.metrics_snapshot().waste_month_usd == {scripted_backend.pk: Decimal("7.2000")}
    [family] = [m for m in TrainboardCollector().collect() if m.name == "trainboard_idle_waste_month_usd"]
    assert [s.value for s in family.samples if s.labels["backend_id"] == str(scripted_backend.pk)] == [7.2]
    for bogus in ({"idle_s": "9e9"}, {"idle_s": True}, {"idle_s": [1]}, {"idle_s": {"a": 1}}, {"idle_s": None}, []):
        TrainingJob.objects.filter(pk=job.pk).update(idle=bogus)
        assert selectors.metrics_snapshot().waste_month_usd == {}, bogus


def test_a_cpu_only_job_is_never_idle_under_a_gpu_policy(user, submitted_job, scripted_backend):
    policy(scripted_backend, "stop", idle_minutes=1)
    job = submitted_job
    lines = [rec("started", step=0)]
    for at in range(60, 3601, 60):  # an hour of samples without GPU figures (no NVML on the node)
        lines.append("[launch] " + format_metric_line({"event": "hardware", "time": START + at, "node_rank": 0,
                                                       "interval_s": 60.0, "ranks": [0, 1],
                                                       "sys/cpu_pct": [0.5, 0.5], "sys/rss_mb": [300.0, 300.0]}))
    sync_running(job, lines)
    assert job.state == S.RUNNING and job.idle_at is None
    assert job.idle in ({}, idle.empty(10))
    assert api_idle(user, job) is None
    assert not JobEvent.objects.filter(job=job, message__startswith="Idle:").exists()


def test_malformed_records_change_nothing_and_do_not_fail_the_sync(submitted_job, scripted_backend):
    bad = [{"event": "hardware", "time": "soon", "gpu_ranks": [0], "sys/gpu_util_pct": [0.0]},
           {"event": "hardware", "time": float("nan"), "gpu_ranks": [0], "sys/gpu_util_pct": [0.0]},
           {"event": "hardware", "time": START, "gpu_ranks": [0, 0], "sys/gpu_util_pct": [0.0, 0.0]},
           {"event": "hardware", "time": START, "gpu_ranks": [True], "sys/gpu_util_pct": [0.0]},
           {"event": "hardware", "time": START, "gpu_ranks": [-1], "sys/gpu_util_pct": [0.0]},
           {"event": "hardware", "time": START, "gpu_ranks": [1 << 21], "sys/gpu_util_pct": [0.0]},
           {"event": "hardware", "time": START, "gpu_ranks": "0", "sys/gpu_util_pct": [0.0]},
           {"event": "hardware", "time": START, "gpu_ranks": [0, 1], "sys/gpu_util_pct": [0.0]},
           {"event": "hardware", "time": START, "gpu_ranks": [0], "sys/gpu_util_pct": ["low"]},
           {"event": "hardware", "time": START, "gpu_ranks": [0], "sys/gpu_util_pct": [None]},
           {"event": "hardware", "time": START, "gpu_ranks": [0], "sys/gpu_util_pct": [-5.0]},
           {"event": "hardware", "time": START, "gpu_ranks": [0], "sys/gpu_util_pct": 0.0},
           {"event": "step", "time": START, "gpu_ranks": [0], "sys/gpu_util_pct": [0.0]}]
    assert (idle.EVENT, idle.UTIL in hardware.GPU_FIELDS) == (hardware.EVENT, True)  # the launcher's schema
    assert idle.idle_after(None, bad, 10) == idle.empty(10)
    for stored in ("garbage", [1], {"gpus": "x", "idle_s": -3}, {"threshold_pct": 10, "gpus": {"0": "x"}}):
        assert idle.idle_after(stored, [], 10)["since"] is None
    # Another threshold starts the windows over and keeps the idle seconds already counted.
    kept = idle.idle_after({"threshold_pct": 20, "gpus": {"0": START}, "since": START, "last": START + 60,
                            "idle_s": 60.0}, [], 10)
    assert kept == {**idle.empty(10), "idle_s": 60.0}
    # A record out of order updates its GPUs and adds no idle seconds.
    tracker = idle.idle_after(None, [{"event": "hardware", "time": START + 120, "gpu_ranks": [0], "sys/gpu_util_pct": [1.0]},
                                     {"event": "hardware", "time": START + 60, "gpu_ranks": [0], "sys/gpu_util_pct": [1.0]}], 10)
    assert (tracker["since"], tracker["last"], tracker["idle_s"]) == (START + 60, START + 120, 0.0)

    policy(scripted_backend, "stop", idle_minutes=1)
    job = submitted_job
    lines = ["[launch] TRAINBOARD_METRIC {not json", "[launch] " + format_metric_line({"event": "hardware"})]
    lines += ["[launch] " + format_metric_line(r) for r in bad if r["time"] == START]
    sync_running(job, [rec("started", step=0), *lines])
    assert job.state == S.RUNNING and job.idle == idle.empty(10) and job.idle_at is None


def test_the_saving_stops_at_the_projected_end_and_at_the_budget():
    at = T0 + dt.timedelta(seconds=1860)
    job = SimpleNamespace(state="RUNNING", hourly_price_usd=Decimal("7.2"), instance_count=2, nodes=2, spot=False,
                          started_at=T0, first_step_at=None, max_runtime_s=7200, budget_usd=None,
                          cost_usd=Decimal("1.00"), last_synced_at=at, progress_total_steps=1000, progress_step=100,
                          progress_at=at, progress_steps_per_s=1.0)
    # 900 steps left at 1 step/s: 900 s < the 5340 s of max runtime left.
    assert idle.saving(job, at) == (Decimal("3.6000"), "900 s to its projected end × 2 nodes × $7.20/h = $3.60")
    job.budget_usd = Decimal("3.00")  # $2.00 left of it: the budget stop would come first
    assert idle.saving(job, at) == (Decimal("2.0000"), "900 s to its projected end × 2 nodes × $7.20/h = $3.60, "
                                                       "capped at the $2.00 its budget has left")
    job.budget_usd, job.progress_total_steps, job.started_at = None, None, None  # no length, no start yet
    assert idle.saving(job, at) == (Decimal("28.8000"), "7200 s left of its max runtime × 2 nodes × $7.20/h = $28.80")
    job.instance_count = 10**9  # more instances than the job's nodes: the saving still fits its column
    assert idle.saving(job, at)[0] == idle.MAX_USD


def test_one_gpu_idling_while_the_others_work_counts_its_share_and_waiting_for_the_slowest_is_priced(
        client, user, submitted_job):
    job = submitted_job  # 2 nodes × 2 GPUs at $7.20 per instance-hour: $3.60 per GPU-hour
    # GPU 3 (node 1's second) at 3 % from T0 + 60 s while the others work, sampled every 60 s to T0 + 660 s.
    lines = [rec("started", step=0), rec("step", step=1, dt=30, train_loss=1.0, wait_for_slowest_s=30.0),
             rec("step", step=2, dt=90, train_loss=0.9, wait_for_slowest_s=45.0)]
    for at in range(60, 661, 60):
        lines += [hw(at, [95.0, 95.0], node=0), hw(at, [95.0, 3.0], node=1)]
    sync_running(job, lines)
    assert idle.gpu_idle_s(job.idle) == {"3": 600.0} and job.idle["idle_s"] == 0.0  # 10 intervals of 60 s
    # Then every GPU idles (T0 + 720 s to 840 s): the whole job's waste, never GPU 3's again. GPU 3's
    # interval 660 → 720 s still counts alone (GPU 2 was busy at 660 s).
    sync_running(job, [hw(at, [1.0, 1.0], node=node) for at in (720, 780, 840) for node in (0, 1)])
    assert idle.gpu_idle_s(job.idle) == {"3": 660.0} and job.idle["idle_s"] == 120.0

    # 120 s × 2 instances × $7.20/h = $0.48; 660 GPU-s × $7.20/h / 2 = $0.66; (30 + 45) rank-s × $7.20/h / 2
    # = $0.075.
    api = APIClient()
    api.force_authenticate(user)
    body = api.get(f"/api/jobs/{job.pk}/").json()
    assert (body["idle"]["gpu_idle_s"], body["idle"]["gpu_waste_usd"]) == (660.0, "0.6600")
    assert body["waste"] == {"idle_s": 120.0, "idle_usd": "0.4800", "gpu_idle_s": 660.0, "gpu_usd": "0.6600",
                             "straggler_s": 75.0, "straggler_usd": "0.0750", "total_usd": "1.2150"}
    assert idle.gpu_waste_usd(gpu_idle_s=1, procs_per_node=3, hourly_price_usd=Decimal("0.18")) == Decimal("0.0000")
    assert idle.gpu_waste_usd(gpu_idle_s=1, procs_per_node=3, hourly_price_usd=Decimal("0.54")) == Decimal("0.0001")

    from webapp.templatetags.trainboard import usd

    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert f'{usd(Decimal("0.66"), job.money_places)} while single GPUs idled (11m 00s of GPU time)</span>' in page
    assert f'{usd(Decimal("0.075"), job.money_places)} while ranks waited for the slowest (1m 15s of rank time)' in page
    assert f'{usd(Decimal("0.48"), job.money_places)} while its GPUs idled (2m 00s)</span>' in page
