// Static behaviour only.
//
// 1. Clicks on tree rows and findings. Elements carry data-action ("toggle", "select",
//    "open") and data-mid (a module id); one delegated listener writes the click into the
//    "ui-click" store, whose server callback updates the selection / expanded nodes / URL.
//    (One pattern-matching callback input per row made large trees slow to render.)
// 2. Opening a finding's "evidence" (or its folded consequences) must not also open its module;
//    a consequence card inside the folded list opens its own module (what stays open: 3.).
// Keyboard: Enter or Space on a focused clickable element acts like a click.
document.addEventListener("keydown", function (e) {
  if ((e.key === "Enter" || e.key === " ") && e.target && e.target.getAttribute &&
      e.target.getAttribute("data-action")) {
    e.preventDefault();
    e.target.click();
  }
});
document.addEventListener("click", function (e) {
  var t = e.target;
  if (!t || !t.closest) { return; }
  var el = t.closest("[data-action]");
  if (!el || !window.dash_clientside || !window.dash_clientside.set_props) { return; }
  // a <details> inside the clicked element (evidence, the consequences' toggle) only opens and closes
  var d = t.closest("details");
  if (t.closest("summary") || (d && el.contains(d))) { return; }
  window.dash_clientside.set_props("ui-click", {data: {
    action: el.getAttribute("data-action"),
    id: el.getAttribute("data-mid"),
    t: Date.now()
  }});
});

// 3. What the user opened (a finding's evidence, its folded consequences: on the Findings page, in a
//    module's detail) stays open when it is drawn again (every poll while a run trains). Such a
//    <details> carries data-open-key; its container names the page's store (data-toggle-store:
//    "findings-toggle", "detail-toggle"; dashboard/ids.py toggle_attrs). After any toggle in the
//    container, the keys of all its open <details> go to that store, whole: the page draws exactly
//    those open. The whole set, not the one change: toggles faster than the server answers must not
//    be lost (a change applied to the server's last known set would drop an earlier one still on its
//    way). A <details> drawn open fires "toggle" too: a set equal to the last one sent is not sent.
document.addEventListener("toggle", function (e) {
  var d = e.target;
  var key = d && d.getAttribute ? d.getAttribute("data-open-key") : null;
  var box = key && d.parentElement ? d.parentElement.closest("[data-toggle-store]") : null;
  var store = box ? box.getAttribute("data-toggle-store") : null;
  if (!store || !window.dash_clientside || !window.dash_clientside.set_props) { return; }
  var keys = [];
  box.querySelectorAll("details[data-open-key]").forEach(function (x) {
    if (x.open) { keys.push(x.getAttribute("data-open-key")); }
  });
  var sent = JSON.stringify(keys);
  if (sent === (box._modscopeSent !== undefined ? box._modscopeSent : box.getAttribute("data-open-keys"))) {
    return;
  }
  box._modscopeSent = sent;
  window.dash_clientside.set_props(store, {data: {keys: keys, t: Date.now()}});
}, true);

