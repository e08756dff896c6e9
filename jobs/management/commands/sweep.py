"""``manage.py sweep``: start, list, show and cancel hyperparameter sweeps (docs/sweeps.md).

    python manage.py sweep create --from-file spec.json --user alice
    python manage.py sweep list
    python manage.py sweep show 3
    python manage.py sweep cancel 3

``spec.json`` holds what ``POST /api/sweeps/`` takes (``name``, ``base``, ``search_space``, ``sampler``,
``objective_metric``, ``direction``, ``max_trials``, ``max_concurrent_trials``, ``budget_usd``,
``pruner`` ...); ``base`` may name its dataset, model and backend by name instead of id. The sweep
is created by ``jobs.sweeps.sweep_create`` (the same checks as the page and the API); a worker and
beat run its trials.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from jobs import selectors, sweeps, validation
from jobs.validation import JSONInputError, loads

EXIT_BAD_INPUT = 2
SPEC_EXAMPLE = {
    "name": "lr-search",
    "base": {"dataset": "digits", "model_spec": "digits-cnn", "backend": "local", "epochs": 2},
    "search_space": {"train.lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True}},
    "sampler": "tpe", "objective_metric": "val_accuracy", "direction": "maximize",
    "max_trials": 8, "max_concurrent_trials": 2, "budget_usd": 5.0, "pruner": "median",
}


class Command(BaseCommand):
    help = ("Hyperparameter sweeps with Optuna: create one from a JSON spec, list them, show one's trials, "
            "cancel one. Exit status 2 for bad input (every message printed). Spec example: "
            + json.dumps(SPEC_EXAMPLE))

    def add_arguments(self, parser):
        parser.add_argument("--user", default=None, metavar="USERNAME",
                            help="Whose sweeps (default: the only, else the first, superuser).")
        sub = parser.add_subparsers(dest="action", required=True, metavar="{create,list,show,cancel}")
        create = sub.add_parser("create", help="Start a sweep from a JSON spec file.")
        create.add_argument("--from-file", required=True, metavar="SPEC.json",
                            help="The sweep as POST /api/sweeps/ takes it; base.dataset, base.model_spec and "
                                 "base.backend may be names of yours.")
        create.add_argument("--json", action="store_true", help="Print the sweep as JSON.")
        listing = sub.add_parser("list", help="Your sweeps and your teams', newest first.")
        listing.add_argument("--json", action="store_true", help="One JSON array.")
        show = sub.add_parser("show", help="One sweep: progress, spend, best trial and every trial.")
        show.add_argument("sweep_id", type=int)
        show.add_argument("--json", action="store_true", help="One JSON object.")
        cancel = sub.add_parser("cancel", help="Cancel a sweep: no new trials, running trials cancelled.")
        cancel.add_argument("sweep_id", type=int)

    def _bad_input(self, message: str) -> None:
        self.stderr.write(message)
        sys.exit(EXIT_BAD_INPUT)

    def _user(self, username: str | None):
        users = get_user_model().objects
        if username:
            user = users.filter(username=username).first()
            if user is None:
                self._bad_input(f"--user: no user named {username!r}.")
            return user
        user = users.filter(is_superuser=True, is_active=True).order_by("pk").first()
        if user is None:
            self._bad_input("--user: there is no superuser; create one (manage.py createsuperuser) or pass --user.")
        return user

    def handle(self, *args, **options):
        user = self._user(options["user"])
        return getattr(self, f"_{options['action']}")(user, options)

    # -- create ---------------------------------------------------------------------------------

    def _create(self, user, options):
        path = Path(options["from_file"])
        try:
            spec = loads(path.read_text())
        except OSError as exc:
            self._bad_input(f"--from-file: cannot read {path}: {exc.strerror or exc}.")
        except (JSONInputError, UnicodeDecodeError) as exc:
            self._bad_input(f"--from-file: {path} is not valid JSON: {exc}.")
        if not isinstance(spec, dict):
            self._bad_input(f"--from-file: {path} must hold a JSON object, e.g. {json.dumps(SPEC_EXAMPLE)}")
        known = ("name", "team", "base", "search_space", "sampler", "seed", "objective_metric", "direction",
                 "objective", "max_trials", "max_concurrent_trials", "budget_usd", "pruner", "pruner_startup_trials",
                 "pruner_warmup_epochs")
        unknown = validation.Errors()
        validation.unknown_fields(unknown, spec, known, what="a sweep")
        if unknown:
            self._bad_input("\n".join(f"{path}: {m}" for messages in unknown.values() for m in messages))
        # base.dataset, base.model_spec and base.backend by id or name: the service resolves a name
        # among the rows the user may use (jobs.validation.owned).
        try:
            sweep = sweeps.sweep_create(owner=user, **{**spec, "name": spec.get("name", "")})
        except ValidationError as exc:
            for field, messages in exc.message_dict.items():
                for message in messages:
                    self.stderr.write(f"{field}: {message}" if field != "__all__" else message)
            sys.exit(EXIT_BAD_INPUT)
        if options["json"]:
            self.stdout.write(json.dumps(self._summary(sweep)))
        else:
            self.stdout.write(f"Sweep {sweep.pk} ({sweep.name}) started: up to {sweeps.trial_limit(sweep)} trials, "
                              f"{sweep.max_concurrent_trials} at a time. `manage.py sweep show {sweep.pk}` follows it.")

    # -- list / show / cancel ----------------------------------------------------------------------

    def _summary(self, sweep) -> dict:
        return {"id": sweep.pk, "name": sweep.name, "state": sweep.state, "sampler": sweep.sampler,
                "objective_metric": sweep.objective_metric, "direction": sweep.direction,
                "max_trials": sweep.max_trials, "max_concurrent_trials": sweep.max_concurrent_trials,
                "budget_usd": None if sweep.budget_usd is None else str(sweep.budget_usd), "message": sweep.message}

    def _list(self, user, options):
        rows = list(selectors.sweep_list_for_user(user=user)[:500])
        if options["json"]:
            self.stdout.write(json.dumps([self._summary(s) for s in rows]))
            return
        if not rows:
            self.stdout.write("No sweeps yet: `manage.py sweep create --from-file spec.json`.")
        for s in rows:
            self.stdout.write(f"{s.pk:>5}  {s.state:<15} {s.sampler:<7} {s.objective_metric} ({s.direction})  {s.name}")

    def _get(self, user, sweep_id: int):
        sweep = selectors.sweep_list_for_user(user=user).filter(pk=sweep_id).first()
        if sweep is None:
            raise CommandError(f"No sweep {sweep_id} of yours or your teams'.")
        return sweep

    def _show(self, user, options):
        sweep = self._get(user, options["sweep_id"])
        trials = sweeps.sweep_trials(sweep=sweep)
        progress = sweeps.sweep_progress(sweep=sweep, trials=trials)
        best = sweeps.best_trial(sweep, trials)
        if options["json"]:
            self.stdout.write(json.dumps({
                **self._summary(sweep), "progress": {k: str(v) if k.endswith("_usd") and v is not None else v
                                                     for k, v in progress.items()},
                "best_trial": best and {"number": best["number"], "value": best["value"], "params": best["params"]},
                "trials": [{**t, "cost_usd": None if t["cost_usd"] is None else str(t["cost_usd"])} for t in trials]}))
            return
        budget = f" of ${progress['budget_usd']:,.2f}" if progress["budget_usd"] is not None else ""
        self.stdout.write(f"Sweep {sweep.pk} {sweep.name}: {sweep.state}. {progress['done']} of {progress['limit']} "
                          f"trials done, {progress['running']} running; ${progress['spent_usd']:,.2f} spent{budget}.")
        if sweep.message:
            self.stdout.write(sweep.message)
        if best:
            self.stdout.write(f"Best: trial {best['number']} {sweep.objective_metric}={best['value']:.4g} "
                              f"{json.dumps(best['params'])}")
        for t in trials:
            value = "" if t["value"] is None else f"{t['value']:.4g}"
            job = f"job {t['job_id']}" if t["job_id"] else "no job"
            self.stdout.write(f"  #{t['number']:<3} {t['state']:<9} {value:<8} {job:<9} {json.dumps(t['params'])}"
                              + (f"  {t['message']}" if t["message"] else ""))

    def _cancel(self, user, options):
        sweep = self._get(user, options["sweep_id"])
        if not selectors.can_change(user=user, obj=sweep):
            raise CommandError(f"Sweep {sweep.pk} is {sweep.owner}'s; only its owner (or staff) can cancel it.")
        try:
            sweep = sweeps.sweep_cancel(sweep=sweep)
        except ValidationError as exc:
            raise CommandError(" ".join(exc.messages)) from None
        self.stdout.write(f"Sweep {sweep.pk} cancelled; its running trials are stopping.")
