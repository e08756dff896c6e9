"""The adapter factory: from a :class:`~jobs.models.ComputeBackend` row to a configured
``cloud_adapters`` :class:`~cloud_adapters.base.Backend`, and the facts about a backend kind that the
services, the worker side and the forms share (host settings, secret keys, its Celery queue, the
provider job name and :class:`~cloud_adapters.base.JobSpec` of a stored job).

A leaf module: it imports no service, so every layer above may use it.
"""

from __future__ import annotations

import logging
from pathlib import PurePath
from typing import Any, Mapping

from django.conf import settings

from cloud_adapters.base import Backend, BackendError, CodeBundle, CredentialsError, JobSpec
from cloud_adapters import registry
from cloud_adapters.settings import BackendSettings
from jobs.models import CodeArchive, ComputeBackend, TrainingJob
from jobs.pricing import DatabasePriceCatalog
from trainer_pkg import preflight
from trainer_pkg.hang import DEADLINE_VAR as HANG_DEADLINE_VAR

log = logging.getLogger(__name__)


HOST_SETTING_SOURCES: dict[str, dict[str, str]] = {
    "gpubox": {"run_root": "TRAINBOARD_RUN_ROOT", "python": "TRAINBOARD_GPUBOX_PYTHON",
               "max_procs_per_node": "TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE",
               "pip_args": "TRAINBOARD_GPUBOX_PIP_ARGS", "run_as": "TRAINBOARD_GPUBOX_RUN_AS",
               "job_uids": "TRAINBOARD_GPUBOX_JOB_UIDS", "job_memory_limit": "TRAINBOARD_GPUBOX_JOB_MEMORY_LIMIT",
               "env_passthrough": "TRAINBOARD_GPUBOX_ENV_PASSTHROUGH",
               "allowed_images": "TRAINBOARD_GPUBOX_ALLOWED_IMAGES", "gpu_ids": "TRAINBOARD_GPUBOX_GPU_IDS",
               "slots": "TRAINBOARD_GPUBOX_SLOTS", "max_concurrent_jobs": "TRAINBOARD_GPUBOX_MAX_CONCURRENT_JOBS"},
    "slurm": {"transport": "TRAINBOARD_SLURM_TRANSPORT", "login_host": "TRAINBOARD_SLURM_LOGIN_HOST",
              "ssh_port": "TRAINBOARD_SLURM_SSH_PORT", "ssh_user": "TRAINBOARD_SLURM_SSH_USER",
              "ssh_host_key": "TRAINBOARD_SLURM_SSH_HOST_KEY", "slurm_conf": "TRAINBOARD_SLURM_CONF",
              "work_dir": "TRAINBOARD_SLURM_WORK_DIR", "python": "TRAINBOARD_SLURM_PYTHON",
              "allowed_images": "TRAINBOARD_SLURM_ALLOWED_IMAGES"},
    "kubernetes": {"kubeconfig": "TRAINBOARD_K8S_KUBECONFIG", "context": "TRAINBOARD_K8S_CONTEXT",
                   "in_cluster": "TRAINBOARD_K8S_IN_CLUSTER", "service_account": "TRAINBOARD_K8S_SERVICE_ACCOUNT",
                   "allowed_images": "TRAINBOARD_K8S_ALLOWED_IMAGES"},
    "ray": {"address": "TRAINBOARD_RAY_ADDRESS", "python": "TRAINBOARD_RAY_PYTHON"},
}
"""kind -> {host setting: the Django setting (and environment variable of the same name) holding this
installation's value}. Data, not if/elif: which settings are host settings is the adapter's
declaration (``Setting.host``); this says where the installation's values live."""


def _host_config_defaults() -> dict[str, dict[str, Any]]:
    """This installation's host settings by adapter kind (:data:`HOST_SETTING_SOURCES`; a blank
    setting leaves the adapter's own default, e.g. the worker's interpreter). ``settings.
    TRAINBOARD_BACKEND_DEFAULTS`` (``{kind: {key: value}}``), when set, replaces them."""
    configured = getattr(settings, "TRAINBOARD_BACKEND_DEFAULTS", None)
    if configured:
        return configured
    defaults: dict[str, dict[str, Any]] = {}
    for kind, sources in HOST_SETTING_SOURCES.items():
        values = {key: getattr(settings, name, None) for key, name in sources.items()}
        defaults[kind] = {key: str(v) if isinstance(v, PurePath) else v for key, v in values.items()
                          if v not in (None, "")}
    return defaults


