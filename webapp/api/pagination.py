"""The API's pagination, for every list: ``limit``/``offset`` with a capped count and position links.

The queries (capped count, keys-first page, positions) are :mod:`jobs.pagination`'s, shared with the
HTML list and the admin.
"""

from __future__ import annotations

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response
from rest_framework.utils.urls import remove_query_param, replace_query_param

from jobs import pagination as job_pages
from jobs.pagination import (
    COUNT_CAP, SEARCH_COUNT_CAP, capped_count, newest_first, older_than, page_rows, position_token, seek_rows,
)


def _whole_number(text: str) -> int | None:
    """``text`` as a whole number written in decimal digits (a sign allowed), or None: "1e3", "NaN",
    "2.5" and a number of more than 30 digits are not one."""
    text = text.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 30:
        return None
    return int(text)


class CappedLimitOffsetPagination(LimitOffsetPagination):
    """``?limit=&offset=`` pagination for every API list (``DEFAULT_PAGINATION_CLASS``): jobs, datasets,
    models, backends.

    Response: ``{"count": 3, "count_is_exact": true, "next": url|null, "previous": url|null,
    "results": [...]}``. ``count`` is exact up to ``COUNT_CAP`` (10,000) rows; past it ``count`` is
    10,000 and ``count_is_exact`` false (there are more). ``next`` is set when a row follows this page,
    found by reading ``limit`` + 1 rows, so it works at any depth. ``limit`` is at most ``max_limit``
    (500); a larger one is cut to it; without ``limit``, ``PAGE_SIZE`` (25, the HTML list's page); a
    ``limit`` below 1 or an ``offset`` below 0 or not a whole number is a 400 naming it. An
    ``offset`` past any row (up to 2⁶² and beyond) is an empty page. Two queries per page at any offset.

    ``next`` also carries ``after=<position of this page's last row>``: with it the page is the
    ``limit`` rows just older than that position (an index seek at any depth; ``offset`` then only
    numbers the page). A position that does not parse is ignored (plain ``offset``). For lists ordered
    newest first by ``(created_at, pk)``, as the jobs are; a list in another order (datasets, models
    and backends by name) pages by ``offset`` alone and ignores ``after``. An ``offset`` at or past the
    count cap without ``after`` spends the count's query on finding the position of row ``offset`` (the key
    columns only) and seeks from it: the same rows as ``OFFSET``, still two queries
    (:func:`jobs.pagination.seek_rows`).

    With a search (``?q=``) the count stops at ``SEARCH_COUNT_CAP`` (1,000) instead.
    """

    after_query_param = "after"
    search_query_param = "q"

    # default_limit: REST_FRAMEWORK["PAGE_SIZE"] (LimitOffsetPagination's); ?limit= up to max_limit
    max_limit = 500
    count_cap: int | None = None  # None: COUNT_CAP

    def get_limit(self, request):
        """``?limit=``: a whole number from 1 (above ``max_limit``: cut to it); absent: ``PAGE_SIZE``.
        Anything else is a 400 naming it (DRF's own class falls back to the default silently)."""
        text = request.query_params.get(self.limit_query_param)
        if text is None or text == "":
            return self.default_limit
        value = _whole_number(text)
        if value is None or value < 1:
            raise ValidationError({self.limit_query_param: [f"limit must be a whole number from 1 to "
                                                            f"{self.max_limit} (a larger one is cut to it), got "
                                                            f"{text[:40]!r}."]})
        return min(value, self.max_limit)

    def get_offset(self, request):
        """``?offset=``: a whole number from 0; absent: 0. Anything else is a 400 naming it."""
        text = request.query_params.get(self.offset_query_param)
        if text is None or text == "":
            return 0
        value = _whole_number(text)
        if value is None or value < 0:
            raise ValidationError({self.offset_query_param: [f"offset must be a whole number from 0, got "
                                                             f"{text[:40]!r}."]})
        return value

    def paginate_queryset(self, queryset, request, view=None):
        self.request = request
        self.limit = self.get_limit(request)
        if self.limit is None:
            return None
        if self.count_cap is None:  # read now: settings and tests may change them
            searching = bool(request.query_params.get(self.search_query_param, "").strip())
            self.count_cap = job_pages.SEARCH_COUNT_CAP if searching else job_pages.COUNT_CAP
        self.offset = self.get_offset(request)
        self.keyset = newest_first(queryset)
        older = older_than(queryset, request.query_params.get(self.after_query_param)) if self.keyset else None
        rows = None
        if older is None and self.offset >= self.count_cap and self.keyset:
            # Deep offset typed by hand: a row there says "more than count_cap" as the count would;
            # none (past the end) means this page is empty, and the count says how long the list is.
            rows = seek_rows(queryset, self.offset, self.limit + 1) or []
        counted = self.count_cap + 1 if rows else capped_count(queryset, self.count_cap)
        self.count_is_exact = counted <= self.count_cap
        self.count = min(counted, self.count_cap)
        if self.count > self.limit and self.template is not None:
            self.display_page_controls = True
        if counted == 0 or (self.count_is_exact and self.offset >= self.count):
            self.more, self.last_position = False, ""
            return []
        if rows is None:
            rows = page_rows(queryset, self.offset, self.limit + 1) if older is None else \
                page_rows(older, 0, self.limit + 1)
        self.more = len(rows) > self.limit
        rows = rows[: self.limit]
        self.last_position = position_token(rows[-1]) if rows and self.keyset else ""
        return rows

    def get_paginated_response(self, data):
        return Response({
            "count": self.count,
            "count_is_exact": self.count_is_exact,
            "next": self.get_next_link(),
            "previous": self.get_previous_link(),
            "results": data,
        })

    def get_next_link(self):
        if not self.more:
            return None
        url = self.request.build_absolute_uri()
        url = replace_query_param(url, self.limit_query_param, self.limit)
        if self.keyset:
            url = replace_query_param(url, self.after_query_param, self.last_position)
        return replace_query_param(url, self.offset_query_param, self.offset + self.limit)

    def get_previous_link(self):
        # Back from a page reached by position: by offset (a previous page is rarely deep).
        url = super().get_previous_link()
        return None if url is None else remove_query_param(url, self.after_query_param)

    def get_schema_operation_parameters(self, view):
        params = super().get_schema_operation_parameters(view)
        params.append({
            "name": self.after_query_param, "required": False, "in": "query",
            "description": "Position of the previous page's last row, as the next link carries it: the page "
                           "starts just after it (fast at any depth).",
            "schema": {"type": "string"},
        })
        return params

    def get_paginated_response_schema(self, schema):
        out = super().get_paginated_response_schema(schema)
        out["properties"]["count"]["description"] = (
            f"Matching rows, counted up to {COUNT_CAP:,} ({SEARCH_COUNT_CAP:,} with q); past that "
            f"{COUNT_CAP} ({SEARCH_COUNT_CAP}) with count_is_exact false.")
        out["properties"] = {"count": out["properties"]["count"],
                             "count_is_exact": {"type": "boolean", "example": True,
                                                "description": "False when there are more rows than count."},
                             **{k: v for k, v in out["properties"].items() if k != "count"}}
        out["required"] = ["count", "count_is_exact", "results"]
        return out
