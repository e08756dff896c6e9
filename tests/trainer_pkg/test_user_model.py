"""A user's own model ("custom", model.entry_point in code.dir) trained by our trainer: real torchrun
runs (2 ranks, gloo, CPU) of a small transformer classifier written here, in tmp_path, as a user
would ship it; and each way the user's code can be wrong failing every rank in seconds, naming it.
"""

from __future__ import annotations

import importlib
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from cloud_adapters.gpubox.backend import _failure_reason
from trainer_helpers import REPO, records, torchrun, write_job
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.models import pipeline_units, sequential_layers
from trainer_pkg.parallel import StageModule, StrategyError, fsdp_units
from trainer_pkg.registry import (
    ARCHITECTURES, CUSTOM, check_input_shape, parse_entry_point, pipeline_layer_count, validate_model_params)
from trainer_pkg.user_model import (
    UserCodeError, build_user_model, check_first_batch, resolve_code_dir, user_traceback)
from trainer_pkg.world_shape import config_errors

MODEL = '''\
"""tinyformer: a transformer classifier over the rows of an image (each row one token)."""
import math

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    def __init__(self, input_shape, width):
        super().__init__()
        self.tokens, self.features = math.prod(input_shape[:-1]), input_shape[-1]
        self.proj = nn.Linear(self.features, width)
        self.pos = nn.Parameter(torch.zeros(self.tokens, width))

    def forward(self, x):
        return self.proj(x.reshape(x.shape[0], self.tokens, self.features)) + self.pos


class Block(nn.Module):
    def __init__(self, width, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, width, num_classes):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(width), nn.Linear(width, num_classes)

    def forward(self, x):
        return self.out(self.ln(x).mean(1))


def build(num_classes, input_shape, width=32, depth=2):
    return nn.Sequential(Embed(input_shape, width), *[Block(width) for _ in range(depth)], Head(width, num_classes))


NOT_A_FUNCTION = 3


def returns_tensor(num_classes, input_shape):
    return torch.zeros(num_classes)


def wrong_head(num_classes, input_shape, width=32):
    return build(5, input_shape, width, depth=1)


def one_layer(num_classes, input_shape):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


class Plain(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def plain(num_classes, input_shape):
    return Plain(build(num_classes, input_shape, depth=1))


def raises_inside(num_classes, input_shape):
    return helper(num_classes)


def helper(n):
    raise ValueError(f"cannot make {n} classes")
'''
BROKEN = "def build(num_classes, input_shape):\n    width = 32\n    return = width\n"  # line 3
NEEDS_DEP = "import not_installed_pkg_xyz\n\n\ndef build(num_classes, input_shape):\n    return None\n"
SHA = "5f" * 32
DIGITS_SHAPE, DIGITS_CLASSES = (1, 8, 8), 10


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory) -> Path:
    """The unpacked code archive: tinyformer/ with the good model and the broken modules."""
    root = tmp_path_factory.mktemp("code")
    pkg = root / "tinyformer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(MODEL)
    (pkg / "broken.py").write_text(BROKEN)
    (pkg / "needs_dep.py").write_text(NEEDS_DEP)
    return root


@pytest.fixture
def tinyformer(code_dir):
    """The user's module imported in this process (as a test would load model.pt with it)."""
    sys.path.insert(0, str(code_dir))
    try:
        yield importlib.import_module("tinyformer.model")
    finally:
        sys.path.remove(str(code_dir))
        for name in [n for n in sys.modules if n == "tinyformer" or n.startswith("tinyformer.")]:
            del sys.modules[name]


def custom_job(tmp_path, code_dir, entry_point, *, strategy="ddp", params=None, shard_classes=None,
               epochs=1, parallel=None):
    model = {"arch": "custom", "entry_point": entry_point, "params": params or {}}
    if shard_classes is not None:
        model["shard_classes"] = shard_classes
    return write_job(tmp_path, model=model, code={"dir": str(code_dir), "sha256": SHA},
                     parallel={"strategy": strategy, "procs_per_node": 2, "timeout_s": 600, **(parallel or {})},
                     train={"epochs": epochs, "batch_size": 32, "optimizer": "adamw", "lr": 0.003, "seed": 1,
                            "log_every_s": 30.0})


