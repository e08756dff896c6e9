"""The comparison of runs: which metrics, final and best values, the config diff, ids not found, the
list's filters, the cap, the page and ``GET /api/jobs/compare/`` (jobs/comparison.py,
webapp/views_compare.py, webapp/api/views_compare.py)."""

from __future__ import annotations

import datetime as dt
import html
import json
import re

import pytest
from django.urls import reverse

from jobs import comparison, services
from jobs.models import MetricPoint, TrainingJob

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def _job(user, dataset, model, backend, name, **kwargs):
    return services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                        nodes=1, procs_per_node=1, epochs=2, name=name, **kwargs)


def _points(job, name, values, *, rank=None, start=0, every_s=10):
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name=name, step=(i + 1) * 10, epoch=0, rank=rank, value=v,
                     recorded_at=T0 + dt.timedelta(seconds=start + every_s * i)) for i, v in enumerate(values)])


@pytest.fixture
def runs(user, digits_dataset, cnn_model, local_backend):
    """Three of alice's runs: a and b differ in lr and seed, c in batch size; with losses, accuracies,
    a user metric and per-rank throughput."""
    a = _job(user, digits_dataset, cnn_model, local_backend, "run-a", lr=0.05)
    b = _job(user, digits_dataset, cnn_model, local_backend, "run-b", lr=0.1, seed=3)
    c = _job(user, digits_dataset, cnn_model, local_backend, "run-c", lr=0.05, batch_size=64)
    _points(a, "train_loss", [2.0, 0.8, 0.9])          # best 0.8, final 0.9
    _points(b, "train_loss", [2.2, 1.0, 0.7], start=5)  # best and final 0.7
    _points(c, "train_loss", [2.1, 1.5, 1.2])
    _points(a, "val_accuracy", [0.5, 0.93, 0.91])      # best 0.93
    _points(b, "val_accuracy", [0.4, 0.88, 0.92], start=5)  # final 0.92: the best final
    _points(c, "val_accuracy", [0.3, 0.6, None])       # a NaN at its last step
    _points(b, "eval/top-1_error", [0.3, 0.1], start=5)  # a user metric: minimised (its name says error)
    _points(c, "my_score", [3.0, 5.0, 4.0])            # another: maximised
    _points(a, "rank_samples_per_s", [100.0, 110.0], rank=0)
    _points(a, "rank_samples_per_s", [90.0, 95.0], rank=1)
    return a, b, c


def test_parse_job_ids_keeps_order_drops_repeats_and_names_every_bad_part():
    assert comparison.parse_job_ids("3, 1,#2  3") == [3, 1, 2]
    assert comparison.parse_job_ids("99999999999999999999999") == [99999999999999999999999]
    with pytest.raises(Exception) as exc:
        comparison.parse_job_ids("1,abc,2;3, x")
    assert exc.value.message_dict["ids"] == [
        "“abc” is not a job id; give job numbers separated by commas, e.g. ids=12,15,19.",
        "“2;3” is not a job id; give job numbers separated by commas, e.g. ids=12,15,19.",
        "“x” is not a job id; give job numbers separated by commas, e.g. ids=12,15,19."]
    with pytest.raises(Exception) as exc:
        comparison.parse_job_ids(" , ")
    assert exc.value.message_dict["ids"][0].startswith("Give the jobs to compare")


def test_metric_direction_follows_the_names():
    assert [comparison.metric_direction(n) for n in
            ("val_loss", "val_accuracy", "lr", "val_perplexity", "my_loss", "Eval-Error", "top1", "tokens_per_s")] == \
        ["min", "max", None, "min", "min", "min", "max", "max"]


