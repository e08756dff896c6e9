"""An in-memory Azure ML workspace behind a custom azure-core transport (clouds.md §3.5), for tests.

The real ``MLClient`` (and the adapter's log reader) send their HTTP requests to
:class:`StandinTransport`, which answers from :class:`AzureMLStandin` without any network: ARM
(workspace, compute, jobs get/PUT/list/cancel, code versions, startPendingUpload, environment
versions), the workspace's
discovery document and run history (run details with log-file URLs and errors), and the log files
themselves (with HTTP ``Range``). Only the code snapshot's bytes leave the process: the SAS URL that
``startPendingUpload`` returns points at a real Blob service (Azurite on 127.0.0.1, see
:class:`BlobAccount`), so azure-ai-ml's own upload code runs against a real blob API.

Reuse (an integration test)::

    standin = AzureMLStandin(blob=BlobAccount(url, name, key))
    backend = AzureMLBackend(settings, credential=FakeCredential(), transport=StandinTransport(standin))
    standin.set_status("tb-job-1", "Running", StartTimeUtc="2026-11-29T12:03:00Z")

Credentials: after :meth:`AzureMLStandin.register_app` (a service principal's tenant, client id and
secret) the stand-in is also Microsoft Entra ID (``https://login.microsoftonline.com``: the tenant's
OpenID configuration and its v2.0 token endpoint, client-credentials grant, as MSAL calls them) and
every ARM and run-history request must carry ``Authorization: Bearer`` with a token it issued, else
401 ``InvalidAuthenticationToken``. ``Seen.app`` records whose token a request carried.

What it records: ``requests`` (every request: :class:`Seen`), ``puts`` (job name → PUT body as
sent), ``jobs`` (the stored job resources), ``environments`` ((name, version) → the stored
environment version, e.g. the anonymous one azure-ai-ml creates for an image plus a conda file). Faults: :meth:`AzureMLStandin.fail` answers the next
matching requests with an error status (429 for throttling).

Response objects follow clouds.md §3.5: ``RestRequestsTransportResponse`` around a
``requests.Response`` whose ``raw`` is a ``urllib3.HTTPResponse``; the legacy transport response
type fails in MLClient.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
import random
import re
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable

import requests
import urllib3
from azure.core.credentials import AccessToken, AccessTokenInfo
from azure.core.pipeline.transport import HttpTransport
from azure.core.rest._requests_basic import RestRequestsTransportResponse
from fake_clock import FakeClock

SUBSCRIPTION = "00000000-0000-0000-0000-0000000000aa"
RESOURCE_GROUP = "rg-trainboard"
WORKSPACE = "ws-trainboard"
COMPUTE = "gpu-cluster"
ARM = "https://management.azure.com"
API = "https://eastus.api.azureml.ms"
LOGIN = "https://login.microsoftonline.com"
LOGS = "https://wsstorage.blob.core.windows.net/azureml/ExperimentRun"
T0 = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account and key (public, the same in every Azurite)."""


def iso(when: dt.datetime) -> str:
    return when.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


class FakeCredential:
    """A credential that needs no Azure AD: ``get_token``/``get_token_info`` as azure-core calls them."""

    def __init__(self) -> None:
        self.scopes: list[tuple[str, ...]] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.scopes.append(scopes)
        return AccessToken("fake-token", int(time.time()) + 3600)

    def get_token_info(self, *scopes: str, options: Any = None) -> AccessTokenInfo:
        self.scopes.append(scopes)
        return AccessTokenInfo("fake-token", int(time.time()) + 3600)


