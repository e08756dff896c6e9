"""A provider that throttles 30% of calls and times out on 10% more (seeded), through the service
layer: submit retries, ``sync_backend`` passes (describe, logs, cancel) while the provider's jobs live
their lives. Job states stay correct at every pass (only the state held before or the provider's
current one, never a wrong terminal state), logs are stored without gap or duplicate, and once the
provider recovers one pass converges everything: states, logs, cost. (The SageMaker adapter's own
version of this, against botocore, is tests/cloud_adapters/sagemaker/test_sagemaker_status.py.)"""

from __future__ import annotations

from decimal import Decimal

import pytest

import fault_backend as fb
from cloud_adapters.base import BackendError
from jobs import dispatch, lifecycle, services, tasks
from jobs.models import JobLogLine, JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db

# Provider-side life of each job, one entry per sync round; "cancel" = the user cancels then.
SCRIPT = {
    "ok": ["RUNNING"] * 4 + ["SUCCEEDED"],
    "fails": ["RUNNING"] * 3 + ["FAILED"],
    "cancelled": ["RUNNING", "RUNNING", "cancel"],
}
ROUNDS = 14


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _submit_through_throttling(job: TrainingJob) -> int:
    """Call the submit service as the task's retries would until it gets through; returns attempts."""
    for attempt in range(1, 30):
        try:
            lifecycle.training_job_submit(job=job, retrying=attempt > 1)
            return attempt
        except BackendError as exc:
            assert exc.transient, exc
            assert _reload(job).state == S.SUBMITTING  # never FAILED for a transient error
            assert "Submission retrying" in _reload(job).status_warning
    raise AssertionError("the submit never got through")


@pytest.mark.parametrize("seed", [1, 7, 2024])
def test_throttled_and_timing_out_provider_keeps_states_correct_and_converges(seed, provider, fault_backend, user,
                                                                             digits_dataset, cnn_model):
    fb._RNGS.clear()
    fb.CALLS.clear()
    with sent_tasks(dispatch.SUBMIT_JOB):
        jobs = {name: services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                                   backend=fault_backend, name=name) for name in SCRIPT}
    provider.control(throttle_share=0.3, timeout_share=0.1, seed=seed)
    for job in jobs.values():
        _submit_through_throttling(job)
    records = {name: provider.jobs(_reload(job).provider_job_name) for name, job in jobs.items()}
    assert all(len(r) == 1 for r in records.values())  # one provider job each, whatever the retries
    ids = {name: r[0]["id"] for name, r in records.items()}
    for name in SCRIPT:
        provider.set_state(ids[name], "RUNNING", billable_seconds=600.0)

    failed_syncs = 0
    with sent_tasks(dispatch.CANCEL_JOB):
        for rnd in range(ROUNDS):
            for name, life in SCRIPT.items():
                step = life[min(rnd, len(life) - 1)]
                if step == "cancel":
                    job = _reload(jobs[name])
                    if job.state in (S.PENDING, S.RUNNING):
                        services.training_job_cancel(job=job, reason="enough")
                elif provider.get(ids[name])["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    provider.set_state(ids[name], step)
                    provider.write_log(ids[name], [f"{name} round {rnd} line {i}" for i in range(7)])
            before = {name: _reload(job).state for name, job in jobs.items()}
            if tasks.sync_backend(fault_backend.pk) == 0:
                failed_syncs += 1
            for name, job in jobs.items():
                job = _reload(job)
                at_provider = provider.get(ids[name])["state"]
                assert job.state in (before[name], at_provider, S.RUNNING, S.STOPPING), (rnd, name, job.state)
                if job.is_terminal:
                    assert job.state == at_provider, (rnd, name)
                stored = list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", "text"))
                assert [seq for seq, _ in stored] == list(range(len(stored)))
                assert [text for _, text in stored] == provider.log_lines(ids[name])[:len(stored)]
    assert fb.CALLS.get("describe_many", 0) >= ROUNDS - failed_syncs
    assert failed_syncs >= 1  # the faults were real: some passes were lost entirely

    provider.control(throttle_share=0, timeout_share=0)  # the provider recovers
    with sent_tasks(dispatch.CANCEL_JOB):
        assert tasks.sync_backend(fault_backend.pk) >= 0
        tasks.sync_backend(fault_backend.pk)  # a STOPPING job's cancel is confirmed by the pass after
    expected = {"ok": S.SUCCEEDED, "fails": S.FAILED, "cancelled": S.CANCELLED}
    for name, job in jobs.items():
        job = _reload(job)
        assert job.state == expected[name], (name, job.state, job.status_warning)
        assert provider.count(job.provider_job_name) == 1
        assert list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("text", flat=True)) == \
            provider.log_lines(ids[name])
        assert job.billable_seconds == 600.0 and job.cost_usd == Decimal("0.6000")  # 600 s × $3.60/h
    assert provider.cancel_effects() == [ids["cancelled"]]
