"""One entry for every backend: read the job's config, start the trainer the way this machine needs.

    python -m trainer_pkg.launch --config job.json                                # see below
    python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2
    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.launch --config job.json

How the shape of the job is found, first match wins:

1. torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) are set: this process is one rank;
   train here.
2. ``--standalone``: start torchrun on this machine with ``--nproc-per-node`` processes (default: the
   config's ``parallel.procs_per_node``) running this module, and exit with its code. SIGTERM/SIGINT
   are passed on to torchrun (which passes them to the ranks); when the ranks stopped cleanly (a
   checkpoint and a ``stopped`` record were written) the exit code is 0.
3. Otherwise: one process (world size 1).

Exit codes: 0 success (or a clean stop on SIGTERM), 1 training failed, 2 the config is invalid.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Sequence

from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.metrics import parse_metric_line, report_error


def read_config(path: str) -> JobConfig:
    """The validated JobConfig in the JSON file ``path``; :class:`ConfigError` saying what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    return JobConfig.from_json(text).validate()


def torchrun_command(config_path: str, nproc_per_node: int) -> list[str]:
    """The argument list that runs this launcher under torchrun on this machine alone."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc_per_node", str(nproc_per_node),
        "-m", "trainer_pkg.launch", "--config", config_path,
    ]


def run_standalone(cfg: JobConfig, config_path: str, nproc_per_node: int) -> int:
    """Start torchrun with ``nproc_per_node`` ranks and wait for it; returns the exit code to use."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        # Split this machine's cores between the ranks (torchrun would otherwise force 1 and warn).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // nproc_per_node))
    # The package may be run from a checkout rather than installed: let the ranks import it too.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)

    started = time.time()
    # torchrun gets its own session so a signal to our process group reaches it once, from us:
    # a second SIGTERM while torchrun is shutting its ranks down would cut that shutdown short.
    proc = subprocess.Popen(torchrun_command(os.path.abspath(config_path), nproc_per_node), env=env,
                            start_new_session=True)
    signalled: list[int] = []

    def forward(signum, frame) -> None:
        signalled.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:  # we are leaving on an exception: do not orphan the ranks
            proc.kill()
            proc.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signalled and code != 0 and _stopped_cleanly(cfg, since=started):
        # torchrun itself exits 1 after forwarding a signal even when every rank exited 0.
        return 0
    return code


def _stopped_cleanly(cfg: JobConfig, since: float) -> bool:
    """Whether this run's last metric record is ``stopped`` (written after its checkpoint)."""
    path = os.path.join(cfg.output.output_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = parse_metric_line(line)
        if isinstance(record, dict) and "event" in record:
            return record["event"] == "stopped" and record.get("time", 0) >= since
    return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer_pkg.launch",
        description=(
            "Run a Trainboard training job from its JobConfig JSON. Under torchrun (RANK, WORLD_SIZE "
            "and LOCAL_RANK set) this process trains as one rank; with --standalone it starts torchrun "
            "on this machine; otherwise it trains in one process."
        ),
        epilog="exit codes: 0 done (or stopped cleanly by SIGTERM, resumable), 1 training failed, "
               "2 invalid config. Example: python -m trainer_pkg.launch --config job.json "
               "--standalone --nproc-per-node 2",
    )
    p.add_argument("--config", required=True, metavar="JOB_JSON",
                   help="the job's JobConfig as JSON (missing fields take their defaults)")
    p.add_argument("--standalone", action="store_true",
                   help="start torchrun on this machine (single node) and wait for it")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="processes for --standalone (default: the config's parallel.procs_per_node)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = read_config(args.config)
        if args.nproc_per_node is not None and args.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    except ConfigError as exc:
        report_error(f"invalid config {args.config}: {exc}")
        return 2

    from trainer_pkg import train  # imports torch: only now that the config is known to be good

    if train.torchrun_env_present():
        return train.train(cfg)
    if args.standalone:
        return run_standalone(cfg, args.config, args.nproc_per_node or cfg.parallel.procs_per_node)
    return train.train(cfg)


if __name__ == "__main__":
    sys.exit(main())
