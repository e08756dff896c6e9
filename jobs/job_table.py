"""The job list as an experiment table: its columns, sort keys, tags and the log's rank filter
(docs/experiments.md). A leaf module: it imports models and the trainer's config only, no service.

Columns beyond the fixed ones (job, state, backend, shape, created, duration, cost, progress) are of two kinds,
told apart by their key:

- a **final metric**, the last value the job reported (``TrainingJob.final_metrics``): a trainer name
  (``val_accuracy``) or a user script's (``tokens/s``, anything ``trainer_pkg.metrics.USER_METRIC_NAME``
  allows);
- a **hyperparameter**, a dotted key into the frozen ``TrainingJob.config`` whose first part is one of
  the config's sections (``train.lr``, ``train.batch_size``, ``model.params.hidden``); the part up to a
  free-form mapping (``model.params``) is checked against ``trainer_pkg.config.JobConfig``.

A sort key is a column key, or one of :data:`BUILTIN_SORTS`, with ``-`` in front for descending. Sorting
runs in the database on the JSON value (PostgreSQL's jsonb order: numbers by value; SQLite's
``JSON_EXTRACT``: the same), rows without a value last in both directions, ties newest first.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any, Collection, Iterable, Mapping

from django.db import connections
from django.db.models import BooleanField, Exists, F, Func, JSONField, OrderBy, OuterRef

from jobs.models import FinalMetricValue, JobStateChoices
from trainer_pkg.config import JobConfig
from trainer_pkg.metrics import GLOBAL_METRICS, USER_METRIC_NAME

DEFAULT_COLUMNS = ("val_accuracy", "val_loss", "train_loss")
"""The extra columns of a user who chose none."""
MAX_COLUMNS = 20
"""Extra columns one list may show."""
MAX_CONFIG_DEPTH = 6
"""Parts of a hyperparameter key at most (``model.params.a.b.c.d``)."""

BUILTIN_SORTS: dict[str, tuple[str, str]] = {
    # key: (model field, label)
    "created": ("created_at", "Created"),
    "name": ("name", "Name"),
    "state": ("state", "State"),
    "backend": ("backend__name", "Backend"),
    "cost": ("cost_usd", "Cost"),
    "id": ("id", "Id"),
}
"""Sort keys of the fixed columns: ``?sort=cost``, ``?sort=-created`` (the default order)."""
DEFAULT_SORT = "-created"

LIST_PARAMS = ("state", "backend", "q", "tag", "archived", "columns", "sort")
"""The job list's own query parameters: what a saved filter keeps (paging excepted)."""
ARCHIVED_CHOICES = {"": "not archived", "0": "not archived", "1": "archived only", "all": "archived or not"}

MAX_TAGS = 20
MAX_TAG_LENGTH = 50
TAG_RE = re.compile(r"[a-z0-9][a-z0-9_.-]*")
MAX_NOTES = 10_000

CONFIG_SECTIONS = tuple(f.name for f in dataclasses.fields(JobConfig))
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Column:
    """One extra column of the job list."""

    key: str  # as in the URL: "val_accuracy", "train.lr"
    kind: str  # "metric" (final_metrics) | "config" (the frozen config)

    @property
    def path(self) -> tuple[str, ...]:
        """The JSON path inside the job's field: ``("val_accuracy",)``, ``("train", "lr")``."""
        return (self.key,) if self.kind == "metric" else tuple(self.key.split("."))

    @property
    def field(self) -> str:
        return "final_metrics" if self.kind == "metric" else "config"

    def value(self, job) -> Any:
        """The job's value for this column, None where it has none (the metric was not reported, the
        key is not in its config)."""
        node: Any = getattr(job, self.field, None)
        for part in self.path:
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


def _config_key_problem(parts: list[str]) -> str | None:
    """Why ``parts`` (a hyperparameter key split on dots) names nothing in ``JobConfig``; None if it may."""
    key = ".".join(parts)
    if len(parts) < 2:
        return f"“{key}” is a section of the config, not a value; name a key in it, e.g. {key}.{_first_field(key)}."
    if len(parts) > MAX_CONFIG_DEPTH:
        return f"Hyperparameter key “{key[:80]}” has more than {MAX_CONFIG_DEPTH} parts."
    bad = [p for p in parts if not _IDENT.fullmatch(p)]
    if bad:
        return f"Hyperparameter key “{key[:80]}”: “{bad[0][:40]}” is not a key name (letters, digits, _)."
    cls: Any = JobConfig
    for i, part in enumerate(parts):
        if dataclasses.is_dataclass(cls):
            names = [f.name for f in dataclasses.fields(cls)]
            if part not in names:
                where = ".".join(parts[:i]) or "the config"
                return f"Unknown hyperparameter “{key}”: {where} has {', '.join(names)}."
            cls = typing.get_type_hints(cls)[part]
        elif typing.get_origin(cls) is dict:
            return None  # a free-form mapping (model.params): any key may be there
        else:
            return f"Unknown hyperparameter “{key}”: {'.'.join(parts[:i])} is a single value, it has no keys."
    if dataclasses.is_dataclass(cls):
        return f"“{key}” is a section of the config, not a value; name a key in it, e.g. {key}.{_first_field(key)}."
    return None


