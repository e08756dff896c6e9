"""Helpers shared by the benchmarks in bench/: synthetic data, running a torchrun job, reading the
trainer's metric records and the ranks' peak RSS, and the statistics the scripts print.

Nothing here imports torch: the drivers (overhead.py, scaling.py) only start processes and read
files, so their own footprint and import time never enter a measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
RANK_WRAPPER = os.path.join(BENCH, "_rank_rss.py")

# Variables an outer launcher (a test runner under torchrun, a cloud) may have set: never leak them
# into the jobs started here.
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
              "TRAINBOARD_LAUNCH_PLATFORM")


def make_npz(path: str, *, n_train: int, n_val: int, shape: Sequence[int], classes: int, seed: int = 0) -> None:
    """A synthetic classification set: float32 inputs N(0, 1), uniform labels, with its own
    validation arrays (so the trainer does no split and both loops train on exactly ``x_train``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    np.savez(
        path,
        x_train=rng.standard_normal((n_train, *shape), dtype=np.float32),
        y_train=rng.integers(0, classes, n_train).astype(np.int64),
        x_val=rng.standard_normal((n_val, *shape), dtype=np.float32),
        y_val=rng.integers(0, classes, n_val).astype(np.int64),
    )


# "walk" token data: each token is the previous one plus one of these steps (mod the vocabulary), drawn
# uniformly, so a model can learn it and the best possible loss is ln 4 = 1.386 nats per token.
WALK_STEPS = (1, 2, 3, 5)
_CHUNK_TOKENS = 1 << 23  # generated and written 8 Mi tokens at a time: the driver never holds a whole split


def generate_tokens(root: str, *, train_tokens: int, val_tokens: int, vocab_size: int, seed: int = 0,
                    fill: str = "walk", shard_tokens: int = 0) -> dict[str, Any]:
    """Write a generated token dataset under ``root`` in :mod:`trainer_pkg.tokens`' layout (its
    ``ShardWriter`` and ``write_meta``; uint16 ids when ``vocab_size`` ≤ 65,536, else uint32) and
    return its meta dict (``meta.json``, with a ``generated`` key saying how).

    ``fill``: ``walk`` (learnable: see :data:`WALK_STEPS`), ``random`` (uniform ids: the loss cannot
    fall below ln ``vocab_size``) or ``sparse`` (files of the right length made by ``truncate``: holes
    that read as token 0, no disk blocks, instant at any size; for memory and I/O measurements only).
    ``shard_tokens``: tokens per shard (0 = one shard per split). Raises ValueError for an unknown fill.
    """
    import numpy as np

    from trainer_pkg.tokens import ShardWriter, token_dtype, write_meta

    if fill not in ("walk", "random", "sparse"):
        raise ValueError(f"fill must be walk, random or sparse, got {fill!r}")
    dtype = token_dtype(vocab_size)
    rng = np.random.default_rng(seed)
    splits: dict[str, list[str]] = {}
    for split, total in (("train", train_tokens), ("val", val_tokens)):
        per_shard = shard_tokens or total
        if fill == "sparse":
            os.makedirs(os.path.join(root, split), exist_ok=True)
            splits[split] = []
            for index, at in enumerate(range(0, total, per_shard)):
                rel = f"{split}/{index:06d}.bin"
                with open(os.path.join(root, rel), "wb") as f:
                    f.truncate(min(per_shard, total - at) * np.dtype(dtype).itemsize)
                splits[split].append(rel)
            continue
        writer, last = ShardWriter(root, split, dtype, per_shard), int(rng.integers(vocab_size))
        for at in range(0, total, _CHUNK_TOKENS):
            k = min(_CHUNK_TOKENS, total - at)
            if fill == "random":
                writer.append(rng.integers(0, vocab_size, k, dtype=np.int64))
            else:
                chunk = (last + np.cumsum(rng.choice(np.array(WALK_STEPS), k))) % vocab_size
                last = int(chunk[-1])
                writer.append(chunk)
        splits[split] = writer.close()
    generated = {"fill": fill, "seed": seed, "train_tokens": train_tokens, "val_tokens": val_tokens}
    path = write_meta(root, dtype=dtype, vocab_size=vocab_size, splits=splits, generated=generated)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_job(path: str, cfg: dict[str, Any]) -> str:
    """Write the trainer config ``cfg`` (a JobConfig dict) to ``path``; returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return path


def job_env(rss_dir: str | None = None) -> dict[str, str]:
    """The environment of every job: 1 CPU thread per rank, the checkout importable, no inherited
    rank variables; ``BENCH_RSS_DIR`` tells :mod:`bench._rank_rss` where each rank's peak RSS goes."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if rss_dir:
        env["BENCH_RSS_DIR"] = rss_dir
    else:
        env.pop("BENCH_RSS_DIR", None)
    return env


def torchrun(nproc: int, target: list[str]) -> list[str]:
    """``torchrun --standalone --nproc_per_node N <target...>`` through this interpreter; the ranks
    run under :mod:`bench._rank_rss`, which records each rank's VmHWM when it exits."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            RANK_WRAPPER, *target]


def run_job(cmd: list[str], env: dict[str, str], log_path: str, timeout_s: float, cwd: str = REPO) -> float:
    """Run ``cmd`` in ``cwd`` to completion (output to ``log_path``); returns its wall time in
    seconds. Raises RuntimeError with the log's tail when it fails."""
    return finish_job(start_job(cmd, env, log_path, cwd=cwd), timeout_s)


def start_job(cmd: list[str], env: dict[str, str], log_path: str, cpus: Sequence[int] | None = None,
              cwd: str = REPO) -> dict[str, Any]:
    """Start ``cmd`` in ``cwd`` (output to ``log_path``), on the logical CPUs ``cpus`` only when
    given (its children inherit the affinity); :func:`finish_job` waits for it."""
    log = open(log_path, "w", encoding="utf-8")
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec)
    return {"cmd": cmd, "proc": proc, "log": log, "log_path": log_path, "start": start}


