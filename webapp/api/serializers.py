"""REST serializers. They check the request's types, then hand the values to ``jobs.services``; the
service's ValidationError comes back as a 400 keyed by the same field names."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from django.db import models
from rest_framework import serializers
from rest_framework.fields import SkipField
from rest_framework.settings import api_settings

from cloud_adapters import registry
from cloud_adapters.settings import BackendSettings
from jobs import code_archives, hangs, job_request, selectors, services, validation
from jobs.cost import estimate_arithmetic
from jobs.services.resources import MAX_HANG_DEADLINE_S, MIN_HANG_DEADLINE_S
from jobs.services.training_jobs import JOB_FIELD_ALIASES
from jobs.models import FRAMEWORKS, MAX_RESTARTS, CodeArchive, ComputeBackend, Dataset, JobEvent, ModelSpec, TrainingJob
from jobs.job_request import MAX_RUNTIME_HELP
from trainer_pkg.registry import ARCHITECTURES, CUSTOM
from webapp.errors import to_drf_validation_error, trial_call


FORM_TRANSPORT_KEYS = frozenset({"csrfmiddlewaretoken"})
"""Keys a form body carries that are no field (the browsable API's forms post the CSRF token)."""


class KnownFieldsMixin:
    """A request body's keys must be the serializer's fields: an unknown one (``lerning_rate``,
    ``model`` for ``model_spec``) is a 400 on that key, with the name it likely meant
    (:func:`jobs.validation.unknown_fields`), reported with the other fields' errors, never dropped so
    the request runs on defaults. A read-only field sent back (``id``, ``created_at`` of a fetched
    object) is known, and ignored as DRF ignores it. A multipart or form body's keys are checked the
    same way (its files included).

    ``known_fields_what``: who takes the fields, for the message that lists them ("a job");
    ``field_aliases``: other spellings → the field; ``field_hints``: a key → where it goes instead.
    """

    known_fields_what = "this endpoint"
    field_aliases: Mapping[str, str] = {}
    field_hints: Mapping[str, str] = {}

    def unknown_field_errors(self, data: Mapping[str, Any]) -> validation.Errors:
        """``{key: [message]}`` for the keys of ``data`` that are no field of this serializer."""
        errors = validation.Errors()
        writable = [name for name, field in self.fields.items() if not field.read_only]
        unknown = [key for key in data if key not in self.fields and key not in FORM_TRANSPORT_KEYS]
        validation.unknown_fields(errors, unknown, writable, what=self.known_fields_what,
                                  aliases=self.field_aliases, hints=self.field_hints)
        return errors

    def to_internal_value(self, data):
        unknown = self.unknown_field_errors(data) if isinstance(data, Mapping) else {}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if not unknown or not isinstance(exc.detail, Mapping):
                raise
            raise serializers.ValidationError({**exc.detail, **unknown}) from None
        if unknown:
            raise serializers.ValidationError(dict(unknown))
        return value


class ServiceSerializerMixin(KnownFieldsMixin):
    """``create``/``update`` call a service; its ValidationError becomes a DRF 400. Unknown keys are
    refused (:class:`KnownFieldsMixin`).

    :meth:`is_valid` reports the request's own field errors and the service's in one 400, like the
    UI's ``submit_form``: when a field fails its own check, the service is still tried
    (``webapp.errors.trial_call``, rolled back: nothing saved, no task sent) on the fields that did
    validate, and its errors on the other fields join the serializer's.
    """

    def _call(self, fn, **kwargs: Any):
        try:
            return fn(**kwargs)
        except DjangoValidationError as exc:
            raise to_drf_validation_error(exc) from None

    def is_valid(self, *, raise_exception: bool = False) -> bool:
        valid = super().is_valid()
        if not valid and not getattr(self, "_service_tried", False) and isinstance(self.initial_data, Mapping) \
                and not self._errors.get(api_settings.NON_FIELD_ERRORS_KEY):
            self._service_tried = True
            self._errors = self._with_service_errors(dict(self._errors))
        if self._errors and raise_exception:
            raise serializers.ValidationError(self.errors)
        return not bool(self._errors)

    def _with_service_errors(self, errors: dict[str, Any]) -> dict[str, Any]:
        values = self._values_that_validate(errors)

        def call():
            try:
                return self.update(self.instance, values) if self.instance is not None else self.create(values)
            except serializers.ValidationError as exc:
                # _call already turned the service's error into the API's keys; back to a dict for trial_call.
                # (each message's code kept: trial_call drops a jobs.validation.WHOLE_INPUT one)
                raise DjangoValidationError({key: [DjangoValidationError(str(m), code=getattr(m, "code", None))
                                                   for m in (msgs if isinstance(msgs, list) else [msgs])]
                                             for key, msgs in exc.detail.items()}) from None

        def check():  # a serializer's pure check of the same values, where it has one (nothing to roll back)
            try:
                return self.check(values)
            except serializers.ValidationError as exc:
                raise DjangoValidationError({key: [DjangoValidationError(str(m), code=getattr(m, "code", None))
                                                   for m in (msgs if isinstance(msgs, list) else [msgs])]
                                             for key, msgs in exc.detail.items()}) from None

        _, exc = trial_call(call, valid=False, flagged=set(errors),
                            check=check if self.instance is None and hasattr(self, "check") else None)
        if exc is not None:
            for key, messages in to_drf_validation_error(exc).detail.items():
                errors.setdefault(key, []).extend(messages)
        return errors

    def _values_that_validate(self, errors: Mapping[str, Any]) -> dict[str, Any]:
        """The validated value of each writable field without an error; on create, None for a required
        one that has an error (the service's own error for it is dropped: the serializer's stands)."""
        values: dict[str, Any] = {}
        for field in self._writable_fields:
            if field.field_name in errors:
                if self.instance is None and field.required:
                    self.set_value(values, field.source_attrs, None)
                continue
            try:
                value = field.run_validation(field.get_value(self.initial_data))
            except (serializers.ValidationError, DjangoValidationError, SkipField):
                continue
            self.set_value(values, field.source_attrs, value)
        return values


class StoredJSONField(serializers.JSONField):
    """A JSON value that can be stored (:mod:`jobs.validation`): no NaN or infinite number, no NUL,
    at most ``MAX_JSON_DEPTH`` levels. A form-encoded value (text) is parsed with the same bounds; each
    problem is one message, with where it is (``train.lr: expected a finite number, got nan.``)."""

    def to_internal_value(self, data):
        text = getattr(data, "is_json_string", False) or self.binary
        if text:
            try:
                data = validation.loads(data)
            except validation.JSONInputError as exc:
                raise serializers.ValidationError(str(exc)) from None
        problems = validation.json_problems(data)
        if problems:
            raise serializers.ValidationError(problems)
        return data if text else super().to_internal_value(data)


def _integer_pk() -> serializers.IntegerField:
    # The key is read as an integer first: a float such as 1e400 (infinity) went to the query, where
    # int(inf) raised OverflowError (a 500), past PrimaryKeyRelatedField's TypeError/ValueError.
    return serializers.IntegerField()


_SLUG = re.compile(r"[-a-zA-Z0-9_]+")


@extend_schema_field({"oneOf": [{"type": "integer"}, {"type": "string"}]})
class TeamField(serializers.PrimaryKeyRelatedField):
    """A team the requesting user is a member of (null = private / none), by its id or its name (team
    names are unique), as the job request's other rows are named. Written back as the id."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("pk_field", _integer_pk())
        super().__init__(**kwargs)

    default_error_messages = {
        "does_not_exist": "Choose one of your teams; team {pk_value} does not exist or you are not a member.",
        "no_such_name": "Choose one of your teams; no team named {name!r} of which you are a member.",
    }

    def get_queryset(self):
        return selectors.team_list_for_user(user=self.context["request"].user)

    def to_internal_value(self, data):
        if isinstance(data, str) and data.strip() and not data.strip().lstrip("-").isdigit():
            name = data.strip()
            # A team's name is a slug of at most 100 characters: anything else names none (and a NUL
            # byte never reaches PostgreSQL, which refuses it in text).
            team = (self.get_queryset().filter(name=name).first()
                    if len(name) <= 100 and _SLUG.fullmatch(name) else None)
            if team is None:
                self.fail("no_such_name", name=name[:100])
            return team
        return super().to_internal_value(data)


def share_team_field() -> TeamField:
    """The optional ``team`` of a dataset, model or backend: shared with that team's members."""
    return TeamField(required=False, allow_null=True,
                     help_text="Share with a team you are a member of (its members see and use it); null = private.")


class TextField(serializers.CharField):
    """A CharField that takes text only: a number or a boolean in a JSON body is refused, not stored as
    "7" or "inf" (1e400 parses as infinity; the API fuzz found a model's image stored as "inf")."""

    default_error_messages = {"not_text": "Must be text, not {kind}."}

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("not_text", kind="null" if data is None else type(data).__name__)
        return super().to_internal_value(data)


STRICT_TEXT_MAPPING = {**serializers.ModelSerializer.serializer_field_mapping}
"""A ModelSerializer's field mapping with the model's text columns as :class:`TextField`."""
for _column in (models.CharField, models.TextField, models.SlugField, models.URLField, models.EmailField):
    if STRICT_TEXT_MAPPING.get(_column) is serializers.CharField:
        STRICT_TEXT_MAPPING[_column] = TextField


class DatasetSerializer(ServiceSerializerMixin, serializers.ModelSerializer):
    """A dataset; ``sample_shape``, ``num_classes`` and ``summary`` are read from the data when it is
    saved (read-only; null/"" for a cloud URI, not read here). A token dataset's ``sample_shape`` is
    ``[null]``: the window length T is not the dataset's but each job's ``data.seq_len`` (0 = the gpt
    model's ``context_length``), so a job-independent value is given rather than one model's length;
    the schema's field help says so. ``num_classes`` is then the vocabulary size."""

    serializer_field_mapping = STRICT_TEXT_MAPPING
    known_fields_what = "a dataset"

    team = share_team_field()

    class Meta:
        model = Dataset
        fields = ["id", "name", "description", "format", "builtin_name", "uri", "label_column", "team",
                  "sample_shape", "num_classes", "num_samples", "val_samples", "summary", "created_at", "updated_at"]
        read_only_fields = ["id", "sample_shape", "num_classes", "num_samples", "val_samples", "summary",
                            "created_at", "updated_at"]

    def create(self, validated_data: dict[str, Any]) -> Dataset:
        # The model's default applies when the request leaves the format out (the service wants one).
        validated_data.setdefault("format", Dataset.Format.BUILTIN)
        return self._call(services.dataset_create, owner=self.context["request"].user, **validated_data)

    def update(self, instance: Dataset, validated_data: dict[str, Any]) -> Dataset:
        return self._call(services.dataset_update, dataset=instance, **validated_data)


CODE_FILES_SHOWN = 50
"""Member paths a model's ``code`` lists in the API (the archive's first, sorted)."""


class CodeArchiveSerializer(serializers.ModelSerializer):
    """A stored code archive: its hash, size, files and requirements (read only)."""

    files = serializers.SerializerMethodField(help_text=f"The first {CODE_FILES_SHOWN} member paths, sorted.")

    class Meta:
        model = CodeArchive
        fields = ["sha256", "size_bytes", "file_count", "requirements", "files"]
        read_only_fields = fields

    def get_files(self, archive: CodeArchive) -> list[str]:
        return list(archive.files[:CODE_FILES_SHOWN])


class CodeField(serializers.FileField):
    """Written: the uploaded ``.zip``/``.tar.gz`` (multipart); read: the stored archive's summary
    (:class:`CodeArchiveSerializer`), or null for a built-in model."""

    def to_representation(self, value: CodeArchive | None) -> dict[str, Any] | None:
        return CodeArchiveSerializer(value).data if value is not None else None


class CodeFieldExtension(OpenApiSerializerFieldExtension):
    """The schema of :class:`CodeField` in a response (and a JSON body, where it is read only): the
    archive's summary. A multipart body documents the upload with :class:`ModelSpecUploadSerializer`."""

    target_class = CodeField

    def map_serializer_field(self, auto_schema, direction):
        component = auto_schema.resolve_serializer(CodeArchiveSerializer, direction)
        return {"allOf": [component.ref], "readOnly": True, "nullable": True,
                "description": "The model's code archive (kinds code and script); null for a built-in model."}


class NonNegativeDecimalExtension(OpenApiSerializerFieldExtension):
    """A decimal sent as a string (``"12.5000"``) whose ``min_value`` is 0 or more: drf-spectacular's
    pattern allows a leading minus whatever the bound (a string schema has no ``minimum``), so the
    pattern loses it, and the schema says what the field refuses."""

    target_class = serializers.DecimalField
    match_subclasses = True

    def map_serializer_field(self, auto_schema, direction):
        schema = auto_schema._map_serializer_field(self.target, direction, bypass_extensions=True)
        low = self.target.min_value
        if low is not None and low >= 0 and isinstance(schema.get("pattern"), str):
            schema["pattern"] = schema["pattern"].replace("^-?", "^", 1)
        return schema


class ServiceCheckedJSONField(serializers.JSONField):
    """A JSON value as the request gives it: itself in a JSON body, its text (parsed with the bounds of
    :func:`jobs.validation.loads`) in a multipart or form body. What it holds is the service's to check,
    worded for its field (``Parameters: dropout: expected a finite number, got nan.``). ``example``: the
    field's value as JSON text, named in the error of a text that is not JSON (``Block`` for
    ``["Block"]``), so a multipart caller learns the field takes JSON, not a plain word or line."""

    def __init__(self, *args: Any, example: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.example = example

    def to_internal_value(self, data):
        if getattr(data, "is_json_string", False):
            try:
                return validation.loads(data)
            except validation.JSONInputError as exc:
                hint = (f" Give its JSON text, e.g. {self.example}."
                        if self.example and exc.decode_error is not None else "")
                raise serializers.ValidationError(f"{exc}{hint}") from None
        return data


@extend_schema_field({"type": "object", "additionalProperties": {}})
class JSONObjectField(ServiceCheckedJSONField):
    """A JSON object: in a JSON body as itself, in a multipart or form body as its JSON text."""


@extend_schema_field({"type": "array", "items": {"type": "string"}})
class JSONStringListField(ServiceCheckedJSONField):
    """A list of strings: in a JSON body as itself, in a multipart or form body as its JSON text."""


class ModelSpecSerializer(ServiceSerializerMixin, serializers.ModelSerializer):
    """A model (docs/user-code.md): kind ``builtin`` (an architecture and its parameters), ``code`` (an
    archive and ``entry_point`` package.module:function) or ``script`` (an archive and ``entry_point``
    train.py or -m package.module, with ``script_args``). The archive comes as a multipart ``code``
    file or, in JSON, as ``code_dir``, a directory on the server; an archive refused says which member
    and why (400)."""

    serializer_field_mapping = STRICT_TEXT_MAPPING
    known_fields_what = "a model"

    architecture = serializers.ChoiceField(
        choices=[*sorted(ARCHITECTURES), CUSTOM], required=False, allow_blank=True,
        help_text="Kind builtin: the registry's architecture. Set by the server for the other kinds "
                  "(code: custom; script: blank).")
    params = JSONObjectField(
        required=False, example='{"hidden_size": 128}', help_text="Kind builtin: architecture parameters; missing ones take the registry's defaults. "
                                  "An update that changes the architecture (or the kind) without params gives it "
                                  "that architecture's defaults. Kind code: the model function's keyword "
                                  "arguments. In a multipart body: the object's JSON text."
    )
    framework = serializers.ChoiceField(
        choices=list(FRAMEWORKS), required=False, help_text=ModelSpec._meta.get_field("framework").help_text,
        error_messages={"invalid_choice": f'"{{input}}" is not a framework: one of {", ".join(FRAMEWORKS)}.'})
    script_args = JSONStringListField(
        required=False, example='["--epochs", "3"]', help_text="Kind script: its arguments, e.g. [\"--epochs\", \"3\", \"--lr\", \"{train.lr}\"] (one "
                                           "each), or one string split as a shell would (never run by one), "
                                           "\"--epochs 3 --lr {train.lr}\"; {train.<field>} becomes the job's "
                                           "value (multipart: the JSON text).")
    shard_classes = JSONStringListField(
        required=False, example='["Block"]', help_text="Kind code, FSDP: class names sharded one fully_shard each, e.g. [\"Block\"]; "
                                  "[] = each top-level child (multipart: the JSON text).")
    code = CodeField(required=False, allow_empty_file=False)
    code_dir = serializers.CharField(
        required=False, allow_blank=True, write_only=True, max_length=4096,
        help_text="Instead of an uploaded code file: a directory on the server under TRAINBOARD_CODE_ROOTS.")
    team = share_team_field()

    class Meta:
        model = ModelSpec
        fields = ["id", "name", "description", "kind", "architecture", "params", "entry_point", "script_args",
                  "framework", "shard_classes", "image", "code", "code_dir", "team", "created_at", "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at"]

    def _code_kwargs(self, validated_data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """The service's ``code`` from the upload or ``code_dir`` (both: a 400), and where its errors go."""
        upload, directory = validated_data.pop("code", None), validated_data.pop("code_dir", "") or ""
        if upload is not None and directory:
            raise serializers.ValidationError({"code_dir": ["Give the code one way: an uploaded file (code) or a "
                                                            "directory on the server (code_dir), not both."]})
        if directory:
            return {**validated_data, "code": directory}, {"code": "code_dir"}
        return ({**validated_data, "code": upload} if upload is not None else validated_data), {}

    def _call_with_code(self, fn, validated_data: dict[str, Any], **kwargs: Any):
        values, field_map = self._code_kwargs(validated_data)
        try:
            return fn(**kwargs, **values)
        except DjangoValidationError as exc:
            raise to_drf_validation_error(exc, field_map) from None

    def _with_service_errors(self, errors: dict[str, Any]) -> dict[str, Any]:
        with code_archives.files_not_written():  # a rolled-back call: its archive must not stay behind
            return super()._with_service_errors(errors)

    def create(self, validated_data: dict[str, Any]) -> ModelSpec:
        return self._call_with_code(services.model_spec_create, validated_data, owner=self.context["request"].user)

    def update(self, instance: ModelSpec, validated_data: dict[str, Any]) -> ModelSpec:
        return self._call_with_code(services.model_spec_update, validated_data, model_spec=instance)


@extend_schema_field(OpenApiTypes.BINARY)
class _UploadedFileField(serializers.FileField):
    """A file in a request body (drf-spectacular documents a FileField as a URI, its response form)."""


class ModelSpecUploadSerializer(ModelSpecSerializer):
    """The multipart body of a model with its code uploaded (schema only: the same fields, ``code`` a file)."""

    code = _UploadedFileField(required=False, write_only=True,
                              help_text="The code: a .zip or .tar.gz of at most TRAINBOARD_CODE_MAX_BYTES.")


def _kind_choices() -> list[tuple[str, str]]:
    return list(registry.kind_choices())


def backend_config_help(schemas: Mapping[str, BackendSettings]) -> str:
    """The API's description of ``config``: each kind's settings from its adapter's declaration."""
    kinds = " ".join(f"{kind}: {'; '.join(s.describe() for s in schema)}." for kind, schema in schemas.items()
                     if schema.settings)
    return ("Adapter settings of the backend's kind; one left out takes the adapter's default. A setting "
            "marked staff only decides what the installation's machines run or where the worker sends its "
            "calls: only a staff user's backend may set it (400 otherwise); the installation's value is used "
            f"otherwise. {kinds}")


def backend_secrets_help(schemas: Mapping[str, BackendSettings]) -> str:
    """The API's description of ``secrets``: each kind's credentials from its adapter's declaration."""
    kinds = "; ".join(f"{kind}: {', '.join(secret.describe() for secret in schema.secrets)}"
                      for kind, schema in schemas.items() if schema.secrets)
    return (f"Write-only credentials, stored encrypted and never returned. {kinds}. Give every one that is not "
            "optional, or none to use the worker's own identity (a staff user's backend only, unless the "
            "installation lets everyone's). On update a key with a value replaces it, a "
            "missing or blank key keeps it.")


class BackendSerializer(ServiceSerializerMixin, serializers.ModelSerializer):
    """A compute backend. The kinds, and each kind's settings and credentials in the descriptions of
    ``config`` and ``secrets``, come from the registry and the adapters' declarations when the
    serializer is built (:meth:`get_fields`), so a registered provider is listed with nothing here."""

    serializer_field_mapping = STRICT_TEXT_MAPPING
    known_fields_what = "a backend"

    kind = serializers.ChoiceField(choices=[])
    config = serializers.DictField(required=False)
    secrets = serializers.DictField(
        child=serializers.CharField(allow_blank=True, max_length=20_000, trim_whitespace=True),
        required=False, write_only=True)
    clear_secrets = serializers.BooleanField(
        required=False, write_only=True, default=False,
        help_text="Update only: remove every stored credential first.")
    secrets_set = serializers.SerializerMethodField(
        help_text="Which credential keys are stored (names only, never values).")
    job_secrets = serializers.DictField(
        child=serializers.CharField(allow_blank=True, allow_null=True, max_length=20_000, trim_whitespace=True),
        required=False, write_only=True,
        help_text="Write-only environment variables set in every job of this backend (API tokens the user's "
                  'code needs), e.g. {"WANDB_API_KEY": "..."}; stored encrypted, never returned or logged. Names '
                  "as environment variables (not the launcher's RANK, MASTER_ADDR, ..., nor TRAINBOARD_*, SM_*, "
                  "AIP_*, AZUREML_*, CUDA_*). On update a name with a value replaces it, a blank or null value "
                  "removes it, a missing name keeps it.")
    clear_job_secrets = serializers.BooleanField(
        required=False, write_only=True, default=False,
        help_text="Update only: remove every stored job secret first.")
    job_secrets_set = serializers.SerializerMethodField(
        help_text="Which job secrets are stored (names only, never values).")
    team = share_team_field()
    state_deadlines = serializers.DictField(
        child=serializers.FloatField(), required=False,
        help_text='Seconds a job may stay in each non-terminal state before it is flagged stalled, e.g. '
                  '{"PENDING": 3600}; states left out use the server defaults (RUNNING: the job\'s max runtime '
                  "+ a margin). {} = all defaults.")

    class Meta:
        model = ComputeBackend
        fields = ["id", "name", "kind", "config", "enabled", "team", "secrets", "clear_secrets", "secrets_set",
                  "job_secrets", "clear_job_secrets", "job_secrets_set", "state_deadlines", "stall_policy",
                  "orphan_policy", "max_restarts", "hang_policy", "hang_deadline_s", "idle_policy",
                  "idle_gpu_util_pct", "idle_minutes", "preflight", "preflight_min_busbw_gbps",
                  "preflight_max_latency_us", "created_at", "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at"]
        extra_kwargs = {"hang_deadline_s": {
            # The service's bounds (jobs.services.resources), declared so the schema says them.
            "min_value": MIN_HANG_DEADLINE_S, "max_value": MAX_HANG_DEADLINE_S,
            "error_messages": {key: f"Hang deadline must be whole seconds from {MIN_HANG_DEADLINE_S} to "
                                    f"{MAX_HANG_DEADLINE_S} (30 days), or null for the job's own step time."
                               for key in ("min_value", "max_value")},
            "help_text": f"Seconds with no new step before a RUNNING job is hung, {MIN_HANG_DEADLINE_S} to "
                         f"{MAX_HANG_DEADLINE_S} (30 days); null = from the job's own step time, max(600, 20 × "
                         f"seconds per step, 3 × seconds between records) (docs/hangs.md)."},
            "max_restarts": {"min_value": 0, "max_value": MAX_RESTARTS, "help_text": (
            "How many times a job whose run is lost (a preemption the provider does not restart itself, a host "
            "that rebooted, a Slurm NODE_FAIL or PREEMPTED) is resubmitted from its last checkpoint before it "
            "ends FAILED, and (hang_policy restart) a hung run is stopped and restarted from it, lost and hung "
            "restarts counted together; 0 = never, at most 10. 0 is refused with hang_policy restart (choose "
            "cancel). A job's own error is never resubmitted (docs/recovery.md, docs/hangs.md).")}}

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        schemas = registry.registered_settings()
        fields["kind"].choices = _kind_choices()
        fields["config"].help_text = backend_config_help(schemas)
        fields["secrets"].help_text = backend_secrets_help(schemas)
        return fields

    def get_secrets_set(self, backend: ComputeBackend) -> list[str]:
        return sorted((backend.secrets or {}).keys())

    def get_job_secrets_set(self, backend: ComputeBackend) -> list[str]:
        return sorted((backend.job_secrets or {}).keys())

    def create(self, validated_data: dict[str, Any]) -> ComputeBackend:
        validated_data.pop("clear_secrets", None)
        validated_data.pop("clear_job_secrets", None)
        return self._call(services.backend_create, owner=self.context["request"].user, **validated_data)

    def update(self, instance: ComputeBackend, validated_data: dict[str, Any]) -> ComputeBackend:
        return self._call(services.backend_update, backend=instance, **validated_data)


# --- jobs ------------------------------------------------------------------------------------


@extend_schema_field({"oneOf": [{"type": "integer"}, {"type": "string"}]})
class OwnedNameOrIdField(serializers.Field):
    """One of the objects the requesting user may use (their own, or their team's), by its id or by
    its name, as the CLI names them (:func:`jobs.validation.owned`: an unknown name, or another
    user's, is "No dataset named 'x' that you can use"; a name given to several is an error listing
    their ids). Written back as the id."""

    default_error_messages = {"kind": "Give the {label}'s id (a whole number) or its name, not {kind}."}

    def __init__(self, model: type, label: str, **kwargs: Any) -> None:
        self.model, self.what = model, label
        kwargs.setdefault("help_text", f"The {label}'s id, or its name (one of yours or your teams'; "
                                       f"GET /api/{label}s/ lists them).")
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, float) and data.is_integer():
            data = int(data)
        if isinstance(data, bool) or not isinstance(data, (int, str)):
            kind = ("null" if data is None else str(data).lower() if isinstance(data, (bool, float))
                    else type(data).__name__)
            self.fail("kind", label=self.what, kind=kind)
        errors = validation.Errors()
        found = validation.owned(errors, self.field_name, self.model, data, self.context["request"].user, self.what)
        if found is None:
            raise serializers.ValidationError(errors.get(self.field_name) or [f"Choose one of your {self.what}s."])
        return found

    def to_representation(self, value) -> int:
        return value.pk


class JobEventSerializer(serializers.ModelSerializer):
    """A move from ``from_state`` to ``to_state``, or a note (``is_note``: ``to_state`` is "", the job
    stayed in ``from_state``; a wait reason, a stall)."""

    is_note = serializers.BooleanField(read_only=True, help_text="True when the job stayed in from_state.")

    class Meta:
        model = JobEvent
        fields = ["from_state", "to_state", "is_note", "message", "created_at"]


class JobAttemptSerializer(serializers.Serializer):
    """One run of a job (jobs.selectors.training_job_attempts): a lost one Trainboard resubmitted, or the
    current one (last)."""

    number = serializers.IntegerField(help_text="1 for the first run, then 2, …")
    provider_job_name = serializers.CharField(help_text="The run's name at the provider (…-a2 from the second).")
    started_at = serializers.DateTimeField(allow_null=True)
    ended_at = serializers.DateTimeField(allow_null=True)
    billable_seconds = serializers.FloatField(help_text="Seconds billed for this run, per instance.")
    cost_usd = serializers.DecimalField(max_digits=12, decimal_places=4,
                                        help_text="This run's cost; the job's cost_usd is the sum over its attempts.")
    outcome = serializers.CharField(help_text='"lost" (resubmitted), "hung" (stopped and restarted by the '
                                                'hang policy), or the job\'s state for the current attempt.')
    reason = serializers.CharField(help_text="Why it ended, as the backend said (\"\" while it runs).")
    checkpoint_uri = serializers.CharField(help_text="Where its checkpoints were (a closed attempt), or where the "
                                                     "current one resumed from; \"\" = the backend's default.")
    current = serializers.BooleanField(help_text="True for the attempt the job runs now (or ended with).")


class MetricSummarySerializer(serializers.Serializer):
    points = serializers.IntegerField(help_text="Points reported.")
    last_step = serializers.IntegerField()
    last_value = serializers.FloatField(allow_null=True,
                                        help_text="null when the trainer reported it NaN or infinite.")
    min = serializers.FloatField(allow_null=True, help_text="Over the finite points; null when none is finite.")
    max = serializers.FloatField(allow_null=True, help_text="Over the finite points; null when none is finite.")
    nonfinite = serializers.IntegerField(help_text="Points the trainer reported as NaN or infinite "
                                                   "(a diverged run).")


class RankThroughputSerializer(serializers.Serializer):
    """One rank's latest numbers (seconds are per optimizer step)."""

    rank = serializers.IntegerField()
    samples_per_s = serializers.FloatField(allow_null=True, help_text="Samples this rank trained per second "
                                                                      "(every stage of a pipeline trains each one).")
    step_time_s = serializers.FloatField(allow_null=True, help_text="compute_s + sync_wait_s: the same on every "
                                                                    "rank in synchronous training.")
    data_wait_s = serializers.FloatField(allow_null=True, help_text="Waiting for the next batch.")
    compute_s = serializers.FloatField(allow_null=True, help_text="This rank's own forward and backward, apart "
                                                                  "from waiting for other ranks.")
    sync_wait_s = serializers.FloatField(allow_null=True, help_text="The gradient sync and optimizer, including "
                                                                    "waiting for slower ranks.")
    stage = serializers.IntegerField(allow_null=True, help_text="Pipeline jobs: this rank's stage (0-based).")
    stage_layers = serializers.IntegerField(allow_null=True, help_text="Pipeline jobs: layers in that stage.")


class StragglerSerializer(serializers.Serializer):
    """The rank the others wait for (jobs.selectors.training_job_straggler)."""

    rank = serializers.IntegerField()
    stage = serializers.IntegerField(allow_null=True)
    time_to_sync_s = serializers.FloatField(help_text="Seconds per step it needs before the gradient sync "
                                                      "(data wait + forward + backward).")
    others_median_s = serializers.FloatField(help_text="The same for the other ranks (their median).")
    behind_pct = serializers.FloatField()
    data_wait_s = serializers.FloatField(allow_null=True)
    others_wait_s = serializers.FloatField(help_text="Seconds per step the other ranks together wait for it.")
    lost_s = serializers.FloatField(help_text="Rank-seconds spent waiting for the slowest rank over the run so far.")
    lost_usd = serializers.DecimalField(max_digits=14, decimal_places=4, allow_null=True,
                                        help_text="lost_s × the job's price per rank-second (hourly price per "
                                                  "instance / processes per node / 3600).")
    text = serializers.CharField()


class BoundSharesSerializer(serializers.Serializer):
    """Shares of a step over all ranks together (jobs.bounds.timing_shares), %."""

    ranks = serializers.IntegerField(help_text="Ranks whose latest timing was read.")
    data_pct = serializers.FloatField(help_text="Σ data wait / Σ (data wait + step time).")
    compute_pct = serializers.FloatField(allow_null=True, help_text="Σ compute / Σ step; null without compute "
                                                                    "figures (an older trainer).")
    sync_pct = serializers.FloatField(allow_null=True, help_text="Σ (step time − compute) / Σ step: the gradient "
                                                                 "sync and the optimizer, waiting included.")
    waiting_pct = serializers.FloatField(
        allow_null=True,
        help_text="Σ (the slowest rank's data wait + compute − the rank's own) / Σ step: waiting for the slowest.")
    slowest_rank = serializers.IntegerField(allow_null=True)


class BoundGpuSerializer(serializers.Serializer):
    """The GPU that stands out (jobs.bounds.gpu_outlier)."""

    rank = serializers.IntegerField()
    node = serializers.IntegerField(help_text="rank // processes per node.")
    gpu = serializers.IntegerField(help_text="Its index on the node: rank % processes per node (its LOCAL_RANK).")
    util_pct = serializers.FloatField(help_text="Its mean utilisation over its recent samples, %.")
    others_pct = serializers.FloatField(help_text="The median of the other GPUs' means, %.")
    more = serializers.IntegerField(help_text="Other GPUs as far below that median.")


class BoundSerializer(serializers.Serializer):
    """What bounds the run (jobs.bounds.bound)."""

    kind = serializers.ChoiceField(choices=["input", "sync", "compute", "gpus-underused"])
    text = serializers.CharField(help_text='One line, e.g. "input-bound: ranks wait for data 38 % of each step".')
    shares = BoundSharesSerializer(allow_null=True, help_text="From each rank's latest timing; null for a run that "
                                                              "reports none (a script).")
    gpu = BoundGpuSerializer(allow_null=True, help_text="A GPU at least 30 points below the others; null if none.")
    gpu_mean_pct = serializers.FloatField(allow_null=True, help_text="The GPUs' mean utilisation over their recent "
                                                                     "samples (the last 4 to 8 minutes), %.")


class JobWasteSerializer(serializers.Serializer):
    """The cost of waste of a job (jobs.selectors.training_job_waste): three parts, no second counted twice."""

    idle_s = serializers.FloatField(help_text="Seconds every GPU was below the backend's idle threshold.")
    idle_usd = serializers.DecimalField(max_digits=14, decimal_places=4,
                                        help_text="idle_s × instances × hourly_price_usd / 3600.")
    gpu_idle_s = serializers.FloatField(help_text="GPU-seconds single GPUs idled while another worked.")
    gpu_usd = serializers.DecimalField(max_digits=14, decimal_places=4,
                                       help_text="gpu_idle_s × hourly_price_usd / procs_per_node / 3600.")
    straggler_s = serializers.FloatField(help_text="Rank-seconds the ranks waited for the slowest to reach the "
                                                   "gradient sync (the trainer's wait_for_slowest_s, summed).")
    straggler_usd = serializers.DecimalField(max_digits=14, decimal_places=4,
                                             help_text="straggler_s × hourly_price_usd / procs_per_node / 3600.")
    total_usd = serializers.DecimalField(max_digits=14, decimal_places=4,
                                         help_text="idle_usd + gpu_usd + straggler_usd.")


class ConnectionCheckSerializer(serializers.Serializer):
    """One result of a backend's connection test."""

    name = serializers.CharField(help_text="What was checked, e.g. identity, bucket, SageMaker access.")
    ok = serializers.BooleanField()
    message = serializers.CharField(help_text="What was found; when not ok, what to do about it.")


class DeviceUseSerializer(serializers.Serializer):
    """The devices one active job holds on a backend that gives out its GPUs (a GPU box)."""

    devices = serializers.ListField(child=serializers.IntegerField(), help_text=(
        "GPU indices as CUDA_VISIBLE_DEVICES names them (on a box without GPUs, process slot numbers), "
        "ascending."))
    job = serializers.IntegerField(source="job_id", allow_null=True, help_text=(
        "The job holding them; null for a job you cannot see (another user's, on a backend shared with "
        "your team): its devices are taken all the same."))


class BackendQueueSerializer(serializers.Serializer):
    """What runs and waits on one backend (``jobs.selectors.backend_queue_for_user``)."""

    queue = serializers.CharField(help_text="The Celery queue the backend's tasks go to: gpubox.<name> for a "
                                            "GPU box, whose worker is the only one that consumes it; celery "
                                            "for a cloud backend.")
    running_count = serializers.IntegerField(help_text="Your visible jobs that hold their devices (SUBMITTING, "
                                                       "PENDING, RUNNING, STOPPING); listed by running-jobs/.")
    waiting_count = serializers.IntegerField(help_text="Your visible QUEUED jobs; listed by waiting-jobs/ in "
                                                       "the order they will start.")
    others_running = serializers.IntegerField(help_text="Running jobs you cannot see (counted only).")
    others_waiting = serializers.IntegerField(help_text="Waiting jobs you cannot see (counted only); they "
                                                        "may start before yours.")
    devices_in_use = DeviceUseSerializer(many=True, help_text="Each active job's devices, lowest first; "
                                                              "the backend's other devices are free.")
    devices_held = serializers.ListField(child=serializers.IntegerField(),
                                         help_text="Every device some active job holds, ascending.")
    devices_free = serializers.ListField(
        child=serializers.IntegerField(), allow_null=True,
        help_text="The backend's devices no active job holds, ascending, when the dashboard knows its devices "
                  "(a GPU box whose gpu_ids are set on the backend itself); null when the box counts them "
                  "itself (NVML or its worker's host settings): a waiting job's wait_reason says how many were free.")
    device_kind = serializers.ChoiceField(choices=["gpu", "slot"], allow_null=True, help_text=(
        "What the devices are: GPU indices, or process slots on a box without GPUs; null when the box counts "
        "them itself (the dashboard does not know which)."))


class BackendQueueJobSerializer(serializers.ModelSerializer):
    """A job as the backend page lists it: who, what state, its place in line and why it waits."""

    display_name = serializers.CharField(source="__str__", read_only=True,
                                         help_text='name, or "job-<id>" for a job launched without one.')
    owner = serializers.CharField(source="owner.username", read_only=True)

    class Meta:
        model = TrainingJob
        fields = ["id", "display_name", "owner", "state", "priority", "wait_reason", "allocated_gpus",
                  "nodes", "procs_per_node", "created_at", "submitted_at", "started_at"]
        read_only_fields = fields
        extra_kwargs = {
            "wait_reason": {"help_text": 'Why a QUEUED job has not started, e.g. "waiting for 4 GPUs on box-a '
                                         '(2 free)"; "" = not waiting, or not yet seen by the backend\'s worker.'},
            "allocated_gpus": {"help_text": "The GPU indices (slots on a box without GPUs) the job holds while it "
                                            "runs; [] = none."},
        }


class JobHangRankSerializer(serializers.Serializer):
    rank = serializers.IntegerField(help_text="The rank (0-based).")
    where = serializers.CharField(help_text='Where it is stuck: "in all_reduce, train.py:212" (innermost function, '
                                            'then the innermost line of the job\'s own code); "" = no stack.')


class JobHangSerializer(serializers.Serializer):
    """A hung job's finding (jobs.hangs)."""

    source = serializers.CharField(help_text='"launcher" (with stacks) or "sweep" (from the progress, no stacks).')
    step = serializers.IntegerField(allow_null=True, help_text="The last step reported before it stopped.")
    step_time = serializers.FloatField(allow_null=True, help_text="That step's time, Unix seconds.")
    deadline_s = serializers.FloatField(allow_null=True, help_text="The hang deadline in force, seconds.")
    reason = serializers.CharField(help_text="One line: the deadline, the last step and where the ranks are.")
    ranks = JobHangRankSerializer(many=True, help_text="Each rank's position, by rank.")


class JobIdleSerializer(serializers.Serializer):
    """A job's GPU idleness (jobs.idle): the cost of waste, and what its backend's idle policy did."""

    gpus = serializers.IntegerField(help_text="GPUs the launcher's samples reported (by rank).")
    threshold_pct = serializers.IntegerField(
        allow_null=True, help_text="The backend's idle threshold the samples were judged by: a GPU below this "
                                   "utilisation (%) is idle.")
    since = serializers.DateTimeField(
        allow_null=True, help_text="Since when every GPU has been below the threshold; null = one is busy.")
    idle_for_s = serializers.FloatField(help_text="Seconds idle as of the newest sample (0 = not idle now).")
    idle_s = serializers.FloatField(help_text="Seconds of the run in which every GPU was below the threshold.")
    waste_usd = serializers.DecimalField(
        max_digits=14, decimal_places=4,
        help_text="The cost of waste: idle_s × instances × hourly_price_usd / 3600 (the whole job's machines).")
    gpu_idle_s = serializers.FloatField(
        help_text="GPU-seconds in which single GPUs were below the threshold while another GPU was not, summed "
                  "over the GPUs (not counted in idle_s).")
    gpu_waste_usd = serializers.DecimalField(
        max_digits=14, decimal_places=4,
        help_text="Their cost: gpu_idle_s × hourly_price_usd / procs_per_node / 3600 (each GPU its share of its "
                  "machine).")
    at = serializers.DateTimeField(
        allow_null=True, help_text="When the backend's idle policy found the job idle (the newest sample's time) "
                                   "and warned or stopped it; null = it did not (a busy sample clears it).")
    reason = serializers.CharField(help_text='The policy\'s line, e.g. "Idle: all 4 GPUs below 10% for 30 min; '
                                             'stopping it saves $21.36 (5340 s left of its max runtime × 2 nodes '
                                             '× $7.20/h = $21.36)"; "" when at is null.')
    saved_usd = serializers.DecimalField(
        max_digits=14, decimal_places=4, allow_null=True,
        help_text="What stopping the job saves from at: the seconds to its projected end (known length) or else "
                  "to its max runtime, whichever is sooner, × instances × hourly_price_usd / 3600, at most what its "
                  "budget has left; null when at is null.")


class JobPreflightSizeSerializer(serializers.Serializer):
    bytes = serializers.IntegerField(help_text="The all-reduce's size, bytes (float32).")
    time_us = serializers.FloatField(allow_null=True, help_text="The slowest rank's mean time per all-reduce, µs.")
    algbw_gbps = serializers.FloatField(allow_null=True, help_text="bytes / time, GB/s (10⁹ bytes).")
    busbw_gbps = serializers.FloatField(allow_null=True, help_text="algbw × 2(n−1)/n for n ranks (nccl-tests), GB/s.")


class JobPreflightPairSerializer(serializers.Serializer):
    units = serializers.ListField(child=serializers.IntegerField(),
                                  help_text="The pair's two nodes (or ranks, on one node), by index.")
    ranks = serializers.ListField(child=serializers.IntegerField(), help_text="The ranks that measured it.")
    hosts = serializers.ListField(child=serializers.CharField(), help_text="Their host names.")
    gbps = serializers.FloatField(help_text="2 × message bytes / the time of a send and a receive each way, GB/s.")


class JobPreflightSerializer(serializers.Serializer):
    """The network preflight's figures (jobs.preflight, trainer_pkg.preflight): what the ranks measured
    before the first step, and why it stopped the run when it did."""

    at = serializers.DateTimeField(help_text="When it ran (the launcher's clock).")
    ok = serializers.BooleanField(help_text="False when it stopped the run (reason says why).")
    reason = serializers.CharField(help_text='Why the run was stopped, naming the slow node or pair, e.g. "Preflight: '
                                             'all-reduce bus bandwidth 0.9 GB/s is below the backend\'s minimum of 10 '
                                             'GB/s …"; "" when ok.')
    world_size = serializers.IntegerField(allow_null=True)
    nodes = serializers.IntegerField(allow_null=True)
    backend = serializers.CharField(help_text="The process group's backend: nccl or gloo.")
    busbw_gbps = serializers.FloatField(allow_null=True, help_text="The largest size's all-reduce bus bandwidth, GB/s.")
    algbw_gbps = serializers.FloatField(allow_null=True, help_text="The largest size's algorithm bandwidth, GB/s.")
    latency_us = serializers.FloatField(allow_null=True, help_text="The slowest rank's mean time of a 4-byte "
                                                                   "all-reduce, µs.")
    sizes = JobPreflightSizeSerializer(many=True)
    pairs = JobPreflightPairSerializer(many=True, help_text="The slowest node pairs first (at most 32).")
    pairs_measured = serializers.IntegerField(allow_null=True)
    pair_unit = serializers.CharField(help_text='"node" (pairs of nodes), or "rank" for a job on one node.')
    duration_s = serializers.FloatField(allow_null=True, help_text="Seconds the preflight took.")
    min_busbw_gbps = serializers.FloatField(allow_null=True, help_text="The backend's minimum then; null = none.")
    max_latency_us = serializers.FloatField(allow_null=True, help_text="The backend's maximum then; null = none.")


class JobProgressSerializer(serializers.Serializer):
    """A job's progress (jobs.progress.Progress): % done, time left from the recent step rate and the
    projected final cost, from the job's own columns (no metric point read)."""

    total_steps = serializers.IntegerField(help_text="The steps the run takes, as the trainer (or the script's "
                                                     "report.progress(total=...)) reported.")
    step = serializers.IntegerField(help_text="Steps done at the newest record read.")
    fraction = serializers.FloatField(help_text="step / total_steps, 0 to 1.")
    percent = serializers.FloatField(help_text="fraction × 100.")
    steps_per_s = serializers.FloatField(
        allow_null=True, help_text="Step rate over the last 8 records of the current run; null until measured.")
    eta_s = serializers.FloatField(
        allow_null=True, help_text="Seconds left from now: the steps left over steps_per_s, counted from the newest "
                                   "record; null unless RUNNING with a measured rate, and null while the job is "
                                   "hung (hung true): a hung run has no end to project.")
    finish_at = serializers.DateTimeField(
        allow_null=True, help_text="When the last step is projected to end; null as for eta_s.")
    projected_cost_usd = serializers.DecimalField(
        max_digits=14, decimal_places=4, allow_null=True,
        help_text="cost_usd + the seconds from the last sync to finish_at × instances × hourly_price_usd / 3600; "
                  "null as for eta_s. While the job is hung (hung true) it is projected instead to the end of its "
                  "max runtime (started_at + max_runtime_s), which a hung run bills until; null when its start is "
                  "not known. A spot job is priced as if not interrupted; with hourly_price_usd 0 "
                  "(price_known false) it adds nothing.")
    hung = serializers.BooleanField(
        help_text="True while the running job is flagged hung (hung_at set, no newer step since): eta_s and "
                  "finish_at are null and projected_cost_usd is the cost at the end of its max runtime.")
    price_known = serializers.BooleanField(help_text="False when hourly_price_usd is 0: the time left is not priced.")
    arithmetic = serializers.CharField(help_text='The sums behind the figures, e.g. "200 of 1000 steps at 2.00 '
                                                 'steps/s: 400 s left after the last record; $0.05 so far + 390 s '
                                                 '× 2 nodes × $3.60/h = $0.83".')


EXPERIMENT_FIELDS = ["final_metrics", "tags", "notes", "archived", "archived_at"]
"""The experiment table's fields of a job (docs/experiments.md); ``PATCH /api/jobs/{id}/`` changes
``tags``, ``notes`` and ``archived`` (:class:`TrainingJobAnnotateSerializer`)."""


class TrainingJobSerializer(serializers.ModelSerializer):
    """A job as listed: its shape, state, times and cost."""

    final_metrics = serializers.DictField(
        child=serializers.FloatField(allow_null=True), read_only=True,
        help_text="The last value of each global metric the job reported (val_accuracy, val_loss, train_loss, a "
                  "script's own names), null where it was not finite; what ?ordering=-val_accuracy sorts by.")
    tags = serializers.ListField(child=serializers.CharField(), read_only=True,
                                 help_text="Short labels, sorted: lower-case letters, digits, _ . -; at most 20 of 50 "
                                           "characters. ?tag= filters the list.")
    notes = serializers.CharField(read_only=True, help_text="The owner's notes (at most 10,000 characters).")
    archived = serializers.SerializerMethodField(
        help_text="True when the job is archived: left out of the list unless ?archived=1 (archived only) or all.")

    world_size = serializers.IntegerField(read_only=True)
    is_terminal = serializers.BooleanField(read_only=True)
    duration_s = serializers.FloatField(read_only=True, allow_null=True)
    spot_saving = serializers.FloatField(
        read_only=True, allow_null=True,
        help_text="Spot jobs: fraction of the on-demand cost saved, 1 − (billable seconds × hourly_price_usd) / "
                  "(training seconds × on_demand_price_usd) (0.3 = 30%): fewer billed seconds on SageMaker, a "
                  "lower hourly price on Vertex AI and Azure ML; null until the provider reports the training "
                  "time, and for on-demand jobs.")
    on_demand_cost_usd = serializers.DecimalField(
        max_digits=12, decimal_places=4, read_only=True, allow_null=True,
        help_text="Spot jobs: what the run would have cost on demand, training seconds × instances × "
                  "on_demand_price_usd; null as for spot_saving.")

    estimate_arithmetic = serializers.SerializerMethodField(
        help_text="How estimated_cost_usd was reached: min(max_runtime_s × nodes × hourly_price_usd, budget_usd), "
                  'e.g. "7200 s × 2 nodes × $1.4084/h = $5.6336, capped at the $3.0000 budget", money '
                  "at the precision of the job's own figures.")
    max_runtime_covers = serializers.CharField(
        source="backend.max_runtime_covers", read_only=True,
        help_text="What max_runtime_s counts on this job's backend, as the provider documents it (start-up "
                  "included).")

    display_name = serializers.CharField(
        source="__str__", read_only=True,
        help_text='The name the UI shows: name, or "job-<id>" for a job launched without one.')
    stalled = serializers.SerializerMethodField(
        help_text="True when the job is past its state's deadline (see stalled_reason); cleared by its next "
                  "state change.")
    hang = serializers.SerializerMethodField(
        help_text="Why the job is flagged hung (hung_at set: no new step for its hang deadline): the last step, "
                  "the deadline and where each rank is stuck; the full stacks are on the job page. Null when "
                  "not hung.")
    idle = serializers.SerializerMethodField(
        help_text="The job's GPU idleness from the launcher's samples: the cost of waste (idle_s, waste_usd) and "
                  "what the backend's idle policy did (at, reason, saved_usd). Null for a job without GPU "
                  "figures (CPU only): it is never idle.")
    preflight = serializers.SerializerMethodField(
        help_text="The network preflight before the first step (the backend's preflight setting): all-reduce bus "
                  "bandwidth and latency, each node pair's bandwidth, and the reason when it stopped the run. Null "
                  "when none ran.")
    budget_usd = serializers.DecimalField(
        max_digits=12, decimal_places=4, min_value=0, read_only=True, allow_null=True,
        help_text="Stop the job when its cost reaches this (USD, 0 or more); null = no budget.")
    progress = serializers.SerializerMethodField(
        help_text="% done, time left and projected final cost of a job with a known length (epochs or "
                  "train.max_steps for the built-in trainer, report.progress(total=...) for a script); null when "
                  "the length is not known or no step was reported yet.")

    class Meta:
        model = TrainingJob
        fields = [
            "id", "name", "display_name", "state", "is_terminal", "stalled", "stalled_reason", "stalled_at", "dataset", "model_spec", "backend", "rerun_of",
            "strategy", "nodes", "procs_per_node", "world_size", "instance_type", "spot",
            "max_runtime_s", "max_runtime_covers", "budget_usd", "hourly_price_usd", "on_demand_price_usd",
            "estimated_cost_usd",
            "estimate_arithmetic", "cost_usd",
            "billable_seconds", "training_seconds", "spot_saving", "on_demand_cost_usd", "instance_count", "raw_state", "secondary_state", "failure_reason",
            "status_warning", "team", "budget_exceeded_at", "created_at", "submitted_at", "started_at",
            "ended_at", "duration_s", "priority", "wait_reason", "allocated_gpus",
            "attempt", "metric_points_pruned_at", "progress", "hung_at", "hang", "idle", "preflight",
        ]
        fields = fields + EXPERIMENT_FIELDS  # the experiment table (docs/experiments.md)
        read_only_fields = fields
        extra_kwargs = {"hung_at": {"help_text": "When the running job was found hung (no new step for its "
                                                 "backend's hang deadline); null = not hung. A newer step clears it."},
                        "budget_exceeded_at": {"help_text": "When the job's cost reached its budget_usd and it "
                                                            "was stopped; null otherwise."},
                        "team": {"help_text": "The team the job runs for (its monthly budget); null = none."},
                        "priority": {"help_text": "Higher starts first where the backend queues jobs itself (a GPU "
                                                  "box whose GPUs are taken); equal priorities in submission order."},
                        "wait_reason": {"help_text": 'Why a QUEUED job has not started, e.g. "waiting for 4 GPUs '
                                                     'on box-a (2 free)"; "" = not waiting.'},
                        "allocated_gpus": {"help_text": "The GPU indices (on a CPU-only box, slot numbers) a GPU box "
                                                        "gave the job while it is active; [] = none."},
                        "max_runtime_s": {"help_text": MAX_RUNTIME_HELP},
                        "attempt": {"help_text": "The run now tracked: 1, then 2, … each time a lost run was "
                                                 "resubmitted from its checkpoint (see attempts); cost_usd and "
                                                 "billable_seconds are summed over them."},
                        "estimated_cost_usd": {"help_text": "What the job may cost, fixed at submission: "
                                                            "min(max_runtime_s × nodes × hourly_price_usd / 3600, "
                                                            "budget_usd); see estimate_arithmetic."}}

    @extend_schema_field(JobHangSerializer(allow_null=True))
    def get_hang(self, job: TrainingJob) -> dict[str, Any] | None:
        if job.hung_at is None:
            return None
        hang = job.hang if isinstance(job.hang, dict) else {}
        return JobHangSerializer({"source": hang.get("source", ""), "step": hang.get("step"),
                                  "step_time": hang.get("step_time"), "deadline_s": hang.get("deadline_s"),
                                  "reason": hangs.hang_reason(hang),
                                  "ranks": [{"rank": r.get("rank"), "where": r.get("where", "")}
                                            for r in hang.get("ranks") or []]}).data

    @extend_schema_field(JobIdleSerializer(allow_null=True))
    def get_idle(self, job: TrainingJob) -> dict[str, Any] | None:
        found = selectors.training_job_idle(job=job)
        return None if found is None else JobIdleSerializer(found).data

    @extend_schema_field(JobPreflightSerializer(allow_null=True))
    def get_preflight(self, job: TrainingJob) -> dict[str, Any] | None:
        found = selectors.training_job_preflight(job=job)
        return None if found is None else JobPreflightSerializer(found).data

    def get_stalled(self, job: TrainingJob) -> bool:
        return job.stalled_at is not None

    @extend_schema_field(JobProgressSerializer(allow_null=True))
    def get_progress(self, job: TrainingJob) -> dict[str, Any] | None:
        progress = job.progress
        if progress is None:
            return None
        return JobProgressSerializer({**dataclasses.asdict(progress), "percent": progress.percent}).data

    def get_archived(self, job: TrainingJob) -> bool:
        return job.archived_at is not None

    def get_estimate_arithmetic(self, job: TrainingJob) -> str:
        return estimate_arithmetic(max_runtime_s=job.max_runtime_s, instances=job.nodes,
                                   hourly_price_usd=job.hourly_price_usd, budget_usd=job.budget_usd,
                                   places=job.money_places)


class JobCodeSerializer(serializers.Serializer):
    """What code a job ran (jobs.selectors.training_job_code): its recorded archive, not the model now."""

    kind = serializers.ChoiceField(choices=["builtin", "code", "script"],
                                   help_text="builtin: a built-in architecture; code: the user's model function "
                                             "trained by Trainboard's trainer; script: the user's training script.")
    sha256 = serializers.CharField(help_text="Hex SHA-256 of the code archive; \"\" for a built-in model.")
    entry_point = serializers.CharField(help_text="Kind code: package.module:function.")
    script = serializers.CharField(help_text="Kind script: train.py or -m package.module.")
    args = serializers.ListField(child=serializers.CharField(), help_text="Kind script: its arguments.")
    framework = serializers.CharField(help_text="Kind script: how its processes started (torch, tensorflow, ray, "
                                                "mpi; docs/user-code.md); \"\" for the other kinds.")
    requirements = serializers.CharField(help_text="The archive's requirements.txt text.")


class TrainingJobDetailSerializer(TrainingJobSerializer):
    """A job with its frozen config, state timeline, metrics summary and per-rank throughput, and the
    code, image, environment and dataset fingerprint it ran with (never the backend's job secrets)."""

    code = serializers.SerializerMethodField()
    env = serializers.DictField(child=serializers.CharField(), read_only=True,
                                help_text="The job's own environment variables (the backend's job secrets are "
                                          "set too, and never shown).")
    dataset_fingerprint = serializers.JSONField(
        read_only=True, allow_null=True,
        help_text='What identified the data when the job was created (local: {"kind": "local", "size_bytes", '
                  '"files", "mtime", "sample_sha256"}; builtin: {"kind", "name"}) or submitted (s3/gs: '
                  '{"kind", "uri", "objects", "size_bytes", "last_modified", "listing_sha256", "truncated"}; '
                  'a failed listing: {"kind", "uri", "error"}); null until taken.')
    events = serializers.SerializerMethodField()
    attempts = serializers.SerializerMethodField(
        help_text="The job's runs in order: each lost run Trainboard resubmitted, then the current one.")
    metrics = serializers.SerializerMethodField()
    ranks = serializers.SerializerMethodField()
    straggler = serializers.SerializerMethodField(
        help_text="The rank the others wait for; null when no rank is meaningfully (10%) slower.")
    waste = serializers.SerializerMethodField(
        help_text="The cost of waste: every GPU idle, single GPUs idle while others worked, and ranks waiting for "
                  "the slowest; null for a job with no GPU figure and no waiting measured.")
    bound = serializers.SerializerMethodField(
        help_text="What bounds the run, from the ranks' latest timing and the GPUs' recent utilisation; null "
                  "when the job reported neither.")
    memory_plan = serializers.JSONField(
        read_only=True, allow_null=True,
        help_text="The memory plan made when the job was created (trainer_pkg.memory_plan): per-rank bytes of "
                  "params_bytes, grads_bytes, optimizer_bytes, activations_bytes, buffers_bytes, host_bytes (CPU "
                  "offload; offloaded: its params_bytes, grads_bytes, optimizer_bytes), peak_bytes, needed_bytes (the "
                  "peak, plus host_bytes on a machine without GPUs), device_bytes (one GPU's memory; null = not known: never "
                  "refused), fits, lines (the arithmetic), suggestion, summary; null when no plan could be made (a "
                  "custom model or a script, data whose shape was not read). A job whose plan does not fit is "
                  "refused at creation with that arithmetic.")
    rank_memory = serializers.JSONField(
        read_only=True, allow_null=True,
        help_text="The trainer's last measured memory, a list indexed by rank of {peak_bytes, params_bytes, "
                  "grads_bytes, optimizer_bytes, activations_bytes, device} (GPU: peak = "
                  "torch.cuda.max_memory_allocated; CPU: the sum of the others); null until reported.")

    # Lineage (issue 16, docs/clone-continue.md): one block.
    lineage = serializers.SerializerMethodField(
        help_text='Where the job came from and what was made from it: {"text": "continued from #12 (checkpoint '
                  'epoch 3)" | "fine-tuned from #12" | "cloned from #12" | "", "parent": {"id", "name"} | null, '
                  '"init_mode": "" | "continue" | "finetune", "source_checkpoint_epoch", "derived": [{"id", '
                  '"name", "state", "text"}]} (only jobs you can see).')
    class Meta(TrainingJobSerializer.Meta):
        fields = TrainingJobSerializer.Meta.fields + ["config", "code", "image", "env", "dataset_fingerprint",
                                                      "events", "metrics", "ranks", "straggler", "bound", "waste",
                                                      "memory_plan", "rank_memory"] + [
            "cloned_from", "source_job", "init_mode", "source_checkpoint_epoch", "lineage"] + ["attempts"]
        read_only_fields = fields

    @extend_schema_field(serializers.JSONField())
    def get_lineage(self, job: TrainingJob) -> dict[str, Any]:
        request = self.context.get("request")
        return selectors.training_job_lineage(job=job, user=request.user if request is not None else job.owner)

    @extend_schema_field(JobCodeSerializer)
    def get_code(self, job: TrainingJob) -> dict[str, Any]:
        code = selectors.training_job_code(job=job)
        return {key: code[key] for key in ("kind", "sha256", "entry_point", "script", "args", "framework",
                                           "requirements")}

    @extend_schema_field(JobEventSerializer(many=True))
    def get_events(self, job: TrainingJob) -> list[dict[str, Any]]:
        return JobEventSerializer(selectors.training_job_events(job=job), many=True).data

    @extend_schema_field(JobAttemptSerializer(many=True))
    def get_attempts(self, job: TrainingJob) -> list[dict[str, Any]]:
        return JobAttemptSerializer(selectors.training_job_attempts(job=job), many=True).data

    @extend_schema_field(serializers.DictField(child=MetricSummarySerializer()))
    def get_metrics(self, job: TrainingJob) -> dict[str, dict[str, Any]]:
        return selectors.training_job_metric_summary(job=job)

    @extend_schema_field(RankThroughputSerializer(many=True))
    def get_ranks(self, job: TrainingJob) -> list[dict[str, Any]]:
        return RankThroughputSerializer(self._ranks(job), many=True).data

    @extend_schema_field(StragglerSerializer(allow_null=True))
    def get_straggler(self, job: TrainingJob) -> dict[str, Any] | None:
        straggler = selectors.training_job_straggler(job=job, ranks=self._ranks(job))
        return StragglerSerializer(straggler).data if straggler else None

    @extend_schema_field(JobWasteSerializer(allow_null=True))
    def get_waste(self, job: TrainingJob) -> dict[str, Any] | None:
        found = selectors.training_job_waste(job=job)
        return JobWasteSerializer(found).data if found else None

    @extend_schema_field(BoundSerializer(allow_null=True))
    def get_bound(self, job: TrainingJob) -> dict[str, Any] | None:
        found = selectors.training_job_bound(job=job, ranks=self._ranks(job))
        return BoundSerializer(found).data if found else None

    def _ranks(self, job: TrainingJob) -> list[dict[str, Any]]:
        cache = self.context.setdefault("_ranks", {})
        if job.pk not in cache:
            cache[job.pk] = selectors.training_job_rank_throughput(job=job)
        return cache[job.pk]


class TrainingJobPreviewSerializer(TrainingJobDetailSerializer):
    """The job ``POST /api/jobs/estimate/`` would create (``services.training_job_preview``, not saved:
    id null), as :class:`TrainingJobDetailSerializer` shows a job, with no history: no events,
    attempts, metrics, ranks or figures derived from them, and no jobs made from it."""

    def get_lineage(self, job: TrainingJob) -> dict[str, Any]:
        return {"text": job.lineage_text, "parent": None, "init_mode": job.init_mode,
                "source_checkpoint_epoch": job.source_checkpoint_epoch, "derived": []}

    def get_events(self, job: TrainingJob) -> list[dict[str, Any]]:
        return []

    def get_attempts(self, job: TrainingJob) -> list[dict[str, Any]]:
        return []

    def get_metrics(self, job: TrainingJob) -> dict[str, dict[str, Any]]:
        return {}

    def get_ranks(self, job: TrainingJob) -> list[dict[str, Any]]:
        return []

    def get_straggler(self, job: TrainingJob) -> None:
        return None

    def get_waste(self, job: TrainingJob) -> None:
        return None

    def get_bound(self, job: TrainingJob) -> None:
        return None


def request_serializer_field(field: job_request.RequestField) -> serializers.Field:
    """The API field of a job request's ``field`` (not a ``ref``): its kind, default, choices and help as
    declared; the minimum (and a job-level field's maximum) checked here, a config field's maximum by
    the service, whose message shows the figures."""
    given: dict[str, Any] = dict(help_text=field.help or None)
    if field.required:
        pass
    elif field.optional:
        given.update(required=False, allow_null=True, default=None)
    else:
        given.update(default=field.default)
    bounds = {"min_value": field.minimum} if field.minimum is not None else {}
    if field.maximum is not None and not field.config:
        bounds["max_value"] = field.maximum
    if field.kind == "int":
        return serializers.IntegerField(**bounds, **given)
    if field.kind == "float":
        return serializers.FloatField(**bounds, **given)
    if field.kind == "decimal":
        return serializers.DecimalField(max_digits=12, decimal_places=4, **bounds, **given)
    if field.kind == "bool":
        return serializers.BooleanField(**given)
    if field.kind == "choice":
        return serializers.ChoiceField(choices=list(field.choices), **given)
    if field.kind == "text":
        return serializers.CharField(required=False, allow_blank=True, max_length=field.max_length, **given)
    if field.kind == "object":
        return StoredJSONField(**given)
    raise ValueError(f"{field.name}: no API field for kind {field.kind!r}")  # a declaration bug


def job_request_serializer_fields(fields=job_request.JOB_REQUEST) -> dict[str, serializers.Field]:
    """The fields of ``POST /api/jobs/`` (and so its OpenAPI schema): one per job request field, in
    the declaration's order; the rows (dataset, model, backend, team) by id or name."""
    rows = {
        "dataset": lambda f: OwnedNameOrIdField(Dataset, "dataset", required=False, allow_null=True, default=None,
                                                help_text=f.help + " GET /api/datasets/ lists them; null or left "
                                                                   "out for a script model."),
        "model_spec": lambda f: OwnedNameOrIdField(ModelSpec, "model"),
        "backend": lambda f: OwnedNameOrIdField(ComputeBackend, "backend"),
        "team": lambda f: TeamField(required=False, allow_null=True, default=None, help_text=f.help),
    }
    return {f.name: rows[f.name](f) if f.name in rows else request_serializer_field(f) for f in fields}


_JobRequestSerializer = serializers.SerializerMetaclass(
    "_JobRequestSerializer", (serializers.Serializer,),
    {"__module__": __name__, **job_request_serializer_fields()})


class TrainingJobCreateSerializer(ServiceSerializerMixin, _JobRequestSerializer):
    """What ``POST /api/jobs/`` takes: the job request (:data:`jobs.job_request.JOB_REQUEST`), large-model
    and pipeline settings included; values go to ``jobs.services.training_job_create``. An unknown key
    is a 400 naming it."""

    known_fields_what = "a job"
    field_aliases = JOB_FIELD_ALIASES

    def create(self, validated_data: dict[str, Any]) -> TrainingJob:
        return self._call(services.training_job_create, owner=self.context["request"].user, **validated_data)

    def check(self, validated_data: dict[str, Any]) -> None:
        """The request's checks without writing (``services.training_job_check``), for a request with
        field errors of its own: the service's errors on the other fields join them."""
        self._call(services.training_job_check, owner=self.context["request"].user, **validated_data)

    def to_representation(self, instance: TrainingJob) -> dict[str, Any]:
        return TrainingJobDetailSerializer(instance, context=self.context).data



class TrainingJobAnnotateSerializer(KnownFieldsMixin, serializers.Serializer):
    """What ``PATCH /api/jobs/{id}/`` takes: any of ``tags``, ``notes``, ``archived`` (the owner or staff
    only); every other field of a job is read-only, and naming one is a 400. The values go to
    ``jobs.services.training_job_annotate``, which checks them (all problems at once)."""

    tags = serializers.JSONField(required=False, help_text="A list of tags (or one string of them separated by "
                                                           "commas); replaces the job's tags.")
    notes = serializers.JSONField(required=False, help_text="Text, at most 10,000 characters; replaces the notes.")
    archived = serializers.JSONField(required=False, help_text="true: archive (only a job that has ended); false: "
                                                               "unarchive.")

    known_fields_what = "a job's PATCH"

    def unknown_field_errors(self, data: Mapping[str, Any]) -> validation.Errors:
        """A field of a job other than these is read-only (said so); any other key is unknown."""
        job_fields = set(TrainingJobDetailSerializer.Meta.fields)
        read_only = sorted(key for key in data if key in job_fields and key not in self.fields)
        errors = super().unknown_field_errors({key: None for key in data if key not in job_fields})
        for name in read_only[:validation.MAX_UNKNOWN_FIELDS]:
            errors.add(name, f"{name} is read-only: a job's tags, notes and archived can be changed, nothing else.")
        return errors

    def validate(self, attrs):
        if not attrs:
            raise serializers.ValidationError({api_settings.NON_FIELD_ERRORS_KEY: [
                "Send tags, notes or archived to change; nothing else of a job can be changed."]})
        return attrs


class JobLogLineSerializer(serializers.Serializer):
    seq = serializers.IntegerField(help_text="The line's number in the job's log, from 0.")
    text = serializers.CharField()


class JobLogPageSerializer(serializers.Serializer):
    """``GET /api/jobs/{id}/logs/``: lines after the cursor and the next cursor."""

    lines = JobLogLineSerializer(many=True)
    next = serializers.IntegerField(help_text="Pass as ?after= for the lines that follow (stable while the job "
                                              "still writes: lines up to it were all looked at).")
    more = serializers.BooleanField(help_text="True when more lines already match after next.")
