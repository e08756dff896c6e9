"""Browser forms. They check types and shapes a browser can get wrong (a number, valid JSON); every
rule of the domain is the service's, whose ValidationError lands back on these fields
(``webapp.errors.add_service_errors``). Forms never save: views pass ``cleaned_data`` to a service.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any, get_args

from django import forms
from django.conf import settings

from cloud_adapters import registry
from cloud_adapters.base import InstanceOffer
from cloud_adapters.settings import Setting
from jobs import job_request, job_table, selectors, services, validation
from jobs.job_request import MAX_RUNTIME_HELP
from jobs.adapters import backend_secret_keys, may_set_host_settings, may_use_worker_credentials
from jobs.cost import format_usd_per_hour
from jobs.deadlines import DEADLINE_STATES
from jobs.models import (DEFAULT_MAX_RESTARTS, FRAMEWORKS, MAX_RESTARTS, ComputeBackend, Dataset, JobStateChoices,
                         ModelSpec, Team, TrainingJob)
from trainer_pkg.config import BuiltinDataset
from trainer_pkg.registry import ARCHITECTURES


def _kind_choices() -> list[tuple[str, str]]:
    # Read when the form renders, so a kind registered after import (a test's) is offered too.
    return list(registry.kind_choices())


def parse_json_object(text: str, *, example: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object ("" → {}) that can be stored (``jobs.validation``: finite
    numbers, no NUL, bounded nesting); a ``forms.ValidationError`` saying what is wrong, one message
    per problem."""
    text = (text or "").strip()
    if not text:
        return {}
    try:
        value = validation.loads(text)
    except validation.JSONInputError as exc:
        bad = exc.decode_error
        raise forms.ValidationError(
            f"Not valid JSON ({bad.msg} at line {bad.lineno}, column {bad.colno}). "
            f"Write an object such as {example}." if bad else str(exc)
        ) from None
    if not isinstance(value, dict):
        raise forms.ValidationError(f"Must be a JSON object such as {example}, not {type(value).__name__}.")
    problems = validation.json_problems(value)
    if problems:
        raise forms.ValidationError(problems)
    return value


def usd_per_hour_label(usd_per_hour: float | Decimal) -> str:
    """``$1.4084/h``, ``$7.09/h``, ``$3.00/h``: the catalog's figure, at least two decimals
    (:func:`jobs.cost.format_usd_per_hour`)."""
    return format_usd_per_hour(usd_per_hour)


def offer_label(offer: InstanceOffer) -> str:
    """``ml.g5.xlarge — $1.4084/h (unconfirmed)`` for the job form's instance type select."""
    return f"{offer.instance_type} — {usd_per_hour_label(offer.usd_per_hour)}" + (
        "" if offer.confirmed else " (unconfirmed)")


SHARE_HELP = "Share with a team you belong to: its members see it and can launch jobs with it."


def team_field(user, *, help_text: str = SHARE_HELP, empty_label: str = "— private —") -> forms.ModelChoiceField:
    """A ``team`` choice limited to the teams ``user`` is a member of (blank = none: private). The
    service checks membership again; a team the user left between render and submit is refused there."""
    return forms.ModelChoiceField(
        queryset=selectors.team_list_for_user(user=user) if user is not None else Team.objects.none(),
        required=False, empty_label=empty_label, help_text=help_text)


class TeamChoiceMixin:
    """Adds the ``team`` choice for the ``user`` keyword (the teams they belong to) to a form whose
    class declares a placeholder ``team`` field (so ``base_fields`` lists it for edit views' initial)."""

    def __init__(self, *args: Any, user=None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["team"] = team_field(user)


class DatasetForm(TeamChoiceMixin, forms.Form):
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
        help_text="ImageFolder / CSV / NPZ: a local path, or an s3:// gs:// azureml:// URI. Token shards: the "
                  "folder holding meta.json (made by manage.py prepare_text).",
    )
    label_column = forms.CharField(required=False, max_length=100, initial="label",
                                   help_text="CSV only: the column holding the integer class label.")
    team = team_field(None)  # replaced per user in __init__


