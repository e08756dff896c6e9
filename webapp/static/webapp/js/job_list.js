// The job list's selection (docs/experiments.md): the "Compare selected" link carries the checked
// jobs' ids, comma-separated (/jobs/compare/?ids=3,7), and "select all" checks the page's rows.
(function () {
  "use strict";
  var form = document.getElementById("job-select-form");
  var link = document.getElementById("compare-selected");
  if (!form || !link) { return; }
  var boxes = function () { return Array.prototype.slice.call(form.querySelectorAll("input.job-select")); };

  function update() {
    var ids = boxes().filter(function (b) { return b.checked; }).map(function (b) { return b.value; });
    link.setAttribute("href", link.dataset.base + "?ids=" + ids.join(","));
    link.setAttribute("aria-disabled", ids.length < 2 ? "true" : "false");
    link.textContent = ids.length ? "Compare selected (" + ids.length + ")" : "Compare selected";
  }

  form.addEventListener("change", function (event) {
    if (event.target.id === "select-all") {
      boxes().forEach(function (b) { b.checked = event.target.checked; });
    }
    update();
  });
  update();
}());
