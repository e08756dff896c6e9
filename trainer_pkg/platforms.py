"""Where is this process running, and what shape of job does the platform ask for?

A *platform* is whatever started this process: torchrun, a SageMaker training container, a Vertex AI
custom-job replica, an Azure ML PyTorch-distribution process, or a person at a shell (``local``).
Each one describes the cluster in its own environment variables and files; a reader below turns
them into one :class:`LaunchPlan` — how many nodes, which one this is, how many processes per node,
where the rendezvous is, whether the processes already exist, and which directories the platform
wants the model, checkpoints and data read from — so that :mod:`trainer_pkg.launch` only acts on it.

Readers take the environment as a mapping and never start a process, import torch or write a file,
so they are cheap to call and to test. A variable that a platform must set but did not, or set to
something unreadable, is a :class:`PlatformError` whose message names the variable and says what to
do; the launcher turns it into exit code 2 within a second of starting.

Detection (:func:`detect`), first match wins:

1. ``TRAINBOARD_LAUNCH_PLATFORM`` and torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``: a rank that
   ``trainer_pkg.launch`` itself started through torchrun; its config is already resolved → torchrun.
2. ``AZUREML_RUN_ID`` (or ``AZUREML_ARM_SUBSCRIPTION``/``AZUREML_ARM_WORKSPACE_NAME``, or an
   ``AZ_BATCH*`` variable) → azureml. Other ``AZUREML_*`` variables are not markers: the SDK sets
   ``AZUREML_CURRENT_CLOUD`` in any process that uses it.
3. ``SM_HOSTS``, ``SM_CURRENT_HOST``, ``SM_TRAINING_ENV``, ``TRAINING_JOB_ARN`` or
   ``<root>/input/config/resourceconfig.json`` → sagemaker.
4. ``CLUSTER_SPEC``, ``CLOUD_ML_JOB_ID`` or ``AIP_MODEL_DIR`` → vertex.
5. ``SLURM_JOB_ID`` with ``SLURM_NODEID`` (a task srun started) → slurm.
6. ``PET_NNODES`` and ``PET_NODE_RANK`` (Kubeflow Trainer's torch runtime), unless torchrun's
   ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` are all set too (then torchrun already started the ranks)
   → kubernetes.
7. ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` (torchrun, ``torch.distributed.launch``, mpirun wrappers)
   → torchrun.
8. Otherwise → local (``--standalone``: torchrun on this machine; without it: one process).

The facts each reader relies on, with their sources, are in ``shared/reference/clouds.md`` (§1.5,
§1.6 SageMaker; §2.3 Vertex AI; §3.4 Azure ML; §7 Kubernetes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Mapping

from trainer_pkg import world_shape
from trainer_pkg.config import JobConfig, apply_overrides

PLATFORMS = ("torchrun", "sagemaker", "vertex", "azureml", "slurm", "kubernetes", "local")
"""Names accepted by ``--platform`` (besides ``auto``)."""

LAUNCHED_BY_US = "TRAINBOARD_LAUNCH_PLATFORM"
"""Set by the launcher in the environment of the torchrun it starts: the platform it detected."""

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The directory holding the ``trainer_pkg`` this process runs: what a relative ``code.dir`` is relative
to (the clouds put the user's files beside or near the package, docs/user-code.md)."""

SAGEMAKER_DEFAULT_PORT = 7777
"""The port the SageMaker PyTorch container exports as MASTER_PORT (clouds.md §1.6)."""


