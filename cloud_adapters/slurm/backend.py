"""The Slurm backend (``slurm``): one ``sbatch`` per job on a cluster the site already runs.

The worker reaches the cluster through a :class:`~cloud_adapters.slurm.transport.Transport`: it runs
the Slurm commands itself when it is on the login node (``transport`` "local"; its Celery queue is
``slurm.<backend name>``), or over SSH to a login node with a stored key ("ssh"; the default queue).
Every command gets ``SLURM_CONF`` (when set), ``TZ=UTC`` and ``SLURM_TIME_FORMAT=standard`` through
the transport, so times read back are UTC.

A job's run directory on the shared filesystem, ``<work_dir>/<job_name>/``::

    job.json        the trainer config as run (output/ and output/checkpoints/ in this directory)
    job.env         the job's variables (env and secret_env), mode 0600, read by the batch script
    job.sbatch      the batch script (:func:`cloud_adapters.slurm.script.batch_script`)
    slurm_job_id    Slurm's job id, written right after sbatch answered
    slurm.log       the job's output and error (--output/--error), the ranks' metric records
    app/            the trainer archive unpacked (trainer_pkg/ and the user's code beside it)
    cancel_requested  present once Trainboard cancelled it
    exit.json       the batch script's exit code and times, written last (not after a kill)

Beside them ``<work_dir>/.archives/`` holds the trainer archives (content-addressed, written once).

Status: ``squeue`` for the jobs the controller still schedules (one call for many), ``sacct`` for the
ones it lists no more (one call; needs accounting), ``scontrol show job`` while the controller still
remembers a finished job (``MinJobAge``), then the run directory's ``exit.json``. The states are
mapped in :mod:`cloud_adapters.slurm.states`. Cost: elapsed × nodes × the partition's internal rate
(:func:`cloud_adapters.pricing.internal_rate`; an on-premises cluster has no list price).
"""

from __future__ import annotations

import datetime as dt
import json
import posixpath
import re
from typing import Any, BinaryIO, Mapping, Sequence

from cloud_adapters import artifact_store, packaging, torchrun_log
from cloud_adapters.base import (
    Artifact,
    Backend,
    BackendError,
    Capabilities,
    ConnectionCheck,
    CredentialsError,
    InvalidSpec,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    ProviderError,
    ProviderJob,
    QuotaExceeded,
    TAG_JOB_ID,
    parse_utc,
    setting_value,
    tagged_job_id,
)
from cloud_adapters.gpubox import _usercode
from cloud_adapters.settings import BackendSettings, Secret, Setting
from cloud_adapters.slurm import script as batch
from cloud_adapters.slurm import states
from cloud_adapters.slurm.transport import CommandResult, LocalTransport, Transport

JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")
"""A job name: one safe path component (the run directory) and a Slurm --job-name without spaces."""
MAX_PROCS_PER_NODE = 1024  # the dashboard's ceiling for any backend (jobs.validation.MAX_PROCS_PER_NODE)
MAX_LOG_LINES = 2000  # lines per logs() call
MAX_LOG_BYTES = 4 * 1024 * 1024
FAILURE_TAIL_BYTES = 256 * 1024
COMMAND_TIMEOUT_S = 60.0
RESERVED_ENV = frozenset({
    "PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "TRAINBOARD_LAUNCH_PLATFORM", "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
})
"""Variables a job's env/secret_env may not set: the batch script and the launcher set them. Names
starting ``SLURM_`` are Slurm's and refused too."""

