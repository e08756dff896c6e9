"""Where an Azure ML job's checkpoints are (``AzureMLBackend.checkpoint_uri``) and how a resubmitted
attempt of a lost run is pointed back at them (docs/recovery.md), over the stand-in workspace and
Azurite: the answer is the job's ``checkpoints`` output as a datastore path (the one the trainer
mounts read-write as ``AZURE_ML_OUTPUT_checkpoints``), and an attempt given it has its own
``checkpoints`` output at that path, so it mounts, and resumes from, the lost attempt's folder.

A continue (or fine-tune) from a job of the workspace (docs/clone-continue.md): ``train.init_from`` is
the source's file as a datastore path (``artifact_uri``), which the trainer cannot read; the job
mounts it as the read-only ``uri_file`` input ``init_from`` and its command hands the launcher the
mounted path (``--init-from ${{inputs.init_from}}``), while the config it ships keeps the URI."""

from __future__ import annotations

import random
import shlex

import pytest
from azure.core.exceptions import ResourceExistsError
from azureml_standin import SETTINGS, FakeClock, FakeCredential, StandinTransport

from cloud_adapters import retry
from cloud_adapters.azureml import AzureMLBackend
from cloud_adapters.base import InvalidSpec, JobHandle, JobSpec, ProviderError
from trainer_pkg.config import JobConfig
from trainer_pkg.launch import build_parser, with_init_from
from trainer_pkg.platforms import read_azureml

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")  # azure-ai-ml's marshmallow schemas

CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"},
          "train": {"epochs": 3, "batch_size": 8}, "parallel": {"strategy": "ddp"}}
NAME = "tb-job-44-65f1a2c4"  # not test_azureml_submit.py's: the session's Azurite keeps its code snapshots by job name
CHECKPOINTS = f"azureml://datastores/workspaceblobstore/paths/azureml/{NAME}/checkpoints/"


def upload(azurite, blob: str, data: bytes) -> None:
    """``data`` as ``blob`` in the workspace's default datastore's container (Azurite)."""
    service = azurite.service()
    try:
        service.create_container("azureml-blobstore")
    except ResourceExistsError:
        pass
    service.get_container_client("azureml-blobstore").upload_blob(blob, data, overwrite=True)


def spec(name: str = NAME, **kw) -> JobSpec:
    values = dict(job_name=name, config=CONFIG, nodes=1, procs_per_node=1, spot=True, max_runtime_s=3600,
                  tags={"trainboard-job-id": "44"})
    values.update(kw)
    return JobSpec(**values)


@pytest.fixture
def backend(workspace, azurite):
    return AzureMLBackend(SETTINGS, credential=FakeCredential(), transport=StandinTransport(workspace),
                          retry_policy=retry.RetryPolicy(rng=random.Random(0)), clock=FakeClock(),
                          blob_account_url=azurite.url)


def test_checkpoint_uri_is_the_checkpoints_outputs_datastore_path(backend, workspace):
    handle = backend.submit(spec())
    # Submitted without a path: Azure ML's default place of the output.
    assert workspace.puts[NAME][0]["properties"]["outputs"]["checkpoints"] == {
        "jobOutputType": "uri_folder", "mode": "ReadWriteMount"}
    before = len(workspace.requests)
    assert backend.checkpoint_uri(handle) == CHECKPOINTS
    assert [(r.method, r.path.rsplit("/", 2)[-2:]) for r in workspace.requests[before:]] == [
        ("GET", ["jobs", NAME])]


def test_a_job_the_workspace_no_longer_has_has_no_checkpoint_uri(backend):
    with pytest.raises(ProviderError, match="where its checkpoints are cannot be found"):
        backend.checkpoint_uri(JobHandle("azureml", "tb-job-1-gone", extra={"azure_job_name": "tb-job-1-gone"}))


