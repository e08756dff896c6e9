"""A job's log at the scale of real runs (issue 29): the log page, the job page's tail poll, a search,
the API's ``?after=`` poll and the start of a download at 10 million lines, beside the same at 10,000.

    nice -n 19 .venv/bin/python bench/log_scale.py                        # 10,000 and 10,000,000 lines
    nice -n 19 .venv/bin/python bench/log_scale.py --lines 10000,1000000  # quicker
    nice -n 19 .venv/bin/python bench/log_scale.py --keep                 # then, on the kept database:
    nice -n 19 .venv/bin/python bench/log_scale.py --reuse --keep --urls page,search_rare

What it does, in one run:

1. creates a throwaway PostgreSQL database (``--db-name``, default ``trainboard_bench_logs``, on
   ``--server``) and applies every migration;
2. for each size of ``--lines`` creates one RUNNING job (ORM) and COPYs its log as the sync now stores
   it: only the lines a person reads (metric records are the job's metric points, not lines), ``seq``
   0 … N−1 without gaps, ``is_metric`` false: ~80-byte trainer lines of 8 ranks, a launcher line every
   1,000 lines, and one rare line (``NCCL WARN``) 1% into the log; then VACUUM ANALYZE;
3. for each size and each URL (``--urls``): ``page`` the full log's newest page (``/jobs/<pk>/logs/``);
   ``oldest`` its first page; ``tail`` the job page's live fragment (``/jobs/<pk>/live/``: status,
   timeline, rank table and the log tail of 200 lines), re-fetched every 2 s while the page is open;
   ``after`` the API's poll for lines after the last 100 (``/api/jobs/<pk>/logs/?after=``);
   ``search_rare`` / ``search_common`` the log page searched for a term in one line / in every line;
   ``download`` ``/jobs/<pk>/logs/download/`` read to its first piece (time to first bytes) and then
   ``--download-mb`` MB on (or whole, ``--download-mb 0``): time, MB/s, and the most the process's
   RSS rose at its peak (the kernel's high-water mark, reset through ``/proc/self/clear_refs``).
   In-process with Django's test ``Client`` (no HTTP server): ``--warmups`` untimed requests (the
   first one's SQL captured and each query EXPLAIN ANALYZEd: the plan's scan nodes and the rows they
   read), then up to ``--requests`` timed ones within ``--budget-s`` seconds a URL;
4. prints p50 ms per URL and size, each ratio to the smallest size measured in this run, the rows the
   SQL read, whether a plan has a Seq Scan, and the table's size;
5. drops the database (unless ``--keep``).

Nothing is asserted: it reports. Times are wall-clock on whatever else the machine is doing (2 cores,
shared): compare ratios within one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import random
import sys
import tempfile
import time
from decimal import Decimal
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import median  # noqa: E402
from bench.job_list import bench_database  # noqa: E402
from bench.metric_scale import _owner_and_world, _reset_peak, _status_mb  # noqa: E402

RARE = "NCCL WARN Connect to 10.0.0.7<43211> failed : Connection refused"
RARE_TERM = "nccl warn"
COMMON_TERM = "loss"
URL_LABELS = ("page", "oldest", "tail", "after", "search_rare", "search_common", "download")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", default="10000,10000000", help="log sizes, comma-separated (default 10,000 and 10 M)")
    p.add_argument("--urls", default=",".join(URL_LABELS), help=f"what to measure, of {', '.join(URL_LABELS)}")
    p.add_argument("--requests", type=int, default=5, help="timed requests per URL (default 5)")
    p.add_argument("--warmups", type=int, default=1, help="untimed requests per URL first (default 1)")
    p.add_argument("--budget-s", type=float, default=30.0, help="seconds of timed requests per URL at most")
    p.add_argument("--download-mb", type=float, default=50.0,
                   help="MB of the download read after its first piece (0: the whole log)")
    p.add_argument("--server", default=os.environ.get("BENCH_PG_SERVER", "postgres://postgres@127.0.0.1:5432"),
                   help="PostgreSQL server URL without a database name")
    p.add_argument("--db-name", default="trainboard_bench_logs", help="throwaway database (dropped and created)")
    p.add_argument("--keep", action="store_true", help="keep the database afterwards (to EXPLAIN by hand)")
    p.add_argument("--reuse", action="store_true", help="use the kept database as it is (load missing sizes only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args(argv)
    args.sizes = sorted({int(x.replace("_", "")) for x in args.lines.split(",") if x.strip()})
    args.url_labels = [u.strip() for u in args.urls.split(",") if u.strip()]
    bad = set(args.url_labels) - set(URL_LABELS)
    if bad:
        p.error(f"--urls: unknown {', '.join(sorted(bad))}; choose from {', '.join(URL_LABELS)}")
    return args


def job_name(lines: int) -> str:
    return f"logs-{lines}"


def _log_text(job_id: int, lines: int, seed: int):
    """COPY text (``job_id \\t seq \\t text \\t f``) of ``lines`` log lines, in blocks of ~1 MB."""
    rng = random.Random(seed)
    rare_at = lines // 100
    out: list[str] = []
    for seq in range(lines):
        if seq == rare_at:
            text = f"[rank3]: {RARE}"
        elif seq % 1000 == 0:
            text = f"[launch] rank {seq // 1000 % 8} (local rank {seq // 1000 % 8}, node_rank 0) of world size 8"
        else:
            rank = seq % 8
            text = (f"[rank{rank}]: [trainer] epoch {seq // 50_000} step {seq // 8}: loss {rng.random() * 3:.4f}, "
                    f"{rng.randint(9000, 11000)} tokens/s, lr {3e-4 * (1 - seq / lines):.3e}")
        out.append(f"{job_id}\t{seq}\t{text}\tf\n")
        if len(out) >= 10_000:
            yield "".join(out)
            out = []
    if out:
        yield "".join(out)


def load_size(lines: int, world) -> dict[str, Any]:
    """One RUNNING job whose log is ``lines`` lines, COPYed; returns its id and the seconds it took."""
    from django.db import connection

    from jobs.models import JobLogLine, TrainingJob

    user, dataset, model, backend = world
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    job = TrainingJob.objects.create(
        owner=user, name=job_name(lines), dataset=dataset, model_spec=model, backend=backend,
        config={"model": {"arch": "cnn"}, "data": {"name": "digits"}, "train": {"epochs": 100, "batch_size": 32}},
        nodes=1, procs_per_node=8, state="RUNNING", provider_job_name=f"tb-{job_name(lines)}",
        hourly_price_usd=Decimal("2.0000"), submitted_at=now - dt.timedelta(days=7), started_at=now - dt.timedelta(days=7),
        first_step_at=now - dt.timedelta(days=7), state_entered_at=now - dt.timedelta(days=7), last_synced_at=now)
    t0 = time.perf_counter()
    with connection.cursor() as cur:
        with cur.cursor.copy(f"COPY {JobLogLine._meta.db_table} (job_id, seq, text, is_metric) FROM STDIN") as copy:
            for n, block in enumerate(_log_text(job.pk, lines, seed=lines)):
                copy.write(block)
                if n % 100 == 99:
                    print(f"  {lines:,} lines: {(n + 1) * 10_000:,} copied, {time.perf_counter() - t0:.0f} s", flush=True)
    took = time.perf_counter() - t0
    print(f"  {lines:,} lines: job {job.pk}, COPY {took:.1f} s ({lines / max(took, 1e-9):,.0f} lines/s)", flush=True)
    return {"job_id": job.pk, "copy_s": took}


def urls_for(job_id: int, lines: int) -> dict[str, str]:
    from urllib.parse import quote

    return {
        "page": f"/jobs/{job_id}/logs/",
        "oldest": f"/jobs/{job_id}/logs/?page=1",
        "tail": f"/jobs/{job_id}/live/",
        "after": f"/api/jobs/{job_id}/logs/?after={lines - 101}",
        "search_rare": f"/jobs/{job_id}/logs/?q={quote(RARE_TERM)}",
        "search_common": f"/jobs/{job_id}/logs/?q={quote(COMMON_TERM)}",
        "download": f"/jobs/{job_id}/logs/download/",
    }


def explain(sql: str) -> dict[str, Any]:
    """EXPLAIN ANALYZE of one captured SELECT: its scan nodes on the log table (its own or its indexes),
    the rows they returned and removed by a filter (the rows the query read), and whether any is a
    Seq Scan. Scans of the small tables (session, user, job) are left out."""
    from django.db import connection

    from jobs.models import JobLogLine

    table = JobLogLine._meta.db_table

    if not sql.lstrip().upper().startswith("SELECT"):
        return {"nodes": [], "rows_read": 0, "seq_scan": False}
    with connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        plan = cur.fetchone()[0]
    plan = plan if isinstance(plan, list) else json.loads(plan)
    nodes: list[str] = []
    rows = 0

    def walk(node: dict[str, Any]) -> None:
        nonlocal rows
        kind = node.get("Node Type", "")
        if "Scan" in kind and node.get("Relation Name", node.get("Index Name", "")).startswith(
                (table, "logline_", "jobs_joblogline")):
            loops = node.get("Actual Loops", 1) or 1
            read = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                    + node.get("Rows Removed by Index Recheck", 0)) * loops
            rows += int(read)
            nodes.append(f"{kind}{' on ' + node['Index Name'] if node.get('Index Name') else ''} ({int(read):,})")
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    return {"nodes": nodes, "rows_read": rows, "seq_scan": any(n.startswith("Seq Scan") for n in nodes)}


def _get(client, url: str) -> tuple[float, float, int]:
    """One GET read whole: (ms, MB of RSS the request added at its peak, status)."""
    gc.collect()
    before = _status_mb("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    response = client.get(url)
    if response.streaming:
        for _ in response.streaming_content:
            pass
    ms = (time.perf_counter() - t0) * 1000
    status = response.status_code
    del response
    return ms, _status_mb("VmHWM") - before, status


def measure(client, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-ups (the first one's SQL captured and EXPLAINed), then timed GETs. Times in ms."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as ctx:
        first_ms, _, status = _get(client, url)
    plans = [explain(q["sql"]) for q in ctx.captured_queries]
    for _ in range(args.warmups - 1):
        _get(client, url)
    times, growth, spent = [], [], 0.0
    for _ in range(args.requests):
        if times and spent >= args.budget_s:
            break
        ms, grew, status = _get(client, url)
        times.append(ms)
        growth.append(grew)
        spent += ms / 1000
    return {"url": url, "status": status, "first_ms": first_ms, "times_ms": times, "p50_ms": median(times),
            "queries": len(plans), "rows_read": sum(p["rows_read"] for p in plans),
            "seq_scan": any(p["seq_scan"] for p in plans), "plans": [p["nodes"] for p in plans],
            "rss_per_request_mb": max(growth)}


def measure_download(client, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The streamed download: ms to its first piece, then ``--download-mb`` MB on (0: all of it)."""
    gc.collect()
    before = _status_mb("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    response = client.get(url)
    pieces = iter(response.streaming_content)
    first = next(pieces, b"")
    first_ms = (time.perf_counter() - t0) * 1000
    read, limit = len(first), args.download_mb * 1e6
    for piece in pieces:
        read += len(piece)
        if limit and read >= limit:
            break
    seconds = time.perf_counter() - t0
    grew = _status_mb("VmHWM") - before
    response.close()
    return {"url": url, "status": response.status_code, "first_bytes_ms": first_ms, "first_piece_bytes": len(first),
            "read_mb": read / 1e6, "read_s": seconds, "mb_per_s": read / 1e6 / max(seconds, 1e-9),
            "rss_growth_mb": grew, "p50_ms": first_ms}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc)
    with bench_database(args.server, args.db_name, reuse=args.reuse, keep=args.keep):
        from django.db import connection
        from django.test import Client

        from jobs.models import JobLogLine, TrainingJob

        world = _owner_and_world()
        sizes: list[dict[str, Any]] = []
        for lines in args.sizes:
            job = TrainingJob.objects.filter(owner=world[0], name=job_name(lines)).first()
            if job is None:
                print(f"loading {lines:,} log lines …", flush=True)
                sizes.append({"lines": lines, **load_size(lines, world)})
            else:
                sizes.append({"lines": lines, "job_id": job.pk})
                print(f"reusing job {job.pk}: {lines:,} lines", flush=True)
        t0 = time.perf_counter()
        with connection.cursor() as cur:
            cur.execute("VACUUM ANALYZE")
            cur.execute("SELECT pg_total_relation_size(%s), pg_relation_size(%s)",
                        [JobLogLine._meta.db_table, JobLogLine._meta.db_table])
            total_bytes, heap_bytes = cur.fetchone()
        print(f"VACUUM ANALYZE in {time.perf_counter() - t0:.1f} s; {JobLogLine._meta.db_table}: "
              f"{total_bytes / 1e6:,.0f} MB with indexes and TOAST ({heap_bytes / 1e6:,.0f} MB of rows)", flush=True)

        client = Client()
        client.force_login(world[0])
        load_before = os.getloadavg()
        print(f"\n{started:%Y-%m-%d %H:%M} UTC · {os.cpu_count()} CPUs · load average before {load_before[0]:.2f} · "
              f"{args.warmups} warm-up + up to {args.requests} timed requests per URL", flush=True)
        for size in sizes:
            size["urls"] = {}
            for label, url in urls_for(size["job_id"], size["lines"]).items():
                if label not in args.url_labels:
                    continue
                if label == "download":
                    fig = measure_download(client, url, args)
                    print(f"  {size['lines']:>11,} lines  download  first bytes {fig['first_bytes_ms']:,.1f} ms; "
                          f"{fig['read_mb']:,.1f} MB in {fig['read_s']:,.2f} s ({fig['mb_per_s']:,.1f} MB/s), "
                          f"RSS +{fig['rss_growth_mb']:,.1f} MB", flush=True)
                else:
                    fig = measure(client, url, args)
                    print(f"  {size['lines']:>11,} lines  {label:<13} p50 {fig['p50_ms']:>9,.1f} ms  "
                          f"{fig['queries']} queries reading {fig['rows_read']:,} rows"
                          f"{'  SEQ SCAN' if fig['seq_scan'] else ''}  +{fig['rss_per_request_mb']:,.1f} MB", flush=True)
                size["urls"][label] = fig
        load_after = os.getloadavg()[0]
        small = sizes[0]
        print(f"\n{'what':<14}" + "".join(f"{s['lines']:>16,} lines" for s in sizes)
              + "".join(f"{'× ' + format(small['lines'], ','):>14}" for s in sizes[1:]))
        for label in args.url_labels:
            cells, ratios = "", ""
            for s in sizes:
                fig = s["urls"].get(label)
                cells += f"{fig['p50_ms']:>13,.1f} ms " if fig else f"{'':>17}"
                cells += f"{'':>5}"
                if s is not small and fig and small["urls"].get(label):
                    ratios += f"{fig['p50_ms'] / max(small['urls'][label]['p50_ms'], 1e-9):>13.2f}×"
            print(f"{label:<14}{cells}{ratios}")
        print("\nrows read by each URL's SQL (EXPLAIN ANALYZE of the first request):")
        for s in sizes:
            for label, fig in s["urls"].items():
                if "plans" in fig:
                    print(f"  {s['lines']:>11,} {label:<13} {fig['rows_read']:>11,}  "
                          + " | ".join(", ".join(nodes) for nodes in fig["plans"] if nodes))
        print(f"\nload average after {load_after:.2f}. p50: median of the timed requests; download: ms to the "
              "first piece (2,000 lines), then its read rate and RSS growth; ×: p50 ÷ the same at "
              f"{small['lines']:,} lines in this run.")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"started": started.isoformat(), "cpus": os.cpu_count(), "argv": sys.argv[1:],
                           "load_average": [load_before[0], load_after], "table_bytes": total_bytes,
                           "heap_bytes": heap_bytes, "sizes": sizes}, f, indent=1, default=str)
            print(f"wrote {args.json}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
