"""The Ray backend (``ray``): one Ray job per Trainboard job on a Ray cluster the site already runs
(KubeRay's RayCluster, or nodes joined with ``ray start``), through Ray's Job Submission API.

The worker talks to the cluster's dashboard over plain HTTP (httpx): no ``ray`` package in the web or
worker process. The calls, as Ray's own client makes them (``ray.job_submission.JobSubmissionClient``,
python/ray/dashboard/modules/dashboard_sdk.py and job/sdk.py, Ray 2.60):

* submit: ``GET /api/packages/gcs/<name>`` (200: the cluster has the package), else ``PUT`` of the zip's
  bytes to the same path; then ``POST /api/jobs/`` with ``submission_id`` = the job's name,
  ``entrypoint``, ``runtime_env`` and ``metadata``. Ray refuses a second job of the same
  ``submission_id``, so a retried submit looks the name up first (``GET /api/jobs/<name>``) and
  adopts the job when its metadata names it Trainboard's (``trainboard-job-name``);
* describe: ``GET /api/jobs/<name>`` (status, message, start/end times in milliseconds, the driver's
  node ``driver_node_id``);
* logs: the driver's log (which holds the workers' output Ray forwards to it) read from its end through
  the State API, ``GET /api/v0/logs/file?submission_id=<name>&node_id=<driver node>&lines=<N>`` (Ray
  2.60, python/ray/dashboard/modules/state/state_head.py ``get_logs``), N bounded: each call reads what is
  new since its cursor and never the whole log (:mod:`cloud_adapters.ray.logtail`). A failed job's
  reason is read from the last :data:`FAILURE_TAIL_LINES` lines the same way. (``GET
  /api/jobs/<name>/logs`` returns the whole log on every call; it is not used.);
* cancel: ``POST /api/jobs/<name>/stop`` (Ray sends the driver SIGTERM, then SIGKILL; the job's
  actors, our ranks' Ray workers, die with it); a 404 is a job already gone;
* list_tagged: ``GET /api/jobs/``, the jobs whose ``metadata`` carry ``trainboard-job-name``;
* test_connection: ``GET /api/version``, ``GET /api/cluster_status`` (the autoscaler's load report:
  the cluster's CPUs and GPUs, in use and in all).

A stored ``token`` is sent as ``Authorization: Bearer <token>`` on every call (Ray's token
authentication, ``RAY_AUTH_MODE=token``; or a proxy in front of the dashboard).

What the job is (:meth:`RayBackend.submit`): the ``working_dir`` is a zip of the trainer archive's files
(``trainer_pkg/`` and the user's code beside it: :func:`cloud_adapters.packaging.archive_entries`),
named by its hash, ``gcs://_ray_pkg_<sha256[:32]>.zip``, uploaded once per (trainer, code) pair; the
job's config travels as JSON in the ``runtime_env``'s ``env_vars`` (``TRAINBOARD_JOB_CONFIG``), with the
job's ``env`` and ``secret_env`` (Ray's dashboard masks ``env_vars`` values for a browser; the API
returns them to anyone who may call it, as SageMaker's DescribeTrainingJob returns its Environment);
the archive's ``requirements.txt`` as the ``runtime_env``'s ``pip`` (installed by Ray on each node into
a virtualenv that sees the cluster's packages). The entrypoint is
``<python> -m trainer_pkg.ray_entry --workers <nodes × processes> ...`` (:mod:`trainer_pkg.ray_entry`:
a ``TorchTrainer`` whose workers each run one rank of our launcher), an argument list we build and
quote with :func:`shlex.join` (Ray runs the entrypoint with a shell): no user text reaches it.

Outputs: rank 0 writes ``<output_path>/<job name>/`` on its node (``model.pt``, ``metrics.jsonl``,
``checkpoints/``); a multi-node job needs that path on a shared filesystem to resume elsewhere. The
worker cannot read the nodes' files, so this backend lists no artifacts; the metrics come from the log.

Cost: Ray has no price; a job costs elapsed hours × workers × the internal rate an admin set in the
price catalog (provider ``ray``, region = the backend's cluster name, instance type ``worker``: USD per
worker-hour plus GPUs per worker × USD per GPU-hour; :func:`cloud_adapters.pricing.internal_rate`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import re
import shlex
from typing import Any, Mapping, Sequence
from urllib.parse import quote, urlsplit

from cloud_adapters import packaging, retry, torchrun_log
from cloud_adapters.base import (
    TAG_JOB_ID,
    TAG_JOB_NAME,
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
    Throttled,
    setting_value,
    tagged_job_id,
)
from cloud_adapters.gpubox import _usercode
from cloud_adapters.ray import logtail, states
from cloud_adapters.settings import BackendSettings, Secret, Setting

JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")
"""A job name: Ray's ``submission_id``, one path segment of the API's URLs."""
MAX_LOG_LINES = 2000  # lines per logs() call
MAX_LOG_BYTES = 4 * 1024 * 1024
FAILURE_TAIL_LINES = 2000
"""Lines at the end of a failed job's log read for its reason (the ranks' error, our entrypoint's summary)."""
NODE_ID_RE = re.compile(r"[0-9a-f]{8,128}")
"""A Ray node id (``driver_node_id``: 56 hex digits in Ray 2.60)."""
_UNREADABLE_LOG = ("Could not find a log file", "has no driver node id", "A file is not found at",
                   "Agent for node id")
