/* The model form: show the selected architecture's parameter docs; "Fill in the defaults" writes
 * that architecture's defaults into the JSON textarea. */
(function () {
  "use strict";
  const select = document.getElementById("id_architecture");
  const params = document.getElementById("id_params");
  const dataNode = document.getElementById("architectures-data");
  if (!select || !params || !dataNode) return;
  const archs = JSON.parse(dataNode.textContent);

  function show() {
    document.querySelectorAll(".arch-docs .arch").forEach(function (section) {
      section.hidden = section.dataset.arch !== select.value;
    });
  }
  select.addEventListener("change", show);
  document.getElementById("fill-defaults").addEventListener("click", function () {
    const arch = archs.find(function (a) { return a.name === select.value; });
    if (arch) params.value = JSON.stringify(arch.defaults, null, 2);
  });
  show();
})();
