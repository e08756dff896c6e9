"""The Slurm backend without a cluster: its settings, the sbatch option allowlist, the batch script
(every ``#SBATCH`` line), the time limit, the environment file, the queue and the internal rate."""

from __future__ import annotations

import shlex
import subprocess
from decimal import Decimal

import pytest

from cloud_adapters.base import InvalidSpec, JobSpec
from cloud_adapters.pricing import PriceRow, StaticPriceCatalog
from cloud_adapters.registry import backend_class, create_backend, kind_choices
from cloud_adapters.slurm import script as batch
from cloud_adapters.slurm.backend import SlurmBackend

BASE = {"partition": "gpu", "work_dir": "/shared/trainboard"}


def test_registered_with_its_label_and_settings():
    assert backend_class("slurm") is SlurmBackend
    assert ("slurm", "Slurm cluster") in kind_choices()
    host = SlurmBackend.settings.host
    assert {"transport", "login_host", "ssh_port", "ssh_user", "ssh_host_key", "slurm_conf", "work_dir",
            "python", "allowed_images"} <= host
    assert not host & {"partition", "account", "qos", "gpus_per_node", "extra_sbatch_options", "cluster"}
    assert SlurmBackend.settings.secret_keys == {"ssh_private_key": True}


def test_defaults_fill_the_settings_not_given():
    config = create_backend("slurm", BASE).config
    assert config["transport"] == "local" and config["ssh_port"] == 22 and config["python"] == "python3"
    assert config["gpus_per_node"] == 0 and config["gpu_request"] == "gres" and config["extra_sbatch_options"] == ""


def test_every_settings_problem_is_reported_at_once():
    with pytest.raises(InvalidSpec) as err:
        create_backend("slurm", {"partition": "gpu; rm -rf /", "account": "a b", "work_dir": "relative/dir",
                                 "gpus_per_node": -1, "gpu_request": "both", "python": "py thon",
                                 "extra_sbatch_options": "--uid=0 --constraint=a100", "transport": "ssh",
                                 "bogus": 1})
    errors = err.value.errors
    assert set(errors) == {"partition", "account", "work_dir", "gpus_per_node", "gpu_request", "python",
                           "extra_sbatch_options", "login_host", "ssh_user", "ssh_host_key", "bogus"}
    assert errors["partition"] == ["Partition: 'gpu; rm -rf /' is not a Slurm name (letters, digits, _ . + -)."]
    assert errors["extra_sbatch_options"] == [
        "Extra sbatch options: --uid is not allowed (would run the job as another user)."]
    assert errors["login_host"] == ["Login host: required for the ssh transport (the operator sets "
                                    "TRAINBOARD_SLURM_LOGIN_HOST)."]
    with pytest.raises(InvalidSpec) as err:
        create_backend("slurm", {"partition": "gpu"})
    assert err.value.errors["work_dir"][0].startswith("Working directory: required;")


@pytest.mark.parametrize("option, message", [
    ("--uid=0", "--uid is not allowed (would run the job as another user)."),
    ("--gid=0", "--gid is not allowed (would run the job as another group)."),
    ("--chdir=/root", "--chdir is not allowed (would move the job out of its run directory)."),
    ("-D/root", "-D is not allowed (would move the job out of its run directory)."),
    ("--export=ALL", "--export is not allowed (would pass the worker's environment to the job)."),
    ("--wrap=id", "--wrap is not allowed (would replace the batch script with a command)."),
    ("--output=/etc/passwd", "--output is not allowed (Trainboard reads the job's output file)."),
    ("--constraint=a100\n#SBATCH --uid=0", "'--constraint=a100\\n#SBATCH --uid=0': an option may not hold a line break."),
    ("--constraint=$(id)", "--constraint: the value '$(id)' may hold only letters, digits and _ . , : = @ / + % [ ] - "
                           "(1–200 characters, no spaces or quotes)."),
    ("--exclusive=user", None),
    ("--exclusive", None),
    ("--requeue=1", "--requeue takes no value; write --requeue alone."),
    ("--constraint", "--constraint needs a value; write --constraint=VALUE."),
    ("--frobnicate=1", "'--frobnicate=1' is not an sbatch option Trainboard allows"),
])
def test_sbatch_option_allowlist(option, message):
    problems = batch.sbatch_option_problems([option])
    if message is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(message)


def test_extra_options_from_a_list_or_text():
    config = create_backend("slurm", {**BASE, "extra_sbatch_options": ["--constraint=a100", "--exclusive"]}).config
    assert config["extra_sbatch_options"] == "--constraint=a100 --exclusive"
    with pytest.raises(InvalidSpec, match="expected options separated by spaces"):
        create_backend("slurm", {**BASE, "extra_sbatch_options": {"--uid": 0}})


@pytest.mark.parametrize("seconds, limit", [(1, "0-00:01:00"), (60, "0-00:01:00"), (61, "0-00:02:00"),
                                            (3600, "0-01:00:00"), (90000, "1-01:00:00")])
def test_time_limit_rounds_up_to_minutes(seconds, limit):
    assert batch.time_limit(seconds) == limit


