"""The Slurm adapter against a real Slurm 22.05 (tests/slurmkit.py: munged, slurmctld, two slurmd on
127.0.0.1), commands run by LocalTransport as a worker on the login node would.

The suite's one cluster, a clean view of it for the module (tests/conftest.py). Jobs are the real
trainer on digits under srun (2 nodes × 2 processes), the trainer stand-in (tests/standins/trainer.py,
the backend's ``python``) held at its first step where a job only has to run until it is cancelled,
or a tiny user script that prints what its environment holds.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
import time

import pytest

from cloud_adapters.base import CodeBundle, JobHandle, JobSpec, JobState
from cloud_adapters.registry import create_backend
from polling import read_whole_log, wait_for
import slurmkit
from slurmkit import SLURM_GROUP

pytestmark = SLURM_GROUP


@pytest.fixture(scope="module")
def cluster(slurm_cluster_module):
    """The suite's shared Slurm cluster, clean, with this module's own work directory (tests/conftest.py)."""
    return slurm_cluster_module


@pytest.fixture
def backend(cluster):
    return create_backend("slurm", {"partition": cluster.partition, "work_dir": str(cluster.work_dir),
                                    "slurm_conf": str(cluster.conf), "python": slurmkit.nodes_python(),
                                    "cluster": cluster.cluster_name})


@pytest.fixture
def standin_backend(backend, trainer_standin):
    """The same backend with the trainer stand-in as the nodes' interpreter (its gate: ``trainer_standin``)."""
    return create_backend("slurm", {**backend.config, "python": trainer_standin.python})


def digits_spec(name: str, *, epochs: int = 1, nodes: int = 2, procs: int = 2, **kw) -> JobSpec:
    return JobSpec(job_name=name, config={"train": {"epochs": epochs, "log_every_steps": 1}},
                   nodes=nodes, procs_per_node=procs, max_runtime_s=900, tags={"trainboard-job-id": "7"}, **kw)


def wait_state(backend, handle, states, timeout=240.0):
    return wait_for(lambda: (s := backend.describe(handle)).state in states and s, timeout=timeout,
                    what=f"{handle.job_name} to reach {states}")


def test_connection_checks_the_cluster(backend, cluster):
    checks = backend.test_connection()
    assert [(c.name, c.ok) for c in checks] == [("Slurm commands", True), ("partition", True),
                                                 ("working directory", True)]
    assert checks[0].message == "slurm-wlm 22.05.8"
    assert checks[1].message == "partition debug: up, 2 nodes, 2 CPUs per node, GRES (null)"
    wrong = create_backend("slurm", {**backend.config, "partition": "nosuch"})
    partition = wrong.test_connection()[1]
    assert not partition.ok and partition.message.startswith("sinfo lists no partition 'nosuch': check the partition")


@pytest.mark.slow  # ~35 s on a loaded 2-core machine: two nodes × two ranks start torch
def test_two_node_job_succeeds_and_a_retried_submit_adopts_it(backend, cluster):
    spec = digits_spec("tb-job-101-a", env={"TB_PLAIN": "x"}, secret_env={"TB_SECRET": "s3cr3t"})
    handle = backend.submit(spec)
    again = backend.submit(spec)  # the retry after a worker died: adopts, never a second job
    assert again == handle and handle.provider_job_id.isdigit()
    assert cluster.job_names().count("tb-job-101-a") == 1

    run_dir = cluster.work_dir / "tb-job-101-a"
    assert stat.S_IMODE(os.stat(run_dir / "job.env").st_mode) == 0o600
    assert "s3cr3t" in (run_dir / "job.env").read_text()
    assert "s3cr3t" not in (run_dir / "job.sbatch").read_text()
    config = json.loads((run_dir / "job.json").read_text())
    assert config["output"] == {"output_dir": f"{run_dir}/output", "checkpoint_dir": f"{run_dir}/output/checkpoints"}
    assert config["parallel"]["nodes"] == 2 and config["parallel"]["procs_per_node"] == 2

    done = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED})
    assert done.state is JobState.SUCCEEDED, done.failure_reason
    assert done.raw_state == "COMPLETED" and done.instance_count == 2
    assert done.started_at is not None and done.ended_at is not None and done.ended_at >= done.started_at
    assert (run_dir / "output" / "model.pt").is_file()
    assert json.loads((run_dir / "exit.json").read_text())["returncode"] == 0

    lines, cursor = read_whole_log(backend, handle)
    launch = [ln for ln in lines if ln.startswith("[launch] platform: slurm")]
    assert sorted(ln.split("node_rank ")[1][:1] for ln in launch) == ["0", "1"]
    assert all("of 2 node(s) × 2 process(es) per node = world size 4" in ln for ln in launch)
    assert any(ln.startswith("TRAINBOARD_METRIC") and '"event":"completed"' in ln for ln in lines)
    assert int(cursor) == (run_dir / "slurm.log").stat().st_size
    assert backend.logs(handle, cursor) == ([], cursor)
    first, next_cursor = backend.logs(handle, "")
    assert first[: len(lines)] == lines[: len(first)] and int(next_cursor) > 0


