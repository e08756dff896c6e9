"""Status, sync cost, throttling and cancel, with botocore's Stubber scripting what moto cannot do
(moto always reports Completed, has no billable time and no StopTrainingJob; clouds.md §1.7)."""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal

import pytest
from botocore.stub import Stubber

from cloud_adapters.base import JobHandle, JobState, ProviderError, Throttled
from cloud_adapters.sagemaker.states import job_status
from jobs.cost import job_cost_usd
from sagemaker_standin import T0, count_calls, describe_response, make_backend, throttle

NAME = "tb-job-7-67a1b2c3"


def handle(name: str = NAME, count: int = 2) -> JobHandle:
    return JobHandle(provider="sagemaker", job_name=name,
                     provider_job_id=f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}",
                     extra={"training_job_name": name, "region": "us-east-1", "instance_count": count})


def transitions(*names: str) -> list[dict]:
    return [{"Status": n, "StartTime": T0 + dt.timedelta(minutes=i)} for i, n in enumerate(names)]


def life() -> list[dict]:
    """Starting → Downloading → Training → Completed, 2 × ml.g5.xlarge, billable 1,200 s."""
    start = T0 + dt.timedelta(minutes=3)
    end = start + dt.timedelta(seconds=1200)
    return [
        describe_response(NAME, "InProgress", "Starting", SecondaryStatusTransitions=transitions("Starting")),
        describe_response(NAME, "InProgress", "Downloading",
                          SecondaryStatusTransitions=transitions("Starting", "Downloading")),
        describe_response(NAME, "InProgress", "Training", TrainingStartTime=start,
                          SecondaryStatusTransitions=transitions("Starting", "Downloading", "Training")),
        describe_response(NAME, "Completed", "Completed", TrainingStartTime=start, TrainingEndTime=end,
                          TrainingTimeInSeconds=1200, BillableTimeInSeconds=1200,
                          SecondaryStatusTransitions=transitions("Starting", "Downloading", "Training",
                                                                 "Uploading", "Completed")),
    ]


def test_scripted_life_ends_succeeded_with_the_catalog_cost():
    backend = make_backend()
    sm = backend.client("sagemaker")
    stub = Stubber(sm)
    for response in life():
        stub.add_response("describe_training_job", response, {"TrainingJobName": NAME})
    with stub:
        statuses = [backend.describe(handle()) for _ in range(4)]
    stub.assert_no_pending_responses()
    assert [s.state for s in statuses] == [JobState.PENDING, JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED]
    assert [s.secondary_state for s in statuses] == ["Starting", "Downloading", "Training", "Completed"]
    assert all(not s.warning for s in statuses)
    done = statuses[-1]
    assert done.billable_seconds == 1200.0 and done.training_seconds == 1200.0 and done.instance_count == 2
    assert done.started_at == T0 + dt.timedelta(minutes=3)
    assert done.ended_at == T0 + dt.timedelta(minutes=3, seconds=1200)
    assert statuses[2].ended_at is None and statuses[0].started_at is None
    price = backend.price("ml.g5.xlarge")
    assert price == 1.4084
    cost = job_cost_usd(billable_seconds=done.billable_seconds, instances=done.instance_count, hourly_price_usd=price)
    assert cost == Decimal("0.9389")  # 1200 × 2 × 1.4084 / 3600 = 0.938933…
    assert math.isclose(float(cost), 1200 * 2 * 1.4084 / 3600, abs_tol=5e-5)


def test_stopped_after_max_runtime_is_failed_with_that_reason():
    status = job_status(describe_response(
        NAME, "Stopped", "MaxRuntimeExceeded", TrainingStartTime=T0, TrainingEndTime=T0 + dt.timedelta(hours=1),
        TrainingTimeInSeconds=3600, BillableTimeInSeconds=3600,
        SecondaryStatusTransitions=[{"Status": "MaxRuntimeExceeded", "StartTime": T0,
                                     "StatusMessage": "Training job runtime exceeded MaxRuntimeInSeconds provided"}]))
    assert status.state is JobState.FAILED
    assert status.failure_reason == (
        "MaxRuntimeExceeded: SageMaker stopped the job when it reached its max runtime (3600 s, counted from the "
        "job's start: launching instances and downloading the image and data count); raise max runtime or resume "
        "from the job's checkpoints (Training job runtime exceeded MaxRuntimeInSeconds provided)")
    assert status.ended_at == T0 + dt.timedelta(hours=1) and status.billable_seconds == 3600.0


def test_stopped_after_max_runtime_through_the_api():
    backend = make_backend()
    stub = Stubber(backend.client("sagemaker"))
    stub.add_response("describe_training_job", describe_response(NAME, "Stopped", "MaxRuntimeExceeded"),
                      {"TrainingJobName": NAME})
    with stub:
        status = backend.describe(handle())
    assert status.state is JobState.FAILED and status.failure_reason.startswith("MaxRuntimeExceeded: ")


