"""Overview: run identity, progress, sampling health, root causes by severity, loss curve, and for
a run of several ranks one line per rank (step, step time, overhead, samples stored and dropped, the
writer's state)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

from dash import Dash, Input, Output, Patch, State, dcc, html
from dash.exceptions import PreventUpdate

from probes.schema import ModuleKind, Severity, count_text, display_path

from ...read.shown_text import TITLE_MAX, clip
from ...read.store import RunState
from .. import figures, ids
from ..components import card, consequences_text, details_key, message, name_span, severity_of, severity_pill, table
from ..config import AppConfig
from ..poll import FINISHED, Tick, callback, plural, reads_store, view_of

TOP_FINDINGS = 6


def layout(config: AppConfig) -> html.Div:
    return html.Div([
        html.Div(id=ids.OV_CARDS, className="cards"),
        html.Div(id=ids.OV_RANKS),
        html.Div([
            html.Div([dcc.Graph(id=ids.OV_LOSS, config=figures.graph_config(displayModeBar="hover"),
                                figure=figures.empty_figure("Loading…"))], className="panel grow"),
            html.Div([html.H3("Top findings"), html.Div(id=ids.OV_TOP_FINDINGS)],
                     className="panel side"),
        ], className="row"),
        html.Div(id=ids.OV_ERRORS),
        dcc.Store(id=ids.OV_LOSS_STATE, data=None),
    ], className="overview")


def _when(ts: float | None) -> str | None:
    if not ts:
        return None
    return _dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def overview_cards(ov: Mapping[str, Any], status: str | None = None, samples: str = "") -> list[html.Div]:
    """The cards of the rank shown; the root causes are the run's (merged over its ranks). ``status``:
    the header's words for the writer (``Tick.status``: "running when copied" in a snapshot, "stalled:
    …"); without it, the store's own status. ``samples``: what the steps hold ("12 full samples · 150
    steps with dense series", and when the next full sample is due)."""
    roots = ov.get("root_causes") or ov["findings"]
    total = ov.get("findings_total", sum(ov["findings"].values()))
    mods = ov["modules"]
    params = ov.get("params") or {}
    overhead = ov.get("overhead")
    unreg = mods[ModuleKind.UNREGISTERED] + mods[ModuleKind.RUNTIME]
    dropped = ov["samples_dropped"]
    return [
        card("Run", name_span(ov["run_name"]), f"{clip(ov.get('model_class') or '?')} · "
             f"{clip(status or ov.get('status') or 'unknown')}"
             + (f" · rank {ov['rank']} of {ov['world_size']}" if (ov.get("world_size") or 1) > 1 else "")
             + (f" · run {clip(ov['run_id'])}" if ov.get("run_id") else ""), "wide"),
        card("Step", figures.fmt_num(ov.get("step")), plural(ov["steps_recorded"], "step") + " recorded"
             + (f" · updated {_when(ov['updated_at'])}" if ov.get("updated_at") else "")),
        card("Samples stored", figures.fmt_num(ov["samples_stored"]),
             (f"{samples} · " if samples else "") + f"sampling {_sampling(ov.get('sampling'))}", "samples"),
        card("Samples dropped", figures.fmt_num(dropped),
             (f"{plural(ov['write_errors'], 'failed commit')}" if ov.get("write_errors") else "queue full")
             if dropped else "none", "bad" if dropped else ""),
        card("Probe errors", figures.fmt_num(ov["probe_errors"]), "caught inside hooks",
             "bad" if ov["probe_errors"] else ""),
        card("Probe overhead", "–" if overhead is None else f"{overhead * 100:.2f}%", "of training time"),
        card("Modules", f"{mods[ModuleKind.REGISTERED]:,}", (f"{unreg:,} unregistered" if unreg else "all registered")
             + (f" · {ov['modules_removed']:,} removed during the run" if ov.get("modules_removed") else ""),
             "bad" if unreg else ""),
        # every parameter the forward uses: those model.parameters() misses (unregistered) counted, and named apart
        card("Parameters", figures.fmt_count((params.get("total") or 0) + (params.get("unregistered") or 0)),
             (f"{figures.fmt_count(params.get('total'))} registered · "
              f"{figures.fmt_count(params.get('unregistered'))} unregistered (not in model.parameters()) · "
              if params.get("unregistered") else "")
             + f"{figures.fmt_count(params.get('in_optimizer'))} in optimizer",
             "bad" if params.get("unregistered") else ""),
        html.Div([
            html.Div("Root causes", className="card-label"),
            html.Div([dcc.Link(severity_pill(s, plural(roots[s], s.value)), href="/findings", className="plain")
                      for s in Severity], className="card-value sev-row"),
            html.Div(count_text(roots, total - sum(roots.values()))
                     + (f" · {plural(ov['rank_count'], 'rank')}" if ov.get("rank_count", 1) > 1 else ""),
                     className="card-sub findings-count"),
        ], className="card wide"),
    ]


