"""The SDK: :class:`Client` over Trainboard's REST API (``/api/``, token auth).

Every method returns the API's JSON (dicts and lists, as documented by the server's OpenAPI schema at
``/api/schema/``). Errors are exceptions carrying what the CLI prints and its exit code:

- :class:`ApiError` (exit 2): the server refused the request (4xx); ``errors`` maps each field to its
  messages, as the server worded them (``{"nodes": ["Ensure this value is greater than or equal to 1."]}``).
- :class:`AuthError` (exit 2): 401, the token is missing, wrong or revoked: log in again.
- :class:`Unreachable` (exit 3): no answer after the retries (connection refused, timeouts, 502/503/504).

A request that did not reach the server (connection refused or timed out while connecting) is retried
with exponential backoff, a GET also after a read timeout or a 502/503/504; ``on_retry`` is told each
time, so a CLI can say so plainly. A POST that may have reached the server is never sent twice.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
FRAMEWORKS = ("torch", "tensorflow", "ray", "mpi")
"""A script model's frameworks, as the server's ``/api/models/`` ``framework`` field takes them (a test
holds the two equal: the client imports nothing of the server's)."""
RETRY_STATUSES = frozenset({502, 503, 504})

RetryHook = Callable[[int, int, float, str], None]
"""``on_retry(attempt, attempts, delay_s, reason)``: attempt ``attempt`` of ``attempts`` failed with
``reason``; the next starts in ``delay_s`` seconds."""


class TrainboardError(Exception):
    """Anything the client reports to its user; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ApiError(TrainboardError):
    """The server answered with an error (4xx, or 5xx with no retry left).

    ``status``: the HTTP status; ``errors``: ``{field: [message, ...]}`` (``detail`` or
    ``non_field_errors`` for an error on no one field; nested fields joined with dots, ``config.region``).
    """

    exit_code = 2

    def __init__(self, status: int, errors: dict[str, list[str]], *, method: str = "", path: str = "") -> None:
        self.status = status
        self.errors = errors
        self.method = method
        self.path = path
        super().__init__(self.message())

    def lines(self) -> list[str]:
        """Each error once, as ``field: message`` (a message on no field alone)."""
        seen: list[str] = []
        for field, messages in self.errors.items():
            for message in messages:
                line = message if field in ("detail", "non_field_errors", "__all__") else f"{field}: {message}"
                if line not in seen:
                    seen.append(line)
        return seen

    def message(self) -> str:
        return "\n".join(self.lines()) or f"{self.method} {self.path} answered HTTP {self.status}"


class AuthError(ApiError):
    """401: the token is missing, wrong or revoked."""

    def message(self) -> str:
        detail = "; ".join(self.lines()) or "no valid token"
        return f"The server refused the credentials ({detail}). Log in again: trainboard login URL"


class ChecksumMismatch(TrainboardError):
    """A downloaded file's SHA-256 is not the server's."""

    exit_code = 1


class Unreachable(TrainboardError):
    """No answer from the server after every retry."""

    exit_code = 3


def flatten_errors(body: Any, prefix: str = "") -> dict[str, list[str]]:
    """DRF's error body as ``{field: [messages]}``: nested objects joined with dots, list items by index
    only where they are objects (``{"env": ["..."]}`` stays ``env``)."""
    out: dict[str, list[str]] = {}
    if isinstance(body, dict):
        for key, value in body.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            for k, v in flatten_errors(value, name).items():
                out.setdefault(k, []).extend(v)
    elif isinstance(body, list):
        for i, item in enumerate(body):
            if isinstance(item, (dict, list)):
                for k, v in flatten_errors(item, f"{prefix}.{i}" if prefix and isinstance(item, dict) else prefix).items():
                    out.setdefault(k, []).extend(v)
            else:
                out.setdefault(prefix or "detail", []).append(str(item))
    elif body is not None:
        out.setdefault(prefix or "detail", []).append(str(body))
    return out


class Client:
    """Trainboard's REST API for one server and one user's token.

    ``url``: the server's root (``http://127.0.0.1:8000``); ``token``: the API token (``trainboard
    login`` or ``POST /api/auth/token/``); ``retries``: extra tries of a request that did not get an
    answer, with exponential backoff from ``backoff_s`` (0.5, 1, 2, ... seconds, at most 8).
    """

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 30.0, retries: int = 4,
                 backoff_s: float = 0.5, on_retry: RetryHook | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.on_retry = on_retry
        headers = {"Accept": "application/json", "User-Agent": "trainboard-client/0.1"}
        if token:
            headers["Authorization"] = f"Token {token}"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ------------------------------------------------------------------------------

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One API call, retried while no answer came (see the module's docstring); raises
        :class:`ApiError` / :class:`AuthError` for an error answer, :class:`Unreachable` when none came."""
        attempts = self.retries + 1
        safe = method.upper() in ("GET", "HEAD", "OPTIONS")
        for attempt in range(1, attempts + 1):
            reason = ""
            try:
                response = self._http.request(method, path, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                reason = f"cannot connect to {self.url} ({_short(exc)})"
            except (httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if not safe:  # the server may have acted on it: never sent twice
                    raise Unreachable(f"{method} {path}: no answer from {self.url} ({_short(exc)}); it may have "
                                      f"been done: check before trying again.") from None
                reason = f"no answer from {self.url} ({_short(exc)})"
            else:
                if response.status_code in RETRY_STATUSES and safe:  # a proxy with no server behind it
                    reason = f"{self.url} answered HTTP {response.status_code}"
                else:
                    return self._checked(response, method, path)
            if attempt == attempts:
                raise Unreachable(f"Server unreachable: {reason}; gave up after {attempts} tries. Is the server "
                                  f"running, and is the URL right?")
            delay = min(self.backoff_s * 2 ** (attempt - 1), 8.0)
            if self.on_retry is not None:
                self.on_retry(attempt, attempts, delay, reason)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _checked(self, response: httpx.Response, method: str, path: str) -> httpx.Response:
        if response.status_code < 400:
            return response
        try:
            body = response.json()
        except ValueError:
            body = {"detail": response.text.strip()[:500] or f"HTTP {response.status_code}"}
        errors = flatten_errors(body)
        cls = AuthError if response.status_code == 401 else ApiError
        raise cls(response.status_code, errors, method=method, path=path)

    def get(self, path: str, **params: Any) -> Any:
        clean = {k: v for k, v in params.items() if v is not None}
        return self.request("GET", path, params=clean).json()

    def post(self, path: str, json: Any = None, **kwargs: Any) -> Any:
        response = self.request("POST", path, json=json, **kwargs)
        return response.json() if response.content else None

    # -- accounts -------------------------------------------------------------------------------

    @classmethod
    def login(cls, url: str, username: str, password: str, **kwargs: Any) -> Client:
        """A client with the token ``POST /api/auth/token/`` gives for ``username`` and ``password``."""
        anonymous = cls(url, None, **kwargs)
        try:
            token = anonymous.post("/api/auth/token/", {"username": username, "password": password})["token"]
        finally:
            anonymous.close()
        return cls(url, token, **kwargs)

    def check_token(self) -> None:
        """Raises :class:`AuthError` unless the server accepts the token (one cheap GET)."""
        self.get("/api/backends/", limit=1)

    # -- lists ------------------------------------------------------------------------------------

    def page(self, path: str, *, limit: int = 25, offset: int = 0, **filters: Any) -> dict[str, Any]:
        """One page of a list: ``{"count", "next", "previous", "results", ...}``."""
        return self.get(path, limit=limit, offset=offset, **filters)

    def iter_all(self, path: str, *, page_size: int = 500, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every item of a list, page after page (``?limit=&offset=``)."""
        offset = 0
        while True:
            page = self.page(path, limit=page_size, offset=offset, **filters)
            yield from page["results"]
            offset += len(page["results"])
            if not page.get("next") or not page["results"]:
                return

    def jobs(self, *, limit: int = 25, offset: int = 0, state: str | None = None, backend: int | None = None,
             q: str | None = None, tag: str | None = None, stalled: bool | None = None,
             archived: str | None = None, ordering: str | None = None) -> dict[str, Any]:
        """A page of your jobs, newest first unless ``ordering`` (``-val_accuracy``, ``cost``, ...)."""
        return self.page("/api/jobs/", limit=limit, offset=offset, state=state, backend=backend, q=q, tag=tag,
                         stalled=None if stalled is None else str(stalled).lower(), archived=archived,
                         ordering=ordering)

    def backends(self) -> list[dict[str, Any]]:
        return list(self.iter_all("/api/backends/"))

    def datasets(self) -> list[dict[str, Any]]:
        return list(self.iter_all("/api/datasets/"))

    def models(self) -> list[dict[str, Any]]:
        return list(self.iter_all("/api/models/"))

    # -- one job ----------------------------------------------------------------------------------

    def job(self, job_id: int) -> dict[str, Any]:
        return self.get(f"/api/jobs/{int(job_id)}/")

    def create_job(self, **fields: Any) -> dict[str, Any]:
        """``POST /api/jobs/`` with the job-create fields (``GET /api/schema/`` lists them); the job."""
        return self.post("/api/jobs/", fields)

    def estimate(self, **fields: Any) -> dict[str, Any]:
        """``POST /api/jobs/estimate/``: ``{"estimated_cost_usd", "estimate_arithmetic", "hourly_price_usd",
        "max_runtime_covers", "world_size", "memory_plan", "job"}`` (``job``: the job ``create_job(**fields)``
        would make, id null; null without ``model_spec``, which prices the shape alone); nothing launched.
        :class:`ApiError` with every error."""
        return self.post("/api/jobs/estimate/", fields)

    def cancel(self, job_id: int) -> dict[str, Any]:
        return self.post(f"/api/jobs/{int(job_id)}/cancel/")

    def logs(self, job_id: int, *, after: int = -1, limit: int | None = None) -> dict[str, Any]:
        """``{"lines": [{"seq", "text"}], "next": cursor, "more": bool}``: the lines after ``after``."""
        return self.get(f"/api/jobs/{int(job_id)}/logs/", after=after, limit=limit)

    def follow(self, job_id: int, *, after: int = -1, poll_s: float = 1.0,
               stop: threading.Event | None = None) -> Iterator[tuple[str, Any]]:
        """Follow a job to its end, yielding in order:

        - ``("event", event)`` for each event of its timeline not yet seen (``from_state``, ``to_state``,
          ``is_note``, ``message``, ``created_at``: every transition, however quickly it passed);
        - ``("state", job)`` when the job's state differs from the last poll's (first its current one);
        - ``("line", text)`` for each new log line (from the ``after`` cursor on),

        until the job has ended and its log is read, or ``stop`` is set (checked between calls and while
        waiting for the next poll: a caller's Ctrl-C handler sets it, so the interrupt never lands
        inside an HTTP call). Each poll reads the new log lines first and the
        job after them, so a transition the server recorded before those lines (the move to RUNNING
        that a sync saw with the first epochs) is yielded before them."""
        state = None
        cursor = after
        events_seen = 0
        while stop is None or not stop.is_set():
            lines: list[str] = []
            while True:
                page = self.logs(job_id, after=cursor)
                lines += [line["text"] for line in page["lines"]]
                cursor = page["next"]
                if not page["more"]:
                    break
            job = self.job(job_id)
            events = job.get("events") or []
            for event in events[events_seen:]:
                yield "event", event
            events_seen = max(events_seen, len(events))
            if job["state"] != state:
                state = job["state"]
                yield "state", job
            for text in lines:
                yield "line", text
            if job["state"] in TERMINAL_STATES:
                # Lines the last sync stored with the final state: read after it, so none is lost.
                while True:
                    page = self.logs(job_id, after=cursor)
                    for line in page["lines"]:
                        yield "line", line["text"]
                    cursor = page["next"]
                    if not page["more"]:
                        return
            if stop is not None:
                stop.wait(poll_s)
            else:
                time.sleep(poll_s)

    def follow_logs(self, job_id: int, *, after: int = -1, poll_s: float = 1.0) -> Iterator[str]:
        """The job's log lines, new ones as they come, until the job has ended."""
        for kind, value in self.follow(job_id, after=after, poll_s=poll_s):
            if kind == "line":
                yield value

    def wait(self, job_id: int, *, poll_s: float = 1.0) -> dict[str, Any]:
        """Block until the job ends; the job as it ended."""
        last: dict[str, Any] = {}
        for kind, value in self.follow(job_id, poll_s=poll_s):
            if kind == "state":
                last = value
        return last or self.job(job_id)

    def rerun(self, job_id: int) -> dict[str, Any]:
        """``POST /api/jobs/{id}/rerun/``: a new job with the same frozen config."""
        return self.post(f"/api/jobs/{int(job_id)}/rerun/")

    def clone(self, job_id: int, **overrides: Any) -> dict[str, Any]:
        """``POST /api/jobs/{id}/clone/``: a new job like this one with the create's fields as overrides
        (``hyperparameters`` deep-merged), and ``init_mode="continue"`` or ``"finetune"`` to start from
        its checkpoint or weights."""
        return self.post(f"/api/jobs/{int(job_id)}/clone/", overrides)

    def compare(self, job_ids: list[int]) -> dict[str, Any]:
        """``GET /api/jobs/compare/?ids=``: runs, metrics, each run's final and best values, config diff."""
        return self.get("/api/jobs/compare/", ids=",".join(str(int(i)) for i in job_ids))

    def artifacts(self, job_id: int) -> dict[str, Any]:
        """``{"results": [{"name", "kind", "size_bytes", "sha256", ...}], "error": ""}``."""
        return self.get(f"/api/jobs/{int(job_id)}/artifacts/")

    def download_artifact(self, job_id: int, name: str, dest: str | os.PathLike[str], *,
                          sha256: str | None = None, on_progress: Callable[[int], None] | None = None) -> str:
        """Download the artifact ``name`` to ``dest``; returns its SHA-256.

        The bytes go to ``dest + ".part"`` first: a later call resumes from its length with an HTTP
        Range request where the answer honours it (the clouds' signed URLs do; a stream the server
        sends whole starts over). ``sha256`` (the listing's, when the server computed one): the file
        must match it, else :class:`ChecksumMismatch` and the partial file is removed. The file is
        moved to ``dest`` only once complete and checked. A signed URL on another host is fetched
        without the token (httpx drops it on a cross-origin redirect)."""
        import hashlib

        target = Path(dest)
        part = target.with_name(target.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        path = f"/api/jobs/{int(job_id)}/artifacts/{quote(name)}/download/"
        headers = {"Range": f"bytes={have}-"} if have else {}
        attempts = self.retries + 1
        for attempt in range(1, attempts + 1):
            try:
                with self._http.stream("GET", path, headers=headers, follow_redirects=True) as response:
                    if response.status_code == 416 and have:  # the part is already whole
                        break
                    if response.status_code >= 400:
                        response.read()
                        self._checked(response, "GET", path)
                    mode = "ab" if have and response.status_code == 206 else "wb"
                    with open(part, mode) as handle:
                        done = have if mode == "ab" else 0
                        for chunk in response.iter_bytes(1 << 20):
                            handle.write(chunk)
                            done += len(chunk)
                            if on_progress is not None:
                                on_progress(done)
                break
            except (httpx.TransportError,) as exc:
                if attempt == attempts:
                    raise Unreachable(f"Download of {name} interrupted ({_short(exc)}); run it again to resume "
                                      f"from {part.stat().st_size if part.exists() else 0:,} bytes.") from None
                delay = min(self.backoff_s * 2 ** (attempt - 1), 8.0)
                if self.on_retry is not None:
                    self.on_retry(attempt, attempts, delay, f"download interrupted ({_short(exc)})")
                time.sleep(delay)
                have = part.stat().st_size if part.exists() else 0
                headers = {"Range": f"bytes={have}-"} if have else {}
        digest = hashlib.sha256()
        with open(part, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        got = digest.hexdigest()
        if sha256 and got != sha256:
            part.unlink()
            raise ChecksumMismatch(f"{name}: downloaded SHA-256 {got[:16]}… is not the server's {sha256[:16]}…; "
                                   f"the partial file was removed: download it again.")
        os.replace(part, target)
        return got

    # -- models and code --------------------------------------------------------------------------

    def create_model(self, *, name: str, kind: str, entry_point: str, archive: bytes,
                     filename: str = "code.tar.gz", script_args: list[str] | None = None,
                     description: str = "", framework: str = "torch") -> dict[str, Any]:
        """``POST /api/models/`` (multipart): a *my script* (kind ``script``) or *my model* (``code``)
        model with its code archive; ``framework`` (a script's: torch, tensorflow, ray or mpi) says how
        its processes start. A refused archive is an :class:`ApiError` on ``code`` naming the member
        and why."""
        import json

        data = {"name": name, "kind": kind, "entry_point": entry_point, "description": description,
                "framework": framework}
        if script_args is not None:
            data["script_args"] = json.dumps(script_args)
        files = {"code": (filename, archive, "application/gzip")}
        return self.request("POST", "/api/models/", data=data, files=files).json()

    # -- the schema -------------------------------------------------------------------------------

    def schema(self) -> dict[str, Any]:
        """The server's OpenAPI schema (``GET /api/schema/``) as JSON."""
        return self.get("/api/schema/", format="json")


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 160 else text[:157] + "..."
