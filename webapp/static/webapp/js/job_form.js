/* The job form: show the instance types (and the spot checkbox) of the chosen backend only.
 * Without JavaScript every backend's group shows and the server refuses another backend's type. */
(function () {
  "use strict";
  const backend = document.getElementById("id_backend");
  const dataNode = document.getElementById("backend-offers");
  if (!backend || !dataNode) return;
  const backends = JSON.parse(dataNode.textContent);
  const instance = document.getElementById("id_instance_type");
  const spot = document.getElementById("id_spot");

  function show() {
    const chosen = backends[backend.value] || {name: "", offers: false, spot: false};
    if (instance && instance.tagName === "SELECT") {
      instance.querySelectorAll("optgroup").forEach(function (group) {
        group.hidden = group.label !== chosen.name;
        group.disabled = group.hidden;
      });
      const selected = instance.options[instance.selectedIndex];
      if (selected && selected.parentElement.tagName === "OPTGROUP" && selected.parentElement.hidden) {
        instance.value = "";
      }
      const field = document.getElementById("field-instance_type");
      if (field) field.hidden = !chosen.offers;
    }
    if (spot) {
      const field = document.getElementById("field-spot");
      if (field) field.hidden = !chosen.spot;
      if (!chosen.spot) spot.checked = false;
    }
  }
  backend.addEventListener("change", show);
  show();
})();