class ModelSpecForm(TeamChoiceMixin, forms.Form):
    """A model: a built-in architecture, or the user's code (an uploaded archive or a directory on the
    server) with its entry point. The fields of the kinds not chosen are not sent to the service, so
    what a hidden section still holds (the architecture's defaults) is not read as the user's."""

    PARAMS_EXAMPLE = '{"channels": 32}'
    FUNCTION_PARAMS_EXAMPLE = '{"width": 256, "depth": 4}'

    name = forms.SlugField(max_length=100, help_text="Short name, unique among your models, e.g. digits-cnn.")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    kind = forms.ChoiceField(
        choices=ModelSpec.Kind.choices, initial=ModelSpec.Kind.BUILTIN, required=False, widget=forms.RadioSelect,
        help_text="Built-in: one of Trainboard's architectures. My model: a function in your code that returns a "
                  "torch.nn.Module, trained by Trainboard's trainer. My script: your own training script, started "
                  "on every rank by Trainboard's launcher.")
    architecture = forms.ChoiceField(
        choices=[(name, f"{name} — {spec.description}") for name, spec in ARCHITECTURES.items()],
        initial="cnn", required=False,
    )
    params = forms.CharField(
        required=False, label="Parameters (JSON)",
        widget=forms.Textarea(attrs={"rows": 6, "class": "mono", "spellcheck": "false"}),
        help_text="A JSON object; parameters left out take the defaults listed beside the form.",
    )
    code = forms.FileField(
        required=False, label="Code archive",
        widget=forms.ClearableFileInput(attrs={"accept": ".zip,.tar.gz,.tgz,application/zip,application/gzip"}),
        help_text="A .zip or .tar.gz of your code (a top-level requirements.txt is installed with it), or a "
                  "directory on the server below: a model of your code or script needs one of them. Editing: "
                  "leave empty to keep the current archive.")
    code_dir = forms.CharField(
        required=False, max_length=4096, label="Or a directory on the server",
        help_text="Instead of uploading: the path of a directory under the installation's code roots.")
    entry_point = forms.CharField(
        required=False, max_length=300, widget=forms.TextInput(attrs={"class": "mono", "spellcheck": "false"}),
        help_text="Required for both kinds. My model: package.module:function, e.g. mymodel.net:build, called "
                  "with num_classes, input_shape and the parameters below. My script: train.py (a file in the "
                  "archive) or -m package.module.")
    function_params = forms.CharField(
        required=False, label="Function parameters (JSON)",
        widget=forms.Textarea(attrs={"rows": 3, "class": "mono", "spellcheck": "false"}),
        help_text=f"Keyword arguments of your function, e.g. {FUNCTION_PARAMS_EXAMPLE}.")
    shard_classes = forms.CharField(
        required=False, label="Shard classes (FSDP)", widget=forms.TextInput(attrs={"class": "mono"}),
        help_text="Class names, comma separated, each sharded with its own fully_shard, e.g. Block; empty = each "
                  "top-level child.")
    script_args = forms.CharField(
        required=False, label="Script arguments",
        widget=forms.Textarea(attrs={"rows": 3, "class": "mono", "spellcheck": "false"}),
        help_text="As you would type them after python train.py, e.g. --epochs 3 --lr {train.lr}: split at spaces "
                  "and line breaks as a shell would (never run by one); quote an argument that holds spaces, "
                  "--title 'my run'. {train.lr}, {train.epochs}, {train.batch_size}, ... become the job's (or a "
                  "sweep trial's) value.")
    framework = forms.ChoiceField(
        choices=[(f, f) for f in FRAMEWORKS], initial="torch", required=False, label="Framework",
        help_text="How the script's processes start: torch (one per rank, torchrun's RANK, WORLD_SIZE...), "
                  "tensorflow (one tf.distribute worker each, with TF_CONFIG), ray (a Ray cluster over the job's "
                  "nodes, your script on node 0) or mpi (started by mpirun). See docs/user-code.md.")
    image = forms.CharField(
        required=False, max_length=500, label="Container image",
        widget=forms.TextInput(attrs={"class": "mono", "spellcheck": "false"}),
        help_text="Optional: an image for this model's jobs (ECR, Artifact Registry or ACR URI); empty = the "
                  "backend's.")
    team = team_field(None)  # replaced per user in __init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        def text(value: Any) -> str:  # a browser sends a textarea's lines with CRLF
            return str(value or "").replace("\r\n", "\n").strip()

        # A code or script model needs both (the fieldset holding them shows only for those kinds): marked
        # "(required)", not "(optional)". Editing such a model, its archive is kept unless one is given.
        self.fields["entry_point"].required_for_kind = True
        self.fields["code"].required_for_kind = self.initial.get("kind") not in (ModelSpec.Kind.CODE,
                                                                                ModelSpec.Kind.SCRIPT)
        if self.is_bound and text(self.data.get("params")) != text(self.initial.get("params")):
            # Shown again after an error: the text is the user's, which static/webapp/js/model_form.js
            # keeps when the architecture changes (it replaces only text the page or it wrote).
            self.fields["params"].widget.attrs["data-edited"] = "true"

    def clean_kind(self) -> str:
        return self.cleaned_data.get("kind") or ModelSpec.Kind.BUILTIN

    def clean_params(self) -> dict[str, Any]:
        return parse_json_object(self.cleaned_data.get("params", ""), example=self.PARAMS_EXAMPLE)

    def clean_function_params(self) -> dict[str, Any]:
        return parse_json_object(self.cleaned_data.get("function_params", ""), example=self.FUNCTION_PARAMS_EXAMPLE)

    def clean_shard_classes(self) -> list[str]:
        return [name.strip() for name in (self.cleaned_data.get("shard_classes") or "").split(",") if name.strip()]

    def clean_script_args(self) -> str:
        # The text as typed: the service splits it as a shell would (services.split_script_args), its
        # error (an unclosed quote) landing on this field.
        return (self.cleaned_data.get("script_args") or "").replace("\r\n", "\n")

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("code") and (data.get("code_dir") or "").strip():
            self.add_error("code_dir", "Give the code one way: upload an archive or name a directory, not both.")
        return data

    def uses_code_dir(self) -> bool:
        """Whether the code comes from the directory field (its errors then go there)."""
        return not self.cleaned_data.get("code") and bool((self.cleaned_data.get("code_dir") or "").strip())

    def service_values(self) -> dict[str, Any]:
        """The keyword arguments of ``model_spec_create``/``model_spec_update``: the chosen kind's
        fields only ("" for one that did not clean: the form shows its error)."""
        data = self.cleaned_data
        kind = data.get("kind") or ModelSpec.Kind.BUILTIN
        values: dict[str, Any] = {name: data.get(name, "") for name in ("name", "description", "team", "image")}
        values["kind"] = kind
        if kind == ModelSpec.Kind.BUILTIN:
            return {**values, "architecture": data.get("architecture", ""), "params": data.get("params", "")}
        code = data.get("code") or (data.get("code_dir") or "").strip() or None
        values.update(entry_point=data.get("entry_point", ""), **({"code": code} if code is not None else {}))
        if kind == ModelSpec.Kind.CODE:
            values.update(params=data.get("function_params", ""), shard_classes=data.get("shard_classes", []),
                          script_args=[], framework="torch")
        else:
            values.update(params={}, script_args=data.get("script_args", []), shard_classes=[],
                          framework=data.get("framework") or "torch")
        return values


