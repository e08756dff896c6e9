"""The backend contract: what every compute backend (SageMaker, Vertex AI, Azure ML, a GPU box) offers.

A *backend* is a place that runs one distributed training job from a :class:`JobSpec` and reports
on it. The dashboard never talks to a provider SDK directly: it builds a ``JobSpec``, calls
:meth:`Backend.submit`, and later asks :meth:`Backend.describe_many` how its jobs are doing. Typed
records cross this boundary in both directions; provider dicts never leave an adapter.

This module imports nothing from Django and nothing from any provider SDK, so it can be used by the
web process, the Celery workers and tests alike.

Operations (each documented on :class:`Backend`):

* ``validate(spec)``      -- reject an impossible request before any API call; never side-effects.
* ``submit(spec)``        -- start the job; **idempotent by** ``spec.job_name``: a second call for the
  same name adopts the job the first call created and never starts a second (billable) one.
* ``describe(handle)`` / ``describe_many(handles)`` -- the job's current :class:`JobStatus`.
* ``cancel(handle)``      -- ask the provider to stop the job; idempotent, returns at once. The job's
  state becomes CANCELLED only when a later ``describe`` confirms it.
* ``logs(handle, cursor)`` -- new log lines since ``cursor`` and the cursor to pass next time.
* ``price(instance_type, spot)`` -- USD per instance-hour.
* ``list_tagged()``       -- the provider jobs carrying Trainboard's tag that have not ended (for the
  orphan reconciler, ``jobs.orphans``).

The cloud adapters implement these once, in :class:`cloud_adapters.cloud.CloudBackend`, over small
hooks for their provider's calls.

A backend is built as ``Backend(config, secrets=..., prices=...)``: ``config`` is checked by
``clean_config`` against the kind's settings, declared once in :attr:`Backend.settings`
(:mod:`cloud_adapters.settings`), from which the dashboard also builds its forms and the API's
description of them.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import datetime as dt
import enum
import math
import types
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Iterator, Mapping, Sequence

from cloud_adapters.settings import BackendSettings, Setting

if TYPE_CHECKING:
    from cloud_adapters.gpus import GpuFacts
    from cloud_adapters.pricing import PriceCatalog


class JobState(str, enum.Enum):
    """Normalized job state shared by every backend and by the dashboard (DESIGN.md §4)."""

    QUEUED = "QUEUED"
    SUBMITTING = "SUBMITTING"
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


# ---------------------------------------------------------------------------------------------
# Errors. The UI shows ``str(error)`` verbatim, so each message says what to do next.
# ---------------------------------------------------------------------------------------------


class BackendError(Exception):
    """Base of every error an adapter raises. ``transient`` errors are retried, never fatal.

    The message is redacted (:func:`cloud_adapters.redaction.redact`): it is shown and logged, and a
    provider's error text may quote the credentials of the request."""

    transient: ClassVar[bool] = False

    def __init__(self, *args: Any) -> None:
        from cloud_adapters.redaction import redact

        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class InvalidSpec(BackendError):
    """The request cannot run on this backend (shape, instance type, limits). Not retried.

    From ``clean_config``, ``errors`` holds every problem found, ``{setting key: [message]}``
    (:class:`SettingsProblems`); the message of the exception is all of them, in order. From
    ``validate``, ``field`` names the :class:`JobSpec` field the refusal is about (``nodes``,
    ``procs_per_node``, ``instance_type``, ``max_runtime_s``, ``spot``, ``dataset_uri``, ``image``), so
    the dashboard shows it beside that field; "" when it is about several or none."""

    def __init__(self, *args: Any, errors: Mapping[str, Sequence[str]] | None = None, field: str = "") -> None:
        super().__init__(*args)
        from cloud_adapters.redaction import redact

        self.field = field

        self.errors: dict[str, list[str]] = {str(k): [redact(m) for m in v] for k, v in (errors or {}).items()}


class CredentialsError(BackendError):
    """The backend's credentials are missing, expired or lack a permission. Not retried."""


class QuotaExceeded(BackendError):
    """An account quota (instances, GPUs, concurrent jobs) would be exceeded. Not retried."""


class CapacityUnavailable(BackendError):
    """The provider has no capacity for the instance type right now (common for spot)."""

    transient = True


class Throttled(BackendError):
    """The provider rate-limited the call; retry with backoff. Never changes a job's state."""

    transient = True


