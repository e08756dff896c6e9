"""A page number or offset typed by hand past the count cap is read by position (jobs.pagination.seek_rows:
the position of the first row by the key columns alone, then a seek), not by OFFSET on the page query.
These check that it gives exactly the rows plain OFFSET gives, ties on created_at and team-shared jobs
included, with the same number of queries as page 1; and that a search counts to SEARCH_COUNT_CAP only
(bench/job_list.py times it at 100,000 jobs).
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs import pagination
from jobs.models import Team, TrainingJob

pytestmark = pytest.mark.django_db

PER_PAGE = 25  # webapp.views.JOBS_PER_PAGE


@pytest.fixture
def jobs_60(user, other_user, digits_dataset, cnn_model, local_backend):
    """60 jobs the user sees: 55 own, 5 of another user shared with the user's team, 3 of the other user
    not shared (never seen); runs of equal created_at across page boundaries; states mixed."""
    from jobs import services

    for i in range(63):
        services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                     backend=local_backend, name=f"sweep-{i:03d}")
    team = Team.objects.create(name="vision")
    team.members.add(user)
    TrainingJob.objects.filter(name__in=[f"sweep-{i:03d}" for i in (3, 19, 20, 44, 51)]).update(
        owner=other_user, team=team)
    TrainingJob.objects.filter(name__in=["sweep-007", "sweep-030", "sweep-058"]).update(owner=other_user)
    base = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    for i, job in enumerate(TrainingJob.objects.order_by("id")):
        # Groups of 7 share a creation time: ties straddle rows 20/21 (the cap below) and 25/26 (a page).
        TrainingJob.objects.filter(pk=job.pk).update(created_at=base + dt.timedelta(minutes=i // 7),
                                                     state="SUCCEEDED" if i % 3 else "FAILED")
    return team


def _offset_rows(user, **filters) -> list[str]:
    """The names plain OFFSET pages through: the list's own order, the user's and team-shared jobs."""
    from jobs import selectors

    return [j.name for j in selectors.training_job_list_for_user(user=user, **filters)]


def _get(client, url: str):
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return response, [q["sql"] for q in ctx.captured_queries]


def test_expected_rows_are_the_visible_jobs_with_ties(user, jobs_60):
    expected = _offset_rows(user)
    assert len(expected) == 60 and "sweep-003" in expected and "sweep-007" not in expected
    created = list(TrainingJob.objects.filter(name__in=expected).values_list("created_at", flat=True))
    assert len(set(created)) < len(created)  # ties exist


@pytest.mark.parametrize("cap", [20, 25, 49])
def test_deep_typed_pages_give_the_offset_rows(owner_client, user, jobs_60, monkeypatch, cap):
    monkeypatch.setattr(pagination, "COUNT_CAP", cap)
    expected = _offset_rows(user)
    base = reverse("job-list")
    first, first_sql = _get(owner_client, base)
    for number in (1, 2, 3):
        response, sql = _get(owner_client, base + f"?page={number}")
        rows = [j.name for j in response.context["jobs"]]
        offset = (number - 1) * PER_PAGE
        assert rows == expected[offset:offset + PER_PAGE], (cap, number)
        page = response.context["page"]
        assert page.number == number and page.has_next() == (offset + PER_PAGE < 60)
        assert len(sql) == len(first_sql), (cap, number, sql)
        deep = offset >= cap
        # Deep: the count's query found the first row's position instead, the page query has no OFFSET.
        assert any("COUNT(*)" in q for q in sql) == (not deep), (cap, number)
        assert any("OFFSET" in q for q in sql) == (offset > 0)
        assert not deep or "OFFSET" not in sql[-1]
        assert page.paginator.count_is_exact is False
        assert f"Page {number} · {cap}+ jobs" in response.content.decode()


def test_deep_typed_pages_with_a_filter_give_the_offset_rows(owner_client, user, jobs_60, monkeypatch):
    monkeypatch.setattr(pagination, "COUNT_CAP", 10)
    expected = _offset_rows(user, state="SUCCEEDED")
    assert 25 < len(expected) < 50
    for number in (1, 2):
        response, _ = _get(owner_client, reverse("job-list") + f"?state=SUCCEEDED&page={number}")
        offset = (number - 1) * PER_PAGE
        assert [j.name for j in response.context["jobs"]] == expected[offset:offset + PER_PAGE]
        assert response.context["page"].has_next() == (number == 1)


def test_typed_page_past_the_end_is_the_last_page_as_before(owner_client, user, jobs_60, monkeypatch):
    monkeypatch.setattr(pagination, "COUNT_CAP", 20)
    expected = _offset_rows(user)
    response, sql = _get(owner_client, reverse("job-list") + "?page=9")
    # No row at offset 200: counted after all (21: "20+"), then the last page that count covers, page 1.
    assert response.context["page"].number == 1
    assert [j.name for j in response.context["jobs"]] == expected[:PER_PAGE]
    # Exact count (cap above the list): past the end gives the real last page.
    monkeypatch.setattr(pagination, "COUNT_CAP", 10_000)
    response, _ = _get(owner_client, reverse("job-list") + "?page=9")
    assert response.context["page"].number == 3
    assert [j.name for j in response.context["jobs"]] == expected[50:]


def test_deep_offsets_on_the_api_give_the_offset_rows(api_client, user, jobs_60, monkeypatch):
    monkeypatch.setattr(pagination, "COUNT_CAP", 20)
    expected = _offset_rows(user)
    _, first_sql = _get(api_client, "/api/jobs/?limit=7")
    for offset in (0, 19, 20, 21, 26, 41, 53, 59):
        response, sql = _get(api_client, f"/api/jobs/?limit=7&offset={offset}")
        body = response.json()
        assert [row["name"] for row in body["results"]] == expected[offset:offset + 7], offset
        assert len(sql) == len(first_sql), (offset, sql)
        assert any("COUNT(*)" in q for q in sql) == (offset < 20), offset
        assert (body["count"], body["count_is_exact"]) == (20, False)
        assert (body["next"] is not None) == (offset + 7 < 60), offset
    # Following next from a deep offset seeks by position and visits the rest once, in order.
    seen, url = [], "/api/jobs/?limit=7&offset=30"
    while url:
        body = api_client.get(url).json()
        seen += [row["name"] for row in body["results"]]
        url = body["next"]
    assert seen == expected[30:]
    # Past the end: counted (21, "more than 20"), no rows, no next; the position and the count only.
    response, sql = _get(api_client, "/api/jobs/?limit=7&offset=60")
    body = response.json()
    assert (body["count"], body["count_is_exact"], body["results"], body["next"]) == (20, False, [], None)
    assert len(sql) == len(first_sql)


def test_absurd_page_numbers_and_offsets_answer_without_failing(owner_client, api_client, user, jobs_60,
                                                                 monkeypatch):
    """Past PostgreSQL's bigint OFFSET: no rows, no error, whether the count is exact or capped."""
    huge = 10**20
    expected = _offset_rows(user)
    for cap in (10_000, 20):
        monkeypatch.setattr(pagination, "COUNT_CAP", cap)
        response, _ = _get(owner_client, reverse("job-list") + f"?page={huge}")
        last = 3 if cap > 60 else 1  # the last page the (capped) count covers
        assert response.context["page"].number == last
        assert [j.name for j in response.context["jobs"]] == expected[(last - 1) * PER_PAGE:last * PER_PAGE]
        body = api_client.get(f"/api/jobs/?offset={huge}").json()
        assert body["results"] == [] and body["next"] is None
    assert pagination.page_rows(TrainingJob.objects.all(), huge, 5) == []
    assert pagination.position_at(TrainingJob.objects.all(), huge) is None