def test_a_resubmitted_attempt_mounts_and_resumes_from_the_lost_attempts_checkpoints(backend, workspace, azurite):
    first = backend.submit(spec())
    lost_checkpoints = backend.checkpoint_uri(first)
    upload(azurite, f"azureml/{NAME}/checkpoints/last.pt", b"epoch 1 checkpoint")

    second = backend.submit(spec(f"{NAME}-a2", checkpoint_uri=lost_checkpoints))

    [body] = workspace.puts[f"{NAME}-a2"]  # a new job, not the lost one adopted
    outputs = body["properties"]["outputs"]
    assert outputs["checkpoints"] == {"jobOutputType": "uri_folder", "uri": CHECKPOINTS, "mode": "ReadWriteMount"}
    assert outputs["model"] == {"jobOutputType": "uri_folder", "mode": "ReadWriteMount"}  # its own
    assert backend.checkpoint_uri(second) == lost_checkpoints == CHECKPOINTS
    # Its trainer keeps its checkpoints, and so resumes, in the mount of that output.
    mount = "/mnt/azureml/cr/j/0/cap/data-capability/wd/checkpoints"
    cfg = JobConfig.from_dict(CONFIG)
    resolved = read_azureml({"AZUREML_RUN_ID": f"{NAME}-a2", "AZURE_ML_OUTPUT_checkpoints": mount}, cfg).resolve(cfg)
    assert resolved.output.checkpoint_dir == mount
    # Its files list the lost attempt's checkpoint: a continue from the recovered job finds it.
    assert "checkpoints/last.pt" in {a.name for a in backend.artifacts(second)}


@pytest.mark.parametrize("uri", [
    "az://azureml-blobstore/azureml/tb-job-44/checkpoints/",
    "gs://stage/tb/output/tb-job-44/checkpoints/",
    "/runs/tb-job-44/output/checkpoints",
])
def test_a_checkpoint_place_that_is_not_a_datastore_path_is_refused_before_any_call(backend, workspace, uri):
    with pytest.raises(InvalidSpec, match="expected a datastore path"):
        backend.submit(spec(f"{NAME}-a2", checkpoint_uri=uri))
    assert workspace.puts == {}


def test_the_long_form_of_a_datastore_path_names_the_same_place(backend, workspace):
    workspace.add_job("tb-job-43-long")
    long_form = ("azureml://subscriptions/sub/resourcegroups/rg/workspaces/ws/datastores/workspaceblobstore/"
                 "paths/azureml/tb-job-43-long/checkpoints/")
    workspace.jobs["tb-job-43-long"]["properties"]["outputs"] = {
        "checkpoints": {"jobOutputType": "uri_folder", "uri": long_form, "mode": "ReadWriteMount"}}
    handle = JobHandle("azureml", "tb-job-43-long", extra={"azure_job_name": "tb-job-43-long"})
    assert backend.checkpoint_uri(handle) == (
        "azureml://datastores/workspaceblobstore/paths/azureml/tb-job-43-long/checkpoints/")


# -- continue and fine-tune from a job of the workspace --------------------------------------------

SOURCE_CHECKPOINT = f"azureml://datastores/workspaceblobstore/paths/azureml/{NAME}/checkpoints/last.pt"
COMMAND = "python -m trainer_pkg.launch --config trainboard_job.json"


def continued(init_from: str, mode: str = "continue") -> dict:
    return {**CONFIG, "train": {**CONFIG["train"], "epochs": 5, "init_from": init_from, "init_mode": mode}}


