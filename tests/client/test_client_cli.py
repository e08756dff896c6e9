"""``trainboard`` login, lists, show, cancel, estimate and its errors, against a live server (issue 32)."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys

import pytest
import yaml

from experimentkit import make_job
from jobs.models import TrainingJob
from jobs import dispatch
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db(transaction=True)


def test_login_stores_the_servers_token_0600_then_whoami_and_logout(cli, user):
    from rest_framework.authtoken.models import Token

    result = cli.login()
    path = cli.config_dir / "trainboard" / "credentials.json"
    assert f"Logged in to {cli.url} as alice; token stored in {path}." in result.err
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    stored = json.loads(path.read_text())
    assert stored == {"url": cli.url, "token": Token.objects.get(user=user).key, "username": "alice"}

    who = cli("whoami")
    assert who.code == 0, who.both
    assert who.out.strip() == f"alice at {cli.url} (from {path}); the server accepts the token."

    bye = cli("logout")
    assert bye.code == 0 and not path.exists()
    # The API's root given instead of the server's: the server's is stored.
    api_root = cli("login", cli.url + "/api/", "--username", "alice", "--password-stdin", input="pw-alice-123\n")
    assert api_root.code == 0, api_root.both
    assert json.loads(path.read_text())["url"] == cli.url
    assert cli("logout").code == 0
    again = cli("whoami")
    assert again.code == 2
    assert "Not logged in: run `trainboard login URL`" in again.err


def test_a_wrong_password_is_refused_with_the_servers_message_and_nothing_is_stored(cli, user):
    result = cli("login", cli.url, "--username", "alice", "--password-stdin", input="wrong\n")
    assert result.code == 2, result.both
    assert result.err.startswith("Error: Unable to log in with provided credentials."), result.err
    assert not (cli.config_dir / "trainboard").exists() or not any((cli.config_dir / "trainboard").iterdir())


def test_the_environment_overrides_the_stored_login_and_a_bad_token_says_log_in_again(cli, user, local_backend):
    from rest_framework.authtoken.models import Token

    token = Token.objects.create(user=user).key
    listed = cli("backends", "ls", "--json", env={"TRAINBOARD_URL": cli.url, "TRAINBOARD_TOKEN": token})
    assert listed.code == 0, listed.both
    assert [(b["id"], b["name"], b["kind"]) for b in json.loads(listed.out)] == [(local_backend.pk, "local", "gpubox")]

    refused = cli("backends", "ls", env={"TRAINBOARD_URL": cli.url, "TRAINBOARD_TOKEN": "0" * 40})
    assert refused.code == 2
    assert refused.err == ("Error: The server refused the credentials (Invalid token.). Log in again: "
                           "trainboard login URL\n")


def test_jobs_ls_filters_and_pages_and_show_prints_the_job(logged_in, user, digits_dataset, cnn_model, local_backend):
    ok = make_job(user, digits_dataset, cnn_model, local_backend, name="ok-run", state="SUCCEEDED")
    bad = make_job(user, digits_dataset, cnn_model, local_backend, name="bad-run", state="FAILED",
                   failure_reason="rank 1 exited with code 3")
    third = make_job(user, digits_dataset, cnn_model, local_backend, name="ok-again", state="SUCCEEDED")

    failed = logged_in("jobs", "ls", "--state", "failed", "--json")
    assert failed.code == 0, failed.both
    assert [(j["id"], j["state"]) for j in json.loads(failed.out)] == [(bad.pk, "FAILED")]

    searched = logged_in("jobs", "ls", "-q", "ok-", "--backend", "local", "--json")
    assert sorted(j["id"] for j in json.loads(searched.out)) == sorted([ok.pk, third.pk])

    one_page = logged_in("jobs", "ls", "--limit", "2")
    assert one_page.code == 0, one_page.both
    assert one_page.out.splitlines()[0].split() == ["ID", "NAME", "STATE", "BACKEND", "NODESxPROCS", "COST", "$",
                                                    "CREATED"]
    assert len(one_page.out.splitlines()) == 3  # the header and 2 jobs
    assert "2 of 3 jobs; --offset 2 or --all for more." in one_page.err
    every = logged_in("jobs", "ls", "--limit", "2", "--all", "--json")
    assert sorted(j["id"] for j in json.loads(every.out)) == sorted([ok.pk, bad.pk, third.pk])

    unknown = logged_in("jobs", "ls", "--backend", "nope")
    assert unknown.code == 2
    assert "backend: no backend named 'nope' that you can use" in unknown.err

    shown = logged_in("jobs", "show", str(bad.pk))
    assert shown.code == 0, shown.both
    assert "failure_reason: rank 1 exited with code 3" in shown.out
    assert json.loads(logged_in("jobs", "show", str(bad.pk), "--json").out)["name"] == "bad-run"
    missing = logged_in("jobs", "show", "999999")
    assert (missing.code, missing.err) == (2, "Error: Training job 999999 not found (or not yours).\n")


def test_cancel_a_queued_job(logged_in, user, digits_dataset, cnn_model, local_backend):
    job = make_job(user, digits_dataset, cnn_model, local_backend, name="waiting", state="QUEUED")
    with sent_tasks(dispatch.CANCEL_JOB):
        result = logged_in("cancel", str(job.pk))
    assert result.code == 0, result.both
    job.refresh_from_db()
    assert job.state == "CANCELLED"
    assert result.err == f"Job #{job.pk}: CANCELLED.\n"


def test_estimate_prints_the_price_and_every_error_by_field(logged_in, digits_dataset, cnn_model, local_backend):
    priced = logged_in("estimate", "--dataset", "digits", "--model-spec", "digits-cnn", "--backend", "local",
                       "--procs-per-node", "2", "--max-runtime-s", "1800")
    assert priced.code == 0, priced.both
    assert priced.err.startswith("Estimate: $1.8000 (1800 s × 1 node × $3.60/h)\n"), priced.err
    assert "Memory plan: " in priced.err and "per rank for 2 ranks" in priced.err  # the server's plan
    assert TrainingJob.objects.count() == 0

    bad = logged_in("estimate", "--dataset", "digits", "--model-spec", "digits-cnn", "--backend", "local",
                    "--nodes", "0", "--epochs", "many", "--priority", "1000", "--strategy", "magic")
    assert bad.code == 2, bad.both
    lines = bad.err.splitlines()
    assert "Error: nodes: Ensure this value is greater than or equal to 1." in lines
    assert "Error: epochs: A valid integer is required." in lines
    assert "Error: priority: Ensure this value is less than or equal to 100." in lines
    assert 'Error: strategy: "magic" is not a valid choice.' in lines
    assert len(lines) == len(set(lines))  # each error once
    assert TrainingJob.objects.count() == 0

    # A task file's own error comes with the server's, in one reply.
    task = logged_in.home / "job.yaml"
    task.write_text(yaml.safe_dump({"backend": "local", "model_spec": "digits-cnn", "dataset": "digits",
                                    "nodes": 0, "epoch": 3}))
    both = logged_in("estimate", "-f", str(task))
    assert both.code == 2
    assert both.err.splitlines()[0].startswith("Error: epoch: unknown key in the task file; known keys: ")
    assert both.err.splitlines()[1:] == ["Error: nodes: Ensure this value is greater than or equal to 1."]


def test_an_unreachable_server_is_retried_with_backoff_then_exit_3(cli, user):
    with socket.socket() as held:  # bound, never listening: connections are refused, no one else gets the port
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        result = cli("jobs", "ls", env={"TRAINBOARD_URL": url, "TRAINBOARD_TOKEN": "x" * 40, "TRAINBOARD_RETRIES": "2"})
    assert result.code == 3, result.both
    lines = result.err.splitlines()
    assert lines[0].startswith(f"Network trouble: cannot connect to {url} (")
    assert lines[0].endswith("Retrying in 0.5 s (try 2 of 3).")
    assert lines[1].endswith("Retrying in 1 s (try 3 of 3).")
    assert lines[2].startswith(f"Error: Server unreachable: cannot connect to {url}")
    assert "gave up after 3 tries" in lines[2]


def test_the_client_imports_no_django_and_no_torch():
    code = ("import sys, trainboard_client, trainboard_client.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'torch', 'rest_framework', 'jobs', "
            "'webapp', 'cloud_adapters', 'trainer_pkg')); print(bad)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_rerun_clone_continue_and_compare(logged_in, user, digits_dataset, cnn_model, local_backend):
    from jobs import services

    with sent_tasks(dispatch.SUBMIT_JOB) as submit:
        first = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                             backend=local_backend, procs_per_node=2, epochs=2, lr=0.05, name="base")
        TrainingJob.objects.filter(pk=first.pk).update(state="SUCCEEDED")

        cloned = logged_in("clone", str(first.pk), "--set", "epochs=5", "--set", "train.lr=0.01",
                           "--set", "name=\"tuned\"")
        assert cloned.code == 0, cloned.both
        clone = TrainingJob.objects.get(cloned_from=first)
        assert cloned.out == f"{clone.pk}\n"
        assert (clone.name, clone.config["train"]["epochs"], clone.config["train"]["lr"], clone.procs_per_node) == (
            "tuned", 5, 0.01, 2)

        again = logged_in("rerun", str(first.pk))
        assert again.code == 0, again.both
        rerun = TrainingJob.objects.get(rerun_of=first)
        assert again.out == f"{rerun.pk}\n" and rerun.config["train"] == first.config["train"]

        # Continuing needs a checkpoint: the server says so, and nothing is made.
        refused = logged_in("continue", str(first.pk), "--epochs", "6")
        assert refused.code == 2, refused.both
        assert refused.err == (f"Error: Job #{first.pk} never ran on its backend: there is no checkpoint or model to "
                               f"start from.\n")
        bad_set = logged_in("clone", str(first.pk), "--set", "epochs", "--set", "=3")
        assert bad_set.code == 2
        assert bad_set.err.splitlines() == [
            "Error: --set: 'epochs' is not KEY=VALUE (e.g. train.lr=0.01 or epochs=5).",
            "Error: --set: '=3' is not KEY=VALUE (e.g. train.lr=0.01 or epochs=5)."]
    assert submit.call_count == 3  # the first job, the clone, the re-run
    assert TrainingJob.objects.count() == 3

    compared = logged_in("compare", str(first.pk), str(clone.pk))
    assert compared.code == 0, compared.both
    lines = compared.out.splitlines()
    assert lines[0].split() == ["#%d" % first.pk, "base", "#%d" % clone.pk, "tuned"]
    lr_row = next(line for line in lines if line.startswith("train.lr "))
    assert lr_row.split() == ["train.lr", "0.05", "0.01"]
    partly = logged_in("compare", str(first.pk), "999999", "--json")
    assert partly.code == 2 and json.loads(partly.out)["not_found"] == [999999]
    assert partly.err == "Error: job(s) not found (or not yours): 999999.\n"
    unknown = logged_in("compare", "999999")
    assert (unknown.code, unknown.out, unknown.err) == (2, "", "Error: job(s) not found (or not yours): 999999.\n")


def test_datasets_create_and_its_errors(logged_in, user):
    made = logged_in("datasets", "create", "--name", "digits2", "--format", "builtin", "--builtin-name", "digits")
    assert made.code == 0, made.both
    from jobs.models import Dataset

    dataset = Dataset.objects.get(owner=user, name="digits2")
    assert made.out == f"{dataset.pk}\n" and dataset.builtin_name == "digits"
    listed = json.loads(logged_in("datasets", "ls", "--json").out)
    assert [d["name"] for d in listed] == ["digits2"]
    bad = logged_in("datasets", "create", "--name", "digits2", "--format", "parquet")
    assert bad.code == 2
    assert any(line.startswith("Error: format: ") for line in bad.err.splitlines()), bad.err
    assert Dataset.objects.filter(owner=user).count() == 1


def test_sweep_create_show_cancel_and_every_error(logged_in, user, digits_dataset, cnn_model, local_backend, tmp_path):
    from jobs.models import Sweep

    spec = {"name": "lr-grid", "base": {"dataset": "digits", "model_spec": "digits-cnn", "backend": "local",
                                        "epochs": 1},
            "search_space": {"train.lr": {"type": "categorical", "choices": [0.01, 0.1]}},
            "sampler": "grid", "max_trials": 2, "max_concurrent_trials": 1}
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text(json.dumps({**spec, "sampler": "bogus", "max_concurrent_trials": 0,
                                    "search_space": {"train.nope": {"type": "int", "low": 1, "high": 2}}}))
    bad = logged_in("sweep", "create", "-f", str(bad_file))
    assert bad.code == 2
    assert {line.split(":")[1].strip() for line in bad.err.splitlines()} == {
        "sampler", "max_concurrent_trials", "search_space"}, bad.err
    assert Sweep.objects.count() == 0

    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    with sent_tasks(dispatch.SWEEP_FILL) as fill:
        made = logged_in("sweep", "create", "-f", str(spec_file))
    assert made.code == 0, made.both
    sweep = Sweep.objects.get()
    assert made.out == f"{sweep.pk}\n" and fill.call_count == 1
    assert (sweep.name, sweep.sampler, sweep.max_trials, sweep.base["epochs"]) == ("lr-grid", "grid", 2, 1)
    shown = logged_in("sweep", "show", str(sweep.pk))
    assert shown.out.splitlines()[:2] == [f"Sweep #{sweep.pk} 'lr-grid': RUNNING",
                                          "maximize val_accuracy (final), sampler grid; trials 0 of 2"]
    assert [s["id"] for s in json.loads(logged_in("sweep", "ls", "--json").out)] == [sweep.pk]
    cancelled = logged_in("sweep", "cancel", str(sweep.pk))
    assert cancelled.code == 0 and cancelled.err == f"Sweep #{sweep.pk}: CANCELLED.\n"
    sweep.refresh_from_db()
    assert sweep.state == "CANCELLED"
