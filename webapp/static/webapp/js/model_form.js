/* The model form: show the selected architecture's parameter docs; "Fill in the defaults" writes
 * that architecture's defaults into the JSON textarea.
 *
 * The parameters follow the architecture unless the user edited them: one architecture's
 * parameters are unknown to another ("channels: unknown parameter for mlp"), so when the textarea
 * still holds what the page or this script put there, choosing another architecture replaces it
 * with that architecture's defaults (or, back on an architecture shown before, with what it held
 * then: an edit page's saved parameters come back). Text the user typed is never replaced.
 *
 * The kind (built-in, my model, my script) shows only its own fields; the server reads only the
 * chosen kind's fields too, so what a hidden section holds does not matter. */
(function () {
  "use strict";
  const kinds = document.querySelectorAll('input[name="kind"]');
  function showKind() {
    const checked = document.querySelector('input[name="kind"]:checked');
    const kind = checked ? checked.value : "builtin";
    document.querySelectorAll(".kind-section").forEach(function (section) {
      section.hidden = section.dataset.kinds.split(" ").indexOf(kind) < 0;
    });
    const docs = document.querySelector(".arch-docs");
    if (docs) docs.hidden = kind !== "builtin";
  }
  kinds.forEach(function (input) { input.addEventListener("change", showKind); });
  showKind();
})();
(function () {
  "use strict";
  const select = document.getElementById("id_architecture");
  const params = document.getElementById("id_params");
  const dataNode = document.getElementById("architectures-data");
  if (!select || !params || !dataNode) return;
  const archs = JSON.parse(dataNode.textContent);
  const shown = {};  // architecture -> the parameters text it had when the user left it
  // The text not typed by the user: the page's (unless it shows back what they submitted), then ours.
  let written = params.dataset.edited === "true" ? null : params.value;
  let current = select.value;

  function defaultsText(name) {
    const arch = archs.find(function (a) { return a.name === name; });
    return arch ? JSON.stringify(arch.defaults, null, 2) : "";
  }

  function write(text) {
    params.value = text;
    written = text;
  }

  function show() {
    document.querySelectorAll(".arch-docs .arch").forEach(function (section) {
      section.hidden = section.dataset.arch !== select.value;
    });
  }

  select.addEventListener("change", function () {
    if (params.value === written) {
      shown[current] = params.value;
      write(Object.prototype.hasOwnProperty.call(shown, select.value) ? shown[select.value]
                                                                        : defaultsText(select.value));
    }
    current = select.value;
    show();
  });
  document.getElementById("fill-defaults").addEventListener("click", function () {
    write(defaultsText(select.value));
  });
  show();
})();
