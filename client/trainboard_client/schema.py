"""The job options, read from the server's OpenAPI schema: the request body of ``POST /api/jobs/``.

The client declares none of them itself: a field the server adds to its job request appears as an
option of ``trainboard run`` and ``trainboard estimate`` (and a task file's key) with the server's
help text, type, choices, bounds and default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

JOB_CREATE_PATH = "/api/jobs/"


@dataclass(frozen=True)
class JobField:
    """One field of the job request: ``name`` as the API spells it (``procs_per_node``)."""

    name: str
    kind: str  # "integer", "number", "boolean", "string", "id_or_name", "choice" or "json"
    help: str = ""
    required: bool = False
    default: Any = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def option(self) -> str:
        """The CLI's spelling: ``--procs-per-node``."""
        return "--" + self.name.replace("_", "-")

    def convert(self, raw: Any) -> Any:
        """A value from a task file or the command line as the API takes it; raises ValueError with a
        message naming the field."""
        if raw is None:
            return None
        if self.kind == "integer":
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(f"{self.name}: expected a whole number, got {raw!r}")
            try:
                return int(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{self.name}: expected a whole number, got {raw!r}") from None
        if self.kind == "number":
            try:
                return float(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{self.name}: expected a number, got {raw!r}") from None
        if self.kind == "boolean":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("true", "1", "yes", "on"):
                return True
            if text in ("false", "0", "no", "off"):
                return False
            raise ValueError(f"{self.name}: expected true or false, got {raw!r}")
        if self.kind == "id_or_name":  # an object's id (digits) or its name
            text = str(raw).strip()
            return int(text) if text.isascii() and text.isdigit() else raw
        if self.kind == "json":
            if isinstance(raw, str):
                try:
                    return json.loads(raw)
                except ValueError:
                    return raw  # the server reads text where it takes it (env's NAME=VALUE lines) or says why
            return raw
        return raw if isinstance(raw, str) else str(raw) if self.kind == "string" else raw


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    seen = 0
    while isinstance(node, dict) and "$ref" in node and seen < 20:
        ref = node["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"the schema refers outside itself ({ref})")
        target: Any = schema
        for part in ref[2:].split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        seen += 1
    if isinstance(node, dict) and "allOf" in node and len(node["allOf"]) == 1:
        inner = _resolve(schema, node["allOf"][0])
        node = {**inner, **{k: v for k, v in node.items() if k != "allOf"}}
    return node


def job_create_body(schema: dict[str, Any], path: str = JOB_CREATE_PATH) -> dict[str, Any]:
    """The resolved JSON schema of ``POST path``'s request body."""
    try:
        operation = schema["paths"][path]["post"]
        content = operation["requestBody"]["content"]
    except KeyError:
        raise ValueError(f"the server's schema has no request body for POST {path}") from None
    media = content.get("application/json") or next(iter(content.values()))
    return _resolve(schema, media["schema"])


def job_fields(schema: dict[str, Any], path: str = JOB_CREATE_PATH) -> list[JobField]:
    """The job request's writable fields, in the schema's order."""
    body = job_create_body(schema, path)
    required = set(body.get("required", ()))
    out: list[JobField] = []
    for name, prop in (body.get("properties") or {}).items():
        prop = _resolve(schema, prop)
        if prop.get("readOnly"):
            continue
        out.append(_field(schema, name, prop, name in required))
    return out


def _field(schema: dict[str, Any], name: str, prop: dict[str, Any], required: bool) -> JobField:
    nullable = bool(prop.get("nullable"))
    enum = prop.get("enum")
    if enum is None and "oneOf" in prop:  # drf-spectacular: a nullable choice is oneOf [enum, NullEnum]
        for option in prop["oneOf"]:
            option = _resolve(schema, option)
            if option.get("enum") and any(v is not None for v in option["enum"]):
                enum = option["enum"]
                prop = {**option, **{k: v for k, v in prop.items() if k != "oneOf"}}
            elif option.get("enum") == [None] or option.get("type") == "null":
                nullable = True
    typ = prop.get("type")
    alternatives = {_resolve(schema, o).get("type") for o in prop.get("oneOf") or ()}
    if enum:
        kind = "choice"
    elif alternatives == {"integer", "string"}:
        kind = "id_or_name"  # a dataset, model, backend or team: by id or by name
    elif typ in ("integer", "number", "boolean"):
        kind = typ
    elif typ == "string":
        kind = "string"
    else:
        kind = "json"  # an object, an array or anything JSON
    return JobField(
        name=name, kind=kind, help=" ".join(str(prop.get("description") or "").split()), required=required,
        default=prop.get("default"), choices=tuple(str(v) for v in (enum or ()) if v not in (None, "")),
        minimum=prop.get("minimum"), maximum=prop.get("maximum"), nullable=nullable,
    )
