"""``GET /api/jobs/compare/``: the comparison of the comparison page as JSON (docs/comparing-runs.md).

Runs: ``?ids=12,15,19`` (in order), ``?filter=<id>`` (one of the user's saved filters, in its sort
order; another user's is a 404), or the job list's API filters (``state``, ``backend``, ``q``,
``stalled``: :class:`webapp.api.views.TrainingJobFilter`), newest first; at most
:data:`jobs.comparison.MAX_COMPARED_JOBS`. Ids the user may not see are listed in ``not_found``, like
ids of no job (existence is never revealed).
"""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import comparison, selectors
from jobs.models import SavedFilter
from webapp.api.views import TrainingJobFilter
from webapp.errors import to_drf_validation_error


class JobCompareView(APIView):
    @extend_schema(
        summary="Compare runs: every metric's series, final and best values, and the config diff",
        description="Runs by ids=12,15,19 (kept in that order) or by the job list's filters (state, backend, q, "
                    "stalled; newest first), at most 20. The answer: runs (id, name, state, t0: unix seconds of "
                    "the run's first point), metrics (name, direction min/max/null, kind, per_rank), table (each "
                    "run's final and best value per global metric), best (per metric and column, the id of the "
                    "best run), config (rows key, values per run, differs), series and rank_series (points "
                    "{x: step, y: value or null, t: unix seconds}), not_found (asked ids you cannot see or that "
                    "do not exist), matched (runs the selection matched, before the cap of 20).",
        parameters=[OpenApiParameter("ids", str, description="Job ids, comma-separated (e.g. 12,15,19)."),
                    OpenApiParameter("filter", int, description="The id of one of your saved filters "
                                                                "(GET /api/saved-filters/): its jobs, in its order.")],
        responses={200: OpenApiResponse(description="The comparison"),
                   400: OpenApiResponse(description="A part of ids that is not a job id, or a bad filter value"),
                   404: OpenApiResponse(description="filter names none of your saved filters")},
    )
    def get(self, request: Request, format: str | None = None) -> Response:
        not_found: list[int] = []
        if "ids" in request.query_params:
            try:
                ids = comparison.parse_job_ids(request.query_params.get("ids", ""))
            except DjangoValidationError as exc:
                raise to_drf_validation_error(exc) from None
            found, not_found = comparison.training_jobs_by_ids_for_user(user=request.user, ids=ids)
            jobs, matched = comparison.limit_jobs(found)
        elif "filter" in request.query_params:
            raw = request.query_params.get("filter", "").strip()
            if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
                raise ValidationError({"filter": [f"“{raw[:40]}” is not a saved filter's id (GET /api/saved-filters/)."]})
            try:
                jobs, matched = comparison.limit_jobs(
                    selectors.saved_filter_jobs_for_user(user=request.user, saved_filter=int(raw)))
            except SavedFilter.DoesNotExist:
                raise NotFound(f"Saved filter #{raw} not found: saved filters are private to their owner.") from None
        else:
            filterset = TrainingJobFilter(request.query_params, request=request,
                                          queryset=selectors.training_job_list_for_user(user=request.user))
            if not filterset.is_valid():
                raise ValidationError(filterset.errors)
            jobs, matched = comparison.limit_jobs(filterset.qs)
        result = comparison.training_job_comparison(jobs=jobs)
        return Response({**result, "not_found": not_found, "matched": matched,
                         "limit": comparison.MAX_COMPARED_JOBS,
                         "message": comparison.limit_message(len(jobs), matched)})