def _first_field(section: str) -> str:
    cls: Any = JobConfig
    for part in section.split("."):
        if not dataclasses.is_dataclass(cls):
            return "…"
        cls = typing.get_type_hints(cls).get(part)
    return dataclasses.fields(cls)[0].name if dataclasses.is_dataclass(cls) else "…"


def column_for(key: str) -> tuple[Column | None, str | None]:
    """``(Column, None)`` for a valid column key, ``(None, message)`` otherwise. A key whose first
    dotted part is a config section (:data:`CONFIG_SECTIONS`) is a hyperparameter, anything else a
    metric name."""
    key = key.strip()
    first = key.split(".", 1)[0]
    if first in CONFIG_SECTIONS:
        problem = _config_key_problem(key.split("."))
        return (None, problem) if problem else (Column(key, "config"), None)
    if not USER_METRIC_NAME.fullmatch(key):
        return None, (f"“{key[:80]}” is neither a metric name (a letter or _, then letters, digits, _ . / -; "
                      f"at most 100) nor a hyperparameter key ({', '.join(s + '.…' for s in CONFIG_SECTIONS)}).")
    return Column(key, "metric"), None


def parse_columns(value: str | Iterable[str] | None) -> tuple[list[Column], list[str]]:
    """Columns from ``"val_accuracy,train.lr"`` (or a list of keys): ``([Column, ...], [problems])``,
    the valid ones in order without repeats; a problem per invalid key and one when more than
    :data:`MAX_COLUMNS` are asked for (the first ones are kept)."""
    keys = value.split(",") if isinstance(value, str) else list(value or [])
    columns: list[Column] = []
    problems: list[str] = []
    for key in keys:
        if not isinstance(key, str):
            problems.append(f"A column is a metric name or a hyperparameter key, got {key!r:.60}.")
            continue
        if not key.strip():
            continue
        column, problem = column_for(key)
        if problem:
            problems.append(problem)
        elif column not in columns:
            columns.append(column)
    if len(columns) > MAX_COLUMNS:
        problems.append(f"At most {MAX_COLUMNS} columns, got {len(columns)}; the first {MAX_COLUMNS} are shown.")
        columns = columns[:MAX_COLUMNS]
    return columns, problems


MAX_LISTED_METRICS = 30
"""Metric names an unknown-sort message lists at most (the rest are counted)."""


def sort_keys_text(metrics: Collection[str] = ()) -> str:
    """The sort keys in words, for an error message: the fixed ones, the trainer's metrics and
    ``metrics`` (the names the user's jobs reported), and the hyperparameter form."""
    names = sorted(set(GLOBAL_METRICS) | set(metrics))
    shown = ", ".join(names[:MAX_LISTED_METRICS])
    if len(names) > MAX_LISTED_METRICS:
        shown += f" and {len(names) - MAX_LISTED_METRICS} more"
    return (f"Sort by {', '.join(BUILTIN_SORTS)}; a metric: {shown}; or a hyperparameter key "
            f"({', '.join(s + '.…' for s in CONFIG_SECTIONS)}, e.g. train.lr), with - in front for descending.")


def sort_problem(sort: str, *, metrics: Collection[str] | None = None) -> str | None:
    """Why ``sort`` (``"-val_accuracy"``) is not a sort key; None when it is.

    ``metrics``: the metric names the user's jobs reported (``selectors.metric_names_for_user``). Given,
    a metric key must be one of them or one of the trainer's own (``GLOBAL_METRICS``): ``?sort=bogus``
    is refused with the allowed keys listed, not run as a sort on a value no job has (which would look
    like no sort at all). None: any well-formed metric name (a saved filter's stored query, checked
    without a user's jobs at hand)."""
    key = sort.strip().removeprefix("-")
    if key in BUILTIN_SORTS:
        return None
    if not key:
        return f"Sort by what? {sort_keys_text(metrics or ())}"
    column, problem = column_for(key)
    if problem:
        return f"Cannot sort by “{sort.strip()[:80]}”: {problem} {sort_keys_text(metrics or ())}"
    if (metrics is not None and column.kind == "metric" and key not in GLOBAL_METRICS
            and key not in metrics):
        return (f"Cannot sort by “{sort.strip()[:80]}”: it is not a sort key, and no job of yours reported a "
                f"metric of that name. {sort_keys_text(metrics)}")
    return None


