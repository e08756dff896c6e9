"""The sync: one pass over a backend's active jobs (the body of ``jobs.tasks.sync_backend``, which
beat sends every ``TRAINBOARD_SYNC_INTERVAL_S``).

One ``describe_many`` for all of them; per job whose status changed or whose log this pass reads:
new log lines and metric points stored (:func:`metric_points_from_record`), then the provider state
applied through the state machine with times, billable seconds and cost recomputed absolutely
(never ``+=``); a job whose cost reached its budget is stopped. The jobs left out and not read are
written in one statement on PostgreSQL (:func:`_sync_unchanged`). Terminal states stop syncing, but
for the log: each pass reads a bounded part of a job's log (:data:`PASS_POINTS`, :data:`PASS_LINES`), so a
backlog of any size never holds the job's state back; a job the provider reports ended is shown in that state
in the pass that learns it, and the rest of its log is read by the next passes (``log_backlog``,
:func:`_read_ended_backlog`).

Transactions: no row lock is held across a provider call, so a provider that is slow or sleeps
through retry backoff never keeps a user's cancel, the recovery sweep or another pass waiting.

* ``describe_many``, ``logs`` and ``cancel`` run outside any transaction (a pass runs in autocommit,
  as the Celery task does; called inside an outer ``atomic()`` this cannot hold).
* Each write locks the job's row (``SELECT … FOR UPDATE SKIP LOCKED``: a row another transaction
  holds is left to the next pass), re-reads it and writes from what the row holds then: a job that
  ended meanwhile is not written, and a state another writer committed is moved on only by the
  state machine's legal moves (:mod:`jobs.states`), so a provider's stale RUNNING never undoes a
  user's STOPPING.
* Log lines are stored chunk by chunk, each only while the row's ``log_cursor`` is still the one
  its ``logs`` call was made from; two passes reading one log at once store it once.
* A budget stop is committed (STOPPING, ``budget_exceeded_at``) before its ``cancel`` is sent; a
  cancel that fails is sent again by the next pass, as for every STOPPING job.
* The one statement for the unchanged jobs locks their rows for that statement only.

The worker side: nothing here is called from a request.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from math import isfinite
from typing import Any, Callable, Mapping

from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.db.models import Max, Q
from django.utils import timezone

from cloud_adapters import torchrun_log
from cloud_adapters.base import PAUSED, Backend, BackendError, JobHandle, JobState, JobStatus
from cloud_adapters.redaction import job_secret_redactor
from jobs import admission, hangs, idle, metric_buckets, metric_store, notifications, preflight, progress, restarts
from jobs import cost as costs
from jobs.adapters import backend_adapter
from jobs.metric_fold import ACROSS_RANKS, across_ranks_name, is_across_ranks
from jobs.models import (
    ACTIVE_STATE_VALUES,
    INTERRUPTION,
    TERMINAL_STATE_VALUES,
    ComputeBackend,
    JobAttempt,
    JobLogLine,
    JobStateChoices as S,
    MetricPoint,
    TrainingJob,
)
from jobs.services import training_job_cancel
from jobs.states import is_allowed, note, transition
from trainer_pkg import hardware
from trainer_pkg.metrics import (
    GLOBAL_METRICS,
    MAX_USER_METRICS,
    RECORD_FIELDS,
    USER_METRIC_NAME,
    parse_metric_line,
)

log = logging.getLogger(__name__)

_RANK_METRICS = ("rank_samples_per_s", "rank_step_time_s", "rank_data_wait_s", "rank_compute_s",
                 "rank_sync_wait_s", "rank_pipeline_stage", "rank_stage_layers")
_ACROSS_METRICS = _RANK_METRICS[:5]
"""The per-rank series that also get their min, median and max across ranks stored, step by step
(``metric_fold.ACROSS_RANKS``); the stage fields are constants, not measurements."""
_METRIC_EVENTS = {"step", "epoch", "failed"}
_MAX_LOG_CALLS = 200  # per job per sync; keeps one task short when a job has a huge backlog
PASS_POINTS = 200_000
"""Metric points one pass stores for one job at most (it stops after the ``logs`` call that reaches them):
about a second of the sync's ingestion (issue 29: ≥ 200,000 points/s), so a backlog of any size never keeps
a job's state waiting longer than that; the rest is read by the next passes (:func:`_drain_logs`)."""
PASS_LINES = 20_000
"""Log lines one pass stores for one job at most (the same bound for a log of plain lines)."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def _when(record: Mapping[str, Any], default: dt.datetime) -> dt.datetime:
    t = _number(record.get("time"))
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc) if t is not None else default


def metric_points_from_record(job: TrainingJob, record: Mapping[str, Any], now: dt.datetime) -> list[MetricPoint]:
    """MetricPoint rows for one trainer record: :func:`metric_point_tuples` as model objects."""
    return [MetricPoint(job=job, name=name, step=step, epoch=epoch, rank=rank, value=value, recorded_at=at)
            for name, rank, step, value, epoch, at in metric_point_tuples(record, now)]


def metric_point_tuples(record: Mapping[str, Any], now: dt.datetime) -> list[metric_store.Point]:
    """The points of one trainer record (schema: trainer_pkg/metrics.py) as ``(name, rank or None,
    step, value or None, epoch or None, recorded_at)`` tuples, in the order the record lists them
    (what :func:`jobs.metric_store.store` takes; no model object per point).

    Global values become rows with ``rank`` NULL; ``rank_*`` lists one row per rank. Only ``step``,
    ``epoch`` and ``failed`` records carry series (``started``/``completed`` mark times and would
    duplicate). A value the trainer reported as non-finite (named in the record's ``nonfinite``, or
    a NaN/Infinity literal from an older trainer) becomes a row with ``value`` None: the chart's gap.

    A user script's record (``trainer_pkg.report.log``) names its own scalars in ``user_metrics``:
    each becomes a global row under that name, once (a name that is also a built-in one is stored as
    the built-in). A name that does not match ``USER_METRIC_NAME`` or is a field of the record itself
    is skipped, and a list longer than ``MAX_USER_METRICS`` is ignored: a log line is never a reason
    to fail a sync.
    """
    if record.get("event") == hardware.EVENT:
        return hardware_point_tuples(record, now)
    if record.get("event") not in _METRIC_EVENTS:
        return []
    step = record.get("step")
    step = int(step) if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0
    epoch = record.get("epoch")
    epoch = int(epoch) if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else None
    at = _when(record, now)
    flagged = record.get("nonfinite")
    flagged = {n for n in flagged if isinstance(n, str)} if isinstance(flagged, list) else set()
    points: list[metric_store.Point] = []

    def add(name: str, raw: Any, rank: int | None) -> None:
        value = _number(raw)
        nonfinite = (raw is None and name in flagged) or (isinstance(raw, float) and value is None)
        if value is not None or nonfinite:
            points.append((name, rank, step, value, epoch, at))

    for name in GLOBAL_METRICS:
        add(name, record.get(name), None)
    for name in _user_metric_names(record):
        add(name, record.get(name), None)
    bad_step = record.get("nonfinite_step")
    if (record.get("event") == "failed" and isinstance(bad_step, int) and not isinstance(bad_step, bool)
            and 0 <= bad_step < step):
        # A diverged run's first non-finite loss, steps before the failed record: the chart marks
        # the step the reason names ("loss became NaN at step 2"), not only where the run stopped.
        points.append(("train_loss", None, bad_step, None, epoch, at))
    for name in _RANK_METRICS:
        values = record.get(name)
        if isinstance(values, list):
            for rank, raw in enumerate(values):
                if type(raw) is float and isfinite(raw):  # the common case, without add()'s checks
                    points.append((name, rank, step, raw, epoch, at))
                else:
                    add(name, raw, rank)
            if name in _ACROSS_METRICS and len(values) > 1:
                points.extend((across_ranks_name(name, stat), None, step, value, epoch, at)
                              for stat, value in _across_ranks(values).items())
    return points


MAX_HARDWARE_INDEX = 1 << 20
"""Largest rank or node index a hardware record may name (a larger one is not a launcher's: skipped)."""


def _indices(value: Any) -> list[int] | None:
    """A record's ``ranks``/``gpu_ranks``: a list of distinct ints in 0..MAX_HARDWARE_INDEX, else None."""
    if not isinstance(value, list) or len(value) > hardware.MAX_RANKS:
        return None
    if not all(type(i) is int and 0 <= i <= MAX_HARDWARE_INDEX for i in value) or len(set(value)) != len(value):
        return None
    return value


def hardware_point_tuples(record: Mapping[str, Any], now: dt.datetime) -> list[metric_store.Point]:
    """The points of one launcher ``hardware`` record (schema: :mod:`trainer_pkg.hardware`):
    ``sys/cpu_pct`` and ``sys/rss_mb`` at each of ``ranks``, the ``sys/gpu_*`` figures at each of
    ``gpu_ranks``, the node's ``sys/net_*``/``sys/disk_*`` rates at ``node_rank`` (the ``rank``
    column holds the node's index for those). Their step is the sample's time in whole Unix
    seconds, not a training step: the launcher samples by the clock, and a script may report no
    step at all (the job page charts these series by time; a resumed run's cut of superseded
    steps leaves them alone). A ``None`` value (a figure the sample could not take) is no point; a
    malformed field is skipped, never a reason to fail a sync."""
    t = _number(record.get("time"))
    if t is None or t < 0:
        return []
    step, at = int(t), dt.datetime.fromtimestamp(t, tz=dt.timezone.utc)
    points: list[metric_store.Point] = []

    def add(names: tuple[str, ...], indices: Any) -> None:
        indices = _indices(indices)
        if indices is None:
            return
        for name in names:
            values = record.get(name)
            if not isinstance(values, list) or len(values) != len(indices):
                continue
            for index, raw in zip(indices, values):
                value = _number(raw)
                if value is not None:
                    points.append((name, index, step, value, None, at))

    add(hardware.RANK_FIELDS, record.get("ranks"))
    add(hardware.GPU_FIELDS, record.get("gpu_ranks"))
    node = record.get("node_rank")
    if type(node) is int and 0 <= node <= MAX_HARDWARE_INDEX:
        for name in hardware.NODE_FIELDS:
            value = _number(record.get(name))
            if value is not None:
                points.append((name, node, step, value, None, at))
    return points


def _across_ranks(values: list[Any]) -> dict[str, float | None]:
    """``{"min", "median", "max"}`` of one record's per-rank list (``metric_fold.ACROSS_RANKS``) over
    its finite numbers (the median of an even count is the mean of the middle two); None each when
    no rank's value is finite (the chart's gap)."""
    finite = sorted(v for v in map(_number, values) if v is not None)
    if not finite:
        return dict.fromkeys(ACROSS_RANKS)
    middle = len(finite) // 2
    median = finite[middle] if len(finite) % 2 else (finite[middle - 1] + finite[middle]) / 2
    return {"min": finite[0], "median": median, "max": finite[-1]}


RANK_MEMORY_FIELDS = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
MAX_RANK_MEMORY = 4096
"""Most ranks of a ``rank_memory`` list kept (a longer one is not a trainer's: ignored)."""


def rank_memory_from_record(record: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The measured memory per rank an ``epoch`` or ``completed`` record carries (``rank_memory``: a
    list indexed by rank of byte counts and the device, trainer_pkg's contract), each rank's entry
    reduced to :data:`RANK_MEMORY_FIELDS` as whole numbers ≥ 0 (others dropped, a missing one
    None) and ``device`` ("cuda" | "cpu" | ""); None when the record has none or it is malformed.
    A log line is never a reason to fail a sync."""
    if record.get("event") not in ("epoch", "completed"):
        return None
    ranks = record.get("rank_memory")
    if not isinstance(ranks, list) or not ranks or len(ranks) > MAX_RANK_MEMORY:
        return None
    out = []
    for entry in ranks:
        if not isinstance(entry, Mapping):
            return None
        kept: dict[str, Any] = {}
        for field in RANK_MEMORY_FIELDS:
            value = entry.get(field)
            ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
            kept[field] = value if ok else None
        device = entry.get("device")
        kept["device"] = device if device in ("cuda", "cpu") else ""
        out.append(kept)
    return out


def _user_metric_names(record: Mapping[str, Any]) -> list[str]:
    """The record's well-formed ``user_metrics`` names, each once, built-in ones left out (stored
    already), and none under the launcher's reserved ``sys/`` (:data:`trainer_pkg.metrics.HARDWARE_PREFIX`)."""
    names = record.get("user_metrics")
    if not isinstance(names, list) or len(names) > MAX_USER_METRICS:
        return []
    out: list[str] = []
    for name in names:
        if (isinstance(name, str) and USER_METRIC_NAME.fullmatch(name) and name not in RECORD_FIELDS
                and name not in GLOBAL_METRICS and not name.startswith(hardware.PREFIX) and name not in out):
            out.append(name)
    return out


def _trainer_failure_reason(job: TrainingJob) -> str | None:
    """The reason the trainer gave when it stopped the run itself (its ``failed`` record, e.g. "loss
    became NaN at step 12"): what the sync kept from the record (:func:`_ingest_lines`), else, for a
    job logged when records were stored as log lines, its last stored ``failed`` record; None when it
    gave none. The second read goes through the partial index of those rows (empty for newer jobs)."""
    kept = TrainingJob.objects.filter(pk=job.pk).values_list("trainer_failure_reason", flat=True).first()
    if kept:
        return kept
    texts = (JobLogLine.objects.filter(job_id=job.pk, is_metric=True)
             .filter(text__contains='"event":"failed"').order_by("-seq").values_list("text", flat=True)[:1])
    for text in texts:
        reason = _record_reason(parse_metric_line(text) or {})
        if reason:
            return reason
    return None


def _record_reason(record: Mapping[str, Any]) -> str:
    """A ``failed`` record's ``reason``, stripped, at most 500 characters; "" when it has none."""
    reason = record.get("reason")
    return reason.strip()[:500] if isinstance(reason, str) else ""


USER_ERROR_LINES = 400
"""How many of a failed job's last stored log lines :func:`_user_code_failure` reads."""


def _says_already(reason: str, trainer_reason: str) -> bool:
    """Whether the backend's ``reason`` already says what ``trainer_reason`` does: the same text, or
    (a custom model's ``trainer error: ... raised ValueError at net.py:12: ...``) the same place and
    message in its own words, so the reason does not say it twice."""
    if trainer_reason in reason:
        return True
    first = trainer_reason.partition("\n")[0]
    where, _, error = first.partition(": ")  # "net.py:12 in build", "ValueError: bad shape"
    message = error.partition(": ")[2] or error
    return bool(where and message) and where.split(" in ")[0] in reason and message in reason


def _with_trainer_reason(job: TrainingJob, reason: str) -> str:
    """A FAILED job's ``reason`` (the backend's) led by the trainer's own from the stored log (its
    ``failed`` record, else the user's code's traceback), unless the reason says it already."""
    trainer_reason = _trainer_failure_reason(job) or _user_code_failure(job)
    if trainer_reason and not _says_already(reason, trainer_reason):
        first, _, source = trainer_reason.partition("\n")  # a user-code error's source line stays last
        reason = f"{first} (the backend reported: {reason})" + (f"\n{source}" if source else "")
    return reason


def _user_code_failure(job: TrainingJob) -> str:
    """Where the user's code failed, from the end of the job's stored log (``train.py:3: SyntaxError:
    invalid syntax`` and the source line: :func:`cloud_adapters.torchrun_log.user_code_error`); "" when
    the log shows no traceback through the user's files. Read once, when the job is FAILED."""
    texts = list(JobLogLine.objects.filter(job_id=job.pk, is_metric=False)
                 .order_by("-seq").values_list("text", flat=True)[:USER_ERROR_LINES])
    texts.reverse()
    return torchrun_log.user_code_error(texts)[:1000]


TRAINING_EVENTS = frozenset({"started", "step", "epoch"})
"""Trainer records that only a run which is training writes (trainer_pkg/train.py, and
``trainer_pkg.report`` for a user's script): once one is stored, the job is RUNNING whatever the
provider's status says (:func:`_write_status`)."""


def _ingest_lines(job: TrainingJob, lines: list[str], next_seq: int, now: dt.datetime,
                  mask: Callable[[str], str]) -> tuple[int, dt.datetime | None, list[dict[str, Any]] | None,
                                                       dt.datetime | None, int]:
    """Store log lines from ``next_seq`` on and their metric records; returns (next seq, first step
    time, the last ``rank_memory`` of the lines' epoch/completed records or None, the time of the
    lines' last :data:`TRAINING_EVENTS` record or None, the metric points stored). The job's final metrics
    and its progress columns (:func:`jobs.progress.progress_after`) are written too, when they change.

    A line that carries a trainer record is stored once, as the record's metric points: it is not a
    log line and takes no ``seq`` (:class:`~jobs.models.JobLogLine`). What later reads need from the
    rare records goes on the job: a ``failed`` record's reason (``trainer_failure_reason``), an
    ``epoch`` record's ``epochs_done`` (``checkpoint_epochs_done``) and the launcher's ``preflight``
    record (``preflight``, :mod:`jobs.preflight`; a note on the timeline, and its reason, when it stopped
    the run, as ``trainer_failure_reason``).
    Each line passes through ``mask`` first (the backend's job-secret values become ``***``), so no
    stored line holds one."""
    log_rows, points, first_step, rank_memory, trained_at, records = [], [], None, None, None, []
    changed: dict[str, Any] = {}
    for line in lines:
        text = mask(str(line).replace("\x00", ""))  # PostgreSQL text cannot hold NUL
        record = parse_metric_line(text)
        if record is None:
            log_rows.append(JobLogLine(job=job, seq=next_seq, text=text))
            next_seq += 1
            continue
        records.append(record)
        event = record.get("event")
        if event == "started" and first_step is None:
            first_step = _when(record, now)
        if event in TRAINING_EVENTS:
            trained_at = _when(record, now)
        if event == "started" and record.get("resumed") is True:
            _drop_superseded_points(job, record)
        if event == "failed" and _record_reason(record):
            changed["trainer_failure_reason"] = _record_reason(record)
        if event == preflight.EVENT and (figures := preflight.from_record(record)) is not None:
            # The network check before the first step; a failed one is why the run ends (FAILED).
            changed["preflight"] = figures
            if figures["reason"]:
                changed["trainer_failure_reason"] = figures["reason"][:1000]
        done = record.get("epochs_done")
        if event == "epoch" and isinstance(done, int) and not isinstance(done, bool) and 0 <= done < 2**31:
            changed["checkpoint_epochs_done"] = done
        points.extend(metric_point_tuples(record, now))
        rank_memory = rank_memory_from_record(record) or rank_memory
    JobLogLine.objects.bulk_create(log_rows)
    # Rows, or chunks for a backlog, and their buckets (jobs.metric_store, jobs.metric_buckets).
    metric_store.store(job.pk, points)
    latest = final_metrics_after(job.final_metrics, points)
    if latest != job.final_metrics:
        changed["final_metrics"] = latest
    # % done, step rate and what projects the time left and the final cost (jobs.progress): from
    # these lines' records and the row's own columns, no metric point read.
    current = {field: getattr(job, field) for field in progress.PROGRESS_FIELDS}
    after = progress.progress_after(current, records)
    changed.update({field: value for field, value in after.items() if value != current[field]})
    # A hang the launcher reported (its records, each rank's stacks), or a newer step that clears one.
    was_hung = job.hung_at
    hung_at, hang = hangs.hang_after(job.hung_at, job.hang, records)
    if (hung_at, hang) != (job.hung_at, job.hang):
        changed.update(hung_at=hung_at, hang=hang)
    # Idle GPUs (jobs.idle): the launcher's samples folded into the job's tracker, and its backend's idle policy.
    was_idle = job.idle_at
    if any(record.get("event") == idle.EVENT for record in records):
        changed.update(_idle_fields(job, records))
    if changed:
        TrainingJob.objects.filter(pk=job.pk).update(**changed)
        for field, value in changed.items():
            setattr(job, field, value)
    if "preflight" in changed:
        note(job.pk, job.state, preflight.summary(job.preflight)[:2000])
    if job.hung_at is not None and job.hung_at != was_hung:
        hung(job)
    if job.idle_at is not None and job.idle_at != was_idle:
        idled(job)
    return next_seq, first_step, rank_memory, trained_at, len(points)


def _idle_fields(job: TrainingJob, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's idle columns after ``records`` (:func:`jobs.idle.idle_after` at its backend's
    ``idle_gpu_util_pct``), those that change: while the job runs (PENDING or RUNNING), a busy sample
    clears a finding (a later idle period is told again), and under an ``idle_policy`` other than
    ``off`` every GPU idle for the backend's ``idle_minutes`` sets ``idle_at`` (the newest sample's
    time), ``idle_reason`` and ``idle_saved_usd`` (:func:`jobs.idle.saving` from that moment), once per
    idle period. A job without GPU figures never is."""
    backend = job.backend
    threshold = backend.idle_gpu_util_pct
    tracker = idle.idle_after(job.idle, records, threshold)
    out: dict[str, Any] = {"idle": tracker} if tracker != job.idle else {}
    if job.state not in (S.PENDING, S.RUNNING):
        return out
    if tracker["since"] is None:
        if job.idle_at is not None:
            out.update(idle_at=None, idle_reason="", idle_saved_usd=None)
        return out
    if (backend.idle_policy == ComputeBackend.IdlePolicy.OFF or job.idle_at is not None
            or idle.idle_for_s(tracker) < backend.idle_minutes * 60):
        return out
    found_at = idle.at_datetime(tracker["last"])
    saved, arithmetic = idle.saving(job, found_at)
    stop = backend.idle_policy == ComputeBackend.IdlePolicy.STOP
    out.update(idle_at=found_at, idle_saved_usd=saved,
               idle_reason=idle.reason(tracker, threshold, saved, arithmetic, stop=stop)[:2000])
    return out


def idled(job: TrainingJob) -> None:
    """After ``job`` was found idle under its backend's idle policy (its ``idle_*`` columns just
    written, its row locked by the caller): a note on its timeline with the reason, the ``job.idle``
    notification (webhook and email, after commit) and, under ``stop``, the cancel (STOPPING with
    "Stopped: " and the reason; the provider's cancel sent after commit, and the trainer checkpoints
    on the SIGTERM it brings)."""
    note(job.pk, job.state, job.idle_reason)
    log.warning("job %s idle: %s", job.pk, job.idle_reason)
    notifications.job_idle(job=job, reason=job.idle_reason)  # rows in this transaction, sent after commit
    if job.state in (S.PENDING, S.RUNNING) and job.backend.idle_policy == ComputeBackend.IdlePolicy.STOP:
        training_job_cancel(job=job, reason=f"Stopped: {job.idle_reason}"[:2000])


def hung(job: TrainingJob) -> None:
    """After ``job`` was flagged hung (its ``hang`` just written, its row locked by the caller): a note
    on its timeline with :func:`jobs.hangs.hang_reason`, and the cancel its backend's ``hang_policy``
    asks for (``cancel``: STOPPING, the provider's cancel sent after commit; ``restart``: the same stop with
    ``hang_restart_at``, and the job restarted from its checkpoint once the stop is confirmed, while the
    backend's ``max_restarts`` allow, else a cancel) while it runs (RUNNING, or still PENDING when this
    pass read its first step and the hang together: the status is written next)."""
    reason = hangs.hang_reason(job.hang)
    note(job.pk, job.state, f"Hung: {reason}"[:2000])
    log.warning("job %s hung: %s", job.pk, reason)
    notifications.job_hung(job=job, reason=reason)  # rows in this transaction, sent after commit
    if job.state not in (S.PENDING, S.RUNNING):
        return
    policy = job.backend.hang_policy
    if policy == ComputeBackend.HangPolicy.RESTART and restarts.restart_left(job):
        restarts.stop_hung(job, reason)  # the confirmed stop restarts it (_write_status → restarts.hung_run)
    elif policy == ComputeBackend.HangPolicy.RESTART:
        limit = job.backend.max_restarts
        training_job_cancel(job=job, reason=f"Cancelled: hung; max restarts {limit} reached. {reason}"[:2000])
    elif policy == ComputeBackend.HangPolicy.CANCEL:
        training_job_cancel(job=job, reason=f"Cancelled: hung. {reason}"[:2000])


def _drop_superseded_points(job: TrainingJob, record: Mapping[str, Any]) -> None:
    """A run resumed from a checkpoint (its ``started`` record says ``resumed``) redoes the steps
    after it: the points a lost attempt stored from that step on (:mod:`jobs.restarts`) are work
    the model no longer holds, so they are deleted before the resumed run's own arrive. Each step
    and epoch of the job's series is then stored once, and its steps continue from the checkpoint."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        return
    metric_buckets.drop_from(job.pk, step)  # the points, rows and chunks, and their buckets


