"""Backend credentials (ComputeBackend.secrets): accepted per kind, encrypted at rest, write-only in
the form, the API and the admin, never in a response or a log line, and used by each adapter to
build its SDK client.

A Celery worker's log is searched in test_worker_secrets.py; the credentials on the wire in
tests/cloud_adapters/vertex/test_vertex_credentials.py and azureml/test_azureml_credentials.py."""

from __future__ import annotations

import io
import json
import logging
import uuid

import pytest
from cryptography.fernet import Fernet
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from jobs import adapters, services
from jobs.models import ComputeBackend

pytestmark = pytest.mark.django_db

SAGEMAKER_CONFIG = {"region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerTraining",
                    "bucket": "tb-bucket"}
VERTEX_CONFIG = {"project": "tb-project", "staging_bucket": "gs://tb-stage"}
AZURE_CONFIG = {"subscription_id": "00000000-0000-0000-0000-000000000000", "resource_group": "rg",
                "workspace": "tb-workspace", "compute": "gpu-cluster"}


def _planted() -> str:
    return "PLANTED-" + uuid.uuid4().hex


@pytest.fixture
def owner(django_user_model):
    # Staff and superuser, so the admin shows the owner every row and page there is.
    return django_user_model.objects.create_superuser(username="olga", password="pw-olga-Secret-1")


def _raw_column(pk: int) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT secrets FROM jobs_computebackend WHERE id = %s", [pk])
        return cursor.fetchone()[0]


# --- validation --------------------------------------------------------------------------------


def test_each_kind_accepts_only_its_own_secret_keys(owner):
    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=owner, name="sm", kind="sagemaker", config=SAGEMAKER_CONFIG,
                                secrets={"client_secret": "x"})
    assert exc.value.message_dict["secrets"] == [
        "client_secret: not a secret an AWS SageMaker backend takes; it takes aws_access_key_id, "
        "aws_secret_access_key, aws_session_token."]
    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=owner, name="sm", kind="sagemaker", config=SAGEMAKER_CONFIG,
                                secrets={"aws_access_key_id": "AKIAONLY"})
    assert exc.value.message_dict["secrets"][0].startswith("aws_secret_access_key: required")
    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=owner, name="box", kind="gpubox", config={}, secrets={"token": "x"})
    assert "it takes none" in exc.value.message_dict["secrets"][0]
    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=owner, name="az", kind="azureml", config=AZURE_CONFIG,
                                secrets={"tenant_id": "t", "client_id": "c"})
    assert exc.value.message_dict["secrets"][0].startswith("client_secret: required")
    assert not ComputeBackend.objects.exists()  # nothing half-created

    # The messages name keys, never values.
    secret = _planted()
    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=owner, name="sm", kind="sagemaker", config=SAGEMAKER_CONFIG,
                                secrets={"aws_secret_access_key": secret})
    assert secret not in json.dumps(exc.value.message_dict)


def test_secrets_are_ciphertext_in_the_database_and_a_wrong_key_says_so(owner, settings):
    secret = _planted()
    backend = services.backend_create(owner=owner, name="sm", kind="sagemaker", config=SAGEMAKER_CONFIG,
                                      secrets={"aws_access_key_id": "AKIA" + secret[-12:].upper(),
                                               "aws_secret_access_key": secret})
    raw = _raw_column(backend.pk)
    assert raw.startswith("fernet:") and secret not in raw and secret[-12:].upper() not in raw
    assert ComputeBackend.objects.get(pk=backend.pk).secrets["aws_secret_access_key"] == secret
    # dumpdata writes the token, not the secret.
    out = io.StringIO()
    call_command("dumpdata", "jobs.computebackend", stdout=out)
    assert secret not in out.getvalue() and '"secrets": "fernet:' in out.getvalue()

    settings.TRAINBOARD_ENCRYPTION_KEYS = (Fernet.generate_key().decode(),)
    with pytest.raises(ImproperlyConfigured, match="cannot be decrypted with TRAINBOARD_ENCRYPTION_KEY"):
        ComputeBackend.objects.get(pk=backend.pk)


