"""Following an Azure ML job: scripted lives through the stand-in (every status mapped, cost from the
run interval), batched status from one paginated list, cancel through ``begin_cancel``, logs from
run history's log files with a byte-offset cursor, prices, and Test connection.
"""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal

import pytest
from azureml_standin import T0, AzureMLStandin, FakeCredential, iso, make_backend

from cloud_adapters.azureml import logs as az_logs
from cloud_adapters.azureml.states import STATES, job_status
from cloud_adapters.base import InvalidSpec, JobHandle, JobState, ProviderError, Throttled
from jobs.cost import job_cost_usd
from trainer_pkg.metrics import METRIC_PREFIX

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")  # azure-ai-ml's marshmallow schemas

NAME = "tb-job-42-65f1a2b3"
TAG = {"trainboard-job-name": NAME}


def handle(name: str = NAME) -> JobHandle:
    return JobHandle("azureml", name, extra={"azure_job_name": name, "instance_count": 2})


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def test_scripted_life_ends_succeeded_with_the_catalog_cost():
    st = AzureMLStandin()
    backend = make_backend(st)
    st.add_job(NAME, "Queued", tags=TAG, instance_count=2)
    life = [("Queued", {}), ("Preparing", {}),
            ("Running", {"StartTimeUtc": iso(at(3))}),
            ("Finalizing", {}),
            ("Completed", {"EndTimeUtc": iso(at(3 + 20))})]
    statuses = []
    for minute, (raw, props) in enumerate(life):
        st.set_status(NAME, raw, at=at(3 + 5 * minute), **props)
        statuses.append(backend.describe(handle()))
    assert [s.state for s in statuses] == [JobState.PENDING, JobState.PENDING, JobState.RUNNING, JobState.RUNNING,
                                           JobState.SUCCEEDED]
    assert [s.raw_state for s in statuses] == ["Queued", "Preparing", "Running", "Finalizing", "Completed"]
    assert all(not s.warning and not s.failure_reason for s in statuses)
    assert statuses[0].started_at is None and statuses[2].started_at == at(3) and statuses[3].ended_at is None
    done = statuses[-1]
    assert done.started_at == at(3) and done.ended_at == at(23)
    assert done.training_seconds == 1200.0 and done.billable_seconds is None and done.instance_count == 2
    price = backend.price("Standard_NC6s_v3")
    assert price == 3.06
    cost = job_cost_usd(billable_seconds=done.training_seconds, instances=done.instance_count, hourly_price_usd=price)
    assert cost == Decimal("2.0400")  # 1200 s × 2 VMs × 3.06 USD/h / 3600
    assert math.isclose(float(cost), 1200 * 2 * 3.06 / 3600, abs_tol=5e-5)
    assert len(st.calls("GET", r"/jobs/")) == 5  # one get per describe, no run-history read


def test_failed_job_carries_run_historys_error_message():
    st = AzureMLStandin()
    backend = make_backend(st)
    st.add_job(NAME, "Running", tags=TAG, instance_count=2, StartTimeUtc=iso(at(3)))
    st.set_status(NAME, "Failed", at=at(9), EndTimeUtc=iso(at(8)))
    st.run_errors[NAME] = {"code": "UserError", "message": "Execution failed. User process exited with status code 1."}
    status = backend.describe(handle())
    assert status.state is JobState.FAILED
    assert status.failure_reason == "UserError: Execution failed. User process exited with status code 1."
    assert status.started_at == at(3) and status.ended_at == at(8) and status.training_seconds == 300.0
    (details,) = st.calls("GET", r"/runs/.*/details$")
    assert details.path.endswith(f"/runs/{NAME}/details") and details.url.startswith("https://eastus.api.azureml.ms/history/v1.0/")


def test_not_responding_is_failed_and_canceled_is_cancelled():
    st = AzureMLStandin()
    backend = make_backend(st)
    st.add_job("a", "NotResponding", tags={"trainboard-job-name": "a"}, StartTimeUtc=iso(at(1)))
    st.set_status("a", "NotResponding", at=at(7))
    st.add_job("b", "Canceled", tags={"trainboard-job-name": "b"}, StartTimeUtc=iso(at(1)), EndTimeUtc=iso(at(4)))
    a, b = backend.describe(handle("a")), backend.describe(handle("b"))
    assert a.state is JobState.FAILED and a.failure_reason.startswith("NotResponding: Azure ML stopped hearing")
    assert a.ended_at == at(7) and a.training_seconds == 360.0  # no EndTimeUtc: the job's last modification
    assert b.state is JobState.CANCELLED and b.failure_reason == "canceled in Azure ML"
    assert b.training_seconds == 180.0


