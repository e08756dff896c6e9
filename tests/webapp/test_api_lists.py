"""Every API list is capped the same way (webapp.api.pagination.CappedLimitOffsetPagination): a
``limit`` or ``offset`` past PostgreSQL's bigint must be clamped before it reaches the query, or it
is a 500."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("path", ["/api/datasets/", "/api/models/", "/api/backends/", "/api/jobs/"])
def test_every_list_caps_limit_and_offset(api_client, job, path):
    huge = 10 ** 20  # past PostgreSQL's bigint: LIMIT 10^20 unclamped is "bigint out of range", a 500
    body = api_client.get(f"{path}?limit={huge}").json()
    assert (body["count"], body["count_is_exact"], len(body["results"]), body["next"]) == (1, True, 1, None)
    deep = api_client.get(f"{path}?limit={huge}&offset={huge}")
    assert deep.status_code == 200
    assert (deep.json()["count"], deep.json()["results"]) == (1, [])
    assert api_client.get(f"{path}?offset={2 ** 63}").json()["results"] == []


def test_resource_lists_page_by_offset_in_name_order(api_client, user):
    from jobs import services

    for name in ("c", "a", "b"):
        services.dataset_create(owner=user, name=name, format="builtin", builtin_name="digits")
    first = api_client.get("/api/datasets/?limit=2").json()
    assert [d["name"] for d in first["results"]] == ["a", "b"]
    assert first["next"] == "http://testserver/api/datasets/?limit=2&offset=2"  # no keyset position
    second = api_client.get(first["next"]).json()
    assert ([d["name"] for d in second["results"]], second["next"]) == (["c"], None)
    # after= is the jobs' (newest-first) position; on a list ordered by name it changes nothing.
    assert api_client.get("/api/datasets/?limit=2&after=1.1").json()["results"] == first["results"]


@pytest.mark.parametrize("path", ["/api/datasets/", "/api/jobs/"])
def test_a_limit_or_offset_that_is_not_a_whole_number_in_range_is_a_400_naming_it(api_client, job, path):
    for query, field, message in [
        ("limit=0", "limit", "limit must be a whole number from 1 to 500 (a larger one is cut to it), got '0'."),
        ("limit=-5", "limit", "limit must be a whole number from 1 to 500 (a larger one is cut to it), got '-5'."),
        ("limit=abc", "limit", "limit must be a whole number from 1 to 500 (a larger one is cut to it), got 'abc'."),
        ("limit=1e3", "limit", "limit must be a whole number from 1 to 500 (a larger one is cut to it), got '1e3'."),
        ("limit=2&offset=-1", "offset", "offset must be a whole number from 0, got '-1'."),
        ("offset=NaN", "offset", "offset must be a whole number from 0, got 'NaN'."),
    ]:
        response = api_client.get(f"{path}?{query}")
        assert (response.status_code, response.json()) == (400, {field: [message]}), query
    # Absent or empty: the defaults (PAGE_SIZE rows from the first).
    assert api_client.get(f"{path}?limit=&offset=").json()["count"] == 1
