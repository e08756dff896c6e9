"""The domain: datasets, model specs, compute backends, training jobs and what they report.

Rows are written only by ``jobs.services`` and read through ``jobs.selectors`` (scoped to the
requesting user). Every row has an owner.
"""

from __future__ import annotations

import urllib.parse
from decimal import Decimal
from pathlib import Path
from typing import get_args

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from cloud_adapters import registry
from cloud_adapters.base import TERMINAL_STATES, Backend, BackendError, JobState
from jobs import cost
from jobs import progress as job_progress
from jobs.fields import EncryptedJSONField
from trainer_pkg.config import Framework

FRAMEWORKS: tuple[str, ...] = get_args(Framework)
"""A script model's frameworks (trainer_pkg.config ``code.framework``): torch, tensorflow, ray, mpi."""


class JobStateChoices(models.TextChoices):
    QUEUED = JobState.QUEUED.value, "Queued"
    SUBMITTING = JobState.SUBMITTING.value, "Submitting"
    PENDING = JobState.PENDING.value, "Pending"
    RUNNING = JobState.RUNNING.value, "Running"
    STOPPING = JobState.STOPPING.value, "Stopping"
    SUCCEEDED = JobState.SUCCEEDED.value, "Succeeded"
    FAILED = JobState.FAILED.value, "Failed"
    CANCELLED = JobState.CANCELLED.value, "Cancelled"


TERMINAL_STATE_VALUES = tuple(s.value for s in TERMINAL_STATES)
HOLDING_STATES = (JobState.SUBMITTING.value, JobState.PENDING.value, JobState.RUNNING.value, JobState.STOPPING.value)
"""States of a job that has left the queue and not ended: on a backend that allocates devices (a GPU
box) it holds the GPUs or slots it was given (``TrainingJob.allocated_gpus``) until it is terminal."""
QUEUE_ORDER = ("-priority", "created_at", "id")
"""The order in which a backend that queues jobs itself starts its waiting QUEUED jobs: priority, then
submission."""
INTERRUPTION = (JobState.RUNNING.value, JobState.PENDING.value)
"""(from, to) of an interruption: the provider took a running job's instances away (a spot
reclaim — SageMaker's SecondaryStatus ``Interrupted`` — or a preemption) and it waits to restart."""
ACTIVE_STATE_VALUES = tuple(s.value for s in JobState if s not in TERMINAL_STATES)
RESUBMIT_FROM = (JobState.SUBMITTING.value, JobState.PENDING.value, JobState.RUNNING.value)
"""States from which a job whose run was lost goes back to QUEUED for its next attempt
(:mod:`jobs.restarts`, docs/recovery.md)."""
DEFAULT_MAX_RESTARTS = 2
MAX_RESTARTS = 10
"""A backend's ``max_restarts``: by default and at most (docs/recovery.md)."""


class Team(models.Model):
    """A group of users who share backends, datasets and models and see each other's jobs.

    An object with ``team`` set is visible to every member; only its owner (or staff) changes it.
    ``monthly_budget_usd`` caps what the team's jobs may cost per calendar month (UTC): a submission
    whose estimate would pass it is refused with the figures.
    """

    name = models.SlugField(max_length=100, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, related_name="trainboard_teams", blank=True)
    monthly_budget_usd = models.DecimalField(
        max_digits=12, decimal_places=2, null=True, blank=True,
        validators=[MinValueValidator(Decimal("0"))],
        help_text="USD per calendar month (UTC) for all of the team's jobs; blank = no limit.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class UserBudget(models.Model):
    """A user's own monthly spending limit (USD per calendar month, UTC) across their jobs."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                related_name="trainboard_budget")
    monthly_budget_usd = models.DecimalField(
        max_digits=12, decimal_places=2, validators=[MinValueValidator(Decimal("0"))],
        help_text="USD per calendar month (UTC) for this user's jobs.",
    )

    class Meta:
        verbose_name = "user budget"

    def __str__(self) -> str:
        return f"{self.user}: ${self.monthly_budget_usd}/month"


class Owned(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    team = models.ForeignKey(
        Team, null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="Share with this team (its members can see and use it); blank = private.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True


class Dataset(Owned):
    """Training data: a built-in dataset or a URI in one of the trainer's formats."""

    class Format(models.TextChoices):
        BUILTIN = "builtin", "Built-in"
        IMAGEFOLDER = "imagefolder", "ImageFolder tree"
        CSV = "csv", "CSV table"
        NPZ = "npz", "NPZ arrays"
        TOKENS = "tokens", "Token shards (language model)"
        WEBDATASET = "webdataset", "WebDataset tar shards (images)"

    name = models.SlugField(max_length=100, help_text="Short name, unique per owner, e.g. digits.")
    description = models.TextField(blank=True)
    format = models.CharField(max_length=20, choices=Format.choices, default=Format.BUILTIN)
    builtin_name = models.CharField(
        max_length=50, blank=True, help_text="For built-in datasets: which one (digits)."
    )
    uri = models.CharField(
        "path or URI", max_length=1000, blank=True, help_text="Local path, or s3:// / gs:// / azureml:// URI."
    )
    label_column = models.CharField(max_length=100, blank=True, default="label", help_text="CSV only.")
    sample_shape = models.JSONField(
        null=True, blank=True, editable=False,
        help_text="Shape of one sample as the trainer reads it, e.g. [1, 8, 8] or [16] (ImageFolder: "
                  "[3, null, null], the job's image size; tokens: [null], the window length T that each job "
                  "sets with data.seq_len, 0 = the gpt model's context_length), read when the dataset was "
                  "saved; null for a cloud URI, which is not read here.")
    summary = models.CharField(
        max_length=500, blank=True, default="", editable=False,
        help_text="One line read from the data when the dataset was saved, e.g. \"1,797 samples, 10 classes, "
                  "inputs 1×8×8\" or \"1,026,173 tokens in 1 shard (train), 10,393 (val), vocab 4,096, "
                  "uint16\"; empty for a cloud URI (not read here) or a dataset not saved since this was added.")

    num_classes = models.PositiveIntegerField(
        null=True, blank=True, editable=False,
        help_text="Classes of the labels, or a token dataset's vocabulary size (the model's output width, which "
                  "the memory plan counts), read when the dataset was saved; null when not read (a cloud URI).")

    num_samples = models.PositiveIntegerField(
        null=True, blank=True, editable=False,
        help_text="Samples in the data, its own validation split included, counted when the dataset was saved; "
                  "null when not counted (a cloud URI, a CSV too large to read whole, a webdataset, token data).")
    val_samples = models.PositiveIntegerField(
        null=True, blank=True, editable=False,
        help_text="Samples of the data's own validation split (an NPZ's x_val, an ImageFolder's val/); null when "
                  "the trainer holds out data.val_fraction of num_samples instead.")

    @property
    def sample_shape_text(self) -> str:
        """One sample's shape for people: "1 × 8 × 8", "16", "3 × H × W" (an ImageFolder's size is the
        job's image size), "T tokens" (a token window's length is the job's data.seq_len); "" when it
        was not read (a cloud URI)."""
        if not self.sample_shape:
            return ""
        if self.format == self.Format.TOKENS:
            return "T tokens"
        unknown = iter("HW")  # an ImageFolder's (C, H, W): height and width come from the job
        return " × ".join(str(n) if n is not None else next(unknown, "?") for n in self.sample_shape)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="dataset_unique_name")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class CodeArchive(models.Model):
    """A user's code, normalized to one deterministic ``.tar.gz`` and stored once by its SHA-256.

    Content-addressed and shared, so not owned: the same files uploaded by two users are one row and
    one file. A user sees an archive only through the models and jobs of theirs that use it. Written by
    :func:`jobs.code_archives.store`; the file lies at :attr:`path` (docs/user-code.md "Code archives").
    """

    sha256 = models.CharField(max_length=64, unique=True, help_text="Hex SHA-256 of the normalized .tar.gz.")
    size_bytes = models.PositiveBigIntegerField(help_text="Size of the normalized .tar.gz, bytes.")
    file_count = models.PositiveIntegerField(help_text="Regular files in the archive.")
    files = models.JSONField(
        default=list, blank=True,
        help_text="Member paths, sorted; at most the first 2,000 (TRAINBOARD_CODE_MAX_FILES' default).")
    requirements = models.TextField(blank=True, help_text="Text of the archive's top-level requirements.txt.")
    created_at = models.DateTimeField(auto_now_add=True)

    FILES_KEPT = 2000
    """How many member paths :attr:`files` keeps (the rest are counted in :attr:`file_count`)."""

    class Meta:
        ordering = ["-created_at", "id"]
        verbose_name = "code archive"

    def __str__(self) -> str:
        return self.sha256[:12]

    @property
    def short_sha(self) -> str:
        """The first 12 hex digits of the hash, as the pages show it."""
        return self.sha256[:12]

    @property
    def path(self) -> Path:
        """Where the archive lies: ``<TRAINBOARD_CODE_STORE>/<sha[:2]>/<sha>.tar.gz``."""
        return Path(settings.TRAINBOARD_CODE_STORE) / self.sha256[:2] / f"{self.sha256}.tar.gz"


