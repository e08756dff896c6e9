"""``code.framework: tensorflow`` (trainer_pkg.frameworks.tensorflow, issue 33).

Unit level, no TensorFlow: the ``TF_CONFIG`` each worker gets where SageMaker's, Vertex AI's and Azure
ML's environments are recreated (their variables as tests/trainer_pkg/test_platforms.py recreates them
for torch), the launchers trading addresses through a real ``TCPStore``, and a rendezvous that a
node never joins failing the launcher within its deadline.

Real processes, in the TensorFlow test venv (tests/framework_venvs.py, tensorflow-cpu 2.21): a
2-worker ``MultiWorkerMirroredStrategy`` script trains to identical weights on both workers; a worker
that fails stops the other; a worker whose peer never starts (and that ignores SIGTERM, as a TF worker
blocked in the strategy's set-up does) is killed at the deadline, no process left; SIGTERM to the
launcher (a cancel) stops workers that ignore it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from framework_venvs import TENSORFLOW, framework_venv_fixture
from polling import wait_for
from tensorflow_scripts import TF_SCRIPT
from test_platforms import azure_vars, clean_env, free_port, sagemaker_layout, vertex_vars
from trainer_helpers import REPO
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.frameworks import tensorflow as tfw
from trainer_pkg.metrics import parse_metric_line
from trainer_pkg.platforms import plan
from user_scripts import write_code

TF = framework_venv_fixture("tensorflow", TENSORFLOW)

WORKER_PIDS = re.compile(r"\[launch\] TensorFlow worker\(s\) of rank [\d, -]+ started: pid ([\d, ]+)")


def tf_job(tmp_path: Path, args: list[str], procs: int = 2) -> Path:
    code = write_code(tmp_path / "code", TF_SCRIPT)
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"output": {"output_dir": str(tmp_path / "out")}, "parallel": {"procs_per_node": procs},
                                "code": {"dir": str(code), "script": "train.py", "args": args,
                                         "framework": "tensorflow"}}))
    return path


def cfg(procs: int = 2) -> JobConfig:
    return JobConfig.from_dict({"parallel": {"procs_per_node": procs},
                                "code": {"script": "train.py", "framework": "tensorflow"}})


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has: it is only not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def exchange(envs: list[dict[str, str]], config: JobConfig, deadline_s: float = 30) -> list[list[dict]]:
    """Each launcher's worker TF_CONFIGs, every launcher in its own thread as on its own machine."""
    out: list = [None] * len(envs)  # (configs, peers): the store's host keeps serving until all are back

    def one(i: int) -> None:
        shape = tfw.launch_shape(plan(envs[i], config), envs[i])
        out[i] = tfw.cluster_configs(shape, envs[i], deadline_s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(envs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s + 5)
    return [configs for configs, _ in out]


# -- TF_CONFIG where each platform's environment is recreated (no TensorFlow) ----------------------


def test_sagemaker_hosts_get_a_written_tf_config_with_launcher_chosen_ports(tmp_path):
    """SageMaker sets no TF_CONFIG for a script: the launchers of algo-1 and algo-2 write one, two
    workers per host (procs_per_node on CPU; SM_NUM_GPUS 0), ports traded at the rendezvous
    (algo-1's launcher serves the store at MASTER_ADDR:MASTER_PORT, as the torch path's rendezvous)."""
    port, hosts = free_port(), ["algo-1", "algo-2"]
    envs = [clean_env(**sagemaker_layout(tmp_path / h, h, hosts, port, {}), MASTER_ADDR="127.0.0.1") for h in hosts]
    node0, node1 = exchange(envs, cfg(2))
    workers = node0[0]["cluster"]["worker"]
    assert len(workers) == 4 and len(set(workers)) == 4
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", w) for w in workers)
    assert [c["task"] for c in node0 + node1] == [{"type": "worker", "index": i} for i in range(4)]
    assert all(c["cluster"] == {"worker": workers} for c in node0 + node1)
    envs1 = [tfw.worker_env(envs[1], c, local_rank=i, local_world=2) for i, c in enumerate(node1)]
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs1] == \
        [("2", "4", "0", "2"), ("3", "4", "1", "2")]
    assert json.loads(envs1[1]["TF_CONFIG"]) == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 3}}
    assert "MASTER_ADDR" not in envs1[0] and "MASTER_PORT" not in envs1[0]


