"""Modules: the lazily expanded module tree (left) and the selected module's detail (right).

Only the children of expanded nodes are queried and rendered, so a 10,000-module model
costs what is on screen. Search (name or type) and the finding filter show a flat,
capped result list instead of the tree.
"""

from __future__ import annotations

from types import MappingProxyType

from dash import ClientsideFunction, Input, Output, Patch, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from .. import figures, ids
from ..components import (code_label, finding_badges, finding_card, kind_badge, message, params_text,
                          table)
from ..data import MAX_CHILDREN, MAX_SEARCH, StoreError, StoreNotReady

MAX_VISIBLE_ROWS = 2000
DETAIL_POINTS = 600        # a detail chart is ~500 px wide: more points only cost rendering time
DETAIL_HEAT_COLUMNS = 150
# Charts wait laid out but invisible (not display:none, so plotly sizes them once, up front).
# (functions returning fresh dicts: no shared mutable module state handed to Dash)


def hidden() -> dict:
    return {"visibility": "hidden", "height": 0, "overflow": "hidden"}


def shown() -> dict:
    return {"visibility": "visible", "height": "auto", "overflow": "visible"}


def graph_config() -> dict:
    return {"displaylogo": False, "displayModeBar": "hover"}


# the series of the detail chart's traces, in order (figures.DETAIL_PANELS; the last only with gradients)
SERIES_KEYS = tuple(key for _, keys, _ in figures.DETAIL_PANELS for key, _ in keys)


def layout(config) -> html.Div:
    return html.Div([
        html.Div([
            html.Div([
                dcc.Input(id=ids.TREE_SEARCH, type="search", placeholder="Search name or type, Enter",
                          debounce=True, className="search", autoComplete="off"),
                html.Div(dcc.Dropdown(id=ids.TREE_FILTER, placeholder="Filter by finding", clearable=True),
                         className="filter"),
            ], className="tree-tools"),
            html.Div(id=ids.TREE_INFO, className="tree-info"),
            html.Div(id=ids.TREE, className="tree"),     # rows drawn by assets/modscope.js
            dcc.Store(id=ids.TREE_DATA, data=None),
            dcc.Store(id=ids.TREE_STATE, data=None),
        ], className="panel tree-panel"),
        html.Div([
            html.Div(id=ids.DETAIL_HEADER, className="detail-header",
                     children=message("Select a module in the tree.")),
            html.Div([
                *[dcc.Graph(id=gid, config=graph_config(), responsive=True,
                            figure=figures.empty_figure(""),
                            style={"width": "100%", "height": "330px" if gid == ids.DETAIL_HEAT else "700px"})
                  for gid in (ids.DETAIL_ACT, ids.DETAIL_HEAT)],
            ], id=ids.DETAIL, className="charts", style=hidden()),
            html.Div(id=ids.DETAIL_PARAMS),
            html.Div(id=ids.DETAIL_FINDINGS),
            dcc.Store(id=ids.DETAIL_STATE, data=None),
        ], className="panel detail-panel"),
    ], className="modules")


# -- tree rendering ---------------------------------------------------------------------------------
# The server sends plain row data (small JSON); assets/modscope.js (renderTree) draws the rows with
# textContent, never HTML. Drawing hundreds of rows as Dash components took ~3 ms per row.
KIND_TITLES = MappingProxyType({"unregistered": "not in model.modules(): reachable through Python attributes only",
               "runtime": "executed in forward but not reachable through attributes"})


def tree_row(m: dict, *, expanded: bool, selected: bool, findings: list[dict], inside: dict | None,
             show_path: bool = False) -> dict:
    """Everything one tree row shows, as plain data (pure)."""
    has_children = m["n_children"] > 0 and not show_path
    seen = {"unregistered-module"} if m["kind"] != "registered" else set()
    badges = []
    for f in findings:
        if f["code"] not in seen:
            seen.add(f["code"])
            badges.append({"label": code_label(f["code"]), "sev": f["severity"], "code": f["code"]})
    pill = subtree_pill(inside) if inside and has_children and not expanded else None
    return {
        "id": m["module_id"], "path": m["path"], "kind": m["kind"],
        "label": (m["path"] or "(root)") if show_path else (m["name"] or m["type"]),
        "type": m["type"] if (m["path"] or show_path) else "",
        "toggle": ("▾" if expanded else "▸") if has_children else "",
        "selected": selected,
        "indent": round(0.4 + (0 if show_path else m["depth"]) * 1.1, 2),
        "kind_title": KIND_TITLES.get(m["kind"], ""),
        "badges": badges,
        "inside": pill,
        "params": params_text(m),
    }


