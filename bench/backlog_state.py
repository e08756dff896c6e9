"""A job's state and newest point behind a log backlog (issue 29): "a job's state and its latest point are
visible within one sync interval of being written, however large the backlog behind them".

    nice -n 19 .venv/bin/python bench/backlog_state.py                    # 200,000 records × 8 ranks
    nice -n 19 .venv/bin/python bench/backlog_state.py --records 20000 --ranks 64

What it does, in one run:

1. creates a throwaway PostgreSQL database (``--db-name``) and applies every migration;
2. registers a backend kind of its own (this module's :class:`BacklogBackend`, in ``cloud_adapters.registry``
   for this process only) that plays back a finished run's whole log: ``--records`` trainer step records of
   ``--ranks`` ranks (``bench/metric_scale.py``'s generator: the records as the trainer prints them, an epoch
   record every 1,000 steps), then the trainer's ``completed`` record and a last plain line, at most 2,000 lines a
   ``logs()`` call (as the GPU box's adapter returns them), its cursor the line number; ``describe_many`` says
   SUCCEEDED from the first call (the run had ended before the first sync read any of its log);
3. one RUNNING job on that backend that has read none of it, then sync passes (``jobs.sync.backend_sync``, the body
   of the periodic task) one after the other, as beat would start them back to back, until the job reads SUCCEEDED
   and its newest point (``train_loss`` at the last step, through ``jobs.metric_store.last``) is stored;
4. meanwhile a thread with its own database connection looks every ``--every`` seconds at what a request would
   see (committed rows): the job's state, the newest ``train_loss`` step and ``final_metrics``; prints the seconds
   from the first pass's start until each became visible, the passes it took and each pass's length, beside the
   sync interval (``TRAINBOARD_SYNC_INTERVAL_S``);
5. drops the database (unless ``--keep``).

Nothing is asserted; ``--check`` exits 1 when either became visible later than one sync interval after the first
pass started. Times are wall-clock on whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import threading
import time
from decimal import Decimal
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.job_list import bench_database  # noqa: E402

DB_PREFIX = "trainboard_bench_backlog"
LINES_PER_CALL = 2000
MAX_PASSES = 10_000

try:  # The registry builds the adapter from this module by name: the same class whether run or imported.
    from cloud_adapters.base import Backend, Capabilities, JobHandle, JobState, JobStatus
except ImportError:  # pragma: no cover - run from elsewhere than the repository root
    raise


class BacklogBackend(Backend):
    """A finished run whose whole log is still unread: :data:`LOG` played back ``LINES_PER_CALL`` lines a call."""

    kind = "benchlog"
    queue = "celery"
    LOG: list[str] = []
    ENDED: dt.datetime | None = None
    STARTED: dt.datetime | None = None
    calls = {"logs": 0, "describe_many": 0}

    @property
    def capabilities(self):
        return Capabilities(max_nodes=1, max_procs_per_node=512)

    def submit(self, spec):  # pragma: no cover - the job is made as submitted
        raise AssertionError("not submitted here")

    def describe(self, handle):  # pragma: no cover - describe_many is used
        raise AssertionError("describe_many is used")

    def describe_many(self, handles, changed_since=None):
        type(self).calls["describe_many"] += 1
        return {h.job_name: JobStatus(JobState.SUCCEEDED, raw_state="Completed", started_at=type(self).STARTED,
                                      ended_at=type(self).ENDED, instance_count=1) for h in handles}

    def cancel(self, handle):  # pragma: no cover - never cancelled
        pass

    def logs(self, handle, cursor=""):
        type(self).calls["logs"] += 1
        at = int(cursor or 0)
        lines = type(self).LOG[at:at + LINES_PER_CALL]
        return lines, str(at + len(lines))

    def price(self, instance_type="", spot=False):
        return 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200_000, help="unread trainer step records (default 200,000)")
    p.add_argument("--ranks", type=int, default=8, help="ranks of the job (default 8)")
    p.add_argument("--every", type=float, default=0.1, help="seconds between two looks of the watcher (default 0.1)")
    p.add_argument("--server", default=os.environ.get("BENCH_PG_SERVER", "postgres://postgres@127.0.0.1:5432"),
                   help="PostgreSQL server URL without a database name")
    p.add_argument("--db-name", default=DB_PREFIX, help="throwaway database (dropped and created)")
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    p.add_argument("--check", action="store_true", help="exit 1 if either is visible later than one sync interval")
    p.add_argument("--seed", type=int, default=29)
    args = p.parse_args(argv)
    if args.records < 1 or args.ranks < 1 or args.every <= 0:
        p.error("--records and --ranks must be at least 1, --every above 0")
    if not args.db_name.startswith(DB_PREFIX):
        p.error(f"--db-name must start with {DB_PREFIX!r}, got {args.db_name!r}")
    return args


def make_log(args: argparse.Namespace, started: dt.datetime) -> tuple[list[str], int]:
    """The run's whole log (launcher lines, the records, ``completed``, a last line) and its last step."""
    from bench.metric_scale import generate_history
    from trainer_pkg.metrics import format_metric_line

    lines = ["[launch] platform: local (torchrun --standalone)",
             format_metric_line({"event": "started", "step": 1, "epoch": 0, "time": started.timestamp(),
                                 "world_size": args.ranks})]
    generate_history(0, steps=args.records, ranks=args.ranks, epoch_steps=1000, started=started, seed=args.seed,
                     write_points=None, log=None, on_record=lines.append)
    end = started.timestamp() + args.records + 1
    lines += [format_metric_line({"event": "completed", "step": args.records, "epoch": (args.records - 1) // 1000,
                                  "time": end}),
              "[trainer] done"]
    return lines, args.records