PROBE = b'''import json, os
names = ["TB_PLAIN", "TB_SECRET", "DATABASE_URL", "REDIS_URL", "DJANGO_SECRET_KEY", "PYTHONPATH"]
print("PROBE " + json.dumps({n: os.environ.get(n) for n in names}), flush=True)
'''


def code_bundle(tmp_path, files):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "code.tar.gz"
    path.write_bytes(raw.getvalue())
    return CodeBundle(sha256=hashlib.sha256(raw.getvalue()).hexdigest(), path=str(path))


def test_the_job_starts_from_a_clean_environment(backend, cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("DJANGO_SECRET_KEY", "worker-only")  # the worker's, never the job's
    spec = JobSpec(job_name="tb-job-102-a", config={"code": {"script": "probe.py"}}, nodes=1, procs_per_node=1,
                   max_runtime_s=300, env={"TB_PLAIN": "it's plain"}, secret_env={"TB_SECRET": "s3cr3t"},
                   code=code_bundle(tmp_path, {"probe.py": PROBE}))
    handle = backend.submit(spec)
    done = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED})
    assert done.state is JobState.SUCCEEDED, done.failure_reason
    lines, _ = read_whole_log(backend, handle)
    seen = json.loads(next(ln for ln in lines if ln.startswith("PROBE "))[len("PROBE "):])
    app = f"{cluster.work_dir}/tb-job-102-a/app"
    assert seen["TB_PLAIN"] == "it's plain" and seen["TB_SECRET"] == "s3cr3t"
    assert seen["DATABASE_URL"] is None and seen["REDIS_URL"] is None and seen["DJANGO_SECRET_KEY"] is None
    assert app in seen["PYTHONPATH"].split(os.pathsep)


def test_waiting_job_shows_its_reason_then_cancel_gives_cancelled(standin_backend, cluster, trainer_standin):
    backend = standin_backend
    trainer_standin.hold(steps=1)  # the first job holds both nodes until it is cancelled
    running = backend.submit(digits_spec("tb-job-103-a"))
    wait_state(backend, running, {JobState.RUNNING})
    ranks = trainer_standin.wait_at(1, cluster.work_dir / "tb-job-103-a", timeout=120)
    assert ranks["world_size"] == 4  # srun's two tasks: node 0's ranks 0-1, node 1's ranks 2-3
    waiting = backend.submit(digits_spec("tb-job-104-a"))
    status = wait_state(backend, waiting, {JobState.PENDING}, timeout=30)
    assert status.raw_state == "PENDING"
    assert wait_for(lambda: backend.describe(waiting).secondary_state in ("waiting: Resources", "waiting: Priority"),
                    timeout=30, what="squeue's reason")

    listed = {p.name: p for p in backend.list_tagged()}
    assert {"tb-job-103-a", "tb-job-104-a"} <= set(listed)
    assert listed["tb-job-103-a"].state is JobState.RUNNING and listed["tb-job-103-a"].job_id == 7
    assert listed["tb-job-104-a"].handle == waiting

    for handle in (running, waiting):
        backend.cancel(handle)
        backend.cancel(handle)  # idempotent
    for handle in (running, waiting):
        done = wait_state(backend, handle, {JobState.CANCELLED, JobState.FAILED, JobState.SUCCEEDED}, timeout=60)
        assert done.state is JobState.CANCELLED and done.raw_state == "CANCELLED"
        assert done.failure_reason == "cancelled from Trainboard (scancel)"
    backend.cancel(running)  # an ended job: still no error
    assert not {"tb-job-103-a", "tb-job-104-a"} & {p.name for p in backend.list_tagged()}
    wait_for(lambda: not any(slurmkit.running(pid) for pid in ranks["pids"]), timeout=30,
             what="every rank of the cancelled job to be gone")
    assert not (cluster.work_dir / "tb-job-104-a" / "output").exists()  # the waiting job never started


