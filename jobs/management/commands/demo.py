"""`python manage.py demo`: the whole product on one machine, for a first look.

Migrates the database, loads the shipped price catalog (`load_prices`), creates the demo user
(printing a fresh password), registers the built-in `digits` dataset, a `digits-cnn` model and a
`local` GPU-box backend, starts the web server, a Celery
worker (consuming the default queue and the box's own, ``gpubox.local``), a notifier (a Celery worker
for webhook deliveries and emails, the ``notifications`` queue) and Celery beat as child processes,
launches one 2-process DDP job and follows it. Runs until
Ctrl-C (or SIGTERM, or SIGHUP when its terminal closes: what it says from then on goes to
``var/logs/demo.log``), then cancels the training still running on this machine and stops every child
process.

The children go with the demo however it ends: each is started with the parent-death signal SIGTERM
(Linux ``prctl(PR_SET_PDEATHSIG)``), so a demo killed with SIGKILL still takes its web server,
workers and beat with it and frees its port. They run in sessions of their own so that Ctrl-C reaches
only the demo, which stops them in order. Every link the demo prints, and ``TRAINBOARD_BASE_URL`` of
its children (the links the worker and the CLI print), is ``http://--host:--port``.
"""

from __future__ import annotations

import ctypes
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

from jobs import adapters, lifecycle, selectors, services, sync
from jobs.models import ACTIVE_STATE_VALUES, TERMINAL_STATE_VALUES, ComputeBackend, Dataset, ModelSpec, TrainingJob

CHILD_STOP_GRACE_S = 15.0
"""Seconds the web server, workers and beat get to exit after SIGTERM before they are SIGKILLed."""
DEMO_EPOCHS = 150
"""Epochs of the demo job: about a minute of training for two processes on two CPU cores, so a
newcomer who logs in after the demo starts still sees the job running."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent_pid: int):
    """A ``preexec_fn`` for a child that must not outlive ``parent_pid``: runs in the forked child,
    sets its parent-death signal to SIGTERM and exits at once if the parent is already gone (it
    died between the fork and the prctl, so no death signal would ever come). The signal comes when
    the thread that started the child ends, so children are started from the main thread. Elsewhere
    than Linux it does nothing: the demo's own shutdown is then the only one that stops them."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # before the fork

    def preexec() -> None:
        if libc is None:
            return
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:
            os._exit(1)
    return preexec


