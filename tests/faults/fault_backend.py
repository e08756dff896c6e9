"""A cloud stand-in for fault-injection tests, registered only in tests (kind ``faultcloud``).

Its "provider" is a directory (:class:`FaultProvider`): one JSON file per provider job, so the test
process and real Celery worker processes see the same provider, and a SIGKILLed worker leaves behind
exactly what a real cloud would (a job that was created, or none). Like Vertex AI, the provider does
not refuse a second job of the same name: the adapter looks the name up, then creates (with an
optional race window between the two), so a duplicate submission would really show up as two jobs.

Faults are set in ``control.json`` (:meth:`FaultProvider.control`):

* ``block_submit``: "before" or "after" — ``submit`` touches ``entered-<job name>`` and waits while the
  file ``block`` exists, before (or just after) creating the provider job: the test SIGKILLs the worker
  there;
* ``race_window_s``: seconds between the name lookup and the create;
* ``throttle_share`` / ``timeout_share`` (+ ``seed``): that share of calls raises Throttled / a transient
  ProviderError ("read timed out"), drawn from ``random.Random(seed)`` per provider directory and
  process.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import random
import time
import uuid
from pathlib import Path
from typing import Any

from cloud_adapters.base import (
    Backend,
    Capabilities,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    ProviderError,
    Throttled,
)
from cloud_adapters.settings import BackendSettings, Setting

KIND = "faultcloud"
HOURLY_USD = 3.6


class FaultProvider:
    """The provider's side: jobs, logs, cancels and the fault controls, all files under ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        (self.root / "jobs").mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)

    # -- consistency: one provider-side lock, like a cloud's own database ---------------------
    @contextlib.contextmanager
    def locked(self):
        with open(self.root / "lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _write(self, path: Path, data: Any) -> None:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    # -- jobs -----------------------------------------------------------------------------------
    def jobs(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every provider job (of ``name``), oldest first."""
        found = []
        for path in (self.root / "jobs").glob("*.json"):
            record = json.loads(path.read_text())
            if name is None or record["name"] == name:
                found.append(record)
        return sorted(found, key=lambda r: (r["created"], r["id"]))

    def count(self, name: str) -> int:
        return len(self.jobs(name))

    def create(self, name: str, tags: dict[str, str]) -> dict[str, Any]:
        record = {"id": uuid.uuid4().hex[:12], "name": name, "state": "RUNNING", "tags": dict(tags),
                  "created": time.time(), "started": time.time(), "ended": None}
        with self.locked():
            self._write(self.root / "jobs" / f"{record['id']}.json", record)
        return record

    def get(self, job_id: str) -> dict[str, Any] | None:
        path = self.root / "jobs" / f"{job_id}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def set_state(self, job_id: str, state: str, **extra: Any) -> None:
        with self.locked():
            record = self.get(job_id)
            record.update(state=state, **extra)
            if state in ("SUCCEEDED", "FAILED", "CANCELLED") and not record.get("ended"):
                record["ended"] = time.time()
            self._write(self.root / "jobs" / f"{job_id}.json", record)

    def cancel(self, job_id: str) -> None:
        """Stop the job: the first cancel of a live job moves it to CANCELLED and is logged as the
        one *effect*; every call is logged in ``cancel-calls``."""
        with self.locked():
            with open(self.root / "cancel-calls", "a") as fh:
                fh.write(job_id + "\n")
            record = self.get(job_id)
            if record and record["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                record.update(state="CANCELLED", ended=time.time())
                self._write(self.root / "jobs" / f"{job_id}.json", record)
                with open(self.root / "cancel-effects", "a") as fh:
                    fh.write(job_id + "\n")

    def cancel_effects(self) -> list[str]:
        path = self.root / "cancel-effects"
        return path.read_text().split() if path.exists() else []

    def cancel_calls(self) -> list[str]:
        path = self.root / "cancel-calls"
        return path.read_text().split() if path.exists() else []

    # -- logs -------------------------------------------------------------------------------
    def write_log(self, job_id: str, lines: list[str]) -> None:
        with self.locked(), open(self.root / "logs" / f"{job_id}.log", "a") as fh:
            fh.writelines(line + "\n" for line in lines)

    def log_lines(self, job_id: str) -> list[str]:
        path = self.root / "logs" / f"{job_id}.log"
        return path.read_text().splitlines() if path.exists() else []

    # -- faults -----------------------------------------------------------------------------
    def control(self, **settings: Any) -> None:
        """Merge ``settings`` into control.json (None removes a key)."""
        current = self.controls()
        current.update(settings)
        self._write(self.root / "control.json", {k: v for k, v in current.items() if v is not None})

    def controls(self) -> dict[str, Any]:
        path = self.root / "control.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def block(self) -> None:
        (self.root / "block").touch()

    def unblock(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / "block").unlink()

    def entered(self, name: str) -> bool:
        """Whether a submit of ``name`` reached its blocking point."""
        return (self.root / f"entered-{name}").exists()


_RNGS: dict[str, random.Random] = {}
CALLS: dict[str, int] = {}
"""Calls this process made to the adapter, by operation (faults included)."""


class FaultBackend(Backend):
    kind = KIND
    queue = "celery"
    settings = BackendSettings(backend_label="Fault-injecting stand-in", provider="faultcloud", settings=(
        Setting("root", "Provider directory", "Where the stand-in provider keeps its jobs and fault controls.",
                required=True, field=False),
    ))

    @property
    def provider(self) -> FaultProvider:
        return FaultProvider(self.config["root"])

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(max_nodes=4, max_procs_per_node=8)

    def _fault(self, op: str) -> None:
        CALLS[op] = CALLS.get(op, 0) + 1
        controls = self.provider.controls()
        throttle, timeout = float(controls.get("throttle_share", 0)), float(controls.get("timeout_share", 0))
        if not throttle and not timeout:
            return
        rng = _RNGS.setdefault(str(self.config["root"]), random.Random(controls.get("seed", 0)))
        draw = rng.random()
        if draw < throttle:
            raise Throttled(f"faultcloud {op}: rate exceeded")
        if draw < throttle + timeout:
            raise ProviderError(f"faultcloud {op}: read timed out", transient=True)

    def _handle(self, record: dict[str, Any]) -> JobHandle:
        return JobHandle(provider=KIND, job_name=record["name"], provider_job_id=record["id"])

    def submit(self, spec: JobSpec) -> JobHandle:
        self._fault("submit")
        provider = self.provider
        existing = provider.jobs(spec.job_name)
        if existing:  # adopt by name, as every real adapter does
            return self._handle(existing[0])
        controls = provider.controls()
        mode = controls.get("block_submit")
        if mode == "before":
            self._wait_blocked(provider, spec.job_name)
        time.sleep(float(controls.get("race_window_s", 0)))
        record = provider.create(spec.job_name, dict(spec.tags))
        if mode == "after":
            self._wait_blocked(provider, spec.job_name)
        return self._handle(record)

    @staticmethod
    def _wait_blocked(provider: FaultProvider, name: str) -> None:
        (provider.root / f"entered-{name}").touch()
        while (provider.root / "block").exists():
            time.sleep(0.05)

    def _status(self, record: dict[str, Any]) -> JobStatus:
        ts = lambda t: dt.datetime.fromtimestamp(t, tz=dt.timezone.utc) if t else None  # noqa: E731
        return JobStatus(state=JobState(record["state"]), raw_state=record["state"],
                         started_at=ts(record.get("started")), ended_at=ts(record.get("ended")),
                         billable_seconds=record.get("billable_seconds"), instance_count=1)

    def describe(self, handle: JobHandle) -> JobStatus:
        self._fault("describe")
        record = self.provider.get(handle.provider_job_id)
        if record is None:
            raise ProviderError(f"faultcloud: no job {handle.job_name}")
        return self._status(record)

    def describe_many(self, handles, changed_since=None) -> dict[str, JobStatus]:
        self._fault("describe_many")
        found = {}
        for handle in handles:
            record = self.provider.get(handle.provider_job_id)
            if record is not None:
                found[handle.job_name] = self._status(record)
        return found

    def cancel(self, handle: JobHandle) -> None:
        self._fault("cancel")
        self.provider.cancel(handle.provider_job_id)

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        self._fault("logs")
        at = int(cursor or 0)
        lines = self.provider.log_lines(handle.provider_job_id)[at:at + 50]
        return lines, str(at + len(lines))

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        return HOURLY_USD
