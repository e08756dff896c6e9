"""A stand-in Kubernetes API server with Kubeflow Trainer for tests: real HTTP on 127.0.0.1, the REST
paths and JSON bodies the official ``kubernetes`` client uses, and a controller that plays Trainer and
JobSet by running each TrainJob's pods as local process groups.

No real API server can run on the test machines (no kube-apiserver package, no container images:
shared/reference/clouds.md §7), so the tests of the Kubernetes backend talk to this one instead::

    with kube_standin_server(tmp_path) as server:          # or the ``kube_standin`` fixture
        api = server.client()                               # a kubernetes.client.ApiClient
        CustomObjectsApi(api).create_namespaced_custom_object(
            "trainer.kubeflow.org", "v1alpha1", "default", "trainjobs", body)
        server.wait_for_condition("default", "tj-1", "Complete", timeout=120)
        server.requests_for("POST", "/trainjobs")[0].body  # what the client sent

What it serves (every other path is a 404 ``Status``; every request needs ``Authorization: Bearer
<token>``, else 401):

- ``GET /version``, ``/api``, ``/apis``, ``/apis/trainer.kubeflow.org/v1alpha1`` (discovery), and
  ``GET /api/v1/namespaces/{ns}`` (200 for the namespaces it holds, 404 otherwise).
- TrainJobs, ``/apis/trainer.kubeflow.org/v1alpha1[/namespaces/{ns}]/trainjobs[/{name}]``: POST
  (201; ``metadata.uid``, ``resourceVersion``, ``creationTimestamp``, ``generation`` set; 409
  ``AlreadyExists``; 400 for unknown fields and 422 ``Invalid`` for values the schema refuses, every
  error at once), GET one, GET list (``labelSelector``), PATCH (merge patch: labels, annotations,
  ``spec.suspend``; the rest of the spec is immutable, as the CRD's ``self == oldSelf`` rules say),
  DELETE (``propagationPolicy`` Foreground, Background or Orphan, in the query or a DeleteOptions body).
- ``GET /apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes[/{name}]``: ``torch-distributed``.
- ``GET /api/v1/nodes[/{name}]`` (:attr:`KubeStandin.node_count` nodes with
  :attr:`KubeStandin.node_labels`) and ``POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews``
  (201, ``status.allowed`` = :attr:`KubeStandin.access_allowed`).
- Secrets, ``/api/v1/namespaces/{ns}/secrets[/{name}]``: POST (201, 409, 422 for a bad name, key or
  base64 value; ``stringData`` folded into ``data``), GET, PATCH (merge or strategic merge), DELETE; a Secret whose
  ``ownerReferences`` name a TrainJob is deleted with it (the garbage collector's part).
- Pods, ``GET /api/v1[/namespaces/{ns}]/pods`` (``labelSelector``), ``GET …/pods/{name}``,
  ``POST …/pods/{name}/eviction`` (a ``policy/v1`` Eviction, strictly decoded: 400 for an unknown
  field or a name that is not the URL's; 404 for no such pod; 201 with a ``Success`` Status; the pod
  is disrupted with reason ``EvictionByEvictionAPI``, see :meth:`KubeStandin.disrupt`) and
  ``GET …/pods/{name}/log`` with ``container``, ``timestamps``, ``sinceTime``, ``sinceSeconds``,
  ``tailLines``, ``limitBytes`` as PodLogOptions documents them (kubernetes.io API reference, core/v1
  Pod "read log"): since-filter first, then the tail, then the byte limit (which may cut a line).

The controller (one thread, every :attr:`KubeStandin.tick_s` seconds), for each TrainJob:

- ``spec.suspend: true`` → no pods (running ones are killed, as a suspended JobSet deletes its Jobs),
  condition ``Suspended`` True reason ``Suspended``; un-suspended → ``Suspended`` False reason
  ``Resumed`` and new pods; the ``activeDeadlineSeconds`` clock restarts on resume (trainjob_types.go).
- Otherwise ``numNodes`` pods named as the JobSet's one replicated Job ``node`` names them:
  ``<trainjob>-node-0-<completion index>-<5 chars>`` (Job ``<jobset>-<replicatedJob>-<job index>``,
  kubernetes-sigs/jobset ``pkg/controllers/jobset_controller.go`` ``placement.GenJobName``; an Indexed
  Job's pod ``<job>-<index>-<random>``), labelled as JobSet and the Job controller label them
  (:func:`pod_labels`), phase Pending, then Running once its process starts (while
  :attr:`KubeStandin.schedulable` is False they stay Pending, ``PodScheduled`` False ``Unschedulable``).
- A pod's process is ``trainer.command + trainer.args`` (the image is not run: ``python``/``python3``
  become :attr:`KubeStandin.python`, ``sys.executable`` unless a test names the trainer stand-in
  there (tests/standins/trainer.py), the interpreter's directory leads ``PATH`` so ``torchrun`` is the venv's,
  the repository root is on ``PYTHONPATH`` as the image would have ``trainer_pkg`` installed) in a
  working directory of its own, in its own process group, with a clean environment: ``PATH``,
  ``HOME``, ``HOSTNAME``, ``PYTHONPATH``, ``PYTHONUNBUFFERED``, the ``trainer.env`` values (literal, or
  a ``secretKeyRef`` read from the stand-in's Secrets: a missing Secret or key keeps the pod Pending in
  ``CreateContainerConfigError`` with the kubelet's message),
  and what Trainer's torch plugin injects (kubeflow/trainer
  ``pkg/runtime/framework/plugins/torch/torch.go`` ``EnforceMLPolicy``): ``PET_NNODES``,
  ``PET_NPROC_PER_NODE`` (numProcPerNode; ``auto`` with ``resourcesPerNode`` and no GPU resource
  becomes the CPU count, as ``calculateNumProcPerNode`` does), ``PET_NODE_RANK`` (the completion
  index), ``PET_MASTER_ADDR`` (127.0.0.1 here, not the headless service's ``<tj>-node-0-0.<tj>``) and
  ``PET_MASTER_PORT`` (a free port here, not 29400). stdout and stderr go, line by line with an
  RFC3339Nano timestamp in front, to ``<directory>/pods/<ns>/<pod>.log``.
- Pod phases follow the processes (exit 0 → Succeeded, else Failed). ``status.jobsStatus`` has one
  entry ``node`` counting child Jobs (one here) as JobSet does (active, ready, succeeded, failed,
  suspended). All pods succeeded → ``Complete`` True (``AllJobsCompleted``, "jobset completed
  successfully", JobSet's constants); one pod failed → the others are killed (the Job's backoffLimit
  is taken as 0) and ``Failed`` True (``FailedJobs``, "jobset failed due to one or more job
  failures"); past ``activeDeadlineSeconds`` → pods killed, ``Failed`` True ``DeadlineExceeded``.
- A disruption (:meth:`KubeStandin.disrupt`, or the Eviction API): the pod gets the condition
  ``DisruptionTarget`` True with the reason (one of :data:`DISRUPTION_REASONS`) and message, as
  Kubernetes adds it (kubernetes.io "Pod disruption conditions"), is deleted (``deletionTimestamp``;
  not for ``TerminationByKubelet``: the kubelet's eviction leaves the pod, with reason ``Evicted``) and
  killed; it ends ``Failed`` whatever its exit code (the Job controller counts a pod deleted before it
  succeeded as failed: job_controller.go ``isPodFailed``), and the TrainJob ``Failed`` ``FailedJobs``
  as JobSet fails it for a failed child Job (the other pods killed).
- Killing a pod is SIGTERM to its process group, then SIGKILL after the grace period
  (``gracePeriodSeconds`` of the delete, else :attr:`KubeStandin.grace_period_s`); a pod is gone when
  no live process of its group remains.

Every request is appended to :attr:`KubeStandin.requests` (method, path, query, parsed JSON body).
Stopping the server kills every process group it started, by PID, and waits for them.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
SERVER_VERSION = {"major": "1", "minor": "33", "gitVersion": "v1.33.0-trainboard-standin",
                  "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
                  "buildDate": "2026-12-01T00:00:00Z", "goVersion": "go1.24.0", "compiler": "gc",
                  "platform": "linux/amd64"}

# JobSet's and the Job controller's pod labels (kubernetes-sigs/jobset api/jobset/v1alpha2
# jobset_types.go; kubernetes batch/v1 Job "Indexed" completion mode, labels since 1.28).
LABEL_JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
LABEL_JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
LABEL_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
LABEL_REPLICATED_JOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
LABEL_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
LABEL_JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
LABEL_JOB_KEY = "jobset.sigs.k8s.io/job-key"
LABEL_RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
LABEL_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
LABEL_JOB_NAME = "batch.kubernetes.io/job-name"
LABEL_CONTROLLER_UID = "batch.kubernetes.io/controller-uid"

REPLICATED_JOB = "node"  # the torch-distributed runtime's one replicated Job and its container
DISRUPTION_REASONS = {
    # reason of the pod condition DisruptionTarget (kubernetes.io "Pod disruption conditions") → a
    # default message, like those the Kubernetes components write
    "PreemptionByScheduler": "default-scheduler: preempting to accommodate a higher priority pod",
    "DeletionByTaintManager": "Taint manager: deleting due to NoExecute taint",
    "EvictionByEvictionAPI": "Eviction API: evicting",
    "DeletionByPodGC": "PodGC: node no longer exists",
    "TerminationByKubelet": "The node was low on resource: memory.",
}
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
MANAGED_BY = ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")

_RUNTIME_NODE_JOB = {
    "name": REPLICATED_JOB, "replicas": 1,
    "template": {
        "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
        "spec": {"template": {"spec": {"containers": [{
            "name": REPLICATED_JOB, "image": "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime",
            "command": ["/bin/bash", "-c", "echo 'Torch Distributed Runtime'"]}]}}},
    },
}
TORCH_DISTRIBUTED_RUNTIME = {
    "apiVersion": API_VERSION, "kind": "ClusterTrainingRuntime",
    "metadata": {"name": "torch-distributed", "uid": "00000000-0000-4000-8000-000000000001",
                 "resourceVersion": "1", "creationTimestamp": "2026-12-01T00:00:00Z",
                 "labels": {"trainer.kubeflow.org/framework": "torch"}},
    "spec": {"mlPolicy": {"numNodes": 1, "torch": {"numProcPerNode": "auto"}},
             "template": {"spec": {"replicatedJobs": [_RUNTIME_NODE_JOB]}}},
}


# ---------------------------------------------------------------------------------------------
# Time, names, quantities
# ---------------------------------------------------------------------------------------------


def rfc3339(seconds: float | None = None) -> str:
    """``2026-12-01T23:50:00Z``: metav1.Time's wire form (whole seconds, UTC)."""
    moment = dt.datetime.fromtimestamp(time.time() if seconds is None else seconds, dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339nano(ns: int) -> str:
    """Go's RFC3339Nano of ``ns`` nanoseconds since the epoch: ``2026-12-01T23:50:00.123456789Z``,
    trailing zeros of the fraction dropped (and the dot, when it is all zeros), as kubelet writes log
    timestamps."""
    seconds, frac = divmod(ns, 1_000_000_000)
    base = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    fraction = f"{frac:09d}".rstrip("0")
    return f"{base}.{fraction}Z" if fraction else f"{base}Z"


_TIME_RE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?([Zz]|[+-]\d{2}:\d{2})$")


def parse_rfc3339_ns(text: str) -> int | None:
    """Nanoseconds since the epoch of an RFC3339 time (fraction optional, up to 9 digits), or None."""
    match = _TIME_RE.match(text)
    if not match:
        return None
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    try:
        tz = dt.timezone.utc
        if zone not in ("Z", "z"):
            sign = 1 if zone[0] == "+" else -1
            tz = dt.timezone(sign * dt.timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6])))
        moment = dt.datetime(int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=tz)
    except ValueError:
        return None
    return int(moment.timestamp()) * 1_000_000_000 + int((fraction or "0").ljust(9, "0"))


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|u|n)?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand: no vowels, no 0/1/3


