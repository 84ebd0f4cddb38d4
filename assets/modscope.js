// Static behaviour only.
//
// 1. Clicks on tree rows and findings. Elements carry data-action ("toggle", "select",
//    "open") and data-mid (a module id); one delegated listener writes the click into the
//    "ui-click" store, whose server callback updates the selection / expanded nodes / URL.
//    (One pattern-matching callback input per row made large trees slow to render.)
//    A finding's action has a control of its own: a native <button> (its path on a card, the whole
//    row of a top finding; dashboard/ids.py button_attrs), which the browser makes focusable and
//    clicks on Enter or Space. The card around it carries the action for the mouse only (a click
//    anywhere on it): it is no control (no role, no tab stop), since it holds toggles of its own.
// 2. Opening a finding's "evidence" (or its folded consequences) must not also open its module;
//    a consequence card inside the folded list opens its own module (what stays open: 3.).
// Keyboard: Enter or Space on a focused clickable element that is not a native control (the tree's
// toggles and names, role="button") acts like a click.
document.addEventListener("keydown", function (e) {
  var t = e.target;
  if ((e.key === "Enter" || e.key === " ") && t && t.getAttribute && t.getAttribute("data-action") &&
      t.tagName !== "BUTTON" && t.tagName !== "A") {
    e.preventDefault();
    t.click();
  }
});
document.addEventListener("click", function (e) {
  var t = e.target;
  if (!t || !t.closest) { return; }
  var el = t.closest("[data-action]");
  // a tree row is selected by a click anywhere on it (its type, badges, parameter count, the space
  // between them: the row is highlighted under the pointer), not only on its name
  var treeRow = !el && t.closest(".tree-row");
  if (treeRow) { el = treeRow.querySelector(".tree-label[data-action]"); }
  if (!el || !window.dash_clientside || !window.dash_clientside.set_props) { return; }
  // a <details> inside the clicked element (evidence, the consequences' toggle) only opens and closes
  var d = t.closest("details");
  if (t.closest("summary") || (d && el.contains(d))) { return; }
  // a finding opened from the keyboard (Enter or Space on its button: a click of detail 0) takes the focus to its
  // module's row in the tree once it is drawn (section 4), not to <body> (the next Tab would start the page over)
  if (el.getAttribute("data-action") === "open" && e.detail === 0) {
    window._modscopeFocusOpened = {mid: el.getAttribute("data-mid"), until: Date.now() + 10000};
  }
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
//    The Findings page's store lives in the tab's sessionStorage (dcc.Store storage_type="session"):
//    the page built again after another page starts from it (dashboard/pages/findings.py).
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
//    It is an ARIA tree (WAI-ARIA Authoring Practices, "Tree View"): the box is role="tree", each row a
//    role="treeitem" (aria-level, aria-expanded when it has children, aria-selected). One row is in the
//    tab order (roving tabindex: the row last focused, else the selected one, else the first); the
//    toggle and the name inside a row stay focusable (click, script) but out of the Tab order.
//    Keys on a row: ArrowDown / ArrowUp the next / previous row; ArrowRight expands a collapsed node,
//    or goes to its first child; ArrowLeft collapses an expanded node, or goes to its parent; Home /
//    End the first / last row; Enter / Space select the row (a click on its name). Expanding and
//    collapsing click the row's toggle (the same "ui-click" as the mouse), and the redraw puts the
//    focus back on the same row (refocus).
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
    div.setAttribute("role", "treeitem");
    div.setAttribute("aria-level", String(Number(r.level) || 1));
    div.setAttribute("aria-selected", r.selected ? "true" : "false");
    div.setAttribute("tabindex", "-1");
    if (r.toggle) { div.setAttribute("aria-expanded", r.toggle === "▾" ? "true" : "false"); }
    div.style.paddingLeft = r.indent + "rem";
    if (r.toggle) {
      div.appendChild(span("tree-toggle", r.toggle, {"data-action": "toggle", "data-mid": String(r.id),
        "title": r.toggle === "▾" ? "collapse" : "expand", "role": "button", "tabindex": "-1",
        "aria-expanded": r.toggle === "▾" ? "true" : "false"}));
    } else {
      div.appendChild(span("tree-toggle-space"));
    }
    div.appendChild(span("tree-label mono", r.label, {"data-action": "select", "data-mid": String(r.id),
      "title": r.path || "<root>", "role": "button", "tabindex": "-1"}));
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
    var opened = null;
    box.querySelectorAll(".tree-row").forEach(function (el) {
      var on = mid !== null && el.getAttribute("data-mid") === mid;
      el.classList.toggle("selected", on);
      el.setAttribute("aria-selected", on ? "true" : "false");
      if (on) { opened = el; }
    });
    roving(box);
    // the module of a finding opened from the keyboard (section 1): its row takes the focus when drawn selected
    var want = window._modscopeFocusOpened;
    if (want && Date.now() > want.until) { want = window._modscopeFocusOpened = null; }
    if (want && opened && opened.getAttribute("data-mid") === want.mid) {
      window._modscopeFocusOpened = null;
      opened.focus({preventScroll: true});
      opened.scrollIntoView({block: "nearest"});
    }
  }
  // the one row with tabindex 0: the row focused last (box._modscopeFocus, while it is drawn),
  // else the selected row, else the first
  function roving(box) {
    var rows = box.querySelectorAll(".tree-row");
    var pick = null;
    for (var i = 0; i < rows.length && !pick; i++) {
      if (box._modscopeFocus !== undefined && rows[i].getAttribute("data-mid") === box._modscopeFocus) {
        pick = rows[i];
      }
    }
    if (!pick) { pick = box.querySelector(".tree-row.selected") || rows[0] || null; }
    rows.forEach(function (el) { el.setAttribute("tabindex", el === pick ? "0" : "-1"); });
  }
  function refocus(box, keep) {
    var target = null;
    box.querySelectorAll(".tree-row").forEach(function (el) {
      if (target || el.getAttribute("data-mid") !== keep.mid) { return; }
      if (keep.row) { target = el; return; }
      var els = el.querySelectorAll("[data-action]");
      for (var i = 0; i < els.length && !target; i++) {
        if (els[i].getAttribute("data-action") === keep.action) { target = els[i]; }
      }
      if (!target) { target = el.querySelector(".tree-label"); }
    });
    if (target) { target.focus({preventScroll: true}); }
  }
  // keyboard and focus on the tree's rows (delegated: the rows are redrawn)
  function treeBox(t) {
    var box = t && t.closest ? t.closest("#tree") : null;
    return box && t.closest(".tree-row") ? box : null;
  }
  document.addEventListener("focusin", function (e) {
    var box = treeBox(e.target);
    if (!box) { return; }
    box._modscopeFocus = e.target.closest(".tree-row").getAttribute("data-mid");
    roving(box);
  });
  document.addEventListener("keydown", function (e) {
    var box = treeBox(e.target);
    if (!box || e.altKey || e.ctrlKey || e.metaKey) { return; }
    var cur = e.target.closest(".tree-row");
    var rows = Array.prototype.slice.call(box.querySelectorAll(".tree-row"));
    var i = rows.indexOf(cur);
    var level = function (el) { return Number(el.getAttribute("aria-level")) || 1; };
    var toggle = cur.querySelector(".tree-toggle[data-action='toggle']");
    var expanded = cur.getAttribute("aria-expanded");
    var to = null;
    switch (e.key) {
      case "ArrowDown": to = rows[i + 1] || null; break;
      case "ArrowUp": to = i > 0 ? rows[i - 1] : null; break;
      case "Home": to = rows[0] || null; break;
      case "End": to = rows[rows.length - 1] || null; break;
      case "ArrowRight":
        if (expanded === "false" && toggle) { toggle.click(); }
        else if (expanded === "true" && rows[i + 1] && level(rows[i + 1]) > level(cur)) { to = rows[i + 1]; }
        break;
      case "ArrowLeft":
        if (expanded === "true" && toggle) { toggle.click(); }
        else {
          for (var j = i - 1; j >= 0 && !to; j--) { if (level(rows[j]) < level(cur)) { to = rows[j]; } }
        }
        break;
      case "Enter":
      case " ":
        // on the row itself: select it, as a click on its name (on its toggle or name: the handler above)
        if (e.target !== cur) { return; }
        var label = cur.querySelector(".tree-label[data-action]");
        if (label) { label.click(); }
        break;
      default:
        return;
    }
    e.preventDefault();
    if (to) {
      to.focus();     // the row (not the toggle or name inside it): the keys go on from there
    } else if ((e.key === "ArrowRight" || e.key === "ArrowLeft") && e.target !== cur) {
      cur.focus();    // expanded or collapsed from its toggle or name: go on from the row
    }
  });
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
      var keep = focused ? {mid: focused.getAttribute("data-mid"), action: act.getAttribute("data-action"),
                            row: act === focused} : null;
      var frag = document.createDocumentFragment();
      (data.rows || []).forEach(function (r) { frag.appendChild(row(r)); });
      if (data.message) { frag.appendChild(span("message muted", data.message)); }
      box.setAttribute("role", "tree");
      box.setAttribute("aria-label", "Module tree");
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

// 5. What the user scrolled sideways in an evidence block (a <pre> of a <details data-open-key>) stays
//    scrolled when it is drawn again: Dash draws the list (or the module's detail) anew on every poll
//    while a run trains, and a new <pre> starts at 0. The position is kept per container store and key
//    (the key the open <details> are kept by; the Findings page and a module's detail may show the same
//    finding), in this page's memory (it survives going to another page of the dashboard and back, not a
//    reload), and set on each <pre> drawn (or opened) again. No user scroll is lost to a redraw: the
//    position is set as the new <pre> enters the document (a MutationObserver's callback runs before the
//    browser's next scroll event), so the scroll event the browser then sends reports the kept one.
(function () {
  var kept = {};        // "<store> <key>" -> [scrollLeft, scrollTop]
  var any = false;
  var SEL = "[data-toggle-store] details[data-open-key] > pre";
  function keyOf(pre) {
    var d = pre.parentElement;
    var box = d && d.closest ? d.closest("[data-toggle-store]") : null;
    if (!box || !d.matches("details[data-open-key]")) { return null; }
    return box.getAttribute("data-toggle-store") + " " + d.getAttribute("data-open-key");
  }
  document.addEventListener("scroll", function (e) {
    var el = e.target;
    if (!el || !el.matches || !el.matches(SEL)) { return; }
    var key = keyOf(el);
    if (key === null) { return; }
    kept[key] = [el.scrollLeft, el.scrollTop];
    any = true;
  }, true);
  // each <pre> once as it is drawn (open), or again when its <details> opens (``all``): reading and
  // setting a scroll position lays the page out, not to be done on every change of the document
  function restore(pres, all) {
    for (var i = 0; i < pres.length; i++) {
      var el = pres[i];
      if ((el._modscopeSeen && !all) || !el.parentElement || !el.parentElement.open) { continue; }
      el._modscopeSeen = true;                                          // (closed: nothing laid out yet)
      var pos = kept[keyOf(el)];
      if (!pos) { continue; }
      if (el.scrollLeft !== pos[0]) { el.scrollLeft = pos[0]; }
      if (el.scrollTop !== pos[1]) { el.scrollTop = pos[1]; }
    }
  }
  function start() {
    new MutationObserver(function () {
      if (any) { restore(document.querySelectorAll(SEL), false); }
    }).observe(document.body, {childList: true, subtree: true});
  }
  if (document.body) { start(); } else { document.addEventListener("DOMContentLoaded", start); }
  // a <details> opened (by the user, or drawn open): its <pre> laid out now
  document.addEventListener("toggle", function (e) {
    var d = e.target;
    if (any && d && d.open && d.matches && d.matches("details[data-open-key]")) {
      restore(d.querySelectorAll(":scope > pre"), true);
    }
  }, true);
})();

// 6. The focus stays where it was when the element holding it is drawn again (the tree does its own,
//    4.): a finding's button or a top finding (data-focus-key), the <summary> of an evidence or of the
//    consequences (its <details>' data-open-key, in its container). Opening an evidence with Enter draws
//    the list again, and so does every poll while a run trains: the keyboard user would be thrown back
//    to <body>. The element focused last is remembered (by its key) until the focus moves elsewhere
//    while it is still in the document; when the document changes and nothing holds the focus, the
//    element drawn with the same key gets it back (without scrolling the page).
(function () {
  var want = null;
  function focusKey(el) {
    if (!el || !el.getAttribute) { return null; }
    var k = el.getAttribute("data-focus-key");
    if (k) { return "k " + k; }
    var d = el.tagName === "SUMMARY" ? el.parentElement : null;
    var box = d && d.getAttribute("data-open-key") ? d.closest("[data-toggle-store]") : null;
    return box ? "s " + box.getAttribute("data-toggle-store") + " " + d.getAttribute("data-open-key") : null;
  }
  function find(key) {
    var els = document.querySelectorAll("[data-focus-key], [data-toggle-store] details[data-open-key] > summary");
    for (var i = 0; i < els.length; i++) { if (focusKey(els[i]) === key) { return els[i]; } }
    return null;
  }
  document.addEventListener("focusin", function (e) { want = focusKey(e.target); });
  document.addEventListener("focusout", function (e) {
    var t = e.target;
    setTimeout(function () {
      // moved away by the user (still drawn): forget it; removed by a redraw: keep it for the new one
      if (t.isConnected && document.activeElement !== t && want === focusKey(t)) { want = null; }
    }, 0);
  });
  function start() {
    new MutationObserver(function () {
      var act = document.activeElement;
      if (want === null || (act && act !== document.body)) { return; }
      var el = find(want);
      if (el) { el.focus({preventScroll: true}); }
    }).observe(document.body, {childList: true, subtree: true});
  }
  if (document.body) { start(); } else { document.addEventListener("DOMContentLoaded", start); }
})();
