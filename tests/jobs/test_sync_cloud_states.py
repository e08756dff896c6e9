"""What each cloud state means for a job, through the real sync (jobs/sync.py) and the real adapters on
their stand-ins (moto for SageMaker, the local REST server for Vertex AI): a phase that goes on training
(SageMaker Updating, Uploading) is no interruption; a restart after training (SageMaker Interrupted,
Restarting, Starting, Downloading … until Training again) is one interruption, counted once; a Vertex AI
job that is paused is shown paused, and its resume (JOB_STATE_QUEUED, PENDING, RUNNING) never moves it
back to PENDING nor counts an interruption (clouds.md §1.2, §2.2; DESIGN.md §4)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.test import Client
from django.urls import reverse

from adapter_standins import vertex_with_gcs
from jobs import dispatch, services, sync, tasks
from jobs.models import JobStateChoices as S, TrainingJob
from jobs.selectors import training_job_interruption_count
from taskkit import sent_tasks

pytestmark = [pytest.mark.django_db,
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")]


def _submitted(user, dataset, model, backend, capture_on_commit, spot=False) -> TrainingJob:
    with sent_tasks(dispatch.SUBMIT_JOB), capture_on_commit(execute=True):
        job = services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                           procs_per_node=1, epochs=3, spot=spot)
    tasks.submit_job(job.pk)
    job = TrainingJob.objects.get(pk=job.pk)
    assert job.state == S.PENDING, job.failure_reason
    return job


def _now() -> str:
    """Now as Vertex AI stamps ``updateTime``: what the sync's changed-since listing compares."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _synced(job, capture_on_commit) -> tuple[str, int, str, str]:
    """One sync pass of the job's backend; (state, interruptions, raw state, secondary state) after it."""
    with capture_on_commit(execute=True):
        sync.backend_sync(backend_id=job.backend_id)
    job = TrainingJob.objects.get(pk=job.pk)
    return job.state, training_job_interruption_count(job=job), job.raw_state, job.secondary_state