SETTINGS = BackendSettings(
    backend_label="Slurm cluster", provider="Slurm",
    settings=(
        # How the worker reaches the cluster, and what runs there as whom: host settings, the
        # operator's (TRAINBOARD_SLURM_*), never another user's backend row.
        Setting("transport", "Transport", "How the worker runs the Slurm commands: on this machine (the worker "
                "is on the login node) or over SSH to the login node.", host=True, field=False,
                choices=(("local", "on this machine"), ("ssh", "over SSH")), default="local"),
        Setting("login_host", "Login host", "The login node SSH connects to (ssh transport).", host=True,
                field=False, max_length=253),
        Setting("ssh_port", "SSH port", "The login node's SSH port.", type=int, host=True, field=False,
                min_value=1, max_value=65535, default=22),
        Setting("ssh_user", "SSH user", "The account the Slurm jobs run as (ssh transport).", host=True,
                field=False, max_length=32),
        Setting("ssh_host_key", "SSH host key", "The login node's public host key, one known_hosts line "
                "(ssh-keyscan -t ed25519 <login host>).", host=True, field=False, max_length=16384),
        Setting("slurm_conf", "slurm.conf", "Path of slurm.conf, passed as SLURM_CONF to every Slurm command; "
                "blank = the site's default.", host=True, field=False, max_length=4096),
        Setting("work_dir", "Working directory", "Absolute path on the cluster's shared filesystem for run "
                "directories and the trainer archive.", host=True, field=False, max_length=4096),
        Setting("python", "Python on the nodes", "The interpreter with torch on the compute nodes (absolute "
                "path, or a command name on their PATH).", host=True, field=False, max_length=4096,
                default="python3"),
        Setting("allowed_images", "Allowed images", "Container images (Pyxis --container-image) a job may run "
                "in, separated by commas or spaces: exact references or prefixes ending in *; blank = none.",
                host=True, field=False),
        # The cluster's scheduling settings: the backend owner's.
        Setting("cluster", "Cluster name", "The cluster's name (ClusterName), as the catalog's internal rates "
                "name it.", max_length=100, default=""),
        Setting("partition", "Partition", "The partition jobs go to (sbatch --partition), e.g. gpu.",
                required=True, max_length=128),
        Setting("account", "Account", "sbatch --account; blank = your default account.", max_length=128,
                default=""),
        Setting("qos", "QoS", "sbatch --qos; blank = the partition's default.", max_length=128, default=""),
        Setting("gpus_per_node", "GPUs per node", "GPUs each node of a job gets; 0 = CPU-only.", type=int,
                min_value=0, max_value=64, default=0),
        Setting("gpu_request", "GPU request", "How GPUs are asked for.",
                choices=(("gres", "--gres=gpu:N"), ("gpus-per-node", "--gpus-per-node=N")), default="gres"),
        Setting("cpus_per_task", "CPUs per node", "CPUs each node's task gets (--cpus-per-task); blank = the "
                "processes per node.", type=int, min_value=1, max_value=4096),
        Setting("mem_per_node_gb", "Memory per node (GB)", "--mem per node in GB; blank or 0 = the partition's "
                "default.", type=int, min_value=0, max_value=1_000_000, default=0),
        Setting("max_nodes", "Max nodes", "The most nodes one job may use.", type=int, min_value=1,
                max_value=10_000, default=16),
        Setting("extra_sbatch_options", "Extra sbatch options", "More sbatch options, separated by spaces, each "
                "--option=value or a bare flag (e.g. --constraint=a100 --exclusive); options that change where or as whom the "
                "job runs are refused.", max_length=2000, default=""),
        Setting("container_image", "Container image", "Pyxis/enroot image the job runs in (--container-image); "
                "blank = the nodes' Python.", max_length=255, default=""),
    ),
    secrets=(Secret("ssh_private_key", "SSH private key", multiline=True),),
)
"""The settings of a Slurm backend (:mod:`cloud_adapters.settings`)."""

_SLURM_ENV = {"TZ": "UTC", "SLURM_TIME_FORMAT": "standard"}


