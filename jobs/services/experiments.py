"""Writes of the experiment table (docs/experiments.md): a job's tags, notes and archive mark, bulk
archive, saved job-list filters, and a user's choice of list columns.

Every function validates everything first and raises one ValidationError keyed by field (``tags``,
``notes``, ``archived``, ``ids``, ``name``, ``query``, ``columns``) with all its messages; nothing is
written then. Only the owner or staff change a job (``selectors.can_change``): the views and the API
answer a teammate 403 before calling these; the bulk archive, which takes ids, checks it itself.
"""

from __future__ import annotations

from typing import Any, Iterable

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from jobs import job_table
from jobs.models import TERMINAL_STATE_VALUES, JobListSettings, SavedFilter, TrainingJob
from jobs.selectors import can_change, training_job_list_for_user
from jobs.validation import Errors, text_problem

UNSET: Any = object()
"""A field :func:`training_job_annotate` leaves as it is."""

MAX_BULK_JOBS = 500
"""Jobs one bulk archive may name."""
MAX_FILTER_NAME = 100


def _archive_problem(job: TrainingJob) -> str | None:
    if job.state not in TERMINAL_STATE_VALUES:
        return (f"Job {job} (#{job.pk}) is {job.state}: only a job that has ended can be archived; "
                f"cancel it first, or archive it once it ends.")
    return None


def training_job_annotate(*, job: TrainingJob, tags: Any = UNSET, notes: Any = UNSET,
                          archived: Any = UNSET) -> TrainingJob:
    """Set ``job``'s ``tags`` (a list of strings, or one string separated by commas or spaces:
    :func:`jobs.job_table.clean_tags`), ``notes`` (text, at most 10,000 characters) and/or
    ``archived`` (True / False; only a terminal job can be archived); arguments left out stay.

    Every problem at once, keyed ``tags`` / ``notes`` / ``archived``; nothing is written then. The
    row is locked and written with an UPDATE of these columns only, so what a sync writes meanwhile
    (state, metrics, cost) is kept; archiving an archived job keeps its ``archived_at``. Returns
    ``job`` with the new values set on it."""
    errors = Errors()
    values: dict[str, Any] = {}
    if tags is not UNSET:
        cleaned, problems = job_table.clean_tags(tags)
        for problem in problems:
            errors.add("tags", problem)
        values["tags"] = cleaned
    if notes is not UNSET:
        if notes is None:
            notes = ""
        if not isinstance(notes, str):
            errors.add("notes", f"Notes are text, got {type(notes).__name__}.")
        elif len(notes) > job_table.MAX_NOTES:
            errors.add("notes", f"Notes are {len(notes):,} characters; at most {job_table.MAX_NOTES:,}.")
        elif "\x00" in notes:
            errors.add("notes", "Notes may not hold a NUL character.")
        else:
            values["notes"] = notes
    if archived is not UNSET and not isinstance(archived, bool):
        errors.add("archived", f"archived is true or false, got {archived!r:.40}.")
    errors.raise_if_any()
    with transaction.atomic():
        row = TrainingJob.objects.select_for_update().only("state", "archived_at", "name").get(pk=job.pk)
        if archived is True:
            problem = _archive_problem(row)
            if problem:
                raise ValidationError({"archived": [problem]})
            values["archived_at"] = row.archived_at or timezone.now()
        elif archived is False:
            values["archived_at"] = None
        if values:
            TrainingJob.objects.filter(pk=job.pk).update(**values, updated_at=timezone.now())
    for field, value in values.items():
        setattr(job, field, value)
    return job


def _job_ids(ids: Any, errors: Errors) -> list[int]:
    """``ids`` (a list of ids, or text "1,2,3") as ints; an error on ``ids`` for anything else."""
    items: Iterable[Any] = ids.split(",") if isinstance(ids, str) else (ids if isinstance(ids, (list, tuple)) else [])
    out: list[int] = []
    for item in items:
        text = str(item).strip().removeprefix("#")
        if not text:
            continue
        if not (text.isascii() and text.isdigit() and len(text) <= 18):
            errors.add("ids", f"“{text[:30]}” is not a job id.")
            continue
        if int(text) not in out:
            out.append(int(text))
    if not out and "ids" not in errors:
        errors.add("ids", "Select at least one job.")
    if len(out) > MAX_BULK_JOBS:
        errors.add("ids", f"At most {MAX_BULK_JOBS} jobs at once, got {len(out):,}.")
    return out