@dataclasses.dataclass(frozen=True)
class BlobAccount:
    """A real Blob service the code upload goes to (Azurite: ``url`` = ``http://127.0.0.1:PORT/devstoreaccount1``)."""

    url: str
    name: str = AZURITE_ACCOUNT
    key: str = AZURITE_KEY

    @property
    def connection_string(self) -> str:
        """The account as ``AZURE_STORAGE_CONNECTION_STRING`` gives it to the SDK."""
        return f"DefaultEndpointsProtocol=http;AccountName={self.name};AccountKey={self.key};BlobEndpoint={self.url};"

    def service(self):
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient(account_url=self.url, credential={"account_name": self.name, "account_key": self.key})

    def container_sas_url(self, container: str) -> str:
        """``<url>/<container>?<SAS>`` with read/write/list rights for an hour (creates the container)."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import ContainerSasPermissions, generate_container_sas

        try:
            self.service().create_container(container)
        except ResourceExistsError:
            pass
        sas = generate_container_sas(self.name, container, account_key=self.key,
                                     permission=ContainerSasPermissions(read=True, write=True, list=True, add=True,
                                                                        create=True),
                                     expiry=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1))
        return f"{self.url}/{container}?{sas}"


@dataclasses.dataclass
class Seen:
    """One request the stand-in answered."""

    method: str
    url: str
    path: str  # without the query
    query: dict[str, str]
    body: Any  # parsed JSON, or bytes/None
    headers: dict[str, str]
    status: int = 0  # what the stand-in answered
    app: tuple[str, str] | None = None  # (tenant, client id) whose issued token the request carried


@dataclasses.dataclass
class Fault:
    method: str
    pattern: re.Pattern[str]
    status: int
    times: int
    code: str = ""


def response(request: Any, status: int, body: Any = None, headers: dict[str, str] | None = None,
             raw: bytes | None = None, content_type: str = "application/json") -> RestRequestsTransportResponse:
    """An azure.core.rest response for ``request`` (the type MLClient needs, clouds.md §3.5)."""
    content = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
    r = requests.Response()
    r.status_code = status
    r.raw = urllib3.response.HTTPResponse(body=io.BytesIO(content), preload_content=False, status=status)
    r.headers.update({"Content-Type": content_type, "Content-Length": str(len(content)), **(headers or {})})
    r.url = request.url
    r.reason = "OK" if status < 300 else "Error"
    out = RestRequestsTransportResponse(request=request, internal_response=r)
    out.read()
    return out


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


class AzureMLStandin:
    """The workspace's state and the routes that read and change it (see the module docstring)."""

    def __init__(self, *, subscription: str = SUBSCRIPTION, resource_group: str = RESOURCE_GROUP,
                 workspace: str = WORKSPACE, compute: str = COMPUTE, vm_size: str = "Standard_NC6s_v3",
                 arm: str = ARM, blob: BlobAccount | None = None, list_page_size: int = 50) -> None:
        self.subscription, self.resource_group, self.workspace = subscription, resource_group, workspace
        self.arm = arm.rstrip("/")
        self.scope = (f"/subscriptions/{subscription}/resourceGroups/{resource_group}/providers/"
                      f"Microsoft.MachineLearningServices/workspaces/{workspace}")
        self.computes = {compute: vm_size}
        self.blob = blob
        self.list_page_size = list_page_size
        self.jobs: dict[str, dict[str, Any]] = {}
        self.puts: dict[str, list[dict[str, Any]]] = {}
        self.codes: dict[tuple[str, str], dict[str, Any]] = {}
        self.environments: dict[tuple[str, str], dict[str, Any]] = {}  # (name, version) -> stored version
        self.datastores: dict[str, str] = {"workspaceblobstore": "azureml-blobstore"}  # name -> Blob container
        self.log_files: dict[str, dict[str, bytes]] = {}  # job -> {user_logs/...: bytes}
        self.run_errors: dict[str, dict[str, str]] = {}  # job -> {"code", "message"}
        self.requests: list[Seen] = []
        self.faults: list[Fault] = []
        self.now = T0
        self.apps: dict[tuple[str, str], str] = {}  # (tenant, client id) -> client secret; see register_app
        self.tokens: dict[str, tuple[str, str]] = {}  # access token issued -> (tenant, client id)
        self._lock = threading.Lock()

    # -- what tests set ---------------------------------------------------------------------

    def register_app(self, tenant: str, client_id: str, client_secret: str) -> None:
        """A service principal Entra ID knows; from now on ARM and run history want its tokens."""
        self.apps[(tenant, client_id)] = client_secret

    def fail(self, method: str, path_regex: str, status: int = 429, times: int = 1, code: str = "") -> None:
        """Answer the next ``times`` requests whose method and path match with ``status``."""
        self.faults.append(Fault(method, re.compile(path_regex), status, times, code))

    def set_status(self, name: str, status: str, *, at: dt.datetime | None = None, **properties: str) -> None:
        """Move job ``name`` to ``status`` at ``at`` (default: the stand-in's clock), adding run
        ``properties`` (``StartTimeUtc=...``)."""
        job = self.jobs[name]
        job["properties"]["status"] = status
        job["properties"].setdefault("properties", {}).update(properties)
        job["systemData"]["lastModifiedAt"] = iso(at or self.now)

    def add_job(self, name: str, status: str = "Running", *, tags: dict[str, str] | None = None,
                instance_count: int = 1, **properties: str) -> dict[str, Any]:
        """A job that exists already (created by someone else, or by an earlier attempt)."""
        body = {"properties": {
            "jobType": "Command", "command": "python -m trainer_pkg.launch --config trainboard_job.json",
            "computeId": f"{self.scope}/computes/{next(iter(self.computes))}",
            "environmentId": "azureml://registries/azureml/environments/acpt-pytorch-2.2-cuda12.1/labels/latest",
            "distribution": {"distributionType": "PyTorch", "processCountPerInstance": 1},
            "resources": {"instanceCount": instance_count}, "tags": dict(tags or {}),
            "properties": dict(properties), "experimentName": "trainboard"}}
        return self._store(name, body, status)

    def write_log(self, name: str, file: str, text: str) -> None:
        """Append ``text`` to the job's log file ``file`` (``user_logs/std_log_process_0.txt``)."""
        files = self.log_files.setdefault(name, {})
        files[file] = files.get(file, b"") + text.encode()

    def response_for(self, request: Any, status: int, code: str = "") -> RestRequestsTransportResponse:
        """An error answer with Azure's ``{"error": {"code", "message"}}`` body (for tests that
        replace a route's answer)."""
        return response(request, status, error_body(code or f"Http{status}", f"stand-in answered {status}"))

    def calls(self, method: str | None = None, path_regex: str = "") -> list[Seen]:
        """The recorded requests with that method whose path matches ``path_regex``."""
        pattern = re.compile(path_regex)
        return [s for s in self.requests if (method is None or s.method == method) and pattern.search(s.path)]

    # -- routing ----------------------------------------------------------------------------

    def handle(self, request: Any) -> RestRequestsTransportResponse:
        url = request.url
        parts = urllib.parse.urlsplit(url)
        path = urllib.parse.unquote(parts.path)
        query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
        raw = request.content if hasattr(request, "content") else request.body
        if isinstance(raw, str):
            raw = raw.encode()
        if isinstance(raw, dict):  # a form body (azure-identity's token requests): its fields
            body: Any = dict(raw)
        else:
            try:
                body = json.loads(raw) if raw else None
            except (ValueError, UnicodeDecodeError):
                body = raw
        seen = Seen(request.method, url, path, query, body, dict(request.headers))
        authorization = request.headers.get("Authorization") or ""
        with self._lock:
            seen.app = self.tokens.get(authorization.removeprefix("Bearer ")) if authorization.startswith(
                "Bearer ") else None
            self.requests.append(seen)
            origin = f"{parts.scheme}://{parts.netloc}"
            if origin == LOGIN:
                answer = self._login(request, path, body)
            elif self.apps and seen.app is None and (origin in (self.arm, API)):
                answer = response(request, 401, error_body(
                    "InvalidAuthenticationToken", "The access token is invalid."),
                    {"WWW-Authenticate": 'Bearer authorization_uri="https://login.microsoftonline.com/common", '
                                         'error="invalid_token"'})
            else:
                answer = self._fault(request, path) or self._route(request, parts, path, query, body)
        seen.status = answer.status_code
        return answer

    def _login(self, request: Any, path: str, body: Any) -> RestRequestsTransportResponse:
        """Entra ID: ``GET /<tenant>/v2.0/.well-known/openid-configuration``, ``POST
        /<tenant>/oauth2/v2.0/token`` (client_credentials, the secret in the form body) and the
        instance discovery MSAL does after an error."""
        m = re.fullmatch(r"/([^/]+)/v2\.0/\.well-known/openid-configuration", path)
        if m and request.method == "GET":
            tenant = m.group(1)
            return response(request, 200, {
                "token_endpoint": f"{LOGIN}/{tenant}/oauth2/v2.0/token",
                "authorization_endpoint": f"{LOGIN}/{tenant}/oauth2/v2.0/authorize",
                "issuer": f"{LOGIN}/{tenant}/v2.0", "device_authorization_endpoint":
                f"{LOGIN}/{tenant}/oauth2/v2.0/devicecode"})
        if path == "/common/discovery/instance" and request.method == "GET":  # MSAL asks after an error
            return response(request, 200, {
                "tenant_discovery_endpoint": f"{LOGIN}/common/v2.0/.well-known/openid-configuration",
                "api-version": "1.1", "metadata": [{
                    "preferred_network": "login.microsoftonline.com", "preferred_cache": "login.windows.net",
                    "aliases": ["login.microsoftonline.com", "login.windows.net", "login.microsoft.com"]}]})
        m = re.fullmatch(r"/([^/]+)/oauth2/v2\.0/token", path)
        if m and request.method == "POST":
            form = body if isinstance(body, dict) else dict(urllib.parse.parse_qsl(
                body.decode() if isinstance(body, bytes) else str(body or "")))
            app = (m.group(1), form.get("client_id", ""))
            if form.get("grant_type") != "client_credentials":
                return response(request, 400, {"error": "unsupported_grant_type"})
            if app not in self.apps or self.apps[app] != form.get("client_secret"):
                return response(request, 401, {"error": "invalid_client", "error_description":
                                               "AADSTS7000215: Invalid client secret provided."})
            token = f"eyJ.standin-{len(self.tokens) + 1}.{app[1]}"
            self.tokens[token] = app
            return response(request, 200, {"token_type": "Bearer", "expires_in": 3599, "ext_expires_in": 3599,
                                           "access_token": token})
        return response(request, 404, {"error": "not_found", "error_description": f"no route {path}"})

    def _fault(self, request: Any, path: str) -> RestRequestsTransportResponse | None:
        for fault in self.faults:
            if fault.times > 0 and fault.method == request.method and fault.pattern.search(path):
                fault.times -= 1
                code = fault.code or ("TooManyRequests" if fault.status == 429 else "InternalServerError")
                headers = {"Retry-After": "0"} if fault.status == 429 else {}
                return response(request, fault.status, error_body(code, f"injected {fault.status}"), headers)
        return None

    def _route(self, request: Any, parts: urllib.parse.SplitResult, path: str, query: dict[str, str],
               body: Any) -> RestRequestsTransportResponse:
        origin = f"{parts.scheme}://{parts.netloc}"
        method = request.method
        if origin == self.arm and path.startswith(self.scope):
            rest = path[len(self.scope):]
            return self._arm(request, method, rest, query, body)
        if url_startswith(request.url, API + "/discovery"):
            return response(request, 200, {"api": API, "catalog": API, "experimentation": API, "history": API,
                                           "modelmanagement": API, "pipelines": API, "studio": "https://ml.azure.com"})
        history = f"/history/v1.0{self.scope}/runs/"
        if origin == API and path.startswith(history) and path.endswith("/details"):
            return self._run_details(request, path[len(history):-len("/details")])
        if url_startswith(request.url, LOGS):
            return self._log_file(request, path)
        return response(request, 404, error_body("NotFound", f"stand-in has no route for {method} {path}"))

    def _arm(self, request: Any, method: str, rest: str, query: dict[str, str],
             body: Any) -> RestRequestsTransportResponse:
        if rest == "" and method == "GET":
            return response(request, 200, self._workspace())
        m = re.fullmatch(r"/computes/([^/]+)", rest)
        if m and method == "GET":
            if m.group(1) not in self.computes:
                return response(request, 404, error_body("ResourceNotFound", f"compute {m.group(1)} not found"))
            return response(request, 200, self._compute(m.group(1)))
        if rest == "/jobs" and method == "GET":
            return self._list_jobs(request, query)
        m = re.fullmatch(r"/jobs/([^/]+)", rest)
        if m:
            name = m.group(1)
            if method == "GET":
                job = self.jobs.get(name)
                if job is None:
                    return response(request, 404, error_body("UserError", f"job {name} not found"))
                return response(request, 200, job)
            if method == "PUT":
                self.puts.setdefault(name, []).append(body)
                if name in self.jobs:
                    return response(request, 409, error_body("Conflict", f"job {name} already exists"))
                return response(request, 201, self._store(name, body, "NotStarted"))
        m = re.fullmatch(r"/datastores/([^/]+)(/listSecrets)?", rest)
        if m and (method, bool(m.group(2))) in (("GET", False), ("POST", True)):
            return self._datastore(request, m.group(1), secrets=bool(m.group(2)))
        m = re.fullmatch(r"/jobs/([^/]+)/cancel", rest)
        if m and method == "POST":
            name = m.group(1)
            if name not in self.jobs:
                return response(request, 404, error_body("UserError", f"job {name} not found"))
            if self.jobs[name]["properties"]["status"] not in ("Completed", "Failed", "Canceled", "NotResponding"):
                self.set_status(name, "CancelRequested")
            location = f"{self.arm}{self.scope}/jobs/{name}/cancelstatus?api-version=2023-04-01-preview"
            return response(request, 202, None, {"Location": location})
        m = re.fullmatch(r"/jobs/([^/]+)/cancelstatus", rest)
        if m and method == "GET":
            return response(request, 200, None)
        m = re.fullmatch(r"/codes/([^/]+)/versions", rest)
        if m and method == "GET":
            wanted = query.get("hash")
            found = [c for (n, _), c in self.codes.items() if n == m.group(1) and (
                wanted is None or c["properties"].get("contentHash") == wanted)]
            return response(request, 200, {"value": found})
        m = re.fullmatch(r"/codes/([^/]+)/versions/([^/]+)/startPendingUpload", rest)
        if m and method == "POST":
            return self._pending_upload(request, m.group(1), m.group(2))
        m = re.fullmatch(r"/codes/([^/]+)/versions/([^/]+)", rest)
        if m and method == "PUT":
            code = {"id": f"{self.scope}/codes/{m.group(1)}/versions/{m.group(2)}", "name": m.group(2),
                    "type": "Microsoft.MachineLearningServices/workspaces/codes/versions",
                    "properties": dict(body["properties"]), "systemData": {"createdAt": iso(self.now)}}
            self.codes[(m.group(1), m.group(2))] = code
            return response(request, 201, code)
        if m and method == "GET":
            code = self.codes.get((m.group(1), m.group(2)))
            return response(request, 200, code) if code else response(
                request, 404, error_body("UserError", "code version not found"))
        m = re.fullmatch(r"/environments/([^/]+)/versions/([^/]+)", rest)
        if m and method == "PUT":
            env = {"id": f"{self.scope}/environments/{m.group(1)}/versions/{m.group(2)}", "name": m.group(2),
                   "type": "Microsoft.MachineLearningServices/workspaces/environments/versions",
                   "properties": dict(body["properties"]), "systemData": {"createdAt": iso(self.now)}}
            self.environments[(m.group(1), m.group(2))] = env
            return response(request, 201, env)
        if m and method == "GET":
            env = self.environments.get((m.group(1), m.group(2)))
            return response(request, 200, env) if env else response(
                request, 404, error_body("UserError", "environment version not found"))
        return response(request, 404, error_body("NotFound", f"stand-in has no ARM route for {method} {rest}"))

    # -- resources --------------------------------------------------------------------------

    def _datastore(self, request: Any, name: str, *, secrets: bool) -> RestRequestsTransportResponse:
        """A Blob datastore of :attr:`datastores` on :attr:`blob`'s account (GET), or its account key
        (POST listSecrets), as ARM answers them; 404 for another name."""
        if name not in self.datastores or self.blob is None:
            return response(request, 404, error_body("UserError", f"datastore {name} not found"))
        if secrets:
            return response(request, 200, {"secretsType": "AccountKey", "key": self.blob.key})
        return response(request, 200, {
            "id": f"{self.scope}/datastores/{name}", "name": name,
            "type": "Microsoft.MachineLearningServices/workspaces/datastores",
            "properties": {"datastoreType": "AzureBlob", "accountName": self.blob.name,
                           "containerName": self.datastores[name], "endpoint": "core.windows.net",
                           "protocol": "https", "isDefault": name == "workspaceblobstore",
                           "credentials": {"credentialsType": "AccountKey"}}})

    def _workspace(self) -> dict[str, Any]:
        return {"id": self.scope, "name": self.workspace, "type": "Microsoft.MachineLearningServices/workspaces",
                "location": "eastus", "kind": "Default",
                "properties": {"discoveryUrl": API + "/discovery", "friendlyName": self.workspace,
                               "workspaceId": "11111111-2222-3333-4444-555555555555",
                               "provisioningState": "Succeeded", "mlFlowTrackingUri": "azureml://eastus.api.azureml.ms"}}

    def _compute(self, name: str) -> dict[str, Any]:
        return {"id": f"{self.scope}/computes/{name}", "name": name, "location": "eastus",
                "type": "Microsoft.MachineLearningServices/workspaces/computes",
                "properties": {"computeType": "AmlCompute", "provisioningState": "Succeeded",
                               "properties": {"vmSize": self.computes[name], "vmPriority": "Dedicated",
                                              "scaleSettings": {"minNodeCount": 0, "maxNodeCount": 4}}}}

    def _store(self, name: str, body: dict[str, Any], status: str) -> dict[str, Any]:
        props = json.loads(json.dumps(body["properties"]))
        props["status"] = status
        props.setdefault("properties", {})
        props.setdefault("services", {"Studio": {"endpoint": f"https://ml.azure.com/runs/{name}", "jobServiceType": "Studio"}})
        job = {"id": f"{self.scope}/jobs/{name}", "name": name, "type": "Microsoft.MachineLearningServices/workspaces/jobs",
               "properties": props,
               "systemData": {"createdAt": iso(self.now), "createdBy": "trainboard", "createdByType": "Application",
                              "lastModifiedAt": iso(self.now)}}
        self.jobs[name] = job
        return job

    def _list_jobs(self, request: Any, query: dict[str, str]) -> RestRequestsTransportResponse:
        tag = query.get("tag")
        jobs = [j for _, j in sorted(self.jobs.items()) if tag is None or tag in (j["properties"].get("tags") or {})]
        skip = int(query.get("$skip", "0") or 0)
        page = jobs[skip: skip + self.list_page_size]
        out: dict[str, Any] = {"value": page}
        if skip + self.list_page_size < len(jobs):
            params = {k: v for k, v in query.items() if k != "$skip"}
            params["$skip"] = str(skip + self.list_page_size)
            out["nextLink"] = f"{self.arm}{self.scope}/jobs?{urllib.parse.urlencode(params)}"
        return response(request, 200, out)

    def _pending_upload(self, request: Any, name: str, version: str) -> RestRequestsTransportResponse:
        if self.blob is None:
            return response(request, 500, error_body("NoBlob", "the stand-in was built without a blob account"))
        container = f"azureml-blobstore-{uuid.uuid5(uuid.NAMESPACE_URL, self.scope).hex[:20]}"
        sas_url = self.blob.container_sas_url(container)
        blob_uri = f"{self.blob.url}/{container}"
        return response(request, 200, {
            "blobReferenceForConsumption": {"blobUri": blob_uri, "storageAccountArmId": None,
                                            "credential": {"credentialType": "SAS", "sasUri": sas_url}},
            "pendingUploadId": str(uuid.uuid4()), "pendingUploadType": "TemporaryBlobReference"})

    def _run_details(self, request: Any, name: str) -> RestRequestsTransportResponse:
        job = self.jobs.get(name)
        if job is None:
            return response(request, 404, error_body("UserError", f"run {name} not found"))
        props = job["properties"]
        files = {f: f"{LOGS}/dcid.{name}/{f}?sv=2021-08-06&sig=stand-in" for f in sorted(self.log_files.get(name, {}))}
        details: dict[str, Any] = {"runId": name, "status": props["status"], "logFiles": files,
                                   "startTimeUtc": props["properties"].get("StartTimeUtc"),
                                   "endTimeUtc": props["properties"].get("EndTimeUtc"), "warnings": []}
        if name in self.run_errors:
            details["error"] = {"error": dict(self.run_errors[name])}
        return response(request, 200, details)

    def _log_file(self, request: Any, path: str) -> RestRequestsTransportResponse:
        m = re.search(r"/dcid\.([^/]+)/(.+)$", path)
        data = self.log_files.get(m.group(1), {}).get(m.group(2)) if m else None
        if data is None:
            return response(request, 404, raw=b"BlobNotFound", content_type="application/xml")
        rng = re.fullmatch(r"bytes=(\d+)-(\d*)", request.headers.get("Range", "") or request.headers.get("x-ms-range", ""))
        if not rng:
            return response(request, 200, raw=data, content_type="text/plain")
        start = int(rng.group(1))
        end = int(rng.group(2)) if rng.group(2) else len(data) - 1
        if start >= len(data):
            return response(request, 416, raw=b"InvalidRange", content_type="application/xml",
                            headers={"Content-Range": f"bytes */{len(data)}"})
        end = min(end, len(data) - 1)
        return response(request, 206, raw=data[start:end + 1], content_type="text/plain",
                        headers={"Content-Range": f"bytes {start}-{end}/{len(data)}"})


