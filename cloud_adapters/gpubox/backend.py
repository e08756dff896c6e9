"""The gpubox backend: runs a job under torchrun on the machine whose Celery worker consumes the
box's own queue, ``gpubox.<backend name>`` (this machine's GPUs, or its CPUs with gloo when it has
none). Several boxes are several backends, each served by the worker on its box
(``manage.py gpubox_worker <name>``; docker-compose.yml's ``gpubox-worker-a``).

Every job lives in a run directory, ``<run_root>/<job_name>/``, and its state lives only there, so it
survives a Celery worker restart and any worker on the machine can describe or cancel any job::

    <run_root>/<job_name>/
        job.json           the trainer config as run (output dirs point into this directory;
                           code.dir at code/ when the job brought an archive)
        tags.json          the JobSpec's tags plus trainboard-job-name (what list_tagged reads)
        trainer.json       sha256 and directory of the trainer snapshot the job runs, and the
                           directory it was made from
        code/              the job's code archive, unpacked (regular files only)
        requirements.txt   the archive's requirements, when it has any
        supervisor.json    supervisor pid, /proc start ticks, start time (Unix seconds)
        torchrun.json      torchrun pid = process-group id, start ticks
        train.log          torchrun's and every rank's stdout + stderr (metric records included)
        supervisor.log     the supervisor's own messages (cancel, SIGKILL escalation, exit code)
        start.lock         flock held while a submit starts the supervisor, and by the supervisor
                           until it has written supervisor.json
        cancel_requested   present once cancel() was called (its mtime is when)
        exit.json          written last and atomically: returncode, started_at, ended_at,
                           cancelled, reason
        output/            model.pt, metrics.jsonl; output/checkpoints/ per-epoch checkpoints
        home/, tmp/        an isolated job's HOME and TMPDIR
        input/             an isolated job's copy of the file train.init_from names
        isolation.json     an isolated job's uid and the directories lent to it (_usercode.lend_dir)

An isolated job (a root worker with a uid pool, :attr:`GpuBoxBackend.isolation`) owns only ``code/``,
``output/``, ``home/`` and ``tmp/`` (mode 0700); the directory itself is ``root:<its gid>`` 0750, so
everything else above is the supervisor's word, which the job can read but not replace
(:func:`_usercode.prepare_isolated_run`; docs/gpu-boxes.md "Isolation").

Beside them, ``<run_root>/.trainers/`` and ``<run_root>/.envs/`` hold the trainer snapshots and the
requirements environments jobs share (:mod:`cloud_adapters.gpubox._usercode`).

A job's processes start from a clean environment (docs/user-code.md "GPU box: clean environment"):
the allowlist of :func:`_usercode.base_environment`, the job's ``env`` and ``secret_env``, the
snapshot and code directory on ``PYTHONPATH`` and torchrun's variables; the job's variables reach
the supervisor through a pipe only, never a file or a command line. They run as a uid of the job's own
(``job_uids``), else as the ``run_as`` user or the worker's; with ``spec.image``, in a ``docker run`` of
the image (:func:`_usercode.container_command`). Each process may allocate its share of the job's
``job_memory_limit`` (``RLIMIT_DATA``).

The box shares its GPUs (docs/gpu-boxes.md): :meth:`GpuBoxBackend.inventory` says which GPUs (or, on
a box without GPUs, which process slots) it hands out (:mod:`cloud_adapters.gpubox.inventory`), the
dashboard allocates them (``jobs.admission``) and passes a job's own as ``JobSpec.devices``, which its
processes receive as ``CUDA_VISIBLE_DEVICES`` (with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, NVML's numbering),
``docker run --gpus '"device=…"'`` for an image, or ``TRAINBOARD_SLOTS`` for slots.

State table (DESIGN.md §4, gpubox row), as :meth:`GpuBoxBackend.describe` reads it from disk:

==========  ===============================================  ==========================
JobState    on disk                                          raw_state
==========  ===============================================  ==========================
PENDING     supervisor alive, no step logged yet             ``spawned``
            (process spawned, rendezvous)
RUNNING     supervisor alive, a ``started``/``step``/        ``running``
            ``epoch`` metric record in train.log
STOPPING    supervisor alive, ``cancel_requested`` present   ``stopping``
            (SIGTERM sent)
SUCCEEDED   exit.json, returncode 0, not cancelled           ``exited 0``
FAILED      exit.json, returncode ≠ 0 (or max runtime);      ``exited N`` / ``max-runtime``
            the requirements did not install (pip's error);  ``requirements failed``
            supervisor gone without exit.json (``lost``);    ``lost``
            the run directory itself gone (its run root
            still there)
CANCELLED   exit.json with ``cancelled`` (stopped by user)   ``cancelled``
==========  ===============================================  ==========================

A supervisor gone without exit.json (the box rebooted, an OOM kill took the process tree) is a lost
run, not the job's own failure: its status has ``lost`` set, and Trainboard may resubmit the job from
its checkpoint (docs/recovery.md); :meth:`GpuBoxBackend.checkpoint_uri` says where that lies. A run
directory removed under the job is not: its checkpoints went with it.

A job whose supervisor is gone without exit.json after a cancel was requested (a stuck supervisor
killed by the escalation below) is CANCELLED, never SUCCEEDED.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping

from cloud_adapters.base import (
    Artifact,
    Backend,
    Capabilities,
    InvalidSpec,
    Inventory,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    MissingDependency,
    ProviderError,
    ProviderJob,
    parse_utc,
    tagged_job_id,
)
from cloud_adapters import packaging, torchrun_log
from cloud_adapters.gpus import GpuFacts
from cloud_adapters.settings import BackendSettings, Setting
from cloud_adapters.gpubox import _proc, _usercode, inventory

# A run directory name: one safe path component, also a valid DNS label and SageMaker-style name.
JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")

MAX_LOG_LINES = 2000  # lines per logs() call
MAX_LOG_BYTES = 4 * 1024 * 1024  # bytes read per logs() call
FAILURE_TAIL_BYTES = 256 * 1024  # how much of the end of train.log failure_reason looks at
STARTUP_GRACE_S = 30.0  # a run dir this young without supervisor.json is still being submitted
START_LOCK_WAIT_S = 30.0  # how long a submit waits for another attempt that is starting the same run
ESCALATE_AFTER_S = 5.0  # on top of the grace period before cancel SIGKILLs the group itself
RUNNING_EVENTS = frozenset({"started", "step", "epoch", "completed"})
MAX_PROCS_PER_NODE = 1024  # the dashboard's ceiling for any backend (jobs.validation.MAX_PROCS_PER_NODE)
MAX_HOURLY_RATE_USD = 100_000.0  # 28 days (the longest max runtime) of it fit the cost column
MAX_GRACE_PERIOD_S = 600.0  # a cancelled job holds the box at most this long before SIGKILL

SETTINGS = BackendSettings(
    backend_label="Local GPU box (torchrun)", provider="gpubox",
    settings=(
        # Host settings: what runs on this machine, where, and how many processes at once are its
        # operator's decision, so the dashboard fills them from the installation's settings
        # (TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE, TRAINBOARD_RUN_ROOT, TRAINBOARD_GPUBOX_PYTHON) or a staff
        # user's backend only. Blank: the visible CUDA GPUs, else os.cpu_count() (at most 1024).
        Setting("max_procs_per_node", "Max processes per node",
                "The most ranks one job may start on this machine; blank = the box's own limit "
                "(TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE, else its GPUs or CPU cores).",
                type=int, host=True, min_value=1, max_value=MAX_PROCS_PER_NODE),
        # The devices the box hands out (cloud_adapters/gpubox/inventory.py) and how many jobs it runs at
        # once are its operator's too (TRAINBOARD_GPUBOX_GPU_IDS, _SLOTS, _MAX_CONCURRENT_JOBS).
        Setting("gpu_ids", "GPUs to hand out",
                "Indices of the GPUs jobs may be given, e.g. 0,1,2,3 (as nvidia-smi -L numbers them); blank = "
                "every GPU NVML finds.", host=True, field=False),
        Setting("slots", "Process slots",
                "On a box without GPUs: how many processes its jobs may run at once in all; blank = "
                "max processes per node.", type=int, host=True, field=False, min_value=1,
                max_value=inventory.MAX_SLOTS),
        Setting("max_concurrent_jobs", "Max concurrent jobs",
                "The most jobs this box runs at once, whatever their size; blank = as many as its GPUs hold.",
                type=int, host=True, field=False, min_value=1, max_value=inventory.MAX_CONCURRENT_JOBS),
        Setting("hourly_rate_usd", "Hourly rate (USD)", "What an hour of this machine costs (0 if free).",
                type=float, min_value=0, default=0.0),
        # The box's GPUs, for the memory plan: set by hand (a box reports none before a job runs on it).
        Setting("gpu_model", "GPU model", "Optional: the box's GPU, e.g. NVIDIA H100 80GB HBM3 (nvidia-smi -L).",
                max_length=100, default=""),
        Setting("gpu_memory_gib", "GPU memory (GiB)",
                "Optional: memory of one GPU in GiB (nvidia-smi's MiB / 1024, e.g. 80); jobs that the memory plan "
                "says cannot fit are refused. Blank or 0 = not known: the plan is shown, never a refusal.",
                type=float, min_value=0, default=0.0),
        Setting("grace_period_s", "Cancel grace period (s)",
                f"Seconds from SIGTERM to SIGKILL when a job is cancelled, 0–{MAX_GRACE_PERIOD_S:g}.",
                type=float, field=False, default=10.0),
        # Required, and checked in clean_config (the installation's value fills it for everyone else).
        Setting("run_root", "Run root", "Absolute path of the directory that holds the run directories.",
                host=True, field=False),
        # Blank: this process's sys.executable.
        Setting("python", "Python interpreter", "Absolute path of the interpreter that has torch.",
                host=True, field=False),
        # How user code runs on the box is its operator's decision too (TRAINBOARD_GPUBOX_PIP_ARGS,
        # TRAINBOARD_GPUBOX_RUN_AS, TRAINBOARD_GPUBOX_ENV_PASSTHROUGH): a job's own requirements.txt
        # may name packages, never pip's options, and no job picks the OS user it runs as.
        Setting("pip_args", "pip options",
                "Options pip gets when it installs a job's requirements, split like a shell line, e.g. "
                "--no-index --find-links /wheels on a box without internet; blank = pip's defaults.",
                host=True, field=False),
        Setting("run_as", "Run jobs as", "OS user whose uid a job's processes run with (the worker must "
                "run as root); blank = the worker's own user.", host=True, field=False),
        Setting("job_uids", "Job uids",
                "The uids a root worker gives jobs, one of its own per job while it runs (and a gid of the same "
                f"number): ranges and uids separated by commas, e.g. 20000-20999; blank = {_usercode.JOB_UIDS_DEFAULT}; "
                f"{_usercode.JOB_UIDS_OFF} = every job runs as the worker's user (for a single user only).",
                host=True, field=False),
        Setting("job_memory_limit", "Job memory limit",
                "The most memory one job may allocate on this box, its ranks together (each rank gets its share as "
                "RLIMIT_DATA), e.g. 8GiB or 512MiB; blank = 80% of the host's memory; none = no limit.",
                host=True, field=False),
        Setting("env_passthrough", "Passed-through variables",
                "Names of the worker's environment variables a job inherits besides PATH, HOME, LANG, "
                "LC_ALL, TZ, TMPDIR, CUDA_VISIBLE_DEVICES and NCCL_*, separated by commas or spaces.",
                host=True, field=False),
        # Which images a job may name is the operator's too: a container runs with the box's GPUs,
        # host network and the run directory, so an arbitrary image from a registry is arbitrary code
        # with those rights (TRAINBOARD_GPUBOX_ALLOWED_IMAGES).
        Setting("allowed_images", "Allowed images",
                "Container images a job may run in, separated by commas or spaces: exact references "
                "(ghcr.io/acme/train:1.2) or prefixes ending in * (ghcr.io/acme/*; * alone: any image); "
                "blank = no job may name an image (jobs run on the host).", host=True, field=False),
    ),
)
"""The settings of a GPU box (:mod:`cloud_adapters.settings`); it stores no credentials."""

@dataclasses.dataclass(frozen=True)
class Isolation:
    """How a box keeps its jobs apart (:attr:`GpuBoxBackend.isolation`): ``isolated`` when each job
    runs as a uid of its own; ``text``, one sentence for the backend page, the job form and the demo."""

    isolated: bool
    text: str


RUNNER_SOCKET_VAR = "TRAINBOARD_GPUBOX_RUNNER_SOCKET"
"""When set, supervisors are started by the box's runner on this Unix socket
(:mod:`cloud_adapters.gpubox.runner`, whose ``SOCKET_VAR`` it is), not as this process's children."""

