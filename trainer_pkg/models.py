"""Torch modules for the architectures declared in :mod:`trainer_pkg.registry`.

``build_model(arch, params, input_shape, num_classes)`` is the one entry; ``params`` is validated (and
completed with defaults) here too, so a caller can pass the raw ``ModelConfig.params``. For arch
``custom`` it calls the user's ``entry_point`` (:mod:`trainer_pkg.user_model`).

``gpt`` is a language model: it maps (B, T) int64 token ids to (B, T, V) logits over the
vocabulary (``num_classes`` = the dataset's ``vocab_size``, ``input_shape`` = (seq_len,)).

Every built-in model also lists its layers in execution order (:func:`sequential_layers`): applying
them one after another is exactly ``model(x)``. Pipeline parallelism splits that list into
consecutive stages (:mod:`trainer_pkg.parallel`), and FSDP shards each of its layers separately. A
custom model lists them the same way (a ``layers()`` method), or is an ``nn.Sequential``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainer_pkg.config import ConfigError
from trainer_pkg.registry import CUSTOM, check_input_shape, validate_model_params
from trainer_pkg.user_model import build_user_model


def build_model(
    arch: str, params: Mapping[str, Any] | None, input_shape: tuple[int, ...], num_classes: int, *,
    entry_point: str = "", code_dir: str = "",
) -> nn.Module:
    """An ``nn.Module`` mapping a batch of shape (B, *input_shape) to logits (B, num_classes); for
    ``gpt``, token ids (B, T) int64 with T ≤ ``input_shape[0]`` (seq_len) to logits (B, T, num_classes),
    ``num_classes`` being the vocabulary size.

    ``entry_point`` and ``code_dir`` (``model.entry_point``, ``code.dir``) are read for arch
    ``custom`` only: :func:`trainer_pkg.user_model.build_user_model` imports and calls the user's
    function and raises :class:`trainer_pkg.user_model.UserCodeError` for whatever goes wrong in it.

    Raises :class:`ConfigError` for invalid params, or an image architecture given non-image input
    (:func:`trainer_pkg.registry.check_input_shape`, the check the dashboard makes at launch).
    """
    p = validate_model_params(arch, params)
    input_shape = tuple(int(s) for s in input_shape)
    if num_classes < 2:
        raise ConfigError(f"the dataset has {num_classes} class(es): classification needs at least 2")
    if arch == CUSTOM:
        return build_user_model(entry_point, code_dir, p, input_shape=input_shape, num_classes=num_classes)
    check_input_shape(arch, input_shape, params=p)
    if arch == "mlp":
        return MLPClassifier(math.prod(input_shape), num_classes, **p)
    if arch == "cnn":
        return CNN(input_shape[0], num_classes, **p)
    if arch == "resnet":
        return ResNet(input_shape[0], num_classes, **p)
    if arch == "gpt":
        return GPT(vocab_size=num_classes, **p)
    raise ConfigError(f"model.arch: {arch} is registered but has no builder")  # a registry bug


def sequential_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in execution order, each with its qualified name inside ``model``: what
    its ``layers()`` method returns, else an ``nn.Sequential``'s children.

    Running them one after another on a batch must equal ``model(batch)`` (the model's promise: it
    cannot be checked without running them); the names are the prefixes of the model's
    ``state_dict`` keys, so a stage built from a slice of the list maps back to them. Checked here:
    each item is a ``(name, module)`` pair whose name is that module's path in ``model``
    (``model.get_submodule(name)``), and every parameter and buffer lies in exactly one listed layer.

    Raises :class:`ConfigError` for a model that lists no layers ("pipeline needs an nn.Sequential or
    a layers() method") or lists them wrongly, naming the item or the state-dict keys at fault.
    """
    layers = getattr(model, "layers", None)
    if callable(layers) and not isinstance(layers, nn.Module):  # self.layers = nn.ModuleList is no list
        pairs, source = list(layers()), f"{type(model).__name__}.layers()"
    elif isinstance(model, nn.Sequential):
        pairs, source = list(model.named_children()), f"{type(model).__name__} (an nn.Sequential)"
    else:
        raise ConfigError(
            f"{type(model).__name__} cannot be split into pipeline stages: pipeline needs an nn.Sequential or "
            "a layers() method returning (name, module) pairs in execution order; or use strategy ddp or fsdp")
    return _checked_layers(model, pairs, source)


def _checked_layers(model: nn.Module, pairs: list[Any], source: str) -> list[tuple[str, nn.Module]]:
    covered: dict[str, str] = {}  # state-dict key -> the layer holding it
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], nn.Module)):
            raise ConfigError(f"{source} item {i} is {type(pair).__name__} {pair!r:.80}, not a (name, module) pair")
        name, layer = pair
        try:
            found = model.get_submodule(name) if name else None
        except AttributeError:
            found = None
        if found is not layer:
            raise ConfigError(f"{source} item {i} is named {name!r}, but that is not its path in the model "
                              "(names must be the attribute paths of model.named_modules(), e.g. blocks.0)")
        for key in layer.state_dict():
            full = f"{name}.{key}"
            if full in covered:
                raise ConfigError(f"{source}: {full} is in two listed layers ({covered[full]} and {name})")
            covered[full] = name
    missing = [k for k in model.state_dict() if k not in covered]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(f"{source} leaves out {shown}: every parameter and buffer must be in one listed layer "
                          "(a pipeline stage holds only its layers)")
    return list(pairs)


