"""A Vertex AI job's life through the adapter: scripted states on the stand-in, cost from the run
interval and the catalog, cancel, one list call for many jobs, Cloud Logging lines, Test connection."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from google.cloud import aiplatform_v1 as v1

from cloud_adapters.base import CredentialsError, InvalidSpec, JobHandle, JobSpec, JobState, ProviderError
from cloud_adapters.pricing import PriceRow, StaticPriceCatalog
from cloud_adapters.vertex import backend as vx_backend
from cloud_adapters.vertex import logs as vx_logs
from cloud_adapters.vertex.states import STATE_MAP, job_status

MACHINE_USD, T4_USD = 0.4369977, 0.4025  # cloud_adapters/data/prices.csv, gcp us-central1
T0 = "2026-01-01T00:00:00Z"


def spec(name="tb-job-7-65f0a1b2", nodes=3, **kw) -> JobSpec:
    return JobSpec(job_name=name, config={"train": {"epochs": 1}}, nodes=nodes, procs_per_node=1,
                   max_runtime_s=7200, tags={"trainboard-job-id": name.split("-")[2]}, **kw)


def utc(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


# -- the state table --------------------------------------------------------------------------------


def test_every_job_state_is_mapped():
    expected = {
        "JOB_STATE_QUEUED": JobState.PENDING, "JOB_STATE_PENDING": JobState.PENDING,
        "JOB_STATE_RUNNING": JobState.RUNNING, "JOB_STATE_UPDATING": JobState.RUNNING,
        "JOB_STATE_PAUSED": JobState.PENDING, "JOB_STATE_CANCELLING": JobState.STOPPING,
        "JOB_STATE_SUCCEEDED": JobState.SUCCEEDED, "JOB_STATE_FAILED": JobState.FAILED,
        "JOB_STATE_EXPIRED": JobState.FAILED, "JOB_STATE_PARTIALLY_SUCCEEDED": JobState.FAILED,
        "JOB_STATE_CANCELLED": JobState.CANCELLED,
    }
    assert set(v1.JobState.__members__) == set(expected) | {"JOB_STATE_UNSPECIFIED"}  # none forgotten
    assert STATE_MAP == expected
    for name, state in expected.items():
        status = job_status(v1.CustomJob(state=v1.JobState[name]))
        assert (status.state, status.raw_state) == (state, name)
        assert bool(status.warning) == (name == "JOB_STATE_UPDATING")
        assert status.secondary_state == ("Paused" if name == "JOB_STATE_PAUSED" else "")
        # Once the job has run (start_time set), paused or resumed and queued again is still RUNNING.
        ran = job_status(v1.CustomJob(state=v1.JobState[name], start_time={"seconds": 1_767_225_600}))
        assert ran.state == (JobState.RUNNING if name in ("JOB_STATE_QUEUED", "JOB_STATE_PENDING",
                                                          "JOB_STATE_PAUSED") else state), name
    unknown = job_status(v1.CustomJob(state=v1.JobState.JOB_STATE_UNSPECIFIED))
    assert unknown.state == JobState.PENDING and "unknown job state 'JOB_STATE_UNSPECIFIED'" in unknown.warning
    partial = job_status(v1.CustomJob(state=v1.JobState.JOB_STATE_PARTIALLY_SUCCEEDED,
                                      error={"code": 13, "message": "replica workerpool1-0 exited"}))
    assert partial.failure_reason == ("Vertex AI reports the job partially succeeded: some results may be "
                                      "missing due to errors (INTERNAL (13): replica workerpool1-0 exited)")


# -- scripted lives ---------------------------------------------------------------------------------


def test_scripted_life_succeeds_with_cost_from_run_interval(backend, vertex):
    handle = backend.submit(spec(nodes=3))
    vertex.script(handle.provider_job_id, [
        {"state": "JOB_STATE_PENDING", "updateTime": "2026-01-01T00:01:00Z"},
        {"state": "JOB_STATE_RUNNING", "startTime": "2026-01-01T00:05:00Z", "updateTime": "2026-01-01T00:05:00Z"},
        {"state": "JOB_STATE_SUCCEEDED", "endTime": "2026-01-01T01:35:00Z", "updateTime": "2026-01-01T01:35:00Z"},
    ])
    seen = [backend.describe(handle)]
    for _ in range(3):
        vertex.step()
        seen.append(backend.describe(handle))
    assert [s.state for s in seen] == [JobState.PENDING, JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED]
    assert [s.raw_state for s in seen] == ["JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_RUNNING",
                                           "JOB_STATE_SUCCEEDED"]
    assert seen[2].started_at == utc("2026-01-01T00:05:00Z") and seen[2].ended_at is None
    final = seen[-1]
    assert final.started_at == utc("2026-01-01T00:05:00Z") and final.ended_at == utc("2026-01-01T01:35:00Z")
    assert final.billable_seconds is None and final.training_seconds == 5400.0
    assert final.instance_count == 3 and final.spot is False and final.failure_reason == "" and not final.warning

    # Cost = run interval × replicas × (machine + accelerator × count), the catalog's figures.
    hourly = backend.price("n1-standard-8")
    assert hourly == pytest.approx(MACHINE_USD + T4_USD * 1)
    run_s = (final.ended_at - final.started_at).total_seconds()
    cost = run_s / 3600 * final.instance_count * hourly
    assert cost == pytest.approx(1.5 * 3 * 0.8394977) == pytest.approx(3.77773965)


def test_a_state_newer_than_the_sdk_is_reported_as_vertex_sent_it(backend, vertex):
    """The REST client drops enum names it does not know (the proto says JOB_STATE_UNSPECIFIED); the
    warning and raw_state carry Vertex's own string, through describe and describe_many alike."""
    handle = backend.submit(spec(nodes=1))
    vertex.script(handle.provider_job_id, [
        {"state": "JOB_STATE_SUSPENDED", "startTime": "2026-01-01T00:02:00Z"},
        {"state": "JOB_STATE_RUNNING"},
    ])
    vertex.step()
    for status in (backend.describe(handle), backend.describe_many([handle])[handle.job_name]):
        assert (status.state, status.raw_state) == (JobState.PENDING, "JOB_STATE_SUSPENDED")
        assert status.warning == ("Vertex AI reported an unknown job state 'JOB_STATE_SUSPENDED'; the job stays "
                                  "non-terminal until a known state arrives.")
    vertex.step()
    running = backend.describe(handle)
    assert (running.state, running.raw_state, running.warning) == (JobState.RUNNING, "JOB_STATE_RUNNING", "")