"""Ray 2.60's State API answers 500 with one of these when the log cannot be read (yet, or any more):
a job it does not know, a driver not started, no log file on the node, a node whose agent is gone
(ray/dashboard/modules/log/log_manager.py, log_agent.py, ray/util/state/state_manager.py)."""
MAX_PACKAGE_BYTES = 512 * 1024 * 1024
"""Ray keeps a package in its GCS, at most the gRPC message size (GRPC_CPP_MAX_MESSAGE_SIZE, 512 MiB)."""
REQUEST_TIMEOUT_S = 30.0
UPLOAD_TIMEOUT_S = 300.0
CONFIG_VAR = "TRAINBOARD_JOB_CONFIG"  # trainer_pkg.ray_entry.CONFIG_VAR (the adapter imports no trainer module)
WORKER_RATE_TYPE = "worker"
"""The price catalog's instance type of a Ray internal rate: USD per worker-hour."""
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RESERVED_ENV = frozenset({
    "PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "TRAINBOARD_LAUNCH_PLATFORM", "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", CONFIG_VAR,
})
"""Variables a job's env/secret_env may not set: the entrypoint and the launcher set them. Names starting
``RAY_`` are Ray's and refused too (``RAY_ADDRESS`` would send the job's driver to another cluster)."""
OUR_ENV = {"PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", "RAY_COLOR_PREFIX": "0"}
"""Set for every job: the ranks' records reach the log whole — Ray's log deduplication would fold the
ranks' alike lines into one ("[repeated 3x across cluster]") and its colors would wrap the prefix."""

SETTINGS = BackendSettings(
    backend_label="Ray cluster", provider="Ray",
    settings=(
        # Where the worker sends its calls and what runs the entrypoint there: the operator's
        # (TRAINBOARD_RAY_*), never another user's backend row.
        Setting("address", "Dashboard address", "The Ray dashboard's HTTP address, where the Job Submission API "
                "answers: http://<head>:8265 (KubeRay: the head service's dashboard port).", host=True,
                field=False, max_length=2000),
        Setting("python", "Python on the cluster", "The interpreter the entrypoint runs with on the cluster (a "
                "command name on the nodes' PATH, or an absolute path); it needs ray[train] and torch.",
                host=True, field=False, max_length=4096, default="python"),
        # The cluster's scheduling settings: the backend owner's.
        Setting("cluster", "Cluster name", "The cluster's name, as the price catalog's internal rates name it "
                "(region of a provider ray row).", max_length=100, default=""),
        Setting("cpus_per_worker", "CPUs per worker", "CPUs each Ray Train worker (one rank) reserves.", type=int,
                min_value=1, max_value=1024, default=1),
        Setting("gpus_per_worker", "GPUs per worker", "GPUs each Ray Train worker reserves; 0 = CPU-only "
                "(gloo).", type=int, min_value=0, max_value=64, default=0),
        Setting("placement", "Placement", "How Ray places the workers on the nodes (ScalingConfig "
                "placement_strategy).", choices=tuple((p, p) for p in PLACEMENTS), default="PACK"),
        Setting("max_workers", "Max workers", "The most Ray Train workers (nodes × processes per node) one "
                "job may use.", type=int, min_value=1, max_value=10_000, default=16),
        Setting("output_path", "Output directory", "Absolute directory on the cluster's nodes where a job writes "
                "<output directory>/<job name>/ (model, metrics, checkpoints); a shared filesystem for "
                "multi-node jobs.", max_length=1024, default="/tmp/trainboard-ray"),
    ),
    secrets=(Secret("token", "Ray token (bearer)", required=False),),
)
"""The settings of a Ray backend (:mod:`cloud_adapters.settings`)."""

_PATH_RE = re.compile(r"/[A-Za-z0-9_.+/-]{0,1023}")
_COMMAND_RE = re.compile(r"[A-Za-z0-9_.+-]{1,64}")