class PlatformError(Exception):
    """The platform's environment lacks a variable it must set, or set it to something unreadable."""

    failure_file: str | None = None
    """Where the platform shows a failure reason (SageMaker's /opt/ml/output/failure), if known."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What the launcher must do on this machine. Directories are local paths, or None to keep the
    config's own value."""

    platform: str
    """One of :data:`PLATFORMS`."""
    nnodes: int
    """Machines in the job."""
    node_rank: int
    """This machine's index, 0 … nnodes-1; node 0 hosts the rendezvous."""
    nproc_per_node: int
    """Processes (ranks) on each machine; world size = nnodes × nproc_per_node."""
    master_addr: str = ""
    """Host of node 0 (rendezvous address); "" when the job has one node."""
    master_port: int = 0
    """Rendezvous port on ``master_addr``; 0 when the job has one node."""
    in_process: bool = False
    """True when the platform already started every rank: this process trains as one of them."""
    reason: str = ""
    """Why this platform was chosen, for the log ("SM_HOSTS is set", "--platform vertex")."""
    output_dir: str | None = None
    """Where model.pt and metrics.jsonl go (SageMaker's /opt/ml/model, Vertex's AIP_MODEL_DIR …)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (/opt/ml/checkpoints, AIP_CHECKPOINT_DIR …)."""
    data_uri: str | None = None
    """The local path of the data (a /gcs mount …), used as is."""
    data_dir: str | None = None
    """The platform's data directory (a SageMaker channel, an Azure ML input). :meth:`resolve` points
    ``data.uri`` inside it when the config — after the hyperparameters — names a dataset that is not on
    this machine (a remote URI or a missing path); built-in datasets and local paths are kept."""
    hyperparameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Config overrides keyed by field name, values as the platform delivered them (strings)."""
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Variables to set for the ranks (e.g. NCCL_SOCKET_IFNAME on SageMaker)."""
    failure_file: str | None = None
    """A file whose text the platform shows as the job's failure reason (SageMaker)."""
    output_data_dir: str | None = None
    """Where node 0 copies metrics.jsonl after training (SageMaker's SM_OUTPUT_DATA_DIR)."""
    sets_shape: bool = True
    """Whether nnodes/nproc_per_node are the platform's word (written into parallel.nodes/procs_per_node)."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def describe(self, starter: str = "torchrun") -> str:
        """One log line: ``platform: sagemaker (SM_HOSTS is set), node_rank 1 of 2 nodes × 2 processes …``;
        ``starter``: what this launcher starts for several processes (torchrun, or a framework's own)."""
        shape = (f"node_rank {self.node_rank} of {self.nnodes} node(s) × {self.nproc_per_node} "
                 f"process(es) per node = world size {self.world_size}")
        parts = [f"platform: {self.platform}" + (f" ({self.reason})" if self.reason else ""), shape]
        if self.master_addr:
            parts.append(f"master {self.master_addr}:{self.master_port}")
        parts.append("ranks already started: training in this process" if self.in_process
                     else "one process" if self.world_size == 1 else f"starting {starter}")
        return ", ".join(parts)

    def resolve(self, cfg: JobConfig) -> JobConfig:
        """``cfg`` with this plan's hyperparameters, directories and shape applied (validated), and a
        relative ``code.dir`` made absolute from :data:`PACKAGE_PARENT` (SageMaker's and Azure ML's
        ``"."``, Vertex's ``trainboard_code_<hash>`` beside the installed package).

        Raises ConfigError naming the field when a hyperparameter does not parse to its type.
        """
        if self.hyperparameters:
            cfg = apply_overrides(cfg, self.hyperparameters)
        d = cfg.to_dict()
        if self.output_dir is not None:
            d["output"]["output_dir"] = self.output_dir
        if self.checkpoint_dir is not None:
            d["output"]["checkpoint_dir"] = self.checkpoint_dir
        if self.data_uri is not None:
            d["data"]["uri"] = self.data_uri
        elif self.data_dir is not None and _wants_data_mapping(cfg):
            # Decided on the config the hyperparameters made: the job file shipped with the code holds
            # only defaults (format builtin), so deciding before them would keep an s3:// URI.
            d["data"]["uri"] = _data_in_dir(self.data_dir, cfg)
        if cfg.code.dir.strip() and not os.path.isabs(cfg.code.dir):
            d["code"]["dir"] = os.path.normpath(os.path.join(PACKAGE_PARENT, cfg.code.dir))
        if self.sets_shape:
            d["parallel"]["nodes"] = self.nnodes
            d["parallel"]["procs_per_node"] = self.nproc_per_node
        return world_shape.validate(JobConfig.from_dict(d))


Env = Mapping[str, str]
Reader = Callable[..., LaunchPlan]


# -- helpers ---------------------------------------------------------------------------------------


def _require(env: Env, name: str, platform: str, hint: str = "") -> str:
    value = env.get(name, "")
    if not value.strip():
        raise PlatformError(f"{platform}: {name} is not set" + (f"; {hint}" if hint else ""))
    return value.strip()


def _int_var(env: Env, name: str, platform: str, *, minimum: int = 0, required: bool = True,
             default: int | None = None) -> int:
    if not required and not env.get(name, "").strip():
        assert default is not None
        return default
    raw = _require(env, name, platform)
    try:
        value = int(raw)
    except ValueError:
        raise PlatformError(f"{platform}: {name} is not an integer: {raw!r}") from None
    if value < minimum:
        raise PlatformError(f"{platform}: {name} must be at least {minimum}, got {value}")
    return value


def _port_var(env: Env, name: str, platform: str, default: int | None = None) -> int:
    port = _int_var(env, name, platform, minimum=1, required=default is None, default=default)
    if port > 65535:
        raise PlatformError(f"{platform}: {name} is not a TCP port: {port}")
    return port


def _json_var(env: Env, name: str, platform: str) -> Any:
    raw = _require(env, name, platform)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise PlatformError(f"{platform}: {name} is not valid JSON: {exc} (value {raw[:200]!r})") from None


OMPI_WORLD_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "OMPI_COMM_WORLD_LOCAL_SIZE")
"""What Open MPI's ``mpirun`` sets in every process it starts (docs.open-mpi.org, "Environment
variables set for MPI applications"): this process's rank, the world size, its rank on its node and
the ranks on its node."""


@dataclasses.dataclass(frozen=True)
class MpiWorld:
    """This process's place among the ranks an ``mpirun`` started (:data:`OMPI_WORLD_VARS`)."""

    rank: int
    """Rank in MPI_COMM_WORLD, 0 … size-1."""
    size: int
    """Ranks in all."""
    local_rank: int
    """Rank among the ranks on this node, 0 … local_size-1."""
    local_size: int
    """Ranks on this node; every node holds as many (mpirun's slots per host)."""

    @property
    def nodes(self) -> int:
        return self.size // self.local_size

    @property
    def node_rank(self) -> int:
        """This node's index: ranks fill the nodes in order (``--map-by slot``, as the platforms map them)."""
        return self.rank // self.local_size


def read_mpi_world(env: Env, who: str = "mpirun") -> MpiWorld | None:
    """This process's :class:`MpiWorld` when an Open MPI ``mpirun`` started it (``OMPI_COMM_WORLD_RANK``
    set), else None. Raises :class:`PlatformError` naming the variable that is missing, not an integer,
    or does not fit the others (a rank not below the size; a world that is not whole nodes of
    ``OMPI_COMM_WORLD_LOCAL_SIZE`` ranks each)."""
    if not env.get("OMPI_COMM_WORLD_RANK", "").strip():
        return None
    rank, size, local_rank, local_size = (
        _int_var(env, name, who, minimum=minimum) for name, minimum in zip(OMPI_WORLD_VARS, (0, 1, 0, 1)))
    if rank >= size or local_rank >= local_size:
        raise PlatformError(f"{who}: OMPI_COMM_WORLD_RANK {rank} / LOCAL_RANK {local_rank} are not below "
                            f"OMPI_COMM_WORLD_SIZE {size} / LOCAL_SIZE {local_size}")
    if size % local_size:
        raise PlatformError(f"{who}: OMPI_COMM_WORLD_SIZE {size} is not whole nodes of "
                            f"OMPI_COMM_WORLD_LOCAL_SIZE {local_size} ranks; give every host as many processes")
    return MpiWorld(rank=rank, size=size, local_rank=local_rank, local_size=local_size)


