/* The job page: draws the loss and accuracy charts, one chart per other metric the job reports (a
 * user script's report.log names, listed in the payload's metric_charts), and keeps them current.
 *
 * htmx re-renders #job-live (and #job-details, out of band) every 2 s while the job is active. After
 * each swap this script fetches the metrics JSON and updates the existing Chart instances in place;
 * the canvases sit outside the swapped fragment, so the charts are never recreated. The last swap
 * (terminal state) renders #job-live without hx-trigger, which ends the polling; one final metrics
 * fetch follows it so the charts show every point.
 */
(function () {
  "use strict";

  // Forms with data-confirm ask first (Cancel). A listener here rather than an inline onsubmit: the
  // content security policy allows no inline script. Delegated, so it survives htmx swaps.
  document.addEventListener("submit", function (event) {
    const message = event.target.dataset && event.target.dataset.confirm;
    if (message && !window.confirm(message)) event.preventDefault();
  });

  // The messages above the job ("Job … queued.", "Cancelling …: the job stops when the backend
  // confirms it.") describe it as it was when the page loaded: once the polled fragment shows
  // another state they are out of date, and they go.
  const liveAtLoad = document.getElementById("job-live");
  const stateAtLoad = liveAtLoad && liveAtLoad.dataset.state;
  document.body.addEventListener("htmx:afterSettle", function (event) {
    if (event.target.id !== "job-live" || event.target.dataset.state === stateAtLoad) return;
    document.querySelectorAll("ul.messages").forEach((list) => list.remove());
  });

  const charts = document.getElementById("charts");
  const dataNode = document.getElementById("metrics-data");
  if (!charts || !dataNode || typeof Chart === "undefined") return;

  const metricsUrl = charts.dataset.metricsUrl;
  const COLORS = { train: "#2563eb", val: "#f59e0b" };
  // chart canvas id -> [[series name, legend label, colour], ...]
  const LAYOUT = {
    "chart-loss": [["train_loss", "train loss", COLORS.train], ["val_loss", "val loss", COLORS.val]],
    "chart-accuracy": [["train_accuracy", "train accuracy", COLORS.train], ["val_accuracy", "val accuracy", COLORS.val]],
  };
  const METRIC_CHART_IDS = {}; // canvas id -> metric name, for the charts of metric_charts
  const metricCanvas = {}; // metric name -> canvas id
  // chart canvas id -> its y axis; a metric chart's axis is titled by the metric's name
  const Y_SCALES = {
    "chart-loss": { beginAtZero: true, title: { display: true, text: "loss" } },
    "chart-accuracy": { min: 0, max: 1, title: { display: true, text: "accuracy" } },
  };

  const NONFINITE_LABEL = "not finite (NaN/inf)";
  const NONFINITE_COLOR = "#dc2626";

  // A point the trainer reported as NaN or infinite arrives with y null: the line breaks there
  // (spanGaps false) and a red cross marks the step, at the series' last finite value before it
  // (0 when there is none), so a diverged run shows where it diverged instead of an empty chart.
  function nonfiniteMarkers(series, payload) {
    const marks = [];
    for (const [name] of series) {
      let last = 0;
      for (const p of payload.series[name] || []) {
        if (p.y === null) marks.push({ x: p.x, y: last, series: name });
        else last = p.y;
      }
    }
    return marks;
  }

  function makeChart(canvasId, series, payload) {
    const canvas = document.getElementById(canvasId);
    return new Chart(canvas, {
      type: "line",
      data: {
        datasets: series.map(([name, label, color]) => ({
          label: label,
          data: (payload.series[name] || []).slice(),
          borderColor: color,
          backgroundColor: color,
          borderWidth: 2,
          // Per-epoch validation and a script's own metrics (maybe a few points): dots as well.
          pointRadius: name.startsWith("val_") || canvasId in METRIC_CHART_IDS ? 3 : 0,
          // Monotone cubic interpolation (Fritsch–Carlson): each segment stays between the two
          // measured points it joins, so the line never dips below a minimum it did not measure.
          // (A Bézier tension overshoots at every zig-zag of a noisy loss.)
          cubicInterpolationMode: "monotone",
          spanGaps: false,
        })).concat([{
          label: NONFINITE_LABEL,
          data: nonfiniteMarkers(series, payload),
          showLine: false,
          pointStyle: "crossRot",
          pointRadius: 7,
          pointBorderWidth: 2,
          borderColor: NONFINITE_COLOR,
          backgroundColor: NONFINITE_COLOR,
        }]),
      },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        parsing: true,
        interaction: { mode: "nearest", intersect: false },
        scales: {
          x: { type: "linear", title: { display: true, text: "step" }, ticks: { precision: 0 } },
          y: Y_SCALES[canvasId],
        },
        plugins: {
          legend: {
            position: "bottom",
            // The non-finite marker's entry only where there is something to mark.
            labels: { filter: (item, data) => item.text !== NONFINITE_LABEL || data.datasets[item.datasetIndex].data.length > 0 },
          },
        },
      },
    });
  }

  const initial = JSON.parse(dataNode.textContent);
  const instances = {};
  for (const [canvasId, series] of Object.entries(LAYOUT)) {
    instances[canvasId] = makeChart(canvasId, series, initial);
  }

  // One card per metric name, made when the name first appears: a running script may start reporting
  // a metric at any step. Built with the DOM API (textContent), so a name is never read as markup.
  function ensureMetricCharts(payload) {
    for (const name of payload.metric_charts || []) {
      if (metricCanvas[name]) continue;
      const canvasId = "chart-metric-" + Object.keys(metricCanvas).length;
      const card = document.createElement("div");
      card.className = "card chart-card metric-chart";
      card.dataset.metric = name;
      const title = document.createElement("h2");
      title.textContent = name;
      const box = document.createElement("div");
      box.className = "chart-box";
      const canvas = document.createElement("canvas");
      canvas.id = canvasId;
      canvas.setAttribute("role", "img");
      canvas.setAttribute("aria-label", name + " by step");
      box.appendChild(canvas);
      card.append(title, box);
      charts.appendChild(card);
      metricCanvas[name] = canvasId;
      METRIC_CHART_IDS[canvasId] = name;
      LAYOUT[canvasId] = [[name, name, COLORS.train]];
      Y_SCALES[canvasId] = { title: { display: true, text: name } };
      instances[canvasId] = makeChart(canvasId, LAYOUT[canvasId], payload);
    }
  }
  ensureMetricCharts(initial);

  // A script reports what it likes: its page keeps a loss or accuracy card only while one of the
  // card's series has points (a trainer job's cards always show, empty until its first step).
  function fitBuiltinCards(payload) {
    if (charts.dataset.script !== "true") return;
    for (const canvasId of ["chart-loss", "chart-accuracy"]) {
      const card = document.getElementById(canvasId).closest(".chart-card");
      card.hidden = !LAYOUT[canvasId].some(([name]) => (payload.series[name] || []).length > 0);
    }
  }
  fitBuiltinCards(initial);

  function applyMetrics(payload) {
    ensureMetricCharts(payload);
    fitBuiltinCards(payload);
    for (const [canvasId, series] of Object.entries(LAYOUT)) {
      const chart = instances[canvasId];
      series.forEach(([name], i) => {
        chart.data.datasets[i].data = (payload.series[name] || []).slice();
      });
      chart.data.datasets[series.length].data = nonfiniteMarkers(series, payload);
      chart.update("none");
    }
  }

  let inFlight = false;
  async function refreshMetrics() {
    if (inFlight) return;
    inFlight = true;
    try {
      const response = await fetch(metricsUrl, { headers: { Accept: "application/json" }, credentials: "same-origin" });
      if (response.ok) applyMetrics(await response.json());
    } catch (err) {
      // A missed refresh is retried at the next poll; nothing to tell the user.
    } finally {
      inFlight = false;
    }
  }

  function scrollLogToEnd() {
    const log = document.getElementById("log-tail");
    if (log) log.scrollTop = log.scrollHeight;
  }

  document.body.addEventListener("htmx:afterSettle", function (event) {
    if (event.target.id !== "job-live") return; // the out-of-band #job-details settles too
    refreshMetrics();
    scrollLogToEnd();
    if (event.target.dataset.terminal === "true") {
      // Points the last sync ingested alongside the final state: fetch again a little later.
      setTimeout(refreshMetrics, 1500);
      setTimeout(refreshMetrics, 5000);
    }
  });

  scrollLogToEnd();
  // The page may have been rendered a moment before the first points arrived.
  if (document.getElementById("job-live").dataset.terminal !== "true") refreshMetrics();

  window.trainboardCharts = instances; // for the browser tests and the console
})();