class Command(BaseCommand):
    _box_queue: str | None = None
    """The queue of the demo's box that its worker consumes (``gpubox.local``); the shutdown cancels
    the active jobs on it, which run on this machine. None until the worker starts."""
    help = (
        "Run Trainboard locally: web server on --host:--port, Celery workers and beat, and one "
        "2-process DDP job on the digits dataset. Ctrl-C stops everything."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="web server address (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=8000, help="web server port (default 8000)")
        parser.add_argument("--username", default="demo", help="demo user name (default demo)")
        parser.add_argument("--procs-per-node", type=int, default=2,
                            help="processes (ranks) of the demo job (default 2)")
        parser.add_argument("--epochs", type=int, default=DEMO_EPOCHS,
                            help=f"epochs of the demo job; the default ({DEMO_EPOCHS}) trains for about a minute "
                                 f"on two CPU cores")
        parser.add_argument("--hourly-rate", default="0.50",
                            help="USD per hour charged by the local backend (default 0.50)")
        parser.add_argument("--no-job", action="store_true", help="start the services, launch no job")
        parser.add_argument("--exit-when-done", action="store_true",
                            help="stop once the demo job ends (exit 0 only if it SUCCEEDED)")

    def handle(self, *args, **opts):
        self._children: list[tuple[str, subprocess.Popen]] = []
        self._box_queue = None
        if _port_in_use(opts["host"], opts["port"]):
            raise CommandError(
                f"{opts['host']}:{opts['port']} is already in use. Stop what runs there or pass --port."
            )
        self.stdout.write("Migrating the database ...")
        call_command("migrate", interactive=False, verbosity=0)
        call_command("load_prices", stdout=self.stdout)  # the shipped price catalog, kept if edited
        user, password = self._demo_user(opts["username"])
        dataset, model, backend = self._demo_objects(user, opts["hourly_rate"])

        # The processes' logs (every job's activity, the web's access log): not a job's to read.
        log_dir = settings.VAR_DIR / "logs"
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(log_dir, 0o700)  # one made before it was private
        base_url = f"http://{opts['host']}:{opts['port']}"
        stopping = {"now": False}

        def on_signal(signum, frame):  # first Ctrl-C: shut down cleanly; handled in the loop
            if signum == signal.SIGHUP:
                # The terminal is gone and writing to it fails: what the shutdown says goes to a log.
                fd = os.open(log_dir / "demo.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
            stopping["now"] = True

        # SIGHUP: the demo's terminal closed; its children are not in that terminal's session.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, on_signal)
        try:
            self._start_children(opts, log_dir, base_url, adapters.backend_queue(backend))
            self._wait_for_web(base_url, log_dir)
            self.stdout.write(self.style.SUCCESS(f"\nTrainboard is up: {base_url}/"))
            self.stdout.write(f"  login:    {user.username}")
            self.stdout.write(f"  password: {password}")
            self.stdout.write(f"  admin:    {base_url}/admin/    API: {base_url}/api/docs/")
            self.stdout.write(f"  logs:     {log_dir}/{{web,worker,notifier,beat}}.log")
            isolation = adapters.backend_isolation(backend)  # docs/gpu-boxes.md "Isolation"
            if isolation is not None:
                self.stdout.write(f"  jobs:     {isolation.text}" if isolation.isolated else
                                  self.style.WARNING(f"  jobs:     {isolation.text}"))
            job = None if opts["no_job"] else self._launch_job(user, dataset, model, backend, opts, base_url)
            self.stdout.write("Press Ctrl-C to stop.\n")
            return self._follow(job, stopping, opts["exit_when_done"])
        finally:
            self._shutdown()

    # -- setup --------------------------------------------------------------------------------

    def _launch_job(self, user, dataset: Dataset, model: ModelSpec, backend: ComputeBackend, opts: dict,
                    base_url: str) -> TrainingJob | None:
        """The demo's DDP job on its box; None, saying why, when the box may not start it (an
        installation of several users whose box cannot isolate: the dashboard still comes up and
        its operator reads what to set, docs/gpu-boxes.md "Isolation")."""
        refusal = adapters.shared_uid_refusal(adapters.backend_adapter(backend))
        if refusal is not None:
            self.stdout.write(self.style.WARNING(f"\nNo demo job: {refusal}"))
            return None
        job = services.training_job_create(
            owner=user, dataset=dataset, model_spec=model, backend=backend,
            nodes=1, procs_per_node=opts["procs_per_node"], epochs=opts["epochs"],
            name="demo: digits-cnn DDP",
        )
        self.stdout.write(self.style.SUCCESS(f"\nDemo job launched: {base_url}/jobs/{job.pk}/"))
        return job

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

    def _start_children(self, opts, log_dir: Path, base_url: str, box_queue: str) -> None:
        """Start web, worker, notifier and beat; the worker consumes the default queue and ``box_queue``,
        the queue of the demo's ``local`` GPU box (``gpubox.local``), whose jobs run on this machine; the
        notifier the notifications queue (webhook deliveries and emails)."""
        self._box_queue = box_queue
        bin_dir = Path(sys.executable).parent
        env = {**os.environ, "TRAINBOARD_BASE_URL": base_url}
        celery = [str(bin_dir / "celery"), "-A", "webapp"]
        commands = {
            "web": [str(bin_dir / "gunicorn"), "webapp.wsgi:application", "--config", "python:webapp.gunicorn_conf",
                    "--bind", f"{opts['host']}:{opts['port']}", "--workers", "2", "--threads", "4",
                    "--access-logfile", "-"],
            "worker": celery + ["worker", "-Q", f"celery,{box_queue}", "--concurrency", "2", "--loglevel", "INFO"],
            # Webhook deliveries and emails wait on other servers: a worker of their own (settings.py).
            "notifier": celery + ["worker", "-Q", settings.TRAINBOARD_NOTIFICATIONS_QUEUE, "-n", "notifier@%h",
                                  "--concurrency", "1", "--loglevel", "INFO"],
            "beat": celery + ["beat", "--loglevel", "INFO"],
        }
        for name, argv in commands.items():
            log = open(log_dir / f"{name}.log", "ab")
            # Own session: Ctrl-C reaches only this command, which then stops the children in order.
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=settings.BASE_DIR, env=env, start_new_session=True,
                                    preexec_fn=_die_with_parent(os.getpid()))
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
        # Every transition and each epoch, in order (not the state seen once a second, which would
        # skip the states a single sync passes through); see selectors.training_job_progress.
        cursor, ended = (0, 0), False
        while not stopping["now"]:
            self._check_children()
            if job is not None and not ended:
                job.refresh_from_db()  # before its history, which then holds its end
                lines, cursor = selectors.training_job_progress(job=job, after=cursor)
                for _, text in lines:
                    self.stdout.write(f"[job {job.pk}] {text}")
                if job.is_terminal:
                    ended = True
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
                 if adapters.backend_queue(job.backend) == self._box_queue]
        for job in local:
            try:
                job = services.training_job_cancel(job=job, reason="Demo stopped with Ctrl-C")
            except ValidationError:  # it ended meanwhile
                continue
            # The worker is about to stop: send the stop now rather than through its queue.
            lifecycle.training_job_cancel_send(job=job)
            self.stdout.write(f"Cancelling job {job.pk}")
        if local:
            self._confirm_cancelled([job.pk for job in local])
        # SIGTERM to each main process only: gunicorn and Celery stop their own workers and pool.
        for name, proc in reversed(self._children):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + CHILD_STOP_GRACE_S
        for name, proc in reversed(self._children):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stderr.write(f"{name} did not stop within {CHILD_STOP_GRACE_S:g} s; killing it")
                # Not reaped yet, so its session's group id is still its own: it and its workers.
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
                    sync.backend_sync(backend_id=backend_id)
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