class RayBackend(Backend):
    """Runs each job as one Ray job on an existing Ray cluster; see the module docstring."""

    kind = "ray"
    settings = SETTINGS
    max_runtime_covers = (
        "the job's run from the moment its driver starts on the Ray cluster, so waiting for the workers' "
        "resources, starting them and loading the data count; at the limit every rank gets SIGTERM, then "
        "SIGKILL 30 s later (Ray's Job Submission API has no time limit of its own: Trainboard's entrypoint "
        "keeps it)")
    dataset_schemes = frozenset({"", "s3", "gs", "az"})
    """A path every node can read (a shared filesystem), or object storage the trainer reads itself."""

    # -- configuration ----------------------------------------------------------------------

    @classmethod
    def clean_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Every problem at once: the declaration's types, choices and bounds, then the address (an
        http(s) URL without credentials, query or fragment), the interpreter and the output directory."""
        problems = cls.settings_problems(config)
        out = dict(SETTINGS.defaults)
        for key, value in config.items():
            if key not in SETTINGS.keys or value is None or (isinstance(value, str) and not value.strip()):
                continue
            with problems.about(key):
                out[key] = setting_value(SETTINGS[key], value)
        address = str(out.get("address") or "")
        with problems.about("address"):
            if address:
                out["address"] = _address(address)
        if not out.get("address") and not problems.has("address"):
            problems.add("address", "address: required; the operator sets TRAINBOARD_RAY_ADDRESS (the Ray "
                                    "dashboard's http://<head>:8265).")
        python = out.get("python") or ""
        with problems.about("python"):
            if not (_PATH_RE.fullmatch(python) or _COMMAND_RE.fullmatch(python)) or ".." in python.split("/"):
                raise InvalidSpec(f"python: expected an absolute path or a command name, got {python[:80]!r}.")
        output = out.get("output_path") or ""
        with problems.about("output_path"):
            if not _PATH_RE.fullmatch(output) or ".." in output.split("/"):
                raise InvalidSpec(f"output_path: expected an absolute path of letters, digits and _ . + - /, "
                                  f"got {output[:80]!r}.")
        with problems.about("cluster"):
            if out.get("cluster") and not re.fullmatch(r"[A-Za-z0-9_.+-]{1,100}", out["cluster"]):
                raise InvalidSpec(f"cluster: {out['cluster'][:60]!r} is not a name (letters, digits, _ . + -).")
        problems.raise_if_any()
        return out

    @property
    def capabilities(self) -> Capabilities:
        most = int(self.config["max_workers"])
        return Capabilities(spot=False, max_nodes=most, max_procs_per_node=most,
                            strategies=self.runnable_strategies())

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        """USD per worker-hour on ``cluster``: the catalog's internal rate (provider ``ray``, instance
        type ``worker``), worker-hour plus ``gpus_per_worker`` × GPU-hour; 0.0 when none is set."""
        rate = self._rate()
        return float(rate) if rate is not None else 0.0

    def price_note(self, instance_type: str = "") -> str:
        """"no internal rate is set for …" when the catalog has none."""
        if self._rate() is not None:
            return ""
        cluster = self.config.get("cluster") or ""
        if not cluster:
            return ("no internal rate can apply: this backend has no Cluster name, so jobs here cost $0; set the "
                    "backend's Cluster name, and an admin sets the rate in the price catalog (provider ray, region "
                    f"= that cluster name, instance type {WORKER_RATE_TYPE})")
        return (f"no internal rate is set for Ray cluster {cluster}, so jobs here cost $0; an admin sets it in the "
                f"price catalog (provider ray, region {cluster}, instance type {WORKER_RATE_TYPE}, per worker-hour)")

    def _rate(self):
        from cloud_adapters.pricing import internal_rate

        return internal_rate(self.prices, "ray", self.config.get("cluster") or "", WORKER_RATE_TYPE,
                             int(self.config["gpus_per_worker"]))

    # -- HTTP -------------------------------------------------------------------------------

    def _client(self):
        import httpx

        if getattr(self, "_http", None) is None:
            token = self.secrets.get("token") or ""
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            self._http = httpx.Client(base_url=self.config["address"], headers=headers, timeout=REQUEST_TIMEOUT_S,
                                      follow_redirects=False)
        return self._http

    def _request(self, method: str, path: str, *, retried: bool = True, **kwargs: Any):
        """The response to one API call (any status: the caller reads it). A connection failure or a
        timeout is retried (GETs; ``retried``) and then a transient :class:`ProviderError`; 401/403 is a
        :class:`CredentialsError`."""
        import httpx

        def once():
            return self._client().request(method, path, **kwargs)

        def classify(exc: BaseException) -> retry.Verdict | None:
            if isinstance(exc, (httpx.TransportError,)):
                return retry.Verdict(retry=retried, error=ProviderError(
                    f"the Ray dashboard at {self.config['address']} did not answer ({type(exc).__name__}: "
                    f"{str(exc)[:200]}); will retry. Check that the cluster's head is up and the address is its "
                    f"dashboard's (port 8265).", transient=True))
            return None

        response = retry.call(once, classify=classify,
                              policy=retry.RetryPolicy(max_attempts=3 if retried else 1, max_delay_s=2.0))
        if response.status_code in (401, 403):
            raise CredentialsError(
                f"the Ray dashboard at {self.config['address']} refused the call ({response.status_code}): "
                f"{'the stored token is not accepted' if self.secrets.get('token') else 'it needs a token'}; "
                f"store the cluster's token (ray get-auth-token) in the backend's Ray token.")
        return response

    def _job(self, name: str) -> dict[str, Any] | None:
        """Ray's JobDetails of ``name`` (a dict), or None when the cluster has no such job."""
        response = self._request("GET", f"/api/jobs/{quote(name, safe='')}")
        if response.status_code == 404:
            return None
        details = _json(response, "GET /api/jobs/<id>")
        if not isinstance(details, dict):
            raise ProviderError(f"the Ray dashboard answered GET /api/jobs/{name} with {str(details)[:200]!r}")
        return details

    # -- submit -----------------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Base checks, then: the job name, nodes × processes ≤ ``max_workers`` (each rank is one Ray
        Train worker), no instance type and no image (Ray places workers by their resources and runs
        them in the nodes' Python), the job's variables, a torch, built-in or Ray job (a TensorFlow or
        MPI script is refused: this backend starts torch ranks or a Ray driver). No call to the cluster."""
        _check_job_name(spec.job_name)
        super().validate(spec)
        most = int(self.config["max_workers"])
        if spec.world_size > most:
            raise InvalidSpec(f"{spec.nodes} nodes × {spec.procs_per_node} processes = {spec.world_size} Ray Train "
                              f"workers, but this Ray backend runs at most {most} per job.", field="nodes")
        if spec.instance_type:
            raise InvalidSpec(f"instance type {spec.instance_type[:60]!r}: a Ray cluster places each worker by its "
                              f"resources ({self.config['cpus_per_worker']} CPU, {self.config['gpus_per_worker']} "
                              f"GPU, the backend's settings); leave it empty.", field="instance_type")
        if spec.image:
            raise InvalidSpec(f"image {spec.image[:80]!r}: a Ray job runs in the Python environment of the cluster's "
                              f"nodes; leave the image empty.", field="image")
        problems = (_usercode.env_problems(spec.env, "env", RESERVED_ENV)
                    + _usercode.env_problems(spec.secret_env, "secret_env", RESERVED_ENV))
        problems += [f"{field}: {name} is Ray's; remove it." for field, env in
                     (("env", spec.env), ("secret_env", spec.secret_env))
                     for name in env if isinstance(name, str) and name.startswith("RAY_")]
        code = spec.config.get("code") if isinstance(spec.config, Mapping) else None
        framework = (code or {}).get("framework", "torch") if isinstance(code, Mapping) else "torch"
        if framework not in ("torch", "ray", None, ""):
            problems.append(f"code.framework {framework!r}: a Ray backend runs torch ranks under Ray Train, or a "
                            f"Ray script as the job's driver; run {'an' if framework == 'mpi' else 'a'} {framework} script "
                            f"on a GPU box, Slurm or a cloud backend.")
        if spec.code is not None and not re.fullmatch(r"[0-9a-f]{64}", str(spec.code.sha256)):
            problems.append(f"code: {str(spec.code.sha256)[:80]!r} is not a SHA-256 (64 lowercase hex digits).")
        if problems:
            raise InvalidSpec(" ".join(problems))

    def submit(self, spec: JobSpec) -> JobHandle:
        """Upload the working_dir zip unless the cluster has it, then ``POST /api/jobs/``; returns at once.

        Idempotent by ``spec.job_name`` (Ray's ``submission_id``): a job of that name carrying our
        ``trainboard-job-name`` metadata is adopted, before the POST and after a POST that failed (a
        retry whose first answer was lost); one without it is not Trainboard's and is an error.
        Raises :class:`InvalidSpec` for what Ray refuses (a bad runtime_env), :class:`CredentialsError`
        for a refused token, transient :class:`ProviderError` when the dashboard does not answer."""
        self.validate(spec)
        existing = self._job(spec.job_name)
        if existing is not None:
            return self._adopt(spec, existing)

        entries = packaging.archive_entries(spec.trainer_package_uri or None, code=spec.code)
        data = packaging.deterministic_zip(entries)
        if len(data) >= MAX_PACKAGE_BYTES:
            raise InvalidSpec(f"the job's code and the trainer zip to {len(data) / 2**20:.0f} MiB; a Ray cluster keeps "
                              f"a working_dir of less than 512 MiB: move the data out of the code archive.")
        package = f"_ray_pkg_{hashlib.sha256(data).hexdigest()[:32]}.zip"
        self._upload_once(package, data)

        body = {"entrypoint": self.entrypoint(spec), "submission_id": spec.job_name,
                "runtime_env": self.runtime_env(spec, package), "metadata": self.metadata(spec)}
        response = self._request("POST", "/api/jobs/", retried=False, json=body)
        if response.status_code == 200:
            return self._handle(spec.job_name, spec.world_size)
        found = self._job(spec.job_name)  # a concurrent submit won, or the first answer was lost
        if found is not None:
            return self._adopt(spec, found)
        text = response.text.strip()
        if response.status_code == 400 or re.search(r"ValueError|TypeError|validat", text):
            raise InvalidSpec(f"the Ray cluster refused the job: {_last_line(text)}")
        raise ProviderError(f"POST /api/jobs/ failed ({response.status_code}): {_last_line(text)}",
                            transient=response.status_code >= 500)

    def _adopt(self, spec: JobSpec, details: Mapping[str, Any]) -> JobHandle:
        metadata = details.get("metadata") or {}
        if not isinstance(metadata, Mapping) or metadata.get(TAG_JOB_NAME) != spec.job_name:
            raise ProviderError(f"the Ray cluster has a job {spec.job_name!r} that is not Trainboard's (its metadata "
                                f"carries no {TAG_JOB_NAME}); Trainboard will not adopt it. Delete it on the cluster "
                                f"(ray job delete {spec.job_name}) or use another backend.")
        return self._handle(spec.job_name, _workers(metadata) or spec.world_size)

    def _upload_once(self, package: str, data: bytes) -> None:
        path = f"/api/packages/gcs/{package}"
        found = self._request("GET", path)
        if found.status_code == 200:
            return
        if found.status_code != 404:
            raise ProviderError(f"GET {path} failed ({found.status_code}): {_last_line(found.text)}",
                                transient=found.status_code >= 500)
        put = self._request("PUT", path, retried=False, content=data, timeout=UPLOAD_TIMEOUT_S)
        if put.status_code != 200:
            raise ProviderError(f"uploading the job's working_dir ({len(data)} bytes) failed ({put.status_code}): "
                                f"{_last_line(put.text)}", transient=put.status_code >= 500)

    def job_config(self, spec: JobSpec) -> dict[str, Any]:
        """The trainer config the job runs: its output and checkpoint directories under ``output_path``
        (or the spec's), its shape, its dataset and its code (``code.dir`` ".", the working_dir)."""
        try:
            config = json.loads(json.dumps(dict(spec.config)))
        except (TypeError, ValueError) as exc:
            raise InvalidSpec(f"config: not JSON-serialisable ({exc}).") from None
        output = config.setdefault("output", {})
        output["output_dir"] = spec.output_uri or f"{self.config['output_path'].rstrip('/')}/{spec.job_name}"
        output["checkpoint_dir"] = spec.checkpoint_uri or f"{output['output_dir']}/checkpoints"
        parallel = config.setdefault("parallel", {})
        parallel["nodes"], parallel["procs_per_node"] = spec.nodes, spec.procs_per_node
        if spec.dataset_uri:
            config.setdefault("data", {})["uri"] = spec.dataset_uri
        return packaging.config_with_code(config, spec.code, packaging.CODE_DIR_HERE)

    def entrypoint(self, spec: JobSpec) -> str:
        """The shell command Ray runs: our argument list (never user text), quoted by :func:`shlex.join`."""
        return shlex.join([
            self.config["python"], "-m", "trainer_pkg.ray_entry", "--workers", str(spec.world_size),
            "--cpus-per-worker", str(self.config["cpus_per_worker"]),
            "--gpus-per-worker", str(self.config["gpus_per_worker"]), "--placement", self.config["placement"],
            "--max-runtime-s", str(int(spec.max_runtime_s)), "--name", spec.job_name])

    def runtime_env(self, spec: JobSpec, package: str) -> dict[str, Any]:
        """``working_dir`` (the uploaded zip), ``env_vars`` (ours, then the job's env and secret_env, then
        the config) and, when the code has a requirements.txt, ``pip``."""
        env = {**OUR_ENV, **{str(k): str(v) for k, v in spec.env.items()},
               **{str(k): str(v) for k, v in spec.secret_env.items()},
               CONFIG_VAR: json.dumps(self.job_config(spec), separators=(",", ":"))}
        runtime_env: dict[str, Any] = {"working_dir": f"gcs://{package}", "env_vars": env}
        requirements = packaging.requirement_lines(spec.code.requirements) if spec.code is not None else []
        if requirements:
            runtime_env["pip"] = {"packages": requirements, "pip_check": False}
        return runtime_env

    def metadata(self, spec: JobSpec) -> dict[str, str]:
        """The job's tags (``trainboard-job-id``, ...), its name and its worker count, as Ray's string metadata."""
        return {**{str(k): str(v) for k, v in spec.tags.items()}, TAG_JOB_NAME: spec.job_name,
                "trainboard-workers": str(spec.world_size)}

    def _handle(self, name: str, workers: int) -> JobHandle:
        return JobHandle(provider=self.kind, job_name=name, provider_job_id=name, extra={"workers": int(workers)})

    # -- status -----------------------------------------------------------------------------

    def describe(self, handle: JobHandle) -> JobStatus:
        """The job's status from ``GET /api/jobs/<name>``; a job the cluster does not know (its head
        restarted: Ray keeps jobs in the head's GCS) is FAILED, lost."""
        _check_job_name(handle.job_name)
        return self._status(handle, self._job(handle.job_name))

    def describe_many(self, handles: Sequence[JobHandle],
                      changed_since: dt.datetime | None = None) -> dict[str, JobStatus]:
        """Statuses keyed by job name: one ``GET /api/jobs/`` for all of them (Ray lists every job it
        keeps; its list has no filter), then the tail of the log of each job that failed (its reason).
        One job alone: :meth:`describe`."""
        if len(handles) <= 1:
            return {h.job_name: self.describe(h) for h in handles}
        for handle in handles:
            _check_job_name(handle.job_name)
        listed = {str(job.get("submission_id")): job for job in self._list_jobs() if isinstance(job, dict)}
        return {h.job_name: self._status(h, listed.get(h.job_name)) for h in handles}

    def _list_jobs(self) -> list[Any]:
        response = self._request("GET", "/api/jobs/")
        if response.status_code != 200:
            raise ProviderError(f"listing the Ray cluster's jobs failed ({response.status_code}): "
                                f"{_last_line(response.text)}", transient=response.status_code >= 500)
        jobs = _json(response, "GET /api/jobs/")
        if not isinstance(jobs, list):
            raise ProviderError(f"the Ray dashboard answered GET /api/jobs/ with {str(jobs)[:200]!r}")
        return jobs

    def _status(self, handle: JobHandle, details: Mapping[str, Any] | None) -> JobStatus:
        workers = int((handle.extra or {}).get("workers") or 1)
        if details is None:
            return JobStatus(state=JobState.FAILED, raw_state="lost", instance_count=workers, lost=True,
                             failure_reason=f"the Ray cluster at {self.config['address']} no longer knows job "
                                            f"{handle.job_name}: its head restarted (Ray keeps its jobs in the head's "
                                            f"GCS), so the run is lost.")
        raw = str(details.get("status") or "")
        state = states.job_state(raw)
        common = dict(raw_state=raw, started_at=_ms(details.get("start_time")), ended_at=_ms(details.get("end_time")),
                      instance_count=workers)
        if state is None:
            return JobStatus(state=JobState.PENDING if common["started_at"] is None else JobState.RUNNING,
                             warning=f"Ray reports job status {raw!r}, which Trainboard does not know; the job stays "
                                     f"active until Ray reports a known status.", **common)
        message = str(details.get("message") or "").strip()
        if state is JobState.PENDING:
            return JobStatus(state=state, secondary_state=message.splitlines()[0][:200] if message else "",
                             **{**common, "started_at": None})
        if state is JobState.CANCELLED:
            return JobStatus(state=state, failure_reason=f"stopped on the Ray cluster ({message or 'ray job stop'})",
                             **common)
        if state is JobState.FAILED:
            return JobStatus(state=state, failure_reason=self._failure(handle, details), **common)
        return JobStatus(state=state, **common)

    def _failure(self, handle: JobHandle, details: Mapping[str, Any]) -> str:
        """Why the job failed: the ranks' own error in the last :data:`FAILURE_TAIL_LINES` lines of its
        log (a ``trainer error:`` line of a rank, the user's exception), else our entrypoint's summary,
        else Ray's message (a runtime_env that could not be set up, a driver that died)."""
        node = str(details.get("driver_node_id") or "")
        try:
            body = self._tail(handle.job_name, node, FAILURE_TAIL_LINES) if NODE_ID_RE.fullmatch(node) else None
        except BackendError:
            body = None
        text = (body or b"")[-256 * 1024:].decode("utf-8", "replace")
        lines = [states.unprefixed(ln).strip() for ln in text.splitlines()]
        lines = [ln for ln in lines if ln]
        # The ranks' own output comes before Ray's report of the failed worker (a traceback through our
        # entrypoint, trainer_pkg/ray_entry.py): their error is read there, as torchrun's log is read.
        cut = next((i for i, ln in enumerate(lines) if "trainer_pkg/ray_entry.py" in ln), len(lines))
        summary = next((ln[ln.index("trainer error:"):] for ln in reversed(lines)
                        if "trainer error: the Ray Train run failed" in ln), "")
        found = torchrun_log.failure_line(lines[:cut])
        if found or summary:
            return found or summary
        message = str(details.get("message") or "").strip()
        kind = str(details.get("error_type") or "")
        return (message.splitlines()[0][:500] if message else "the Ray job failed") + (f" ({kind})" if kind else "")

    # -- cancel, logs, listing --------------------------------------------------------------

    def cancel(self, handle: JobHandle) -> None:
        """``POST /api/jobs/<name>/stop``; idempotent (a job already ended answers ``stopped: false``, a
        job the cluster no longer knows 404). Returns without waiting."""
        _check_job_name(handle.job_name)
        response = self._request("POST", f"/api/jobs/{quote(handle.job_name, safe='')}/stop")
        if response.status_code in (200, 404):
            return
        raise ProviderError(f"stopping Ray job {handle.job_name} failed ({response.status_code}): "
                            f"{_last_line(response.text)}", transient=response.status_code >= 500)

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        """Complete lines of the job's log (the driver's, with the workers' output Ray forwards to it)
        after ``cursor`` ("" = the start), oldest first, and the next cursor; at most
        :data:`MAX_LOG_LINES` lines of the log (about :data:`MAX_LOG_BYTES`) per call.

        Ray 2.60's State API tails the file on its node, ``GET /api/v0/logs/file?submission_id=<name>
        &node_id=<driver node>&lines=<N>`` (python/ray/dashboard/modules/state/state_head.py
        ``get_logs``; ``node_id`` is required beside ``submission_id``, ray/util/state/common.py
        ``GetLogOptions``): a call asks for the last 2,000 lines, doubling up to 32,000 while what it
        read before is not inside them, so its cost does not grow with the log
        (:mod:`cloud_adapters.ray.logtail`: the cursor, and a log that outgrew one read, which gets a
        ``[trainboard]`` line saying lines were skipped). The driver's node comes from ``GET
        /api/jobs/<name>`` once and then travels in the cursor. A cursor of the old reader (a byte
        offset) goes on from there while the log fits in one read, else from the log's end.

        No lines and the same cursor: a job the cluster does not know, a driver not started yet, a log
        not written yet. InvalidSpec for a cursor that is not this backend's."""
        _check_job_name(handle.job_name)
        parsed = logtail.TailCursor.parse(cursor)
        if not parsed.node:
            details = self._job(handle.job_name)
            node = str((details or {}).get("driver_node_id") or "")
            if not NODE_ID_RE.fullmatch(node):
                return [], cursor
            parsed = dataclasses.replace(parsed, node=node)
        got = logtail.read(lambda lines: self._tail(handle.job_name, parsed.node, lines), parsed,
                           max_lines=MAX_LOG_LINES, max_bytes=MAX_LOG_BYTES)
        if got is None:
            return [], cursor
        lines, after = got
        return lines, after.text()

    def _tail(self, name: str, node: str, lines: int) -> bytes | None:
        """The last ``lines`` lines of job ``name``'s driver log on node ``node`` (bytes, as the file
        holds them); None when Ray cannot serve it (:data:`_UNREADABLE_LOG`, 404). Throttled on 429 (the
        State API's limit on concurrent calls), ProviderError on another answer."""
        response = self._request("GET", "/api/v0/logs/file",
                                 params={"submission_id": name, "node_id": node, "lines": str(int(lines))})
        if response.status_code == 200:
            return response.content
        if response.status_code == 404 or (response.status_code == 500
                                            and any(s in response.text for s in _UNREADABLE_LOG)):
            return None
        if response.status_code == 429:
            raise Throttled(f"the Ray dashboard at {self.config['address']} is serving too many State API calls "
                            f"(429); the log is read again on the next sync.")
        raise ProviderError(f"reading Ray job {name}'s log failed ({response.status_code}): "
                            f"{_last_line(response.text)}", transient=response.status_code >= 500)

    def list_tagged(self) -> list[ProviderJob]:
        """The cluster's unfinished jobs (PENDING, RUNNING) whose metadata carries ``trainboard-job-name``:
        one ``GET /api/jobs/``."""
        listed = []
        for job in self._list_jobs():
            metadata = job.get("metadata") if isinstance(job, dict) else None
            if not isinstance(metadata, dict) or not metadata.get(TAG_JOB_NAME):
                continue
            state = states.job_state(job.get("status")) or JobState.PENDING
            if state.is_terminal:
                continue
            name = str(job.get("submission_id") or "")
            listed.append(ProviderJob(
                name=str(metadata[TAG_JOB_NAME]), state=state, raw_state=str(job.get("status") or ""),
                job_id=tagged_job_id(metadata), created_at=_ms(job.get("start_time")),
                handle=self._handle(name, _workers(metadata) or 1) if JOB_NAME_RE.fullmatch(name) else None))
        return listed

    def test_connection(self) -> list[ConnectionCheck]:
        """Two read-only checks: the dashboard answers (``GET /api/version``: Ray's version) and the
        cluster's resources fit one worker (``GET /api/cluster_status``: nodes, CPUs, GPUs). Stops after
        a failed first. Never raises."""
        try:
            response = self._request("GET", "/api/version")
            version = _json(response, "GET /api/version") if response.status_code == 200 else None
        except BackendError as exc:
            return [ConnectionCheck("Ray dashboard", False, str(exc))]
        if not isinstance(version, dict) or "ray_version" not in version:
            return [ConnectionCheck("Ray dashboard", False, f"{self.config['address']} answered GET /api/version with "
                                    f"{response.status_code}, not Ray's Jobs API: check the address (the dashboard, "
                                    f"port 8265).")]
        checks = [ConnectionCheck("Ray dashboard", True, f"Ray {version['ray_version']} (Jobs API version "
                                  f"{version.get('version', '?')}) at {self.config['address']}")]
        try:
            response = self._request("GET", "/api/cluster_status")
            report = ((_json(response, "GET /api/cluster_status") or {}).get("data") or {}).get("clusterStatus") or {}
        except (BackendError, AttributeError) as exc:
            return [*checks, ConnectionCheck("resources", False, f"cannot read the cluster's resources ({exc})")]
        usage = (report.get("loadMetricsReport") or {}).get("usage") or {}
        nodes = sum(int(count) for _, count in (report.get("loadMetricsReport") or {}).get("nodeTypes") or []
                    if isinstance(count, int))
        cpus_used, cpus = _usage(usage.get("CPU"))
        gpus_used, gpus = _usage(usage.get("GPU"))
        need_cpu, need_gpu = int(self.config["cpus_per_worker"]), int(self.config["gpus_per_worker"])
        fits = cpus >= need_cpu and gpus >= need_gpu
        text = (f"{nodes} node(s), {cpus:g} CPUs ({cpus - cpus_used:g} free), {gpus:g} GPUs ({gpus - gpus_used:g} free)")
        checks.append(ConnectionCheck("resources", fits, text if fits else
                                      f"{text}: one worker needs {need_cpu} CPU and {need_gpu} GPU (the backend's "
                                      f"CPUs/GPUs per worker); add nodes or lower those settings"))
        return checks


# -- helpers -------------------------------------------------------------------------------------


def _address(value: str) -> str:
    """``value`` as the dashboard's base URL (no trailing slash); InvalidSpec when it is not an http(s)
    URL of a host, or carries credentials, a query or a fragment."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError as exc:
        raise InvalidSpec(f"address: {value[:100]!r} is not a URL ({exc}).") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidSpec(f"address: expected the dashboard's http://<head>:8265, got {value[:100]!r}.")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise InvalidSpec("address: no user, password, query or fragment in the URL; store a token as the "
                          "backend's Ray token instead.")
    del port
    return value.strip().rstrip("/")


def _check_job_name(name: str) -> None:
    if not isinstance(name, str) or not JOB_NAME_RE.fullmatch(name):
        raise InvalidSpec(f"job name {name!r}: must be 1–63 letters, digits or '-', starting with a letter or digit "
                          f"(it is the Ray job's submission id).")


def _json(response, what: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise ProviderError(f"the Ray dashboard answered {what} with {response.status_code} and no JSON: "
                            f"{response.text[:200]!r}") from None


def _last_line(text: str) -> str:
    """The last non-empty line of an error body (Ray answers with a Python traceback)."""
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    lines = [ln for ln in lines if ln != "."]
    return (lines[-1] if lines else "no details")[:500]


def _ms(value: Any) -> dt.datetime | None:
    """A UTC time from Ray's milliseconds since the epoch; None for none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return dt.datetime.fromtimestamp(value / 1000.0, tz=dt.timezone.utc)


def _workers(metadata: Mapping[str, Any]) -> int:
    value = str(metadata.get("trainboard-workers") or "")
    return int(value) if value.isdigit() and int(value) > 0 else 0


def _usage(pair: Any) -> tuple[float, float]:
    """(used, total) of one resource in the autoscaler's load report (``[used, total]``); (0, 0) when absent."""
    if isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(v, (int, float)) for v in pair):
        return float(pair[0]), float(pair[1])
    return 0.0, 0.0


__all__ = ["RayBackend", "SETTINGS", "TAG_JOB_ID"]
