"""jobs/admin.py: pages render for the owner, another staff user gets 404, actions use the services."""


import pytest
from django.urls import reverse

from jobs import dispatch, services
from jobs.models import ComputeBackend, Dataset, JobStateChoices as S, ModelSpec, TrainingJob
from jobs.states import transition
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db

MODELS = ["dataset", "modelspec", "computebackend", "trainingjob", "jobevent", "metricpoint", "joblogline"]


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=local_backend, procs_per_node=2, name="mine")


def test_every_model_is_registered():
    from django.contrib import admin

    from jobs import models

    for model in (models.Dataset, models.ModelSpec, models.ComputeBackend, models.TrainingJob,
                  models.JobEvent, models.MetricPoint, models.JobLogLine):
        assert admin.site.is_registered(model)


@pytest.mark.parametrize("name", MODELS)
def test_owner_changelists_render(client, user, job, name):
    client.force_login(user)
    response = client.get(reverse(f"admin:jobs_{name}_changelist"))
    assert response.status_code == 200


def test_owner_change_pages_render_and_other_staff_gets_404(client, user, other_user, job):
    objects = {"trainingjob": job, "dataset": job.dataset, "modelspec": job.model_spec,
               "computebackend": job.backend, "jobevent": job.events.first()}
    for name, obj in objects.items():
        url = reverse(f"admin:jobs_{name}_change", args=[obj.pk])
        client.force_login(user)
        response = client.get(url)
        assert response.status_code == 200, name
        client.force_login(other_user)
        assert client.get(url).status_code == 404, name
    client.force_login(user)
    page = client.get(reverse("admin:jobs_trainingjob_change", args=[job.pk])).content.decode()
    assert "QUEUED" in page and "1 × 2" in page
    client.force_login(other_user)
    listing = client.get(reverse("admin:jobs_trainingjob_changelist")).content.decode()
    assert "mine" not in listing


def test_superuser_sees_everyone(client, django_user_model, job):
    admin_user = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin_user)
    assert client.get(reverse("admin:jobs_trainingjob_change", args=[job.pk])).status_code == 200
    listing = client.get(reverse("admin:jobs_trainingjob_changelist")).content.decode()
    assert "mine" in listing and "alice" in listing


def test_cancel_and_rerun_actions(client, user, other_user, job, django_capture_on_commit_callbacks):
    client.force_login(user)
    url = reverse("admin:jobs_trainingjob_changelist")
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        with django_capture_on_commit_callbacks(execute=True):
            response = client.post(url, {"action": "rerun_selected", "_selected_action": [job.pk]}, follow=True)
    assert response.status_code == 200
    rerun = TrainingJob.objects.get(rerun_of=job)
    assert f"Queued 1 re-run: job {rerun.pk}." in response.content.decode()
    send.assert_called_once_with(args=[rerun.pk], queue="gpubox.local")

    response = client.post(url, {"action": "cancel_selected", "_selected_action": [job.pk, rerun.pk]}, follow=True)
    assert response.status_code == 200
    assert "Cancel requested for 2 jobs." in response.content.decode()
    job.refresh_from_db()
    assert job.state == S.CANCELLED and "admin" in job.failure_reason

    # Cancelling a finished job is reported per job, not a 500.
    response = client.post(url, {"action": "cancel_selected", "_selected_action": [job.pk]}, follow=True)
    assert response.status_code == 200
    page = response.content.decode()
    assert f"Job {job.pk} already ended" in page and f"Job {job.pk}: Job {job.pk}" not in page

    # Another staff user's selection of this job matches nothing in their queryset.
    client.force_login(other_user)
    client.post(url, {"action": "rerun_selected", "_selected_action": [job.pk]})
    assert TrainingJob.objects.filter(rerun_of=job).count() == 1


def test_add_forms_write_through_services(client, user):
    client.force_login(user)
    response = client.post(reverse("admin:jobs_dataset_add"),
                           {"name": "d2", "format": "builtin", "builtin_name": "mnist", "label_column": "label"})
    assert response.status_code == 200  # re-rendered with the service's error on the field
    assert "Choose a built-in dataset" in response.content.decode()
    assert not Dataset.objects.exists()
    response = client.post(reverse("admin:jobs_dataset_add"),
                           {"name": "d2", "format": "builtin", "builtin_name": "digits", "label_column": "label"})
    assert response.status_code == 302
    assert Dataset.objects.get(name="d2").owner == user
    response = client.post(reverse("admin:jobs_modelspec_add"),
                           {"name": "m", "architecture": "mlp", "params": '{"hidden_size": 4}'})
    assert response.status_code == 302
    assert ModelSpec.objects.get(name="m").params["hidden_size"] == 4
    response = client.post(reverse("admin:jobs_computebackend_add"),
                           {"name": "box", "kind": "gpubox", "config": '{"max_procs_per_node": 0}', "enabled": "on"})
    # The admin's help under config lists every setting, so the error is looked for on the field itself.
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["config"] == ["Max processes per node: must be 1 to 1024, got 0."]
    assert not ComputeBackend.objects.filter(name="box").exists()