def final_metrics_after(final: Mapping[str, Any] | None,
                        points: list[MetricPoint] | list[metric_store.Point]) -> dict[str, float | None]:
    """``final`` (a job's :attr:`~jobs.models.TrainingJob.final_metrics`) updated with the global
    ``points`` just stored (MetricPoint objects or :data:`jobs.metric_store.Point` tuples), in the
    order they were logged: each name's value becomes its last one (None where it was not finite).
    Per-rank points, and their statistics across ranks, are not final metrics."""
    out = dict(final or {})
    for point in points:
        if isinstance(point, tuple):
            if point[1] is None and not is_across_ranks(point[0]):
                out[point[0]] = point[3]
        elif point.rank is None and not is_across_ranks(point.name):
            out[point.name] = point.value
    return out


STATUS_LOCK_WAIT_MS = 5000
"""How long a pass waits for a job's row before it writes the job's status (PostgreSQL ``lock_timeout``,
milliseconds): the row's other holders make no provider call while they hold it, so the wait is
database work (another pass's chunk of log lines, a cancel). Past it the status is left to the next pass."""


def _locked(job_id: int, *, ended_backlog: bool = False, wait: bool = False) -> TrainingJob | None:
    """The job's row, locked until the caller's transaction ends, while it is active and no other
    transaction holds it (``SKIP LOCKED``: a pass never waits behind another writer); else None. The
    lock is ``FOR NO KEY UPDATE`` (PostgreSQL): it excludes another pass and every writer of the row,
    but not a transaction that only adds a row pointing at the job (a JobEvent's foreign key check
    takes ``FOR KEY SHARE``), which would otherwise make a pass skip the job.
    ``ended_backlog``: also a job that ended with its log not read to its end (``log_backlog``), whose
    log the sync goes on reading. ``wait``: wait up to :data:`STATUS_LOCK_WAIT_MS` for a row another
    transaction holds, instead of skipping it (a pass's log chunk and status writes: two passes at once
    must not both drop a job's status, one because the other held the row for a moment to find that its
    log cursor had moved).
    Call inside ``transaction.atomic()``, and make no provider call until it ends."""
    reading = Q(state__in=ACTIVE_STATE_VALUES) | Q(log_backlog=True) if ended_backlog else Q(state__in=ACTIVE_STATE_VALUES)
    if not wait or connection.vendor != "postgresql":
        return TrainingJob.objects.select_for_update(skip_locked=not wait, no_key=True).filter(reading, pk=job_id).first()
    try:
        # A savepoint: a lock timeout rolls back to it (the SET LOCAL too), the caller's transaction usable.
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = {int(STATUS_LOCK_WAIT_MS)}")
            row = TrainingJob.objects.select_for_update(no_key=True).filter(reading, pk=job_id).first()
            cursor.execute("SET LOCAL lock_timeout = DEFAULT")
            return row
    except OperationalError:  # lock_timeout: left to the next pass
        return None


