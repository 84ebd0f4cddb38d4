// Static behaviour only.
//
// 1. Clicks on tree rows and findings. Elements carry data-action ("toggle", "select",
//    "open") and data-mid (a module id); one delegated listener writes the click into the
//    "ui-click" store, whose server callback updates the selection / expanded nodes / URL.
//    (One pattern-matching callback input per row made large trees slow to render.)
// 2. Opening a finding's "evidence" must not also open its module.
document.addEventListener("click", function (e) {
  var t = e.target;
  if (!t || !t.closest) { return; }
  if (t.closest("details")) { return; }
  var el = t.closest("[data-action]");
  if (!el || !window.dash_clientside || !window.dash_clientside.set_props) { return; }
  window.dash_clientside.set_props("ui-click", {data: {
    action: el.getAttribute("data-action"),
    id: el.getAttribute("data-mid"),
    t: Date.now()
  }});
});