def watch(job_id: int, last_step: int, t0: list[float], seen: dict[str, float], stop: threading.Event,
          every: float) -> None:
    """What a request sees, from a connection of its own: the seconds (since ``t0[0]``) at which the job first
    read SUCCEEDED (``state``), its train_loss reached ``last_step`` (``newest``) and final_metrics held a
    train_loss (``final``)."""
    from django.db import connection

    from jobs import metric_store
    from jobs.models import TrainingJob

    try:
        while not stop.is_set():
            job = TrainingJob.objects.only("state", "final_metrics").get(pk=job_id)
            now = time.perf_counter() - t0[0]
            if "state" not in seen and job.state == "SUCCEEDED":
                seen["state"] = now
            if "final" not in seen and (job.final_metrics or {}).get("train_loss") is not None:
                seen["final"] = now
            if "newest" not in seen:
                newest = metric_store.last(job_id, "train_loss")
                if newest is not None and newest[0] >= last_step:
                    seen["newest"] = time.perf_counter() - t0[0]
            if {"state", "newest"} <= set(seen):
                return
            stop.wait(every)
    finally:
        connection.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with bench_database(args.server, args.db_name, reuse=False, keep=args.keep):
        from django.conf import settings
        from django.contrib.auth import get_user_model

        from cloud_adapters import registry
        from jobs import sync
        from jobs.models import ComputeBackend, Dataset, JobLogLine, ModelSpec, TrainingJob

        registry.KINDS["benchlog"] = registry.KindInfo(BacklogBackend.__module__, "BacklogBackend", "Backlog (bench)")
        user = get_user_model().objects.create_user("blbench", "blbench@example.com", "blbench-pw-1")
        dataset = Dataset.objects.create(owner=user, name="digits", format="builtin", builtin_name="digits")
        model = ModelSpec.objects.create(owner=user, name="digits-cnn", architecture="cnn", params={})
        backend = ComputeBackend.objects.create(owner=user, name="backlog", kind="benchlog", config={})
        now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        started = now - dt.timedelta(seconds=args.records + 120)
        t_gen = time.perf_counter()
        BacklogBackend.LOG, last_step = make_log(args, started)
        BacklogBackend.STARTED, BacklogBackend.ENDED = started, now - dt.timedelta(seconds=60)
        print(f"log: {len(BacklogBackend.LOG):,} lines ({args.records:,} step records × {args.ranks} ranks), "
              f"made in {time.perf_counter() - t_gen:.1f} s", flush=True)
        job = TrainingJob.objects.create(
            owner=user, name="backlog", dataset=dataset, model_spec=model, backend=backend,
            config={"model": {"arch": "cnn"}, "data": {"name": "digits"}, "train": {"epochs": 1}}, nodes=1,
            procs_per_node=args.ranks, state="RUNNING", provider_job_name="tb-backlog",
            provider_handle=JobHandle(provider="benchlog", job_name="tb-backlog", provider_job_id="bl-1").to_dict(),
            hourly_price_usd=Decimal("2.0000"), submitted_at=started, started_at=started, first_step_at=started,
            state_entered_at=started, last_synced_at=started)

        t0: list[float] = [0.0]
        seen: dict[str, float] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(job.pk, last_step, t0, seen, stop, args.every), daemon=True)
        try:
            load_before = os.getloadavg()[0]
        except OSError:
            load_before = float("nan")
        t0[0] = time.perf_counter()
        watcher.start()
        passes: list[float] = []
        while len(passes) < MAX_PASSES:
            p0 = time.perf_counter()
            sync.backend_sync(backend_id=backend.pk)
            passes.append(time.perf_counter() - p0)
            job.refresh_from_db()
            if len(passes) <= 3 or len(passes) % 10 == 0 or not getattr(job, "log_backlog", False):
                print(f"  pass {len(passes)}: {passes[-1]:.1f} s, state {job.state}, log cursor {job.log_cursor} "
                      f"(at {time.perf_counter() - t0[0]:.1f} s)", flush=True)
            if job.state == "SUCCEEDED" and int(job.log_cursor or 0) >= len(BacklogBackend.LOG):
                break
        watcher.join(timeout=30)
        stop.set()
        interval = float(settings.TRAINBOARD_SYNC_INTERVAL_S)
        try:
            load_after = os.getloadavg()[0]
        except OSError:
            load_after = float("nan")
        lines = JobLogLine.objects.filter(job=job).count()
        print(f"\n{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC · {os.cpu_count()} CPUs · load average "
              f"{load_before:.2f} before, {load_after:.2f} after · sync interval {interval:g} s")
        print(f"backlog: {len(BacklogBackend.LOG):,} lines ({args.records:,} records × {args.ranks} ranks), "
              f"{BacklogBackend.calls['logs']:,} logs() calls, {lines:,} log lines stored")
        print(f"passes: {len(passes)}, {sum(passes):.1f} s in all (first {', '.join(f'{s:.1f}' for s in passes[:5])} s; "
              f"longest {max(passes):.1f} s)")
        misses = []
        for key, what in (("state", "state SUCCEEDED"), ("newest", f"newest point (train_loss at step {last_step:,})"),
                          ("final", "final_metrics")):
            at = seen.get(key)
            print(f"  {what:<40} visible after {'never' if at is None else f'{at:,.1f} s'}")
            if key != "final" and (at is None or at > interval):
                misses.append(f"{what}: {'never' if at is None else f'{at:,.1f} s'} > one sync interval ({interval:g} s)")
        print("targets missed:" + ("".join(f"\n  {m}" for m in misses) if misses else " none"))
        return 1 if misses and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
