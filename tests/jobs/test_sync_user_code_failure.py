"""A script job that fails on a cloud that reports only an exit code (Vertex AI on its stand-in, through
the real sync): the job's failure reason leads with where the user's code failed, read from the job's
stored log — file:line, the error, and the offending source line — the provider's words following."""

from __future__ import annotations

import datetime as dt

import pytest

from adapter_standins import vertex_with_gcs
from jobs import dispatch, services, sync, tasks
from jobs.models import JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = [pytest.mark.django_db,
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")]

LOG = [  # what a rank of a script job prints when its train.py does not compile (Python 3.11)
    "[launch] rank 0 (local rank 0, node_rank 0) of world size 1, platform vertex, master :0",
    '  File "/tmp/trainboard-code-1/code/train.py", line 3',
    "    x = = 1",
    "        ^",
    "SyntaxError: invalid syntax",
]


@pytest.fixture
def vertex(monkeypatch, tmp_path):
    with vertex_with_gcs(monkeypatch, tmp_path) as both:
        yield both


def test_a_script_that_does_not_compile_fails_naming_its_file_line_and_source(
        user, digits_dataset, cnn_model, vertex, django_capture_on_commit_callbacks):
    api, gcs_url = vertex
    backend = services.backend_create(owner=user, name="vx", kind="vertex", config={
        "project": "tb-code", "staging_bucket": "gs://stage/tb", "api_endpoint": api.url,
        "storage_endpoint": gcs_url, "machine_type": "n1-standard-8"})
    with sent_tasks(dispatch.SUBMIT_JOB), django_capture_on_commit_callbacks(execute=True):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=backend, procs_per_node=1, epochs=1)
    tasks.submit_job(job.pk)
    job = TrainingJob.objects.get(pk=job.pk)
    job_id = job.provider_handle["provider_job_id"]
    now = dt.datetime.now(dt.timezone.utc)
    for i, text in enumerate(LOG):
        api.add_entry(job_id.rsplit("/", 1)[-1], (now + dt.timedelta(milliseconds=i)).isoformat().replace(
            "+00:00", "Z"), f"e{i}", text=text)
    api.jobs[job_id].update(state="JOB_STATE_FAILED", startTime="2026-01-01T00:01:00Z",
                            endTime="2026-01-01T00:02:00Z", updateTime=now.isoformat().replace("+00:00", "Z"),
                            error={"code": 3, "message": "The replica workerpool0-0 exited with a non-zero status of 1."})
    with django_capture_on_commit_callbacks(execute=True):
        sync.backend_sync(backend_id=backend.pk)
    job = TrainingJob.objects.get(pk=job.pk)
    assert job.state == S.FAILED
    assert job.failure_reason == (
        "train.py:3: SyntaxError: invalid syntax (the backend reported: INVALID_ARGUMENT (3): The replica "
        "workerpool0-0 exited with a non-zero status of 1.)\n    x = = 1")
