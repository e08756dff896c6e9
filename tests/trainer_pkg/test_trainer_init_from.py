"""``train.init_from`` / ``train.init_mode``: a run that starts from another run's results, under
torchrun with gloo on the digits data (docs/clone-continue.md).

- continue: a 1-epoch run's ``last.pt``, continued to 2 epochs, ends with the same weights as one
  uninterrupted 2-epoch run (the trainer is deterministic on CPU), and reports epoch 1 only;
- the run's own checkpoint wins over ``init_from`` (a restarted continued run resumes itself);
- finetune: the source's ``model.pt`` loaded, step 0, epoch 0, a fresh optimizer;
- refusals: a model.pt given to continue, a symbolic link, weights of another architecture.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.trainer_pkg.trainer_helpers import launch, records, torchrun, write_job

pytestmark = pytest.mark.slow

DIGITS = {"format": "builtin", "name": "digits"}
MLP = {"arch": "mlp", "params": {"hidden_size": 32}}


def _train(tmp_path, name, *, epochs, nproc=2, **train):
    job = write_job(tmp_path / name, data=DIGITS, model=MLP,
                    parallel={"strategy": "ddp", "procs_per_node": nproc},
                    train={"epochs": epochs, "batch_size": 16, "lr": 0.05, "seed": 3, "log_every_steps": 5, **train})
    result = torchrun(job, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / name / "out", result


def _weights(out):
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The runs the tests start from, trained once for the module (read, never written to, by the
    tests): ``one_epoch`` and ``two_epochs`` (2 ranks each, the same seed), and ``continued``: the
    one-epoch run's ``last.pt`` continued to 2 epochs (with its :class:`subprocess.CompletedProcess`
    as ``continued_result``)."""
    root = tmp_path_factory.mktemp("init-from-sources")
    one, _ = _train(root, "one_epoch", epochs=1)
    two, _ = _train(root, "two_epochs", epochs=2)
    continued, result = _train(root, "continued", epochs=2, init_from=str(one / "checkpoints" / "last.pt"),
                               init_mode="continue")
    return {"one_epoch": one, "two_epochs": two, "continued": continued, "continued_result": result}


def test_continue_from_a_1_epoch_checkpoint_to_2_epochs_equals_an_uninterrupted_2_epoch_run(sources):
    straight, first = sources["two_epochs"], sources["one_epoch"]
    source = first / "checkpoints" / "last.pt"
    continued, result = sources["continued"], sources["continued_result"]

    a, b = _weights(straight), _weights(continued)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert f"continuing from {source}" in result.stdout + result.stderr
    recs = records(continued)
    epochs = [r["epoch"] for r in recs if r["event"] == "epoch"]
    assert epochs == [1]  # the source's epoch 0 is not reported again
    started = next(r for r in recs if r["event"] == "started")
    assert started["resumed"] is True and started["step"] > 0
    straight_epoch1 = next(r for r in records(straight) if r["event"] == "epoch" and r["epoch"] == 1)
    continued_epoch1 = next(r for r in recs if r["event"] == "epoch")
    assert continued_epoch1["val_loss"] == straight_epoch1["val_loss"]
    assert continued_epoch1["step"] == straight_epoch1["step"]


