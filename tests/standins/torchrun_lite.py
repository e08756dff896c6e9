"""A torch-free torchrun, for the tests that run the REAL trainer but whose subject is not torchrun.

``python -m torch.distributed.run`` imports torch in its own process (about 2.5 CPU-seconds here)
before it starts a rank, and its elastic agent takes a second or two to wind down after the ranks
exit: a third of the CPU and a third of the wall time of a 2-rank run of the tests' digits jobs
(4.5 s against 7 s, measured by the commit that added this). The real trainer's tests start it
about 200 times. This module starts the same ranks, each a real interpreter running the real
trainer, from a process that imports no torch.

:func:`run` is torchrun's part for ``--nnodes N`` (static rendezvous: ``--node_rank``,
``--master_addr``, ``--master_port``; ``--standalone`` or one node: a free local port), with the
environment torch 2.13's agent gives each rank (checked by tests/trainer_pkg/test_torchrun_lite.py
against the real one): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_NAME``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_ERROR_FILE`` (a per-rank path in a directory removed
at the end), ``TORCHELASTIC_SIGNALS_TO_HANDLE``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` and
``OMP_NUM_THREADS=1`` when unset and nproc > 1. One difference, by design:
``TORCHELASTIC_USE_AGENT_STORE`` is ``False`` (there is no agent store), so rank 0's
``init_process_group`` hosts the TCP store at ``MASTER_ADDR:MASTER_PORT``, as under a launcher
other than torchrun. Each rank is ``[rank_python, -u, script...]`` in a session of its own (as torch's
SubprocessHandler starts it); SIGTERM/SIGINT are passed on; the exit code is torchrun 2.x's: 0 when
every rank exited 0; 1 when a rank failed (the others get SIGTERM, then SIGKILL after
:data:`TORCHRUN_CLOSE_S`, and a ``ChildFailedError`` summary naming the first failed rank goes to
stderr); 1 after it was signalled (a ``SignalException`` line on stderr). No restarts
(``--max_restarts`` is not taken) and no c10d rendezvous of several agents. Where the test process
started a rank zygote (:mod:`standins.rank_zygote`, by :func:`python`) and ``rank_python`` is its
interpreter, each rank is instead forked by the zygote, which has imported torch once, and becomes
that same command; otherwise (``TRAINBOARD_TEST_RANK_ZYGOTE=0``, another interpreter,
``--no_python``, the zygote unreachable) it is a plain subprocess.

:func:`python` is an interpreter wrapper (an executable file whose shebang is this interpreter)
that tests name where they would name ``sys.executable``: by its arguments (after an optional ``-u``)

``-m torch.distributed.run OPTS REST``
    :func:`run`, its ranks the real interpreter;
``-m trainer_pkg.launch ARGS``
    the real launcher (:func:`trainer_pkg.launch.main`) in this process, the torchrun it starts being
    this wrapper (``torchrun_command``'s ``python``), ended as the module's ``__main__`` ends it
    (:func:`trainer_pkg.metrics.exit_process`); everything else is the launcher's own;
anything else
    the real interpreter, ``exec``-ed with the same arguments.

The trainer stand-in (:mod:`standins.trainer`) uses :func:`run` as its torchrun, its ranks the
stand-in's own wrapper. Tests whose subject IS torchrun (its environment, its two-node rendezvous,
its signal handling with the launcher, the stand-in contract, the platform tests) start the real one.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping, Sequence

from standins import rank_zygote

REPO = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO / "tests"
TORCHRUN_POLL_S = 0.05
"""Seconds between two looks at the ranks (torchrun's own monitor interval is 0.1 s)."""
TORCHRUN_CLOSE_S = 30.0
"""Seconds torchrun gives its ranks after SIGTERM before SIGKILL (torch.distributed.elastic's value)."""
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""``TORCHELASTIC_SIGNALS_TO_HANDLE`` as torch 2.13's torchrun sets it by default."""
WRAPPER_DIR = REPO / "var" / "torchrun-lite"
"""Where :func:`python` writes its wrapper (``var/`` is git-ignored; ``make clean`` removes it)."""

_WRAPPER = """#!{python}
# Trainboard's tests (tests/standins/torchrun_lite.py): the real interpreter and trainer, with a
# torchrun that imports no torch.
import sys
sys.path.append({tests!r})
from standins.torchrun_lite import main
sys.exit(main(sys.argv[1:], wrapper={wrapper!r}))
"""


def parser(prog: str = "torchrun (torch-free, tests)") -> argparse.ArgumentParser:
    """The torchrun options :func:`run` takes (both spellings, as torchrun has them)."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    p.add_argument("--nnodes", default="1")
    p.add_argument("--nproc_per_node", "--nproc-per-node", default="1")
    p.add_argument("--node_rank", "--node-rank", type=int, default=0)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--master_addr", "--master-addr", default="")
    p.add_argument("--master_port", "--master-port", type=int, default=0)
    p.add_argument("-m", "--module", action="store_true")
    p.add_argument("--no_python", "--no-python", action="store_true")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def run(argv: Sequence[str], *, rank_python: str, prog: str = "torchrun (torch-free, tests)",
        prepare: Callable[[argparse.Namespace, str, float], Mapping[str, str]] | None = None,
        finish: Callable[[argparse.Namespace, str], None] | None = None) -> int:
    """torchrun's part (module docstring): start this node's ranks, pass signals on, wait; the exit
    code torchrun would give. ``prepare(args, run_id, started)`` adds variables to every rank's
    environment; ``finish(args, run_id)`` runs after the ranks are gone."""
    started = time.time()
    args = parser(prog).parse_args(list(argv))
    nnodes = int(str(args.nnodes).split(":")[-1])
    nproc = int(args.nproc_per_node)
    world = nnodes * nproc
    master_addr = args.master_addr or "localhost"
    master_port = args.master_port or free_port()
    run_id = uuid.uuid4().hex if args.standalone or nnodes == 1 else f"{master_addr}-{master_port}"
    if args.no_python:
        cmd = [args.training_script, *args.training_script_args]
    elif args.module:
        cmd = [rank_python, "-u", "-m", args.training_script, *args.training_script_args]
    else:
        cmd = [rank_python, "-u", args.training_script, *args.training_script_args]

    base = dict(os.environ)
    zygote = base.pop(rank_zygote.SOCKET_VAR, None) is not None and not args.no_python
    if "OMP_NUM_THREADS" not in base and nproc > 1:
        print("Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
              "your system being overloaded (torch-free torchrun, as torchrun does)", file=sys.stderr, flush=True)
        base["OMP_NUM_THREADS"] = "1"
    base.update(GROUP_RANK=str(args.node_rank), GROUP_WORLD_SIZE=str(nnodes), ROLE_NAME="default",
                LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
                MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), TORCHELASTIC_RUN_ID=run_id,
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_SIGNALS_TO_HANDLE=SIGNALS_TO_HANDLE, TORCHELASTIC_USE_AGENT_STORE="False",
                TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    if prepare is not None:
        base.update(prepare(args, run_id, started))

    signalled: list[int] = []
    ranks: list[subprocess.Popen | rank_zygote.RankProcess] = []

    def forward(signum, frame) -> None:
        signalled.append(signum)
        for proc in ranks:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    errors = Path(tempfile.mkdtemp(prefix="torchrun-lite-"))
    try:
        for local in range(nproc):
            rank = args.node_rank * nproc + local
            env = dict(base, LOCAL_RANK=str(local), RANK=str(rank), ROLE_RANK=str(rank),
                       TORCHELASTIC_ERROR_FILE=str(errors / "attempt_0" / str(local) / "error.json"))
            forked = rank_zygote.start(cmd, env) if zygote else None
            ranks.append(forked or subprocess.Popen(cmd, env=env, start_new_session=True))
        return _watch(ranks, signalled, args.training_script, args.node_rank * nproc)
    finally:
        _close(ranks, signal.SIGTERM)  # nothing left running, whatever raised
        shutil.rmtree(errors, ignore_errors=True)
        if finish is not None:
            finish(args, run_id)


def _watch(ranks: list[subprocess.Popen | rank_zygote.RankProcess], signalled: list[int], script: str, first_rank: int) -> int:
    """Wait for this node's ``ranks`` (global ranks from ``first_rank``); torchrun's exit code."""
    while True:
        codes = [proc.poll() for proc in ranks]
        if signalled:
            _close(ranks, signal.SIGTERM)
            print(f"torch.distributed.elastic.multiprocessing.api.SignalException: Process {os.getpid()} got "
                  f"signal: {signalled[0]} (torch-free torchrun)", file=sys.stderr, flush=True)
            return 1
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            local, code = failed[0]
            failure = (first_rank + local, ranks[local], time.time())
            _close(ranks, signal.SIGTERM)
            _failure_summary(script, failure, code, local)
            return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(TORCHRUN_POLL_S)


def _close(ranks: list[subprocess.Popen | rank_zygote.RankProcess], sig: int) -> None:
    """Signal the ranks still running, wait up to :data:`TORCHRUN_CLOSE_S`, then SIGKILL them."""
    for proc in ranks:
        if proc.poll() is None:
            proc.send_signal(sig)
    deadline = time.monotonic() + TORCHRUN_CLOSE_S
    for proc in ranks:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _failure_summary(script: str, failure: tuple[int, subprocess.Popen, float], code: int, local: int) -> None:
    """torchrun's report of a failed rank (``ChildFailedError`` and its table), on stderr."""
    rank, proc, when = failure
    bar = "=" * 60
    print("\n".join([
        "Traceback (most recent call last):",
        "  (torch-free torchrun: torchrun's agent)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        bar, f"{script} FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "-" * 60,
        "Root Cause (first observed failure):", "[0]:",
        f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(when))}",
        f"  host      : {socket.gethostname()}",
        f"  rank      : {rank} (local_rank: {local})",
        f"  exitcode  : {code} (pid: {proc.pid})",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        bar]), file=sys.stderr, flush=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (what ``--standalone`` picks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the interpreter wrapper ----------------------------------------------------------------------


def python() -> str:
    """Path of the interpreter wrapper (module docstring), written on first use (mode 0755 in
    :data:`WRAPPER_DIR`, readable by every user; atomic, so concurrent xdist workers agree). Starts
    this process's rank zygote (:func:`standins.rank_zygote.ensure`) unless
    ``TRAINBOARD_TEST_RANK_ZYGOTE=0``: the agents this process starts then fork their ranks from it."""
    rank_zygote.ensure()
    return wrapper()


def wrapper() -> str:
    """Path of the interpreter wrapper, written on first use, without starting a rank zygote (what
    :func:`python` returns; for a process whose agents never reach one, e.g. the GPU box's default
    interpreter, whose jobs start from an allowlisted environment)."""
    path = WRAPPER_DIR / "python"
    text = _WRAPPER.format(python=sys.executable, tests=str(TESTS_DIR), wrapper=str(path))
    try:
        if path.read_text(encoding="utf-8") == text:
            return str(path)
    except FileNotFoundError:
        pass
    WRAPPER_DIR.mkdir(parents=True, exist_ok=True)
    tmp = WRAPPER_DIR / f".python.tmp-{os.getpid()}"
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return str(path)


def main(argv: Sequence[str], *, wrapper: str) -> int:
    """The wrapper's entry: ``argv`` as the interpreter got it (module docstring)."""
    argv = list(argv)
    rest = argv[1:] if argv[:1] == ["-u"] else argv
    if rest[:2] == ["-m", "torch.distributed.run"]:
        return run(rest[2:], rank_python=sys.executable)
    if rest[:2] == ["-m", "trainer_pkg.launch"]:
        sys.path[0] = os.getcwd()  # as `python -m` has it (here it is the wrapper's directory)
        from trainer_pkg import launch
        from trainer_pkg.metrics import exit_process

        launch.torchrun_command = functools.partial(launch.torchrun_command, python=wrapper)
        # Ended as `python -m trainer_pkg.launch` ends (its __main__): a job of one process trains in
        # this process, and the interpreter's teardown with gloo's threads still alive can abort the
        # finished run (SIGABRT, exit -6), intermittently and more often under load.
        exit_process(launch.main(list(rest[2:])))  # never returns
    os.execv(sys.executable, [sys.executable, *argv])
    return 127  # not reached: execv replaces this process or raises