class SlurmBackend(Backend):
    """Runs each job as one ``sbatch`` on a Slurm cluster; see the module docstring."""

    kind = "slurm"
    settings = SETTINGS
    # sbatch(1) --time: "When the time limit is reached, each task in each job step is sent SIGTERM
    # followed by SIGKILL" (after KillWait); the limit runs from the job's start on its nodes.
    max_runtime_covers = (
        "the job's run on its nodes from the moment Slurm starts it (time waiting in the queue does not count), "
        "rounded up to whole minutes; at the limit Slurm sends the processes SIGTERM, then SIGKILL (Slurm "
        "documentation, sbatch --time)")
    image_setting = "container_image"
    dataset_schemes = frozenset({""})
    """Paths on the cluster's shared filesystem (the nodes have no cloud storage client)."""

    @classmethod
    def queue_for(cls, name: str, config: Mapping[str, Any]) -> str:
        """``slurm.<name>`` when the worker on the login node runs the Slurm commands (``transport``
        "local"), the default queue over SSH (any worker can reach the login node). ``name`` is the
        backend row's slug; anything else raises ValueError (as the GPU box's queue_for)."""
        if (config or {}).get("transport") == "ssh":
            return "celery"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,100}", name):
            raise ValueError(f"A Slurm backend's name must be a slug (letters, digits, - and _) to name its "
                             f"Celery queue; got {name!r}.")
        return f"slurm.{name}"

    # -- configuration ----------------------------------------------------------------------

    @classmethod
    def clean_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Every problem at once (one :class:`InvalidSpec` naming each setting): the declaration's
        types and bounds, then names (partition, account, QoS, cluster), absolute paths (work_dir,
        slurm_conf), the interpreter, the SSH settings when ``transport`` is ssh, the extra sbatch
        options against the allowlist and the image against ``allowed_images``."""
        raw = dict(config)
        extra = raw.pop("extra_sbatch_options", None)
        problems = cls.settings_problems(config)
        out = dict(SETTINGS.defaults)
        for key, value in raw.items():
            if key not in SETTINGS.keys or value is None or (isinstance(value, str) and not value.strip()):
                continue
            with problems.about(key):
                out[key] = setting_value(SETTINGS[key], value)
        options: list[str] = []
        with problems.about("extra_sbatch_options"):
            split = batch.split_options(extra if extra is not None else "")
            if split is None:
                raise InvalidSpec("extra_sbatch_options: expected options separated by spaces (or a list of "
                                  "strings), e.g. --constraint=a100 --exclusive.")
            if (found := batch.sbatch_option_problems(split)):
                raise InvalidSpec("extra_sbatch_options: " + " ".join(found))
            options = split
        out["extra_sbatch_options"] = " ".join(options)
        for key in ("partition", "account", "qos", "cluster"):
            value = out.get(key) or ""
            with problems.about(key):
                if value and not batch.NAME_RE.fullmatch(value):
                    raise InvalidSpec(f"{key}: {value[:60]!r} is not a Slurm name (letters, digits, _ . + -).")
        for key in ("work_dir", "slurm_conf"):
            value = out.get(key) or ""
            with problems.about(key):
                if value and not batch.PATH_RE.fullmatch(value):
                    raise InvalidSpec(f"{key}: expected an absolute path of letters, digits and _ . + - /, "
                                      f"got {value[:80]!r}.")
        if not out.get("work_dir") and not problems.has("work_dir"):
            problems.add("work_dir", "work_dir: required; the operator sets TRAINBOARD_SLURM_WORK_DIR (a "
                                     "directory on the cluster's shared filesystem).")
        python = out.get("python") or ""
        with problems.about("python"):
            if not (batch.PATH_RE.fullmatch(python) or re.fullmatch(r"[A-Za-z0-9_.+-]{1,64}", python)):
                raise InvalidSpec(f"python: expected an absolute path or a command name, got {python[:80]!r}.")
        if out.get("transport") == "ssh":
            for key in ("login_host", "ssh_user", "ssh_host_key"):
                if not out.get(key) and not problems.has(key):
                    problems.add(key, f"{key}: required for the ssh transport (the operator sets "
                                      f"TRAINBOARD_SLURM_{key.upper()}).")
            with problems.about("login_host"):
                host = out.get("login_host") or ""
                if host and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,252}", host):
                    raise InvalidSpec(f"login_host: {host[:60]!r} is not a host name or address.")
            with problems.about("ssh_user"):
                user = out.get("ssh_user") or ""
                if user and not _usercode.USER_NAME_RE.fullmatch(user):
                    raise InvalidSpec(f"ssh_user: {user[:40]!r} is not a user name.")
            with problems.about("ssh_host_key"):
                if out.get("ssh_host_key"):
                    from cloud_adapters.slurm.ssh import parse_host_key

                    parse_host_key(out["ssh_host_key"])
        with problems.about("allowed_images"):
            if (image_problems := _usercode.image_pattern_problems(out.get("allowed_images") or "")):
                raise InvalidSpec(image_problems[0])
        image = out.get("container_image") or ""
        with problems.about("container_image"):
            if image and not _usercode.IMAGE_RE.fullmatch(image):
                raise InvalidSpec(f"container_image: {image[:80]!r} is not a container image reference.")
        problems.raise_if_any()
        return out

    @property
    def capabilities(self) -> Capabilities:
        gpus = int(self.config["gpus_per_node"])
        return Capabilities(spot=False, max_nodes=int(self.config["max_nodes"]),
                            max_procs_per_node=gpus or int(self.config.get("cpus_per_task") or MAX_PROCS_PER_NODE),
                            strategies=self.runnable_strategies())

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        """USD per node-hour of the partition (``instance_type`` or the ``partition`` setting) on
        ``cluster``: the catalog's internal rate, node-hour plus ``gpus_per_node`` × GPU-hour; 0.0 when
        the admin has set no rate for it (:meth:`rate_known` says which)."""
        rate = self._rate(instance_type)
        return float(rate) if rate is not None else 0.0

    def rate_known(self, instance_type: str = "") -> bool:
        """Whether the catalog has an internal rate for the partition (else jobs cost 0: "no rate set")."""
        return self._rate(instance_type) is not None

    def price_note(self, instance_type: str = "") -> str:
        """"no internal rate is set for partition P on cluster C …" when the catalog has none."""
        if self.rate_known(instance_type):
            return ""
        partition = instance_type or self.config["partition"]
        cluster = self.config.get("cluster") or ""
        if not cluster:
            return (f"no internal rate can apply: this backend has no Cluster name, so jobs here cost $0; set the "
                    f"backend's Cluster name, and an admin sets the rate in the price catalog (provider slurm, region = "
                    f"that cluster name, instance type {partition})")
        return (f"no internal rate is set for partition {partition} on cluster {cluster}, so jobs here cost $0; an "
                f"admin sets it in the price catalog (provider slurm, region {cluster}, instance type {partition})")

    def _rate(self, instance_type: str = ""):
        from cloud_adapters.pricing import internal_rate

        return internal_rate(self.prices, "slurm", self.config.get("cluster") or "",
                             instance_type or self.config["partition"], int(self.config["gpus_per_node"]))

    # -- the cluster ------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        """The transport of :attr:`config` (built once): SSH to ``login_host``, else this machine."""
        if getattr(self, "_transport", None) is None:
            if self.config["transport"] == "ssh":
                from cloud_adapters.slurm.ssh import SshTransport  # paramiko, only when used

                key = self.secrets.get("ssh_private_key") or ""
                if not key:
                    raise CredentialsError("this Slurm backend connects over SSH but stores no SSH private key; "
                                           "paste the key of the SSH user in the backend's settings.")
                self._transport = SshTransport(self.config["login_host"], port=int(self.config["ssh_port"]),
                                               user=self.config["ssh_user"], private_key=key,
                                               host_key=self.config["ssh_host_key"])
            else:
                conf = self.config.get("slurm_conf") or ""
                self._transport = LocalTransport(env={"SLURM_CONF": conf} if conf else {})
        return self._transport

    def _run(self, argv: Sequence[str], *, input: bytes | None = None) -> CommandResult:
        env = dict(_SLURM_ENV)
        if self.config.get("slurm_conf"):
            env["SLURM_CONF"] = self.config["slurm_conf"]
        return self.transport.run(list(argv), input=input, timeout=COMMAND_TIMEOUT_S, env=env)

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.config["work_dir"], *parts)

    def _exists(self, path: str) -> bool:
        try:
            self.transport.read_file(path, limit=1)
        except FileNotFoundError:
            return False
        return True

    def _read_text(self, path: str, *, offset: int = 0, limit: int = MAX_LOG_BYTES) -> str | None:
        try:
            return self.transport.read_file(path, offset=offset, limit=limit).decode("utf-8", "replace")
        except FileNotFoundError:
            return None

    # -- submit -----------------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Base checks plus the job name, the partition a job names (``instance_type``), the job's
        variables (names; :data:`RESERVED_ENV` and ``SLURM_*`` refused), its image against
        ``allowed_images`` and its code archive's hash. Makes no call to the cluster."""
        _check_job_name(spec.job_name)
        super().validate(spec)
        problems = (_usercode.env_problems(spec.env, "env", RESERVED_ENV)
                    + _usercode.env_problems(spec.secret_env, "secret_env", RESERVED_ENV))
        problems += [f"{field}: {name} is Slurm's; remove it." for field, env in
                     (("env", spec.env), ("secret_env", spec.secret_env))
                     for name in env if isinstance(name, str) and name.startswith("SLURM_")]
        if spec.instance_type and not batch.NAME_RE.fullmatch(spec.instance_type):
            problems.append(f"instance type {spec.instance_type[:60]!r}: on Slurm it is a partition name "
                            f"(letters, digits, _ . + -); leave it empty for {self.config['partition']}.")
        image = spec.image or self.config.get("container_image") or ""
        if image and not _usercode.IMAGE_RE.fullmatch(image):
            problems.append(f"image: {image[:80]!r} is not a container image reference.")
        elif image and not _usercode.image_allowed(image, self.config.get("allowed_images") or ""):
            problems.append(f"image: this Slurm backend runs only the images its operator allows, and {image[:80]!r} "
                            f"is not among them; use an allowed image or none (the operator sets "
                            f"TRAINBOARD_SLURM_ALLOWED_IMAGES).")
        if spec.code is not None and not re.fullmatch(r"[0-9a-f]{64}", str(spec.code.sha256)):
            problems.append(f"code: {str(spec.code.sha256)[:80]!r} is not a SHA-256 (64 lowercase hex digits).")
        if spec.dataset_uri and not spec.dataset_uri.startswith("/"):
            problems.append(f"dataset {spec.dataset_uri[:80]!r}: a Slurm job reads datasets from paths on the "
                            f"cluster's shared filesystem.")
        if problems:
            raise InvalidSpec(" ".join(problems))

    def submit(self, spec: JobSpec) -> JobHandle:
        """Write the run directory and ``sbatch --parsable`` its batch script; returns at once.

        Idempotent by ``spec.job_name``: a job of that name that ``squeue`` (every state the controller
        remembers) or ``sacct`` lists, or a ``slurm_job_id`` in the run directory, is adopted and no
        second job is submitted (a retry after a worker died between sbatch and its answer finds the
        first job by its name). Raises :class:`InvalidSpec` for what sbatch refuses (an unknown
        partition, account or QoS; a shape the partition cannot run), :class:`QuotaExceeded` for a
        QoS/association limit, transient :class:`ProviderError` when the controller does not answer."""
        self.validate(spec)
        run_dir = self._path(spec.job_name)
        existing = self._find_by_name(spec.job_name, run_dir)
        if existing is not None:
            return self._handle(spec.job_name, existing, run_dir, spec.checkpoint_uri)

        archive = packaging.build_archive(spec.trainer_package_uri or None, code=spec.code)
        archive_path = self._path(".archives", archive.name)
        if not self._exists(archive_path):
            self.transport.write_file(archive_path, archive.data, mode=0o600)  # may hold the user's code
        try:
            config = json.loads(json.dumps(dict(spec.config)))
        except (TypeError, ValueError) as exc:
            raise InvalidSpec(f"config: not JSON-serialisable ({exc}).") from None
        output = config.setdefault("output", {})
        output["output_dir"] = spec.output_uri or f"{run_dir}/output"
        output["checkpoint_dir"] = spec.checkpoint_uri or f"{output['output_dir']}/checkpoints"
        parallel = config.setdefault("parallel", {})
        parallel["nodes"], parallel["procs_per_node"] = spec.nodes, spec.procs_per_node
        if spec.dataset_uri:
            config.setdefault("data", {})["uri"] = spec.dataset_uri
        config = packaging.config_with_code(config, spec.code, packaging.CODE_DIR_HERE)
        self.transport.write_file(f"{run_dir}/job.json", json.dumps(config, indent=2).encode(), mode=0o600)
        env = {**{str(k): str(v) for k, v in spec.env.items()}, **{str(k): str(v) for k, v in spec.secret_env.items()}}
        self.transport.write_file(f"{run_dir}/job.env", batch.env_file(env), mode=0o600)

        image = spec.image or self.config.get("container_image") or ""
        job_id = tagged_job_id(spec.tags)
        text = batch.batch_script(
            job_name=spec.job_name, run_dir=run_dir, archive=archive_path, nodes=spec.nodes,
            procs_per_node=spec.procs_per_node, max_runtime_s=spec.max_runtime_s,
            python=self.config["python"] if not image else "python3",
            partition=spec.instance_type or self.config["partition"], account=self.config.get("account") or "",
            qos=self.config.get("qos") or "", gpus_per_node=int(self.config["gpus_per_node"]),
            gpu_request=self.config["gpu_request"], cpus_per_task=int(self.config.get("cpus_per_task") or 0),
            mem_per_node_gb=int(self.config.get("mem_per_node_gb") or 0),
            comment=f"{TAG_JOB_ID}={job_id}" if job_id is not None else "",
            extra_options=batch.split_options(self.config.get("extra_sbatch_options") or "") or (),
            container_image=image, container_mounts=(f"{run_dir}:{run_dir}",) if image else ())
        script_path = f"{run_dir}/job.sbatch"
        self.transport.write_file(script_path, text.encode(), mode=0o700)

        done = self._run(["sbatch", "--parsable", "--export=NONE", f"--chdir={run_dir}", script_path])
        if not done.ok:
            raise _sbatch_error(done)
        slurm_id = done.stdout.strip().split(";", 1)[0]
        if not slurm_id.isdigit():
            raise ProviderError(f"sbatch answered {done.stdout.strip()[:200]!r} instead of a job id.")
        self.transport.write_file(f"{run_dir}/slurm_job_id", f"{slurm_id}\n".encode(), mode=0o644)
        return self._handle(spec.job_name, slurm_id, run_dir, spec.checkpoint_uri)

    def _find_by_name(self, job_name: str, run_dir: str) -> str | None:
        """Slurm's id of the job named ``job_name``, if one was submitted already (newest first)."""
        found = self._run(["squeue", "-h", "--states=all", f"--name={job_name}", "-o",
                           states.SEP.join(states.SQUEUE_FIELDS)])
        _raise_for_controller(found)
        jobs = [j for j in states.parse_squeue(found.stdout) if j.name == job_name]
        if jobs:
            return max(jobs, key=lambda j: int(j.job_id)).job_id
        acct = self._run(["sacct", "--parsable2", "-n", "-X", f"--name={job_name}", "-S", "now-30days", "-o",
                          ",".join(states.SACCT_FIELDS)])
        jobs = [j for j in states.parse_sacct(acct.stdout) if j.name == job_name] if acct.ok else []
        if jobs:
            return max(jobs, key=lambda j: int(j.job_id)).job_id
        recorded = (self._read_text(f"{run_dir}/slurm_job_id", limit=64) or "").strip()
        return recorded if recorded.isdigit() else None

    def _handle(self, job_name: str, slurm_id: str, run_dir: str, checkpoint_dir: str = "") -> JobHandle:
        """The job's handle: ``run_dir``, and ``checkpoint_dir`` when the spec named one (a resubmitted
        attempt writes its checkpoints into the lost attempt's directory: ``JobSpec.checkpoint_uri``)."""
        extra = {"run_dir": run_dir, **({"checkpoint_dir": checkpoint_dir} if checkpoint_dir else {})}
        return JobHandle(provider=self.kind, job_name=job_name, provider_job_id=slurm_id, extra=extra)

    def _run_dir(self, handle: JobHandle) -> str:
        _check_job_name(handle.job_name)
        return self._path(handle.job_name)

    def _checkpoint_dir(self, handle: JobHandle) -> str:
        """Where the run writes its checkpoints: the handle's ``checkpoint_dir`` (set by submit from the
        spec, which Trainboard writes, never the job) when it is another run's ``output/checkpoints``
        under the work directory, else the run's own ``<run_dir>/output/checkpoints``."""
        given = str((handle.extra or {}).get("checkpoint_dir") or "")
        parts = posixpath.relpath(posixpath.normpath(given), self.config["work_dir"]).split("/") if given else []
        if len(parts) == 3 and parts[1:] == ["output", "checkpoints"] and JOB_NAME_RE.fullmatch(parts[0]):
            return self._path(*parts)
        return f"{self._run_dir(handle)}/output/checkpoints"

    def checkpoint_uri(self, handle: JobHandle) -> str:
        """The run's checkpoint directory on the cluster's shared filesystem (:meth:`_checkpoint_dir`:
        ``<run_dir>/output/checkpoints``, or the lost attempt's this attempt resumed in; the place is
        the adapter's, never read back from a file the job could rewrite), for a later attempt to
        resume from in place. No call to the cluster: the next job, there, opens it."""
        return self._checkpoint_dir(handle)

    # -- status -----------------------------------------------------------------------------

    def describe(self, handle: JobHandle) -> JobStatus:
        """The job's status (:meth:`describe_many` of one); a job Slurm and the run directory both
        lack is FAILED "lost"."""
        return self.describe_many([handle])[handle.job_name]

    def describe_many(self, handles: Sequence[JobHandle],
                      changed_since: dt.datetime | None = None) -> dict[str, JobStatus]:
        """Statuses keyed by job name: one ``squeue -j <ids>`` for all, one ``sacct`` for those squeue
        no longer lists (skipped when accounting is off), ``scontrol show job`` for each job still
        missing, then the run directory. Raises a transient :class:`ProviderError` when the controller
        does not answer (no job's state changes then)."""
        by_id = {h.provider_job_id: h for h in handles if str(h.provider_job_id).isdigit()}
        found: dict[str, states.SlurmJob] = {}
        if by_id:
            out = self._run(["squeue", "-h", "-j", ",".join(by_id), "-o", states.SEP.join(states.SQUEUE_FIELDS)])
            _raise_for_controller(out)
            found.update({j.job_id: j for j in states.parse_squeue(out.stdout) if j.job_id in by_id})
        missing = [i for i in by_id if i not in found]
        if missing:
            acct = self._run(["sacct", "--parsable2", "-n", "-X", "-j", ",".join(missing), "-o",
                              ",".join(states.SACCT_FIELDS)])
            if acct.ok:
                found.update({j.job_id: j for j in states.parse_sacct(acct.stdout) if j.job_id in by_id})
        for job_id in [i for i in missing if i not in found]:
            shown = self._run(["scontrol", "-o", "show", "job", job_id])
            if shown.ok:
                found.update({j.job_id: j for j in states.parse_scontrol(shown.stdout) if j.job_id == job_id})
        result = {}
        for handle in handles:
            job = found.get(str(handle.provider_job_id))
            result[handle.job_name] = self._status(handle, job)
        return result

    def _status(self, handle: JobHandle, job: states.SlurmJob | None) -> JobStatus:
        run_dir = self._run_dir(handle)
        if job is None:
            return self._status_from_run_dir(handle, run_dir)
        state = states.job_state(job.state)
        nodes = job.nodes or 1
        common = dict(raw_state=job.state, started_at=job.started_at, ended_at=job.ended_at, instance_count=nodes)
        if state is None:
            return JobStatus(state=JobState.PENDING if job.started_at is None else JobState.RUNNING,
                             secondary_state=job.reason,
                             warning=f"Slurm reports state {job.state!r}, which Trainboard does not know; the job "
                                     f"stays active until Slurm reports a known state.", **common)
        if state is JobState.PENDING:
            return JobStatus(state=state, secondary_state=states.pending_reason(job), **common)
        if state is JobState.RUNNING:
            return JobStatus(state=state, secondary_state=job.state.lower() if job.state != "RUNNING" else "", **common)
        if state is JobState.CANCELLED:
            cancelled = self._exists(f"{run_dir}/cancel_requested")
            return JobStatus(state=state, failure_reason="cancelled from Trainboard (scancel)" if cancelled
                             else "cancelled on the cluster (scancel)", **common)
        if state is JobState.FAILED:
            reason = states.failed_reason(job)
            if not reason:
                code = f"exit code {job.exit_code}" if job.exit_code is not None else "a non-zero exit code"
                reason = self._log_failure(run_dir) or f"the batch script ended with {code}"
            return JobStatus(state=state, failure_reason=reason, lost=job.state in states.LOST_STATES, **common)
        return JobStatus(state=state, **common)

    def _status_from_run_dir(self, handle: JobHandle, run_dir: str) -> JobStatus:
        """The state of a job Slurm no longer reports: from ``exit.json``, else ``cancel_requested``."""
        text = self._read_text(f"{run_dir}/exit.json", limit=4096)
        record: dict[str, Any] = {}
        if text:
            try:
                record = json.loads(text)
            except ValueError:
                record = {}
        nodes = _recorded_nodes(self._read_text(f"{run_dir}/job.json", limit=1 << 20))
        times = dict(started_at=parse_utc(record.get("started_at")), ended_at=parse_utc(record.get("ended_at")),
                     instance_count=nodes)
        if isinstance(record.get("returncode"), int):
            code = record["returncode"]
            if code == 0:
                return JobStatus(state=JobState.SUCCEEDED, raw_state="COMPLETED", **times)
            return JobStatus(state=JobState.FAILED, raw_state="FAILED",
                             failure_reason=self._log_failure(run_dir) or f"the batch script ended with exit code {code}",
                             **times)
        if self._exists(f"{run_dir}/cancel_requested"):
            return JobStatus(state=JobState.CANCELLED, raw_state="CANCELLED",
                             failure_reason="cancelled from Trainboard (scancel)", **times)
        # No exit record: the batch script never reached its end (its node vanished, or the job was
        # killed on the cluster), so this is a lost run rather than the job's own error.
        return JobStatus(state=JobState.FAILED, raw_state="lost", instance_count=nodes, lost=True, failure_reason=(
            f"Slurm no longer knows job {handle.provider_job_id or handle.job_name} and it left no exit record "
            f"in {run_dir}: it was killed (time limit, node failure or scancel on the cluster). Enable Slurm "
            f"accounting (sacct) to see why."))

    def _log_failure(self, run_dir: str) -> str:
        """Why the job failed, from the end of ``slurm.log`` (:func:`cloud_adapters.torchrun_log.failure_line`:
        torchrun's root cause, a ``trainer error:`` line, the last Python exception); "" when none."""
        text = self._tail(f"{run_dir}/slurm.log")
        return torchrun_log.failure_line([ln.strip() for ln in text.splitlines() if ln.strip()])

    def _tail(self, path: str) -> str:
        chunks, offset = [], 0
        while True:  # the file's end, a window of FAILURE_TAIL_BYTES
            data = self._read_text(path, offset=offset, limit=MAX_LOG_BYTES)
            if not data:
                break
            chunks.append(data)
            chunks = ["".join(chunks)[-FAILURE_TAIL_BYTES:]]
            offset += len(data.encode("utf-8", "replace"))
            if len(data) < MAX_LOG_BYTES // 2:
                break
        return "".join(chunks)

    # -- cancel, logs, listing --------------------------------------------------------------

    def cancel(self, handle: JobHandle) -> None:
        """``scancel <id>`` after recording ``cancel_requested``; idempotent (scancel of an ended job
        is answered "already completing or completed" and ignored). Returns without waiting."""
        run_dir = self._run_dir(handle)
        if not self._exists(f"{run_dir}/cancel_requested"):
            self.transport.write_file(f"{run_dir}/cancel_requested", f"{_now().isoformat()}\n".encode(), mode=0o644)
        if not str(handle.provider_job_id).isdigit():
            return
        done = self._run(["scancel", str(handle.provider_job_id)])
        if not done.ok and not re.search(r"already completing|completed|Invalid job id", done.stderr, re.I):
            _raise_for_controller(done)
            raise ProviderError(f"scancel {handle.provider_job_id} failed: {done.stderr.strip()[:300]}")

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        """Complete lines of the job's ``slurm.log`` (--output and --error) from byte offset ``cursor``
        ("" = 0), and the next offset; at most 2000 lines per call, a partial last line kept for later."""
        offset = torchrun_log.byte_cursor(cursor)
        try:
            chunk = self.transport.read_file(f"{self._run_dir(handle)}/slurm.log", offset=offset, limit=MAX_LOG_BYTES)
        except FileNotFoundError:
            return [], str(offset)
        return torchrun_log.complete_lines(chunk, offset, max_bytes=MAX_LOG_BYTES, max_lines=MAX_LOG_LINES)

    # -- artifacts --------------------------------------------------------------------------
    # The run directory's output/ (the trainer's output_dir as submitted), its checkpoints/ and
    # slurm.log, through the transport (local files, or SFTP over the backend's SSH connection).
    # The places are the adapter's own, never read back from job.json: the job's code can write
    # there, and must not be able to point the dashboard at another directory of the cluster.

    def _artifact_files(self, handle: JobHandle) -> dict[str, tuple[str, str, Any]]:
        """name → (path, the root it lies under, its FileEntry)."""
        run_dir = self._run_dir(handle)
        out_dir = f"{run_dir}/output"
        ckpt_dir = self._checkpoint_dir(handle)  # a resubmitted attempt's: the lost attempt's directory
        files: dict[str, tuple[str, str, Any]] = {}
        for entry in self.transport.list_files(out_dir):
            if entry.path == "checkpoints" or entry.path.startswith("checkpoints/"):
                continue
            files[entry.path] = (f"{out_dir}/{entry.path}", out_dir, entry)
        for entry in self.transport.list_files(ckpt_dir):
            files[f"checkpoints/{entry.path}"] = (f"{ckpt_dir}/{entry.path}", ckpt_dir, entry)
        top = {e.path: e for e in self.transport.list_files(run_dir, recursive=False)}
        if not top and not files:
            raise ProviderError(f"run directory {run_dir} is missing on the cluster; the job's files are gone")
        if "slurm.log" in top:
            files["logs/slurm.log"] = (f"{run_dir}/slurm.log", run_dir, top["slurm.log"])
        return {name: value for name, value in files.items() if not artifact_store.name_problem(name)}

    def artifacts(self, handle: JobHandle) -> list[Artifact]:
        """``output/``'s files by their path under it (``model.pt``, ``metrics.jsonl``), the
        checkpoints as ``checkpoints/...`` and ``slurm.log`` as ``logs/slurm.log``; regular files
        only, never through a symbolic link. Raises ProviderError when the run directory is gone."""
        return [Artifact(name=name, kind=artifact_store.artifact_kind(name), size_bytes=entry.size_bytes,
                         modified_at=dt.datetime.fromtimestamp(entry.mtime, dt.timezone.utc))
                for name, (_, _, entry) in sorted(self._artifact_files(handle).items())]

    def open_artifact(self, handle: JobHandle, name: str) -> BinaryIO:
        """The file opened through the transport (a link on the way is refused)."""
        found = self._artifact_files(handle).get(name) if not artifact_store.name_problem(name) else None
        if found is None:
            raise InvalidSpec(f"job {handle.job_name} has no artifact {name!r}")
        path, root, _ = found
        try:
            return self.transport.open_file(path, root=root)
        except OSError as exc:
            raise ProviderError(f"cannot read {path}: {exc.strerror or exc}") from exc

    def artifact_uri(self, handle: JobHandle, name: str) -> str:
        """The file's path on the cluster's shared filesystem: a later job there reads it in place."""
        found = self._artifact_files(handle).get(name)
        return found[0] if found else ""

    def list_tagged(self) -> list[ProviderJob]:
        """The jobs squeue lists (pending, running, completing…) whose comment carries Trainboard's tag
        (``trainboard-job-id=<id>``, set at submit): one ``squeue`` call."""
        out = self._run(["squeue", "-h", "-o", states.SEP.join(states.SQUEUE_FIELDS)])
        _raise_for_controller(out)
        listed = []
        for job in states.parse_squeue(out.stdout):
            if not job.comment.startswith(f"{TAG_JOB_ID}="):
                continue
            state = states.job_state(job.state) or JobState.PENDING
            if state.is_terminal:
                continue
            listed.append(ProviderJob(
                name=job.name, state=state, raw_state=job.state,
                job_id=tagged_job_id({TAG_JOB_ID: job.comment.split("=", 1)[1]}), created_at=job.submitted_at,
                handle=self._handle(job.name, job.job_id, self._path(job.name)) if JOB_NAME_RE.fullmatch(job.name) else None))
        return listed

    def test_connection(self) -> list[ConnectionCheck]:
        """The transport's own checks (over SSH: "SSH connection", "SSH host key", "SSH login"; stops
        there when one fails), then three: the Slurm commands answer (``sinfo --version`` through the
        transport), the partition exists and is up (``sinfo -p``), the working directory is writable
        (a file written and read back). Never raises."""
        try:
            checks = self.transport.check_connection()
        except BackendError as exc:  # the transport cannot be built from the settings (no or a bad key)
            return [ConnectionCheck("transport", False, str(exc))]
        if not all(check.ok for check in checks):
            return checks
        try:
            version = self._run(["sinfo", "--version"])
            checks.append(ConnectionCheck("Slurm commands", version.ok, version.stdout.strip() or
                                          version.stderr.strip()[:300] or "sinfo failed"))
        except BackendError as exc:
            return [*checks, ConnectionCheck("Slurm commands", False, str(exc))]
        partition = self.config["partition"]
        try:
            out = self._run(["sinfo", "-h", "-p", partition, "-o", "%P|%a|%D|%c|%G"])
            rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 4]
            if out.ok and rows:
                name, avail, nodes, cpus, gres = rows[0]
                checks.append(ConnectionCheck("partition", avail == "up",
                                              f"partition {name.rstrip('*')}: {avail}, {nodes} nodes, {cpus} CPUs per "
                                              f"node, GRES {gres}" + ("" if avail == "up" else
                                                                      "; ask the cluster's admins to bring it up")))
            else:
                checks.append(ConnectionCheck("partition", False, f"sinfo lists no partition {partition!r}: check the "
                                              f"partition setting ({out.stderr.strip()[:200]})"))
        except BackendError as exc:
            checks.append(ConnectionCheck("partition", False, str(exc)))
        probe = self._path(".trainboard-write-test")
        try:
            self.transport.write_file(probe, b"ok\n", mode=0o600)
            ok = self.transport.read_file(probe) == b"ok\n"
            checks.append(ConnectionCheck("working directory", ok, f"{self.config['work_dir']} is writable" if ok
                                          else f"{probe} did not read back what was written"))
        except (OSError, BackendError) as exc:
            checks.append(ConnectionCheck("working directory", False,
                                          f"cannot write to {self.config['work_dir']} ({exc}); create it on the shared "
                                          f"filesystem, writable by the Slurm user"))
        return checks