def test_cancel_ends_cancelled_and_is_idempotent(backend, vertex):
    handle = backend.submit(spec(nodes=1))
    vertex.script(handle.provider_job_id, [
        {"state": "JOB_STATE_RUNNING", "startTime": "2026-01-01T00:02:00Z"},
        {"state": "JOB_STATE_CANCELLED", "endTime": "2026-01-01T00:12:00Z",
         "error": {"code": 1, "message": "CANCELED"}},
    ])
    vertex.step()
    assert backend.describe(handle).state == JobState.RUNNING
    backend.cancel(handle)
    (cancel,) = vertex.calls("POST", r":cancel$")
    assert cancel.path == f"/v1/{handle.provider_job_id}:cancel" and cancel.body == {}
    stopping = backend.describe(handle)
    assert (stopping.state, stopping.raw_state) == (JobState.STOPPING, "JOB_STATE_CANCELLING")
    backend.cancel(handle)  # already cancelling: fine
    vertex.step()
    done = backend.describe(handle)
    assert done.state == JobState.CANCELLED and done.failure_reason == "cancelled in Vertex AI (CancelCustomJob)"
    assert done.training_seconds == 600.0 and done.ended_at == utc("2026-01-01T00:12:00Z")
    backend.cancel(handle)  # terminal: the service answers FAILED_PRECONDITION, which is not an error
    assert len(vertex.calls("POST", r":cancel$")) == 3
    missing = JobHandle(provider="vertex", job_name="x",
                           provider_job_id="projects/my-proj/locations/us-central1/customJobs/42")
    with pytest.raises(ProviderError, match="no custom job .*customJobs/42"):
        backend.cancel(missing)
    with pytest.raises(ProviderError, match="no custom job .*customJobs/42.*deleted"):
        backend.describe(missing)


