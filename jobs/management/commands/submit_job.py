"""``manage.py submit_job``: launch a training job from the shell, the same way the dashboard does.

    python manage.py submit_job --dataset digits --model digits-cnn --backend local \\
        --nodes 1 --procs-per-node 2 --epochs 3 --wait --json

A script model (kind script) that reads its own data needs no ``--dataset``; any other model does
(the service says so, exit 2). The job is created by ``jobs.services.training_job_create`` (same
validation, same frozen config)
and driven by the Celery worker and beat; ``--wait`` only watches the database.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from typing import Any, Iterable

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.conf import settings
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from jobs import job_request, selectors, services, validation
from jobs.cost import format_usd
from jobs.models import TrainingJob
from jobs.validation import Errors
from trainer_pkg.world_shape import describe_world

EXIT_OK, EXIT_NOT_SUCCEEDED, EXIT_BAD_INPUT = 0, 1, 2

_GROUPS = {"what": "what to train", "job": "what to train", "shape": "cluster shape", "training": "training",
           "large": "large models", "environment": "environment", "limits": "limits"}
"""submit_job's option groups, by the job request's ``group``, in --help's order."""
_NAMED = ("dataset", "model_spec", "backend", "team", "env")
"""Request fields this command asks for its own way: rows by name, ``--env`` repeated."""
_METAVARS = {"int": "N", "float": "X", "decimal": "USD", "text": "TEXT", "object": "JSON"}


def _option(field: str) -> str:
    try:
        return job_request.request_field(field).cli_option
    except StopIteration:
        return "--" + field.replace("_", "-")


def add_job_request_options(parser: argparse.ArgumentParser, groups: dict[str, Any],
                            fields: Iterable[job_request.RequestField] = job_request.JOB_REQUEST) -> None:
    """One option per job request field (but :data:`_NAMED`), with the declaration's help, default,
    choices and bounds: ``--epochs N``, ``--activation-checkpointing/--no-activation-checkpointing``,
    ``--checkpoint-format {full,sharded}``. Values are checked by the service, not argparse, so every
    bad one is reported at once (exit 2)."""
    for field in fields:
        if field.name in _NAMED:
            continue
        group = groups.get(field.group) or groups.setdefault(field.group, parser.add_argument_group(field.group))
        text = field.help
        if field.minimum is not None and field.maximum is not None:
            text += f" ({field.minimum} to {field.maximum}"
        elif field.minimum is not None:
            text += f" (at least {field.minimum}"
        else:
            text += " ("
        if field.optional:
            text += ("; " if text[-1] != "(" else "") + "default: the trainer's" if field.config else ""
        elif field.default is not None and field.default != "" and field.default is not False:
            text += ("; " if text[-1] != "(" else "") + f"default: {field.default}"
        text = text + ")" if not text.endswith(" (") else text[:-2]
        kwargs: dict[str, Any] = dict(dest=field.name, help=text.replace("%", "%%"))
        if field.kind == "bool":
            kwargs.update(action=argparse.BooleanOptionalAction if field.optional else "store_true",
                          default=field.default)
        else:
            kwargs.update(default=field.default, metavar="{" + ",".join(field.choices) + "}" if field.choices
                          else "SECONDS" if field.name.endswith("_s") else _METAVARS.get(field.kind))
            if field.kind in ("int", "float"):
                kwargs["type"] = int if field.kind == "int" else float
        group.add_argument(field.cli_option, **kwargs)


