"""jobs/restarts.py on the clouds that report a lost run (docs/recovery.md), through the real sync and
submit task with the real adapters on their stand-ins: a Vertex AI spot job that ends
JOB_STATE_FAILED for its preemption, an Azure ML low-priority job that ends Failed for it. Each is
resubmitted as attempt 2 with ``checkpoint_uri`` = where the lost attempt's trainer wrote its
checkpoints (``Backend.checkpoint_uri``: the gs:// ``AIP_CHECKPOINT_DIR``, the ``checkpoints``
output's datastore path), and attempt 2 is created so that its trainer resumes from there: on
Vertex AI with the lost attempt's base output directory (Vertex sets ``AIP_CHECKPOINT_DIR`` from
it, clouds.md §2.3), on Azure ML with its ``checkpoints`` output at that path (mounted as
``AZURE_ML_OUTPUT_checkpoints``). As the GPU box's test in tests/jobs/test_restarts_policy.py."""

from __future__ import annotations

import pytest

from adapter_standins import azureml_workspace_in_registry, azurite_blob, standin, vertex_with_gcs
from jobs import dispatch, services, sync, tasks
from jobs.models import JobAttempt, JobStateChoices as S, TrainingJob
from taskkit import sent_tasks
from trainer_pkg.config import JobConfig
from trainer_pkg.platforms import gcs_fuse_path, read_vertex

pytestmark = [pytest.mark.django_db,
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::UserWarning")]  # azure-ai-ml's marshmallow schemas

azureml_standin = standin("azureml")


def _reload(job) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


@pytest.fixture
def sync_pass(django_capture_on_commit_callbacks):
    """One sync pass of a backend; what it sends after commit is sent at its end, as in a worker."""
    def run(backend) -> None:
        with django_capture_on_commit_callbacks(execute=True):
            sync.backend_sync(backend_id=backend.pk)
    return run


def _submitted(user, dataset, model, backend, capture_on_commit) -> TrainingJob:
    """A 3-epoch spot job created through the service and submitted by the task body itself."""
    with sent_tasks(dispatch.SUBMIT_JOB), capture_on_commit(execute=True):
        job = services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                           procs_per_node=1, epochs=3, spot=True)
    tasks.submit_job(job.pk)
    job = _reload(job)
    assert job.state == S.PENDING, job.failure_reason
    return job


def _resubmitted(job, backend, sync_pass) -> TrainingJob:
    """The sync pass that sees the lost run: the job is QUEUED as attempt 2 and its submit is sent."""
    with sent_tasks(dispatch.SUBMIT_JOB) as sent:
        sync_pass(backend)
    job = _reload(job)
    assert (job.state, job.attempt, sent.call_count) == (S.QUEUED, 2, 1), job.failure_reason
    assert job.events.last().message.endswith("resubmitting, attempt 2 of 3")  # a checkpoint to resume from
    return job


# -- Vertex AI -------------------------------------------------------------------------------------


@pytest.fixture
def vertex(monkeypatch, tmp_path):
    """``(Vertex stand-in, Cloud Storage emulator URL)``, no ambient Google configuration."""
    with vertex_with_gcs(monkeypatch, tmp_path) as both:
        yield both