def backend_declaration(kind: str) -> BackendSettings:
    """The settings declaration of a ``kind`` backend (``Backend.settings``: its settings, their
    labels, which are required or host settings, its secrets); an empty one for an unknown kind or
    one whose SDK is missing."""
    try:
        return registry.backend_settings(kind)
    except (LookupError, ValueError, BackendError):
        return BackendSettings(backend_label=str(kind), provider=str(kind))


def backend_host_settings(kind: str) -> frozenset[str]:
    """The settings of a ``kind`` backend that only staff may set (its declaration's host settings:
    for the gpubox ``run_root``, ``python``, ``max_procs_per_node``, ``pip_args``, ``run_as``,
    ``env_passthrough``, ``allowed_images``, ``gpu_ids``, ``slots``, ``max_concurrent_jobs``); empty for
    an unknown kind."""
    return backend_declaration(kind).host


def backend_setting_labels(kind: str) -> dict[str, str]:
    """``{config key: label}`` of a ``kind`` backend's settings (its declaration's labels): the
    backend form labels its fields with them, as the adapter's messages name the settings; {} for an
    unknown kind or one whose SDK is missing."""
    return backend_declaration(kind).labels


def may_set_host_settings(user) -> bool:
    """Whether a backend owned by ``user`` may carry host settings (:func:`backend_host_settings`):
    an active staff user's may; anyone else's takes them from the installation."""
    return bool(user is not None and getattr(user, "is_active", False) and getattr(user, "is_staff", False))


def may_use_worker_credentials(user) -> bool:
    """Whether a cloud backend owned by ``user`` may call its provider with the worker's own identity
    (the adapter's ``ambient_identity``: boto3's default chain, Application Default Credentials,
    DefaultAzureCredential) when it stores no credentials of its own.

    ``settings.TRAINBOARD_WORKER_CREDENTIALS``: ``"staff"`` (the default) lets only an active staff
    user's backend; ``"everyone"`` lets every user's. The default is the safe one because that
    identity is the operator's cloud account: a backend naming any role ARN or service account would
    otherwise launch billable jobs there as the operator (DESIGN.md §8: as whom a job runs is the
    operator's decision)."""
    return settings.TRAINBOARD_WORKER_CREDENTIALS == "everyone" or may_set_host_settings(user)


def worker_credentials_refusal(cls: type[Backend], config: Mapping[str, Any], secrets: Mapping[str, Any] | None,
                               owner) -> str | None:
    """Why a ``cls`` backend of ``owner`` with ``config`` and stored ``secrets`` may not be used: it
    would call its provider with the worker's own identity (``cls.uses_ambient_credentials``) and
    :func:`may_use_worker_credentials` says no for ``owner``. The message says what to do; None when
    it may be used."""
    if may_use_worker_credentials(owner) or not cls.uses_ambient_credentials(config, secrets):
        return None
    keys = " and ".join(k for k, required in cls.settings.secret_keys.items() if required)
    return (f"this backend stores no credentials of its own, so its calls would use the worker's own "
            f"identity ({cls.ambient_identity}), which only a backend owned by staff may use. Store the "
            f"backend's own credentials ({keys}), or ask staff to set up the backend.")


def effective_config(kind: str, config: Mapping[str, Any] | None, *, host_settings_from_row: bool) -> dict[str, Any]:
    """The installation's host settings for ``kind``, then the row's ``config`` over them; the row's
    own host settings count only when ``host_settings_from_row`` (its owner is staff)."""
    refused = frozenset() if host_settings_from_row else backend_host_settings(kind)
    merged = dict(_host_config_defaults().get(kind, {}))
    merged.update({k: v for k, v in (config or {}).items() if v not in (None, "") and k not in refused})
    return merged


def backend_isolation(backend: ComputeBackend):
    """How a GPU box keeps its jobs apart (``GpuBoxBackend.isolation``: ``isolated`` and a sentence
    for people); None for another kind, or a backend whose adapter cannot be built (its page says why)."""
    if backend.kind != "gpubox":
        return None
    try:
        return getattr(backend_adapter(backend), "isolation", None)
    except (BackendError, LookupError, ValueError, TypeError):
        return None


