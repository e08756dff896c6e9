import pytest

from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.registry import ARCHITECTURES, validate_model_params


def test_every_architecture_is_described_and_has_defaults():
    assert set(ARCHITECTURES) == {"mlp", "cnn", "resnet", "gpt"}
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
        ("transformer", {}, "model.arch: unknown architecture 'transformer' (known: cnn, gpt, mlp, resnet)"),
        ("gpt", {"layers": 0}, "model.params.layers: 0 is out of range for gpt (allowed 1 to 256)"),
        ("gpt", {"context_length": 1}, "model.params.context_length: 1 is out of range for gpt (allowed 2 to 131072)"),
        ("gpt", {"tied_embeddings": 1}, "model.params.tied_embeddings: expected true or false, got 1"),
        ("gpt", {"embed_dim": 100, "heads": 3},
         "model.params.embed_dim: 100 is not divisible by heads 3 (each head takes embed_dim / heads channels): "
         "use a multiple of 3, e.g. 99, or change heads"),
        ("gpt", {"vocab_size": 50257}, "model.params.vocab_size: unknown parameter for gpt (known: bias, "
                                       "context_length, dropout, embed_dim, heads, layers, tied_embeddings)"),
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


def test_gpt_defaults_and_pipeline_layers():
    from trainer_pkg.registry import pipeline_layer_count

    assert validate_model_params("gpt", {}) == {"layers": 4, "heads": 4, "embed_dim": 128, "context_length": 128,
                                                "dropout": 0.0, "tied_embeddings": True, "bias": True}
    assert pipeline_layer_count("gpt", {"layers": 12}) == 14  # embeddings, 12 blocks, head
    assert ARCHITECTURES["gpt"].input_kind == "tokens"


@pytest.mark.parametrize("arch, shape, data_format, params, message", [
    ("gpt", (64,), "tokens", {"context_length": 32},
     "data.seq_len: windows of 64 tokens are longer than the model's context_length 32; set data.seq_len to at "
     "most 32 (0 = context_length) or raise model.params.context_length"),
    ("gpt", (16,), "csv", None,
     "model.arch: gpt is a language model and reads a tokens dataset (token ids, made by prepare_text), but this "
     "dataset's format is csv; use a classifier (mlp, cnn, resnet) for it"),
    ("gpt", (1, 8, 8), None, None,
     "model.arch: gpt needs windows of token ids, samples of shape (seq_len,), but the dataset's samples have "
     "shape (1, 8, 8); give it a tokens dataset"),
    ("mlp", (128,), "tokens", None,
     "model.arch: mlp is a classifier, but a tokens dataset holds token ids for a language model; use gpt"),
    ("cnn", (128,), "tokens", None,
     "model.arch: cnn is a classifier, but a tokens dataset holds token ids for a language model; use gpt"),
])
def test_check_input_shape_keeps_token_data_and_language_models_together(arch, shape, data_format, params, message):
    from trainer_pkg.registry import check_input_shape

    with pytest.raises(ConfigError) as err:
        check_input_shape(arch, shape, data_format=data_format, params=params)
    assert str(err.value) == message


def test_gpt_accepts_its_windows_and_seq_len_defaults_to_the_context_length():
    from trainer_pkg.registry import check_input_shape, seq_len_for

    check_input_shape("gpt", (128,), data_format="tokens")
    check_input_shape("gpt", (None,), data_format="tokens")  # seq_len set by the job
    check_input_shape("mlp", (16,), data_format="csv")
    assert seq_len_for(0, "gpt", {"context_length": 256}) == 256
    assert seq_len_for(64, "gpt", {"context_length": 256}) == 64
    assert seq_len_for(0, "mlp", {}) == 0


def test_pipeline_of_gpt_needs_untied_embeddings():
    from trainer_pkg.world_shape import config_errors

    cfg = JobConfig.from_dict({"model": {"arch": "gpt"}, "data": {"format": "tokens", "uri": "/data/tok"},
                               "parallel": {"strategy": "pipeline", "procs_per_node": 2}})
    assert config_errors(cfg) == {"model.params.tied_embeddings": (
        "pipeline puts the token embedding on the first stage and the output layer on the last, so they cannot "
        "share one weight: set tied_embeddings to false, or use strategy ddp or fsdp")}
    cfg.model.params = {"tied_embeddings": False}
    assert config_errors(cfg) == {}
    cfg.parallel.strategy = "fsdp"
    cfg.model.params = {}
    assert config_errors(cfg) == {}


def test_the_trainer_refuses_a_classifier_on_token_data_before_opening_it():
    from trainer_pkg.world_shape import data_model_errors

    cnn = JobConfig.from_dict({"model": {"arch": "cnn"}, "data": {"format": "tokens", "uri": "/nowhere"}})
    assert data_model_errors(cnn) == {"model.arch": "cnn is a classifier, but a tokens dataset holds token ids "
                                                    "for a language model; use gpt"}
    gpt = JobConfig.from_dict({"model": {"arch": "gpt"}, "data": {"format": "builtin"}})
    assert data_model_errors(gpt) == {"model.arch": (
        "gpt is a language model and reads a tokens dataset (token ids, made by prepare_text), but this "
        "dataset's format is builtin; use a classifier (mlp, cnn, resnet) for it")}
    gpt.data.format, gpt.data.uri = "tokens", "/data/tok"
    assert data_model_errors(gpt) == {} and data_model_errors(JobConfig()) == {}
