"""Helpers for the trainer tests: write a JobConfig, run the trainer as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def write_job(tmp_path: Path, **sections) -> Path:
    """A job.json in tmp_path with output under tmp_path/out; ``sections`` override config sections."""
    cfg = {"output": {"output_dir": str(tmp_path / "out")}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(cfg))
    return path


def trainer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def python(real_torchrun: bool = False) -> str:
    """The interpreter to start the trainer with: :func:`standins.torchrun_lite.python` (the real
    interpreter and trainer with a torchrun that imports no torch), or with ``real_torchrun`` this
    interpreter (torch's own torchrun), for the tests whose subject is torchrun."""
    if real_torchrun:
        return sys.executable
    from standins import torchrun_lite

    return torchrun_lite.python()


def torchrun(config: Path, nproc: int = 2, timeout: float = 120, *, real_torchrun: bool = False
             ) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N -m trainer_pkg.launch --config config`` (the
    torchrun of :func:`python`)."""
    cmd = [python(real_torchrun), "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", str(nproc), "-m", "trainer_pkg.launch", "--config", str(config)]
    return subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=timeout)


def launch(config: Path, *extra: str, timeout: float = 120, real_torchrun: bool = False
           ) -> subprocess.CompletedProcess:
    """``python -m trainer_pkg.launch --config config [extra]`` (one process unless --standalone;
    the torchrun it starts is :func:`python`'s)."""
    cmd = [python(real_torchrun), "-m", "trainer_pkg.launch", "--config", str(config), *extra]
    return subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=timeout)


def records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]