def shared_uid_refusal(adapter: Backend) -> str | None:
    """Why a job may not start on ``adapter``'s box: the box cannot give each job a uid of its own
    (``isolation``), this installation has more than one active user who is not staff (staff run the
    installation and see every job anyway), and its operator has not accepted that
    (``TRAINBOARD_GPUBOX_ALLOW_SHARED_UID``). None when it may."""
    isolation = getattr(adapter, "isolation", None)
    if isolation is None or isolation.isolated or settings.TRAINBOARD_GPUBOX_ALLOW_SHARED_UID:
        return None
    from django.contrib.auth import get_user_model

    users = get_user_model().objects.filter(is_active=True, is_staff=False).count()
    if users <= 1:
        return None
    return (f"This GPU box cannot keep one user's job from another's: {isolation.text}. This installation has "
            f"{users} users, so it starts no job there: the box's operator runs its worker as root with a uid pool "
            f"(TRAINBOARD_GPUBOX_JOB_UIDS), or sets TRAINBOARD_GPUBOX_ALLOW_SHARED_UID=true to accept that every "
            f"user's job there can read and signal the others' and the worker's.")


def backend_adapter(backend: ComputeBackend) -> Backend:
    """The configured ``cloud_adapters`` Backend for a ComputeBackend row, pricing from the
    admin-managed catalog (:class:`jobs.pricing.DatabasePriceCatalog`, shipped rows as fallback).

    Host settings (:func:`backend_host_settings`: where a GPU box runs jobs, with which interpreter,
    how many processes) come from the installation (:data:`HOST_SETTING_SOURCES`); the row's values
    of them are used only while its owner is an active staff user (:func:`may_set_host_settings`).
    A non-staff user's row never carries them since the service refuses them, and any such value a
    row still holds (saved while its owner was staff) is ignored here — the rule is the row's owner,
    at the time of use.

    The backend's stored ``secrets`` (decrypted) are passed to the adapter's constructor, which
    builds its SDK clients with them instead of the provider's default credential chain. A
    cloud backend without them uses the worker's own identity, so it is built only while its owner
    may use that (:func:`may_use_worker_credentials`, checked at the time of use like the host
    settings): one whose owner may not (e.g. not staff) raises
    :class:`CredentialsError` saying what to do, before any provider call.

    Raises :class:`BackendError` (e.g. InvalidSpec for a bad stored config, MissingDependency,
    CredentialsError as above); ImproperlyConfigured when the stored secrets cannot be decrypted with
    the configured keys.
    """
    config = effective_config(backend.kind, backend.config,
                               host_settings_from_row=may_set_host_settings(backend.owner))
    adapter = registry.create_backend(backend.kind, config, secrets=backend.secrets or None,
                                      prices=DatabasePriceCatalog())
    refusal = worker_credentials_refusal(type(adapter), adapter.config, backend.secrets, backend.owner)
    if refusal:
        raise CredentialsError(refusal)
    return adapter


def backend_queue(backend: ComputeBackend) -> str:
    """The Celery queue whose workers reach ``backend`` (``Backend.queue_for`` of its kind: a GPU
    box's is ``gpubox.<name>``); "celery" when the kind is unknown or its SDK is missing.

    A stored name is a validated slug, which every ``queue_for`` accepts; its ValueError for any
    other name is not swallowed here, since falling back to "celery" would hand a GPU box's job to
    a worker on another machine."""
    try:
        cls = registry.backend_class(backend.kind)
    except (LookupError, ValueError, BackendError):
        return "celery"
    return cls.queue_for(backend.name, _queue_config(backend))


def _queue_config(backend: ComputeBackend) -> dict[str, Any]:
    # The effective settings: a Slurm backend's transport is a host setting (the installation's).
    return effective_config(backend.kind, backend.config or {},
                            host_settings_from_row=may_set_host_settings(backend.owner))


def backend_queue_holder(backend: ComputeBackend) -> ComputeBackend | None:
    """Another backend (any owner's) whose Celery queue is ``backend``'s own queue, or None.

    A queue is a backend's own when its name makes it (``queue_for`` of another name, same settings,
    differs: a GPU box's ``gpubox.<name>``, a local-transport Slurm backend's ``slurm.<name>``). Two
    rows on one such queue would be served by one machine's worker while each believed it had the
    machine to itself (a GPU box gives out its GPUs per backend row), so a name that makes another
    row's queue is refused. Rows of the shared queues (the cloud backends' ``celery``) never collide."""
    try:
        cls = registry.backend_class(backend.kind)
        config = _queue_config(backend)
        queue = cls.queue_for(backend.name, config)
        shared = queue == cls.queue_for("b" if backend.name == "a" else "a", config)
    except (LookupError, ValueError, BackendError):
        return None
    if shared:
        return None
    for other in ComputeBackend.objects.filter(name=backend.name).exclude(pk=backend.pk).select_related("owner"):
        try:
            if backend_queue(other) == queue:
                return other
        except ValueError:
            continue
    return None