def _sampling(s: object) -> str:
    if isinstance(s, dict):
        every, budget = s.get("every"), s.get("overhead")
        if isinstance(every, int) and not isinstance(every, bool) and every > 0:
            return f"every {plural(every, 'step')}"
        if isinstance(budget, (int, float)) and not isinstance(budget, bool) and 0 < budget <= 1:
            return f"budget {budget * 100:g}%"
    return "unknown" if s is not None else "–"


def top_findings(items: list[dict[str, Any]], total: int | None = None) -> list[Any]:
    """The first root causes (each with how many consequences it explains). Each is a button (nothing
    interactive inside it) that selects its module and opens the Modules page; drawn again on every poll,
    it keeps the focus (``data-focus-key``, assets/modscope.js)."""
    if not items:
        return [message("No active findings.", "ok")]
    out: list[Any] = []
    for f in items[:TOP_FINDINGS]:
        n = len(f.get("consequences") or [])
        path = clip(display_path(f["path"]))
        mid = f.get("module_id")
        parts = [severity_pill(f["severity"], f["code"]),
                 html.Span(path, className="mono path", title=clip(display_path(f["path"]), TITLE_MAX)),
                 html.Span(f"+ {consequences_text(n)}", className="muted small") if n else None]
        cls = f"top-finding sev-border-{severity_of(f['severity']).value}"
        if mid is None:       # nothing to open
            out.append(html.Div(parts, className=cls, title=path))
            continue
        name = f"{clip(f['code'])} at {path}" + (f", {consequences_text(n)}" if n else "") + ": show this module"
        out.append(html.Button(parts, className=f"{cls} clickable", title=f"show module {path}",
                               **{"data-focus-key": details_key("top", f)},
                               **ids.button_attrs(ids.ClickAction.OPEN, int(mid), name)))
    total = len(items) if total is None else total
    if total > TOP_FINDINGS:
        out.append(dcc.Link(f"all {total:,} root causes →", href="/findings", className="more"))
    return out


def rank_table(rows: list[dict[str, Any]]) -> html.Div | None:
    """One line per rank: step, median step time of the recent steps, overhead, samples stored and
    dropped, failed commits, host, and the writer's state (a rank that stalled or ended is marked)."""
    if len(rows) < 2:
        return None
    body = []
    for r in rows:
        bad = r["state"] in (RunState.STALLED, RunState.ENDED)
        body.append([
            html.Td(f"rank {r['rank']}", className="mono"),
            r["step"], r["median_step_ms"],
            "–" if r["overhead"] is None else f"{r['overhead'] * 100:.2f}%",
            r["samples_stored"],
            html.Td(figures.fmt_num(r["samples_dropped"]), className="num bad" if r["samples_dropped"] else "num"),
            html.Td(figures.fmt_num(r["write_errors"]), className="num bad" if r["write_errors"] else "num"),
            html.Td(clip(r.get("hostname") or "–"), className="mono"),
            html.Td(r["status_text"], className="bad" if bad else ""),
        ])
    return html.Div([html.H3(f"Ranks ({len(rows)})"), table(
        ["rank", "step", "step time (ms, median)", "overhead", "samples stored", "samples dropped",
         "failed commits", "host", "status"], body, "ranks-table")], className="panel", id="ranks-panel")