def test_kubernetes_pods_get_a_written_tf_config():
    """Kubeflow Trainer's torch runtime (PET_* on each pod, clouds.md §7): pod 0's launcher serves the
    store at PET_MASTER_ADDR:PET_MASTER_PORT; PET_NPROC_PER_NODE 2 workers per pod."""
    port = free_port()
    envs = [clean_env(PET_NNODES="2", PET_NODE_RANK=str(n), PET_NPROC_PER_NODE="2", PET_MASTER_ADDR="127.0.0.1",
                      PET_MASTER_PORT=str(port)) for n in (0, 1)]
    pod0, pod1 = exchange(envs, cfg(2))
    assert [c["task"]["index"] for c in pod0 + pod1] == [0, 1, 2, 3]
    assert pod0[0]["cluster"] == pod1[1]["cluster"] and len(set(pod0[0]["cluster"]["worker"])) == 4


def test_vertex_tf_config_is_passed_through_and_its_chief_is_rank_0(tmp_path):
    """Vertex sets TF_CONFIG on every replica (chief = workerpool0, worker = workerpool1; AI Platform's
    "TF_CONFIG and distributed training"): the launcher runs that one worker with it unchanged."""
    given = {"cluster": {"chief": ["cmle-training-chief-0:2222"],
                         "worker": ["cmle-training-worker-0:2222", "cmle-training-worker-1:2222"]},
             "environment": "cloud", "task": {"type": "worker", "index": 1, "trial": ""},
             "job": {"python_module": "trainer_pkg.launch"}}
    env = clean_env(**vertex_vars(tmp_path, "workerpool1", 1, 2, free_port()), TF_CONFIG=json.dumps(given))
    spec = json.loads(env["CLUSTER_SPEC"])
    spec["cluster"]["workerpool1"] = ["127.0.0.2:2222", "127.0.0.3:2222"]
    env.update(CLUSTER_SPEC=json.dumps(spec), WORLD_SIZE="3")
    [configs] = exchange([env], cfg(1))
    assert configs == [given]
    worker = tfw.worker_env(env, configs[0], local_rank=0, local_world=1)
    assert json.loads(worker["TF_CONFIG"]) == given
    assert (worker["RANK"], worker["WORLD_SIZE"]) == ("2", "3")  # chief 0, worker 0 → 1, worker 1 → 2
    assert [a for _, _, a in tfw.training_tasks(given)] == ["cmle-training-chief-0:2222",
                                                            "cmle-training-worker-0:2222", "cmle-training-worker-1:2222"]


def test_azureml_tensorflow_distribution_tf_config_is_passed_through(tmp_path):
    """Azure ML's ``tensorflow`` distribution (TensorFlowDistribution(worker_count=2)) starts a process
    per worker with TF_CONFIG and none of the PyTorch distribution's RANK/MASTER_* variables."""
    given = {"cluster": {"worker": ["10.0.0.4:6000", "10.0.0.5:6000"]}, "task": {"type": "worker", "index": 0}}
    env = clean_env(**{k: v for k, v in azure_vars(tmp_path, 0, 1).items()
                       if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")},
                    TF_CONFIG=json.dumps(given))
    p = plan(env, cfg(1))
    assert (p.platform, p.nnodes, p.nproc_per_node, p.in_process) == ("azureml", 1, 1, False)
    [configs] = exchange([env], cfg(1))
    assert configs == [given]
    worker = tfw.worker_env(env, given, local_rank=0, local_world=1)
    assert (worker["RANK"], worker["WORLD_SIZE"], worker["TF_CONFIG"]) == ("0", "2", json.dumps(given, sort_keys=True))


def test_ranks_started_by_the_platform_each_run_one_worker(tmp_path):
    """Azure ML's PyTorch distribution (ranks started by the platform, no agent store): rank 0's
    launcher serves the store, every rank runs one worker, task index = RANK."""
    port = free_port()
    envs = [clean_env(**azure_vars(tmp_path, r, port)) for r in range(4)]
    configs = exchange(envs, cfg(2))
    assert [c[0]["task"]["index"] for c in configs] == [0, 1, 2, 3]
    assert len({json.dumps(c[0]["cluster"]) for c in configs}) == 1


def test_garbled_tf_config_names_it():
    for raw, says in (("{not json", "TF_CONFIG is not valid JSON"),
                      ('{"cluster": {"worker": ["a:1"]}}', "with 'cluster' and 'task'"),
                      ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}', "list of 'host:port'"),
                      ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}', "not a task of its cluster (worker: 1)")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            tfw.platform_tf_config({"TF_CONFIG": raw})