# -- training a user's transformer with each strategy --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("strategy, extra", [
    ("ddp", {}),
    ("fsdp", {"shard_classes": ["Block"]}),
    ("pipeline", {"parallel": {"pipeline_stages": 2, "microbatches": 4}}),
])
def test_a_users_transformer_trains_with_each_strategy(tmp_path, code_dir, tinyformer, strategy, extra):
    job = custom_job(tmp_path, code_dir, "tinyformer.model:build", strategy=strategy,
                     params={"width": 32, "depth": 2}, epochs=2, **extra)
    run = torchrun(job, nproc=2, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"user code: sha256 {SHA} in {code_dir}" in run.stdout
    assert "model custom tinyformer.model:build (" in run.stdout

    recs = records(tmp_path / "out")
    epochs = [r for r in recs if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1] and recs[-1]["event"] == "completed"
    assert epochs[-1]["val_accuracy"] >= 0.6, epochs  # 10 classes: chance is 0.1
    assert epochs[-1]["val_loss"] < epochs[0]["val_loss"]
    if strategy == "fsdp":  # the two Blocks on their own, then the root
        assert "; fsdp: 2 submodule(s) sharded on their own (Block), then the root" in run.stdout, [ln for ln in run.stdout.splitlines() if "parameters)" in ln]
    if strategy == "pipeline":
        step = next(r for r in recs if "rank_pipeline_stage" in r)
        assert step["rank_pipeline_stage"] == [0, 1] and step["rank_stage_layers"] == [2, 2]

    # model.pt is the bare state dict of the user's own module
    state = torch.load(tmp_path / "out" / "model.pt", map_location="cpu", weights_only=True)
    fresh = tinyformer.build(num_classes=DIGITS_CLASSES, input_shape=DIGITS_SHAPE, width=32, depth=2)
    assert set(state) == set(fresh.state_dict())
    fresh.load_state_dict(state, strict=True)
    torch.manual_seed(1)
    untrained = tinyformer.build(num_classes=DIGITS_CLASSES, input_shape=DIGITS_SHAPE, width=32, depth=2)
    assert not torch.equal(state["1.qkv.weight"], untrained.state_dict()["1.qkv.weight"])  # it trained


# -- the user's code at fault: every rank fails in seconds, naming the rank and the fault -------------


_LINES = MODEL.splitlines()
CALL_LINE = _LINES.index("    return helper(num_classes)") + 1
RAISE_LINE = _LINES.index('    raise ValueError(f"cannot make {n} classes")') + 1


@pytest.mark.slow
@pytest.mark.parametrize("entry_point, run_with, message, traceback", [
    ("tinyformer.nope:build", {},
     "model.entry_point tinyformer.nope:build: no module tinyformer.nope in code.dir {code} "
     "(its top level: tinyformer/)", None),
    ("tinyformer.broken:build", {},
     "model.entry_point tinyformer.broken:build: importing tinyformer.broken raised {syntax_error}",
     '  File "{code}/tinyformer/broken.py", line 3\n    return = width\nSyntaxError: invalid syntax\n'),
    ("tinyformer.needs_dep:build", {},
     "model.entry_point tinyformer.needs_dep:build: importing tinyformer.needs_dep raised ModuleNotFoundError at "
     "tinyformer/needs_dep.py:1: "
     "No module named 'not_installed_pkg_xyz' (a package the code imports is not installed: list it in the "
     "archive's requirements.txt)",
     "Traceback (most recent call last):\n"
     '  File "{code}/tinyformer/needs_dep.py", line 1, in <module>\n    import not_installed_pkg_xyz\n'
     "ModuleNotFoundError: No module named 'not_installed_pkg_xyz'\n"),
    ("tinyformer.model:NOT_A_FUNCTION", {},
     "model.entry_point tinyformer.model:NOT_A_FUNCTION: tinyformer.model.NOT_A_FUNCTION is the int 3, not a "
     "function: name a function that returns the torch.nn.Module", None),
    ("tinyformer.model:raises_inside", {},
     "model.entry_point tinyformer.model:raises_inside: raises_inside(num_classes=10, input_shape=(1, 8, 8), "
     f"**model.params) raised ValueError at tinyformer/model.py:{RAISE_LINE} (helper): cannot make 10 classes",
     "Traceback (most recent call last):\n"
     f'  File "{{code}}/tinyformer/model.py", line {CALL_LINE}, in raises_inside\n    return helper(num_classes)\n'
     f'  File "{{code}}/tinyformer/model.py", line {RAISE_LINE}, in helper\n'
     '    raise ValueError(f"cannot make {{n}} classes")\n'
     "ValueError: cannot make 10 classes\n"),
    ("tinyformer.model:returns_tensor", {},
     "model.entry_point tinyformer.model:returns_tensor: returns_tensor(num_classes=10, input_shape=(1, 8, 8), "
     "**model.params) returned a torch.Tensor of shape (10,), not a torch.nn.Module", None),
    ("tinyformer.model:wrong_head", {},
     "model.entry_point tinyformer.model:wrong_head: on a first batch of shape (32, 1, 8, 8) the model returned "
     "shape (32, 5); expected (32, 10): (batch, num_classes) logits", None),
    ("tinyformer.model:build", {"strategy": "fsdp", "shard_classes": ["Blok"]},
     "model.shard_classes: no submodule of class 'Blok' in Sequential; its modules' classes are Block, "
     "Embed, GELU, Head, LayerNorm, Linear, Sequential", None),
    ("tinyformer.model:plain", {"strategy": "pipeline"},
     "Plain cannot be split into pipeline stages: pipeline needs an nn.Sequential or a layers() method "
     "returning (name, module) pairs in execution order; or use strategy ddp or fsdp", None),
    ("tinyformer.model:one_layer", {"strategy": "pipeline"},
     "the model has 1 layer; 2 pipeline stages need at least 2: use fewer stages (parallel.pipeline_stages) "
     "or a deeper model", None),
], ids=["module-not-found", "syntax-error", "missing-dependency", "not-callable", "raises-in-the-function",
        "returns-a-tensor", "wrong-output-shape", "unknown-shard-class", "pipeline-not-sequential",
        "pipeline-too-few-layers"])
def test_a_fault_in_the_users_code_fails_every_rank_in_seconds(tmp_path, code_dir, entry_point, run_with, message,
                                                               traceback):
    job = custom_job(tmp_path, code_dir, entry_point, **run_with)
    started = time.monotonic()
    # A rank left waiting in a collective would sit out parallel.timeout_s (600 s). A failing run
    # takes 10-30 s here (torchrun, importing torch, the process group) on a loaded 2-core machine.
    run = torchrun(job, nproc=2, timeout=180)
    elapsed = time.monotonic() - started
    assert run.returncode != 0
    assert elapsed < 120, f"{elapsed:.1f} s"
    try:
        compile(BROKEN, str(code_dir / "tinyformer" / "broken.py"), "exec")
    except SyntaxError as exc:
        syntax_error = f"SyntaxError: {exc}"
    expected = message.format(code=code_dir, syntax_error=syntax_error)
    errors = sorted(line for line in run.stderr.splitlines() if line.startswith("trainer error: "))
    assert errors == [f"trainer error: rank {r}: {expected}" for r in (0, 1)], run.stderr[-4000:]
    assert not (tmp_path / "out" / "model.pt").exists()
    # the GPU box's failure reason (read from the job's log) is one rank's line
    log = tmp_path / "train.log"
    log.write_text(run.stdout + run.stderr)
    assert _failure_reason(log, run.returncode) in {f"trainer error: rank {r}: {expected}" for r in (0, 1)}

    # Where the user's code raised, each rank prints their traceback: their frames, none of ours
    # (Python's ^^^ markers under a frame's line are left out of the comparison).
    stderr = re.sub(r"\n *[~^]+ *(?=\n)", "", run.stderr)
    header = "the user's code raised (frames in the user's files only):\n"
    if traceback is None:
        assert header not in stderr
        return
    shown = traceback.format(code=code_dir)
    for rank in (0, 1):
        block = stderr.split(f"[rank {rank}] {header}")[1].split("trainer error: ")[0]
        block = block.split("[rank ")[0]  # the other rank's block may follow
        assert block == shown
        assert "trainer_pkg" not in block and "torch" not in block


# -- the same checks in this process: loading, first batch, layers, FSDP units, registry ---------------


def test_build_user_model_in_process(code_dir, tinyformer):
    model = build_user_model("tinyformer.model:build", str(code_dir), {"width": 16, "depth": 1},
                             input_shape=DIGITS_SHAPE, num_classes=DIGITS_CLASSES)
    assert isinstance(model, nn.Sequential) and len(model) == 3
    assert sys.path[0] == str(code_dir)
    check_first_batch(model, torch.randn(4, *DIGITS_SHAPE), num_classes=DIGITS_CLASSES,
                      entry_point="tinyformer.model:build", code_dir=str(code_dir))
    with pytest.raises(UserCodeError) as err:
        build_user_model("tinyformer.model:nothing_here", str(code_dir), {}, input_shape=DIGITS_SHAPE,
                         num_classes=DIGITS_CLASSES)
    assert str(err.value).startswith("model.entry_point tinyformer.model:nothing_here: module tinyformer.model "
                                     "(tinyformer/model.py) has no 'nothing_here'; it defines: Block, Embed, Head, ")
    with pytest.raises(UserCodeError, match=r"build\(\) got an unexpected keyword argument 'widht'$") as err:
        build_user_model("tinyformer.model:build", str(code_dir), {"widht": 3}, input_shape=DIGITS_SHAPE,
                         num_classes=DIGITS_CLASSES)
    with pytest.raises(UserCodeError, match=r"^model.entry_point: 'tinyformer.model.build' is not "
                                            r"package.module:function"):
        build_user_model("tinyformer.model.build", str(code_dir), {}, input_shape=DIGITS_SHAPE,
                         num_classes=DIGITS_CLASSES)
    with pytest.raises(UserCodeError, match=r"^code.dir /nonexistent/code is not a directory"):
        build_user_model("tinyformer.model:build", "/nonexistent/code", {}, input_shape=DIGITS_SHAPE,
                         num_classes=DIGITS_CLASSES)


def test_a_relative_code_dir_is_beside_trainer_pkg_and_our_frames_are_never_the_users():
    # SageMaker and Azure ML set code.dir "." (the archive's files beside trainer_pkg/)
    assert resolve_code_dir(".") == str(REPO) and resolve_code_dir("code/x") == str(REPO / "code" / "x")
    assert resolve_code_dir("/abs/dir") == "/abs/dir" and resolve_code_dir("") == ""
    try:
        parse_entry_point("no-colon")  # raises in trainer_pkg/registry.py, which lies under code.dir "."
    except ConfigError as exc:
        shown = user_traceback(exc, ".")
    assert f'File "{Path(__file__).resolve()}"' in shown  # this file lies there too, and is no file of ours
    assert "registry.py\", line" not in shown and shown.count("  File ") == 1
    assert shown.endswith("trainer_pkg.config.ConfigError: model.entry_point: 'no-colon' is not "
                          "package.module:function (e.g. tinyformer.model:build, the module importable from the "
                          "code archive's top level)\n")


def test_a_forward_that_raises_shows_the_users_frames(code_dir, tinyformer):
    model = tinyformer.build(num_classes=10, input_shape=DIGITS_SHAPE, width=16, depth=1)
    with pytest.raises(UserCodeError) as err:
        check_first_batch(model, torch.randn(4, 3, 7), num_classes=10, entry_point="tinyformer.model:build",
                          code_dir=str(code_dir))
    line = _LINES.index("        return self.proj(x.reshape(x.shape[0], self.tokens, self.features)) + self.pos") + 1
    # The reason names where in the user's files it raised (the log has the whole traceback)
    assert str(err.value) == ("model.entry_point tinyformer.model:build: the model's forward on a first batch of "
                              f"shape (4, 3, 7) raised RuntimeError at tinyformer/model.py:{line} (forward): "
                              "shape '[4, 8, 8]' is invalid for input of size 84")
    shown = re.sub(r"\n *[~^]+ *(?=\n)", "", err.value.user_traceback)
    assert shown == ("Traceback (most recent call last):\n"
                     f'  File "{code_dir}/tinyformer/model.py", line {line}, in forward\n'
                     "    return self.proj(x.reshape(x.shape[0], self.tokens, self.features)) + self.pos\n"
                     "RuntimeError: shape '[4, 8, 8]' is invalid for input of size 84\n")  # no torch frames


def test_first_batch_check_names_what_came_back_and_leaves_the_model_as_it_was():
    class TupleOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(x), x

    model = TupleOut()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserCodeError) as err:
        check_first_batch(model, torch.randn(8, 4) * 5 + 3, num_classes=4, entry_point="m:f", code_dir="")
    assert str(err.value) == ("model.entry_point m:f: on a first batch of shape (8, 4) the model returned a tuple; "
                              "expected a tensor of shape (8, 4): (batch, num_classes) logits")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the running statistics are untouched
    assert model.training