@pytest.mark.parametrize("raw,state", [
    ("NotStarted", JobState.PENDING), ("Queued", JobState.PENDING), ("Preparing", JobState.PENDING),
    ("Provisioning", JobState.PENDING), ("Starting", JobState.PENDING), ("Running", JobState.RUNNING),
    ("Finalizing", JobState.RUNNING), ("CancelRequested", JobState.STOPPING), ("Completed", JobState.SUCCEEDED),
    ("Failed", JobState.FAILED), ("NotResponding", JobState.FAILED), ("Canceled", JobState.CANCELLED),
    ("Paused", JobState.PENDING), ("Unknown", JobState.PENDING),
])
def test_every_status_maps_to_one_state(raw, state):
    status = job_status(status=raw, created_at=T0, last_modified_at=at(1))
    assert status.state is state and status.raw_state == raw
    assert bool(status.warning) == (raw in ("Paused", "Unknown"))
    assert (status.ended_at is not None) == state.is_terminal


def test_the_table_covers_the_whole_enum():
    from azure.ai.ml._restclient.arm_ml_service.models import JobStatus as RestJobStatus

    assert {s.value for s in RestJobStatus} == set(STATES.states)  # clouds.md §3.3: fourteen values


def test_paused_unknown_and_new_values_stay_non_terminal_with_a_warning():
    for raw in ("Paused", "Unknown", "Hibernating"):
        status = job_status(status=raw)
        assert status.state is JobState.PENDING and not status.state.is_terminal
        assert repr(raw) in status.warning or raw in status.warning


def test_times_fall_back_to_the_creation_context():
    running = job_status(status="Running", created_at=iso(T0))
    assert running.started_at == T0 and running.ended_at is None and running.training_seconds is None
    done = job_status(status="Completed", created_at=T0, last_modified_at=at(30))
    assert done.started_at == T0 and done.ended_at == at(30) and done.training_seconds == 1800.0
    queued = job_status(status="Queued", created_at=T0)
    assert queued.started_at is None


def test_describe_many_is_one_paginated_list_for_many_jobs():
    st = AzureMLStandin(list_page_size=10)
    backend = make_backend(st)
    for i in range(25):
        st.add_job(f"tb-job-{i}", "Running", tags={"trainboard-job-name": f"tb-job-{i}"}, StartTimeUtc=iso(at(1)))
    st.add_job("someone-elses", "Running")  # untagged: not listed
    st.set_status("tb-job-7", "Completed", EndTimeUtc=iso(at(11)))
    handles = [handle(f"tb-job-{i}") for i in range(25)] + [handle("tb-job-gone")]
    statuses = backend.describe_many(handles)
    assert len(statuses) == 25 and "tb-job-gone" not in statuses
    assert statuses["tb-job-7"].state is JobState.SUCCEEDED and statuses["tb-job-7"].training_seconds == 600.0
    assert all(statuses[f"tb-job-{i}"].state is JobState.RUNNING for i in range(25) if i != 7)
    lists = st.calls("GET", r"/jobs$")
    assert len(lists) == 3  # 26 tagged-or-not → 25 tagged, 10 per page: one list, three pages
    assert all(c.query["tag"] == "trainboard-job-name" for c in lists)
    assert [c.query.get("$skip") for c in lists] == [None, "10", "20"]
    assert not st.calls("GET", r"/jobs/[^/]+$")  # no get per job


def test_describe_many_leaves_out_jobs_unchanged_since():
    st = AzureMLStandin()
    backend = make_backend(st)
    for name in ("old", "new"):
        st.add_job(name, "Running", tags={"trainboard-job-name": name})
    st.set_status("old", "Running", at=at(0))
    st.set_status("new", "Completed", at=at(60))
    statuses = backend.describe_many([handle("old"), handle("new")], changed_since=at(30))
    assert list(statuses) == ["new"]
    with pytest.raises(ValueError, match="timezone-aware"):
        backend.describe_many([handle("old")], changed_since=dt.datetime(2026, 1, 1))


def test_throttled_list_pages_are_retried_and_converge(clock):
    st = AzureMLStandin(list_page_size=2)
    backend = make_backend(st, clock=clock, seed=3)
    for i in range(5):
        st.add_job(f"j{i}", "Running", tags={"trainboard-job-name": f"j{i}"})
    st.fail("GET", r"/jobs$", 429, times=2)
    statuses = backend.describe_many([handle(f"j{i}") for i in range(5)])
    assert sorted(statuses) == [f"j{i}" for i in range(5)]
    assert [c.status for c in st.calls("GET", r"/jobs$")][:2] == [429, 429]
    assert len(clock.sleeps) == 2


