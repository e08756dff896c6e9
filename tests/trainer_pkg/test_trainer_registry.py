import pytest

from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.registry import ARCHITECTURES, validate_model_params


def test_every_architecture_is_described_and_has_defaults():
    assert set(ARCHITECTURES) == {"mlp", "cnn", "resnet"}
    for name, spec in ARCHITECTURES.items():
        assert spec.description and "\n" not in spec.description
        assert validate_model_params(name, {}) == spec.defaults()
        for p in spec.params:
            assert p.doc, f"{name}.{p.name} has no doc"
            assert p.check(p.default, name) == p.default  # every default is within its own bounds


def test_defaults_fill_in_missing_params():
    assert validate_model_params("cnn", {"channels": 8}) == {
        "channels": 8, "num_blocks": 2, "hidden_size": 64, "dropout": 0.0}
    assert validate_model_params("mlp", None)["hidden_size"] == 128


def test_int_accepted_for_float_and_converted():
    out = validate_model_params("mlp", {"dropout": 0})
    assert out["dropout"] == 0.0 and isinstance(out["dropout"], float)


@pytest.mark.parametrize(
    "arch, params, message",
    [
        ("cnn", {"chanels": 8}, "model.params.chanels: unknown parameter for cnn (known: channels, dropout, hidden_size, num_blocks)"),
        ("cnn", {"channels": "8"}, "model.params.channels: expected an integer, got '8'"),
        ("cnn", {"channels": 8.0}, "model.params.channels: expected an integer, got 8.0"),
        ("cnn", {"channels": True}, "model.params.channels: expected an integer, got True"),
        ("mlp", {"dropout": "0.1"}, "model.params.dropout: expected a number, got '0.1'"),
        ("cnn", {"num_blocks": 0}, "model.params.num_blocks: 0 is out of range for cnn (allowed 1 to 6)"),
        ("mlp", {"dropout": 0.95}, "model.params.dropout: 0.95 is out of range for mlp (allowed 0.0 to 0.9)"),
        ("transformer", {}, "model.arch: unknown architecture 'transformer' (known: cnn, mlp, resnet)"),
    ],
)
def test_validation_errors_name_the_parameter(arch, params, message):
    with pytest.raises(ConfigError) as err:
        validate_model_params(arch, params)
    assert str(err.value) == message


def test_registry_names_match_the_config_vocabulary():
    from typing import get_args
    from trainer_pkg.config import Architecture
    from trainer_pkg.registry import CUSTOM

    # the built-in models, and the user's own (reached through its code, not the registry's list)
    assert set(get_args(Architecture)) == set(ARCHITECTURES) | {CUSTOM}
    assert JobConfig().model.arch in ARCHITECTURES


def test_registry_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, trainer_pkg.registry, trainer_pkg.datasets; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_spec_as_dict_is_json_for_forms():
    import json

    spec = json.loads(json.dumps(ARCHITECTURES["resnet"].as_dict()))
    assert spec["name"] == "resnet" and spec["input_kind"] == "image"
    assert spec["params"][0] == {"name": "width", "type": "int", "default": 16, "min": 1, "max": 512,
                                 "doc": "Channels of the first stage; doubles at each later stage."}
