"""The job page's loss chart in a real browser, drawn from stored points: the smoothed line never
leaves the range of the two measured points it joins (no overshoot, no dip below a minimum)."""

from __future__ import annotations

import datetime as dt

import pytest

from jobs import services
from jobs.models import MetricPoint

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

T0 = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)

# Every drawn segment of every dataset, sampled along its Bézier curve (as Chart.js draws it, in
# canvas pixels), against the pixel y of the two measured points it joins.
SEGMENT_EXCURSIONS_JS = """(id) => {
  const chart = Chart.getChart(document.getElementById(id));
  const out = [];
  chart.data.datasets.forEach((d, di) => {
    const pts = chart.getDatasetMeta(di).data;
    for (let i = 0; i + 1 < pts.length; i++) {
      const a = pts[i], b = pts[i + 1];
      if (a.skip || b.skip) continue;
      const lo = Math.min(a.y, b.y), hi = Math.max(a.y, b.y);
      let worst = 0;
      for (let k = 0; k <= 50; k++) {
        const t = k / 50, u = 1 - t;
        const y = u * u * u * a.y + 3 * u * u * t * a.cp2y + 3 * u * t * t * b.cp1y + t * t * t * b.y;
        worst = Math.max(worst, lo - y, y - hi);
      }
      out.push({dataset: d.label, segment: i, worst: worst});
    }
  });
  return out;
}"""

# A noisy loss that falls fast, then zig-zags near its floor: what made the line dip below every point.
TRAIN_LOSS = [2.3, 0.9, 0.35, 0.30, 0.12, 0.31, 0.08, 0.29, 0.07, 0.30, 0.28, 0.05, 0.27]


def login(page, live_server):
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/jobs/")


def test_the_smoothed_loss_line_stays_between_the_points_it_joins(live_server, browser_page, user,
                                                                  digits_dataset, cnn_model, local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name="train_loss", step=10 * (i + 1), epoch=0, value=v, recorded_at=T0)
         for i, v in enumerate(TRAIN_LOSS)]
        + [MetricPoint(job=job, name="val_loss", step=s, epoch=e, value=v, recorded_at=T0)
           for e, (s, v) in enumerate([(40, 0.6), (80, 0.1), (130, 0.4)])])
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && "
                           "window.trainboardCharts['chart-loss'].getDatasetMeta(0).data.length === 13")
    segments = page.evaluate(SEGMENT_EXCURSIONS_JS, "chart-loss")
    assert len(segments) == 12 + 2
    over = [s for s in segments if s["worst"] > 0.01]  # pixels
    assert over == []


def test_nonfinite_points_are_gaps_with_a_marker(live_server, browser_page, user, digits_dataset, cnn_model,
                                                  local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
    losses = [2.3, 1.7, None, None]  # None: the trainer reported NaN (a diverged run)
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name="train_loss", step=10 * (i + 1), epoch=0, value=v, recorded_at=T0)
         for i, v in enumerate(losses)])
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && "
                           "window.trainboardCharts['chart-loss'].getDatasetMeta(0).data.length === 4")
    drawn = page.evaluate("""() => {
      const chart = window.trainboardCharts['chart-loss'];
      return chart.data.datasets.map((d, i) => ({
        label: d.label, spanGaps: d.spanGaps, data: d.data,
        skipped: chart.getDatasetMeta(i).data.map(p => p.skip),
        inLegend: chart.legend.legendItems.some(item => item.text === d.label)}));
    }""")
    train, val, marks = drawn
    assert train["label"] == "train loss" and train["spanGaps"] is False
    assert train["data"] == [{"x": 10, "y": 2.3}, {"x": 20, "y": 1.7}, {"x": 30, "y": None}, {"x": 40, "y": None}]
    assert train["skipped"] == [False, False, True, True]  # no line through them
    assert marks["label"] == "not finite (NaN/inf)" and marks["inLegend"] is True
    assert marks["data"] == [{"x": 30, "y": 1.7, "series": "train_loss"}, {"x": 40, "y": 1.7, "series": "train_loss"}]
    assert val["data"] == [] and val["inLegend"] is True
    # The accuracy chart has nothing to mark: no marker entry in its legend.
    assert page.evaluate("() => window.trainboardCharts['chart-accuracy'].legend.legendItems.map(i => i.text)") == [
        "train accuracy", "val accuracy"]