class _RowMovedOn(Exception):
    """The job's row changed while this pass waited for the provider (another pass stored the same
    log lines, the job ended, or another transaction holds the row): what this pass read for the
    job is dropped, and the next pass reads it again."""


def _drain_logs(adapter: Backend, job: TrainingJob, handle: JobHandle, now: dt.datetime,
                mask: Callable[[str], str], *, ended: bool = False) -> tuple[bool, dt.datetime | None]:
    """Read ``logs(handle, cursor)`` from the job's stored cursor until empty, storing each chunk as
    it comes; returns (drained, trained_at): drained is True when the log was read to its end (False:
    a backlog remains: this pass stored :data:`PASS_POINTS` points or :data:`PASS_LINES` lines, or made
    :data:`_MAX_LOG_CALLS` calls, and the next pass goes on from the stored cursor); trained_at is the
    trainer's time (UTC) of the last :data:`TRAINING_EVENTS` record this call stored, or None.
    ``ended``: the job has ended and this reads the rest of its log (``log_backlog``).

    Each ``logs`` call runs outside any transaction. Its lines are then written under the job's row
    lock, and only while the stored cursor is still the one the call was made from, so two passes
    reading one log at once store it once. Raises :class:`_RowMovedOn`, dropping the chunk, when
    the cursor moved meanwhile, the job ended, its row is held, or it follows another run now (a lost
    run resubmitted by another pass: a new handle).
    """
    cursor = job.log_cursor
    next_seq, trained_at = None, None
    points = lines_read = 0
    for _ in range(_MAX_LOG_CALLS):
        if points >= PASS_POINTS or lines_read >= PASS_LINES:
            return False, trained_at
        lines, new_cursor = adapter.logs(handle, cursor)
        if not lines and (new_cursor or "") == (cursor or ""):
            return True, trained_at
        with transaction.atomic():
            locked = _locked(job.pk, ended_backlog=ended, wait=True)
            if locked is None or locked.log_cursor != (cursor or "") or locked.provider_handle != job.provider_handle:
                raise _RowMovedOn
            update: dict[str, Any] = {"log_cursor": new_cursor or ""}
            if lines:
                if next_seq is None:  # the cursor check above keeps it right for the later chunks
                    last = JobLogLine.objects.filter(job_id=job.pk).aggregate(m=Max("seq"))["m"]
                    next_seq = 0 if last is None else last + 1
                next_seq, first_step, rank_memory, trained, stored = _ingest_lines(locked, lines, next_seq, now, mask)
                trained_at = trained or trained_at
                points += stored
                lines_read += len(lines)
                if first_step is not None and locked.first_step_at is None:
                    update["first_step_at"] = first_step
                if rank_memory is not None:  # the last measurement stands beside the plan on the job page
                    update["rank_memory"] = rank_memory
            TrainingJob.objects.filter(pk=job.pk).update(**update)
        if not lines:
            return True, trained_at
        cursor = new_cursor
    return False, trained_at


