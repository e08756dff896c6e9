"""The TrainJob a Trainboard job becomes: its body built from a :class:`~cloud_adapters.base.JobSpec`
and the backend's settings, without a call.

Every field is one the TrainJob API documents (kubeflow/trainer ``pkg/apis/trainer/v1alpha1/
trainjob_types.go`` at commit 0015772c, the version that has ``runtimePatches``)::

    apiVersion: trainer.kubeflow.org/v1alpha1
    kind: TrainJob
    metadata:
      name: <the job's name, RFC 1035 label>          # a 409 on create means "adopt"
      namespace: <namespace>
      labels: {trainboard-job-id: "<id>", trainboard-job-name: <job name>,
               kueue.x-k8s.io/queue-name: <queue_name, when set>}
    spec:
      runtimeRef: {name: <runtime>, apiGroup: trainer.kubeflow.org, kind: ClusterTrainingRuntime}
      suspend: true                                    # when the backend says so (Kueue admits it)
      activeDeadlineSeconds: <max runtime, s>
      trainer:
        image: <the job's image, else the backend's>
        command: [python, -m, trainer_pkg.launch, --config, env:TRAINBOARD_JOB_CONFIG, --platform, kubernetes]
        env: [{name: TRAINBOARD_JOB_CONFIG, value: <the JobConfig JSON>}, PYTHONUNBUFFERED, TRAINBOARD_JOB_NAME,
              the job's env, then each job secret as
              {name: K, valueFrom: {secretKeyRef: {name: <TrainJob name>-env, key: K}}}]
        numNodes: <nodes>
        numProcPerNode: <processes per node>
        resourcesPerNode: {limits: {nvidia.com/gpu: N}, requests: {nvidia.com/gpu: N, cpu, memory}}
      runtimePatches:                                  # only with a node selector, tolerations or service account
      - manager: trainboard
        trainingRuntimeSpec: {template: {spec: {replicatedJobs: [{name: node, template: {spec: {template:
          {spec: {nodeSelector, tolerations, serviceAccountName}}}}}]}}}

``node`` is the replicated Job of the ``torch-distributed`` runtime that runs the trainer (its
ClusterTrainingRuntime, kubeflow/trainer ``manifests/base/runtimes/torch_distributed.yaml``). The
torch runtime injects ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``
and ``PET_MASTER_PORT`` into that container (shared/reference/clouds.md §7), which the launcher's
``kubernetes`` platform reads; the job's env may not set them. Extended resources such as
``nvidia.com/gpu`` cannot be overcommitted, so their request equals their limit (Kubernetes "Resource
Management for Pods and Containers"); CPU and memory are requests only.

The backend's job secrets are not in the TrainJob: they go in a Secret of their own,
``<TrainJob name>-env`` (:func:`secret`, type Opaque, the same labels), which the trainer's variables
reference with ``valueFrom.secretKeyRef`` (Kubernetes "Distribute Credentials Securely Using Secrets").
Reading them takes ``get`` on secrets, which a Role gives apart from ``get`` on trainjobs. The
adapter makes the TrainJob the Secret's owner (``metadata.ownerReferences``), so the garbage
collector deletes the Secret with the TrainJob.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping

from cloud_adapters.base import TAG_JOB_ID, TAG_JOB_NAME, InvalidSpec, JobSpec
from cloud_adapters.kubernetes import syntax

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
PLURAL = "trainjobs"
API_VERSION = f"{GROUP}/{VERSION}"
RUNTIME_KIND = "ClusterTrainingRuntime"
NODE_JOB = "node"  # the torch runtime's replicated Job (and container) that runs the trainer
PATCH_MANAGER = "trainboard"  # runtimePatches[].manager: who owns the patch
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # Kueue's LocalQueue label (kueue.sigs.k8s.io "Run a TrainJob")
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
CONFIG_ENV = "TRAINBOARD_JOB_CONFIG"
COMMAND = ("python", "-m", "trainer_pkg.launch", "--config", f"env:{CONFIG_ENV}", "--platform", "kubernetes")
RESERVED_ENV = frozenset({CONFIG_ENV, "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                          "PET_MASTER_PORT"})
"""Variables the job's own env may not set: ours, and the ones the torch runtime injects (Trainer's
webhook refuses a TrainJob that sets them)."""
MAX_ENV = 128  # Trainer.env MaxItems (trainjob_types.go)
MAX_COMMAND_ITEM = 65536  # Trainer.command items MaxLength
MAX_IMAGE = 500  # Trainer.image MaxLength


def secret_name(trainjob: str) -> str:
    """The Secret holding the job secrets of TrainJob ``trainjob``: ``<trainjob>-env`` (a TrainJob's
    name is an RFC 1035 label of at most 63 characters, so this is a valid Secret name)."""
    return f"{trainjob}-env"


def _checked_env_name(key: Any, what: str) -> str:
    key = str(key)
    if key in RESERVED_ENV:
        raise InvalidSpec(f"{what} {key}: the name is set by Trainboard or Kubeflow Trainer's torch runtime; "
                          f"rename the variable.")
    if not syntax.ENV_NAME.fullmatch(key):
        raise InvalidSpec(f"{what} {key[:60]!r}: Kubernetes variable names are letters, digits, '_', '-' or "
                          f"'.', not starting with a digit.")
    return key


def env_list(spec: JobSpec, config_json: str, *, trainjob: str) -> list[dict[str, Any]]:
    """``trainer.env``: ours, then ``spec.env`` as ``{name, value}``, then each of ``spec.secret_env``
    as a ``secretKeyRef`` into :func:`secret_name` (``trainjob``) — never its value; a job secret
    replaces a plain variable of the same name. Raises :class:`InvalidSpec` naming a bad or reserved
    variable (never a value)."""
    env: dict[str, dict[str, Any]] = {}
    for key, value in ((CONFIG_ENV, config_json), ("PYTHONUNBUFFERED", "1"), ("TRAINBOARD_JOB_NAME", spec.job_name)):
        env[key] = {"name": key, "value": value}
    for key, value in spec.env.items():
        key = _checked_env_name(key, "env")
        env[key] = {"name": key, "value": str(value)}
    for key in spec.secret_env:
        key = _checked_env_name(key, "job secret")
        env.pop(key, None)  # re-inserted last, as a reference
        env[key] = {"name": key, "valueFrom": {"secretKeyRef": {"name": secret_name(trainjob), "key": key}}}
    if len(env) > MAX_ENV:
        raise InvalidSpec(f"env: {len(env)} variables (with Trainboard's and the job secrets); a TrainJob takes at "
                          f"most {MAX_ENV}.")
    return list(env.values())


def secret(spec: JobSpec, *, trainjob: str, namespace: str, config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The Secret of ``spec``'s job secrets for TrainJob ``trainjob`` (module docstring), values
    base64-encoded in ``data``, labelled with the Trainboard job's id and name; None when the job has
    none. Keys are the variable names (checked by :func:`env_list`)."""
    if not spec.secret_env:
        return None
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret_name(trainjob), "namespace": namespace,
                         "labels": {k: v for k, v in labels(spec, config).items() if k != QUEUE_LABEL}},
            "data": {str(k): base64.b64encode(str(v).encode()).decode() for k, v in spec.secret_env.items()}}


