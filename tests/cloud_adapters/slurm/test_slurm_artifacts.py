"""The Slurm backend's artifacts from a real run: one digits job under srun on the Slurm kit's
cluster (tests/slurmkit.py), then its run directory listed and read by both transports — local
files, as a worker on the login node, and SFTP through a real sshd (tests/sshkit.py). Symbolic
links the job left are neither listed nor followed, and job.env (its secrets) is never an artifact."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from cloud_adapters.base import InvalidSpec, JobHandle, JobSpec, JobState, ProviderError
from cloud_adapters.registry import create_backend
from polling import wait_for
import slurmkit
from slurmkit import SLURM_GROUP
from sshkit import sshd_server

pytestmark = [pytest.mark.slow, SLURM_GROUP]


@pytest.fixture(scope="module")
def cluster(slurm_cluster_module):
    """The suite's shared Slurm cluster, clean, with this module's own work directory (tests/conftest.py)."""
    return slurm_cluster_module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with sshd_server(tmp_path_factory.mktemp("sshd")) as running:
        yield running


def _local(cluster):
    return create_backend("slurm", {"partition": cluster.partition, "work_dir": str(cluster.work_dir),
                                    "slurm_conf": str(cluster.conf), "python": slurmkit.nodes_python(),
                                    "cluster": cluster.cluster_name})


def _ssh(cluster, server):
    return create_backend("slurm", {
        "transport": "ssh", "login_host": "127.0.0.1", "ssh_port": server.port, "ssh_user": server.user,
        "ssh_host_key": server.host_key_line, "partition": cluster.partition, "work_dir": str(cluster.work_dir),
        "slurm_conf": str(cluster.conf), "python": slurmkit.nodes_python(), "cluster": cluster.cluster_name},
        secrets={"ssh_private_key": server.client_key})


@pytest.fixture(scope="module")
def finished(cluster, tmp_path_factory):
    """A digits job that ran to SUCCEEDED (1 node × 1 process, 1 epoch); its run directory then gets
    a link to a file outside it and a link to a directory, as a job's code could leave."""
    backend = _local(cluster)
    handle = backend.submit(JobSpec(job_name="tb-job-31-art", config={"train": {"epochs": 1}}, nodes=1,
                                    procs_per_node=1, max_runtime_s=900, tags={"trainboard-job-id": "31"}))
    wait_for(lambda: backend.describe(handle).state in (JobState.SUCCEEDED, JobState.FAILED), timeout=300,
             what="the Slurm job to end")
    status = backend.describe(handle)
    assert status.state == JobState.SUCCEEDED, (status, backend.logs(handle)[0][-20:])
    run_dir = Path(cluster.work_dir) / "tb-job-31-art"
    secret = tmp_path_factory.mktemp("outside") / "id_ed25519"
    secret.write_text("a private key of the cluster user")
    os.symlink(secret, run_dir / "output" / "key.txt")
    os.symlink(secret.parent, run_dir / "output" / "elsewhere")
    return handle, run_dir


def _on_disk(run_dir: Path) -> dict[str, bytes]:
    """What the listing must be, read from the disk independently of the adapter."""
    out = run_dir / "output"
    files = {}
    for path in out.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        rel = path.relative_to(out).as_posix()
        files[rel] = path.read_bytes()
    files["logs/slurm.log"] = (run_dir / "slurm.log").read_bytes()
    return files


@pytest.mark.parametrize("via", ["local", "ssh"])
def test_the_run_directory_is_listed_and_read_through_the_transport(cluster, server, finished, via):
    handle, run_dir = finished
    backend = _local(cluster) if via == "local" else _ssh(cluster, server)
    try:
        expected = _on_disk(run_dir)
        listed = {a.name: a for a in backend.artifacts(handle)}
        assert set(listed) == set(expected)
        assert {"model.pt", "metrics.jsonl", "logs/slurm.log"} <= set(listed)
        assert any(name.startswith("checkpoints/") for name in listed)
        assert {name: a.size_bytes for name, a in listed.items()} == {n: len(b) for n, b in expected.items()}
        assert listed["model.pt"].kind == "model" and listed["logs/slurm.log"].kind == "log"
        with backend.open_artifact(handle, "model.pt") as stream:
            assert hashlib.sha256(stream.read()).hexdigest() == hashlib.sha256(expected["model.pt"]).hexdigest()
        for name in ("key.txt", "elsewhere/id_ed25519", "../job.env", "../slurm.log", "job.env"):
            with pytest.raises(InvalidSpec, match="no artifact"):
                backend.open_artifact(handle, name)
        assert backend.artifact_url(handle, "model.pt") is None  # streamed by the dashboard
        assert backend.artifact_uri(handle, "model.pt") == str(run_dir / "output" / "model.pt")
    finally:
        backend.transport.close()