def test_a_long_runs_line_keeps_its_spike_in_a_band_and_a_poll_adds_only_the_new_steps(
        live_server, browser_page, user, digits_dataset, cnn_model, local_backend):
    """20,000 steps of loss with a one-step spike: the page draws at most 2,000 buckets a line and the
    spike's value is the band's top, where 2,000 evenly spaced points would have missed it (step
    12,345 is no multiple of 10). Points stored after the page loaded arrive with the next poll,
    which asks only for what is new (``?after=``)."""
    from jobs import comparison

    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
    spike = 12_345
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name="train_loss", step=s, epoch=0, value=50.0 if s == spike else 1.0 / (1 + s / 1000),
                     recorded_at=T0 + dt.timedelta(seconds=s)) for s in range(1, 20_001)])
    assert not any(round(i * 19_999 / 1999) + 1 == spike for i in range(2000))  # even sampling misses it
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && "
                           "window.trainboardCharts['chart-loss'].getDatasetMeta(0).data.length > 0")
    drawn = page.evaluate("""() => window.trainboardCharts['chart-loss'].data.datasets.map(d => ({
        label: d.label, tb: d._tb, n: d.data.length, top: Math.max(...d.data.map(p => p.y === null ? -1 : p.y))}))""")
    line = next(d for d in drawn if d["label"] == "train loss")
    band_top = next(d for d in drawn if d["label"] == "train loss (max)")
    assert line["n"] == 1251 and line["top"] < 50.0  # buckets of 16 steps; the last of the spike's is not it
    assert band_top["tb"] == "band" and band_top["top"] == 50.0
    requests = []
    page.on("request", lambda r: requests.append(r.url) if "/metrics.json" in r.url else None)
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name="train_loss", step=s, epoch=0, value=0.01, recorded_at=T0 + dt.timedelta(seconds=s))
         for s in range(20_001, 20_101)])
    # The job is active: htmx re-renders its live fragment every 2 s, and job.js polls after each.
    page.wait_for_function("() => window.trainboardCharts['chart-loss'].getDatasetMeta(0).data.length === 1257")
    assert requests and "after=20000" in requests[-1] and "widths=16%2C" in requests[-1]
    full = comparison.training_job_chart_series(job=job)["series"]["train_loss"]
    shown = page.evaluate("() => window.trainboardCharts['chart-loss'].data.datasets[0].data")
    assert [p["x"] for p in shown] == [p["x"] for p in full]


def test_zooming_in_reads_the_range_at_full_resolution_and_reset_goes_back(
        live_server, browser_page, user, digits_dataset, cnn_model, local_backend):
    """The 20,000-step run zoomed to steps 12,300–12,400: the loss chart re-reads that range and draws
    its 101 points themselves, the spike at its own step; Reset zoom draws the run's buckets again."""
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
    spike = 12_345
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name="train_loss", step=s, epoch=0, value=50.0 if s == spike else 1.0,
                     recorded_at=T0 + dt.timedelta(seconds=s)) for s in range(1, 20_001)])
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && "
                           "window.trainboardCharts['chart-loss'].getDatasetMeta(0).data.length === 1251")
    page.evaluate("() => window.trainboardZoomTo('chart-loss', 12300, 12400)")
    page.wait_for_function("() => window.trainboardCharts['chart-loss'].data.datasets[0].data.length === 101")
    data = page.evaluate("() => window.trainboardCharts['chart-loss'].data.datasets[0].data")
    assert data[0] == {"x": 12300, "y": 1.0} and data[-1] == {"x": 12400, "y": 1.0}
    assert {"x": spike, "y": 50.0} in data
    page.click("#chart-reset-zoom")
    page.wait_for_function("() => window.trainboardCharts['chart-loss'].data.datasets[0].data.length === 1251")