def test_pipeline_layers_from_a_layers_method_are_checked():
    class Listed(nn.Module):
        def __init__(self, leave_out=False, wrong_name=False):
            super().__init__()
            self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 3)
            self.leave_out, self.wrong_name = leave_out, wrong_name

        def forward(self, x):
            return self.second(self.first(x))

        def layers(self):
            if self.leave_out:
                return [("first", self.first)]
            return [("first", self.first), ("relu", nn.ReLU()) if self.wrong_name else ("second", self.second)]

    model = Listed()
    assert [n for n, _ in sequential_layers(model)] == ["first", "second"]
    # stages cut from a layers() list compose to the model, and their state dicts map back to its keys
    stages = [StageModule(unit) for unit in pipeline_units(sequential_layers(model))]
    x = torch.randn(3, 4)
    assert torch.equal(stages[1](stages[0](x)), model(x))
    merged = {k: v for stage in stages for k, v in stage.model_state_dict().items()}
    assert merged.keys() == model.state_dict().keys()
    with pytest.raises(ConfigError) as err:
        sequential_layers(Listed(leave_out=True))
    assert str(err.value) == ("Listed.layers() leaves out second.weight, second.bias: every parameter and buffer "
                              "must be in one listed layer (a pipeline stage holds only its layers)")
    with pytest.raises(ConfigError, match=r"^Listed.layers\(\) item 1 is named 'relu', but that is not its path"):
        sequential_layers(Listed(wrong_name=True))

    class Stack(nn.Module):  # an attribute named layers that is a ModuleList is no layers() method
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    with pytest.raises(ConfigError, match=r"^Stack cannot be split into pipeline stages: pipeline needs an "
                                          r"nn.Sequential or a layers\(\) method"):
        sequential_layers(Stack())