def test_every_metric_final_and_best_values_and_the_best_run(runs):
    a, b, c = runs
    result = comparison.training_job_comparison(jobs=[b, a, c])
    assert [r["id"] for r in result["runs"]] == [b.pk, a.pk, c.pk]  # the order asked
    assert result["runs"][1]["t0"] == T0.timestamp() and result["runs"][0]["t0"] == T0.timestamp() + 5
    assert [(m["name"], m["direction"], m["kind"], m["per_rank"]) for m in result["metrics"]] == [
        ("val_accuracy", "max", "accuracy", False), ("train_loss", "min", "loss", False),
        ("rank_samples_per_s", "max", "other", True),
        ("eval/top-1_error", "min", "other", False), ("my_score", "max", "other", False)]
    table = {row["job_id"]: row["values"] for row in result["table"]}
    assert table[a.pk]["train_loss"] == {"final": 0.9, "best": 0.8}
    assert table[b.pk]["train_loss"] == {"final": 0.7, "best": 0.7}
    assert table[c.pk]["val_accuracy"] == {"final": None, "best": 0.6}
    assert table[a.pk]["eval/top-1_error"] == {"final": None, "best": None}
    assert table[b.pk]["eval/top-1_error"] == {"final": 0.1, "best": 0.1}
    assert "rank_samples_per_s" not in table[a.pk]
    assert result["best"]["train_loss"] == {"final": b.pk, "best": b.pk}
    assert result["best"]["val_accuracy"] == {"final": b.pk, "best": a.pk}
    assert result["best"]["my_score"] == {"final": c.pk, "best": c.pk}
    # Series carry step, value and time per point; per-rank ones one list per rank.
    assert result["series"]["train_loss"][str(a.pk)] == [
        {"x": 10, "y": 2.0, "t": T0.timestamp()}, {"x": 20, "y": 0.8, "t": T0.timestamp() + 10},
        {"x": 30, "y": 0.9, "t": T0.timestamp() + 20}]
    assert result["series"]["val_accuracy"][str(c.pk)][-1]["y"] is None
    assert set(result["series"]["my_score"]) == {str(c.pk)}
    assert result["rank_series"]["rank_samples_per_s"] == {str(a.pk): {
        "0": [{"x": 10, "y": 100.0, "t": T0.timestamp()}, {"x": 20, "y": 110.0, "t": T0.timestamp() + 10}],
        "1": [{"x": 10, "y": 90.0, "t": T0.timestamp()}, {"x": 20, "y": 95.0, "t": T0.timestamp() + 10}]}}


def test_the_config_diff_marks_only_the_keys_that_differ(runs):
    a, b, c = runs
    rows = {r["key"]: r for r in comparison.config_diff(jobs=[a, b, c])}
    assert rows["train.lr"] == {"key": "train.lr", "values": ["0.05", "0.1", "0.05"], "differs": True}
    assert rows["train.seed"]["values"] == ["0", "3", "0"] and rows["train.seed"]["differs"]
    assert rows["train.batch_size"]["values"] == ["32", "32", "64"] and rows["train.batch_size"]["differs"]
    assert rows["train.epochs"] == {"key": "train.epochs", "values": ["2", "2", "2"], "differs": False}
    assert rows["backend"]["values"] == ["local"] * 3 and not rows["backend"]["differs"]
    assert rows["nodes"]["values"] == ["1"] * 3 and rows["spot"]["values"] == ["false"] * 3
    keys = list(rows)
    assert keys[:len(comparison.SHAPE_KEYS)] == list(comparison.SHAPE_KEYS)
    assert keys[len(comparison.SHAPE_KEYS):] == sorted(keys[len(comparison.SHAPE_KEYS):])
    # A key one run lacks differs from a value: absence is shown as such.
    TrainingJob.objects.filter(pk=c.pk).update(config={**c.config, "extra": {"flag": True}})
    c.refresh_from_db()
    rows = {r["key"]: r for r in comparison.config_diff(jobs=[a, c])}
    assert rows["extra.flag"] == {"key": "extra.flag", "values": [comparison.ABSENT, "true"], "differs": True}


def test_the_page_shows_charts_the_table_and_the_diff(owner_client, runs):
    a, b, c = runs
    r = owner_client.get(reverse("job-compare"), {"ids": f"{a.pk},{b.pk},{c.pk}"})
    assert r.status_code == 200
    page = r.content.decode()
    data = json.loads(re.search(r'<script id="compare-data" type="application/json">(.*?)</script>', page,
                                re.S).group(1))
    assert [run["id"] for run in data["runs"]] == [a.pk, b.pk, c.pk]
    assert data["runs"][0]["url"] == f"/jobs/{a.pk}/"
    assert [m["name"] for m in data["metrics"]] == ["val_accuracy", "train_loss", "rank_samples_per_s",
                                                    "eval/top-1_error", "my_score"]
    assert page.count('class="card chart-card compare-chart') == 5
    # The table: the best run of each column is highlighted (b's final loss 0.7, a's best accuracy 0.93).
    best = re.findall(r'<tr data-job-id="(\d+)">.*?</tr>', page, re.S)
    assert best == [str(a.pk), str(b.pk), str(c.pk)]
    cells = re.findall(r'<td class="right( best)?" data-metric="([^"]+)" data-which="(\w+)"[^>]*>([^<]*)</td>', page)
    highlighted = [(m, w, v) for b_, m, w, v in cells if b_]
    assert ("train_loss", "final", "0.7") in highlighted and ("val_accuracy", "best", "0.93") in highlighted
    assert ("train_loss", "best", "0.8") not in highlighted
    assert comparison.DIRECTION_RULE in page
    # The diff: only the keys that differ, then all of them behind the toggle.
    diff_keys = re.findall(r'<tr data-key="([^"]+)"', page)
    assert diff_keys == ["train.batch_size", "output.output_dir", "train.lr", "train.seed"] or \
        set(diff_keys) >= {"train.batch_size", "train.lr", "train.seed"} and "train.epochs" not in diff_keys
    assert "train.epochs" not in diff_keys
    toggle = re.search(r'id="config-toggle" href="\?([^"]+)"', page).group(1).replace("&amp;", "&")
    assert "config=all" in toggle
    everything = owner_client.get(reverse("job-compare") + "?" + toggle).content.decode()
    assert 'data-key="train.epochs"' in everything and 'data-key="backend"' in everything