def test_update_keeps_blank_secrets_replaces_given_ones_and_clears(owner):
    backend = services.backend_create(owner=owner, name="az", kind="azureml", config=AZURE_CONFIG,
                                      secrets={"tenant_id": "t1", "client_id": "c1", "client_secret": "s1"})
    services.backend_update(backend=backend, secrets={"tenant_id": "", "client_id": "", "client_secret": "s2"})
    assert ComputeBackend.objects.get(pk=backend.pk).secrets == {"tenant_id": "t1", "client_id": "c1",
                                                                  "client_secret": "s2"}
    services.backend_update(backend=backend, clear_secrets=True)
    assert ComputeBackend.objects.get(pk=backend.pk).secrets == {}
    assert _raw_column(backend.pk) == ""


# --- never rendered back ---------------------------------------------------------------------------


def _walk_every_get(client: Client, api: APIClient) -> list[tuple[str, int, str]]:
    """GET every URL of the URLconf as ``client`` (the API as ``api``); ``(url, status, body)``."""
    from test_permission_walk import OBJECT_OF, Route, _admin_url, _kwargs, all_routes, classify

    from jobs.models import Dataset, ModelSpec, TrainingJob

    objects = {"backend": ComputeBackend.objects.first(), "dataset": Dataset.objects.first(),
               "model": ModelSpec.objects.first(), "job": TrainingJob.objects.first(), "orphan": None}
    user = client.session.get("_auth_user_id")
    out = []
    for route in all_routes():
        kind = classify(route)
        if route.pattern.startswith("admin/"):
            from django.contrib.auth import get_user_model

            url = _admin_url(route, None, get_user_model().objects.get(pk=user))
        elif kind in ("public-post", "staff", "api-action") or route.name in ("logout",):
            continue
        else:
            prefix = "-".join(route.name.split("-")[:2]) if route.name.startswith("api-") else route.name.split("-")[0]
            obj = objects.get(OBJECT_OF.get(prefix, ""))
            if "pk" in route.params and obj is None:
                continue
            url = reverse(route.name, kwargs=_kwargs(route, getattr(obj, "pk", None)))
        if url is None or (route.name or "").endswith("_delete") or "logout" in (route.name or ""):
            continue
        r = (api if (route.name or "").startswith("api-") and kind != "api-docs" else client).get(url, follow=False)
        body = b"".join(r.streaming_content) if getattr(r, "streaming", False) else r.content  # a log download streams
        out.append((url, r.status_code, body.decode(errors="replace")))
    return out


