"""Modules: the lazily expanded module tree (left) and the selected module's detail (right).

Only the children of expanded nodes are queried and rendered, so a 10,000-module model
costs what is on screen. Search (name or type) and the finding filter show a flat,
capped result list instead of the tree.

While a run trains the open module's detail is drawn again on every poll: the evidence and the
consequences of its findings the user opened are kept in ``dcc.Store(ids.DETAIL_OPEN)`` (the detail
panel names ``ids.DETAIL_TOGGLE``, into which assets/modscope.js reports each toggle) and drawn open
again, as on the Findings page; ``ids.DETAIL_TOGGLE`` lives in the tab's sessionStorage, so that they are
still open after another page and back.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

from dash import ClientsideFunction, Dash, Input, Output, Patch, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from probes.schema import Severity, TensorKind, code_label, display_path

from ...read.run import Run, fold_causes, format_ranks
from ...read.shown_text import TITLE_MAX, clip, title
from ...read.store import MAX_CHILDREN, MAX_SEARCH, REMOVED, Store
from ...read.store_guard import valid_id
from .. import figures, ids
from ..components import (
    KIND_TITLES,
    badge_specs,
    count_or_unknown,
    finding_badges,
    finding_card,
    int_or_zero,
    kind_badge,
    long_text,
    message,
    params_text,
    table,
    toggled,
    yes_no,
)
from ..config import AppConfig
from ..poll import Tick, callback, plural, reads_store, view_of
from . import param_history

MAX_VISIBLE_ROWS = 2000
MAX_INDENT = 48            # levels of indentation drawn (a deeper row is indented no further; its aria-level still
                           # says how deep)
LONG_PATH = 300            # characters of the module's path in its detail's title (all of it: "show all")
DETAIL_POINTS = 600        # a detail chart is ~500 px wide: more points only cost rendering time
DETAIL_HEAT_COLUMNS = 150
# Charts wait laid out but invisible (not display:none, so plotly sizes them once, up front).
# (functions returning fresh dicts: no shared mutable module state handed to Dash)


def hidden() -> dict[str, Any]:
    return {"visibility": "hidden", "height": 0, "overflow": "hidden"}


def shown() -> dict[str, Any]:
    return {"visibility": "visible", "height": "auto", "overflow": "visible"}


def graph_config() -> dict[str, Any]:
    return figures.graph_config(displayModeBar="hover")


# the series of the detail chart's traces, in order (figures.DETAIL_PANELS; the last only with gradients)
SERIES_KEYS = tuple(key for _, keys, _ in figures.DETAIL_PANELS for key, _ in keys)


def layout(config: AppConfig) -> html.Div:
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
            dcc.Graph(id=ids.DETAIL_PARAM_HISTORY, config=graph_config(), responsive=True,
                      figure=figures.empty_figure(""), style={"width": "100%", "height": "460px"}),
            dcc.Store(id=ids.DETAIL_PARAM_HISTORY_STATE, data=None),
            html.Div(id=ids.DETAIL_RANKS),
            html.Div(id=ids.DETAIL_FINDINGS),
            dcc.Store(id=ids.DETAIL_STATE, data=None),
            dcc.Store(id=ids.DETAIL_HEAT_STATE, data=None),
            dcc.Store(id=ids.DETAIL_OPEN, data=[]),
            dcc.Store(id=ids.DETAIL_TOGGLE, data=None, storage_type="session"),
        ], className="panel detail-panel", **ids.toggle_attrs(ids.DETAIL_TOGGLE)),
    ], className="modules")


# -- tree rendering ---------------------------------------------------------------------------------
# The server sends plain row data (small JSON); assets/modscope.js (renderTree) draws the rows with
# textContent, never HTML. Drawing hundreds of rows as Dash components took ~3 ms per row.
def removed_title(m: Mapping[str, Any]) -> str | None:
    """What a module no longer part of the model says of it (None for one that is)."""
    step = m.get("removed_step")
    if step is None:
        return None
    return f"removed at step {step}: no longer part of the model (its statistics and findings are kept)"


def tree_row(m: Mapping[str, Any], *, expanded: bool, selected: bool, findings: list[dict[str, Any]],
             inside: dict[str, int] | None, show_path: bool = False) -> dict[str, Any]:
    """Everything one tree row shows, as plain data (pure). A module no longer part of the model is of kind
    "removed" (its badge's title says since which step)."""
    gone = removed_title(m)
    has_children = (m["n_children"] or 0) > 0 and not show_path and gone is None
    pill = subtree_pill(inside) if inside and has_children and not expanded else None
    depth = m["depth"] or 0                                    # unknown (a store from elsewhere): 0
    return {
        # strings cut (a 1 MB path must not fill the row); the path, the row's tooltip, to TITLE_MAX
        "id": m["module_id"], "path": clip(m["path"], TITLE_MAX), "kind": REMOVED if gone else clip(m["kind"]),
        "label": clip(display_path(m["path"]) if show_path else (m["name"] or m["type"])),
        "type": clip(m["type"]) if (m["path"] or show_path) else "",
        "toggle": ("▾" if expanded else "▸") if has_children else "",
        "selected": selected,
        "level": 1 if show_path else depth + 1,          # aria-level (a flat search result: 1)
        "indent": round(0.4 + (0 if show_path else min(depth, MAX_INDENT)) * 1.1, 2),
        "kind_title": gone or KIND_TITLES.get(m["kind"], ""),
        "badges": [b.to_data() for b in badge_specs(findings, m["kind"])],
        "inside": pill,
        "params": params_text(m),
    }


def subtree_pill(counts: Mapping[str, int]) -> dict[str, str] | None:
    """"2 errors, 1 warning inside" on a collapsed node, coloured by the worst."""
    present = [s for s in Severity if counts.get(s)]
    if not present:
        return None
    return {"text": ", ".join(plural(counts[s], s.value) for s in present) + " inside", "sev": present[0].value}


def build_tree(store: Store, rank: int, expanded: list[int], selected: int | None) -> tuple[dict[str, Any], str]:
    """The visible part of the tree: the root and the children of expanded nodes only, as the model is now (a
    module no longer part of it is drawn where it was when it is the one selected)."""
    root = store.root(rank)
    if root is None:
        return {"rows": [], "message": "No modules recorded yet."}, ""
    expanded_set = set(expanded)
    # the selected module and its ancestors: a module removed with its parent (blocks.3.1 when blocks.3 was popped)
    # is drawn under that parent, itself drawn where it was
    also = [] if selected is None else [*store.ancestors(rank, selected), selected]
    inside = store.subtree_finding_counts(rank)
    stack = [root]
    nodes: list[dict[str, Any]] = []
    more: dict[str, int] = {}
    while stack and len(nodes) < MAX_VISIBLE_ROWS:
        m = stack.pop()
        nodes.append(m)
        if m["module_id"] in expanded_set and m["n_children"]:
            ch = store.children(rank, m["module_id"], MAX_CHILDREN, also=also)
            if ch["more"]:
                more[display_path(m["path"])] = ch["more"]
            stack.extend(reversed(ch["items"]))
    own = store.findings_for_modules(rank, [m["module_id"] for m in nodes])
    rows = [tree_row(m, expanded=m["module_id"] in expanded_set, selected=m["module_id"] == selected,
                     findings=own.get(m["module_id"], []), inside=inside.get(m["module_id"])) for m in nodes]
    note = "; ".join(f"{n:,} more children of {p} not shown (use search)" for p, n in more.items())
    info = f"{len(nodes):,} nodes shown" + (" (limit reached, use search)" if stack else "")
    return {"rows": rows, "message": note}, info


def build_results(store: Store, rank: int, text: str, code: str | None,
                  selected: int | None) -> tuple[dict[str, Any], str]:
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


def filter_options(codes: list[str]) -> list[dict[str, str]]:
    return [{"label": f"{code_label(c)} ({c})", "value": c} for c in codes]


# -- clicks ---------------------------------------------------------------------------------------------
def expanded_ids(expanded: object, view: list[Any]) -> list[int] | None:
    """The expanded nodes stored for ``view`` ([run, rank]); None when they were stored for another
    run or rank (module ids differ between them) or not yet."""
    if isinstance(expanded, dict) and expanded.get("view") == view and isinstance(expanded.get("ids"), list):
        return [int(i) for i in expanded["ids"]]
    return None


def handle_click(store: Store, click: object, expanded: object, rank: int, view: list[Any]) -> tuple[Any, Any]:
    """(expanded nodes, page path) after one click from assets/modscope.js; the selection itself
    is set in the browser (modscope.selectFromClick). ``view``: the run and rank shown."""
    if not isinstance(click, dict):
        raise PreventUpdate
    try:
        action = ids.ClickAction(click.get("action"))
    except (TypeError, ValueError):
        raise PreventUpdate from None
    mid = valid_id(click.get("id"))         # from the browser: anything (an id out of range, text) is no click
    if mid is None:
        raise PreventUpdate
    if action is ids.ClickAction.TOGGLE:
        exp = expanded_ids(expanded, view)
        exp = store.default_expanded(rank) if exp is None else exp
        if mid in exp:
            exp.remove(mid)
        else:
            exp.append(mid)
        return {"view": view, "ids": exp}, no_update
    return expand_to(store, rank, mid, expanded, view), "/modules" if action is ids.ClickAction.OPEN else no_update


def expand_to(store: Store, rank: int, module_id: int, expanded: object, view: list[Any]) -> Any:
    """The expanded nodes with the ancestors of ``module_id`` added (no_update when all are)."""
    have = expanded_ids(expanded, view)
    exp = store.default_expanded(rank) if have is None else have
    missing = [a for a in store.ancestors(rank, module_id) if a not in exp]
    if not missing and have is not None:
        return no_update
    return {"view": view, "ids": exp + missing}


# -- detail rendering ---------------------------------------------------------------------------------
def detail_header(m: Mapping[str, Any], own: list[dict[str, Any]],
                  params: Sequence[Mapping[str, Any]] = ()) -> list[Any]:
    """The module's title and counts. The counts are the store's (``modules.params_total``: each tensor
    once, under the module it is stored under); a tensor this module owns by another name (a tied
    weight) is named beside them."""
    shared = [p for p in params if p.get("primary") is False]
    shared_numel = sum(int_or_zero(p.get("numel")) for p in shared)
    trainable, in_opt = m["params_trainable"], m["params_in_optimizer"]
    path = display_path(m["path"])
    return [
        html.Div([html.H2(clip(path, LONG_PATH), className="mono", title=title(path, LONG_PATH)),
                  html.Span(clip(m["type"]), className="detail-type",
                            title=clip(m.get("type_module") or "", TITLE_MAX)),
                  kind_badge(m["kind"]) if m.get("removed_step") is None
                  else html.Span(REMOVED, className=f"badge kind-{REMOVED}", title=removed_title(m)),
                  *finding_badges(own, m["kind"])], className="detail-title"),
        long_text(path, "mono detail-full-path", limit=0) if len(path) > LONG_PATH else None,
        html.Div([
            html.Span(f"{count_or_unknown(m['params_total'])} parameters"),
            html.Span(f"{count_or_unknown(trainable)} trainable"),
            html.Span(f"{count_or_unknown(in_opt)} held by the optimizer",
                      className="bad" if int_or_zero(in_opt) < int_or_zero(trainable) else ""),
            html.Span(f"+ {shared_numel:,} shared with "
                      + ", ".join(clip(p["shared_with"][0]) for p in shared) + " (counted there)",
                      title="tied: the same tensor under another name") if shared else None,
            html.Span(f"{count_or_unknown(m['n_children'])} children"),
            html.Span(f"first seen at step {m['first_step']}") if m.get("first_step") is not None else None,
            html.Span(f"removed at step {m['removed_step']}", className="bad")
            if m.get("removed_step") is not None else None,
        ], className="detail-facts"),
    ]


def findings_section(items: list[dict[str, Any]], *, show_ranks: bool = False,
                     opened: Collection[str] = frozenset()) -> html.Div | None:
    """The module's findings (``module_findings``: root causes with their consequences already folded
    under them); the evidence and consequences whose keys (components.details_key) are in ``opened``
    drawn open."""
    if not items:
        return None
    return html.Div([html.H3("Findings"), *[finding_card(f, show_ranks=show_ranks, opened=opened)
                                            for f in items]], className="detail-findings")


def module_findings(run: Run, rank: int, mid: int) -> list[dict[str, Any]]:
    """The run's findings (merged over its ranks, resolved ones too) that concern module ``mid`` of
    ``rank``, folded over the whole run first (as on the Findings page and the Overview): each root
    cause drawn on the module or with a consequence drawn on it, with all its consequences."""
    return [f for f in fold_causes(run.findings_merged(active=None, rank=rank))
            if f.get("module_id") == mid or any(c.get("module_id") == mid for c in f["consequences"])]


def ranks_table(norms: Mapping[str, Any]) -> html.Div | None:
    """The module's tensors' local gradient norms (each rank's own, before the all-reduce), one column
    per rank: a rank whose gradient differs stands out."""
    ranks = norms.get("ranks") or []
    rows = [r for r in norms.get("rows") or [] if any(v is not None for v in r["values"].values())]
    if len(ranks) < 2 or not rows:
        return None
    steps = norms.get("steps") or {}
    same_step = len({steps.get(r) for r in ranks}) == 1
    heads = ["tensor", *(f"rank {r}" + ("" if same_step or steps.get(r) is None else f" (step {steps[r]})")
                         for r in ranks)]
    body = [[html.Td(r["name"], className="mono", title=r["path"]), *(r["values"].get(k) for k in ranks)]
            for r in rows]
    step = f" at step {steps.get(ranks[0])}" if same_step and steps.get(ranks[0]) is not None else ""
    more = norms.get("more_ranks") or 0
    return html.Div([html.H3(f"Local gradient norms per rank{step}"),
                     html.Div("each rank's own gradient, before the all-reduce", className="muted small"),
                     html.Div(table(heads, body, "ranks-grad-table"), className="table-scroll"),
                     message(f"{format_ranks(range(len(ranks), len(ranks) + more))} not shown") if more else None],
                    className="params")


def optimizer_text(p: Mapping[str, Any], several: bool) -> str:
    """Where the optimizer holds ``p``: "yes (group 0, lr 0.01)", naming the optimizer ("optimizer 1,
    group 0") when the run has more than one."""
    if p["in_optimizer"] is None:
        return "unknown"
    if not p["in_optimizer"]:
        return "no"
    where = [f"optimizer {p['opt_index']}"] if several and p.get("opt_index") is not None else []
    where.append(f"group {p['opt_group']}")
    if p["lr"] is not None:
        where.append(f"lr {figures.fmt_num(p['lr'])}")
    return f"yes ({', '.join(where)})"


def params_table(params: list[dict[str, Any]], optimizers: int = 1) -> html.Div:
    """The module's tensors (``Store.module_params``); ``optimizers``: how many the run has."""
    if not params:
        return message("This module owns no parameters or buffers.")
    rows = []
    for p in params:
        opt = optimizer_text(p, optimizers > 1)
        bad_opt = p["requires_grad"] and not p["in_optimizer"] and p["kind"] != TensorKind.BUFFER
        moved = {1: "yes", 0: "no", None: "–"}.get(p["moved"], "–")
        others = [str(x) for x in p.get("shared_with") or []]
        shared = (f" · same tensor as {others[0]}" if p.get("primary") is False
                  else f" · shared with {', '.join(others)}" if others else "")
        rows.append([
            html.Td(clip(p["name"]), className="mono", title=clip(p["path"], TITLE_MAX)),
            html.Td(clip(p["kind"]) + ("" if p["in_state_dict"] else " · not in state_dict") + clip(shared),
                    className="bad" if p["kind"] == TensorKind.TENSOR else ""),
            html.Td(clip("×".join(str(s) for s in p["shape"])) if isinstance(p["shape"], list)
                    else "uninitialised" if p["shape"] is None else "unknown",
                    className="mono"),
            yes_no(p["requires_grad"]),
            html.Td(opt, className="bad" if bad_opt else ""),
            p["grad_norm"],
            p["update_ratio"],
            html.Td(moved, className="bad" if p["moved"] == 0 and p["requires_grad"] else ""),
        ])
    return html.Div([html.H3("Parameters"), table(
        ["name", "kind", "shape", "requires_grad", "in optimizer", "grad norm", "update/data", "moved"],
        rows, "params-table")], className="params")


class DetailOutputs(NamedTuple):
    """The outputs of the detail callback, in order."""

    header: Any
    findings: Any
    charts_style: Any
    chart: Any               # a figure, or a Patch extending the open one
    params: Any
    ranks: Any               # local gradient norms per rank (a run of several ranks)
    state: Any               # {"view", "rank", "module_id", "last", "has_data", "has_grad"}: what the chart shows
    opened: Any = no_update  # the keys of the <details> the user opened (ids.DETAIL_OPEN), when they changed


def detail_error(text: str) -> DetailOutputs:
    return DetailOutputs([message(text, "bad")], None, hidden(), no_update, None, None, None)


def detail_cleared() -> DetailOutputs:
    """Nothing selected (another run or rank is shown now)."""
    return DetailOutputs(message("Select a module in the tree."), None, hidden(), figures.empty_figure(""), None,
                         None, None)


def inside_torchscript(store: Store, rank: int, m: Mapping[str, Any]) -> str | None:
    """The path of the TorchScript module ``m`` runs inside (its parent is a ScriptModule: its forward runs in
    TorchScript, where no hook sees it, so it never has samples of its own), else None."""
    parent = store.module(rank, m["parent_id"]) if m.get("parent_id") is not None else None
    if parent is not None and str(parent.get("type") or "").endswith("ScriptModule"):
        return display_path(parent["path"])
    return None


def no_samples_text(where: str | None, what: str = "activation samples") -> str:
    if where is None:
        return f"No {what} for this module yet."
    return f"No {what}: it runs inside the TorchScript module {where}, where no hook sees it ({where} has them)."


def detail_full(run: Run, rank: int, mid: int, opened: Collection[str] = frozenset()) -> DetailOutputs:
    """The module's detail drawn whole (``opened``: the keys of the <details> drawn open)."""
    store = run.at(rank)
    m = store.module(rank, mid)
    if m is None:
        return detail_error(f"Module {mid} is not in this store.")
    own = store.findings_for_modules(rank, [mid]).get(mid, [])
    series = store.module_series(rank, mid, max_points=DETAIL_POINTS)
    several = len(run.ranks()) > 1
    params = store.module_params(rank, mid)
    return DetailOutputs(
        detail_header(m, own, params),
        findings_section(module_findings(run, rank, mid), show_ranks=several, opened=opened),
        shown(),
        figures.detail_series_figure(series, f"{run.key}-{rank}-{mid}",
                                     empty=no_samples_text(inside_torchscript(store, rank, m))),
        params_table(params, store.optimizer_count(rank)),
        ranks_table(run.local_grad_norms(rank, mid)) if several else None,
        {"view": [run.key, rank], "rank": rank, "module_id": mid, "last": series["last"],
         "has_data": bool(series["step"]), "has_grad": any(v is not None for v in series["out_grad_norm"])})


def detail_increment(run: Run, rank: int, mid: int, state: dict[str, Any],
                     opened: Collection[str] = frozenset()) -> DetailOutputs:
    """New samples of the open module: the chart extended in place (a Patch), unless its gradient
    panel was still the "no gradients yet" message (then drawn whole); the rest drawn again, the
    <details> whose keys are in ``opened`` open."""
    if not state.get("has_data"):
        return detail_full(run, rank, mid, opened)
    store = run.at(rank)
    new = store.module_series(rank, mid, since_step=state.get("last"))
    if not new["step"]:
        raise PreventUpdate
    has_grad = bool(state.get("has_grad", False))
    chart: Any
    if not has_grad and any(v is not None for v in new["out_grad_norm"]):
        chart = figures.detail_series_figure(store.module_series(rank, mid, max_points=DETAIL_POINTS),
                                             f"{run.key}-{rank}-{mid}")
        has_grad = True
    else:
        chart = Patch()
        grew = has_grad and any(v is not None for v in new["out_grad_norm"])
        for i, key in enumerate(SERIES_KEYS if grew else SERIES_KEYS[:-1]):
            chart["data"][i]["x"].extend(new["step"])
            chart["data"][i]["y"].extend(new[key])
    m = store.module(rank, mid)
    own = store.findings_for_modules(rank, [mid]).get(mid, [])
    several = len(run.ranks()) > 1
    params = store.module_params(rank, mid)
    return DetailOutputs(
        detail_header(m, own, params) if m else no_update,
        findings_section(module_findings(run, rank, mid), show_ranks=several, opened=opened),
        no_update, chart, params_table(params, store.optimizer_count(rank)),
        ranks_table(run.local_grad_norms(rank, mid)) if several else None,
        {**state, "last": new["last"], "has_grad": has_grad})


def detail_findings(run: Run, rank: int, mid: int, opened: Collection[str]) -> DetailOutputs:
    """Only the module's findings, drawn again with ``opened`` (a toggle of the user's)."""
    section = findings_section(module_findings(run, rank, mid), show_ranks=len(run.ranks()) > 1, opened=opened)
    return DetailOutputs(no_update, section, no_update, no_update, no_update, no_update, no_update)


def heat_update(fig: dict[str, Any], key: str, drawn: object) -> tuple[Any, Any]:
    """The heat map (``fig``, of the module ``key`` names) as an output, and what it shows
    ({"key", "has_data"}, ``drawn`` before). The same module's map drawn again (new samples) is a Patch
    of its data only: the layout, where plotly keeps the user's zoom, stays. (A new figure loses the
    zoom although its uirevision is the same: dcc.Graph plots the zoomed layout again, and plotly then
    takes the zoom for the app's own range, which the next figure does not have.)"""
    shows = {"key": key, "has_data": bool(fig["data"])}
    if shows["has_data"] and drawn == shows:
        patch = Patch()
        patch["data"] = fig["data"]
        return patch, no_update
    return fig, shows


# -- callbacks ------------------------------------------------------------------------------------------
def register(app: Dash, config: AppConfig) -> None:
    source = config.source
    param_history.register(app, config, heat_update)        # each parameter's history, under its table

    @callback(app, Output(ids.TREE_FILTER, "options"), Input(ids.TICK, "data"))
    @reads_store(source, waiting=lambda _text: [])
    def update_filter_options(tick: Tick) -> list[dict[str, str]]:
        run, rank = view_of(config, tick)
        return filter_options(run.at(rank).finding_codes(rank))

    def tree_message(text: str) -> tuple[Any, ...]:
        return {"rows": [], "message": text}, "", None

    @callback(app, Output(ids.TREE_DATA, "data"), Output(ids.TREE_INFO, "children"), Output(ids.TREE_STATE, "data"),
                  Input(ids.TICK, "data"), Input(ids.EXPANDED, "data"), Input(ids.TREE_SEARCH, "value"),
                  Input(ids.TREE_FILTER, "value"),
                  State(ids.SELECTED, "data"), State(ids.TREE_STATE, "data"))
    @reads_store(source, waiting=tree_message, failed=tree_message)
    def render_tree(tick: Tick, expanded: object, text: str | None, code: str | None,
                    selected: object, tree_state: object) -> tuple[Any, ...]:
        """The visible rows of the run and rank shown. A new selection only moves the highlight (done
        in the browser)."""
        key = [list(tick.structure), *tick.view]
        if ctx.triggered_id == ids.TICK and isinstance(tree_state, dict) and tree_state.get("structure") == key:
            raise PreventUpdate  # a new step without new modules or findings: the tree is unchanged
        run, rank = view_of(config, tick)
        store = run.at(rank)
        sel = selected.get("module_id") if isinstance(selected, dict) and selected.get("run") == run.key \
            and selected.get("rank") == rank else None
        if (text or "").strip() or code:
            data, info = build_results(store, rank, text or "", code, sel)
        else:
            exp = expanded_ids(expanded, [run.key, rank])
            data, info = build_tree(store, rank, store.default_expanded(rank) if exp is None else exp, sel)
        return data, info, {"structure": key}

    app.clientside_callback(ClientsideFunction(namespace="modscope", function_name="renderTree"),
                            Output(ids.TREE, "title"), Input(ids.TREE_DATA, "data"), State(ids.SELECTED, "data"))
    app.clientside_callback(ClientsideFunction(namespace="modscope", function_name="highlightSelected"),
                            Output(ids.TREE, "className"), Input(ids.SELECTED, "data"))

    # The selection is set in the browser (no round trip before the detail callback starts); the
    # server expands the selected module's ancestors and switches to /modules in parallel. A tick
    # that shows another run or rank clears it.
    app.clientside_callback(ClientsideFunction(namespace="modscope", function_name="selectFromClick"),
                            Output(ids.SELECTED, "data"), Input(ids.UI_CLICK, "data"), Input(ids.TICK, "data"),
                            State(ids.SELECTED, "data"), prevent_initial_call=True)

    @callback(app, Output(ids.EXPANDED, "data"), Output(ids.URL, "pathname"),
                  Input(ids.UI_CLICK, "data"), State(ids.TICK, "data"), State(ids.EXPANDED, "data"),
                  prevent_initial_call=True)
    @reads_store(source, tick_first=False)
    def on_click(click: object, tick: object, expanded: object) -> tuple[Any, Any]:
        """Tree toggles, tree selections and findings (which open their module). Expanded nodes are
        kept per run and rank (module ids differ between them): another view starts from its default."""
        run, rank = view_of(config, Tick.from_data(tick))
        return handle_click(run.at(rank), click, expanded, rank, [run.key, rank])

    @callback(app,
        Output(ids.DETAIL_HEADER, "children"), Output(ids.DETAIL_FINDINGS, "children"),
        Output(ids.DETAIL, "style"),
        Output(ids.DETAIL_ACT, "figure"),
        Output(ids.DETAIL_PARAMS, "children"), Output(ids.DETAIL_RANKS, "children"), Output(ids.DETAIL_STATE, "data"),
        Output(ids.DETAIL_OPEN, "data"),
        Input(ids.TICK, "data"), Input(ids.SELECTED, "data"), Input(ids.DETAIL_TOGGLE, "data"),
        State(ids.DETAIL_STATE, "data"), State(ids.DETAIL_OPEN, "data"))
    @reads_store(source, failed=detail_error)
    def render_detail(tick: Tick, selected: object, toggle: object, state: object, opened: object) -> DetailOutputs:
        """Header, findings, the series chart (three panels, one figure; extended in place when
        live), parameters and, for several ranks, their local gradient norms side by side. The
        evidence and consequences the user opened are drawn open (``components.toggled``); a toggle
        alone draws the findings again: a redraw that a poll started before it would otherwise close
        it again (Dash drops that redraw's answer, chart and state together, once this call is made)."""
        keys = toggled(opened, toggle)
        triggers = set(ctx.triggered_prop_ids)
        # (the page drawn again, its stores new, is the toggle's store alone among the triggers too)
        toggle_only = isinstance(toggle, dict) and triggers == {f"{ids.DETAIL_TOGGLE}.data"}
        if toggle_only and set(keys) == set(toggled(opened, None)):
            raise PreventUpdate
        run, rank = view_of(config, tick)
        chosen = selected if isinstance(selected, dict) else {}
        mid = valid_id(chosen.get("module_id"))          # from the browser: anything but an id is no selection
        if mid is None or chosen.get("run") != run.key or chosen.get("rank") != rank:
            if isinstance(state, dict):
                return detail_cleared()
            raise PreventUpdate
        drawn = state if isinstance(state, dict) and state.get("module_id") == mid \
            and state.get("view") == [run.key, rank] else None              # this module's detail is on screen
        if drawn is not None and toggle_only:
            out = detail_findings(run, rank, mid, set(keys))
        elif drawn is not None and f"{ids.TICK}.data" in triggers and f"{ids.SELECTED}.data" not in triggers:
            out = detail_increment(run, rank, mid, drawn, set(keys))
        else:
            out = detail_full(run, rank, mid, set(keys))
        return out._replace(opened=keys if keys != opened else no_update)

    @callback(app, Output(ids.DETAIL_HEAT, "figure"), Output(ids.DETAIL_HEAT_STATE, "data"),
                  Input(ids.DETAIL_STATE, "data"), State(ids.DETAIL_HEAT_STATE, "data"))
    @reads_store(source, failed=lambda text: (figures.empty_figure(text), None), tick_first=False)
    def render_heat(state: object, drawn: object) -> tuple[Any, Any]:
        """The histogram heat map follows the other charts (drawn after them, rebuilt - thinned to
        DETAIL_HEAT_COLUMNS - when the module got new samples; the same module's keeps its zoom)."""
        mid = valid_id(state.get("module_id")) if isinstance(state, dict) else None      # from the browser
        view = state.get("view") if isinstance(state, dict) else None
        if mid is None or not isinstance(view, list) or len(view) != 2 or valid_id(view[1]) is None:
            raise PreventUpdate
        run_key, rank = str(view[0]), int(view[1])
        run = source.run(run_key or None)
        key = f"{run.key}-{rank}-{mid}"
        store = run.at(int(rank))
        hist = store.module_hist(int(rank), mid, max_cols=DETAIL_HEAT_COLUMNS)
        m = store.module(int(rank), mid) if not hist.get("step") else None
        empty = no_samples_text(inside_torchscript(store, int(rank), m) if m else None, "activation histograms")
        return heat_update(figures.heatmap_figure(hist, key, empty=empty), key, drawn)
