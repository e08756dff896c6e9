"""In-process pieces of the trainer: sharding masks, checkpoint files, CLI → config."""

import torch
from torch.utils.data import DistributedSampler

from trainer_pkg.config import JobConfig
from trainer_pkg.train import _real_mask, build_parser, config_from_args, load_checkpoint, strip_module_prefix


def test_real_mask_marks_exactly_the_padded_duplicates():
    n, world = 11, 4  # padded to 12: one duplicate, on rank 3
    seen = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0)
        order = list(iter(sampler))
        keep = _real_mask(torch.arange(len(order)), rank, world, n)
        seen += [i for i, k in zip(order, keep.tolist()) if k]
        assert keep.sum().item() == (3 if rank < 3 else 2)
    assert sorted(seen) == list(range(n))  # every sample exactly once


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
