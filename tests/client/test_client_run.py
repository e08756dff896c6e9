"""``trainboard run`` against a live server (issue 32): its job options read from the server's schema,
a dry run that reports every error and creates nothing, and one real job end to end through a Celery
worker (a 2-rank script streamed to SUCCEEDED), then the same tree again: nothing uploaded."""

from __future__ import annotations

import hashlib
import json
import re
import signal
from pathlib import Path

import pytest
import yaml
from rest_framework import serializers

from jobs import dispatch, states
from jobs.models import CodeArchive, ModelSpec, TrainingJob
from polling import wait_for
from taskkit import sent_tasks
from trainboard_client.packing import pack

pytestmark = pytest.mark.django_db(transaction=True)

TRAIN_PY = """\
import os
import sys

print(f"hello from rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} with {sys.argv[1:]}", flush=True)
if os.environ["RANK"] == "0":
    os.makedirs(os.environ["TRAINBOARD_MODEL_DIR"], exist_ok=True)
    with open(os.path.join(os.environ["TRAINBOARD_MODEL_DIR"], "weights.bin"), "wb") as out:
        out.write(bytes(range(256)) * 512)
"""
WEIGHTS = bytes(range(256)) * 512


def _project(root: Path) -> Path:
    """A project directory: the script, plus what .gitignore and .trainboardignore leave out."""
    root.mkdir()
    (root / "train.py").write_text(TRAIN_PY)
    (root / ".gitignore").write_text("data/\n*.log\n")
    (root / ".trainboardignore").write_text("notes.txt\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\0" * 4096)
    (root / "run.log").write_text("old log\n")
    (root / "notes.txt").write_text("not code\n")
    return root


def test_run_help_lists_the_job_options_of_the_servers_schema_including_a_new_one(logged_in, monkeypatch):
    from webapp.api.serializers import TrainingJobCreateSerializer

    before = logged_in("run", "--help")
    assert before.code == 0, before.both
    text = " ".join(before.out.split())
    assert "Job options (from the server):" in before.out
    assert "--procs-per-node INTEGER" in text and "--max-runtime-s INTEGER" in text
    assert "--spot / --no-spot" in text
    assert "--priority INTEGER -100 to 100: where the backend queues jobs itself" in text  # the server's help
    assert "--model-spec" not in text  # run registers the model itself
    # A dataset or backend is an id or a name; a choice's help is the server's, without a list of the choices.
    assert "--dataset ID|NAME The dataset's id, or its name" in text and "--backend ID|NAME" in text
    assert "--strategy [ddp|fsdp|pipeline] ddp: every rank holds the model" in text and "`ddp` - ddp" not in text
    assert "--gpu-hours-cap" not in text

    # A field the server adds to its job request is an option of the client's next run, with its help.
    monkeypatch.setitem(TrainingJobCreateSerializer._declared_fields, "gpu_hours_cap", serializers.IntegerField(
        min_value=1, required=False, help_text="Stop the job after this many GPU hours."))
    after = " ".join(logged_in("run", "--help").out.split())
    assert "--gpu-hours-cap INTEGER Stop the job after this many GPU hours. Range 1..." in after
    assert "--gpu-hours-cap" in " ".join(logged_in("estimate", "--help").out.split())


def test_run_help_without_a_login_says_where_the_options_come_from(cli):
    result = cli("run", "--help")
    assert result.code == 0, result.both
    assert "Log in (trainboard login URL) to see the job options here" in " ".join(result.out.split())


