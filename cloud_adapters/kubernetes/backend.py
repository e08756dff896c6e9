"""The Kubernetes backend: a Trainboard job is one Kubeflow Trainer ``TrainJob``, through the official
``kubernetes`` Python client.

What a job is made of: :mod:`cloud_adapters.kubernetes.body` (every field, and the TrainJob API's
source). The image holds Trainboard's ``trainer_pkg`` (and torch); the pods run
``python -m trainer_pkg.launch --config env:TRAINBOARD_JOB_CONFIG --platform kubernetes``, which reads
the ``PET_*`` variables Trainer's torch runtime sets. A job's code archive is not shipped: the
image must hold the code (a job with one is refused with what to do). Datasets: built-in, or
``s3://``, ``gs://``, ``az://`` URIs the trainer reads itself (:mod:`trainer_pkg.objstore`), with the
credentials the pods have. Outputs go to ``<output_path>/<job name>/`` inside the pod (mount a
volume there through the runtime to keep them).

The client: ``kubernetes.config.new_client_from_config(kubeconfig, context)`` — an ``ApiClient`` of
this backend's own, never the module-wide default configuration, since several backends live in
one worker — or the in-cluster service account (``load_incluster_config`` into a fresh
``Configuration``); a stored ``token`` replaces the credentials of either with that bearer token.

Calls (``CustomObjectsApi`` on ``trainer.kubeflow.org/v1alpha1`` ``trainjobs``; ``CoreV1Api``):

* submit: with job secrets, first ``create_namespaced_secret`` of ``<name>-env`` (a 409 is a retried
  submit: the Secret is read and its data patched when its ``trainboard-job-name`` label is the job's);
  then ``create_namespaced_custom_object``; a 409 AlreadyExists is a retried submit: the TrainJob
  of that name is read (``get_namespaced_custom_object``) and adopted when its
  ``trainboard-job-name`` label is the job's (a TrainJob of that name that is not Trainboard's job is
  an error, never adopted); then ``patch_namespaced_secret`` makes the TrainJob the Secret's owner,
  so it is deleted with the TrainJob. A TrainJob the API refuses takes the new Secret with it;
* describe_many: ONE ``list_namespaced_custom_object(label_selector="trainboard-job-name")`` per
  namespace of the batch, and, only for jobs whose counts cannot tell PENDING from RUNNING (an active
  child Job, none ready) or that ended ``Failed`` (was a pod disrupted? a lost run), one
  ``list_namespaced_pod`` with the set-based selector ``jobset.sigs.k8s.io/jobset-name in (…)`` for
  all of them: at most two calls per namespace, whatever the number of jobs;
* cancel: ``delete_namespaced_custom_object`` with ``propagationPolicy: Foreground`` (the pods go
  first, then the TrainJob); a 404 is a job already gone;
* logs: ``list_namespaced_pod`` by ``jobset.sigs.k8s.io/jobset-name=<name>`` and
  ``read_namespaced_pod_log`` per pod (:mod:`cloud_adapters.kubernetes.logs`);
* list_tagged: one list by the ``trainboard-job-name`` label.

States: :mod:`cloud_adapters.kubernetes.states` (how CANCELLED is told from "deleted outside
Trainboard", and a lost run: a Failed TrainJob whose pod Kubernetes disrupted, ``DisruptionTarget``).
A lost run's checkpoints are in ``<output_path>/<job name>/checkpoints``
(:meth:`KubernetesBackend.checkpoint_uri`); the next attempt, a TrainJob of a new name, is given that
directory as its ``output.checkpoint_dir`` and resumes from it when the volume is shared. Errors:
:mod:`cloud_adapters.kubernetes.errors`. Every call goes through :mod:`cloud_adapters.retry` under
one token bucket per cluster configuration.

Cost: an on-premises cluster has no list price. When the backend names a cloud instance type
(``price_provider``/``price_region``/``price_instance_type``: the node pool's machines on a managed
cluster), that catalog row's on-demand price per node-hour; otherwise the internal rate an admin set
for ``cluster``/``node_pool`` (:func:`cloud_adapters.pricing.internal_rate`), 0 when none is set.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from typing import Any, BinaryIO, Callable, Iterable, Mapping, Sequence

from cloud_adapters import retry
from cloud_adapters.base import (
    TAG_JOB_NAME,
    Artifact,
    BackendError,
    Capabilities,
    CredentialsError,
    InvalidSpec,
    JobHandle,
    JobSpec,
    JobStatus,
    MissingDependency,
    ProviderError,
    ProviderJob,
    parse_utc,
    tagged_job_id,
)
from cloud_adapters.cloud import CloudBackend, Probe
from cloud_adapters.gpus import GpuFacts, catalog_gpus
from cloud_adapters.gpubox import _usercode
from cloud_adapters.kubernetes import body as tj
from cloud_adapters.kubernetes import errors, logs as pod_logs, states, syntax
from cloud_adapters.pricing import internal_rate
from cloud_adapters.settings import BackendSettings, Secret, Setting

PROVIDER = "kubernetes"  # provider name of internal rates in the price catalog
SERVICE = "Kubernetes"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
MAX_NODES = 1000
MAX_PROCS_PER_NODE = 1024
MAX_GPUS_PER_NODE = 64
MAX_RUNTIME_S = 28 * 24 * 3600  # the dashboard's longest max runtime
CALL_TIMEOUT_S = (5.0, 30.0)  # (connect, read) seconds of one API request
RATE = 10.0  # calls per second per cluster configuration (the client's own default QPS is 5, burst 10)
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"  # a well-known label (kubernetes.io "Well-Known Labels")
PERMISSIONS = (("create", "trainjobs", "", "trainer.kubeflow.org"), ("get", "trainjobs", "", "trainer.kubeflow.org"),
               ("list", "trainjobs", "", "trainer.kubeflow.org"), ("delete", "trainjobs", "", "trainer.kubeflow.org"),
               ("list", "pods", "", ""), ("get", "pods", "log", ""), ("create", "secrets", "", ""),
               ("get", "secrets", "", ""), ("patch", "secrets", "", ""), ("delete", "secrets", "", ""))
"""What the worker's identity needs in the namespace: (verb, resource, subresource, API group)."""
PRICE_PROVIDERS = (("aws", "AWS"), ("gcp", "Google Cloud"), ("azure", "Azure"))

