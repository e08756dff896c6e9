"""The Azure ML backend: a Trainboard job is one Azure ML command job, created with azure-ai-ml v2.

What a job is made of (clouds.md §3.1 for the builder, §3.2 for the wire body):

* **code**: the trainer archive (:mod:`cloud_adapters.packaging`) unpacked into a temporary
  directory, with ``trainboard_job.json`` replaced by the job's config (its ``parallel.nodes`` and
  ``procs_per_node`` set to the job's shape: Azure ML does not tell a process how many processes
  share its node, clouds.md §3.4). ``jobs.create_or_update`` uploads it through azure-ai-ml's code
  upload (hash lookup, then a SAS upload to the workspace's blob storage, then a code version), so
  an unchanged snapshot is uploaded once;
* **command** ``python -m trainer_pkg.launch --config trainboard_job.json``, run by Azure ML in every
  process it starts: with ``PyTorchDistribution(process_count_per_instance=procs_per_node)`` the
  platform starts the ranks itself and sets per-process ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` and
  ``MASTER_ADDR``/``MASTER_PORT`` (clouds.md §3.4); the launcher trains in place
  (trainer_pkg/platforms.py ``read_azureml``);
* an MPI script (``code.framework`` ``mpi``) gets ``MpiDistribution(process_count_per_instance=procs_per_node)``
  instead: Azure ML's mpirun starts the processes, each with Open MPI's ``OMPI_COMM_WORLD_*``, and the
  launcher runs the script as that rank (trainer_pkg/frameworks/mpi.py);
* with the user's code (``JobSpec.code``) its files join the snapshot at its root, beside
  ``trainer_pkg/``, and the config's ``code.dir`` is ``"."`` (the command's working directory, the
  directory holding trainer_pkg); a root ``.gitignore`` of the user's gets an empty ``.amlignore``
  beside it, because azure-ai-ml's upload leaves out what a root ``.gitignore`` matches unless an
  ``.amlignore`` is there (``get_ignore_file``) and the job must run every file of the archive;
* ``instance_count`` = nodes on the backend's compute cluster;
* the environment (:meth:`AzureMLBackend.environment`): the backend's ``environment`` setting; for a
  job with requirements an ``Environment`` of an image (``JobSpec.image``, else
  :data:`REQUIREMENTS_IMAGE`) plus a conda file whose pip dependencies are the trainer's and then the
  requirement lines (Azure ML builds the image's conda environment from it: a new environment, so
  the trainer's own dependencies are listed too); for a job with only an image, that image alone;
* ``environment_variables``: ours, ``JobSpec.env``, ``JobSpec.secret_env`` (how Azure ML hands
  variables to every process; the job's definition shows them to whoever may read the job);
* the dataset (``spec.dataset_uri``) as input ``data``, ``uri_folder`` mounted read-only
  (``ro_mount``), which the launcher finds as ``AZURE_ML_INPUT_data``; a continue or fine-tune from
  another job of the workspace (``train.init_from`` a datastore path, docs/clone-continue.md) as input
  ``init_from``, ``uri_file`` mounted read-only, whose local path the command hands the launcher
  (``--init-from ${{inputs.init_from}}``: the trainer reads no ``azureml://``); outputs ``model`` and
  ``checkpoints`` (``uri_folder``, ``rw_mount``), found as ``AZURE_ML_OUTPUT_model`` /
  ``AZURE_ML_OUTPUT_checkpoints``; a resubmitted attempt of a lost run (``JobSpec.checkpoint_uri``:
  docs/recovery.md) has its ``checkpoints`` output at the lost attempt's, so it resumes from there;
* ``timeout`` = max runtime (``limits.timeout``, ISO-8601 on the wire); low-priority jobs ask for
  ``queue_settings.job_tier = "spot"`` (REST ``JobTier`` Spot, [AML ``_enums.py``]);
* tags: ``trainboard-job-name`` (the list filter of :meth:`describe_many`) plus ``spec.tags``
  (``trainboard-job-id``, ``trainboard-owner-id``).

Names: ``JobSpec.job_name`` becomes the job's ``name`` through :func:`azure_job_name`; a retried
submit GETs that name first and adopts the job it finds, so it never creates a second one.

Every SDK call goes through :mod:`cloud_adapters.retry` with the Azure classifier
(:mod:`cloud_adapters._azure`) under the subscription's token bucket; azure-core's own retries are
off (``retry_total=0``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
import threading
import tomllib
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping, Sequence

from cloud_adapters import _azure, artifact_store, packaging, retry
from cloud_adapters.azureml import logs as az_logs
from cloud_adapters.azureml.states import STATES, job_status, status_text
from cloud_adapters.base import (
    TAG_JOB_NAME,
    Artifact,
    BackendError,
    Capabilities,
    CredentialsError,
    InstanceOffer,
    InvalidSpec,
    JobHandle,
    JobSpec,
    JobStatus,
    ProviderError,
    parse_utc,
)
from cloud_adapters.cloud import CloudBackend, Probe
from cloud_adapters.gpus import GpuFacts, catalog_gpus
from cloud_adapters.settings import BackendSettings, Secret, Setting
from trainer_pkg.objstore import is_remote

PROVIDER = "azure"  # provider name in the price catalog
LOW_PRIORITY_SUFFIX = ":low_priority"
"""A catalog row ``<vm size>:low_priority`` prices the low-priority tier of that size."""

DEFAULT_ENVIRONMENT = "azureml://registries/azureml/environments/acpt-pytorch-2.8-cuda12.6/labels/latest"
"""Azure's curated PyTorch environment (ACPT, PyTorch 2.8, CUDA 12.6) from the ``azureml`` registry:
torch new enough for every strategy (:mod:`trainer_pkg.versions`). Source: Azure/azureml-assets
``assets/training/general/environments/acpt-pytorch-2.8-cuda12.6/spec.yaml`` ("PyTorch 2.8 …
cu126 wheels", tagged Preview when read, 2026-12-01). ACPT 2.2 (clouds.md §3.6) has torch 2.2: older
than the trainer's floor."""

SETTINGS = BackendSettings(
    backend_label="Azure ML", provider="Azure ML",
    settings=(
        # A GUID; it keys the rate limit.
        Setting("subscription_id", "Subscription ID",
                "The Azure subscription of the workspace, a GUID such as 00000000-0000-0000-0000-000000000000.",
                required=True, max_length=100),
        Setting("resource_group", "Resource group", "The resource group of the workspace.", required=True,
                max_length=255),
        Setting("workspace", "Workspace", "The Azure Machine Learning workspace name.", required=True,
                max_length=255),
        Setting("compute", "Compute cluster", "The name of the workspace's compute cluster the jobs run on.",
                required=True, max_length=255),
        # azureml://registries/..., azureml:<name>:<version> or an ARM id.
        Setting("environment", "Environment",
                "An environment such as azureml:my-env:3 or a registry URI; blank uses the curated PyTorch "
                "environment.", max_length=500, default=DEFAULT_ENVIRONMENT),
        # Must have a price in the catalog for the region.
        Setting("vm_size", "Default VM size",
                "The cluster's VM size, used for prices, e.g. Standard_NC6s_v3 (the default).", max_length=100,
                default="Standard_NC6s_v3"),
        Setting("tier", "Tier", "The cluster's VM priority; it sets which price the cost uses.",
                choices=(("dedicated", "Dedicated"), ("low_priority", "Low priority (cheaper, may be preempted)")),
                default="dedicated"),
        Setting("region", "Azure region", "The workspace's region, for prices, e.g. eastus (the default).",
                max_length=30, default="eastus"),
        Setting("max_nodes", "Max nodes per job", "Blank allows 16.", type=int, min_value=1, default=16),
        # Host setting: where the worker sends its ARM calls, with the worker's own identity
        # (DefaultAzureCredential) when the backend stores no service principal.
        Setting("base_url", "Resource Manager endpoint",
                "Advanced: only for a sovereign cloud or a private endpoint; blank uses https://management.azure.com.",
                host=True, max_length=500, default=""),
    ),
    # A service principal; without it, DefaultAzureCredential (ambient_identity).
    secrets=(Secret("tenant_id", "Tenant ID"), Secret("client_id", "Client (application) ID"),
             Secret("client_secret", "Client secret")),
)
"""The settings of an Azure ML backend and the credentials it may store (:mod:`cloud_adapters.settings`)."""
TIERS = tuple(value for value, _ in SETTINGS["tier"].choices)

GUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
RESOURCE_GROUP_RE = re.compile(r"[-\w.()]{0,89}[-\w()]")  # ARM resource group naming rules
WORKSPACE_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_-]{2,32}")  # azure-ai-ml's workspaceName URL pattern [AML]
COMPUTE_RE = re.compile(r"[a-zA-Z][a-zA-Z0-9-]{1,31}")  # compute names: a letter, then letters, digits, '-'
REGION_RE = re.compile(r"[a-z][a-z0-9]{2,30}")  # eastus, westeurope, eastus2 ...
VM_SIZE_RE = re.compile(r"Standard_[A-Za-z0-9_]+")
JOB_NAME_MAX = 255
JOB_NAME_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_-]{0,254}")
"""Job names: a letter or digit, then letters, digits, '_' or '-', at most 255 (the REST API's job id
rule; not in clouds.md)."""
ENV_KEY_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
IMAGE_RE = re.compile(r"[\w.\-]+(:\d+)?/[\w.\-/]+([:@][\w.\-:]+)?")  # <registry>/<repository>[:tag|@digest]
DATASET_PREFIXES = ("azureml:", "https://", "wasbs://", "abfss://", "adl://")
"""URIs an Azure ML ``uri_folder`` input accepts: datastore paths (``azureml://datastores/...``), data
assets (``azureml:<name>:<version>``), storage URLs (clouds.md §3.1-§3.2)."""

