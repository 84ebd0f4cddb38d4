"""Layers: how each layer trains, over time. For a chosen metric (gradient norm, update-to-data ratio as log10
with its 1e-3 guide, weight norm, activation mean and std, dead and saturated fractions) a heat map of the
layers (rows, in the model's order, grouped by the module tree) against the steps (columns, the real step
numbers), and a line chart of the layers picked. A click on a row opens that module on the Modules page.

Rows are one per module or block (``dashboard.layer_data``): the "open blocks" control expands a block such as
``blocks.3`` into its layers and collapses it again; one row per tensor when asked. While the run trains, new
steps are appended to both charts in place (a Patch of their data: the zoom stays); a new view (metric, rows,
run, rank) draws them anew."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from dash import Dash, Input, Output, Patch, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from ...read.layer_data import (
    MAX_COLUMNS,
    MAX_SHOWN_ROWS,
    PAGE_METRICS,
    LayerHeat,
    LayerRow,
    default_opened,
    default_picks,
    layer_heat,
    layer_rows,
    load_tree,
    measured_modules,
    open_choices,
    picks_of,
)
from ...read.series import METRICS
from ...read.store import Store
from .. import figures, ids
from ..components import message
from ..config import AppConfig
from ..layer_figures import hover_text, layer_heat_figure, layer_lines_figure, points
from ..poll import Tick, callback, reads_store, view_of

ROW_CHOICES = (("layers", "one row per layer or block"), ("tensors", "one row per tensor"))


def layout(config: AppConfig) -> html.Div:
    return html.Div([
        html.Div([
            html.Label(["Metric", dcc.Dropdown(
                id=ids.LAYERS_METRIC, value=PAGE_METRICS[0], clearable=False, searchable=False,
                options=[{"label": METRICS[m].label + (" (log10, 1e-3 guide)" if m == "update_ratio" else ""),
                          "value": m} for m in PAGE_METRICS])], className="layers-metric"),
            dcc.RadioItems(id=ids.LAYERS_ROWS, value="layers", inline=True,
                           options=[{"label": text, "value": v} for v, text in ROW_CHOICES]),
            html.Label(["Open blocks", dcc.Dropdown(id=ids.LAYERS_OPEN, multi=True, value=None, options=[],
                                                    placeholder="all collapsed")], className="layers-open"),
        ], className="layers-tools"),
        html.Div(id=ids.LAYERS_INFO, className="muted small layers-info"),
        dcc.Graph(id=ids.LAYERS_HEAT, config=figures.graph_config(displayModeBar="hover"),
                  figure=figures.empty_figure("Loading…"), style={"width": "100%"}),
        html.Label(["Plot", dcc.Dropdown(id=ids.LAYERS_PICK, multi=True, value=None, options=[],
                                         placeholder="pick layers to plot")], className="layers-pick"),
        dcc.Graph(id=ids.LAYERS_LINES, config=figures.graph_config(displayModeBar="hover"),
                  figure=figures.empty_figure(""), style={"width": "100%"}),
        dcc.Store(id=ids.LAYERS_STATE, data=None),
    ], className="panel layers-page")


class LayersOut(NamedTuple):
    """The outputs of the page's callback, in order."""

    heat: Any
    lines: Any
    open_options: Any
    opened: Any
    pick_options: Any
    picked: Any
    info: Any
    state: Any


def info_text(store: Store, rank: int, tick: Tick, rows: Sequence[LayerRow], columns: int) -> str:
    """'6 rows · 200 steps shown · 12 full samples · 150 steps with dense series · next full sample at …'."""
    parts = [f"{len(rows):,} row{'s' if len(rows) != 1 else ''}", f"{columns:,} steps shown",
             store.step_counts(rank).text()]
    if not tick.finished:
        parts.append(store.sample_schedule(rank).next_text())
    return " · ".join(p for p in parts if p)


def view_key(run_key: str, rank: int, metric: str, per_tensor: bool) -> list[Any]:
    return [run_key, rank, metric, per_tensor]


def extend(new: LayerHeat, rows: Sequence[LayerRow], picked: Sequence[str]) -> tuple[Patch, Patch]:
    """The heat map and the line chart extended by the steps of ``new`` (their layouts, and so the zoom, stay)."""
    heat, lines = Patch(), Patch()
    heat["data"][0]["x"].extend(new.steps)
    shown, text = new.shown(), hover_text(new.values)
    for i in range(len(rows)):
        heat["data"][0]["z"][i].extend(shown[i])
        heat["data"][0]["text"][i].extend(text[i])
    index = {r.key: i for i, r in enumerate(rows)}
    for n, key in enumerate(k for k in picked if k in index):
        line = points(new.steps, new.values[index[key]], new.metric)
        lines["data"][n]["x"].extend(line.x)
        lines["data"][n]["y"].extend(line.y)
        lines["data"][n]["customdata"].extend(line.value)
    return heat, lines