def cpu_threads_per_rank(procs_per_node: int) -> int:
    """CPU threads for each of ``procs_per_node`` ranks sharing this machine: the cores this process
    may run on (its affinity mask, which a container's or a scheduler's CPU limit narrows), split
    evenly, at least 1. Ranks that each took every core would fight over them; torchrun alone would
    give each one thread.

    The launcher passes it to the ranks as ``OMP_NUM_THREADS`` (:func:`trainer_pkg.launch.torchrun_env`)
    and the trainer applies it when a rank was started without one.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, procs_per_node))


def _visible_gpus(env: Env) -> int:
    """GPUs this machine exposes, counted without importing torch (CUDA_VISIBLE_DEVICES, /dev/nvidiaN)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len([n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)])
    except OSError:
        return 0


def _nproc(cfg: JobConfig, gpus: int, override: int | None) -> int:
    """Processes per node: --nproc-per-node, else one per GPU, else the config's procs_per_node."""
    if override is not None:
        return override
    return gpus if gpus > 0 else cfg.parallel.procs_per_node


def _is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def _data_in_dir(directory: str, cfg: JobConfig) -> str:
    """The dataset path inside a platform data directory (a SageMaker channel, an Azure input).

    ImageFolder data is the directory itself. A CSV/NPZ file keeps its name from ``data.uri`` when
    the directory holds it; otherwise the one file with that suffix in the directory is taken.
    """
    fmt = cfg.data.format
    if fmt not in ("csv", "npz"):
        return directory
    name = cfg.data.uri.rstrip("/").rsplit("/", 1)[-1]
    if name and os.path.isfile(os.path.join(directory, name)):
        return os.path.join(directory, name)
    try:
        matches = sorted(f for f in os.listdir(directory) if f.lower().endswith("." + fmt))
    except OSError:
        return directory  # the dataset loader says the path is missing, naming it
    return os.path.join(directory, matches[0]) if len(matches) == 1 else directory


def _wants_data_mapping(cfg: JobConfig) -> bool:
    """Map the data only when the config names a remote URI or a path that is not on this machine."""
    uri = cfg.data.uri
    if cfg.data.format == "builtin":
        return False
    return not uri or _is_remote(uri) or not os.path.exists(uri)


# -- torchrun --------------------------------------------------------------------------------------


