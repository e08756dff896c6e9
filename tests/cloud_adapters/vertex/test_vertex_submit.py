"""Submitting a Vertex AI custom job: the real ``aiplatform_v1.JobServiceClient`` (REST transport)
against the local stand-in, the trainer archive and config in gcp-storage-emulator.

The CreateCustomJob body is asserted field by field as it went over the wire (proto3 JSON: enums as
numbers, int64 as strings, Durations as "<n>s", false fields omitted — clouds.md §2.4).
"""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from google.cloud import storage
from google.auth.credentials import AnonymousCredentials

from cloud_adapters import registry
from cloud_adapters.base import CredentialsError, InvalidSpec, JobSpec, ProviderError, QuotaExceeded
from cloud_adapters.vertex import VertexBackend, package
from cloud_adapters.vertex.backend import job_label, label_value

IMAGE = "us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-4.py310:latest"
CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"},
          "train": {"epochs": 1, "batch_size": 32}, "parallel": {"strategy": "ddp"}}
CREATE = r"/customJobs$"


def spec(name="tb-job-7-65f0a1b2", **kw) -> JobSpec:
    base = dict(job_name=name, config=CONFIG, nodes=3, procs_per_node=1, spot=True, max_runtime_s=7200,
                tags={"trainboard-job-id": "7", "trainboard-owner-id": "3"}, env={"FOO": "bar"})
    base.update(kw)
    return JobSpec(**base)


def blobs(gcs_url: str) -> dict[str, bytes]:
    client = storage.Client(project="my-proj", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": gcs_url})
    return {b.name: b.download_as_bytes() for b in client.list_blobs("stage")}


def test_custom_job_json_field_by_field(backend, vertex, gcs):
    handle = backend.submit(spec())

    archive = package.build_sdist()
    package_uri = f"gs://stage/tb/code/{archive.name}"
    assert len(vertex.created) == 1
    (create,) = vertex.calls("POST", CREATE)
    assert create.path == "/v1/projects/my-proj/locations/us-central1/customJobs"
    assert create.query["$alt"] == "json;enum-encoding=int"
    python = {
        "executorImageUri": IMAGE,
        "packageUris": [package_uri],
        "pythonModule": "trainer_pkg.launch",
        "args": ["--config", "/gcs/stage/tb/jobs/tb-job-7-65f0a1b2/trainboard_job.json",
                 "--platform", "vertex", "--nproc-per-node", "1"],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"},
                {"name": "TRAINBOARD_JOB_NAME", "value": "tb-job-7-65f0a1b2"},
                {"name": "FOO", "value": "bar"}],
    }
    machine = {"machineType": "n1-standard-8", "acceleratorType": 5, "acceleratorCount": 1}  # 5 = NVIDIA_TESLA_T4
    body = vertex.created[0]
    assert body["displayName"] == "tb-job-7-65f0a1b2"
    assert body["labels"] == {"trainboard-job-name": "tb-job-7-65f0a1b2", "trainboard-job-id": "7",
                              "trainboard-owner-id": "3"}
    pools = body["jobSpec"]["workerPoolSpecs"]
    assert len(pools) == 2
    assert pools[0] == {"machineSpec": machine, "replicaCount": "1", "pythonPackageSpec": python}  # the chief
    assert pools[1] == {"machineSpec": machine, "replicaCount": "2", "pythonPackageSpec": python}  # nodes − 1
    assert body["jobSpec"]["scheduling"] == {"timeout": "7200s", "restartJobOnWorkerRestart": True,
                                             "strategy": 4}  # 4 = SPOT
    assert body["jobSpec"]["serviceAccount"] == "trainer@my-proj.iam.gserviceaccount.com"
    assert body["jobSpec"]["baseOutputDirectory"] == {"outputUriPrefix": "gs://stage/tb/output/tb-job-7-65f0a1b2/"}
    assert set(body) == {"displayName", "labels", "jobSpec"}
    assert set(body["jobSpec"]) == {"workerPoolSpecs", "scheduling", "serviceAccount", "baseOutputDirectory"}

    # The handle finds the job again; the archive and the config the replicas read are in the bucket.
    assert handle.provider == "vertex" and handle.job_name == "tb-job-7-65f0a1b2"
    assert handle.provider_job_id == "projects/my-proj/locations/us-central1/customJobs/1000000001"
    assert handle.extra == {"label": "tb-job-7-65f0a1b2", "region": "us-central1", "instance_count": 3,
                            "create_time": "2026-01-01T00:00:00+00:00"}
    stored = blobs(gcs)
    assert set(stored) == {f"tb/code/{archive.name}", "tb/jobs/tb-job-7-65f0a1b2/trainboard_job.json"}
    assert stored[f"tb/code/{archive.name}"] == archive.data
    assert json.loads(stored["tb/jobs/tb-job-7-65f0a1b2/trainboard_job.json"]) == CONFIG


