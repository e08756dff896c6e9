"""cloud_adapters.registry: the only kind → adapter mapping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cloud_adapters import registry
from cloud_adapters.base import Backend, InvalidSpec, MissingDependency
from cloud_adapters.gpubox import GpuBoxBackend

REPO = Path(__file__).resolve().parents[2]


def test_the_kinds_are_registered_with_their_extras():
    assert list(registry.KINDS) == ["gpubox", "sagemaker", "vertex", "azureml", "slurm", "kubernetes", "ray"]
    assert [kind for kind, _ in registry.kind_choices()] == ["gpubox", "sagemaker", "vertex", "azureml", "slurm",
                                                             "kubernetes", "ray"]
    assert registry.backend_class("gpubox") is GpuBoxBackend
    assert GpuBoxBackend.kind == "gpubox" and GpuBoxBackend.queue == "gpubox"
    assert registry.EXTRAS == {"sagemaker": "aws", "vertex": "gcp", "azureml": "azure", "kubernetes": "kubernetes"}
    assert registry.SDK_PACKAGES["kubernetes"] == "kubernetes"
    for kind in ("sagemaker", "vertex", "azureml", "kubernetes", "ray"):
        cls = registry.backend_class(kind)
        assert cls.kind == kind and cls.queue == "celery"  # cloud calls run on the default workers


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(InvalidSpec) as err:
        registry.backend_class("lambda-labs")
    assert str(err.value) == "unknown backend kind 'lambda-labs'; known kinds: azureml, gpubox, kubernetes, ray, sagemaker, slurm, vertex."


def test_missing_sdk_names_the_extra(monkeypatch):
    monkeypatch.setitem(
        registry.KINDS, "fakecloud",
        registry.KindInfo("trainboard_no_such_sdk_module", "FakeBackend", "Fake Cloud"),
    )
    monkeypatch.setitem(registry.EXTRAS, "fakecloud", "fake")
    with pytest.raises(MissingDependency) as err:
        registry.backend_class("fakecloud")
    assert "trainboard_no_such_sdk_module" in str(err.value)
    assert "install fake with `pip install -r requirements.txt`" in str(err.value)
    assert registry.SDK_PACKAGES["aws"] == "boto3"


def test_create_backend_cleans_config(tmp_path):
    backend = registry.create_backend(
        "gpubox", {"run_root": str(tmp_path), "max_procs_per_node": 3, "hourly_rate_usd": 1.5}
    )
    assert isinstance(backend, Backend)
    assert backend.config["run_root"] == str(tmp_path)
    assert backend.config["max_procs_per_node"] == 3
    assert backend.config["hourly_rate_usd"] == 1.5
    assert backend.config["grace_period_s"] == 10.0
    assert backend.config["python"] == sys.executable
    assert backend.price() == 1.5


@pytest.mark.parametrize(
    "config, field",
    [
        ({}, "run_root"),
        ({"run_root": "relative/runs"}, "run_root"),
        ({"run_root": "/tmp/runs", "hourly_rate_usd": -0.5}, "hourly_rate_usd"),
        ({"run_root": "/tmp/runs", "hourly_rate_usd": "1"}, "hourly_rate_usd"),
        ({"run_root": "/tmp/runs", "max_procs_per_node": "2"}, "max_procs_per_node"),
        ({"run_root": "/tmp/runs", "max_procs_per_node": 1.5}, "max_procs_per_node"),
        ({"run_root": "/tmp/runs", "max_procs_per_node": 0}, "max_procs_per_node"),
        ({"run_root": "/tmp/runs", "max_procs_per_node": True}, "max_procs_per_node"),
        ({"run_root": "/tmp/runs", "grace_period_s": -1}, "grace_period_s"),
        ({"run_root": "/tmp/runs", "python": "python3"}, "python"),
        ({"run_root": "/tmp/runs", "region": "us-east-1"}, "region"),
    ],
)
def test_create_backend_rejects_bad_config_naming_the_field(config, field):
    with pytest.raises(InvalidSpec) as err:
        registry.create_backend("gpubox", config)
    assert list(err.value.errors) == [field]
    label = registry.backend_settings("gpubox").labels.get(field, field)
    assert err.value.errors[field][0].startswith(f"{label}:") and str(err.value).startswith(f"{label}:")


def test_adapters_import_neither_django_nor_torch():
    code = (
        "import sys, cloud_adapters.registry as r; r.create_backend('gpubox', {'run_root': '/tmp/x'});"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'torch'));"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
