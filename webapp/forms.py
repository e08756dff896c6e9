"""Browser forms. They check types and shapes a browser can get wrong (a number, valid JSON); every
rule of the domain is the service's, whose ValidationError lands back on these fields
(``webapp.errors.add_service_errors``). Forms never save: views pass ``cleaned_data`` to a service.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any, get_args

from django import forms

from jobs import selectors
from jobs.models import Dataset
from trainer_pkg.config import BuiltinDataset, PipelineSchedule, Strategy
from trainer_pkg.registry import ARCHITECTURES


def _kind_choices() -> list[tuple[str, str]]:
    # Imported when the form renders, so the registry stays the one place that lists providers.
    from cloud_adapters.registry import kind_choices

    return list(kind_choices())


def parse_json_object(text: str, *, example: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object ("" → {}); a ``forms.ValidationError`` saying what is wrong."""
    text = (text or "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise forms.ValidationError(
            f"Not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}). "
            f"Write an object such as {example}."
        ) from None
    if not isinstance(value, dict):
        raise forms.ValidationError(f"Must be a JSON object such as {example}, not {type(value).__name__}.")
    return value


class DatasetForm(forms.Form):
    name = forms.SlugField(max_length=100, help_text="Short name, unique among your datasets, e.g. digits.")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    format = forms.ChoiceField(choices=Dataset.Format.choices, initial=Dataset.Format.BUILTIN)
    builtin_name = forms.ChoiceField(
        required=False, label="Built-in dataset",
        choices=[("", "—")] + [(n, n) for n in get_args(BuiltinDataset)],
        help_text="Only for the built-in format (digits: scikit-learn's 8×8 handwritten digits).",
    )
    uri = forms.CharField(
        required=False, max_length=1000, label="Path or URI",
        help_text="ImageFolder / CSV / NPZ: a local path, or an s3:// gs:// azureml:// URI.",
    )
    label_column = forms.CharField(required=False, max_length=100, initial="label",
                                   help_text="CSV only: the column holding the integer class label.")


class ModelSpecForm(forms.Form):
    PARAMS_EXAMPLE = '{"channels": 32}'

    name = forms.SlugField(max_length=100, help_text="Short name, unique among your models, e.g. digits-cnn.")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    architecture = forms.ChoiceField(
        choices=[(name, f"{name} — {spec.description}") for name, spec in ARCHITECTURES.items()],
        initial="cnn",
    )
    params = forms.CharField(
        required=False, label="Parameters (JSON)",
        widget=forms.Textarea(attrs={"rows": 6, "class": "mono", "spellcheck": "false"}),
        help_text="A JSON object; parameters left out take the defaults listed beside the form.",
    )

    def clean_params(self) -> dict[str, Any]:
        return parse_json_object(self.cleaned_data.get("params", ""), example=self.PARAMS_EXAMPLE)


class BackendForm(forms.Form):
    CONFIG_EXAMPLE = '{"region": "eu-west-1"}'

    name = forms.SlugField(max_length=100, help_text="Short name, unique among your backends, e.g. local.")
    kind = forms.ChoiceField(choices=_kind_choices, help_text="Which adapter runs the jobs.")
    max_procs_per_node = forms.IntegerField(
        required=False, min_value=1, label="Max processes per node",
        help_text="GPU box: the most ranks one job may start on this machine.",
    )
    hourly_rate_usd = forms.DecimalField(
        required=False, min_value=Decimal("0"), max_digits=12, decimal_places=6,
        label="Hourly rate (USD)", help_text="GPU box: what an hour of this machine costs (0 if free).",
    )
    extra_config = forms.CharField(
        required=False, label="Other settings (JSON)",
        widget=forms.Textarea(attrs={"rows": 3, "class": "mono", "spellcheck": "false"}),
        help_text="Provider settings the adapter reads (region, bucket, project…), as a JSON object.",
    )
    enabled = forms.BooleanField(required=False, initial=True)

    # Form fields that are keys of ComputeBackend.config.
    CONFIG_FIELDS = ("max_procs_per_node", "hourly_rate_usd")

    def clean_extra_config(self) -> dict[str, Any]:
        return parse_json_object(self.cleaned_data.get("extra_config", ""), example=self.CONFIG_EXAMPLE)

    def config(self) -> dict[str, Any]:
        """The backend's ``config`` dict from the cleaned fields (JSON-able: the rate as a float)."""
        config = dict(self.cleaned_data.get("extra_config") or {})
        for key in self.CONFIG_FIELDS:
            value = self.cleaned_data.get(key)
            if value is not None:
                config[key] = float(value) if isinstance(value, Decimal) else value
        return config

    @classmethod
    def initial_from(cls, backend) -> dict[str, Any]:
        config = dict(backend.config or {})
        initial = {"name": backend.name, "kind": backend.kind, "enabled": backend.enabled}
        for key in cls.CONFIG_FIELDS:
            if key in config:
                initial[key] = config.pop(key)
        initial["extra_config"] = json.dumps(config, indent=2) if config else ""
        return initial


