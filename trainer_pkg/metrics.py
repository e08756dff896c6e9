"""The metric record the trainer emits and the dashboard ingests.

Rank 0 writes one JSON object per line to ``<output_dir>/metrics.jsonl`` and prints the same object
on stdout prefixed with :data:`METRIC_PREFIX`, so any backend that can read the job's log (a GPU box's
log file, CloudWatch, Cloud Logging, an Azure ML log stream) also yields its metrics.

Record fields (values are global: all-reduced over ranks, weighted by sample count):

``event``        ``"started"`` (once per run, after its first optimizer step; carries ``resumed``, true
                 when the run continued from a checkpoint), ``"step"`` (about every
                 ``train.log_every_s`` seconds of training, or every ``train.log_every_steps`` steps), ``"epoch"`` (end of each epoch, with validation),
                 ``"completed"`` (once, after the final model is saved), ``"stopped"`` (once, when
                 SIGTERM stopped the run after its checkpoint was written; rerunning resumes),
                 ``"failed"`` (once, when the run stops itself: its training loss became NaN or
                 infinite and ``train.on_nonfinite_loss`` is ``stop``; carries ``reason``).
``time``         Unix time, seconds.
``epoch``        0-based epoch; ``step`` the number of optimizer steps taken so far.
``total_steps``  the optimizer steps the run takes (``train.epochs`` × the steps of an epoch, or
                 ``train.max_steps`` when fewer); a script's records carry it once it called
                 :func:`trainer_pkg.report.progress`. The dashboard's % done and time left.
``world_size``   ranks in the job.
``train_loss``, ``train_accuracy``       mean over the samples since the previous record (0–1 accuracy);
                                          absent when no sample was trained since then.
``val_loss``, ``val_accuracy``           ``epoch`` records only.
``epochs_done``                           ``epoch`` records only: the epochs the checkpoint written right
                                          after the record holds, all finished (``epoch`` + 1; ``epoch``
                                          when ``train.max_steps`` ended the epoch early, the checkpoint
                                          then holding its position inside it). A run continued from
                                          that checkpoint starts at epoch ``epochs_done`` (0-based).
``sample_order_digest``                   ``epoch`` records only: per rank (a list indexed by rank), 16 hex
                                          digits of SHA-256 over the sample indices that rank trained on
                                          that epoch, in order. Equal digests mean the same samples in
                                          the same order (a resumed run must match an uninterrupted one).
``samples_per_s``                         global training throughput (samples/s, training time only).
``rank_samples_per_s``, ``rank_step_time_s``, ``rank_data_wait_s``, ``rank_compute_s``, ``rank_sync_wait_s``
                                          lists indexed by rank: samples/s this rank trained (every
                                          stage of a pipeline trains each sample); seconds per step
                                          waiting for the next batch (indexing, augmentation, the copy
                                          to the device); seconds per step of the rank's own forward
                                          and backward, apart from waiting for other ranks (see
                                          :mod:`trainer_pkg.parallel`); seconds per step in the
                                          gradient sync and the optimizer, waiting for slower ranks
                                          included; ``rank_step_time_s`` = compute + sync wait, the
                                          same on every rank in synchronous training. The straggler
                                          is the rank with the largest data wait + compute: the
                                          others wait for it. The throughput fields are absent along
                                          with train_loss.
``wait_for_slowest_s``                    rank-seconds the ranks spent, over the window since the
                                          previous record, waiting for the slowest one to reach the
                                          gradient sync: Σ over ranks of (slowest's data wait +
                                          compute − its own). Absent in a one-rank run (there is
                                          no slowest to wait for).
``rank_pipeline_stage``, ``rank_stage_layers``
                                          pipeline only, with the throughput fields: each rank's stage
                                          (0-based) and that stage's number of layers.
``nonfinite``    names of the fields whose value was NaN or infinite (a diverged run), each written as
                 ``null`` (JSON has no NaN); for a list field, its non-finite entries are ``null``.
                 Absent when every value is finite. See :func:`encode_record`.
``reason``       ``failed`` records only: why the run stopped, e.g. ``"loss became NaN at step 12"``.
``nonfinite_step`` ``failed`` records of a diverged run only: the first step whose loss was not finite
                 (12 above); the record's own ``step`` is later, where the ranks agreed to stop.
``lr``           learning rate at that step.
``grad_norm``    global L2 norm of the gradients before clipping, of the latest optimizer step;
                 present only when clipping is on (``train.grad_clip_norm`` > 0).
``user_metrics`` records of a user's script (:func:`trainer_pkg.report.log`) only: the names of the
                 record's fields that are the script's own scalars, each matching
                 :data:`USER_METRIC_NAME`, at most :data:`MAX_USER_METRICS`; the dashboard charts
                 each one under its name.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any

METRIC_PREFIX = "TRAINBOARD_METRIC "

GLOBAL_METRICS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "samples_per_s", "lr",
                  "wait_for_slowest_s", "val_perplexity", "tokens_per_s")
"""The trainer's own scalar fields (one value for the job, not per rank), as the dashboard stores them.
A language model's (token data) records add ``val_perplexity`` (exp of ``val_loss``, nats per token)
to ``epoch`` records and ``tokens_per_s`` (``samples_per_s`` × seq_len) to those with throughput."""

USER_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,99}")
"""A user metric's name (``fullmatch``): 1-100 characters, a letter or ``_`` first, then letters,
digits and ``_ . / -`` (``loss``, ``tokens/s``, ``eval.top-1``)."""

HARDWARE_PREFIX = "sys/"
"""The launcher's hardware series (:mod:`trainer_pkg.hardware`) are named under it: a user metric may not be."""

