"""The job list (/jobs/ and /api/jobs/) costs a constant number of SQL queries: the same for 3 jobs
as for 60, on page 1 as on page 3, filtered or not, and past the count cap, so a user with
100,000 jobs waits no longer than one with 3.

These count queries, they do not time anything; bench/job_list.py measures the time at 100,000 jobs.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from jobs.models import TrainingJob
from jobs import pagination

pytestmark = pytest.mark.django_db


def _make_jobs(user, dataset, model, backend, n: int, start: int = 0) -> None:
    from jobs import services

    for i in range(start, start + n):
        services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                     name=f"sweep-{i:03d}")


def _queries(client, url: str) -> tuple[int, object]:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return len(ctx.captured_queries), response


def _html_urls(backend) -> list[str]:
    base = reverse("job-list")
    return [base, base + "?state=QUEUED", base + f"?backend={backend.pk}", base + "?q=sweep",
            base + f"?state=QUEUED&backend={backend.pk}&q=sweep"]


def test_html_list_queries_do_not_grow_with_jobs_or_depth(owner_client, user, digits_dataset, cnn_model,
                                                          local_backend):
    _make_jobs(user, digits_dataset, cnn_model, local_backend, 3)
    # One stalled job: its badge must not cost a query either.
    TrainingJob.objects.filter(name="sweep-001").update(stalled_at=timezone.now(), stalled_reason="QUEUED for 11 min")
    small = {url: _queries(owner_client, url) for url in _html_urls(local_backend)}
    # session, user, backends (the filter's options), the user's columns and saved filters
    # (docs/experiments.md), count, page; a search adds one query for the datasets, models and
    # backends whose name matches. Nothing per row.
    assert {url: n for url, (n, _) in small.items()} == {
        url: 7 + ("q=" in url) for url in _html_urls(local_backend)}
    first = small[reverse("job-list")][1].content.decode()
    assert 'data-stalled="1" title="QUEUED for 11 min"' in first
    assert [j.name for j in small[reverse("job-list")][1].context["jobs"]] == ["sweep-002", "sweep-001", "sweep-000"]

    _make_jobs(user, digits_dataset, cnn_model, local_backend, 57, start=3)
    TrainingJob.objects.filter(name__in=["sweep-010", "sweep-040"]).update(
        stalled_at=timezone.now(), stalled_reason="PENDING for 2 h")
    for url in _html_urls(local_backend):
        for page in ("", "page=2", "page=3"):
            full = url + (("&" if "?" in url else "?") + page if page else "")
            n, response = _queries(owner_client, full)
            assert n == small[url][0], (full, n, small[url][0])
    n, page3 = _queries(owner_client, reverse("job-list") + "?page=3")
    assert [j.name for j in page3.context["jobs"]] == [f"sweep-{i:03d}" for i in range(9, -1, -1)]
    html = page3.content.decode()
    assert "Page 3 of 3 · 60 jobs" in html
    assert html.count('data-stalled="1"') == 1  # sweep-010 only (sweep-040 is on page 1)


def test_html_list_past_the_count_cap(owner_client, user, digits_dataset, cnn_model, local_backend, monkeypatch):
    _make_jobs(user, digits_dataset, cnn_model, local_backend, 30)
    n_exact, _ = _queries(owner_client, reverse("job-list"))
    monkeypatch.setattr(pagination, "COUNT_CAP", 20)
    n1, page1 = _queries(owner_client, reverse("job-list"))
    assert n1 == n_exact
    assert page1.context["page"].paginator.count_is_exact is False
    assert "Page 1 · 20+ jobs" in page1.content.decode()
    assert page1.context["page"].has_next()
    # Page 2 lies past the cap's 20 rows and is still reachable, with no page after it.
    n2, page2 = _queries(owner_client, reverse("job-list") + "?page=2")
    assert n2 == n_exact
    assert [j.name for j in page2.context["jobs"]] == [f"sweep-{i:03d}" for i in range(4, -1, -1)]
    assert not page2.context["page"].has_next()
    assert "Older" not in page2.content.decode() and "Newer" in page2.content.decode()
    # Past the end: the last page the capped count knows of, not an error.
    n9, page9 = _queries(owner_client, reverse("job-list") + "?page=9")
    assert page9.status_code == 200 and page9.context["page"].number == 1  # ceil(21 / 25) = 1
    junk = owner_client.get(reverse("job-list") + "?page=-3")
    assert junk.status_code == 200 and junk.context["page"].number == 1


def _api_urls(backend) -> list[str]:
    return ["/api/jobs/", "/api/jobs/?state=QUEUED", f"/api/jobs/?backend={backend.pk}", "/api/jobs/?q=sweep",
            f"/api/jobs/?state=QUEUED&backend={backend.pk}&q=sweep"]


def test_api_list_queries_do_not_grow_with_jobs_or_depth(api_client, user, digits_dataset, cnn_model,
                                                         local_backend):
    _make_jobs(user, digits_dataset, cnn_model, local_backend, 3)
    small = {url: _queries(api_client, url)[0] for url in _api_urls(local_backend)}
    # count and page (authentication is forced: no session queries), one more for a search.
    assert small == {url: 2 + ("q=" in url) for url in _api_urls(local_backend)}
    body = api_client.get("/api/jobs/").json()
    assert body["count"] == 3 and body["count_is_exact"] is True and body["next"] is None

    _make_jobs(user, digits_dataset, cnn_model, local_backend, 57, start=3)
    for url in _api_urls(local_backend):
        for extra in ("", "limit=25", "limit=25&offset=50", "limit=10&offset=55"):
            full = url + (("&" if "?" in url else "?") + extra if extra else "")
            n, _ = _queries(api_client, full)
            assert n == small[url], (full, n, small[url])
    _, deep = _queries(api_client, "/api/jobs/?limit=25&offset=50")
    body = deep.json()
    assert body["count"] == 60 and body["count_is_exact"] is True
    assert [j["name"] for j in body["results"]] == [f"sweep-{i:03d}" for i in range(9, -1, -1)]
    assert body["next"] is None and "offset=25" in body["previous"]
    middle = api_client.get("/api/jobs/?limit=25&offset=25").json()
    assert middle["next"].endswith("limit=25&offset=50") or "offset=50" in middle["next"]
    assert [j["name"] for j in middle["results"]][0] == "sweep-034"


def test_api_list_past_the_count_cap(api_client, user, digits_dataset, cnn_model, local_backend, monkeypatch):
    _make_jobs(user, digits_dataset, cnn_model, local_backend, 30)
    n_exact, _ = _queries(api_client, "/api/jobs/")
    monkeypatch.setattr(pagination, "COUNT_CAP", 20)
    n, response = _queries(api_client, "/api/jobs/?limit=10&offset=20")
    assert n == n_exact
    body = response.json()
    assert body["count"] == 20 and body["count_is_exact"] is False
    # Rows past the cap are still served, and the last page says so by its missing next link.
    assert [j["name"] for j in body["results"]] == [f"sweep-{i:03d}" for i in range(9, -1, -1)]
    assert body["next"] is None
    body = api_client.get("/api/jobs/?limit=10&offset=10").json()
    assert "offset=20" in body["next"]
    assert len(api_client.get("/api/jobs/?limit=100000").json()["results"]) == 30  # limit cut to 500, not an error


def test_api_list_other_user_sees_nothing(other_api_client, user, digits_dataset, cnn_model, local_backend):
    _make_jobs(user, digits_dataset, cnn_model, local_backend, 3)
    body = other_api_client.get("/api/jobs/?limit=2&offset=1").json()
    assert (body["count"], body["count_is_exact"], body["next"], body["results"]) == (0, True, None, [])


def test_page_rows_rejects_bad_slices(user):
    qs = TrainingJob.objects.filter(owner_id=user.pk)
    with pytest.raises(ValueError, match="offset and limit must be >= 0"):
        pagination.page_rows(qs, -1, 10)
    with pytest.raises(ValueError, match="ordered queryset"):
        pagination.page_rows(qs.order_by(), 0, 10)
    assert pagination.page_rows(qs, 0, 0) == []


def test_search_matches_job_dataset_model_and_backend_names(api_client, owner_client, user, digits_dataset,
                                                           cnn_model, local_backend):
    """The search's related-name arm (ids found first) finds what a join over the related names finds."""
    from jobs import selectors, services

    _make_jobs(user, digits_dataset, cnn_model, local_backend, 3)
    other_model = services.model_spec_create(owner=user, name="wide-mlp", architecture="mlp", params={})
    services.training_job_create(owner=user, dataset=digits_dataset, model_spec=other_model,
                                 backend=local_backend, name="odd-one")

    def names(q):
        return sorted(j.name for j in selectors.training_job_list_for_user(user=user, q=q))

    everything = ["odd-one", "sweep-000", "sweep-001", "sweep-002"]
    assert names("DIGITS") == everything  # the dataset's name, any case
    assert names("digits-cnn") == ["sweep-000", "sweep-001", "sweep-002"]  # the model's
    assert names("wide") == ["odd-one"]
    assert names("loc") == everything  # the backend's
    assert names("sweep-001") == ["sweep-001"]
    assert names("nothing-like-this") == []
    job = TrainingJob.objects.get(name="sweep-002")
    assert names(f"#{job.pk}") == ["sweep-002"]
    assert [j["name"] for j in api_client.get("/api/jobs/?q=wide").json()["results"]] == ["odd-one"]
    assert [j.name for j in owner_client.get(reverse("job-list") + "?q=wide").context["jobs"]] == ["odd-one"]


