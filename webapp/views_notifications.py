"""Notification pages: the user's email choices and webhooks (/account/notifications/), a webhook's
page with its delivery log, its form, and delete. Reads through ``jobs.selectors`` (a stranger's
webhook is a 404, a teammate's is read-only: 403 to change), writes through ``jobs.services``.
docs/notifications.md."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from jobs import selectors, services
from jobs.models import NOTIFICATION_EVENTS, Webhook
from webapp.errors import submit_form
from webapp.forms import team_field
from webapp.views import _changeable

EVENT_CHOICES = list(NOTIFICATION_EVENTS.items())
DELIVERIES_PER_PAGE = 25


class NotificationSettingsForm(forms.Form):
    email_events = forms.MultipleChoiceField(
        choices=EVENT_CHOICES, required=False, widget=forms.CheckboxSelectMultiple,
        label="Email me about my jobs", help_text="Sent to your account's email address.")
    team_email_events = forms.MultipleChoiceField(
        choices=EVENT_CHOICES, required=False, widget=forms.CheckboxSelectMultiple,
        label="Email me about my teammates' team jobs",
        help_text="Jobs another member runs for one of your teams; none unless you choose.")


class WebhookForm(forms.Form):
    name = forms.CharField(max_length=100, required=False, help_text="For you: which endpoint this is.")
    url = forms.CharField(max_length=2000, label="URL",
                          help_text="http(s) URL that receives a signed POST per event; public addresses only.")
    events = forms.MultipleChoiceField(choices=EVENT_CHOICES, widget=forms.CheckboxSelectMultiple)
    format = forms.ChoiceField(choices=Webhook.Format.choices, initial=Webhook.Format.JSON,
                               help_text="Slack: a {text, blocks} body an incoming webhook posts as a message.")
    enabled = forms.BooleanField(required=False, initial=True)

    def __init__(self, *args: Any, user=None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["team"] = team_field(user, help_text="Team webhook: every job of that team is sent; "
                                                         "blank: your own jobs.", empty_label="— my jobs —")


def _webhook_for(request: HttpRequest, pk: int) -> Webhook:
    return get_object_or_404(selectors.webhook_list_for_user(user=request.user), pk=pk)


def _show_secret(request: HttpRequest, webhook: Webhook, secret: str) -> None:
    # Shown once, in the next page's message; never stored in the clear or rendered again.
    messages.warning(request, f"Signing secret of webhook {webhook}: {secret} — copy it now, it is not shown again.")


@login_required
@require_http_methods(["GET", "POST"])
def notification_settings(request: HttpRequest) -> HttpResponse:
    pref = selectors.notification_preference_for_user(user=request.user)
    form = NotificationSettingsForm(request.POST or None, initial={"email_events": pref.email_events,
                                                                   "team_email_events": pref.team_email_events})
    if request.method == "POST":
        saved = submit_form(form, lambda: services.notification_preference_update(
            user=request.user, email_events=form.cleaned_data.get("email_events", []),
            team_email_events=form.cleaned_data.get("team_email_events", [])))
        if saved is not None:
            messages.success(request, "Notification settings saved.")
            return redirect("notification-settings")
    webhooks = selectors.webhook_list_for_user(user=request.user).order_by("-created_at", "-id")
    return render(request, "webapp/notifications/settings.html",
                  {"form": form, "webhooks": webhooks, "events": NOTIFICATION_EVENTS})


@login_required
@require_http_methods(["GET", "POST"])
def webhook_create(request: HttpRequest) -> HttpResponse:
    form = WebhookForm(request.POST or None, user=request.user)
    if request.method == "POST":
        created = submit_form(form, lambda: services.webhook_create(owner=request.user, **_values(form)))
        if created is not None:
            webhook, secret = created
            _show_secret(request, webhook, secret)
            return redirect("webhook-detail", pk=webhook.pk)
    return render(request, "webapp/notifications/webhook_form.html", {"form": form, "webhook": None})


def _values(form: WebhookForm) -> dict[str, Any]:
    data = {name: form.cleaned_data.get(name, "") for name in ("name", "url", "events", "format", "team")}
    data["enabled"] = bool(form.cleaned_data.get("enabled", False))
    data["events"] = data["events"] or []
    return data


@login_required
def webhook_detail(request: HttpRequest, pk: int) -> HttpResponse:
    webhook = _webhook_for(request, pk)
    page = Paginator(selectors.webhook_deliveries(webhook=webhook), DELIVERIES_PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "webapp/notifications/webhook_detail.html", {
        "webhook": webhook, "page": page, "events": NOTIFICATION_EVENTS,
        "can_change": selectors.can_change(user=request.user, obj=webhook)})


@login_required
@require_http_methods(["GET", "POST"])
def webhook_edit(request: HttpRequest, pk: int) -> HttpResponse:
    webhook = _changeable(request, _webhook_for(request, pk))
    initial = {"name": webhook.name, "url": webhook.url, "events": webhook.events, "format": webhook.format,
               "enabled": webhook.enabled, "team": webhook.team_id}
    form = WebhookForm(request.POST or None, initial=initial, user=webhook.owner)
    if request.method == "POST":
        rotate = request.POST.get("rotate_secret") == "on"
        saved = submit_form(form, lambda: services.webhook_update(webhook=webhook, rotate_secret=rotate,
                                                                  **_values(form)))
        if saved is not None:
            webhook, secret = saved
            if secret:
                _show_secret(request, webhook, secret)
            messages.success(request, f"Webhook {webhook} saved.")
            return redirect("webhook-detail", pk=webhook.pk)
    return render(request, "webapp/notifications/webhook_form.html", {"form": form, "webhook": webhook})


@login_required
@require_POST
def webhook_delete(request: HttpRequest, pk: int) -> HttpResponse:
    webhook = _changeable(request, _webhook_for(request, pk))
    name = str(webhook)
    services.webhook_delete(webhook=webhook)
    messages.info(request, f"Webhook {name} deleted, with its delivery log.")
    return redirect("notification-settings")
