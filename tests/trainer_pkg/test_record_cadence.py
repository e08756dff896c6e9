"""Time-based ``step`` records (train.log_every_steps 0, the default) and GPU placement checks."""

from trainer_pkg.train import RECORD_FIRST_STEPS, RECORD_MAX_STEPS, gpu_placement_error, record_interval

from tests.trainer_pkg.trainer_helpers import records, torchrun, write_job


def test_record_interval_is_about_log_every_s_of_the_slowest_step():
    assert record_interval(0.0, 1.0) == RECORD_FIRST_STEPS == 10  # no step time agreed yet
    assert record_interval(0.005, 1.0) == 200  # 5 ms steps: one record a second
    assert record_interval(0.25, 1.0) == 4
    assert record_interval(3.0, 1.0) == 1  # steps slower than the interval: every step
    assert record_interval(1e-6, 1.0) == RECORD_MAX_STEPS == 1000
    assert record_interval(0.005, 5.0) == 1000


def test_default_cadence_follows_log_every_s_on_every_rank(tmp_path):
    # 1,437 training samples / (2 ranks x 32) = 23 steps. A tiny log_every_s asks for a record every
    # step once step 1's time has been agreed (the agreement started before step 2 is read before
    # step 3); both ranks must agree, or the records' all-gather would hang.
    job = write_job(tmp_path, train={"epochs": 1, "batch_size": 32, "log_every_s": 1e-6})
    run = torchrun(job, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = records(tmp_path / "out")
    assert [r["step"] for r in recs if r["event"] == "step"] == list(range(3, 24))
    assert [r["event"] for r in recs if r["event"] != "step"] == ["started", "epoch", "completed"]


def test_default_cadence_writes_no_step_record_in_a_run_shorter_than_log_every_s(tmp_path):
    job = write_job(tmp_path / "slow", train={"epochs": 1, "batch_size": 32, "log_every_s": 86_400})
    run = torchrun(job, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = records(tmp_path / "slow" / "out")
    assert [r["event"] for r in recs] == ["started", "epoch", "completed"]
    assert recs[1]["step"] == 23 and recs[1]["train_loss"] > 0  # the epoch record carries the whole window


def test_log_every_s_must_be_positive():
    from trainer_pkg.config import JobConfig

    errs = JobConfig.from_dict({"train": {"log_every_s": 0, "log_every_steps": -1}}).field_errors()
    assert errs["train.log_every_s"] == "must be greater than 0 seconds, got 0.0"
    assert errs["train.log_every_steps"] == "must be 0 (by time, every train.log_every_s) or more, got -1"


def test_two_nccl_ranks_on_one_gpu_are_refused_before_they_start():
    assert gpu_placement_error("nccl", "ddp", 2, 1) == (
        "2 processes per node but this node has 1 CUDA GPU(s): NCCL needs one GPU per process. Start 1 "
        "process(es) per node (parallel.procs_per_node), or use parallel.dist_backend gloo to share GPUs "
        "(ddp and fsdp only)")
    assert gpu_placement_error("nccl", "fsdp", 8, 8) is None
    assert gpu_placement_error("gloo", "ddp", 2, 1) is None  # seen working on an H200
    assert "gloo cannot do for CUDA tensors" in gpu_placement_error("gloo", "pipeline", 2, 2)
    assert gpu_placement_error("gloo", "pipeline", 2, 0) is None  # CPU: gloo pipelines work
