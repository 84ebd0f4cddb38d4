"""The module detail's parameter history: each of the selected module's tensors over time (gradient norm at
every step that has it, the dense tier's included, and the update-to-data ratio of the full samples, with its
1e-3 guide), not only the latest value of the parameter table. Drawn after the detail's other charts, again
when the module got new samples (the same module's chart keeps its zoom: a Patch of its data)."""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State
from dash.exceptions import PreventUpdate

from ...read.layer_data import param_history
from .. import figures, ids
from ..config import AppConfig
from ..layer_figures import param_history_figure
from ..poll import callback, reads_store


def register(app: Dash, config: AppConfig, heat_update: Any) -> None:
    """``heat_update``: the Modules page's way to hand a redrawn figure over (a Patch of the same module's)."""
    source = config.source

    @callback(app, Output(ids.DETAIL_PARAM_HISTORY, "figure"), Output(ids.DETAIL_PARAM_HISTORY_STATE, "data"),
              Input(ids.DETAIL_STATE, "data"), State(ids.DETAIL_PARAM_HISTORY_STATE, "data"))
    @reads_store(source, failed=lambda text: (figures.empty_figure(text), None), tick_first=False)
    def render_param_history(state: object, drawn: object) -> tuple[Any, Any]:
        if not isinstance(state, dict) or state.get("module_id") is None:
            raise PreventUpdate
        run_key, rank = state.get("view") or ["", 0]
        run = source.run(run_key or None)
        mid = int(state["module_id"])
        store = run.at(int(rank))
        history = param_history(store, int(rank), store.module_params(int(rank), mid))
        key = f"params-{run.key}-{rank}-{mid}"
        return heat_update(param_history_figure(history, key), key, drawn)  # type: ignore[no-any-return]