def test_sagemaker_updating_and_uploading_go_on_and_a_restart_after_training_counts_once(
        user, digits_dataset, cnn_model, aws_env, django_capture_on_commit_callbacks):
    aws_env.create_bucket()
    backend = services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": aws_env.ROLE, "bucket": aws_env.BUCKET, "spot_allowed": True})
    job = _submitted(user, digits_dataset, cnn_model, backend, django_capture_on_commit_callbacks, spot=True)
    name = job.provider_handle["job_name"]
    life = [
        # before any training, an update keeps it PENDING
        ("Starting", S.PENDING, 0), ("Updating", S.PENDING, 0), ("Downloading", S.PENDING, 0),
        ("Training", S.RUNNING, 0),
        # a profiler / warm-pool update while it trains: it goes on training
        ("Updating", S.RUNNING, 0), ("Training", S.RUNNING, 0),
        # spot reclaim, SageMaker restarts it: one interruption however many phases the restart has
        ("Interrupted", S.PENDING, 1), ("Restarting", S.PENDING, 1), ("Starting", S.PENDING, 1),
        ("Downloading", S.PENDING, 1), ("Training", S.RUNNING, 1),
        # a retry (RetryStrategy: back to Starting) after training is the second restart
        ("Starting", S.PENDING, 2), ("Training", S.RUNNING, 2),
        # training done, artifacts uploading: still its run
        ("Uploading", S.RUNNING, 2), ("Updating", S.RUNNING, 2),
    ]
    for secondary, state, interruptions in life:
        aws_env.set_status(name, "InProgress", secondary)
        assert _synced(job, django_capture_on_commit_callbacks) == (state, interruptions, "InProgress", secondary), \
            secondary
    events = [(e.from_state, e.to_state) for e in TrainingJob.objects.get(pk=job.pk).events.all()
              if not e.is_note]
    assert events == [("", "QUEUED"), ("QUEUED", "SUBMITTING"), ("SUBMITTING", "PENDING"), ("PENDING", "RUNNING"),
                      ("RUNNING", "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "PENDING"), ("PENDING", "RUNNING")]


def test_sagemaker_updating_without_a_history_keeps_a_running_job_running(
        user, digits_dataset, cnn_model, aws_env, django_capture_on_commit_callbacks):
    aws_env.create_bucket()
    backend = services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": aws_env.ROLE, "bucket": aws_env.BUCKET})
    job = _submitted(user, digits_dataset, cnn_model, backend, django_capture_on_commit_callbacks)
    name = job.provider_handle["job_name"]
    aws_env.set_status(name, "InProgress", "Training")
    assert _synced(job, django_capture_on_commit_callbacks)[:2] == (S.RUNNING, 0)
    aws_env.set_status(name, "InProgress", "Updating")
    aws_env.training_jobs()[name].secondary_status_transitions = []  # a describe without the history
    assert _synced(job, django_capture_on_commit_callbacks)[:2] == (S.RUNNING, 0)
    assert "updating the job" in TrainingJob.objects.get(pk=job.pk).status_warning


@pytest.fixture
def vertex(monkeypatch, tmp_path):
    with vertex_with_gcs(monkeypatch, tmp_path) as both:
        yield both


def test_a_paused_vertex_job_is_shown_paused_and_its_resume_is_no_interruption(
        user, digits_dataset, cnn_model, vertex, django_capture_on_commit_callbacks):
    api, gcs_url = vertex
    backend = services.backend_create(owner=user, name="vx", kind="vertex", config={
        "project": "tb-states", "staging_bucket": "gs://stage/tb", "api_endpoint": api.url,
        "storage_endpoint": gcs_url, "machine_type": "n1-standard-8", "spot_allowed": True})
    job = _submitted(user, digits_dataset, cnn_model, backend, django_capture_on_commit_callbacks)
    remote = api.jobs[job.provider_handle["provider_job_id"]]
    page = Client()
    page.force_login(user)

    def live() -> str:
        return page.get(reverse("job-live", args=[job.pk])).content.decode()

    remote.update(state="JOB_STATE_PENDING", updateTime=_now())
    assert _synced(job, django_capture_on_commit_callbacks)[:2] == (S.PENDING, 0)
    remote.update(state="JOB_STATE_RUNNING", startTime=_now(), updateTime=_now())
    assert _synced(job, django_capture_on_commit_callbacks)[:2] == (S.RUNNING, 0)
    assert 'data-paused="1"' not in live()

    remote.update(state="JOB_STATE_PAUSED", updateTime=_now())
    assert _synced(job, django_capture_on_commit_callbacks) == (S.RUNNING, 0, "JOB_STATE_PAUSED", "Paused")
    html = live()
    assert '<span class="badge state-paused" data-paused="1"' in html and ">Paused</span>" in html
    assert "Paused by the provider (JOB_STATE_PAUSED): not training until it is resumed" in html  # timeline

    for state in ("JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_RUNNING"):  # resumed
        remote.update(state=state, updateTime=_now())
        assert _synced(job, django_capture_on_commit_callbacks) == (S.RUNNING, 0, state, ""), state
    html = live()
    assert 'data-paused="1"' not in html and "Resumed by the provider (JOB_STATE_QUEUED)" in html
    job = TrainingJob.objects.get(pk=job.pk)
    moves = [(e.from_state, e.to_state) for e in job.events.all() if not e.is_note]
    assert moves[-2:] == [("SUBMITTING", "PENDING"), ("PENDING", "RUNNING")]  # never back to PENDING
    assert [e.message for e in job.events.all() if e.is_note] == [
        "Paused by the provider (JOB_STATE_PAUSED): not training until it is resumed",
        "Resumed by the provider (JOB_STATE_QUEUED)"]
    assert not job.status_warning


def test_a_vertex_job_paused_before_it_ran_stays_pending_and_shows_paused(
        user, digits_dataset, cnn_model, vertex, django_capture_on_commit_callbacks):
    api, gcs_url = vertex
    backend = services.backend_create(owner=user, name="vx", kind="vertex", config={
        "project": "tb-states", "staging_bucket": "gs://stage/tb", "api_endpoint": api.url,
        "storage_endpoint": gcs_url, "machine_type": "n1-standard-8"})
    job = _submitted(user, digits_dataset, cnn_model, backend, django_capture_on_commit_callbacks)
    remote = api.jobs[job.provider_handle["provider_job_id"]]
    remote.update(state="JOB_STATE_PAUSED", updateTime=_now())
    assert _synced(job, django_capture_on_commit_callbacks) == (S.PENDING, 0, "JOB_STATE_PAUSED", "Paused")
    remote.update(state="JOB_STATE_QUEUED", updateTime=_now())
    assert _synced(job, django_capture_on_commit_callbacks) == (S.PENDING, 0, "JOB_STATE_QUEUED", "")