def test_a_dry_run_prints_every_error_at_once_and_uploads_and_creates_nothing(logged_in, local_backend, tmp_path):
    project = _project(tmp_path / "proj")
    models = ModelSpec.objects.count()
    bad = logged_in("run", "missing.py", "--backend", "local", "--nodes", "0", "--procs-per-node", "x",
                    "--priority", "1000", "--dry-run", cwd=project)
    assert bad.code == 2, bad.both
    assert bad.err.splitlines() == [
        f"Error: script: missing.py is not in the packed files of {project} (ignored, or elsewhere?).",
        "Error: nodes: Ensure this value is greater than or equal to 1.",
        "Error: procs_per_node: A valid integer is required.",
        "Error: priority: Ensure this value is less than or equal to 100.",
    ]

    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump({"script": "train.py", "backend": "local", "procs_per_node": 2,
                                    "max_runtime_s": 1200, "epochz": 3}))
    typo = logged_in("run", "-f", str(task), "--dry-run", cwd=project)
    assert typo.code == 2
    prefix = "Error: epochz: unknown key in the task file; known keys: "
    assert typo.err.startswith(prefix), typo.err
    known = typo.err[len(prefix):].strip().rstrip(".").split(", ")
    # The client's own keys and every job option of the server's schema (max_steps: a trainer-config
    # field the job request declares), sorted.
    assert known == sorted(known) and {"args", "backend", "epochs", "script", "max_steps", "seq_len"} <= set(known)

    task.write_text(yaml.safe_dump({"script": "train.py", "backend": "local", "procs_per_node": 2,
                                    "max_runtime_s": 1200}))
    good = logged_in("run", "-f", str(task), "--nodes", "1", "--dry-run", cwd=project)
    assert good.code == 0, good.both
    assert good.err.splitlines()[0].startswith(f"Packed 3 files from {project}: ")
    assert "Estimate: $1.2000 (1200 s × 1 node × $3.60/h)" in good.err
    assert "Dry run: the code would be uploaded at launch" in good.err
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), TrainingJob.objects.count()) == (models, 0, 0)

    # Without --dry-run, a job the server refuses uploads nothing either.
    refused = logged_in("run", "train.py", "--backend", "local", "--nodes", "0", cwd=project)
    assert refused.code == 2
    assert refused.err.splitlines()[1:] == ["Error: nodes: Ensure this value is greater than or equal to 1."]
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), TrainingJob.objects.count()) == (models, 0, 0)


def test_a_refused_archive_is_the_servers_error_naming_the_member_and_nothing_is_made(logged_in, local_backend,
                                                                                     tmp_path):
    project = _project(tmp_path / "proj")
    (project / "trainer_pkg").mkdir()
    (project / "trainer_pkg" / "mine.py").write_text("x = 1\n")
    with sent_tasks(dispatch.SUBMIT_JOB) as submit:
        refused = logged_in("run", "train.py", "--backend", "local", cwd=project)
    assert refused.code == 2, refused.both
    assert refused.err.splitlines()[-1].startswith(
        "Error: code: member 'trainer_pkg/mine.py': trainer_pkg/ is Trainboard's trainer package"), refused.err
    assert (ModelSpec.objects.count(), CodeArchive.objects.count(), TrainingJob.objects.count()) == (0, 0, 0)
    submit.assert_not_called()


def test_run_model_entry_registers_a_model_of_kind_code_for_the_built_in_trainer(logged_in, digits_dataset,
                                                                                 local_backend, tmp_path):
    project = tmp_path / "tiny"
    (project / "tinynet").mkdir(parents=True)
    (project / "tinynet" / "__init__.py").write_text("")
    (project / "tinynet" / "net.py").write_text("def build(num_classes, **params):\n    raise NotImplementedError\n")
    with sent_tasks(dispatch.SUBMIT_JOB) as submit:
        launched = logged_in("run", "--model-entry", "tinynet.net:build", "--dataset", "digits", "--backend", "local",
                             "--epochs", "2", "--detach", cwd=project)
    assert launched.code == 0, launched.both
    job = TrainingJob.objects.get()
    assert launched.out == f"{job.pk}\n"
    assert (job.model_spec.kind, job.model_spec.entry_point, job.dataset_id, job.config["train"]["epochs"]) == (
        "code", "tinynet.net:build", digits_dataset.pk, 2)
    assert list(job.model_spec.code.files) == ["tinynet/__init__.py", "tinynet/net.py"]
    submit.assert_called_once()


