"""A torch-free stand-in for Trainboard's trainer under torchrun, for the tests whose subject is a
job's life (submit, cancel, max runtime, a lost supervisor, a budget stop, an orphan), not its
training. It starts in a fraction of a second and takes its optimizer steps only when the test
allows them, so a test holds a job at step N instead of hoping that N epochs outlast the load.

It is an *interpreter stand-in*. :meth:`TrainerStandin.create` writes an executable file
``<dir>/python`` whose shebang is the real interpreter; a test names it wherever Trainboard names
the interpreter that has torch (a GPU box's ``python`` setting: ``TRAINBOARD_GPUBOX_PYTHON``, the
backend config's ``"python"``), and the backend starts it exactly as it would start the real one.
By its arguments (after an optional ``-u``) it is

``-m torch.distributed.run OPTS REST``
    a torchrun (:func:`torchrun`, :mod:`standins.torchrun_lite`'s): ``--nnodes``, ``--nproc_per_node``/``--nproc-per-node``,
    ``--node_rank``, ``--standalone``, ``--master_addr``, ``--master_port`` (either spelling), then
    ``-m module args`` or ``script args``. It starts ``nproc`` ranks ``[<dir>/python, -u, *REST]``,
    each in a session of its own, with torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``TORCHELASTIC_*`` (and ``OMP_NUM_THREADS=1`` when unset and nproc > 1), passes
    SIGTERM/SIGINT on to them and exits as torchrun 2.x does: 0 when every rank exited 0; 1 when a
    rank failed (the others get SIGTERM, then SIGKILL after ``torchrun_lite.TORCHRUN_CLOSE_S``; a
    ``ChildFailedError`` summary naming the first failed rank goes to stderr); 1 after it was
    signalled, whatever the ranks did (a ``SignalException`` line on stderr; the launcher turns that
    into 0 when the ranks stopped cleanly, see :mod:`trainer_pkg.launch`).
``-m trainer_pkg.launch ARGS``
    the REAL launcher (:func:`trainer_pkg.launch.main`) in this process, with two parts replaced: the
    torchrun it starts is this stand-in (``torchrun_command``'s ``python``), and its in-process
    training (``_train``) is :func:`train`. Platform detection, the ``[launch] ...`` lines, the
    environment, failure messages and exit codes are the launcher's own.
anything else
    the real interpreter, ``exec``-ed with the same arguments (a user's script, ``-c``, ``-m venv``,
    pip).

:func:`train` writes what the real trainer (``trainer_pkg/train.py``) writes, from the JobConfig:
rank 0's records (:mod:`trainer_pkg.metrics`: ``started`` after the first step, ``step`` every
``train.log_every_steps`` steps (every 10 when 0), ``epoch`` after each epoch with ``val_loss``,
``val_accuracy``, ``epochs_done``, ``sample_order_digest`` and ``rank_memory``, ``completed``; a
``stopped`` record after SIGTERM), on stdout and in ``<output_dir>/metrics.jsonl``;
``<checkpoint_dir>/last.pt`` after each epoch and on SIGTERM, ``<output_dir>/model.pt`` at the end;
``[trainer] ...`` lines on rank 0. Steps per epoch are the real ones for ``digits`` (1,797 samples,
``data.val_fraction`` held out, sharded over the data-parallel ranks, ``train.batch_size``,
``train.grad_accum_steps``), used for every dataset (it reads no data). ``train.max_steps`` ends the
loop as in the real trainer. Values are made up but follow ``train.lr`` as real training does
(:func:`learned`): a loss that falls from chance (ln 10) and an accuracy that rises from chance
(0.1) as ``train.lr`` × steps grows, so at lr 0.05 it passes 0.8 in the second epoch of digits and at
lr 1e-6 it stays at chance (what the contract test finds in the real trainer, and a sweep's pruner
needs); the
files hold JSON, not torch pickles: a run resumes from a ``last.pt`` the stand-in wrote (``started``
then carries ``resumed: true``), and fails (exit 1, ``trainer error: ...``) on any other. It never
imports torch (a run that finds torch imported fails saying so).

The gate (``<dir>/gate``), read by every rank before each optimizer step (every
:data:`GATE_POLL_S` while it waits):

``steps``      the number of optimizer steps every job may have taken so far (a decimal integer);
               absent: no limit, every job runs straight to its end. :meth:`TrainerStandin.hold`.
``at/*.json``  written by each rank: ``{"output_dir", "rank", "world_size", "step", "state", "pid"}``,
               ``state`` one of ``waiting`` (held at the gate after ``step`` steps), ``running``,
               ``completed``, ``stopped``, ``failed``. :meth:`TrainerStandin.wait_at`.
``fail.json``  ``{"step", "rank", "code", "message"}``: before optimizer step ``step`` (1-based), rank
               ``rank`` (every rank when null) raises ``RuntimeError(message)``, prints the traceback
               and ``trainer error: [rank R: ]RuntimeError: message`` on stderr and exits ``code``, as
               the real trainer does for an unexpected error. :meth:`TrainerStandin.fail`.

SIGTERM/SIGINT: the rank stops at once (while held, too); the ranks of one torchrun agree through a
file in ``<dir>/gate/groups/``, so a signal to one rank stops all, as the real ranks' all-reduce
does. Rank 0 writes ``last.pt`` (the position reached) and a ``stopped`` record; every rank exits 0.

Several nodes (``--nnodes N --node_rank K --master_addr A --master_port P``, one stand-in torchrun
per node, as Slurm's srun tasks or a TrainJob's pods start them): node K's ranks are ``K × nproc`` to
``K × nproc + nproc - 1`` of ``N × nproc`` (torchrun's static rendezvous), and every node's ranks share
the group ``<dir>/gate/groups/A-P``; a stop file there older than the node's torchrun (a finished
job's that used the same address and port) is not a stop.

Pass-through (``<dir>/pass-through``, :meth:`TrainerStandin.pass_through`): while it exists, the
wrapper ``exec``s the real interpreter whatever its arguments, so the real torchrun and trainer run
and the gate is not read. For a module whose one worker names the wrapper in a host setting it reads
once (a Slurm installation's ``TRAINBOARD_SLURM_PYTHON``) and that has real-trainer tests as well as
held ones. Each start decides once; processes already running keep what they are.

A rank held for :data:`HOLD_LIMIT_S` fails (a test that never released it must not leave processes).
The wrapper bakes in the gate's path: a GPU box scrubs the job's environment, so no variable of the
test's reaches the ranks. The jobs must run as a user that can read ``<dir>`` (not an isolated uid;
pytest's temporary directories are mode 0700: the test Slurm cluster's slurmd and jobs run as root,
as the tests do).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

TESTS_DIR = Path(__file__).resolve().parents[1]
GATE_POLL_S = 0.02
"""Seconds between two looks at the gate while a rank is held."""
HOLD_LIMIT_S = 600.0
"""Seconds a rank waits at the gate before it fails (a test that forgot to release it)."""
GROUP_VAR = "TRAINBOARD_STANDIN_GROUP"
"""Set in the ranks of one stand-in torchrun: the directory through which they agree on a stop."""
SINCE_VAR = "TRAINBOARD_STANDIN_SINCE"
"""Set in the ranks of one stand-in torchrun: when it started (Unix time); a stop file in the group
directory older than that is a finished job's."""

