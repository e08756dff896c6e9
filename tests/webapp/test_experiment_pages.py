"""The experiment table in the browser UI without a browser (docs/experiments.md): the list's metric and
hyperparameter columns, sort links and pages, messages for bad input (400, never 500), tags, notes and
archive from the job page and the list, saved filters, the column choice, and the log page and download."""

from __future__ import annotations

import re
from html import unescape

import pytest
from django.urls import reverse
from django.utils.html import escape

from experimentkit import make_job
from jobs import services
from jobs.models import JobLogLine, SavedFilter, Team, TrainingJob
from trainer_pkg.metrics import format_metric_line

pytestmark = pytest.mark.django_db


@pytest.fixture
def jobs(user, digits_dataset, cnn_model, local_backend):
    def job(name, acc, lr, state="SUCCEEDED"):
        return make_job(user, digits_dataset, cnn_model, local_backend, name=name, state=state,
                        final_metrics={"val_accuracy": acc, "val_loss": 1 - acc if acc is not None else None,
                                       "train_loss": 0.5, "tokens/s": 812.0},
                        config={"train": {"lr": lr, "optimizer": "adamw"}, "model": {"params": {"hidden": 32}}})

    return {"a": job("run-a", 0.91, 0.1), "b": job("run-b", 0.62, 0.01), "c": job("run-c", None, 0.05),
            "live": job("run-live", 0.3, 0.2, state="RUNNING")}


def cells(html: str, key: str) -> list[str]:
    """The texts of column ``key``'s cells, in row order."""
    head = re.search(r"<thead>.*?</thead>", html, re.S).group(0)
    keys = [(re.search(r'data-sort="([^"]+)"', th) or re.search("", "")).group(1) if "data-sort" in th else ""
            for th in re.findall(r"<th.*?</th>", head, re.S)]
    index = keys.index(key)
    rows = re.findall(r"<tr data-job=.*?</tr>", html, re.S)
    return [re.sub(r"<[^>]+>", "", re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)[index]).strip() for row in rows]


def test_default_columns_sorted_by_final_metric(owner_client, jobs):
    r = owner_client.get(reverse("job-list") + "?sort=-val_accuracy")
    assert r.status_code == 200
    html = r.content.decode()
    assert [j.name for j in r.context["jobs"]] == ["run-a", "run-b", "run-live", "run-c"]
    assert cells(html, "val_accuracy") == ["0.91", "0.62", "0.3", "—"]
    assert cells(html, "val_loss") == ["0.09", "0.38", "0.7", "—"]
    # The header link of the sorted column flips the direction and keeps the rest of the query.
    assert 'href="?sort=val_accuracy" class="sort" data-sort="val_accuracy" aria-sort="descending"' in html


def test_columns_from_the_url_hyperparameters_and_user_metrics(owner_client, jobs):
    url = reverse("job-list") + "?columns=train.lr,tokens/s,model.params.hidden,train.optimizer&sort=train.lr"
    r = owner_client.get(url)
    html = r.content.decode()
    assert [j.name for j in r.context["jobs"]] == ["run-b", "run-c", "run-a", "run-live"]
    assert cells(html, "train.lr") == ["0.01", "0.05", "0.1", "0.2"]
    assert cells(html, "tokens/s") == ["812", "812", "812", "812"]
    assert cells(html, "model.params.hidden") == ["32"] * 4 and cells(html, "train.optimizer") == ["adamw"] * 4
    assert 'data-column="val_accuracy"' not in html  # the URL's columns replace the defaults


def test_bad_sort_and_columns_are_named_not_500(owner_client, jobs):
    r = owner_client.get(reverse("job-list") + "?sort=-no such&columns=val_accuracy,train.nope&tag=Bad Tag!&archived=x")
    assert r.status_code == 400
    problems = r.context["filter_problems"]
    assert problems[0].startswith("Tag “bad tag!” may hold only lower-case letters")
    assert problems[1] == ("archived is 1 (archived jobs only), all (both) or 0 (the default), got “x”. "
                           "The list below leaves archived jobs out.")
    assert problems[2].startswith("Unknown hyperparameter “train.nope”: train has epochs, batch_size, lr")
    assert problems[3].startswith("Cannot sort by “-no such”: “no such” is neither a metric name")
    assert problems[3].endswith("The list below is newest first.")
    assert [j.name for j in r.context["jobs"]] == ["run-live", "run-c", "run-b", "run-a"]
    assert 'data-column="val_accuracy"' in r.content.decode()  # the valid column is still shown
    # A well-formed metric name no job reported: named, with the allowed keys; the list still renders.
    r = owner_client.get(reverse("job-list") + "?sort=-bogus")
    assert r.status_code == 400
    [problem] = r.context["filter_problems"]
    assert problem.startswith("Cannot sort by “-bogus”: it is not a sort key, and no job of yours reported a metric")
    assert "tokens/s" in problem and problem.endswith("The list below is newest first.")
    assert [j.name for j in r.context["jobs"]] == ["run-live", "run-c", "run-b", "run-a"]
    assert "Cannot sort by “-bogus”" in r.content.decode()