def test_each_epoch_record_says_the_finished_epochs_its_checkpoint_holds(tmp_path):
    """``epochs_done``: epoch + 1 after a whole epoch; after an epoch train.max_steps cut short, the
    epoch itself, which is where the checkpoint resumes (the dashboard's "checkpoint epoch N")."""
    whole, _ = _train(tmp_path, "whole", epochs=2, nproc=1)
    assert [(r["epoch"], r["epochs_done"]) for r in records(whole) if r["event"] == "epoch"] == [(0, 1), (1, 2)]
    # One rank: no slowest rank to wait for, so no wait_for_slowest_s (a 0 would win comparisons).
    assert any("samples_per_s" in r for r in records(whole))
    assert not any("wait_for_slowest_s" in r for r in records(whole))
    assert torch.load(whole / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["epoch"] == 2
    per_epoch = next(r["step"] for r in records(whole) if r["event"] == "epoch")
    cut, _ = _train(tmp_path, "cut", epochs=3, nproc=1, max_steps=per_epoch + 3)
    assert [(r["epoch"], r["epochs_done"]) for r in records(cut) if r["event"] == "epoch"] == [(0, 1), (1, 1)]
    saved = torch.load(cut / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["batches_done"] > 0) == (1, True)


def test_a_continued_run_with_its_own_checkpoint_resumes_that_not_the_source(sources, tmp_path):
    source = sources["one_epoch"] / "checkpoints" / "last.pt"
    # The continued run's output, as a restarted job finds it: its own last.pt (epoch 2).
    continued = tmp_path / "continued" / "out"
    shutil.copytree(sources["continued"], continued)
    # Run the same job again with more epochs: its own last.pt (epoch 2) wins over the source's (epoch 1).
    _, result = _train(tmp_path, "continued", epochs=3, init_from=str(source), init_mode="continue")
    out = result.stdout + result.stderr
    assert "continuing from" not in out
    assert f"resuming from {continued / 'checkpoints' / 'last.pt'}: epoch 2" in out
    assert [r["epoch"] for r in records(continued) if r["event"] == "epoch"] == [1, 2]


def test_finetune_starts_at_step_0_with_the_source_weights_and_a_new_optimizer(sources, tmp_path):
    source_out = sources["two_epochs"]
    source_weights = _weights(source_out)
    # lr so small that one step barely moves: the first loss is the trained model's, not a fresh one's.
    tuned, result = _train(tmp_path, "tuned", epochs=1, lr=1e-9, init_from=str(source_out / "model.pt"),
                           init_mode="finetune")
    fresh, _ = _train(tmp_path, "fresh", epochs=1, lr=1e-9)
    out = result.stdout + result.stderr
    assert "fine-tuning from the weights in" in out and "resuming from" not in out
    recs = records(tuned)
    started = next(r for r in recs if r["event"] == "started")
    assert started["resumed"] is False and started["epoch"] == 0 and started["step"] == 1
    tuned_val = next(r for r in recs if r["event"] == "epoch")["val_loss"]
    source_val = [r for r in records(source_out) if r["event"] == "epoch"][-1]["val_loss"]
    fresh_val = next(r for r in records(fresh) if r["event"] == "epoch")["val_loss"]
    assert abs(tuned_val - source_val) < 1e-4  # the trained model, unchanged by an lr of 1e-9
    assert fresh_val > source_val + 0.1
    tuned_weights = _weights(tuned)
    for key in source_weights:
        assert torch.allclose(tuned_weights[key], source_weights[key], atol=1e-6), key
    ckpt = torch.load(tuned / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 1  # one epoch of its own, counted from 0


def test_init_from_refusals_name_the_file_and_what_to_do(sources, tmp_path):
    source_out = sources["one_epoch"]

    def run(name, **train):
        job = write_job(tmp_path / name, data=DIGITS, model=train.pop("model", MLP),
                        train={"epochs": 2, "batch_size": 16, **train})
        return launch(job)  # one process, world size 1: the trainer refuses before its first step

    weights_only = run("weights", init_from=str(source_out / "model.pt"), init_mode="continue")
    assert weights_only.returncode != 0
    assert "is not a Trainboard checkpoint (last.pt); continue needs one" in weights_only.stderr

    link = tmp_path / "link.pt"
    os.symlink(source_out / "checkpoints" / "last.pt", link)
    linked = run("linked", init_from=str(link), init_mode="continue")
    assert linked.returncode != 0
    assert f"train.init_from {link} cannot be read" in linked.stderr and "not a symbolic link" in linked.stderr

    other = run("other", model={"arch": "mlp", "params": {"hidden_size": 64}},
                init_from=str(source_out / "model.pt"), init_mode="finetune")
    assert other.returncode != 0
    assert "its weights do not fit this model" in other.stderr

    copied = tmp_path / "copy.pt"
    shutil.copy(source_out / "checkpoints" / "last.pt", copied)
    alone = run("alone", init_from=str(copied))  # no init_mode
    assert alone.returncode != 0
    assert "train.init_from and train.init_mode go together" in alone.stderr


def test_init_from_flag_replaces_the_configs_uri_and_is_refused_for_a_job_from_scratch(tmp_path, capfd):
    """``--init-from``: where the platform mounted the file (Azure ML's ``${{inputs.init_from}}``)."""
    from trainer_pkg.config import ConfigError, JobConfig
    from trainer_pkg.launch import main, with_init_from

    uri = "azureml://datastores/workspaceblobstore/paths/azureml/tb-job-40/checkpoints/last.pt"
    cfg = JobConfig.from_dict({"train": {"epochs": 2, "init_from": uri, "init_mode": "continue"}})
    assert with_init_from(cfg, "/mnt/inputs/last.pt").train.init_from == "/mnt/inputs/last.pt"
    assert cfg.train.init_from == uri  # a new config; the one read is left as it was
    with pytest.raises(ConfigError, match="empty path"):
        with_init_from(cfg, " ")
    scratch = write_job(tmp_path / "scratch", data=DIGITS, model=MLP, train={"epochs": 1})
    assert main(["--config", str(scratch), "--init-from", "/mnt/inputs/last.pt"]) == 2
    assert ("--init-from /mnt/inputs/last.pt: the config starts from scratch (no train.init_mode)"
            in capfd.readouterr().err)