DIGITS_SAMPLES = 1797
"""scikit-learn's digits: the steps per epoch of every stand-in run are computed from this size."""
RECORD_FIRST_STEPS = 10
"""Steps between ``step`` records when ``train.log_every_steps`` is 0 (the real trainer's cadence
before it has measured a step; the stand-in's steps take no time to measure)."""
LEARNING_GAIN = 0.8
"""How fast the stand-in "learns": the fraction learned after ``s`` steps at learning rate ``lr`` is
``1 - exp(-LEARNING_GAIN × lr × s)`` (:func:`learned`)."""
CHANCE_LOSS = math.log(10)
"""Cross-entropy of a uniform guess over digits' 10 classes: the stand-in's loss before it learns."""
CHECKPOINT_NAME = "last.pt"
MODEL_NAME = "model.pt"
STANDIN_MARK = "trainboard-trainer-standin"
"""Key of the JSON files the stand-in writes as ``last.pt`` and ``model.pt``."""
PASS_THROUGH_NAME = "pass-through"
FAKE_NVML_NAME = "fake-nvml"
"""While ``<dir>/fake-nvml`` exists (:meth:`TrainerStandin.fake_nvml`), the launcher of a rank started
after it finds the NVML stand-in (tests/standins/fake_nvml) as ``pynvml``: its hardware samples carry
that stand-in's GPU figures (GPU i at 10 × (i + 1) %)."""
FAKE_NVML_DIR = Path(__file__).resolve().parent / "fake_nvml"
"""The file in the stand-in's directory that makes the wrapper the real interpreter (module docstring)."""