def test_run_m_runs_a_module_of_the_project_as_python_m_does(logged_in, local_backend, tmp_path):
    project = tmp_path / "modproj"
    (project / "tinypkg").mkdir(parents=True)
    (project / "tinypkg" / "__init__.py").write_text("")
    (project / "tinypkg" / "train.py").write_text("print('hi')\n")
    # As with python -m, every positional argument is the module's: "x.py" here is an argument, not a script.
    dry = logged_in("run", "-m", "tinypkg.train", "x.py", "--backend", "local", "--dry-run", cwd=project)
    assert dry.code == 0, dry.both
    with sent_tasks(dispatch.SUBMIT_JOB) as submit:
        launched = logged_in("run", "-m", "tinypkg.train", "--backend", "local", "--detach", "--", "--epochs", "3",
                             cwd=project)
    assert launched.code == 0, launched.both
    assert launched.err.splitlines()[0].startswith(f"Packed 2 files from {project}: ")
    job = TrainingJob.objects.get()
    assert (job.model_spec.kind, job.model_spec.entry_point, job.model_spec.script_args) == (
        "script", "-m tinypkg.train", ["--epochs", "3"])
    submit.assert_called_once()


def test_run_exits_1_with_the_jobs_failure_reason(logged_in, local_backend, tmp_path):
    """The job is moved by this test, as a worker's sync would move it: the client follows the server."""
    project = _project(tmp_path / "proj")
    with sent_tasks(dispatch.SUBMIT_JOB):
        running = logged_in.start("run", "train.py", "--backend", "local", "--poll", "0.2", cwd=project)
        try:
            job = wait_for(lambda: TrainingJob.objects.first(), timeout=60, what="the job the client launches")
            states.transition(job, "SUBMITTING", message="Submitting")
            states.transition(job, "FAILED", message="exited 3", failure_reason="rank 1 exited with code 3")
            out, err = running.communicate(timeout=60)
        finally:
            if running.poll() is None:
                running.kill()
                running.wait()
    assert running.returncode == 1, err
    assert err.splitlines()[-3:] == [f"[job #{job.pk}] SUBMITTING: Submitting", f"[job #{job.pk}] FAILED: exited 3",
                                     f"Job #{job.pk} FAILED: rank 1 exited with code 3"]


def test_ctrl_c_while_following_detaches_and_leaves_the_job_running(logged_in, local_backend, tmp_path):
    project = _project(tmp_path / "proj")
    with sent_tasks(dispatch.SUBMIT_JOB):
        running = logged_in.start("run", "train.py", "--backend", "local", "--poll", "0.2", cwd=project)
        try:
            seen = []
            for line in running.stderr:  # until the client follows the job
                seen.append(line)
                if line.startswith("[job #"):
                    break
            running.send_signal(signal.SIGINT)
            out, err = running.communicate(timeout=60)
        finally:
            if running.poll() is None:
                running.kill()
                running.wait()
    job = TrainingJob.objects.get()
    assert running.returncode == 130, "".join(seen) + err
    assert seen[-1] == f"[job #{job.pk}] QUEUED: Created\n"
    # Not a terminal: nobody to ask, so the job is left running (stdin is not a tty).
    assert err.splitlines()[-1] == f"Detached; job #{job.pk} keeps running: trainboard logs -f {job.pk}"
    job.refresh_from_db()
    assert job.state == "QUEUED"