REQUIREMENTS_IMAGE = "mcr.microsoft.com/azureml/openmpi4.1.0-ubuntu22.04:latest"
"""Image of the environment Azure ML builds for a job whose code has requirements and that names no
image: Azure ML's base image for environments defined as an image plus a conda file (Azure/AzureML-
Containers ``base/cpu/openmpi4.1.0-ubuntu22.04``; torch's PyPI wheels bring their own CUDA runtime)."""
CONDA_PYTHON = "3.11"
"""Python of that conda environment: one the trainer supports (``requires-python >= 3.10``)."""
AMLIGNORE = ".amlignore"

CONFIG_FILE = packaging.BASE_CONFIG  # trainboard_job.json, in the code snapshot
COMMAND = f"python -m trainer_pkg.launch --config {CONFIG_FILE}"
EXPERIMENT = "trainboard"
DATA_INPUT = "data"  # -> AZURE_ML_INPUT_data (trainer_pkg.platforms.AZURE_DATA_NAMES)
INIT_INPUT = "init_from"  # -> ${{inputs.init_from}} in the command: train.init_from's file, mounted
INIT_ARGUMENT = f" --init-from ${{{{inputs.{INIT_INPUT}}}}}"
"""Appended to :data:`COMMAND` with the ``init_from`` input: Azure ML writes the input's mounted path
in place of ``${{inputs.init_from}}`` (clouds.md §3.1), and the launcher reads the file from there
(trainer_pkg/launch.py ``--init-from``)."""
DEFAULT_DATASTORE = "workspaceblobstore"  # Azure ML's default datastore of a workspace's job outputs
MODEL_OUTPUT = "model"  # -> AZURE_ML_OUTPUT_model (AZURE_OUTPUT_NAMES)
CHECKPOINT_OUTPUT = "checkpoints"  # -> AZURE_ML_OUTPUT_checkpoints (AZURE_CHECKPOINT_NAMES)
DATASTORE_PATH_RE = re.compile(
    r"azureml://(?:subscriptions/[^/]+/resource[gG]roups/[^/]+/workspaces/[^/]+/)?datastores/([^/]+)/paths/(.+)")
"""A datastore path, ``azureml://datastores/<datastore>/paths/<path>``, or its long form with the
workspace's subscription, resource group and workspace before ``datastores`` (both name the same
place: Microsoft Learn, "Work with models in Azure Machine Learning")."""
LONG_FORM_SCOPE_RE = re.compile(r"azureml://subscriptions/([^/]+)/resource[gG]roups/([^/]+)/workspaces/([^/]+)/")
"""The subscription, resource group and workspace a long-form datastore path names."""
MAX_RUNTIME_S = 30 * 24 * 3600
"""Largest max runtime accepted here: 30 days (a sanity bound; clouds.md records no Azure limit)."""
MAX_PROCS_PER_NODE = 8

VM_GPUS = {
    "Standard_NC6s_v3": 1, "Standard_NC12s_v3": 2, "Standard_NC24s_v3": 4,
    "Standard_NC4as_T4_v3": 1, "Standard_NC8as_T4_v3": 1, "Standard_NC16as_T4_v3": 1, "Standard_NC64as_T4_v3": 4,
    "Standard_NC24ads_A100_v4": 1, "Standard_NC48ads_A100_v4": 2, "Standard_NC96ads_A100_v4": 4,
    "Standard_ND96asr_v4": 8,
}
"""NVIDIA GPUs per VM size (Azure's NCv3, NCasT4_v3, NC A100 v4 and NDasr A100 v4 series size tables;
not in clouds.md). A size missing here is checked against :data:`MAX_PROCS_PER_NODE` only."""

RATE_PER_SECOND = 10.0
"""API calls per second this process makes per subscription (token bucket, burst 2×)."""
LIST_PAGE_LIMIT = 200
"""Most pages :meth:`AzureMLBackend.describe_many` reads from one list (a safety stop)."""


def azure_job_name(job_name: str) -> str:
    """The Azure ML job name for a Trainboard job name, deterministic.

    A valid name (:data:`JOB_NAME_RE`) is kept. Otherwise every character outside
    ``[a-zA-Z0-9_-]`` becomes ``-``, leading ``-``/``_`` are dropped and ``-`` + the first 8 hex
    digits of sha256(original) are appended (cut to fit 255), so two names mapping to the same text
    stay distinct. Raises :class:`InvalidSpec` for an empty name.
    """
    if JOB_NAME_RE.fullmatch(job_name or ""):
        return job_name
    if not job_name:
        raise InvalidSpec("job name: empty; the dashboard derives it from the job id.")
    digest = hashlib.sha256(job_name.encode("utf-8")).hexdigest()[:8]
    base = re.sub(r"[^a-zA-Z0-9_-]", "-", job_name).lstrip("-_")
    base = base[: JOB_NAME_MAX - len(digest) - 1]
    return f"{base}-{digest}" if base else f"tb-{digest}"