def _attempt_figures(job: TrainingJob, status: JobStatus, now: dt.datetime) -> restarts.AttemptFigures:
    """The current attempt's own start, end, billable seconds, instances and cost from ``status``."""
    target = status.state.value if isinstance(status.state, JobState) else str(status.state)
    terminal = target in TERMINAL_STATE_VALUES
    started_at = status.started_at or job.started_at
    ended_at = (status.ended_at or job.ended_at or now) if terminal else None
    billable = status.billable_seconds
    if billable is None:
        billable = costs.run_seconds(started_at, ended_at, now)
    instances = max(int(status.instance_count or job.nodes), 1)
    return restarts.AttemptFigures(
        started_at=started_at, ended_at=ended_at, billable_seconds=float(billable), instance_count=instances,
        cost_usd=costs.job_cost_usd(billable_seconds=billable, instances=instances,
                                    hourly_price_usd=job.hourly_price_usd))


def _status_fields(job: TrainingJob, status: JobStatus, now: dt.datetime,
                   figures: restarts.AttemptFigures | None = None) -> dict[str, Any]:
    """Columns to write from a provider status; cost recomputed absolutely from them: the current
    attempt's (``figures``, :func:`_attempt_figures` by default) plus the closed attempts' stored
    figures (:func:`jobs.restarts.closed_totals`)."""
    target = status.state.value if isinstance(status.state, JobState) else str(status.state)
    terminal = target in TERMINAL_STATE_VALUES
    figures = figures or _attempt_figures(job, status, now)
    closed_seconds, closed_usd = restarts.closed_totals(job)
    ended_at = figures.ended_at
    fields: dict[str, Any] = {
        "raw_state": (status.raw_state or "")[:100],
        "secondary_state": (status.secondary_state or "")[:100],
        "status_warning": status.warning or "",
        "started_at": figures.started_at,
        "billable_seconds": closed_seconds + figures.billable_seconds,
        "instance_count": figures.instance_count,
        "cost_usd": closed_usd + figures.cost_usd,
        "last_synced_at": now,
    }
    if status.training_seconds is not None:
        fields["training_seconds"] = float(status.training_seconds)
    if terminal:
        fields["ended_at"] = ended_at
    if target == S.FAILED:
        reason = status.failure_reason or job.failure_reason or (
            f"The backend reported the job failed ({status.raw_state or 'no reason given'}).")
        # The trainer's own reason (a diverged loss) is what the user acts on; a cloud's reason is
        # generic ("exited with a non-zero status of 1"), so it follows as the detail.
        fields["failure_reason"] = _with_trainer_reason(job, reason)
    elif target == S.CANCELLED:
        fields["failure_reason"] = job.failure_reason or status.failure_reason or "Cancelled"
    return fields