class ProviderError(BackendError):
    """Any other provider failure; ``transient`` says whether a retry may succeed."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient  # type: ignore[misc]


class MissingDependency(BackendError):
    """A provider SDK is not installed; the message names the extra to install."""


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data, so forms can grey out options and services refuse early."""

    spot: bool = False  # offers interruptible (spot / low-priority) capacity
    max_nodes: int = 1  # most nodes one job may use
    max_procs_per_node: int = 1  # most processes (ranks) per node
    strategies: tuple[str, ...] = ("ddp",)  # parallelism strategies the backend runs


@dataclasses.dataclass(frozen=True)
class CodeBundle:
    """A user's code archive as a backend receives it: stored once, named by its content.

    The archive is the dashboard's normalized form (``jobs.code_archives``): a deterministic
    ``.tar.gz`` whose members are relative paths (no leading directory), regular files only. A
    backend puts its contents where ``config.code.dir`` says on the platform.
    """

    sha256: str  # hex SHA-256 of the archive's bytes
    path: str  # absolute local path of the stored .tar.gz (the dashboard's content-addressed store)
    requirements: str = ""  # text of the archive's top-level requirements.txt ("" = none)

    @property
    def name(self) -> str:
        """``trainboard-code-<sha256[:16]>.tar.gz``: the object name in a bucket, uploaded once."""
        return f"trainboard-code-{self.sha256[:16]}.tar.gz"


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything a backend needs to start one job (input record)."""

    job_name: str  # deterministic, provider-safe name derived from the Trainboard job id
    config: Mapping[str, Any]  # trainer_pkg JobConfig as a JSON-able dict (typed values)
    nodes: int = 1  # number of machines / instances
    procs_per_node: int = 1  # ranks per node; world size = nodes * procs_per_node
    instance_type: str = ""  # provider instance / machine / VM size; "" = backend default
    spot: bool = False  # use interruptible capacity
    max_runtime_s: int = 3600  # hard limit on wall-clock run time, seconds
    dataset_uri: str = ""  # where the data lives ("" for built-in datasets)
    output_uri: str = ""  # where the final model and metrics go ("" = backend default)
    checkpoint_uri: str = ""  # where checkpoints go, unique to the job ("" = backend default)
    trainer_package_uri: str = ""  # where the packaged trainer lies ("" = run from this checkout)
    tags: Mapping[str, str] = dataclasses.field(default_factory=dict)  # carry the Trainboard job id
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # extra environment variables
    code: "CodeBundle | None" = None  # the user's code archive; None = Trainboard's trainer only
    image: str = ""  # container image for this job ("" = the backend's default image)
    secret_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # environment variables whose values are secrets: set in the job's processes, never logged,
    # tagged or shown back (the backend's job secrets)
    devices: tuple[int, ...] = ()  # the GPU indices (or, on a CPU-only box, slot numbers) the
    # dashboard allocated to this job on a backend that allocates them (Backend.inventory); () = none
    # allocated: the job sees what the backend gives every job

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclasses.dataclass(frozen=True)
class Inventory:
    """What a backend that shares one machine between jobs can hand out (:meth:`Backend.inventory`):
    its GPUs, or, on a machine without one, its process slots. A job needs one device per process
    (``JobSpec.procs_per_node``); the dashboard allocates them (``jobs.admission``)."""

    kind: str  # "gpu" (devices are GPU indices, as CUDA_VISIBLE_DEVICES names them) or "slot"
    devices: tuple[int, ...]  # the indices or slot numbers jobs may be given, ascending, no repeats
    source: str  # how they were found: "nvml", "gpu_ids setting", "slots setting", "max processes"
    names: tuple[str, ...] = ()  # per device, the GPU's name (NVML's nvmlDeviceGetName); () for slots
    memory_bytes: tuple[int, ...] = ()  # per device, its total memory in bytes (NVML); () = not known
    max_concurrent_jobs: int | None = None  # most jobs active at once; None = no limit but the devices

    @property
    def capacity(self) -> int:
        """How many devices one job may be given at most: all of them."""
        return len(self.devices)

    def unit(self, count: int) -> str:
        """``"4 GPUs"``, ``"1 GPU"``, ``"2 slots"``: ``count`` devices of this kind."""
        word = "GPU" if self.kind == "gpu" else "slot"
        return f"{count} {word}{'' if count == 1 else 's'}"


@dataclasses.dataclass(frozen=True)
class JobHandle:
    """How a backend finds a job again: stored on the TrainingJob row as JSON."""

    provider: str  # registry key of the backend kind, e.g. "gpubox", "sagemaker"
    job_name: str  # the name used at submit time (JobSpec.job_name)
    provider_job_id: str = ""  # provider's id / ARN / resource name; "" where the name is the id
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # adapter-private, JSON-able

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "job_name": self.job_name,
            "provider_job_id": self.provider_job_id,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "JobHandle":
        return cls(
            provider=data["provider"],
            job_name=data["job_name"],
            provider_job_id=data.get("provider_job_id", ""),
            extra=dict(data.get("extra") or {}),
        )


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """What a backend reports about a job at one moment (output record)."""

    state: JobState  # normalized state
    raw_state: str = ""  # the provider's own primary status string
    secondary_state: str = ""  # the provider's finer status (e.g. SageMaker SecondaryStatus); PAUSED for
    # a job the provider paused (it keeps its state, shown "Paused" beside it, and can be resumed)
    failure_reason: str = ""  # provider's or trainer's message when FAILED (or why CANCELLED)
    started_at: dt.datetime | None = None  # when billable work began (UTC, aware)
    ended_at: dt.datetime | None = None  # when the job reached a terminal state (UTC, aware)
    billable_seconds: float | None = None  # provider-reported, where it reports them
    instance_count: int = 1  # instances billed
    warning: str = ""  # e.g. an unknown provider state; the job stays non-terminal
    training_seconds: float | None = None  # provider-reported run time (SageMaker TrainingTimeInSeconds);
    # with spot, billable_seconds < training_seconds and the saving is 1 - billable / training
    spot: bool = False  # the job runs on interruptible capacity
    lost: bool = False  # FAILED because the run was lost (a preemption the provider does not restart
    # itself, a host that rebooted or failed), not by the job's own error; failure_reason says how.
    # Trainboard may resubmit such a job from its checkpoint (docs/recovery.md). A job's own failure
    # (exit code ≠ 0, trainer error, time limit, out of memory) is never lost.


PAUSED = "Paused"
"""``JobStatus.secondary_state`` of a job its provider paused (Vertex AI's JOB_STATE_PAUSED: "stopped,
and can be resumed"): not terminal, and no interruption — a job keeps the state it had (Trainboard has
no paused state) and the job page shows it paused; the sync notes the pause and the resume on the
timeline."""

TAG_JOB_ID = "trainboard-job-id"
"""Tag (label) key under which :func:`jobs.adapters.job_spec` records the Trainboard job id."""
TAG_JOB_NAME = "trainboard-job-name"
"""Tag (label) key under which a cloud adapter's submit records the job's name: how it finds the job
again and how :meth:`Backend.list_tagged` tells Trainboard's jobs from others."""


