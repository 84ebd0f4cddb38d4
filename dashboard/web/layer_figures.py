"""Figures of how layers train over time (pure functions from plain data to plotly figure dicts): the Layers
page's heat map (layers x steps) and line chart, and the module detail's per-parameter history."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..read.layer_data import GUIDE_RATIO, RATIO_LOG_RANGE, LayerHeat, LayerRow, ParamHistory
from ..read.series import METRICS
from .figures import SERIES_COLORS, Figure, _axis, _base, empty_figure, fmt_num, plot_text, whole_steps

ROW_PX = 20                  # height of one heat-map row
LINE_COLORS = (*SERIES_COLORS[:4], "#c2417a", "#0e7490", "#a16207", "#4b5563")


def colour_spec(metric: str) -> dict[str, Any]:
    """The heat map's colour settings for ``metric`` (a fixed scale where the values have one)."""
    if metric == "update_ratio":
        lo, hi = RATIO_LOG_RANGE
        return {"colorscale": "RdBu", "zmin": lo, "zmax": hi, "zmid": -3}      # above the guide red, below blue
    if metric == "act_mean":
        return {"colorscale": "RdBu", "reversescale": True, "zmid": 0}
    if metric in ("dead_fraction", "saturated_fraction", "zero_fraction"):
        return {"colorscale": "Reds", "zmin": 0, "zmax": 1}
    return {"colorscale": "Viridis"}


def colour_title(metric: str) -> str:
    spec = METRICS[metric]
    return f"log10 {spec.label}" if spec.log else spec.label


def step_axis(steps: Sequence[int], **extra: Any) -> dict[str, Any]:
    """An x axis of steps that never labels a fraction of a step."""
    return whole_steps(_axis(title={"text": "step"}, **extra), steps)


def hover_text(values: Sequence[Sequence[float | None]]) -> list[list[str]]:
    return [[fmt_num(v) if v is not None else "–" for v in row] for row in values]


def layer_heat_figure(rows: Sequence[LayerRow], heat: LayerHeat, uirevision: object) -> Figure:
    """Layers (rows, in the model's order, top down) against steps (one column per recorded step, labelled with
    its number): the colour is the metric (log10 where it spans decades); hover says layer, step and value."""
    spec = METRICS[heat.metric]
    if not rows:
        return empty_figure("No layer has this metric: nothing of the model was measured yet.", 260)
    if not heat.steps:
        return empty_figure(f"No {spec.label} recorded yet.", 260)
    layout = _base(None, 80 + ROW_PX * len(rows), uirevision)
    layout.update(hovermode="closest", margin={"l": 12, "r": 24, "t": 16, "b": 48})
    # one column per recorded step, all alike wide (a numeric axis would stretch a lone sample over the gap
    # before the next), labelled with the real step numbers
    layout["xaxis"] = _axis(title={"text": "step"}, type="category", showgrid=False, nticks=12)
    layout["yaxis"] = _axis(type="category", autorange="reversed", showgrid=False, automargin=True,
                            tickfont={"family": "ui-monospace, SFMono-Regular, Menlo, monospace", "size": 11})
    trace = {"type": "heatmap", "x": list(heat.steps), "y": [plot_text(r.label) for r in rows], "z": heat.shown(),
             "text": hover_text(heat.values), "xgap": 0, "ygap": 1, "hoverongaps": False,
             "colorbar": {"thickness": 10, "title": {"text": plot_text(colour_title(heat.metric)), "side": "right"}},
             "hovertemplate": f"%{{y}}<br>step %{{x}}<br>{plot_text(spec.label)} %{{text}}<extra></extra>",
             **colour_spec(heat.metric)}
    return {"data": [trace], "layout": layout}


def layer_lines_figure(rows: Sequence[LayerRow], heat: LayerHeat, picked: Sequence[str], uirevision: object) -> Figure:
    """The picked layers' values over the steps, one line each (a log axis where the metric spans decades; the
    update-to-data ratio with its 1e-3 guide)."""
    spec = METRICS[heat.metric]
    index = {r.key: i for i, r in enumerate(rows)}
    chosen = [k for k in picked if k in index]
    if not chosen or not heat.steps:
        return empty_figure("Pick layers to plot." if heat.steps else f"No {spec.label} recorded yet.", 320)
    layout = _base(None, 360, uirevision)
    layout["hovermode"] = "x unified"
    layout["xaxis"] = step_axis(heat.steps)
    ratio = heat.metric == "update_ratio"
    layout["yaxis"]["title"] = {"text": "log10 update/data" if ratio else plot_text(spec.label)}
    layout["legend"] = {"orientation": "v", "x": 1.01, "xanchor": "left", "y": 1, "yanchor": "top"}
    layout["margin"] = {"l": 60, "r": 24, "t": 16, "b": 48}
    if spec.log and not ratio:
        layout["yaxis"]["type"] = "log"
    data = []
    for n, key in enumerate(chosen):
        i = index[key]
        line = points(heat.steps, heat.values[i], heat.metric)
        data.append({"type": "scatter", "x": line.x, "y": line.y, "customdata": line.value,
                     "name": plot_text(rows[i].label), "mode": "lines",
                     "line": {"color": LINE_COLORS[n % len(LINE_COLORS)], "width": 2},
                     "hovertemplate": "%{customdata:.3g}"})
    if ratio:
        guide(layout)
    return {"data": data, "layout": layout}


