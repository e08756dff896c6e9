"""``manage.py prepare_text``: turn text files into a token dataset and register it in the dashboard.

    python manage.py prepare_text data/kjv.txt --out var/datasets/kjv --vocab-size 4096 \\
        --name kjv --owner alice

The same options as ``python -m trainer_pkg.prepare_text`` (a byte-level BPE trained locally, the
text encoded into uint16/uint32 shards; see that module), plus ``--name`` and ``--owner``: the result
is then registered as a Dataset of format ``tokens`` by ``jobs.services.dataset_create`` (the same
checks as the form and the API; ``--out`` must lie inside TRAINBOARD_DATASET_ROOTS). Without
``--name`` it only prepares. Every problem with the options is reported before anything is written.
Exit status: 0 done, 2 bad input (every message printed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from jobs import services
from jobs.models import Dataset
from trainer_pkg import prepare_text as prep

EXIT_OK, EXIT_BAD_INPUT = 0, 2


class Command(BaseCommand):
    help = (
        "Turn UTF-8 text files into a token dataset (format tokens): train a byte-level BPE tokenizer "
        "locally (or reuse --tokenizer), encode the text into memory-mapped shards, and with --name and "
        "--owner register it as a dataset. Nothing is downloaded. Exit status: 0 done, 2 bad input "
        "(every message is printed)."
    )

    def add_arguments(self, parser):
        prep.add_arguments(parser)
        who = parser.add_argument_group("register the dataset")
        who.add_argument("--name", default="", help="Dataset name, unique among the owner's, e.g. kjv; "
                                                    "without it the dataset is only written.")
        who.add_argument("--owner", default="", metavar="USERNAME", help="With --name: who owns the dataset.")
        who.add_argument("--description", default="", help="With --name: shown in the dashboard.")
        parser.add_argument("--json", action="store_true", help="Print one JSON object describing the result on stdout.")

    def _bad_input(self, lines: list[str], what: str = "nothing was written"):
        raise CommandError(f"{what}:\n  " + "\n  ".join(lines), returncode=EXIT_BAD_INPUT)

    def handle(self, *args, **opts):
        out = os.path.abspath(opts["out"])  # relative to the current directory, as a shell user means it
        _, problems = prep.check_options(opts["inputs"], out, vocab_size=opts["vocab_size"],
                                         val_fraction=opts["val_fraction"], shard_tokens=opts["shard_tokens"],
                                         tokenizer=opts["tokenizer"])
        owner = self._check_registration(opts, out, problems)
        if problems:
            self._bad_input(problems)
        try:
            done = prep.prepare_text(opts["inputs"], out, vocab_size=opts["vocab_size"],
                                     val_fraction=opts["val_fraction"], shard_tokens=opts["shard_tokens"],
                                     tokenizer=opts["tokenizer"],
                                     progress=lambda msg: self.stderr.write(f"[prepare_text] {msg}"))
        except prep.PrepareError as exc:
            self._bad_input(exc.errors)
        self.stderr.write(f"wrote {done.out}: {done.train_tokens:,} train tokens in {done.train_shards} shard(s), "
                          f"{done.val_tokens:,} val tokens, vocab {done.vocab_size:,}, {done.dtype}")
        summary = done.summary()
        if owner is not None:
            try:
                dataset = services.dataset_create(owner=owner, name=opts["name"], format=Dataset.Format.TOKENS,
                                                  uri=done.out, description=opts["description"])
            except ValidationError as exc:
                self._bad_input([f"--{field.replace('_', '-')}: {m}" for field, ms in exc.message_dict.items() for m in ms],
                                what=f"the dataset was written to {done.out} but not registered")
            self.stderr.write(f"dataset {dataset.name} registered (id {dataset.pk}) for {owner.get_username()}")
            summary["dataset"] = {"id": dataset.pk, "name": dataset.name, "owner": owner.get_username()}
        if opts["json"]:
            self.stdout.write(json.dumps(summary))

    def _check_registration(self, opts, out: str, problems: list[str]):
        """The owner to register for (None without --name); each problem with --name, --owner and where
        --out lies appended to ``problems``, before anything is written."""
        if not opts["name"]:
            if opts["owner"]:
                problems.append("--owner: give --name too, or leave --owner out to only write the dataset.")
            return None
        if not opts["owner"]:
            problems.append("--owner: whose dataset is it? Give --owner USERNAME with --name.")
            return None
        try:
            owner = get_user_model().objects.filter(username=opts["owner"]).first()
        except DatabaseError as exc:  # a fresh checkout: no tables yet (or no database server)
            problems.append(f"--owner: the dashboard's database is not ready ({str(exc).splitlines()[0][:120]}): "
                            "run `make demo` once, or `python manage.py migrate` and create the user, first.")
            return None
        if owner is None:
            problems.append(f"--owner: no user named {opts['owner']!r}.")
            return None
        if Dataset.objects.filter(owner=owner, name=opts["name"]).exists():
            problems.append(f"--name: {opts['owner']} already has a dataset named {opts['name']}; choose another name.")
        roots = [Path(r).resolve() for r in getattr(settings, "TRAINBOARD_DATASET_ROOTS", ())]
        where = Path(out).resolve()
        if not any(where == r or where.is_relative_to(r) for r in roots):
            shown = " or ".join(str(r) for r in roots) or "(none: TRAINBOARD_DATASET_ROOTS is empty)"
            problems.append(f"--out {out}: a registered dataset must lie inside {shown} (TRAINBOARD_DATASET_ROOTS); "
                            "write it there, or leave --name out to only write it.")
        return owner