def test_a_continued_job_mounts_the_sources_checkpoint_and_hands_the_trainer_its_path(backend, workspace, azurite):
    source = backend.submit(spec())
    upload(azurite, f"azureml/{NAME}/checkpoints/last.pt", b"epoch 3 checkpoint")
    uri = backend.artifact_uri(source, "checkpoints/last.pt")  # what lineage.job_init sets
    assert uri == SOURCE_CHECKPOINT
    config = continued(uri)

    backend.submit(spec("tb-job-45-continued", config=config, tags={"trainboard-job-id": "45"}))

    [body] = workspace.puts["tb-job-45-continued"]
    props = body["properties"]
    assert props["inputs"] == {"init_from": {"jobInputType": "uri_file", "uri": SOURCE_CHECKPOINT,
                                             "mode": "ReadOnlyMount"}}
    assert props["command"] == COMMAND + " --init-from ${{inputs.init_from}}"
    assert config["train"]["init_from"] == SOURCE_CHECKPOINT  # the job's config is left as it was
    # Azure ML writes the input's mounted path into the command (clouds.md §3.1); the launcher's
    # --init-from then replaces the config's URI, which the trainer could not read, with it.
    mount = "/mnt/azureml/cr/j/0/cap/data-capability/wd/INPUT_init_from/last.pt"
    argv = shlex.split(props["command"].replace("${{inputs.init_from}}", mount))
    args = build_parser().parse_args(argv[3:])
    assert (args.config, args.init_from) == ("trainboard_job.json", mount)
    cfg = with_init_from(JobConfig.from_dict(config), args.init_from)
    assert (cfg.train.init_from, cfg.train.init_mode) == (mount, "continue")


def test_a_fine_tune_mounts_the_sources_model_beside_the_dataset(backend, workspace):
    weights = "azureml://datastores/workspaceblobstore/paths/azureml/tb-job-40/model/model.pt"
    data = "azureml://datastores/workspaceblobstore/paths/data/digits/"
    backend.submit(spec("tb-job-46-finetuned", config=continued(weights, "finetune"), dataset_uri=data))
    props = workspace.puts["tb-job-46-finetuned"][0]["properties"]
    assert props["inputs"] == {
        "data": {"jobInputType": "uri_folder", "uri": data, "mode": "ReadOnlyMount"},
        "init_from": {"jobInputType": "uri_file", "uri": weights, "mode": "ReadOnlyMount"}}
    assert props["command"] == COMMAND + " --init-from ${{inputs.init_from}}"


@pytest.mark.parametrize("uri", ["", "s3://bucket/runs/tb-job-40/checkpoints/last.pt"])
def test_a_job_from_scratch_or_from_a_uri_the_trainer_reads_mounts_nothing(backend, workspace, uri):
    config = continued(uri) if uri else CONFIG
    backend.submit(spec("tb-job-47-plain", config=config))
    props = workspace.puts["tb-job-47-plain"][0]["properties"]
    assert (props["inputs"], props["command"]) == ({}, COMMAND)


@pytest.mark.parametrize(("uri", "message"), [
    ("/runs/tb-job-40/output/checkpoints/last.pt", "an Azure ML job reads the file it starts from as an input"),
    ("azureml:tb-checkpoint:1", "an Azure ML job reads the file it starts from as an input"),
    ("azureml://subscriptions/00000000-0000-0000-0000-000000000000/resourcegroups/other-rg/workspaces/other-ws/"
     "datastores/workspaceblobstore/paths/azureml/tb-job-40/checkpoints/last.pt",
     "a datastore path of workspace other-ws"),
])
def test_a_file_to_start_from_that_the_job_cannot_mount_is_refused_before_any_call(backend, workspace, uri, message):
    with pytest.raises(InvalidSpec, match=message):
        backend.submit(spec("tb-job-48-refused", config=continued(uri)))
    assert workspace.puts == {}


def test_the_long_form_of_this_workspaces_datastore_path_is_mounted(backend, workspace):
    long_form = (f"azureml://subscriptions/{SETTINGS['subscription_id']}/resourceGroups/"
                 f"{SETTINGS['resource_group']}/workspaces/{SETTINGS['workspace']}/datastores/workspaceblobstore/"
                 f"paths/azureml/tb-job-40/checkpoints/last.pt")
    backend.submit(spec("tb-job-49-long", config=continued(long_form)))
    assert workspace.puts["tb-job-49-long"][0]["properties"]["inputs"]["init_from"]["uri"] == long_form
