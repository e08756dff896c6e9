"""The comparison page, ``/jobs/compare/`` (docs/comparing-runs.md).

Which runs: ``?ids=12,15,19`` (in that order), or the job list's own filter parameters (``state``,
``backend``, ``q`` …, read by the list's :class:`webapp.forms.JobListFilterForm`, newest first), or
``?filter=<id>`` (one of the user's saved filters, in its sort order; another's is a 404), at most
:data:`jobs.comparison.MAX_COMPARED_JOBS`. Everything the page shows is in its query string, so its URL
can be shared; someone who may not see a run is told its id is not found, as for an id that does not
exist. The charts' data travels in a ``json_script`` block (the content security policy allows no
inline script) read by static/webapp/js/compare.js.
"""

from __future__ import annotations

import inspect
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET

from jobs import comparison, selectors
from jobs.models import SavedFilter
from webapp.forms import JobListFilterForm

MISSING = "missing"
"""``how`` for a ``?filter=`` that is not the user's saved filter: the page is a 404 (existence never told)."""
SHOW_ALL_CONFIG = "all"
"""``?config=all``: the config diff lists every key, not only those that differ."""


def list_filter_keys() -> tuple[str, ...]:
    """The job list's filter parameters (its filter form's fields): any of them selects runs by filter."""
    return tuple(JobListFilterForm.base_fields)


def _selector_filters(filters: dict[str, Any]) -> dict[str, Any]:
    """The list form's filters that the list's selector takes (its other values, such as the columns
    it shows, choose no jobs): the same jobs as the list, whatever filters the two grow."""
    accepted = inspect.signature(selectors.training_job_list_for_user).parameters
    return {key: value for key, value in filters.items() if key in accepted and key != "user"}


def compared_jobs(request: HttpRequest) -> tuple[list, list[str], list[str], str]:
    """``(jobs, problems, notes, how)`` for the request's query string.

    ``problems``: what makes the request unanswerable as asked (a part of ``ids`` that is not an id,
    a bad filter value, a saved filter not the user's), each a sentence to act on; ``notes``: ids not
    found, runs left out past the cap; ``how``: "ids", "filter", :data:`MISSING` or "" (nothing asked yet)."""
    user = request.user
    if "ids" in request.GET:
        try:
            ids = comparison.parse_job_ids(request.GET.get("ids", ""))
        except ValidationError as exc:
            return [], comparison.ids_problem(exc), [], "ids"
        found, not_found = comparison.training_jobs_by_ids_for_user(user=user, ids=ids)
        jobs, total = comparison.limit_jobs(found)
        return jobs, [], [m for m in (comparison.not_found_message(not_found),
                                      comparison.limit_message(len(jobs), total)) if m], "ids"
    if "filter" in request.GET:
        raw = request.GET.get("filter", "").strip()
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
            return [], [f"“{raw[:40]}” is not a saved filter's id; choose one of your saved filters in the job list."], \
                [], "filter"
        try:
            matching = selectors.saved_filter_jobs_for_user(user=user, saved_filter=int(raw))
        except SavedFilter.DoesNotExist:
            return [], [f"Saved filter #{raw} not found: saved filters are private to their owner."], [], MISSING
        jobs, total = comparison.limit_jobs(matching)
        return jobs, [], [m for m in (comparison.limit_message(len(jobs), total),) if m], "filter"
    if any(key in request.GET for key in list_filter_keys()):
        form = JobListFilterForm(request.GET, backends=selectors.backend_list_for_user(user=user), user=user)
        if form.problems():
            return [], form.problems(), [], "filter"
        matching = selectors.training_job_list_for_user(user=user, **_selector_filters(form.filters()))
        jobs, total = comparison.limit_jobs(matching)
        return jobs, [], [m for m in (comparison.limit_message(len(jobs), total),) if m], "filter"
    return [], [], [], ""


def _number(value: float | None) -> str:
    """A metric value as the table shows it: 4 significant digits; "—" for none."""
    if value is None:
        return "—"
    if abs(value) >= 10_000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _table(result: dict[str, Any], jobs: list) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The table's columns (global metrics) and its rows (one per run, a cell per column and value)."""
    columns = [m for m in result["metrics"] if not m["per_rank"]]
    by_id = {job.pk: job for job in jobs}
    rows = []
    for row in result["table"]:
        cells = []
        for metric in columns:
            values, winners = row["values"][metric["name"]], result["best"][metric["name"]]
            for which in ("final", "best"):
                cells.append({"metric": metric["name"], "which": which, "text": _number(values[which]),
                              "value": values[which], "is_best": winners[which] == row["job_id"]})
        rows.append({"job": by_id[row["job_id"]], "cells": cells})
    return columns, rows


@login_required
@require_GET
def job_compare(request: HttpRequest) -> HttpResponse:
    jobs, problems, notes, how = compared_jobs(request)
    result = comparison.training_job_comparison(jobs=jobs)
    columns, rows = _table(result, jobs)
    show_all = request.GET.get("config") == SHOW_ALL_CONFIG
    config_rows = [r for r in result["config"] if show_all or r["differs"]]
    toggle = request.GET.copy()
    if show_all:
        toggle.pop("config", None)
    else:
        toggle["config"] = SHOW_ALL_CONFIG
    chart_data = {
        "runs": [{**run, "url": reverse("job-detail", kwargs={"pk": run["id"]})} for run in result["runs"]],
        "metrics": result["metrics"],
        "series": result["series"],
        "rank_series": result["rank_series"],
    }
    return render(request, "webapp/jobs/compare.html", {
        "jobs": jobs,
        "how": how,
        "problems": problems,
        "notes": notes,
        "metrics": result["metrics"],
        "columns": columns,
        "rows": rows,
        "config_rows": config_rows,
        "config_differing": sum(1 for r in result["config"] if r["differs"]),
        "config_total": len(result["config"]),
        "show_all_config": show_all,
        "config_toggle_query": toggle.urlencode(),
        "direction_rule": result["direction_rule"],
        "chart_data": chart_data,
        "max_jobs": comparison.MAX_COMPARED_JOBS,
        "api_query": request.GET.urlencode(),
    }, status=404 if how == MISSING else 400 if problems else 200)
