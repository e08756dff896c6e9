"""The notification pages and API: email choices, webhook create (the secret shown once, never
again), edit, delete, the delivery log with each attempt's response code, teammates read-only,
strangers 404, and bad input answered 400 (never 500) with nothing stored."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from jobs import services, webhooks
from jobs.models import NotificationPreference, Team, Webhook, WebhookDelivery
from taskkit import record_sent_tasks
from webhookkit import webhook_receiver

pytestmark = pytest.mark.django_db


@pytest.fixture
def people(django_user_model, user):
    erin = django_user_model.objects.create_user(username="erin", password="x", email="erin@example.org")
    dave = django_user_model.objects.create_user(username="dave", password="x")
    team = Team.objects.create(name="vision")
    team.members.add(user, erin)
    return {"alice": user, "erin": erin, "dave": dave, "team": team}


def _web(user):
    c = Client()
    c.force_login(user)
    return c


def _api(user):
    c = APIClient()
    c.force_authenticate(user)
    return c


def test_settings_page_saves_email_choices(user):
    user.email = "alice@example.org"
    user.save()
    c = _web(user)
    page = c.get(reverse("notification-settings"))
    assert page.status_code == 200 and "alice@example.org" in page.content.decode()
    r = c.post(reverse("notification-settings"), {"email_events": ["job.failed", "job.budget_stopped"]})
    assert r.status_code == 302
    pref = NotificationPreference.objects.get(user=user)
    assert pref.email_events == ["job.failed", "job.budget_stopped"] and pref.team_email_events == []
    bad = c.post(reverse("notification-settings"), {"email_events": ["job.nope"]})
    assert bad.status_code == 200 and "Select a valid choice" in bad.content.decode()
    assert NotificationPreference.objects.get(user=user).email_events == ["job.failed", "job.budget_stopped"]


def test_create_page_shows_the_secret_once(user):
    c = _web(user)
    r = c.post(reverse("webhook-create"), {"name": "ci", "url": "http://127.0.0.1:9/hook", "events": ["job.failed"],
                                           "format": "slack", "enabled": "on"}, follow=True)
    webhook = Webhook.objects.get()
    secret = webhook.secret["key"]
    assert r.status_code == 200 and secret in r.content.decode()
    assert (webhook.format, webhook.events, webhook.enabled) == ("slack", ["job.failed"], True)
    for url in (reverse("webhook-detail", args=[webhook.pk]), reverse("webhook-edit", args=[webhook.pk]),
                reverse("notification-settings")):
        assert secret not in c.get(url).content.decode()


def test_create_page_refuses_a_private_url(user, settings):
    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = []
    r = _web(user).post(reverse("webhook-create"), {"url": "http://10.0.0.7/hook", "events": ["job.failed"],
                                                    "format": "json"})
    assert r.status_code == 200
    assert "10.0.0.7 is a private address" in r.content.decode()
    assert not Webhook.objects.exists()


def test_detail_shows_the_delivery_log(user, job):
    with webhook_receiver([500, 200]) as receiver:
        webhook, _ = services.webhook_create(owner=user, url=receiver.url, events=["job.failed"])
        from django.db import transaction

        from jobs import notifications

        with transaction.atomic():
            [delivery] = notifications.event_record(job=job, event="job.failed", reason="exit 1")
        assert webhooks.delivery_attempt(delivery.pk) == "retry"
        WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=delivery.created_at)
        assert webhooks.delivery_attempt(delivery.pk) == "delivered"
    html = _web(user).get(reverse("webhook-detail", args=[webhook.pk])).content.decode()
    row = html[html.index(f'data-delivery="{delivery.delivery_id}"'):]
    row = row[:row.index("</tr>")]
    assert "job.failed" in row and ">delivered<" in row
    assert row.index('<span class="mono">500</span>') < row.index('<span class="mono">200</span>')
    assert "receiver says no" in row


def test_an_unnamed_webhook_reads_as_its_id_and_host_not_a_sweep(user, job):
    """Its page title, its edit page and the delivery admin's webhook column name it by id and URL
    host, never the path (a token may live there); it has none of Sweep's members."""
    import uuid

    webhook, _ = services.webhook_create(owner=user, url="http://127.0.0.1:9/services/T0/B0/tok3n?x=1",
                                         events=["job.failed"])
    WebhookDelivery.objects.create(webhook=webhook, job=job, delivery_id=uuid.uuid4(), event="job.failed",
                                   payload={"event": "job.failed"})
    expected = f"#{webhook.pk} (127.0.0.1)"
    assert str(webhook) == expected
    assert str(Webhook(pk=8, url="not a url")) == "#8"
    assert str(Webhook(pk=9, name="ci", url="http://127.0.0.1:9/x")) == "ci"
    assert not hasattr(webhook, "study_name") and not hasattr(webhook, "is_terminal")
    c = _web(user)
    detail = c.get(reverse("webhook-detail", args=[webhook.pk])).content.decode()
    assert f"<title>Webhook {expected} · Trainboard</title>" in detail and "sweep-" not in detail
    assert f"Edit webhook {expected}</h1>" in c.get(reverse("webhook-edit", args=[webhook.pk])).content.decode()
    admin_rows = c.get(reverse("admin:jobs_webhookdelivery_changelist")).content.decode()
    assert f'<td class="field-webhook nowrap">{expected}</td>' in admin_rows and "sweep-" not in admin_rows
    assert "tok3n" not in admin_rows