@pytest.mark.parametrize("raw, error, reason", [
    ("JOB_STATE_FAILED", {"code": 8, "message": "The zone 'us-central1-a' does not have enough resources."},
     "RESOURCE_EXHAUSTED (8): The zone 'us-central1-a' does not have enough resources."),
    ("JOB_STATE_FAILED", None, "Vertex AI reported the job failed without an error message"),
    ("JOB_STATE_EXPIRED", {"code": 4, "message": "Job timed out waiting for resources"},
     "Vertex AI expired the job before it finished (DEADLINE_EXCEEDED (4): Job timed out waiting for resources)"),
])
def test_failed_and_expired_end_failed_with_reason(backend, vertex, raw, error, reason):
    handle = backend.submit(spec(nodes=2, spot=True))
    end = {"state": raw, "startTime": "2026-01-01T00:05:00Z", "endTime": "2026-01-01T00:20:00Z"}
    if error:
        end["error"] = error
    vertex.script(handle.provider_job_id, [{"state": "JOB_STATE_RUNNING", "startTime": "2026-01-01T00:05:00Z"}, end])
    vertex.step()
    vertex.step()
    status = backend.describe(handle)
    assert status.state == JobState.FAILED and status.raw_state == raw
    assert status.failure_reason == reason
    assert status.training_seconds == 900.0 and status.instance_count == 2 and status.spot is True


# -- describe_many ----------------------------------------------------------------------------------


def test_describe_many_is_one_list_call(backend, vertex):
    handles = []
    for i in range(5):
        vertex.now = f"2026-01-01T0{i}:00:00Z"
        handles.append(backend.submit(spec(f"tb-job-{i}-abc", nodes=1)))
    vertex.insert("projects/my-proj/locations/us-central1", {"displayName": "not ours"})  # no Trainboard label
    vertex.jobs[handles[3].provider_job_id].update(state="JOB_STATE_RUNNING", startTime="2026-01-01T03:30:00Z")
    before = len(vertex.requests)
    statuses = backend.describe_many(handles)
    calls = vertex.requests[before:]
    assert len(calls) == 1 and calls[0].method == "GET" and calls[0].path.endswith("/customJobs")
    assert calls[0].query["filter"] == 'labels.trainboard-job-name:* AND create_time>="2025-12-31T23:58:00Z"'
    assert sorted(statuses) == [f"tb-job-{i}-abc" for i in range(5)]
    assert statuses["tb-job-3-abc"].state == JobState.RUNNING
    assert {s.state for n, s in statuses.items() if n != "tb-job-3-abc"} == {JobState.PENDING}


def test_describe_many_pages_and_changed_since(backend, vertex, monkeypatch):
    handles = [backend.submit(spec(f"tb-job-{i}-abc", nodes=1)) for i in range(5)]
    monkeypatch.setattr(vx_backend, "LIST_PAGE", 2)
    vertex.jobs[handles[1].provider_job_id].update(state="JOB_STATE_RUNNING", updateTime="2026-01-01T02:00:00Z")
    gone = JobHandle(provider="vertex", job_name="tb-job-9-gone",
                            provider_job_id="projects/my-proj/locations/us-central1/customJobs/999",
                            extra={"create_time": "2026-01-01T00:00:00+00:00"})
    before = len(vertex.requests)
    statuses = backend.describe_many(handles + [gone], changed_since=utc("2026-01-01T01:00:00Z"))
    calls = vertex.requests[before:]
    assert [c.query.get("pageToken") for c in calls] == [None, "2", "4"]  # one filtered list, 3 pages of 2
    assert list(statuses) == ["tb-job-1-abc"]  # the others unchanged since; the missing job left out
    assert statuses["tb-job-1-abc"].state == JobState.RUNNING
    assert backend.describe_many([]) == {} and len(vertex.requests) == before + 3


# -- logs -------------------------------------------------------------------------------------------