def test_each_local_worker_sees_its_own_gpu():
    given = tfw.written_tf_config(["h:1", "h:2"], 1)
    assert tfw.worker_env({"CUDA_VISIBLE_DEVICES": "3,5"}, given, local_rank=1, local_world=2)["CUDA_VISIBLE_DEVICES"] == "5"
    assert tfw.worker_env({"CUDA_VISIBLE_DEVICES": "3"}, given, local_rank=1, local_world=2)["CUDA_VISIBLE_DEVICES"] == "3"
    assert tfw.worker_env({"CUDA_VISIBLE_DEVICES": "3,5"}, given, local_rank=0, local_world=1)["CUDA_VISIBLE_DEVICES"] == "3,5"


def test_a_node_that_never_joins_fails_the_launcher_within_the_deadline(tmp_path):
    """Slurm node 0 of 2; node 1's launcher never starts: node 0 serves the rendezvous, waits the
    deadline (3 s), then exits 1 with the reason on stderr and as the ``failed`` record; no worker started."""
    config = tf_job(tmp_path, [], procs=1)
    env = clean_env(SLURM_JOB_ID="77", SLURM_NODEID="0", SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]",
                    SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                    TRAINBOARD_TF_CLUSTER_DEADLINE_S="3")
    t0 = time.monotonic()
    run = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "trainer_pkg.launch", "--config", str(config)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert run.returncode == 1, run.stderr[-2000:]
    reason = "the TensorFlow cluster did not form within 3 s: node(s) 1 never joined the rendezvous at 127.0.0.1:"
    assert f"trainer error: {reason}" in run.stderr
    [failed] = [r for r in map(parse_metric_line, run.stdout.splitlines()) if r and r.get("event") == "failed"]
    assert failed["reason"].startswith(reason)
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])["reason"] == failed["reason"]
    assert "TensorFlow worker(s)" not in run.stdout
    assert 3 <= took < 30, took