_REPO_ROOT = Path(__file__).resolve().parents[2]  # holds cloud_adapters/, for the supervisor


def _start_failed(run_dir: Path, started_at: float, exc: Exception) -> ProviderError:
    """Record that the run's supervisor could not be started (directly or by the box's runner) and
    return the error to raise: ``exit.json`` with no return code ends the run FAILED "not started"
    with this reason, and a retry adopts it (:func:`_started`) instead of starting it again."""
    reason = f"could not start the gpubox supervisor: {exc}"
    _proc.write_json_atomic(run_dir / "exit.json", {"returncode": None, "started_at": started_at,
                                                    "ended_at": time.time(), "cancelled": False,
                                                    "reason": reason})
    return ProviderError(reason)


def _reap_when_it_exits(sup: subprocess.Popen) -> None:
    """Wait for a supervisor this process started, in a daemon thread, so that it is reaped as soon
    as it exits: a long-lived worker that submits no further job (the demo's) would otherwise keep it
    ``<defunct>`` until it exits itself. The supervisor still outlives the worker (its own session;
    the thread dies with the worker and init adopts it). The jobs' state never depends on this."""
    threading.Thread(target=sup.wait, name=f"gpubox-reap-{sup.pid}", daemon=True).start()


def visible_gpu_count() -> int:
    """NVIDIA GPUs this process may use, without importing torch.

    Counts ``/dev/nvidia<N>`` device nodes, narrowed by ``CUDA_VISIBLE_DEVICES`` when set ("" or
    "-1" hide every GPU, as in CUDA).
    """
    try:
        devices = [e for e in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", e)]
    except OSError:
        devices = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(devices)
    ids = [v for v in visible.split(",") if v.strip()]
    if not ids or ids[0].strip() == "-1":
        return 0
    return min(len(ids), len(devices))


def _utc(ts: float | None) -> dt.datetime | None:
    return parse_utc(float(ts)) if ts is not None else None


_QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}")
"""A backend name that is a queue name as it stands: Django's SlugField alphabet, its length."""