def test_a_job_slurm_has_forgotten_is_read_from_its_run_directory(backend, cluster):
    def handle(name):
        return JobHandle(provider="slurm", job_name=name, provider_job_id="999999")

    done = cluster.work_dir / "tb-job-901-a"
    done.mkdir()
    (done / "exit.json").write_text('{"returncode": 0, "started_at": 1796169000, "ended_at": 1796169060}\n')
    (done / "job.json").write_text('{"parallel": {"nodes": 2}}')
    failed = cluster.work_dir / "tb-job-902-a"
    failed.mkdir()
    (failed / "exit.json").write_text('{"returncode": 1, "started_at": 1796169000, "ended_at": 1796169060}\n')
    (failed / "slurm.log").write_text("[rank0]: trainer error: rank 0: data.uri /x does not exist\nsrun: error\n")
    cancelled = cluster.work_dir / "tb-job-903-a"
    cancelled.mkdir()
    (cancelled / "cancel_requested").write_text("x\n")

    statuses = backend.describe_many([handle("tb-job-901-a"), handle("tb-job-902-a"), handle("tb-job-903-a"),
                                      handle("tb-job-904-a")])
    ok = statuses["tb-job-901-a"]
    assert (ok.state, ok.instance_count, (ok.ended_at - ok.started_at).total_seconds()) == (JobState.SUCCEEDED, 2, 60)
    assert statuses["tb-job-902-a"].state is JobState.FAILED
    assert statuses["tb-job-902-a"].failure_reason == "trainer error: rank 0: data.uri /x does not exist"
    assert statuses["tb-job-903-a"].state is JobState.CANCELLED
    lost = statuses["tb-job-904-a"]
    assert lost.state is JobState.FAILED and lost.raw_state == "lost"
    assert lost.failure_reason.startswith("Slurm no longer knows job 999999 and it left no exit record")


def test_sbatch_refusal_is_an_invalid_spec(backend, cluster):
    from cloud_adapters.base import InvalidSpec

    wrong = create_backend("slurm", {**backend.config, "partition": "nosuch"})
    with pytest.raises(InvalidSpec, match="Slurm refused the job: sbatch: error: invalid partition specified: nosuch"):
        wrong.submit(digits_spec("tb-job-105-a"))
    assert "tb-job-105-a" not in cluster.job_names()


def test_reset_cancels_every_job_and_resumes_the_nodes_a_test_left_down(cluster):
    """What the shared cluster's reset between modules (tests/conftest.py) undoes: a job requeued
    after its node was set down, a job still pending, a drained node (a down node may already be
    back: ReturnToService=2 takes it back when its slurmd registers again; drained stays drained)."""
    def sbatch(name, nodes):
        out = cluster.run("sbatch", "--parsable", f"--job-name={name}", f"--nodes={nodes}",
                          f"--chdir={cluster.work_dir}", "--wrap", "sleep 300")
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    sbatch("tb-reset-a", 1)
    wait_for(lambda: "RUNNING" in " ".join(cluster.active_jobs() or []), timeout=30, what="the job to run")
    sbatch("tb-reset-b", 2)  # waits for the node the first holds
    node = cluster.run("squeue", "-h", "--name=tb-reset-a", "-o", "%N").stdout.strip()
    other = next(n for n in cluster.nodes if n != node)
    assert cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=test").returncode == 0
    assert cluster.run("scontrol", "update", f"nodename={other}", "state=drain", "reason=test").returncode == 0
    states = cluster.node_states()
    assert states[other] in ("drain", "drng"), states
    assert {line.split()[1] for line in cluster.active_jobs()} == {"tb-reset-a", "tb-reset-b"}

    slurmkit.reset(cluster)
    assert cluster.active_jobs() == []
    assert cluster.node_states() == {n: "idle" for n in cluster.nodes}
