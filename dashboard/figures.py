"""Figure builders: pure functions from plain data (dicts/lists from dashboard.data) to
plotly figures. No I/O, no state.

Text that comes from user code (module paths, class names) is passed through
``plot_text`` because plotly renders a small HTML subset in titles and labels.
"""

from __future__ import annotations

import html
import math
from typing import Sequence

import plotly.graph_objects as go

SEVERITY_COLORS = {"error": "#d93f3f", "warning": "#e09b0f", "info": "#2f74d0"}
SERIES_COLORS = ("#2f74d0", "#7c4dcc", "#1f9d74", "#d9672b", "#6b7280")
FONT = "Inter, Segoe UI, Roboto, Helvetica, Arial, sans-serif"


def plot_text(text: object) -> str:
    """Escape user text for plotly (which interprets <b>, <br>, <a> in labels)."""
    return html.escape("" if text is None else str(text), quote=True)


def _base(title: str | None, height: int, uirevision: object) -> go.Layout:
    return go.Layout(
        title={"text": title, "x": 0.01, "font": {"size": 14}} if title else None,
        template="plotly_white",
        height=height,
        margin={"l": 52, "r": 16, "t": 36 if title else 12, "b": 56},
        font={"family": FONT, "size": 12, "color": "#1f2937"},
        legend={"orientation": "h", "y": -0.22, "yanchor": "top", "x": 0, "xanchor": "left"},
        uirevision=uirevision,
        hovermode="x unified",
    )


def empty_figure(message: str, height: int = 240) -> go.Figure:
    fig = go.Figure(layout=_base(None, height, "empty"))
    fig.update_layout(xaxis={"visible": False}, yaxis={"visible": False}, hovermode=False,
                      annotations=[{"text": plot_text(message), "showarrow": False,
                                    "font": {"size": 13, "color": "#6b7280"},
                                    "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}])
    return fig


def loss_figure(series: dict, uirevision: object = "loss", height: int = 280) -> go.Figure:
    steps, loss = series.get("step") or [], series.get("loss") or []
    if not steps:
        return empty_figure("No loss recorded yet (pass loss= to watcher.step()).", height)
    fig = go.Figure(layout=_base("Loss", height, uirevision))
    fig.add_trace(go.Scatter(x=list(steps), y=list(loss), mode="lines+markers" if len(steps) < 40 else "lines",
                             name="loss", marker={"size": 4}, line={"color": SERIES_COLORS[0], "width": 2}))
    fig.update_xaxes(title_text="step")
    if all(v is None or v > 0 for v in loss) and _spread(loss) > 100:
        fig.update_yaxes(type="log")
    return fig


def _spread(values: Sequence) -> float:
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return 0.0
    return max(vals) / min(vals)


def _lines(title: str, series: dict, keys: Sequence[tuple[str, str]], uirevision: object,
           height: int, ytitle: str | None = None, yrange=None, log: bool = False) -> go.Figure:
    steps = series.get("step") or []
    fig = go.Figure(layout=_base(title, height, uirevision))
    for i, (key, label) in enumerate(keys):
        fig.add_trace(go.Scatter(x=list(steps), y=list(series.get(key) or []), mode="lines+markers"
                                 if len(steps) < 40 else "lines", name=label,
                                 marker={"size": 4}, line={"color": SERIES_COLORS[i % 5], "width": 2}))
    fig.update_xaxes(title_text="step")
    if steps and max(steps) - min(steps) < 8:
        fig.update_xaxes(dtick=1)
    if ytitle:
        fig.update_yaxes(title_text=ytitle)
    if yrange:
        fig.update_yaxes(range=yrange)
    if log:
        fig.update_yaxes(type="log")
    return fig


def activation_figure(series: dict, uirevision: object, height: int = 240) -> go.Figure:
    if not series.get("step"):
        return empty_figure("No activation samples for this module yet.", height)
    return _lines("Activation mean / std", series, [("mean", "mean"), ("std", "std")], uirevision, height)


def fractions_figure(series: dict, uirevision: object, height: int = 240) -> go.Figure:
    if not series.get("step"):
        return empty_figure("No activation samples for this module yet.", height)
    return _lines("Dead / saturated / zero fraction", series,
                  [("dead_frac", "dead units"), ("sat_frac", "saturated"), ("zero_frac", "zeros")],
                  uirevision, height, yrange=[-0.02, 1.02])


def grad_figure(series: dict, uirevision: object, height: int = 240) -> go.Figure:
    vals = [v for v in (series.get("out_grad_norm") or []) if v is not None]
    if not vals:
        return empty_figure("No output gradients recorded (no backward on sampled steps).", height)
    return _lines("Output grad norm", series, [("out_grad_norm", "‖∂loss/∂output‖")], uirevision,
                  height, log=all(v > 0 for v in vals) and _spread(vals) > 50)


def bin_labels(edges: Sequence[float]) -> list[str]:
    """Labels for HIST_BINS = len(edges) + 1 bins: (-inf, e0), [e0, e1), ..., [e_last, inf)."""
    def f(x: float) -> str:
        return f"{x:g}"
    if not edges:
        return []
    labels = [f"< {f(edges[0])}"]
    for lo, hi in zip(edges[:-1], edges[1:]):
        labels.append("≈ 0" if lo < 0 < hi and abs(lo) <= 1e-6 else f"{f(lo)} … {f(hi)}")
    labels.append(f"≥ {f(edges[-1])}")
    return labels


def heatmap_figure(hist: dict, uirevision: object, height: int = 300) -> go.Figure:
    """Histogram over time: x = step, y = activation bin, colour = share of values."""
    steps, counts = hist.get("step") or [], hist.get("counts") or []
    if not steps:
        return empty_figure("No activation histograms for this module yet.", height)
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
    fig = go.Figure(layout=_base("Activation histogram", height,
                                 uirevision))
    fig.add_trace(go.Heatmap(x=list(steps), y=labels[lo:hi + 1], z=z[lo:hi + 1], colorscale="Viridis",
                             zmin=0, zmax=max(max(r) for r in z) or 1, colorbar={"thickness": 10},
                             hovertemplate="step %{x}<br>%{y}: %{z:.1%}<extra></extra>"))
    fig.update_xaxes(title_text="step")
    fig.update_layout(hovermode="closest", margin={"l": 96})
    return fig


def severity_figure(counts: dict, height: int = 200) -> go.Figure:
    sev = ["error", "warning", "info"]
    fig = go.Figure(layout=_base(None, height, "severity"))
    fig.add_trace(go.Bar(x=[counts.get(s, 0) for s in sev], y=sev, orientation="h",
                         marker={"color": [SEVERITY_COLORS[s] for s in sev]},
                         text=[counts.get(s, 0) for s in sev], textposition="auto"))
    fig.update_layout(hovermode=False, showlegend=False, margin={"l": 70, "t": 8})
    fig.update_yaxes(autorange="reversed")
    return fig


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
