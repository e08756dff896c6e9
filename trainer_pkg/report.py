"""What a user's training script calls to show its metrics on the job page and to find its directories.

Run under ``python -m trainer_pkg.launch`` (``code.script`` set), a script sees torchrun's variables
and Trainboard's directories on every platform; this module reads them::

    from trainer_pkg import report

    for step in range(steps):
        loss = train_one_step()
        report.log(step=step, loss=loss, **{"tokens/s": tokens_per_s})   # rank 0 prints; others: no-op
    torch.save(model.state_dict(), os.path.join(report.model_dir(), "model.pt"))

``report.progress(total=steps)`` gives the run's length: the dashboard then shows % done, the time
left and the projected final cost. ``report.hparams()`` holds the job's training values (a sweep
trial's too), ``report.init_from()`` the file a continue or fine-tune starts from.

``report.log`` prints one ``TRAINBOARD_METRIC {...}`` line (the record format of
:mod:`trainer_pkg.metrics`) that the dashboard reads from the job's log on every backend, and appends
the same record to ``<TRAINBOARD_MODEL_DIR>/metrics.jsonl``. Each name becomes a chart on the job page.

Directories (:data:`MODEL_DIR`, :data:`CHECKPOINT_DIR`, :data:`DATA_DIR`, :data:`CODE_DIR`): where the
platform keeps the model that is uploaded at the end (SageMaker's ``SM_MODEL_DIR``, Vertex's
``AIP_MODEL_DIR``, the Azure ML ``model`` output, the job's output directory on a GPU box), the
checkpoints it keeps across a restart, the dataset, and the unpacked code. The table per platform is in
docs/user-code.md.

Torch-free: importing this module (or ``trainer_pkg``) imports neither torch nor numpy.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, NoReturn

from trainer_pkg.metrics import (HARDWARE_PREFIX, MAX_USER_METRICS, RECORD_FIELDS, USER_METRIC_NAME, encode_record,
                                 format_metric_line, print_line)

MODEL_DIR = "TRAINBOARD_MODEL_DIR"
"""Variable naming the directory for the final model (uploaded by the platform when the job ends)."""
CHECKPOINT_DIR = "TRAINBOARD_CHECKPOINT_DIR"
"""Variable naming the directory for checkpoints (kept by the platform across a restart)."""
DATA_DIR = "TRAINBOARD_DATA_DIR"
"""Variable naming the dataset's local path: a directory, or the file of a CSV/NPZ dataset."""
CODE_DIR = "TRAINBOARD_CODE_DIR"
"""Variable naming the directory of the unpacked code archive (the script's working directory)."""
HPARAMS = "TRAINBOARD_HPARAMS"
"""Variable holding the job's ``train`` values as a JSON object of dotted keys (:func:`hparams`)."""
INIT_FROM = "TRAINBOARD_INIT_FROM"
"""Variable naming the local file a continue or fine-tune starts from (:func:`init_from`); unset otherwise."""
INIT_MODE = "TRAINBOARD_INIT_MODE"
"""Variable holding ``continue`` or ``finetune`` beside :data:`INIT_FROM`; unset otherwise."""

_last_step = -1  # the step of this process's previous log() call
_total_steps = 0  # the run's length given to progress(); 0: not given


def log(step: int | None = None, **metrics: Any) -> None:
    """Report scalar metrics at ``step``: rank 0 prints one ``TRAINBOARD_METRIC`` record; other ranks
    only validate (so a bad call fails on every rank alike) and return.

    ``step``: the optimizer step (an int ≥ 0); omitted, one more than the previous call's (0 first).
    ``metrics``: name → a real number: an int, a float, a numpy scalar or a one-element tensor (read
    with ``float()``; call it after the values you want are all-reduced, as this reports rank 0's).
    NaN and infinity are kept, as ``null`` listed under ``nonfinite``: the chart shows the gap.
    Names that are not Python identifiers go through a dict: ``report.log(**{"tokens/s": 812.0})``.

    The record: ``{"event": "step", "step": 10, "time": <Unix s>, "loss": 0.42, "user_metrics":
    ["loss"]}``, printed to stdout in one write and appended to ``<TRAINBOARD_MODEL_DIR>/metrics.jsonl``
    when that variable is set.

    Raises ValueError, naming the metric, when ``step`` is not an int ≥ 0, a name does not match
    ``[A-Za-z_][A-Za-z0-9_./-]{0,99}``, is one of the record's own fields (``time``, ``event`` …) or
    starts with ``sys/`` (the launcher's hardware series),
    there are more than 50 metrics, or a value is not a real number.
    """
    global _last_step
    step = _last_step + 1 if step is None else _check_step(step)
    record: dict[str, Any] = {"event": "step", "step": step, "time": time.time()}
    record.update(_check_metrics(metrics))
    record["user_metrics"] = list(metrics)
    if _total_steps:
        record["total_steps"] = _total_steps
    _last_step = step
    _emit(record)


