"""The world-shape checks: a strategy against the ranks it runs on, with the arithmetic shown."""

from __future__ import annotations

import pytest

from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.world_shape import config_errors, describe_world, shape_errors, validate


def test_shape_errors_show_the_arithmetic():
    cfg = JobConfig.from_dict({"parallel": {"strategy": "pipeline", "nodes": 2, "procs_per_node": 2,
                                            "pipeline_stages": 3}, "train": {"batch_size": 30}})
    errs = config_errors(cfg)
    assert errs["parallel.pipeline_stages"].startswith(
        "2 nodes × 2 processes = 4 ranks; 3 pipeline stages do not divide 4")
    assert errs["parallel.microbatches"].startswith("batch size 30 is not divisible into 4 micro-batches")

    cfg = JobConfig.from_dict({"model": {"arch": "mlp", "params": {"num_layers": 1}},
                               "parallel": {"strategy": "pipeline", "procs_per_node": 4}})
    assert config_errors(cfg) == {"parallel.pipeline_stages": (
        "4 pipeline stages need at least one layer each, but mlp with these parameters has 2 layers: "
        "use fewer stages or a deeper model")}

    cfg = JobConfig.from_dict({"parallel": {"strategy": "pipeline"}})
    assert config_errors(cfg)["parallel.pipeline_stages"].startswith(
        "1 node × 1 process = 1 rank; a pipeline needs at least 2 stages")

    cfg = JobConfig.from_dict({"parallel": {"strategy": "pipeline", "procs_per_node": 4, "pipeline_stages": 2,
                                            "microbatches": 1, "pipeline_schedule": "1f1b"},
                               "model": {"arch": "cnn", "params": {}}})
    assert config_errors(cfg) == {"parallel.microbatches": (
        "the 1f1b schedule needs at least one micro-batch per stage: 1 micro-batches < 2 stages")}
    # 4 ranks as 2 pipelines of 2 stages, and ddp/fsdp never look at the pipeline fields
    cfg.parallel.microbatches = 2
    assert config_errors(cfg) == {}
    for strategy in ("ddp", "fsdp"):
        assert config_errors(JobConfig.from_dict({"parallel": {"strategy": strategy, "procs_per_node": 3},
                                                  "train": {"batch_size": 30}})) == {}


def test_field_errors_leave_the_shape_to_world_shape():
    cfg = JobConfig.from_dict({"parallel": {"strategy": "pipeline", "procs_per_node": 3, "pipeline_stages": 2},
                               "train": {"epochs": 0}})
    assert cfg.field_errors() == {"train.epochs": "must be at least 1, got 0"}
    assert config_errors(cfg) == {
        "train.epochs": "must be at least 1, got 0",
        "parallel.pipeline_stages": ("1 node × 3 processes = 3 ranks; 2 pipeline stages do not divide 3: choose a "
                                     "stage count that divides it (the ranks beyond one pipeline become "
                                     "data-parallel replicas)"),
    }
    with pytest.raises(ConfigError, match=r"^train.epochs: must be at least 1, got 0; parallel.pipeline_stages: 1 node"):
        validate(cfg)
    ok = JobConfig()
    assert validate(ok) is ok


def test_an_invalid_node_count_skips_the_shape_checks():
    cfg = JobConfig.from_dict({"parallel": {"strategy": "pipeline", "nodes": 0, "pipeline_stages": 3}})
    assert config_errors(cfg) == {"parallel.nodes": "must be at least 1, got 0"}


def test_the_trainer_checks_against_the_launchers_world():
    cfg = JobConfig.from_dict({"parallel": {"strategy": "pipeline", "procs_per_node": 4, "pipeline_stages": 2}})
    assert shape_errors(cfg, world_size=4, world_desc=describe_world(1, 4)) == {}
    assert shape_errors(cfg, world_size=3, world_desc="the launcher started 3 rank(s)") == {
        "parallel.pipeline_stages": ("the launcher started 3 rank(s); 2 pipeline stages do not divide 3: choose "
                                     "a stage count that divides it (the ranks beyond one pipeline become "
                                     "data-parallel replicas)")}
    assert describe_world(1, 1) == "1 node × 1 process = 1 rank"
    assert describe_world(2, 4) == "2 nodes × 4 processes = 8 ranks"
