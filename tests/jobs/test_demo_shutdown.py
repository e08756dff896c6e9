"""`manage.py demo`'s Ctrl-C path: training still running on this machine is stopped and recorded as
CANCELLED before the command exits (not left STOPPING until the next start). Real gpubox run (supervisor,
torchrun and launcher; the training the trainer stand-in's, held at its first step until it is stopped)."""

from __future__ import annotations

import io

import pytest

from jobs import dispatch, services, sync, tasks
from jobs.management.commands import demo
from jobs.models import JobEvent, JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db


def test_shutdown_cancels_local_training_and_records_cancelled(user, digits_dataset, cnn_model, local_backend,
                                                                 wait_until, live_processes, settings,
                                                                 trainer_standin):
    settings.TRAINBOARD_GPUBOX_PYTHON = trainer_standin.python
    trainer_standin.hold(steps=1)
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=local_backend, nodes=1, procs_per_node=2, epochs=1)
    tasks.submit_job(job.pk)

    def running():
        sync.backend_sync(backend_id=local_backend.pk)
        return TrainingJob.objects.get(pk=job.pk).state == S.RUNNING

    wait_until(running, timeout=60, what="the job to be RUNNING")
    name = TrainingJob.objects.get(pk=job.pk).provider_handle["job_name"]
    assert live_processes(name), "the trainer should be running"

    out = io.StringIO()
    command = demo.Command(stdout=out, stderr=io.StringIO())
    command._children = []  # web, worker and beat are not started in this test
    command._box_queue = "gpubox.local"  # the queue of the box its worker consumed: local_backend's
    command._shutdown()

    job.refresh_from_db()
    assert job.state == S.CANCELLED
    assert job.failure_reason == "Demo stopped with Ctrl-C"
    assert [line for line in out.getvalue().splitlines() if line.startswith(("Cancelling job", f"Job {job.pk}"))] == [
        f"Cancelling job {job.pk}", f"Job {job.pk} CANCELLED"]
    assert list(JobEvent.objects.filter(job=job).values_list("to_state", flat=True))[-2:] == [S.STOPPING, S.CANCELLED]
    wait_until(lambda: not live_processes(name), timeout=30, what="the job's processes to exit")