@pytest.mark.parametrize("raw, secondary, state", [
    ("InProgress", "Starting", JobState.PENDING),
    ("InProgress", "Pending", JobState.PENDING),
    ("InProgress", "LaunchingMLInstances", JobState.PENDING),
    ("InProgress", "PreparingTrainingStack", JobState.PENDING),
    ("InProgress", "Downloading", JobState.PENDING),
    ("InProgress", "DownloadingTrainingImage", JobState.PENDING),
    ("InProgress", "Interrupted", JobState.PENDING),
    ("InProgress", "Restarting", JobState.PENDING),
    ("InProgress", "Training", JobState.RUNNING),
    ("InProgress", "Uploading", JobState.RUNNING),
    ("Stopping", "Stopping", JobState.STOPPING),
    ("Completed", "Completed", JobState.SUCCEEDED),
    ("Failed", "Failed", JobState.FAILED),
    ("Stopped", "Stopped", JobState.CANCELLED),
    ("Stopped", "MaxRuntimeExceeded", JobState.FAILED),
    ("Stopped", "MaxWaitTimeExceeded", JobState.FAILED),
    ("Deleting", "Stopped", JobState.CANCELLED),
])
def test_every_documented_status_maps_to_one_state(raw, secondary, state):
    status = job_status(describe_response(NAME, raw, secondary, FailureReason="AlgorithmError: exit 1"
                                          if raw == "Failed" else ""))
    assert status.state is state and status.raw_state == raw and status.secondary_state == secondary
    assert status.warning == ""
    if raw == "Failed":
        assert status.failure_reason == "AlgorithmError: exit 1"
    if secondary == "MaxWaitTimeExceeded":
        assert status.failure_reason.startswith("MaxWaitTimeExceeded: the spot job did not finish")


def test_updating_takes_the_state_of_the_status_it_updates():
    """UpdateTrainingJob (profiler, warm pool) while the job trains: it goes on training; before it
    trained, still PENDING; with no history to tell, PENDING with a warning (no interruption)."""
    def updating(*history):
        return job_status(describe_response(NAME, "InProgress", "Updating", SecondaryStatusTransitions=[
            {"Status": s, "StartTime": T0} for s in history]))
    assert (updating("Starting", "Downloading", "Training", "Updating").state, updating("Training", "Updating").warning) \
        == (JobState.RUNNING, "")
    assert updating("Training", "Uploading", "Updating").state is JobState.RUNNING
    assert updating("Starting", "Updating").state is JobState.PENDING
    assert updating("Training", "Interrupted", "Updating").state is JobState.PENDING
    bare = updating()
    assert bare.state is JobState.PENDING and "updating the job (UpdateTrainingJob)" in bare.warning


def test_unknown_values_stay_non_terminal_with_a_warning():
    odd = job_status(describe_response(NAME, "Hibernating", "Dreaming"))
    assert odd.state is JobState.PENDING and "unknown training job status 'Hibernating'" in odd.warning
    odd = job_status(describe_response(NAME, "InProgress", "Defragmenting"))
    assert odd.state is JobState.PENDING and "unknown secondary status 'Defragmenting'" in odd.warning


def test_spot_saving_fields():
    status = job_status(describe_response(NAME, "Completed", "Completed", EnableManagedSpotTraining=True,
                                          TrainingTimeInSeconds=1000, BillableTimeInSeconds=300))
    assert status.spot is True and status.billable_seconds == 300.0 and status.training_seconds == 1000.0
    assert 1 - status.billable_seconds / status.training_seconds == pytest.approx(0.7)


# -- describe_many ------------------------------------------------------------------------------


def _summary(name: str) -> dict:
    return {"TrainingJobName": name, "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}",
            "CreationTime": T0, "LastModifiedTime": T0, "TrainingJobStatus": "InProgress"}


def test_sync_of_1000_active_jobs_with_10_changed():
    backend = make_backend()
    sm = backend.client("sagemaker")
    calls = count_calls(sm)
    handles = [handle(f"tb-job-{i}-aa") for i in range(1000)]
    changed = [f"tb-job-{i}-aa" for i in range(0, 1000, 100)]
    # The account also holds 150 other recently modified jobs (not Trainboard's): 2 pages of 100.
    listed = changed + [f"someone-else-{i}" for i in range(150)]
    since = T0 + dt.timedelta(minutes=10)
    stub = Stubber(sm)
    stub.add_response("list_training_jobs",
                      {"TrainingJobSummaries": [_summary(n) for n in listed[:100]], "NextToken": "page-2"},
                      {"LastModifiedTimeAfter": since - dt.timedelta(seconds=120), "MaxResults": 100})
    stub.add_response("list_training_jobs", {"TrainingJobSummaries": [_summary(n) for n in listed[100:]]},
                      {"LastModifiedTimeAfter": since - dt.timedelta(seconds=120), "MaxResults": 100,
                       "NextToken": "page-2"})
    for name in changed:
        stub.add_response("describe_training_job", describe_response(name, "InProgress", "Training"),
                          {"TrainingJobName": name})
    with stub:
        statuses = backend.describe_many(handles, changed_since=since)
    stub.assert_no_pending_responses()
    assert sorted(statuses) == sorted(changed)
    assert all(s.state is JobState.RUNNING for s in statuses.values())
    assert calls.count("ListTrainingJobs") == 2 <= math.ceil(1000 / 100)
    assert calls.count("DescribeTrainingJob") == 10
    assert len(calls.calls) == 12