def test_sorted_pages_link_by_number_and_do_not_overlap(owner_client, user, digits_dataset, cnn_model,
                                                       local_backend):
    for i in range(30):
        make_job(user, digits_dataset, cnn_model, local_backend, name=f"s{i:02d}", final_metrics={"val_loss": i / 100})
    first = owner_client.get(reverse("job-list") + "?sort=val_loss")
    html = first.content.decode()
    assert [j.name for j in first.context["jobs"]] == [f"s{i:02d}" for i in range(25)]
    assert 'href="?sort=val_loss&amp;page=2">Next →' in html and "after=" not in html
    second = owner_client.get(reverse("job-list") + "?sort=val_loss&page=2")
    assert [j.name for j in second.context["jobs"]] == [f"s{i:02d}" for i in range(25, 30)]
    assert "Page 2 of 2 · 30 jobs" in second.content.decode()


def test_tags_notes_and_archive_from_the_job_page(owner_client, jobs):
    job = jobs["a"]
    r = owner_client.post(reverse("job-annotate", args=[job.pk]), {"tags": "Baseline, lr-sweep", "notes": "keep"})
    assert r.status_code == 302
    job.refresh_from_db()
    assert (job.tags, job.notes) == (["baseline", "lr-sweep"], "keep")
    page = owner_client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert 'value="baseline, lr-sweep"' in page and f'href="/jobs/{job.pk}/logs/"' in page
    # Bad tags: the message, and nothing changed (the form keeps what was typed: the test below).
    r = owner_client.post(reverse("job-annotate", args=[job.pk]), {"tags": "ok, NO WAY!", "notes": "changed"})
    assert r.status_code == 400
    assert r.context["annotate"]["errors"] == [
        "Tag “way!” may hold only lower-case letters, digits and _ . - (starting with a letter or digit), "
        "e.g. baseline or lr-0.1."]
    job.refresh_from_db()
    assert (job.tags, job.notes) == (["baseline", "lr-sweep"], "keep")
    # Tag filter and tags shown in the list.
    listed = owner_client.get(reverse("job-list") + "?tag=baseline")
    assert [j.name for j in listed.context["jobs"]] == ["run-a"]
    assert '<a class="tag" href="?tag=lr-sweep">lr-sweep</a>' in listed.content.decode()
    # Archive: gone from the default list, in ?archived=1; an active job is refused with the reason.
    owner_client.post(reverse("job-archive", args=[job.pk]), {"archived": "1"})
    assert "run-a" not in [j.name for j in owner_client.get(reverse("job-list")).context["jobs"]]
    assert [j.name for j in owner_client.get(reverse("job-list") + "?archived=1").context["jobs"]] == ["run-a"]
    assert owner_client.get(reverse("job-detail", args=[job.pk])).status_code == 200
    r = owner_client.post(reverse("job-archive", args=[jobs["live"].pk]), {"archived": "1"}, follow=True)
    assert [str(m) for m in r.context["messages"]] == [
        f"Job run-live (#{jobs['live'].pk}) is RUNNING: only a job that has ended can be archived; cancel it "
        f"first, or archive it once it ends."]
    owner_client.post(reverse("job-archive", args=[job.pk]), {"archived": "0"})
    assert TrainingJob.objects.get(pk=job.pk).archived_at is None


def test_teammate_reads_tags_but_cannot_change_them(client, user, django_user_model, jobs):
    team = Team.objects.create(name="vision")
    erin = django_user_model.objects.create_user(username="erin", password="pw-erin-123")
    team.members.add(user, erin)
    job = jobs["a"]
    TrainingJob.objects.filter(pk=job.pk).update(team=team, tags=["baseline"], notes="mine")
    client.force_login(erin)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert '<a class="tag" href="/jobs/?tag=baseline">baseline</a>' in page and 'id="annotate-form"' not in page
    assert client.post(reverse("job-annotate", args=[job.pk]), {"tags": "x"}).status_code == 403
    assert client.post(reverse("job-archive", args=[job.pk]), {"archived": "1"}).status_code == 403
    assert TrainingJob.objects.get(pk=job.pk).tags == ["baseline"]