_WRAPPER = """#!{python}
# Trainboard's trainer stand-in (tests/standins/trainer.py): a torchrun and trainer without torch.
# Named where the interpreter that has torch is named; it steps only as {gate}/steps allows.
import sys
sys.path.append({tests!r})
from standins.trainer import main
sys.exit(main(sys.argv[1:], wrapper={wrapper!r}, gate={gate!r}))
"""


# -- the test's side ---------------------------------------------------------------------------


class TrainerStandin:
    """A stand-in interpreter and its gate, in one directory (:meth:`create`).

    ``python`` is the path to name as the interpreter; ``hold``/``release``/``fail`` write the gate;
    ``wait_at``/``positions`` read where the ranks are.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.gate = self.directory / "gate"
        self.python = str(self.directory / "python")
        """Absolute path of the executable wrapper (the ``python`` setting's value)."""

    @classmethod
    def create(cls, directory: Path) -> "TrainerStandin":
        """Write ``<directory>/python`` (mode 0755, shebang ``sys.executable``) and an open gate."""
        standin = cls(Path(directory).resolve())
        (standin.gate / "at").mkdir(parents=True, exist_ok=True)
        text = _WRAPPER.format(python=sys.executable, tests=str(TESTS_DIR), wrapper=standin.python,
                               gate=str(standin.gate))
        Path(standin.python).write_text(text, encoding="utf-8")
        os.chmod(standin.python, 0o755)
        return standin

    def hold(self, steps: int = 0) -> None:
        """Let every job take ``steps`` optimizer steps in all (0: none; ``started`` comes with the
        first), then wait at the gate until a later ``hold`` or :meth:`release`."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        _write_atomic(self.gate / "steps", f"{steps}\n")

    def pass_through(self, on: bool = True) -> None:
        """On: every later start of the wrapper ``exec``s the real interpreter with its arguments (the
        real torchrun and trainer; the gate is not read). Off: the stand-in again."""
        marker = self.directory / PASS_THROUGH_NAME
        if on:
            marker.write_text("the wrapper execs the real interpreter while this file exists\n", encoding="utf-8")
        else:
            marker.unlink(missing_ok=True)

    def fake_nvml(self, on: bool = True) -> None:
        """On: the launchers started from now on read GPUs from the NVML stand-in
        (tests/standins/fake_nvml: four GPUs, GPU i busy 10 × (i + 1) % of the time), as on a GPU
        machine; off: NVML as the machine has it."""
        marker = self.directory / FAKE_NVML_NAME
        if on:
            marker.write_text("the launcher imports tests/standins/fake_nvml as pynvml\n", encoding="utf-8")
        else:
            marker.unlink(missing_ok=True)

    def release(self) -> None:
        """No limit: held jobs go on, and every job runs to its end at full speed."""
        (self.gate / "steps").unlink(missing_ok=True)

    def fail(self, *, step: int = 1, rank: int | None = None, code: int = 1,
             message: str = "the trainer stand-in was told to fail") -> None:
        """Make rank ``rank`` (every rank when None) of every job raise ``RuntimeError(message)``
        before optimizer step ``step`` (1-based: 1 fails before ``started``) and exit ``code``."""
        _write_atomic(self.gate / "fail.json", json.dumps(
            {"step": step, "rank": rank, "code": code, "message": message}))

    def positions(self) -> list[dict[str, Any]]:
        """Every rank's last report (the ``at/*.json`` objects of the module docstring), by output
        directory and rank."""
        found = []
        for path in sorted((self.gate / "at").glob("*.json")):
            try:
                found.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):  # being replaced: read it next time
                continue
        return sorted(found, key=lambda p: (p["output_dir"], p["rank"]))

    def at(self, step: int, output_dir: str | os.PathLike | None = None) -> dict[str, Any] | None:
        """The job held with every rank at the gate after ``step`` steps, or None:
        ``{"output_dir", "world_size", "pids"}`` (pids by rank). ``output_dir``: only a job whose
        output directory is it or lies under it (a GPU box's run directory)."""
        jobs: dict[str, list[dict[str, Any]]] = {}
        for p in self.positions():
            jobs.setdefault(p["output_dir"], []).append(p)
        for out, ranks in jobs.items():
            if output_dir is not None and not _under(out, os.fspath(output_dir)):
                continue
            world = ranks[0]["world_size"]
            if (len(ranks) == world and sorted(r["rank"] for r in ranks) == list(range(world))
                    and all(r["state"] == "waiting" and r["step"] == step for r in ranks)):
                return {"output_dir": out, "world_size": world, "pids": [r["pid"] for r in ranks]}
        return None

    def wait_at(self, step: int, output_dir: str | os.PathLike | None = None, *, timeout: float = 60.0) -> dict[str, Any]:
        """Wait (polling every 20 ms, failing the test after ``timeout`` seconds) until a job is held
        with every rank at the gate after ``step`` steps (see :meth:`at`); returns :meth:`at`'s value."""
        from polling import wait_for

        return wait_for(lambda: self.at(step, output_dir), timeout=timeout, interval=0.02,
                        what=f"a stand-in job held at step {step} (ranks now: {self.positions()})")


def _under(path: str, top: str) -> bool:
    path, top = os.path.abspath(path), os.path.abspath(top)
    return path == top or path.startswith(top.rstrip("/") + "/")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# -- the interpreter's side: dispatch ----------------------------------------------------------


def main(argv: Sequence[str], *, wrapper: str, gate: str) -> int:
    """The wrapper's entry: ``argv`` as the interpreter got it (module docstring)."""
    argv = list(argv)
    if os.path.exists(os.path.join(os.path.dirname(wrapper), PASS_THROUGH_NAME)):
        os.execv(sys.executable, [sys.executable, *argv])
    rest = argv[1:] if argv[:1] == ["-u"] else argv
    if rest[:2] == ["-m", "torch.distributed.run"]:
        return torchrun(rest[2:], wrapper=wrapper, gate=Path(gate))
    if rest[:2] == ["-m", "trainer_pkg.launch"]:
        return run_launcher(rest[2:], wrapper=wrapper, gate=Path(gate))
    os.execv(sys.executable, [sys.executable, *argv])
    return 127  # not reached: execv replaces this process or raises


def run_launcher(args: Sequence[str], *, wrapper: str, gate: Path) -> int:
    """``python -m trainer_pkg.launch ARGS`` with the real launcher: its torchrun is this stand-in,
    its in-process training :func:`train`."""
    sys.path[0] = os.getcwd()  # as `python -m` has it (here it is the wrapper's directory)
    if os.path.exists(os.path.join(os.path.dirname(wrapper), FAKE_NVML_NAME)):
        sys.path.insert(1, str(FAKE_NVML_DIR))  # before site-packages' nvidia-ml-py
    from trainer_pkg import launch

    launch.torchrun_command = functools.partial(launch.torchrun_command, python=wrapper)
    launch._train = functools.partial(train, gate=gate)
    return launch.main(list(args))


# -- torchrun ------------------------------------------------------------------------------------


def torchrun(argv: Sequence[str], *, wrapper: str, gate: Path) -> int:
    """torchrun's part (module docstring): :func:`standins.torchrun_lite.run` with this stand-in's
    ranks, which agree on a stop through ``<gate>/groups/<run id>``."""
    from standins import torchrun_lite

    def prepare(args, run_id: str, started: float) -> dict[str, str]:
        group = gate / "groups" / run_id
        group.mkdir(parents=True, exist_ok=True)
        return {GROUP_VAR: str(group), SINCE_VAR: repr(started)}

    def finish(args, run_id: str) -> None:
        if int(str(args.nnodes).split(":")[-1]) == 1:  # another node's ranks may still read a shared one
            shutil.rmtree(gate / "groups" / run_id, ignore_errors=True)

    return torchrun_lite.run(argv, rank_python=wrapper, prog="torchrun (trainer stand-in)", prepare=prepare,
                             finish=finish)


# -- the trainer -------------------------------------------------------------------------------


class _Stop:
    """SIGTERM/SIGINT on this rank, or on another rank of the same torchrun or of another node's
    torchrun of the same job (the group file, touched by the rank that got the signal; one older
    than this rank's torchrun is a finished job's)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.since = float(os.environ.get(SINCE_VAR, "0"))
        group = os.environ.get(GROUP_VAR, "")
        self.group_file = Path(group, "stop") if group else None

    def install(self) -> "_Stop":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def requested(self) -> bool:
        if self.received is not None:
            if self.group_file is not None:
                self.group_file.touch()
            return True
        if self.group_file is None:
            return False
        try:
            return self.group_file.stat().st_mtime >= self.since
        except FileNotFoundError:
            return False


class _Gate:
    """This rank's view of the gate directory (module docstring)."""

    def __init__(self, gate: Path, output_dir: str, rank: int, world_size: int) -> None:
        self.gate, self.rank, self.world_size = gate, rank, world_size
        self.output_dir = os.path.abspath(output_dir)
        key = hashlib.sha256(self.output_dir.encode()).hexdigest()[:16]
        self.at_file = gate / "at" / f"{key}-rank{rank}.json"

    def allowed(self) -> int | None:
        try:
            return int((self.gate / "steps").read_text(encoding="utf-8").strip())
        except FileNotFoundError:
            return None

    def report(self, step: int, state: str) -> None:
        self.at_file.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.at_file, json.dumps({
            "output_dir": self.output_dir, "rank": self.rank, "world_size": self.world_size, "step": step,
            "state": state, "pid": os.getpid()}))

    def wait(self, done: int, stop: _Stop) -> bool:
        """Before optimizer step ``done + 1``: wait until the gate allows it; False when a stop came
        first. Raises RuntimeError after :data:`HOLD_LIMIT_S`."""
        allowed = self.allowed()
        if allowed is None or done < allowed:
            return not stop.requested()
        self.report(done, "waiting")
        give_up = time.monotonic() + HOLD_LIMIT_S
        while True:
            if stop.requested():
                return False
            allowed = self.allowed()
            if allowed is None or done < allowed:
                self.report(done, "running")
                return True
            if time.monotonic() > give_up:
                raise RuntimeError(f"trainer stand-in held at step {done} for {HOLD_LIMIT_S:g} s: the test never "
                                   f"released it ({self.gate}/steps)")
            time.sleep(GATE_POLL_S)

    def failure(self, step: int) -> dict[str, Any] | None:
        """The ``fail.json`` order for this rank before optimizer step ``step``, or None."""
        try:
            order = json.loads((self.gate / "fail.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        if order["step"] == step and order.get("rank") in (None, self.rank):
            return order
        return None


def learned(lr: float, steps: int) -> tuple[float, float]:
    """The stand-in's ``(loss, accuracy)`` after ``steps`` optimizer steps at learning rate ``lr``:
    with ``f = 1 - exp(-LEARNING_GAIN × lr × steps)`` (0 before any learning, towards 1), loss
    ``CHANCE_LOSS × (1 - f) + 0.02`` (nats, > 0) and accuracy ``0.1 + 0.89 × f`` (in [0.1, 0.99]).
    E.g. accuracy 0.64 after 23 steps (an epoch of digits at batch 64) and 0.85 after 46 at lr 0.05 (the
    real trainer's mlp: 0.64, 0.85), 0.1000 at lr 1e-6."""
    f = 1.0 - math.exp(-LEARNING_GAIN * lr * steps)
    return CHANCE_LOSS * (1.0 - f) + 0.02, 0.1 + 0.89 * f


def batches_per_epoch(cfg: Any, world_size: int) -> int:
    """Batches one rank reads in an epoch of digits for ``cfg`` on ``world_size`` ranks, as the real
    trainer cuts them: the training split (1,797 less ``round(1797 × data.val_fraction)``) sharded
    over the data-parallel ranks (padded: the ceiling), cut into ``train.batch_size`` batches (a
    pipeline drops an incomplete last one). An optimizer step takes ``train.grad_accum_steps`` of
    them (the epoch's last step what is left)."""
    t, p = cfg.train, cfg.parallel
    n = DIGITS_SAMPLES - int(round(DIGITS_SAMPLES * cfg.data.val_fraction))
    if p.strategy == "pipeline":
        stages = p.pipeline_stages or world_size
        shard = math.ceil(n / max(1, world_size // stages))
        batches = shard // t.batch_size
    else:
        shard = math.ceil(n / world_size)
        batches = math.ceil(shard / t.batch_size)
    return max(1, batches)


def train(cfg: Any, *, gate: Path) -> int:
    """One rank of the job ``cfg`` (a :class:`trainer_pkg.config.JobConfig`), the topology from
    torchrun's variables (one process when unset); the exit code. Replaces ``trainer_pkg.launch._train``."""
    from trainer_pkg.metrics import report_error

    stop = _Stop().install()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    run = _Run(cfg, rank, world, _Gate(gate, cfg.output.output_dir, rank, world), stop)
    try:
        code = run.run()
    except RuntimeError as exc:
        traceback.print_exc()
        report_error(f"{type(exc).__name__}: {exc}")
        run.gate.report(run.step, "failed")
        return run.fail_code
    if "torch" in sys.modules:
        report_error("the trainer stand-in imported torch (tests/standins/trainer.py must not)")
        return 1
    return code


class _Run:
    """One rank's run (the real ``trainer_pkg.train._run``, without tensors)."""

    def __init__(self, cfg: Any, rank: int, world_size: int, gate: _Gate, stop: _Stop) -> None:
        self.cfg, self.rank, self.world_size, self.gate, self.stop = cfg, rank, world_size, gate, stop
        self.main = rank == 0
        self.ckpt_path = os.path.join(cfg.output.resolved_checkpoint_dir, CHECKPOINT_NAME)
        self.model_path = os.path.join(cfg.output.output_dir, MODEL_NAME)
        self.step = 0
        self.unrecorded = 0  # steps since the last record (the real window's samples)
        self.fail_code = 1
        self._records = None
        self.total_steps = 0

    def log(self, message: str) -> None:
        from trainer_pkg.metrics import print_line

        if self.main:
            print_line(f"[trainer] {message}")

    def record(self, event: str, epoch: int, **extra: Any) -> None:
        """Rank 0: one record in metrics.jsonl and on stdout, with the window fields when steps were
        taken since the previous one (as the real ``Recorder.report``)."""
        if not self.main:
            self.unrecorded = 0
            return
        from trainer_pkg.metrics import encode_record, format_metric_line, print_line

        record: dict[str, Any] = {"event": event, "time": time.time(), "epoch": epoch, "step": self.step,
                                  "world_size": self.world_size, "lr": self.cfg.train.lr}
        if self.total_steps:  # as the real Recorder: the steps the run takes (its planned_steps)
            record["total_steps"] = self.total_steps
        if self.unrecorded:
            record.update(self._window())
        if self.cfg.train.grad_clip_norm > 0:
            record["grad_norm"] = 1.0
        record.update(extra)
        self.unrecorded = 0
        self._records.write(json.dumps(encode_record(record), sort_keys=True, allow_nan=False) + "\n")
        self._records.flush()
        print_line(format_metric_line(record))

    def _window(self) -> dict[str, Any]:
        w, s = self.world_size, self.step
        per_rank = [float(self.cfg.train.batch_size) * 1000.0] * w
        loss, accuracy = learned(self.cfg.train.lr, s)
        fields = {"train_loss": loss, "train_accuracy": accuracy,
                  "samples_per_s": sum(per_rank), "rank_samples_per_s": per_rank,
                  "rank_step_time_s": [0.001] * w, "rank_data_wait_s": [0.0001] * w,
                  "rank_compute_s": [0.0005] * w, "rank_sync_wait_s": [0.0005] * w}
        if w > 1:
            fields["wait_for_slowest_s"] = 0.0
        return fields

    def rank_memory(self) -> list[dict[str, Any]]:
        one = {"activations_bytes": 0, "device": "cpu", "grads_bytes": 0, "optimizer_bytes": 0,
               "params_bytes": 0, "peak_bytes": 0}
        return [dict(one) for _ in range(self.world_size)]

    def save(self, path: str, **state: Any) -> None:
        """Rank 0 writes ``path`` atomically (temp file + rename), JSON marked as the stand-in's."""
        if not self.main:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({STANDIN_MARK: True, "world_size": self.world_size, **state}, f)
        os.replace(tmp, path)

    def resume_point(self) -> dict[str, Any] | None:
        """The stand-in checkpoint to continue from, or None; RuntimeError for a real one."""
        if not os.path.exists(self.ckpt_path):
            return None
        try:
            with open(self.ckpt_path, encoding="utf-8") as f:
                state = json.load(f)
            if state.get(STANDIN_MARK):
                return state
        except (UnicodeDecodeError, ValueError):
            pass
        raise RuntimeError(f"{self.ckpt_path} was not written by the trainer stand-in; it cannot resume from it")

    def check_order(self, step: int) -> None:
        order = self.gate.failure(step)
        if order is not None:
            self.fail_code = int(order.get("code", 1))
            raise RuntimeError(order.get("message") or "the trainer stand-in was told to fail")

    def run(self) -> int:
        cfg, t = self.cfg, self.cfg.train
        self.log(f"world size {self.world_size} (trainer stand-in: no torch, no data)")
        ckpt = self.resume_point()
        start_epoch, start_batch = (ckpt["epoch"], ckpt["batches_done"]) if ckpt else (0, 0)
        self.step = ckpt["step"] if ckpt else 0
        if ckpt:
            self.log(f"resuming from {self.ckpt_path}: epoch {start_epoch}, batch {start_batch}, step {self.step}")
        batches = batches_per_epoch(cfg, self.world_size)
        self.total_steps = t.epochs * math.ceil(batches / t.grad_accum_steps)
        self.total_steps = min(self.total_steps, t.max_steps) if t.max_steps else self.total_steps
        first_step = self.step + 1
        done = lambda: bool(t.max_steps) and self.step >= t.max_steps  # noqa: E731
        if self.main:
            os.makedirs(cfg.output.output_dir, exist_ok=True)
            self._records = open(os.path.join(cfg.output.output_dir, "metrics.jsonl"), "a" if ckpt else "w",
                                 encoding="utf-8")
        try:
            self.gate.report(self.step, "running")
            last_epoch = max(start_epoch - 1, 0)
            for epoch in range(start_epoch, t.epochs):
                if done():
                    break
                last_epoch = epoch
                b = start_batch if epoch == start_epoch else 0
                while b < batches and not done():
                    if not self.gate.wait(self.step, self.stop):
                        return self.stopped(epoch, b)
                    self.check_order(self.step + 1)
                    b = min(b + t.grad_accum_steps, batches)
                    self.step += 1
                    self.unrecorded += 1
                    if self.step == first_step:
                        self.record("started", epoch, resumed=ckpt is not None)
                    elif self.step % (t.log_every_steps or RECORD_FIRST_STEPS) == 0:
                        self.record("step", epoch)
                finished = b >= batches
                epochs_done = epoch + 1 if finished else epoch
                val_loss, val_accuracy = learned(t.lr, self.step)
                digests = [hashlib.sha256(f"{t.seed}/{epoch}/{r}".encode()).hexdigest()[:16]
                           for r in range(self.world_size)]
                self.record("epoch", epoch, val_loss=val_loss, val_accuracy=val_accuracy,
                            sample_order_digest=digests, rank_memory=self.rank_memory(), epochs_done=epochs_done)
                self.log(f"epoch {epoch}: val_loss {val_loss:.4f} val_accuracy {val_accuracy:.4f}")
                self.save(self.ckpt_path, epoch=epochs_done, batches_done=0 if finished else b, step=self.step)
            self.save(self.model_path, step=self.step)
            self.record("completed", last_epoch, rank_memory=self.rank_memory())
            self.log(f"done: {self.model_path}")
            self.gate.report(self.step, "completed")
            return 0
        finally:
            if self._records is not None:
                self._records.close()

    def stopped(self, epoch: int, batches_done: int) -> int:
        """Every rank stops: rank 0 checkpoints the position and emits ``stopped``; exit 0."""
        self.save(self.ckpt_path, epoch=epoch, batches_done=batches_done, step=self.step)
        self.record("stopped", epoch)
        self.log(f"stopped by signal at epoch {epoch}, step {self.step}; checkpoint {self.ckpt_path}")
        self.gate.report(self.step, "stopped")
        return 0
