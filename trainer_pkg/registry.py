"""The model registry: which architectures exist and which parameters each one takes.

Torch-free on purpose: the dashboard imports this module to build its model form and to validate a
job before it is queued, and the web process does not install torch. ``trainer_pkg.models`` turns a
validated ``(arch, params)`` pair into an ``nn.Module``.

:data:`ARCHITECTURES` holds the built-in models only (the dashboard's model form lists them). The
config's other architecture, :data:`CUSTOM` (``"custom"``), is the user's own model, built by
``model.entry_point`` from the user's code (:mod:`trainer_pkg.user_model`): its parameters are any
JSON object (the entry point's keyword arguments), it has no input-shape rule, and its pipeline layer
count is known only once it is built (:func:`pipeline_layer_count` returns None).

Usage::

    from trainer_pkg.registry import ARCHITECTURES, validate_model_params
    params = validate_model_params("cnn", {"channels": 32})   # -> every parameter, defaults filled
    for name, spec in ARCHITECTURES.items():
        print(name, spec.description, [p.name for p in spec.params])
"""

from __future__ import annotations

import dataclasses
import keyword
from typing import Any, Callable, Mapping, Sequence

from trainer_pkg.config import ConfigError


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One architecture parameter, as the form shows it and the validator checks it."""

    name: str
    """Key in ``ModelConfig.params``."""
    type: type
    """``int``, ``float`` or ``bool``. An int is accepted for a float; a bool never for a number."""
    default: Any
    """Value used when the parameter is absent."""
    min: float | None = None
    """Inclusive lower bound (numbers only); None means unbounded."""
    max: float | None = None
    """Inclusive upper bound (numbers only); None means unbounded."""
    doc: str = ""
    """One line for the form's help text."""

    def check(self, value: Any, arch: str) -> Any:
        """Return ``value`` converted to this parameter's type, or raise :class:`ConfigError`."""
        where = f"model.params.{self.name}"
        if self.type is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false, got {value!r}")
            return value
        if isinstance(value, bool):  # bool is a subclass of int; True is not a layer count
            raise ConfigError(f"{where}: expected {_type_word(self.type)}, got {value!r}")
        if self.type is int and not isinstance(value, int):
            raise ConfigError(f"{where}: expected {_type_word(int)}, got {value!r}")
        if self.type is float:
            if not isinstance(value, (int, float)):
                raise ConfigError(f"{where}: expected {_type_word(float)}, got {value!r}")
            value = float(value)
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise ConfigError(
                f"{where}: {value!r} is out of range for {arch} (allowed {self.min} to {self.max})"
            )
        return value