def test_describe_many_without_changed_since_describes_each():
    backend = make_backend()
    stub = Stubber(backend.client("sagemaker"))
    names = ["tb-a", "tb-b", "tb-gone"]
    stub.add_response("describe_training_job", describe_response("tb-a", "InProgress", "Training"), {"TrainingJobName": "tb-a"})
    stub.add_response("describe_training_job", describe_response("tb-b", "Completed", "Completed"), {"TrainingJobName": "tb-b"})
    stub.add_client_error("describe_training_job", "ValidationException", "Requested resource not found.",
                          expected_params={"TrainingJobName": "tb-gone"})
    with stub:
        statuses = backend.describe_many([handle(n) for n in names])
    assert {k: v.state for k, v in statuses.items()} == {"tb-a": JobState.RUNNING, "tb-b": JobState.SUCCEEDED}


def test_describe_many_needs_an_aware_time():
    with pytest.raises(ValueError):
        make_backend().describe_many([handle()], changed_since=dt.datetime(2026, 1, 1))


# -- throttling ---------------------------------------------------------------------------------


def test_30_percent_throttled_calls_leave_states_correct_and_the_job_converges(clock):
    """Three jobs, each a step apart in its life, synced until all end; a seeded 30% of calls answer
    ThrottlingException. Each sync returns the right state for every job or raises Throttled (the
    dashboard then keeps every state and syncs again); the jobs converge to SUCCEEDED."""
    backend = make_backend(clock, seed=11)
    sm = backend.client("sagemaker")
    phases = [("InProgress", "Starting"), ("InProgress", "Downloading"), ("InProgress", "Training"),
              ("Completed", "Completed")]
    expected = [JobState.PENDING, JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED]
    names = ["tb-one", "tb-two", "tb-three"]
    offset = {n: i for i, n in enumerate(names)}  # tb-two is one phase behind tb-one, ...
    sync_no = 0
    current: dict = {}  # this sync attempt's Stubber and the job whose answer it holds

    def feed(model, params, **kwargs):
        # Queue the answer for the job this attempt asks about (once: a throttled attempt never
        # reaches the Stubber, so its retry uses the same answer); the Stubber checks and returns it.
        name = params["TrainingJobName"]
        if current.get("queued") == name:
            return
        phase = min(max(sync_no - offset[name], 0), len(phases) - 1)
        extra = {"BillableTimeInSeconds": 1200, "TrainingTimeInSeconds": 1200} if phase == 3 else {}
        current["stub"].add_response("describe_training_job", describe_response(name, *phases[phase], **extra),
                                     {"TrainingJobName": name})
        current["queued"] = name

    sm.meta.events.register_first("provide-client-params.sagemaker.DescribeTrainingJob", feed)
    throttler = throttle(sm, share=0.3, seed=1234)
    seen: dict[str, list[JobState]] = {n: [] for n in names}
    throttled_syncs = 0
    while sync_no < 8 and not all(seen[n][-1:] == [JobState.SUCCEEDED] for n in names):
        current.clear()
        current["stub"] = Stubber(sm)  # a fresh script per sync attempt
        with current["stub"]:
            try:
                statuses = backend.describe_many([handle(n) for n in names])
            except Throttled:
                throttled_syncs += 1  # nothing reported: every job keeps its state
                continue
        for n in names:
            phase = min(max(sync_no - offset[n], 0), len(phases) - 1)
            assert statuses[n].state is expected[phase], (n, sync_no, statuses[n])
            if not seen[n] or seen[n][-1] is not statuses[n].state:
                seen[n].append(statuses[n].state)
        sync_no += 1
    assert throttler.injected >= 10
    assert sync_no == 6  # tb-three (two phases behind) reached Completed on the 6th successful sync
    assert all(seen[n] == [JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED] for n in names), seen
    assert len(clock.sleeps) == throttler.injected - throttled_syncs  # a spent 5th attempt does not wait


