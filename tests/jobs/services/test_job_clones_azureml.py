"""Continue and fine-tune from an Azure ML job (jobs/services/lineage.py, docs/clone-continue.md),
through the services and the real submit task with the real adapter on the stand-in workspace (its
files on Azurite): the source's file is its datastore path (``artifact_uri``), accepted for a job on
the same Azure ML backend, which mounts it as the job's ``init_from`` input and hands the trainer the
mounted path; refused, naming the backend to choose, for a backend that cannot mount it."""

from __future__ import annotations

import contextlib

import pytest
from azure.core.exceptions import ResourceExistsError
from django.core.exceptions import ValidationError
from django.utils import timezone

from adapter_standins import azureml_workspace_in_registry, azurite_blob, standin
from jobs import dispatch, services, tasks
from jobs.models import JobStateChoices as S, MetricPoint, TrainingJob
from taskkit import sent_tasks

pytestmark = [pytest.mark.django_db,
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::UserWarning")]  # azure-ai-ml's marshmallow schemas

azureml_standin = standin("azureml")
COMMAND = "python -m trainer_pkg.launch --config trainboard_job.json"


@pytest.fixture
def azureml(monkeypatch, tmp_path):
    """The in-memory workspace (code uploads and datastore files on Azurite); every Azure ML adapter
    the services build talks to it."""
    with azurite_blob(tmp_path) as blob:
        yield azureml_workspace_in_registry(monkeypatch, blob)


def _backend(user, name="aml"):
    return services.backend_create(owner=user, name=name, kind="azureml", config={
        "subscription_id": azureml_standin.SUBSCRIPTION, "resource_group": azureml_standin.RESOURCE_GROUP,
        "workspace": azureml_standin.WORKSPACE, "compute": azureml_standin.COMPUTE})


def _reload(job) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _submit(job) -> TrainingJob:
    tasks.submit_job(job.pk)  # as the worker runs it
    job = _reload(job)
    assert job.state == S.PENDING, job.failure_reason
    return job


def _ended_source(user, dataset, model, backend, workspace, capture_on_commit) -> tuple[TrainingJob, str]:
    """A 3-epoch job submitted to ``backend`` that SUCCEEDED, its outputs in the datastore as Azure
    ML's default paths leave them; (the job, its Azure ML name)."""
    with sent_tasks(dispatch.SUBMIT_JOB), capture_on_commit(execute=True):
        job = services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                           procs_per_node=1, epochs=3, lr=0.02)
    job = _submit(job)
    name = job.provider_handle["extra"]["azure_job_name"]
    workspace.set_status(name, "Completed")
    service = workspace.blob.service()
    with contextlib.suppress(ResourceExistsError):
        service.create_container("azureml-blobstore")
    container = service.get_container_client("azureml-blobstore")
    container.upload_blob(f"azureml/{name}/checkpoints/last.pt", b"epoch 3 checkpoint", overwrite=True)
    container.upload_blob(f"azureml/{name}/model/model.pt", b"weights", overwrite=True)
    job.state = S.SUCCEEDED
    job.save(update_fields=["state"])
    for epoch in range(3):
        MetricPoint.objects.create(job=job, name="val_loss", step=10 * (epoch + 1), epoch=epoch, value=0.5,
                                   recorded_at=timezone.now())
    return job, name


@pytest.mark.parametrize(("mode", "overrides", "blob"), [
    ("continue", {"epochs": 5}, "checkpoints/last.pt"),
    ("finetune", {"epochs": 2, "lr": 0.01}, "model/model.pt"),
])
def test_a_job_from_an_azure_ml_job_on_its_backend_mounts_the_file_and_gives_the_trainer_its_path(
        user, digits_dataset, cnn_model, azureml, django_capture_on_commit_callbacks, mode, overrides, blob):
    backend = _backend(user)
    source, source_name = _ended_source(user, digits_dataset, cnn_model, backend, azureml,
                                        django_capture_on_commit_callbacks)
    uri = f"azureml://datastores/workspaceblobstore/paths/azureml/{source_name}/{blob}"

    with sent_tasks(dispatch.SUBMIT_JOB) as sent, django_capture_on_commit_callbacks(execute=True):
        job = services.training_job_clone(owner=user, job=source, overrides={"init_mode": mode, **overrides})
    assert sent.call_count == 1
    assert (job.config["train"]["init_from"], job.config["train"]["init_mode"]) == (uri, mode)
    assert (job.source_job, job.backend) == (source, backend)
    assert job.source_checkpoint_epoch == (3 if mode == "continue" else None)

    job = _submit(job)
    name = job.provider_handle["extra"]["azure_job_name"]
    [body] = azureml.puts[name]
    props = body["properties"]
    assert props["inputs"] == {"init_from": {"jobInputType": "uri_file", "uri": uri, "mode": "ReadOnlyMount"}}
    assert props["command"] == COMMAND + " --init-from ${{inputs.init_from}}"
    assert job.config["train"]["init_from"] == uri  # the stored config names the source's file


def test_a_backend_that_cannot_mount_the_azure_ml_file_is_refused_with_the_backend_to_choose(
        user, digits_dataset, cnn_model, azureml, local_backend, django_capture_on_commit_callbacks):
    backend = _backend(user)
    source, source_name = _ended_source(user, digits_dataset, cnn_model, backend, azureml,
                                        django_capture_on_commit_callbacks)
    other_workspace_row = _backend(user, name="aml-b")  # another row: it may be another workspace
    for target in (local_backend, other_workspace_row):
        with pytest.raises(ValidationError) as excinfo:
            services.training_job_clone(owner=user, job=source, overrides={
                "init_mode": "continue", "epochs": 5, "backend": target})
        [message] = excinfo.value.message_dict["backend"]
        assert (f"lies on backend aml (Azure ML) at azureml://datastores/workspaceblobstore/paths/azureml/"
                f"{source_name}/checkpoints/last.pt" in message)
        assert f"({target.name}) cannot read it" in message and message.endswith("Choose backend aml.")
    assert TrainingJob.objects.count() == 1
