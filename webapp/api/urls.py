"""``/api/`` routes: the viewsets, a token endpoint, the OpenAPI schema and its Swagger UI."""

from django.contrib.auth.decorators import login_required
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import DefaultRouter

from webapp.api import notifications, saved_filters, sweeps, views, views_compare
from webapp.auth import RateLimitedObtainAuthToken

router = DefaultRouter()
router.register("datasets", views.DatasetViewSet, basename="api-dataset")
router.register("models", views.ModelSpecViewSet, basename="api-model")
router.register("backends", views.BackendViewSet, basename="api-backend")
router.register("jobs", views.TrainingJobViewSet, basename="api-job")
router.register("sweeps", sweeps.SweepViewSet, basename="api-sweep")
router.register("webhooks", notifications.WebhookViewSet, basename="api-webhook")
router.register("saved-filters", saved_filters.SavedFilterViewSet, basename="api-saved-filter")

urlpatterns = [
    # POST username + password -> {"token": "..."}; then send "Authorization: Token <token>".
    # Rate limited like the login page (django-axes): 429 with the lockout message.
    path("auth/token/", RateLimitedObtainAuthToken.as_view(), name="api-token"),
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    # A browser page: someone not logged in is sent to the login page and back (the schema it loads
    # needs the session), rather than shown a bare 401. The split view serves its start-up script as
    # a file (?script), so the content security policy needs no inline script.
    path("docs/", login_required(SpectacularSwaggerSplitView.as_view(url_name="api-schema")), name="api-docs"),
    # Before the router: "compare" is not a job id.
    path("jobs/compare/", views_compare.JobCompareView.as_view(), name="api-job-compare"),
    path("notifications/", notifications.NotificationPreferenceView.as_view(), name="api-notification-settings"),
    path("", include(router.urls)),
]
