"""One entry for every backend: read the job's config and the platform's environment, then start the
trainer the way this machine needs.

    python -m trainer_pkg.launch --config job.json                    # any platform: detects it
    python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2   # this machine
    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.launch --config job.json
    python -m trainer_pkg.launch --config job.json --platform vertex  # skip detection

What runs where (the platform is detected as in :mod:`trainer_pkg.platforms` and logged as
``[launch] platform: sagemaker (SM_HOSTS is set), node_rank 1 of 2 node(s) × 2 process(es) ...``):

=========  ==========================================================================================
torchrun   ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set: this process is one rank; train here.
sagemaker  ``SM_HOSTS``/``SM_CURRENT_HOST``: start torchrun --nnodes len(hosts) --node_rank (index of
           this host) --master_addr (first host) with one process per GPU (or parallel.procs_per_node
           on CPU); string hyperparameters parsed to the config's types; output → /opt/ml/model,
           checkpoints → /opt/ml/checkpoints, data → the ``train`` channel.
vertex     ``CLUSTER_SPEC`` + per-machine ``RANK``/``WORLD_SIZE``: start torchrun with per-process
           ranks; output → ``AIP_MODEL_DIR``, checkpoints → ``AIP_CHECKPOINT_DIR`` (gs:// via /gcs).
azureml    ``AZUREML_RUN_ID`` + per-process ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``: Azure started the
           ranks; train here. Output/checkpoints → the job's ``AZURE_ML_OUTPUT_<name>`` folders.
local      ``--standalone``: torchrun on this machine with ``--nproc-per-node`` processes (default
           ``parallel.procs_per_node``); nothing set: one process.
=========  ==========================================================================================

Every rank this launcher starts logs one line ``[launch] rank R (local rank L, node_rank N) of world
size W ...`` so a job's log shows the whole cluster. SIGTERM/SIGINT are passed on to torchrun (which
passes them to the ranks); when the ranks stopped cleanly (a checkpoint and a ``stopped`` record were
written) the exit code is 0.

Exit codes: 0 success (or a clean stop on SIGTERM), 1 training failed, 2 the config is invalid or the
platform's environment lacks or garbles a variable (the message names it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Sequence

from trainer_pkg import world_shape
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.metrics import exit_process, parse_metric_line, report_error
from trainer_pkg.platforms import (
    LAUNCHED_BY_US,
    PLATFORMS,
    LaunchPlan,
    PlatformError,
    cpu_threads_per_rank,
    plan as make_plan,
)

# Variables a platform or an outer launcher set that must not leak into the torchrun we start: it
# sets its own per-process values (Vertex's RANK/WORLD_SIZE count machines, not processes).
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def read_config(path: str) -> JobConfig:
    """The validated JobConfig in the JSON file ``path``; :class:`ConfigError` saying what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    return world_shape.validate(JobConfig.from_json(text))


def torchrun_command(config_path: str, plan: LaunchPlan, *, python: str = sys.executable) -> list[str]:
    """The torchrun argument list that starts ``plan``'s ranks of this node, each running this
    launcher on ``config_path``: ``--standalone`` for one node, else a static rendezvous at the
    master with this node's rank (as SageMaker's toolkit does, clouds.md §1.6). ``python`` is the
    interpreter that has torch (the GPU box's may differ from the worker's own)."""
    cmd = [python, "-m", "torch.distributed.run", "--nnodes", str(plan.nnodes),
           "--nproc_per_node", str(plan.nproc_per_node)]
    if plan.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += ["--node_rank", str(plan.node_rank), "--master_addr", plan.master_addr,
                "--master_port", str(plan.master_port)]
    return cmd + ["-m", "trainer_pkg.launch", "--config", config_path]