def test_ids_not_found_are_named_and_a_strangers_job_is_never_shown(owner_client, other_user, runs, local_backend):
    a, _, _ = runs
    from jobs import services as s

    ds = s.dataset_create(owner=other_user, name="bob-digits", format="builtin", builtin_name="digits")
    model = s.model_spec_create(owner=other_user, name="bob-cnn", architecture="cnn", params={})
    box = s.backend_create(owner=other_user, name="bob-box", kind="gpubox", config={})
    secret = _job(other_user, ds, model, box, "bobs-secret-run")
    _points(secret, "train_loss", [0.01234])
    missing = secret.pk + 500
    r = owner_client.get(reverse("job-compare"), {"ids": f"{secret.pk},{a.pk},{missing}"})
    page = r.content.decode()
    assert r.status_code == 200
    assert f"Not found: #{secret.pk}, #{missing} (no such job, or one you may not see)." in page
    assert "bobs-secret-run" not in page and "bob-box" not in page and "0.01234" not in page
    assert re.findall(r'<tr data-job-id="(\d+)">', page) == [str(a.pk)]


def test_bad_ids_are_a_400_with_the_reason_and_no_ids_a_help_page(owner_client):
    r = owner_client.get(reverse("job-compare"), {"ids": "1,<b>x</b>"})
    assert r.status_code == 400
    assert "“&lt;b&gt;x&lt;/b&gt;” is not a job id" in r.content.decode()
    r = owner_client.get(reverse("job-compare"))
    assert r.status_code == 200 and 'id="compare-empty"' in r.content.decode()


def test_the_job_lists_filters_select_the_runs(owner_client, runs, local_backend):
    a, b, c = runs
    TrainingJob.objects.filter(pk=b.pk).update(state="SUCCEEDED")
    r = owner_client.get(reverse("job-compare"), {"state": "SUCCEEDED"})
    assert re.findall(r'<tr data-job-id="(\d+)">', r.content.decode()) == [str(b.pk)]
    r = owner_client.get(reverse("job-compare"), {"q": "run-", "backend": local_backend.pk})
    assert re.findall(r'<tr data-job-id="(\d+)">', r.content.decode()) == [str(c.pk), str(b.pk), str(a.pk)]
    r = owner_client.get(reverse("job-compare"), {"state": "DONE"})
    assert r.status_code == 400 and "State “DONE” is not a job state" in r.content.decode()


def test_at_most_twenty_runs_with_a_message(owner_client, user, digits_dataset, cnn_model, local_backend):
    jobs = [_job(user, digits_dataset, cnn_model, local_backend, f"many-{i}") for i in range(22)]
    ids = ",".join(str(j.pk) for j in jobs)
    page = owner_client.get(reverse("job-compare"), {"ids": ids}).content.decode()
    assert re.findall(r'<li data-job-id="(\d+)">', page) == [str(j.pk) for j in jobs[:20]]
    assert "Showing 20 of 22 runs: a comparison shows at most 20." in page
    page = owner_client.get(reverse("job-compare"), {"q": "many-"}).content.decode()
    assert re.findall(r'<li data-job-id="(\d+)">', page) == [str(j.pk) for j in reversed(jobs[2:])]
    assert "Showing 20 of 22 runs" in page


def test_the_api_returns_the_table_the_diff_and_the_series(api_client, runs):
    a, b, c = runs
    r = api_client.get("/api/jobs/compare/", {"ids": f"{c.pk},{a.pk},{c.pk + 999}"})
    assert r.status_code == 200
    body = r.json()
    assert [run["id"] for run in body["runs"]] == [c.pk, a.pk]
    assert body["not_found"] == [c.pk + 999] and body["matched"] == 2 and body["limit"] == 20
    assert {row["job_id"]: row["values"]["train_loss"] for row in body["table"]} == {
        c.pk: {"final": 1.2, "best": 1.2}, a.pk: {"final": 0.9, "best": 0.8}}
    assert body["best"]["train_loss"] == {"final": a.pk, "best": a.pk}
    differing = {row["key"] for row in body["config"] if row["differs"]}
    assert {"train.batch_size"} <= differing and "train.lr" not in differing
    assert body["series"]["my_score"][str(c.pk)][1] == {"x": 20, "y": 5.0, "t": T0.timestamp() + 10}
    r = api_client.get("/api/jobs/compare/", {"ids": "1,nope"})
    assert r.status_code == 400 and r.json()["ids"][0].startswith("“nope” is not a job id")
    r = api_client.get("/api/jobs/compare/", {"state": "BAD"})
    assert r.status_code == 400 and "state" in r.json()
    r = api_client.get("/api/jobs/compare/", {"q": "run-a"})
    assert [run["id"] for run in r.json()["runs"]] == [a.pk]