def setting_form_field(setting: Setting) -> forms.Field:
    """The backend form's input for one adapter setting (``Backend.settings``): a select for choices,
    a checkbox, a whole number, a decimal (stored as a float) or text, labelled as the adapter's
    messages name it. Never required by the form: only the chosen kind's settings are read, and the
    adapter decides (``clean_config``, through ``jobs.services``), its message landing on this input;
    a required setting carries ``required_for_kind`` so the template marks it "(required)" rather
    than "(optional)"."""
    common = {"required": False, "label": setting.label, "help_text": setting.help}
    field: forms.Field
    if setting.choices:
        field = forms.ChoiceField(choices=list(setting.choices), **common)
    elif setting.type is bool:
        field = forms.BooleanField(**common)
    elif setting.type is int:
        field = forms.IntegerField(min_value=setting.min_value, max_value=setting.max_value, **common)
    elif setting.type is float:
        # A decimal of at most 6 places and 12 digits (a rate in USD, a number of seconds); config()
        # stores it as a float, the type the adapter checks.
        field = forms.DecimalField(
            min_value=None if setting.min_value is None else Decimal(str(setting.min_value)),
            max_value=None if setting.max_value is None else Decimal(str(setting.max_value)),
            max_digits=12, decimal_places=6, **common)
    else:
        field = forms.CharField(max_length=setting.max_length, **common)
    field.required_for_kind = setting.required
    return field


def _registered_kind_settings() -> dict[str, dict[str, str]]:
    """``{kind: {form field name: config key}}`` for the registered kinds' settings that have an input
    (``Setting.field``). A key two kinds share becomes ``<kind>_<key>`` so each kind keeps its own field."""
    keys = {kind: [s.key for s in schema.fields] for kind, schema in registry.registered_settings().items()}
    counts: dict[str, int] = {}
    for kind_keys in keys.values():
        for key in kind_keys:
            counts[key] = counts.get(key, 0) + 1
    return {kind: {(key if counts[key] == 1 else f"{kind}_{key}"): key for key in kind_keys}
            for kind, kind_keys in keys.items() if kind_keys}


def _secret_field_name(kind: str, key: str) -> str:
    return f"secret_{kind}_{key}"


def _deadline_field_name(state: str) -> str:
    return f"deadline_{state}"


def _deadline_fields() -> dict[str, forms.Field]:
    """One optional seconds input per non-terminal state; the placeholder shows the default
    (``settings.TRAINBOARD_STATE_DEADLINES_S``; RUNNING: the job's max runtime + the margin)."""
    fields = {}
    for state in DEADLINE_STATES:
        if state == "RUNNING":
            default = f"max runtime + {settings.TRAINBOARD_RUNNING_DEADLINE_MARGIN_S:g} s"
        else:
            seconds = settings.TRAINBOARD_STATE_DEADLINES_S.get(state)
            default = f"{seconds:g} s" if seconds else "none"
        # No min_value: the service's own message ("PENDING: the deadline must be a positive number
        # of seconds") lands on this field, the same words the API gives.
        fields[_deadline_field_name(state)] = forms.FloatField(
            required=False, label=f"{state.capitalize()} (s)",
            widget=forms.NumberInput(attrs={"placeholder": f"default: {default}", "min": "1", "step": "any",
                                            "class": "deadline"}),
            help_text=f"Seconds a job may stay {state} before it is flagged stalled; blank = default ({default}).")
    return fields


class WriteOnlyTextarea(forms.Textarea):
    """A textarea that never renders a value, not even the one just posted: what is typed in it is
    secret (a backend's job secrets), so a form shown again with errors asks for it again."""

    def format_value(self, value: Any) -> None:
        return None