def test_admin_changelist_queries_do_not_grow_with_jobs(client, user, digits_dataset, cnn_model, local_backend):
    client.force_login(user)
    url = reverse("admin:jobs_trainingjob_changelist")
    _make_jobs(user, digits_dataset, cnn_model, local_backend, 3)
    shapes = ["", "?state__exact=QUEUED", "?q=sweep", "?strategy=ddp", "?backend__kind=gpubox"]
    small = {shape: _queries(client, url + shape)[0] for shape in shapes}
    _make_jobs(user, digits_dataset, cnn_model, local_backend, 57, start=3)
    large = {shape: _queries(client, url + shape) for shape in shapes}
    assert {shape: n for shape, (n, _) in large.items()} == small
    html = large[""][1].content.decode()
    assert html.count('class="action-select"') == 50  # list_per_page
    n2, page2 = _queries(client, url + "?p=2")
    assert n2 == small[""] and page2.content.decode().count('class="action-select"') == 10
    assert large["?strategy=ddp"][1].context["cl"].result_count == 60
    found = client.get(url + "?q=sweep-004")
    assert found.context["cl"].result_count == 1


def _link(html: str, label: str) -> str | None:
    """The href of the pager link whose text is ``label`` (unescaped), or None."""
    import re
    from html import unescape

    found = re.search(r'<a class="btn" href="([^"]+)">' + re.escape(label) + "</a>", html)
    return unescape(found.group(1)) if found else None


