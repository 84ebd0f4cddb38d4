"""Figure builders: pure functions from plain data (dicts/lists from dashboard.read.store) to
plotly figures. No I/O, no state.

Text that comes from user code (module paths, class names) is passed through
``plot_text`` because plotly renders a small HTML subset in titles and labels.
"""

from __future__ import annotations

import html
import itertools
import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

# Figures are plain dicts ({"data": [...], "layout": {...}}), which Dash and plotly.js take as
# they are: building validated plotly.graph_objects figures cost ~20 ms each.
SERIES_COLORS = ("#2f74d0", "#7c4dcc", "#1f9d74", "#d9672b", "#6b7280")
FONT = "Inter, Segoe UI, Roboto, Helvetica, Arial, sans-serif"
GRID = "#eceef2"

Figure = dict[str, Any]     # {"data": [...], "layout": {...}}
Series = Mapping[str, Any]  # plain data from dashboard.read.store: {"step": [...], <key>: [...]}


# plotly.js's mode bar, the same on every chart: no logo, and no "Share chart..." (plotly.js 4's sendChartToCloud, which
# uploads the chart's data, module statistics of the user's training, to Plotly Cloud; a tab stop of every chart too)
REMOVED_MODEBAR_BUTTONS = ("sendChartToCloud",)


def graph_config(**extra: Any) -> dict[str, Any]:
    """The ``config`` of every chart (the pages' ``dcc.Graph`` and the report), plus ``extra``."""
    return {"displaylogo": False, "modeBarButtonsToRemove": list(REMOVED_MODEBAR_BUTTONS), **extra}


def plot_text(text: object) -> str:
    """Escape user text for plotly (which interprets <b>, <br>, <a> in labels)."""
    return html.escape("" if text is None else str(text), quote=True)


def _axis(**kw: Any) -> dict[str, Any]:
    ax = {"gridcolor": GRID, "zeroline": False, "linecolor": "#d1d5db", "showline": True,
          "ticks": "", "automargin": True}
    ax.update(kw)
    return ax


def _base(title: str | None, height: int, uirevision: object) -> dict[str, Any]:
    layout = {
        "height": height,
        "margin": {"l": 52, "r": 28, "t": 36 if title else 12, "b": 40},
        "font": {"family": FONT, "size": 12, "color": "#1f2937"},
        "paper_bgcolor": "#ffffff", "plot_bgcolor": "#ffffff",
        "legend": {"orientation": "h", "y": -0.12, "yanchor": "top", "x": 0, "xanchor": "left"},
        "uirevision": uirevision,
        "hovermode": "x unified",
        "modebar": {"orientation": "v"},        # beside the plot, not over the title
        "xaxis": _axis(),                        # x is the step everywhere (hover says "step")
        "yaxis": _axis(),
        "colorway": list(SERIES_COLORS),
    }
    if title:
        layout["title"] = {"text": title, "x": 0.01, "font": {"size": 14}}
    return layout


SHORT_SPAN = 8          # steps: below it a step axis has one tick per step
MARKERS_BELOW = 40      # points: below it a line is drawn with its markers
LOG_SPREAD = 100        # largest / smallest value: above it (all values positive) a loss axis is log


def whole_steps(axis: dict[str, Any], steps: Sequence[Any]) -> dict[str, Any]:
    """A step axis that labels whole steps only: integer ticks, one per step over a short span (plotly would
    put ticks at 0.5 there); over a longer one plotly's automatic ticks, a handful."""
    return _whole_steps(axis, max(steps) - min(steps) if steps else None)


def _whole_steps(axis: dict[str, Any], span: float | None) -> dict[str, Any]:
    axis["tickformat"] = "d"
    if span is not None and span < SHORT_SPAN:
        axis["dtick"] = 1
    return axis