def test_a_scripts_metrics_get_one_chart_each_titled_by_name(live_server, browser_page, user, digits_dataset,
                                                             cnn_model, local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
    config = {**job.config, "code": {**job.config.get("code", {}), "dir": "/code", "script": "train.py"}}
    type(job).objects.filter(pk=job.pk).update(config=config)  # a script job, as the dashboard freezes it
    points = {"my_loss": [2.0, 1.0, None], "tokens/s": [800.0, 820.0, 810.0], "lr": [0.1, 0.05, 0.01],
              "train_loss": [2.1, 1.1, 0.9]}
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name=name, step=i + 1, epoch=None, value=v, recorded_at=T0)
         for name, values in points.items() for i, v in enumerate(values)])
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && window.trainboardCharts['chart-metric-2']")
    cards = page.evaluate("""() => [...document.querySelectorAll('#charts .metric-chart')].map(card => {
      const canvas = card.querySelector('canvas');
      const chart = Chart.getChart(canvas);
      return {metric: card.dataset.metric, title: card.querySelector('h2').textContent,
              label: canvas.getAttribute('aria-label'), drawn: window.trainboardCharts[canvas.id] === chart,
              datasets: chart.data.datasets.map(d => d.label), data: chart.data.datasets[0].data,
              axis: chart.options.scales.y.title.text, height: canvas.getBoundingClientRect().height};
    })""")
    assert [c["metric"] for c in cards] == ["lr", "my_loss", "tokens/s"]  # lr too: the script's own
    assert [c["title"] for c in cards] == ["lr", "my_loss", "tokens/s"]
    assert all(c["drawn"] and c["height"] > 100 and c["label"] == f"{c['metric']} by step" and c["axis"] == c["metric"]
               for c in cards)
    assert cards[1]["datasets"] == ["my_loss", "not finite (NaN/inf)"]
    assert cards[1]["data"] == [{"x": 1, "y": 2.0}, {"x": 2, "y": 1.0}, {"x": 3, "y": None}]
    assert cards[2]["data"] == [{"x": 1, "y": 800.0}, {"x": 2, "y": 820.0}, {"x": 3, "y": 810.0}]
    # A user metric named like the trainer's loss is drawn in the loss chart, not twice.
    assert page.evaluate("() => window.trainboardCharts['chart-loss'].data.datasets[0].data.length") == 3
    assert page.locator("#charts canvas").count() == 2 + 3
    # It reported no accuracy: that card is hidden, the loss card (its train_loss) shown.
    assert page.locator("#chart-accuracy").is_hidden() and page.locator("#chart-loss").is_visible()

    # A name first reported after the page loaded gets its chart at the next refresh.
    MetricPoint.objects.create(job=job, name="eval/top-1", step=3, value=0.5, recorded_at=T0)
    page.wait_for_function("() => document.querySelector('#charts .metric-chart[data-metric=\"eval/top-1\"]')",
                           timeout=15_000)
    assert page.evaluate("""() => Chart.getChart(document.querySelector(
        '#charts .metric-chart[data-metric="eval/top-1"] canvas')).data.datasets[0].data""") == [{"x": 3, "y": 0.5}]


def test_a_trainer_job_shows_only_loss_and_accuracy(live_server, browser_page, user, digits_dataset, cnn_model,
                                                     local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name=n, step=1, value=1.0, recorded_at=T0)
         for n in ("train_loss", "lr", "samples_per_s", "wait_for_slowest_s", "custom_from_model")])
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && window.trainboardCharts['chart-metric-0']")
    assert page.evaluate("() => [...document.querySelectorAll('#charts h2')].map(h => h.textContent)") == [
        "Loss", "Accuracy", "custom_from_model"]


