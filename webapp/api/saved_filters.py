"""``/api/saved-filters/``: the job list's saved filters (docs/experiments.md, "Saved filters"), the same
ones the job list page saves. List, create, retrieve, delete, and ``jobs/``: the jobs a filter selects,
in its sort order, paged like the job list. Private to their owner: another user's filter is a 404.
Querysets from ``jobs.selectors``, writes through ``jobs.services``."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from jobs import job_table, selectors, services, validation
from jobs.models import SavedFilter
from webapp.api.pagination import CappedLimitOffsetPagination
from webapp.api.serializers import TrainingJobSerializer
from webapp.errors import to_drf_validation_error

QUERY_HELP = ("The job list's parameters, each as text: " + ", ".join(job_table.LIST_PARAMS)
              + " (e.g. {\"state\": \"SUCCEEDED\", \"tag\": \"lr-sweep\", \"sort\": \"-val_accuracy\"}).")


class SavedFilterSerializer(serializers.ModelSerializer):
    query = serializers.DictField(child=serializers.CharField(), read_only=True, help_text=QUERY_HELP)

    class Meta:
        model = SavedFilter
        fields = ["id", "name", "query", "created_at", "updated_at"]
        read_only_fields = fields


class SavedFilterCreateSerializer(serializers.Serializer):
    """The request body of a create: checked by ``jobs.services.saved_filter_create``, every problem at once."""

    name = serializers.CharField(help_text="1–100 characters, unique among your saved filters.")
    query = serializers.DictField(child=serializers.CharField(), help_text=QUERY_HELP)


def _shape_problems(data) -> dict[str, list[str]]:
    """What is wrong with a create body's shape: fields a saved filter does not have, and keys of
    ``query`` that are not the job list's parameters (the service checks the values)."""
    problems = validation.Errors()
    validation.unknown_fields(problems, set(data) - {"id", "created_at", "updated_at"}, ("name", "query"),
                              what="a saved filter")
    query = data.get("query", {})
    if isinstance(query, dict):
        extra = sorted(map(str, set(query) - set(job_table.LIST_PARAMS)))
        if extra:
            problems["query"] = [f"Unknown job-list parameters: {', '.join(extra)[:200]}; "
                                 f"the list's are {', '.join(job_table.LIST_PARAMS)}."]
    return problems


@extend_schema_view(
    list=extend_schema(summary="Your saved job-list filters, by name"),
    retrieve=extend_schema(summary="One of your saved filters"),
    destroy=extend_schema(summary="Delete one of your saved filters"),
)
class SavedFilterViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                         viewsets.GenericViewSet):
    serializer_class = SavedFilterSerializer
    pagination_class = CappedLimitOffsetPagination
    permission_classes = [permissions.IsAuthenticated]

    def get_queryset(self):
        return selectors.saved_filter_list_for_user(user=self.request.user)

    @extend_schema(summary="Save a job-list filter", request=SavedFilterCreateSerializer,
                   responses={201: SavedFilterSerializer,
                              400: OpenApiResponse(description="Every problem of the name and the query at once")})
    def create(self, request: Request, format: str | None = None) -> Response:
        data = request.data
        if not isinstance(data, dict):
            raise ValidationError({"non_field_errors": ["Send a JSON object: {\"name\": ..., \"query\": {...}}."]})
        problems = _shape_problems(data)
        # The service checks the name and the values too when the shape is wrong, in a savepoint rolled
        # back: every problem in one answer, nothing saved.
        saved, error = validation.trial_call(
            lambda: services.saved_filter_create(owner=request.user, name=data.get("name"),
                                                 query=data.get("query", {})),
            valid=not problems, flagged=set())
        if error is not None:
            for field, messages in to_drf_validation_error(error).detail.items():
                problems.setdefault(field, []).extend(messages)
        if problems:
            raise ValidationError(problems)
        return Response(SavedFilterSerializer(saved).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: SavedFilter) -> None:
        services.saved_filter_delete(saved_filter=instance)

    @extend_schema(summary="The jobs a saved filter selects, in its sort order",
                   description="As GET /api/jobs/ with the filter's parameters (state, backend, q, tag, archived, "
                               "sort), paged with limit and offset.",
                   responses={200: TrainingJobSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="jobs")
    def jobs(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        saved = self.get_object()
        jobs = selectors.saved_filter_jobs_for_user(user=request.user, saved_filter=saved).select_related(
            "dataset", "model_spec", "backend")
        page = self.paginate_queryset(jobs)
        return self.get_paginated_response(
            TrainingJobSerializer(page, many=True, context=self.get_serializer_context()).data)