def _unchanged_fields(job: TrainingJob, now: dt.datetime) -> dict[str, Any]:
    """Columns to write for a job ``describe_many`` left out (unchanged since ``changed_since``, or
    not found): the sync time and, while it runs, its cost so far from the run interval (start →
    now) — recomputed absolutely, never incremented. The provider's own billable seconds arrive
    with the status that reports them."""
    fields: dict[str, Any] = {"last_synced_at": now}
    if job.state == S.RUNNING and job.started_at is not None:
        billable = costs.run_seconds(job.started_at, None, now)
        closed_seconds, closed_usd = restarts.closed_totals(job)  # earlier attempts of a resubmitted job
        fields["billable_seconds"] = closed_seconds + billable
        fields["cost_usd"] = closed_usd + costs.job_cost_usd(billable_seconds=billable, instances=job.instance_count,
                                                             hourly_price_usd=job.hourly_price_usd)
    return fields


def _sync_one(adapter: Backend, job: TrainingJob, status: JobStatus | None, now: dt.datetime,
              read_logs: bool = True, *, mask: Callable[[str], str]) -> None:
    """Sync one job of a pass: store its new log lines (when read), then write its ``status`` (None:
    left out of ``describe_many``) and stop it if its cost reached its budget.

    ``job`` is the pass's list entry (id, state, handle, log cursor). The provider calls (``logs``,
    the budget stop's ``cancel``) run outside any transaction; each write locks the row, re-reads
    it and writes from what it holds then, so a cancel or an end that another writer committed
    meanwhile is kept (:func:`jobs.states.transition` allows only legal moves from there). A row
    another transaction holds, or that ended, is left to the next pass.
    """
    handle = JobHandle.from_dict(job.provider_handle)
    read = read_logs or status is not None  # a changed job's log is always read (its end needs all of it)
    drained, trained_at = True, None
    if read:
        try:
            drained, trained_at = _drain_logs(adapter, job, handle, now, mask)
        except _RowMovedOn:
            return
    checkpoint = ""
    if status is not None and not job.checkpoint_uri and (
            (status.lost and status.state is JobState.FAILED) or _restart_confirmed(job, status)):
        # Where the lost (or hung) run's checkpoints are, asked before the row is locked (jobs.restarts).
        checkpoint = restarts.checkpoint_location(adapter, handle)
    with transaction.atomic():
        locked = _locked(job.pk, wait=True)
        if locked is None or locked.provider_handle != job.provider_handle:
            # Ended, held, or resubmitted meanwhile by another pass (a lost run's next attempt): this
            # status is of a run the job no longer follows, and applying it would close that attempt too.
            return
        stopped = _write_status(locked, status, now, drained=drained, logs_read=read, mask=mask,
                                checkpoint_uri=checkpoint, trained_at=trained_at)
    if stopped:  # committed: the stop is on record before the provider is asked
        _send_cancel(adapter, locked, handle)