def test_the_job_page_opens_on_its_headline_and_charts_and_fits_a_phone(live_server, browser_page, user,
                                                                        digits_dataset, cnn_model, local_backend,
                                                                        artifacts_dir):
    """Issue 27 items 12 and 13, in one browser: at 1400 × 900 the first chart starts inside the first
    screen under a headline whose latest values are the stored ones; at 390 × 844 the page is no wider
    than the screen (tables scroll inside their cards); a script's charts list only its own lines; the
    job list keeps names on a line or two with many columns."""
    from jobs.states import transition
    from jobs.sync import final_metrics_after, metric_points_from_record
    from jobs.models import TrainingJob

    job = services.training_job_create(
        owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend, nodes=1, procs_per_node=2,
        epochs=3, name="digits-cnn-ddp-" + "with-a-long-name-" * 4, env={"WANDB_RUN_GROUP": "g" * 120})
    transition(job, "SUBMITTING")
    transition(job, "PENDING")
    transition(job, "RUNNING", started_at=T0)
    t = T0.timestamp()
    records = [{"event": "step", "time": t + 10 * s, "epoch": (s - 1) // 5, "step": s, "lr": 0.05,
                "train_loss": 2.0 / s, "train_accuracy": 0.5 + s / 40,
                "rank_samples_per_s": [800.0 + s, 790.0], "rank_step_time_s": [0.04, 0.041]}
               for s in range(1, 8)]
    records.insert(5, {"event": "epoch", "time": t + 51, "epoch": 0, "step": 5, "lr": 0.05, "val_loss": 0.61234,
                       "val_accuracy": 0.8125})
    points = [p for r in records for p in metric_points_from_record(job, r, T0)]
    MetricPoint.objects.bulk_create(points)
    TrainingJob.objects.filter(pk=job.pk).update(
        final_metrics=final_metrics_after({}, points),
        rank_memory=[{"peak_bytes": 2 ** 30, "params_bytes": 2 ** 20, "grads_bytes": 2 ** 20,
                      "optimizer_bytes": 2 ** 21, "activations_bytes": 2 ** 25, "device": "cpu"}] * 2)
    stored = {name: MetricPoint.objects.filter(job=job, name=name, rank__isnull=True).order_by("-step").first().value
              for name in ("train_loss", "val_accuracy")}

    page = browser_page
    login(page, live_server)
    chart_top = "() => document.getElementById('chart-loss').getBoundingClientRect().top + window.scrollY"

    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && "
                           "window.trainboardCharts['chart-loss'].getDatasetMeta(0).data.length === 7")
    page.screenshot(path=str(artifacts_dir / "job-page-1400.png"))
    assert page.evaluate(chart_top) < 600  # was 973
    assert page.inner_text("#job-headline [data-metric=train_loss]") == f"{stored['train_loss']:.4g}" == "0.2857"
    assert page.inner_text("#job-headline [data-metric=val_accuracy]") == f"{stored['val_accuracy']:.4g}" == "0.8125"
    assert page.inner_text("#progress-value") == "epoch 2 of 3"
    assert page.evaluate("() => document.getElementById('progress-bar').value") == pytest.approx(7 / 15, abs=1e-3)

    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    page.wait_for_function("() => window.trainboardCharts && window.trainboardCharts['chart-loss']")
    page.wait_for_selector("#artifacts h2")
    widths = page.evaluate("() => [document.documentElement.scrollWidth, document.body.scrollWidth]")
    assert widths[0] <= 390 and widths[1] <= 390, widths  # was 614
    # The wide tables scroll inside their cards.
    for table in ("#memory-table", "#rank-table"):
        box = page.evaluate(f"() => {{ const t = document.querySelector('{table}');"
                            f"return [t.scrollWidth, t.parentElement.clientWidth, getComputedStyle(t.parentElement).overflowX]; }}")
        assert box[2] == "auto", (table, box)
    assert page.evaluate(chart_top) < 1000  # was 1,577
    page.screenshot(path=str(artifacts_dir / "job-page-390.png"), full_page=True)

    # A script job's loss chart: the script reported train_loss only, so no empty "val loss" entry.
    config = {**job.config, "code": {**job.config.get("code", {}), "dir": "/code", "script": "train.py"}}
    script = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                          backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
    TrainingJob.objects.filter(pk=script.pk).update(config=config)
    MetricPoint.objects.bulk_create([MetricPoint(job=script, name="train_loss", step=i, value=1.0 / i, recorded_at=T0)
                                     for i in range(1, 4)])
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(f"{live_server.url}/jobs/{script.pk}/")
    page.wait_for_function("() => window.trainboardCharts && "
                           "window.trainboardCharts['chart-loss'].getDatasetMeta(0).data.length === 3")
    assert page.evaluate("() => window.trainboardCharts['chart-loss'].legend.legendItems.map(i => i.text)") == [
        "train loss"]

    # The job list with many columns: a name stays on one or two lines, the table scrolls instead.
    named = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                         backend=local_backend, nodes=1, procs_per_node=1, epochs=1,
                                         name="demo: digits-cnn DDP with a longer name than most")
    columns = ",".join(["val_accuracy", "val_loss", "train_loss", "train_accuracy", "train.lr", "train.batch_size",
                        "train.epochs", "train.optimizer", "model.arch", "parallel.strategy", "val_perplexity"])
    page.goto(f"{live_server.url}/jobs/?columns={columns}")
    cell = page.evaluate(f"""() => {{
      const s = document.querySelector('#job-table tr[data-job="{named.pk}"] td.job-name strong');
      return [Math.round(s.getBoundingClientRect().height / parseFloat(getComputedStyle(s).lineHeight)),
              s.closest('td').getBoundingClientRect().width]; }}""")
    assert cell[0] <= 2 and cell[1] >= 300, cell  # was 5 lines in a 90 px column
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 1400