def test_teammate_reads_a_team_webhook_and_cannot_change_it(people):
    webhook, secret = services.webhook_create(owner=people["alice"], url="http://127.0.0.1:9/t",
                                              events=["job.failed"], team=people["team"])
    erin, dave = _web(people["erin"]), _web(people["dave"])
    assert erin.get(reverse("webhook-detail", args=[webhook.pk])).status_code == 200
    assert erin.get(reverse("webhook-edit", args=[webhook.pk])).status_code == 403
    assert erin.post(reverse("webhook-delete", args=[webhook.pk])).status_code == 403
    assert dave.get(reverse("webhook-detail", args=[webhook.pk])).status_code == 404
    assert dave.post(reverse("webhook-delete", args=[webhook.pk])).status_code == 404
    assert _api(people["erin"]).delete(f"/api/webhooks/{webhook.pk}/").status_code == 403
    assert _api(people["dave"]).get(f"/api/webhooks/{webhook.pk}/").status_code == 404
    assert Webhook.objects.filter(pk=webhook.pk).exists()
    # The owner deletes it, with its log.
    assert _web(people["alice"]).post(reverse("webhook-delete", args=[webhook.pk])).status_code == 302
    assert not Webhook.objects.exists()


def test_api_create_returns_the_secret_once(user):
    api = _api(user)
    r = api.post("/api/webhooks/", {"url": "http://127.0.0.1:9/hook", "events": ["job.succeeded", "job.failed"],
                                    "format": "json", "name": "ci"}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    secret = body["secret"]
    assert len(secret) >= 40 and Webhook.objects.get().secret == {"key": secret}
    assert body["events"] == ["job.succeeded", "job.failed"] and body["team"] is None and body["owner"] == "alice"
    shown = api.get(f"/api/webhooks/{body['id']}/").json()
    assert "secret" not in shown and secret not in str(api.get("/api/webhooks/").json())
    rotated = api.patch(f"/api/webhooks/{body['id']}/", {"rotate_secret": True}, format="json").json()
    assert rotated["secret"] != secret and Webhook.objects.get().secret == {"key": rotated["secret"]}
    assert api.patch(f"/api/webhooks/{body['id']}/", {"enabled": False}, format="json").json()["enabled"] is False


@pytest.mark.parametrize("body, fields", [
    ({"url": "gopher://x", "events": ["job.failed"]}, {"url"}),
    ({"url": 12, "events": "job.failed"}, {"url"}),
    ({"url": "http://127.0.0.1:9/", "events": {"a": 1}}, {"events"}),
    ({"url": "http://127.0.0.1:9/", "events": []}, {"events"}),
    ({"url": "http://127.0.0.1:9/", "events": ["job.failed"], "format": ["json"]}, {"format"}),
    ({"url": "http://127.0.0.1:9/", "events": ["job.failed"], "enabled": "yes"}, {"enabled"}),
    ({"url": "http://127.0.0.1:9/", "events": ["job.failed"], "team": 99999}, {"team"}),
    ({"url": "http://127.0.0.1:9/", "events": ["job.failed"], "team": "abc"}, {"team"}),
    ({"url": "http://127.0.0.1:9/", "events": ["job.failed"], "name": "\x00"}, {"name"}),
    ('{"url": "http://127.0.0.1:9/\\ud800", "events": ["job.failed"]}', {"detail"}),  # the parser's 400
    ({"url": "http://127.0.0.1:9/", "events": ["job.failed"], "secret": "mine"}, {"secret"}),
])
def test_api_bad_input_is_a_400_and_stores_nothing(user, body, fields):
    if isinstance(body, str):
        r = _api(user).post("/api/webhooks/", body, content_type="application/json")
    else:
        r = _api(user).post("/api/webhooks/", body, format="json")
    assert r.status_code == 400, r.content
    assert set(r.json()) == fields
    assert not Webhook.objects.exists()


def test_an_unknown_key_is_reported_with_every_other_error(user):
    r = _api(user).post("/api/webhooks/", {"url": "gopher://x", "events": [], "format": "xml", "extra": 1},
                        format="json")
    assert r.status_code == 400
    body = r.json()
    assert set(body) == {"extra", "url", "events", "format"}, body
    assert body["extra"] == ["Unknown field 'extra': a webhook takes name, url, events, format, enabled, team, "
                             "rotate_secret."]
    assert not Webhook.objects.exists()
    webhook, _ = services.webhook_create(owner=user, url="http://127.0.0.1:9/a", events=["job.failed"])
    r = _api(user).put(f"/api/webhooks/{webhook.pk}/", {"name": "\x00", "extra": 1, "rotate_secret": True},
                       format="json")
    assert r.status_code == 400
    assert set(r.json()) == {"extra", "url", "events", "name"}, r.json()
    assert r.json()["url"] == ["This field is required."]
    webhook.refresh_from_db()
    assert (webhook.url, webhook.name) == ("http://127.0.0.1:9/a", "")


def test_api_bad_update_changes_nothing(user):
    webhook, _ = services.webhook_create(owner=user, url="http://127.0.0.1:9/a", events=["job.failed"])
    r = _api(user).patch(f"/api/webhooks/{webhook.pk}/", {"url": "http://169.254.169.254/", "events": ["x"]},
                         format="json")
    assert r.status_code == 400 and set(r.json()) == {"url", "events"}
    webhook.refresh_from_db()
    assert (webhook.url, webhook.events) == ("http://127.0.0.1:9/a", ["job.failed"])


def test_api_deliveries_and_preferences(user, job, monkeypatch):
    record_sent_tasks(monkeypatch, "jobs.tasks.deliver_webhook")
    webhook, _ = services.webhook_create(owner=user, url="http://127.0.0.1:9/a", events=["job.failed"])
    from django.db import transaction

    from jobs import notifications

    with transaction.atomic():
        [delivery] = notifications.event_record(job=job, event="job.failed")
    api = _api(user)
    page = api.get(f"/api/webhooks/{webhook.pk}/deliveries/").json()
    assert page["count"] == 1
    [row] = page["results"]
    assert row["delivery_id"] == str(delivery.delivery_id) and row["status"] == "pending"
    assert row["payload"]["job"]["id"] == job.pk and row["attempts"] == []

    assert api.get("/api/notifications/").json() == {"email_events": [], "team_email_events": [], "email": ""}
    refused = api.patch("/api/notifications/", {"email_events": ["job.failed"]}, format="json")
    assert refused.status_code == 400 and "no email address" in refused.json()["non_field_errors"][0]
    user.email = "alice@example.org"
    user.save()
    ok = api.put("/api/notifications/", {"email_events": ["job.failed"], "team_email_events": ["job.stalled"]},
                 format="json")
    assert ok.status_code == 200
    assert ok.json() == {"email_events": ["job.failed"], "team_email_events": ["job.stalled"],
                         "email": "alice@example.org"}
    assert api.patch("/api/notifications/", ["x"], format="json").status_code == 400