def read_torchrun(env: Env, cfg: JobConfig, *, nproc: int | None = None, standalone: bool = False,
                  reason: str = "") -> LaunchPlan:
    """This process is one rank that torchrun (or a launcher with its variables) started.

    Needs ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and, with more than one rank, ``MASTER_ADDR`` and
    ``MASTER_PORT`` (``init_method="env://"``). ``GROUP_RANK``/``LOCAL_WORLD_SIZE`` (set by torchrun)
    give the node and processes per node for the log.
    """
    who = "torchrun"
    rank = _int_var(env, "RANK", who)
    local_rank = _int_var(env, "LOCAL_RANK", who)
    world = _int_var(env, "WORLD_SIZE", who, minimum=1)
    if rank >= world:
        raise PlatformError(f"{who}: RANK {rank} is not below WORLD_SIZE {world}")
    local_world = _int_var(env, "LOCAL_WORLD_SIZE", who, minimum=1, required=False, default=world)
    if world > 1:
        _require(env, "MASTER_ADDR", who)
        _port_var(env, "MASTER_PORT", who)
    node_rank = _int_var(env, "GROUP_RANK", who, required=False, default=rank // local_world)
    return LaunchPlan(
        platform="torchrun", nnodes=max(1, world // local_world), node_rank=node_rank,
        nproc_per_node=local_world, master_addr=env.get("MASTER_ADDR", ""),
        master_port=int(env.get("MASTER_PORT", "0") or 0), in_process=True,
        reason=reason or "RANK, LOCAL_RANK and WORLD_SIZE are set", sets_shape=False)


# -- local -----------------------------------------------------------------------------------------


def read_local(env: Env, cfg: JobConfig, *, nproc: int | None = None, standalone: bool = False,
               reason: str = "") -> LaunchPlan:
    """This machine alone: torchrun --standalone with ``nproc`` processes, or one process."""
    n = (nproc or cfg.parallel.procs_per_node) if standalone else 1
    return LaunchPlan(platform="local", nnodes=1, node_rank=0, nproc_per_node=n,
                      reason=reason or ("--standalone" if standalone else "no platform variables"),
                      sets_shape=False)


# -- SageMaker -------------------------------------------------------------------------------------


def sagemaker_root(env: Env) -> str:
    """SageMaker's container root: ``TRAINBOARD_SM_ROOT`` (tests), ``SAGEMAKER_BASE_DIR`` (the
    training toolkit's own override), else ``/opt/ml``."""
    return env.get("TRAINBOARD_SM_ROOT") or env.get("SAGEMAKER_BASE_DIR") or "/opt/ml"


def _read_json_file(path: str, platform: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise PlatformError(f"{platform}: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlatformError(f"{platform}: {path} is not valid JSON: {exc}") from None


def read_sagemaker(env: Env, cfg: JobConfig, *, nproc: int | None = None, standalone: bool = False,
                   reason: str = "") -> LaunchPlan:
    try:
        return _read_sagemaker(env, cfg, nproc=nproc, reason=reason)
    except PlatformError as exc:
        exc.failure_file = os.path.join(sagemaker_root(env), "output", "failure")
        raise


def _read_sagemaker(env: Env, cfg: JobConfig, *, nproc: int | None, reason: str) -> LaunchPlan:
    """A SageMaker training container (clouds.md §1.5, §1.6).

    Hosts and this host come from ``SM_HOSTS`` (JSON list) / ``SM_CURRENT_HOST``, or from
    ``<root>/input/config/resourceconfig.json`` when the training toolkit did not export them (a
    custom image). Node rank = index of this host in the sorted hosts; master = the first host
    (``algo-1``), port ``MASTER_PORT`` or 7777 as the PyTorch container uses. Processes per node =
    ``SM_NUM_GPUS`` when > 0, else the config's ``parallel.procs_per_node``.

    Directories: model → ``SM_MODEL_DIR`` (``<root>/model``, uploaded as model.tar.gz), checkpoints →
    ``<root>/checkpoints`` (synced with CheckpointConfig.S3Uri), data → the ``train`` channel
    (``SM_CHANNEL_TRAIN`` / ``<root>/input/data/train``) or the only channel, used when the config
    after the hyperparameters names a remote dataset (:attr:`LaunchPlan.data_dir`). Hyperparameters come
    from ``<root>/input/config/hyperparameters.json`` as strings; keys starting ``sagemaker_`` are the
    SDK's own and ignored.

    If torchrun's variables are also set (the toolkit's ``torch_distributed`` launcher started the
    ranks) this process trains in place with the same directories and hyperparameters; so does an MPI
    script's rank (``code.framework`` ``mpi``, the job's ``mpi`` distribution) that the toolkit's
    mpirun started, its place read from ``OMPI_COMM_WORLD_*`` (:func:`read_mpi_world`).
    """
    who = "SageMaker"
    root = sagemaker_root(env)
    config_dir = env.get("SM_INPUT_CONFIG_DIR") or os.path.join(root, "input", "config")
    resource_path = os.path.join(config_dir, "resourceconfig.json")
    resource = _read_json_file(resource_path, who) if os.path.isfile(resource_path) else {}
    if not isinstance(resource, dict):
        raise PlatformError(f"{who}: {resource_path} must hold a JSON object")

    if env.get("SM_HOSTS", "").strip():
        hosts = _json_var(env, "SM_HOSTS", who)
    elif "hosts" in resource:
        hosts = resource["hosts"]
    else:
        raise PlatformError(f"{who}: SM_HOSTS is not set (nor 'hosts' in {resource_path}); the "
                            "sagemaker-training toolkit exports it — run in a SageMaker training container")
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise PlatformError(f"{who}: SM_HOSTS must be a non-empty JSON list of host names, got {hosts!r}")
    hosts = sorted(hosts)
    current = env.get("SM_CURRENT_HOST", "").strip() or resource.get("current_host", "")
    if not current:
        raise PlatformError(f"{who}: SM_CURRENT_HOST is not set (nor 'current_host' in {resource_path})")
    if current not in hosts:
        raise PlatformError(f"{who}: SM_CURRENT_HOST {current!r} is not one of SM_HOSTS {hosts}")
    gpus = _int_var(env, "SM_NUM_GPUS", who, required=False, default=0)

    extra_env = {}
    interface = env.get("SM_NETWORK_INTERFACE_NAME") or resource.get("network_interface_name")
    if interface and gpus > 0:
        # What the toolkit's torchrun launcher sets so NCCL talks over the cluster interface (§1.6).
        extra_env = {"NCCL_SOCKET_IFNAME": interface, "NCCL_PROTO": "simple"}

    hp_path = os.path.join(config_dir, "hyperparameters.json")
    if os.path.isfile(hp_path):
        hps = _read_json_file(hp_path, who)
    elif env.get("SM_HPS", "").strip():
        hps = _json_var(env, "SM_HPS", who)
    else:
        hps = {}
    if not isinstance(hps, dict):
        raise PlatformError(f"{who}: {hp_path} must hold a JSON object of hyperparameters")
    hps = {k: v for k, v in hps.items() if not k.startswith("sagemaker_")}

    common = dict(
        platform="sagemaker", reason=reason or "SM_HOSTS / SM_CURRENT_HOST are set",
        output_dir=env.get("SM_MODEL_DIR") or os.path.join(root, "model"),
        checkpoint_dir=os.path.join(root, "checkpoints"), data_dir=_sagemaker_channel(env, root),
        hyperparameters=hps,
        extra_env=extra_env, failure_file=os.path.join(root, "output", "failure"),
        output_data_dir=env.get("SM_OUTPUT_DATA_DIR") or os.path.join(root, "output", "data"),
    )
    world = read_mpi_world(env, who) if _framework(cfg, hps) == "mpi" else None
    if world is not None:
        # The job's ``mpi`` distribution: the toolkit's mpirun started every rank on every host. It
        # exports the master's SM_CURRENT_HOST to all of them (-x), so the node is the rank's.
        if world.nodes != len(hosts):
            raise PlatformError(f"{who}: OMPI_COMM_WORLD_SIZE {world.size} is not {len(hosts)} host(s) × "
                                f"OMPI_COMM_WORLD_LOCAL_SIZE {world.local_size}")
        return LaunchPlan(nnodes=len(hosts), node_rank=world.node_rank, nproc_per_node=world.local_size,
                          master_addr=hosts[0] if len(hosts) > 1 else "",
                          master_port=_port_var(env, "MASTER_PORT", who, default=SAGEMAKER_DEFAULT_PORT)
                          if len(hosts) > 1 else 0, in_process=True, **common)
    if all(k in env for k in TORCHRUN_VARS):
        ranks = read_torchrun(env, cfg)
        return LaunchPlan(nnodes=len(hosts), node_rank=hosts.index(current),
                          nproc_per_node=ranks.nproc_per_node, master_addr=ranks.master_addr,
                          master_port=ranks.master_port, in_process=True, **common)
    nnodes = len(hosts)
    master_addr = env.get("MASTER_ADDR", "").strip() or hosts[0]
    master_port = _port_var(env, "MASTER_PORT", who, default=SAGEMAKER_DEFAULT_PORT)
    return LaunchPlan(nnodes=nnodes, node_rank=hosts.index(current),
                      nproc_per_node=_nproc(cfg, gpus, nproc),
                      master_addr=master_addr if nnodes > 1 else "",
                      master_port=master_port if nnodes > 1 else 0, **common)


def _framework(cfg: JobConfig, hyperparameters: Mapping[str, Any]) -> str:
    """``code.framework`` as the hyperparameters make it (the SageMaker job's config travels in them);
    the config's own when they do not parse (:meth:`LaunchPlan.resolve` reports that)."""
    try:
        return apply_overrides(cfg, hyperparameters).code.framework
    except ValueError:
        return cfg.code.framework


def _sagemaker_channel(env: Env, root: str) -> str | None:
    """The data channel's directory: ``train`` if there is one, else the only channel."""
    channels: dict[str, str] = {}
    for key, value in env.items():
        if key.startswith("SM_CHANNEL_") and value:
            channels[key[len("SM_CHANNEL_"):].lower()] = value
    data_root = os.path.join(root, "input", "data")
    if not channels and os.path.isdir(data_root):
        channels = {n: os.path.join(data_root, n) for n in os.listdir(data_root)
                    if os.path.isdir(os.path.join(data_root, n))}
    if "train" in channels:
        return channels["train"]
    return next(iter(channels.values())) if len(channels) == 1 else None


# -- Vertex AI -------------------------------------------------------------------------------------


def gcs_fuse_path(uri: str, env: Env) -> str:
    """``gs://bucket/path`` as the Cloud Storage FUSE path Vertex mounts (``/gcs/bucket/path``);
    ``TRAINBOARD_GCS_ROOT`` replaces ``/gcs`` (tests). Other values are returned unchanged."""
    if not uri.startswith("gs://"):
        return uri
    root = env.get("TRAINBOARD_GCS_ROOT") or "/gcs"
    return os.path.join(root, uri[len("gs://"):]).rstrip("/")


def read_vertex(env: Env, cfg: JobConfig, *, nproc: int | None = None, standalone: bool = False,
                reason: str = "") -> LaunchPlan:
    """A Vertex AI custom-job replica (clouds.md §2.3).

    ``CLUSTER_SPEC`` (JSON) gives the machines: ``cluster.workerpool0`` (the chief, node 0) then
    ``cluster.workerpool1`` (workers, nodes 1…); ``task.type``/``task.index`` say which one this is.
    Vertex starts ONE process per machine and sets ``RANK``/``WORLD_SIZE`` per machine (not per
    process) with ``MASTER_ADDR``/``MASTER_PORT``, so the launcher starts torchrun with per-process
    ranks. When ``RANK``/``WORLD_SIZE`` are set they must agree with the cluster spec. A single-replica
    job without ``CLUSTER_SPEC`` runs on this machine alone.

    Directories: ``AIP_MODEL_DIR`` → output_dir, ``AIP_CHECKPOINT_DIR`` → checkpoint_dir; ``gs://``
    URIs (those and ``data.uri``) are read through the Cloud Storage FUSE mount ``/gcs/<bucket>/…``.
    """
    who = "Vertex AI"
    if "CLUSTER_SPEC" in env:
        spec = _json_var(env, "CLUSTER_SPEC", who)
        nnodes, node_rank = _vertex_node(spec)
    else:
        machines = _int_var(env, "WORLD_SIZE", who, minimum=1, required=False, default=1)
        if machines > 1:
            raise PlatformError(f"{who}: CLUSTER_SPEC is not set but WORLD_SIZE is {machines}; Vertex "
                                "sets it on every replica of a multi-replica job")
        nnodes, node_rank = 1, 0
    if env.get("WORLD_SIZE", "").strip():
        machines = _int_var(env, "WORLD_SIZE", who, minimum=1)
        if machines != nnodes:
            raise PlatformError(f"{who}: WORLD_SIZE is {machines} but CLUSTER_SPEC lists {nnodes} machine(s) "
                                "in workerpool0 + workerpool1")
    if env.get("RANK", "").strip():
        machine = _int_var(env, "RANK", who)
        if machine != node_rank:
            raise PlatformError(f"{who}: RANK is {machine} but CLUSTER_SPEC's task is machine {node_rank}")

    master_addr, master_port = "", 0
    if nnodes > 1:
        master_addr = _require(env, "MASTER_ADDR", who, "Vertex sets it on multi-replica PyTorch jobs")
        master_port = _port_var(env, "MASTER_PORT", who)
    data_uri = gcs_fuse_path(cfg.data.uri, env) if cfg.data.uri.startswith("gs://") else None
    model_dir = env.get("AIP_MODEL_DIR", "").strip()
    ckpt_dir = env.get("AIP_CHECKPOINT_DIR", "").strip()
    out = gcs_fuse_path(model_dir, env) if model_dir else (
        gcs_fuse_path(cfg.output.output_dir, env) if cfg.output.output_dir.startswith("gs://") else None)
    ckpt = gcs_fuse_path(ckpt_dir, env) if ckpt_dir else (
        gcs_fuse_path(cfg.output.checkpoint_dir, env) if cfg.output.checkpoint_dir.startswith("gs://") else None)
    common = dict(platform="vertex", reason=reason or "CLUSTER_SPEC is set", output_dir=out,
                  checkpoint_dir=ckpt, data_uri=data_uri)
    if "TORCHELASTIC_RUN_ID" in env and all(k in env for k in TORCHRUN_VARS):
        # Someone already ran torchrun inside the replica: RANK/WORLD_SIZE are now per process.
        ranks = read_torchrun(env, cfg)
        return LaunchPlan(nnodes=ranks.nnodes, node_rank=ranks.node_rank,
                          nproc_per_node=ranks.nproc_per_node, master_addr=ranks.master_addr,
                          master_port=ranks.master_port, in_process=True, **common)
    return LaunchPlan(nnodes=nnodes, node_rank=node_rank, nproc_per_node=_nproc(cfg, _visible_gpus(env), nproc),
                      master_addr=master_addr, master_port=master_port, **common)


def _vertex_node(spec: Any) -> tuple[int, int]:
    """(machines, this machine's node rank) from a parsed CLUSTER_SPEC."""
    who = "Vertex AI"
    if not isinstance(spec, dict) or not isinstance(spec.get("cluster"), dict) \
            or not isinstance(spec.get("task"), dict):
        raise PlatformError(f"{who}: CLUSTER_SPEC must be an object with 'cluster' and 'task', got {spec!r:.200}")
    cluster, task = spec["cluster"], spec["task"]
    pools = []
    for pool in ("workerpool0", "workerpool1"):
        hosts = cluster.get(pool, [])
        if not isinstance(hosts, list):
            raise PlatformError(f"{who}: CLUSTER_SPEC cluster.{pool} must be a list of host:port, got {hosts!r}")
        pools.append(hosts)
    if len(pools[0]) != 1:
        raise PlatformError(f"{who}: CLUSTER_SPEC cluster.workerpool0 must hold exactly one machine "
                            f"(the chief), got {len(pools[0])}")
    kind, index = task.get("type"), task.get("index")
    if kind not in ("workerpool0", "workerpool1"):
        raise PlatformError(f"{who}: CLUSTER_SPEC task.type is {kind!r}; the trainer runs in workerpool0 "
                            "(chief) and workerpool1 (workers) only")
    pool = pools[0] if kind == "workerpool0" else pools[1]
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(pool):
        raise PlatformError(f"{who}: CLUSTER_SPEC task.index {index!r} is not a machine of {kind} "
                            f"({len(pool)} listed)")
    return len(pools[0]) + len(pools[1]), index if kind == "workerpool0" else 1 + index


# -- Azure ML --------------------------------------------------------------------------------------


AZURE_MARKERS = ("AZUREML_RUN_ID", "AZUREML_ARM_SUBSCRIPTION", "AZUREML_ARM_WORKSPACE_NAME")
AZURE_OUTPUT_NAMES = ("model", "output", "outputs")
AZURE_CHECKPOINT_NAMES = ("checkpoints", "checkpoint")
AZURE_DATA_NAMES = ("data", "train", "dataset")


def _azure_named(env: Env, prefix: str, names: tuple[str, ...]) -> str | None:
    """The value of ``<prefix><name>`` for the first of ``names`` (case-insensitive) that is set."""
    by_name = {k[len(prefix):].lower(): v for k, v in env.items() if k.upper().startswith(prefix) and v}
    return next((by_name[n] for n in names if n in by_name), None)


def read_azureml(env: Env, cfg: JobConfig, *, nproc: int | None = None, standalone: bool = False,
                 reason: str = "") -> LaunchPlan:
    """An Azure ML command job (clouds.md §3.4).

    For an MPI script (``code.framework`` ``mpi``: the job asks for ``MpiDistribution``) Azure ML's
    mpirun starts the processes, which carry Open MPI's ``OMPI_COMM_WORLD_*`` (:func:`read_mpi_world`)
    and train in place.

    With ``distribution=PyTorchDistribution(process_count_per_instance=N)`` Azure ML itself starts N
    processes per node and sets per-process ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (all processes)
    and per-node ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``: every process trains in place, no
    torchrun. Without a distribution (none of those set) the job is one process.

    Directories: the job's named outputs, which Azure ML exposes as ``AZURE_ML_OUTPUT_<name>`` (seen
    in public job code, not in a documented list): ``model``/``output(s)`` → output_dir,
    ``checkpoints`` → checkpoint_dir; a named input ``AZURE_ML_INPUT_data`` (or ``train``/``dataset``)
    → the data path when the config's data.uri is remote.
    """
    who = "Azure ML"
    out = _azure_named(env, "AZURE_ML_OUTPUT_", AZURE_OUTPUT_NAMES)
    ckpt = _azure_named(env, "AZURE_ML_OUTPUT_", AZURE_CHECKPOINT_NAMES)
    data_dir = _azure_named(env, "AZURE_ML_INPUT_", AZURE_DATA_NAMES)
    common = dict(platform="azureml", reason=reason or "AZUREML_RUN_ID is set", output_dir=out,
                  checkpoint_dir=ckpt, data_dir=data_dir)
    world = read_mpi_world(env, who) if cfg.code.framework == "mpi" else None
    if world is not None:
        # MpiDistribution: Azure ML's mpirun started the ranks (OMPI_COMM_WORLD_*), no RANK/MASTER_ADDR.
        return LaunchPlan(nnodes=world.nodes, node_rank=world.node_rank, nproc_per_node=world.local_size,
                          in_process=True, **common)
    dist_vars = TORCHRUN_VARS + ("MASTER_ADDR", "MASTER_PORT")
    if not any(env.get(k, "").strip() for k in dist_vars):
        return LaunchPlan(nnodes=1, node_rank=0, nproc_per_node=1, **common)
    rank = _int_var(env, "RANK", who)
    local_rank = _int_var(env, "LOCAL_RANK", who)
    world = _int_var(env, "WORLD_SIZE", who, minimum=1)
    master_addr = _require(env, "MASTER_ADDR", who)
    master_port = _port_var(env, "MASTER_PORT", who)
    if rank >= world:
        raise PlatformError(f"{who}: RANK {rank} is not below WORLD_SIZE {world}")
    per_node = _int_var(env, "LOCAL_WORLD_SIZE", who, minimum=1, required=False,
                        default=nproc or cfg.parallel.procs_per_node)
    if local_rank >= per_node or world % per_node:
        raise PlatformError(f"{who}: LOCAL_RANK {local_rank} / WORLD_SIZE {world} do not fit {per_node} "
                            "process(es) per node; set LOCAL_WORLD_SIZE or parallel.procs_per_node to "
                            "the job's process_count_per_instance")
    node_rank = _int_var(env, "NODE_RANK", who, required=False, default=rank // per_node)
    return LaunchPlan(nnodes=world // per_node, node_rank=node_rank, nproc_per_node=per_node,
                      master_addr=master_addr, master_port=master_port, in_process=True,
                      extra_env={"LOCAL_WORLD_SIZE": str(per_node)}, **common)


# -- Slurm -----------------------------------------------------------------------------------------


SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list as host names, in order: ``n[1-3,5]`` → n1 n2 n3 n5,
    ``gpu-[01-02]`` → gpu-01 gpu-02 (zero padding kept), ``a1,b[2-3]`` → a1 b2 b3, and several
    brackets in one name (``r[1-2]-n[1-2]`` → r1-n1 r1-n2 r2-n1 r2-n2), as ``scontrol show
    hostnames`` prints them. Raises ValueError for an unbalanced bracket or a bad range."""
    hosts: list[str] = []
    depth, start = 0, 0
    names = []
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    names.append(text[start:])
    for name in (n.strip() for n in names):
        if name:
            hosts += _expand_name(name)
    return hosts


def _expand_name(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    values = []
    for part in match.group(1).split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in {name!r}")
        if not dash:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range {part!r} in {name!r} goes backwards")
        width = len(low) if low.startswith("0") else 0
        values += [str(v).zfill(width) for v in range(int(low), int(high) + 1)]
    return [f"{head}{v}{rest}" for v in values for rest in _expand_name(tail)]


def read_slurm(env: Env, cfg: JobConfig, *, nproc: int | None = None, standalone: bool = False,
               reason: str = "") -> LaunchPlan:
    """One task of a Slurm job that srun started on each node (sbatch(1), srun(1) "OUTPUT
    ENVIRONMENT VARIABLES"; Trainboard's batch script, ``cloud_adapters.slurm.script``).

    ``SLURM_NODEID`` is this node's index in the allocation (the node rank), ``SLURM_NNODES`` the
    number of nodes, ``SLURM_JOB_NODELIST`` the hosts (compressed, :func:`expand_nodelist`); the
    first host is node 0 and the rendezvous. Its address is ``SLURM_LAUNCH_NODE_IPADDR`` when set,
    since the batch script, and so its srun, runs on the first node of the allocation (sbatch(1)
    "DESCRIPTION"); that needs no name resolution on the nodes. Else the host name itself.
    The rendezvous port is ``MASTER_PORT`` when set, else 20000 + job id mod 20000, so two jobs that
    share a node do not collide. Processes per node: ``--nproc-per-node``, else
    ``SLURM_GPUS_ON_NODE`` when > 0, else the config's ``parallel.procs_per_node``.
    """
    who = "Slurm"
    job_id = _int_var(env, "SLURM_JOB_ID", who)
    node_rank = _int_var(env, "SLURM_NODEID", who)
    try:
        hosts = expand_nodelist(_require(env, "SLURM_JOB_NODELIST", who, "srun sets it in every task"))
    except ValueError as exc:
        raise PlatformError(f"{who}: SLURM_JOB_NODELIST cannot be read: {exc}") from None
    nnodes = _int_var(env, "SLURM_NNODES", who, minimum=1, required=False, default=len(hosts))
    if nnodes != len(hosts):
        raise PlatformError(f"{who}: SLURM_NNODES is {nnodes} but SLURM_JOB_NODELIST names {len(hosts)} host(s)")
    if node_rank >= nnodes:
        raise PlatformError(f"{who}: SLURM_NODEID {node_rank} is not below SLURM_NNODES {nnodes}")
    gpus = _int_var(env, "SLURM_GPUS_ON_NODE", who, required=False, default=0)
    master = env.get("SLURM_LAUNCH_NODE_IPADDR", "").strip() or hosts[0]
    port = _port_var(env, "MASTER_PORT", who, default=SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN)
    return LaunchPlan(platform="slurm", nnodes=nnodes, node_rank=node_rank,
                      nproc_per_node=_nproc(cfg, gpus, nproc),
                      master_addr=master if nnodes > 1 else "", master_port=port if nnodes > 1 else 0,
                      reason=reason or f"SLURM_JOB_ID {job_id}, first host {hosts[0]}")


# -- Kubernetes (Kubeflow Trainer) -----------------------------------------------------------------


def read_kubernetes(env: Env, cfg: JobConfig, *, nproc: int | None = None, standalone: bool = False,
                    reason: str = "") -> LaunchPlan:
    """A pod of a Kubeflow Trainer ``TrainJob`` on the torch runtime (clouds.md §7).

    Trainer's torch plugin (kubeflow/trainer ``pkg/runtime/framework/plugins/torch/torch.go``) starts
    one container per node and sets, for torchrun: ``PET_NNODES`` (numNodes), ``PET_NPROC_PER_NODE``
    (numProcPerNode: an integer, or ``auto``/``gpu``/``cpu`` as torchrun's ``--nproc-per-node``
    takes them), ``PET_NODE_RANK`` (the pod's Job completion index), ``PET_MASTER_ADDR`` (node 0's
    pod, ``<trainjob>-node-0-0.<trainjob>``) and ``PET_MASTER_PORT`` (29400). The launcher starts
    torchrun with those values. ``auto`` is one process per visible GPU, else the CPUs this process
    may use (torchrun's ``auto`` on a machine without GPUs); ``gpu`` needs a GPU; ``cpu`` is the CPU
    count. ``--nproc-per-node`` wins over all of them. Directories are the config's (the pod mounts
    whatever volume the config names).
    """
    who = "Kubernetes"
    hint = "Kubeflow Trainer's torch runtime sets it on every TrainJob pod"
    nnodes = _int_var(env, "PET_NNODES", who, minimum=1)
    node_rank = _int_var(env, "PET_NODE_RANK", who)
    if node_rank >= nnodes:
        raise PlatformError(f"{who}: PET_NODE_RANK {node_rank} is not below PET_NNODES {nnodes}")
    per_node = nproc if nproc is not None else _kubernetes_nproc(env, who, hint)
    master_addr, master_port = "", 0
    if nnodes > 1:
        master_addr = _require(env, "PET_MASTER_ADDR", who, hint)
        master_port = _port_var(env, "PET_MASTER_PORT", who)
    return LaunchPlan(platform="kubernetes", nnodes=nnodes, node_rank=node_rank, nproc_per_node=per_node,
                      master_addr=master_addr, master_port=master_port,
                      reason=reason or "PET_NNODES and PET_NODE_RANK are set")


def _kubernetes_nproc(env: Env, who: str, hint: str) -> int:
    raw = _require(env, "PET_NPROC_PER_NODE", who, hint).lower()
    gpus = _visible_gpus(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if raw == "auto":
        return gpus or cpus
    if raw == "cpu":
        return cpus
    if raw == "gpu":
        if not gpus:
            raise PlatformError(f"{who}: PET_NPROC_PER_NODE is 'gpu' but this pod sees no GPU; request "
                                "nvidia.com/gpu in the TrainJob's resourcesPerNode or use an integer")
        return gpus
    return _int_var(env, "PET_NPROC_PER_NODE", who, minimum=1)


# -- detection -------------------------------------------------------------------------------------


READERS: dict[str, Reader] = {
    "torchrun": read_torchrun, "sagemaker": read_sagemaker, "vertex": read_vertex,
    "azureml": read_azureml, "slurm": read_slurm, "kubernetes": read_kubernetes, "local": read_local,
}


def detect(env: Env, *, standalone: bool = False) -> tuple[str, str]:
    """(platform, why) for this environment; the order is in the module docstring."""
    torchrun_vars = [k for k in TORCHRUN_VARS if k in env]
    if env.get(LAUNCHED_BY_US) and len(torchrun_vars) == len(TORCHRUN_VARS):
        return "torchrun", f"a rank started by trainer_pkg.launch on {env[LAUNCHED_BY_US]}"
    if standalone:  # asked for this machine alone; under torchrun, this process is one of its ranks
        if len(torchrun_vars) == len(TORCHRUN_VARS):
            return "torchrun", "RANK, LOCAL_RANK and WORLD_SIZE are set"
        return "local", "--standalone"
    # Only a job's own markers: azure-ai-ml itself sets AZUREML_CURRENT_CLOUD in a process that merely
    # submits jobs (a Celery worker that also runs gpubox jobs must not take the Azure path).
    azure = [k for k in AZURE_MARKERS if env.get(k)] or sorted(k for k in env if k.startswith("AZ_BATCH"))
    if azure:
        return "azureml", f"{azure[0]} is set"
    sagemaker = [k for k in ("SM_HOSTS", "SM_CURRENT_HOST", "SM_TRAINING_ENV", "TRAINING_JOB_ARN") if env.get(k)]
    if sagemaker:
        return "sagemaker", f"{sagemaker[0]} is set"
    resource = os.path.join(sagemaker_root(env), "input", "config", "resourceconfig.json")
    if os.path.isfile(resource):
        return "sagemaker", f"{resource} exists"
    vertex = [k for k in ("CLUSTER_SPEC", "CLOUD_ML_JOB_ID", "AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR") if env.get(k)]
    if vertex:
        return "vertex", f"{vertex[0]} is set"
    if env.get("SLURM_JOB_ID") and env.get("SLURM_NODEID"):
        return "slurm", "SLURM_JOB_ID and SLURM_NODEID are set"
    if env.get("PET_NNODES") and env.get("PET_NODE_RANK") and len(torchrun_vars) < len(TORCHRUN_VARS):
        return "kubernetes", "PET_NNODES and PET_NODE_RANK are set"
    if torchrun_vars:
        if len(torchrun_vars) < len(TORCHRUN_VARS):
            missing = [k for k in TORCHRUN_VARS if k not in env]
            raise PlatformError(
                f"torchrun: {', '.join(torchrun_vars)} set but {', '.join(missing)} not; unset them to "
                "train in one process, or name the platform with --platform")
        return "torchrun", "RANK, LOCAL_RANK and WORLD_SIZE are set"
    return "local", "no platform variables"


def plan(env: Env, cfg: JobConfig, *, platform: str = "auto", nproc: int | None = None,
         standalone: bool = False) -> LaunchPlan:
    """The :class:`LaunchPlan` for this machine. ``platform`` ``auto`` detects; a name forces that
    reader. Raises :class:`PlatformError` naming a missing or malformed variable."""
    if platform == "auto":
        name, why = detect(env, standalone=standalone)
    elif platform in READERS:
        name, why = platform, f"--platform {platform}"
    else:
        raise PlatformError(f"unknown platform {platform!r}: choose auto or one of {', '.join(PLATFORMS)}")
    if nproc is not None and nproc < 1:
        raise PlatformError(f"--nproc-per-node must be at least 1, got {nproc}")
    return READERS[name](env, cfg, nproc=nproc, standalone=standalone, reason=why)