class Line(NamedTuple):
    """What one line draws: steps, the y it is drawn at, the value it says on hover."""

    x: list[int]
    y: list[float]
    value: list[float]


def points(steps: Sequence[int], values: Sequence[float | None], metric: str) -> Line:
    """The steps with a value: on a log axis the positive ones; the update-to-data ratio as log10 (the way it is
    read against its 1e-3 guide, -3), a zero (a layer that does not update) at the bottom of its scale."""
    spec = METRICS[metric]
    out = Line([], [], [])
    for s, v in zip(steps, values, strict=True):
        if v is None or not math.isfinite(v):
            continue
        if spec.log and (v < 0 or (v == 0 and metric != "update_ratio")):
            continue
        out.x.append(s)
        out.value.append(v)
        out.y.append((math.log10(v) if v > 0 else RATIO_LOG_RANGE[0]) if metric == "update_ratio" else v)
    return out


def guide(layout: dict[str, Any], yref: str = "y") -> None:
    """The update-to-data ratio's guide, log10(1e-3) = -3: a dashed line across the chart, labelled."""
    at = math.log10(GUIDE_RATIO)
    layout.setdefault("shapes", []).append(
        {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": yref, "y0": at, "y1": at,
         "line": {"color": "#9ca3af", "dash": "dash", "width": 1}})
    layout.setdefault("annotations", []).append(
        {"text": "1e-3 guide", "xref": "paper", "x": 1, "xanchor": "right", "yref": yref, "y": at,
         "yanchor": "bottom", "showarrow": False, "font": {"size": 11, "color": "#6b7280"}})


def param_history_figure(history: Sequence[ParamHistory], uirevision: object, height: int = 460) -> Figure:
    """A module's parameters over time: gradient norm (top) and update-to-data ratio with its 1e-3 guide
    (bottom), one line per tensor."""
    if not any(h.has_values() for h in history):
        return empty_figure("No parameter statistics for this module yet.", 200)
    layout = _base(None, height, uirevision)
    layout.update(hovermode="x unified", margin={"l": 60, "r": 28, "t": 32, "b": 44})
    all_steps = [x for h in history for x in (*h.steps, *h.update_steps)]
    layout["xaxis"] = step_axis(all_steps, anchor="y2")
    layout["yaxis"] = _axis(domain=[0.56, 1.0], type="log", anchor="x", title={"text": "grad norm"})
    layout["yaxis2"] = _axis(domain=[0.0, 0.44], anchor="x", title={"text": "log10 update/data"})
    layout["annotations"] = [
        {"text": title, "showarrow": False, "xref": "paper", "yref": "paper", "x": 0, "y": top, "xanchor": "left",
         "yanchor": "bottom", "yshift": 4, "font": {"size": 14}}
        for title, top in (("Gradient norm per parameter", 1.0), ("Update-to-data ratio per parameter", 0.44))]
    data = []
    for n, h in enumerate(history):
        colour = LINE_COLORS[n % len(LINE_COLORS)]
        for key, steps, values, axis, show in (("grad_norm", h.steps, h.grad_norm, "y", True),
                                               ("update_ratio", h.update_steps, h.update_ratio, "y2", False)):
            line = points(steps, values, key)
            data.append({"type": "scatter", "x": line.x, "y": line.y, "customdata": line.value,
                         "name": plot_text(h.name), "legendgroup": h.name, "showlegend": show,
                         "mode": "lines+markers" if len(line.x) < 40 else "lines", "marker": {"size": 4},
                         "line": {"color": colour, "width": 2}, "xaxis": "x", "yaxis": axis,
                         "hovertemplate": "%{customdata:.3g}"})
    guide(layout, "y2")
    return {"data": data, "layout": layout}