def tagged_job_id(tags: Mapping[str, Any] | None) -> int | None:
    """The Trainboard job id a provider job's tags name (``trainboard-job-id``), or None when the tag
    is missing or not a whole number."""
    value = str((tags or {}).get(TAG_JOB_ID, "")).strip()
    return int(value) if value.isdigit() else None


@dataclasses.dataclass(frozen=True)
class ProviderJob:
    """One job a provider runs that carries Trainboard's tag (output of :meth:`Backend.list_tagged`)."""

    name: str  # the Trainboard job name it was submitted under (JobSpec.job_name, from the tag)
    state: JobState  # normalized state; never terminal in list_tagged's answer
    raw_state: str = ""  # the provider's own status string
    job_id: int | None = None  # Trainboard job id from the trainboard-job-id tag, None if absent
    created_at: dt.datetime | None = None  # when the provider created it (UTC, aware)
    handle: JobHandle | None = None  # what cancel() needs to stop it


@dataclasses.dataclass(frozen=True)
class ConnectionCheck:
    """One result of :meth:`Backend.test_connection`, worded for the user who must act on it."""

    name: str  # what was checked, e.g. "identity", "bucket", "SageMaker access"
    ok: bool
    message: str  # what was found; when not ok, what to do about it


@dataclasses.dataclass(frozen=True)
class Artifact:
    """One file a job left behind, as :meth:`Backend.artifacts` lists it (output record).

    ``name`` is the file's path relative to the job's artifact root, with ``/`` separators and no
    ``..``: ``model.pt``, ``metrics.jsonl``, ``checkpoints/last.pt``, a sharded checkpoint's files
    under ``checkpoints/checkpoint/``, ``logs/train.log``. ``kind`` groups them for the job page:
    ``model``, ``metrics``, ``checkpoint``, ``log`` or ``output`` (:data:`ARTIFACT_KINDS`).
    """

    name: str
    kind: str  # one of ARTIFACT_KINDS
    size_bytes: int | None = None  # None = the provider did not say
    sha256: str = ""  # hex; "" = not known without reading the file (the dashboard may compute it)
    modified_at: dt.datetime | None = None  # UTC, aware; None = not known


ARTIFACT_KINDS = ("model", "metrics", "checkpoint", "log", "output")
"""``Artifact.kind`` values; ``output``: any other file the job wrote to its output directory (a script's own)."""