class ModelSpec(Owned):
    """A model to train: a built-in architecture from the trainer's registry with validated
    parameters, a user's model function in a code archive (``kind`` code), or a user's training
    script in one (``kind`` script)."""

    class Kind(models.TextChoices):
        BUILTIN = "builtin", "Built-in architecture"
        CODE = "code", "My model, Trainboard's trainer"
        SCRIPT = "script", "My training script"

    name = models.SlugField(max_length=100, help_text="Short name, unique per owner, e.g. digits-cnn.")
    description = models.TextField(blank=True)
    kind = models.CharField(max_length=10, choices=Kind.choices, default=Kind.BUILTIN)
    architecture = models.CharField(
        max_length=50, blank=True,
        help_text="Built-in: mlp, cnn or resnet. Kind code: custom (the trainer's name for a user's "
                  "model). Kind script: blank.")
    params = models.JSONField(
        default=dict, blank=True,
        help_text="Built-in: architecture parameters; kind code: the model function's keyword arguments (JSON).")
    code = models.ForeignKey(
        CodeArchive, null=True, blank=True, on_delete=models.PROTECT, related_name="model_specs",
        help_text="The archive holding the model function or the script (kinds code and script).")
    entry_point = models.CharField(
        max_length=300, blank=True,
        help_text="Kind code: package.module:function returning a torch.nn.Module. Kind script: a file "
                  "in the archive (train.py) or -m package.module.")
    script_args = models.JSONField(default=list, blank=True, help_text="Kind script: its argument list.")
    framework = models.CharField(
        max_length=12, choices=[(f, f) for f in FRAMEWORKS], default="torch",
        help_text="Kind script: how its processes are started: torch (torchrun's variables), tensorflow "
                  "(TF_CONFIG), ray (a Ray cluster over the job's nodes) or mpi (mpirun). Other kinds: torch.")
    shard_classes = models.JSONField(
        default=list, blank=True,
        help_text="Kind code, FSDP: class names sharded one fully_shard each (default: each top-level child).")
    image = models.CharField(
        max_length=500, blank=True, help_text="Container image for this model's jobs; blank = the backend's.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="modelspec_unique_name")]
        ordering = ["name"]
        verbose_name = "model"

    def __str__(self) -> str:
        return self.name


class ComputeBackend(Owned):
    """An admin-managed place to run jobs; ``kind`` picks the adapter from cloud_adapters.registry."""

    name = models.SlugField(max_length=100, help_text="Short name, unique per owner, e.g. local.")
    kind = models.CharField(max_length=30, help_text="Adapter kind, e.g. gpubox.")
    config = models.JSONField(default=dict, blank=True, help_text="Backend settings for the adapter.")
    secrets = EncryptedJSONField(
        help_text="Credentials the adapter needs when the platform identity is not used; encrypted at "
                  "rest, never rendered back.",
    )
    job_secrets = EncryptedJSONField(
        help_text="Environment variables (name → value) set in this backend's jobs, e.g. API tokens "
                  "the user's code needs; encrypted at rest, never logged or rendered back.",
    )
    enabled = models.BooleanField(default=True)

    class StallPolicy(models.TextChoices):
        WARN = "warn", "Flag the job as stalled"
        CANCEL = "cancel", "Flag and cancel the job"

    class OrphanPolicy(models.TextChoices):
        REPORT = "report", "List on the Orphans page"
        STOP = "stop", "List and stop them"

    state_deadlines = models.JSONField(
        default=dict, blank=True,
        help_text='Seconds a job may stay in each non-terminal state before it is flagged STALLED, e.g. '
                  '{"QUEUED": 600, "SUBMITTING": 300, "PENDING": 3600, "STOPPING": 900}; RUNNING defaults '
                  "to the job's max runtime plus a margin. Missing states use the defaults.",
    )
    stall_policy = models.CharField(max_length=10, choices=StallPolicy.choices, default=StallPolicy.WARN)

    class HangPolicy(models.TextChoices):
        FLAG = "flag", "Flag the job as hung"
        CANCEL = "cancel", "Flag and cancel the job"
        RESTART = "restart", "Flag, stop and restart the job from its last checkpoint"

    hang_policy = models.CharField(
        max_length=10, choices=HangPolicy.choices, default=HangPolicy.FLAG,
        help_text="What a RUNNING job with no new step for its hang deadline gets (jobs.hangs): a flag "
                  "with the last step and each rank's stack; that and a cancel; or that, a stop and a new "
                  "attempt that resumes from the last checkpoint (at most max restarts times, then a cancel).")
    hang_deadline_s = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Seconds with no new step before a RUNNING job is hung; blank = from the job's own step "
                  "time, max(600, 20 × seconds per step, 3 × seconds between records).")

    class IdlePolicy(models.TextChoices):
        OFF = "off", "Do nothing"
        WARN = "warn", "Warn (a note and the job.idle notification)"
        STOP = "stop", "Warn, checkpoint and stop the job"

    idle_policy = models.CharField(
        max_length=10, choices=IdlePolicy.choices, default=IdlePolicy.OFF,
        help_text="What a running job whose GPUs all stay below the idle threshold for the idle minutes gets "
                  "(jobs.idle): nothing, a warning, or a warning and a cancel (the trainer checkpoints on "
                  "SIGTERM). A job without GPU figures (CPU only) is never idle.")
    idle_gpu_util_pct = models.PositiveSmallIntegerField(
        default=10, validators=[MinValueValidator(1), MaxValueValidator(100)],
        help_text="A GPU is idle while its utilisation (NVML, % of time a kernel ran) is below this, 1 to 100.")
    idle_minutes = models.PositiveIntegerField(
        default=30, validators=[MinValueValidator(1), MaxValueValidator(7 * 24 * 60)],
        help_text="Minutes every GPU of a job must stay idle before the idle policy acts, 1 to 10,080 (7 days).")
    # The network preflight (trainer_pkg.preflight, issue 30): measured by every rank before the first
    # step; below the minimum or above the maximum the run stops at once, FAILED with the reason.
    preflight = models.BooleanField(
        default=False,
        help_text="Before a job's first step, every rank measures the all-reduce bus bandwidth and latency and "
                  "each node pair's bandwidth (a few seconds); the figures are on the job page.")
    preflight_min_busbw_gbps = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.001), MaxValueValidator(100_000)],
        help_text="The least all-reduce bus bandwidth (and node pair bandwidth) a job may start with, GB/s "
                  "(0.001 to 100,000); below it the run is stopped before its first step, naming the slow "
                  "node. Blank = no minimum.")
    preflight_max_latency_us = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(10_000_000)],
        help_text="The most a small all-reduce may take, microseconds (1 to 10,000,000); above it the run is "
                  "stopped before its first step. Blank = no maximum.")
    orphan_policy = models.CharField(max_length=10, choices=OrphanPolicy.choices, default=OrphanPolicy.REPORT)
    max_restarts = models.PositiveSmallIntegerField(
        default=DEFAULT_MAX_RESTARTS,
        help_text="How many times a job whose run is lost (a preemption the provider does not restart "
                  "itself, a host that rebooted, a Slurm NODE_FAIL or PREEMPTED) is resubmitted from its "
                  "checkpoint before it ends FAILED, and (hang policy restart) a hung run restarted from it; "
                  "0 = never. A job's own error is never resubmitted.",
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="backend_unique_name")]
        ordering = ["name"]
        verbose_name = "compute backend"

    def __str__(self) -> str:
        return self.name

    @property
    def max_runtime_covers(self) -> str:
        """What a job's max runtime counts on this backend (``Backend.max_runtime_covers`` of its
        adapter: start-up included); the contract's wording when the adapter cannot be loaded."""
        try:
            return registry.backend_class(self.kind).max_runtime_covers
        except BackendError:
            return Backend.max_runtime_covers


