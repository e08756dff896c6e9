"""jobs.adapters: what the dashboard reads of a backend kind comes from its adapter's declaration, and
the factory hands the row's credentials to the adapter's constructor."""

from __future__ import annotations

import pytest

from cloud_adapters import registry
from jobs import adapters, services

pytestmark = pytest.mark.django_db

SAGEMAKER = {"region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerTraining",
             "bucket": "tb-test-bucket"}
KEYS = {"aws_access_key_id": "AKIAEXAMPLEKEY", "aws_secret_access_key": "s3cr3t-value"}


def test_a_kinds_facts_are_its_declarations():
    declared = registry.backend_settings("sagemaker")
    assert adapters.backend_declaration("sagemaker") is declared
    assert adapters.backend_host_settings("sagemaker") == declared.host == {"profile", "endpoint_url"}
    assert adapters.backend_setting_labels("sagemaker")["role_arn"] == "Execution role ARN"
    assert adapters.backend_secret_keys("sagemaker") == {"aws_access_key_id": True, "aws_secret_access_key": True,
                                                          "aws_session_token": False}
    # An unknown kind has nothing to declare (the service refuses it on ``kind``).
    unknown = adapters.backend_declaration("nosuchcloud")
    assert (unknown.keys, unknown.host, unknown.labels, unknown.secret_keys) == (frozenset(), frozenset(), {}, {})
    assert adapters.backend_secret_keys("nosuchcloud") == {}


def test_the_factory_passes_the_stored_credentials_to_the_constructor(user):
    backend = services.backend_create(owner=user, name="sm", kind="sagemaker", config=SAGEMAKER, secrets=KEYS)
    adapter = adapters.backend_adapter(backend)
    assert dict(adapter.secrets) == KEYS
    with pytest.raises(TypeError):
        adapter.secrets["aws_secret_access_key"] = "other"  # type: ignore[index]
    # Another backend of the same kind without credentials shares nothing with it.
    plain = services.backend_create(owner=user, name="sm-2", kind="sagemaker", config=SAGEMAKER)
    assert dict(adapters.backend_adapter(plain).secrets) == {}
