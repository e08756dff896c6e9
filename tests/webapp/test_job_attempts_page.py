"""A resubmitted job's attempts on its page (table and timeline), in the API, and max_restarts in the
backend form and API (docs/recovery.md)."""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from jobs.models import JobAttempt, JobStateChoices as S, TrainingJob
from jobs.states import transition

pytestmark = pytest.mark.django_db


@pytest.fixture
def resubmitted(job):
    """``job`` lost once (attempt 1: 100 s, $0.10) and SUCCEEDED as attempt 2 (50 s, $0.05)."""
    t0 = timezone.now() - dt.timedelta(seconds=400)
    transition(job, S.SUBMITTING, message="Submitting")
    transition(job, S.PENDING, message="Submitted")
    transition(job, S.RUNNING, message="first step logged")
    JobAttempt.objects.create(job=job, number=1, provider_job_name=job.provider_job_name, raw_state="lost",
                              started_at=t0, ended_at=t0 + dt.timedelta(seconds=100), billable_seconds=100.0,
                              cost_usd=Decimal("0.1000"), reason="supervisor process disappeared",
                              checkpoint_uri="/runs/first/output/checkpoints")
    transition(job, S.QUEUED, message="run lost (supervisor process disappeared); resubmitting, attempt 2 of 3",
               attempt=2, provider_job_name=f"{job.provider_job_name}-a2", provider_handle=None,
               checkpoint_uri="/runs/first/output/checkpoints")
    for state in (S.SUBMITTING, S.PENDING, S.RUNNING):
        transition(job, state, message="again")
    transition(job, S.SUCCEEDED, message="exited 0", started_at=t0 + dt.timedelta(seconds=200),
               ended_at=t0 + dt.timedelta(seconds=250), billable_seconds=150.0, cost_usd=Decimal("0.1500"))
    return TrainingJob.objects.get(pk=job.pk)


def test_the_job_page_shows_each_attempt_its_cost_and_the_resubmission_on_the_timeline(owner_client, resubmitted):
    page = owner_client.get(reverse("job-detail", args=[resubmitted.pk])).content.decode()
    table = page[page.index('id="attempt-table"'):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr[^>]*><td>(\d+)</td>.*?</tr>", table, re.S)
    assert rows == ["1", "2"]
    first, second = re.split(r"<tr class=\"current\">", table.split("<tbody>")[1])
    assert "Run lost" in first and "supervisor process disappeared" in first
    assert "100 s" in first and "$0.10" in first
    assert f"{resubmitted.provider_job_name}" in second and "50 s" in second and "$0.05" in second
    assert 'data-state="SUCCEEDED"' in second or "Succeeded" in second
    assert re.search(r"All attempts</th><th[^>]*>150 s</th><th[^>]*>\$0\.15<", table)
    assert "Run lost · resubmitted" in page
    assert "run lost (supervisor process disappeared); resubmitting, attempt 2 of 3" in page
    # Lost and hung runs share the backend's max restarts (docs/hangs.md): the header says both.
    assert ('<h2>Attempts <span class="muted small">(a lost or hung run is restarted from its checkpoint, at most '
            '2 times in all: docs/recovery.md, docs/hangs.md)</span></h2>') in page


def test_a_job_never_resubmitted_has_no_attempts_table(owner_client, job):
    page = owner_client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert 'id="attempt-table"' not in page


def test_the_api_returns_the_attempts_and_strangers_get_404(api_client, other_api_client, resubmitted):
    body = api_client.get(f"/api/jobs/{resubmitted.pk}/").json()
    assert body["attempt"] == 2 and body["cost_usd"] == "0.1500" and body["billable_seconds"] == 150.0
    first, second = body["attempts"]
    assert (first["number"], first["outcome"], first["reason"], first["cost_usd"], first["billable_seconds"],
            first["checkpoint_uri"], first["current"]) == (
        1, "lost", "supervisor process disappeared", "0.1000", 100.0, "/runs/first/output/checkpoints", False)
    assert (second["number"], second["outcome"], second["cost_usd"], second["billable_seconds"], second["current"],
            second["provider_job_name"]) == (2, "SUCCEEDED", "0.0500", 50.0, True, resubmitted.provider_job_name)
    listed = api_client.get("/api/jobs/").json()["results"]
    assert [j["attempt"] for j in listed] == [2]
    assert other_api_client.get(f"/api/jobs/{resubmitted.pk}/").status_code == 404


def test_max_restarts_in_the_api_and_the_backend_form(api_client, owner_client, local_backend):
    url = f"/api/backends/{local_backend.pk}/"
    assert api_client.get(url).json()["max_restarts"] == 2
    bad = api_client.patch(url, {"max_restarts": 11}, format="json")
    assert bad.status_code == 400 and "max_restarts" in bad.json()
    assert api_client.patch(url, {"max_restarts": 0}, format="json").json()["max_restarts"] == 0
    local_backend.refresh_from_db()
    assert local_backend.max_restarts == 0
    page = owner_client.get(reverse("backend-edit", args=[local_backend.pk])).content.decode()
    assert re.search(r'name="max_restarts"[^>]*value="0"|value="0"[^>]*name="max_restarts"', page)
    assert "Max restarts of a lost or hung run" in page


def test_the_services_refuse_max_restarts_out_of_bounds_with_the_bounds(local_backend):
    from django.core.exceptions import ValidationError

    from jobs import services

    with pytest.raises(ValidationError) as exc:
        services.backend_update(backend=local_backend, max_restarts=-1)
    assert exc.value.message_dict == {
        "max_restarts": ["Max restarts must be from 0 (never resubmit a lost run) to 10, got -1."]}
    with pytest.raises(ValidationError) as exc:
        services.backend_update(backend=local_backend, max_restarts="many")
    assert exc.value.message_dict == {"max_restarts": ["Max restarts must be a whole number from 0 to 10, got 'many'."]}
    local_backend.refresh_from_db()
    assert local_backend.max_restarts == 2