def test_a_bad_deadline_setting_exits_2_naming_it(tmp_path):
    config = tf_job(tmp_path, [])
    run = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "trainer_pkg.launch", "--config", str(config),
                          "--standalone"], cwd=REPO, env=clean_env(TRAINBOARD_TF_CLUSTER_DEADLINE_S="soon"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "trainer error: TRAINBOARD_TF_CLUSTER_DEADLINE_S must be a number of seconds above 0, got 'soon'" in run.stderr


def test_a_failed_workers_reason_names_its_exception_where_the_users_code_raised_it(tmp_path):
    """The supervisor's reason for a worker that ended on an uncaught exception: its rank, pid, exit code
    and the line trainer_pkg.rank_entry wrote (not a peer's consequence); the other worker is stopped and
    the error files are gone. Plain Python workers: the subject is the supervisor, not TensorFlow."""
    code = write_code(tmp_path / "code", "import os, time\n"
                                         "def load(shard):\n"
                                         "    raise ValueError(f'bad shard {shard}')\n"
                                         "if os.environ['RANK'] == '1':\n"
                                         "    load(7)\n"
                                         "time.sleep(600)\n")
    env = clean_env()
    commands = [([sys.executable, "-m", "trainer_pkg.rank_entry", str(code / "train.py")],
                 {**env, "RANK": str(rank), "PYTHONPATH": str(REPO)}) for rank in (0, 1)]
    shape = tfw.Shape(members=1, member=0, workers=2, master_addr="", master_port=0, hosts_store=False)
    supervisor = tfw._Supervisor(commands, str(code), peers=tfw.Peers(shape, None, "p/"), addresses=[],
                                 deadline=time.monotonic() + 60, deadline_s=60, grace_s=2)
    supervisor.start()
    try:
        code_, reason = supervisor.watch()
    finally:
        supervisor.stop()
    pid = supervisor.procs[1].pid
    assert (code_, reason) == (1, f"TensorFlow worker 1 (pid {pid}) exited with code 1: train.py:3 in load: "
                                  f"ValueError: bad shard 7; the job's other workers were stopped")
    assert supervisor.procs[0].returncode == -signal.SIGTERM
    assert not Path(supervisor.error_dir).exists()


# -- real TensorFlow workers ---------------------------------------------------------------------------


def launch_tf(python: Path, config: Path, *extra: str, env: dict[str, str] | None = None,
              timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "trainer_pkg.launch", "--config", str(config), *extra], cwd=REPO,
                          env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def pids(stdout: str) -> list[int]:
    return [int(p) for m in WORKER_PIDS.finditer(stdout) for p in m.group(1).split(", ")]


@pytest.mark.slow
def test_two_workers_train_to_identical_weights(tmp_path, TF):
    t0 = time.monotonic()
    run = launch_tf(TF, tf_job(tmp_path, ["--steps", "20"]), "--standalone", "--nproc-per-node", "2")
    assert run.returncode == 0, run.stderr[-4000:]
    out = tmp_path / "out"
    w0, w1 = (json.loads((out / f"weights-{r}.json").read_text()) for r in (0, 1))
    assert w0["weights"] == w1["weights"]  # the all-reduce made both workers' variables one
    assert w0["world_size"] == w1["world_size"] == 2
    workers = w0["tf_config"]["cluster"]["worker"]
    assert w0["tf_config"] == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 0}}
    assert w1["tf_config"] == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 1}}
    # The true weights are (1, -2, 0.5, 3): 20 steps of lr 0.1 get close from 0.
    assert all(abs(a - b) < 0.2 for a, b in zip(w0["weights"], [1.0, -2.0, 0.5, 3.0])), w0
    [logged] = [r for r in map(parse_metric_line, run.stdout.splitlines()) if r and r.get("event") == "step"]
    assert [logged[f"w{i}"] for i in range(4)] == w0["weights"]  # report.log, from worker 0 only
    assert logged["step"] == 20 and logged["loss"] == pytest.approx(w0["loss"])
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["w0"] == w0["weights"][0]
    assert sorted(pids(run.stdout)) == sorted([w0["pid"], w1["pid"]]) and not any(map(alive, pids(run.stdout)))
    print(f"\n[tensorflow] 2 workers trained in {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
def test_a_failed_worker_stops_the_other(tmp_path, TF):
    """Worker 1 exits 3 before the strategy; worker 0, waiting for it, is stopped: exit 3, reason named."""
    run = launch_tf(TF, tf_job(tmp_path, ["--fail-rank", "1"]), "--standalone", "--nproc-per-node", "2")
    assert run.returncode == 3, run.stderr[-3000:]
    started = pids(run.stdout)
    assert len(started) == 2 and not any(map(alive, started))
    assert re.search(r"trainer error: TensorFlow worker 1 \(pid \d+\) exited with code 3; the job's other workers "
                     r"were stopped", run.stderr), run.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])["event"] == "failed"


