"""The comparison page and the chart controls in a real browser (Chromium): one chart per metric with a
line per run, the table and the diff; the x axis by step, relative and wall time, the log scale,
smoothing (raw line kept faint), zoom and its reset, per-rank lines and the fitted accuracy axis, read
from the Chart.js instances of the page."""

from __future__ import annotations

import datetime as dt

import pytest

from jobs import services
from jobs.models import MetricPoint

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

T0 = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def login(page, live_server):
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/jobs/")


def _points(job, name, values, *, rank=None, start_s=0):
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name=name, step=10 * (i + 1), epoch=0, rank=rank, value=v,
                     recorded_at=T0 + dt.timedelta(seconds=start_s + 5 * i)) for i, v in enumerate(values)])


# The chart of a metric: its line datasets (not the faint raw lines), its scales as drawn.
CHART_JS = """(metric) => {
  const card = document.querySelector(`.compare-chart[data-metric="${metric}"]`);
  const chart = Chart.getChart(card.querySelector('canvas'));
  const pick = (kind) => chart.data.datasets.filter(d => d._tb === kind)
    .map(d => ({label: d.label, data: d.data.map(p => [p.x, p.y])}));
  return {lines: pick('line'), raws: pick('raw'), xType: chart.scales.x.type, yType: chart.scales.y.type,
          xMin: chart.scales.x.min, xMax: chart.scales.x.max, yMin: chart.options.scales.y.min,
          yMax: chart.options.scales.y.max, xTitle: chart.options.scales.x.title.text};
}"""


@pytest.fixture
def three_runs(user, digits_dataset, cnn_model, local_backend):
    def make(name, **kwargs):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=local_backend, nodes=1, procs_per_node=1, epochs=1,
                                            name=name, **kwargs)

    a, b, c = make("run-a", lr=0.05), make("run-b", lr=0.1), make("run-c", lr=0.05, batch_size=64)
    losses = [2.0, 1.2, 1.5, 0.7, 0.9, 0.4, 0.6, 0.3]  # zig-zags: smoothing changes it
    _points(a, "train_loss", losses)
    _points(b, "train_loss", [v * 1.2 for v in losses], start_s=100)
    _points(c, "train_loss", [v * 0.9 for v in losses[:4]], start_s=200)
    _points(a, "val_accuracy", [0.62, 0.81])
    _points(b, "val_accuracy", [0.55, 0.9], start_s=100)
    _points(c, "my_score", [3.0, 4.0], start_s=200)
    _points(a, "rank_samples_per_s", [100.0, 110.0], rank=0)
    _points(a, "rank_samples_per_s", [90.0, 94.0], rank=1)
    return a, b, c