def _type_word(t: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false"}[t]


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """An architecture the trainer can build."""

    name: str
    description: str
    """One line for the form's architecture picker."""
    params: tuple[ParamSpec, ...]
    input_kind: str
    """``"image"`` (needs (C, H, W) input), ``"any"`` (flattens whatever it gets) or ``"tokens"``
    (a language model: (seq_len,) windows of token ids from a ``tokens`` dataset); checked by
    :func:`check_input_shape`."""
    pipeline_layers: Callable[[Mapping[str, Any]], int]
    """The layer count for pipeline parallelism from validated params (every parameter present):
    how many consecutive pieces the built model splits into, one per layer with weights (a conv
    block, a residual block, a Linear). Equals ``len(trainer_pkg.models.pipeline_units(...))`` of
    the built model (a test builds each architecture to hold it to that)."""
    cross_check: Callable[[Mapping[str, Any]], tuple[str, str] | None] = lambda p: None
    """A rule between parameters on validated params: None when they agree, else (parameter name,
    message) for :func:`validate_model_params` to raise."""

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form of this spec (for the dashboard's forms and the API schema)."""
        return {
            "name": self.name,
            "description": self.description,
            "input_kind": self.input_kind,
            "params": [
                {"name": p.name, "type": p.type.__name__, "default": p.default, "min": p.min,
                 "max": p.max, "doc": p.doc}
                for p in self.params
            ],
        }


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec(
            name="mlp",
            description="Multi-layer perceptron over the flattened input; fits tables (CSV) and small images.",
            input_kind="any",
            params=(
                ParamSpec("hidden_size", int, 128, 1, 8192, "Units in each hidden layer."),
                ParamSpec("num_layers", int, 2, 1, 16, "Hidden layers (each Linear → ReLU → Dropout)."),
                ParamSpec("dropout", float, 0.0, 0.0, 0.9, "Dropout probability after each hidden layer."),
            ),
            pipeline_layers=lambda p: p["num_layers"] + 1,  # hidden Linears, classifier
        ),
        ArchSpec(
            name="cnn",
            description="Small convolutional net (conv blocks, 2×2 average pooling, hidden layer, linear head) for images.",
            input_kind="image",
            params=(
                ParamSpec("channels", int, 32, 1, 1024, "Output channels of the first conv block; doubles each block."),
                ParamSpec("num_blocks", int, 2, 1, 6, "Conv blocks (conv 3×3 → BatchNorm → ReLU, max-pool between blocks)."),
                ParamSpec("hidden_size", int, 64, 1, 8192, "Units of the hidden layer before the classifier."),
                ParamSpec("dropout", float, 0.0, 0.0, 0.9, "Dropout probability before the classifier."),
            ),
            pipeline_layers=lambda p: p["num_blocks"] + 2,  # conv blocks, hidden Linear, classifier
        ),
        ArchSpec(
            name="resnet",
            description="Small ResNet (basic residual blocks with BatchNorm) for images.",
            input_kind="image",
            params=(
                ParamSpec("width", int, 16, 1, 512, "Channels of the first stage; doubles at each later stage."),
                ParamSpec("num_stages", int, 3, 1, 5, "Stages; each after the first halves the spatial size."),
                ParamSpec("blocks_per_stage", int, 1, 1, 8, "Residual blocks in each stage."),
            ),
            # stem, residual blocks, classifier
            pipeline_layers=lambda p: 1 + p["num_stages"] * p["blocks_per_stage"] + 1,
        ),
        ArchSpec(
            name="gpt",
            description="Decoder-only transformer language model (GPT-2 layout) over a tokens dataset; "
                        "the vocabulary is the dataset's.",
            input_kind="tokens",
            params=(
                ParamSpec("layers", int, 4, 1, 256, "Transformer blocks (GPT-2 124M: 12)."),
                ParamSpec("heads", int, 4, 1, 256, "Attention heads per block; must divide embed_dim (GPT-2 124M: 12)."),
                ParamSpec("embed_dim", int, 128, 8, 65536, "Width of the token embeddings and of every block (GPT-2 124M: 768)."),
                ParamSpec("context_length", int, 128, 2, 131072,
                          "Most tokens the model attends over (position embeddings); data.seq_len may not exceed it."),
                ParamSpec("dropout", float, 0.0, 0.0, 0.9, "Dropout probability on embeddings, attention and MLP outputs."),
                ParamSpec("tied_embeddings", bool, True, doc="Share the token embedding matrix with the output layer "
                                                             "(GPT-2 does); pipeline needs it off."),
                ParamSpec("bias", bool, True, doc="Biases in the Linear and LayerNorm layers (GPT-2 has them)."),
            ),
            pipeline_layers=lambda p: p["layers"] + 2,  # embeddings, blocks, final LayerNorm + output layer
            cross_check=lambda p: None if p["embed_dim"] % p["heads"] == 0 else (
                "embed_dim", f"{p['embed_dim']} is not divisible by heads {p['heads']} (each head takes "
                             f"embed_dim / heads channels): use a multiple of {p['heads']}, e.g. "
                             f"{max(p['heads'], p['embed_dim'] // p['heads'] * p['heads'])}, or change heads"),
        ),
    )
}

