"""jobs/services/resources.py: dataset, model and backend validation."""

import pytest
from django.core.exceptions import ValidationError

from jobs import services
from jobs.models import Dataset

pytestmark = pytest.mark.django_db


def test_dataset_validation(user, tmp_path):
    with pytest.raises(ValidationError) as excinfo:
        services.dataset_create(owner=user, name="d", format="builtin", builtin_name="mnist")
    assert "builtin_name" in excinfo.value.message_dict
    with pytest.raises(ValidationError) as excinfo:
        services.dataset_create(owner=user, name="d", format="npz")
    assert "uri" in excinfo.value.message_dict
    with pytest.raises(ValidationError) as excinfo:
        services.dataset_create(owner=user, name="d", format="npz", uri=str(tmp_path / "missing.npz"))
    assert "does not exist" in excinfo.value.message_dict["uri"][0]
    services.dataset_create(owner=user, name="d", format="builtin", builtin_name="digits")
    with pytest.raises(ValidationError) as excinfo:
        services.dataset_create(owner=user, name="d", format="builtin", builtin_name="digits")
    assert "already have" in excinfo.value.message_dict["name"][0]
    with pytest.raises(ValidationError) as excinfo:
        services.dataset_create(owner=user, name="not a slug", format="builtin", builtin_name="digits")
    assert "name" in excinfo.value.message_dict
    assert Dataset.objects.count() == 1


def test_model_and_backend_validation(user):
    with pytest.raises(ValidationError) as excinfo:
        services.model_spec_create(owner=user, name="m", architecture="transformer")
    assert "architecture" in excinfo.value.message_dict
    with pytest.raises(ValidationError) as excinfo:
        services.model_spec_create(owner=user, name="m", architecture="cnn", params={"channels": 0})
    assert "params" in excinfo.value.message_dict
    spec = services.model_spec_create(owner=user, name="m", architecture="mlp", params={"hidden_size": 8})
    assert spec.params == {"hidden_size": 8, "num_layers": 2, "dropout": 0.0}
    with pytest.raises(ValidationError) as excinfo:
        services.backend_create(owner=user, name="b", kind="nope")
    assert "kind" in excinfo.value.message_dict
    with pytest.raises(ValidationError) as excinfo:
        services.backend_create(owner=user, name="b", kind="gpubox", config={"hourly_rate_usd": -1})
    assert excinfo.value.message_dict["config.hourly_rate_usd"] == ["Hourly rate (USD): must be 0 to 100,000 USD per node-hour, got -1."]
    backend = services.backend_create(owner=user, name="b", kind="gpubox", config={"max_procs_per_node": 2})
    assert backend.config == {"max_procs_per_node": 2}  # run_root comes from this host's settings