def backend_allocates_devices(backend: ComputeBackend) -> bool:
    """Whether the dashboard shares ``backend``'s devices between its jobs (``Backend.allocates_devices``:
    a GPU box), holding a job QUEUED until they are free (:mod:`jobs.admission`); False if unknown."""
    try:
        return bool(registry.backend_class(backend.kind).allocates_devices)
    except (LookupError, ValueError, BackendError):
        return False


def provider_job_name(job: TrainingJob) -> str:
    """Deterministic, provider-safe job name: ``tb-job-<id>-<creation time, hex seconds>``.

    Derived only from the row, so a retried submit finds the job its first attempt created. The
    creation time keeps a fresh database (ids restarting at 1) from adopting an old run's job.
    Lowercase letters, digits and hyphens, under 63 characters: valid on SageMaker, Vertex, Azure ML.
    """
    prefix = getattr(settings, "TRAINBOARD_JOB_NAME_PREFIX", "tb-job")
    return f"{prefix}-{job.pk}-{int(job.created_at.timestamp()):x}"


def code_bundle(archive: CodeArchive | None) -> CodeBundle | None:
    """The :class:`CodeBundle` a backend receives for a stored archive (its hash, the path of its
    ``.tar.gz`` in the local store, its requirements text); None for no archive."""
    if archive is None:
        return None
    return CodeBundle(sha256=archive.sha256, path=str(archive.path), requirements=archive.requirements or "")


def job_spec(job: TrainingJob) -> JobSpec:
    """The :class:`JobSpec` for a stored job: its frozen config and shape, the code archive it
    recorded (:func:`code_bundle`), its image and environment, and its backend's job secrets
    (decrypted, as ``secret_env``: a backend sets them in the job's processes and never logs them)."""
    return JobSpec(
        job_name=job.provider_job_name or provider_job_name(job),
        config=job.config,
        nodes=job.nodes,
        procs_per_node=job.procs_per_node,
        instance_type=job.instance_type,
        spot=job.spot,
        max_runtime_s=job.max_runtime_s,
        dataset_uri=(job.config.get("data") or {}).get("uri", ""),
        tags={"trainboard-job-id": str(job.pk), "trainboard-owner-id": str(job.owner_id)},
        # The backend's hang deadline reaches the launcher's watchdog (trainer_pkg.hang); the job's own
        # environment may set its own. The preflight is the operator's (the backend's) alone: its
        # variables come last and none of the job's own is kept (the job's validation refuses TRAINBOARD_
        # names; a row written otherwise does not change what runs).
        env={**({HANG_DEADLINE_VAR: str(job.backend.hang_deadline_s)} if job.backend.hang_deadline_s else {}),
             **{k: v for k, v in (job.env or {}).items() if k not in PREFLIGHT_VARS}, **preflight_env(job.backend)},
        code=code_bundle(job.code) if job.code_id else None,
        image=job.image or "",
        secret_env=dict(job.backend.job_secrets or {}),
        devices=tuple(int(d) for d in job.allocated_gpus or ()),
        # A resubmitted attempt writes, and so resumes from, its lost attempt's checkpoints (jobs.restarts).
        checkpoint_uri=job.checkpoint_uri or "",
    )


PREFLIGHT_VARS = frozenset({preflight.ENABLE_VAR, preflight.MIN_BUSBW_VAR, preflight.MAX_LATENCY_VAR})
"""The variables :func:`preflight_env` sets; a job's own environment never sets them."""


def preflight_env(backend: ComputeBackend) -> dict[str, str]:
    """The variables that turn the network preflight on in every rank of ``backend``'s jobs, with its
    thresholds (:mod:`trainer_pkg.preflight`); {} when the backend's preflight is off."""
    if not backend.preflight:
        return {}
    env = {preflight.ENABLE_VAR: "1"}
    if backend.preflight_min_busbw_gbps is not None:
        env[preflight.MIN_BUSBW_VAR] = repr(float(backend.preflight_min_busbw_gbps))
    if backend.preflight_max_latency_us is not None:
        env[preflight.MAX_LATENCY_VAR] = str(int(backend.preflight_max_latency_us))
    return env


def backend_secret_keys(kind: str) -> dict[str, bool]:
    """The secret keys a backend of ``kind`` accepts, each mapped to whether it is required once any
    secret is given (e.g. sagemaker: ``aws_access_key_id``/``aws_secret_access_key`` required,
    ``aws_session_token`` optional), as its declaration's secrets say; {} for a kind that stores no
    secret (gpubox) or is unknown."""
    return backend_declaration(kind).secret_keys