def test_job_in_flight_renders_duration(client, user, job):
    transition(job, S.SUBMITTING)
    client.force_login(user)
    assert client.get(reverse("admin:jobs_trainingjob_changelist")).status_code == 200


@pytest.mark.parametrize("params, message", [
    ('{"x": ' + "[" * 5000 + "]" * 5000 + "}", "Nested more than 32 levels deep"),  # was a RecursionError
    ('{"dropout": NaN}', "Parameters: dropout: expected a finite number, got nan."),  # was a DataError
])
def test_add_form_json_that_cannot_be_stored_is_a_field_error(client, user, params, message):
    client.force_login(user)
    response = client.post(reverse("admin:jobs_modelspec_add"), {"name": "m", "architecture": "mlp", "params": params})
    assert response.status_code == 200
    assert any(message in e for e in response.context["adminform"].form.errors["params"])
    assert not ModelSpec.objects.exists()


# --- Sweeps, webhooks and their deliveries (issue 16) ----------------------------------------------


@pytest.fixture
def sweep_and_hook(user, digits_dataset, cnn_model, local_backend, job, settings):
    import uuid

    from jobs import sweeps
    from jobs.models import WebhookDelivery

    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    with sent_tasks(dispatch.SWEEP_FILL):
        sweep = sweeps.sweep_create(owner=user, name="lr-search", base={
            "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk, "epochs": 1},
            search_space={"train.lr": {"type": "categorical", "choices": [0.1, 0.05]}}, sampler="grid")
    hook, secret = services.webhook_create(owner=user, url="http://127.0.0.1:9/hook", events=["job.failed"],
                                           name="ops-hook")
    delivery = WebhookDelivery.objects.create(
        webhook=hook, job=job, delivery_id=uuid.uuid4(), event="job.failed", payload={"event": "job.failed"},
        attempts=[{"at": "2026-01-01T00:00:00Z", "status_code": 500, "error": "", "duration_ms": 3}], attempt_count=1)
    return sweep, hook, secret, delivery


def test_sweep_webhook_and_delivery_admin_pages_list_filter_search_and_never_show_the_secret(
        client, user, other_user, sweep_and_hook):
    sweep, hook, secret, delivery = sweep_and_hook
    client.force_login(user)
    pages = {
        "sweep": ["", "?state__exact=RUNNING", "?sampler__exact=grid", "?q=lr-search"],
        "webhook": ["", "?enabled__exact=1", "?format__exact=json", "?q=ops-hook"],
        "webhookdelivery": ["", "?event=job.failed", "?delivered_at__isnull=True", f"?q={delivery.delivery_id}"],
    }
    for name, queries in pages.items():
        for query in queries:
            response = client.get(reverse(f"admin:jobs_{name}_changelist") + query)
            assert response.status_code == 200, (name, query)
            body = response.content.decode()
            assert {"sweep": "lr-search", "webhook": "ops-hook", "webhookdelivery": "job.failed"}[name] in body, query
            assert secret not in body
    listing = client.get(reverse("admin:jobs_webhookdelivery_changelist")).content.decode()
    assert "pending" in listing and ">500<" in listing  # its status and last response code
    assert client.get(reverse("admin:jobs_sweep_changelist") + "?state__exact=CANCELLED").content.decode().count(
        "lr-search") == 0
    for name, obj in (("sweep", sweep), ("webhook", hook), ("webhookdelivery", delivery)):
        url = reverse(f"admin:jobs_{name}_change", args=[obj.pk])
        page = client.get(url)
        assert page.status_code == 200 and secret not in page.content.decode(), name
        assert 'name="_save"' not in page.content.decode(), name  # read-only: written by the services
        assert client.get(reverse(f"admin:jobs_{name}_add")).status_code == 403, name
        client.force_login(other_user)
        assert client.get(url).status_code == 404, name
        assert "lr-search" not in client.get(reverse(f"admin:jobs_{name}_changelist")).content.decode()
        client.force_login(user)


def test_the_sweep_admin_cancels_through_the_service(client, user, sweep_and_hook):
    from jobs.models import Sweep

    sweep = sweep_and_hook[0]
    client.force_login(user)
    url = reverse("admin:jobs_sweep_changelist")
    response = client.post(url, {"action": "cancel_selected", "_selected_action": [sweep.pk]}, follow=True)
    assert "Cancelled 1 sweep." in response.content.decode()
    sweep.refresh_from_db()
    assert (sweep.state, sweep.message) == (Sweep.State.CANCELLED, f"Sweep cancelled by {user.username} (admin)")
    again = client.post(url, {"action": "cancel_selected", "_selected_action": [sweep.pk]}, follow=True)
    assert "already ended (CANCELLED)" in again.content.decode()