class TrainingJob(Owned):
    """One distributed training run. ``config`` is the frozen trainer JobConfig it ran with."""

    name = models.CharField(max_length=200, blank=True)
    dataset = models.ForeignKey(Dataset, on_delete=models.PROTECT, related_name="jobs", null=True, blank=True,
                                help_text="None only for a script that reads its own data (no TRAINBOARD_DATA_DIR).")
    model_spec = models.ForeignKey(ModelSpec, on_delete=models.PROTECT, related_name="jobs")
    backend = models.ForeignKey(ComputeBackend, on_delete=models.PROTECT, related_name="jobs")
    rerun_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="reruns"
    )
    code = models.ForeignKey(
        CodeArchive, null=True, blank=True, on_delete=models.PROTECT, related_name="jobs",
        help_text="The code archive the job ran (a re-run runs the same one); null = Trainboard's trainer only.")
    image = models.CharField(max_length=500, blank=True, help_text="Container image; blank = the backend's.")
    env = models.JSONField(
        default=dict, blank=True, help_text="Non-secret environment variables (name → value) of the job's processes.")
    dataset_fingerprint = models.JSONField(
        null=True, blank=True,
        help_text="What identified the dataset's content when the job was created (sizes, times, "
                  "ETags, generations); null when not taken.")

    # Frozen at creation: the full trainer config plus the cluster shape it asks for.
    config = models.JSONField(help_text="trainer_pkg JobConfig, frozen at creation.")
    strategy = models.CharField(max_length=20, default="ddp")
    nodes = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    procs_per_node = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    instance_type = models.CharField(max_length=100, blank=True)
    spot = models.BooleanField(default=False)
    priority = models.IntegerField(
        default=0, help_text="Higher starts first where a backend queues jobs itself (a GPU box that is full); "
                             "equal priorities start in submission order.")
    wait_reason = models.CharField(
        max_length=500, blank=True,
        help_text="Why a QUEUED job has not started, e.g. \"waiting for 4 GPUs on box-a (2 free)\"; blank = not waiting.")
    allocated_gpus = models.JSONField(
        default=list, blank=True,
        help_text="The GPU indices (or, on a CPU-only box, slot numbers) a GPU box gave this job while it runs; "
                  "[] = none held.")
    max_runtime_s = models.PositiveIntegerField(default=3600, validators=[MinValueValidator(1)])
    budget_usd = models.DecimalField(max_digits=12, decimal_places=4, null=True, blank=True)
    hourly_price_usd = models.DecimalField(
        max_digits=12, decimal_places=6, default=Decimal("0"),
        help_text="Price per instance-hour, frozen at submission.",
    )
    on_demand_price_usd = models.DecimalField(
        max_digits=12, decimal_places=6, null=True, blank=True,
        help_text="On-demand price per instance-hour of the same instance type, frozen at submission: what a "
                  "spot job's saving is measured against (null for jobs created before it was kept: the "
                  "hourly price stands in).",
    )
    estimated_cost_usd = models.DecimalField(max_digits=12, decimal_places=4, default=Decimal("0"))

    # Lifecycle
    state = models.CharField(
        max_length=20, choices=JobStateChoices.choices, default=JobStateChoices.QUEUED, db_index=True
    )
    provider_job_name = models.CharField(max_length=200, blank=True, db_index=True)
    provider_handle = models.JSONField(null=True, blank=True)
    raw_state = models.CharField(max_length=100, blank=True)
    secondary_state = models.CharField(max_length=100, blank=True)
    failure_reason = models.TextField(blank=True)
    status_warning = models.TextField(blank=True)
    submitted_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    first_step_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    last_synced_at = models.DateTimeField(null=True, blank=True)
    state_entered_at = models.DateTimeField(
        null=True, blank=True, help_text="When the job entered its current state (deadlines count from it).")
    stalled_at = models.DateTimeField(null=True, blank=True, db_index=True)
    stalled_reason = models.TextField(blank=True)
    budget_exceeded_at = models.DateTimeField(
        null=True, blank=True, help_text="When the job's cost reached its budget and it was stopped.")
    metric_points_pruned_at = models.DateTimeField(
        null=True, blank=True,
        help_text="When the operator's retention (TRAINBOARD_METRIC_POINTS_RETENTION_DAYS after the job ended) "
                  "removed its step-level metric points; its buckets, per-epoch validation points and final "
                  "values are kept (jobs.metric_retention). Null: every point is kept.")

    # Cost: recomputed from source data at every sync, never incremented.
    billable_seconds = models.FloatField(default=0)
    training_seconds = models.FloatField(
        null=True, blank=True,
        help_text="Run time the provider reports (SageMaker TrainingTimeInSeconds); with spot, billable "
                  "seconds are less and the saving is 1 − billable / training.",
    )
    instance_count = models.PositiveIntegerField(default=1)
    cost_usd = models.DecimalField(max_digits=12, decimal_places=4, default=Decimal("0"))

    # Progress (jobs.progress, issue 30): kept by the sync from the trainer's (or a script's
    # report.progress) records, so the list, the API and /metrics compute % done, time left and the
    # projected cost from these columns alone, never from metric points.
    progress_total_steps = models.PositiveBigIntegerField(
        null=True, blank=True,
        help_text="The steps the run takes, as the trainer (or the script's report.progress) reported; "
                  "null = no known length.")
    progress_step = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Steps done at the newest record read; null until one.")
    progress_at = models.DateTimeField(
        null=True, blank=True, help_text="The trainer's time of that record.")
    progress_steps_per_s = models.FloatField(
        null=True, blank=True,
        help_text="Step rate over the recent records (progress_recent); null until two records differ.")
    progress_recent = models.JSONField(
        default=list, blank=True,
        help_text="[[step, Unix seconds], ...]: the last 8 records of the current run (jobs.progress).")

    # Hang detection (jobs.hangs, issue 30): the launcher's hang records (each rank's stacks), or the
    # recovery sweep's finding that no step arrived for the deadline; cleared by a newer step.
    hung_at = models.DateTimeField(
        null=True, blank=True, db_index=True,
        help_text="When the run was found hung (no new step for its deadline); null = not hung.")
    hang = models.JSONField(
        default=dict, blank=True,
        help_text="What was found (jobs.hangs.hang_after): the last step and its time, the deadline, "
                  "who found it and each rank's stack.")
    hang_restart_at = models.DateTimeField(
        null=True, blank=True,
        help_text="When the backend's hang policy (restart) stopped the hung run to restart it: once the "
                  "provider confirms the stop, the job is resubmitted from its last checkpoint "
                  "(jobs.restarts.hung_run). Null: no restart asked; a user's cancel clears it.")

    # Idle GPUs (jobs.idle, issue 30): the launcher's hardware samples folded into a tracker; the
    # backend's idle policy acts once every GPU stayed below its threshold for its minutes.
    idle = models.JSONField(
        default=dict, blank=True,
        help_text="The idle tracker (jobs.idle.idle_after): per GPU since when it is below the backend's "
                  "threshold, since when all are, the newest sample's time and the idle seconds so far.")
    idle_at = models.DateTimeField(
        null=True, blank=True,
        help_text="When the idle policy found the job idle (the newest sample's time) and warned or stopped "
                  "it; null = not idle, or no policy. A busy sample clears it while the job runs.")
    idle_reason = models.TextField(
        blank=True, help_text="What the idle policy said: the GPUs, the threshold, the minutes and the saving.")
    idle_saved_usd = models.DecimalField(
        max_digits=12, decimal_places=4, null=True, blank=True,
        help_text="What stopping the idle job saves (jobs.idle.saving), USD; null when not idle.")

    # The network preflight's figures (jobs.preflight.from_record, issue 30): what the ranks measured
    # before the first step and, when the run was stopped, why.
    preflight = models.JSONField(
        default=dict, blank=True,
        help_text="The launcher's preflight record (jobs.preflight): bus bandwidth, latency, each size and the "
                  "slowest node pairs, the backend's thresholds, ok and the reason; {} when none ran.")

    # The memory plan before launch (trainer_pkg.memory_plan.MemoryPlan.as_dict) and the trainer's last
    # measurement (rank_memory of its latest epoch or completed record), shown side by side.
    memory_plan = models.JSONField(
        null=True, blank=True,
        help_text="Estimated peak memory per rank by term, with the arithmetic, when the job was created; null "
                  "when no plan could be made (a custom model or script, an unknown sample shape).")
    rank_memory = models.JSONField(
        null=True, blank=True,
        help_text="The trainer's last measured memory per rank (a list indexed by rank of peak_bytes, "
                  "params_bytes, grads_bytes, optimizer_bytes, activations_bytes, device); null until reported.")

    # The experiment workflow (issue 16).
    final_metrics = models.JSONField(
        default=dict, blank=True,
        help_text="The last reported value of each global metric, name → value (None where it was not finite), "
                  "kept by the sync as lines arrive: what the job list shows and sorts by.")
    # Sweeps (docs/sweeps.md): the sweep a trial job belongs to and its Optuna trial number.
    sweep = models.ForeignKey(
        "Sweep", null=True, blank=True, on_delete=models.PROTECT, related_name="jobs",
        help_text="The sweep whose trial this job runs; null = not a sweep's job.")
    trial_number = models.PositiveIntegerField(
        null=True, blank=True, help_text="The Optuna trial number within the sweep (0, 1, ...); unique per sweep.")

    # Lineage (issue 16, docs/clone-continue.md): the job this one was made from ("New job like this",
    # Continue, Fine-tune), and for the last two the job whose checkpoint or weights it starts from.
    cloned_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="clones",
        help_text="The job this one was made from (its settings prefilled the form).")
    source_job = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="derived_jobs",
        help_text="The job whose last checkpoint (continue) or trained weights (fine-tune) this job starts from.")

    class InitMode(models.TextChoices):
        NONE = "", "from scratch"
        CONTINUE = "continue", "continue"
        FINETUNE = "finetune", "fine-tune"

    init_mode = models.CharField(max_length=10, blank=True, default="", choices=InitMode.choices)
    source_checkpoint_epoch = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Continue: the epochs the source's checkpoint had completed when this job was created.")

    # The experiment table (docs/experiments.md): the owner's labels, notes and archive mark.
    tags = models.JSONField(
        default=list, blank=True,
        help_text="Short labels (slugs: lower-case letters, digits, _ . -; at most 20 of 50 characters), "
                  "sorted and without repeats; the job list filters by them (?tag=).")
    notes = models.TextField(blank=True, help_text="The owner's notes on the run (at most 10,000 characters).")
    archived_at = models.DateTimeField(
        null=True, blank=True,
        help_text="When the job was archived: hidden from the default job list and API list; null = not archived.")

    # Where the next log read starts (adapter-defined cursor).
    log_cursor = models.CharField(max_length=500, blank=True)
    attempt = models.PositiveIntegerField(
        default=1, help_text="The run now tracked: 1, then 2, … each time a lost run is resubmitted "
                             "(the earlier ones are its JobAttempt rows).")
    checkpoint_uri = models.CharField(
        max_length=1000, blank=True,
        help_text="Where this attempt's checkpoints go when not the backend's default: a resubmitted "
                  "attempt resumes from the checkpoint directory of the one it replaces.")
    logs_read_at = models.DateTimeField(
        null=True, blank=True,
        help_text="Last sync that read this job's log; unchanged jobs are read least recently read first.")
    trainer_failure_reason = models.TextField(
        blank=True,
        help_text="The reason of the trainer's last ``failed`` record (e.g. \"loss became NaN at step 12\"), "
                  "kept when the sync reads it: metric records are stored as points, not as log lines.")
    checkpoint_epochs_done = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="``epochs_done`` of the trainer's last ``epoch`` record: finished epochs its last checkpoint "
                  "holds. Null: no such record read (a job logged before this field reads its stored log).")
    log_backlog = models.BooleanField(
        default=False,
        help_text="The job ended (its state is the provider's) while its log was not yet read to its end: "
                  "the sync goes on reading it, a bounded part a pass, until it is.")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["owner", "-created_at"], name="job_owner_created"),
            models.Index(fields=["state", "backend"], name="job_state_backend"),
        ]
        constraints = [
            # One job per trial: a fill that crashed after asking never gets a second job for the trial.
            models.UniqueConstraint(fields=["sweep", "trial_number"], name="job_unique_sweep_trial"),
        ]
        verbose_name = "training job"

    def __str__(self) -> str:
        return self.name or f"job-{self.pk}"

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATE_VALUES

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def lineage_text(self) -> str:
        """How the job came to be: ``continued from #12 (checkpoint epoch 3)``, ``fine-tuned from #12``,
        ``cloned from #12``; "" for a job made from scratch (docs/clone-continue.md)."""
        if self.init_mode == self.InitMode.CONTINUE and self.source_job_id:
            epoch = "" if self.source_checkpoint_epoch is None else f" (checkpoint epoch {self.source_checkpoint_epoch})"
            return f"continued from #{self.source_job_id}{epoch}"
        if self.init_mode == self.InitMode.FINETUNE and self.source_job_id:
            return f"fine-tuned from #{self.source_job_id}"
        if self.cloned_from_id:
            return f"cloned from #{self.cloned_from_id}"
        return ""

    MONEY_FIELDS = ("cost_usd", "budget_usd", "estimated_cost_usd", "spot", "training_seconds", "instance_count",
                    "hourly_price_usd", "on_demand_price_usd", "max_runtime_s", "nodes")
    """The columns :attr:`money_places` reads: a list that loads fewer (``.only()``) pays a query per row."""

    @property
    def money_places(self) -> int:
        """Decimals (2 or 4) that show every money figure of the job (cost, budget, estimate, on-demand
        cost, and the uncapped max runtime × nodes × price of its estimate's arithmetic) unrounded, so
        the UI, the API's ``estimate_arithmetic`` and messages show them at one precision
        (:func:`jobs.cost.usd_places`)."""
        runtime = (None if self.hourly_price_usd is None else
                   cost.job_cost_usd(billable_seconds=self.max_runtime_s, instances=self.nodes,
                                hourly_price_usd=self.hourly_price_usd))
        return cost.usd_places(self.cost_usd, self.budget_usd, self.estimated_cost_usd, self.on_demand_cost_usd, runtime)

    @property
    def on_demand_hourly_usd(self) -> Decimal:
        """The on-demand price per instance-hour the job is compared with (frozen at submission;
        the hourly price for a job created before it was kept)."""
        return self.on_demand_price_usd if self.on_demand_price_usd is not None else self.hourly_price_usd

    @property
    def spot_saving(self) -> float | None:
        """Fraction of the on-demand cost spot saved (0.7 = 70 %), ``1 − billable × spot price /
        (training × on-demand price)`` (:func:`jobs.cost.spot_saving`): fewer billed seconds on
        SageMaker, a lower hourly price on Vertex AI and Azure ML. None unless this is a spot job whose
        provider reported its training time."""
        if not self.spot:
            return None
        return cost.spot_saving(billable_seconds=self.billable_seconds, training_seconds=self.training_seconds,
                           hourly_price_usd=self.hourly_price_usd, on_demand_price_usd=self.on_demand_hourly_usd)

    @property
    def on_demand_cost_usd(self) -> Decimal | None:
        """What a spot job would have cost on demand: training seconds × instances × on-demand hourly
        price; None unless this is a spot job whose provider reported its training time."""
        if not self.spot or self.training_seconds is None:
            return None
        return cost.job_cost_usd(billable_seconds=self.training_seconds, instances=self.instance_count,
                            hourly_price_usd=self.on_demand_hourly_usd)

    @property
    def progress(self) -> job_progress.Progress | None:
        """% done, time left and the projected final cost now (:func:`jobs.progress.job_progress`),
        from the job's columns alone (:data:`jobs.progress.READ_FIELDS`); None without a known length."""
        return job_progress.job_progress(self, timezone.now())

    @property
    def duration_s(self) -> float | None:
        """Seconds from start (or submission) to end, or to now while the job is active."""
        begin = self.started_at or self.submitted_at
        if begin is None:
            return None
        return ((self.ended_at or timezone.now()) - begin).total_seconds()


