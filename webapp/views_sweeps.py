"""The sweep pages (docs/sweeps.md): the list ``/sweeps/``, the create form ``/sweeps/new/``, a sweep's
page ``/sweeps/<id>/`` (trials, best trial, progress and spend, a parallel-coordinates plot and a
parameter-importance chart drawn by ``webapp/js/sweep.js`` from a JSON block, no inline script) and
its cancel. Reads through ``jobs.selectors`` (another user's sweep is a 404), writes through
``jobs.sweeps``."""

from __future__ import annotations

import json
import math
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from jobs import selectors, sweeps
from jobs.models import Sweep
from webapp.errors import add_service_errors, service_error_dict
from webapp.forms import team_field

SPACE_PLACEHOLDER = json.dumps(json.loads(sweeps.SPACE_EXAMPLE), indent=2)


class SweepForm(forms.Form):
    """The create form: the base job's main fields, the search space as JSON, the sampler, the
    objective and the limits. Every value is checked by ``jobs.sweeps.sweep_create``."""

    name = forms.CharField(max_length=200)
    dataset = forms.ModelChoiceField(queryset=None)
    model_spec = forms.ModelChoiceField(queryset=None, label="Model")
    backend = forms.ModelChoiceField(queryset=None)
    nodes = forms.IntegerField(initial=1, min_value=1)
    procs_per_node = forms.IntegerField(initial=1, min_value=1, label="Processes per node")
    epochs = forms.IntegerField(initial=2, min_value=1)
    batch_size = forms.IntegerField(initial=32, min_value=1)
    lr = forms.FloatField(initial=0.05, label="Learning rate", help_text="Unless the search space sets train.lr.")
    max_runtime_s = forms.IntegerField(initial=3600, min_value=1, label="Max runtime per trial (s)")
    hyperparameters = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}),
                                      help_text='Trainer config overrides for every trial, e.g. {"train": {"optimizer": "adamw"}}.')
    search_space = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 8, "placeholder": SPACE_PLACEHOLDER}),
        help_text="Dotted config keys → distributions: float (low, high, log), int (low, high, step), "
                  "categorical (choices). Example: " + sweeps.SPACE_EXAMPLE)
    sampler = forms.ChoiceField(choices=Sweep.Sampler.choices, initial=Sweep.Sampler.TPE)
    seed = forms.IntegerField(initial=0, min_value=0, help_text="The same seed asks the same trials.")
    objective_metric = forms.CharField(initial="val_accuracy", max_length=100,
                                       help_text="Any metric the trials report, e.g. val_accuracy or val_loss.")
    direction = forms.ChoiceField(choices=Sweep.Direction.choices, initial=Sweep.Direction.MAXIMIZE)
    objective = forms.ChoiceField(choices=Sweep.Objective.choices, initial=Sweep.Objective.FINAL,
                                  label="Score a trial by")
    max_trials = forms.IntegerField(initial=10, min_value=1)
    max_concurrent_trials = forms.IntegerField(initial=2, min_value=1)
    budget_usd = forms.DecimalField(required=False, min_value=0, max_digits=12, decimal_places=2,
                                    label="Budget for the whole sweep (USD)", help_text="Blank = no limit.")
    pruner = forms.ChoiceField(choices=Sweep.Pruner.choices, initial=Sweep.Pruner.NONE)
    pruner_startup_trials = forms.IntegerField(initial=1, min_value=0, label="Pruner start-up trials",
                                               help_text="Median: completed trials before any is pruned.")
    pruner_warmup_epochs = forms.IntegerField(initial=0, min_value=0, label="Pruner warm-up epochs")

    BASE_FIELDS = ("dataset", "model_spec", "backend", "nodes", "procs_per_node", "epochs", "batch_size", "lr",
                   "max_runtime_s", "hyperparameters")

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        # As on the job form and in POST /api/sweeps/: the sweep and its trial jobs may be a team's.
        self.fields["team"] = team_field(user, empty_label="— none —", help_text=(
            "Optional: run the sweep for a team you belong to. Its trial jobs count toward the team's monthly "
            "budget, and its members see the sweep and its trials."))
        self.fields["dataset"].queryset = selectors.dataset_list_for_user(user=user)
        self.fields["model_spec"].queryset = selectors.model_spec_list_for_user(user=user)
        self.fields["backend"].queryset = selectors.backend_list_for_user(user=user)

    def service_arguments(self) -> dict[str, Any]:
        data = self.cleaned_data
        base = {k: data.get(k) for k in self.BASE_FIELDS}
        for key in ("dataset", "model_spec", "backend"):
            base[key] = base[key].pk if base[key] is not None else None
        base["hyperparameters"] = base["hyperparameters"] or {}
        base = {k: v for k, v in base.items() if v is not None}
        budget = data.get("budget_usd")
        return dict(name=data.get("name", ""), team=data.get("team"), base=base,
                    search_space=data.get("search_space", ""),
                    sampler=data.get("sampler", ""), seed=data.get("seed", 0), objective_metric=data.get("objective_metric", ""),
                    direction=data.get("direction", ""), objective=data.get("objective", ""),
                    max_trials=data.get("max_trials", 1), max_concurrent_trials=data.get("max_concurrent_trials", 1),
                    budget_usd=None if budget is None else str(budget), pruner=data.get("pruner", ""),
                    pruner_startup_trials=data.get("pruner_startup_trials", 0),
                    pruner_warmup_epochs=data.get("pruner_warmup_epochs", 0))


