"""Submitting to Azure ML: the real ``MLClient`` over the stand-in transport (clouds.md §3.5) sends a
job PUT whose body is asserted field by field (from the JSON the transport received), the code
snapshot goes through azure-ai-ml's upload to a real Blob service (Azurite, npm ``azurite``, on
127.0.0.1), a retried submit adopts the job instead of creating another, and provider errors become
Trainboard errors (429 retried).
"""

from __future__ import annotations

import json

import pytest
from azureml_standin import (
    COMPUTE,
    RESOURCE_GROUP,
    SUBSCRIPTION,
    WORKSPACE,
    AzureMLStandin,
    FakeCredential,
    StandinTransport,
    make_backend,
    two_gpu_catalog,
)

from cloud_adapters.azureml import AzureMLBackend
from cloud_adapters.azureml.backend import DEFAULT_ENVIRONMENT, azure_job_name
from cloud_adapters.base import CredentialsError, InvalidSpec, JobSpec, QuotaExceeded, Throttled
from cloud_adapters.registry import EXTRAS, backend_class, create_backend

SCOPE = (f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}/providers/"
         f"Microsoft.MachineLearningServices/workspaces/{WORKSPACE}")
CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"},
          "train": {"epochs": 1, "batch_size": 8}, "parallel": {"strategy": "ddp"}}
DATA = "azureml://datastores/workspaceblobstore/paths/datasets/digits/"


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")  # azure-ai-ml's marshmallow schemas


def spec(**kw) -> JobSpec:
    values = dict(job_name="tb-job-42-65f1a2b3", config=CONFIG, nodes=2, procs_per_node=2,
                  instance_type="Standard_NC12s_v3", max_runtime_s=7200, dataset_uri=DATA,
                  tags={"trainboard-job-id": "42", "trainboard-owner-id": "7"})
    values.update(kw)
    return JobSpec(**values)


def job_puts(st: AzureMLStandin):
    return st.calls("PUT", r"/jobs/[^/]+$")


def test_an_mpi_script_asks_for_the_mpi_distribution(workspace):
    """``code.framework`` mpi: ``MpiDistribution`` with the job's processes per node, so Azure ML's
    mpirun starts the ranks (trainer_pkg/frameworks/mpi.py runs the script as each one); the command
    is the same."""
    backend = make_backend(workspace, prices=two_gpu_catalog())
    backend.submit(spec(config={**CONFIG, "code": {"script": "train.py", "framework": "mpi"}}))
    (put,) = job_puts(workspace)
    body = put.body["properties"]
    assert body["distribution"] == {"distributionType": "Mpi", "processCountPerInstance": 2}
    assert body["command"] == "python -m trainer_pkg.launch --config trainboard_job.json"


def test_job_put_body_field_by_field(workspace):
    backend = make_backend(workspace, prices=two_gpu_catalog())
    handle = backend.submit(spec())

    assert handle.provider == "azureml" and handle.job_name == "tb-job-42-65f1a2b3"
    assert handle.provider_job_id == f"{SCOPE}/jobs/tb-job-42-65f1a2b3"
    assert handle.extra == {"azure_job_name": "tb-job-42-65f1a2b3", "instance_count": 2}
    (put,) = job_puts(workspace)
    assert put.path == f"{SCOPE}/jobs/tb-job-42-65f1a2b3"
    assert put.query["api-version"] == "2025-01-01-preview"  # clouds.md §3.5
    body = put.body["properties"]
    assert body["jobType"] == "Command"
    assert body["command"] == "python -m trainer_pkg.launch --config trainboard_job.json"
    assert body["distribution"] == {"distributionType": "PyTorch", "processCountPerInstance": 2}
    assert body["resources"]["instanceCount"] == 2
    assert body["computeId"] == f"{SCOPE}/computes/{COMPUTE}"
    assert body["environmentId"] == DEFAULT_ENVIRONMENT
    assert body["inputs"] == {"data": {"jobInputType": "uri_folder", "uri": DATA, "mode": "ReadOnlyMount"}}
    assert body["outputs"] == {"model": {"jobOutputType": "uri_folder", "mode": "ReadWriteMount"},
                               "checkpoints": {"jobOutputType": "uri_folder", "mode": "ReadWriteMount"}}
    assert body["limits"] == {"jobLimitsType": "Command", "timeout": "PT2H"}
    assert body["tags"] == {"trainboard-job-name": "tb-job-42-65f1a2b3", "trainboard-job-id": "42",
                            "trainboard-owner-id": "7"}
    assert body["environmentVariables"] == {"PYTHONUNBUFFERED": "1", "TRAINBOARD_JOB_NAME": "tb-job-42-65f1a2b3"}
    assert body["experimentName"] == "trainboard" and body["displayName"] == "tb-job-42-65f1a2b3"
    assert "queueSettings" not in body or body["queueSettings"] is None  # dedicated
    # the code id is the version azure-ai-ml registered after its upload
    (code_put,) = workspace.calls("PUT", r"/codes/[^/]+/versions/[^/]+$")
    assert body["codeId"] == code_put.path
    # the credential was asked for an ARM token
    assert ("https://management.azure.com/.default",) in backend.credential().scopes