TOKENS_FORMAT = "tokens"
"""``data.format`` of token datasets: only a ``tokens`` architecture reads them."""


CUSTOM = "custom"
"""``model.arch`` of a user's model (``model.entry_point``); not in :data:`ARCHITECTURES`."""

TRAINER_ARGUMENTS = ("num_classes", "input_shape")
"""The keyword arguments the trainer itself passes a custom model's entry point (from the dataset)."""


def get_arch(arch: str) -> ArchSpec:
    """The :class:`ArchSpec` named ``arch``; :class:`ConfigError` listing the known ones otherwise."""
    try:
        return ARCHITECTURES[arch]
    except (KeyError, TypeError):
        raise ConfigError(
            f"model.arch: unknown architecture {arch!r} (known: {', '.join(sorted(ARCHITECTURES))})"
        ) from None


def validate_model_params(arch: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check ``params`` for ``arch`` and return a new dict with every parameter, defaults filled in.

    Raises :class:`ConfigError` naming the parameter for an unknown name (listing the known ones),
    a wrong type or a value out of bounds, and for an unknown architecture.

    For :data:`CUSTOM` any JSON object is accepted as it is (no defaults: the entry point has its
    own); :class:`ConfigError` when ``params`` is not an object, a key is not a Python identifier, or
    a key is one the trainer passes itself (:data:`TRAINER_ARGUMENTS`).
    """
    if arch == CUSTOM:
        return _custom_params(params)
    spec = get_arch(arch)
    params = dict(params or {})
    by_name = {p.name: p for p in spec.params}
    unknown = sorted(set(params) - set(by_name))
    if unknown:
        raise ConfigError(
            f"model.params.{unknown[0]}: unknown parameter for {arch} "
            f"(known: {', '.join(sorted(by_name))})"
        )
    out = spec.defaults()
    for name, value in params.items():
        out[name] = by_name[name].check(value, arch)
    broken = spec.cross_check(out)
    if broken:
        raise ConfigError(f"model.params.{broken[0]}: {broken[1]}")
    return out


def check_input_shape(arch: str, sample_shape: Sequence[int | None], *, data_format: str | None = None,
                      params: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`ConfigError` when ``arch`` cannot take samples of ``sample_shape`` (one sample,
    without the batch dimension: (C, H, W) for images, (F,) for tables, (seq_len,) token ids for a
    ``tokens`` dataset; None for a size the job sets, as an ImageFolder's H and W). An ``image``
    architecture needs three dimensions (C, H, W); an ``any`` one flattens whatever it gets; a
    ``tokens`` one (``gpt``) needs 1-D samples of a ``tokens`` dataset, at most its
    ``context_length`` (from ``params``, defaults filled) long.

    ``data_format`` (``data.format``), when known: token data (``"tokens"``) is refused by every
    classifier, and any other format by ``gpt``. The message names both shapes (or the format and
    what to use instead). Also raises for an unknown architecture, as :func:`get_arch`, and for
    invalid ``params``, as :func:`validate_model_params`.
    """
    if arch == CUSTOM:
        return  # the user's model says what it takes: the trainer's first-batch check tells
    spec = get_arch(arch)
    shape = tuple(sample_shape)
    shown = "(" + ", ".join("?" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
    if spec.input_kind == "tokens":
        if data_format is not None and data_format != TOKENS_FORMAT:
            raise ConfigError(f"model.arch: {arch} is a language model and reads a {TOKENS_FORMAT} dataset "
                              f"(token ids, made by prepare_text), but this dataset's format is {data_format}; "
                              "use a classifier (mlp, cnn, resnet) for it")
        if len(shape) != 1:
            raise ConfigError(f"model.arch: {arch} needs windows of token ids, samples of shape (seq_len,), "
                              f"but the dataset's samples have shape {shown}; give it a {TOKENS_FORMAT} dataset")
        context = validate_model_params(arch, params)["context_length"]
        if shape[0] is not None and shape[0] > context:
            raise ConfigError(f"data.seq_len: windows of {shape[0]:,} tokens are longer than the model's "
                              f"context_length {context:,}; set data.seq_len to at most {context:,} (0 = "
                              "context_length) or raise model.params.context_length")
        return
    if data_format == TOKENS_FORMAT:
        raise ConfigError(f"model.arch: {arch} is a classifier, but a {TOKENS_FORMAT} dataset holds token ids for a "
                          "language model; use gpt")
    if spec.input_kind == "image" and len(shape) != 3:
        raise ConfigError(
            f"model.arch: {arch} needs image inputs of shape (C, H, W), but the dataset's samples have "
            f"shape {shown}; use mlp for tabular data"
        )


def seq_len_for(seq_len: int, arch: str, params: Mapping[str, Any] | None) -> int:
    """Tokens per training window of a job: ``data.seq_len``, or when it is 0 the ``gpt`` model's
    ``context_length`` (defaults filled). 0 stays 0 for an architecture without a context length (a
    custom model must be given ``data.seq_len``). Raises :class:`ConfigError` like
    :func:`validate_model_params`."""
    if seq_len or arch == CUSTOM or get_arch(arch).input_kind != "tokens":
        return seq_len
    return validate_model_params(arch, params)["context_length"]


def pipeline_layer_count(arch: str, params: Mapping[str, Any] | None) -> int | None:
    """How many consecutive pieces ``arch`` with ``params`` splits into for pipeline parallelism: at
    most this many stages (:attr:`ArchSpec.pipeline_layers`), computed without torch. None for
    :data:`CUSTOM`: only the built model knows (the trainer checks it after building).

    Raises :class:`ConfigError` like :func:`validate_model_params`.
    """
    if arch == CUSTOM:
        validate_model_params(arch, params)
        return None
    return get_arch(arch).pipeline_layers(validate_model_params(arch, params))


def _custom_params(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"model.params: a custom model's parameters are a JSON object (the entry point's "
                          f"keyword arguments), got {type(params).__name__} {params!r}")
    for name in params:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ConfigError(f"model.params.{name}: not a Python keyword argument name (letters, digits and "
                              "_, not starting with a digit)")
        if name in TRAINER_ARGUMENTS:
            raise ConfigError(f"model.params.{name}: the trainer passes {name} itself (from the dataset); "
                              "remove it from the parameters")
    return dict(params)


def parse_entry_point(entry_point: str) -> tuple[str, str]:
    """``"tinyformer.model:build"`` → ``("tinyformer.model", "build")``: the module to import and the
    function in it. Raises :class:`ConfigError` for anything else, e.g. ``tinyformer.model.build``
    or an empty string, with an example of the form."""
    module, sep, function = entry_point.strip().partition(":")
    names = module.split(".") + [function]
    if not sep or not all(n.isidentifier() and not keyword.iskeyword(n) for n in names):
        shown = repr(entry_point) if entry_point else "empty"
        raise ConfigError(f"model.entry_point: {shown} is not package.module:function (e.g. "
                          "tinyformer.model:build, the module importable from the code archive's top level)")
    return module, function


def model_errors(model: Any) -> dict[str, str]:
    """The errors of a ``ModelConfig`` that the registry can see without torch, keyed by dotted
    field name; empty when there are none: a custom model's entry point and parameters, and an entry
    point set on a built-in architecture (which would be silently ignored)."""
    errs: dict[str, str] = {}
    for check in (lambda: validate_model_params(model.arch, model.params),
                  lambda: parse_entry_point(model.entry_point) if model.arch == CUSTOM else None):
        try:
            check()
        except ConfigError as exc:
            field, _, message = str(exc).partition(": ")
            errs.setdefault(field, message)
    if model.arch != CUSTOM and model.entry_point:
        errs["model.entry_point"] = (f"only read for a custom model, but model.arch is {model.arch}: clear it, "
                                     "or set model.arch to custom")
    return errs
