"""In-process pieces of the trainer: sharding masks, checkpoint files, CLI → config."""

import dataclasses
from types import SimpleNamespace

import torch
from torch.utils.data import DistributedSampler

from trainer_pkg.config import JobConfig
from trainer_pkg.sampling import ShardOrder, real_mask
from trainer_pkg.train import (build_parser, cli_flags, config_from_args, load_checkpoint, memory_step_batch,
                               strip_module_prefix)


def test_real_mask_marks_exactly_the_padded_duplicates():
    n, world = 11, 4  # padded to 12: one duplicate, on rank 3
    seen = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0)
        order = list(iter(sampler))
        keep = real_mask(torch.arange(len(order)), rank, world, n)
        seen += [i for i, k in zip(order, keep.tolist()) if k]
        assert keep.sum().item() == (3 if rank < 3 else 2)
    assert sorted(seen) == list(range(n))  # every sample exactly once


def test_shard_order_is_the_distributed_samplers_and_masks_its_padding():
    n, world, batch = 11, 4, 2  # 3 samples a rank, padded: rank 3 holds one duplicate
    seen = []
    for rank in range(world):
        order = ShardOrder(n, dp_rank=rank, dp_size=world, batch_size=batch, seed=7, drop_last_batch=False)
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(2)
        epoch = order.epoch_order(2)
        assert epoch.tolist() == list(iter(sampler))
        assert order.batches == 2 and order.indices(epoch, 1).tolist() == epoch[2:3].tolist()
        assert order.padding(0, 2) == (None, 2)  # a full first batch is all real
        mask, real = order.padding(2, 1)
        assert real == (1 if rank < 3 else 0) and (mask is None) == (rank < 3)
        seen += [i for i, k in zip(epoch.tolist(), real_mask(torch.arange(3), rank, world, n).tolist()) if k]
    assert sorted(seen) == list(range(n))
    pipeline = ShardOrder(11, dp_rank=0, dp_size=4, batch_size=4, seed=0, drop_last_batch=True)
    assert pipeline.batches == 0
    assert pipeline.too_small() == ("train.batch_size 4 is larger than the 3 samples each pipeline reads per "
                                    "epoch; use a smaller batch size")


def test_old_checkpoints_with_module_prefix_load(tmp_path):
    model = torch.nn.Linear(3, 2)
    old = {"model": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 1, "step": 5}
    torch.save(old, tmp_path / "old.pt")
    ckpt = load_checkpoint(str(tmp_path / "old.pt"))
    assert set(ckpt["model"]) == {"weight", "bias"}
    torch.nn.Linear(3, 2).load_state_dict(ckpt["model"])
    assert strip_module_prefix({"weight": 1}) == {"weight": 1}


def test_corrupt_checkpoint_error_names_the_file(tmp_path):
    (tmp_path / "last.pt").write_bytes(b"garbage")
    try:
        load_checkpoint(str(tmp_path / "last.pt"))
    except Exception as exc:
        assert str(tmp_path / "last.pt") in str(exc) and "delete it to start over" in str(exc)
    else:
        raise AssertionError("a corrupt checkpoint loaded")


def test_cli_flags_build_the_job_config(tmp_path):
    args = build_parser().parse_args(
        ["--dataset", "digits", "--model", "cnn", "--strategy", "ddp", "--epochs", "3", "--batch-size", "32",
         "--lr", "0.05", "--seed", "0", "--output-dir", str(tmp_path), "--model-param", "channels=16"])
    cfg = config_from_args(args)
    assert cfg.data.format == "builtin" and cfg.data.name == "digits"
    assert cfg.model.arch == "cnn" and cfg.model.params == {"channels": 16}
    assert (cfg.train.epochs, cfg.train.batch_size, cfg.train.lr, cfg.train.seed) == (3, 32, 0.05, 0)
    assert cfg.output.output_dir == str(tmp_path)

    base = tmp_path / "job.json"
    base.write_text(JobConfig.from_dict({"train": {"epochs": 7, "lr": 0.2}}).to_json())
    cfg = config_from_args(build_parser().parse_args(["--config", str(base), "--lr", "0.3", "--dataset", "x.csv"]))
    assert (cfg.train.epochs, cfg.train.lr) == (7, 0.3)
    assert (cfg.data.format, cfg.data.uri) == ("csv", "x.csv")