def test_planted_secret_never_appears_in_any_response_or_log_line(owner, caplog, settings, tmp_path):
    caplog.set_level(logging.DEBUG)
    settings.TRAINBOARD_RUN_ROOT = tmp_path
    secret = _planted()
    key_id = "AKIA" + uuid.uuid4().hex[:16].upper()
    client = Client()
    client.force_login(owner)
    api = APIClient()
    api.force_authenticate(owner)

    # Plant through the browser form (a SageMaker backend) and through the API (an Azure ML one).
    r = client.post(reverse("backend-create"), {
        "name": "sm", "kind": "sagemaker", "sagemaker_region": "us-east-1", "role_arn": SAGEMAKER_CONFIG["role_arn"],
        "bucket": "tb-bucket", "enabled": "on",
        "secret_sagemaker_aws_access_key_id": key_id, "secret_sagemaker_aws_secret_access_key": secret,
    })
    assert r.status_code == 302, r.content.decode()[:2000]
    sm = ComputeBackend.objects.get(name="sm")
    assert sm.secrets == {"aws_access_key_id": key_id, "aws_secret_access_key": secret}
    r = api.post(reverse("api-backend-list"), {"name": "az", "kind": "azureml", "config": AZURE_CONFIG,
                                               "secrets": {"tenant_id": "tenant-1", "client_id": "client-1",
                                                           "client_secret": secret}}, format="json")
    assert r.status_code == 201, r.content
    assert "secrets" not in r.json() and r.json()["secrets_set"] == ["client_id", "client_secret", "tenant_id"]
    az = ComputeBackend.objects.get(name="az")
    # A gpubox backend and a job on it, so every job page has something to show.
    digits = services.dataset_create(owner=owner, name="digits", format="builtin", builtin_name="digits")
    cnn = services.model_spec_create(owner=owner, name="cnn", architecture="cnn", params={})
    box = services.backend_create(owner=owner, name="box", kind="gpubox", config={"max_procs_per_node": 1})
    services.training_job_create(owner=owner, dataset=digits, model_spec=cnn, backend=box, nodes=1,
                                 procs_per_node=1, epochs=1)

    # The edit pages: password inputs never carry a value; "stored" is all they say.
    page = client.get(reverse("backend-edit", args=[sm.pk])).content.decode()
    assert "Stored (encrypted); leave blank to keep it." in page and secret not in page and key_id not in page
    # A blank re-save keeps the secrets.
    r = client.post(reverse("backend-edit", args=[sm.pk]), {
        "name": "sm", "kind": "sagemaker", "sagemaker_region": "us-east-1", "role_arn": SAGEMAKER_CONFIG["role_arn"],
        "bucket": "tb-bucket", "enabled": "on", "secret_sagemaker_aws_access_key_id": "",
        "secret_sagemaker_aws_secret_access_key": ""})
    assert r.status_code == 302
    assert ComputeBackend.objects.get(pk=sm.pk).secrets["aws_secret_access_key"] == secret
    # The admin says set / not set only.
    admin_page = client.get(reverse("admin:jobs_computebackend_change", args=[az.pk])).content.decode()
    assert "set: client_id, client_secret, tenant_id" in admin_page
    # An API update with secrets answers without them.
    r = api.patch(reverse("api-backend-detail", args=[az.pk]), {"secrets": {"client_secret": secret + "2"}},
                  format="json")
    assert r.status_code == 200 and secret not in r.content.decode()
    assert ComputeBackend.objects.get(pk=az.pk).secrets["client_secret"] == secret + "2"

    responses = _walk_every_get(client, api)
    assert len(responses) > 50
    assert sum(1 for _, status, _ in responses if status == 200) > 40
    leaks = [url for url, _, body in responses if secret in body or key_id in body]
    assert not leaks, f"the planted secret is in: {leaks}"
    assert not [url for url, status, _ in responses if status >= 500]
    logged = [rec.getMessage() for rec in caplog.records]
    assert logged  # the requests did log (axes, django.request ...): the search had lines to search
    assert not [line for line in logged if secret in line or key_id in line]


# --- the adapters use them ---------------------------------------------------------------------------


def test_sagemaker_signs_with_the_stored_keys(owner, aws_env):
    key_id = "AKIA" + uuid.uuid4().hex[:16].upper()
    backend = services.backend_create(owner=owner, name="sm", kind="sagemaker", config=SAGEMAKER_CONFIG,
                                      secrets={"aws_access_key_id": key_id, "aws_secret_access_key": _planted()})
    signed_with: list[str] = []

    def capture(request, **kwargs):
        signed_with.append(request.headers["Authorization"].decode() if isinstance(
            request.headers["Authorization"], bytes) else request.headers["Authorization"])

    sts = adapters.backend_adapter(backend).client("sts")
    sts.meta.events.register_first("before-send.sts.GetCallerIdentity", capture)
    identity = sts.get_caller_identity()
    assert identity["Account"] == "123456789012"  # moto answered
    assert len(signed_with) == 1 and f"Credential={key_id}/" in signed_with[0]

    # Without stored keys, boto3's default chain is used (under moto: moto's fake environment keys).
    other = services.backend_create(owner=owner, name="sm2", kind="sagemaker", config=SAGEMAKER_CONFIG)
    sts = adapters.backend_adapter(other).client("sts")
    sts.meta.events.register_first("before-send.sts.GetCallerIdentity", capture)
    sts.get_caller_identity()
    assert len(signed_with) == 2 and key_id not in signed_with[1] and "Credential=FOOBARKEY/" in signed_with[1]


