"""A hung run through the sync (jobs.hangs, issue 30): the launcher's ``hang`` records, as
trainer_pkg.hang writes them from two ranks' faulthandler dumps, read from the job's log (recorded
lines, no process): the job is flagged with its last step and time, the page shows both ranks'
stacks, the backend's ``cancel`` policy stops it, and a newer step clears the flag."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse

from cloud_adapters.base import JobState, JobStatus
from jobs import hangs, sync
from jobs.models import ComputeBackend, JobEvent, JobStateChoices as S, TrainingJob
from test_sync import T0, ScriptedBackend, rec, scripted_backend, submitted_job, sync_running  # noqa: F401 (fixtures)
from trainer_pkg import hang
from trainer_pkg.metrics import format_metric_line

pytestmark = pytest.mark.django_db

RANK0 = """\
Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2806 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/code/train.py", line 15 in <module>
"""
RANK1 = """\
Thread 0x00007f0000000009 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait

Thread 0x00007f0000000002 (most recent call first):
  File "/code/train.py", line 14 in <module>
"""
DETECTED = T0.timestamp() + 130.0
STEP_TIME = T0.timestamp() + 10.0


def hang_lines(detected: float = DETECTED) -> list[str]:
    """What the launcher prints for one stall of a 2-rank run after step 1 (trainer_pkg.hang.Watchdog)."""
    lines = ["[launch] hang: no new step for 120 s (deadline 120 s) after step 1; the ranks' stacks follow"]
    for rank, dump, main in ((0, RANK0, 0x7F0000000001), (1, RANK1, 0x7F0000000002)):
        record = hang.hang_record(rank=rank, threads=hang.parse_dump(dump, main), detected_at=detected, step=1,
                                  step_time=STEP_TIME, deadline=120.0, world_size=2)
        lines += [f"[launch] rank {rank}: {record['where']}", format_metric_line(record)]
    return lines


def test_a_hung_run_is_flagged_with_its_last_step_and_both_ranks_stacks_on_the_page(
        client, user, submitted_job):
    job = submitted_job
    sync_running(job, [rec("started", step=0), rec("step", step=1, dt=10), *hang_lines()])
    assert job.state == S.RUNNING  # the default policy only flags
    assert job.hung_at == dt.datetime.fromtimestamp(DETECTED, dt.timezone.utc)
    assert (job.hang["source"], job.hang["step"], job.hang["step_time"], job.hang["deadline_s"]) == (
        "launcher", 1, STEP_TIME, 120.0)
    assert [(r["rank"], r["where"]) for r in job.hang["ranks"]] == [
        (0, "in all_reduce, train.py:15"), (1, "in <module>, train.py:14")]
    assert job.hang["ranks"][1]["threads"][0]["main"] is True  # rank 1's main thread first
    reason = ("No new step for 120 s after step 1; rank 0: in all_reduce, train.py:15; "
              "rank 1: in <module>, train.py:14")
    assert JobEvent.objects.filter(job=job, message=f"Hung: {reason}").count() == 1

    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "<strong>Hung.</strong>" in page
    assert "after step 1 (logged 2024-05-01 12:00:10 UTC)" in page
    assert "(flagged 2024-05-01 12:02:10 UTC)" in page
    assert '<li id="hang-rank-0"><strong>rank 0</strong>: in all_reduce, train.py:15' in page
    assert '<li id="hang-rank-1"><strong>rank 1</strong>: in &lt;module&gt;, train.py:14' in page
    assert 'File &quot;/code/train.py&quot;, line 14 in &lt;module&gt;' in page
    assert ('File &quot;/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py&quot;, '
            'line 2806 in all_reduce') in page

    # A step after the detection: the run was slow, not stuck.
    sync_running(job, [rec("step", step=2, dt=140)])
    assert (job.hung_at, job.hang) == (None, {})
    assert "<strong>Hung.</strong>" not in client.get(reverse("job-detail", args=[job.pk])).content.decode()


def test_the_cancel_policy_stops_a_hung_job_with_the_reason(submitted_job, scripted_backend):
    ComputeBackend.objects.filter(pk=scripted_backend.pk).update(hang_policy=ComputeBackend.HangPolicy.CANCEL)
    job = submitted_job
    sync_running(job, [rec("step", step=1, dt=10), *hang_lines()])
    assert job.state == S.STOPPING and job.hung_at is not None
    assert job.failure_reason.startswith("Cancelled: hung. No new step for 120 s after step 1; rank 0: in all_reduce")
    sync_running(job, ["still stuck"])  # the provider still says RUNNING: every sync sends the cancel again
    assert job.state == S.STOPPING and ScriptedBackend.calls["cancel"] == 1


def test_malformed_hang_records_are_skipped_and_strings_are_cut():
    at = T0.timestamp()
    records = [{"event": "hang", "time": "soon", "rank": 0}, {"event": "hang", "time": at, "rank": -1},
               {"event": "hang", "time": at, "rank": True}, {"event": "hang", "time": float("inf"), "rank": 0}]
    assert hangs.hang_after(None, {}, records) == (None, {})
    hung_at, found = hangs.hang_after(None, {}, [{"event": "hang", "time": at, "rank": 3, "step": "1",
                                                  "where": "x" * 1000, "threads": [{"frames": [5, {"line": -2}]}, 7]}])
    assert hung_at == T0 and found["step"] is None and found["deadline_s"] is None
    assert found["ranks"] == [{"rank": 3, "where": "x" * hangs.MAX_TEXT, "threads": [
        {"thread": "", "main": False, "frames": [{"file": "", "line": 0, "function": ""}]}]}]
    assert hangs.hang_reason(found) == "No new step (no step reported); rank 3: " + "x" * hangs.MAX_TEXT


def test_the_servers_deadline_mirrors_the_launchers():
    for recent in ([], [[0, 1000.0], [5, 1225.0], [10, 1450.0]], [[0, 0.0], [1000, 1000.0], [2000, 2000.0]]):
        assert hangs.deadline_s(recent) == hang.deadline_s([tuple(p) for p in recent], {})
    # A malformed pair is skipped: 10 steps in 9,000 s between 2 records; 3 × 9,000 s > 20 × 900 s.
    assert hangs.deadline_s([[0, 0.0], ["x", None], [10, 9000.0]], override_s=None) == 27000.0
    assert hangs.deadline_s([[0, 0.0], [10, 9000.0]], override_s=120) == 120.0
    assert hangs.deadline_s("garbage", override_s=True) == 600.0


def test_the_sweep_flags_a_silent_running_job_without_stacks_and_the_launchers_records_replace_it(
        client, user, submitted_job, scripted_backend):
    from jobs import recovery

    job = submitted_job
    # Steps 0..4 ten seconds apart: 2 s a step → the floor, 600 s, is the deadline.
    sync_running(job, [rec("step", step=s, dt=10 * s) for s in range(5)])
    assert job.state == S.RUNNING and job.progress_at == T0 + dt.timedelta(seconds=40)
    assert recovery.flag_hung_jobs(now=T0 + dt.timedelta(seconds=640)) == []  # 600 s: not past it
    now = T0 + dt.timedelta(seconds=641)
    assert recovery.recovery_sweep(now=now)["hung"] == 1
    job.refresh_from_db()
    assert job.hung_at == now and job.state == S.RUNNING
    assert job.hang == {"source": "sweep", "detected_at": now.timestamp(), "step": 4,
                        "step_time": (T0 + dt.timedelta(seconds=40)).timestamp(), "deadline_s": 600.0, "ranks": []}
    assert JobEvent.objects.filter(job=job, message="Hung: No new step for 600 s after step 4; no stacks (the "
                                                    "launcher did not report them)").count() == 1
    assert recovery.flag_hung_jobs(now=now + dt.timedelta(hours=1)) == []  # flagged once
    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "from the job's progress: the launcher reported no stacks" in page

    sync_running(job, hang_lines(detected=now.timestamp() + 5))
    assert job.hang["source"] == "launcher" and [r["rank"] for r in job.hang["ranks"]] == [0, 1]


def test_a_backends_hang_deadline_overrides_the_default(submitted_job, scripted_backend):
    from jobs import recovery

    ComputeBackend.objects.filter(pk=scripted_backend.pk).update(hang_deadline_s=60,
                                                                 hang_policy=ComputeBackend.HangPolicy.CANCEL)
    job = submitted_job
    sync_running(job, [rec("step", step=1, dt=10)])
    assert recovery.flag_hung_jobs(now=T0 + dt.timedelta(seconds=70)) == []
    assert recovery.flag_hung_jobs(now=T0 + dt.timedelta(seconds=71)) == [job.pk]
    job.refresh_from_db()
    assert job.state == S.STOPPING and job.hang["deadline_s"] == 60.0
    assert job.failure_reason == ("Cancelled: hung. No new step for 60 s after step 1; no stacks (the launcher "
                                  "did not report them)")


def test_the_api_gives_where_each_rank_is_stuck_and_a_large_run_keeps_a_bounded_hang(user, submitted_job):
    from rest_framework.test import APIClient

    api_client = APIClient()
    api_client.force_authenticate(user)
    job = submitted_job
    sync_running(job, [rec("step", step=1, dt=10), *hang_lines()])
    body = api_client.get(f"/api/jobs/{job.pk}/").json()
    assert body["hung_at"].startswith("2024-05-01T12:02:10")
    assert body["hang"] == {"source": "launcher", "step": 1, "step_time": STEP_TIME, "deadline_s": 120.0,
                            "reason": hangs.hang_reason(job.hang),
                            "ranks": [{"rank": 0, "where": "in all_reduce, train.py:15"},
                                      {"rank": 1, "where": "in <module>, train.py:14"}]}
    listed = {j["id"]: j["hang"] for j in api_client.get("/api/jobs/").json()["results"]}
    assert listed[job.pk] == body["hang"]

    threads = hang.parse_dump(RANK1, 0x7F0000000002)
    records = [hang.hang_record(rank=r, threads=threads, detected_at=DETECTED, step=1, step_time=STEP_TIME,
                                deadline=120.0, world_size=300) for r in range(300)]
    _, found = hangs.hang_after(None, {}, records)
    assert len(found["ranks"]) == hangs.MAX_RANKS
    assert sum(1 for r in found["ranks"] if r["threads"]) == hangs.MAX_STACK_RANKS
    assert all(r["where"] == "in <module>, train.py:14" for r in found["ranks"])


def test_a_hang_is_a_notification_event_and_a_badge_in_the_job_list(client, user, submitted_job, settings):
    from jobs import services
    from jobs.models import WebhookDelivery

    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]  # the test's endpoint (never called)
    services.webhook_create(owner=user, url="http://127.0.0.1:9/hook", events=["job.hung"])
    job = submitted_job
    sync_running(job, [rec("step", step=1, dt=10), *hang_lines()])
    [row] = WebhookDelivery.objects.filter(job=job)
    assert row.event == "job.hung" and row.payload["job"]["reason"] == hangs.hang_reason(job.hang)
    client.force_login(user)
    listing = client.get(reverse("job-list")).content.decode()
    assert 'data-hung="1"' in listing and ">Hung</span>" in listing
    sync_running(job, [rec("step", step=2, dt=140)])
    assert 'data-hung="1"' not in client.get(reverse("job-list")).content.decode()


def _restart_policy(backend, max_restarts: int) -> None:
    ComputeBackend.objects.filter(pk=backend.pk).update(hang_policy=ComputeBackend.HangPolicy.RESTART,
                                                        max_restarts=max_restarts)


def _stop_confirmed(job, state: JobState = JobState.CANCELLED) -> None:
    """The provider's answer to the stop: the run ended 200 s after T0 on 2 instances."""
    ScriptedBackend.statuses = [JobStatus(state, raw_state="Stopped", started_at=T0,
                                          ended_at=T0 + dt.timedelta(seconds=200), instance_count=2,
                                          billable_seconds=200.0)]
    sync.backend_sync(backend_id=job.backend_id)
    job.refresh_from_db()


