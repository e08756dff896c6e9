"""``trainboard``: Trainboard from a laptop, over the REST API.

Exit codes: 0 done (``run``: the job SUCCEEDED), 1 the job failed or was cancelled, 2 bad input (every
error the server found, each with its field; also a refused login), 3 the server is unreachable (after
retries with backoff), 130 interrupted. ``trainboard COMMAND --help`` describes each command.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

import click
import yaml

from trainboard_client import config
from trainboard_client.api import FRAMEWORKS, TERMINAL_STATES, ApiError, AuthError, Client, TrainboardError
from trainboard_client.packing import PackError, Packed, human_size, pack
from trainboard_client.schema import JobField, job_fields

EXIT_FAILED, EXIT_INPUT, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 1, 2, 3, 130


class InputError(TrainboardError):
    """Bad input found by the client itself: every message at once."""

    exit_code = EXIT_INPUT

    def __init__(self, messages: list[str]) -> None:
        self.messages = messages
        super().__init__("\n".join(messages))


def say(message: str) -> None:
    """Progress and state for people: stderr, so stdout carries only logs and --json."""
    click.echo(message, err=True)


def _on_retry(attempt: int, attempts: int, delay: float, reason: str) -> None:
    say(f"Network trouble: {reason}. Retrying in {delay:g} s (try {attempt + 1} of {attempts}).")


def make_client(creds: config.Credentials | None = None) -> Client:
    creds = creds or config.load()
    if creds is None:
        raise InputError(["Not logged in: run `trainboard login URL`, or set TRAINBOARD_URL and TRAINBOARD_TOKEN."])
    retries = int(os.environ.get("TRAINBOARD_RETRIES", "4"))
    return Client(creds.url, creds.token, retries=retries, on_retry=_on_retry)


class Group(click.Group):
    """Reports a :class:`TrainboardError` once, on stderr, and exits with its code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TrainboardError as exc:
            plain_api = isinstance(exc, ApiError) and not isinstance(exc, AuthError) and exc.lines()
            for line in exc.lines() if plain_api else str(exc).splitlines():
                click.echo(f"Error: {line}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=Group, help=__doc__)
@click.version_option("0.1.0", prog_name="trainboard")
def cli() -> None:
    pass


# -----------------------------------------------------------------------------------------------
# login / whoami / logout
# -----------------------------------------------------------------------------------------------


@cli.command()
@click.argument("url")
@click.option("--username", "-u", help="Get a token for this user (asks for the password; POST /api/auth/token/).")
@click.option("--password-stdin", is_flag=True, help="Read the password from stdin instead of asking.")
@click.option("--token", "token_text", help="A token you already have (the API's token; - reads it from stdin).")
def login(url: str, username: str | None, password_stdin: bool, token_text: str | None) -> None:
    """Log in to the server at URL and store the token (0600, in $XDG_CONFIG_HOME/trainboard/).

    With --username, the password is asked (or read with --password-stdin) and exchanged for a token;
    with --token (or when asked), the token is pasted. The token is checked before it is stored."""
    url = url.rstrip("/")
    if not re.match(r"https?://", url):
        raise InputError([f"URL must start with http:// or https://, got {url!r}."])
    if url.endswith("/api"):  # the API's own root given: the server's is wanted (every call adds /api/)
        url = url[: -len("/api")]
    retries = int(os.environ.get("TRAINBOARD_RETRIES", "4"))
    if token_text == "-":
        token_text = sys.stdin.readline().strip()
    if username is None and not token_text:
        username = click.prompt("Username (leave blank to paste a token)", default="", show_default=False,
                               err=True) or None
        if username is None:
            token_text = click.prompt("Token", hide_input=True, err=True).strip()
    if username is not None:
        password = sys.stdin.readline().rstrip("\n") if password_stdin else click.prompt(
            "Password", hide_input=True, err=True)
        client = Client.login(url, username, password, retries=retries, on_retry=_on_retry)
    else:
        client = Client(url, token_text, retries=retries, on_retry=_on_retry)
    with client:
        client.check_token()
        path = config.save(url, client.token or "", username or "")
    say(f"Logged in to {url}{' as ' + username if username else ''}; token stored in {path}.")


@cli.command()
def whoami() -> None:
    """The server and user of the login in effect, checked against the server."""
    creds = config.load()
    with make_client(creds) as client:
        client.check_token()
    assert creds is not None
    who = creds.username or "(a pasted token)"
    click.echo(f"{who} at {creds.url} (from {creds.source}); the server accepts the token.")


@cli.command()
def logout() -> None:
    """Forget the stored token (the server's token itself stays valid until an admin revokes it)."""
    path = config.credentials_path()
    if config.remove():
        say(f"Logged out: removed {path}.")
    else:
        say(f"Not logged in ({path} does not exist).")


# -----------------------------------------------------------------------------------------------
# Lists
# -----------------------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    cells = [[title for _, title in columns]]
    for row in rows:
        cells.append([_cell(row.get(key)) for key, _ in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _backend_id(client: Client, backend: str | None) -> int | None:
    if backend is None:
        return None
    if backend.isdigit():
        return int(backend)
    for row in client.backends():
        if row.get("name") == backend:
            return int(row["id"])
    raise InputError([f"backend: no backend named {backend!r} that you can use (trainboard backends ls)."])


@cli.group(cls=Group)
def jobs() -> None:
    """Your training jobs."""


@jobs.command("ls")
@click.option("--state", type=click.Choice(["QUEUED", "SUBMITTING", "PENDING", "RUNNING", "STOPPING", "SUCCEEDED",
                                            "FAILED", "CANCELLED"], case_sensitive=False), help="Only jobs in this state.")
@click.option("--backend", help="Only jobs on this backend (name or id).")
@click.option("-q", "--search", "q", help="Jobs whose name, dataset, model or backend contains this.")
@click.option("--tag", help="Only jobs carrying this tag.")
@click.option("--stalled/--not-stalled", default=None, help="Only jobs past (or not past) their state's deadline.")
@click.option("--archived", type=click.Choice(["0", "1", "all"]), help="0 (default): not archived; 1: archived; all.")
@click.option("--ordering", help="Sort key: created, -cost, -val_accuracy, train.lr, ... (- for descending).")
@click.option("--limit", type=click.IntRange(1, 500), default=25, show_default=True, help="Jobs per page.")
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True, help="Jobs to skip.")
@click.option("--all", "all_pages", is_flag=True, help="Every page, not just one.")
@click.option("--json", "as_json", is_flag=True, help="The API's JSON objects, one list, on stdout.")
def jobs_ls(state, backend, q, tag, stalled, archived, ordering, limit, offset, all_pages, as_json) -> None:
    """List your jobs, newest first (or by --ordering)."""
    with make_client() as client:
        filters = dict(state=state.upper() if state else None, backend=_backend_id(client, backend), q=q, tag=tag,
                       stalled=stalled, archived=archived, ordering=ordering)
        page = client.jobs(limit=limit, offset=offset, **filters)
        rows = list(page["results"])
        while all_pages and page.get("next") and page["results"]:
            offset += len(page["results"])
            page = client.jobs(limit=limit, offset=offset, **filters)
            rows.extend(page["results"])
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        row["shape"] = f"{row.get('nodes')}x{row.get('procs_per_node')}"
    _table(rows, [("id", "ID"), ("display_name", "NAME"), ("state", "STATE"), ("backend", "BACKEND"),
                  ("shape", "NODESxPROCS"), ("cost_usd", "COST $"), ("created_at", "CREATED")])
    if not all_pages and page.get("next"):
        say(f"{len(rows)} of {page.get('count')} jobs; --offset {offset + len(rows)} or --all for more.")


@jobs.command("show")
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="The API's whole JSON object.")
def jobs_show(job_id: int, as_json: bool) -> None:
    """One job: its state, shape, cost, failure reason and final metrics."""
    with make_client() as client:
        job = client.job(job_id)
    if as_json:
        click.echo(json.dumps(job, indent=2))
        return
    for key in ("id", "display_name", "state", "failure_reason", "backend", "dataset", "model_spec", "strategy",
                "nodes", "procs_per_node", "world_size", "instance_type", "spot", "estimated_cost_usd", "cost_usd",
                "created_at", "started_at", "ended_at", "duration_s", "final_metrics"):
        if key in job and job[key] not in (None, "", {}):
            value = json.dumps(job[key]) if isinstance(job[key], (dict, list)) else job[key]
            click.echo(f"{key:>18}: {value}")


def _list_command(group: click.Group, name: str, fetch: str, columns: list[tuple[str, str]], what: str) -> None:
    @group.command("ls", help=f"List the {what} you can use.")
    @click.option("--json", "as_json", is_flag=True, help="The API's JSON objects, one list, on stdout.")
    def ls(as_json: bool) -> None:
        with make_client() as client:
            rows = getattr(client, fetch)()
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        else:
            _table(rows, columns)

    ls.__name__ = f"{name}_ls"


@cli.group(cls=Group)
def backends() -> None:
    """Compute backends."""


@cli.group(cls=Group)
def datasets() -> None:
    """Datasets."""


@cli.group(cls=Group)
def models() -> None:
    """Models (built-in architectures, your model code, your scripts)."""


_list_command(backends, "backends", "backends", [("id", "ID"), ("name", "NAME"), ("kind", "KIND")], "backends")
_list_command(datasets, "datasets", "datasets", [("id", "ID"), ("name", "NAME"), ("format", "FORMAT")], "datasets")
_list_command(models, "models", "models", [("id", "ID"), ("name", "NAME"), ("kind", "KIND"),
                                           ("entry_point", "ENTRY POINT")], "models")


# -----------------------------------------------------------------------------------------------
# logs / cancel
# -----------------------------------------------------------------------------------------------


@cli.command()
@click.argument("job_id", type=int)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--after", type=int, default=-1, show_default=True, help="Only lines after this line number (seq).")
@click.option("--poll", type=click.FloatRange(0.1), default=2.0, show_default=True, help="Seconds between polls (-f).")
def logs(job_id: int, follow: bool, after: int, poll: float) -> None:
    """Print a job's log (GET /api/jobs/ID/logs/?after=); with -f, follow it to the job's end."""
    with make_client() as client:
        if follow:
            for line in client.follow_logs(job_id, after=after, poll_s=poll):
                click.echo(line)
            return
        cursor = after
        while True:
            page = client.logs(job_id, after=cursor)
            for line in page["lines"]:
                click.echo(line["text"])
            cursor = page["next"]
            if not page["more"]:
                return


@cli.command()
@click.argument("job_id", type=int)
def cancel(job_id: int) -> None:
    """Cancel a job: a queued one at once, a running one when its backend confirms the stop."""
    with make_client() as client:
        job = client.cancel(job_id)
    say(f"Job #{job['id']}: {job['state']}.")


# -----------------------------------------------------------------------------------------------
# Again: rerun, clone, continue; compare; artifacts; datasets create
# -----------------------------------------------------------------------------------------------


def _settings(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``--set`` pairs as clone overrides: ``epochs=5`` a field of the job request, ``train.lr=0.01`` a
    key into ``hyperparameters`` (deep); values read as JSON where they parse (0.01, true, [1, 2]), else
    text. Every malformed pair is reported at once."""
    overrides: dict[str, Any] = {}
    errors = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            errors.append(f"--set: {pair!r} is not KEY=VALUE (e.g. train.lr=0.01 or epochs=5).")
            continue
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        if "." in key:
            node = overrides.setdefault("hyperparameters", {})
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    errors.append(f"--set: {key} sets inside {part}, which another --set gave a value.")
                    break
            else:
                node[leaf] = value
        else:
            overrides[key] = value
    if errors:
        raise InputError(errors)
    return overrides


def _launched(client: Client, job: dict[str, Any], follow: bool, poll: float) -> None:
    say(f"Launched job #{job['id']}: {client.url}/jobs/{job['id']}/")
    if not follow:
        click.echo(job["id"])
        return
    final = _stream(client, int(job["id"]), poll)
    _ended(final)


def _ended(final: dict[str, Any]) -> None:
    if final["state"] == "SUCCEEDED":
        say(f"Job #{final['id']} SUCCEEDED" + (f" in {final['duration_s']:.0f} s" if final.get("duration_s") else "")
            + (f", cost ${final['cost_usd']}" if final.get("cost_usd") is not None else "") + ".")
        return
    reason = final.get("failure_reason") or ""
    say(f"Job #{final['id']} {final['state']}" + (f": {reason}" if reason else "."))
    raise click.exceptions.Exit(EXIT_FAILED)


_FOLLOW = click.option("--follow/--detach", "-f/-d", default=False,
                       help="Follow the new job to its end (exit 0 only if it SUCCEEDED), or print its id [default].")
_POLL = click.option("--poll", type=click.FloatRange(0.1), default=1.0, show_default=True,
                     help="Seconds between polls (--follow).")


@cli.command()
@click.argument("job_id", type=int)
@_FOLLOW
@_POLL
def rerun(job_id: int, follow: bool, poll: float) -> None:
    """Run a job again with its frozen config (POST /api/jobs/ID/rerun/)."""
    with make_client() as client:
        _launched(client, client.rerun(job_id), follow, poll)


@cli.command()
@click.argument("job_id", type=int)
@click.option("--set", "pairs", multiple=True, metavar="KEY=VALUE",
              help="An override: a job field (epochs=5, backend=box-b) or a config key (train.lr=0.01); repeatable.")
@_FOLLOW
@_POLL
def clone(job_id: int, pairs: tuple[str, ...], follow: bool, poll: float) -> None:
    """A new job like JOB_ID with edits (POST /api/jobs/ID/clone/)."""
    overrides = _settings(pairs)
    with make_client() as client:
        _launched(client, client.clone(job_id, **overrides), follow, poll)


@cli.command("continue")
@click.argument("job_id", type=int)
@click.option("--epochs", type=int, help="Train to this many epochs in all.")
@click.option("--finetune", is_flag=True, help="Start from its trained weights with a new optimizer at epoch 0 "
                                               "instead of resuming its last checkpoint.")
@click.option("--set", "pairs", multiple=True, metavar="KEY=VALUE", help="Further overrides, as for clone.")
@_FOLLOW
@_POLL
def continue_(job_id: int, epochs: int | None, finetune: bool, pairs: tuple[str, ...], follow: bool,
              poll: float) -> None:
    """Resume JOB_ID's last checkpoint for more epochs (or --finetune from its weights)."""
    overrides = {**_settings(pairs), "init_mode": "finetune" if finetune else "continue"}
    if epochs is not None:
        overrides["epochs"] = epochs
    with make_client() as client:
        _launched(client, client.clone(job_id, **overrides), follow, poll)


@cli.command()
@click.argument("job_ids", type=int, nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="The API's whole comparison (series included).")
def compare(job_ids: tuple[int, ...], as_json: bool) -> None:
    """Compare runs: each one's final value per metric (* the best), and the config keys that differ.
    Exits 2 when an id is not a job of yours (after showing the others)."""
    with make_client() as client:
        result = client.compare(list(job_ids))
    missing = [str(i) for i in result.get("not_found") or []]
    failure = InputError([f"job(s) not found (or not yours): {', '.join(missing)}."]) if missing else None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        if failure:
            raise failure
        return
    runs = result.get("runs") or []
    if not runs and failure:
        raise failure
    header = ["", *[f"#{r['id']} {r.get('name') or ''}".strip() for r in runs]]
    rows = [header, ["state", *[r.get("state", "") for r in runs]]]
    finals = {row["job_id"]: row.get("values") or {} for row in result.get("table") or []}
    names = [m["name"] for m in result.get("metrics") or [] if any(m["name"] in v for v in finals.values())]
    best = result.get("best") or {}
    for name in names:
        cells = []
        for run in runs:
            value = (finals.get(run["id"], {}).get(name) or {}).get("final")
            mark = " *" if value is not None and (best.get(name) or {}).get("final") == run["id"] else ""
            cells.append(("-" if value is None else f"{value:.6g}") + mark)
        rows.append([f"{name} (final)", *cells])
    for row in result.get("config") or []:
        if row.get("differs"):
            rows.append([str(row.get("key")), *[_cell(v) for v in row.get("values") or []]])
    widths = [max(len(str(r[i])) if i < len(r) else 0 for r in rows) for i in range(len(header))]
    for r in rows:
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    if failure:
        raise failure


@cli.group(cls=Group)
def artifacts() -> None:
    """A job's files: its model, metrics, checkpoints and log."""


@artifacts.command("ls")
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="The API's JSON objects, one list, on stdout.")
def artifacts_ls(job_id: int, as_json: bool) -> None:
    """List JOB_ID's artifacts with size and SHA-256."""
    with make_client() as client:
        listing = client.artifacts(job_id)
    if listing.get("error"):
        say(f"The backend's files cannot be read now: {listing['error']} (the last listing follows)")
    rows = listing["results"]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        row["sha"] = (row.get("sha256") or "")[:16]
    _table(rows, [("name", "NAME"), ("kind", "KIND"), ("size_bytes", "BYTES"), ("sha", "SHA-256")])


@artifacts.command("download")
@click.argument("job_id", type=int)
@click.argument("name")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Where to write it [default: NAME's last part, "
                                                                       "here].")
def artifacts_download(job_id: int, name: str, output: str | None) -> None:
    """Download one artifact; an interrupted download resumes where the store allows, and the file is
    checked against the server's SHA-256 before it is kept (exit 1 on a mismatch)."""
    dest = Path(output or name.rsplit("/", 1)[-1])
    with make_client() as client:
        listed = next((a for a in client.artifacts(job_id)["results"] if a["name"] == name), None)
        if listed is None:
            raise InputError([f"name: job #{job_id} has no artifact {name!r} (trainboard artifacts ls {job_id})."])
        expected = listed.get("sha256") or None
        got = client.download_artifact(job_id, name, dest, sha256=expected)
    check = "matches the server's" if expected else "not checked: the server has no SHA-256 for it"
    say(f"Downloaded {name} to {dest} ({dest.stat().st_size:,} bytes), sha256 {got[:16]}… {check}.")


@datasets.command("create")
@click.option("--name", required=True, help="The dataset's name (unique among yours).")
@click.option("--format", "format_", required=True, help="builtin, imagefolder, csv, npz, tokens (the server says "
                                                          "which it takes).")
@click.option("--builtin-name", help="format builtin: e.g. digits.")
@click.option("--uri", help="Where the data is: a path on the backend, s3://, gs://, az://.")
@click.option("--label-column", help="format csv: the label's column.")
@click.option("--set", "pairs", multiple=True, metavar="KEY=VALUE", help="Any other field of POST /api/datasets/.")
def datasets_create(name: str, format_: str, builtin_name: str | None, uri: str | None, label_column: str | None,
                    pairs: tuple[str, ...]) -> None:
    """Register a dataset (POST /api/datasets/); every error at once."""
    body: dict[str, Any] = {"name": name, "format": format_}
    for key, value in (("builtin_name", builtin_name), ("uri", uri), ("label_column", label_column)):
        if value is not None:
            body[key] = value
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise InputError([f"--set: {pair!r} is not KEY=VALUE."])
        try:
            body[key] = json.loads(raw)
        except ValueError:
            body[key] = raw
    with make_client() as client:
        made = client.post("/api/datasets/", body)
    say(f"Registered dataset {made['name']!r} (#{made['id']}).")
    click.echo(made["id"])


@cli.group(cls=Group)
def sweep() -> None:
    """Hyperparameter sweeps (docs/sweeps.md): each trial is a job."""


@sweep.command("create")
@click.option("-f", "--file", "spec_file", required=True, type=click.Path(dir_okay=False),
              help="The sweep as YAML (or .json / .toml): name, base (the job's fields), search_space, sampler, "
                   "max_trials, ... as POST /api/sweeps/ takes them.")
def sweep_create(spec_file: str) -> None:
    """Start a sweep from a spec file; every error at once. Prints its id."""
    path = Path(spec_file)
    try:
        text = path.read_text()
        spec = json.loads(text) if path.suffix == ".json" else tomllib.loads(text) if path.suffix == ".toml" \
            else yaml.safe_load(text)
    except OSError as exc:
        raise InputError([f"-f: cannot read {spec_file}: {exc.strerror}."]) from None
    except (ValueError, yaml.YAMLError) as exc:
        raise InputError([f"-f: {spec_file} cannot be read: {exc}"]) from None
    if not isinstance(spec, dict):
        raise InputError([f"-f: {spec_file} must hold a mapping (name, base, search_space, ...)."])
    with make_client() as client:
        made = client.post("/api/sweeps/", spec)
    say(f"Started sweep #{made['id']} {made['name']!r}: {client.url}/sweeps/{made['id']}/")
    click.echo(made["id"])


@sweep.command("ls")
@click.option("--state", help="Only sweeps in this state (RUNNING, SUCCEEDED, ...).")
@click.option("--json", "as_json", is_flag=True, help="The API's JSON objects, one list, on stdout.")
def sweep_ls(state: str | None, as_json: bool) -> None:
    """Your sweeps, newest first."""
    with make_client() as client:
        rows = list(client.iter_all("/api/sweeps/", state=state))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    _table(rows, [("id", "ID"), ("name", "NAME"), ("state", "STATE"), ("sampler", "SAMPLER"),
                  ("objective_metric", "OBJECTIVE"), ("max_trials", "TRIALS")])


@sweep.command("show")
@click.argument("sweep_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="The API's whole JSON object.")
def sweep_show(sweep_id: int, as_json: bool) -> None:
    """A sweep: its state, progress, trials and best trial."""
    with make_client() as client:
        found = client.get(f"/api/sweeps/{int(sweep_id)}/")
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    progress = found.get("progress") or {}
    click.echo(f"Sweep #{found['id']} {found['name']!r}: {found['state']}"
               + (f" ({found['message']})" if found.get("message") else ""))
    click.echo(f"{found['direction']} {found['objective_metric']} ({found['objective']}), sampler {found['sampler']}; "
               f"trials {progress.get('done', 0)} of {progress.get('limit', found.get('max_trials'))}")
    for trial in found.get("trials") or []:
        click.echo(f"  trial {trial.get('number')}: {trial.get('state')} job #{trial.get('job_id')} "
                   f"value {trial.get('value')} {json.dumps(trial.get('params') or {})}")
    best = found.get("best_trial")
    if best:
        click.echo(f"best: trial {best['number']} (job #{best['job_id']}) value {best['value']} "
                   f"{json.dumps(best['params'])}")


@sweep.command("cancel")
@click.argument("sweep_id", type=int)
def sweep_cancel(sweep_id: int) -> None:
    """Cancel a sweep: no new trials, its running trials cancelled."""
    with make_client() as client:
        found = client.post(f"/api/sweeps/{int(sweep_id)}/cancel/")
    say(f"Sweep #{found['id']}: {found['state']}.")


# -----------------------------------------------------------------------------------------------
# Job options from the server's schema: estimate and run
# -----------------------------------------------------------------------------------------------


_METAVARS = {"integer": "INTEGER", "number": "NUMBER", "string": "TEXT", "id_or_name": "ID|NAME", "json": "JSON"}


class JobOptionsCommand(click.Command):
    """A command whose job options are the fields of the server's job request (its OpenAPI schema),
    read when the command runs or shows --help; ``skip``: fields the command sets itself."""

    def __init__(self, *args: Any, skip: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = skip
        self._job_params: list[click.Parameter] | None = None
        self.fields: list[JobField] = []
        self.schema_note = ""

    def job_params(self) -> list[click.Parameter]:
        if self._job_params is None:
            self._job_params = []
            creds = config.load()
            if creds is None:
                self.schema_note = ("Log in (trainboard login URL) to see the job options here: they are read "
                                    "from the server's schema.")
                return self._job_params
            try:
                with make_client(creds) as client:
                    schema = client.schema()
                self.fields = job_fields(schema)
            except (TrainboardError, ValueError) as exc:
                self.schema_note = f"The server's job options could not be read: {exc}"
                return self._job_params
            own = {p.name for p in self.params}
            self.fields = [f for f in self.fields if f.name not in self.skip and f.name not in own]
            self.schema_note = f"Job options: the fields of POST /api/jobs/ in {creds.url}/api/schema/."
            for f in self.fields:
                self._job_params.append(_option(f))
        return self._job_params

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return [*super().get_params(ctx), *self.job_params()]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        job_names = {p.name for p in self.job_params()}
        own, job = [], []
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                (job if param.name in job_names else own).append(record)
        if own:
            with formatter.section("Options"):
                formatter.write_dl(own)
        if job:
            with formatter.section("Job options (from the server)"):
                formatter.write_dl(job)
        if self.schema_note:
            with formatter.section("Note"):
                formatter.write_text(self.schema_note)


def _option(f: JobField) -> click.Option:
    bits = [f.help] if f.help else []
    if f.choices:
        bits.append(f"One of: {', '.join(f.choices)}.")
    if f.minimum is not None or f.maximum is not None:
        low = "" if f.minimum is None else f"{f.minimum:g}"
        high = "" if f.maximum is None else f"{f.maximum:g}"
        bits.append(f"Range {low}..{high}.")
    if f.required:
        bits.append("Required.")
    elif f.default not in (None, "", [], {}):
        bits.append(f"Server default: {json.dumps(f.default) if not isinstance(f.default, str) else f.default}.")
    text = " ".join(bits)
    if f.kind == "boolean":
        return click.Option([f"{f.option}/--no-{f.option[2:]}", ], default=None, help=text)
    metavar = "[" + "|".join(f.choices) + "]" if f.kind == "choice" and len(f.choices) <= 6 else \
        _METAVARS.get(f.kind, "TEXT")
    return click.Option([f.option], default=None, metavar=metavar, help=text)


def _lenient(f: JobField, raw: Any) -> Any:
    """The value as the API takes it; one the client cannot read goes as given, for the server to
    report with every other error."""
    try:
        return f.convert(raw)
    except ValueError:
        return raw


def _task_file(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise InputError([f"-f: cannot read {path}: {exc.strerror}."]) from None
    try:
        data = tomllib.loads(text) if file.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise InputError([f"-f: {path} is not valid {'TOML' if file.suffix == '.toml' else 'YAML'}: {exc}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError([f"-f: {path} must hold a mapping of option names to values."])
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _job_values(command: JobOptionsCommand, ctx: click.Context, task: dict[str, Any],
                own_keys: set[str]) -> tuple[dict[str, Any], list[str]]:
    """The job's fields: the task file's, then the command line's over them; and the unknown keys."""
    by_name = {f.name: f for f in command.fields}
    values: dict[str, Any] = {}
    errors = []
    for key, value in task.items():
        if key in by_name:
            values[key] = _lenient(by_name[key], value)
        elif key not in own_keys:
            known = sorted([*own_keys, *by_name])
            errors.append(f"{key}: unknown key in the task file; known keys: {', '.join(known)}.")
    for f in command.fields:
        raw = ctx.params.get(f.name)
        if raw is not None:
            values[f.name] = _lenient(f, raw)
    return values, errors


def _print_estimate(job: dict[str, Any]) -> None:
    arithmetic = job.get("estimate_arithmetic") or ""
    say(f"Estimate: ${job.get('estimated_cost_usd')} ({arithmetic})" if arithmetic else
        f"Estimate: ${job.get('estimated_cost_usd')}")
    if job.get("max_runtime_covers"):
        say(f"  max runtime covers: {job['max_runtime_covers']}")
    plan = job.get("memory_plan")
    if isinstance(plan, dict):
        summary = plan.get("summary")
        say(f"Memory plan: {summary}" if summary else "Memory plan:")
        for line in plan.get("lines") or []:
            say(f"  {line}")
        if plan.get("fits") is False and plan.get("suggestion"):
            say(f"  {plan['suggestion']}")


@cli.command(cls=JobOptionsCommand)
@click.option("-f", "--file", "task_file", type=click.Path(dir_okay=False),
              help="A YAML (or .toml) file of job options, keyed by the option names (nodes, procs_per_node, ...).")
@click.pass_context
def estimate(ctx: click.Context, task_file: str | None, **_: Any) -> None:
    """The price estimate and memory plan of a job, or every error it would get; nothing is launched
    (POST /api/jobs/estimate/)."""
    command = ctx.command
    assert isinstance(command, JobOptionsCommand)
    values, errors = _job_values(command, ctx, _task_file(task_file), {"task_file"})
    with make_client() as client:
        try:
            job = client.estimate(**values)
        except AuthError:
            raise
        except ApiError as exc:  # with the task file's own errors: every error in one reply
            raise InputError(errors + exc.lines()) from None
    if errors:
        raise InputError(errors)
    _print_estimate(job)


RUN_KEYS = {"script", "args", "workdir", "model_entry", "framework"}
"""A task file's keys of its own, beside the job options."""


def _drop_unregistered(exc: ApiError, values: dict[str, Any], kind: str) -> None:
    """Drop the errors a job gets only because its model is not registered yet (a dry run, or input
    refused before the upload): ``model_spec`` itself, and for a script that reads its own data the
    dataset the server asks of a job whose model it cannot see."""
    exc.errors.pop("model_spec", None)
    if kind == "script" and values.get("dataset") is None:
        exc.errors.pop("dataset", None)


def _server_errors(values: dict[str, Any], kind: str) -> list[str]:
    """The server's errors for the job options (the model left out: the client registers it), so that
    one reply lists every error; none when the server cannot be asked."""
    try:
        with make_client() as client:
            client.estimate(**values)
    except AuthError as exc:
        return [str(exc)]
    except ApiError as exc:
        _drop_unregistered(exc, values, kind)
        return exc.lines()
    except TrainboardError:
        return []
    return []


def _model_name(root: Path, kind: str, entry_point: str, script_args: list[str] | None, packed: Packed,
                framework: str = "torch") -> str:
    """A name that says what the model is: the project, and a key of its code, entry point, arguments
    and framework (a later run of the same finds it and uploads nothing)."""
    keyed: list[Any] = [packed.sha256, kind, entry_point, script_args]
    if framework != "torch":  # a torch script keeps the name it had before frameworks
        keyed.append(framework)
    key = hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:12]
    project = re.sub(r"[^A-Za-z0-9_.-]+", "-", root.name).strip("-")[:60] or "project"
    return f"{project}-{key}"


@cli.command(cls=JobOptionsCommand, skip=("model_spec",),
             context_settings={"ignore_unknown_options": False})
@click.argument("script", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("-f", "--file", "task_file", type=click.Path(dir_okay=False),
              help="A YAML (or .toml) task file holding these options (script, args, workdir, model_entry and the "
                   "job options by name); the command line wins over it.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="The project directory to pack [default: .].")
@click.option("-m", "--module", help="Instead of a script file: a module of the project run as python -m runs it "
                                     "(package.module).")
@click.option("--model-entry", help="Instead of a script: package.module:function returning the torch.nn.Module "
                                    "that the built-in trainer trains (a model of kind code).")
@click.option("--framework", type=click.Choice(FRAMEWORKS), default=None,
              help="How the script's processes start: torch (torchrun's variables), tensorflow (TF_CONFIG), ray (a "
                   "Ray cluster over the job's nodes, the script on node 0) or mpi (mpirun) [default: torch].")
@click.option("--dry-run", is_flag=True, help="Print the estimate and every error; upload and launch nothing.")
@click.option("-d", "--detach", is_flag=True, help="Launch and return: print the job's id, follow nothing.")
@click.option("--poll", type=click.FloatRange(0.1), default=1.0, show_default=True,
              help="Seconds between polls of the job's state and log.")
@click.pass_context
def run(ctx: click.Context, script: str | None, args: tuple[str, ...], task_file: str | None, workdir: str | None,
        module: str | None, model_entry: str | None, framework: str | None, dry_run: bool, detach: bool, poll: float,
        **_: Any) -> None:
    """Pack the project, upload it (once per content), launch a job and follow it to its end.

    \b
      trainboard run train.py --backend box-a --nodes 2 --procs-per-node 4 -- --epochs 3
      trainboard run -m mypkg.train --backend box-a -- --epochs 3
      trainboard run --model-entry mymodel.net:build --dataset digits --backend box-a
      trainboard run -f task.yaml

    SCRIPT (train.py; or -m package.module, which takes every positional argument as its own, as python -m
    does) runs under the launcher on every rank with ARGS (after --). The directory is packed honouring
    .gitignore and .trainboardignore.
    Exits 0 only if the job SUCCEEDED, 1 if it failed or was cancelled, 2 for bad input, 3 when the
    server cannot be reached."""
    command = ctx.command
    assert isinstance(command, JobOptionsCommand)
    task = _task_file(task_file)
    values, errors = _job_values(command, ctx, task, RUN_KEYS)
    if module:  # as with python -m: every positional argument is the module's
        args, script = ((script,) if script else ()) + tuple(args), f"-m {module}"
    script = script or task.get("script")
    model_entry = model_entry or task.get("model_entry")
    framework = framework or task.get("framework") or "torch"
    if framework not in FRAMEWORKS:
        errors.append(f"framework: one of {', '.join(FRAMEWORKS)}, got {framework!r}.")
    elif model_entry and framework != "torch":
        errors.append(f"framework: {framework} runs a script; the built-in trainer (--model-entry) is PyTorch.")
    script_args = list(args) if args else task.get("args")
    if isinstance(script_args, str):
        script_args = [script_args]
    if script_args is not None and not (isinstance(script_args, list) and all(isinstance(a, (str, int, float))
                                                                           for a in script_args)):
        errors.append("args: a list of the script's arguments, e.g. [\"--epochs\", \"3\"].")
    script_args = [str(a) for a in script_args] if isinstance(script_args, list) else None
    root = Path(workdir or task.get("workdir") or ".")
    if bool(script) == bool(model_entry):
        errors.append("script: give a script to run (trainboard run train.py, or -m package.module) or "
                      "--model-entry package.module:function, one of them.")
    if model_entry and script_args:
        errors.append("args: script arguments go with a script, not with --model-entry.")
    if not root.is_dir():
        errors.append(f"workdir: {root} is not a directory.")
    packed = None
    if root.is_dir():
        try:
            packed = pack(root)
        except PackError as exc:
            errors.append(f"code: {exc}")
    kind = "code" if model_entry else "script"
    entry_point = model_entry or script or ""
    if packed is not None and script and not script.startswith("-m"):
        if script.replace("\\", "/").removeprefix("./") not in packed.files:
            errors.append(f"script: {script} is not in the packed files of {root.resolve()} (ignored, or "
                          f"elsewhere?).")
    if errors:
        raise InputError(errors + _server_errors(values, kind))
    assert packed is not None
    files = f"{len(packed.files)} file{'s' if len(packed.files) != 1 else ''}"
    say(f"Packed {files} from {root.resolve()}: {human_size(packed.size_bytes)} "
        f"({human_size(packed.compressed_bytes)} compressed), sha256 {packed.sha256[:12]}.")
    name = _model_name(root.resolve(), kind, entry_point, script_args, packed, framework)
    with make_client() as client:
        existing = next((m for m in client.models() if m.get("name") == name), None)
        if dry_run:
            body = {**values, **({"model_spec": existing["id"]} if existing else {})}
            try:
                job = client.estimate(**body)
            except ApiError as exc:
                if existing is None:  # the model is registered at launch: its absence is no error of yours
                    _drop_unregistered(exc, values, kind)
                if exc.errors:
                    raise
                job = None
            if job is not None:
                _print_estimate(job)
            if existing is None:
                say("Dry run: the code would be uploaded at launch, where the server checks it; nothing was "
                    "uploaded or launched.")
            else:
                say(f"Dry run: model {name!r} (#{existing['id']}) holds this code already; nothing was launched.")
            return
        if existing is not None:
            say(f"Code already on the server: model {name!r} (#{existing['id']}); nothing to upload.")
            model = existing
        else:
            refused = _server_errors(values, kind)  # the job's own errors before anything is uploaded
            if refused:
                raise InputError(refused)
            say(f"Uploading {human_size(packed.compressed_bytes)} ...")
            model = client.create_model(name=name, kind=kind, entry_point=entry_point, archive=packed.data,
                                        filename=f"{name}.tar.gz", script_args=script_args if kind == "script" else None,
                                        framework=framework,
                                        description=f"Packed by trainboard run from {root.resolve().name}.")
            say(f"Registered model {name!r} (#{model['id']}), code sha256 {(model.get('code') or {}).get('sha256', '')[:12]}.")
        body = {**values, "model_spec": model["id"]}
        _print_estimate(client.estimate(**body))
        job = client.create_job(**body)
        say(f"Launched job #{job['id']}: {client.url}/jobs/{job['id']}/")
        if detach:
            click.echo(job["id"])
            return
        final = _stream(client, int(job["id"]), poll)
    _ended(final)


def _stream(client: Client, job_id: int, poll: float) -> dict[str, Any]:
    """Print the job's state changes (stderr) and log lines (stdout) until it ends; Ctrl-C asks whether to
    cancel the job or detach."""
    last: dict[str, Any] = {}
    # Ctrl-C sets a flag the follow checks between calls: a KeyboardInterrupt raised inside an HTTP
    # call could leave its connection pool locked, and the exit then hung closing it.
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        for kind, value in client.follow(job_id, poll_s=poll, stop=interrupted):
            if kind == "event":
                message = f": {value['message']}" if value.get("message") else ""
                if value.get("is_note") or not value.get("to_state"):
                    say(f"[job #{job_id}] note{message}")
                else:
                    say(f"[job #{job_id}] {value['to_state']}{message}")
            elif kind == "state":
                last = value
            else:
                click.echo(value)
            if interrupted.is_set():
                break
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted.is_set():
        choice = "detach"
        if sys.stdin.isatty():
            choice = click.prompt(f"\nCancel job #{job_id} on the server, or detach (it keeps running)?",
                                  type=click.Choice(["cancel", "detach"]), default="detach", err=True)
        if choice == "cancel":
            job = client.cancel(job_id)
            say(f"Job #{job_id}: {job['state']} (cancel sent).")
        else:
            say(f"Detached; job #{job_id} keeps running: trainboard logs -f {job_id}")
        raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
    return last if last.get("state") in TERMINAL_STATES else client.job(job_id)


def main() -> None:
    cli(prog_name="trainboard")


if __name__ == "__main__":
    main()
