"""The admin: every model, scoped like the rest of the product (DESIGN.md §8).

Superusers see everything. Other staff see and act on their own objects only: ``get_queryset`` is
scoped, another user's change page is a 404, and they need no model permissions for their own
objects (ownership is the permission). Writes go through ``jobs.services`` (forms call the service in
``_post_clean`` so its ValidationErrors land on the form's fields); jobs are read-only here apart from
the actions "Cancel selected jobs" and "Re-run selected jobs", which report per-job errors as messages.
Backends have the action "Test connection", one message per check. Instance prices are a catalog
shared by everyone: Django's model permissions govern them, not ownership.
"""

from __future__ import annotations

import datetime as dt
from typing import get_args

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.actions import delete_selected as django_delete_selected
from django.db import models
from django.db.models import Q
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from cloud_adapters import registry
from jobs import services, validation
from jobs.cost import format_usd
from jobs.orphans import orphan_stop
from jobs.pagination import CappedCountPaginator
from jobs.services.resources import MAX_HANG_DEADLINE_S, MIN_HANG_DEADLINE_S
from jobs.models import (
    DEFAULT_MAX_RESTARTS,
    FRAMEWORKS,
    MAX_RESTARTS,
    TERMINAL_STATE_VALUES,
    CodeArchive,
    ComputeBackend,
    Dataset,
    InstancePrice,
    JobEvent,
    JobLogLine,
    MetricBucket,
    MetricChunk,
    MetricPoint,
    ModelSpec,
    OrphanJob,
    Sweep,
    Team,
    TrainingJob,
    UserBudget,
    Webhook,
    WebhookDelivery,
)
from trainer_pkg.config import Strategy, plural


# ---------------------------------------------------------------------------------------------
# Scoping
# ---------------------------------------------------------------------------------------------


class OwnedAdmin(admin.ModelAdmin):
    """Staff see their own rows (``owner_path`` names the owner field); superusers see all."""

    owner_path = "owner"

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        return qs.filter(**{self.owner_path: request.user})

    def get_object(self, request, object_id, from_field=None):
        obj = super().get_object(request, object_id, from_field)
        if obj is None:
            raise Http404("No such object, or it is not yours.")  # never reveal another user's rows
        return obj

    def _owns(self, request, obj) -> bool:
        if request.user.is_superuser or obj is None:
            return True
        owner_id = obj
        for part in self.owner_path.split("__"):
            owner_id = getattr(owner_id, part)
        return owner_id.pk == request.user.pk

    def _staff(self, request) -> bool:
        return request.user.is_active and request.user.is_staff

    def has_module_permission(self, request):
        return self._staff(request)

    def has_view_permission(self, request, obj=None):
        return self._staff(request) and self._owns(request, obj)

    def has_change_permission(self, request, obj=None):
        return self._staff(request) and self._owns(request, obj)

    def has_delete_permission(self, request, obj=None):
        return self._staff(request) and self._owns(request, obj)

    def has_add_permission(self, request):
        return self._staff(request)


class ReadOnlyOwnedAdmin(OwnedAdmin):
    """Rows written only by the services (events, metrics, log lines): look, never touch."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


# ---------------------------------------------------------------------------------------------
# Forms that write through the services
# ---------------------------------------------------------------------------------------------


class ServiceForm(forms.ModelForm):
    """Runs ``save_via_service`` during validation; its ValidationError becomes form errors."""

    request = None  # set by ServiceFormAdmin.get_form

    def save_via_service(self, data: dict):  # pragma: no cover - overridden
        raise NotImplementedError

    def _post_clean(self):
        if self.errors:
            return
        try:
            self.instance = self.save_via_service(dict(self.cleaned_data))
        except ValidationError as exc:
            for field, msgs in exc.message_dict.items():
                field = field if field in self.fields else field.split(".", 1)[0]  # config.region: config
                for msg in msgs:
                    self.add_error(field if field in self.fields else None, msg)


class StoredJSONFormField(forms.JSONField):
    """Django's JSON form field, parsed by :func:`jobs.validation.loads`: text nested past
    ``MAX_JSON_DEPTH`` is the field's error (``json.loads`` raised RecursionError, a 500, both on
    submit and when the form re-rendered it). What the value holds (NaN, NUL) is the service's to say."""

    def to_python(self, value):
        if self.disabled or value in self.empty_values or not isinstance(value, str):
            return super().to_python(value)
        try:
            converted = validation.loads(value)
        except validation.JSONInputError as exc:
            raise ValidationError(str(exc), code="invalid") from None
        return forms.fields.JSONString(converted) if isinstance(converted, str) else converted

    def bound_data(self, data, initial):
        if self.disabled or data is None:
            return super().bound_data(data, initial)
        try:
            return validation.loads(data)
        except validation.JSONInputError:
            return forms.fields.InvalidJSONInput(data)