def progress(total: int | None = None, done: int | None = None) -> None:
    """Tell the dashboard how long the run is and how far it got: the job list, the job page, the
    API and /metrics then show % done (``done / total``), the time left from the recent step rate,
    and the projected final cost. Rank 0 prints one ``TRAINBOARD_METRIC`` ``step`` record holding
    no metric; other ranks only validate and return. Call it once with ``total`` before the loop;
    the records of later :func:`log` calls carry it, and their ``step`` counts as the steps done::

        report.progress(total=steps)
        for step in range(1, steps + 1):
            report.log(step=step, loss=train_one_step())

    ``total``: the steps the run takes (an int ≥ 1, in the unit of :func:`log`'s ``step``); omitted,
    the one given before (a later call may change it, e.g. once the data's length is known).
    ``done``: steps done so far (an int ≥ 0); omitted, the ``step`` of the previous :func:`log` call
    (0 before any). The record: ``{"event": "step", "step": 0, "time": <Unix s>, "total_steps":
    1000}``, also appended to ``<TRAINBOARD_MODEL_DIR>/metrics.jsonl`` as :func:`log` does.

    Raises ValueError when ``total`` is not an int ≥ 1 (or omitted with none given before) or
    ``done`` is not an int ≥ 0.
    """
    global _total_steps
    if total is None:
        if not _total_steps:
            raise ValueError("report.progress: give total (the steps the run takes) in the first call, "
                             "e.g. report.progress(total=1000)")
        total = _total_steps
    elif isinstance(total, bool) or not hasattr(total, "__index__") or total.__index__() < 1:
        raise ValueError(f"report.progress: total must be an int of at least 1 (the steps the run takes), "
                         f"got {_short(total)}")
    total = total.__index__()
    done = max(_last_step, 0) if done is None else _check_step(done, what="report.progress: done")
    _total_steps = total
    _emit({"event": "step", "step": done, "time": time.time(), "total_steps": total})


def _emit(record: dict[str, Any]) -> None:
    """Rank 0: print ``record`` as one metric line and append it to ``metrics.jsonl`` in the model
    directory (when that is a local path); other ranks: nothing."""
    if not _is_rank_zero():
        return
    print_line(format_metric_line(record))
    directory = os.environ.get(MODEL_DIR, "").strip()
    if directory and not _is_uri(directory):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(encode_record(record), sort_keys=True, allow_nan=False) + "\n")


def model_dir() -> str:
    """The directory for the final model (``TRAINBOARD_MODEL_DIR``), created if missing.

    Raises RuntimeError when the variable is not set (the script was not started by the launcher).
    """
    return _directory(MODEL_DIR, create=True)


def checkpoint_dir() -> str:
    """The directory for checkpoints (``TRAINBOARD_CHECKPOINT_DIR``), created if missing. On a cloud
    it survives a spot restart: look for your last checkpoint there when the script starts.

    Raises RuntimeError when the variable is not set (the script was not started by the launcher).
    """
    return _directory(CHECKPOINT_DIR, create=True)


def data_dir() -> str:
    """The dataset's local path (``TRAINBOARD_DATA_DIR``): a directory (ImageFolder, a SageMaker
    channel, an Azure ML input) or, for a CSV/NPZ dataset, its file.

    Raises RuntimeError when the variable is not set: the script was not started by the launcher, or
    the job's dataset has no path (a built-in one).
    """
    return _directory(DATA_DIR, create=False)


def hparams() -> dict[str, Any]:
    """The job's training values (``TRAINBOARD_HPARAMS``): ``{"train.epochs": 3, "train.batch_size":
    32, "train.lr": 0.01, "train.seed": 0, "train.optimizer": "sgd", ...}``, every field of the job
    config's ``train`` section but ``init_from``/``init_mode`` (the job form's epochs, batch size, lr
    and seed, a sweep trial's sampled values, the hyperparameters' overrides). In a sweep, read your
    trial's values here (or take them as ``{train.lr}`` placeholders in the script's arguments)::

        lr = report.hparams()["train.lr"]

    Raises RuntimeError when the variable is not set (the script was not started by the launcher),
    ValueError when it does not hold a JSON object.
    """
    text = os.environ.get(HPARAMS, "").strip()
    if not text:
        raise RuntimeError(f"{HPARAMS} is not set: run the script under Trainboard's launcher (a job of kind "
                           "script, or python -m trainer_pkg.launch --config job.json with code.script set)")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{HPARAMS} is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{HPARAMS} must hold a JSON object, got {type(values).__name__}")
    return values