def render_layers(config: AppConfig, tick: Tick, metric: str, rows_mode: str, opened: object, picked: object,
                  state: object, triggers: set[str]) -> LayersOut:
    """Everything the page draws, for the run and rank ``tick`` shows (a plain function of the store)."""
    if metric not in METRICS:
        raise PreventUpdate
    run, rank = view_of(config, tick)
    store = run.at(rank)
    spec = METRICS[metric]
    per_tensor = rows_mode == "tensors"
    view = view_key(run.key, rank, metric, per_tensor)
    old = state if isinstance(state, dict) else {}
    tree = load_tree(store, rank)
    measured = measured_modules(store, rank, spec)
    user_opened = bool(old.get("user_opened")) and old.get("view", [None, None])[:2] == view[:2]
    if f"{ids.LAYERS_OPEN}.value" in triggers:
        user_opened = isinstance(opened, list)
    if user_opened and isinstance(opened, list):
        open_set = {int(m) for m in opened if isinstance(m, int) and m in tree.nodes}
    else:
        open_set = default_opened(tree, spec, measured)
    rows = layer_rows(tree, spec, open_set, measured, per_tensor=per_tensor)[:MAX_SHOWN_ROWS]
    keys = [r.key for r in rows]
    chosen = picks_of(keys, picked)
    if not chosen and (not isinstance(picked, list) or old.get("rows") != keys):
        chosen = default_picks(rows)
    only_tick = triggers <= {f"{ids.TICK}.data"}
    if (only_tick and old.get("view") == view and old.get("rows") == keys and old.get("picked") == chosen
            and old.get("last") is not None):
        new = layer_heat(store, rank, rows, spec, after=int(old["last"]))
        if not new.steps:
            raise PreventUpdate
        if int(old.get("columns") or 0) + len(new.steps) <= MAX_COLUMNS:
            heat_patch, lines_patch = extend(new, rows, chosen)
            columns = int(old.get("columns") or 0) + len(new.steps)
            return LayersOut(heat_patch, lines_patch, no_update, no_update, no_update, no_update,
                             info_text(store, rank, tick, rows, columns),
                             {**old, "last": new.steps[-1], "columns": columns})
    heat = layer_heat(store, rank, rows, spec)
    revision = "-".join(str(x) for x in view)
    same_heat = triggers == {f"{ids.LAYERS_PICK}.value"} and old.get("view") == view and old.get("rows") == keys
    options = open_choices(tree, spec, open_set, measured)
    pick_options = [{"label": r.label, "value": r.key} for r in rows]
    return LayersOut(
        no_update if same_heat else layer_heat_figure(rows, heat, f"heat-{revision}"),
        layer_lines_figure(rows, heat, chosen, f"lines-{revision}"),
        options, sorted(open_set & {o["value"] for o in options}), pick_options, chosen,
        info_text(store, rank, tick, rows, len(heat.steps)),
        {"view": view, "rows": keys, "picked": chosen, "user_opened": user_opened,
         "last": heat.steps[-1] if heat.steps else None, "columns": len(heat.steps),
         "modules": {r.label: r.module_id for r in rows}})


def clicked_module(click: object, state: object) -> int | None:
    """The module of the heat-map row a click landed on (None: not on a row)."""
    if not isinstance(click, dict) or not isinstance(state, dict):
        return None
    points_ = click.get("points") or []
    label = points_[0].get("y") if points_ and isinstance(points_[0], dict) else None
    mid = (state.get("modules") or {}).get(label)
    return int(mid) if isinstance(mid, int) else None


def register(app: Dash, config: AppConfig) -> None:
    source = config.source

    def waiting(text: str) -> LayersOut:
        return LayersOut(figures.empty_figure(text), figures.empty_figure(""), no_update, no_update, no_update,
                         no_update, "", no_update)

    def failed(text: str) -> LayersOut:
        return LayersOut(figures.empty_figure(text), figures.empty_figure(""), no_update, no_update, no_update,
                         no_update, message(text, "bad"), no_update)

    @callback(app, *(Output(i, p) for i, p in (
                  (ids.LAYERS_HEAT, "figure"), (ids.LAYERS_LINES, "figure"), (ids.LAYERS_OPEN, "options"),
                  (ids.LAYERS_OPEN, "value"), (ids.LAYERS_PICK, "options"), (ids.LAYERS_PICK, "value"),
                  (ids.LAYERS_INFO, "children"), (ids.LAYERS_STATE, "data"))),
              Input(ids.TICK, "data"), Input(ids.LAYERS_METRIC, "value"), Input(ids.LAYERS_ROWS, "value"),
              Input(ids.LAYERS_OPEN, "value"), Input(ids.LAYERS_PICK, "value"), State(ids.LAYERS_STATE, "data"))
    @reads_store(source, waiting=waiting, failed=failed)
    def render(tick: Tick, metric: str, rows_mode: str, opened: object, picked: object, state: object) -> LayersOut:
        return render_layers(config, tick, metric, rows_mode, opened, picked, state, set(ctx.triggered_prop_ids))

    @callback(app, Output(ids.UI_CLICK, "data", allow_duplicate=True), Input(ids.LAYERS_HEAT, "clickData"),
              State(ids.LAYERS_STATE, "data"), prevent_initial_call=True)
    def open_module(click: object, state: object) -> dict[str, Any]:
        """A click on a row opens its module on the Modules page (as a click on a finding does)."""
        mid = clicked_module(click, state)
        if mid is None:
            raise PreventUpdate
        return {"action": ids.ClickAction.OPEN.value, "id": mid, "t": time.time()}