class InstancePrice(models.Model):
    """On-demand list price of one instance type in one region, managed by admins (DESIGN.md §6).

    Seeded from the catalog shipped with the adapters (``manage.py load_prices``), refreshed from a
    provider's price API (``manage.py refresh_prices``) or edited in the admin. Adapters read these
    rows through :class:`jobs.pricing.DatabasePriceCatalog`, which falls back to the shipped catalog
    for rows not here. Prices are not owned by a user: every backend of a provider reads the same ones.
    """

    class Provider(models.TextChoices):
        AWS = "aws", "AWS (SageMaker)"
        GCP = "gcp", "Google Cloud (Vertex AI)"
        AZURE = "azure", "Azure (Azure ML)"
        SLURM = "slurm", "Slurm (internal rate)"
        KUBERNETES = "kubernetes", "Kubernetes (internal rate or node pool)"
        RAY = "ray", "Ray (internal rate per worker-hour)"

    provider = models.CharField(max_length=10, choices=Provider.choices)
    region = models.CharField(max_length=50, help_text="Provider region code, e.g. us-east-1, us-central1, eastus.")
    instance_type = models.CharField(max_length=100, help_text="e.g. ml.g5.xlarge, n1-standard-8, Standard_NC6s_v3.")
    usd_per_hour = models.DecimalField(
        max_digits=12, decimal_places=6, validators=[MinValueValidator(Decimal("0"))],
        help_text="On-demand USD per instance-hour (per accelerator-hour for accelerator rows).",
    )
    usd_per_gpu_hour = models.DecimalField(
        "USD per GPU-hour", max_digits=12, decimal_places=6, default=Decimal("0"),
        validators=[MinValueValidator(Decimal("0"))],
        help_text="Internal rates (slurm, kubernetes, ray): USD per GPU-hour, added to usd_per_hour (the node-hour "
                  "rate) once per GPU a node is given. 0 for the clouds' list prices.")
    source = models.CharField(max_length=500, blank=True, help_text="Where the figure comes from (API, URL, file).")
    as_of = models.DateField(null=True, blank=True, help_text="When the figure was read.")
    confirmed = models.BooleanField(
        default=False, help_text="Checked against the provider's own price list or price API.")
    # GPU facts of the type (cloud_adapters/data/gpus.csv, seeded by load_prices): the memory plan checks a
    # job's peak per rank against gpu_memory_gib. Region-independent; refresh_prices never changes them.
    gpu_model = models.CharField("GPU model", max_length=100, blank=True, help_text="e.g. NVIDIA A10G; blank = none or not known.")
    gpu_count = models.PositiveIntegerField(
        "GPUs", null=True, blank=True,
        help_text="GPUs per instance (Vertex AI accelerator rows: 1 per accelerator); 0 = a CPU-only type; "
                  "empty = not known.")
    gpu_memory_gib = models.FloatField(
        "GPU memory (GiB)", null=True, blank=True, validators=[MinValueValidator(0.0)],
        help_text="Memory of one GPU in GiB (providers' \"GB\" of GPU memory are binary); empty = not known.")
    gpu_source = models.CharField("GPU facts source", max_length=500, blank=True,
                                  help_text="Where the GPU figures come from (the provider's documentation page).")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["provider", "region", "instance_type"],
                                               name="instanceprice_unique_type")]
        ordering = ["provider", "region", "instance_type"]
        verbose_name = "instance price"

    def __str__(self) -> str:
        return f"{self.provider} {self.region} {self.instance_type}: ${self.usd_per_hour.normalize():f}/h"


