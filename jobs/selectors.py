"""Reads, always scoped to the requesting user (DESIGN.md §8).

Views fetch one object with ``get_object_or_404(<list queryset>, pk=pk)``, so another user's object
is a 404. The contract is docs/internal-api.md.

Visibility: a user sees what they own and what is shared with a team they are a member
of (``team`` set on the object). Changing an object (edit, cancel, re-run, test connection) is for
its owner or staff only: :func:`can_change`; a teammate who may see it gets a 403 for those.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import statistics
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Iterable

from django.db import connection
from django.db.models import Case, CharField, Count, F, Func, Max, Q, QuerySet, Sum, Value, When
from django.db.models import Min
from django.db.models import DecimalField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce
from django.utils import timezone

from cloud_adapters import torchrun_log
from cloud_adapters.base import BackendError, Inventory
from jobs import bounds, hangs, idle, job_table, metric_buckets, metric_store
from jobs import preflight as job_preflight
from jobs import progress as job_progress
from jobs.adapters import backend_adapter, backend_allocates_devices, backend_queue, may_set_host_settings
from jobs.cost import CENT_FRACTION, MONEY_PLACES, format_usd, format_usd_per_hour, usd_places

from jobs.models import (
    ACTIVE_STATE_VALUES,
    HOLDING_STATES,
    INTERRUPTION,
    QUEUE_ORDER,
    TERMINAL_STATE_VALUES,
    ComputeBackend,
    Dataset,
    JobAttempt,
    JobEvent,
    JobListSettings,
    JobLogLine,
    JobStateChoices as S,
    MetricPoint,
    ModelSpec,
    SavedFilter,
    Sweep,
    Team,
    TrainingJob,
)
from jobs.budgets import month_start
from jobs.models import NotificationPreference, OperationCount, Webhook, WebhookDelivery  # notifications
from trainer_pkg.config import ConfigError, JobConfig, expand_script_args, script_hparams
from trainer_pkg.metrics import parse_metric_line
from trainer_pkg.registry import CUSTOM


def team_list_for_user(*, user) -> QuerySet[Team]:
    """The teams ``user`` is a member of (none for an anonymous user)."""
    return Team.objects.filter(members__pk=user.pk) if user.pk is not None else Team.objects.none()


def _visible(user) -> Q:
    """Rows of an Owned model that ``user`` may see: own, or shared with one of the user's teams."""
    if user.pk is None:
        return Q(pk__in=[])
    return Q(owner_id=user.pk) | Q(team_id__in=Team.objects.filter(members__pk=user.pk).values("pk"))


def can_change(*, user, obj) -> bool:
    """Whether ``user`` may change ``obj`` (an Owned row they can see): its owner or staff."""
    return user.pk is not None and (obj.owner_id == user.pk or bool(user.is_staff))


def dataset_list_for_user(*, user) -> QuerySet[Dataset]:
    return Dataset.objects.filter(_visible(user))


def model_spec_list_for_user(*, user) -> QuerySet[ModelSpec]:
    return ModelSpec.objects.filter(_visible(user))


def backend_list_for_user(*, user) -> QuerySet[ComputeBackend]:
    return ComputeBackend.objects.filter(_visible(user))


def training_job_list_for_user(*, user, state: str | Iterable[str] | None = None, backend: Any = None,
                               q: str | None = None, tag: str | None = None, archived: bool | None = None,
                               sort: str | None = None) -> QuerySet[TrainingJob]:
    """The user's jobs and their teams' jobs, newest first (or by ``sort``).

    ``tag``: jobs carrying that tag; ``archived``: None = archived or not (what fetching one job
    needs: an archived job's page still opens), False = not archived (the lists' default), True =
    archived only; ``sort``: a sort key of :mod:`jobs.job_table` (``"-val_accuracy"``, ``"train.lr"``,
    ``"cost"``; rows without the value last), ValueError for one :func:`jobs.job_table.sort_problem`
    refuses.

    ``state``: one state value or several; ``backend``: a ComputeBackend, its pk or its name;
    ``q``: an id search (``7`` or ``#7``) matches the job of that id only, ``job-7`` (an unnamed job's
    shown name) that job or one named so; any other text matches the
    job's name or its dataset's, model's or backend's name (contained, case-insensitive), or its
    whole provider job name (``tb-job-7-6650f3a1``, any case). The provider name is never searched
    for a part: every one holds the job's id and a hex creation time, so a fragment such as ``7``
    or ``a1`` would match nearly every job.
    """
    qs = (TrainingJob.objects.filter(_visible(user))
          .select_related("dataset", "model_spec", "backend"))
    if state:
        states = [state] if isinstance(state, str) else list(state)
        qs = qs.filter(state__in=[str(s).upper() for s in states])
    if backend not in (None, ""):
        if isinstance(backend, ComputeBackend):
            qs = qs.filter(backend_id=backend.pk)
        elif isinstance(backend, int) or (isinstance(backend, str) and backend.isdigit()):
            qs = qs.filter(backend_id=int(backend))
        else:
            qs = qs.filter(backend__name=backend)
    if q:
        q = q.strip()
        job_id = q.removeprefix("#")
        shown = q.lower().removeprefix("job-") if q.lower().startswith("job-") else ""
        if job_id.isascii() and job_id.isdigit():
            qs = qs.filter(pk=int(job_id)) if len(job_id) <= 18 else qs.none()  # past bigint: no such id
        elif shown.isascii() and shown.isdigit() and len(shown) <= 18:
            # "job-7": the name the UI shows an unnamed job by, or a job named so.
            qs = qs.filter(Q(pk=int(shown)) | Q(name__iexact=q))
        else:
            qs = qs.filter(Q(name__icontains=q) | Q(provider_job_name__iexact=q)
                           | _related_name_match(q, dataset="dataset_id", model_spec="model_spec_id",
                                                 backend="backend_id"))
    if tag:
        qs = qs.filter(job_table.HasTag("tags", tag.strip().lower()))
    if archived is not None:
        qs = qs.filter(archived_at__isnull=not archived)
    if sort:
        qs = qs.order_by(*job_table.ordering(sort))
    return qs


def _related_name_match(q: str, **columns: str) -> Q:
    """``dataset_id IN (…) | model_spec_id IN (…) | backend_id IN (…)`` for the datasets, models and
    backends whose name contains ``q`` (case-insensitive), found first in one small UNION query.

    Why not ``Q(dataset__name__icontains=q)``: that joins every job to its dataset, model and backend
    and tests each row; with literal id lists every arm of the search's OR is an indexed column of the
    job table (foreign keys; trigram indexes on name and provider job name, jobs/migrations/
    0004_scale_indexes.py), so a search reads the matching jobs only.
    """
    tags = {"dataset": Dataset, "model_spec": ModelSpec, "backend": ComputeBackend}
    parts = [tags[tag].objects.filter(name__icontains=q).order_by()
             .annotate(tag=Value(tag, output_field=CharField())).values_list("pk", "tag") for tag in columns]
    ids: dict[str, list[int]] = {tag: [] for tag in columns}
    for pk, tag in parts[0].union(*parts[1:], all=True):
        ids[tag].append(pk)
    match = Q(pk__in=[])
    for tag, column in columns.items():
        if ids[tag]:
            match |= Q(**{f"{column}__in": ids[tag]})
    return match


def training_job_metric_summary(*, job: TrainingJob) -> dict[str, dict[str, Any]]:
    """Each global series of ``job`` in one row, however long: ``{"val_loss": {"points": 1200,
    "last_step": 36000, "last_value": 0.21, "min": 0.2, "max": 2.3, "nonfinite": 0}, ...}`` by name.
    ``points`` counts the non-finite ones too (``nonfinite``; ``last_value`` None when the last was
    one); ``min``/``max`` are over the finite values (None without one). One query, one row a
    series (:func:`jobs.metric_buckets.summaries`); a chart reads :func:`jobs.metric_buckets.read_series`."""
    return {name: {"points": a.count, "last_step": a.last_step, "last_value": a.last_value, "min": a.min_value,
                   "max": a.max_value, "nonfinite": a.nonfinite}
            for (_, name, _), a in sorted(metric_buckets.summaries([job.pk], per_rank=False).items())}


_RANK_FIELDS = {"rank_samples_per_s": "samples_per_s", "rank_step_time_s": "step_time_s",
                "rank_data_wait_s": "data_wait_s", "rank_compute_s": "compute_s",
                "rank_sync_wait_s": "sync_wait_s", "rank_pipeline_stage": "stage",
                "rank_stage_layers": "stage_layers"}
