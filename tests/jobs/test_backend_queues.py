"""A Celery queue per GPU box (``gpubox.<name>``): where a box's tasks go, the names that would make
two rows share one box's queue, renaming a box with active jobs, and ``manage.py gpubox_worker``."""

from __future__ import annotations

import io
import shlex
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command

from cloud_adapters.gpubox import GpuBoxBackend
from cloud_adapters.sagemaker import SageMakerBackend
from jobs import dispatch, services
from jobs.adapters import backend_queue
from jobs.models import JobStateChoices as S
from jobs.states import transition
from tests.taskkit import sent_tasks

pytestmark = pytest.mark.django_db


def test_each_box_has_its_own_queue_and_cloud_backends_share_the_default():
    assert GpuBoxBackend.queue_for("box-a", {}) == "gpubox.box-a"
    assert GpuBoxBackend.queue_for("Box_2", {"run_root": "/x"}) == "gpubox.Box_2"
    assert SageMakerBackend.queue_for("box-a", {}) == "celery"


@pytest.mark.parametrize("name", ["", "box.a", "box a", "box*", "x" * 101, "bøx", None])
def test_a_name_that_is_no_slug_names_no_queue(name):
    with pytest.raises(ValueError, match="must be a slug"):
        GpuBoxBackend.queue_for(name, {})


def test_the_tasks_of_a_box_go_to_its_queue(user, digits_dataset, cnn_model, local_backend,
                                            django_capture_on_commit_callbacks):
    assert backend_queue(local_backend) == "gpubox.local"
    box_b = services.backend_create(owner=user, name="box-b", kind="gpubox", config={})
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        with django_capture_on_commit_callbacks(execute=True):
            job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                               backend=box_b, nodes=1, procs_per_node=1, epochs=1)
    send.assert_called_once_with(args=[job.pk], queue="gpubox.box-b")


def test_another_users_box_of_the_same_name_is_refused(user, other_user, local_backend):
    with pytest.raises(ValidationError) as excinfo:
        services.backend_create(owner=other_user, name="local", kind="gpubox", config={})
    assert excinfo.value.message_dict["name"] == [
        "Another user's backend is already named local, and this backend's name makes its own Celery queue "
        "(gpubox.local), which only the worker on its machine consumes; choose another name."]
    # Renaming onto it is refused alike; a cloud backend shares the default queue, so its name is free.
    theirs = services.backend_create(owner=other_user, name="theirs", kind="gpubox", config={})
    with pytest.raises(ValidationError, match="Another user's backend is already named local"):
        services.backend_update(backend=theirs, name="local")
    cloud = services.backend_create(owner=other_user, name="local", kind="sagemaker",
                                    config={"role_arn": "arn:aws:iam::123456789012:role/x",
                                            "bucket": "tb-bucket", "region": "us-east-1"},
                                    secrets={"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": "s"})
    assert backend_queue(cloud) == "celery"


def test_renaming_a_box_with_active_jobs_is_refused_and_names_them(user, digits_dataset, cnn_model, local_backend):
    jobs = [services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                         backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
            for _ in range(2)]
    transition(jobs[1], S.SUBMITTING)
    with pytest.raises(ValidationError) as excinfo:
        services.backend_update(backend=local_backend, name="box-a")
    assert excinfo.value.message_dict["name"] == [
        f"This backend has active jobs (#{jobs[0].pk}, #{jobs[1].pk}) on its Celery queue gpubox.local, which "
        f"the new name would change; wait for them to end (or cancel them) before renaming it."]
    local_backend.refresh_from_db()
    assert local_backend.name == "local"
    # Other changes go through while jobs run; a rename once they have ended moves the queue.
    services.backend_update(backend=local_backend, config={"hourly_rate_usd": 2})
    for job in jobs:
        services.training_job_cancel(job=job, reason="done")
        job.refresh_from_db()
        if job.state != S.CANCELLED:
            transition(job, S.CANCELLED)
    renamed = services.backend_update(backend=local_backend, name="box-a")
    assert renamed.name == "box-a" and backend_queue(renamed) == "gpubox.box-a"


def test_gpubox_worker_prints_the_worker_of_one_box(user, local_backend):
    out, err = io.StringIO(), io.StringIO()
    call_command("gpubox_worker", "local", "--concurrency", "3", "--print", stdout=out, stderr=err)
    argv = shlex.split(out.getvalue())
    assert Path(argv[0]).name == "celery"
    assert argv[1:] == ["-A", "webapp", "worker", "-Q", "gpubox.local", "-n", "gpubox-local@%h",
                        "--concurrency", "3", "--loglevel", "INFO"]
    assert err.getvalue() == ""  # the backend exists: nothing to warn about


@pytest.mark.parametrize("args,env,message", [
    ((), None, "Name the GPU box: manage.py gpubox_worker <backend name>, or set TRAINBOARD_GPUBOX_NAME."),
    (("box.a",), None, "A GPU box's name must be a slug (letters, digits, - and _) to name its Celery queue; got 'box.a'."),
    (("box-a", "--concurrency", "0"), None, "--concurrency must be at least 1, got 0."),
    ((), "bad name", "A GPU box's name must be a slug (letters, digits, - and _) to name its Celery queue; got 'bad name'."),
])
def test_gpubox_worker_refuses_what_names_no_queue(monkeypatch, args, env, message):
    if env is None:
        monkeypatch.delenv("TRAINBOARD_GPUBOX_NAME", raising=False)
    else:
        monkeypatch.setenv("TRAINBOARD_GPUBOX_NAME", env)
    with pytest.raises(CommandError) as excinfo:
        call_command("gpubox_worker", *args, "--print", stdout=io.StringIO(), stderr=io.StringIO())
    assert str(excinfo.value) == message


def test_gpubox_worker_says_when_the_name_is_another_kinds(user, monkeypatch):
    services.backend_create(owner=user, name="cloudy", kind="sagemaker",
                            config={"role_arn": "arn:aws:iam::123456789012:role/x", "bucket": "tb-bucket",
                                    "region": "us-east-1"},
                            secrets={"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": "s"})
    err = io.StringIO()
    call_command("gpubox_worker", "cloudy", "--print", stdout=io.StringIO(), stderr=err)
    assert err.getvalue().strip() == ("No GPU-box backend is named cloudy yet (there is a sagemaker backend of "
                                      "that name); this worker will serve gpubox.cloudy once one is created "
                                      "with that name.")