def pipeline_units(layers: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """``layers`` grouped into the smallest pieces a pipeline stage boundary may fall between.

    A piece starts at a layer with parameters and takes the parameter-free layers after it
    (activations, pooling, dropout); a normalization layer stays with the layer before it, and
    leading parameter-free layers (a ``Flatten``) join the first piece. So a stage never starts with
    an in-place activation on the activations it receives. :func:`trainer_pkg.registry.pipeline_layer_count`
    predicts ``len(pipeline_units(...))`` without torch.
    """
    units: list[list[tuple[str, nn.Module]]] = []
    for name, layer in layers:
        starts = any(True for _ in layer.parameters()) and not isinstance(layer, _BatchNorm)
        if starts or not units:
            if units and not any(any(True for _ in m.parameters()) for _, m in units[-1]):
                units[-1].append((name, layer))  # only parameter-free layers so far: extend them
            else:
                units.append([(name, layer)])
        else:
            units[-1].append((name, layer))
    return units


class MLPClassifier(nn.Module):
    """``mlp``: Linear → ReLU → Dropout hidden layers over the flattened input, then a Linear classifier."""

    def __init__(self, in_features: int, num_classes: int, hidden_size: int, num_layers: int, dropout: float):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden_size), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            width = hidden_size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)

    def layers(self) -> list[tuple[str, nn.Module]]:
        return [(f"net.{i}", m) for i, m in enumerate(self.net)]


class CNN(nn.Module):
    """Conv blocks (3×3 conv → BatchNorm → ReLU, 2× max-pool between blocks), channels doubling per
    block, then adaptive average pooling to 2×2 (keeps the coarse layout a digit needs), a hidden
    layer and the classifier. Works for any image size ≥ 1 pixel."""

    def __init__(self, in_channels: int, num_classes: int, channels: int, num_blocks: int,
                 hidden_size: int, dropout: float):
        super().__init__()
        layers: list[nn.Module] = []
        c_in = in_channels
        for i in range(num_blocks):
            c_out = channels * 2**i
            if i > 0:
                # ceil_mode keeps a 1-pixel map at 1 pixel instead of shrinking it to nothing.
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c_in * 4, hidden_size),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden_size, num_classes),
        )

    def forward(self, x):
        return self.head(self.pool(self.features(x)))

    def layers(self) -> list[tuple[str, nn.Module]]:
        return ([(f"features.{i}", m) for i, m in enumerate(self.features)] + [("pool", self.pool)]
                + [(f"head.{i}", m) for i, m in enumerate(self.head)])


class BasicBlock(nn.Module):
    """Two 3×3 convs with BatchNorm and an identity (or 1×1 projection) shortcut (He et al. 2016)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet: 3×3 stem, ``num_stages`` stages of basic blocks (stride 2 entering each stage
    after the first, channels doubling), global average pooling, linear classifier."""

    def __init__(self, in_channels: int, num_classes: int, width: int, num_stages: int, blocks_per_stage: int):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        blocks: list[nn.Module] = []
        c_in = width
        for stage in range(num_stages):
            c_out = width * 2**stage
            for b in range(blocks_per_stage):
                blocks.append(BasicBlock(c_in, c_out, stride=2 if stage > 0 and b == 0 else 1))
                c_in = c_out
        self.stages = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))

    def layers(self) -> list[tuple[str, nn.Module]]:
        return ([(f"stem.{i}", m) for i, m in enumerate(self.stem)]
                + [(f"stages.{i}", m) for i, m in enumerate(self.stages)]
                + [(f"head.{i}", m) for i, m in enumerate(self.head)])