def torchrun_env(plan: LaunchPlan, env: Mapping[str, str]) -> dict[str, str]:
    """The environment for :func:`torchrun_command`, from ``env`` (this process's, as a rule).

    Another launcher's rank variables are dropped (torchrun sets its own per process; Vertex's
    RANK/WORLD_SIZE count machines), ``plan.extra_env`` is added, the ranks are marked as started
    by this launcher (so they train in process whatever else the machine's environment says), and
    ``OMP_NUM_THREADS`` is :func:`~trainer_pkg.platforms.cpu_threads_per_rank` unless ``env`` sets
    it. ``PYTHONPATH`` is the caller's: it knows where the package comes from.
    """
    out = {k: v for k, v in env.items() if k not in _RANK_VARS}
    out.update(plan.extra_env)
    out[LAUNCHED_BY_US] = plan.platform
    if "OMP_NUM_THREADS" not in out:
        out["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(plan.nproc_per_node))
    return out


def run_torchrun(cfg: JobConfig, config_path: str, plan: LaunchPlan) -> int:
    """Start torchrun for ``plan`` on this node and wait for it; returns the exit code to use."""
    env = torchrun_env(plan, os.environ)
    # The package may be run from a checkout rather than installed: let the ranks import it too.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)

    started = time.time()
    # torchrun gets its own session so a signal to our process group reaches it once, from us:
    # a second SIGTERM while torchrun is shutting its ranks down would cut that shutdown short.
    proc = subprocess.Popen(torchrun_command(os.path.abspath(config_path), plan), env=env,
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


def _last_record(cfg: JobConfig) -> dict:
    """The last metric record in ``metrics.jsonl`` ({} when there is none)."""
    path = os.path.join(cfg.output.output_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = parse_metric_line(line)
        if isinstance(record, dict) and "event" in record:
            return record
    return {}


def _stopped_cleanly(cfg: JobConfig, since: float) -> bool:
    """Whether this run's last metric record is ``stopped`` (written after its checkpoint)."""
    record = _last_record(cfg)
    return record.get("event") == "stopped" and record.get("time", 0) >= since


def failure_message(cfg: JobConfig, code: int, since: float) -> str:
    """The failure reason of a run started at ``since`` (Unix time) that exited ``code`` (≠ 0): the
    trainer's own when it stopped the run itself (a ``failed`` record of this run, its ``reason``,
    e.g. "loss became NaN at step 12"), else the exit code and where the ranks' errors are."""
    record = _last_record(cfg)
    if (record.get("event") == "failed" and isinstance(record.get("reason"), str)
            and record.get("time", 0) >= since):
        return f"{record['reason']} (training failed with exit code {code})"
    return (f"training failed with exit code {code}; the ranks' errors ('trainer error: ...') are in "
            "the job's log")


def _resolved_config_file(cfg: JobConfig) -> str:
    """The resolved config written for the ranks this launcher starts (removed when they are done)."""
    fd, path = tempfile.mkstemp(prefix="trainboard-job-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(cfg.to_json())
    return path


def _log_rank(plan_platform: str) -> None:
    """One line per rank, so the job's log shows where every process sits."""
    env = os.environ
    print(f"[launch] rank {env.get('RANK')} (local rank {env.get('LOCAL_RANK')}, node_rank "
          f"{env.get('GROUP_RANK', env.get('NODE_RANK', '?'))}) of world size {env.get('WORLD_SIZE')}, "
          f"platform {plan_platform}, master {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}", flush=True)


def _write_failure(path: str | None, message: str) -> None:
    """Leave ``message`` where the platform shows it as the job's failure reason (SageMaker)."""
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(message[:1024])
    except OSError:
        pass  # best effort: the same message is on stderr, which the platform logs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer_pkg.launch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run a Trainboard training job from its JobConfig JSON on whatever platform this is.\n\n"
            "auto-detection (first match wins):\n"
            "  torchrun   RANK, LOCAL_RANK, WORLD_SIZE set       -> this process is one rank\n"
            "  azureml    AZUREML_RUN_ID (+ per-process RANK...) -> Azure started the ranks; train here\n"
            "  sagemaker  SM_HOSTS / SM_CURRENT_HOST             -> torchrun over the job's hosts\n"
            "  vertex     CLUSTER_SPEC (+ per-machine RANK...)   -> torchrun over the job's machines\n"
            "  local      --standalone                           -> torchrun on this machine\n"
            "             nothing set                            -> one process\n\n"
            "On a cloud the platform's directories replace the config's: model/output, checkpoints\n"
            "and data (SageMaker /opt/ml/..., Vertex AIP_MODEL_DIR/AIP_CHECKPOINT_DIR, Azure\n"
            "AZURE_ML_OUTPUT_<name>); SageMaker hyperparameters (strings) override config fields."
        ),
        epilog="exit codes: 0 done (or stopped cleanly by SIGTERM, resumable), 1 training failed, "
               "2 invalid config or platform environment (the message names the variable). "
               "Example: python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2",
    )
    p.add_argument("--config", required=True, metavar="JOB_JSON",
                   help="the job's JobConfig as JSON (missing fields take their defaults)")
    p.add_argument("--platform", choices=("auto",) + PLATFORMS, default="auto",
                   help="where this runs; auto (default) detects it from the environment")
    p.add_argument("--standalone", action="store_true",
                   help="start torchrun on this machine alone (single node) and wait for it")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="processes per node (default: one per GPU, else the config's parallel.procs_per_node)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.time()
    plan: LaunchPlan | None = None
    try:
        cfg = read_config(args.config)
        plan = make_plan(os.environ, cfg, platform=args.platform, nproc=args.nproc_per_node,
                         standalone=args.standalone)
        try:
            cfg = plan.resolve(cfg)
        except ConfigError as exc:
            source = " (SageMaker hyperparameters)" if plan.hyperparameters else ""
            raise ConfigError(f"{plan.platform}{source}: {exc}") from None
    except PlatformError as exc:
        report_error(str(exc))
        _write_failure(exc.failure_file, str(exc))
        return 2
    except ConfigError as exc:
        report_error(f"invalid config {args.config}: {exc}")
        _write_failure(plan and plan.failure_file, f"invalid config: {exc}")
        return 2

    ours = os.environ.get(LAUNCHED_BY_US)  # set in the ranks we started: their node launcher logged
    if not ours and not (plan.in_process and os.environ.get("LOCAL_RANK", "0") != "0"):
        print(f"[launch] {plan.describe()}", flush=True)

    if plan.in_process:
        os.environ.update(plan.extra_env)
        _log_rank(f"{ours} via torchrun" if ours else plan.platform)
        code = _train(cfg)
    elif plan.world_size == 1:
        for name in _RANK_VARS:  # e.g. Vertex's per-machine RANK=0/WORLD_SIZE=1: not a process group
            os.environ.pop(name, None)
        code = _train(cfg)
    else:  # this process only supervises torchrun: it never imports torch
        path = _resolved_config_file(cfg)
        try:
            code = run_torchrun(cfg, path, plan)
        finally:
            os.unlink(path)
    _finish(plan, cfg, code, started)
    return code


def _train(cfg: JobConfig) -> int:
    from trainer_pkg import train  # imports torch: only now that config and platform are known good

    return train.train(cfg)


def _finish(plan: LaunchPlan, cfg: JobConfig, code: int, started: float) -> None:
    """After training on this node: copy the metrics where the platform collects outputs, or leave
    the failure reason where the platform shows it."""
    if code != 0:
        _write_failure(plan.failure_file, failure_message(cfg, code, started))
        return
    first = os.environ.get("RANK") == "0" if plan.in_process else plan.node_rank == 0
    metrics = os.path.join(cfg.output.output_dir, "metrics.jsonl")
    if plan.output_data_dir and first and os.path.isfile(metrics):
        os.makedirs(plan.output_data_dir, exist_ok=True)
        shutil.copy(metrics, os.path.join(plan.output_data_dir, "metrics.jsonl"))


if __name__ == "__main__":
    exit_process(main())