def test_throttling_that_outlasts_the_retries_raises_and_reports_nothing(clock):
    backend = make_backend(clock)
    sm = backend.client("sagemaker")
    stub = Stubber(sm)
    for _ in range(5):
        stub.add_client_error("describe_training_job", "ThrottlingException", "Rate exceeded", http_status_code=400)
    with stub, pytest.raises(Throttled):
        backend.describe_many([handle()])
    stub.assert_no_pending_responses()


def test_connection_errors_are_transient(clock, monkeypatch):
    from botocore.exceptions import EndpointConnectionError

    backend = make_backend(clock)
    sm = backend.client("sagemaker")
    attempts = []

    def refuse(**kwargs):
        attempts.append(kwargs)
        raise EndpointConnectionError(endpoint_url="https://api.sagemaker.us-east-1.amazonaws.com")

    monkeypatch.setattr(sm, "describe_training_job", refuse)
    with pytest.raises(ProviderError) as err:
        backend.describe(handle())
    assert err.value.transient is True and len(attempts) == 5
    assert "could not reach the AWS endpoint" in str(err.value)


def test_one_rate_limit_per_account(clock):
    """Two backends on one account share one bucket: 30 calls at 10/s, burst 20, wait ~1 s in all."""
    a = make_backend(clock, max_calls_per_second=10.0)
    b = make_backend(clock, max_calls_per_second=10.0, bucket="another-bucket")
    for backend in (a, b):
        stub = Stubber(backend.client("sagemaker"))
        for _ in range(15):
            stub.add_response("describe_training_job", describe_response(NAME, "InProgress", "Training"))
        stub.activate()
    for _ in range(15):
        a.describe(handle())
        b.describe(handle())
    assert sum(clock.sleeps) == pytest.approx(1.0)  # (30 − 20 burst) / 10 per second
    other = make_backend(clock, role_arn="arn:aws:iam::210987654321:role/Other", max_calls_per_second=10.0)
    stub = Stubber(other.client("sagemaker"))
    stub.add_response("describe_training_job", describe_response(NAME, "InProgress", "Training"))
    with stub:
        before = len(clock.sleeps)
        other.describe(handle())
    assert len(clock.sleeps) == before  # another account: its own full bucket


# -- cancel -------------------------------------------------------------------------------------


def test_cancel_calls_stop_and_is_idempotent():
    backend = make_backend()
    stub = Stubber(backend.client("sagemaker"))
    stub.add_response("stop_training_job", {}, {"TrainingJobName": NAME})
    stub.add_response("describe_training_job", describe_response(NAME, "Stopping", "Stopping"), {"TrainingJobName": NAME})
    # second cancel: SageMaker refuses to stop a job that is already stopping
    stub.add_client_error("stop_training_job", "ValidationException",
                          f"The request was rejected because the training job is in status Stopping.",
                          expected_params={"TrainingJobName": NAME})
    stub.add_response("describe_training_job", describe_response(NAME, "Stopping", "Stopping"), {"TrainingJobName": NAME})
    stub.add_response("describe_training_job", describe_response(NAME, "Stopped", "Stopped"), {"TrainingJobName": NAME})
    # third cancel after it stopped
    stub.add_client_error("stop_training_job", "ValidationException", "The job is in status Stopped.",
                          expected_params={"TrainingJobName": NAME})
    stub.add_response("describe_training_job", describe_response(NAME, "Stopped", "Stopped"), {"TrainingJobName": NAME})
    with stub:
        assert backend.cancel(handle()) is None
        assert backend.describe(handle()).state is JobState.STOPPING
        backend.cancel(handle())
        status = backend.describe(handle())
        backend.cancel(handle())
    stub.assert_no_pending_responses()
    assert status.state is JobState.CANCELLED and status.failure_reason == "stopped in SageMaker (StopTrainingJob)"


def test_cancel_of_a_running_job_that_sagemaker_refuses_raises():
    backend = make_backend()
    stub = Stubber(backend.client("sagemaker"))
    stub.add_client_error("stop_training_job", "ValidationException", "odd", expected_params={"TrainingJobName": NAME})
    stub.add_response("describe_training_job", describe_response(NAME, "InProgress", "Training"), {"TrainingJobName": NAME})
    with stub, pytest.raises(Exception) as err:
        backend.cancel(handle())
    assert "odd" in str(err.value)


def test_cancel_of_an_unknown_job_names_it():
    backend = make_backend()
    stub = Stubber(backend.client("sagemaker"))
    stub.add_client_error("stop_training_job", "ValidationException", "Requested resource not found.")
    stub.add_client_error("describe_training_job", "ValidationException", "Requested resource not found.")
    with stub, pytest.raises(ProviderError) as err:
        backend.cancel(handle())
    assert str(err.value) == f"SageMaker has no training job '{NAME}' in us-east-1 to stop."