def test_fsdp_units_by_class_name(tinyformer):
    model = tinyformer.build(num_classes=10, input_shape=DIGITS_SHAPE, width=16, depth=2)
    blocks = fsdp_units(model, ["Block"], custom=True)
    assert blocks == [model[2], model[1]]  # innermost first: both are leaves among the chosen
    nested = fsdp_units(model, ["Block", "LayerNorm"], custom=True)
    assert nested.index(model[1].ln1) < nested.index(model[1])  # a module before the one containing it
    assert fsdp_units(model, [], custom=True) == list(model.children())
    assert fsdp_units(model, ["Sequential"], custom=True) == [model[2].mlp, model[1].mlp]  # and the root, last anyway
    with pytest.raises(StrategyError, match=r"^model.shard_classes: no submodule of class 'Attention', 'Mlp' in "
                                            r"Sequential; its modules' classes are Block, Embed, GELU, "):
        fsdp_units(model, ["Block", "Attention", "Mlp"], custom=True)


def test_registry_takes_any_object_for_custom_and_lists_builtins_only():
    assert set(ARCHITECTURES) == {"mlp", "cnn", "resnet", "gpt"}  # the dashboard's model form lists these
    params = {"width": 32, "blocks": [1, 2], "name": "tiny", "scale": {"a": 0.5}}
    assert validate_model_params(CUSTOM, params) == params
    assert validate_model_params(CUSTOM, None) == {}
    check_input_shape(CUSTOM, (3,))  # no rule: the first-batch check tells
    assert pipeline_layer_count(CUSTOM, {"depth": 12}) is None
    for bad, message in [
        ([1, 2], "model.params: a custom model's parameters are a JSON object (the entry point's keyword "
                 "arguments), got list [1, 2]"),
        ({"num_classes": 3}, "model.params.num_classes: the trainer passes num_classes itself (from the dataset); "
                             "remove it from the parameters"),
        ({"my-width": 3}, "model.params.my-width: not a Python keyword argument name (letters, digits and _, "
                          "not starting with a digit)"),
    ]:
        with pytest.raises(ConfigError) as err:
            validate_model_params(CUSTOM, bad)
        assert str(err.value) == message
    assert parse_entry_point("tinyformer.model:build") == ("tinyformer.model", "build")
    for bad in ("", "tinyformer.model.build", "tinyformer.model:", "tiny-former:build", "a.class:build", "a:b:c"):
        with pytest.raises(ConfigError, match=r"^model.entry_point: .* is not package.module:function"):
            parse_entry_point(bad)


def test_config_errors_skip_the_layer_count_of_a_custom_model():
    pipeline = {"strategy": "pipeline", "procs_per_node": 4}
    custom = JobConfig.from_dict({"model": {"arch": "custom", "entry_point": "tinyformer.model:build"},
                                  "parallel": pipeline})
    assert config_errors(custom) == {}
    custom.model.entry_point = "tinyformer.model.build"
    assert config_errors(custom) == {"model.entry_point": (
        "'tinyformer.model.build' is not package.module:function (e.g. tinyformer.model:build, the module "
        "importable from the code archive's top level)")}
    builtin = JobConfig.from_dict({"model": {"arch": "mlp", "params": {"num_layers": 1},
                                             "entry_point": "tinyformer.model:build"}, "parallel": pipeline})
    assert config_errors(builtin) == {
        "model.entry_point": "only read for a custom model, but model.arch is mlp: clear it, or set model.arch "
                             "to custom",
        "parallel.pipeline_stages": "4 pipeline stages need at least one layer each, but mlp with these "
                                    "parameters has 2 layers: use fewer stages or a deeper model"}