_INT_RANK_FIELDS = ("stage", "stage_layers")


def training_job_rank_throughput(*, job: TrainingJob) -> list[dict[str, Any]]:
    """Latest per-rank numbers, e.g. ``[{"rank": 0, "samples_per_s": 812.0, "step_time_s": 0.04,
    "data_wait_s": 0.002, "compute_s": 0.011, "sync_wait_s": 0.027, "stage": None,
    "stage_layers": None}, ...]``.

    Seconds per step: ``data_wait_s`` waiting for the next batch; ``compute_s`` the rank's own
    forward and backward, apart from waiting for other ranks; ``sync_wait_s`` the rest of the step
    (the gradient sync, waiting for slower ranks, the optimizer); ``step_time_s`` = compute + sync
    wait (equal on every rank in synchronous training). ``stage`` / ``stage_layers``: a pipeline
    rank's stage (0-based) and its number of layers. Taken from the last step that reported
    per-rank values (None where a metric is missing: older trainers report no compute).
    """
    latest = metric_buckets.summaries([job.pk], names=tuple(_RANK_FIELDS), per_rank=True)
    if not latest:
        return []
    last_step = max(agg.last_step for agg in latest.values())
    out: dict[int, dict[str, Any]] = {}
    for (_, name, rank), agg in sorted(latest.items(), key=lambda item: item[0][2]):
        if agg.last_step != last_step:
            continue
        value = agg.last_value
        row = out.setdefault(rank, {"rank": rank, **dict.fromkeys(_RANK_FIELDS.values())})
        field = _RANK_FIELDS[name]
        row[field] = int(value) if field in _INT_RANK_FIELDS and value is not None else value
    return [out[r] for r in sorted(out)]


STRAGGLER_MIN_BEHIND_PCT = 10.0
"""A rank is named the straggler only when it needs at least this much more time per step than the
median of the other ranks: below it, ranks are equal up to noise (and "0% behind" says nothing)."""


def _time_to_sync(row: dict[str, Any]) -> float | None:
    """Seconds per step a rank needs before it can join the gradient sync: data wait + compute.
    Records from trainers before compute was measured: the step time (which includes waiting)."""
    if row.get("compute_s") is not None:
        return (row.get("data_wait_s") or 0.0) + row["compute_s"]
    return row.get("step_time_s")


