"""Issue 27 item 9, the trainer's side: where the dashboard could not refuse a batch larger than a
rank's shard (the data's size unknown at create), the job's log says what batch was really used."""

from __future__ import annotations

from trainer_pkg.sampling import ShardOrder
from trainer_helpers import launch, records, write_job


def test_the_note_names_the_batch_really_used_and_only_when_the_batch_is_too_large():
    order = ShardOrder(1438, dp_rank=0, dp_size=2, batch_size=100_000, seed=0, drop_last_batch=False)
    assert order.small_batch_note() == (
        "train.batch_size 100,000 is larger than the 719 samples each rank reads per epoch (1,438 training samples "
        "over 2 data-parallel ranks): each epoch is one batch of 719 samples per rank; a batch size of at most 719 "
        "trains on full batches")
    assert ShardOrder(1438, dp_rank=0, dp_size=2, batch_size=719, seed=0, drop_last_batch=False).small_batch_note() \
        is None
    # A pipeline (drop_last) with no full batch is refused instead (too_small), not noted.
    assert ShardOrder(11, dp_rank=0, dp_size=4, batch_size=4, seed=0, drop_last_batch=True).small_batch_note() is None


def test_a_run_with_a_batch_past_the_data_logs_it(tmp_path):
    job = write_job(tmp_path, model={"arch": "mlp", "params": {"hidden_size": 8}},
                    train={"epochs": 1, "batch_size": 5000})
    run = launch(job)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("[trainer] warning: train.batch_size 5,000 is larger than the 1,438 samples each rank reads per epoch "
            "(1,438 training samples over 1 data-parallel rank): each epoch is one batch of 1,438 samples per rank"
            in run.stdout), run.stdout[-3000:]
    assert [r["event"] for r in records(tmp_path / "out")].count("epoch") == 1