def _sweep_for(request: HttpRequest, pk: int) -> Sweep:
    return get_object_or_404(selectors.sweep_list_for_user(user=request.user), pk=pk)


@login_required
def sweep_list(request: HttpRequest) -> HttpResponse:
    rows = list(selectors.sweep_list_for_user(user=request.user)[:200])
    return render(request, "webapp/sweeps/list.html", {"sweeps": rows, "unavailable": sweeps.sweeps_unavailable()})


@login_required
@require_http_methods(["GET", "POST"])
def sweep_create(request: HttpRequest) -> HttpResponse:
    """The create form; where sweeps cannot run (the embedded SQLite database), the page says why
    instead, before anyone fills in the form (a POST gets the same page)."""
    if (unavailable := sweeps.sweeps_unavailable()) is not None:
        return render(request, "webapp/sweeps/form.html", {"unavailable": unavailable},
                      status=400 if request.method == "POST" else 200)
    form = SweepForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        try:
            sweep = sweeps.sweep_create(owner=request.user, **form.service_arguments())
        except ValidationError as exc:
            add_service_errors(form, exc, field_map={f"base.{k}": k for k in SweepForm.BASE_FIELDS})
        else:
            messages.success(request, f"Sweep {sweep.name} started.")
            return redirect("sweep-detail", pk=sweep.pk)
    return render(request, "webapp/sweeps/form.html", {"form": form, "space_example": SPACE_PLACEHOLDER})


def _parallel_coordinates(sweep: Sweep, trials: list[dict[str, Any]]) -> dict[str, Any]:
    """The plot's data: one axis per parameter and the objective, each trial's values scaled to 0..1
    on every axis (a categorical's choices spread evenly; a log range on a log scale), with each
    axis' labels at 0 and 1."""
    axes = []
    for key, spec in sweep.search_space.items():
        if spec["type"] == "categorical":
            choices = spec["choices"]
            axes.append({"name": key, "kind": "categorical", "ticks": [str(c) for c in choices]})
        else:
            axes.append({"name": key, "kind": spec["type"], "low": spec["low"], "high": spec["high"],
                         "log": bool(spec.get("log"))})
    scored = [t["value"] for t in trials if t["value"] is not None]
    objective = {"name": sweep.objective_metric, "kind": "float",
                 "low": min(scored) if scored else 0.0, "high": max(scored) if scored else 1.0, "log": False}

    def scale(axis, value):
        if value is None:
            return None
        if axis["kind"] == "categorical":
            ticks = axis["ticks"]
            return ticks.index(str(value)) / max(len(ticks) - 1, 1) if str(value) in ticks else None
        low, high = axis["low"], axis["high"]
        if axis["log"] and low > 0 and value > 0:
            low, high, value = math.log(low), math.log(high), math.log(value)
        return 0.5 if high == low else (value - low) / (high - low)

    lines = []
    for t in trials:
        if t["state"] not in ("COMPLETE", "PRUNED"):
            continue
        points = [scale(a, t["params"].get(a["name"])) for a in axes] + [scale(objective, t["value"])]
        lines.append({"trial": t["number"], "state": t["state"], "value": t["value"], "points": points})
    for axis in axes + [objective]:
        if axis["kind"] != "categorical":
            axis["ticks"] = [f"{axis['low']:.3g}", f"{axis['high']:.3g}"]
    return {"axes": [a["name"] for a in axes] + [objective["name"]], "ticks": [a["ticks"] for a in axes + [objective]],
            "lines": lines}


@login_required
def sweep_detail(request: HttpRequest, pk: int) -> HttpResponse:
    sweep = _sweep_for(request, pk)
    trials = sweeps.sweep_trials(sweep=sweep)
    best = sweeps.best_trial(sweep, trials)
    importances = sweeps.param_importances(sweep=sweep)
    chart = {"parallel": _parallel_coordinates(sweep, trials),
             "importance": [{"name": k, "value": v} for k, v in importances.items()]}
    return render(request, "webapp/sweeps/detail.html", {
        "sweep": sweep, "trials": trials, "best": best, "importances": importances,
        "progress": sweeps.sweep_progress(sweep=sweep, trials=trials), "params": list(sweep.search_space),
        "chart": chart, "can_change": selectors.can_change(user=request.user, obj=sweep),
    })


@login_required
@require_POST
def sweep_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    sweep = _sweep_for(request, pk)
    if not selectors.can_change(user=request.user, obj=sweep):
        raise PermissionDenied("Only the owner (or staff) can change this; it is shared with you to see and use.")
    try:
        sweeps.sweep_cancel(sweep=sweep)
    except ValidationError as exc:
        for message in (m for ms in service_error_dict(exc).values() for m in ms):
            messages.error(request, message)
    else:
        messages.info(request, f"Sweep {sweep.name} cancelled: no new trials; its running trials are stopping.")
    return redirect("sweep-detail", pk=pk)
