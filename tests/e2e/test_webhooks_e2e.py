"""End to end: webhooks and email with a real Celery worker (Redis, PostgreSQL test database). The
jobs are the trainer stand-in's (tests/standins/trainer.py, named on the staff owner's backend row):
the real GPU-box supervisor and launcher, a torch-free training loop that steps as the test allows
(real training through the worker: tests/e2e/test_job_lifecycle.py).

* A digits job runs on the GPU box to SUCCEEDED; its ``job.succeeded`` webhook is POSTed to a local
  receiver (127.0.0.1, http.server in a thread) that answers 500 once, then 200: the receiver gets the
  delivery twice, both with a valid HMAC-SHA256 signature and the same delivery id, and the delivery
  log shows 500 then 200. The owner's email goes out through the file-based mail backend.
* A worker killed in the middle of a delivery leaves its row; the next worker's beat sends it once
  the killed attempt's lease ends.
* An endpoint that takes requests and answers none holds only the notifications worker: the job is
  held at its first step until both of the notifier's processes hang in their job.started requests,
  then the jobs worker syncs it to SUCCEEDED while every delivery attempt still hangs, and once the
  endpoint answers, the notifier delivers them all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.db import transaction

from jobs import dispatch, notifications, services
from jobs.models import JobEvent, JobStateChoices as S, NotificationPreference, TrainingJob, WebhookDelivery
from taskkit import sent_tasks
from webhookkit import valid_signature, webhook_receiver

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _worker_env(settings, tmp_path: Path, **more: str) -> dict[str, str]:
    """The worker's notification settings: loopback allowed, quick retries and beat pass, this
    process's encryption keys (the worker decrypts the webhook's secret), mail into files."""
    env = {
        "TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8",
        "TRAINBOARD_WEBHOOK_RETRY_DELAYS_S": "1,1",
        "TRAINBOARD_WEBHOOK_SWEEP_INTERVAL_S": "1",
        "TRAINBOARD_WEBHOOK_TIMEOUT_S": "3",
        "TRAINBOARD_ENCRYPTION_KEY": ",".join(settings.TRAINBOARD_ENCRYPTION_KEYS),
        "TRAINBOARD_BASE_URL": "https://trainboard.example.org",
        "EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend",
        "EMAIL_FILE_PATH": str(tmp_path / "mail"),
    }
    env.update(more)
    return env


def _dir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def loopback_webhooks(settings):
    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]


def _on_the_standin(backend, standin) -> None:
    """``backend``'s jobs run the trainer stand-in, whichever worker starts them."""
    services.backend_update(backend=backend, config={**backend.config, "python": standin.python})


def test_job_succeeds_and_its_webhook_is_retried_after_a_500(celery_worker_factory, settings, tmp_path, user,
                                                             digits_dataset, cnn_model, local_backend, run_root,
                                                             trainer_standin):
    _on_the_standin(local_backend, trainer_standin)
    user.email = "alice@example.org"
    user.save()
    services.notification_preference_update(user=user, email_events=["job.succeeded"])
    with webhook_receiver([500, 200]) as receiver:
        webhook, secret = services.webhook_create(owner=user, url=receiver.url, events=["job.succeeded"])
        with celery_worker_factory(_dir(tmp_path, "worker"), run_root, extra_env=_worker_env(settings, tmp_path)) as worker:
            job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                               backend=local_backend, nodes=1, procs_per_node=1, epochs=1,
                                               batch_size=64, name="notify-me")
            job = worker.wait_for(lambda: (j := TrainingJob.objects.get(pk=job.pk)).is_terminal and j, timeout=300,
                                  what="the job to end")
            assert job.state == S.SUCCEEDED, (job.failure_reason, worker.log()[-3000:])
            delivery = worker.wait_for(
                lambda: WebhookDelivery.objects.filter(webhook=webhook, delivered_at__isnull=False).first(),
                timeout=60, what="the delivery to be delivered")
            mails = worker.wait_for(lambda: list((tmp_path / "mail").glob("*.log")), timeout=30,
                                    what="the email file")
        requests = list(receiver.requests)

    assert [r.status for r in requests] == [500, 200]
    for request in requests:
        assert request.headers["X-Trainboard-Event"] == "job.succeeded"
        assert request.headers["X-Trainboard-Delivery"] == str(delivery.delivery_id)
        assert valid_signature(secret, request.body, request.headers["X-Trainboard-Signature"])
    assert requests[0].body == requests[1].body
    body = json.loads(requests[1].body)
    assert body["job"]["id"] == job.pk and body["job"]["state"] == "SUCCEEDED"
    assert body["job"]["url"] == f"https://trainboard.example.org/jobs/{job.pk}/"
    assert body["job"]["cost_usd"] == f"{job.cost_usd:.4f}"
    assert [a["status_code"] for a in delivery.attempts] == [500, 200]
    assert delivery.attempt_count == 2 and delivery.given_up_at is None
    text = "".join(p.read_text() for p in mails)
    assert "To: alice@example.org" in text
    assert f"Subject: [Trainboard] Job #{job.pk} notify-me succeeded" in text
    assert NotificationPreference.objects.get(user=user).email_events == ["job.succeeded"]