def test_the_comparison_page_and_its_chart_controls(live_server, browser_page, three_runs, artifacts_dir):
    a, b, c = three_runs
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/compare/?ids={a.pk},{b.pk},{c.pk}")
    page.wait_for_function("() => window.trainboardCharts && Object.keys(window.trainboardCharts).length === 4")
    metrics = page.evaluate("() => [...document.querySelectorAll('.compare-chart')].map(c => c.dataset.metric)")
    assert metrics == ["val_accuracy", "train_loss", "rank_samples_per_s", "my_score"]

    loss = page.evaluate(CHART_JS, "train_loss")
    assert [line["label"] for line in loss["lines"]] == [f"#{a.pk} run-a", f"#{b.pk} run-b", f"#{c.pk} run-c"]
    assert [len(line["data"]) for line in loss["lines"]] == [8, 8, 4]
    assert loss["raws"] == [] and loss["xType"] == "linear" and loss["xTitle"] == "step"
    assert loss["lines"][0]["data"][:2] == [[10, 2.0], [20, 1.2]]
    assert len(page.evaluate(CHART_JS, "my_score")["lines"]) == 1  # only c logged it
    # The accuracy axis is fitted to the data (0.55–0.9, a 5% margin), not 0–1.
    accuracy = page.evaluate(CHART_JS, "val_accuracy")
    assert accuracy["yMin"] == pytest.approx(0.55 - 0.0175) and accuracy["yMax"] == pytest.approx(0.9 + 0.0175)

    # The table (a's final and best loss, 0.3, are the best) and the diff (only what differs: lr, batch size).
    best = page.locator('#compare-table td.best[data-metric="train_loss"][data-which="final"]')
    assert best.count() == 1 and best.text_content() == "0.3"
    assert page.locator(f'#compare-table tr[data-job-id="{a.pk}"] td.best[data-metric="train_loss"]').count() == 2
    diff_keys = page.evaluate("() => [...document.querySelectorAll('#config-diff tr[data-key]')].map(r => r.dataset.key)")
    assert "train.lr" in diff_keys and "train.batch_size" in diff_keys and "train.epochs" not in diff_keys
    page.screenshot(path=str(artifacts_dir / "compare-runs.png"), full_page=True)

    # x axis: relative time counts from each run's first point; wall time is a time axis.
    page.select_option("#chart-x", "relative")
    loss = page.evaluate(CHART_JS, "train_loss")
    assert loss["xType"] == "linear" and loss["xTitle"] == "seconds since the run's first point"
    assert [line["data"][:2] for line in loss["lines"]] == [[[0, 2.0], [5, 1.2]], [[0, 2.4], [5, 1.44]],
                                                            [[0, 1.8], [5, 1.08]]]
    page.select_option("#chart-x", "wall")
    loss = page.evaluate(CHART_JS, "train_loss")
    assert loss["xType"] == "time" and loss["lines"][1]["data"][0][0] == (T0.timestamp() + 100) * 1000
    page.select_option("#chart-x", "step")

    # Log scale on every chart's y axis.
    page.check("#chart-log")
    assert {page.evaluate(CHART_JS, m)["yType"] for m in metrics} == {"logarithmic"}
    page.uncheck("#chart-log")
    assert page.evaluate(CHART_JS, "train_loss")["yType"] == "linear"

    # Smoothing: the line is the moving average, the raw line stays (faint, out of the legend).
    page.fill("#chart-smoothing", "0.8")
    loss = page.evaluate(CHART_JS, "train_loss")
    assert page.text_content("#chart-smoothing-value") == "0.80"
    assert [r["data"] for r in loss["raws"]][0][:3] == [[10, 2.0], [20, 1.2], [30, 1.5]]
    smoothed = [y for _, y in loss["lines"][0]["data"]]
    raw = [y for _, y in loss["raws"][0]["data"]]
    assert smoothed[0] == pytest.approx(2.0) and smoothed != raw
    assert smoothed[1] == pytest.approx((0.8 * 0.2 * 2.0 + 0.2 * 1.2) / (1 - 0.8 ** 2))
    legend = page.evaluate("""() => Chart.getChart(document.querySelector('.compare-chart[data-metric="train_loss"] canvas'))
        .legend.legendItems.map(i => i.text)""")
    assert legend == [f"#{a.pk} run-a", f"#{b.pk} run-b", f"#{c.pk} run-c"]
    page.fill("#chart-smoothing", "0")
    assert page.evaluate(CHART_JS, "train_loss")["raws"] == []

    # Zoom: the wheel over a chart narrows its x range; Reset zoom gives it back.
    before = page.evaluate(CHART_JS, "train_loss")
    box = page.locator('.compare-chart[data-metric="train_loss"] canvas').bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    for _ in range(3):
        page.mouse.wheel(0, -300)
    page.wait_for_function("""(m) => { const c = Chart.getChart(document.querySelector(
        `.compare-chart[data-metric="${m}"] canvas`)); return c.scales.x.max - c.scales.x.min < %f; }"""
                           % ((before["xMax"] - before["xMin"]) * 0.9), arg="train_loss")
    zoomed = page.evaluate(CHART_JS, "train_loss")
    assert before["xMin"] <= zoomed["xMin"] < zoomed["xMax"] <= before["xMax"]
    page.fill("#chart-smoothing", "0.3")  # another control keeps the zoomed range
    assert page.evaluate(CHART_JS, "train_loss")["xMax"] == pytest.approx(zoomed["xMax"])
    page.click("#chart-reset-zoom")
    page.wait_for_function("""(m) => { const c = Chart.getChart(document.querySelector(
        `.compare-chart[data-metric="${m}"] canvas`)); return c.scales.x.max === %r; }""" % before["xMax"],
                           arg="train_loss")
    page.fill("#chart-smoothing", "0")

    # Per-rank: one line per rank of each run, or each run's mean over its ranks.
    ranks = page.evaluate(CHART_JS, "rank_samples_per_s")
    assert [line["label"] for line in ranks["lines"]] == [f"#{a.pk} run-a · rank 0", f"#{a.pk} run-a · rank 1"]
    assert ranks["lines"][1]["data"] == [[10, 90.0], [20, 94.0]]
    page.uncheck("#chart-per-rank")
    ranks = page.evaluate(CHART_JS, "rank_samples_per_s")
    assert ranks["lines"] == [{"label": f"#{a.pk} run-a · mean over ranks", "data": [[10, 95.0], [20, 102.0]]}]