# -- gpt: a decoder-only transformer language model ----------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions ≤ t only, through
    ``F.scaled_dot_product_attention(is_causal=True)`` (flash or memory-efficient kernels on a GPU)."""

    def __init__(self, embed_dim: int, heads: int, dropout: float, bias: bool):
        super().__init__()
        if embed_dim % heads:
            raise ConfigError(f"model.params.embed_dim: {embed_dim} is not divisible by heads {heads}")
        self.heads, self.dropout = heads, dropout
        self.c_attn = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)  # queries, keys, values of every head
        self.c_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) → (B, T, C)."""
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    """A transformer block's feed-forward part: Linear(C, 4C) → GELU → Linear(4C, C) → Dropout."""

    def __init__(self, embed_dim: int, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(embed_dim, 4 * embed_dim, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * embed_dim, embed_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) → (B, T, C)."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; (B, T, C) → (B, T, C).
    FSDP shards each Block on its own (``model.shard_classes`` ``["Block"]``)."""

    def __init__(self, embed_dim: int, heads: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed_dim, bias=bias)
        self.attn = CausalSelfAttention(embed_dim, heads, dropout, bias)
        self.ln_2 = nn.LayerNorm(embed_dim, bias=bias)
        self.mlp = MLP(embed_dim, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTEmbedding(nn.Module):
    """The first pipeline layer of :class:`GPT`: token ids (B, T) int64 → token plus position
    embeddings, dropped out, (B, T, C)."""

    def __init__(self, vocab_size: int, context_length: int, embed_dim: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, embed_dim)
        self.wpe = nn.Embedding(context_length, embed_dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.wpe.num_embeddings:
            raise ValueError(f"a window of {t} tokens is longer than the model's context_length {self.wpe.num_embeddings}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class GPTHead(nn.Module):
    """The last pipeline layer of :class:`GPT`: final LayerNorm and the output layer, (B, T, C) → logits (B, T, V)."""

    def __init__(self, vocab_size: int, embed_dim: int, bias: bool):
        super().__init__()
        self.ln_f = nn.LayerNorm(embed_dim, bias=bias)
        self.lm_head = nn.Linear(embed_dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """``gpt``: a decoder-only transformer language model in GPT-2's layout (Radford et al. 2019; the
    parameter count of karpathy/nanoGPT's ``model.py``).

    Token ids (B, T) int64, T ≤ ``context_length`` → logits (B, T, ``vocab_size``) for the next token
    at every position; the loss is the mean cross entropy over every token against the ids shifted
    by one (:func:`trainer_pkg.parallel.cross_entropy`). Position t sees tokens ≤ t only.

    Parts (the attributes of GPT-2's description): ``wte`` (V, C) token and ``wpe`` (T, C) position
    embeddings and ``drop``, held by ``embedding`` (:class:`GPTEmbedding`); ``blocks``, ``layers``
    :class:`Block` s; ``ln_f`` and ``lm_head`` (Linear(C, V), no bias), held by ``head``
    (:class:`GPTHead`). With ``tied_embeddings`` ``lm_head.weight`` is ``wte.weight`` (one tensor,
    counted once). The state dict's keys are ``embedding.wte.weight`` … ``blocks.0.attn.c_attn.weight``
    … ``head.lm_head.weight``: the embedding and the head are modules of their own so that a pipeline
    stage can hold each (:meth:`layers`).

    GPT-2 124M (layers 12, heads 12, embed_dim 768, context_length 1024, vocab 50257, tied, bias) has
    124,439,808 parameters. Initialisation as GPT-2: every Linear and Embedding weight normal with
    std 0.02, biases 0, and each residual projection (``c_proj``) std 0.02 / sqrt(2 · layers).
    """

    default_shard_classes = ("Block",)
    """What FSDP shards on its own when ``model.shard_classes`` is empty (:func:`trainer_pkg.parallel.fsdp_units`):
    each block, then the root (embeddings and head; a tied weight must stay in one unit)."""

    def __init__(self, *, vocab_size: int, layers: int, heads: int, embed_dim: int, context_length: int,
                 dropout: float, tied_embeddings: bool, bias: bool):
        super().__init__()
        self.vocab_size, self.context_length = vocab_size, context_length
        self.tied_embeddings = tied_embeddings
        self.embedding = GPTEmbedding(vocab_size, context_length, embed_dim, dropout)
        self.blocks = nn.ModuleList(Block(embed_dim, heads, dropout, bias) for _ in range(layers))
        self.head = GPTHead(vocab_size, embed_dim, bias)
        if tied_embeddings:
            self.head.lm_head.weight = self.embedding.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # GPT-2's names for the parts (the modules themselves live in embedding and head).
    @property
    def wte(self) -> nn.Embedding:
        return self.embedding.wte

    @property
    def wpe(self) -> nn.Embedding:
        return self.embedding.wpe

    @property
    def drop(self) -> nn.Dropout:
        return self.embedding.drop

    @property
    def ln_f(self) -> nn.LayerNorm:
        return self.head.ln_f

    @property
    def lm_head(self) -> nn.Linear:
        return self.head.lm_head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 token ids → (B, T, V) logits. Raises ValueError when T > ``context_length``."""
        x = self.embedding(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def layers(self) -> list[tuple[str, nn.Module]]:
        """Pipeline layers in execution order: the embedding, each block, the head (``layers`` + 2).

        Raises :class:`ConfigError` with tied embeddings: the token embedding and the output layer
        would be one tensor on the first and the last stage."""
        if self.tied_embeddings:
            raise ConfigError("model.params.tied_embeddings: pipeline puts the token embedding on the first stage and "
                              "the output layer on the last, so they cannot share one weight: set tied_embeddings "
                              "to false for strategy pipeline (or use ddp or fsdp)")
        return ([("embedding", self.embedding)] + [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)]
                + [("head", self.head)])