def test_bulk_archive_from_the_list_and_compare_links(owner_client, jobs):
    html = owner_client.get(reverse("job-list") + "?state=SUCCEEDED&sort=-val_accuracy").content.decode()
    ids = ",".join(str(jobs[k].pk) for k in ("a", "b", "c"))
    assert f'id="compare-page" href="/jobs/compare/?ids={ids.replace(",", "%2C")}"' in html
    assert 'id="compare-filter" href="/jobs/compare/?state=SUCCEEDED&amp;sort=-val_accuracy"' in html
    assert 'id="compare-selected" href="/jobs/compare/?ids=" data-base="/jobs/compare/"' in html
    r = owner_client.post(reverse("job-bulk-archive"), {
        "ids": [jobs["a"].pk, jobs["live"].pk], "action": "archive", "list_query": "state=SUCCEEDED&page=3"})
    assert r.status_code == 302 and r["Location"] == "/jobs/?state=SUCCEEDED"
    assert [str(m) for m in owner_client.get(r["Location"]).context["messages"]] == [
        f"Job run-live (#{jobs['live'].pk}) is RUNNING: only a job that has ended can be archived; cancel it "
        f"first, or archive it once it ends."]
    assert TrainingJob.objects.filter(archived_at__isnull=False).count() == 0  # all or nothing
    r = owner_client.post(reverse("job-bulk-archive"), {"ids": [jobs["a"].pk, jobs["b"].pk], "action": "archive"},
                          follow=True)
    assert [str(m) for m in r.context["messages"]] == [f"Archived 2 jobs: #{jobs['a'].pk}, #{jobs['b'].pk}."]
    assert [j.name for j in r.context["jobs"]] == ["run-live", "run-c"]


def test_saved_filters_and_kept_columns(owner_client, user, other_user, client, jobs):
    r = owner_client.post(reverse("savedfilter-create"), {
        "name": "best", "list_query": "sort=-val_accuracy&columns=val_accuracy,train.lr&page=2&junk=1"})
    saved = SavedFilter.objects.get(owner=user)
    assert saved.query == {"sort": "-val_accuracy", "columns": "val_accuracy,train.lr"}
    assert r["Location"] == reverse("savedfilter-open", args=[saved.pk])
    opened = owner_client.get(r["Location"])
    assert opened["Location"] == "/jobs/?columns=val_accuracy%2Ctrain.lr&sort=-val_accuracy"
    listed = owner_client.get(opened["Location"]).content.decode()
    assert f'href="/jobs/filters/{saved.pk}/" data-filter="{saved.pk}">best</a>' in listed
    r = owner_client.post(reverse("savedfilter-create"), {"name": "best", "list_query": "sort=-nope nope"}, follow=True)
    assert [str(m) for m in r.context["messages"]][0] == (
        "You already have a saved filter named “best”; choose another name or delete that one.")
    assert SavedFilter.objects.count() == 1
    # Columns kept as the user's own: shown without ?columns=.
    owner_client.post(reverse("job-columns"), {"columns": "train.lr", "list_query": "columns=train.lr&sort=name"})
    html = owner_client.get(reverse("job-list")).content.decode()
    assert 'data-column="train.lr"' in html and 'data-column="val_accuracy"' not in html
    # Another user: the filter is a 404, and their list has the default columns.
    client.force_login(other_user)
    assert client.get(reverse("savedfilter-open", args=[saved.pk])).status_code == 404
    assert client.post(reverse("savedfilter-delete", args=[saved.pk])).status_code == 404
    assert 'id="columns-input" value="val_accuracy,val_loss,train_loss"' in client.get(reverse("job-list")).content.decode()
    client.force_login(user)
    client.post(reverse("savedfilter-delete", args=[saved.pk]))
    assert SavedFilter.objects.count() == 0


def test_log_page_search_rank_and_download(owner_client, jobs):
    job = jobs["a"]
    record = format_metric_line({"event": "step", "step": 1})
    # A job logged when records were stored as lines too (is_metric rows).
    texts = [f"line {i}" for i in range(600)] + ["[rank1]: ValueError: bad shard", record]
    JobLogLine.objects.bulk_create(JobLogLine(job=job, seq=i, text=t) for i, t in enumerate(texts))
    r = owner_client.get(reverse("job-logs", args=[job.pk]))
    html = r.content.decode()
    assert r.context["page"].number == 2 and r.context["page"].count == 601  # the metric record hidden
    assert '<span class="log-line" data-seq="500"><span class="seq">500</span>line 500</span>' in html
    assert 'id="log-first" href="?page=1"' in html and "TRAINBOARD_METRIC" not in html
    r = owner_client.get(reverse("job-logs", args=[job.pk]) + "?q=LINE 59&page=1")
    assert [t for _, t in r.context["page"].lines] == ["line 59"] + [f"line {i}" for i in range(590, 600)]
    r = owner_client.get(reverse("job-logs", args=[job.pk]) + "?rank=1")
    assert r.context["page"].lines == [(600, "[rank1]: ValueError: bad shard")]
    r = owner_client.get(reverse("job-logs", args=[job.pk]) + "?metrics=1&q=trainboard_metric")
    assert r.context["page"].lines == [(601, record)]
    bad = owner_client.get(reverse("job-logs", args=[job.pk]) + "?rank=one&page=x")
    assert bad.status_code == 400 and bad.context["problems"] == [
        "Rank “one” is not a rank: a whole number 0 to 1,000,000. Every rank's lines are shown.",
        "Page “x” is not a page number; the newest page is shown."]
    download = owner_client.get(reverse("job-logs-download", args=[job.pk]))
    assert download["Content-Disposition"] == f'attachment; filename="job-{job.pk}-log.txt"'
    assert download.streaming
    assert b"".join(download.streaming_content).decode() == "".join(f"{t}\n" for t in texts)


