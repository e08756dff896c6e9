"""REST API (``/api/``). Every queryset comes from ``jobs.selectors`` scoped to the requesting user, so
another user's object is a 404; every write goes through ``jobs.services``."""

from __future__ import annotations

from collections.abc import Mapping

import django_filters
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view, inline_serializer
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from jobs import code_archives, job_table, selectors, services, validation
from jobs.models import JobStateChoices, TrainingJob
from webapp.api.pagination import CappedLimitOffsetPagination
from webapp.api.views_artifacts import JobArtifactActions
from webapp.api.serializers import (
    BackendQueueJobSerializer,
    BackendQueueSerializer,
    BackendSerializer,
    ConnectionCheckSerializer,
    DatasetSerializer,
    JobLogPageSerializer,
    ModelSpecSerializer,
    ModelSpecUploadSerializer,
    TrainingJobAnnotateSerializer,
    TrainingJobCreateSerializer,
    TrainingJobDetailSerializer,
    TrainingJobPreviewSerializer,
    TrainingJobSerializer,
)
from webapp.errors import to_drf_validation_error


class IsOwnerOrStaffToChange(permissions.IsAuthenticated):
    """Anyone who can see an object (own, or shared with their team) may read it; changing it (PUT,
    PATCH, cancel, rerun, test-connection) is for its owner or staff: a teammate gets 403, a stranger
    already got 404 from the scoped queryset."""

    message = "Only the owner (or staff) can change this; it is shared with you to see and use."

    def has_object_permission(self, request, view, obj) -> bool:
        return request.method in permissions.SAFE_METHODS or selectors.can_change(user=request.user, obj=obj)


class _ListCreateRetrieveUpdate(mixins.ListModelMixin, mixins.CreateModelMixin,
                                mixins.RetrieveModelMixin, mixins.UpdateModelMixin,
                                viewsets.GenericViewSet):
    """list / create / retrieve / update (PUT and PATCH); no delete: jobs keep what they ran on."""

    permission_classes = [IsOwnerOrStaffToChange]


@extend_schema_view(
    list=extend_schema(summary="Your datasets"),
    create=extend_schema(summary="Register a dataset (a local path is checked before it is saved)"),
)
class DatasetViewSet(_ListCreateRetrieveUpdate):
    serializer_class = DatasetSerializer

    def get_queryset(self):
        return selectors.dataset_list_for_user(user=self.request.user)


_MODEL_BODIES = {"application/json": ModelSpecSerializer, "multipart/form-data": ModelSpecUploadSerializer}


@extend_schema_view(
    list=extend_schema(summary="Your models"),
    create=extend_schema(summary="Register a model: a built-in architecture, your model function or your script",
                         description="A built-in model: kind builtin, architecture and params (JSON). Your code: "
                                     "kind code (entry_point package.module:function) or script (entry_point "
                                     "train.py or -m package.module, script_args), with the code as a multipart "
                                     "file field code (.zip or .tar.gz) or, in JSON, code_dir (a directory on the "
                                     "server). A refused archive is a 400 naming the member and why; nothing is "
                                     "stored then.",
                         request=_MODEL_BODIES),
    update=extend_schema(request=_MODEL_BODIES),
    partial_update=extend_schema(request=_MODEL_BODIES),
)
class ModelSpecViewSet(_ListCreateRetrieveUpdate):
    serializer_class = ModelSpecSerializer

    def get_queryset(self):
        return selectors.model_spec_list_for_user(user=self.request.user).select_related("code")

    def create(self, request: Request, *args, **kwargs) -> Response:
        refuse_oversized_upload(request)
        return super().create(request, *args, **kwargs)

    def update(self, request: Request, *args, **kwargs) -> Response:
        refuse_oversized_upload(request)
        return super().update(request, *args, **kwargs)


def refuse_oversized_upload(request) -> None:
    """A 400 on ``code`` before a body larger than an archive may be is read (the files of a
    multipart body are not bounded by DATA_UPLOAD_MAX_MEMORY_SIZE)."""
    problem = code_archives.request_too_large(request.META.get("CONTENT_LENGTH"))
    if problem:
        raise ValidationError({"code": [problem]})