def test_one_node_on_demand_has_one_pool_and_no_restart_or_spot(make_backend, vertex):
    backend = make_backend(accelerator_type="", accelerator_count=0, service_account="", machine_type="n1-standard-4")
    backend.submit(spec(nodes=1, procs_per_node=2, spot=False, max_runtime_s=600, env={}, tags={}))
    body = vertex.created[0]
    (pool,) = body["jobSpec"]["workerPoolSpecs"]
    assert pool["machineSpec"] == {"machineType": "n1-standard-4"}
    assert pool["replicaCount"] == "1"
    assert pool["pythonPackageSpec"]["args"][-2:] == ["--nproc-per-node", "2"]
    assert body["jobSpec"]["scheduling"] == {"timeout": "600s"}
    assert "serviceAccount" not in body["jobSpec"]
    assert body["labels"] == {"trainboard-job-name": "tb-job-7-65f0a1b2"}


def test_archive_is_pip_installable_sdist_of_trainer_pkg():
    archive = package.build_sdist()
    assert archive.data == package.build_sdist().data  # content-addressed: same trainer, same bytes
    with tarfile.open(fileobj=io.BytesIO(archive.data), mode="r:gz") as tar:
        names = tar.getnames()
    root = names[0].split("/")[0]
    assert all(n.startswith(root + "/") for n in names)  # one top-level directory, as pip expects
    assert f"{root}/pyproject.toml" in names and f"{root}/launch.py" in names and f"{root}/platforms.py" in names
    assert archive.name == f"trainboard-trainer-{archive.sha256[:16]}.tar.gz"


def test_retried_submit_creates_nothing_new(backend, vertex):
    first = backend.submit(spec())
    second = backend.submit(spec())
    assert second == first
    assert len(vertex.jobs) == 1 and len(vertex.created) == 1
    # The retry found the job by its label, with one list call and nothing else.
    lists = vertex.calls("GET", CREATE)
    assert [r.query["filter"] for r in lists] == ['labels.trainboard-job-name="tb-job-7-65f0a1b2"'] * 3
    assert len(vertex.requests) == 4  # list, create, list (duplicate check); retry: list


def test_create_that_failed_after_creating_is_adopted_not_repeated(backend, vertex, clock):
    # The service created the job but the answer was lost (503): the retry must not create a second.
    vertex.fail(503, method="POST", path_re=CREATE, after=True, message="The service is currently unavailable.")
    handle = backend.submit(spec())
    assert len(vertex.jobs) == 1 and len(vertex.created) == 1
    assert handle.provider_job_id == next(iter(vertex.jobs))
    assert len(clock.sleeps) == 1  # one backoff before looking for the job


def test_create_that_failed_before_creating_is_tried_again(backend, vertex):
    vertex.fail(503, method="POST", path_re=CREATE, message="The service is currently unavailable.")
    handle = backend.submit(spec())
    assert len(vertex.calls("POST", CREATE)) == 2
    assert len(vertex.jobs) == 1 and handle.provider_job_id in vertex.jobs


