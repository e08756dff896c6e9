"""Writes for notifications: a user's email choices, and webhooks (create, update, delete, rotate the
secret). Every function validates everything at once (``ValidationError`` keyed by field) and writes
nothing on error. docs/notifications.md.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from jobs import validation, webhooks
from jobs.models import NOTIFICATION_EVENTS, NotificationPreference, Webhook
from jobs.validation import ALL, Errors

MAX_WEBHOOKS_PER_OWNER = 50


def _event_list(errors: Errors, field: str, value: Any, *, allow_empty: bool = True) -> list[str]:
    """``value`` as a list of known event names (a list, or a comma-separated string), in the order
    of :data:`NOTIFICATION_EVENTS`; an unknown name or another type is an error on ``field``."""
    if value is None:
        value = []
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        errors.add(field, "Give a list of event names, e.g. [\"job.failed\", \"job.succeeded\"].")
        return []
    unknown = [v for v in value if v not in NOTIFICATION_EVENTS]
    if unknown:
        shown = ", ".join(repr(v[:50]) for v in unknown[:5])
        errors.add(field, f"Unknown event {shown}; choose from {', '.join(NOTIFICATION_EVENTS)}.")
    if not allow_empty and not value:
        errors.add(field, "Choose at least one event.")
    return [e for e in NOTIFICATION_EVENTS if e in value]


def notification_preference_update(*, user, email_events: Any = None, team_email_events: Any = None
                                   ) -> NotificationPreference:
    """Set which events ``user`` is emailed about: ``email_events`` for their own jobs,
    ``team_email_events`` for other members' jobs of their teams (lists of event names; None leaves
    that choice as it is). Errors on ``email_events`` / ``team_email_events``; choosing any event
    without an email address on the account is an error on ``__all__``."""
    errors = Errors()
    pref = NotificationPreference.objects.filter(user=user).first() or NotificationPreference(user=user)
    own = pref.email_events if email_events is None else _event_list(errors, "email_events", email_events)
    team = (pref.team_email_events if team_email_events is None
            else _event_list(errors, "team_email_events", team_email_events))
    if (own or team) and not user.email:
        errors.add(ALL, "Your account has no email address; ask an administrator to add one, then choose events.")
    errors.raise_if_any()
    pref.email_events, pref.team_email_events = own, team
    pref.save()
    return pref


def _webhook_fields(errors: Errors, owner, fields: dict[str, Any], *, creating: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "url" in fields or creating:
        url = fields.get("url")
        problem = webhooks.url_problem(url)
        if problem:
            errors.add("url", problem)
        else:
            try:
                webhooks.resolve_target(url)
            except webhooks.UrlRefused as exc:
                errors.add("url", str(exc))
            out["url"] = url.strip()
    if "name" in fields:
        name = fields["name"]
        if not isinstance(name, str) or len(name) > 100 or validation.text_problem(name):
            errors.add("name", 'The name is text of at most 100 characters ("" for none).')
        else:
            out["name"] = name.strip()
    if "events" in fields or creating:
        out["events"] = _event_list(errors, "events", fields.get("events"), allow_empty=False)
    if "format" in fields:
        if fields["format"] not in Webhook.Format.values:
            errors.add("format", f"Choose a format: {', '.join(Webhook.Format.values)}.")
        else:
            out["format"] = fields["format"]
    if "enabled" in fields:
        if not isinstance(fields["enabled"], bool):
            errors.add("enabled", "enabled is true or false.")
        else:
            out["enabled"] = fields["enabled"]
    if "team" in fields:
        team = validation.member_team(errors, fields["team"], owner)
        if team is not None or fields["team"] in (None, ""):
            out["team"] = team
    unknown = set(fields) - {"url", "name", "events", "format", "enabled", "team"}
    if unknown:
        errors.add(ALL, f"Unknown webhook fields: {', '.join(sorted(map(str, unknown)))[:200]}.")
    return out


def webhook_create(*, owner, url: Any, events: Any, name: Any = "", format: Any = "json", enabled: Any = True,
                   team: Any = None) -> tuple[Webhook, str]:
    """A webhook of ``owner`` (``team`` set: for every job of that team, which must be one of the
    owner's) that POSTs ``events`` to ``url``. Returns the row and its signing secret, the only time
    the secret is shown (it is stored encrypted). Errors on ``url`` (not http(s), or a host that
    resolves to a non-public address: docs/notifications.md "SSRF"), ``events``, ``format``,
    ``name``, ``team``, ``enabled``; at most :data:`MAX_WEBHOOKS_PER_OWNER` per owner."""
    errors = Errors()
    fields = _webhook_fields(errors, owner, {"url": url, "events": events, "name": name, "format": format,
                                             "enabled": enabled, "team": team}, creating=True)
    if Webhook.objects.filter(owner=owner).count() >= MAX_WEBHOOKS_PER_OWNER:
        errors.add(ALL, f"You have {MAX_WEBHOOKS_PER_OWNER} webhooks, the most one user may have; delete one first.")
    errors.raise_if_any()
    secret = webhooks.new_secret()
    with transaction.atomic():
        webhook = Webhook.objects.create(owner=owner, secret={"key": secret}, **fields)
    return webhook, secret


def webhook_update(*, webhook: Webhook, rotate_secret: bool = False, **fields: Any) -> tuple[Webhook, str | None]:
    """Change ``fields`` (url, name, events, format, enabled, team) of ``webhook``; the row is
    untouched on error. ``rotate_secret``: a new signing secret, returned (else None)."""
    errors = Errors()
    values = _webhook_fields(errors, webhook.owner, fields, creating=False)
    errors.raise_if_any()
    secret = webhooks.new_secret() if rotate_secret else None
    if secret:
        values["secret"] = {"key": secret}
    with transaction.atomic():
        for key, value in values.items():
            setattr(webhook, key, value)
        webhook.save()
    return webhook, secret


def webhook_delete(*, webhook: Webhook) -> None:
    """Delete ``webhook`` and its delivery log."""
    webhook.delete()
