"""``trainer_pkg.config``: every error of a config at once, each keyed by its dotted path, and the
field metadata (label, help, default, bounds, choices) the dashboard's front doors are built from."""

from __future__ import annotations

import dataclasses

import pytest

from trainer_pkg.config import (MAXIMA, MINIMA, ConfigError, JobConfig, TrainConfig, check_config, config_fields,
                                field_docs)


def test_from_dict_reports_every_unknown_and_mistyped_field_at_once_by_path():
    with pytest.raises(ConfigError) as caught:
        JobConfig.from_dict({"train": {"lr": "fast", "epochs": "3", "bogus": 1}, "parallel": {"cpu_offload": "yes"},
                             "data": 7, "nope": {}})
    assert caught.value.errors == {
        "nope": "unknown field (known: code, data, model, output, parallel, train)",
        "train.bogus": "unknown field (known: augment, batch_size, compile, epochs, find_unused_parameters, "
                       "grad_accum_steps, grad_clip_norm, init_from, init_mode, log_every_s, log_every_steps, lr, "
                       "lr_schedule, max_steps, momentum, on_nonfinite_loss, optimizer, precision, seed, "
                       "stop_check_s, warmup_steps, weight_decay)",
        "train.lr": "expected a number, got 'fast'",
        "train.epochs": "expected an integer, got '3'",
        "parallel.cpu_offload": "expected true or false, got 'yes'",
        "data": "expected an object, got int",
    }
    # The text leads with the first error (what a log line or a trainer's exit shows), then the rest.
    assert str(caught.value).startswith("nope: unknown field")
    assert "; train.lr: expected a number, got 'fast'; " in str(caught.value)


def test_from_dict_of_a_valid_config_is_unchanged():
    cfg = JobConfig.from_dict({"train": {"lr": 0.1, "epochs": 2}, "parallel": {"strategy": "fsdp"}})
    assert (cfg.train.lr, cfg.train.epochs, cfg.parallel.strategy, cfg.train.batch_size) == (0.1, 2, "fsdp", 32)


def test_check_config_joins_type_and_range_errors_without_raising():
    config, errors = check_config({"train": {"lr": "x", "epochs": 0, "momentum": 1.5},
                                   "parallel": {"nodes": 0, "strategy": "tp"}, "data": {"val_fraction": 1}})
    assert config is None
    assert errors == {
        "train.lr": "expected a number, got 'x'",
        "parallel.strategy": "must be one of 'ddp', 'fsdp', 'pipeline', got 'tp'",
        "train.epochs": "must be at least 1, got 0",
        "train.momentum": "must be in [0, 1), got 1.5",
        "parallel.nodes": "must be at least 1, got 0",
        "data.val_fraction": "must be between 0 and 1 (exclusive), got 1.0",
    }
    config, errors = check_config({"train": {"epochs": 5}})
    assert errors == {} and config.train.epochs == 5 and config == JobConfig(train=TrainConfig(epochs=5))
    assert check_config("[]") == (None, {"config": "expected an object, got str"})


def test_field_metadata_comes_from_the_dataclasses():
    fields = config_fields()
    lr, epochs, strategy = fields["train.lr"], fields["train.epochs"], fields["parallel.strategy"]
    assert (lr.kind, lr.default, lr.label, lr.help, lr.minimum) == ("float", 0.05, "Learning rate",
                                                                    "Peak learning rate.", None)
    assert (epochs.kind, epochs.default, epochs.label, epochs.minimum, epochs.maximum) == ("int", 3, "Epochs", 1,
                                                                                           100_000)
    assert (strategy.kind, strategy.default, strategy.choices) == ("choice", "ddp", ("ddp", "fsdp", "pipeline"))
    ac = fields["parallel.activation_checkpointing"]
    assert (ac.kind, ac.default, ac.label, ac.name) == ("bool", False, "Activation checkpointing",
                                                        "activation_checkpointing")
    assert ac.help == field_docs(type(JobConfig().parallel))["activation_checkpointing"]
    assert fields["output.checkpoint_format"].choices == ("full", "sharded")
    assert (fields["model.params"].kind, fields["code.args"].kind) == ("dict", "list")
    # Every leaf field, section by section in declaration order.
    expected = [f"{s.name}.{f.name}" for s in dataclasses.fields(JobConfig)
                for f in dataclasses.fields(getattr(JobConfig(), s.name))]
    assert list(fields) == expected and len(expected) == 55


@pytest.mark.parametrize("path", sorted(MINIMA))
def test_each_declared_minimum_is_the_one_the_checks_enforce(path):
    """A form built from ``MINIMA`` refuses exactly what the trainer refuses: the minimum passes the
    config's checks, one below it does not (the shape checks hold pipeline_stages and microbatches)."""
    from trainer_pkg.world_shape import config_errors

    section, name = path.split(".")
    low = MINIMA[path]
    step = 1 if isinstance(low, int) else 0.5
    base = {"data": {"format": "tokens", "uri": "/d"}} if path.startswith("data.") else {}

    def errors_at(value):
        cfg = JobConfig.from_dict({**base, section: {**base.get(section, {}), name: value}})
        return config_errors(cfg)

    assert path not in errors_at(low)
    assert path in errors_at(low - step)
    assert path not in MAXIMA or MAXIMA[path] > low