def test_throttling_that_outlasts_the_retries_reports_nothing(clock):
    st = AzureMLStandin()
    backend = make_backend(st, clock=clock)
    st.add_job("j0", "Running", tags={"trainboard-job-name": "j0"})
    st.fail("GET", r"/jobs$", 429, times=99)
    with pytest.raises(Throttled):
        backend.describe_many([handle("j0")])
    assert len(st.calls("GET", r"/jobs$")) == 5 and len(clock.sleeps) == 4


def test_server_errors_are_transient(clock):
    st = AzureMLStandin()
    backend = make_backend(st, clock=clock)
    st.add_job(NAME, "Running", tags=TAG)
    st.fail("GET", r"/jobs/", 503, times=1)
    assert backend.describe(handle()).state is JobState.RUNNING
    st.fail("GET", r"/jobs/", 500, times=9)
    with pytest.raises(ProviderError) as info:
        backend.describe(handle())
    assert info.value.transient and "Azure-side error" in str(info.value)


def test_cancel_goes_through_begin_cancel_and_is_idempotent():
    st = AzureMLStandin()
    backend = make_backend(st)
    st.add_job(NAME, "Running", tags=TAG, StartTimeUtc=iso(at(1)))
    backend.cancel(handle())
    (post,) = st.calls("POST", r"/cancel$")
    assert post.path.endswith(f"/jobs/{NAME}/cancel") and post.query["api-version"] == "2023-04-01-preview"
    assert st.calls("GET", r"/cancelstatus$")  # the LRO was followed to its end
    assert backend.describe(handle()).state is JobState.STOPPING  # CancelRequested
    backend.cancel(handle())  # again while CancelRequested: no second POST
    st.set_status(NAME, "Canceled", EndTimeUtc=iso(at(5)))
    backend.cancel(handle())
    assert len(st.calls("POST", r"/cancel$")) == 1
    assert backend.describe(handle()).state is JobState.CANCELLED


def test_cancel_refused_because_the_job_just_ended_is_not_an_error():
    st = AzureMLStandin()
    backend = make_backend(st)
    st.add_job(NAME, "Running", tags=TAG)
    real = st._route

    def ends_first(request, parts, path, query, body):
        if request.method == "POST" and path.endswith("/cancel"):
            st.set_status(NAME, "Completed")
            return st.response_for(request, 400, "UserError")
        return real(request, parts, path, query, body)

    st._route = ends_first
    backend.cancel(handle())
    assert st.jobs[NAME]["properties"]["status"] == "Completed"


def test_cancel_or_describe_of_an_unknown_job_names_it():
    backend = make_backend(AzureMLStandin())
    with pytest.raises(ProviderError, match="has no job 'nope' to cancel"):
        backend.cancel(handle("nope"))
    with pytest.raises(ProviderError, match="has no job 'nope'; was it deleted"):
        backend.describe(handle("nope"))


def test_logs_follow_each_process_file_by_byte_offset():
    st = AzureMLStandin()
    backend = make_backend(st)
    st.add_job(NAME, "Running", tags=TAG)
    assert backend.logs(handle()) == ([], "{}")  # no log file yet

    metric = METRIC_PREFIX + '{"event": "step", "step": 1, "loss": 2.25}'
    st.write_log(NAME, "user_logs/std_log_process_0.txt", f"[launch] rank 0\n{metric}\nepoch 0 ha")
    st.write_log(NAME, "user_logs/std_log_process_1.txt", "[launch] rank 1\n")
    st.write_log(NAME, "system_logs/lifecycler/execution-wrapper.log", "not a user log\n")
    lines, cursor = backend.logs(handle())
    assert lines == ["[std_log_process_0] [launch] rank 0", metric, "[std_log_process_1] [launch] rank 1"]
    first = len(f"[launch] rank 0\n{metric}\n".encode())
    assert az_logs.parse_cursor(cursor) == {"user_logs/std_log_process_0.txt": first,
                                            "user_logs/std_log_process_1.txt": len(b"[launch] rank 1\n")}

    assert backend.logs(handle(), cursor) == ([], cursor)  # nothing new (416 past the end, partial line kept)
    st.write_log(NAME, "user_logs/std_log_process_0.txt", "lf done\n")
    lines, cursor2 = backend.logs(handle(), cursor)
    assert lines == ["[std_log_process_0] epoch 0 half done"]
    ranges = [c.headers["Range"] for c in st.calls("GET", r"std_log_process_0\.txt$")]
    assert ranges[-1] == f"bytes={first}-{first + az_logs.MAX_BYTES - 1}"