def _service_account_json(email: str) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    return json.dumps({"type": "service_account", "project_id": "tb-project", "private_key_id": "k1",
                       "private_key": pem, "client_email": email, "client_id": "1",
                       "token_uri": "https://oauth2.googleapis.com/token"})


def test_vertex_builds_its_clients_with_the_stored_service_account(owner, monkeypatch, tmp_path):
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    email = f"tb-{uuid.uuid4().hex[:8]}@tb-project.iam.gserviceaccount.com"
    backend = services.backend_create(owner=owner, name="vx", kind="vertex", config=VERTEX_CONFIG,
                                      secrets={"service_account_json": _service_account_json(email)})
    adapter = adapters.backend_adapter(backend)
    creds = adapter.job_client()._transport._credentials
    assert creds.service_account_email == email
    assert adapter.storage_client()._credentials.service_account_email == email

    # A key that is not a service-account key file: a clear CredentialsError that quotes nothing of it.
    from cloud_adapters.base import CredentialsError

    services.backend_update(backend=backend, secrets={"service_account_json": '{"private_key": "PLANTED-x"}'})
    with pytest.raises(CredentialsError) as exc:
        adapters.backend_adapter(ComputeBackend.objects.get(pk=backend.pk)).job_client()
    assert "not a usable service-account key file" in str(exc.value) and "PLANTED" not in str(exc.value)


def test_azureml_uses_a_client_secret_credential_from_the_stored_service_principal(owner):
    from azure.identity import ClientSecretCredential, DefaultAzureCredential

    backend = services.backend_create(owner=owner, name="az", kind="azureml", config=AZURE_CONFIG,
                                      secrets={"tenant_id": "tenant-1", "client_id": "client-1",
                                               "client_secret": _planted()})
    credential = adapters.backend_adapter(backend).credential()
    assert isinstance(credential, ClientSecretCredential)
    assert (credential._tenant_id, credential._client_id) == ("tenant-1", "client-1")
    plain = services.backend_create(owner=owner, name="az2", kind="azureml", config=AZURE_CONFIG)
    assert isinstance(adapters.backend_adapter(plain).credential(), DefaultAzureCredential)


def test_rotate_secrets_re_encrypts_with_the_first_key(owner, settings):
    from django.core.management.base import CommandError

    old_key, new_key = settings.TRAINBOARD_ENCRYPTION_KEYS[0], Fernet.generate_key().decode()
    secret = _planted()
    backend = services.backend_create(owner=owner, name="az", kind="azureml", config=AZURE_CONFIG,
                                      secrets={"tenant_id": "t", "client_id": "c", "client_secret": secret})
    before = _raw_column(backend.pk)

    settings.TRAINBOARD_ENCRYPTION_KEYS = (new_key, old_key)
    out = io.StringIO()
    call_command("rotate_secrets", stdout=out)
    assert out.getvalue().strip() == "re-encrypted the secrets of 1 backend with the first key."
    after = _raw_column(backend.pk)
    assert after != before and after.startswith("fernet:") and secret not in after
    # The old key can go now: the new one alone opens the row; the old one alone no longer does.
    settings.TRAINBOARD_ENCRYPTION_KEYS = (new_key,)
    assert ComputeBackend.objects.get(pk=backend.pk).secrets["client_secret"] == secret
    settings.TRAINBOARD_ENCRYPTION_KEYS = (old_key,)
    with pytest.raises(CommandError, match=f"backend {backend.pk}: no key of TRAINBOARD_ENCRYPTION_KEY opens it"):
        call_command("rotate_secrets", stdout=io.StringIO())
    assert _raw_column(backend.pk) == after  # nothing half-rotated
