"""``/api/notifications/`` (the user's email choices) and ``/api/webhooks/`` (webhooks and their
delivery log). Querysets from ``jobs.selectors`` (a stranger's webhook is a 404; a teammate reads a
team webhook, only its owner or staff change it: 403), writes through ``jobs.services``. The signing
secret is in the create answer (and a ``rotate_secret`` update's) only. docs/notifications.md."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import selectors, services, validation
from jobs.models import NOTIFICATION_EVENTS, Webhook, WebhookDelivery
from jobs.validation import trial_call
from webapp.api.views import IsOwnerOrStaffToChange
from webapp.errors import to_drf_validation_error

EVENT_HELP = "Event names: " + ", ".join(NOTIFICATION_EVENTS) + "."


class NotificationPreferenceSerializer(serializers.Serializer):
    email_events = serializers.ListField(child=serializers.CharField(), required=False, help_text=EVENT_HELP)
    team_email_events = serializers.ListField(child=serializers.CharField(), required=False,
                                              help_text="Events of other members' jobs of your teams. " + EVENT_HELP)
    email = serializers.SerializerMethodField(help_text="Where the emails go (your account's address).")

    def get_email(self, obj) -> str:
        return obj.user.email


class WebhookSerializer(serializers.ModelSerializer):
    """A webhook as the API shows it: never its secret."""

    team = serializers.IntegerField(source="team_id", allow_null=True, required=False,
                                    help_text="One of your teams: every job of it; null: your own jobs.")
    owner = serializers.CharField(source="owner.username", read_only=True)
    events = serializers.ListField(child=serializers.CharField(), help_text=EVENT_HELP)
    url = serializers.CharField(max_length=None, help_text="http(s) URL on a public address.")
    name = serializers.CharField(max_length=None, required=False, allow_blank=True)
    format = serializers.CharField(required=False, help_text="json | slack")
    enabled = serializers.JSONField(required=False, help_text="true or false")

    class Meta:
        model = Webhook
        fields = ["id", "name", "url", "events", "format", "enabled", "team", "owner", "created_at", "updated_at"]
        read_only_fields = ["id", "owner", "created_at", "updated_at"]


class WebhookCreatedSerializer(WebhookSerializer):
    secret = serializers.CharField(read_only=True, help_text="The signing secret: shown in this answer only.")

    class Meta(WebhookSerializer.Meta):
        fields = [*WebhookSerializer.Meta.fields, "secret"]


class WebhookDeliverySerializer(serializers.ModelSerializer):
    status = serializers.CharField(read_only=True, help_text="delivered | given up | pending")

    class Meta:
        model = WebhookDelivery
        fields = ["id", "delivery_id", "event", "job", "status", "attempt_count", "attempts", "payload",
                  "created_at", "next_attempt_at", "delivered_at", "given_up_at"]
        read_only_fields = fields


def _service_fields(data) -> tuple[dict, dict[str, list[str]]]:
    """The fields a request body gives, as the service names them (``team`` stays ``team``), and the
    body's own errors (keys no webhook has), which :func:`_service_call` reports with the service's."""
    if not isinstance(data, dict):
        raise ValidationError({"non_field_errors": ["Send a JSON object."]})
    allowed = ("name", "url", "events", "format", "enabled", "team")
    own = validation.Errors()  # read-only fields sent back (id, owner, ...) are ignored
    validation.unknown_fields(own, set(data) - {"id", "owner", "created_at", "updated_at"},
                              (*allowed, "rotate_secret"), what="a webhook")
    return {k: data[k] for k in allowed if k in data}, dict(own)


def _service_call(call, own: dict[str, list[str]]):
    """``call()``'s result; with ``own`` errors of the request, the service is still called (rolled
    back: ``validation.trial_call``) and every error is answered in one 400."""
    result, exc = trial_call(call, valid=not own, flagged=set())
    if exc is None and not own:
        return result
    detail = dict(to_drf_validation_error(exc).detail) if exc is not None else {}
    for key, messages in own.items():
        detail[key] = [*messages, *detail.get(key, [])]
    raise ValidationError(detail)


class NotificationPreferenceView(APIView):
    """GET your email choices; PUT/PATCH them (lists of event names)."""

    permission_classes = [permissions.IsAuthenticated]
    serializer_class = NotificationPreferenceSerializer

    @extend_schema(summary="Your email notification choices", responses=NotificationPreferenceSerializer)
    def get(self, request: Request, format: str | None = None) -> Response:
        pref = selectors.notification_preference_for_user(user=request.user)
        return Response(NotificationPreferenceSerializer(pref).data)

    @extend_schema(summary="Choose the events you are emailed about", request=NotificationPreferenceSerializer,
                   responses=NotificationPreferenceSerializer)
    def patch(self, request: Request, format: str | None = None) -> Response:
        data = request.data if isinstance(request.data, dict) else None
        if data is None:
            raise ValidationError({"non_field_errors": ["Send a JSON object."]})
        own = validation.Errors()
        validation.unknown_fields(own, set(data) - {"email"}, ("email_events", "team_email_events"),
                                  what="the notification settings")
        pref = _service_call(lambda: services.notification_preference_update(
            user=request.user, email_events=data.get("email_events"),
            team_email_events=data.get("team_email_events")), dict(own))
        return Response(NotificationPreferenceSerializer(pref).data)

    put = patch


@extend_schema_view(
    list=extend_schema(summary="Your webhooks and your teams'"),
    create=extend_schema(summary="Register a webhook (the answer holds its signing secret, shown once)",
                         responses={201: WebhookCreatedSerializer}),
    partial_update=extend_schema(summary="Change a webhook; rotate_secret: true returns a new secret"),
)
class WebhookViewSet(mixins.ListModelMixin, mixins.CreateModelMixin, mixins.RetrieveModelMixin,
                     mixins.UpdateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    serializer_class = WebhookSerializer
    permission_classes = [IsOwnerOrStaffToChange]

    def get_queryset(self):
        return selectors.webhook_list_for_user(user=self.request.user).order_by("-created_at", "-id")

    def create(self, request: Request, *args, **kwargs) -> Response:
        fields, own = _service_fields(request.data)
        webhook, secret = _service_call(lambda: services.webhook_create(
            owner=request.user, url=fields.pop("url", None), events=fields.pop("events", None), **fields), own)
        data = WebhookSerializer(webhook).data
        data["secret"] = secret
        return Response(data, status=status.HTTP_201_CREATED)

    def update(self, request: Request, *args, **kwargs) -> Response:
        webhook = self.get_object()
        fields, own = _service_fields(request.data)
        rotate = request.data.get("rotate_secret") is True
        if request.method == "PUT":
            own.update({f: ["This field is required."] for f in ("url", "events") if f not in fields})
        webhook, secret = _service_call(
            lambda: services.webhook_update(webhook=webhook, rotate_secret=rotate, **fields), own)
        data = WebhookSerializer(webhook).data
        if secret:
            data["secret"] = secret
        return Response(data)

    def perform_destroy(self, instance: Webhook) -> None:
        services.webhook_delete(webhook=instance)

    @extend_schema(summary="The webhook's delivery log, newest first", responses=WebhookDeliverySerializer(many=True))
    @action(detail=True, methods=["get"], url_path="deliveries")
    def deliveries(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        webhook = self.get_object()
        page = self.paginate_queryset(selectors.webhook_deliveries(webhook=webhook))
        return self.get_paginated_response(WebhookDeliverySerializer(page, many=True).data)
