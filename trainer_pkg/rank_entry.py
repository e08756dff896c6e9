"""A rank of a user's script, as the launcher starts it: install the hang dump, then run the script as
``python`` would have.

    python -m trainer_pkg.rank_entry /abs/code/train.py --lr 0.1      # = python /abs/code/train.py --lr 0.1
    python -m trainer_pkg.rank_entry -m mypkg.train --lr 0.1          # = python -m mypkg.train --lr 0.1

:func:`trainer_pkg.hang.install_rank_dump` first (SIGUSR1 writes every thread's stack where the
launcher's watchdog reads it; nothing when the launcher set no ``TRAINBOARD_HANG_DIR``), then the
script runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as Python sets them for it (the
script's directory; the working directory for ``-m``). Its exit code and traceback are its own.
Torch-free.
"""

from __future__ import annotations

import os
import runpy
import sys

from trainer_pkg.hang import install_rank_dump


def main(argv: list[str]) -> None:
    if not argv or argv[0] == "-m" and len(argv) < 2:
        sys.exit("usage: python -m trainer_pkg.rank_entry (SCRIPT.py | -m MODULE) [ARGS...]")
    install_rank_dump()
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
