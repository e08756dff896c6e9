"""Webhook deliveries over real HTTP to a receiver on 127.0.0.1: the payload, its headers and
HMAC-SHA256 signature (checked with hmac, as a receiver would), the retry schedule (network errors,
timeouts, 5xx and 429 retried; other 4xx final), the lease a worker takes, and SSRF refusals."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from jobs.fields import TOKEN_PREFIX
from jobs import counters, notifications, services, webhooks
from jobs.models import OperationCount, Webhook, WebhookDelivery
from webhookkit import valid_signature, webhook_receiver

pytestmark = pytest.mark.django_db


def _webhook(user, url, *, events=("job.succeeded",), format="json", **kw):
    return services.webhook_create(owner=user, url=url, events=list(events), format=format, name="ci", **kw)


def _record(job, event="job.succeeded", reason=""):
    with transaction.atomic():
        return notifications.event_record(job=job, event=event, reason=reason)


def _make_due(delivery):
    WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=timezone.now() - dt.timedelta(seconds=1))


def _counter(name):
    row = OperationCount.objects.filter(name=name, backend__isnull=True).first()
    return row.value if row else 0


def test_payload_headers_and_signature(user, job):
    with webhook_receiver([200]) as receiver:
        webhook, secret = _webhook(user, receiver.url)
        [delivery] = _record(job)
        assert webhooks.delivery_attempt(delivery.pk) == "delivered"
    [request] = receiver.requests
    assert request.path == "/hook"
    assert request.headers["X-Trainboard-Event"] == "job.succeeded"
    assert request.headers["X-Trainboard-Delivery"] == str(delivery.delivery_id)
    assert request.headers["Content-Type"] == "application/json"
    assert valid_signature(secret, request.body, request.headers["X-Trainboard-Signature"])
    assert not valid_signature(secret + "x", request.body, request.headers["X-Trainboard-Signature"])
    body = json.loads(request.body)
    assert body["delivery"] == str(delivery.delivery_id)
    assert body["event"] == "job.succeeded"
    assert body["job"] == {"id": job.pk, "name": "digits-run", "state": "QUEUED", "reason": "",
                           "cost_usd": "0.0000", "budget_usd": "2.0000", "backend": "local", "owner": "alice",
                           "team": None, "url": f"https://trainboard.example.org/jobs/{job.pk}/"}
    sent_at = dt.datetime.fromisoformat(body["timestamp"])
    assert abs((timezone.now() - sent_at).total_seconds()) < 60
    delivery.refresh_from_db()
    assert delivery.status == "delivered" and delivery.next_attempt_at is None
    assert [a["status_code"] for a in delivery.attempts] == [200] and delivery.attempt_count == 1
    # The secret is stored encrypted: the column holds no trace of it.
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT secret FROM jobs_webhook WHERE id = %s", [webhook.pk])
        stored = cursor.fetchone()[0]
    assert stored.startswith(TOKEN_PREFIX) and secret not in stored


def test_the_same_bytes_and_delivery_id_at_every_attempt(user, job):
    with webhook_receiver([503, 200]) as receiver:
        _webhook(user, receiver.url, events=["job.failed"])
        [delivery] = _record(job, "job.failed", reason="rank 1: CUDA out of memory")
        assert webhooks.delivery_attempt(delivery.pk) == "retry"
        _make_due(delivery)
        assert webhooks.delivery_attempt(delivery.pk) == "delivered"
    first, second = receiver.requests
    assert first.body == second.body
    assert first.headers["X-Trainboard-Delivery"] == second.headers["X-Trainboard-Delivery"]
    assert json.loads(first.body)["job"]["reason"] == "rank 1: CUDA out of memory"
    delivery.refresh_from_db()
    assert [a["status_code"] for a in delivery.attempts] == [503, 200]
    assert delivery.attempts[0]["error"] == "receiver says no"


def test_slack_format_has_text_and_blocks(user, job):
    with webhook_receiver([200]) as receiver:
        _, secret = _webhook(user, receiver.url, events=["job.failed"], format="slack")
        [delivery] = _record(job, "job.failed", reason="exit code 1")
        assert webhooks.delivery_attempt(delivery.pk) == "delivered"
    [request] = receiver.requests
    assert valid_signature(secret, request.body, request.headers["X-Trainboard-Signature"])
    body = json.loads(request.body)
    assert set(body) == {"text", "blocks"}
    assert body["text"] == f"Job #{job.pk} digits-run failed: exit code 1"
    section, context = body["blocks"]
    assert section["type"] == "section" and section["text"]["type"] == "mrkdwn"
    assert f"<https://trainboard.example.org/jobs/{job.pk}/|Job #{job.pk} digits-run>" in section["text"]["text"]
    assert context["type"] == "context" and "cost $0.0000" in context["elements"][0]["text"]


def test_retry_schedule_then_give_up(user, job):
    with webhook_receiver([500]) as receiver:
        _webhook(user, receiver.url)
        [delivery] = _record(job)
        waits = []
        for attempt in range(1, 6):
            before = timezone.now()
            outcome = webhooks.delivery_attempt(delivery.pk)
            delivery.refresh_from_db()
            if attempt < 5:
                assert outcome == "retry"
                waits.append(round((delivery.next_attempt_at - before).total_seconds()))
                _make_due(delivery)
            else:
                assert outcome == "given up"
    assert waits == [60, 180, 540, 1080]  # 5 attempts over 31 minutes
    assert len(receiver.requests) == 5
    assert delivery.given_up_at is not None and delivery.next_attempt_at is None
    assert [a["status_code"] for a in delivery.attempts] == [500] * 5
    assert _counter(counters.WEBHOOK_ATTEMPTS_FAILED) == 5
    assert _counter(counters.WEBHOOK_DELIVERIES_GIVEN_UP) == 1
    assert webhooks.delivery_attempt(delivery.pk) == "not due"  # finished: never sent again


@pytest.mark.parametrize("status, outcome", [(429, "retry"), (502, "retry"), (404, "given up"), (410, "given up"),
                                             (401, "given up"), (302, "given up")])
def test_which_answers_are_retried(user, job, status, outcome):
    with webhook_receiver([status]) as receiver:
        _webhook(user, receiver.url)
        [delivery] = _record(job)
        assert webhooks.delivery_attempt(delivery.pk) == outcome
    assert len(receiver.requests) == 1


def test_network_error_and_timeout_are_retried(user, job, settings):
    settings.TRAINBOARD_WEBHOOK_TIMEOUT_S = 0.5
    with webhook_receiver([200]) as receiver:
        closed_url = receiver.url
    _webhook(user, closed_url)  # nothing listens there any more
    [refused] = _record(job)
    assert webhooks.delivery_attempt(refused.pk) == "retry"
    refused.refresh_from_db()
    assert refused.attempts[0]["status_code"] is None and "ConnectError" in refused.attempts[0]["error"]

    Webhook.objects.all().delete()
    with webhook_receiver([200], hold_s=2.0) as slow:
        _webhook(user, slow.url)
        [delivery] = _record(job)
        assert webhooks.delivery_attempt(delivery.pk) == "retry"
    delivery.refresh_from_db()
    assert delivery.attempts[0] == {**delivery.attempts[0], "status_code": None, "error": "timed out after 0.5 s"}


def test_a_taken_delivery_is_not_sent_twice_until_its_lease_ends(user, job):
    with webhook_receiver([200]) as receiver:
        _webhook(user, receiver.url)
        [delivery] = _record(job)
        now = timezone.now()
        taken = webhooks.delivery_claim(delivery.pk, now=now)
        assert taken is not None
        assert (taken.next_attempt_at - now).total_seconds() == pytest.approx(2.0 + webhooks.LEASE_MARGIN_S)
        assert webhooks.delivery_attempt(delivery.pk) == "not due"  # another worker holds it
        assert webhooks.due_delivery_ids() == []
        # The holder was killed: once the lease ends the row is due, and the next attempt sends it.
        assert webhooks.due_delivery_ids(now=now + dt.timedelta(seconds=13)) == [delivery.pk]
        _make_due(delivery)
        assert webhooks.delivery_attempt(delivery.pk) == "delivered"
    assert len(receiver.requests) == 1


# --- SSRF -----------------------------------------------------------------------------------


@pytest.mark.parametrize("url, words", [
    ("http://10.0.0.5/hook", "10.0.0.5 is a private address"),
    ("http://192.168.1.20:8080/x", "192.168.1.20 is a private address"),
    ("http://127.0.0.1:9000/", "127.0.0.1 is a loopback address"),
    ("http://localhost:9000/", "localhost resolves to 127.0.0.1, and 127.0.0.1 is a loopback address; "),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local (cloud metadata) address"),
    ("http://[::1]/", "::1 is a loopback address"),
    ("http://[::ffff:127.0.0.1]/", "127.0.0.1 is a loopback address"),
    ("http://0.0.0.0/", "0.0.0.0 is a"),
    ("http://100.64.0.1/", "100.64.0.1 is a non-public address"),
    ("http://[fd00:ec2::254]/", "fd00:ec2::254 is a private address"),
])
def test_private_addresses_are_refused(settings, url, words):
    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = []
    with pytest.raises(webhooks.UrlRefused) as exc:
        webhooks.resolve_target(url)
    assert words in str(exc.value)
    assert "TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS" in str(exc.value)


def test_allowed_networks_and_public_addresses_pass(settings):
    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    assert webhooks.resolve_target("http://127.0.0.1:9000/x").address == "127.0.0.1"
    assert webhooks.resolve_target("https://93.184.215.14/hook").port == 443
    with pytest.raises(webhooks.UrlRefused):
        webhooks.resolve_target("http://10.1.2.3/")  # still refused: not in the allowed networks


@pytest.mark.parametrize("url, words", [
    ("ftp://93.184.215.14/x", "Only http:// and https://"),
    ("file:///etc/passwd", "Only http:// and https://"),
    ("gopher://93.184.215.14/", "Only http:// and https://"),
    ("https://user:pw@93.184.215.14/", "no user name or password"),
    ("", "Enter the URL"),
    ("https://exa mple.com/", "spaces"),
    ("http://93.184.215.14:99999/", "not a valid URL"),
    ("https://" + "a" * 2000 + ".com/", "at most 2,000"),
])
def test_url_checks(url, words):
    assert words in webhooks.url_problem(url)


def test_webhook_create_refuses_a_private_url_and_stores_nothing(user, settings):
    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = []
    with pytest.raises(ValidationError) as exc:
        services.webhook_create(owner=user, url="http://169.254.169.254/latest/", events=["job.bogus"], format="xml")
    errors = exc.value.message_dict
    assert set(errors) == {"url", "events", "format"}
    assert "link-local" in errors["url"][0]
    assert "Unknown event 'job.bogus'" in errors["events"][0]
    assert not Webhook.objects.exists()


def test_a_url_refused_at_send_time_is_given_up_without_a_request(user, job, settings):
    with webhook_receiver([200]) as receiver:
        _webhook(user, receiver.url)
        [delivery] = _record(job)
        settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = []  # the operator closed loopback since
        assert webhooks.delivery_attempt(delivery.pk) == "given up"
    assert receiver.requests == []
    delivery.refresh_from_db()
    assert "127.0.0.1 is a loopback address" in delivery.attempts[0]["error"]