def _restart_confirmed(job: TrainingJob, status: JobStatus) -> bool:
    """Whether ``status`` confirms the stop of a hung run that the hang policy stopped to restart
    (``hang_restart_at``): the provider says CANCELLED, or FAILED (a run the signal ended with an error).
    A run that SUCCEEDED meanwhile has nothing left to restart."""
    return (job.state == S.STOPPING and job.hang_restart_at is not None
            and status.state in (JobState.CANCELLED, JobState.FAILED))


def _write_status(job: TrainingJob, status: JobStatus | None, now: dt.datetime, *, drained: bool,
                  logs_read: bool, mask: Callable[[str], str], checkpoint_uri: str = "",
                  trained_at: dt.datetime | None = None) -> bool:
    """Write ``status`` onto ``job``, whose row the caller holds locked; True when the job's budget
    stop was made (the caller sends the cancel after commit). No provider call. ``mask``: as for
    :func:`_ingest_lines`, applied to the failure reason, which may quote the job's own output.
    A lost run (``status.lost``) is resubmitted from ``checkpoint_uri`` while restarts are left
    (:func:`jobs.restarts.lost_run`) instead of ending the job FAILED.

    ``trained_at``: the trainer's time of the last training record (:data:`TRAINING_EVENTS`) this
    pass stored. A SUBMITTING or PENDING job with one logged after it entered that state is training:
    it moves to RUNNING ("first step logged") even where the provider's status still says PENDING or
    the job was left out of ``describe_many`` (the status was read before the log, or the provider
    reports the run late), so a job whose metrics arrive is never shown PENDING."""
    read = {"logs_read_at": now} if logs_read else {}
    training = (trained_at is not None and job.state in (S.SUBMITTING, S.PENDING)
                and (job.state_entered_at is None or trained_at >= job.state_entered_at))
    if status is None:  # unchanged since the last sync, or not found: state left as it is
        if training:
            transition(job, S.RUNNING, message="first step logged")
        TrainingJob.objects.filter(pk=job.pk, state=job.state).update(**_unchanged_fields(job, now), **read)
        job.refresh_from_db()
        return _enforce_budget(job)
    target = status.state.value if isinstance(status.state, JobState) else str(status.state)
    logged_first = training and target == S.PENDING
    if logged_first:
        target = S.RUNNING
    restart = _restart_confirmed(job, status)
    if target in TERMINAL_STATE_VALUES and not drained and (status.lost or restart):
        # A lost (or hung) run is resubmitted from its checkpoint (jobs.restarts): only once its log is all stored.
        TrainingJob.objects.filter(pk=job.pk).update(last_synced_at=now, **read)
        return False
    figures = _attempt_figures(job, status, now)
    fields = {**_status_fields(job, status, now, figures), **read}
    if target in TERMINAL_STATE_VALUES and not drained:
        # The state is the provider's, shown now, apart from the backlog behind it: the job is marked to
        # have the rest of its log (and metrics) read by the next passes (_read_ended_backlog), and a
        # FAILED job's reason is completed from the trainer's records once they are all read.
        fields["log_backlog"] = True
    was_paused = job.secondary_state == PAUSED
    if fields.get("failure_reason"):
        # The GPU box's reason is the failed rank's error line, the user's code's own words.
        fields["failure_reason"] = mask(fields["failure_reason"])
    if target == S.FAILED and status.lost and job.state != S.STOPPING:
        outcome = restarts.lost_run(job, status=dataclasses.replace(status, failure_reason=mask(status.failure_reason)),
                                    figures=figures, fields=fields, checkpoint_uri=checkpoint_uri)
        if outcome.requeued:
            return False
        fields["failure_reason"] = outcome.failure_reason
    if restart:
        outcome = restarts.hung_run(job, status=status, figures=figures, fields=fields, checkpoint_uri=checkpoint_uri,
                                    reason=hangs.hang_reason(job.hang) if job.hang else "no new step")
        if outcome.requeued:
            return False
        fields["failure_reason"] = outcome.failure_reason
    if (target in TERMINAL_STATE_VALUES and job.state in (S.SUBMITTING, S.PENDING)
            and job.first_step_at is not None):
        # It ran and ended between two syncs; the trainer's "started" record is in the log we just
        # stored, so the history says so rather than jumping PENDING → SUCCEEDED.
        transition(job, S.RUNNING, message="first step logged", started_at=fields["started_at"])
    # An unknown provider state reads as PENDING (with a warning) only so that a job that never ran
    # is not shown RUNNING; for a running job it is no interruption: it stays RUNNING, warning shown.
    unsure_interruption = (str(job.state), target) == INTERRUPTION and bool(status.warning)
    # A job moved to RUNNING by its log while the provider still said PENDING: the same PENDING word
    # again is the provider catching up, not an interruption (that comes after it said RUNNING).
    unsure_interruption = unsure_interruption or ((str(job.state), target) == INTERRUPTION and (
        (status.raw_state or "")[:100], (status.secondary_state or "")[:100]) == (job.raw_state, job.secondary_state))
    # QUEUED is never a provider's word: only a resubmission (jobs.restarts) moves a job back there.
    if target != job.state and target != S.QUEUED and is_allowed(job.state, target) and not unsure_interruption:
        message = " / ".join(x for x in (status.raw_state, status.secondary_state) if x)
        if logged_first:
            message = f"first step logged (the backend still reports {message or 'PENDING'})"
        if target in (S.FAILED,) and fields.get("failure_reason"):
            message = f"{message}: {fields['failure_reason']}" if message else fields["failure_reason"]
        transition(job, target, message=message[:2000], **fields)
    else:
        # Same state, or a move the machine refuses (the provider still says RUNNING while we are
        # STOPPING): refresh the numbers only.
        fields = {k: v for k, v in fields.items() if k not in ("ended_at", "failure_reason")}
        TrainingJob.objects.filter(pk=job.pk, state=job.state).update(**fields)
        job.refresh_from_db()
    _note_pause(job, status, was_paused)
    return _enforce_budget(job)


