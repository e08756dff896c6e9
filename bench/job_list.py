"""The job list at 100,000 jobs and 1,000,000 metric points: server time and SQL queries.

    .venv/bin/python bench/job_list.py                      # 100,000 jobs, 1,000,000 points, 50 requests each
    .venv/bin/python bench/job_list.py --quick              # 5,000 jobs, 50,000 points, 20 requests each
    .venv/bin/python bench/job_list.py --jobs 20000 --metric-points 200000 --requests 30 --keep
    .venv/bin/python bench/job_list.py --reuse --keep --pages deep,many   # again on the kept database

What it does, in one run:

1. creates a throwaway PostgreSQL database (``--db-name``, default ``trainboard_bench``, on
   ``--server``, default ``postgres://postgres@127.0.0.1:5432``), applies every migration, and bulk-loads
   with COPY: a big user ("bench", staff) with ``--jobs`` jobs spread over 4 backends, 3 datasets,
   3 models, every state and a year of creation times; a small user ("small") with 10 jobs;
   ``--metric-points`` MetricPoint rows over the big user's newest jobs (100 per job); then VACUUM ANALYZE;
2. for each page (the list, each filter, a search with one match and one with many, the last page by
   ``?page=N`` and by the "Older →" link's position, the same for /api/jobs/ and the admin changelist;
   ``--pages`` picks some of them by label),
   in-process with Django's test ``Client`` (middleware, view, template or
   serializer, database; no HTTP server), counts the SQL queries for the small and the big user
   (``CaptureQueriesContext``) and times ``--requests`` requests of the big user after 3 warm-ups;
3. prints p50 / p95 in ms per page, the query counts, and whether each meets its target (HTML and API
   p95 ≤ 50 ms, admin changelist p95 ≤ 200 ms; queries equal for 10 vs N jobs and page 1 vs a deep page);
4. drops the database (unless ``--keep``).

Nothing is asserted: it reports (exit 0), or with ``--check`` exits 1 when a target is missed.
Times are wall-clock on whatever else the machine is doing; run it on a quiet machine for the record.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STATES = ["QUEUED", "SUBMITTING", "PENDING", "RUNNING", "STOPPING", "SUCCEEDED", "FAILED", "CANCELLED"]
# Most jobs of a long-lived account are finished.
STATE_WEIGHTS = [1, 0.2, 1, 3, 0.2, 80, 10, 5]
HTML_P95_MS = 50.0
ADMIN_P95_MS = 200.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=100_000, help="jobs of the big user (default 100,000)")
    p.add_argument("--metric-points", type=int, default=1_000_000, help="MetricPoint rows (default 1,000,000)")
    p.add_argument("--requests", type=int, default=50, help="timed requests per page (default 50)")
    p.add_argument("--quick", action="store_true", help="5,000 jobs, 50,000 points, 20 requests")
    p.add_argument("--server", default=os.environ.get("BENCH_PG_SERVER", "postgres://postgres@127.0.0.1:5432"),
                   help="PostgreSQL server URL without a database name")
    p.add_argument("--db-name", default="trainboard_bench", help="throwaway database (dropped and created)")
    p.add_argument("--keep", action="store_true", help="keep the database afterwards (to EXPLAIN by hand)")
    p.add_argument("--reuse", action="store_true", help="use the kept database as it is (no load)")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    p.add_argument("--pages", default="",
                   help="only the pages whose label contains one of these comma-separated words "
                        "(e.g. 'deep,q (many)'); default all")
    p.add_argument("--seed", type=int, default=6)
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.metric_points, args.requests = 5_000, 50_000, 20
    for name in ("jobs", "metric_points", "requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def admin_db(server: str):
    import psycopg

    return psycopg.connect(f"{server.rstrip('/')}/postgres", autocommit=True)


def create_database(server: str, name: str) -> None:
    from psycopg import sql

    with admin_db(server) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(server: str, name: str) -> None:
    from psycopg import sql

    with admin_db(server) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def setup_django(server: str, name: str) -> None:
    os.environ["DATABASE_URL"] = f"{server.rstrip('/')}/{name}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    if not os.environ.get("TRAINBOARD_ENCRYPTION_KEY"):
        from cryptography.fernet import Fernet

        os.environ["TRAINBOARD_ENCRYPTION_KEY"] = Fernet.generate_key().decode()
    import django

    django.setup()
    import logging

    logging.getLogger("axes").setLevel(logging.WARNING)  # one line per force_login otherwise


@contextlib.contextmanager
def bench_database(server: str, name: str, *, reuse: bool = False, keep: bool = False) -> Iterator[None]:
    """A benchmark's throwaway PostgreSQL database ``name`` on ``server`` with Django set up on it: dropped
    and created with every migration applied (``reuse``: the database kept by an earlier run, as it is);
    at the end its connections closed and, unless ``keep``, the database dropped (printed)."""
    if not reuse:
        create_database(server, name)
    setup_django(server, name)
    try:
        if not reuse:
            from django.core.management import call_command

            call_command("migrate", verbosity=0, interactive=False)
        yield
    finally:
        from django.db import connections

        connections.close_all()
        if not keep:
            drop_database(server, name)
            print(f"dropped database {name}")


def _copy(table: str, columns: list[str], rows) -> None:
    from django.db import connection

    with connection.cursor() as cur:
        raw = cur.cursor  # psycopg 3 cursor under Django's wrapper
        with raw.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)


def _job_columns() -> tuple[list[str], dict[str, Any]]:
    """All concrete TrainingJob columns but ``id``, with each one's default as a database value."""
    from django.db import connection
    from jobs.models import TrainingJob

    template = TrainingJob()
    cols, defaults = [], {}
    for field in TrainingJob._meta.concrete_fields:
        if field.primary_key:
            continue
        cols.append(field.column)
        value = field.get_db_prep_save(getattr(template, field.attname), connection)
        defaults[field.column] = value
    return cols, defaults


