"""Kubernetes' own syntax rules for the values a Kubernetes backend's settings and jobs carry.

Each check returns the problem in words ("" when the value is fine) or raises
:class:`~cloud_adapters.base.InvalidSpec`, so ``clean_config`` can collect every problem at once.
The rules are the API server's (k8s.io/apimachinery ``pkg/util/validation/validation.go``:
``IsDNS1123Label``, ``IsDNS1123Subdomain``, ``IsQualifiedName``, ``IsValidLabelValue``,
``IsEnvVarName``; ``pkg/api/resource/quantity.go`` for quantities; k8s.io/api ``core/v1``
``Toleration`` for tolerations), checked here so a user reads them at once rather than in a 422
when the job starts. This module imports no SDK.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from cloud_adapters.base import InvalidSpec

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # ≤ 63: namespaces, ...
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # ≤ 63: a TrainJob's metadata.name (its CRD's rule)
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # ≤ 253
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")  # ≤ 63, the part after a prefix/
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")  # ≤ 63, may be empty
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")  # IsEnvVarName (the API's long-standing rule)
QUANTITY = re.compile(
    r"\+?(\d+(\.\d*)?|\.\d+)"  # a non-negative decimal number
    r"(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?"  # binary SI, decimal SI, or a decimal exponent
)
TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
MAX_TOLERATIONS = 128  # the TrainJob API's runtimePatches ... tolerations MaxItems
MAX_NODE_SELECTOR = 64  # not an API limit: a form's sanity bound


def _shown(value: Any) -> str:
    return repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."


def dns_label(value: str) -> bool:
    """Whether ``value`` is an RFC 1123 DNS label (a namespace): lowercase letters, digits, '-', ≤ 63."""
    return len(value) <= 63 and bool(DNS1123_LABEL.fullmatch(value))


def dns_subdomain(value: str) -> bool:
    """Whether ``value`` is an RFC 1123 DNS subdomain (a runtime or service account name), ≤ 253."""
    return len(value) <= 253 and bool(DNS1123_SUBDOMAIN.fullmatch(value))


def label_key_problem(key: Any) -> str:
    """Why ``key`` is not a label key (``[prefix/]name``: a DNS subdomain prefix, a qualified name of at
    most 63 characters); "" when it is one."""
    if not isinstance(key, str) or not key:
        return f"{_shown(key)} is not a label key"
    prefix, _, name = key.rpartition("/")
    if "/" in key and not (prefix and dns_subdomain(prefix)):
        return f"{_shown(key)}: the prefix before '/' must be a DNS subdomain such as example.com"
    if len(name) > 63 or not QUALIFIED_NAME.fullmatch(name):
        return (f"{_shown(key)}: a label name is at most 63 letters, digits, '-', '_' or '.', starting and "
                f"ending with a letter or digit")
    return ""


def label_value_problem(value: Any) -> str:
    """Why ``value`` is not a label value (at most 63 letters, digits, '-', '_', '.', starting and
    ending with a letter or digit; may be empty); "" when it is one."""
    if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.fullmatch(value):
        return (f"{_shown(value)} is not a label value (at most 63 letters, digits, '-', '_' or '.', starting "
                f"and ending with a letter or digit)")
    return ""


def quantity(key: str, value: Any) -> str:
    """``value`` as a Kubernetes resource quantity ("500m", "2", "16Gi", "1.5"), stripped; "" stays "".

    Raises :class:`InvalidSpec` ``"<key>: …"`` for anything else, zero and negative amounts included
    (a request of nothing is a mistake)."""
    if value is None or value == "":
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise InvalidSpec(f"{key}: expected a Kubernetes quantity such as 500m, 2 or 16Gi, got {_shown(value)}.")
    text = value.strip()
    match = QUANTITY.fullmatch(text)
    if not match:
        raise InvalidSpec(f"{key}: {_shown(text)} is not a Kubernetes quantity; write a number with an optional "
                          f"suffix: m (milli), k, M, G, T or Ki, Mi, Gi, Ti (e.g. 500m, 2, 16Gi).")
    if float(match.group(1)) == 0:
        raise InvalidSpec(f"{key}: {_shown(text)} requests nothing; leave it blank for no request.")
    return text


def node_selector(key: str, value: Any) -> dict[str, str]:
    """A node selector from ``{label key: value}`` or text ``"key=value, key2=value2"``; {} for blank.

    Raises :class:`InvalidSpec` naming every bad entry."""
    if value is None or value == "":
        return {}
    pairs: list[tuple[Any, Any]] = []
    if isinstance(value, str):
        for item in re.split(r"[\s,]+", value.strip()):
            if item:
                name, sep, val = item.partition("=")
                if not sep:
                    raise InvalidSpec(f"{key}: {_shown(item)} is not key=value (e.g. cloud.google.com/gke-nodepool=gpu).")
                pairs.append((name, val))
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        raise InvalidSpec(f"{key}: expected an object of label key → value (or key=value text), got {_shown(value)}.")
    if len(pairs) > MAX_NODE_SELECTOR:
        raise InvalidSpec(f"{key}: {len(pairs)} labels; at most {MAX_NODE_SELECTOR}.")
    problems = [p for k, v in pairs for p in (label_key_problem(k), label_value_problem(v)) if p]
    if problems:
        raise InvalidSpec(f"{key}: " + "; ".join(problems[:5]) + ".")
    return {str(k): str(v) for k, v in pairs}


def tolerations(key: str, value: Any) -> list[dict[str, Any]]:
    """Tolerations (a list of ``{key, operator, value, effect, tolerationSeconds}`` objects, as in a
    pod spec) checked field by field; [] for blank. Raises :class:`InvalidSpec` naming each problem."""
    if value is None or value == "" or value == []:
        return []
    if not isinstance(value, list):
        raise InvalidSpec(f"{key}: expected a list of objects such as "
                          f"[{{\"key\": \"nvidia.com/gpu\", \"operator\": \"Exists\", \"effect\": \"NoSchedule\"}}], "
                          f"got {_shown(value)}.")
    if len(value) > MAX_TOLERATIONS:
        raise InvalidSpec(f"{key}: {len(value)} tolerations; the TrainJob API takes at most {MAX_TOLERATIONS}.")
    problems: list[str] = []
    out: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"toleration {index + 1}"
        if not isinstance(item, Mapping):
            problems.append(f"{where}: expected an object, got {_shown(item)}")
            continue
        unknown = sorted(str(k) for k in item if k not in TOLERATION_KEYS)
        if unknown:
            problems.append(f"{where}: unknown field(s) {', '.join(unknown)} (known: key, operator, value, effect, "
                            f"tolerationSeconds)")
            continue
        operator = item.get("operator", "Equal")
        tkey, tvalue, effect = item.get("key", ""), item.get("value", ""), item.get("effect", "")
        seconds = item.get("tolerationSeconds")
        if operator not in TOLERATION_OPERATORS:
            problems.append(f"{where}: operator must be Exists or Equal, got {_shown(operator)}")
        if tkey != "" and (problem := label_key_problem(tkey)):
            problems.append(f"{where}: key {problem}")
        if tkey == "" and operator != "Exists":
            problems.append(f"{where}: a toleration without a key must have operator Exists")
        if operator == "Exists" and tvalue not in ("", None):
            problems.append(f"{where}: operator Exists takes no value")
        elif tvalue not in ("", None) and (problem := label_value_problem(tvalue)):
            problems.append(f"{where}: value {problem}")
        if effect not in ("", None) and effect not in TAINT_EFFECTS:
            problems.append(f"{where}: effect must be NoSchedule, PreferNoSchedule or NoExecute, got {_shown(effect)}")
        if seconds is not None:
            if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
                problems.append(f"{where}: tolerationSeconds must be a whole number ≥ 0, got {_shown(seconds)}")
            elif effect != "NoExecute":
                problems.append(f"{where}: tolerationSeconds applies to effect NoExecute only")
        out.append({k: item[k] for k in ("key", "operator", "value", "effect", "tolerationSeconds")
                    if k in item and item[k] not in ("", None)})
    if problems:
        raise InvalidSpec(f"{key}: " + "; ".join(problems[:5]) + ".")
    return out