def test_logs_from_cloud_logging_with_cursor(backend, vertex):
    from trainer_pkg.metrics import METRIC_PREFIX

    handle = backend.submit(spec(nodes=2))
    job_id = handle.provider_job_id.rsplit("/", 1)[-1]
    metric = METRIC_PREFIX + json.dumps({"event": "step", "step": 1, "loss": 2.25})
    vertex.add_entry(job_id, "2026-01-01T00:10:00.000000001Z", "a1", text="[launch] platform: vertex\n")
    vertex.add_entry(job_id, "2026-01-01T00:10:00.000000001Z", "a2", text=metric, task="workerpool1-0")
    vertex.add_entry(job_id, "2026-01-01T00:10:01Z", "b1", payload={"message": "epoch 0 done\nsaving"},
                     task="workerpool1-0")
    vertex.add_entry("555", "2026-01-01T00:10:02Z", "z9", text="another job's line")
    lines, cursor = backend.logs(handle, "")
    assert lines == ["[workerpool0-0] [launch] platform: vertex", metric,
                     "[workerpool1-0] epoch 0 done", "[workerpool1-0] saving"]
    assert json.loads(cursor) == {"ts": "2026-01-01T00:10:01Z", "id": "b1"}
    (call,) = vertex.calls("POST", r"/v2/entries:list")
    assert call.body == {"resourceNames": ["projects/my-proj"], "orderBy": "timestamp asc", "pageSize": 1000,
                         "filter": 'resource.type="ml_job" AND resource.labels.job_id="1000000001" AND '
                                   'timestamp>="2026-01-01T00:00:00Z"'}

    assert backend.logs(handle, cursor) == ([], cursor)  # nothing new: same cursor
    # A late entry with the cursor's timestamp but a higher insertId is still read; earlier ones not again.
    vertex.add_entry(job_id, "2026-01-01T00:10:01Z", "b2", text="late twin")
    vertex.fail(429, method="POST", path_re=r"entries:list", message="Rate limit: too many requests per minute")
    lines, cursor2 = backend.logs(handle, cursor)
    assert lines == ["[workerpool0-0] late twin"] and json.loads(cursor2) == {"ts": "2026-01-01T00:10:01Z", "id": "b2"}
    assert vertex.calls("POST", r"entries:list")[-1].body["filter"].endswith('timestamp>="2026-01-01T00:10:01Z"')
    with pytest.raises(InvalidSpec, match="log cursor"):
        backend.logs(handle, "not json")


def test_logs_page_through_and_stop_at_max_lines(backend, vertex, monkeypatch):
    handle = backend.submit(spec(nodes=1))
    job_id = handle.provider_job_id.rsplit("/", 1)[-1]
    for i in range(7):
        vertex.add_entry(job_id, f"2026-01-01T00:10:0{i}Z", f"i{i}", text=f"line {i}")
    monkeypatch.setattr(vx_logs, "PAGE_SIZE", 3)
    monkeypatch.setattr(vx_logs, "MAX_LINES", 5)
    lines, cursor = backend.logs(handle, "")
    assert lines == [f"line {i}" for i in range(5)]  # one replica: no prefix
    lines, cursor = backend.logs(handle, cursor)
    assert lines == ["line 5", "line 6"]


# -- prices, offers, test connection ----------------------------------------------------------------


def test_price_and_offers_from_the_catalog(make_backend):
    backend = make_backend(accelerator_type="NVIDIA_TESLA_T4", accelerator_count=2)
    assert backend.price() == pytest.approx(MACHINE_USD + 2 * T4_USD)
    # The shipped spot rows are the on-demand figures standing in as an upper bound (no Spot figure found).
    assert backend.price("n1-standard-4", spot=True) == pytest.approx(0.21849885 + 2 * T4_USD)
    assert "upper bound, not a Spot figure" in backend.prices.lookup("gcp", "us-central1", "n1-standard-4:spot").source
    offers = {o.instance_type: o for o in backend.instance_offers()}
    assert sorted(offers) == ["n1-standard-4", "n1-standard-8"]  # spot rows are prices, not offers
    assert offers["n1-standard-8"].usd_per_hour == pytest.approx(MACHINE_USD + 2 * T4_USD)
    assert offers["n1-standard-8"].confirmed is False and "derived" in offers["n1-standard-8"].source
    with pytest.raises(InvalidSpec, match="machine type 'e2-standard-4' has no price in the catalog for us-central1"):
        backend.price("e2-standard-4")
    l4 = make_backend(accelerator_type="NVIDIA_L4", accelerator_count=1)
    with pytest.raises(InvalidSpec, match="accelerator 'NVIDIA_L4' has no price"):
        l4.price()
    assert l4.instance_offers() == []
    cpu = make_backend(accelerator_type="", accelerator_count=0, region="europe-west4")
    with pytest.raises(InvalidSpec, match="for europe-west4; known: none"):
        cpu.price()
    own = StaticPriceCatalog([PriceRow("gcp", "us-central1", "n1-standard-8", 1)])  # the dashboard's catalog wins
    from cloud_adapters.vertex import VertexBackend
    assert VertexBackend({"project": "my-proj", "staging_bucket": "gs://stage"}, prices=own).price() == 1.0


