"""The Ray backend against a real Ray 2.60 head on this machine (tests/raykit.py: ``ray start --head`` from
the Ray test venv, free ports, 2 CPUs), reached only over HTTP as the worker reaches it (this process has
no ``ray``). Jobs: a tiny script model whose two ranks all-reduce over the MASTER_ADDR/MASTER_PORT the
entrypoint gives them, a script held running until it is cancelled (as an orphan), a Ray script that runs
its own Ray Train, a failing script. The built-in trainer's run on 2 Ray Train workers, with the log's cursor, is
tests/e2e/test_ray_backend.py's (through the worker).

One head for this module and tests/e2e/test_ray_backend.py (``raykit.head``, session-scoped: both are
in the ray-backend xdist group); its first start builds the Ray venv when it is missing
(tests/framework_venvs.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import psutil
import pytest

from cloud_adapters.base import CodeBundle, JobSpec, JobState
from cloud_adapters.registry import create_backend
from polling import read_whole_log, wait_for
from raykit import head, ray_python  # noqa: F401 (fixtures: one head for the ray-backend group)
from trainer_pkg.metrics import parse_metric_line

# Every test may use the database (one does: the orphan reconciler), so pytest-django keeps the module's
# tests together and the module starts one head.
pytestmark = [pytest.mark.xdist_group("ray-backend"), pytest.mark.django_db]



@pytest.fixture
def backend(head):
    # Outputs under the head's own directory: a job resumes from a checkpoint it finds (a run before this one's).
    return create_backend("ray", {"address": head.address, "python": str(head.python), "cluster": "lab",
                                  "output_path": f"{head.temp_dir}/out"})


def wait_state(backend, handle, states, timeout=300.0):
    return wait_for(lambda: (s := backend.describe(handle)).state in states and s, timeout=timeout, interval=1.0,
                    what=f"{handle.job_name} to reach {states}")


def records(lines):
    return [r for r in (parse_metric_line(ln) for ln in lines) if r is not None]


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


def test_connection_names_the_ray_version_and_the_cpus(backend, head):
    checks = backend.test_connection()
    assert [(c.name, c.ok) for c in checks] == [("Ray dashboard", True), ("resources", True)]
    assert checks[0].message == f"Ray 2.60.0 (Jobs API version 4) at {head.address}"
    assert checks[1].message.startswith("1 node(s), 2 CPUs (")
    assert checks[1].message.endswith("0 GPUs (0 free)")

    greedy = create_backend("ray", {**backend.config, "gpus_per_worker": 1})
    resources = greedy.test_connection()[1]
    assert not resources.ok and "one worker needs 1 CPU and 1 GPU" in resources.message

    nobody = create_backend("ray", {**backend.config, "address": "http://127.0.0.1:9"})
    [dashboard] = nobody.test_connection()
    assert not dashboard.ok and dashboard.message.startswith("the Ray dashboard at http://127.0.0.1:9 did not answer")


ALLREDUCE = b'''import os
import torch
import torch.distributed as dist
from trainer_pkg import report

dist.init_process_group("gloo")  # env://: MASTER_ADDR and MASTER_PORT from the Ray entrypoint
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(f"ALLREDUCE rank {dist.get_rank()} of {dist.get_world_size()} sum {total.item():g} "
      f"local {os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']}", flush=True)
report.log(step=1, loss=1.0 / total.item(), ranks_sum=total.item())
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_a_script_model_runs_as_two_ranks_that_reach_each_other(backend, tmp_path):
    spec = JobSpec(job_name="tb-job-202-a", config={"code": {"script": "allreduce.py"}}, nodes=1, procs_per_node=2,
                   max_runtime_s=600, tags={"trainboard-job-id": "202"},
                   code=code_bundle(tmp_path, {"allreduce.py": ALLREDUCE}))
    handle = backend.submit(spec)
    done = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED})
    assert done.state is JobState.SUCCEEDED, done.failure_reason

    lines, _ = read_whole_log(backend, handle)
    said = sorted(ln[ln.index("ALLREDUCE"):] for ln in lines if "ALLREDUCE rank" in ln)
    assert said == ["ALLREDUCE rank 0 of 2 sum 3 local 0/2", "ALLREDUCE rank 1 of 2 sum 3 local 1/2"]
    logged = [r for r in records(lines) if r.get("ranks_sum") is not None]
    assert len(logged) == 1 and logged[0]["ranks_sum"] == 3.0 and logged[0]["step"] == 1  # rank 0 reports


RAY_SCRIPT = b'''import os
import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer


def loop(config):
    import torch
    import torch.distributed as dist
    from trainer_pkg import report

    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    report.log(step=1, ranks_sum=total.item())


ray.init()
print("RAYSCRIPT driver on", ray.get_runtime_context().get_job_id() is not None, flush=True)
print("RAYSCRIPT shape", *(os.environ[n] for n in ("TRAINBOARD_RAY_NUM_WORKERS", "TRAINBOARD_RAY_USE_GPU",
                                                  "TRAINBOARD_NNODES", "TRAINBOARD_NPROC_PER_NODE")), flush=True)
# As docs/user-code.md has it: the workers from the job's shape (the trial's script failed here on this backend).
TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=int(os.environ["TRAINBOARD_RAY_NUM_WORKERS"]))).fit()
print("RAYSCRIPT done", flush=True)
'''


@pytest.mark.slow
def test_a_ray_script_is_the_jobs_driver_and_runs_its_own_ray_train(backend, tmp_path):
    spec = JobSpec(job_name="tb-job-205-a", config={"code": {"script": "ray_train.py", "framework": "ray"}}, nodes=1,
                   procs_per_node=2, max_runtime_s=600, tags={"trainboard-job-id": "205"},
                   code=code_bundle(tmp_path, {"ray_train.py": RAY_SCRIPT}))
    handle = backend.submit(spec)
    done = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED})
    assert done.state is JobState.SUCCEEDED, done.failure_reason
    lines, _ = read_whole_log(backend, handle)
    assert any("[ray] running the user's Ray script as the job's driver: python ray_train.py" in ln for ln in lines)
    assert "RAYSCRIPT driver on True" in lines and lines.index("RAYSCRIPT done") > lines.index("RAYSCRIPT driver on True")
    assert "RAYSCRIPT shape 2 0 1 2" in lines  # 1 node × 2 processes, no GPU
    logged = [r for r in records(lines) if r.get("ranks_sum") is not None]
    assert [(r["step"], r["ranks_sum"]) for r in logged] == [(1, 3.0)]  # rank 0 of the script's own 2 workers


FAILING = b'''def load(shard):
    raise ValueError(f"bad shard {shard}")


print("about to fail", flush=True)
load(7)
'''


@pytest.mark.slow
def test_a_failing_script_fails_the_job_with_its_reason(backend, tmp_path):
    spec = JobSpec(job_name="tb-job-203-a", config={"code": {"script": "fail.py"}}, nodes=1, procs_per_node=1,
                   max_runtime_s=600, tags={"trainboard-job-id": "203"}, code=code_bundle(tmp_path, {"fail.py": FAILING}))
    handle = backend.submit(spec)
    assert backend.submit(spec) == handle  # the retry after a worker died: adopts, never a second job
    assert (handle.provider, handle.provider_job_id, handle.extra) == ("ray", "tb-job-203-a", {"workers": 1})
    done = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED})
    assert done.state is JobState.FAILED and done.raw_state == "FAILED"
    assert done.failure_reason.startswith("fail.py:2 in load: ValueError: bad shard 7"), done.failure_reason


HOLD = b'''import os, sys, time
print("HOLDING rank", os.environ["RANK"], "pid", os.getpid(), flush=True)
while True:
    time.sleep(0.2)
'''


def _held_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
def test_a_tagged_job_unknown_to_the_database_is_an_orphan_and_cancel_stops_it(backend, head, tmp_path, user):
    from jobs import orphans, services
    from jobs.models import OrphanJob

    spec = JobSpec(job_name="tb-job-204-a", config={"code": {"script": "hold_tb204.py"}}, nodes=1, procs_per_node=2,
                   max_runtime_s=600, tags={"trainboard-job-id": "987654"},
                   code=code_bundle(tmp_path, {"hold_tb204.py": HOLD}))
    handle = backend.submit(spec)
    wait_for(lambda: len([ln for ln in read_whole_log(backend, handle)[0] if "HOLDING rank" in ln]) == 2, timeout=300,
             interval=1.0, what="both ranks to run the script")
    assert backend.describe(handle).state is JobState.RUNNING
    assert len(_held_processes("hold_tb204.py")) >= 2  # the two ranks' script processes

    # The orphan reconciler: a tagged, running Ray job that no job row knows.
    [listed] = [p for p in backend.list_tagged() if p.name == "tb-job-204-a"]
    assert (listed.state, listed.raw_state, listed.job_id) == (JobState.RUNNING, "RUNNING", 987654)
    assert listed.handle == handle
    row = services.backend_create(owner=user, name="lab-ray", kind="ray", config=dict(backend.config))
    assert orphans.reconcile_orphans(row.pk)["open"] == 1
    orphan = OrphanJob.objects.get(backend=row)
    assert (orphan.provider_job_name, orphan.raw_state) == ("tb-job-204-a", "RUNNING")

    backend.cancel(listed.handle)
    backend.cancel(listed.handle)  # idempotent
    stopped = wait_state(backend, handle, {JobState.CANCELLED, JobState.FAILED, JobState.SUCCEEDED}, timeout=120)
    assert stopped.state is JobState.CANCELLED and stopped.raw_state == "STOPPED"
    assert stopped.failure_reason.startswith("stopped on the Ray cluster")
    wait_for(lambda: not _held_processes("hold_tb204.py"), timeout=60, what="the ranks' processes to end")
    assert orphans.reconcile_orphans(row.pk) == {"listed": 0, "open": 0, "resolved": 1, "stopped": 0}
    backend.cancel(handle)  # a job that has ended: nothing to do, no error
