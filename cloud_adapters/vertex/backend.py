"""The Vertex AI backend: a Trainboard job is one Vertex AI ``CustomJob``, through google-cloud-aiplatform's
``aiplatform_v1.JobServiceClient`` on its REST transport.

What a job is made of (clouds.md §2.1 for every field):

* the trainer as a pip-installable source archive (:mod:`cloud_adapters.vertex.package`), uploaded once
  per content hash to ``gs://<bucket>/<prefix>/code/trainboard-trainer-<sha256[:16]>.tar.gz``;
* with the user's code (``JobSpec.code``), a second archive in ``package_uris``: the code as a package
  whose dependencies are its ``requirements.txt`` (:func:`cloud_adapters.vertex.package.build_code_sdist`),
  uploaded once per content hash beside the trainer's; the config's ``code.dir`` is that package's
  directory name, relative to the site-packages both are installed into (:func:`~.package.code_dir`);
* ``executor_image_uri``: ``JobSpec.image`` when set, else the backend's ``image_uri``;
* the job's config as JSON at ``gs://<bucket>/<prefix>/jobs/<label>/trainboard_job.json``, read by
  the trainer through Vertex's Cloud Storage FUSE mount ``/gcs/<bucket>/…`` (the mount the trainer
  already reads ``AIP_MODEL_DIR``/``AIP_CHECKPOINT_DIR`` through, trainer_pkg/platforms.py
  ``gcs_fuse_path``);
* ``CreateCustomJob``: worker pool 0 = the chief (1 replica), worker pool 1 = nodes − 1 workers
  (omitted for one node) — the order Vertex gives meaning to (§2.1); each a ``PythonPackageSpec``
  (``executor_image_uri`` = the prebuilt PyTorch image, ``package_uris`` = [the archive],
  ``python_module`` = ``trainer_pkg.launch``, ``args`` = ``--config /gcs/… --platform vertex
  --nproc-per-node N``, ``env`` = ``JobSpec.env`` and ``JobSpec.secret_env``), the machine type and
  accelerators; ``scheduling`` (timeout = max runtime,
  SPOT strategy for spot, ``restart_job_on_worker_restart`` for more than one node: DDP is not
  resilient to a worker leaving, and the trainer resumes from its checkpoint); ``base_output_directory``
  ``gs://<bucket>/<prefix>/output/<label>/`` so Vertex sets ``AIP_MODEL_DIR`` = ``<base>/model/`` and
  ``AIP_CHECKPOINT_DIR`` = ``<base>/checkpoints/`` (§2.3), where the trainer writes model and
  checkpoints (a resubmitted attempt of a lost run, given ``JobSpec.checkpoint_uri``, gets the lost
  attempt's base instead, so it resumes from that attempt's checkpoints: docs/recovery.md); the
  service account; labels ``trainboard-job-name`` = the job's label form plus
  ``JobSpec.tags`` (the Trainboard job and owner ids) in GCP's label form.

On a replica Vertex pip-installs the archive and runs ``python -m trainer_pkg.launch <args>``; the
launcher reads ``CLUSTER_SPEC`` and Vertex's per-machine ``RANK``/``WORLD_SIZE`` and starts torchrun
with per-process ranks (trainer_pkg/platforms.py ``read_vertex``, clouds.md §2.3).

Idempotency: Vertex job names are server-assigned ids, so a job is found again by its label
``trainboard-job-name``. submit lists the jobs with that label first and adopts one that exists
(any state). A create that failed ambiguously (5xx, timeout, dropped connection: it may have been
created) is never blindly resent: the label is listed again and only when no job carries it is the
create tried again. After a create, the label is listed once more; when a concurrent submit created
a job too, the younger one is cancelled and the older adopted, so at most one keeps running.

Sync cost: :meth:`VertexBackend.describe_many` is one filtered ``ListCustomJobs`` (all of
Trainboard's jobs created since the oldest job of the batch, 100 per page), whatever the batch size.

Every call goes through :mod:`cloud_adapters.retry` with the Google classifier
(:mod:`cloud_adapters._gcp`) under the project's token bucket (key ``gcp:<project>:<region>``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import re
import threading
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence

from cloud_adapters import _gcp, artifact_store, packaging, retry
from cloud_adapters.base import (
    TAG_JOB_NAME,
    Artifact,
    BackendError,
    Capabilities,
    InstanceOffer,
    InvalidSpec,
    JobHandle,
    JobSpec,
    JobStatus,
    ProviderError,
    Throttled,
)
from cloud_adapters.cloud import LIST_SKEW_S, CloudBackend, Probe
from cloud_adapters.gpus import GpuFacts, catalog_gpus
from cloud_adapters.pricing import SPOT_SUFFIX
from cloud_adapters.settings import BackendSettings, Secret, Setting
from cloud_adapters.vertex import logs as cloud_logs
from cloud_adapters.vertex import package
from cloud_adapters.vertex.states import STATE_MAP, STATES, RawStates, job_status, proto_time, replica_count, state_name

PROVIDER = "gcp"  # provider name in the price catalog
SERVICE = "Vertex AI"
PYTHON_MODULE = "trainer_pkg.launch"
CONFIG_FILE = "trainboard_job.json"
CHECKPOINT_SUBDIR = "checkpoints"  # AIP_CHECKPOINT_DIR = <base_output_directory>/checkpoints/ (clouds.md §2.3)

LABEL_VALUE_RE = re.compile(r"[a-z0-9_-]{0,63}")  # GCP label values
MAX_LABELS = 64  # GCP resource label limit
DISPLAY_NAME_MAX = 128  # CustomJob.display_name, UTF-8 characters
MAX_ENV = 100  # PythonPackageSpec.env entries (clouds.md §2.1)
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PROJECT_RE = re.compile(r"([a-z0-9.-]+:)?[a-z][a-z0-9-]{4,28}[a-z0-9]")  # project ids: 6–30, optional domain
REGION_RE = re.compile(r"[a-z]+(-[a-z]+)+\d+")
BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")  # GCS bucket names
IMAGE_RE = re.compile(r"[\w.\-]+(:\d+)?/[\w.\-/]+([:@][\w.\-:]+)?")  # <registry>/<repository>[:tag|@digest]
MACHINE_RE = re.compile(r"[a-z0-9]+(-[a-z0-9]+)+")
ENDPOINT_RE = re.compile(r"(https?://)?[A-Za-z0-9.-]+(:\d+)?/?")
SA_RE = re.compile(r"[a-z0-9-_.+]+@[a-z0-9-.]+\.[a-z]+")

LIST_PAGE = 100  # ListCustomJobs page_size
CALL_TIMEOUT_S = 60.0  # per API request
CALLS_PER_SECOND = 10.0  # the project's token bucket here (burst 2×)
CREATE_ATTEMPTS = 5

IMAGE_TEMPLATE = "{geo}-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-4.py310:latest"
"""Default executor image: the prebuilt-training-image pattern
``{us,europe,asia}-docker.pkg.dev/vertex-ai/training/<fw>-<cpu|gpu>.<ver>.py310:latest`` with the PyTorch
instance public runbooks use (clouds.md §2.1; exact current PyTorch tags not confirmed there). The GPU
build also runs on CPU-only machines. It has torch 2.4: ddp only (fsdp needs 2.6, pipeline 2.7,
:mod:`trainer_pkg.versions`), so a Vertex backend on it offers ddp and refuses the others at launch;
no newer prebuilt PyTorch training image was found to default to — set ``image_uri`` to one (its
``pytorch-gpu.<major>-<minor>`` tag tells the adapter its torch) to run fsdp or pipeline."""

SETTINGS = BackendSettings(
    backend_label="Google Vertex AI", provider="Vertex AI",
    settings=(
        Setting("project", "Google Cloud project ID",
                "The project that owns the jobs and pays for them, e.g. my-ml-project (the ID, not the display "
                "name).", required=True, max_length=100),
        Setting("region", "Region", "Where jobs run; blank uses us-central1.", max_length=30, default="us-central1"),
        # For code, job configs and outputs.
        Setting("staging_bucket", "Staging bucket",
                "A Cloud Storage location for the trainer package, outputs and checkpoints, gs://bucket or "
                "gs://bucket/prefix, in the same region.", required=True, max_length=1000),
        # Blank: the prebuilt PyTorch training image of the region (IMAGE_TEMPLATE).
        Setting("image_uri", "Executor image",
                "A Vertex AI prebuilt PyTorch training image; blank uses the default one.", max_length=2048,
                default=""),
        Setting("service_account", "Service account",
                "Optional: the email of the service account the job runs as; blank uses the project's Vertex AI "
                "default.", max_length=200, default=""),
        Setting("machine_type", "Default machine type",
                "Used when a job does not choose one, e.g. n1-standard-8; blank uses n1-standard-8.",
                max_length=100, default="n1-standard-8"),
        # An AcceleratorType name (clouds.md §2.6-A).
        Setting("accelerator_type", "Accelerator",
                "GPU attached to each machine, e.g. NVIDIA_TESLA_T4 or NVIDIA_L4; blank for none.", max_length=50,
                default=""),
        Setting("accelerator_count", "Accelerators per machine",
                "How many of that GPU each machine gets (0 without an accelerator).", type=int, min_value=0,
                default=0),
        # Scheduling.Strategy.SPOT.
        Setting("spot_allowed", "Spot allowed", "Jobs may ask for Spot VMs (cheaper, may be preempted).", type=bool,
                default=False),
        Setting("max_nodes", "Max machines per job", "Blank allows 16.", type=int, min_value=1, default=16),
        # Host settings: where the worker sends its calls, with the worker's own credentials (ADC) when the
        # backend stores no service-account key. An http:// endpoint is a local stand-in that also answers
        # Cloud Logging, called with anonymous credentials unless a key is stored (loopback only).
        Setting("api_endpoint", "Vertex AI API endpoint",
                "Advanced: only for a private endpoint; blank uses Google's regional endpoint.", host=True,
                max_length=500, default=""),
        Setting("storage_endpoint", "Cloud Storage endpoint",
                "Advanced: only for a private endpoint; blank uses Google's.", host=True, max_length=500,
                default=""),
    ),
    # A service-account key file (JSON text); without it, Application Default Credentials (ambient_identity).
    secrets=(Secret("service_account_json", "Service-account key (JSON)", multiline=True),),
)
"""The settings of a Vertex AI backend and the credentials it may store (:mod:`cloud_adapters.settings`)."""


def default_image_uri(region: str) -> str:
    """The prebuilt PyTorch training image in the Artifact Registry multi-region nearest ``region``
    (``europe-*`` → europe, ``asia-*``/``australia-*`` → asia, else us; clouds.md §2.1)."""
    geo = "europe" if region.startswith("europe") else "asia" if region.startswith(("asia", "australia")) else "us"
    return IMAGE_TEMPLATE.format(geo=geo)


def label_value(text: str) -> str:
    """``text`` in GCP label form: lowercase, ``[a-z0-9_-]``, at most 63 characters, deterministic.

    A value already valid is kept; otherwise other characters become ``-`` and, when anything was
    changed or cut, ``-`` + the first 8 hex digits of sha256(text) are appended (cut to fit), so two
    names that map to the same text stay distinct."""
    if LABEL_VALUE_RE.fullmatch(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]
    base = re.sub(r"[^a-z0-9_-]", "-", text.lower()).strip("-")[: 63 - 9].rstrip("-")
    return f"{base}-{digest}" if base else digest


def label_key(text: str) -> str:
    """``text`` as a label key: :func:`label_value` that starts with a lowercase letter (``k`` added)."""
    value = label_value(text)
    return value if value[:1].isalpha() else label_value(f"k{value}")


def job_label(job_name: str) -> str:
    """The ``trainboard-job-name`` label of a Trainboard job name. Raises :class:`InvalidSpec` for ""."""
    if not job_name:
        raise InvalidSpec("job name: empty; the dashboard derives it from the job id.")
    return label_value(job_name)


def parse_gcs(uri: str, field: str) -> tuple[str, str]:
    """``(bucket, object prefix without slashes at the ends)`` of ``gs://bucket[/prefix]``.

    Raises :class:`InvalidSpec` naming ``field`` for another form."""
    m = re.fullmatch(r"gs://([^/]+)(?:/(.*))?", (uri or "").strip())
    if not m or not BUCKET_RE.fullmatch(m.group(1)):
        raise InvalidSpec(f"{field}: expected a Cloud Storage URI 'gs://bucket[/prefix]', got {uri!r}.")
    prefix = (m.group(2) or "").strip("/")
    if ".." in prefix.split("/"):
        raise InvalidSpec(f"{field}: '..' is not allowed in the prefix, got {uri!r}.")
    return m.group(1), prefix


def checkpoint_base(uri: str) -> str:
    """The ``base_output_directory`` (``gs://bucket/prefix/``) whose ``AIP_CHECKPOINT_DIR`` is the
    checkpoint directory ``uri``: Vertex sets ``AIP_CHECKPOINT_DIR = <base_output_directory>/checkpoints/``
    (clouds.md §2.3; GAPIC ``CustomJobSpec.base_output_directory``), so ``uri`` must be
    ``gs://bucket/<prefix>/checkpoints[/]``, which :meth:`VertexBackend.checkpoint_uri` answers.
    Raises :class:`InvalidSpec` for another form: Vertex can point the trainer at no other directory."""
    bucket, prefix = parse_gcs(uri, "checkpoints")
    parent, _, last = prefix.rpartition("/")
    if last != CHECKPOINT_SUBDIR:
        raise InvalidSpec(f"checkpoints: Vertex AI gives a job its checkpoint directory as "
                          f"<base output directory>/{CHECKPOINT_SUBDIR}/ (AIP_CHECKPOINT_DIR); expected "
                          f"'gs://bucket/<prefix>/{CHECKPOINT_SUBDIR}/', got {uri!r}.")
    return f"gs://{bucket}/{parent}/" if parent else f"gs://{bucket}/"


def _vcpus(machine_type: str) -> int | None:
    """vCPUs of a predefined ``<series>-<standard|highmem|highcpu>-<N>`` machine type (N is the vCPU
    count in Compute Engine's naming); None for others (a2-highgpu-1g …)."""
    m = re.fullmatch(r"[a-z0-9]+-(standard|highmem|highcpu)-(\d+)", machine_type)
    return int(m.group(2)) if m else None


def _rfc3339(value: dt.datetime) -> str:
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class VertexBackend(CloudBackend):
    """Runs jobs as Vertex AI custom jobs; see the module docstring for what a job is made of.

    Settings: :data:`SETTINGS` (``clean_config`` raises :class:`InvalidSpec` naming each setting
    that is missing or malformed). Credentials are the backend's stored service-account key, else
    Application Default Credentials (:func:`cloud_adapters._gcp.credentials`).
    """

    kind = "vertex"
    service = SERVICE
    states = STATES
    image_setting = "image_uri"
    image_torch_pattern = r"/pytorch-(?:gpu|cpu|tpu|xla)\.(\d+-\d+)"  # <fw>-<cpu|gpu>.<ver>.py310, clouds.md §2.1
    # Scheduling.timeout, "the maximum job running time": aiplatform_v1 Scheduling, clouds.md §2.1.
    max_runtime_covers = (
        "the job's whole running time (Vertex AI's maximum job running time), the machines starting and the "
        "image download included (Vertex AI API reference, Scheduling timeout)")
    settings = SETTINGS
    dataset_schemes = frozenset({"gs"})
    """Cloud Storage, read through the /gcs FUSE mount Vertex gives every job (clouds.md §2.3)."""
    # google-auth's google.auth.default(), "How Application Default Credentials works" (cloud.google.com).
    ambient_identity = ("Application Default Credentials: the worker's GOOGLE_APPLICATION_CREDENTIALS key, "
                        "gcloud login or attached service account")

    @classmethod
    def uses_ambient_credentials(cls, config: Mapping[str, Any], secrets: Mapping[str, Any] | None) -> bool:
        """As :meth:`Backend.uses_ambient_credentials`, except that a plain-``http://`` ``api_endpoint``
        (a local stand-in, set by staff or the installation) without a stored key is called with
        anonymous credentials (:func:`cloud_adapters._gcp.credentials`): no identity at all."""
        if _gcp.is_local(str((config or {}).get("api_endpoint") or "")) and not (secrets or {}).get(
                "service_account_json"):
            return False
        return super().uses_ambient_credentials(config, secrets)

    def __init__(self, config: Mapping[str, Any] | None = None, *, secrets: Mapping[str, str] | None = None,
                 prices=None, retry_policy: retry.RetryPolicy | None = None, clock: retry.Clock | None = None,
                 http_session: Any = None) -> None:
        super().__init__(config, secrets=secrets, prices=prices)
        self.retry_policy = retry_policy or retry.RetryPolicy()
        """Attempts and backoff of every provider call (tests pass a seeded RNG)."""
        self.clock = clock or retry.SYSTEM_CLOCK
        """Time source of retries and the rate limit (tests pass a simulated clock)."""
        self._http_session = http_session
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._raw_states = RawStates(frozenset(STATE_MAP) | {"JOB_STATE_UNSPECIFIED"})
        """Job states the SDK dropped (newer than it), as Vertex sent them; see :mod:`.states`."""
        self.bucket_name, self.prefix = parse_gcs(self.config["staging_bucket"], "staging_bucket")

    # -- configuration ----------------------------------------------------------------------

    @classmethod
    def clean_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Every problem at once (:class:`SettingsProblems`): one InvalidSpec whose ``errors`` name
        each setting that is missing or malformed."""
        problems = cls.settings_problems(config)
        out = SETTINGS.defaults
        # None or blank = the default (the dashboard's form sends "" for an untouched field).
        out.update({k: v for k, v in config.items()
                    if k in SETTINGS.keys and v is not None and not (isinstance(v, str) and not v.strip())})

        def text(key: str) -> str:
            value = out.get(key, "")
            if not isinstance(value, str):
                raise InvalidSpec(f"{key}: expected text, got {value!r}.")
            return value.strip()

        project = region = bucket = image = account = machine = accel = ""
        with problems.about("project"):
            project = text("project")
            if not PROJECT_RE.fullmatch(project):
                raise InvalidSpec(f"project: expected a Google Cloud project id (6–30 lowercase letters, digits "
                                  f"and '-', starting with a letter), got {out.get('project')!r}.")
        with problems.about("region"):
            region = text("region")
            if not REGION_RE.fullmatch(region):
                raise InvalidSpec(f"region: expected a Vertex AI region such as 'us-central1', got {region!r}.")
        with problems.about("staging_bucket"):
            bucket = text("staging_bucket")
            parse_gcs(bucket, "staging_bucket")
        with problems.about("image_uri"):
            image = text("image_uri")
            # The default image is the region's: without a valid region there is none to check.
            if image or not problems.has("region"):
                image = image or default_image_uri(region)
                if not IMAGE_RE.fullmatch(image):
                    raise InvalidSpec(f"image_uri: expected '<registry>/<repository>[:tag|@digest]', got {image!r}.")
        with problems.about("service_account"):
            account = text("service_account")
            if account and not SA_RE.fullmatch(account):
                raise InvalidSpec(f"service_account: expected a service account email "
                                  f"('name@project.iam.gserviceaccount.com'), got {account!r}.")
        with problems.about("machine_type"):
            machine = text("machine_type")
            if not MACHINE_RE.fullmatch(machine):
                raise InvalidSpec(f"machine_type: expected a Compute Engine machine type such as 'n1-standard-8', "
                                  f"got {machine!r}.")
        with problems.about("accelerator_type"):
            accel = text("accelerator_type").upper()
            if accel:
                from google.cloud.aiplatform_v1.types.accelerator_type import AcceleratorType

                names = [n for n in AcceleratorType.__members__ if n != "ACCELERATOR_TYPE_UNSPECIFIED"]
                if accel not in names:
                    raise InvalidSpec(f"accelerator_type: {accel!r} is not a Vertex AI accelerator; known: "
                                      f"{', '.join(names)} (or empty for none).")
        count = out["accelerator_count"]
        with problems.about("accelerator_count"):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise InvalidSpec(f"accelerator_count: expected a whole number ≥ 0, got {count!r}.")
            if accel and count < 1 and not problems.has("accelerator_type"):
                raise InvalidSpec(f"accelerator_count: {accel} is set, so at least 1 accelerator per replica; "
                                  f"got {count}.")
            if count and not accel and not problems.has("accelerator_type"):
                raise InvalidSpec(f"accelerator_count: {count} given without an accelerator; set "
                                  f"{problems.label('accelerator_type')} (e.g. NVIDIA_TESLA_T4) or 0.")
        with problems.about("spot_allowed"):
            if not isinstance(out["spot_allowed"], bool):
                raise InvalidSpec(f"spot_allowed: expected true or false, got {out['spot_allowed']!r}.")
        nodes = out["max_nodes"]
        with problems.about("max_nodes"):
            if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= 1000:
                raise InvalidSpec(f"max_nodes: expected a whole number from 1 to 1000, got {nodes!r}.")
        for key in ("api_endpoint", "storage_endpoint"):
            with problems.about(key):
                value = text(key).rstrip("/")
                if value and not ENDPOINT_RE.fullmatch(value):
                    raise InvalidSpec(f"{key}: expected a host name or 'http(s)://host[:port]', got {value!r}.")
                out[key] = value
        problems.raise_if_any()
        out.update(project=project, region=region, staging_bucket=bucket.rstrip("/"), image_uri=image,
                   service_account=account, machine_type=machine, accelerator_type=accel)
        return out

    @property
    def region(self) -> str:
        return self.config["region"]

    @property
    def parent(self) -> str:
        """``projects/<project>/locations/<region>``, where the custom jobs live."""
        return f"projects/{self.config['project']}/locations/{self.region}"

    @property
    def capabilities(self) -> Capabilities:
        count = self.config["accelerator_count"]
        return Capabilities(
            spot=self.config["spot_allowed"],
            max_nodes=self.config["max_nodes"],
            max_procs_per_node=count if count > 0 else (_vcpus(self.config["machine_type"]) or 8),
            strategies=self.runnable_strategies(),
        )

    # -- prices -----------------------------------------------------------------------------

    def _row(self, name: str, what: str, suffix: str = ""):
        row = self.prices.lookup(PROVIDER, self.region, name + suffix)
        if row is None and suffix and self.prices.lookup(PROVIDER, self.region, name) is not None:
            raise InvalidSpec(
                f"{what} {name!r} has no Spot price in the catalog for {self.region}; add a row "
                f"'{name}{suffix}' (manage.py refresh_prices --provider gcp reads Cloud Billing's Spot SKUs) "
                f"or untick spot.")
        if row is None:
            known = [r.instance_type for r in self.prices.rows(PROVIDER, self.region)
                     if not r.instance_type.endswith(SPOT_SUFFIX)]
            raise InvalidSpec(
                f"{what} {name!r} has no price in the catalog for {self.region}; known: "
                f"{', '.join(known) or 'none (add rows to the price catalog)'}.")
        return row

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        """USD per replica-hour: machine price + accelerator price × ``accelerator_count`` (catalog rows
        of provider ``gcp`` in the region, accelerators priced per accelerator-hour as Vertex lists them,
        clouds.md §4.5).

        ``instance_type`` is the machine type ("" = ``machine_type``); the accelerator is the backend's.
        With ``spot`` the rows ``<machine>:spot`` and ``<accelerator>:spot`` (Spot VMs are priced per
        component too; Cloud Billing's Spot/Preemptible SKUs, ``refresh_prices``). Vertex reports no
        billable seconds, so cost is the run interval × replicas × this price, and a spot job's
        saving is 1 − this / :meth:`on_demand_price`.
        Raises :class:`InvalidSpec` when the machine or the accelerator has no (spot) row.
        """
        suffix = SPOT_SUFFIX if spot else ""
        machine = self._row(instance_type or self.config["machine_type"], "machine type", suffix)
        total = machine.usd_per_hour
        if self.config["accelerator_type"]:
            accel = self._row(self.config["accelerator_type"], "accelerator", suffix)
            total += accel.usd_per_hour * self.config["accelerator_count"]
        return float(total)

    def gpus(self, instance_type: str = "") -> GpuFacts | None:
        """The backend's accelerator × ``accelerator_count`` (Vertex attaches them to any machine
        type, ``instance_type`` included), from the catalog's per-accelerator row; count 0 without an
        accelerator; None for an accelerator the catalog does not know."""
        accel = self.config["accelerator_type"]
        if not accel:
            return GpuFacts(model="", count=0, memory_gib=None,
                            source=f"{instance_type or self.config['machine_type']}: no accelerator_type set")
        row = catalog_gpus(self.prices, PROVIDER, accel)
        if row is None:
            return None
        return dataclasses.replace(row, count=self.config["accelerator_count"])

    def instance_offers(self) -> list[InstanceOffer]:
        """The region's machine-type rows (accelerator rows are the upper-case ``AcceleratorType``
        names) priced as :meth:`price` with the backend's accelerator; none when that accelerator has
        no price."""
        accel_name = self.config["accelerator_type"]
        accel = self.prices.lookup(PROVIDER, self.region, accel_name) if accel_name else None
        if accel_name and accel is None:
            return []
        offers = []
        for r in self.prices.rows(PROVIDER, self.region):
            if r.instance_type.upper() == r.instance_type or r.instance_type.endswith(SPOT_SUFFIX):
                continue  # an accelerator row, or a spot price
            sources = [f"{r.source} ({r.as_of})" if r.as_of else r.source]
            if accel is not None:
                sources.append(f"{accel_name} × {self.config['accelerator_count']}: {accel.source}"
                               + (f" ({accel.as_of})" if accel.as_of else ""))
            offers.append(InstanceOffer(instance_type=r.instance_type, usd_per_hour=self.price(r.instance_type),
                                        confirmed=r.confirmed and (accel is None or accel.confirmed),
                                        source="; ".join(sources)))
        return offers

    # -- validate / build -------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Base checks (nodes, processes, spot allowed, runtime ≥ 1 s) plus Vertex's own.

        * machine type: a Compute Engine type with a catalog price (and the accelerator's);
        * processes per node ≤ accelerators per replica (one rank per GPU), or ≤ the machine's vCPUs;
        * dataset and output: "" or ``gs://`` (the trainer reads gs:// through /gcs, clouds.md §2.3);
          checkpoints: "" or ``gs://…/checkpoints/`` (:func:`checkpoint_base`), with an output, if any,
          the directory above it;
        * labels (at most 64) and environment (at most 100, clouds.md §2.1) within the API's limits;
        * the job's image an image URI; its code archive readable, unchanged, without members named like
          ours, and its requirements requirements, not pip options (reads the local archive only).
        """
        job_label(spec.job_name)
        machine = spec.instance_type or self.config["machine_type"]
        if not MACHINE_RE.fullmatch(machine):
            raise InvalidSpec(f"instance type {machine!r}: expected a Compute Engine machine type such as "
                              f"{self.config['machine_type']}.", field="instance_type")
        self.price(machine)
        count = self.config["accelerator_count"]
        if count and spec.procs_per_node > count:
            raise InvalidSpec(
                f"{spec.nodes} × {machine} with {count} {self.config['accelerator_type']} each and "
                f"{spec.procs_per_node} processes per node: each rank needs its own accelerator; ask for at "
                f"most {count} processes per node (world size {spec.nodes} × {count} = {spec.nodes * count}).", field="procs_per_node")
        vcpus = _vcpus(machine)
        if not count and vcpus and spec.procs_per_node > vcpus:
            raise InvalidSpec(f"{machine} has {vcpus} vCPUs; ask for at most {vcpus} processes per node "
                              f"(got {spec.procs_per_node}).", field="procs_per_node")
        super().validate(spec)  # nodes, spot, runtime (the per-node limits above say more)
        for field, uri in (("dataset", spec.dataset_uri), ("output", spec.output_uri)):
            if uri:
                parse_gcs(uri, field)
        if spec.checkpoint_uri:
            base = checkpoint_base(spec.checkpoint_uri)
            if spec.output_uri and spec.output_uri.rstrip("/") + "/" != base:
                raise InvalidSpec(f"output {spec.output_uri!r} and checkpoints {spec.checkpoint_uri!r}: Vertex AI "
                                  f"puts checkpoints in <output>/checkpoints/ (AIP_CHECKPOINT_DIR); give the "
                                  f"output {base!r}, or no output.")
        if not isinstance(spec.config, Mapping):
            raise InvalidSpec("config: expected a JSON object (the trainer_pkg JobConfig as a dict).")
        try:
            json.dumps(spec.config)
        except (TypeError, ValueError) as exc:
            raise InvalidSpec(f"config: not JSON-serialisable ({exc}).") from None
        if spec.image and not IMAGE_RE.fullmatch(spec.image):
            raise InvalidSpec(f"image {spec.image!r}: expected an Artifact Registry image URI "
                              f"'<registry>/<repository>[:tag|@digest]', e.g. "
                              f"us-docker.pkg.dev/{self.config['project']}/training/my-image:1.", field="image")
        if spec.code is not None:  # the archive's own problems, before the job is queued
            packaging.refuse_ours(packaging.code_files(spec.code), ())
            package.pip_dependencies(spec.code.requirements)
        self._labels(spec)
        self._env(spec)

    def _labels(self, spec: JobSpec) -> dict[str, str]:
        labels = {TAG_JOB_NAME: job_label(spec.job_name)}
        for key, value in spec.tags.items():
            labels.setdefault(label_key(str(key)), label_value(str(value)))
        if len(labels) > MAX_LABELS:
            raise InvalidSpec(f"tags: {len(labels)} labels, Vertex AI takes at most {MAX_LABELS}.")
        return labels

    def _env(self, spec: JobSpec) -> dict[str, str]:
        """The replicas' environment: ours, then ``spec.env``, then ``spec.secret_env`` (a message about
        a variable names it, never its value)."""
        env = {"PYTHONUNBUFFERED": "1", "TRAINBOARD_JOB_NAME": spec.job_name}
        env.update({str(k): str(v) for k, v in spec.env.items()})
        env.update({str(k): str(v) for k, v in spec.secret_env.items()})
        if len(env) > MAX_ENV:
            raise InvalidSpec(f"env: {len(env)} variables (with the job's secrets), Vertex AI takes at most {MAX_ENV}.")
        for key in env:
            if not ENV_KEY_RE.fullmatch(key):
                raise InvalidSpec(f"env {key!r}: names are letters, digits and '_', not starting with a digit.")
        return env

    def _gs(self, *parts: str) -> str:
        return f"gs://{self.bucket_name}/{package.object_name(self.prefix, *parts)}"

    def output_uri(self, spec: JobSpec) -> str:
        """``base_output_directory`` of the job: for a job given ``spec.checkpoint_uri`` (a resubmitted
        attempt, docs/recovery.md) the directory above it (:func:`checkpoint_base`), so that Vertex
        sets its ``AIP_CHECKPOINT_DIR`` to that checkpoint directory and the trainer resumes there;
        else ``spec.output_uri`` or ``gs://<staging>/output/<label>/``."""
        if spec.checkpoint_uri:
            return checkpoint_base(spec.checkpoint_uri)
        base = spec.output_uri or self._gs("output", job_label(spec.job_name))
        return base.rstrip("/") + "/"

    def config_object(self, spec: JobSpec) -> str:
        """Object name of the job's config JSON in the staging bucket."""
        return package.object_name(self.prefix, "jobs", job_label(spec.job_name), CONFIG_FILE)

    def config_path(self, spec: JobSpec) -> str:
        """Where a replica reads the job's config: its Cloud Storage FUSE path ``/gcs/<bucket>/<object>``."""
        return f"/gcs/{self.bucket_name}/{self.config_object(spec)}"

    def custom_job(self, spec: JobSpec, package_uri: str, code_uri: str = "") -> Any:
        """The ``aiplatform_v1.CustomJob`` for ``spec`` with the trainer archive at ``package_uri`` and
        the user's code package at ``code_uri`` ("" = none) (field meanings: clouds.md §2.1). Makes no
        call."""
        from google.cloud import aiplatform_v1 as v1
        from google.protobuf import duration_pb2

        machine_spec = v1.MachineSpec(machine_type=spec.instance_type or self.config["machine_type"])
        if self.config["accelerator_type"]:
            machine_spec.accelerator_type = v1.AcceleratorType[self.config["accelerator_type"]]
            machine_spec.accelerator_count = self.config["accelerator_count"]
        python = v1.PythonPackageSpec(
            executor_image_uri=spec.image or self.config["image_uri"],
            package_uris=[package_uri, code_uri] if code_uri else [package_uri],
            python_module=PYTHON_MODULE,
            args=["--config", self.config_path(spec), "--platform", "vertex",
                  "--nproc-per-node", str(spec.procs_per_node)],
            env=[v1.EnvVar(name=k, value=v) for k, v in self._env(spec).items()],
        )
        pools = [v1.WorkerPoolSpec(machine_spec=machine_spec, replica_count=1, python_package_spec=python)]
        if spec.nodes > 1:
            pools.append(v1.WorkerPoolSpec(machine_spec=machine_spec, replica_count=spec.nodes - 1,
                                           python_package_spec=python))
        scheduling = v1.Scheduling(timeout=duration_pb2.Duration(seconds=int(spec.max_runtime_s)),
                                   restart_job_on_worker_restart=spec.nodes > 1)
        if spec.spot:
            scheduling.strategy = v1.Scheduling.Strategy.SPOT
        job_spec = v1.CustomJobSpec(
            worker_pool_specs=pools, scheduling=scheduling,
            base_output_directory=v1.GcsDestination(output_uri_prefix=self.output_uri(spec)))
        if self.config["service_account"]:
            job_spec.service_account = self.config["service_account"]
        return v1.CustomJob(display_name=spec.job_name[:DISPLAY_NAME_MAX], job_spec=job_spec,
                            labels=self._labels(spec))

    # -- submit -----------------------------------------------------------------------------

    def trainer_uri(self, spec: JobSpec) -> str:
        """The archive's ``gs://`` URI, uploading it first when the bucket lacks it.

        ``spec.trainer_package_uri``: "" packages this checkout's trainer_pkg; a ``gs://`` URI (a
        pip-installable archive) is used as is; a local directory holding ``trainer_pkg/`` is packaged
        from there."""
        from pathlib import Path

        source = spec.trainer_package_uri
        if source.startswith("gs://"):
            return source
        if source and not Path(source, "trainer_pkg", "__init__.py").is_file():
            raise InvalidSpec(f"trainer package {source!r}: expected a gs:// URI or a directory that "
                              f"contains trainer_pkg/ (leave it empty to ship this installation's).")
        archive = package.build_sdist(source or None)
        uri, _ = package.upload_once(self.bucket(), archive, prefix=self.prefix,
                                     call=lambda fn: self.call(fn, "Cloud Storage"))
        return uri

    def code_uri(self, spec: JobSpec) -> str:
        """The ``gs://`` URI of the user's code package (:func:`~.package.build_code_sdist`), uploaded
        first when the bucket lacks it; "" for a job without code."""
        if spec.code is None:
            return ""
        uri, _ = package.upload_once(self.bucket(), package.build_code_sdist(spec.code), prefix=self.prefix,
                                     call=lambda fn: self.call(fn, "Cloud Storage"))
        return uri

    def job_config(self, spec: JobSpec) -> dict[str, Any]:
        """The config a replica reads: ``spec.config`` with ``code.dir`` = the code package's directory
        (relative to site-packages, where trainer_pkg is) and ``code.sha256`` when the job has code."""
        return packaging.config_with_code(spec.config, spec.code,
                                          package.code_dir(spec.code) if spec.code else "")

    def _upload_config(self, spec: JobSpec) -> None:
        blob = self.bucket().blob(self.config_object(spec))
        data = json.dumps(self.job_config(spec), sort_keys=True, indent=1)
        self.call(lambda: blob.upload_from_string(data, content_type="application/json", retry=None,
                                                  timeout=CALL_TIMEOUT_S), "Cloud Storage")

    # CloudBackend.submit: ListCustomJobs by label (adopt when one exists); else the archive's
    # existence check (+ upload once per trainer version), the config upload, CreateCustomJob, and
    # ListCustomJobs by label again (a concurrent duplicate is cancelled, after_create).

    create_attempts = CREATE_ATTEMPTS

    def provider_name(self, job_name: str) -> str:
        """The job's ``trainboard-job-name`` label: Vertex assigns the job's name itself."""
        return job_label(job_name)

    def find_job(self, label: str) -> Any | None:
        """The oldest CustomJob labelled ``trainboard-job-name=<label>``, or None."""
        jobs = self.list_jobs(f'labels.{TAG_JOB_NAME}="{label}"')
        if not jobs:
            return None
        return min(jobs, key=lambda j: (j.create_time.timestamp() if j.create_time else 0.0, j.name))

    @contextlib.contextmanager
    def create_request(self, spec: JobSpec, name: str) -> Iterator[Any]:
        job = self.custom_job(spec, self.trainer_uri(spec), self.code_uri(spec))
        self._upload_config(spec)
        yield job

    def create_job(self, spec: JobSpec, name: str, request: Any) -> Any:
        client = self.job_client()
        return self.call(lambda: client.create_custom_job(parent=self.parent, custom_job=request, retry=None,
                                                          timeout=CALL_TIMEOUT_S), classify=_classify_create)

    def after_create(self, label: str, created: Any) -> Any:
        oldest = self.find_job(label)
        if oldest is not None and oldest.name != created.name:
            # Names are Vertex's, so two concurrent submits both create: keep the older, stop ours.
            self.stop(created.name)
            return oldest
        return created

    def job_handle(self, job_name: str, job: Any) -> JobHandle:
        created = job.create_time
        return JobHandle(provider=self.kind, job_name=job_name, provider_job_id=str(job.name),
                         extra={"label": job_label(job_name), "region": self.region,
                                "instance_count": replica_count(job),
                                "create_time": created.isoformat() if isinstance(created, dt.datetime)
                                and created.timestamp() > 0 else ""})

    # -- list / describe --------------------------------------------------------------------

    def list_jobs(self, filter_: str, page_size: int | None = None, max_pages: int | None = None) -> list[Any]:
        """Every CustomJob matching ``filter_`` (one ListCustomJobs per page, each retried)."""
        from google.cloud import aiplatform_v1 as v1

        client = self.job_client()

        def page(token: str | None) -> tuple[list[Any], str]:
            request = v1.ListCustomJobsRequest(parent=self.parent, filter=filter_, page_size=page_size or LIST_PAGE,
                                               page_token=token or "")
            answer = next(iter(client.list_custom_jobs(request=request, retry=None, timeout=CALL_TIMEOUT_S).pages))
            return list(answer.custom_jobs), answer.next_page_token

        return list(self.pages(page, max_pages=max_pages))

    def job_ref(self, handle: JobHandle) -> str:
        return handle.provider_job_id

    def no_job(self, ref: str) -> str:
        return f"Vertex AI has no custom job {ref!r}"

    def job_status(self, job: Any) -> JobStatus:
        """The mapping of :mod:`cloud_adapters.vertex.states`, with the state Vertex sent when the SDK
        does not know it."""
        return job_status(job, self._raw_states.get(job.name))

    def raw_state(self, job: Any) -> str:
        return state_name(job, self._raw_states.get(job.name))

    def get_job(self, ref: str) -> Any | None:
        """GetCustomJob of resource name ``ref``, or None when Vertex has none (404) or ``ref`` is ""."""
        from google.api_core import exceptions as gexc

        if not ref:
            return None
        client = self.job_client()
        try:
            return self.call(lambda: client.get_custom_job(name=ref, retry=None, timeout=CALL_TIMEOUT_S))
        except BackendError as exc:
            if isinstance(exc.__cause__, gexc.NotFound):
                return None
            raise

    def jobs_of(self, handles: Sequence[JobHandle], since: dt.datetime | None) -> Iterator[tuple[JobHandle, Any]]:
        """ONE filtered ListCustomJobs (paginated, 100 a page), whatever the batch size.

        Filter: ``labels.trainboard-job-name:*`` (Trainboard's jobs) ``AND create_time>=`` the oldest
        handle's create time − :data:`~cloud_adapters.cloud.LIST_SKEW_S` (ListCustomJobs filters on
        display_name, state, create_time and labels, not update_time: [GAPIC
        ListCustomJobsRequest.filter]); :meth:`modified_at` leaves out the jobs unchanged since."""
        if not handles:
            return
        terms = [f"labels.{TAG_JOB_NAME}:*"]
        created = [h.extra.get("create_time") for h in handles]
        if all(created):
            oldest = min(dt.datetime.fromisoformat(str(c)) for c in created)
            terms.append(f'create_time>="{_rfc3339(oldest - dt.timedelta(seconds=LIST_SKEW_S))}"')
        jobs = {j.name: j for j in self.list_jobs(" AND ".join(terms))}
        for handle in handles:
            job = jobs.get(handle.provider_job_id)
            if job is not None:
                yield handle, job

    def modified_at(self, job: Any) -> dt.datetime | None:
        return proto_time(job.update_time)

    # -- orphans ----------------------------------------------------------------------------

    def unfinished_jobs(self) -> list[Any]:
        """Custom jobs labelled ``trainboard-job-name`` whose state is not final: QUEUED, PENDING,
        RUNNING, UPDATING, PAUSED or CANCELLING.

        ListCustomJobs filters combine terms with AND only, so there is one filtered list per
        non-final state (``labels.trainboard-job-name:* AND state="…"``, 100 per page): 6 +
        ⌈jobs in each state / 100⌉ − 1 calls, bounded by the project's unfinished jobs, never by
        its history.
        """
        return [job for state in sorted(self.states.unfinished)
                for job in self.list_jobs(f'labels.{TAG_JOB_NAME}:* AND state="{state}"')]

    def job_tags(self, job: Any) -> dict[str, str]:
        """The job's labels: Trainboard's tag keys are valid label keys, so a label is keyed as its
        tag, and the job name's label is the name unchanged (Trainboard names are valid values)."""
        return dict(job.labels or {})

    def created_at(self, job: Any) -> dt.datetime | None:
        return proto_time(job.create_time)

    # -- cancel -----------------------------------------------------------------------------
    # CloudBackend.cancel: CancelCustomJob (Vertex reports CANCELLING, then CANCELLED, clouds.md
    # §2.2); a cancel Vertex refuses because the job already ended or is cancelling is not an error.

    def stop_job(self, ref: str) -> None:
        client = self.job_client()
        self.call(lambda: client.cancel_custom_job(name=ref, retry=None, timeout=CALL_TIMEOUT_S))

    def stop_refused(self, exc: BackendError) -> bool:
        from google.api_core import exceptions as gexc

        return isinstance(exc.__cause__, (gexc.BadRequest, gexc.NotFound, gexc.Conflict))

    # -- logs -------------------------------------------------------------------------------

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        """New lines of the job's Cloud Logging entries since ``cursor``.

        See :mod:`cloud_adapters.vertex.logs` for the cursor and line format: in a multi-replica job
        lines are prefixed ``[workerpool1-0] ``; metric lines stay exactly as the trainer printed them.
        """
        job_id = handle.provider_job_id.rsplit("/", 1)[-1]
        created = str(handle.extra.get("create_time") or "")
        since = _rfc3339(dt.datetime.fromisoformat(created)) if created else ""
        return cloud_logs.tail(
            self.http_session(), base_url=self.logging_endpoint, project=self.config["project"],
            job_id=job_id, cursor=cursor, since=since,
            prefix_tasks=int(handle.extra.get("instance_count") or 1) > 1,
            call=lambda fn: self.call(fn, "Cloud Logging"))

    # -- artifacts --------------------------------------------------------------------------
    # Vertex sets AIP_MODEL_DIR = <base>/model/, AIP_CHECKPOINT_DIR = <base>/checkpoints/ and
    # AIP_TENSORBOARD_LOG_DIR = <base>/logs/ from the job's base_output_directory (clouds.md §2.3); the
    # trainer writes its model and metrics, and its checkpoints, there through the FUSE mount.

    def _base_output(self, handle: JobHandle, what: str) -> str:
        """The job's ``base_output_directory`` as Vertex holds it (GetCustomJob), ending in "/"; the
        default of :meth:`output_uri` for a job that has none. Raises :class:`ProviderError` naming
        ``what`` when Vertex no longer has the job."""
        ref = self.job_ref(handle)
        job = self.get_job(ref)
        if job is None:
            raise ProviderError(f"{self.no_job(ref)}: {what} cannot be found")
        base = job.job_spec.base_output_directory.output_uri_prefix or self._gs("output", job_label(handle.job_name))
        return base.rstrip("/") + "/"

    def _artifact_roots(self, handle: JobHandle) -> list[artifact_store.Root]:
        bucket, prefix = artifact_store.split_uri(self._base_output(handle, "its outputs"), "gs")
        return [artifact_store.Root(bucket, f"{prefix}model/"),
                artifact_store.Root(bucket, f"{prefix}{CHECKPOINT_SUBDIR}/", "checkpoints/"),
                artifact_store.Root(bucket, f"{prefix}logs/", "logs/")]

    def checkpoint_uri(self, handle: JobHandle) -> str:
        """Where the job's trainer wrote its checkpoints: the ``AIP_CHECKPOINT_DIR`` Vertex gave it,
        ``<base_output_directory>/checkpoints/`` (clouds.md §2.3), as a ``gs://`` URI, e.g.
        ``gs://stage/tb/output/tb-job-7-65f0a1b2/checkpoints/``. The trainer writes there through
        the ``/gcs`` mount (trainer_pkg/platforms.py ``read_vertex``), and a later attempt given this
        URI as :attr:`JobSpec.checkpoint_uri` gets the same base output directory (:meth:`output_uri`),
        so Vertex points its ``AIP_CHECKPOINT_DIR`` at the same place and the trainer resumes from
        it (docs/recovery.md). One GetCustomJob: the base is the job's as Vertex holds it. Raises
        :class:`ProviderError` when Vertex no longer has the job."""
        return f"{self._base_output(handle, 'where its checkpoints are')}{CHECKPOINT_SUBDIR}/"

    def _artifact_files(self, handle: JobHandle) -> dict[str, artifact_store.StoredFile]:
        def list_files() -> dict[str, artifact_store.StoredFile]:
            client = self.storage_client()
            found: list[artifact_store.StoredFile] = []
            for root in self._artifact_roots(handle):
                found += self.call(lambda root=root: artifact_store.gcs_files(client, root), "Cloud Storage")
            return artifact_store.collect(found)
        return artifact_store.cached_listing(self, handle.job_name, list_files)

    def artifacts(self, handle: JobHandle) -> list[Artifact]:
        """The job's output directory on Cloud Storage: ``model/``'s files by their name under it
        (``model.pt``, ``metrics.jsonl``), ``checkpoints/...`` and ``logs/...``. Calls: GetCustomJob,
        then objects.list per directory."""
        return artifact_store.as_artifacts(self._artifact_files(handle))

    def open_artifact(self, handle: JobHandle, name: str) -> BinaryIO:
        """A reader of the object (ranged reads)."""
        f = artifact_store.pick(self._artifact_files(handle), name, handle.job_name)
        return self.call(lambda: artifact_store.gcs_open(self.storage_client(), f), "Cloud Storage")

    def artifact_url(self, handle: JobHandle, name: str, *, expires_s: int = 300) -> str | None:
        """A V4 signed URL, signed by the backend's service-account key (or an ambient identity that
        can sign); None with credentials that cannot sign (then the dashboard streams the file)."""
        f = artifact_store.pick(self._artifact_files(handle), name, handle.job_name)
        endpoint = self.config["storage_endpoint"]
        creds, _ = _gcp.credentials(endpoint, self.secrets.get("service_account_json", ""))
        return artifact_store.gcs_url(self.storage_client(), f, expires_s, credentials=creds, endpoint=endpoint)

    def artifact_uri(self, handle: JobHandle, name: str) -> str:
        """``gs://bucket/object``."""
        f = artifact_store.pick(self._artifact_files(handle), name, handle.job_name)
        return f"gs://{f.container}/{f.key}"

    # -- test connection --------------------------------------------------------------------

    def connection_probes(self) -> list[Probe]:
        """``credentials`` (Application Default Credentials found; without them nothing else is
        checked), ``bucket`` (the staging bucket's metadata), ``Vertex AI access`` (ListCustomJobs
        page_size=1 in the region)."""
        from google.api_core import exceptions as gexc

        bucket = self.config["staging_bucket"]

        def identity() -> str:
            key = self.secrets.get("service_account_json", "")
            if _gcp.is_local(self.config["api_endpoint"]) and not key:
                return f"anonymous (the API endpoint {self.config['api_endpoint']} is a local stand-in)"
            creds, project = _gcp.credentials(self.config["api_endpoint"], key)
            who = getattr(creds, "service_account_email", None) or "user credentials (gcloud ADC)"
            source = "the backend's stored service-account key" if key else "Application Default Credentials found"
            return f"{source}: {who}" + (f", project {project}" if project else "")

        def get_bucket() -> str:
            self.storage_client().get_bucket(self.bucket_name, retry=None, timeout=30)
            return f"bucket gs://{self.bucket_name} exists and is accessible"

        def bucket_hint(exc: BaseException) -> str:
            cause = exc.__cause__ or exc
            if isinstance(cause, gexc.NotFound):
                return (f"bucket gs://{self.bucket_name} does not exist; create it (in {self.region}) or "
                        f"correct staging_bucket ({bucket}).")
            if isinstance(cause, (gexc.Forbidden, gexc.Unauthorized)):
                return (f"access to bucket gs://{self.bucket_name} was denied; grant the worker's identity "
                        f"Storage Object Admin on it (and the job's service account read/write).")
            return str(exc)

        def list_jobs() -> str:
            self.list_jobs("", page_size=1, max_pages=1)
            return f"Vertex AI API reachable in {self.region} (ListCustomJobs allowed in {self.config['project']})"

        def vertex_hint(exc: BaseException) -> str:
            cause = exc.__cause__ or exc
            if isinstance(cause, (gexc.Forbidden, gexc.Unauthorized)):
                return (f"{exc} Grant the worker's identity the Vertex AI User role "
                        f"(aiplatform.customJobs.list/create/get/cancel) in {self.config['project']}, and "
                        f"enable aiplatform.googleapis.com there.")
            return str(exc)

        return [Probe("credentials", identity, service="Google auth", required=True,
                      skipped="not checked: no credentials"),
                Probe("bucket", get_bucket, bucket_hint, service="Cloud Storage"),
                Probe("Vertex AI access", list_jobs, vertex_hint)]

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def logging_endpoint(self) -> str:
        """Cloud Logging's base URL: the ``http://`` stand-in of ``api_endpoint`` in tests, else Google's."""
        endpoint = self.config["api_endpoint"]
        return endpoint if _gcp.is_local(endpoint) else cloud_logs.LOGGING_ENDPOINT

    def _cached(self, key: str, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key not in self._clients:
                self._clients[key] = make()
            return self._clients[key]

    def job_client(self) -> Any:
        """The ``aiplatform_v1.JobServiceClient`` (REST transport) of the region, created once."""
        def make() -> Any:
            from google.api_core.client_options import ClientOptions
            from google.cloud import aiplatform_v1 as v1

            endpoint = self.config["api_endpoint"] or f"{self.region}-aiplatform.googleapis.com"
            creds, _ = _gcp.credentials(endpoint, self.secrets.get("service_account_json", ""))
            client = v1.JobServiceClient(credentials=creds, transport="rest",
                                         client_options=ClientOptions(api_endpoint=endpoint))
            # The client drops job states it does not know; the hook keeps Vertex's own string.
            client._transport._session.hooks["response"].append(self._raw_states.on_response)  # noqa: SLF001
            return client
        return self._cached("jobs", make)

    def storage_client(self) -> Any:
        """The ``google.cloud.storage.Client`` (``storage_endpoint`` when set), created once."""
        def make() -> Any:
            from google.cloud import storage

            endpoint = self.config["storage_endpoint"]
            creds, _ = _gcp.credentials(endpoint, self.secrets.get("service_account_json", ""))
            options = {"api_endpoint": endpoint} if endpoint else None
            return storage.Client(project=self.config["project"], credentials=creds, client_options=options)
        return self._cached("storage", make)

    def bucket(self) -> Any:
        """The staging bucket handle (no call)."""
        return self.storage_client().bucket(self.bucket_name)

    def http_session(self) -> Any:
        """The HTTP session for Cloud Logging: the injected one, else google-auth's AuthorizedSession."""
        if self._http_session is not None:
            return self._http_session

        def make() -> Any:
            from google.auth.transport.requests import AuthorizedSession

            creds, _ = _gcp.credentials(self.config["api_endpoint"], self.secrets.get("service_account_json", ""))
            return AuthorizedSession(creds)
        return self._cached("http", make)

    def classify(self, exc: BaseException, *, service: str) -> retry.Verdict | None:
        return _gcp.classify(exc, service=service)

    def rate_limit(self) -> tuple[str, float]:
        """The project in the region, at :data:`CALLS_PER_SECOND`."""
        return f"gcp:{self.config['project']}:{self.region}", CALLS_PER_SECOND


def _classify_create(exc: BaseException, *, service: str) -> retry.Verdict | None:
    """:func:`cloud_adapters._gcp.classify` for CreateCustomJob: a throttled create (429: refused, nothing
    created) is retried at once; any other transient failure may have created the job, so it is raised
    (still transient) for :meth:`VertexBackend.submit` to look for the job before trying again."""
    verdict = _gcp.classify(exc, service=service)
    if verdict is not None and verdict.retry and not isinstance(verdict.error, Throttled):
        return retry.Verdict(False, verdict.error)
    return verdict
