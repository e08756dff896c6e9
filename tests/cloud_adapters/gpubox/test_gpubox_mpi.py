"""An MPI script (``code.framework`` ``mpi``) on the GPU box: real supervisor, launcher and Debian's Open
MPI, the box's ``python`` the MPI test venv's (mpi4py, tests/framework_venvs.py).

The box starts one launcher instead of torchrun (``trainer_pkg.frameworks.mpi.node_command``), which
starts the 2 ranks with ``mpirun``: they form one MPI world (an allreduce of the ranks gives 1), rank 0
alone reports it, and the job SUCCEEDS; a cancel leaves no rank, no mpirun and no launcher (by PID).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from cloud_adapters.base import JobSpec, JobState
from cloud_adapters.gpubox import GpuBoxBackend
from framework_venvs import MPI, framework_venv_fixture
from trainer_pkg.metrics import parse_metric_line
from test_gpubox_user_code import _log, code_bundle, wait_terminal

MPI_PYTHON = framework_venv_fixture("mpi", MPI)

SCRIPT = '''\
import json, os, sys, time
from mpi4py import MPI
from trainer_pkg import report

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
total = comm.allreduce(rank, op=MPI.SUM)
with open(f"rank{rank}.json.tmp", "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "sum": total, "RANK": os.environ["RANK"],
               "HOROVOD_SIZE": os.environ["HOROVOD_SIZE"]}, f)
os.replace(f"rank{rank}.json.tmp", f"rank{rank}.json")
report.log(step=1, rank_sum=total)
if "--wait" in sys.argv:
    time.sleep(600)  # the workload the cancel stops
'''


def mpi_spec(name: str, store: Path, args: list[str]) -> JobSpec:
    config = {"code": {"script": "train.py", "args": args, "framework": "mpi"}, "parallel": {"procs_per_node": 2}}
    return JobSpec(job_name=name, config=config, procs_per_node=2, code=code_bundle(store, {"train.py": SCRIPT}))


def backend(tmp_path: Path, python: Path) -> GpuBoxBackend:
    return GpuBoxBackend({"run_root": str(tmp_path / "runs"), "max_procs_per_node": 2, "grace_period_s": 5,
                          "python": str(python)})


def ranks(run_dir: Path) -> dict[int, dict]:
    return {int(p.name[4:-5]): json.loads(p.read_text()) for p in sorted((run_dir / "code").glob("rank*.json"))}


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_an_mpi_script_runs_under_mpirun_and_succeeds(tmp_path, MPI_PYTHON):
    box = backend(tmp_path, MPI_PYTHON)
    handle = box.submit(mpi_spec("tb-mpi-ok", tmp_path / "store", []))
    status = wait_terminal(box, handle)
    assert status.state == JobState.SUCCEEDED, _log(handle)
    run_dir = Path(handle.provider_job_id)
    seen = ranks(run_dir)
    assert {r: (v["sum"], v["RANK"], v["HOROVOD_SIZE"]) for r, v in seen.items()} == {0: (1, "0", "2"),
                                                                                       1: (1, "1", "2")}
    log = (run_dir / "train.log").read_text()
    steps = [r for r in map(parse_metric_line, log.splitlines()) if r is not None and r["event"] == "step"]
    assert [(r["step"], r["rank_sum"]) for r in steps] == [(1, 1.0)]  # rank 0 alone
    assert "[launch] mpi: starting 2 rank(s) with /usr/bin/mpirun (on this machine)" in log
    # One launcher (no torchrun), which logged its plan once, and one mpirun that started both ranks.
    assert [line for line in log.splitlines() if line.startswith("[launch] platform:")] == [
        "[launch] platform: local (--standalone), node_rank 0 of 1 node(s) × 2 process(es) per node = world size 2, "
        "starting trainer_pkg.frameworks.mpi"]
    assert seen[0]["ppid"] == seen[1]["ppid"]
    supervised = (run_dir / "supervisor.log").read_text()
    assert "started the launcher pid" in supervised and "the launcher exited with code 0" in supervised
    assert "torchrun" not in supervised


def test_a_cancelled_mpi_job_leaves_no_process(tmp_path, MPI_PYTHON):
    box = backend(tmp_path, MPI_PYTHON)
    handle = box.submit(mpi_spec("tb-mpi-cancel", tmp_path / "store", ["--wait"]))
    run_dir = Path(handle.provider_job_id)
    deadline = time.monotonic() + 120
    while len(ranks(run_dir)) < 2:
        assert time.monotonic() < deadline, _log(handle)
        assert not box.describe(handle).state.is_terminal, _log(handle)
        time.sleep(0.1)
    seen = ranks(run_dir)
    launcher = json.loads((run_dir / "torchrun.json").read_text())["pid"]
    pids = {"rank 0": seen[0]["pid"], "rank 1": seen[1]["pid"], "mpirun": seen[0]["ppid"], "launcher": launcher}
    assert b"mpirun" in Path(f"/proc/{pids['mpirun']}/cmdline").read_bytes()
    assert all(running(p) for p in pids.values())
    box.cancel(handle)
    status = wait_terminal(box, handle, timeout=60)
    assert status.state == JobState.CANCELLED, _log(handle)
    assert {name: pid for name, pid in pids.items() if running(pid)} == {}