class Command(BaseCommand):
    help = (
        "Launch a distributed training job (same validation as the dashboard and the API). "
        "Datasets, models and backends are named as their owner (--user) named them. Exit status: "
        "0 job created (with --wait: SUCCEEDED), 1 the job ended otherwise or --timeout passed, "
        "2 bad input (the validation messages are printed)."
    )

    def add_arguments(self, parser):
        what = parser.add_argument_group("what to train")
        what.add_argument("--dataset", default=None, help=(
            "Dataset name (or id), e.g. digits. Required, except for a script model (kind script) that reads its "
            "own data: leave it out there."))
        what.add_argument("--model", required=True, help="Model name (or id), e.g. digits-cnn.")
        what.add_argument("--backend", required=True, help="Compute backend name (or id), e.g. local.")
        what.add_argument("--team", default=None, metavar="TEAM",
                          help="Run it for one of your teams (its members see it; its monthly budget applies).")
        groups = {"what": what, "job": what}
        groups.update({key: parser.add_argument_group(title) for key, title in _GROUPS.items() if key not in groups})
        add_job_request_options(parser, groups)
        groups["environment"].add_argument(
            "--env", action="append", default=[], metavar="KEY=VALUE",
            help="An environment variable of the job's processes (repeatable); the launcher's and the platforms' own "
                 "names (RANK, PYTHONPATH, TRAINBOARD_*, SM_*, ...) are refused.")
        run = parser.add_argument_group("running")
        run.add_argument("--user", default=None, metavar="USERNAME",
                         help="Owner of the job (default: the only, else the first, superuser).")
        run.add_argument("--wait", action="store_true",
                         help="Wait until the job ends, printing progress on stderr (a worker and beat must run).")
        run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                         help="With --wait: give up after this long (default: max runtime + 10 minutes).")
        run.add_argument("--poll-interval", type=float, default=0.5, metavar="SECONDS",
                         help="With --wait: how often to look at the database (default: 0.5).")
        run.add_argument("--json", action="store_true", help="Print one JSON object describing the job on stdout.")

    # -- input ----------------------------------------------------------------------------------
    # Every bad flag is reported at once (validation.Errors), the service's own checks included.

    def _owner(self, errors: Errors, username):
        users = get_user_model().objects
        if username:
            user = users.filter(username=username).first()
            if user is None:
                errors.add("user", f"no user named {username!r}.")
            return user
        user = users.filter(is_superuser=True, is_active=True).order_by("pk").first()
        if user is None:
            errors.add("user", "there is no superuser; create one (manage.py createsuperuser) or pass --user.")
        return user

    def _named(self, errors: Errors, qs, name: str, field: str, what: str, owner=None):
        """The row of ``qs`` (what the owner may use) named ``name``, as the API resolves a name
        (``validation.named_row``: one your own and a team's share is an error listing the ids); a
        number that no row is named is taken as the id."""
        if name.isascii() and name.isdigit() and len(name) < 19 and not qs.filter(name=name).exists():
            by_id = qs.filter(pk=int(name)).first()
            if by_id is not None:
                return by_id
        known = ", ".join(qs.order_by("name").values_list("name", flat=True)[:50]) or "none yet"
        return validation.named_row(errors, field, qs, name, owner, what,
                                    missing=f"you have no {what} named {name!r} (yours: {known}).")

    def _env(self, errors: Errors, items: list[str]) -> dict[str, str]:
        """``--env KEY=VALUE`` options as a dict (the service checks names and values); an option
        without ``=``, or a name given twice, is an error on ``env`` and left out."""
        env: dict[str, str] = {}
        for item in items:
            name, sep, value = item.partition("=")
            if not sep:
                errors.add("env", f"{item[:60]!r} is not KEY=VALUE (e.g. --env WANDB_PROJECT=vision).")
            elif name in env:
                errors.add("env", f"{name[:60]} is given twice; keep one.")
            else:
                env[name] = value
        return env

    # -- run ------------------------------------------------------------------------------------

    def handle(self, *args, **opts):
        errors = Errors()
        owner = self._owner(errors, opts["user"])
        dataset = model = backend = team = None
        if owner is not None:
            if opts["dataset"] is not None:  # left out: the service says where the model needs one
                dataset = self._named(errors, selectors.dataset_list_for_user(user=owner), opts["dataset"], "dataset",
                                      "dataset", owner)
            model = self._named(errors, selectors.model_spec_list_for_user(user=owner), opts["model"], "model_spec",
                                "model", owner)
            backend = self._named(errors, selectors.backend_list_for_user(user=owner), opts["backend"], "backend",
                                  "backend", owner)
            if opts["team"]:
                team = self._named(errors, selectors.team_list_for_user(user=owner), opts["team"], "team", "team",
                                   owner)
        env = self._env(errors, opts["env"])

        request = {f.name: opts[f.name] for f in job_request.JOB_REQUEST if f.name in opts}
        request.update(dataset=dataset, model_spec=model, backend=backend, team=team, env=env)
        # With errors of its own the request is still checked (training_job_check writes nothing), so
        # every error shows at once; its messages on what it saw no value for (a name not found) are
        # dropped, ours say why.
        not_seen = {f for f in errors if f != "env"} | ({"dataset", "model_spec", "backend", "team"}
                                                        if owner is None else set())
        job, exc = None, None
        try:
            if errors:
                services.training_job_check(owner=owner, **request)
            else:
                job = services.training_job_create(owner=owner, **request)
        except ValidationError as refused:
            exc = validation.unflagged_errors(refused, not_seen) if errors else refused
        if exc is not None:
            for field, messages in exc.message_dict.items():
                for message in messages:
                    errors.add(field, message)
        if errors:
            lines = [f"{_option(f)}: {m}" if f != validation.ALL else m for f, msgs in errors.items() for m in msgs]
            raise CommandError("the job was not created:\n  " + "\n  ".join(lines), returncode=EXIT_BAD_INPUT)
        self.stderr.write(f"job {job.pk} queued on {backend.name} ({describe_world(job.nodes, job.procs_per_node)}, "
                          f"estimate ≤ {format_usd(job.estimated_cost_usd, job.money_places)})")
        timed_out = False
        if opts["wait"]:
            timeout = opts["timeout"] if opts["timeout"] is not None else job.max_runtime_s + 600
            job, timed_out = self._wait(job, timeout, max(opts["poll_interval"], 0.05))
        if opts["json"]:
            self.stdout.write(json.dumps(self._summary(job), sort_keys=False))
        if opts["wait"]:
            if timed_out:
                raise CommandError(f"job {job.pk} still {job.state} after the timeout.", returncode=EXIT_NOT_SUCCEEDED)
            if job.state != "SUCCEEDED":
                reason = f": {job.failure_reason}" if job.failure_reason else ""
                raise CommandError(f"job {job.pk} ended {job.state}{reason}", returncode=EXIT_NOT_SUCCEEDED)

    def _wait(self, job: TrainingJob, timeout: float, interval: float) -> tuple[TrainingJob, bool]:
        """Print the job's history as it happens (:func:`jobs.selectors.training_job_progress`: every
        transition, each epoch before the final state), each line stamped with its own UTC time,
        until it ends or ``timeout`` seconds pass; returns (the job as last read, whether it timed out)."""
        deadline = time.monotonic() + timeout
        _, cursor = selectors.training_job_progress(job=job)  # its creation: "queued" said that
        while True:
            job = TrainingJob.objects.get(pk=job.pk)  # before its history, which then holds its end
            lines, cursor = selectors.training_job_progress(job=job, after=cursor)
            for at, text in lines:
                self.stderr.write(f"{timezone.localtime(at, dt.timezone.utc):%H:%M:%S} job {job.pk}: {text}")
            if job.is_terminal:
                return job, False
            if time.monotonic() > deadline:
                return job, True
            time.sleep(interval)

    def _summary(self, job: TrainingJob) -> dict:
        try:
            url = reverse("job-detail", args=[job.pk])
        except NoReverseMatch:
            url = f"/jobs/{job.pk}/"
        url = f"{settings.TRAINBOARD_BASE_URL}{url}"
        final = selectors.training_job_final_metrics(job=job)
        # The three headline metrics are always keys (None before the first epoch); every other series
        # the job stored, a script's own report.log names included, adds its last value.
        metrics = {k: final[k] for k in ("val_accuracy", "val_loss", "train_loss")}
        for name, summary in selectors.training_job_metric_summary(job=job).items():
            if name not in metrics:
                metrics[name] = summary["last_value"]
        duration = job.duration_s
        return {
            "id": job.pk,
            "state": job.state,
            "url": url,
            "cost_usd": float(job.cost_usd),
            "duration_s": round(duration, 3) if duration is not None else None,
            "failure_reason": job.failure_reason,
            "code_sha256": job.code.sha256 if job.code_id else None,
            "image": job.image,
            "metrics": metrics,
            "events": [{"from": e.from_state or None, "to": e.to_state, "at": e.created_at.isoformat()}
                       for e in selectors.training_job_events(job=job)],
        }
