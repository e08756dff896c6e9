/* The chart controls shared by the job page (job.js) and the comparison page (compare.js): what the x
 * axis counts (step, seconds since the run's first point, wall time), a log y axis, zoom and pan
 * (chartjs-plugin-zoom), smoothing (an exponential moving average, the raw line kept faint), one line
 * per rank or their mean for the per-rank metrics, and an accuracy axis fitted to the data.
 *
 * A page describes each chart as lines ({label, color, points, t0, dash, radius}); each point is
 * {x: step, y: value or null (not finite), t: unix seconds}. TrainboardChartKit.datasets(lines,
 * controls) turns them into Chart.js datasets for the controls' current state, and scales(...) the
 * axes; the page calls them again when the controls change (bind) or new points arrive.
 * Loaded after Chart.js, hammerjs, chartjs-plugin-zoom (which registers itself) and the date-fns
 * adapter of the time axis.
 */
(function () {
  "use strict";

  // Distinct colours, one per run (a comparison has at most 20) or per rank.
  const PALETTE = ["#2563eb", "#f59e0b", "#16a34a", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
    "#ea580c", "#4f46e5", "#0d9488", "#a16207", "#9333ea", "#be123c", "#15803d", "#1d4ed8", "#b45309",
    "#6d28d9", "#0e7490", "#4d7c0f"];
  const RANK_DASHES = [[], [6, 3], [2, 2], [8, 3, 2, 3], [1, 3]];
  const DEFAULTS = { x: "step", log: false, smoothing: 0, perRank: true };
  const X_TITLES = { step: "step", relative: "seconds since the run's first point", wall: "wall time" };

  function color(i) {
    return PALETTE[i % PALETTE.length];
  }

  // "#2563eb" -> "rgba(37, 99, 235, 0.25)": the raw line behind a smoothed one.
  function faint(hex, alpha) {
    const n = parseInt(hex.slice(1), 16);
    return `rgba(${(n >> 16) & 255}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
  }

  function xOf(point, mode, t0) {
    if (mode === "relative") return point.t - t0;
    if (mode === "wall") return point.t * 1000; // the time scale counts milliseconds
    return point.x;
  }

  // The points as the x axis counts them; a log axis has no place for 0 or less: those become gaps.
  function positioned(points, mode, t0, log) {
    return points.map((p) => ({ x: xOf(p, mode, t0), y: p.y === null || (log && p.y <= 0) ? null : p.y }));
  }

  // Exponential moving average with TensorBoard's debiasing (so the start is not pulled towards 0):
  // s_n = w·s_(n-1) + (1−w)·y_n, shown as s_n / (1 − w^n). A gap (null) stays a gap; the average
  // goes on from the last finite value.
  function ema(points, weight) {
    if (!(weight > 0)) return points.slice();
    let last = 0;
    let n = 0;
    return points.map((p) => {
      if (p.y === null) return { x: p.x, y: null };
      last = last * weight + (1 - weight) * p.y;
      n += 1;
      return { x: p.x, y: last / (1 - Math.pow(weight, n)) };
    });
  }

  // The mean over ranks at each step, for a per-rank metric drawn as one line.
  function meanOverRanks(byRank) {
    const steps = new Map();
    for (const points of Object.values(byRank)) {
      for (const p of points) {
        const s = steps.get(p.x) || { x: p.x, t: p.t, sum: 0, n: 0, missing: false };
        if (p.y === null) s.missing = true;
        else { s.sum += p.y; s.n += 1; }
        s.t = Math.min(s.t, p.t);
        steps.set(p.x, s);
      }
    }
    return [...steps.values()].sort((a, b) => a.x - b.x)
      .map((s) => ({ x: s.x, t: s.t, y: s.n && !s.missing ? s.sum / s.n : null }));
  }

  // A per-rank metric across its ranks ({min, median, max} lines from the server, stored by the sync
  // step by step): the median's points, each with a band from the lowest rank's value to the
  // highest's (over a bucket, the min of the per-step minimum and the max of the per-step maximum),
  // which band() draws behind the line: one slow rank among 512 is the band's edge.
  function acrossRanks(stats) {
    const lowest = new Map((stats.min || []).map((p) => [p.x, p]));
    const highest = new Map((stats.max || []).map((p) => [p.x, p]));
    const edge = (p, key) => (p ? (p[key] !== undefined ? p[key] : p.y) : null);
    return (stats.median || []).map((p) => {
      const lo = edge(lowest.get(p.x), "min");
      const hi = edge(highest.get(p.x), "max");
      return lo === null || hi === null ? p : Object.assign({}, p, { min: lo, max: hi });
    });
  }

  // The y range of an accuracy axis: the data's min and max with a 5% margin (at least 0.01),
  // kept inside [0, 1]; all of [0, 1] without data.
  function fittedRange(values) {
    const finite = values.filter((v) => v !== null && Number.isFinite(v));
    if (!finite.length) return { min: 0, max: 1 };
    const lo = Math.min(...finite);
    const hi = Math.max(...finite);
    const margin = Math.max((hi - lo) * 0.05, 0.01);
    return { min: Math.max(0, lo - margin), max: Math.min(1, hi + margin) };
  }

  function readControls(form) {
    if (!form) return Object.assign({}, DEFAULTS);
    const smoothing = Math.min(0.99, Math.max(0, parseFloat(form.elements.smoothing.value) || 0));
    return {
      x: form.elements.x.value,
      log: form.elements.log.checked,
      smoothing: smoothing,
      perRank: form.elements.per_rank.checked,
    };
  }

  // A long run's line arrives as buckets (jobs/metric_buckets.py): each point is its bucket's last
  // value with the bucket's min and max. The band between them, faint behind the line, keeps a spike
  // in view that the line's last values would miss. Two datasets, the upper filled down to the lower.
  function band(line, controls) {
    const points = (line.points || []).filter((p) => p.min !== undefined && p.min !== null);
    if (points.length === 0) return [];
    const edge = (key) => positioned(points.map((p) => ({ x: p.x, t: p.t, y: p[key] })), controls.x,
                                     line.t0 || 0, controls.log);
    const style = { borderWidth: 0, pointRadius: 0, spanGaps: false, backgroundColor: faint(line.color, 0.15),
                    borderColor: faint(line.color, 0) };
    return [
      Object.assign({ label: line.label + " (max)", data: edge("max"), fill: "+1", _tb: "band",
                      _key: (line.key || line.label) + " (max)" }, style),
      Object.assign({ label: line.label + " (min)", data: edge("min"), fill: false, _tb: "band",
                      _key: (line.key || line.label) + " (min)" }, style),
    ];
  }

  // Chart.js datasets for lines under the controls: each line's (smoothed) data, and with smoothing
  // its raw data faint behind it, and a bucketed line's min–max band (both left out of the legend).
  // `_tb` says which a dataset is.
  function datasets(lines, controls) {
    const out = [];
    const raws = [];
    for (const line of lines) {
      raws.push(...band(line, controls));
      const raw = positioned(line.points || [], controls.x, line.t0 || 0, controls.log);
      const smoothed = ema(raw, controls.smoothing);
      out.push({
        label: line.label,
        data: smoothed,
        borderColor: line.color,
        backgroundColor: line.color,
        borderWidth: 2,
        borderDash: line.dash || [],
        pointRadius: controls.smoothing > 0 ? 0 : (line.radius || 0),
        // Monotone cubic interpolation (Fritsch–Carlson): each segment stays between the two
        // measured points it joins, so the line never dips below a minimum it did not measure.
        cubicInterpolationMode: "monotone",
        spanGaps: false,
        _tb: "line",
        _key: line.key || line.label,
      });
      if (controls.smoothing > 0) {
        raws.push({
          label: line.label + " (raw)",
          data: raw,
          borderColor: faint(line.color, 0.25),
          backgroundColor: faint(line.color, 0.25),
          borderWidth: 1,
          borderDash: line.dash || [],
          pointRadius: 0,
          spanGaps: false,
          _tb: "raw",
          _key: (line.key || line.label) + " (raw)",
        });
      }
    }
    return out.concat(raws);
  }

  function xScale(mode) {
    const title = { display: true, text: X_TITLES[mode] || X_TITLES.step };
    if (mode === "wall") {
      return { type: "time", title: title, time: { tooltipFormat: "yyyy-MM-dd HH:mm:ss" } };
    }
    return { type: "linear", title: title, ticks: mode === "step" ? { precision: 0 } : {} };
  }

  // The y axis: `kind` "accuracy" is fitted to `values` (fittedRange), "loss" starts at zero
  // (on a linear axis), a log axis is logarithmic.
  function yScale(title, kind, values, controls) {
    const scale = { type: controls.log ? "logarithmic" : "linear", title: { display: true, text: title } };
    if (kind === "accuracy") {
      const range = fittedRange(values);
      if (!controls.log || range.min > 0) scale.min = range.min;
      scale.max = range.max;
    } else if (kind === "loss" && !controls.log) {
      scale.beginAtZero = true;
    }
    return scale;
  }

  // Zoom on the x axis with the wheel or a pinch, pan by dragging; "Reset zoom" goes back.
  function zoomOptions() {
    return {
      zoom: { wheel: { enabled: true }, pinch: { enabled: true }, mode: "x" },
      pan: { enabled: true, mode: "x" },
    };
  }

  // Replace a chart's datasets, keeping which lines the user hid through the legend.
  function setDatasets(chart, next) {
    const hidden = new Set();
    chart.data.datasets.forEach((d, i) => {
      if (!chart.isDatasetVisible(i)) hidden.add(d._key || d.label);
    });
    next.forEach((d) => {
      if (hidden.has(d._key || d.label)) d.hidden = true;
    });
    chart.data.datasets = next;
  }

  // A control other than the x axis keeps the zoomed x range (the zoom plugin keeps it in the
  // x scale's min and max options, which a new x scale would drop).
  function keepZoom(chart, nextX, what) {
    const current = chart.options.scales && chart.options.scales.x;
    if (what === "x" || !current) return;
    if (current.min !== undefined) nextX.min = current.min;
    if (current.max !== undefined) nextX.max = current.max;
  }

  // The legend leaves out the faint raw lines and bands (they share their line's colour and name).
  function legendFilter(item, data) {
    const d = data.datasets[item.datasetIndex];
    return !d || (d._tb !== "raw" && d._tb !== "band");
  }

  // Calls onChange(controls, what) when a control changes; what is "x" when the x axis changed
  // (a page resets zoom then: the old range means nothing on the new axis).
  function bind(form, charts, onChange) {
    if (!form) return;
    const shown = form.querySelector("#chart-smoothing-value");
    form.addEventListener("submit", (event) => event.preventDefault());
    form.addEventListener("input", (event) => {
      if (shown) shown.textContent = readControls(form).smoothing.toFixed(2);
      if (event.target.name === "x") {
        Object.values(charts()).forEach((chart) => chart.resetZoom && chart.resetZoom("none"));
      }
      onChange(readControls(form), event.target.name);
    });
    const reset = form.querySelector("#chart-reset-zoom");
    if (reset) {
      reset.addEventListener("click", () => {
        Object.values(charts()).forEach((chart) => chart.resetZoom && chart.resetZoom());
      });
    }
  }

  window.TrainboardChartKit = {
    PALETTE: PALETTE,
    RANK_DASHES: RANK_DASHES,
    DEFAULTS: DEFAULTS,
    color: color,
    ema: ema,
    meanOverRanks: meanOverRanks,
    acrossRanks: acrossRanks,
    fittedRange: fittedRange,
    positioned: positioned,
    xOf: xOf,
    readControls: readControls,
    datasets: datasets,
    xScale: xScale,
    yScale: yScale,
    zoomOptions: zoomOptions,
    setDatasets: setDatasets,
    keepZoom: keepZoom,
    legendFilter: legendFilter,
    bind: bind,
  };
})();
