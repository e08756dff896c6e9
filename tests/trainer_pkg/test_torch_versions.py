"""Which torch each strategy needs (trainer_pkg.versions): the trainer refuses at start, with the table,
a strategy its torch is too old for; the adapters read their image's torch and offer only what it runs."""

from __future__ import annotations

import pytest
import torch

from trainer_pkg import train as train_module
from trainer_pkg.config import JobConfig
from trainer_pkg.versions import STRATEGY_MIN_TORCH, parse_torch_version, strategy_torch_error


def test_the_table_and_the_parser():
    assert STRATEGY_MIN_TORCH == {"ddp": (2, 4), "fsdp": (2, 6), "pipeline": (2, 7)}
    assert parse_torch_version("2.13.0+cpu") == (2, 13) and parse_torch_version("2-4") == (2, 4)
    assert parse_torch_version("latest") is None
    assert strategy_torch_error("fsdp", "2.6.0") is None and strategy_torch_error("pipeline", None) is None
    assert strategy_torch_error("pipeline", "2.6.0+cu124", where="this image") == (
        "parallel.strategy pipeline needs torch ≥ 2.7 (torch.distributed.pipelining with scale_grads), but this "
        "image has torch 2.6.0+cu124: use ddp or fsdp, or run on an image with torch ≥ 2.7 (torch ddp ≥ 2.4, "
        "fsdp ≥ 2.6, pipeline ≥ 2.7)")


def test_the_trainer_says_at_start_which_torch_the_strategy_needs(monkeypatch, capfd):
    """An image with torch 2.4 (Vertex's prebuilt pytorch-gpu.2-4) asked for fsdp: the trainer stops before
    any process group with the versions, not with an ImportError from deep inside FSDP."""
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")  # the image's torch, as the trainer reads it
    cfg = JobConfig.from_dict({"parallel": {"strategy": "fsdp"}})
    assert train_module.train(cfg) == 1
    err = capfd.readouterr().err
    assert ("parallel.strategy fsdp needs torch ≥ 2.6 (FSDP2 fully_shard), but this image has torch "
            "2.4.1+cu121: use ddp, or run on an image with torch ≥ 2.6 (torch ddp ≥ 2.4, fsdp ≥ 2.6, "
            "pipeline ≥ 2.7)") in err


@pytest.mark.parametrize("kind, config, strategies", [
    # The defaults: SageMaker's PyTorch 2.8 image, Azure's ACPT 2.8, Vertex's newest prebuilt (2.4: ddp).
    ("sagemaker", {}, ("ddp", "fsdp", "pipeline")),
    ("azureml", {}, ("ddp", "fsdp", "pipeline")),
    ("vertex", {}, ("ddp",)),
    # A version read from the tag.
    ("sagemaker", {"image_uri": "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.6.0-gpu-py312"},
     ("ddp", "fsdp")),
    ("vertex", {"image_uri": "us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.2-7.py310:latest"},
     ("ddp", "fsdp", "pipeline")),
    ("azureml", {"environment": "azureml://registries/azureml/environments/acpt-pytorch-2.2-cuda12.1/labels/latest"},
     ()),
    # A custom image whose torch is unknown is not refused anything.
    ("vertex", {"image_uri": "us-central1-docker.pkg.dev/my-proj/train/trainer:7"}, ("ddp", "fsdp", "pipeline")),
])
def test_a_backend_offers_the_strategies_its_image_runs(kind, config, strategies):
    from cloud_adapters.registry import create_backend

    base = {
        "sagemaker": {"region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/R", "bucket": "tb-bucket"},
        "vertex": {"project": "my-proj", "staging_bucket": "gs://stage/tb"},
        "azureml": {"subscription_id": "00000000-0000-0000-0000-000000000000", "resource_group": "rg",
                    "workspace": "ws-trainboard", "compute": "gpu-cluster"},
    }[kind]
    backend = create_backend(kind, {**base, **config})
    assert backend.capabilities.strategies == strategies
    for strategy in set(STRATEGY_MIN_TORCH) - set(strategies):
        assert backend.strategy_error(strategy).startswith(f"parallel.strategy {strategy} needs torch ≥ ")