def _read_ended_backlog(adapter: Backend, job: TrainingJob, now: dt.datetime, mask: Callable[[str], str]) -> None:
    """A pass's part of an ended job's log backlog (``log_backlog``): the next bounded part of its log is
    stored (:func:`_drain_logs`); once the log is read to its end the mark goes and a FAILED job's reason
    gains the trainer's own (its ``failed`` record or the user's traceback, now stored), as
    :func:`_status_fields` gives it to a job whose log was read before it ended. No status is asked for:
    the job's state is final."""
    try:
        drained, _ = _drain_logs(adapter, job, JobHandle.from_dict(job.provider_handle), now, mask, ended=True)
    except _RowMovedOn:
        return
    with transaction.atomic():
        locked = _locked(job.pk, ended_backlog=True)
        if locked is None:
            return
        fields: dict[str, Any] = {"logs_read_at": now}
        if drained:
            fields["log_backlog"] = False
            if locked.state == S.FAILED:
                fields["failure_reason"] = mask(_with_trainer_reason(locked, locked.failure_reason or ""))
        TrainingJob.objects.filter(pk=job.pk).update(**fields)


def _note_pause(job: TrainingJob, status: JobStatus, was_paused: bool) -> None:
    """A note on the timeline when the provider paused the job (``secondary_state`` PAUSED) or resumed
    it: the job keeps its state through both (a pause is no interruption, :data:`cloud_adapters.base.PAUSED`)."""
    paused = status.secondary_state == PAUSED
    if job.is_terminal or paused == was_paused:
        return
    raw = status.raw_state or "no state given"
    note(job.pk, job.state, f"Paused by the provider ({raw}): not training until it is resumed" if paused
         else f"Resumed by the provider ({raw})")


def _enforce_budget(job: TrainingJob) -> bool:
    """Stop a PENDING/RUNNING job whose cost reached its budget: → STOPPING with
    ``budget_exceeded_at`` and the reason "Stopped: budget of $X reached at $Y" (Y = its cost then).
    True when this call moved it; the caller then sends the cancel, once that is committed."""
    if job.budget_usd is None or job.state not in (S.PENDING, S.RUNNING) or job.cost_usd < job.budget_usd:
        return False
    places = job.money_places  # as the job page shows its cost and budget beside this reason
    reason = (f"Stopped: budget of {costs.format_usd(job.budget_usd, places)} reached at "
              f"{costs.format_usd(job.cost_usd, places)}")
    now = timezone.now()
    return transition(job, S.STOPPING, message=reason, failure_reason=reason, cancel_requested_at=now,
                      budget_exceeded_at=now)


def _send_cancel(adapter: Backend, job: TrainingJob, handle: JobHandle) -> None:
    try:
        adapter.cancel(handle)
    except BackendError as exc:
        log.warning("job %s: cancel not sent this sync (%s); the next sync retries", job.pk, exc)


_UNCHANGED_SQL = """
WITH synced AS (
    UPDATE {table} AS j SET
        last_synced_at = %(now)s,
        billable_seconds = CASE WHEN j.state = %(running)s AND j.started_at IS NOT NULL
            THEN ({seconds})::double precision + CASE WHEN j.attempt > 1
                THEN COALESCE((SELECT SUM(a.billable_seconds) FROM {attempts} AS a WHERE a.job_id = j.id), 0)
                ELSE 0 END
            ELSE j.billable_seconds END,
        cost_usd = CASE WHEN j.state = %(running)s AND j.started_at IS NOT NULL
            THEN {cost} + CASE WHEN j.attempt > 1
                THEN COALESCE((SELECT SUM(a.cost_usd) FROM {attempts} AS a WHERE a.job_id = j.id), 0)
                ELSE 0 END
            ELSE j.cost_usd END
    FROM (SELECT id FROM {table} WHERE id = ANY(%(ids)s) AND state = ANY(%(active)s)
          ORDER BY id FOR UPDATE SKIP LOCKED) AS free
    WHERE j.id = free.id
    RETURNING j.id, j.state, j.cost_usd, j.budget_usd
)
SELECT id FROM synced
WHERE state = ANY(%(budgeted)s) AND budget_usd IS NOT NULL AND cost_usd >= budget_usd
ORDER BY id
"""
"""One statement for the jobs of a pass that are neither changed nor read: ``{seconds}`` and
``{cost}`` are :func:`jobs.cost.run_seconds_sql` and :func:`jobs.cost.job_cost_sql` of the row, to
which a resubmitted job (``attempt`` > 1) adds its closed attempts' stored figures
(:func:`jobs.restarts.closed_totals`)."""


def _sync_unchanged(job_ids: list[int], now: dt.datetime) -> list[int]:
    """Write :func:`_unchanged_fields` for every job of ``job_ids`` in one statement, and return the
    ids of those whose cost now reaches their budget (the caller stops them, one by one).

    For the jobs ``describe_many`` left out whose logs this pass does not read: one statement in
    place of a lock, an update and a re-read per row, so a pass's database work grows with the jobs
    that changed (at 10,000 active jobs: bench/RESULTS.md, "One sync of 10,000 active jobs"). The values are those of the per-job path, computed by PostgreSQL from
    the row under its lock by the SQL form of :func:`jobs.cost.run_seconds` and
    :func:`jobs.cost.job_cost_usd` (``run_seconds_sql``, ``job_cost_sql``, which tests/jobs/test_cost.py
    holds equal to them): recomputed absolutely, never added to. The rows are locked for this one
    statement only (it runs on its own, in autocommit, with no provider call). A row another sync or
    a transition holds is skipped (``SKIP LOCKED``), as the per-job lock does, and so is a job no
    longer active. PostgreSQL only: the caller uses the per-job path elsewhere.
    """
    if not job_ids:
        return []
    seconds = costs.run_seconds_sql(started_at="j.started_at", now="%(now)s")
    sql = _UNCHANGED_SQL.format(
        table=connection.ops.quote_name(TrainingJob._meta.db_table), seconds=seconds,
        attempts=connection.ops.quote_name(JobAttempt._meta.db_table),
        cost=costs.job_cost_sql(seconds=seconds, instances="j.instance_count", hourly_price_usd="j.hourly_price_usd"))
    with connection.cursor() as cursor:
        cursor.execute(sql, {"now": now, "running": S.RUNNING.value, "ids": list(job_ids),
                             "active": list(ACTIVE_STATE_VALUES),
                             "budgeted": [S.PENDING.value, S.RUNNING.value]})
        return [row[0] for row in cursor.fetchall()]


