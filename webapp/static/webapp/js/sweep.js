/* The sweep page: a parallel-coordinates plot (one line per complete or pruned trial across one
 * axis per parameter and the objective, each scaled 0..1 by the server) and a parameter-importance
 * bar chart, both drawn with Chart.js from the JSON block #sweep-chart-data (no inline script: the
 * content security policy allows none). Cancel asks first (data-confirm).
 */
(function () {
  "use strict";

  document.addEventListener("submit", function (event) {
    const message = event.target.dataset && event.target.dataset.confirm;
    if (message && !window.confirm(message)) event.preventDefault();
  });

  const dataNode = document.getElementById("sweep-chart-data");
  if (!dataNode || typeof Chart === "undefined") return;
  const data = JSON.parse(dataNode.textContent);
  const COLORS = { COMPLETE: "#2563eb", PRUNED: "#9ca3af" };

  const parallel = document.getElementById("chart-parallel");
  if (parallel) {
    const axes = data.parallel.axes;
    const ticks = data.parallel.ticks;
    new Chart(parallel, {
      type: "line",
      data: {
        labels: axes,
        datasets: data.parallel.lines.map(function (line) {
          return {
            label: "trial " + line.trial + (line.state === "PRUNED" ? " (pruned)" : ""),
            data: line.points,
            borderColor: COLORS[line.state] || "#f59e0b",
            backgroundColor: COLORS[line.state] || "#f59e0b",
            borderDash: line.state === "PRUNED" ? [4, 3] : [],
            spanGaps: false,
            tension: 0,
          };
        }),
      },
      options: {
        animation: false,
        maintainAspectRatio: false,
        plugins: {
          legend: { display: data.parallel.lines.length <= 12 },
          tooltip: {
            callbacks: {
              // The value on an axis, in its own units: its tick at a categorical's position, or the
              // scaled fraction's place between the axis' low and high.
              label: function (ctx) {
                const axis = ticks[ctx.dataIndex];
                const y = ctx.parsed.y;
                if (axis.length > 2 || isNaN(Number(axis[0]))) {
                  const i = Math.round(y * (axis.length - 1));
                  return ctx.dataset.label + ": " + axis[i];
                }
                return ctx.dataset.label + ": " + (y * 100).toFixed(0) + "% of " + axis[0] + " … " + axis[1];
              },
            },
          },
        },
        scales: {
          y: { min: 0, max: 1, ticks: { callback: function (v) { return v === 0 ? "low" : v === 1 ? "high" : ""; } } },
          x: { ticks: { callback: function (v, i) { return [axes[i], ticks[i].join(" · ")]; } } },
        },
      },
    });
  }

  const importance = document.getElementById("chart-importance");
  if (importance && data.importance.length) {
    new Chart(importance, {
      type: "bar",
      data: {
        labels: data.importance.map(function (r) { return r.name; }),
        datasets: [{ label: "importance", data: data.importance.map(function (r) { return r.value; }),
                     backgroundColor: "#2563eb" }],
      },
      options: { animation: false, maintainAspectRatio: false, indexAxis: "y",
                 plugins: { legend: { display: false } }, scales: { x: { min: 0, max: 1 } } },
    });
  }
})();
