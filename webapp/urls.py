"""Top-level routes: the browser UI, the REST API under /api/, the admin and /healthz."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from django.views import defaults
from django.views.generic import RedirectView

from webapp import metrics, views, views_artifacts, views_compare, views_experiments, views_notifications, views_staff, views_sweeps

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="job-list", permanent=False), name="home"),
    path("healthz", views.healthz, name="healthz"),
    # Browsers (and the admin's pages, which do not link an icon) ask for /favicon.ico.
    path("favicon.ico", RedirectView.as_view(url=static("webapp/favicon.svg")), name="favicon"),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    # Datasets, models, backends
    path("datasets/", views.dataset_list, name="dataset-list"),
    path("datasets/new/", views.dataset_create, name="dataset-create"),
    path("datasets/<int:pk>/edit/", views.dataset_edit, name="dataset-edit"),
    path("models/", views.model_list, name="model-list"),
    path("models/new/", views.model_create, name="model-create"),
    path("models/<int:pk>/edit/", views.model_edit, name="model-edit"),
    path("backends/", views.backend_list, name="backend-list"),
    path("backends/new/", views.backend_create, name="backend-create"),
    path("backends/<int:pk>/", views.backend_detail, name="backend-detail"),
    path("backends/<int:pk>/edit/", views.backend_edit, name="backend-edit"),
    path("backends/<int:pk>/test-connection/", views.backend_test_connection, name="backend-test-connection"),
    # Jobs
    path("jobs/", views.job_list, name="job-list"),
    path("jobs/new/", views.job_create, name="job-create"),
    path("jobs/estimate/", views.job_estimate, name="job-estimate"),
    path("jobs/compare/", views_compare.job_compare, name="job-compare"),
    path("jobs/<int:pk>/", views.job_detail, name="job-detail"),
    path("jobs/<int:pk>/live/", views.job_live, name="job-live"),
    path("jobs/<int:pk>/metrics.json", views.job_metrics, name="job-metrics"),
    path("jobs/<int:pk>/cancel/", views.job_cancel, name="job-cancel"),
    path("jobs/<int:pk>/rerun/", views.job_rerun, name="job-rerun"),
    path("jobs/<int:pk>/artifacts/", views_artifacts.job_artifacts, name="job-artifacts"),
    path("jobs/<int:pk>/artifacts/<path:name>", views_artifacts.job_artifact_download, name="job-artifact-download"),
    # Sweeps (docs/sweeps.md)
    path("sweeps/", views_sweeps.sweep_list, name="sweep-list"),
    path("sweeps/new/", views_sweeps.sweep_create, name="sweep-create"),
    path("sweeps/<int:pk>/", views_sweeps.sweep_detail, name="sweep-detail"),
    path("sweeps/<int:pk>/cancel/", views_sweeps.sweep_cancel, name="sweep-cancel"),
    # The experiment table and the full log (docs/experiments.md)
    path("jobs/archive/", views_experiments.job_bulk_archive, name="job-bulk-archive"),
    path("jobs/columns/", views_experiments.job_columns_save, name="job-columns"),
    path("jobs/filters/", views_experiments.saved_filter_create, name="savedfilter-create"),
    path("jobs/filters/<int:pk>/", views_experiments.saved_filter_open, name="savedfilter-open"),
    path("jobs/filters/<int:pk>/delete/", views_experiments.saved_filter_delete, name="savedfilter-delete"),
    path("jobs/<int:pk>/notes/", views_experiments.job_annotate, name="job-annotate"),
    path("jobs/<int:pk>/archive/", views_experiments.job_archive, name="job-archive"),
    path("jobs/<int:pk>/logs/", views_experiments.job_logs, name="job-logs"),
    path("jobs/<int:pk>/logs/download/", views_experiments.job_logs_download, name="job-logs-download"),
    # Notifications: email choices, webhooks and their delivery log; /metrics for Prometheus
    path("account/notifications/", views_notifications.notification_settings, name="notification-settings"),
    path("account/webhooks/new/", views_notifications.webhook_create, name="webhook-create"),
    path("account/webhooks/<int:pk>/", views_notifications.webhook_detail, name="webhook-detail"),
    path("account/webhooks/<int:pk>/edit/", views_notifications.webhook_edit, name="webhook-edit"),
    path("account/webhooks/<int:pk>/delete/", views_notifications.webhook_delete, name="webhook-delete"),
    path("metrics", metrics.metrics_view, name="metrics"),
    # Staff
    path("orphans/", views_staff.orphan_list, name="orphan-list"),
    path("orphans/<int:pk>/stop/", views_staff.orphan_stop, name="orphan-stop"),
    # REST API and admin
    path("api/", include("webapp.api.urls")),
    path("admin/", admin.site.urls),
]


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """A 404 for a path no route matches (and any Http404 outside DRF's views): under /api/ JSON as
    the API's own 404s (``{"detail": ...}``), for a script that parses every answer; else the page."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": f"Not found: no API endpoint at {request.path[:200]}. GET /api/ lists the "
                                       f"endpoints; /api/schema/ describes them."}, status=404)
    return defaults.page_not_found(request, exception)


handler404 = not_found