def test_older_and_newer_links_walk_the_list_by_position(owner_client, user, digits_dataset, cnn_model,
                                                         local_backend):
    _make_jobs(user, digits_dataset, cnn_model, local_backend, 60)
    # Ties on created_at must neither drop nor repeat a job: 20 jobs across the page 1/2 boundary share one.
    same = TrainingJob.objects.get(name="sweep-040").created_at
    TrainingJob.objects.filter(name__in=[f"sweep-{i:03d}" for i in range(25, 45)]).update(created_at=same)
    expected = [j.name for j in TrainingJob.objects.filter(owner=user).order_by("-created_at", "-id")]
    base = reverse("job-list")
    n_first, response = _queries(owner_client, base)
    seen, numbers, url = [], [], base
    while True:
        page = response.context["page"]
        seen += [j.name for j in response.context["jobs"]]
        numbers.append(page.number)
        url = _link(response.content.decode(), "Older →")
        if url is None:
            break
        assert "after=" in url
        n, response = _queries(owner_client, base + url)
        assert n == n_first, (url, n, n_first)
    assert seen == expected and numbers == [1, 2, 3]
    # Back from page 3 by position: page 2's rows, then page 1 (a plain link, no position needed).
    newer = _link(response.content.decode(), "← Newer")
    assert "before=" in newer and newer.endswith("page=2")
    back = owner_client.get(base + newer)
    assert [j.name for j in back.context["jobs"]] == expected[25:50] and back.context["page"].number == 2
    first = _link(back.content.decode(), "← Newer")
    assert "before=" not in first and first.endswith("page=1")
    assert [j.name for j in owner_client.get(base + first).context["jobs"]] == expected[:25]
    # A filter stays on the links; a bad position falls back to the page number, not an error.
    filtered = owner_client.get(base + "?q=sweep-0")
    assert "q=sweep-0" in _link(filtered.content.decode(), "Older →")
    junk = owner_client.get(base + "?after=not-a-position&page=2")
    assert junk.status_code == 200 and [j.name for j in junk.context["jobs"]] == expected[25:50]
    for bad in ("?after=99999999999999999999999.1", "?before=1.x&page=-4", "?after=-5.3&page=zz"):
        response = owner_client.get(base + bad)
        assert response.status_code == 200, bad
    past = owner_client.get(base + "?after=1.1&page=7")  # older than everything: the last page
    assert past.status_code == 200 and [j.name for j in past.context["jobs"]] == expected[50:]