def test_code_snapshot_is_uploaded_to_blob_storage_with_the_job_config(workspace, azurite):
    backend = make_backend(workspace, prices=two_gpu_catalog())
    backend.submit(spec())

    ops = [(s.method, s.path.rsplit("/", 2)[-2:] if "/codes/" in s.path else s.path.rsplit("/", 1)[-1])
           for s in workspace.requests]
    # get (404), code hash lookup, pending upload (SAS), code version, job PUT (clouds.md §3.5)
    assert [m for m, _ in ops] == ["GET", "GET", "POST", "PUT", "PUT"]
    lookup = workspace.calls("GET", r"/codes/[^/]+/versions$")[0]
    assert lookup.query["hashVersion"] == "202208" and len(lookup.query["hash"]) == 64
    (code_put,) = workspace.calls("PUT", r"/codes/")
    code_uri = code_put.body["properties"]["codeUri"]
    assert code_uri.startswith(azurite.url + "/") and code_uri.endswith("/tb-job-42-65f1a2b3")
    assert code_put.body["properties"]["isAnonymous"] is True
    assert code_put.body["properties"]["properties"]["hash_sha256"] == lookup.query["hash"]

    container, prefix = code_uri[len(azurite.url) + 1:].split("/", 1)
    blobs = azurite.service().get_container_client(container)
    names = sorted(b.name for b in blobs.list_blobs(name_starts_with=prefix + "/"))
    assert f"{prefix}/trainer_pkg/launch.py" in names and f"{prefix}/trainer_pkg/platforms.py" in names
    assert f"{prefix}/trainboard_job.json" in names
    job_json = json.loads(blobs.download_blob(f"{prefix}/trainboard_job.json").readall())
    assert job_json["parallel"] == {"strategy": "ddp", "nodes": 2, "procs_per_node": 2}
    assert job_json["train"] == {"epochs": 1, "batch_size": 8} and job_json["model"] == {"arch": "mlp"}
    with open("trainer_pkg/launch.py", "rb") as f:
        assert blobs.download_blob(f"{prefix}/trainer_pkg/launch.py").readall() == f.read()


def test_retried_submit_adopts_the_job_and_puts_once(workspace):
    backend = make_backend(workspace, prices=two_gpu_catalog())
    first = backend.submit(spec())
    again = make_backend(workspace, prices=two_gpu_catalog()).submit(spec())  # a redelivered task
    assert again == first
    assert len(job_puts(workspace)) == 1
    assert len(workspace.calls("POST", r"startPendingUpload")) == 1
    assert list(workspace.jobs) == ["tb-job-42-65f1a2b3"]


def test_a_put_that_landed_before_its_answer_was_lost_is_adopted(workspace, clock):
    """The PUT creates the job but its answer is a 503; the retry's PUT gets 409; the job is adopted."""
    backend = make_backend(workspace, clock=clock, prices=two_gpu_catalog())
    real = workspace._route

    def lose_first_answer(request, parts, path, query, body, state={"lost": False}):
        answer = real(request, parts, path, query, body)
        if request.method == "PUT" and "/jobs/" in path and not state["lost"]:
            state["lost"] = True
            return workspace.response_for(request, 503)
        return answer

    workspace._route = lose_first_answer
    handle = backend.submit(spec())
    assert handle.extra["azure_job_name"] == "tb-job-42-65f1a2b3"
    assert [s.status for s in job_puts(workspace)] == [503, 409]
    assert list(workspace.jobs) == ["tb-job-42-65f1a2b3"]


