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