def resources(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``trainer.resourcesPerNode``: GPUs as limit and request, CPU and memory as requests; {} when
    the backend asks for none (the runtime's defaults apply)."""
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    gpus = int(config.get("gpus_per_node") or 0)
    if gpus > 0:
        limits[GPU_RESOURCE] = requests[GPU_RESOURCE] = str(gpus)
    if config.get("cpu_request"):
        requests["cpu"] = config["cpu_request"]
    if config.get("memory_request"):
        requests["memory"] = config["memory_request"]
    out = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def runtime_patches(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``spec.runtimePatches``: one patch of the ``node`` Job's pod spec with the backend's node
    selector, tolerations and service account; [] when it sets none of them."""
    pod_spec: dict[str, Any] = {}
    if config.get("node_selector"):
        pod_spec["nodeSelector"] = dict(config["node_selector"])
    if config.get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in config["tolerations"]]
    if config.get("service_account"):
        pod_spec["serviceAccountName"] = config["service_account"]
    if not pod_spec:
        return []
    return [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": NODE_JOB, "template": {"spec": {"template": {"spec": pod_spec}}}}]}}}}]


def labels(spec: JobSpec, config: Mapping[str, Any]) -> dict[str, str]:
    """``metadata.labels``: the Trainboard job id and name, and Kueue's queue when ``queue_name`` is set."""
    out = {TAG_JOB_NAME: spec.job_name}
    job_id = str(spec.tags.get(TAG_JOB_ID, "") or "")
    if job_id:
        out[TAG_JOB_ID] = job_id
    if config.get("queue_name"):
        out[QUEUE_LABEL] = config["queue_name"]
    for key, value in out.items():
        if (problem := syntax.label_value_problem(value)):
            raise InvalidSpec(f"label {key}: {problem}.")
    return dict(sorted(out.items()))


def train_job(spec: JobSpec, *, name: str, namespace: str, config: Mapping[str, Any],
              job_config: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainJob body (module docstring) for ``spec`` named ``name`` in ``namespace``, with the
    backend's cleaned settings ``config`` and the JobConfig the pods run, ``job_config`` (a JSON-able
    dict). Raises :class:`InvalidSpec` for a variable, label or image the API would refuse."""
    image = spec.image or config.get("image") or ""
    if not image or len(image) > MAX_IMAGE:
        raise InvalidSpec(f"image: a TrainJob needs an image of at most {MAX_IMAGE} characters, got {image[:80]!r}.")
    config_json = json.dumps(job_config, sort_keys=True, separators=(",", ":"))
    if len(config_json) > MAX_COMMAND_ITEM * 16:
        raise InvalidSpec(f"config: {len(config_json)} characters of JSON; too large to pass in a variable.")
    trainer: dict[str, Any] = {
        "image": image,
        "command": list(COMMAND),
        "env": env_list(spec, config_json, trainjob=name),
        "numNodes": int(spec.nodes),
        "numProcPerNode": int(spec.procs_per_node),
    }
    if (res := resources(config)):
        trainer["resourcesPerNode"] = res
    body_spec: dict[str, Any] = {
        "runtimeRef": {"name": config.get("runtime") or "torch-distributed", "apiGroup": GROUP, "kind": RUNTIME_KIND},
        "activeDeadlineSeconds": int(spec.max_runtime_s),
        "trainer": trainer,
    }
    if config.get("suspend"):
        body_spec["suspend"] = True
    if (patches := runtime_patches(config)):
        body_spec["runtimePatches"] = patches
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(spec, config)},
        "spec": body_spec,
    }
