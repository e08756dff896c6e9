"""SageMaker API calls per sync: ``describe_many(changed_since=...)`` against describing every job.

    .venv/bin/python bench/sync_calls.py                    # 10, 100, 1,000, 10,000 active jobs
    .venv/bin/python bench/sync_calls.py --active 50 5000 --changed 25

For each number of active jobs the script runs one sync three ways against a counting stand-in for
the SageMaker client (it answers ListTrainingJobs in pages of ``MaxResults`` and DescribeTrainingJob
for any name, and counts each call; no network, no boto3):

  baseline     describe_many(handles)                       one DescribeTrainingJob per active job
  10 changed   describe_many(handles, changed_since=t)      ListTrainingJobs pages + 10 describes
  all changed  the same when every active job changed        worst case: pages + one describe each

and prints the calls of each and the ratio to the baseline. Calls are what AWS rate-limits and
bills nothing for, but they are what a 10,000-job sync waits for under the account's token bucket
(default 10 calls/s): the baseline's 10,000 calls take 1,000 s there, the changed-only sync 11 calls.

The counts are exact, not timings, so they are the same on any machine (bench/RESULTS.md, "SageMaker
sync cost", has the table): with 10 changed, calls per sync stay at 11 whatever the number of active
jobs; when everything changed the listing adds ⌈N/100⌉ calls (1 %).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cloud_adapters.base import JobHandle  # noqa: E402
from cloud_adapters.sagemaker import SageMakerBackend  # noqa: E402

T0 = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)


class CountingSageMaker:
    """The two SageMaker operations a sync uses, answering from memory and counting calls."""

    def __init__(self, names: list[str], changed: set[str]) -> None:
        self.names = names
        self.changed = [n for n in names if n in changed]
        self.calls: Counter[str] = Counter()

    def list_training_jobs(self, *, LastModifiedTimeAfter: dt.datetime, MaxResults: int,
                           NextToken: str = "") -> dict[str, Any]:
        self.calls["ListTrainingJobs"] += 1
        start = int(NextToken or 0)
        page = self.changed[start:start + MaxResults]
        out: dict[str, Any] = {"TrainingJobSummaries": [
            {"TrainingJobName": n, "TrainingJobStatus": "InProgress", "LastModifiedTime": T0} for n in page]}
        if start + MaxResults < len(self.changed):
            out["NextToken"] = str(start + MaxResults)
        return out

    def describe_training_job(self, *, TrainingJobName: str) -> dict[str, Any]:
        self.calls["DescribeTrainingJob"] += 1
        return {"TrainingJobName": TrainingJobName, "TrainingJobStatus": "InProgress", "SecondaryStatus": "Training",
                "ResourceConfig": {"InstanceType": "ml.g5.xlarge", "InstanceCount": 1}}


def one_sync(active: int, changed: int | None) -> Counter[str]:
    """Calls of one describe_many over ``active`` jobs; ``changed`` None = the baseline (no changed_since)."""
    backend = SageMakerBackend({"region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerRole",
                                "bucket": "bench-bucket", "max_calls_per_second": 1e9})
    names = [f"tb-job-{i}-bench" for i in range(active)]
    step = max(1, active // changed) if changed else 1
    fake = CountingSageMaker(names, set(names[::step][:changed]) if changed else set())
    backend._clients["sagemaker"] = fake  # the stand-in replaces the boto3 client
    handles = [JobHandle("sagemaker", n, extra={"training_job_name": n}) for n in names]
    statuses = backend.describe_many(handles, changed_since=None if changed is None else T0)
    expected = active if changed is None else changed
    assert len(statuses) == expected, (len(statuses), expected)
    return fake.calls


def main() -> int:
    p = argparse.ArgumentParser(description="SageMaker API calls per sync, changed-only vs describe-all")
    p.add_argument("--active", type=int, nargs="+", default=[10, 100, 1000, 10000])
    p.add_argument("--changed", type=int, default=10, help="jobs that changed since the last sync (default 10)")
    args = p.parse_args()
    print(f"{'active':>7} {'changed':>8} {'baseline':>9} {'list':>5} {'describe':>9} {'calls':>6} {'ratio':>6}")
    for active in args.active:
        baseline = sum(one_sync(active, None).values())
        for changed in sorted({min(args.changed, active), active}):
            calls = one_sync(active, changed)
            total = sum(calls.values())
            print(f"{active:>7} {changed:>8} {baseline:>9} {calls['ListTrainingJobs']:>5} "
                  f"{calls['DescribeTrainingJob']:>9} {total:>6} {total / baseline:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