def training_jobs_archive(*, user, ids: Any, archived: bool = True) -> list[TrainingJob]:
    """Archive (or, ``archived=False``, unarchive) the jobs ``ids`` (ints or "1,2,3") of ``user``'s
    list, all or none: every id must be a job ``user`` may see (else "No job #9 in your list") and
    change (owner or staff), and to archive, every job must have ended. All problems at once on
    ``ids``; nothing is written then. Returns the jobs, by id."""
    errors = Errors()
    wanted = _job_ids(ids, errors)
    errors.raise_if_any()
    with transaction.atomic():
        visible = {job.pk: job for job in training_job_list_for_user(user=user)
                   .select_related(None).filter(pk__in=wanted).select_for_update(of=("self",)).only("owner", "state", "name", "archived_at")}
        for pk in wanted:
            job = visible.get(pk)
            if job is None:
                errors.add("ids", f"No job #{pk} in your list.")
            elif not can_change(user=user, obj=job):
                errors.add("ids", f"Only the owner (or staff) can archive or unarchive job {job} (#{pk}).")
            elif archived:
                problem = _archive_problem(job)
                if problem:
                    errors.add("ids", problem)
        errors.raise_if_any()
        now = timezone.now()
        if archived:
            TrainingJob.objects.filter(pk__in=wanted, archived_at__isnull=True).update(archived_at=now, updated_at=now)
        else:
            TrainingJob.objects.filter(pk__in=wanted).update(archived_at=None, updated_at=now)
    return list(TrainingJob.objects.filter(pk__in=wanted).order_by("id"))


def saved_filter_create(*, owner, name: Any, query: Any) -> SavedFilter:
    """Save the job-list query ``query`` (a QueryDict or dict of the list's parameters) as ``name``
    for ``owner``. Only the list's own parameters (:data:`jobs.job_table.LIST_PARAMS`) are kept, each
    checked (:func:`jobs.job_table.clean_list_query`: problems on ``query``); the name is 1–100
    characters, unique per owner (error on ``name``)."""
    errors = Errors()
    name = name.strip() if isinstance(name, str) else name
    if not isinstance(name, str) or not name:
        errors.add("name", "Name the filter, e.g. best-lr-sweep.")
    elif len(name) > MAX_FILTER_NAME:
        errors.add("name", f"The name is {len(name)} characters; at most {MAX_FILTER_NAME}.")
    elif problem := text_problem(name):
        errors.add("name", f"The name {problem}")
    elif SavedFilter.objects.filter(owner_id=owner.pk, name=name).exists():
        errors.add("name", f"You already have a saved filter named “{name}”; choose another name or delete that one.")
    cleaned: dict[str, str] = {}
    if not hasattr(query, "get"):
        errors.add("query", f"The query is the job list's parameters (state, tag, sort, ...), got {type(query).__name__}.")
    else:
        cleaned, problems = job_table.clean_list_query(query)
        for messages in problems.values():
            for message in messages:
                errors.add("query", message)
    errors.raise_if_any()
    try:
        with transaction.atomic():
            return SavedFilter.objects.create(owner=owner, name=name, query=cleaned)
    except IntegrityError:  # the same name saved meanwhile by another request
        raise ValidationError({"name": [f"You already have a saved filter named “{name}”; choose another name."]}) from None


def saved_filter_delete(*, saved_filter: SavedFilter) -> None:
    """Delete ``saved_filter`` (the caller fetched it from the owner's own list)."""
    saved_filter.delete()


def job_list_columns_save(*, user, columns: Any) -> list[str]:
    """Keep ``columns`` ("val_accuracy,train.lr" or a list of keys, :func:`jobs.job_table.parse_columns`)
    as ``user``'s job-list columns; empty = back to the defaults. Problems on ``columns``. Returns the
    keys stored."""
    if columns is not None and not isinstance(columns, (str, list, tuple)):
        raise ValidationError({"columns": [f"Columns are a list of keys, got {type(columns).__name__}."]})
    parsed, problems = job_table.parse_columns(columns)
    if problems:
        raise ValidationError({"columns": problems})
    keys = [c.key for c in parsed]
    JobListSettings.objects.update_or_create(user=user, defaults={"columns": keys})
    return keys
