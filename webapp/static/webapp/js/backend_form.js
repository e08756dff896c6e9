/* The backend form: show only the settings of the chosen kind. Without JavaScript every kind's
 * fieldset shows and the server reads only the chosen kind's fields. */
(function () {
  "use strict";
  const kind = document.getElementById("id_kind");
  if (!kind) return;
  function show() {
    document.querySelectorAll("fieldset.kind-settings").forEach(function (fieldset) {
      fieldset.hidden = fieldset.dataset.kind !== kind.value;
    });
  }
  kind.addEventListener("change", show);
  show();
})();
