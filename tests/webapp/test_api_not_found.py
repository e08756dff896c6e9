"""A 404 of the API names what was not found in the API's words (webapp/api/exceptions.py), and answers
the same for a row that is someone else's as for one that does not exist."""

from __future__ import annotations

import pytest

from experimentkit import make_job

pytestmark = pytest.mark.django_db


def test_a_missing_or_foreign_object_is_named_and_another_404_keeps_its_own_message(
        api_client, user, other_user, digits_dataset, cnn_model, local_backend):
    theirs = make_job(other_user, digits_dataset, cnn_model, local_backend, name="not-yours")
    expected = {
        "/api/jobs/999999/": "Training job 999999 not found (or not yours).",
        f"/api/jobs/{theirs.pk}/": f"Training job {theirs.pk} not found (or not yours).",  # exists: another's
        "/api/jobs/abc/": "Training job abc not found (or not yours).",
        "/api/models/999999/": "Model 999999 not found (or not yours).",
        "/api/jobs/999999/artifacts/": "Training job 999999 not found (or not yours).",
    }
    for url, message in expected.items():
        response = api_client.get(url)
        assert (response.status_code, response.json()) == (404, {"detail": message}), url
    # The job is the user's, its artifact is missing: the view's own message, not the job's.
    mine = make_job(user, digits_dataset, cnn_model, local_backend, name="mine")
    response = api_client.get(f"/api/jobs/{mine.pk}/artifacts/nope.txt/download/")
    assert (response.status_code, response.json()) == (404, {"detail": "This job has no artifact of that name."})
    # A path the API does not have keeps the router's answer; it names no object.
    assert api_client.get("/api/no-such-thing/").status_code == 404
