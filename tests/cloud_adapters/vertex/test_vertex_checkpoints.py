"""Where a Vertex AI job's checkpoints are (``VertexBackend.checkpoint_uri``) and how a resubmitted
attempt of a lost run is pointed back at them (docs/recovery.md), against the stand-in and the GCS
emulator: the answer is the ``AIP_CHECKPOINT_DIR`` Vertex gives the job, ``<base_output_directory>/
checkpoints/`` (clouds.md §2.3), and an attempt given it gets the same base output directory, so
Vertex points the new attempt's ``AIP_CHECKPOINT_DIR``, and the trainer (trainer_pkg/platforms.py
``read_vertex``), at the lost attempt's checkpoints."""

from __future__ import annotations

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cloud_adapters.base import InvalidSpec, JobHandle, JobSpec, ProviderError
from cloud_adapters.vertex.backend import checkpoint_base
from trainer_pkg.config import JobConfig
from trainer_pkg.platforms import read_vertex

CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"},
          "train": {"epochs": 3, "batch_size": 32}, "parallel": {"strategy": "ddp"}}
NAME = "tb-job-7-65f0a1b2"
BASE = f"gs://stage/tb/output/{NAME}/"
CHECKPOINTS = f"gs://stage/tb/output/{NAME}/checkpoints/"


def spec(name: str = NAME, **kw) -> JobSpec:
    values = dict(job_name=name, config=CONFIG, nodes=1, procs_per_node=1, spot=True, max_runtime_s=3600,
                  tags={"trainboard-job-id": "7"})
    values.update(kw)
    return JobSpec(**values)


def test_checkpoint_uri_is_the_aip_checkpoint_dir_of_the_jobs_base_output_directory(backend, vertex):
    handle = backend.submit(spec())
    assert vertex.created[0]["jobSpec"]["baseOutputDirectory"] == {"outputUriPrefix": BASE}
    before = len(vertex.requests)
    assert backend.checkpoint_uri(handle) == CHECKPOINTS
    # One GetCustomJob: the base is the job's as Vertex holds it, not recomputed from the name.
    assert [(r.method, r.path) for r in vertex.requests[before:]] == [
        ("GET", f"/v1/{handle.provider_job_id}")]


def test_a_job_vertex_no_longer_has_has_no_checkpoint_uri(backend):
    gone = JobHandle("vertex", NAME, "projects/my-proj/locations/us-central1/customJobs/999")
    with pytest.raises(ProviderError, match="where its checkpoints are cannot be found"):
        backend.checkpoint_uri(gone)


def test_a_resubmitted_attempt_writes_to_and_resumes_from_the_lost_attempts_checkpoints(backend, vertex, gcs):
    first = backend.submit(spec())
    lost_checkpoints = backend.checkpoint_uri(first)
    bucket = storage.Client(project="my-proj", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": gcs}).bucket("stage")
    bucket.blob(f"tb/output/{NAME}/checkpoints/last.pt").upload_from_string(b"epoch 1 checkpoint")

    second = backend.submit(spec(f"{NAME}-a2", checkpoint_uri=lost_checkpoints))

    body = vertex.created[1]
    assert body["labels"]["trainboard-job-name"] == f"{NAME}-a2"  # a new job, not the lost one adopted
    assert body["jobSpec"]["baseOutputDirectory"] == {"outputUriPrefix": BASE}  # the lost attempt's
    args = body["jobSpec"]["workerPoolSpecs"][0]["pythonPackageSpec"]["args"]
    assert args[:2] == ["--config", f"/gcs/stage/tb/jobs/{NAME}-a2/trainboard_job.json"]
    assert backend.checkpoint_uri(second) == lost_checkpoints == CHECKPOINTS
    # The trainer of attempt 2, given the variables Vertex sets from that base (clouds.md §2.3),
    # keeps its checkpoints, and so resumes, in the lost attempt's directory through /gcs.
    env = {"AIP_MODEL_DIR": f"{BASE}model/", "AIP_CHECKPOINT_DIR": f"{BASE}checkpoints/"}
    cfg = JobConfig.from_dict(CONFIG)
    resolved = read_vertex(env, cfg, reason="test").resolve(cfg)
    assert resolved.output.checkpoint_dir == f"/gcs/stage/tb/output/{NAME}/checkpoints"
    # Its files are the lost attempt's: a continue from the recovered job finds the checkpoint.
    assert "checkpoints/last.pt" in {a.name for a in backend.artifacts(second)}


@pytest.mark.parametrize("uri, words", [
    ("gs://stage/tb/output/x/ckpt/", "expected 'gs://bucket/<prefix>/checkpoints/'"),
    ("s3://stage/tb/output/x/checkpoints/", "expected a Cloud Storage URI"),
    ("/runs/tb-job-7/output/checkpoints", "expected a Cloud Storage URI"),
])
def test_a_checkpoint_directory_vertex_cannot_give_the_trainer_is_refused_before_any_call(backend, vertex,
                                                                                          uri, words):
    with pytest.raises(InvalidSpec, match=words):
        backend.submit(spec(f"{NAME}-a2", checkpoint_uri=uri))
    assert vertex.created == []


def test_an_output_directory_other_than_the_checkpoints_base_is_refused(backend, vertex):
    with pytest.raises(InvalidSpec, match="Vertex AI puts checkpoints in <output>/checkpoints/"):
        backend.validate(spec(checkpoint_uri=CHECKPOINTS, output_uri="gs://stage/elsewhere/"))
    backend.validate(spec(checkpoint_uri=CHECKPOINTS, output_uri=BASE.rstrip("/")))


def test_checkpoint_base():
    assert checkpoint_base(CHECKPOINTS) == BASE
    assert checkpoint_base(CHECKPOINTS.rstrip("/")) == BASE
    assert checkpoint_base("gs://stage/checkpoints") == "gs://stage/"
