"""A backend's job secrets: environment variables set in every job of it whose values are secret.
Written through the service, the backend form and the API (names validated as environment
variable names, values never in a message); only the names come back (form, API, admin); the
values reach the job as ``JobSpec.secret_env``, and a log line that prints one is stored with
``***`` in its place, so neither the job page nor the API shows it."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.urls import reverse

from cloud_adapters import registry
from cloud_adapters.base import Backend, Capabilities, JobHandle, JobSpec, JobState, JobStatus
from jobs import services, sync, tasks
from jobs.adapters import job_spec
from jobs.models import ComputeBackend, JobLogLine, TrainingJob

pytestmark = pytest.mark.django_db

TOKEN = "wandb-0123456789abcdef"
HF = "hf_SeCrEt42"


def gpubox_post(**extra) -> dict:
    return {"name": "box", "kind": "gpubox", "hourly_rate_usd": "1.5", "enabled": "on", **extra}


def raw_column(backend) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT job_secrets FROM jobs_computebackend WHERE id = %s", [backend.pk])
        return cursor.fetchone()[0]


# --- the service ----------------------------------------------------------------------------


def test_job_secrets_are_stored_encrypted_and_merged_on_update(user, local_backend):
    backend = services.backend_update(backend=local_backend, job_secrets=f"WANDB_API_KEY={TOKEN}\nHF_TOKEN={HF}")
    backend.refresh_from_db()
    assert backend.job_secrets == {"WANDB_API_KEY": TOKEN, "HF_TOKEN": HF}
    assert TOKEN not in raw_column(backend) and raw_column(backend).startswith("fernet:")
    # A value replaces, a blank value removes, a name left out stays; the rest of the row is kept.
    services.backend_update(backend=backend, job_secrets={"HF_TOKEN": "hf_other_value", "WANDB_API_KEY": ""})
    backend.refresh_from_db()
    assert backend.job_secrets == {"HF_TOKEN": "hf_other_value"}
    services.backend_update(backend=backend, name="renamed")
    backend.refresh_from_db()
    assert (backend.name, backend.job_secrets) == ("renamed", {"HF_TOKEN": "hf_other_value"})
    services.backend_update(backend=backend, clear_job_secrets=True, job_secrets="NEW_ONE=abcd")
    backend.refresh_from_db()
    assert backend.job_secrets == {"NEW_ONE": "abcd"}


def test_job_secret_names_are_checked_as_environment_names_and_no_value_is_quoted(user):
    with pytest.raises(ValidationError) as excinfo:
        services.backend_create(owner=user, name="box", kind="gpubox", config={"hourly_rate_usd": 1},
                                job_secrets=f"RANK={TOKEN}\n9LIVES={TOKEN}\nAWS_SECRET={TOKEN}\nnot a line")
    errors = excinfo.value.message_dict
    assert errors == {"job_secrets": [
        "Job secret RANK cannot be set here: torchrun sets it on every rank from the job's shape.",
        "Job secret '9LIVES' is not a variable name: letters, digits and _, not starting with a digit "
        "(e.g. WANDB_API_KEY).",
        "Line 4: 'not a line' is not NAME=VALUE; write one variable per line, e.g. WANDB_PROJECT=vision."]}
    assert TOKEN not in json.dumps(errors)
    assert not ComputeBackend.objects.exists()


def test_job_spec_gives_the_job_secrets_as_secret_env(user, digits_dataset, cnn_model, local_backend):
    services.backend_update(backend=local_backend, job_secrets={"WANDB_API_KEY": TOKEN})
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, procs_per_node=1)
    spec = job_spec(TrainingJob.objects.get(pk=job.pk))
    assert dict(spec.secret_env) == {"WANDB_API_KEY": TOKEN}
    assert dict(spec.env) == {} and TOKEN not in json.dumps(job.config)


# --- the form, the API and the admin show names only ----------------------------------------


def test_the_backend_form_takes_job_secrets_and_shows_only_their_names(owner_client, user):
    response = owner_client.post(reverse("backend-create"), gpubox_post(job_secrets=f"WANDB_API_KEY={TOKEN}"))
    assert response.status_code == 302, response.context["form"].errors
    backend = ComputeBackend.objects.get(name="box")
    assert backend.job_secrets == {"WANDB_API_KEY": TOKEN}
    page = owner_client.get(reverse("backend-edit", args=[backend.pk])).content.decode()
    assert "Stored: WANDB_API_KEY." in page
    assert TOKEN not in page
    # An error elsewhere re-renders the form: the secret typed in is not echoed back.
    again = owner_client.post(reverse("backend-edit", args=[backend.pk]),
                              gpubox_post(name="", job_secrets=f"HF_TOKEN={HF}\nPATH=/bin"))
    assert again.status_code == 200
    html = again.content.decode()
    assert HF not in html
    assert "Job secret PATH cannot be set here: the platform sets it for the job&#x27;s user and image." in html
    backend.refresh_from_db()
    assert backend.job_secrets == {"WANDB_API_KEY": TOKEN}  # nothing saved
    # NAME= removes one; the checkbox clears them all.
    owner_client.post(reverse("backend-edit", args=[backend.pk]), gpubox_post(job_secrets=f"HF_TOKEN={HF}"))
    backend.refresh_from_db()
    assert backend.job_secrets == {"WANDB_API_KEY": TOKEN, "HF_TOKEN": HF}
    owner_client.post(reverse("backend-edit", args=[backend.pk]), gpubox_post(job_secrets="WANDB_API_KEY="))
    backend.refresh_from_db()
    assert backend.job_secrets == {"HF_TOKEN": HF}
    owner_client.post(reverse("backend-edit", args=[backend.pk]), gpubox_post(clear_job_secrets="on"))
    backend.refresh_from_db()
    assert backend.job_secrets == {}


def test_the_api_writes_job_secrets_and_returns_only_their_names(api_client):
    created = api_client.post("/api/backends/", {"name": "box", "kind": "gpubox", "config": {"hourly_rate_usd": 1},
                                                 "job_secrets": {"WANDB_API_KEY": TOKEN}}, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["job_secrets_set"] == ["WANDB_API_KEY"] and "job_secrets" not in body
    assert TOKEN not in created.content.decode()
    pk = body["id"]
    patched = api_client.patch(f"/api/backends/{pk}/", {"job_secrets": {"HF_TOKEN": HF, "WANDB_API_KEY": None}},
                               format="json")
    assert patched.status_code == 200, patched.json()
    assert patched.json()["job_secrets_set"] == ["HF_TOKEN"]
    listed = api_client.get("/api/backends/").content.decode()
    assert HF not in listed and TOKEN not in listed
    bad = api_client.patch(f"/api/backends/{pk}/", {"job_secrets": {"LD_PRELOAD": HF}}, format="json")
    assert bad.status_code == 400
    assert bad.json() == {"job_secrets": ["Job secret LD_PRELOAD cannot be set here: it changes which libraries "
                                          "every process of the image loads; put them in a container image."]}
    cleared = api_client.patch(f"/api/backends/{pk}/", {"clear_job_secrets": True}, format="json")
    assert cleared.json()["job_secrets_set"] == []


def test_the_admin_shows_the_names_only(client, django_user_model, user, digits_dataset, cnn_model,
                                        local_backend):
    services.backend_update(backend=local_backend, job_secrets={"WANDB_API_KEY": TOKEN})
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, procs_per_node=1, env={"PLAIN": "shown"})
    admin = django_user_model.objects.create_superuser(username="root", password="pw-root-123")
    client.force_login(admin)
    page = client.get(reverse("admin:jobs_computebackend_change", args=[local_backend.pk])).content.decode()
    assert "set: WANDB_API_KEY" in page
    assert TOKEN not in page
    for url in (reverse("admin:jobs_trainingjob_change", args=[job.pk]), reverse("admin:jobs_trainingjob_changelist"),
                reverse("admin:jobs_computebackend_changelist")):
        response = client.get(url)
        assert response.status_code == 200 and TOKEN not in response.content.decode()


# --- log lines: every value masked before it is stored --------------------------------------


class PrintingBackend(Backend):
    """A provider whose job prints its environment: one RUNNING status and one log chunk."""

    kind = "printing"
    queue = "celery"
    chunk: list[str] = []

    @property
    def capabilities(self):
        return Capabilities(max_nodes=1, max_procs_per_node=2)

    def submit(self, spec: JobSpec) -> JobHandle:
        type(self).chunk = [f"WANDB_API_KEY={spec.secret_env['WANDB_API_KEY']}",
                            f"login with {spec.secret_env['HF_TOKEN']} ok", "short value: abc",
                            "a line without secrets"]
        return JobHandle(provider="printing", job_name=spec.job_name)

    def describe_many(self, handles, changed_since=None):
        return {h.job_name: JobStatus(JobState.RUNNING, raw_state="Running") for h in handles}

    def describe(self, handle):  # pragma: no cover - describe_many is used
        raise AssertionError

    def cancel(self, handle):
        pass

    def logs(self, handle, cursor=""):
        return (list(type(self).chunk), "1") if not cursor else ([], cursor)

    def price(self, instance_type="", spot=False):
        return 1.0


def test_a_secret_printed_by_the_job_is_stored_masked_and_shown_nowhere(owner_client, api_client, user,
                                                                        digits_dataset, cnn_model, monkeypatch):
    monkeypatch.setitem(registry.KINDS, "printing",
                        registry.KindInfo(PrintingBackend.__module__, "PrintingBackend", "Printing"))
    backend = services.backend_create(owner=user, name="printing", kind="printing",
                                      job_secrets={"WANDB_API_KEY": TOKEN, "HF_TOKEN": HF, "SHORT": "abc"})
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=backend,
                                       procs_per_node=1)
    tasks.submit_job(job.pk)
    sync.backend_sync(backend_id=backend.pk)
    stored = list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("text", flat=True))
    assert stored == ["WANDB_API_KEY=***", "login with *** ok", "short value: abc", "a line without secrets"]
    page = owner_client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "WANDB_API_KEY=***" in page
    detail = api_client.get(f"/api/jobs/{job.pk}/").content.decode()
    for text in (page, detail):
        assert TOKEN not in text and HF not in text
