"""Launch overhead on the gpubox backend: from the API call to the first training step, against bare
torchrun of the same job (target: p95 ≤ 5 s above torchrun's own start-up).

    .venv/bin/python bench/launch_overhead.py               # 10 dashboard runs and 10 bare torchrun runs, alternating
    .venv/bin/python bench/launch_overhead.py --quick       # 3 and 3
    .venv/bin/python bench/launch_overhead.py --runs 5 --procs 1 --keep-dir /tmp/launch

What it does, in one run:

1. creates a throwaway PostgreSQL database (``--db-name``, default ``trainboard_bench_launch``), a user,
   the digits dataset, a CNN model and a gpubox backend whose run root is a temporary directory; flushes
   Redis database ``--redis-db`` (default 10) and starts a real Celery worker with beat
   (``celery -A webapp worker -B -Q celery,gpubox``, prefork, 2 processes), sync interval as configured
   (``TRAINBOARD_SYNC_INTERVAL_S``, default 2 s);
2. alternates, ``--runs`` times each:
   - dashboard: ``POST /api/jobs/`` in this process (Django's test Client, a real on-commit publish to
     Redis), then waits for the job to finish; its times come from the database: the API call (t0,
     taken here just before the request), ``created_at``, the SUBMITTING and PENDING events (the worker
     took the task; the supervisor was spawned), ``first_step_at`` (the trainer's own ``started``
     record, written after its first optimizer step, Unix time from the trainer) and the RUNNING event
     (when a sync showed the first step to the dashboard);
   - bare torchrun: ``python -m torch.distributed.run --standalone --nproc_per_node N -m
     trainer_pkg.launch --config job.json`` with the job.json the dashboard run used (output to a fresh
     directory), timed from just before ``Popen`` to the same ``started`` record;
3. prints per-stage medians and p95, the overhead (dashboard time to first step − median bare
   time to first step, per run) and its p95 against the 5 s target.

Nothing is asserted (exit 0), or with ``--check`` exit 1 when p95 overhead > 5 s. Times are wall clock
on whatever else the machine runs; the two kinds alternate so drift hits both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

TARGET_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="runs of each kind (default 10)")
    p.add_argument("--quick", action="store_true", help="3 runs of each kind")
    p.add_argument("--procs", type=int, default=2, help="processes (ranks) per job (default 2)")
    p.add_argument("--server", default=os.environ.get("BENCH_PG_SERVER", "postgres://postgres@127.0.0.1:5432"),
                   help="PostgreSQL server URL without a database name")
    p.add_argument("--db-name", default="trainboard_bench_launch", help="throwaway database (dropped and created)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379", help="Redis server URL without a db number")
    p.add_argument("--redis-db", type=int, default=10, help="Redis database to flush and use (default 10)")
    p.add_argument("--keep-dir", help="keep run directories and the worker log here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one job (default 300)")
    p.add_argument("--check", action="store_true", help="exit 1 if p95 overhead > 5 s")
    args = p.parse_args(argv)
    if args.quick:
        args.runs = 3
    if args.runs < 1 or args.procs < 1:
        p.error("--runs and --procs must be at least 1")
    return args


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]


def started_time(metrics_file: Path) -> float | None:
    """Unix time of the trainer's ``started`` record in ``metrics.jsonl``, or None if not there yet."""
    if not metrics_file.exists():
        return None
    for line in metrics_file.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "started":
            return float(record["time"])
    return None