def test_the_api_never_shows_a_strangers_job(other_api_client, runs):
    a, _, _ = runs
    body = other_api_client.get("/api/jobs/compare/", {"ids": str(a.pk)}).json()
    assert body["runs"] == [] and body["not_found"] == [a.pk] and body["series"] == {} and body["table"] == []
    body = other_api_client.get("/api/jobs/compare/", {"q": "run-"}).json()
    assert body["runs"] == [] and body["matched"] == 0


def test_a_saved_filter_selects_the_runs_and_another_users_is_a_404(owner_client, other_user, runs):
    from django.test import Client

    from jobs.models import SavedFilter

    other_client = Client()
    other_client.force_login(other_user)
    a, _, _ = runs
    saved = SavedFilter.objects.create(owner=a.owner, name="just a", query={"q": "run-a"})
    r = owner_client.get(reverse("job-compare"), {"filter": saved.pk})
    assert r.status_code == 200 and re.findall(r'<li data-job-id="(\d+)">', r.content.decode()) == [str(a.pk)]
    r = other_client.get(reverse("job-compare"), {"filter": saved.pk})
    assert r.status_code == 404 and f"Saved filter #{saved.pk} not found" in r.content.decode()
    assert "run-a" not in r.content.decode()
    r = owner_client.get(reverse("job-compare"), {"filter": "x1"})
    assert r.status_code == 400 and "“x1” is not a saved filter's id" in html.unescape(r.content.decode())


def test_a_one_rank_run_never_wins_wait_for_slowest_s_and_shows_none(user, digits_dataset, cnn_model, local_backend):
    """With one rank there is no slowest rank to wait for: the 0 an older trainer reported is neither
    charted nor tabulated, and the best is the multi-rank run that waited least."""
    solo = _job(user, digits_dataset, cnn_model, local_backend, "solo")  # 1 node × 1 process
    pair = _job(user, digits_dataset, cnn_model, local_backend, "pair")
    quad = _job(user, digits_dataset, cnn_model, local_backend, "quad")
    TrainingJob.objects.filter(pk=pair.pk).update(procs_per_node=2)
    TrainingJob.objects.filter(pk=quad.pk).update(nodes=2, procs_per_node=2)
    pair.refresh_from_db()
    quad.refresh_from_db()
    _points(solo, "wait_for_slowest_s", [0.0, 0.0])
    _points(pair, "wait_for_slowest_s", [0.5, 0.4])
    _points(quad, "wait_for_slowest_s", [0.9, 0.6])
    for job in (solo, pair, quad):
        _points(job, "train_loss", [1.0, 0.5])
    data = comparison.training_job_comparison(jobs=[solo, pair, quad])
    values = {row["job_id"]: row["values"]["wait_for_slowest_s"] for row in data["table"]}
    assert values == {solo.pk: {"final": None, "best": None}, pair.pk: {"final": 0.4, "best": 0.4},
                      quad.pk: {"final": 0.6, "best": 0.6}}
    assert data["best"]["wait_for_slowest_s"] == {"final": pair.pk, "best": pair.pk}
    assert set(data["series"]["wait_for_slowest_s"]) == {str(pair.pk), str(quad.pk)}
    assert data["best"]["train_loss"]["final"] == solo.pk  # its other metrics compete as before
    assert "wait_for_slowest_s" not in comparison.training_job_chart_series(job=solo)["series"]


def test_a_filter_sorted_by_a_metric_compares_its_first_runs_through_the_sort_table(owner_client, runs):
    """``Compare all in this filter`` of a list sorted by a metric: the runs come in that order, read
    as the job list's page is (the metric's sort table on PostgreSQL, not every matching job's JSON)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    a, b, c = runs
    for job, accuracy in ((a, 0.91), (b, 0.92), (c, None)):
        TrainingJob.objects.filter(pk=job.pk).update(final_metrics={"val_accuracy": accuracy})
    with CaptureQueriesContext(connection) as queries:
        r = owner_client.get(reverse("job-compare"), {"q": "run-", "sort": "-val_accuracy"})
    assert re.findall(r'<li data-job-id="(\d+)">', r.content.decode()) == [str(b.pk), str(a.pk), str(c.pk)]
    assert any("jobs_finalmetricvalue" in q["sql"] for q in queries.captured_queries)
