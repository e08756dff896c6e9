"""A small in-memory Vertex AI + Cloud Logging, served over plain HTTP on 127.0.0.1 for the real
``aiplatform_v1.JobServiceClient`` on its REST transport (clouds.md §2.4: ``api_endpoint=http://…``).

Routes (what the REST transport and the adapter's Cloud Logging reader send, clouds.md §2.4):

* ``POST /v1/projects/P/locations/L/customJobs``          create: the body (proto3 JSON, camelCase,
  enums as numbers) is stored verbatim in :attr:`VertexStandIn.created`; the job gets an id, state
  QUEUED and ``createTime``/``updateTime`` = :attr:`VertexStandIn.now`.
* ``GET  /v1/projects/P/locations/L/customJobs?filter=…`` list, with the filter terms the service
  documents for ListCustomJobs (``labels.k="v"``, ``labels.k:*``, ``display_name="…"``,
  ``state="…"``, ``create_time>=…``; AND only) and ``pageSize``/``pageToken``; any other term is
  answered 400 INVALID_ARGUMENT, like the service.
* ``GET  /v1/<job name>``, ``POST /v1/<job name>:cancel`` (a terminal job: 400 FAILED_PRECONDITION;
  otherwise CANCELLING).
* ``POST /v2/entries:list``  Cloud Logging entries of a job (``resource.type``, ``resource.labels.job_id``,
  ``timestamp>=`` terms), ``timestamp asc`` then ``insertId``, paged.

* ``POST /token``  Google's OAuth 2.0 token endpoint for service accounts (RFC 7523 JWT bearer grant):
  a key file whose ``token_uri`` points here gets ``ya29.standin-…`` access tokens.

Credentials: after :meth:`accept_key` (a service account's email and public key) every API request
must prove that account, as Google checks: ``Authorization: Bearer`` with an access token this
stand-in issued for a JWT assertion signed by the key, or a self-signed JWT (what the Vertex client
sends, ``always_use_jwt_access``) signed by it; anything else is answered 401 UNAUTHENTICATED. Each
request records its headers and the proved account (:attr:`Request.identity`).

Tests script a job's life with :meth:`script` + :meth:`step`, inject failures with :meth:`fail`, and
read every request from :attr:`requests`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import http.server
import json
import re
import threading
import urllib.parse
import uuid
from typing import Any, Callable, Mapping

from requests.structures import CaseInsensitiveDict

TERMINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED",
            "JOB_STATE_PARTIALLY_SUCCEEDED"}
GOOGLE_TOKEN_ENDPOINT = "https://oauth2.googleapis.com/token"
STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                409: "ABORTED", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}


@dataclasses.dataclass
class Request:
    method: str
    path: str  # without the query
    query: dict[str, str]
    body: Any  # parsed JSON (a form body: its fields), or None
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)  # as sent; any case finds a name
    identity: str | None = None  # the service account the Authorization header proved (see accept_key)


@dataclasses.dataclass
class Fault:
    status: int
    method: str | None = None  # None = any
    path_re: str = ""  # matched against the path
    times: int = 1
    message: str = "injected failure"
    after: bool = False  # do the work first, then answer the error (an ambiguous failure)
    echo: bool = False  # append the request's Authorization header to the message (a careless provider)


def ts_key(value: str) -> tuple:
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z", value)
    assert m, value
    return (dt.datetime.fromisoformat(m.group(1)), int((m.group(2) or "0").ljust(9, "0")))


class ApiError(Exception):
    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


class VertexStandIn:
    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.created: list[dict[str, Any]] = []  # create bodies as sent
        self.requests: list[Request] = []
        self.entries: list[dict[str, Any]] = []
        self.faults: list[Fault] = []
        self.scripts: dict[str, list[dict[str, Any]]] = {}
        self.now = "2026-01-01T00:00:00Z"
        self.on_create: Callable[[dict[str, Any]], None] | None = None  # runs before a create is stored
        self.keys: dict[str, str] = {}  # service-account email -> its public key (PEM); see accept_key
        self.tokens: dict[str, str] = {}  # access token issued by /token -> service-account email
        self._next_id = 1000000001
        self._lock = threading.RLock()
        self._server: http.server.ThreadingHTTPServer | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> "VertexStandIn":
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                standin._handle(self, "GET")

            def do_POST(self) -> None:
                standin._handle(self, "POST")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- what tests use ----------------------------------------------------------------------------

    def script(self, name: str, steps: list[dict[str, Any]]) -> None:
        """Fields merged into job ``name`` at each :meth:`step` (one dict per step)."""
        self.scripts[name] = list(steps)

    def step(self) -> None:
        """Advance every scripted job by one step."""
        with self._lock:
            for name, steps in self.scripts.items():
                if steps:
                    fields = steps.pop(0)
                    self.jobs[name].update(fields)
                    self.jobs[name]["updateTime"] = fields.get("updateTime", self.now)

    def fail(self, status: int, *, method: str | None = None, path_re: str = "", times: int = 1,
             message: str = "injected failure", after: bool = False, echo: bool = False) -> None:
        """Answer the next ``times`` matching requests with ``status`` and ``message`` (``echo``: plus
        the credentials the request carried, as a provider that quotes its request would)."""
        self.faults.append(Fault(status, method, path_re, times, message, after, echo))

    def add_entry(self, job_id: str, timestamp: str, insert_id: str, *, text: str | None = None,
                  payload: dict[str, Any] | None = None, task: str = "workerpool0-0") -> None:
        entry: dict[str, Any] = {
            "logName": "projects/my-proj/logs/workerpool0-0", "timestamp": timestamp, "insertId": insert_id,
            "resource": {"type": "ml_job", "labels": {"job_id": job_id, "task_name": task, "project_id": "my-proj"}},
            "labels": {"ml.googleapis.com/task_name": task}, "severity": "INFO",
        }
        if payload is not None:
            entry["jsonPayload"] = payload
        else:
            entry["textPayload"] = text
        self.entries.append(entry)

    def accept_key(self, email: str, public_key_pem: str) -> None:
        """From now on, API requests must carry credentials of ``email``, signed by this key."""
        self.keys[email] = public_key_pem

    def _verified_jwt(self, token: str, audience: str | None = None) -> dict[str, Any] | None:
        """The claims of ``token`` when one of the accepted keys signed it (its ``iss`` that key's
        account, not expired, for ``audience`` when given); else None."""
        from google.auth import jwt

        try:
            unverified = jwt.decode(token, verify=False)
        except ValueError:
            return None
        public = self.keys.get(str(unverified.get("iss")))
        if public is None:
            return None
        try:
            return jwt.decode(token, certs=public, verify=True, audience=audience)
        except ValueError:
            return None

    def _identity(self, authorization: str) -> str | None:
        if not authorization.startswith("Bearer "):
            return None
        token = authorization[len("Bearer "):]
        if token in self.tokens:
            return self.tokens[token]
        claims = self._verified_jwt(token)  # a self-signed JWT: for the cloud-platform scope
        if claims and "https://www.googleapis.com/auth/cloud-platform" in str(claims.get("scope", "")).split():
            return str(claims["iss"])
        return None

    def _token(self, form: dict[str, str]) -> dict[str, Any]:
        if form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer":
            raise ApiError(400, f"unsupported grant_type {form.get('grant_type')!r}", "unsupported_grant_type")
        # google-auth addresses the assertion to Google's token endpoint whatever the key's token_uri.
        claims = self._verified_jwt(form.get("assertion", ""), audience=GOOGLE_TOKEN_ENDPOINT)
        if claims is None:
            raise ApiError(400, "Invalid JWT Signature.", "invalid_grant")
        token = f"ya29.standin-{len(self.tokens) + 1}-{claims['iss'].split('@')[0]}"
        self.tokens[token] = str(claims["iss"])
        return {"access_token": token, "expires_in": 3599, "token_type": "Bearer"}

    def calls(self, method: str, pattern: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and re.search(pattern, r.path)]

    # -- serving -----------------------------------------------------------------------------------

    def _handle(self, handler: http.server.BaseHTTPRequestHandler, method: str) -> None:
        parsed = urllib.parse.urlsplit(handler.path)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(parsed.query).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        if "application/x-www-form-urlencoded" in (handler.headers.get("Content-Type") or ""):
            body: Any = dict(urllib.parse.parse_qsl(raw.decode()))
        else:
            body = json.loads(raw) if raw else None
        path = urllib.parse.unquote(parsed.path)
        headers = CaseInsensitiveDict(handler.headers.items())  # google-auth sends "authorization"
        with self._lock:
            identity = self._identity(headers.get("Authorization", ""))
            self.requests.append(Request(method, path, query, body, headers, identity))
            if method == "POST" and path == "/token":
                try:
                    status, reply = 200, self._token(body or {})
                except ApiError as exc:  # OAuth's error shape, not Google's API one
                    status, reply = exc.status, {"error": exc.reason, "error_description": exc.message}
                self._reply(handler, status, reply)
                return
            fault = next((f for f in self.faults if f.times > 0 and (f.method in (None, method))
                          and re.search(f.path_re, path)), None)
            if fault is not None:
                fault.times -= 1
            try:
                if self.keys and identity is None:
                    raise ApiError(401, "Request had invalid authentication credentials. Expected OAuth 2 "
                                        "access token, login cookie or other valid authentication credential.")
                message = fault and (fault.message + (f" (request credentials: {headers.get('Authorization')})"
                                                      if fault.echo else ""))
                if fault is not None and not fault.after:
                    raise ApiError(fault.status, message)
                status, reply = 200, self._route(method, path, query, body)
                if fault is not None:
                    raise ApiError(fault.status, message)
            except ApiError as exc:
                status = exc.status
                reply = {"error": {"code": exc.status, "message": exc.message,
                                   "status": exc.reason or STATUS_NAMES.get(exc.status, "UNKNOWN")}}
        self._reply(handler, status, reply)

    @staticmethod
    def _reply(handler: http.server.BaseHTTPRequestHandler, status: int, reply: Any) -> None:
        data = json.dumps(reply).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> Any:
        if method == "POST" and path == "/v2/entries:list":
            return self._entries(body or {})
        m = re.fullmatch(r"/v1/(projects/[^/]+/locations/[^/]+)/customJobs", path)
        if m and method == "POST":
            return self._create(m.group(1), body or {})
        if m and method == "GET":
            return self._list(m.group(1), query)
        m = re.fullmatch(r"/v1/(projects/[^/]+/locations/[^/]+/customJobs/\d+)(:cancel)?", path)
        if m:
            job = self.jobs.get(m.group(1))
            if job is None:
                raise ApiError(404, f"CustomJob {m.group(1)} is not found.")
            if m.group(2) and method == "POST":
                if job["state"] in TERMINAL:
                    raise ApiError(400, f"Cannot cancel a job in state {job['state']}.", "FAILED_PRECONDITION")
                job.update(state="JOB_STATE_CANCELLING", updateTime=self.now)
                return {}
            if method == "GET":
                return job
        raise ApiError(404, f"no route {method} {path}")

    def _create(self, parent: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.on_create is not None:
            self.on_create(body)
        self.created.append(json.loads(json.dumps(body)))
        return self.insert(parent, body)

    def insert(self, parent: str, body: dict[str, Any], create_time: str | None = None) -> dict[str, Any]:
        """Store a job as the service would after a create; returns it."""
        with self._lock:
            name = f"{parent}/customJobs/{self._next_id}"
            self._next_id += 1
            job = dict(json.loads(json.dumps(body)), name=name, state="JOB_STATE_QUEUED",
                       createTime=create_time or self.now, updateTime=create_time or self.now)
            self.jobs[name] = job
            return job

    def _matches(self, job: dict[str, Any], term: str) -> bool:
        labels = job.get("labels") or {}
        if m := re.fullmatch(r'labels\.([a-z0-9_-]+)="([^"]*)"', term):
            return labels.get(m.group(1)) == m.group(2)
        if m := re.fullmatch(r"labels\.([a-z0-9_-]+):\*", term):
            return m.group(1) in labels
        if m := re.fullmatch(r'display_name="([^"]*)"', term):
            return job.get("displayName") == m.group(1)
        if m := re.fullmatch(r'state="([A-Z_]+)"', term):
            return job.get("state") == m.group(1)
        if m := re.fullmatch(r'create_time(>=|>|<=|<|=)"([^"]+)"', term):
            a, b = ts_key(job["createTime"]), ts_key(m.group(2))
            return {">=": a >= b, ">": a > b, "<=": a <= b, "<": a < b, "=": a == b}[m.group(1)]
        raise ApiError(400, f"Unsupported filter term: {term}")

    def _list(self, parent: str, query: dict[str, str]) -> dict[str, Any]:
        terms = [t.strip() for t in query.get("filter", "").split(" AND ") if t.strip()]
        found = [j for n, j in self.jobs.items() if n.startswith(parent + "/")
                 and all(self._matches(j, t) for t in terms)]
        found.sort(key=lambda j: (ts_key(j["createTime"]), j["name"]))
        return self._page(found, query.get("pageSize"), query.get("pageToken"), "customJobs")

    @staticmethod
    def _page(items: list[Any], size: Any, token: Any, key: str) -> dict[str, Any]:
        start = int(token or 0)
        size = int(size or 100)
        reply: dict[str, Any] = {key: items[start:start + size]}
        if start + size < len(items):
            reply["nextPageToken"] = str(start + size)
        return reply

    def _entries(self, body: dict[str, Any]) -> dict[str, Any]:
        terms = [t.strip() for t in body.get("filter", "").split(" AND ") if t.strip()]
        found = list(self.entries)
        for term in terms:
            if m := re.fullmatch(r'resource\.type="([^"]+)"', term):
                found = [e for e in found if e["resource"]["type"] == m.group(1)]
            elif m := re.fullmatch(r'resource\.labels\.job_id="([^"]+)"', term):
                found = [e for e in found if e["resource"]["labels"]["job_id"] == m.group(1)]
            elif m := re.fullmatch(r'timestamp>="([^"]+)"', term):
                found = [e for e in found if ts_key(e["timestamp"]) >= ts_key(m.group(1))]
            else:
                raise ApiError(400, f"Unsupported filter term: {term}")
        assert body.get("orderBy") == "timestamp asc", body
        found.sort(key=lambda e: (ts_key(e["timestamp"]), e["insertId"]))
        return self._page(found, body.get("pageSize"), body.get("pageToken"), "entries")


def service_account_key(email: str, token_uri: str) -> tuple[str, str]:
    """``(key file JSON, public key PEM)`` of a new RSA service-account key of ``email`` whose tokens
    come from ``token_uri`` (``<stand-in url>/token``); give the public key to :meth:`VertexStandIn.accept_key`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    info = {"type": "service_account", "project_id": "my-proj", "private_key_id": uuid.uuid4().hex,
            "private_key": private, "client_email": email, "client_id": "1", "token_uri": token_uri}
    return json.dumps(info), public