def test_throttled_calls_are_retried_and_converge(backend, vertex, clock):
    rate = ("Quota exceeded for quota metric 'Resource management (CRUD) requests' and limit "
            "'Resource management (CRUD) requests per minute per region' of service 'aiplatform.googleapis.com'.")
    vertex.fail(429, method="GET", path_re=CREATE, times=2, message=rate)
    vertex.fail(429, method="POST", path_re=CREATE, times=1, message=rate)
    handle = backend.submit(spec())
    assert len(vertex.jobs) == 1 and len(vertex.created) == 1
    assert len(vertex.calls("POST", CREATE)) == 2  # a throttled create is refused: sent again at once
    assert len(clock.sleeps) == 3 and all(0 <= s <= 1.0 for s in clock.sleeps)
    vertex.fail(429, method="GET", path_re=r"/customJobs/\d+$", times=2, message=rate)
    assert backend.describe(handle).raw_state == "JOB_STATE_QUEUED"
    assert len(clock.sleeps) == 5


def test_gpu_quota_is_not_retried(backend, vertex):
    vertex.fail(429, method="POST", path_re=CREATE, times=5,
                message="The following quota metrics exceed quota limits: "
                        "aiplatform.googleapis.com/custom_model_training_nvidia_t4_gpus")
    with pytest.raises(QuotaExceeded, match="custom_model_training_nvidia_t4_gpus.*higher quota"):
        backend.submit(spec())
    assert len(vertex.calls("POST", CREATE)) == 1 and not vertex.jobs


@pytest.mark.parametrize("status, error, words", [
    (403, CredentialsError, "Permission 'aiplatform.customJobs.create' denied.*Vertex AI User"),
    (401, CredentialsError, "credentials"),  # google-auth tries a refresh first; anonymous ones cannot
    (400, InvalidSpec, "machine type n1-nope is not supported"),
    (404, ProviderError, "Location us-central1 is not found"),
])
def test_api_errors_become_backend_errors(backend, vertex, status, error, words):
    messages = {403: "Permission 'aiplatform.customJobs.create' denied on resource.",
                401: "Request had invalid authentication credentials.",
                400: "machine type n1-nope is not supported", 404: "Location us-central1 is not found"}
    vertex.fail(status, method="POST", path_re=CREATE, message=messages[status])
    with pytest.raises(error, match=words) as info:
        backend.submit(spec())
    assert not getattr(info.value, "transient", False)
    assert len(vertex.calls("POST", CREATE)) == 1 and not vertex.jobs


def test_concurrent_duplicate_is_cancelled_and_the_older_adopted(backend, vertex):
    # Another worker's submit created the job between our label lookup and our create.
    def other_worker(body):
        vertex.on_create = None
        vertex.insert("projects/my-proj/locations/us-central1", body, create_time="2025-12-31T23:59:59Z")

    vertex.on_create = other_worker
    handle = backend.submit(spec())
    older, ours = sorted(vertex.jobs)
    assert handle.provider_job_id == older
    assert vertex.jobs[ours]["state"] == "JOB_STATE_CANCELLING"
    assert vertex.jobs[older]["state"] == "JOB_STATE_QUEUED"