def test_the_job_page_charts_have_the_same_controls(live_server, browser_page, user, digits_dataset, cnn_model,
                                                    local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=2, epochs=1)
    _points(job, "train_loss", [2.0, 1.0, 1.4, 0.5])
    _points(job, "train_accuracy", [0.2, 0.45, 0.4, 0.7])
    for rank, values in ((0, [0.04, 0.05, 0.04]), (1, [0.06, 0.07, 0.06])):
        _points(job, "rank_step_time_s", values, rank=rank, start_s=2)
    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && window.trainboardCharts['chart-rank-step-time-s']")
    state = """(id) => { const c = window.trainboardCharts[id];
      return {xType: c.scales.x.type, yType: c.scales.y.type, yMin: c.options.scales.y.min, yMax: c.options.scales.y.max,
              lines: c.data.datasets.filter(d => d._tb === 'line').map(d => [d.label, d.data.map(p => [p.x, p.y])]),
              raws: c.data.datasets.filter(d => d._tb === 'raw').length}; }"""
    accuracy = page.evaluate(state, "chart-accuracy")
    assert accuracy["yMin"] == pytest.approx(0.2 - 0.025) and accuracy["yMax"] == pytest.approx(0.7 + 0.025)
    ranks = page.evaluate(state, "chart-rank-step-time-s")
    assert ranks["lines"] == [["rank 0", [[10, 0.04], [20, 0.05], [30, 0.04]]],
                              ["rank 1", [[10, 0.06], [20, 0.07], [30, 0.06]]]]
    page.uncheck("#chart-per-rank")
    mean = page.evaluate(state, "chart-rank-step-time-s")["lines"]
    assert mean[0][0] == "mean over ranks" and [y for _, y in mean[0][1]] == pytest.approx([0.05, 0.06, 0.05])
    # Relative time: the job's first point (its loss at T0) is 0; the ranks' first step came 2 s later.
    page.select_option("#chart-x", "relative")
    assert page.evaluate(state, "chart-loss")["lines"][0][1][:2] == [[0, 2.0], [5, 1.0]]
    assert page.evaluate(state, "chart-rank-step-time-s")["lines"][0][1][0][0] == 2
    page.select_option("#chart-x", "wall")
    assert page.evaluate(state, "chart-loss")["xType"] == "time"
    page.check("#chart-log")
    assert page.evaluate(state, "chart-loss")["yType"] == "logarithmic"
    page.fill("#chart-smoothing", "0.5")
    loss = page.evaluate(state, "chart-loss")  # train loss and (empty) val loss, each with its raw line
    assert loss["raws"] == 2 and [y for _, y in loss["lines"][0][1]][1] == pytest.approx(
        (0.5 * 0.5 * 2.0 + 0.5 * 1.0) / (1 - 0.25))


def test_a_32_rank_job_charts_the_median_across_ranks_in_a_min_max_band_and_names_the_slowest_rank(
        live_server, browser_page, user, digits_dataset, cnn_model, local_backend):
    from jobs import sync
    from jobs.models import TrainingJob

    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=local_backend, nodes=1, procs_per_node=2, epochs=1)
    TrainingJob.objects.filter(pk=job.pk).update(nodes=4, procs_per_node=8)  # 32 ranks: past MAX_RANK_LINES
    points = []
    for step in (10, 20, 30):
        # Rank r takes 0.1 + r/1000 s a step; rank 9 is slowed to 0.5 s at step 20.
        times = [0.1 + r / 1000 for r in range(32)]
        if step == 20:
            times[9] = 0.5
        record = {"event": "step", "step": step, "epoch": 0, "time": T0.timestamp() + step,
                  "rank_step_time_s": times}
        points += sync.metric_points_from_record(job, record, T0)
    MetricPoint.objects.bulk_create(points)

    page = browser_page
    login(page, live_server)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_function("() => window.trainboardCharts && window.trainboardCharts['chart-rank-step-time-s']")
    drawn = page.evaluate("""(id) => { const c = window.trainboardCharts[id];
      const pick = (kind) => c.data.datasets.filter(d => d._tb === kind).map(d => [d.label, d.data.map(p => [p.x, p.y])]);
      return {lines: pick('line'), bands: pick('band'),
              title: c.canvas.closest('.chart-card').querySelector('h2').textContent}; }""",
                          "chart-rank-step-time-s")
    assert drawn["title"] == "Step time per rank (s): min / median / max across ranks"
    # The median of 32 ranks is the mean of the 16th and 17th times: ranks 15's and 16's, and at step 20,
    # with rank 9 moved to the top, ranks 16's and 17's; the band's top there is rank 9's 0.5 s.
    [(label, data)] = drawn["lines"]
    assert label == "median across ranks (band: min–max; slowest: rank 9)"
    assert [x for x, _ in data] == [10, 20, 30]
    assert [y for _, y in data] == pytest.approx([(0.115 + 0.116) / 2, (0.116 + 0.117) / 2, (0.115 + 0.116) / 2])
    bands = dict(drawn["bands"])
    assert [y for _, y in bands[label + " (max)"]] == pytest.approx([0.131, 0.5, 0.131])
    assert [y for _, y in bands[label + " (min)"]] == pytest.approx([0.1, 0.1, 0.1])
    # The per-rank checkbox cannot bring 32 lines back: the job has too many ranks for a line each.
    page.check("#chart-per-rank")
    assert page.evaluate("(id) => window.trainboardCharts[id].data.datasets.filter(d => d._tb === 'line').length",
                         "chart-rank-step-time-s") == 1