def init_from() -> str | None:
    """The local file this job starts from (``TRAINBOARD_INIT_FROM``), or None for a job that starts
    from scratch. Set for a continue or fine-tune of another job (:func:`init_mode` says which): the
    source job's ``<checkpoint dir>/last.pt`` (continue; fine-tune when it saved no ``model.pt``) or
    ``<model dir>/model.pt`` (fine-tune), as that job's script saved them (the source job's own file:
    read it, never write it); an object-store file is fetched to a local one first. Load it only when :func:`checkpoint_dir` holds no checkpoint
    of this job's own (a restarted job resumes its own progress)::

        source = report.init_from()
        if own_checkpoint is None and source is not None:
            model.load_state_dict(torch.load(source, map_location="cpu"))
    """
    return os.environ.get(INIT_FROM, "").strip() or None


def init_mode() -> str | None:
    """``"continue"`` (go on with the source's training state: weights, optimizer, step) or
    ``"finetune"`` (its weights only, a new optimizer from step 0) beside :func:`init_from`; None
    when the job starts from scratch (``TRAINBOARD_INIT_MODE``)."""
    return os.environ.get(INIT_MODE, "").strip() or None


# -- checks ---------------------------------------------------------------------------------------


def finish(code: int = 0) -> NoReturn:
    """End the script now with exit status ``code``, skipping the interpreter's teardown.

    Call it last, after ``torch.distributed.destroy_process_group()``. Left to the interpreter's
    shutdown, torch 2.13's C++ threads (gloo's, DDP's reducer) can be destroyed while still joinable,
    and the C++ runtime aborts a rank that finished its work ("terminate called without an active
    exception", SIGABRT); torchrun then fails the whole job. Trainboard's own trainer ends this way
    (``trainer_pkg.metrics.exit_process``). Before leaving: the ``atexit`` handlers run (a tracker's
    ``finish``, logging's flush), then stdout and stderr are flushed. Never returns."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def _check_step(step: Any, what: str = "report.log: step") -> int:
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise ValueError(f"{what} must be an int (the optimizer step), got {_short(step)}")
    value = step.__index__()  # numpy integers too
    if value < 0:
        raise ValueError(f"{what} must be 0 or more, got {value}")
    return value


def _check_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """``metrics`` as floats; ValueError listing every bad name and value at once."""
    if len(metrics) > MAX_USER_METRICS:
        raise ValueError(f"report.log: at most {MAX_USER_METRICS} metrics per call, got {len(metrics)}; "
                         "split them over several calls with the same step")
    problems, out = [], {}
    for name, value in metrics.items():
        if not USER_METRIC_NAME.fullmatch(name):
            problems.append(f"metric name {name!r} is not allowed: use 1-100 letters, digits or _ . / -, "
                            "starting with a letter or _")
            continue
        if name in RECORD_FIELDS:
            problems.append(f"metric name {name!r} is a field of the record itself; choose another "
                            f"(reserved: {', '.join(sorted(RECORD_FIELDS))})")
            continue
        if name.startswith(HARDWARE_PREFIX):
            problems.append(f"metric name {name!r} starts with {HARDWARE_PREFIX!r}, the launcher's hardware "
                            "series; choose another")
            continue
        number = _real(value)
        if number is None:
            problems.append(f"metric {name!r} must be a real number (int, float, numpy scalar or "
                            f"one-element tensor), got {type(value).__name__} {_short(value)}")
            continue
        out[name] = number
    if problems:
        raise ValueError("report.log: " + "; ".join(problems))
    return out


def _real(value: Any) -> float | None:
    """``float(value)`` for a number-like value; None for a string, a bool or anything float() refuses.

    Strings are refused although float() reads them: ``"nan"`` or ``"3"`` is a bug in the caller.
    """
    if isinstance(value, (str, bytes, bool)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # RuntimeError: a tensor of several elements
        return None
    return number if isinstance(number, float) else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_rank_zero() -> bool:
    """Rank 0 by torchrun's ``RANK``; a process without it (one process) is rank 0."""
    rank = os.environ.get("RANK", "").strip()
    return not rank or rank == "0"


def _is_uri(path: str) -> bool:
    return "://" in path


def _directory(variable: str, *, create: bool) -> str:
    path = os.environ.get(variable, "").strip()
    if not path:
        raise RuntimeError(
            f"{variable} is not set: run the script under Trainboard's launcher (a job of kind script, or "
            "python -m trainer_pkg.launch --config job.json with code.script set), or set it yourself"
            + ("; a built-in dataset has no path" if variable == DATA_DIR else ""))
    if create and not _is_uri(path):
        os.makedirs(path, exist_ok=True)
    return path


__all__ = ["CHECKPOINT_DIR", "CODE_DIR", "DATA_DIR", "HPARAMS", "INIT_FROM", "INIT_MODE", "MODEL_DIR",
           "checkpoint_dir", "data_dir", "hparams", "init_from", "init_mode", "log", "model_dir", "progress"]
