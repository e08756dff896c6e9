"""The base of the cloud adapters: the algorithms every managed cloud shares, written once.

A cloud backend (SageMaker, Vertex AI, Azure ML) runs a job as one provider job and talks to the
provider only through its API. What differs between clouds is which calls to make; what to do with
their answers is the same everywhere, so :class:`CloudBackend` owns it as template methods:

* **submit-or-adopt** (:meth:`~CloudBackend.submit`): look the job's provider name up; adopt a job
  that exists; else create it, and when the create fails in a way that may have created it anyway
  (a concurrent submit won, an answer was lost) look again and adopt what is there.
* **idempotent cancel** (:meth:`~CloudBackend.cancel`): ask the provider to stop the job; when it
  refuses, look the job up: a job that has ended or is ending is not an error.
* **describe / describe_many**: one job, or a batch left out where the provider reports it unchanged
  since ``changed_since`` − :data:`LIST_SKEW_S`.
* **tagged listing** (:meth:`~CloudBackend.list_tagged`): the provider's unfinished jobs that carry
  Trainboard's tags, read page by page (:meth:`~CloudBackend.pages`).
* **the call wrapper** (:meth:`~CloudBackend.call`): every provider call under the account's token
  bucket, retried with backoff while the adapter's classifier calls the failure transient
  (:mod:`cloud_adapters.retry`).
* **connection checks** (:meth:`~CloudBackend.test_connection`): the adapter's read-only
  :class:`Probe` s, each turned into a :class:`~cloud_adapters.base.ConnectionCheck`.

Each provider job state maps to one :class:`~cloud_adapters.base.JobState` through the adapter's
:class:`StateTable`, data declared in its ``states`` module (DESIGN.md §4).

What a new cloud supplies (each hook documented below): ``service``, ``states``, ``stop_verb``; the
names (:meth:`~CloudBackend.provider_name`, :meth:`~CloudBackend.job_ref`); the provider calls
(:meth:`~CloudBackend.get_job`, :meth:`~CloudBackend.create_job`, :meth:`~CloudBackend.stop_job`,
:meth:`~CloudBackend.unfinished_jobs`, and where the defaults do not fit
:meth:`~CloudBackend.find_job`, :meth:`~CloudBackend.create_request`,
:meth:`~CloudBackend.jobs_of`); the reading of a provider job (:meth:`~CloudBackend.job_handle`,
:meth:`~CloudBackend.job_status`, :meth:`~CloudBackend.raw_state`, :meth:`~CloudBackend.job_tags`,
:meth:`~CloudBackend.created_at`); the exception classification (:meth:`~CloudBackend.classify`,
:meth:`~CloudBackend.stop_refused`, :meth:`~CloudBackend.adopt_after_failed_create`); the account's
rate limit (:meth:`~CloudBackend.rate_limit`); its probes; and what every backend supplies
(``validate``, ``logs``, ``price``, ``capabilities``: :mod:`cloud_adapters.base`).

Like :mod:`cloud_adapters.base`, this module imports nothing from Django or any provider SDK.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import datetime as dt
import functools
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence, TypeVar, Union

from cloud_adapters import retry
from cloud_adapters.base import (
    TAG_JOB_NAME,
    Backend,
    BackendError,
    ConnectionCheck,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    ProviderError,
    ProviderJob,
    tagged_job_id,
)

T = TypeVar("T")

LIST_SKEW_S = 120
"""Seconds taken off ``changed_since`` before a provider is asked what changed: its timestamps are
stamped by the provider's clock and ``changed_since`` by ours, so a change at the boundary is
reported twice rather than never."""

StateKey = Union[str, tuple[str, str]]
"""A provider state (``"JOB_STATE_RUNNING"``), or a state and its secondary state
(``("InProgress", "Training")``) where the provider refines one by the other."""


@dataclasses.dataclass(frozen=True)
class StateTable:
    """A provider's job states as data: each documented state → its :class:`JobState`.

    ``states`` keys are a provider state, or ``(state, secondary state)`` for a provider whose
    primary state is refined by a secondary one (SageMaker's ``SecondaryStatus``); a pair wins over
    its state alone. A state not in the table is PENDING with the ``unknown`` warning: the job stays
    non-terminal until a known state arrives (DESIGN.md §4). Warnings are ``str.format`` templates
    with ``{raw}`` (the provider state) and ``{secondary}``.
    """

    states: Mapping[StateKey, JobState]
    unknown: str  # warning for a state the table lacks, e.g. "... unknown job state {raw!r}; ..."
    warnings: Mapping[StateKey, str] = dataclasses.field(default_factory=dict)
    # known states whose meaning for the job is unclear (paused, updating): shown, still mapped

    def resolve(self, raw: str, secondary: str = "") -> tuple[JobState, str]:
        """``(state, warning)`` of provider state ``raw`` (and ``secondary``); warning "" when none."""
        for key in ((raw, secondary), raw):
            if key in self.states:
                warning = self.warnings.get(key, "")
                return self.states[key], warning.format(raw=raw, secondary=secondary)
        return JobState.PENDING, self.unknown.format(raw=raw, secondary=secondary)

    @functools.cached_property
    def _primaries(self) -> dict[str, frozenset[JobState]]:
        """Each provider state → the JobStates it maps to, with any secondary state."""
        out: dict[str, set[JobState]] = {}
        for key, state in self.states.items():
            out.setdefault(key[0] if isinstance(key, tuple) else key, set()).add(state)
        return {raw: frozenset(states) for raw, states in out.items()}

    @functools.cached_property
    def terminal(self) -> frozenset[str]:
        """Provider states after which the job never runs again (a stop is then a no-op)."""
        return frozenset(raw for raw, states in self._primaries.items() if all(s.is_terminal for s in states))

    @functools.cached_property
    def unfinished(self) -> frozenset[str]:
        """Provider states of a job that has not ended (queued, starting, running, stopping)."""
        return frozenset(raw for raw, states in self._primaries.items() if not any(s.is_terminal for s in states))

    def ended_or_ending(self, raw: str) -> bool:
        """Whether a job in provider state ``raw`` has ended or is stopping: a stop has nothing to do."""
        states = self._primaries.get(raw, frozenset())
        return bool(states) and all(s.is_terminal or s is JobState.STOPPING for s in states)


@dataclasses.dataclass(frozen=True)
class Probe:
    """One read-only check that :meth:`CloudBackend.test_connection` runs."""

    name: str  # what is checked, as the user reads it: "identity", "bucket", "compute"
    run: Callable[[], str]  # the provider call(s); returns what was found, the passed check's message
    explain: Callable[[BaseException], str] = str  # the failed check's message: what to fix
    service: str = ""  # the API a classified error names ("" = the backend's ``service``)
    required: bool = False  # when it fails, the probes after it are not run
    skipped: str = ""  # with ``required``: each probe not run is reported failed with this; "" = left out


class CloudBackend(Backend):
    """A backend on a managed cloud; the shared algorithms of the module docstring, over hooks.

    ``job`` in the hooks is the provider's own record of a job (a DescribeTrainingJob dict, a
    ``CustomJob``, an azure-ai-ml ``Job``); it never leaves the adapter. ``ref`` is how the
    provider addresses one job: its name, or a resource name the provider assigned.
    """

    service: ClassVar[str]
    """How messages and classified errors name the provider's job API ("SageMaker", "Vertex AI")."""
    states: ClassVar[StateTable]
    """The provider's job states → :class:`JobState` (the adapter's ``states`` module)."""
    stop_verb: ClassVar[str] = "cancel"
    """The provider's word for a stop, in "<no job> to <verb>." ("stop", "cancel")."""
    create_attempts: ClassVar[int] = 1
    """Creates tried per submit while the failure is transient, looking the name up before each
    retry. 1 where the provider's create is retried only inside :meth:`call` (it cannot double)."""

    retry_policy: retry.RetryPolicy
    """Attempts and backoff of every provider call; set by the adapter's constructor (tests pass a
    seeded RNG)."""
    clock: retry.Clock
    """Time source of retries and the rate limit; set by the adapter's constructor (tests pass a
    simulated clock)."""

    # -- names --------------------------------------------------------------------------------

    @abc.abstractmethod
    def provider_name(self, job_name: str) -> str:
        """The provider-side name of the Trainboard job name ``job_name``, deterministic, so a
        retried submit finds its job. Raises :class:`~cloud_adapters.base.InvalidSpec` for ""."""

    @abc.abstractmethod
    def job_ref(self, handle: JobHandle) -> str:
        """What :meth:`get_job` and :meth:`stop_job` take for the job of ``handle``."""

    @abc.abstractmethod
    def no_job(self, ref: str) -> str:
        """The words for "the provider has no job ``ref``", e.g. "SageMaker has no training job 'x'
        in us-east-1"; describe and cancel end the sentence."""

    # -- provider calls -----------------------------------------------------------------------

    @abc.abstractmethod
    def get_job(self, ref: str) -> Any | None:
        """The provider's job ``ref`` (one describe call through :meth:`call`), or None when the
        provider has no such job. Raises :class:`BackendError` for any other failure."""

    def find_job(self, name: str) -> Any | None:
        """The job a submit of provider name ``name`` would adopt, or None. Default
        :meth:`get_job`; a provider that assigns its own ids finds the name by a label."""
        return self.get_job(name)

    @contextlib.contextmanager
    def create_request(self, spec: JobSpec, name: str) -> Iterator[Any]:
        """What :meth:`create_job` sends, built once per submit (the trainer uploaded, the request
        assembled) and alive while the creates run. Default: nothing."""
        yield None

    @abc.abstractmethod
    def create_job(self, spec: JobSpec, name: str, request: Any) -> Any:
        """Create the job (one create call through :meth:`call`); returns the created job, as
        :meth:`job_handle` reads it."""

    def adopt_after_failed_create(self, exc: BackendError) -> bool:
        """Whether a create that failed with ``exc`` may have created the job anyway, so that the
        name is looked up and an existing job adopted before ``exc`` is raised. Default False."""
        return False

    def after_create(self, name: str, created: Any) -> Any:
        """The job a submit adopts after creating ``created``. Default ``created``."""
        return created

    @abc.abstractmethod
    def stop_job(self, ref: str) -> None:
        """Ask the provider to stop the job (one call through :meth:`call`); returns at once."""

    @abc.abstractmethod
    def stop_refused(self, exc: BackendError) -> bool:
        """Whether ``exc`` from :meth:`stop_job` is the provider refusing the stop (the job ended,
        is ending, or is unknown), so the job is looked up to tell which."""

    @abc.abstractmethod
    def unfinished_jobs(self) -> Iterable[Any]:
        """The provider jobs that have not ended and may carry Trainboard's tags (paginated,
        :meth:`pages`); :meth:`list_tagged` picks Trainboard's."""

    def jobs_of(self, handles: Sequence[JobHandle], since: dt.datetime | None) -> Iterator[tuple[JobHandle, Any]]:
        """``(handle, job)`` for the ``handles`` the provider still knows; where it can tell, only
        those changed after ``since`` (UTC; None = all). Default: :meth:`get_job` per handle."""
        for handle in handles:
            job = self.get_job(self.job_ref(handle))
            if job is not None:
                yield handle, job

    # -- reading a provider job -------------------------------------------------------------

    @abc.abstractmethod
    def job_handle(self, job_name: str, job: Any) -> JobHandle:
        """The handle of the provider's ``job``, submitted as Trainboard job ``job_name``."""

    @abc.abstractmethod
    def job_status(self, job: Any) -> JobStatus:
        """The :class:`JobStatus` of ``job`` (its state through :attr:`states`)."""

    @abc.abstractmethod
    def raw_state(self, job: Any) -> str:
        """The provider's own state string of ``job``, read without a call."""

    @abc.abstractmethod
    def job_tags(self, job: Any) -> Mapping[str, str]:
        """The tags or labels of ``job``: ``trainboard-job-name`` and ``trainboard-job-id`` among them
        for Trainboard's jobs."""

    def created_at(self, job: Any) -> dt.datetime | None:
        """When the provider created ``job`` (UTC, aware), None when unknown. Default None."""
        return None

    def modified_at(self, job: Any) -> dt.datetime | None:
        """When ``job`` last changed (UTC, aware), for providers whose listing cannot filter by it;
        None = not known here. Default None."""
        return None

    # -- errors and rate ----------------------------------------------------------------------

    @abc.abstractmethod
    def classify(self, exc: BaseException, *, service: str) -> retry.Verdict | None:
        """The retry verdict for an exception of a provider call naming API ``service``
        (:data:`cloud_adapters.retry.Classifier`)."""

    @abc.abstractmethod
    def rate_limit(self) -> tuple[str, float]:
        """``(bucket key, calls per second)`` of the account or project the calls spend: one
        bucket for every backend of this process on that account (burst 2 × the rate)."""

    def connection_probes(self) -> list[Probe]:
        """The read-only checks :meth:`test_connection` runs, in order."""
        return []

    # -- the shared algorithms ----------------------------------------------------------------

    def call(self, fn: Callable[[], T], service: str = "", *, policy: retry.RetryPolicy | None = None,
             classify: Callable[..., retry.Verdict | None] | None = None) -> T:
        """``fn()`` under the account's rate limit, retried per ``policy`` (default
        :attr:`retry_policy`) while ``classify`` (default :meth:`classify`) calls the failure
        transient; ``service`` (default :attr:`service`) names the API in errors.

        Returns ``fn``'s result. Raises the classifier's :class:`BackendError` (see
        :func:`cloud_adapters.retry.call`).
        """
        key, rate = self.rate_limit()
        bucket = retry.limiter(key, rate=rate, burst=max(1, int(2 * rate)), clock=self.clock)
        service = service or self.service
        classify = classify or self.classify
        return retry.call(fn, classify=lambda exc: classify(exc, service=service), bucket=bucket,
                          policy=policy or self.retry_policy, clock=self.clock)

    def pages(self, fetch: Callable[[str | None], tuple[Iterable[T], str | None]], service: str = "", *,
              max_pages: int | None = None) -> Iterator[T]:
        """Every item of a paginated list: ``fetch(token)`` reads one page (``None`` = the first) and
        returns ``(items, next token)``, a falsy token on the last page. Each page is one
        :meth:`call`, retried on its own; at most ``max_pages`` pages are read."""
        token: str | None = None
        read = 0
        while True:
            items, token = self.call(lambda token=token: fetch(token), service)
            read += 1
            yield from items
            if not token or (max_pages is not None and read >= max_pages):
                return

    def submit(self, spec: JobSpec) -> JobHandle:
        """Create the job; idempotent by name (a job of the provider name is adopted).

        Calls: :meth:`find_job`; when there is none, :meth:`create_request` (uploads) and
        :meth:`create_job`; after a failed create that may have landed
        (:meth:`adopt_after_failed_create`, or a transient failure while :attr:`create_attempts`
        allow another), :meth:`find_job` again, adopting what it finds. Raises
        :class:`~cloud_adapters.base.InvalidSpec`, :class:`~cloud_adapters.base.CredentialsError`,
        :class:`~cloud_adapters.base.QuotaExceeded`, :class:`~cloud_adapters.base.CapacityUnavailable`,
        :class:`~cloud_adapters.base.Throttled` or :class:`ProviderError`.
        """
        self.validate(spec)
        name = self.provider_name(spec.job_name)
        existing = self.find_job(name)
        if existing is not None:
            return self.job_handle(spec.job_name, existing)
        with self.create_request(spec, name) as request:
            attempt = 0
            while True:
                attempt += 1
                try:
                    created = self.create_job(spec, name, request)
                except BackendError as exc:
                    again = exc.transient and attempt < self.create_attempts
                    if not again and not self.adopt_after_failed_create(exc):
                        raise
                    if again:
                        self.clock.sleep(self.retry_policy.delay(attempt))
                    found = self.find_job(name)  # the failed create, or a concurrent submit, made it
                    if found is not None:
                        return self.job_handle(spec.job_name, found)
                    if not again:
                        raise
                else:
                    return self.job_handle(spec.job_name, self.after_create(name, created))

    def describe(self, handle: JobHandle) -> JobStatus:
        """The job's status: one :meth:`get_job`. Raises :class:`ProviderError` when the provider
        has no such job, :class:`~cloud_adapters.base.Throttled` or a transient
        :class:`ProviderError` after retries."""
        ref = self.job_ref(handle)
        job = self.get_job(ref)
        if job is None:
            raise ProviderError(f"{self.no_job(ref)}; was it deleted?")
        return self.job_status(job)

    def describe_many(self, handles: Sequence[JobHandle],
                      changed_since: dt.datetime | None = None) -> dict[str, JobStatus]:
        """Statuses keyed by ``handle.job_name`` for the jobs :meth:`jobs_of` reads; with
        ``changed_since``, those :meth:`modified_at` dates before it − :data:`LIST_SKEW_S` are left
        out as unchanged. A job the provider no longer knows is left out. Throttling or connection
        errors that outlast the retries raise, so the caller keeps its ``changed_since``.
        Raises ValueError for a naive ``changed_since``."""
        if changed_since is not None and changed_since.tzinfo is None:
            raise ValueError("changed_since must be timezone-aware (UTC)")
        since = changed_since - dt.timedelta(seconds=LIST_SKEW_S) if changed_since is not None else None
        out: dict[str, JobStatus] = {}
        for handle, job in self.jobs_of(handles, since):
            modified = self.modified_at(job)
            if since is not None and modified is not None and modified < since:
                continue
            out[handle.job_name] = self.job_status(job)
        return out

    def cancel(self, handle: JobHandle) -> None:
        """Ask the provider to stop the job; returns at once (a later describe reports the stop).

        Idempotent: when the provider refuses (:meth:`stop_refused`) because the job has ended or is
        ending, that is not an error. Raises :class:`ProviderError` when there is no such job, and
        the refusal itself for a job that still runs."""
        self.stop(self.job_ref(handle))

    def stop(self, ref: str) -> None:
        """:meth:`cancel` of the provider's job ``ref``."""
        try:
            self.stop_job(ref)
        except BackendError as exc:
            if not self.stop_refused(exc):
                raise
            job = self.get_job(ref)
            if job is None:
                raise ProviderError(f"{self.no_job(ref)} to {self.stop_verb}.") from exc
            if self.states.ended_or_ending(self.raw_state(job)):
                return
            raise

    def list_tagged(self) -> list[ProviderJob]:
        """The provider's unfinished jobs (:meth:`unfinished_jobs`) that carry the
        ``trainboard-job-name`` tag submit sets, that tag's value as the name. Raises
        :class:`~cloud_adapters.base.Throttled` / :class:`ProviderError` after retries."""
        found: list[ProviderJob] = []
        for job in list(self.unfinished_jobs()):
            tags = self.job_tags(job)
            name = str(tags.get(TAG_JOB_NAME) or "")
            if not name or self.raw_state(job) in self.states.terminal:
                continue  # not Trainboard's, or ended
            status = self.job_status(job)
            found.append(ProviderJob(name=name, state=status.state, raw_state=status.raw_state,
                                     job_id=tagged_job_id(tags), created_at=self.created_at(job),
                                     handle=self.job_handle(name, job)))
        return found

    def test_connection(self) -> list[ConnectionCheck]:
        """Run :meth:`connection_probes` in order, each reported in words a user can act on; never
        raises. Each probe's calls are tried twice at most (a form waits for the answer)."""
        policy = retry.RetryPolicy(max_attempts=2, base_delay_s=0.2, rng=self.retry_policy.rng)
        probes = self.connection_probes()
        checks: list[ConnectionCheck] = []
        for index, probe in enumerate(probes):
            try:
                checks.append(ConnectionCheck(probe.name, True, self.call(probe.run, probe.service, policy=policy)))
            except Exception as exc:  # noqa: BLE001 - every failure becomes a message
                checks.append(ConnectionCheck(probe.name, False, probe.explain(exc)))
                if probe.required:
                    if probe.skipped:
                        checks += [ConnectionCheck(p.name, False, probe.skipped) for p in probes[index + 1:]]
                    break
        return checks