def finish_job(job: dict[str, Any], timeout_s: float) -> float:
    """Wait for a :func:`start_job`; its wall time in seconds. Raises RuntimeError with the log's tail
    when it fails (and kills it when it outlives ``timeout_s``)."""
    try:
        code = job["proc"].wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        job["proc"].kill()
        code = job["proc"].wait()
    wall = time.perf_counter() - job["start"]
    job["log"].close()
    if code != 0:
        with open(job["log_path"], encoding="utf-8", errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(job['cmd'])} exited {code}; log {job['log_path']}:\n{tail}")
    return wall


def read_records(metrics_path: str) -> list[dict[str, Any]]:
    with open(metrics_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def trainer_window(metrics_path: str, last_step: int | None = None) -> dict[str, float]:
    """The trainer's timed window from its metric records (rank 0's ``time`` taken when each record
    is started, after its step's work on rank 0; ``started`` after an all-gather, so every rank has
    finished step 1):

    ``loop_s``      from ``started`` (written after optimizer step 1) to the ``step`` record of step
                    ``last_step`` (None: the last ``step`` record of the run, wherever the trainer's
                    cadence put it): steps 2..``last_step`` with the trainer's per-step work and its
                    periodic ``step`` records, nothing else;
    ``last_step``   that record's step;
    ``tail_s``      from that record to ``completed``: the end-of-epoch validation, ``epoch`` record,
                    checkpoint and ``model.pt`` (per-epoch/per-run costs the hand-written loop has not),
                    plus, with ``last_step`` None, the steps after the last record;
    ``started_to_completed_s`` the sum of the two.
    """
    records = read_records(metrics_path)
    started = next(r for r in records if r["event"] == "started")
    steps = [r for r in records if r["event"] == "step"]
    if last_step is None:
        last = steps[-1] if steps else None
    else:
        last = next((r for r in steps if r["step"] == last_step), None)
    if last is None:
        raise RuntimeError(f"{metrics_path}: no step record" + (f" at step {last_step} (log_every_steps must "
                                                                   f"divide it)" if last_step else ""))
    completed = next(r for r in records if r["event"] == "completed")
    return {"loop_s": last["time"] - started["time"], "last_step": last["step"],
            "tail_s": completed["time"] - last["time"], "started_to_completed_s": completed["time"] - started["time"]}


def read_rss(rss_dir: str) -> dict[int, float]:
    """Each rank's peak RSS in MB (VmHWM at exit) written by :mod:`bench._rank_rss`."""
    out: dict[int, float] = {}
    for name in os.listdir(rss_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(rss_dir, name), encoding="utf-8") as f:
                data = json.load(f)
            out[int(data["rank"])] = data["vmhwm_kb"] / 1024.0
    return out


def read_rank_cpu(rss_dir: str) -> dict[int, tuple[float, float]]:
    """Each rank's ``(CPU seconds, of which sampling)`` written by :mod:`bench._rank_rss`: user + system
    of all its threads from start to exit, and the part its hardware sampler took."""
    out: dict[int, tuple[float, float]] = {}
    for name in os.listdir(rss_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(rss_dir, name), encoding="utf-8") as f:
                data = json.load(f)
            out[int(data["rank"])] = (float(data["cpu_s"]), float(data.get("sampling_cpu_s", 0.0)))
    return out


def read_rss_detail(rss_dir: str) -> dict[int, dict[str, float]]:
    """Each rank's figures from :mod:`bench._rank_rss` in MB: ``peak`` (VmHWM), and ``anon`` and
    ``file`` (RssAnon, RssFile when the rank exited)."""
    out: dict[int, dict[str, float]] = {}
    for name in os.listdir(rss_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(rss_dir, name), encoding="utf-8") as f:
                data = json.load(f)
            out[int(data["rank"])] = {"peak": data["vmhwm_kb"] / 1024.0, "anon": data.get("rss_anon_kb", 0) / 1024.0,
                                      "file": data.get("rss_file_kb", 0) / 1024.0}
    return out


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def fmt_list(values: Sequence[float], digits: int = 3) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"


def spread(values: Sequence[float]) -> str:
    """min–max around the median as a percentage of it: how noisy the repetitions were."""
    m = median(values)
    if not m:
        return "n/a"
    return f"{(min(values) - m) / m * 100:+.1f}% / {(max(values) - m) / m * 100:+.1f}%"


def verdict(value: float, target: float, higher_is_better: bool) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "meets target" if ok else "MISSES target"