def start_worker(args: argparse.Namespace, env: dict[str, str], log_path: Path, beat_file: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "celery", "-A", "webapp", "worker", "-B",
               "--scheduler", "celery.beat:PersistentScheduler", "-s", str(beat_file),
               "-Q", "celery,gpubox", "--pool", "prefork", "-c", "2", "-n", f"launchbench-{os.getpid()}@%h",
               "--loglevel", "INFO", "--without-gossip", "--without-mingle"]
    log = open(log_path, "ab")
    return subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def dashboard_run(args, client, ids: dict[str, int], n: int) -> dict[str, Any]:
    """One job through POST /api/jobs/ and the real worker; stage times in seconds from the API call."""
    from jobs import sync
    from jobs.models import JobEvent, TrainingJob

    payload = {"dataset": ids["dataset"], "model_spec": ids["model"], "backend": ids["backend"], "nodes": 1,
               "procs_per_node": args.procs, "epochs": 1, "batch_size": 32, "seed": 7,
               "max_runtime_s": 600, "name": f"launch-{n}"}
    t0 = time.time()
    response = client.post("/api/jobs/", payload, format="json")
    t_response = time.time()
    if response.status_code != 201:
        raise SystemExit(f"POST /api/jobs/ answered {response.status_code}: {response.content[:500]!r}")
    job_id = response.json()["id"]
    deadline = time.monotonic() + args.timeout
    job = TrainingJob.objects.get(pk=job_id)
    while not job.is_terminal:
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id} still {job.state} after {args.timeout:.0f} s")
        time.sleep(0.5)
        job = TrainingJob.objects.get(pk=job_id)
    if job.state != "SUCCEEDED":
        raise SystemExit(f"job {job_id} ended {job.state}: {job.failure_reason}")
    if job.first_step_at is None:  # the sync that ended it also stored the log; one more just in case
        sync.backend_sync(backend_id=ids["backend"])
        job.refresh_from_db()
    events = {e.to_state: e.created_at.timestamp() for e in JobEvent.objects.filter(job_id=job_id)}
    return {
        "job": job_id, "run_dir": job.provider_handle["provider_job_id"],  # the gpubox handle is its run dir
        "api_response": t_response - t0,
        "created": job.created_at.timestamp() - t0,
        "submitting": events["SUBMITTING"] - t0,
        "pending": events["PENDING"] - t0,
        "first_step": job.first_step_at.timestamp() - t0,
        "running_seen": events.get("RUNNING", float("nan")) - t0,
    }