def probe_errors_block(errs: list[dict[str, Any]]) -> html.Div | None:
    if not errs:
        return None
    return html.Div([html.H3("Probe errors (caught, training unaffected)"), table(
        ["where", "error", "message", "count", "first step", "last step"],
        [[e["location"], e["error_type"], e["message"], e["count"], e["first_step"], e["last_step"]]
         for e in errs])], className="panel")


def register(app: Dash, config: AppConfig) -> None:
    source = config.source

    @callback(app, Output(ids.OV_CARDS, "children"), Output(ids.OV_TOP_FINDINGS, "children"),
                  Output(ids.OV_ERRORS, "children"), Output(ids.OV_RANKS, "children"),
                  Input(ids.TICK, "data"))
    @reads_store(source, waiting=lambda text: ([message(text, "wait")], [], None, None),
                 failed=lambda text: ([message(text, "bad")], [], None, None))
    def update_cards(tick: Tick) -> tuple[Any, ...]:
        run, rank = view_of(config, tick)
        ov = run.overview(rank)
        roots = run.folded_findings(active=True, rank=rank)
        store = run.at(rank)
        errs = store.probe_errors(rank) if ov["probe_errors"] else []
        rows = run.rank_rows() if ov["rank_count"] > 1 else []
        samples = " · ".join(x for x in (store.step_counts(rank).text(), tick.next_sample) if x)
        status = FINISHED if tick.finished else tick.status
        return overview_cards(ov, status, samples), top_findings(roots), probe_errors_block(errs), rank_table(rows)

    @callback(app, Output(ids.OV_LOSS, "figure"), Output(ids.OV_LOSS_STATE, "data"),
                  Input(ids.TICK, "data"), State(ids.OV_LOSS_STATE, "data"))
    @reads_store(source, waiting=lambda text: (figures.empty_figure(text), None),
                 failed=lambda text: (figures.empty_figure(text), None))
    def update_loss(tick: Tick, state: dict[str, Any] | None) -> tuple[Any, Any]:
        """The loss of the rank shown: extended in place while the same run and rank are shown."""
        run, rank = view_of(config, tick)
        store = run.at(rank)
        view = [run.key, rank]
        if state and state.get("view") == view and state.get("has_data") and state.get("last") is not None:
            extended = extend_loss(state, store.loss_series(rank, since_step=state["last"]))
            if extended is not None:
                return extended
        return draw_loss(store.loss_series(rank), view)


def draw_loss(series: Mapping[str, Any], view: list[Any]) -> tuple[figures.Figure, dict[str, Any]]:
    """The loss chart of ``series`` (the rank's whole loss, as loaded fresh) and the state its live
    extension starts from: the view it shows, the last step read, the shape of its data."""
    fig = figures.loss_figure(series, uirevision=f"loss-{view[0]}-{view[1]}")
    return fig, {"view": view, "last": series["last"], "has_data": bool(series["step"]),
                 "shape": figures.series_shape(series["step"], series["loss"])}


def extend_loss(state: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[Patch, dict[str, Any]] | None:
    """The loss chart extended in place by the steps of ``new`` (its layout, and so the zoom, stays), and the
    state after it; None where the layout must change (:func:`figures.loss_look`: the axis past a short span
    of steps, no markers past a few points, a log axis), so that the chart is drawn afresh: a chart opened
    at step 0 and left open through a long run ends as the chart loaded at the end. Nothing new: no update."""
    if not new["step"]:
        raise PreventUpdate
    before = state.get("shape")
    shape = figures.series_shape(new["step"], new["loss"], before)
    if not before or figures.loss_look(shape) != figures.loss_look(before):
        return None
    patch = Patch()
    patch["data"][0]["x"].extend(new["step"])
    patch["data"][0]["y"].extend(new["loss"])
    return patch, {**state, "last": new["last"], "shape": shape}