class ServiceFormAdmin(OwnedAdmin):
    formfield_overrides = {models.JSONField: {"form_class": StoredJSONFormField}}

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change, **kwargs)
        form.request = request
        return form

    def save_model(self, request, obj, form, change):
        pass  # the service already saved it in ServiceForm._post_clean


def _json_field(value):
    if isinstance(value, str):
        try:
            return validation.loads(value) if value.strip() else {}
        except validation.JSONInputError:
            return value  # the service reports it on the field
    return value


class DatasetForm(ServiceForm):
    class Meta:
        model = Dataset
        fields = ["name", "description", "format", "builtin_name", "uri", "label_column", "team"]

    def save_via_service(self, data):
        if self.instance.pk:
            return services.dataset_update(dataset=self.instance, **data)
        return services.dataset_create(owner=self.request.user, **data)


class ModelSpecForm(ServiceForm):
    """A model's fields; its code archive is uploaded from the model form, the API or ``manage.py
    register_model`` (here it is shown, and kept on change)."""

    # Not required, so a POST without it is a built-in model, as before kinds existed.
    kind = forms.ChoiceField(required=False, choices=ModelSpec.Kind.choices, initial=ModelSpec.Kind.BUILTIN)
    framework = forms.ChoiceField(required=False, choices=[(f, f) for f in FRAMEWORKS], initial="torch",
                                  help_text=ModelSpec._meta.get_field("framework").help_text)

    class Meta:
        model = ModelSpec
        fields = ["name", "description", "kind", "architecture", "params", "entry_point", "script_args",
                  "framework", "shard_classes", "image", "team"]

    def save_via_service(self, data):
        for name in ("params", "script_args", "shard_classes"):
            data[name] = _json_field(data.get(name))
        data["kind"] = data.get("kind") or ModelSpec.Kind.BUILTIN
        data["framework"] = data.get("framework") or "torch"
        if self.instance.pk:
            return services.model_spec_update(model_spec=self.instance, **data)
        return services.model_spec_create(owner=self.request.user, **data)


def _kind_choices():
    return registry.kind_choices()


def backend_settings_help() -> str:
    """The admin's help under ``config``: each registered kind's settings and credentials, from its
    adapter's declaration (``Backend.settings``), as HTML (the admin renders help text unescaped;
    every part is escaped here)."""
    kinds = format_html_join("", "<li>{} ({}): {}.{}</li>", (
        (registry.KINDS[kind].label, kind, "; ".join(s.describe() for s in schema) or "no settings",
         format_html(" Credentials (write-only, set from the backend form or the API): {}.",
                     ", ".join(secret.describe() for secret in schema.secrets)) if schema.secrets else "")
        for kind, schema in registry.registered_settings().items()))
    return format_html(
        "The settings of the backend's kind as a JSON object; one left out takes the adapter's default. A "
        "setting marked staff only is the operator's: it is taken from a staff user's backend only.<ul>{}</ul>",
        kinds)


