"""Small display helpers for the UI: state badges, durations, money."""

from __future__ import annotations

import shlex

from django import template
from django.utils.html import format_html

from cloud_adapters.base import PAUSED
from jobs.models import JobStateChoices

register = template.Library()

_LABELS = dict(JobStateChoices.choices)


@register.simple_tag
def state_badge(state: str) -> str:
    """``<span class="badge state-running">Running</span>``; the CSS colours each state."""
    state = str(state)
    return format_html('<span class="badge state-{}" data-state="{}">{}</span>',
                       state.lower(), state, _LABELS.get(state, state))


@register.simple_tag
def job_state_badge(job) -> str:
    """The job's state badge, followed by a "Paused" badge while its provider holds it paused
    (``secondary_state`` :data:`~cloud_adapters.base.PAUSED`) and a "Stalled" badge (reason in its
    title) when the job is past its state's deadline (``TrainingJob.stalled_at``), or a "Hung" badge when
    it stopped stepping (``TrainingJob.hung_at``, :mod:`jobs.hangs`: where each rank is stuck is on its page),
    or an "Idle" badge (the reason in its title) while its backend's idle policy finds its GPUs idle
    (``TrainingJob.idle_at``, :mod:`jobs.idle`)."""
    badge = state_badge(job.state)
    if getattr(job, "secondary_state", "") == PAUSED and not job.is_terminal:
        badge = format_html('{} <span class="badge state-paused" data-paused="1" title="{}">Paused</span>', badge,
                            f"{job.raw_state}: paused by the provider, not training until it is resumed")
    if getattr(job, "hung_at", None) and not job.is_terminal:
        badge = format_html('{} <span class="badge state-stalled" data-hung="1" title="{}">Hung</span>', badge,
                            "No new step for its hang deadline; where each rank is stuck is on the job page")
    if getattr(job, "idle_at", None) and not job.is_terminal:
        badge = format_html('{} <span class="badge state-stalled" data-idle="1" title="{}">Idle</span>', badge,
                            getattr(job, "idle_reason", "") or "Its GPUs are below the backend's idle threshold")
    if getattr(job, "stalled_at", None) and not job.is_terminal:
        return format_html('{} <span class="badge state-stalled" data-stalled="1" title="{}">Stalled</span>',
                           badge, job.stalled_reason or "Past this state's deadline")
    return badge


@register.filter
def changeable_by(obj, user) -> bool:
    """``{% if obj|changeable_by:user %}``: only the owner (or staff) gets edit/cancel/re-run controls;
    a teammate sees a shared object without them (the views answer 403 anyway)."""
    from jobs.selectors import can_change

    return can_change(user=user, obj=obj)


@register.filter
def visible_to(backend, user) -> bool:
    """``{% if job.backend|visible_to:user %}``: whether ``user`` may open the backend's page (they own
    it or it is shared with their team), so a teammate's job on a backend not shared with them links
    nothing rather than a 404. One query."""
    from jobs.selectors import backend_list_for_user

    return backend_list_for_user(user=user).filter(pk=backend.pk).exists()


@register.filter
def duration(seconds) -> str:
    """``3725`` → ``1h 02m 05s``; ``42.4`` → ``42s``; None → ``—``."""
    if seconds is None or seconds == "":
        return "—"
    total = int(round(float(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


@register.filter
def usd(value, places=None) -> str:
    """USD through :func:`jobs.cost.format_usd`: ``{{ amount|usd }}`` at the decimals the amount
    needs (cents, or 4 decimals for a sub-cent part); ``{{ job.cost_usd|usd:job.money_places }}`` at
    the precision of the job's own figures, so its cost, budget and estimate read alike."""
    from jobs.cost import format_usd

    try:
        places = None if places in (None, "") else int(places)
    except (TypeError, ValueError):
        places = None
    return format_usd(value, places)


@register.filter
def usd_per_hour(value) -> str:
    """An hourly price as the catalog has it: ``$1.4084/h`` (:func:`jobs.cost.format_usd_per_hour`)."""
    from jobs.cost import format_usd_per_hour

    if value is None or value == "":
        return "—"
    return format_usd_per_hour(value)


@register.filter
def shell_join(args) -> str:
    """A list of arguments as a shell would read them back (:func:`shlex.join`): ``["--epochs", "3"]`` →
    ``--epochs 3``, ``["--epochs 3"]`` → ``'--epochs 3'``, so where one argument ends shows. Display
    only: nothing is ever run through a shell."""
    return shlex.join(str(a) for a in args or [])


@register.filter
def get_item(mapping, key):
    return mapping.get(key) if hasattr(mapping, "get") else None


@register.filter
def pretty_json(value) -> str:
    """A JSON-able value as indented JSON (autoescaped by the template)."""
    import json

    return json.dumps(value, indent=2, sort_keys=True)


@register.filter
def percent(fraction) -> str:
    """``0.3`` → ``30%``, ``0.3333`` → ``33.3%``; None → ``—``."""
    if fraction is None or fraction == "":
        return "—"
    value = round(float(fraction) * 100, 1)
    return f"{value:g}%"


@register.filter
def metric_value(value) -> str:
    """A metric's latest value as the job page's headline shows it: ``0.4012`` → ``0.4012``,
    ``812000.0`` → ``8.12e+05`` (4 significant digits, the job list's cell text); None (the last
    value was NaN or infinite) → ``not finite``."""
    from webapp.views_experiments import cell_text

    return "not finite" if value is None else cell_text(value)


@register.filter
def highlight(text, query) -> str:
    """``text`` escaped, each match of ``query`` (any case, as the log search matches) wrapped in
    ``<mark>``; both are escaped, so neither can add markup. ``query`` "" or None: ``text`` escaped."""
    import re

    from django.utils.html import conditional_escape
    from django.utils.safestring import mark_safe

    text = str(text)
    if not query:
        return conditional_escape(text)
    parts = re.split(f"({re.escape(str(query))})", text, flags=re.IGNORECASE)
    # re.split with one group: even indexes are the text between matches, odd ones the matches.
    return mark_safe("".join(f"<mark>{conditional_escape(part)}</mark>" if i % 2 else conditional_escape(part)
                             for i, part in enumerate(parts)))