// 4. The module tree. The server sends plain row data (dashboard/pages/modules.py tree_row);
//    this draws it. Every string goes through textContent / setAttribute, never innerHTML.
(function () {
  function span(cls, text, attrs) {
    var el = document.createElement("span");
    if (cls) { el.className = cls; }
    if (text) { el.textContent = text; }
    if (attrs) { for (var k in attrs) { if (attrs[k] !== undefined && attrs[k] !== null) { el.setAttribute(k, attrs[k]); } } }
    return el;
  }
  function row(r) {
    var div = document.createElement("div");
    div.className = "tree-row kind-" + r.kind + (r.selected ? " selected" : "");
    div.setAttribute("data-path", r.path);
    div.setAttribute("data-kind", r.kind);
    div.setAttribute("data-mid", String(r.id));
    div.style.paddingLeft = r.indent + "rem";
    if (r.toggle) {
      div.appendChild(span("tree-toggle", r.toggle, {"data-action": "toggle", "data-mid": String(r.id),
        "title": r.toggle === "▾" ? "collapse" : "expand", "role": "button", "tabindex": "0",
        "aria-expanded": r.toggle === "▾" ? "true" : "false"}));
    } else {
      div.appendChild(span("tree-toggle-space"));
    }
    div.appendChild(span("tree-label mono", r.label, {"data-action": "select", "data-mid": String(r.id),
      "title": r.path || "<root>", "role": "button", "tabindex": "0"}));
    if (r.type) { div.appendChild(span("tree-type", r.type)); }
    if (r.kind !== "registered") { div.appendChild(span("badge kind-" + r.kind, r.kind, {"title": r.kind_title})); }
    (r.badges || []).forEach(function (b) {
      div.appendChild(span("badge sev-" + b.sev, b.label, {"title": b.code + " (" + b.sev + ")"}));
    });
    if (r.inside) { div.appendChild(span("inside sev-" + r.inside.sev, r.inside.text)); }
    div.appendChild(span("tree-params", r.params,
      {"title": "parameters in the subtree: total · trainable · held by the optimizer"}));
    return div;
  }
  function highlight(box, selected) {
    var mid = selected && selected.module_id !== undefined && selected.module_id !== null
      ? String(selected.module_id) : null;
    box.querySelectorAll(".tree-row").forEach(function (el) {
      el.classList.toggle("selected", mid !== null && el.getAttribute("data-mid") === mid);
    });
  }
  function refocus(box, keep) {
    var target = null;
    box.querySelectorAll(".tree-row").forEach(function (el) {
      if (target || el.getAttribute("data-mid") !== keep.mid) { return; }
      var els = el.querySelectorAll("[data-action]");
      for (var i = 0; i < els.length && !target; i++) {
        if (els[i].getAttribute("data-action") === keep.action) { target = els[i]; }
      }
      if (!target) { target = el.querySelector(".tree-label"); }
    });
    if (target) { target.focus({preventScroll: true}); }
  }
  window.dash_clientside = window.dash_clientside || {};
  window.dash_clientside.modscope = Object.assign({}, window.dash_clientside.modscope, {
    renderTree: function (data, selected) {
      var box = document.getElementById("tree");
      if (!box || !data) { return window.dash_clientside.no_update; }
      // the element focused in the tree (a toggle just pressed with Enter) is destroyed by the redraw:
      // focus the same node's element again (same data-mid and data-action; its label when the
      // toggle is gone), else the keyboard user is thrown back to <body> (and the next Tab to the root)
      var act = document.activeElement;
      var focused = act && box.contains(act) && act.closest ? act.closest(".tree-row") : null;
      var keep = focused ? {mid: focused.getAttribute("data-mid"), action: act.getAttribute("data-action")} : null;
      var frag = document.createDocumentFragment();
      (data.rows || []).forEach(function (r) { frag.appendChild(row(r)); });
      if (data.message) { frag.appendChild(span("message muted", data.message)); }
      box.replaceChildren(frag);
      highlight(box, selected);
      if (keep) { refocus(box, keep); }
      return window.dash_clientside.no_update;
    },
    // The selection a click makes (dashboard/pages/modules.py handle_click does the rest: the
    // ancestors to expand, the page): {run, rank, module_id} of the view the tick shows; a tick
    // that shows another run or rank (a switch, or a new run followed) clears it.
    selectFromClick: function (click, tick, selected) {
      var ctx = window.dash_clientside.callback_context;
      var trig = ctx && ctx.triggered && ctx.triggered.length ? ctx.triggered[0].prop_id : "";
      var run = (tick && tick.run) || "";
      var r = (tick && tick.rank) || 0;
      if (trig === "tick.data") {
        if (selected && (selected.run !== run || selected.rank !== r)) { return null; }
        return window.dash_clientside.no_update;
      }
      if (!click || (click.action !== "select" && click.action !== "open")) {
        return window.dash_clientside.no_update;
      }
      var mid = Number(click.id);
      if (!Number.isInteger(mid) || mid < 0) { return window.dash_clientside.no_update; }
      if (selected && selected.module_id === mid && selected.rank === r && selected.run === run) {
        return window.dash_clientside.no_update;
      }
      return {run: run, rank: r, module_id: mid};
    },
    highlightSelected: function (selected) {
      var box = document.getElementById("tree");
      if (box) { highlight(box, selected); }
      return window.dash_clientside.no_update;
    }
  });
})();
