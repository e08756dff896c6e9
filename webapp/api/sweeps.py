"""``/api/sweeps/``: create, list, retrieve (with its trials, best trial, progress and parameter
importances) and cancel a sweep (docs/sweeps.md). Querysets come from ``jobs.selectors`` (another
user's sweep is a 404); writes go through ``jobs.sweeps``."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from jobs import selectors, sweeps
from jobs.models import Sweep
from webapp.api.pagination import CappedLimitOffsetPagination
from webapp.api.serializers import ServiceSerializerMixin, TextField
from webapp.api.views import IsOwnerOrStaffToChange
from webapp.errors import to_drf_validation_error


class SweepSerializer(serializers.ModelSerializer):
    """A sweep as the list shows it."""

    owner = serializers.CharField(source="owner.username", read_only=True)
    budget_usd = serializers.DecimalField(
        max_digits=12, decimal_places=4, min_value=0, read_only=True, allow_null=True,
        help_text="USD for the whole sweep (more than 0): no trial starts whose estimate would take spend past it; "
                  "null = no limit.")

    class Meta:
        model = Sweep
        fields = ["id", "name", "owner", "team", "state", "message", "dataset", "model_spec", "backend", "sampler",
                  "seed", "objective_metric", "direction", "objective", "max_trials", "max_concurrent_trials",
                  "budget_usd", "pruner", "pruner_startup_trials", "pruner_warmup_epochs", "trial_estimate_usd",
                  "created_at", "ended_at"]
        read_only_fields = fields


class SweepDetailSerializer(SweepSerializer):
    """A sweep with its base job, search space, trials, best trial, progress and importances."""

    trials = serializers.SerializerMethodField()
    best_trial = serializers.SerializerMethodField()
    progress = serializers.SerializerMethodField()
    param_importances = serializers.SerializerMethodField()

    class Meta(SweepSerializer.Meta):
        fields = SweepSerializer.Meta.fields + ["base", "search_space", "trial_errors", "trials", "best_trial",
                                                "progress", "param_importances"]
        read_only_fields = fields

    def _trials(self, sweep: Sweep) -> list[dict]:
        cache = self.context.setdefault("_trials", {})
        if sweep.pk not in cache:
            cache[sweep.pk] = sweeps.sweep_trials(sweep=sweep)
        return cache[sweep.pk]

    def get_trials(self, sweep: Sweep) -> list[dict]:
        return [{**t, "cost_usd": None if t["cost_usd"] is None else str(t["cost_usd"])} for t in self._trials(sweep)]

    def get_best_trial(self, sweep: Sweep) -> dict | None:
        best = sweeps.best_trial(sweep, self._trials(sweep))
        return None if best is None else {"number": best["number"], "value": best["value"], "params": best["params"],
                                          "job_id": best["job_id"]}

    def get_progress(self, sweep: Sweep) -> dict:
        progress = sweeps.sweep_progress(sweep=sweep, trials=self._trials(sweep))
        return {k: (str(v) if k.endswith("_usd") and v is not None else v) for k, v in progress.items()}

    def get_param_importances(self, sweep: Sweep) -> dict[str, float]:
        return sweeps.param_importances(sweep=sweep)


class SweepCreateSerializer(ServiceSerializerMixin, serializers.Serializer):
    """What ``POST /api/sweeps/`` takes; values go to ``jobs.sweeps.sweep_create``, which checks them all.
    A key it does not know is refused (400 naming it, with the service's errors), as is a body that is
    no JSON object."""

    known_fields_what = "a sweep"

    name = TextField(max_length=200)
    team = serializers.IntegerField(required=False, allow_null=True, default=None)
    base = serializers.JSONField(help_text='The job each trial starts from: {"dataset": id or name, "model_spec": '
                                           'id or name, "backend": id or name, "epochs": 2, ...} (the fields of '
                                           'POST /api/jobs/).')
    search_space = serializers.JSONField(help_text=f"Dotted config key → distribution, e.g. {sweeps.SPACE_EXAMPLE}")
    sampler = TextField(default="tpe", help_text="grid, random or tpe.")
    seed = serializers.JSONField(default=0)
    objective_metric = TextField(default="val_accuracy", max_length=100)
    direction = TextField(default="maximize", help_text="maximize or minimize.")
    objective = TextField(default="final", help_text="final (the last value) or best (over the run).")
    max_trials = serializers.JSONField(default=10)
    max_concurrent_trials = serializers.JSONField(default=2)
    budget_usd = serializers.JSONField(default=None, help_text="USD for the whole sweep; null = no limit.")
    pruner = TextField(default="none", help_text="none, median or successive_halving.")
    pruner_startup_trials = serializers.JSONField(default=1)
    pruner_warmup_epochs = serializers.JSONField(default=0)

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["Send the sweep as a JSON object."]})
        return super().to_internal_value(data)

    def create(self, validated_data):
        return self._call(sweeps.sweep_create, owner=self.context["request"].user, **validated_data)


@extend_schema_view(
    list=extend_schema(summary="Your sweeps, newest first"),
    retrieve=extend_schema(summary="A sweep with its trials, best trial, progress, spend and parameter importances"),
    create=extend_schema(summary="Start a sweep", request=SweepCreateSerializer,
                         responses={201: SweepDetailSerializer}),
)
class SweepViewSet(mixins.ListModelMixin, mixins.CreateModelMixin, mixins.RetrieveModelMixin,
                   viewsets.GenericViewSet):
    pagination_class = CappedLimitOffsetPagination
    permission_classes = [IsOwnerOrStaffToChange]

    def get_queryset(self):
        return selectors.sweep_list_for_user(user=self.request.user, state=self.request.query_params.get("state"))

    def get_serializer_class(self):
        if self.action == "create":
            return SweepCreateSerializer
        if self.action == "list":
            return SweepSerializer
        return SweepDetailSerializer

    def create(self, request: Request, *args, **kwargs) -> Response:
        serializer = SweepCreateSerializer(data=request.data, context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        sweep = serializer.save()
        data = SweepDetailSerializer(sweep, context=self.get_serializer_context()).data
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(summary="Cancel the sweep: no new trials, its running trials cancelled", request=None,
                   responses={200: SweepDetailSerializer, 400: OpenApiResponse(description="Sweep already ended")})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        sweep = self.get_object()
        try:
            sweep = sweeps.sweep_cancel(sweep=sweep)
        except DjangoValidationError as exc:
            raise to_drf_validation_error(exc) from None
        return Response(SweepDetailSerializer(sweep, context=self.get_serializer_context()).data)