@dataclasses.dataclass(frozen=True)
class InstanceOffer:
    """An instance type this backend offers, with its catalog price (for the job form)."""

    instance_type: str
    usd_per_hour: float  # on-demand USD per instance-hour
    confirmed: bool = False  # the price was checked against the provider's own list
    source: str = ""  # the catalog row's source and date, for a tooltip


# ---------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------


class Backend(abc.ABC):
    """One configured compute backend: ``Backend(config, secrets=..., prices=...)``.

    ``kind`` is the registry key. ``config`` holds backend-level settings (region, bucket, hourly
    rate...), checked by :meth:`clean_config` against :attr:`settings`; per-job settings (instance
    type, node count, spot) come in the :class:`JobSpec` and override the backend's defaults.
    ``secrets`` are the backend's stored credentials, ``prices`` the catalog :meth:`price` reads.
    """

    kind: ClassVar[str]
    max_runtime_covers: ClassVar[str] = (
        "the job's whole run on this backend, from its start: start-up counts toward it")
    """What :attr:`JobSpec.max_runtime_s` limits on this backend, as the provider documents it: a
    phrase the job page shows after "Max runtime counts …" (each adapter states its own, with source)."""
    settings: ClassVar[BackendSettings] = BackendSettings(backend_label="this", provider="this")
    """This kind's settings and credentials, declared once (:mod:`cloud_adapters.settings`): the keys
    :meth:`clean_config` accepts, their labels, which are required and which are host settings, and
    the secrets a backend may store. The backend form, the admin, the API and the checks below are
    built from it.

    Host settings decide what runs on a machine the installation operates, where and with how many
    processes (a GPU box's interpreter, run root and process limit), or where the worker sends its
    calls and with whose credentials (an endpoint URL, a profile of the worker's own). They are the
    operator's decision: the dashboard takes them from the installation's settings or from a staff
    user's backend, never from another user's backend row (``jobs.adapters.backend_adapter``)."""
    ambient_identity: ClassVar[str] = ""
    """Whose identity this adapter calls its provider as when the backend stores no credentials of
    its own: the SDK's default chain on the worker (e.g. "boto3's default credential chain: the
    worker's environment, profile or IAM role"), the worker's own identity. "" = it calls no cloud (a
    GPU box). Which users' backends may use it is the operator's decision
    (``jobs.adapters.may_use_worker_credentials``)."""

    @classmethod
    def uses_ambient_credentials(cls, config: Mapping[str, Any], secrets: Mapping[str, Any] | None) -> bool:
        """Whether a backend of this kind with settings ``config`` and stored ``secrets`` would call its
        provider with the worker's own identity (:attr:`ambient_identity`): it has one, and not every
        required secret of :attr:`settings` is stored. Makes no call; an adapter whose settings can
        send calls unsigned (a local stand-in) overrides it."""
        if not cls.ambient_identity:
            return False
        stored = secrets or {}
        return not all(stored.get(key) for key, required in cls.settings.secret_keys.items() if required)

    image_setting: ClassVar[str] = ""
    """The backend setting that names the image the trainer runs in (``image_uri``, ``environment``);
    "" where the backend has none (a GPU box runs the host's torch)."""
    image_torch: ClassVar[Mapping[str, str]] = {}
    """Known images (the defaults) → the torch version inside, each from the image's own listing."""
    image_torch_pattern: ClassVar[str] = ""
    """A regular expression whose first group is the torch version in an image reference of this
    provider's form (``pytorch-training:2.8.0-gpu-py312`` → ``2.8``); "" = not parsed."""
    offered_strategies: ClassVar[tuple[str, ...]] = ("ddp", "fsdp", "pipeline")
    """The strategies this backend runs when its image's torch runs them (:meth:`runnable_strategies`)."""
    max_nodes_note: ClassVar[str] = ""
    """Why a job may not have more nodes than :attr:`Capabilities.max_nodes` here and where such a
    job goes instead (a GPU box: one machine, so Slurm or Kubernetes); the job form shows it beside
    the nodes field and :meth:`validate` refuses with it. "" = only the arithmetic."""
    queue: ClassVar[str] = "celery"
    """Celery queue whose workers can reach this backend. A GPU box's jobs run on the machine whose
    worker consumes its queue (docker-compose's gpubox worker); cloud backends use the default."""

    @classmethod
    def queue_for(cls, name: str, config: Mapping[str, Any]) -> str:
        """The Celery queue for the backend named ``name`` (its row's slug) with settings ``config``.

        Default :attr:`queue`. A backend whose calls must run on one machine overrides it: each GPU
        box is served by the worker on that box (``gpubox.<name>``), a Slurm backend that runs the
        Slurm commands locally by the worker on its login node (``slurm.<name>``)."""
        return cls.queue
    allocates_devices: ClassVar[bool] = False
    """Whether the dashboard allocates this backend's devices to its jobs (:meth:`inventory`) and
    holds a job QUEUED until enough are free, instead of handing every job to the provider at once
    (a GPU box has no scheduler of its own; a cloud or a Slurm cluster queues jobs itself)."""

    def inventory(self) -> Inventory | None:
        """The devices this backend hands out to jobs, found on the machine it runs on (call it in
        the worker of :meth:`queue_for`); None where the provider schedules jobs itself (the
        default). Makes no provider call. Raises :class:`InvalidSpec` for settings that name no
        device."""
        return None

    dataset_schemes: ClassVar[frozenset[str]] = frozenset({""})
    """URI schemes (:func:`uri_scheme`) of the datasets this backend's jobs can read; ``""`` is a
    local path on the machine that runs the job. A built-in dataset (no URI) runs everywhere. The
    dashboard refuses a job whose dataset has another scheme at launch (``jobs.services``)."""

    def __init__(self, config: Mapping[str, Any] | None = None, *, secrets: Mapping[str, str] | None = None,
                 prices: "PriceCatalog | None" = None) -> None:
        self.config: dict[str, Any] = self.clean_config(dict(config or {}))
        self.secrets: Mapping[str, str] = types.MappingProxyType(dict(secrets or {}))
        """The backend's stored credentials (keys of :attr:`settings`' secrets, decrypted by the
        dashboard), read-only; empty = the provider's default chain on the worker (:attr:`ambient_identity`)."""
        if prices is None:
            from cloud_adapters.pricing import shipped_catalog

            prices = shipped_catalog()
        self.prices: PriceCatalog = prices
        """Where :meth:`price` looks up catalog prices (the shipped CSV unless the dashboard passes its own)."""

    @classmethod
    def clean_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Validate and normalise backend settings: every problem at once, as one :class:`InvalidSpec`
        whose ``errors`` name each setting (:class:`SettingsProblems`).

        This default checks what :attr:`settings` alone declares: unknown and required keys
        (:meth:`settings_problems`), then each value's type, choices and bounds
        (:func:`setting_value`); blank or None values are left out, and the declared defaults fill
        the settings not given. An adapter with checks of its own (a region's pattern) overrides it,
        starting from :meth:`settings_problems`."""
        problems = cls.settings_problems(config)
        out = cls.settings.defaults
        for key, value in config.items():
            if key not in cls.settings.keys or value is None or (isinstance(value, str) and not value.strip()):
                continue
            with problems.about(key):
                out[key] = setting_value(cls.settings[key], value)
        problems.raise_if_any()
        return out

    @classmethod
    def settings_problems(cls, config: Mapping[str, Any]) -> "SettingsProblems":
        """How ``clean_config`` starts: a :class:`SettingsProblems` worded with :attr:`settings`' labels
        that already holds "unknown <provider> setting (known: …)." for each key of ``config`` the
        declaration lacks, then "<label> is required for a <backend> backend." for each required
        setting missing or blank, in declaration order."""
        schema = cls.settings
        problems = SettingsProblems(schema.labels, schema.backend_label)
        known = ", ".join(sorted(schema.keys))
        for key in sorted(set(config) - schema.keys):
            problems.add(key, f"unknown {schema.provider} setting (known: {known}).")
        problems.require(config, schema.required)
        return problems

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this configured backend can run."""

    def validate(self, spec: JobSpec) -> None:
        """Raise :class:`InvalidSpec` if ``spec`` cannot run here; the message shows the arithmetic.

        Makes no provider call. The default checks node and process counts against
        :attr:`capabilities`.
        """
        caps = self.capabilities
        if spec.nodes < 1 or spec.procs_per_node < 1:
            raise InvalidSpec(
                f"nodes and processes per node must be at least 1 (got {spec.nodes} nodes × "
                f"{spec.procs_per_node} processes)."
            , field="procs_per_node")
        if spec.nodes > caps.max_nodes and self.max_nodes_note:
            raise InvalidSpec(f"{spec.nodes} nodes requested. {self.max_nodes_note}", field="nodes")
        if spec.nodes > caps.max_nodes:
            raise InvalidSpec(
                f"{spec.nodes} nodes requested, but this backend runs at most "
                f"{caps.max_nodes} {'node' if caps.max_nodes == 1 else 'nodes'} per job."
            , field="nodes")
        if spec.procs_per_node > caps.max_procs_per_node:
            raise InvalidSpec(
                f"{spec.procs_per_node} processes per node requested, but this backend allows at "
                f"most {caps.max_procs_per_node} per node."
            , field="procs_per_node")
        if spec.spot and not caps.spot:
            raise InvalidSpec("This backend has no spot capacity; untick spot.", field="spot")
        if spec.max_runtime_s < 1:
            raise InvalidSpec(f"max runtime must be at least 1 second (got {spec.max_runtime_s}).", field="max_runtime_s")

    @abc.abstractmethod
    def submit(self, spec: JobSpec) -> JobHandle:
        """Start the job; idempotent by ``spec.job_name`` (adopts an existing job of that name).

        Raises :class:`InvalidSpec`, :class:`CredentialsError`, :class:`QuotaExceeded`,
        :class:`CapacityUnavailable`, :class:`Throttled` or :class:`ProviderError`.
        """

    @abc.abstractmethod
    def describe(self, handle: JobHandle) -> JobStatus:
        """The job's current status. Raises :class:`Throttled` / :class:`ProviderError`."""

    def describe_many(self, handles: Sequence[JobHandle],
                      changed_since: dt.datetime | None = None) -> dict[str, JobStatus]:
        """Statuses keyed by ``handle.job_name``. Adapters override this to batch provider calls
        so that the number of calls grows with the jobs that changed, not with the active ones.

        ``changed_since`` (UTC, aware): the caller already holds every job's status as of that
        moment, so an adapter may leave out jobs the provider reports unchanged since then (the
        caller passes None for a job it has never synced). A job missing from the result was not
        found or did not change this time: its state is left unchanged."""
        return {h.job_name: self.describe(h) for h in handles}

    @abc.abstractmethod
    def cancel(self, handle: JobHandle) -> None:
        """Ask the provider to stop the job. Idempotent; returns without waiting for the stop."""

    @abc.abstractmethod
    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        """Log lines written since ``cursor`` ("" = from the start), and the next cursor.

        Lines carry no trailing newline. At most a backend-chosen number of lines per call; call
        again with the returned cursor for more.
        """

    @abc.abstractmethod
    def price(self, instance_type: str = "", spot: bool = False) -> float:
        """USD per instance-hour a job of ``instance_type`` (the backend default when "") is billed at,
        on spot capacity when ``spot``."""

    def price_note(self, instance_type: str = "") -> str:
        """A sentence the estimate and the job page add about :meth:`price` of ``instance_type``, when
        it is not a list price to trust: an own cluster's partition without an internal rate is priced
        at 0 ("no internal rate is set for …"). "" = nothing to add (this default)."""
        return ""

    def on_demand_price(self, instance_type: str = "") -> float:
        """USD per instance-hour of ``instance_type`` on demand: what a spot job's run is compared
        with for its saving. Default :meth:`price` without spot; an adapter whose backend settings
        can make every job interruptible (Azure ML's low-priority tier) overrides it."""
        return self.price(instance_type, False)

    def gpus(self, instance_type: str = "") -> "GpuFacts | None":
        """The GPUs one instance of ``instance_type`` (the backend default when "") has: model, count
        and memory per GPU with their source (:mod:`cloud_adapters.gpus`), for the memory plan that
        checks a job against them before launch. A CPU-only type has count 0; None when not known
        (the plan is then shown but never refuses a job). This default knows none."""
        return None

    def list_tagged(self) -> list[ProviderJob]:
        """The jobs carrying Trainboard's tag that the provider reports as not ended (queued,
        starting, running or stopping), each with a handle :meth:`cancel` accepts.

        Read-only; each adapter documents how many provider calls one listing makes. Raises
        :class:`Throttled` / :class:`ProviderError` like :meth:`describe`. Every real adapter
        implements it; this default (for test doubles) raises NotImplementedError.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list its provider's jobs")

    # -- artifacts: what a job left behind (issue 16) --------------------------------------------

    def artifacts(self, handle: JobHandle) -> list[Artifact]:
        """The files the job left: its model, metrics, last checkpoint and logs, sorted by name.

        Read-only; works for an ended job as long as the provider keeps its outputs (the GPU box's
        run directory, the job's bucket prefix). Raises :class:`ProviderError` when the place cannot
        be read. This default lists none (a test double)."""
        return []

    def open_artifact(self, handle: JobHandle, name: str) -> BinaryIO:
        """A binary stream of the artifact ``name`` (one of :meth:`artifacts`' names), for the
        dashboard to stream to a browser or to copy; the caller closes it. Raises
        :class:`InvalidSpec` for a name the job does not have (or one with ``..``),
        :class:`ProviderError` when it cannot be read."""
        raise InvalidSpec(f"{type(self).__name__} keeps no artifacts")

    def artifact_url(self, handle: JobHandle, name: str, *, expires_s: int = 300) -> str | None:
        """A short-lived URL a browser may download ``name`` from directly (an S3 presigned URL, a
        GCS signed URL, an Azure Blob SAS URL), valid ``expires_s`` seconds; None where the backend
        has none (the dashboard then streams :meth:`open_artifact`)."""
        return None

    def artifact_uri(self, handle: JobHandle, name: str) -> str:
        """Where ``name`` lies, as a path or URI a job on this same backend can read
        (``/runs/tb-job-7/output/checkpoints/last.pt``, ``s3://bucket/prefix/...``); "" when a job
        cannot read it in place (the dashboard then copies it with :meth:`open_artifact`)."""
        return ""

    def checkpoint_uri(self, handle: JobHandle) -> str:
        """Where the job's checkpoints go, as a path or URI a later job on this same backend can be
        given as :attr:`JobSpec.checkpoint_uri` to resume from them (a resubmitted attempt of a lost
        run: docs/recovery.md); "" when the backend cannot say (the next attempt then starts over).
        Read-only; never follows a symbolic link the job made. This default knows none."""
        return ""

    def instance_offers(self) -> list[InstanceOffer]:
        """Instance types a job on this backend may ask for, with prices, for the job form.
        Empty where the backend has no choice of instance type (the gpubox)."""
        return []

    def test_connection(self) -> list[ConnectionCheck]:
        """Check that this backend is usable with its settings and the credentials at hand.

        Makes only read-only provider calls and never raises for a failed check: each failure is a
        :class:`ConnectionCheck` with ``ok=False`` and a message saying what to fix.
        """
        return [ConnectionCheck("settings", True, "settings are valid; this backend has nothing remote to check")]

    def training_image(self) -> str:
        """The configured image or environment the trainer runs in ("" when the backend has none)."""
        return str(self.config.get(self.image_setting) or "") if self.image_setting else ""

    def image_torch_version(self, image: str = "") -> str | None:
        """The torch version of ``image`` (a job's own image; "" = :meth:`training_image`): from
        :attr:`image_torch` for a known image, else parsed from its reference by
        :attr:`image_torch_pattern`; None when unknown (a custom image is then not refused anything)."""
        import re

        image = image or self.training_image()
        if not image:
            return None
        if image in self.image_torch:
            return self.image_torch[image]
        match = re.search(self.image_torch_pattern, image) if self.image_torch_pattern else None
        return match.group(1).replace("-", ".") if match else None

    def strategy_error(self, strategy: str, image: str = "") -> str | None:
        """Why the image a job runs in cannot run ``strategy`` (its torch is older than the trainer
        needs, :mod:`trainer_pkg.versions`), naming the image and what to do; None when it can or the
        image's torch is unknown. ``image``: the job's own image; "" = this backend's."""
        from trainer_pkg.versions import strategy_torch_error

        where = f"the job's image {image}" if image else f"{self.image_setting} {self.training_image()}"
        return strategy_torch_error(strategy, self.image_torch_version(image), where=where)

    def runnable_strategies(self) -> tuple[str, ...]:
        """:attr:`offered_strategies` less those the image's torch cannot run: what
        :attr:`Capabilities.strategies` reports, so the form offers only these."""
        return tuple(s for s in self.offered_strategies if self.strategy_error(s) is None)


def uri_scheme(uri: str) -> str:
    """The lower-case scheme of a dataset URI: ``"s3"`` for ``s3://b/k``, ``"azureml"`` for
    ``azureml://…`` and ``azureml:<asset>:<version>``; ``""`` for a local path, ``file://`` included
    (the dashboard stores local datasets as absolute paths)."""
    from urllib.parse import urlsplit

    try:
        scheme = urlsplit(uri or "").scheme.lower()
    except ValueError:  # e.g. an unbalanced "[" in what would be the host
        scheme = (uri or "").split(":", 1)[0].lower() if ":" in (uri or "") else ""
    return "" if scheme == "file" else scheme


def scheme_label(scheme: str) -> str:
    """How a message names a scheme: ``s3://``, or ``local paths`` for ``""``."""
    return f"{scheme}://" if scheme else "local paths"


def with_article(label: str) -> str:
    """``label`` after its indefinite article: "an Azure ML", "an AWS SageMaker", "a Google Vertex
    AI". By the first letter, which is right for every backend label the registry has (an initialism
    that starts with a vowel letter is said with a vowel sound: "an AWS")."""
    return f"{'an' if label[:1].lower() in 'aeiou' else 'a'} {label}"


class SettingsProblems:
    """Every problem ``clean_config`` finds in a backend's settings, so a form shows them all after
    one submit (not one per submit), each worded with the setting's label as the form shows it
    (``Backend.settings``' labels, e.g. "AWS region") rather than its config key (``region``); a key
    without a label (a setting only the JSON field sets) keeps its key. One message per setting:
    the first found (a missing setting is not also reported as malformed).

    Usage inside ``clean_config``::

        problems = cls.settings_problems(config)  # unknown and missing required settings recorded
        with problems.about("region"):
            ...  # the check raises InvalidSpec("region: expected ...") as it would alone
        problems.raise_if_any()  # InvalidSpec(errors={"region": ["AWS region: expected ..."]})
    """

    def __init__(self, labels: Mapping[str, str], backend_label: str) -> None:
        self.labels = dict(labels)
        self.backend_label = backend_label
        self.errors: dict[str, list[str]] = {}

    def label(self, key: str) -> str:
        return self.labels.get(key, key)

    def has(self, key: str) -> bool:
        return key in self.errors

    def add(self, key: str, message: str) -> None:
        """Record ``message`` for ``key`` (a leading ``"<key>: "`` becomes ``"<label>: "``)."""
        if key in self.errors:
            return
        text = message[len(key) + 2:] if message.startswith(f"{key}: ") else message
        self.errors[key] = [f"{self.label(key)}: {text}"]

    def require(self, config: Mapping[str, Any], keys: Sequence[str]) -> None:
        """``"<label> is required for an <backend> backend."`` for each of ``keys`` that is missing,
        None or blank in ``config`` (a form sends "" for an untouched field)."""
        for key in keys:
            value = config.get(key)
            if (value is None or (isinstance(value, str) and not value.strip())) and key not in self.errors:
                self.errors[key] = [f"{self.label(key)} is required for {with_article(self.backend_label)} backend."]

    @contextlib.contextmanager
    def about(self, key: str) -> Iterator[None]:
        """Run one check of ``key``: an :class:`InvalidSpec` it raises is recorded, and the caller
        goes on to the next check."""
        try:
            yield
        except InvalidSpec as exc:
            self.add(key, str(exc))

    def raise_if_any(self) -> None:
        """Raise one :class:`InvalidSpec` carrying every problem (``errors``), if there is any."""
        if self.errors:
            raise InvalidSpec(" ".join(m for ms in self.errors.values() for m in ms), errors=self.errors)


_EXPECTED = {str: "text", int: "a whole number", float: "a number", bool: "true or false"}


def setting_value(setting: Setting, value: Any) -> Any:
    """``value`` of ``setting`` checked against its declaration: its type (a whole number is a number
    too, returned as a float; a bool is no number), its choices, its bounds and its length; text comes
    back stripped. Raises :class:`InvalidSpec` ``"<key>: expected …, got <value>."``."""
    expected = _EXPECTED[setting.type]
    if setting.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, setting.type) or (setting.type is int and isinstance(value, bool)):
        raise InvalidSpec(f"{setting.key}: expected {expected}, got {value!r:.100}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidSpec(f"{setting.key}: expected a finite number, got {value!r}.")
    if isinstance(value, str):
        value = value.strip()
        if setting.choices and value not in [choice for choice, _ in setting.choices]:
            raise InvalidSpec(f"{setting.key}: expected one of {', '.join(repr(c) for c, _ in setting.choices)}, "
                              f"got {value!r:.100}.")
        if setting.max_length is not None and len(value) > setting.max_length:
            raise InvalidSpec(f"{setting.key}: at most {setting.max_length} characters, got {len(value)}.")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = setting.min_value, setting.max_value
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = (f"from {low:g} to {high:g}" if low is not None and high is not None else
                      f"at least {low:g}" if low is not None else f"at most {high:g}")
            raise InvalidSpec(f"{setting.key}: expected a number {bounds}, got {value!r:.100}.")
    return value


def parse_utc(value: str | float | dt.datetime | None) -> dt.datetime | None:
    """A UTC-aware datetime from what a provider reports as a time: a datetime (a naive one is taken
    as UTC), an ISO-8601 string (``Z`` allowed) or a Unix timestamp in seconds. None for None, "",
    a string that is not ISO-8601 and any other type: a time in a form nobody documented is unknown."""
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.timezone.utc) if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return dt.datetime.fromtimestamp(float(value), tz=dt.timezone.utc)
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    return parsed.astimezone(dt.timezone.utc) if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)