def bare_run(args, config_path: Path, work: Path, n: int) -> float:
    """Seconds from Popen of bare torchrun to the trainer's first step."""
    out = work / f"bare-{n}"
    config = json.loads(config_path.read_text())
    config.setdefault("output", {})["output_dir"] = str(out / "output")
    config["output"]["checkpoint_dir"] = str(out / "output" / "checkpoints")
    out.mkdir(parents=True)
    (out / "job.json").write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc_per_node", str(args.procs), "-m", "trainer_pkg.launch", "--config", str(out / "job.json")]
    with open(out / "train.log", "wb") as log:
        t0 = time.time()
        proc = subprocess.Popen(command, cwd=out, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
        rc = proc.wait(timeout=args.timeout)
    if rc != 0:
        raise SystemExit(f"bare torchrun exited {rc}; see {out / 'train.log'}")
    first = started_time(out / "output" / "metrics.jsonl")
    if first is None:
        raise SystemExit(f"no 'started' record in {out / 'output' / 'metrics.jsonl'}")
    return first - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from job_list import create_database, drop_database

    started = dt.datetime.now(dt.timezone.utc)
    work = Path(args.keep_dir).resolve() if args.keep_dir else Path(tempfile.mkdtemp(prefix="launchbench-"))
    work.mkdir(parents=True, exist_ok=True)
    run_root = work / "runs"
    run_root.mkdir(exist_ok=True)
    broker = f"{args.redis.rstrip('/')}/{args.redis_db}"
    # The box's host settings come from the installation, as on a real GPU box (the bench user is no staff).
    os.environ.update({"REDIS_URL": broker, "TRAINBOARD_RUN_ROOT": str(run_root),
                       "TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE": str(max(2, args.procs)),
                       "TRAINBOARD_VAR_DIR": str(work / "var")})
    (work / "var").mkdir(exist_ok=True)
    create_database(args.server, args.db_name)
    worker = None
    try:
        from job_list import setup_django

        setup_django(args.server, args.db_name)
        import redis
        from django.conf import settings
        from django.contrib.auth import get_user_model
        from django.core.management import call_command
        from rest_framework.test import APIClient

        from jobs import services

        call_command("migrate", verbosity=0, interactive=False)
        redis.Redis.from_url(broker).flushdb()
        user = get_user_model().objects.create_user("bench", "bench@example.com", "bench-pw-1")
        dataset = services.dataset_create(owner=user, name="digits", format="builtin", builtin_name="digits")
        model = services.model_spec_create(owner=user, name="digits-cnn", architecture="cnn",
                                           params={"channels": 16, "hidden_size": 64})
        backend = services.backend_create(owner=user, name="local", kind="gpubox", config={
            "hourly_rate_usd": 0, "grace_period_s": 3.0})
        ids = {"dataset": dataset.pk, "model": model.pk, "backend": backend.pk}
        env = dict(os.environ, DJANGO_SETTINGS_MODULE="webapp.settings", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
        worker = start_worker(args, env, work / "worker.log", work / "beat-schedule")
        client = APIClient()
        client.force_authenticate(user)
        try:
            load_avg = os.getloadavg()[0]
        except OSError:
            load_avg = float("nan")
        # A first job that is not counted: the worker's first task imports the adapters.
        warm = dashboard_run(args, client, ids, 0)
        config_path = Path(warm["run_dir"]) / "job.json"
        dashboard, bare = [], []
        for n in range(1, args.runs + 1):
            dashboard.append(dashboard_run(args, client, ids, n))
            bare.append(bare_run(args, config_path, work, n))
            d = dashboard[-1]
            print(f"run {n:2d}: dashboard first step {d['first_step']:6.2f} s (worker took it "
                  f"{d['submitting']:5.2f}, spawned {d['pending']:5.2f}, RUNNING seen {d['running_seen']:6.2f}) · "
                  f"bare torchrun first step {bare[-1]:6.2f} s", flush=True)

        bare_median = statistics.median(bare)
        stages = [
            ("API call → response", [d["api_response"] for d in dashboard]),
            ("API call → SUBMITTING (worker took the task)", [d["submitting"] for d in dashboard]),
            ("SUBMITTING → PENDING (submit: run dir, spawn)", [d["pending"] - d["submitting"] for d in dashboard]),
            ("PENDING → first step (torchrun, trainer)", [d["first_step"] - d["pending"] for d in dashboard]),
            ("API call → first step", [d["first_step"] for d in dashboard]),
            ("bare torchrun → first step", bare),
            ("first step → RUNNING shown (next sync)", [d["running_seen"] - d["first_step"] for d in dashboard]),
        ]
        overhead = [d["first_step"] - b for d, b in zip(dashboard, bare)]
        print(f"\n{started:%Y-%m-%d %H:%M} UTC · gpubox, digits cnn, 1 node × {args.procs} processes, 1 epoch · "
              f"{args.runs} runs each, alternating · sync interval {settings.TRAINBOARD_SYNC_INTERVAL_S:g} s · "
              f"load average before {load_avg:.2f} · {os.cpu_count()} CPUs\n")
        print(f"{'stage':<48} {'median s':>9} {'p95 s':>7}")
        for label, values in stages:
            print(f"{label:<48} {statistics.median(values):>9.2f} {p95(values):>7.2f}")
        print(f"{'overhead (pairwise: dashboard − bare)':<48} {statistics.median(overhead):>9.2f} {p95(overhead):>7.2f}")
        ok = p95(overhead) <= TARGET_S
        print(f"\np95 overhead {p95(overhead):.2f} s (target ≤ {TARGET_S:g} s: {'ok' if ok else 'MISS'}); "
              f"against the median bare run {p95([d['first_step'] - bare_median for d in dashboard]):.2f} s")
        return 1 if not ok and args.check else 0
    finally:
        if worker is not None:
            stop(worker)
        from django.db import connections

        connections.close_all()
        drop_database(args.server, args.db_name)
        if not args.keep_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
