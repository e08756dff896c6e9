"""The experiment table's pages and actions (docs/experiments.md): the job list's extra columns, sort
links, selection and saved filters (the list itself is ``webapp.views.job_list``, which takes
:func:`table_context` from here), a job's tags, notes and archive mark, and its full log.

Reads go through ``jobs.selectors`` (another user's job or saved filter is a 404), writes through
``jobs.services``; a teammate who may see a job gets 403 for changing it.
"""

from __future__ import annotations

import difflib
import json
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse, QueryDict, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import NoReverseMatch, reverse
from django.views.decorators.http import require_GET, require_POST

from jobs import job_table, selectors, services
from jobs.job_table import BUILTIN_SORTS, Column
from trainer_pkg.metrics import GLOBAL_METRICS
from webapp.errors import service_error_dict

COMPARE_PATH = "/jobs/compare/"
"""The comparison page (issue 16, h2): ``?ids=1,2,3`` or the list's filter parameters; its URL name
``job-compare`` is used once it exists."""
COLUMN_SUGGESTIONS = ("train_accuracy", "val_perplexity", "train.lr", "train.batch_size", "train.epochs",
                      "train.optimizer", "model.arch", "parallel.strategy")
"""Offered in the column picker besides the defaults and the metrics the page's jobs reported."""
MAX_CELL_CHARS = 60


def _job_for(request: HttpRequest, pk: int):
    return get_object_or_404(selectors.training_job_list_for_user(user=request.user), pk=pk)


def _changeable(request: HttpRequest, obj):
    if not selectors.can_change(user=request.user, obj=obj):
        raise PermissionDenied("Only the owner (or staff) can change this; it is shared with you to see and use.")
    return obj


def _messages_of(request: HttpRequest, exc: ValidationError) -> None:
    for message in (m for ms in service_error_dict(exc).values() for m in ms):
        messages.error(request, message)


def compare_path() -> str:
    try:
        return reverse("job-compare")
    except NoReverseMatch:
        return COMPARE_PATH


# --- the list --------------------------------------------------------------------------------------