MAX_USER_METRICS = 50
"""Most user metrics in one record."""

RECORD_FIELDS = frozenset({"event", "time", "step", "epoch", "epochs_done", "user_metrics", "nonfinite",
                           "nonfinite_step", "reason", "resumed", "world_size", "total_steps"})
"""Fields of a record that say what and when it is, never a user metric's name."""


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def encode_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as valid JSON can carry it: every NaN or infinite float (top level, or an entry of
    a list) becomes None and the field's name is listed, sorted, under ``nonfinite``.

    ``{"train_loss": nan, "rank_step_time_s": [0.1, inf]}`` →
    ``{"train_loss": None, "rank_step_time_s": [0.1, None], "nonfinite": ["rank_step_time_s", "train_loss"]}``.
    A record with only finite values is returned unchanged (no ``nonfinite`` key).
    """
    out: dict[str, Any] = {}
    bad: list[str] = []
    for key, value in record.items():
        if isinstance(value, list) and not all(_finite(v) for v in value):
            value = [v if _finite(v) else None for v in value]
            bad.append(key)
        elif not _finite(value):
            value = None
            bad.append(key)
        out[key] = value
    if bad:
        out["nonfinite"] = sorted(bad)
    return out


def format_metric_line(record: dict[str, Any]) -> str:
    """The stdout line for ``record`` (no trailing newline), non-finite values encoded by
    :func:`encode_record`."""
    return METRIC_PREFIX + json.dumps(encode_record(record), sort_keys=True, separators=(",", ":"),
                                      allow_nan=False)


def print_line(text: str) -> None:
    """Print ``text`` and its newline on stdout as ONE write, then flush.

    A node's ranks share torchrun's stdout pipe, and torchrun starts them under ``python -u``, where
    ``print`` writes the text and the newline separately: another rank's line can land between the
    two and leave a metric record unparseable (seen: a record lost from a 2-rank run's log). One
    write of at most PIPE_BUF bytes (4,096 on Linux) to a pipe is atomic; a longer one (a record of
    very many ranks) can only be split by another writer when the pipe is full.
    """
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def parse_metric_line(line: str) -> dict[str, Any] | None:
    """The record carried by a log line, or None when the line carries none.

    The prefix may appear after other text (launchers and clouds prepend rank or timestamp tags).
    A malformed record is ignored rather than raised: a log is never a reason to fail a sync.
    """
    at = line.find(METRIC_PREFIX)
    if at < 0:
        return None
    try:
        record = json.loads(line[at + len(METRIC_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "event" in record else None


def report_error(message: str) -> None:
    """Print ``trainer error: <message>`` on stderr as ONE write; in a job of several ranks the
    message starts with ``rank N: `` (from torchrun's ``RANK``), so the job's failure reason can name
    the rank whose error it is.

    Every rank shares the launcher's stderr pipe; ``print`` issues the text and the newline as two
    writes, so two ranks failing together could splice their lines. One ``os.write`` of less than
    PIPE_BUF bytes is atomic.
    """
    rank, world_size = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "1")
    if rank.isdigit() and world_size.isdigit() and int(world_size) > 1:
        message = f"rank {rank}: {message}"
    sys.stderr.flush()
    os.write(2, f"trainer error: {message}\n".encode("utf-8", "replace"))


def exit_process(code: int) -> None:
    """End an entry point with ``code``. After training (torch imported), skip interpreter teardown.

    By then every output is on disk (records are flushed per line, checkpoints and model.pt renamed
    into place) and the process group is destroyed. Left to the interpreter's shutdown, torch's C++
    threads (gloo's, DDP's reducer) can be destroyed while still joinable, and the C++ runtime aborts
    the process ("terminate called without an active exception", SIGABRT) after a successful run;
    torchrun then reports the rank as failed. Seen intermittently with torch 2.13 on CPU/gloo.
    """
    if "torch" not in sys.modules:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