def sorts_by_user_metric(sort: str) -> bool:
    """Whether the sort key ``sort`` names a metric other than the trainer's own (one that
    :func:`sort_problem` accepts only among the user's reported ``metrics``)."""
    key = sort.strip().removeprefix("-")
    if key in BUILTIN_SORTS or key in GLOBAL_METRICS:
        return False
    column, _ = column_for(key)
    return column is not None and column.kind == "metric"


def ordering(sort: str | None) -> list[Any]:
    """``order_by`` arguments for a valid sort key (:func:`sort_problem` is None): the key's column,
    rows without a value last in either direction, then newest first (a total order, so pages do not
    overlap). ``None`` / ``""``: newest first. ValueError for an invalid key."""
    sort = (sort or DEFAULT_SORT).strip()
    problem = sort_problem(sort)
    if problem:
        raise ValueError(problem)
    descending = sort.startswith("-")
    key = sort.removeprefix("-")
    tie = ["-created_at", "-id"]
    if key in BUILTIN_SORTS:
        field = BUILTIN_SORTS[key][0]
        if field == "created_at":
            return ["-created_at", "-id"] if descending else ["created_at", "id"]
        if field == "id":
            return ["-id"] if descending else ["id"]
        return [OrderBy(F(field), descending=descending), *tie]
    column, _ = column_for(key)
    value = MetricSortValue(column.key) if column.kind == "metric" else JSONPathValue(column.field, column.path)
    return [OrderBy(value, descending=descending, nulls_last=True), *tie]


class JSONPathValue(Func):
    """The value at ``path`` inside the JSON column ``field``, for ORDER BY: numbers by value, and SQL
    NULL both where the path is missing and where it holds JSON null (a metric that was not finite),
    so both sort last and tie. Django's key transforms cannot say this alike on both databases:
    on SQLite they give JSON null as the text ``'null'``, which sorts after every number.

    PostgreSQL: ``col #> '{train,lr}'`` (jsonb; numbers compare numerically); SQLite:
    ``json_extract(col, '$."train"."lr"')`` (numbers as numbers, strings as text)."""

    output_field = JSONField()

    def __init__(self, field: str, path: tuple[str, ...]) -> None:
        super().__init__(F(field))
        self.path = tuple(path)

    def as_postgresql(self, compiler, connection, **extra):
        lhs, params = compiler.compile(self.source_expressions[0])
        value = f"({lhs} #> %s::text[])"
        path = list(self.path)
        return (f"(CASE WHEN jsonb_typeof({value}) = 'null' THEN NULL ELSE {value} END)",
                (*params, path, *params, path))

    def as_sqlite(self, compiler, connection, **extra):
        lhs, params = compiler.compile(self.source_expressions[0])
        path = "$." + ".".join(json.dumps(part) for part in self.path)
        return (f"(CASE WHEN json_type({lhs}, %s) = 'null' THEN NULL ELSE json_extract({lhs}, %s) END)",
                (*params, path, *params, path))

    def as_sql(self, compiler, connection, **extra):
        raise NotImplementedError(f"sorting on JSON values supports PostgreSQL and SQLite, not {connection.vendor}")