@pytest.mark.slow
def test_a_worker_whose_peer_never_starts_is_killed_at_the_deadline(tmp_path, TF):
    """A TF_CONFIG of 2 workers (as Azure ML's tensorflow distribution gives) where worker 1 never
    starts: worker 0 ignores SIGTERM; at the deadline (20 s) the launcher kills it (SIGKILL after a
    2 s grace) and exits 1 naming the worker that never listened. No process is left."""
    given = {"cluster": {"worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]},
             "task": {"type": "worker", "index": 0}}
    env = clean_env(TF_CONFIG=json.dumps(given), TRAINBOARD_TF_CLUSTER_DEADLINE_S="20", TRAINBOARD_TF_GRACE_S="2")
    t0 = time.monotonic()
    run = launch_tf(TF, tf_job(tmp_path, ["--ignore-sigterm"], procs=1), env=env, timeout=120)
    took = time.monotonic() - t0
    assert run.returncode == 1, run.stderr[-3000:]
    [pid] = pids(run.stdout)
    assert not alive(pid)
    found = re.search(r"trainer error: the TensorFlow cluster did not form within 20 s "
                      r"\(TRAINBOARD_TF_CLUSTER_DEADLINE_S\): worker\(s\) (.+) never started listening; the job's "
                      r"workers were stopped", run.stderr)
    assert found, run.stderr[-3000:]
    # Worker 1 is named; worker 0 too when TensorFlow's import outlasted the deadline on a loaded machine.
    assert given["cluster"]["worker"][1] in found.group(1).split(", ")
    # SIGTERM was ignored: the launcher waited the grace period, then SIGKILL ended the worker.
    assert 20 + 2 <= took < 20 + 2 + 20, took
    [failed] = [r for r in map(parse_metric_line, run.stdout.splitlines()) if r and r.get("event") == "failed"]
    assert failed["reason"] == found.group(0)[len("trainer error: "):]


def start_ignoring_workers(tmp_path: Path, python: Path) -> tuple[subprocess.Popen, list[int]]:
    """The launcher with 2 workers that ignore SIGTERM and wait forever before TensorFlow (the subject is
    the launcher's stopping; a real TF worker waiting for its cluster is the deadline test's), returned
    once both said so (their own lines: the gate), with the workers' pids."""
    cmd = [str(python), "-m", "trainer_pkg.launch", "--config",
           str(tf_job(tmp_path, ["--ignore-sigterm", "--never-start-rank", "all"])), "--standalone",
           "--nproc-per-node", "2"]
    err = open(tmp_path / "stderr", "wb")
    # The deadline bounds the wait below if a worker's line never comes (the default is 600 s).
    env = clean_env(TRAINBOARD_TF_GRACE_S="2", TRAINBOARD_TF_CLUSTER_DEADLINE_S="180")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    err.close()
    started, ignoring = [], set()
    for line in proc.stdout:
        started += pids(line)
        # Not anchored: the two workers print at once, and under ``python -u`` (PYTHONUNBUFFERED in the
        # environment) print writes a line's text and its newline apart, so two lines can land as one.
        ignoring |= set(re.findall(r"worker (\d+) ignores SIGTERM", line))
        if ignoring == {"0", "1"}:
            break
    assert len(started) == 2 and ignoring == {"0", "1"}, (tmp_path / "stderr").read_text()[-3000:]
    return proc, started


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_workers_that_ignore_it(tmp_path, TF):
    """A cancel: SIGTERM to the launcher once its workers ignore SIGTERM: SIGKILL ends them after the
    2 s grace, exit 143."""
    proc, started = start_ignoring_workers(tmp_path, TF)
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.stdout.read()
        code = proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGTERM, (tmp_path / "stderr").read_text()[-3000:]
    assert 2 <= took < 15, took
    assert not any(map(alive, started))


@pytest.mark.slow
def test_workers_die_with_a_killed_launcher(tmp_path, TF):
    """SIGKILL to the launcher (it cannot stop anything): the kernel kills its workers
    (PR_SET_PDEATHSIG), those that ignore SIGTERM included."""
    proc, started = start_ignoring_workers(tmp_path, TF)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    wait_for(lambda: not any(map(alive, started)), timeout=10, what=f"workers {started} to die with their launcher")