def training_job_straggler(*, job: TrainingJob,
                           ranks: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The rank the others wait for, by its latest time to reach the gradient sync (data wait +
    its own forward and backward, not the time it waits for the others), and what the waiting costs.

    ``{"rank": 1, "stage": None, "time_to_sync_s": 0.024, "others_median_s": 0.004,
    "behind_pct": 500.0, "data_wait_s": 0.001, "others_wait_s": 0.02, "lost_s": 12.5,
    "lost_usd": Decimal("0.0125"), "text": "rank 1 makes the others wait: ..."}``:
    ``others_wait_s`` seconds per step the other ranks together spend waiting for it (latest
    record); ``lost_s`` rank-seconds all ranks spent waiting for the slowest rank over the run so
    far (the sum of the trainer's ``wait_for_slowest_s``); ``lost_usd`` = lost_s × the job's price
    per rank-second (``hourly_price_usd`` per instance-hour / ``procs_per_node`` / 3600), None
    without a price; ``text`` shows it at the precision of the job's own figures
    (``TrainingJob.money_places``), "under $0.0001" when it rounds to nothing. None with fewer than two ranks reporting, or when the slowest is less than
    :data:`STRAGGLER_MIN_BEHIND_PCT` behind the others' median. Ties go to the lowest rank.
    ``ranks``: the rows of :func:`training_job_rank_throughput` when the caller has them already.
    """
    rows = training_job_rank_throughput(job=job) if ranks is None else ranks
    timed = [(r, t) for r in rows if (t := _time_to_sync(r)) is not None]
    if len(timed) < 2:
        return None
    slowest, slowest_s = max(timed, key=lambda rt: (rt[1], -rt[0]["rank"]))
    others = [t for r, t in timed if r is not slowest]
    median = statistics.median(others)
    if median > 0:
        behind = (slowest_s / median - 1.0) * 100.0
    else:
        behind = math.inf if slowest_s > 0 else 0.0
    if behind < STRAGGLER_MIN_BEHIND_PCT:
        return None
    others_wait = sum(slowest_s - t for t in others)
    waited = metric_buckets.summaries([job.pk], names=["wait_for_slowest_s"], per_rank=False)
    lost = sum(agg.sum_value or 0.0 for agg in waited.values())
    lost_usd = None
    if job.hourly_price_usd is not None and job.procs_per_node:
        lost_usd = (Decimal(repr(lost)) * job.hourly_price_usd / job.procs_per_node / 3600).quantize(
            Decimal("0.0001"), rounding=ROUND_HALF_UP)
    stage = slowest.get("stage")
    who = f"rank {slowest['rank']}" + (f" (pipeline stage {stage}, {slowest.get('stage_layers')} layers)"
                                       if stage is not None else "")
    text = (f"{who} makes the others wait: {slowest_s:.3g} s/step to reach the gradient sync (data + "
            f"forward + backward), {behind:.0f}% more than the others' median of {median:.3g} s; they wait "
            f"{others_wait:.3g} s/step for it")
    if lost > 0:
        text += f". Waiting so far: {lost:,.3g} rank-seconds"
        if lost_usd is not None and job.hourly_price_usd > 0:
            places = max(job.money_places, usd_places(lost_usd))
            # waiting worth less than the smallest figure a job's cost is kept in is not "$0.0000"
            dollars = (format_usd(lost_usd, places) if lost_usd > 0
                       else f"under {format_usd(CENT_FRACTION, MONEY_PLACES)}")
            text += f", {dollars} at {format_usd_per_hour(job.hourly_price_usd)} per node"
    return {
        "rank": slowest["rank"],
        "stage": stage,
        "time_to_sync_s": slowest_s,
        "others_median_s": median,
        "behind_pct": behind,
        "data_wait_s": slowest.get("data_wait_s"),
        "others_wait_s": others_wait,
        "lost_s": lost,
        "lost_usd": lost_usd,
        "text": text,
    }


def training_job_bound(*, job: TrainingJob, ranks: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """What bounds the run, in one line (:func:`jobs.bounds.bound`): from each rank's latest timing
    (``ranks``: the rows of :func:`training_job_rank_throughput` when the caller has them) and each
    GPU's mean utilisation over its recent samples (:func:`jobs.metric_buckets.recent_means` of
    ``sys/gpu_util_pct``: the last two 256-second buckets, 4 to 8 minutes of samples). None when the
    job reported neither. Two queries beyond the ranks' rows, however long the run."""
    rows = training_job_rank_throughput(job=job) if ranks is None else ranks
    utils = metric_buckets.recent_means(job.pk, idle.UTIL)
    return bounds.bound(rows, utils, job.procs_per_node)


def training_job_log_tail(*, job: TrainingJob, lines: int = 200) -> list[str]:
    """The last ``lines`` log lines, oldest first, without the trainer's metric records (those are
    the charts; as raw JSON they would crowd out what a person reads a log for). torchrun's own
    report of a failure (its traceback and summary, ~40 lines after the rank's own traceback) is
    folded into one line, so the tail ends with the user's traceback; the full log keeps it."""
    lines = max(int(lines), 0)
    texts = list(JobLogLine.objects.filter(job_id=job.pk, is_metric=False)
                 .order_by("-seq").values_list("text", flat=True)[:lines])
    texts.reverse()
    span = torchrun_log.failure_summary_span(texts)
    if span is not None:
        first, last = span
        texts[first:last + 1] = [f"[trainboard] torchrun's failure report ({last - first + 1} lines) folded: the "
                                 "failed rank and its error are in the failure reason; the full log has it"]
    return texts


# --- the experiment table, saved filters and the full log (docs/experiments.md) -----------------


def job_list_columns_for_user(*, user) -> list[str]:
    """The extra job-list columns ``user`` chose (``jobs.job_table`` keys, e.g. ``["val_accuracy",
    "train.lr"]``), :data:`jobs.job_table.DEFAULT_COLUMNS` when they chose none."""
    if user.pk is None:
        return list(job_table.DEFAULT_COLUMNS)
    row = JobListSettings.objects.filter(user_id=user.pk).values_list("columns", flat=True).first()
    return list(row) if isinstance(row, list) and row else list(job_table.DEFAULT_COLUMNS)


def metric_names_for_user(*, user) -> set[str]:
    """The final-metric names (``TrainingJob.final_metrics`` keys: ``"val_accuracy"``, ``"tokens/s"``)
    that any job ``user`` may see reported, archived or not: with the trainer's own names, the metric
    sort keys the job list and ``?ordering=`` accept. One query (PostgreSQL: the distinct
    ``jsonb_object_keys``; another database reads the field of each job that has metrics)."""
    jobs = TrainingJob.objects.filter(_visible(user)).exclude(final_metrics={}).order_by()
    if connection.vendor == "postgresql":
        keys = jobs.annotate(key=Func(F("final_metrics"), function="jsonb_object_keys", output_field=CharField()))
        return set(keys.values_list("key", flat=True).distinct())
    return {k for row in jobs.values_list("final_metrics", flat=True) if isinstance(row, dict) for k in row}


def saved_filter_list_for_user(*, user) -> QuerySet[SavedFilter]:
    """``user``'s saved job-list filters by name. Saved filters are private: fetch one with
    ``get_object_or_404(saved_filter_list_for_user(user=u), pk=pk)``, another user's is a 404."""
    if user.pk is None:
        return SavedFilter.objects.none()
    return SavedFilter.objects.filter(owner_id=user.pk).order_by("name", "id")


def saved_filter_jobs_for_user(*, user, saved_filter: SavedFilter | int) -> QuerySet[TrainingJob]:
    """The jobs ``saved_filter`` (a SavedFilter of ``user``'s, or its pk) selects for ``user``, in its
    sort order: the job list's queryset for the stored state, backend, search, tag, archive choice and
    sort (its ``columns`` choose what is shown, not which jobs). What the comparison page uses for
    ``?filter=<id>``. Raises ``SavedFilter.DoesNotExist`` when it is not ``user``'s (a 404 to show)."""
    if not isinstance(saved_filter, SavedFilter) or saved_filter.owner_id != user.pk:
        pk = saved_filter.pk if isinstance(saved_filter, SavedFilter) else saved_filter
        saved_filter = saved_filter_list_for_user(user=user).get(pk=pk)
    query, _ = job_table.clean_list_query(saved_filter.query if isinstance(saved_filter.query, dict) else {})
    return training_job_list_for_user(
        user=user, state=query.get("state"), backend=query.get("backend"), q=query.get("q"),
        tag=query.get("tag"), archived=job_table.archived_filter(query.get("archived")), sort=query.get("sort"))


LOG_PAGE_LINES = 500
"""Lines per page of the job's log page."""
LOG_API_MAX_LIMIT = 5000
"""Most lines one ``GET /api/jobs/{id}/logs/`` answers."""
LOG_SEARCH_WINDOW = 200_000
"""Most lines one filtered read looks at (a search ``q`` or a ``rank``: a text match on every line,
no index can narrow it): the log page searches a longer log this many lines at a time, newest first,
and a filtered ``?after=`` read moves its cursor at most this far. A read then costs what it shows,
whatever the log's length (bench/log_scale.py)."""


def training_job_log_lines(*, job: TrainingJob, q: str = "", rank: int | None = None,
                           metrics: bool = False) -> QuerySet[JobLogLine]:
    """The job's stored log lines in order (``seq`` ascending), filtered: ``q`` a substring, any case;
    ``rank`` the lines rank ``rank`` wrote (:func:`jobs.job_table.rank_regex`: the marks torch, the
    launcher and the trainer put on a rank's lines); ``metrics`` False leaves out the trainer's metric
    records that a job logged by an older Trainboard has as lines (``is_metric``; a newer job's
    records are its metric points only, :class:`~jobs.models.JobLogLine`)."""
    lines = JobLogLine.objects.filter(job_id=job.pk)
    if not metrics:
        lines = lines.filter(is_metric=False)
    if q:
        lines = lines.filter(text__icontains=q)
    if rank is not None:
        lines = lines.filter(text__regex=job_table.rank_regex(rank))
    return lines.order_by("seq")


def training_job_has_metric_lines(*, job: TrainingJob) -> bool:
    """Whether ``job`` has metric records stored as log lines (logged before records were stored once,
    as points only). One probe of the partial index ``logline_metric_seq``, empty for newer jobs."""
    return JobLogLine.objects.filter(job_id=job.pk, is_metric=True).exists()


@dataclasses.dataclass(frozen=True)
class LogPage:
    """One page of a job's log as the log page shows it."""

    lines: list[tuple[int, str]]  # (seq, text) in order
    number: int  # 1-based
    num_pages: int  # at least 1
    count: int  # matching lines in all (those shown, when ``searched`` is set)
    per_page: int
    searched: tuple[int, int] | None = None  # (first, last) seq a search of a long log looked at
    older: int | None = None  # the ``before`` that goes on searching older lines; None: none left

    @property
    def has_previous(self) -> bool:
        return self.number > 1

    @property
    def has_next(self) -> bool:
        return self.number < self.num_pages


def training_job_log_page(*, job: TrainingJob, page: int | None = None, per_page: int = LOG_PAGE_LINES,
                          q: str = "", rank: int | None = None, metrics: bool = False,
                          before: int | None = None) -> LogPage:
    """Page ``page`` (1-based; None or past the end = the newest page; below 1 = the first) of the
    job's lines as :func:`training_job_log_lines` filters them, ``per_page`` lines a page.

    Unfiltered (no ``q``, no ``rank``) and with every line shown (a newer job, or ``metrics``), a
    job's ``seq`` runs without gaps, so the count is last − first ``seq`` + 1 and page N is the
    ``seq`` range of its lines: three index probes whatever the log's length. A search (``q`` or
    ``rank``) of a log longer than :data:`LOG_SEARCH_WINDOW` lines, or with ``before`` (a ``seq``),
    is one page of the newest matches before ``before`` (None: after the newest line), looking back
    at most that many lines (``page`` is then ignored): :attr:`LogPage.searched` is the range looked
    at, :attr:`LogPage.older` the ``before`` that goes on from there. Otherwise (a shorter log
    searched, an older job's lines without its records) two queries, count and page, over the
    job's lines."""
    bounds = JobLogLine.objects.filter(job_id=job.pk).aggregate(first=Min("seq"), last=Max("seq"))
    first, last = bounds["first"], bounds["last"]
    if not q and rank is None and (metrics or not training_job_has_metric_lines(job=job)):
        count = 0 if last is None else last - first + 1
        num_pages = max(1, math.ceil(count / per_page))
        number = num_pages if page is None else min(max(int(page), 1), num_pages)
        start = (first or 0) + (number - 1) * per_page
        rows = list(JobLogLine.objects.filter(job_id=job.pk, seq__gte=start, seq__lt=start + per_page)
                    .order_by("seq").values_list("seq", "text"))
        return LogPage(lines=rows, number=number, num_pages=num_pages, count=count, per_page=per_page)
    lines = training_job_log_lines(job=job, q=q, rank=rank, metrics=metrics)
    if (q or rank is not None) and last is not None and (before is not None or last - first + 1 > LOG_SEARCH_WINDOW):
        # The newest matches before ``before``, looking back at most a window: one query that stops
        # at a page of matches (a common term) or the window's first line (a rare one).
        high = last if before is None else max(min(last, int(before) - 1), first)
        low = max(first, high - LOG_SEARCH_WINDOW + 1)
        rows = list(lines.filter(seq__gte=low, seq__lte=high).order_by("-seq").values_list("seq", "text")[:per_page])
        rows.reverse()
        if len(rows) == per_page:  # the page is full: the next search goes on from its oldest line
            low = rows[0][0]
        return LogPage(lines=rows, number=1, num_pages=1, count=len(rows), per_page=per_page,
                       searched=(low, high), older=low if low > first else None)
    count = lines.count()
    num_pages = max(1, math.ceil(count / per_page))
    number = num_pages if page is None else min(max(int(page), 1), num_pages)
    start = (number - 1) * per_page
    rows = list(lines.values_list("seq", "text")[start:start + per_page])
    return LogPage(lines=rows, number=number, num_pages=num_pages, count=count, per_page=per_page)


def training_job_log_after(*, job: TrainingJob, after: int = -1, limit: int = LOG_PAGE_LINES, q: str = "",
                           rank: int | None = None, metrics: bool = False
                           ) -> tuple[list[tuple[int, str]], int, bool]:
    """Lines after cursor ``after`` (a ``seq``; -1 = from the start), at most ``limit``, as
    ``([(seq, text), ...], next, more)``: pass ``next`` as the next ``after``.

    Stable while the job still writes: the last stored ``seq`` is read first and only lines up to it
    are considered, so when fewer than ``limit`` match, ``next`` is that seq (every line up to it was
    looked at, matching or not, and a filtered reader does not scan them again); otherwise it is the
    last returned line's seq and ``more`` is True. A filter (``q``, ``rank``) looks at most
    :data:`LOG_SEARCH_WINDOW` lines after ``after``: ``next`` is then the last one looked at and
    ``more`` True while lines remain. Lines are stored in ``seq`` order by one sync at a time
    (jobs.sync), so none appears later below a cursor already handed out."""
    last = JobLogLine.objects.filter(job_id=job.pk).aggregate(m=Max("seq"))["m"]
    if last is None or last <= after:
        return [], max(after, -1), False
    high = last if not q and rank is None else min(last, max(after, -1) + LOG_SEARCH_WINDOW)
    rows = list(training_job_log_lines(job=job, q=q, rank=rank, metrics=metrics)
                .filter(seq__gt=after, seq__lte=high).values_list("seq", "text")[:limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (rows[-1][0] if more else high), more or high < last


def training_job_log_text(*, job: TrainingJob, chunk_lines: int = 2000) -> Iterable[str]:
    """The job's whole stored log as text, in pieces of ``chunk_lines`` lines (each line ending in a
    newline), read by ``seq`` ranges so a long log is never held whole. A newer job's metric records
    are not in it (they are its metric points; docs/experiments.md); an older job's stored records are."""
    after = -1
    while True:
        rows = list(JobLogLine.objects.filter(job_id=job.pk, seq__gt=after).order_by("seq")
                    .values_list("seq", "text")[:chunk_lines])
        if not rows:
            return
        yield "".join(f"{text}\n" for _, text in rows)
        after = rows[-1][0]


def training_job_events(*, job: TrainingJob) -> QuerySet[JobEvent]:
    """The job's timeline in order: its state transitions (the first, "Created", from a blank state)
    and its notes (:attr:`JobEvent.is_note`: a wait reason, a stall; blank ``to_state``)."""
    return JobEvent.objects.filter(job_id=job.pk).order_by("created_at", "id")


JOB_CODE_KINDS = {"builtin": "Built-in architecture", "code": "My model, Trainboard's trainer",
                  "script": "My training script"}


def training_job_code(*, job: TrainingJob) -> dict[str, Any]:
    """What code the job ran, from its frozen config and its recorded archive (not the model as it is
    now): ``{"kind": "builtin" | "code" | "script", "kind_label", "sha256": hex | "", "entry_point"
    ("package.module:function", kind code), "script" + "args" (kind script, as given) + "argv" (the
    arguments the script received: ``{train.lr}`` placeholders replaced by the job's values), "framework"
    (kind script: torch, tensorflow, ray or mpi; "" for the others), "requirements"
    (the archive's requirements.txt text), "architecture" (builtin)}``."""
    config = job.config or {}
    model, code = config.get("model") or {}, config.get("code") or {}
    kind = "script" if code.get("script") else "code" if model.get("arch") == CUSTOM else "builtin"
    archive = job.code if job.code_id else None
    return {
        "kind": kind,
        "kind_label": JOB_CODE_KINDS[kind],
        "sha256": archive.sha256 if archive else code.get("sha256", ""),
        "entry_point": model.get("entry_point", "") if kind == "code" else "",
        "script": code.get("script", ""),
        "args": list(code.get("args") or []),
        "argv": _script_argv(config),
        "framework": (code.get("framework") or "torch") if kind == "script" else "",
        "requirements": archive.requirements if archive else "",
        "architecture": model.get("arch", "") if kind == "builtin" else "",
    }


def _script_argv(config: dict[str, Any]) -> list[str]:
    """A job's script arguments as its launcher passes them (:func:`trainer_pkg.config.expand_script_args`);
    as stored when the config cannot be read that way (a config of an older trainer)."""
    args = list((config.get("code") or {}).get("args") or [])
    try:
        cfg = JobConfig.from_dict(config)
        return expand_script_args(cfg.code.args, script_hparams(cfg))
    except (ConfigError, KeyError, TypeError):
        return args


ProgressCursor = tuple[int, int]
"""Where :func:`training_job_progress` stopped: (last event id, last val_accuracy point id)."""


def training_job_progress(*, job: TrainingJob, after: ProgressCursor = (0, 0)
                          ) -> tuple[list[tuple[dt.datetime, str]], ProgressCursor]:
    """What happened to ``job`` since ``after`` ((0, 0): from its creation), for a terminal that
    follows it (``manage.py submit_job --wait``, ``manage.py demo``): ``([(when, text), ...], cursor)``
    with the cursor to pass next time.

    In the order to print: its transitions ("QUEUED" for its creation, then "PENDING → RUNNING"),
    read from its events, so two that one sync pass made between two calls are both there, and
    each epoch's global validation figures ("epoch 3 val_accuracy 0.9861, val_loss 0.0612", and a
    language model's ", val_perplexity 1.0631"), the
    two merged by time (the job's first move to RUNNING at its ``started_at`` when that is earlier than
    the sync that saw it); then a final state's transition, last. A sync stores a job's last metric points in the same transaction
    as its final state and they are read here after its events, so nothing of the job comes after
    its final state. ``when`` is the event's time, or the trainer's for a metric (UTC)."""
    after_event, after_metric = after
    events = list(JobEvent.objects.filter(job_id=job.pk, pk__gt=after_event).exclude(to_state="")
                  .order_by("created_at", "id"))
    points = list(MetricPoint.objects.filter(job_id=job.pk, name="val_accuracy", rank__isnull=True,
                                             pk__gt=after_metric).order_by("id"))
    # The cursor is the val_accuracy rows' id: an epoch series (a point per epoch) stays rows, as a sync
    # pass brings one point of it at a time and compaction seals only series of CHUNK_POINTS rows.
    beside: dict[str, dict[int, float | None]] = {"val_loss": {}, "val_perplexity": {}}  # a language model's too
    steps = {p.step for p in points}
    if steps:
        for (name, _), series in metric_store.points(job.pk, names=list(beside), per_rank=False,
                                                     start=min(steps), end=max(steps)).items():
            for step, value in zip(series.steps.tolist(), series.value_list()):
                if step in steps:
                    beside[name][step] = value

    # The job's first move to RUNNING is seen by a sync after the trainer has begun (often with its
    # first epochs in the same pass): it is placed at the platform's start time when that is earlier
    # (never before the transition ahead of it), and no epoch before it, whatever the trainer's clock
    # says: "PENDING → RUNNING" comes before the epochs (the new-user trial saw them after).
    first_running = next((e.pk for e in events if e.to_state == S.RUNNING), None)
    if first_running is not None and JobEvent.objects.filter(job_id=job.pk, to_state=S.RUNNING,
                                                             pk__lt=first_running).exists():
        first_running = None
    keys: dict[int, dt.datetime] = {}
    previous = None
    for event in events:
        when = event.created_at
        if event.pk == first_running and job.started_at is not None:
            when = max(min(when, job.started_at), previous or when)
        keys[event.pk] = previous = when
    running_since = keys.get(first_running) if first_running is not None else None

    def said(event: JobEvent) -> tuple[dt.datetime, str]:
        return keys[event.pk], (f"{event.from_state} → {event.to_state}" if event.from_state else event.to_state)

    lines = [said(e) for e in events if e.to_state not in TERMINAL_STATE_VALUES]
    for point in points:
        extra = "".join(f", {name} {by_step[point.step]:.4f}" for name, by_step in beside.items()
                        if by_step.get(point.step) is not None)
        when = max(point.recorded_at, running_since) if running_since is not None else point.recorded_at
        lines.append((when, f"epoch {point.epoch} val_accuracy {point.value:.4f}{extra}"))
    # A transition is seen by a sync after the epochs the trainer logged before it (a budget stop
    # after epoch 16): by time, not transitions first. Stable, so equal times keep events first.
    lines.sort(key=lambda line: line[0])
    lines += [said(e) for e in events if e.to_state in TERMINAL_STATE_VALUES]
    cursor = (max([after_event, *(e.pk for e in events)]), max([after_metric, *(p.pk for p in points)]))
    return lines, cursor


def training_job_interruption_count(*, job: TrainingJob) -> int:
    """How many times the provider interrupted the job (RUNNING → PENDING, :data:`INTERRUPTION`:
    a spot reclaim or a preemption, after which it restarted)."""
    from_state, to_state = INTERRUPTION
    return JobEvent.objects.filter(job_id=job.pk, from_state=from_state, to_state=to_state).count()


def training_job_attempts(*, job: TrainingJob) -> list[dict[str, Any]]:
    """The job's runs in order (docs/recovery.md): one dict per closed attempt (a lost run Trainboard
    resubmitted, its :class:`~jobs.models.JobAttempt` row) and, last, the current one (the job row):
    ``{"number", "provider_job_name", "started_at", "ended_at", "billable_seconds" (per instance),
    "cost_usd", "outcome" ("lost" | the current attempt's state), "reason", "checkpoint_uri",
    "current": bool}``. The current attempt's seconds and cost are the job's minus the closed ones'
    (the job's are their sum). A job never resubmitted has its one current attempt."""
    closed = list(JobAttempt.objects.filter(job_id=job.pk).order_by("number"))
    rows = [{"number": a.number, "provider_job_name": a.provider_job_name, "started_at": a.started_at,
             "ended_at": a.ended_at, "billable_seconds": a.billable_seconds, "cost_usd": a.cost_usd,
             "outcome": a.outcome, "reason": a.reason, "checkpoint_uri": a.checkpoint_uri, "current": False}
            for a in closed]
    closed_s = sum(a.billable_seconds for a in closed)
    closed_usd = sum((a.cost_usd for a in closed), Decimal("0"))
    rows.append({"number": job.attempt, "provider_job_name": job.provider_job_name, "started_at": job.started_at,
                 "ended_at": job.ended_at, "billable_seconds": max(job.billable_seconds - closed_s, 0.0),
                 "cost_usd": max(job.cost_usd - closed_usd, Decimal("0")), "outcome": str(job.state),
                 "reason": job.failure_reason if job.is_terminal else "", "checkpoint_uri": job.checkpoint_uri,
                 "current": True})
    return rows


def training_job_final_metrics(*, job: TrainingJob) -> dict[str, float | None]:
    """The last value of each global metric, e.g. ``{"val_accuracy": 0.97, ...}`` (None if absent)."""
    out: dict[str, float | None] = {}
    for name in ("val_accuracy", "val_loss", "train_loss", "train_accuracy"):
        point = metric_store.last(job.pk, name)  # the newest row or chunk, one query
        out[name] = None if point is None else point[1]
    return out


HEADLINE_TRAINER_METRICS = ("train_loss", "val_loss", "train_accuracy", "val_accuracy", "val_perplexity")
"""The trainer's metrics the job page's headline shows (those the job reported), in this order."""
HEADLINE_SCRIPT_METRICS = 6
"""A script's own metrics the headline shows at most (in name order)."""


def training_job_headline(*, job: TrainingJob) -> dict[str, Any]:
    """The job page's headline: where the run is and its latest values.

    ``{"metrics": [(name, value | None)], "step": int | None, "epoch": int | None (1-based, the epoch
    the last record is in), "epochs": int | None, "total_steps": int | None, "fraction": 0..1 | None,
    "total_estimated": bool, "eta_s": seconds | None, "script": bool}``.

    The values are :attr:`TrainingJob.final_metrics` (the last of each name, kept by the sync; no
    query). Progress reads at most two points, each the last of one name by the ``(job, name, step)``
    index, never the history: the trainer's last record (its ``lr``, in every record) gives the step
    and epoch; its last epoch record (``val_loss``) the steps an epoch takes, so ``total_steps`` is
    ``train.max_steps`` when set, else steps per epoch × ``train.epochs`` once an epoch has ended
    (``fraction`` before that: epochs finished ÷ epochs). A script's epochs are its own: only its
    step (its first reported name's last point) is shown, no fraction. ``eta_s``: the training time
    so far (start to the last record) × the part left ÷ the part done, while the job is active.

    Where the run reported its length (the trainer's ``total_steps``, a script's ``report.progress``),
    the job's stored progress (:attr:`TrainingJob.progress`, :mod:`jobs.progress`) stands instead: the
    exact total, its fraction, the time left from the recent step rate, and ``"projected_cost_usd"``
    (USD | None) with ``"progress_arithmetic"`` (text | "") beside the cost.

    A job flagged hung (``hung_at`` set while RUNNING, :mod:`jobs.hangs`) claims no time left:
    ``"hung_at"`` (datetime | None) is set, ``eta_s`` is None and ``projected_cost_usd`` is to the end
    of its max runtime (:func:`jobs.progress.job_progress`), which it bills until."""
    out = _with_stored_progress(job, _headline_from_points(job))
    out["hung_at"] = job.hung_at if job.state == S.RUNNING else None
    if out["hung_at"] is not None:
        out["eta_s"] = None
    return out


def _with_stored_progress(job: TrainingJob, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` (a headline) with the job's stored progress, when it has one (:func:`training_job_headline`)."""
    out.setdefault("projected_cost_usd", None)
    out.setdefault("progress_arithmetic", "")
    stored = job.progress
    if stored is None:
        return out
    out.update(step=stored.step, total_steps=stored.total_steps, total_estimated=False,
               fraction=1.0 if job.state == S.SUCCEEDED else stored.fraction,
               projected_cost_usd=stored.projected_cost_usd, progress_arithmetic=stored.arithmetic)
    if stored.eta_s is not None or job.is_terminal:
        out["eta_s"] = stored.eta_s
    return out


def _headline_from_points(job: TrainingJob) -> dict[str, Any]:
    """:func:`training_job_headline` from at most two metric points (its first paragraph)."""
    config = job.config if isinstance(job.config, dict) else {}
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    script = bool((config.get("code") or {}).get("script")) if isinstance(config.get("code"), dict) else False
    final = job.final_metrics if isinstance(job.final_metrics, dict) else {}
    if script:
        names = sorted(n for n in final if isinstance(n, str))[:HEADLINE_SCRIPT_METRICS]
    else:
        names = [n for n in HEADLINE_TRAINER_METRICS if n in final]
    out: dict[str, Any] = {"metrics": [(n, final[n]) for n in names], "step": None, "epoch": None,
                           "epochs": None, "total_steps": None, "fraction": None, "eta_s": None, "script": script,
                           "total_estimated": False}

    def last(name: str) -> dict[str, Any] | None:
        point = metric_store.last(job.pk, name)  # the newest row or chunk, one query
        return None if point is None else {"step": point[0], "epoch": point[2], "recorded_at": point[3]}

    point = last(names[0] if script and names else "lr") if (final or not script) else None
    if point is None:
        return out
    out["step"] = point["step"]
    if script:
        return out

    def whole(value: Any) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    epochs, max_steps = whole(train.get("epochs")), whole(train.get("max_steps"))
    out["epochs"] = epochs or None
    if point["epoch"] is not None:
        out["epoch"] = point["epoch"] + 1
    if max_steps:
        out["total_steps"] = max_steps
    elif epochs:
        ended = last("val_loss")
        if ended is not None and ended["epoch"] is not None and ended["step"] > 0:
            out["total_steps"] = round(ended["step"] / (ended["epoch"] + 1) * epochs)
            out["total_estimated"] = True
    if out["total_steps"]:
        out["fraction"] = min(point["step"] / out["total_steps"], 1.0)
    elif epochs and point["epoch"] is not None:
        out["fraction"] = min(point["epoch"] / epochs, 1.0)
    if job.state == S.SUCCEEDED:
        out["fraction"] = 1.0
    fraction = out["fraction"]
    if not job.is_terminal and job.started_at and fraction and 0 < fraction < 1:
        trained_s = (point["recorded_at"] - job.started_at).total_seconds()
        if trained_s > 0:
            out["eta_s"] = trained_s * (1 - fraction) / fraction
    return out


def backend_ids_with_active_jobs() -> list[int]:
    """Backends that have jobs a sync must look at (submitted, not yet terminal)."""
    return list(
        TrainingJob.objects.filter(state__in=ACTIVE_STATE_VALUES).exclude(state=S.QUEUED)
        .order_by().values_list("backend_id", flat=True).distinct()
    )


_MEMORY_TERMS = (("Parameters", "params_bytes"), ("Gradients", "grads_bytes"), ("Optimizer state", "optimizer_bytes"),
                 ("Activations", "activations_bytes"))


def training_job_price_note(*, job: TrainingJob) -> str:
    """What the job page adds about the job's hourly price when it is 0 and the backend says why
    (``Backend.price_note``: an own cluster's partition without an internal rate); "" otherwise, and
    when the backend's adapter cannot be built (its settings or SDK), since the note is a courtesy."""
    from cloud_adapters.base import BackendError
    from jobs import adapters

    if job.hourly_price_usd is None or job.hourly_price_usd != 0 or job.backend_id is None:
        return ""
    try:
        return adapters.backend_adapter(job.backend).price_note(job.instance_type or "")
    except (BackendError, ValueError, LookupError):
        return ""


def training_job_hang(*, job: TrainingJob) -> dict[str, Any] | None:
    """What the job page shows of a hung run (:mod:`jobs.hangs`), None when it is not flagged:
    ``{"at", "source", "step", "step_at", "deadline_s", "reason", "policy", "ranks": [{"rank", "where",
    "stack"}]}`` with ``at``/``step_at`` datetimes (UTC; ``step_at`` None when unknown) and ``stack`` the
    rank's threads as faulthandler prints them, main thread first, innermost frame first
    (``File "train.py", line 14 in <module>``). No query beyond the job's backend."""
    if job.hung_at is None:
        return None
    hang = job.hang if isinstance(job.hang, dict) else {}
    step_time = hang.get("step_time")
    step_at = (dt.datetime.fromtimestamp(step_time, dt.timezone.utc)
               if isinstance(step_time, (int, float)) and math.isfinite(step_time) and 0 < step_time < 253402300799
               else None)
    ranks = []
    for rank in hang.get("ranks") or []:
        lines = []
        for thread in rank.get("threads") or []:
            lines.append(f"{'Main thread' if thread.get('main') else 'Thread'} {thread.get('thread', '')}:")
            lines += [f'  File "{f.get("file")}", line {f.get("line")} in {f.get("function")}'
                      for f in thread.get("frames") or []]
        ranks.append({"rank": rank.get("rank"), "where": rank.get("where") or "", "stack": "\n".join(lines)})
    deadline = hang.get("deadline_s")
    return {"at": job.hung_at, "source": hang.get("source", ""), "step": hang.get("step"), "step_at": step_at,
            "deadline_s": deadline if isinstance(deadline, (int, float)) else None, "reason": hangs.hang_reason(hang),
            "policy": job.backend.hang_policy, "ranks": ranks}


def training_job_idle(*, job: TrainingJob) -> dict[str, Any] | None:
    """What the job page and the API show of the job's GPU idleness (:mod:`jobs.idle`); None when no
    sample with a GPU figure arrived (a CPU-only job, a node without NVML) and no policy acted:
    ``{"gpus": GPUs seen, "threshold_pct": %, "since": datetime (UTC) from which all were below or None,
    "idle_for_s": seconds idle as of the newest sample, "idle_s": seconds all were idle over the run,
    "waste_usd": Decimal, the cost of those seconds (idle_s × instances × hourly price / 3600),
    "gpu_idle_s": seconds single GPUs were below the threshold while another was not, summed over the GPUs,
    "gpu_waste_usd": Decimal, their cost (gpu_idle_s × hourly price / processes per node / 3600),
    "at": when the idle policy acted or None, "reason": its line or "", "saved_usd": Decimal or None}``.
    No query."""
    tracker = job.idle if isinstance(job.idle, dict) else {}
    gpus = idle.gpu_count(tracker)
    if not gpus and job.idle_at is None:
        return None
    idle_s = idle.tracker_idle_s(tracker)
    since = tracker.get("since")
    ok = isinstance(since, (int, float)) and not isinstance(since, bool) and 0 <= since < idle.MAX_TIME
    threshold = tracker.get("threshold_pct")
    return {"gpus": gpus, "threshold_pct": threshold if isinstance(threshold, int) else None,
            "since": idle.at_datetime(since) if ok else None, "idle_for_s": idle.idle_for_s(tracker),
            "idle_s": idle_s,
            "waste_usd": idle.waste_usd(idle_s=idle_s, instances=max(int(job.instance_count or job.nodes or 1), 1),
                                        hourly_price_usd=job.hourly_price_usd or 0),
            "gpu_idle_s": (alone := sum(idle.gpu_idle_s(tracker).values())),
            "gpu_waste_usd": idle.gpu_waste_usd(gpu_idle_s=alone, procs_per_node=job.procs_per_node,
                                                hourly_price_usd=job.hourly_price_usd or 0),
            "at": job.idle_at, "reason": job.idle_reason or "", "saved_usd": job.idle_saved_usd}


def training_job_waste(*, job: TrainingJob, idle_found: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The cost of waste of ``job``, three parts that never count a second twice: ``{"idle_s",
    "idle_usd"`` (every GPU idle: :func:`training_job_idle`), ``"gpu_idle_s", "gpu_usd"`` (single GPUs
    idle while others worked, each its share of its machine), ``"straggler_s", "straggler_usd"``
    (rank-seconds the ranks waited for the slowest to reach the gradient sync, the sum of the trainer's
    ``wait_for_slowest_s``, × the price per rank-second: hourly price / processes per node / 3600, as
    :func:`training_job_straggler` prices it), ``"total_usd"}``; the dollars are Decimals (4 places).
    None when the job has no GPU figure and no waiting measured. ``idle_found``: what
    :func:`training_job_idle` gave, when the caller has it. One query (the summary row of
    ``wait_for_slowest_s``)."""
    found = training_job_idle(job=job) if idle_found is None else idle_found
    waited = metric_buckets.summaries([job.pk], names=["wait_for_slowest_s"], per_rank=False)
    straggler_s = sum(agg.sum_value or 0.0 for agg in waited.values())
    if found is None and straggler_s <= 0:
        return None
    price = job.hourly_price_usd or Decimal(0)
    straggler_usd = idle.gpu_waste_usd(gpu_idle_s=straggler_s, procs_per_node=job.procs_per_node,
                                       hourly_price_usd=price)
    zero = Decimal("0.0000")
    out = {"idle_s": found["idle_s"] if found else 0.0, "idle_usd": found["waste_usd"] if found else zero,
           "gpu_idle_s": found["gpu_idle_s"] if found else 0.0, "gpu_usd": found["gpu_waste_usd"] if found else zero,
           "straggler_s": straggler_s, "straggler_usd": straggler_usd}
    out["total_usd"] = out["idle_usd"] + out["gpu_usd"] + straggler_usd
    return out


def training_job_preflight(*, job: TrainingJob) -> dict[str, Any] | None:
    """What the job page and the API show of the job's network preflight (:mod:`jobs.preflight`): the
    stored figures (``busbw_gbps``, ``algbw_gbps``, ``latency_us``, ``sizes``, ``pairs`` slowest first,
    the thresholds, ``ok``, ``reason`` …) with ``at`` (datetime, UTC, when it ran), each size's ``label``
    ("32 MiB") and ``summary`` (the timeline's line); None when no preflight ran. No query."""
    stored = job.preflight if isinstance(job.preflight, dict) else {}
    if not stored or not isinstance(stored.get("time"), (int, float)):
        return None
    sizes = [{**size, "label": f"{size['bytes'] >> 20} MiB" if size.get("bytes", 0) >= 1 << 20
              else f"{size.get('bytes')} B"} for size in stored.get("sizes") or [] if isinstance(size, dict)]
    return {**stored, "sizes": sizes, "at": dt.datetime.fromtimestamp(stored["time"], dt.timezone.utc),
            "summary": job_preflight.summary(stored)}


def training_job_memory(*, job: TrainingJob) -> dict[str, Any] | None:
    """The memory plan made at creation beside the trainer's last measurement, for the job page:
    ``{"summary", "lines", "rows": [{"label", "planned", "measured", "ratio"}], "busiest_rank",
    "device", "ranks": [{"rank", "peak"}], "cpu"}`` with byte figures as text ("1.2 GiB"; "–" when
    absent). The measured side is the busiest rank's (largest ``peak_bytes``). On CPU the trainer
    measures parameters, gradients, optimizer state and saved activations only, so the peak row
    compares those four terms (with ``parallel.cpu_offload`` the offloaded shards too: on CPU they are
    in the memory it measures); on a GPU the plan's whole peak (buffers too) against
    ``max_memory_allocated``. None when the job has neither a plan nor a measurement."""
    from trainer_pkg.memory_plan import gib

    plan = job.memory_plan if isinstance(job.memory_plan, dict) else None
    ranks = [r for r in job.rank_memory if isinstance(r, dict)] if isinstance(job.rank_memory, list) else []
    if plan is None and not ranks:
        return None
    busiest = max(range(len(ranks)), key=lambda i: ranks[i].get("peak_bytes") or 0) if ranks else None
    measured = ranks[busiest] if busiest is not None else {}
    cpu = measured.get("device") == "cpu"

    def planned_of(key: str) -> int | None:
        value = (plan or {}).get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def row(label: str, planned: int | None, got: Any) -> dict[str, Any]:
        got = got if isinstance(got, int) and not isinstance(got, bool) else None
        ratio = f"{planned / got:.2f}" if planned is not None and got else "–"
        return {"label": label, "planned": gib(planned) if planned is not None else "–",
                "measured": gib(got) if got is not None else "–", "ratio": ratio}

    offloaded = (plan or {}).get("offloaded") if cpu else None  # on CPU the host is the rank's memory:
    offloaded = offloaded if isinstance(offloaded, dict) else {}  # its shards count where it measures them

    def planned_term(key: str) -> int | None:
        value, moved = planned_of(key), offloaded.get(key)
        return value + moved if value is not None and isinstance(moved, int) and not isinstance(moved, bool) else value

    rows = [row(label + (" (offloaded to the host)" if offloaded.get(key) else ""), planned_term(key),
                measured.get(key)) for label, key in _MEMORY_TERMS]
    rows.append(row("Buffers (unsharded units, logits, the batch)", planned_of("buffers_bytes"), None))
    rows.append(row("Evaluation, instead of activations and buffers", planned_of("evaluation_bytes"), None))
    terms = [planned_term(key) for _, key in _MEMORY_TERMS]
    peak = sum(terms) if cpu and None not in terms else planned_of("peak_bytes")
    rows.append(row("Peak per rank" + (" (CPU: the four terms above)" if cpu else ""), peak, measured.get("peak_bytes")))
    return {"summary": (plan or {}).get("summary", ""), "lines": list((plan or {}).get("lines") or []),
            "rows": rows, "busiest_rank": busiest, "device": measured.get("device", ""), "cpu": cpu,
            "ranks": [{"rank": i, "peak": gib(r["peak_bytes"]) if isinstance(r.get("peak_bytes"), int) else "–"}
                      for i, r in enumerate(ranks)]}


# --- a backend's queue (the backend page) -----------------------------------------------------

"""The order QUEUED jobs start in: higher ``priority`` first, then submission order (jobs.admission)."""


@dataclasses.dataclass(frozen=True)
class DeviceUse:
    """The devices (GPU indices, or a CPU-only box's process slots) one active job holds."""

    devices: tuple[int, ...]  # its ``allocated_gpus``, ascending
    job_id: int | None  # the job, when the user may see it; None = a job of someone the user cannot see


@dataclasses.dataclass(frozen=True)
class BackendQueue:
    """What the backend page and ``GET /api/backends/{id}/queue/`` show of one backend."""

    queue: str  # the Celery queue its tasks go to (``gpubox.<name>`` for a GPU box)
    running: QuerySet[TrainingJob]  # the user's visible jobs in HOLDING_STATES, oldest start first
    waiting: QuerySet[TrainingJob]  # the user's visible QUEUED jobs, in the order they will start
    others_running: int  # jobs in HOLDING_STATES the user cannot see (counted, never shown)
    others_waiting: int  # QUEUED jobs the user cannot see
    devices_in_use: tuple[DeviceUse, ...]  # every active job's devices, lowest device first
    inventory: Inventory | None = None  # the devices the backend hands out, when the dashboard can know
    # them (:func:`_stated_inventory`); None = counted on the box itself
    allocates_devices: bool = True  # the backend gives each job its own devices and queues what does not fit
    # (a GPU box); False = it submits at once and the provider's scheduler queues (Slurm, Kubernetes, clouds)

    @property
    def devices_held(self) -> tuple[int, ...]:
        """Every device some active job holds, ascending."""
        return tuple(sorted({d for use in self.devices_in_use for d in use.devices}))

    @property
    def devices_free(self) -> tuple[int, ...] | None:
        """The inventory's devices no active job holds, ascending; None when the inventory is not known here."""
        if self.inventory is None:
            return None
        held = set(self.devices_held)
        return tuple(d for d in self.inventory.devices if d not in held)

    @property
    def device_kind(self) -> str | None:
        """"gpu" or "slot" (a box without GPUs counts process slots) when the dashboard knows the
        backend's inventory; None when the box counts its devices itself."""
        return self.inventory.kind if self.inventory is not None else None

    @property
    def device_word(self) -> str:
        """"GPU", "slot", or "device" (a GPU or a slot) when the box counts its devices itself."""
        return {"gpu": "GPU", "slot": "slot"}.get(self.device_kind or "", "device")


def _device_list(value: Any) -> tuple[int, ...]:
    """``allocated_gpus`` as sorted ints; anything that is not a list of ints counts as none."""
    if not isinstance(value, list):
        return ()
    return tuple(sorted({d for d in value if isinstance(d, int) and not isinstance(d, bool) and d >= 0}))


def _stated_inventory(backend: ComputeBackend) -> Inventory | None:
    """The devices ``backend`` hands out, when its own row names them: a GPU box whose ``gpu_ids``
    staff set on the backend (a host setting counts from the row only while its owner is staff).
    Every process then reads the same list, so the web can say which are free. Otherwise the box
    finds them itself (NVML, or the host settings of its worker's machine, which the web process may
    not share), and this is None rather than the web machine's own GPUs."""
    if not backend_allocates_devices(backend) or not (backend.config or {}).get("gpu_ids") \
            or not may_set_host_settings(backend.owner):
        return None
    try:
        return backend_adapter(backend).inventory()
    except (BackendError, LookupError, ValueError, TypeError):
        return None


def backend_queue_for_user(*, user, backend: ComputeBackend) -> BackendQueue:
    """The jobs of ``backend`` that are running and waiting, as ``user`` may see them.

    ``backend`` must come from :func:`backend_list_for_user` (a stranger's backend is a 404 before
    this). Jobs of the backend that ``user`` may not see (another user's, on a backend shared
    through a team) are counted, and their devices shown as taken, but nothing else of them: the
    free devices and a waiting job's place in line depend on them. Two queries, and the two
    querysets; the querysets are lazy, so the caller pages them."""
    jobs = TrainingJob.objects.filter(backend=backend)
    visible = _visible(user)
    running = jobs.filter(visible, state__in=HOLDING_STATES).order_by("submitted_at", "created_at", "id")
    waiting = jobs.filter(visible, state=S.QUEUED).order_by(*QUEUE_ORDER)
    queued = jobs.filter(state=S.QUEUED).aggregate(all=Count("id"), seen=Count("id", filter=visible))
    holding = list(jobs.filter(state__in=HOLDING_STATES)
                   .annotate(seen=Case(When(visible, then=Value(True)), default=Value(False)))
                   .values_list("id", "allocated_gpus", "seen"))
    uses = sorted((DeviceUse(devices=_device_list(allocated), job_id=job_id if seen else None)
                   for job_id, allocated, seen in holding if _device_list(allocated)),
                  key=lambda use: use.devices)
    return BackendQueue(
        queue=backend_queue(backend), running=running, waiting=waiting,
        others_running=sum(1 for _, _, seen in holding if not seen),
        others_waiting=queued["all"] - queued["seen"],
        devices_in_use=tuple(uses), inventory=_stated_inventory(backend),
        allocates_devices=backend_allocates_devices(backend),
    )


def training_job_lineage(*, job: TrainingJob, user) -> dict[str, Any]:
    """Where ``job`` came from and what was made from it, as ``user`` may see it (docs/clone-continue.md):
    ``{"text": "continued from #12 (checkpoint epoch 3)" | "fine-tuned from #12" | "cloned from #12" | "",
    "parent": {"id", "name"} | None (the job it was made from, when ``user`` sees it), "init_mode",
    "source_checkpoint_epoch", "derived": [{"id", "name", "state", "text"}, ...]}`` (the jobs made
    from it that ``user`` sees, oldest first)."""
    visible = TrainingJob.objects.filter(_visible(user))
    parent_id = job.source_job_id or job.cloned_from_id
    parent = visible.filter(pk=parent_id).only("id", "name").first() if parent_id else None
    derived = (visible.filter(Q(cloned_from=job) | Q(source_job=job))
               .only("id", "name", "state", "init_mode", "source_job_id", "cloned_from_id", "source_checkpoint_epoch")
               .order_by("created_at", "id"))
    return {
        "text": job.lineage_text,
        "parent": {"id": parent.pk, "name": str(parent)} if parent is not None else None,
        "init_mode": job.init_mode,
        "source_checkpoint_epoch": job.source_checkpoint_epoch,
        "derived": [{"id": d.pk, "name": str(d), "state": d.state, "text": d.lineage_text} for d in derived],
    }


def training_job_checkpoint_epoch(*, job: TrainingJob) -> int:
    """Finished epochs ``job``'s last checkpoint holds (0 when none): the ``epochs_done`` of the last
    ``epoch`` record the sync read (the trainer checkpoints right after each; an epoch that
    ``train.max_steps`` cut short is not finished, trainer_pkg/metrics.py). A continued job starts at
    that epoch (0-based) and shows it as "checkpoint epoch N". For a log of an older trainer, whose
    records lack it: one past the last epoch it validated (its global ``val_loss`` points)."""
    if job.checkpoint_epochs_done is not None:  # kept by the sync from the record (jobs.sync._ingest_lines)
        return job.checkpoint_epochs_done
    # A job logged when records were stored as log lines: its rows of them (a partial index, empty
    # for newer jobs, so a long log is not scanned).
    texts = (JobLogLine.objects.filter(job_id=job.pk, is_metric=True, text__contains='"event":"epoch"')
             .filter(text__contains='"epochs_done":').order_by("-seq").values_list("text", flat=True)[:1])
    for text in texts:
        done = (parse_metric_line(text) or {}).get("epochs_done")
        if isinstance(done, int) and not isinstance(done, bool) and done >= 0:
            return done
    # The newest val_loss point that has an epoch (epochs grow with steps), rows and chunks alike.
    last = next((epoch for _, _, epoch, _ in metric_store.backwards(job.pk, "val_loss") if epoch is not None), None)
    return 0 if last is None else int(last) + 1
def sweep_list_for_user(*, user, state: str | None = None) -> QuerySet[Sweep]:
    """The user's sweeps and their teams' sweeps, newest first; ``state`` one Sweep.State value."""
    qs = Sweep.objects.filter(_visible(user)).select_related("dataset", "model_spec", "backend", "owner")
    if state:
        qs = qs.filter(state=str(state).upper())
    return qs


# ---------------------------------------------------------------------------------------------
# Notifications and webhooks (docs/notifications.md)
# ---------------------------------------------------------------------------------------------


def webhook_list_for_user(*, user) -> QuerySet[Webhook]:
    """Webhooks ``user`` may see: their own, and those of their teams (a teammate reads, only the
    owner or staff change: :func:`can_change`)."""
    return Webhook.objects.filter(_visible(user)).select_related("team", "owner")


def webhook_deliveries(*, webhook: Webhook) -> QuerySet[WebhookDelivery]:
    """The delivery log of ``webhook``, newest first (each row's ``attempts``: at, status_code,
    error, duration_ms)."""
    return webhook.deliveries.order_by("-created_at", "-id")


def notification_preference_for_user(*, user) -> NotificationPreference:
    """``user``'s email choices; an unsaved row with none chosen when they never chose."""
    return NotificationPreference.objects.filter(user=user).first() or NotificationPreference(user=user)


# ---------------------------------------------------------------------------------------------
# /metrics (read at scrape time by webapp.metrics)
# ---------------------------------------------------------------------------------------------

SYNCED_STATES = (S.PENDING, S.RUNNING, S.STOPPING)
"""States whose jobs the sync follows (a job is lagging when its last sync is old)."""


@dataclasses.dataclass
class MetricsSnapshot:
    """What /metrics reports, read in a few queries.

    ``backends``: {backend id: (name, kind, Celery queue)}; ``jobs_by_state``: {(backend id, state):
    count}; ``cost_month_usd``: {backend id: USD of the jobs created this calendar month (UTC)};
    ``sync_lag_s``: {backend id: seconds since the least recently synced PENDING/RUNNING/STOPPING
    job's last sync (its state's start if never synced)}; ``submit_errors``: {backend id: jobs that
    failed while being submitted (JobEvents QUEUED/SUBMITTING → FAILED)}; ``counters``: {(name,
    backend id or None): value} of :class:`~jobs.models.OperationCount`; ``webhook_pending``:
    deliveries neither delivered nor given up; ``progress``: ``[(job id, backend id, Progress)]`` of
    the RUNNING jobs with a known length (:mod:`jobs.progress`), by job id; ``waste_month_usd``: {backend
    id: the cost of waste of the jobs created this calendar month (UTC), Σ idle seconds × instances ×
    hourly price / 3600 (:mod:`jobs.idle`), rounded to 4 decimals}, backends with none left out."""

    backends: dict[int, tuple[str, str, str]]
    jobs_by_state: dict[tuple[int, str], int]
    cost_month_usd: dict[int, Decimal]
    sync_lag_s: dict[int, float]
    submit_errors: dict[int, int]
    counters: dict[tuple[str, int | None], int]
    webhook_pending: int
    progress: list[tuple[int, int, job_progress.Progress]] = dataclasses.field(default_factory=list)
    waste_month_usd: dict[int, Decimal] = dataclasses.field(default_factory=dict)


def metrics_snapshot(*, now: dt.datetime | None = None) -> MetricsSnapshot:
    """Everything /metrics reports (:class:`MetricsSnapshot`), in a fixed number of queries (eight,
    plus what naming each backend's queue reads) whatever the number of jobs; the progress query
    reads the RUNNING jobs' progress columns (:data:`jobs.progress.READ_FIELDS`), no metric point."""
    now = now or timezone.now()
    backends = {}
    for backend in ComputeBackend.objects.only("pk", "name", "kind", "config"):
        try:
            queue = backend_queue(backend)
        except ValueError:
            queue = ""
        backends[backend.pk] = (backend.name, backend.kind, queue)
    jobs_by_state = {(row["backend_id"], row["state"]): row["n"] for row in
                     TrainingJob.objects.values("backend_id", "state").annotate(n=Count("id")).order_by()}
    cost, waste = {}, {}
    for row in (TrainingJob.objects.filter(created_at__gte=month_start(now)).values("backend_id")
                .annotate(usd=Sum("cost_usd"), waste=idle_waste_sum()).order_by()):
        cost[row["backend_id"]] = row["usd"] or Decimal("0")
        if row["waste"]:
            waste[row["backend_id"]] = (row["waste"] / 3600).quantize(CENT_FRACTION, rounding=ROUND_HALF_UP)
    lag = {}
    for row in (TrainingJob.objects.filter(state__in=SYNCED_STATES).values("backend_id")
                .annotate(oldest=Min(Coalesce("last_synced_at", "state_entered_at", "created_at"))).order_by()):
        lag[row["backend_id"]] = max(0.0, (now - row["oldest"]).total_seconds())
    submit_errors = {row["job__backend_id"]: row["n"] for row in
                     JobEvent.objects.filter(to_state=S.FAILED,
                                             from_state__in=(S.QUEUED, S.SUBMITTING))
                     .values("job__backend_id").annotate(n=Count("id")).order_by()}
    counters = {(row["name"], row["backend_id"]): row["value"] for row in
                OperationCount.objects.values("name", "backend_id", "value")}
    pending = WebhookDelivery.objects.filter(delivered_at__isnull=True, given_up_at__isnull=True).count()
    progress = []
    for job in (TrainingJob.objects.filter(state=S.RUNNING, progress_total_steps__isnull=False)
                .only("backend_id", *job_progress.READ_FIELDS).order_by("id")):
        stored = job_progress.job_progress(job, now)
        if stored is not None:
            progress.append((job.pk, job.backend_id, stored))
    return MetricsSnapshot(backends, jobs_by_state, cost, lag, submit_errors, counters, pending, progress, waste)


def idle_waste_sum() -> Sum:
    """The aggregate of the cost of waste over a query's jobs (:mod:`jobs.idle`), USD × 3600 (divide,
    then round): Σ tracker ``idle_s`` × instances × hourly price. Only trackers whose ``idle_s`` is a JSON
    number in (0, 10¹⁵) count (the sync writes no other; in jsonb's order strings sort below numbers,
    booleans, arrays and objects above them), the others are filtered out before the cast."""
    seconds = Cast(KT("idle__idle_s"), DecimalField(max_digits=30, decimal_places=6))
    return Sum(seconds * F("instance_count") * F("hourly_price_usd"),
               output_field=DecimalField(max_digits=40, decimal_places=10),
               filter=Q(idle__idle_s__gt=0, idle__idle_s__lt=10**15))
