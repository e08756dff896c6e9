/* The job page: draws the loss and accuracy charts, one chart per other metric the job reports (a
 * user script's report.log names, listed in the payload's metric_charts), one chart per per-rank
 * metric (a line per rank, or the median across ranks with a min–max band: always past 16 ranks),
 * and keeps them current. The chart controls above them (x axis, log
 * scale, zoom, smoothing, per-rank lines) are chart_controls.js's.
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
  const Kit = window.TrainboardChartKit;
  if (!charts || !dataNode || typeof Chart === "undefined" || !Kit) return;

  const metricsUrl = charts.dataset.metricsUrl;
  const SCRIPT = charts.dataset.script === "true";
  const controlsForm = document.getElementById("chart-controls");
  let controls = Kit.readControls(controlsForm);
  const COLORS = { train: "#2563eb", val: "#f59e0b" };
  // chart canvas id -> [[series name, legend label, colour], ...]
  const LAYOUT = {
    "chart-loss": [["train_loss", "train loss", COLORS.train], ["val_loss", "val loss", COLORS.val]],
    "chart-accuracy": [["train_accuracy", "train accuracy", COLORS.train], ["val_accuracy", "val accuracy", COLORS.val]],
  };
  const METRIC_CHART_IDS = {}; // canvas id -> metric name, for the charts of metric_charts
  const metricCanvas = {}; // metric name -> canvas id
  const RANK_CHART_IDS = {}; // canvas id -> per-rank metric name (payload.rank_series)
  const rankCanvas = {}; // per-rank metric name -> canvas id
  const HW_CHART_IDS = {}; // canvas id -> hardware series name (payload.hardware.series)
  const hwCanvas = {}; // hardware series name -> canvas id
  // The launcher's samples (trainer_pkg/hardware.py), in the order the Hardware section shows them:
  // [title, what a line is]. A node's series are indexed by node, the others by rank.
  const HW_TITLES = {
    "sys/gpu_util_pct": ["GPU utilisation per rank (%)", "rank"],
    "sys/gpu_mem_used_mb": ["GPU memory used per rank (MB)", "rank"],
    "sys/gpu_power_w": ["GPU power per rank (W)", "rank"],
    "sys/gpu_temp_c": ["GPU temperature per rank (°C)", "rank"],
    "sys/gpu_sm_clock_mhz": ["GPU SM clock per rank (MHz)", "rank"],
    "sys/cpu_pct": ["CPU per rank (% of one core)", "rank"],
    "sys/rss_mb": ["Resident memory per rank (MB)", "rank"],
    "sys/net_recv_mb_s": ["Network received per node (MB/s)", "node"],
    "sys/net_sent_mb_s": ["Network sent per node (MB/s)", "node"],
    "sys/disk_read_mb_s": ["Disk read per node (MB/s)", "node"],
    "sys/disk_write_mb_s": ["Disk written per node (MB/s)", "node"],
  };
  const hardwareSection = document.getElementById("hardware");
  const hardwareCharts = document.getElementById("hardware-charts");
  const RANK_TITLES = {
    rank_samples_per_s: "Samples/s per rank", rank_step_time_s: "Step time per rank (s)",
    rank_data_wait_s: "Data wait per rank (s/step)", rank_compute_s: "Compute per rank (s/step)",
    rank_sync_wait_s: "Sync wait per rank (s/step)",
  };
  // chart canvas id -> [y axis title, kind]: the accuracy axis is fitted to the data, the loss
  // axis starts at zero; a metric chart's axis is titled by the metric's name.
  const Y_AXES = { "chart-loss": ["loss", "loss"], "chart-accuracy": ["accuracy", "accuracy"] };

  const NONFINITE_LABEL = "not finite (NaN/inf)";
  const NONFINITE_COLOR = "#dc2626";

  let payload = JSON.parse(dataNode.textContent);
  // canvas id -> the payload of its zoomed range (?steps=first,last), read at the resolution the range
  // needs: a chart zoomed on the step axis shows its range's own buckets, or its points once it holds
  // at most 2,000 steps; Reset zoom goes back to the whole run's.
  const zoomed = {};

  // The lines of a chart under the controls: a per-rank chart one line per rank (or their mean),
  // any other the series of its LAYOUT.
  function linesOf(canvasId) {
    if (canvasId in HW_CHART_IDS) {
      const name = HW_CHART_IDS[canvasId];
      const hw = payload.hardware || {};
      const byIndex = (hw.series || {})[name] || {};
      const t0 = hardwareT0();
      return Object.keys(byIndex).sort((a, b) => a - b).map((index, i) => (
        { label: HW_TITLES[name][1] + " " + index, key: index, color: Kit.color(i), points: byIndex[index], t0: t0 }));
    }
    const source = zoomed[canvasId] || payload;
    const t0 = payload.t0 || 0;
    if (canvasId in RANK_CHART_IDS) {
      const name = RANK_CHART_IDS[canvasId];
      const byRank = (source.rank_series || {})[name] || {};
      const stats = (source.rank_stats || {})[name];
      if (stats && stats.median && (!controls.perRank || !payload.rank_lines)) {
        return [acrossRanks(stats, payload.slowest_rank && payload.slowest_rank[name], t0)];
      }
      if (!controls.perRank) {
        return [{ label: "mean over ranks", key: "mean", color: COLORS.train, points: Kit.meanOverRanks(byRank), t0: t0 }];
      }
      return Object.keys(byRank).sort((a, b) => a - b).map((rank, i) => (
        { label: "rank " + rank, key: "rank " + rank, color: Kit.color(i), points: byRank[rank], t0: t0 }));
    }
    return LAYOUT[canvasId].map(([name, label, color]) => ({
      label: label, key: name, color: color, points: source.series[name] || [], t0: t0,
      // Per-epoch validation and a script's own metrics (maybe a few points): dots as well.
      radius: name.startsWith("val_") || canvasId in METRIC_CHART_IDS ? 3 : 0,
    }));
  }

  // A per-rank metric across its ranks (payload.rank_stats): the median line with a min–max band
  // (Kit.acrossRanks), the slowest rank over the run named in the legend.
  function acrossRanks(stats, slowest, t0) {
    const label = "median across ranks (band: min–max" +
      (slowest !== undefined && slowest !== null ? "; slowest: rank " + slowest : "") + ")";
    return { label: label, key: "across ranks", color: COLORS.train, points: Kit.acrossRanks(stats), t0: t0 };
  }

  // The hardware charts count time whatever the x control says: their "step" is the sample's Unix
  // second, so the step axis shows seconds since the first point instead. Their relative time
  // counts from the earlier of the run's first point and the first sample (sampling starts first).
  function hardwareT0() {
    const first = (payload.hardware || {}).t0;
    if (first === null || first === undefined) return payload.t0 || 0;
    return payload.t0 ? Math.min(payload.t0, first) : first;
  }

  function controlsOf(canvasId) {
    if (!(canvasId in HW_CHART_IDS) || controls.x !== "step") return controls;
    return Object.assign({}, controls, { x: "relative" });
  }

  // A point the trainer reported as NaN or infinite arrives with y null: the line breaks there
  // (spanGaps false) and a red cross marks the step, at the series' last finite value before it
  // (0 when there is none), so a diverged run shows where it diverged instead of an empty chart.
  function nonfiniteMarkers(lines, x) {
    const marks = [];
    for (const line of lines) {
      let last = 0;
      for (const p of line.points) {
        if (p.y === null) marks.push({ x: Kit.xOf(p, x, line.t0), y: last, series: line.key });
        else last = p.y;
      }
    }
    return marks;
  }

  // The chart's datasets: its lines, the non-finite marker, then (with smoothing) the faint raw lines.
  function datasetsOf(canvasId, lines) {
    const mine = controlsOf(canvasId);
    const sets = Kit.datasets(lines, mine);
    sets.splice(lines.length, 0, {
      label: NONFINITE_LABEL,
      data: nonfiniteMarkers(lines, mine.x),
      showLine: false,
      pointStyle: "crossRot",
      pointRadius: 7,
      pointBorderWidth: 2,
      borderColor: NONFINITE_COLOR,
      backgroundColor: NONFINITE_COLOR,
      _tb: "marker",
    });
    return sets;
  }

  function yAxisOf(canvasId, lines) {
    const [title, kind] = Y_AXES[canvasId];
    return Kit.yScale(title, kind, lines.flatMap((line) => line.points.map((p) => p.y)), controlsOf(canvasId));
  }

  // The zoom plugin's options with the range re-read when a zoom or a pan ends (or is reset).
  function zoomOf(canvasId) {
    const options = Kit.zoomOptions();
    options.zoom.onZoomComplete = () => readRange(canvasId);
    options.pan.onPanComplete = () => readRange(canvasId);
    return options;
  }

  // The zoomed range of a chart on the step axis, read again from the server; nothing to read when
  // the chart is not zoomed (its lines are the run's again) or its x axis counts time.
  async function readRange(canvasId) {
    const chart = instances[canvasId];
    if (!chart || canvasId in HW_CHART_IDS) return; // a hardware chart holds its whole run, by time
    const x = chart.scales.x;
    if (controls.x !== "step" || !chart.isZoomedOrPanned()) {
      if (zoomed[canvasId]) {
        delete zoomed[canvasId];
        redraw(canvasId);
      }
      return;
    }
    const first = Math.max(0, Math.floor(x.min));
    const last = Math.max(first, Math.ceil(x.max));
    try {
      const response = await fetch(metricsUrl + "?" + new URLSearchParams({ steps: first + "," + last }).toString(),
                                   { headers: { Accept: "application/json" }, credentials: "same-origin" });
      if (!response.ok) return;
      zoomed[canvasId] = await response.json();
      redraw(canvasId);
    } catch (err) {
      // The chart keeps the run's buckets; the next zoom tries again.
    }
  }

  // For the browser tests and the console: zoom a chart on the step axis to [first, last].
  window.trainboardZoomTo = function (canvasId, first, last) {
    const chart = instances[canvasId];
    chart.zoomScale("x", { min: first, max: last }, "none");
    return readRange(canvasId);
  };

  function makeChart(canvasId) {
    const lines = linesOf(canvasId);
    return new Chart(document.getElementById(canvasId), {
      type: "line",
      data: { datasets: datasetsOf(canvasId, lines) },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        parsing: true,
        interaction: { mode: "nearest", intersect: false },
        scales: { x: Kit.xScale(controlsOf(canvasId).x), y: yAxisOf(canvasId, lines) },
        plugins: {
          legend: {
            position: "bottom",
            // The non-finite marker's entry only where there is something to mark; no raw lines.
            // A script's chart lists only the lines it reported (no empty "val loss").
            labels: { filter: (item, data) => Kit.legendFilter(item, data) &&
              ((item.text !== NONFINITE_LABEL && !SCRIPT) || data.datasets[item.datasetIndex].data.length > 0) },
          },
          zoom: zoomOf(canvasId),
        },
      },
    });
  }

  function redraw(canvasId, what) {
    const chart = instances[canvasId];
    const lines = linesOf(canvasId);
    Kit.setDatasets(chart, datasetsOf(canvasId, lines));
    const x = Kit.xScale(controlsOf(canvasId).x);
    Kit.keepZoom(chart, x, what);
    chart.options.scales.x = x;
    chart.options.scales.y = yAxisOf(canvasId, lines);
    chart.update("none");
  }

  const instances = {};
  for (const canvasId of Object.keys(LAYOUT)) {
    instances[canvasId] = makeChart(canvasId);
  }

  // A card with a canvas, built with the DOM API (textContent), so a name is never read as markup.
  function addCard(canvasId, name, title, className, parent) {
    const card = document.createElement("div");
    card.className = "card chart-card " + className;
    card.dataset.metric = name;
    const heading = document.createElement("h2");
    heading.textContent = title;
    const box = document.createElement("div");
    box.className = "chart-box";
    const canvas = document.createElement("canvas");
    canvas.id = canvasId;
    canvas.setAttribute("role", "img");
    canvas.setAttribute("aria-label", name + (parent ? " by time" : " by step"));
    box.appendChild(canvas);
    card.append(heading, box);
    (parent || charts).appendChild(card);
  }

  // One card per metric name, made when the name first appears: a running script may start reporting
  // a metric at any step.
  function ensureMetricCharts() {
    for (const name of payload.metric_charts || []) {
      if (metricCanvas[name]) continue;
      const canvasId = "chart-metric-" + Object.keys(metricCanvas).length;
      addCard(canvasId, name, name, "metric-chart");
      metricCanvas[name] = canvasId;
      METRIC_CHART_IDS[canvasId] = name;
      LAYOUT[canvasId] = [[name, name, COLORS.train]];
      Y_AXES[canvasId] = [name, "other"];
      instances[canvasId] = makeChart(canvasId);
    }
  }
  ensureMetricCharts();

  // One card per per-rank metric the job reports (samples/s, step time ... of each rank).
  function ensureRankCharts() {
    for (const name of Object.keys(RANK_TITLES)) {
      if (rankCanvas[name] || !((payload.rank_series || {})[name] || (payload.rank_stats || {})[name])) continue;
      const canvasId = "chart-rank-" + name.replace(/^rank_/, "").replace(/_/g, "-");
      // Too many ranks for a line each (jobs.comparison.MAX_RANK_LINES): the chart says what it shows.
      addCard(canvasId, name, RANK_TITLES[name] + (payload.rank_lines === false ? ": min / median / max across ranks" : ""),
              "rank-chart");
      rankCanvas[name] = canvasId;
      RANK_CHART_IDS[canvasId] = name;
      Y_AXES[canvasId] = [name.replace(/^rank_/, ""), "other"];
      instances[canvasId] = makeChart(canvasId);
    }
  }
  ensureRankCharts();

  // One card per hardware series the launcher sent, in the Hardware section (shown once one has
  // points; a job of many ranks gets a note instead of lines).
  function ensureHardwareCharts() {
    const hw = payload.hardware;
    if (!hardwareSection || !hw) return;
    if (hw.t0 !== null && hw.t0 !== undefined) hardwareSection.hidden = false;
    if (hw.lines === false) {
      document.getElementById("hardware-note").textContent =
        "Sampled by the launcher and stored; this job has too many ranks for a line each.";
      return;
    }
    for (const name of Object.keys(HW_TITLES)) {
      if (hwCanvas[name] || !Object.keys((hw.series || {})[name] || {}).length) continue;
      const canvasId = "chart-hw-" + name.replace(/^sys\//, "").replace(/_/g, "-");
      addCard(canvasId, name, HW_TITLES[name][0], "hardware-chart", hardwareCharts);
      hwCanvas[name] = canvasId;
      HW_CHART_IDS[canvasId] = name;
      Y_AXES[canvasId] = [name.replace(/^sys\//, ""), "other"];
      instances[canvasId] = makeChart(canvasId);
    }
  }
  ensureHardwareCharts();

  // A script reports what it likes: its page keeps a loss or accuracy card only while one of the
  // card's series has points (a trainer job's cards always show, empty until its first step).
  function fitBuiltinCards() {
    if (!SCRIPT) return;
    for (const canvasId of ["chart-loss", "chart-accuracy"]) {
      const card = document.getElementById(canvasId).closest(".chart-card");
      card.hidden = !LAYOUT[canvasId].some(([name]) => (payload.series[name] || []).length > 0);
    }
  }
  fitBuiltinCards();

  // A line with the poll's points put in place of its own from the poll's from_step on.
  function mergeLine(old, fresh, from) {
    return (old || []).filter((p) => p.x < from).concat(fresh || []);
  }

  // A poll's answer over the payload: every point again (replace), or only what is new.
  function merged(next) {
    if (next.replace) return next;
    const [fromGlobal, fromRank] = next.from_step;
    const series = {};
    for (const name of new Set([...Object.keys(payload.series), ...Object.keys(next.series)])) {
      series[name] = mergeLine(payload.series[name], next.series[name], fromGlobal);
    }
    // Per-rank lines by rank, and the statistics across ranks by min/median/max: the same merge.
    function mergeGroups(before, fresh) {
      const out = {};
      for (const name of new Set([...Object.keys(before || {}), ...Object.keys(fresh || {})])) {
        const lines = {};
        const mine = (before || {})[name] || {};
        const theirs = (fresh || {})[name] || {};
        for (const key of new Set([...Object.keys(mine), ...Object.keys(theirs)])) {
          lines[key] = mergeLine(mine[key], theirs[key], fromRank);
        }
        out[name] = lines;
      }
      return out;
    }
    return Object.assign({}, next, { series: series, rank_series: mergeGroups(payload.rank_series, next.rank_series),
                                     rank_stats: mergeGroups(payload.rank_stats, next.rank_stats) });
  }

  // How many stored points a group's lines hold: a bucket its count (n), a point at width 1 itself;
  // a gap marker none (its bucket counts it).
  function pointsIn(groups, from, width) {
    let total = 0;
    for (const lines of groups) {
      for (const line of Object.values(lines || {})) {
        for (const p of line) if (p.x >= from) total += p.n !== undefined ? p.n : (width === 1 ? 1 : 0);
      }
    }
    return total;
  }

  // Whether a poll's answer, put in place of the page's points from its from_step on, holds every
  // point the server counts (next.totals, per group: the global lines; the ranks' lines and the
  // statistics across ranks). Answers without totals (an older server) are taken as they are.
  function addsUp(next) {
    if (!next.totals || !payload.totals) return true;
    const [fromGlobal, fromRank] = next.from_step;
    const [wGlobal, wRank] = next.widths;
    const rankGroups = (data) => [...Object.values(data.rank_series || {}), ...Object.values(data.rank_stats || {})];
    const global = payload.totals[0] - pointsIn([payload.series], fromGlobal, wGlobal) +
      pointsIn([next.series], fromGlobal, wGlobal);
    const perRank = payload.totals[1] - pointsIn(rankGroups(payload), fromRank, wRank) +
      pointsIn(rankGroups(next), fromRank, wRank);
    return global === next.totals[0] && perRank === next.totals[1];
  }

  function applyMetrics(next) {
    payload = merged(next);
    ensureMetricCharts();
    ensureRankCharts();
    ensureHardwareCharts();
    fitBuiltinCards();
    for (const canvasId of Object.keys(instances)) redraw(canvasId);
  }

  Kit.bind(controlsForm, () => instances, (next, what) => {
    controls = next;
    if (what === "x") for (const canvasId of Object.keys(zoomed)) delete zoomed[canvasId];
    for (const canvasId of Object.keys(instances)) redraw(canvasId, what);
  });

  let inFlight = false;
  async function refreshMetrics() {
    if (inFlight) return;
    inFlight = true;
    try {
      // Only what is new since the points this page has (jobs.comparison.training_job_chart_series).
      const query = new URLSearchParams({ after: payload.last_step, widths: payload.widths.join(","),
                                          attempt: payload.attempt });
      const options = { headers: { Accept: "application/json" }, credentials: "same-origin" };
      const response = await fetch(metricsUrl + "?" + query.toString(), options);
      if (!response.ok) return;
      let next = await response.json();
      if (!next.replace && !addsUp(next)) {
        // A point arrived at a step before the poll's from_step: read every line again.
        const whole = await fetch(metricsUrl, options);
        if (!whole.ok) return;
        next = await whole.json();
      }
      applyMetrics(next);
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
