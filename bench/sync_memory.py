"""One sync of 10,000 active jobs across backends: provider calls and the worker's peak memory.

    .venv/bin/python bench/sync_memory.py                   # 10,000 active jobs on 4 backends, 1 % changed
    .venv/bin/python bench/sync_memory.py --quick           # 1,000 jobs
    .venv/bin/python bench/sync_memory.py --jobs 10000 --backends 1 --changed-pct 5

What it does, in one run:

1. creates a throwaway PostgreSQL database (``--db-name``, default ``trainboard_bench_sync``), applies
   every migration and loads with COPY ``--jobs`` active jobs (90 % RUNNING, 10 % PENDING, each with its
   frozen trainer config, a provider handle and a last sync 30 s ago) spread over ``--backends``
   backends of a counting stand-in kind (below);
2. runs, in a fresh subprocess each (a worker's process: Django set up, nothing else), one sync pass
   (``jobs.sync.backend_sync`` for every backend, as ``sync_jobs`` fans it out) and reports
   - the process's peak resident memory (``VmHWM`` from /proc/self/status) before and after the pass;
   - in a second subprocess, the Python heap's peak during the pass (``tracemalloc``; slower, so its
     time is not reported);
   - the provider calls the pass made, by operation;
3. prints the calls against the active and the changed jobs, and the memory against the 300 MB target;
4. drops the database (unless ``--keep``).

The stand-in (``CountingFake``) answers like the SageMaker adapter's ``describe_many(changed_since=…)``:
one list call per 100 changed jobs, one describe per changed job, nothing for the unchanged ones; it
counts every ``logs`` and ``cancel`` call too. No network. A job "changed" when its number modulo 100
is below ``--changed-pct``. Nothing is asserted (exit 0), or with ``--check`` exit 1 on a missed target.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Iterator, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from cloud_adapters.base import Backend, Capabilities, JobHandle, JobState, JobStatus  # noqa: E402

PEAK_MB_TARGET = 300.0
KIND = "benchfake"


class CountingFake(Backend):
    """A provider that changes ``changed_pct`` % of its jobs between syncs and counts the calls."""

    kind = KIND
    calls: Counter[str] = Counter()
    changed_pct = 1
    page = 100  # jobs per list call, as SageMaker's ListTrainingJobs MaxResults

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities()

    @classmethod
    def changed(cls, handle: JobHandle) -> bool:
        return int(handle.job_name.rsplit("-", 1)[-1]) % 100 < cls.changed_pct

    def _status(self) -> JobStatus:
        now = dt.datetime.now(dt.timezone.utc)
        return JobStatus(state=JobState.RUNNING, raw_state="InProgress", secondary_state="Training",
                         started_at=now - dt.timedelta(minutes=30), billable_seconds=1800.0)

    def submit(self, spec):
        raise AssertionError("the sync benchmark submits nothing")

    def describe(self, handle: JobHandle) -> JobStatus:
        self.calls["describe"] += 1
        return self._status()

    def describe_many(self, handles: Sequence[JobHandle],
                      changed_since: dt.datetime | None = None) -> dict[str, JobStatus]:
        if changed_since is None:
            return {h.job_name: self.describe(h) for h in handles}
        changed = [h for h in handles if self.changed(h)]
        self.calls["list"] += max(1, math.ceil(len(changed) / self.page))
        return {h.job_name: self.describe(h) for h in changed}

    def cancel(self, handle: JobHandle) -> None:
        self.calls["cancel"] += 1

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        self.calls["logs"] += 1
        return [], cursor

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        return 1.0


def register_fake() -> None:
    from cloud_adapters import registry

    registry.KINDS[KIND] = registry.KindInfo(__name__, "CountingFake", "Benchmark stand-in")


def sync_parser(doc: str, db_name: str) -> argparse.ArgumentParser:
    """The options this benchmark and bench/sync_db.py share: the load (``--jobs``, ``--backends``,
    ``--changed-pct``, ``--quick``) and the throwaway database (``--server``, ``--db-name``, ``--keep``)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=10_000, help="active jobs (default 10,000)")
    p.add_argument("--backends", type=int, default=4, help="backends they are spread over (default 4)")
    p.add_argument("--changed-pct", type=int, default=1, help="percent of jobs changed since the last sync")
    p.add_argument("--quick", action="store_true", help="1,000 jobs")
    p.add_argument("--server", default=os.environ.get("BENCH_PG_SERVER", "postgres://postgres@127.0.0.1:5432"),
                   help="PostgreSQL server URL without a database name")
    p.add_argument("--db-name", default=db_name, help="throwaway database (dropped and created)")
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = sync_parser(__doc__, "trainboard_bench_sync")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    p.add_argument("--child", choices=["plain", "traced"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.jobs = 1_000
    if args.jobs < 1 or args.backends < 1 or not 0 <= args.changed_pct <= 100:
        p.error("--jobs and --backends must be at least 1, --changed-pct between 0 and 100")
    return args


def vm_kib(field: str) -> int:
    """``VmHWM`` / ``VmRSS`` of this process in KiB (Linux /proc)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def load(args: argparse.Namespace) -> None:
    from django.contrib.auth import get_user_model
    from psycopg.types.json import Jsonb

    from job_list import _copy, _job_columns
    from jobs.models import ComputeBackend, Dataset, ModelSpec, TrainingJob
    from trainer_pkg.config import JobConfig

    owner = get_user_model().objects.create_user("bench", "bench@example.com", "bench-pw-1")
    dataset = Dataset.objects.create(owner=owner, name="digits", format="builtin", builtin_name="digits")
    model = ModelSpec.objects.create(owner=owner, name="digits-cnn", architecture="cnn", params={})
    backends = [ComputeBackend.objects.create(owner=owner, name=f"fake-{b}", kind=KIND, config={})
                for b in range(args.backends)]
    cols, defaults = _job_columns()
    config = Jsonb(JobConfig().to_dict())
    now = dt.datetime.now(dt.timezone.utc)

    def rows():
        for i in range(args.jobs):
            running = i % 10 != 9
            row = dict(defaults)
            row.update({
                "owner_id": owner.pk, "created_at": now - dt.timedelta(hours=1), "updated_at": now,
                "name": f"sync-{i:05d}", "dataset_id": dataset.pk, "model_spec_id": model.pk,
                "backend_id": backends[i % args.backends].pk, "config": config, "nodes": 2, "procs_per_node": 4,
                "state": "RUNNING" if running else "PENDING", "provider_job_name": f"tb-job-{i}",
                "provider_handle": Jsonb({"provider": KIND, "job_name": f"tb-job-{i}", "provider_job_id": "",
                                          "extra": {}}),
                "raw_state": "InProgress", "secondary_state": "Training" if running else "Starting",
                "submitted_at": now - dt.timedelta(minutes=50),
                "started_at": now - dt.timedelta(minutes=30) if running else None,
                "state_entered_at": now - dt.timedelta(minutes=30), "last_synced_at": now - dt.timedelta(seconds=30),
                "hourly_price_usd": 1.2, "instance_count": 2,
            })
            yield [row[c] for c in cols]

    _copy(TrainingJob._meta.db_table, cols, rows())
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE")


def child_backends(args: argparse.Namespace) -> list[int]:
    """In a ``--child`` process: Django on the loaded database, the stand-in registered and changing
    ``--changed-pct`` % of the jobs; the ids of its backends."""
    from job_list import setup_django

    setup_django(args.server, args.db_name)
    register_fake()
    CountingFake.changed_pct = args.changed_pct
    from jobs.models import ComputeBackend

    return list(ComputeBackend.objects.filter(kind=KIND).order_by("pk").values_list("pk", flat=True))


def child(args: argparse.Namespace) -> None:
    """One sync pass in this (fresh) process; prints one JSON line."""
    import tracemalloc

    backend_ids = child_backends(args)
    from jobs.sync import backend_sync

    hwm_before, rss_before = vm_kib("VmHWM"), vm_kib("VmRSS")
    if args.child == "traced":
        tracemalloc.start()
    t0 = time.perf_counter()
    looked_at = sum(backend_sync(backend_id=b) for b in backend_ids)
    seconds = time.perf_counter() - t0
    heap_peak = tracemalloc.get_traced_memory()[1] if args.child == "traced" else None
    print(json.dumps({"looked_at": looked_at, "seconds": seconds, "calls": dict(CountingFake.calls),
                      "hwm_before_kib": hwm_before, "rss_before_kib": rss_before, "hwm_after_kib": vm_kib("VmHWM"),
                      "heap_peak_bytes": heap_peak}))


def run_child(args: argparse.Namespace, mode: str, script: str = __file__) -> dict[str, Any]:
    """``script --child mode`` on the loaded database in a fresh process; its JSON line."""
    cmd = [sys.executable, os.path.abspath(script), "--child", mode, "--server", args.server,
           "--db-name", args.db_name, "--changed-pct", str(args.changed_pct)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
    if out.returncode != 0:
        raise SystemExit(f"sync subprocess failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def reset_sync_times(args: argparse.Namespace) -> None:
    """Put every job back to 'last synced 30 s ago', so the second pass does what the first did (the
    changed jobs were RUNNING and stay RUNNING, with new numbers)."""
    import psycopg

    with psycopg.connect(f"{args.server.rstrip('/')}/{args.db_name}", autocommit=True) as conn:
        conn.execute("UPDATE jobs_trainingjob SET last_synced_at = now() - interval '30 seconds'")


@contextlib.contextmanager
def loaded_database(args: argparse.Namespace) -> Iterator[None]:
    """The throwaway database, migrated and loaded (``--jobs`` active jobs on ``--backends``
    stand-in backends), with no connection left open to it; dropped afterwards unless ``--keep``."""
    from job_list import create_database, drop_database, setup_django

    create_database(args.server, args.db_name)
    try:
        setup_django(args.server, args.db_name)
        register_fake()
        from django.core.management import call_command
        from django.db import connections

        call_command("migrate", verbosity=0, interactive=False)
        t0 = time.perf_counter()
        load(args)
        print(f"loaded {args.jobs:,} active jobs on {args.backends} backend(s) in {time.perf_counter() - t0:.1f} s",
              flush=True)
        connections.close_all()
        yield
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            drop_database(args.server, args.db_name)
            print(f"dropped database {args.db_name}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    started = dt.datetime.now(dt.timezone.utc)
    with loaded_database(args):
        try:
            load_avg = os.getloadavg()[0]
        except OSError:
            load_avg = float("nan")
        plain = run_child(args, "plain")
        reset_sync_times(args)
        traced = run_child(args, "traced")
        calls = Counter(plain["calls"])
        changed = sum(1 for i in range(args.jobs) if i % 100 < args.changed_pct)
        provider = calls["list"] + calls["describe"]
        peak_mb = plain["hwm_after_kib"] / 1024
        print(f"\n{started:%Y-%m-%d %H:%M} UTC · {args.jobs:,} active jobs on {args.backends} backend(s) · "
              f"{changed:,} changed ({args.changed_pct} %) · load average before {load_avg:.2f} · "
              f"{os.cpu_count()} CPUs\n")
        print(f"jobs looked at            {plain['looked_at']:,}")
        print(f"sync pass                 {plain['seconds']:.1f} s ({plain['seconds'] / plain['looked_at'] * 1000:.2f} ms per job)")
        print(f"list + describe calls     {provider:,}  (list {calls['list']}, describe {calls['describe']}): "
              f"{provider / max(1, changed):.2f} per changed job, {provider / args.jobs:.4f} per active job")
        print(f"logs calls                {calls['logs']:,}  ({calls['logs'] / args.jobs:.2f} per active job)")
        print(f"cancel calls              {calls['cancel']:,}")
        print(f"peak RSS (VmHWM)          {plain['hwm_before_kib'] / 1024:.1f} MB after Django setup → "
              f"{peak_mb:.1f} MB after the pass (target ≤ {PEAK_MB_TARGET:.0f} MB: "
              f"{'ok' if peak_mb <= PEAK_MB_TARGET else 'MISS'})")
        print(f"Python heap peak          {traced['heap_peak_bytes'] / 2**20:.1f} MB during the pass (tracemalloc, "
              f"second run; its VmHWM {traced['hwm_after_kib'] / 1024:.1f} MB includes tracemalloc's own)")
        missed = peak_mb > PEAK_MB_TARGET
        return 1 if missed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