def url_startswith(url: str, prefix: str) -> bool:
    return url == prefix or url.startswith(prefix.rstrip("/") + "/") or url.startswith(prefix + "?")


class StandinTransport(HttpTransport):
    """An azure-core transport that hands every request to an :class:`AzureMLStandin`."""

    def __init__(self, standin: AzureMLStandin, *, on_send: Callable[[Any], None] | None = None) -> None:
        self.standin = standin
        self.on_send = on_send

    def __enter__(self) -> "StandinTransport":
        return self

    def __exit__(self, *args: Any) -> None:
        return None

    def open(self) -> None:
        return None

    def close(self) -> None:
        return None

    def send(self, request: Any, **kwargs: Any) -> RestRequestsTransportResponse:
        if self.on_send is not None:
            self.on_send(request)
        return self.standin.handle(request)




SETTINGS = {"subscription_id": SUBSCRIPTION, "resource_group": RESOURCE_GROUP, "workspace": WORKSPACE,
            "compute": COMPUTE}
"""The backend settings that match the stand-in's defaults."""


def make_backend(st: "AzureMLStandin", *, clock: FakeClock | None = None, seed: int = 0, credential: Any = None,
                 prices: Any = None, **config: Any):
    """An :class:`AzureMLBackend` on ``st`` with a fake credential, seeded jitter and ``clock``;
    ``config`` overrides :data:`SETTINGS`. Its datastores' Blob service is ``st.blob`` (Azurite),
    when the workspace has one."""
    from cloud_adapters import retry
    from cloud_adapters.azureml import AzureMLBackend

    return AzureMLBackend({**SETTINGS, **config}, credential=credential or FakeCredential(),
                          transport=StandinTransport(st), prices=prices,
                          retry_policy=retry.RetryPolicy(rng=random.Random(seed)), clock=clock or FakeClock(),
                          blob_account_url=st.blob.url if st.blob is not None else None)


def two_gpu_catalog():
    """The shipped pay-as-you-go rows (not their low-priority stand-ins, so a size without a
    low-priority price can be tested) plus a 2-GPU size, ``Standard_NC12s_v3``, with made-up test prices
    (6.12 on demand, 1.22 low priority): lets a test run 2 processes per node (one per GPU)."""
    from cloud_adapters.pricing import PriceRow, StaticPriceCatalog, shipped_catalog

    rows = [r for r in shipped_catalog().rows("azure") if not r.instance_type.endswith(":low_priority")] + [
        PriceRow("azure", "eastus", "Standard_NC12s_v3", 6.12, "test row"),
        PriceRow("azure", "eastus", "Standard_NC12s_v3:low_priority", 1.22, "test row"),
    ]
    return StaticPriceCatalog(rows)