def test_api_next_links_walk_the_list_by_position(api_client, user, digits_dataset, cnn_model, local_backend):
    """``next`` carries ``after=<position>``: following it visits every job once, in order, ties on
    created_at included, with the same queries at every depth; a bad position is plain offset."""
    _make_jobs(user, digits_dataset, cnn_model, local_backend, 60)
    same = TrainingJob.objects.get(name="sweep-040").created_at
    TrainingJob.objects.filter(name__in=[f"sweep-{i:03d}" for i in range(5, 45)]).update(created_at=same)
    expected = [j.name for j in TrainingJob.objects.filter(owner=user).order_by("-created_at", "-id")]
    n_first, response = _queries(api_client, "/api/jobs/?limit=25")
    seen, url, offsets = [], None, []
    while True:
        body = response.json()
        seen += [row["name"] for row in body["results"]]
        url = body["next"]
        if url is None:
            break
        assert "after=" in url
        offsets.append(int(url.split("offset=")[1].split("&")[0]))
        n, response = _queries(api_client, url)
        assert n == n_first, (url, n, n_first)
    assert seen == expected and offsets == [25, 50]
    assert "after=" not in (response.json()["previous"] or "")  # back by offset
    junk = api_client.get("/api/jobs/?limit=25&offset=25&after=junk").json()
    assert [row["name"] for row in junk["results"]] == expected[25:50]


def test_id_search_matches_the_id_only_not_digits_inside_provider_job_names(api_client, owner_client, user,
                                                                             digits_dataset, cnn_model,
                                                                             local_backend):
    """``?q=<id>`` matches the job id only: a substring of the provider job names
    (``tb-job-<id>-<hex>``) would also match the hex creation time inside them, and so (nearly) every job."""
    import datetime as dt

    from jobs import adapters, selectors

    _make_jobs(user, digits_dataset, cnn_model, local_backend, 3)
    first, second, third = TrainingJob.objects.filter(owner=user).order_by("pk")
    # The other two jobs were created at a moment whose hex seconds contain the first job's id, as
    # real provider names do for some id (0x69… s is 2025–2026); their names are what the service
    # derives from that time.
    for other in (second, third):
        other.created_at = dt.datetime.fromtimestamp(int(f"69{first.pk:06d}", 16), tz=dt.timezone.utc)
        other.provider_job_name = adapters.provider_job_name(other)
        other.save(update_fields=["created_at", "provider_job_name"])
        assert str(first.pk) in other.provider_job_name.split("-", 3)[3]

    def names(q):
        return sorted(j.name for j in selectors.training_job_list_for_user(user=user, q=q))

    assert names(str(first.pk)) == [first.name]
    assert names(f"#{second.pk}") == [second.name]
    assert names("9" * 30) == []  # past any id: nothing, not a database error
    assert names(second.provider_job_name.upper()) == [second.name]  # the whole provider name, any case
    assert names(second.provider_job_name.split("-", 3)[3]) == []  # a part of it (the hex time) is not a name
    assert names("sweep-00") == ["sweep-000", "sweep-001", "sweep-002"]
    # An unnamed job is shown as job-<id>: that finds it (and a job someone named so), nothing else.
    TrainingJob.objects.filter(pk=third.pk).update(name="")
    named = TrainingJob.objects.filter(pk=second.pk)
    named.update(name=f"job-{first.pk}")
    assert sorted(j.pk for j in selectors.training_job_list_for_user(user=user, q=f"JOB-{third.pk}")) == [third.pk]
    assert sorted(j.pk for j in selectors.training_job_list_for_user(user=user, q=f"job-{first.pk}")) == \
        sorted([first.pk, second.pk])
    assert [j["id"] for j in api_client.get(f"/api/jobs/?q=job-{third.pk}").json()["results"]] == [third.pk]
    named.update(name="sweep-001")
    assert [j["name"] for j in api_client.get(f"/api/jobs/?q={first.pk}").json()["results"]] == [first.name]
    page = owner_client.get(reverse("job-list") + f"?q={first.pk}")
    assert [j.name for j in page.context["jobs"]] == [first.name]