class ComputeBackendForm(ServiceForm):
    kind = forms.ChoiceField(choices=_kind_choices, help_text="Which adapter runs this backend's jobs.")
    # Not required, so a POST without them keeps the backend's (default: warn, report).
    stall_policy = forms.ChoiceField(
        required=False, choices=ComputeBackend.StallPolicy.choices, initial=ComputeBackend.StallPolicy.WARN,
        help_text="What a job past its state's deadline gets: flagged Stalled, or flagged and cancelled.")
    orphan_policy = forms.ChoiceField(
        required=False, choices=ComputeBackend.OrphanPolicy.choices, initial=ComputeBackend.OrphanPolicy.REPORT,
        help_text="Provider jobs with Trainboard's tag and no active job: list them, or list and stop them.")
    hang_policy = forms.ChoiceField(
        required=False, choices=ComputeBackend.HangPolicy.choices, initial=ComputeBackend.HangPolicy.FLAG,
        help_text="What a RUNNING job with no new step for its hang deadline gets: flagged Hung (each rank's "
                  "stack on its page), flagged and cancelled, or flagged, stopped and restarted from its last "
                  "checkpoint (at most max restarts times, then cancelled).")
    idle_policy = forms.ChoiceField(
        required=False, choices=ComputeBackend.IdlePolicy.choices, initial=ComputeBackend.IdlePolicy.OFF,
        help_text="What a RUNNING job whose GPUs all stay below the idle threshold for the idle minutes gets: "
                  "nothing, a warning (note, job.idle notification), or that and a stop (the trainer "
                  "checkpoints on SIGTERM). A job without GPU figures (CPU only) is never idle.")
    # Not required: a POST without them keeps the backend's (default 10 %, 30 min).
    idle_gpu_util_pct = forms.IntegerField(
        required=False, min_value=1, max_value=100, initial=10,
        help_text="A GPU is idle while its utilisation (NVML, % of time a kernel ran) is below this, 1 to 100.")
    idle_minutes = forms.IntegerField(
        required=False, min_value=1, max_value=7 * 24 * 60, initial=30,
        help_text="Minutes every GPU of a job must stay idle before the idle policy acts, 1 to 10,080 (7 days).")
    preflight = forms.BooleanField(
        required=False, help_text="Before a job's first step every rank measures the all-reduce bus bandwidth and "
                                  "latency and each node pair's bandwidth (trainer_pkg.preflight).")
    preflight_min_busbw_gbps = forms.FloatField(
        required=False, min_value=0.001, max_value=100_000,
        help_text="Below it (GB/s, the all-reduce's or a node pair's) the run is stopped before its first step; "
                  "blank = no minimum.")
    preflight_max_latency_us = forms.IntegerField(
        required=False, min_value=1, max_value=10_000_000,
        help_text="Above it (µs, a small all-reduce) the run is stopped before its first step; blank = no maximum.")
    max_restarts = forms.IntegerField(
        required=False, min_value=0, max_value=MAX_RESTARTS, initial=DEFAULT_MAX_RESTARTS,
        help_text="How many times a job whose run is lost (a preemption the provider does not restart itself, a "
                  "host that rebooted, a Slurm NODE_FAIL or PREEMPTED) is resubmitted from its last checkpoint "
                  "before it ends FAILED, and (hang policy restart) a hung run restarted from it, counted together; "
                  "0 = never (not with the hang policy restart). A job's own error is never resubmitted.")
    # Declared with the service's bounds, so an out-of-range deadline is reported with the other fields'
    # errors (the model field alone accepts any positive number, and the service runs only once they pass).
    hang_deadline_s = forms.IntegerField(
        required=False, min_value=MIN_HANG_DEADLINE_S, max_value=MAX_HANG_DEADLINE_S, label="Hang deadline s",
        help_text=f"Seconds with no new step before a running job is hung, {MIN_HANG_DEADLINE_S} to "
                  f"{MAX_HANG_DEADLINE_S:,} (30 days). Blank: from the job's own step time.")

    class Meta:
        model = ComputeBackend
        fields = ["name", "kind", "config", "enabled", "team", "state_deadlines", "stall_policy", "orphan_policy",
                  "max_restarts", "hang_policy", "hang_deadline_s", "idle_policy", "idle_gpu_util_pct", "idle_minutes",
                  "preflight", "preflight_min_busbw_gbps", "preflight_max_latency_us"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["config"].help_text = backend_settings_help()

    def save_via_service(self, data):
        data["config"] = _json_field(data.get("config"))
        data["state_deadlines"] = _json_field(data.get("state_deadlines"))
        for name in ("stall_policy", "orphan_policy", "hang_policy", "idle_policy"):
            if not data.get(name):
                data.pop(name, None)
        for name in ("max_restarts", "idle_gpu_util_pct", "idle_minutes"):
            if data.get(name) is None:
                data.pop(name, None)  # left out: the backend's (defaults 2, 10 %, 30 min)
        if self.instance.pk:
            return services.backend_update(backend=self.instance, **data)
        return services.backend_create(owner=self.request.user, **data)


# ---------------------------------------------------------------------------------------------
# Registrations
# ---------------------------------------------------------------------------------------------


@admin.register(Dataset)
class DatasetAdmin(ServiceFormAdmin):
    form = DatasetForm
    list_display = ["name", "owner", "format", "builtin_name", "uri", "summary", "created_at"]
    list_filter = ["format", "created_at"]
    search_fields = ["name", "description", "uri", "owner__username"]
    date_hierarchy = "created_at"
    readonly_fields = ["owner", "summary", "sample_shape", "num_classes", "created_at", "updated_at"]


@admin.register(ModelSpec)
class ModelSpecAdmin(ServiceFormAdmin):
    form = ModelSpecForm
    list_display = ["name", "owner", "kind", "architecture", "entry_point", "code_hash", "created_at"]
    list_filter = ["kind", "architecture", "created_at"]
    list_select_related = ["owner", "code"]
    search_fields = ["name", "description", "entry_point", "owner__username", "=code__sha256"]
    search_help_text = "Name, description, entry point, owner, or a code archive's full SHA-256."
    date_hierarchy = "created_at"
    readonly_fields = ["owner", "code_summary", "created_at", "updated_at"]

    @admin.display(description="Code", ordering="code__sha256")
    def code_hash(self, obj) -> str:
        return obj.code.short_sha if obj.code_id else "—"

    @admin.display(description="Code archive")
    def code_summary(self, obj) -> str:
        """The archive's hash, size and requirements (its files are on the code archive's page)."""
        if obj is None or not obj.code_id:
            return "none (a built-in model)"
        code = obj.code
        requirements = f"; requirements: {code.requirements.strip()}" if code.requirements.strip() else ""
        return f"{code.sha256} ({code.file_count} files, {code.size_bytes:,} bytes){requirements}"


@admin.register(CodeArchive)
class CodeArchiveAdmin(ReadOnlyOwnedAdmin):
    """Stored code archives, read only: content-addressed and shared, so not owned; a staff user sees
    the ones their own models or jobs use (a superuser, all). The rows are written by
    ``jobs.code_archives.store`` and kept while a model or a job uses them."""

    owner_path = "model_specs__owner"  # one way to a user; get_queryset adds the jobs' way
    list_display = ["short_sha", "file_count", "size_bytes", "created_at"]
    search_fields = ["=sha256"]
    date_hierarchy = "created_at"
    fields = ["sha256", "size_bytes", "file_count", "requirements", "files", "created_at", "stored_at"]
    readonly_fields = fields

    @admin.display(description="Stored at")
    def stored_at(self, obj) -> str:
        return str(obj.path)

    def get_queryset(self, request):
        qs = admin.ModelAdmin.get_queryset(self, request)
        if request.user.is_superuser:
            return qs
        uses = Q(model_specs__owner=request.user) | Q(jobs__owner=request.user)
        return qs.filter(pk__in=CodeArchive.objects.filter(uses).values("pk"))

    def _owns(self, request, obj) -> bool:
        return obj is None or request.user.is_superuser or self.get_queryset(request).filter(pk=obj.pk).exists()


@admin.register(ComputeBackend)
class ComputeBackendAdmin(ServiceFormAdmin):
    form = ComputeBackendForm
    list_display = ["name", "owner", "kind", "enabled", "stall_policy", "orphan_policy", "max_restarts", "created_at"]
    list_filter = ["kind", "enabled", "stall_policy", "orphan_policy", "created_at"]
    search_fields = ["name", "kind", "owner__username"]
    date_hierarchy = "created_at"
    readonly_fields = ["owner", "credentials", "job_secret_names", "created_at", "updated_at"]
    actions = ["test_connection_selected"]

    @admin.display(description="Stored credentials")
    def credentials(self, obj) -> str:
        """Which credential keys are stored ("set: a, b" or "not set"), never their values; they are
        written from the backend form or the API (write-only)."""
        keys = sorted((obj.secrets or {}).keys()) if obj is not None and obj.pk else []
        return f"set: {', '.join(keys)}" if keys else "not set"

    @admin.display(description="Job secrets")
    def job_secret_names(self, obj) -> str:
        """The names of the environment variables set from the backend's job secrets, never their values."""
        keys = sorted((obj.job_secrets or {}).keys()) if obj is not None and obj.pk else []
        return f"set: {', '.join(keys)}" if keys else "none"

    @admin.action(description="Test connection of selected backends")
    def test_connection_selected(self, request, queryset):
        """One message per check: success for ok, error for failed (the adapter's own words)."""
        for backend in queryset:
            try:
                checks = services.backend_test_connection(backend=backend, user=request.user)
            except ValidationError as exc:
                self.message_user(request, f"{backend.name}: {' '.join(exc.messages)}", messages.ERROR)
                continue
            for check in checks:
                self.message_user(
                    request, f"{backend.name} — {check.name}: {'ok' if check.ok else 'failed'}. {check.message}",
                    messages.SUCCESS if check.ok else messages.ERROR,
                )


class InstancePriceForm(forms.ModelForm):
    """Saves through ``services.instance_price_save`` (its ValidationError lands on the fields).

    One form for the clouds' list prices and the internal rates of own clusters (slurm, kubernetes:
    ``cloud_adapters.pricing.internal_rate``), so the help texts say what each field means for both."""

    class Meta:
        model = InstancePrice
        fields = ["provider", "region", "instance_type", "usd_per_hour", "usd_per_gpu_hour", "source", "as_of",
                  "confirmed", "gpu_model", "gpu_count", "gpu_memory_gib", "gpu_source"]
        labels = {"usd_per_hour": "USD per hour", "usd_per_gpu_hour": "USD per GPU-hour"}
        help_texts = {
            "region": "Clouds: the provider's region code, e.g. us-east-1, us-central1, eastus. Slurm and "
                      "Kubernetes (internal rate): the cluster's name, as its backend's settings name it (a Slurm "
                      "backend's Cluster name).",
            "instance_type": "Clouds: e.g. ml.g5.xlarge, n1-standard-8, Standard_NC6s_v3. Slurm: the partition; "
                             "Kubernetes: the node pool.",
            "usd_per_hour": "Clouds: on-demand USD per instance-hour (per accelerator-hour for accelerator rows). "
                            "Internal rate: USD per node-hour, charged for each node a job holds.",
            "usd_per_gpu_hour": "Internal rate only: USD per GPU-hour, added per GPU a node is given; a node then "
                                "costs USD per hour + GPUs per node × this. 0 (or blank) for the clouds' list prices.",
            "source": "Where the figure comes from (API, URL, file). Blank on a Slurm or Kubernetes row: "
                      "\"internal rate\".",
        }

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["usd_per_gpu_hour"].required = False  # blank = 0: most rows have no GPU-hour rate

    def _post_clean(self):
        if self.errors:
            return
        try:
            self.instance = services.instance_price_save(
                price=self.instance if self.instance.pk else None, **self.cleaned_data)
        except ValidationError as exc:
            for field, msgs in exc.message_dict.items():
                field = field if field in self.fields else field.split(".", 1)[0]  # config.region: config
                for msg in msgs:
                    self.add_error(field if field in self.fields else None, msg)


@admin.register(InstancePrice)
class InstancePriceAdmin(admin.ModelAdmin):
    """The price catalog adapters price jobs from. Not owned by a user: Django's model permissions
    decide who may edit it (superusers always; other staff when granted ``jobs.change_instanceprice``)."""

    form = InstancePriceForm
    list_display = ["instance_type", "provider", "region", "usd_per_hour", "usd_per_gpu_hour", "confirmed", "as_of",
                    "gpu_count", "gpu_model", "gpu_memory_gib", "source", "updated_at"]
    list_display_links = ["instance_type"]
    list_filter = ["provider", "confirmed", "region", "as_of"]
    search_fields = ["instance_type", "region", "source"]
    ordering = ["provider", "region", "instance_type"]
    readonly_fields = ["updated_at"]

    def save_model(self, request, obj, form, change):
        pass  # saved by the service in InstancePriceForm._post_clean


class JobEventInline(admin.TabularInline):
    model = JobEvent
    fields = ["created_at", "from_state", "to_state", "message"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["created_at", "id"]

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_view_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff


_JOB_FIELDS = [f.name for f in TrainingJob._meta.get_fields() if f.concrete and f.name != "id"]


# Off: at 1280 px the navigation sidebar (276 px) and the filter column (240 px) leave the job list
# 631 px for 780 px of columns, so it would scroll sideways; the breadcrumbs and the admin index
# reach every model without it.
admin.site.enable_nav_sidebar = False


@admin.register(TrainingJob)
class TrainingJobAdmin(OwnedAdmin):
    list_display = ["id", "display_name", "owner", "state", "backend", "shape", "created", "duration", "cost"]
    list_display_links = ["id", "display_name"]

    class StrategyFilter(admin.SimpleListFilter):
        """The trainer's strategies as fixed choices: the default filter runs SELECT DISTINCT over
        every job on each page view."""

        title = "strategy"
        parameter_name = "strategy"

        def lookups(self, request, model_admin):
            return [(s, s) for s in get_args(Strategy)]

        def queryset(self, request, queryset):
            return queryset.filter(strategy=self.value()) if self.value() else queryset

    # At 100,000 jobs (bench/job_list.py): no full COUNT(*) (the count stops at 10,001, "10,001" then
    # means "more than 10,000"), no date hierarchy (a SELECT DISTINCT over every job; filter by
    # "created at" instead), search only on what has an index (id as text; trigram on name and
    # provider job name) because a search through a join reads every job; 50 rows a page.
    paginator = CappedCountPaginator
    show_full_result_count = False
    list_per_page = 50  # rendering the rows is most of the page's time
    list_filter = ["state", "backend__kind", StrategyFilter, "spot", "created_at"]
    search_fields = ["=id", "name", "provider_job_name"]
    search_help_text = "Job id (exact), job name or provider job name."
    list_select_related = ["owner", "backend"]
    readonly_fields = _JOB_FIELDS + ["shape", "duration"]
    fieldsets = [
        (None, {"fields": ["name", "owner", "team", "state", "state_entered_at", "stalled_at", "stalled_reason",
                           "failure_reason", "status_warning", "rerun_of"]}),
        ("What it runs", {"fields": ["dataset", "dataset_fingerprint", "model_spec", "code", "image", "env",
                                     "backend", "strategy", "shape", "instance_type", "spot", "max_runtime_s",
                                     "config"]}),
        ("Lifecycle", {"fields": ["provider_job_name", "provider_handle", "raw_state", "secondary_state",
                                  "created_at", "submitted_at", "started_at", "first_step_at", "ended_at",
                                  "cancel_requested_at", "last_synced_at", "duration", "log_cursor"]}),
        ("Cost", {"fields": ["hourly_price_usd", "estimated_cost_usd", "budget_usd", "budget_exceeded_at",
                             "billable_seconds", "training_seconds", "instance_count", "cost_usd"]}),
    ]
    inlines = [JobEventInline]
    # "delete_selected" here replaces the site-wide action of that name (ModelAdmin.get_actions).
    actions = ["cancel_selected", "rerun_selected", "delete_selected"]

    # A job's own history, deleted with it: their admins are read-only (nobody deletes one event), which
    # must not block deleting the job they belong to.
    _JOB_HISTORY = (JobEvent, MetricPoint, MetricChunk, MetricBucket, JobLogLine)
    ACTIVE_LISTED = 20  # active jobs named in the refusal; the rest are counted

    def has_add_permission(self, request):
        return False  # jobs are launched from the dashboard, the API or `manage.py submit_job`

    def has_delete_permission(self, request, obj=None):
        return bool(super().has_delete_permission(request, obj) and (obj is None or obj.is_terminal))

    def get_deleted_objects(self, objs, request):
        deletable, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        history = {str(model._meta.verbose_name) for model in self._JOB_HISTORY}
        return deletable, counts, {name for name in perms_needed if str(name) not in history}, protected

    @admin.action(description="Delete selected training jobs", permissions=["delete"])
    def delete_selected(self, request, queryset):
        """Django's "Delete selected", refused as a whole with a message naming the active jobs when
        any selected job has not ended (a running job's cloud resources would be left behind)."""
        active = list(queryset.exclude(state__in=TERMINAL_STATE_VALUES).select_related(None)
                      .order_by("pk").only("pk", "name", "state"))
        if not active:
            return django_delete_selected(self, request, queryset)
        named = ", ".join(f"#{job.pk} {job} ({job.state})" for job in active[:self.ACTIVE_LISTED])
        more = f" and {len(active) - self.ACTIVE_LISTED} more" if len(active) > self.ACTIVE_LISTED else ""
        self.message_user(
            request,
            f"Nothing was deleted: {len(active)} of the selected jobs have not ended: {named}{more}. Cancel them "
            f"(action “Cancel selected jobs”) and delete them once they have ended, or select only ended jobs.",
            messages.ERROR)
        return None

    @admin.display(description="name", ordering="name")
    def display_name(self, job):
        """The name the dashboard shows: ``job-<id>`` for a job launched without one (not "-")."""
        return str(job)

    @admin.display(description="created (UTC)", ordering="created_at")
    def created(self, job):
        # "2026-12-01 09:20" rather than the locale's "Dec. 1, 2026, 9:20 a.m." (a third narrower).
        return timezone.localtime(job.created_at, dt.timezone.utc).strftime("%Y-%m-%d %H:%M")

    @admin.display(description="nodes × procs")
    def shape(self, job):
        return f"{job.nodes} × {job.procs_per_node}"

    @admin.display(description="cost", ordering="cost_usd")
    def cost(self, job):
        return format_usd(job.cost_usd, job.money_places)

    @admin.display(description="duration")
    def duration(self, job):
        seconds = job.duration_s
        if seconds is None:
            return "—"
        minutes, secs = divmod(int(seconds), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"

    @admin.action(description="Cancel selected jobs")
    def cancel_selected(self, request, queryset):
        done = 0
        for job in queryset.select_related("backend"):
            try:
                services.training_job_cancel(job=job, reason=f"Cancelled by {request.user.get_username()} (admin)")
            except ValidationError as exc:
                self.message_user(request, _prefixed(job.pk, exc.messages), messages.ERROR)
            else:
                done += 1
        if done:
            self.message_user(request, f"Cancel requested for {plural(done, 'job', 'jobs')}.", messages.SUCCESS)

    @admin.action(description="Re-run selected jobs")
    def rerun_selected(self, request, queryset):
        created = []
        for job in queryset.select_related("backend", "dataset", "model_spec"):
            owner = job.owner if request.user.is_superuser else request.user
            try:
                created.append(services.training_job_rerun(job=job, owner=owner))
            except ValidationError as exc:
                self.message_user(request, _prefixed(job.pk, exc.messages), messages.ERROR)
        if created:
            ids = ", ".join(str(j.pk) for j in created)
            self.message_user(request, f"Queued {plural(len(created), 're-run', 're-runs')}: "
                              f"{'job' if len(created) == 1 else 'jobs'} {ids}.", messages.SUCCESS)


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyOwnedAdmin):
    owner_path = "job__owner"
    list_display = ["id", "job", "from_state", "to_state", "message", "created_at"]
    list_filter = ["to_state", "created_at"]
    search_fields = ["message", "job__name", "=job__id"]
    date_hierarchy = "created_at"
    list_select_related = ["job"]


@admin.register(MetricPoint)
class MetricPointAdmin(ReadOnlyOwnedAdmin):
    owner_path = "job__owner"
    list_display = ["id", "job", "name", "step", "epoch", "rank", "value", "recorded_at"]
    list_filter = ["name", "recorded_at"]
    search_fields = ["name", "job__name", "=job__id"]
    date_hierarchy = "recorded_at"
    list_select_related = ["job"]


@admin.register(JobLogLine)
class JobLogLineAdmin(ReadOnlyOwnedAdmin):
    owner_path = "job__owner"
    list_display = ["job", "seq", "line"]
    search_fields = ["text", "=job__id"]
    list_select_related = ["job"]

    @admin.display(description="text")
    def line(self, obj):
        return format_html("<code>{}</code>", obj.text[:200])


def _prefixed(job_id: int, texts: list[str]) -> str:
    """``"Job N: <message>"`` for an admin message, without repeating a "Job N" the message starts with."""
    text = " ".join(texts)
    return text if text.startswith(f"Job {job_id} ") else f"Job {job_id}: {text}"


# --- Orphans (jobs.orphans) ------------------------------------------------------------------

@admin.register(OrphanJob)
class OrphanJobAdmin(admin.ModelAdmin):
    """Provider jobs with Trainboard's tag and no active job row; rows are the reconciler's, so every
    field is read-only; the Stop action sends the provider's cancel (``jobs.orphans.orphan_stop``)."""

    list_display = ["id", "backend", "provider_job_name", "job_id", "raw_state", "last_seen_at",
                    "stop_requested_at", "resolved_at"]
    list_filter = ["backend__kind", "resolved_at", "stop_requested_at"]
    search_fields = ["provider_job_name", "=job_id", "backend__name"]
    list_select_related = ["backend"]
    readonly_fields = ["backend", "provider_job_name", "job_id", "raw_state", "first_seen_at", "last_seen_at",
                       "stop_requested_at", "stop_requested_by", "resolved_at", "note"]
    actions = ["stop_selected"]

    def has_add_permission(self, request):
        return False  # found by the reconciler, never entered by hand

    @admin.action(description="Stop selected orphan jobs at the provider")
    def stop_selected(self, request, queryset):
        done = 0
        for orphan in queryset.select_related("backend"):
            try:
                orphan_stop(orphan, request.user)
            except (ValidationError, PermissionDenied) as exc:
                text = " ".join(getattr(exc, "messages", None) or [str(exc)])
                self.message_user(request, f"{orphan.provider_job_name}: {text}", messages.ERROR)
            else:
                done += 1
        if done:
            self.message_user(request, f"Stop sent for {plural(done, 'orphan job', 'orphan jobs')}.", messages.SUCCESS)


# ---------------------------------------------------------------------------------------------
# Teams and budgets: not owned rows; Django's model permissions govern them.
# ---------------------------------------------------------------------------------------------


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "monthly_budget_usd", "created_at"]
    search_fields = ["name", "members__username"]
    filter_horizontal = ["members"]
    readonly_fields = ["created_at"]


@admin.register(UserBudget)
class UserBudgetAdmin(admin.ModelAdmin):
    list_display = ["user", "monthly_budget_usd"]
    search_fields = ["user__username"]
    autocomplete_fields = ["user"]


# --- Sweeps and webhooks (issue 16): written by their services, looked at and acted on here ------


@admin.register(Sweep)
class SweepAdmin(ReadOnlyOwnedAdmin):
    """Sweeps (docs/sweeps.md). A sweep is made by ``jobs.sweeps.sweep_create`` (its search space and
    base job checked against the trainer's schema), so every field is read-only here; the Cancel
    action is ``jobs.sweeps.sweep_cancel`` (no new trials, its running trials cancelled)."""

    list_display = ["id", "name", "owner", "team", "state", "sampler", "objective_metric", "direction",
                    "max_trials", "max_concurrent_trials", "budget_usd", "pruner", "created_at", "ended_at"]
    list_filter = ["state", "sampler", "direction", "pruner", "backend__kind", "created_at"]
    search_fields = ["name", "owner__username", "objective_metric", "=id"]
    date_hierarchy = "created_at"
    list_select_related = ["owner", "team"]
    actions = ["cancel_selected"]

    @admin.action(description="Cancel selected sweeps")
    def cancel_selected(self, request, queryset):
        from jobs import sweeps

        done = 0
        for sweep in queryset:
            try:
                sweeps.sweep_cancel(sweep=sweep, reason=f"Sweep cancelled by {request.user.username} (admin)")
            except ValidationError as exc:
                self.message_user(request, " ".join(exc.messages), messages.ERROR)
            else:
                done += 1
        if done:
            self.message_user(request, f"Cancelled {plural(done, 'sweep', 'sweeps')}.", messages.SUCCESS)


@admin.register(Webhook)
class WebhookAdmin(ReadOnlyOwnedAdmin):
    """Webhooks (docs/notifications.md). Read-only: a URL must pass the service's checks (http(s), a
    public address: ``jobs.services.webhook_create`` / ``webhook_update``), and the signing secret is
    never shown (it is not among the fields)."""

    list_display = ["id", "name", "owner", "team", "url", "format", "enabled", "event_list", "created_at"]
    list_filter = ["enabled", "format", "created_at"]
    search_fields = ["name", "url", "owner__username", "team__name"]
    list_select_related = ["owner", "team"]
    fields = ["name", "owner", "team", "url", "events", "format", "enabled", "created_at", "updated_at"]

    @admin.display(description="events")
    def event_list(self, obj):
        return ", ".join(map(str, obj.events or []))


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyOwnedAdmin):
    """The delivery log: one row per event per webhook, with every attempt's status code (read-only:
    the delivery task and its beat pass write them)."""

    owner_path = "webhook__owner"
    list_display = ["id", "webhook", "event", "job", "delivery_status", "attempt_count", "last_status_code",
                    "created_at", "delivered_at", "given_up_at"]
    list_filter = ["event", ("delivered_at", admin.EmptyFieldListFilter), ("given_up_at", admin.EmptyFieldListFilter),
                   "created_at"]
    search_fields = ["=delivery_id", "webhook__name", "webhook__url", "=job__id", "event"]
    date_hierarchy = "created_at"
    list_select_related = ["webhook", "job"]

    @admin.display(description="status")
    def delivery_status(self, obj):
        return obj.status

    @admin.display(description="last response")
    def last_status_code(self, obj):
        """The last attempt's HTTP status code, else its error, else — (no attempt yet)."""
        last = obj.attempts[-1] if obj.attempts and isinstance(obj.attempts[-1], dict) else {}
        if last.get("status_code") is not None:
            return last["status_code"]
        return str(last.get("error") or "—")[:200]