class TrainingJobForm(forms.Form):
    HYPERPARAMETERS_EXAMPLE = '{"train": {"optimizer": "adamw"}}'

    name = forms.CharField(required=False, max_length=200, help_text="Optional; defaults to job-<id>.")
    dataset = forms.ModelChoiceField(queryset=None, empty_label=None)
    model_spec = forms.ModelChoiceField(queryset=None, empty_label=None, label="Model")
    backend = forms.ModelChoiceField(queryset=None, empty_label=None)
    strategy = forms.ChoiceField(
        choices=[(s, s) for s in get_args(Strategy)], initial="ddp",
        help_text="ddp: every rank holds the model and a shard of the data. fsdp: the same, with parameters, "
                  "gradients and optimizer state sharded across ranks. pipeline: the model's layers split "
                  "into consecutive stages, one per rank.")
    pipeline_stages = forms.IntegerField(
        required=False, min_value=0, initial=0, label="Pipeline stages",
        help_text="Pipeline only: stages per pipeline, dividing the world size; 0 = one per rank.")
    microbatches = forms.IntegerField(
        required=False, min_value=1, initial=4, label="Micro-batches",
        help_text="Pipeline only: the batch size must divide into this many micro-batches.")
    pipeline_schedule = forms.ChoiceField(
        required=False, choices=[(s, s) for s in get_args(PipelineSchedule)], initial="gpipe",
        label="Pipeline schedule", help_text="Pipeline only: gpipe, or 1f1b (needs micro-batches ≥ stages).")
    nodes = forms.IntegerField(min_value=1, initial=1, help_text="Machines.")
    procs_per_node = forms.IntegerField(min_value=1, initial=1, label="Processes per node",
                                        help_text="Ranks per machine; world size = nodes × processes.")
    epochs = forms.IntegerField(min_value=1, initial=3)
    batch_size = forms.IntegerField(min_value=1, initial=32, label="Batch size per process")
    lr = forms.FloatField(initial=0.05, label="Learning rate")
    seed = forms.IntegerField(initial=0, min_value=0)
    max_runtime_s = forms.IntegerField(min_value=1, initial=3600, label="Max runtime (s)",
                                       help_text="The job is stopped after this many seconds.")
    budget_usd = forms.DecimalField(required=False, min_value=Decimal("0"), max_digits=12, decimal_places=4,
                                    label="Budget (USD)", help_text="Optional: stop the job when its cost reaches this.")
    instance_type = forms.CharField(required=False, max_length=100,
                                    help_text="Optional; empty uses the backend's default.")
    spot = forms.BooleanField(required=False, help_text="Interruptible capacity, where the backend offers it.")
    hyperparameters = forms.CharField(
        required=False, label="Hyperparameters (JSON)",
        widget=forms.Textarea(attrs={"rows": 4, "class": "mono", "spellcheck": "false",
                                     "placeholder": HYPERPARAMETERS_EXAMPLE}),
        help_text="Optional overrides of the trainer config, e.g. " + HYPERPARAMETERS_EXAMPLE + ".",
    )

    # The fields the cost estimate reads.
    ESTIMATE_FIELDS = ("backend", "nodes", "procs_per_node", "max_runtime_s", "instance_type", "spot")
    # Read too when given and valid, so the estimate shows the strategy's shape errors.
    SHAPE_FIELDS = ("strategy", "pipeline_stages", "microbatches", "pipeline_schedule", "batch_size", "model_spec")
    PIPELINE_FIELDS = ("pipeline_stages", "microbatches", "pipeline_schedule")

    def __init__(self, *args: Any, user, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["dataset"].queryset = selectors.dataset_list_for_user(user=user)
        self.fields["model_spec"].queryset = selectors.model_spec_list_for_user(user=user)
        self.fields["backend"].queryset = selectors.backend_list_for_user(user=user)

    def clean_hyperparameters(self) -> dict[str, Any]:
        return parse_json_object(self.cleaned_data.get("hyperparameters", ""),
                                 example=self.HYPERPARAMETERS_EXAMPLE)

    def estimate_kwargs(self) -> dict[str, Any] | None:
        """Keyword arguments for ``training_job_estimate`` once the fields it needs are valid."""
        self.is_valid()
        data = self.cleaned_data
        if any(f in self.errors for f in self.ESTIMATE_FIELDS):
            return None
        kwargs = {f: data[f] for f in self.ESTIMATE_FIELDS}
        kwargs.update({f: data[f] for f in self.SHAPE_FIELDS
                       if f not in self.errors and data.get(f) not in (None, "")})
        return kwargs

    def create_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``training_job_create`` (without ``owner``)."""
        data = dict(self.cleaned_data)
        for f in self.PIPELINE_FIELDS:  # empty: the trainer's default
            if data.get(f) in (None, ""):
                data.pop(f, None)
        return data
