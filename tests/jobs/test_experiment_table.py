"""The experiment table's rules in the database (docs/experiments.md): sorting on final metrics and
hyperparameters (JSON keys, nulls last both ways, pages that do not overlap), tags, archive, saved
filters and per-user columns, each refusal's message and that a refused write changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
from django.core.exceptions import ValidationError

from jobs import job_table, pagination, selectors, services
from experimentkit import make_job
from jobs.models import JobListSettings, SavedFilter, Team, TrainingJob
from trainer_pkg.config import TrainConfig

pytestmark = pytest.mark.django_db


@pytest.fixture
def table(user, digits_dataset, cnn_model, local_backend):
    """Five jobs: three with val_accuracy (0.9, 0.5, 0.75), one whose value was not finite (JSON null),
    one that reported none; lr 0.1 / 0.01 / 0.05 / missing / 0.2."""
    def job(name, metrics, config):
        return make_job(user, digits_dataset, cnn_model, local_backend, name=name, final_metrics=metrics,
                        config=config)

    return {
        "high": job("high", {"val_accuracy": 0.9, "val_loss": 0.3}, {"train": {"lr": 0.1, "batch_size": 64}}),
        "low": job("low", {"val_accuracy": 0.5, "val_loss": 1.2}, {"train": {"lr": 0.01, "batch_size": 16}}),
        "mid": job("mid", {"val_accuracy": 0.75, "val_loss": 0.7}, {"train": {"lr": 0.05}, "model": {"params": {"hidden": 128}}}),
        "diverged": job("diverged", {"val_accuracy": None, "val_loss": None}, {"model": {"params": {"hidden": 64}}}),
        "silent": job("silent", {}, {"train": {"lr": 0.2, "batch_size": 32}}),
    }


def names(qs) -> list[str]:
    return [job.name for job in qs]


def test_sort_by_a_final_metric_both_ways_with_missing_values_last(user, table):
    down = selectors.training_job_list_for_user(user=user, sort="-val_accuracy")
    up = selectors.training_job_list_for_user(user=user, sort="val_accuracy")
    # "diverged" (JSON null) and "silent" (no key) come last in both directions, newest first among them.
    assert names(down) == ["high", "mid", "low", "silent", "diverged"]
    assert names(up) == ["low", "mid", "high", "silent", "diverged"]


def test_sort_by_hyperparameters_numbers_by_value_and_nested_keys(user, table):
    assert names(selectors.training_job_list_for_user(user=user, sort="train.lr")) == [
        "low", "mid", "high", "silent", "diverged"]
    assert names(selectors.training_job_list_for_user(user=user, sort="-train.lr")) == [
        "silent", "high", "mid", "low", "diverged"]
    assert names(selectors.training_job_list_for_user(user=user, sort="-model.params.hidden")) == [
        "mid", "diverged", "silent", "low", "high"]  # the three without it newest first


def test_sorted_pages_cover_every_job_once(user, table):
    jobs = selectors.training_job_list_for_user(user=user, sort="-val_loss")
    paginator = pagination.CappedCountPaginator(jobs, 2)
    assert not pagination.newest_first(jobs)  # sorted by a metric: numbered pages, not positions
    pages = [names(paginator.page(n).object_list) for n in (1, 2, 3)]
    assert pages == [["low", "mid"], ["high", "silent"], ["diverged"]]
    assert paginator.count == 5


def test_builtin_sort_keys_and_the_default(user, table):
    assert names(selectors.training_job_list_for_user(user=user, sort="name")) == [
        "diverged", "high", "low", "mid", "silent"]
    assert names(selectors.training_job_list_for_user(user=user, sort="-created")) == [
        "silent", "diverged", "mid", "low", "high"]
    TrainingJob.objects.filter(name="low").update(cost_usd="2.5")
    assert names(selectors.training_job_list_for_user(user=user, sort="-cost"))[0] == "low"


def test_unknown_sort_keys_and_columns_are_named():
    assert job_table.sort_problem("-val_accuracy") is None
    assert job_table.sort_problem("train.lr") is None
    train_fields = [f.name for f in dataclasses.fields(TrainConfig)]
    assert train_fields[:3] == ["epochs", "batch_size", "lr"]
    assert job_table.sort_problem("train.lrr") == (
        f"Cannot sort by “train.lrr”: Unknown hyperparameter “train.lrr”: train has {', '.join(train_fields)}. "
        f"Sort by created, name, state, backend, cost, id; a metric: lr, samples_per_s, tokens_per_s, train_accuracy, "
        f"train_loss, val_accuracy, val_loss, val_perplexity, wait_for_slowest_s; or a hyperparameter key (data.…, "
        f"model.…, parallel.…, train.…, output.…, code.…, e.g. train.lr), with - in front for descending.")
    # Given the user's reported metric names, a well-formed name that none of them is, is refused too.
    assert job_table.sort_problem("-tokens/s", metrics={"tokens/s"}) is None
    assert job_table.sort_problem("val_loss", metrics=set()) is None  # the trainer's own: always a key
    assert job_table.sort_problem("-bogus", metrics={"tokens/s"}) == (
        "Cannot sort by “-bogus”: it is not a sort key, and no job of yours reported a metric of that name. "
        "Sort by created, name, state, backend, cost, id; a metric: lr, samples_per_s, tokens/s, tokens_per_s, "
        "train_accuracy, train_loss, val_accuracy, val_loss, val_perplexity, wait_for_slowest_s; or a "
        "hyperparameter key (data.…, model.…, parallel.…, train.…, output.…, code.…, e.g. train.lr), with - in "
        "front for descending.")
    assert job_table.sort_problem("-bogus") is None  # no user at hand (a saved filter's query): well-formed is enough
    assert (job_table.sorts_by_user_metric("-bogus"), job_table.sorts_by_user_metric("val_loss"),
            job_table.sorts_by_user_metric("train.lr"), job_table.sorts_by_user_metric("cost")) == (
        True, False, False, False)
    with pytest.raises(ValueError, match="Cannot sort by “1bad”"):
        job_table.ordering("1bad")
    columns, problems = job_table.parse_columns("val_accuracy, tokens/s,train.lr,val_accuracy,train,model.arch.x")
    assert [(c.key, c.kind) for c in columns] == [("val_accuracy", "metric"), ("tokens/s", "metric"),
                                                  ("train.lr", "config")]
    assert problems == [
        "“train” is a section of the config, not a value; name a key in it, e.g. train.epochs.",
        "Unknown hyperparameter “model.arch.x”: model.arch is a single value, it has no keys."]
    columns, problems = job_table.parse_columns(",".join(f"m{i}" for i in range(25)))
    assert len(columns) == 20 and problems == ["At most 20 columns, got 25; the first 20 are shown."]


def test_tag_rules_all_at_once():
    assert job_table.clean_tags(["Baseline", "lr-0.1", "baseline", " x_1 "]) == (["baseline", "lr-0.1", "x_1"], [])
    assert job_table.clean_tags("a, b c") == (["a", "b", "c"], [])
    tags, problems = job_table.clean_tags(["-lead", "x" * 51, "ok", 7])
    assert tags == ["ok"]
    assert problems == [
        "Tag “-lead” may hold only lower-case letters, digits and _ . - (starting with a letter or digit), "
        "e.g. baseline or lr-0.1.",
        f"Tag “{'x' * 50}…” is 51 characters; at most 50.",
        "A tag is text, got 7."]
    assert job_table.clean_tags([f"t{i}" for i in range(21)])[1] == ["At most 20 tags on a job, got 21."]
    assert job_table.clean_tags({"a": 1})[1] == [
        "Tags are a list of short labels (or one text of them separated by commas), got dict."]


def test_annotate_stores_tags_and_notes_and_refuses_everything_at_once(user, table):
    job = table["high"]
    services.training_job_annotate(job=job, tags="Baseline, lr-sweep", notes="best so far")
    job.refresh_from_db()
    assert (job.tags, job.notes) == (["baseline", "lr-sweep"], "best so far")
    with pytest.raises(ValidationError) as exc:
        services.training_job_annotate(job=job, tags=["ok", "NOT OK!"], notes="n" * 10_001, archived="yes")
    assert exc.value.message_dict == {
        "tags": ["Tag “not ok!” may hold only lower-case letters, digits and _ . - (starting with a letter or "
                 "digit), e.g. baseline or lr-0.1."],
        "notes": ["Notes are 10,001 characters; at most 10,000."],
        "archived": ["archived is true or false, got 'yes'."]}
    job.refresh_from_db()
    assert (job.tags, job.notes, job.archived_at) == (["baseline", "lr-sweep"], "best so far", None)


def test_tag_filter(user, table):
    services.training_job_annotate(job=table["high"], tags=["baseline", "resnet"])
    services.training_job_annotate(job=table["low"], tags=["baseline"])
    services.training_job_annotate(job=table["mid"], tags=["baseline-2"])
    assert names(selectors.training_job_list_for_user(user=user, tag="baseline", sort="name")) == ["high", "low"]
    assert names(selectors.training_job_list_for_user(user=user, tag="resnet")) == ["high"]
    assert names(selectors.training_job_list_for_user(user=user, tag="nothing")) == []


def test_archive_rules(user, digits_dataset, cnn_model, local_backend, table):
    running = make_job(user, digits_dataset, cnn_model, local_backend, name="running", state="RUNNING")
    with pytest.raises(ValidationError) as exc:
        services.training_job_annotate(job=running, archived=True)
    assert exc.value.message_dict == {"archived": [
        f"Job running (#{running.pk}) is RUNNING: only a job that has ended can be archived; cancel it first, "
        f"or archive it once it ends."]}
    job = services.training_job_annotate(job=table["low"], archived=True)
    first = job.archived_at
    assert first is not None
    services.training_job_annotate(job=table["low"], archived=True)  # again: keeps the first time
    assert TrainingJob.objects.get(pk=job.pk).archived_at == first
    assert "low" not in names(selectors.training_job_list_for_user(user=user, archived=False))
    assert names(selectors.training_job_list_for_user(user=user, archived=True)) == ["low"]
    assert "low" in names(selectors.training_job_list_for_user(user=user))  # by id it is still found
    services.training_job_annotate(job=table["low"], archived=False)
    assert TrainingJob.objects.get(pk=job.pk).archived_at is None


def test_bulk_archive_is_all_or_nothing(user, other_user, django_user_model, digits_dataset, cnn_model,
                                        local_backend, table):
    team = Team.objects.create(name="vision")
    erin = django_user_model.objects.create_user(username="erin", password="pw-erin-123")
    team.members.add(user, erin)
    running = make_job(user, digits_dataset, cnn_model, local_backend, name="running", state="RUNNING")
    TrainingJob.objects.filter(pk=table["high"].pk).update(team=team)
    ids = [table["high"].pk, table["low"].pk]
    with pytest.raises(ValidationError) as exc:
        services.training_jobs_archive(user=user, ids=[*ids, running.pk, 999999, "x"], archived=True)
    assert exc.value.message_dict == {"ids": ["“x” is not a job id."]}
    with pytest.raises(ValidationError) as exc:
        services.training_jobs_archive(user=user, ids=[*ids, running.pk, 999999], archived=True)
    assert exc.value.message_dict == {"ids": [
        f"Job running (#{running.pk}) is RUNNING: only a job that has ended can be archived; cancel it first, "
        f"or archive it once it ends.",
        "No job #999999 in your list."]}
    # erin sees "high" through the team but may not change it; bob sees none of them.
    with pytest.raises(ValidationError) as exc:
        services.training_jobs_archive(user=erin, ids=ids)
    assert exc.value.message_dict == {"ids": [
        f"Only the owner (or staff) can archive or unarchive job high (#{table['high'].pk}).",
        f"No job #{table['low'].pk} in your list."]}
    assert TrainingJob.objects.filter(archived_at__isnull=False).count() == 0
    jobs = services.training_jobs_archive(user=user, ids=f"{ids[0]},{ids[1]}")
    assert [j.name for j in jobs] == ["high", "low"] and all(j.archived_at for j in jobs)
    services.training_jobs_archive(user=user, ids=ids, archived=False)
    assert TrainingJob.objects.filter(archived_at__isnull=False).count() == 0
    with pytest.raises(ValidationError) as exc:
        services.training_jobs_archive(user=user, ids=[])
    assert exc.value.message_dict == {"ids": ["Select at least one job."]}


def test_saved_filter_keeps_only_the_lists_parameters_and_selects_its_jobs(user, other_user, table):
    services.training_job_annotate(job=table["high"], tags=["baseline"])
    services.training_job_annotate(job=table["low"], tags=["baseline"])
    saved = services.saved_filter_create(owner=user, name=" best baseline ", query={
        "tag": "baseline", "sort": "-val_accuracy", "columns": "val_accuracy, train.lr", "page": "4",
        "after": "x", "evil": "<script>", "state": "succeeded"})
    assert (saved.name, saved.query) == ("best baseline", {
        "state": "SUCCEEDED", "tag": "baseline", "columns": "val_accuracy,train.lr", "sort": "-val_accuracy"})
    assert names(selectors.saved_filter_jobs_for_user(user=user, saved_filter=saved)) == ["high", "low"]
    assert names(selectors.saved_filter_jobs_for_user(user=user, saved_filter=saved.pk)) == ["high", "low"]
    with pytest.raises(SavedFilter.DoesNotExist):
        selectors.saved_filter_jobs_for_user(user=other_user, saved_filter=saved)
    assert list(selectors.saved_filter_list_for_user(user=other_user)) == []


def test_saved_filter_refusals(user):
    services.saved_filter_create(owner=user, name="mine", query={})
    with pytest.raises(ValidationError) as exc:
        services.saved_filter_create(owner=user, name="mine", query={"sort": "-nope nope", "state": "DONE",
                                                                     "archived": "maybe", "tag": "A B"})
    assert exc.value.message_dict["name"] == [
        "You already have a saved filter named “mine”; choose another name or delete that one."]
    assert exc.value.message_dict["query"][0].startswith("State “DONE” is not a job state")
    assert exc.value.message_dict["query"][1:] == [
        "Tag “a b” may hold only lower-case letters, digits and _ . - (starting with a letter or digit), "
        "e.g. baseline or lr-0.1.",
        "archived is 1 (archived jobs only), all (both) or 0 (the default), got “maybe”.",
        "Cannot sort by “-nope nope”: “nope nope” is neither a metric name (a letter or _, then letters, digits, "
        "_ . / -; at most 100) nor a hyperparameter key (data.…, model.…, parallel.…, train.…, output.…, code.…). "
        "Sort by created, name, state, backend, cost, id; a metric: lr, samples_per_s, tokens_per_s, "
        "train_accuracy, train_loss, val_accuracy, val_loss, val_perplexity, wait_for_slowest_s; or a "
        "hyperparameter key (data.…, model.…, parallel.…, train.…, output.…, code.…, e.g. train.lr), with - in "
        "front for descending."]
    with pytest.raises(ValidationError) as exc:
        services.saved_filter_create(owner=user, name="", query=[])
    assert exc.value.message_dict == {
        "name": ["Name the filter, e.g. best-lr-sweep."],
        "query": ["The query is the job list's parameters (state, tag, sort, ...), got list."]}
    assert list(SavedFilter.objects.values_list("name", flat=True)) == ["mine"]


def test_list_columns_are_kept_per_user(user, other_user):
    assert selectors.job_list_columns_for_user(user=user) == ["val_accuracy", "val_loss", "train_loss"]
    assert services.job_list_columns_save(user=user, columns="train.lr, val_accuracy") == ["train.lr", "val_accuracy"]
    assert selectors.job_list_columns_for_user(user=user) == ["train.lr", "val_accuracy"]
    assert selectors.job_list_columns_for_user(user=other_user) == ["val_accuracy", "val_loss", "train_loss"]
    with pytest.raises(ValidationError) as exc:
        services.job_list_columns_save(user=user, columns="train.bogus")
    assert exc.value.message_dict["columns"][0].startswith("Unknown hyperparameter “train.bogus”: train has epochs")
    assert JobListSettings.objects.get(user=user).columns == ["train.lr", "val_accuracy"]
    services.job_list_columns_save(user=user, columns="")
    assert selectors.job_list_columns_for_user(user=user) == ["val_accuracy", "val_loss", "train_loss"]


def test_clean_list_query_reads_a_querydict():
    from django.http import QueryDict

    query, problems = job_table.clean_list_query(QueryDict("state=running&q=+resnet+&archived=all&page=2&x=1"))
    assert (query, problems) == ({"state": "RUNNING", "q": "resnet", "archived": "all"}, {})


def _values(*jobs) -> dict[tuple[str, str], tuple[float, object]]:
    from jobs.models import FinalMetricValue

    return {(v.job.name, v.name): (v.value, v.created_at) for v in
            FinalMetricValue.objects.filter(job__in=jobs).select_related("job")}


def test_final_metric_values_follow_final_metrics_whoever_writes_them(user, table):
    """The sort table (PostgreSQL triggers, migration 0040) holds each job's finite numbers of
    ``final_metrics`` with its ``created_at``, through create, queryset update, save and a changed
    ``created_at``; a JSON null, a text, a boolean, a name past 100 characters, a number out of float8's
    range and a non-object hold none."""
    high, mid, diverged = table["high"], table["mid"], table["diverged"]
    assert _values(*table.values()) == {
        ("high", "val_accuracy"): (0.9, high.created_at), ("high", "val_loss"): (0.3, high.created_at),
        ("low", "val_accuracy"): (0.5, table["low"].created_at), ("low", "val_loss"): (1.2, table["low"].created_at),
        ("mid", "val_accuracy"): (0.75, mid.created_at), ("mid", "val_loss"): (0.7, mid.created_at)}
    TrainingJob.objects.filter(pk=high.pk).update(final_metrics={"val_accuracy": None, "val_loss": 0.25, "steps": 7,
                                                                 "note": "text", "flag": True, "x" * 101: 1.0})
    mid.final_metrics = {"val_accuracy": 0.8}
    mid.save()
    moved = high.created_at.replace(year=2020)
    TrainingJob.objects.filter(pk=diverged.pk).update(final_metrics={"val_loss": 2.0}, created_at=moved)
    TrainingJob.objects.filter(pk=table["low"].pk).update(final_metrics=["not", "an", "object"])
    assert _values(high, mid, diverged, table["low"]) == {
        ("high", "val_loss"): (0.25, high.created_at), ("high", "steps"): (7.0, high.created_at),
        ("mid", "val_accuracy"): (0.8, mid.created_at), ("diverged", "val_loss"): (2.0, moved)}
    TrainingJob.objects.filter(pk=diverged.pk).update(created_at=high.created_at)
    assert _values(diverged) == {("diverged", "val_loss"): (2.0, high.created_at)}
    # Numbers a float8 cannot hold (a 400-digit integer, a subnormal) hold no row and never fail the write.
    TrainingJob.objects.filter(pk=diverged.pk).update(final_metrics={"huge": 10**400, "tiny": 5e-324, "zero": 0,
                                                                     "big": -1e308, "val_loss": 1e-300})
    assert _values(diverged) == {("diverged", "zero"): (0.0, high.created_at), ("diverged", "big"): (-1e308, high.created_at),
                                 ("diverged", "val_loss"): (1e-300, high.created_at)}


@pytest.mark.parametrize("sort", ["-val_accuracy", "val_accuracy"])
def test_metric_sorted_pages_read_the_sort_tables_index_and_equal_the_json_order(
        user, other_user, digits_dataset, cnn_model, local_backend, sort):
    """47 jobs with repeated values, equal creation times, JSON nulls and no value, and jobs the list
    filters out (another user's, another state, archived): every page of 6, in either direction, is
    the JSON order's slice (values, those without one last, ties newest first, then by id); each
    page is two queries, its keys from ``jobs_finalmetricvalue`` (the jobs without a value in the same
    statement) and its rows, on the pages before, at and past the last valued job alike."""
    import datetime as dt
    import random

    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    rng = random.Random(sort)
    at = timezone.now().replace(microsecond=0)
    mine = []
    for i in range(47):
        kind = rng.random()
        metrics = ({} if kind < 0.15 else {"val_accuracy": None} if kind < 0.3 else
                   {"val_accuracy": rng.choice([0.25, 0.5, 0.75, 1.0])})
        job = make_job(user, digits_dataset, cnn_model, local_backend, name=f"j{i}", final_metrics=metrics)
        TrainingJob.objects.filter(pk=job.pk).update(created_at=at - dt.timedelta(seconds=rng.choice([0, 1, 2])))
        mine.append(TrainingJob.objects.get(pk=job.pk))
    make_job(user, digits_dataset, cnn_model, local_backend, name="failed", state="FAILED", final_metrics={"val_accuracy": 2.0})
    make_job(user, digits_dataset, cnn_model, local_backend, name="archived", final_metrics={"val_accuracy": 2.0},
             archived_at=at)
    theirs = digits_dataset.__class__.objects.create(owner=other_user, name="d2", format="builtin", builtin_name="digits")
    make_job(other_user, theirs, cnn_model, local_backend, name="theirs", final_metrics={"val_accuracy": 2.0})

    descending = sort.startswith("-")
    newest = lambda j: (-j.created_at.timestamp(), -j.pk)  # noqa: E731
    valued = sorted((j for j in mine if j.final_metrics.get("val_accuracy") is not None),
                    key=lambda j: ((-1 if descending else 1) * j.final_metrics["val_accuracy"], *newest(j)))
    expected = [j.name for j in valued] + [j.name for j in sorted((j for j in mine if j not in valued), key=newest)]
    jobs = selectors.training_job_list_for_user(user=user, state="SUCCEEDED", archived=False, sort=sort)
    assert names(jobs) == expected  # the JSON order itself
    paginator = pagination.CappedCountPaginator(jobs, 6)
    assert paginator.count == 47
    got = []
    for number in range(1, paginator.num_pages + 1):
        with CaptureQueriesContext(connection) as queries:
            got += names(paginator.page(number).object_list)
        keys = queries.captured_queries[0]["sql"]
        assert "jobs_finalmetricvalue" in keys and "#>" not in keys
        # The page's keys (valued or not, in one statement), then its rows: on every page, as the list's other orders.
        assert len(queries) == 2, [q["sql"][:120] for q in queries]
    assert got == expected


@pytest.mark.django_db(transaction=True)
def test_migration_0040_fills_the_sort_table_from_the_jobs_final_metrics(user, digits_dataset, cnn_model, local_backend):
    """Jobs whose ``final_metrics`` were written before the sort table existed get their rows when
    migration 0040 runs (and the way back removes the table and its triggers)."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    kept = make_job(user, digits_dataset, cnn_model, local_backend, name="kept", final_metrics={"val_accuracy": 0.5})
    later = make_job(user, digits_dataset, cnn_model, local_backend, name="later")
    executor = MigrationExecutor(connection)
    leaves = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate([("jobs", "0039_job_preflight")])
        with connection.cursor() as cursor:
            assert "jobs_finalmetricvalue" not in connection.introspection.table_names(cursor)
            # Written with no trigger to keep a sort table: what a job had before 0040.
            cursor.execute("UPDATE jobs_trainingjob SET final_metrics = %s::jsonb WHERE id = %s",
                           ['{"val_loss": 0.25, "note": "text", "val_accuracy": null}', later.pk])
        executor = MigrationExecutor(connection)
        executor.migrate(leaves)
    finally:
        MigrationExecutor(connection).migrate(leaves)
    assert _values(kept, later) == {("kept", "val_accuracy"): (0.5, kept.created_at),
                                    ("later", "val_loss"): (0.25, later.created_at)}
    TrainingJob.objects.filter(pk=later.pk).update(final_metrics={"val_loss": 0.125})  # the triggers are back
    assert _values(later) == {("later", "val_loss"): (0.125, later.created_at)}
