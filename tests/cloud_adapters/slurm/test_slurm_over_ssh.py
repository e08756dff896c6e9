"""The Slurm backend with ``transport`` ssh: built by the registry from its settings and secret, it
reaches a real Slurm 22.05 (tests/slurmkit.py) through a real OpenSSH server (tests/sshkit.py), both
on 127.0.0.1. Every Slurm command goes through sshd, every file through its SFTP subsystem."""

from __future__ import annotations

import pytest

from cloud_adapters.base import JobSpec, JobState
from cloud_adapters.registry import create_backend
from polling import wait_for
import slurmkit
from slurmkit import SLURM_GROUP
from sshkit import keygen, sshd_server

pytestmark = SLURM_GROUP


@pytest.fixture(scope="module")
def cluster(slurm_cluster_module):
    """The suite's shared Slurm cluster, clean, with this module's own work directory (tests/conftest.py)."""
    return slurm_cluster_module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with sshd_server(tmp_path_factory.mktemp("sshd")) as running:
        yield running


def ssh_backend(cluster, server, **overrides):
    config = {"transport": "ssh", "login_host": "127.0.0.1", "ssh_port": server.port, "ssh_user": server.user,
              "ssh_host_key": server.host_key_line, "partition": cluster.partition,
              "work_dir": str(cluster.work_dir), "slurm_conf": str(cluster.conf), "python": slurmkit.nodes_python(),
              "cluster": cluster.cluster_name}
    secrets = {"ssh_private_key": overrides.pop("private_key", server.client_key)}
    config.update(overrides)
    return create_backend("slurm", config, secrets=secrets)


def test_connection_over_ssh_checks_the_login_then_the_cluster(cluster, server):
    backend = ssh_backend(cluster, server)
    checks = backend.test_connection()
    backend.transport.close()

    assert [(c.name, c.ok) for c in checks] == [
        ("SSH connection", True), ("SSH host key", True), ("SSH login", True),
        ("Slurm commands", True), ("partition", True), ("working directory", True)]
    assert checks[3].message == "slurm-wlm 22.05.8"
    assert checks[4].message.startswith("partition debug: up, 2 nodes")


def test_connection_says_host_key_mismatch(cluster, server, tmp_path):
    _, impostor = keygen(tmp_path / "impostor", "ed25519")
    checks = ssh_backend(cluster, server, ssh_host_key=impostor).test_connection()

    assert [(c.name, c.ok) for c in checks] == [("SSH connection", True), ("SSH host key", False)]
    assert checks[1].message.startswith(f"host key of 127.0.0.1:{server.port} does not match the one configured")


def test_connection_says_authentication_refused(cluster, server, tmp_path):
    stranger, _ = keygen(tmp_path / "stranger", "ed25519")
    checks = ssh_backend(cluster, server, private_key=stranger).test_connection()

    assert [(c.name, c.ok) for c in checks][-1] == ("SSH login", False)
    assert checks[-1].message.startswith("SSH authentication refused")


def test_connection_without_a_stored_key_says_so(cluster, server):
    checks = ssh_backend(cluster, server, private_key="").test_connection()
    assert [(c.name, c.ok) for c in checks] == [("transport", False)]
    assert "stores no SSH private key" in checks[0].message


@pytest.mark.slow  # the real trainer (3 steps) under srun: ~30 s on a busy 2-core machine
def test_a_job_submitted_over_ssh_runs_to_success_and_its_logs_come_back(cluster, server):
    backend = ssh_backend(cluster, server)
    spec = JobSpec(job_name="tb-job-ssh-1", config={"train": {"epochs": 1, "max_steps": 3, "log_every_steps": 1}},
                   nodes=1, procs_per_node=1, max_runtime_s=900, tags={"trainboard-job-id": "41"})
    try:
        handle = backend.submit(spec)
        assert backend.submit(spec) == handle  # a retried submit adopts the job over SSH too
        assert cluster.job_names().count("tb-job-ssh-1") <= 1
        listed = [job.name for job in backend.list_tagged()]
        assert listed in (["tb-job-ssh-1"], [])  # [] once it has already ended

        status = wait_for(lambda: (s := backend.describe(handle)).state.is_terminal and s, timeout=240,
                          what="the job submitted over SSH to end")
        lines, cursor = backend.logs(handle, "")
        assert status.state == JobState.SUCCEEDED, (status, lines[-20:])
        assert any('"epoch"' in line for line in lines), lines[-20:]
        assert (cluster.work_dir / "tb-job-ssh-1" / "job.sbatch").exists()  # written through SFTP
    finally:
        backend.transport.close()
