"""The launcher's ``slurm`` platform: the node list expander, the plan a task srun started reads, and
two launchers with Slurm's variables training 4 ranks on 127.0.0.1 (as the other platforms' tests in
test_platforms.py do). A real srun starting it on two nodes is in
tests/cloud_adapters/slurm/test_slurm_backend.py and tests/e2e/test_slurm.py.
"""

from __future__ import annotations

import pytest

from trainer_pkg.config import JobConfig
from trainer_pkg.platforms import PlatformError, detect, expand_nodelist, plan


@pytest.mark.parametrize("compressed, hosts", [
    ("n1", ["n1"]),
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("gpu-[01-02]", ["gpu-01", "gpu-02"]),
    ("gpu-[08-11]", ["gpu-08", "gpu-09", "gpu-10", "gpu-11"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("node[7]", ["node7"]),
    ("x[1-2],y,z[10-11]", ["x1", "x2", "y", "z10", "z11"]),
])
def test_expand_nodelist(compressed, hosts):
    assert expand_nodelist(compressed) == hosts


@pytest.mark.parametrize("bad", ["n[1-3", "n1-3]", "n[a-b]", "n[3-1]", "n[1-]"])
def test_expand_nodelist_refuses_malformed_lists(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


def slurm_env(**extra):
    env = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "1", "SLURM_NNODES": "3",
           "SLURM_JOB_NODELIST": "gpu-[01-03]"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_detected_from_job_id_and_node_id():
    assert detect(slurm_env()) == ("slurm", "SLURM_JOB_ID and SLURM_NODEID are set")
    # The batch step alone (no srun task) has no SLURM_NODEID in every Slurm version: not a task.
    assert detect({"SLURM_JOB_ID": "1"})[0] == "local"


def test_plan_reads_node_rank_hosts_and_first_host_rendezvous():
    cfg = JobConfig.from_dict({"parallel": {"procs_per_node": 2}})
    p = plan(slurm_env(), cfg)
    assert (p.platform, p.nnodes, p.node_rank, p.nproc_per_node) == ("slurm", 3, 1, 2)
    assert p.master_addr == "gpu-01"
    assert p.master_port == 20000 + 4242 % 20000
    assert not p.in_process and p.world_size == 6


def test_launch_node_address_port_and_gpus():
    cfg = JobConfig.from_dict({"parallel": {"procs_per_node": 2}})
    p = plan(slurm_env(SLURM_LAUNCH_NODE_IPADDR="10.0.0.7", MASTER_PORT="29555", SLURM_GPUS_ON_NODE="4"), cfg)
    assert (p.master_addr, p.master_port, p.nproc_per_node) == ("10.0.0.7", 29555, 4)
    # --nproc-per-node wins over the GPUs Slurm gave the node.
    assert plan(slurm_env(SLURM_GPUS_ON_NODE="4"), cfg, nproc=1).nproc_per_node == 1


def test_one_node_needs_no_rendezvous():
    p = plan(slurm_env(SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_NODELIST="n7"), JobConfig())
    assert (p.nnodes, p.master_addr, p.master_port) == (1, "", 0)


@pytest.mark.parametrize("change, message", [
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NODELIST": "gpu-[01-03"}, "SLURM_JOB_NODELIST cannot be read"),
    ({"SLURM_NNODES": "2"}, "SLURM_NNODES is 2 but SLURM_JOB_NODELIST names 3 host(s)"),
    ({"SLURM_NODEID": "3"}, "SLURM_NODEID 3 is not below SLURM_NNODES 3"),
    ({"SLURM_NODEID": "x"}, "SLURM_NODEID is not an integer"),
    ({"SLURM_GPUS_ON_NODE": "two"}, "SLURM_GPUS_ON_NODE is not an integer"),
])
def test_missing_or_malformed_variables_are_named(change, message):
    with pytest.raises(PlatformError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        plan(slurm_env(**change), JobConfig(), platform="slurm")


@pytest.mark.slow  # ~30 s on a loaded 2-core machine: 4 ranks import torch
def test_two_tasks_train_four_ranks_on_127_0_0_1(tmp_path):
    """What srun starts on each of two nodes (one task per node), recreated on this machine: the
    launcher of node 0 and of node 1 with Slurm's variables, the rendezvous at the launch node's
    address. The real trainer (gloo) on a tiny NPZ."""
    from test_platforms import (assert_trained_4_ranks, clean_env, free_port, launcher, rank_lines, run_all,
                                write_config, write_npz)

    data = write_npz(tmp_path / "tiny.npz")
    out = tmp_path / "output"
    config = write_config(tmp_path / "job.json", data={"uri": str(data)},
                          output={"output_dir": str(out), "checkpoint_dir": str(out / "checkpoints")})
    port = free_port()
    envs = [clean_env(SLURM_JOB_ID="77", SLURM_NODEID=str(node), SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]",
                      SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=str(port), SLURM_GPUS_ON_NODE="0")
            for node in (0, 1)]
    (c0, out0, err0), (c1, out1, err1) = run_all([(launcher(config, "--nproc-per-node", "2"), envs[0]),
                                                  (launcher(config, "--nproc-per-node", "2"), envs[1])])
    assert c0 == 0 and c1 == 0, (err0[-3000:], err1[-3000:])
    assert ("[launch] platform: slurm (SLURM_JOB_ID and SLURM_NODEID are set), node_rank 0 of 2 node(s) × 2 "
            f"process(es) per node = world size 4, master 127.0.0.1:{port}") in out0
    assert rank_lines(out0) == {(0, 0, 0, 4), (1, 1, 0, 4)}
    assert rank_lines(out1) == {(2, 0, 1, 4), (3, 1, 1, 4)}
    cfg = assert_trained_4_ranks(out, out / "checkpoints")
    assert cfg["parallel"]["nodes"] == 2 and cfg["parallel"]["procs_per_node"] == 2