class OrphanJob(models.Model):
    """A provider job carrying Trainboard's tag with no active job row: it may be billing unseen.

    Written by the orphan reconciler (``jobs.orphans``), listed on the staff Orphans page, stopped on
    request or by the backend's ``orphan_policy``. ``job_id`` is the Trainboard job id the tag names,
    if any (that row may be terminal or gone).
    """

    backend = models.ForeignKey(ComputeBackend, on_delete=models.CASCADE, related_name="orphans")
    provider_job_name = models.CharField(max_length=200)
    job_id = models.BigIntegerField(null=True, blank=True)
    raw_state = models.CharField(max_length=100, blank=True)
    first_seen_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField()
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    stop_requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                          on_delete=models.SET_NULL, related_name="+")
    resolved_at = models.DateTimeField(null=True, blank=True, help_text="When the provider job was last seen ended.")
    note = models.TextField(blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["backend", "provider_job_name"], name="orphan_unique_name")]
        ordering = ["-last_seen_at", "id"]
        verbose_name = "orphan provider job"

    def __str__(self) -> str:
        return f"{self.backend}: {self.provider_job_name}"


class JobEvent(models.Model):
    """One state transition in a job's life, or a note (:attr:`is_note`: blank ``to_state``, the job
    stayed in ``from_state``), in order. The first row, "Created", has a blank ``from_state``."""

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="events")
    from_state = models.CharField(max_length=20, blank=True)
    to_state = models.CharField(max_length=20, blank=True)
    message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        if self.is_note:
            return f"{self.from_state} (note)"
        return f"{self.from_state or '∅'} → {self.to_state}"

    @property
    def is_note(self) -> bool:
        """Whether this records no move: something noted while the job stayed in ``from_state`` (a wait
        reason, a stall; ``to_state`` blank, :func:`jobs.states.note`). Rows written before notes
        existed carry the same state on both sides and read as notes too."""
        return not self.to_state or self.from_state == self.to_state

    @property
    def is_interruption(self) -> bool:
        """Whether this is an interruption (:data:`INTERRUPTION`, RUNNING → PENDING)."""
        return (self.from_state, self.to_state) == INTERRUPTION

    @property
    def is_resubmission(self) -> bool:
        """Whether this is a lost run resubmitted as the next attempt (→ QUEUED, :mod:`jobs.restarts`)."""
        return self.to_state == JobState.QUEUED.value and self.from_state in RESUBMIT_FROM

    @property
    def is_hang_restart(self) -> bool:
        """Whether this is a hung run restarted (STOPPING → QUEUED, :func:`jobs.restarts.hung_run`)."""
        return self.to_state == JobState.QUEUED.value and self.from_state == JobState.STOPPING.value


