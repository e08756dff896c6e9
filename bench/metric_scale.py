"""Metric history at the scale of real runs (issue 29): the job page, its chart poll and the API read
against the length of the run, with the SQL queries, the web process's memory and the bytes per point.

    .venv/bin/python bench/metric_scale.py                          # 1,000 / 10,000 / 100,000 steps × 8 ranks
    .venv/bin/python bench/metric_scale.py --quick                  # 1,000 / 10,000 steps × 8 ranks
    .venv/bin/python bench/metric_scale.py --steps 1000,100000 --requests 1 --json ms.json
    .venv/bin/python bench/metric_scale.py --keep --steps 1000,10000         # then, on the kept database:
    .venv/bin/python bench/metric_scale.py --reuse --keep --steps 1000,10000,100000 --urls poll,api

What it does, in one run:

1. creates a throwaway PostgreSQL database (``--db-name``, default ``trainboard_bench_ms``, on
   ``--server``, default ``postgres://postgres@127.0.0.1:5432``) and applies every migration;
2. for each size of ``--steps`` creates one RUNNING job of ``--ranks`` ranks (ORM) and stores its
   history as the sync stores the trainer's records (``--load sync``, the default: each record's log line
   parsed, ``jobs.sync.metric_point_tuples``, ``jobs.metric_store.store`` per pass of ``--pass-steps``
   records: full chunks for a backlog, rows for the rest, buckets folded from arrays, compaction; timed:
   points/s), or (``--load copy``, today's storage before chunks) one row per point by COPY then folded:
   per step 4 global points (train_loss, train_accuracy, samples_per_s, lr; rank NULL) and 5 per-rank
   timing points per rank (rank_samples_per_s, rank_step_time_s, rank_data_wait_s, rank_compute_s,
   rank_sync_wait_s), val_loss and val_accuracy once per epoch (``--epoch-steps``), NULL values where a
   step was not finite (a few gaps), one loss spike, the last rank slower than the others (a
   straggler); and, unless ``--no-logs``, the job's log as the sync stores it: each record again as a
   ``TRAINBOARD_METRIC`` line, a few launcher lines and one plain line per epoch (by COPY). Then
   (``--compare-steps``) ingestion from the same trainer records through today's row path
   (``MetricPoint.objects.bulk_create``) and the sync's path, points/s and their ratio in this run; and
   VACUUM ANALYZE;
3. for each size and each URL (``--urls``: page ``/jobs/<pk>/``; chart ``/jobs/<pk>/metrics.json``,
   every line whole (a page's first read); poll the same with ``?after=&widths=&attempt=`` as the
   page's job.js asks, for what is new since :data:`POLL_NEW_STEPS` steps before the last; live
   ``/jobs/<pk>/live/``, the fragment htmx re-fetches every 2 s before each poll; api ``/api/jobs/<pk>/``), in-process with Django's test ``Client``
   (middleware, view, template or serializer, database; no HTTP server): ``--warmups`` requests (the
   first request's SQL is captured with ``CaptureQueriesContext``: count, summed time, the slowest),
   then up to ``--requests`` timed ones, stopping early once ``--budget-s`` seconds went into that URL
   (at least one timed request). The web process's memory: the peak RSS during each request less the
   RSS just before it (the kernel's high-water mark, reset through ``/proc/self/clear_refs``), and the
   RSS kept after the URL's requests;
4. prints the table, each time's ratio to the smallest size's (1,000 steps by default) from this same
   run, the storage (``pg_total_relation_size`` of the points' and the buckets' tables, indexes and TOAST
   included, after VACUUM ANALYZE, of the points' rows, the chunks and the buckets ÷ the points), and
   which of issue 29's targets are missed: ingestion ≥ 200,000 points/s, job
   page ≤ 300 ms, poll ≤ 50 ms, API retrieve ≤ 50 ms (p50), each ≤ 2× its time at the smallest size,
   ≤ 50 MB of RSS per request, ≤ 20 bytes per point;
5. drops the database (unless ``--keep``).

Nothing is asserted: it reports (exit 0), or with ``--check`` exits 1 when a target is missed;
``--json FILE`` writes the figures. Times are wall-clock on whatever else the machine is doing. On
today's code the largest size is slow (minutes per job-page request at 100,000 steps): ``--budget-s``
bounds the timed requests per URL, ``--urls`` and ``--steps`` pick what to measure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from decimal import Decimal
from typing import Any, Callable, TextIO

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import median  # noqa: E402
from bench.job_list import bench_database  # noqa: E402

GLOBAL_STEP_METRICS = ("train_loss", "train_accuracy", "samples_per_s", "lr")
EPOCH_METRICS = ("val_loss", "val_accuracy")
RANK_STEP_METRICS = ("rank_samples_per_s", "rank_step_time_s", "rank_data_wait_s", "rank_compute_s",
                     "rank_sync_wait_s")
BATCH_PER_RANK = 32

# (label, what, target p50 ms or None). "live" has no target of its own in issue 29; it is reported
# because the page fetches it before every poll.
URLS = (("page", "job page", 300.0), ("chart", "chart data (full)", None), ("poll", "chart poll", 50.0),
        ("live", "live fragment", None), ("api", "API retrieve", 50.0))
POLL_NEW_STEPS = 10
"""The poll asks for what is new since this many steps before the run's last (as job.js asks after a sync)."""
COMPARE_URLS = (("compare", "compare page"), ("compare_api", "compare API"))
COMPARE_MS = 1000.0
"""Issue 29: the comparison of 10 jobs of 1,000,000 steps × 64 ranks within 1 s."""
RATIO_TARGET = 2.0
RSS_PER_REQUEST_MB = 50.0
BYTES_PER_POINT = 20.0
INGEST_POINTS_PER_S = 200_000
DB_PREFIX = "trainboard_bench_ms"
CHUNK_STEPS = 2_000  # steps per COPY write: bounded memory at any run length


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="1000,10000,100000",
                   help="comma-separated run lengths in optimizer steps, one job each (default 1000,10000,100000)")
    p.add_argument("--ranks", type=int, default=8, help="ranks of every job (default 8)")
    p.add_argument("--epoch-steps", type=int, default=1000, help="steps per epoch: val_* points (default 1,000)")
    p.add_argument("--requests", type=int, default=5, help="timed requests per URL at most (default 5)")
    p.add_argument("--warmups", type=int, default=1, help="untimed requests per URL first (default 1)")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="no further timed request of a URL once its requests took this long (default 60 s; "
                        "at least one is timed)")
    p.add_argument("--urls", default="page,chart,poll,live,api",
                   help="which URLs, comma-separated from page, chart, poll, live, api (default all)")
    p.add_argument("--quick", action="store_true", help="--steps 1000,10000")
    p.add_argument("--no-logs", action="store_true", help="no JobLogLine rows (the log tail then reads nothing)")
    p.add_argument("--load", choices=("sync", "bulk", "copy"), default="sync",
                   help="sync (default): the points stored through the sync's path (jobs.metric_store.store: "
                        "chunks for a backlog, rows for the rest, compaction); bulk: the same history generated "
                        "as arrays, a pass at a time, stored by jobs.metric_store.store_series (what store does "
                        "once it has grouped a pass's point tuples: the same chunks, rows, buckets and "
                        "across-ranks series, without the records' JSON; several times faster, for 1,000,000 "
                        "steps × 64 ranks); copy: one row per point by COPY, then folded (today's storage, for a "
                        "before figure)")
    p.add_argument("--pass-steps", type=int, default=2000,
                   help="records (steps) per stored batch in the sync load and the ingestion comparison (default 2,000: a "
                        "provider logs() call brings at most 2,000 lines, stored in a transaction of its own)")
    p.add_argument("--compare-steps", type=int, default=8192,
                   help="steps of the ingestion comparison, rows vs the sync path (default 8,192; 0: skip it)")
    p.add_argument("--compare", type=int, default=0, metavar="N",
                   help="also time the comparison of N jobs of the largest size (/jobs/compare/ and /api/jobs/compare/; "
                        "target ≤ 1 s): the largest job and N − 1 copies of its stored history (see compare_jobs; "
                        "default 0: not measured)")
    p.add_argument("--slow-queries", type=int, default=3,
                   help="print the slowest N SQL queries of each URL at the largest size (default 3)")
    p.add_argument("--server", default=os.environ.get("BENCH_PG_SERVER", "postgres://postgres@127.0.0.1:5432"),
                   help="PostgreSQL server URL without a database name")
    p.add_argument("--db-name", default="trainboard_bench_ms", help="throwaway database (dropped and created)")
    p.add_argument("--keep", action="store_true", help="keep the database afterwards (to EXPLAIN by hand)")
    p.add_argument("--reuse", action="store_true",
                   help="use the kept database: load only the sizes it lacks")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    p.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    p.add_argument("--seed", type=int, default=29)
    args = p.parse_args(argv)
    if args.quick:
        args.steps = "1000,10000"
    try:
        args.sizes = sorted({int(s.replace("_", "")) for s in args.steps.split(",") if s.strip()})
    except ValueError:
        p.error(f"--steps is a comma-separated list of whole numbers, got {args.steps!r}")
    if not args.sizes or args.sizes[0] < 1:
        p.error("--steps needs at least one size, each at least 1")
    args.url_labels = [u.strip() for u in args.urls.split(",") if u.strip()]
    unknown = sorted(set(args.url_labels) - {label for label, _, _ in URLS})
    if unknown or not args.url_labels:
        p.error(f"--urls takes page, chart, poll, live, api; got {args.urls!r}")
    if args.compare < 0 or args.compare == 1:
        p.error("--compare is 0 (not measured) or at least 2 jobs")
    if args.compare_steps < 0:
        p.error("--compare-steps must be at least 0")
    for name in ("ranks", "epoch_steps", "requests", "pass_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmups < 0 or args.budget_s <= 0:
        p.error("--warmups must be at least 0 and --budget-s above 0")
    if not args.db_name.startswith(DB_PREFIX):
        # The script drops this database: never one that is not a benchmark's.
        p.error(f"--db-name must start with {DB_PREFIX!r}, got {args.db_name!r}")
    return args


# --- the history ---------------------------------------------------------------------------------

def job_name(steps: int, ranks: int) -> str:
    return f"metric-scale-{steps}x{ranks}"


def _special_steps(steps: int, ranks: int) -> dict[str, Any]:
    """Where the run is not smooth: steps whose train_loss was not finite (three short gaps), one
    loss spike (what uniform thinning drops), one rank's non-finite step time."""
    gaps = set()
    for fraction in (0.25, 0.5, 0.75):
        at = max(1, int(steps * fraction))
        gaps.update(range(at, min(steps, at + 2) + 1))
    return {"loss_gaps": gaps, "spike": max(1, int(steps * 0.4)) + 1,
            "rank_gap": (max(1, int(steps * 0.6)) + 2, ranks // 2)}


def _number(value: float | None) -> str:
    return "\\N" if value is None else repr(value)


def generate_history(job_id: int, *, steps: int, ranks: int, epoch_steps: int, started: dt.datetime,
                     seed: int, write_points: Callable[[str], None] | None, log: TextIO | None,
                     on_record: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the job's MetricPoint rows in COPY text format (columns job_id, name, step, epoch, rank,
    value, recorded_at) to ``write_points``, in the order the sync stores them (step by step), and,
    with ``log``, its log lines (job_id, seq, text, is_metric in COPY text format). One record a second from
    ``started``. ``on_record``: called with each metric record's log line (``TRAINBOARD_METRIC {...}``)
    as the trainer printed it, in order (the sync's input). Returns ``{"points", "log_lines",
    "final_metrics", "rank_gap": (step, rank)}``."""
    from trainer_pkg.metrics import METRIC_PREFIX, format_metric_line

    rng = random.Random(seed * 1_000_003 + steps)
    special = _special_steps(steps, ranks)
    loss_gaps, spike, (gap_step, gap_rank) = special["loss_gaps"], special["spike"], special["rank_gap"]
    t_start = started.timestamp()
    points = 0
    seq = 0
    final: dict[str, float | None] = {}

    def log_line(text: str) -> None:
        nonlocal seq
        if log is not None:
            # COPY text: a backslash escapes; is_metric as JobLogLine's bulk_create sets it.
            log.write(f"{job_id}\t{seq}\t{text.replace(chr(92), chr(92) * 2)}\t{'t' if METRIC_PREFIX in text else 'f'}\n")
        seq += 1

    launch = [f"[launch] rank {r}: world size {ranks}, backend gloo, torchrun" for r in range(ranks)]
    for text in ["[launch] platform: local (torchrun --standalone)", *launch,
                 "[trainer] no checkpoint found: starting at step 1", "[trainer] data: digits (built-in)"]:
        log_line(text)

    buf: list[str] = []
    for step in range(1, steps + 1):
        epoch = (step - 1) // epoch_steps
        progress = step / steps
        when = dt.datetime.fromtimestamp(t_start + step, tz=dt.timezone.utc).isoformat()
        head = f"{job_id}\t"
        tail = f"\t{step}\t{epoch}\t"
        loss = 2.3 * math.exp(-4.0 * progress) + 0.05 + rng.gauss(0.0, 0.02)
        if step == spike:
            loss *= 6.0
        values: dict[str, Any] = {
            "train_loss": None if step in loss_gaps else loss,
            "train_accuracy": min(1.0, max(0.0, 1.0 - loss / 2.5 + rng.gauss(0.0, 0.01))),
            "lr": 0.05 * 0.5 * (1.0 + math.cos(math.pi * progress)),
        }
        compute = [0.011 * (1.0 + rng.gauss(0.0, 0.03)) * (1.6 if r == ranks - 1 else 1.0) for r in range(ranks)]
        data_wait = [0.002 * (1.0 + abs(rng.gauss(0.0, 0.2))) for _ in range(ranks)]
        step_time = max(d + c for d, c in zip(data_wait, compute)) + 0.025  # the all-reduce waits for the slowest
        rank_values = {
            "rank_samples_per_s": [BATCH_PER_RANK / step_time] * ranks,
            "rank_step_time_s": [step_time] * ranks,
            "rank_data_wait_s": data_wait,
            "rank_compute_s": compute,
            "rank_sync_wait_s": [step_time - c for c in compute],
        }
        if step == gap_step:
            rank_values["rank_step_time_s"] = [None if r == gap_rank else step_time for r in range(ranks)]
        values["samples_per_s"] = BATCH_PER_RANK * ranks / step_time
        for name in GLOBAL_STEP_METRICS:
            buf.append(f"{head}{name}{tail}\\N\t{_number(values[name])}\t{when}\n")
            final[name] = values[name]
        for name in RANK_STEP_METRICS:
            for rank, value in enumerate(rank_values[name]):
                buf.append(f"{head}{name}{tail}{rank}\t{_number(value)}\t{when}\n")
        points += len(GLOBAL_STEP_METRICS) + len(RANK_STEP_METRICS) * ranks
        record = {"event": "step", "step": step, "epoch": epoch, "time": t_start + step, **values, **rank_values}
        # What the trainer printed where a value was not finite (format_metric_line lists it under "nonfinite").
        if step in loss_gaps:
            record["train_loss"] = float("nan")
        if step == gap_step:
            record["rank_step_time_s"] = [float("nan") if v is None else v for v in rank_values["rank_step_time_s"]]
        text = format_metric_line(record)
        log_line(text)
        if on_record is not None:
            on_record(text)
        if step % epoch_steps == 0:
            val = {"val_loss": loss * 1.08 + rng.gauss(0.0, 0.01), "val_accuracy": values["train_accuracy"] * 0.98}
            for name in EPOCH_METRICS:
                buf.append(f"{head}{name}{tail}\\N\t{_number(val[name])}\t{when}\n")
                final[name] = val[name]
            points += len(EPOCH_METRICS)
            text = format_metric_line({"event": "epoch", "step": step, "epoch": epoch, "time": t_start + step, **val})
            log_line(text)
            if on_record is not None:
                on_record(text)
            log_line(f"[trainer] epoch {epoch + 1} done at step {step:,}: val_loss {val['val_loss']:.4f}, "
                     f"checkpoint saved")
        if step % CHUNK_STEPS == 0 or step == steps:
            if write_points is not None:
                write_points("".join(buf))
            buf.clear()
    return {"points": points, "log_lines": seq, "final_metrics": final, "rank_gap": (gap_step, gap_rank)}


def _owner_and_world():
    """The benchmark's user and the dataset, model and backend its jobs use (made once)."""
    from django.contrib.auth import get_user_model

    from jobs.models import ComputeBackend, Dataset, ModelSpec

    User = get_user_model()
    user = User.objects.filter(username="msbench").first()
    if user is None:
        user = User.objects.create_user("msbench", "msbench@example.com", "msbench-pw-1")
    dataset, _ = Dataset.objects.get_or_create(owner=user, name="digits",
                                               defaults={"format": "builtin", "builtin_name": "digits"})
    model, _ = ModelSpec.objects.get_or_create(owner=user, name="digits-cnn",
                                               defaults={"architecture": "cnn", "params": {}})
    backend, _ = ComputeBackend.objects.get_or_create(owner=user, name="local",
                                                      defaults={"kind": "gpubox", "config": {}})
    return user, dataset, model, backend


def load_size(args: argparse.Namespace, steps: int, world) -> dict[str, Any]:
    """One RUNNING job of ``steps`` steps: its row (ORM), its points and log lines (COPY)."""
    from django.db import connection

    from jobs.metric_buckets import fold_stored_points
    from jobs.models import JobLogLine, MetricPoint, TrainingJob

    user, dataset, model, backend = world
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    started = now - dt.timedelta(seconds=steps + 60)
    epochs_so_far = max(1, steps // args.epoch_steps)
    job = TrainingJob.objects.create(
        owner=user, name=job_name(steps, args.ranks), dataset=dataset, model_spec=model, backend=backend,
        # Half-way through its epochs, so the headline has a fraction and an ETA to compute.
        config={"model": {"arch": "cnn"}, "data": {"name": "digits"},
                "train": {"epochs": 2 * epochs_so_far, "batch_size": BATCH_PER_RANK}},
        nodes=1, procs_per_node=args.ranks, state="RUNNING", provider_job_name=f"tb-{job_name(steps, args.ranks)}",
        hourly_price_usd=Decimal("2.0000"), submitted_at=started - dt.timedelta(seconds=30), started_at=started,
        first_step_at=started, state_entered_at=started, last_synced_at=now, created_at=started,
    )
    if args.load == "sync":
        return {"job_id": job.pk, **_load_through_sync(args, steps, job, started)}
    if args.load == "bulk":
        return {"job_id": job.pk, **_load_bulk(args, steps, job, started)}
    t0 = time.perf_counter()
    total = {"rows": 0, "next": max(1, steps // 10)}
    rows_per_step = len(GLOBAL_STEP_METRICS) + len(RANK_STEP_METRICS) * args.ranks
    cols = ["job_id", "name", "step", "epoch", "rank", "value", "recorded_at"]
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log, connection.cursor() as cur:
        # COPY text written a chunk of steps at a time: several times faster than a row at a time.
        with cur.cursor.copy(f"COPY {MetricPoint._meta.db_table} ({', '.join(cols)}) FROM STDIN") as copy:
            def write_points(text: str) -> None:
                copy.write(text)
                total["rows"] += text.count("\n")
                done = total["rows"] // rows_per_step
                if done >= total["next"] or done >= steps:
                    elapsed = time.perf_counter() - t0
                    print(f"  {steps:,} steps: {min(done, steps):,} loaded, {total['rows']:,} points, {elapsed:.1f} s "
                          f"({total['rows'] / max(elapsed, 1e-9):,.0f} points/s)", flush=True)
                    total["next"] += max(1, steps // 10)

            made = generate_history(job.pk, steps=steps, ranks=args.ranks, epoch_steps=args.epoch_steps,
                                    started=started, seed=args.seed, write_points=write_points,
                                    log=None if args.no_logs else log)
        t_points = time.perf_counter() - t0
        t_logs = _copy_logs(cur, log) if not args.no_logs else 0.0
    TrainingJob.objects.filter(pk=job.pk).update(final_metrics=made["final_metrics"])
    t2 = time.perf_counter()
    folded = fold_stored_points(job.pk)  # the buckets, as storing the points through the ORM folds them
    t_fold = time.perf_counter() - t2
    print(f"  {steps:,} steps × {args.ranks} ranks: job {job.pk}, {made['points']:,} points in {t_points:.1f} s"
          + ("" if args.no_logs else f", {made['log_lines']:,} log lines in {t_logs:.1f} s")
          + f"; folded into buckets in {t_fold:.1f} s ({folded / max(t_fold, 1e-9):,.0f} points/s)", flush=True)
    return {"job_id": job.pk, "points": made["points"], "log_lines": 0 if args.no_logs else made["log_lines"],
            "load_points_s": t_points, "load_logs_s": t_logs, "fold_s": t_fold,
            "fold_points_per_s": folded / max(t_fold, 1e-9)}


def _copy_logs(cur, log: TextIO) -> float:
    """COPY the log lines ``generate_history`` wrote to ``log``; returns the seconds it took."""
    from jobs.models import JobLogLine

    t1 = time.perf_counter()
    log.seek(0)
    with cur.cursor.copy(f"COPY {JobLogLine._meta.db_table} (job_id, seq, text, is_metric) FROM STDIN") as copy:
        while block := log.read(1 << 20):
            copy.write(block)
    return time.perf_counter() - t1


def _passes(lines: list[str], pass_steps: int) -> list[list[str]]:
    """``lines`` (metric records in order) cut into sync passes of ``pass_steps`` step records each
    (an epoch record goes with the pass of its step)."""
    out: list[list[str]] = [[]]
    steps = 0
    for line in lines:
        if '"event":"step"' in line:
            if steps == pass_steps:
                out.append([])
                steps = 0
            steps += 1
        out[-1].append(line)
    return [p for p in out if p]


def ingest_rows(job, lines: list[str], now: dt.datetime) -> int:
    """Today's row path for one pass: parse, a ``MetricPoint`` per point, ``MetricPoint.objects.bulk_create``
    (which folds the buckets point by point), in one transaction. Returns the points stored."""
    from django.db import transaction

    from jobs.models import MetricPoint
    from jobs.sync import metric_points_from_record
    from trainer_pkg.metrics import parse_metric_line

    points = [p for line in lines for p in metric_points_from_record(job, parse_metric_line(line), now)]
    with transaction.atomic():
        MetricPoint.objects.bulk_create(points)
    return len(points)


def ingest_sync(job, lines: list[str], now: dt.datetime) -> int:
    """The sync's path for one pass (``jobs.sync._ingest_lines`` less the log lines): parse, point tuples,
    ``jobs.metric_store.store`` (full chunks directly for a backlog, buckets folded from arrays, then
    compaction), in one transaction. Returns the points stored."""
    from django.db import transaction

    from jobs import metric_store
    from jobs.sync import metric_point_tuples
    from trainer_pkg.metrics import parse_metric_line

    points = [p for line in lines for p in metric_point_tuples(parse_metric_line(line), now)]
    with transaction.atomic():
        metric_store.store(job.pk, points)
    return len(points)


def _load_through_sync(args: argparse.Namespace, steps: int, job, started: dt.datetime) -> dict[str, Any]:
    """The job's points stored as the sync stores them (:func:`ingest_sync`, passes of ``--pass-steps``
    records), its log lines by COPY; ingestion timed apart from generating the records. The records are
    stored a pass at a time as they are generated (memory bounded by one pass at any run length: a
    1,000,000-step × 64-rank history is ~7 GB of record lines)."""
    from django.db import connection

    from jobs.models import TrainingJob

    now = dt.datetime.now(dt.timezone.utc)
    state = {"stored": 0, "seconds": 0.0, "pending": [], "steps": 0, "next": max(1, steps // 20),
             "t0": time.perf_counter()}

    def flush() -> None:
        if not state["pending"]:
            return
        t0 = time.perf_counter()
        state["stored"] += ingest_sync(job, state["pending"], now)
        state["seconds"] += time.perf_counter() - t0
        state["pending"] = []
        if state["steps"] >= state["next"]:
            wall = time.perf_counter() - state["t0"]
            print(f"  {steps:,} steps: {state['steps']:,} stored, {state['stored']:,} points, ingest "
                  f"{state['seconds']:.0f} s ({state['stored'] / max(state['seconds'], 1e-9):,.0f} points/s), "
                  f"wall {wall:.0f} s", flush=True)
            state["next"] += max(1, steps // 20)

    def on_record(line: str) -> None:
        # The same cut as _passes: a pass is --pass-steps step records; an epoch record goes with its step's pass.
        if '"event":"step"' in line:
            if state["steps"] and state["steps"] % args.pass_steps == 0:
                flush()
            state["steps"] += 1
        state["pending"].append(line)

    with tempfile.TemporaryFile("w+", encoding="utf-8") as log, connection.cursor() as cur:
        made = generate_history(job.pk, steps=steps, ranks=args.ranks, epoch_steps=args.epoch_steps, started=started,
                                seed=args.seed, write_points=None, log=None if args.no_logs else log,
                                on_record=on_record)
        flush()
        t_logs = _copy_logs(cur, log) if not args.no_logs else 0.0
    stored, t_points = state["stored"], state["seconds"]
    # The sync adds the min, median and max across ranks of each per-rank timing (global series).
    assert stored >= made["points"], (stored, made["points"])
    TrainingJob.objects.filter(pk=job.pk).update(final_metrics=made["final_metrics"])
    print(f"  {steps:,} steps × {args.ranks} ranks: job {job.pk}, {stored:,} points stored through the sync's path "
          f"in {t_points:.1f} s ({stored / max(t_points, 1e-9):,.0f} points/s, passes of {args.pass_steps:,} records; "
          f"wall with generating the records {time.perf_counter() - state['t0']:.0f} s)"
          + ("" if args.no_logs else f", {made['log_lines']:,} log lines in {t_logs:.1f} s"), flush=True)
    return {"points": stored, "log_lines": 0 if args.no_logs else made["log_lines"], "load_points_s": t_points,
            "load_logs_s": t_logs, "ingest_points_per_s": stored / max(t_points, 1e-9)}


def generate_arrays(*, steps: int, ranks: int, epoch_steps: int, started: dt.datetime, seed: int,
                    pass_steps: int):
    """The history of :func:`generate_history` (the same series, shapes, gaps, spike and straggler, the
    values drawn from numpy's generator instead of ``random``), a pass of ``pass_steps`` steps at a time, as
    the arrays the sync builds from that pass's records: yields ``(last step, {(name, rank or None): Series})``,
    the global series (rank None), every rank's series, the min / median / max across ranks of each per-rank
    timing over its finite values (``jobs.sync.metric_point_tuples``) and, at each epoch's end, val_loss and
    val_accuracy; a value the trainer reported as not finite is a missing point. Returns nothing; the final
    values are in the last pass's arrays."""
    import numpy as np

    from jobs.metric_fold import ACROSS_RANKS, across_ranks_name
    from jobs.metric_store import Series

    rng = np.random.default_rng(seed * 1_000_003 + steps)
    special = _special_steps(steps, ranks)
    gaps = np.array(sorted(special["loss_gaps"]), np.int64)
    gap_step, gap_rank = special["rank_gap"]
    t_start_us = int(started.timestamp()) * 1_000_000
    for first in range(1, steps + 1, pass_steps):
        step = np.arange(first, min(steps, first + pass_steps - 1) + 1, dtype=np.int64)
        n = step.shape[0]
        epoch = (step - 1) // epoch_steps
        at_us = t_start_us + step * 1_000_000
        progress = step / steps
        loss = 2.3 * np.exp(-4.0 * progress) + 0.05 + rng.normal(0.0, 0.02, n)
        loss[step == special["spike"]] *= 6.0
        loss_missing = np.isin(step, gaps)
        accuracy = np.clip(1.0 - loss / 2.5 + rng.normal(0.0, 0.01, n), 0.0, 1.0)
        lr = 0.05 * 0.5 * (1.0 + np.cos(np.pi * progress))
        compute = 0.011 * (1.0 + rng.normal(0.0, 0.03, (n, ranks)))
        compute[:, ranks - 1] *= 1.6
        data_wait = 0.002 * (1.0 + np.abs(rng.normal(0.0, 0.2, (n, ranks))))
        step_time = (data_wait + compute).max(axis=1) + 0.025
        per_rank = {
            "rank_samples_per_s": np.repeat((BATCH_PER_RANK / step_time)[:, None], ranks, axis=1),
            "rank_step_time_s": np.repeat(step_time[:, None], ranks, axis=1),
            "rank_data_wait_s": data_wait,
            "rank_compute_s": compute,
            "rank_sync_wait_s": step_time[:, None] - compute,
        }
        rank_missing = np.zeros((n, ranks), bool)
        rank_missing[step == gap_step, gap_rank] = True
        none = np.zeros(n, bool)
        no_epoch = np.full(n, -1, np.int64)

        def series(values, missing, where=slice(None)):
            return Series(step[where].copy(), np.where(missing, 0.0, values)[where], missing[where].copy(),
                          epoch[where].copy(), at_us[where].copy())

        out = {("train_loss", None): series(loss, loss_missing), ("train_accuracy", None): series(accuracy, none),
               ("lr", None): series(lr, none),
               ("samples_per_s", None): series(BATCH_PER_RANK * ranks / step_time, none)}
        for name in RANK_STEP_METRICS:
            missing = rank_missing if name == "rank_step_time_s" else np.zeros((n, ranks), bool)
            for rank in range(ranks):
                out[(name, rank)] = series(per_rank[name][:, rank], missing[:, rank])
        for name in RANK_STEP_METRICS:
            if ranks < 2:
                continue
            values = np.where(rank_missing if name == "rank_step_time_s" else False, np.nan, per_rank[name])
            stats = {"min": np.nanmin(values, axis=1), "median": np.nanmedian(values, axis=1),
                     "max": np.nanmax(values, axis=1)}
            for stat in ACROSS_RANKS:
                out[(across_ranks_name(name, stat), None)] = series(stats[stat], none)
        ends = step % epoch_steps == 0
        if ends.any():
            val_loss = loss * 1.08 + rng.normal(0.0, 0.01, n)
            out[("val_loss", None)] = series(val_loss, none, ends)
            out[("val_accuracy", None)] = series(accuracy * 0.98, none, ends)
        del no_epoch
        yield int(step[-1]), out


def _load_bulk(args: argparse.Namespace, steps: int, job, started: dt.datetime) -> dict[str, Any]:
    """``--load bulk``: :func:`generate_arrays` stored a pass at a time by ``jobs.metric_store.store_series``
    (one transaction a pass, as the sync's); storing timed apart from generating."""
    from django.db import transaction

    from jobs import metric_store
    from jobs.models import TrainingJob

    stored, seconds, t_wall, report = 0, 0.0, time.perf_counter(), max(1, steps // 20)
    final: dict[str, float | None] = {}
    for last, arrays in generate_arrays(steps=steps, ranks=args.ranks, epoch_steps=args.epoch_steps,
                                        started=started, seed=args.seed, pass_steps=args.pass_steps):
        t0 = time.perf_counter()
        with transaction.atomic():
            metric_store.store_series(job.pk, arrays)
        seconds += time.perf_counter() - t0
        stored += sum(len(s) for s in arrays.values())
        for (name, rank), s in arrays.items():
            if rank is None and ":" not in name and len(s):
                final[name] = None if s.missing[-1] else float(s.values[-1])
        if last // report != (last - args.pass_steps) // report or last == steps:
            print(f"  {steps:,} steps: {last:,} stored, {stored:,} points, store {seconds:.0f} s "
                  f"({stored / max(seconds, 1e-9):,.0f} points/s), wall {time.perf_counter() - t_wall:.0f} s", flush=True)
    TrainingJob.objects.filter(pk=job.pk).update(final_metrics=final)
    print(f"  {steps:,} steps × {args.ranks} ranks: job {job.pk}, {stored:,} points stored by store_series in "
          f"{seconds:.1f} s ({stored / max(seconds, 1e-9):,.0f} points/s; wall with generating "
          f"{time.perf_counter() - t_wall:.0f} s)", flush=True)
    return {"points": stored, "log_lines": 0, "load_points_s": seconds, "load_logs_s": 0.0,
            "ingest_points_per_s": stored / max(seconds, 1e-9)}


def ingest_compare(args: argparse.Namespace, world) -> dict[str, Any]:
    """Ingestion from trainer records, today's row path against the sync's path, on the same records
    (``--compare-steps`` steps × ``--ranks``, passes of ``--pass-steps`` records), each into a job of
    its own, then both jobs deleted. Returns points/s of each and their ratio."""
    from jobs import metric_store
    from jobs.models import TrainingJob

    user, dataset, model, backend = world
    lines: list[str] = []
    started = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1)
    made = generate_history(0, steps=args.compare_steps, ranks=args.ranks, epoch_steps=args.epoch_steps,
                            started=started, seed=args.seed, write_points=None, log=None, on_record=lines.append)
    passes = _passes(lines, args.pass_steps)
    now = dt.datetime.now(dt.timezone.utc)
    out: dict[str, Any] = {"steps": args.compare_steps, "passes": len(passes)}
    jobs = []
    for label, ingest in (("rows", ingest_rows), ("sync", ingest_sync)):
        job = TrainingJob.objects.create(
            owner=user, name=f"ingest-{label}", dataset=dataset, model_spec=model, backend=backend,
            config={"model": {"arch": "cnn"}, "data": {"name": "digits"}, "train": {"epochs": 2}}, nodes=1,
            procs_per_node=args.ranks, state="RUNNING", provider_job_name=f"tb-ingest-{label}",
            hourly_price_usd=Decimal("2.0000"), started_at=started, state_entered_at=started)
        jobs.append(job)
        t0 = time.perf_counter()
        stored = sum(ingest(job, one, now) for one in passes)
        seconds = time.perf_counter() - t0
        assert stored >= made["points"], (label, stored, made["points"])
        out[label] = {"seconds": seconds, "points_per_s": stored / max(seconds, 1e-9)}
        out["points"] = stored
    a, b = (metric_store.points(job.pk) for job in jobs)
    out["same_points"] = a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and (a[k].steps == b[k].steps).all() and (a[k].values == b[k].values).all() for k in a)
    out["ratio"] = out["sync"]["points_per_s"] / out["rows"]["points_per_s"]
    TrainingJob.objects.filter(pk__in=[job.pk for job in jobs]).delete()
    print(f"ingestion from trainer records ({out['points']:,} points, {args.compare_steps:,} steps × {args.ranks} "
          f"ranks, {len(passes)} passes): rows {out['rows']['points_per_s']:,.0f} points/s, sync path "
          f"{out['sync']['points_per_s']:,.0f} points/s = {out['ratio']:.1f}× (same points: {out['same_points']})",
          flush=True)
    return out


def compare_jobs(args: argparse.Namespace, source_id: int, world) -> list[int]:
    """``--compare`` jobs for the comparison: the job ``source_id`` and ``--compare`` − 1 copies of it, made
    once (found again by name with ``--reuse``). A copy is a TrainingJob row of its own with its own copy
    of the rows the source's history has in the tables the comparison reads, by ``INSERT … SELECT``: the
    tail of point rows and the buckets of every stored level above the finest (4,096 steps and up, the
    summaries included), so a comparison reads 10 jobs' rows, not one job's 10 times. Not copied: the chunks
    (the raw points, ~3 GB a copy at 1,000,000 steps × 64 ranks) and the 256-step buckets (94 % of the bucket
    rows, 1.3 M a copy at that size): a comparison of runs this long reads neither (a line of at most 2,000
    points, 250 a per-rank line, over 1,000,000 steps is read at 4,096 steps a bucket), which the bench
    checks: ``chunk_queries`` counts the compare URL's queries that name the chunks' table, and the widths
    its bucket queries name are printed with its slowest queries. The copies' tables are smaller than ten
    jobs' stored through the sync would be (the index lookups of one job's range are a B-tree level or so
    shallower at most)."""
    from django.db import connection

    from jobs.models import MetricBucket, MetricPoint, TrainingJob

    source = TrainingJob.objects.get(pk=source_id)
    ids = [source_id]
    for i in range(1, args.compare):
        name = f"{source.name}-copy{i}"
        job = TrainingJob.objects.filter(owner=world[0], name=name).first()
        if job is None:
            t0 = time.perf_counter()
            job = TrainingJob.objects.get(pk=source_id)
            job.pk = job.id = None
            job.name, job.provider_job_name = name, f"{source.provider_job_name}-copy{i}"
            job.save(force_insert=True)
            with connection.cursor() as cur:
                for model, where in ((MetricBucket, " AND width > 256"), (MetricPoint, "")):
                    cols = [f.column for f in model._meta.concrete_fields if f.column not in ("id", "job_id")]
                    cur.execute(f"INSERT INTO {model._meta.db_table} (job_id, {', '.join(cols)}) "
                                f"SELECT %s, {', '.join(cols)} FROM {model._meta.db_table} WHERE job_id = %s{where}",
                                [job.pk, source_id])
            print(f"  compare: job {job.pk} = a copy of job {source_id}'s buckets and point rows in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        ids.append(job.pk)
    return ids


def storage() -> dict[str, Any]:
    """Bytes on disk of the metric and log tables (heap, indexes, TOAST) ÷ their rows; run after
    VACUUM ANALYZE so dead tuples and stale statistics do not count."""
    from django.db import connection

    from jobs.models import JobLogLine, MetricBucket, MetricChunk, MetricPoint

    out = {}
    with connection.cursor() as cur:
        for key, model in (("metric_points", MetricPoint), ("metric_chunks", MetricChunk),
                           ("metric_buckets", MetricBucket), ("log_lines", JobLogLine)):
            table = model._meta.db_table
            cur.execute(f"SELECT pg_total_relation_size(%s::regclass), pg_relation_size(%s::regclass), "
                        f"pg_indexes_size(%s::regclass), "
                        f"(SELECT count(*) FROM {table})", [table, table, table])
            total, heap, indexes, rows = cur.fetchone()
            out[key] = {"table": table, "rows": rows, "total_bytes": total, "heap_bytes": heap,
                        "index_bytes": indexes, "bytes_per_row": total / rows if rows else None}
        cur.execute(f"SELECT COALESCE(SUM(count), 0) FROM {MetricChunk._meta.db_table}")
        out["metric_chunks"]["points"] = int(cur.fetchone()[0])
    out["points"] = out["metric_points"]["rows"] + out["metric_chunks"]["points"]
    return out


# --- the measurements ----------------------------------------------------------------------------

def _status_mb(field: str) -> float:
    """``field`` (VmRSS, VmHWM) of this process in MB, from /proc/self/status; NaN elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def _reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: ``5`` to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _request(client, url: str) -> tuple[float, float, int, int]:
    """One GET: (ms, MB of RSS the request added at its peak, status, response bytes). Without a
    resettable high-water mark the RSS after the request stands in for its peak."""
    gc.collect()
    before = _status_mb("VmRSS")
    resettable = _reset_peak()
    t0 = time.perf_counter()
    response = client.get(url)
    ms = (time.perf_counter() - t0) * 1000
    status, size = response.status_code, len(response.content)
    peak = _status_mb("VmHWM") if resettable else _status_mb("VmRSS")
    del response
    return ms, peak - before, status, size


def measure(client, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--warmups`` untimed GETs, then timed ones until ``--requests`` or ``--budget-s``; the first
    request's SQL captured. Times in ms, memory in MB."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    gc.collect()
    rss_start = _status_mb("VmRSS")
    times: list[float] = []
    growth: list[float] = []
    spent_s, captured, first = 0.0, None, None
    for i in range(args.warmups + args.requests):
        if i >= args.warmups and times and spent_s >= args.budget_s:
            break
        if captured is None:
            with CaptureQueriesContext(connection) as ctx:
                ms, grew, status, size = _request(client, url)
            captured = list(ctx.captured_queries)
            first = {"ms": ms, "status": status, "bytes": size}
        else:
            ms, grew, status, size = _request(client, url)
        spent_s += ms / 1000
        growth.append(grew)
        if i >= args.warmups:
            times.append(ms)
    queries = sorted(captured, key=lambda q: -float(q["time"]))
    return {
        "url": url, "status": first["status"], "bytes": first["bytes"], "first_ms": first["ms"],
        "times_ms": times, "p50_ms": median(times), "min_ms": min(times),
        "queries": len(captured), "sql_ms": sum(float(q["time"]) for q in captured) * 1000,
        "slowest": [{"ms": float(q["time"]) * 1000, "sql": q["sql"]} for q in queries[: max(args.slow_queries, 0)]],
        "rss_per_request_mb": max(growth), "rss_kept_mb": _status_mb("VmRSS") - rss_start,
        "captured": [{"sql": q["sql"]} for q in captured],
    }


def urls_for(job_id: int) -> dict[str, str]:
    from django.urls import reverse

    from jobs import comparison
    from jobs.models import TrainingJob

    page = comparison.training_job_chart_series(job=TrainingJob.objects.get(pk=job_id))
    after = max(0, page["last_step"] - POLL_NEW_STEPS)
    chart = reverse("job-metrics", args=[job_id])
    poll = f"{chart}?after={after}&widths={','.join(map(str, page['widths']))}&attempt={page['attempt']}"
    return {"page": reverse("job-detail", args=[job_id]), "chart": chart, "poll": poll,
            "live": reverse("job-live", args=[job_id]), "api": f"/api/jobs/{job_id}/"}


def verdicts(sizes: list[dict[str, Any]], store: dict[str, Any]) -> list[str]:
    """Every missed target as a short line (empty: all met); sets each URL figure's ``ratio``."""
    misses = []
    base = sizes[0]
    for size in sizes:
        for label, what, target in URLS:
            fig = size["urls"].get(label)
            if fig is None:
                continue
            base_fig = base["urls"].get(label)
            fig["ratio"] = fig["p50_ms"] / base_fig["p50_ms"] if base_fig and base_fig["p50_ms"] else None
            if fig["status"] != 200:
                misses.append(f"{what} at {size['steps']:,} steps answered HTTP {fig['status']}")
            if target is None:
                continue
            if fig["p50_ms"] > target:
                misses.append(f"{what} at {size['steps']:,} steps: {fig['p50_ms']:,.0f} ms > {target:.0f} ms")
            if size is not base and fig["ratio"] is not None and fig["ratio"] > RATIO_TARGET:
                misses.append(f"{what} at {size['steps']:,} steps: {fig['ratio']:,.1f}× its time at "
                              f"{base['steps']:,} steps > {RATIO_TARGET:.0f}×")
            if fig["rss_per_request_mb"] > RSS_PER_REQUEST_MB:
                misses.append(f"{what} at {size['steps']:,} steps: +{fig['rss_per_request_mb']:,.0f} MB RSS in a "
                              f"request > {RSS_PER_REQUEST_MB:.0f} MB")
    per_point = None if store.get("with_compare_copies") else _bytes_per_point(store)
    if per_point is not None and per_point > BYTES_PER_POINT:
        misses.append(f"storage: {per_point:.0f} bytes per point > {BYTES_PER_POINT:.0f}")
    return misses


def _bytes_per_point(store: dict[str, Any]) -> float | None:
    """Bytes on disk per point: the points' (rows), the chunks' and the buckets' tables ÷ the points."""
    mp, mc, mb = store["metric_points"], store["metric_chunks"], store["metric_buckets"]
    return (mp["total_bytes"] + mc["total_bytes"] + mb["total_bytes"]) / store["points"] if store["points"] else None


def print_table(sizes: list[dict[str, Any]], store: dict[str, Any], args: argparse.Namespace) -> None:
    targets = {label: target for label, _, target in URLS}
    base = sizes[0]["steps"]
    print(f"\n{'steps':>9} {'points':>11} {'url':<6} {'p50 ms':>10} {'min ms':>10} {'n':>3} {'1st ms':>10} "
          f"{'sql ms':>9} {'queries':>7} {'KB':>9} {'RSS/req MB':>10} {'kept MB':>8} {f'×{base:,}':>8} "
          f"{'target':>7}")
    for size in sizes:
        for label in args.url_labels:
            fig = size["urls"][label]
            ratio = f"{fig['ratio']:.1f}" if fig.get("ratio") is not None else "–"
            target = targets[label]
            print(f"{size['steps']:>9,} {size['points']:>11,} {label:<6} {fig['p50_ms']:>10,.1f} "
                  f"{fig['min_ms']:>10,.1f} {len(fig['times_ms']):>3} {fig['first_ms']:>10,.1f} "
                  f"{fig['sql_ms']:>9,.1f} {fig['queries']:>7} "
                  f"{fig['bytes'] / 1024:>9,.0f} {fig['rss_per_request_mb']:>10,.1f} {fig['rss_kept_mb']:>8,.1f} "
                  f"{ratio:>8} {'–' if target is None else f'{target:.0f}':>7}"
                  + ("" if fig["status"] == 200 else f"  HTTP {fig['status']}"))
    mp, ll = store["metric_points"], store["log_lines"]
    print(f"\nstorage after VACUUM ANALYZE (pg_total_relation_size: heap + indexes + TOAST, every job in the table):\n"
          f"  {mp['table']}: {mp['rows']:,} rows, {mp['total_bytes'] / 2**20:,.1f} MiB (heap "
          f"{mp['heap_bytes'] / 2**20:,.1f}, indexes {mp['index_bytes'] / 2**20:,.1f}) = "
          f"{(mp['bytes_per_row'] or 0):.1f} bytes per row")
    mc = store["metric_chunks"]
    print(f"  {mc['table']}: {mc['rows']:,} chunks of {mc['points']:,} points, {mc['total_bytes'] / 2**20:,.1f} MiB "
          f"(heap {mc['heap_bytes'] / 2**20:,.1f}, indexes {mc['index_bytes'] / 2**20:,.1f}, TOAST included) = "
          f"{mc['total_bytes'] / max(mc['points'], 1):.1f} bytes per point")
    mb = store["metric_buckets"]
    print(f"  {mb['table']}: {mb['rows']:,} rows, {mb['total_bytes'] / 2**20:,.1f} MiB (heap "
          f"{mb['heap_bytes'] / 2**20:,.1f}, indexes {mb['index_bytes'] / 2**20:,.1f}); points and buckets: "
          f"{_bytes_per_point(store):.1f} bytes per point over {store['points']:,} points, rows + chunks + buckets "
          f"(target ≤ {BYTES_PER_POINT:.0f})"
          + (": NOT a per-point figure, the table holds --compare copies' buckets (take it from a run before them)"
             if store.get("with_compare_copies") else ""))
    if ll["rows"]:
        print(f"  {ll['table']}: {ll['rows']:,} rows, {ll['total_bytes'] / 2**20:,.1f} MiB = "
              f"{ll['bytes_per_row']:.0f} bytes per line (each metric record stored again as a line)")
    if args.slow_queries > 0:
        largest = sizes[-1]
        print(f"\nslowest SQL of the first request at {largest['steps']:,} steps:")
        for label in args.url_labels:
            for q in largest["urls"][label]["slowest"]:
                # A plain column list says little (an aggregate stays); the table, WHERE and ORDER BY say what is read.
                sql = re.sub(r"^SELECT [^()]*? FROM ", "SELECT … FROM ", " ".join(q["sql"].split())).replace('"', "")
                print(f"  {label:<5} {q['ms']:>9,.1f} ms  {sql[:320]}{'…' if len(sql) > 320 else ''}")


def print_compare(comparison: dict[str, Any], compared: list[int], steps: int, ranks: int) -> None:
    if not comparison:
        return
    print(f"\ncompare of {len(compared)} jobs of {steps:,} steps × {ranks} ranks (target ≤ {COMPARE_MS:,.0f} ms):")
    for label, what in COMPARE_URLS:
        fig = comparison[label]
        print(f"  {what:<13} p50 {fig['p50_ms']:>9,.1f} ms  min {fig['min_ms']:>9,.1f}  n {len(fig['times_ms'])}  "
              f"1st {fig['first_ms']:>9,.1f}  sql {fig['sql_ms']:>8,.1f} ms  {fig['queries']} queries "
              f"({fig['chunk_queries']} name the chunks)  {fig['bytes'] / 1024:,.0f} KB  "
              f"+{fig['rss_per_request_mb']:,.1f} MB RSS/req" + ("" if fig["status"] == 200 else f"  HTTP {fig['status']}"))
        for q in fig["slowest"]:
            sql = re.sub(r"^SELECT [^()]*? FROM ", "SELECT … FROM ", " ".join(q["sql"].split())).replace('"', "")
            print(f"      {q['ms']:>9,.1f} ms  {sql[:300]}{'…' if len(sql) > 300 else ''}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc)
    with bench_database(args.server, args.db_name, reuse=args.reuse, keep=args.keep):
        from django.db import connection
        from django.test import Client

        from jobs.comparison import RANK_METRICS
        from django.db.models import Sum

        from jobs.models import JobLogLine, MetricChunk, MetricPoint, TrainingJob
        from trainer_pkg.metrics import GLOBAL_METRICS

        # The history is the trainer's: fail here, not silently, if its names change.
        assert set(GLOBAL_STEP_METRICS + EPOCH_METRICS) <= set(GLOBAL_METRICS), GLOBAL_METRICS
        assert set(RANK_STEP_METRICS) == set(RANK_METRICS), RANK_METRICS

        world = _owner_and_world()
        sizes: list[dict[str, Any]] = []
        loaded = False
        for steps in args.sizes:
            job = TrainingJob.objects.filter(owner=world[0], name=job_name(steps, args.ranks)).first()
            if job is None:
                print(f"loading {steps:,} steps × {args.ranks} ranks …", flush=True)
                sizes.append({"steps": steps, "ranks": args.ranks, **load_size(args, steps, world)})
                loaded = True
            else:
                chunked = MetricChunk.objects.filter(job_id=job.pk).aggregate(n=Sum("count"))["n"] or 0
                sizes.append({"steps": steps, "ranks": args.ranks, "job_id": job.pk,
                              "points": MetricPoint.objects.filter(job_id=job.pk).count() + chunked,
                              "log_lines": JobLogLine.objects.filter(job_id=job.pk).count()})
                print(f"reusing job {job.pk}: {steps:,} steps, {sizes[-1]['points']:,} points", flush=True)
        if loaded or not args.reuse:
            t0 = time.perf_counter()
            with connection.cursor() as cur:
                cur.execute("VACUUM ANALYZE")
            print(f"VACUUM ANALYZE in {time.perf_counter() - t0:.1f} s", flush=True)
        copies = TrainingJob.objects.filter(owner=world[0], name__contains="-copy").exists()
        store = storage()
        # The compare copies hold buckets of no points of their own: bytes per point only without them.
        store["with_compare_copies"] = copies
        if not copies:
            print(f"storage: {_bytes_per_point(store):.2f} bytes per point over {store['points']:,} points "
                  f"(rows {store['metric_points']['total_bytes']:,} + chunks {store['metric_chunks']['total_bytes']:,} + "
                  f"buckets {store['metric_buckets']['total_bytes']:,} bytes)", flush=True)
            if args.json:  # the storage figure is kept even if a later step fails
                with open(args.json + ".storage", "w", encoding="utf-8") as f:
                    json.dump(store, f, indent=1, default=str)
        compared = compare_jobs(args, sizes[-1]["job_id"], world) if args.compare else []
        # After the storage figure: the comparison's rows, deleted, would leave their index pages behind.
        ingestion = ingest_compare(args, world) if args.compare_steps else None

        client = Client()
        client.force_login(world[0])
        try:
            load_before = os.getloadavg()
        except OSError:
            load_before = (float("nan"),) * 3
        print(f"\n{started:%Y-%m-%d %H:%M} UTC · {os.cpu_count()} CPUs · load average before "
              f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} · {args.warmups} warm-up + up to "
              f"{args.requests} timed requests per URL (budget {args.budget_s:.0f} s) · RSS at start "
              f"{_status_mb('VmRSS'):,.0f} MB", flush=True)
        for size in sizes:
            size["urls"] = {}
            for label, url in urls_for(size["job_id"]).items():
                if label not in args.url_labels:
                    continue
                t0 = time.perf_counter()
                size["urls"][label] = fig = measure(client, url, args)
                print(f"  {size['steps']:>9,} steps  {label:<5} p50 {fig['p50_ms']:>10,.1f} ms  "
                      f"{fig['queries']} queries  +{fig['rss_per_request_mb']:,.0f} MB  "
                      f"({len(fig['times_ms'])} timed, {time.perf_counter() - t0:,.0f} s)", flush=True)
        comparison = {}
        if compared:
            from django.urls import reverse

            ids = ",".join(map(str, compared))
            for label, url in (("compare", f"{reverse('job-compare')}?ids={ids}"),
                               ("compare_api", f"{reverse('api-job-compare')}?ids={ids}")):
                t0 = time.perf_counter()
                comparison[label] = fig = measure(client, url, args)
                fig["chunk_queries"] = sum("jobs_metricchunk" in q["sql"] for q in fig.pop("captured"))
                print(f"  {len(compared)} × {sizes[-1]['steps']:,} steps  {label:<11} p50 {fig['p50_ms']:>10,.1f} ms  "
                      f"{fig['queries']} queries ({fig['chunk_queries']} read chunks)  +{fig['rss_per_request_mb']:,.0f} MB"
                      f"  ({len(fig['times_ms'])} timed, {time.perf_counter() - t0:,.0f} s)", flush=True)
        for size in sizes:
            for fig in size["urls"].values():
                fig.pop("captured", None)
        misses = verdicts(sizes, store)
        for label, what in COMPARE_URLS:
            fig = comparison.get(label)
            if fig is None:
                continue
            if fig["status"] != 200:
                misses.append(f"{what} of {len(compared)} jobs answered HTTP {fig['status']}")
            if fig["p50_ms"] > COMPARE_MS:
                misses.append(f"{what} of {len(compared)} jobs of {sizes[-1]['steps']:,} steps: {fig['p50_ms']:,.0f} ms "
                              f"> {COMPARE_MS:.0f} ms")
            if fig["rss_per_request_mb"] > RSS_PER_REQUEST_MB:
                misses.append(f"{what}: +{fig['rss_per_request_mb']:,.0f} MB RSS in a request > {RSS_PER_REQUEST_MB:.0f} MB")
        if ingestion and ingestion["sync"]["points_per_s"] < INGEST_POINTS_PER_S:
            misses.append(f"ingestion: {ingestion['sync']['points_per_s']:,.0f} points/s < {INGEST_POINTS_PER_S:,}")
        print_table(sizes, store, args)
        print_compare(comparison, compared, sizes[-1]["steps"], args.ranks)
        try:
            load_after = os.getloadavg()[0]
        except OSError:
            load_after = float("nan")
        print(f"\nload average after {load_after:.2f}. p50 / min: the timed requests (n of them); 1st ms: the first "
              "request (warm-up), whose SQL is counted (queries, sql ms: their times summed); KB: the response; "
              "RSS/req: the most one request raised the process's RSS at its peak; kept: RSS after the URL's "
              f"requests less before; ×{sizes[0]['steps']:,}: p50 ÷ the same URL's p50 at {sizes[0]['steps']:,} "
              "steps in this run.")
        print("targets missed:" + ("".join(f"\n  {m}" for m in misses) if misses else " none"))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"started": started.isoformat(), "cpus": os.cpu_count(),
                           "load_average": [load_before[0], load_after], "argv": sys.argv[1:],
                           "targets": {"p50_ms": {label: t for label, _, t in URLS}, "ratio": RATIO_TARGET,
                                       "rss_per_request_mb": RSS_PER_REQUEST_MB, "bytes_per_point": BYTES_PER_POINT},
                           "storage": store, "ingestion": ingestion, "sizes": sizes,
                           "compare": {"jobs": compared, **comparison}, "misses": misses}, f,
                          indent=1, default=str)
            print(f"wrote {args.json}")
        return 1 if misses and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