def subtree_pill(counts: dict) -> dict | None:
    parts = [f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in ("error", "warning", "info")
             if counts.get(s)]
    if not parts:
        return None
    worst = next(s for s in ("error", "warning", "info") if counts.get(s))
    return {"text": ", ".join(parts) + " inside", "sev": worst}


def build_tree(store, rank: int, expanded: list[int], selected: int | None) -> tuple[dict, str]:
    """The visible part of the tree: the root and the children of expanded nodes only."""
    root = store.root(rank)
    if root is None:
        return {"rows": [], "message": "No modules recorded yet."}, ""
    expanded_set = set(expanded)
    inside = store.subtree_finding_counts(rank)
    stack = [root]
    nodes: list[dict] = []
    more: dict[str, int] = {}
    while stack and len(nodes) < MAX_VISIBLE_ROWS:
        m = stack.pop()
        nodes.append(m)
        if m["module_id"] in expanded_set and m["n_children"]:
            ch = store.children(rank, m["module_id"], MAX_CHILDREN)
            if ch["more"]:
                more[m["path"] or "(root)"] = ch["more"]
            stack.extend(reversed(ch["items"]))
    own = store.findings_for_modules(rank, [m["module_id"] for m in nodes])
    rows = [tree_row(m, expanded=m["module_id"] in expanded_set, selected=m["module_id"] == selected,
                     findings=own.get(m["module_id"], []), inside=inside.get(m["module_id"])) for m in nodes]
    note = "; ".join(f"{n:,} more children of {p} not shown (use search)" for p, n in more.items())
    info = f"{len(nodes):,} nodes shown" + (" (limit reached, use search)" if stack else "")
    return {"rows": rows, "message": note}, info


def build_results(store, rank: int, text: str, code: str | None, selected: int | None) -> tuple[dict, str]:
    """Search / filter results: a flat, capped list of rows labelled by full path."""
    res = store.search_modules(rank, text, code, MAX_SEARCH)
    items = res["items"]
    own = store.findings_for_modules(rank, [m["module_id"] for m in items])
    rows = [tree_row(m, expanded=False, selected=m["module_id"] == selected, findings=own.get(m["module_id"], []),
                     inside=None, show_path=True) for m in items]
    if not items:
        return {"rows": [], "message": "No module matches."}, "0 matches"
    info = (f"first {len(items)} matches shown, refine the search" if res["truncated"]
            else f"{len(items)} match{'es' if len(items) != 1 else ''}")
    return {"rows": rows, "message": ""}, info


# -- detail rendering ---------------------------------------------------------------------------------
def detail_header(m: dict, own: list[dict]) -> list:
    return [
        html.Div([html.H2(m["path"] or "(root)", className="mono"),
                  html.Span(m["type"], className="detail-type", title=m.get("type_module") or ""),
                  kind_badge(m["kind"]), *finding_badges(own, m["kind"])], className="detail-title"),
        html.Div([
            html.Span(f"{m['params_total']:,} parameters"),
            html.Span(f"{m['params_trainable']:,} trainable"),
            html.Span(f"{m['params_in_optimizer']:,} held by the optimizer",
                      className="bad" if m["params_in_optimizer"] < m["params_trainable"] else ""),
            html.Span(f"{m['n_children']:,} children"),
            html.Span(f"first seen at step {m['first_step']}") if m.get("first_step") is not None else None,
        ], className="detail-facts"),
    ]


def finding_cards(items: list[dict]) -> list:
    return [finding_card(f) for f in items]


def _yn(v) -> str:
    return "–" if v is None else ("yes" if v else "no")


def params_table(params: list[dict]) -> html.Div:
    if not params:
        return message("This module owns no parameters or buffers.")
    rows = []
    for p in params:
        opt = (f"yes (group {p['opt_group']}" + (f", lr {figures.fmt_num(p['lr'])}" if p["lr"] is not None else "")
               + ")") if p["in_optimizer"] else "no"
        bad_opt = p["requires_grad"] and not p["in_optimizer"] and p["kind"] != "buffer"
        moved = {1: "yes", 0: "no", None: "–"}[p["moved"]]
        rows.append([
            html.Td(p["name"], className="mono", title=p["path"]),
            html.Td(p["kind"] + ("" if p["in_state_dict"] else " · not in state_dict"),
                    className="bad" if p["kind"] == "tensor" else ""),
            html.Td("×".join(str(s) for s in p["shape"]) if isinstance(p["shape"], list) else "uninitialised",
                    className="mono"),
            _yn(p["requires_grad"]),
            html.Td(opt, className="bad" if bad_opt else ""),
            p["grad_norm"],
            p["update_ratio"],
            html.Td(moved, className="bad" if p["moved"] == 0 and p["requires_grad"] else ""),
        ])
    return html.Div([html.H3("Parameters"), table(
        ["name", "kind", "shape", "requires_grad", "in optimizer", "grad norm", "update/data", "moved"],
        rows, "params-table")], className="params")