def random_suffix(n: int = 5) -> str:
    return "".join(secrets.choice(_SUFFIX_CHARS) for _ in range(n))


def cpu_count_of(quantity: Any) -> int | None:
    """A CPU quantity (``2``, ``"1.5"``, ``"500m"``) rounded up to whole CPUs, as resource.Quantity's
    ``Value()`` does; None when it is not one."""
    text = str(quantity)
    if not _QUANTITY.match(text):
        return None
    if text.endswith("m"):
        return -(-int(float(text[:-1])) // 1000)
    try:
        value = float(text)
    except ValueError:
        return None
    return int(-(-value // 1))


def is_label_key(key: str) -> bool:
    """A qualified name: ``[prefix/]name``, name ≤ 63 characters, prefix a DNS subdomain ≤ 253."""
    prefix, _, name = key.rpartition("/")
    if not name or len(name) > 63 or not _LABEL_NAME.match(name):
        return False
    return not prefix or (len(prefix) <= 253 and all(_DNS1123_LABEL.match(p) for p in prefix.split(".")))


# ---------------------------------------------------------------------------------------------
# Label selectors (k8s.io/apimachinery/pkg/labels: equality- and set-based)
# ---------------------------------------------------------------------------------------------


class SelectorError(ValueError):
    pass


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """A predicate over a label dict for ``labelSelector`` text: requirements joined by commas, each
    ``k=v``, ``k==v``, ``k!=v``, ``k`` (exists), ``!k`` (does not exist), ``k in (a,b)``,
    ``k notin (a,b)``. Raises :class:`SelectorError` for anything else."""
    requirements: list[Callable[[dict[str, str]], bool]] = []
    for part in _split_selector(text or ""):
        set_match = re.match(r"^([^\s!=()]+)\s+(in|notin)\s+\(([^()]*)\)$", part)
        if set_match:
            key, op, values = set_match.group(1), set_match.group(2), {v.strip() for v in set_match.group(3).split(",")}
            if not is_label_key(key):
                raise SelectorError(f"invalid label key {key!r}")
            if op == "in":
                requirements.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                requirements.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
            continue
        eq_match = re.match(r"^([^\s!=()]+)\s*(==|!=|=)\s*([^\s!=(),]*)$", part)
        if eq_match:
            key, op, value = eq_match.groups()
            if not is_label_key(key) or not _LABEL_VALUE.match(value) or len(value) > 63:
                raise SelectorError(f"invalid requirement {part!r}")
            if op == "!=":
                requirements.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                requirements.append(lambda labels, k=key, v=value: labels.get(k) == v)
            continue
        exists_match = re.match(r"^(!?)\s*([^\s!=(),]+)$", part)
        if exists_match and is_label_key(exists_match.group(2)):
            negate, key = exists_match.groups()
            if negate:
                requirements.append(lambda labels, k=key: k not in labels)
            else:
                requirements.append(lambda labels, k=key: k in labels)
            continue
        raise SelectorError(f"unable to parse requirement: {part!r}")
    return lambda labels: all(req(labels or {}) for req in requirements)


# ---------------------------------------------------------------------------------------------
# TrainJob validation (kubeflow/trainer pkg/apis/trainer/v1alpha1/trainjob_types.go)
# ---------------------------------------------------------------------------------------------

# A schema node: dict of field → node (an object with exactly those fields), ("list", node),
# ("map", value node), or a leaf kind: "string", "int", "bool", "intOrString", "quantity", "any"
# (an object the stand-in takes whole: core/v1 types the trainer never reads, e.g. volumes).
ENV_VAR = {"name": "string", "value": "string",
           "valueFrom": {"fieldRef": {"apiVersion": "string", "fieldPath": "string"},
                         "resourceFieldRef": {"containerName": "string", "resource": "string", "divisor": "quantity"},
                         "configMapKeyRef": {"name": "string", "key": "string", "optional": "bool"},
                         "secretKeyRef": {"name": "string", "key": "string", "optional": "bool"},
                         "fileKeyRef": "any"}}
OBJECT_META = {"name": "string", "generateName": "string", "namespace": "string", "labels": ("map", "string"),
               "annotations": ("map", "string"), "uid": "string", "resourceVersion": "string",
               "generation": "int", "creationTimestamp": "string", "deletionTimestamp": "string",
               "deletionGracePeriodSeconds": "int", "finalizers": ("list", "string"),
               "ownerReferences": ("list", "any"), "managedFields": ("list", "any"), "selfLink": "string"}
LABELS_ONLY_META = {"labels": ("map", "string"), "annotations": ("map", "string")}
RESOURCES = {"limits": ("map", "quantity"), "requests": ("map", "quantity"), "claims": ("list", {"name": "string", "request": "string"})}
TOLERATION = {"key": "string", "operator": "string", "value": "string", "effect": "string", "tolerationSeconds": "int"}
CONTAINER_PATCH = {"name": "string", "env": ("list", ENV_VAR), "volumeMounts": ("list", "any"), "securityContext": "any"}
POD_SPEC_PATCH = {"serviceAccountName": "string", "volumes": ("list", "any"), "initContainers": ("list", CONTAINER_PATCH),
                  "containers": ("list", CONTAINER_PATCH), "imagePullSecrets": ("list", {"name": "string"}),
                  "securityContext": "any", "nodeSelector": ("map", "string"), "affinity": "any",
                  "tolerations": ("list", TOLERATION), "schedulingGates": ("list", {"name": "string"})}
RUNTIME_PATCH = {"manager": "string", "time": "string", "trainingRuntimeSpec": {"template": {
    "metadata": LABELS_ONLY_META,
    "spec": {"replicatedJobs": ("list", {"name": "string", "template": {
        "metadata": LABELS_ONLY_META,
        "spec": {"template": {"metadata": LABELS_ONLY_META, "spec": POD_SPEC_PATCH}}}})}}}}
STORAGE_INITIALIZER = {"storageUri": "string", "env": ("list", ENV_VAR), "secretRef": {"name": "string"}}
TRAINJOB_SCHEMA = {
    "apiVersion": "string", "kind": "string", "metadata": OBJECT_META,
    "spec": {
        "runtimeRef": {"name": "string", "apiGroup": "string", "kind": "string"},
        "initializer": {"dataset": STORAGE_INITIALIZER, "model": STORAGE_INITIALIZER},
        "trainer": {"image": "string", "command": ("list", "string"), "args": ("list", "string"),
                    "env": ("list", ENV_VAR), "numNodes": "int", "resourcesPerNode": RESOURCES,
                    "numProcPerNode": "intOrString"},
        "runtimePatches": ("list", RUNTIME_PATCH),
        "suspend": "bool", "activeDeadlineSeconds": "int", "managedBy": "string",
    },
    "status": "any",
}
"""The fields the stand-in accepts in a TrainJob, from kubeflow/trainer
``pkg/apis/trainer/v1alpha1/trainjob_types.go`` (TrainJobSpec: runtimeRef, initializer, trainer,
runtimePatches, suspend, activeDeadlineSeconds, managedBy; Trainer: image, command, args, env,
numNodes, resourcesPerNode, numProcPerNode; RuntimePatch down to PodSpecPatch: serviceAccountName,
volumes, initContainers, containers, imagePullSecrets, securityContext, nodeSelector, affinity,
tolerations, schedulingGates) and core/v1 (ObjectMeta, EnvVar, ResourceRequirements, Toleration).
``numProcPerNode`` takes an int or ``auto``/``cpu``/``gpu`` (torch.go ``Validate``). The older
``podTemplateOverrides``/``podSpecOverrides`` are not fields of this version."""


def _kind_error(path: str, value: Any, kind: str) -> str:
    return f"{path}: Invalid value: {json.dumps(value)[:80]}: {path} in body must be of type {kind}"


def schema_errors(value: Any, node: Any, path: str) -> tuple[list[str], list[str]]:
    """``(unknown field paths, type errors)`` of ``value`` against the schema ``node``."""
    unknown: list[str] = []
    errors: list[str] = []
    if node == "any":
        return unknown, errors
    if isinstance(node, dict):
        if not isinstance(value, dict):
            return unknown, [_kind_error(path, value, "object")]
        for key, item in value.items():
            child = f"{path}.{key}" if path else key
            if key not in node:
                unknown.append(child)
                continue
            if item is None:
                continue  # JSON null: an omitted optional field
            u, e = schema_errors(item, node[key], child)
            unknown += u
            errors += e
        return unknown, errors
    if isinstance(node, tuple):
        container, inner = node
        if container == "list":
            if not isinstance(value, list):
                return unknown, [_kind_error(path, value, "array")]
            for i, item in enumerate(value):
                u, e = schema_errors(item, inner, f"{path}[{i}]")
                unknown += u
                errors += e
        else:
            if not isinstance(value, dict):
                return unknown, [_kind_error(path, value, "object")]
            for key, item in value.items():
                u, e = schema_errors(item, inner, f"{path}[{key}]")
                unknown += u
                errors += e
        return unknown, errors
    ok = {"string": isinstance(value, str),
          "int": isinstance(value, int) and not isinstance(value, bool),
          "bool": isinstance(value, bool),
          "intOrString": isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)),
          "quantity": (isinstance(value, (int, float)) and not isinstance(value, bool))
                      or (isinstance(value, str) and bool(_QUANTITY.match(value)))}[node]
    if not ok:
        kind = {"int": "integer", "bool": "boolean", "intOrString": "integer or string",
                "quantity": "quantity (a number or a string such as 500m or 4Gi)"}.get(node, node)
        errors.append(_kind_error(path, value, kind))
    return unknown, errors


def trainjob_value_errors(body: dict, runtimes: dict[str, dict]) -> list[str]:
    """The CRD's value rules (kubebuilder markers in trainjob_types.go) and Trainer's webhook checks
    (torch.go ``Validate``) for a body whose shape already passed :func:`schema_errors`."""
    errors = []
    meta = body.get("metadata") or {}
    name = meta.get("name") or ""
    if body.get("apiVersion") != API_VERSION:
        errors.append(f"apiVersion: Invalid value: {json.dumps(body.get('apiVersion'))}: must be {API_VERSION}")
    if body.get("kind") != "TrainJob":
        errors.append(f"kind: Invalid value: {json.dumps(body.get('kind'))}: must be TrainJob")
    if name and (len(name) > 63 or not _DNS1035.match(name)):
        errors.append(f"metadata.name: Invalid value: {json.dumps(name)}: metadata.name must match RFC 1035 DNS "
                      "label format and be no more than 63 characters")
    for field in ("labels", "annotations"):
        for key, val in (meta.get(field) or {}).items():
            if not is_label_key(key):
                errors.append(f"metadata.{field}: Invalid value: {json.dumps(key)}: name part must consist of "
                              "alphanumeric characters, '-', '_' or '.', at most 63 characters")
            if field == "labels" and (len(val) > 63 or not _LABEL_VALUE.match(val)):
                errors.append(f"metadata.labels: Invalid value: {json.dumps(val)}: a valid label must be an empty "
                              "string or consist of alphanumeric characters, '-', '_' or '.', at most 63 characters")
    spec = body.get("spec")
    if not isinstance(spec, dict):
        return errors + ["spec: Required value"]
    ref = spec.get("runtimeRef") or {}
    if not ref.get("name"):
        errors.append("spec.runtimeRef.name: Required value")
    elif len(ref["name"]) > 253:
        errors.append("spec.runtimeRef.name: Too long: may not be longer than 253")
    if ref.get("apiGroup") not in (None, GROUP):
        errors.append(f"spec.runtimeRef.apiGroup: Unsupported value: {json.dumps(ref.get('apiGroup'))}: "
                      f"supported values: \"{GROUP}\"")
    kind = ref.get("kind", "ClusterTrainingRuntime")
    if kind not in ("ClusterTrainingRuntime", "TrainingRuntime"):
        errors.append(f"spec.runtimeRef.kind: Unsupported value: {json.dumps(kind)}: supported values: "
                      "\"ClusterTrainingRuntime\", \"TrainingRuntime\"")
    elif ref.get("name") and (kind == "TrainingRuntime" or ref["name"] not in runtimes):
        errors.append(f"spec.runtimeRef: Invalid value: {json.dumps(ref.get('name'))}: {kind}.{GROUP} "
                      f"{json.dumps(ref.get('name'))} not found")
    if "activeDeadlineSeconds" in spec and spec["activeDeadlineSeconds"] < 1:
        errors.append(f"spec.activeDeadlineSeconds: Invalid value: {spec['activeDeadlineSeconds']}: "
                      "spec.activeDeadlineSeconds in body should be greater than or equal to 1")
    if spec.get("managedBy") not in (None, *MANAGED_BY):
        errors.append(f"spec.managedBy: Invalid value: {json.dumps(spec['managedBy'])}: ManagedBy must be "
                      "trainer.kubeflow.org/trainjob-controller or kueue.x-k8s.io/multikueue if set")
    trainer = spec.get("trainer") or {}
    if "image" in trainer and len(trainer["image"]) > 500:
        errors.append("spec.trainer.image: Too long: may not be longer than 500")
    for field in ("command", "args"):
        items = trainer.get(field) or []
        if len(items) > 128:
            errors.append(f"spec.trainer.{field}: Too many: {len(items)}: must have at most 128 items")
        if any(len(item) > 65536 for item in items):
            errors.append(f"spec.trainer.{field}: Too long: an item may not be longer than 65536")
    if "numNodes" in trainer and trainer["numNodes"] < 1:
        errors.append(f"spec.trainer.numNodes: Invalid value: {trainer['numNodes']}: must be at least 1")
    nppn = trainer.get("numProcPerNode")
    if isinstance(nppn, str) and nppn not in ("auto", "cpu", "gpu"):
        errors.append(f"spec.trainer.numProcPerNode: Invalid value: {json.dumps(nppn)}: must have an int value "
                      "or [auto cpu gpu]")
    if isinstance(nppn, int) and nppn < 1:
        errors.append(f"spec.trainer.numProcPerNode: Invalid value: {nppn}: must be at least 1")
    env = trainer.get("env") or []
    errors += _env_errors(env, "spec.trainer.env")
    reserved = sorted({e.get("name") for e in env if e.get("name") in TORCH_RESERVED_ENV})
    if reserved:
        errors.append(f"spec.trainer.env: Invalid value: {json.dumps(reserved)}: must not have reserved envs, "
                      f"invalid envs configured: [{' '.join(reserved)}]")
    patches = spec.get("runtimePatches") or []
    if len(patches) > 16:
        errors.append(f"spec.runtimePatches: Too many: {len(patches)}: must have at most 16 items")
    managers = [p.get("manager") for p in patches]
    for i, patch in enumerate(patches):
        if not patch.get("manager"):
            errors.append(f"spec.runtimePatches[{i}].manager: Required value")
        elif managers.count(patch["manager"]) > 1:
            errors.append(f"spec.runtimePatches[{i}]: Duplicate value: {{\"manager\":{json.dumps(patch['manager'])}}}")
        jobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
        for j, job in enumerate(jobs):
            where = f"spec.runtimePatches[{i}].trainingRuntimeSpec.template.spec.replicatedJobs[{j}]"
            if not job.get("name"):
                errors.append(f"{where}.name: Required value")
            pod_spec = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            for k, tol in enumerate(pod_spec.get("tolerations") or []):
                if tol.get("operator", "Equal") not in ("Equal", "Exists"):
                    errors.append(f"{where}.template.spec.template.spec.tolerations[{k}].operator: Unsupported value: "
                                  f"{json.dumps(tol.get('operator'))}: supported values: \"Equal\", \"Exists\"")
                if tol.get("effect", "") not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
                    errors.append(f"{where}.template.spec.template.spec.tolerations[{k}].effect: Unsupported value: "
                                  f"{json.dumps(tol.get('effect'))}: supported values: \"NoSchedule\", "
                                  "\"PreferNoSchedule\", \"NoExecute\"")
            for k, container in enumerate(pod_spec.get("containers") or []):
                if not container.get("name"):
                    errors.append(f"{where}.template.spec.template.spec.containers[{k}].name: Required value")
                errors += _env_errors(container.get("env") or [], f"{where}.template.spec.template.spec.containers[{k}].env")
    return errors


def _env_errors(env: list, path: str) -> list[str]:
    errors, names = [], []
    if len(env) > 128:
        errors.append(f"{path}: Too many: {len(env)}: must have at most 128 items")
    for i, item in enumerate(env):
        name = item.get("name")
        if not name:
            errors.append(f"{path}[{i}].name: Required value")
        elif not _ENV_NAME.match(name):
            errors.append(f"{path}[{i}].name: Invalid value: {json.dumps(name)}: a valid environment variable name "
                          "must consist of alphabetic characters, digits, '_', '-', or '.', and must not start with a digit")
        elif name in names:
            errors.append(f"{path}[{i}]: Duplicate value: {{\"name\":{json.dumps(name)}}}")
        names.append(name)
        if "value" in item and item.get("valueFrom"):
            errors.append(f"{path}[{i}].valueFrom: Invalid value: \"\": may not be specified when `value` is not empty")
    return errors


# ---------------------------------------------------------------------------------------------
# The objects and the controller
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RecordedRequest:
    """One request the server answered."""

    method: str
    path: str  # without the query
    query: dict[str, list[str]]
    body: Any  # the parsed JSON body, or None
    content_type: str
    status: int = 0  # the HTTP status it answered


@dataclasses.dataclass
class Pod:
    """A pod of a TrainJob and the process group that plays it."""

    obj: dict
    trainjob: str
    index: int  # the completion index: the node rank
    workdir: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    reader: threading.Thread | None = None
    started_at: float | None = None
    started_ns: int | None = None
    environ: dict[str, str] | None = None  # the environment its process was started with (the kubelet's part)
    kill_sent: float | None = None  # monotonic time of SIGTERM
    grace_s: float = 10.0
    killed_reason: str = ""  # why the controller killed it (DeadlineExceeded, …), if it did
    start_error: str = ""  # why its container could not start, if it could not
    orphaned: bool = False  # its TrainJob was deleted with propagationPolicy Orphan
    disruption: dict | None = None  # its DisruptionTarget condition, once disrupted (KubeStandin.disrupt)

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]


