"""Whose cloud identity a backend without stored credentials uses.

A SageMaker, Vertex AI or Azure ML backend that stores no credentials calls its provider as the
worker itself (boto3's default chain, Application Default Credentials, DefaultAzureCredential): the
operator's account. Under ``TRAINBOARD_WORKER_CREDENTIALS=staff`` (the default) only a backend owned
by active staff may do that: anyone else's is refused on save (service, API, form) and, for a row
stored before the rule or whose owner lost staff, refused again where the adapter is built
(jobs.adapters.backend_adapter), so Test connection, a launch and a sync make no provider call with
the worker's identity. ``everyone`` lets every user's backend use it."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from rest_framework.test import APIClient

from cloud_adapters import _aws
from cloud_adapters.base import BackendError, ConnectionCheck, CredentialsError
from cloud_adapters.registry import backend_class
from jobs import adapters, services, sync
from jobs.models import ComputeBackend, JobStateChoices as S, TrainingJob
from webapp.forms import BackendForm

pytestmark = pytest.mark.django_db

SAGEMAKER = {"region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerTraining",
             "bucket": "tb-test-bucket"}
CLOUDS = {
    "sagemaker": SAGEMAKER,
    "vertex": {"project": "vision-ml-prod", "region": "europe-west4", "staging_bucket": "gs://tb-staging/vertex",
               "service_account": "trainer@vision-ml-prod.iam.gserviceaccount.com"},
    "azureml": {"subscription_id": "3f2b6c1e-8a4d-4e7b-9c0a-5d1e2f3a4b5c", "resource_group": "ml-rg",
                "workspace": "vision-ws", "compute": "gpu-cluster"},
}
FIRST_KEY = {"sagemaker": "aws_access_key_id", "vertex": "service_account_json", "azureml": "tenant_id"}
SM_KEYS = {"aws_access_key_id": "AKIAIOSFODNN7EXAMPLE", "aws_secret_access_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}
REFUSAL = "this backend stores no credentials of its own, so its calls would use the worker's own identity"


@pytest.fixture
def mallory(django_user_model):
    return django_user_model.objects.create_user(username="mallory", password="pw-mallory-Secret-1")


@pytest.fixture
def aws_clients(monkeypatch):
    """The boto3 clients the SageMaker adapter makes (service names, in order), made for real."""
    made: list[str] = []
    real = _aws.make_client

    def spy(service, **kwargs):
        made.append(service)
        return real(service, **kwargs)

    monkeypatch.setattr(_aws, "make_client", spy)
    return made


def _legacy_row(owner, kind="sagemaker") -> ComputeBackend:
    """A cloud backend without credentials, saved before the rule (written past the service)."""
    return ComputeBackend.objects.create(owner=owner, name=f"old-{kind}", kind=kind, config=CLOUDS[kind])


def test_which_adapters_use_the_workers_identity_is_data_on_the_adapter():
    for kind in CLOUDS:
        cls = backend_class(kind)
        assert cls.ambient_identity
        assert cls.uses_ambient_credentials(CLOUDS[kind], {}) is True
        required = {k: "v" for k, r in cls.settings.secret_keys.items() if r}
        assert cls.uses_ambient_credentials(CLOUDS[kind], required) is False
    assert backend_class("sagemaker").uses_ambient_credentials(SAGEMAKER, {"aws_access_key_id": "only-one"}) is True
    # The GPU box calls no cloud; a Vertex stand-in on http:// is called unsigned (anonymous).
    assert backend_class("gpubox").uses_ambient_credentials({}, {}) is False
    assert backend_class("vertex").uses_ambient_credentials(
        {**CLOUDS["vertex"], "api_endpoint": "http://127.0.0.1:9"}, {}) is False


@pytest.mark.parametrize("kind", sorted(CLOUDS))
def test_the_service_refuses_a_non_staff_cloud_backend_without_credentials(mallory, kind):
    with pytest.raises(ValidationError) as excinfo:
        services.backend_create(owner=mallory, name="mine", kind=kind, config=CLOUDS[kind])
    messages = excinfo.value.message_dict["secrets"]
    assert len(messages) == 1 and messages[0].startswith(f"{FIRST_KEY[kind]}: required, because {REFUSAL} (")
    assert "which only a backend owned by staff may use. Store the backend's own credentials (" in messages[0]
    assert messages[0].endswith("or ask staff to set up the backend.")
    assert backend_class(kind).ambient_identity in messages[0]
    assert not ComputeBackend.objects.filter(name="mine").exists()


def test_all_errors_at_once_and_clearing_credentials_is_refused_too(mallory):
    with pytest.raises(ValidationError) as excinfo:
        services.backend_create(owner=mallory, name="mine", kind="sagemaker", config={**SAGEMAKER, "role_arn": "x"})
    errors = excinfo.value.message_dict
    assert set(errors) == {"secrets", "config.role_arn"}
    assert "expected an IAM role ARN" in errors["config.role_arn"][0]
    # With keys it is saved; clearing them afterwards would fall back to the worker's identity.
    backend = services.backend_create(owner=mallory, name="mine", kind="sagemaker", config=SAGEMAKER, secrets=SM_KEYS)
    with pytest.raises(ValidationError) as excinfo:
        services.backend_update(backend=backend, clear_secrets=True)
    assert excinfo.value.message_dict["secrets"][0].startswith(f"aws_access_key_id: required, because {REFUSAL}")
    backend.refresh_from_db()
    assert backend.secrets == SM_KEYS


def test_staff_and_the_everyone_setting_may_use_the_workers_identity(user, mallory, settings):
    assert settings.TRAINBOARD_WORKER_CREDENTIALS == "staff"  # the default
    staff_owned = services.backend_create(owner=user, name="ops", kind="sagemaker", config=SAGEMAKER)
    assert adapters.backend_adapter(staff_owned).config["role_arn"] == SAGEMAKER["role_arn"]
    settings.TRAINBOARD_WORKER_CREDENTIALS = "everyone"
    for kind in CLOUDS:
        backend = services.backend_create(owner=mallory, name=f"m-{kind}", kind=kind, config=CLOUDS[kind])
        assert adapters.backend_adapter(backend).kind == kind
    # Back to staff: the rows saved meanwhile are refused where they are used.
    settings.TRAINBOARD_WORKER_CREDENTIALS = "staff"
    with pytest.raises(CredentialsError, match="which only a backend owned by staff may use"):
        adapters.backend_adapter(ComputeBackend.objects.get(name="m-vertex"))


def test_an_owner_who_is_no_longer_staff_loses_the_workers_identity(user):
    backend = services.backend_create(owner=user, name="ops", kind="azureml", config=CLOUDS["azureml"])
    adapters.backend_adapter(backend)
    type(user).objects.filter(pk=user.pk).update(is_staff=False)
    backend = ComputeBackend.objects.get(pk=backend.pk)
    with pytest.raises(CredentialsError) as excinfo:
        adapters.backend_adapter(backend)
    assert str(excinfo.value).startswith(f"{REFUSAL} (DefaultAzureCredential")


def test_the_api_answers_400_with_the_field_message(mallory, user):
    api = APIClient()
    api.force_authenticate(mallory)
    r = api.post(reverse("api-backend-list"), {"name": "mine", "kind": "sagemaker", "config": SAGEMAKER},
                 format="json")
    assert r.status_code == 400, r.content
    assert r.json()["secrets"][0].startswith(f"aws_access_key_id: required, because {REFUSAL} (boto3's")
    r = api.post(reverse("api-backend-list"), {"name": "mine", "kind": "sagemaker", "config": SAGEMAKER,
                                               "secrets": SM_KEYS}, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["secrets_set"] == ["aws_access_key_id", "aws_secret_access_key"]
    api.force_authenticate(user)  # staff
    r = api.post(reverse("api-backend-list"), {"name": "ops", "kind": "sagemaker", "config": SAGEMAKER},
                 format="json")
    assert r.status_code == 201, r.content


def test_the_form_puts_the_message_on_the_first_credential_input(client, mallory):
    client.force_login(mallory)
    page = client.get(reverse("backend-create")).content.decode()
    assert "Not set. Required: only a backend owned by staff may use the worker&#x27;s own identity." in page
    fields = {BackendForm().setting_field("sagemaker", k): v for k, v in SAGEMAKER.items()}
    r = client.post(reverse("backend-create"), {"name": "mine", "kind": "sagemaker", "enabled": "on", **fields})
    assert r.status_code == 200
    errors = r.context["form"].errors
    assert list(errors) == ["secret_sagemaker_aws_access_key_id"]
    assert errors["secret_sagemaker_aws_access_key_id"][0].startswith(f"aws_access_key_id: required, because {REFUSAL}")
    assert not ComputeBackend.objects.filter(name="mine").exists()
    r = client.post(reverse("backend-create"), {
        "name": "mine", "kind": "sagemaker", "enabled": "on", **fields,
        **{f"secret_sagemaker_{k}": v for k, v in SM_KEYS.items()}})
    assert r.status_code == 302
    assert ComputeBackend.objects.get(name="mine").secrets == SM_KEYS


def test_test_connection_of_a_stored_row_says_why_and_calls_nothing(mallory, aws_env, aws_clients):
    backend = _legacy_row(mallory)
    checks = services.backend_test_connection(backend=backend, user=mallory)
    assert len(checks) == 1 and checks[0].name == "settings" and not checks[0].ok
    assert checks[0].message.startswith(f"Backend old-sagemaker cannot be used: {REFUSAL} (boto3's")
    assert aws_clients == []
    # The same row with stored keys is tested with them (the check reaches moto).
    ComputeBackend.objects.filter(pk=backend.pk).update(secrets=SM_KEYS)
    checks = services.backend_test_connection(backend=ComputeBackend.objects.get(pk=backend.pk), user=mallory)
    assert checks[0] == ConnectionCheck("identity", True, checks[0].message) and aws_clients


def test_a_launch_on_a_stored_row_is_refused_and_creates_no_job(mallory, aws_env, aws_clients):
    backend = _legacy_row(mallory)
    dataset = services.dataset_create(owner=mallory, name="digits", format="builtin", builtin_name="digits")
    model = services.model_spec_create(owner=mallory, name="cnn", architecture="cnn",
                                       params={"channels": 16, "hidden_size": 64})
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_create(owner=mallory, dataset=dataset, model_spec=model, backend=backend)
    assert excinfo.value.message_dict["backend"][0].startswith(f"Backend old-sagemaker cannot be used: {REFUSAL}")
    assert TrainingJob.objects.count() == 0 and aws_clients == []


def test_a_sync_of_an_active_job_warns_and_makes_no_provider_call(mallory, settings, aws_env, aws_clients):
    """Decision: the job is not touched (state, cost and provider job as they are) and says why; the
    provider is not called with the worker's identity, not even to describe or cancel it."""
    backend = _legacy_row(mallory)
    dataset = services.dataset_create(owner=mallory, name="digits", format="builtin", builtin_name="digits")
    model = services.model_spec_create(owner=mallory, name="cnn", architecture="cnn", params={})
    handle = {"provider": "sagemaker", "job_name": "tb-job-1-abc", "provider_job_id": "", "extra": {}}
    running = TrainingJob.objects.create(owner=mallory, dataset=dataset, model_spec=model, backend=backend,
                                         config={}, state=S.RUNNING, provider_handle=handle)
    stopping = TrainingJob.objects.create(owner=mallory, dataset=dataset, model_spec=model, backend=backend,
                                          config={}, state=S.STOPPING, provider_handle={**handle, "job_name": "tb-job-2-abc"})
    assert sync.backend_sync(backend_id=backend.pk) == 2
    assert aws_clients == []
    for job in (running, stopping):
        before = job.state
        job.refresh_from_db()
        assert job.state == before
        assert job.status_warning.startswith(f"Not synced: backend old-sagemaker cannot be used: {REFUSAL}")
        assert job.status_warning.endswith("Until then this job is not followed or stopped from here; check it "
                                           "in the provider's console.")
    # The control: where the operator allows it, the same sync does call the provider.
    TrainingJob.objects.filter(pk=stopping.pk).update(state=S.CANCELLED)  # the running job's describe suffices
    settings.TRAINBOARD_WORKER_CREDENTIALS = "everyone"
    try:
        sync.backend_sync(backend_id=backend.pk)
    except BackendError:
        pass  # moto knows no such training job; what matters is that it was asked
    assert "sagemaker" in aws_clients


@pytest.mark.parametrize("value,ok", [("everyone", True), ("Staff ", True), ("anyone", False)])
def test_the_setting_accepts_staff_or_everyone_and_names_a_bad_value(value, ok):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "webapp.settings", "TRAINBOARD_WORKER_CREDENTIALS": value}
    proc = subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; print(settings.TRAINBOARD_WORKER_CREDENTIALS)"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=60)
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip() == value.strip().lower(), proc.stderr
    else:
        assert proc.returncode != 0
        assert "TRAINBOARD_WORKER_CREDENTIALS must be staff or everyone (got 'anyone')" in proc.stderr