def register(app, config) -> None:
    if config.mode == "compare":
        return
    store = config.store

    def _default_expanded(rank):
        try:
            return store.default_expanded(rank)
        except StoreError:
            return []

    @app.callback(Output(ids.TREE_FILTER, "options"), Input(ids.TICK, "data"), Input(ids.RANK, "value"))
    def filter_options(tick, rank):
        if not tick or not tick.get("ready"):
            return []
        try:
            codes = store.finding_codes(rank or 0)
        except StoreError:
            raise PreventUpdate
        return [{"label": f"{code_label(c)} ({c})", "value": c} for c in codes]

    @app.callback(Output(ids.TREE_DATA, "data"), Output(ids.TREE_INFO, "children"), Output(ids.TREE_STATE, "data"),
                  Input(ids.EXPANDED, "data"), Input(ids.TREE_SEARCH, "value"), Input(ids.TREE_FILTER, "value"),
                  Input(ids.TICK, "data"), Input(ids.RANK, "value"),
                  State(ids.SELECTED, "data"), State(ids.TREE_STATE, "data"))
    def render_tree(expanded, text, code, tick, rank, selected, tree_state):
        """The visible rows. A new selection only moves the highlight (done in the browser)."""
        if not tick or not tick.get("ready"):
            return {"rows": [], "message": f"Waiting for the first sample in {store.path} …"}, "", None
        struct = [tick.get("struct"), rank]
        if ctx.triggered_id == ids.TICK and isinstance(tree_state, dict) and tree_state.get("struct") == struct:
            raise PreventUpdate  # a new step without new modules or findings: the tree is unchanged
        rank = rank or 0
        sel = selected.get("module_id") if isinstance(selected, dict) else None
        try:
            if (text or "").strip() or code:
                data, info = build_results(store, rank, text or "", code, sel)
            else:
                exp = expanded if isinstance(expanded, list) else _default_expanded(rank)
                data, info = build_tree(store, rank, exp, sel)
        except StoreNotReady:
            raise PreventUpdate
        except StoreError as exc:
            return {"rows": [], "message": str(exc)}, "", None
        return data, info, {"struct": struct}

    app.clientside_callback(ClientsideFunction(namespace="modscope", function_name="renderTree"),
                            Output(ids.TREE, "title"), Input(ids.TREE_DATA, "data"), State(ids.SELECTED, "data"))
    app.clientside_callback(ClientsideFunction(namespace="modscope", function_name="highlightSelected"),
                            Output(ids.TREE, "className"), Input(ids.SELECTED, "data"))

    # The selection is set in the browser (no round trip before the detail callback starts); the
    # server expands the selected module's ancestors and switches to /modules in parallel.
    app.clientside_callback(ClientsideFunction(namespace="modscope", function_name="selectFromClick"),
                            Output(ids.SELECTED, "data"), Input(ids.UI_CLICK, "data"), Input(ids.RANK, "value"),
                            State(ids.SELECTED, "data"), prevent_initial_call=True)

    @app.callback(Output(ids.EXPANDED, "data"), Output(ids.URL, "pathname"),
                  Input(ids.UI_CLICK, "data"), Input(ids.RANK, "value"),
                  State(ids.EXPANDED, "data"), prevent_initial_call=True)
    def on_click(click, rank, expanded):
        """Tree toggles, tree selections and findings (which open their module). Another rank
        has other module ids: switching rank starts from its default view."""
        if ctx.triggered_id == ids.RANK:
            return None, no_update
        return handle_click(store, click, expanded, rank or 0, _default_expanded)[1:]

    @app.callback(
        Output(ids.DETAIL_HEADER, "children"), Output(ids.DETAIL_FINDINGS, "children"),
        Output(ids.DETAIL, "style"),
        Output(ids.DETAIL_ACT, "figure"),
        Output(ids.DETAIL_PARAMS, "children"), Output(ids.DETAIL_STATE, "data"),
        Input(ids.SELECTED, "data"), Input(ids.TICK, "data"), State(ids.DETAIL_STATE, "data"))
    def render_detail(selected, tick, state):
        """Header, findings, the series chart (three panels, one figure; extended in place when
        live) and parameters."""
        if not isinstance(selected, dict) or selected.get("module_id") is None or not tick or not tick.get("ready"):
            raise PreventUpdate
        rank, mid = selected.get("rank", 0), selected["module_id"]
        try:
            if (ctx.triggered_id == ids.TICK and isinstance(state, dict) and state.get("module_id") == mid
                    and state.get("rank") == rank):
                return _detail_increment(store, rank, mid, state)
            return _detail_full(store, rank, mid)
        except StoreNotReady:
            raise PreventUpdate
        except StoreError as exc:
            return ([message(str(exc), "bad")], None, hidden(), no_update, None, None)

    @app.callback(Output(ids.DETAIL_HEAT, "figure"), Input(ids.DETAIL_STATE, "data"))
    def render_heat(state):
        """The histogram heat map follows the other charts (drawn after them, rebuilt - thinned to
        DETAIL_HEAT_COLUMNS - when the module got new samples)."""
        if not isinstance(state, dict) or state.get("module_id") is None:
            raise PreventUpdate
        rank, mid = state.get("rank", 0), state["module_id"]
        try:
            hist = store.module_hist(rank, mid, max_cols=DETAIL_HEAT_COLUMNS)
        except StoreNotReady:
            raise PreventUpdate
        except StoreError as exc:
            return figures.empty_figure(str(exc))
        return figures.heatmap_figure(hist, f"{rank}-{mid}")