def _check_job_name(name: str) -> None:
    if not isinstance(name, str) or not JOB_NAME_RE.fullmatch(name):
        raise InvalidSpec(f"job name {name!r}: must be 1–63 letters, digits or '-', starting with a letter or digit "
                          f"(it names the run directory and the Slurm job).")


def _recorded_nodes(text: str | None) -> int:
    try:
        nodes = int(json.loads(text or "{}").get("parallel", {}).get("nodes", 1))
    except (ValueError, TypeError, AttributeError):
        nodes = 1
    return max(1, nodes)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


_CONTROLLER_DOWN = re.compile(r"Unable to contact slurm controller|Socket timed out|Connection refused|"
                              r"Zero Bytes were transmitted|Communication connection failure", re.I)


def _raise_for_controller(result: CommandResult) -> None:
    """A transient ProviderError when a command failed because the controller did not answer."""
    if not result.ok and _CONTROLLER_DOWN.search(result.stderr):
        raise ProviderError(f"the Slurm controller did not answer ({result.stderr.strip()[:200]}); will retry.",
                            transient=True)
    if not result.ok and not re.search(r"Invalid job id", result.stderr, re.I):
        raise ProviderError(f"Slurm command failed: {result.stderr.strip()[:300] or result.stdout.strip()[:300]}")


def _sbatch_error(result: CommandResult) -> BackendError:
    """What sbatch's refusal means for the job (sbatch prints "sbatch: error: …")."""
    text = result.stderr.strip()[:500]
    if _CONTROLLER_DOWN.search(text):
        return ProviderError(f"the Slurm controller did not answer ({text}); will retry.", transient=True)
    if re.search(r"QOSMax|AssocMax|MaxSubmit|limit", text, re.I):
        return QuotaExceeded(f"Slurm refused the job: {text}. Wait for your running jobs to end or ask for a higher limit.")
    if re.search(r"Invalid (partition|account|qos)|Requested node configuration|More processors|"
                 r"Node count specification|Invalid generic resource|invalid", text, re.I):
        return InvalidSpec(f"Slurm refused the job: {text}. Check the backend's partition, account, QoS and GPU "
                           f"settings against `sinfo` and `sacctmgr show assoc`.")
    return ProviderError(f"sbatch failed: {text or result.stdout.strip()[:300]}")