@pytest.mark.parametrize("via", ["local", "ssh"])
def test_the_transport_refuses_a_path_through_a_link(cluster, server, finished, via):
    """Asked directly (as a name swapped for a link between listing and opening would be), both
    transports refuse a path whose last part, or a directory on the way, is a link."""
    handle, run_dir = finished
    backend = _local(cluster) if via == "local" else _ssh(cluster, server)
    try:
        with pytest.raises(PermissionError):
            backend.transport.open_file(str(run_dir / "output" / "key.txt"), root=str(run_dir / "output"))
        with pytest.raises(PermissionError):
            backend.transport.open_file(str(run_dir / "output" / "elsewhere" / "id_ed25519"),
                                        root=str(run_dir / "output"))
    finally:
        backend.transport.close()


def test_a_job_without_a_run_directory_says_its_files_are_gone(cluster):
    with pytest.raises(ProviderError, match="files are gone"):
        _local(cluster).artifacts(JobHandle("slurm", "tb-job-32-none", "99999"))


def test_a_resubmitted_attempt_lists_the_checkpoints_it_wrote_in_the_lost_attempts_directory(cluster, finished):
    """Recovery (docs/recovery.md) gives the next attempt the lost one's checkpoint directory: it
    resumes and writes its checkpoints there, and its artifacts and checkpoint_uri say so."""
    first, first_dir = finished
    backend = _local(cluster)
    resume_in = backend.checkpoint_uri(first)
    assert resume_in == f"{cluster.work_dir}/tb-job-31-art/output/checkpoints"
    handle = backend.submit(JobSpec(job_name="tb-job-31-art-a2", config={"train": {"epochs": 2}}, nodes=1,
                                    procs_per_node=1, max_runtime_s=900, checkpoint_uri=resume_in,
                                    tags={"trainboard-job-id": "31"}))
    assert handle.extra == {"run_dir": f"{cluster.work_dir}/tb-job-31-art-a2", "checkpoint_dir": resume_in}
    wait_for(lambda: backend.describe(handle).state in (JobState.SUCCEEDED, JobState.FAILED), timeout=300,
             what="the resubmitted attempt to end")
    assert backend.describe(handle).state == JobState.SUCCEEDED, backend.logs(handle)[0][-20:]
    second_dir = Path(cluster.work_dir) / "tb-job-31-art-a2"
    # It resumed after the first attempt's epoch: its own metrics hold the second epoch only.
    epochs = {json.loads(line).get("epoch") for line in (second_dir / "output" / "metrics.jsonl").read_text().splitlines()
              if '"val_accuracy"' in line}
    assert epochs == {1}, epochs

    listed = {a.name: a for a in backend.artifacts(handle)}
    in_first = {f"checkpoints/{p.relative_to(first_dir / 'output' / 'checkpoints').as_posix()}": p.stat().st_size
                for p in (first_dir / "output" / "checkpoints").rglob("*") if p.is_file() and not p.is_symlink()}
    assert "checkpoints/last.pt" in in_first
    assert {n: a.size_bytes for n, a in listed.items() if n.startswith("checkpoints/")} == in_first
    assert {"model.pt", "metrics.jsonl", "logs/slurm.log"} <= set(listed)  # its own run directory's
    assert backend.artifact_uri(handle, "checkpoints/last.pt") == f"{resume_in}/last.pt"
    assert backend.artifact_uri(handle, "model.pt") == str(second_dir / "output" / "model.pt")
    assert backend.checkpoint_uri(handle) == resume_in  # a third attempt resumes in the same place

    # A checkpoint_dir that is not a run's output/checkpoints under the work directory is not followed.
    for stray in ("/etc", f"{cluster.work_dir}/../x/output/checkpoints", f"{cluster.work_dir}/tb-job-31-art/output"):
        other = JobHandle("slurm", "tb-job-31-art-a2", handle.provider_job_id,
                          extra={"run_dir": str(second_dir), "checkpoint_dir": stray})
        assert backend.checkpoint_uri(other) == f"{second_dir}/output/checkpoints", stray
