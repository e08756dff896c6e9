"""MPI scripts (``code.framework`` ``mpi``, trainer_pkg/frameworks/mpi.py): real processes under Debian's
Open MPI, the script an mpi4py one in the MPI test venv (tests/framework_venvs.py).

What is asserted: through the launcher on this machine, ``mpirun`` starts 2 ranks that form one MPI
world (an allreduce of the ranks gives 1), each with Open MPI's, torchrun's and Horovod's rank
variables and the job's directories, and rank 0 alone reports the value; SIGTERM to the launcher
leaves no rank and no mpirun (by PID). Where a platform's mpirun starts the ranks (SageMaker's ``mpi``
distribution, Azure ML's ``MpiDistribution``), a real mpirun plays the platform's, started as it starts
the job (SageMaker: ``python -m mpi4py trainboard_entry.py`` in the unpacked archive, the adapter's
hyperparameters; Azure ML: the job's command), and each launcher runs the script as its rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from framework_venvs import MPI, framework_venv_fixture
from test_platforms import clean_env
from trainer_helpers import REPO
from trainer_pkg.config import JobConfig
from trainer_pkg.frameworks import mpi
from trainer_pkg.launch import UserScript
from trainer_pkg.metrics import parse_metric_line
from trainer_pkg.platforms import LaunchPlan, MpiWorld, PlatformError, plan, read_mpi_world
from user_scripts import write_code

MPI_PYTHON = framework_venv_fixture("mpi", MPI)

ALLREDUCE_SCRIPT = '''\
import json, os, sys
from mpi4py import MPI
from trainer_pkg import report

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "HOROVOD_RANK", "HOROVOD_SIZE",
         "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
         "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINBOARD_MODEL_DIR",
         "TRAINBOARD_CODE_DIR", "TRAINBOARD_HPARAMS", "TRAINBOARD_LAUNCH_PLATFORM")
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
total = comm.allreduce(rank, op=MPI.SUM)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"size": comm.Get_size(), "sum": total, "pid": os.getpid(), "cwd": os.getcwd(),
               "argv": sys.argv[2:], "env": {n: os.environ.get(n) for n in NAMES}}, f)
report.log(step=1, rank_sum=total, ranks=comm.Get_size())
'''

WAIT_SCRIPT = '''\
import json, os, sys, time
from mpi4py import MPI

comm = MPI.COMM_WORLD
comm.Barrier()
path = os.path.join(sys.argv[1], f"rank{comm.Get_rank()}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid()}, f)
os.replace(path + ".tmp", path)
time.sleep(600)  # the workload: stopped by the launcher's SIGTERM
'''


def job(tmp_path: Path, code_dir: Path, script: str = "train.py", args: list[str] | None = None) -> Path:
    cfg = {"output": {"output_dir": str(tmp_path / "out")}, "train": {"lr": 0.25},
           "code": {"dir": str(code_dir), "script": script, "args": args or [], "framework": "mpi"}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(cfg))
    return path


def seen(env_out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(env_out.glob("rank*.json"))}


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited but not reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:g} s")
        time.sleep(0.05)


# -- units ----------------------------------------------------------------------------------------


def test_rank_variables_come_from_open_mpis():
    world = read_mpi_world({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert world == MpiWorld(rank=5, size=8, local_rank=1, local_size=4)
    assert (world.nodes, world.node_rank) == (2, 1)
    assert mpi.rank_variables(world) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "4",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}
    assert read_mpi_world({"RANK": "0"}) is None


@pytest.mark.parametrize("env, message", [
    ({"OMPI_COMM_WORLD_RANK": "0"}, "mpirun: OMPI_COMM_WORLD_SIZE is not set"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     "mpirun: OMPI_COMM_WORLD_RANK 2 / LOCAL_RANK 0 are not below OMPI_COMM_WORLD_SIZE 2 / LOCAL_SIZE 2"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     "mpirun: OMPI_COMM_WORLD_SIZE 3 is not whole nodes of OMPI_COMM_WORLD_LOCAL_SIZE 2 ranks; give every "
     "host as many processes"),
])
def test_a_garbled_mpi_world_is_named(env, message):
    with pytest.raises(PlatformError) as excinfo:
        read_mpi_world(env)
    assert str(excinfo.value) == message


def test_the_mpirun_command_is_an_argument_list_with_root_only_for_root(tmp_path):
    script = UserScript(code_dir=str(tmp_path), path=str(tmp_path / "train.py"), args=("--note", "a b; $HOME"))
    one = LaunchPlan(platform="local", nnodes=1, node_rank=0, nproc_per_node=2)
    assert mpi.mpirun_command(one, script, python="/venv/bin/python", exported=("PYTHONPATH",), as_root=False) == [
        "mpirun", "-np", "2", "--map-by", "slot", "--bind-to", "none", "--oversubscribe", "-x", "PYTHONPATH",
        "/venv/bin/python", "-m", "trainer_pkg.frameworks.mpi", str(tmp_path / "train.py"), "--note", "a b; $HOME"]
    two = LaunchPlan(platform="slurm", nnodes=2, node_rank=0, nproc_per_node=3, master_addr="n1", master_port=2)
    assert mpi.mpirun_command(two, script, python="py", hosts=("n1", "n2"), as_root=True)[:12] == [
        "mpirun", "-np", "6", "--host", "n1:3,n2:3", "--map-by", "slot", "--bind-to", "none", "--oversubscribe",
        "--allow-run-as-root", "py"]


def test_sagemakers_and_azures_mpi_ranks_train_in_place_their_node_from_the_rank(tmp_path):
    """The env recreations: the toolkit's mpirun exports the master's SM_CURRENT_HOST to every rank
    (-x), so rank 3 of 2 hosts × 2 is node 1 whatever it says; Azure ML's MpiDistribution sets no RANK."""
    cfg = JobConfig.from_dict({"code": {"script": "train.py", "framework": "mpi"}})
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    sm = plan({"SM_HOSTS": '["algo-1","algo-2"]', "SM_CURRENT_HOST": "algo-1", "TRAINBOARD_SM_ROOT": str(tmp_path),
               **ompi}, cfg)
    assert (sm.platform, sm.in_process, sm.nnodes, sm.node_rank, sm.nproc_per_node, sm.master_addr,
            sm.master_port) == ("sagemaker", True, 2, 1, 2, "algo-1", 7777)
    # The framework arrives in the hyperparameters (the job file in the archive is "{}").
    config_dir = tmp_path / "input" / "config"
    config_dir.mkdir(parents=True)
    (config_dir / "hyperparameters.json").write_text(json.dumps(
        {"code.framework": '"mpi"', "code.script": '"train.py"', "sagemaker_mpi_enabled": "true"}))
    sm = plan({"SM_HOSTS": '["algo-1","algo-2"]', "SM_CURRENT_HOST": "algo-1", "TRAINBOARD_SM_ROOT": str(tmp_path),
               **ompi}, JobConfig.from_dict({}))
    assert (sm.in_process, sm.node_rank) == (True, 1)
    az = plan({"AZUREML_RUN_ID": "run-1", **ompi}, cfg)
    assert (az.platform, az.in_process, az.nnodes, az.node_rank, az.nproc_per_node) == ("azureml", True, 2, 1, 2)
    # A torch job keeps its own reading of the same environment.
    assert plan({"AZUREML_RUN_ID": "run-1", **ompi}, JobConfig.from_dict({})).in_process is False


