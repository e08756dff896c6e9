"""A rank of a user's script, as the launcher starts it: install the hang dump, run the network preflight
when the backend asks for it, then run the script as ``python`` would have.

    python -m trainer_pkg.rank_entry /abs/code/train.py --lr 0.1      # = python /abs/code/train.py --lr 0.1
    python -m trainer_pkg.rank_entry -m mypkg.train --lr 0.1          # = python -m mypkg.train --lr 0.1

:func:`trainer_pkg.hang.install_rank_dump` first (SIGUSR1 writes every thread's stack where the
launcher's watchdog reads it; nothing when the launcher set no ``TRAINBOARD_HANG_DIR``), then
:func:`trainer_pkg.preflight.maybe_run` (nothing unless ``TRAINBOARD_PREFLIGHT=1``: the network measured
across the ranks; a network below the backend's minimum ends the rank with exit code 3 before the
script's first line), then the script runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as Python sets them for it (the
script's directory; the working directory for ``-m``). Its exit code and traceback are its own: an
exception it does not catch is printed without this module's and :mod:`runpy`'s frames (its traceback
starts at the script, as under ``python``) and the rank exits 1, having written one line naming it
to ``TRAINBOARD_RANK_ERROR_FILE`` when its launcher set one. Torch-free (the preflight imports
torch only when it runs).
"""

from __future__ import annotations

import os
import runpy
import sys
from types import TracebackType

from trainer_pkg import preflight
from trainer_pkg.hang import install_rank_dump
from trainer_pkg.metrics import exit_process


_OWN_FRAMES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
"""Source files whose frames come before the script's in a traceback (this entry and :mod:`runpy`,
which Python 3.11 runs frozen)."""


def _script_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from its first frame that is not :data:`_OWN_FRAMES`' (the script's own)."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in _OWN_FRAMES
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in _OWN_FRAMES):
        tb = tb.tb_next
    return tb


ERROR_FILE_ENV = "TRAINBOARD_RANK_ERROR_FILE"
"""Set by a launcher that starts the ranks itself (the TensorFlow one): where a rank that ends on an
uncaught exception writes one line naming it (:func:`error_summary`), for the launcher's failure reason."""


def error_summary(exc: BaseException, code_dir: str) -> str:
    """One line naming an uncaught exception where the user's code raised it: ``helpers.py:2 in load:
    ValueError: bad shard 7`` — the innermost frame of a file under ``code_dir`` (the path relative to
    it; ``in <function>`` left out at module level), for a SyntaxError the file and line it names; the
    exception alone when no frame is the user's. At most 1,000 characters."""
    root = os.path.realpath(code_dir) + os.sep
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    where = ""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        path = os.path.realpath(exc.filename)
        where = f"{os.path.relpath(path, root) if path.startswith(root) else os.path.basename(path)}:{exc.lineno}"
    tb = exc.__traceback__
    while tb is not None:
        path = os.path.realpath(tb.tb_frame.f_code.co_filename)
        if path.startswith(root):
            func = tb.tb_frame.f_code.co_name
            where = f"{os.path.relpath(path, root)}:{tb.tb_lineno}" + (f" in {func}" if func != "<module>" else "")
        tb = tb.tb_next
    line = f"{where}: {text}" if where else text
    return " ".join(line.split())[:1000]


def _write_error(exc: BaseException, code_dir: str) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(error_summary(exc, code_dir) + "\n")
    except OSError:
        pass  # the traceback is on stderr: the launcher names the exit code instead


def main(argv: list[str]) -> None:
    if not argv or argv[0] == "-m" and len(argv) < 2:
        sys.exit("usage: python -m trainer_pkg.rank_entry (SCRIPT.py | -m MODULE) [ARGS...]")
    install_rank_dump()
    stopped = preflight.maybe_run("auto")  # the script's backend is its own: nccl where CUDA is, else gloo
    if stopped is not None:
        exit_process(stopped)
    code_dir = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    try:
        _run(argv)
    except Exception as exc:  # what python prints for an uncaught exception, from the script's frame on
        # None when the exception came before the script's first frame (a SyntaxError in it: python
        # prints the file, line and caret from the exception itself, without a traceback).
        exc = exc.with_traceback(_script_traceback(exc.__traceback__))
        sys.excepthook(type(exc), exc, exc.__traceback__)
        _write_error(exc, code_dir)
        sys.exit(1)


def _run(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file first, as python -m does
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(argv[0])
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