def test_logs_of_one_process_are_unprefixed_and_a_missing_run_has_none():
    st = AzureMLStandin()
    backend = make_backend(st)
    st.add_job(NAME, "Running", tags=TAG)
    st.write_log(NAME, "user_logs/std_log.txt", "hello\r\nworld\n")
    assert backend.logs(handle())[0] == ["hello", "world"]
    assert backend.logs(handle("never-ran")) == ([], "")
    with pytest.raises(InvalidSpec, match="log cursor"):
        backend.logs(handle(), "not json")


def test_prices_and_offers_from_the_catalog():
    backend = make_backend(AzureMLStandin())
    assert backend.price() == 3.06  # Standard_NC6s_v3, the default vm_size
    assert backend.price("Standard_NC24ads_A100_v4") == 3.673
    offers = backend.instance_offers()
    assert [(o.instance_type, o.usd_per_hour, o.confirmed) for o in offers] == [
        ("Standard_NC24ads_A100_v4", 3.673, False), ("Standard_NC4as_T4_v3", 0.526, False),
        ("Standard_NC6s_v3", 3.06, False)]
    assert "sources conflict" in offers[2].source and "2026-11-29" in offers[2].source
    # Shipped low-priority rows: the pay-as-you-go figure stands in as an upper bound (none found).
    assert backend.price("Standard_NC6s_v3", spot=True) == 3.06
    assert "upper bound" in backend.prices.lookup("azure", "eastus", "Standard_NC6s_v3:low_priority").source
    from cloud_adapters.pricing import StaticPriceCatalog, shipped_catalog

    dedicated_only = StaticPriceCatalog([r for r in shipped_catalog().rows("azure") if ":" not in r.instance_type])
    with pytest.raises(InvalidSpec) as missing:
        make_backend(AzureMLStandin(), prices=dedicated_only).price("Standard_NC6s_v3", spot=True)
    assert str(missing.value) == ("Standard_NC6s_v3 has no low-priority price in the catalog for eastus; add a row "
                                  "'Standard_NC6s_v3:low_priority' (from the Azure Retail Prices API) or run on "
                                  "dedicated VMs (untick spot / set tier to dedicated).")
    with pytest.raises(InvalidSpec, match="'Standard_E4s_v3' has no price in the catalog for eastus; known: "
                                          "Standard_NC24ads_A100_v4, Standard_NC4as_T4_v3, Standard_NC6s_v3"):
        backend.price("Standard_E4s_v3")


def test_test_connection_reports_each_check():
    st = AzureMLStandin()
    checks = make_backend(st).test_connection()
    assert [(c.name, c.ok) for c in checks] == [("credential", True), ("workspace", True), ("compute", True)]
    assert checks[1].message == "workspace ws-trainboard found in resource group rg-trainboard (eastus)"
    assert checks[2].message == "compute cluster gpu-cluster exists (Standard_NC6s_v3, 0–4 nodes)"
    assert not [c for c in st.requests if c.method != "GET"]  # read-only


def test_test_connection_says_what_to_fix():
    st = AzureMLStandin()
    missing = make_backend(st, compute="cpu-cluster").test_connection()
    assert [(c.name, c.ok) for c in missing] == [("credential", True), ("workspace", True), ("compute", False)]
    assert "compute cluster cpu-cluster does not exist in workspace ws-trainboard; create it" in missing[2].message

    st.fail("GET", r"/workspaces/ws-trainboard$", 404, times=9, code="ResourceNotFound")
    no_ws = make_backend(st).test_connection()
    assert [(c.name, c.ok) for c in no_ws] == [("credential", True), ("workspace", False)]
    assert "correct the workspace, resource_group or subscription_id setting" in no_ws[1].message

    class Broken(FakeCredential):
        def get_token(self, *scopes, **kw):
            raise RuntimeError("no environment credential, no managed identity, az not logged in")

    no_cred = make_backend(AzureMLStandin(), credential=Broken()).test_connection()
    assert [(c.name, c.ok) for c in no_cred] == [("credential", False)]
    assert "DefaultAzureCredential tried the environment" in no_cred[0].message
    assert "az not logged in" in no_cred[0].message