def test_low_priority_asks_for_the_spot_tier(workspace):
    backend = make_backend(workspace, prices=two_gpu_catalog())
    backend.submit(spec(spot=True, dataset_uri=""))
    body = job_puts(workspace)[0].body["properties"]
    assert body["queueSettings"] == {"jobTier": "Spot"}
    assert body["inputs"] == {}  # built-in data: nothing mounted
    assert backend.price("Standard_NC12s_v3", spot=True) == 1.22


def test_tier_low_priority_backend_prices_every_job_low_priority(workspace):
    backend = make_backend(workspace, prices=two_gpu_catalog(), tier="low_priority", vm_size="Standard_NC12s_v3")
    assert backend.price() == 1.22
    # What a low-priority job is compared with is the dedicated price, whatever the tier (it was 1.22).
    assert backend.on_demand_price() == 6.12 and backend.on_demand_price("Standard_NC6s_v3") == 3.06
    assert [(o.instance_type, o.usd_per_hour) for o in backend.instance_offers()] == [("Standard_NC12s_v3", 1.22)]
    backend.submit(spec(instance_type=""))
    assert job_puts(workspace)[0].body["properties"]["queueSettings"] == {"jobTier": "Spot"}


def test_a_name_azure_refuses_is_mapped_deterministically(workspace):
    backend = make_backend(workspace, prices=two_gpu_catalog())
    handle = backend.submit(spec(job_name="tb job/42"))
    name = azure_job_name("tb job/42")
    assert name == azure_job_name("tb job/42") and name.startswith("tb-job-42-") and len(name) == len("tb-job-42-") + 8
    assert handle.extra["azure_job_name"] == name and name in workspace.jobs
    assert azure_job_name("tb-job-1-abc") == "tb-job-1-abc"
    assert azure_job_name("_x") != azure_job_name("-x")


@pytest.mark.parametrize("status,code,error,words", [
    (400, "UserError", InvalidSpec, "HTTP 400 UserError"),
    (403, "AuthorizationFailed", CredentialsError, "AzureML Data Scientist"),
    (401, "InvalidAuthenticationToken", CredentialsError, "rejected the credential"),
    (400, "QuotaExceeded", QuotaExceeded, "higher quota"),
])
def test_put_errors_become_backend_errors(workspace, status, code, error, words):
    workspace.fail("PUT", r"/jobs/[^/]+$", status, times=1, code=code)
    backend = make_backend(workspace, prices=two_gpu_catalog())
    with pytest.raises(error, match=words):
        backend.submit(spec())
    assert len(job_puts(workspace)) == 1  # not retried
    assert not workspace.jobs


def test_throttled_put_is_retried_then_created(workspace, clock):
    workspace.fail("PUT", r"/jobs/[^/]+$", 429, times=2)
    backend = make_backend(workspace, clock=clock, prices=two_gpu_catalog())
    backend.submit(spec())
    assert [s.status for s in job_puts(workspace)] == [429, 429, 201]
    assert len(clock.sleeps) == 2 and clock.sleeps[0] <= 0.5 and clock.sleeps[1] <= 1.0
    assert list(workspace.jobs) == ["tb-job-42-65f1a2b3"]


def test_throttling_that_outlasts_the_retries_raises_throttled(workspace, clock):
    workspace.fail("GET", r"/jobs/[^/]+$", 429, times=10)
    backend = make_backend(workspace, clock=clock, prices=two_gpu_catalog())
    with pytest.raises(Throttled, match="rate-limited by Azure"):
        backend.submit(spec())
    assert len(workspace.calls("GET", r"/jobs/[^/]+$")) == 5 and not job_puts(workspace)


def test_credential_failure_is_a_credentials_error(workspace):
    from azure.core.exceptions import ClientAuthenticationError

    class NoCredential(FakeCredential):
        def get_token(self, *scopes, **kw):
            raise ClientAuthenticationError("DefaultAzureCredential failed to retrieve a token")

        get_token_info = get_token

    backend = make_backend(workspace, credential=NoCredential(), prices=two_gpu_catalog())
    with pytest.raises(CredentialsError, match="no usable Azure credential.*az login"):
        backend.submit(spec())
    assert not workspace.requests


