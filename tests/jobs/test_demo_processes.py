"""``manage.py demo`` run for real: its web server, workers and beat go when the demo goes, whatever
ends it (SIGHUP from a closed terminal, SIGTERM, SIGKILL), the port is free again, and the links it
prints and the URL its children get use ``--port``; what it prints while it follows its job.

Each demo runs on the embedded default (SQLite, the filesystem broker) in its own
``TRAINBOARD_VAR_DIR`` on a free port, with ``--no-job``; everything is stopped by pid.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from jobs import dispatch, services
from jobs.management.commands import demo as demo_command
from jobs.management.commands.demo import CHILD_STOP_GRACE_S
from jobs.models import JobStateChoices as S, MetricPoint
from jobs.states import transition
from polling import wait_for
from taskkit import sent_tasks

REPO_ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        pairs = [item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


@pytest.fixture
def demo(tmp_path, live_processes):
    """Start ``manage.py demo --no-job`` on a free port; yields ``(proc, port, var_dir, out_path)``
    once it says it is up, and SIGKILLs whatever of it is left afterwards."""
    var_dir = tmp_path / "var"
    var_dir.mkdir()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "TRAINBOARD_BASE_URL")}
    env.update({"TRAINBOARD_VAR_DIR": str(var_dir), "PYTHONUNBUFFERED": "1"})
    out_path = tmp_path / "demo.out"
    with open(out_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "manage.py", "demo", "--port", str(port), "--no-job"],
                                cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def up():
        if proc.poll() is not None:
            pytest.fail(f"the demo exited ({proc.returncode}):\n{out_path.read_text()[-3000:]}")
        return "Trainboard is up:" in out_path.read_text()

    try:
        wait_for(up, timeout=240, interval=0.5, what="the demo to be up")
        yield proc, port, var_dir, out_path
    finally:
        for pid in live_processes(str(var_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_children_go_when_the_demo_goes(demo, live_processes, signum):
    proc, port, var_dir, out_path = demo
    output = out_path.read_text()
    children = {name: int(pid) for name, pid in re.findall(r"Started (web|worker|notifier|beat) \(pid (\d+)\)", output)}
    assert sorted(children) == ["beat", "notifier", "web", "worker"]
    # Every link printed, and the URL the worker and beat print links under, carries --port.
    base_url = f"http://127.0.0.1:{port}"
    assert f"Trainboard is up: {base_url}/" in output
    assert f"admin:    {base_url}/admin/    API: {base_url}/api/docs/" in output
    assert ":8000" not in output
    # Its box keeps jobs apart only with a root worker whose jobs' uids reach the interpreter and var/
    # (docs/gpu-boxes.md "Isolation"): the demo says which, here (var/ in pytest's 0700 tmp) that it cannot.
    assert re.search(r"^  jobs:     jobs on this box run as the dashboard's own user: for a single user only \(.+\)$",
                     output, re.M), output
    # Its processes' logs (every job's activity, the access log) are no job's to read.
    assert (var_dir / "logs").stat().st_mode & 0o777 == 0o700
    for name, pid in children.items():
        assert _environ(pid)["TRAINBOARD_BASE_URL"] == base_url, name
    assert not _port_free(port)
    everything = set(live_processes(str(var_dir)))
    assert set(children.values()) | {proc.pid} <= everything
    assert len(everything) >= 8, "demo, web + its 2 workers, worker + its 2 pool processes, notifier + its 1, beat"

    os.kill(proc.pid, signum)
    proc.wait(timeout=CHILD_STOP_GRACE_S + 60)  # a clean stop first syncs and stops local training

    wait_for(lambda: not live_processes(str(var_dir)), timeout=CHILD_STOP_GRACE_S + 15,
             what=f"every process of the demo to exit after {signum.name}")
    assert _port_free(port)
    if signum != signal.SIGKILL:
        assert proc.returncode == 0
        said = out_path.read_text() + ((var_dir / "logs" / "demo.log").read_text()
                                       if signum == signal.SIGHUP else "")
        assert [line for line in said.splitlines() if line.startswith("Stopped ")] == [
            "Stopped beat", "Stopped notifier", "Stopped worker", "Stopped web"]


def test_make_demo_passes_port():
    result = subprocess.run(["make", "-n", "demo", "PORT=8100"], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True)
    assert [line for line in result.stdout.splitlines() if "manage.py demo" in line] == [
        ".venv/bin/python manage.py demo --port 8100"]
    default = subprocess.run(["make", "-n", "demo"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert ".venv/bin/python manage.py demo --port 8000" in default.stdout.splitlines()


@pytest.mark.django_db
def test_follow_prints_every_transition_and_the_epochs_before_the_end(user, digits_dataset, cnn_model,
                                                                      local_backend):
    """Printing the state seen once a second would show QUEUED, PENDING (the SUBMITTING between
    them lost): the demo's follow loop prints the job's history, each epoch before the final state."""
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=local_backend, procs_per_node=2, epochs=2)
    steps = iter(["one sync: submitted and pending", "one sync: ran and ended"])

    def one_sync_per_second(_):
        if next(steps).endswith("pending"):
            transition(job, S.SUBMITTING)
            transition(job, S.PENDING, started_at=job.created_at)
            return
        transition(job, S.RUNNING, message="first step logged")
        running_at = job.events.order_by("-id").first().created_at
        for epoch in (0, 1):  # the trainer's epochs come after its first step
            MetricPoint.objects.create(job=job, name="val_accuracy", step=epoch + 1, epoch=epoch,
                                       value=0.9 + epoch / 100,
                                       recorded_at=running_at + dt.timedelta(seconds=epoch + 1))
        transition(job, S.SUCCEEDED)

    out = io.StringIO()
    command = demo_command.Command(stdout=out, stderr=io.StringIO())
    command._children = []
    with mock.patch("jobs.management.commands.demo.time.sleep", side_effect=one_sync_per_second):
        command._follow(job, {"now": False}, exit_when_done=True)
    printed = [line for line in out.getvalue().splitlines() if line.startswith(f"[job {job.pk}] ")]
    assert printed[:-1] == [f"[job {job.pk}] {text}" for text in (
        "QUEUED", "QUEUED → SUBMITTING", "SUBMITTING → PENDING", "PENDING → RUNNING",
        "epoch 0 val_accuracy 0.9000", "epoch 1 val_accuracy 0.9100", "RUNNING → SUCCEEDED")]
    assert printed[-1].startswith(f"[job {job.pk}] SUCCEEDED: launch → first step")


@pytest.mark.django_db
def test_a_box_that_may_not_start_jobs_leaves_the_demo_up_without_its_job(django_user_model, digits_dataset,
                                                                         cnn_model, local_backend, settings):
    """Two users who are not staff and a box that cannot give each job a uid of its own (here: run
    root in pytest's 0700 tmp): the demo says why it launches no job, instead of a traceback."""
    settings.TRAINBOARD_GPUBOX_ALLOW_SHARED_UID = False
    for name in ("carol", "dave"):
        django_user_model.objects.create_user(username=name, password=f"pw-{name}-123")
    out = io.StringIO()
    command = demo_command.Command(stdout=out, stderr=io.StringIO())
    with sent_tasks(dispatch.SUBMIT_JOB) as sent:
        job = command._launch_job(local_backend.owner, digits_dataset, cnn_model, local_backend,
                                  {"procs_per_node": 2, "epochs": 1}, "http://127.0.0.1:8000")
    assert job is None and sent.call_count == 0 and not local_backend.jobs.exists()
    printed = out.getvalue().strip()
    assert printed.startswith("No demo job: This GPU box cannot keep one user's job from another's: "), printed
    assert "This installation has 2 users" in printed and "TRAINBOARD_GPUBOX_ALLOW_SHARED_UID=true" in printed

    settings.TRAINBOARD_GPUBOX_ALLOW_SHARED_UID = True  # the operator accepts it: the job launches
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = command._launch_job(local_backend.owner, digits_dataset, cnn_model, local_backend,
                                  {"procs_per_node": 2, "epochs": 1}, "http://127.0.0.1:8000")
    assert job is not None and f"Demo job launched: http://127.0.0.1:8000/jobs/{job.pk}/" in out.getvalue()