def test_batch_script_lines():
    text = batch.batch_script(
        job_name="tb-job-7-abc", run_dir="/shared/tb/tb-job-7-abc", archive="/shared/tb/.archives/t.tar.gz",
        nodes=2, procs_per_node=4, max_runtime_s=5400, python="/opt/torch/bin/python", partition="gpu",
        account="ml", qos="high", gpus_per_node=4, gpu_request="gres", cpus_per_task=16, mem_per_node_gb=64,
        comment="trainboard-job-id=7", extra_options=["--constraint=a100", "--exclusive"])
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=tb-job-7-abc",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=16",
        "#SBATCH --time=0-01:30:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=ml",
        "#SBATCH --qos=high",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --mem=64G",
        "#SBATCH --output=/shared/tb/tb-job-7-abc/slurm.log",
        "#SBATCH --error=/shared/tb/tb-job-7-abc/slurm.log",
        "#SBATCH --open-mode=append",
        "#SBATCH --export=NONE",
        "#SBATCH --comment=trainboard-job-id=7",
        "#SBATCH --constraint=a100",
        "#SBATCH --exclusive",
    ]
    assert text.startswith("#!/bin/bash\n")
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert shlex.split(srun[0]) == [
        "srun", "--export=ALL", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "/opt/torch/bin/python", "-m",
        "trainer_pkg.launch", "--config", "/shared/tb/tb-job-7-abc/job.json", "--platform", "slurm",
        "--nproc-per-node", "4"]
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # bash parses it


def test_batch_script_defaults_gpus_per_node_and_container():
    text = batch.batch_script(job_name="j", run_dir="/w/j", archive="/w/a.tar.gz", nodes=1, procs_per_node=2,
                              max_runtime_s=60, python="python3", gpus_per_node=2, gpu_request="gpus-per-node",
                              container_image="nvcr.io/nvidia/pytorch:24.05-py3", container_mounts=["/w/j:/w/j"])
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --gpus-per-node=2" in sbatch and "#SBATCH --cpus-per-task=2" in sbatch
    assert not [line for line in sbatch if line.startswith(("#SBATCH --partition", "#SBATCH --account",
                                                            "#SBATCH --qos", "#SBATCH --mem", "#SBATCH --comment"))]
    srun = shlex.split([line for line in text.splitlines() if line.startswith("srun ")][0])
    assert srun[4:7] == ["--container-image=nvcr.io/nvidia/pytorch:24.05-py3", "--container-mounts=/w/j:/w/j",
                         "--container-workdir=/w/j"]


def test_env_file_quotes_every_value(tmp_path):
    values = {"PLAIN": "x", "QUOTES": "it's \"here\"", "SUBST": "$(touch " + str(tmp_path / "pwned") + ")",
              "NEWLINE": "a\nb", "SPACES": " a  b "}
    path = tmp_path / "job.env"
    path.write_bytes(batch.env_file(values))
    out = subprocess.run(["bash", "-c", f'. {shlex.quote(str(path))}; for n in {" ".join(values)}; do '
                          'printf "%s=%s\\0" "$n" "${!n}"; done'], capture_output=True, check=True)
    seen = dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if item)
    assert seen == values
    assert not (tmp_path / "pwned").exists()


def test_queue_follows_the_transport():
    assert SlurmBackend.queue_for("hpc", {}) == "slurm.hpc"
    assert SlurmBackend.queue_for("hpc", {"transport": "local"}) == "slurm.hpc"
    assert SlurmBackend.queue_for("hpc", {"transport": "ssh"}) == "celery"


def test_price_is_the_internal_rate_of_cluster_and_partition():
    rows = [PriceRow("slurm", "hpc1", "gpu", Decimal("1.5"), source="internal rate", usd_per_gpu_hour=Decimal("2"))]
    prices = StaticPriceCatalog(rows)
    backend = create_backend("slurm", {**BASE, "cluster": "hpc1", "gpus_per_node": 4}, prices=prices)
    assert backend.price() == pytest.approx(1.5 + 4 * 2)
    assert backend.rate_known()
    other = create_backend("slurm", {**BASE, "cluster": "hpc1", "partition": "cpu"}, prices=prices)
    assert other.price() == 0.0 and not other.rate_known()
    assert other.price_note() == ("no internal rate is set for partition cpu on cluster hpc1, so jobs here cost $0; "
                                  "an admin sets it in the price catalog (provider slurm, region hpc1, instance type cpu)")
    unnamed = create_backend("slurm", {**BASE, "partition": "gpu"}, prices=prices)
    assert unnamed.price() == 0.0
    assert unnamed.price_note() == (
        "no internal rate can apply: this backend has no Cluster name, so jobs here cost $0; set the backend's "
        "Cluster name, and an admin sets the rate in the price catalog (provider slurm, region = that cluster name, "
        "instance type gpu)")


def test_validate_refuses_what_the_batch_script_must_not_get():
    backend = create_backend("slurm", {**BASE, "allowed_images": "ghcr.io/acme/*"})
    ok = JobSpec(job_name="tb-job-1-a", config={}, nodes=2, procs_per_node=2)
    backend.validate(ok)
    cases = [
        (dict(job_name="../etc"), "job name '../etc'"),
        (dict(env={"SLURM_JOB_ID": "1"}), "env: SLURM_JOB_ID is Slurm's; remove it."),
        (dict(env={"PYTHONPATH": "/x"}), "env: PYTHONPATH is set by Trainboard"),
        (dict(secret_env={"bad name": "x"}), "secret_env: 'bad name' is not an environment variable name"),
        (dict(instance_type="gpu;id"), "instance type 'gpu;id': on Slurm it is a partition name"),
        (dict(image="docker.io/evil/miner:1"), "image: this Slurm backend runs only the images its operator allows"),
        (dict(nodes=17), "17 nodes requested, but this backend runs at most 16 nodes per job."),
        (dict(dataset_uri="s3://bucket/data.npz"), "dataset 's3://bucket/data.npz': a Slurm job reads datasets"),
    ]
    for change, message in cases:
        fields = {"job_name": ok.job_name, "config": {}, "nodes": 2, "procs_per_node": 2, **change}
        with pytest.raises(InvalidSpec) as err:
            backend.validate(JobSpec(**fields))
        assert message in str(err.value), (change, str(err.value))
    backend.validate(JobSpec(job_name="tb-job-1-a", config={}, image="ghcr.io/acme/train:2"))