class MetricPointQuerySet(models.QuerySet):
    def bulk_create(self, objs, *args, **kwargs):
        """Store the points and fold them into their jobs' buckets (:mod:`jobs.metric_buckets`), in
        one transaction: a point is never stored without being counted in its buckets."""
        from django.db import transaction

        from jobs import metric_fold

        with transaction.atomic(using=self.db):
            created = super().bulk_create(objs, *args, **kwargs)
            metric_fold.store(created)
        return created


class MetricPoint(models.Model):
    """One scalar the trainer reported: ``name`` at optimizer ``step`` (and ``rank``, if per rank).

    Names: train_loss, train_accuracy, val_loss, val_accuracy, samples_per_s, lr (global) and
    rank_samples_per_s, rank_step_time_s, rank_data_wait_s, rank_compute_s, rank_sync_wait_s,
    rank_pipeline_stage, rank_stage_layers (with ``rank`` set); wait_for_slowest_s (global); and any
    name a user's script reports with ``trainer_pkg.report.log`` (global; see ``jobs.sync``).

    ``value`` is None where the trainer reported NaN or infinity (a diverged run): the point is kept
    so charts show the gap where it is, never a line drawn over it.
    """

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="metric_points")
    name = models.CharField(max_length=100)
    step = models.PositiveIntegerField()
    epoch = models.PositiveIntegerField(null=True, blank=True)
    rank = models.PositiveIntegerField(null=True, blank=True)
    value = models.FloatField(null=True, blank=True)
    recorded_at = models.DateTimeField()

    objects = MetricPointQuerySet.as_manager()

    class Meta:
        ordering = ["job", "name", "step"]
        indexes = [models.Index(fields=["job", "name", "step"], name="metric_job_name_step")]

    def save(self, *args, **kwargs) -> None:
        """A new point is folded into its buckets as well (:mod:`jobs.metric_buckets`); a stored
        point is not edited (its buckets would not follow)."""
        from django.db import transaction

        from jobs import metric_fold

        if not self._state.adding:
            raise ValueError("a stored MetricPoint is not edited: delete the job's points from a step on instead")
        with transaction.atomic():
            super().save(*args, **kwargs)
            metric_fold.store([self])

    def __str__(self) -> str:
        return f"{self.name}@{self.step}={'not finite' if self.value is None else format(self.value, 'g')}"


class MetricBucket(models.Model):
    """The points of one series (``name``, ``rank``) of a job whose step falls in
    ``[bucket × width, (bucket + 1) × width)``, folded: what a chart of any length draws instead of
    the points themselves (:mod:`jobs.metric_buckets`, which writes them as points are stored).

    ``width`` is one of :data:`jobs.metric_buckets.WIDTHS` (16, 256, ... 16**6 steps): each level
    holds every point, so a range of steps is read at the level that gives at most a chart's worth
    of buckets, and the widest level (one bucket per series for runs under 16.7M steps) is the
    series' summary: its count, last value, min, max and sum. Values are the points' ``value``:
    ``nonfinite`` counts the points that were NaN/inf (stored None), ``min_value``, ``max_value``
    and ``sum_value`` are over the finite ones (None when there are none), ``last_*`` are the point
    with the highest step (the later one stored at equal steps), ``first_nonfinite_step`` the lowest
    step of a non-finite point (the chart's gap), None without one.
    """

    # No index of its own: the key's (job, width, ...) serves every read by job, and a second index on
    # job alone is what PostgreSQL picked for a job its statistics did not know yet (a new job), reading
    # every bucket of the job at every width to keep a chart's few (bench/RESULTS.md, issue 29).
    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="metric_buckets", db_index=False)
    name = models.CharField(max_length=100)
    rank = models.IntegerField(help_text="The rank of a per-rank series; -1 (GLOBAL_RANK) for a global one.")
    width = models.PositiveIntegerField(help_text="Steps per bucket.")
    bucket = models.BigIntegerField(help_text="The bucket's first step is bucket × width.")
    count = models.PositiveIntegerField()
    nonfinite = models.PositiveIntegerField(default=0)
    first_nonfinite_step = models.BigIntegerField(null=True, blank=True)
    min_value = models.FloatField(null=True, blank=True)
    max_value = models.FloatField(null=True, blank=True)
    sum_value = models.FloatField(null=True, blank=True)
    first_step = models.BigIntegerField()
    last_step = models.BigIntegerField()
    last_value = models.FloatField(null=True, blank=True)
    last_epoch = models.PositiveIntegerField(null=True, blank=True)
    first_at = models.DateTimeField()
    last_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "width", "name", "rank", "bucket"],
                                               name="metric_bucket_key")]

    def __str__(self) -> str:
        return f"{self.name}[{self.bucket * self.width}:+{self.width}] n={self.count}"


class FinalMetricValue(models.Model):
    """One numeric entry of a job's :attr:`TrainingJob.final_metrics` (``name`` → its last value) as a
    row, with the job's ``created_at`` beside it: what the job list sorts by a metric through an
    index, where sorting on the JSON reads every visible job (``jobs.job_table.metric_sorted_keys``).

    Kept by the database itself, not by code: on PostgreSQL, triggers on ``jobs_trainingjob``
    (migration 0040, which also filled the rows of the jobs before it) rewrite a job's rows whenever
    ``final_metrics`` (or ``created_at``) changes, whoever writes it (the sync's update, a service, a
    fixture, a COPY). Only JSON numbers a float8 holds are rows: a metric whose last value was not
    finite (JSON null), or that the job never reported, has none and sorts last.
    On SQLite (the demo) the table stays empty and the list sorts on the JSON (triggers would not
    survive SQLite's table rebuilds in later migrations)."""

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="final_metric_values",
                            db_index=False)
    name = models.CharField(max_length=100)
    value = models.FloatField()
    created_at = models.DateTimeField(help_text="The job's created_at: the list's tie order after the value.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "name"], name="final_metric_value_key")]
        # The list's two orders, each with its ties newest first: ascending and descending value.
        indexes = [models.Index(fields=["name", "value", "-created_at", "-job"], name="final_metric_asc"),
                   models.Index(fields=["name", "-value", "-created_at", "-job"], name="final_metric_desc")]

    def __str__(self) -> str:
        return f"{self.name}={self.value} (job {self.job_id})"


class MetricChunk(models.Model):
    """A sealed run of up to :data:`jobs.metric_store.CHUNK_POINTS` points of one series (``name`` at
    ``rank``, -1 for a global series as in :class:`MetricBucket`), in step order, as compact bytes
    (:func:`jobs.metric_store.encode`: steps, epochs and times delta-encoded, values as exact float64,
    a mask of the non-finite points, byte-shuffled and zlib-compressed): a few bytes a point where a
    :class:`MetricPoint` row costs ~150. Written by compaction (a series' oldest rows sealed) and by
    the sync's backlog path; read through :mod:`jobs.metric_store`, never row by row.

    ``first_step`` and ``last_step`` are the lowest and highest step in it (inclusive), ``count`` its
    points; the index ``(job, name, rank, last_step)`` serves range reads (``last_step >= start AND
    first_step <= end``) and the newest chunk of a series."""

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="metric_chunks", db_index=False)
    name = models.CharField(max_length=100)
    rank = models.IntegerField(help_text="The rank of a per-rank series; -1 (GLOBAL_RANK) for a global one.")
    first_step = models.BigIntegerField()
    last_step = models.BigIntegerField()
    count = models.PositiveIntegerField()
    data = models.BinaryField(help_text="The points, encoded by jobs.metric_store.encode.")

    class Meta:
        indexes = [models.Index(fields=["job", "name", "rank", "last_step"], name="metric_chunk_range")]

    def __str__(self) -> str:
        return f"{self.name}[{self.rank}] steps {self.first_step}..{self.last_step} n={self.count}"