SETTINGS = BackendSettings(
    backend_label="Kubernetes (Kubeflow Trainer)", provider="Kubernetes",
    settings=(
        # Where the worker sends its calls and as whom: the operator's (TRAINBOARD_K8S_*).
        Setting("kubeconfig", "Kubeconfig file",
                "Absolute path of the kubeconfig the worker reads; blank with in-cluster = the worker pod's "
                "service account.", host=True, field=False),
        Setting("context", "Kubeconfig context", "The kubeconfig context to use; blank = its current-context.",
                host=True, field=False, max_length=253),
        Setting("in_cluster", "In-cluster config", "Use the worker pod's own service account (no kubeconfig).",
                type=bool, host=True, field=False, default=False),
        Setting("namespace", "Namespace", "Where the TrainJobs are created, e.g. team-a; blank = default.", max_length=63,
                default="default"),
        Setting("runtime", "Training runtime",
                "The ClusterTrainingRuntime the TrainJobs use (Kubeflow Trainer's torch runtime: torch-distributed).",
                max_length=253, default="torch-distributed"),
        Setting("image", "Trainer image",
                "The container image the pods run: it must hold Trainboard's trainer_pkg and torch, e.g. "
                "ghcr.io/acme/trainboard-trainer:1.4.", required=True, max_length=500),
        Setting("gpus_per_node", "GPUs per node", "nvidia.com/gpu each pod asks for; 0 for CPU-only pods.",
                type=int, min_value=0, max_value=MAX_GPUS_PER_NODE, default=0),
        Setting("cpu_request", "CPU request", "CPU each pod requests, a Kubernetes quantity (e.g. 8 or 500m); "
                "blank = none.", max_length=32, default=""),
        Setting("memory_request", "Memory request", "Memory each pod requests (e.g. 32Gi); blank = none.",
                max_length=32, default=""),
        Setting("node_selector", "Node selector",
                "Node labels the pods must match, as {\"key\": \"value\"} or key=value pairs.", field=False),
        Setting("tolerations", "Tolerations",
                "Taints the pods tolerate: a list of {key, operator, value, effect, tolerationSeconds}.", field=False),
        # A service account is an identity inside the cluster: the operator's decision.
        Setting("service_account", "Service account", "The Kubernetes service account the pods run as; blank = "
                "the runtime's.", host=True, field=False),
        Setting("suspend", "Create suspended", "Create TrainJobs suspended, for Kueue (or a person) to admit.",
                type=bool, default=False),
        Setting("queue_name", "Kueue queue", "The LocalQueue the TrainJobs join (kueue.x-k8s.io/queue-name); "
                "blank = none.", max_length=63, default=""),
        Setting("cluster", "Cluster name", "The cluster's name in the price catalog's internal rates (its region).",
                max_length=100, default="default"),
        Setting("node_pool", "Node pool", "The node pool's name in the price catalog's internal rates.",
                max_length=100, default="default"),
        Setting("price_provider", "Price from cloud", "Price a node as this cloud's instance type instead of an "
                "internal rate (a managed cluster's node pool).", choices=PRICE_PROVIDERS, field=False),
        Setting("price_region", "Price region", "The cloud region of that instance type, e.g. us-east-1.",
                max_length=50, field=False),
        Setting("price_instance_type", "Price instance type",
                "The node pool's instance type in the catalog, e.g. n1-standard-8.", max_length=100, field=False),
        Setting("output_path", "Output directory in the pod",
                "Where each job writes model and checkpoints inside the pod (<path>/<job name>); mount a volume "
                "there through the runtime to keep them.", field=False, max_length=500, default="/workspace/output"),
        Setting("max_nodes", "Max nodes", "The most nodes one job may ask for.", type=int, min_value=1,
                max_value=MAX_NODES, field=False, default=16),
        Setting("max_procs_per_node", "Max processes per node",
                "The most processes per node of a CPU-only job (with GPUs: one per GPU).", type=int, min_value=1,
                max_value=MAX_PROCS_PER_NODE, field=False, default=8),
        # Which images users may run on the cluster with its service account: the operator's.
        Setting("allowed_images", "Allowed images",
                "Images the backend and its jobs may name, separated by commas or spaces: exact references or "
                "prefixes ending in * (ghcr.io/acme/*; * alone: any); blank = none.", host=True, field=False),
    ),
    secrets=(Secret("token", "Bearer token"),),
)
"""The settings of a Kubernetes backend (:mod:`cloud_adapters.settings`); ``kubeconfig``, ``context``,
``in_cluster``, ``service_account`` and ``allowed_images`` are host settings. Secret: ``token``, a
bearer token used instead of the kubeconfig's user."""


def _shown(value: Any) -> str:
    return repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."


def trainjob_name(job_name: str) -> str:
    """The TrainJob's ``metadata.name`` for ``job_name``: the name itself when it is an RFC 1035 label
    of at most 63 characters (the TrainJob CRD's rule; Trainboard's ``tb-job-<id>-<hex>`` are). Any
    other raises :class:`InvalidSpec`: a name mapped to another could collide, and the job's label
    must carry it unchanged."""
    if not job_name:
        raise InvalidSpec("job name: required.")
    if len(job_name) > 63 or not syntax.DNS1035_LABEL.fullmatch(job_name):
        raise InvalidSpec(f"job name {_shown(job_name)}: a TrainJob's name is at most 63 lowercase letters, digits "
                          f"and '-', starting with a letter.")
    return job_name


class PermissionProblem(Exception):
    """A connection check that found something to fix (its message says what)."""


