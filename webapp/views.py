"""The browser UI. Views read through ``jobs.selectors`` (scoped to the user: another user's object is
a 404) and write only through ``jobs.services``; a service's ValidationError is shown on the form.

The job page polls ``job_live`` (an htmx fragment) every 2 s while the job is active; the charts sit
outside that fragment and are updated in place from ``job_metrics`` (see static/webapp/js/job.js).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from cloud_adapters.base import ConnectionCheck
from jobs import code_archives, comparison, job_table, metric_retention, pagination, selectors, services
from jobs import progress as job_progress
from jobs.adapters import backend_declaration, backend_isolation
from jobs.models import JobStateChoices, ModelSpec, TrainingJob
from trainer_pkg.metrics import GLOBAL_METRICS
from trainer_pkg.registry import ARCHITECTURES
from webapp import views_clone
from webapp import views_experiments
from webapp.errors import add_service_errors, service_error_dict, submit_form
from webapp.forms import BackendForm, DatasetForm, JobListFilterForm, ModelSpecForm, TrainingJobForm

JOBS_PER_PAGE = 25
BACKEND_JOBS_PER_PAGE = 25
"""Running jobs, and waiting jobs, per page of the backend page."""
LOG_TAIL_LINES = 200

# Chart series drawn on the job page: chart id -> the metric names of its lines, in order.
CHART_SERIES = {
    "loss": ("train_loss", "val_loss"),
    "accuracy": ("train_accuracy", "val_accuracy"),
}
# Fields of our trainer's own that get a chart of their own when a job reports them (a language model's).
OWN_METRIC_CHARTS = ("val_perplexity",)
# Beyond those, one chart per other metric name a job reported (a user script's report.log), titled
# by the name; at most this many, in name order, so a script inventing names cannot flood the page.
MAX_METRIC_CHARTS = 50


def _values(form) -> dict[str, Any]:
    """The form's values for a service call: every field's cleaned value, "" for one that did not
    clean (the form shows its error; the service's own error for it is dropped, ``submit_form``)."""
    return {name: form.cleaned_data.get(name, "") for name in form.fields}


def _changeable(request: HttpRequest, obj):
    """``obj`` when the user may change it (owner or staff); a teammate who only sees it gets 403."""
    if not selectors.can_change(user=request.user, obj=obj):
        raise PermissionDenied("Only the owner (or staff) can change this; it is shared with you to see and use.")
    return obj


# --- health ----------------------------------------------------------------------------------


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """200 ``{"db": "ok"}`` when the database answers; 503 with the error otherwise."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # any database failure is the answer, not a crash
        return JsonResponse({"db": f"error: {exc.__class__.__name__}"}, status=503)
    return JsonResponse({"db": "ok"})


# --- datasets --------------------------------------------------------------------------------


def _read(dataset) -> str:
    """": <summary>" for the save message, or what was not read (a cloud URI is not opened here)."""
    if dataset.summary:
        return f": {dataset.summary}"
    return "; its data was not read here (a cloud URI is read by the job)" if dataset.uri else ""


@login_required
def dataset_list(request: HttpRequest) -> HttpResponse:
    datasets = selectors.dataset_list_for_user(user=request.user)
    return render(request, "webapp/datasets/list.html", {"datasets": datasets})


@login_required
@require_http_methods(["GET", "POST"])
def dataset_create(request: HttpRequest) -> HttpResponse:
    form = DatasetForm(request.POST or None, user=request.user)
    if request.method == "POST":
        dataset = submit_form(form, lambda: services.dataset_create(owner=request.user, **_values(form)))
        if dataset is not None:
            messages.success(request, f"Dataset {dataset.name} created{_read(dataset)}.")
            return redirect("dataset-list")
    return render(request, "webapp/datasets/form.html", {"form": form, "dataset": None})


@login_required
@require_http_methods(["GET", "POST"])
def dataset_edit(request: HttpRequest, pk: int) -> HttpResponse:
    dataset = _changeable(request, get_object_or_404(selectors.dataset_list_for_user(user=request.user), pk=pk))
    initial = {f: getattr(dataset, f) for f in DatasetForm.base_fields}
    form = DatasetForm(request.POST or None, initial=initial, user=request.user)
    if request.method == "POST":
        if (saved := submit_form(form, lambda: services.dataset_update(dataset=dataset, **_values(form)))) is not None:
            messages.success(request, f"Dataset {saved.name} saved{_read(saved)}.")
            return redirect("dataset-list")
    return render(request, "webapp/datasets/form.html", {"form": form, "dataset": dataset})


# --- models ----------------------------------------------------------------------------------


def _architectures() -> list[dict[str, Any]]:
    """The registry as the model form's help panel shows it."""
    return [
        {
            "name": name,
            "description": spec.description,
            "params": [
                {"name": p.name, "type": p.type.__name__, "default": p.default,
                 "min": p.min, "max": p.max, "doc": p.doc}
                for p in spec.params
            ],
            "defaults": spec.defaults(),
        }
        for name, spec in ARCHITECTURES.items()
    ]


def _model_form_page(request: HttpRequest, form: ModelSpecForm, model_spec, status: int = 200) -> HttpResponse:
    return render(request, "webapp/models/form.html",
                  {"form": form, "model_spec": model_spec, "architectures": _architectures()}, status=status)


def _submit_model_form(request: HttpRequest, form: ModelSpecForm, call) -> Any:
    """``submit_form`` for the model form: the service's errors on ``code`` go to the directory field
    when the code came from there."""
    def add_errors(form: ModelSpecForm, exc: ValidationError) -> None:
        add_service_errors(form, exc, {"code": "code_dir"} if form.uses_code_dir() else None)

    if form.is_valid():
        return submit_form(form, lambda: call(**form.service_values()), add_errors)
    with code_archives.files_not_written():  # the service runs only for its errors, then rolls back
        return submit_form(form, lambda: call(**form.service_values()), add_errors)


def _oversized_model_post(request: HttpRequest, initial: dict[str, Any], model_spec) -> HttpResponse | None:
    """The form again, with why, for a POST too large to be an archive (refused before its body is read)."""
    problem = request.method == "POST" and code_archives.request_too_large(request.META.get("CONTENT_LENGTH"))
    if not problem:
        return None
    messages.error(request, problem)
    return _model_form_page(request, ModelSpecForm(initial=initial, user=request.user), model_spec, status=400)


@login_required
def model_list(request: HttpRequest) -> HttpResponse:
    models = selectors.model_spec_list_for_user(user=request.user).select_related("code")
    return render(request, "webapp/models/list.html", {"models": models})


@login_required
@require_http_methods(["GET", "POST"])
def model_create(request: HttpRequest) -> HttpResponse:
    initial = {"kind": ModelSpec.Kind.BUILTIN, "architecture": "cnn",
               "params": json.dumps(ARCHITECTURES["cnn"].defaults(), indent=2)}
    if (refused := _oversized_model_post(request, initial, None)) is not None:
        return refused
    form = ModelSpecForm(request.POST or None, request.FILES or None, initial=initial, user=request.user)
    if request.method == "POST":
        model_spec = _submit_model_form(request, form, lambda **values: services.model_spec_create(
            owner=request.user, **values))
        if model_spec is not None:
            messages.success(request, f"Model {model_spec.name} created.")
            return redirect("model-list")
    return _model_form_page(request, form, None)


@login_required
@require_http_methods(["GET", "POST"])
def model_edit(request: HttpRequest, pk: int) -> HttpResponse:
    model_spec = _changeable(request, get_object_or_404(
        selectors.model_spec_list_for_user(user=request.user).select_related("code"), pk=pk))
    builtin = model_spec.kind == ModelSpec.Kind.BUILTIN
    initial = {
        "name": model_spec.name, "description": model_spec.description, "kind": model_spec.kind,
        "architecture": model_spec.architecture if builtin else "cnn",
        "params": json.dumps((model_spec.params if builtin else ARCHITECTURES["cnn"].defaults()) or {}, indent=2),
        "function_params": "" if builtin or not model_spec.params else json.dumps(model_spec.params, indent=2),
        "entry_point": model_spec.entry_point, "shard_classes": ", ".join(model_spec.shard_classes or []),
        "script_args": shlex.join(model_spec.script_args or []), "image": model_spec.image,
        "framework": model_spec.framework,
        "team": model_spec.team_id,
    }
    if (refused := _oversized_model_post(request, initial, model_spec)) is not None:
        return refused
    form = ModelSpecForm(request.POST or None, request.FILES or None, initial=initial, user=request.user)
    if request.method == "POST":
        if _submit_model_form(request, form, lambda **values: services.model_spec_update(
                model_spec=model_spec, **values)) is not None:
            messages.success(request, f"Model {form.cleaned_data['name']} saved.")
            return redirect("model-list")
    return _model_form_page(request, form, model_spec)


# --- backends --------------------------------------------------------------------------------

def _add_backend_errors(form: BackendForm, exc: ValidationError) -> None:
    """The service reports each setting's error on ``config.<setting>`` (the adapter's
    ``clean_config`` keys its problems by setting); a setting the chosen kind has a field for gets
    the message there, the rest (and errors on ``config`` as a whole) go on the JSON field; a
    "<key>: message" on ``secrets`` goes on that secret's input."""
    errors = service_error_dict(exc)
    kind = form.chosen_kind()
    for key in [k for k in errors if k == "config" or k.startswith("config.")]:
        setting = key.removeprefix("config").removeprefix(".")
        for message in errors.pop(key):
            form.add_error((form.setting_field(kind, setting) if setting else None) or "extra_config", message)
    for message in errors.pop("state_deadlines", []):
        form.add_error(form.deadline_field(message), message)
    for message in errors.pop("secrets", []):
        # "<secret key>: message" lands on that key's input; one naming no key goes to the form's top.
        form.add_error(form.secret_field(kind, message.split(":", 1)[0].strip()), message)
    if errors:
        add_service_errors(form, ValidationError(errors))


def _backend_form_page(request: HttpRequest, form: BackendForm, backend, checks=None) -> HttpResponse:
    return render(request, "webapp/backends/form.html", {"form": form, "backend": backend, "checks": checks})


@login_required
def backend_list(request: HttpRequest) -> HttpResponse:
    backends = selectors.backend_list_for_user(user=request.user)
    return render(request, "webapp/backends/list.html", {"backends": backends})


@login_required
@require_GET
def backend_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One backend: its kind, settings and Celery queue, its running jobs with the GPUs each holds,
    and its waiting jobs in the order they will start, each with why it waits (``wait_reason``).
    Both lists are paged (``?running=N``, ``?waiting=N``; a bad number shows the nearest page)."""
    backend = get_object_or_404(selectors.backend_list_for_user(user=request.user), pk=pk)
    queue = selectors.backend_queue_for_user(user=request.user, backend=backend)
    related = ("dataset", "model_spec", "owner")
    running = Paginator(queue.running.select_related(*related), BACKEND_JOBS_PER_PAGE).get_page(request.GET.get("running"))
    waiting = Paginator(queue.waiting.select_related(*related), BACKEND_JOBS_PER_PAGE).get_page(request.GET.get("waiting"))
    # Each waiting job's place in line: its index among all waiting jobs the user sees, from page 1.
    first_place = waiting.start_index() if waiting.paginator.count else 1
    held_by_job = {use.job_id: use.devices for use in queue.devices_in_use if use.job_id is not None}
    return render(request, "webapp/backends/detail.html", {
        "backend": backend,
        "kind_label": backend_declaration(backend.kind).backend_label,
        "isolation": backend_isolation(backend),
        "queue": queue,
        "running": running,
        "running_rows": [(job, held_by_job.get(job.pk, ())) for job in running.object_list],
        "waiting": waiting,
        "waiting_rows": [(first_place + i, job) for i, job in enumerate(waiting.object_list)],
        "query_running": request.GET.get("running", ""),
        "query_waiting": request.GET.get("waiting", ""),
    })


@login_required
@require_http_methods(["GET", "POST"])
def backend_create(request: HttpRequest) -> HttpResponse:
    form = BackendForm(request.POST or None, initial={"kind": "gpubox", "hourly_rate_usd": 0, "enabled": True},
                       user=request.user)
    if request.method == "POST":
        backend = submit_form(form, lambda: services.backend_create(
            owner=request.user, name=form.cleaned_data.get("name", ""), kind=form.chosen_kind(),
            config=form.config(), enabled=form.cleaned_data.get("enabled", True), secrets=form.secrets(),
            team=form.cleaned_data.get("team"), job_secrets=form.cleaned_data.get("job_secrets", ""),
            **form.policy_kwargs(),
        ), _add_backend_errors)
        if backend is not None:
            messages.success(request, f"Backend {backend.name} created.")
            return redirect("backend-list")
    return _backend_form_page(request, form, None)


@login_required
@require_http_methods(["GET", "POST"])
def backend_edit(request: HttpRequest, pk: int) -> HttpResponse:
    backend = _changeable(request, get_object_or_404(selectors.backend_list_for_user(user=request.user), pk=pk))
    form = BackendForm(request.POST or None, initial=BackendForm.initial_from(backend), user=request.user,
                       backend=backend)
    if request.method == "POST":
        saved = submit_form(form, lambda: services.backend_update(
            backend=backend, name=form.cleaned_data.get("name", ""), kind=form.chosen_kind(),
            config=form.config(), enabled=form.cleaned_data.get("enabled", True), secrets=form.secrets(),
            clear_secrets=form.cleaned_data.get("clear_secrets", False), team=form.cleaned_data.get("team"),
            job_secrets=form.cleaned_data.get("job_secrets", ""),
            clear_job_secrets=form.cleaned_data.get("clear_job_secrets", False), **form.policy_kwargs(),
        ), _add_backend_errors)
        if saved is not None:
            messages.success(request, f"Backend {form.cleaned_data['name']} saved.")
            return redirect("backend-list")
    saved = request.session.pop(_checks_key(pk), None) if request.method == "GET" else None
    checks = [ConnectionCheck(**check) for check in saved] if saved is not None else None
    return _backend_form_page(request, form, backend, checks)


@login_required
@require_POST
def backend_test_connection(request: HttpRequest, pk: int) -> HttpResponse:
    """Run the backend's connection checks with its saved settings. htmx: the results fragment;
    otherwise a redirect to the edit page, which shows the results above the form (once)."""
    backend = _changeable(request, get_object_or_404(selectors.backend_list_for_user(user=request.user), pk=pk))
    try:
        checks = services.backend_test_connection(backend=backend, user=request.user)
    except ValidationError as exc:
        checks = [ConnectionCheck("permission", False, m) for ms in service_error_dict(exc).values() for m in ms]
    if request.htmx:
        return render(request, "webapp/backends/_connection.html", {"backend": backend, "checks": checks})
    # Redirect after POST (the Backends list's button): the browser lands on the edit page, which
    # shows these results once, and a reload there does not run the test again.
    request.session[_checks_key(pk)] = [dataclasses.asdict(check) for check in checks]
    return redirect("backend-edit", pk=pk)


def _checks_key(pk: int) -> str:
    return f"backend-connection-checks-{pk}"


# --- jobs ------------------------------------------------------------------------------------


@login_required
@require_GET
def job_list(request: HttpRequest) -> HttpResponse:
    user = request.user
    # One query for the filter's options, reused to resolve ?backend= (no second query for it).
    backends = list(selectors.backend_list_for_user(user=user))
    # A bad ?state=, ?backend=, ?tag=, ?sort= or ?columns= is named on the page (400), not silently
    # dropped (webapp/forms.py).
    filter_form = JobListFilterForm(request.GET, backends=backends, user=user)
    filters = filter_form.filters()
    state, backend, q = filters["state"], filters["backend"], filters["q"]
    jobs = selectors.training_job_list_for_user(user=user, state=state, backend=backend, q=q, tag=filters["tag"],
                                                archived=filters["archived"], sort=filters["sort"])
    columns = filters["columns"]
    if columns is None:
        columns, _ = job_table.parse_columns(selectors.job_list_columns_for_user(user=user))
    # Only the columns the table shows: building 25 jobs and their dataset, model and backend is most
    # of the page's database time (no encrypted backend secrets to decrypt; the frozen config only
    # when a hyperparameter column needs it).
    jobs = jobs.select_related("backend", "dataset", "model_spec").only(
        "name", "state", "secondary_state", "raw_state", "stalled_at", "stalled_reason", "hung_at", "idle_at", "idle_reason", "budget_usd", "budget_exceeded_at", "nodes", "procs_per_node", "created_at",
        "submitted_at", "started_at", "ended_at", "cost_usd", "dataset__name", "model_spec__name",
        "backend__name", "final_metrics", "tags", "archived_at", "owner",
        *(["config"] if any(c.kind == "config" for c in columns) else []),
        # what shows the row's figures at the job's own precision, and its progress (no metric point read)
        *TrainingJob.MONEY_FIELDS, *job_progress.READ_FIELDS)
    # Capped count and key-first page fetch: the same queries on page 1 and page 4,000.
    # "Older" / "Newer" links carry the position of the page's last / first row: an index seek at any
    # depth; a deep ?page=N finds its position by the key columns alone. A search counts to 1,000.
    # Sorted by another column, the links carry page numbers (keys-first offset pages).
    paginator = pagination.CappedCountPaginator(
        jobs, JOBS_PER_PAGE, count_cap=pagination.SEARCH_COUNT_CAP if q else None)
    keyset = pagination.newest_first(jobs)
    after, before = request.GET.get("after"), request.GET.get("before")
    if keyset and (after or before):
        page = paginator.keyset_page(request.GET.get("page"), after=after, before=before)
    else:
        page = paginator.get_page(request.GET.get("page"))
    query = request.GET.copy()
    for key in ("page", "after", "before"):
        query.pop(key, None)
    return render(request, "webapp/jobs/list.html", {
        "page": page,
        "jobs": page.object_list,
        "keyset": keyset,
        "states": JobStateChoices.choices,
        "backends": backends,
        "filters": {"state": state or "", "backend": str(backend.pk) if backend else "", "q": q or "",
                    "tag": filters["tag"] or "", "archived": request.GET.get("archived", "").strip()
                    if filters["archived"] is not False else "", "sort": filters["sort"] or ""},
        "query": query.urlencode(),
        "filter_problems": filter_form.problems(),
        **views_experiments.table_context(request, page.object_list, columns, filters),
    }, status=400 if filter_form.problems() else 200)


@login_required
@require_http_methods(["GET", "POST"])
def job_create(request: HttpRequest) -> HttpResponse:
    source, mode = views_clone.clone_source(request)  # ?from=<id>&mode=: a job like another (views_clone)
    initial = views_clone.clone_initial(source, mode) if source is not None and request.method == "GET" else None
    form = TrainingJobForm(request.POST or None, user=request.user, initial=initial)
    if request.method == "POST":
        def job_request() -> dict:
            return dict(owner=request.user, **form.create_kwargs(), **views_clone.clone_kwargs(source, mode))

        # A form with errors of its own is checked (nothing written) so the service's errors join them.
        job = submit_form(form, lambda: services.training_job_create(**job_request()),
                          check=lambda: services.training_job_check(**job_request()))
        if job is not None:
            messages.success(request, f"Job {job} queued.")
            return redirect("job-detail", pk=job.pk)
    estimate = _estimate(form) if request.method == "POST" else None
    return render(request, "webapp/jobs/form.html", {"form": form, "estimate": estimate,
                                                     "clone": views_clone.clone_notice(source, mode),
                                                     "shared_boxes": _shared_boxes(form)})


def _shared_boxes(form: TrainingJobForm) -> list[tuple[str, str]]:
    """``(backend name, sentence)`` of each GPU box the form offers whose jobs run as one shared user
    (docs/gpu-boxes.md "Isolation"): the form says so before a job is sent there."""
    backends = getattr(form.fields.get("backend"), "queryset", None)
    if backends is None:
        return []
    found = []
    for backend in backends.filter(kind="gpubox")[:20]:
        isolation = backend_isolation(backend)
        if isolation is not None and not isolation.isolated:
            found.append((backend.name, isolation.text))
    return found


def _estimate(form: TrainingJobForm) -> dict[str, Any]:
    """``{"ok": True, **estimate}`` or ``{"ok": False, "errors": [...]}`` for the form's shape."""
    kwargs = form.estimate_kwargs()
    if kwargs is None:
        errors = [f"{form.fields[f].label or f}: {e}" for f in form.ESTIMATE_FIELDS for e in form.errors.get(f, [])]
        return {"ok": False, "errors": errors}
    try:
        result = services.training_job_estimate(**kwargs)
    except ValidationError as exc:
        return {"ok": False, "errors": [m for ms in service_error_dict(exc).values() for m in ms]}
    withheld = [str(form.fields[f].label or f) for f in form.plan_withheld]
    return {"ok": True, **result, "max_runtime_s": kwargs["max_runtime_s"], "nodes": kwargs["nodes"],
            "plan_withheld": ", ".join(withheld)}


@login_required
@require_http_methods(["GET", "POST"])
def job_estimate(request: HttpRequest) -> HttpResponse:
    """The cost estimate for the job form's current values (an htmx fragment)."""
    form = TrainingJobForm(request.POST if request.method == "POST" else request.GET, user=request.user)
    return render(request, "webapp/jobs/_estimate.html", {"estimate": _estimate(form)})


def _job_for(request: HttpRequest, pk: int):
    jobs = selectors.training_job_list_for_user(user=request.user)
    return get_object_or_404(jobs.select_related("backend", "dataset", "model_spec", "rerun_of", "code"), pk=pk)


def _live_context(job) -> dict[str, Any]:
    ranks = selectors.training_job_rank_throughput(job=job)
    return {
        "job": job,
        "events": selectors.training_job_events(job=job),
        "interruptions": selectors.training_job_interruption_count(job=job),
        "ranks": ranks,
        "pipeline_ranks": any(r.get("stage") is not None for r in ranks),
        "straggler": selectors.training_job_straggler(job=job, ranks=ranks),
        "bound": selectors.training_job_bound(job=job, ranks=ranks),
        "log_lines": selectors.training_job_log_tail(job=job, lines=LOG_TAIL_LINES),
        "log_tail_lines": LOG_TAIL_LINES,
        "headline": selectors.training_job_headline(job=job),
        "hang": selectors.training_job_hang(job=job),
        "idle": (idle_found := selectors.training_job_idle(job=job)),
        "waste": selectors.training_job_waste(job=job, idle_found=idle_found),
        "preflight": selectors.training_job_preflight(job=job),
    }


SCRIPT_CONFIG_SECTIONS = ("code", "output")
"""What of the frozen config reaches a *my script* job (trainer_pkg/launch.py ``trainboard_env``): its
code (script, arguments) and its output directories; ``data.uri`` as well when the dataset has a path.
The trainer's model, parallel and train sections do not apply to it."""


def _config_shown(job) -> dict[str, Any]:
    """``{"script": bool, "config": dict}``: the job page's config panel, the whole frozen config for
    a job of our trainer, and for a script job only the parts the launcher hands the script."""
    config = job.config if isinstance(job.config, dict) else {}
    if not (isinstance(config.get("code"), dict) and config["code"].get("script")):
        return {"script": False, "config": config}
    shown = {key: config[key] for key in SCRIPT_CONFIG_SECTIONS if key in config}
    uri = (config.get("data") or {}).get("uri") if isinstance(config.get("data"), dict) else ""
    if uri:
        shown["data"] = {"uri": uri}
    return {"script": True, "config": shown}


def _metric_chart_names(job, names) -> list[str]:
    """The metric names that get a chart of their own: every one not drawn in :data:`CHART_SERIES`;
    for a job of our trainer, not its other own fields either (lr, throughput: the rank table's), so
    its page is as before, but for :data:`OWN_METRIC_CHARTS` (a language model's ``val_perplexity``).
    A script's metrics are all its own, whatever their names (``lr`` too)."""
    drawn = {n for series in CHART_SERIES.values() for n in series}
    script = isinstance(job.config, dict) and bool((job.config.get("code") or {}).get("script"))
    own = () if script else [n for n in GLOBAL_METRICS if n not in OWN_METRIC_CHARTS]
    return sorted(n for n in names if n not in drawn and n not in own)[:MAX_METRIC_CHARTS]


def _metrics_payload(job, *, after: int | None = None, widths: list[int] | None = None,
                     attempt: int | None = None, steps: tuple[int, int] | None = None) -> dict[str, Any]:
    """Chart data: ``{"state", "is_terminal", "series": {name: [{"x": step, "y": value, "t": unix s}, ...]},
    "metric_charts": [name, ...], "rank_series": {name: {"<rank>": [points]}}, "rank_stats": {name:
    {"min" | "median" | "max": [points]}}, "rank_lines": bool, "slowest_rank": {name: rank}, "t0": unix s | None,
    "last_step", "attempt", "widths", "from_step", "replace", "totals"}``; ``metric_charts`` lists the names
    charted one chart each (a user script's), and ``series`` holds those and the loss and accuracy
    lines; ``rank_series`` the per-rank metrics the job reported (``jobs.comparison.RANK_METRICS``, a
    chart each, one line per rank); ``t0`` the time of the job's first point, which the charts'
    relative-time axis counts from (docs/comparing-runs.md); ``hardware`` the launcher's CPU, memory, GPU,
    network and disk series by time (:func:`jobs.comparison.training_job_hardware_series`). A poll (``after``, ``widths``,
    ``attempt`` as its page has them) gets only what is new, a zoomed chart (``steps``) its range at
    the resolution the range needs: :func:`jobs.comparison.training_job_chart_series`."""
    charted = comparison.training_job_chart_series(job=job, after=after, widths=widths, attempt=attempt,
                                                   steps=steps)
    series = charted["series"]
    extra = _metric_chart_names(job, charted["names"])
    names = [n for names in CHART_SERIES.values() for n in names] + extra
    return {
        "state": job.state,
        "is_terminal": job.is_terminal,
        "series": {n: series.get(n, []) for n in names},
        "metric_charts": extra,
        "rank_series": charted["rank_series"],
        **{key: charted[key] for key in ("rank_stats", "rank_lines", "slowest_rank", "t0", "last_step", "attempt",
                                         "widths", "from_step", "replace")},
        # Points the page's lines hold in all, per group (global lines sent; per rank): job.js checks
        # that a poll's answer adds up to them, and reads every line again when it does not.
        "totals": [sum(charted["counts"].get(n, 0) for n in set(names)), charted["rank_total"]],
        **({"steps": charted["steps"]} if "steps" in charted else {}),
        # The launcher's samples, by time (a zoom on the step axis has none to read).
        **({} if steps is not None else {"hardware": comparison.training_job_hardware_series(job=job)}),
    }


def _poll_args(query) -> dict[str, Any]:
    """``after``, ``widths`` and ``attempt`` of a chart poll's query (``?after=1200&widths=16,1&attempt=1``),
    or ``steps`` of a zoomed chart's (``?steps=12300,12400``: first and last step, 0 ≤ first ≤ last);
    any missing or malformed one makes it a full read, never an error."""
    if "steps" in query:
        try:
            first, last = (int(v) for v in query.get("steps", "").split(","))
        except ValueError:
            return {}
        return {"steps": (first, last)} if 0 <= first <= last else {}
    try:
        after = int(query.get("after", ""))
        widths = [int(w) for w in query.get("widths", "").split(",")]
        attempt = int(query.get("attempt", ""))
    except ValueError:
        return {}
    return {"after": after, "widths": widths, "attempt": attempt}


@login_required
@require_GET
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    return job_page(request, _job_for(request, pk))


def job_page(request: HttpRequest, job, *, annotate: dict[str, Any] | None = None, status: int = 200) -> HttpResponse:
    """The job page for ``job`` (already scoped to the user). ``annotate``: the tags and notes form
    as the user sent it, ``{"tags", "notes", "errors": [...]}``, shown instead of the job's own when
    saving them was refused (``views_experiments.job_annotate``), with ``status`` 400."""
    context = _live_context(job)
    context["annotate"] = annotate
    context["metrics"] = _metrics_payload(job)
    context["chart_series"] = CHART_SERIES
    context["code"] = selectors.training_job_code(job=job)
    context["memory"] = selectors.training_job_memory(job=job)
    context["price_note"] = selectors.training_job_price_note(job=job)
    context["lineage"] = {**selectors.training_job_lineage(job=job, user=request.user),
                          **views_clone.job_actions(job)}
    context["attempts"] = selectors.training_job_attempts(job=job)
    context["config_shown"] = _config_shown(job)
    context["retention"] = {"days": metric_retention.retention_days(), "until": metric_retention.prune_after(job),
                            "pruned_at": job.metric_points_pruned_at, "bucket_steps": metric_retention.PRUNED_WIDTH}
    return render(request, "webapp/jobs/detail.html", context, status=status)


@never_cache
@login_required
@require_GET
def job_live(request: HttpRequest, pk: int) -> HttpResponse:
    """The job page's live fragment (status, cost, timeline, rank table, log tail)."""
    job = _job_for(request, pk)
    return render(request, "webapp/jobs/_live.html", {**_live_context(job), "oob": True})


@never_cache
@login_required
@require_GET
def job_metrics(request: HttpRequest, pk: int) -> JsonResponse:
    """The chart series as JSON; the job page updates its Chart instances from this, asking only for
    what is new since its last poll (:func:`_poll_args`)."""
    return JsonResponse(_metrics_payload(_job_for(request, pk), **_poll_args(request.GET)))


@login_required
@require_POST
def job_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    job = _changeable(request, _job_for(request, pk))
    try:
        job = services.training_job_cancel(job=job)
    except ValidationError as exc:
        for message in (m for ms in service_error_dict(exc).values() for m in ms):
            messages.error(request, message)
    else:
        messages.info(request, f"Cancelling {job}: the job stops when the backend confirms it.")
    return redirect("job-detail", pk=pk)


@login_required
@require_POST
def job_rerun(request: HttpRequest, pk: int) -> HttpResponse:
    job = _changeable(request, _job_for(request, pk))
    try:
        new_job = services.training_job_rerun(job=job, owner=request.user)
    except ValidationError as exc:
        for message in (m for ms in service_error_dict(exc).values() for m in ms):
            messages.error(request, message)
        return redirect("job-detail", pk=pk)
    messages.success(request, f"Re-run of {job} queued as {new_job}.")
    return redirect(reverse("job-detail", kwargs={"pk": new_job.pk}))