class MetricSortValue(JSONPathValue):
    """A job's final value of metric ``name`` (``final_metrics -> name``) as the job list sorts by it,
    with :meth:`page_keys`, which reads a page of that order through ``FinalMetricValue``'s index on
    PostgreSQL instead of the JSON of every visible job (bench/RESULTS.md: 135 ms of SQL at 100,000
    jobs, each request)."""

    def __init__(self, name: str) -> None:
        super().__init__("final_metrics", (name,))
        self.metric = name

    def page_keys(self, queryset, offset: int, limit: int, *, descending: bool) -> list[Any] | None:
        """The primary keys of rows ``offset`` .. ``offset + limit − 1`` of ``queryset`` (TrainingJobs,
        ordered by this value, rows without one last, ties newest first: :func:`ordering`), in no
        particular order (``jobs.pagination.page_rows`` orders the rows it reads with them), in one
        query; None where the JSON sort stays (not PostgreSQL).

        The jobs with a finite value come first, in the order of the index on ``(name, value,
        created_at, job)`` (an index range read joined to the jobs, stopping at the page's end); the
        jobs without one (the metric never reported, or its last value not finite) follow, newest
        first. The statement reads the valued jobs up to the page's end twice (to count how many of the
        page they fill, then the page's own), and the others only where the valued ones run short:
        their branch's ``LIMIT`` is then above 0, computed by PostgreSQL from that count (a ``LIMIT 0``
        never reads its rows). One query whatever the page, as the list's other orders."""
        connection = connections[queryset.db]
        if connection.vendor != "postgresql":
            return None
        offset, limit = int(offset), int(limit)
        base = queryset.order_by()
        value = F("final_metric_values__value")
        valued = (base.filter(final_metric_values__name=self.metric)
                  .order_by(value.desc() if descending else value.asc(), F("final_metric_values__created_at").desc(),
                            F("final_metric_values__job_id").desc())
                  .values_list("pk", flat=True))
        missing = ~Exists(FinalMetricValue.objects.filter(job_id=OuterRef("pk"), name=self.metric))
        rest = base.filter(missing).order_by("-created_at", "-id").values_list("pk", flat=True)
        head_sql, head_params = valued[:offset + limit].query.sql_with_params()
        page_sql, page_params = valued[offset:offset + limit].query.sql_with_params()
        rest_sql, rest_params = rest.query.sql_with_params()
        # n: the valued jobs up to the page's end (at most offset + limit); the others fill what they leave.
        sql = (f"WITH n AS MATERIALIZED (SELECT count(*) AS n FROM ({head_sql}) AS head) "
               f"(SELECT * FROM ({page_sql}) AS valued) UNION ALL "
               f"(SELECT * FROM ({rest_sql} LIMIT greatest(0, {limit} - greatest(0, (SELECT n FROM n) - {offset})) "
               f"OFFSET greatest(0, {offset} - (SELECT n FROM n))) AS rest)")
        with connection.cursor() as cursor:
            cursor.execute(sql, (*head_params, *page_params, *rest_params))
            return [row[0] for row in cursor.fetchall()]


# --- tags ----------------------------------------------------------------------------------------


def clean_tags(value: Any) -> tuple[list[str], list[str]]:
    """``(tags, problems)``: ``value`` (a list of strings, or one string of tags separated by commas or
    spaces) as sorted, deduplicated tags, with a message per rule broken (every one at once). Upper
    case is lowered; each tag is :data:`TAG_RE`, at most :data:`MAX_TAG_LENGTH` characters; at most
    :data:`MAX_TAGS` tags."""
    if value is None:
        return [], []
    if isinstance(value, str):
        items: list[Any] = [t for t in re.split(r"[\s,]+", value) if t]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        return [], [f"Tags are a list of short labels (or one text of them separated by commas), got {type(value).__name__}."]
    problems: list[str] = []
    tags: set[str] = set()
    for item in items:
        if not isinstance(item, str):
            problems.append(f"A tag is text, got {item!r:.40}.")
            continue
        tag = item.strip().lower()
        if not tag:
            continue
        if len(tag) > MAX_TAG_LENGTH:
            problems.append(f"Tag “{tag[:MAX_TAG_LENGTH]}…” is {len(tag)} characters; at most {MAX_TAG_LENGTH}.")
        elif not TAG_RE.fullmatch(tag):
            problems.append(f"Tag “{tag[:60]}” may hold only lower-case letters, digits and _ . - "
                            f"(starting with a letter or digit), e.g. baseline or lr-0.1.")
        else:
            tags.add(tag)
    if len(tags) > MAX_TAGS:
        problems.append(f"At most {MAX_TAGS} tags on a job, got {len(tags)}.")
    return sorted(tags), problems


def tag_problem(tag: str) -> str | None:
    """Why ``tag`` (a ``?tag=`` filter) can be no job's tag; None when it can."""
    tags, problems = clean_tags([tag])
    return problems[0] if problems else None