class KubeStandin:
    """The stand-in server and its controller (see the module docstring). Start it with
    :meth:`start` (or :func:`kube_standin_server`), stop it with :meth:`stop`."""

    def __init__(self, directory: Path, *, namespaces: tuple[str, ...] = ("default",), token: str | None = None,
                 grace_period_s: float = 10.0, tick_s: float = 0.1):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.token = token or secrets.token_urlsafe(24)
        self.namespaces = set(namespaces)
        self.grace_period_s = grace_period_s
        """Seconds between SIGTERM and SIGKILL when a pod is killed (terminationGracePeriodSeconds)."""
        self.tick_s = tick_s
        self.schedulable = True
        """False keeps new pods Pending (unschedulable), as a cluster without free nodes would."""
        self.node_count = 4
        """Nodes ``standin-node-0`` … served by ``GET /api/v1/nodes``; pod of completion index i runs on node i."""
        self.node_labels: dict[str, str] = {"node.kubernetes.io/instance-type": "standin-cpu-4",
                                            "topology.kubernetes.io/region": "standin"}
        """Labels every node carries (the well-known instance-type label prices a node pool)."""
        self.access_allowed = True
        """The answer to every SelfSubjectAccessReview (``kubectl auth can-i``)."""
        self.python = sys.executable
        """What ``python``/``python3`` at the head of a pod's command become when its process starts
        (the image's interpreter): a test names the trainer stand-in's wrapper here
        (:meth:`with_python`) to hold a job's ranks at its gate."""
        self.runtimes = {"torch-distributed": TORCH_DISTRIBUTED_RUNTIME}
        self.requests: list[RecordedRequest] = []
        self.lock = threading.RLock()
        self.trainjobs: dict[tuple[str, str], dict] = {}
        self.secrets: dict[tuple[str, str], dict] = {}
        """core/v1 Secrets by (namespace, name), ``data`` base64 as the API keeps it."""
        self.pods: dict[tuple[str, str], Pod] = {}
        self._rv = 1
        self._tj_state: dict[tuple[str, str], dict] = {}  # per TrainJob: jobset uid, master port, deadline clock
        self._all_procs: list[subprocess.Popen] = []
        self._groups: set[int] = set()
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self.controller_errors: list[str] = []
        self.ticks = 0
        """Controller passes completed so far."""

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> "KubeStandin":
        handler = type("Handler", (_Handler,), {"standin": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        for target in (self._server.serve_forever, self._control_loop):
            thread = threading.Thread(target=target, daemon=True, name=f"k8s-standin-{target.__name__}")
            thread.start()
            self._threads.append(thread)
        self.kubeconfig_path = self.write_kubeconfig(self.directory / "kubeconfig")
        return self

    def stop(self) -> None:
        """Stop the controller and the server, then SIGKILL every process group the stand-in started
        and wait for each process."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=10)
        with self.lock:
            procs = list(self._all_procs)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for pod in list(self.pods.values()):
            if pod.reader is not None:
                pod.reader.join(timeout=5)

    @contextlib.contextmanager
    def with_python(self, python: str) -> Iterator["KubeStandin"]:
        """Pods started inside the block run ``python`` (an absolute path: the trainer stand-in's
        wrapper) for ``python``/``python3``; :attr:`python` is ``sys.executable`` again after it."""
        self.python = python
        try:
            yield self
        finally:
            self.python = sys.executable

    def write_kubeconfig(self, path: Path, *, context: str = "standin", namespace: str = "default") -> Path:
        """A kubeconfig (JSON is YAML) with one cluster (this server over http), one token user and
        one context ``context`` whose namespace is ``namespace``."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": context, "preferences": {},
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "standin-user", "user": {"token": self.token}}],
            "contexts": [{"name": context, "context": {"cluster": "standin", "user": "standin-user",
                                                        "namespace": namespace}}],
        }
        path.write_text(json.dumps(config, indent=2))
        os.chmod(path, 0o600)
        return path

    def installation(self, allowed_images: str = "registry.example/trainboard/*") -> dict[str, str]:
        """The ``TRAINBOARD_K8S_*`` host settings of an installation that reaches this server (its
        kubeconfig, context ``standin``) and runs the images ``allowed_images`` matches: a worker's
        environment, or the test process's settings."""
        return {"TRAINBOARD_K8S_KUBECONFIG": str(self.kubeconfig_path), "TRAINBOARD_K8S_CONTEXT": "standin",
                "TRAINBOARD_K8S_ALLOWED_IMAGES": allowed_images}

    def client(self):
        """A ``kubernetes.client.ApiClient`` configured from this server's kubeconfig."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig_path), client_configuration=configuration)
        return client.ApiClient(configuration)

    # -- what tests read --------------------------------------------------------------------

    def requests_for(self, method: str, path_contains: str = "") -> list[RecordedRequest]:
        """The recorded requests with this method whose path contains ``path_contains``, oldest first."""
        with self.lock:
            return [r for r in self.requests if r.method == method and path_contains in r.path]

    def trainjob(self, namespace: str, name: str) -> dict | None:
        with self.lock:
            obj = self.trainjobs.get((namespace, name))
            return copy.deepcopy(obj) if obj else None

    def condition(self, namespace: str, name: str, type_: str) -> dict | None:
        obj = self.trainjob(namespace, name)
        for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
            if cond["type"] == type_:
                return cond
        return None

    def pods_of(self, namespace: str, trainjob: str) -> list[Pod]:
        with self.lock:
            return sorted((p for (ns, _), p in self.pods.items() if ns == namespace and p.trainjob == trainjob),
                          key=lambda p: p.index)

    def wait_for(self, predicate: Callable[[], Any], *, timeout: float, what: str = "") -> Any:
        """Poll ``predicate`` until truthy (returned); AssertionError naming ``what`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what or predicate}; "
                                     f"controller errors: {self.controller_errors}")
            time.sleep(0.1)

    def wait_for_condition(self, namespace: str, name: str, type_: str, *, timeout: float) -> dict:
        return self.wait_for(lambda: (c := self.condition(namespace, name, type_)) and c["status"] == "True" and c,
                             timeout=timeout, what=f"TrainJob {namespace}/{name} condition {type_}")

    def disrupt(self, namespace: str, pod_name: str, reason: str = "EvictionByEvictionAPI", message: str | None = None,
                *, grace_s: float | None = None) -> dict:
        """Disrupt a pod as Kubernetes would (module docstring): condition ``DisruptionTarget`` True with
        ``reason`` (one of :data:`DISRUPTION_REASONS`, else ValueError) and ``message`` (default: that
        reason's), then SIGTERM to its process group and SIGKILL after ``grace_s`` seconds (default the
        pod's grace period; 0: SIGKILL at once, a node that is gone). Returns the condition. KeyError for
        no such pod; ValueError for a pod that already ended or is being deleted."""
        if reason not in DISRUPTION_REASONS:
            raise ValueError(f"disruption reason {reason!r}: expected one of {', '.join(DISRUPTION_REASONS)}")
        with self.lock:
            pod = self.pods.get((namespace, pod_name))
            if pod is None:
                raise KeyError(f"no pod {namespace}/{pod_name}")
            if pod.kill_sent is not None or pod.obj["status"]["phase"] not in ("Pending", "Running"):
                raise ValueError(f"pod {namespace}/{pod_name} has ended or is being deleted; nothing to disrupt")
            pod.disruption = {"type": "DisruptionTarget", "status": "True", "reason": reason,
                              "message": DISRUPTION_REASONS[reason] if message is None else message,
                              "lastTransitionTime": rfc3339(), "lastProbeTime": None}
            self._kill(pod, "Evicted" if reason == "TerminationByKubelet" else reason,
                       grace=grace_s)
            self._update_pods([pod])
            return copy.deepcopy(pod.disruption)

    def live_pids(self) -> list[int]:
        """Pids of live processes in the process groups of this server's pods."""
        with self.lock:
            groups = {p.proc.pid for p in self.pods.values() if p.proc is not None}
            groups |= {proc.pid for proc in self._all_procs}
        return [pid for pid, pgid in _process_groups().items() if pgid in groups]

    # -- object store -----------------------------------------------------------------------

    def next_rv(self) -> str:
        with self.lock:
            self._rv += 1
            return str(self._rv)

    def _touch(self, obj: dict) -> None:
        obj["metadata"]["resourceVersion"] = self.next_rv()

    def create_trainjob(self, namespace: str, body: dict) -> dict:
        meta = body.setdefault("metadata", {})
        if not meta.get("name"):
            meta["name"] = meta["generateName"] + random_suffix()
        name = meta["name"]
        obj = copy.deepcopy(body)
        spec = obj["spec"]
        spec.setdefault("runtimeRef", {}).setdefault("apiGroup", GROUP)
        spec["runtimeRef"].setdefault("kind", "ClusterTrainingRuntime")
        spec.setdefault("suspend", False)
        spec.setdefault("managedBy", MANAGED_BY[0])
        meta = obj["metadata"]
        for server_owned in ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
                             "deletionGracePeriodSeconds", "managedFields", "selfLink"):
            meta.pop(server_owned, None)
        meta.update(namespace=namespace, uid=str(uuid.uuid4()), generation=1, creationTimestamp=rfc3339())
        obj.pop("status", None)
        with self.lock:
            if (namespace, name) in self.trainjobs:
                raise ApiError(409, "AlreadyExists", f'trainjobs.{GROUP} "{name}" already exists',
                               details={"name": name, "group": GROUP, "kind": "trainjobs"})
            self._touch(obj)
            self.trainjobs[(namespace, name)] = obj
            self._tj_state[(namespace, name)] = {"jobset_uid": str(uuid.uuid4()), "active_since": None}
        return copy.deepcopy(obj)

    # -- the controller ---------------------------------------------------------------------

    def _control_loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.reconcile()
            except Exception as exc:  # keep serving; tests see it in controller_errors
                self.controller_errors.append(f"{type(exc).__name__}: {exc}")
            self.ticks += 1

    def reconcile(self) -> None:
        """One controller pass over every TrainJob and orphaned pod."""
        with self.lock:
            self._groups = set(_process_groups().values())  # one /proc scan per pass
            for key in list(self.trainjobs):
                self._reconcile_trainjob(key)
            self._reconcile_orphans()

    def _reconcile_trainjob(self, key: tuple[str, str]) -> None:
        namespace, name = key
        obj = self.trainjobs[key]
        state = self._tj_state[key]
        pods = [p for (ns, _), p in self.pods.items() if ns == namespace and p.trainjob == name]
        spec = obj["spec"]
        status = obj.setdefault("status", {})
        before = json.dumps(obj, sort_keys=True)

        if obj["metadata"].get("deletionTimestamp"):  # foreground deletion: pods first, then the object
            for pod in pods:
                self._kill(pod, "TrainJob deleted", grace=state.get("delete_grace"))
            self._update_pods(pods)
            if not any(p.name in self._live_pod_names() for p in pods):
                for pod in pods:
                    self.pods.pop((namespace, pod.name), None)
                del self.trainjobs[key]
                del self._tj_state[key]
                self._collect_garbage(obj["metadata"]["uid"])
            return

        finished = self._has_condition(obj, "Complete") or self._has_condition(obj, "Failed")
        if spec.get("suspend") and not finished:
            for pod in pods:
                self._kill(pod, "Suspended")
            self._update_pods(pods)
            for pod in pods:
                if pod.name not in self._live_pod_names():
                    self.pods.pop((namespace, pod.name), None)
            state["active_since"] = None
            self._set_condition(obj, "Suspended", "True", "Suspended", "TrainJob is suspended")
        else:
            if not finished and self._has_condition(obj, "Suspended") and spec.get("suspend") is False:
                self._set_condition(obj, "Suspended", "False", "Resumed", "TrainJob is resumed")
            if not finished and not pods:
                pods = self._create_pods(obj, state)
            if not finished:
                self._start_pods(pods)
            self._update_pods(pods)
            if not finished:
                self._judge(obj, state, pods)
        status["jobsStatus"] = [self._jobs_status(obj, pods)]
        if json.dumps(obj, sort_keys=True) != before:
            self._touch(obj)

    def _judge(self, obj: dict, state: dict, pods: list[Pod]) -> None:
        phases = [p.obj["status"]["phase"] for p in pods]
        deadline = obj["spec"].get("activeDeadlineSeconds")
        if pods and all(ph == "Succeeded" for ph in phases):
            self._set_condition(obj, "Complete", "True", "AllJobsCompleted", "jobset completed successfully")
        elif any(ph == "Failed" and (not p.killed_reason or p.disruption) for p, ph in zip(pods, phases)):
            for pod in pods:
                self._kill(pod, "FailedJobs")
            self._set_condition(obj, "Failed", "True", "FailedJobs", "jobset failed due to one or more job failures")
        elif deadline and state["active_since"] is not None and time.monotonic() - state["active_since"] > deadline:
            for pod in pods:
                self._kill(pod, "DeadlineExceeded")
            self._set_condition(obj, "Failed", "True", "DeadlineExceeded",
                                f"TrainJob exceeded its activeDeadlineSeconds ({deadline} s)")

    def _create_pods(self, obj: dict, state: dict) -> list[Pod]:
        namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        trainer = obj["spec"].get("trainer") or {}
        nnodes = trainer.get("numNodes") or self.runtimes[obj["spec"]["runtimeRef"]["name"]]["spec"]["mlPolicy"]["numNodes"]
        state["master_port"] = free_port()
        state["active_since"] = time.monotonic()
        job_name = f"{name}-{REPLICATED_JOB}-0"
        job_uid = str(uuid.uuid4())
        patch = _node_pod_patch(obj)
        pods = []
        for index in range(nnodes):
            pod_name = f"{job_name}-{index}-{random_suffix()}"
            env = [{"name": e["name"], **({"value": e["value"]} if "value" in e else {}),
                    **({"valueFrom": e["valueFrom"]} if e.get("valueFrom") else {})}
                   for e in trainer.get("env") or []]
            env += [{"name": "PET_NNODES", "value": str(nnodes)},
                    {"name": "PET_NPROC_PER_NODE", "value": nproc_per_node(trainer, self.runtimes[obj["spec"]["runtimeRef"]["name"]])},
                    {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
                        "apiVersion": "v1",
                        "fieldPath": f"metadata.annotations['{LABEL_COMPLETION_INDEX}']"}}},
                    {"name": "PET_MASTER_ADDR", "value": "127.0.0.1"},
                    {"name": "PET_MASTER_PORT", "value": str(state["master_port"])}]
            container = {"name": REPLICATED_JOB, "image": trainer.get("image", "pytorch/pytorch"),
                         "command": list(trainer.get("command") or []), "args": list(trainer.get("args") or []),
                         "env": env, "resources": copy.deepcopy(trainer.get("resourcesPerNode") or {}),
                         "ports": [{"containerPort": 29400, "protocol": "TCP"}]}
            pod_spec = {"containers": [container], "restartPolicy": "Never", "subdomain": name,
                        "hostname": f"{job_name}-{index}", "terminationGracePeriodSeconds": int(self.grace_period_s),
                        "serviceAccountName": patch.get("serviceAccountName", "default")}
            for field in ("nodeSelector", "tolerations", "affinity", "schedulingGates", "imagePullSecrets"):
                if field in patch:
                    pod_spec[field] = copy.deepcopy(patch[field])
            pod_obj = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": namespace, "uid": str(uuid.uuid4()),
                             "creationTimestamp": rfc3339(), "labels": pod_labels(namespace, name, state["jobset_uid"], index, job_uid),
                             "annotations": {LABEL_COMPLETION_INDEX: str(index), LABEL_JOBSET_NAME: name,
                                             LABEL_REPLICATED_JOB: REPLICATED_JOB},
                             "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": job_name,
                                                  "uid": job_uid, "controller": True, "blockOwnerDeletion": True}]},
                "spec": pod_spec,
                "status": {"phase": "Pending", "qosClass": "BestEffort",
                           "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                           "message": "0/2 nodes are available: the stand-in holds its pods"}]},
            }
            workdir = self.directory / "pods" / namespace / pod_name
            workdir.mkdir(parents=True)
            pod = Pod(obj=pod_obj, trainjob=name, index=index, workdir=workdir,
                      log_path=self.directory / "pods" / namespace / f"{pod_name}.log", grace_s=self.grace_period_s)
            pod.log_path.touch()
            self._touch(pod_obj)
            self.pods[(namespace, pod_name)] = pod
            pods.append(pod)
        return pods

    def _secret_value(self, namespace: str, ref: dict) -> tuple[str | None, str]:
        """(value, "") of a ``secretKeyRef``, or (None, the kubelet's message) when the Secret or its key
        is missing (the pod then waits in CreateContainerConfigError, as a kubelet's would); an
        ``optional`` reference to a missing one is (None, "")."""
        obj = self.secrets.get((namespace, ref.get("name", "")))
        if obj is None:
            return None, "" if ref.get("optional") else f'secret "{ref.get("name", "")}" not found'
        value = (obj.get("data") or {}).get(ref.get("key", ""))
        if value is None:
            return None, "" if ref.get("optional") else (
                f"couldn't find key {ref.get('key', '')} in Secret {namespace}/{ref.get('name', '')}")
        return base64.b64decode(value).decode(), ""

    def _collect_garbage(self, uid: str) -> None:
        """Delete the Secrets owned by the object with ``uid`` (an ownerReference to it), as the
        garbage collector does once their owner is gone."""
        for key, obj in list(self.secrets.items()):
            if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or ()):
                del self.secrets[key]

    def _start_pods(self, pods: list[Pod]) -> None:
        if not self.schedulable:
            return
        for pod in pods:
            if pod.proc is not None or pod.start_error or pod.kill_sent is not None:
                continue
            container = pod.obj["spec"]["containers"][0]
            env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
                   "HOME": str(pod.workdir), "HOSTNAME": pod.name, "PYTHONPATH": str(REPO_ROOT),
                   "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}
            for item in container["env"]:
                if "value" in item:
                    env[item["name"]] = item["value"]
                elif (item.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath", "").startswith("metadata.annotations"):
                    env[item["name"]] = str(pod.index)  # the completion index annotation
                elif (ref := (item.get("valueFrom") or {}).get("secretKeyRef")):
                    value, problem = self._secret_value(pod.obj["metadata"]["namespace"], ref)
                    if problem:
                        pod.start_error = problem
                    elif value is not None:
                        env[item["name"]] = value
                else:
                    pod.start_error = (f"env {item['name']}: the stand-in resolves literal values, secret keys and "
                                       "the completion-index annotation, not config maps")
            argv = list(container["command"]) + list(container["args"])
            if not argv:
                pod.start_error = "the stand-in runs trainer.command + trainer.args, and the TrainJob has neither"
            if pod.start_error:
                pod.obj["status"].update(phase="Pending", containerStatuses=[_container_status(
                    pod, {"waiting": {"reason": "CreateContainerConfigError", "message": pod.start_error}})])
                continue
            if argv[0] in ("python", "python3"):
                argv[0] = self.python
            log = open(pod.log_path, "ab")
            pod.environ = dict(env)
            try:
                proc = subprocess.Popen(argv, cwd=pod.workdir, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                log.close()
                pod.start_error = f"failed to start container: {exc}"
                pod.obj["status"]["containerStatuses"] = [_container_status(
                    pod, {"terminated": {"exitCode": 128, "reason": "StartError", "message": pod.start_error}})]
                pod.obj["status"]["phase"] = "Failed"
                continue
            self._all_procs.append(proc)
            pod.proc = proc
            pod.started_at = time.time()
            pod.started_ns = time.time_ns()
            pod.reader = threading.Thread(target=_copy_log, args=(proc, log), daemon=True,
                                          name=f"k8s-standin-log-{pod.name}")
            pod.reader.start()
            pod.obj["spec"]["nodeName"] = f"standin-node-{pod.index}"

    def _update_pods(self, pods: list[Pod]) -> None:
        live = self._live_pod_names()
        for pod in pods:
            status = pod.obj["status"]
            before = json.dumps(status, sort_keys=True)
            if pod.proc is None:
                if pod.kill_sent is not None and not pod.start_error:
                    status["phase"] = "Failed"
                    status["reason"] = pod.killed_reason
                elif self.schedulable and not pod.start_error:
                    status["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            else:
                started = rfc3339(pod.started_at)
                code = pod.proc.poll()
                status.update(podIP="127.0.0.1", hostIP="127.0.0.1", startTime=started,
                              podIPs=[{"ip": "127.0.0.1"}], hostIPs=[{"ip": "127.0.0.1"}])
                if code is None or pod.name in live:
                    status["phase"] = "Running"
                    status["containerStatuses"] = [_container_status(pod, {"running": {"startedAt": started}},
                                                                     ready=True)]
                    status["conditions"] = _pod_conditions(ready=True)
                else:
                    ok = code == 0 and not pod.killed_reason
                    status["phase"] = "Succeeded" if ok else "Failed"
                    if pod.killed_reason:
                        status["reason"] = pod.killed_reason
                    terminated = {"exitCode": code if code >= 0 else 128 - code,
                                  "reason": "Completed" if code == 0 else "Error", "startedAt": started,
                                  "finishedAt": rfc3339(), "containerID": f"standin://{pod.proc.pid}"}
                    if code < 0:
                        terminated["signal"] = -code
                    prev = (status.get("containerStatuses") or [{}])[0].get("state", {}).get("terminated")
                    if prev:
                        terminated["finishedAt"] = prev["finishedAt"]
                    status["containerStatuses"] = [_container_status(pod, {"terminated": terminated})]
                    status["conditions"] = _pod_conditions(ready=False)
            if pod.disruption is not None:
                status["conditions"] = [c for c in status.get("conditions") or []
                                        if c["type"] != "DisruptionTarget"] + [pod.disruption]
            if pod.kill_sent is not None:
                if (pod.disruption or {}).get("reason") != "TerminationByKubelet":  # the kubelet deletes nothing
                    pod.obj["metadata"].setdefault("deletionTimestamp", rfc3339())
                if (pod.proc is not None and pod.name in live
                        and time.monotonic() - pod.kill_sent > pod.grace_s):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pod.proc.pid, signal.SIGKILL)
            if json.dumps(status, sort_keys=True) != before:
                self._touch(pod.obj)

    def _kill(self, pod: Pod, reason: str, grace: float | None = None) -> None:
        if pod.kill_sent is not None:
            return
        pod.kill_sent = time.monotonic()
        pod.killed_reason = pod.killed_reason or (reason if pod.obj["status"]["phase"] in ("Pending", "Running") else "")
        if grace is not None:
            pod.grace_s = grace
        if pod.proc is not None and pod.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pod.proc.pid, signal.SIGTERM if pod.grace_s > 0 else signal.SIGKILL)

    def _reconcile_orphans(self) -> None:
        """Pods whose TrainJob went away with Background propagation: the garbage collector deletes them."""
        live = self._live_pod_names()
        for key, pod in list(self.pods.items()):
            owner = (key[0], pod.trainjob)
            if owner in self.trainjobs or pod.orphaned:
                continue
            self._kill(pod, "TrainJob deleted")
            self._update_pods([pod])
            if pod.name not in live:
                del self.pods[key]

    def _live_pod_names(self) -> set[str]:
        """Pods with a live process in their group, as of this pass's /proc scan."""
        return {p.name for p in self.pods.values() if p.proc is not None and p.proc.pid in self._groups}

    @staticmethod
    def _has_condition(obj: dict, type_: str) -> bool:
        return any(c["type"] == type_ and c["status"] == "True" for c in (obj.get("status") or {}).get("conditions") or [])

    @staticmethod
    def _set_condition(obj: dict, type_: str, status: str, reason: str, message: str) -> None:
        conditions = obj.setdefault("status", {}).setdefault("conditions", [])
        for cond in conditions:
            if cond["type"] == type_:
                if (cond["status"], cond["reason"], cond["message"]) != (status, reason, message):
                    if cond["status"] != status:
                        cond["lastTransitionTime"] = rfc3339()
                    cond.update(status=status, reason=reason, message=message,
                                observedGeneration=obj["metadata"]["generation"])
                return
        conditions.append({"type": type_, "status": status, "reason": reason, "message": message,
                           "lastTransitionTime": rfc3339(), "observedGeneration": obj["metadata"]["generation"]})

    def _jobs_status(self, obj: dict, pods: list[Pod]) -> dict:
        """JobSet's ReplicatedJobStatus for the one child Job ``node-0`` (counts of Jobs, not pods)."""
        phases = [p.obj["status"]["phase"] for p in pods]
        failed = self._has_condition(obj, "Failed") and any(ph == "Failed" for ph in phases)
        succeeded = bool(pods) and all(ph == "Succeeded" for ph in phases)
        suspended = bool(obj["spec"].get("suspend")) and not pods
        active = bool(pods) and not failed and not succeeded and any(ph in ("Pending", "Running") for ph in phases)
        ready = bool(pods) and all(ph in ("Running", "Succeeded") for ph in phases) and not failed
        return {"name": REPLICATED_JOB, "active": int(active), "ready": int(ready), "succeeded": int(succeeded),
                "failed": int(failed), "suspended": int(suspended)}


def nproc_per_node(trainer: dict, runtime: dict) -> str:
    """PET_NPROC_PER_NODE as Trainer's torch plugin computes it (torch.go ``EnforceMLPolicy``):
    numProcPerNode (the runtime's, ``auto``, when the TrainJob has none); with resourcesPerNode,
    ``auto`` and no GPU resource → the CPU count (limits first, then requests; at least 1), ``cpu`` →
    the CPU count when a cpu resource is set, else 1."""
    value = trainer.get("numProcPerNode", runtime["spec"]["mlPolicy"]["torch"]["numProcPerNode"])
    resources = trainer.get("resourcesPerNode")
    if resources is None or value not in ("auto", "cpu"):
        return str(value)
    for kind in ("limits", "requests"):
        amounts = resources.get(kind)
        if amounts is None:
            continue
        uses_cpu = ("cpu" in amounts) if value == "cpu" else not any("gpu" in k.lower() for k in amounts)
        if uses_cpu:
            return str(max(1, cpu_count_of(amounts.get("cpu", 0)) or 0))
    return "1" if value == "cpu" else value


def pod_labels(namespace: str, trainjob: str, jobset_uid: str, index: int, job_uid: str) -> dict[str, str]:
    """The labels of a TrainJob's pod: JobSet's (jobset_controller.go ``labelAndAnnotateObject``) and
    the Indexed Job controller's (``batch.kubernetes.io/job-completion-index``, ``job-name``,
    ``controller-uid``)."""
    job_name = f"{trainjob}-{REPLICATED_JOB}-0"
    return {
        LABEL_JOBSET_NAME: trainjob, LABEL_JOBSET_UID: jobset_uid, LABEL_REPLICATED_JOB: REPLICATED_JOB,
        LABEL_REPLICATED_JOB_REPLICAS: "1", LABEL_JOB_INDEX: "0", LABEL_JOB_GLOBAL_INDEX: "0",
        LABEL_JOB_KEY: hashlib.sha1(f"{namespace}/{job_name}".encode()).hexdigest(), LABEL_RESTART_ATTEMPT: "0",
        LABEL_COMPLETION_INDEX: str(index), LABEL_JOB_NAME: job_name, "job-name": job_name,
        LABEL_CONTROLLER_UID: job_uid, "controller-uid": job_uid,
    }


def _node_pod_patch(obj: dict) -> dict:
    """The PodSpecPatch fields of the runtimePatches that target the replicated Job ``node``, merged."""
    merged: dict = {}
    for patch in obj["spec"].get("runtimePatches") or []:
        jobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
        for job in jobs:
            if job.get("name") == REPLICATED_JOB:
                merged.update(((job.get("template") or {}).get("spec") or {}).get("template", {}).get("spec") or {})
    return merged


def _container_status(pod: Pod, state: dict, *, ready: bool = False) -> dict:
    return {"name": REPLICATED_JOB, "image": pod.obj["spec"]["containers"][0]["image"], "imageID": "",
            "ready": ready, "restartCount": 0, "started": "running" in state, "state": state}


def _pod_conditions(*, ready: bool) -> list[dict]:
    status = "True" if ready else "False"
    return [{"type": t, "status": s} for t, s in
            (("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", status), ("Ready", status))]


def _copy_log(proc: subprocess.Popen, log) -> None:
    """Copy the process's output to its log, each line behind an RFC3339Nano timestamp."""
    with log:
        for line in iter(proc.stdout.readline, b""):
            log.write(rfc3339nano(time.time_ns()).encode() + b" " + line.rstrip(b"\n") + b"\n")
            log.flush()
        proc.stdout.close()
    proc.wait()


def _process_groups() -> dict[int, int]:
    """pid → process group id of every live (not zombie) process on the machine."""
    groups = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X"):
            groups[int(entry)] = int(fields[2])
    return groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_pod_log(pod: Pod, query: dict[str, list[str]]) -> bytes:
    """The pod's log as ``GET …/log`` returns it for these PodLogOptions (see the module docstring).
    Raises :class:`ApiError` for invalid options (422) or a container that has not started (400)."""
    one = {k: v[-1] for k, v in query.items()}
    errors = []
    container = one.get("container", REPLICATED_JOB)
    if container != REPLICATED_JOB:
        raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {pod.name}")
    ints = {}
    for name, minimum in (("sinceSeconds", 1), ("tailLines", 0), ("limitBytes", 1)):
        if name in one:
            try:
                ints[name] = int(one[name])
            except ValueError:
                errors.append(f"{name}: Invalid value: {json.dumps(one[name])}: must be an integer")
                continue
            if ints[name] < minimum:
                errors.append(f"{name}: Invalid value: {ints[name]}: must be "
                              + ("greater than 0" if minimum else "greater than or equal to 0"))
    since_ns = None
    if "sinceTime" in one:
        since_ns = parse_rfc3339_ns(one["sinceTime"])
        if since_ns is None:
            errors.append(f"sinceTime: Invalid value: {json.dumps(one['sinceTime'])}: must be an RFC3339 time")
    if "sinceTime" in one and "sinceSeconds" in one:
        errors.append("sinceSeconds: Forbidden: at most one of `sinceTime` or `sinceSeconds` may be specified")
    if errors:
        raise ApiError(422, "Invalid", f'PodLogOptions "{pod.name}" is invalid: [{", ".join(errors)}]')
    if pod.proc is None:
        reason = pod.obj["status"].get("containerStatuses", [{}])[0].get("state", {}).get("waiting", {}).get("reason", "ContainerCreating")
        raise ApiError(400, "BadRequest", f'container "{REPLICATED_JOB}" in pod "{pod.name}" is waiting to start: {reason}')
    if "sinceSeconds" in ints:
        since_ns = time.time_ns() - ints["sinceSeconds"] * 1_000_000_000
    timestamps = one.get("timestamps", "false").lower() in ("true", "1")
    lines = []
    for raw in pod.log_path.read_bytes().splitlines(keepends=True):
        stamp, _, text = raw.partition(b" ")
        if since_ns is not None and (parse_rfc3339_ns(stamp.decode()) or 0) < since_ns:
            continue
        lines.append(raw if timestamps else text)
    if "tailLines" in ints:
        lines = lines[len(lines) - ints["tailLines"]:] if ints["tailLines"] else []
    data = b"".join(lines)
    if "limitBytes" in ints:
        data = data[:ints["limitBytes"]]
    return data


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error the server answers with a Kubernetes ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


TRAINJOBS = re.compile(rf"^/apis/{re.escape(GROUP)}/{VERSION}(?:/namespaces/([^/]+))?/trainjobs(?:/([^/]+))?$")
RUNTIMES = re.compile(rf"^/apis/{re.escape(GROUP)}/{VERSION}/clustertrainingruntimes(?:/([^/]+))?$")
PODS = re.compile(r"^/api/v1(?:/namespaces/([^/]+))?/pods(?:/([^/]+)(/log|/eviction)?)?$")
EVICTION_SCHEMA = {"apiVersion": "string", "kind": "string", "metadata": OBJECT_META,
                   "deleteOptions": {"apiVersion": "string", "kind": "string", "gracePeriodSeconds": "int",
                                     "propagationPolicy": "string", "dryRun": ("list", "string"),
                                     "orphanDependents": "bool", "ignoreStoreReadErrorWithClusterBreakingPotential": "bool",
                                     "preconditions": {"uid": "string", "resourceVersion": "string"}}}
NAMESPACE = re.compile(r"^/api/v1/namespaces/([^/]+)$")
NODES = re.compile(r"^/api/v1/nodes(?:/([^/]+))?$")
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
SECRETS = re.compile(r"^/api/v1/namespaces/([^/]+)/secrets(?:/([^/]+))?$")
SECRET_SCHEMA = {"apiVersion": "string", "kind": "string", "metadata": OBJECT_META, "data": ("map", "string"),
                 "stringData": ("map", "string"), "type": "string", "immutable": "bool"}
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


class _Handler(BaseHTTPRequestHandler):
    standin: KubeStandin
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - keep the test output clean
        pass

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def do_PATCH(self):
        self._serve("PATCH")

    def do_DELETE(self):
        self._serve("DELETE")

    def do_PUT(self):
        self._serve("PUT")

    def _serve(self, method: str) -> None:
        parsed = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        record = RecordedRequest(method=method, path=parsed.path, query=query, body=None,
                                 content_type=self.headers.get("Content-Type", ""))
        try:
            if raw:
                try:
                    record.body = json.loads(raw)
                except ValueError:
                    raise ApiError(400, "BadRequest", "the request body is not JSON") from None
            with self.standin.lock:
                self.standin.requests.append(record)
            if self.headers.get("Authorization") != f"Bearer {self.standin.token}":
                raise ApiError(401, "Unauthorized", "Unauthorized")
            code, body = self._route(method, parsed.path, query, record.body, record.content_type)
        except ApiError as exc:
            code, body = exc.code, exc.status()
        except Exception as exc:  # a stand-in bug: answer it, never hang the client
            code, body = 500, ApiError(500, "InternalError", f"stand-in error: {type(exc).__name__}: {exc}").status()
        record.status = code
        if isinstance(body, bytes):
            payload, ctype = body, "text/plain"
        else:
            payload, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Audit-Id", str(uuid.uuid4()))
        self.end_headers()
        self.wfile.write(payload)

    def _route(self, method, path, query, body, content_type):
        standin = self.standin
        path = path.rstrip("/") or "/"  # the client asks for /version/
        if path == "/version" and method == "GET":
            return 200, SERVER_VERSION
        if path == "/api" and method == "GET":
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{standin.port}"}]}
        if path == "/apis" and method == "GET":
            version = {"groupVersion": API_VERSION, "version": VERSION}
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": GROUP, "versions": [version], "preferredVersion": version}]}
        if path == f"/apis/{GROUP}/{VERSION}" and method == "GET":
            return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": API_VERSION, "resources": [
                {"name": "trainjobs", "singularName": "trainjob", "namespaced": True, "kind": "TrainJob",
                 "verbs": ["create", "delete", "get", "list", "patch"]},
                {"name": "clustertrainingruntimes", "singularName": "clustertrainingruntime", "namespaced": False,
                 "kind": "ClusterTrainingRuntime", "verbs": ["get", "list"]}]}
        if match := NAMESPACE.match(path):
            if method != "GET":
                raise _not_allowed(method)
            name = match.group(1)
            if name not in standin.namespaces:
                raise ApiError(404, "NotFound", f'namespaces "{name}" not found', {"name": name, "kind": "namespaces"})
            return 200, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, name))},
                         "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}
        if match := NODES.match(path):
            if method != "GET":
                raise _not_allowed(method)
            return self._nodes(match.group(1), query)
        if path == ACCESS_REVIEWS:
            if method != "POST" or not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "POST a SelfSubjectAccessReview")
            review = copy.deepcopy(body)
            review["status"] = {"allowed": standin.access_allowed,
                                **({} if standin.access_allowed else {"reason": "the stand-in denies it"})}
            return 201, review
        if match := TRAINJOBS.match(path):
            return self._trainjobs(method, match.group(1), match.group(2), query, body, content_type)
        if match := SECRETS.match(path):
            return self._secrets(method, match.group(1), match.group(2), body, content_type)
        if match := RUNTIMES.match(path):
            if method != "GET":
                raise _not_allowed(method)
            name = match.group(1)
            if name is None:
                return 200, {"apiVersion": API_VERSION, "kind": "ClusterTrainingRuntimeList",
                             "metadata": {"resourceVersion": str(standin._rv)},
                             "items": list(standin.runtimes.values())}
            if name not in standin.runtimes:
                raise ApiError(404, "NotFound", f'clustertrainingruntimes.{GROUP} "{name}" not found',
                               {"name": name, "group": GROUP, "kind": "clustertrainingruntimes"})
            return 200, standin.runtimes[name]
        if match := PODS.match(path):
            if match.group(3) == "/eviction" and match.group(1) is not None:
                if method != "POST":
                    raise _not_allowed(method)
                return self._evict(match.group(1), match.group(2), body)
            if method != "GET" or match.group(3) == "/eviction":
                raise _not_allowed(method)
            return self._pods(match.group(1), match.group(2), match.group(3) == "/log", query)
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

    def _nodes(self, name, query):
        standin = self.standin
        nodes = []
        for i in range(standin.node_count):
            node_name = f"standin-node-{i}"
            nodes.append({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": node_name, "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, node_name)),
                             "labels": {"kubernetes.io/hostname": node_name, "kubernetes.io/os": "linux",
                                        **standin.node_labels}},
                "spec": {},
                "status": {"capacity": {"cpu": "4", "memory": "16Gi", "pods": "110"},
                           "allocatable": {"cpu": "4", "memory": "16Gi", "pods": "110"},
                           "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                           "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                         {"type": "Hostname", "address": node_name}]},
            })
        if name is None:
            selector = _selector(query)
            return 200, {"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": str(standin._rv)},
                         "items": [n for n in nodes if selector(n["metadata"]["labels"])]}
        for node in nodes:
            if node["metadata"]["name"] == name:
                return 200, node
        raise ApiError(404, "NotFound", f'nodes "{name}" not found', {"name": name, "kind": "nodes"})

    def _namespace(self, namespace: str) -> None:
        if namespace not in self.standin.namespaces:
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                           {"name": namespace, "kind": "namespaces"})

    def _trainjobs(self, method, namespace, name, query, body, content_type):
        standin = self.standin
        selector = _selector(query)
        if name is None and method == "GET":
            with standin.lock:
                items = [copy.deepcopy(obj) for (ns, _), obj in sorted(standin.trainjobs.items())
                         if (namespace is None or ns == namespace) and selector(obj["metadata"].get("labels") or {})]
                return 200, {"apiVersion": API_VERSION, "kind": "TrainJobList",
                             "metadata": {"resourceVersion": str(standin._rv)}, "items": items}
        if namespace is None:
            raise _not_allowed(method)
        self._namespace(namespace)
        if name is None and method == "POST":
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the request body must be a TrainJob object")
            validation = (query.get("fieldValidation") or ["Strict"])[-1]
            unknown, type_errors = schema_errors(body, TRAINJOB_SCHEMA, "")
            meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
            label = meta.get("name") or meta.get("generateName") or ""
            if unknown and validation == "Strict":
                raise ApiError(400, "BadRequest", f"TrainJob in version \"{VERSION}\" cannot be handled as a TrainJob: "
                               + "strict decoding error: " + ", ".join(f'unknown field "{u}"' for u in unknown))
            body = _drop_fields(body, unknown)
            errors = type_errors or trainjob_value_errors(body, standin.runtimes)
            if not meta.get("name") and not meta.get("generateName"):
                errors.append("metadata.name: Required value: name or generateName is required")
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the "
                               "namespace sent on the request")
            if errors:
                raise ApiError(422, "Invalid", f'TrainJob.{GROUP} "{label}" is invalid: [{", ".join(errors)}]',
                               {"name": label, "group": GROUP, "kind": "TrainJob",
                                "causes": [{"reason": "FieldValueInvalid", "message": e, "field": e.split(":")[0]}
                                           for e in errors]})
            return 201, standin.create_trainjob(namespace, body)
        if name is None:
            raise _not_allowed(method)
        with standin.lock:
            obj = standin.trainjobs.get((namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'trainjobs.{GROUP} "{name}" not found',
                               {"name": name, "group": GROUP, "kind": "trainjobs"})
            if method == "GET":
                return 200, copy.deepcopy(obj)
            if method == "PATCH":
                return 200, self._patch(obj, body, content_type)
            if method == "DELETE":
                return 200, self._delete(namespace, name, obj, query, body)
        raise _not_allowed(method)

    def _patch(self, obj: dict, patch: Any, content_type: str) -> dict:
        if "merge-patch+json" not in content_type:
            raise ApiError(415, "UnsupportedMediaType", f"the stand-in takes merge patches only, not {content_type!r}")
        if not isinstance(patch, dict):
            raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
        new = _merge(copy.deepcopy(obj), patch)
        unknown, errors = schema_errors(new, TRAINJOB_SCHEMA, "")
        if unknown:
            raise ApiError(400, "BadRequest", "strict decoding error: " + ", ".join(f'unknown field "{u}"' for u in unknown))
        errors = errors or trainjob_value_errors(new, self.standin.runtimes)
        for field, value in new["spec"].items():
            if field != "suspend" and value != obj["spec"].get(field):
                errors.append(f"spec.{field}: Invalid value: \"object\": field is immutable")
        for field in ("name", "namespace", "uid"):
            if new["metadata"].get(field) != obj["metadata"].get(field):
                errors.append(f"metadata.{field}: Invalid value: field is immutable")
        if errors:
            name = obj["metadata"]["name"]
            raise ApiError(422, "Invalid", f'TrainJob.{GROUP} "{name}" is invalid: [{", ".join(errors)}]',
                           {"name": name, "group": GROUP, "kind": "TrainJob"})
        new["status"] = obj.get("status", {})
        if new["spec"] != obj["spec"]:
            new["metadata"]["generation"] = obj["metadata"]["generation"] + 1
        obj.clear()
        obj.update(new)
        self.standin._touch(obj)
        return copy.deepcopy(obj)

    def _delete(self, namespace: str, name: str, obj: dict, query: dict, body: Any) -> dict:
        options = body if isinstance(body, dict) else {}
        policy = (query.get("propagationPolicy") or [options.get("propagationPolicy") or "Background"])[-1]
        if policy not in ("Foreground", "Background", "Orphan"):
            raise ApiError(422, "Invalid", f'DeleteOptions is invalid: propagationPolicy: Unsupported value: '
                           f'"{policy}": supported values: "Foreground", "Background", "Orphan"')
        grace = (query.get("gracePeriodSeconds") or [options.get("gracePeriodSeconds")])[-1]
        standin = self.standin
        key = (namespace, name)
        if policy == "Foreground":
            meta = obj["metadata"]
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = rfc3339()
                meta["deletionGracePeriodSeconds"] = 0
                meta["finalizers"] = sorted(set(meta.get("finalizers") or []) | {"foregroundDeletion"})
                standin._tj_state[key]["delete_grace"] = float(grace) if grace is not None else None
                standin._touch(obj)
            return copy.deepcopy(obj)
        if policy == "Orphan":
            for pod in standin.pods_of(namespace, name):
                pod.orphaned = True
                pod.obj["metadata"]["ownerReferences"] = []
        elif grace is not None:
            for pod in standin.pods_of(namespace, name):
                pod.grace_s = float(grace)
        del standin.trainjobs[key]
        del standin._tj_state[key]
        standin._collect_garbage(obj["metadata"]["uid"])
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "group": GROUP, "kind": "trainjobs", "uid": obj["metadata"]["uid"]}}

    def _secrets(self, method, namespace, name, body, content_type):
        """core/v1 Secrets: POST (201, 409 AlreadyExists, 422 for a bad name, key or base64 value;
        ``stringData`` is folded into ``data``), GET one, PATCH (merge patch, or a strategic merge patch:
        the client's default for a dict body, which merges ``ownerReferences`` by uid), DELETE."""
        standin = self.standin
        self._namespace(namespace)
        if name is None:
            if method != "POST":
                raise _not_allowed(method)
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the request body must be a Secret object")
            unknown, type_errors = schema_errors(body, SECRET_SCHEMA, "")
            if unknown:
                raise ApiError(400, "BadRequest", "Secret in version \"v1\" cannot be handled as a Secret: strict "
                               "decoding error: " + ", ".join(f'unknown field "{u}"' for u in unknown))
            meta = body.get("metadata") or {}
            label = meta.get("name") or ""
            obj, errors = _secret_object(body, namespace)
            errors = type_errors + errors
            if errors:
                raise ApiError(422, "Invalid", f'Secret "{label}" is invalid: [{", ".join(errors)}]',
                               {"name": label, "kind": "Secret"})
            with standin.lock:
                key = (namespace, obj["metadata"]["name"])
                if key in standin.secrets:
                    raise ApiError(409, "AlreadyExists", f'secrets "{key[1]}" already exists',
                                   {"name": key[1], "kind": "secrets"})
                obj["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=rfc3339(),
                                       resourceVersion=standin.next_rv())
                standin.secrets[key] = obj
                return 201, copy.deepcopy(obj)
        with standin.lock:
            obj = standin.secrets.get((namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'secrets "{name}" not found', {"name": name, "kind": "secrets"})
            if method == "GET":
                return 200, copy.deepcopy(obj)
            if method == "DELETE":
                del standin.secrets[(namespace, name)]
                return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                             "details": {"name": name, "kind": "secrets", "uid": obj["metadata"]["uid"]}}
            if method == "PATCH":
                if "merge-patch+json" not in content_type:  # merge-patch or strategic-merge-patch
                    raise ApiError(415, "UnsupportedMediaType",
                                   f"the stand-in takes (strategic) merge patches only, not {content_type!r}")
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
                patch = copy.deepcopy(body)
                owners = (patch.get("metadata") or {}).get("ownerReferences")
                if "strategic" in content_type and isinstance(owners, list):
                    # ObjectMeta.ownerReferences: patchStrategy merge, patchMergeKey uid
                    kept = {ref.get("uid"): ref for ref in obj["metadata"].get("ownerReferences") or ()}
                    kept.update({ref.get("uid"): ref for ref in owners if isinstance(ref, dict)})
                    patch["metadata"]["ownerReferences"] = list(kept.values())
                merged = _merge(copy.deepcopy(obj), patch)
                new, errors = _secret_object(merged, namespace)
                for field in ("name", "namespace", "uid"):
                    if new["metadata"].get(field) != obj["metadata"].get(field):
                        errors.append(f"metadata.{field}: Invalid value: field is immutable")
                if errors:
                    raise ApiError(422, "Invalid", f'Secret "{name}" is invalid: [{", ".join(errors)}]',
                                   {"name": name, "kind": "Secret"})
                new["metadata"]["resourceVersion"] = standin.next_rv()
                obj.clear()
                obj.update(new)
                return 200, copy.deepcopy(obj)
        raise _not_allowed(method)

    def _pods(self, namespace, name, log, query):
        standin = self.standin
        if namespace is not None:
            self._namespace(namespace)
        if name is None:
            selector = _selector(query)
            with standin.lock:
                items = [copy.deepcopy(p.obj) for (ns, _), p in sorted(standin.pods.items())
                         if (namespace is None or ns == namespace) and selector(p.obj["metadata"]["labels"])]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": str(standin._rv)},
                         "items": items}
        with standin.lock:
            pod = standin.pods.get((namespace, name))
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
            if not log:
                return 200, copy.deepcopy(pod.obj)
        return 200, read_pod_log(pod, query)


    def _evict(self, namespace, name, body):
        """``POST …/pods/{name}/eviction``: the pod disrupted with reason EvictionByEvictionAPI (no
        PodDisruptionBudget here, so never a 429). A pod that already ended, or is being deleted, is
        left as it is (201)."""
        standin = self.standin
        self._namespace(namespace)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the request body must be a policy/v1 Eviction")
        unknown, errors = schema_errors(body, EVICTION_SCHEMA, "")
        if unknown:
            raise ApiError(400, "BadRequest", "strict decoding error: " + ", ".join(f'unknown field "{u}"' for u in unknown))
        # Omitted apiVersion and kind default to the endpoint's type (the official client sends none).
        if errors or body.get("apiVersion", "policy/v1") != "policy/v1" or body.get("kind", "Eviction") != "Eviction":
            raise ApiError(400, "BadRequest", "; ".join(errors) or f"expected apiVersion policy/v1 kind Eviction, got "
                                                                  f"{body.get('apiVersion')!r} {body.get('kind')!r}")
        if (body.get("metadata") or {}).get("name") != name:
            raise ApiError(400, "BadRequest", "name in URL does not match name in Eviction object")
        grace = (body.get("deleteOptions") or {}).get("gracePeriodSeconds")
        with standin.lock:
            pod = standin.pods.get((namespace, name))
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
            if pod.kill_sent is None and pod.obj["status"]["phase"] in ("Pending", "Running"):
                standin.disrupt(namespace, name, "EvictionByEvictionAPI", grace_s=grace)
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}


def _secret_object(body: dict, namespace: str) -> tuple[dict, list[str]]:
    """The Secret the API would store for ``body`` (``stringData`` base64-encoded into ``data``,
    ``type`` Opaque by default) and the validation errors of its name, keys and values."""
    obj = copy.deepcopy(body)
    meta = obj.setdefault("metadata", {})
    meta.setdefault("namespace", namespace)
    errors = []
    name = meta.get("name") or ""
    if not name:
        errors.append("metadata.name: Required value: name or generateName is required")
    elif len(name) > 253 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name):
        errors.append(f"metadata.name: Invalid value: {json.dumps(name)}: a lowercase RFC 1123 subdomain must "
                      "consist of lower case alphanumeric characters, '-' or '.'")
    if meta.get("namespace") != namespace:
        errors.append("metadata.namespace: Invalid value: does not match the namespace of the request")
    data = dict(obj.get("data") or {})
    for key, value in (obj.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    for key, value in data.items():
        if not _SECRET_KEY.match(key):
            errors.append(f"data[{key}]: Invalid value: {json.dumps(key)}: a valid config key must consist of "
                          "alphanumeric characters, '-', '_' or '.'")
        try:
            base64.b64decode(value, validate=True)
        except (ValueError, TypeError):
            errors.append(f"data[{key}]: Invalid value: illegal base64 data")
    obj["data"] = data
    obj.setdefault("type", "Opaque")
    obj["apiVersion"], obj["kind"] = "v1", "Secret"
    return obj, errors


def _not_allowed(method: str) -> ApiError:
    return ApiError(405, "MethodNotAllowed", f"the server does not allow this method on the requested resource ({method})")


def _selector(query: dict) -> Callable[[dict], bool]:
    try:
        return parse_selector((query.get("labelSelector") or [""])[-1])
    except SelectorError as exc:
        raise ApiError(400, "BadRequest", f"unable to parse requirement: {exc}") from None


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    if not isinstance(target, dict):
        target = {}
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = _merge(target.get(key), value)
    return target


def _drop_fields(body: dict, paths: list[str]) -> dict:
    """``body`` without the unknown fields (fieldValidation Warn/Ignore drops them)."""
    body = copy.deepcopy(body)
    for path in paths:
        parts = re.split(r"\.(?![^\[]*\])", path)
        node = body
        for part in parts[:-1]:
            m = re.match(r"^([^\[]+)((?:\[[^\]]+\])*)$", part)
            node = node.get(m.group(1)) if isinstance(node, dict) else None
            for idx in re.findall(r"\[([^\]]+)\]", m.group(2) or ""):
                node = node[int(idx)] if isinstance(node, list) else (node or {}).get(idx)
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    return body


@contextlib.contextmanager
def kube_standin_server(directory: Path, **kwargs) -> Iterator[KubeStandin]:
    """Start a :class:`KubeStandin` with its files under ``directory``; stop it, and every process it
    started, at the end, even when the body raised."""
    from fixture_report import count_start

    server = KubeStandin(directory, **kwargs)
    server.start()
    count_start("kubernetes stand-in")
    try:
        yield server
    finally:
        server.stop()