class GpuBoxBackend(Backend):
    """Runs jobs with torchrun on this machine; see the module docstring for states and layout.

    Settings: :data:`SETTINGS` (``clean_config`` raises :class:`InvalidSpec` naming each setting
    that is malformed); ``run_root``, ``python``, ``max_procs_per_node`` and what the box shares
    (``gpu_ids``, ``slots``, ``max_concurrent_jobs``) are among its host settings.
    """

    kind = "gpubox"
    # The supervisor's deadline runs from its own start, a requirements build included; its stop_group
    # sends SIGTERM, then SIGKILL after the grace period (cloud_adapters/gpubox/supervisor.py).
    max_runtime_covers = (
        "the run from the moment the job starts on the box, so installing the code's requirements, connecting "
        "the processes and loading the data count; at the limit the processes get SIGTERM and, once the cancel "
        "grace period is over, are killed")
    settings = SETTINGS
    dataset_schemes = frozenset({""})
    """Local paths only: the trainer runs on this machine and has no cloud storage client."""
    max_nodes_note = "A GPU box runs a job on one machine; multi-node jobs go to a Slurm or Kubernetes backend."
    queue = "gpubox"
    """The prefix of every box's queue (:meth:`queue_for`); no worker consumes it alone."""

    @classmethod
    def queue_for(cls, name: str, config: Mapping[str, Any]) -> str:
        """``gpubox.<name>``: a box's jobs must be started, synced and cancelled by the worker on
        that box, so each box has a queue of its own (``config`` plays no part).

        ``name`` is the backend row's slug (letters, digits, ``-`` and ``_``), which makes a valid
        Celery queue and routing key as it is; anything else raises ValueError rather than being
        rewritten, because two names rewritten alike would send one box's jobs to another."""
        if not isinstance(name, str) or not _QUEUE_NAME.fullmatch(name):
            raise ValueError(f"A GPU box's name must be a slug (letters, digits, - and _) to name its "
                             f"Celery queue; got {name!r}.")
        return f"{cls.queue}.{name}"

    # -- configuration ----------------------------------------------------------------------

    @classmethod
    def clean_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Every problem at once (:class:`SettingsProblems`): one InvalidSpec whose ``errors`` name
        each setting that is missing or malformed."""
        problems = cls.settings_problems(config)
        defaults = SETTINGS.defaults

        run_root = config.get("run_root")
        with problems.about("run_root"):
            if not isinstance(run_root, (str, os.PathLike)) or not str(run_root):
                raise InvalidSpec("run_root: required; set it to an absolute directory for run directories.")
            if not os.path.isabs(run_root) or "\0" in str(run_root):
                raise InvalidSpec(f"run_root: must be an absolute path, got {str(run_root)!r}.")

        procs = config.get("max_procs_per_node")
        if procs is None:
            procs = min(visible_gpu_count() or os.cpu_count() or 1, MAX_PROCS_PER_NODE)
        with problems.about("max_procs_per_node"):
            if isinstance(procs, bool) or not isinstance(procs, int):
                raise InvalidSpec(f"max_procs_per_node: expected an integer, got {_shown(procs)}.")
            if not 1 <= procs <= MAX_PROCS_PER_NODE:
                raise InvalidSpec(f"max_procs_per_node: must be 1 to {MAX_PROCS_PER_NODE}, got {_shown(procs)}.")

        rate = grace = 0.0
        with problems.about("hourly_rate_usd"):
            rate = _number(config.get("hourly_rate_usd", defaults["hourly_rate_usd"]), "hourly_rate_usd")
            if not 0 <= rate <= MAX_HOURLY_RATE_USD:
                raise InvalidSpec(f"hourly_rate_usd: must be 0 to {MAX_HOURLY_RATE_USD:,g} USD per node-hour, "
                                  f"got {rate:g}.")

        with problems.about("grace_period_s"):
            grace = _number(config.get("grace_period_s", defaults["grace_period_s"]), "grace_period_s")
            if not 0 <= grace <= MAX_GRACE_PERIOD_S:
                raise InvalidSpec(f"grace_period_s: must be 0 to {MAX_GRACE_PERIOD_S:g} seconds, got {grace:g}.")

        gpu_model = config.get("gpu_model") or ""
        with problems.about("gpu_model"):
            if not isinstance(gpu_model, str) or len(gpu_model) > 100:
                raise InvalidSpec(f"gpu_model: expected a GPU's name of at most 100 characters, got {_shown(gpu_model)}.")
        gpu_memory = 0.0
        with problems.about("gpu_memory_gib"):
            gpu_memory = _number(config.get("gpu_memory_gib") or 0.0, "gpu_memory_gib")
            if not 0 <= gpu_memory <= 100_000:
                raise InvalidSpec(f"gpu_memory_gib: must be 0 (not known) to 100,000 GiB, got {gpu_memory:g}.")

        python = config.get("python") or sys.executable
        with problems.about("python"):
            if not isinstance(python, str) or not os.path.isabs(python) or "\0" in python:
                raise InvalidSpec(f"python: must be an absolute interpreter path, got {python!r}.")

        pip_args = config.get("pip_args") or ""
        with problems.about("pip_args"):
            try:
                shlex.split(pip_args)
            except (ValueError, AttributeError) as exc:
                raise InvalidSpec(f"pip_args: cannot be split into pip's options ({exc}); quote each option "
                                  f"as in a shell line, e.g. --no-index --find-links /wheels.") from None

        run_as = config.get("run_as") or ""
        with problems.about("run_as"):
            if not isinstance(run_as, str) or (run_as and not _usercode.USER_NAME_RE.fullmatch(run_as)):
                raise InvalidSpec(f"run_as: expected an OS user name (e.g. trainboard-jobs), got {_shown(run_as)}.")

        job_uids = config.get("job_uids") or ""
        with problems.about("job_uids"):
            if not isinstance(job_uids, str):
                raise InvalidSpec(f"job_uids: expected uid ranges such as {_usercode.JOB_UIDS_DEFAULT}, got "
                                  f"{_shown(job_uids)}.")
            if job_uids.strip() and job_uids.strip().lower() != _usercode.JOB_UIDS_OFF:
                _usercode.parse_uid_pool(job_uids)

        memory_limit = config.get("job_memory_limit") or ""
        with problems.about("job_memory_limit"):
            if not isinstance(memory_limit, str):
                raise InvalidSpec(f"job_memory_limit: expected a size such as 8GiB, got {_shown(memory_limit)}.")
            parse_memory(memory_limit)

        passthrough = config.get("env_passthrough") or ""
        with problems.about("env_passthrough"):
            if not isinstance(passthrough, str):
                raise InvalidSpec(f"env_passthrough: expected variable names separated by commas, got "
                                  f"{_shown(passthrough)}.")
            bad = [n for n in _usercode.passthrough_names(passthrough) if not _usercode.ENV_NAME_RE.fullmatch(n)]
            if bad:
                raise InvalidSpec(f"env_passthrough: {', '.join(map(repr, bad[:5]))} "
                                  f"{'is not a variable name' if len(bad) == 1 else 'are not variable names'}.")
        gpu_ids = config.get("gpu_ids") or ""
        with problems.about("gpu_ids"):
            gpu_ids = ",".join(map(str, inventory.parse_gpu_ids(gpu_ids)))
        limits: dict[str, int | None] = {}
        for key, ceiling in (("slots", inventory.MAX_SLOTS), ("max_concurrent_jobs", inventory.MAX_CONCURRENT_JOBS)):
            value = config.get(key)
            limits[key] = None
            with problems.about(key):
                if value in (None, ""):
                    continue
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidSpec(f"{key}: expected a whole number, got {_shown(value)}.")
                if not 1 <= value <= ceiling:
                    raise InvalidSpec(f"{key}: must be 1 to {ceiling:,} (blank = "
                                      f"{'max processes per node' if key == 'slots' else 'no limit'}), got {_shown(value)}.")
                limits[key] = value
        allowed_images = config.get("allowed_images") or ""
        with problems.about("allowed_images"):
            if not isinstance(allowed_images, str):
                raise InvalidSpec(f"allowed_images: expected image references separated by commas, got "
                                  f"{_shown(allowed_images)}.")
            if (image_problems := _usercode.image_pattern_problems(allowed_images)):
                raise InvalidSpec(image_problems[0])
        problems.raise_if_any()

        return {
            "run_root": os.path.normpath(str(run_root)),
            "max_procs_per_node": procs,
            "hourly_rate_usd": rate,
            "grace_period_s": grace,
            "gpu_model": gpu_model.strip(),
            "gpu_memory_gib": gpu_memory,
            "python": python,
            "pip_args": pip_args,
            "run_as": run_as,
            "job_uids": job_uids.strip(),
            "job_memory_limit": memory_limit.strip(),
            "env_passthrough": passthrough,
            "allowed_images": allowed_images,
            "gpu_ids": gpu_ids,
            "slots": limits["slots"],
            "max_concurrent_jobs": limits["max_concurrent_jobs"],
        }

    def gpus(self, instance_type: str = "") -> GpuFacts | None:
        """The box's GPUs as its backend settings say (``gpu_model``, ``gpu_memory_gib``, set by hand),
        one per rank up to ``max_procs_per_node``; None when ``gpu_memory_gib`` is not set."""
        memory = self.config.get("gpu_memory_gib") or 0.0
        if not memory:
            return None
        return GpuFacts(model=self.config.get("gpu_model") or "GPU", count=self.config["max_procs_per_node"],
                        memory_gib=float(memory), source="set on the backend by its operator")

    allocates_devices = True  # a box has no scheduler: the dashboard shares its GPUs (jobs.admission)

    def inventory(self) -> Inventory:
        """The GPUs (or, on a box without one, the process slots) this box hands out to jobs, and its
        ``max_concurrent_jobs``: ``gpu_ids`` when set, else NVML's GPUs, else ``slots`` or
        ``max_procs_per_node`` (:mod:`cloud_adapters.gpubox.inventory`). Found once per adapter."""
        if getattr(self, "_inventory", None) is None:
            self._inventory = inventory.box_inventory(self.config)
        return self._inventory

    @property
    def run_root(self) -> Path:
        return Path(self.config["run_root"])

    @property
    def isolation(self) -> Isolation:
        """Whether each job runs as a uid of its own (docs/gpu-boxes.md "Isolation"), and what to tell
        people: a root worker with a uid pool whose jobs can reach the interpreter and the run root
        isolates; otherwise jobs share the worker's user (or ``run_as``), and the text says so
        (:data:`_usercode.SHARED_UID_NOTICE`) with the reason. Read from the settings and the
        directories' modes; starts nothing."""
        problem = _usercode.isolation_problem(run_as=self.config.get("run_as") or "",
                                              job_uids=self.config.get("job_uids") or "",
                                              run_root=self.run_root, python=self.config["python"])
        if problem is None:
            pool = self.config.get("job_uids") or _usercode.JOB_UIDS_DEFAULT
            return Isolation(True, f"each job runs as a uid of its own (pool {pool}): it cannot read another job's "
                                   f"files or the dashboard's, nor signal their processes")
        return Isolation(False, f"{_usercode.SHARED_UID_NOTICE} ({problem})")

    def job_memory_limit(self) -> int | None:
        """The most bytes one job may allocate (``job_memory_limit``; blank: 80% of the host's memory),
        or None when the operator set ``none`` or the host's memory cannot be read."""
        text = self.config.get("job_memory_limit") or ""
        if text.strip().lower() == "none":
            return None
        limit = parse_memory(text)
        if limit is None:
            total = host_memory_bytes()
            return int(total * DEFAULT_MEMORY_FRACTION) if total else None
        return limit

    def host_memory(self, ranks: int) -> HostMemory | None:
        """What each of ``ranks`` processes may hold on a box without GPUs (the job's memory limit, or
        the host's memory when there is none, shared by its ranks): what the memory plan checks a job
        against (jobs.services.training_jobs.job_memory_plan). None on a box with GPUs (their memory is
        what counts, :meth:`gpus`) or when the host's memory cannot be read."""
        total = host_memory_bytes()
        if not total or self.config.get("gpu_memory_gib") or visible_gpu_count() or self.config.get("gpu_ids"):
            return None
        return HostMemory(total_bytes=total, job_limit_bytes=self.job_memory_limit(), ranks=max(1, int(ranks)))

    def _uid_pool(self) -> list[int]:
        return _usercode.parse_uid_pool(self.config.get("job_uids") or _usercode.JOB_UIDS_DEFAULT)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            spot=False,
            max_nodes=1,
            max_procs_per_node=self.config["max_procs_per_node"],
            strategies=("ddp", "fsdp", "pipeline"),
        )

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        """The configured ``hourly_rate_usd`` (USD per node-hour); the box has one instance type."""
        return float(self.config["hourly_rate_usd"])

    # -- submit -----------------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Base checks plus the job name, the per-node process arithmetic of this box, and what the
        job brings: its environment variables' names (:data:`RESERVED_ENV` are Trainboard's), the
        image reference, the code archive's hash and path, and a requirements text without pip
        options. What only the box itself can say (Docker, the run user, the archive's bytes) is
        checked by :meth:`submit` on the box."""
        _check_job_name(spec.job_name)
        caps = self.capabilities
        if spec.nodes > caps.max_nodes:  # before the per-node arithmetic, which would not be the point
            raise InvalidSpec(f"{spec.nodes} nodes requested. {self.max_nodes_note}", field="nodes")
        if spec.procs_per_node > caps.max_procs_per_node >= 1 and spec.nodes >= 1:
            raise InvalidSpec(
                f"{spec.nodes} node{'s' if spec.nodes != 1 else ''} × {spec.procs_per_node} processes = {spec.world_size} ranks, but "
                f"this GPU box runs at most {caps.max_procs_per_node} processes per node "
                f"(max_procs_per_node); ask for {caps.max_procs_per_node} or fewer."
            , field="procs_per_node")
        super().validate(spec)
        try:
            box = self.inventory()
        except MissingDependency as exc:  # GPUs it cannot hand out: no job may start here until fixed
            raise InvalidSpec(str(exc)) from None
        if spec.procs_per_node > box.capacity:
            raise InvalidSpec(
                f"{spec.procs_per_node} processes need {box.unit(spec.procs_per_node)} (one per process), but this GPU "
                f"box has {box.unit(box.capacity)} in all ({box.source}), so the job could never start; ask for "
                f"{box.capacity} or fewer processes per node.", field="procs_per_node")
        if spec.devices and (len(spec.devices) != spec.procs_per_node or len(set(spec.devices)) != len(spec.devices)
                             or not set(spec.devices) <= set(box.devices)):
            raise InvalidSpec(
                f"devices {list(spec.devices)[:8]}: a job of {spec.procs_per_node} processes is given "
                f"{box.unit(spec.procs_per_node)}, each once, out of this box's {list(box.devices)[:16]}.")
        if not isinstance(spec.config, Mapping):
            raise InvalidSpec("config: expected a JSON object (the trainer_pkg JobConfig as a dict).")
        if spec.trainer_package_uri and not os.path.isdir(spec.trainer_package_uri):
            raise InvalidSpec(
                f"trainer package {spec.trainer_package_uri!r}: the gpubox runs trainer_pkg from a "
                f"local directory that contains it; leave it empty to use this machine's installation."
            )
        problems = (_usercode.env_problems(spec.env, "env", RESERVED_ENV)
                    + _usercode.env_problems(spec.secret_env, "secret_env", RESERVED_ENV))
        if spec.image and not _usercode.IMAGE_RE.fullmatch(spec.image):
            problems.append(f"image: {spec.image[:80]!r} is not a container image reference "
                            f"(e.g. ghcr.io/org/train:1.2 or pytorch/pytorch@sha256:...).")
        elif spec.image and not _usercode.image_allowed(spec.image, self.config["allowed_images"]):
            allowed = _usercode.image_patterns(self.config["allowed_images"])
            problems.append(
                f"image: this GPU box runs only the images its operator allows, and {spec.image[:80]!r} is not "
                + (f"one of them ({', '.join(allowed[:5])}{' …' if len(allowed) > 5 else ''}); "
                   if allowed else "among them (it allows none); ")
                + "use an allowed image or leave the image empty to run on the host (the operator sets "
                "TRAINBOARD_GPUBOX_ALLOWED_IMAGES).")
        if spec.code is not None:
            if not re.fullmatch(r"[0-9a-f]{64}", str(spec.code.sha256)):
                problems.append(f"code: {str(spec.code.sha256)[:80]!r} is not a SHA-256 (64 lowercase hex digits).")
            if not os.path.isabs(str(spec.code.path)):
                problems.append(f"code: the archive path {str(spec.code.path)[:200]!r} must be absolute (the "
                                f"dashboard's code store on this machine).")
            problems += _usercode.requirements_problems(spec.code.requirements or "")
        if problems:
            raise InvalidSpec(" ".join(problems))

    def submit(self, spec: JobSpec) -> JobHandle:
        """Create ``<run_root>/<job_name>`` and start the supervisor; returns at once.

        What the job brings is put in place first: the trainer package as a content-addressed
        snapshot (``<run_root>/.trainers/<sha16>/``, recorded in ``trainer.json``), the code
        archive unpacked into ``<run_dir>/code/`` (``code.dir`` and ``code.sha256`` of the config
        point at it). A requirements environment is built by the supervisor, in the job's run,
        never here. Raises :class:`InvalidSpec` when the archive's bytes do not hash to
        ``spec.code.sha256``, hold anything but regular files at relative paths or use our names
        (``trainer_pkg/``, ``trainboard_*``), when the job asks for an image and this box has no
        Docker, or when ``run_as`` names no user or the worker is not root.

        Idempotent: a run whose supervisor started (``supervisor.json``, or ``exit.json`` when it
        could not start) is adopted and no second torchrun is started. A run directory without
        either is what an attempt left when its worker died before starting the supervisor: this
        call starts it. Attempts take ``start.lock`` (``flock``) first, and the supervisor holds it
        too until it has recorded itself, so two attempts, or a retry after the first worker died
        just after starting the supervisor, never start two. Raises a transient
        :class:`ProviderError` when another attempt holds the lock for more than 30 s.
        """
        self.validate(spec)
        run_dir = self._run_dir(spec.job_name)
        handle = self._handle(spec.job_name, run_dir)
        if _started(run_dir):
            return handle  # the common retry: adopt without touching anything
        trainer_dir = self._trainer_dir(spec)
        try:
            config = json.loads(json.dumps(dict(spec.config)))  # a deep, JSON-clean copy
        except (TypeError, ValueError) as exc:
            raise InvalidSpec(f"config: not JSON-serialisable ({exc}).") from None
        output = config.setdefault("output", {})
        output["output_dir"] = spec.output_uri or str(run_dir / "output")
        output["checkpoint_dir"] = spec.checkpoint_uri or os.path.join(output["output_dir"], "checkpoints")
        # What runs is the spec's shape; the config records it so the trainer's checks agree.
        parallel = config.setdefault("parallel", {})
        parallel["nodes"] = spec.nodes
        parallel["procs_per_node"] = spec.procs_per_node
        config = packaging.config_with_code(config, spec.code, str(run_dir / "code"))

        # The box's own word, before anything is written: a job it cannot run leaves nothing behind.
        user = _usercode.run_user(self.config["run_as"]) if self.config["run_as"] else None
        if spec.image and (problem := _usercode.docker_problem()):
            raise InvalidSpec(problem)
        code_files = None
        if spec.code is not None:
            code_files = packaging.code_files(spec.code)  # the hash and every member checked
            packaging.refuse_ours(code_files, ())  # a trainer_pkg/ of its own would shadow the snapshot

        try:
            self.run_root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ProviderError(f"cannot create run root {self.run_root}: {exc}") from exc
        trainer = (*_usercode.trainer_snapshot(self.run_root, trainer_dir), trainer_dir)
        try:
            # The worker's own user runs it (no run_as, no uid of its own): nobody else needs to enter
            # it, and a later job of a box made able to isolate must not read it (isolated runs are
            # made root:<their gid> 0750, run_as ones opened to that user, by _start).
            os.mkdir(run_dir, 0o700)
        except FileExistsError:
            pass  # an earlier attempt made it; the lock below decides whether its run started
        except OSError as exc:
            raise ProviderError(f"cannot create run directory {run_dir}: {exc}") from exc
        with _start_lock(run_dir) as lock_fd:
            if _started(run_dir):
                return handle  # another attempt started it while we waited: adopt it
            isolated = False
            if user is None and self.isolation.isolated:
                # A uid of its own (held until the supervisor gives it back at the end); the run root
                # may be entered, not listed, by the jobs; the snapshots and environments only read.
                user, isolated = _usercode.allocate_job_user(self.run_root, spec.job_name, self._uid_pool()), True
                _usercode.seal_shared_runs(self.run_root)
                for path, mode in ((self.run_root, 0o711), (self.run_root / ".trainers", 0o755),
                                   (self.run_root / ".envs", 0o755)):
                    if path.is_dir() and path.stat().st_uid == os.geteuid():
                        os.chmod(path, mode)
            return self._start(spec, run_dir, handle, config, trainer, code_files, user, lock_fd, isolated)

    def _start(self, spec: JobSpec, run_dir: Path, handle: JobHandle, config: dict[str, Any],
               trainer: tuple[str, Path, Path], code_files: list[packaging.Entry] | None,
               user: _usercode.RunUser | None, lock_fd: int, isolated: bool = False) -> JobHandle:
        """Write the run's files and start its supervisor (the caller holds ``start.lock``).
        ``trainer``: the snapshot's SHA-256, its directory, and the directory it was made from;
        ``code_files``: the job's archive, checked (:func:`cloud_adapters.packaging.code_files`);
        ``isolated``: ``user`` is the job's own uid (:func:`_usercode.allocate_job_user`)."""
        trainer_sha, trainer_path, trainer_source = trainer
        code_dir = run_dir / "code"
        if code_files is not None:
            _usercode.write_tree(code_files, code_dir, f"code archive {spec.code.sha256[:16]}")
        if isolated:
            assert user is not None
            _usercode.prepare_isolated_run(run_dir, user)
            self._give_inputs(config, run_dir, user)
        _proc.write_json_atomic(run_dir / "job.json", config)
        tags = {"trainboard-job-name": spec.job_name, **{str(k): str(v) for k, v in spec.tags.items()}}
        _proc.write_json_atomic(run_dir / "tags.json", tags)
        _proc.write_json_atomic(run_dir / "trainer.json", {
            "sha256": trainer_sha, "dir": str(trainer_path), "source": str(trainer_source)})

        # torch-free; imported here, once _trainer_dir has said what to install if the package is missing
        from trainer_pkg.launch import torchrun_command, torchrun_env
        from trainer_pkg.platforms import LAUNCHED_BY_US, LaunchPlan

        runner = user or _usercode.worker_user()
        if user is not None and not isolated:
            # The job writes its outputs, and a script its working directory (code.dir); the rest of
            # the run directory (exit.json, the supervisor's records) stays the worker's, open to
            # run_as for reading (it was made 0700 for the worker's own user).
            os.chmod(run_dir, 0o755)
            output_dir = run_dir / "output"
            output_dir.mkdir(exist_ok=True)
            _proc.chown_tree(output_dir, user.uid, user.gid)
            if code_dir.is_dir():
                _proc.chown_tree(code_dir, user.uid, user.gid)
        base = _usercode.base_environment(os.environ, runner,
                                          _usercode.passthrough_names(self.config["env_passthrough"]))
        if isolated:
            base["TMPDIR"] = str(run_dir / "tmp")  # /tmp is shared with every other job

        # The requirements environment: built by the supervisor before torchrun, once per text.
        requirements = spec.code.requirements if spec.code is not None else ""
        environment = None
        python = self.config["python"] if not spec.image else _usercode.IMAGE_PYTHON
        if requirements.strip():
            env_sha = _usercode.requirements_sha256(requirements, spec.image)
            envs = self.run_root / ".envs"
            envs.mkdir(exist_ok=True)
            env_dir = envs / env_sha[:16]
            req_file = run_dir / "requirements.txt"
            req_file.write_text(requirements, encoding="utf-8")
            pip_args = shlex.split(self.config["pip_args"])
            steps = _usercode.environment_steps(env_dir, python, req_file, pip_args)
            if spec.image:
                # The operator's wheel directories (--find-links /wheels) are seen inside, read-only.
                mounts = [(str(run_dir), True), (str(envs), False)] + [
                    (a, True) for a in pip_args if os.path.isabs(a) and os.path.isdir(a)]
                steps = [_usercode.container_command(spec.image, step, name=f"tb-{spec.job_name}-env{i}",
                                                     user=runner, workdir=str(run_dir), mounts=mounts,
                                                     env_names=(), gpus=False)
                         for i, step in enumerate(steps)]
            environment = {"dir": str(env_dir), "lock": str(envs / f"{env_sha[:16]}.lock"),
                           "marker": str(env_dir / _usercode.ENV_READY_MARKER), "sha256": env_sha,
                           "steps": steps, "env": base}
            python = str(env_dir / "bin" / "python")

        # The command and thread count `trainer_pkg.launch --standalone` uses, so a job gets the same
        # threads here as on any other backend; this supervisor, not the launcher, watches torchrun.
        plan = LaunchPlan(platform="local", nnodes=1, node_rank=0, nproc_per_node=spec.procs_per_node,
                          reason="GPU box")
        job_env = torchrun_env(plan, {**base, **{str(k): str(v) for k, v in spec.env.items()},
                                      **{str(k): str(v) for k, v in spec.secret_env.items()}})
        # The snapshot, not the worker's checkout: what was submitted is what runs.
        job_env["PYTHONPATH"] = os.pathsep.join(
            str(p) for p in (trainer_path, code_dir if spec.code is not None else None) if p)
        job_env["PYTHONUNBUFFERED"] = "1"  # metric lines reach train.log as they are printed
        job_env.update(self._device_env(spec))
        if environment is not None:
            job_env["VIRTUAL_ENV"] = environment["dir"]
            job_env["PATH"] = os.pathsep.join((str(Path(environment["dir"], "bin")), job_env["PATH"]))
        if packaging.code_framework(config) == "mpi":
            # One launcher, which starts the ranks with mpirun (trainer_pkg/frameworks/mpi.py): MPI's
            # ranks cannot be torchrun's. Unmarked, so it logs its plan as a node's launcher does.
            from trainer_pkg.frameworks.mpi import node_command

            command = node_command(str(run_dir / "job.json"), plan, python=python)
            job_env.pop(LAUNCHED_BY_US)
        else:
            command = torchrun_command(str(run_dir / "job.json"), plan, python=python)
        cleanup = None
        if spec.image:
            name = f"tb-{spec.job_name}"
            command = _usercode.container_command(
                spec.image, command, name=name, user=runner, workdir=str(run_dir),
                gpus=self._container_gpus(spec),
                mounts=self._container_mounts(config, run_dir, trainer_path, environment),
                # The image's own PATH, HOME and temporary directory; everything else by name.
                env_names=[k for k in job_env if k not in ("PATH", "HOME", "TMPDIR")] + [_proc.RUN_TAG_VAR])
            cleanup = ["docker", "rm", "--force", name]
            if environment is not None:
                cleanup += [f"{name}-env{i}" for i in range(len(environment["steps"]))]

        # The supervisor's own environment is the clean base and nothing of the job's: a job's
        # variables (LD_PRELOAD, PYTHONSTARTUP ...) must not reach a process that runs as the worker.
        sup_env = dict(base, PYTHONPATH=str(_REPO_ROOT))
        limit = self.job_memory_limit()
        sup_plan = {"env": job_env, "user": user.as_json() if user is not None else None,
                    "memory_limit": {"job_bytes": limit, "per_process_bytes": max(limit // spec.procs_per_node, 1)}
                    if limit else None,
                    "isolation": {"run_root": str(self.run_root), "uid": user.uid} if isolated else None,
                    "environment": environment, "cleanup": cleanup, "in_container": bool(spec.image)}
        sup_command = [
            sys.executable, "-m", "cloud_adapters.gpubox.supervisor",
            "--run-dir", str(run_dir),
            "--grace-period", repr(float(self.config["grace_period_s"])),
            "--max-runtime", str(int(spec.max_runtime_s)),
            "--start-lock-fd", str(lock_fd),
            "--plan-stdin",
            "--",
            *command,
        ]
        started_at = time.time()
        if os.environ.get(RUNNER_SOCKET_VAR):
            return self._start_through_runner(os.environ[RUNNER_SOCKET_VAR], sup_command, sup_env, sup_plan,
                                              run_dir, handle, lock_fd, started_at)
        try:
            with open(run_dir / "supervisor.log", "ab") as errlog:  # a crash trace lands here
                sup = subprocess.Popen(
                    sup_command,
                    stdin=subprocess.PIPE,  # the plan: the job's variables never touch the disk or argv
                    stdout=errlog,
                    stderr=subprocess.STDOUT,
                    cwd=run_dir,
                    env=sup_env,
                    start_new_session=True,  # outlives the worker; the worker's signals don't reach it
                    close_fds=True,
                    pass_fds=(lock_fd,),  # held until it has recorded itself, should this worker die first
                )
        except OSError as exc:
            raise _start_failed(run_dir, started_at, exc) from exc
        try:
            with sup.stdin:
                sup.stdin.write(json.dumps(sup_plan).encode())
        except OSError:
            pass  # the supervisor died at once: it left exit.json, or describe reports it lost
        _proc.write_json_atomic(
            run_dir / "supervisor.json",
            {"pid": sup.pid, "start_ticks": _proc.start_ticks(sup.pid), "started_at": started_at},
        )
        _reap_when_it_exits(sup)
        return handle

    @staticmethod
    def _start_through_runner(socket_path: str, sup_command: list[str], sup_env: dict[str, str],
                              sup_plan: dict[str, Any], run_dir: Path, handle: JobHandle, lock_fd: int,
                              started_at: float) -> JobHandle:
        """Start the supervisor through the box's runner (:mod:`cloud_adapters.gpubox.runner`), so it
        outlives this worker's container: the same command, environment, plan pipe and start lock as
        a direct start. A runner that does not answer raises a transient ProviderError and leaves the
        run unstarted (a retry starts it); one that refuses ends the run like a failed start."""
        # Here, not at the top: ``python -m cloud_adapters.gpubox.runner`` must not find itself imported.
        from cloud_adapters.gpubox import runner as box_runner

        args = list(sup_command[3:])
        at = args.index("--start-lock-fd")
        del args[at:at + 2]  # the runner numbers the lock descriptor it passes on
        read_end, write_end = os.pipe()
        try:
            with open(run_dir / "supervisor.log", "ab") as errlog:
                pid, ticks = box_runner.start_supervisor(socket_path, args=args, env=sup_env, cwd=str(run_dir),
                                                     stdin_fd=read_end, log_fd=errlog.fileno(), lock_fd=lock_fd)
        except box_runner.RunnerError as exc:
            os.close(write_end)
            if not exc.reached:
                raise ProviderError(str(exc), transient=True) from None
            raise _start_failed(run_dir, started_at, exc) from None
        finally:
            os.close(read_end)
        try:
            with os.fdopen(write_end, "wb") as plan_pipe:
                plan_pipe.write(json.dumps(sup_plan).encode())
        except OSError:
            pass  # the supervisor died at once: it left exit.json, or describe reports it lost
        _proc.write_json_atomic(run_dir / "supervisor.json", {"pid": pid, "start_ticks": ticks,
                                                              "started_at": started_at})
        return handle

    def _give_inputs(self, config: dict[str, Any], run_dir: Path, user: _usercode.RunUser) -> None:
        """What an isolated job reads or writes outside its run directory, made its own: the file
        ``train.init_from`` names (a source job's checkpoint or model.pt, in its run directory, which
        this job's uid may not enter) copied to ``<run_dir>/input/`` and the config pointed at the
        copy; an output or checkpoint directory in another run directory of this run root (a lost
        attempt's checkpoints, resumed) lent to the job's uid (:func:`_usercode.lend_dir`), listed in
        ``isolation.json`` for the uid's release to give back. ``config`` is changed in place."""
        train = config.get("train") or {}
        init_from = str(train.get("init_from") or "")
        if (os.path.isabs(init_from) and os.path.isfile(init_from) and not os.path.islink(init_from)
                and not Path(init_from).is_relative_to(run_dir)):
            inputs = run_dir / "input"
            inputs.mkdir(mode=0o750, exist_ok=True)
            os.chown(inputs, 0, user.gid)
            copy = inputs / Path(init_from).name
            shutil.copyfile(init_from, copy, follow_symlinks=False)
            os.chown(copy, 0, user.gid)
            os.chmod(copy, 0o640)
            train["init_from"] = str(copy)
        output = config.get("output") or {}
        lent: list[str] = []
        for key in ("output_dir", "checkpoint_dir"):
            path = os.path.normpath(str(output.get(key) or "."))
            if (os.path.isabs(path) and Path(path).is_relative_to(self.run_root) and not Path(path).is_relative_to(run_dir)
                    and os.path.isdir(path) and path not in lent):
                lent.append(path)
        # Recorded first: whoever gives the uid back (_usercode.release_job_user) takes them back too.
        _proc.write_json_atomic(run_dir / _usercode.ISOLATION_RECORD, {"uid": user.uid, "lent": lent})
        for path in lent:
            _usercode.lend_dir(self.run_root, Path(path), user)

    def _device_env(self, spec: JobSpec) -> dict[str, str]:
        """The variables that give the job its allocated devices (``spec.devices``; {} when none
        were allocated). GPUs: ``CUDA_VISIBLE_DEVICES`` of their indices and ``CUDA_DEVICE_ORDER=
        PCI_BUS_ID`` (NVML's numbering; in a container, which sees only its GPUs, numbered from 0,
        the first ones); slots: ``TRAINBOARD_SLOTS``, the slot numbers. Each rank's ``LOCAL_RANK``
        picks its GPU among the visible ones, so rank i runs on the i-th allocated GPU."""
        if not spec.devices:
            return {}
        box = self.inventory()
        listed = ",".join(map(str, spec.devices))
        if box.kind != "gpu":
            return {"TRAINBOARD_SLOTS": listed}
        if spec.image:
            listed = ",".join(str(i) for i in range(len(spec.devices)))
        return {"CUDA_VISIBLE_DEVICES": listed, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def _container_gpus(self, spec: JobSpec) -> tuple[int, ...] | bool:
        """What ``docker run --gpus`` gets: the allocated GPU indices, or, for a job given none (a
        CPU-only box, or submitted without an allocation), every GPU when the box has any."""
        if spec.devices:
            return tuple(spec.devices) if self.inventory().kind == "gpu" else False
        return visible_gpu_count() > 0

    @staticmethod
    def _container_mounts(config: Mapping[str, Any], run_dir: Path, trainer_path: Path,
                          environment: Mapping[str, Any] | None) -> list[tuple[str, bool]]:
        """``(host path, read_only)`` a job's container sees at the same paths: the run directory,
        the trainer snapshot, the requirements environment, a local dataset, output or checkpoint
        directories outside the run directory, and the file ``train.init_from`` names (read-only)."""
        mounts = [(str(run_dir), False), (str(trainer_path), True)]
        if environment is not None:
            mounts.append((environment["dir"], True))
        data_uri = str((config.get("data") or {}).get("uri") or "")
        if os.path.isabs(data_uri) and os.path.exists(data_uri):
            mounts.append((os.path.normpath(data_uri), True))
        output = config.get("output") or {}
        for key in ("output_dir", "checkpoint_dir"):
            path = str(output.get(key) or "")
            if os.path.isabs(path) and not Path(path).is_relative_to(run_dir):
                mounts.append((os.path.normpath(path), False))
        # A continued or fine-tuned job reads its source's checkpoint or model.pt in place (read-only;
        # the file itself, never a symbolic link: docs/clone-continue.md).
        init_from = str((config.get("train") or {}).get("init_from") or "")
        if os.path.isabs(init_from) and os.path.isfile(init_from) and not os.path.islink(init_from):
            mounts.append((os.path.normpath(init_from), True))
        return mounts

    # -- describe ---------------------------------------------------------------------------

    def describe(self, handle: JobHandle) -> JobStatus:
        """The job's state, read from its run directory only (see the module's state table).

        A run directory that is gone while the run root that held it is still there was removed
        under the job: FAILED ("run directory lost"), that job alone. A run root that is gone too
        (an unmounted disk, another machine) raises a transient :class:`ProviderError`: no job is
        judged until it is back.
        """
        run_dir = self._handle_dir(handle)
        if not run_dir.is_dir():
            self._check_run_root(run_dir)
            return JobStatus(JobState.FAILED, raw_state="lost", failure_reason=(
                f"run directory lost: {run_dir} no longer exists (removed while the job was active); "
                f"its log and outputs are gone. Re-run the job."))
        sup = _proc.read_json(run_dir / "supervisor.json") or {}
        exit_info = _proc.read_json(run_dir / "exit.json")
        if exit_info is None and not _proc.is_alive(sup.get("pid"), sup.get("start_ticks")):
            exit_info = _proc.read_json(run_dir / "exit.json")  # it may have exited just now
        started = sup.get("started_at") or (exit_info or {}).get("started_at")
        started_at = _utc(started)

        if exit_info is not None:
            ended = exit_info.get("ended_at") or time.time()
            billable = max(0.0, ended - started) if started else None
            common = dict(started_at=started_at, ended_at=_utc(ended), billable_seconds=billable,
                          instance_count=1)
            code = exit_info.get("returncode")
            if exit_info.get("cancelled"):
                return JobStatus(JobState.CANCELLED, raw_state="cancelled",
                                 failure_reason=exit_info.get("reason") or "stopped by user", **common)
            # A supervisor from a release without the max_runtime flag marks the stop by this prefix
            # only, and a run it started may end after an upgrade.
            if exit_info.get("max_runtime") or str(exit_info.get("reason", "")).startswith("MaxRuntimeExceeded"):
                return JobStatus(JobState.FAILED, raw_state="max-runtime",
                                 failure_reason=exit_info["reason"], **common)
            if exit_info.get("stage") == "requirements":  # pip's own error, not a rank's
                return JobStatus(JobState.FAILED, raw_state="requirements failed",
                                 failure_reason=exit_info.get("reason") or "installing the requirements failed",
                                 **common)
            if code == 0:
                return JobStatus(JobState.SUCCEEDED, raw_state="exited 0", **common)
            reason = _failure_reason(run_dir / "train.log", code) if code is not None else ""
            limit = exit_info.get("memory_limit") or {}
            if reason and limit.get("job_bytes") and _out_of_memory(run_dir / "train.log"):
                reason = (f"the job exceeded its {_gib(limit['job_bytes'])} memory limit ({_gib(limit['per_process_bytes'])}"
                          f" per process; the box's TRAINBOARD_GPUBOX_JOB_MEMORY_LIMIT): {reason}")
            return JobStatus(JobState.FAILED,
                             raw_state=f"exited {code}" if code is not None else "not started",
                             failure_reason=reason or exit_info.get("reason") or f"exit code {code}",
                             **common)

        now = time.time()
        running_common = dict(started_at=started_at,
                              billable_seconds=max(0.0, now - started) if started else None,
                              instance_count=1)
        cancel_at = _mtime(run_dir / "cancel_requested")
        if cancel_at is not None:
            self._escalate(run_dir, cancel_at)

        if not sup:
            age = now - (_mtime(run_dir) or now)
            if age < STARTUP_GRACE_S:
                return JobStatus(JobState.PENDING, raw_state="submitting",
                                 secondary_state="run directory created", **running_common)
            return self._lost(run_dir, started_at, cancel_at,
                              "supervisor never started (the submitting worker died mid-submit)")

        if _proc.is_alive(sup.get("pid"), sup.get("start_ticks")):
            if cancel_at is not None:
                return JobStatus(JobState.STOPPING, raw_state="stopping",
                                 secondary_state="SIGTERM sent", **running_common)
            if _first_step_logged(run_dir / "train.log"):
                return JobStatus(JobState.RUNNING, raw_state="running",
                                 secondary_state="first step logged", **running_common)
            return JobStatus(JobState.PENDING, raw_state="spawned",
                             secondary_state="process spawned, rendezvous", **running_common)

        return self._lost(run_dir, started_at, cancel_at, "supervisor process disappeared")

    def _lost(self, run_dir: Path, started_at: dt.datetime | None, cancel_at: float | None,
              reason: str) -> JobStatus:
        """Terminal status for a job nobody supervises any more; kills ranks it left behind."""
        self._kill_job(run_dir)  # a job reported over must not keep the GPUs busy
        ended = _mtime(run_dir / "train.log") or _mtime(run_dir) or time.time()
        billable = max(0.0, ended - started_at.timestamp()) if started_at else None
        common = dict(started_at=started_at, ended_at=_utc(ended), billable_seconds=billable,
                      instance_count=1)
        if cancel_at is not None:
            return JobStatus(JobState.CANCELLED, raw_state="cancelled",
                             failure_reason=f"stopped by user ({reason})", **common)
        # Nobody wrote exit.json: the run was killed from outside (a reboot, the OOM killer), not
        # ended by the job's own error, which the supervisor would have recorded.
        return JobStatus(JobState.FAILED, raw_state="lost", failure_reason=reason, lost=True, **common)

    # -- orphans ----------------------------------------------------------------------------

    def list_tagged(self) -> list[ProviderJob]:
        """Run directories under ``run_root`` that carry Trainboard's tag (a ``tags.json`` naming
        ``trainboard-job-name`` = the directory's name) and whose job has not ended.

        No remote call: one directory scan, and per tagged directory the files :meth:`describe`
        reads. Directories without ``tags.json`` (not made by :meth:`submit`) are left out.
        """
        try:
            entries = sorted(self.run_root.iterdir())
        except FileNotFoundError:
            return []
        found: list[ProviderJob] = []
        for run_dir in entries:
            if not run_dir.is_dir() or not JOB_NAME_RE.fullmatch(run_dir.name):
                continue
            tags = _proc.read_json(run_dir / "tags.json")
            if not isinstance(tags, dict) or tags.get("trainboard-job-name") != run_dir.name:
                continue
            handle = self._handle(run_dir.name, run_dir)
            try:
                status = self.describe(handle)
            except ProviderError:
                continue  # removed while we looked
            if status.state.is_terminal:
                continue
            found.append(ProviderJob(name=run_dir.name, state=status.state, raw_state=status.raw_state,
                                     job_id=tagged_job_id(tags), created_at=_utc(_mtime(run_dir)),
                                     handle=handle))
        return found

    # -- cancel -----------------------------------------------------------------------------

    def cancel(self, handle: JobHandle) -> None:
        """Record the request, SIGTERM the supervisor; idempotent and returns at once.

        If the request is older than ``grace_period_s`` + 5 s and the job still runs (a stuck
        supervisor), SIGKILL its torchrun group and the supervisor directly.
        """
        run_dir = self._handle_dir(handle)
        if not run_dir.is_dir():
            self._check_run_root(run_dir)
            return  # the run directory is lost (describe reports it FAILED): nothing left to stop
        if (run_dir / "exit.json").exists():
            return  # already over: nothing to stop
        marker = run_dir / "cancel_requested"
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.write(fd, f"{time.time()}\n".encode())
            os.close(fd)
        except FileExistsError:
            pass  # first request's time is kept: escalation counts from it
        sup = _proc.read_json(run_dir / "supervisor.json") or {}
        if sup.get("pid"):
            _proc.signal_pid(int(sup["pid"]), sup.get("start_ticks"), signal.SIGTERM)
        self._escalate(run_dir, _mtime(marker))

    def _escalate(self, run_dir: Path, cancel_at: float | None) -> None:
        if cancel_at is None or (run_dir / "exit.json").exists():
            return
        if time.time() - cancel_at < float(self.config["grace_period_s"]) + ESCALATE_AFTER_S:
            return
        sup = _proc.read_json(run_dir / "supervisor.json") or {}
        self._kill_job(run_dir)
        # The supervisor had grace + 5 s to stop the job and write exit.json: it is stuck. Once it
        # is gone, describe() reports the job CANCELLED (cancel was requested).
        if sup.get("pid") and not (run_dir / "exit.json").exists():
            _proc.signal_pid(int(sup["pid"]), sup.get("start_ticks"), signal.SIGKILL)

    @staticmethod
    def _kill_job(run_dir: Path) -> None:
        """SIGKILL torchrun's process group and every rank of the job (an unsupervised remnant)."""
        tr = _proc.read_json(run_dir / "torchrun.json") or {}
        if tr.get("pgid") and _group_is_ours(tr):
            _proc.kill_group(int(tr["pgid"]), signal.SIGKILL)
        _proc.signal_job(str(run_dir), signal.SIGKILL)

    # -- logs -------------------------------------------------------------------------------

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        """Complete lines of ``train.log`` from byte offset ``cursor`` ("" = 0), and the next offset.

        At most 2000 lines per call; a partial last line is left for the next call. Lines are
        decoded as UTF-8 with invalid bytes replaced.
        """
        offset = torchrun_log.byte_cursor(cursor)
        path = self._handle_dir(handle) / "train.log"
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                chunk = fh.read(MAX_LOG_BYTES)
        except FileNotFoundError:
            return [], str(offset)
        return torchrun_log.complete_lines(chunk, offset, max_bytes=MAX_LOG_BYTES, max_lines=MAX_LOG_LINES)

    # -- helpers ----------------------------------------------------------------------------

    # -- artifacts ----------------------------------------------------------------------------

    def _artifact_files(self, handle: JobHandle) -> dict[str, Path]:
        """name → path of every regular file the job left (:class:`Artifact` names): ``output/``'s
        files by their path under it, the checkpoint directory's under ``checkpoints/``, and
        ``train.log`` as ``logs/train.log``. Symbolic links are never followed or listed (a job's
        code could point one at any file of the box)."""
        run_dir = self._handle_dir(handle)
        if not run_dir.is_dir():
            self._check_run_root(run_dir)
            raise ProviderError(f"run directory {run_dir} no longer exists; the job's files are gone")
        output = (_proc.read_json(run_dir / "job.json") or {}).get("output") or {}
        out_dir = Path(output.get("output_dir") or run_dir / "output")
        ckpt_dir = Path(output.get("checkpoint_dir") or out_dir / "checkpoints")
        files: dict[str, Path] = {}

        def walk(root: Path, prefix: str, skip: Path | None = None) -> None:
            if root.is_symlink() or not root.is_dir():
                return
            for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
                here = Path(dirpath)
                dirnames[:] = sorted(d for d in dirnames if not (here / d).is_symlink()
                                     and (skip is None or here / d != skip))
                for filename in filenames:
                    path = here / filename
                    if path.is_symlink() or not path.is_file():
                        continue
                    files[prefix + path.relative_to(root).as_posix()] = path

        walk(out_dir, "", skip=ckpt_dir)
        walk(ckpt_dir, "checkpoints/")
        log_file = run_dir / "train.log"
        if log_file.is_file() and not log_file.is_symlink():
            files["logs/train.log"] = log_file
        return files

    @staticmethod
    def _artifact_kind(name: str) -> str:
        if name.startswith("checkpoints/"):
            return "checkpoint"
        if name.startswith("logs/"):
            return "log"
        if name == "metrics.jsonl":
            return "metrics"
        return "model" if name == "model.pt" else "output"

    def artifacts(self, handle: JobHandle) -> list[Artifact]:
        """The run directory's files (:meth:`_artifact_files`) with their sizes and times, read from
        this machine's disk; sha256 is left to the dashboard (it reads the file once)."""
        found = []
        for name, path in sorted(self._artifact_files(handle).items()):
            try:
                stat = path.stat()
            except OSError:
                continue  # removed while listed
            found.append(Artifact(name=name, kind=self._artifact_kind(name), size_bytes=stat.st_size,
                                  modified_at=_utc(stat.st_mtime)))
        return found

    def open_artifact(self, handle: JobHandle, name: str) -> BinaryIO:
        """The file ``name`` opened for reading (``O_NOFOLLOW``: never a link)."""
        path = self._artifact_files(handle).get(name)
        if path is None:
            raise InvalidSpec(f"job {handle.job_name} has no artifact {name!r}")
        try:
            return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")
        except OSError as exc:
            raise ProviderError(f"cannot read {path}: {exc.strerror or exc}") from exc

    def artifact_uri(self, handle: JobHandle, name: str) -> str:
        """The artifact's absolute path on this box: a later job on the same box reads it in place."""
        path = self._artifact_files(handle).get(name)
        return str(path) if path is not None else ""

    def checkpoint_uri(self, handle: JobHandle) -> str:
        """The run's own checkpoint directory on this box, ``<run_dir>/output/checkpoints`` (where
        submit puts it for a job given none), for a later attempt to resume from in place. The place
        is the adapter's, never read back from a file the job could rewrite (a path there would become
        a container's read-write mount). "" when the run directory is gone, or when any directory of
        that path is a symbolic link (the job made it: a later job must never be pointed through it)."""
        run_dir = self._handle_dir(handle)
        here = run_dir
        for part in ("", "output", "checkpoints"):
            here = here / part if part else here
            if here.is_symlink() or not here.is_dir():
                return ""
        return str(run_dir / "output" / "checkpoints")

    def _run_dir(self, job_name: str) -> Path:
        _check_job_name(job_name)
        return self.run_root / job_name

    @staticmethod
    def _check_run_root(run_dir: Path) -> None:
        """Raise a transient ProviderError when the run root that holds ``run_dir`` is missing."""
        if not run_dir.parent.is_dir():
            raise ProviderError(
                f"run root {run_dir.parent} not found on this machine: is its disk mounted, and does this "
                f"worker run on the GPU box the job was submitted to? Its jobs keep their state until it is back.",
                transient=True)

    def _handle(self, job_name: str, run_dir: Path) -> JobHandle:
        return JobHandle(provider=self.kind, job_name=job_name, provider_job_id=str(run_dir))

    def _handle_dir(self, handle: JobHandle) -> Path:
        _check_job_name(handle.job_name)
        if handle.provider_job_id:
            path = Path(handle.provider_job_id)
            if not path.is_absolute() or path.name != handle.job_name:
                raise InvalidSpec(f"handle {handle.provider_job_id!r} is not a gpubox run directory.")
            return path
        return self.run_root / handle.job_name

    def _trainer_dir(self, spec: JobSpec) -> Path:
        """The directory that contains ``trainer_pkg`` (found without importing torch)."""
        if spec.trainer_package_uri:
            return Path(spec.trainer_package_uri).resolve()
        found = importlib.util.find_spec("trainer_pkg")
        if found is None or not found.submodule_search_locations:
            raise MissingDependency(
                "trainer_pkg is not importable on this gpubox worker; install it with "
                "`pip install -e trainer_pkg` or run the worker from the repository root."
            )
        return Path(list(found.submodule_search_locations)[0]).resolve().parent


RESERVED_ENV = frozenset({
    _proc.RUN_TAG_VAR, "PYTHONPATH", "TRAINBOARD_LAUNCH_PLATFORM", "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TRAINBOARD_SLOTS",
})
"""Variables a job's ``env``/``secret_env`` may not set: the supervisor finds the job's processes by
the first, the trainer snapshot and the code directory are on PYTHONPATH, torchrun sets most of the
rest, and the allocation sets the devices a job sees (:meth:`GpuBoxBackend._device_env`)."""


DEFAULT_MEMORY_FRACTION = 0.8
"""A job's memory limit when the operator sets none: this share of the host's memory."""
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?", re.IGNORECASE)


def parse_memory(text: str) -> int | None:
    """Bytes of a size such as ``8GiB``, ``512MiB``, ``16G`` or ``1.5 TiB`` (K, M, G, T: powers of
    1024; a bare number is bytes); None for blank or ``none``. Raises InvalidSpec for anything else or
    a size under 64 MiB (no job's interpreter starts in less)."""
    text = (text or "").strip()
    if not text or text.lower() == "none":
        return None
    match = _SIZE.fullmatch(text)
    if not match:
        raise InvalidSpec(f"job_memory_limit: {text[:40]!r} is not a size such as 8GiB or 512MiB (or none).")
    unit = (match.group(2) or "B").upper()[:1]
    size = int(float(match.group(1)) * 1024 ** "BKMGT".index(unit))
    if size < 64 * 2**20:
        raise InvalidSpec(f"job_memory_limit: {text!r} is under 64 MiB, too little for any job.")
    return size


def host_memory_bytes() -> int | None:
    """The host's memory (``MemTotal`` of ``/proc/meminfo``) in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """The memory of a box without GPUs, as a job's ranks may use it (:meth:`GpuBoxBackend.host_memory`)."""

    total_bytes: int
    job_limit_bytes: int | None  # the job's limit (job_memory_limit); None: none
    ranks: int

    @property
    def per_rank_bytes(self) -> int:
        """What one rank may hold: its share of the job's limit, or of the host's memory without one."""
        return (self.job_limit_bytes or self.total_bytes) // self.ranks

    def describe(self) -> str:
        """``"no GPU; 23.4 GiB of host memory, a job may use 18.7 GiB (job_memory_limit): 9.36 GiB per rank for 2
        ranks"``."""
        limit = (f"a job may use {_gib(self.job_limit_bytes)} (its memory limit)" if self.job_limit_bytes
                 else "no memory limit")
        return (f"no GPU; {_gib(self.total_bytes)} of host memory, {limit}: {_gib(self.per_rank_bytes)} per rank "
                f"for {self.ranks} rank{'s' if self.ranks != 1 else ''}")


_OUT_OF_MEMORY = (b"MemoryError", b"can't allocate memory", b"Cannot allocate memory", b"std::bad_alloc")


def _out_of_memory(log_path: Path) -> bool:
    """Whether the end of ``train.log`` shows an allocation the memory limit refused."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - FAILURE_TAIL_BYTES))
            tail = fh.read()
    except OSError:
        return False
    return any(marker in tail for marker in _OUT_OF_MEMORY)


def _shown(value: Any) -> str:
    """``value`` for a message: an integer of hundreds of digits (10**400) is named by its size."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:8]}… ({len(text)} characters)"


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSpec(f"{field}: expected a number, got {_shown(value)}.")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf
    if not math.isfinite(number):
        raise InvalidSpec(f"{field}: expected a finite number, got {_shown(value)}.")
    return number


def _check_job_name(name: str) -> None:
    if not isinstance(name, str) or not JOB_NAME_RE.fullmatch(name):
        raise InvalidSpec(
            f"job name {name!r}: must be 1–63 letters, digits or '-', starting with a letter or "
            f"digit (it names the run directory)."
        )


def _started(run_dir: Path) -> bool:
    """True once a supervisor recorded itself in ``run_dir`` or the attempt to start one failed."""
    return (run_dir / "supervisor.json").exists() or (run_dir / "exit.json").exists()


@contextlib.contextmanager
def _start_lock(run_dir: Path) -> Iterator[int]:
    """Hold ``run_dir/start.lock`` (an exclusive ``flock``); yields its descriptor.

    The kernel drops the lock when every process holding the descriptor has closed it or died, so a
    dead worker never leaves it taken. Raises a transient ProviderError after 30 s of waiting.
    """
    fd = os.open(run_dir / "start.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        deadline = time.monotonic() + START_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ProviderError(f"another attempt is still starting {run_dir.name}; retry later",
                                        transient=True) from None
                time.sleep(0.05)
        yield fd
    finally:
        os.close(fd)  # never LOCK_UN: that would release the supervisor's hold on it too


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def _group_is_ours(tr: Mapping[str, Any]) -> bool:
    """True when torchrun's process group still has members and its id was not reused."""
    pgid = int(tr["pgid"])
    stat = _proc.proc_stat(pgid)
    if stat is not None and stat[0] not in ("Z", "X") and stat[2] != tr.get("start_ticks"):
        return False  # the leader's pid belongs to a newer process now
    return bool(_proc.group_members(pgid))


def _first_step_logged(log_path: Path) -> bool:
    """True once train.log holds a ``started``/``step``/``epoch`` metric record.

    Reads from the start and stops at the first record, so the cost is bounded by what the job
    printed before its first step.
    """
    from trainer_pkg.metrics import METRIC_PREFIX, parse_metric_line  # torch-free

    marker = METRIC_PREFIX.encode()
    try:
        with open(log_path, "rb") as fh:
            for raw in fh:
                if marker not in raw:
                    continue
                record = parse_metric_line(raw.decode("utf-8", errors="replace"))
                if record and record.get("event") in RUNNING_EVENTS:
                    return True
    except FileNotFoundError:
        return False
    return False


def _failure_reason(log_path: Path, code: int) -> str:
    """Why the job failed, from the end of train.log: the rank that failed first and its error.

    Preference: torchrun's failure summary ("Root Cause (first observed failure)": that rank, its
    exit code or signal, and the ``trainer error: rank N: ...`` line of that rank when it printed one
    — the other ranks' errors are usually the consequence, e.g. a closed connection; else the log's last
    exception or argparse error line above the summary, as a user's script prints it); then the last
    line containing ``trainer error:``; then the last Python exception line of a rank (torchrun's
    own ChildFailedError wrapper is skipped); then the last 5 non-empty lines.
    """
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - FAILURE_TAIL_BYTES))
            tail = fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return f"exit code {code}"
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    found = torchrun_log.failure_line(lines)
    if found:
        return found
    if lines:
        return "\n".join(lines[-5:])
    return f"exit code {code}"


