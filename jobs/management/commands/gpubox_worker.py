"""``manage.py gpubox_worker <backend name>``: the Celery worker of one GPU box.

    python manage.py gpubox_worker box-a                # on box-a: consume gpubox.box-a
    python manage.py gpubox_worker box-a --print        # only print the celery command
    TRAINBOARD_GPUBOX_NAME=box-a python manage.py gpubox_worker   # the name from the environment

Each GPU-box backend has its own Celery queue, ``gpubox.<name>`` (``GpuBoxBackend.queue_for``):
its jobs are started, synced and cancelled by the worker on that machine only, so run this once on
every box, against the same database and broker as the web server. The command replaces itself
with ``celery -A webapp worker -Q gpubox.<name>`` (``exec``: Celery gets the signals a supervisor or
``docker stop`` sends), with a node name of its own so several boxes' workers are told apart. It
consumes the box's queue only; the default queue (``celery``) is served by the other workers.

The backend need not exist yet (a box's container may start before an admin creates its row); the
command says so and starts anyway, since the queue is named from the name alone.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from cloud_adapters import registry
from jobs.models import ComputeBackend

KIND = "gpubox"
"""The backend kind whose workers this command starts (its adapter names the queue)."""
NAME_VARIABLE = "TRAINBOARD_GPUBOX_NAME"
"""The environment variable naming the box when no name is given (docker-compose.yml sets it)."""


def worker_command(name: str, *, concurrency: int, loglevel: str) -> list[str]:
    """The argument list of the Celery worker for the GPU box named ``name``: ``celery -A webapp
    worker -Q gpubox.<name> -n gpubox-<name>@%h --concurrency N --loglevel L``, with the ``celery``
    beside this interpreter. Raises ValueError for a name that is not a slug (no queue can be named
    from it)."""
    queue = registry.backend_class(KIND).queue_for(name, {})
    celery = str(Path(sys.executable).parent / "celery")
    return [celery, "-A", "webapp", "worker", "-Q", queue, "-n", f"gpubox-{name}@%h",
            "--concurrency", str(concurrency), "--loglevel", loglevel]


class Command(BaseCommand):
    help = (
        "Start the Celery worker of one GPU box: it consumes the box's own queue, gpubox.<name>, and "
        "runs that backend's jobs on this machine. Run it on every box (same database and broker as "
        f"the web server). The name defaults to ${NAME_VARIABLE}."
    )

    def add_arguments(self, parser):
        parser.add_argument("name", nargs="?", default=None,
                            help=f"The GPU-box backend's name, e.g. box-a (default: ${NAME_VARIABLE}).")
        parser.add_argument("--concurrency", type=int, default=2,
                            help="Worker processes (default 2; tasks submit, poll and cancel in seconds, "
                                 "training runs outside the worker).")
        parser.add_argument("--loglevel", default="INFO", help="Celery log level (default INFO).")
        parser.add_argument("--print", action="store_true", dest="print_only",
                            help="Print the celery command instead of running it.")

    def handle(self, *args, **opts):
        name = (opts["name"] or os.environ.get(NAME_VARIABLE, "")).strip()
        if not name:
            raise CommandError(f"Name the GPU box: manage.py gpubox_worker <backend name>, or set {NAME_VARIABLE}.")
        if opts["concurrency"] < 1:
            raise CommandError(f"--concurrency must be at least 1, got {opts['concurrency']}.")
        try:
            argv = worker_command(name, concurrency=opts["concurrency"], loglevel=opts["loglevel"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        queue = argv[argv.index("-Q") + 1]
        kinds = sorted(set(ComputeBackend.objects.filter(name=name).values_list("kind", flat=True)))
        if KIND not in kinds:
            found = f" (there is a {', '.join(kinds)} backend of that name)" if kinds else ""
            self.stderr.write(f"No GPU-box backend is named {name} yet{found}; this worker will serve "
                              f"{queue} once one is created with that name.")
        if opts["print_only"]:
            self.stdout.write(shlex.join(argv))
            return
        self.stderr.write(f"Starting the worker of GPU box {name}: {shlex.join(argv)}")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(argv[0], argv)
