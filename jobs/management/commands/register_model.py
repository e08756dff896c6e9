"""``manage.py register_model``: register a model whose code is yours, the way the dashboard does.

    python manage.py register_model --name tiny --code ./tiny.zip --entry-point mymodel.net:build \\
        --param width=256 --shard-class Block --owner alice
    python manage.py register_model --name mytrain --code /srv/trainboard/code/mytrain --script train.py \\
        --script-arg=--epochs --script-arg=3 --owner alice --json

The model is created by ``jobs.services.model_spec_create`` (same checks, same archive store as the
form and the API; ``--update`` changes the owner's model of that name with ``model_spec_update``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from jobs import selectors, services, validation
from jobs.models import FRAMEWORKS, ModelSpec

EXIT_OK, EXIT_BAD_INPUT = 0, 2


class Command(BaseCommand):
    help = (
        "Register a model of your own code: an archive (.zip, .tar.gz) or a directory under "
        "TRAINBOARD_CODE_ROOTS, with --entry-point package.module:function (your model, Trainboard's "
        "trainer) or --script train.py | '-m package.module' (your training script). The code is checked "
        "without being imported and stored once by its SHA-256. Exit status: 0 registered, 2 bad input "
        "(every message is printed)."
    )

    def add_arguments(self, parser):
        what = parser.add_argument_group("the model")
        what.add_argument("--name", required=True, help="Model name, unique among the owner's, e.g. tiny-gpt.")
        what.add_argument("--description", default="", help="Shown in the dashboard.")
        what.add_argument("--code", required=True, metavar="PATH",
                          help="A .zip or .tar.gz file, or a directory under TRAINBOARD_CODE_ROOTS.")
        kind = what.add_mutually_exclusive_group(required=True)
        kind.add_argument("--entry-point", metavar="PACKAGE.MODULE:FUNCTION",
                          help="Your model: a function returning a torch.nn.Module, called with num_classes, "
                               "input_shape and the --param values.")
        kind.add_argument("--script", metavar="FILE_OR_-m_MODULE",
                          help="Your training script: a .py file in the archive (train.py) or '-m package.module'.")
        what.add_argument("--script-arg", action="append", default=[], metavar="ARG", dest="script_args",
                          help="With --script: one argument, repeatable, in order. Write --script-arg=--epochs for "
                               "an argument that starts with a dash.")
        what.add_argument("--framework", default="torch", choices=FRAMEWORKS,
                          help="With --script: how its processes start: torch (torchrun's variables; default), "
                               "tensorflow (TF_CONFIG), ray (a Ray cluster over the job's nodes) or mpi (mpirun). "
                               "See docs/user-code.md.")
        what.add_argument("--shard-class", action="append", default=[], metavar="CLASS", dest="shard_classes",
                          help="With --entry-point, FSDP: a class name sharded with its own fully_shard (repeatable; "
                               "none = each top-level child).")
        what.add_argument("--param", action="append", default=[], metavar="KEY=JSON", dest="params",
                          help="With --entry-point: a keyword argument of your function, the value as JSON "
                               "(width=256, name='\"small\"', sizes=[1,2]); repeatable.")
        what.add_argument("--image", default="", metavar="URI",
                          help="A container image for this model's jobs (ECR, Artifact Registry or ACR URI).")
        who = parser.add_argument_group("owner")
        who.add_argument("--owner", required=True, metavar="USERNAME", help="Who owns the model.")
        who.add_argument("--team", default=None, metavar="TEAM", help="Share it with one of the owner's teams.")
        run = parser.add_argument_group("output")
        run.add_argument("--update", action="store_true",
                         help="Change the owner's model of this name (new code, entry point ...) instead of "
                              "refusing the name as taken.")
        run.add_argument("--json", action="store_true", help="Print one JSON object describing the model on stdout.")

    def _bad_input(self, lines: list[str]):
        raise CommandError("the model was not registered:\n  " + "\n  ".join(lines), returncode=EXIT_BAD_INPUT)

    def handle(self, *args, **opts):
        problems: list[str] = []
        owner = get_user_model().objects.filter(username=opts["owner"]).first()
        if owner is None:
            self._bad_input([f"--owner: no user named {opts['owner']!r}."])
        team = None
        if opts["team"]:
            team = selectors.team_list_for_user(user=owner).filter(name=opts["team"]).first()
            if team is None:
                problems.append(f"--team: {opts['owner']} is not a member of a team named {opts['team']!r}.")
        params = self._params(opts["params"], problems)
        is_script = opts["script"] is not None
        fields: dict[str, Any] = {
            "name": opts["name"], "description": opts["description"],
            "kind": ModelSpec.Kind.SCRIPT if is_script else ModelSpec.Kind.CODE,
            "entry_point": opts["script"] if is_script else opts["entry_point"],
            "script_args": opts["script_args"], "shard_classes": opts["shard_classes"], "image": opts["image"],
            "params": params if params is not None else {}, "framework": opts["framework"],
        }
        if opts["framework"] != "torch" and not is_script:  # the service's message speaks of the form's kinds
            problems.append(f"--framework {opts['framework']}: only a training script runs under "
                            f"{opts['framework']} (Trainboard's own trainer is PyTorch): give --script instead of "
                            f"--entry-point, or leave --framework out (torch).")
        if team is not None:
            fields["team"] = team
        existing = None
        if opts["update"]:
            existing = ModelSpec.objects.filter(owner=owner, name=opts["name"]).first()
            if existing is None:
                problems.append(f"--update: {opts['owner']} has no model named {opts['name']!r}; leave --update out "
                                f"to register it.")
        code, code_handle = self._code(opts["code"], problems)
        try:
            model = self._create(owner, fields, code, existing, problems, opts)
        finally:
            if code_handle is not None:
                code_handle.close()
        if model is None:
            self._bad_input(problems)
        archive = model.code
        self.stderr.write(f"model {model.name} {'updated' if existing else 'registered'} (id {model.pk}): "
                          f"kind {model.kind}, {model.entry_point}, archive {archive.short_sha} "
                          f"({archive.file_count} file{'s' if archive.file_count != 1 else ''}, {archive.size_bytes:,} "
                          f"bytes{', with requirements.txt' if archive.requirements else ''})")
        if opts["json"]:
            self.stdout.write(json.dumps(self._summary(model)))

    _OPTIONS = {"name": "--name", "description": "--description", "code": "--code", "script_args": "--script-arg",
                "shard_classes": "--shard-class", "params": "--param", "image": "--image", "team": "--team",
                "framework": "--framework"}

    def _create(self, owner, fields: dict[str, Any], code: Any, existing: ModelSpec | None, problems: list[str],
                opts: dict[str, Any]) -> ModelSpec | None:
        """The model, or None with every message in ``problems``. With problems already found here,
        the service still runs, so its messages on the other options come in the same run: it is
        given a team it refuses (its messages for the options already reported are dropped), so it
        stores nothing."""
        reported = {f for f, option in self._OPTIONS.items() if any(p.startswith(option + " ") or
                                                                    p.startswith(option + ":") for p in problems)}
        if opts["update"] and existing is None:
            reported.add("name")
        if problems:
            fields = {**fields, "team": "not-a-team"}
            reported.add("team")
            if code is None:
                reported.add("code")
        kwargs = {**fields, **({"code": code} if code is not None else {})}
        try:
            if existing is not None:
                return services.model_spec_update(model_spec=existing, **kwargs)
            return services.model_spec_create(owner=owner, **kwargs)
        except ValidationError as exc:
            entry_option = "--script" if fields["kind"] == ModelSpec.Kind.SCRIPT else "--entry-point"
            for field, messages in exc.message_dict.items():
                if field in reported:
                    continue
                option = entry_option if field == "entry_point" else self._OPTIONS.get(field, f"--{field.replace('_', '-')}")
                problems.extend(m if field == "__all__" else f"{option}: {m}" for m in messages)
        return None

    def _summary(self, model: ModelSpec) -> dict[str, Any]:
        archive = model.code
        return {"id": model.pk, "name": model.name, "owner": model.owner.get_username(), "kind": model.kind,
                "entry_point": model.entry_point, "script_args": model.script_args, "framework": model.framework,
                "shard_classes": model.shard_classes, "params": model.params, "image": model.image,
                "team": model.team.name if model.team_id else None,
                "code": {"sha256": archive.sha256, "size_bytes": archive.size_bytes, "file_count": archive.file_count,
                         "requirements": archive.requirements, "path": str(archive.path)}}

    def _params(self, items: list[str], problems: list[str]) -> dict[str, Any] | None:
        params: dict[str, Any] = {}
        for item in items:
            key, sep, text = item.partition("=")
            if not sep or not key.strip():
                problems.append(f"--param {item}: expected KEY=JSON, e.g. width=256.")
                continue
            try:
                params[key.strip()] = validation.loads(text)
            except validation.JSONInputError as exc:
                problems.append(f"--param {item}: the value must be JSON (a number, true, [1, 2], or a string in "
                                f"double quotes: {key}='\"text\"'): {exc}")
        return None if len(params) != len(items) else params

    def _code(self, path_text: str, problems: list[str]):
        """The service's ``code``: an open archive file, or a directory's absolute path (relative paths
        are relative to the current directory here, as a shell user means them)."""
        path = Path(os.path.abspath(path_text))
        if path.is_dir():
            return str(path), None
        if not path.is_file():
            problems.append(f"--code: {path_text} is neither a file nor a directory.")
            return None, None
        try:
            handle = open(path, "rb")
        except OSError as exc:
            problems.append(f"--code: {path_text} cannot be read ({exc.strerror}).")
            return None, None
        return handle, handle