def test_a_delivery_whose_worker_was_killed_is_sent_by_the_next_worker(celery_worker_factory, settings, tmp_path,
                                                                     user, digits_dataset, cnn_model, local_backend,
                                                                     run_root):
    env = _worker_env(settings, tmp_path)
    with sent_tasks(dispatch.SUBMIT_JOB):  # the job is only the event's subject: it never runs
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=local_backend, epochs=1, name="killed-worker")
    with webhook_receiver([200], hold_s=60.0) as receiver:  # the first request hangs until the worker dies
        webhook, secret = services.webhook_create(owner=user, url=receiver.url, events=["job.failed"])
        with celery_worker_factory(_dir(tmp_path, "first"), run_root, extra_env=env) as first:
            with transaction.atomic():
                [delivery] = notifications.event_record(job=job, event="job.failed", reason="exit 1")
            first.wait_for(lambda: len(receiver.requests) == 1, timeout=60, what="the first worker's request")
            first.kill()
        delivery.refresh_from_db()
        assert delivery.delivered_at is None and delivery.attempt_count == 0  # killed mid-attempt
        assert delivery.next_attempt_at is not None  # its lease: due again once it ends
        with celery_worker_factory(_dir(tmp_path, "second"), run_root, extra_env=env) as second:
            second.wait_for(lambda: WebhookDelivery.objects.get(pk=delivery.pk).delivered_at is not None,
                            timeout=90, what="the next worker to deliver it")
        requests = list(receiver.requests)
    assert len(requests) == 2
    assert {r.headers["X-Trainboard-Delivery"] for r in requests} == {str(delivery.delivery_id)}
    assert all(valid_signature(secret, r.body, r.headers["X-Trainboard-Signature"]) for r in requests)
    delivery.refresh_from_db()
    assert [a["status_code"] for a in delivery.attempts] == [200]


def test_an_endpoint_that_never_answers_holds_the_notifier_not_the_sync(celery_worker_factory, settings, tmp_path,
                                                                        user, digits_dataset, cnn_model,
                                                                        local_backend, run_root, trainer_standin):
    """Three webhooks of job.started and job.succeeded on an endpoint that answers nothing until the
    test lets it (a 120 s HTTP timeout): the notifier's two processes hang on the job.started
    deliveries while the jobs worker, which serves the default and the box's queues, syncs the
    job to its end. With the deliveries on the jobs worker's queue, its two processes would hang
    instead, and the job's end would be recorded only after the attempts timed out. The job is the
    trainer stand-in's, held at its first step (RUNNING: job.started is sent) until both of the
    notifier's processes are in their requests."""
    env = _worker_env(settings, tmp_path, TRAINBOARD_WEBHOOK_TIMEOUT_S="120")
    _on_the_standin(local_backend, trainer_standin)
    trainer_standin.hold(steps=1)
    with webhook_receiver([200], hold=True) as receiver:
        hooks = [services.webhook_create(owner=user, url=f"{receiver.url}?hook={i}",
                                         events=["job.started", "job.succeeded"])[0] for i in range(3)]
        with celery_worker_factory(_dir(tmp_path, "jobs"), run_root, extra_env=env,
                                   queues="celery,gpubox.local") as jobs_worker, \
             celery_worker_factory(_dir(tmp_path, "notifier"), _dir(tmp_path, "notifier-runs"), extra_env=env,
                                   queues="notifications", beat=False) as notifier:
            job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                               backend=local_backend, nodes=1, procs_per_node=1, epochs=2,
                                               batch_size=64, name="held-endpoint")
            held = notifier.wait_for(lambda: len(receiver.requests) >= 2 and list(receiver.requests), timeout=120,
                                     what="the notifier's two processes to be in their requests")
            assert TrainingJob.objects.get(pk=job.pk).state == S.RUNNING  # held at the gate
            trainer_standin.release()
            job = jobs_worker.wait_for(lambda: (j := TrainingJob.objects.get(pk=job.pk)).is_terminal and j,
                                       timeout=120, what="the job to end")
            assert job.state == S.SUCCEEDED, (job.failure_reason, jobs_worker.log()[-3000:])
            ended_recorded = JobEvent.objects.get(job=job, to_state=S.SUCCEEDED).created_at.timestamp()
            # The job's end was recorded while no attempt had ended: all still hang in the notifier.
            assert [d.attempt_count for d in WebhookDelivery.objects.filter(job=job, event="job.started")] == [0] * 3
            assert WebhookDelivery.objects.filter(job=job, delivered_at__isnull=False).count() == 0
            assert receiver.answered == 0
            # Both of the notifier's processes were in their requests before the end was recorded.
            assert held[1].received_at < ended_recorded, (held[1].received_at, ended_recorded)
            receiver.release()
            delivered = notifier.wait_for(
                lambda: (rows := list(WebhookDelivery.objects.filter(job=job, delivered_at__isnull=False))
                         ) and len(rows) == 6 and rows,
                timeout=90, what="the six deliveries once the endpoint answers")
    assert sorted((d.webhook_id, d.event) for d in delivered) == sorted(
        (h.pk, e) for h in hooks for e in ("job.started", "job.succeeded"))
    assert all([a["status_code"] for a in d.attempts] == [200] for d in delivered)
    # "Task <name>[<id>] received": the notifier ran the deliveries, the jobs worker none of them.
    assert "jobs.tasks.deliver_webhook[" in notifier.log()
    assert "jobs.tasks.deliver_webhook[" not in jobs_worker.log()