class JobAttempt(models.Model):
    """One closed run of a job: an attempt whose run was lost and that Trainboard replaced by the next
    (:mod:`jobs.restarts`). The attempt now running is the job row itself (``TrainingJob.attempt``);
    the job's cost and billable seconds are the sum of these rows and the current attempt's."""

    class Outcome(models.TextChoices):
        LOST = "lost", "Run lost; resubmitted"
        HUNG = "hung", "Run hung; stopped and restarted"

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField(help_text="1 for the first run, then 2, …")
    provider_job_name = models.CharField(max_length=200, blank=True)
    provider_handle = models.JSONField(null=True, blank=True)
    raw_state = models.CharField(max_length=100, blank=True, help_text="The provider's last state of the run.")
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    billable_seconds = models.FloatField(default=0, help_text="Seconds billed for this run (per instance).")
    instance_count = models.PositiveIntegerField(default=1)
    cost_usd = models.DecimalField(max_digits=12, decimal_places=4, default=Decimal("0"))
    outcome = models.CharField(max_length=10, choices=Outcome.choices, default=Outcome.LOST)
    reason = models.TextField(blank=True, help_text="Why the run ended, as the backend said.")
    checkpoint_uri = models.CharField(max_length=1000, blank=True,
                                      help_text="Where its checkpoints were; the next attempt resumed from there.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="attempt_unique_number")]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.number}"


class JobLogLineQuerySet(models.QuerySet):
    def bulk_create(self, objs, *args, **kwargs):
        """Store the lines, each marked :attr:`JobLogLine.is_metric` from its text."""
        objs = list(objs)
        for line in objs:
            line.is_metric = JobLogLine.carries_metric(line.text)
        return super().bulk_create(objs, *args, **kwargs)


class JobLogLine(models.Model):
    """One line of the job's log, numbered from 0 in the order it was read (``seq``).

    A trainer metric record (a line holding ``TRAINBOARD_METRIC {...}``) is not a log line: the sync
    stores it once, as metric points (:mod:`jobs.metric_store`), and gives it no ``seq``, so a job's
    ``seq`` runs 0, 1, 2, … without gaps over the lines a person reads (docs/experiments.md, "The
    full log"). ``is_metric`` marks the records that were stored as lines before that (jobs logged
    by an older Trainboard; set from the text when a line is stored): the log tail and the failure
    reasons read the other lines through the partial index ``logline_text_seq``, and
    ``logline_metric_seq`` (empty for any newer job) tells in one probe whether a job has such rows."""

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="log_lines")
    seq = models.PositiveIntegerField()
    text = models.TextField()
    is_metric = models.BooleanField(default=False)

    objects = JobLogLineQuerySet.as_manager()

    class Meta:
        ordering = ["job", "seq"]
        constraints = [models.UniqueConstraint(fields=["job", "seq"], name="logline_unique_seq")]
        indexes = [models.Index(fields=["job", "seq"], condition=models.Q(is_metric=False), name="logline_text_seq"),
                   models.Index(fields=["job", "seq"], condition=models.Q(is_metric=True), name="logline_metric_seq")]

    @staticmethod
    def carries_metric(text: str) -> bool:
        """Whether ``text`` carries a well-formed trainer record (``trainer_pkg.metrics.parse_metric_line``).
        A malformed one (a record cut by another rank's write) is an ordinary line: no point holds it."""
        from trainer_pkg.metrics import METRIC_PREFIX, parse_metric_line

        return METRIC_PREFIX in text and parse_metric_line(text) is not None

    def save(self, *args, **kwargs) -> None:
        self.is_metric = self.carries_metric(self.text)
        super().save(*args, **kwargs)


class Sweep(Owned):
    """A hyperparameter search: Optuna trials, each run as a normal :class:`TrainingJob` (docs/sweeps.md).

    ``base`` is the job-create payload every trial starts from (the keyword arguments of
    ``jobs.services.training_job_create`` without the owner, ids for dataset/model/backend), and
    ``search_space`` maps dotted config keys (``train.lr``, ``model.params.hidden``) to their
    distributions. The study lives in Optuna's RDB storage in this database, named
    :attr:`study_name`; the trial's job carries ``sweep`` and ``trial_number``.
    """

    class State(models.TextChoices):
        RUNNING = "RUNNING", "Running"
        SUCCEEDED = "SUCCEEDED", "Succeeded"
        CANCELLED = "CANCELLED", "Cancelled"
        FAILED = "FAILED", "Failed"
        BUDGET_REACHED = "BUDGET_REACHED", "Budget reached"

    class Sampler(models.TextChoices):
        GRID = "grid", "Grid (every combination once)"
        RANDOM = "random", "Random"
        TPE = "tpe", "TPE (Bayesian)"

    class Direction(models.TextChoices):
        MAXIMIZE = "maximize", "Maximize"
        MINIMIZE = "minimize", "Minimize"

    class Objective(models.TextChoices):
        FINAL = "final", "Final value"
        BEST = "best", "Best value reported"

    class Pruner(models.TextChoices):
        NONE = "none", "No pruning"
        MEDIAN = "median", "Median pruner"
        SUCCESSIVE_HALVING = "successive_halving", "Successive halving"

    name = models.CharField(max_length=200)
    dataset = models.ForeignKey(Dataset, on_delete=models.PROTECT, related_name="sweeps")
    model_spec = models.ForeignKey(ModelSpec, on_delete=models.PROTECT, related_name="sweeps")
    backend = models.ForeignKey(ComputeBackend, on_delete=models.PROTECT, related_name="sweeps")
    base = models.JSONField(help_text="The job-create payload each trial starts from (validated at creation).")
    search_space = models.JSONField(
        help_text='Dotted config key → distribution, e.g. {"train.lr": {"type": "float", "low": 1e-4, '
                  '"high": 0.1, "log": true}}.')
    sampler = models.CharField(max_length=10, choices=Sampler.choices, default=Sampler.TPE)
    seed = models.PositiveIntegerField(default=0, help_text="The sampler's seed: the same seed asks the same trials.")
    objective_metric = models.CharField(max_length=100, default="val_accuracy")
    direction = models.CharField(max_length=10, choices=Direction.choices, default=Direction.MAXIMIZE)
    objective = models.CharField(
        max_length=10, choices=Objective.choices, default=Objective.FINAL,
        help_text="Which value of the metric a trial is scored by: its last, or its best over the run.")
    max_trials = models.PositiveIntegerField(default=10)
    max_concurrent_trials = models.PositiveIntegerField(default=2)
    budget_usd = models.DecimalField(
        max_digits=12, decimal_places=4, null=True, blank=True,
        help_text="USD for the whole sweep: no trial starts whose estimate would take spend past it.")
    pruner = models.CharField(max_length=20, choices=Pruner.choices, default=Pruner.NONE)
    pruner_startup_trials = models.PositiveIntegerField(
        default=1, help_text="Median pruner: completed trials before any trial is pruned.")
    pruner_warmup_epochs = models.PositiveIntegerField(
        default=0, help_text="Epochs a trial reports before it may be pruned (successive halving: its min resource).")
    trial_estimate_usd = models.DecimalField(
        max_digits=12, decimal_places=4, default=Decimal("0"),
        help_text="One trial's estimated cost (max runtime × nodes × price), taken at creation.")
    state = models.CharField(max_length=20, choices=State.choices, default=State.RUNNING, db_index=True)
    message = models.TextField(blank=True, help_text="Why the sweep ended, or the latest problem.")
    trial_errors = models.JSONField(
        default=list, blank=True,
        help_text='Trials whose job could not be created or ran no objective: [{"trial": n, "message": "..."}].')
    ended_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)

    TERMINAL = (State.SUCCEEDED, State.CANCELLED, State.FAILED, State.BUDGET_REACHED)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.name or f"sweep-{self.pk}"

    @property
    def study_name(self) -> str:
        """The Optuna study's name: ``trainboard-sweep-<id>``."""
        return f"trainboard-sweep-{self.pk}"

    @property
    def is_terminal(self) -> bool:
        return self.state in self.TERMINAL