def init_from(config: Mapping[str, Any]) -> str:
    """``train.init_from`` of a job config: the file a continue or fine-tune starts from; "" for none."""
    train = config.get("train") if isinstance(config, Mapping) else None
    return str(train.get("init_from") or "") if isinstance(train, Mapping) else ""


class AzureMLBackend(CloudBackend):
    """Runs jobs as Azure ML command jobs; see the module docstring for what a job is made of.

    Settings: :data:`SETTINGS` (``clean_config`` raises :class:`InvalidSpec` naming each setting
    that is missing or malformed). Credentials are the backend's stored service principal, else
    ``DefaultAzureCredential``.

    Tests pass ``credential`` (anything with ``get_token``/``get_token_info``) and ``transport`` (an
    azure-core ``HttpTransport``, used for the ARM calls, run history, log reads and the stored
    service principal's token requests alike).
    """

    kind = "azureml"
    service = "Azure ML"
    states = STATES
    image_setting = "environment"
    image_torch_pattern = r"/environments/acpt-pytorch-(\d+\.\d+)"  # curated ACPT names carry the version
    # command(timeout=), "the number, in seconds, after which the job will be cancelled": azure-ai-ml
    # command(), REST limits.timeout; clouds.md §3.2.
    max_runtime_covers = (
        "the whole job, preparing the environment and starting the nodes included; at the limit Azure ML "
        "cancels the job (Azure Machine Learning documentation, command job timeout)")
    settings = SETTINGS
    dataset_schemes = frozenset(p.split(":", 1)[0] for p in DATASET_PREFIXES)
    """Datastore paths and data assets (azureml), storage URLs (https, wasbs, abfss, adl): what a
    ``uri_folder`` input mounts (clouds.md §3.1-§3.2)."""
    # azure-identity's DefaultAzureCredential: environment, workload/managed identity, then developer logins.
    ambient_identity = ("DefaultAzureCredential: the worker's AZURE_* environment, managed identity or "
                        "Azure CLI login")

    def __init__(self, config: Mapping[str, Any] | None = None, *, secrets: Mapping[str, str] | None = None,
                 prices=None, credential: Any = None, transport: Any = None,
                 retry_policy: retry.RetryPolicy | None = None, clock: retry.Clock | None = None,
                 blob_account_url: str | None = None) -> None:
        super().__init__(config, secrets=secrets, prices=prices)
        self._blob_account_url = blob_account_url
        """The Blob service of the job outputs' datastore; None = ``<protocol>://<account>.blob.<endpoint>``
        as the datastore says (a test passes Azurite's URL, as it passes a transport)."""
        if self._row(self.config["vm_size"], low_priority=False) is None:
            raise self._unknown_size(self.config["vm_size"], field="vm_size")
        self.retry_policy = retry_policy or retry.RetryPolicy()
        """Attempts and backoff of every provider call (tests pass a seeded RNG)."""
        self.clock = clock or retry.SYSTEM_CLOCK
        """Time source of retries and the rate limit (tests pass a simulated clock)."""
        self._credential = credential
        self._transport = transport
        self._ml: Any = None
        self._requests_transport: Any = None
        self._lock = threading.Lock()

    # -- configuration ----------------------------------------------------------------------

    @classmethod
    def clean_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Every problem at once (:class:`SettingsProblems`): one InvalidSpec whose ``errors`` name
        each setting that is missing or malformed."""
        problems = cls.settings_problems(config)
        out = SETTINGS.defaults
        out.update({k: v.strip() if isinstance(v, str) else v for k, v in config.items()
                    if k in SETTINGS.keys and v is not None and v != ""})

        def text(field: str, pattern: re.Pattern[str], what: str) -> str:
            value = out.get(field)
            with problems.about(field):
                if not isinstance(value, str) or not pattern.fullmatch(value):
                    raise InvalidSpec(f"{field}: expected {what}, got {value!r}.")
            return value if isinstance(value, str) else ""

        out["subscription_id"] = text("subscription_id", GUID_RE,
                                      "the subscription id, a GUID like 00000000-0000-0000-0000-000000000000").lower()
        text("resource_group", RESOURCE_GROUP_RE,
             "the workspace's resource group (1–90 letters, digits, '_-.()', not ending in '.')")
        text("workspace", WORKSPACE_RE, "an Azure ML workspace name (3–33 letters, digits, '_' or '-')")
        text("compute", COMPUTE_RE,
             "the compute cluster's name (a letter, then letters, digits or '-', at most 32)")
        env = out.get("environment")
        with problems.about("environment"):
            if not isinstance(env, str) or not env.startswith(("azureml:", "/subscriptions/")) or " " in env:
                raise InvalidSpec(
                    f"environment: expected 'azureml://registries/<registry>/environments/<name>/labels/latest', "
                    f"'azureml:<name>:<version>' or an ARM id, got {env!r}.")
        text("vm_size", VM_SIZE_RE, "an Azure VM size such as 'Standard_NC6s_v3'")
        tier = out.get("tier")
        with problems.about("tier"):
            if tier not in TIERS:
                raise InvalidSpec(f"tier: expected 'dedicated' or 'low_priority', got {tier!r}.")
        text("region", REGION_RE, "an Azure region name such as 'eastus'")
        nodes = out.get("max_nodes")
        with problems.about("max_nodes"):
            if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= 100:
                raise InvalidSpec(f"max_nodes: expected an integer from 1 to 100, got {nodes!r}.")
        base = out.get("base_url")
        with problems.about("base_url"):
            if not isinstance(base, str) or (base and not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", base)):
                raise InvalidSpec(f"base_url: expected an http(s):// URL or nothing, got {base!r}.")
            out["base_url"] = base.rstrip("/")
        problems.raise_if_any()
        return out

    @property
    def region(self) -> str:
        return self.config["region"]

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            spot=any(r.instance_type.endswith(LOW_PRIORITY_SUFFIX) for r in self.prices.rows(PROVIDER, self.region)),
            max_nodes=self.config["max_nodes"],
            max_procs_per_node=MAX_PROCS_PER_NODE,
            strategies=self.runnable_strategies(),
        )

    # -- prices -----------------------------------------------------------------------------

    def _low_priority(self, spot: bool) -> bool:
        return bool(spot) or self.config["tier"] == "low_priority"

    def _row(self, vm_size: str, *, low_priority: bool):
        key = vm_size + LOW_PRIORITY_SUFFIX if low_priority else vm_size
        return self.prices.lookup(PROVIDER, self.region, key)

    def _sizes(self) -> list[str]:
        return [r.instance_type for r in self.prices.rows(PROVIDER, self.region)
                if not r.instance_type.endswith(LOW_PRIORITY_SUFFIX)]

    def _unknown_size(self, vm_size: str, *, field: str = "instance type") -> InvalidSpec:
        known = self._sizes()
        listed = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
        text = (f"VM size {vm_size!r} has no price in the catalog for {self.region}; known: "
                f"{listed or 'none (add azure rows to the price catalog)'}.")
        if field in SETTINGS.labels:  # a setting: worded and keyed as clean_config's problems
            message = f"{SETTINGS.labels[field]}: {text}"
            return InvalidSpec(message, errors={field: [message]})
        return InvalidSpec(f"{field}: {text}")

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        """USD per VM-hour of ``instance_type`` (default: ``vm_size``) in the backend's region.

        Azure ML clusters are priced as their VMs (clouds.md §4.3), so this is the catalog's VM price
        × 1. Low priority (``spot`` or ``tier: low_priority``) takes the catalog row
        ``<size>:low_priority``; there is no discount formula. Raises :class:`InvalidSpec` when the
        catalog has no such row.
        """
        size = instance_type or self.config["vm_size"]
        low = self._low_priority(spot)
        row = self._row(size, low_priority=low)
        if row is None and low and self._row(size, low_priority=False) is not None:
            raise InvalidSpec(
                f"{size} has no low-priority price in the catalog for {self.region}; add a row "
                f"'{size}{LOW_PRIORITY_SUFFIX}' (from the Azure Retail Prices API) or run "
                f"on dedicated VMs (untick spot / set tier to dedicated).")
        if row is None:
            raise self._unknown_size(size)
        return float(row.usd_per_hour)

    def on_demand_price(self, instance_type: str = "") -> float:
        """USD per VM-hour of ``instance_type`` (default ``vm_size``) on dedicated VMs, whatever the
        backend's tier: the figure a low-priority job's saving is measured against. Raises
        :class:`InvalidSpec` when the catalog has no row for the size."""
        size = instance_type or self.config["vm_size"]
        row = self._row(size, low_priority=False)
        if row is None:
            raise self._unknown_size(size)
        return float(row.usd_per_hour)

    def gpus(self, instance_type: str = "") -> GpuFacts | None:
        """The catalog's GPU facts of VM size ``instance_type`` (default: the backend's ``vm_size``)."""
        return catalog_gpus(self.prices, PROVIDER, instance_type or self.config["vm_size"])

    def instance_offers(self) -> list[InstanceOffer]:
        """The catalog's VM sizes for the region (sorted); with ``tier: low_priority`` only those with
        a low-priority row, at that price."""
        low = self.config["tier"] == "low_priority"
        offers = []
        for size in self._sizes():
            row = self._row(size, low_priority=low)
            if row is not None:
                offers.append(InstanceOffer(
                    instance_type=size, usd_per_hour=float(row.usd_per_hour), confirmed=row.confirmed,
                    source=f"{row.source} ({row.as_of})" if row.as_of else row.source))
        return offers

    # -- validate / build -------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Base checks (nodes, processes, runtime ≥ 1 s) plus Azure ML's own; no provider call.

        * VM size: priced in the catalog (for low priority, its ``:low_priority`` row);
        * processes per node ≤ the VM's GPUs (one rank per GPU);
        * max runtime ≤ 30 days; dataset "" or an Azure data URI (:data:`DATASET_PREFIXES`);
          checkpoints "" or a datastore path (:data:`DATASTORE_PATH_RE`); ``train.init_from`` "", a
          datastore path of this workspace or an ``s3://``/``gs://``/``az://`` URI;
        * config a JSON object; env names valid; the job's image an image reference;
        * its code archive readable, unchanged and without members named like ours (reads the local
          archive: no provider call).
        """
        azure_job_name(spec.job_name)
        size = spec.instance_type or self.config["vm_size"]
        if not VM_SIZE_RE.fullmatch(size):
            raise InvalidSpec(f"instance type {size!r}: Azure VM sizes look like 'Standard_NC6s_v3'.", field="instance_type")
        super().validate(spec)
        self.price(size, spec.spot)
        gpus = VM_GPUS.get(size)
        if gpus and spec.procs_per_node > gpus:
            raise InvalidSpec(
                f"{spec.nodes} × {size} with {spec.procs_per_node} processes per node: {size} has {gpus} "
                f"GPU{'s' if gpus != 1 else ''} and each rank needs its own; ask for at most {gpus} processes "
                f"per node (world size {spec.nodes} × {gpus} = {spec.nodes * gpus}).", field="procs_per_node")
        if spec.max_runtime_s > MAX_RUNTIME_S:
            raise InvalidSpec(f"max runtime {spec.max_runtime_s} s is above {MAX_RUNTIME_S} s (30 days); lower it "
                              f"and resume from the checkpoints in a second job.", field="max_runtime_s")
        if spec.dataset_uri and not spec.dataset_uri.startswith(DATASET_PREFIXES):
            raise InvalidSpec(
                f"dataset {spec.dataset_uri!r}: Azure ML mounts data from a datastore or storage URL; use "
                f"'azureml://datastores/<datastore>/paths/<path>', 'azureml:<data asset>:<version>' or an "
                f"https:// blob URL (or a built-in dataset).", field="dataset_uri")
        if spec.checkpoint_uri and not DATASTORE_PATH_RE.fullmatch(spec.checkpoint_uri):
            # Listed and resumed from through its datastore (_output_location, checkpoint_uri).
            raise InvalidSpec(f"checkpoints {spec.checkpoint_uri!r}: expected a datastore path "
                              f"'azureml://datastores/<datastore>/paths/<path>/' (Backend.checkpoint_uri).")
        if not isinstance(spec.config, Mapping):
            raise InvalidSpec("config: expected a JSON object (the trainer_pkg JobConfig as a dict).")
        self._check_init_from(init_from(spec.config))
        if spec.image and not IMAGE_RE.fullmatch(spec.image):
            raise InvalidSpec(f"image {spec.image!r}: expected a container image such as "
                              f"'myregistry.azurecr.io/training:1' ('<registry>/<repository>[:tag|@digest]').", field="image")
        if spec.code is not None:  # the archive's own problems, before the job is queued
            packaging.refuse_ours(packaging.code_files(spec.code), ())
        self._config_json(spec)
        self._environment(spec)

    def _check_init_from(self, uri: str) -> None:
        """``train.init_from`` of a job here is "", a datastore path of this workspace (mounted as the
        ``init_from`` input) or a URI the trainer reads itself (``s3://``, ``gs://``, ``az://``);
        anything else, a local path of another machine included, is an :class:`InvalidSpec`."""
        if not uri or is_remote(uri):
            return
        m = DATASTORE_PATH_RE.fullmatch(uri)
        if m is None:
            raise InvalidSpec(
                f"train.init_from {uri!r}: an Azure ML job reads the file it starts from as an input mounted "
                f"from a datastore path 'azureml://datastores/<datastore>/paths/<path>' of workspace "
                f"{self.config['workspace']} (its jobs' artifact_uri), or through an s3://, gs:// or az:// URI; "
                f"start from a job of this backend.")
        scope = LONG_FORM_SCOPE_RE.match(uri)
        mine = (self.config["subscription_id"], self.config["resource_group"], self.config["workspace"])
        if scope and tuple(g.lower() for g in scope.groups()) != tuple(v.lower() for v in mine):
            raise InvalidSpec(
                f"train.init_from {uri!r} is a datastore path of workspace {scope.group(3)} (resource group "
                f"{scope.group(2)}), not of this backend's workspace {mine[2]} (resource group {mine[1]}): a job "
                f"mounts its own workspace's datastores. Start from a job of this backend.")

    def _inputs(self, spec: JobSpec) -> dict[str, Any]:
        """The job's inputs, each mounted read-only (``ro_mount``): ``data``, the dataset folder
        (``spec.dataset_uri``), and ``init_from``, the one file ``train.init_from`` names when it is a
        datastore path (:data:`INIT_INPUT`)."""
        from azure.ai.ml import Input

        mounts = {}
        if spec.dataset_uri:
            mounts[DATA_INPUT] = ("uri_folder", spec.dataset_uri)
        if DATASTORE_PATH_RE.fullmatch(init_from(spec.config)):
            mounts[INIT_INPUT] = ("uri_file", init_from(spec.config))
        return {name: Input(type=kind, path=path, mode="ro_mount") for name, (kind, path) in mounts.items()}

    def _config_json(self, spec: JobSpec) -> str:
        """The job config written into the code snapshot, with the job's shape in ``parallel`` and,
        for a job with user code, ``code.dir`` "." and the archive's hash."""
        cfg = packaging.config_with_code(spec.config, spec.code, packaging.CODE_DIR_HERE)
        parallel = cfg.setdefault("parallel", {})
        if not isinstance(parallel, dict):
            raise InvalidSpec(f"config.parallel: expected an object of fields, got {parallel!r:.100}")
        parallel["nodes"] = int(spec.nodes)
        parallel["procs_per_node"] = int(spec.procs_per_node)
        try:
            return json.dumps(cfg, sort_keys=True, indent=1) + "\n"
        except (TypeError, ValueError) as exc:
            raise InvalidSpec(f"config: not JSON-serialisable ({exc}).") from None

    def _environment(self, spec: JobSpec) -> dict[str, str]:
        """The processes' ``environment_variables``: ours, then ``spec.env``, then ``spec.secret_env``
        (a message about a variable names it, never its value)."""
        env = {"PYTHONUNBUFFERED": "1", "TRAINBOARD_JOB_NAME": spec.job_name}
        env.update({str(k): str(v) for k, v in spec.env.items()})
        env.update({str(k): str(v) for k, v in spec.secret_env.items()})
        for key in env:
            if not ENV_KEY_RE.fullmatch(key):
                raise InvalidSpec(f"env {key!r}: names are letters, digits and '_', not starting with a digit.")
        return env

    def _tags(self, spec: JobSpec) -> dict[str, str]:
        return {TAG_JOB_NAME: spec.job_name, **{str(k): str(v) for k, v in spec.tags.items()}}

    def write_code(self, spec: JobSpec, directory: Path | str) -> Path:
        """Lay out the job's code snapshot in ``directory``: the trainer archive's files (from
        ``spec.trainer_package_uri``, a directory holding ``trainer_pkg/``, or this checkout's) with
        ``spec.code``'s files at the root (:func:`~cloud_adapters.packaging.build_archive`, which refuses
        members named like ours), an empty ``.amlignore`` when the user's root ``.gitignore`` would
        otherwise thin the upload, and ``trainboard_job.json`` = the job config. Returns the directory."""
        source = spec.trainer_package_uri
        if source and not Path(source, "trainer_pkg", "__init__.py").is_file():
            raise InvalidSpec(f"trainer package {source!r}: expected a directory that contains trainer_pkg/ "
                              f"(leave it empty to ship this installation's).")
        archive = packaging.build_archive(source or None, code=spec.code)
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive.data), mode="r:gz") as tar:
            tar.extractall(root, filter="data")
        if (root / ".gitignore").is_file() and not (root / AMLIGNORE).exists():
            (root / AMLIGNORE).write_text("", encoding="utf-8")
        (root / CONFIG_FILE).write_text(self._config_json(spec), encoding="utf-8")
        return root

    def conda_file(self, spec: JobSpec) -> dict[str, Any]:
        """The conda file of a job with requirements: Python :data:`CONDA_PYTHON` and pip, whose
        dependencies are the trainer's (its pyproject's ``dependencies`` and the extras its data needs:
        ``digits`` for the built-in dataset, ``images`` for an image folder) and then the requirement
        lines of ``spec.code`` (:func:`~cloud_adapters.packaging.requirement_lines`, pip options kept:
        Azure ML hands the list to pip as a requirements file)."""
        source = Path(spec.trainer_package_uri or packaging.REPO_ROOT)
        project = tomllib.loads((source / "trainer_pkg" / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        data = spec.config.get("data") if isinstance(spec.config.get("data"), Mapping) else {}
        fmt = data.get("format", "builtin")
        extras = project.get("optional-dependencies", {})
        wanted = {"builtin": "digits", "imagefolder": "images"}.get(str(fmt))
        trainer = list(project.get("dependencies", [])) + list(extras.get(wanted, []) if wanted else [])
        user = packaging.requirement_lines(spec.code.requirements) if spec.code is not None else []
        return {"name": "trainboard", "channels": ["conda-forge"],
                "dependencies": [f"python={CONDA_PYTHON}", "pip", {"pip": trainer + user}]}

    def environment(self, spec: JobSpec) -> Any:
        """The job's environment: an azure-ai-ml ``Environment`` of the job's image (else
        :data:`REQUIREMENTS_IMAGE`) plus :meth:`conda_file` when its code has requirements; of the job's
        image alone when it names one; else the backend's ``environment`` setting (a reference)."""
        from azure.ai.ml.entities import Environment

        requirements = spec.code is not None and bool(packaging.requirement_lines(spec.code.requirements))
        if requirements:
            return Environment(image=spec.image or REQUIREMENTS_IMAGE, conda_file=self.conda_file(spec),
                               description=f"Trainboard code {spec.code.sha256[:16]} and its requirements")
        if spec.image:
            return Environment(image=spec.image)
        return self.config["environment"]

    def command_job(self, spec: JobSpec, code_dir: Path | str) -> Any:
        """The azure-ai-ml ``Command`` for ``spec`` with its code snapshot in ``code_dir``
        (clouds.md §3.1). Makes no call."""
        from azure.ai.ml import MpiDistribution, Output, PyTorchDistribution, command
        from azure.ai.ml.entities import QueueSettings

        name = azure_job_name(spec.job_name)
        inputs = self._inputs(spec)
        outputs = {
            MODEL_OUTPUT: Output(type="uri_folder", path=spec.output_uri or None, mode="rw_mount"),
            CHECKPOINT_OUTPUT: Output(type="uri_folder", path=spec.checkpoint_uri or None, mode="rw_mount"),
        }
        job = command(
            name=name,
            display_name=spec.job_name,
            experiment_name=EXPERIMENT,
            command=COMMAND + (INIT_ARGUMENT if INIT_INPUT in inputs else ""),
            code=str(code_dir),
            environment=self.environment(spec),
            environment_variables=self._environment(spec),
            compute=self.config["compute"],
            instance_count=int(spec.nodes),
            distribution=(MpiDistribution if packaging.code_framework(spec.config) == "mpi" else PyTorchDistribution)(
                process_count_per_instance=int(spec.procs_per_node)),
            inputs=inputs,
            outputs=outputs,
            timeout=int(spec.max_runtime_s),
            tags=self._tags(spec),
        )
        if self._low_priority(spec.spot):
            job.queue_settings = QueueSettings(job_tier="spot")
        return job

    # -- submit -----------------------------------------------------------------------------

    # CloudBackend.submit: jobs.get(name) (adopt when it exists); else jobs.create_or_update (code
    # hash lookup, upload of a new snapshot, code version, job PUT); when the create fails, jobs.get
    # again and adopt a job a concurrent or earlier attempt created.

    def provider_name(self, job_name: str) -> str:
        return azure_job_name(job_name)

    @contextlib.contextmanager
    def create_request(self, spec: JobSpec, name: str) -> Iterator[Any]:
        with tempfile.TemporaryDirectory(prefix="trainboard-azureml-") as tmp:
            # The snapshot's folder name becomes its blob prefix: name it after the job.
            yield self.command_job(spec, self.write_code(spec, Path(tmp, name)))

    def create_job(self, spec: JobSpec, name: str, request: Any) -> Any:
        ml = self.ml_client()
        return self.call(lambda: ml.jobs.create_or_update(request))

    def adopt_after_failed_create(self, exc: BackendError) -> bool:
        return True  # the PUT may have landed before its answer was lost

    def job_handle(self, job_name: str, job: Any) -> JobHandle:
        resources = getattr(job, "resources", None)
        count = getattr(resources, "instance_count", None) or 1
        return JobHandle(provider=self.kind, job_name=job_name, provider_job_id=str(getattr(job, "id", "") or ""),
                         extra={"azure_job_name": str(getattr(job, "name", "") or azure_job_name(job_name)),
                                "instance_count": int(count)})

    def job_ref(self, handle: JobHandle) -> str:
        return str(handle.extra.get("azure_job_name") or azure_job_name(handle.job_name))

    def no_job(self, ref: str) -> str:
        return f"Azure ML workspace {self.config['workspace']} has no job {ref!r}"

    def get_job(self, ref: str) -> Any | None:
        """``jobs.get(name)``, or None when the workspace has no job of that name (404)."""
        from azure.core.exceptions import ResourceNotFoundError

        ml = self.ml_client()
        try:
            return self.call(lambda: ml.jobs.get(ref))
        except BackendError as exc:
            if isinstance(exc.__cause__, ResourceNotFoundError):
                return None
            raise

    # -- describe ---------------------------------------------------------------------------

    def job_status(self, job: Any) -> JobStatus:
        """The mapping of :mod:`cloud_adapters.azureml.states`; a Failed job adds one run-history
        read for its error message (the ARM job carries none)."""
        raw = status_text(getattr(job, "status", None))
        error = self._error_message(str(job.name)) if raw in ("Failed", "NotResponding") else ""
        context = getattr(job, "creation_context", None)
        queue = getattr(job, "queue_settings", None)
        tier = str(getattr(queue, "job_tier", "") or "").lower()
        return job_status(
            status=raw, properties=dict(getattr(job, "properties", None) or {}),
            created_at=getattr(context, "created_at", None),
            last_modified_at=getattr(context, "last_modified_at", None), error=error,
            instance_count=getattr(getattr(job, "resources", None), "instance_count", None),
            low_priority=tier == "spot" or self.config["tier"] == "low_priority")

    def raw_state(self, job: Any) -> str:
        return status_text(getattr(job, "status", None))

    def _error_message(self, name: str) -> str:
        """The failed run's error message from run history (the ARM job carries none); "" when it
        cannot be read — the status itself is still reported."""
        try:
            details = self._run_details(name)
        except BackendError:
            return ""
        error = getattr(getattr(details, "error", None), "error", None)
        message = str(getattr(error, "message", "") or "")
        code = str(getattr(error, "code", "") or "")
        return f"{code}: {message}" if code and message else message

    def _tagged_jobs(self) -> Iterator[Any]:
        """The workspace's jobs that carry the :data:`~cloud_adapters.base.TAG_JOB_NAME` tag:
        ``jobs.list(tag=...)`` (REST ``?tag=``), page by page, at most :data:`LIST_PAGE_LIMIT` pages."""
        ml = self.ml_client()

        def page(token: str | None) -> tuple[list[Any], str | None]:
            pages = ml.jobs.list(tag=TAG_JOB_NAME).by_page(continuation_token=token)
            return [j for j in next(pages) if j is not None], pages.continuation_token

        return self.pages(page, max_pages=LIST_PAGE_LIMIT)

    def jobs_of(self, handles: Sequence[JobHandle], since: dt.datetime | None) -> Iterator[tuple[JobHandle, Any]]:
        """ONE paginated list of the tagged jobs (:meth:`_tagged_jobs`), whatever the number of
        handles; :meth:`modified_at` leaves out those unchanged since ``since``. A handle the list
        does not contain (deleted, archived) is left out."""
        if not handles:
            return
        wanted = {self.job_ref(h): h for h in handles}
        for job in self._tagged_jobs():
            if getattr(job, "name", None) in wanted:
                yield wanted[job.name], job

    def modified_at(self, job: Any) -> dt.datetime | None:
        return parse_utc(getattr(getattr(job, "creation_context", None), "last_modified_at", None))

    # -- orphans ----------------------------------------------------------------------------

    def unfinished_jobs(self) -> Iterator[Any]:
        """The tagged jobs (:meth:`_tagged_jobs`, the list :meth:`describe_many` reads), ended ones
        included: ``jobs.list`` cannot filter by status, and the statuses are in the list, so
        :meth:`list_tagged` drops the ended ones with no call per job."""
        return self._tagged_jobs()

    def job_tags(self, job: Any) -> dict[str, str]:
        return dict(getattr(job, "tags", None) or {})

    def created_at(self, job: Any) -> dt.datetime | None:
        return parse_utc(getattr(getattr(job, "creation_context", None), "created_at", None))

    # -- cancel -----------------------------------------------------------------------------

    def cancel(self, handle: JobHandle) -> None:
        """``jobs.begin_cancel(name)`` and wait for its short LRO (the cancel request, not the stop:
        Azure ML then reports CancelRequested, then Canceled).

        Idempotent: a job already Canceled, Completed, Failed or CancelRequested is left alone (no
        call beyond ``jobs.get``), and a cancel the service refuses because the job just ended is
        not an error. Raises :class:`ProviderError` when there is no such job.
        """
        name = self.job_ref(handle)
        job = self.get_job(name)
        if job is None:
            raise ProviderError(f"{self.no_job(name)} to cancel.")
        # Looked up first, so a repeated cancel sends Azure ML no second cancel request.
        if self.states.ended_or_ending(self.raw_state(job)):
            return
        self.stop(name)

    def stop_job(self, ref: str) -> None:
        ml = self.ml_client()
        self.call(lambda: ml.jobs.begin_cancel(ref).result(timeout=60))

    def stop_refused(self, exc: BackendError) -> bool:
        return True  # the refusal's code does not say whether the job just ended: look

    # -- logs -------------------------------------------------------------------------------

    def _run_details(self, name: str) -> Any:
        """Run history's details of the job's run (``logFiles``, ``error``, times)."""
        ml = self.ml_client()
        return self.call(lambda: ml.jobs._runs_operations.get_run_details(name))  # noqa: SLF001 - §3.5

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        """New lines of the job's user logs since ``cursor`` (see :mod:`cloud_adapters.azureml.logs`
        for the cursor and line format; metric lines stay exactly as the trainer printed them).

        Calls: run history's run details (the log files' SAS URLs), then one ranged GET per log file.
        A job with no run yet (queued) has no lines.
        """
        from azure.core.exceptions import ResourceNotFoundError

        az_logs.parse_cursor(cursor)
        try:
            details = self._run_details(self.job_ref(handle))
        except BackendError as exc:
            if isinstance(exc.__cause__, ResourceNotFoundError):
                return [], cursor
            raise
        files = dict(getattr(details, "log_files", None) or {})
        return az_logs.read_new(files, cursor, self._fetch_range)

    def _fetch_range(self, url: str, offset: int, length: int) -> bytes | None:
        """Up to ``length`` bytes of ``url`` from ``offset`` (HTTP Range): ``b""`` past its end (416),
        None when the file is gone (404)."""
        from azure.core.exceptions import HttpResponseError
        from azure.core.pipeline import Pipeline
        from azure.core.pipeline.policies import HeadersPolicy
        from azure.core.rest import HttpRequest

        def get() -> bytes | None:
            pipeline = Pipeline(transport=self._log_transport(), policies=[HeadersPolicy()])
            request = HttpRequest("GET", url, headers={"Range": f"bytes={offset}-{offset + length - 1}",
                                                       "x-ms-version": "2021-08-06"})
            response = pipeline.run(request).http_response
            response.read()
            if response.status_code == 416:
                return b""
            if response.status_code == 404:
                return None
            if response.status_code not in (200, 206):
                raise HttpResponseError(response=response)
            data = response.content
            return data[:length] if response.status_code == 206 else data[offset:offset + length]

        return self.call(get)

    # -- artifacts --------------------------------------------------------------------------
    # The job's outputs ``model`` and ``checkpoints`` are uri_folders on a datastore: the path the job
    # set (azureml://datastores/<datastore>/paths/<path>), else Azure ML's default
    # azureml://datastores/workspaceblobstore/paths/azureml/<job name>/<output name>/. The datastore
    # names the storage account and Blob container; its account key (listSecrets) signs SAS URLs.

    def _output_location(self, job: Any, output: str) -> tuple[str, str]:
        """``(datastore, path prefix ending in '/')`` of the job's output ``output``."""
        ref = str(getattr(job, "name", ""))
        outputs = getattr(job, "outputs", None) or {}
        path = str(getattr(outputs.get(output), "path", "") or "")
        m = DATASTORE_PATH_RE.fullmatch(path)
        if m:
            return m.group(1), m.group(2).strip("/") + "/"
        return DEFAULT_DATASTORE, f"azureml/{ref}/{output}/"

    def _blob_store(self, datastore: str) -> tuple[Any, str]:
        """``(BlobServiceClient, container)`` of ``datastore``: with its account key when Azure ML
        hands it out (listSecrets), else the backend's own Entra ID credential (no SAS then)."""
        key = "blob:" + datastore

        def make() -> tuple[Any, str]:
            from azure.storage.blob import BlobServiceClient

            ml = self.ml_client()
            try:
                store = self.call(lambda: ml.datastores.get(datastore, include_secrets=True))
            except BackendError:
                store = self.call(lambda: ml.datastores.get(datastore))
            account_key = getattr(getattr(store, "credentials", None), "account_key", None)
            url = self._blob_account_url or f"{store.protocol}://{store.account_name}.blob.{store.endpoint}"
            credential: Any = ({"account_name": store.account_name, "account_key": account_key} if account_key
                               else self.credential())
            return BlobServiceClient(account_url=url, credential=credential, retry_total=0), store.container_name
        with self._lock:
            cache = self.__dict__.setdefault("_blob_stores", {})
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def _artifact_files(self, handle: JobHandle) -> dict[str, artifact_store.StoredFile]:
        def list_files() -> dict[str, artifact_store.StoredFile]:
            ref = self.job_ref(handle)
            job = self.get_job(ref)
            if job is None:
                raise ProviderError(f"{self.no_job(ref)}: its outputs cannot be found")
            found: list[artifact_store.StoredFile] = []
            for output, name_prefix in ((MODEL_OUTPUT, ""), (CHECKPOINT_OUTPUT, "checkpoints/")):
                datastore, prefix = self._output_location(job, output)
                service, container = self._blob_store(datastore)
                root = artifact_store.Root(container, prefix, name_prefix)
                found += [dataclasses.replace(f, store=datastore) for f in
                          self.call(lambda root=root, service=service: artifact_store.blob_files(service, root),
                                    "Azure Blob")]
            return artifact_store.collect(found)
        return artifact_store.cached_listing(self, self.job_ref(handle), list_files)

    def _pick(self, handle: JobHandle, name: str) -> tuple[Any, artifact_store.StoredFile]:
        f = artifact_store.pick(self._artifact_files(handle), name, handle.job_name)
        service, _ = self._blob_store(f.store)
        return service, f

    def artifacts(self, handle: JobHandle) -> list[Artifact]:
        """The job's outputs in their datastore's Blob container: ``model``'s files by their name
        under it (``model.pt``, ``metrics.jsonl``), ``checkpoints``' as ``checkpoints/...``. Calls:
        GET job, GET datastore (+ listSecrets), List Blobs per output."""
        return artifact_store.as_artifacts(self._artifact_files(handle))

    def open_artifact(self, handle: JobHandle, name: str) -> BinaryIO:
        """A chunked reader of the blob (Get Blob)."""
        service, f = self._pick(handle, name)
        return self.call(lambda: artifact_store.blob_open(service, f), "Azure Blob")

    def artifact_url(self, handle: JobHandle, name: str, *, expires_s: int = 300) -> str | None:
        """A read-only SAS URL signed with the datastore's account key; None without one."""
        service, f = self._pick(handle, name)
        return artifact_store.blob_url(service, f, expires_s)

    def artifact_uri(self, handle: JobHandle, name: str) -> str:
        """``azureml://datastores/<datastore>/paths/<blob>``: what a later Azure ML job takes as an input."""
        f = artifact_store.pick(self._artifact_files(handle), name, handle.job_name)
        return f"azureml://datastores/{f.store}/paths/{f.key}"

    def checkpoint_uri(self, handle: JobHandle) -> str:
        """Where the job's trainer wrote its checkpoints: its ``checkpoints`` output, mounted read-write
        as ``AZURE_ML_OUTPUT_checkpoints`` (trainer_pkg/platforms.py ``read_azureml``), as the
        datastore path ``azureml://datastores/<datastore>/paths/<path>/``: the path the job set, else
        Azure ML's default ``azureml://datastores/workspaceblobstore/paths/azureml/<job name>/checkpoints/``.
        A later attempt given it as :attr:`JobSpec.checkpoint_uri` mounts that same folder as its
        ``checkpoints`` output (:meth:`command_job`), and the trainer resumes from what is there
        (docs/recovery.md). A datastore path, not an ``az://`` URI: it is what an Azure ML output
        takes, and the datastore names the storage account. One GET of the job. Raises
        :class:`ProviderError` when the workspace no longer has it."""
        ref = self.job_ref(handle)
        job = self.get_job(ref)
        if job is None:
            raise ProviderError(f"{self.no_job(ref)}: where its checkpoints are cannot be found")
        datastore, prefix = self._output_location(job, CHECKPOINT_OUTPUT)
        return f"azureml://datastores/{datastore}/paths/{prefix}"

    # -- test connection --------------------------------------------------------------------

    def connection_probes(self) -> list[Probe]:
        """``credential`` (a token for Azure Resource Manager), ``workspace`` (``workspaces.get``),
        ``compute`` (``compute.get`` of the cluster, with its VM size and node range); a failed
        check leaves the later ones out, as each needs the one before."""
        ws, rg, sub = self.config["workspace"], self.config["resource_group"], self.config["subscription_id"]
        cluster = self.config["compute"]

        def token() -> str:
            self.credential().get_token("https://management.azure.com/.default")
            return "obtained a token for Azure Resource Manager"

        def token_hint(exc: BaseException) -> str:
            return str(exc) if isinstance(exc, BackendError) else _azure.no_credentials_message(exc)

        def status_of(exc: BaseException) -> int | None:
            return _azure.http_status(exc.__cause__ or exc)

        def workspace() -> str:
            found = self.ml_client().workspaces.get(ws)
            return f"workspace {ws} found in resource group {rg} ({getattr(found, 'location', '') or 'region unknown'})"

        def workspace_hint(exc: BaseException) -> str:
            status = status_of(exc)
            if status == 404:
                return (f"workspace {ws} was not found in resource group {rg} of subscription {sub}; correct the "
                        f"workspace, resource_group or subscription_id setting.")
            if status in (401, 403):
                return (f"access to workspace {ws} was denied; give the worker's identity a role on it (e.g. "
                        f"AzureML Data Scientist).")
            return str(exc)

        def compute() -> str:
            found = self.ml_client().compute.get(cluster)
            size = getattr(found, "size", "") or "unknown size"
            low, high = getattr(found, "min_instances", None), getattr(found, "max_instances", None)
            nodes = f", {low}–{high} nodes" if high is not None else ""
            return f"compute cluster {cluster} exists ({size}{nodes})"

        def compute_hint(exc: BaseException) -> str:
            if status_of(exc) == 404:
                return (f"compute cluster {cluster} does not exist in workspace {ws}; create it (Azure ML studio → "
                        f"Compute → Compute clusters) or correct the compute setting.")
            return str(exc)

        return [Probe("credential", token, token_hint, required=True),
                Probe("workspace", workspace, workspace_hint, required=True),
                Probe("compute", compute, compute_hint)]

    # -- plumbing ---------------------------------------------------------------------------

    def credential(self) -> Any:
        """The credential in use: the one passed in, else the stored service principal's
        ``ClientSecretCredential``, else ``DefaultAzureCredential()`` (created once).

        The service principal's token requests (Microsoft Entra ID's OpenID configuration and token
        endpoint) go through the backend's ``transport`` when one was given, like every other request
        of the backend: a stand-in then sees the stored secret being exchanged for the bearer token
        its ARM calls carry."""
        with self._lock:
            if self._credential is None:
                if self.secrets.get("client_secret"):
                    from azure.identity import ClientSecretCredential

                    # Its pipeline's own retries off too, as for MLClient: cloud_adapters.retry retries.
                    options: dict[str, Any] = {"retry_total": 0}
                    if self._transport is not None:
                        options["transport"] = self._transport
                    self._credential = ClientSecretCredential(
                        tenant_id=self.secrets["tenant_id"], client_id=self.secrets["client_id"],
                        client_secret=self.secrets["client_secret"], **options)
                else:
                    from azure.identity import DefaultAzureCredential

                    self._credential = DefaultAzureCredential()
            return self._credential

    def ml_client(self) -> Any:
        """The ``MLClient`` of the workspace (created once per backend object; thread-safe).

        azure-core retries are off (``retry_total=0``: :mod:`cloud_adapters.retry` retries), so is
        telemetry. The cloud is always named (``AzureCloud``, or a cloud registered for
        ``base_url``). MLClient writes it into the process environment (``AZUREML_CURRENT_CLOUD``);
        the previous value is put back, because a worker that also runs the gpubox backend passes its
        environment to the trainer, whose platform detection reads any ``AZUREML_*`` variable as
        "running inside Azure ML" (trainer_pkg/platforms.py ``detect``).
        """
        credential = self.credential()
        with self._lock:
            if self._ml is None:
                from azure.ai.ml import MLClient

                kwargs: dict[str, Any] = {"retry_total": 0, "enable_telemetry": False, "show_progress": False}
                kwargs.update(_cloud_kwargs(self.config["base_url"]))
                if self._transport is not None:
                    kwargs["transport"] = self._transport
                with _CLOUD_ENV_LOCK:
                    before = os.environ.get(CLOUD_ENV)
                    try:
                        self._ml = MLClient(credential, subscription_id=self.config["subscription_id"],
                                            resource_group_name=self.config["resource_group"],
                                            workspace_name=self.config["workspace"], **kwargs)
                    finally:
                        _restore_env(CLOUD_ENV, before)
            return self._ml

    def _log_transport(self) -> Any:
        """The transport of log reads: the one passed in, else a requests transport (created once)."""
        with self._lock:
            if self._transport is not None:
                return self._transport
            if self._requests_transport is None:
                from azure.core.pipeline.transport import RequestsTransport

                self._requests_transport = RequestsTransport()
            return self._requests_transport

    def rate_limit(self) -> tuple[str, float]:
        """The subscription, at :data:`RATE_PER_SECOND`."""
        return f"azure:{self.config['subscription_id']}", RATE_PER_SECOND

    def classify(self, exc: BaseException, *, service: str) -> retry.Verdict | None:
        """:func:`cloud_adapters._azure.classify`, except that a token refused for the stored service
        principal says so (not "DefaultAzureCredential tried ...", which was not in use)."""
        from azure.core.exceptions import ClientAuthenticationError, ServiceRequestError, ServiceResponseError

        if (isinstance(exc, ClientAuthenticationError) and _azure.http_status(exc) is None
                and self.secrets.get("client_secret") and self._credential is not None
                and type(self._credential).__name__ == "ClientSecretCredential"):
            if isinstance(exc.__cause__ or exc.__context__, (ServiceRequestError, ServiceResponseError)):
                # No answer at all (DNS, connection, timeout): nothing was refused; try again later.
                return retry.Verdict(True, ProviderError(
                    f"could not reach Microsoft Entra ID for a token of the backend's stored service principal "
                    f"({_azure.error_message(exc)}); check the worker's network (login.microsoftonline.com). "
                    f"The next sync tries again.", transient=True))
            return retry.Verdict(False, CredentialsError(
                f"Microsoft Entra ID refused the backend's stored service principal: {_azure.error_message(exc)} "
                f"Check its tenant id, client id and client secret on the backend (a client secret expires; "
                f"create a new one under App registrations → Certificates & secrets)."))
        return _azure.classify(exc, service=service)


CLOUD_ENV = "AZUREML_CURRENT_CLOUD"
_CLOUD_ENV_LOCK = threading.Lock()


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _cloud_kwargs(base_url: str) -> dict[str, Any]:
    """MLClient's ``cloud`` (and ``cloud_metadata`` for a ``base_url`` override): Azure's public cloud,
    or a cloud named after the URL whose resource manager is ``base_url``."""
    if not base_url:
        return {"cloud": "AzureCloud"}
    from azure.ai.ml._azure_environments import EndpointURLS, _get_cloud  # noqa: PLC2701 - no public API

    public = _get_cloud("AzureCloud")
    metadata = {key: public.get(key) for key in (
        EndpointURLS.AZURE_PORTAL_ENDPOINT, EndpointURLS.ACTIVE_DIRECTORY_ENDPOINT, EndpointURLS.AML_RESOURCE_ID,
        EndpointURLS.STORAGE_ENDPOINT, EndpointURLS.REGISTRY_DISCOVERY_ENDPOINT)}
    metadata[EndpointURLS.RESOURCE_MANAGER_ENDPOINT] = base_url + "/"
    name = "trainboard-" + hashlib.sha256(base_url.encode()).hexdigest()[:10]
    return {"cloud": name, "cloud_metadata": metadata}