def test_the_restart_policy_stops_a_hung_run_and_restarts_it_from_its_checkpoint_once_the_stop_is_confirmed(
        client, user, submitted_job, scripted_backend, tmp_path, monkeypatch):
    from decimal import Decimal

    from jobs import tasks
    from jobs.models import JobAttempt

    # The run's checkpoint directory, as the backend names it for a later attempt (a GPU box's
    # <run_dir>/output/checkpoints), holding the trainer's last.pt.
    checkpoints = tmp_path / "run" / "output" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.pt").write_bytes(b"checkpoint of step 1")
    monkeypatch.setattr(ScriptedBackend, "checkpoint_uri", lambda self, handle: str(checkpoints), raising=False)
    specs = []
    submit = ScriptedBackend.submit
    monkeypatch.setattr(ScriptedBackend, "submit", lambda self, spec: specs.append(spec) or submit(self, spec))
    _restart_policy(scripted_backend, max_restarts=1)
    job = submitted_job
    first_name = job.provider_job_name

    sync_running(job, [rec("started", step=0), rec("step", step=1, dt=10), *hang_lines()])
    reason = ("No new step for 120 s after step 1; rank 0: in all_reduce, train.py:15; "
              "rank 1: in <module>, train.py:14")
    assert job.state == S.STOPPING and job.hang_restart_at is not None and job.failure_reason == ""
    assert job.events.last().message == f"Restarting: hung. {reason}"
    sync_running(job, ["still stuck"])  # the provider still says RUNNING: the stop is sent again, nothing else
    assert job.state == S.STOPPING and ScriptedBackend.calls["cancel"] == 1

    _stop_confirmed(job)
    assert job.state == S.QUEUED and job.attempt == 2
    assert (job.provider_job_name, job.provider_handle, job.log_cursor) == (f"{first_name}-a2", None, "")
    assert job.checkpoint_uri == str(checkpoints)
    assert (job.hung_at, job.hang, job.hang_restart_at, job.cancel_requested_at) == (None, {}, None, None)
    event = job.events.last()
    assert (event.from_state, event.to_state, event.message) == (
        S.STOPPING, S.QUEUED, f"hung ({reason}); restarting from its last checkpoint, attempt 2 of 2")
    (closed,) = JobAttempt.objects.filter(job=job)
    assert (closed.number, closed.provider_job_name, closed.outcome, closed.reason, closed.checkpoint_uri) == (
        1, first_name, "hung", reason, str(checkpoints))
    # 200 s × 2 instances × $7.20/h = $0.80, kept on the job over its attempts.
    assert (closed.billable_seconds, closed.cost_usd, job.cost_usd) == (200.0, Decimal("0.8000"), Decimal("0.8000"))
    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert '<strong class="interruption-label">Hung · restarted</strong>' in page
    unescaped = page.replace("&lt;", "<").replace("&gt;", ">")
    assert f'<strong>Hung · restarted</strong> <span class="muted small">({reason})</span>' in unescaped

    # Attempt 2 is submitted with the checkpoint directory: the trainer resumes from its last.pt.
    ScriptedBackend.log_chunks = []  # attempt 2's own log
    tasks.submit_job(job.pk)
    job.refresh_from_db()
    assert job.state == S.PENDING and specs[-1].job_name == f"{first_name}-a2"
    assert specs[-1].checkpoint_uri == str(checkpoints) and (checkpoints / "last.pt").exists()

    # It hangs again: no restart left (max restarts 1), so the policy cancels it.
    sync_running(job, [rec("started", step=1, resumed=True), rec("step", step=2, dt=400),
                  *hang_lines(detected=DETECTED + 1000)])
    assert job.state == S.STOPPING and job.hang_restart_at is None
    assert job.failure_reason.startswith("Cancelled: hung; max restarts 1 reached. No new step for 120 s after step 1")
    _stop_confirmed(job)
    assert job.state == S.CANCELLED and job.attempt == 2 and JobAttempt.objects.filter(job=job).count() == 1


