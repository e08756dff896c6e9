"""Reading what a GPU-box job's processes were given: the environment of its ranks, from /proc.

A rank is a process of the job (``_proc.job_processes``: its environment carries the run tag) that
torchrun started, so its environment has ``LOCAL_RANK``; torchrun and the supervisor have none.
"""

from __future__ import annotations

from cloud_adapters.gpubox import _proc


def environment(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def rank_environments(run_dir: str) -> dict[int, dict[str, str]]:
    """``{LOCAL_RANK: environment}`` of the job's live ranks (empty before they start and after they end)."""
    found = {}
    for pid in _proc.job_processes(str(run_dir)):
        env = environment(pid)
        if env and env.get("LOCAL_RANK", "").isdigit():
            found[int(env["LOCAL_RANK"])] = env
    return found
