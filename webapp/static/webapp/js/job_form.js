/* The job form: show the instance types (and the spot checkbox) of the chosen backend only, offer
 * only the strategies its image runs (the others are disabled, with the reason in the estimate), and
 * say beside the nodes field when the backend runs a job on one machine.
 * Without JavaScript every backend's group shows and the server refuses another backend's type. */
(function () {
  "use strict";
  const backend = document.getElementById("id_backend");
  const dataNode = document.getElementById("backend-offers");
  if (!backend || !dataNode) return;
  const backends = JSON.parse(dataNode.textContent);
  const instance = document.getElementById("id_instance_type");
  const spot = document.getElementById("id_spot");
  const strategy = document.getElementById("id_strategy");
  const nodes = document.getElementById("id_nodes");
  const nodesField = document.getElementById("field-nodes");
  let nodesNote = null;
  if (nodes && nodesField) {
    nodesNote = document.createElement("p");
    nodesNote.id = "nodes-note";
    nodesNote.className = "note";
    nodesNote.hidden = true;
    nodesField.appendChild(nodesNote);
  }

  /* A backend with a node limit of its own (a GPU box runs a job on one machine) says so beside the
   * nodes field, as a warning once more nodes are asked for; the server refuses them with the same words. */
  function showNodesNote() {
    if (!nodesNote) return;
    const chosen = backends[backend.value] || {};
    const asked = parseInt(nodes.value, 10);
    nodesNote.textContent = chosen.nodes_note || "";
    nodesNote.hidden = !chosen.nodes_note;
    nodesNote.classList.toggle("error", Boolean(chosen.nodes_note) && asked > (chosen.max_nodes || Infinity));
  }

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
    if (strategy && strategy.tagName === "SELECT" && Array.isArray(chosen.strategies)) {
      Array.prototype.forEach.call(strategy.options, function (option) {
        option.disabled = chosen.strategies.indexOf(option.value) < 0;
      });
      const current = strategy.options[strategy.selectedIndex];
      if (current && current.disabled && chosen.strategies.length) {
        strategy.value = chosen.strategies[0];
        strategy.dispatchEvent(new Event("change", {bubbles: true}));
      }
    }
  }
  backend.addEventListener("change", show);
  backend.addEventListener("change", showNodesNote);
  if (nodes) nodes.addEventListener("input", showNodesNote);
  show();
  showNodesNote();
})();