def test_spot_is_priced_from_the_spot_rows_and_compared_with_on_demand(vertex, gcs, clock):
    """A spot job is billed at <machine>:spot + <accelerator>:spot × count, its saving measured against
    the on-demand rows (it was priced on demand: "Spot saving 0%")."""
    from cloud_adapters.vertex import VertexBackend

    rows = [PriceRow("gcp", "us-central1", "n1-standard-8", 0.44, "test"),
            PriceRow("gcp", "us-central1", "n1-standard-8:spot", 0.09, "test spot"),
            PriceRow("gcp", "us-central1", "NVIDIA_TESLA_T4", 0.40, "test"),
            PriceRow("gcp", "us-central1", "NVIDIA_TESLA_T4:spot", 0.14, "test spot"),
            PriceRow("gcp", "us-central1", "n1-standard-4", 0.22, "test")]
    backend = VertexBackend({"project": "my-proj", "staging_bucket": "gs://stage", "api_endpoint": vertex.url,
                             "accelerator_type": "NVIDIA_TESLA_T4", "accelerator_count": 2, "spot_allowed": True},
                            prices=StaticPriceCatalog(rows), clock=clock)
    assert backend.price(spot=True) == pytest.approx(0.09 + 2 * 0.14)
    assert backend.on_demand_price() == backend.price() == pytest.approx(0.44 + 2 * 0.40)
    assert [o.instance_type for o in backend.instance_offers()] == ["n1-standard-4", "n1-standard-8"]
    with pytest.raises(InvalidSpec, match=r"machine type 'n1-standard-4' has no Spot price in the catalog for "
                                          r"us-central1; add a row 'n1-standard-4:spot' \(manage.py refresh_prices"):
        backend.price("n1-standard-4", spot=True)


def test_connection_checks_pass_against_the_stand_ins(backend, vertex):
    checks = backend.test_connection()
    assert [(c.name, c.ok) for c in checks] == [("credentials", True), ("bucket", True), ("Vertex AI access", True)]
    assert checks[1].message == "bucket gs://stage exists and is accessible"
    assert vertex.calls("GET", r"/customJobs$")[-1].query["pageSize"] == "1"


def test_connection_explains_failures(make_backend, vertex, monkeypatch):
    missing_bucket = make_backend(staging_bucket="gs://nope/tb")
    vertex.fail(403, method="GET", path_re=r"/customJobs$", message="Permission 'aiplatform.customJobs.list' denied")
    checks = missing_bucket.test_connection()
    assert [(c.name, c.ok) for c in checks] == [("credentials", True), ("bucket", False), ("Vertex AI access", False)]
    assert checks[1].message.startswith("bucket gs://nope does not exist; create it (in us-central1)")
    assert "Grant the worker's identity the Vertex AI User role" in checks[2].message

    import google.auth
    from google.auth import exceptions as auth_exc

    def no_adc(*args, **kwargs):
        raise auth_exc.DefaultCredentialsError("Your default credentials were not found.")

    monkeypatch.setattr(google.auth, "default", no_adc)
    real = make_backend(api_endpoint="", storage_endpoint="")
    checks = real.test_connection()  # nothing is sent anywhere: the credentials check fails first
    assert [(c.name, c.ok) for c in checks] == [("credentials", False), ("bucket", False), ("Vertex AI access", False)]
    assert "gcloud auth application-default login" in checks[0].message
    with pytest.raises(CredentialsError, match="no Google Cloud credentials found"):
        real.describe(JobHandle(provider="vertex", job_name="x",
                                provider_job_id="projects/my-proj/locations/us-central1/customJobs/1"))
