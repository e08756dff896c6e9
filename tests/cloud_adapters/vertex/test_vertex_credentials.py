"""A Vertex backend's stored service-account key is what its requests carry.

The key goes in through the dashboard's service (encrypted in the database), comes back out through
``adapters.backend_adapter``, and the stand-in (standin.py, :meth:`VertexStandIn.accept_key`) checks
every request the way Google does: a self-signed JWT or an access token from the key's ``token_uri``,
signed by that key, else 401. So these tests see the credentials on the wire, not how a client was
built.
"""

from __future__ import annotations

import json
import uuid

import pytest
from google.auth import jwt

from cloud_adapters.base import CredentialsError, JobSpec
from jobs import adapters, services
from jobs.models import ComputeBackend
from standin import service_account_key

STAGING = "gs://stage/tb"  # the bucket gcs (conftest.py) creates

pytestmark = pytest.mark.django_db

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
CONFIG = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "mlp"},
          "train": {"epochs": 1, "batch_size": 32}, "parallel": {"strategy": "ddp"}}


def _backend(user, vertex, gcs, *, name: str = "vx", secrets: dict | None = None) -> ComputeBackend:
    return services.backend_create(
        owner=user, name=name, kind="vertex",
        config={"project": "my-proj", "staging_bucket": STAGING, "api_endpoint": vertex.url,
                "storage_endpoint": gcs, "accelerator_type": "NVIDIA_TESLA_T4", "accelerator_count": 1},
        secrets=secrets)


def _spec(name: str) -> JobSpec:
    return JobSpec(job_name=name, config=CONFIG, nodes=1, procs_per_node=1, spot=False, max_runtime_s=600,
                   tags={"trainboard-job-id": "1"}, env={})


def test_every_request_carries_the_stored_service_account(user, vertex, gcs):
    email = f"tb-{uuid.uuid4().hex[:8]}@my-proj.iam.gserviceaccount.com"
    key_json, public = service_account_key(email, token_uri=f"{vertex.url}/token")
    vertex.accept_key(email, public)  # from now on the stand-in answers 401 to anyone else
    row = _backend(user, vertex, gcs, secrets={"service_account_json": key_json})
    adapter = adapters.backend_adapter(ComputeBackend.objects.get(pk=row.pk))  # decrypted from the database

    handle = adapter.submit(_spec("tb-job-1-cred"))  # uploads to the GCS emulator, then CreateCustomJob
    status = adapter.describe(handle)
    lines, _ = adapter.logs(handle)
    assert status.state == "PENDING" and lines == []

    api = [r for r in vertex.requests if r.path.startswith(("/v1/", "/v2/"))]
    assert {(r.method, r.path.rsplit("/", 1)[-1]) for r in api} >= {
        ("POST", "customJobs"), ("GET", "1000000001"), ("POST", "entries:list")}
    assert [r.identity for r in api] == [email] * len(api)  # each proved the stored account

    # The Vertex client signs each request itself (a self-signed JWT, always_use_jwt_access): the
    # stand-in checked its signature against the stored key's public half; here its claims.
    (create,) = vertex.calls("POST", r"/customJobs$")
    scheme, _, token = create.headers["Authorization"].partition(" ")
    claims = jwt.decode(token, certs=public)
    assert scheme == "Bearer" and claims["iss"] == claims["sub"] == email and claims["scope"] == CLOUD_PLATFORM
    assert jwt.decode_header(token)["kid"] == json.loads(key_json)["private_key_id"]

    # Cloud Logging (google-auth's AuthorizedSession) and Cloud Storage exchange a JWT assertion signed
    # by the key at its token_uri for access tokens; the log read carries one of those.
    grants = vertex.calls("POST", r"^/token$")
    assert grants  # Cloud Storage's and Cloud Logging's sessions each ask at least once
    for grant in grants:
        assert grant.body["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
        assertion = jwt.decode(grant.body["assertion"], certs=public, audience="https://oauth2.googleapis.com/token")
        assert assertion["iss"] == email and assertion["scope"] == CLOUD_PLATFORM
    (entries,) = vertex.calls("POST", r"^/v2/entries:list$")
    bearer = entries.headers["Authorization"].removeprefix("Bearer ")
    assert bearer.startswith("ya29.standin-") and vertex.tokens[bearer] == email


def test_without_the_stored_key_the_requests_are_refused(user, vertex, gcs):
    email = f"tb-{uuid.uuid4().hex[:8]}@my-proj.iam.gserviceaccount.com"
    vertex.accept_key(email, service_account_key(email, token_uri=f"{vertex.url}/token")[1])
    # Another key of the same name (not the one the stand-in knows), and no key at all.
    other_json, _ = service_account_key(email, token_uri=f"{vertex.url}/token")
    signed_by_other = adapters.backend_adapter(_backend(user, vertex, gcs, name="other",
                                                        secrets={"service_account_json": other_json}))
    anonymous = adapters.backend_adapter(_backend(user, vertex, gcs, name="anon"))
    with pytest.raises(CredentialsError, match="Vertex AI 401 Unauthorized"):
        signed_by_other.list_tagged()
    refused = vertex.calls("GET", r"/customJobs$")
    assert refused and all(r.identity is None and r.headers["Authorization"].startswith("Bearer ey")
                           for r in refused)
    # Anonymous: the 401 makes google-auth try to refresh credentials it does not have.
    with pytest.raises(CredentialsError, match="^no Google Cloud credentials found"):
        anonymous.list_tagged()
    anonymous_calls = vertex.calls("GET", r"/customJobs$")[len(refused):]
    assert anonymous_calls and all("Authorization" not in r.headers for r in anonymous_calls)
    assert not vertex.created and not vertex.tokens


def test_a_stored_key_is_never_sent_in_clear_text_off_this_machine(user):
    key_json, _ = service_account_key("tb@my-proj.iam.gserviceaccount.com", token_uri="https://oauth2.googleapis.com/token")
    row = services.backend_create(
        owner=user, name="vx", kind="vertex",
        config={"project": "my-proj", "staging_bucket": STAGING, "api_endpoint": "http://vertex.example.com:8080"},
        secrets={"service_account_json": key_json})
    with pytest.raises(CredentialsError) as exc:
        adapters.backend_adapter(row).job_client()
    assert str(exc.value) == (
        "the endpoint http://vertex.example.com:8080 is plain http:// on another machine: the backend's "
        "service-account token would cross the network unencrypted. Use https://, or a stand-in on 127.0.0.1.")
