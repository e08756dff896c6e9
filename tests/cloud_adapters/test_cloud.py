"""cloud_adapters.cloud: the shared algorithms of the cloud adapters, over a scripted fake provider.

The provider's life is scripted (each job answers its describes from a list of states, the last one
repeating), its failures are queued per API, sleeping goes to a simulated clock, and every test
asserts how many calls of each API the algorithm made.
"""

from __future__ import annotations

import collections
import datetime as dt
import random
from typing import Any, Callable

import pytest

from cloud_adapters import retry
from cloud_adapters.base import (
    TAG_JOB_ID,
    TAG_JOB_NAME,
    Capabilities,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    ProviderError,
    Throttled,
)
from cloud_adapters.cloud import LIST_SKEW_S, CloudBackend, Probe, StateTable
from fake_clock import FakeClock

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


class ApiError(Exception):
    """What the fake provider's API raises: an error code, as a provider SDK's exception carries one."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class Provider:
    """A scripted cloud: jobs by name, each answering describes from its list of states in turn."""

    PAGE = 2  # jobs per list page

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.failures: dict[str, list[str]] = collections.defaultdict(list)
        # api → what its next calls raise, in order: an error code, or "" for a call that succeeds
        self.before: dict[str, Callable[[], None]] = {}  # api → what happens at the provider first
        self.tokens: list[str | None] = []  # the page token of every list call, in order

    def add(self, name: str, *states: str, tags: dict[str, str] | None = None,
            modified: dt.datetime = T0) -> None:
        self.jobs[name] = {"name": name, "states": list(states), "tags": dict(tags or {}), "modified": modified}

    def _enter(self, api: str) -> None:
        self.calls[api] += 1
        if api in self.before:
            self.before.pop(api)()
        code = self.failures[api].pop(0) if self.failures[api] else ""
        if code:
            raise ApiError(code)

    def describe(self, name: str) -> dict[str, Any]:
        self._enter("describe")
        if name not in self.jobs:
            raise ApiError("NotFound")
        job = self.jobs[name]
        state = job["states"].pop(0) if len(job["states"]) > 1 else job["states"][0]
        return {"name": name, "state": state, "tags": job["tags"], "modified": job["modified"]}

    def create(self, name: str) -> dict[str, Any]:
        self._enter("create")
        if name in self.jobs:
            raise ApiError("Conflict")
        self.add(name, "QUEUED")
        return {"name": name, "state": "QUEUED", "tags": {}}

    def stop(self, name: str) -> None:
        self._enter("stop")
        if name not in self.jobs:
            raise ApiError("NotFound")
        if self.jobs[name]["states"][0] not in ("QUEUED", "RUNNING"):
            raise ApiError("Refused")
        self.jobs[name]["states"] = ["STOPPING"]

    def list(self, token: str | None) -> tuple[list[dict[str, Any]], str | None]:
        self.tokens.append(token)
        self._enter("list")
        start = int(token or 0)
        names = sorted(self.jobs)
        page = [{"name": n, "state": self.jobs[n]["states"][0], "tags": self.jobs[n]["tags"],
                 "modified": self.jobs[n]["modified"]} for n in names[start:start + self.PAGE]]
        more = start + self.PAGE < len(names)
        return page, str(start + self.PAGE) if more else None


STATES = StateTable(
    states={"QUEUED": JobState.PENDING, "RUNNING": JobState.RUNNING, "STOPPING": JobState.STOPPING,
            "DONE": JobState.SUCCEEDED, "FAILED": JobState.FAILED, "STOPPED": JobState.CANCELLED},
    unknown="FakeCloud reported an unknown state {raw!r}.",
)


class FakeCloud(CloudBackend):
    """A cloud adapter with nothing but the hooks, over :class:`Provider`."""

    kind = "fakecloud"
    service = "FakeCloud"
    states = STATES
    stop_verb = "stop"

    def __init__(self, provider: Provider, clock: FakeClock, *, attempts: int = 5, rate: float = 1000.0,
                 probes: list[Probe] | None = None) -> None:
        super().__init__({})
        self.provider = provider
        self.clock = clock
        self.retry_policy = retry.RetryPolicy(max_attempts=attempts, rng=random.Random(1))
        self.rate = rate
        self.probes = probes or []

    capabilities = Capabilities(max_nodes=2, max_procs_per_node=2)

    def price(self, instance_type: str = "", spot: bool = False) -> float:
        return 1.0

    def logs(self, handle: JobHandle, cursor: str = "") -> tuple[list[str], str]:
        return [], cursor

    # the hooks
    def provider_name(self, job_name: str) -> str:
        return f"fc-{job_name}"

    def job_ref(self, handle: JobHandle) -> str:
        return handle.provider_job_id

    def no_job(self, ref: str) -> str:
        return f"FakeCloud has no job {ref!r}"

    def get_job(self, ref: str) -> dict[str, Any] | None:
        try:
            return self.call(lambda: self.provider.describe(ref))
        except ProviderError as exc:
            if exc.__cause__.code == "NotFound":
                return None
            raise

    def create_job(self, spec: JobSpec, name: str, request: Any) -> dict[str, Any]:
        return self.call(lambda: self.provider.create(name))

    def adopt_after_failed_create(self, exc) -> bool:
        return exc.__cause__.code == "Conflict"

    def stop_job(self, ref: str) -> None:
        self.call(lambda: self.provider.stop(ref))

    def stop_refused(self, exc) -> bool:
        return exc.__cause__.code in ("Refused", "NotFound")

    def unfinished_jobs(self):
        return self.pages(self.provider.list)

    def job_handle(self, job_name: str, job: dict[str, Any]) -> JobHandle:
        return JobHandle(provider=self.kind, job_name=job_name, provider_job_id=job["name"])

    def job_status(self, job: dict[str, Any]) -> JobStatus:
        state, warning = self.states.resolve(job["state"])
        return JobStatus(state=state, raw_state=job["state"], warning=warning)

    def raw_state(self, job: dict[str, Any]) -> str:
        return job["state"]

    def job_tags(self, job: dict[str, Any]) -> dict[str, str]:
        return job["tags"]

    def modified_at(self, job: dict[str, Any]) -> dt.datetime | None:
        return job["modified"]

    def classify(self, exc: BaseException, *, service: str) -> retry.Verdict | None:
        if not isinstance(exc, ApiError):
            return None
        if exc.code == "Throttling":
            return retry.Verdict(True, Throttled(f"{service}: throttled"))
        if exc.code == "Unavailable":
            return retry.Verdict(True, ProviderError(f"{service}: unavailable", transient=True))
        return retry.Verdict(False, ProviderError(f"{service} {exc.code}"))

    def rate_limit(self) -> tuple[str, float]:
        return "fake:account", self.rate

    def connection_probes(self) -> list[Probe]:
        return self.probes


@pytest.fixture(autouse=True)
def fresh_limiters():
    retry.reset_limiters()
    yield
    retry.reset_limiters()


@pytest.fixture
def provider() -> Provider:
    return Provider()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def backend(provider, clock) -> FakeCloud:
    return FakeCloud(provider, clock)


def spec(name: str = "tb-job-1") -> JobSpec:
    return JobSpec(job_name=name, config={})


def handle(ref: str = "fc-tb-job-1") -> JobHandle:
    return JobHandle(provider="fakecloud", job_name=ref.removeprefix("fc-"), provider_job_id=ref)


# -- submit ------------------------------------------------------------------------------------


def test_submit_creates_once_and_a_retried_submit_adopts(backend, provider):
    first = backend.submit(spec())
    assert first == handle()
    assert provider.calls == {"describe": 1, "create": 1}
    assert backend.submit(spec()) == first  # the retry describes the name and adopts
    assert provider.calls == {"describe": 2, "create": 1}


def test_a_create_that_lost_the_race_adopts_the_winners_job(backend, provider):
    provider.before["create"] = lambda: provider.add("fc-tb-job-1", "RUNNING")  # a concurrent submit
    assert backend.submit(spec()) == handle()
    assert provider.calls == {"describe": 2, "create": 1}  # NotFound, Conflict, then found
    assert provider.jobs["fc-tb-job-1"]["states"] == ["RUNNING"]  # its job, not a second one


def test_a_create_refused_for_another_reason_is_raised_without_looking_again(backend, provider):
    provider.failures["create"] = ["QuotaExceeded"]
    with pytest.raises(ProviderError, match="FakeCloud QuotaExceeded"):
        backend.submit(spec())
    assert provider.calls == {"describe": 1, "create": 1}


def test_a_conflict_with_no_job_to_adopt_raises_the_conflict(backend, provider):
    provider.failures["create"] = ["Conflict"]
    with pytest.raises(ProviderError, match="FakeCloud Conflict"):
        backend.submit(spec())
    assert provider.calls == {"describe": 2, "create": 1}


class Retrying(FakeCloud):
    create_attempts = 3


def test_transient_creates_look_the_name_up_before_each_retry(provider, clock):
    backend = Retrying(provider, clock, attempts=1)  # call() itself retries nothing
    provider.failures["create"] = ["Unavailable", "Unavailable"]
    assert backend.submit(spec()) == handle()
    assert provider.calls == {"describe": 3, "create": 3}  # first look, a look before each retry
    assert len(clock.sleeps) == 2


def test_a_transient_create_that_landed_is_adopted_not_resent(provider, clock):
    backend = Retrying(provider, clock, attempts=1)

    def landed_but_answer_lost():
        provider.add("fc-tb-job-1", "QUEUED")
        provider.failures["create"].append("Unavailable")

    provider.before["create"] = landed_but_answer_lost
    assert backend.submit(spec()) == handle()
    assert provider.calls == {"describe": 2, "create": 1}


def test_the_last_transient_create_is_raised_without_another_look(provider, clock):
    backend = Retrying(provider, clock, attempts=1)
    provider.failures["create"] = ["Unavailable"] * 3
    with pytest.raises(ProviderError, match="unavailable") as info:
        backend.submit(spec())
    assert info.value.transient
    assert provider.calls == {"describe": 3, "create": 3} and len(clock.sleeps) == 2


# -- describe ----------------------------------------------------------------------------------


def test_describe_follows_a_scripted_life(backend, provider):
    provider.add("fc-tb-job-1", "QUEUED", "RUNNING", "RUNNING", "FAILED")
    states = [backend.describe(handle()).state for _ in range(5)]
    assert states == [JobState.PENDING, JobState.RUNNING, JobState.RUNNING, JobState.FAILED, JobState.FAILED]
    assert provider.calls == {"describe": 5}


def test_describe_of_a_missing_job_names_it(backend):
    with pytest.raises(ProviderError, match=r"^FakeCloud has no job 'fc-gone'; was it deleted\?$"):
        backend.describe(handle("fc-gone"))


def test_an_unknown_state_stays_pending_with_its_warning(backend, provider):
    provider.add("fc-tb-job-1", "HIBERNATING")
    status = backend.describe(handle())
    assert (status.state, status.raw_state) == (JobState.PENDING, "HIBERNATING")
    assert status.warning == "FakeCloud reported an unknown state 'HIBERNATING'."


def test_describe_many_leaves_out_jobs_unchanged_since_less_the_skew(backend, provider):
    since = T0 + dt.timedelta(hours=1)
    provider.add("fc-old", "RUNNING", modified=since - dt.timedelta(seconds=LIST_SKEW_S + 1))
    provider.add("fc-edge", "RUNNING", modified=since - dt.timedelta(seconds=LIST_SKEW_S - 1))
    provider.add("fc-new", "DONE", modified=since + dt.timedelta(seconds=5))
    handles = [handle("fc-old"), handle("fc-edge"), handle("fc-new"), handle("fc-gone")]
    statuses = backend.describe_many(handles, changed_since=since)
    assert {name: s.state for name, s in statuses.items()} == {"edge": JobState.RUNNING, "new": JobState.SUCCEEDED}
    assert len(backend.describe_many(handles)) == 3  # without changed_since: every job found
    with pytest.raises(ValueError, match="timezone-aware"):
        backend.describe_many(handles, changed_since=since.replace(tzinfo=None))


# -- cancel ------------------------------------------------------------------------------------


def test_cancel_of_a_running_job_is_one_stop(backend, provider):
    provider.add("fc-tb-job-1", "RUNNING")
    backend.cancel(handle())
    assert provider.calls == {"stop": 1}
    assert backend.describe(handle()).state is JobState.STOPPING


@pytest.mark.parametrize("state", ["DONE", "FAILED", "STOPPED", "STOPPING"])
def test_cancel_of_a_job_that_ended_or_is_ending_is_fine(backend, provider, state):
    provider.add("fc-tb-job-1", state)
    backend.cancel(handle())  # refused, described, fine
    assert provider.calls == {"stop": 1, "describe": 1}


def test_cancel_refused_for_a_job_that_still_runs_is_raised(backend, provider):
    provider.add("fc-tb-job-1", "RUNNING")
    provider.failures["stop"] = ["Refused"]
    with pytest.raises(ProviderError, match="^FakeCloud Refused$"):
        backend.cancel(handle())
    assert provider.calls == {"stop": 1, "describe": 1}


def test_cancel_of_an_unknown_job_names_it(backend, provider):
    with pytest.raises(ProviderError, match=r"^FakeCloud has no job 'fc-gone' to stop\.$"):
        backend.cancel(handle("fc-gone"))
    assert provider.calls == {"stop": 1, "describe": 1}


def test_a_stop_failure_that_is_no_refusal_is_raised_at_once(backend, provider, clock):
    provider.add("fc-tb-job-1", "RUNNING")
    provider.failures["stop"] = ["Throttling"] * 5
    with pytest.raises(Throttled):
        backend.cancel(handle())
    assert provider.calls == {"stop": 5} and len(clock.sleeps) == 4  # retried by call(), never described


# -- tagged listing ----------------------------------------------------------------------------


def tags(name: str, job_id: str = "") -> dict[str, str]:
    return {TAG_JOB_NAME: name, **({TAG_JOB_ID: job_id} if job_id else {})}


def test_list_tagged_reads_every_page_and_keeps_trainboards_unfinished_jobs(backend, provider):
    provider.add("a", "RUNNING", tags=tags("tb-a", "7"))
    provider.add("b", "QUEUED", tags=tags("tb-b"))
    provider.add("c", "DONE", tags=tags("tb-c", "8"))  # ended
    provider.add("d", "RUNNING")  # not Trainboard's
    provider.add("e", "STOPPING", tags=tags("tb-e", "9"))
    found = backend.list_tagged()
    assert [(j.name, j.state, j.raw_state, j.job_id) for j in found] == [
        ("tb-a", JobState.RUNNING, "RUNNING", 7), ("tb-b", JobState.PENDING, "QUEUED", None),
        ("tb-e", JobState.STOPPING, "STOPPING", 9)]
    assert found[0].handle == JobHandle(provider="fakecloud", job_name="tb-a", provider_job_id="a")
    assert provider.tokens == [None, "2", "4"]  # five jobs, two a page: three pages
    assert provider.calls == {"list": 3}


def test_a_throttled_page_is_retried_on_its_own(backend, provider, clock):
    for name in "abcde":
        provider.add(name, "RUNNING", tags=tags(f"tb-{name}"))
    provider.failures["list"] = ["", "Throttling"]  # the second page, once
    assert [j.name for j in backend.list_tagged()] == [f"tb-{n}" for n in "abcde"]
    assert provider.tokens == [None, "2", "2", "4"]  # page 1 is not read again
    assert len(clock.sleeps) == 1


def test_pages_stop_at_max_pages(backend, provider):
    for name in "abcde":
        provider.add(name, "RUNNING")
    assert [j["name"] for j in backend.pages(provider.list, max_pages=2)] == ["a", "b", "c", "d"]
    assert provider.tokens == [None, "2"]


# -- the call wrapper --------------------------------------------------------------------------


def test_calls_spend_the_accounts_bucket_shared_by_its_backends(provider, clock):
    one, two = FakeCloud(provider, clock, rate=1.0), FakeCloud(provider, clock, rate=1.0)
    provider.add("fc-tb-job-1", "RUNNING")
    one.describe(handle())
    two.describe(handle())  # burst 2 × 1 call/s: both at once
    assert clock.sleeps == []
    one.describe(handle())  # the third waits for the refill
    assert clock.sleeps == [pytest.approx(1.0)]


def test_call_retries_transient_failures_then_succeeds(backend, provider, clock):
    provider.add("fc-tb-job-1", "RUNNING")
    provider.failures["describe"] = ["Unavailable", "Throttling"]
    assert backend.describe(handle()).state is JobState.RUNNING
    assert provider.calls == {"describe": 3} and len(clock.sleeps) == 2


# -- connection checks -------------------------------------------------------------------------


def failing(code: str, counter: collections.Counter[str], name: str) -> Callable[[], str]:
    def run() -> str:
        counter[name] += 1
        raise ApiError(code)
    return run


def test_probes_run_in_order_and_a_failure_says_what_to_fix(provider, clock):
    tries: collections.Counter[str] = collections.Counter()
    backend = FakeCloud(provider, clock, probes=[
        Probe("identity", lambda: "signed in as tester"),
        Probe("bucket", failing("Unavailable", tries, "bucket"), lambda exc: f"bucket: {exc}; check the network"),
        Probe("jobs API", lambda: "reachable", service="Jobs"),
    ])
    checks = backend.test_connection()
    assert [(c.name, c.ok, c.message) for c in checks] == [
        ("identity", True, "signed in as tester"),
        ("bucket", False, "bucket: FakeCloud: unavailable; check the network"),
        ("jobs API", True, "reachable")]
    assert tries["bucket"] == 2  # a form waits for the answer: two tries at most


def test_a_required_probe_that_fails_skips_the_rest(provider, clock):
    tries: collections.Counter[str] = collections.Counter()
    later = [Probe("bucket", lambda: "fine"), Probe("jobs API", lambda: "fine")]
    reported = FakeCloud(provider, clock, probes=[
        Probe("credentials", failing("Denied", tries, "reported"), required=True,
              skipped="not checked: no credentials"), *later]).test_connection()
    assert [(c.name, c.ok, c.message) for c in reported] == [
        ("credentials", False, "FakeCloud Denied"), ("bucket", False, "not checked: no credentials"),
        ("jobs API", False, "not checked: no credentials")]
    left_out = FakeCloud(provider, clock, probes=[
        Probe("credentials", failing("Denied", tries, "left out"), required=True), *later]).test_connection()
    assert [(c.name, c.ok) for c in left_out] == [("credentials", False)]
    assert tries == {"reported": 1, "left out": 1}  # a permanent failure is not tried again


# -- the state table ---------------------------------------------------------------------------


REFINED = StateTable(
    states={"InProgress": JobState.PENDING, ("InProgress", "Training"): JobState.RUNNING,
            "Stopping": JobState.STOPPING, "Completed": JobState.SUCCEEDED,
            ("Stopped", "MaxRuntimeExceeded"): JobState.FAILED, "Stopped": JobState.CANCELLED,
            "Deleting": JobState.CANCELLED},
    warnings={"InProgress": "unknown secondary {secondary!r} of {raw}"},
    unknown="unknown {raw!r} ({secondary!r})",
)


def test_a_secondary_state_refines_its_primary():
    assert REFINED.resolve("InProgress", "Training") == (JobState.RUNNING, "")
    assert REFINED.resolve("InProgress", "Warming") == (JobState.PENDING, "unknown secondary 'Warming' of InProgress")
    assert REFINED.resolve("Stopped", "MaxRuntimeExceeded") == (JobState.FAILED, "")
    assert REFINED.resolve("Stopped", "Stopped") == (JobState.CANCELLED, "")
    assert REFINED.resolve("Exploded", "x") == (JobState.PENDING, "unknown 'Exploded' ('x')")


def test_the_state_sets_are_read_from_the_table():
    assert REFINED.terminal == {"Completed", "Stopped", "Deleting"}
    assert REFINED.unfinished == {"InProgress", "Stopping"}
    assert [s for s in ("InProgress", "Stopping", "Completed", "Stopped", "Exploded")
            if REFINED.ended_or_ending(s)] == ["Stopping", "Completed", "Stopped"]


@pytest.mark.parametrize("kind", ["sagemaker", "vertex", "azureml"])
def test_every_provider_state_is_unfinished_or_terminal(kind):
    from cloud_adapters.registry import backend_class

    table = backend_class(kind).states
    primaries = {key[0] if isinstance(key, tuple) else key for key in table.states}
    assert table.terminal | table.unfinished == primaries and not table.terminal & table.unfinished
    assert table.terminal and table.unfinished