def test_a_point_stored_late_at_an_earlier_step_reaches_the_page_with_the_next_poll(
        live_server, browser_page, user, digits_dataset, cnn_model, local_backend):
    """A poll asks only for what is new since the page's last step; a point stored afterwards at a step
    before that (here validation at step 100 once the loss is at step 3,000, as a script's
    ``report.log(step=100, ...)`` would store it) is not in that answer. The answer's ``totals`` then
    do not add up with what the page kept, and the page reads every line again."""
    from jobs import comparison

    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=1, epochs=1)
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name="train_loss", step=s, epoch=0, value=1.0 / s, recorded_at=T0 + dt.timedelta(seconds=s))
         for s in range(1, 3001)])
    page = browser_page
    requests = []
    page.on("request", lambda r: requests.append(r.url) if "/metrics.json" in r.url else None)
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && "
                           "window.trainboardCharts['chart-loss'].getDatasetMeta(0).data.length === 188")
    for _ in range(2):  # polls that find nothing new
        with page.expect_request(lambda r: "/metrics.json?after=3000" in r.url, timeout=30_000):
            pass
    MetricPoint.objects.create(job=job, name="val_loss", step=100, epoch=0, value=0.5,
                               recorded_at=T0 + dt.timedelta(seconds=3100))
    page.wait_for_function("() => window.trainboardCharts['chart-loss'].data.datasets"
                           ".some(d => d.label === 'val loss' && d.data.length === 1)")
    val = page.evaluate("() => window.trainboardCharts['chart-loss'].data.datasets"
                        ".find(d => d.label === 'val loss').data.map(p => [p.x, p.y])")
    assert val == [[100, 0.5]]
    # Every request a poll (?after=), but one read of every line: the polls that found nothing new
    # added up, the one that missed the late point did not.
    assert [url for url in requests if "?after=" not in url] == [f"{live_server.url}/jobs/{job.pk}/metrics.json"]
    assert len(requests) >= 3
    expected = comparison.training_job_chart_series(job=job)
    assert expected["counts"] == {"train_loss": 3000, "val_loss": 1}


def test_the_hardware_section_charts_the_launchers_samples_by_time(live_server, browser_page, user, digits_dataset,
                                                                   cnn_model, local_backend):
    """Samples every 5 s of two ranks' memory and one node's network (as the sync stores them: their step
    the sample's Unix second) get a card each in the Hardware section, a line per rank or node, drawn
    by seconds since the first point; the loss chart keeps its step axis."""
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=2, epochs=1)
    t0 = int(T0.timestamp())
    at = [T0 + dt.timedelta(seconds=5 * i) for i in range(4)]
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name="sys/rss_mb", rank=rank, step=t0 + 5 * i, value=100.0 * (rank + 1) + i,
                     recorded_at=at[i]) for rank in (0, 1) for i in range(4)]
        + [MetricPoint(job=job, name="sys/net_recv_mb_s", rank=0, step=t0 + 5 * i, value=1.5, recorded_at=at[i])
           for i in range(4)]
        + [MetricPoint(job=job, name="train_loss", step=s, value=1.0 / s, recorded_at=at[3]) for s in (1, 2)])
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && window.trainboardCharts['chart-hw-rss-mb']")
    assert page.locator("#hardware").is_visible()
    cards = page.evaluate("""() => [...document.querySelectorAll('#hardware-charts .hardware-chart')].map(card => {
      const chart = Chart.getChart(card.querySelector('canvas'));
      return {metric: card.dataset.metric, title: card.querySelector('h2').textContent,
              lines: chart.data.datasets.filter(d => d._tb === 'line').map(d => [d.label, d.data]),
              x: chart.options.scales.x.title.text};
    })""")
    assert [c["title"] for c in cards] == ["Resident memory per rank (MB)", "Network received per node (MB/s)"]
    assert cards[0]["lines"] == [["rank 0", [{"x": 5.0 * i, "y": 100.0 + i} for i in range(4)]],
                                 ["rank 1", [{"x": 5.0 * i, "y": 200.0 + i} for i in range(4)]]]
    assert cards[1]["lines"] == [["node 0", [{"x": 5.0 * i, "y": 1.5} for i in range(4)]]]
    assert {c["x"] for c in cards} == {"seconds since the run's first point"}
    loss = page.evaluate("() => [window.trainboardCharts['chart-loss'].options.scales.x.title.text, "
                         "window.trainboardCharts['chart-loss'].data.datasets[0].data]")
    assert loss == ["step", [{"x": 1, "y": 1.0}, {"x": 2, "y": 0.5}]]
