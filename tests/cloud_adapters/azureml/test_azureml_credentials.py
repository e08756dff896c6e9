"""An Azure ML backend's stored service principal is what its requests carry.

The secrets go in through the dashboard's service (encrypted in the database) and come back out of
the row; the adapter builds azure-identity's ``ClientSecretCredential`` from them. With
:meth:`AzureMLStandin.register_app` the stand-in is also Microsoft Entra ID: MSAL fetches the
tenant's OpenID configuration and posts the client-credentials grant (client id and secret in the
form) to the tenant's token endpoint; ARM and run history then want ``Bearer`` + the token it issued,
else 401. So these tests see the stored secret on the wire, not how a client was built.
"""

from __future__ import annotations

import random
import uuid

import pytest
from azureml_standin import LOGIN, SETTINGS, FakeClock, StandinTransport

from cloud_adapters import retry
from cloud_adapters.azureml import AzureMLBackend
from cloud_adapters.base import CredentialsError, JobSpec
from jobs import services
from jobs.models import ComputeBackend

pytestmark = [pytest.mark.django_db,
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::UserWarning")]  # azure-ai-ml's marshmallow schemas

ARM_SCOPE = "https://management.azure.com/.default"
CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"},
          "train": {"epochs": 1, "batch_size": 8}, "parallel": {"strategy": "ddp"}}


def _adapter(user, workspace, secrets: dict, name: str = "az") -> AzureMLBackend:
    """The adapter of a backend row holding ``secrets``, as ``jobs.adapters.backend_adapter`` builds it
    (decrypted ``secrets`` passed to the constructor), with the stand-in as its transport."""
    row = services.backend_create(owner=user, name=name, kind="azureml", config=dict(SETTINGS), secrets=secrets)
    stored = ComputeBackend.objects.get(pk=row.pk)
    return AzureMLBackend(stored.config, secrets=stored.secrets, transport=StandinTransport(workspace),
                          clock=FakeClock(), retry_policy=retry.RetryPolicy(rng=random.Random(0)))


def test_arm_requests_carry_the_token_of_the_stored_service_principal(user, workspace):
    tenant, client, secret = str(uuid.uuid4()), str(uuid.uuid4()), "PLANTED-" + uuid.uuid4().hex
    workspace.register_app(tenant, client, secret)
    adapter = _adapter(user, workspace, {"tenant_id": tenant, "client_id": client, "client_secret": secret})

    handle = adapter.submit(JobSpec(job_name="tb-job-9-cred", config=CONFIG, nodes=1, procs_per_node=1,
                                    max_runtime_s=600, tags={"trainboard-job-id": "9"}))
    workspace.set_status("tb-job-9-cred", "Running")
    assert adapter.describe(handle).state == "RUNNING"

    # Entra ID saw the stored secret, in the form of a client-credentials grant for ARM.
    login = [s for s in workspace.requests if s.url.startswith(LOGIN)]
    assert [(s.method, s.path) for s in login] == [
        ("GET", f"/{tenant}/v2.0/.well-known/openid-configuration"), ("POST", f"/{tenant}/oauth2/v2.0/token")]
    grant = login[1].body
    assert (grant["grant_type"], grant["client_id"], grant["client_secret"], grant["scope"]) == (
        "client_credentials", client, secret, ARM_SCOPE)
    assert login[1].status == 200
    (issued,) = workspace.tokens
    assert workspace.tokens[issued] == (tenant, client)

    # Every ARM and run-history request carried that token; the stand-in accepted each.
    api = [s for s in workspace.requests if s.url.startswith(("https://management.azure.com",
                                                               "https://eastus.api.azureml.ms"))]
    assert {s.method for s in api} >= {"GET", "PUT"} and len(api) >= 4
    assert {s.headers["Authorization"] for s in api} == {f"Bearer {issued}"}
    assert {s.app for s in api} == {(tenant, client)} and not [s for s in api if s.status in (401, 403)]
    (put,) = workspace.calls("PUT", r"/jobs/tb-job-9-cred$")
    assert put.headers["Authorization"] == f"Bearer {issued}"


def test_a_wrong_stored_secret_is_refused_by_entra_id_and_nothing_reaches_arm(user, workspace):
    tenant, client = str(uuid.uuid4()), str(uuid.uuid4())
    workspace.register_app(tenant, client, "the-right-secret")
    wrong = "PLANTED-" + uuid.uuid4().hex
    adapter = _adapter(user, workspace, {"tenant_id": tenant, "client_id": client, "client_secret": wrong})

    with pytest.raises(CredentialsError) as exc:
        adapter.list_tagged()
    assert str(exc.value) == (
        "Microsoft Entra ID refused the backend's stored service principal: Authentication failed: AADSTS7000215: "
        "Invalid client secret provided. Check its tenant id, client id and client secret on the backend (a "
        "client secret expires; create a new one under App registrations → Certificates & secrets).")
    (post,) = [s for s in workspace.requests if s.method == "POST" and s.url.startswith(LOGIN)]
    assert post.body["client_secret"] == wrong and post.status == 401
    assert not workspace.tokens
    assert not [s for s in workspace.requests if s.url.startswith("https://management.azure.com")
                and "Authorization" in s.headers]


def test_entra_id_out_of_reach_is_a_transient_error_not_a_refusal(user, workspace):
    from azure.core.exceptions import ServiceRequestError

    from cloud_adapters.base import ProviderError

    def unreachable(request):
        if request.url.startswith(LOGIN):
            raise ServiceRequestError("Failed to resolve 'login.microsoftonline.com' ([Errno -2] Name or service not known)")

    secret = "PLANTED-" + uuid.uuid4().hex
    adapter = _adapter(user, workspace, {"tenant_id": str(uuid.uuid4()), "client_id": str(uuid.uuid4()),
                                         "client_secret": secret})
    adapter._transport.on_send = unreachable
    with pytest.raises(ProviderError) as exc:
        adapter.list_tagged()
    assert exc.value.transient and type(exc.value) is ProviderError
    assert str(exc.value) == (
        "could not reach Microsoft Entra ID for a token of the backend's stored service principal (Authentication "
        "failed: Failed to resolve 'login.microsoftonline.com' ([Errno -2] Name or service not known)); check the "
        "worker's network (login.microsoftonline.com). The next sync tries again.")
    assert len(adapter.clock.sleeps) == adapter.retry_policy.max_attempts - 1  # retried with backoff
    assert not [s for s in workspace.requests if s.url.startswith("https://management.azure.com")]
