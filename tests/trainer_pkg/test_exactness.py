"""Exactness: data parallelism, resume and seeding change nothing a single uninterrupted process
would compute. Real trainer runs (torchrun, gloo, 1 CPU thread per rank) on small NPZ files; the
plain 2-rank run of the image NPZ (:func:`plain`) is shared by the tests that compare with it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer_helpers import REPO, python, records, trainer_env, write_job
from trainer_pkg.metrics import parse_metric_line
from trainer_pkg.models import build_model
from trainer_pkg.train import load_checkpoint, random_hflip


def make_npz(path: Path, n_train: int, n_val: int, shape: tuple[int, ...] = (16,), classes: int = 4,
             seed: int = 0) -> Path:
    """A learnable NPZ with its own validation arrays: the label is the argmax of a fixed projection."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(int(np.prod(shape)), classes))
    x = rng.normal(size=(n_train + n_val, *shape)).astype(np.float32)
    y = (x.reshape(len(x), -1) @ w).argmax(1).astype(np.int64)
    np.savez(path, x_train=x[:n_train], y_train=y[:n_train], x_val=x[n_train:], y_val=y[n_train:])
    return path


def train_cli(out: Path, dataset: Path, *flags: str, nproc: int = 1, timeout: float = 180) -> subprocess.CompletedProcess:
    """``[torchrun --standalone --nproc_per_node N] -m trainer_pkg.train --dataset ... --output-dir out``."""
    runner = ([python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
              if nproc > 1 else [sys.executable])
    cmd = [*runner, "-m", "trainer_pkg.train", "--dataset", str(dataset), "--output-dir", str(out), *flags]
    run = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


IMAGE_FLAGS = ("--model", "mlp", "--epochs", "1", "--lr", "0.05", "--seed", "7")
"""The image NPZ runs' flags (with ``--batch-size`` and, for the augmented ones, ``--augment``)."""


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[Path, Path]:
    """``(data, out)``: the image NPZ (256 training samples of 1×8×8, 32 validation, 4 classes) and
    one real run on it, 2 ranks × batch 16, no augmentation."""
    top = tmp_path_factory.mktemp("plain")
    data = make_npz(top / "img.npz", 256, 32, shape=(1, 8, 8))
    train_cli(top / "out", data, *IMAGE_FLAGS, "--batch-size", "16", "--strategy", "ddp", nproc=2)
    return data, top / "out"


def test_exact_ddp_two_ranks_of_16_equal_one_process_of_32_through_the_cli(plain, tmp_path):
    data, two_out = plain
    train_cli(tmp_path / "one", data, *IMAGE_FLAGS, "--batch-size", "32")

    one, two = weights(tmp_path / "one"), weights(two_out)
    assert one.keys() == two.keys() and len(one) >= 2
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst <= 1e-6, f"largest parameter difference {worst:g}"
    torch.manual_seed(7)
    initial = build_model("mlp", {}, (1, 8, 8), 4).state_dict()
    assert any(not torch.equal(one[k], initial[k]) for k in one)  # it trained
    rec_one, rec_two = records(tmp_path / "one"), records(two_out)
    assert rec_one[-1]["step"] == rec_two[-1]["step"] == 8  # 256 samples / 32 per step
    assert rec_one[-1]["event"] == rec_two[-1]["event"] == "completed"
    assert (rec_one[-1]["world_size"], rec_two[-1]["world_size"]) == (1, 2)
    # DDP averages the gradients of the same 32 samples per step (the sampler deals one permutation
    # out by rank), so validation sees the same model.
    epoch_one = [r for r in rec_one if r["event"] == "epoch"][0]
    epoch_two = [r for r in rec_two if r["event"] == "epoch"][0]
    assert abs(epoch_one["val_loss"] - epoch_two["val_loss"]) < 1e-4
    assert epoch_one["val_accuracy"] == epoch_two["val_accuracy"]


def _launch(job: Path, *, stop_after_epoch: int | None = None, interpreter: str = sys.executable
            ) -> subprocess.Popen:
    """``python -m trainer_pkg.launch --config job --standalone --nproc-per-node 2``; with
    ``stop_after_epoch``, SIGTERM (as a spot preemption would) once that epoch's record is printed.
    ``interpreter``: this one by default (torch's own torchrun, whose agent passes the signal on: this
    file's subject), or :func:`trainer_helpers.python` for a test whose subject is the trainer alone."""
    cmd = [interpreter, "-m", "trainer_pkg.launch", "--config", str(job), "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while stop_after_epoch is not None and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if not ready:
                continue
            line = proc.stdout.readline()
            assert line, f"the run ended before epoch {stop_after_epoch}: {proc.stderr.read()[-3000:]}"
            record = parse_metric_line(line)
            if record and record["event"] == "epoch" and record["epoch"] == stop_after_epoch:
                os.killpg(proc.pid, signal.SIGTERM)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    return proc


def test_exact_resume_after_sigterm_matches_an_uninterrupted_run(tmp_path):
    # 2048 samples / (2 ranks × 16) = 64 steps per epoch: long enough for the signal to land in epoch 1.
    data = make_npz(tmp_path / "d.npz", 2048, 64)
    sections = dict(data={"format": "npz", "uri": str(data)}, model={"arch": "mlp", "params": {}},
                    train={"epochs": 3, "batch_size": 16, "lr": 0.02, "seed": 11, "log_every_steps": 1000,
                           "stop_check_s": 0},  # agree at every step: the signal lands in epoch 1
                    parallel={"procs_per_node": 2})
    _launch(write_job(tmp_path / "straight", **sections))

    _launch(write_job(tmp_path / "resumed", **sections), stop_after_epoch=0)
    stopped = records(tmp_path / "resumed" / "out")
    assert stopped[-1]["event"] == "stopped" and stopped[-1]["epoch"] == 1, stopped[-1]
    assert not (tmp_path / "resumed" / "out" / "model.pt").exists()
    ckpt = load_checkpoint(str(tmp_path / "resumed" / "out" / "checkpoints" / "last.pt"))
    assert ckpt["epoch"] == 1 and 0 <= ckpt["batches_done"] < 64
    _launch(tmp_path / "resumed" / "job.json")

    straight, resumed = weights(tmp_path / "straight" / "out"), weights(tmp_path / "resumed" / "out")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), "parameters differ after resume"

    def epochs(out: Path) -> dict[int, dict]:
        return {r["epoch"]: r for r in records(out) if r["event"] == "epoch"}

    a, b = epochs(tmp_path / "straight" / "out"), epochs(tmp_path / "resumed" / "out")
    assert sorted(a) == sorted(b) == [0, 1, 2]
    # Epoch 2 (index 1), the one the signal split: same samples in the same order on every rank.
    assert len(a[1]["sample_order_digest"]) == 2
    assert a[1]["sample_order_digest"] == b[1]["sample_order_digest"]
    assert a[1]["sample_order_digest"] != a[0]["sample_order_digest"]  # set_epoch reshuffled
    assert a[2]["val_loss"] == b[2]["val_loss"] and a[2]["val_accuracy"] == b[2]["val_accuracy"]
    starts = [r for r in records(tmp_path / "resumed" / "out") if r["event"] == "started"]
    assert [s["resumed"] for s in starts] == [False, True]


def test_exact_same_seed_with_augmentation_is_identical_and_ranks_draw_different_flips(plain, tmp_path):
    data, plain_out = plain
    for name in ("a", "b"):
        train_cli(tmp_path / name, data, *IMAGE_FLAGS, "--batch-size", "16", "--strategy", "ddp", "--augment", nproc=2)
    a, b, unflipped = weights(tmp_path / "a"), weights(tmp_path / "b"), weights(plain_out)
    assert all(torch.equal(a[k], b[k]) for k in a)  # same seed: bit-identical, flips included
    assert any(not torch.equal(a[k], unflipped[k]) for k in a)  # the flips did change the training

    # Each rank's stream (the torch RNG random_hflip draws from, saved per rank in the checkpoint)
    # gives that rank its own flips.
    rngs = load_checkpoint(str(tmp_path / "a" / "checkpoints" / "last.pt"))["rng"]
    assert len(rngs) == 2
    masks = []
    probe = torch.arange(2.0 * 32).view(32, 1, 1, 2)  # 32 images of 1×2 pixels: [2i, 2i+1]
    for state in rngs:
        torch.set_rng_state(state["torch"])
        flipped = random_hflip(probe)
        masks.append(flipped[:, 0, 0, 0] != probe[:, 0, 0, 0])
        assert torch.equal(flipped[masks[-1]], probe[masks[-1]].flip(-1))  # a flip mirrors, nothing else
    assert not torch.equal(masks[0], masks[1])
    assert 0 < int(masks[0].sum()) < 32 and 0 < int(masks[1].sum()) < 32


def test_exact_validation_accuracy_over_5_samples_on_2_ranks_ignores_the_padded_duplicate(tmp_path):
    # 101 training samples on 2 ranks × batch 8 (51 and 50 real samples): equal step counts, no hang.
    data = make_npz(tmp_path / "d.npz", 101, 5, seed=4)
    train_cli(tmp_path / "out", data, "--model", "mlp", "--epochs", "2", "--batch-size", "8", "--seed", "1",
              nproc=2, timeout=120)
    recs = records(tmp_path / "out")
    assert recs[-1]["event"] == "completed" and recs[-1]["step"] == 2 * 7  # ceil(51 / 8) per epoch
    final = [r for r in recs if r["event"] == "epoch"][-1]

    # The same 5 samples through the saved model in one process.
    z = np.load(data)
    model = build_model("mlp", {}, (16,), 4)
    model.load_state_dict(weights(tmp_path / "out"))
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(z["x_val"]))
        y = torch.from_numpy(z["y_val"])
        correct = int((logits.argmax(1) == y).sum())
        loss = F.cross_entropy(logits, y).item()
    assert abs(final["val_accuracy"] * 5 - correct) < 1e-9  # k / 5 exactly: not (k ± 1) / 6
    assert abs(final["val_loss"] - loss) < 1e-6
    # Sample 0 is rank 1's padding; were it counted, accuracy and loss would both move.
    with torch.no_grad():
        padded = torch.cat([logits, logits[:1]]), torch.cat([y, y[:1]])
        padded_loss = F.cross_entropy(*padded).item()
    assert abs(padded_loss - loss) > 1e-6