class JobArtifact(models.Model):
    """One file a job left behind (``cloud_adapters.base.Artifact``), as the dashboard last listed it,
    with its sha256 kept so an unchanged file is never read twice (:mod:`jobs.services.artifacts`).

    A file is unchanged while its ``size_bytes`` and ``modified_at`` are those listed before; then
    ``sha256`` (the provider's where it gives one, else computed once by reading the file) stays."""

    SHA256_SOURCES = (("provider", "provider"), ("computed", "computed"), ("", "not known"))

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="artifacts")
    name = models.CharField(max_length=1024, help_text="Path under the job's artifact root, '/'-separated.")
    kind = models.CharField(max_length=20, help_text="model, metrics, checkpoint, log or output.")
    size_bytes = models.PositiveBigIntegerField(null=True, blank=True, help_text="Bytes; null = not known.")
    modified_at = models.DateTimeField(null=True, blank=True)
    sha256 = models.CharField(max_length=64, blank=True, help_text="Hex; '' = not known (too large to read).")
    sha256_source = models.CharField(max_length=10, blank=True, choices=SHA256_SOURCES)
    listed_at = models.DateTimeField(help_text="When the backend last listed this file.")

    class Meta:
        ordering = ["job", "name"]
        constraints = [models.UniqueConstraint(fields=["job", "name"], name="artifact_unique_name")]

    def __str__(self) -> str:
        return f"{self.job_id}:{self.name}"


class SavedFilter(models.Model):
    """A job-list query saved under a name (docs/experiments.md, "Saved filters"): only the list's own
    parameters (``jobs.job_table.LIST_PARAMS``), already checked, as ``{param: text}``. Private to
    its owner: another user's saved filter is a 404."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=100)
    query = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["owner", "name"]
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="savedfilter_unique_name")]

    def __str__(self) -> str:
        return self.name


class JobListSettings(models.Model):
    """One user's job-list preferences: the extra columns (final metrics and hyperparameter keys,
    ``jobs.job_table``) shown when the URL names none."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                related_name="trainboard_job_list_settings")
    columns = models.JSONField(default=list, blank=True)

    class Meta:
        verbose_name = "job list settings"
        verbose_name_plural = "job list settings"

    def __str__(self) -> str:
        return f"{self.user}: {', '.join(self.columns) or 'default columns'}"


# ---------------------------------------------------------------------------------------------
# Notifications: per-user email choices, webhooks and their delivery log (docs/notifications.md)
# ---------------------------------------------------------------------------------------------

NOTIFICATION_EVENTS: dict[str, str] = {
    "job.started": "Job started (its first step was logged)",
    "job.succeeded": "Job succeeded",
    "job.failed": "Job failed",
    "job.cancelled": "Job cancelled",
    "job.budget_stopped": "Job stopped by its budget",
    "job.stalled": "Job stalled (past its state's deadline)",
    "job.hung": "Job hung (no new step for its hang deadline)",
    "job.idle": "Job idle (its GPUs below the backend's threshold; warned or stopped by its idle policy)",
}
"""Event type name → label, in the order the settings page lists them (jobs.notifications sends them)."""


class NotificationPreference(models.Model):
    """Which events a user is emailed about. No row: none (email is opt-in)."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                related_name="trainboard_notifications")
    email_events = models.JSONField(default=list, blank=True,
                                    help_text="Event names (NOTIFICATION_EVENTS) mailed for the user's own jobs.")
    team_email_events = models.JSONField(
        default=list, blank=True,
        help_text="Event names mailed for other members' jobs of the user's teams.")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.user}: {', '.join(self.email_events) or 'no email'}"


class Webhook(Owned):
    """An HTTP endpoint told about job events: the owner's own jobs, or with ``team`` set, every job
    of that team. ``secret`` signs each delivery (HMAC-SHA256), stored encrypted, never shown again."""

    class Format(models.TextChoices):
        JSON = "json", "JSON"
        SLACK = "slack", "Slack (text and blocks)"

    name = models.CharField(max_length=100, blank=True)
    url = models.CharField(max_length=2000, help_text="http(s) URL that receives a POST per event.")
    secret = EncryptedJSONField(help_text="{'key': signing secret}, encrypted at rest.")
    events = models.JSONField(default=list, help_text="Event names (NOTIFICATION_EVENTS) sent to this URL.")
    format = models.CharField(max_length=10, choices=Format.choices, default=Format.JSON)
    enabled = models.BooleanField(default=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        """Its name; unnamed, ``#<id> (<URL host>)``: the host only, as a URL's path or query may carry a
        token (a Slack incoming webhook's does) and this text lands in page titles, messages and the
        delivery admin."""
        if self.name:
            return self.name
        try:
            host = urllib.parse.urlsplit(str(self.url)).hostname or ""
        except ValueError:  # an unparsable URL (the service refuses one; an old row may hold it)
            host = ""
        return f"#{self.pk} ({host})" if host else f"#{self.pk}"


class WebhookDelivery(models.Model):
    """One event for one webhook: sent by a Celery task, retried with backoff until
    ``delivered_at`` or ``given_up_at``. ``next_attempt_at`` is when it is due (a worker that takes
    it moves it past its own attempt: a lease, so a killed worker's row comes due again)."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    job = models.ForeignKey(TrainingJob, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    delivery_id = models.UUIDField(unique=True, help_text="X-Trainboard-Delivery: receivers deduplicate by it.")
    event = models.CharField(max_length=50)
    payload = models.JSONField(help_text="The body sent (the same bytes at every attempt).")
    attempts = models.JSONField(
        default=list, blank=True,
        help_text="One {at, status_code, error, duration_ms} per attempt, oldest first.")
    attempt_count = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True, db_index=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    given_up_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.event} → {self.webhook_id} ({self.status})"

    @property
    def status(self) -> str:
        """"delivered", "given up" or "pending"."""
        if self.delivered_at:
            return "delivered"
        return "given up" if self.given_up_at else "pending"


class OperationCount(models.Model):
    """A counter shared by every process (web, workers): ``name`` per ``backend``, incremented in the
    database (jobs.counters), read by /metrics. Counts since the row was created; never reset."""

    name = models.CharField(max_length=50)
    backend = models.ForeignKey(ComputeBackend, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    value = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["name", "backend"], name="operation_count_unique",
                                               nulls_distinct=False)]

    def __str__(self) -> str:
        return f"{self.name}[{self.backend_id}] = {self.value}"
