"""The HTML job list names a bad ``?state=`` or ``?backend=`` (400, as the API answers) instead of
silently showing every job, and shows no message for valid filters."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from jobs import services
from jobs.models import JobStateChoices as S

pytestmark = pytest.mark.django_db


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_job_list_names_an_unknown_state_instead_of_ignoring_it(owner_client, job, api_client):
    response = owner_client.get(reverse("job-list"), {"state": "BOGUS"})
    assert response.status_code == 400
    page = response.content.decode()
    problems = re.search(r'<ul class="messages" role="alert" id="filter-problems">(.*?)</ul>', page, re.S)
    assert problems, page[:3000]
    assert _text(problems.group(1)).strip() == (
        "State “BOGUS” is not a job state; choose one of " + ", ".join(S.values)
        + ". The list below shows every state.")
    assert "digits-ddp" in page  # the other filters (none here) still apply
    # The API says 400 for the same query.
    assert api_client.get(reverse("api-job-list"), {"state": "BOGUS"}).status_code == 400


def test_job_list_names_a_backend_that_is_not_yours(owner_client, job, other_user):
    other = services.backend_create(owner=other_user, name="theirs", kind="gpubox", config={})
    for value in ("abc", str(other.pk), "999999"):
        response = owner_client.get(reverse("job-list"), {"backend": value, "state": "QUEUED"})
        assert response.status_code == 400, value
        text = _text(response.content.decode())
        assert (f"Backend “{value}” is not one of your backends; choose one from the Backend list. "
                f"The list below shows every backend.") in text
        assert "digits-ddp" in text  # state=QUEUED still filters, and the job is queued


def test_job_list_valid_filters_have_no_message(owner_client, job, local_backend):
    response = owner_client.get(reverse("job-list"), {"state": "QUEUED", "backend": local_backend.pk, "q": "ddp"})
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="filter-problems"' not in page and "digits-ddp" in page
    response = owner_client.get(reverse("job-list"), {"state": "RUNNING"})
    assert response.status_code == 200 and "digits-ddp" not in response.content.decode()
