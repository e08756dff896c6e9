"""Pagination that costs the same on page 1 and page 4,000 of 100,000 jobs.

Two things make a plain ``Paginator``/``LimitOffsetPagination`` slow on a long list:

- ``COUNT(*)`` visits every matching row. Here the count stops at ``COUNT_CAP`` + 1 rows
  (``SELECT COUNT(*) FROM (SELECT … LIMIT 10001)``); past it the list says "10,000+" and the API
  answers ``count: 10000`` with ``count_is_exact: false``.
- ``OFFSET n`` on the full row, with its joins, builds and throws away n joined rows. Here the page's
  primary keys are picked first by a subquery that selects only ``pk`` (an index-only scan on
  ``job_list_key``, jobs/migrations/0006_joblist_key_index.py, or with a state / backend filter on
  ``job_list_state`` / ``job_list_backend``, 0004_scale_indexes.py), and only those rows are fetched with
  their joins: ``WHERE id IN (SELECT id … ORDER BY … LIMIT l OFFSET n)``. That still reads n index
  entries; the HTML list's "Older" / "Newer" links therefore carry the position ``(created_at, id)``
  of the page's last / first row and seek to it (:meth:`CappedCountPaginator.keyset_page`), so
  following them costs the same at any depth.
- A deep ``?page=N`` or ``?offset=n`` typed by hand (``n`` at or past the count cap) still has to read n
  index entries: nothing records where row n is. There, the count would only say "more than the cap",
  which a row at ``n`` says too, so the count's query is spent finding the position of row ``n``
  instead (:func:`position_at`: ``SELECT created_at, id … ORDER BY … LIMIT 1 OFFSET n``, an index-only
  scan of the key columns, no join, no other column), and the page is read by seeking to it
  (:func:`at_or_older`), as the links do: the same rows as ``OFFSET n`` (the order is total, ``id``
  breaks ties), one skip instead of a skip plus a 10,001-row count. Past the end it falls back to the
  count (one query more).

Searches count up to ``SEARCH_COUNT_CAP`` (1,000) only: a search's count cannot come from an index alone
(the name arms need the rows), so each counted match is a heap row; "1,000+ matches" says enough.

Each page is a fixed number of queries whatever its depth or the list's length: one capped count (on a
deep page, the position) and one page query; a page number past the end costs one or two more. The
subquery needs ``LIMIT`` inside ``IN (…)``, which PostgreSQL and SQLite allow. A list sorted by a metric
(``jobs.job_table.MetricSortValue``) picks its page's keys through that metric's index on PostgreSQL first
(one query), then reads those rows: one query more than another order, on every page alike. Used by the HTML job list
(webapp.views), the admin's job changelist (jobs.admin; the admin counts before it asks for a page, so
its deep pages read by offset) and the API's job pagination (webapp.api.pagination, whose ``next`` link
carries the position of the page's last row, ``after=``, so a client that follows ``next`` seeks like
the HTML links; a deep ``offset`` typed without ``after`` finds its position as above).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Sequence

from django.core.paginator import EmptyPage, Page, PageNotAnInteger, Paginator
from django.db.models import Q, QuerySet
from django.utils.functional import cached_property

COUNT_CAP = 10_000
"""Rows counted at most; a longer list is reported as "10,000+" (count_is_exact false)."""

MAX_OFFSET = 2**62
"""No row lies deeper (PostgreSQL's OFFSET is a bigint): a page number or offset past it answers "no rows"
without a query instead of failing (``?page=99999999999999999999``)."""

SEARCH_COUNT_CAP = 1_000
"""Matches of a search (``?q=``) counted at most: "1,000+" past it. Each counted match is a heap row
(the name arms are in no covering index), not an index entry as in the plain list's count, so a search
counts a tenth as far (timings in bench/RESULTS.md, "Job list at 100,000 jobs")."""


def capped_count(queryset: QuerySet, cap: int = COUNT_CAP) -> int:
    """The number of rows of ``queryset``, but at most ``cap + 1`` (one query, at most cap + 1 rows read).

    A result above ``cap`` means "more than cap".
    """
    return queryset.order_by()[: cap + 1].count()


def page_rows(queryset: QuerySet, offset: int, limit: int) -> list[Any]:
    """Rows ``offset`` .. ``offset + limit − 1`` of the ordered ``queryset`` in one query: the slice is
    taken on primary keys alone (a subquery), then only those rows are read with their joins. Where the
    first ordering key reads its own pages (``page_keys``, a metric sort on PostgreSQL), its keys
    come first, in a query of their own (the subquery's place).

    ``offset``, ``limit``: non-negative row counts. Keeps the queryset's ordering, filters,
    ``select_related`` and ``only`` / ``defer``. Raises ``ValueError`` for a negative offset or limit.
    """
    if offset < 0 or limit < 0:
        raise ValueError(f"offset and limit must be >= 0, got offset={offset}, limit={limit}")
    if limit == 0:
        return []
    if not queryset.ordered:
        raise ValueError("page_rows needs an ordered queryset (the same page must come back each time)")
    if offset > MAX_OFFSET:
        return []
    ordering = queryset.query.order_by or queryset.model._meta.ordering
    # An order whose first key reads its own pages (jobs.job_table.MetricSortValue: a metric's index
    # instead of the JSON of every row) gives the page's keys itself.
    first = ordering[0] if ordering else None
    page_keys = getattr(getattr(first, "expression", None), "page_keys", None)
    keys = page_keys(queryset, offset, limit, descending=first.descending) if page_keys else None
    if keys is None:
        keys = queryset.values("pk")[offset:offset + limit]
    rows = (queryset.model._base_manager.filter(pk__in=keys)
            .select_related(*_select_related(queryset)).order_by(*ordering))
    rows.query.deferred_loading = queryset.query.deferred_loading  # keep .only() / .defer()
    return list(rows)


def _select_related(queryset: QuerySet) -> Sequence[str]:
    """The field paths of ``queryset.select_related(...)`` (``query.select_related`` is a nested dict)."""
    tree = queryset.query.select_related
    if not isinstance(tree, dict):
        return []
    paths: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for name, child in node.items():
            path = f"{prefix}{name}"
            if child:
                walk(child, path + "__")
            else:
                paths.append(path)

    walk(tree, "")
    return paths


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def position_token(row) -> str:
    """Where ``row`` stands in a newest-first list: ``"<created_at in µs since 1970>.<pk>"``, exact
    (integer arithmetic), for the ``after`` / ``before`` links."""
    return f"{(row.created_at - _EPOCH) // dt.timedelta(microseconds=1)}.{row.pk}"


def parse_position(token: str | None) -> tuple[dt.datetime, int] | None:
    """``(created_at, pk)`` from :func:`position_token`'s text; None for anything else (a hand-edited
    link falls back to the page number, never an error)."""
    try:
        micros, pk = str(token).split(".")
        return _EPOCH + dt.timedelta(microseconds=int(micros)), int(pk)
    except (ValueError, OverflowError):
        return None


class CappedPage(Page):
    """A page that knows whether another follows without the total (the paginator read one row more),
    with the positions of its first and last rows for keyset links (``newer_token``, ``older_token``)."""

    def __init__(self, object_list, number, paginator, more: bool) -> None:
        super().__init__(object_list, number, paginator)
        self.more = more

    def has_next(self) -> bool:
        return self.more

    @property
    def older_token(self) -> str:
        return position_token(self.object_list[-1]) if self.object_list else ""

    @property
    def newer_token(self) -> str:
        return position_token(self.object_list[0]) if self.object_list else ""


class CappedCountPaginator(Paginator):
    """A Django ``Paginator`` for long lists: the count stops at ``count_cap`` + 1 and each page is
    fetched by :func:`page_rows`.

    While the list has at most ``count_cap`` rows it behaves as ``Paginator`` (``count``,
    ``num_pages``, a page number past the end gives the last page through ``get_page``). Past the cap,
    ``count_is_exact`` is False, ``count`` is ``count_cap`` + 1, any page number is allowed, and
    ``has_next`` comes from reading one row more than a page. Always two queries per page.
    """

    def __init__(self, object_list, per_page, orphans: int = 0, allow_empty_first_page: bool = True, *,
                 count_cap: int | None = None, **kwargs) -> None:
        # Positional orphans / allow_empty_first_page: the admin's get_paginator passes them so.
        super().__init__(object_list, per_page, orphans, allow_empty_first_page, **kwargs)
        self.count_cap = COUNT_CAP if count_cap is None else count_cap

    @cached_property
    def count(self) -> int:
        return capped_count(self.object_list, self.count_cap)

    @property
    def count_is_exact(self) -> bool:
        return self.count <= self.count_cap

    def validate_number(self, number) -> int:
        if self.count_is_exact:
            return super().validate_number(number)
        number = self._to_int(number)
        if number < 1:
            raise EmptyPage(self.error_messages["min_page"])
        return number

    def _to_int(self, number) -> int:
        # Paginator.validate_number's int parsing, without its upper bound.
        try:
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            return int(number)
        except (TypeError, ValueError):
            raise PageNotAnInteger(self.error_messages["invalid_page"]) from None

    def get_page(self, number) -> CappedPage:
        """As ``Paginator.get_page``, except that a page number below 1 gives the first page (Django's
        gives the last); past the cap a page number beyond the rows gives the last page the capped
        count covers."""
        try:
            if int(number) < 1:
                number = 1
        except (TypeError, ValueError, OverflowError):
            pass  # not a number: Paginator.get_page gives page 1
        deep = self._deep_page(number)  # before Paginator.get_page counts
        if deep is not None:
            return deep
        try:
            return super().get_page(number)
        except EmptyPage:
            return self.page(self.num_pages)

    def keyset_page(self, number, *, after: str | None = None, before: str | None = None) -> CappedPage:
        """The page of rows just older than position ``after`` (or just newer than ``before``), labelled
        page ``number``; for a list ordered newest first by ``(created_at, pk)``.

        This is how the list's "Older" / "Newer" links page: an index seek to the position, whatever
        the depth, where ``?page=N`` alone reads and skips N − 1 pages of keys. A position that does
        not parse, or leads to no rows, gives ``get_page(number)``. Same two queries as a numbered page.
        """
        position = parse_position(after if after else before)
        if position is None:
            return self.get_page(number)
        try:
            number = self._to_int(number)
        except PageNotAnInteger:
            number = 2
        at, pk = position
        if after:
            older = self.object_list.filter(Q(created_at__lte=at) & (Q(created_at__lt=at) | Q(pk__lt=pk)))
            rows = page_rows(older, 0, self.per_page + 1)
            more, rows = len(rows) > self.per_page, rows[: self.per_page]
            number = max(number, 2)
        else:
            newer = (self.object_list.filter(Q(created_at__gte=at) & (Q(created_at__gt=at) | Q(pk__gt=pk)))
                     .order_by("created_at", "pk"))
            rows = page_rows(newer, 0, self.per_page + 1)
            newest_reached = len(rows) <= self.per_page
            rows, more = list(reversed(rows[: self.per_page])), True  # the row at ``before`` follows
            number = 1 if newest_reached else max(number, 2)
        if not rows:
            return self.get_page(number)
        return CappedPage(rows, number, self, more)

    def _deep_page(self, number) -> CappedPage | None:
        """Page ``number`` when it starts at or past the count cap and has rows, read by
        :func:`seek_rows` in place of the count and the page query (still two queries); None otherwise
        (not counted yet, a shallow page, another ordering, or past the end: the caller counts)."""
        if "count" in self.__dict__ or not newest_first(self.object_list):
            return None
        try:
            number = self._to_int(number)
        except PageNotAnInteger:
            return None
        offset = (number - 1) * self.per_page
        if offset < self.count_cap:
            return None
        rows = seek_rows(self.object_list, offset, self.per_page + 1)
        if not rows:
            return None
        # A row at or past the cap: more than count_cap rows, all the capped count could have said.
        self.__dict__["count"] = self.count_cap + 1
        return CappedPage(rows[: self.per_page], number, self, len(rows) > self.per_page)

    def page(self, number) -> CappedPage:
        deep = self._deep_page(number)
        if deep is not None:
            return deep
        number = self.validate_number(number)
        offset = (number - 1) * self.per_page
        rows = page_rows(self.object_list, offset, self.per_page + 1)
        more = len(rows) > self.per_page
        rows = rows[: self.per_page]
        if not rows and number > 1:
            raise EmptyPage(self.error_messages["no_results"])
        return CappedPage(rows, number, self, more)


def newest_first(queryset: QuerySet) -> bool:
    """Whether ``queryset`` is ordered newest first by ``(created_at, pk)``, the order that positions
    (:func:`position_token`) describe: ``-created_at`` then ``-id`` / ``-pk`` (later keys change nothing,
    ``id`` is unique)."""
    ordering = list(queryset.query.order_by or (queryset.model._meta.ordering
                                                if queryset.query.default_ordering else ()))
    if len(ordering) < 2 or not all(isinstance(key, str) for key in ordering[:2]):
        return False
    pk = queryset.model._meta.pk.name
    return ordering[0] == "-created_at" and ordering[1] in ("-pk", f"-{pk}")


def position_at(queryset: QuerySet, offset: int) -> tuple[dt.datetime, int] | None:
    """``(created_at, pk)`` of row ``offset`` (from 0) of a newest-first ``queryset``, or None when it
    has no such row. One query that reads ``offset + 1`` index entries of the key columns and nothing
    else (an index-only scan on the list-order index; no join, no row is built)."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if offset > MAX_OFFSET:
        return None
    found = list(queryset.values_list("created_at", "pk")[offset:offset + 1])
    return (found[0][0], found[0][1]) if found else None


def at_or_older(queryset: QuerySet, position: tuple[dt.datetime, int]) -> QuerySet:
    """The rows of a newest-first ``queryset`` from ``position`` (that row included) on: with
    :func:`position_at`, ``at_or_older(qs, position_at(qs, n))[:k]`` is ``qs[n:n + k]``."""
    at, pk = position
    # created_at <= at outside the OR: the index seek's bound (as in keyset_page and older_than).
    return queryset.filter(Q(created_at__lte=at) & (Q(created_at__lt=at) | Q(pk__lte=pk)))


def seek_rows(queryset: QuerySet, offset: int, limit: int) -> list[Any] | None:
    """:func:`page_rows` ``(queryset, offset, limit)`` in two queries that do not read the skipped rows'
    columns: the position of row ``offset`` (:func:`position_at`), then ``limit`` rows from it by an
    index seek (:func:`page_rows` on :func:`at_or_older`). None when the queryset has no row
    ``offset``; needs a :func:`newest_first` queryset (ValueError otherwise).

    The same rows as ``OFFSET offset LIMIT limit``: ``(created_at, pk)`` orders the rows totally.
    """
    if not newest_first(queryset):
        raise ValueError("seek_rows needs a queryset ordered by -created_at, -pk")
    position = position_at(queryset, offset)
    if position is None:
        return None
    return page_rows(at_or_older(queryset, position), 0, limit)


def older_than(queryset: QuerySet, token: str | None) -> QuerySet | None:
    """The rows of a newest-first ``(created_at, pk)`` list older than position ``token``
    (:func:`position_token`), or None when ``token`` does not parse."""
    position = parse_position(token) if token else None
    if position is None:
        return None
    at, pk = position
    return queryset.filter(Q(created_at__lte=at) & (Q(created_at__lt=at) | Q(pk__lt=pk)))
