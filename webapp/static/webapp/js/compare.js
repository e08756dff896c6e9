/* The comparison page: one chart per metric, every run overlaid in its own colour (the legend names
 * the run), drawn from the page's json_script block (#compare-data) under the chart controls
 * (chart_controls.js). A per-rank metric draws one line per rank of each run (dashed by rank), or
 * each run's median across ranks with a min–max band (its mean over ranks for runs stored before the
 * sync kept those); a run of more than 16 ranks always the median and band.
 */
(function () {
  "use strict";

  const Kit = window.TrainboardChartKit;
  const dataNode = document.getElementById("compare-data");
  if (!Kit || !dataNode || typeof Chart === "undefined") return;

  const data = JSON.parse(dataNode.textContent);
  const form = document.getElementById("chart-controls");
  const runColor = {};
  data.runs.forEach((run, i) => {
    runColor[run.id] = Kit.color(i);
  });
  document.querySelectorAll("#run-legend li[data-job-id]").forEach((item) => {
    const swatch = item.querySelector(".swatch");
    if (swatch) swatch.style.backgroundColor = runColor[item.dataset.jobId];
  });

  function runLabel(run) {
    return `#${run.id} ${run.name}`;
  }

  // The lines of one metric's chart under the controls.
  function lines(metric, controls) {
    const out = [];
    data.runs.forEach((run) => {
      const key = String(run.id);
      if (metric.per_rank) {
        const byRank = (data.rank_series[metric.name] || {})[key];
        const stats = ((data.rank_stats || {})[metric.name] || {})[key];
        if (stats && stats.median && (!byRank || !controls.perRank)) {
          out.push({ label: `${runLabel(run)} · median across ranks`, key: `${key}/median`, color: runColor[run.id],
                     points: Kit.acrossRanks(stats), t0: run.t0 });
          return;
        }
        if (!byRank) return;
        if (controls.perRank) {
          Object.keys(byRank).sort((a, b) => a - b).forEach((rank, i) => {
            out.push({ label: `${runLabel(run)} · rank ${rank}`, key: `${key}/${rank}`, color: runColor[run.id],
                       dash: Kit.RANK_DASHES[i % Kit.RANK_DASHES.length], points: byRank[rank], t0: run.t0 });
          });
        } else {
          out.push({ label: `${runLabel(run)} · mean over ranks`, key: `${key}/mean`, color: runColor[run.id],
                     points: Kit.meanOverRanks(byRank), t0: run.t0 });
        }
        return;
      }
      const points = (data.series[metric.name] || {})[key];
      if (!points) return;
      out.push({ label: runLabel(run), key: key, color: runColor[run.id], points: points, t0: run.t0,
                 radius: points.length <= 30 ? 3 : 0 });
    });
    return out;
  }

  function values(lineList) {
    return lineList.flatMap((line) => line.points.map((p) => p.y));
  }

  const charts = {};
  function draw(controls, what) {
    data.metrics.forEach((metric, i) => {
      const canvasId = "compare-chart-" + i;
      const lineList = lines(metric, controls);
      const scales = { x: Kit.xScale(controls.x), y: Kit.yScale(metric.name, metric.kind, values(lineList), controls) };
      const chart = charts[canvasId];
      if (!chart) {
        charts[canvasId] = new Chart(document.getElementById(canvasId), {
          type: "line",
          data: { datasets: Kit.datasets(lineList, controls) },
          options: {
            responsive: true,
            maintainAspectRatio: false,
            animation: false,
            interaction: { mode: "nearest", intersect: false },
            scales: scales,
            plugins: {
              legend: { position: "bottom", labels: { filter: Kit.legendFilter } },
              zoom: Kit.zoomOptions(),
            },
          },
        });
        return;
      }
      Kit.setDatasets(chart, Kit.datasets(lineList, controls));
      Kit.keepZoom(chart, scales.x, what);
      chart.options.scales.x = scales.x;
      chart.options.scales.y = scales.y;
      chart.update("none");
    });
  }

  draw(Kit.readControls(form));
  Kit.bind(form, () => charts, (controls, what) => draw(controls, what));
  window.trainboardCharts = charts; // for the browser tests and the console
})();
