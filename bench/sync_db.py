"""One sync of 10,000 active jobs: the database work of a pass, one statement for the unchanged jobs
against the per-job path, measured in the same run.

    .venv/bin/python bench/sync_db.py                  # 10,000 active jobs on 4 backends, 100 changed
    .venv/bin/python bench/sync_db.py --quick          # 1,000 jobs
    .venv/bin/python bench/sync_db.py --backends 1 --rounds 2

What it does, in one run:

1. creates a throwaway PostgreSQL database (``--db-name``, default ``trainboard_bench_sync_db``),
   applies every migration and loads ``--jobs`` active jobs exactly as ``bench/sync_memory.py`` does
   (90 % RUNNING, 10 % PENDING, frozen configs, last sync 30 s ago, its counting stand-in provider that
   changes ``--changed-pct`` % of them: 100 of 10,000 by default);
2. for each of ``--rounds`` rounds, runs one pass (``jobs.sync.backend_sync`` for every backend,
   as ``sync_jobs`` fans it out) in a fresh subprocess with ``bulk=False`` (the per-job path: every
   job locked, updated, re-read) and then one with ``bulk=True`` (the jobs that did not change and
   whose logs are not read this pass in one UPDATE), putting the sync times back to 30 s ago before
   each pass so every pass does the same work;
3. prints, per pass: wall time, SQL statements sent (every ``cursor.execute`` through Django, savepoints
   included; the BEGIN/COMMIT that psycopg adds around each transaction are not counted), the time
   spent inside them (client side, round trips included) and in the longest one, the jobs written one
   by one, and the per-job / bulk ratios;
4. drops the database (unless ``--keep``).

Nothing is asserted (exit 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from sync_memory import (CountingFake, child_backends, loaded_database, reset_sync_times,  # noqa: E402
                         run_child, sync_parser)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = sync_parser(__doc__, "trainboard_bench_sync_db")
    p.add_argument("--rounds", type=int, default=1, help="per-job pass + bulk pass, this many times (default 1)")
    p.add_argument("--child", choices=["per-job", "bulk"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.jobs = 1_000
    if args.jobs < 1 or args.backends < 1 or args.rounds < 1 or not 0 <= args.changed_pct <= 100:
        p.error("--jobs, --backends and --rounds must be at least 1, --changed-pct between 0 and 100")
    return args


class StatementCounter:
    """A Django execute wrapper: statements sent and seconds spent in them."""

    def __init__(self) -> None:
        self.statements = 0
        self.seconds = 0.0
        self.longest = 0.0

    def __call__(self, execute, sql, params, many, context):
        t0 = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            spent = time.perf_counter() - t0
            self.seconds += spent
            self.longest = max(self.longest, spent)
            self.statements += 1


def child(args: argparse.Namespace) -> None:
    """One sync pass in this (fresh) process; prints one JSON line."""
    backend_ids = child_backends(args)
    from django.db import connection

    from jobs import sync

    one_by_one = 0
    real_sync_one = sync._sync_one

    def counting_sync_one(*a, **kw):
        nonlocal one_by_one
        one_by_one += 1
        return real_sync_one(*a, **kw)

    sync._sync_one = counting_sync_one
    counter = StatementCounter()
    bulk = args.child == "bulk"
    t0 = time.perf_counter()
    with connection.execute_wrapper(counter):
        looked_at = sum(sync.backend_sync(backend_id=b, bulk=bulk) for b in backend_ids)
    seconds = time.perf_counter() - t0
    print(json.dumps({"looked_at": looked_at, "seconds": seconds, "statements": counter.statements,
                      "sql_seconds": counter.seconds, "longest_ms": counter.longest * 1000, "one_by_one": one_by_one, "calls": dict(CountingFake.calls)}))


def row(label: str, r: dict[str, Any]) -> str:
    return (f"| {label} | {r['looked_at']:,} | {r['one_by_one']:,} | {r['seconds']:.2f} | {r['statements']:,} | "
            f"{r['sql_seconds']:.2f} | {r['longest_ms']:.0f} | {r['calls'].get('logs', 0):,} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    started = dt.datetime.now(dt.timezone.utc)
    with loaded_database(args):
        load_before = os.getloadavg()[0]
        results: dict[str, list[dict[str, Any]]] = {"per-job": [], "bulk": []}
        for _ in range(args.rounds):
            for mode in ("per-job", "bulk"):
                reset_sync_times(args)
                results[mode].append(run_child(args, mode, script=__file__))
                print(f"  {mode:8} pass: {results[mode][-1]['seconds']:.2f} s", flush=True)
        load_after = os.getloadavg()[0]
        changed = sum(1 for i in range(args.jobs) if i % 100 < args.changed_pct)
        print(f"\n{started:%Y-%m-%d %H:%M} UTC · {args.jobs:,} active jobs on {args.backends} backend(s) · "
              f"{changed:,} changed · load average {load_before:.2f} before, {load_after:.2f} after · "
              f"{os.cpu_count()} CPUs\n")
        print("| pass | jobs | written one by one | wall s | SQL statements | s in SQL | longest statement ms | "
              "logs calls |")
        print("|---|---|---|---|---|---|---|---|")
        for mode in ("per-job", "bulk"):
            for i, r in enumerate(results[mode], 1):
                print(row(f"{mode} #{i}" if args.rounds > 1 else mode, r))

        def median(mode: str, key: str) -> float:
            return statistics.median(r[key] for r in results[mode])

        print()
        for key, what in (("seconds", "wall time"), ("statements", "SQL statements"), ("sql_seconds", "time in SQL")):
            a, b = median("per-job", key), median("bulk", key)
            print(f"{what:15} per-job / bulk = {a:,.2f} / {b:,.2f} = {a / b:.1f}×" if b else f"{what}: bulk 0")
        return 0


if __name__ == "__main__":
    sys.exit(main())
