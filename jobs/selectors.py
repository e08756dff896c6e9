"""Reads, always scoped to the requesting user (DESIGN.md §8).

Views fetch one object with ``get_object_or_404(<list queryset>, pk=pk)``, so another user's object
is a 404. The contract is docs/internal-api.md.

Visibility (issue 6): a user sees what they own and what is shared with a team they are a member
of (``team`` set on the object). Changing an object (edit, cancel, re-run, test connection) is for
its owner or staff only: :func:`can_change`; a teammate who may see it gets a 403 for those.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from django.db.models import CharField, Max, Q, QuerySet, Value

from jobs.models import (
    ACTIVE_STATE_VALUES,
    INTERRUPTION,
    ComputeBackend,
    Dataset,
    JobEvent,
    JobLogLine,
    JobStateChoices as S,
    MetricPoint,
    ModelSpec,
    Team,
    TrainingJob,
)
from trainer_pkg.metrics import METRIC_PREFIX


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
                               q: str | None = None) -> QuerySet[TrainingJob]:
    """The user's jobs and their teams' jobs, newest first.

    ``state``: one state value or several; ``backend``: a ComputeBackend, its pk or its name;
    ``q``: an id search (``7`` or ``#7``) matches the job of that id only; any other text matches the
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
        if job_id.isascii() and job_id.isdigit():
            qs = qs.filter(pk=int(job_id)) if len(job_id) <= 18 else qs.none()  # past bigint: no such id
        else:
            qs = qs.filter(Q(name__icontains=q) | Q(provider_job_name__iexact=q)
                           | _related_name_match(q, dataset="dataset_id", model_spec="model_spec_id",
                                                 backend="backend_id"))
    return qs


def _related_name_match(q: str, **columns: str) -> Q:
    """``dataset_id IN (…) | model_spec_id IN (…) | backend_id IN (…)`` for the datasets, models and
    backends whose name contains ``q`` (case-insensitive), found first in one small UNION query.

    Why not ``Q(dataset__name__icontains=q)``: that joins every job to its dataset, model and backend
    and tests each row; with literal id lists every arm of the search's OR is an indexed column of the
    job table (foreign keys; trigram indexes on name and provider job name, jobs/migrations/
    0004_scale_indexes.py), so a search reads the matching jobs only (issue 6, Scale).
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


def training_job_metric_series(*, job: TrainingJob) -> dict[str, list[dict[str, Any]]]:
    """Global series by name: ``{"val_accuracy": [{"step": 30, "epoch": 0, "value": 0.91}, ...]}``,
    each ordered by step."""
    series: dict[str, list[dict[str, Any]]] = {}
    rows = (MetricPoint.objects.filter(job_id=job.pk, rank__isnull=True)
            .order_by("name", "step", "id").values_list("name", "step", "epoch", "value"))
    for name, step, epoch, value in rows:
        series.setdefault(name, []).append({"step": step, "epoch": epoch, "value": value})
    return series


_RANK_FIELDS = {"rank_samples_per_s": "samples_per_s", "rank_step_time_s": "step_time_s",
                "rank_data_wait_s": "data_wait_s"}


def training_job_rank_throughput(*, job: TrainingJob) -> list[dict[str, Any]]:
    """Latest per-rank numbers, e.g. ``[{"rank": 0, "samples_per_s": 812.0, "step_time_s": 0.04,
    "data_wait_s": 0.002}, ...]`` (seconds per step computing; seconds per step waiting for data).

    Taken from the last step that reported per-rank values (None where a metric is missing).
    """
    per_rank = MetricPoint.objects.filter(job_id=job.pk, rank__isnull=False, name__in=tuple(_RANK_FIELDS))
    last_step = per_rank.aggregate(m=Max("step"))["m"]
    if last_step is None:
        return []
    out: dict[int, dict[str, Any]] = {}
    for rank, name, value in per_rank.filter(step=last_step).order_by("rank", "id").values_list("rank", "name", "value"):
        row = out.setdefault(rank, {"rank": rank, **dict.fromkeys(_RANK_FIELDS.values())})
        row[_RANK_FIELDS[name]] = value
    return [out[r] for r in sorted(out)]


def training_job_straggler(*, job: TrainingJob,
                           ranks: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The slowest rank by its latest step time and how far it trails the median of all ranks.

    ``{"rank": 1, "step_time_s": 0.012, "median_step_time_s": 0.0089, "behind_pct": 35.0,
    "data_wait_s": 0.001, "text": "rank 1 is the slowest: 0.012 s/step, 35% behind the median"}``;
    None with fewer than two ranks reporting a step time. Ties go to the lowest rank. ``ranks``:
    the rows of :func:`training_job_rank_throughput` when the caller has them already.
    """
    rows = training_job_rank_throughput(job=job) if ranks is None else ranks
    timed = [r for r in rows if r.get("step_time_s") is not None]
    if len(timed) < 2:
        return None
    median = statistics.median(r["step_time_s"] for r in timed)
    slowest = max(timed, key=lambda r: (r["step_time_s"], -r["rank"]))
    behind = (slowest["step_time_s"] / median - 1.0) * 100.0 if median > 0 else 0.0
    return {
        "rank": slowest["rank"],
        "step_time_s": slowest["step_time_s"],
        "median_step_time_s": median,
        "behind_pct": behind,
        "data_wait_s": slowest.get("data_wait_s"),
        "text": f"rank {slowest['rank']} is the slowest: {slowest['step_time_s']:.3g} s/step, "
                f"{behind:.0f}% behind the median",
    }


def training_job_log_tail(*, job: TrainingJob, lines: int = 200) -> list[str]:
    """The last ``lines`` log lines, oldest first, without the trainer's metric records (those are
    the charts; as raw JSON they would crowd out what a person reads a log for)."""
    lines = max(int(lines), 0)
    texts = list(JobLogLine.objects.filter(job_id=job.pk).exclude(text__contains=METRIC_PREFIX)
                 .order_by("-seq").values_list("text", flat=True)[:lines])
    texts.reverse()
    return texts


def training_job_events(*, job: TrainingJob) -> QuerySet[JobEvent]:
    """The job's state transitions in order."""
    return JobEvent.objects.filter(job_id=job.pk).order_by("created_at", "id")


def training_job_interruption_count(*, job: TrainingJob) -> int:
    """How many times the provider interrupted the job (RUNNING → PENDING, :data:`INTERRUPTION`:
    a spot reclaim or a preemption, after which it restarted)."""
    from_state, to_state = INTERRUPTION
    return JobEvent.objects.filter(job_id=job.pk, from_state=from_state, to_state=to_state).count()


def training_job_final_metrics(*, job: TrainingJob) -> dict[str, float | None]:
    """The last value of each global metric, e.g. ``{"val_accuracy": 0.97, ...}`` (None if absent)."""
    out: dict[str, float | None] = {}
    for name in ("val_accuracy", "val_loss", "train_loss", "train_accuracy"):
        point = (MetricPoint.objects.filter(job_id=job.pk, name=name, rank__isnull=True)
                 .order_by("-step", "-id").values_list("value", flat=True).first())
        out[name] = point
    return out


def backend_ids_with_active_jobs() -> list[int]:
    """Backends that have jobs a sync must look at (submitted, not yet terminal)."""
    return list(
        TrainingJob.objects.filter(state__in=ACTIVE_STATE_VALUES).exclude(state=S.QUEUED)
        .order_by().values_list("backend_id", flat=True).distinct()
    )