@pytest.mark.e2e
def test_run_streams_a_two_rank_script_to_succeeded_and_a_second_run_uploads_nothing(
        logged_in, celery_worker_process, shared_celery_worker, user, local_backend, tmp_path, settings):
    settings.TRAINBOARD_CODE_STORE = shared_celery_worker.code_store  # the upload lands where the worker reads
    project = _project(tmp_path / "proj")
    result = logged_in("run", "train.py", "--backend", "local", "--procs-per-node", "2", "--max-runtime-s", "600",
                       "--poll", "0.5", "--", "--epochs", "3", cwd=project, timeout=300)
    assert result.code == 0, result.both + celery_worker_process.log()[-3000:]

    job = TrainingJob.objects.get()
    assert (job.state, job.backend_id, job.nodes, job.procs_per_node, job.max_runtime_s) == (
        "SUCCEEDED", local_backend.pk, 1, 2, 600)
    model = job.model_spec
    packed = pack(project)
    assert (model.kind, model.entry_point, model.script_args) == ("script", "train.py", ["--epochs", "3"])
    assert model.code.sha256 == packed.sha256  # the client's archive is byte for byte the server's
    assert list(model.code.files) == [".gitignore", ".trainboardignore", "train.py"]

    # The log streamed on stdout; the states, upload and estimate on stderr.
    for rank in (0, 1):
        assert f"hello from rank {rank} of 2 with ['--epochs', '3']" in result.out
    err = result.err
    assert f"Packed 3 files from {project}: " in err and f"sha256 {packed.sha256[:12]}." in err
    assert f"Registered model {model.name!r} (#{model.pk}), code sha256 {packed.sha256[:12]}." in err
    assert "Estimate: $0.6000 (600 s × 1 node × $3.60/h)" in err
    # Every transition of the job's timeline, in order, however quickly it passed.
    states = re.findall(rf"^\[job #{job.pk}\] ([A-Z]+)\b", err, flags=re.M)
    assert states == [e.to_state for e in job.events.order_by("created_at", "id") if e.to_state], err
    assert states[0] == "QUEUED" and states[-1] == "SUCCEEDED", err  # a script that logs no step skips RUNNING
    assert err.rstrip().splitlines()[-1].startswith(f"Job #{job.pk} SUCCEEDED")

    logs = logged_in("logs", str(job.pk))
    assert logs.code == 0 and "hello from rank 1 of 2 with ['--epochs', '3']" in logs.out
    followed = logged_in("logs", "-f", str(job.pk))  # the job has ended: the whole log, then done
    assert (followed.code, followed.out) == (0, logs.out)
    later = logged_in("logs", str(job.pk), "--after", "1")
    assert later.out.splitlines() == logs.out.splitlines()[2:]

    # The file the script wrote, listed with the server's SHA-256 and downloaded checked against it.
    listed = json.loads(logged_in("artifacts", "ls", str(job.pk), "--json").out)
    [weights] = [a for a in listed if a["name"].endswith("weights.bin")]
    assert (weights["size_bytes"], weights["sha256"]) == (len(WEIGHTS), hashlib.sha256(WEIGHTS).hexdigest())
    got = logged_in("artifacts", "download", str(job.pk), weights["name"], "-o", str(tmp_path / "w.bin"))
    assert got.code == 0, got.both
    assert (tmp_path / "w.bin").read_bytes() == WEIGHTS
    assert got.err == (f"Downloaded {weights['name']} to {tmp_path / 'w.bin'} ({len(WEIGHTS):,} bytes), sha256 "
                       f"{weights['sha256'][:16]}… matches the server's.\n")

    # The same tree again, from a task file: the model is found by its content, nothing is uploaded.
    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump({"script": "train.py", "args": ["--epochs", "3"], "backend": "local",
                                    "procs_per_node": 2, "max_runtime_s": 600}))
    with sent_tasks(dispatch.SUBMIT_JOB) as submit:  # launched, not run: one real run is enough
        again = logged_in("run", "-f", str(task), "--detach", cwd=project)
    assert again.code == 0, again.both
    second = TrainingJob.objects.exclude(pk=job.pk).get()
    assert again.out == f"{second.pk}\n"
    assert f"Code already on the server: model {model.name!r} (#{model.pk}); nothing to upload." in again.err
    assert "Uploading" not in again.err
    assert (ModelSpec.objects.count(), CodeArchive.objects.count()) == (1, 1)
    assert (second.model_spec_id, second.state, second.procs_per_node) == (model.pk, "QUEUED", 2)
    submit.assert_called_once()