def empty_figure(message: str, height: int = 240) -> Figure:
    """A chart that says ``message`` instead (wrapped: a plotly annotation is one line, cut at the chart's edges)."""
    layout = _base(None, height, "empty")
    text = "<br>".join(plot_text(line) for line in textwrap.wrap(message, 44) or [""])
    layout.update(xaxis={"visible": False}, yaxis={"visible": False}, hovermode=False,
                  annotations=[{"text": text, "showarrow": False,
                                "font": {"size": 13, "color": "#6b7280"},
                                "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}])
    return {"data": [], "layout": layout}


def _scatter(x: Sequence[Any], y: Sequence[Any], name: str, color: str, n: int) -> dict[str, Any]:
    return {"type": "scatter", "x": list(x), "y": list(y), "name": name,
            "mode": "lines+markers" if n < MARKERS_BELOW else "lines", "marker": {"size": 4},
            "line": {"color": color, "width": 2}}


def series_shape(steps: Sequence[int], values: Sequence[float | None],
                 before: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a step chart's layout depends on, for the points ``steps``/``values`` following those ``before``
    describes (a shape of this function's; None: no points before): the first and last step, the number of
    points, the smallest and largest positive value, whether a value is not positive (or NaN). Plain data, kept
    in a ``dcc.Store`` while a live chart is extended: the shape of the parts is the shape of the whole."""
    positive = [v for v in values if v is not None and v > 0]
    shape: dict[str, Any] = {
        "first": min(steps) if steps else None, "last": max(steps) if steps else None, "points": len(steps),
        "low": min(positive) if positive else None, "high": max(positive) if positive else None,
        "not_positive": any(v is not None and not v > 0 for v in values)}
    if not before:
        return shape

    def pick(key: str, fn: Any) -> Any:
        both = [x for x in (before.get(key), shape[key]) if x is not None]
        return fn(both) if both else None
    return {"first": pick("first", min), "last": pick("last", max),
            "points": int(before.get("points") or 0) + shape["points"],
            "low": pick("low", min), "high": pick("high", max),
            "not_positive": bool(before.get("not_positive")) or shape["not_positive"]}


def loss_look(shape: Mapping[str, Any]) -> dict[str, bool]:
    """The loss chart's layout for data of ``shape`` (:func:`series_shape`): one tick per step (a short span),
    markers (few points), a log axis (positive values spanning more than ``LOG_SPREAD``). A chart extended in
    place keeps its layout: where the look of the extended data differs, the chart is drawn afresh."""
    first, last, low, high = shape.get("first"), shape.get("last"), shape.get("low"), shape.get("high")
    spread = float(high / low) if low and high else 0.0
    return {"step_ticks": first is not None and last is not None and last - first < SHORT_SPAN,
            "markers": int(shape.get("points") or 0) < MARKERS_BELOW,
            "log": not shape.get("not_positive") and spread > LOG_SPREAD}


def loss_figure(series: Series, uirevision: object = "loss", height: int = 280) -> Figure:
    """The loss over the steps; its layout is :func:`loss_look` of the series' shape."""
    steps, loss = series.get("step") or [], series.get("loss") or []
    if not steps:
        # no API named: a run of `modscope run` records the loss itself, and its script calls nothing of modscope
        return empty_figure("No loss recorded yet.", height)
    shape = series_shape(steps, loss)
    layout = _base("Loss", height, uirevision)
    _whole_steps(layout["xaxis"], shape["last"] - shape["first"])
    if loss_look(shape)["log"]:
        layout["yaxis"]["type"] = "log"
    return {"data": [_scatter(steps, loss, "loss", SERIES_COLORS[0], shape["points"])], "layout": layout}


def _spread(values: Sequence[float | None]) -> float:
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return 0.0
    return float(max(vals) / min(vals))


def _lines(title: str, series: Series, keys: Sequence[tuple[str, str]], uirevision: object,
           height: int, ytitle: str | None = None, yrange: Sequence[float] | None = None,
           log: bool = False) -> Figure:
    steps = series.get("step") or []
    layout = _base(title, height, uirevision)
    data = [_scatter(steps, series.get(key) or [], label, SERIES_COLORS[i % 5], len(steps))
            for i, (key, label) in enumerate(keys)]
    whole_steps(layout["xaxis"], steps)
    if ytitle:
        layout["yaxis"]["title"] = {"text": ytitle}
    if yrange:
        layout["yaxis"]["range"] = list(yrange)
    if log:
        layout["yaxis"]["type"] = "log"
    return {"data": data, "layout": layout}


def activation_figure(series: Series, uirevision: object, height: int = 240) -> Figure:
    if not series.get("step"):
        return empty_figure("No activation samples for this module yet.", height)
    return _lines("Activation mean / std", series, [("mean", "mean"), ("std", "std")], uirevision, height)


def fractions_figure(series: Series, uirevision: object, height: int = 240) -> Figure:
    if not series.get("step"):
        return empty_figure("No activation samples for this module yet.", height)
    return _lines("Dead / saturated / zero fraction", series,
                  [("dead_frac", "dead units"), ("sat_frac", "saturated"), ("zero_frac", "zeros")],
                  uirevision, height, yrange=[-0.02, 1.02])


def grad_figure(series: Series, uirevision: object, height: int = 240) -> Figure:
    vals = [v for v in (series.get("out_grad_norm") or []) if v is not None]
    if not vals:
        return empty_figure("No output gradients recorded (no backward on sampled steps).", height)
    return _lines("Output grad norm", series, [("out_grad_norm", "‖∂loss/∂output‖")], uirevision,
                  height, log=all(v > 0 for v in vals) and _spread(vals) > 50)


DETAIL_PANELS = (
    # (title, ((series key, label), ...), y-domain): the order is the order of the traces
    ("Activation mean / std", (("mean", "mean"), ("std", "std")), (0.70, 1.0)),
    ("Fractions of units", (("dead_frac", "dead units"), ("sat_frac", "saturated"),
                            ("zero_frac", "zeros")), (0.35, 0.63)),
    ("Output grad norm", (("out_grad_norm", "‖∂loss/∂output‖"),), (0.0, 0.28)),
)


def detail_series_figure(series: Series, uirevision: object, height: int = 700, *,
                         empty: str = "No activation samples for this module yet.") -> Figure:
    """The module detail's three line charts (activation mean/std, dead/saturated/zero fractions,
    output grad norm) as one figure of three panels sharing the step axis: one plotly draw
    instead of three. Traces in DETAIL_PANELS order; the grad trace only when there are
    gradients (otherwise its panel says why)."""
    steps = series.get("step") or []
    if not steps:
        return empty_figure(empty, height)
    layout = _base(None, height, uirevision)
    layout["margin"] = {"l": 52, "r": 28, "t": 32, "b": 40}
    layout["xaxis"] = whole_steps(_axis(anchor="y3"), steps)
    data, annotations = [], []
    grads = [v for v in (series.get("out_grad_norm") or []) if v is not None]
    for k, (title, keys, domain) in enumerate(DETAIL_PANELS):
        yname, legend = ("yaxis", "legend") if k == 0 else (f"yaxis{k + 1}", f"legend{k + 1}")
        yref = yname.replace("axis", "")
        ax = _axis(domain=list(domain), anchor="x")
        # the title alone above the panel, the legend a column right of the panel (the right margin
        # grows to fit it): a legend above the panel wraps in a narrow chart and covers the title
        annotations.append({"text": title, "showarrow": False, "xref": "paper", "yref": "paper",
                            "x": 0, "y": domain[1], "xanchor": "left", "yanchor": "bottom", "yshift": 4,
                            "font": {"size": 14}})
        layout[legend] = {"orientation": "v", "x": 1.01, "xanchor": "left", "y": domain[1],
                          "yanchor": "top", "bgcolor": "rgba(0,0,0,0)"}
        if k == 1:
            ax["range"] = [-0.02, 1.02]
        if k == 2:
            if not grads:
                ax["visible"] = False
                annotations.append({"text": "No output gradients recorded (no backward on sampled steps).",
                                    "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.5,
                                    "y": sum(domain) / 2, "font": {"size": 13, "color": "#6b7280"}})
                layout[yname] = ax
                continue
            if all(v > 0 for v in grads) and _spread(grads) > 50:
                ax["type"] = "log"
        layout[yname] = ax
        for i, (key, label) in enumerate(keys):
            tr = _scatter(steps, series.get(key) or [], label, SERIES_COLORS[i % 5], len(steps))
            tr.update(xaxis="x", yaxis=yref, legend=legend)
            data.append(tr)
    layout["annotations"] = annotations
    return {"data": data, "layout": layout}


def bin_labels(edges: Sequence[float]) -> list[str]:
    """Labels for HIST_BINS = len(edges) + 1 bins: (-inf, e0), [e0, e1), ..., [e_last, inf)."""
    def f(x: float) -> str:
        return f"{x:g}"
    if not edges:
        return []
    labels = [f"< {f(edges[0])}"]
    for lo, hi in itertools.pairwise(edges):
        labels.append("≈ 0" if lo < 0 < hi and abs(lo) <= 1e-6 else f"{f(lo)} … {f(hi)}")
    labels.append(f"≥ {f(edges[-1])}")
    return labels


def heatmap_figure(hist: Series, uirevision: object, height: int = 300, *,
                   empty: str = "No activation histograms for this module yet.") -> Figure:
    """Histogram over time: x = step, y = activation bin, colour = share of values."""
    steps, counts = hist.get("step") or [], hist.get("counts") or []
    if not steps:
        return empty_figure(empty, height)
    nbins = max(len(c) for c in counts)
    labels = bin_labels(hist.get("edges") or [])
    if len(labels) != nbins:
        labels = [f"bin {i}" for i in range(nbins)]
    z = [[0.0] * len(steps) for _ in range(nbins)]
    for j, col in enumerate(counts):
        total = sum(col) or 1.0
        for i, c in enumerate(col[:nbins]):
            z[i][j] = c / total
    # Drop empty outer bins so the picture uses the space.
    used = [i for i in range(nbins) if any(z[i])]
    lo, hi = (min(used), max(used)) if used else (0, nbins - 1)
    layout = _base("Activation histogram", height, uirevision)
    layout.update(hovermode="closest", margin={"l": 96, "r": 96, "t": 36, "b": 40})
    layout["yaxis"] = _axis(type="category", showgrid=False)
    layout["xaxis"]["showgrid"] = False
    whole_steps(layout["xaxis"], steps)
    trace = {"type": "heatmap", "x": list(steps), "y": labels[lo:hi + 1], "z": z[lo:hi + 1],
             "colorscale": "Viridis", "zmin": 0, "zmax": max(max(r) for r in z) or 1,
             "colorbar": {"thickness": 10},
             "hovertemplate": "step %{x}<br>%{y}: %{z:.1%}<extra></extra>"}
    return {"data": [trace], "layout": layout}


def fmt_num(x: object, digits: int = 3) -> str:
    """Compact number formatting for tables and cards."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == 0:
            return "0"
        if abs(x) >= 1e4 or abs(x) < 1e-3:
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}"
    return str(x)


def fmt_count(n: object) -> str:
    if not isinstance(n, (int, float)) or n is None:
        return "–"
    n = float(n)
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{int(n):,}"