class KubernetesBackend(CloudBackend):
    """Runs each job as a Kubeflow Trainer TrainJob; see the module docstring."""

    kind = "kubernetes"
    service = SERVICE
    states = states.STATES
    stop_verb = "delete"
    settings = SETTINGS
    image_setting = "image"
    image_torch_pattern = r"pytorch[^:]*:(\d+\.\d+)"  # pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime → 2.9
    dataset_schemes = frozenset({"s3", "gs", "az"})
    """Object storage the trainer reads itself (trainer_pkg.objstore) with the pods' credentials; a
    local path would be one on the worker, which the pods do not see."""
    # activeDeadlineSeconds: "relative to the TrainJob start time (which resets on resume from
    # suspension)"; once reached the pods are terminated (trainjob_types.go).
    max_runtime_covers = (
        "the TrainJob's active time from its start (restarted when a suspended job is resumed): scheduling the "
        "pods, pulling the image and connecting the nodes count; at the limit Kubeflow Trainer terminates the "
        "pods (Kubeflow Trainer API reference, TrainJob activeDeadlineSeconds)")
    ambient_identity = ("the worker's kubeconfig user (the kubeconfig host setting) or its pod's in-cluster "
                        "service account")

    def __init__(self, config: Mapping[str, Any] | None = None, *, secrets: Mapping[str, str] | None = None,
                 prices=None, retry_policy: retry.RetryPolicy | None = None, clock: retry.Clock | None = None,
                 api_client: Any = None) -> None:
        super().__init__(config, secrets=secrets, prices=prices)
        self.retry_policy = retry_policy or retry.RetryPolicy()
        self.clock = clock or retry.SYSTEM_CLOCK
        self._api_client = api_client
        self._lock = threading.Lock()
        self._deleted: set[tuple[str, str]] = set()
        """(namespace, name) of the TrainJobs this adapter object deleted (cancel): a 404 for one of
        them is CANCELLED (:mod:`.states`)."""

    # -- configuration ----------------------------------------------------------------------

    @classmethod
    def clean_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Every problem at once (:class:`~cloud_adapters.base.SettingsProblems`): one InvalidSpec whose
        ``errors`` name each setting that is missing or malformed."""
        from cloud_adapters.base import setting_value

        problems = cls.settings_problems(config)
        out = SETTINGS.defaults
        given = {k: v for k, v in config.items()
                 if k in SETTINGS.keys and v is not None and not (isinstance(v, str) and not v.strip())}
        structured = {"node_selector", "tolerations"}
        for key, value in given.items():
            if key in structured:
                continue
            with problems.about(key):
                out[key] = setting_value(SETTINGS[key], value)
        with problems.about("node_selector"):
            out["node_selector"] = syntax.node_selector("node_selector", given.get("node_selector"))
        with problems.about("tolerations"):
            out["tolerations"] = syntax.tolerations("tolerations", given.get("tolerations"))

        def check(key: str, test: Callable[[str], bool], message: str) -> None:
            value = out.get(key)
            if isinstance(value, str) and value and not problems.has(key) and not test(value):
                problems.add(key, f"{key}: {_shown(value)} {message}")

        kubeconfig = out.get("kubeconfig") or ""
        if isinstance(kubeconfig, str) and kubeconfig and not problems.has("kubeconfig"):
            if not os.path.isabs(kubeconfig) or "\0" in kubeconfig:
                problems.add("kubeconfig", f"kubeconfig: expected an absolute path, got {_shown(kubeconfig)}.")
        if not kubeconfig and not out.get("in_cluster") and not problems.has("kubeconfig"):
            problems.add("kubeconfig", "kubeconfig: set the path of a kubeconfig file, or in-cluster config "
                                       "(TRAINBOARD_K8S_KUBECONFIG or TRAINBOARD_K8S_IN_CLUSTER for the installation).")
        if kubeconfig and out.get("in_cluster") and not problems.has("in_cluster"):
            problems.add("in_cluster", "in_cluster: a kubeconfig is set too; use one or the other.")
        check("namespace", syntax.dns_label, "is not a namespace name (at most 63 lowercase letters, digits and '-').")
        check("runtime", syntax.dns_subdomain, "is not a runtime name (lowercase letters, digits, '-' and '.').")
        check("service_account", syntax.dns_subdomain,
              "is not a service account name (lowercase letters, digits, '-' and '.').")
        check("queue_name", lambda v: syntax.dns_subdomain(v) and len(v) <= 63,
              "is not a LocalQueue name (at most 63 lowercase letters, digits, '-' and '.').")
        check("image", lambda v: bool(_usercode.IMAGE_RE.fullmatch(v)),
              "is not an image reference such as ghcr.io/acme/trainer:1.4.")
        check("output_path", lambda v: v.startswith("/") and "\0" not in v, "is not an absolute path.")
        for key in ("cpu_request", "memory_request"):
            with problems.about(key):
                out[key] = syntax.quantity(key, out.get(key))
        allowed = out.get("allowed_images") or ""
        with problems.about("allowed_images"):
            if (image_problems := _usercode.image_pattern_problems(allowed)):
                raise InvalidSpec(image_problems[0])
        image = out.get("image") or ""
        if image and not problems.has("image") and not problems.has("allowed_images") \
                and not _usercode.image_allowed(image, allowed):
            problems.add("image", f"image: {_shown(image)} is not among the images the operator allows "
                                  f"({', '.join(_usercode.image_patterns(allowed)) or 'none'}; "
                                  f"TRAINBOARD_K8S_ALLOWED_IMAGES).")
        priced = [k for k in ("price_provider", "price_region", "price_instance_type") if out.get(k)]
        if priced and len(priced) < 3:
            for key in ("price_provider", "price_region", "price_instance_type"):
                if not out.get(key) and not problems.has(key):
                    problems.add(key, f"{key}: needed too when a node is priced as a cloud instance type (set "
                                      f"all three, or none for an internal rate).")
        problems.raise_if_any()
        return out

    @property
    def namespace(self) -> str:
        return self.config["namespace"]

    @property
    def capabilities(self) -> Capabilities:
        gpus = self.config["gpus_per_node"]
        return Capabilities(spot=False, max_nodes=self.config["max_nodes"],
                            max_procs_per_node=gpus if gpus > 0 else self.config["max_procs_per_node"],
                            strategies=self.runnable_strategies())

    # -- prices -----------------------------------------------------------------------------

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        """USD per node-hour: the catalog row of ``price_provider``/``price_region``/
        ``price_instance_type`` when set (InvalidSpec when the catalog lacks it), else the internal
        rate of ``cluster`` and ``node_pool`` (``instance_type`` or the backend's) with
        ``gpus_per_node`` GPUs, 0 when no rate is set. There is no spot capacity here."""
        if spot:
            raise InvalidSpec("This backend has no spot capacity; untick spot.")
        if self.config.get("price_instance_type"):
            provider, region, itype = (self.config["price_provider"], self.config["price_region"],
                                       self.config["price_instance_type"])
            row = self.prices.lookup(provider, region, itype)
            if row is None:
                raise InvalidSpec(f"price instance type {itype!r} has no {provider} price in the catalog for {region}; "
                                  f"add the row or clear the price settings for an internal rate.")
            return float(row.usd_per_hour)
        rate = internal_rate(self.prices, PROVIDER, self.config["cluster"], instance_type or self.config["node_pool"],
                             self.config["gpus_per_node"])
        return float(rate) if rate is not None else 0.0

    def price_note(self, instance_type: str = "") -> str:
        """"no internal rate is set for node pool P on cluster C …" when jobs are priced by an internal
        rate and the catalog has none; "" otherwise."""
        if self.config.get("price_instance_type"):
            return ""
        pool, cluster = instance_type or self.config["node_pool"], self.config["cluster"]
        if internal_rate(self.prices, PROVIDER, cluster, pool, self.config["gpus_per_node"]) is not None:
            return ""
        return (f"no internal rate is set for node pool {pool} on cluster {cluster}, so jobs here cost $0; an admin "
                f"sets it in the price catalog (provider kubernetes, region {cluster}, instance type {pool})")

    def gpus(self, instance_type: str = "") -> GpuFacts | None:
        """``gpus_per_node`` GPUs of the priced instance type's model (catalog) when the backend names
        one; count 0 for CPU-only pods; None (unknown memory) otherwise."""
        count = self.config["gpus_per_node"]
        if count == 0:
            return GpuFacts(model="", count=0, memory_gib=None, source="gpus_per_node is 0")
        if self.config.get("price_instance_type"):
            facts = catalog_gpus(self.prices, self.config["price_provider"], self.config["price_instance_type"])
            if facts is not None:
                return GpuFacts(model=facts.model, count=count, memory_gib=facts.memory_gib, source=facts.source)
        return None

    # -- validate / build -------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Base checks (nodes, processes, no spot, runtime ≥ 1 s) plus the cluster's own: the name a
        TrainJob may have, processes ≤ GPUs per node, the image allowed, no code archive (the image
        holds the code), no trainer package location, a dataset the pods can read, the body's
        variables and labels. Makes no call."""
        trainjob_name(spec.job_name)
        gpus = self.config["gpus_per_node"]
        if gpus and spec.procs_per_node > gpus:
            raise InvalidSpec(f"{spec.procs_per_node} processes per node with {gpus} GPUs per node: each rank needs "
                              f"its own GPU; ask for at most {gpus} (world size {spec.nodes} × {gpus} = "
                              f"{spec.nodes * gpus}).", field="procs_per_node")
        super().validate(spec)
        if spec.max_runtime_s > MAX_RUNTIME_S:
            raise InvalidSpec(f"max runtime {spec.max_runtime_s} s is over {MAX_RUNTIME_S} s (28 days).", field="max_runtime_s")
        if spec.instance_type and spec.instance_type != self.config["node_pool"]:
            raise InvalidSpec(f"instance type {spec.instance_type!r}: this backend runs on node pool "
                              f"{self.config['node_pool']!r} (its setting); leave the instance type blank.", field="instance_type")
        if spec.image and not _usercode.image_allowed(spec.image, self.config.get("allowed_images") or ""):
            raise InvalidSpec(f"image {spec.image!r} is not among the images the operator allows on this cluster "
                              f"({', '.join(_usercode.image_patterns(self.config.get('allowed_images') or '')) or 'none'}).", field="image")
        if spec.image and not _usercode.IMAGE_RE.fullmatch(spec.image):
            raise InvalidSpec(f"image {spec.image[:80]!r} is not an image reference.", field="image")
        if spec.code is not None:
            raise InvalidSpec("This Kubernetes backend runs the code its image holds and ships no code archive; build "
                              "an image with your code (and Trainboard's trainer_pkg) and run the job in it, or run "
                              "the job on another backend.")
        if spec.trainer_package_uri:
            raise InvalidSpec("trainer package: the image holds trainer_pkg on Kubernetes; leave it empty.")
        if spec.checkpoint_uri:
            # Only a directory the pods see on the output volume (checkpoint_uri's answer for an earlier
            # attempt): a path elsewhere would be a directory of the pod's own image or node.
            root = self._output_root()
            if (not spec.checkpoint_uri.startswith(f"{root}/") or "\0" in spec.checkpoint_uri
                    or ".." in spec.checkpoint_uri.split("/") or spec.checkpoint_uri.rstrip("/") == root):
                raise InvalidSpec(f"checkpoints {spec.checkpoint_uri[:200]!r}: expected a directory under the output "
                                  f"path {root}/ (Backend.checkpoint_uri of an earlier attempt).")
        if not isinstance(spec.config, Mapping):
            raise InvalidSpec("config: expected a JSON object (the trainer_pkg JobConfig as a dict).")
        try:
            json.dumps(spec.config)
        except (TypeError, ValueError) as exc:
            raise InvalidSpec(f"config: not JSON-serialisable ({exc}).") from None
        self.train_job(spec)

    def job_config(self, spec: JobSpec) -> dict[str, Any]:
        """The config the pods run: ``spec.config`` with the output and checkpoint directories set
        (``spec.output_uri``/``checkpoint_uri``, else ``<output_path>/<job name>``)."""
        out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in spec.config.items()}
        output = out.setdefault("output", {})
        if not isinstance(output, dict):
            raise InvalidSpec(f"config.output: expected an object of fields, got {output!r:.100}")
        output["output_dir"] = spec.output_uri or f"{self.config['output_path'].rstrip('/')}/{spec.job_name}"
        output["checkpoint_dir"] = spec.checkpoint_uri or f"{output['output_dir']}/checkpoints"
        return out

    def train_job(self, spec: JobSpec) -> dict[str, Any]:
        """The TrainJob body for ``spec`` (:func:`cloud_adapters.kubernetes.body.train_job`)."""
        return tj.train_job(spec, name=trainjob_name(spec.job_name), namespace=self.namespace, config=self.config,
                            job_config=self.job_config(spec))

    def secret(self, spec: JobSpec) -> dict[str, Any] | None:
        """The Secret of ``spec``'s job secrets (:func:`cloud_adapters.kubernetes.body.secret`); None without any."""
        return tj.secret(spec, trainjob=trainjob_name(spec.job_name), namespace=self.namespace, config=self.config)

    # -- the client -------------------------------------------------------------------------

    def api_client(self) -> Any:
        """This backend's ``kubernetes.client.ApiClient``, built once (module docstring). Raises
        :class:`CredentialsError` for a kubeconfig or in-cluster configuration that cannot be loaded."""
        with self._lock:
            if self._api_client is None:
                self._api_client = self._make_client()
            return self._api_client

    def _make_client(self) -> Any:
        try:
            from kubernetes import client as k8s_client
            from kubernetes import config as k8s_config
        except ImportError as exc:  # pragma: no cover - the package __init__ checks first
            raise MissingDependency(f"the Kubernetes backend needs the kubernetes package ({exc})") from exc
        try:
            if self.config.get("in_cluster"):
                configuration = k8s_client.Configuration()
                k8s_config.load_incluster_config(client_configuration=configuration)
                api = k8s_client.ApiClient(configuration)
            else:
                api = k8s_config.new_client_from_config(config_file=self.config["kubeconfig"],
                                                        context=self.config.get("context") or None,
                                                        persist_config=False)
        except (k8s_config.ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
            where = "the in-cluster service account" if self.config.get("in_cluster") else \
                f"kubeconfig {self.config.get('kubeconfig')}" + (f" context {self.config['context']}"
                                                                  if self.config.get("context") else "")
            raise CredentialsError(f"Kubernetes: cannot load {where}: {str(exc)[:300]}; check the file and the "
                                   f"context (or that the worker runs in a pod with a service account).") from None
        token = self.secrets.get("token")
        if token:
            # The loaders install a hook that puts the kubeconfig's (or the pod's) token back before
            # every request: without it, the stored token is the only credential sent.
            api.configuration.refresh_api_key_hook = None
            api.configuration.api_key = {"authorization": f"Bearer {token}"}
            api.configuration.api_key_prefix = {}
        return api

    def custom(self) -> Any:
        from kubernetes.client import CustomObjectsApi

        return CustomObjectsApi(self.api_client())

    def core(self) -> Any:
        from kubernetes.client import CoreV1Api

        return CoreV1Api(self.api_client())

    def classify(self, exc: BaseException, *, service: str) -> retry.Verdict | None:
        return errors.classify(exc, service=service)

    def rate_limit(self) -> tuple[str, float]:
        where = "in-cluster" if self.config.get("in_cluster") else self.config.get("kubeconfig", "")
        return f"kubernetes:{where}:{self.config.get('context') or ''}", RATE

    def _maybe(self, fn: Callable[[], Any], missing: int = 404) -> Any:
        """``fn()`` through :meth:`call`, None when the API answers ``missing`` (404: no such object)."""
        from kubernetes.client.exceptions import ApiException

        def attempt() -> Any:
            try:
                return fn()
            except ApiException as exc:
                if exc.status == missing:
                    return None
                raise

        return self.call(attempt)

    # -- CloudBackend hooks -----------------------------------------------------------------

    def provider_name(self, job_name: str) -> str:
        return trainjob_name(job_name)

    def job_ref(self, handle: JobHandle) -> str:
        return handle.provider_job_id or trainjob_name(handle.job_name)

    def _handle_namespace(self, handle: JobHandle) -> str:
        value = (handle.extra or {}).get("namespace")
        return value if isinstance(value, str) and syntax.dns_label(value) else self.namespace

    def no_job(self, ref: str) -> str:
        return f"Kubernetes has no TrainJob {ref!r} in namespace {self.namespace}"

    def get_job(self, ref: str, namespace: str = "") -> Mapping[str, Any] | None:
        return self._maybe(lambda: self.custom().get_namespaced_custom_object(
            tj.GROUP, tj.VERSION, namespace or self.namespace, tj.PLURAL, ref, _request_timeout=CALL_TIMEOUT_S))

    def create_job(self, spec: JobSpec, name: str, request: Any) -> Any:
        """Create the TrainJob ``request`` (its body) in this backend's namespace: the created object, or
        None when one of that name exists already (409; :meth:`submit` decides whether to adopt it)."""
        return self._maybe(lambda: self.custom().create_namespaced_custom_object(
            tj.GROUP, tj.VERSION, self.namespace, tj.PLURAL, request, _request_timeout=CALL_TIMEOUT_S), missing=409)

    def stop_job(self, ref: str, namespace: str = "") -> None:
        """Delete TrainJob ``ref`` with foreground propagation (its pods stop first); a 404 is already gone."""
        from kubernetes.client import V1DeleteOptions

        self._maybe(lambda: self.custom().delete_namespaced_custom_object(
            tj.GROUP, tj.VERSION, namespace or self.namespace, tj.PLURAL, ref,
            body=V1DeleteOptions(propagation_policy="Foreground"), _request_timeout=CALL_TIMEOUT_S))

    def stop_refused(self, exc: BackendError) -> bool:
        return False

    def job_handle(self, job_name: str, job: Any) -> JobHandle:
        meta = job.get("metadata") or {}
        return JobHandle(provider=self.kind, job_name=job_name, provider_job_id=str(meta.get("name") or ""),
                         extra={"namespace": str(meta.get("namespace") or self.namespace),
                                "uid": str(meta.get("uid") or "")})

    def job_status(self, job: Any) -> JobStatus:
        return states.job_status(job)

    def raw_state(self, job: Any) -> str:
        return states.raw_state(job)

    def job_tags(self, job: Any) -> Mapping[str, str]:
        return dict((job.get("metadata") or {}).get("labels") or {})

    def created_at(self, job: Any) -> dt.datetime | None:
        return parse_utc((job.get("metadata") or {}).get("creationTimestamp"))

    def list_trainjobs(self, namespace: str = "") -> list[Mapping[str, Any]]:
        """Trainboard's TrainJobs in ``namespace`` (default the backend's): one list call selected by
        the ``trainboard-job-name`` label."""
        answer = self.call(lambda: self.custom().list_namespaced_custom_object(
            tj.GROUP, tj.VERSION, namespace or self.namespace, tj.PLURAL, label_selector=TAG_JOB_NAME,
            _request_timeout=CALL_TIMEOUT_S))
        return [item for item in (answer or {}).get("items") or [] if isinstance(item, Mapping)]

    def unfinished_jobs(self) -> Iterable[Any]:
        return [job for job in self.list_trainjobs() if states.raw_state(job) not in self.states.terminal]

    def list_pods(self, selector: str, namespace: str = "") -> list[dict[str, Any]]:
        """The pods matching label ``selector`` in ``namespace``, as the API's JSON (one call)."""
        def fetch() -> list[dict[str, Any]]:
            response = self.core().list_namespaced_pod(namespace or self.namespace, label_selector=selector,
                                                       _preload_content=False, _request_timeout=CALL_TIMEOUT_S)
            data = json.loads(response.data or b"{}")
            return [p for p in data.get("items") or [] if isinstance(p, dict)]

        return self.call(fetch)

    # -- the operations ---------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> JobHandle:
        """Create the TrainJob; idempotent by name: a 409 AlreadyExists adopts the TrainJob of that
        name when its ``trainboard-job-name`` label is ``spec.job_name`` (one create call, and one get
        after a 409). Raises InvalidSpec (422 with the server's message, or one of :meth:`validate`),
        CredentialsError, Throttled or ProviderError; ProviderError when the name is taken by a
        TrainJob that is not this job's."""
        self.validate(spec)
        body = self.train_job(spec)
        name = body["metadata"]["name"]
        secret = self.secret(spec)
        made_secret = secret is not None and self._put_secret(spec, secret)
        try:
            created = self.create_job(spec, name, body)
        except InvalidSpec:
            if made_secret:  # the API refused the TrainJob: no Secret left behind for a job that never was
                self._delete_secret(secret["metadata"]["name"])
            raise
        job = created if created is not None else self._adoptable(spec, name)
        if secret is not None:
            self._own_secret(secret["metadata"]["name"], job)
        return self.job_handle(spec.job_name, job)

    def _put_secret(self, spec: JobSpec, secret: Mapping[str, Any]) -> bool:
        """Create the job's Secret; True when this call created it. When one of that name exists (a
        retried submit) and carries this job's label, its data is replaced with the job's current
        secrets; one that is not this job's raises ProviderError."""
        name = secret["metadata"]["name"]
        created = self._maybe(lambda: self.core().create_namespaced_secret(
            self.namespace, secret, _request_timeout=CALL_TIMEOUT_S), missing=409)
        if created is not None:
            return True
        existing = self._maybe(lambda: self.core().read_namespaced_secret(
            name, self.namespace, _request_timeout=CALL_TIMEOUT_S))
        label = str(((getattr(existing, "metadata", None) and existing.metadata.labels) or {}).get(TAG_JOB_NAME, ""))
        if existing is None or label != spec.job_name:
            raise ProviderError(f"namespace {self.namespace} already has a Secret {name!r} that is not this job's "
                                f"(its {TAG_JOB_NAME} label is {label!r}); delete it or use another namespace.")
        self.call(lambda: self.core().patch_namespaced_secret(
            name, self.namespace, {"data": secret["data"]}, _request_timeout=CALL_TIMEOUT_S))
        return False

    def _own_secret(self, name: str, job: Mapping[str, Any]) -> None:
        """Make TrainJob ``job`` the owner of Secret ``name`` (``metadata.ownerReferences``): the garbage
        collector deletes the Secret once the TrainJob is deleted."""
        meta = job.get("metadata") or {}
        owner = {"apiVersion": tj.API_VERSION, "kind": "TrainJob", "name": str(meta.get("name") or ""),
                 "uid": str(meta.get("uid") or "")}
        self.call(lambda: self.core().patch_namespaced_secret(
            name, self.namespace, {"metadata": {"ownerReferences": [owner]}}, _request_timeout=CALL_TIMEOUT_S))

    def _delete_secret(self, name: str) -> None:
        self._maybe(lambda: self.core().delete_namespaced_secret(name, self.namespace, _request_timeout=CALL_TIMEOUT_S))

    def _adoptable(self, spec: JobSpec, name: str) -> Mapping[str, Any]:
        """The existing TrainJob ``name`` after a 409, when it is this job's (its label); else ProviderError."""
        existing = self.get_job(name)
        if existing is None:
            raise ProviderError(f"Kubernetes answered that TrainJob {name!r} exists, then that it does not (it is being "
                                f"deleted?); the submit is retried.", transient=True)
        label = str((existing.get("metadata") or {}).get("labels", {}).get(TAG_JOB_NAME, ""))
        if label != spec.job_name:
            raise ProviderError(f"namespace {self.namespace} already has a TrainJob {name!r} that is not this job's "
                                f"(its {TAG_JOB_NAME} label is {label!r}); delete it or use another namespace.")
        return existing

    def describe(self, handle: JobHandle) -> JobStatus:
        """The job's status: one get (and its pods when the counts cannot tell PENDING from RUNNING);
        a TrainJob gone is CANCELLED after this adapter deleted it, else FAILED (:mod:`.states`)."""
        return self.describe_many([handle])[handle.job_name]

    def describe_many(self, handles: Sequence[JobHandle],
                      changed_since: dt.datetime | None = None) -> dict[str, JobStatus]:
        """Statuses keyed by job name: one label-selected TrainJob list per namespace of the batch,
        and at most one pod list for the jobs whose child Jobs are active but not ready and those that
        ended Failed (``jobset-name in (…)``; :func:`.states.needs_pods`): a Failed one with a pod
        that ended disrupted is FAILED ``lost`` (:func:`.states.disruption_reason`). Every handle gets
        a status (a gone TrainJob is CANCELLED or FAILED).
        ``changed_since`` is not used: the list is one call whatever changed. Throttling or
        connection errors that outlast the retries raise."""
        if changed_since is not None and changed_since.tzinfo is None:
            raise ValueError("changed_since must be timezone-aware (UTC)")
        by_namespace: dict[str, list[JobHandle]] = {}
        for handle in handles:
            by_namespace.setdefault(self._handle_namespace(handle), []).append(handle)
        out: dict[str, JobStatus] = {}
        now = dt.datetime.now(dt.timezone.utc)
        for namespace, group in by_namespace.items():
            found = {str((job.get("metadata") or {}).get("name")): job for job in self.list_trainjobs(namespace)}
            jobs = {h.job_name: found.get(self.job_ref(h)) for h in group}
            # Pending-or-running undecided, or Failed (lost?): one pod list for all of them.
            read = sorted({self.job_ref(h) for h in group if jobs[h.job_name] is not None
                           and states.needs_pods(jobs[h.job_name])})
            pods: dict[str, list[states.PodView]] = {}
            if read:
                for pod in self.list_pods(f"{JOBSET_LABEL} in ({','.join(read)})", namespace):
                    owner = ((pod.get("metadata") or {}).get("labels") or {}).get(JOBSET_LABEL, "")
                    pods.setdefault(owner, []).append(states.pod_view(pod))
            for handle in group:
                job = jobs[handle.job_name]
                ref = self.job_ref(handle)
                if job is None:
                    out[handle.job_name] = states.gone_status((namespace, ref) in self._deleted, now)
                    continue
                views = pods.get(ref)
                reason = next((p.waiting for p in views or () if p.waiting), "")
                out[handle.job_name] = states.job_status(job, [p.phase for p in views] if views is not None else None,
                                                         reason, pods=views or ())
        return out

    def cancel(self, handle: JobHandle) -> None:
        """Delete the TrainJob with foreground propagation (its pods are stopped first); returns at
        once. Idempotent: a 404 is a TrainJob already gone. Remembers the name, so that the next
        describe of it (404) is CANCELLED."""
        namespace, ref = self._handle_namespace(handle), self.job_ref(handle)
        self._deleted.add((namespace, ref))
        self.stop_job(ref, namespace)

    def list_tagged(self) -> list[ProviderJob]:
        """Trainboard's TrainJobs (``trainboard-job-name`` label) without a terminal condition, in the
        backend's namespace: one list call."""
        found = []
        for job in self.list_trainjobs():
            tags = self.job_tags(job)
            name = str(tags.get(TAG_JOB_NAME) or "")
            status = states.job_status(job)
            if not name or status.state.is_terminal:
                continue
            found.append(ProviderJob(name=name, state=status.state, raw_state=status.raw_state,
                                     job_id=tagged_job_id(tags), created_at=self.created_at(job),
                                     handle=self.job_handle(name, job)))
        return found

    # -- artifacts --------------------------------------------------------------------------
    # A job writes its model and checkpoints to <output_path>/<job name>/ inside its pods, on
    # whatever volume the runtime mounts there (a PVC, a hostPath, nothing at all). The API server
    # offers no way to read a volume's files, and the adapter has no credentials for the storage
    # behind it: the dashboard lists none, and says where they are.

    def _outputs_unreachable(self, handle: JobHandle) -> str:
        where = f"{self.config['output_path'].rstrip('/')}/{handle.job_name}/"
        return (f"a Kubernetes job's files are not reachable from the dashboard: its model and checkpoints are in "
                f"{where} inside its pods, on the volume the runtime mounts there; read them from that volume "
                f"(a pod that mounts it, or the storage behind it).")

    def artifacts(self, handle: JobHandle) -> list[Artifact]:
        """Raises ProviderError saying where the files are (inside the pods' volume, out of reach)."""
        raise ProviderError(self._outputs_unreachable(handle))

    def open_artifact(self, handle: JobHandle, name: str) -> BinaryIO:
        """Raises InvalidSpec: no file of a Kubernetes job is reachable (:meth:`artifacts`)."""
        raise InvalidSpec(f"job {handle.job_name} has no artifact {name!r}: {self._outputs_unreachable(handle)}")

    def artifact_uri(self, handle: JobHandle, name: str) -> str:
        """The path inside a later pod on the same volume, when ``name`` is one the job wrote there."""
        if not name or ".." in name.split("/") or name.startswith("/"):
            return ""
        return f"{self.config['output_path'].rstrip('/')}/{handle.job_name}/{name}"

    def checkpoint_uri(self, handle: JobHandle) -> str:
        """Where the job's trainer wrote its checkpoints: ``<output_path>/<job name>/checkpoints``, the
        ``output.checkpoint_dir`` :meth:`job_config` gives a job given none (``artifact_uri(handle,
        "checkpoints")``), a path inside the pods on the volume the runtime mounts at the output path.
        The place is the adapter's, never read back from the cluster: no call. A later attempt given it
        as :attr:`JobSpec.checkpoint_uri` writes to, and resumes from, that directory (the trainer
        resumes by default from a checkpoint there), when the volume is one all pods share (a
        ReadWriteMany PVC); on a pod-local volume the directory is empty and the attempt starts over."""
        return f"{self._output_root()}/{trainjob_name(handle.job_name)}/checkpoints"

    def _output_root(self) -> str:
        return self.config["output_path"].rstrip("/")

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        """New lines of the job's pods since ``cursor``, rank 0 first (:mod:`cloud_adapters.kubernetes.logs`
        for the cursor and line format). Calls: one pod list, one log read per started pod."""
        from kubernetes.client.exceptions import ApiException

        pod_logs.parse_cursor(cursor)
        namespace, ref = self._handle_namespace(handle), self.job_ref(handle)
        views = [states.pod_view(p) for p in self.list_pods(f"{JOBSET_LABEL}={ref}", namespace)]
        started = [v for v in views if v.phase != "Pending"]

        def fetch(pod: states.PodView, since: int | None, limit: int) -> bytes | None:
            kwargs: dict[str, Any] = {"timestamps": True, "limit_bytes": limit, "_preload_content": False,
                                      "_request_timeout": CALL_TIMEOUT_S}
            if since is not None:
                kwargs["since_seconds"] = since
            if tj.NODE_JOB in pod.containers and len(pod.containers) > 1:
                kwargs["container"] = tj.NODE_JOB

            def read() -> bytes | None:
                try:
                    return self.core().read_namespaced_pod_log(pod.name, namespace, **kwargs).data
                except ApiException as exc:
                    if exc.status in (400, 404):  # not started yet, or gone
                        return None
                    raise

            return self.call(read)

        return pod_logs.read_new(started, cursor, fetch, dt.datetime.now(dt.timezone.utc))

    # -- connection checks ------------------------------------------------------------------

    def connection_probes(self) -> list[Probe]:
        """The API server answers (``/version``), the namespace exists (or, where this identity may
        not read namespaces, its pods are listable), the TrainJob API is served (a list of at most
        one), the runtime exists where it is readable, this identity has the :data:`PERMISSIONS` in the
        namespace (one SelfSubjectAccessReview each, ``kubectl auth can-i``), and nodes match the node
        selector (their ``node.kubernetes.io/instance-type``, for pricing; not checked where nodes are
        not readable)."""
        from kubernetes.client.exceptions import ApiException

        def version() -> str:
            from kubernetes.client import VersionApi

            info = VersionApi(self.api_client()).get_code(_request_timeout=CALL_TIMEOUT_S)
            return f"API server {self.api_client().configuration.host} answers: Kubernetes {info.git_version}."

        def namespace() -> str:
            try:
                self.core().read_namespace(self.namespace, _request_timeout=CALL_TIMEOUT_S)
                return f"namespace {self.namespace} exists."
            except ApiException as exc:
                if exc.status != 403:
                    raise
            self.core().list_namespaced_pod(self.namespace, limit=1, _request_timeout=CALL_TIMEOUT_S)
            return (f"pods in namespace {self.namespace} are readable (this identity may not read namespaces, so "
                    f"whether {self.namespace} exists is not checked).")

        def trainjobs() -> str:
            self.custom().list_namespaced_custom_object(tj.GROUP, tj.VERSION, self.namespace, tj.PLURAL, limit=1,
                                                        _request_timeout=CALL_TIMEOUT_S)
            return f"the TrainJob API ({tj.API_VERSION}) is served and trainjobs in {self.namespace} are listable."

        def runtime() -> str:
            name = self.config["runtime"]
            try:
                self.custom().get_cluster_custom_object(tj.GROUP, tj.VERSION, "clustertrainingruntimes", name,
                                                        _request_timeout=CALL_TIMEOUT_S)
            except ApiException as exc:
                if exc.status == 403:
                    return (f"ClusterTrainingRuntime {name} is not readable with this identity; a TrainJob naming a "
                            f"runtime that does not exist is refused when it is created.")
                raise
            return f"ClusterTrainingRuntime {name} exists."

        def permissions() -> str:
            from kubernetes.client import AuthorizationV1Api

            api = AuthorizationV1Api(self.api_client())
            denied = []
            for verb, resource, subresource, group in PERMISSIONS:
                review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                          "spec": {"resourceAttributes": {"namespace": self.namespace, "verb": verb, "group": group,
                                                          "resource": resource, "subresource": subresource}}}
                answer = api.create_self_subject_access_review(review, _request_timeout=CALL_TIMEOUT_S)
                if not getattr(answer.status, "allowed", False):
                    denied.append(f"{verb} {resource}{'/' + subresource if subresource else ''}")
            if denied:
                raise PermissionProblem(f"this identity may not {', '.join(denied)} in namespace {self.namespace}; "
                                        f"grant them with a Role and RoleBinding (docs/kubernetes.md).")
            return (f"this identity may {', '.join(f'{v} {r}' + ('/' + s if s else '') for v, r, s, _ in PERMISSIONS)} "
                    f"in namespace {self.namespace}.")

        def node_pool() -> str:
            selector = ",".join(f"{k}={v}" for k, v in self.config["node_selector"].items())
            try:
                response = self.core().list_node(label_selector=selector or None, limit=100, _preload_content=False,
                                                 _request_timeout=CALL_TIMEOUT_S)
            except ApiException as exc:
                if exc.status == 403:
                    return "nodes are not readable with this identity; their instance type is not checked."
                raise
            nodes = [n for n in json.loads(response.data or b"{}").get("items") or [] if isinstance(n, dict)]
            types = sorted({str(((n.get("metadata") or {}).get("labels") or {}).get(INSTANCE_TYPE_LABEL, "?"))
                            for n in nodes})
            where = f"matching the node selector {selector}" if selector else "in the cluster"
            if not nodes:
                raise PermissionProblem(f"no node {where}: the pods would wait forever; check the node selector.")
            priced = self.config.get("price_instance_type")
            hint = (f"; jobs are priced as {priced}" if priced else
                    f"; jobs are priced at the internal rate of {self.config['cluster']}/{self.config['node_pool']} "
                    f"(or set the price settings to one of these instance types)")
            return f"{len(nodes)} node(s) {where}, instance type {', '.join(types)}{hint}."

        def explain(what: str, missing: str) -> Callable[[BaseException], str]:
            def message(exc: BaseException) -> str:
                if errors.status_code(exc) == 404:
                    return missing
                return f"{what}: {exc}"
            return message

        return [
            Probe("API server", version, explain("API server", "the API server has no /version; is it a Kubernetes "
                                                 "API server?"), required=True,
                  skipped="not checked: the API server did not answer."),
            Probe("namespace", namespace, explain("namespace", f"namespace {self.namespace} does not exist; create it "
                                                  f"or set the backend's namespace.")),
            Probe("TrainJob API", trainjobs, explain("TrainJob API", f"the cluster does not serve {tj.API_VERSION} "
                                                     f"trainjobs: install Kubeflow Trainer v2 (docs/kubernetes.md).")),
            Probe("training runtime", runtime, explain("training runtime", f"there is no ClusterTrainingRuntime "
                                                       f"{self.config['runtime']!r}; install Kubeflow Trainer's runtimes "
                                                       f"or set the backend's runtime.")),
            Probe("permissions", permissions, explain("permissions", "the API server has no SelfSubjectAccessReview "
                                                      "API; the permissions are not checked.")),
            Probe("node pool", node_pool, explain("node pool", "the API server lists no nodes.")),
        ]

    def test_connection(self):
        """As :meth:`CloudBackend.test_connection`; a configuration that cannot be loaded is one failed
        check that says why."""
        from cloud_adapters.base import ConnectionCheck

        try:
            self.api_client()
        except BackendError as exc:
            return [ConnectionCheck("API server", False, str(exc))]
        return super().test_connection()