def test_seek_rows_equals_offset_rows_at_every_offset(user, jobs_60):
    from jobs import selectors

    qs = selectors.training_job_list_for_user(user=user).only(
        "name", "created_at", "dataset__name", "model_spec__name", "backend__name")
    expected = list(qs.values_list("pk", flat=True))
    for offset in range(0, 62):
        for limit in (1, 7, 26):
            rows = pagination.seek_rows(qs, offset, limit)
            if offset >= len(expected):
                assert rows is None
                continue
            assert [r.pk for r in rows] == expected[offset:offset + limit], (offset, limit)
            assert [r.pk for r in rows] == [r.pk for r in pagination.page_rows(qs, offset, limit)]
    # Deferred fields and select_related survive the seek like they do page_rows.
    row = pagination.seek_rows(qs, 30, 1)[0]
    assert row.get_deferred_fields() >= {"config"} and row.backend.name == "local"


def test_seek_rows_needs_the_newest_first_order(user):
    qs = TrainingJob.objects.filter(owner_id=user.pk)
    assert pagination.newest_first(qs) and pagination.newest_first(qs.order_by("-created_at", "-pk"))
    assert not pagination.newest_first(qs.order_by("name")) and not pagination.newest_first(qs.order_by())
    assert not pagination.newest_first(qs.order_by("-created_at"))
    with pytest.raises(ValueError, match="ordered by -created_at, -pk"):
        pagination.seek_rows(qs.order_by("name"), 0, 5)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        pagination.position_at(qs, -1)


def test_a_search_counts_to_the_search_cap_only(owner_client, api_client, user, jobs_60, monkeypatch):
    monkeypatch.setattr(pagination, "SEARCH_COUNT_CAP", 5)
    expected = _offset_rows(user, q="sweep-0")
    assert len(expected) == 60
    response, _ = _get(owner_client, reverse("job-list") + "?q=sweep-0")
    assert [j.name for j in response.context["jobs"]] == expected[:PER_PAGE]
    assert "Page 1 · 5+ jobs" in response.content.decode()
    response, _ = _get(owner_client, reverse("job-list") + "?q=sweep-0&page=3")  # past the search cap
    assert [j.name for j in response.context["jobs"]] == expected[50:]
    body = api_client.get("/api/jobs/?q=sweep-0&limit=10&offset=20").json()
    assert (body["count"], body["count_is_exact"]) == (5, False)
    assert [row["name"] for row in body["results"]] == expected[20:30]
    # Without a search the list's cap applies.
    assert owner_client.get(reverse("job-list")).context["page"].paginator.count == 60
    body = api_client.get("/api/jobs/?limit=10").json()
    assert (body["count"], body["count_is_exact"]) == (60, True)


@pytest.mark.parametrize("number", ["0", "-1", "-99999999999999999999"])
def test_a_page_number_below_one_is_the_first_page(owner_client, user, jobs_60, number):
    expected = _offset_rows(user)
    response, _ = _get(owner_client, reverse("job-list") + f"?page={number}")
    assert response.context["page"].number == 1  # Django's get_page would give the last page (3)
    assert [j.name for j in response.context["jobs"]] == expected[:PER_PAGE]
