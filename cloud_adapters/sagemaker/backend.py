"""The SageMaker backend: a Trainboard job is one SageMaker training job, created with plain boto3.

What a job is made of (clouds.md §1.1 for every request field):

* the trainer archive (:mod:`cloud_adapters.packaging`), uploaded once per content hash to
  ``s3://<bucket>/<prefix>/code/trainboard-trainer-<sha256[:16]>.tar.gz``; with user code
  (``JobSpec.code``) the archive also holds the user's files at its root, beside ``trainer_pkg/``, and
  is named by the hash of the whole: the toolkit unpacks it into ``/opt/ml/code``, installs a root
  ``requirements.txt`` with ``pip install -r requirements.txt`` there before the entry script
  (sagemaker-training ``entry_point.install``), and the job's ``code.dir`` hyperparameter is ``"."``
  (:data:`~cloud_adapters.packaging.CODE_DIR_HERE`: the directory holding ``trainer_pkg/``, which is
  also the entry script's working directory);
* the image: ``JobSpec.image`` when set, else the backend's ``image_uri``;
* ``JobSpec.env`` and ``JobSpec.secret_env`` in the request's ``Environment`` (how SageMaker passes
  variables to the container; DescribeTrainingJob shows them to whoever may describe the job), never in
  the tags or hyperparameters;
* CreateTrainingJob with AWS's PyTorch training image in script mode: ``sagemaker_program`` =
  ``trainboard_entry.py`` in ``sagemaker_submit_directory`` = the archive. The toolkit runs the entry
  once per instance; it starts ``python -m trainer_pkg.launch``, which reads SM_HOSTS/SM_CURRENT_HOST
  and starts torchrun across the instances (trainer_pkg/platforms.py ``read_sagemaker``);
* an MPI script (``code.framework`` ``mpi``) asks for the ``mpi`` distribution instead
  (``sagemaker_mpi_enabled``, ``sagemaker_mpi_num_of_processes_per_host`` = processes per node): the
  toolkit's mpirun on the first host starts every rank on every host (sshd in the image), each running
  the entry script, and the launcher runs the script as that rank (trainer_pkg/frameworks/mpi.py);
* the job config as hyperparameters, one per field, ``"<section>.<field>": json.dumps(value)`` — the
  JSON encoding the SageMaker SDK uses and the keys ``trainer_pkg.config.apply_overrides`` reads
  (but ``output.output_dir``/``output.checkpoint_dir``: SageMaker decides /opt/ml/model and /opt/ml/checkpoints);
* the dataset's ``s3://`` URI as input channel ``train`` (FastFile), output under
  ``s3://<bucket>/<prefix>/output/``, checkpoints under ``s3://<bucket>/<prefix>/checkpoints/<name>/``.

Names: ``JobSpec.job_name`` becomes the TrainingJobName through :func:`training_job_name`
(1–63 characters, pattern ``[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}``, clouds.md §1.1 [B]): a valid name is
kept; any other is mapped deterministically, so a retried submit finds its job.

Idempotency: submit first describes the name; a job that exists is adopted. A CreateTrainingJob
answered ``ResourceInUse`` (a concurrent submit won) is adopted the same way. moto replaces a
duplicate silently instead of answering ResourceInUse (§1.7), which the describe-first order also
covers.

Sync cost: :meth:`SageMakerBackend.describe_many` with ``changed_since`` lists the jobs SageMaker
modified since then (ListTrainingJobs, 100 per page) and describes only those of the batch: calls per
sync = ⌈changed in the account / 100⌉ + changed in the batch, not the number of active jobs.

Every call goes through :mod:`cloud_adapters.retry` with the AWS classifier (:mod:`cloud_adapters._aws`)
under the account's token bucket (key ``aws:<account of role_arn>:<region>``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping, Sequence

from cloud_adapters import _aws, artifact_store, packaging, retry
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
    parse_utc,
)
from cloud_adapters.cloud import CloudBackend, Probe
from cloud_adapters.gpus import GpuFacts, catalog_gpus
from cloud_adapters.settings import BackendSettings, Secret, Setting
from cloud_adapters.sagemaker import logs as cw_logs
from cloud_adapters.sagemaker.states import STATES, job_status

PROVIDER = "aws"  # provider name in the price catalog
NAME_MAX = 63
NAME_RE = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")  # TrainingJobName, clouds.md §1.1 [B]
BUCKET_RE = re.compile(r"(?!\d+\.\d+\.\d+\.\d+$)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3 bucket naming rules
REGION_RE = re.compile(r"[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d")
IMAGE_RE = re.compile(r"[\w.\-]+(:\d+)?/[\w.\-/]+([:@][\w.\-:]+)?")  # <registry>/<repository>[:tag|@digest]
ENV_KEY_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")  # Environment keys, botocore model
TAG_RE = re.compile(r"[\w\s.:/=+\-@]*", re.UNICODE)  # Tag Key/Value pattern, botocore model

MAX_RUNTIME_S = 28 * 24 * 3600
"""Largest MaxRuntimeInSeconds SageMaker accepts: 28 days (clouds.md §1.1 StoppingCondition [B])."""
MAX_HYPERPARAMETERS = 100  # entries, clouds.md §1.1 [B]
MAX_HYPERPARAMETER_VALUE = 2500  # characters per value in botocore's model (§1.1: the doc text says 256)
MAX_ENVIRONMENT = 100  # entries; keys and values ≤ 512 characters (botocore model)
MAX_TAGS = 50  # clouds.md §1.1 [B]
LIST_PAGE = 100  # ListTrainingJobs MaxResults upper bound (clouds.md §1.7)
SPOT_WAIT_FACTOR = 2
"""Spot jobs wait up to this × max runtime for capacity and run (MaxWaitTimeInSeconds ≥ MaxRuntime,
clouds.md §1.1), capped at :data:`MAX_RUNTIME_S`."""

IMAGE_ACCOUNTS = {"us-east-1": "763104351884", "us-west-2": "763104351884", "eu-west-1": "763104351884"}
"""ECR registry account of AWS's deep learning containers per region, where clouds.md §1.1 records it
([SDK2 image_uri_config/pytorch.json]); other regions have other accounts: set ``image_uri`` there."""
IMAGE_REPO = "pytorch-training"
IMAGE_VERSION = "2.8.0"  # newest PyTorch training entry in the SDK's config, py312 (clouds.md §1.1)
IMAGE_PY = "py312"

INSTANCE_GPUS = {
    "ml.m5.xlarge": 0, "ml.g5.xlarge": 1, "ml.g5.12xlarge": 4, "ml.p3.2xlarge": 1, "ml.p4d.24xlarge": 8,
}
"""NVIDIA GPUs per instance of the catalog's types (AWS EC2 instance-type specifications for the m5,
g5 (A10G), p3 (V100) and p4d (A100) families; SageMaker's ml.* types are the same machines). Not in
clouds.md; a type missing here is checked against ``max_procs_per_node`` only."""
INSTANCE_VCPUS = {"ml.m5.xlarge": 4}
"""vCPUs of the CPU-only types above (EC2 m5.xlarge: 4), the most ranks a CPU job runs per instance."""

SETTINGS = BackendSettings(
    backend_label="AWS SageMaker", provider="SageMaker",
    settings=(
        Setting("region", "AWS region", "Where jobs run, e.g. us-east-1.", required=True, max_length=30),
        # Its account keys the rate limit.
        Setting("role_arn", "Execution role ARN",
                "The IAM role SageMaker assumes to read the data and write outputs, e.g. "
                "arn:aws:iam::123456789012:role/SageMakerTraining.", required=True, max_length=2048),
        Setting("bucket", "S3 bucket", "Holds the trainer package, outputs and checkpoints.", required=True,
                max_length=63),
        Setting("prefix", "S3 prefix", "Key prefix inside the bucket, e.g. trainboard/.", max_length=500,
                default="trainboard"),
        # Blank: default_image_uri (its -cpu- variant on CPU-only instances).
        Setting("image_uri", "Training image",
                "Container image URI; blank uses AWS's PyTorch training container for the region.",
                max_length=2048),
        Setting("instance_type", "Default instance type", "Used when a job does not choose one, e.g. ml.g5.xlarge.",
                max_length=100, default="ml.g5.xlarge"),
        Setting("spot_allowed", "Spot allowed", "Jobs may ask for managed spot training.", type=bool, default=False),
        # Host settings: a profile picks one of the worker's own AWS credentials, an endpoint is where the
        # worker sends its signed calls (with the worker's session token when no secrets are stored).
        Setting("profile", "AWS profile name",
                "Optional: a profile of the worker's ~/.aws/config; blank uses boto3's default chain. "
                "No keys are stored here.", host=True, max_length=128, default=""),
        Setting("endpoint_url", help="\"\" (AWS), one URL for every service (a local stand-in), or {service: URL}.",
                host=True, field=False, default=""),
        Setting("max_nodes", help="Most instances per job, 1–100.", type=int, field=False, default=8),
        Setting("max_procs_per_node", help="Most ranks per instance, 1–64 (GPU types are also capped at their "
                                           "GPU count).", type=int, field=False, default=8),
        Setting("volume_size_gb", help="ResourceConfig.VolumeSizeInGB, 1–16384 (NVMe types use instance storage).",
                type=int, field=False, default=50),
        Setting("max_calls_per_second", help="The account's API rate limit here (token bucket, burst 2×).",
                type=float, field=False, default=10.0),
    ),
    # Without them, boto3's default chain (ambient_identity).
    secrets=(
        Secret("aws_access_key_id", "AWS access key ID"),
        Secret("aws_secret_access_key", "AWS secret access key"),
        Secret("aws_session_token", "AWS session token", required=False),
    ),
)
"""The settings of a SageMaker backend and the credentials it may store (:mod:`cloud_adapters.settings`)."""


def default_image_uri(region: str, *, gpu: bool = True) -> str:
    """AWS's PyTorch training image for ``region``:
    ``763104351884.dkr.ecr.<region>.amazonaws.com/pytorch-training:2.8.0-<gpu|cpu>-py312``
    (the SageMaker SDK's form, clouds.md §1.1 [SDK2 image_uris.py ``_format_tag``]).

    Raises :class:`InvalidSpec` for a region whose registry account clouds.md does not record.
    """
    account = IMAGE_ACCOUNTS.get(region)
    if account is None:
        raise InvalidSpec(
            f"image_uri: no default PyTorch training image is known for region {region!r} (known: "
            f"{', '.join(sorted(IMAGE_ACCOUNTS))}); set image_uri to the region's "
            f"'<account>.dkr.ecr.{region}.amazonaws.com/{IMAGE_REPO}:<tag>' from AWS's deep learning "
            f"containers list.")
    kind = "gpu" if gpu else "cpu"
    return f"{account}.dkr.ecr.{region}.amazonaws.com/{IMAGE_REPO}:{IMAGE_VERSION}-{kind}-{IMAGE_PY}"


def training_job_name(job_name: str) -> str:
    """The SageMaker TrainingJobName for a Trainboard job name, deterministic.

    A name already valid (1–63 characters, ``[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}``) is kept. Otherwise
    every character outside ``[a-zA-Z0-9-]`` becomes ``-`` (SageMaker forbids ``_``), leading and
    trailing hyphens are dropped, and ``-`` + the first 8 hex digits of sha256(original) are appended
    (the name cut to fit 63), so two names that map to the same text stay distinct.
    """
    if NAME_RE.fullmatch(job_name or ""):
        return job_name
    if not job_name:
        raise InvalidSpec("job name: empty; the dashboard derives it from the job id.")
    digest = hashlib.sha256(job_name.encode("utf-8")).hexdigest()[:8]
    base = re.sub(r"[^a-zA-Z0-9-]", "-", job_name).strip("-")
    base = base[: NAME_MAX - len(digest) - 1].rstrip("-")
    return f"{base}-{digest}" if base else f"tb-{digest}"


def hyperparameters(config: Mapping[str, Any]) -> dict[str, str]:
    """``{"<section>.<field>": json.dumps(value)}`` for every field of the JobConfig dict ``config``
    except ``output.output_dir`` and ``output.checkpoint_dir`` (SageMaker's directories replace them;
    the rest of the section, e.g. ``output.checkpoint_format``, is the job's and is passed).

    Raises :class:`InvalidSpec` when the config is not sections of fields, a value is not JSON or is
    longer than 2500 characters, or there are more than 100 (botocore model limits, clouds.md §1.1).
    """
    out: dict[str, str] = {}
    for section, fields in config.items():
        if not isinstance(fields, Mapping):
            raise InvalidSpec(f"config.{section}: expected an object of fields, got {fields!r:.100}")
        for field, value in fields.items():
            key = f"{section}.{field}"
            if key in ("output.output_dir", "output.checkpoint_dir"):
                continue
            try:
                text = json.dumps(value, sort_keys=True, separators=(",", ":"))
            except (TypeError, ValueError) as exc:
                raise InvalidSpec(f"config.{key}: not JSON-serialisable ({exc}).") from None
            if len(text) > MAX_HYPERPARAMETER_VALUE:
                raise InvalidSpec(
                    f"config.{key}: {len(text)} characters as a SageMaker hyperparameter, the limit is "
                    f"{MAX_HYPERPARAMETER_VALUE}; shorten it.")
            out[key] = text
    return out


def _refuse_setup_py(members) -> None:
    """The toolkit would ``pip install .`` a submit directory with a top-level setup.py as a package
    (sagemaker-training ``_entry_point_type``) instead of running the entry script."""
    if "setup.py" in members:
        raise InvalidSpec("code archive member 'setup.py': SageMaker's training toolkit installs a submit "
                          "directory with a top-level setup.py as a Python package; move setup.py into "
                          "a subdirectory, or list your dependencies in requirements.txt.")


def _parse_s3(uri: str, field: str) -> tuple[str, str]:
    m = re.fullmatch(r"s3://([^/]+)(?:/(.*))?", uri or "")
    if not m:
        raise InvalidSpec(f"{field}: expected an s3://bucket/key URI, got {uri!r}.")
    return m.group(1), m.group(2) or ""


class SageMakerBackend(CloudBackend):
    """Runs jobs as SageMaker training jobs; see the module docstring for what a job is made of.

    Settings: :data:`SETTINGS` (``clean_config`` raises :class:`InvalidSpec` naming each setting
    that is missing or malformed). Credentials are the backend's stored access key, else boto3's
    default chain or the named ``profile``.
    """

    kind = "sagemaker"
    service = "SageMaker"
    states = STATES
    stop_verb = "stop"
    # StoppingCondition.MaxRuntimeInSeconds and its SIGTERM + 120 s: botocore's SageMaker model, clouds.md §1.1.
    max_runtime_covers = (
        "the whole training job from its start, so launching the instances and downloading the image and the "
        "data count; at the limit SageMaker sends the training processes SIGTERM and stops the job 120 s later "
        "(AWS SageMaker API reference, StoppingCondition)")
    image_setting = "image_uri"
    image_torch_pattern = r"/pytorch-training:(\d+\.\d+)"  # <version>-<cpu|gpu>-<py>, clouds.md §1.1
    settings = SETTINGS
    dataset_schemes = frozenset({"s3"})
    """An S3 prefix becomes the ``train`` input channel (``InputDataConfig``'s ``S3Uri``, clouds.md §1.1)."""
    # boto3's documentation, "Credentials" → "Configuring credentials": the order boto3 searches.
    ambient_identity = "boto3's default credential chain: the worker's AWS_* environment, profile or IAM role"

    def __init__(self, config: Mapping[str, Any] | None = None, *, secrets: Mapping[str, str] | None = None,
                 prices=None, retry_policy: retry.RetryPolicy | None = None, clock: retry.Clock | None = None) -> None:
        super().__init__(config, secrets=secrets, prices=prices)
        self.retry_policy = retry_policy or retry.RetryPolicy()
        """Attempts and backoff of every provider call (tests pass a seeded RNG)."""
        self.clock = clock or retry.SYSTEM_CLOCK
        """Time source of retries and the rate limit (tests pass a simulated clock)."""
        self._clients: dict[str, Any] = {}
        self._clients_lock = threading.Lock()

    # -- configuration ----------------------------------------------------------------------

    @classmethod
    def clean_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Every problem at once (:class:`SettingsProblems`): one InvalidSpec whose ``errors`` name
        each setting that is missing or malformed."""
        problems = cls.settings_problems(config)
        out = SETTINGS.defaults
        out.update({k: v for k, v in config.items() if v is not None and k in SETTINGS.keys})

        region = out.get("region")
        with problems.about("region"):
            if not isinstance(region, str) or not REGION_RE.fullmatch(region.strip()):
                raise InvalidSpec(f"region: expected an AWS region code such as 'us-east-1', got {region!r}.")
            out["region"] = region = region.strip()

        role = out.get("role_arn")
        with problems.about("role_arn"):
            if not isinstance(role, str) or _aws.role_account(role.strip()) is None:
                raise InvalidSpec(
                    f"role_arn: expected an IAM role ARN 'arn:aws:iam::<12-digit account id>:role/<name>' "
                    f"(the SageMaker execution role), got {role!r}.")
            out["role_arn"] = role.strip()

        bucket = out.get("bucket")
        with problems.about("bucket"):
            if not isinstance(bucket, str) or not BUCKET_RE.fullmatch(bucket.strip()):
                raise InvalidSpec(
                    f"bucket: expected an S3 bucket name (3–63 lowercase letters, digits, '.' or '-'; no "
                    f"s3:// prefix), got {bucket!r}.")
            out["bucket"] = bucket.strip()

        prefix = out.get("prefix")
        with problems.about("prefix"):
            if not isinstance(prefix, str) or not re.fullmatch(r"[\w.\-/]*", prefix) or ".." in prefix:
                raise InvalidSpec(f"prefix: expected an S3 key prefix of letters, digits, '_-./', got {prefix!r}.")
            out["prefix"] = prefix.strip("/")

        image = out.get("image_uri") or ""
        with problems.about("image_uri"):
            if not isinstance(image, str):
                raise InvalidSpec(f"image_uri: expected an ECR image URI, got {image!r}.")
            # The default image is the region's: without a valid region there is none to check.
            if image.strip() or not problems.has("region"):
                out["image_uri"] = image.strip() or default_image_uri(region)
                if not IMAGE_RE.fullmatch(out["image_uri"]):
                    raise InvalidSpec(
                        f"image_uri: expected '<registry>/<repository>[:tag|@digest]', got {out['image_uri']!r}.")

        itype = out.get("instance_type")
        with problems.about("instance_type"):
            if not isinstance(itype, str) or not itype.startswith("ml."):
                raise InvalidSpec(f"instance_type: expected a SageMaker 'ml.*' instance type, got {itype!r}.")

        with problems.about("spot_allowed"):
            if not isinstance(out["spot_allowed"], bool):
                raise InvalidSpec(f"spot_allowed: expected true or false, got {out['spot_allowed']!r}.")
        with problems.about("profile"):
            if not isinstance(out["profile"], str):
                raise InvalidSpec(f"profile: expected an AWS profile name, got {out['profile']!r}.")
        endpoint = out["endpoint_url"]
        with problems.about("endpoint_url"):
            urls = endpoint.values() if isinstance(endpoint, Mapping) else [endpoint]
            if not all(isinstance(u, str) and (not u or re.match(r"https?://", u)) for u in urls):
                raise InvalidSpec(f"endpoint_url: expected an http(s):// URL or {{service: URL}}, got {endpoint!r}.")
            if isinstance(endpoint, Mapping):
                out["endpoint_url"] = dict(endpoint)

        for field, low, high in (("max_nodes", 1, 100), ("max_procs_per_node", 1, 64), ("volume_size_gb", 1, 16384)):
            value = out[field]
            with problems.about(field):
                if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                    raise InvalidSpec(f"{field}: expected an integer from {low} to {high}, got {value!r}.")
        rate = out["max_calls_per_second"]
        with problems.about("max_calls_per_second"):
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
                raise InvalidSpec(f"max_calls_per_second: expected a number above 0, got {rate!r}.")
            out["max_calls_per_second"] = float(rate)
        problems.raise_if_any()
        return out

    @property
    def region(self) -> str:
        return self.config["region"]

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            spot=self.config["spot_allowed"],
            max_nodes=self.config["max_nodes"],
            max_procs_per_node=self.config["max_procs_per_node"],
            strategies=self.runnable_strategies(),
        )

    # -- prices -----------------------------------------------------------------------------

    def _known_types(self) -> list[str]:
        return [r.instance_type for r in self.prices.rows(PROVIDER, self.region)]

    def _unknown_type(self, instance_type: str) -> InvalidSpec:
        known = self._known_types()
        listed = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
        return InvalidSpec(
            f"instance type {instance_type!r} has no price in the catalog for {self.region}; known: "
            f"{listed or 'none (add rows to the price catalog)'}.", field="instance_type")

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        """On-demand USD per instance-hour of ``instance_type`` in the backend's region (catalog row).

        For spot the same on-demand price is returned: SageMaker bills managed spot jobs for fewer
        seconds (BillableTimeInSeconds < TrainingTimeInSeconds, clouds.md §1.2), so
        cost = billable seconds × instances × this price already carries the saving.
        Raises :class:`InvalidSpec` when the catalog has no row (the message lists known types).
        """
        itype = instance_type or self.config["instance_type"]
        row = self.prices.lookup(PROVIDER, self.region, itype)
        if row is None:
            raise self._unknown_type(itype)
        return float(row.usd_per_hour)

    def gpus(self, instance_type: str = "") -> GpuFacts | None:
        """The catalog's GPU facts of ``instance_type`` (default: the backend's ``instance_type``)."""
        return catalog_gpus(self.prices, PROVIDER, instance_type or self.config["instance_type"])

    def instance_offers(self) -> list[InstanceOffer]:
        """Every catalog row of the region, as offers (sorted by instance type)."""
        return [InstanceOffer(instance_type=r.instance_type, usd_per_hour=float(r.usd_per_hour),
                              confirmed=r.confirmed, source=f"{r.source} ({r.as_of})" if r.as_of else r.source)
                for r in self.prices.rows(PROVIDER, self.region)]

    # -- validate / submit ------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Base checks (nodes, processes, spot allowed, runtime ≥ 1 s) plus SageMaker's own.

        * instance type: an ``ml.*`` type with a catalog price in the region;
        * processes per node ≤ the instance's GPUs (one rank per GPU), or ≤ its vCPUs on a CPU type;
        * max runtime ≤ 28 days (MaxRuntimeInSeconds, clouds.md §1.1);
        * dataset: "" (built-in data) or an ``s3://`` URI; tags and env within the API's limits;
        * the job's image an image URI; its code archive readable, unchanged, without members named like
          ours or a top-level setup.py (reads the local archive: no provider call).
        """
        training_job_name(spec.job_name)
        itype = spec.instance_type or self.config["instance_type"]
        if not itype.startswith("ml."):
            raise InvalidSpec(f"instance type {itype!r}: SageMaker training types start with 'ml.' "
                              f"(e.g. {self.config['instance_type']}).", field="instance_type")
        if self.prices.lookup(PROVIDER, self.region, itype) is None:
            raise self._unknown_type(itype)
        super().validate(spec)
        gpus = INSTANCE_GPUS.get(itype)
        if gpus and spec.procs_per_node > gpus:
            raise InvalidSpec(
                f"{spec.nodes} × {itype} with {spec.procs_per_node} processes per node: {itype} has "
                f"{gpus} GPU{'s' if gpus != 1 else ''} and each rank needs its own; ask for at most {gpus} "
                f"processes per node (world size {spec.nodes} × {gpus} = {spec.nodes * gpus}).", field="procs_per_node")
        vcpus = INSTANCE_VCPUS.get(itype)
        if gpus == 0 and vcpus and spec.procs_per_node > vcpus:
            raise InvalidSpec(f"{itype} has {vcpus} vCPUs; ask for at most {vcpus} processes per node "
                              f"(got {spec.procs_per_node}).", field="procs_per_node")
        if spec.max_runtime_s > MAX_RUNTIME_S:
            raise InvalidSpec(
                f"max runtime {spec.max_runtime_s} s is above SageMaker's limit of {MAX_RUNTIME_S} s "
                f"(28 days); lower it, and resume from checkpoints in a second job if needed.", field="max_runtime_s")
        if spec.dataset_uri and not spec.dataset_uri.startswith("s3://"):
            raise InvalidSpec(
                f"dataset {spec.dataset_uri!r}: SageMaker reads data from S3; upload it and use its "
                f"s3:// URI (or a built-in dataset).", field="dataset_uri")
        if spec.dataset_uri:
            _parse_s3(spec.dataset_uri, "dataset")
        if not isinstance(spec.config, Mapping):
            raise InvalidSpec("config: expected a JSON object (the trainer_pkg JobConfig as a dict).")
        if spec.image and not IMAGE_RE.fullmatch(spec.image):
            raise InvalidSpec(f"image {spec.image!r}: expected an ECR image URI '<registry>/<repository>[:tag|@digest]', "
                              f"e.g. 123456789012.dkr.ecr.{self.region}.amazonaws.com/my-training:1.", field="image")
        if spec.code is not None and spec.trainer_package_uri.startswith("s3://"):
            raise InvalidSpec(f"trainer package {spec.trainer_package_uri!r}: a job with its own code ships the "
                              f"trainer and the code as one archive, so the trainer must be a directory that "
                              f"contains trainer_pkg/ (or empty for this installation's).")
        if spec.code is not None:  # the archive's own problems, before the job is queued
            files = packaging.code_files(spec.code)
            packaging.refuse_ours(files, ())
            _refuse_setup_py(name for name, _, _ in files)
        if len(hyperparameters(self._config(spec))) + 5 > MAX_HYPERPARAMETERS:
            raise InvalidSpec(f"config: more than {MAX_HYPERPARAMETERS - 5} fields; SageMaker takes "
                              f"{MAX_HYPERPARAMETERS} hyperparameters.")
        self._tags(spec)
        self._environment(spec)

    def _tags(self, spec: JobSpec) -> list[dict[str, str]]:
        tags = {TAG_JOB_NAME: spec.job_name, **{str(k): str(v) for k, v in spec.tags.items()}}
        if len(tags) > MAX_TAGS:
            raise InvalidSpec(f"tags: {len(tags)} given, SageMaker takes at most {MAX_TAGS}.")
        for key, value in tags.items():
            if not (1 <= len(key) <= 128 and len(value) <= 256 and TAG_RE.fullmatch(key) and TAG_RE.fullmatch(value)):
                raise InvalidSpec(f"tag {key!r}={value!r}: keys 1–128 and values ≤ 256 characters of "
                                  f"letters, digits, spaces and _.:/=+-@.")
        return [{"Key": k, "Value": v} for k, v in tags.items()]

    def _environment(self, spec: JobSpec) -> dict[str, str]:
        """The request's Environment: ours, then ``spec.env``, then ``spec.secret_env`` (a message about
        a variable names it, never its value)."""
        env = {"PYTHONUNBUFFERED": "1", "TRAINBOARD_JOB_NAME": spec.job_name,
               packaging.PROCS_ENV: str(spec.procs_per_node)}
        env.update({str(k): str(v) for k, v in spec.env.items()})
        env.update({str(k): str(v) for k, v in spec.secret_env.items()})
        if len(env) > MAX_ENVIRONMENT:
            raise InvalidSpec(f"env: {len(env)} variables (with the job's secrets), SageMaker takes at most "
                              f"{MAX_ENVIRONMENT}.")
        for key, value in env.items():
            if not ENV_KEY_RE.fullmatch(key) or len(key) > 512 or len(value) > 512:
                raise InvalidSpec(f"env {key!r}: names are letters, digits and '_' (not starting with a "
                                  f"digit); names and values at most 512 characters.")
        return env

    def _config(self, spec: JobSpec) -> dict[str, Any]:
        """The job's config as the hyperparameters carry it: ``code.dir`` and ``code.sha256`` set when
        the job has user code (its files lie beside trainer_pkg/ in the submit directory)."""
        return packaging.config_with_code(spec.config, spec.code, packaging.CODE_DIR_HERE)

    def _image(self, instance_type: str, job_image: str = "") -> str:
        if job_image:
            return job_image
        image = self.config["image_uri"]
        if image == default_image_uri(self.region) and INSTANCE_GPUS.get(instance_type) == 0:
            return default_image_uri(self.region, gpu=False)  # the CPU build of the same container
        return image

    def _s3_uri(self, *parts: str) -> str:
        key = "/".join(p.strip("/") for p in (self.config["prefix"], *parts) if p.strip("/"))
        return f"s3://{self.config['bucket']}/{key}/"

    def training_request(self, spec: JobSpec, trainer_uri: str) -> dict[str, Any]:
        """The CreateTrainingJob keyword arguments for ``spec`` with the trainer archive at
        ``trainer_uri`` (field meanings and limits: clouds.md §1.1). Makes no call."""
        name = training_job_name(spec.job_name)
        itype = spec.instance_type or self.config["instance_type"]
        hps = hyperparameters(self._config(spec))
        hps.update({
            # Script mode of AWS's framework containers, JSON-encoded as the SDK sends them (§1.1).
            "sagemaker_program": json.dumps(packaging.ENTRY_SCRIPT),
            "sagemaker_submit_directory": json.dumps(trainer_uri),
            "sagemaker_container_log_level": "20",
            "sagemaker_job_name": json.dumps(name),
            "sagemaker_region": json.dumps(self.region),
        })
        if packaging.code_framework(spec.config) == "mpi":
            # The SDK's distribution={"mpi": {"enabled": True, "processes_per_host": N}}: the toolkit's
            # mpirun starts N ranks per host, each running the entry script (sagemaker-training
            # params.py, runner.py, mpi.py MasterRunner); the launcher then runs the script as its rank.
            hps.update({"sagemaker_mpi_enabled": json.dumps(True),
                        "sagemaker_mpi_num_of_processes_per_host": json.dumps(int(spec.procs_per_node)),
                        "sagemaker_mpi_custom_mpi_options": json.dumps("")})
        stopping = {"MaxRuntimeInSeconds": int(spec.max_runtime_s)}
        if spec.spot:
            stopping["MaxWaitTimeInSeconds"] = max(int(spec.max_runtime_s),
                                                   min(MAX_RUNTIME_S, SPOT_WAIT_FACTOR * int(spec.max_runtime_s)))
        request: dict[str, Any] = {
            "TrainingJobName": name,
            "RoleArn": self.config["role_arn"],
            "AlgorithmSpecification": {"TrainingImage": self._image(itype, spec.image),
                                       "TrainingInputMode": "FastFile"},
            "HyperParameters": hps,
            "OutputDataConfig": {"S3OutputPath": spec.output_uri or self._s3_uri("output")},
            "CheckpointConfig": {"S3Uri": spec.checkpoint_uri or self._s3_uri("checkpoints", name),
                                 "LocalPath": "/opt/ml/checkpoints"},
            "ResourceConfig": {"InstanceType": itype, "InstanceCount": int(spec.nodes),
                               "VolumeSizeInGB": int(self.config["volume_size_gb"])},
            "StoppingCondition": stopping,
            "EnableManagedSpotTraining": bool(spec.spot),
            "Environment": self._environment(spec),
            "Tags": self._tags(spec),
        }
        if spec.dataset_uri:
            request["InputDataConfig"] = [{
                "ChannelName": "train",
                "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": spec.dataset_uri,
                                                "S3DataDistributionType": "FullyReplicated"}},
                "InputMode": "FastFile",
            }]
        return request

    def trainer_uri(self, spec: JobSpec) -> str:
        """The archive's S3 URI, uploading it first when the bucket lacks it (HeadObject).

        ``spec.trainer_package_uri``: "" packages this checkout's trainer_pkg; an ``s3://`` URI is
        used as is; a local directory holding ``trainer_pkg/`` is packaged from there. ``spec.code``'s
        files join the archive at its root (:func:`~cloud_adapters.packaging.build_archive`): a member
        named like one of ours, or a top-level ``setup.py``, is refused with :class:`InvalidSpec`.
        """
        source = spec.trainer_package_uri
        if source.startswith("s3://") and spec.code is None:
            return source
        if source and not Path(source, "trainer_pkg", "__init__.py").is_file():
            raise InvalidSpec(f"trainer package {source!r}: expected "
                              f"{'a directory' if spec.code is not None else 'an s3:// URI or a directory'} that "
                              f"contains trainer_pkg/ (leave it empty to ship this installation's).")
        archive = packaging.build_archive(source or None, code=spec.code)
        if spec.code is not None:
            _refuse_setup_py(archive.members)
        uri, _ = packaging.upload_once(self.client("s3"), archive, bucket=self.config["bucket"],
                                       prefix=self.config["prefix"],
                                       call=lambda fn: self.call(fn, "S3"))
        return uri

    # -- submit -----------------------------------------------------------------------------
    # CloudBackend.submit: DescribeTrainingJob (adopt when it exists); else HeadObject (+ PutObject
    # once per trainer version) and CreateTrainingJob; on ResourceInUse DescribeTrainingJob again.

    def provider_name(self, job_name: str) -> str:
        return training_job_name(job_name)

    @contextlib.contextmanager
    def create_request(self, spec: JobSpec, name: str) -> Iterator[dict[str, Any]]:
        yield self.training_request(spec, self.trainer_uri(spec))

    def create_job(self, spec: JobSpec, name: str, request: dict[str, Any]) -> dict[str, Any]:
        sm = self.client("sagemaker")
        created = self.call(lambda: sm.create_training_job(**request))
        return {"TrainingJobName": name, "TrainingJobArn": created.get("TrainingJobArn"),
                "ResourceConfig": request["ResourceConfig"]}

    def adopt_after_failed_create(self, exc: BackendError) -> bool:
        return _aws.error_code(exc.__cause__) == "ResourceInUse"  # a concurrent submit created it first

    def job_handle(self, job_name: str, desc: Mapping[str, Any]) -> JobHandle:
        count = (desc.get("ResourceConfig") or {}).get("InstanceCount") or 1
        return JobHandle(provider=self.kind, job_name=job_name,
                         provider_job_id=str(desc.get("TrainingJobArn") or ""),
                         extra={"training_job_name": str(desc.get("TrainingJobName") or training_job_name(job_name)),
                                "region": self.region, "instance_count": int(count)})

    # -- describe ---------------------------------------------------------------------------

    def job_ref(self, handle: JobHandle) -> str:
        return str(handle.extra.get("training_job_name") or training_job_name(handle.job_name))

    def no_job(self, ref: str) -> str:
        return f"SageMaker has no training job {ref!r} in {self.region}"

    def get_job(self, ref: str) -> dict[str, Any] | None:
        """DescribeTrainingJob, or None when SageMaker has no job of that name (the service answers
        ValidationException "Requested resource not found", the model lists ResourceNotFound;
        clouds.md §1.2)."""
        sm = self.client("sagemaker")
        try:
            return self.call(lambda: sm.describe_training_job(TrainingJobName=ref))
        except BackendError as exc:
            if _aws.error_code(exc.__cause__) in ("ValidationException", "ResourceNotFound"):
                return None
            raise

    def job_status(self, desc: Mapping[str, Any]) -> JobStatus:
        """The mapping of :mod:`cloud_adapters.sagemaker.states`."""
        return job_status(desc)

    def raw_state(self, desc: Mapping[str, Any]) -> str:
        return str(desc.get("TrainingJobStatus") or "")

    def jobs_of(self, handles: Sequence[JobHandle],
                since: dt.datetime | None) -> Iterator[tuple[JobHandle, Mapping[str, Any]]]:
        """Without ``since``: one DescribeTrainingJob per handle. With it: ListTrainingJobs
        (LastModifiedTimeAfter = ``since``, 100 per page, every page), then DescribeTrainingJob only
        for the handles listed: calls per sync = ⌈changed in the account / 100⌉ + changed in the
        batch, not the number of active jobs."""
        if since is not None:
            changed = self._changed_names(since)
            handles = [h for h in handles if self.job_ref(h) in changed]
        return super().jobs_of(handles, since)

    def _changed_names(self, after: dt.datetime) -> set[str]:
        sm = self.client("sagemaker")

        def page(token: str | None) -> tuple[list[str], str | None]:
            kwargs: dict[str, Any] = {"LastModifiedTimeAfter": after, "MaxResults": LIST_PAGE}
            if token:
                kwargs["NextToken"] = token
            answer = sm.list_training_jobs(**kwargs)
            return [s["TrainingJobName"] for s in answer.get("TrainingJobSummaries") or []], answer.get("NextToken")

        return set(self.pages(page))

    # -- orphans ----------------------------------------------------------------------------

    def unfinished_jobs(self) -> list[Mapping[str, Any]]:
        """Training jobs in this region that have not ended (InProgress, Stopping).

        Calls: ListTrainingJobs(StatusEquals=InProgress), then (StatusEquals=Stopping), 100 per page,
        every page; :meth:`job_tags` adds ListTags once per job listed (ListTrainingJobs does not
        return tags): ⌈in progress / 100⌉ + ⌈stopping / 100⌉ + (in progress + stopping) calls,
        bounded by the account's running jobs, never by its history.
        """
        sm = self.client("sagemaker")
        unfinished = self.states.unfinished
        summaries: list[Mapping[str, Any]] = []
        for status in sorted(unfinished):
            def page(token: str | None, status: str = status) -> tuple[list[Mapping[str, Any]], str | None]:
                kwargs: dict[str, Any] = {"StatusEquals": status, "MaxResults": LIST_PAGE}
                if token:
                    kwargs["NextToken"] = token
                answer = sm.list_training_jobs(**kwargs)
                return answer.get("TrainingJobSummaries") or [], answer.get("NextToken")

            summaries += [s for s in self.pages(page) if s.get("TrainingJobStatus") in unfinished]
        return summaries

    def job_tags(self, summary: Mapping[str, Any]) -> dict[str, str]:
        arn = str(summary.get("TrainingJobArn") or "")
        sm = self.client("sagemaker")
        answer = self.call(lambda: sm.list_tags(ResourceArn=arn, MaxResults=MAX_TAGS))
        return {t["Key"]: t["Value"] for t in answer.get("Tags") or []}

    def created_at(self, summary: Mapping[str, Any]) -> dt.datetime | None:
        return parse_utc(summary.get("CreationTime"))

    # -- cancel -----------------------------------------------------------------------------
    # CloudBackend.cancel: StopTrainingJob (SageMaker reports Stopping, then Stopped); a stop it
    # refuses (ValidationException) for a job already Stopping or ended is not an error.

    def stop_job(self, ref: str) -> None:
        sm = self.client("sagemaker")
        self.call(lambda: sm.stop_training_job(TrainingJobName=ref))

    def stop_refused(self, exc: BackendError) -> bool:
        return _aws.error_code(exc.__cause__) in ("ValidationException", "ResourceNotFound")

    # -- logs -------------------------------------------------------------------------------

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        """New lines of the job's CloudWatch streams (one per instance) since ``cursor``.

        See :mod:`cloud_adapters.sagemaker.logs` for the cursor and line format: in a multi-instance
        job lines are prefixed ``[algo-N] ``, metric lines stay exactly as the trainer printed them.
        """
        count = int(handle.extra.get("instance_count") or 1)
        return cw_logs.tail(self.client("logs"), self.job_ref(handle), cursor, prefix_hosts=count > 1,
                            call=lambda fn: self.call(fn, "CloudWatch Logs"))

    # -- artifacts --------------------------------------------------------------------------
    # SageMaker uploads /opt/ml/model as one tarball, <S3OutputPath>/<job>/output/model.tar.gz (and
    # /opt/ml/output/data as output.tar.gz beside it), and syncs /opt/ml/checkpoints to the
    # CheckpointConfig prefix while the job runs. The tarball is listed as it is, not its members: a
    # gzip stream cannot be listed or sliced without reading it whole, and the tarball is what a
    # SageMaker model or a later job takes. The CloudWatch log is no artifact: it is a set of event
    # streams, not an object to sign or stream; its lines are the dashboard's own job log.

    def _artifact_roots(self, handle: JobHandle) -> list[artifact_store.Root]:
        ref = self.job_ref(handle)
        desc = self.get_job(ref)
        if desc is None:
            raise ProviderError(f"{self.no_job(ref)}: its outputs cannot be found")
        output = (desc.get("OutputDataConfig") or {}).get("S3OutputPath") or self._s3_uri("output")
        checkpoints = (desc.get("CheckpointConfig") or {}).get("S3Uri") or self._s3_uri("checkpoints", ref)
        out_bucket, out_prefix = artifact_store.split_uri(output, "s3")
        ckpt_bucket, ckpt_prefix = artifact_store.split_uri(checkpoints, "s3")
        return [artifact_store.Root(out_bucket, f"{out_prefix}{ref}/output/",
                                    only=frozenset({"model.tar.gz", "output.tar.gz"})),
                artifact_store.Root(ckpt_bucket, ckpt_prefix, "checkpoints/")]

    def _artifact_files(self, handle: JobHandle) -> dict[str, artifact_store.StoredFile]:
        def list_files() -> dict[str, artifact_store.StoredFile]:
            s3 = self.client("s3")
            found: list[artifact_store.StoredFile] = []
            for root in self._artifact_roots(handle):
                found += self.call(lambda root=root: artifact_store.s3_files(s3, root), "S3")
            return artifact_store.collect(found)
        return artifact_store.cached_listing(self, self.job_ref(handle), list_files)

    def artifacts(self, handle: JobHandle) -> list[Artifact]:
        """``model.tar.gz`` and ``output.tar.gz`` (once SageMaker uploaded them) and every object of
        the checkpoint prefix as ``checkpoints/<key under it>``. Calls: DescribeTrainingJob, then
        ListObjectsV2 per prefix (1,000 objects a page)."""
        return artifact_store.as_artifacts(self._artifact_files(handle))

    def open_artifact(self, handle: JobHandle, name: str) -> BinaryIO:
        """The object's body (GetObject), streamed."""
        f = artifact_store.pick(self._artifact_files(handle), name, handle.job_name)
        return self.call(lambda: artifact_store.s3_open(self.client("s3"), f), "S3")

    def artifact_url(self, handle: JobHandle, name: str, *, expires_s: int = 300) -> str | None:
        """A presigned GetObject URL (signed with the backend's credentials, valid ``expires_s``)."""
        f = artifact_store.pick(self._artifact_files(handle), name, handle.job_name)
        return artifact_store.s3_url(self.client("s3"), f, expires_s)

    def artifact_uri(self, handle: JobHandle, name: str) -> str:
        """``s3://bucket/key``: what a later SageMaker job reads as a channel or checkpoint prefix."""
        f = artifact_store.pick(self._artifact_files(handle), name, handle.job_name)
        return f"s3://{f.container}/{f.key}"

    # -- test connection --------------------------------------------------------------------

    def connection_probes(self) -> list[Probe]:
        """``identity`` (STS GetCallerIdentity), ``bucket`` (S3 HeadBucket on ``bucket``),
        ``SageMaker access`` (ListTrainingJobs MaxResults=1); each runs whatever the others found."""
        bucket = self.config["bucket"]

        def identity() -> str:
            who = self.client("sts").get_caller_identity()
            return f"signed in as {who.get('Arn')} (account {who.get('Account')})"

        def credentials_hint(exc: BaseException) -> str:
            code = _aws.error_code(exc.__cause__ or exc)
            if code in _aws.CREDENTIAL_CODES:
                return f"AWS rejected the credentials ({code}); refresh them or fix AWS_PROFILE / the profile setting."
            return str(exc)

        def head_bucket() -> str:
            self.client("s3").head_bucket(Bucket=bucket)
            return f"bucket {bucket} exists and is accessible"

        def bucket_hint(exc: BaseException) -> str:
            cause = exc.__cause__ or exc
            status = _aws.http_status(cause)
            code = _aws.error_code(cause)
            if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
                return (f"bucket {bucket} does not exist; create it in {self.region} or correct the "
                        f"bucket setting.")
            if status == 403 or code in ("403", "AccessDenied", "Forbidden"):
                return (f"access to bucket {bucket} was denied; grant the worker's identity "
                        f"s3:ListBucket, s3:GetObject and s3:PutObject on it (and the SageMaker role "
                        f"read/write on the prefix {self.config['prefix']}/).")
            return str(exc)

        def list_jobs() -> str:
            self.client("sagemaker").list_training_jobs(MaxResults=1)
            return f"SageMaker API reachable in {self.region} (ListTrainingJobs allowed)"

        def sagemaker_hint(exc: BaseException) -> str:
            code = _aws.error_code(exc.__cause__ or exc)
            if code in _aws.CREDENTIAL_CODES:
                return ("the identity may not call SageMaker; grant it sagemaker:ListTrainingJobs, "
                        "CreateTrainingJob, DescribeTrainingJob, StopTrainingJob and iam:PassRole on "
                        f"{self.config['role_arn']}.")
            return str(exc)

        return [Probe("identity", identity, credentials_hint, service="STS"),
                Probe("bucket", head_bucket, bucket_hint, service="S3"),
                Probe("SageMaker access", list_jobs, sagemaker_hint)]

    # -- plumbing ---------------------------------------------------------------------------

    def client(self, service: str) -> Any:
        """The boto3 client for ``service`` (created once per backend object; thread-safe)."""
        with self._clients_lock:
            if service not in self._clients:
                self._clients[service] = _aws.make_client(
                    service, region=self.region, profile=self.config["profile"],
                    endpoint_url=self.config["endpoint_url"], secrets=self.secrets)
            return self._clients[service]

    def classify(self, exc: BaseException, *, service: str) -> retry.Verdict | None:
        return _aws.classify(exc, service=service)

    def rate_limit(self) -> tuple[str, float]:
        """The account of ``role_arn`` in the region, at ``max_calls_per_second``."""
        account = _aws.role_account(self.config["role_arn"])
        return f"aws:{account}:{self.region}", self.config["max_calls_per_second"]