# -- real processes ---------------------------------------------------------------------------------


def test_two_ranks_allreduce_under_our_mpirun_and_rank_0_reports(tmp_path, MPI_PYTHON):
    code_dir = write_code(tmp_path / "code", ALLREDUCE_SCRIPT)
    env_out = tmp_path / "seen"
    env_out.mkdir()
    config = job(tmp_path, code_dir, args=[str(env_out), "{train.lr}", "a b; $HOME"])
    run = subprocess.run([str(MPI_PYTHON), "-m", "trainer_pkg.launch", "--config", str(config), "--standalone",
                          "--nproc-per-node", "2"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = seen(env_out)
    assert sorted(ranks) == [0, 1]
    port = ranks[0]["env"]["MASTER_PORT"]
    for rank, got in ranks.items():
        assert (got["size"], got["sum"], got["cwd"], got["argv"]) == (2, 1, str(code_dir), ["0.25", "a b; $HOME"])
        assert got["env"] == {
            "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(rank),
            "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
            "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "TRAINBOARD_MODEL_DIR": str(tmp_path / "out"), "TRAINBOARD_CODE_DIR": str(code_dir),
            "TRAINBOARD_HPARAMS": ranks[0]["env"]["TRAINBOARD_HPARAMS"], "TRAINBOARD_LAUNCH_PLATFORM": None}
    assert port.isdigit() and json.loads(ranks[0]["env"]["TRAINBOARD_HPARAMS"])["train.lr"] == 0.25
    printed = [r for r in map(parse_metric_line, run.stdout.splitlines()) if r is not None and r["event"] == "step"]
    assert [(r["step"], r["rank_sum"], r["ranks"]) for r in printed] == [(1, 1.0, 2.0)]  # rank 0 alone
    stored = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert stored == printed
    assert ("[launch] platform: local (--standalone), node_rank 0 of 1 node(s) × 2 process(es) per node = world "
            "size 2, starting trainer_pkg.frameworks.mpi") in run.stdout
    assert "[launch] mpi: starting 2 rank(s) with /usr/bin/mpirun (on this machine)" in run.stdout


def test_sigterm_to_the_launcher_leaves_no_rank_and_no_mpirun(tmp_path, MPI_PYTHON):
    code_dir = write_code(tmp_path / "code", WAIT_SCRIPT)
    env_out = tmp_path / "seen"
    env_out.mkdir()
    config = job(tmp_path, code_dir, args=[str(env_out)])
    with open(tmp_path / "launch.log", "wb") as log:
        launcher = subprocess.Popen([str(MPI_PYTHON), "-m", "trainer_pkg.launch", "--config", str(config),
                                     "--standalone", "--nproc-per-node", "2"], cwd=REPO, env=clean_env(),
                                    stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(seen(env_out)) == 2, 120, "both ranks past their barrier")
        ranks = seen(env_out)
        pids = [r["pid"] for r in ranks.values()]
        mpirun_pid = ranks[0]["ppid"]
        assert ranks[1]["ppid"] == mpirun_pid and "mpirun" in Path(f"/proc/{mpirun_pid}/cmdline").read_text()
        assert all(running(p) for p in [*pids, mpirun_pid])
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    log = (tmp_path / "launch.log").read_text()
    assert code == 1, log[-3000:]  # mpirun exits 1 after passing the signal on to the ranks
    assert [p for p in [*pids, mpirun_pid] if running(p)] == []


RAISE_SCRIPT = '''\
import json, os, sys
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid()}, f)
comm.Barrier()
if rank == 1:
    raise ValueError("bad shard on mpi rank 1")
comm.allreduce(rank)  # rank 0 would wait here for ever
'''


def test_a_rank_that_raises_aborts_the_world_and_the_job_fails_at_once(tmp_path, MPI_PYTHON):
    """Rank 1 raises while rank 0 waits in a collective: the rank wrapper MPI_Aborts the world, so
    mpirun stops every rank and the launcher fails now with rank 1's traceback in the log, instead of
    both ranks waiting until the job's max runtime (the new-user trial's hung job)."""
    code_dir = write_code(tmp_path / "code", RAISE_SCRIPT)
    env_out = tmp_path / "seen"
    env_out.mkdir()
    config = job(tmp_path, code_dir, args=[str(env_out)])
    run = subprocess.run([str(MPI_PYTHON), "-m", "trainer_pkg.launch", "--config", str(config), "--standalone",
                          "--nproc-per-node", "2"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    assert "ValueError: bad shard on mpi rank 1" in output
    assert 'train.py", line 10, in <module>' in output  # the script's own frame, not the wrapper's
    ranks = seen(env_out)
    assert sorted(ranks) == [0, 1]
    assert [r["pid"] for r in ranks.values() if running(r["pid"])] == []


def test_sagemakers_mpirun_starts_our_entry_script_in_every_rank(tmp_path, MPI_PYTHON):
    """SageMaker's ``mpi`` distribution recreated: the toolkit's MasterRunner runs ``mpirun ... python
    -m mpi4py trainboard_entry.py`` in /opt/ml/code (sagemaker-training ``mpi.py``), hosts and
    hyperparameters as the container has them; each rank's launcher runs the script as that rank."""
    from cloud_adapters import packaging

    root = tmp_path / "opt_ml"
    code_dir = root / "code"
    write_code(code_dir, ALLREDUCE_SCRIPT)
    (code_dir / packaging.ENTRY_SCRIPT).write_text(packaging.ENTRY_SOURCE)
    (code_dir / packaging.BASE_CONFIG).write_text("{}\n")
    env_out = tmp_path / "seen"
    env_out.mkdir()
    config_dir = root / "input" / "config"
    config_dir.mkdir(parents=True)
    hps = {"code.dir": json.dumps(str(code_dir)), "code.script": '"train.py"', "code.framework": '"mpi"',
           "code.args": json.dumps([str(env_out)]), "sagemaker_mpi_enabled": "true",
           "sagemaker_mpi_num_of_processes_per_host": "2", "sagemaker_program": '"trainboard_entry.py"'}
    (config_dir / "hyperparameters.json").write_text(json.dumps(hps))
    env = clean_env(SM_HOSTS='["algo-1"]', SM_CURRENT_HOST="algo-1", SAGEMAKER_BASE_DIR=str(root),
                    SM_MODEL_DIR=str(root / "model"))
    run = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
                          str(MPI_PYTHON), "-m", "mpi4py", packaging.ENTRY_SCRIPT], cwd=code_dir, env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = seen(env_out)
    assert {r: (got["sum"], got["env"]["RANK"], got["env"]["LOCAL_WORLD_SIZE"], got["env"]["TRAINBOARD_MODEL_DIR"])
            for r, got in ranks.items()} == {0: (1, "0", "2", str(root / "model")),
                                             1: (1, "1", "2", str(root / "model"))}
    printed = [r for r in map(parse_metric_line, run.stdout.splitlines()) if r is not None and r["event"] == "step"]
    assert [(r["step"], r["rank_sum"]) for r in printed] == [(1, 1.0)]
    assert "[launch] mpi: rank 1 of 2 (local rank 1 of 2, node_rank 0) started by sagemaker's mpirun" in run.stdout
    # Rank 0 alone copied the metrics where SageMaker uploads output data.
    assert json.loads((root / "output" / "data" / "metrics.jsonl").read_text())["rank_sum"] == 1.0


def test_azure_mls_mpirun_starts_the_jobs_command_in_every_rank(tmp_path, MPI_PYTHON):
    """Azure ML's MpiDistribution recreated: its mpirun runs the job's command in each process."""
    code_dir = write_code(tmp_path / "code", ALLREDUCE_SCRIPT)
    env_out = tmp_path / "seen"
    env_out.mkdir()
    config = job(tmp_path, code_dir, args=[str(env_out)])
    env = clean_env(AZUREML_RUN_ID="run-7", AZURE_ML_OUTPUT_model=str(tmp_path / "model"))
    run = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", "--allow-run-as-root", str(MPI_PYTHON), "-m",
                          "trainer_pkg.launch", "--config", str(config)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = seen(env_out)
    assert {r: (got["sum"], got["env"]["RANK"], got["env"]["HOROVOD_SIZE"], got["env"]["TRAINBOARD_MODEL_DIR"])
            for r, got in ranks.items()} == {0: (1, "0", "2", str(tmp_path / "model")),
                                             1: (1, "1", "2", str(tmp_path / "model"))}
    stored = [json.loads(line) for line in (tmp_path / "model" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rank_sum"]) for r in stored if r["event"] == "step"] == [(1, 1.0)]


def test_ranks_torchrun_started_are_refused_with_what_to_do(tmp_path, MPI_PYTHON):
    code_dir = write_code(tmp_path / "code", ALLREDUCE_SCRIPT)
    config = job(tmp_path, code_dir, args=[str(tmp_path)])
    env = clean_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    run = subprocess.run([str(MPI_PYTHON), "-m", "trainer_pkg.launch", "--config", str(config)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert ("code.framework mpi: this process is rank 1 of ranks that torchrun started without MPI (RANK is set, "
            "OMPI_COMM_WORLD_RANK is not)") in run.stderr