def cell_text(value: Any) -> str:
    """A column value as the table shows it: ``0.9861`` (4 significant digits), ``true``, ``adamw``,
    compact JSON for a list or mapping, "—" for none; at most 60 characters."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (int, str)):
        text = str(value)
    else:
        text = json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)
    return text if len(text) <= MAX_CELL_CHARS else text[:MAX_CELL_CHARS - 1] + "…"


def _with(query: QueryDict, **changes: str | None) -> str:
    """``query`` with ``changes`` applied (None removes) and the paging parameters dropped, encoded."""
    out = query.copy()
    for key in ("page", "after", "before"):
        out.pop(key, None)
    for key, value in changes.items():
        out.pop(key, None)
        if value is not None:
            out[key] = value
    return out.urlencode()


def _sort_link(query: QueryDict, current: str, key: str) -> dict[str, str]:
    """The header link of the column sorted by ``key``: ascending first, then descending."""
    if current == key:
        target, arrow, aria = f"-{key}", " ▲", "ascending"
    elif current == f"-{key}":
        target, arrow, aria = key, " ▼", "descending"
    else:
        target, arrow, aria = key, "", "none"
    return {"href": "?" + _with(query, sort=target), "arrow": arrow, "aria": aria, "key": key}


def table_context(request: HttpRequest, jobs, columns: list[Column], filters: dict[str, Any]) -> dict[str, Any]:
    """What the job list adds to its rows: the extra columns (header sort links and each row's cells),
    the sort links of the fixed columns, the compare links, the column picker's value and
    suggestions, and the user's saved filters."""
    current = (filters.get("sort") or "").strip()
    query = request.GET
    for job in jobs:
        job.table_cells = [cell_text(c.value(job)) for c in columns]
    reported = sorted({name for job in jobs for name in (job.final_metrics or {}) if isinstance(name, str)})
    keys = [c.key for c in columns]
    suggestions = [k for k in dict.fromkeys([*job_table.DEFAULT_COLUMNS, *reported, *COLUMN_SUGGESTIONS]) if k not in keys]
    filter_params = {k: v for k, v in query.items() if k in job_table.LIST_PARAMS and k != "columns" and v}
    known = [*reported, *GLOBAL_METRICS, *job_table.DEFAULT_COLUMNS]
    base = compare_path()
    return {
        "columns": [{"key": c.key, "kind": c.kind, **_sort_link(query, current, c.key)} for c in columns],
        "sorts": {key: _sort_link(query, current, key) for key in BUILTIN_SORTS},
        "column_keys": ",".join(keys),
        "column_suggestions": suggestions,
        "columns_in_url": "columns" in query,
        "compare_url": base,
        "compare_page_url": f"{base}?{urlencode({'ids': ','.join(str(j.pk) for j in jobs)})}",
        "compare_filter_url": f"{base}?{urlencode(filter_params)}" if filter_params else base,
        "saved_filters": list(selectors.saved_filter_list_for_user(user=request.user)),
        "list_query": _with(query),
        "hidden_params": [(k, v) for k, v in query.items() if k in job_table.LIST_PARAMS and k != "columns"],
        "archived_view": filters.get("archived"),
        # A trainer metric no job here has reported yet is no misspelling: only other names get a notice.
        "column_notices": [_unreported_notice(c.key, known) for c in columns
                           if jobs and c.kind == "metric" and c.key not in known],
    }


def _unreported_notice(key: str, known: list[str]) -> str:
    """What the list says of a metric column no job on the page reported (its cells all "—"): a
    metric's name is free (a script's own), so a misspelt one is valid, and only this says so."""
    close = difflib.get_close_matches(key, list(dict.fromkeys(known)), n=1, cutoff=0.75)
    hint = f" Did you mean {close[0]}?" if close else ""
    return f"No job on this page reported a metric “{key}”: its column shows — for every job.{hint}"


@login_required
@require_POST
def job_bulk_archive(request: HttpRequest) -> HttpResponse:
    """Archive or unarchive the jobs checked in the list (``ids``, ``action`` archive | unarchive): all
    of them or none, every refusal named."""
    archived = request.POST.get("action", "archive") != "unarchive"
    try:
        jobs = services.training_jobs_archive(user=request.user, ids=request.POST.getlist("ids"), archived=archived)
    except ValidationError as exc:
        _messages_of(request, exc)
    else:
        verb = "Archived" if archived else "Unarchived"
        messages.success(request, f"{verb} {len(jobs)} job{'s' if len(jobs) != 1 else ''}: "
                                  f"{', '.join(f'#{j.pk}' for j in jobs)}.")
    return redirect(_back_to_list(request))


def _back_to_list(request: HttpRequest) -> str:
    """The job list with the query the form came from (``list_query``, the list's own parameters only)."""
    query, _ = job_table.clean_list_query(QueryDict(request.POST.get("list_query", "")))
    return reverse("job-list") + (f"?{urlencode(query)}" if query else "")


@login_required
@require_POST
def job_columns_save(request: HttpRequest) -> HttpResponse:
    """Keep the column picker's ``columns`` as the user's own (shown when the URL names none)."""
    try:
        keys = services.job_list_columns_save(user=request.user, columns=request.POST.get("columns", ""))
    except ValidationError as exc:
        _messages_of(request, exc)
    else:
        messages.success(request, f"Your job list shows {', '.join(keys) or 'the default columns'}.")
    query, _ = job_table.clean_list_query(QueryDict(request.POST.get("list_query", "")))
    query.pop("columns", None)
    return redirect(reverse("job-list") + (f"?{urlencode(query)}" if query else ""))


# --- saved filters ---------------------------------------------------------------------------------


@login_required
@require_POST
def saved_filter_create(request: HttpRequest) -> HttpResponse:
    """Save the list's current query (``list_query``) under ``name``."""
    raw = request.POST.get("list_query", "")
    try:
        saved = services.saved_filter_create(owner=request.user, name=request.POST.get("name", ""),
                                             query=QueryDict(raw))
    except ValidationError as exc:
        _messages_of(request, exc)
        return redirect(reverse("job-list") + (f"?{raw}" if raw and len(raw) < 2000 else ""))
    messages.success(request, f"Saved filter “{saved.name}”.")
    return redirect("savedfilter-open", pk=saved.pk)


@login_required
@require_GET
def saved_filter_open(request: HttpRequest, pk: int) -> HttpResponse:
    """The job list with the saved filter's query."""
    saved = get_object_or_404(selectors.saved_filter_list_for_user(user=request.user), pk=pk)
    query, _ = job_table.clean_list_query(saved.query if isinstance(saved.query, dict) else {})
    return redirect(reverse("job-list") + (f"?{urlencode(query)}" if query else ""))


@login_required
@require_POST
def saved_filter_delete(request: HttpRequest, pk: int) -> HttpResponse:
    saved = get_object_or_404(selectors.saved_filter_list_for_user(user=request.user), pk=pk)
    services.saved_filter_delete(saved_filter=saved)
    messages.info(request, f"Deleted saved filter “{saved.name}”.")
    return redirect("job-list")


# --- one job: tags, notes, archive ------------------------------------------------------------------


@login_required
@require_POST
def job_annotate(request: HttpRequest, pk: int) -> HttpResponse:
    """The job page's tags and notes form (``tags``: separated by commas or spaces). Refused, the job
    page comes back (400) with the tags and notes as typed and every error above them."""
    from webapp.views import job_page  # webapp.views imports this module

    job = _changeable(request, _job_for(request, pk))
    tags, notes = request.POST.get("tags", ""), request.POST.get("notes", "")
    try:
        services.training_job_annotate(job=job, tags=tags, notes=notes)
    except ValidationError as exc:
        errors = [m for ms in service_error_dict(exc).values() for m in ms]
        job = _job_for(request, pk)  # as stored: the refused values were not saved
        return job_page(request, job, annotate={"tags": tags, "notes": notes, "errors": errors}, status=400)
    messages.success(request, "Tags and notes saved.")
    return redirect("job-detail", pk=pk)


@login_required
@require_POST
def job_archive(request: HttpRequest, pk: int) -> HttpResponse:
    """Archive (``archived=1``) or unarchive (``archived=0``) one job from its page."""
    job = _changeable(request, _job_for(request, pk))
    archived = request.POST.get("archived", "1") != "0"
    try:
        services.training_job_annotate(job=job, archived=archived)
    except ValidationError as exc:
        _messages_of(request, exc)
    else:
        messages.success(request, f"{'Archived' if archived else 'Unarchived'} {job}.")
    return redirect("job-detail", pk=pk)


# --- one job: the full log --------------------------------------------------------------------------


def _log_filters(request: HttpRequest) -> tuple[dict[str, Any], list[str]]:
    """``({"q", "rank", "metrics", "page", "before"}, problems)`` from the log page's query; a bad
    value is named and left out. ``before`` (the search window's end, a ``seq``) only with a search."""
    problems: list[str] = []
    q = request.GET.get("q", "").strip()
    if len(q) > 200:
        problems.append(f"The search is {len(q):,} characters; at most 200. The log is not searched.")
        q = ""
    rank = None
    raw_rank = request.GET.get("rank", "").strip()
    if raw_rank:
        if raw_rank.isascii() and raw_rank.isdigit() and int(raw_rank) <= job_table.MAX_RANK:
            rank = int(raw_rank)
        else:
            problems.append(f"Rank “{raw_rank[:20]}” is not a rank: a whole number 0 to {job_table.MAX_RANK:,}. "
                            f"Every rank's lines are shown.")
    before = None
    raw_before = request.GET.get("before", "").strip()
    if raw_before:
        if raw_before.isascii() and raw_before.isdigit() and len(raw_before) <= 10:
            before = int(raw_before)
        else:
            problems.append(f"“{raw_before[:20]}” is not a line number; the newest lines are searched.")
    page = None
    raw_page = request.GET.get("page", "").strip()
    if raw_page and raw_page != "last":
        if raw_page.isascii() and raw_page.isdigit() and len(raw_page) <= 9:
            page = int(raw_page)
        else:
            problems.append(f"Page “{raw_page[:20]}” is not a page number; the newest page is shown.")
    return {"q": q, "rank": rank, "metrics": request.GET.get("metrics") == "1", "page": page,
            "before": before if q or rank is not None else None}, problems


@login_required
@require_GET
def job_logs(request: HttpRequest, pk: int) -> HttpResponse:
    """The job's full log, 500 lines a page (the newest page first), with search, a rank filter and,
    for a job logged when records were stored as lines, the trainer's metric records on request."""
    job = _job_for(request, pk)
    filters, problems = _log_filters(request)
    page = selectors.training_job_log_page(job=job, page=filters["page"], q=filters["q"], rank=filters["rank"],
                                           metrics=filters["metrics"], before=filters["before"])
    params = {k: v for k, v in (("q", filters["q"]), ("rank", "" if filters["rank"] is None else str(filters["rank"])),
                                ("metrics", "1" if filters["metrics"] else "")) if v}
    window = {**params, "before": str(filters["before"])} if filters["before"] is not None else params
    return render(request, "webapp/jobs/logs.html", {
        "job": job, "page": page, "filters": filters, "problems": problems,
        "params": urlencode(window), "search_params": urlencode(params),
        "search_window": f"{selectors.LOG_SEARCH_WINDOW:,}",
        # Only a job logged when records were stored as lines has any to show or hide.
        "has_metric_lines": filters["metrics"] or selectors.training_job_has_metric_lines(job=job),
        "first_seq": page.lines[0][0] if page.lines else None,
    }, status=400 if problems else 200)


@login_required
@require_GET
def job_logs_download(request: HttpRequest, pk: int) -> StreamingHttpResponse:
    """The job's whole stored log as a text file, streamed (a newer job's metric records are its
    metric points, not lines: docs/experiments.md)."""
    job = _job_for(request, pk)
    response = StreamingHttpResponse(selectors.training_job_log_text(job=job), content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="job-{job.pk}-log.txt"'
    return response