SYNC_MARGIN = dt.timedelta(seconds=60)
"""Overlap between syncs: provider modification times and our clock may disagree by this much."""


def sync_changed_since(jobs: list[TrainingJob]) -> dt.datetime | None:
    """``changed_since`` for ``describe_many``: the oldest ``last_synced_at`` among ``jobs`` minus
    :data:`SYNC_MARGIN`, or None when any of them has never been synced (it must be described)."""
    synced = [job.last_synced_at for job in jobs]
    if not synced or any(at is None for at in synced):
        return None
    return min(synced) - SYNC_MARGIN


def log_readers(jobs: list[TrainingJob], changed: set[str], limit: int) -> set[int]:
    """Ids of the jobs whose logs one sync pass reads: every job whose status ``changed`` (by provider
    job name) and at most ``limit`` of the others, least recently read first (never read = first), so
    at 10,000 active jobs a pass makes ``changed + limit`` log reads, not 10,000, and every job's log
    is still read every ``active / limit`` passes."""
    never = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    ids = {j.pk for j in jobs if (j.provider_handle or {}).get("job_name", "") in changed}
    rest = sorted((j for j in jobs if j.pk not in ids), key=lambda j: (j.logs_read_at or never, j.pk))
    return ids | {j.pk for j in rest[:max(limit, 0)]}


def backend_sync(*, backend_id: int, bulk: bool = True) -> int:
    """One sync pass over a backend's active jobs (the body of ``jobs.tasks.sync_backend``).

    One ``describe_many`` call for all of them, with ``changed_since`` from :func:`sync_changed_since`
    so an adapter may list only the jobs that changed. STOPPING jobs get their cancel re-sent. Per
    job whose status changed or whose log this pass reads (its row locked only to write, skipped if
    another transaction holds it; see the module's transaction rule): new log lines and metric
    points are stored, then the provider state is applied through the state machine with times,
    billable and training seconds, instance count and cost recomputed absolutely. A job left out
    of the result keeps its state and, while RUNNING, its cost so far is recomputed from the run
    interval; its log is read when it is among the ``TRAINBOARD_LOG_READS_PER_SYNC`` least
    recently read (:func:`log_readers`). The rest (left out and not read) are written in one
    statement (:func:`_sync_unchanged`), so the pass's database work grows with the changed jobs,
    not the active ones. A job whose cost reached its budget is stopped in this pass, whichever way
    it was written. On a backend that shares its devices (a GPU box), a pass in which a job ended
    wakes the backend's first waiting job (:func:`jobs.admission.wake_waiting`).

    ``bulk=False`` (and any database but PostgreSQL) writes every job by the per-job path; the
    results are the same (bench/sync_db.py compares the two).
    A backend whose adapter cannot be built (:func:`backend_adapter` raises a non-transient
    BackendError, e.g. it may not use the worker's identity) is not called at all: its jobs keep
    their state and get a ``status_warning`` saying why they are not followed.
    Returns the number of jobs looked at. Transient BackendErrors from describe_many propagate.
    """
    backend = ComputeBackend.objects.get(pk=backend_id)
    # Only what this loop reads (each job is re-read, locked, before anything is written): at 10,000
    # active jobs the frozen configs alone would be most of the worker's memory (bench/sync_memory.py).
    jobs = list(
        TrainingJob.objects.filter(backend_id=backend_id, state__in=ACTIVE_STATE_VALUES)
        .exclude(state=S.QUEUED).exclude(provider_handle__isnull=True).order_by("id")
        .only("id", "state", "provider_handle", "last_synced_at", "logs_read_at", "log_cursor", "attempt",
              "checkpoint_uri", "hang_restart_at")
    )
    # Jobs that ended with their log not read to its end: this pass reads the next part of each (no status).
    ended = list(
        TrainingJob.objects.filter(backend_id=backend_id, state__in=TERMINAL_STATE_VALUES, log_backlog=True)
        .exclude(provider_handle__isnull=True).order_by("id")
        .only("id", "state", "provider_handle", "log_cursor", "failure_reason")
    )
    if not jobs and not ended:
        return 0
    try:
        adapter = backend_adapter(backend)
    except BackendError as exc:
        if exc.transient:
            raise
        # E.g. a backend that may not use the worker's identity (stored before that rule): its jobs
        # are not touched (no provider call at all); each says why it is no longer followed.
        log.warning("backend %s: not synced: %s", backend.pk, exc)
        TrainingJob.objects.filter(pk__in=[job.pk for job in jobs]).update(
            status_warning=f"Not synced: backend {backend.name} cannot be used: {exc} Until then this job "
                           f"is not followed or stopped from here; check it in the provider's console.")
        return len(jobs)
    for job in jobs:
        if job.state == S.STOPPING:
            # Re-sent every sync: idempotent, and lets a gpubox escalate SIGTERM to SIGKILL.
            _send_cancel(adapter, job, JobHandle.from_dict(job.provider_handle))
    statuses = adapter.describe_many([JobHandle.from_dict(j.provider_handle) for j in jobs],
                                     changed_since=sync_changed_since(jobs)) if jobs else {}
    now = timezone.now()
    readers = log_readers(jobs, set(statuses), settings.TRAINBOARD_LOG_READS_PER_SYNC)
    mask = job_secret_redactor(backend.job_secrets or {})  # the values this backend sets in its jobs

    def changed_or_read(job: TrainingJob) -> bool:
        return job.pk in readers or job.provider_handle.get("job_name", "") in statuses

    one_by_one = jobs
    if bulk and connection.vendor == "postgresql":
        over_budget = set(_sync_unchanged([job.pk for job in jobs if not changed_or_read(job)], now))
        # Those over budget go through the per-job path too: it writes the same values again, then
        # stops them (in this pass, as if they had been written one by one).
        one_by_one = [job for job in jobs if changed_or_read(job) or job.pk in over_budget]
    for job in one_by_one:
        try:
            _sync_one(adapter, job, statuses.get(job.provider_handle.get("job_name", "")), now,
                      read_logs=job.pk in readers, mask=mask)
        except BackendError as exc:
            if not exc.transient:
                log.warning("job %s: sync error: %s", job.pk, exc)
                TrainingJob.objects.filter(pk=job.pk).update(status_warning=f"Sync error: {exc}")
            else:
                log.info("job %s: transient sync error, next sync retries: %s", job.pk, exc)
    for job in ended:
        try:
            _read_ended_backlog(adapter, job, now, mask)
        except BackendError as exc:
            log.info("job %s: reading the rest of its log failed, next sync retries: %s", job.pk, exc)
    if jobs and adapter.allocates_devices and TrainingJob.objects.filter(
            pk__in=[job.pk for job in jobs], state__in=TERMINAL_STATE_VALUES).exists():
        # A job that ended gave its GPUs back (the allocation counts active jobs only): the first
        # waiting job may start now (jobs.admission).
        admission.wake_waiting(backend)
    return len(jobs) + len(ended)