def handle_click(store, click, expanded, rank: int, default_expanded):
    """(selected, expanded, pathname) for one click from assets/modscope.js."""
    if not isinstance(click, dict) or click.get("action") not in ("toggle", "select", "open"):
        raise PreventUpdate
    try:
        mid = int(click.get("id"))
    except (TypeError, ValueError):
        raise PreventUpdate from None
    if mid < 0:
        raise PreventUpdate
    if click["action"] == "toggle":
        exp = list(expanded) if isinstance(expanded, list) else default_expanded(rank)
        if mid in exp:
            exp.remove(mid)
        else:
            exp.append(mid)
        return no_update, exp, no_update
    sel, exp = select_module(store, rank, mid, expanded, default_expanded)
    return sel, exp, "/modules" if click["action"] == "open" else no_update


def select_module(store, rank: int, module_id: int, expanded, default_expanded):
    """Select a module and make sure the tree shows it (its ancestors expanded)."""
    exp = list(expanded) if isinstance(expanded, list) else default_expanded(rank)
    try:
        anc = store.ancestors(rank, module_id)
    except StoreError:
        anc = []
    changed = False
    for a in anc:
        if a not in exp:
            exp.append(a)
            changed = True
    return {"rank": rank, "module_id": module_id}, (exp if changed or not isinstance(expanded, list)
                                                     else no_update)


def _detail_full(store, rank: int, mid: int):
    m = store.module(rank, mid)
    if m is None:
        return ([message(f"Module {mid} is not in this store.", "bad")], None, hidden(), no_update, None, None)
    own = store.findings_for_modules(rank, [mid]).get(mid, [])
    items = store.findings(rank, active=None, module_id=mid)
    series = store.module_series(rank, mid, max_points=DETAIL_POINTS)
    params = store.module_params(rank, mid)
    rev = f"{rank}-{mid}"
    findings_block = html.Div([html.H3("Findings"), *finding_cards(items)], className="detail-findings") \
        if items else None
    return (detail_header(m, own), findings_block, shown(),
            figures.detail_series_figure(series, rev), params_table(params),
            {"rank": rank, "module_id": mid, "last": series["last"], "has_data": bool(series["step"]),
             "has_grad": any(v is not None for v in series["out_grad_norm"])})


def _detail_increment(store, rank: int, mid: int, state: dict):
    if not state.get("has_data"):
        return _detail_full(store, rank, mid)
    new = store.module_series(rank, mid, since_step=state.get("last"))
    if not new["step"]:
        raise PreventUpdate
    has_grad = state.get("has_grad", False)
    if not has_grad and any(v is not None for v in new["out_grad_norm"]):
        # the grad panel was the "no gradients yet" message (no trace to extend): draw it all
        chart = figures.detail_series_figure(store.module_series(rank, mid, max_points=DETAIL_POINTS), f"{rank}-{mid}")
        has_grad = True
    else:
        chart = Patch()
        grew = has_grad and any(v is not None for v in new["out_grad_norm"])
        for i, key in enumerate(SERIES_KEYS if grew else SERIES_KEYS[:-1]):
            chart["data"][i]["x"].extend(new["step"])
            chart["data"][i]["y"].extend(new[key])
    params = params_table(store.module_params(rank, mid))
    own = store.findings_for_modules(rank, [mid]).get(mid, [])
    m = store.module(rank, mid)
    items = store.findings(rank, active=None, module_id=mid)
    findings_block = html.Div([html.H3("Findings"), *finding_cards(items)], className="detail-findings") \
        if items else None
    return (detail_header(m, own) if m else no_update, findings_block, no_update, chart,
            params, {**state, "last": new["last"], "has_grad": has_grad})
