"""`python manage.py demo`: the whole product on one machine, for a first look.

Migrates the database, loads the shipped price catalog (`load_prices`), creates the demo user
(printing a fresh password), registers the built-in `digits` dataset, a `digits-cnn` model and a
`local` GPU-box backend, starts the web server, a Celery
worker and Celery beat as child processes, launches one 2-process DDP job and follows it. Runs until
Ctrl-C, then stops every child process and cancels the training still running on this machine.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management import BaseCommand, CommandError, call_command

from jobs import selectors, services
from jobs.models import ACTIVE_STATE_VALUES, TERMINAL_STATE_VALUES, ComputeBackend, Dataset, ModelSpec, TrainingJob

LOCAL_QUEUES = {"gpubox"}  # queues whose jobs run on this machine (see the worker's -Q below)


class Command(BaseCommand):
    help = (
        "Run Trainboard locally: web server on --host:--port, a Celery worker and beat, and one "
        "2-process DDP job on the digits dataset. Ctrl-C stops everything."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="web server address (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=8000, help="web server port (default 8000)")
        parser.add_argument("--username", default="demo", help="demo user name (default demo)")
        parser.add_argument("--procs-per-node", type=int, default=2,
                            help="processes (ranks) of the demo job (default 2)")
        parser.add_argument("--epochs", type=int, default=3, help="epochs of the demo job (default 3)")
        parser.add_argument("--hourly-rate", default="0.50",
                            help="USD per hour charged by the local backend (default 0.50)")
        parser.add_argument("--no-job", action="store_true", help="start the services, launch no job")
        parser.add_argument("--exit-when-done", action="store_true",
                            help="stop once the demo job ends (exit 0 only if it SUCCEEDED)")

    def handle(self, *args, **opts):
        self._children: list[tuple[str, subprocess.Popen]] = []
        if _port_in_use(opts["host"], opts["port"]):
            raise CommandError(
                f"{opts['host']}:{opts['port']} is already in use. Stop what runs there or pass --port."
            )
        self.stdout.write("Migrating the database ...")
        call_command("migrate", interactive=False, verbosity=0)
        call_command("load_prices", stdout=self.stdout)  # the shipped price catalog, kept if edited
        user, password = self._demo_user(opts["username"])
        dataset, model, backend = self._demo_objects(user, opts["hourly_rate"])

        log_dir = settings.VAR_DIR / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        base_url = f"http://{opts['host']}:{opts['port']}"
        stopping = {"now": False}

        def on_signal(signum, frame):  # first Ctrl-C: shut down cleanly; handled in the loop
            stopping["now"] = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            self._start_children(opts, log_dir)
            self._wait_for_web(base_url, log_dir)
            self.stdout.write(self.style.SUCCESS(f"\nTrainboard is up: {base_url}/"))
            self.stdout.write(f"  login:    {user.username}")
            self.stdout.write(f"  password: {password}")
            self.stdout.write(f"  admin:    {base_url}/admin/    API: {base_url}/api/docs/")
            self.stdout.write(f"  logs:     {log_dir}/{{web,worker,beat}}.log")
            job = None
            if not opts["no_job"]:
                job = services.training_job_create(
                    owner=user, dataset=dataset, model_spec=model, backend=backend,
                    nodes=1, procs_per_node=opts["procs_per_node"], epochs=opts["epochs"],
                    name="demo: digits-cnn DDP",
                )
                self.stdout.write(self.style.SUCCESS(f"\nDemo job launched: {base_url}/jobs/{job.pk}/"))
            self.stdout.write("Press Ctrl-C to stop.\n")
            return self._follow(job, stopping, opts["exit_when_done"])
        finally:
            self._shutdown()

    # -- setup --------------------------------------------------------------------------------

    def _demo_user(self, username: str):
        User = get_user_model()
        user, _ = User.objects.get_or_create(username=username, defaults={"email": f"{username}@localhost"})
        password = secrets.token_urlsafe(12)
        user.set_password(password)
        user.is_staff = user.is_superuser = True
        user.save()
        return user, password

    def _demo_objects(self, user, hourly_rate: str):
        dataset = Dataset.objects.filter(owner=user, name="digits").first() or services.dataset_create(
            owner=user, name="digits", format="builtin", builtin_name="digits",
            description="scikit-learn's 1,797 handwritten digits, 8×8 pixels, 10 classes",
        )
        model = ModelSpec.objects.filter(owner=user, name="digits-cnn").first() or services.model_spec_create(
            owner=user, name="digits-cnn", architecture="cnn", params={},
            description="A small CNN for 8×8 digit images",
        )
        backend = ComputeBackend.objects.filter(owner=user, name="local").first() or services.backend_create(
            owner=user, name="local", kind="gpubox",
            config={"max_procs_per_node": max(2, os.cpu_count() or 1), "hourly_rate_usd": float(hourly_rate)},
        )
        return dataset, model, backend

    # -- child processes ----------------------------------------------------------------------

    def _start_children(self, opts, log_dir: Path) -> None:
        bin_dir = Path(sys.executable).parent
        celery = [str(bin_dir / "celery"), "-A", "webapp"]
        commands = {
            "web": [str(bin_dir / "gunicorn"), "webapp.wsgi:application",
                    "--bind", f"{opts['host']}:{opts['port']}", "--workers", "2", "--threads", "4",
                    "--access-logfile", "-"],
            "worker": celery + ["worker", "-Q", ",".join(["celery", *sorted(LOCAL_QUEUES)]), "--concurrency", "2", "--loglevel", "INFO"],
            "beat": celery + ["beat", "--loglevel", "INFO"],
        }
        for name, argv in commands.items():
            log = open(log_dir / f"{name}.log", "ab")
            # Own session: Ctrl-C reaches only this command, which then stops the children in order.
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=settings.BASE_DIR, start_new_session=True)
            log.close()
            self._children.append((name, proc))
            self.stdout.write(f"Started {name} (pid {proc.pid})")

    def _wait_for_web(self, base_url: str, log_dir: Path, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_children()
            try:
                with urllib.request.urlopen(f"{base_url}/healthz", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise CommandError(f"The web server did not answer within {timeout_s:.0f} s; see {log_dir}/web.log")

    def _check_children(self) -> None:
        for name, proc in self._children:
            if proc.poll() is not None:
                raise CommandError(
                    f"The {name} process exited with code {proc.returncode}; see "
                    f"{settings.VAR_DIR / 'logs' / (name + '.log')}"
                )

    def _follow(self, job: TrainingJob | None, stopping: dict, exit_when_done: bool):
        last_state, epochs_seen = None, set()
        while not stopping["now"]:
            self._check_children()
            if job is not None and last_state not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                job.refresh_from_db()
                if job.state != last_state:
                    self.stdout.write(f"[job {job.pk}] {job.state}")
                    last_state = job.state
                series = selectors.training_job_metric_series(job=job).get("val_accuracy", [])
                for point in series:
                    if point["epoch"] not in epochs_seen:
                        epochs_seen.add(point["epoch"])
                        self.stdout.write(f"[job {job.pk}] epoch {point['epoch']}: val_accuracy {point['value']:.4f}")
                if job.is_terminal:
                    self._summary(job)
                    if exit_when_done:
                        if job.state != "SUCCEEDED":
                            raise CommandError(f"The demo job ended {job.state}: {job.failure_reason}")
                        return
            time.sleep(1)
        self.stdout.write("\nStopping ...")

    def _summary(self, job: TrainingJob) -> None:
        def since_created(at):
            return f"{(at - job.created_at).total_seconds():.1f} s" if at else "n/a"

        style = self.style.SUCCESS if job.state == "SUCCEEDED" else self.style.ERROR
        self.stdout.write(style(
            f"[job {job.pk}] {job.state}: launch → first step {since_created(job.first_step_at)}, "
            f"launch → end {since_created(job.ended_at)}, cost ${job.cost_usd}"
        ))
        if job.failure_reason:
            self.stdout.write(self.style.ERROR(f"[job {job.pk}] {job.failure_reason}"))

    def _shutdown(self) -> None:
        # Training on this machine (the GPU-box queue this demo's worker served) runs detached from
        # the worker: stop it through the backend, whoever launched it, rather than leave it running.
        local = [job for job in TrainingJob.objects.filter(state__in=ACTIVE_STATE_VALUES).select_related("backend")
                 if services.backend_queue(job.backend) in LOCAL_QUEUES]
        for job in local:
            try:
                job = services.training_job_cancel(job=job, reason="Demo stopped with Ctrl-C")
            except ValidationError:  # it ended meanwhile
                continue
            # The worker is about to stop: send the stop now rather than through its queue.
            services.training_job_cancel_send(job=job)
            self.stdout.write(f"Cancelling job {job.pk}")
        if local:
            self._confirm_cancelled([job.pk for job in local])
        for name, proc in reversed(self._children):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for name, proc in reversed(self._children):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self.stdout.write(f"Stopped {name}")


    def _confirm_cancelled(self, job_ids: list[int], timeout_s: float = 20.0) -> None:
        """Sync the cancelled jobs' backends here (the worker may already be busy stopping) until each
        is CANCELLED, so the database does not keep them STOPPING until the next start. Each sync
        re-sends the stop, which escalates to SIGKILL after the backend's grace period."""
        deadline = time.monotonic() + timeout_s
        pending = set(job_ids)
        while pending and time.monotonic() < deadline:
            backends = set(TrainingJob.objects.filter(pk__in=pending).values_list("backend_id", flat=True))
            for backend_id in backends:
                try:
                    services.backend_sync(backend_id=backend_id)
                except Exception as exc:  # noqa: BLE001 — best effort on the way out; said, not raised
                    self.stderr.write(f"sync of backend {backend_id} on shutdown failed: {exc}")
            for job in TrainingJob.objects.filter(pk__in=pending, state__in=TERMINAL_STATE_VALUES):
                self.stdout.write(f"Job {job.pk} {job.state}")
                pending.discard(job.pk)
            if pending:
                time.sleep(0.5)
        for job_id in sorted(pending):
            self.stdout.write(f"Job {job_id} still stopping; the next start records how it ended")


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((host, port)) == 0
