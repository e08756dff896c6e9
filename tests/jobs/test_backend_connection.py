"""services.backend_test_connection and the admin action "Test connection": the adapter's checks as
they are, settings errors as a failed check (never an exception), ownership enforced."""

from __future__ import annotations

import pytest
from django.contrib.messages import get_messages
from django.core.exceptions import ValidationError
from django.urls import reverse

from cloud_adapters import registry
from cloud_adapters.base import ConnectionCheck
from jobs import services
from jobs.models import ComputeBackend
from backend_fakes import OfflineBackend

pytestmark = pytest.mark.django_db

SAGEMAKER = {"region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerTraining",
             "bucket": "tb-test-bucket", "spot_allowed": True}


@pytest.fixture
def sagemaker_backend(user):
    return services.backend_create(owner=user, name="sm", kind="sagemaker", config=SAGEMAKER)


class ExplodingBackend(OfflineBackend):
    """An adapter whose test_connection breaks its contract and raises."""

    kind = "exploding"

    def test_connection(self):
        raise RuntimeError("socket closed")


def test_gpubox_reports_one_ok_check(user, local_backend):
    checks = services.backend_test_connection(backend=local_backend, user=user)
    assert checks == [ConnectionCheck("settings", True, "settings are valid; this backend has nothing remote to check")]


def test_sagemaker_checks_identity_bucket_and_api_access(user, sagemaker_backend, aws_env):
    import boto3

    checks = services.backend_test_connection(backend=sagemaker_backend, user=user)
    assert [(c.name, c.ok) for c in checks] == [("identity", True), ("bucket", False), ("SageMaker access", True)]
    assert checks[0].message == "signed in as arn:aws:sts::123456789012:user/moto (account 123456789012)"
    assert checks[1].message == ("bucket tb-test-bucket does not exist; create it in us-east-1 or correct the "
                                 "bucket setting.")
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="tb-test-bucket")
    checks = services.backend_test_connection(backend=sagemaker_backend, user=user)
    assert [(c.name, c.ok, c.message) for c in checks][1] == (
        "bucket", True, "bucket tb-test-bucket exists and is accessible")


def test_settings_the_adapter_rejects_become_a_failed_check(user, sagemaker_backend):
    # A row edited behind the service's back (or saved before a validation rule existed).
    ComputeBackend.objects.filter(pk=sagemaker_backend.pk).update(config={**SAGEMAKER, "role_arn": "admin"})
    sagemaker_backend.refresh_from_db()
    checks = services.backend_test_connection(backend=sagemaker_backend, user=user)
    assert checks == [ConnectionCheck("settings", False, (
        "Backend sm cannot be used: Execution role ARN: expected an IAM role ARN 'arn:aws:iam::<12-digit account id>:"
        "role/<name>' (the SageMaker execution role), got 'admin'. Fix its settings and test again."))]


def test_an_unknown_kind_and_a_raising_adapter_are_failed_checks(user, monkeypatch):
    monkeypatch.setitem(registry.KINDS, "exploding",
                        registry.KindInfo(ExplodingBackend.__module__, "ExplodingBackend", "Exploding"))
    backend = services.backend_create(owner=user, name="boom", kind="exploding")
    checks = services.backend_test_connection(backend=backend, user=user)
    assert checks == [ConnectionCheck("connection", False,
                                      "The exploding adapter failed while testing (RuntimeError: socket closed).")]
    monkeypatch.delitem(registry.KINDS, "exploding")
    (check,) = services.backend_test_connection(backend=backend, user=user)
    assert (check.name, check.ok) == ("settings", False)
    assert check.message.startswith("Backend boom cannot be used: unknown backend kind 'exploding'; known kinds:")


def test_only_the_owner_or_a_superuser_may_test(user, other_user, django_user_model, local_backend):
    with pytest.raises(ValidationError) as caught:
        services.backend_test_connection(backend=local_backend, user=other_user)
    assert caught.value.message_dict == {"__all__": ["Backend local is not yours to test."]}
    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    assert services.backend_test_connection(backend=local_backend, user=root)[0].ok


def test_admin_action_reports_each_check(client, user, local_backend, sagemaker_backend, aws_env):
    client.force_login(user)
    response = client.post(reverse("admin:jobs_computebackend_changelist"), {
        "action": "test_connection_selected", "_selected_action": [local_backend.pk, sagemaker_backend.pk],
    })
    assert response.status_code == 302
    got = [(m.level_tag, m.message) for m in get_messages(response.wsgi_request)]
    assert got == [
        ("success", "local — settings: ok. settings are valid; this backend has nothing remote to check"),
        ("success", "sm — identity: ok. signed in as arn:aws:sts::123456789012:user/moto (account 123456789012)"),
        ("error", "sm — bucket: failed. bucket tb-test-bucket does not exist; create it in us-east-1 or correct "
                  "the bucket setting."),
        ("success", "sm — SageMaker access: ok. SageMaker API reachable in us-east-1 (ListTrainingJobs allowed)"),
    ]


def test_admin_action_never_reaches_another_users_backend(client, other_user, local_backend):
    client.force_login(other_user)
    response = client.post(reverse("admin:jobs_computebackend_changelist"), {
        "action": "test_connection_selected", "_selected_action": [local_backend.pk],
    })
    # The scoped queryset has no such row: the action runs over nothing and reports nothing.
    assert response.status_code == 302
    assert [m.message for m in get_messages(response.wsgi_request)] == []