class BackendForm(forms.Form):
    """A backend's name, kind, the chosen kind's settings and, for clouds, its stored credentials.

    Each registered kind's settings and credentials come from its adapter's declaration
    (``Backend.settings``), one fieldset per kind. Every fieldset is rendered (server-side;
    static/webapp/js/backend_form.js hides the other kinds') and only the chosen kind's are read and
    validated, so the form works without JavaScript. Settings without an input of their own go in
    the JSON field.

    Credentials are write-only: the password inputs never render a stored value; blank keeps what is
    stored; "Clear stored credentials" removes them (the worker's own identity is used then).
    """

    CONFIG_EXAMPLE = '{"region": "eu-west-1"}'

    name = forms.SlugField(max_length=100, help_text="Short name, unique among your backends, e.g. local.")
    kind = forms.ChoiceField(choices=_kind_choices, help_text="Which adapter runs the jobs.")
    extra_config = forms.CharField(
        required=False, label="Other settings (JSON)",
        widget=forms.Textarea(attrs={"rows": 3, "class": "mono", "spellcheck": "false"}),
        help_text="Settings the adapter reads that have no field above, as a JSON object.",
    )
    enabled = forms.BooleanField(required=False, initial=True)

    def __init__(self, *args: Any, user=None, backend=None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        schemas = registry.registered_settings()
        self.kind_settings = _registered_kind_settings()
        fields = dict(self.fields)
        self.fields = {name: fields[name] for name in ("name", "kind")}
        stored = set((backend.secrets or {}).keys()) if backend is not None else set()
        stored_kind = backend.kind if backend is not None else ""
        self.secret_fields: dict[str, dict[str, str]] = {}
        # Host settings (what runs on the box, where, how many processes) are its operator's: only a
        # staff user's backend carries them. For anyone else the input is shown disabled, so the
        # browser sends nothing; a value sent anyway reaches the service, which refuses it on this field.
        owner = backend.owner if backend is not None else user
        staff_owned = may_set_host_settings(owner)
        unset_help = ("Not set. Optional: leave all blank to use the worker's own identity."
                      if may_use_worker_credentials(owner) else
                      "Not set. Required: only a backend owned by staff may use the worker's own identity.")
        for kind, schema in schemas.items():
            for name, key in self.kind_settings.get(kind, {}).items():
                setting = schema[key]
                field = setting_form_field(setting)
                field.widget.attrs["data-kind"] = kind
                if setting.host and not staff_owned:
                    field.widget.attrs["disabled"] = "disabled"
                    field.help_text = f"{field.help_text} Set by the box's operator (only staff backends set it here)."
                self.fields[name] = field
            for secret in schema.secrets:
                name = _secret_field_name(kind, secret.key)
                is_set = kind == stored_kind and secret.key in stored
                widget = (forms.Textarea(attrs={"rows": 3, "class": "mono", "autocomplete": "off"})
                          if secret.multiline else forms.PasswordInput(render_value=False,
                                                                       attrs={"autocomplete": "new-password"}))
                widget.attrs["data-kind"] = kind
                self.fields[name] = forms.CharField(
                    required=False, strip=True, max_length=20_000, label=secret.label, widget=widget,
                    help_text=("Stored (encrypted); leave blank to keep it." if is_set else
                               unset_help))
                self.secret_fields.setdefault(kind, {})[name] = secret.key
        self.fields.update({name: fields[name] for name in ("extra_config", "enabled")})
        self.fields["clear_secrets"] = forms.BooleanField(
            required=False, label="Clear stored credentials",
            help_text="Remove every stored credential of this backend; jobs then use the worker's own identity"
                      + ("." if may_use_worker_credentials(owner) else
                         ", which only a backend owned by staff may (so a cloud backend of yours is refused)."))
        stored_job_secrets = sorted((backend.job_secrets or {}).keys()) if backend is not None else []
        self.fields["job_secrets"] = forms.CharField(
            required=False, strip=True, max_length=300_000, label="Job secrets",
            widget=WriteOnlyTextarea(attrs={"rows": 3, "class": "mono", "autocomplete": "off",
                                            "spellcheck": "false", "placeholder": "WANDB_API_KEY=..."}),
            help_text=("Environment variables set in every job of this backend whose values are secret (API "
                       "tokens your code needs): NAME=VALUE, one per line; stored encrypted, never shown or "
                       "logged. " + (f"Stored: {', '.join(stored_job_secrets)}. A line replaces that one; "
                                     f"NAME= removes it; blank keeps them all." if stored_job_secrets else
                                     "None stored.")))
        self.fields["clear_job_secrets"] = forms.BooleanField(
            required=False, label="Clear stored job secrets",
            help_text="Remove every job secret of this backend (before the lines above are added).")
        self.fields["team"] = team_field(user)
        self.deadline_fields = _deadline_fields()
        self.fields.update(self.deadline_fields)
        # Not required: a POST without them (an older client) keeps the backend's (default: warn, report).
        self.fields["stall_policy"] = forms.ChoiceField(
            required=False, choices=ComputeBackend.StallPolicy.choices, initial=ComputeBackend.StallPolicy.WARN,
            label="When a job is past its deadline",
            help_text="Warn flags it Stalled (on its page and in the list); cancel also cancels it.")
        self.fields["hang_policy"] = forms.ChoiceField(
            required=False, choices=ComputeBackend.HangPolicy.choices, initial=ComputeBackend.HangPolicy.FLAG,
            label="When a running job stops stepping",
            help_text="Flag shows it Hung with each rank's stack on its page; cancel also cancels it; restart "
                      "stops it and runs it again from its last checkpoint (at most max restarts times, then "
                      "cancels it).")
        self.fields["hang_deadline_s"] = forms.IntegerField(
            required=False, min_value=10, max_value=30 * 86_400, label="Hang deadline (seconds)",
            help_text="Seconds with no new step before a running job is hung. Blank: from the job's own step "
                      "time, max(600, 20 × seconds per step).")
        self.fields["idle_policy"] = forms.ChoiceField(
            required=False, choices=ComputeBackend.IdlePolicy.choices, initial=ComputeBackend.IdlePolicy.OFF,
            label="When a running job's GPUs idle",
            help_text="Warn notes it on the job page and sends job.idle (webhook, email) with what stopping it "
                      "would save; stop also checkpoints and stops it. A job without GPU figures (CPU only) is "
                      "never idle.")
        self.fields["idle_gpu_util_pct"] = forms.IntegerField(
            required=False, min_value=1, max_value=100, initial=10, label="Idle below (GPU utilisation, %)",
            help_text="A GPU is idle while NVML's utilisation (% of time a kernel ran) is below this.")
        self.fields["idle_minutes"] = forms.IntegerField(
            required=False, min_value=1, max_value=7 * 24 * 60, initial=30, label="Idle for (minutes)",
            help_text="Minutes every GPU of the job must stay idle before the policy acts.")
        self.fields["preflight"] = forms.BooleanField(
            required=False, label="Network preflight before the first step",
            help_text="Every rank measures the all-reduce bus bandwidth and latency and each node pair's "
                      "bandwidth (a few seconds, before any training step); the figures are on the job page.")
        self.fields["preflight_min_busbw_gbps"] = forms.FloatField(
            required=False, min_value=0.001, max_value=100_000, label="Minimum bus bandwidth (GB/s)",
            help_text="Below it (the all-reduce's, or a node pair's) the run is stopped before its first step, "
                      "FAILED with the slow node named. Blank: no minimum.")
        self.fields["preflight_max_latency_us"] = forms.IntegerField(
            required=False, min_value=1, max_value=10_000_000, label="Maximum latency (µs)",
            help_text="Above it (a small all-reduce) the run is stopped before its first step. Blank: no maximum.")
        self.fields["orphan_policy"] = forms.ChoiceField(
            required=False, choices=ComputeBackend.OrphanPolicy.choices, initial=ComputeBackend.OrphanPolicy.REPORT,
            label="Orphan provider jobs",
            help_text="Provider jobs with Trainboard's tag and no active job: list them for staff, or also "
                      "stop them.")
        # Not required either: a POST without it keeps the backend's (default 2).
        self.fields["max_restarts"] = forms.IntegerField(
            required=False, min_value=0, max_value=MAX_RESTARTS, initial=DEFAULT_MAX_RESTARTS,
            label="Max restarts of a lost or hung run",
            help_text=("How many times a job whose run is lost (a preemption the provider does not restart itself, a host "
                      "that rebooted, a Slurm NODE_FAIL or PREEMPTED) is resubmitted from its last checkpoint before "
                      "it ends Failed, and (hang policy restart) a hung run restarted from it, all counted together; "
                      "0 = never (not with the hang policy restart). A job's own error is never resubmitted."))
        # For the template: one fieldset per kind, legend = the registry's label.
        self.kind_fieldsets = [
            {"kind": kind, "label": registry.KINDS[kind].label,
             "fields": [self[name] for name in self.kind_settings.get(kind, {})]
             + [self[name] for name in self.secret_fields.get(kind, {})]}
            for kind in schemas if kind in self.kind_settings or kind in self.secret_fields
        ]

    def deadline_bound_fields(self) -> list[forms.BoundField]:
        return [self[name] for name in self.deadline_fields]

    def state_deadlines(self) -> dict[str, float]:
        """``{state: seconds}`` of the deadline inputs that have a value (blank ones: the default)."""
        return {name.removeprefix("deadline_"): self.cleaned_data[name] for name in self.deadline_fields
                if self.cleaned_data.get(name) is not None}

    def policy_kwargs(self) -> dict[str, Any]:
        """``state_deadlines``, and ``stall_policy``/``orphan_policy`` when chosen, for
        ``backend_create``/``backend_update`` (a policy left out keeps the backend's, or the default)."""
        kwargs: dict[str, Any] = {"state_deadlines": self.state_deadlines()}
        for name in ("stall_policy", "orphan_policy", "hang_policy", "idle_policy"):
            if self.cleaned_data.get(name):
                kwargs[name] = self.cleaned_data[name]
        for name in ("idle_gpu_util_pct", "idle_minutes"):  # blank: the backend's (default 10 %, 30 min)
            if self.cleaned_data.get(name) is not None:
                kwargs[name] = self.cleaned_data[name]
        if "hang_deadline_s" in self.cleaned_data:  # blank: the job's own step time
            kwargs["hang_deadline_s"] = self.cleaned_data["hang_deadline_s"]
        for name in ("preflight", "preflight_min_busbw_gbps", "preflight_max_latency_us"):  # blank: none
            if name in self.cleaned_data:
                kwargs[name] = self.cleaned_data[name]
        if self.cleaned_data.get("max_restarts") is not None:
            kwargs["max_restarts"] = self.cleaned_data["max_restarts"]
        return kwargs

    def deadline_field(self, message: str) -> str | None:
        """The deadline input a service message about ``state_deadlines`` belongs to ("PENDING: …"),
        or None (the form's top) when it names no state of the form."""
        name = _deadline_field_name(message.split(":", 1)[0].strip().upper())
        return name if name in self.deadline_fields else None

    def secrets(self) -> dict[str, str]:
        """The chosen kind's credentials typed in this time (blank ones left out: keep the stored)."""
        kind = self.cleaned_data.get("kind", "")
        return {key: self.cleaned_data[name] for name, key in self.secret_fields.get(kind, {}).items()
                if self.cleaned_data.get(name)}

    def secret_field(self, kind: str, key: str) -> str | None:
        """The form field of ``kind``'s secret ``key`` (None when it has none)."""
        return next((name for name, k in self.secret_fields.get(kind, {}).items() if k == key), None)

    def chosen_kind(self) -> str:
        return (self.data.get("kind") if self.is_bound else self.initial.get("kind")) or ""

    def setting_field(self, kind: str, key: str) -> str | None:
        """The form field of ``kind``'s setting ``key`` (None when it has none)."""
        return next((name for name, k in self.kind_settings.get(kind, {}).items() if k == key), None)

    def full_clean(self) -> None:
        # Only the chosen kind's settings are read, so only they are validated: a stray value in a
        # hidden (or, without JavaScript, visible) fieldset of another kind is ignored.
        super().full_clean()
        if not self.is_bound:
            return
        chosen = self.chosen_kind()
        for kind, names in self.kind_settings.items():
            if kind == chosen:
                continue
            for name in [*names, *self.secret_fields.get(kind, {})]:
                self._errors.pop(name, None)
                self.cleaned_data.pop(name, None)

    def clean_extra_config(self) -> dict[str, Any]:
        return parse_json_object(self.cleaned_data.get("extra_config", ""), example=self.CONFIG_EXAMPLE)

    def config(self) -> dict[str, Any]:
        """The backend's ``config`` dict: the JSON settings, then the chosen kind's fields that have a
        value (JSON-able: decimals as floats; blank text left out so the adapter's default applies)."""
        config = dict(self.cleaned_data.get("extra_config") or {})
        for name, key in self.kind_settings.get(self.cleaned_data.get("kind", ""), {}).items():
            value = self.cleaned_data.get(name)
            if value is None or (isinstance(value, str) and not value.strip()):
                continue
            config[key] = float(value) if isinstance(value, Decimal) else (
                value.strip() if isinstance(value, str) else value)
        return config

    @classmethod
    def initial_from(cls, backend) -> dict[str, Any]:
        config = dict(backend.config or {})
        initial = {"name": backend.name, "kind": backend.kind, "enabled": backend.enabled, "team": backend.team_id,
                   "stall_policy": backend.stall_policy, "orphan_policy": backend.orphan_policy,
                   "max_restarts": backend.max_restarts, "hang_policy": backend.hang_policy,
                   "hang_deadline_s": backend.hang_deadline_s, "idle_policy": backend.idle_policy,
                   "idle_gpu_util_pct": backend.idle_gpu_util_pct, "idle_minutes": backend.idle_minutes,
                   "preflight": backend.preflight, "preflight_min_busbw_gbps": backend.preflight_min_busbw_gbps,
                   "preflight_max_latency_us": backend.preflight_max_latency_us}
        for state, seconds in (backend.state_deadlines or {}).items():
            initial[_deadline_field_name(state)] = seconds
        for name, key in _registered_kind_settings().get(backend.kind, {}).items():
            if key in config:
                initial[name] = config.pop(key)
        initial["extra_config"] = json.dumps(config, indent=2) if config else ""
        return initial


def _preselected_backend_id(user, backends) -> int | None:
    """The backend the job form selects at first: among ``backends`` that are enabled and whose
    credentials are known to be at hand, the one of ``user``'s newest job, else the first by name;
    None when there is none (the browser then shows the first option).

    "At hand" is decided from the database alone, without a provider call: the kind uses no
    credentials (a GPU box), the backend has stored secrets, or a job of this user on it was
    accepted by its provider (``submitted_at`` set), which shows that the credentials it runs with
    (stored, or the SDK's default chain: an IAM role, ADC, a managed identity) worked. A cloud
    backend with none of these stays in the list; it is only not chosen for the user."""
    enabled = list(backends.filter(enabled=True).order_by("name", "pk"))
    ids = [b.pk for b in enabled]
    accepted = set(TrainingJob.objects.filter(owner=user, backend__in=ids, submitted_at__isnull=False)
                   .values_list("backend_id", flat=True).distinct())
    ready = [b.pk for b in enabled if not backend_secret_keys(b.kind) or b.secrets or b.pk in accepted]
    if not ready:
        return None
    newest = (TrainingJob.objects.filter(owner=user, backend__in=ready).order_by("-created_at", "-pk")
              .values_list("backend_id", flat=True).first())
    return newest if newest is not None else ready[0]


def request_form_field(field: job_request.RequestField) -> forms.Field:
    """The job form's field of a job request's config ``field``: its kind, label (``form_label`` where
    the form says more), help, choices, minimum and the config's default as the initial value;
    an optional one may be left blank (the trainer's default)."""
    given: dict[str, Any] = dict(required=not field.optional and field.kind != "bool", initial=field.initial,
                                 label=field.form_label or field.label, help_text=field.help)
    bounds = {"min_value": field.minimum} if field.minimum is not None else {}
    if field.kind == "int":
        return forms.IntegerField(**bounds, **given)
    if field.kind == "float":
        return forms.FloatField(**bounds, **given)
    if field.kind == "bool":
        return forms.BooleanField(**given)
    if field.kind == "choice":
        return forms.ChoiceField(choices=[(c, c) for c in field.choices], **given)
    raise ValueError(f"{field.name}: no form field for kind {field.kind!r}")  # a declaration bug


def job_request_form_fields(fields=job_request.JOB_REQUEST) -> dict[str, forms.Field]:
    """The job form's fields of the job request's config fields (strategy, shape, training, pipeline
    and large-model settings), built from the declaration; the job-level fields, with their own widgets
    (rows, JSON, environment lines), are declared on :class:`TrainingJobForm`."""
    return {f.name: request_form_field(f) for f in fields if f.config}


_JobRequestFormFields = forms.forms.DeclarativeFieldsMetaclass(
    "_JobRequestFormFields", (forms.Form,), {"__module__": __name__, **job_request_form_fields()})


class TrainingJobForm(_JobRequestFormFields):
    HYPERPARAMETERS_EXAMPLE = '{"train": {"optimizer": "adamw"}}'
    field_order = [f.name for f in job_request.JOB_REQUEST]  # the declaration's order, generated fields among the rest

    name = forms.CharField(required=False, max_length=200, help_text="Optional; defaults to job-<id>.")
    dataset = forms.ModelChoiceField(
        queryset=None, required=False, empty_label="— none: my script reads its own data —",
        help_text="Required, except for a model of kind my script: its script may read its own data "
                  "(TRAINBOARD_DATA_DIR is then unset).")
    model_spec = forms.ModelChoiceField(queryset=None, empty_label=None, label="Model")
    backend = forms.ModelChoiceField(queryset=None, empty_label=None)
    max_runtime_s = forms.IntegerField(min_value=1, initial=3600, label="Max runtime (s)",
                                       help_text=MAX_RUNTIME_HELP)
    budget_usd = forms.DecimalField(required=False, min_value=Decimal("0"), max_digits=12, decimal_places=4,
                                    label="Budget (USD)",
                                    help_text="Optional: stop the job when its cost reaches this. The estimate is "
                                              "min(max runtime × nodes × hourly price, budget).")
    instance_type = forms.CharField(required=False, max_length=100,
                                    help_text="Optional; empty uses the backend's default.")
    spot = forms.BooleanField(required=False, help_text="Interruptible capacity, where the backend offers it.")
    priority = forms.IntegerField(
        required=False, initial=0, min_value=validation.PRIORITY_RANGE[0],
        max_value=validation.PRIORITY_RANGE[1], label="Priority",
        help_text=f"{validation.PRIORITY_RANGE[0]} to {validation.PRIORITY_RANGE[1]}: on a GPU box whose GPUs are "
                  f"taken, higher starts first; equal priorities start in submission order.")
    hyperparameters = forms.CharField(
        required=False, label="Hyperparameters (JSON)",
        widget=forms.Textarea(attrs={"rows": 4, "class": "mono", "spellcheck": "false",
                                     "placeholder": HYPERPARAMETERS_EXAMPLE}),
        help_text="Optional overrides of the trainer config, e.g. " + HYPERPARAMETERS_EXAMPLE + "; not the code "
                  "section (the model's) nor output.output_dir / output.checkpoint_dir (the backend's).",
    )

    env = forms.CharField(
        required=False, label="Environment variables",
        widget=forms.Textarea(attrs={"rows": 3, "class": "mono", "spellcheck": "false",
                                     "placeholder": "WANDB_PROJECT=vision"}),
        help_text="Optional: NAME=VALUE, one per line, set in every process of the job (not secrets: they are "
                  "shown on the job page; the backend's job secrets are set too). The launcher's and the "
                  "platforms' own names (RANK, MASTER_ADDR, PYTHONPATH, TRAINBOARD_*, SM_*, ...) are refused.")
    image = forms.CharField(
        required=False, max_length=500, label="Container image",
        widget=forms.TextInput(attrs={"class": "mono", "spellcheck": "false",
                                      "placeholder": "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0"}),
        help_text="Optional: the image the job runs in (ECR, Artifact Registry or ACR URI); blank = the model's "
                  "image, else the backend's.")

    team = team_field(
        None, empty_label="— none —",
        help_text="Optional: run for a team you belong to. The job counts toward the team's monthly budget "
                  "and its members see it.")

    # The fields the cost estimate reads.
    ESTIMATE_FIELDS = ("backend", "nodes", "procs_per_node", "max_runtime_s", "instance_type", "spot")
    # Read too when given and valid, so the estimate shows the strategy's shape errors (and the budget
    # that caps it), and the memory plan (the dataset and the overrides: precision, optimizer, ...).
    SHAPE_FIELDS = ("strategy", "pipeline_stages", "microbatches", "pipeline_schedule", "batch_size", "model_spec",
                    "budget_usd", "dataset", "hyperparameters", "activation_checkpointing", "cpu_offload",
                    "checkpoint_format", "max_steps", "seq_len")
    OPTIONAL_CONFIG_FIELDS = tuple(f.name for f in job_request.JOB_REQUEST if f.config and f.optional)

    def __init__(self, *args: Any, user, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan_withheld: list[str] = []  # the fields in error that the memory plan would read
        self.fields["dataset"].queryset = selectors.dataset_list_for_user(user=user)
        self.fields["model_spec"].queryset = selectors.model_spec_list_for_user(user=user)
        self.fields["backend"].queryset = selectors.backend_list_for_user(user=user)
        self.fields["team"].queryset = selectors.team_list_for_user(user=user)
        if not self.is_bound and "dataset" not in self.initial:  # "none" is for scripts: not the default
            first = self.fields["dataset"].queryset.values_list("pk", flat=True).first()
            if first is not None:
                self.initial["dataset"] = first
        if not self.is_bound and "backend" not in self.initial:
            # The select's first option is alphabetical: it may be a cloud without credentials.
            chosen = _preselected_backend_id(user, self.fields["backend"].queryset)
            if chosen is not None:
                self.initial["backend"] = chosen
        self._offer_instance_types()

    def _offer_instance_types(self) -> None:
        """Where a backend's adapter offers instance types (a cloud), ``instance_type`` becomes a
        select of them with their prices, grouped by backend (static/webapp/js/job_form.js shows only
        the chosen backend's group; without it ``clean`` refuses another backend's type). With no such
        backend the field stays free text, as for the gpubox. ``spot_backends``: backends with spot;
        ``backend_strategies``: the strategies each backend's image runs."""
        self.backend_offers: dict[int, list[InstanceOffer]] = {}
        self.spot_backends: list[int] = []
        self.backend_strategies: dict[int, tuple[str, ...]] = {}
        self.backend_nodes: dict[int, tuple[int, str]] = {}
        for backend in self.fields["backend"].queryset:
            offers, spot, strategies, max_nodes, nodes_note = services.backend_instance_offers(backend=backend)
            self.backend_offers[backend.pk] = offers
            self.backend_strategies[backend.pk] = strategies
            self.backend_nodes[backend.pk] = (max_nodes, nodes_note)
            if spot:
                self.spot_backends.append(backend.pk)
        self.backend_names = {b.pk: b.name for b in self.fields["backend"].queryset}
        if not any(self.backend_offers.values()):
            return
        groups: list[tuple[str, Any]] = [("", "Backend default")]
        groups += [(self.backend_names[pk], [(o.instance_type, offer_label(o)) for o in offers])
                   for pk, offers in self.backend_offers.items() if offers]
        self.fields["instance_type"] = forms.ChoiceField(
            required=False, choices=groups, label="Instance type",
            help_text="Price per instance-hour from the catalog; (unconfirmed) = not checked against the "
                      "provider's own price list. Backend default: the backend's default instance type.")

    def offers_by_backend(self) -> dict[str, Any]:
        """For job_form.js: ``{backend id: {"name", "offers": bool, "spot": bool, "strategies": [...],
        "max_nodes": int, "nodes_note": str}}``; the script disables the strategies a backend's image
        cannot run and shows ``nodes_note`` beside the nodes field (the service refuses both too)."""
        return {str(pk): {"name": self.backend_names[pk], "offers": bool(self.backend_offers[pk]),
                          "spot": pk in self.spot_backends, "strategies": list(self.backend_strategies[pk]),
                          "max_nodes": self.backend_nodes[pk][0], "nodes_note": self.backend_nodes[pk][1]}
                for pk in self.backend_offers}

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        backend, instance_type = data.get("backend"), data.get("instance_type") or ""
        if backend is None or not instance_type or not isinstance(self.fields["instance_type"], forms.ChoiceField):
            return data
        offered = [o.instance_type for o in self.backend_offers.get(backend.pk, [])]
        if not offered:
            self.add_error("instance_type", f"Backend {backend.name} has no choice of instance type; "
                                            f"choose “Backend default”.")
        elif instance_type not in offered:
            self.add_error("instance_type", f"Backend {backend.name} does not offer {instance_type}; choose one "
                                            f"of {', '.join(offered)}.")
        return data

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
        # No memory plan worked out on stand-ins for the fields in error (``plan_withheld`` says so).
        self.plan_withheld = [f for f in self.SHAPE_FIELDS if f != "budget_usd" and f in self.errors]
        if self.plan_withheld:
            kwargs.pop("dataset", None)
        return kwargs

    def create_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``training_job_create`` (without ``owner``)."""
        data = dict(self.cleaned_data)
        for f in ("dataset", "model_spec", "backend"):  # one that did not clean: the form shows its error
            data.setdefault(f, None)
        for f in self.OPTIONAL_CONFIG_FIELDS:  # empty: the trainer's default
            if data.get(f) in (None, ""):
                data.pop(f, None)
        if data.get("priority") is None:  # left blank: the default
            data["priority"] = 0
        return data


class JobListFilterForm(forms.Form):
    """The job list's query string (``?state=&backend=&q=``), checked like the API's filter.

    The API answers an unknown state or a non-numeric backend with 400; the HTML list says so too,
    rather than dropping them silently and showing every job as if unfiltered. :meth:`problems` says
    what was wrong in words a user can act on; :meth:`filters` gives the valid values only (a bad one is left out).
    """

    state = forms.CharField(required=False)
    backend = forms.CharField(required=False)
    q = forms.CharField(required=False, strip=True)
    # The experiment table (docs/experiments.md; jobs.job_table checks each).
    tag = forms.CharField(required=False, strip=True)
    archived = forms.CharField(required=False, strip=True)
    columns = forms.CharField(required=False, strip=True)
    sort = forms.CharField(required=False, strip=True)

    def clean_tag(self) -> str | None:
        value = self.cleaned_data.get("tag") or ""
        problem = job_table.tag_problem(value) if value else None
        if problem:
            raise forms.ValidationError(f"{problem} The list below is not filtered by tag.")
        return value.lower() or None

    def clean_archived(self) -> bool | None:
        try:
            return job_table.archived_filter(self.cleaned_data.get("archived"))
        except ValueError as exc:
            raise forms.ValidationError(f"{exc} The list below leaves archived jobs out.") from None

    def clean_columns(self):
        """The extra columns named in the URL (None when it names none: the user's own choice applies)."""
        if "columns" not in self.data:
            return None
        columns, problems = job_table.parse_columns(self.cleaned_data.get("columns") or "")
        self.column_choice = columns  # the valid ones are shown even when others are refused
        if problems:
            raise forms.ValidationError(problems)
        return columns

    def clean_sort(self) -> str | None:
        value = self.cleaned_data.get("sort") or ""
        problem = job_table.sort_problem(value) if value else None
        if not problem and value and self.user is not None and job_table.sorts_by_user_metric(value):
            # a well-formed name that no job reported sorts nothing: say so (one query, only then)
            problem = job_table.sort_problem(value, metrics=selectors.metric_names_for_user(user=self.user))
        if problem:
            raise forms.ValidationError(f"{problem} The list below is newest first.")
        return value or None

    def __init__(self, data, *, backends, user=None) -> None:
        """``backends``: the user's, already fetched by the view (no extra query); ``user``: whose
        reported metric names a metric sort key must be among (None: any well-formed name)."""
        super().__init__(data)
        self.backends = list(backends)
        self.user = user

    def clean_state(self) -> str | None:
        value = self.cleaned_data.get("state") or ""
        if not value:
            return None
        if value not in JobStateChoices.values:
            raise forms.ValidationError(
                f"State “{value[:40]}” is not a job state; choose one of {', '.join(JobStateChoices.values)}. "
                f"The list below shows every state.")
        return value

    def clean_backend(self):
        value = self.cleaned_data.get("backend") or ""
        if not value:
            return None
        found = next((b for b in self.backends if value.isdigit() and b.pk == int(value)), None)
        if found is None:
            raise forms.ValidationError(
                f"Backend “{value[:40]}” is not one of your backends; choose one from the Backend list. "
                f"The list below shows every backend.")
        return found

    def problems(self) -> list[str]:
        """The messages of the invalid filters, in field order ([] when all are valid)."""
        self.is_valid()
        return [message for name in self.fields for message in self.errors.get(name, [])]

    def filters(self) -> dict[str, Any]:
        """``{"state": str | None, "backend": ComputeBackend | None, "q": str | None, "tag": str | None,
        "archived": bool | None, "sort": str | None, "columns": [Column] | None}``, valid values only
        (``archived`` False when invalid; ``columns`` the valid ones of an invalid list)."""
        self.is_valid()
        data = self.cleaned_data
        return {"state": data.get("state"), "backend": data.get("backend"), "q": data.get("q") or None,
                "tag": data.get("tag"), "archived": data.get("archived", False), "sort": data.get("sort"),
                "columns": data["columns"] if "columns" in data else getattr(self, "column_choice", None)}
