"""An MPI script (``code.framework`` ``mpi``) on the real Slurm test cluster (tests/slurmkit.py: two slurmd
on this machine), the nodes' ``python`` the MPI test venv's (mpi4py on Debian's Open MPI).

Trainboard's batch script starts one launcher per node; node 0's runs ``mpirun --host n1:2,n2:2 -np 4``
and Open MPI's Slurm launcher starts its daemons with srun inside the allocation. The 4 ranks on 2
nodes form one MPI world (an allreduce of the ranks gives 6) and the job SUCCEEDS; a cancel (scancel)
leaves no rank (by PID).

The job sets ``OMPI_MCA_btl=self,tcp``: the two test nodes are one host, so Open MPI's shared-memory
transport, which names its segments by host name, would mix up the ranks of "n1" and "n2" (a segfault
in btl_vader); real nodes are separate hosts and need nothing. ``srun --mpi=pmix`` fails here for the
same reason (both slurmd create ``/tmp/spmix_appdir_<uid>_<job>.<step>``), which is why the launcher
uses mpirun (trainer_pkg/frameworks/mpi.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloud_adapters.base import JobSpec, JobState
from cloud_adapters.registry import create_backend
from framework_venvs import MPI, framework_venv_fixture
from polling import wait_for
import slurmkit
from slurmkit import SLURM_GROUP
from polling import read_whole_log
from test_slurm_backend import code_bundle, wait_state
from trainer_pkg.metrics import parse_metric_line

pytestmark = SLURM_GROUP

MPI_PYTHON = framework_venv_fixture("mpi", MPI)

SCRIPT = b'''\
import json, os, socket, sys, time
from mpi4py import MPI
from trainer_pkg import report

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
total = comm.allreduce(rank, op=MPI.SUM)
os.makedirs(os.environ["TRAINBOARD_MODEL_DIR"], exist_ok=True)
path = os.path.join(os.environ["TRAINBOARD_MODEL_DIR"], f"rank{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "sum": total, "size": comm.Get_size(),
               "vars": [os.environ[n] for n in ("RANK", "LOCAL_RANK", "GROUP_RANK", "HOROVOD_CROSS_SIZE")],
               "hparams": json.loads(os.environ["TRAINBOARD_HPARAMS"])["train.lr"]}, f)
os.replace(path + ".tmp", path)
report.log(step=1, rank_sum=total)
if "--wait" in sys.argv:
    time.sleep(600)  # the workload the cancel stops
'''


@pytest.fixture(scope="module")
def cluster(slurm_cluster_module):
    return slurm_cluster_module


@pytest.fixture
def backend(cluster, MPI_PYTHON):
    return create_backend("slurm", {"partition": cluster.partition, "work_dir": str(cluster.work_dir),
                                    "slurm_conf": str(cluster.conf), "python": str(MPI_PYTHON),
                                    "cluster": cluster.cluster_name})


def mpi_spec(name: str, tmp_path: Path, args: list[str]) -> JobSpec:
    config = {"code": {"script": "train.py", "args": args, "framework": "mpi"}, "train": {"lr": 0.125}}
    return JobSpec(job_name=name, config=config, nodes=2, procs_per_node=2, max_runtime_s=600,
                   env={"OMPI_MCA_btl": "self,tcp"}, tags={"trainboard-job-id": "33"},
                   code=code_bundle(tmp_path, {"train.py": SCRIPT}))


def ranks(output: Path) -> dict[int, dict]:
    return {int(p.name[4:-5]): json.loads(p.read_text()) for p in output.glob("rank*.json")}


def test_four_ranks_on_two_nodes_form_one_world(backend, cluster, tmp_path):
    handle = backend.submit(mpi_spec("tb-job-mpi-1", tmp_path, []))
    done = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
    lines, _ = read_whole_log(backend, handle)
    assert done.state is JobState.SUCCEEDED, "\n".join(lines[-60:])
    seen = ranks(cluster.work_dir / "tb-job-mpi-1" / "output")
    assert {r: (v["sum"], v["size"], v["vars"], v["hparams"]) for r, v in seen.items()} == {
        0: (6, 4, ["0", "0", "0", "2"], 0.125), 1: (6, 4, ["1", "1", "0", "2"], 0.125),
        2: (6, 4, ["2", "0", "1", "2"], 0.125), 3: (6, 4, ["3", "1", "1", "2"], 0.125)}
    steps = [r for r in map(parse_metric_line, lines) if r is not None and r["event"] == "step"]
    assert [(r["step"], r["rank_sum"]) for r in steps] == [(1, 6.0)]  # rank 0 alone
    assert "[launch] mpi: starting 4 rank(s) with /usr/bin/mpirun (on n1,n2)" in lines
    assert ("[launch] mpi: node 0's mpirun starts the 2 rank(s) of node_rank 1 (Open MPI's Slurm launcher); "
            "nothing to start here") in lines


def test_a_cancelled_mpi_job_leaves_no_rank(backend, cluster, tmp_path):
    handle = backend.submit(mpi_spec("tb-job-mpi-2", tmp_path, ["--wait"]))
    output = cluster.work_dir / "tb-job-mpi-2" / "output"
    wait_for(lambda: len(ranks(output)) == 4, timeout=120, what="all 4 ranks past their allreduce")
    pids = sorted(v["pid"] for v in ranks(output).values())
    assert all(slurmkit.running(pid) for pid in pids)
    backend.cancel(handle)
    done = wait_state(backend, handle, {JobState.CANCELLED, JobState.FAILED, JobState.SUCCEEDED}, timeout=60)
    assert done.state is JobState.CANCELLED
    wait_for(lambda: not any(slurmkit.running(pid) for pid in pids), timeout=30,
             what="every rank of the cancelled job to be gone")