def test_the_cli_is_the_config_a_flag_per_field_with_its_documentation():
    parser = build_parser()
    options = {o for action in parser._actions for o in action.option_strings}
    assert options == {
        "-h", "--help", "--config", "--dataset", "--data-format", "--label-column", "--val-fraction",
        "--image-size", "--model", "--model-param", "--entry-point", "--strategy", "--pipeline-stages", "--microbatches",
        "--pipeline-schedule", "--dist-backend", "--timeout-s", "--epochs", "--batch-size", "--lr", "--optimizer",
        "--momentum", "--weight-decay", "--seed", "--log-every-steps", "--log-every-s", "--stop-check-s",
        "--augment", "--no-augment", "--precision", "--grad-accum-steps", "--grad-clip-norm", "--lr-schedule",
        "--warmup-steps", "--on-nonfinite-loss", "--find-unused-parameters", "--no-find-unused-parameters",
        "--output-dir", "--checkpoint-dir", "--seq-len", "--val-windows", "--num-workers", "--pin-memory",
        "--no-pin-memory", "--prefetch-factor", "--activation-checkpointing", "--no-activation-checkpointing",
        "--cpu-offload", "--no-cpu-offload", "--max-steps", "--compile", "--no-compile", "--checkpoint-format",
        "--init-from", "--init-mode"}
    by_flag = {a.option_strings[0]: a for a in parser._actions}
    assert by_flag["--pipeline-schedule"].choices == ("gpipe", "1f1b")  # the Literal's
    assert by_flag["--model"].choices == ("mlp", "cnn", "resnet", "gpt", "custom")
    assert by_flag["--checkpoint-format"].choices == ("full", "sharded")
    assert by_flag["--epochs"].type is int and by_flag["--lr"].type is float
    assert by_flag["--epochs"].help == "Passes over the training data. (config default 3)"
    assert by_flag["--output-dir"].help.startswith("Where model.pt (bare state dict) and metrics.jsonl are written.")
    # every field of the config has its flag, but the ones --dataset, --model-param and the launcher set
    flagged = {f"{f.section}.{f.field}" for f in cli_flags()}
    every = {f"{section.name}.{f.name}" for section in dataclasses.fields(JobConfig)
             for f in dataclasses.fields(section.default_factory())}
    assert every - flagged == {"data.name", "data.uri", "model.params", "parallel.nodes", "parallel.procs_per_node",
                               "model.shard_classes", "code.dir", "code.sha256", "code.script", "code.args",
                               "code.framework"}
    text = parser.format_help()
    assert "Passes over the training data." in text
    assert "(see trainer_pkg.train.record_interval)" in by_flag["--log-every-steps"].help  # reST roles as text
    assert ":func:" not in text and "``" not in text


def test_unset_flags_keep_the_configs_values(tmp_path):
    base = tmp_path / "job.json"
    base.write_text(JobConfig.from_dict({"model": {"arch": "mlp", "params": {"num_layers": 3}},
                                         "train": {"augment": True, "epochs": 4}}).to_json())
    cfg = config_from_args(build_parser().parse_args(["--config", str(base), "--no-augment"]))
    assert (cfg.train.augment, cfg.train.epochs, cfg.model.params) == (False, 4, {"num_layers": 3})
    # the same architecture keeps its params; another one starts from its own defaults
    assert config_from_args(build_parser().parse_args(["--config", str(base), "--model", "mlp"])).model.params == {
        "num_layers": 3}
    assert config_from_args(build_parser().parse_args(["--config", str(base), "--model", "cnn"])).model.params == {}
    cfg = config_from_args(build_parser().parse_args(["--dataset", "d.npz", "--data-format", "npz", "--epochs", "2"]))
    assert (cfg.data.format, cfg.data.uri, cfg.data.name, cfg.train.epochs) == ("npz", "d.npz", "digits", 2)


def test_a_pipelines_memory_is_measured_past_the_step_that_infers_its_shapes():
    """A pipeline's first step in a process runs one extra forward (the schedule infers the stages'
    shapes), so rank_memory measures its first epoch at the next step; every other case at the
    epoch's first step (its first batch, or the batch a resume starts at)."""
    pipeline, ddp = SimpleNamespace(name="pipeline"), SimpleNamespace(name="ddp")
    assert memory_step_batch(pipeline, 0, 10, 1, first_of_run=True) == 1
    assert memory_step_batch(pipeline, 4, 10, 2, first_of_run=True) == 6  # resumed at batch 4, 2 per step
    assert memory_step_batch(pipeline, 0, 10, 1, first_of_run=False) == 0  # a later epoch
    assert memory_step_batch(pipeline, 0, 1, 1, first_of_run=True) == 0  # no second step to wait for
    assert memory_step_batch(ddp, 3, 10, 1, first_of_run=True) == 3