def load(args: argparse.Namespace) -> dict[str, Any]:
    """Users, datasets, models, backends, jobs and metric points; returns what the pages need."""
    from django.contrib.auth import get_user_model
    from django.db import connection
    from psycopg.types.json import Jsonb

    from jobs.models import ComputeBackend, Dataset, MetricPoint, ModelSpec, TrainingJob

    rng = random.Random(args.seed)
    User = get_user_model()
    # Staff, not superuser, like "small": the admin shows each only their own rows.
    big = User.objects.create_user("bench", "bench@example.com", "bench-pw-1", is_staff=True)
    small = User.objects.create_user("small", "small@example.com", "small-pw-1", is_staff=True)

    def world(owner) -> tuple[list, list, list]:
        datasets = [Dataset.objects.create(owner=owner, name=n, format="builtin", builtin_name="digits")
                    for n in ("digits", "digits-aug", "cifar-small")]
        models = [ModelSpec.objects.create(owner=owner, name=n, architecture=a, params={})
                  for n, a in (("digits-cnn", "cnn"), ("digits-mlp", "mlp"), ("resnet-small", "resnet"))]
        backends = [ComputeBackend.objects.create(owner=owner, name=n, kind=k, config={})
                    for n, k in (("local", "gpubox"), ("aws", "sagemaker"), ("gcp", "vertex"), ("azure", "azureml"))]
        return datasets, models, backends

    big_world, small_world = world(big), world(small)
    cols, defaults = _job_columns()
    config = Jsonb({"model": {"arch": "cnn"}, "train": {"epochs": 3, "batch_size": 32}, "data": {"name": "digits"}})
    now = dt.datetime.now(dt.timezone.utc)

    def rows(owner, owned_world, n: int, prefix: str):
        datasets, models, backends = owned_world
        for i in range(n):
            # The small user has one job in every state, so each filter shows it a non-empty page.
            state = STATES[i % len(STATES)] if n <= 2 * len(STATES) else rng.choices(STATES, STATE_WEIGHTS)[0]
            # Creation times spread over a year, in the order of i.
            created = now - dt.timedelta(seconds=(n - i) * (365 * 86400 // n))
            submitted = created + dt.timedelta(seconds=5) if state != "QUEUED" else None
            started = created + dt.timedelta(seconds=60) if state in ("RUNNING", "STOPPING", "SUCCEEDED",
                                                                       "FAILED", "CANCELLED") else None
            ended = created + dt.timedelta(seconds=60 + rng.randint(60, 7200)) if state in (
                "SUCCEEDED", "FAILED", "CANCELLED") else None
            row = dict(defaults)
            row.update({
                "owner_id": owner.pk, "created_at": created, "updated_at": ended or created,
                "name": f"{prefix}-{i:06d}", "dataset_id": datasets[i % 3].pk, "model_spec_id": models[i % 3].pk,
                "backend_id": backends[i % 4].pk, "config": config, "nodes": 1 + i % 2,
                "procs_per_node": 2, "state": state, "provider_job_name": f"tb-job-{prefix}-{i}",
                "submitted_at": submitted, "started_at": started, "ended_at": ended,
                "state_entered_at": ended or started or submitted or created,
                "cost_usd": round(rng.random() * 40, 4), "billable_seconds": rng.random() * 7000,
                "stalled_at": now if state == "PENDING" and i % 7 == 0 else None,
                "stalled_reason": "PENDING for 3 h (deadline 1 h)" if state == "PENDING" and i % 7 == 0 else "",
                # What the sync keeps as the job's last values (the list's metric columns and sorts read them);
                # jobs that never trained have none.
                "final_metrics": Jsonb({"train_loss": round(rng.uniform(0.05, 2.0), 6),
                                        "val_accuracy": round(rng.uniform(0.5, 0.99), 6),
                                        "samples_per_s": round(rng.uniform(100, 5000), 2)}) if started else Jsonb({}),
            })
            yield [row[c] for c in cols]

    t0 = time.perf_counter()
    _copy(TrainingJob._meta.db_table, cols, rows(big, big_world, args.jobs, "sweep"))
    _copy(TrainingJob._meta.db_table, cols, rows(small, small_world, 10, "tiny"))
    t_jobs = time.perf_counter() - t0

    newest = list(TrainingJob.objects.filter(owner=big).order_by("-id").values_list("id", flat=True)
                  [: max(1, args.metric_points // 100)])
    names = ["train_loss", "train_accuracy", "val_loss", "val_accuracy", "samples_per_s"]

    def points():
        left = args.metric_points
        for job_id in newest:
            for k in range(min(100, left)):
                yield (job_id, names[k % 5], (k // 5 + 1) * 10, k // 40, None, rng.random(), now)
            left -= min(100, left)
            if left <= 0:
                return

    t0 = time.perf_counter()
    _copy(MetricPoint._meta.db_table, ["job_id", "name", "step", "epoch", "rank", "value", "recorded_at"], points())
    t_points = time.perf_counter() - t0
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE")
    print(f"loaded {args.jobs:,} + 10 jobs in {t_jobs:.1f} s, {args.metric_points:,} metric points in "
          f"{t_points:.1f} s; VACUUM ANALYZE done", flush=True)
    return {"big": big, "small": small}


def pages(args: argparse.Namespace, big_backend_id: int, small_backend_id: int,
          big_user) -> list[tuple[str, str, str, float]]:
    """(label, url for the big user, url for the small user, target p95 ms)."""
    from jobs.models import TrainingJob
    from jobs.pagination import position_token

    deep = max(2, (args.jobs - 50) // 25)        # HTML: 25 per page, the last full page
    # The "Older →" link on page deep − 1 carries the position of that page's last row.
    before_deep = TrainingJob.objects.filter(owner=big_user).order_by("-created_at", "-id")[(deep - 1) * 25 - 1]
    older_link = f"/jobs/?after={position_token(before_deep)}&page={deep}"
    deep_offset = max(50, args.jobs - 50)         # API: 25 per page by default
    # The API's "next" link from the page before carries the position of that page's last row.
    before_offset = TrainingJob.objects.filter(owner=big_user).order_by("-created_at", "-id")[deep_offset - 1]
    api_next_link = f"/api/jobs/?after={position_token(before_offset)}&limit=25&offset={deep_offset}"
    admin_deep = max(2, (args.jobs - 50) // 50)  # admin: 50 per page (list_per_page), ?p= counts from 1
    rare = "sweep-000123"  # one job matches: the search reads the whole list
    out = [
        ("html list", "/jobs/", "/jobs/", HTML_P95_MS),
        ("html state=RUNNING", "/jobs/?state=RUNNING", "/jobs/?state=RUNNING", HTML_P95_MS),
        ("html backend", f"/jobs/?backend={big_backend_id}", f"/jobs/?backend={small_backend_id}", HTML_P95_MS),
        ("html q (1 match)", f"/jobs/?q={rare}", "/jobs/?q=tiny-000003", HTML_P95_MS),
        ("html q (many)", "/jobs/?q=resnet", "/jobs/?q=resnet", HTML_P95_MS),
        ("html deep page", f"/jobs/?page={deep}", "/jobs/?page=1", HTML_P95_MS),
        ("html deep by link", older_link, "/jobs/?page=1", HTML_P95_MS),
        ("html state deep", f"/jobs/?state=SUCCEEDED&page={int(deep * 0.7)}", "/jobs/?state=SUCCEEDED&page=1",
         HTML_P95_MS),
        ("html metric column", "/jobs/?columns=val_accuracy,train_loss", "/jobs/?columns=val_accuracy,train_loss",
         HTML_P95_MS),
        ("html sort by metric", "/jobs/?columns=val_accuracy&sort=-val_accuracy",
         "/jobs/?columns=val_accuracy&sort=-val_accuracy", HTML_P95_MS),
        ("api list", "/api/jobs/", "/api/jobs/", HTML_P95_MS),
        ("api sort by metric", "/api/jobs/?ordering=-val_accuracy", "/api/jobs/?ordering=-val_accuracy", HTML_P95_MS),
        ("api state=FAILED", "/api/jobs/?state=FAILED", "/api/jobs/?state=FAILED", HTML_P95_MS),
        ("api backend", f"/api/jobs/?backend={big_backend_id}", f"/api/jobs/?backend={small_backend_id}",
         HTML_P95_MS),
        ("api q (1 match)", f"/api/jobs/?q={rare}", "/api/jobs/?q=tiny-000003", HTML_P95_MS),
        ("api q (many)", "/api/jobs/?q=resnet", "/api/jobs/?q=resnet", HTML_P95_MS),
        ("api deep offset", f"/api/jobs/?offset={deep_offset}", "/api/jobs/?offset=0", HTML_P95_MS),
        ("api deep by next", api_next_link, "/api/jobs/?offset=0", HTML_P95_MS),
        ("admin changelist", "/admin/jobs/trainingjob/", "/admin/jobs/trainingjob/", ADMIN_P95_MS),
        ("admin state filter", "/admin/jobs/trainingjob/?state__exact=RUNNING",
         "/admin/jobs/trainingjob/?state__exact=RUNNING", ADMIN_P95_MS),
        ("admin search", f"/admin/jobs/trainingjob/?q={rare}", "/admin/jobs/trainingjob/?q=tiny-000003",
         ADMIN_P95_MS),
        ("admin deep page", f"/admin/jobs/trainingjob/?p={admin_deep}", "/admin/jobs/trainingjob/",
         ADMIN_P95_MS),
    ]
    return out


def measure(client, url: str, n: int) -> tuple[list[float], int, int, float]:
    """Times (ms) of ``n`` GETs after 3 warm-ups; the query count, status and summed SQL time (ms, as
    Django's cursor wrapper times each query) of one more."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    for _ in range(3):
        client.get(url)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.get(url)
        times.append((time.perf_counter() - t0) * 1000)
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    sql_ms = sum(float(q["time"]) for q in ctx.captured_queries) * 1000
    return times, len(ctx.captured_queries), response.status_code, sql_ms


def count_queries(client, url: str) -> tuple[int, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.get(url)
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    return len(ctx.captured_queries), response.status_code


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc)
    with bench_database(args.server, args.db_name, reuse=args.reuse, keep=args.keep):
        from django.contrib.auth import get_user_model
        from django.test import Client

        from jobs.models import ComputeBackend, MetricPoint, TrainingJob

        if not args.reuse:
            load(args)
        User = get_user_model()
        big, small = User.objects.get(username="bench"), User.objects.get(username="small")
        n_jobs, n_points = TrainingJob.objects.count(), MetricPoint.objects.count()
        big_backend = ComputeBackend.objects.get(owner=big, name="aws").pk
        small_backend = ComputeBackend.objects.get(owner=small, name="aws").pk
        big_client, small_client = Client(), Client()
        big_client.force_login(big)
        small_client.force_login(small)
        try:
            load_avg = os.getloadavg()
        except OSError:
            load_avg = (float("nan"),) * 3
        print(f"\n{started:%Y-%m-%d %H:%M} UTC · {n_jobs:,} jobs · {n_points:,} metric points · "
              f"{args.requests} timed requests per page · load average before {load_avg[0]:.2f} "
              f"{load_avg[1]:.2f} {load_avg[2]:.2f} · {os.cpu_count()} CPUs\n")
        print(f"{'page':<20} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'target':>7} {'sql ms':>7} {'q small':>8} "
              f"{'q big':>6}  result  url")
        failures = []
        first_queries: dict[str, int] = {}
        wanted = [w.strip() for w in args.pages.split(",") if w.strip()]
        for label, url, small_url, target in pages(args, big_backend, small_backend, big):
            if wanted and not any(w in label for w in wanted):
                continue
            times, q_big, status, sql_ms = measure(big_client, url, args.requests)
            q_small, small_status = count_queries(small_client, small_url)
            kind = label.split()[0]
            first_queries.setdefault(kind, q_big)
            ok_time = p95(times) <= target
            ok_queries = q_small == q_big
            verdict = "ok" if ok_time and ok_queries and status == 200 == small_status else "MISS"
            if verdict != "ok":
                failures.append(label)
            print(f"{label:<20} {statistics.median(times):>8.1f} {p95(times):>8.1f} {max(times):>8.1f} "
                  f"{target:>7.0f} {sql_ms:>7.1f} {q_small:>8} {q_big:>6}  {verdict:<6}  {url}"
                  + ("" if status == 200 == small_status else f"  (HTTP {status}/{small_status})"))
        try:
            load_after = os.getloadavg()[0]
        except OSError:
            load_after = float("nan")
        print(f"\nload average after {load_after:.2f}. sql ms: the database's share of one request (its queries' "
              "times summed). q small / q big: SQL queries of one request by a user with 10 jobs and by the "
              "user with all the others (same page shape).")
        print("targets missed: " + (", ".join(failures) if failures else "none"))
        return 1 if failures and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