@pytest.mark.parametrize("change,words", [
    (dict(procs_per_node=2, instance_type="Standard_NC6s_v3"),
     r"2 × Standard_NC6s_v3 with 2 processes per node: Standard_NC6s_v3 has 1 GPU .* \(world size 2 × 1 = 2\)"),
    (dict(instance_type="Standard_X9"), "has no price in the catalog for eastus"),
    (dict(instance_type="ml.g5.xlarge"), "Azure VM sizes look like"),
    (dict(dataset_uri="s3://bucket/digits"), "azureml://datastores"),
    (dict(nodes=17), "at most 16 node"),
    (dict(max_runtime_s=31 * 24 * 3600), "30 days"),
    (dict(spot=True, instance_type="Standard_NC6s_v3", procs_per_node=1),
     "no low-priority price .* 'Standard_NC6s_v3:low_priority'"),
])
def test_validate_refuses_before_any_call(workspace, change, words):
    backend = make_backend(workspace, prices=two_gpu_catalog())
    with pytest.raises(InvalidSpec, match=words):
        backend.submit(spec(**change))
    assert not workspace.requests


@pytest.mark.parametrize("change,field", [
    ({"subscription_id": "not-a-guid"}, "subscription_id"),
    ({"subscription_id": None}, "subscription_id"),
    ({"resource_group": "bad/group"}, "resource_group"),
    ({"workspace": "w"}, "workspace"),
    ({"compute": "1cluster"}, "compute"),
    ({"environment": "pytorch:latest"}, "environment"),
    ({"vm_size": "n1-standard-8"}, "vm_size"),
    ({"vm_size": "Standard_D2s_v3"}, "vm_size"),  # no catalog price
    ({"tier": "spot"}, "tier"),
    ({"region": "East US"}, "region"),
    ({"max_nodes": 0}, "max_nodes"),
    ({"max_nodes": True}, "max_nodes"),
    ({"base_url": "ftp://x"}, "base_url"),
    ({"role_arn": "x"}, "role_arn"),
])
def test_bad_settings_name_the_field(change, field):
    settings = {"subscription_id": SUBSCRIPTION, "resource_group": RESOURCE_GROUP, "workspace": WORKSPACE,
                "compute": COMPUTE, **change}
    with pytest.raises(InvalidSpec) as err:
        AzureMLBackend(settings, credential=FakeCredential(), transport=StandinTransport(AzureMLStandin()))
    assert list(err.value.errors) == [field]
    label = AzureMLBackend.settings.labels.get(field, field)
    assert err.value.errors[field][0].startswith(label + (" is required for an Azure ML backend." if change[field] is None
                                                          else ": "))


def test_every_bad_setting_is_reported_at_once_in_the_forms_words():
    with pytest.raises(InvalidSpec) as err:
        AzureMLBackend({"subscription_id": "", "resource_group": "", "workspace": "w", "compute": "",
                        "tier": "spot"}, credential=FakeCredential())
    assert err.value.errors == {
        "subscription_id": ["Subscription ID is required for an Azure ML backend."],
        "resource_group": ["Resource group is required for an Azure ML backend."],
        "compute": ["Compute cluster is required for an Azure ML backend."],
        "workspace": ["Workspace: expected an Azure ML workspace name (3–33 letters, digits, '_' or '-'), got 'w'."],
        "tier": ["Tier: expected 'dedicated' or 'low_priority', got 'spot'."],
    }


def test_settings_defaults_and_registry():
    backend = create_backend("azureml", {"subscription_id": SUBSCRIPTION.upper(), "resource_group": RESOURCE_GROUP,
                                         "workspace": WORKSPACE, "compute": COMPUTE})
    assert backend.config == {
        "subscription_id": SUBSCRIPTION, "resource_group": RESOURCE_GROUP, "workspace": WORKSPACE,
        "compute": COMPUTE, "environment": DEFAULT_ENVIRONMENT, "vm_size": "Standard_NC6s_v3",
        "tier": "dedicated", "region": "eastus", "max_nodes": 16, "base_url": ""}
    assert backend_class("azureml") is AzureMLBackend and EXTRAS["azureml"] == "azure"
    caps = backend.capabilities
    assert caps.max_nodes == 16 and caps.spot  # low-priority rows shipped (upper bounds)


def test_base_url_sends_arm_calls_to_that_endpoint():
    st = AzureMLStandin(arm="http://127.0.0.1:9")  # answered by the transport, never connected to
    backend = make_backend(st, base_url="http://127.0.0.1:9/")
    st.add_job("tb-job-9-a", "Queued")
    from cloud_adapters.base import JobHandle

    assert backend.describe(JobHandle("azureml", "tb-job-9-a")).raw_state == "Queued"
    assert st.requests[0].url.startswith("http://127.0.0.1:9/subscriptions/")
    import os

    assert "AZUREML_CURRENT_CLOUD" not in os.environ  # MLClient's process-wide cloud setting is undone