class HasTag(Func):
    """``tags`` (a JSON list) holds ``tag``: a condition for ``.filter()``, on PostgreSQL jsonb
    containment (``@>``), on SQLite a ``json_each`` lookup (Django's ``contains`` on a JSONField is not
    available on SQLite)."""

    output_field = BooleanField()

    def __init__(self, field: str, tag: str) -> None:
        super().__init__(F(field))
        self.tag = tag

    def as_postgresql(self, compiler, connection, **extra):
        lhs, params = compiler.compile(self.source_expressions[0])
        return f"({lhs} @> %s::jsonb)", (*params, json.dumps([self.tag]))

    def as_sqlite(self, compiler, connection, **extra):
        lhs, params = compiler.compile(self.source_expressions[0])
        return f"EXISTS (SELECT 1 FROM json_each({lhs}) WHERE json_each.value = %s)", (*params, self.tag)

    def as_sql(self, compiler, connection, **extra):
        raise NotImplementedError(f"tag filters support PostgreSQL and SQLite, not {connection.vendor}")


# --- the query string ----------------------------------------------------------------------------


def clean_list_query(data: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The job list's own parameters of ``data`` (a QueryDict or a dict): ``(query, problems)`` with
    ``query`` = ``{param: text}`` for the valid, non-empty values of :data:`LIST_PARAMS` (anything else
    dropped) and ``problems`` = ``{param: [messages]}``. ``backend`` is checked to be an id here; whether
    the user may see it is the list's check when the query is used."""
    query: dict[str, str] = {}
    problems: dict[str, list[str]] = {}
    for param in LIST_PARAMS:
        raw = data.get(param)
        if isinstance(raw, (list, tuple)):
            raw = raw[-1] if raw else ""
        if raw is None:
            continue
        if not isinstance(raw, (str, int)) or isinstance(raw, bool):
            problems.setdefault(param, []).append(f"{param} is text, got {type(raw).__name__}.")
            continue
        value = str(raw).strip()
        if not value:
            continue
        problem = None
        if param == "state" and value.upper() not in JobStateChoices.values:
            problem = f"State “{value[:40]}” is not a job state; choose one of {', '.join(JobStateChoices.values)}."
        elif param == "backend" and not (value.isascii() and value.isdigit() and len(value) <= 18):
            problem = f"Backend “{value[:40]}” is not a backend id."
        elif param == "q" and len(value) > 200:
            problem = f"The search is {len(value):,} characters; at most 200."
        elif param == "tag":
            problem = tag_problem(value)
        elif param == "archived" and value not in ARCHIVED_CHOICES:
            problem = f"archived is 1 (archived jobs only), all (both) or 0 (the default), got “{value[:20]}”."
        elif param == "columns":
            columns, column_problems = parse_columns(value)
            if column_problems:
                problems.setdefault(param, []).extend(column_problems)
                continue
            value = ",".join(c.key for c in columns)
        elif param == "sort":
            problem = sort_problem(value)
        if problem:
            problems.setdefault(param, []).append(problem)
            continue
        query[param] = value.upper() if param == "state" else value
    return query, problems


def archived_filter(value: str | None) -> bool | None:
    """``?archived=``: False (hide archived jobs: absent, "" or "0"), True ("1": archived only), None
    ("all"). ValueError for another value."""
    value = (value or "").strip()
    if value not in ARCHIVED_CHOICES:
        raise ValueError(f"archived is 1 (archived jobs only), all (both) or 0 (the default), got “{value[:20]}”.")
    return {"": False, "0": False, "1": True, "all": None}[value]


# --- the log's rank filter -----------------------------------------------------------------------

MAX_RANK = 1_000_000
_HOST_PREFIX = r"(\[[A-Za-z0-9_.:/ -]{1,80}\] )?"


def rank_regex(rank: int) -> str:
    """A regular expression (the subset PostgreSQL's and Python's engines read alike) matching the log
    lines rank ``rank`` wrote, by the marks they carry:

    - ``[rank1]: ...``: torch's excepthook on every rank of a process group (a traceback's lines);
    - ``[rank 1] ...``: the trainer's user-code error block;
    - ``[launch] rank 1 (local rank 1, ...)`` and ``[trainer] rank 1 (...)``: the launcher's and the
      trainer's per-rank lines;
    - ``trainer error: rank 1: ...``: a rank's fatal error;
    - ``  rank      : 1 (local_rank: 1)``: torchrun's failure summary of the rank;

    each possibly after the host mark a multi-instance backend puts first (SageMaker ``[algo-2] ``,
    Kubernetes ``[node 1] ``, Vertex AI and Azure ML their replica's). Lines without a rank mark (the
    trainer's own reports, printed by rank 0 alone) belong to no rank filter."""
    n = int(rank)
    return (rf"^{_HOST_PREFIX}(\[rank{n}\]:|\[rank {n}\] |\[(launch|trainer)\] rank {n} |trainer error: rank {n}:)"
            rf"|trainer error: rank {n}:|^ +rank +: {n} \(local_rank")