def test_a_vertex_spot_job_lost_to_preemption_is_resubmitted_onto_its_checkpoints(
        user, digits_dataset, cnn_model, vertex, sync_pass, django_capture_on_commit_callbacks):
    api, gcs_url = vertex
    backend = services.backend_create(owner=user, name="vx", kind="vertex", config={
        "project": "tb-recovery", "staging_bucket": "gs://stage/tb", "api_endpoint": api.url,
        "storage_endpoint": gcs_url, "machine_type": "n1-standard-8", "spot_allowed": True})
    job = _submitted(user, digits_dataset, cnn_model, backend, django_capture_on_commit_callbacks)
    first_name = job.provider_job_name
    [first] = api.created
    base = first["jobSpec"]["baseOutputDirectory"]["outputUriPrefix"]
    assert base == f"gs://stage/tb/output/{first_name}/"
    # Vertex gave up its own restarts of the reclaimed Spot VM: FAILED with a STOCKOUT error.
    api.jobs[job.provider_handle["provider_job_id"]].update(
        state="JOB_STATE_FAILED", startTime="2026-01-01T00:01:00Z", endTime="2026-01-01T00:11:00Z",
        updateTime="2026-01-01T00:11:00Z",
        error={"code": 14, "message": "The Spot VM of workerpool0-0 was preempted (STOCKOUT)"})

    job = _resubmitted(job, backend, sync_pass)

    checkpoints = f"{base}checkpoints/"  # the lost attempt's AIP_CHECKPOINT_DIR (clouds.md §2.3)
    assert job.checkpoint_uri == checkpoints
    [lost] = JobAttempt.objects.filter(job=job)
    assert (lost.provider_job_name, lost.outcome, lost.checkpoint_uri) == (first_name, "lost", checkpoints)
    assert "preempted (STOCKOUT)" in lost.reason

    tasks.submit_job(job.pk)  # attempt 2, as the worker runs it
    job = _reload(job)
    assert job.state == S.PENDING and job.provider_job_name == f"{first_name}-a2"
    second = api.created[1]
    assert second["labels"]["trainboard-job-name"] == f"{first_name}-a2"
    # The same base output directory: Vertex sets attempt 2's AIP_CHECKPOINT_DIR to the lost
    # attempt's checkpoints, and the trainer keeps (so resumes from) its checkpoints there.
    assert second["jobSpec"]["baseOutputDirectory"] == {"outputUriPrefix": base}
    cfg = JobConfig.from_dict(job.config)
    env = {"AIP_MODEL_DIR": f"{base}model/", "AIP_CHECKPOINT_DIR": f"{base}checkpoints/"}
    resolved = read_vertex(env, cfg, reason="test").resolve(cfg)
    assert resolved.output.checkpoint_dir == gcs_fuse_path(job.checkpoint_uri, {})


# -- Azure ML --------------------------------------------------------------------------------------


@pytest.fixture
def azureml(monkeypatch, tmp_path):
    """The in-memory workspace (its code uploads to Azurite); every Azure ML adapter the services
    build talks to it through the stand-in transport with a fake credential."""
    with azurite_blob(tmp_path) as blob:
        yield azureml_workspace_in_registry(monkeypatch, blob)


def test_an_azure_low_priority_job_lost_to_preemption_is_resubmitted_onto_its_checkpoints(
        user, digits_dataset, cnn_model, azureml, sync_pass, django_capture_on_commit_callbacks):
    backend = services.backend_create(owner=user, name="aml", kind="azureml", config={
        "subscription_id": azureml_standin.SUBSCRIPTION, "resource_group": azureml_standin.RESOURCE_GROUP,
        "workspace": azureml_standin.WORKSPACE, "compute": azureml_standin.COMPUTE})
    job = _submitted(user, digits_dataset, cnn_model, backend, django_capture_on_commit_callbacks)
    first_name = job.provider_handle["extra"]["azure_job_name"]
    [first] = azureml.puts[first_name]
    assert first["properties"]["queueSettings"]["jobTier"] == "Spot"
    assert "uri" not in first["properties"]["outputs"]["checkpoints"]  # Azure ML's default place
    # Azure ML did not requeue it: Failed, its error naming the preemption.
    azureml.set_status(first_name, "Failed", StartTimeUtc="2026-11-29T12:01:00Z", EndTimeUtc="2026-11-29T12:11:00Z")
    azureml.run_errors[first_name] = {"code": "ServiceError", "message": "the job's low priority nodes were preempted"}

    job = _resubmitted(job, backend, sync_pass)

    checkpoints = f"azureml://datastores/workspaceblobstore/paths/azureml/{first_name}/checkpoints/"
    assert job.checkpoint_uri == checkpoints
    [lost] = JobAttempt.objects.filter(job=job)
    assert (lost.outcome, lost.checkpoint_uri) == ("lost", checkpoints)
    assert "preempted" in lost.reason

    tasks.submit_job(job.pk)  # attempt 2, as the worker runs it
    job = _reload(job)
    second_name = job.provider_handle["extra"]["azure_job_name"]
    assert job.state == S.PENDING and second_name != first_name
    [second] = azureml.puts[second_name]
    # Its checkpoints output is the lost attempt's folder: mounted read-write as
    # AZURE_ML_OUTPUT_checkpoints, where the trainer keeps (so resumes from) its checkpoints.
    assert second["properties"]["outputs"]["checkpoints"] == {
        "jobOutputType": "uri_folder", "uri": checkpoints, "mode": "ReadWriteMount"}
    assert "uri" not in second["properties"]["outputs"]["model"]  # its own model output