def test_a_users_cancel_while_a_hung_run_stops_for_its_restart_ends_it_instead(submitted_job, scripted_backend):
    from jobs import services
    from jobs.models import JobAttempt

    _restart_policy(scripted_backend, max_restarts=2)
    job = submitted_job
    sync_running(job, [rec("step", step=1, dt=10), *hang_lines()])
    assert job.state == S.STOPPING and job.hang_restart_at is not None
    services.training_job_cancel(job=job)
    job.refresh_from_db()
    assert (job.state, job.hang_restart_at, job.failure_reason) == (S.STOPPING, None, "Cancelled by user")
    assert job.events.last().message == "Cancelled by user: it will not be restarted"
    _stop_confirmed(job)
    assert job.state == S.CANCELLED and job.attempt == 1 and not JobAttempt.objects.filter(job=job).exists()
    assert job.failure_reason == "Cancelled by user"


def test_a_hung_run_that_succeeded_before_its_stop_landed_is_not_restarted(submitted_job, scripted_backend):
    _restart_policy(scripted_backend, max_restarts=2)
    job = submitted_job
    sync_running(job, [rec("step", step=1, dt=10), *hang_lines()])
    assert job.state == S.STOPPING
    _stop_confirmed(job, JobState.SUCCEEDED)
    assert job.state == S.SUCCEEDED and job.attempt == 1
