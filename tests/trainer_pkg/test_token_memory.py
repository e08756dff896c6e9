"""A token dataset larger than the memory each rank is allowed trains to the end: the real trainer,
2 ranks under torchrun, a tiny gpt, and a watchdog that samples each rank's resident set from /proc
and fails the test (killing the ranks) the moment one goes above the limit.

The limit is a rank's baseline (a process that has imported torch and the trainer) plus half the
dataset's size; a process that loads the same shards whole (``numpy.fromfile``) is measured too, and
goes above that limit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from standins import rank_zygote
from trainer_helpers import REPO, records, torchrun, trainer_env, write_job
from trainer_pkg.tokens import write_meta

pytestmark = pytest.mark.slow

SHARDS, SHARD_TOKENS = 4, 64 * 1024 * 1024  # 4 × 128 MiB of uint16: 512 MiB
VOCAB = 256
MARKER = "TRAINBOARD_RSS_WATCH"


def _status_kb(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class RSSWatchdog(threading.Thread):
    """Samples, every 50 ms, the peak resident set (VmHWM, kB) of every process whose environment
    holds ``MARKER=token`` and that runs the trainer; kills them all (by PID) when one exceeds
    ``limit_kb``, so an over-limit run ends at once instead of swapping the machine."""

    def __init__(self, token: str, limit_kb: int) -> None:
        super().__init__(daemon=True)
        self.token, self.limit_kb = f"{MARKER}={token}".encode(), limit_kb
        self.peaks: dict[int, int] = {}
        self.over: tuple[int, int] | None = None
        self.done = threading.Event()

    def _ranks(self) -> list[int]:
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                env = Path(entry.path, "environ").read_bytes().split(b"\0")
                cmd = Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue
            # torchrun's agent has the marker too; the ranks are the processes that have a RANK.
            if self.token in env and b"trainer_pkg.launch" in cmd and any(v.startswith(b"RANK=") for v in env):
                found.append(int(entry.name))
        return found

    def run(self) -> None:
        while not self.done.is_set():
            ranks = self._ranks()
            for pid in ranks:
                peak = _status_kb(pid, "VmHWM")
                if peak is not None:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), peak)
                    if peak > self.limit_kb and self.over is None:
                        self.over = (pid, peak)
                        for victim in ranks:
                            try:
                                os.kill(victim, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
            time.sleep(0.05)


_MEASURE = """
import sys, numpy as np, torch, trainer_pkg.train
if len(sys.argv) > 1:
    whole = [np.fromfile(p, dtype=np.uint16) for p in sys.argv[1:]]
    print(int(sum(int(w.sum() % 7) for w in whole) >= 0), file=sys.stderr)
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(line.split()[1])
"""


def _peak_kb(*paths: str) -> int:
    out = subprocess.run([sys.executable, "-c", _MEASURE, *paths], cwd=REPO, env=trainer_env(),
                         capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.split()[-1])


def test_a_token_dataset_larger_than_a_ranks_memory_limit_trains_to_the_end(tmp_path, monkeypatch):
    root = tmp_path / "tokens"
    (root / "train").mkdir(parents=True)
    rng = np.random.default_rng(0)
    files = []
    for i in range(SHARDS):
        with open(root / "train" / f"{i:06d}.bin", "wb") as f:
            for _ in range(SHARD_TOKENS // (1 << 22)):  # 8 MiB at a time
                rng.integers(0, VOCAB, 1 << 22, dtype=np.uint16).tofile(f)
        files.append(f"train/{i:06d}.bin")
    (root / "val").mkdir()
    rng.integers(0, VOCAB, 20_000, dtype=np.uint16).tofile(root / "val" / "000000.bin")
    write_meta(str(root), dtype="uint16", vocab_size=VOCAB, splits={"train": files, "val": ["val/000000.bin"]})
    dataset_kb = sum((root / f).stat().st_size for f in files) // 1024

    baseline_kb = _peak_kb()
    limit_kb = baseline_kb + dataset_kb // 2
    whole_kb = _peak_kb(*(str(root / f) for f in files))
    assert dataset_kb > limit_kb - baseline_kb and whole_kb > limit_kb, (baseline_kb, whole_kb, limit_kb)

    job = write_job(tmp_path, data={"format": "tokens", "uri": str(root), "seq_len": 64, "val_windows": 32},
                    model={"arch": "gpt", "params": {"layers": 2, "heads": 2, "embed_dim": 64, "context_length": 64}},
                    train={"epochs": 1, "max_steps": 40, "batch_size": 8, "optimizer": "adamw", "lr": 1e-3,
                           "log_every_steps": 10},
                    parallel={"procs_per_node": 2})
    token = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, token)
    # The subject is a rank's own memory: plain rank processes, not ranks forked by the rank zygote
    # (a forked rank's resident set counts the zygote's pages, and its /proc environ is the zygote's).
    monkeypatch.setenv(rank_zygote.ENABLE_VAR, "0")
    watchdog = RSSWatchdog(token, limit_kb)
    watchdog.start()
    try:
        result = torchrun(job, nproc=2, timeout=180)
    finally:
        watchdog.done.set()
        watchdog.join()
    assert watchdog.over is None, (f"rank pid {watchdog.over[0]} reached {watchdog.over[1]:,} kB, above the "
                                   f"limit {limit_kb:,} kB (baseline {baseline_kb:,} + dataset/2)")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(watchdog.peaks) == 2 and all(peak > baseline_kb // 2 for peak in watchdog.peaks.values())
    recs = records(tmp_path / "out")
    assert recs[-1]["event"] == "completed" and recs[-1]["step"] == 40
    assert all(np.isfinite(r["train_loss"]) for r in recs if "train_loss" in r)
