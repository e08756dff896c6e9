"""A Trainboard job on a Ray cluster: the entrypoint the ``ray`` backend submits through Ray's Job
Submission API (cloud_adapters/ray, docs/ray.md).

    python -m trainer_pkg.ray_entry --workers 2                      # 2 Ray Train workers, 1 CPU each
    python -m trainer_pkg.ray_entry --workers 8 --gpus-per-worker 1 --placement SPREAD --max-runtime-s 3600

It runs as the Ray job's driver, in the job's ``working_dir`` (the archive the backend uploaded:
``trainer_pkg/`` and the user's code beside it), with the job's config as JSON in the environment
variable ``TRAINBOARD_JOB_CONFIG`` (:data:`CONFIG_VAR`). What it does, top to bottom:

1. ``ray.init()`` joins the cluster the job runs on (the job supervisor sets ``RAY_ADDRESS``).
2. A ``TorchTrainer`` with ``ScalingConfig(num_workers=--workers, use_gpu=--gpus-per-worker > 0,
   resources_per_worker={"CPU": ..., "GPU": ...})`` starts the Ray Train workers; Ray Train sets up
   its torch process group among them (gloo: it carries one message, below) and each worker's
   ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK`` and ``MASTER_ADDR``
   (rank 0's node).
3. Each worker (:func:`rank_loop`) starts ONE process, ``python -m trainer_pkg.launch --config <file>
   --platform torchrun``, with those variables, ``GROUP_RANK`` = the node rank and ``MASTER_PORT`` =
   a free port rank 0 picked on its node and broadcast over Ray Train's process group (the port Ray
   Train's own group listens on is taken). That process is one rank exactly as under torchrun: our
   trainer or the user's script, its own process group, checkpoints on SIGTERM, metric records on
   stdout (Ray forwards the workers' output to the job's log, where Trainboard reads the records).
   Its exit code is the rank's; a rank that fails fails the Ray Train run, and the job.

Why a child process rather than the training loop in the Ray worker itself: the trainer and a torchrun
script each create their own default process group and read torchrun's variables, and a child is
stopped as a unit (``PR_SET_PDEATHSIG``: SIGTERM when the Ray worker that started it dies, so a
``ray job stop`` leaves no trainer behind).

Limits: ``--max-runtime-s`` counts from this driver's start; when it is reached every rank gets SIGTERM
(a checkpoint is written) and SIGKILL 30 s later, and the job fails with that reason. Exit codes: 0 when
every rank exited 0, 1 when one failed or the limit was reached, 2 when the config or the arguments are
invalid.

A Ray script (``code.framework`` "ray": one that calls ``ray.init()`` and runs its own Ray Train) is not
wrapped: it is the job's driver (:func:`run_ray_script`).

Torch-free at import: ``ray`` is imported in :func:`main`, torch only inside the workers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from trainer_pkg.lifetime import die_with_parent

CONFIG_VAR = "TRAINBOARD_JOB_CONFIG"
"""The environment variable holding the job's config (JSON), set in the job's ``runtime_env``."""
KILL_AFTER_S = 30.0
"""Seconds between the SIGTERM a rank gets at the time limit and the SIGKILL that follows."""
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Ray's placement group strategies (``ScalingConfig.placement_strategy``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer_pkg.ray_entry", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, required=True, help="Ray Train workers: one rank each")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--gpus-per-worker", type=float, default=0.0)
    parser.add_argument("--placement", choices=PLACEMENTS, default="PACK")
    parser.add_argument("--max-runtime-s", type=float, default=0.0, help="0 = no limit")
    parser.add_argument("--name", default="trainboard", help="the Ray Train run's name (the job's)")
    return parser


def _error(message: str) -> None:
    sys.stderr.flush()
    os.write(2, f"trainer error: {message}\n".encode("utf-8", "replace"))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problems = []
    if args.workers < 1:
        problems.append(f"--workers must be at least 1, got {args.workers}")
    if not args.cpus_per_worker > 0:
        problems.append(f"--cpus-per-worker must be above 0, got {args.cpus_per_worker}")
    if not args.gpus_per_worker >= 0:
        problems.append(f"--gpus-per-worker must be 0 or more, got {args.gpus_per_worker}")
    text = os.environ.get(CONFIG_VAR, "")
    try:
        config = json.loads(text)
    except ValueError as exc:
        config = None
        problems.append(f"{CONFIG_VAR} is not JSON ({exc})")
    if not problems and not isinstance(config, dict):
        problems.append(f"{CONFIG_VAR} must hold a JSON object (the job's config)")
    if problems:
        _error("; ".join(problems))
        return 2
    code = config.get("code") if isinstance(config.get("code"), dict) else {}
    if code.get("framework") == "ray":
        return run_ray_script(text, args.max_runtime_s, workers=args.workers, gpus_per_worker=args.gpus_per_worker)

    # -- the cluster: the job's driver joins it, Ray Train starts the workers --------------------
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    started = time.time()
    ray.init()
    print(f"[ray] {args.workers} Ray Train worker(s), {args.cpus_per_worker:g} CPU and {args.gpus_per_worker:g} "
          f"GPU each, placement {args.placement}; Ray {ray.__version__}", flush=True)
    gpus = args.gpus_per_worker
    trainer = TorchTrainer(
        rank_loop,
        train_loop_config={"config": text, "deadline": started + args.max_runtime_s if args.max_runtime_s else 0.0,
                           "max_runtime_s": args.max_runtime_s},
        # Ray Train's own process group only carries rank 0's port (rank_loop): gloo, never the GPUs.
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=gpus > 0,
                                     resources_per_worker={"CPU": args.cpus_per_worker,
                                                           **({"GPU": gpus} if gpus > 0 else {})},
                                     placement_strategy=args.placement),
        # A failed rank fails the job: Trainboard resubmits lost runs itself, from the checkpoint.
        run_config=RunConfig(name=args.name, failure_config=FailureConfig(max_failures=0)),
    )
    try:
        trainer.fit()
    except Exception as exc:  # Ray Train's TrainingFailedError and what it wraps: the ranks' own errors
        _error(f"the Ray Train run failed: {_first_line(exc)}")
        return 1
    return 0


def run_ray_script(text: str, max_runtime_s: float, *, workers: int, gpus_per_worker: float = 0.0) -> int:
    """A Ray script (``code.framework`` "ray"): the user's script is the job's driver itself, started as
    ``python -m trainer_pkg.rank_entry <script> <args>`` in ``code.dir`` with Trainboard's variables
    (:func:`trainer_pkg.launch.trainboard_env`) and the job's shape as a Ray job inside any backend
    gets it (:mod:`trainer_pkg.frameworks.ray`: ``TRAINBOARD_RAY_NUM_WORKERS`` = ``workers``,
    ``TRAINBOARD_RAY_USE_GPU`` 1 when ``gpus_per_worker`` > 0, ``TRAINBOARD_NNODES``,
    ``TRAINBOARD_NPROC_PER_NODE``); its ``ray.init()`` joins this cluster (the job supervisor's
    ``RAY_ADDRESS``) and its own Ray Train run starts the workers. Its exit code is the job's; the time
    limit as for our ranks (:func:`_wait`)."""
    from trainer_pkg import world_shape
    from trainer_pkg.config import ConfigError, JobConfig
    from trainer_pkg.frameworks.ray import NNODES_ENV, NPROC_ENV, NUM_WORKERS_ENV, USE_GPU_ENV
    from trainer_pkg.launch import trainboard_env, user_script

    try:
        cfg = world_shape.validate(JobConfig.from_json(text))
        script = user_script(cfg)
    except ConfigError as exc:
        _error(f"invalid config: {exc}")
        return 2
    if script is None:
        _error("invalid config: code.framework ray runs a training script (code.script)")
        return 2
    here = os.getcwd()
    env = {k: v for k, v in os.environ.items() if k != CONFIG_VAR}
    env.update(trainboard_env(cfg))
    env.update({NUM_WORKERS_ENV: str(workers), NNODES_ENV: str(cfg.parallel.nodes),
                NPROC_ENV: str(cfg.parallel.procs_per_node), USE_GPU_ENV: "1" if gpus_per_worker > 0 else "0"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    print(f"[ray] running the user's Ray script as the job's driver: {script.describe()} (in {script.code_dir})",
          flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "trainer_pkg.rank_entry", *script.argv()], cwd=script.code_dir,
                            env=env, preexec_fn=die_with_parent(signal.SIGTERM))
    code = _wait(proc, time.time() + max_runtime_s if max_runtime_s else 0.0)
    if code is None:
        _error(f"the time limit of {max_runtime_s:g} s was reached; the script was stopped")
        return 1
    return code


def _first_line(exc: BaseException) -> str:
    """What a failed run's exception says about the ranks: ``rank R: the trainer exited with code C``
    (:func:`rank_loop`'s own error, inside Ray Train's), else its first line."""
    import re

    text = str(exc).strip() or type(exc).__name__
    found = re.findall(r"RuntimeError: (rank \d+: .+)", text)
    return found[-1].strip() if found else text.splitlines()[0][:500]


# -- one Ray Train worker: one rank ------------------------------------------------------------------


def rank_loop(loop_config: dict[str, Any]) -> None:
    """The body of each Ray Train worker: start this rank's trainer process and wait for it.

    Raises RuntimeError when the process exits non-zero or the time limit is reached (Ray Train then
    fails the run)."""
    import ray.train
    import torch.distributed as dist

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    local_rank, local_world = context.get_local_rank(), context.get_local_world_size()
    node_rank = context.get_node_rank()
    master_addr = os.environ.get("MASTER_ADDR") or _this_address()
    box: list[Any] = [_free_port(master_addr)] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    port = int(box[0])

    here = os.getcwd()  # the job's working_dir on this node: trainer_pkg/ and the user's code
    run_dir = tempfile.mkdtemp(prefix=f"trainboard-rank{rank}-")
    config_path = os.path.join(run_dir, "job.json")
    with open(config_path, "w", encoding="utf-8") as fh:
        fh.write(loop_config["config"])
    # torchrun's agent variables are not this rank's (no torchrun agent runs here).
    env = {k: v for k, v in os.environ.items() if k != CONFIG_VAR and not k.startswith("TORCHELASTIC_")}
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(node_rank), NODE_RANK=str(node_rank),
               MASTER_ADDR=master_addr, MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p))
    argv = [sys.executable, "-m", "trainer_pkg.launch", "--config", config_path, "--platform", "torchrun"]
    sys.stdout.flush()
    proc = subprocess.Popen(argv, cwd=here, env=env, preexec_fn=die_with_parent(signal.SIGTERM))
    code = _wait(proc, float(loop_config.get("deadline") or 0.0))
    if code is None:
        raise RuntimeError(f"rank {rank}: the time limit of {loop_config.get('max_runtime_s'):g} s was reached; "
                           f"the rank was stopped")
    if code != 0:
        raise RuntimeError(f"rank {rank}: the trainer exited with code {code}")


def _wait(proc: subprocess.Popen, deadline: float) -> int | None:
    """``proc``'s exit code; None when ``deadline`` (epoch seconds; 0 = none) came first, after SIGTERM
    and, :data:`KILL_AFTER_S` later, SIGKILL."""
    while True:
        timeout = None if not deadline else max(0.0, deadline - time.time())
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            break
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return None


def _this_address() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


def _free_port(address: str) -> int:
    """A TCP port free on every address of this node now (the kernel's choice, as torchrun picks one),
    for the ranks' rendezvous: rank 0's store listens on all of them, so a port free on ``address``
    alone (one a service holds on 127.0.0.1) would not do."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