def test_archive_uploaded_once_for_two_jobs(backend, vertex, gcs, monkeypatch):
    uploads: list[str] = []
    real = storage.Blob.upload_from_string

    def spy(self, *args, **kwargs):
        uploads.append(self.name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(storage.Blob, "upload_from_string", spy)
    backend.submit(spec("tb-job-1-aaaa"))
    backend.submit(spec("tb-job-2-bbbb"))
    archive = package.build_sdist()
    assert uploads == [f"tb/code/{archive.name}", "tb/jobs/tb-job-1-aaaa/trainboard_job.json",
                       "tb/jobs/tb-job-2-bbbb/trainboard_job.json"]
    uris = {tuple(p["pythonPackageSpec"]["packageUris"]) for b in vertex.created for p in b["jobSpec"]["workerPoolSpecs"]}
    assert uris == {(f"gs://stage/tb/code/{archive.name}",)}
    assert sorted(blobs(gcs)) == [f"tb/code/{archive.name}", "tb/jobs/tb-job-1-aaaa/trainboard_job.json",
                                  "tb/jobs/tb-job-2-bbbb/trainboard_job.json"]


def test_labels_follow_gcp_rules():
    assert label_value("tb-job-7-65f0a1b2") == "tb-job-7-65f0a1b2"
    odd = label_value("TB Job/7:" + "x" * 80)
    assert len(odd) <= 63 and odd.startswith("tb-job-7-xxx") and odd == label_value("TB Job/7:" + "x" * 80)
    assert label_value("Tb-Job-7") != label_value("tb-job-7") and label_value("Tb-Job-7").startswith("tb-job-7-")
    with pytest.raises(InvalidSpec, match="job name: empty"):
        job_label("")


def test_validate_refuses_what_vertex_cannot_run(backend, vertex):
    with pytest.raises(InvalidSpec, match=r"each rank needs its own accelerator; ask for at most 1 .*3 × 1 = 3"):
        backend.validate(spec(procs_per_node=2))
    with pytest.raises(InvalidSpec, match="machine type 'a2-highgpu-1g' has no price in the catalog for us-central1"):
        backend.validate(spec(instance_type="a2-highgpu-1g"))
    with pytest.raises(InvalidSpec, match="dataset: expected a Cloud Storage URI"):
        backend.validate(spec(dataset_uri="s3://bucket/data"))
    with pytest.raises(InvalidSpec, match="at most 16 node"):
        backend.validate(spec(nodes=17))
    assert not vertex.requests  # validation makes no call


def test_clean_config_defaults_and_errors():
    cfg = VertexBackend.clean_config({"project": "my-proj", "staging_bucket": "gs://stage/tb/", "region": "",
                                      "max_nodes": None})
    assert cfg == {"project": "my-proj", "region": "us-central1", "staging_bucket": "gs://stage/tb",
                   "image_uri": IMAGE, "service_account": "", "machine_type": "n1-standard-8",
                   "accelerator_type": "", "accelerator_count": 0, "spot_allowed": False, "max_nodes": 16,
                   "api_endpoint": "", "storage_endpoint": ""}
    assert VertexBackend.clean_config({"project": "my-proj", "staging_bucket": "gs://s3b",
                                       "region": "europe-west4"})["image_uri"] == \
        "europe-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-4.py310:latest"
    base = {"project": "my-proj", "staging_bucket": "gs://stage"}
    bad = [({"staging_bucket": "gs://bkt"}, "project", "Google Cloud project ID is required for a Google Vertex AI"),
           ({"project": "my-proj"}, "staging_bucket", "Staging bucket is required for a Google Vertex AI backend."),
           (dict(base, staging_bucket="s3://b"), "staging_bucket", "Staging bucket: expected a Cloud Storage URI"),
           (dict(base, project="My Project"), "project", "Google Cloud project ID: expected a Google Cloud project id"),
           (dict(base, region="US Central"), "region", "Region:"),
           (dict(base, accelerator_type="NVIDIA_GTX"), "accelerator_type", "Accelerator:"),
           (dict(base, accelerator_type="NVIDIA_TESLA_T4"), "accelerator_count",
            "Accelerators per machine: NVIDIA_TESLA_T4 is set"),
           (dict(base, accelerator_count=2), "accelerator_count",
            "Accelerators per machine: 2 given without an accelerator; set Accelerator"),
           (dict(base, spot_allowed="False"), "spot_allowed", "Spot allowed:"),
           (dict(base, max_nodes=0), "max_nodes", "Max machines per job:"),
           (dict(base, machine_type="n1 standard"), "machine_type", "Default machine type:"),
           (dict(base, service_account="me"), "service_account", "Service account:"),
           (dict(base, api_endpoint="http://x y"), "api_endpoint", "Vertex AI API endpoint:"),
           (dict(base, secret_key="x"), "secret_key", "secret_key: unknown")]
    for config, key, message in bad:
        with pytest.raises(InvalidSpec) as err:
            VertexBackend.clean_config(config)
        assert list(err.value.errors) == [key], config
        assert err.value.errors[key][0].startswith(message), err.value.errors
    # Everything wrong at once is reported at once, so a user fixes it in one round.
    with pytest.raises(InvalidSpec) as err:
        VertexBackend.clean_config({"project": "", "staging_bucket": "", "region": "US Central", "max_nodes": 0})
    assert list(err.value.errors) == ["project", "staging_bucket", "region", "max_nodes"]


def test_registered_kind():
    assert registry.backend_class("vertex") is VertexBackend
    assert dict(registry.kind_choices())["vertex"] == "Google Vertex AI"
    assert registry.EXTRAS["vertex"] == "gcp"