def test_a_refused_tag_keeps_the_tags_and_notes_typed_and_names_the_error(owner_client, jobs):
    job = jobs["a"]
    notes = "lr 0.1 <script>alert(1)</script> diverged at epoch 3\nsee the log"
    r = owner_client.post(reverse("job-annotate", args=[job.pk]), {"tags": "baseline, Bad Tag!", "notes": notes})
    assert r.status_code == 400
    html = r.content.decode()
    form = html[html.index('id="annotate-form"'):html.index("</form>", html.index('id="annotate-form"'))]
    assert 'id="annotate-errors"' in form and "Tag “tag!” may hold only lower-case letters" in form
    assert re.search(r'id="job-tags-input" value="baseline, Bad Tag!"', form)
    # The notes come back as typed, escaped (never markup), in the textarea.
    assert (f'<textarea name="notes" id="job-notes-input" rows="3" maxlength="10000">'
            f'{escape(notes)}</textarea>') in form
    assert "<script>alert(1)</script>" not in html
    job.refresh_from_db()
    assert (job.tags, job.notes) == ([], "")  # nothing saved
    # The rest of the page is the job's page (its charts and headline), not an error page.
    assert 'id="job-headline"' in html and 'id="chart-loss"' in html


def test_a_misspelt_metric_column_is_named_with_a_suggestion(owner_client, jobs):
    r = owner_client.get(reverse("job-list") + "?columns=val_acuracy,tokens/s,val_perplexity")
    html = r.content.decode()
    assert r.status_code == 200 and cells(html, "val_acuracy") == ["—"] * 4
    notices = re.findall(r'<li class="msg msg-warning">(.*?)</li>', html[html.index('id="column-notices"'):])
    assert [unescape(n) for n in notices] == [
        "No job on this page reported a metric “val_acuracy”: its column shows — for every job. "
        "Did you mean val_accuracy?"]
    # A script metric the page's jobs did report, and a trainer metric not reported yet, get no notice.
    assert "tokens/s" not in "".join(notices) and "val_perplexity" not in "".join(notices)
    assert 'id="column-notices"' not in owner_client.get(reverse("job-list")).content.decode()
    # The job's name cell keeps its width however many columns (the table scrolls: app.css).
    assert '<td class="job-name"><a href=' in html


def test_log_search_marks_its_matches_and_escapes_both_sides(owner_client, jobs):
    job = jobs["a"]
    texts = ["Epoch 1 <script>alert('line')</script> loss 0.5", "epoch 2 ok", "nothing here",
             "a <script>x</script> b <SCRIPT>"]
    JobLogLine.objects.bulk_create(JobLogLine(job=job, seq=i, text=t) for i, t in enumerate(texts))
    html = owner_client.get(reverse("job-logs", args=[job.pk]) + "?q=EPOCH").content.decode()
    lines = re.findall(r'<span class="seq">\d+</span>(.*?)</span>', html)
    assert lines == ["<mark>Epoch</mark> 1 &lt;script&gt;alert(&#x27;line&#x27;)&lt;/script&gt; loss 0.5",
                     "<mark>epoch</mark> 2 ok"]
    html = owner_client.get(reverse("job-logs", args=[job.pk]) + "?q=<script>").content.decode()
    lines = re.findall(r'<span class="seq">\d+</span>(.*?)</span>', html)
    assert lines == ["Epoch 1 <mark>&lt;script&gt;</mark>alert(&#x27;line&#x27;)&lt;/script&gt; loss 0.5",
                     "a <mark>&lt;script&gt;</mark>x&lt;/script&gt; b <mark>&lt;SCRIPT&gt;</mark>"]
    assert "<script>" not in html.split("<main", 1)[1].split("</main>", 1)[0]
    # Without a search nothing is marked.
    assert "<mark>" not in owner_client.get(reverse("job-logs", args=[job.pk])).content.decode()