@extend_schema_view(
    list=extend_schema(summary="Your compute backends"),
    create=extend_schema(summary="Register a compute backend"),
)
class BackendViewSet(_ListCreateRetrieveUpdate):
    serializer_class = BackendSerializer

    def get_queryset(self):
        return selectors.backend_list_for_user(user=self.request.user)

    @extend_schema(
        summary="Test the backend's connection with its saved settings",
        description="Runs the adapter's read-only checks (for a cloud: identity, storage, API access) and "
                    "returns each, ok or failed with what to fix. Failed checks are a 200 answer, not an error.",
        request=None,
        responses={200: ConnectionCheckSerializer(many=True)},
    )
    # A plain list of checks, not a page: without pagination_class=None the schema declared a
    # paginated object for what the view returns.
    @action(detail=True, methods=["post"], url_path="test-connection", pagination_class=None)
    def test_connection(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        backend = self.get_object()
        try:
            checks = services.backend_test_connection(backend=backend, user=request.user)
        except DjangoValidationError as exc:
            raise to_drf_validation_error(exc) from None
        return Response(ConnectionCheckSerializer(checks, many=True).data)

    @extend_schema(
        summary="What runs and waits on the backend, and which GPUs are in use",
        description="The backend's Celery queue, how many of your jobs run and wait there (and how many of "
                    "others' you cannot see), and the GPUs each active job holds. The jobs themselves: "
                    "running-jobs/ and waiting-jobs/.",
        responses={200: BackendQueueSerializer},
    )
    @action(detail=True, methods=["get"], url_path="queue", pagination_class=None)
    def queue(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        backend = self.get_object()
        queue = selectors.backend_queue_for_user(user=request.user, backend=backend)
        return Response(BackendQueueSerializer({
            "queue": queue.queue, "running_count": queue.running.count(), "waiting_count": queue.waiting.count(),
            "others_running": queue.others_running, "others_waiting": queue.others_waiting,
            "devices_in_use": queue.devices_in_use, "devices_held": queue.devices_held,
            "devices_free": queue.devices_free, "device_kind": queue.device_kind,
        }).data)

    @extend_schema(summary="Your jobs running on the backend (holding their GPUs), oldest start first",
                   responses={200: BackendQueueJobSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="running-jobs")
    def running_jobs(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        return self._queue_page(lambda queue: queue.running)

    @extend_schema(summary="Your jobs waiting on the backend, in the order they will start, with why each waits",
                   description="Ordered by priority (higher first), then submission; wait_reason says what each "
                               "waits for.",
                   responses={200: BackendQueueJobSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="waiting-jobs")
    def waiting_jobs(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        return self._queue_page(lambda queue: queue.waiting)

    def _queue_page(self, which) -> Response:
        backend = self.get_object()
        jobs = which(selectors.backend_queue_for_user(user=self.request.user, backend=backend))
        page = self.paginate_queryset(jobs.select_related("owner"))
        return self.get_paginated_response(BackendQueueJobSerializer(page, many=True).data)


class TrainingJobFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=JobStateChoices.choices)
    backend = django_filters.NumberFilter(field_name="backend_id", help_text="Backend id.")
    q = django_filters.CharFilter(
        method="search",
        help_text="A job id (7 or #7) finds that job only; other text matches the job's, dataset's, model's or "
                  "backend's name (any part, any case) or the whole provider job name (tb-job-…).")
    stalled = django_filters.ChoiceFilter(choices=[("true", "true"), ("false", "false")], method="filter_stalled",
                                          error_messages={"invalid_choice": "stalled must be true or false, got "
                                                                            "%(value)s."},
                                          help_text="true: only jobs past their state's deadline; false: the others "
                                                    "(any other value is a 400).")

    tag = django_filters.CharFilter(method="filter_tag", help_text="Jobs carrying this tag.")

    class Meta:
        model = TrainingJob
        fields = ["state", "backend", "q", "stalled", "tag"]

    def filter_tag(self, queryset, name, value):
        problem = job_table.tag_problem(value)
        if problem:
            raise ValidationError({"tag": [problem]})
        return queryset.filter(job_table.HasTag("tags", value.strip().lower()))

    def filter_stalled(self, queryset, name, value):
        return queryset.filter(stalled_at__isnull=value == "false")

    def search(self, queryset, name, value):
        # The selector owns what "search" means; re-query it with the same user and intersect.
        matching = selectors.training_job_list_for_user(user=self.request.user, q=value)
        return queryset.filter(pk__in=matching.values("pk"))


_SHAPE_FIELDS = ("backend", "nodes", "procs_per_node", "max_runtime_s", "instance_type", "spot", "strategy",
                 "pipeline_stages", "microbatches", "pipeline_schedule", "batch_size", "budget_usd", "dataset",
                 "hyperparameters")
"""What of a job request ``jobs.services.training_job_estimate`` prices without a model."""


_ESTIMATE_RESPONSE = inline_serializer("JobEstimate", fields={
    "estimated_cost_usd": serializers.CharField(
        allow_null=True, help_text="min(max_runtime_s × nodes × hourly_price_usd, budget_usd); null without a price."),
    "estimate_arithmetic": serializers.CharField(help_text='That sum in words: "1800 s × 1 node × $3.60/h".'),
    "hourly_price_usd": serializers.CharField(allow_null=True, help_text="One node's hourly price."),
    "max_runtime_covers": serializers.CharField(help_text="What max_runtime_s counts on this backend."),
    "world_size": serializers.IntegerField(help_text="nodes × procs_per_node."),
    "memory_plan": serializers.JSONField(allow_null=True, help_text="As a job's memory_plan; null where none is made."),
    "job": serializers.JSONField(allow_null=True, help_text="The job as POST /api/jobs/ would create it (as GET "
                                                            "/api/jobs/{id}/ shows a job; id null); null without "
                                                            "model_spec."),
})


_LIST_PARAMETERS = [
    OpenApiParameter("ordering", OpenApiTypes.STR, description=(
        "Sort key: created (the default, -created: newest first), name, state, backend, cost, id, a final metric "
        "(val_accuracy, a script's own name) or a hyperparameter key into the frozen config (train.lr, "
        "model.params.hidden); - in front for descending. Jobs without the value come last either way.")),
    OpenApiParameter("archived", OpenApiTypes.STR, enum=["0", "1", "all"], description=(
        "0 or absent: jobs not archived; 1: archived jobs only; all: both.")),
]


@extend_schema_view(
    list=extend_schema(summary="Your training jobs, newest first (or by ?ordering=)", parameters=_LIST_PARAMETERS),
    partial_update=extend_schema(
        summary="Change a job's tags, notes or archive mark (its owner or staff)",
        description="Only tags, notes and archived may be sent; every other field of a job is read-only (400). Only "
                    "a job that has ended can be archived.",
        request=TrainingJobAnnotateSerializer, responses={200: TrainingJobDetailSerializer}),
    retrieve=extend_schema(summary="A job with its config, state timeline, metrics summary and ranks"),
    create=extend_schema(
        summary="Launch a training job",
        request=TrainingJobCreateSerializer,
        responses={201: TrainingJobDetailSerializer},
    ),
)
class TrainingJobViewSet(JobArtifactActions, mixins.ListModelMixin, mixins.CreateModelMixin, mixins.RetrieveModelMixin,
                         viewsets.GenericViewSet):
    filterset_class = TrainingJobFilter
    pagination_class = CappedLimitOffsetPagination
    permission_classes = [IsOwnerOrStaffToChange]

    def get_queryset(self):
        jobs = selectors.training_job_list_for_user(user=self.request.user).select_related(
            "dataset", "model_spec", "backend"
        )
        if self.action != "list":
            return jobs  # an archived job is still fetched by its id
        params = self.request.query_params
        problems: dict[str, list[str]] = {}
        try:
            archived = job_table.archived_filter(params.get("archived"))
        except ValueError as exc:
            problems["archived"] = [str(exc)]
            archived = False
        ordering = (params.get("ordering") or "").strip()
        problem = job_table.sort_problem(ordering) if ordering else None
        if not problem and ordering and job_table.sorts_by_user_metric(ordering):
            problem = job_table.sort_problem(
                ordering, metrics=selectors.metric_names_for_user(user=self.request.user))
        if problem:
            problems["ordering"] = [problem]
        if problems:
            raise ValidationError(problems)
        if archived is not None:
            jobs = jobs.filter(archived_at__isnull=not archived)
        return jobs.order_by(*job_table.ordering(ordering)) if ordering else jobs

    def partial_update(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        job = self.get_object()
        body = TrainingJobAnnotateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            job = services.training_job_annotate(job=job, **body.validated_data)
        except DjangoValidationError as exc:
            raise to_drf_validation_error(exc) from None
        return Response(TrainingJobDetailSerializer(job, context=self.get_serializer_context()).data)

    @extend_schema(
        summary="The job's log lines after a cursor",
        description="Lines with seq > after (-1: from the start), at most limit (default 500, at most 5,000), "
                    "filtered by q (a substring, any case) and rank (lines marked as that rank's: [rank1]:, "
                    "[launch] rank 1, ...); a filtered call looks at most 200,000 lines after the cursor. The "
                    "trainer's metric records are the job's metrics, not log lines; a job logged by an older "
                    "Trainboard has them as lines too, returned only with metrics=true. next is the cursor for "
                    "the following call (more: lines remain): poll with it while the job runs.",
        parameters=[OpenApiParameter("after", OpenApiTypes.INT), OpenApiParameter("limit", OpenApiTypes.INT),
                    OpenApiParameter("q", OpenApiTypes.STR), OpenApiParameter("rank", OpenApiTypes.INT),
                    OpenApiParameter("metrics", OpenApiTypes.BOOL)],
        responses={200: JobLogPageSerializer},
    )
    # No filter backend: the job list's ?q= (a job search) must not filter which job this is.
    @action(detail=True, methods=["get"], url_path="logs", pagination_class=None, filter_backends=[])
    def logs(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        job = self.get_object()
        params = request.query_params
        problems: dict[str, list[str]] = {}

        def whole(name: str, default: int, low: int, high: int) -> int:
            raw = (params.get(name) or "").strip()
            if not raw:
                return default
            try:
                value = int(raw)
            except ValueError:
                problems[name] = [f"{name} must be a whole number, got “{raw[:20]}”."]
                return default
            if not low <= value <= high:
                problems[name] = [f"{name} must be {low:,} to {high:,}, got {value:,}."]
                return default
            return value

        after = whole("after", -1, -1, 2**31)
        limit = whole("limit", selectors.LOG_PAGE_LINES, 1, selectors.LOG_API_MAX_LIMIT)
        rank = whole("rank", -1, 0, job_table.MAX_RANK)
        q = (params.get("q") or "").strip()
        if len(q) > 200:
            problems["q"] = [f"q is {len(q):,} characters; at most 200."]
        metrics = (params.get("metrics") or "false").strip().lower()
        if metrics not in ("true", "false", "1", "0"):
            problems["metrics"] = [f"metrics is true or false, got “{metrics[:20]}”."]
        if problems:
            raise ValidationError(problems)
        lines, cursor, more = selectors.training_job_log_after(
            job=job, after=after, limit=limit, q=q, rank=None if rank < 0 else rank, metrics=metrics in ("true", "1"))
        return Response(JobLogPageSerializer({"lines": [{"seq": seq, "text": text} for seq, text in lines],
                                              "next": cursor, "more": more}).data)

    @extend_schema(
        summary="Check a job without launching it: every error, or its estimate and memory plan",
        description="The body of POST /api/jobs/, with the same checks; nothing is stored and nothing is sent to a "
                    "backend (the create's checks run, not its write). 200: the estimate, the memory plan and the job "
                    "as that POST would create it (its id null). Without model_spec: the price of the shape alone "
                    "(backend, nodes, procs_per_node, max_runtime_s, instance_type, spot, strategy, budget_usd), "
                    "job and memory_plan null, and no dataset asked for (a client's dry run before it uploads the "
                    "model's code). 400: every error by field, as the create's. The client's `trainboard run "
                    "--dry-run` and `trainboard estimate` call it.",
        responses={200: _ESTIMATE_RESPONSE, 400: OpenApiResponse(description="Every error, by field")},
    )
    @action(detail=False, methods=["post"], url_path="estimate", pagination_class=None, filter_backends=[])
    def estimate(self, request: Request, format: str | None = None) -> Response:
        body = self.get_serializer(data=request.data)
        if isinstance(request.data, Mapping) and request.data.get("model_spec") in (None, ""):
            return self._estimate_shape(body, request.data)
        body.is_valid(raise_exception=True)
        job = body._call(services.training_job_preview, owner=request.user, **body.validated_data)  # nothing stored
        data = TrainingJobPreviewSerializer(job, context=self.get_serializer_context()).data
        return Response({**{key: data.get(key) for key in ("estimated_cost_usd", "estimate_arithmetic",
                                                             "hourly_price_usd", "max_runtime_covers", "world_size",
                                                             "memory_plan")},
                         "job": {**data, "id": None, "events": [], "attempts": []}})

    def _estimate_shape(self, body, data: Mapping) -> Response:
        """The price of a job's shape before its model exists (a client's dry run before its upload)."""
        body.is_valid()
        errors = {key: messages for key, messages in body.errors.items() if key != "model_spec"
                  and not (key == "dataset" and data.get("dataset") in (None, ""))}
        if errors:
            raise ValidationError(errors)
        values = body._values_that_validate(body.errors)
        try:
            result = services.training_job_estimate(**{k: values[k] for k in _SHAPE_FIELDS if k in values})
        except DjangoValidationError as exc:
            raise to_drf_validation_error(exc) from None

        def money(value) -> str | None:
            return None if value is None else f"{value:.4f}"

        return Response({"estimated_cost_usd": money(result["estimated_cost_usd"]),
                         "estimate_arithmetic": result["arithmetic"],
                         "hourly_price_usd": money(result["hourly_price_usd"]),
                         "max_runtime_covers": result["max_runtime_covers"], "world_size": result["world_size"],
                         "memory_plan": None, "job": None})

    def get_serializer_class(self):
        if self.action in ("create", "estimate"):
            return TrainingJobCreateSerializer
        if self.action == "list":
            return TrainingJobSerializer
        return TrainingJobDetailSerializer

    @extend_schema(
        summary="Cancel a job",
        description="A queued job is cancelled at once; a running one moves to STOPPING and becomes "
                    "CANCELLED when the backend confirms it. A finished job answers 400.",
        request=None,
        responses={200: TrainingJobDetailSerializer, 400: OpenApiResponse(description="Job already finished")},
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        job = self.get_object()
        try:
            job = services.training_job_cancel(job=job)
        except DjangoValidationError as exc:
            raise to_drf_validation_error(exc) from None
        return Response(TrainingJobDetailSerializer(job, context=self.get_serializer_context()).data)

    @extend_schema(
        summary="Run a job again with the same frozen config",
        request=None,
        responses={201: TrainingJobDetailSerializer},
    )
    @action(detail=True, methods=["post"])
    def rerun(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        job = self.get_object()
        if isinstance(request.data, Mapping) and request.data:  # e.g. {"epochs": 5}: not run as the same job
            errors = validation.Errors()
            hint = (f"a re-run takes no fields (it runs job #{job.pk}'s frozen config again); for a job with "
                    f"edits, POST them to /api/jobs/{job.pk}/clone/.")
            validation.unknown_fields(errors, request.data, (), what="a re-run", hints=dict.fromkeys(request.data, hint))
            raise ValidationError(dict(errors))
        try:
            new_job = services.training_job_rerun(job=job, owner=request.user)
        except DjangoValidationError as exc:
            raise to_drf_validation_error(exc) from None
        data = TrainingJobDetailSerializer(new_job, context=self.get_serializer_context()).data
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="A new job like this one, with edits; or continue / fine-tune from it",
        description="The body holds overrides with the job create's field names (every one optional; "
                    "`hyperparameters` is deep-merged over the job's; `dataset`, `model_spec` and `backend` by "
                    "id or name; an unknown key is a 400 on that key), and `init_mode`: `continue` (resume this "
                    "job's last checkpoint and train to the new `epochs`) or `finetune` (its trained weights, a "
                    "new optimizer, epoch 0). The new job is yours (a teammate may clone a team job); `cloned_from` "
                    "is this job. 400 lists every error at once; nothing is created then.",
        request=OpenApiTypes.OBJECT,
        responses={201: TrainingJobDetailSerializer, 400: OpenApiResponse(description="Every error, by field")},
    )
    @action(detail=True, methods=["post"], permission_classes=[permissions.IsAuthenticated])
    def clone(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        job = self.get_object()  # a stranger's job is a 404; seeing it is enough to clone it
        if request.data is None:  # a JSON null: no object of overrides (no body at all is none)
            raise ValidationError({"non_field_errors": [
                'Send a JSON object of overrides, e.g. {"epochs": 5}, or no body to clone the job as it is.']})
        try:
            new_job = services.training_job_clone(owner=request.user, job=job, overrides=request.data)
        except DjangoValidationError as exc:
            raise to_drf_validation_error(exc) from None
        data = TrainingJobDetailSerializer(new_job, context=self.get_serializer_context()).data
        return Response(data, status=status.HTTP_201_CREATED)
